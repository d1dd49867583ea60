"""PPO for Atari games from pixels, in one file: the PPO paper's Atari setup, annotated.

Proximal Policy Optimization (Schulman et al., 2017: "PPO paper") with the Atari preprocessing of
DeepMind's DQN (Mnih et al., 2015) and the implementation details of CleanRL and Stable-Baselines3
("The 37 Implementation Details of PPO", Huang et al., 2022: "37 details"), each named where it is
implemented. Their published scores (10M steps: Breakout ~400, Pong ~20) are the yardstick.

The idea. A policy-gradient method improves a policy with games the policy itself just played; the
games then describe an older policy, so plain policy gradient uses each batch once. PPO reuses each
batch ("rollout") for several epochs of minibatch steps, and keeps the new policy near the one that
collected the data by clipping the probability ratio r_t = pi(a_t | s_t) / pi_old(a_t | s_t) in its
objective (PPO paper, eq. 7), so that a step gains nothing by moving r_t beyond [1 - eps, 1 + eps]:

    L_clip = mean_t min( r_t A_t, clip(r_t, 1 - eps, 1 + eps) A_t )

The advantage A_t says how much better action a_t did than the value V(s_t) expected. Generalized
Advantage Estimation (GAE, Schulman et al., 2016) weighs the one-step errors of V by gamma * lambda:

    A_t = sum_k (gamma lambda)^k delta_(t+k),   delta_t = r_t + gamma V(s_(t+1)) - V(s_t)

Read it top to bottom: `Config`, `Game` (one preprocessed game), `Worker` (Games in a child
process), `Model` (the Nature CNN), `compute_gae` and `Trainer` (a clipped PPO step), `Main` (the
loop). PPO is complete at the banner; below it, the machinery: ale-py's C++ engine, frames stored
once, torchrun, bookkeeping, checkpoints, evaluation, the CLI.

Run it:         python ppo_atari.py --env BreakoutNoFrameskip-v4   (--help lists every flag)
On N GPUs:      torchrun --standalone --nproc_per_node N ppo_atari.py   (data parallel: `Ranks`)
In a notebook:  from ppo_atari import Config, Main; Main(Config(total_timesteps=50_000)).run()
                (or paste this file into a cell, and call `Main(Config(...)).run()` in the next)
10M steps take hours even on a GPU; on a 2-core CPU, 6 or 7 hours (see README).
"""

import argparse
import copy
import dataclasses
import difflib
import hashlib
import json
import math
import multiprocessing.connection  # (binds `multiprocessing` too)
import os
import random
import signal
import sys
import threading
import time
import typing
from collections import deque
from dataclasses import dataclass, field
from multiprocessing import shared_memory
from pathlib import Path
from typing import Optional

import ale_py  # importing it registers the Atari ids (ALE/*-v5, *NoFrameskip-v4) with gymnasium
import cv2
import gymnasium as gym
import numpy as np
import torch
import torch.distributed as dist  # already loaded by `import torch`: costs nothing more
import torch.nn as nn

SCRIPT = "ppo_atari"
FRAME_SIZE = 84  # DQN's observation: 84x84 grayscale
FRAME_STACK = 4  # the last 4 frames, so that the network can see motion
FRAME_SKIP = 4  # each action is repeated for 4 emulator frames


def option(default, help):
    """A Config field with its one-line explanation, which `--help` prints."""
    return field(default=default, metadata={"help": help})


@dataclass
class Config:
    """Every setting of a run. Each field is also a command-line flag (`num_envs` -> `--num-envs`).
    The defaults are the PPO paper's Atari settings, as CleanRL's ppo_atari.py uses them."""

    # PPO's hyperparameters.
    learning_rate: float = option(2.5e-4, "Adam step size at the start, annealed linearly to 0")
    anneal_lr: bool = option(True, "anneal the learning rate linearly to 0 over the run")
    gamma: float = option(0.99, "discount factor")
    gae_lambda: float = option(0.95, "GAE lambda: bias (0) vs variance (1) of the advantage")
    num_minibatches: int = option(4, "minibatches each rollout is split into")
    update_epochs: int = option(4, "passes over each rollout")
    clip_coef: float = option(0.1, "PPO's clip range for the probability ratio")
    clip_value_loss: bool = option(True, "clip the value update around the rollout's values too")
    ent_coef: float = option(0.01, "weight of the entropy bonus")
    vf_coef: float = option(0.5, "weight of the value loss")
    max_grad_norm: float = option(0.5, "clip the global gradient norm to this")
    target_kl: Optional[float] = option(None, "stop an update's epochs once approx KL exceeds this")

    # Collecting experience.
    env: str = option("BreakoutNoFrameskip-v4", "Atari game id: *NoFrameskip-v4 or ALE/*-v5")
    # ale-vector is the faster engine; tests/test_atari_game.py checks both play the same games.
    env_backend: str = option("ale-vector", "ale-vector: ale-py's C++ vector env | game: the Game "
                                            "class, in --num-workers processes")
    num_envs: int = option(8, "games played side by side (by each rank, under torchrun)")
    num_workers: int = option(2, "with --env-backend game: child processes for the games (0: here)")
    num_steps: int = option(128, "steps per game in a rollout: a rollout is num_envs * num_steps")

    # The run.
    seed: int = option(1, "seeds everything; game i of rank r gets seed + r * num_envs + i")
    total_timesteps: int = option(10_000_000, "agent steps (4 frames each) of all games and ranks")
    device: str = option("auto", "auto | cpu | cuda: auto takes CUDA when present")
    run_dir: Optional[str] = option(
        None, "logs, checkpoint and summary go here (default runs/<env>__<script>__<seed>__<time>)")
    target_return: Optional[float] = option(None, "stop at this mean score of 100 games")
    checkpoint_every: int = option(500_000, "save a checkpoint every this many steps, and last")
    resume: Optional[str] = option(None, "continue training from this checkpoint")
    eval: Optional[str] = option(None, "play --eval-episodes whole games with this checkpoint")
    eval_episodes: int = option(10, "games played by --eval")
    greedy: bool = option(False, "with --eval, take the most likely action instead of sampling")
    video: bool = option(False, "with --eval, write an mp4 of the games into the run dir")
    compile: bool = option(True, "torch.compile inference and the update (eager where it cannot)")
    # reduce-overhead records CUDA graphs: one launch replays a whole forward or backward.
    compile_mode: str = option("default", "torch.compile mode: default | reduce-overhead (CUDA "
                                          "graphs, for GPUs) | max-autotune")
    # bfloat16 is faster on CPUs with AMX and on recent GPUs, but rounds the body's numbers:
    # float32, as every published PPO result, is the default (benchmarks/README.md).
    precision: str = option("float32", "float32 | bfloat16: the network's body in bfloat16")


