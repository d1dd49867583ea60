"""PPO for games with continuous actions (Pendulum, MuJoCo's robots and friends), in one file.

Proximal Policy Optimization (Schulman et al., 2017: "PPO paper") with the implementation details
of CleanRL and Stable-Baselines3 ("The 37 Implementation Details of PPO", Huang et al., 2022:
"37 details"; its nine details for continuous actions are "continuous #1" to "#9"), each named
where it is implemented.

The idea. A policy-gradient method improves a policy with games the policy itself just played; the
games then describe an older policy, so plain policy gradient uses each batch once. PPO reuses each
batch ("rollout") for several epochs of minibatch steps, and keeps the new policy near the one that
collected the data by clipping the probability ratio r_t = pi(a_t | s_t) / pi_old(a_t | s_t) in its
objective (PPO paper, eq. 7), so that a step gains nothing by moving r_t beyond [1 - eps, 1 + eps]:

    L_clip = mean_t min( r_t A_t, clip(r_t, 1 - eps, 1 + eps) A_t )

The advantage A_t says how much better action a_t did than the value V(s_t) expected. Generalized
Advantage Estimation (GAE, Schulman et al., 2016) weighs the one-step errors of V by gamma * lambda:

    A_t = sum_k (gamma lambda)^k delta_(t+k),   delta_t = r_t + gamma V(s_(t+1)) - V(s_t)

Continuous actions. An action is a vector of real numbers (a torque, a robot's joint forces). The
policy is a Gaussian: the network gives the mean mu(s) of each action dimension, and a learnt
standard deviation sigma, the same in every state, sets how widely it explores. Observations are
normalised by running statistics, rewards scaled by the running spread of the discounted return.

Read it top to bottom: `Config`, `Game` (a batch of envs), `Worker` (Games in a child process),
`Model`, `compute_gae` and `Trainer` (a clipped PPO step), `Main` (the loop). PPO is complete at the
banner; below it, the machinery: running statistics, a torch Pendulum, torchrun, checkpoints, CLI.

Run it:         python ppo_continuous.py           (Pendulum-v1; --help lists every flag)
                python ppo_continuous.py --env-backend torch   (Pendulum stepped as tensors)
                python ppo_continuous.py --env HalfCheetah-v5   (MuJoCo: pip install mujoco)
On N GPUs:      torchrun --standalone --nproc_per_node N ppo_continuous.py   (data parallel)
In a notebook:  from ppo_continuous import Config, Main; Main(Config()).run()   (or paste it all)
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

SCRIPT = "ppo_continuous"


def option(default, help):
    """A Config field with its one-line explanation, which `--help` prints."""
    return field(default=default, metadata={"help": help})


@dataclass
class Config:
    """Every setting of a run. Each field is also a command-line flag (`num_envs` -> `--num-envs`).
    The defaults learn Pendulum-v1 fast (benchmarks/README.md has the measurements)."""

    # PPO's hyperparameters.
    learning_rate: float = option(1e-3, "Adam step size at the start, annealed linearly to 0")
    anneal_lr: bool = option(True, "anneal the learning rate linearly to 0 over the run")
    gamma: float = option(0.97, "discount factor: 0.97 looks ~33 steps ahead, about a swing-up")
    gae_lambda: float = option(0.95, "GAE lambda: bias (0) vs variance (1) of the advantage")
    num_minibatches: int = option(4, "minibatches each rollout is split into")
    update_epochs: int = option(10, "passes over each rollout")
    clip_coef: float = option(0.2, "PPO's clip range for the probability ratio")
    clip_value_loss: bool = option(False, "clip the value update too")
    ent_coef: float = option(0.0, "weight of the entropy bonus")
    vf_coef: float = option(0.5, "weight of the value loss")
    max_grad_norm: float = option(0.5, "clip the global gradient norm to this")
    target_kl: Optional[float] = option(None, "stop an update's epochs once approx KL exceeds this")
    hidden_size: int = option(64, "units in each of the two hidden layers of both MLPs")
    normalize_obs: bool = option(True, "normalise observations by running mean and std")
    obs_clip: float = option(10.0, "clip normalised observations to +-this")
    scale_rewards: bool = option(True, "divide rewards by the running std of the discounted return")
    reward_clip: float = option(10.0, "clip scaled rewards to +-this")

    # Collecting experience.
    env: str = option("Pendulum-v1", "gymnasium id: Box observations, Box (continuous) actions")
    env_backend: str = option("gym", "gym: gymnasium envs in Games | torch: Pendulum-v1 written "
                                     "in torch, all envs in one tensor op on --device")
    num_envs: Optional[int] = option(
        None, "games played side by side (by each rank); default: 16 (gym), 64 (torch)")
    num_workers: int = option(0, "child processes that run the games (0 = in this process)")
    num_steps: Optional[int] = option(
        None, "steps per game in each rollout; default: 64 (gym), 16 (torch)")

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
    greedy: bool = option(False, "with --eval, take the mean action instead of sampling")
    video: bool = option(False, "with --eval, write an mp4 of the games into the run dir")
    compile: bool = option(False, "torch.compile (off: it takes longer than learning Pendulum)")


class Game:
    """A batch of `num_envs` copies of one gymnasium environment, stepped together by gymnasium's
    SyncVectorEnv in same-step autoreset mode (env i seeded with seed + i): every value below is an
    array over the batch. Actions come in clipped to the bounds (see Main.collect_rollout).

    - Observations come out flat, as raw float32 rows, whatever the Box's shape (the trainer
      normalises them, with one set of statistics for all Games, Workers and ranks).
    - When an episode ends, its env restarts in the same step: `step` returns the first observation
      of the next episode, and the last one of the ended episode in `info["final_obs"]`
      (`info["_final_obs"]` marks which rows hold one), so the trainer can still bootstrap from it
      when the episode was only truncated (cut by a time limit, not ended by the game).
    - It reports the raw return and length of each episode that ends in `info["episode"]`.
    """

    def __init__(self, env_id: str, seed: int, num_envs: int = 1,
                 render_mode: Optional[str] = None):
        # render_mode is passed only when asked for: envs without rendering need not accept it.
        self.envs = gym.make_vec(env_id, num_envs, vectorization_mode="sync",
                                 vector_kwargs={"autoreset_mode": AutoresetMode.SAME_STEP},
                                 **({"render_mode": render_mode} if render_mode else {}))
        self.seed, self.num_envs = seed, num_envs
        self.action_space = self.envs.single_action_space
        self.episode_returns = np.zeros(num_envs)
        self.episode_lengths = np.zeros(num_envs, dtype=np.int64)

    def reset(self) -> np.ndarray:
        # Seed only the first reset: later restarts continue the envs' own random streams, so each
        # episode differs and the whole run is still fixed by the seed.
        obs, _ = self.envs.reset(seed=self.seed)
        self.seed = None
        self.episode_returns[:], self.episode_lengths[:] = 0, 0
        return self.flat(obs)

    def step(self, actions: np.ndarray):
        space = self.action_space
        env_actions = actions.reshape(-1, *space.shape).astype(space.dtype)
        obs, rewards, terminated, truncated, env_info = self.envs.step(env_actions)
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
        """A batch of observations as float32 rows [batch, obs_size], whatever the Box's shape."""
        obs = np.asarray(obs, dtype=np.float32)
        return obs.reshape(len(obs), -1)

    def render(self) -> np.ndarray:
        """The picture of the first env of the batch."""
        return self.envs.render()[0]

    def close(self):
        self.envs.close()


