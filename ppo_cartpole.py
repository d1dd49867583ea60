"""PPO for games with vector observations and discrete actions (CartPole and friends), in one file.

Proximal Policy Optimization (Schulman et al., 2017: "PPO paper") with the details of CleanRL and
SB3 ("The 37 Implementation Details of PPO", Huang et al., 2022: "37 details") named where used.

The idea. Policy gradient improves a policy with games it just played, and can use each batch of
them only once: afterwards the policy has changed. PPO reuses each batch ("rollout") for several
epochs of minibatch steps, and keeps the new policy near the one that played by clipping the
probability ratio rho_t = pi(a_t | s_t) / pi_old(a_t | s_t) (`Trainer.ppo_loss` derives it):
L_clip = mean_t min(rho_t A_t, clip(rho_t, 1 - eps, 1 + eps) A_t). The advantage A_t (how much
better a_t did than the value V(s_t) expected) comes from the rewards r_t by GAE (`compute_gae`).

Run it:         python ppo_cartpole.py            (CartPole-v1; --help lists every flag)
On N GPUs:      torchrun --standalone --nproc_per_node N ppo_cartpole.py   (data parallel: `Ranks`)
In a notebook:  Main(Config(total_timesteps=50_000)).run() (imported, or pasted down to the banner)
"""

import argparse
import contextlib
import dataclasses
import difflib
import math
import multiprocessing
import time
import typing
from collections import deque
from typing import Optional

SCRIPT = "ppo_cartpole"


def option(default, help, check=None):  # a Config field, its --help line, its valid range
    return dataclasses.field(default=default, metadata={"help": help, "check": check})


# A Config field left at None takes its env's preset (CartPole-v1's wins the race to solve it) or,
# for an env without one or with --no-preset, the general setting, which learns every game this
# script is for: LunarLander, Acrobot, MountainCar (benchmarks/README.md, "beyond_default_env.py").
PRESET_FIELDS = ("learning_rate", "gamma", "num_minibatches", "update_epochs", "ent_coef",
                 "normalize_observations", "num_envs", "num_steps")
GENERAL_SETTING = dict(zip(PRESET_FIELDS, (3e-4, 0.99, 32, 10, 0.0, True, 16, 128)))
PRESETS = {"CartPole-v1": dict(zip(PRESET_FIELDS, (8e-3, 0.98, 2, 8, 0.0, False, 64, 32)))}


@dataclasses.dataclass
class Config:
    """Every setting, each a flag (num_envs: --num-envs). None: the env's preset (just above)."""

    # PPO's hyperparameters.
    learning_rate: Optional[float] = option(None, "Adam's step size, annealed linearly to 0", "> 0")
    anneal_lr: bool = option(True, "anneal the learning rate linearly to 0 over the run")
    gamma: Optional[float] = option(None, "discount: looks ~1 / (1 - gamma) steps ahead", "(0, 1]")
    gae_lambda: float = option(0.95, "GAE: bias (0) vs variance (1) of the advantage", "[0, 1]")
    num_minibatches: Optional[int] = option(None, "minibatches each rollout is split into", "> 0")
    update_epochs: Optional[int] = option(None, "passes over each rollout", "> 0")
    clip_coef: float = option(0.2, "PPO's clip range for the probability ratio", "> 0")
    clip_value_loss: bool = option(False, "clip the value update too (off: slower on CartPole)")
    ent_coef: Optional[float] = option(None, "weight of the entropy bonus", ">= 0")
    vf_coef: float = option(0.5, "weight of the value loss", ">= 0")
    max_grad_norm: float = option(0.5, "clip the global gradient norm to this", "> 0")
    target_kl: Optional[float] = option(None, "stop an update's epochs at this approx KL", "> 0")
    hidden_size: int = option(64, "units in each of the two hidden layers of both MLPs", "> 0")
    normalize_observations: Optional[bool] = option(None, "normalise observations by running stats")
    obs_clip: float = option(10.0, "clip normalised observations to +-this", "> 0")

    # Collecting experience.
    env: str = option("CartPole-v1", "gymnasium id: vector observations, discrete actions")
    preset: bool = option(True, "the env's preset where it has one (off: the general setting)")
    num_envs: Optional[int] = option(None, "games played side by side (by each rank)", "> 0")
    # 0: stepping 64 vectorised poles takes less time than a pipe round trip to a child process.
    num_workers: int = option(0, "child processes that run the games (0 = in this process)", ">= 0")
    num_steps: Optional[int] = option(None, "steps per game in each rollout", "> 0")

    # The run.
    seed: int = option(1, "seeds everything; env i of rank r gets seed + r * num_envs + i", ">= 0")
    total_timesteps: int = option(200_000, "environment steps over all envs (and all ranks)", "> 0")
    device: str = option("auto", "auto | cpu | cuda: auto takes CUDA when present")
    run_dir: Optional[str] = option(None, "logs, checkpoint, summary (None: a new folder in runs/)")
    overwrite: bool = option(False, "replace the run already in --run-dir instead of refusing")
    target_return: Optional[float] = option(None, "stop at this mean return of 100 episodes")
    checkpoint_every: int = option(100_000, "save a checkpoint every this many steps", "> 0")
    resume: Optional[str] = option(None, "continue training from this checkpoint or run folder")
    eval: Optional[str] = option(None, "play --eval-episodes games with this checkpoint or run")
    eval_episodes: int = option(10, "games played by --eval", "> 0")
    greedy: bool = option(False, "with --eval, take the most likely action instead of sampling")
    video: bool = option(False, "with --eval, write an mp4 of the games into the run dir")
    compile: bool = option(False, "torch.compile (off: it takes longer than solving CartPole)")
    env_backend: str = option("vector", "vector (gymnasium's CartPole) | game (the lesson's Game)")


def with_preset(config: Config) -> Config:
    """The config with each field left at None set to its env's preset (or the general setting)."""
    settings = PRESETS.get(config.env, GENERAL_SETTING) if config.preset else GENERAL_SETTING
    return dataclasses.replace(config, **{name: value for name, value in settings.items()
                                          if getattr(config, name) is None})


def parse_config(argv=None) -> Config:
    """A flag per Config field, read before torch is imported (2 s): --help answers at once."""
    flags = {"--" + f.name.replace("_", "-"): f for f in dataclasses.fields(Config)}

    def refuse(message: str):
        typed = [word for word in message.split() if word.startswith("--")]
        close = difflib.get_close_matches(typed[0], flags, n=1) if typed else []
        hint = f"; did you mean {close[0]}?" if close and "unrecognized" in message else ""
        parser.exit(2, f"error: {message}{hint}\n")

    def whole_number(text: str) -> int:  # 1e6 and 1_000_000 are whole numbers too
        with contextlib.suppress(ValueError):
            if (number := float(text.replace("_", ""))).is_integer():
                return int(number)
        raise argparse.ArgumentTypeError(f"expected a whole number, not {text!r}")

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.error = refuse
    for flag, f in flags.items():
        kind = next(t for t in (bool, int, float, str) if t in (f.type, *typing.get_args(f.type)))
        line, default = f.metadata["help"], f.default
        line += f" (valid: {f.metadata['check']})" if f.metadata["check"] else ""
        if f.name in PRESET_FIELDS:  # its value by env (Config keeps None; --help adds no default)
            by_env = [f"{env} {settings[f.name]}" for env, settings in PRESETS.items()]
            line += f" (default: {', '.join(by_env)}, other envs {GENERAL_SETTING[f.name]})"
            default = argparse.SUPPRESS
        parser.add_argument(flag, default=default, help=line,
                            **({"action": argparse.BooleanOptionalAction} if kind is bool else
                               {"type": whole_number if kind is int else kind}))
    return Config(**vars(parser.parse_args(argv)))


if __name__ == "__main__" and "__file__" in globals():
    parse_config()  # --help and a mistyped flag answer here; `command_line` (the end) runs it all


import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn


class Game:
    """One gymnasium env as PPO sees it: flat float32 observations, an action as an index per
    dimension from 0. An ended episode restarts in the same step: `step` returns the new one's first
    observation; in `info`, the ended one's last ("final_obs") and return and length ("episode")."""

    def __init__(self, env_id: str, seed: int, **options):  # options: gym.make's (render_mode)
        self.env = gym.make(env_id, **options)
        self.seed, self.action_space = seed, self.env.action_space

    def reset(self) -> np.ndarray:
        obs, _ = self.env.reset(seed=self.seed)  # seeded once; restarts continue its stream
        self.seed, self.episode_return, self.episode_length = None, 0.0, 0
        return np.asarray(obs, dtype=np.float32).reshape(-1)

    def sizes(self) -> tuple:
        """What the Model is built for: (observation size, choices per action dimension, binary)."""
        space, obs_size = self.action_space, int(np.prod(self.env.observation_space.shape))
        if isinstance(space, gym.spaces.Discrete):
            return obs_size, [int(space.n)], False
        binary = isinstance(space, gym.spaces.MultiBinary)  # else MultiDiscrete
        dims = [2] * int(np.prod(space.shape)) if binary else [int(n) for n in space.nvec.flat]
        return obs_size, dims, binary

    def env_action(self, action: np.ndarray):  # counted from the space's `start` (if it has one)
        if isinstance(space := self.action_space, gym.spaces.Discrete):
            return action[0] + space.start
        return (action.reshape(space.shape) + getattr(space, "start", 0)).astype(space.dtype)

    def step(self, action: np.ndarray):
        obs, reward, terminated, truncated, _ = self.env.step(self.env_action(action))
        self.episode_return += float(reward)
        self.episode_length += 1
        obs, info = np.asarray(obs, dtype=np.float32).reshape(-1), {}
        if terminated or truncated:
            ended = {"return": self.episode_return, "length": self.episode_length}
            info, obs = {"final_obs": obs, "episode": ended}, self.reset()
        return obs, reward, terminated, truncated, info


class StepResult(typing.NamedTuple):
    """What one step of all the games gives the trainer, besides the observations."""

    rewards: np.ndarray  # [num_envs]
    terminated: np.ndarray  # [num_envs] bool: the episode ended in the game (the pole fell)
    truncated: np.ndarray  # [num_envs] bool: a time limit cut the episode
    final_obs: dict  # env index -> the last observation of the episode that ended there
    episodes: dict  # env index -> {"return", "length"} of the episode that ended there