class Game:
    """One Atari game, preprocessed as DQN, the PPO paper, CleanRL and SB3 do it. Each step:

    - Action repeat (MaxAndSkipEnv): the action is held for 4 emulator frames and their rewards
      are summed; the repeat stops early if the game ends inside it. The agent acts 4x less often,
      so it sees further for the same compute, and 4 frames rarely change the right action.
    - Max-pooling: the picture is the pixel-wise max of the last two frames, because Atari
      sprites flicker (some are drawn only every other frame).
    - Grayscale, 84x84 (WarpFrame): the emulator gives grayscale frames (`obs_type="grayscale"`,
      as gymnasium's AtariPreprocessing and ale-py's vector env read them), shrunk with area
      interpolation, which averages pixels instead of dropping them.
    - Frame stack (VecFrameStack): the observation is the last 4 pictures, so that speed and
      direction can be seen. When a training episode (re)starts, the stack is zeros and the first
      picture, as in SB3 and ale-py's vector env: no picture of the episode before leaks in.
    - Life loss ends the training episode (EpisodicLifeEnv): `terminated=True`, so that losing a
      life is learned as the end of everything, which helps a lot early on. The game goes on.
    - FIRE to start (FireResetEnv): games like Breakout wait for FIRE after a (re)start; the Game
      presses it so that an agent does not stall.
    - Reward clipping (ClipRewardEnv): the training reward is the sign of the score change, so one
      step size fits games whose points differ by orders of magnitude. `info["episode"]` reports
      the real score, unclipped, summed over all lives, and the game's length in agent steps.
    - No-op starts (NoopResetEnv): after a real reset, 1..30 random NOOP frames, so that the games
      do not all start from the same picture (`noop_max=0`: none, for tests of the exact start).

    Observations are uint8 (the model scales them by 1/255): 4 times less memory than float32.
    """

    def __init__(self, env_id: str, seed: int, noop_max: int = 30,
                 render_mode: Optional[str] = None):
        # frameskip=1: the Game does the skipping itself (ALE/*-v5 ids would otherwise skip 4
        # frames and the max-pool would see the wrong frames). v5's sticky actions (each frame,
        # the previous action is repeated with probability 0.25) are left as the id asks.
        options = {"obs_type": "grayscale", "frameskip": 1}
        if render_mode:
            options["render_mode"] = render_mode
        self.env = make_atari(env_id, **options)
        self.ale = self.env.unwrapped.ale
        meanings = self.env.unwrapped.get_action_meanings()
        self.needs_fire = len(meanings) >= 3 and meanings[1] == "FIRE"  # FireResetEnv's test
        self.noop_max = noop_max
        self.seed = seed
        self.rng = np.random.default_rng(seed)  # draws the number of no-ops
        self.stack = np.zeros((FRAME_STACK, FRAME_SIZE, FRAME_SIZE), dtype=np.uint8)
        self.episode_return, self.episode_length = 0.0, 0

    def reset(self) -> np.ndarray:
        """A real reset, at the start and at game over: new game, no-ops, FIRE."""
        frame, _ = self.env.reset(seed=self.seed)  # seed only the first reset; later ones go on
        self.seed = None
        self.previous_frame = self.frame = frame
        self.episode_return, self.episode_length = 0.0, 0
        for _ in range(self.rng.integers(1, self.noop_max + 1) if self.noop_max else 0):
            self.episode_return += self.raw_step(0)
            if self.game_over:
                frame, _ = self.env.reset()
                self.previous_frame = self.frame = frame
                self.episode_return = 0.0
        self.lives = self.ale.lives()
        if self.needs_fire:
            self.press_fire()
        return self.restart_stack()

    def raw_step(self, action: int) -> float:
        """One emulator frame. Keeps the last two frames for the max-pool."""
        frame, reward, self.game_over, self.truncated, _ = self.env.step(action)
        self.previous_frame, self.frame = self.frame, frame
        return reward

    def repeat(self, action: int) -> float:
        """The action for 4 frames, or fewer if the game ends (or hits ALE's frame limit)."""
        reward = 0.0
        for _ in range(FRAME_SKIP):
            reward += self.raw_step(action)
            if self.game_over or self.truncated:
                break
        return reward

    def picture(self) -> np.ndarray:
        """The max of the last two frames, shrunk to 84x84."""
        return cv2.resize(np.maximum(self.previous_frame, self.frame), (FRAME_SIZE, FRAME_SIZE),
                          interpolation=cv2.INTER_AREA)

    def restart_stack(self) -> np.ndarray:
        self.stack[:-1] = 0
        self.stack[-1] = self.picture()
        return self.stack.copy()

    def press_fire(self):
        """FIRE, then action 2, as FireResetEnv does (some games start only after both); the points
        they score count in the game's score."""
        for action in (1, 2):
            self.episode_return += self.repeat(action)

    def step(self, action: int):
        reward = self.repeat(int(action))
        self.episode_return += reward
        self.episode_length += 1
        self.stack[:-1] = self.stack[1:]  # shift out the oldest picture...
        self.stack[-1] = self.picture()  # ...and put the newest last
        lives = self.ale.lives()
        life_lost = 0 < lives < self.lives  # the last life's loss is game over
        self.lives = lives
        # Read the flags now: the restarts below step the emulator again and overwrite them.
        game_over, truncated = self.game_over, self.truncated
        terminated = game_over or life_lost
        info = {}
        if terminated or truncated:
            info["final_obs"] = self.stack.copy()
        if game_over or truncated:
            info["episode"] = {"return": self.episode_return, "length": self.episode_length}
            obs = self.reset()
        elif life_lost:
            # As EpisodicLifeEnv + FireResetEnv: one NOOP step, then FIRE where the game needs it,
            # and the next training episode starts from a fresh stack: zeros and the picture.
            self.episode_return += self.repeat(0)
            if self.needs_fire:
                self.press_fire()
            obs = self.restart_stack()
        else:
            obs = self.stack.copy()
        return obs, float(np.sign(reward)), terminated, truncated, info

    def render(self) -> np.ndarray:
        return self.env.render()

    def close(self):
        self.env.close()


def step_games(games: list, actions: np.ndarray, obs_out: np.ndarray) -> tuple:
    """Step each Game with its action, write the observations into `obs_out` (a row per game), and
    return the rest: rewards, flags, and by game index the final observations of the episodes that
    ended and the statistics of the games that ended."""
    rewards = np.empty(len(games), dtype=np.float32)
    terminated = np.empty(len(games), dtype=bool)
    truncated = np.empty(len(games), dtype=bool)
    final_obs, episodes = {}, {}
    for i, (game, action) in enumerate(zip(games, actions)):
        obs_out[i], rewards[i], terminated[i], truncated[i], info = game.step(action)
        if "final_obs" in info:
            final_obs[i] = info["final_obs"]
        if "episode" in info:
            episodes[i] = info["episode"]
    return rewards, terminated, truncated, final_obs, episodes


class Worker:
    """Runs a few Games, either in a child process or, with `in_process=True`, right here.

    The trainer sends the actions through a `multiprocessing` pipe; the child steps its Games
    and answers with rewards, flags and finished-episode statistics. Observations, the one large
    array, skip the pipe: the child writes them into shared memory (`obs_view`, a numpy view over a
    `multiprocessing.shared_memory` block that the trainer reads as a tensor without a copy).

    Children are forked: they inherit the shared memory and start in milliseconds, instead of
    importing torch again. A child ignores SIGINT (a terminal's Ctrl-C reaches the whole process
    group; the trainer decides how to stop) and exits by itself when the trainer's end of its pipe
    closes, so a trainer that dies, however, never leaves a worker behind.
    """

    def __init__(self, index: int, env_id: str, seeds: list, obs_view: np.ndarray, in_process: bool,
                 inherited_trainer_ends: list):
        self.index = index
        self.env_id = env_id
        self.obs_view = obs_view
        self.in_process = in_process
        if in_process:
            self.games = [Game(env_id, seed) for seed in seeds]
            for i, game in enumerate(self.games):
                obs_view[i] = game.reset()
            return
        self.trainer_end, child_end = multiprocessing.Pipe()
        context = multiprocessing.get_context("fork")
        self.process = context.Process(
            target=Worker.child_main,
            args=(child_end, [self.trainer_end, *inherited_trainer_ends], env_id, seeds, obs_view),
            name=f"{SCRIPT}-worker-{index}", daemon=True)
        self.process.start()
        child_end.close()
        self.receive()  # the child's first answer comes once its Games are reset

    @staticmethod
    def child_main(conn, trainer_ends, env_id, seeds, obs_view):
        """The loop of the child process: step the Games on each command until told to stop."""
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        # A forked child holds copies of every pipe end the trainer had. Closing the trainer's ends
        # makes a recv() here fail with EOFError as soon as the trainer is gone.
        for end in trainer_ends:
            end.close()
        try:
            games = [Game(env_id, seed) for seed in seeds]
            for i, game in enumerate(games):
                obs_view[i] = game.reset()
            conn.send(("ok", None))
            while True:
                command, actions = conn.recv()
                if command == "close":
                    break
                conn.send(("ok", step_games(games, actions, obs_view)))
        except (EOFError, BrokenPipeError, KeyboardInterrupt):
            pass  # the trainer is gone or stopping: just exit
        except Exception as error:
            try:
                conn.send(("error", f"{type(error).__name__}: {error}"))
            except (BrokenPipeError, OSError):
                pass
        finally:
            os._exit(0)  # skip the inherited atexit handlers (they belong to the trainer)

    def send_step(self, actions: np.ndarray):
        if self.in_process:
            self.actions = actions
            return
        try:
            self.trainer_end.send(("step", actions))
        except (BrokenPipeError, ConnectionResetError):
            pass  # the child is gone: receive() finds out how, and says so

    def receive(self, timeout: float = 120.0) -> tuple:
        """The result of the last `send_step`. Waits on the pipe and on the process at once, so a
        child that dies is noticed at once instead of blocking `recv()` forever."""
        if self.in_process:
            return step_games(self.games, self.actions, self.obs_view)
        ready = multiprocessing.connection.wait([self.trainer_end, self.process.sentinel], timeout)
        if self.trainer_end in ready:
            try:
                status, payload = self.trainer_end.recv()
            except (EOFError, OSError):
                status, payload = "dead", None
            if status == "ok":
                return payload
            if status == "error":
                raise WorkerError(f"worker {self.index} ({self.env_id}) failed: {payload}")
        name = f"worker {self.index} ({self.env_id})"
        if not ready:
            raise WorkerError(f"{name} did not answer within {timeout:.0f} s")
        self.process.join(timeout=1.0)
        code = self.process.exitcode
        signal_name = signal.Signals(-code).name if code and code < 0 else None
        how = f"killed by signal {signal_name}" if signal_name else f"exit code {code}"
        raise WorkerError(f"{name} died ({how})")

    def close(self):
        if self.in_process:
            for game in self.games:
                game.close()
            return
        try:
            self.trainer_end.send(("close", None))
        except (BrokenPipeError, OSError):
            pass
        self.trainer_end.close()
        self.process.join(timeout=2.0)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()


def orthogonal(layer: nn.Module, gain: float = math.sqrt(2)) -> nn.Module:
    """Orthogonal weights of the given gain and zero biases (37 details, #2: the body gets sqrt(2),
    the policy output 0.01 so that all actions start equally likely, the value output 1)."""
    nn.init.orthogonal_(layer.weight, gain)
    nn.init.zeros_(layer.bias)
    return layer