def step_game(game: Game, actions: np.ndarray, obs_out: np.ndarray) -> tuple:
    """Step the Game, write the observations into `obs_out`, and return the rest: rewards, flags,
    and by env index the final observations and the statistics of the episodes that ended."""
    obs_out[:], rewards, terminated, truncated, info = game.step(actions)
    final_obs, episodes = {}, {}
    for i in np.flatnonzero(info.get("_final_obs", ())):
        final_obs[i] = info["final_obs"][i]
        episodes[i] = {"return": float(info["episode"]["return"][i]),
                       "length": int(info["episode"]["length"][i])}
    return rewards, terminated, truncated, final_obs, episodes


class Worker:
    """Runs a Game (a batch of envs), either in a child process or, with `in_process=True`, here.

    The trainer sends the actions through a `multiprocessing` pipe; the child steps its Game and
    answers with rewards, flags and finished-episode statistics. Observations, the one large array,
    skip the pipe: the child writes them into shared memory (`obs_view`, a numpy view over a
    `multiprocessing.shared_memory` block that the trainer reads as a tensor without a copy).

    Children are forked: they inherit the shared memory and start in milliseconds, instead of
    importing torch again. A child ignores SIGINT (a terminal's Ctrl-C reaches the whole process
    group; the trainer decides how to stop) and exits by itself when the trainer's end of its pipe
    closes, so a trainer that dies, however, never leaves a worker behind.
    """

    def __init__(self, index: int, env_id: str, seed: int, obs_view: np.ndarray, in_process: bool,
                 inherited_trainer_ends: list):
        self.index = index
        self.env_id = env_id
        self.obs_view = obs_view
        self.in_process = in_process
        if in_process:
            self.game = Game(env_id, seed, len(obs_view))
            obs_view[:] = self.game.reset()
            return
        self.trainer_end, child_end = multiprocessing.Pipe()
        context = multiprocessing.get_context("fork")
        self.process = context.Process(
            target=Worker.child_main,
            args=(child_end, [self.trainer_end, *inherited_trainer_ends], env_id, seed, obs_view),
            name=f"{SCRIPT}-worker-{index}", daemon=True)
        self.process.start()
        child_end.close()
        self.receive()  # the child's first answer comes once its Game is reset

    @staticmethod
    def child_main(conn, trainer_ends, env_id, seed, obs_view):
        """The loop of the child process: step the Game on each command until told to stop."""
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        # A forked child holds copies of every pipe end the trainer had. Closing the trainer's ends
        # makes a recv() here fail with EOFError as soon as the trainer is gone.
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
        """The result of the last `send_step`. Waits on the pipe and on the process at once, so a
        child that dies is noticed at once instead of blocking `recv()` forever."""
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
    """A linear layer with orthogonal weights of the given gain and zero biases (37 details, #2: the
    hidden layers get sqrt(2), the policy output 0.01 so that every mean starts near 0, the value
    output 1)."""
    linear = nn.Linear(in_size, out_size)
    nn.init.orthogonal_(linear.weight, gain)
    nn.init.zeros_(linear.bias)
    return linear


class Model(nn.Module):
    """The actor-critic: a policy MLP giving the mean of each action dimension and a separate value
    MLP, both 64-64 tanh (37 details, #13 and continuous #4). The policy is a Gaussian (continuous
    #1) with a state-independent log standard deviation (continuous #2): one parameter per action
    dimension, initialised to 0 (sigma = 1). The dimensions are independent (continuous #3): the
    log-probability and the entropy of an action are sums over its dimensions."""

    def __init__(self, obs_size: int, action_size: int, hidden_size: int = 64):
        super().__init__()
        self.critic = nn.Sequential(
            layer(obs_size, hidden_size), nn.Tanh(),
            layer(hidden_size, hidden_size), nn.Tanh(),
            layer(hidden_size, 1, gain=1.0))
        self.actor = nn.Sequential(
            layer(obs_size, hidden_size), nn.Tanh(),
            layer(hidden_size, hidden_size), nn.Tanh(),
            layer(hidden_size, action_size, gain=0.01))
        self.log_std = nn.Parameter(torch.zeros(1, action_size))

    def value(self, obs: torch.Tensor) -> torch.Tensor:
        return self.critic(obs).squeeze(-1)

    @staticmethod
    def gaussian_log_prob(actions, mean, log_std) -> torch.Tensor:
        """log N(a; mu, sigma) summed over the action dimensions: [batch]. (Continuous #3.)
        $\\sum_i -(a_i - \\mu_i)^2 / (2\\sigma_i^2) - \\log\\sigma_i - \\tfrac12 \\log 2\\pi$"""
        squared = ((actions - mean) / log_std.exp()) ** 2
        return (-0.5 * squared - log_std - 0.5 * math.log(2 * math.pi)).sum(-1)

    def act(self, obs: torch.Tensor, greedy: bool = False):
        """Choose actions for a batch of observations: (the sampled, unbounded actions [batch,
        action_size], their log-probabilities, the values of the observations)."""
        mean = self.actor(obs)
        log_std = self.log_std.expand_as(mean)
        actions = mean if greedy else mean + log_std.exp() * torch.randn_like(mean)
        return actions, self.gaussian_log_prob(actions, mean, log_std), self.value(obs)

    def evaluate_actions(self, obs: torch.Tensor, actions: torch.Tensor):
        """For the loss: log-probabilities of the taken actions under the current policy, the
        entropy of the policy, and the values, all [batch]."""
        mean = self.actor(obs)
        log_prob = self.gaussian_log_prob(actions, mean, self.log_std.expand_as(mean))
        # The same in every state: $H = \\sum_i \\tfrac12 + \\tfrac12 \\log 2\\pi + \\log \\sigma_i$
        entropy = (0.5 + 0.5 * math.log(2 * math.pi) + self.log_std).sum(-1).expand(len(obs))
        return log_prob, entropy, self.value(obs)


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

    obs: torch.Tensor  # [batch, obs_size], as the policy saw them
    actions: torch.Tensor  # [batch, action_size], the sampled (unclipped) actions it took
    old_log_probs: torch.Tensor  # their log-probabilities then
    advantages: torch.Tensor  # from GAE
    returns: torch.Tensor  # the value targets: advantages + old values
    old_values: torch.Tensor  # the values then