class Worker:
    """Plays several Games in a child process (beside the trainer): actions go down a pipe, the
    rest comes back; observations, the one large array, skip the pipe (shared memory: obs_view)."""

    def __init__(self, index: int, env_id: str, seed: int, obs_view: np.ndarray):
        self.index, self.env_id, self.obs_view = index, env_id, obs_view
        self.trainer_end, child_end = multiprocessing.Pipe()
        self.process = multiprocessing.get_context("fork").Process(
            target=self.child_loop, args=(child_end, env_id, seed, obs_view),
            name=f"{SCRIPT}-worker-{index}", daemon=True)
        self.process.start()
        child_end.close()
        self.receive()  # the child's first answer comes once its Games are reset

    def start_games(self, env_id: str, seed: int, obs_view: np.ndarray) -> list:
        games = [Game(env_id, seed + i) for i in range(len(obs_view))]  # game i: seed + i
        obs_view[:] = [game.reset() for game in games]
        return games

    @staticmethod
    def step_games(games: list, actions: np.ndarray, obs_out: np.ndarray) -> tuple:
        """Step each Game, observations into obs_out; the rest as StepResult's fields."""
        rewards, final_obs, episodes = np.zeros(len(games), dtype=np.float32), {}, {}
        terminated, truncated = np.zeros(len(games), bool), np.zeros(len(games), bool)
        for i, game in enumerate(games):
            obs_out[i], rewards[i], terminated[i], truncated[i], info = game.step(actions[i])
            if "episode" in info:
                final_obs[i], episodes[i] = info["final_obs"], info["episode"]
        return rewards, terminated, truncated, final_obs, episodes

    def child_loop(self, conn, env_id: str, seed: int, obs_view: np.ndarray):  # in the child
        games = self.start_games(env_id, seed, obs_view)
        conn.send(("ok", None))
        while (command := conn.recv())[0] == "step":
            conn.send(("ok", self.step_games(games, command[1], obs_view)))

    def step(self, actions: np.ndarray) -> StepResult:  # step_games' answer, from the child
        self.trainer_end.send(("step", actions))
        return StepResult(*self.receive())

    def receive(self) -> tuple:  # the child's answer (observations: in obs_view)
        return self.trainer_end.recv()[1]

    def observations(self) -> torch.Tensor:  # the Games' current observations (shared memory)
        return torch.from_numpy(self.obs_view)

    def close(self):
        self.trainer_end.send(("close", None))
        self.process.join()


class RunningMeanStd(nn.Module):
    """Each observation entry's count, mean and variance over all seen (float64), to normalise what
    the policy sees (37 details, continuous-action #6-#7: MountainCar's velocity is 20 times smaller
    than its position). A batch merges in by Chan et al.'s formula (1979), exact for any split
    (n = n_a + n_b, delta = mean_b - mean_a): mean = mean_a + delta n_b / n,
    var = (var_a n_a + var_b n_b + delta^2 n_a n_b / n) / n. Inactive: a pass-through."""

    def __init__(self, shape: tuple, active: bool = True):
        super().__init__()
        self.active, float64 = active, torch.float64
        self.register_buffer("mean", torch.zeros(shape, dtype=float64), persistent=False)
        self.register_buffer("var", torch.ones(shape, dtype=float64), persistent=False)
        self.register_buffer("count", torch.tensor(1e-4, dtype=float64), persistent=False)

    def update(self, batch: torch.Tensor):  # a batch [n, *shape] of numbers
        var, mean = torch.var_mean(batch.to(torch.float64), dim=0, correction=0)
        self.merge(float(len(batch)), mean, var)

    def merge(self, count: float, mean: torch.Tensor, var: torch.Tensor):  # in place
        total = self.count + count  # (a tensor: addcmul_ is add_ by alpha, without a GPU sync)
        delta = mean - self.mean
        self.var.mul_(self.count / total).addcmul_(var, count / total)
        self.var.addcmul_(delta.square(), self.count * count / total ** 2)
        self.mean.addcmul_(delta, count / total)
        self.count.copy_(total)

    def normalize(self, obs: torch.Tensor, clip: float, update: bool = True) -> torch.Tensor:
        """(obs - mean) / std, this batch included (`update`); then clipped to [-clip, clip]."""
        if not self.active:
            return obs
        if update:
            self.update(obs)
        return ((obs - self.mean) / (self.var + 1e-8).sqrt()).clamp(-clip, clip).to(torch.float32)


def layer(in_size: int, out_size: int, gain: float = math.sqrt(2)) -> nn.Linear:
    """Orthogonal weights of the given gain, zero biases (37 details, #2: sqrt(2) for hidden layers,
    0.01 for the policy output so that all actions start equally likely, 1 for the value)."""
    linear = nn.Linear(in_size, out_size)
    nn.init.orthogonal_(linear.weight, gain)
    nn.init.zeros_(linear.bias)
    return linear


class Model(nn.Module):
    """The actor-critic: separate policy and value MLPs, 64-64 tanh (37 details, #13). An action of
    several dimensions (MultiDiscrete, MultiBinary) has a categorical per dimension, and its
    log-probability (entropy) is the sum over them (37 details, #23). A binary dimension with logit
    l is a categorical over {0, 1} with logits (0, l); dimensions with fewer choices than the
    largest are padded with logits of -1e9 (probability 0; 0 * log-probability stays 0). It holds
    the running statistics of the observations: they are the policy's too."""

    def __init__(self, obs_size: int, action_dims: list, binary: bool, hidden_size: int = 64,
                 normalize_observations: bool = False):
        super().__init__()
        self.action_dims, self.binary, self.num_choices = action_dims, binary, max(action_dims)
        outputs = len(self.action_dims) if binary else len(self.action_dims) * self.num_choices
        mlp = lambda out_size, gain: nn.Sequential(  # two tanh hidden layers, then the output
            layer(obs_size, hidden_size), nn.Tanh(), layer(hidden_size, hidden_size), nn.Tanh(),
            layer(hidden_size, out_size, gain=gain))
        self.critic, self.actor = mlp(1, 1.0), mlp(outputs, 0.01)
        self.obs_stats = RunningMeanStd((obs_size,), active=normalize_observations)
        padding = [[0.0] * n + [-1e9] * (self.num_choices - n) for n in self.action_dims]
        self.register_buffer("logit_padding", torch.tensor(padding))

    def value(self, obs: torch.Tensor) -> torch.Tensor:  # V(s), [batch]
        return self.critic(obs).squeeze(-1)

    def logits(self, obs: torch.Tensor) -> torch.Tensor:  # [batch, dims, choices]
        out = self.actor(obs)
        if self.binary:
            return torch.stack([torch.zeros_like(out), out], dim=-1)
        return out.view(-1, len(self.action_dims), self.num_choices) + self.logit_padding

    def act(self, obs: torch.Tensor, greedy: bool = False):
        """Actions [batch, dims] for observations, their log-probabilities, the values."""
        log_probs = torch.log_softmax(self.logits(obs), dim=-1)
        actions = log_probs.argmax(-1) if greedy else torch.multinomial(  # a draw per dimension
            log_probs.exp().view(-1, self.num_choices), 1).view(log_probs.shape[:-1])
        log_prob = log_probs.gather(-1, actions.unsqueeze(-1)).sum((-1, -2))
        return actions, log_prob, self.value(obs)

    def evaluate_actions(self, obs: torch.Tensor, actions: torch.Tensor):
        """For the loss: log pi_theta of the taken actions, the policy's entropy, V; [batch]."""
        log_probs = torch.log_softmax(self.logits(obs), dim=-1)
        log_prob = log_probs.gather(-1, actions.unsqueeze(-1)).sum((-1, -2))
        entropy = -(log_probs.exp() * log_probs).sum((-1, -2))
        return log_prob, entropy, self.value(obs)


def compute_gae(rewards, values, dones, last_value, gamma: float, gae_lambda: float):
    """Generalized Advantage Estimation (Schulman et al., 2016; PPO paper, eq. 11-12).
    rewards, values, dones: [T, N] (time, env); last_value: [N], V(s_T). The advantages: [T, N].

    The advantage A_t = Q(s_t, a_t) - V(s_t) says how much better action a_t did than the critic
    expected. With the TD error delta_t = r_t + gamma V(s_(t+1)) - V(s_t), the k-step estimators

        A_t^(k) = sum_(l<k) gamma^l delta_(t+l)
                = sum_(l<k) gamma^l r_(t+l) + gamma^k V(s_(t+k)) - V(s_t)

    trade bias for variance: few steps lean on V (biased wherever V is wrong), many on the sampled
    rewards (unbiased, but each adds its randomness). GAE averages all of them with weights
    (1 - lambda) lambda^(k-1); the sum telescopes into discounted TD errors, computed backwards:

        $\\hat{A}_t = \\sum_l (\\gamma\\lambda)^l \\delta_{t+l}
                  = \\delta_t + \\gamma\\lambda (1 - d_t) \\hat{A}_{t+1}$

    lambda = 0 is the one-step estimate, lambda = 1 the sampled return minus V(s_t). `dones[t] = 1`
    (d_t) when the episode ended at step t (after action t) by termination or truncation: the sum
    stops there; a truncation's gamma * V(final observation) is already in rewards[t]. (CleanRL's
    `dones[t]` means "obs[t] starts a new episode", one step later; the advantages are the same.)
    """
    advantages = torch.zeros_like(rewards)
    next_advantage, next_value = torch.zeros_like(last_value), last_value
    for t in reversed(range(rewards.shape[0])):
        not_done = 1.0 - dones[t]
        delta = rewards[t] + gamma * next_value * not_done - values[t]
        next_advantage = delta + gamma * gae_lambda * not_done * next_advantage
        advantages[t], next_value = next_advantage, values[t]
    return advantages


class Minibatch(typing.NamedTuple):
    """A shuffled slice of the rollout, one row per step: what the Trainer learns from."""

    obs: torch.Tensor  # [batch, obs_size], as the policy saw them
    actions: torch.Tensor  # [batch, dims], the actions it took
    old_log_probs: torch.Tensor  # their log-probabilities then
    advantages: torch.Tensor  # from GAE
    returns: torch.Tensor  # the value targets: advantages + old values
    old_values: torch.Tensor  # the values then


class Rollout:
    """What the current policy saw, did and got: [num_steps, num_envs, ...], on the device."""

    def __init__(self, config: Config, obs_size: int, num_dims: int, device: torch.device):
        shape = (config.num_steps, config.num_envs)
        self.obs = torch.zeros(shape + (obs_size,), device=device)
        self.actions = torch.zeros(shape + (num_dims,), dtype=torch.long, device=device)
        self.log_probs, self.values, self.rewards, self.dones = (
            torch.zeros(shape, device=device) for _ in range(4))

    def minibatch(self, indices: torch.Tensor, advantages, returns) -> Minibatch:
        """The rows of flat indices (step * num_envs + env)."""
        return Minibatch(self.obs.flatten(0, 1)[indices], self.actions.flatten(0, 1)[indices],
                         self.log_probs.flatten()[indices], advantages.flatten()[indices],
                         returns.flatten()[indices], self.values.flatten()[indices])


