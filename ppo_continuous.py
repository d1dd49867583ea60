"""PPO for games with continuous actions (Pendulum, MuJoCo's robots and friends), in one file.

Proximal Policy Optimization (Schulman et al., 2017: "PPO paper") with the details of CleanRL and
SB3 ("The 37 Implementation Details of PPO", Huang et al., 2022: "37 details"; "continuous #1-#9").

The idea. Policy gradient uses each batch of games once: afterwards the policy has changed. PPO
reuses each batch ("rollout") for several epochs of minibatch steps, keeping the new policy near the
one that played by clipping the probability ratio rho_t = pi(a_t|s_t) / pi_old(a_t|s_t)
(`Trainer.ppo_loss`). The advantage A_t, how much better a_t did than the value V(s_t) expected,
comes from the rewards r_t by GAE (`compute_gae`). Actions are real vectors from a Gaussian policy
(`Model`); running statistics (`RunningMeanStd`) normalise observations and scale rewards.

Run it:         python ppo_continuous.py   (Pendulum-v1; --env HalfCheetah-v5: pip install mujoco)
On N GPUs:      torchrun --standalone --nproc_per_node N ppo_continuous.py  (data parallel)
In a notebook:  Main(Config()).run() (imported, or pasted down to the banner)"""

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

SCRIPT = "ppo_continuous"


def option(default, help, check=None):  # a Config field, its --help line, its valid range
    return dataclasses.field(default=default, metadata={"help": help, "check": check})


# A Config field left at None takes its env's preset (Pendulum's wins the race to -200, the lander's
# looks ahead to its landing) or, for other envs or --no-preset, the general setting: CleanRL's for
# MuJoCo, which learns the robots and BipedalWalker (benchmarks/README.md, "beyond_default_env.py").
PRESET_FIELDS = ("learning_rate", "gamma", "num_minibatches", "clip_value_loss", "num_envs",
                 "num_steps")
GENERAL_SETTING = dict(zip(PRESET_FIELDS, (3e-4, 0.99, 32, True, 1, 2048)))
PRESETS = {"Pendulum-v1": dict(zip(PRESET_FIELDS, (1e-3, 0.97, 4, False, 16, 64))),
           "LunarLanderContinuous-v3": {**GENERAL_SETTING, "gamma": 0.999}}


@dataclasses.dataclass
class Config:
    """Every setting, each a flag (num_envs: --num-envs). None: the env's preset (just above)."""

    # PPO's hyperparameters.
    learning_rate: Optional[float] = option(None, "Adam's step size, annealed linearly to 0", "> 0")
    anneal_lr: bool = option(True, "anneal the learning rate linearly to 0 over the run")
    gamma: Optional[float] = option(None, "discount: looks ~1 / (1 - gamma) steps ahead", "(0, 1]")
    gae_lambda: float = option(0.95, "GAE: bias (0) vs variance (1) of the advantage", "[0, 1]")
    num_minibatches: Optional[int] = option(None, "minibatches each rollout is split into", "> 0")
    update_epochs: int = option(10, "passes over each rollout", "> 0")
    clip_coef: float = option(0.2, "PPO's clip range for the probability ratio", "> 0")
    clip_value_loss: Optional[bool] = option(None, "clip the value update too")
    ent_coef: float = option(0.0, "weight of the entropy bonus", ">= 0")
    vf_coef: float = option(0.5, "weight of the value loss", ">= 0")
    max_grad_norm: float = option(0.5, "clip the global gradient norm to this", "> 0")
    target_kl: Optional[float] = option(None, "stop an update's epochs at this approx KL", "> 0")
    hidden_size: int = option(64, "units in each of the two hidden layers of both MLPs", "> 0")
    normalize_observations: bool = option(True, "normalise observations by running mean and std")
    obs_clip: float = option(10.0, "clip normalised observations to +-this", "> 0")
    scale_rewards: bool = option(True, "divide rewards by the running std of the discounted return")
    reward_clip: float = option(10.0, "clip scaled rewards to +-this", "> 0")

    # Collecting experience.
    env: str = option("Pendulum-v1", "gymnasium id: Box observations, Box (continuous) actions")
    preset: bool = option(True, "the env's preset where it has one (off: the general setting)")
    env_backend: str = option("game", "game: the lesson's Game | torch: Pendulum-v1 in tensors")
    physics: str = option("", "the torch Pendulum's g (gravity), m, l (mass, length), max_speed, "
                          "max_torque, dt, e.g. g=6:14,m=1.2: a range is drawn per game at each "
                          "reset; '': gymnasium's", "g >= 0, the rest > 0, max_torque <= 2")
    num_envs: Optional[int] = option(None, "games played side by side (by each rank)", "> 0")
    num_workers: int = option(0, "child processes that run the games (0 = in this process)", ">= 0")
    num_steps: Optional[int] = option(None, "steps per game in each rollout", "> 0")

    # The run.
    seed: int = option(1, "seeds everything; env i of rank r gets seed + r * num_envs + i", ">= 0")
    total_timesteps: int = option(200_000, "environment steps over all envs (and all ranks)", "> 0")
    device: str = option("auto", "auto | cpu | cuda: auto takes CUDA when present")
    run_dir: Optional[str] = option(None, "logs, checkpoint, summary (default runs/<env>__...)")
    overwrite: bool = option(False, "replace the run already in --run-dir instead of refusing")
    target_return: Optional[float] = option(None, "stop at this mean return of 100 episodes")
    checkpoint_every: int = option(100_000, "save a checkpoint every this many steps", "> 0")
    resume: Optional[str] = option(None, "continue training from this checkpoint or run folder")
    eval: Optional[str] = option(None, "play --eval-episodes games with this checkpoint or run")
    eval_episodes: int = option(10, "games played by --eval", "> 0")
    greedy: bool = option(False, "with --eval, take the mean action instead of sampling")
    video: bool = option(False, "with --eval, write an mp4 of the games into the run dir")
    compile: bool = option(False, "torch.compile (off: it takes longer than learning Pendulum)")
    numpy_on_cpu: bool = option(True, "on the CPU, the shipped lesson's step in NumPy (faster)")


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
            by_env = [f"{env} {settings[f.name]}" for env, settings in PRESETS.items()
                      if settings[f.name] != GENERAL_SETTING[f.name]]  # (the presets that differ)
            line += f" (default: {', '.join(by_env)}, other envs {GENERAL_SETTING[f.name]})"
            default = argparse.SUPPRESS
        parser.add_argument(flag, default=default, help=line,
                            **({"action": argparse.BooleanOptionalAction} if kind is bool else
                               {"type": whole_number if kind is int else kind}))
    return Config(**vars(parser.parse_args(argv)))


if __name__ == "__main__" and "__file__" in globals():
    import os  # NumPy reads this as it loads (below): its matrix products on one core (RunGuard)
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    parse_config()  # --help and a mistyped flag answer here; `command_line` (the end) runs it all

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn


class Game:
    """One gymnasium env as PPO sees it (flat float32 observations). An ended episode restarts in
    the same step: `step` returns the next one's first observation, in `info` the ended one's last
    ("final_obs": to bootstrap from if a time limit cut it), return and length ("episode")."""

    def __init__(self, env_id: str, seed: int, **options):  # options: gym.make's (render_mode)
        self.env, self.seed = gym.make(env_id, **options), seed

    def reset(self) -> np.ndarray:  # seeded the first time; later, the env's own random stream
        obs, _ = self.env.reset(seed=self.seed)
        self.seed, self.episode_return, self.episode_length = None, 0.0, 0
        return np.asarray(obs, dtype=np.float32).reshape(-1)

    def step(self, action: np.ndarray):
        space, info = self.env.action_space, {}
        obs, reward, terminated, truncated, _ = self.env.step(
            action.reshape(space.shape).astype(space.dtype))
        obs = np.asarray(obs, dtype=np.float32).reshape(-1)
        self.episode_return += float(reward)
        self.episode_length += 1
        if terminated or truncated:
            episode = {"return": self.episode_return, "length": self.episode_length}
            obs, info = self.reset(), {"final_obs": obs, "episode": episode}
        return obs, reward, terminated, truncated, info


class StepResult(typing.NamedTuple):
    """One step of all the games, besides the observations: tensors on the device, a row a game."""

    rewards: torch.Tensor  # [num_envs] float32, raw
    terminated: torch.Tensor  # [num_envs] bool: the episode ended in the game
    truncated: torch.Tensor  # [num_envs] bool: a time limit cut the episode
    final_obs: torch.Tensor  # [num_envs, obs_size] raw: the last obs of an ended episode (else any)
    episode_returns: torch.Tensor  # [num_envs] float64: raw return of the episode that ended there
    episode_lengths: torch.Tensor  # [num_envs] int64: its length


class Worker:
    """Plays several Games in a child process (beside the trainer): actions go down a pipe, the
    rest comes back; observations, the one large array, skip the pipe (shared memory: obs_view)."""

    def __init__(self, index: int, env_id: str, seed: int, obs_view: np.ndarray, device="cpu"):
        self.index, self.env_id, self.obs_view, self.device = index, env_id, obs_view, device
        self.trainer_end, child_end = multiprocessing.Pipe()
        self.process = multiprocessing.get_context("fork").Process(
            target=self.child_loop, args=(child_end, env_id, seed, obs_view),
            name=f"{SCRIPT}-worker-{index}", daemon=True)
        self.process.start()
        child_end.close()
        self.receive()  # the child's first answer comes once its Games are reset

    def child_loop(self, conn, env_id: str, seed: int, obs_view: np.ndarray):  # in the child
        games = [Game(env_id, seed + i) for i in range(len(obs_view))]  # game i: seed + i
        obs_view[:] = [game.reset() for game in games]
        conn.send(("ok", None))
        while (command := conn.recv())[0] == "step":
            conn.send(("ok", self.step_games(games, command[1], obs_view)))

    @staticmethod
    def step_games(games: list, actions: np.ndarray, obs_out: np.ndarray) -> tuple:
        """Step each Game (observations into `obs_out`): StepResult's fields, as NumPy arrays."""
        n, final_obs = len(games), np.zeros_like(obs_out)
        rewards, returns, lengths = np.zeros(n, np.float32), np.zeros(n), np.zeros(n, np.int64)
        terminated, truncated = np.zeros(n, bool), np.zeros(n, bool)
        for i, game in enumerate(games):
            obs_out[i], rewards[i], terminated[i], truncated[i], info = game.step(actions[i])
            if "episode" in info:  # the ended episode's last observation, return and length
                final_obs[i], episode = info["final_obs"], info["episode"]
                returns[i], lengths[i] = episode["return"], episode["length"]
        return rewards, terminated, truncated, final_obs, returns, lengths

    def step(self, actions: torch.Tensor) -> StepResult:  # step_games' answer, from the child
        self.trainer_end.send(("step", actions.cpu().numpy()))
        return StepResult(*(torch.from_numpy(part).to(self.device) for part in self.receive()))

    def observations(self) -> torch.Tensor:  # the Games' current observations, on the device
        return torch.from_numpy(self.obs_view).to(self.device)

    def receive(self) -> tuple:  # the child's answer (the observations: in obs_view)
        return self.trainer_end.recv()[1]

    def close(self):  # any command but "step" ends the child's loop
        self.trainer_end.send(("close", None))
        self.process.join()