class Trainer:
    """One PPO step on one minibatch: the clipped surrogate objective, the value loss, the entropy
    bonus, and a gradient step with the global gradient norm clipped."""

    def __init__(self, model: Model, config: Config, ranks: Optional["Ranks"] = None):
        self.model, self.config, self.ranks = model, config, ranks
        # Adam (written out below the banner) with eps 1e-5 instead of 1e-8 (37 details, #3).
        self.optimizer = Adam(model.parameters(), lr=config.learning_rate, eps=1e-5)

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

        # Value loss (37 details, #9): squared error to the GAE returns; optionally clipped like the
        # policy, around the values of the rollout. Off by default here (benchmarks/README.md).
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
            self.model = Model(guard.obs_size, guard.action_size, config.hidden_size)
            self.trainer = Trainer(self.model.to(guard.device), config, guard.ranks)
            self.normalizer = Normalizer(config, guard.obs_size, guard.device,  # running stats
                                         shared=guard.ranks.distributed)
            self.global_step = guard.prepare_learner()  # 0, or --resume's; compile, sync ranks
            self.games = guard.start_games()  # Workers, or the torch Pendulum
            self.rollout = Rollout(config, guard.obs_size, guard.action_size, guard.device)
            next_obs = self.normalizer.observations(self.games.observations())
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
            self.trainer.optimizer.lr = config.learning_rate * max(0.0, 1.0 - progress)

    @torch.inference_mode()  # like no_grad, and skips autograd's version counting too: faster
    def collect_rollout(self, next_obs: torch.Tensor) -> torch.Tensor:
        """Play num_steps steps in every game with the current policy, filling the rollout buffer.
        `next_obs` and the result, the observation after the last step, are normalised."""
        config, rollout, normalizer = self.config, self.rollout, self.normalizer
        low, high = self.guard.action_low, self.guard.action_high
        episodes = []  # per step: which games ended, their raw returns and lengths
        for step in range(config.num_steps):
            if self.guard.stop_at_once():  # Ctrl-C (see RunGuard)
                break
            rollout.obs[step] = next_obs
            actions, log_probs, values = self.model.act(next_obs)
            rollout.actions[step], rollout.log_probs[step], rollout.values[step] = (
                actions, log_probs, values)
            # Continuous #5: the env gets the action clipped to its bounds, the rollout keeps the
            # sampled one: its log-probability is what the policy did (clipped, it has another).
            result = self.games.step(actions.clamp(low, high))
            # Continuous #6-#7: observations normalised by running statistics (this batch
            # included), then clipped. #8-#9: rewards divided by the running std of the
            # discounted return, then clipped. Episode returns and --target-return stay raw.
            next_obs = normalizer.observations(self.games.observations())
            ended = result.terminated | result.truncated
            rewards = normalizer.rewards(result.rewards, ended)
            # Truncation is not death: an episode cut by a time limit would have gone on, so its
            # last reward gets gamma * V(final observation) added (normalised with the statistics
            # this step used); then the done flag cuts GAE's sum for both endings (compute_gae).
            cut = result.truncated & ~result.terminated
            if cut.any():  # (most steps cut no episode: skip the extra forward pass then)
                final_obs = normalizer.observations(result.final_obs, update=False)
                rewards += config.gamma * self.model.value(final_obs) * cut
            rollout.rewards[step], rollout.dones[step] = rewards, ended
            self.global_step += config.num_envs * self.guard.ranks.world_size
            episodes.append((self.global_step, ended, result.episode_returns,
                             result.episode_lengths))
        normalizer.merge_ranks(self.guard.ranks)  # under torchrun: all ranks' data, on every rank
        self.guard.after_rollout(episode_list(episodes))  # record the episodes; stop on Ctrl-C
        return next_obs

    def estimate_advantages(self, next_obs: torch.Tensor):
        """GAE over the rollout: (advantages, returns), both [num_steps, num_envs]."""
        with torch.no_grad():
            last_value = self.model.value(next_obs)
        rollout = self.rollout
        advantages = compute_gae(rollout.rewards, rollout.values, rollout.dones, last_value,
                                 self.config.gamma, self.config.gae_lambda)
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
# running statistics, the engines the games run on (Workers, or a Pendulum written in torch), the
# rollout buffer, a faster Adam and compilation; `Ranks` (torchrun); `RunGuard` (set-up, Ctrl-C,
# failures, logging, summary); checkpoints; evaluation and video; the checks of the user's input;
# the command line.


# ----- Running statistics: observation normalisation and reward scaling ---------------------------