class Trainer:
    """One PPO step on a minibatch: clipped surrogate, value loss, entropy bonus, gradient clip."""

    def __init__(self, model: Model, config: Config, optimizer: type = torch.optim.Adam):
        self.model, self.config = model, config
        # Adam with eps 1e-5, not 1e-8 (37 details, #3).
        self.optimizer = optimizer(model.parameters(), lr=config.learning_rate, eps=1e-5)
        self.average_gradients = lambda parameters: None  # torchrun's hook (see gradient_step)

    @staticmethod
    def ppo_loss(minibatch: Minibatch, new_log_probs, entropy, new_values, config: Config):
        """The negated PPO objective of a minibatch (to be minimised) and its diagnostics.

        Why a ratio: the samples were drawn by pi_old, the policy that played the rollout, but the
        gradient should raise E_{a ~ pi_theta}[A]. Importance sampling reweights each sample by
        rho_t = pi_theta(a_t|s_t) / pi_old(a_t|s_t): E_{pi_theta}[A] = E_{pi_old}[rho_t A_t]. At
        theta = theta_old its gradient is the plain policy gradient; further away it lets one
        rollout serve several epochs, but the estimate worsens as the policies part (other states
        would be visited; rho_t's variance grows). Why clip: TRPO bounds the move with a KL
        constraint; PPO (paper, eq. 7) stops rewarding it beyond [1 - eps, 1 + eps]:

            L_clip = E_t[ min(rho_t A_t, clip(rho_t, 1 - eps, 1 + eps) A_t) ]

        Once rho_t is out of range in the helpful direction (rho_t > 1 + eps with A_t > 0, or
        rho_t < 1 - eps with A_t < 0), the clipped term is constant: no gradient, the sample stops
        pulling. Why the minimum: it makes L_clip a pessimistic bound, so that a move that made
        things worse (rho_t < 1 - eps with A_t > 0) is never hidden: the unclipped term is then the
        smaller one, and its gradient pulls back.
        """
        advantages = minibatch.advantages  # normalised per minibatch (37 details, #7)
        advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
        # The clipped surrogate (37 details, #8), negated: the max of the negations is the min.
        log_ratio = new_log_probs - minibatch.old_log_probs
        ratio = log_ratio.exp()
        clipped_ratio = ratio.clamp(1 - config.clip_coef, 1 + config.clip_coef)
        policy_loss = torch.max(-advantages * ratio, -advantages * clipped_ratio).mean()
        # Value loss (37 details, #9): squared error to the returns, optionally clipped like rho_t.
        returns, old_values, clip = minibatch.returns, minibatch.old_values, config.clip_coef
        squared_error = (new_values - returns) ** 2
        if config.clip_value_loss:
            clipped = old_values + (new_values - old_values).clamp(-clip, clip)
            squared_error = torch.max(squared_error, (clipped - returns) ** 2)
        value_loss = 0.5 * squared_error.mean()
        # Entropy bonus (37 details, #10): rewards a spread-out policy, which keeps exploring.
        entropy_mean = entropy.mean()
        loss = policy_loss - config.ent_coef * entropy_mean + config.vf_coef * value_loss
        # Diagnostics (37 details, #12): approx KL by the low-variance (rho - 1) - log rho
        # (Schulman, "Approximating KL divergence", 2020), and the share the clip touched.
        with torch.no_grad():
            approx_kl = ((ratio - 1) - log_ratio).mean()
            clip_fraction = ((ratio - 1).abs() > config.clip_coef).float().mean()
        stats = {"policy_loss": policy_loss, "value_loss": value_loss, "entropy": entropy_mean,
                 "approx_kl": approx_kl, "clip_fraction": clip_fraction}
        return loss, stats

    def compute_loss(self, minibatch: Minibatch):  # under the current weights (--compile's part)
        evaluated = self.model.evaluate_actions(minibatch.obs, minibatch.actions)  # log pi, H, V
        return self.ppo_loss(minibatch, *evaluated, self.config)

    def gradient_step(self, minibatch: Minibatch) -> dict:
        """Loss, backward, the ranks' mean gradient (torchrun), norm clip, Adam; the diagnostics."""
        loss, stats = self.compute_loss(minibatch)
        self.optimizer.zero_grad()
        loss.backward()
        self.average_gradients(self.model.parameters())  # hook: under torchrun, the ranks' mean
        # Global gradient clipping (37 details, #11): all gradients scaled to norm <= max_grad_norm.
        stats["grad_norm"] = nn.utils.clip_grad_norm_(self.model.parameters(),
                                                      self.config.max_grad_norm)
        self.optimizer.step()
        return stats


class Run:
    """The plain run `Main.train` talks to: seeds, device, sizes, the games, progress, summary.
    `RunGuard`, below the banner, extends it: Ctrl-C, checkpoints, NaN guard, torchrun, engines."""

    def __init__(self, main: "Main"):
        self.main, self.config, self.games, self.summary = main, main.config, None, None
        self.returns, self.updates, self.solved_step = deque(maxlen=100), 0, None

    def __enter__(self) -> "Run":
        """The env's preset; seed torch's draws (sampling, shuffling); the device; the sizes."""
        config = self.config = self.main.config = with_preset(self.config)
        self.start_time = time.perf_counter()
        torch.manual_seed(config.seed)
        cuda = config.device != "cpu" and torch.cuda.is_available()
        self.device, self.steps_per_step = torch.device("cuda" if cuda else "cpu"), config.num_envs
        game = Game(config.env, config.seed)
        self.obs_size, self.action_dims, self.binary = game.sizes()
        game.env.close()
        return self

    prepare_learner = lambda self: 0  # the step to start from (RunGuard's: --resume's)
    stop_at_once = lambda self: False  # end the rollout now (RunGuard's: after Ctrl-C)
    mean = lambda self, value: value  # a number's mean over the ranks (RunGuard's: torchrun)
    optimizer = torch.optim.Adam  # the Trainer's (RunGuard's: a copy, the same steps, 2 s sooner)

    def start_games(self) -> Worker:
        """All the games in one Worker, game i seeded with seed + i (RunGuard's: --num-workers)."""
        obs = torch.zeros(self.config.num_envs, self.obs_size).share_memory_()
        self.games = Worker(0, self.config.env, self.config.seed, obs.numpy())
        return self.games

    def after_rollout(self, ended: list):
        """Record the (global step, episode) of the episodes that ended; note the target."""
        target = self.config.target_return
        for step, episode in ended:
            self.returns.append(episode["return"])
            if (target is not None and self.solved_step is None and len(self.returns) == 100
                    and np.mean(self.returns) >= target):
                self.solved_step = step

    def after_update(self, stats: dict):
        """A progress line: the step, the speed, the mean return of the last 100 episodes."""
        self.updates, step = self.updates + 1, self.main.global_step
        speed, mean = step / (time.perf_counter() - self.start_time), np.mean(self.returns or [0])
        print(f"step {step:,} | {speed:,.0f} steps/s | return {mean:.1f} | updates {self.updates}")

    def __exit__(self, kind, error, traceback):
        """Close the games and keep the summary; an error goes on up."""
        if self.games is not None:
            self.games.close()
        self.summary = {"script": SCRIPT, "env": self.config.env, "steps": self.main.global_step,
                        "mean_return_100": float(np.mean(self.returns)) if self.returns else None,
                        "solved_step": self.solved_step}

    @staticmethod
    def evaluate(config: Config) -> dict:  # --eval: the machinery's (below the banner)
        raise NotImplementedError("--eval plays a checkpoint: the machinery below the banner")


class Main:
    """The loop: `Main(config).run()` trains (or --eval plays) and returns the summary as a dict.
    One iteration (37 details, #6): num_steps steps in every game, GAE, update_epochs passes."""

    def __init__(self, config: Config):  # anneal_from: (step, rate) where annealing starts
        self.config, self.guard = config, None
        self.anneal_from = (0, with_preset(config).learning_rate)

    def run(self) -> dict:
        # The one lookup of the machinery: RunGuard extends Run; cut at the banner, Run runs alone.
        run_class = globals().get("RunGuard", Run)
        return run_class.evaluate(self.config) if self.config.eval else self.train(run_class)

    def train(self, run_class: type) -> dict:
        self.guard = run_class(self)  # the env's preset, seeds, the games, progress, summary
        with self.guard as guard:
            config = self.config  # (with the preset; the checkpoint's settings, when resuming)
            self.model = Model(guard.obs_size, guard.action_dims, guard.binary, config.hidden_size,
                               config.normalize_observations)
            self.trainer = Trainer(self.model.to(guard.device), config, guard.optimizer)
            self.global_step = guard.prepare_learner()  # 0, or --resume's; compile, torchrun
            self.games = guard.start_games()
            self.rollout = Rollout(config, guard.obs_size, len(guard.action_dims), guard.device)
            next_obs = self.model.obs_stats.normalize(self.games.observations().to(guard.device),
                                                      config.obs_clip)
            while self.global_step < config.total_timesteps:
                self.anneal_learning_rate()
                next_obs = self.collect_rollout(next_obs)  # 1. play with the current policy
                if guard.solved_step is not None:
                    break  # the target was reached in this rollout: the policy is good enough
                advantages, returns = self.estimate_advantages(next_obs)  # 2. GAE
                stats = self.learn(advantages, returns)  # 3. epochs of clipped PPO steps
                guard.after_update(stats)  # progress line (RunGuard's: NaN guard, checkpoint)
        return guard.summary

    def anneal_learning_rate(self):
        """Linear annealing (37 details, #4), from learning_rate at step 0 to 0 at the end."""
        start_step, start_rate = self.anneal_from
        progress = (self.global_step - start_step) / (self.config.total_timesteps - start_step)
        rate = start_rate * max(0.0, 1.0 - progress) if self.config.anneal_lr else start_rate
        for group in self.trainer.optimizer.param_groups:
            group["lr"] = rate

    @torch.inference_mode()  # like no_grad, and skips autograd's version counting too: faster
    def collect_rollout(self, next_obs: torch.Tensor) -> torch.Tensor:
        """Play num_steps steps in every game, filling the rollout; returns the next observation."""
        config, rollout, device, ended = self.config, self.rollout, self.guard.device, []
        obs_stats = self.model.obs_stats  # (off: observations pass through as they are)
        for step in range(config.num_steps):
            if self.guard.stop_at_once():  # Ctrl-C
                break
            rollout.obs[step] = next_obs
            actions, rollout.log_probs[step], rollout.values[step] = self.model.act(next_obs)
            rollout.actions[step] = actions
            result = self.games.step(actions.cpu().numpy())
            next_obs = obs_stats.normalize(self.games.observations().to(device), config.obs_clip)
            rewards = torch.from_numpy(result.rewards).to(device)
            # Truncation is not death: an episode cut by a time limit would have gone on, so its
            # last reward gets gamma * V(final obs); done = 1 (either end) keeps GAE in its episode.
            cut = [i for i in result.final_obs if result.truncated[i] and not result.terminated[i]]
            if cut:
                cut_obs = torch.from_numpy(np.stack([result.final_obs[i] for i in cut]))
                cut_obs = obs_stats.normalize(cut_obs.to(device), config.obs_clip, update=False)
                rewards[cut] += config.gamma * self.model.value(cut_obs)
            rollout.rewards[step] = rewards
            rollout.dones[step] = torch.from_numpy(result.terminated | result.truncated).to(device)
            self.global_step += self.guard.steps_per_step  # num_envs of every rank
            ended += [(self.global_step, episode) for episode in result.episodes.values()]
        self.guard.after_rollout(ended)  # record the episodes (RunGuard's: stop on Ctrl-C)
        return next_obs

    @torch.no_grad()
    def estimate_advantages(self, next_obs: torch.Tensor):
        """GAE over the rollout: (advantages, returns), both [num_steps, num_envs]."""
        rollout, config = self.rollout, self.config
        advantages = compute_gae(rollout.rewards, rollout.values, rollout.dones,
                                 self.model.value(next_obs), config.gamma, config.gae_lambda)
        return advantages, advantages + rollout.values

    def learn(self, advantages: torch.Tensor, returns: torch.Tensor) -> dict:
        """update_epochs passes over the rollout in shuffled minibatches; the mean diagnostics."""
        config, batch_size = self.config, self.config.num_envs * self.config.num_steps
        minibatch_size, steps = batch_size // config.num_minibatches, []
        for epoch in range(config.update_epochs):
            order = torch.randperm(batch_size, device=self.guard.device)
            for start in range(0, batch_size, minibatch_size):
                minibatch = self.rollout.minibatch(order[start:start + minibatch_size],
                                                   advantages, returns)
                steps.append(self.trainer.gradient_step(minibatch))  # diagnostics, as tensors
            # Early stop (37 details, #12, optional): the policy moved too far from the data's.
            if (config.target_kl is not None
                    and self.guard.mean(steps[-1]["approx_kl"].item()) > config.target_kl):
                break
        stats = {key: torch.stack([step[key].detach() for step in steps]).mean().item()
                 for key in steps[0]}  # the update's one host sync (--target-kl: one an epoch)
        # Explained variance (37 details, #12): 1 - Var[R - V] / Var[R], 1 if V predicts R.
        variance, unexplained = returns.var().item(), (returns - self.rollout.values).var().item()
        stats["explained_variance"] = 0.0 if variance == 0 else 1 - unexplained / variance
        return stats

