"""PPO for many agents with one shared policy (PettingZoo parallel envs, MPE2's simple_spread), in
one file.

Proximal Policy Optimization (Schulman et al., 2017: "PPO paper") with the implementation details
of CleanRL and Stable-Baselines3 ("The 37 Implementation Details of PPO", Huang et al., 2022:
"37 details") and of MAPPO ("The Surprising Effectiveness of PPO in Cooperative Multi-Agent Games",
Yu et al., 2022: "MAPPO paper"), each named where it is implemented.

The idea. A policy-gradient method improves a policy with games the policy itself just played; the
games then describe an older policy, so plain policy gradient uses each batch once. PPO reuses each
batch ("rollout") for several epochs of minibatch steps, and keeps the new policy near the one that
collected the data by clipping the probability ratio r_t = pi(a_t | s_t) / pi_old(a_t | s_t) in its
objective (PPO paper, eq. 7), so that a step gains nothing by moving r_t beyond [1 - eps, 1 + eps]:

    L_clip = mean_t min( r_t A_t, clip(r_t, 1 - eps, 1 + eps) A_t )

The advantage A_t says how much better action a_t did than the value V(s_t) expected. Generalized
Advantage Estimation (GAE, Schulman et al., 2016) weighs the one-step errors of V by gamma * lambda:

    A_t = sum_k (gamma lambda)^k delta_(t+k),   delta_t = r_t + gamma V(s_(t+1)) - V(s_t)

Many agents. Every agent of every env copy is played by the same network ("parameter sharing"):
each agent's step is one more row of the batch, with its own observation, reward and advantage, so
three agents give three times the data of one. Two choices stay open (MAPPO paper, section 4): the
value function sees the agent's own observation ("independent PPO") or the env's global state
(`--central-value`: a centralised critic); and an agent may see a one-hot of its own index
(`--agent-id`). Agents that leave before the others (dead) or come later are masked out of every
loss and statistic.

Read it top to bottom: `Config`, `Game` (one env, all its agents), `Worker` (Games in a child
process), `Model`, `compute_gae` and `Trainer` (a clipped PPO step), `Main` (the loop). PPO is
complete at the banner; below it, the machinery: torchrun, bookkeeping, checkpoints, evaluation,
the CLI.

Run it:         python ppo_multiagent.py        (MPE2 simple_spread_v3; --help lists every flag)
Another env:    python ppo_multiagent.py --env mpe2.simple_spread_v3 --env-kwargs N=5
On N GPUs:      torchrun --standalone --nproc_per_node N ppo_multiagent.py  (data parallel: `Ranks`)
In a notebook:  from ppo_multiagent import Config, Main; Main(Config(total_timesteps=60_000)).run()
                (or paste this file into a cell, and call `Main(Config(...)).run()` in the next)
"""

import argparse
import ast
import copy
import dataclasses
import hashlib
import importlib
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

SCRIPT = "ppo_multiagent"


def option(default, help):
    """A Config field with its one-line explanation, which `--help` prints."""
    return field(default=default, metadata={"help": help})


@dataclass
class Config:
    """Every setting of a run. Each field is also a command-line flag (`num_envs` -> `--num-envs`).
    The defaults learn simple_spread fastest of those tried (benchmarks/README.md). Steps count
    agent steps: one agent acting once is one step, as Stable-Baselines3 with SuperSuit counts."""

    # PPO's hyperparameters.
    learning_rate: float = option(2e-3, "Adam step size at the start, annealed linearly to 0")
    anneal_lr: bool = option(True, "anneal the learning rate linearly to 0 over the run")
    gamma: float = option(0.95, "discount factor: 0.95 looks ~20 steps ahead, about an episode")
    gae_lambda: float = option(0.95, "GAE lambda: bias (0) vs variance (1) of the advantage")
    num_minibatches: int = option(2, "minibatches each rollout is split into")
    update_epochs: int = option(10, "passes over each rollout")
    clip_coef: float = option(0.2, "PPO's clip range for the probability ratio")
    clip_value_loss: bool = option(False, "clip the value update too")
    ent_coef: float = option(0.01, "weight of the entropy bonus")
    vf_coef: float = option(0.5, "weight of the value loss")
    max_grad_norm: float = option(10.0, "clip the global gradient norm to this (MAPPO: 10)")
    target_kl: Optional[float] = option(None, "stop an update's epochs once approx KL exceeds this")
    hidden_size: int = option(64, "units in each of the two hidden layers of both MLPs")
    agent_id: bool = option(False, "show each agent a one-hot of its index (the policy's input)")
    central_value: bool = option(
        True, "the value function sees the env's global state and the agent's one-hot index "
        "(MAPPO); off: the agent's own observation (independent PPO)")

    # Collecting experience.
    env: str = option("mpe2.simple_spread_v3", "PettingZoo parallel env, as module.name")
    env_kwargs: str = option("", "the env's own options, e.g. N=5,local_ratio=0.3")
    num_envs: int = option(16, "env copies played side by side (by each rank, under torchrun)")
    num_workers: int = option(2, "child processes that run the envs (0 = in this process)")
    num_steps: int = option(25, "env steps per env copy in each rollout")

    # The run.
    seed: int = option(1, "seeds everything; env i of rank r gets seed + r * num_envs + i")
    total_timesteps: int = option(600_000, "agent steps over all agents, envs (and ranks)")
    device: str = option("auto", "auto | cpu | cuda: auto takes CUDA when present")
    run_dir: Optional[str] = option(
        None, "logs, checkpoint and summary go here (default runs/<env>__<script>__<seed>__<time>)")
    target_return: Optional[float] = option(
        None, "stop at this mean return per agent of 100 episodes")
    checkpoint_every: int = option(200_000, "save a checkpoint every this many steps, and last")
    resume: Optional[str] = option(None, "continue training from this checkpoint")
    eval: Optional[str] = option(None, "play --eval-episodes episodes with this checkpoint")
    eval_episodes: int = option(10, "episodes played by --eval")
    greedy: bool = option(False, "with --eval, take the most likely action instead of sampling")
    video: bool = option(False, "with --eval, write an mp4 of the episodes into the run dir")
    compile: bool = option(False, "torch.compile (off: networks this small gain nothing)")