class Model(nn.Module):
    """The Nature CNN (Mnih et al., 2015) with two heads on one shared body: a policy over the
    game's actions and a value. Sharing the body is what the PPO paper did on Atari: both heads need
    the same picture understood, and one CNN costs half of two.

    Input: uint8 [batch, 4, 84, 84], scaled to [0, 1] here, so that nothing upstream ever holds
    float copies of the observations.

    `bfloat16=True` (`--precision bfloat16`) runs the body's layers in bfloat16 under autocast: the
    weights, the gradients and Adam stay float32, and the heads read the body's output in float32,
    so the action probabilities and values keep their precision. It changes the numbers (about 3
    significant digits inside the body), not the algorithm.
    """

    def __init__(self, num_actions: int, bfloat16: bool = False):
        super().__init__()
        self.bfloat16 = bfloat16
        self.body = nn.Sequential(
            orthogonal(nn.Conv2d(FRAME_STACK, 32, kernel_size=8, stride=4)), nn.ReLU(),  # 32x20x20
            orthogonal(nn.Conv2d(32, 64, kernel_size=4, stride=2)), nn.ReLU(),  # -> 64 x 9 x 9
            orthogonal(nn.Conv2d(64, 64, kernel_size=3, stride=1)), nn.ReLU(),  # -> 64 x 7 x 7
            nn.Flatten(),
            orthogonal(nn.Linear(64 * 7 * 7, 512)), nn.ReLU())
        self.policy = orthogonal(nn.Linear(512, num_actions), gain=0.01)
        self.critic = orthogonal(nn.Linear(512, 1), gain=1.0)

    def forward(self, obs: torch.Tensor):
        """Logits of the actions [batch, actions] and values [batch]."""
        with torch.autocast(obs.device.type, dtype=torch.bfloat16, enabled=self.bfloat16):
            hidden = self.body(obs.float() / 255.0).float()
        return self.policy(hidden), self.critic(hidden).squeeze(-1)

    def value(self, obs: torch.Tensor) -> torch.Tensor:
        return self(obs)[1]

    def act(self, obs: torch.Tensor, greedy: bool = False):
        """Choose actions for a batch of observations: (actions [batch], their log-probabilities,
        the values of the observations)."""
        logits, value = self(obs)
        log_probs = torch.log_softmax(logits, dim=-1)
        if greedy:
            actions = log_probs.argmax(-1)
        else:
            actions = torch.multinomial(log_probs.exp(), 1).squeeze(-1)
        return actions, log_probs.gather(-1, actions.unsqueeze(-1)).squeeze(-1), value

    def evaluate_actions(self, obs: torch.Tensor, actions: torch.Tensor):
        """For the loss: log-probabilities of the taken actions under the current policy, the
        entropy of the policy, and the values, all [batch]."""
        logits, value = self(obs)
        log_probs = torch.log_softmax(logits, dim=-1)
        log_prob = log_probs.gather(-1, actions.unsqueeze(-1)).squeeze(-1)
        entropy = -(log_probs.exp() * log_probs).sum(-1)
        return log_prob, entropy, value


def compute_gae(rewards, values, dones, last_value, gamma: float, gae_lambda: float):
    """Generalized Advantage Estimation (Schulman et al., 2016; PPO paper, eq. 11-12).

    rewards, values, dones: [T, N] (time, env); last_value: [N], the value of the observation after
    the last step. `dones[t] = 1` when the episode ended at step t, after action t, by termination
    or truncation; for a truncated episode the trainer has already added gamma * V(final
    observation) to rewards[t], so cutting the sum there is right in both cases. Returns the
    advantages [T, N]; the value targets are advantages + values.

    Readers who know CleanRL: its `dones[t]` means "obs[t] starts a new episode", one step later
    than here; the two give the same advantages.

        $\\delta_t = r_t + \\gamma V(s_{t+1}) (1 - d_t) - V(s_t)$
        $\\hat{A}_t = \\delta_t + \\gamma \\lambda (1 - d_t) \\hat{A}_{t+1}$
    """
    advantages = torch.zeros_like(rewards)
    next_advantage = torch.zeros_like(last_value)
    next_value = last_value
    for t in reversed(range(rewards.shape[0])):
        not_done = 1.0 - dones[t]
        delta = rewards[t] + gamma * next_value * not_done - values[t]
        next_advantage = delta + gamma * gae_lambda * not_done * next_advantage
        advantages[t] = next_advantage
        next_value = values[t]
    return advantages


class Minibatch(typing.NamedTuple):
    """A shuffled slice of the rollout, one row per step: what the Trainer learns from."""

    obs: torch.Tensor  # [batch, 4, 84, 84] uint8, as the policy saw them
    actions: torch.Tensor  # [batch], the actions it took
    old_log_probs: torch.Tensor  # their log-probabilities then
    advantages: torch.Tensor  # from GAE
    returns: torch.Tensor  # the value targets: advantages + old values
    old_values: torch.Tensor  # the values then


class Trainer:
    """One PPO step on one minibatch: the clipped surrogate objective, the value loss, the entropy
    bonus, and a gradient step with the global gradient norm clipped."""

    def __init__(self, model: Model, config: Config, ranks: Optional["Ranks"] = None):
        self.model, self.config, self.ranks = model, config, ranks
        # Adam with eps 1e-5 instead of 1e-8 (37 details, #3), as the PPO paper's code. fused=True
        # does the same arithmetic in one kernel (benchmarks/README.md).
        self.optimizer = torch.optim.Adam(model.parameters(), lr=config.learning_rate, eps=1e-5,
                                          fused=True)

    @staticmethod
    def ppo_loss(minibatch: Minibatch, new_log_probs, entropy, new_values, config: Config):
        """The PPO loss and its diagnostics, from a minibatch and what the current weights make of
        it (all [batch])."""
        # Advantage normalisation per minibatch (37 details, #7): one step size suits every game.
        # Under torchrun, each rank normalises its own minibatch, as CleanRL's multi-GPU PPO does.
        advantages = minibatch.advantages
        advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)

        # The clipped surrogate (PPO paper, eq. 7): the probability ratio r = pi_new / pi_old may
        # move the objective only within [1 - clip, 1 + clip]; the max of the two negated terms is
        # the pessimistic (min) bound of the paper. 37 details, #8.
        log_ratio = new_log_probs - minibatch.old_log_probs
        ratio = log_ratio.exp()
        clipped_ratio = ratio.clamp(1 - config.clip_coef, 1 + config.clip_coef)
        policy_loss = torch.max(-advantages * ratio, -advantages * clipped_ratio).mean()

        # Value loss (37 details, #9): squared error to the GAE returns, clipped like the policy
        # around the values of the rollout, as in the PPO paper's Atari runs (on by default here).
        returns, old_values, clip = minibatch.returns, minibatch.old_values, config.clip_coef
        if config.clip_value_loss:
            clipped = old_values + (new_values - old_values).clamp(-clip, clip)
            value_loss = 0.5 * torch.max((new_values - returns) ** 2,
                                         (clipped - returns) ** 2).mean()
        else:
            value_loss = 0.5 * ((new_values - returns) ** 2).mean()

        # Entropy bonus (37 details, #10): rewards a spread-out policy, which keeps exploring.
        entropy_mean = entropy.mean()
        loss = policy_loss - config.ent_coef * entropy_mean + config.vf_coef * value_loss

        # Diagnostics (37 details, #12): approx KL with the low-variance estimator (r - 1) - log r
        # (Schulman, "Approximating KL divergence", 2020) and the share of samples the clip touched.
        with torch.no_grad():
            approx_kl = ((ratio - 1) - log_ratio).mean()
            clip_fraction = ((ratio - 1).abs() > config.clip_coef).float().mean()
        stats = {"policy_loss": policy_loss, "value_loss": value_loss, "entropy": entropy_mean,
                 "approx_kl": approx_kl, "clip_fraction": clip_fraction}
        return loss, stats

    def compute_loss(self, minibatch: Minibatch):
        """The loss of a minibatch under the current weights (what --compile compiles)."""
        new_log_probs, entropy, new_values = self.model.evaluate_actions(minibatch.obs,
                                                                         minibatch.actions)
        return self.ppo_loss(minibatch, new_log_probs, entropy, new_values, self.config)

    def gradient_step(self, minibatch: Minibatch) -> dict:
        """One gradient step on one minibatch. Returns the diagnostics as tensors (no host sync)."""
        loss, stats = self.compute_loss(minibatch)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if self.ranks is not None:  # (after the backward, outside the compiled loss)
            self.ranks.average_gradients(self.model.parameters())
        # Global gradient clipping (37 details, #11): all gradients together are scaled down to a
        # norm of at most max_grad_norm, which keeps a rare huge step from undoing the policy.
        stats["grad_norm"] = nn.utils.clip_grad_norm_(self.model.parameters(),
                                                      self.config.max_grad_norm)
        self.optimizer.step()
        return stats