# ==== Below: speed, safety and scale. PPO is complete above. ======================================
#
# A reader of PPO may stop here. What follows makes the lesson fast, safe and scalable: the engines
# the games run on and compilation; `Ranks` (torchrun); `RunGuard` and `RunLog` (set-up, Ctrl-C,
# failures, logging, summary), which extend the lesson's plain `Run`; checkpoints; evaluation and
# video; the input checks; the command line.

import copy
import datetime
import gc
import hashlib
import importlib
import json
import logging
import multiprocessing.connection
import os
import random
import signal
import sys
import threading
from multiprocessing import shared_memory
from pathlib import Path

import torch.distributed as dist  # already loaded by `import torch`: costs nothing more
from gymnasium.envs.classic_control.cartpole import CartPoleVectorEnv

# ----- Engines: the games, fast and guarded -------------------------------------------------------


class SameStepCartPole(CartPoleVectorEnv):
    """gymnasium's vectorised CartPole (64 poles in a few numpy operations, the time a Python loop
    takes for 10 Games), made to restart an ended pole in the same step, as Game does: the library
    restarts it at its *next* step, ignoring that step's action. Here the restart happens at once,
    with the very draw the library would make one step later (tests/ hold the two equal)."""

    ENTRY_POINT = "gymnasium.envs.classic_control.cartpole:CartPoleVectorEnv"

    def step(self, action):
        obs, reward, terminated, truncated, info = super().step(action)
        ended = self.prev_done  # the poles the library would restart at its next step
        if ended.any():
            info = {"final_obs": obs.copy(), "_final_obs": ended.copy()}
            self.state[:, ended] = self.np_random.uniform(low=self.low, high=self.high,
                                                          size=(4, ended.sum()))
            self.steps[ended] = 0
            self.prev_done = np.zeros_like(ended)
            obs = self.state.T.astype(np.float32)
        return obs, reward, terminated, truncated, info


class CartPoleGames:
    """For CartPole, a Worker's Games are one SameStepCartPole of all its poles, seeded with the
    worker's first seed: WorkerPool mixes this class into the Worker's, whose `start_games` and
    `step_games` then give what they give for a list of Games."""

    def start_games(self, env_id: str, seed: int, obs_view: np.ndarray) -> SameStepCartPole:
        spec = gym.spec(env_id)
        poles = SameStepCartPole(len(obs_view), max_episode_steps=spec.max_episode_steps,
                                 **spec.kwargs)
        obs_view[:], _ = poles.reset(seed=seed)
        poles.episode_returns = np.zeros(len(obs_view))
        poles.episode_lengths = np.zeros(len(obs_view), dtype=np.int64)
        return poles

    @staticmethod
    def step_games(poles: SameStepCartPole, actions: np.ndarray, obs_out: np.ndarray) -> tuple:
        obs_out[:], rewards, terminated, truncated, info = poles.step(actions[:, 0])
        poles.episode_returns += rewards
        poles.episode_lengths += 1
        final_obs, episodes = {}, {}
        for i in np.flatnonzero(terminated | truncated):
            final_obs[i] = info["final_obs"][i]
            episodes[i] = {"return": float(poles.episode_returns[i]),
                           "length": int(poles.episode_lengths[i])}
            poles.episode_returns[i], poles.episode_lengths[i] = 0, 0
        return rewards.astype(np.float32), terminated, truncated, final_obs, episodes

    @staticmethod
    def close_games(poles: SameStepCartPole):
        poles.close()


class GuardedWorker(Worker):
    """A Worker made safe for long runs. The child ignores SIGINT (a terminal's Ctrl-C reaches the
    whole group: the trainer decides how to stop), reports its Games' errors in one line, and closes
    its inherited copies of the trainer's pipe ends, so that it exits once the trainer is gone. The
    trainer waits on the pipe and the process at once: a child that dies is reported (WorkerError)
    instead of blocking `recv()` forever."""

    def __init__(self, index: int, env_id: str, seed: int, obs_view: np.ndarray,
                 inherited_trainer_ends: list):
        self.inherited_trainer_ends = inherited_trainer_ends
        super().__init__(index, env_id, seed, obs_view)

    def child_loop(self, conn, env_id: str, seed: int, obs_view: np.ndarray):
        gc.freeze()  # the trainer's objects (its garbage too) are not the child's to finalize
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        for end in [self.trainer_end, *self.inherited_trainer_ends]:
            end.close()
        try:
            super().child_loop(conn, env_id, seed, obs_view)
        except (EOFError, BrokenPipeError, KeyboardInterrupt):
            pass  # the trainer is gone or stopping: just exit
        except Exception as error:
            with contextlib.suppress(OSError):
                conn.send(("error", f"{type(error).__name__}: {error}"))
        finally:
            os._exit(0)  # skip the inherited atexit handlers (they belong to the trainer)

    def send_step(self, actions: np.ndarray):
        with contextlib.suppress(OSError):  # a child that is gone: receive() says how
            self.trainer_end.send(("step", actions))

    def receive(self, timeout: float = 120.0) -> tuple:
        name = f"worker {self.index} ({self.env_id})"
        ready = multiprocessing.connection.wait([self.trainer_end, self.process.sentinel], timeout)
        if not ready:
            raise WorkerError(f"{name} did not answer within {timeout:.0f} s")
        if self.trainer_end in ready:
            try:
                status, payload = self.trainer_end.recv()
            except (EOFError, OSError):
                status, payload = "dead", None
            if status == "ok":
                return payload
            if status == "error":
                raise WorkerError(f"{name} failed: {payload}")
        self.process.join(timeout=1.0)
        code = self.process.exitcode
        how = (f"killed by signal {signal.Signals(-code).name}" if code and code < 0
               else f"exit code {code}")
        raise WorkerError(f"{name} died ({how})")

    def close(self):
        with contextlib.suppress(OSError):
            self.trainer_end.send(("close", None))
        self.trainer_end.close()
        self.process.join(timeout=2.0)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()


class InProcessWorker(Worker):
    """--num-workers 0: the Games of a Worker, played in this process (no child, no pipe)."""

    def __init__(self, index: int, env_id: str, seed: int, obs_view: np.ndarray,
                 inherited_trainer_ends: list):
        self.index, self.env_id, self.obs_view, self.trainer_end = index, env_id, obs_view, None
        self.games = self.start_games(env_id, seed, obs_view)

    def send_step(self, actions: np.ndarray):
        self.actions = actions

    def receive(self) -> tuple:
        return self.step_games(self.games, self.actions, self.obs_view)

    @staticmethod
    def close_games(games: list):
        for game in games:
            game.env.close()

    def close(self):
        self.close_games(self.games)


class WorkerPool:
    """All the games of this rank: num_workers Workers of num_envs / num_workers Games each (one in
    this process with --num-workers 0), their observations in one [num_envs, obs_size] array
    (shared memory with child processes), read as a tensor without a copy."""

    def __init__(self, config: Config, obs_size: int, first_seed: int, device: torch.device):
        self.device, self.workers, self.shared_obs = device, [], None
        shape = (config.num_envs, obs_size)
        if config.num_workers == 0:
            self.obs_array = np.zeros(shape, dtype=np.float32)
        else:
            self.shared_obs = shared_memory.SharedMemory(create=True, size=int(np.prod(shape)) * 4)
            self.obs_array = np.ndarray(shape, dtype=np.float32, buffer=self.shared_obs.buf)
        worker_class = GuardedWorker if config.num_workers else InProcessWorker
        games_per_worker = config.num_envs // max(config.num_workers, 1)
        where = (f"{games_per_worker} per Worker in {config.num_workers} child processes"
                 if config.num_workers else "in this process")
        self.engine = f"the lesson's Game, {where}"
        if (config.env_backend == "vector"
                and gym.spec(config.env).vector_entry_point == SameStepCartPole.ENTRY_POINT):
            worker_class = type(worker_class.__name__, (CartPoleGames, worker_class), {})
            self.engine = (f"gymnasium's vector CartPole, {where}, the same game as Game "
                           f"(tests/test_cartpole_units.py); --env-backend game plays the lesson's")
        try:
            for index in range(max(config.num_workers, 1)):
                first = index * games_per_worker
                worker = worker_class(index, config.env, first_seed + first,
                                      self.obs_array[first:first + games_per_worker],
                                      [w.trainer_end for w in self.workers if w.trainer_end])
                worker.first = first
                self.workers.append(worker)
        except BaseException:
            self.close()  # the workers started so far
            raise
        if self.shared_obs is not None:  # mapped by the children now: no segment outlives the run
            self.shared_obs.unlink()
        self.obs_tensor = torch.from_numpy(self.obs_array)

    def observations(self) -> torch.Tensor:
        """The games' current observations on the training device (no copy on the CPU)."""
        return self.obs_tensor.to(self.device)

    def step(self, actions: np.ndarray) -> StepResult:
        """Send all workers their actions first, then collect: the children run in parallel."""
        for worker in self.workers:
            worker.send_step(actions[worker.first:worker.first + len(worker.obs_view)])
        results = [worker.receive() for worker in self.workers]
        if len(results) == 1:
            return StepResult(*results[0])
        final_obs, episodes = {}, {}
        for worker, (_, _, _, worker_final_obs, worker_episodes) in zip(self.workers, results):
            final_obs.update({worker.first + i: obs for i, obs in worker_final_obs.items()})
            episodes.update({worker.first + i: episode for i, episode in worker_episodes.items()})
        rewards, terminated, truncated = (np.concatenate(part) for part in list(zip(*results))[:3])
        return StepResult(rewards, terminated, truncated, final_obs, episodes)

    def close(self):
        for worker in self.workers:
            worker.close()
        self.workers = []
        if self.shared_obs is not None:
            self.obs_tensor = self.obs_array = None  # drop the views before unmapping the memory
            self.shared_obs.close()
            self.shared_obs = None

# ----- Compilation and Adam written out -----------------------------------------------------------