class Game:
    """One copy of a PettingZoo parallel env, every agent of which the one shared policy plays:
    every value below is an array over the env's agent slots (its `possible_agents`, in order).

    - An agent's row is what the network reads: its own observation (flat, float32); with
      --agent-id a one-hot of its slot, so that agents that see alike can still act differently;
      with --central-value then the env's global state and the one-hot again, for the critic
      (`Model` splits the row in two).
    - An agent can be absent: done before the others, or not yet arrived. Its row is zeros and
      `present` says so; the trainer keeps such rows out of everything it learns from.
    - When an agent's episode ends, `info["final_rows"]` holds its last row (`info["_final_rows"]`
      marks which), so that the trainer can bootstrap from it when a time limit cut the episode.
    - When every agent is done, the env restarts in the same step, and `info["episode"]` reports
      the episode: the return per agent (the mean over its agents), the team's (their sum) and the
      length in env steps.
    """

    def __init__(self, env_id: str, seed: int, env_kwargs: Optional[dict] = None,
                 agent_id: bool = False, central_value: bool = False,
                 render_mode: Optional[str] = None):
        self.env = make_env(env_id, env_kwargs or {}, render_mode)
        self.agents = list(self.env.possible_agents)
        self.num_agents = len(self.agents)
        self.seed, self.agent_id, self.central_value = seed, agent_id, central_value
        self.one_hot = np.eye(self.num_agents, dtype=np.float32)
        self.present = np.zeros(self.num_agents, dtype=bool)
        self.returns = np.zeros(self.num_agents)
        self.ever_present = np.zeros(self.num_agents, dtype=bool)
        self.length = 0

    def reset(self) -> np.ndarray:
        # Seed only the first reset: later restarts continue the env's own random stream, so each
        # episode differs and the whole run is still fixed by the seed.
        observations, _ = self.env.reset(seed=self.seed)
        self.seed = None
        self.returns[:], self.ever_present[:], self.length = 0, False, 0
        return self.observe(observations)

    def observe(self, observations: dict) -> np.ndarray:
        """The rows of the agents in the env now; marks them present."""
        self.present = np.array([agent in self.env.agents for agent in self.agents])
        self.ever_present |= self.present
        return self.rows(observations, self.present)

    def rows(self, observations: dict, which: np.ndarray) -> np.ndarray:
        """Each agent's row [num_agents, row size] for the agents `which` marks; zeros elsewhere."""
        state = np.asarray(self.env.state(), np.float32).ravel() if self.central_value else None
        rows = []
        for slot, agent in enumerate(self.agents):
            parts = [np.asarray(observations[agent], np.float32).ravel()] if which[slot] else []
            parts += [self.one_hot[slot]] if self.agent_id and which[slot] else []
            parts += [state, self.one_hot[slot]] if self.central_value and which[slot] else []
            rows.append(np.concatenate(parts) if parts else None)
        size = next(len(row) for row in rows if row is not None)
        return np.stack([np.zeros(size, np.float32) if row is None else row for row in rows])

    def step(self, actions: np.ndarray):
        """One env step: `actions` holds one action per slot (those of absent agents are unused)."""
        acting = {agent: int(actions[slot]) for slot, agent in enumerate(self.agents)
                  if self.present[slot]}
        observations, rewards, terminations, truncations, _ = self.env.step(acting)
        reward = np.array([rewards.get(agent, 0.0) for agent in self.agents], np.float32)
        terminated = np.array([bool(terminations.get(agent, False)) for agent in self.agents])
        truncated = np.array([bool(truncations.get(agent, False)) for agent in self.agents])
        self.returns += reward
        self.length += 1
        info = {}
        ended = terminated | truncated
        if ended.any():
            info["_final_rows"] = ended
            info["final_rows"] = self.rows(observations, ended)
        if self.env.agents:
            return self.observe(observations), reward, terminated, truncated, info
        played = self.returns[self.ever_present]  # every agent is done: the episode is over
        info["episode"] = {"return": float(played.mean()), "team_return": float(played.sum()),
                           "length": self.length}
        return self.reset(), reward, terminated, truncated, info

    def render(self) -> np.ndarray:
        return self.env.render()

    def close(self):
        self.env.close()


def step_games(games: list, actions: np.ndarray, rows_out: np.ndarray) -> tuple:
    """Step each Game with its agents' actions and write the rows into `rows_out`: row
    game * num_agents + slot holds that agent of that game (the batch layout). Return the rest, by
    row: rewards, flags, which agents are present now, the final rows of the agents whose episode
    ended, and by game index the statistics of the episodes that ended."""
    size = len(rows_out)
    rewards = np.empty(size, dtype=np.float32)
    terminated, truncated, present = (np.empty(size, dtype=bool) for _ in range(3))
    final_rows, episodes = {}, {}
    for index, game in enumerate(games):
        rows = slice(index * game.num_agents, (index + 1) * game.num_agents)
        rows_out[rows], rewards[rows], terminated[rows], truncated[rows], info = game.step(
            actions[rows])
        present[rows] = game.present
        for slot in np.flatnonzero(info.get("_final_rows", ())):
            final_rows[rows.start + slot] = info["final_rows"][slot]
        if "episode" in info:
            episodes[index] = info["episode"]
    return rewards, terminated, truncated, present, final_rows, episodes