class Main:
    """The loop: `Main(config).run()` trains (or, with --eval, plays a checkpoint's games) and
    returns the summary as a dict. One iteration (37 details, #6): play num_steps steps in each of
    num_envs games with the current policy, estimate each step's advantage with GAE, then take
    update_epochs passes over the rollout in shuffled minibatches, one clipped gradient step each.
    The `RunGuard` (below the banner) sets up, logs, saves and stops, so `train` reads as PPO."""

    def __init__(self, config: Config):
        self.config = config
        self.guard = None

    def run(self) -> dict:
        return evaluate_checkpoint(self.config) if self.config.eval else self.train()

    def train(self) -> dict:
        self.guard = guard = RunGuard(self)  # settings, torchrun, seeds, Ctrl-C, failures, saving
        with guard:
            config = self.config  # (the checkpoint's settings, when resuming)
            self.model = Model(guard.num_actions, bfloat16=config.precision == "bfloat16")
            # Channels-last weights let the CPU's convolutions skip a layout change per layer.
            self.model.to(guard.device, memory_format=torch.channels_last)
            self.trainer = Trainer(self.model, config, guard.ranks)
            self.global_step = guard.prepare_learner()  # 0, or --resume's; compile, sync ranks
            self.games = guard.start_games()  # Workers or ale-py's C++ engine (VectorGames)
            self.rollout = Rollout(config, guard.device)  # stores each picture once
            next_obs = self.games.observations()
            while self.global_step < config.total_timesteps:
                self.anneal_learning_rate()
                next_obs = self.collect_rollout(next_obs)  # 1. play with the current policy
                if guard.solved_step is not None:
                    break  # the target was reached in this rollout: the policy is good enough
                advantages, returns = self.estimate_advantages(next_obs)  # 2. GAE
                stats = self.learn(advantages, returns)  # 3. epochs of clipped PPO steps
                guard.after_update(stats)  # NaN guard, logging, checkpoint when due
        return guard.summary

    def anneal_learning_rate(self):
        """Linear learning-rate annealing (37 details, #4): from learning_rate at step 0 to 0 at the
        end, set by the step at which each rollout starts, so that a resumed run continues it."""
        config = self.config
        if config.anneal_lr:
            progress = self.global_step / config.total_timesteps
            learning_rate = config.learning_rate * max(0.0, 1.0 - progress)
            self.trainer.optimizer.param_groups[0]["lr"] = learning_rate

    @torch.inference_mode()  # like no_grad, and skips autograd's version counting too: faster
    def collect_rollout(self, next_obs: torch.Tensor) -> torch.Tensor:
        """Play num_steps steps in every game with the current policy, filling the rollout buffer.
        Returns the observation after the last step."""
        config, rollout, device = self.config, self.rollout, self.guard.device
        ended = []  # (global step, statistics) of the games that end
        for step in range(config.num_steps):
            if self.guard.stop_at_once():  # Ctrl-C (see RunGuard)
                break
            rollout.store_obs(step, next_obs)
            actions, log_probs, values = self.model.act(next_obs)
            rollout.actions[step], rollout.log_probs[step], rollout.values[step] = (
                actions, log_probs, values)
            result = self.games.step(actions.cpu().numpy())
            next_obs = self.games.observations()
            # Truncation is not death: an episode cut by a time limit would have gone on, so its
            # last reward gets the value of where it stood, gamma * V(final observation), added.
            # Then the done flag below can cut GAE's sum for both kinds of endings (compute_gae).
            cut = [i for i in result.final_obs if result.truncated[i] and not result.terminated[i]]
            if cut:
                cut_obs = torch.from_numpy(np.stack([result.final_obs[i] for i in cut]))
                cut_values = self.model.value(cut_obs.to(device)).cpu().numpy()
                result.rewards[cut] += config.gamma * cut_values
            # (Rewards and flags stay on the host during the rollout: one copy per update.)
            rollout.rewards[step] = torch.from_numpy(result.rewards)
            rollout.dones[step] = torch.from_numpy(result.terminated | result.truncated)
            rollout.restarts[step] = torch.from_numpy(result.restarted)  # see Rollout
            self.global_step += config.num_envs * self.guard.ranks.world_size
            ended += [(self.global_step, episode) for episode in result.episodes.values()]
        self.guard.after_rollout(ended)  # record the games; stop here on Ctrl-C
        return next_obs

    def estimate_advantages(self, next_obs: torch.Tensor):
        """GAE over the rollout: (advantages, returns), both [num_steps, num_envs]."""
        with torch.no_grad():
            last_value = self.model.value(next_obs)
        rollout, device = self.rollout, self.guard.device
        # (non_blocking: the host buffers are not written again before their results are read)
        rewards, dones = (t.to(device, non_blocking=True) for t in (rollout.rewards, rollout.dones))
        advantages = compute_gae(rewards, rollout.values, dones, last_value, self.config.gamma,
                                 self.config.gae_lambda)
        return advantages, advantages + rollout.values

    def learn(self, advantages: torch.Tensor, returns: torch.Tensor) -> dict:
        """update_epochs passes over the rollout in shuffled minibatches, one gradient step each.
        Returns the mean diagnostics as floats (the only host sync of the update)."""
        config, ranks = self.config, self.guard.ranks
        batch_size = config.num_envs * config.num_steps
        minibatch_size = batch_size // config.num_minibatches
        totals, count = {}, 0
        for epoch in range(config.update_epochs):
            order = torch.randperm(batch_size, device=self.guard.device)
            for start in range(0, batch_size, minibatch_size):
                indices = order[start:start + minibatch_size]
                stats = self.trainer.gradient_step(self.rollout.minibatch(indices, advantages,
                                                                          returns))
                for key, value in stats.items():
                    totals[key] = totals.get(key, 0.0) + value.detach()
                count += 1
            # Early stop (37 details, #12, optional): once the policy has moved too far from the one
            # that collected the data, further epochs would only push it beyond the trust region.
            # (Under torchrun, by the ranks' mean KL, so that all stop after the same epoch.)
            kl = stats["approx_kl"].item() if config.target_kl is not None else None
            if kl is not None and ranks.mean([kl])[0] > config.target_kl:
                break
        stats = {key: (value / count).item() for key, value in totals.items()}
        stats["explained_variance"] = explained_variance(self.rollout.values, returns)
        # Under torchrun, the means over the ranks: rank 0 logs those of the global batch, and all
        # ranks see the same values when the guard checks them for NaN.
        return dict(zip(stats, ranks.mean(list(stats.values()))))


# ==== Below: speed, safety and scale. PPO is complete above. ======================================
#
# What follows makes the lesson fast, safe and scalable, and a reader of PPO may stop here: the
# engines the games run on, the rollout buffer that stores each picture once, compilation; `Ranks`;
# `RunGuard` (set-up, Ctrl-C, failures, logging, summary); checkpoints; evaluation and video; the
# checks of the user's input; the command line.


# ----- The games' engines -------------------------------------------------------------------------


class StepResult(typing.NamedTuple):
    """What one step of all the games gives the trainer, besides the observations."""

    rewards: np.ndarray  # [num_envs] float32, clipped to their sign
    terminated: np.ndarray  # [num_envs] bool: the training episode ended (a life lost, game over)
    truncated: np.ndarray  # [num_envs] bool: ALE's frame limit cut the game
    restarted: np.ndarray  # [num_envs] bool: the game's frame stack starts afresh (see Rollout)
    final_obs: dict  # game index -> the last observation of the episode that ended there
    episodes: dict  # game index -> {"return", "length"} of the whole game that ended there


class Engine:
    """What both engines share: the games write their observations into `obs_array`, uint8
    [num_envs, 4, 84, 84] on the host, and the trainer reads them on its device."""

    def __init__(self, obs_array: np.ndarray, device: torch.device):
        self.obs_array, self.device = obs_array, device
        self.obs_tensor = torch.from_numpy(obs_array)
        # On a GPU they pass through a page-locked host buffer, which the GPU reads directly and
        # asynchronously (overwriting it next step is safe: `actions.cpu()` in between waits).
        self.staging = (torch.empty(obs_array.shape, dtype=torch.uint8, pin_memory=True)
                        if device.type == "cuda" else None)

    def observations(self) -> torch.Tensor:
        """The games' current observations on the training device (no copy on the CPU)."""
        if self.staging is None:
            return self.obs_tensor
        self.staging.copy_(self.obs_tensor)
        return self.staging.to(self.device, non_blocking=True)


class WorkerPool(Engine):
    """All the games as Games (`--env-backend game`): num_workers Workers with num_envs /
    num_workers Games each (or all of them in this process with --num-workers 0). Their
    observations land in one array (shared memory when there are child processes) that the trainer
    reads as a tensor without copying. Game i is seeded with seeds[i]."""

    def __init__(self, config: Config, seeds: list, device: torch.device):
        self.workers, self.shared_obs = [], None
        shape = (config.num_envs, FRAME_STACK, FRAME_SIZE, FRAME_SIZE)
        if config.num_workers == 0:
            obs_array = np.zeros(shape, dtype=np.uint8)
        else:
            self.shared_obs = shared_memory.SharedMemory(create=True, size=int(np.prod(shape)))
            obs_array = np.ndarray(shape, dtype=np.uint8, buffer=self.shared_obs.buf)
        super().__init__(obs_array, device)
        games_per_worker = config.num_envs // max(config.num_workers, 1)
        try:
            for index in range(max(config.num_workers, 1)):
                first = index * games_per_worker
                worker = Worker(index, config.env, seeds[first:first + games_per_worker],
                                obs_array[first:first + games_per_worker],
                                in_process=config.num_workers == 0,
                                inherited_trainer_ends=[w.trainer_end for w in self.workers])
                worker.first = first
                self.workers.append(worker)
        except BaseException:
            self.close()  # the workers started so far
            raise
        if self.shared_obs is not None:
            # The children have the memory mapped now, so its name is no longer needed: unlinking
            # it at once means no segment is ever left behind in /dev/shm, however this ends.
            self.shared_obs.unlink()

    def step(self, actions: np.ndarray) -> StepResult:
        """Step every game: send all workers their actions first, then collect, so that children
        run in parallel. A Game restarts its stack at every end of a training episode."""
        for worker in self.workers:
            worker.send_step(actions[worker.first:worker.first + len(worker.obs_view)])
        results = [worker.receive() for worker in self.workers]
        final_obs, episodes = {}, {}
        for worker, (_, _, _, worker_final_obs, worker_episodes) in zip(self.workers, results):
            final_obs.update({worker.first + i: obs for i, obs in worker_final_obs.items()})
            episodes.update({worker.first + i: episode for i, episode in worker_episodes.items()})
        rewards, terminated, truncated = (np.concatenate(part) for part in list(zip(*results))[:3])
        restarted = terminated | truncated
        return StepResult(rewards, terminated, truncated, restarted, final_obs, episodes)

    def close(self):
        for worker in self.workers:
            worker.close()
        self.workers = []
        if self.shared_obs is not None:
            self.obs_tensor = self.obs_array = None  # drop the views before unmapping the memory
            self.shared_obs.close()
            self.shared_obs = None


