"""PPO for Atari games from pixels, in one file: the PPO paper's Atari setup, annotated.

Proximal Policy Optimization (Schulman et al., 2017: "PPO paper") with the Atari preprocessing of
DeepMind's DQN (Mnih et al., 2015) and the details of CleanRL and SB3 ("The 37 Implementation
Details of PPO", Huang et al., 2022: "37 details") named where used. The idea: play a rollout with
the current policy, estimate each action's advantage A_t with GAE (`compute_gae` derives it), then
learn from it for several epochs, keeping the new policy near the one that played by clipping the
probability ratio rho_t = pi(a_t | s_t) / pi_old(a_t | s_t) (`Trainer.ppo_loss` derives it).

Run it:         python ppo_atari.py --env BreakoutNoFrameskip-v4   (--help lists every flag)
On N GPUs:      torchrun --standalone --nproc_per_node N ppo_atari.py   (data parallel: `Ranks`)
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

SCRIPT = "ppo_atari"
FRAME_SIZE, FRAME_STACK, FRAME_SKIP = 84, 4, 4  # DQN's: 84x84 grey, 4 stacked, each action 4 frames


def option(default, help, check=None):  # a Config field: its default, --help line, valid range
    return dataclasses.field(default=default, metadata={"help": help, "check": check})


@dataclasses.dataclass
class Config:
    """Every setting of a run, each a flag (`num_envs`: `--num-envs`); the PPO paper's defaults."""

    # PPO's hyperparameters.
    learning_rate: float = option(2.5e-4, "Adam's step size, annealed linearly to 0", "> 0")
    anneal_lr: bool = option(True, "anneal the learning rate linearly to 0 over the run")
    gamma: float = option(0.99, "discount factor", "(0, 1]")
    gae_lambda: float = option(0.95, "GAE: bias (0) vs variance (1) of the advantage", "[0, 1]")
    num_minibatches: int = option(4, "minibatches each rollout is split into", "> 0")
    update_epochs: int = option(4, "passes over each rollout", "> 0")
    clip_coef: float = option(0.1, "PPO's clip range for the probability ratio", "> 0")
    clip_value_loss: bool = option(True, "clip the value update around the rollout's values too")
    ent_coef: float = option(0.01, "weight of the entropy bonus", ">= 0")
    vf_coef: float = option(0.5, "weight of the value loss", ">= 0")
    max_grad_norm: float = option(0.5, "clip the global gradient norm to this", "> 0")
    target_kl: Optional[float] = option(None, "stop an update's epochs at this approx KL", "> 0")
    # Collecting experience.
    env: str = option("BreakoutNoFrameskip-v4", "Atari game id: *NoFrameskip-v4 or ALE/*-v5")
    env_backend: str = option("ale-vector", "ale-vector (ale-py's C++ engine) | game (Workers)")
    num_envs: int = option(8, "games played side by side (by each rank, under torchrun)", "> 0")
    num_workers: int = option(2, "child processes for --env-backend game (0 = in this one)", ">= 0")
    num_steps: int = option(128, "steps per game in a rollout of num_envs * num_steps", "> 0")
    # The run.
    seed: int = option(1, "seeds everything; game i of rank r gets seed + r * num_envs + i", ">= 0")
    total_timesteps: int = option(10_000_000, "agent steps over all games (and ranks)", "> 0")
    device: str = option("auto", "auto | cpu | cuda: auto takes CUDA when present")
    run_dir: Optional[str] = option(None, "logs, checkpoint, summary (None: a new folder in runs/)")
    overwrite: bool = option(False, "replace the run already in --run-dir instead of refusing")
    target_return: Optional[float] = option(None, "stop at this mean score of 100 games")
    checkpoint_every: int = option(500_000, "save a checkpoint every this many steps", "> 0")
    resume: Optional[str] = option(None, "continue training from this checkpoint or run folder")
    eval: Optional[str] = option(None, "play --eval-episodes games with this checkpoint or run")
    eval_episodes: int = option(10, "whole games (all lives) played by --eval", "> 0")
    greedy: bool = option(False, "with --eval, take the most likely action instead of sampling")
    video: bool = option(False, "with --eval, write an mp4 of the games into the run dir")
    compile: bool = option(True, "torch.compile inference and the update (eager where it cannot)")
    compile_mode: str = option("default", "torch.compile: default | reduce-overhead | max-autotune")
    precision: str = option("float32", "float32 | bfloat16 (the body; faster with AMX, new GPUs)")


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
        valid = f" (valid: {f.metadata['check']})" if f.metadata["check"] else ""
        parser.add_argument(flag, default=f.default, help=f.metadata["help"] + valid,
                            **({"action": argparse.BooleanOptionalAction} if kind is bool else
                               {"type": whole_number if kind is int else kind}))
    return Config(**vars(parser.parse_args(argv)))


if __name__ == "__main__" and "__file__" in globals():
    parse_config()  # --help and a mistyped flag answer here; `command_line` (the end) runs it all

import ale_py  # importing it registers the Atari ids (ALE/*-v5, *NoFrameskip-v4) with gymnasium
import cv2
import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn


class Game:
    """One Atari game, preprocessed as DQN, the PPO paper, CleanRL and SB3 do it (SB3's names):
    - Frame skip (MaxAndSkipEnv): each action is held for 4 emulator frames, their rewards summed;
      the picture is the max of the last two frames (sprites flicker). (v5's sticky actions stay.)
    - 84x84 grey (WarpFrame): grayscale, shrunk by area interpolation. Frame stack: the last 4
      pictures, so that motion shows (zeros and the first picture as a training episode starts).
    - Episodic life (EpisodicLifeEnv): a lost life ends the training episode (`terminated`); the
      game goes on, and `info["episode"]` holds the whole game's real score.
    - Fire reset (FireResetEnv): FIRE is pressed where a game waits for it after a (re)start.
    - Reward clipping (ClipRewardEnv): the reward's sign, so that one step size fits every game.
    - No-op starts (NoopResetEnv): 1..30 random NOOP frames start a game, so that games differ."""

    def __init__(self, env_id: str, seed: int, noop_max: int = 30):
        ale_py.ALEInterface.setLoggerMode(ale_py.LoggerMode.Error)  # no start-up banner on stderr
        self.env = gym.make(env_id, obs_type="grayscale", frameskip=1)
        self.ale, meanings = self.env.unwrapped.ale, self.env.unwrapped.get_action_meanings()
        self.needs_fire = len(meanings) >= 3 and meanings[1] == "FIRE"  # FireResetEnv's test
        self.noop_max, self.seed, self.rng = noop_max, seed, np.random.default_rng(seed)
        self.stack = np.zeros((FRAME_STACK, FRAME_SIZE, FRAME_SIZE), dtype=np.uint8)
        self.close = self.env.close

    def reset(self) -> np.ndarray:  # a new game: no-op starts (drawn by self.rng), then FIRE
        self.frames = [self.env.reset(seed=self.seed)[0]] * 2  # the last two, for the max-pool
        self.seed, self.episode_return, self.episode_length = None, 0.0, 0  # (seeded once)
        for _ in range(self.rng.integers(1, self.noop_max + 1) if self.noop_max else 0):
            self.episode_return += self.repeat(0, frames=1)
            if self.game_over:
                self.frames, self.episode_return = [self.env.reset()[0]] * 2, 0.0
        self.lives = self.ale.lives()
        return self.observe(new_episode=True)

    def repeat(self, action: int, frames: int = FRAME_SKIP) -> float:  # fewer if the game ends
        reward = 0.0
        for _ in range(frames):
            frame, frame_reward, self.game_over, self.truncated, _ = self.env.step(action)
            self.frames, reward = [self.frames[1], frame], reward + frame_reward
            if self.game_over or self.truncated:  # (truncated: ALE's limit of frames in a game)
                break
        return reward

    def observe(self, new_episode: bool = False) -> np.ndarray:  # a copy of the stack
        for action in (1, 2) if new_episode and self.needs_fire else ():  # (FireResetEnv)
            self.episode_return += self.repeat(action)
        self.stack[:-1] = 0 if new_episode else self.stack[1:]  # a new episode: zeros
        self.stack[-1] = cv2.resize(np.maximum(*self.frames), (FRAME_SIZE, FRAME_SIZE),
                                    interpolation=cv2.INTER_AREA)  # the last two frames' max
        return self.stack.copy()

    def step(self, action: int):
        reward = self.repeat(int(action))
        self.episode_return += reward
        self.episode_length += 1
        obs = self.observe()
        life_lost, self.lives = 0 < self.ale.lives() < self.lives, self.ale.lives()  # 0: game over
        game_over, truncated = self.game_over, self.truncated  # (the restarts below step again)
        terminated = game_over or life_lost
        info = {"final_obs": obs} if terminated or truncated else {}
        if game_over or truncated:
            info["episode"] = {"return": self.episode_return, "length": self.episode_length}
            obs = self.reset()
        elif life_lost:  # as EpisodicLifeEnv + FireResetEnv: one NOOP step, then a new episode
            self.episode_return += self.repeat(0)
            obs = self.observe(new_episode=True)
        return obs, float(np.sign(reward)), terminated, truncated, info


class StepResult(typing.NamedTuple):  # a step of all the games, besides the observations
    rewards: np.ndarray  # [num_envs] float32, clipped to their sign
    terminated: np.ndarray  # [num_envs] bool: the training episode ended (a life lost, game over)
    truncated: np.ndarray  # [num_envs] bool: ALE's frame limit cut the game
    final_obs: dict  # game index -> the last observation of the episode that ended there
    episodes: dict  # game index -> {"return", "length"} of the whole game that ended there


class Worker:
    """Runs several Games in a child process, beside the trainer: actions go down a pipe,
    rewards, flags and ended episodes come back; observations skip it (shared memory: obs_view)."""

    def __init__(self, index: int, env_id: str, seed: int, obs_view: np.ndarray):
        self.index, self.env_id, self.obs_view = index, env_id, obs_view
        self.trainer_end, child_end = multiprocessing.Pipe()
        self.process = multiprocessing.get_context("fork").Process(
            target=self.child_loop, args=(child_end, env_id, seed, obs_view),
            name=f"{SCRIPT}-worker-{index}", daemon=True)
        self.process.start()
        child_end.close()
        self.receive()  # the child's first answer comes once its Games are reset

    @staticmethod
    def step_games(games: list, actions: np.ndarray, obs_out: np.ndarray) -> tuple:
        """Step each Game (observations into `obs_out`): rewards, end flags, ended episodes."""
        rewards, terminated, truncated = (np.empty(len(games), t) for t in (np.float32, bool, bool))
        infos = [{}] * len(games)
        for i, (game, action) in enumerate(zip(games, actions)):
            obs_out[i], rewards[i], terminated[i], truncated[i], infos[i] = game.step(action)
        final_obs = {i: info["final_obs"] for i, info in enumerate(infos) if "final_obs" in info}
        episodes = {i: info["episode"] for i, info in enumerate(infos) if "episode" in info}
        return rewards, terminated, truncated, final_obs, episodes

    def child_loop(self, conn, env_id: str, seed: int, obs_view: np.ndarray):  # in the child
        games = [Game(env_id, seed + i) for i in range(len(obs_view))]  # game i: seed + i
        obs_view[:] = [game.reset() for game in games]
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


def layer(in_size: int, out_size: int, gain: float = math.sqrt(2), kernel_size: int = 0,
          stride: int = 1) -> nn.Module:
    """A linear layer (a convolution given a kernel size): orthogonal weights, zero biases (37
    details, #2: gain sqrt(2) in the body; 0.01 for the actor: all actions start alike; 1: V)."""
    module = (nn.Conv2d(in_size, out_size, kernel_size, stride) if kernel_size
              else nn.Linear(in_size, out_size))
    nn.init.orthogonal_(module.weight, gain)
    nn.init.zeros_(module.bias)
    return module


class Model(nn.Module):
    """The Nature CNN (Mnih et al., 2015): one body, an actor head (logits) and a critic head (V),
    on uint8 stacks scaled to [0, 1] here. `bfloat16`: the body in bfloat16, the rest float32."""

    def __init__(self, num_actions: int, bfloat16: bool = False):
        super().__init__()
        self.bfloat16 = bfloat16
        self.body = nn.Sequential(
            layer(FRAME_STACK, 32, kernel_size=8, stride=4), nn.ReLU(),  # -> 32 x 20 x 20
            layer(32, 64, kernel_size=4, stride=2), nn.ReLU(),  # -> 64 x 9 x 9
            layer(64, 64, kernel_size=3), nn.ReLU(),  # -> 64 x 7 x 7
            nn.Flatten(), layer(64 * 7 * 7, 512), nn.ReLU())
        self.actor, self.critic = layer(512, num_actions, gain=0.01), layer(512, 1, gain=1.0)

    def forward(self, obs: torch.Tensor):  # -> the actions' logits [batch, actions], values
        with torch.autocast(obs.device.type, dtype=torch.bfloat16, enabled=self.bfloat16):
            hidden = self.body(obs.float() / 255.0).float()
        return self.actor(hidden), self.critic(hidden).squeeze(-1)

    def value(self, obs: torch.Tensor) -> torch.Tensor:  # V(s) alone: the critic's estimate
        return self(obs)[1]

    def act(self, obs: torch.Tensor, greedy: bool = False):  # actions, log-probabilities, values
        logits, value = self(obs)
        log_probs = torch.log_softmax(logits, dim=-1)
        actions = log_probs.argmax(-1) if greedy else torch.multinomial(log_probs.exp(), 1)[:, 0]
        return actions, log_probs.gather(-1, actions.unsqueeze(-1)).squeeze(-1), value

    def evaluate_actions(self, obs: torch.Tensor, actions: torch.Tensor):  # (the loss's inputs)
        logits, value = self(obs)
        log_probs = torch.log_softmax(logits, dim=-1)
        log_prob = log_probs.gather(-1, actions.unsqueeze(-1)).squeeze(-1)
        return log_prob, -(log_probs.exp() * log_probs).sum(-1), value  # entropy in the middle


