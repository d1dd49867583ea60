"""PPO with memory, for games whose observation hides part of the state, in one file.

Proximal Policy Optimization (Schulman et al., 2017: "PPO paper") with the implementation details
of CleanRL and Stable-Baselines3 ("The 37 Implementation Details of PPO", Huang et al., 2022: "37
details", its LSTM details "LSTM details"), each named where it is implemented.

The idea. A policy-gradient method improves a policy with games the policy itself just played; the
games then describe an older policy, so plain policy gradient uses each batch once. PPO reuses each
batch ("rollout") for several epochs of minibatch steps, and keeps the new policy near the one that
collected the data by clipping the probability ratio r_t = pi(a_t | h_t) / pi_old(a_t | h_t) in its
objective (PPO paper, eq. 7), so that a step gains nothing by moving r_t beyond [1 - eps, 1 + eps]:

    L_clip = mean_t min( r_t A_t, clip(r_t, 1 - eps, 1 + eps) A_t )

The advantage A_t says how much better action a_t did than the value V(h_t) expected. Generalized
Advantage Estimation (GAE, Schulman et al., 2016) weighs the one-step errors of V by gamma * lambda:

    A_t = sum_k (gamma lambda)^k delta_(t+k),   delta_t = r_t + gamma V(h_(t+1)) - V(h_t)

Memory. Stateless CartPole (the default) shows the cart's position and the pole's angle, not their
velocities: the policy must act on the history h_t = (o_1, a_1, r_1, ..., o_t), not on o_t alone.
--memory chooses how: none (o_t alone, the baseline), framestack (the last k steps side by side),
lstm or gru (a state carried from step to step), attention (a gated Transformer-XL block over the
last M steps). r_t is right only if training sees exactly what the rollout saw (`Model`).

Read it top to bottom: `Config`, `Game`, `Worker`, `Model`, `compute_gae`, `Trainer`, `Main`; PPO
is complete at the banner, and the machinery (engines, torchrun, checkpoints, the CLI) follows.

Run it:         python ppo_memory.py --memory lstm   (stateless CartPole; --help lists every flag)
On N GPUs:      torchrun --standalone --nproc_per_node N ppo_memory.py   (data parallel: `Ranks`)
In a notebook:  from ppo_memory import Config, Main; Main(Config(total_timesteps=50_000)).run()
                (or paste this file into a cell, and call `Main(Config(...)).run()` in the next)
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

import gymnasium as gym
import numpy as np
import torch
import torch.distributed as dist  # already loaded by `import torch`: costs nothing more
import torch.nn as nn
from gymnasium.vector import AutoresetMode

SCRIPT = "ppo_memory"
MEMORY_KINDS = ("none", "framestack", "lstm", "gru", "attention")


def option(default, help, choices=None):
    """A Config field with its one-line explanation, which `--help` prints."""
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass
class Config:
    """Every setting of a run; each field is also a command-line flag (`num_envs` -> `--num-envs`).
    "Per kind": a field left at None takes its value for --memory from KIND_DEFAULTS (machinery)."""

    # PPO's hyperparameters.
    learning_rate: Optional[float] = option(None, "Adam step size at the start (default: per kind)")
    anneal_lr: bool = option(True, "anneal the learning rate linearly to 0 over the run")
    gamma: float = option(0.98, "discount factor: 0.98 looks ~50 steps ahead, enough for a pole")
    gae_lambda: float = option(0.95, "GAE lambda: bias (0) vs variance (1) of the advantage")
    num_minibatches: Optional[int] = option(None, "minibatches per rollout, by env (per kind)")
    update_epochs: Optional[int] = option(None, "passes over each rollout (default: per kind)")
    clip_coef: float = option(0.2, "PPO's clip range for the probability ratio")
    clip_value_loss: bool = option(False, "clip the value update too")
    ent_coef: float = option(0.0, "weight of the entropy bonus")
    vf_coef: Optional[float] = option(None, "weight of the value loss (default: per kind)")
    max_grad_norm: float = option(0.5, "clip the global gradient norm to this")
    target_kl: Optional[float] = option(None, "stop an update's epochs once approx KL exceeds this")
    hidden_size: Optional[int] = option(None, "units of MLP layers and memory (default: per kind)")

    # Memory (the default kind solves stateless CartPole fastest: benchmarks/README.md).
    memory: str = option("framestack", "what the policy remembers", choices=MEMORY_KINDS)
    frame_stack: int = option(4, "with --memory framestack: steps the policy sees")
    attention_span: int = option(16, "with --memory attention: steps each step attends to")
    prev_action_reward: bool = option(True, "give the model the previous action and reward too")
    normalize_observations: bool = option(True, "scale observations by a running mean and std")

    # Collecting experience.
    env: str = option("StatelessCartPole-v1", "gymnasium id: vector observations, Discrete actions")
    num_envs: int = option(64, "games played side by side (by each rank, under torchrun)")
    num_workers: int = option(0, "child processes that run the games (0 = in this process)")
    num_steps: Optional[int] = option(None, "steps per game in each rollout (default: per kind)")

    # The run.
    seed: int = option(1, "seeds everything; env i of rank r gets seed + r * num_envs + i")
    total_timesteps: int = option(200_000, "environment steps over all envs (and all ranks)")
    device: str = option("auto", "auto | cpu | cuda: auto takes CUDA when present")
    run_dir: Optional[str] = option(
        None, "logs, checkpoint and summary go here (default runs/<env>__<script>__<seed>__<time>)")
    target_return: Optional[float] = option(None, "stop at this mean return of 100 episodes")
    checkpoint_every: int = option(100_000, "save a checkpoint every this many steps, and last")
    resume: Optional[str] = option(None, "continue training from this checkpoint")
    eval: Optional[str] = option(None, "play --eval-episodes games with this checkpoint")
    eval_episodes: int = option(10, "games played by --eval")
    greedy: bool = option(False, "with --eval, take the most likely action instead of sampling")
    video: bool = option(False, "with --eval, write an mp4 of the games into the run dir")
    compile: bool = option(False, "torch.compile the loss (off: it takes longer than it saves)")


class Game:
    """A batch of `num_envs` copies of one gymnasium env (SyncVectorEnv, same-step autoreset; env i
    seeded with seed + i): every value below is an array over the batch, observations float32 rows.
    An ended episode restarts in the same step: `step` returns the next episode's first observation,
    and the ended one's last in `info["final_obs"]` (rows marked by `info["_final_obs"]`), to
    bootstrap from if truncated; `info["episode"]` (marked by `info["_episode"]`) its statistics."""

    def __init__(self, env_id: str, seed: int, num_envs: int = 1, render_mode: str = None):
        register_stateless_envs()
        self.envs = gym.make_vec(  # (render_mode only when asked: not every env accepts it)
            env_id, num_envs, vectorization_mode="sync",
            vector_kwargs={"autoreset_mode": AutoresetMode.SAME_STEP},
            **({"render_mode": render_mode} if render_mode else {}))
        self.seed, self.num_envs = seed, num_envs
        self.action_space = self.envs.single_action_space
        self.episode_returns = np.zeros(num_envs)
        self.episode_lengths = np.zeros(num_envs, dtype=np.int64)

    def reset(self) -> np.ndarray:
        # Seed only the first reset: later restarts continue the envs' own random streams.
        obs, _ = self.envs.reset(seed=self.seed)
        self.seed = None
        self.episode_returns[:], self.episode_lengths[:] = 0, 0
        return self.flat(obs)

    def step(self, actions: np.ndarray):
        obs, rewards, terminated, truncated, env_info = self.envs.step(
            actions + self.action_space.start)  # the model counts choices from 0
        self.episode_returns += rewards
        self.episode_lengths += 1
        info = {}
        ended = terminated | truncated
        if ended.any():
            info["_final_obs"] = info["_episode"] = ended
            info["final_obs"] = np.zeros_like(self.flat(obs))
            info["final_obs"][ended] = self.flat(np.stack(env_info["final_obs"][ended]))
            info["episode"] = {"return": self.episode_returns.copy(),
                               "length": self.episode_lengths.copy()}
            self.episode_returns[ended], self.episode_lengths[ended] = 0, 0
        return self.flat(obs), rewards.astype(np.float32), terminated, truncated, info

    @staticmethod
    def flat(obs) -> np.ndarray:
        obs = np.asarray(obs, dtype=np.float32)
        return obs.reshape(len(obs), -1)

    def render(self) -> np.ndarray:
        return self.envs.render()[0]

    def close(self):
        self.envs.close()


def step_game(game: Game, actions: np.ndarray, obs_out: np.ndarray) -> tuple:
    """Step the Game, observations into `obs_out`; the rest by env index for the ended episodes."""
    obs_out[:], rewards, terminated, truncated, info = game.step(actions)
    final_obs, episodes = {}, {}
    for i in np.flatnonzero(info.get("_final_obs", ())):
        final_obs[i] = info["final_obs"][i]
        episodes[i] = {"return": float(info["episode"]["return"][i]),
                       "length": int(info["episode"]["length"][i])}
    return rewards, terminated, truncated, final_obs, episodes


class Worker:
    """Runs a Game (a batch of envs) in a child process or, with `in_process=True`, here. The
    trainer sends actions through a `multiprocessing` pipe; the child answers with rewards, flags
    and episode statistics, and writes observations into shared memory (`obs_view`). Children are
    forked, ignore SIGINT (the trainer decides how to stop) and exit when its pipe end closes."""

    def __init__(self, index: int, env_id: str, seed: int, obs_view: np.ndarray, in_process: bool,
                 inherited_trainer_ends: list):
        self.index, self.env_id, self.obs_view = index, env_id, obs_view
        self.in_process = in_process
        if in_process:
            self.game = Game(env_id, seed, len(obs_view))
            obs_view[:] = self.game.reset()
            return
        self.trainer_end, child_end = multiprocessing.Pipe()
        context = multiprocessing.get_context("fork")
        self.process = context.Process(
            target=Worker.child_main, name=f"{SCRIPT}-worker-{index}", daemon=True,
            args=(child_end, [self.trainer_end, *inherited_trainer_ends], env_id, seed, obs_view))
        self.process.start()
        child_end.close()
        self.receive()  # the child's first answer comes once its Game is reset

    @staticmethod
    def child_main(conn, trainer_ends, env_id, seed, obs_view):
        """The loop of the child process: step the Game on each command until told to stop."""
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        # Closing the copies of the trainer's pipe ends makes recv() fail once the trainer is gone.
        for end in trainer_ends:
            end.close()
        try:
            game = Game(env_id, seed, len(obs_view))
            obs_view[:] = game.reset()
            conn.send(("ok", None))
            while True:
                command, actions = conn.recv()
                if command == "close":
                    break
                conn.send(("ok", step_game(game, actions, obs_view)))
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
        """The result of the last `send_step`, or why the child died (it waits on both at once)."""
        if self.in_process:
            return step_game(self.game, self.actions, self.obs_view)
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
            self.game.close()
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


def layer(in_size: int, out_size: int, gain: float = math.sqrt(2)) -> nn.Linear:
    """A linear layer with orthogonal weights and zero biases (37 details, #2: hidden layers get
    gain sqrt(2), the policy output 0.01 so that all actions start equally likely, the value 1)."""
    linear = nn.Linear(in_size, out_size)
    nn.init.orthogonal_(linear.weight, gain)
    nn.init.zeros_(linear.bias)
    return linear


class Model(nn.Module):
    """The actor-critic with memory. Its methods take steps of a batch of envs: `inputs` [L, B, D]
    (rows x_t = [o_t, one-hot(a_(t-1)), r_(t-1)], zeros for both at an episode's first step),
    `starts` [L, B] (1 where an episode starts) and `memory`, the state before the first row
    ((h, c) for lstm, (h,) for gru, () otherwise). The same `remember` serves one step of the
    rollout and a whole sequence in training, so both compute the same numbers.
    - none: x_t into separate 64-64 tanh MLPs for actor and critic (37 details, #13);
    - framestack: the last k rows side by side (`stack_frames`, by index) into the same MLPs;
    - lstm, gru: linear+tanh encoder, one recurrent cell, linear heads (CleanRL's LSTM PPO);
    - attention: the same encoder, then a gated Transformer-XL block over the last M rows."""

    def __init__(self, obs_size: int, num_actions: int, config: Config):
        super().__init__()
        self.kind, self.num_actions, self.config = config.memory, num_actions, config
        # Observation normalisation (`encode_inputs`): running statistics, saved with the weights.
        self.register_buffer("obs_mean", torch.zeros(obs_size))
        self.register_buffer("obs_var", torch.ones(obs_size))
        self.register_buffer("obs_count", torch.tensor(1e-4))
        self.input_size = obs_size + (num_actions + 1 if config.prev_action_reward else 0)
        # Rows of the rollout that one step reads: its own, and the k - 1 (M - 1) before it.
        self.window = {"framestack": config.frame_stack, "attention": config.attention_span}.get(
            self.kind, 1)
        hidden = config.hidden_size
        if self.kind in ("none", "framestack"):
            size = self.input_size * self.window
            self.critic = nn.Sequential(layer(size, hidden), nn.Tanh(), layer(hidden, hidden),
                                        nn.Tanh(), layer(hidden, 1, gain=1.0))
            self.actor = nn.Sequential(layer(size, hidden), nn.Tanh(), layer(hidden, hidden),
                                       nn.Tanh(), layer(hidden, num_actions, gain=0.01))
            return
        self.encoder = nn.Sequential(layer(self.input_size, hidden), nn.Tanh())
        if self.kind == "attention":  # (below the banner, with the GTrXL details)
            self.attention = GatedAttention(hidden, self.window)
        else:  # LSTM details, #1: orthogonal weights, zero biases
            self.cell = (nn.LSTMCell if self.kind == "lstm" else nn.GRUCell)(hidden, hidden)
            for name, weights in self.cell.named_parameters():
                nn.init.orthogonal_(weights) if "weight" in name else nn.init.zeros_(weights)
        self.critic = layer(hidden, 1, gain=1.0)
        self.actor = layer(hidden, num_actions, gain=0.01)

    def initial_memory(self, batch: int, device=None) -> tuple:
        """LSTM details, #2: the recurrent state starts at zero."""
        count = {"lstm": 2, "gru": 1}.get(self.kind, 0)
        return tuple(torch.zeros(batch, self.cell.hidden_size, device=device) for _ in range(count))

    def remember(self, inputs: torch.Tensor, starts: torch.Tensor, memory: tuple):
        """The features of each step: [L, B, D] rows -> ([L', B, F], the memory after the last)."""
        if self.kind in ("none", "framestack"):  # none: a window of 1
            return stack_frames(inputs, starts, self.window), memory  # (below the banner)
        encoded = self.encoder(inputs)
        if self.kind == "attention":  # no state: the window of raw rows is the memory
            return self.attention(*episode_windows(encoded, starts, self.window)), memory
        features = []
        for x, start in zip(encoded, starts):
            # LSTM details, #3: the state restarts at zero where an episode starts (a reset at the
            # end of the one before), in a rollout and in training (#5: rebuilt step by step).
            memory = tuple(state * (1.0 - start)[:, None] for state in memory)
            memory = self.cell(x, memory) if self.kind == "lstm" else (self.cell(x, memory[0]),)
            features.append(memory[0])
        return torch.stack(features), memory

    def value(self, features: torch.Tensor) -> torch.Tensor:
        return self.critic(features).squeeze(-1)

    def act(self, inputs, starts, memory, greedy: bool = False):
        """Actions for each env's last row: (actions [B], log-probs, values, memory after it)."""
        features, memory = self.remember(inputs, starts, memory)
        log_probs = torch.log_softmax(self.actor(features[-1]), dim=-1)
        actions = log_probs.argmax(-1) if greedy else torch.multinomial(log_probs.exp(), 1)[:, 0]
        log_prob = log_probs.gather(-1, actions[:, None]).squeeze(-1)
        return actions, log_prob, self.value(features[-1]), memory

    def evaluate_actions(self, inputs, starts, memory, actions):
        """For the loss, over sequences of steps: log-probabilities of the taken actions [T, B]
        under the current policy, the policy's entropy and the values, flattened time-major."""
        features, _ = self.remember(inputs, starts, memory)
        log_probs = torch.log_softmax(self.actor(features), dim=-1)
        log_prob = log_probs.gather(-1, actions.unsqueeze(-1)).squeeze(-1)
        entropy = -(log_probs.exp() * log_probs).sum(-1)
        return log_prob.flatten(), entropy.flatten(), self.value(features).flatten()


def compute_gae(rewards, values, dones, last_value, gamma: float, gae_lambda: float):
    """Generalized Advantage Estimation (Schulman et al., 2016; PPO paper, eq. 11-12).

    rewards, values, dones: [T, N] (time, env); last_value: [N], the value of the observation after
    the last step. `dones[t] = 1` when the episode ended at step t, after action t, by termination
    or truncation (for a truncated one the trainer has already added gamma * V(final obs) to
    rewards[t]: cutting the sum there is right for both). Returns the advantages [T, N].

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
    """Whole env sequences of the rollout (LSTM details, #4: minibatches split the envs, not the
    steps, so that the memory can be rebuilt); per-step fields flattened to [T * B], time-major."""

    inputs: torch.Tensor  # [window - 1 + T, B, input_size]: the model's inputs, raw
    starts: torch.Tensor  # [window - 1 + T, B]: 1 where a step starts an episode
    memory: tuple  # the recurrent state at the start of the rollout, [B, hidden] each
    actions: torch.Tensor  # [T, B], the actions taken
    old_log_probs: torch.Tensor  # their log-probabilities then
    advantages: torch.Tensor  # from GAE
    returns: torch.Tensor  # the value targets: advantages + old values
    old_values: torch.Tensor  # the values then


class Trainer:
    """One PPO step on a minibatch: clipped surrogate, value loss, entropy bonus, clipped step."""

    def __init__(self, model: Model, config: Config, ranks: Optional["Ranks"] = None):
        self.model, self.config, self.ranks = model, config, ranks
        # Adam (written out below the banner) with eps 1e-5 instead of 1e-8 (37 details, #3).
        self.optimizer = Adam(model.parameters(), lr=config.learning_rate, eps=1e-5)

    @staticmethod
    def ppo_loss(minibatch: Minibatch, new_log_probs, entropy, new_values, config: Config):
        """The PPO loss and its diagnostics, from what the current weights make of a minibatch."""
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

        # Value loss (37 details, #9): squared error to the GAE returns; optionally clipped like the
        # policy, around the values of the rollout.
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
        new_log_probs, entropy, new_values = self.model.evaluate_actions(
            minibatch.inputs, minibatch.starts, minibatch.memory, minibatch.actions)
        return self.ppo_loss(minibatch, new_log_probs, entropy, new_values, self.config)

    def gradient_step(self, minibatch: Minibatch) -> dict:
        """One gradient step on one minibatch. Returns the diagnostics as tensors (no host sync)."""
        loss, stats = self.compute_loss(minibatch)
        self.optimizer.zero_grad()
        loss.backward()
        if self.ranks is not None:
            self.ranks.average_gradients(self.model.parameters())
        # Global gradient clipping (37 details, #11): all gradients together are scaled down to a
        # norm of at most max_grad_norm, which keeps a rare huge step from undoing the policy.
        stats["grad_norm"] = nn.utils.clip_grad_norm_(self.model.parameters(),
                                                      self.config.max_grad_norm)
        self.optimizer.step()
        return stats


class Main:
    """The loop: `Main(config).run()` trains (or, with --eval, plays a checkpoint's games) and
    returns the summary as a dict. One iteration (37 details, #6): play num_steps steps per game,
    carrying its memory; GAE; update_epochs passes in minibatches of whole env sequences."""

    def __init__(self, config: Config):
        self.config, self.guard = config, None

    def run(self) -> dict:
        return evaluate_checkpoint(self.config) if self.config.eval else self.train()

    def train(self) -> dict:
        self.guard = guard = RunGuard(self)  # settings, torchrun, seeds, Ctrl-C, failures, saving
        with guard:
            config = self.config  # (the checkpoint's settings and the kind's defaults)
            self.model = Model(guard.obs_size, guard.num_actions, config)
            self.trainer = Trainer(self.model.to(guard.device), config, guard.ranks)
            self.global_step = guard.prepare_learner()  # 0, or --resume's; compile, sync ranks
            self.games = guard.start_games()  # Workers; observations through shared memory
            self.rollout = Rollout(config, self.model, guard.device)
            # Every game starts an episode: zero memory, no previous action or reward.
            self.memory = self.model.initial_memory(config.num_envs, guard.device)
            self.next_input = encode_inputs(self.model, self.games.observations())
            self.next_start = torch.ones(config.num_envs, device=guard.device)
            while self.global_step < config.total_timesteps:
                self.anneal_learning_rate()
                self.collect_rollout()  # 1. play with the current policy
                if guard.solved_step is not None:
                    break  # the target was reached in this rollout: the policy is good enough
                advantages, returns = self.estimate_advantages()  # 2. GAE
                stats = self.learn(advantages, returns)  # 3. epochs of clipped PPO steps
                guard.after_update(stats)  # NaN guard, logging, checkpoint when due
        return guard.summary

    def anneal_learning_rate(self):
        """Linear learning-rate annealing (37 details, #4): from learning_rate at step 0 to 0 at the
        end, set by the step at which each rollout starts, so that a resumed run continues it."""
        config = self.config
        if config.anneal_lr:
            progress = self.global_step / config.total_timesteps
            self.trainer.optimizer.lr = config.learning_rate * max(0.0, 1.0 - progress)

    @torch.inference_mode()  # like no_grad, and skips autograd's version counting too: faster
    def collect_rollout(self):
        """Play num_steps steps in every game with the current policy, filling the rollout buffer
        (inputs in rows history + step). `self.memory` carries the games' recurrent states."""
        config, rollout, model, device = self.config, self.rollout, self.model, self.guard.device
        rollout.keep_history()
        rollout.first_memory = self.memory  # LSTM details, #5: training starts from this state
        ended = []  # (global step, statistics) of the episodes that end
        for step in range(config.num_steps):
            if self.guard.stop_at_once():  # Ctrl-C (see RunGuard)
                break
            row = rollout.history + step
            rollout.inputs[row], rollout.starts[row] = self.next_input, self.next_start
            window = slice(row + 1 - model.window, row + 1)  # this row and the window - 1 before
            actions, log_probs, values, memory = model.act(rollout.inputs[window],
                                                           rollout.starts[window], self.memory)
            rollout.actions[step], rollout.log_probs[step], rollout.values[step] = (
                actions, log_probs, values)
            result = self.games.step(actions.cpu().numpy())
            raw_rewards = torch.from_numpy(result.rewards).to(device)
            rewards = raw_rewards.clone()
            done = torch.from_numpy(result.terminated | result.truncated).to(device).float()
            # Truncation is not death: a time-limit cut adds gamma * V(final obs) to its last
            # reward, V seen by the memory *after* this step (not a reset one); GAE then cuts there.
            cut = [i for i in result.final_obs if result.truncated[i] and not result.terminated[i]]
            if cut:
                final_obs = self.games.observations().clone()
                final_obs[cut] = torch.from_numpy(np.stack([result.final_obs[i] for i in cut])
                                                  ).to(device)
                final = encode_inputs(model, final_obs, actions, raw_rewards, done * 0)
                rewards[cut] += config.gamma * value_after(model, rollout, row, final, done * 0,
                                                           memory)[cut]
            rollout.rewards[step], rollout.dones[step] = rewards, done
            rollout.observations[step] = observations = self.games.observations()
            # The next input: the new observation, this action and reward (zeros if it restarted).
            self.next_input = encode_inputs(model, observations, actions, raw_rewards, done)
            self.next_start, self.memory = done, memory
            self.global_step += config.num_envs * self.guard.ranks.world_size
            ended += [(self.global_step, episode) for episode in result.episodes.values()]
        self.guard.after_rollout(ended)  # record the episodes; stop here on Ctrl-C
        update_observation_statistics(model, rollout.observations, self.guard.ranks)

    def estimate_advantages(self):
        """GAE over the rollout: (advantages, returns), both [num_steps, num_envs]."""
        rollout, last_row = self.rollout, self.rollout.history + self.config.num_steps - 1
        with torch.no_grad():
            last_value = value_after(self.model, rollout, last_row, self.next_input,
                                     self.next_start, self.memory)
        advantages = compute_gae(rollout.rewards, rollout.values, rollout.dones, last_value,
                                 self.config.gamma, self.config.gae_lambda)
        return advantages, advantages + rollout.values

    def learn(self, advantages: torch.Tensor, returns: torch.Tensor) -> dict:
        """update_epochs passes over the rollout in minibatches of whole env sequences (shuffled
        envs), one gradient step each. Returns the mean diagnostics as floats."""
        config, ranks = self.config, self.guard.ranks
        envs_per_minibatch = config.num_envs // config.num_minibatches
        totals, count = {}, 0
        for epoch in range(config.update_epochs):
            order = torch.randperm(config.num_envs, device=self.guard.device)
            for start in range(0, config.num_envs, envs_per_minibatch):
                envs = order[start:start + envs_per_minibatch]
                stats = self.trainer.gradient_step(self.rollout.minibatch(envs, advantages,
                                                                          returns))
                for key, value in stats.items():
                    totals[key] = totals.get(key, 0.0) + value.detach()
                count += 1
            # Early stop (37 details, #12, optional): a policy already far from the one that played
            # stops learning from its data (under torchrun by the ranks' mean KL: all stop alike).
            kl = stats["approx_kl"].item() if config.target_kl is not None else None
            if kl is not None and ranks.mean([kl])[0] > config.target_kl:
                break
        stats = {key: (value / count).item() for key, value in totals.items()}
        stats["explained_variance"] = explained_variance(self.rollout.values, returns)
        # Under torchrun, the means over the ranks: rank 0 logs them, all check the same for NaN.
        return dict(zip(stats, ranks.mean(list(stats.values()))))


# ==== Below: speed, safety and scale. PPO is complete above. ======================================
#
# What follows makes the lesson fast, safe and scalable, and a reader of PPO may stop here: the
# engines the games run on, the rollout buffer, a faster Adam and compilation; `Ranks` (torchrun);
# `RunGuard` (set-up, Ctrl-C, failures, logging, summary); checkpoints; evaluation and video; the
# checks of the user's input; the command line.


# ----- The games' engine --------------------------------------------------------------------------


# The partially observed versions of classic-control games this script registers with gymnasium:
# id -> (the full game, the entries of its observation that stay; the velocities go).
STATELESS_ENVS = {
    "StatelessCartPole-v1": ("CartPole-v1", [0, 2]),  # cart position, pole angle
    "StatelessAcrobot-v1": ("Acrobot-v1", [0, 1, 2, 3]),  # cos and sin of both angles
}


class StatelessObservation(gym.ObservationWrapper):
    """An env with some entries of its observation vector removed: `keep` lists those that stay.
    Stateless CartPole keeps the cart's position and the pole's angle (entries 0 and 2) and hides
    both velocities; stateless Acrobot keeps the cosines and sines of its two angles and hides the
    two angular velocities. Registered under the ids of STATELESS_ENVS."""

    def __init__(self, env: gym.Env, keep: list):
        super().__init__(env)
        self.keep = list(keep)
        space = env.observation_space
        self.observation_space = gym.spaces.Box(space.low[self.keep], space.high[self.keep],
                                                dtype=space.dtype)

    def observation(self, observation):
        return observation[self.keep]


def make_stateless_env(base: str, keep: list, **kwargs) -> gym.Env:
    return StatelessObservation(gym.make(base, **kwargs), keep)


def register_stateless_envs():
    """Register STATELESS_ENVS, once (called by whatever makes or checks an env: importing this
    file changes nothing). The full game's time limit stays (CartPole: 500 steps)."""
    for env_id, (base, keep) in STATELESS_ENVS.items():
        if env_id not in gym.registry:
            gym.register(env_id, entry_point=make_stateless_env,
                         kwargs={"base": base, "keep": keep})


class StepResult(typing.NamedTuple):
    """What one step of all the games gives the trainer, besides the observations."""

    rewards: np.ndarray  # [num_envs]
    terminated: np.ndarray  # [num_envs] bool: the episode ended in the game (the pole fell)
    truncated: np.ndarray  # [num_envs] bool: a time limit cut the episode
    final_obs: dict  # env index -> the last observation of the episode that ended there
    episodes: dict  # env index -> {"return", "length"} of the episode that ended there


class WorkerPool:
    """All the games: num_workers Workers with a Game of num_envs / num_workers envs each (or one
    Game in this process with --num-workers 0). Their observations land in one [num_envs, obs_size]
    array (shared memory when there are child processes) that the trainer reads as a tensor without
    copying. Env i is seeded with first_seed + i."""

    def __init__(self, config: Config, obs_size: int, first_seed: int, device: torch.device):
        self.device = device
        self.workers, self.shared_obs = [], None
        shape = (config.num_envs, obs_size)
        if config.num_workers == 0:
            self.obs_array = np.zeros(shape, dtype=np.float32)
        else:
            self.shared_obs = shared_memory.SharedMemory(create=True, size=int(np.prod(shape)) * 4)
            self.obs_array = np.ndarray(shape, dtype=np.float32, buffer=self.shared_obs.buf)
        games_per_worker = config.num_envs // max(config.num_workers, 1)
        try:
            for index in range(max(config.num_workers, 1)):
                first = index * games_per_worker
                worker = Worker(index, config.env, first_seed + first,
                                self.obs_array[first:first + games_per_worker],
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
        self.obs_tensor = torch.from_numpy(self.obs_array)

    def observations(self) -> torch.Tensor:
        """The games' current observations on the training device (no copy on the CPU)."""
        return self.obs_tensor.to(self.device)

    def step(self, actions: np.ndarray) -> StepResult:
        """Step every game: send all workers their actions first, then collect, so that children
        run in parallel."""
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


# ----- The rollout buffer, Adam and compilation ---------------------------------------------------


class Rollout:
    """The rollout buffer, on the training device. The model's inputs are stored once per step
    (rows `history` + step), with their start flags; for framestack and attention, the first
    `history` = window - 1 rows hold the last steps of the rollout before, so that the first steps'
    windows can be gathered (`episode_windows`). The rest is one entry per step and env (the raw
    observations too, for their statistics), and `first_memory` the recurrent state at the
    rollout's start. No sequence is ever padded: each is one env's whole rollout, num_steps long,
    so no step needs to be masked out of the losses or the advantage normalisation."""

    def __init__(self, config: Config, model: Model, device: torch.device):
        self.history = model.window - 1
        rows = (self.history + config.num_steps, config.num_envs)
        self.inputs = torch.zeros(rows + (model.input_size,), device=device)
        self.starts = torch.zeros(rows, device=device)
        shape = (config.num_steps, config.num_envs)
        self.actions = torch.zeros(shape, dtype=torch.long, device=device)
        self.log_probs = torch.zeros(shape, device=device)
        self.values = torch.zeros(shape, device=device)
        self.rewards = torch.zeros(shape, device=device)
        self.dones = torch.zeros(shape, device=device)
        self.observations = torch.zeros(shape + model.obs_mean.shape, device=device)
        self.first_memory = ()

    def keep_history(self):
        """Move the last `history` rows to the front, before a new rollout overwrites the rest."""
        if self.history:
            self.inputs[:self.history] = self.inputs[-self.history:].clone()
            self.starts[:self.history] = self.starts[-self.history:].clone()

    def minibatch(self, envs: torch.Tensor, advantages, returns) -> Minibatch:
        """The whole sequences of the envs `envs`, in time order."""
        return Minibatch(self.inputs[:, envs], self.starts[:, envs],
                         tuple(state[envs] for state in self.first_memory),
                         self.actions[:, envs], self.log_probs[:, envs].flatten(),
                         advantages[:, envs].flatten(), returns[:, envs].flatten(),
                         self.values[:, envs].flatten())


def value_after(model: Model, rollout: Rollout, row: int, new_input: torch.Tensor,
                new_start: torch.Tensor, memory: tuple) -> torch.Tensor:
    """V of a step that follows rollout row `row`, of input `new_input` (start flags `new_start`),
    seen by `memory` (the state after that row) and, for framestack, by the k - 1 rows up to it."""
    earlier = slice(row + 2 - model.window, row + 1)
    features, _ = model.remember(torch.cat([rollout.inputs[earlier], new_input[None]]),
                                 torch.cat([rollout.starts[earlier], new_start[None]]), memory)
    return model.value(features[-1])


# ----- The model's inputs, and framestack by index -----------------------------------------------


def encode_inputs(model: Model, obs, prev_actions=None, prev_rewards=None, new_episode=None):
    """x_t = [o_t, one-hot(a_(t-1)), r_(t-1)]: what the policy did and how that went. An
    episode's first step (`new_episode`; all rows without `prev_actions`) sees zeros for both.
    o_t is normalised (`update_observation_statistics`) when the rows are made, and stored so: the
    rollout and training read the same rows, whatever the statistics do later."""
    if model.config.normalize_observations:
        obs = ((obs - model.obs_mean) / (model.obs_var + 1e-8).sqrt()).clamp(-10.0, 10.0)
    if not model.config.prev_action_reward:
        return obs
    if prev_actions is None:
        return torch.cat([obs, obs.new_zeros(obs.shape[0], model.num_actions + 1)], dim=1)
    keep = 1.0 - new_episode.float()
    one_hot = nn.functional.one_hot(prev_actions, model.num_actions).float() * keep[:, None]
    return torch.cat([obs, one_hot, (prev_rewards.float() * keep)[:, None]], dim=1)


def episode_windows(inputs: torch.Tensor, starts: torch.Tensor, k: int) -> tuple:
    """The window of row t is rows t-k+1..t, gathered by index from the rows stored once each (no
    window is ever stored), with a mask of those that belong to row t's episode (the rows before
    its start do not). [L, B, D] -> (windows [L-k+1, B, k, D] of rows k-1..L-1, mask [L-k+1, B, k]),
    oldest row first."""
    length = inputs.shape[0]
    rows = torch.arange(k - 1, length, device=inputs.device)
    frames = rows[:, None] - (k - 1) + torch.arange(k, device=inputs.device)  # [T, k]
    # The row where the episode of each row began: the latest start at or before it (0 when
    # none is in sight: the episode began before these rows, and all of them belong to it).
    start_rows = torch.arange(length, device=inputs.device)[:, None] * starts.long()
    episode_start = start_rows.cummax(dim=0).values[rows]  # [T, B]
    in_episode = frames[:, None, :] >= episode_start[:, :, None]  # [T, B, k]
    return inputs[frames].transpose(1, 2), in_episode


@torch.no_grad()
def update_observation_statistics(model: Model, observations: torch.Tensor, ranks: "Ranks"):
    """Observation normalisation (37 details, continuous-action #4; SB3's VecNormalize): fold the
    rollout's observations [T, N, size] into the running mean and variance that `encode_inputs`
    scales by (the parallel update of Chan et al., 1979). A small observation (a pole's angle of
    0.05 rad beside a one-hot action of 1) would otherwise barely move a recurrent cell's gates.
    Under torchrun, the ranks' moments are averaged first: every rank keeps the same statistics."""
    if not model.config.normalize_observations:
        return
    flat, size = observations.flatten(0, 1), observations.shape[-1]
    moments = ranks.mean(flat.mean(0).tolist() + flat.square().mean(0).tolist())
    batch_mean = torch.tensor(moments[:size], device=flat.device)
    batch_var = (torch.tensor(moments[size:], device=flat.device) - batch_mean ** 2).clamp(min=0)
    count, new = model.obs_count.clone(), len(flat) * ranks.world_size
    delta = batch_mean - model.obs_mean
    model.obs_mean += delta * new / (count + new)
    model.obs_var.copy_((model.obs_var * count + batch_var * new
                         + delta ** 2 * count * new / (count + new)) / (count + new))
    model.obs_count += new


def stack_frames(inputs: torch.Tensor, starts: torch.Tensor, k: int) -> torch.Tensor:
    """Framestack by index: the stack of row t is its window (`episode_windows`) side by side, the
    rows before the start of row t's episode zeroed. [L, B, D] -> [L-k+1, B, k*D]."""
    windows, in_episode = episode_windows(inputs, starts, k)
    return (windows * in_episode[..., None]).flatten(2)


# ----- Attention: a gated Transformer-XL block ----------------------------------------------------


class GatedAttention(nn.Module):
    """--memory attention: one block of the Gated Transformer-XL (GTrXL: Parisotto et al., 2020,
    "Stabilizing Transformers for Reinforcement Learning"), run for each step over its window of
    the last M steps. The step is the query; the keys and values are the steps of its window.
    - Causal: a window holds the step and the M - 1 before it, never a later one.
    - Never across an episode start: keys before the start of the step's episode are masked out
      (the step itself always remains), so an episode sees nothing of the one before.
    - Positions relative to the step (Transformer-XL's relative positions): each key carries a
      sinusoid of its distance back from the query, within the episode (earlier keys are masked).
    - Pre-LayerNorm (GTrXL's "identity map reordering"): each sublayer reads LayerNorm(x), and its
      output (after a ReLU) joins the stream x through a gate: an identity path runs through.
    - A GRU-style gate (`GRUGate`) whose bias starts the block near the identity: early in training
      the policy is close to a memoryless one, and attention comes in as it pays.
    What is stored per step: the raw input row x_t (the rollout's `inputs`, before any layer),
    re-encoded in training with the current weights: the ratio before the first gradient step is
    exactly 1.
    Transformer-XL and CleanRL's ppo_trxl instead cache each layer's hidden states at rollout time:
    cheaper, but stale after the first epoch (the weights that made them have moved)."""

    def __init__(self, size: int, span: int, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.attention_norm, self.mlp_norm = nn.LayerNorm(size), nn.LayerNorm(size)
        self.query, self.key_value = layer(size, size, 1.0), layer(size, 2 * size, 1.0)
        self.attention_output = layer(size, size, 1.0)
        self.mlp = nn.Sequential(layer(size, size), nn.ReLU(), layer(size, size, 1.0))
        self.attention_gate, self.mlp_gate = GRUGate(size), GRUGate(size)
        # Slot j of a window lies span - 1 - j steps back: the sinusoids of Vaswani et al. (2017)
        # for those distances, fixed (not learned, not saved).
        distance = torch.arange(span - 1, -1, -1.0)[:, None]
        frequency = torch.exp(torch.arange(0, size, 2) * (-math.log(10_000.0) / size))
        codes = torch.zeros(span, size)
        codes[:, 0::2], codes[:, 1::2] = (distance * frequency).sin(), (distance * frequency).cos()
        self.register_buffer("distance_codes", codes, persistent=False)

    def forward(self, windows: torch.Tensor, in_episode: torch.Tensor) -> torch.Tensor:
        """windows [T, B, M, F] (oldest first), in_episode [T, B, M] -> features [T, B, F] of the
        newest step of each window."""
        *batch, span, size = windows.shape
        heads, head_size = self.heads, size // self.heads
        stream = windows[..., -1, :]  # the newest step: the query, and the residual stream
        normed = self.attention_norm(windows) + self.distance_codes
        query = self.query(normed[..., -1, :]).view(*batch, heads, 1, head_size)
        keys, values = self.key_value(normed).view(*batch, span, 2, heads, head_size).unbind(-3)
        keys, values = keys.transpose(-2, -3), values.transpose(-2, -3)  # [T, B, heads, M, d]
        scores = query @ keys.transpose(-1, -2) / math.sqrt(head_size)  # [T, B, heads, 1, M]
        scores = scores.masked_fill(~in_episode[..., None, None, :], float("-inf"))
        attended = (scores.softmax(-1) @ values).reshape(*batch, size)
        stream = self.attention_gate(stream, torch.relu(self.attention_output(attended)))
        return self.mlp_gate(stream, torch.relu(self.mlp(self.mlp_norm(stream))))


class GRUGate(nn.Module):
    """GTrXL's gate (Parisotto et al., 2020, eq. 8-11) joining a sublayer's output y to the stream
    x as a GRU joins its input to its state:
        r = sigmoid(W_r y + U_r x),  z = sigmoid(W_z y + U_z x - b_g),
        h = tanh(W_g y + U_g (r * x)),  out = (1 - z) * x + z * h.
    With b_g = 2, z starts near sigmoid(-2) = 0.12: the block starts close to the identity."""

    def __init__(self, size: int, gate_bias: float = 2.0):
        super().__init__()
        self.from_output = layer(size, 3 * size, 1.0)  # W_r, W_z, W_g (their biases: zero)
        self.from_stream = layer(size, 2 * size, 1.0)  # U_r, U_z
        self.from_reset_stream = layer(size, size, 1.0)  # U_g
        self.gate_bias = gate_bias

    def forward(self, stream: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
        reset_y, update_y, candidate_y = self.from_output(output).chunk(3, dim=-1)
        reset_x, update_x = self.from_stream(stream).chunk(2, dim=-1)
        reset = torch.sigmoid(reset_y + reset_x)
        update = torch.sigmoid(update_y + update_x - self.gate_bias)
        candidate = torch.tanh(candidate_y + self.from_reset_stream(reset * stream))
        return (1 - update) * stream + update * candidate


class Adam:
    """Adam (Kingma & Ba, 2015), computing exactly what `torch.optim.Adam` computes, in a few lines.

    Why not torch.optim.Adam: constructing the first torch.optim optimizer imports torch._dynamo,
    which costs about a second, a share of the time this script needs to solve a small game.
    tests/ check this class against torch.optim.Adam step by step. Adam keeps running averages of
    each gradient (m) and of its square (v), corrects their bias towards 0 in the first steps, and
    moves each weight by lr * m_hat / (sqrt(v_hat) + eps).
    """

    def __init__(self, params, lr: float, eps: float = 1e-5, betas=(0.9, 0.999)):
        self.params = list(params)
        self.lr, self.eps, self.betas = lr, eps, betas
        self.steps = 0
        self.exp_avg = [torch.zeros_like(p) for p in self.params]
        self.exp_avg_sq = [torch.zeros_like(p) for p in self.params]

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self):
        beta1, beta2 = self.betas
        self.steps += 1
        bias_correction1 = 1 - beta1 ** self.steps
        bias_correction2_sqrt = math.sqrt(1 - beta2 ** self.steps)
        grads = [p.grad for p in self.params]
        # $m \leftarrow \beta_1 m + (1 - \beta_1) g$,  $v \leftarrow \beta_2 v + (1 - \beta_2) g^2$
        torch._foreach_lerp_(self.exp_avg, grads, 1 - beta1)
        torch._foreach_mul_(self.exp_avg_sq, beta2)
        torch._foreach_addcmul_(self.exp_avg_sq, grads, grads, 1 - beta2)
        # $w \leftarrow w - lr / (1 - \beta_1^t) \cdot m / (\sqrt{v / (1 - \beta_2^t)} + \epsilon)$
        denominators = torch._foreach_sqrt(self.exp_avg_sq)
        torch._foreach_div_(denominators, bias_correction2_sqrt)
        torch._foreach_add_(denominators, self.eps)
        step_size = self.lr / bias_correction1
        torch._foreach_addcdiv_(self.params, self.exp_avg, denominators, -step_size)

    def state_dict(self) -> dict:
        return {"steps": self.steps, "lr": self.lr, "exp_avg": self.exp_avg,
                "exp_avg_sq": self.exp_avg_sq}

    def load_state_dict(self, state: dict):
        self.steps, self.lr = int(state["steps"]), float(state["lr"])
        saved = state["exp_avg"] + state["exp_avg_sq"]
        for mine, theirs in zip(self.exp_avg + self.exp_avg_sq, saved):
            mine.copy_(theirs)


def compile_learner(trainer: Trainer):
    """torch.compile the loss (its backward is compiled with it). The recurrent kinds step a cell
    along the sequence in a Python loop, which compiles into one long graph: seconds that small
    games never earn back, hence off by default. A machine that cannot compile falls back to eager
    at the first minibatch, with a one-line warning."""
    eager_loss = trainer.compute_loss
    compiled_loss = torch.compile(eager_loss)

    def compute_loss(minibatch: Minibatch):
        try:
            return compiled_loss(minibatch)
        except Exception as error:
            trainer.compute_loss = eager_loss
            print(f"warning: torch.compile failed ({type(error).__name__}: "
                  f"{str(error).splitlines()[0] if str(error) else ''}); running eagerly",
                  file=sys.stderr)
            return eager_loss(minibatch)

    trainer.compute_loss = compute_loss


# ----- Ranks: data-parallel training under torchrun -----------------------------------------------


class RankError(RuntimeError):
    """Under torchrun: another rank is gone (a collective failed), or the ranks' weights differ at
    the end."""


class Ranks:
    """The processes ("ranks") of one run started by torchrun, and the few things they do together.

    `torchrun --nproc_per_node N ppo_memory.py ...` (or any torch.distributed launcher, over
    several machines too) starts N copies of this script and tells each its rank and the world size
    in the environment (RANK, WORLD_SIZE, LOCAL_RANK). This is data parallelism, as in CleanRL's
    multi-GPU PPO (ppo_atari_multigpu.py): each rank plays its own --num-envs games (env i of rank r
    gets seed + r * num_envs + i), collects its own rollout and splits it into its own
    --num-minibatches; but before each gradient step the ranks average their gradients, so all take
    the same step and hold the same weights.
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
        flattened into one vector. Why not DistributedDataParallel: DDP overlaps the exchange with
        the backward pass, which pays for big networks; here one small message per minibatch is as
        fast, keeps the averaging in sight in Trainer.gradient_step (before the clip, so every rank
        clips the same global gradient), and fits the hand-written Adam, which reads each .grad."""
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
    again afterwards), then gives back what it changed in the process: the signal handlers and
    torch's thread count, so that a notebook is left as it was.
    """

    def __init__(self, main: Main):
        self.main, self.config = main, main.config
        self.previous_threads = torch.get_num_threads()
        self.previous_handlers = {}
        self.stop_signal = None
        self.ranks = self.games = self.writer = None
        self.updates = 0
        self.summary = None

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
        config = with_kind_defaults(config)  # the fields left at None, from --memory
        check_settings(config)
        device = pick_device(config.device)
        self.obs_size, self.num_actions = inspect_env(config.env)
        # Under torchrun, join the other ranks (each on a GPU of its own); alone, a world of one.
        self.ranks = Ranks(device)
        self.device = self.ranks.device
        # Rank 0 names and makes the run dir: the default name holds the time, which may differ.
        self.run_dir = self.ranks.from_rank_0(lambda: make_run_dir(config))
        config = dataclasses.replace(config, run_dir=str(self.run_dir))
        self.main.config = self.config = config
        # Reproducibility: every random draw of the trainer comes from torch's seeded generator
        # (action sampling, minibatch shuffling), and each game from its own seeded generator.
        # Under torchrun, rank r seeds with seed + r, so that its draws are its own.
        self.seed = config.seed + self.ranks.rank
        random.seed(self.seed)
        np.random.seed(self.seed)
        torch.manual_seed(self.seed)
        # One thread is fastest for networks this small: splitting a 64-unit layer over threads
        # costs more than it saves (benchmarks/README.md). Given back when the run ends.
        torch.set_num_threads(1)
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
            compile_learner(main.trainer)
        self.last_good_learner = copy.deepcopy(learner_state(main))  # what a NaN falls back to
        self.last_checkpoint_step = main.global_step
        self.writer = make_writer(self.run_dir, config) if self.ranks.rank == 0 else None
        return main.global_step

    def start_games(self) -> WorkerPool:
        """The games of this rank: game i of rank r is seeded with seed + r * num_envs + i."""
        config = self.config
        first_seed = config.seed + self.ranks.rank * config.num_envs
        self.games = WorkerPool(config, self.obs_size, first_seed, self.device)
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
        """Restore what the run changed in this process: signal handlers, torch's thread count."""
        for signum, handler in self.previous_handlers.items():
            signal.signal(signum, handler)
        self.previous_handlers = {}
        torch.set_num_threads(self.previous_threads)
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
        writer.add_scalar("charts/learning_rate", self.main.trainer.optimizer.lr, step)
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
        "script": SCRIPT, "env": main.config.env, "memory": main.config.memory,
        "obs_size": guard.obs_size, "num_actions": guard.num_actions,
        "config": dataclasses.asdict(main.config),
        "model": main.model.state_dict(), "optimizer": main.trainer.optimizer.state_dict(),
        "global_step": main.global_step, "updates": guard.updates,
        "rng": {"torch": torch.get_rng_state()},
    }


def restore_learner(main: Main, state: dict):
    try:
        main.model.load_state_dict(state["model"])
    except RuntimeError as error:
        raise UsageError(f"the checkpoint's network does not fit {main.config.env} with --memory "
                         f"{main.config.memory}, hidden size {main.config.hidden_size}: "
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


# The settings a checkpoint's weights are made for: another value cannot resume or evaluate them.
NETWORK_FIELDS = ("env", "hidden_size", "memory", "frame_stack", "attention_span",
                  "prev_action_reward", "normalize_observations")


def resumed_config(checkpoint: dict, given: Config) -> Config:
    """The settings of a resumed (or evaluated) run: the checkpoint's, except those given
    differently from their defaults now (e.g. a new --total-timesteps). A different env
    or network (NETWORK_FIELDS: what the weights were made for) is refused."""
    fields = dataclasses.fields(Config)
    saved = {f.name: checkpoint["config"][f.name] for f in fields if f.name in checkpoint["config"]}
    config = Config(**saved)
    for f in fields:
        value = getattr(given, f.name)
        if value != f.default:
            if f.name in NETWORK_FIELDS and value != saved.get(f.name):
                raise UsageError(f"the checkpoint was trained with --{f.name.replace('_', '-')} "
                                 f"{saved.get(f.name)}, not {value}")
            config = dataclasses.replace(config, **{f.name: value})
    return config


# ----- Evaluation and video -----------------------------------------------------------------------


@torch.no_grad()
def evaluate_checkpoint(given: Config) -> dict:
    """--eval: play --eval-episodes games with a checkpoint's policy and report the return. The
    memory is carried from step to step as in training: the recurrent state (zero at an episode's
    start), or for framestack and attention a window of the last rows with their start flags."""
    checkpoint = load_checkpoint(given.eval)
    config = with_kind_defaults(resumed_config(checkpoint, given))
    check_settings(config)
    if config.eval_episodes <= 0:
        raise UsageError("--eval-episodes must be positive")
    obs_size, num_actions = inspect_env(config.env)
    model = Model(obs_size, num_actions, config)
    model.load_state_dict(checkpoint["model"])
    torch.manual_seed(config.seed)
    run_dir = Path(given.run_dir) if given.run_dir else Path(config.eval).parent
    game = Game(config.env, config.seed, num_envs=1,
                render_mode="rgb_array" if config.video else None)
    video = None
    memory = model.initial_memory(1)
    next_input, next_start = encode_inputs(model, torch.from_numpy(game.reset())), torch.ones(1)
    inputs, starts = torch.zeros(model.window, 1, model.input_size), torch.zeros(model.window, 1)
    returns = []
    try:
        while len(returns) < config.eval_episodes:
            if config.video:
                video = write_frame(video, game, run_dir / "eval.mp4")
            inputs = torch.cat([inputs[1:], next_input[None]])
            starts = torch.cat([starts[1:], next_start[None]])
            actions, _, _, memory = model.act(inputs, starts, memory, greedy=config.greedy)
            obs, rewards, terminated, truncated, info = game.step(actions.numpy())
            next_start = torch.from_numpy(terminated | truncated).float()
            next_input = encode_inputs(model, torch.from_numpy(obs), actions,
                                       torch.from_numpy(rewards), next_start)
            if "episode" in info:
                returns.append(float(info["episode"]["return"][0]))
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
    """Append the game's current picture to the mp4 (OpenCV's VideoWriter, opened at the first
    frame)."""
    import cv2  # only --video needs OpenCV

    frame = game.render()
    if video is None:
        path.parent.mkdir(parents=True, exist_ok=True)
        fps = game.envs.metadata.get("render_fps", 30)
        video = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), fps,
                                (frame.shape[1], frame.shape[0]))
        if not video.isOpened():
            raise UsageError(f"OpenCV cannot write {path}")
    video.write(cv2.cvtColor(frame, cv2.COLOR_RGB2BGR))
    return video


# ----- Per-kind defaults --------------------------------------------------------------------------


# The settings that differ between the kinds of memory: Config's fields left at None take these.
# The MLP kinds keep separate actor and critic networks. lstm, gru and attention share their encoder
# and memory between actor and critic (CleanRL's LSTM PPO), so the value loss (returns up to ~50)
# pulls on the features the policy reads too: at the usual weight of 0.5, lstm and gru ended 200k
# steps below 475 on some seeds; at 0.03 with 128 units, on none; attention at 0.03 reached 475
# within 500k steps on seeds 1-3 (benchmarks/README.md).
MLP_DEFAULTS = dict(learning_rate=8e-3, num_steps=32, num_minibatches=2, update_epochs=8,
                    hidden_size=64, vf_coef=0.5)
SHARED_CORE_DEFAULTS = dict(learning_rate=3e-3, num_steps=32, num_minibatches=4, update_epochs=8,
                            vf_coef=0.03)
KIND_DEFAULTS = {
    "none": MLP_DEFAULTS,
    "framestack": MLP_DEFAULTS,
    "lstm": dict(SHARED_CORE_DEFAULTS, hidden_size=128),
    "gru": dict(SHARED_CORE_DEFAULTS, hidden_size=128),
    "attention": dict(SHARED_CORE_DEFAULTS, hidden_size=64),
}


def with_kind_defaults(config: Config) -> Config:
    """The config with each field left at None set from KIND_DEFAULTS[config.memory]."""
    if config.memory not in KIND_DEFAULTS:
        raise UsageError(f"unknown --memory {config.memory!r}: use {', '.join(MEMORY_KINDS)}")
    chosen = {name: value for name, value in KIND_DEFAULTS[config.memory].items()
              if getattr(config, name) is None}
    return dataclasses.replace(config, **chosen)


# ----- Checking the input -------------------------------------------------------------------------


class UsageError(ValueError):
    """Bad input from the user: the command line prints its message on one line, exit status 2."""


def check_settings(config: Config):
    """Refuse settings that cannot work, with one line that says what to change."""
    if config.memory not in MEMORY_KINDS:
        raise UsageError(f"unknown --memory {config.memory!r}: use {', '.join(MEMORY_KINDS)}")
    for name in ("total_timesteps", "num_envs", "num_steps", "num_minibatches", "update_epochs",
                 "hidden_size", "checkpoint_every", "frame_stack", "attention_span",
                 "learning_rate"):
        if getattr(config, name) <= 0:
            raise UsageError(f"--{name.replace('_', '-')} must be positive, not "
                             f"{getattr(config, name)}")
    if config.num_workers < 0:
        raise UsageError(f"--num-workers must be 0 (games in this process) or more, not "
                         f"{config.num_workers}")
    if config.num_workers and config.num_envs % config.num_workers:
        raise UsageError(f"--num-workers {config.num_workers} must divide --num-envs "
                         f"{config.num_envs}")
    if config.memory == "attention" and config.hidden_size % 4:
        raise UsageError(f"--hidden-size {config.hidden_size} does not split into the 4 heads of "
                         f"--memory attention: use a multiple of 4")
    window = {"framestack": "frame_stack", "attention": "attention_span"}.get(config.memory)
    if window and getattr(config, window) > config.num_steps + 1:
        raise UsageError(f"--{window.replace('_', '-')} {getattr(config, window)} reaches beyond "
                         f"the rollout before: at most --num-steps + 1 ({config.num_steps + 1})")
    # Minibatches hold whole env sequences (LSTM details, #4): they split the envs.
    if config.num_envs % config.num_minibatches:
        raise UsageError(f"the {config.num_envs} envs (--num-envs) do not split into "
                         f"--num-minibatches {config.num_minibatches} (minibatches split the envs)")
    batch_size = config.num_envs * config.num_steps
    if batch_size // config.num_minibatches < 2:
        raise UsageError(f"minibatches of {batch_size // config.num_minibatches} step cannot be "
                         f"normalised: raise --num-envs or --num-steps, or lower --num-minibatches")


def inspect_env(env_id: str):
    """Check that the env exists and that this script can play it. Returns (observation size,
    number of actions)."""
    register_stateless_envs()
    if env_id not in gym.registry:
        try:
            import ale_py  # registers the Atari ids, to tell the user where those belong

            gym.register_envs(ale_py)
        except ImportError:
            pass
        if env_id in gym.registry:
            raise UsageError(f"{env_id} is an Atari game: use ppo_atari.py")
        close = difflib.get_close_matches(env_id, list(gym.registry), n=3, cutoff=0.6)
        hint = (f"; did you mean {' or '.join(close)}?" if close
                else "; see gymnasium.pprint_registry()")
        raise UsageError(f"unknown env {env_id!r}{hint}")
    try:
        env = gym.make(env_id)
    except Exception as error:
        raise UsageError(f"cannot make {env_id}: {type(error).__name__}: {error}") from None
    obs_space, action_space = env.observation_space, env.action_space
    env.close()
    if not isinstance(obs_space, gym.spaces.Box):
        raise UsageError(f"{env_id} has a {type(obs_space).__name__} observation space; this "
                         f"script needs a Box (a vector of numbers)")
    if obs_space.dtype == np.uint8 and len(obs_space.shape) >= 2:
        raise UsageError(f"{env_id} observes images {obs_space.shape}: use ppo_atari.py, which "
                         f"has a CNN")
    obs_size = int(np.prod(obs_space.shape))
    if isinstance(action_space, gym.spaces.Discrete):
        return obs_size, int(action_space.n)
    if isinstance(action_space, gym.spaces.Box):
        raise UsageError(f"{env_id} has a {action_space} action space; this script handles "
                         f"Discrete actions: continuous Box actions need a Gaussian policy, "
                         f"ppo_continuous.py")
    raise UsageError(f"{env_id} has a {action_space} action space; this script handles Discrete "
                     f"actions: use ppo_cartpole.py (no memory) for MultiDiscrete and MultiBinary")


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
    per_kind = "; ".join(f"{kind}: " + ", ".join(f"--{name.replace('_', '-')} {value}"
                                                 for name, value in settings.items())
                         for kind, settings in KIND_DEFAULTS.items())
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog=f"defaults per --memory kind (for the flags whose "
                                            f"default is None): {per_kind}",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for f in dataclasses.fields(Config):
        flag = "--" + f.name.replace("_", "-")
        kind = next(t for t in (bool, int, float, str)
                    if t is f.type or t in typing.get_args(f.type))
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default,
                                help=f.metadata["help"])
        else:
            parser.add_argument(flag, type=kind, default=f.default, help=f.metadata["help"],
                                choices=f.metadata["choices"])
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