class VectorGames(Engine):
    """All the games at once in ale-py's own vector env, `ale_py.vector_env.AtariVectorEnv`
    (`--env-backend ale-vector`). The Game is the lesson: each step of the preprocessing in Python
    you can read. This is the engine: the same preprocessing in C++, the games stepped by a pool of
    threads inside this process, with no child processes and no pipes.

    It is configured to keep the Game's contract: the same grayscale frames, 4-frame repeat with
    the max of the last two frames before the 84x84 area resize, a stack of zeros and the first
    picture at a reset, no-op starts, sticky actions as the env id asks, ALE's 108,000-frame limit
    as truncation, raw rewards (clipped here, so that the real score can be reported), and a life
    loss reported as a termination (`life_loss_info`) while the game goes on
    (`episodic_life=False`).
    With same-step autoreset, an ended game's next observation is already the new game's first.

    Two things the vector env does not do, it is made to do here:
    - Serve after a lost life. It presses FIRE only when a game starts, so in Breakout the ball
      would not come back until the agent learnt to press FIRE, and the waiting steps would earn
      nothing. The Game serves, as FireResetEnv does; here, in the games that need FIRE, the step
      after a lost life sends FIRE to the emulator in place of the policy's action. That step is
      stored and scored with the action the policy sampled, and rightly so: for the game, every
      action at that state does the same (serve), so the sampled action and its log-probability are
      still exactly what the policy did there, and its advantage favours no action over another.
    - Tell game over from a lost life by the emulator's frame counter: `episode_frame_number`
      goes back when a new game starts. (Comparing lives would read a game that ends with more
      lives than a new one starts with, after bonus lives, as a lost life.)

    What cannot be made equal (tests/test_atari_game.py steps both with the same actions and
    checks everything else for equality):
    - FIRE: the Game presses FIRE then 2 for 4 frames each, out of the agent's sight, at a reset
      and after the NOOP step that follows a lost life (FireResetEnv); the vector env presses FIRE
      for one frame at a reset, and here for one agent step after a lost life, a step the agent
      sees (so a life costs one step more than with the Game).
    - After a life loss the vector env plays on: no NOOP step, and the frame stack goes on through
      the loss; the Game takes EpisodicLifeEnv's NOOP step and restarts its stack. So here a stack
      restarts only when a game ends (`restarted`), and the rollout buffer rebuilds stacks so.
    - The last observation of a game that ended (`final_obs`) has the same older pictures, but its
      newest is built from other frames than the Game's (tests: under 5% of its pixels differ; when
      the repeat is cut short it repeats the picture before). It is read only to bootstrap a game
      cut by the time limit, at most once per 27,000 steps.
    - No-op counts are drawn by the vector env's own seeded generator, not the Game's, and points
      scored during no-ops or FIRE at a reset are not seen (rare; the Game counts them).
    """

    def __init__(self, env_id: str, seeds: list, device: torch.device = torch.device("cpu"),
                 noop_max: int = 30):
        from ale_py.vector_env import AtariVectorEnv

        settings = gym.spec(env_id).kwargs  # the ROM and what the id asks: sticky actions, limit
        self.env = AtariVectorEnv(
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

    def step(self, actions: np.ndarray) -> StepResult:
        """Step every game (serving with FIRE where a life was lost in the step before)."""
        sent = np.where(self.serving, 1, actions) if self.needs_fire else actions
        obs, raw_rewards, terminated, truncated, info = self.env.step(sent)
        self.obs_array[:] = obs
        self.episode_returns += raw_rewards
        self.episode_lengths += 1
        restarted, life_lost = self.endings(terminated, info["episode_frame_number"],
                                            self.episode_frames)
        self.episode_frames = info["episode_frame_number"]
        self.serving = life_lost
        final_obs, episodes = {}, {}
        for i in np.flatnonzero(restarted):
            final_obs[i] = info["final_obs"][i]  # (after a life loss, obs goes on: no final_obs)
            episodes[i] = {"return": float(self.episode_returns[i]),
                           "length": int(self.episode_lengths[i])}
            self.episode_returns[i], self.episode_lengths[i] = 0.0, 0
        rewards = np.sign(raw_rewards).astype(np.float32)
        return StepResult(rewards, terminated, truncated, restarted, final_obs, episodes)

    @staticmethod
    def endings(terminated: np.ndarray, episode_frames: np.ndarray, previous_frames: np.ndarray):
        """(restarted, life_lost), from the flags and the emulator's frame counter of each game:
        a game that ended (game over, or cut by the frame limit) has already been replaced by a new
        one, whose counter starts again near 0; a termination in a game that goes on is a lost
        life."""
        restarted = episode_frames <= previous_frames
        return restarted, terminated & ~restarted

    def close(self):
        self.env.close()


# ----- The rollout buffer, with each picture stored once, and compilation -------------------------


class Rollout:
    """The rollout buffer: one row per step and env, on the training device.

    Consecutive observations of a game share 3 of their 4 pictures, so the buffer stores each 84x84
    picture once (the newest of each observation: 7,056 bytes per step instead of 28,224 for the
    stacks) and rebuilds the stacks of a minibatch by indexing (`stacks`). `pictures` has
    num_steps + 4 rows per game: rows 0-2 hold the 3 older pictures of the rollout's first stack
    (they come from the rollout before), row 3 + t the newest picture of step t, and the last row
    stays zeros, the picture before the start of an episode. `restarts[t]` marks the games whose
    stack restarted after step t (with the Game, at every done; see VectorGames for the other).
    """

    def __init__(self, config: Config, device: torch.device):
        self.num_envs, self.device = config.num_envs, device
        shape = (config.num_steps, config.num_envs)
        self.pictures = torch.zeros((config.num_steps + FRAME_STACK, config.num_envs, FRAME_SIZE,
                                     FRAME_SIZE), dtype=torch.uint8, device=device)
        self.actions = torch.zeros(shape, dtype=torch.long, device=device)
        self.log_probs = torch.zeros(shape, device=device)
        self.values = torch.zeros(shape, device=device)
        # What the games return stays on the host during the rollout (page-locked on a GPU) and
        # moves to the device once per update: one copy each, instead of three small ones per step.
        pinned = device.type == "cuda"
        self.rewards = torch.zeros(shape, pin_memory=pinned)
        self.dones = torch.zeros(shape, pin_memory=pinned)
        self.restarts = torch.zeros(shape, dtype=torch.bool, pin_memory=pinned)
        self.episode_starts = None  # found from `restarts` once the rollout is complete

    def store_obs(self, step: int, obs: torch.Tensor):
        """Keep the newest picture of each game's observation (and, at step 0, the older three)."""
        if step == 0:
            self.pictures[:FRAME_STACK - 1] = obs[:, :-1].transpose(0, 1)
            self.episode_starts = None
        self.pictures[FRAME_STACK - 1 + step] = obs[:, -1]

    def minibatch(self, indices: torch.Tensor, advantages, returns) -> Minibatch:
        """The rows of flat indices (step * num_envs + env), with their stacks rebuilt."""
        return Minibatch(self.stacks(indices), self.actions.flatten()[indices],
                         self.log_probs.flatten()[indices], advantages.flatten()[indices],
                         returns.flatten()[indices], self.values.flatten()[indices])

    def find_episode_starts(self):
        """For each step and env, the step at which its stack last restarted within this rollout
        (-4 when it restarted before: the rollout's first stack already holds what it needs). A
        stack never reaches back past its restart: a restarted stack is zeros and the picture."""
        restarts = self.restarts.to(self.device, non_blocking=True)
        step_index = torch.arange(len(restarts), device=self.device)[:, None].expand_as(restarts)
        started = torch.zeros_like(restarts)
        started[1:] = restarts[:-1]  # a stack that restarted after step t-1 starts at step t
        self.episode_starts = torch.where(started, step_index, -FRAME_STACK).cummax(dim=0).values

    def stacks(self, indices: torch.Tensor) -> torch.Tensor:
        """The observations [batch, 4, 84, 84] of flat rollout indices (step * num_envs + env),
        rebuilt from the stored pictures exactly as the games built them."""
        if self.episode_starts is None:
            self.find_episode_starts()
        steps, envs = indices // self.num_envs, indices % self.num_envs
        # Picture k of the stack at step t is the newest picture of step t - 3 + k, in row t + k of
        # `pictures`; a picture from before the stack's restart is the zero picture (last row).
        sources = steps[:, None] - (FRAME_STACK - 1) + torch.arange(FRAME_STACK, device=self.device)
        rows = torch.where(sources >= self.episode_starts[steps, envs][:, None],
                           sources + FRAME_STACK - 1, len(self.pictures) - 1)
        # One gather of whole 84x84 pictures from the buffer seen as a list of pictures.
        pictures = self.pictures.view(-1, FRAME_SIZE, FRAME_SIZE)
        flat_rows = (rows * self.num_envs + envs[:, None]).flatten()
        return pictures.index_select(0, flat_rows).view(len(indices), FRAME_STACK, FRAME_SIZE,
                                                        FRAME_SIZE)


def compile_learner(model: Model, trainer: Trainer, config: Config, device: torch.device):
    """torch.compile fuses the network's operations into fewer, faster kernels, for the rollout's
    inference and for the loss (its backward is compiled with it). Compiling the bound methods, not
    the module, keeps the checkpoint's parameter names as they are. Both are compiled here, on
    inputs of the sizes they will see, so that a machine that cannot compile falls back to eager at
    once, with a one-line warning."""
    eager_forward, eager_loss = model.forward, trainer.compute_loss
    minibatch_size = config.num_envs * config.num_steps // config.num_minibatches
    picture = (FRAME_STACK, FRAME_SIZE, FRAME_SIZE)
    try:
        model.forward = torch.compile(eager_forward, mode=config.compile_mode)
        trainer.compute_loss = torch.compile(eager_loss, mode=config.compile_mode)
        obs = torch.zeros((config.num_envs, *picture), dtype=torch.uint8, device=device)
        # The network runs under inference_mode in the rollout and under no_grad for the last
        # value: the compiled code is specialised to each, so both are compiled now.
        with torch.inference_mode():
            model.act(obs)
        with torch.no_grad():
            model.value(obs)
        minibatch_obs = torch.zeros((minibatch_size, *picture), dtype=torch.uint8, device=device)
        # (distinct tensors: the compiled code is specialised to which arguments are the same)
        actions, log_probs, advantages, returns, values = (
            torch.zeros(minibatch_size, device=device) for _ in range(5))
        loss, _ = trainer.compute_loss(Minibatch(minibatch_obs, actions.long(), log_probs,
                                                 advantages + 1, returns, values))
        loss.backward()
        trainer.optimizer.zero_grad(set_to_none=True)
    except Exception as error:
        model.forward, trainer.compute_loss = eager_forward, eager_loss
        print(f"warning: torch.compile failed ({type(error).__name__}: "
              f"{str(error).splitlines()[0]}); running eagerly", file=sys.stderr)


# ----- Ranks: data-parallel training under torchrun -----------------------------------------------


class RankError(RuntimeError):
    """Under torchrun: another rank is gone (a collective failed), or the ranks' weights differ at
    the end."""


class Ranks:
    """The processes ("ranks") of one run started by torchrun, and the few things they do together.

    `torchrun --nproc_per_node N ppo_atari.py ...` (or any torch.distributed launcher, over
    several machines too) starts N copies of this script and tells each its rank and the world size
    in the environment (RANK, WORLD_SIZE, LOCAL_RANK). This is data parallelism, as in CleanRL's
    multi-GPU PPO (ppo_atari_multigpu.py): each rank plays its own --num-envs games (game i of rank
    r gets seed + r * num_envs + i, either engine), collects its own rollout and splits it into its
    own --num-minibatches; but before each gradient step the ranks average their gradients, so all
    take the same step and hold the same weights.
    - The global batch of an update is world_size x num_envs x num_steps steps. --total-timesteps,
      the learning-rate schedule and --checkpoint-every count the steps of all ranks.
    - A gradient step sees world_size x (num_envs x num_steps / num_minibatches) samples, and an
      update still takes update_epochs x num_minibatches steps.
    - To keep the hyperparameters of a 1-GPU run equivalent on N GPUs, divide --num-envs by N: the
      same global batch, minibatches and steps, in 1/N of the time. Keeping --num-envs makes the
      batch and the minibatches N times larger, and the run N times fewer updates.
    Every decision to stop (Ctrl-C, --target-return, --target-kl, a non-finite loss) is taken from
    values all ranks share, so no rank waits in a collective the others skipped. Only rank 0 writes
    files.

    Without torchrun it is a world of one: no process group, and every method returns at once, so
    a run alone is exactly what it would be without this class.
    """

    def __init__(self, device: torch.device):
        self.distributed = "WORLD_SIZE" in os.environ  # set by torchrun
        self.world_size = int(os.environ.get("WORLD_SIZE", 1))
        self.rank = int(os.environ.get("RANK", 0))
        self.device = device
        if not self.distributed:
            return
        if device.type == "cuda":  # one GPU per rank: the LOCAL_RANK-th of its machine
            local_rank, gpus = int(os.environ.get("LOCAL_RANK", 0)), torch.cuda.device_count()
            if local_rank >= gpus:
                raise UsageError(f"rank {self.rank} wants GPU {local_rank}, but its machine has "
                                 f"{gpus}: lower --nproc_per_node")
            self.device = torch.device("cuda", local_rank)
            torch.cuda.set_device(self.device)
        try:
            # NCCL moves CUDA tensors between GPUs directly; gloo moves CPU tensors over TCP.
            dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo")
        except (RuntimeError, ValueError) as error:
            raise UsageError(f"WORLD_SIZE is set, but joining the other ranks failed "
                             f"({str(error).splitlines()[0]}): start the script with torchrun"
                             ) from None

    def collective(self, operation, *args):
        """Run one torch.distributed operation. When another rank has died, gloo raises here (its
        connection closed): this rank then stops with one line (RankError), not a traceback."""
        try:
            return operation(*args)
        except RuntimeError as error:
            cause = str(error).splitlines()[0] if str(error) else type(error).__name__
            cause = cause.split("] ", 1)[-1].split(". ")[0]  # drop gloo's C++ file and line
            raise RankError(f"rank {self.rank} lost contact with the other ranks ({cause})"
                            ) from None

    def average_gradients(self, parameters):
        """Replace each gradient with its mean over the ranks: one all-reduce of all gradients
        flattened into one vector (1.7M floats, 6.7 MB, per minibatch). Why not
        DistributedDataParallel: DDP overlaps the exchange with the backward pass, bucket by bucket,
        which pays for networks many times this size; and it wraps the model, so the compiled
        forward and loss and the checkpoint's parameter names would all go through the wrapper. One
        message keeps the averaging outside the compiled code, in sight in Trainer.gradient_step,
        before the clip: every rank clips the same global gradient and takes the same Adam step."""
        if not self.distributed:
            return
        grads = [p.grad for p in parameters]
        flat = torch.cat([grad.flatten() for grad in grads])
        self.collective(dist.all_reduce, flat)  # sum
        flat /= self.world_size
        for grad, part in zip(grads, flat.split([grad.numel() for grad in grads])):
            grad.copy_(part.view_as(grad))  # (copy_ keeps each gradient's layout: channels-last)

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
        if not self.distributed:
            return make()
        result = [None]
        if self.rank == 0:
            try:
                result[0] = make()
            except UsageError as error:
                result[0] = error
        self.collective(dist.broadcast_object_list, result, 0)
        if isinstance(result[0], UsageError):
            raise result[0]
        return result[0]

    def copy_from_rank_0(self, tensors):
        """Overwrite the tensors (the initial weights) with rank 0's."""
        if self.distributed:
            for tensor in tensors:
                self.collective(dist.broadcast, tensor, 0)

    def check_same(self, tensors):
        """Raise RankError on every rank unless every rank holds bitwise the same tensors as rank 0
        (the weights at the end of a run: a difference means the ranks trained other networks)."""
        if not self.distributed:
            return
        digest = hashlib.sha256(b"".join(t.detach().cpu().numpy().tobytes() for t in tensors))
        digests = self.gather(digest.hexdigest())
        differ = [rank for rank, other in enumerate(digests) if other != digests[0]]
        if differ:
            raise RankError(f"the weights of rank {', '.join(map(str, differ))} differ from rank "
                            f"0's at the end of the run")

    def close(self):
        if self.distributed and dist.is_initialized():
            dist.destroy_process_group()


# ----- RunGuard: set-up, Ctrl-C, failures, logging and the summary --------------------------------


class WorkerError(RuntimeError):
    """A worker process died or one of its Games raised: the run stops with this message."""


class Interrupted(Exception):
    """Ctrl-C or SIGTERM arrived: the run stops at the next step and saves what it has."""


class NonFiniteLoss(RuntimeError):
    """A loss or gradient became NaN or infinite: the run stops rather than train on garbage."""


FAILURES = (WorkerError, NonFiniteLoss, RankError)  # what stops a run with exit status 1


class RunGuard:
    """Everything around PPO's loop that is not PPO, as a context manager: `with RunGuard(main)`.

    On entry it reads --resume's checkpoint, checks the settings and the env, joins the other ranks
    under torchrun, makes the run dir and seeds every generator. In the loop it records finished
    episodes, stops on Ctrl-C or SIGTERM, logs each update, saves checkpoints when due, and stops
    on a non-finite loss with the weights of the update before. On exit, whatever ended the run,
    it closes the games, saves the last checkpoint and writes summary.json (a failure is raised
    again afterwards), then gives back what it changed in the process (the signal handlers), so
    that a notebook is left as it was.
    """

    def __init__(self, main: Main):
        self.main = main
        self.previous_handlers = {}
        self.stop_signal = None
        self.ranks = self.games = self.writer = None
        self.updates = 0
        self.summary = None

    @property
    def config(self) -> Config:
        """The run's settings, held by Main (the checkpoint's when resuming, with the run dir)."""
        return self.main.config

    def __enter__(self) -> "RunGuard":
        self.catch_stop_signals()
        try:
            self.setup()
        except BaseException:
            self.give_back()
            raise
        return self

    def catch_stop_signals(self):
        """Ctrl-C and SIGTERM only set a flag; the loop sees it at its next step (under torchrun,
        at the end of the rollout, all ranks together) and stops cleanly. (Signal handlers can only
        be set from the main thread; in another thread the run cannot be interrupted this way.)"""
        if threading.current_thread() is not threading.main_thread():
            return

        def request_stop(signum, frame):
            self.stop_signal = signum

        for signum in (signal.SIGINT, signal.SIGTERM):
            self.previous_handlers[signum] = signal.signal(signum, request_stop)

    def setup(self):
        config = self.config
        self.checkpoint = load_checkpoint(config.resume) if config.resume else None
        if self.checkpoint is not None:
            config = resumed_config(self.checkpoint, config)
        self.start_time = time.perf_counter()  # set-up counts: it holds the compilation, if any
        check_settings(config)
        device = pick_device(config.device)
        self.num_actions = inspect_env(config.env)
        # Under torchrun, join the other ranks (each on a GPU of its own); alone, a world of one.
        self.ranks = Ranks(device)
        self.device = self.ranks.device
        # Rank 0 names and makes the run dir: the default name holds the time, which may differ.
        self.run_dir = self.ranks.from_rank_0(lambda: make_run_dir(config))
        config = dataclasses.replace(config, run_dir=str(self.run_dir))
        self.main.config = config
        # Reproducibility: every random draw of the trainer comes from torch's seeded generator
        # (action sampling, minibatch shuffling), and each game from its own seeded generator.
        # Under torchrun, rank r seeds with seed + r, so that its draws are its own.
        self.seed = config.seed + self.ranks.rank
        random.seed(self.seed)
        np.random.seed(self.seed)
        torch.manual_seed(self.seed)
        self.recent_returns, self.recent_lengths = deque(maxlen=100), deque(maxlen=100)
        self.episodes = 0
        self.solved_step = self.solved_seconds = None
        self.interrupted = False
        self.first_update_end = None  # (time, step) once the first update is done
        self.last_print = 0.0
        self.checkpoint_path = self.run_dir / "checkpoint.pt"

    def prepare_learner(self) -> int:
        """Continue from --resume's checkpoint (if any), start every rank from rank 0's weights,
        and compile (--compile). Returns the global step to start from."""
        main, config = self.main, self.config
        main.global_step = 0
        if self.checkpoint is not None:
            restore_learner(main, self.checkpoint)
            if self.ranks.rank > 0:  # the checkpoint holds rank 0's random state: a fresh stream
                torch.manual_seed(self.seed + main.global_step)
        # The ranks start from the same weights, rank 0's; averaging the gradients keeps them so.
        self.ranks.copy_from_rank_0(main.model.state_dict().values())
        if config.compile:
            compile_learner(main.model, main.trainer, config, self.device)
        self.last_good_learner = copy.deepcopy(learner_state(main))  # what a NaN falls back to
        self.last_checkpoint_step = main.global_step
        self.writer = make_writer(self.run_dir, config) if self.ranks.rank == 0 else None
        return main.global_step

    def start_games(self) -> Engine:
        """The games of this rank, in the engine --env-backend names: game i of rank r is seeded
        with seed + r * num_envs + i."""
        config = self.config
        first_seed = config.seed + self.ranks.rank * config.num_envs
        seeds = [first_seed + i for i in range(config.num_envs)]
        if config.env_backend == "ale-vector":
            self.games = VectorGames(config.env, seeds, self.device)
        else:
            self.games = WorkerPool(config, seeds, self.device)
        return self.games

    def stop_at_once(self) -> bool:
        """Ctrl-C alone stops a rollout at once; under torchrun all ranks stop together after it."""
        return self.stop_signal is not None and not self.ranks.distributed

    def after_rollout(self, ended: list):
        """Record the episodes that ended in the rollout, and stop (raise Interrupted) if asked to.
        Under torchrun, this is where the ranks meet once per rollout: each learns the episodes of
        every rank and whether any rank was asked to stop. All record the same episodes in the same
        order (by step, then by rank), so they take the same --target-return decision."""
        shared = self.ranks.gather((ended, self.stop_signal))
        episodes = sorted((episode for rank_ended, _ in shared for episode in rank_ended),
                          key=lambda step_and_episode: step_and_episode[0])
        for step, episode in episodes:
            self.record_episode(episode, step)
        signals = [signum for _, signum in shared if signum is not None]
        if signals:
            self.stop_signal = signals[0]
            raise Interrupted

    def record_episode(self, episode: dict, step: int):
        self.episodes += 1
        self.recent_returns.append(episode["return"])
        self.recent_lengths.append(episode["length"])
        if self.writer is not None:
            self.writer.add_scalar("charts/episodic_return", episode["return"], step)
            self.writer.add_scalar("charts/episodic_length", episode["length"], step)
        target = self.config.target_return
        if (target is not None and self.solved_step is None and len(self.recent_returns) == 100
                and np.mean(self.recent_returns) >= target):
            self.solved_step = step
            self.solved_seconds = time.perf_counter() - self.start_time

    def after_update(self, stats: dict):
        """Stop on a non-finite loss; else count the update, log it, and save when due."""
        main = self.main
        if not all(math.isfinite(v) for v in stats.values()):
            values = ", ".join(f"{key}={value}" for key, value in stats.items())
            raise NonFiniteLoss(f"non-finite loss or gradient in update {self.updates + 1} "
                                f"({values}); stopped with the weights of the update before")
        self.updates += 1
        if self.first_update_end is None:
            self.first_update_end = (time.perf_counter(), main.global_step)
        self.log_update(stats)
        if main.global_step - self.last_checkpoint_step >= self.config.checkpoint_every:
            save_checkpoint(learner_state(main), self.checkpoint_path, self.ranks)
            self.last_checkpoint_step = main.global_step
        self.last_good_learner = copy.deepcopy(learner_state(main))

    def __exit__(self, kind, error, traceback) -> bool:
        """Close the games, and unless the error is one a run cannot save from (bad input, a bug),
        save the last checkpoint and the summary. Ctrl-C ends a run normally (`interrupted`); a
        failure is raised again once everything is saved."""
        try:
            if self.games is not None:
                self.games.close()
            if kind is not None and not issubclass(kind, (Interrupted, *FAILURES)):
                return False
            self.interrupted = kind is Interrupted
            failure = error if isinstance(error, FAILURES) else None
            if isinstance(error, (NonFiniteLoss, RankError)):  # the update may be half done
                restore_learner(self.main, self.last_good_learner)
            if failure is None:  # all ranks are here together: check they trained the same network
                try:
                    self.ranks.check_same(self.main.model.state_dict().values())
                except RankError as mismatch:
                    failure = mismatch
            save_checkpoint(learner_state(self.main), self.checkpoint_path, self.ranks)
            self.summary = self.write_summary()
            if self.writer is not None:
                self.writer.close()
                self.print_progress(final=True)
            if failure is not None and failure is not error:
                raise failure
            return failure is None  # a failure propagates; Ctrl-C does not
        finally:
            self.give_back()

    def give_back(self):
        """Restore what the run changed in this process: the signal handlers."""
        for signum, handler in self.previous_handlers.items():
            signal.signal(signum, handler)
        self.previous_handlers = {}
        if self.ranks is not None:
            self.ranks.close()

    def steady_speed(self) -> Optional[float]:
        """Steps per second since the end of the first update (which holds one-time costs)."""
        if self.first_update_end is None:
            return None
        end_time, end_step = self.first_update_end
        elapsed, steps = time.perf_counter() - end_time, self.main.global_step - end_step
        return steps / elapsed if elapsed > 0 and steps > 0 else None

    def log_update(self, stats: dict):
        step, writer = self.main.global_step, self.writer
        if writer is None:
            return  # under torchrun, rank 0 logs and prints for all
        for key, value in stats.items():
            writer.add_scalar(f"losses/{key}", value, step)
        learning_rate = self.main.trainer.optimizer.param_groups[0]["lr"]
        writer.add_scalar("charts/learning_rate", learning_rate, step)
        speed = self.steady_speed()
        if speed is not None:
            writer.add_scalar("charts/steps_per_second", speed, step)
        if time.perf_counter() - self.last_print >= 1.0:
            self.print_progress()

    def print_progress(self, final: bool = False):
        self.last_print = time.perf_counter()
        total, step = self.config.total_timesteps, self.main.global_step
        speed = self.steady_speed() or step / max(self.last_print - self.start_time, 1e-9)
        eta = time.strftime("%H:%M:%S", time.gmtime(max(total - step, 0) / max(speed, 1e-9)))
        mean = lambda values: f"{np.mean(values):.1f}" if values else "-"
        print(f"step {step:,}/{total:,} ({100 * step / total:.1f}%) | {speed:,.0f} steps/s | "
              f"eta {eta} | return {mean(self.recent_returns)} | "
              f"length {mean(self.recent_lengths)} | updates {self.updates}"
              + (" | done" if final else ""), flush=True)

    def write_summary(self) -> dict:
        now, speed = time.perf_counter(), self.steady_speed()
        summary = {
            "script": SCRIPT, "env": self.config.env, "seed": self.config.seed,
            "steps": self.main.global_step,
            "seconds": round(now - self.start_time, 3),
            "warmup_seconds": (round(self.first_update_end[0] - self.start_time, 3)
                               if self.first_update_end else None),
            "steps_per_second": round(speed, 1) if speed else None,
            "episodes": self.episodes,
            "mean_return_100": float(np.mean(self.recent_returns)) if self.recent_returns else None,
            "target_return": self.config.target_return,
            "solved_step": self.solved_step,
            "solved_seconds": (round(self.solved_seconds, 3) if self.solved_seconds is not None
                               else None),
            "interrupted": self.interrupted,
            "checkpoint": str(self.checkpoint_path) if self.checkpoint_path.exists() else None,
            "world_size": self.ranks.world_size,
        }
        if self.ranks.rank != 0:
            return summary  # rank 0 writes it
        try:
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        except OSError as error:
            print(f"warning: could not write summary.json ({error})", file=sys.stderr)
        return summary


def explained_variance(values: torch.Tensor, returns: torch.Tensor) -> float:
    """1 when the value function predicts the returns perfectly, 0 when not at all. A constant
    return (e.g. all episodes alike) leaves nothing to explain: 0."""
    returns_variance = returns.var().item()
    unexplained = (returns - values).var().item()
    return 0.0 if returns_variance == 0 else 1 - unexplained / returns_variance


def make_writer(run_dir: Path, config: Config):
    """TensorBoard writer, with the hyperparameters as a text table."""
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(run_dir))
    rows = "\n".join(f"|{key}|{value}|" for key, value in dataclasses.asdict(config).items())
    writer.add_text("hyperparameters", f"|param|value|\n|-|-|\n{rows}")
    return writer