def compile_learner(main: Main):
    """torch.compile fuses the small layers into fewer kernels, for the rollout's inference and the
    loss (its backward compiled with it): seconds that CartPole never earns back, hence off by
    default. Compiling the bound methods, not the modules, keeps the checkpoint's parameter names.
    Both are compiled here, on inputs of the sizes they will see, so that a machine that cannot
    compile falls back to eager at once, with a warning."""
    logging.getLogger("torch.utils.cpp_extension").addFilter(not_the_cuda_home_warning)
    model, trainer, config, guard = main.model, main.trainer, main.config, main.guard
    networks = (model.actor, model.critic)
    eager_forwards, eager_loss = [network.forward for network in networks], trainer.compute_loss
    rows = config.num_envs * config.num_steps // config.num_minibatches
    try:
        for network, forward in zip(networks, eager_forwards):
            network.forward = torch.compile(forward)
        trainer.compute_loss = torch.compile(eager_loss)
        with torch.no_grad():
            model.act(torch.zeros(config.num_envs, guard.obs_size, device=guard.device))
        zeros = torch.zeros(rows, device=guard.device)
        actions = torch.zeros((rows, len(guard.action_dims)), dtype=torch.long, device=guard.device)
        obs = torch.zeros(rows, guard.obs_size, device=guard.device)
        loss, _ = trainer.compute_loss(Minibatch(obs, actions, zeros, zeros + 1, zeros, zeros))
        loss.backward()
        trainer.optimizer.zero_grad()
    except Exception as error:
        for network, forward in zip(networks, eager_forwards):
            network.forward = forward
        trainer.compute_loss = eager_loss
        print(f"warning: torch.compile failed ({type(error).__name__}: "
              f"{str(error).splitlines()[0]}); running eagerly", file=sys.stderr)


def not_the_cuda_home_warning(record: logging.LogRecord) -> bool:
    """Drops torch's "No CUDA runtime is found, using CUDA_HOME=..." (logged when the compiler
    loads on a machine with CUDA's compiler but no GPU): a CPU run is not doing anything wrong."""
    return not record.getMessage().startswith("No CUDA runtime is found")


class Adam:
    """torch.optim.Adam (Kingma & Ba, 2015), the lesson's optimizer, written out: its CPU step bit
    for bit (tests/test_adam.py), without the 1-2 s that creating a torch.optim optimizer costs (it
    imports torch's compiler). RunGuard hands it to the Trainer while the lesson's Run names
    torch.optim.Adam. For each weight w with gradient g, at step t = 1, 2, ...:

        m <- beta1 m + (1 - beta1) g        a running mean of the gradient,
        v <- beta2 v + (1 - beta2) g^2      and of its square;
        w <- w - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)

    m and v start at 0: the step divides out their bias, the factors 1 - beta^t. Each weight moves
    by about lr along its mean gradient, less where the gradient keeps changing sign (v large
    against m^2), whatever its scale. The state_dict is laid out as torch.optim.Adam's."""

    def __init__(self, parameters, lr: float, eps: float, betas=(0.9, 0.999)):
        self.parameters = list(parameters)
        self.param_groups = [{"lr": lr, "betas": betas, "eps": eps}]  # lr: annealed by Main
        self.state = {index: {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(w),
                              "exp_avg_sq": torch.zeros_like(w)}  # t, m and v
                      for index, w in enumerate(self.parameters)}

    def zero_grad(self):
        for w in self.parameters:
            w.grad = None

    @torch.no_grad()
    def step(self):
        group = self.param_groups[0]
        (beta1, beta2), lr, eps = group["betas"], group["lr"], group["eps"]
        for w, state in zip(self.parameters, self.state.values()):
            g, m, v = w.grad, state["exp_avg"], state["exp_avg_sq"]
            if g is None:  # a weight the loss did not use: left as it is (so does torch's Adam)
                continue
            state["step"] += 1
            t = state["step"].item()
            m.lerp_(g, 1 - beta1)  # m + (1 - beta1)(g - m)
            v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            denominator = (v.sqrt() / (1 - beta2 ** t) ** 0.5).add_(eps)
            w.addcdiv_(m, denominator, value=-lr / (1 - beta1 ** t))

    def state_dict(self) -> dict:
        return {"state": self.state, "param_groups": self.param_groups}


# ----- Ranks: data-parallel training under torchrun -----------------------------------------------


class RankError(RuntimeError):
    """Under torchrun: another rank is gone (a collective failed), or the ranks' weights differ."""


class Ranks:
    """The processes ("ranks") of a run started by torchrun, and the few things they do together.

    torchrun starts N copies of this script and tells each its rank (RANK, WORLD_SIZE, LOCAL_RANK).
    Data parallelism, as in CleanRL's multi-GPU PPO: each rank plays its own --num-envs games (env
    i of rank r gets seed + r * num_envs + i) and splits its own rollout into minibatches, but the
    ranks average their gradients before each step, so all hold the same weights.
    --total-timesteps, the learning-rate schedule and --checkpoint-every count the steps of all
    ranks (README, "torchrun"). Every decision to stop is taken from values all ranks share, so no
    rank waits in a collective the others skipped; rank 0 writes the files. Without torchrun: a
    world of one, and every method returns at once."""

    def __init__(self, device: torch.device):
        self.distributed = "WORLD_SIZE" in os.environ  # set by torchrun
        self.world_size = int(os.environ.get("WORLD_SIZE", 1))
        self.rank, self.device = int(os.environ.get("RANK", 0)), device
        if not self.distributed:
            return
        if device.type == "cuda":  # one GPU per rank: the LOCAL_RANK-th of its machine
            local_rank, gpus = int(os.environ.get("LOCAL_RANK", 0)), torch.cuda.device_count()
            if local_rank >= gpus:
                raise UsageError(f"rank {self.rank} wants GPU {local_rank}, but its machine has "
                                 f"{gpus}: lower --nproc_per_node")
            self.device = torch.device("cuda", local_rank)
            torch.cuda.set_device(self.device)
        try:  # NCCL moves CUDA tensors between GPUs directly; gloo moves CPU tensors over TCP
            dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo")
        except (RuntimeError, ValueError) as error:
            raise UsageError(f"WORLD_SIZE is set, but joining the other ranks failed "
                             f"({str(error).splitlines()[0]}): start the script with torchrun"
                             ) from None

    def collective(self, operation, *args):
        """One torch.distributed operation. When another rank has died, gloo raises here: this
        rank then stops with one line (RankError), not a traceback."""
        try:
            return operation(*args)
        except RuntimeError as error:
            cause = str(error).splitlines()[0] if str(error) else type(error).__name__
            cause = cause.split("] ", 1)[-1].split(". ")[0]  # drop gloo's C++ file and line
            raise RankError(f"rank {self.rank} lost contact with the other ranks ({cause})"
                            ) from None

    def average_gradients(self, parameters):
        """Each gradient becomes its mean over the ranks, in one all-reduce of all of them. (DDP
        would overlap this with the backward pass, which pays only for big networks.)"""
        if not self.distributed:
            return
        grads = [p.grad for p in parameters]
        flat = torch.cat([grad.flatten() for grad in grads])
        self.collective(dist.all_reduce, flat)  # sum
        flat /= self.world_size
        for grad, part in zip(grads, flat.split([grad.numel() for grad in grads])):
            grad.copy_(part.view_as(grad))

    def mean(self, values: list) -> list:
        """Each number's mean over the ranks."""
        if not self.distributed:
            return values
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        self.collective(dist.all_reduce, tensor)
        return (tensor / self.world_size).tolist()

    def gather(self, value) -> list:
        """Every rank's value (anything picklable), in rank order, on every rank."""
        if not self.distributed:
            return [value]
        values = [None] * self.world_size
        self.collective(dist.all_gather_object, values, value)
        return values

    def from_rank_0(self, make):
        """make() run on rank 0 only; its result, or the UsageError it raised, on every rank."""
        result = None
        if self.rank == 0:
            try:
                result = make()
            except UsageError as error:
                result = error
        result = self.gather(result)[0]
        if isinstance(result, UsageError):
            raise result
        return result

    def copy_from_rank_0(self, tensors):
        """Overwrite the tensors (the initial weights) with rank 0's."""
        if self.distributed:
            for tensor in tensors:
                self.collective(dist.broadcast, tensor, 0)

    def check_same(self, tensors):
        """Raise RankError unless every rank holds bitwise rank 0's tensors (the final weights)."""
        if not self.distributed:
            return
        digest = hashlib.sha256(b"".join(t.detach().cpu().numpy().tobytes() for t in tensors))
        digests = self.gather(digest.hexdigest())
        differ = [str(rank) for rank, other in enumerate(digests) if other != digests[0]]
        if differ:
            raise RankError(f"the weights of rank {', '.join(differ)} differ from rank 0's at "
                            f"the end of the run")

    def close(self):
        if self.distributed and dist.is_initialized():
            dist.destroy_process_group()


def merge_over_ranks(ranks: Ranks, stats: RunningMeanStd, before: dict):
    """Under torchrun, after each rollout: every rank's share is what its statistics gained since
    `before` (Chan's formula, inverted); all merge all shares into `before`, in rank order, so
    that every rank normalises with the statistics of all ranks' observations."""
    if not ranks.distributed or not stats.active:
        return
    old_count, count = float(before["count"]), float(stats.count)
    own = count - old_count
    own_mean = before["mean"] + (stats.mean - before["mean"]) * (count / own if own else 0.0)
    delta = own_mean - before["mean"]
    squares = (stats.var * count - before["var"] * old_count
               - delta.square() * old_count * own / count)
    own_var = squares / own if own else torch.zeros_like(squares)
    load_statistics(stats, before)
    for share, mean, var in ranks.gather((own, own_mean.cpu(), own_var.cpu())):
        stats.merge(share, mean.to(stats.mean.device), var.to(stats.var.device))

# ----- RunGuard: set-up, Ctrl-C, failures, logging, the summary -----------------------------------


class UsageError(ValueError):
    """Bad input from the user: the command line prints its message on one line, exit status 2."""


class WorkerError(RuntimeError):
    """A worker process died or one of its Games raised: the run stops with this message."""


class Interrupted(Exception):
    """Ctrl-C or SIGTERM arrived: the run stops at the next step and saves what it has."""


class NonFiniteLoss(RuntimeError):
    """A loss or gradient became NaN or infinite: the run stops rather than train on garbage."""


FAILURES = (WorkerError, NonFiniteLoss, RankError)  # what stops a run with exit status 1