class Worker:
    """Runs a few Games, either in a child process or, with `in_process=True`, right here.

    The trainer sends the actions through a `multiprocessing` pipe; the child steps its Games and
    answers with rewards, flags and finished-episode statistics. The rows, the one large array, skip
    the pipe: the child writes them into shared memory (`rows_view`, a numpy view over a
    `multiprocessing.shared_memory` block that the trainer reads as a tensor without a copy).

    Children are forked: they inherit the shared memory and start in milliseconds, instead of
    importing torch again. A child ignores SIGINT (a terminal's Ctrl-C reaches the whole process
    group; the trainer decides how to stop) and exits by itself when the trainer's end of its pipe
    closes, so a trainer that dies, however, never leaves a worker behind.
    """

    def __init__(self, index: int, env_id: str, seeds: list, game_options: dict,
                 rows_view: np.ndarray, in_process: bool, inherited_trainer_ends: list):
        self.index = index
        self.env_id = env_id
        self.rows_view = rows_view
        self.in_process = in_process
        if in_process:
            self.games = [Game(env_id, seed, **game_options) for seed in seeds]
            self.present = Worker.reset_games(self.games, rows_view)
            return
        self.trainer_end, child_end = multiprocessing.Pipe()
        context = multiprocessing.get_context("fork")
        self.process = context.Process(
            target=Worker.child_main,
            args=(child_end, [self.trainer_end, *inherited_trainer_ends], env_id, seeds,
                  game_options, rows_view),
            name=f"{SCRIPT}-worker-{index}", daemon=True)
        self.process.start()
        child_end.close()
        self.present = self.receive()  # the child's first answer comes once its Games are reset

    @staticmethod
    def reset_games(games: list, rows_view: np.ndarray) -> np.ndarray:
        """Reset every Game into its rows; return which agents are present."""
        num_agents = games[0].num_agents
        for index, game in enumerate(games):
            rows_view[index * num_agents:(index + 1) * num_agents] = game.reset()
        return np.concatenate([game.present for game in games])

    @staticmethod
    def child_main(conn, trainer_ends, env_id, seeds, game_options, rows_view):
        """The loop of the child process: step the Games on each command until told to stop."""
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        # A forked child holds copies of every pipe end the trainer had. Closing the trainer's ends
        # makes a recv() here fail with EOFError as soon as the trainer is gone.
        for end in trainer_ends:
            end.close()
        try:
            games = [Game(env_id, seed, **game_options) for seed in seeds]
            conn.send(("ok", Worker.reset_games(games, rows_view)))
            while True:
                command, actions = conn.recv()
                if command == "close":
                    break
                conn.send(("ok", step_games(games, actions, rows_view)))
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

    def receive(self, timeout: float = 120.0):
        """The result of the last `send_step`. Waits on the pipe and on the process at once, so a
        child that dies is noticed at once instead of blocking `recv()` forever."""
        if self.in_process:
            return step_games(self.games, self.actions, self.rows_view)
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


def layer(in_size: int, out_size: int, gain: float = math.sqrt(2)) -> nn.Linear:
    """A linear layer with orthogonal weights of the given gain and zero biases (37 details, #2: the
    hidden layers get sqrt(2), the policy output 0.01 so that all actions start equally likely, the
    value output 1)."""
    linear = nn.Linear(in_size, out_size)
    nn.init.orthogonal_(linear.weight, gain)
    nn.init.zeros_(linear.bias)
    return linear


class Model(nn.Module):
    """The actor-critic shared by all agents: a policy MLP and a separate value MLP, both 64-64 tanh
    (37 details, #13).

    A row (see `Game`) is [observation, one-hot id?] for the policy, followed with --central-value
    by [global state, one-hot id] for the critic. The policy reads the first `policy_size` columns.
    The critic reads the rest with --central-value (MAPPO paper, section 4: a centralised value
    function; the one-hot tells it whose value it gives, since rewards may differ per agent), else
    the same columns as the policy (independent PPO). Either way the policy acts on what its agent
    sees alone, so the trained agents need no global state to play.

    Value normalisation (MAPPO paper, suggestion 1): the critic's output is in units of the running
    mean and standard deviation of the value targets (`return_mean`, `return_std`, kept by the
    Trainer), and `value` turns it back into a return. simple_spread's targets (about -1 a step,
    over 1 / (1 - gamma) steps, since a time-limit cut is bootstrapped) lie far from what a freshly
    initialised output layer gives; normalised, the critic fits them within a few updates.
    """

    def __init__(self, policy_size: int, value_size: int, num_actions: int,
                 central_value: bool, hidden_size: int = 64):
        super().__init__()
        self.policy_size, self.central_value = policy_size, central_value
        self.critic = nn.Sequential(
            layer(value_size, hidden_size), nn.Tanh(),
            layer(hidden_size, hidden_size), nn.Tanh(),
            layer(hidden_size, 1, gain=1.0))
        self.actor = nn.Sequential(
            layer(policy_size, hidden_size), nn.Tanh(),
            layer(hidden_size, hidden_size), nn.Tanh(),
            layer(hidden_size, num_actions, gain=0.01))
        # Buffers, not parameters: saved with the weights, never moved by the optimizer.
        self.register_buffer("return_mean", torch.zeros(()))
        self.register_buffer("return_std", torch.ones(()))
        self.register_buffer("return_count", torch.zeros((), dtype=torch.float64))

    def value(self, rows: torch.Tensor) -> torch.Tensor:
        columns = slice(self.policy_size, None) if self.central_value else slice(self.policy_size)
        return self.critic(rows[:, columns]).squeeze(-1) * self.return_std + self.return_mean

    def log_probs(self, rows: torch.Tensor) -> torch.Tensor:
        """Log-probabilities of each action: [batch, actions]."""
        return torch.log_softmax(self.actor(rows[:, :self.policy_size]), dim=-1)

    def act(self, rows: torch.Tensor, greedy: bool = False):
        """Choose actions for a batch of rows: (actions [batch], their log-probabilities, the
        values)."""
        log_probs = self.log_probs(rows)
        if greedy:
            actions = log_probs.argmax(-1)
        else:
            actions = torch.multinomial(log_probs.exp(), 1).squeeze(-1)
        log_prob = log_probs.gather(-1, actions.unsqueeze(-1)).squeeze(-1)
        return actions, log_prob, self.value(rows)

    def evaluate_actions(self, rows: torch.Tensor, actions: torch.Tensor):
        """For the loss: log-probabilities of the taken actions under the current policy, the
        entropy of the policy, and the values, all [batch]."""
        log_probs = self.log_probs(rows)
        log_prob = log_probs.gather(-1, actions.unsqueeze(-1)).squeeze(-1)
        entropy = -(log_probs.exp() * log_probs).sum(-1)
        return log_prob, entropy, self.value(rows)