# ----- Checkpoints --------------------------------------------------------------------------------


def learner_state(main: Main) -> dict:
    """Everything needed to continue learning: only tensors, numbers, strings, lists and dicts, so
    that torch.load(..., weights_only=True) can read it back (a checkpoint cannot run code)."""
    guard = main.guard
    return {
        "script": SCRIPT, "env": main.config.env, "num_actions": guard.num_actions,
        "config": dataclasses.asdict(main.config),
        "model": main.model.state_dict(), "optimizer": main.trainer.optimizer.state_dict(),
        "global_step": main.global_step, "updates": guard.updates,
        "rng": {"torch": torch.get_rng_state()},
    }


def restore_learner(main: Main, state: dict):
    try:
        main.model.load_state_dict(state["model"])
    except RuntimeError as error:
        raise UsageError(f"the checkpoint's network does not fit {main.config.env} "
                         f"({main.guard.num_actions} actions): "
                         f"{str(error).splitlines()[-1].strip()}") from None
    main.trainer.optimizer.load_state_dict(state["optimizer"])
    main.global_step, main.guard.updates = int(state["global_step"]), int(state["updates"])
    torch.set_rng_state(state["rng"]["torch"])


def save_checkpoint(state: dict, path: Path, ranks: Ranks):
    """Write to a temporary file, then rename: a crash or a full disk never leaves half a
    checkpoint, and a failed write keeps the previous one. Under torchrun, rank 0 writes (all hold
    the same learner)."""
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