class RunGuard(Run):
    """Everything around PPO's loop that is not PPO, as a context manager. On entry: the settings,
    --resume's checkpoint, the ranks, the run dir, the seeds. In the loop: Ctrl-C, checkpoints,
    non-finite losses, told by its RunLog. On exit, however the run ended: the games closed, the
    last checkpoint and the summary saved, and what the process lent given back (a notebook's)."""

    def __init__(self, main: Main):
        self.main, self.stop_signal, self.signals = main, None, None
        self.previous_threads = torch.get_num_threads()
        self.ranks = self.games = self.log = self.summary = None

    config = property(lambda self: self.main.config)  # the run's (or the checkpoint's) settings
    solved_step = property(lambda self: self.log.solved_step)  # --target-return was reached
    optimizer = Adam if Run.optimizer is torch.optim.Adam else Run.optimizer  # torch's, faster

    @staticmethod
    def evaluate(config: Config) -> dict:  # --eval
        return evaluate_checkpoint(config)

    def __enter__(self) -> "RunGuard":
        self.signals = StopSignals(self)  # Ctrl-C and SIGTERM, from now until give_back
        try:
            self.setup()
        except BaseException:
            self.give_back()
            raise
        return self

    def setup(self):
        start_time = time.perf_counter()  # set-up counts: it holds the compilation, if any
        check_settings(self.config)
        self.checkpoint = load_checkpoint(self.config.resume) if self.config.resume else None
        config = resumed_config(self.checkpoint, self.config)  # (and the env's preset)
        check_settings(config)
        self.obs_size, self.action_dims, self.binary = inspect_env(config.env)
        # The rollout: an observation and 5 numbers a step; an update makes about 2 copies more.
        refuse_what_will_not_fit(3 * 4 * config.num_steps * config.num_envs * (self.obs_size + 5),
                                 "the rollout")
        # Under torchrun, join the other ranks (each on a GPU of its own); alone, a world of one.
        self.ranks = Ranks(pick_device(config.device))
        self.device = self.ranks.device
        self.steps_per_step = config.num_envs * self.ranks.world_size  # all envs of all ranks
        # Rank 0 names and makes the run dir: the default name holds the time, which may differ.
        self.run_dir = self.ranks.from_rank_0(lambda: make_run_dir(config, self.checkpoint))
        self.main.config = config = dataclasses.replace(config, run_dir=str(self.run_dir))
        # Every random draw of the trainer (sampling, shuffling) comes from torch's seeded
        # generator, and each game from its own. Rank r seeds with seed + r: its draws are its own.
        self.seed = config.seed + self.ranks.rank
        random.seed(self.seed)
        np.random.seed(self.seed)
        torch.manual_seed(self.seed)
        # One thread is fastest for networks this small (benchmarks/README.md); given back after.
        torch.set_num_threads(1)
        self.updates, self.checkpoint_path = 0, self.run_dir / "checkpoint.pt"
        self.log = RunLog(self, start_time)

    def prepare_learner(self) -> int:
        """Continue from --resume's checkpoint (if any), start every rank from rank 0's weights,
        and compile (--compile). Returns the global step to start from."""
        main = self.main
        main.global_step, main.trainer.average_gradients = 0, self.ranks.average_gradients
        if self.checkpoint is not None:
            restore_learner(main, self.checkpoint)
            main.anneal_from = continued_schedule(self.checkpoint, main.config, main.global_step,
                                                  main.trainer.optimizer.param_groups[0]["lr"])
            if self.ranks.rank > 0:  # the checkpoint holds rank 0's random state: a fresh stream
                torch.manual_seed(self.seed + main.global_step)
        self.log.start()  # the start-up block
        self.ranks.copy_from_rank_0(main.model.state_dict().values())  # the same start everywhere
        if main.config.compile:
            compile_learner(main)
        self.last_good_learner = copy.deepcopy(learner_state(main))  # what a NaN falls back to
        self.last_checkpoint_step = main.global_step
        return main.global_step

    def start_games(self) -> WorkerPool:  # game i of rank r is seeded with seed + r * num_envs + i
        first_seed = self.config.seed + self.ranks.rank * self.config.num_envs
        self.games = WorkerPool(self.config, self.obs_size, first_seed, self.device)
        self.log.say(f"engine: {self.games.engine}")
        return self.games

    def stop_at_once(self) -> bool:  # under torchrun, all ranks stop together after the rollout
        return self.stop_signal is not None and not self.ranks.distributed

    def mean(self, value: float) -> float:  # over the ranks (the value itself without torchrun)
        return self.ranks.mean([value])[0]

    def after_rollout(self, ended: list):
        """Record the episodes that ended in the rollout; raise Interrupted if asked to stop. Under
        torchrun the ranks meet here once per rollout: each learns every rank's episodes, in the
        same order (by step, then rank), and whether any was asked to stop; each rank merges all
        ranks' observations of the rollout into its statistics."""
        merge_over_ranks(self.ranks, self.main.model.obs_stats,
                         self.last_good_learner["normalizer"]["obs"])
        shared = self.ranks.gather((ended, self.stop_signal))
        for step, episode in sorted((item for rank_ended, _ in shared for item in rank_ended),
                                    key=lambda step_and_episode: step_and_episode[0]):
            self.log.record_episode(episode, step)
        signals = [signum for _, signum in shared if signum is not None]
        if signals:
            self.stop_signal = signals[0]
            raise Interrupted

    def after_update(self, stats: dict):
        """Average the diagnostics over the ranks and stop if one is not finite; else log the
        update and save when due."""
        main, stats = self.main, dict(zip(stats, self.ranks.mean(list(stats.values()))))
        if not all(math.isfinite(v) for v in stats.values()):
            values = ", ".join(f"{key}={value}" for key, value in stats.items())
            raise NonFiniteLoss(f"non-finite loss or gradient in update {self.updates + 1} "
                                f"({values}); stopped with the weights of the update before")
        self.updates += 1
        self.log.update(stats)
        if main.global_step - self.last_checkpoint_step >= self.config.checkpoint_every:
            save_checkpoint(learner_state(main), self.checkpoint_path, self.ranks)
            self.last_checkpoint_step = main.global_step
        self.last_good_learner = copy.deepcopy(learner_state(main))

    def __exit__(self, kind, error, traceback) -> bool:
        """Close the games and, unless the error is one a run cannot save from (bad input, a bug),
        save the last checkpoint and the summary. Ctrl-C ends a run normally (`interrupted`); a
        failure is raised again once everything is saved."""
        try:
            if self.games is not None:
                self.games.close()
            if kind is not None and not issubclass(kind, (Interrupted, *FAILURES)):
                return False
            failure = error if isinstance(error, FAILURES) else None
            if isinstance(error, (NonFiniteLoss, RankError)):  # the update may be half done
                restore_learner(self.main, self.last_good_learner)
            if failure is None:  # all ranks are here together: check they trained the same network
                try:
                    self.ranks.check_same(self.main.model.state_dict().values())
                except RankError as mismatch:
                    failure = mismatch
            save_checkpoint(learner_state(self.main), self.checkpoint_path, self.ranks)
            self.summary = self.log.finish(kind is Interrupted, failure is not None)
            if failure is not None and failure is not error:
                raise failure
            return failure is None  # a failure propagates; Ctrl-C does not
        finally:
            self.give_back()

    def give_back(self):
        """Restore what the run changed in this process: signal handlers, torch's thread count."""
        if self.signals is not None:
            self.signals.give_back()
        torch.set_num_threads(self.previous_threads)
        if self.ranks is not None:
            self.ranks.close()


class StopSignals:
    """Ctrl-C and SIGTERM during a run, caught in the main thread (the only one that can): the first
    sets the guard's stop_signal (the run stops after this update and saves it); a second stops the
    run at once, keeping the last checkpoint. give_back restores the handlers there before."""

    def __init__(self, guard: "RunGuard"):
        self.guard, self.previous_handlers = guard, {}
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                self.previous_handlers[signum] = signal.signal(signum, self.note)

    def note(self, number: int, frame):
        if self.guard.stop_signal is not None:
            raise KeyboardInterrupt
        self.guard.stop_signal = number
        with contextlib.suppress(OSError):  # (print is not safe inside a signal handler)
            os.write(2, b"stopping after this update; a second Ctrl-C stops at once\n")

    def give_back(self):
        for signum, handler in self.previous_handlers.items():
            signal.signal(signum, handler)


def tell(line: str):
    """Print a line; output that cannot be written (`| head`, a full disk) goes to /dev/null."""
    try:
        print(line, flush=True)
    except OSError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def preset_of(config: Config) -> tuple:
    """(its name, its settings): what `with_preset` fills `config`'s fields left at None with."""
    if config.preset and config.env in PRESETS:
        return f"{config.env}'s preset", PRESETS[config.env]
    return "the general setting", GENERAL_SETTING


class RunLog:
    """What a run tells, from rank 0: the start-up block, a progress line per update (at most one a
    second), TensorBoard, summary.json and a closing line. Its counts (steps, episodes, seconds,
    the last 100 returns) cover the whole run across resumes; its speeds, this process alone."""

    def __init__(self, guard: RunGuard, start_time: float):
        self.guard, self.main, self.start_time = guard, guard.main, start_time
        resumed = guard.checkpoint is not None
        saved = guard.checkpoint.get("log", {}) if resumed else {}
        self.resumed_at_step = int(guard.checkpoint["global_step"]) if resumed else None
        self.episodes, self.earlier_seconds = saved.get("episodes", 0), saved.get("seconds", 0.0)
        self.recent_returns = deque(saved.get("recent_returns", []), maxlen=100)
        self.recent_lengths = deque(saved.get("recent_lengths", []), maxlen=100)
        self.solved_step = self.solved_seconds = self.first_update_end = self.printed_step = None
        self.last_print, self.writer = 0.0, None
        if guard.ranks.rank == 0:  # rank 0 speaks for all; TensorBoard shows the settings too
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(guard.run_dir))
            rows = "\n".join(f"|{key}|{value}|" for key, value in
                             dataclasses.asdict(guard.config).items())
            self.writer.add_text("hyperparameters", f"|param|value|\n|-|-|\n{rows}")

    def say(self, line: str):
        if self.writer is not None:
            tell(line)

    def start(self):
        """What runs where, what differs from the defaults, and how far it goes."""
        guard, config, step = self.guard, self.guard.config, self.main.global_step
        batch = guard.steps_per_step * config.num_steps
        self.last_step = step + max(0, math.ceil((config.total_timesteps - step) / batch)) * batch
        rounded = (f" ({config.total_timesteps:,} rounded up to whole rollouts of {batch:,})"
                   if self.last_step != config.total_timesteps else "")
        self.say(f"{SCRIPT}.py: {config.env} on {guard.device}, seed {config.seed}, "
                 f"{self.last_step:,} steps{rounded}\nrun dir: {guard.run_dir}")
        preset, defaults = preset_of(config)
        defaults = {**{f.name: f.default for f in dataclasses.fields(Config)}, **defaults}
        changed = [(name.replace("_", "-"), getattr(config, name)) for name in defaults
                   if name != "run_dir" and getattr(config, name) != defaults[name]]
        flags = " ".join(f"--{'' if value else 'no-'}{flag}" if isinstance(value, bool)
                         else f"--{flag} {value}" for flag, value in changed)
        self.say(f"settings: {preset} (benchmarks/README.md)" + (f", and {flags}" if flags else ""))
        if self.resumed_at_step is not None:
            self.main.anneal_learning_rate()  # as the next update will: the rate it takes
            until = f", annealed to 0 by step {self.last_step:,}" if config.anneal_lr else ""
            self.say(f"resuming from {guard.checkpoint['path']} at step {step:,} (learning rate "
                     f"{self.main.trainer.optimizer.param_groups[0]['lr']:.6g}{until})")
        self.say("learner: the lesson's torch code (Model, Trainer, compute_gae)"
                 + (", torch.compile" if config.compile else ""))
        if config.compile:
            self.say("compiling the model and the update (torch.compile, once per run; this can "
                     "take a minute)...")

    def record_episode(self, episode: dict, step: int):
        self.episodes += 1
        self.recent_returns.append(episode["return"])
        self.recent_lengths.append(episode["length"])
        if self.writer is not None:
            self.writer.add_scalar("charts/episodic_return", episode["return"], step)
            self.writer.add_scalar("charts/episodic_length", episode["length"], step)
        target = self.guard.config.target_return
        if (target is not None and self.solved_step is None and len(self.recent_returns) == 100
                and np.mean(self.recent_returns) >= target):
            self.solved_step, self.solved_seconds = step, self.seconds()

    def update(self, stats: dict):
        step, writer = self.main.global_step, self.writer
        if self.first_update_end is None:
            self.first_update_end = (time.perf_counter(), step)
        if writer is None:
            return
        for key, value in stats.items():
            writer.add_scalar(f"losses/{key}", value, step)
        writer.add_scalar("charts/learning_rate",
                          self.main.trainer.optimizer.param_groups[0]["lr"], step)
        speed = self.steady_speed()
        if speed is not None:
            writer.add_scalar("charts/steps_per_second", speed, step)
        if time.perf_counter() - self.last_print >= 1.0:
            self.print_progress()

    def seconds(self) -> float:
        """Wall-clock seconds of the whole run: the parts it was resumed from, and this one."""
        return self.earlier_seconds + time.perf_counter() - self.start_time

    def steady_speed(self) -> Optional[float]:
        """Steps per second since this process's first update (which holds one-time costs)."""
        if self.first_update_end is None:
            return None
        end_time, end_step = self.first_update_end
        elapsed, steps = time.perf_counter() - end_time, self.main.global_step - end_step
        return steps / elapsed if elapsed > 0 and steps > 0 else None

    def print_progress(self):
        self.last_print, step, total = time.perf_counter(), self.main.global_step, self.last_step
        self.printed_step = step
        speed = (self.steady_speed() or (step - (self.resumed_at_step or 0))
                 / max(self.last_print - self.start_time, 1e-9))
        eta = time.strftime("%H:%M:%S", time.gmtime(max(total - step, 0) / max(speed, 1e-9)))
        mean = lambda values: f"{np.mean(values):.1f}" if values else "-"
        self.say(f"step {step:,}/{total:,} ({100 * step / total:.1f}%) | {speed:,.0f} steps/s | "
                 f"eta {eta} | return {mean(self.recent_returns)} | "
                 f"length {mean(self.recent_lengths)} | updates {self.guard.updates}")

    def state(self) -> dict:
        """What the checkpoint keeps of the log, for a resumed run to count on."""
        return {"episodes": self.episodes, "seconds": self.seconds(),
                "recent_returns": list(self.recent_returns),
                "recent_lengths": list(self.recent_lengths)}

    def finish(self, interrupted: bool, failed: bool) -> dict:
        """Write summary.json, print the last progress line (once) and how the run ended."""
        guard, config, step = self.guard, self.guard.config, self.main.global_step
        speed, path = self.steady_speed(), guard.run_dir / "summary.json"
        summary = {
            "script": SCRIPT, "env": config.env, "seed": config.seed, "steps": step,
            "seconds": round(self.seconds(), 3),
            "warmup_seconds": (round(self.first_update_end[0] - self.start_time, 3)
                               if self.first_update_end else None),
            "steps_per_second": round(speed, 1) if speed else None, "episodes": self.episodes,
            "mean_return_100": float(np.mean(self.recent_returns)) if self.recent_returns else None,
            "target_return": config.target_return, "solved_step": self.solved_step,
            "solved_seconds": (round(self.solved_seconds, 3) if self.solved_seconds is not None
                               else None), "interrupted": interrupted,
            "checkpoint": str(guard.checkpoint_path) if guard.checkpoint_path.exists() else None,
            "world_size": guard.ranks.world_size, "resumed_at_step": self.resumed_at_step}
        if self.writer is None:
            return summary  # rank 0 writes it
        try:
            path.write_text(json.dumps(summary, indent=2) + "\n")
        except OSError as error:
            print(f"warning: could not write summary.json ({error})", file=sys.stderr)
        self.writer.close()
        if self.printed_step != step:
            self.print_progress()
        how = (f"reached the target return {config.target_return:g} at step {self.solved_step:,}"
               if self.solved_step is not None else
               f"{'interrupted' if interrupted else 'finished'} at step {step:,}")
        after = datetime.timedelta(seconds=round(self.seconds()))  # h:mm:ss
        if not failed:
            self.say(f"{how} after {after}; checkpoint {summary['checkpoint']}, summary {path}"
                     + (f" (continue with --resume {guard.run_dir})" if interrupted else ""))
        return summary