def compute_gae(rewards, values, dones, last_value, gamma: float, gae_lambda: float):
    """Generalized Advantage Estimation (Schulman et al., 2016; PPO paper, eq. 11-12).

    rewards, values, dones: [T, N] (time, row: here one row per agent of each env); last_value:
    [N], the value of the row after the last step. `dones[t] = 1` when the agent's episode ended at
    step t, after action t, by termination or truncation (or when the agent was absent at step t);
    for a truncated episode the trainer has already added gamma * V(final row) to rewards[t], so
    cutting the sum there is right in both cases. Returns the advantages [T, N]; the value targets
    are advantages + values.

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
    """A shuffled slice of the rollout, one row per agent step: what the Trainer learns from."""

    obs: torch.Tensor  # [batch, row size], the rows the networks read
    actions: torch.Tensor  # [batch], the actions taken
    old_log_probs: torch.Tensor  # their log-probabilities then
    advantages: torch.Tensor  # from GAE
    returns: torch.Tensor  # the value targets: advantages + old values
    old_values: torch.Tensor  # the values then
    mask: torch.Tensor  # 1 where an agent was present and acted, 0 for an absent agent's row


class Trainer:
    """One PPO step on one minibatch: the clipped surrogate objective, the value loss, the entropy
    bonus, and a gradient step with the global gradient norm clipped. Every mean is over the rows
    of present agents only (`mask`): an absent agent's padded row never reaches a loss, the
    advantage normalisation, the entropy or a diagnostic."""

    def __init__(self, model: Model, config: Config, ranks: Optional["Ranks"] = None):
        self.model, self.config, self.ranks = model, config, ranks
        # Adam (written out below the banner) with eps 1e-5 instead of 1e-8 (37 details, #3).
        self.optimizer = Adam(model.parameters(), lr=config.learning_rate, eps=1e-5)

    @staticmethod
    def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The mean of `values` over the rows where `mask` is 1 (0 when there is none)."""
        return (values * mask).sum() / mask.sum().clamp(min=1)

    @torch.no_grad()
    def track_returns(self, returns: torch.Tensor, mask: torch.Tensor):
        """Fold a rollout's value targets (those of present agents) into the running mean and
        standard deviation that normalise the critic's output (`Model`); under torchrun, those of
        every rank, so that all ranks hold the same statistics. Chan et al.'s parallel update of
        count, mean and variance: the statistics of all targets seen so far."""
        targets = returns[mask > 0].double()
        count = float(targets.numel())
        sums = [count, targets.sum().item(), (targets ** 2).sum().item()]
        if self.ranks is not None:
            sums = self.ranks.mean(sums)  # (means of sums: the ratios below are the same)
        count, mean = sums[0], sums[1] / max(sums[0], 1.0)
        variance = max(sums[2] / max(sums[0], 1.0) - mean ** 2, 0.0)
        model = self.model
        seen, seen_mean = model.return_count.item(), model.return_mean.item()
        total = seen + count
        if total == 0:
            return
        delta = mean - seen_mean
        squares = (model.return_std.item() ** 2 * seen + variance * count
                   + delta ** 2 * seen * count / total)
        model.return_mean.fill_(seen_mean + delta * count / total)
        model.return_std.fill_(max(math.sqrt(squares / total), 1e-3))
        model.return_count.fill_(total)

    @staticmethod
    def ppo_loss(minibatch: Minibatch, new_log_probs, entropy, new_values, config: Config,
                 value_scale: torch.Tensor):
        """The PPO loss and its diagnostics, from a minibatch and what the current weights make of
        it (all [batch]); value_scale: the standard deviation of the value targets."""
        mask, mean = minibatch.mask, Trainer.masked_mean
        # Advantage normalisation per minibatch (37 details, #7), over the present agents' rows.
        # torch.where, not a product: a padded row's numbers take no part, not even as 0 * inf.
        advantages = torch.where(mask > 0, minibatch.advantages, 0.0)
        centred = advantages - mean(advantages, mask)
        std = (mean(centred ** 2, mask) * mask.sum() / (mask.sum() - 1).clamp(min=1)).sqrt()
        advantages = torch.where(mask > 0, centred / (std + 1e-8), 0.0)

        # The clipped surrogate (PPO paper, eq. 7): the probability ratio r = pi_new / pi_old may
        # move the objective only within [1 - clip, 1 + clip]; the max of the two negated terms is
        # the pessimistic (min) bound of the paper. 37 details, #8.
        log_ratio = torch.where(mask > 0, new_log_probs - minibatch.old_log_probs, 0.0)
        ratio = log_ratio.exp()
        clipped_ratio = ratio.clamp(1 - config.clip_coef, 1 + config.clip_coef)
        policy_loss = mean(torch.max(-advantages * ratio, -advantages * clipped_ratio), mask)

        # Value loss (37 details, #9): squared error to the GAE returns, in units of their standard
        # deviation (value normalisation, see Model); optionally clipped like the policy, around
        # the values of the rollout.
        returns = torch.where(mask > 0, minibatch.returns, 0.0) / value_scale
        old_values = torch.where(mask > 0, minibatch.old_values, 0.0) / value_scale
        new_values = torch.where(mask > 0, new_values, 0.0) / value_scale
        if config.clip_value_loss:
            clip = config.clip_coef
            clipped = old_values + (new_values - old_values).clamp(-clip, clip)
            value_loss = 0.5 * mean(torch.max((new_values - returns) ** 2,
                                              (clipped - returns) ** 2), mask)
        else:
            value_loss = 0.5 * mean((new_values - returns) ** 2, mask)

        # Entropy bonus (37 details, #10): rewards a spread-out policy, which keeps exploring.
        entropy_mean = mean(entropy, mask)
        loss = policy_loss - config.ent_coef * entropy_mean + config.vf_coef * value_loss

        # Diagnostics (37 details, #12): approx KL with the low-variance estimator (r - 1) - log r
        # (Schulman, "Approximating KL divergence", 2020) and the share of samples the clip touched.
        with torch.no_grad():
            approx_kl = mean((ratio - 1) - log_ratio, mask)
            clip_fraction = mean(((ratio - 1).abs() > config.clip_coef).float(), mask)
        stats = {"policy_loss": policy_loss, "value_loss": value_loss, "entropy": entropy_mean,
                 "approx_kl": approx_kl, "clip_fraction": clip_fraction}
        return loss, stats

    def compute_loss(self, minibatch: Minibatch):
        """The loss of a minibatch under the current weights (what --compile compiles)."""
        new_log_probs, entropy, new_values = self.model.evaluate_actions(minibatch.obs,
                                                                         minibatch.actions)
        return self.ppo_loss(minibatch, new_log_probs, entropy, new_values, self.config,
                             self.model.return_std)

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
    """The loop: `Main(config).run()` trains (or, with --eval, plays a checkpoint's episodes) and
    returns the summary as a dict. One iteration (37 details, #6): play num_steps steps in each of
    num_envs env copies with the current policy, every agent a row of the batch; estimate each
    agent step's advantage with GAE; then take update_epochs passes over the rollout in shuffled
    minibatches, one clipped gradient step each. The `RunGuard` (below the banner) sets up, logs,
    saves and stops, so `train` reads as PPO."""

    def __init__(self, config: Config):
        self.config = config
        self.guard = None

    def run(self) -> dict:
        return evaluate_checkpoint(self.config) if self.config.eval else self.train()

    def train(self) -> dict:
        self.guard = guard = RunGuard(self)  # settings, torchrun, seeds, Ctrl-C, failures, saving
        with guard:
            config = self.config  # (the checkpoint's settings, when resuming)
            self.model = Model(guard.policy_size, guard.value_size, guard.spec.num_actions,
                               config.central_value, config.hidden_size)
            self.trainer = Trainer(self.model.to(guard.device), config, guard.ranks)
            self.global_step = guard.prepare_learner()  # 0, or --resume's; compile, sync ranks
            self.games = guard.start_games()  # Workers; rows through shared memory
            self.rollout = Rollout(config, guard.batch_rows, guard.row_size, guard.device)
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
            self.trainer.optimizer.lr = config.learning_rate * max(0.0, 1.0 - progress)

    @torch.inference_mode()  # like no_grad, and skips autograd's version counting too: faster
    def collect_rollout(self, next_obs: torch.Tensor) -> torch.Tensor:
        """Play num_steps steps in every env copy with the current policy, one row per agent,
        filling the rollout buffer. Returns the rows after the last step."""
        config, rollout, device = self.config, self.rollout, self.guard.device
        ended = []  # (global step, statistics) of the episodes that end
        for step in range(config.num_steps):
            if self.guard.stop_at_once():  # Ctrl-C (see RunGuard)
                break
            rollout.obs[step], rollout.mask[step] = next_obs, self.games.present()
            actions, log_probs, values = self.model.act(next_obs)
            rollout.actions[step], rollout.log_probs[step], rollout.values[step] = (
                actions, log_probs, values)
            result = self.games.step(actions.cpu().numpy())
            next_obs = self.games.observations()
            rewards = torch.from_numpy(result.rewards).to(device)
            # Truncation is not death: an episode cut by a time limit (every simple_spread episode
            # ends so, after 25 steps) would have gone on, so its last reward gets the value of
            # where it stood, gamma * V(final row), added. Then the done flag below can cut GAE's
            # sum for both kinds of endings (compute_gae).
            cut = [i for i in result.final_rows if result.truncated[i] and not result.terminated[i]]
            if cut:
                cut_rows = torch.from_numpy(np.stack([result.final_rows[i] for i in cut]))
                rewards[cut] += config.gamma * self.model.value(cut_rows.to(device))
            rollout.rewards[step] = rewards
            # An absent agent's row is done too, so that GAE never links steps across its absence.
            ends = torch.from_numpy(result.terminated | result.truncated).to(device)
            rollout.dones[step] = torch.maximum(ends.float(), 1 - rollout.mask[step])
            self.global_step += self.guard.batch_rows * self.guard.ranks.world_size
            ended += [(self.global_step, episode) for episode in result.episodes.values()]
        self.guard.after_rollout(ended)  # record the episodes; stop here on Ctrl-C
        return next_obs

    def estimate_advantages(self, next_obs: torch.Tensor):
        """GAE over the rollout: (advantages, returns), both [num_steps, rows]."""
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
        self.trainer.track_returns(returns, self.rollout.mask)  # for value normalisation
        batch_size = self.guard.batch_rows * config.num_steps
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
        stats["explained_variance"] = explained_variance(self.rollout.values, returns,
                                                         self.rollout.mask)
        # Under torchrun, the means over the ranks: rank 0 logs those of the global batch, and all
        # ranks see the same values when the guard checks them for NaN.
        return dict(zip(stats, ranks.mean(list(stats.values()))))