class RunningMeanStd:
    """The count, mean and variance of every number seen so far, per feature, kept without the
    numbers (float64, on the training device; the count a Python number). A batch is merged by the
    parallel formula of Chan, Golub and LeVeque (1979), exact for any split of the data: with
    delta = mean_b - mean_a and n = n_a + n_b,

        mean = mean_a + delta n_b / n,   var = (var_a n_a + var_b n_b + delta^2 n_a n_b / n) / n

    (var * count is the sum of squared deviations, which merges by plain addition plus the delta
    term). It starts, as gymnasium's and SB3's do, from a tiny count 1e-4 with mean 0 and
    variance 1, so that the first division is safe."""

    def __init__(self, shape: tuple, device: torch.device, count: float = 1e-4,
                 var: float = 1.0):
        self.count = count
        self.mean = torch.zeros(shape, dtype=torch.float64, device=device)
        self.var = torch.full(shape, var, dtype=torch.float64, device=device)

    def update(self, batch: torch.Tensor):
        """Add a batch [n, *shape] of numbers."""
        var, mean = torch.var_mean(batch.to(torch.float64), dim=0, correction=0)
        self.merge(float(len(batch)), mean, var)

    def merge(self, count: float, mean: torch.Tensor, var: torch.Tensor):
        """Add the statistics of `count` other numbers (in place, so inference mode may do it)."""
        if count == 0:
            return
        total = self.count + count
        delta = mean - self.mean
        self.var.mul_(self.count / total).add_(var, alpha=count / total)
        self.var.add_(delta.square(), alpha=self.count * count / total ** 2)
        self.mean.add_(delta, alpha=count / total)
        self.count = total

    def moments(self) -> torch.Tensor:
        """[count, mean..., var...] as one flat tensor (what the ranks exchange)."""
        return torch.cat([self.mean.new_tensor([self.count]), self.mean.flatten(),
                          self.var.flatten()])

    def merge_moments(self, moments: torch.Tensor):
        size = self.mean.numel()
        self.merge(float(moments[0]), moments[1:1 + size].view_as(self.mean),
                   moments[1 + size:].view_as(self.var))

    def state_dict(self) -> dict:
        return {"count": self.mean.new_tensor(self.count), "mean": self.mean.clone(),
                "var": self.var.clone()}

    def load_state_dict(self, state: dict):
        self.count = float(state["count"])
        self.mean.copy_(state["mean"])
        self.var.copy_(state["var"])


class Normalizer:
    """What the trainer does to observations and rewards before PPO sees them (37 details,
    continuous #6-#9), as CleanRL's continuous PPO and SB3's VecNormalize do, with the statistics
    in the learner: one set for all the games, saved in the checkpoint, restored by --resume,
    frozen by --eval, and under torchrun (`shared`) merged over the ranks after each rollout.

    - Observation normalisation (continuous #6): obs <- (obs - mean) / sqrt(var + 1e-8), with the
      running statistics of every observation the policy was given, this batch included.
    - Observation clipping (continuous #7): then to [-obs_clip, obs_clip].
    - Reward scaling (continuous #8): each game keeps a running discounted return
      R <- gamma R + r; the reward is divided by the running std of R (not of the rewards: the
      value function learns sums of rewards, and this keeps them near unit scale). R restarts at
      every end of an episode, truncation included, as SB3's VecNormalize does; gymnasium's
      NormalizeReward restarts it only at a termination, which on Pendulum (truncated only) never
      comes, so its R runs on across episodes.
    - Reward clipping (continuous #9): then to [-reward_clip, reward_clip].
    """

    def __init__(self, config: Config, obs_size: int, device: torch.device,
                 num_envs: Optional[int] = None, shared: bool = False):
        self.config, self.shared = config, shared
        self.obs_stats = RunningMeanStd((obs_size,), device)
        self.return_stats = RunningMeanStd((), device)
        self.returns = torch.zeros(num_envs or config.num_envs, dtype=torch.float64, device=device)
        self.start_rollout()

    def start_rollout(self):
        """Shared over ranks, each rank keeps apart what its own rollout adds (from count 0)."""
        if not self.shared:
            return
        device = self.returns.device
        self.rollout_obs = RunningMeanStd(self.obs_stats.mean.shape, device, count=0.0, var=0.0)
        self.rollout_returns = RunningMeanStd((), device, count=0.0, var=0.0)
        self.before_rollout = (self.obs_stats.state_dict(), self.return_stats.state_dict())

    def observations(self, obs: torch.Tensor, update: bool = True) -> torch.Tensor:
        """Normalised and clipped observations (float32); `update` first adds them to the stats."""
        if not self.config.normalize_obs:
            return obs
        if update:
            self.obs_stats.update(obs)
            if self.shared:
                self.rollout_obs.update(obs)
        stats, clip = self.obs_stats, self.config.obs_clip
        normalised = (obs - stats.mean) / torch.sqrt(stats.var + 1e-8)
        return normalised.clamp(-clip, clip).to(torch.float32)

    def rewards(self, rewards: torch.Tensor, ended: torch.Tensor) -> torch.Tensor:
        """Scaled and clipped rewards (float32) of one step; `ended` restarts the games' R."""
        if not self.config.scale_rewards:
            return rewards.clone()
        self.returns.mul_(self.config.gamma).add_(rewards)
        self.return_stats.update(self.returns)
        if self.shared:
            self.rollout_returns.update(self.returns)
        self.returns.masked_fill_(ended, 0.0)
        scaled = rewards / torch.sqrt(self.return_stats.var + 1e-8)
        return scaled.clamp(-self.config.reward_clip, self.config.reward_clip).to(torch.float32)

    def merge_ranks(self, ranks: "Ranks"):
        """Under torchrun: one all_gather of what each rank's rollout added (count, mean, var),
        merged exactly into the statistics from before the rollout, in rank order, so that every
        rank holds the statistics of the union of all the ranks' data (not an average of
        variances). Alone, the statistics already hold everything: nothing to do."""
        if not self.shared:
            return
        shared = ranks.gather_tensors(torch.cat([self.rollout_obs.moments(),
                                                 self.rollout_returns.moments()]))
        self.obs_stats.load_state_dict(self.before_rollout[0])
        self.return_stats.load_state_dict(self.before_rollout[1])
        size = len(self.rollout_obs.moments())
        for moments in shared:
            self.obs_stats.merge_moments(moments[:size])
            self.return_stats.merge_moments(moments[size:])
        self.start_rollout()

    def state_dict(self) -> dict:
        return {"obs": self.obs_stats.state_dict(), "return": self.return_stats.state_dict()}

    def load_state_dict(self, state: dict):
        self.obs_stats.load_state_dict(state["obs"])
        self.return_stats.load_state_dict(state["return"])
        self.start_rollout()