class RunningMeanStd(nn.Module):
    """The count, mean and variance per feature of all the numbers seen so far, kept without the
    numbers (float64), to normalise what PPO sees as CleanRL and SB3 do (continuous #6-#9): one set
    for all games, the Model's, frozen by --eval. A batch merges in by Chan, Golub and LeVeque's
    formula (1979), exact for any split (n = n_a + n_b, delta = mean_b - mean_a):
        mean = mean_a + delta n_b / n,   var = (var_a n_a + var_b n_b + delta^2 n_a n_b / n) / n
    From count 1e-4, mean 0, variance 1, as theirs (a safe first division). Off: a pass-through."""

    def __init__(self, shape: tuple, device=None, count=1e-4, var=1.0, active: bool = True):
        super().__init__()
        self.active, float64 = active, dict(dtype=torch.float64, device=device)
        self.register_buffer("mean", torch.zeros(shape, **float64), persistent=False)
        self.register_buffer("var", torch.full(shape, var, **float64), persistent=False)
        self.register_buffer("count", torch.tensor(count, **float64), persistent=False)

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
        """Continuous #6-#7: (obs - mean) / std, this batch included (`update`); then clipped."""
        if not self.active:
            return obs
        if update:
            self.update(obs)
        return ((obs - self.mean) / (self.var + 1e-8).sqrt()).clamp(-clip, clip).to(torch.float32)

    def scale(self, rewards, returns, ended, gamma: float, clip: float) -> torch.Tensor:
        """Continuous #8-#9: rewards / std(R), R being each game's discounted return (R <- gamma R
        + r, in `returns`; 0 after an episode end), clipped: value targets near unit scale."""
        if not self.active:
            return rewards
        returns.mul_(gamma).add_(rewards)
        self.update(returns)
        returns.masked_fill_(ended, 0.0)
        return (rewards / torch.sqrt(self.var + 1e-8)).clamp(-clip, clip).to(torch.float32)


def layer(in_size: int, out_size: int, gain: float = math.sqrt(2)) -> nn.Linear:
    """A linear layer, orthogonal weights of the given gain, zero biases (37 details, #2: sqrt(2)
    hidden, 0.01 at the policy output so that every mean starts near 0, 1 at the value's)."""
    linear = nn.Linear(in_size, out_size)
    nn.init.orthogonal_(linear.weight, gain)
    nn.init.zeros_(linear.bias)
    return linear