# ==== Below: speed, safety and scale. PPO is complete above. ======================================
#
# What follows makes the lesson fast, safe and scalable, and a reader of PPO may stop here: the
# envs, the worker pool and the rollout buffer, a faster Adam and compilation; `Ranks` (torchrun);
# `RunGuard` (set-up, Ctrl-C, failures, logging, summary); checkpoints; evaluation and video; the
# checks of the user's input; the command line.


# ----- The envs and the worker pool ---------------------------------------------------------------


class EnvSpec(typing.NamedTuple):
    """What the networks need to know of an env: its agents are alike (`inspect_env` checks)."""

    num_agents: int  # agent slots (possible_agents)
    obs_size: int  # numbers in one agent's observation
    num_actions: int  # choices of its Discrete action
    state_size: int  # numbers in the env's global state (0 when it gives none)


def find_env_module(env_id: str):
    """The module (or object) that `--env module.name` names: it must have `parallel_env()`, as
    every PettingZoo env has (mpe2.simple_spread_v3, pettingzoo.butterfly.pistonball_v6, ...)."""
    parent, _, name = env_id.rpartition(".")
    if not parent:
        raise UsageError(f"--env {env_id!r}: name a PettingZoo parallel env by module and name, "
                         f"e.g. mpe2.simple_spread_v3 (gymnasium envs: use ppo_cartpole.py)")
    try:
        module = importlib.import_module(env_id)
    except ModuleNotFoundError as error:
        missing = error.name or ""
        if missing != env_id and not env_id.startswith(missing + "."):
            raise UsageError(f"{env_id} needs the package {missing}: pip install it") from None
        try:
            module = getattr(importlib.import_module(parent), name, None)
        except ModuleNotFoundError:
            module = None
        if module is None:
            raise UsageError(f"unknown env {env_id!r}: no such module (PettingZoo envs are named "
                             f"like mpe2.simple_spread_v3)") from None
    if not callable(getattr(module, "parallel_env", None)):
        raise UsageError(f"{env_id} has no parallel_env(): this script plays PettingZoo parallel "
                         f"envs")
    return module


def make_env(env_id: str, env_kwargs: dict, render_mode: Optional[str] = None):
    """A PettingZoo parallel env. render_mode is passed only when asked for: envs without
    rendering need not accept it."""
    options = dict(env_kwargs, **({"render_mode": render_mode} if render_mode else {}))
    return find_env_module(env_id).parallel_env(**options)


def row_sizes(spec: EnvSpec, config: Config) -> tuple:
    """(policy columns, value columns, whole row) of a row (see `Game` and `Model`)."""
    ids = spec.num_agents if config.agent_id else 0
    policy_size = spec.obs_size + ids
    if not config.central_value:
        return policy_size, policy_size, policy_size
    value_size = spec.state_size + spec.num_agents
    return policy_size, value_size, policy_size + value_size