def episode_list(episodes: list) -> list:
    """(global step, {"return", "length"}) of each episode that ended in a rollout, from the
    per-step tensors of Main.collect_rollout, read from the device in one go at its end."""
    if not episodes:
        return []
    steps = [step for step, _, _, _ in episodes]
    ended, returns, lengths = (torch.stack(part).cpu() for part in list(zip(*episodes))[1:])
    return [(steps[t], {"return": float(returns[t, i]), "length": int(lengths[t, i])})
            for t, i in ended.nonzero().tolist()]


# ----- The games' engines -------------------------------------------------------------------------


class StepResult(typing.NamedTuple):
    """What one step of all the games gives the trainer, besides the observations: tensors on the
    training device, one row per game."""

    rewards: torch.Tensor  # [num_envs] float32, raw
    terminated: torch.Tensor  # [num_envs] bool: the episode ended in the game
    truncated: torch.Tensor  # [num_envs] bool: a time limit cut the episode
    final_obs: torch.Tensor  # [num_envs, obs_size] raw: the last obs of an ended episode (else any)
    episode_returns: torch.Tensor  # [num_envs] float64: raw return of the episode that ended there
    episode_lengths: torch.Tensor  # [num_envs] int64: its length


class WorkerPool:
    """All the games as Games (`--env-backend gym`): num_workers Workers with a Game of num_envs /
    num_workers envs each (or one Game in this process with --num-workers 0). Their observations
    land in one [num_envs, obs_size] array (shared memory when there are child processes) that the
    trainer reads as a tensor without copying. Env i is seeded with first_seed + i."""

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

    def step(self, actions: torch.Tensor) -> StepResult:
        """Step every game: send all workers their actions first, then collect, so that children
        run in parallel."""
        actions = actions.cpu().numpy()
        for worker in self.workers:
            worker.send_step(actions[worker.first:worker.first + len(worker.obs_view)])
        results = [worker.receive() for worker in self.workers]
        final_obs = self.obs_array.copy()
        episode_returns, episode_lengths = np.zeros(len(final_obs)), np.zeros(len(final_obs), int)
        for worker, (_, _, _, worker_final_obs, worker_episodes) in zip(self.workers, results):
            for i, obs in worker_final_obs.items():
                final_obs[worker.first + i] = obs
            for i, episode in worker_episodes.items():
                episode_returns[worker.first + i] = episode["return"]
                episode_lengths[worker.first + i] = episode["length"]
        rewards, terminated, truncated = (np.concatenate(part) for part in list(zip(*results))[:3])
        as_tensor = lambda array: torch.from_numpy(np.asarray(array)).to(self.device)
        return StepResult(as_tensor(rewards), as_tensor(terminated), as_tensor(truncated),
                          as_tensor(final_obs), as_tensor(episode_returns),
                          as_tensor(episode_lengths))

    def close(self):
        for worker in self.workers:
            worker.close()
        self.workers = []
        if self.shared_obs is not None:
            self.obs_tensor = self.obs_array = None  # drop the views before unmapping the memory
            self.shared_obs.close()
            self.shared_obs = None


class TorchPendulum:
    """gymnasium's Pendulum-v1 rewritten in torch (`--env-backend torch`): the states of all games
    are one tensor [num_envs, 2] (angle, angular velocity) on the training device, and a step of
    all of them is a few tensor operations, with no Python loop over games. It needs no Worker:
    there is no per-game work to spread over processes, and on a GPU the observations never leave
    it (a step costs no host round trip; episode statistics are read once per rollout).

    The same as gymnasium's (tests/ step both from the same states): dynamics (g = 10, m = l = 1,
    dt = 0.05, angular velocity clipped to +-8, the angle not wrapped), the reward from the state
    before the step and the torque clipped to +-2, -(angle_normalize(th)^2 + 0.1 thdot^2 +
    0.001 u^2), observations (cos th, sin th, thdot) in float32, starts th ~ U(-pi, pi),
    thdot ~ U(-1, 1), and truncation after 200 steps (it never terminates). An ended game restarts
    in the same step, like the Games. Its random numbers come from its own generator, seeded with
    `seed`: the same runs as gymnasium's only in distribution, not draw for draw.
    """

    MAX_SPEED, MAX_TORQUE, DT, G, M, L = 8.0, 2.0, 0.05, 10.0, 1.0, 1.0
    MAX_EPISODE_STEPS = 200
    # The worst reward: angle pi, speed 8, torque 2.
    REWARD_RANGE = (-(math.pi ** 2 + 0.1 * 8.0 ** 2 + 0.001 * 2.0 ** 2), 0.0)

    def __init__(self, num_envs: int, seed: int, device: torch.device):
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self.state = self.random_states(num_envs)
        self.steps = torch.zeros(num_envs, dtype=torch.int64, device=device)
        self.episode_returns = torch.zeros(num_envs, dtype=torch.float64, device=device)

    def random_states(self, n: int) -> torch.Tensor:
        """Starting states, float64 like gymnasium's: th ~ U(-pi, pi), thdot ~ U(-1, 1)."""
        uniform = torch.rand(n, 2, dtype=torch.float64, device=self.device,
                             generator=self.generator)
        return (2 * uniform - 1) * torch.tensor([math.pi, 1.0], dtype=torch.float64,
                                                device=self.device)

    def observations(self) -> torch.Tensor:
        theta, theta_dot = self.state.unbind(1)
        return torch.stack([theta.cos(), theta.sin(), theta_dot], dim=1).to(torch.float32)

    def step(self, actions: torch.Tensor) -> StepResult:
        torque = actions[:, 0].to(torch.float64).clamp(-self.MAX_TORQUE, self.MAX_TORQUE)
        theta, theta_dot = self.state.unbind(1)
        normalised_angle = (theta + math.pi) % (2 * math.pi) - math.pi
        costs = normalised_angle ** 2 + 0.1 * theta_dot ** 2 + 0.001 * torque ** 2
        acceleration = (3 * self.G / (2 * self.L) * theta.sin()
                        + 3.0 / (self.M * self.L ** 2) * torque)
        theta_dot = (theta_dot + acceleration * self.DT).clamp(-self.MAX_SPEED, self.MAX_SPEED)
        self.state = torch.stack([theta + theta_dot * self.DT, theta_dot], dim=1)
        rewards = -costs
        self.steps += 1
        self.episode_returns += rewards
        truncated = self.steps >= self.MAX_EPISODE_STEPS
        final_obs = self.observations()
        episode_returns, episode_lengths = self.episode_returns.clone(), self.steps.clone()
        # Same-step restart without asking the device which games ended (no host sync): fresh
        # states are drawn for all, and kept where a game ended.
        self.state = torch.where(truncated[:, None], self.random_states(len(truncated)), self.state)
        self.steps.masked_fill_(truncated, 0)
        self.episode_returns.masked_fill_(truncated, 0.0)
        return StepResult(rewards.to(torch.float32), torch.zeros_like(truncated), truncated,
                          final_obs, episode_returns, episode_lengths)

    def close(self):
        pass