class Model(nn.Module):
    """The actor-critic, two 64-64 tanh MLPs (37 details, #13, continuous #4): the policy's gives
    the mean of a Gaussian (continuous #1) whose log standard deviation, one per action dimension
    from 0, depends on no state (#2); the dimensions are independent: log-probabilities sum (#3).
    It holds the running statistics of observations and returns: they are the policy's too."""

    def __init__(self, obs_size: int, action_size: int, hidden_size: int = 64,
                 normalize_observations: bool = True, scale_rewards: bool = True):
        super().__init__()
        mlp = lambda out_size, gain: nn.Sequential(
            layer(obs_size, hidden_size), nn.Tanh(), layer(hidden_size, hidden_size), nn.Tanh(),
            layer(hidden_size, out_size, gain=gain))
        self.critic, self.actor = mlp(1, 1.0), mlp(action_size, 0.01)
        self.log_std = nn.Parameter(torch.zeros(1, action_size))
        self.obs_stats = RunningMeanStd((obs_size,), active=normalize_observations)
        self.return_stats = RunningMeanStd((), active=scale_rewards)

    def value(self, obs: torch.Tensor) -> torch.Tensor:
        return self.critic(obs).squeeze(-1)

    @staticmethod
    def gaussian_log_prob(actions, mean, log_std) -> torch.Tensor:
        """log N(a; mu, sigma) summed over the action dimensions: [batch]. (Continuous #3.)
        $\\sum_i -(a_i - \\mu_i)^2 / (2\\sigma_i^2) - \\log\\sigma_i - \\tfrac12 \\log 2\\pi$"""
        squared = ((actions - mean) / log_std.exp()) ** 2
        return (-0.5 * squared - log_std - 0.5 * math.log(2 * math.pi)).sum(-1)

    def act(self, obs: torch.Tensor, greedy: bool = False):
        """(sampled, unbounded actions [batch, action_size], their log-probabilities, values)."""
        mean = self.actor(obs)
        log_std = self.log_std.expand_as(mean)
        actions = mean if greedy else mean + log_std.exp() * torch.randn_like(mean)
        return actions, self.gaussian_log_prob(actions, mean, log_std), self.value(obs)

    def evaluate_actions(self, obs: torch.Tensor, actions: torch.Tensor):
        """For the loss: the taken actions' log-probabilities, the entropy, the values ([batch])."""
        mean = self.actor(obs)
        log_prob = self.gaussian_log_prob(actions, mean, self.log_std.expand_as(mean))
        # The same in every state: $H = \\sum_i \\tfrac12 + \\tfrac12 \\log 2\\pi + \\log \\sigma_i$
        entropy = (0.5 + 0.5 * math.log(2 * math.pi) + self.log_std).sum(-1).expand(len(obs))
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
    lambda = 0 is the one-step estimate, lambda = 1 the sampled return minus V(s_t). d_t = dones[t]
    = 1 when the episode ended at step t (after action t), by termination or truncation: it cuts the
    sum; a truncated step's reward already holds + gamma V(final observation). CleanRL's `dones[t]`
    ("obs[t] starts a new episode") is one step later than here; the advantages are the same."""
    advantages = torch.zeros_like(rewards)
    next_advantage, next_value = torch.zeros_like(last_value), last_value
    for t in reversed(range(rewards.shape[0])):
        not_done = 1.0 - dones[t]
        delta = rewards[t] + gamma * next_value * not_done - values[t]
        advantages[t] = next_advantage = delta + gamma * gae_lambda * not_done * next_advantage
        next_value = values[t]
    return advantages


class Minibatch(typing.NamedTuple):
    """A shuffled slice of the rollout, one row per step: what the Trainer learns from."""

    obs: torch.Tensor  # [batch, obs_size], normalised, as the policy saw them
    actions: torch.Tensor  # [batch, action_size], the sampled (unclipped) actions it took
    old_log_probs: torch.Tensor  # their log-probabilities then
    advantages: torch.Tensor  # from GAE
    returns: torch.Tensor  # the value targets: advantages + old values
    old_values: torch.Tensor  # the values then


class Rollout:
    """The rollout buffer: what the current policy saw, did and got, [num_steps, num_envs, ...]."""

    def __init__(self, config: Config, obs_size: int, action_size: int, device: torch.device):
        shape = (config.num_steps, config.num_envs)
        self.obs, self.actions, self.log_probs, self.values, self.rewards, self.dones = (
            torch.zeros(shape + size, device=device)
            for size in [(obs_size,), (action_size,), (), (), (), ()])

    def minibatch(self, indices: torch.Tensor, advantages, returns) -> Minibatch:
        rows = lambda tensor: tensor.flatten(0, 1)[indices]  # flat index: step * num_envs + env
        return Minibatch(rows(self.obs), rows(self.actions), rows(self.log_probs),
                         rows(advantages), rows(returns), rows(self.values))


class Trainer:
    """One PPO step on one minibatch: clipped surrogate, value loss, entropy bonus, clipped norm."""

    def __init__(self, model: Model, config: Config, optimizer: type = torch.optim.Adam):
        self.model, self.config = model, config
        # Adam with eps 1e-5, not 1e-8 (37 details, #3).
        self.optimizer = optimizer(model.parameters(), lr=config.learning_rate, eps=1e-5)
        self.average_gradients = lambda parameters: None  # torchrun's hook (see gradient_step)

    @staticmethod
    def ppo_loss(minibatch: Minibatch, new_log_probs, entropy, new_values, config: Config):
        """The negated PPO objective of a minibatch, and its diagnostics (the inputs: [batch]).

        Why a ratio: the samples were drawn by pi_old, the policy that played the rollout, but the
        gradient should raise E_{a ~ pi_theta}[A]. Importance sampling reweights each sample by
        rho_t = pi_theta(a_t|s_t) / pi_old(a_t|s_t): E_{pi_theta}[A] = E_{pi_old}[rho_t A_t]. At
        theta = theta_old its gradient is the plain policy gradient; further away it lets one
        rollout serve several epochs, but the estimate worsens as the policies part (other states
        would be visited; rho_t's variance grows). Why clip: TRPO bounds the move with a KL
        constraint; PPO (paper, eq. 7) stops rewarding it beyond [1 - eps, 1 + eps]:
            L_clip = E_t[ min(rho_t A_t, clip(rho_t, 1 - eps, 1 + eps) A_t) ]
        Out of range in the helpful direction (rho_t > 1 + eps with A_t > 0, or rho_t < 1 - eps with
        A_t < 0), the clipped term is constant: no gradient. Why the minimum: a pessimistic bound,
        so a move that made things worse (rho_t < 1 - eps with A_t > 0) is never hidden: then the
        unclipped term is the smaller one, and its gradient pulls back."""
        # Advantage normalisation per minibatch (37 details, #7): one step size suits every game.
        advantages = minibatch.advantages
        advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
        # The clipped surrogate (37 details, #8), negated: the max of the negations is the min.
        log_ratio = new_log_probs - minibatch.old_log_probs
        ratio = log_ratio.exp()
        clipped_ratio = ratio.clamp(1 - config.clip_coef, 1 + config.clip_coef)
        policy_loss = torch.max(-advantages * ratio, -advantages * clipped_ratio).mean()
        # Value loss (37 details, #9): squared error to the GAE returns, clipped only if asked.
        returns, old_values, clip = minibatch.returns, minibatch.old_values, config.clip_coef
        value_loss = (new_values - returns) ** 2
        if config.clip_value_loss:
            clipped = old_values + (new_values - old_values).clamp(-clip, clip)
            value_loss = torch.max(value_loss, (clipped - returns) ** 2)
        value_loss = 0.5 * value_loss.mean()
        # Entropy bonus (37 details, #10): rewards a spread-out policy, which keeps exploring.
        entropy_mean = entropy.mean()
        loss = policy_loss - config.ent_coef * entropy_mean + config.vf_coef * value_loss
        # Diagnostics (37 details, #12): approx KL, (rho - 1) - log rho (Schulman, 2020); clipped.
        with torch.no_grad():
            approx_kl = ((ratio - 1) - log_ratio).mean()
            clip_fraction = ((ratio - 1).abs() > config.clip_coef).float().mean()
        return loss, {"policy_loss": policy_loss, "value_loss": value_loss, "entropy": entropy_mean,
                      "approx_kl": approx_kl, "clip_fraction": clip_fraction}

    def compute_loss(self, minibatch: Minibatch):  # under the current weights (--compile's part)
        evaluated = self.model.evaluate_actions(minibatch.obs, minibatch.actions)  # log pi, H, V
        return self.ppo_loss(minibatch, *evaluated, self.config)

    def gradient_step(self, minibatch: Minibatch) -> dict:
        """Loss, backward, the ranks' mean gradient (torchrun), norm clip, Adam; the diagnostics."""
        loss, stats = self.compute_loss(minibatch)
        self.optimizer.zero_grad()
        loss.backward()
        self.average_gradients(self.model.parameters())  # hook: under torchrun, the ranks' mean
        # Global gradient clipping (37 details, #11): a rare huge step cannot undo the policy.
        stats["grad_norm"] = nn.utils.clip_grad_norm_(self.model.parameters(),
                                                      self.config.max_grad_norm)
        self.optimizer.step()
        return stats


class Run:
    """The plain run `Main.train` talks to: seeds, device, sizes, the games, progress, summary.
    `RunGuard`, below the banner, extends it: Ctrl-C, checkpoints, NaN guard, torchrun, engines."""

    def __init__(self, main: "Main"):
        self.main, self.config, self.games, self.summary = main, main.config, None, None
        self.returns, self.episodes, self.updates, self.solved_step = deque(maxlen=100), 0, 0, None

    def __enter__(self) -> "Run":
        """The env's preset; seed torch's draws (sampling, shuffling); the device; the sizes."""
        config = self.config = self.main.config = with_preset(self.config)
        self.start_time = time.perf_counter()
        torch.manual_seed(config.seed)
        cuda = config.device != "cpu" and torch.cuda.is_available()
        self.device, self.steps_per_step = torch.device("cuda" if cuda else "cpu"), config.num_envs
        with gym.make(config.env) as env:  # its spaces: the Model's sizes, the action bounds
            space, self.obs_size = env.action_space, int(np.prod(env.observation_space.shape))
        self.action_size, self.action_bounds = int(np.prod(space.shape)), [
            torch.as_tensor(bound, dtype=torch.float32, device=self.device).flatten()
            for bound in (space.low, space.high)]
        return self

    prepare_learner = lambda self: 0  # the step to start from (RunGuard's: --resume's)
    stop_at_once = lambda self: False  # end the rollout now (RunGuard's: after Ctrl-C)
    mean = lambda self, value: value  # a number's mean over the ranks (RunGuard's: torchrun)
    optimizer = torch.optim.Adam  # the Trainer's (RunGuard's: a copy, the same steps, 2 s sooner)

    def start_games(self) -> Worker:
        """All the games in one Worker, game i seeded with seed + i (RunGuard's: --num-workers)."""
        obs = torch.zeros(self.config.num_envs, self.obs_size).share_memory_()
        self.games = Worker(0, self.config.env, self.config.seed, obs.numpy(), self.device)
        return self.games

    def after_rollout(self, episodes: list):
        """Record the ended episodes' returns ((step, StepResult) pairs); note --target-return."""
        target = self.config.target_return
        for step, result in episodes:
            for row in (result.terminated | result.truncated).nonzero().flatten().tolist():
                self.episodes += 1
                self.returns.append(float(result.episode_returns[row]))
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
        self.summary = {"script": SCRIPT, "env": self.config.env, "seed": self.config.seed,
                        "steps": self.main.global_step, "episodes": self.episodes,
                        "seconds": round(time.perf_counter() - self.start_time, 3),
                        "mean_return_100": float(np.mean(self.returns)) if self.returns else None,
                        "solved_step": self.solved_step}

    @staticmethod
    def evaluate(config: Config) -> dict:  # --eval: the machinery's (below the banner)
        raise NotImplementedError("--eval plays a checkpoint: the machinery below the banner")


class Main:
    """The loop: `Main(config).run()` trains (or --eval plays) and returns the summary as a dict.
    One iteration (37 details, #6): play, estimate each step's advantage (GAE), learn for epochs."""

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
            self.model = Model(guard.obs_size, guard.action_size, config.hidden_size,
                               config.normalize_observations, config.scale_rewards)
            self.trainer = Trainer(self.model.to(guard.device), config, guard.optimizer)
            self.discounted_returns = self.model.return_stats.mean.new_zeros(config.num_envs)  # R
            self.global_step = guard.prepare_learner()  # 0, or --resume's; compile, NumPy, torchrun
            self.games = guard.start_games()  # Workers of Games (or the machinery's engines)
            self.rollout = Rollout(config, guard.obs_size, guard.action_size, guard.device)
            next_obs = self.model.obs_stats.normalize(self.games.observations(), config.obs_clip)
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
        """Linear learning-rate annealing (37 details, #4): to 0 at the end, set per rollout."""
        start_step, start_rate = self.anneal_from
        progress = (self.global_step - start_step) / (self.config.total_timesteps - start_step)
        rate = start_rate * max(0.0, 1.0 - progress) if self.config.anneal_lr else start_rate
        for group in self.trainer.optimizer.param_groups:
            group["lr"] = rate

    @torch.inference_mode()  # like no_grad, and skips autograd's version counting too: faster
    def collect_rollout(self, next_obs: torch.Tensor) -> torch.Tensor:
        """Play num_steps steps of every game into the rollout; the next (normalised) obs."""
        config, rollout, guard, model = self.config, self.rollout, self.guard, self.model
        episodes = []  # (step, its result): which games ended, their raw returns and lengths
        for step in range(config.num_steps):
            if guard.stop_at_once():  # Ctrl-C (see RunGuard)
                break
            rollout.obs[step] = next_obs
            actions, rollout.log_probs[step], rollout.values[step] = model.act(next_obs)
            rollout.actions[step] = actions
            # Continuous #5: the env gets it clipped, the rollout keeps the sample (the ratio's)
            result = self.games.step(actions.clamp(*guard.action_bounds))
            # Continuous #6-#9; the episode returns and --target-return stay raw.
            next_obs = model.obs_stats.normalize(self.games.observations(), config.obs_clip)
            ended = result.terminated | result.truncated
            rewards = model.return_stats.scale(result.rewards, self.discounted_returns, ended,
                                               config.gamma, config.reward_clip)
            # Truncation is not death: a time-limit cut would have gone on, so its last reward gets
            # gamma * V(final observation); the done flag then cuts GAE's sum for both endings.
            cut = result.truncated & ~result.terminated
            if cut.any():  # (most steps cut no episode: skip the extra forward pass then)
                last = model.obs_stats.normalize(result.final_obs, config.obs_clip, update=False)
                rewards = rewards + config.gamma * model.value(last) * cut
            rollout.rewards[step], rollout.dones[step] = rewards, ended
            self.global_step += guard.steps_per_step  # num_envs of every rank
            episodes.append((self.global_step, result))
        guard.after_rollout(episodes)  # record the episodes (and stop on Ctrl-C)
        return next_obs

    @torch.no_grad()
    def estimate_advantages(self, next_obs: torch.Tensor):
        """GAE over the rollout: (advantages, returns), both [num_steps, num_envs]."""
        rollout, config, last_value = self.rollout, self.config, self.model.value(next_obs)
        advantages = compute_gae(rollout.rewards, rollout.values, rollout.dones, last_value,
                                 config.gamma, config.gae_lambda)
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
            # Early stop (37 details, #12, optional): the policy has moved too far from the player.
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
# A reader of PPO may stop here. What follows makes the lesson fast, safe and scalable, section by
# section: `RunGuard` and `RunLog` extend the lesson's plain `Run` (Ctrl-C, failures, logging).

import copy
import datetime
import gc
import hashlib
import importlib
import inspect
import json
import logging
import multiprocessing.connection
import os
import random
import signal
import sys
import threading
from pathlib import Path

import torch.distributed as dist  # already loaded by `import torch`: costs nothing more

# ----- Engines: the games, fast and guarded -------------------------------------------------------


class GuardedWorker(Worker):
    """A Worker made safe for long runs. The child ignores SIGINT, reports its Games' errors in one
    line, and closes its copies of the trainer's pipe ends (it exits once the trainer is gone); the
    trainer waits on pipe and process at once: a child that dies is a WorkerError, not a hang."""

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

    def send_step(self, actions: np.ndarray):  # WorkerPool sends to all first, then receives
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
    """--num-workers 0: a Worker's Games, played in this process as its child would (no pipe)."""

    def __init__(self, index: int, env_id: str, seed: int, obs_view: np.ndarray,
                 inherited_trainer_ends: list):
        self.index, self.env_id, self.obs_view, self.trainer_end = index, env_id, obs_view, None
        self.games = [Game(env_id, seed + i) for i in range(len(obs_view))]
        obs_view[:] = [game.reset() for game in self.games]

    def send_step(self, actions: np.ndarray):
        self.actions = actions

    def receive(self) -> tuple:
        return self.step_games(self.games, self.actions, self.obs_view)

    def close(self):
        for game in self.games:
            game.env.close()


class WorkerPool:
    """All the games of this rank: num_workers Workers of num_envs / num_workers Games each (one in
    this process with --num-workers 0), their observations in one shared [num_envs, obs_size]."""

    def __init__(self, config: Config, obs_size: int, first_seed: int, device: torch.device):
        self.device, self.workers, children = device, [], config.num_workers
        self.obs_tensor = torch.zeros(config.num_envs, obs_size).share_memory_()
        self.obs_array, size = self.obs_tensor.numpy(), config.num_envs // max(children, 1)
        where = f"per Worker in {children} child processes" if children else "in this process"
        self.engine = f"the lesson's Game, {size} {where}"
        try:
            for first in range(0, config.num_envs, size):
                self.workers.append((GuardedWorker if children else InProcessWorker)(
                    first // size, config.env, first_seed + first,
                    self.obs_array[first:first + size],
                    [worker.trainer_end for worker in self.workers if worker.trainer_end]))
        except BaseException:
            self.close()  # the workers started so far
            raise

    def observations(self) -> torch.Tensor:  # on the training device (no copy on the CPU)
        return self.obs_tensor.to(self.device)

    def step(self, actions: torch.Tensor) -> StepResult:  # all sent first: the children run at once
        for worker, part in zip(self.workers, np.split(actions.cpu().numpy(), len(self.workers))):
            worker.send_step(part)
        parts = zip(*(worker.receive() for worker in self.workers))  # each field, worker by worker
        return StepResult(*(torch.from_numpy(np.concatenate(part)).to(self.device)
                            for part in parts))

    def close(self):
        for worker in self.workers:
            worker.close()
        self.workers = []


class TorchPendulum:
    """gymnasium's Pendulum-v1 in torch (`--env-backend torch`): all games' states (angle, speed)
    in one tensor on the device, restarted in the same step: gymnasium's game (tests/ compare).
    As in TorchRL's Pendulum, each game has its own physics (a tensor [num_envs] each): gravity g,
    the rod's mass m and length l, its max_speed, the motor's max_torque, the time step dt.
    `physics` ({name: (low, high)}, from --physics) fixes a value or draws a range per game,
    uniformly, at each of its resets, from the engine's seeded generator; PHYSICS: gymnasium's."""

    PHYSICS = {"g": 10.0, "m": 1.0, "l": 1.0, "max_speed": 8.0, "max_torque": 2.0, "dt": 0.05}
    MAX_EPISODE_STEPS = 200
    engine = ("the torch Pendulum (Pendulum-v1 in tensors, the same game as Game: "
              "tests/test_continuous.py); --env-backend game plays the lesson's Game")

    def __init__(self, num_envs: int, seed: int, device: torch.device,
                 physics: Optional[dict] = None):
        self.device, self.generator = device, torch.Generator(device=device).manual_seed(seed)
        self.physics = {name: (low,) * 2 for name, low in self.PHYSICS.items()} | (physics or {})
        self.state = self.random_states(num_envs)
        for name, (low, _) in self.physics.items():  # (the ranges: drawn just below)
            setattr(self, name, torch.full((num_envs,), low, dtype=torch.float64, device=device))
        self.ranges = [name for name, (low, high) in self.physics.items() if low < high]
        self.restart_physics(torch.ones(num_envs, dtype=torch.bool, device=device))
        self.steps = torch.zeros(num_envs, dtype=torch.int64, device=device)
        self.episode_returns = torch.zeros(num_envs, dtype=torch.float64, device=device)
        # The bounds its games can reach (gymnasium's declared ones, with gymnasium's physics).
        top_speed, top_torque = self.physics["max_speed"][1], self.physics["max_torque"][1]
        high = np.array([1.0, 1.0, top_speed], dtype=np.float32)
        self.observation_space = gym.spaces.Box(-high, high, dtype=np.float32)
        self.reward_range = (-(math.pi ** 2 + 0.1 * top_speed ** 2 + 0.001 * top_torque ** 2), 0.0)

    def random_states(self, n: int) -> torch.Tensor:
        """Starting states, float64 like gymnasium's: th ~ U(-pi, pi), thdot ~ U(-1, 1)."""
        u = torch.rand(n, 2, generator=self.generator, dtype=torch.float64, device=self.device)
        return (2 * u - 1) * u.new_tensor([math.pi, 1.0])

    def restart_physics(self, restarted: torch.Tensor):
        """Each range drawn anew for the games `restarted` (a mask); then the step's two gains."""
        for name in self.ranges:  # (fixed values draw nothing: the generator's stream is kept)
            low, high = self.physics[name]
            u = torch.rand(len(restarted), generator=self.generator, dtype=torch.float64,
                           device=self.device)
            setattr(self, name, torch.where(restarted, low + (high - low) * u, getattr(self, name)))
        # A rod of mass m and length l turns about one end (moment of inertia m l^2 / 3), pulled
        # by gravity at its middle and turned by the torque u: theta'' = (m g l / 2 sin(theta) +
        # u) / (m l^2 / 3) = 3 g / (2 l) sin(theta) + 3 / (m l^2) u, in gymnasium's order.
        self.gravity_gain = 3 * self.g / (2 * self.l)
        self.torque_gain = 3.0 / (self.m * self.l ** 2)

    def observations(self) -> torch.Tensor:
        theta, theta_dot = self.state.unbind(1)
        return torch.stack([theta.cos(), theta.sin(), theta_dot], dim=1).to(torch.float32)

    def step(self, actions: torch.Tensor) -> StepResult:
        torque = actions[:, 0].to(torch.float64).clamp(-self.max_torque, self.max_torque)
        theta, theta_dot = self.state.unbind(1)
        normalised_angle = (theta + math.pi) % (2 * math.pi) - math.pi
        rewards = -(normalised_angle ** 2 + 0.1 * theta_dot ** 2 + 0.001 * torque ** 2)
        acceleration = self.gravity_gain * theta.sin() + self.torque_gain * torque
        theta_dot = (theta_dot + acceleration * self.dt).clamp(-self.max_speed, self.max_speed)
        self.state = torch.stack([theta + theta_dot * self.dt, theta_dot], dim=1)
        self.steps += 1
        self.episode_returns += rewards
        truncated = self.steps >= self.MAX_EPISODE_STEPS
        result = StepResult(rewards.to(torch.float32), torch.zeros_like(truncated), truncated,
                            self.observations(), self.episode_returns.clone(), self.steps.clone())
        # Same-step restart, without a host sync: fresh states for all, kept where a game ended.
        self.state = torch.where(truncated[:, None], self.random_states(len(truncated)), self.state)
        if self.ranges:
            self.restart_physics(truncated)
        self.steps.masked_fill_(truncated, 0)
        self.episode_returns.masked_fill_(truncated, 0.0)
        return result

    @classmethod
    def checked(cls, config: Config, first_seed: int, device: torch.device) -> "TorchPendulum":
        """The engine, once a spare one passed check_env_specs against the declared spaces:
        gymnasium's (gym.make's) with gymnasium's physics, else those its own physics allows."""
        env, physics = gym.make(config.env), parse_physics(config.physics)
        spare = cls(4, first_seed, device, physics)
        check_env_specs(spare, 4, spare.observation_space if physics else env.observation_space,
                        env.action_space)
        return cls(config.num_envs, first_seed, device, physics)

    def describe(self) -> str:
        """Its physics in words, for the start-up and --eval lines."""
        words = ", ".join(f"{name} {low:g}" + f" to {high:g}" * (low < high)
                          for name, (low, high) in self.physics.items())
        gymnasiums = all(self.physics[name] == (value,) * 2 for name, value in self.PHYSICS.items())
        return words + (" (ranges drawn per game at each reset)" if self.ranges else
                        " (gymnasium's)" if gymnasiums else "")

    def close(self):
        pass


def check_env_specs(engine, num_envs: int, obs_space, action_space, steps: int = 210):
    """As TorchRL's check_env_specs: step a spare engine with random actions (a third beyond the
    bounds) through a truncation; any shape, dtype or bound not as declared raises RuntimeError."""
    obs_shape = (num_envs, int(np.prod(obs_space.shape)))
    obs_bounds = [torch.as_tensor(bound, device=engine.device).flatten()
                  for bound in (obs_space.low, obs_space.high)]
    low, high = (torch.as_tensor(bound, device=engine.device)
                 for bound in (action_space.low, action_space.high))

    def check(what: str, tensor: torch.Tensor, shape: tuple, dtype: torch.dtype, bounds=None):
        problem = (f"shape {tuple(tensor.shape)}" if tuple(tensor.shape) != shape else
                   f"dtype {tensor.dtype}" if tensor.dtype != dtype else
                   "values out of bounds" if bounds is not None and not (
                       (tensor >= bounds[0]).all() and (tensor <= bounds[1]).all()) else None)
        if problem:
            raise RuntimeError(f"{type(engine).__name__}: {what} has {problem}, not as declared "
                               f"{shape} {dtype} {tuple(bounds) if bounds else ''}")

    truncations = 0
    check("an observation", engine.observations(), obs_shape, torch.float32, obs_bounds)
    for _ in range(steps):
        uniform = torch.rand(num_envs, *low.shape, device=engine.device, generator=engine.generator)
        result = engine.step(low + (3 * uniform - 1) * (high - low))
        check("an observation", engine.observations(), obs_shape, torch.float32, obs_bounds)
        check("a final observation", result.final_obs, obs_shape, torch.float32, obs_bounds)
        check("a reward", result.rewards, (num_envs,), torch.float32, engine.reward_range)
        check("terminated", result.terminated, (num_envs,), torch.bool)
        check("truncated", result.truncated, (num_envs,), torch.bool)
        truncations += int(result.truncated.sum())
    if truncations != num_envs * (steps // engine.MAX_EPISODE_STEPS):
        raise RuntimeError(f"{type(engine).__name__}: {truncations} truncations in {steps} steps "
                           f"of {num_envs} games, not one per {engine.MAX_EPISODE_STEPS} steps")


def ended_episodes(episodes: list) -> list:
    """(step, statistics) of each episode the rollout ended, read from the device at once."""
    if not episodes:
        return []
    steps, results = zip(*episodes)
    ended, returns, lengths = (torch.stack(part).cpu() for part in zip(*(
        (result.terminated | result.truncated, result.episode_returns, result.episode_lengths)
        for result in results)))
    return [(steps[t], {"return": float(returns[t, i]), "length": int(lengths[t, i])})
            for t, i in ended.nonzero().tolist()]

# ----- The CPU's fast path (the lesson's step in NumPy, while unedited); compilation; Adam --------

# The lesson's definitions that NumpyPlayer and NumpyLearner compute again, and the sha256 of each
# one's source as shipped: where one differs (a reader's edit) or cannot be read (a notebook's
# cell), the lesson's torch code runs. After a change on purpose, make the NumPy path equal again
# (tests/test_continuous.py), then renew LESSON_DIGEST.
NUMPY_STANDS_IN_FOR = ("RunningMeanStd", "Model", "compute_gae", "Minibatch", "Rollout", "Adam",
                       "Trainer", "Main.collect_rollout", "Main.estimate_advantages")
LESSON_DIGEST = {
    "RunningMeanStd": "00cb0e1c213ad1e9f65cbeace32c42ddefd6e9b6a9d7d7738b6f3743f8c65ea9",
    "Model": "5d78e05a6e70c509458280f01ac0abbf3ad127ff22d259d25cb17047fd348be2",
    "compute_gae": "0cb59dcfab7777082d002fe6cb760f1a231692919658a3624b92268f00ce658e",
    "Minibatch": "2fc4fe679e94f546176bbfcba44007c3552a04ee17a599c7a03cf7b9d9f7e7c1",
    "Rollout": "9a82272357fc03681bfc3176f384f870130eed36a7508062eee8abcff747e4c4",
    "Adam": "a76bd935a7c7e25a46f1cf2ed115c56131cace4295f371d48a8503d589d17f64",
    "Trainer": "38fdccf0c12aafc25e10989ca99f0887224635ba6dfce7e8352fecebc6a39835",
    "Main.collect_rollout": "ceb4cbf89e515cd2d465ee7e9c1577b11c5318496912ca0ff7f431e05c58a3dd",
    "Main.estimate_advantages": "bd68302ee5f265729cae81a4b9e20da6576f948f9822d6b3da2dd39188b28245",
}


def lesson_digest() -> dict:
    """The sha256 of the source of each of NUMPY_STANDS_IN_FOR as it is now (None: unreadable)."""
    digests = {}
    for name in NUMPY_STANDS_IN_FOR:
        owner, _, method = name.partition(".")
        try:  # (OSError, TypeError: no source to read, as in a notebook's cell)
            definition = getattr(globals()[owner], method) if method else globals()[owner]
            digests[name] = hashlib.sha256(inspect.getsource(definition).encode()).hexdigest()
        except Exception:
            digests[name] = None
    return digests


def use_numpy_on_cpu(main: Main) -> str:
    """--numpy-on-cpu (the default): torch's dispatch of the lesson's many small operations costs
    more than a game's step, NumPy's far less (benchmarks/README.md). So, while the lesson is the
    shipped one, NumpyPlayer and NumpyLearner compute it again in NumPy on its own tensors (shared
    memory), equal up to rounding (tests/); torchrun and --compile keep torch's gradient step,
    Workers in child processes the lesson's rollout. Returns the learner's start-up line."""
    config, guard, torch_code = main.config, main.guard, "learner: the lesson's torch code"
    if not config.numpy_on_cpu or guard.device.type != "cpu":
        return torch_code + (", torch.compile" if config.compile else "")
    digests = lesson_digest()
    differ = [name for name in NUMPY_STANDS_IN_FOR if digests[name] != LESSON_DIGEST.get(name)]
    if type(main.trainer.optimizer) is not Adam:  # the lesson's Run names another optimizer
        differ.append("Run.optimizer")
    if None in digests.values() or differ:
        why = ("its source cannot be read here" if None in digests.values() else
               f"{', '.join(differ)} differ{'s' * (len(differ) == 1)} from the shipped lesson")
        return f"{torch_code}: {why} (the NumPy fast path steps aside)"
    torch_step = "torchrun" if guard.ranks.world_size > 1 else "--compile" if config.compile else ""
    if not torch_step:
        main.trainer.gradient_step = NumpyLearner(main).gradient_step
    player = NumpyPlayer(main)  # (after the learner, which moves the weights into flat arrays)
    main.estimate_advantages = player.estimate_advantages
    if config.env_backend == "game" and config.num_workers == 0:
        main.collect_rollout = player.collect_rollout
    gradient = f" (torch steps the gradient: {torch_step})" if torch_step else ""
    return (f"learner: NumPy fast path{gradient}, equal to the lesson's (tests/test_continuous.py; "
            f"--no-numpy-on-cpu runs the lesson's torch code)")


def numpy_layers(mlp: nn.Sequential) -> list:
    """(W [out, in], b [out]) of each Linear of one of the Model's MLPs, as NumPy views."""
    return [(linear.weight.detach().numpy(), linear.bias.detach().numpy()) for linear in mlp[::2]]


def numpy_mlp(layers: list, x: np.ndarray, inputs: Optional[list] = None) -> np.ndarray:
    """x through Linear-tanh-Linear-tanh-Linear; `inputs` collects each layer's input."""
    for index, (weight, bias) in enumerate(layers):
        if inputs is not None:
            inputs.append(x)
        x = x @ weight.T + bias
        if index < len(layers) - 1:
            x = np.tanh(x)
    return x


def numpy_merge(stats: RunningMeanStd, batch: np.ndarray):
    """RunningMeanStd.update on NumPy views of its tensors: a batch [n, *shape] merged in."""
    count, counted = len(batch), stats.count.numpy()  # (a 0-d view of the count)
    batch_mean = np.add.reduce(batch, 0, np.float64) / count
    batch_var = np.add.reduce((batch - batch_mean) ** 2, 0) / count
    seen, mean, var = float(counted), stats.mean.numpy(), stats.var.numpy()
    total = seen + count
    delta = batch_mean - mean
    var *= seen / total
    var += batch_var * (count / total) + delta ** 2 * (seen * count / total ** 2)
    mean += delta * (count / total)
    counted[...] = total


def numpy_normalize(stats: RunningMeanStd, obs: np.ndarray, clip: float, update: bool = True):
    """RunningMeanStd.normalize of rows of float32."""
    if not stats.active:
        return obs
    if update:
        numpy_merge(stats, obs)
    scaled = (obs - stats.mean.numpy()) / np.sqrt(stats.var.numpy() + 1e-8)
    return np.minimum(np.maximum(scaled, -clip), clip).astype(np.float32)


class NumpyPlayer:
    """Main.collect_rollout and Main.estimate_advantages in NumPy (see use_numpy_on_cpu)."""

    def __init__(self, main: Main):
        self.main, self.config, self.guard = main, main.config, main.guard
        self.actor, self.critic = numpy_layers(main.model.actor), numpy_layers(main.model.critic)
        self.log_std = main.model.log_std.detach().numpy()  # [1, action_size]

    def collect_rollout(self, next_obs: torch.Tensor) -> torch.Tensor:
        """Main.collect_rollout step for step (its comments say why); noise drawn once a rollout."""
        main, config, guard, rollout = self.main, self.config, self.guard, self.main.rollout
        worker, pool_obs = main.games.workers[0], main.games.obs_array  # (an InProcessWorker)
        obs, actions, log_probs, values, rewards_out, dones = (
            tensor.numpy() for tensor in (rollout.obs, rollout.actions, rollout.log_probs,
                                          rollout.values, rollout.rewards, rollout.dones))
        low, high = (bound.numpy() for bound in guard.action_bounds)
        log_std, std = self.log_std, np.exp(self.log_std)
        noise = torch.randn(actions.shape).numpy()
        returns, return_stats = main.discounted_returns.numpy(), main.model.return_stats
        next_obs, episodes = next_obs.numpy(), []
        for step in range(config.num_steps):
            if guard.stop_at_once():
                break
            obs[step] = next_obs
            mean = numpy_mlp(self.actor, next_obs)
            values[step] = numpy_mlp(self.critic, next_obs)[:, 0]
            actions[step] = sampled = mean + std * noise[step]
            log_probs[step] = (-0.5 * ((sampled - mean) / std) ** 2 - log_std
                               - 0.5 * math.log(2 * math.pi)).sum(-1)
            sent = np.minimum(np.maximum(sampled, low), high)
            result = worker.step_games(worker.games, sent, pool_obs)  # StepResult's, in NumPy
            next_obs = numpy_normalize(main.model.obs_stats, pool_obs, config.obs_clip)
            rewards, terminated, truncated, final_obs = result[:4]
            ended = terminated | truncated
            if return_stats.active:  # RunningMeanStd.scale
                returns *= config.gamma
                returns += rewards
                numpy_merge(return_stats, returns)
                returns[ended] = 0.0
                rewards = rewards / np.float32(np.sqrt(return_stats.var.numpy() + 1e-8))
                rewards = np.minimum(np.maximum(rewards, -config.reward_clip), config.reward_clip)
            cut = truncated & ~terminated
            if cut.any():
                last = numpy_normalize(main.model.obs_stats, final_obs, config.obs_clip,
                                       update=False)
                rewards = rewards + config.gamma * numpy_mlp(self.critic, last)[:, 0] * cut
            rewards_out[step], dones[step] = rewards, ended
            main.global_step += guard.steps_per_step
            if ended.any():  # for the episodes' records
                episodes.append((main.global_step, StepResult(*map(torch.from_numpy, result))))
        guard.after_rollout(episodes)
        return torch.from_numpy(next_obs)

    def estimate_advantages(self, next_obs: torch.Tensor):
        """Main.estimate_advantages: compute_gae's loop, a NumPy row of games a step."""
        rollout, config = self.main.rollout, self.config
        rewards, values, dones = (tensor.numpy() for tensor in (rollout.rewards, rollout.values,
                                                                rollout.dones))
        next_value = numpy_mlp(self.critic, next_obs.numpy())[:, 0]
        advantages, next_advantage = np.zeros_like(rewards), np.zeros_like(next_value)
        for t in reversed(range(len(rewards))):
            not_done = 1.0 - dones[t]
            delta = rewards[t] + config.gamma * next_value * not_done - values[t]
            advantages[t] = next_advantage = (
                delta + config.gamma * config.gae_lambda * not_done * next_advantage)
            next_value = values[t]
        advantages = torch.from_numpy(advantages)
        return advantages, advantages + rollout.values


class NumpyLearner:
    """Trainer.gradient_step in NumPy (see use_numpy_on_cpu): Trainer.ppo_loss, its gradient by the
    chain rule, the global norm clipped, Adam.step. The weights and Adam's moments move into a flat
    array each (the tensors become views): clipping and Adam are a few operations on all at once."""

    def __init__(self, main: Main):
        self.config, optimizer = main.config, main.trainer.optimizer
        named = list(main.model.named_parameters())  # the order of the optimizer's parameters
        total = sum(param.numel() for _, param in named)
        self.params, self.exp_avg, self.exp_avg_sq, self.grad = (
            np.zeros(total, np.float32) for _ in range(4))
        self.steps = np.zeros(len(named), np.float32)  # Adam's step count, one per parameter
        self.grads, self.optimizer, offset = {}, optimizer, 0  # grads: name -> view of `grad`
        for index, (name, param) in enumerate(named):
            part, shape = slice(offset, offset + param.numel()), param.shape
            param.data = torch.from_numpy(self.params[part]).view(shape).copy_(param.data)
            state = optimizer.state[index]
            state["step"] = torch.from_numpy(self.steps[index:index + 1]).view(()).copy_(
                state["step"])
            for key, flat in (("exp_avg", self.exp_avg), ("exp_avg_sq", self.exp_avg_sq)):
                state[key] = torch.from_numpy(flat[part]).view(shape).copy_(state[key])
            self.grads[name] = self.grad[part].reshape(shape)
            offset += param.numel()
        self.actor, self.critic = numpy_layers(main.model.actor), numpy_layers(main.model.critic)
        self.log_std = main.model.log_std.detach().numpy()

    def gradient_step(self, minibatch: Minibatch) -> dict:
        config, (obs, actions, old_log_probs, advantages, returns, old_values) = (
            self.config, (tensor.numpy() for tensor in minibatch))
        n, clip, log_std = len(obs), self.config.clip_coef, self.log_std
        actor_inputs, critic_inputs = [], []  # each layer's input, for its gradient
        mean = numpy_mlp(self.actor, obs, actor_inputs)
        new_values = numpy_mlp(self.critic, obs, critic_inputs)[:, 0]
        std = np.exp(log_std)
        z = (actions - mean) / std  # how far each sample is from the mean, in sigmas
        new_log_probs = (-0.5 * z ** 2 - log_std - 0.5 * math.log(2 * math.pi)).sum(-1)
        entropy = (0.5 + 0.5 * math.log(2 * math.pi) + log_std).sum()
        centred = advantages - advantages.sum() / n
        advantages = centred / (np.sqrt((centred ** 2).sum() / (n - 1)) + 1e-8)
        log_ratio = new_log_probs - old_log_probs
        ratio = np.exp(log_ratio)
        clipped_ratio = np.minimum(np.maximum(ratio, 1 - clip), 1 + clip)
        unclipped_term, clipped_term = -advantages * ratio, -advantages * clipped_ratio
        policy_loss = np.maximum(unclipped_term, clipped_term).sum() / n
        # d loss / d ratio flows through the larger term (a tie splits it, as torch.max does);
        # the clipped one passes it only inside [1 - eps, 1 + eps], where clamp is the identity.
        inside = (ratio >= 1 - clip) & (ratio <= 1 + clip)
        d_ratio = np.where(unclipped_term > clipped_term, -advantages,
                           np.where(unclipped_term < clipped_term, -advantages * inside,
                                    -advantages * (1 + inside) / 2)) / n
        d_log_probs = d_ratio * ratio  # ratio = exp(log_ratio)
        # log N(a; mu, sigma) = sum -z^2/2 - log sigma - log(2 pi)/2 with z = (a - mu) / sigma:
        # d/d mu = z / sigma, d/d log sigma = z^2 - 1; the entropy term adds -ent_coef.
        d_mean = d_log_probs[:, None] * z / std
        self.grads["log_std"][...] = ((d_log_probs[:, None] * (z ** 2 - 1)).sum(0, keepdims=True)
                                      - config.ent_coef)
        squared = (new_values - returns) ** 2
        d_squared = 2 * (new_values - returns)
        if config.clip_value_loss:  # the larger of the two squares, as for the policy
            moved = new_values - old_values
            clipped_values = old_values + np.minimum(np.maximum(moved, -clip), clip)
            clipped_squared = (clipped_values - returns) ** 2
            d_clipped = 2 * (clipped_values - returns) * ((moved >= -clip) & (moved <= clip))
            d_squared = np.where(squared > clipped_squared, d_squared,
                                 np.where(squared < clipped_squared, d_clipped,
                                          (d_squared + d_clipped) / 2))
            squared = np.maximum(squared, clipped_squared)
        value_loss = 0.5 * squared.sum() / n
        d_values = d_squared * (0.5 * config.vf_coef / n)
        self.backpropagate("critic", self.critic, critic_inputs, d_values[:, None])
        self.backpropagate("actor", self.actor, actor_inputs, d_mean)
        grad_norm = self.clip_and_step()
        with np.errstate(all="ignore"):  # (a NaN is RunGuard's to report)
            approx_kl = ((ratio - 1) - log_ratio).sum() / n
            clip_fraction = (np.abs(ratio - 1) > clip).sum() / n
        stats = torch.tensor([policy_loss, value_loss, entropy, approx_kl, clip_fraction,
                              grad_norm], dtype=torch.float32)
        return dict(zip(("policy_loss", "value_loss", "entropy", "approx_kl", "clip_fraction",
                         "grad_norm"), stats.unbind()))

    def backpropagate(self, name: str, layers: list, inputs: list, d_out: np.ndarray):
        """Through numpy_mlp, last layer first: for y = x W^T + b, dW = dy^T x, db = sum dy and
        dx = dy W; through x = tanh(u), du = dx (1 - x^2). Writes dW and db into self.grads."""
        for index in reversed(range(len(layers))):
            x = inputs[index]
            self.grads[f"{name}.{2 * index}.weight"][...] = d_out.T @ x
            self.grads[f"{name}.{2 * index}.bias"][...] = d_out.sum(0)
            if index > 0:
                d_out = (d_out @ layers[index][0]) * (1 - x * x)

    def clip_and_step(self) -> float:
        """nn.utils.clip_grad_norm_, then Adam.step, on all weights at once; the norm unclipped."""
        group, grad, m, v = self.optimizer.param_groups[0], self.grad, self.exp_avg, self.exp_avg_sq
        norm = float(np.sqrt(np.dot(grad, grad)))
        grad *= np.float32(min(1.0, self.config.max_grad_norm / (norm + 1e-6)))
        (beta1, beta2), eps, lr = group["betas"], group["eps"], group["lr"]
        self.steps += 1
        steps = float(self.steps[0])
        # $m \leftarrow \beta_1 m + (1 - \beta_1) g$,  $v \leftarrow \beta_2 v + (1 - \beta_2) g^2$
        m += (1 - beta1) * (grad - m)
        v *= beta2
        v += (1 - beta2) * grad * grad
        # $w \leftarrow w - lr / (1 - \beta_1^t) \cdot m / (\sqrt{v / (1 - \beta_2^t)} + \epsilon)$
        denominator = np.sqrt(v) / math.sqrt(1 - beta2 ** steps) + eps
        self.params -= lr / (1 - beta1 ** steps) * m / denominator
        return norm


def compile_learner(main: Main):
    """torch.compile the networks' forward passes and the loss with its backward: off by default
    (seconds Pendulum never earns back). Bound methods, not modules: the checkpoint's names stay.
    Both run here once, at their sizes: where compiling fails, eager code runs from the start."""
    model, trainer, config, guard = main.model, main.trainer, main.config, main.guard
    logging.getLogger("torch.utils.cpp_extension").addFilter(not_the_cuda_home_warning)
    networks = (model.actor, model.critic)
    eager_forwards, eager_loss = [network.forward for network in networks], trainer.compute_loss
    size, device = config.num_envs * config.num_steps // config.num_minibatches, guard.device
    try:
        for network, forward in zip(networks, eager_forwards):
            network.forward = torch.compile(forward)
        trainer.compute_loss = torch.compile(eager_loss)
        with torch.no_grad():
            model.act(torch.zeros(config.num_envs, guard.obs_size, device=device))
        zeros = torch.zeros(size, device=device)
        actions, obs = (torch.zeros(size, n, device=device)
                        for n in (guard.action_size, guard.obs_size))
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


def merge_over_ranks(ranks: Ranks, main: Main, before: dict):
    """Under torchrun, after each rollout: every rank's share is what its statistics gained since
    `before` (Chan's formula, inverted); all merge all shares into `before`, in rank order."""
    if not ranks.distributed:
        return
    statistics, shares = (main.model.obs_stats, main.model.return_stats), []
    for stats, old in zip(statistics, (before["obs"], before["return"])):
        old_count, count = float(old["count"]), float(stats.count)
        own = count - old_count
        own_mean = old["mean"] + (stats.mean - old["mean"]) * (count / own if own else 0.0)
        delta = own_mean - old["mean"]
        squares = (stats.var * count - old["var"] * old_count
                   - delta.square() * old_count * own / count)
        own_var = squares / own if own else torch.zeros_like(squares)
        shares.append((own, own_mean.cpu(), own_var.cpu()))
        load_statistics(stats, old)
    for rank_shares in ranks.gather(shares):
        for stats, (count, mean, var) in zip(statistics, rank_shares):
            stats.merge(count, mean.to(stats.mean.device), var.to(stats.var.device))

# ----- RunGuard: set-up, Ctrl-C, failures, logging, the summary -----------------------------------


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
    non-finite losses (told by its RunLog). On exit, however the run ended: the games closed, the
    last checkpoint and the summary saved, and what the process lent given back (a notebook's)."""

    def __init__(self, main: Main):
        self.main, self.previous_threads = main, torch.get_num_threads()
        self.stop_signal = self.signals = self.ranks = self.games = self.log = self.summary = None

    config = property(lambda self: self.main.config)  # the run's (or the checkpoint's) settings
    solved_step = property(lambda self: self.log.solved_step)  # --target-return was reached
    optimizer = Adam if Run.optimizer is torch.optim.Adam else Run.optimizer  # torch's, faster
    evaluate = staticmethod(lambda config: evaluate_checkpoint(config))  # --eval

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
        check_settings(self.config, complete=not self.config.resume)
        self.checkpoint = load_checkpoint(self.config.resume) if self.config.resume else None
        config = resumed_config(self.checkpoint, self.config)  # (and the env's preset)
        check_settings(config)
        self.obs_size, self.action_size, *self.action_bounds = inspect_env(config.env)
        # The rollout: an observation, an action and 6 more numbers (advantages, returns...) a step,
        # ~3 copies in an update; each game its own (peak RSS: HalfCheetah 1.07 MB, Pendulum 23 KB).
        game_bytes = 2 ** 20 if runs_on_mujoco(config.env) else 2 ** 15
        refuse_what_will_not_fit(config.num_envs * (3 * 4 * config.num_steps * (
            self.obs_size + self.action_size + 6) + game_bytes), "the rollout and the games")
        self.ranks = Ranks(pick_device(config.device))  # under torchrun, a GPU each; alone, one
        self.device = self.ranks.device
        self.action_bounds = [bound.to(self.device) for bound in self.action_bounds]
        self.steps_per_step = config.num_envs * self.ranks.world_size  # all envs of all ranks
        # Rank 0 names and makes the run dir: the default name holds the time, which may differ.
        self.run_dir = self.ranks.from_rank_0(lambda: make_run_dir(config, self.checkpoint))
        self.main.config = config = dataclasses.replace(config, run_dir=str(self.run_dir))
        log_mujoco_into(self.run_dir)  # (MuJoCo's warnings, if any)
        # The trainer draws (sampling, shuffling) from torch's generator; rank r's seeded seed + r.
        self.seed = config.seed + self.ranks.rank
        random.seed(self.seed)
        np.random.seed(self.seed)
        torch.manual_seed(self.seed)
        # One thread is fastest for networks this small (benchmarks/README.md); NumPy's: the top.
        torch.set_num_threads(1)
        self.updates, self.checkpoint_path = 0, self.run_dir / "checkpoint.pt"
        self.log = RunLog(self, start_time)

    def prepare_learner(self) -> int:
        """--resume, rank 0's weights everywhere, --compile, the NumPy path: the first step."""
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
        self.log.say(use_numpy_on_cpu(main))  # the learner line
        self.last_good_learner = copy.deepcopy(learner_state(main))  # what a NaN falls back to
        self.last_checkpoint_step = main.global_step
        return main.global_step

    def start_games(self):
        """Workers of Games or the torch Pendulum; game i of rank r gets seed + r * num_envs + i."""
        config, first_seed = self.config, self.config.seed + self.ranks.rank * self.config.num_envs
        if config.env_backend == "game":
            self.games = WorkerPool(config, self.obs_size, first_seed, self.device)
            self.log.say(f"engine: {self.games.engine}")
        else:
            self.games = TorchPendulum.checked(config, first_seed, self.device)
            self.log.say(f"engine: {self.games.engine}\nphysics: {self.games.describe()}")
        return self.games

    def stop_at_once(self) -> bool:  # under torchrun, all ranks stop together after the rollout
        return self.stop_signal is not None and not self.ranks.distributed

    def mean(self, value: float) -> float:  # over the ranks (the value itself without torchrun)
        return self.ranks.mean([value])[0]

    def after_rollout(self, episodes: list):
        """Record the ended episodes (all ranks', statistics merged); raise Interrupted to stop."""
        merge_over_ranks(self.ranks, self.main, self.last_good_learner["normalizer"])
        shared = self.ranks.gather((ended_episodes(episodes), self.stop_signal))
        for step, episode in sorted((item for rank_ended, _ in shared for item in rank_ended),
                                    key=lambda step_and_episode: step_and_episode[0]):
            self.log.record_episode(episode, step)
        signals = [signum for _, signum in shared if signum is not None]
        if signals:
            self.stop_signal = signals[0]
            raise Interrupted

    def after_update(self, stats: dict):
        """The diagnostics' mean over the ranks: stop if one is not finite; log; save when due."""
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
        """Close the games; unless the error is one a run cannot save from (bad input, a bug), save
        the checkpoint and the summary. Ctrl-C ends a run normally; a failure is raised again."""
        try:
            if self.games is not None:
                self.games.close()
            if kind is not None and not issubclass(kind, (Interrupted, *FAILURES)):
                return False
            failure = error if isinstance(error, FAILURES) else None
            if isinstance(error, (NonFiniteLoss, RankError)):  # the update may be half done
                restore_learner(self.main, self.last_good_learner)
            if failure is None:  # all ranks are here together: check they trained the same network
                try:  # (its weights and running statistics)
                    self.ranks.check_same([*self.main.model.parameters(),
                                           *self.main.model.buffers()])
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
        log_mujoco_into(None)  # (no longer into the run dir)
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
    """(its name, its settings): what the fields of `config` left at None take."""
    if config.preset and config.env in PRESETS:
        return f"{config.env}'s preset", PRESETS[config.env]
    return "the general setting", GENERAL_SETTING


class RunLog:
    """What a run tells, from rank 0: the start-up block, progress lines (at most one a second),
    TensorBoard, summary.json, a closing line. Its counts span the resumes; its speeds, this one."""

    def __init__(self, guard: RunGuard, start_time: float):
        self.guard, self.main, self.start_time = guard, guard.main, start_time
        saved = (guard.checkpoint or {}).get("log", {})
        self.resumed_at_step = int(guard.checkpoint["global_step"]) if guard.checkpoint else None
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


def load_statistics(stats: RunningMeanStd, state: dict):
    for name in ("count", "mean", "var"):
        getattr(stats, name).copy_(state[name])


def learner_state(main: Main) -> dict:
    """All a resumed run needs, as plain data: torch.load(..., weights_only=True) runs no code."""
    guard = main.guard
    return {
        "script": SCRIPT, "env": main.config.env, "obs_size": guard.obs_size,
        "action_size": guard.action_size, "config": dataclasses.asdict(main.config),
        "model": main.model.state_dict(), "optimizer": main.trainer.optimizer.state_dict(),
        "normalizer": {name: {"count": stats.count, "mean": stats.mean, "var": stats.var}
                       for name, stats in (("obs", main.model.obs_stats),  # the policy's too
                                           ("return", main.model.return_stats))},
        "global_step": main.global_step, "updates": guard.updates,
        "anneal_from": list(main.anneal_from), "log": guard.log.state(),
        "rng": {"torch": torch.get_rng_state()},
    }


def load_weights(model: Model, weights: dict, config: Config):
    """A checkpoint's weights into `model`, for --resume and --eval; refused in one line if they
    do not fit (another version of this script wrote them)."""
    try:
        model.load_state_dict(weights)
    except RuntimeError as error:
        raise UsageError(f"the checkpoint's network does not fit {config.env} with hidden size "
                         f"{config.hidden_size}: {str(error).splitlines()[-1].strip()}") from None


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
    load_statistics(main.model.obs_stats, state["normalizer"]["obs"])
    load_statistics(main.model.return_stats, state["normalizer"]["return"])
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
    """A resumed (or evaluated) run's settings: the checkpoint's, but those given win (a new
    --total-timesteps...); the run dir: its folder unless given. Another env or net: refused.
    Without a checkpoint: the given settings. Either, with the env's preset."""
    if checkpoint is None:
        return with_preset(given)
    fields = dataclasses.fields(Config)
    saved = {f.name: checkpoint["config"][f.name] for f in fields if f.name in checkpoint["config"]}
    saved["run_dir"] = str(Path(checkpoint["path"]).parent)
    if saved.get("env_backend") == "gym":  # its name before: the lesson's Game
        saved["env_backend"] = "game"
    typed = getattr(given, "typed", None)  # the command line's flags (None: Config(...) in code)
    changed = {f.name: getattr(given, f.name) for f in fields
               if (f.name in typed if typed is not None else getattr(given, f.name) != f.default)}
    for name in ("env", "hidden_size"):
        if name in changed and changed[name] != saved.get(name):
            raise UsageError(f"the checkpoint was trained with --{name.replace('_', '-')} "
                             f"{saved.get(name)}, not {changed[name]}")
    return with_preset(Config(**{**saved, **changed}))

# ----- Evaluation and video -----------------------------------------------------------------------


@torch.no_grad()
def evaluate_checkpoint(given: Config) -> dict:
    """--eval: play a checkpoint's games, its statistics frozen; report the return. gymnasium's
    Game plays them one by one; with --physics, torch Pendulums side by side, one episode each."""
    check_settings(given)
    checkpoint = load_checkpoint(given.eval)
    config = resumed_config(checkpoint, given)
    physics = check_physics(config)  # (the checkpoint's, unless given)
    obs_size, action_size, low, high = inspect_env(config.env)
    # MuJoCo draws with OpenGL: without a display, offscreen (MUJOCO_GL=egl or osmesa).
    if config.video and runs_on_mujoco(config.env) and not (
            os.environ.get("MUJOCO_GL") in ("egl", "osmesa") or os.environ.get("DISPLAY")):
        raise UsageError(f"--video of {config.env} needs a display, or MuJoCo's offscreen "
                         f"drawing: run with MUJOCO_GL=egl or MUJOCO_GL=osmesa")
    model = Model(obs_size, action_size, config.hidden_size, config.normalize_observations)
    load_weights(model, checkpoint["model"], config)
    load_statistics(model.obs_stats, checkpoint["normalizer"]["obs"])
    torch.manual_seed(config.seed)
    video, path, returns, played = None, Path(config.run_dir) / "eval.mp4", [], ""
    if physics:  # all games side by side, one episode (200 steps) each
        refuse_what_will_not_fit(config.eval_episodes * 2 ** 10, "--eval-episodes' games")
        engine = TorchPendulum(config.eval_episodes, config.seed, torch.device("cpu"), physics)
        for _ in range(engine.MAX_EPISODE_STEPS):
            obs = model.obs_stats.normalize(engine.observations(), config.obs_clip, update=False)
            result = engine.step(model.act(obs, greedy=config.greedy)[0].clamp(low, high))
        returns, played = result.episode_returns.tolist(), f", physics {engine.describe()}"
    else:
        drawn = {"render_mode": "rgb_array"} if config.video else {}  # (only when asked for)
        game = Game(config.env, config.seed, **drawn)
        obs = game.reset()
        try:
            while len(returns) < config.eval_episodes:
                if config.video:
                    video = write_frame(video, game, path)
                obs = model.obs_stats.normalize(torch.from_numpy(obs)[None], config.obs_clip,
                                                update=False)
                actions, _, _ = model.act(obs, greedy=config.greedy)
                obs, _, _, _, info = game.step(actions[0].clamp(low, high).numpy())
                if "episode" in info:
                    returns.append(float(info["episode"]["return"]))
        finally:
            game.env.close()
            if video is not None:
                video.release()
    mean, std = float(np.mean(returns)), float(np.std(returns))
    episodes = f"{len(returns)} episode{'s' * (len(returns) != 1)}"
    print(f"eval {config.env}{played}: return {mean:.2f} ± {std:.2f} over {episodes} "
          f"({'greedy' if config.greedy else 'sampled'} actions)")
    if video is not None:
        print(f"video: {path}")
    return {"script": SCRIPT, "env": config.env, "episodes": len(returns), "mean_return": mean,
            "std_return": std, "returns": returns, "greedy": config.greedy,
            "physics": config.physics, "video": str(path) if video is not None else None}


def write_frame(video, game: Game, path: Path):
    """Append the game's picture to the mp4 (OpenCV's VideoWriter, opened at the first frame)."""
    import cv2  # only --video needs OpenCV

    # pygame draws the classic-control games: the picture needs no display or sound (SDL's dummy).
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


class UsageError(ValueError):
    """Bad input from the user: the command line prints its message on one line, exit status 2."""


RANGES = {"> 0": (lambda x: x > 0, "positive"), ">= 0": (lambda x: x >= 0, "0 or more"),
          "(0, 1]": (lambda x: 0 < x <= 1, "in (0, 1]"),
          "[0, 1]": (lambda x: 0 <= x <= 1, "in [0, 1]")}


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


def check_settings(config: Config, complete: bool = True):
    """Refuse, in one line saying what to change, numbers out of range (or not finite) and flags
    that cannot work together (complete=False: --resume's flags, before its checkpoint's)."""
    config = with_preset(config)  # (a field left at None: its value for the env)
    for f in dataclasses.fields(Config):
        value, rule = getattr(config, f.name), f.metadata["check"]
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, float) and not math.isfinite(value):
            raise UsageError(f"{flag} must be a finite number, not {value}")
        if rule in RANGES and value is not None and not RANGES[rule][0](value):
            raise UsageError(f"{flag} must be {RANGES[rule][1]}, not {value}")
    for flag in ("video", "greedy"):
        if getattr(config, flag) and not config.eval:
            raise UsageError(f"--{flag} is for --eval's games: add --eval PATH")
    if config.eval and config.resume:
        raise UsageError("--eval plays a checkpoint, --resume trains on from one: give one")
    if config.env_backend not in ("game", "torch"):
        raise UsageError(f"unknown --env-backend {config.env_backend!r}: use game or torch")
    if config.env_backend == "torch" and config.env != "Pendulum-v1":
        raise UsageError(f"--env-backend torch has Pendulum-v1 only, not {config.env}: use "
                         f"--env-backend game")
    if config.env_backend == "torch" and config.num_workers:
        raise UsageError("--env-backend torch steps every game in this process: drop --num-workers")
    check_physics(config, complete)
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


def parse_physics(text: str) -> dict:
    """--physics as {name: (low, high)}: "g=6:14,m=1.2" is {"g": (6.0, 14.0), "m": (1.2, 1.2)}.
    Physical: g 0 (weightless) or more, the rest positive, max_torque at most the bound (2) that
    the policy's actions are clipped to (gymnasium's); else, or for an unknown name, a name given
    twice, no finite number, an empty or reversed range: refused in one line."""
    physics = {}
    for part in filter(None, (part.strip() for part in text.split(","))):
        name, _, values = (word.strip() for word in part.partition("="))
        close = difflib.get_close_matches(name.lower(), TorchPendulum.PHYSICS, n=1)
        try:
            low, high = map(float, values.split(":") if ":" in values else (values, values))
        except ValueError:
            low = high = None
        rule = ">= 0" if name == "g" else "> 0"
        problem = (
            f"no parameter {name!r}; " + (f"did you mean {close[0]}?" if close else
                                          f"use {', '.join(TorchPendulum.PHYSICS)}")
            if name not in TorchPendulum.PHYSICS else
            f"write {name}=value or {name}=low:high (e.g. g=6:14)" if low is None else
            f"{name} is given twice" if name in physics else
            "not a finite number" if not (math.isfinite(low) and math.isfinite(high)) else
            f"a reversed range: write {name}={high:g}:{low:g}" if low > high else
            f"an empty range: write {name}={low:g}" if low == high and ":" in values else
            f"{name} must be {RANGES[rule][1]}" if not RANGES[rule][0](low) else
            "max_torque must be at most 2, the bound of the policy's actions (gymnasium's)"
            if name == "max_torque" and high > 2 else None)
        if problem:
            raise UsageError(f"--physics {part!r}: {problem}")
        physics[name] = (low, high)
    return physics


def check_physics(config: Config, complete: bool = True) -> dict:
    """--physics, read (parse_physics) and held to what plays it: the torch Pendulum."""
    physics = parse_physics(config.physics)
    if physics and config.env != "Pendulum-v1":
        raise UsageError(f"--physics is Pendulum-v1's, not {config.env}'s: drop --physics")
    if physics and config.env_backend == "game" and complete and not config.eval:
        raise UsageError("--physics needs --env-backend torch: the lesson's Game plays gymnasium's "
                         "Pendulum-v1, whose physics is its own")
    if physics and config.video:
        raise UsageError(f"--video films gymnasium's Pendulum-v1, not --physics "
                         f"{config.physics!r}: add --physics '' (gymnasium's) or drop --video")
    return physics


def inspect_env(env_id: str):
    """Check that this script can play the env: (obs size, action size, action bounds, tensors)."""
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
        if "box2d" in str(gym.spec(registered).entry_point):  # LunarLanderContinuous, BipedalWalker
            import Box2D  # noqa: F401
    except ImportError:
        raise UsageError(f"{env_id} runs on Box2D, which is not installed: "
                         f"pip install \"gymnasium[box2d]\"") from None
    try:
        if runs_on_mujoco(env_id):  # (only MuJoCo's envs need it)
            import mujoco  # noqa: F401
            log_mujoco_into(None)  # (before the first of its models is compiled, just below)
    except ImportError:
        raise UsageError(f"{env_id} runs on MuJoCo, which is not installed: "
                         f"pip install \"gymnasium[mujoco]\"") from None
    except Exception as error:  # its OpenGL, e.g. MUJOCO_GL=osmesa without libOSMesa
        raise UsageError(f"MuJoCo cannot start with MUJOCO_GL={os.environ.get('MUJOCO_GL')}: "
                         f"{type(error).__name__}: {error}") from None
    try:
        env = gym.make(env_id)
    except Exception as error:
        raise UsageError(f"cannot make {env_id}: {type(error).__name__}: {error}") from None
    obs_space, action_space = env.observation_space, env.action_space
    env.close()
    kind = type(obs_space).__name__
    if not isinstance(obs_space, gym.spaces.Box):
        raise UsageError(f"{env_id} has a {kind} observation space; " + (
            "use ppo_spaces.py, which reads any nest of spaces"
            if kind in ("Discrete", "MultiDiscrete", "MultiBinary", "Dict", "Tuple")
            else f"no script of this library handles {kind} observations yet"))
    if obs_space.dtype == np.uint8 and len(obs_space.shape) >= 2:
        raise UsageError(f"{env_id} observes images {obs_space.shape}; use ppo_spaces.py (a CNN "
                         f"sized to the image) or, for Atari, ppo_atari.py")
    if not isinstance(action_space, gym.spaces.Box):
        kind = type(action_space).__name__
        raise UsageError(f"{env_id} has a {action_space} action space; this script handles "
                         f"continuous (Box) actions" + (
                             ": use ppo_cartpole.py for Discrete, MultiDiscrete and MultiBinary "
                             "ones" if kind in ("Discrete", "MultiDiscrete", "MultiBinary") else
                             ": use ppo_spaces.py for nests of actions" if kind in ("Dict", "Tuple")
                             else f", and no script of this library handles {kind} actions yet"))
    low, high = (torch.as_tensor(bound, dtype=torch.float32).flatten()
                 for bound in (action_space.low, action_space.high))
    return int(np.prod(obs_space.shape)), int(np.prod(action_space.shape)), low, high


def runs_on_mujoco(env_id: str) -> bool:
    return "mujoco" in str(gym.spec(env_id.rpartition(":")[2]).entry_point)


def log_mujoco_into(folder: Optional[Path]):
    """MuJoCo's warnings into `folder`'s MUJOCO_LOG.TXT, not the working dir's (None: printed)."""
    mujoco = sys.modules.get("mujoco")
    if hasattr(mujoco, "MjLogConfig"):  # (MuJoCo 3.10 and later)
        log = mujoco.MjLogConfig.get()
        log.logto_file = folder is not None
        log.logfile = str(Path(folder or "") / "MUJOCO_LOG.TXT")
        log.set()


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