class StepResult(typing.NamedTuple):
    """What one step of all the envs gives the trainer besides the rows, by row (env * agents +
    slot)."""

    rewards: np.ndarray  # [rows]
    terminated: np.ndarray  # [rows] bool: the agent's episode ended in the game
    truncated: np.ndarray  # [rows] bool: a time limit cut the agent's episode
    present: np.ndarray  # [rows] bool: which agents are in their env now (the next rows)
    final_rows: dict  # row -> the last row of the agent whose episode ended there
    episodes: dict  # env index -> {"return", "team_return", "length"} of an episode that ended


class WorkerPool:
    """All the envs: num_workers Workers with num_envs / num_workers Games each (or all Games in
    this process with --num-workers 0). Their rows land in one [num_envs * num_agents, row size]
    array (shared memory when there are child processes), env-major: row e * num_agents + a holds
    agent a of env e. The trainer reads it as a tensor without copying. Env i is seeded with
    first_seed + i."""

    def __init__(self, config: Config, spec: EnvSpec, row_size: int, first_seed: int,
                 env_kwargs: dict, device: torch.device):
        self.device = device
        self.workers, self.shared_obs = [], None
        agents = spec.num_agents
        shape = (config.num_envs * agents, row_size)
        if config.num_workers == 0:
            self.obs_array = np.zeros(shape, dtype=np.float32)
        else:
            self.shared_obs = shared_memory.SharedMemory(create=True, size=int(np.prod(shape)) * 4)
            self.obs_array = np.ndarray(shape, dtype=np.float32, buffer=self.shared_obs.buf)
        envs_per_worker = config.num_envs // max(config.num_workers, 1)
        options = {"env_kwargs": env_kwargs, "agent_id": config.agent_id,
                   "central_value": config.central_value}
        try:
            for index in range(max(config.num_workers, 1)):
                first = index * envs_per_worker
                seeds = [first_seed + first + i for i in range(envs_per_worker)]
                rows = self.obs_array[first * agents:(first + envs_per_worker) * agents]
                worker = Worker(index, config.env, seeds, options, rows,
                                in_process=config.num_workers == 0,
                                inherited_trainer_ends=[w.trainer_end for w in self.workers
                                                        if not w.in_process])
                worker.first_env, worker.first_row = first, first * agents
                self.workers.append(worker)
        except BaseException:
            self.close()  # the workers started so far
            raise
        if self.shared_obs is not None:
            # The children have the memory mapped now, so its name is no longer needed: unlinking
            # it at once means no segment is ever left behind in /dev/shm, however this ends.
            self.shared_obs.unlink()
        self.obs_tensor = torch.from_numpy(self.obs_array)
        self.present_array = np.concatenate([worker.present for worker in self.workers])

    def observations(self) -> torch.Tensor:
        """The envs' current rows on the training device (no copy on the CPU)."""
        return self.obs_tensor.to(self.device)

    def present(self) -> torch.Tensor:
        """1.0 for each row whose agent is in its env now, 0.0 for an absent agent's."""
        return torch.from_numpy(self.present_array).to(self.device, torch.float32)

    def step(self, actions: np.ndarray) -> StepResult:
        """Step every env: send all workers their actions first, then collect, so that children
        run in parallel."""
        for worker in self.workers:
            worker.send_step(actions[worker.first_row:worker.first_row + len(worker.rows_view)])
        results = [worker.receive() for worker in self.workers]
        final_rows, episodes = {}, {}
        for worker, (*_, worker_final_rows, worker_episodes) in zip(self.workers, results):
            final_rows.update({worker.first_row + i: row for i, row in worker_final_rows.items()})
            episodes.update({worker.first_env + i: episode
                             for i, episode in worker_episodes.items()})
        rewards, terminated, truncated, present = (np.concatenate(part)
                                                   for part in list(zip(*results))[:4])
        self.present_array = present
        return StepResult(rewards, terminated, truncated, present, final_rows, episodes)

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
    """The rollout buffer: one row per step and agent of each env, on the training device."""

    def __init__(self, config: Config, batch_rows: int, row_size: int, device: torch.device):
        shape = (config.num_steps, batch_rows)
        self.obs = torch.zeros(shape + (row_size,), device=device)
        self.actions = torch.zeros(shape, dtype=torch.long, device=device)
        self.log_probs = torch.zeros(shape, device=device)
        self.values = torch.zeros(shape, device=device)
        self.rewards = torch.zeros(shape, device=device)
        self.dones = torch.zeros(shape, device=device)
        self.mask = torch.zeros(shape, device=device)

    def minibatch(self, indices: torch.Tensor, advantages, returns) -> Minibatch:
        """The rows of flat indices (step * rows + env * num_agents + slot)."""
        return Minibatch(self.obs.flatten(0, 1)[indices], self.actions.flatten()[indices],
                         self.log_probs.flatten()[indices], advantages.flatten()[indices],
                         returns.flatten()[indices], self.values.flatten()[indices],
                         self.mask.flatten()[indices])