def check_env_specs(engine, num_envs: int, obs_space, action_space, steps: int = 210):
    """At start-up, in the spirit of TorchRL's check_env_specs: step an engine (a spare one, so the
    run's random streams are untouched) with random actions, some beyond the bounds, through a
    truncation, and check every shape, dtype and bound against the declared spaces. A failure is a
    bug in the engine: RuntimeError."""
    obs_size, action_size = int(np.prod(obs_space.shape)), int(np.prod(action_space.shape))
    low, high = (torch.as_tensor(bound, device=engine.device).flatten()
                 for bound in (obs_space.low, obs_space.high))

    def check(what: str, tensor: torch.Tensor, shape: tuple, dtype: torch.dtype, bounds=None):
        problem = (f"shape {tuple(tensor.shape)}" if tuple(tensor.shape) != shape else
                   f"dtype {tensor.dtype}" if tensor.dtype != dtype else
                   f"device {tensor.device}" if tensor.device.type != engine.device.type else
                   "values out of bounds" if bounds is not None and not (
                       (tensor >= bounds[0]).all() and (tensor <= bounds[1]).all()) else None)
        if problem:
            raise RuntimeError(f"{type(engine).__name__}: {what} has {problem}, not as declared "
                               f"{shape} {dtype} {tuple(bounds) if bounds else ''}")

    check("an observation", engine.observations(), (num_envs, obs_size), torch.float32, (low, high))
    action_low = torch.as_tensor(action_space.low, device=engine.device)
    action_high = torch.as_tensor(action_space.high, device=engine.device)
    truncations = 0
    for _ in range(steps):
        uniform = torch.rand(num_envs, action_size, device=engine.device,
                             generator=engine.generator)
        actions = action_low + (3 * uniform - 1) * (action_high - action_low)  # 1/3 beyond
        result = engine.step(actions)
        check("an observation", engine.observations(), (num_envs, obs_size), torch.float32,
              (low, high))
        check("a final observation", result.final_obs, (num_envs, obs_size), torch.float32,
              (low, high))
        check("a reward", result.rewards, (num_envs,), torch.float32, engine.REWARD_RANGE)
        check("terminated", result.terminated, (num_envs,), torch.bool)
        check("truncated", result.truncated, (num_envs,), torch.bool)
        truncations += int(result.truncated.sum())
    if truncations != num_envs * (steps // engine.MAX_EPISODE_STEPS):
        raise RuntimeError(f"{type(engine).__name__}: {truncations} truncations in {steps} steps "
                           f"of {num_envs} games, not one per {engine.MAX_EPISODE_STEPS} steps")


# ----- The rollout buffer, Adam and compilation ---------------------------------------------------


class Rollout:
    """The rollout buffer: one row per step and env, on the training device."""

    def __init__(self, config: Config, obs_size: int, action_size: int, device: torch.device):
        shape = (config.num_steps, config.num_envs)
        self.obs = torch.zeros(shape + (obs_size,), device=device)  # normalised, as the policy saw
        self.actions = torch.zeros(shape + (action_size,), device=device)
        self.log_probs = torch.zeros(shape, device=device)
        self.values = torch.zeros(shape, device=device)
        self.rewards = torch.zeros(shape, device=device)
        self.dones = torch.zeros(shape, device=device)

    def minibatch(self, indices: torch.Tensor, advantages, returns) -> Minibatch:
        """The rows of flat indices (step * num_envs + env)."""
        return Minibatch(self.obs.flatten(0, 1)[indices], self.actions.flatten(0, 1)[indices],
                         self.log_probs.flatten()[indices], advantages.flatten()[indices],
                         returns.flatten()[indices], self.values.flatten()[indices])


class Adam:
    """Adam (Kingma & Ba, 2015), computing exactly what `torch.optim.Adam` computes, in a few lines.

    Why not torch.optim.Adam: constructing the first torch.optim optimizer imports torch._dynamo,
    which costs about a second, a large share of the time this script needs to learn Pendulum.
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


def compile_learner(model: Model, trainer: Trainer, config: Config, obs_size: int, action_size: int,
                    device: torch.device):
    """torch.compile fuses the small layers into fewer kernels, for the rollout's inference and for
    the loss (its backward is compiled with it). It costs seconds to compile, which Pendulum never
    earns back, hence off by default. Compiling the bound methods, not the modules, keeps the
    checkpoint's parameter names as they are. Both are compiled here, on inputs of the sizes they
    will see, so that a machine that cannot compile falls back to eager at once, with a warning."""
    networks = (model.actor, model.critic)
    eager_forwards, eager_loss = [network.forward for network in networks], trainer.compute_loss
    minibatch_size = config.num_envs * config.num_steps // config.num_minibatches
    try:
        for network, forward in zip(networks, eager_forwards):
            network.forward = torch.compile(forward)
        trainer.compute_loss = torch.compile(eager_loss)
        with torch.no_grad():
            model.act(torch.zeros(config.num_envs, obs_size, device=device))
        zeros = torch.zeros(minibatch_size, device=device)
        actions = torch.zeros((minibatch_size, action_size), device=device)
        obs = torch.zeros(minibatch_size, obs_size, device=device)
        loss, _ = trainer.compute_loss(Minibatch(obs, actions, zeros, zeros + 1, zeros, zeros))
        loss.backward()
        trainer.optimizer.zero_grad()
    except Exception as error:
        for network, forward in zip(networks, eager_forwards):
            network.forward = forward
        trainer.compute_loss = eager_loss
        print(f"warning: torch.compile failed ({type(error).__name__}: "
              f"{str(error).splitlines()[0]}); running eagerly", file=sys.stderr)


# ----- Ranks: data-parallel training under torchrun -----------------------------------------------


class RankError(RuntimeError):
    """Under torchrun: another rank is gone (a collective failed), or the ranks' weights differ at
    the end."""


class Ranks:
    """The processes ("ranks") of one run started by torchrun, and the few things they do together.

    `torchrun --nproc_per_node N ppo_continuous.py ...` (or any torch.distributed launcher, over
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

    def gather_tensors(self, tensor: torch.Tensor) -> list:
        """Every rank's tensor (of the same shape), in rank order, on every rank: one all_gather."""
        if not self.distributed:
            return [tensor]
        tensors = [torch.empty_like(tensor) for _ in range(self.world_size)]
        self.collective(dist.all_gather, tensors, tensor.contiguous())
        return tensors

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
        config = with_backend_defaults(config)
        check_settings(config)
        device = pick_device(config.device)
        self.obs_size, self.action_size, action_low, action_high = inspect_env(config.env)
        # Under torchrun, join the other ranks (each on a GPU of its own); alone, a world of one.
        self.ranks = Ranks(device)
        self.device = self.ranks.device
        self.action_low = torch.as_tensor(action_low, device=self.device)
        self.action_high = torch.as_tensor(action_high, device=self.device)
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
            compile_learner(main.model, main.trainer, config, self.obs_size, self.action_size,
                            self.device)
        self.last_good_learner = copy.deepcopy(learner_state(main))  # what a NaN falls back to
        self.last_checkpoint_step = main.global_step
        self.writer = make_writer(self.run_dir, config) if self.ranks.rank == 0 else None
        return main.global_step

    def start_games(self):
        """The games of this rank, on the engine --env-backend names: game i of rank r is seeded
        with seed + r * num_envs + i (the torch Pendulum: its generator, with seed + r * num_envs).
        The torch Pendulum is checked against gymnasium's declared spaces first."""
        config = self.config
        first_seed = config.seed + self.ranks.rank * config.num_envs
        if config.env_backend == "torch":
            env = gym.make(config.env)
            check_env_specs(TorchPendulum(4, first_seed, self.device), 4, env.observation_space,
                            env.action_space)
            env.close()
            self.games = TorchPendulum(config.num_envs, first_seed, self.device)
        else:
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
                    self.ranks.check_same(list(self.main.model.state_dict().values())
                                          + list(learner_state(self.main)["normalizer"]["obs"]
                                                 .values()))
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
        "script": SCRIPT, "env": main.config.env, "obs_size": guard.obs_size,
        "action_size": guard.action_size, "config": dataclasses.asdict(main.config),
        "model": main.model.state_dict(), "optimizer": main.trainer.optimizer.state_dict(),
        "normalizer": main.normalizer.state_dict(),  # the running statistics: part of the policy
        "global_step": main.global_step, "updates": guard.updates,
        "rng": {"torch": torch.get_rng_state()},
    }


def restore_learner(main: Main, state: dict):
    try:
        main.model.load_state_dict(state["model"])
    except RuntimeError as error:
        raise UsageError(f"the checkpoint's network does not fit {main.config.env} with hidden "
                         f"size {main.config.hidden_size}: "
                         f"{str(error).splitlines()[-1].strip()}") from None
    main.trainer.optimizer.load_state_dict(state["optimizer"])
    main.normalizer.load_state_dict(state["normalizer"])
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
    differently from their defaults now (e.g. a new --total-timesteps). A different env or network
    is refused."""
    fields = dataclasses.fields(Config)
    saved = {f.name: checkpoint["config"][f.name] for f in fields if f.name in checkpoint["config"]}
    config = Config(**saved)
    for f in fields:
        value = getattr(given, f.name)
        if value != f.default:
            if f.name in ("env", "hidden_size") and value != saved.get(f.name):
                raise UsageError(f"the checkpoint was trained with --{f.name.replace('_', '-')} "
                                 f"{saved.get(f.name)}, not {value}")
            config = dataclasses.replace(config, **{f.name: value})
    return config


# ----- Evaluation and video -----------------------------------------------------------------------


@torch.no_grad()
def evaluate_checkpoint(given: Config) -> dict:
    """--eval: play --eval-episodes games with a checkpoint's policy and report the raw return.
    The observations are normalised with the checkpoint's statistics, frozen: evaluation does not
    change the policy it measures. The games are gymnasium's, whichever backend trained it."""
    checkpoint = load_checkpoint(given.eval)
    config = with_backend_defaults(resumed_config(checkpoint, given))
    check_settings(config)
    if config.eval_episodes <= 0:
        raise UsageError("--eval-episodes must be positive")
    obs_size, action_size, action_low, action_high = inspect_env(config.env)
    if config.video:
        check_video(config.env)
    model = Model(obs_size, action_size, config.hidden_size)
    model.load_state_dict(checkpoint["model"])
    normalizer = Normalizer(config, obs_size, torch.device("cpu"), num_envs=1)
    normalizer.load_state_dict(checkpoint["normalizer"])
    low, high = torch.as_tensor(action_low), torch.as_tensor(action_high)
    torch.manual_seed(config.seed)
    run_dir = Path(given.run_dir) if given.run_dir else Path(config.eval).parent
    game = Game(config.env, config.seed, num_envs=1,
                render_mode="rgb_array" if config.video else None)
    video = None
    obs = game.reset()
    returns = []
    try:
        while len(returns) < config.eval_episodes:
            if config.video:
                video = write_frame(video, game, run_dir / "eval.mp4")
            obs = normalizer.observations(torch.from_numpy(obs), update=False)
            actions, _, _ = model.act(obs, greedy=config.greedy)
            obs, _, _, _, info = game.step(actions.clamp(low, high).numpy())
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

    try:
        frame = game.render()
    except Exception as error:  # e.g. MuJoCo without the OpenGL library MUJOCO_GL names
        raise UsageError(f"cannot draw the game for --video ({type(error).__name__}: {error}); "
                         f"for MuJoCo, try MUJOCO_GL=egl or MUJOCO_GL=osmesa") from None
    if video is None:
        path.parent.mkdir(parents=True, exist_ok=True)
        fps = game.envs.metadata.get("render_fps", 30)
        video = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), fps,
                                (frame.shape[1], frame.shape[0]))
        if not video.isOpened():
            raise UsageError(f"OpenCV cannot write {path}")
    video.write(cv2.cvtColor(frame, cv2.COLOR_RGB2BGR))
    return video