def compute_gae(rewards, values, dones, last_value, gamma: float, gae_lambda: float):
    """Generalized Advantage Estimation (Schulman et al., 2016; PPO paper, eq. 11-12): advantages
    [T, N] from rewards, values, dones [T, N] (time, env) and last_value [N] (after the last step).

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
    `dones[t]` means "obs[t] starts a new episode", one step later; the advantages are the same.)"""
    advantages = torch.zeros_like(rewards)
    next_advantage, next_value = torch.zeros_like(last_value), last_value
    for t in reversed(range(rewards.shape[0])):
        not_done = 1.0 - dones[t]
        delta = rewards[t] + gamma * next_value * not_done - values[t]
        next_advantage = delta + gamma * gae_lambda * not_done * next_advantage
        advantages[t], next_value = next_advantage, values[t]
    return advantages


class Minibatch(typing.NamedTuple):  # a shuffled slice of the rollout: what the Trainer learns
    obs: torch.Tensor  # [batch, 4, 84, 84] uint8, as the policy saw them
    actions: torch.Tensor  # [batch], the actions it took
    old_log_probs: torch.Tensor  # their log-probabilities then
    advantages: torch.Tensor  # from GAE
    returns: torch.Tensor  # the value targets: advantages + old values
    old_values: torch.Tensor  # the values then


class Rollout:
    """What the policy saw, did and got, [steps, games, ...]; what it got stays on the host."""

    def __init__(self, config: Config, device: torch.device):
        shape = (config.num_steps, config.num_envs)
        self.obs = torch.zeros(shape + (FRAME_STACK, FRAME_SIZE, FRAME_SIZE), dtype=torch.uint8,
                               device=device)
        self.actions = torch.zeros(shape, dtype=torch.long, device=device)
        self.log_probs, self.values = (torch.zeros(shape, device=device) for _ in range(2))
        pinned = device.type == "cuda"
        self.rewards, self.dones = (torch.zeros(shape, pin_memory=pinned) for _ in range(2))

    def store_obs(self, step: int, obs: torch.Tensor):
        self.obs[step] = obs

    def minibatch(self, indices: torch.Tensor, advantages, returns) -> Minibatch:  # flat indices
        columns = (self.actions, self.log_probs, advantages, returns, self.values)
        return Minibatch(self.obs.flatten(0, 1)[indices], *(c.flatten()[indices] for c in columns))


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
        rollout serve several epochs, but the estimate worsens as the policies part (rho_t's
        variance grows). Why clip: TRPO bounds the move with a KL constraint; PPO (paper, eq. 7)
        stops rewarding it beyond [1 - eps, 1 + eps]:

            L_clip = E_t[ min(rho_t A_t, clip(rho_t, 1 - eps, 1 + eps) A_t) ]

        Once rho_t is out of range in the helpful direction (rho_t > 1 + eps with A_t > 0, or
        rho_t < 1 - eps with A_t < 0), the clipped term is constant: no gradient, the sample stops
        pulling. Why the minimum: it makes L_clip a pessimistic bound, so that a move that made
        things worse (rho_t < 1 - eps with A_t > 0) is never hidden: its gradient pulls back."""
        advantages = minibatch.advantages  # normalised per minibatch (37 details, #7)
        advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
        # The clipped surrogate (37 details, #8), negated: the max of the negations is the min.
        log_ratio = new_log_probs - minibatch.old_log_probs
        ratio = log_ratio.exp()
        clipped_ratio = ratio.clamp(1 - config.clip_coef, 1 + config.clip_coef)
        policy_loss = torch.max(-advantages * ratio, -advantages * clipped_ratio).mean()
        # Value loss (37 details, #9): squared error to the returns, clipped like the policy.
        returns, old_values, clip = minibatch.returns, minibatch.old_values, config.clip_coef
        value_loss = (new_values - returns) ** 2
        if config.clip_value_loss:
            clipped = old_values + (new_values - old_values).clamp(-clip, clip)
            value_loss = torch.max(value_loss, (clipped - returns) ** 2)
        value_loss = 0.5 * value_loss.mean()
        # Entropy bonus (37 details, #10): rewards a spread-out policy, which keeps exploring.
        entropy_mean = entropy.mean()
        loss = policy_loss - config.ent_coef * entropy_mean + config.vf_coef * value_loss
        # Diagnostics (37 details, #12): approx KL by the low-variance (rho - 1) - log rho
        # (Schulman, "Approximating KL divergence", 2020), and the share the clip touched.
        with torch.no_grad():
            stats = {"policy_loss": policy_loss, "value_loss": value_loss, "entropy": entropy_mean,
                     "approx_kl": ((ratio - 1) - log_ratio).mean(),
                     "clip_fraction": ((ratio - 1).abs() > config.clip_coef).float().mean()}
        return loss, stats

    def compute_loss(self, minibatch: Minibatch):  # under the current weights (--compile's part)
        outputs = self.model.evaluate_actions(minibatch.obs, minibatch.actions)
        return self.ppo_loss(minibatch, *outputs, self.config)

    def gradient_step(self, minibatch: Minibatch) -> dict:  # -> the diagnostics, as tensors
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
    """The plain run `Main.train` talks to: seeds, device, the games, progress, summary. `RunGuard`,
    below the banner, extends it: Ctrl-C, checkpoints, NaN guard, torchrun, the fast engines."""

    def __init__(self, main: "Main"):
        self.main, self.config, self.games, self.summary = main, main.config, None, None
        self.returns, self.episodes, self.updates, self.solved_step = deque(maxlen=100), 0, 0, None

    def __enter__(self) -> "Run":
        """Seed torch's draws (sampling, shuffling), pick the device, ask a Game its actions."""
        config, self.start_time = self.config, time.perf_counter()
        torch.manual_seed(config.seed)
        cuda = config.device != "cpu" and torch.cuda.is_available()
        self.device, self.steps_per_step = torch.device("cuda" if cuda else "cpu"), config.num_envs
        with contextlib.closing(Game(config.env, config.seed)) as game:
            self.num_actions = int(game.env.action_space.n)
        return self

    prepare_learner = lambda self: 0  # the step to start from (RunGuard's: --resume's)
    stop_at_once = lambda self: False  # end the rollout now (RunGuard's: after Ctrl-C)
    mean = lambda self, value: value  # a number's mean over the ranks (RunGuard's: torchrun)
    optimizer = torch.optim.Adam  # the Trainer's (RunGuard's: a copy, the same steps, 2 s sooner)
    rollout_class = Rollout  # (RunGuard's stores each picture once: PictureRollout)

    def start_games(self) -> Worker:
        """All the games in one Worker, game i seeded with seed + i (RunGuard's: --num-workers)."""
        shape = (self.config.num_envs, FRAME_STACK, FRAME_SIZE, FRAME_SIZE)
        obs = torch.zeros(shape, dtype=torch.uint8).share_memory_()
        self.games = Worker(0, self.config.env, self.config.seed, obs.numpy())
        return self.games

    def after_rollout(self, ended: list):
        """Record the (global step, episode) of the games that ended; note the target."""
        target, self.episodes = self.config.target_return, self.episodes + len(ended)
        for step, episode in ended:
            self.returns.append(episode["return"])
            if (target is not None and self.solved_step is None and len(self.returns) == 100
                    and np.mean(self.returns) >= target):
                self.solved_step = step

    def after_update(self, stats: dict):
        """A progress line: the step, the speed, the mean score of the last 100 games."""
        self.updates, step = self.updates + 1, self.main.global_step
        speed, mean = step / (time.perf_counter() - self.start_time), np.mean(self.returns or [0])
        print(f"step {step:,} | {speed:,.0f} steps/s | return {mean:.1f} | updates {self.updates}")

    def __exit__(self, kind, error, traceback):
        """Close the games and keep the summary; an error goes on up."""
        if self.games is not None:
            self.games.close()
        config, seconds = self.config, round(time.perf_counter() - self.start_time, 3)
        self.summary = {"script": SCRIPT, "env": config.env, "seed": config.seed,
                        "steps": getattr(self.main, "global_step", 0), "seconds": seconds,
                        "episodes": self.episodes, "solved_step": self.solved_step,
                        "mean_return_100": float(np.mean(self.returns)) if self.returns else None}

    @staticmethod
    def evaluate(config: Config) -> dict:  # --eval: the machinery's (below the banner)
        raise NotImplementedError("--eval plays a checkpoint: the machinery below the banner")