# ----- Checkpoints --------------------------------------------------------------------------------


def learner_state(main: Main) -> dict:
    """Everything needed to continue learning: only tensors, numbers, strings, lists and dicts, so
    that torch.load(..., weights_only=True) can read it back (a checkpoint cannot run code)."""
    guard = main.guard
    return {
        "script": SCRIPT, "env": main.config.env, "obs_size": guard.obs_size,
        "action_dims": guard.action_dims, "binary": guard.binary,
        "config": dataclasses.asdict(main.config),
        "model": main.model.state_dict(), "optimizer": main.trainer.optimizer.state_dict(),
        "normalizer": {"obs": statistics_state(main.model.obs_stats)},  # the policy's too
        "global_step": main.global_step, "updates": guard.updates,
        "anneal_from": list(main.anneal_from), "log": guard.log.state(),
        "rng": {"torch": torch.get_rng_state()},
    }


def statistics_state(stats: RunningMeanStd) -> dict:
    """The running statistics as a checkpoint holds them (`load_statistics` reads them back)."""
    return {"count": stats.count, "mean": stats.mean, "var": stats.var}


def load_statistics(stats: RunningMeanStd, state: dict):
    """A checkpoint's running statistics (`statistics_state`) into `stats`, in place."""
    stats.count.copy_(state["count"])
    stats.mean.copy_(state["mean"])
    stats.var.copy_(state["var"])


def load_weights(model: Model, weights: dict, config: Config):
    """A checkpoint's weights into `model`; one that does not fit (another version of this script
    wrote it) is refused in one line, for --resume and --eval alike."""
    try:
        model.load_state_dict(weights)
    except RuntimeError as error:
        raise UsageError(f"the checkpoint's network does not fit {config.env} with hidden "
                         f"size {config.hidden_size}: "
                         f"{str(error).splitlines()[-1].strip()}") from None


def load_optimizer(optimizer: Adam, saved: dict):
    """Adam's state from a checkpoint: laid out as torch.optim.Adam's (the lesson's Adam wrote it,
    or torch.optim.Adam itself), or as this script's first hand-written Adam's ("steps", "lr",
    "exp_avg", "exp_avg_sq")."""
    if "exp_avg" in saved:
        steps = torch.tensor(float(saved["steps"]))
        moments = zip(saved["exp_avg"], saved["exp_avg_sq"])
        saved = {"param_groups": [{"lr": saved["lr"]}],
                 "state": {index: {"step": steps, "exp_avg": m, "exp_avg_sq": v}
                           for index, (m, v) in enumerate(moments)}}
    if not isinstance(optimizer, Adam):  # another optimizer, which the lesson was edited to name
        return optimizer.load_state_dict(saved)
    optimizer.param_groups[0]["lr"] = float(saved["param_groups"][0]["lr"])
    for index, state in saved["state"].items():
        for key, value in state.items():
            optimizer.state[index][key].copy_(value)


def restore_learner(main: Main, state: dict):
    load_weights(main.model, state["model"], main.config)
    load_optimizer(main.trainer.optimizer, state["optimizer"])
    if "normalizer" in state:  # (a checkpoint from before observation normalisation: none)
        load_statistics(main.model.obs_stats, state["normalizer"]["obs"])
    main.global_step, main.guard.updates = int(state["global_step"]), int(state["updates"])
    main.anneal_from = tuple(state.get("anneal_from", (0, state["config"]["learning_rate"])))
    torch.set_rng_state(state["rng"]["torch"])


def continued_schedule(checkpoint: dict, config: Config, step: int, rate: float) -> tuple:
    """Where a resumed run anneals the learning rate from, as (step, rate): as saved with the
    checkpoint's total and rate; with another --total-timesteps from `rate` (the last update's) to 0
    over the steps left, so that it never jumps; a new --learning-rate starts there."""
    saved = checkpoint["config"]
    if config.learning_rate != saved["learning_rate"]:
        return step, config.learning_rate
    if config.total_timesteps != saved["total_timesteps"] and saved["anneal_lr"]:
        return step, rate
    return tuple(checkpoint.get("anneal_from", (0, saved["learning_rate"])))


def save_checkpoint(state: dict, path: Path, ranks: Ranks):
    """Write to a temporary file, then rename: a crash or a full disk never leaves half a
    checkpoint, and a failed write keeps the previous one. Rank 0 writes (all hold the same)."""
    if ranks.rank != 0:
        return
    temporary = path.with_suffix(".tmp")
    try:
        torch.save(state, temporary)
        os.replace(temporary, path)
    except OSError as error:
        temporary.unlink(missing_ok=True)
        kept = "the previous checkpoint is kept" if path.exists() else "no checkpoint"
        reason = os.strerror(error.errno) if error.errno else error
        print(f"warning: could not write {path} ({reason}); {kept}", file=sys.stderr)


def find_checkpoint(path: str) -> Path:
    """--resume and --eval take a checkpoint file or the run folder that holds checkpoint.pt."""
    found = Path(path) / "checkpoint.pt" if Path(path).is_dir() else Path(path)
    if not found.is_file():
        raise UsageError(f"run folder {path} holds no checkpoint.pt" if Path(path).is_dir()
                         else f"checkpoint {path} not found")
    return found


def load_checkpoint(path: str) -> dict:
    """Read a checkpoint of this script, refusing clearly what is missing, damaged or foreign."""
    path = find_checkpoint(path)
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:
        raise UsageError(f"{path} is not a readable checkpoint (truncated or corrupt?): "
                         f"{type(error).__name__}") from None
    if not isinstance(checkpoint, dict) or "script" not in checkpoint:
        raise UsageError(f"{path} is not a checkpoint of this library")
    if checkpoint["script"] != SCRIPT:
        raise UsageError(f"{path} was written by {checkpoint['script']}.py, not {SCRIPT}.py: "
                         f"use that script")
    return {**checkpoint, "path": str(path)}


def resumed_config(checkpoint: Optional[dict], given: Config) -> Config:
    """The settings of a resumed (or evaluated) run: the checkpoint's, except those given now
    differently from their defaults (e.g. a new --total-timesteps); the run dir is the
    checkpoint's folder unless given. A different env or network is refused. Without a
    checkpoint: the given settings, with the env's preset."""
    if checkpoint is None:
        return with_preset(given)
    fields = dataclasses.fields(Config)
    saved = {f.name: checkpoint["config"][f.name] for f in fields if f.name in checkpoint["config"]}
    saved["run_dir"] = str(Path(checkpoint["path"]).parent)
    saved.setdefault("normalize_observations", False)  # (a checkpoint from before it existed)
    typed = getattr(given, "typed", None)  # the command line's flags (None: Config(...) in code)
    changed = {f.name: getattr(given, f.name) for f in fields
               if (f.name in typed if typed is not None else getattr(given, f.name) != f.default)}
    for name in ("env", "hidden_size", "normalize_observations"):  # what the weights are made for
        if name in changed and changed[name] != saved.get(name):
            raise UsageError(f"the checkpoint was trained with --{name.replace('_', '-')} "
                             f"{saved.get(name)}, not {changed[name]}")
    return with_preset(Config(**{**saved, **changed}))

# ----- Evaluation and video -----------------------------------------------------------------------