# ----- Checking the input -------------------------------------------------------------------------


class UsageError(ValueError):
    """Bad input from the user: the command line prints its message on one line, exit status 2."""


# --num-envs and --num-steps when not given, by --env-backend: a step of the torch Pendulum costs
# about as much for 64 games as for 16, so it plays more games for fewer steps each
# (benchmarks/README.md).
BACKEND_DEFAULTS = {"gym": {"num_envs": 16, "num_steps": 64},
                    "torch": {"num_envs": 64, "num_steps": 16}}


def with_backend_defaults(config: Config) -> Config:
    """The config with --num-envs and --num-steps filled in from --env-backend's defaults where
    not given (an unknown backend is left for check_settings to refuse)."""
    defaults = BACKEND_DEFAULTS.get(config.env_backend, BACKEND_DEFAULTS["gym"])
    given = {name: getattr(config, name) for name in defaults}
    return dataclasses.replace(config, **{name: defaults[name] if value is None else value
                                          for name, value in given.items()})


def check_settings(config: Config):
    """Refuse settings that cannot work, with one line that says what to change."""
    if config.env_backend not in BACKEND_DEFAULTS:
        raise UsageError(f"unknown --env-backend {config.env_backend!r}: use gym or torch")
    for name in ("total_timesteps", "num_envs", "num_steps", "num_minibatches", "update_epochs",
                 "hidden_size", "checkpoint_every"):
        if getattr(config, name) <= 0:
            raise UsageError(f"--{name.replace('_', '-')} must be positive, not "
                             f"{getattr(config, name)}")
    if config.num_workers < 0:
        raise UsageError(f"--num-workers must be 0 (games in this process) or more, not "
                         f"{config.num_workers}")
    if config.num_workers and config.num_envs % config.num_workers:
        raise UsageError(f"--num-workers {config.num_workers} must divide --num-envs "
                         f"{config.num_envs}")
    if config.env_backend == "torch" and config.env != "Pendulum-v1":
        raise UsageError(f"--env-backend torch has Pendulum-v1 only, not {config.env}: use "
                         f"--env-backend gym")
    if config.env_backend == "torch" and config.num_workers:
        raise UsageError("--env-backend torch steps every game in this process: drop "
                         "--num-workers")
    batch_size = config.num_envs * config.num_steps
    if batch_size % config.num_minibatches:
        raise UsageError(f"the batch of {batch_size} steps (--num-envs x --num-steps) does not "
                         f"split into --num-minibatches {config.num_minibatches}")
    if batch_size // config.num_minibatches < 2:
        raise UsageError(f"minibatches of {batch_size // config.num_minibatches} step cannot be "
                         f"normalised: raise --num-envs or --num-steps, or lower --num-minibatches")