class Adam:
    """Adam (Kingma & Ba, 2015), computing exactly what `torch.optim.Adam` computes, in a few lines.

    Why not torch.optim.Adam: constructing the first torch.optim optimizer imports torch._dynamo,
    which costs about a second, a share of a short run worth saving.
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


def compile_learner(model: Model, trainer: Trainer, config: Config, row_size: int,
                    batch_rows: int, device: torch.device):
    """torch.compile fuses the small layers into fewer kernels, for the rollout's inference and for
    the loss (its backward is compiled with it). It costs seconds to compile, which networks this
    small never earn back, hence off by default. Compiling the bound methods, not the modules,
    keeps the checkpoint's parameter names as they are. Both are compiled here, on inputs of the
    sizes they will see, so that a machine that cannot compile falls back to eager at once, with a
    warning."""
    networks = (model.actor, model.critic)
    eager_forwards, eager_loss = [network.forward for network in networks], trainer.compute_loss
    minibatch_size = batch_rows * config.num_steps // config.num_minibatches
    try:
        for network, forward in zip(networks, eager_forwards):
            network.forward = torch.compile(forward)
        trainer.compute_loss = torch.compile(eager_loss)
        with torch.no_grad():
            model.act(torch.zeros(batch_rows, row_size, device=device))
        zeros = torch.zeros(minibatch_size, device=device)
        actions = torch.zeros(minibatch_size, dtype=torch.long, device=device)
        rows = torch.zeros(minibatch_size, row_size, device=device)
        minibatch = Minibatch(rows, actions, zeros, zeros + 1, zeros, zeros, zeros + 1)
        loss, _ = trainer.compute_loss(minibatch)
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

    `torchrun --nproc_per_node N ppo_multiagent.py ...` (or any torch.distributed launcher, over
    several machines too) starts N copies of this script and tells each its rank and the world size
    in the environment (RANK, WORLD_SIZE, LOCAL_RANK). This is data parallelism, as in CleanRL's
    multi-GPU PPO (ppo_atari_multigpu.py): each rank plays its own --num-envs envs (env i of rank r
    gets seed + r * num_envs + i), collects its own rollout and splits it into its own
    --num-minibatches; but before each gradient step the ranks average their gradients, so all take
    the same step and hold the same weights.
    - The global batch of an update is world_size x num_envs x agents x num_steps agent steps.
      --total-timesteps, the learning-rate schedule and --checkpoint-every count those of all ranks.
    - A gradient step sees world_size x (num_envs x agents x num_steps / num_minibatches) samples,
      and an update still takes update_epochs x num_minibatches steps.
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
        self.main = main
        self.previous_threads = torch.get_num_threads()
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
        self.env_kwargs = parse_env_kwargs(config.env_kwargs)
        self.spec = inspect_env(config.env, self.env_kwargs, config.central_value)
        check_batch(config, self.spec.num_agents)
        self.policy_size, self.value_size, self.row_size = row_sizes(self.spec, config)
        self.batch_rows = config.num_envs * self.spec.num_agents  # rows of one step of all envs
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
        # One thread is fastest for networks this small: splitting a 64-unit layer over threads
        # costs more than it saves. Given back when the run ends.
        torch.set_num_threads(1)
        # The last 100 episodes: return per agent (the mean over its agents), the team's, length.
        self.recent_returns, self.recent_lengths = deque(maxlen=100), deque(maxlen=100)
        self.recent_team_returns = deque(maxlen=100)
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
            compile_learner(main.model, main.trainer, config, self.row_size, self.batch_rows,
                            self.device)
        self.last_good_learner = copy.deepcopy(learner_state(main))  # what a NaN falls back to
        self.last_checkpoint_step = main.global_step
        self.writer = make_writer(self.run_dir, config) if self.ranks.rank == 0 else None
        return main.global_step

    def start_games(self) -> WorkerPool:
        """The envs of this rank: env i of rank r is seeded with seed + r * num_envs + i."""
        config = self.config
        first_seed = config.seed + self.ranks.rank * config.num_envs
        self.games = WorkerPool(config, self.spec, self.row_size, first_seed, self.env_kwargs,
                                self.device)
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
        self.recent_team_returns.append(episode["team_return"])
        self.recent_lengths.append(episode["length"])
        if self.writer is not None:
            self.writer.add_scalar("charts/episodic_return", episode["return"], step)
            self.writer.add_scalar("charts/team_return", episode["team_return"], step)
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
        mean = lambda values: f"{np.mean(values):.2f}" if values else "-"
        env_steps = step // self.spec.num_agents
        print(f"step {step:,}/{total:,} ({100 * step / total:.1f}%) | env steps {env_steps:,} | "
              f"{speed:,.0f} steps/s | eta {eta} | return per agent {mean(self.recent_returns)} "
              f"| team {mean(self.recent_team_returns)} | length {mean(self.recent_lengths)} | "
              f"updates {self.updates}"
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
            "mean_team_return_100": (float(np.mean(self.recent_team_returns))
                                     if self.recent_team_returns else None),
            "env_steps": self.main.global_step // self.spec.num_agents,
            "num_agents": self.spec.num_agents,
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


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """1 when the value function predicts the returns perfectly, 0 when not at all, over the rows
    of present agents. A constant return leaves nothing to explain: 0."""
    present = mask > 0
    values, returns = values[present], returns[present]
    if len(returns) < 2:
        return 0.0
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
        "script": SCRIPT, "env": main.config.env, "env_kwargs": main.config.env_kwargs,
        "spec": list(guard.spec), "config": dataclasses.asdict(main.config),
        "model": main.model.state_dict(), "optimizer": main.trainer.optimizer.state_dict(),
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
    fixed = ("env", "env_kwargs", "hidden_size", "agent_id", "central_value")
    for f in fields:
        value = getattr(given, f.name)
        if value != f.default:
            if f.name in fixed and value != saved.get(f.name):
                raise UsageError(f"the checkpoint was trained with --{f.name.replace('_', '-')} "
                                 f"{saved.get(f.name)}, not {value}")
            config = dataclasses.replace(config, **{f.name: value})
    return config


# ----- Evaluation and video -----------------------------------------------------------------------


@torch.no_grad()
def evaluate_checkpoint(given: Config) -> dict:
    """--eval: play --eval-episodes episodes with a checkpoint's policy (every agent playing it)
    and report the return per agent and per team."""
    checkpoint = load_checkpoint(given.eval)
    config = resumed_config(checkpoint, given)
    check_settings(config)
    if config.eval_episodes <= 0:
        raise UsageError("--eval-episodes must be positive")
    env_kwargs = parse_env_kwargs(config.env_kwargs)
    spec = inspect_env(config.env, env_kwargs, config.central_value)
    policy_size, value_size, _ = row_sizes(spec, config)
    model = Model(policy_size, value_size, spec.num_actions, config.central_value,
                  config.hidden_size)
    model.load_state_dict(checkpoint["model"])
    torch.manual_seed(config.seed)
    run_dir = Path(given.run_dir) if given.run_dir else Path(config.eval).parent
    try:
        game = Game(config.env, config.seed, env_kwargs, config.agent_id, config.central_value,
                    render_mode="rgb_array" if config.video else None)
    except Exception as error:
        raise UsageError(f"cannot make {config.env} for --video: {type(error).__name__}: "
                         f"{error}") from None
    video = None
    rows = game.reset()
    returns, team_returns = [], []
    try:
        while len(returns) < config.eval_episodes:
            if config.video:
                video = write_frame(video, game, run_dir / "eval.mp4")
            actions, _, _ = model.act(torch.from_numpy(rows), greedy=config.greedy)
            rows, _, _, _, info = game.step(actions.numpy())
            if "episode" in info:
                returns.append(info["episode"]["return"])
                team_returns.append(info["episode"]["team_return"])
    finally:
        game.close()
        if video is not None:
            video.release()
    mean, std = float(np.mean(returns)), float(np.std(returns))
    team_mean, team_std = float(np.mean(team_returns)), float(np.std(team_returns))
    how = "greedy" if config.greedy else "sampled"
    print(f"eval {config.env}: return per agent {mean:.2f} ± {std:.2f}, per team "
          f"{team_mean:.2f} ± {team_std:.2f} over {len(returns)} episodes ({how} actions)")
    if video is not None:
        print(f"video: {run_dir / 'eval.mp4'}")
    return {"script": SCRIPT, "env": config.env, "episodes": len(returns), "mean_return": mean,
            "std_return": std, "mean_team_return": team_mean, "std_team_return": team_std,
            "returns": returns, "team_returns": team_returns, "greedy": config.greedy,
            "video": str(run_dir / "eval.mp4") if video is not None else None}


def write_frame(video, game: Game, path: Path):
    """Append the env's current picture to the mp4 (OpenCV's VideoWriter, opened at the first
    frame)."""
    import cv2  # only --video needs OpenCV

    frame = game.render()
    if frame is None:
        raise UsageError(f"{game.env.metadata.get('name', 'the env')} draws no picture: "
                         f"--video needs an env with render_mode 'rgb_array'")
    if video is None:
        path.parent.mkdir(parents=True, exist_ok=True)
        fps = game.env.metadata.get("render_fps", 10)
        video = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), fps,
                                (frame.shape[1], frame.shape[0]))
        if not video.isOpened():
            raise UsageError(f"OpenCV cannot write {path}")
    video.write(cv2.cvtColor(np.ascontiguousarray(frame), cv2.COLOR_RGB2BGR))
    return video


# ----- Checking the input -------------------------------------------------------------------------


class UsageError(ValueError):
    """Bad input from the user: the command line prints its message on one line, exit status 2."""


def check_settings(config: Config):
    """Refuse settings that cannot work, with one line that says what to change."""
    for name in ("total_timesteps", "num_envs", "num_steps", "num_minibatches", "update_epochs",
                 "hidden_size", "checkpoint_every"):
        if getattr(config, name) <= 0:
            raise UsageError(f"--{name.replace('_', '-')} must be positive, not "
                             f"{getattr(config, name)}")
    if config.num_workers < 0:
        raise UsageError(f"--num-workers must be 0 (envs in this process) or more, not "
                         f"{config.num_workers}")
    if config.num_workers and config.num_envs % config.num_workers:
        raise UsageError(f"--num-workers {config.num_workers} must divide --num-envs "
                         f"{config.num_envs}")


def check_batch(config: Config, num_agents: int):
    """The batch of a rollout, num_envs x agents x num_steps rows, must split into minibatches."""
    batch_size = config.num_envs * num_agents * config.num_steps
    if batch_size % config.num_minibatches:
        raise UsageError(f"the batch of {batch_size} agent steps (--num-envs x {num_agents} agents "
                         f"x --num-steps) does not split into --num-minibatches "
                         f"{config.num_minibatches}")
    if batch_size // config.num_minibatches < 2:
        raise UsageError(f"minibatches of {batch_size // config.num_minibatches} step cannot be "
                         f"normalised: raise --num-envs or --num-steps, or lower --num-minibatches")


def parse_env_kwargs(text: str) -> dict:
    """--env-kwargs "N=5,local_ratio=0.3" -> {"N": 5, "local_ratio": 0.3}: each value read as a
    Python literal (numbers, True, None, ...), else kept as a string."""
    options = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, equals, value = (part.strip() for part in item.partition("="))
        if not equals or not key.isidentifier():
            raise UsageError(f"--env-kwargs {text!r}: write name=value pairs separated by commas, "
                             f"e.g. N=5,local_ratio=0.3")
        try:
            options[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            options[key] = value
    return options


def inspect_env(env_id: str, env_kwargs: dict, central_value: bool) -> EnvSpec:
    """Check that the env exists and that one shared policy can play it: every agent with the same
    vector observation space and the same Discrete action space."""
    module = find_env_module(env_id)
    try:
        env = module.parallel_env(**env_kwargs)
        env.reset(seed=0)
    except Exception as error:
        options = f" with --env-kwargs {env_kwargs}" if env_kwargs else ""
        raise UsageError(f"cannot make {env_id}{options}: {type(error).__name__}: "
                         f"{str(error).splitlines()[0] if str(error) else ''}") from None
    try:
        agents = list(env.possible_agents)
        obs_spaces = [env.observation_space(agent) for agent in agents]
        action_spaces = [env.action_space(agent) for agent in agents]
        for agent, obs_space, action_space in zip(agents, obs_spaces, action_spaces):
            if obs_space != obs_spaces[0] or action_space != action_spaces[0]:
                raise UsageError(
                    f"{env_id} has agents of different kinds ({agents[0]}: {obs_spaces[0]}, "
                    f"{action_spaces[0]}; {agent}: {obs_space}, {action_space}): one shared "
                    f"policy needs every agent to observe and act alike")
        obs_space, action_space = obs_spaces[0], action_spaces[0]
        if isinstance(action_space, gym.spaces.Box):
            raise UsageError(f"{env_id} has continuous {action_space} actions: a Gaussian policy "
                             f"for Box actions is ppo_continuous.py's (single agent); here, "
                             f"choose discrete actions (MPE2: continuous_actions=False)")
        if not isinstance(action_space, gym.spaces.Discrete):
            raise UsageError(f"{env_id} has a {action_space} action space; this script handles "
                             f"Discrete actions")
        if not isinstance(obs_space, gym.spaces.Box):
            raise UsageError(f"{env_id} has a {type(obs_space).__name__} observation space; this "
                             f"script needs a Box (a vector of numbers)")
        state_size = 0
        if central_value:
            try:
                state_size = int(np.asarray(env.state()).size)
            except Exception:
                raise UsageError(f"{env_id} gives no global state (state()), which "
                                 f"--central-value needs: pass --no-central-value") from None
        return EnvSpec(len(agents), int(np.prod(obs_space.shape)), int(action_space.n),
                       state_size)
    finally:
        env.close()


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