@torch.no_grad()
def evaluate_checkpoint(given: Config) -> dict:
    """--eval: play --eval-episodes games with a checkpoint's policy and report the return."""
    check_settings(given)
    checkpoint = load_checkpoint(given.eval)
    config = resumed_config(checkpoint, given)
    model = Model(*inspect_env(config.env), config.hidden_size, config.normalize_observations)
    load_weights(model, checkpoint["model"], config)
    if "normalizer" in checkpoint:  # (a checkpoint from before observation normalisation: none)
        load_statistics(model.obs_stats, checkpoint["normalizer"]["obs"])
    torch.manual_seed(config.seed)
    drawn = {"render_mode": "rgb_array"} if config.video else {}  # (only when asked for)
    game = Game(config.env, config.seed, **drawn)
    video, path, returns, obs = None, Path(config.run_dir) / "eval.mp4", [], game.reset()
    try:
        while len(returns) < config.eval_episodes:
            if config.video:
                video = write_frame(video, game, path)
            seen = model.obs_stats.normalize(torch.from_numpy(obs)[None], config.obs_clip,
                                             update=False)
            actions, _, _ = model.act(seen, greedy=config.greedy)
            obs, _, _, _, info = game.step(actions[0].numpy())
            if "episode" in info:
                returns.append(float(info["episode"]["return"]))
    finally:
        game.env.close()
        if video is not None:
            video.release()
    mean, std = float(np.mean(returns)), float(np.std(returns))
    how = "greedy" if config.greedy else "sampled"
    episodes = f"{len(returns)} episode{'s' * (len(returns) != 1)}"
    print(f"eval {config.env}: return {mean:.2f} ± {std:.2f} over {episodes} ({how} actions)")
    if video is not None:
        print(f"video: {path}")
    return {"script": SCRIPT, "env": config.env, "episodes": len(returns), "mean_return": mean,
            "std_return": std, "returns": returns, "greedy": config.greedy,
            "video": str(path) if video is not None else None}


def write_frame(video, game: Game, path: Path):
    """Append the game's picture to the mp4 (OpenCV's VideoWriter, opened at the first frame)."""
    import cv2  # only --video needs OpenCV

    # pygame, which draws the classic-control games, would open SDL's display and sound drivers
    # and complain, on a machine without them, about XDG_RUNTIME_DIR: the picture needs neither.
    os.environ.setdefault("SDL_VIDEODRIVER", "dummy")
    os.environ.setdefault("SDL_AUDIODRIVER", "dummy")
    frame = game.env.render()
    if video is None:
        path.parent.mkdir(parents=True, exist_ok=True)
        fps = game.env.metadata.get("render_fps", 30)
        video = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), fps,
                                (frame.shape[1], frame.shape[0]))
        if not video.isOpened():
            raise UsageError(f"OpenCV cannot write {path}")
    video.write(cv2.cvtColor(frame, cv2.COLOR_RGB2BGR))
    return video

# ----- Checking the input -------------------------------------------------------------------------


RANGES = {"> 0": (lambda x: x > 0, "positive"), ">= 0": (lambda x: x >= 0, "0 or more"),
          "(0, 1]": (lambda x: 0 < x <= 1, "in (0, 1]"),
          "[0, 1]": (lambda x: 0 <= x <= 1, "in [0, 1]")}

# The observation spaces besides Box that ppo_spaces.py reads, alone or nested.
SPACES_OBSERVATIONS = ("Discrete", "MultiDiscrete", "MultiBinary", "Dict", "Tuple")


def refuse_what_will_not_fit(needed: int, what: str):
    """Refuse in one line a setting whose `needed` bytes (`what`: what holds them) exceed the memory
    free now (MemAvailable, Linux; elsewhere not checked), before it is allocated: better than
    minutes of swapping, or the kernel killing the run without a word."""
    try:
        with open("/proc/meminfo") as meminfo:
            free = next(int(line.split()[1]) * 1024 for line in meminfo
                        if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return
    if needed > free:
        raise UsageError(f"{what} would take about {needed / 2 ** 30:,.1f} GiB, more than the "
                         f"{free / 2 ** 30:,.1f} GiB free: lower --num-envs or --num-steps")


def check_settings(config: Config):
    """Refuse settings that cannot work, in one line that says what to change: a number outside
    the range its Config field names, or not finite; flags that make no sense together."""
    config = with_preset(config)  # (a field left at None: its value for the env)
    for f in dataclasses.fields(Config):
        value, rule = getattr(config, f.name), f.metadata["check"]
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, float) and not math.isfinite(value):
            raise UsageError(f"{flag} must be a finite number, not {value}")
        if rule is not None and value is not None and not RANGES[rule][0](value):
            raise UsageError(f"{flag} must be {RANGES[rule][1]}, not {value}")
    if config.env_backend not in ("vector", "game"):
        raise UsageError(f"unknown --env-backend {config.env_backend!r}: use vector or game")
    for flag in ("video", "greedy"):
        if getattr(config, flag) and not config.eval:
            raise UsageError(f"--{flag} is for --eval's games: add --eval PATH")
    if config.eval and config.resume:
        raise UsageError("--eval plays a checkpoint, --resume trains on from one: give one")
    if config.num_workers and config.num_envs % config.num_workers:
        raise UsageError(f"--num-workers {config.num_workers} must divide --num-envs "
                         f"{config.num_envs}")
    batch_size = config.num_envs * config.num_steps
    if batch_size % config.num_minibatches:
        raise UsageError(f"the batch of {batch_size} steps (--num-envs x --num-steps) does not "
                         f"split into --num-minibatches {config.num_minibatches}")
    if batch_size // config.num_minibatches < 2:
        raise UsageError(f"minibatches of {batch_size // config.num_minibatches} step cannot be "
                         f"normalised: raise --num-envs or --num-steps, or lower --num-minibatches")


def inspect_env(env_id: str):
    """Check that the env exists and that this script can play it. Returns (observation size,
    number of choices of each action dimension, whether the actions are binary)."""
    module, _, registered = env_id.rpartition(":")  # "module:Env-v0": the module registers it
    try:
        importlib.import_module(module or "gymnasium")  # (gymnasium: imported already)
    except ImportError as error:
        raise UsageError(f"cannot import {module} for --env {env_id}: {error}") from None
    if registered not in gym.registry:
        with contextlib.suppress(ImportError):  # ale-py registers the Atari ids: say where they go
            import ale_py

            gym.register_envs(ale_py)
        if registered in gym.registry:
            raise UsageError(f"{env_id} is an Atari game: use ppo_atari.py")
        if "." in env_id and not module:  # PettingZoo's module.name, e.g. mpe2.simple_spread_v3
            raise UsageError(f"{env_id} is a multi-agent PettingZoo env: use ppo_multiagent.py")
        close = " or ".join(difflib.get_close_matches(registered, list(gym.registry), cutoff=0.6))
        hint = f"; did you mean {close}?" if close else "; see gymnasium.pprint_registry()"
        raise UsageError(f"unknown env {env_id!r}{hint}")
    try:
        if "box2d" in str(gym.spec(registered).entry_point):  # LunarLander and Box2D's others
            import Box2D  # noqa: F401
    except ImportError:
        raise UsageError(f"{env_id} runs on Box2D, which is not installed: "
                         f"pip install \"gymnasium[box2d]\"") from None
    try:
        game = Game(env_id, seed=0)
    except Exception as error:
        raise UsageError(f"cannot make {env_id}: {type(error).__name__}: {error}") from None
    obs_space, action_space = game.env.observation_space, game.action_space
    game.env.close()
    kind = type(obs_space).__name__
    if not isinstance(obs_space, gym.spaces.Box):
        raise UsageError(f"{env_id} has a {kind} observation space; " + (
            "use ppo_spaces.py, which reads any nest of spaces" if kind in SPACES_OBSERVATIONS
            else f"no script of this library handles {kind} observations yet"))
    if obs_space.dtype == np.uint8 and len(obs_space.shape) >= 2:
        raise UsageError(f"{env_id} observes images {obs_space.shape}; use ppo_spaces.py (a CNN "
                         f"sized to the image) or, for Atari, ppo_atari.py")
    if isinstance(action_space, (gym.spaces.Discrete, gym.spaces.MultiDiscrete,
                                 gym.spaces.MultiBinary)):
        return game.sizes()  # the lesson's reading of the spaces
    if isinstance(action_space, gym.spaces.Box):
        raise UsageError(f"{env_id} has a {action_space} action space (continuous): use "
                         f"ppo_continuous.py, which has a Gaussian policy")
    kind = type(action_space).__name__
    raise UsageError(f"{env_id} has a {action_space} action space; this script handles Discrete, "
                     f"MultiDiscrete and MultiBinary actions" + (
                         ": use ppo_spaces.py for nests of actions" if kind in ("Dict", "Tuple")
                         else f", and no script of this library handles {kind} actions yet"))


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise UsageError(f"unknown --device {name!r}: use auto, cpu or cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda, but torch sees no CUDA device here: use --device cpu")
    return device


RUN_FILES = ("checkpoint.pt", "summary.json", "events.out.tfevents.*", "eval.mp4")


def make_run_dir(config: Config, checkpoint: Optional[dict]) -> Path:
    """The run dir, made and tested for writing. One that holds another run is refused, unless
    --overwrite (which deletes that run's files first) or it is the folder being resumed."""
    default = f"runs/{config.env.replace('/', '-')}__{SCRIPT}__{config.seed}__{int(time.time())}"
    run_dir = Path(config.run_dir or default)
    resumed_here = (checkpoint is not None
                    and Path(checkpoint["path"]).parent.resolve() == run_dir.resolve())
    earlier_run = [path for pattern in RUN_FILES for path in run_dir.glob(pattern)]
    if earlier_run and not resumed_here:
        if not config.overwrite:
            raise UsageError(f"--run-dir {run_dir} already holds a run: continue it with --resume "
                             f"{run_dir}, or choose another --run-dir (--overwrite replaces it)")
        for path in earlier_run:
            path.unlink()
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / ".write-test").write_text("")
        (run_dir / ".write-test").unlink()
    except OSError as error:
        raise UsageError(f"cannot write to --run-dir {run_dir}: {error.strerror or error}"
                         ) from None
    return run_dir

# ----- The command line ---------------------------------------------------------------------------


def typed_fields(argv: list) -> set:
    """The Config fields a command line names: on --resume, a flag typed wins whatever its value."""
    names = {f.name for f in dataclasses.fields(Config)}
    typed = {word[2:].split("=")[0].replace("-", "_") for word in argv if word.startswith("--")}
    return {name[3:] if name not in names and name.startswith("no_") else name for name in typed}


def command_line(argv=None) -> int:
    """Run as a command; returns the exit status: 0, 1 after a failure, 2 for bad input, 128 + the
    signal after Ctrl-C or SIGTERM."""
    config = parse_config(argv)
    config.typed = typed_fields(sys.argv[1:] if argv is None else argv)
    main = Main(config)
    try:
        main.run()
    except UsageError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except FAILURES as error:
        print(f"error: {error}; the checkpoint of the last finished update is kept",
              file=sys.stderr)
        return getattr(error, "exit_status", 1)  # 2 where the env itself was bad input
    except KeyboardInterrupt:  # a second Ctrl-C or SIGTERM, or one before the run began
        print("error: stopped at once; the checkpoint of the last finished update is kept",
              file=sys.stderr)
        return 128 + (getattr(main.guard, "stop_signal", None) or signal.SIGINT)
    stop_signal = main.guard.stop_signal if main.guard is not None else None
    return 0 if stop_signal is None else 128 + stop_signal


# A pasted notebook cell has no __file__: there, defining everything is all this file does.
if __name__ == "__main__" and "__file__" in globals():
    status = command_line()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # all is saved: a late Ctrl-C waits for the exit
    gc.collect()  # the run's cycles freed now (an engine's C++ threads stop with it), then
    gc.freeze()  # the collection at exit skips all objects left, torch's too: ~0.4 s sooner
    sys.exit(status)