def load_checkpoint(path: str) -> dict:
    """Read a checkpoint of this script, refusing clearly what is missing, damaged or foreign."""
    if not Path(path).is_file():
        raise UsageError(f"checkpoint {path} not found")
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
    return checkpoint


def resumed_config(checkpoint: dict, given: Config) -> Config:
    """The settings of a resumed (or evaluated) run: the checkpoint's, except those given
    differently from their defaults now (e.g. a new --total-timesteps). A different env is
    refused."""
    fields = dataclasses.fields(Config)
    saved = {f.name: checkpoint["config"][f.name] for f in fields if f.name in checkpoint["config"]}
    config = Config(**saved)
    for f in fields:
        value = getattr(given, f.name)
        if value != f.default:
            if f.name == "env" and value != saved.get(f.name):
                raise UsageError(f"the checkpoint was trained with --{f.name.replace('_', '-')} "
                                 f"{saved.get(f.name)}, not {value}")
            config = dataclasses.replace(config, **{f.name: value})
    return config


# ----- Evaluation and video ----------------------------------------------------------------------


@torch.no_grad()
def evaluate_checkpoint(given: Config) -> dict:
    """--eval: play --eval-episodes whole games (all lives) with a checkpoint's policy and report
    the real, unclipped score."""
    checkpoint = load_checkpoint(given.eval)
    config = resumed_config(checkpoint, given)
    check_settings(config)
    if config.eval_episodes <= 0:
        raise UsageError("--eval-episodes must be positive")
    model = Model(inspect_env(config.env), bfloat16=config.precision == "bfloat16")
    model.load_state_dict(checkpoint["model"])
    torch.manual_seed(config.seed)
    run_dir = Path(given.run_dir) if given.run_dir else Path(config.eval).parent
    game = Game(config.env, config.seed, render_mode="rgb_array" if config.video else None)
    video = None
    obs = game.reset()
    returns = []
    try:
        while len(returns) < config.eval_episodes:
            if config.video:
                video = write_frame(video, game, run_dir / "eval.mp4")
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
    print(f"eval {config.env}: return {mean:.2f} ± {std:.2f} over {len(returns)} episodes "
          f"({how} actions)")
    if video is not None:
        print(f"video: {run_dir / 'eval.mp4'}")
    return {"script": SCRIPT, "env": config.env, "episodes": len(returns), "mean_return": mean,
            "std_return": std, "returns": returns, "greedy": config.greedy,
            "video": str(run_dir / "eval.mp4") if video is not None else None}