def inspect_env(env_id: str):
    """Check that the env exists and that this script can play it. Returns (observation size,
    action size, the actions' lower and upper bounds as flat float32 arrays)."""
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
    if is_mujoco(env_id):
        try:
            import mujoco  # noqa: F401  (only gymnasium's MuJoCo envs need it)
        except ImportError:
            raise UsageError(f"{env_id} runs on MuJoCo, which is not installed: "
                             f"pip install \"gymnasium[mujoco]\"") from None
        except Exception as error:  # its OpenGL, e.g. MUJOCO_GL=osmesa without libOSMesa
            raise UsageError(f"MuJoCo cannot start with MUJOCO_GL="
                             f"{os.environ.get('MUJOCO_GL')}: {type(error).__name__}: {error}; "
                             f"install that OpenGL library or try another MUJOCO_GL") from None
    try:
        env = gym.make(env_id)
    except Exception as error:
        # gymnasium's MuJoCo envs need imageio too, which its extra brings along with mujoco.
        extra = isinstance(error, ImportError) and is_mujoco(env_id)
        raise UsageError(f"cannot make {env_id}: {type(error).__name__}: {error}"
                         + ('; pip install "gymnasium[mujoco]"' if extra else "")) from None
    obs_space, action_space = env.observation_space, env.action_space
    env.close()
    if not isinstance(obs_space, gym.spaces.Box):
        raise UsageError(f"{env_id} has a {type(obs_space).__name__} observation space; this "
                         f"script needs a Box (a vector of numbers)")
    if obs_space.dtype == np.uint8 and len(obs_space.shape) >= 2:
        raise UsageError(f"{env_id} observes images {obs_space.shape}: use ppo_atari.py, which "
                         f"has a CNN")
    if not isinstance(action_space, gym.spaces.Box):
        raise UsageError(f"{env_id} has a {action_space} action space; this script handles "
                         f"continuous (Box) actions: use ppo_cartpole.py for Discrete, "
                         f"MultiDiscrete and MultiBinary ones")
    low, high = (np.asarray(bound, dtype=np.float32).reshape(-1)
                 for bound in (action_space.low, action_space.high))
    return int(np.prod(obs_space.shape)), int(np.prod(action_space.shape)), low, high


def is_mujoco(env_id: str) -> bool:
    return "mujoco" in str(gym.spec(env_id).entry_point)


def check_video(env_id: str):
    """MuJoCo draws with OpenGL: without a display, it needs an offscreen OpenGL named in the
    environment variable MUJOCO_GL before it is imported (EGL, or the OSMesa library)."""
    offscreen = os.environ.get("MUJOCO_GL") in ("egl", "osmesa")
    if is_mujoco(env_id) and not offscreen and not os.environ.get("DISPLAY"):
        raise UsageError(f"--video of {env_id} needs a display, or MuJoCo's offscreen drawing: "
                         f"run with MUJOCO_GL=egl or MUJOCO_GL=osmesa")


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