class Main:
    """The PPO loop (37 details, #6): `Main(config).run()` trains, returns the summary (a dict)."""

    def __init__(self, config: Config):  # anneal_from: (step, rate) where annealing starts
        self.config, self.guard, self.anneal_from = config, None, (0, config.learning_rate)

    def run(self) -> dict:
        # The one lookup of the machinery: RunGuard extends Run; cut at the banner, Run runs alone.
        run_class = globals().get("RunGuard", Run)
        return run_class.evaluate(self.config) if self.config.eval else self.train(run_class)

    def train(self, run_class: type) -> dict:
        self.guard = run_class(self)  # seeds, the games, the progress line, the summary
        with self.guard as guard:
            config = self.config  # (the checkpoint's settings, when resuming)
            self.model = Model(guard.num_actions, bfloat16=config.precision == "bfloat16")
            self.model.to(guard.device, memory_format=torch.channels_last)  # faster convolutions
            self.trainer = Trainer(self.model, config, guard.optimizer)
            self.global_step = guard.prepare_learner()  # 0, or --resume's; compile, torchrun
            self.games = guard.start_games()  # (RunGuard's: ale-py's C++ engine, the same game)
            self.rollout = guard.rollout_class(config, guard.device)
            next_obs = self.games.observations().to(guard.device)
            while self.global_step < config.total_timesteps:
                self.anneal_learning_rate()
                next_obs = self.collect_rollout(next_obs)  # 1. play with the current policy
                if guard.solved_step is not None:
                    break  # --target-return reached in this rollout
                advantages, returns = self.estimate_advantages(next_obs)  # 2. GAE
                stats = self.learn(advantages, returns)  # 3. epochs of clipped PPO steps
                guard.after_update(stats)  # progress line (RunGuard's: NaN guard, checkpoint)
        return guard.summary

    def anneal_learning_rate(self):  # linearly, to 0 at the end (37 details, #4)
        start_step, start_rate = self.anneal_from
        progress = (self.global_step - start_step) / (self.config.total_timesteps - start_step)
        rate = start_rate * max(0.0, 1.0 - progress) if self.config.anneal_lr else start_rate
        for group in self.trainer.optimizer.param_groups:
            group["lr"] = rate

    @torch.inference_mode()  # like no_grad, and skips autograd's version counting too: faster
    def collect_rollout(self, next_obs: torch.Tensor) -> torch.Tensor:  # -> the next observation
        config, rollout, device, ended = self.config, self.rollout, self.guard.device, []
        for step in range(config.num_steps):
            if self.guard.stop_at_once():  # Ctrl-C
                break
            rollout.store_obs(step, next_obs)
            actions, rollout.log_probs[step], rollout.values[step] = self.model.act(next_obs)
            rollout.actions[step] = actions
            result = self.games.step(actions.cpu().numpy())
            next_obs = self.games.observations().to(device)
            # Truncation is not death: a cut episode's last reward gets gamma * V(final obs).
            cut = [i for i in result.final_obs if result.truncated[i] and not result.terminated[i]]
            if cut:
                cut_obs = torch.from_numpy(np.stack([result.final_obs[i] for i in cut])).to(device)
                result.rewards[cut] += config.gamma * self.model.value(cut_obs).cpu().numpy()
            rollout.rewards[step] = torch.from_numpy(result.rewards)
            rollout.dones[step] = torch.from_numpy(result.terminated | result.truncated)
            self.global_step += self.guard.steps_per_step  # num_envs of every rank
            ended += [(self.global_step, episode) for episode in result.episodes.values()]  # games
        self.guard.after_rollout(ended)  # record the games (RunGuard's: stop on Ctrl-C)
        return next_obs

    @torch.no_grad()
    def estimate_advantages(self, next_obs: torch.Tensor):  # (advantages, returns) by GAE
        rollout, config, device = self.rollout, self.config, self.guard.device
        rewards, dones = (t.to(device, non_blocking=True) for t in (rollout.rewards, rollout.dones))
        advantages = compute_gae(rewards, rollout.values, dones, self.model.value(next_obs),
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
# A reader of PPO may stop here. What follows makes the lesson fast, safe and scalable, one part
# under each heading; `RunGuard` and `RunLog` extend the lesson's plain `Run`.

import copy
import datetime
import gc
import hashlib
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

# ----- Engines (the games, fast and guarded), compilation and Adam written out --------------------


class GuardedWorker(Worker):
    """A Worker made safe: the child ignores SIGINT, reports errors in one line, and exits once
    the trainer is gone (it closes its pipe ends' copies); a dead child: a WorkerError, no hang."""

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
            with contextlib.suppress(EOFError, BrokenPipeError, KeyboardInterrupt):
                super().child_loop(conn, env_id, seed, obs_view)  # until the trainer goes
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
            with contextlib.suppress(EOFError, OSError):  # (the pipe of a child that died)
                status, payload = self.trainer_end.recv()
                if status == "error":
                    raise WorkerError(f"{name} failed: {payload}")
                return payload
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
        self.games = [Game(env_id, seed + i) for i in range(len(obs_view))]
        obs_view[:] = [game.reset() for game in self.games]

    def send_step(self, actions: np.ndarray):
        self.actions = actions

    def receive(self) -> tuple:
        return self.step_games(self.games, self.actions, self.obs_view)

    def close(self):
        for game in self.games:
            game.close()


class Engine:
    """Both engines: the games write into `obs_array` (uint8, on the host); the trainer reads it."""

    def __init__(self, obs_array: np.ndarray, device: torch.device):
        self.obs_array, self.device = obs_array, device
        self.obs_tensor = torch.from_numpy(obs_array)
        # On a GPU: page-locked, read asynchronously (refilled only after `actions.cpu()` waits).
        self.staging = (torch.empty(obs_array.shape, dtype=torch.uint8, pin_memory=True)
                        if device.type == "cuda" else None)

    def observations(self) -> torch.Tensor:  # on the training device (no copy on the CPU)
        if self.staging is None:
            return self.obs_tensor
        self.staging.copy_(self.obs_tensor)
        return self.staging.to(self.device, non_blocking=True)


class WorkerPool(Engine):
    """`--env-backend game`: GuardedWorkers of Games (with --num-workers 0, an InProcessWorker)."""

    def __init__(self, config: Config, first_seed: int, device: torch.device):
        self.workers, self.size = [], config.num_envs // max(config.num_workers, 1)
        shape = (config.num_envs, FRAME_STACK, FRAME_SIZE, FRAME_SIZE)
        super().__init__(torch.zeros(shape, dtype=torch.uint8).share_memory_().numpy(), device)
        worker_class, n = GuardedWorker if config.num_workers else InProcessWorker, self.size
        try:
            for index in range(max(config.num_workers, 1)):
                ends = [worker.trainer_end for worker in self.workers if worker.trainer_end]
                self.workers.append(worker_class(index, config.env, first_seed + index * n,
                                                 self.obs_array[index * n:][:n], ends))
        except BaseException:
            self.close()  # the workers started so far
            raise

    def step(self, actions: np.ndarray) -> StepResult:  # all sent first: the children play at once
        for i, worker in enumerate(self.workers):
            worker.send_step(actions[i * self.size:][:self.size])
        results = [worker.receive() for worker in self.workers]
        rewards, terminated, truncated = (np.concatenate(part) for part in list(zip(*results))[:3])
        final_obs, episodes = ({i * self.size + j: item for i, result in enumerate(results)
                                for j, item in result[part].items()} for part in (3, 4))
        return StepResult(rewards, terminated, truncated, final_obs, episodes)

    def close(self):
        for worker in self.workers:
            worker.close()


class VectorGames(Engine):
    """All the games at once in ale-py's C++ vector env (`--env-backend ale-vector`), stepped by
    threads in this process, set to play the Game's game; FIRE after a lost life (in place of the
    sampled action, which is stored) and the clipping are done here. What differs from the Game
    (tests/test_atari_game.py holds the rest equal): FIRE is one frame at a reset and one step after
    a lost life, with no NOOP; the stack goes on after a lost life; `final_obs`'s newest picture
    (<5% of pixels differ; it only bootstraps a cut); no-ops drawn by ALE, their points unseen."""

    def __init__(self, env_id: str, seeds: list, device: torch.device = torch.device("cpu"),
                 noop_max: int = 30):
        settings = gym.spec(env_id).kwargs  # the ROM and what the id asks: sticky actions, limit
        self.env = ale_py.AtariVectorEnv(
            settings["game"], len(seeds),
            repeat_action_probability=settings.get("repeat_action_probability", 0.0),
            full_action_space=settings.get("full_action_space", False),
            max_num_frames_per_episode=settings.get("max_num_frames_per_episode", 108_000),
            frameskip=FRAME_SKIP, stack_num=FRAME_STACK, img_height=FRAME_SIZE,
            img_width=FRAME_SIZE, grayscale=True, maxpool=True, noop_max=noop_max,
            use_fire_reset=True, reward_clipping=False, episodic_life=False, life_loss_info=True,
            autoreset_mode="SameStep")
        obs, info = self.env.reset(seed=np.array(seeds))  # seeds only the first reset
        super().__init__(np.array(obs, dtype=np.uint8), device)
        action_set = self.env.ale.get_action_set()  # FireResetEnv's test of a game that needs FIRE
        self.needs_fire = len(action_set) >= 3 and action_set[1] == ale_py.Action.FIRE
        self.serving = np.zeros(len(seeds), dtype=bool)  # a life was lost: FIRE on the next step
        self.episode_frames = info["episode_frame_number"]
        self.episode_returns = np.zeros(len(seeds))
        self.episode_lengths = np.zeros(len(seeds), dtype=np.int64)
        self.close = self.env.close

    def step(self, actions: np.ndarray) -> StepResult:  # FIRE where a life was lost just before
        sent = np.where(self.serving, 1, actions) if self.needs_fire else actions
        obs, raw_rewards, terminated, truncated, info = self.env.step(sent)
        self.obs_array[:] = obs
        self.episode_returns += raw_rewards
        self.episode_lengths += 1
        restarted, self.serving = self.endings(terminated, info["episode_frame_number"],
                                               self.episode_frames)  # serve after a lost life
        self.episode_frames = info["episode_frame_number"]
        ended = np.flatnonzero(restarted)
        final_obs = {i: info["final_obs"][i] for i in ended}  # (a lost life has none: obs goes on)
        episodes = {i: {"return": float(self.episode_returns[i]),
                        "length": int(self.episode_lengths[i])} for i in ended}
        self.episode_returns[ended], self.episode_lengths[ended] = 0.0, 0
        rewards = np.sign(raw_rewards).astype(np.float32)
        return StepResult(rewards, terminated, truncated, final_obs, episodes)

    @staticmethod
    def endings(terminated: np.ndarray, episode_frames: np.ndarray, previous_frames: np.ndarray):
        """(restarted, life_lost): a new game restarts the frame counter; other ends: lost lives."""
        restarted = episode_frames <= previous_frames
        return restarted, terminated & ~restarted


class PictureRollout(Rollout):
    """The lesson's Rollout, each picture stored once (7,056 bytes a step, not 28,224): a stack's
    older pictures are the newest of the steps before, unless it restarted (its older ones zero)."""

    def __init__(self, config: Config, device: torch.device):  # the lesson's, less `obs`
        self.num_envs, self.device = config.num_envs, device
        shape = (config.num_steps, config.num_envs)
        self.pictures = torch.zeros((config.num_steps + FRAME_STACK, config.num_envs, FRAME_SIZE,
                                     FRAME_SIZE), dtype=torch.uint8, device=device)
        self.fresh = torch.zeros(shape, dtype=torch.bool, device=device)
        self.actions = torch.zeros(shape, dtype=torch.long, device=device)
        self.log_probs, self.values = (torch.zeros(shape, device=device) for _ in range(2))
        pinned = device.type == "cuda"
        self.rewards, self.dones = (torch.zeros(shape, pin_memory=pinned) for _ in range(2))

    def store_obs(self, step: int, obs: torch.Tensor):  # the newest picture (at step 0: all four)
        new = FRAME_STACK if step == 0 else 1  # (row t + 3 holds the newest picture of step t)
        self.pictures[step + FRAME_STACK - new:step + FRAME_STACK] = obs[:, -new:].transpose(0, 1)
        self.fresh[step] = step > 0 and obs[:, :-1].flatten(1).amax(1) == 0  # older ones all 0

    def minibatch(self, indices: torch.Tensor, advantages, returns) -> Minibatch:
        columns = (self.actions, self.log_probs, advantages, returns, self.values)
        return Minibatch(self.stacks(indices), *(c.flatten()[indices] for c in columns))

    def stacks(self, indices: torch.Tensor) -> torch.Tensor:  # exactly as the games built them
        counts = self.fresh.long().cumsum(0)  # stacks started afresh after step 0, up to step t
        steps, envs = indices // self.num_envs, indices % self.num_envs
        # Picture k of step t's stack is the newest of step t - 3 + k, in row t + k (rows 0-2: the
        # first stack's older ones), unless a stack started afresh since: then zeros (last row).
        rows = steps[:, None] + torch.arange(FRAME_STACK, device=self.device)
        since = counts[(rows - (FRAME_STACK - 1)).clamp(min=0), envs[:, None]]
        rows = torch.where(since == counts[steps, envs][:, None], rows, len(self.pictures) - 1)
        flat_rows = (rows * self.num_envs + envs[:, None]).flatten()  # one gather of pictures:
        return self.pictures.flatten(0, 1).index_select(0, flat_rows).unflatten(0, rows.shape)


def compile_learner(main: Main):
    """torch.compile the rollout's inference and the loss with its backward (bound methods: the
    checkpoint's names stay), now, at their sizes: where compiling fails, eager code runs."""
    model, trainer, config, device = main.model, main.trainer, main.config, main.guard.device
    logging.getLogger("torch.utils.cpp_extension").addFilter(not_the_cuda_home_warning)
    eager_forward, eager_loss = model.forward, trainer.compute_loss
    try:
        model.forward = torch.compile(eager_forward, mode=config.compile_mode)
        trainer.compute_loss = torch.compile(eager_loss, mode=config.compile_mode)
        rollout = PictureRollout(config, device)  # of zeros, at the run's sizes
        obs = rollout.stacks(torch.arange(config.num_envs, device=device))
        with torch.inference_mode():  # compiled code is specialised to it (the rollout)...
            model.act(obs)
        with torch.no_grad():  # ...and to no_grad (the last value)
            model(obs)
        # A minibatch: distinct tensors (compiled code is specialised to which are the same).
        indices = torch.arange(rollout.actions.numel() // config.num_minibatches, device=device)
        loss, _ = trainer.compute_loss(rollout.minibatch(indices, rollout.values, rollout.values))
        loss.backward()
        trainer.optimizer.zero_grad()
    except Exception as error:
        model.forward, trainer.compute_loss = eager_forward, eager_loss
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


# ----- Ranks (torchrun); RunGuard: set-up, Ctrl-C, failures, logging, the summary -----------------


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
    """Everything around PPO's loop that is not PPO (its RunLog tells what happens)."""

    def __init__(self, main: Main):
        self.main, self.stop_signal, self.signals = main, None, None
        self.ranks = self.games = self.log = self.summary = None

    config = property(lambda self: self.main.config)  # the run's (or the checkpoint's) settings
    rollout_class = PictureRollout  # the lesson's Rollout, each picture stored once
    solved_step = property(lambda self: self.log.solved_step)  # --target-return was reached
    optimizer = Adam if Run.optimizer is torch.optim.Adam else Run.optimizer  # torch's, faster
    evaluate = staticmethod(lambda config: evaluate_checkpoint(config))  # --eval: no training
    mean = lambda self, value: self.ranks.mean([value])[0]  # over the ranks (torchrun)
    # After Ctrl-C: at once; under torchrun, all ranks stop together after the rollout.
    stop_at_once = lambda self: self.stop_signal is not None and not self.ranks.distributed

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
        self.checkpoint = load_checkpoint(self.config.resume) if self.config.resume else None
        config = resumed_config(self.checkpoint, self.config) if self.checkpoint else self.config
        check_settings(config)  # the settings given, and on --resume the checkpoint's
        self.num_actions = inspect_env(config.env)
        device = pick_device(config.device)
        # What this process holds (peak RSS at --num-envs 8-128, --num-steps 4-256): 2 MB a game
        # (its emulator); on the CPU, 7.1 KB a rollout step (a picture), 300 KB a minibatch row.
        per_step = 8 if device.type == "cuda" else 7_100 + 300_000 // config.num_minibatches
        refuse_what_will_not_fit(config.num_envs * (2_000_000 + config.num_steps * per_step),
                                 "the games, the rollout and the update")
        self.ranks = Ranks(device)  # under torchrun, joined with the others; alone, a world of one
        self.device = self.ranks.device
        self.steps_per_step = config.num_envs * self.ranks.world_size  # all envs of all ranks
        # Rank 0 names and makes the run dir: the default name holds the time, which may differ.
        self.run_dir = self.ranks.from_rank_0(lambda: make_run_dir(config, self.checkpoint))
        self.main.config = config = dataclasses.replace(config, run_dir=str(self.run_dir))
        # The trainer's draws (sampling, shuffling) take seed + rank; each game seeds its own.
        self.seed = config.seed + self.ranks.rank
        random.seed(self.seed)
        np.random.seed(self.seed)
        torch.manual_seed(self.seed)
        self.updates, self.checkpoint_path = 0, self.run_dir / "checkpoint.pt"
        self.log = RunLog(self, start_time)

    def prepare_learner(self) -> int:  # --resume, rank 0's weights everywhere, --compile
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

    def start_games(self) -> Engine:  # game i of rank r is seeded with seed + r * num_envs + i
        config, first_seed = self.config, self.config.seed + self.ranks.rank * self.config.num_envs
        self.games = (VectorGames(config.env, [first_seed + i for i in range(config.num_envs)],
                                  self.device) if config.env_backend == "ale-vector" else
                      WorkerPool(config, first_seed, self.device))
        return self.games

    def after_rollout(self, ended: list):  # all ranks' episodes, by step; Interrupted: stop
        shared = self.ranks.gather((ended, self.stop_signal))
        for step, episode in sorted((item for rank_ended, _ in shared for item in rank_ended),
                                    key=lambda step_and_episode: step_and_episode[0]):
            self.log.record_episode(episode, step)
        signals = [signum for _, signum in shared if signum is not None]
        if signals:
            self.stop_signal = signals[0]
            raise Interrupted

    def after_update(self, stats: dict):  # the ranks' means: stop if not finite; log; save
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

    def __exit__(self, kind, error, traceback) -> bool:  # saves, unless bad input or a bug
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

    def give_back(self):  # what the run changed in this process: signal handlers, the ranks
        if self.signals is not None:
            self.signals.give_back()
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


class RunLog:
    """What a run tells, from rank 0: the start-up block, progress lines (at most one a second),
    TensorBoard, summary.json, a closing line. Its counts span the resumes; its speeds, this one."""

    def __init__(self, guard: RunGuard, start_time: float):
        self.guard, self.main, self.start_time = guard, guard.main, start_time
        saved = guard.checkpoint.get("log", {}) if guard.checkpoint else {}
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

    def start(self):  # the start-up block: what runs where, what differs, how far it goes
        guard, config, step = self.guard, self.guard.config, self.main.global_step
        batch = guard.steps_per_step * config.num_steps
        self.last_step = step + max(0, math.ceil((config.total_timesteps - step) / batch)) * batch
        rounded = (f" ({config.total_timesteps:,} rounded up to whole rollouts of {batch:,})"
                   if self.last_step != config.total_timesteps else "")
        self.say(f"{SCRIPT}.py: {config.env} on {guard.device}, seed {config.seed}, "
                 f"{self.last_step:,} steps{rounded}\nrun dir: {guard.run_dir}")
        changed = [(f.name.replace("_", "-"), getattr(config, f.name))
                   for f in dataclasses.fields(Config)
                   if f.name != "run_dir" and getattr(config, f.name) != f.default]
        if changed:
            self.say("settings: " + " ".join(f"--{'' if value else 'no-'}{flag}"
                                              if isinstance(value, bool) else f"--{flag} {value}"
                                              for flag, value in changed))
        if self.resumed_at_step is not None:
            self.main.anneal_learning_rate()  # as the next update will: the rate it takes
            until = f", annealed to 0 by step {self.last_step:,}" if config.anneal_lr else ""
            self.say(f"resuming from {guard.checkpoint['path']} at step {step:,} (learning rate "
                     f"{self.main.trainer.optimizer.param_groups[0]['lr']:.6g}{until})")
        self.say("learner: the lesson's torch code (Model, Trainer, compute_gae)"
                 + (", torch.compile" if config.compile else ""))
        where = (f"{config.num_envs // config.num_workers} per Worker in {config.num_workers} "
                 f"child processes" if config.num_workers else "in this process")
        self.say("engine: " + (f"the lesson's Game, {where}" if config.env_backend == "game" else
                               "ale-py's vector engine (C++), the same game as Game; "
                               "--env-backend game plays the lesson's Game"))
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
            self.solved_step, self.solved_seconds = step, round(self.seconds(), 3)

    def update(self, stats: dict):
        step, writer = self.main.global_step, self.writer
        if self.first_update_end is None:
            self.first_update_end = (time.perf_counter(), step)
        if writer is None:
            return
        for key, value in stats.items():
            writer.add_scalar(f"losses/{key}", value, step)
        writer.add_scalar("charts/learning_rate", self.main.trainer.optimizer.param_groups[0]["lr"],
                          step)
        speed = self.steady_speed()
        if speed is not None:
            writer.add_scalar("charts/steps_per_second", speed, step)
        if time.perf_counter() - self.last_print >= 1.0:
            self.print_progress()

    def seconds(self) -> float:  # wall-clock, of the whole run: the parts resumed from, and this
        return self.earlier_seconds + time.perf_counter() - self.start_time

    def steady_speed(self) -> Optional[float]:  # steps/s after this process's first update
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

    def state(self) -> dict:  # what the checkpoint keeps of the log, for a resumed run
        return {"episodes": self.episodes, "seconds": self.seconds(),
                "recent_returns": list(self.recent_returns),
                "recent_lengths": list(self.recent_lengths)}

    def finish(self, interrupted: bool, failed: bool) -> dict:  # summary.json, the last lines
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
            "solved_seconds": self.solved_seconds, "interrupted": interrupted,
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

# ----- Checkpoints, evaluation and video; the input's checks; the command line --------------------


def learner_state(main: Main) -> dict:
    """What a run continues from, as data torch.load(..., weights_only=True) reads (no code)."""
    return {"script": SCRIPT, "env": main.config.env, "num_actions": main.guard.num_actions,
            "config": dataclasses.asdict(main.config),
            "model": main.model.state_dict(), "optimizer": main.trainer.optimizer.state_dict(),
            "global_step": main.global_step, "updates": main.guard.updates,
            "anneal_from": list(main.anneal_from), "log": main.guard.log.state(),
            "rng": {"torch": torch.get_rng_state()}}


def load_weights(model: Model, weights: dict, config: Config):
    """A checkpoint's weights into `model`; ones that do not fit are refused in one line."""
    renamed = {"actor" + key[6:] if key.startswith("policy.") else key: value  # an older
               for key, value in weights.items()}  # script's names: the actor was `policy`
    try:
        model.load_state_dict(renamed)
    except RuntimeError as error:
        raise UsageError(f"the checkpoint's network does not fit {config.env}: "
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


def resumed_config(checkpoint: dict, given: Config) -> Config:
    """A resumed (or evaluated) run's settings: the checkpoint's, but those given win."""
    fields = dataclasses.fields(Config)
    saved = {f.name: checkpoint["config"][f.name] for f in fields if f.name in checkpoint["config"]}
    saved["run_dir"] = str(Path(checkpoint["path"]).parent)
    typed = getattr(given, "typed", None)  # the command line's flags (None: Config(...) in code)
    changed = {f.name: getattr(given, f.name) for f in fields
               if (f.name in typed if typed is not None else getattr(given, f.name) != f.default)}
    if "env" in changed and changed["env"] != saved.get("env"):
        raise UsageError(f"the checkpoint was trained with --env {saved['env']}, not "
                         f"{changed['env']}")
    return Config(**{**saved, **changed})


@torch.no_grad()
def evaluate_checkpoint(given: Config) -> dict:
    """--eval: the real, unclipped score of --eval-episodes whole games (all lives) of a policy;
    with --video, an mp4 of them (OpenCV's VideoWriter)."""
    check_settings(given)
    checkpoint = load_checkpoint(given.eval)
    config = resumed_config(checkpoint, given)
    model = Model(inspect_env(config.env), bfloat16=config.precision == "bfloat16")
    load_weights(model, checkpoint["model"], config)
    torch.manual_seed(config.seed)
    game, video, path, returns = Game(config.env, config.seed), None, None, []
    try:
        if config.video:
            Path(config.run_dir).mkdir(parents=True, exist_ok=True)
            path = str(Path(config.run_dir) / "eval.mp4")
            fps, (height, width) = game.env.metadata["render_fps"], game.ale.getScreenDims()
            video = cv2.VideoWriter(path, cv2.VideoWriter_fourcc(*"mp4v"), fps / FRAME_SKIP,
                                    (width, height))  # a picture each agent step
            if not video.isOpened():
                raise UsageError(f"OpenCV cannot write {path}")
        obs = game.reset()
        while len(returns) < config.eval_episodes:
            if video is not None:  # the emulator's screen, in colour
                video.write(cv2.cvtColor(game.ale.getScreenRGB(), cv2.COLOR_RGB2BGR))
            actions, _, _ = model.act(torch.from_numpy(obs)[None], greedy=config.greedy)
            obs, _, _, _, info = game.step(actions.item())
            if "episode" in info:
                returns.append(info["episode"]["return"])
    finally:
        game.close()
        if video is not None:
            video.release()
    mean, std = float(np.mean(returns)), float(np.std(returns))
    how = "greedy" if config.greedy else "sampled"
    episodes = f"{len(returns)} episode{'s' * (len(returns) != 1)}"
    print(f"eval {config.env}: return {mean:.2f} ± {std:.2f} over {episodes} ({how} actions)")
    if path is not None:
        print(f"video: {path}")
    return {"script": SCRIPT, "env": config.env, "episodes": len(returns), "mean_return": mean,
            "std_return": std, "returns": returns, "greedy": config.greedy, "video": path}


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
    """Refuse, in one line saying what to change, numbers out of range and clashing flags."""
    for f in dataclasses.fields(Config):
        value, rule = getattr(config, f.name), f.metadata["check"]
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, float) and not math.isfinite(value):
            raise UsageError(f"{flag} must be a finite number, not {value}")
        if rule is not None and value is not None and not RANGES[rule][0](value):
            raise UsageError(f"{flag} must be {RANGES[rule][1]}, not {value}")
    for name, choices in (("compile_mode", ("default", "reduce-overhead", "max-autotune")),
                          ("precision", ("float32", "bfloat16")),
                          ("env_backend", ("game", "ale-vector"))):
        if getattr(config, name) not in choices:
            raise UsageError(f"unknown --{name.replace('_', '-')} {getattr(config, name)!r}: "
                             f"use {', '.join(choices[:-1])} or {choices[-1]}")
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


def inspect_env(env_id: str) -> int:
    """Check that the env exists and is an Atari game. Returns its number of actions."""
    if env_id not in gym.registry:
        if "." in env_id and ":" not in env_id:  # PettingZoo's module.name: mpe2.simple_spread_v3
            raise UsageError(f"{env_id} is a multi-agent PettingZoo env: use ppo_multiagent.py")
        close = " or ".join(difflib.get_close_matches(env_id, list(gym.registry), cutoff=0.6))
        hint = (f"; did you mean {close}?" if close
                else "; Atari ids look like ALE/Pong-v5 or PongNoFrameskip-v4")
        raise UsageError(f"unknown env {env_id!r}{hint}")
    atari = str(gym.spec(env_id).entry_point).startswith("ale_py")
    if atari and not (env_id.endswith("NoFrameskip-v4") or env_id.startswith("ALE/")):  # (all v5)
        game = env_id.split("-")[0].replace("Deterministic", "").replace("NoFrameskip", "")
        raise UsageError(f"{env_id} skips frames: use {game}NoFrameskip-v4 or ALE/{game}-v5")
    try:
        env = Game(env_id, seed=0).env if atari else gym.make(env_id)
    except Exception as error:
        raise UsageError(f"cannot make {env_id}: {type(error).__name__}: {error}") from None
    obs_space, action_space = env.observation_space, env.action_space
    env.close()
    if atari:
        return int(action_space.n)
    kind = type(obs_space).__name__
    if not isinstance(obs_space, gym.spaces.Box) and kind not in SPACES_OBSERVATIONS:
        raise UsageError(f"{env_id} is not an Atari game, and no script of this library handles "
                         f"{kind} observations yet")
    script = "ppo_continuous.py" if isinstance(action_space, gym.spaces.Box) else "ppo_cartpole.py"
    if kind in SPACES_OBSERVATIONS or obs_space.dtype == np.uint8 and len(obs_space.shape) >= 2:
        script = "ppo_spaces.py, which reads images and nests of spaces"
    raise UsageError(f"{env_id} is not an Atari game: use {script}")


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
    """The run dir, made and tested for writing; one holding another run needs --overwrite."""
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