def write_frame(video, game: Game, path: Path):
    """Append the game's current picture (in colour) to the mp4 (OpenCV's VideoWriter, opened at
    the first frame). One picture per agent step: the video plays at real speed."""
    frame = game.render()
    if video is None:
        path.parent.mkdir(parents=True, exist_ok=True)
        fps = game.env.metadata.get("render_fps", 60) / FRAME_SKIP
        video = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), fps,
                                (frame.shape[1], frame.shape[0]))
        if not video.isOpened():
            raise UsageError(f"OpenCV cannot write {path}")
    video.write(cv2.cvtColor(frame, cv2.COLOR_RGB2BGR))
    return video


# ----- Checking the input -------------------------------------------------------------------------


class UsageError(ValueError):
    """Bad input from the user: the command line prints its message on one line, exit status 2."""


def check_settings(config: Config):
    """Refuse settings that cannot work, with one line that says what to change."""
    for name in ("total_timesteps", "num_envs", "num_steps", "num_minibatches", "update_epochs",
                 "checkpoint_every"):
        if getattr(config, name) <= 0:
            raise UsageError(f"--{name.replace('_', '-')} must be positive, not "
                             f"{getattr(config, name)}")
    for name, choices in (("compile_mode", ("default", "reduce-overhead", "max-autotune")),
                          ("precision", ("float32", "bfloat16")),
                          ("env_backend", ("game", "ale-vector"))):
        if getattr(config, name) not in choices:
            raise UsageError(f"unknown --{name.replace('_', '-')} {getattr(config, name)!r}: "
                             f"use {', '.join(choices[:-1])} or {choices[-1]}")
    if config.num_workers < 0:
        raise UsageError(f"--num-workers must be 0 (games in this process) or more, not "
                         f"{config.num_workers}")
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


def make_atari(env_id: str, **options) -> gym.Env:
    """gym.make for an Atari id, without the emulator's start-up banner on stderr."""
    ale_py.ALEInterface.setLoggerMode(ale_py.LoggerMode.Error)
    return gym.make(env_id, **options)


def inspect_env(env_id: str) -> int:
    """Check that the env exists and is an Atari game. Returns its number of actions."""
    if env_id not in gym.registry:
        close = difflib.get_close_matches(env_id, list(gym.registry), n=3, cutoff=0.6)
        hint = (f"; did you mean {' or '.join(close)}?" if close
                else "; Atari ids look like ALE/Pong-v5 or PongNoFrameskip-v4")
        raise UsageError(f"unknown env {env_id!r}{hint}")
    if not str(gym.spec(env_id).entry_point).startswith("ale_py"):
        raise UsageError(f"{env_id} is not an Atari game: use ppo_cartpole.py for games with "
                         f"vector observations")
    try:
        env = make_atari(env_id, obs_type="grayscale", frameskip=1)
    except Exception as error:
        raise UsageError(f"cannot make {env_id}: {type(error).__name__}: {error}") from None
    num_actions = int(env.action_space.n)
    env.close()
    return num_actions


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UsageError(f"unknown --device {name!r}: use auto, cpu or cuda") from None
    if device.type not in ("cpu", "cuda"):
        raise UsageError(f"unknown --device {name!r}: use auto, cpu or cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda, but torch sees no CUDA device here: use --device cpu")
    return device


def make_run_dir(config: Config) -> Path:
    default = f"runs/{config.env.replace('/', '-')}__{SCRIPT}__{config.seed}__{int(time.time())}"
    run_dir = Path(config.run_dir or default)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as error:
        reason = error.strerror or error
        raise UsageError(f"cannot write to --run-dir {run_dir}: {reason}") from None
    return run_dir


# ----- The command line ---------------------------------------------------------------------------


def parse_config(argv=None) -> Config:
    """The command line: one flag per Config field, with its default and explanation in --help."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for f in dataclasses.fields(Config):
        flag = "--" + f.name.replace("_", "-")
        kind = next(t for t in (bool, int, float, str)
                    if t is f.type or t in typing.get_args(f.type))
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default,
                                help=f.metadata["help"])
        else:
            parser.add_argument(flag, type=kind, default=f.default, help=f.metadata["help"])
    return Config(**vars(parser.parse_args(argv)))


def command_line(argv=None) -> int:
    """Run as a command; returns the exit status: 0, 1 after a failure, 2 for bad input, 128 + the
    signal after Ctrl-C or SIGTERM."""
    main = Main(parse_config(argv))
    try:
        main.run()
    except UsageError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except FAILURES as error:
        print(f"error: {error}; the checkpoint of the last finished update is kept",
              file=sys.stderr)
        return 1
    stop_signal = main.guard.stop_signal if main.guard is not None else None
    return 0 if stop_signal is None else 128 + stop_signal


# A pasted notebook cell has no __file__: there, defining everything is all this file does.
if __name__ == "__main__" and "__file__" in globals():
    sys.exit(command_line())
