"""PPO for games with vector observations and discrete actions (CartPole and friends), in one file.

Proximal Policy Optimization (Schulman et al., 2017, "PPO paper") with the implementation details of
CleanRL and Stable-Baselines3 ("The 37 Implementation Details of PPO", Huang et al., 2022, "37 details").
Read it top to bottom, in five parts:

1. `Game`    - one gymnasium environment: flat float32 observations, episode bookkeeping,
               termination kept apart from truncation.
2. `Worker`  - runs several Games, in a child process (observations through shared memory) or here.
3. `Model`   - the actor-critic: two separate 64-64 tanh MLPs, one categorical per action dimension.
4. `Trainer` - one clipped PPO update on a minibatch.
5. `Main`    - the loop: rollout, GAE, epochs of minibatches, logging, checkpoints, evaluation.

Run it:      python ppo_cartpole.py                   (CartPole-v1; --help lists every flag)
On N GPUs:   torchrun --standalone --nproc_per_node N ppo_cartpole.py     (data parallel: see `Ranks`)
In a notebook:  from ppo_cartpole import Config, Main; Main(Config(total_timesteps=50_000)).run()
"""

import argparse
import copy
import dataclasses
import difflib
import hashlib
import json
import math
import multiprocessing
import multiprocessing.connection
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

import gymnasium as gym
import numpy as np
import torch
import torch.distributed as dist  # already loaded by `import torch`: costs nothing more
import torch.nn as nn
from gymnasium.envs.classic_control.cartpole import CartPoleVectorEnv
from gymnasium.vector import AutoresetMode

SCRIPT = "ppo_cartpole"
CARTPOLE_VECTOR_ENTRY_POINT = "gymnasium.envs.classic_control.cartpole:CartPoleVectorEnv"


def option(default, help):
    """A Config field with its one-line explanation, which `--help` prints."""
    return field(default=default, metadata={"help": help})


@dataclass
class Config:
    """Every setting of a run. Each field is also a command-line flag (`num_envs` -> `--num-envs`)."""

    # The game and the run.
    env: str = option("CartPole-v1", "gymnasium id: Box observation; Discrete, MultiDiscrete or MultiBinary action")
    seed: int = option(1, "seeds python, numpy, torch and every env (env i of rank r gets seed + r * num_envs + i)")
    total_timesteps: int = option(200_000, "environment steps over all envs (of all ranks, under torchrun)")
    device: str = option("auto", "auto | cpu | cuda: auto takes CUDA when present")
    run_dir: typing.Optional[str] = option(None, "logs, checkpoint and summary go here (default runs/<env>__<script>__<seed>__<time>)")
    target_return: typing.Optional[float] = option(None, "stop once the mean return of the last 100 episodes reaches this")
    checkpoint_every: int = option(100_000, "save a checkpoint every this many steps (and always at the end)")
    resume: typing.Optional[str] = option(None, "continue training from this checkpoint")
    eval: typing.Optional[str] = option(None, "no training: play --eval-episodes games with this checkpoint")
    eval_episodes: int = option(10, "games played by --eval")
    greedy: bool = option(False, "with --eval, take the most likely action instead of sampling")
    video: bool = option(False, "with --eval, write an mp4 of the games into the run dir")
    compile: bool = option(False, "torch.compile the model; off: compiling takes longer than solving CartPole")

    # Collecting experience.
    num_envs: int = option(64, "games played side by side (by each rank, under torchrun)")
    # 0 is fastest for CartPole: stepping 64 vectorised poles takes ~60 us, less than a pipe round trip to a
    # child. Measured here (2 cores, 81,920 steps): 41-44k steps/s with 0 workers, 28-29k with 1, 24-28k with 2.
    num_workers: int = option(0, "child processes that run the games (0 = in this process)")
    num_steps: int = option(32, "steps per game in each rollout; a rollout is num_envs * num_steps steps")

    # The PPO update.
    learning_rate: float = option(8e-3, "Adam step size at the start, annealed linearly to 0")
    anneal_lr: bool = option(True, "anneal the learning rate linearly to 0 over the run")
    gamma: float = option(0.98, "discount factor: 0.98 looks ~50 steps ahead, enough to keep a pole up")
    gae_lambda: float = option(0.95, "GAE lambda: bias (0) vs variance (1) of the advantage")
    num_minibatches: int = option(2, "minibatches each rollout is split into")
    update_epochs: int = option(8, "passes over each rollout")
    clip_coef: float = option(0.2, "PPO's clip range for the probability ratio")
    clip_value_loss: bool = option(False, "clip the value update too (off: it slows CartPole, see Trainer)")
    # Steps to solve CartPole-v1, seeds 1-3, with the other defaults: 80-86k as set; ent_coef 0.01:
    # 80-88k, target_kl 0.02: 80-84k, neither a measurable gain. Hence 0 and None.
    ent_coef: float = option(0.0, "weight of the entropy bonus")
    vf_coef: float = option(0.5, "weight of the value loss")
    max_grad_norm: float = option(0.5, "clip the global gradient norm to this")
    target_kl: typing.Optional[float] = option(None, "stop an update's epochs early once the approximate KL passes this")
    hidden_size: int = option(64, "units in each of the two hidden layers of both MLPs")


class UsageError(ValueError):
    """Bad input from the user: the command line prints its message on one line and exits with status 2."""


class SameStepCartPole(CartPoleVectorEnv):
    """gymnasium's vectorised CartPole, which steps all its poles in a few numpy operations (64 of them
    in about the time a Python loop takes for 10 single envs), made to restart an ended episode in the
    same step.

    The library's version restarts an ended pole at the *next* call of `step`, ignoring that call's
    action ("next-step" autoreset). Here the restart happens at once, with the very same random draw the
    library would make one step later, so that `step` returns the first observation of the new episode
    and the last one of the old in `info["final_obs"]`, like gymnasium's SyncVectorEnv in same-step mode.
    tests/ check this against the library's own CartPoleVectorEnv, step by step.
    """

    metadata = {**CartPoleVectorEnv.metadata, "autoreset_mode": AutoresetMode.SAME_STEP}

    def step(self, action):
        obs, reward, terminated, truncated, info = super().step(action)
        ended = self.prev_done  # the poles the library would restart at its next step
        if ended.any():
            info = {"final_obs": obs.copy(), "_final_obs": ended.copy()}
            self.state[:, ended] = self.np_random.uniform(low=self.low, high=self.high, size=(4, ended.sum()))
            self.steps[ended] = 0
            self.prev_done = np.zeros_like(ended)
            obs = self.state.T.astype(np.float32)
        return obs, reward, terminated, truncated, info


class Game:
    """A batch of `num_envs` copies of one gymnasium environment, stepped together (the batch form of
    GUIDE.md section 4: every value is an array over the batch).

    - Observations come out flat, as float32 rows, whatever the Box's shape.
    - When an episode ends, its env restarts in the same step: `step` returns the first observation of
      the next episode, and the last one of the ended episode in `info["final_obs"]` (`info["_final_obs"]`
      marks which rows hold one), so the trainer can still bootstrap from it when the episode was only
      truncated (cut by a time limit, not ended by the game).
    - It counts the return and length of each episode and reports them when one ends, in
      `info["episode"]` (marked by `info["_episode"]`).

    CartPole runs on `SameStepCartPole` above; every other env on gymnasium's SyncVectorEnv, a loop over
    single envs, in its same-step autoreset mode. The batch shares one random generator in the first
    case and seeds env i with seed + i in the second.
    """

    def __init__(self, env_id: str, seed: int, num_envs: int = 1, render_mode: typing.Optional[str] = None):
        spec = gym.spec(env_id)
        if spec.vector_entry_point == CARTPOLE_VECTOR_ENTRY_POINT:
            self.envs = SameStepCartPole(num_envs, max_episode_steps=spec.max_episode_steps,
                                         render_mode=render_mode, **spec.kwargs)
        else:
            # render_mode is passed only when asked for: envs without rendering need not accept it.
            self.envs = gym.make_vec(env_id, num_envs, vectorization_mode="sync",
                                     vector_kwargs={"autoreset_mode": AutoresetMode.SAME_STEP},
                                     **({"render_mode": render_mode} if render_mode else {}))
        self.seed = seed
        self.num_envs = num_envs
        self.action_space = self.envs.single_action_space
        self.episode_returns = np.zeros(num_envs)
        self.episode_lengths = np.zeros(num_envs, dtype=np.int64)

    def reset(self) -> np.ndarray:
        # Seed only the first reset: later restarts continue the envs' own random streams, so each
        # episode differs and the whole run is still fixed by the seed.
        obs, _ = self.envs.reset(seed=self.seed)
        self.seed = None
        self.episode_returns[:] = 0
        self.episode_lengths[:] = 0
        return self.flat(obs)

    def step(self, actions: np.ndarray):
        obs, rewards, terminated, truncated, env_info = self.envs.step(self.env_actions(actions))
        self.episode_returns += rewards
        self.episode_lengths += 1
        info = {}
        ended = terminated | truncated
        if ended.any():
            info["_final_obs"] = info["_episode"] = ended
            info["final_obs"] = np.zeros_like(self.flat(obs))
            info["final_obs"][ended] = self.flat(np.stack(env_info["final_obs"][ended]))
            info["episode"] = {"return": self.episode_returns.copy(), "length": self.episode_lengths.copy()}
            self.episode_returns[ended] = 0
            self.episode_lengths[ended] = 0
        return self.flat(obs), rewards.astype(np.float32), terminated, truncated, info

    @staticmethod
    def flat(obs) -> np.ndarray:
        """A batch of observations as float32 rows, whatever their Box's shape: [batch, obs_size]."""
        obs = np.asarray(obs, dtype=np.float32)
        return obs.reshape(len(obs), -1)

    def env_actions(self, actions: np.ndarray):
        """The model picks one index per action dimension, counting from 0: [num_envs, dims]. The envs
        want their own form."""
        space = self.action_space
        if isinstance(space, gym.spaces.Discrete):
            return actions[:, 0] + space.start
        if isinstance(space, gym.spaces.MultiDiscrete):
            return (actions.reshape(-1, *space.shape) + space.start).astype(space.dtype)
        return actions.reshape(-1, *space.shape).astype(space.dtype)  # MultiBinary

    def render(self) -> np.ndarray:
        """The picture of the first env of the batch."""
        return self.envs.render()[0]

    def close(self):
        self.envs.close()


def step_game(game: Game, actions: np.ndarray, obs_out: np.ndarray):
    """Step the Game, write the next observations into `obs_out`, and return what the trainer needs
    besides: rewards, terminations, truncations, and two dicts keyed by env index: the final
    observations of the episodes that ended, and their statistics."""
    obs_out[:], rewards, terminated, truncated, info = game.step(actions)
    final_obs, episodes = {}, {}
    for i in np.flatnonzero(info.get("_final_obs", ())):
        final_obs[i] = info["final_obs"][i]
        episodes[i] = {"return": float(info["episode"]["return"][i]), "length": int(info["episode"]["length"][i])}
    return rewards, terminated, truncated, final_obs, episodes


class WorkerError(RuntimeError):
    """A worker process died or one of its Games raised: the run stops with this message."""


class Worker:
    """Runs a Game (a batch of envs), either in a child process or, with `in_process=True`, right here.

    The trainer and a child talk through a `multiprocessing` pipe: the trainer sends the actions, the
    child steps its Game and answers with rewards, flags and finished-episode statistics. Observations,
    the one large array, do not go through the pipe: the child writes them straight into shared memory
    (`obs_view`, a numpy view over a `multiprocessing.shared_memory` block that the trainer reads as a
    torch tensor without a copy).

    Children are started with `fork`: they inherit the shared memory mapping and start in milliseconds,
    instead of importing torch again as `spawn` would. A child ignores SIGINT (a terminal's Ctrl-C
    reaches every process of the group; the trainer decides how to stop) and exits by itself when the
    trainer's end of its pipe closes, so a trainer that dies, however, never leaves a worker behind.
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
        # A forked child holds copies of every pipe end the trainer had. Closing the trainer's ends makes
        # a recv() here fail with EOFError as soon as the trainer is gone.
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

    def receive(self, timeout: float = 120.0):
        """The result of the last `send_step`. Waits on the pipe and on the process at once, so a child
        that dies is noticed at once instead of blocking `recv()` forever."""
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
        if not ready:
            raise WorkerError(f"worker {self.index} ({self.env_id}) did not answer within {timeout:.0f} s")
        self.process.join(timeout=1.0)
        code = self.process.exitcode
        how = (f"killed by signal {signal.Signals(-code).name}" if code is not None and code < 0
               else f"exit code {code}")
        raise WorkerError(f"worker {self.index} ({self.env_id}) died ({how})")

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
    hidden layers get sqrt(2), the policy output 0.01 so that all actions start equally likely, the value
    output 1)."""
    linear = nn.Linear(in_size, out_size)
    nn.init.orthogonal_(linear.weight, gain)
    nn.init.zeros_(linear.bias)
    return linear


class Model(nn.Module):
    """The actor-critic: a policy MLP and a separate value MLP, both 64-64 tanh (37 details, #13:
    separate networks work better than a shared body on these small games).

    The action may have several dimensions (MultiDiscrete, MultiBinary): the policy outputs one
    categorical distribution per dimension, and the log-probability (entropy) of a whole action is the
    sum over its dimensions, as if the dimensions were chosen independently (37 details, #23). A binary
    dimension is a Bernoulli with logit l, which is exactly a categorical over {0, 1} with logits (0, l),
    so binary actions reuse the categorical code. Dimensions with fewer choices than the largest are
    padded with a logit of -1e9: probability 0, and 0 * log-probability stays 0 (not NaN) in the entropy.
    """

    def __init__(self, obs_size: int, action_dims: list, binary: bool, hidden_size: int = 64):
        super().__init__()
        self.action_dims, self.binary = list(action_dims), binary
        self.num_choices = max(self.action_dims)
        outputs = len(self.action_dims) if binary else len(self.action_dims) * self.num_choices
        self.critic = nn.Sequential(
            layer(obs_size, hidden_size), nn.Tanh(),
            layer(hidden_size, hidden_size), nn.Tanh(),
            layer(hidden_size, 1, gain=1.0))
        self.actor = nn.Sequential(
            layer(obs_size, hidden_size), nn.Tanh(),
            layer(hidden_size, hidden_size), nn.Tanh(),
            layer(hidden_size, outputs, gain=0.01))
        padding = torch.zeros(len(self.action_dims), self.num_choices)
        for dim, choices in enumerate(self.action_dims):
            padding[dim, choices:] = -1e9
        self.register_buffer("logit_padding", padding)

    def value(self, obs: torch.Tensor) -> torch.Tensor:
        return self.critic(obs).squeeze(-1)

    def logits(self, obs: torch.Tensor) -> torch.Tensor:
        """Log-probabilities, up to a constant, of every choice of every dimension: [batch, dims, choices]."""
        out = self.actor(obs)
        if self.binary:
            return torch.stack([torch.zeros_like(out), out], dim=-1)
        return out.view(-1, len(self.action_dims), self.num_choices) + self.logit_padding

    def act(self, obs: torch.Tensor, greedy: bool = False):
        """Choose actions for a batch of observations: (actions [batch, dims], their log-probabilities,
        the values of the observations)."""
        log_probs = torch.log_softmax(self.logits(obs), dim=-1)
        if greedy:
            actions = log_probs.argmax(-1)
        else:
            actions = torch.multinomial(log_probs.exp().view(-1, self.num_choices), 1).view(log_probs.shape[:-1])
        log_prob = log_probs.gather(-1, actions.unsqueeze(-1)).sum((-1, -2))
        return actions, log_prob, self.value(obs)

    def evaluate(self, obs: torch.Tensor, actions: torch.Tensor):
        """For the update: log-probabilities of the taken actions under the current policy, the entropy
        of the policy, and the values, all [batch]."""
        log_probs = torch.log_softmax(self.logits(obs), dim=-1)
        log_prob = log_probs.gather(-1, actions.unsqueeze(-1)).sum((-1, -2))
        entropy = -(log_probs.exp() * log_probs).sum((-1, -2))
        return log_prob, entropy, self.value(obs)


def compute_gae(rewards, values, dones, last_value, gamma: float, gae_lambda: float) -> torch.Tensor:
    """Generalized Advantage Estimation (Schulman et al., 2016; PPO paper, eq. 11-12).

    rewards, values, dones: [T, N] (time, env); last_value: [N], the value of the observation after the
    last step. `dones[t] = 1` when the episode ended at step t, after action t, by termination or
    truncation; for a truncated episode the trainer has already added gamma * V(final observation) to
    rewards[t], so cutting the sum there is right in both cases. Returns the advantages [T, N]; the
    value targets are advantages + values.

    Readers who know CleanRL: its `dones[t]` means "obs[t] starts a new episode", one step later than
    here; the two give the same advantages.

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


class Adam:
    """Adam (Kingma & Ba, 2015), computing exactly what `torch.optim.Adam` computes, in a few lines.

    Why not torch.optim.Adam: constructing the first torch.optim optimizer imports torch._dynamo, which
    took 1.3 s here, a third of the time this script needs to solve CartPole. tests/ check this class
    against torch.optim.Adam step by step. Adam keeps running averages of each gradient (m) and of its
    square (v), corrects their bias towards 0 in the first steps, and moves each weight by
    lr * m_hat / (sqrt(v_hat) + eps). eps is 1e-5, not 1e-8 (37 details, #3).
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
        # $w \leftarrow w - \frac{lr}{1 - \beta_1^t} \, m / (\sqrt{v} / \sqrt{1 - \beta_2^t} + \epsilon)$
        denominators = torch._foreach_sqrt(self.exp_avg_sq)
        torch._foreach_div_(denominators, bias_correction2_sqrt)
        torch._foreach_add_(denominators, self.eps)
        torch._foreach_addcdiv_(self.params, self.exp_avg, denominators, -self.lr / bias_correction1)

    def state_dict(self) -> dict:
        return {"steps": self.steps, "lr": self.lr, "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}

    def load_state_dict(self, state: dict):
        self.steps, self.lr = int(state["steps"]), float(state["lr"])
        for mine, saved in zip(self.exp_avg + self.exp_avg_sq, state["exp_avg"] + state["exp_avg_sq"]):
            mine.copy_(saved)


class RankError(RuntimeError):
    """Under torchrun: another rank is gone (a collective failed), or the ranks' weights differ at the end."""


class Ranks:
    """The processes ("ranks") of one run started by torchrun, and the few things they do together.

    `torchrun --nproc_per_node N ppo_cartpole.py ...` (or any torch.distributed launcher, over several
    machines too) starts N copies of this script and tells each its rank and the world size in the
    environment (RANK, WORLD_SIZE, LOCAL_RANK). This is data parallelism, as in CleanRL's multi-GPU PPO
    (ppo_atari_multigpu.py): each rank plays its own --num-envs games (env i of rank r gets seed + r *
    num_envs + i), collects its own rollout and splits it into its own --num-minibatches; but before each
    gradient step the ranks average their gradients, so all take the same step and hold the same weights.
    - The global batch of an update is world_size x num_envs x num_steps steps. --total-timesteps, the
      learning-rate schedule and --checkpoint-every count the steps of all ranks.
    - A gradient step sees world_size x (num_envs x num_steps / num_minibatches) samples, and an update still
      takes update_epochs x num_minibatches steps.
    - To keep the hyperparameters of a 1-GPU run equivalent on N GPUs, divide --num-envs by N: the same
      global batch, minibatches and steps, in 1/N of the time. Keeping --num-envs makes the batch and the
      minibatches N times larger, and the run N times fewer updates for the same --total-timesteps.
    Every decision to stop (Ctrl-C, --target-return, --target-kl, a non-finite loss) is taken from values
    all ranks share, so no rank waits in a collective the others skipped. Only rank 0 writes files.

    Without torchrun it is a world of one: no process group, and every method returns at once, so a run
    alone is exactly what it was before this class existed.
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
                raise UsageError(f"rank {self.rank} wants GPU {local_rank}, but its machine has {gpus}: "
                                 f"lower --nproc_per_node")
            self.device = torch.device("cuda", local_rank)
            torch.cuda.set_device(self.device)
        try:
            # NCCL moves CUDA tensors between GPUs directly; gloo moves CPU tensors over TCP.
            dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo")
        except (RuntimeError, ValueError) as error:
            raise UsageError(f"WORLD_SIZE is set, but joining the other ranks failed "
                             f"({str(error).splitlines()[0]}): start the script with torchrun") from None

    def collective(self, operation, *args):
        """Run one torch.distributed operation. When another rank has died, gloo raises here (its connection
        closed): this rank then stops with one line (RankError), not a traceback."""
        try:
            return operation(*args)
        except RuntimeError as error:
            cause = str(error).splitlines()[0] if str(error) else type(error).__name__
            cause = cause.split("] ", 1)[-1].split(". ")[0]  # drop the C++ file and line of gloo's message
            raise RankError(f"rank {self.rank} lost contact with the other ranks ({cause})") from None

    def average_gradients(self, parameters):
        """Replace each gradient with its mean over the ranks: one all-reduce of all gradients flattened into
        one vector. Why not DistributedDataParallel: DDP overlaps the exchange with the backward pass, which
        pays for big networks; here one small message per minibatch is as fast, keeps the averaging in
        sight in Trainer.update (before the clip, so every rank clips the same global gradient), and fits
        the hand-written Adam, which reads each parameter's .grad."""
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
        """Raise RankError on every rank unless every rank holds bitwise the same tensors as rank 0 (the
        weights at the end of a run: a difference means the ranks trained different networks)."""
        if not self.distributed:
            return
        digest = hashlib.sha256(b"".join(tensor.detach().cpu().numpy().tobytes() for tensor in tensors))
        digests = self.gather(digest.hexdigest())
        differ = [rank for rank, other in enumerate(digests) if other != digests[0]]
        if differ:
            raise RankError(f"the weights of rank {', '.join(map(str, differ))} differ from rank 0's at the "
                            f"end of the run")

    def close(self):
        if self.distributed and dist.is_initialized():
            dist.destroy_process_group()


class Trainer:
    """One PPO update on one minibatch: the clipped surrogate objective, the value loss, the entropy
    bonus, and a gradient step with the global gradient norm clipped (on the gradient averaged over the
    ranks, under torchrun)."""

    def __init__(self, model: Model, config: Config, ranks: typing.Optional[Ranks] = None):
        self.model, self.config, self.ranks = model, config, ranks
        self.optimizer = Adam(model.parameters(), lr=config.learning_rate, eps=1e-5)

    @staticmethod
    def loss(new_log_prob, old_log_prob, advantages, new_value, old_value, returns, entropy, config: Config):
        """The PPO loss and its diagnostics, from the pieces of one minibatch (all [batch])."""
        # Advantage normalisation per minibatch (37 details, #7): the same step size suits every game.
        # Under torchrun, each rank normalises its own minibatch, as CleanRL's multi-GPU PPO does.
        advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)

        # The clipped surrogate (PPO paper, eq. 7): the probability ratio r = pi_new / pi_old may move the
        # objective only within [1 - clip, 1 + clip]; taking the max of the two negated terms is the
        # pessimistic (min) bound of the paper. 37 details, #8.
        log_ratio = new_log_prob - old_log_prob
        ratio = log_ratio.exp()
        policy_loss = torch.max(-advantages * ratio,
                                -advantages * ratio.clamp(1 - config.clip_coef, 1 + config.clip_coef)).mean()

        # Value loss (37 details, #9): squared error to the GAE returns; optionally clipped like the
        # policy, around the values of the rollout. Off by default here: on CartPole the returns grow
        # faster than a clipped value can follow (CartPole-v1, seeds 1-3: 105-133k steps to solve with
        # clipping, 80-86k without).
        if config.clip_value_loss:
            clipped_value = old_value + (new_value - old_value).clamp(-config.clip_coef, config.clip_coef)
            value_loss = 0.5 * torch.max((new_value - returns) ** 2, (clipped_value - returns) ** 2).mean()
        else:
            value_loss = 0.5 * ((new_value - returns) ** 2).mean()

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

    def compute_loss(self, obs, actions, old_log_prob, advantages, returns, old_value):
        """The loss of one minibatch under the current weights (what `--compile` compiles, backward included)."""
        new_log_prob, entropy, new_value = self.model.evaluate(obs, actions)
        return self.loss(new_log_prob, old_log_prob, advantages, new_value, old_value, returns, entropy, self.config)

    def update(self, obs, actions, old_log_prob, advantages, returns, old_value) -> dict:
        """One gradient step on one minibatch. Returns the diagnostics as tensors (no host sync here)."""
        loss, stats = self.compute_loss(obs, actions, old_log_prob, advantages, returns, old_value)
        self.optimizer.zero_grad()
        loss.backward()
        if self.ranks is not None:
            self.ranks.average_gradients(self.model.parameters())
        # Global gradient clipping (37 details, #11): all gradients together are scaled down to a norm of
        # at most max_grad_norm, which keeps a rare huge step from undoing the policy.
        stats["grad_norm"] = nn.utils.clip_grad_norm_(self.model.parameters(), self.config.max_grad_norm)
        self.optimizer.step()
        return stats


class Interrupted(Exception):
    """Ctrl-C or SIGTERM arrived: the run stops at the next step and saves what it has."""


class NonFiniteLoss(RuntimeError):
    """A loss or gradient became NaN or infinite: the run stops rather than train on garbage."""


class Main:
    """The training loop (and `--eval`). `Main(config).run()` returns the summary as a dict.

    Each iteration ("update") collects a rollout of num_steps steps in each of num_envs games with the
    current policy, computes advantages with GAE, then runs update_epochs passes of shuffled minibatches
    through the Trainer (37 details, #6). Then it logs, and checkpoints when due.
    """

    def __init__(self, config: Config):
        self.config = config
        self.stop_signal = None
        self.workers = []
        self.shared_obs = None
        self.ranks = None

    def run(self) -> dict:
        if self.config.eval:
            return self.evaluate()
        previous_handlers = self.catch_stop_signals()
        try:
            return self.train()
        finally:
            for signum, handler in previous_handlers.items():
                signal.signal(signum, handler)
            if self.ranks is not None:
                self.ranks.close()

    def catch_stop_signals(self) -> dict:
        """Ctrl-C and SIGTERM only set a flag; the loop sees it at its next step (under torchrun, at the end
        of the rollout, all ranks together) and stops cleanly.
        (Signal handlers can only be set from the main thread; elsewhere, e.g. in a thread of a
        notebook, the run simply cannot be interrupted this way.)"""
        if threading.current_thread() is not threading.main_thread():
            return {}

        def request_stop(signum, frame):
            self.stop_signal = signum

        return {signum: signal.signal(signum, request_stop) for signum in (signal.SIGINT, signal.SIGTERM)}

    # ----- setting up -----------------------------------------------------------------------------

    def setup(self, config: Config, checkpoint: typing.Optional[dict]):
        check_settings(config)
        device = pick_device(config.device)
        self.obs_size, self.action_dims, self.binary = inspect_env(config.env)
        # Under torchrun, join the other ranks (each on a GPU of its own); alone, a world of one.
        self.ranks = Ranks(device)
        self.device = self.ranks.device
        # Rank 0 names and makes the run dir: the default name holds the time, which may differ between ranks.
        self.run_dir = self.ranks.from_rank_0(lambda: make_run_dir(config))
        self.config = config = dataclasses.replace(config, run_dir=str(self.run_dir))
        # Reproducibility: every random draw of the trainer comes from torch's seeded generator (action
        # sampling, minibatch shuffling), and each game from its own seeded generator. Under torchrun, rank
        # r seeds with seed + r, so that its draws are its own (and rank 0's those of a run alone).
        seed = config.seed + self.ranks.rank
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)
        # One thread is fastest for networks this small: splitting a 64-unit layer over threads costs more
        # than it saves (measured here: the updates of a solving run took 2.0 s on one thread, 2.9 s on two).
        torch.set_num_threads(1)
        self.model = Model(self.obs_size, self.action_dims, self.binary, config.hidden_size).to(self.device)
        self.trainer = Trainer(self.model, config, self.ranks)
        self.global_step, self.updates = 0, 0
        if checkpoint is not None:
            self.restore(checkpoint)
            if self.ranks.rank > 0:  # the checkpoint holds rank 0's random state: start a fresh stream
                torch.manual_seed(seed + self.global_step)
        # The ranks start from the same weights, rank 0's; averaging the gradients keeps them the same.
        self.ranks.copy_from_rank_0(self.model.state_dict().values())
        if config.compile:
            self.compile_model()

    def compile_model(self):
        """torch.compile fuses the small layers into fewer kernels, for the rollout's inference and for the
        update's loss (its backward is compiled with it). It costs seconds to compile, which CartPole never
        earns back, hence off by default. Compiling the bound methods, not the modules, keeps the
        checkpoint's parameter names as they are. Both are compiled here, on inputs of the sizes they will
        see, so that a machine that cannot compile falls back to eager at once, with a one-line warning."""
        networks = (self.model.actor, self.model.critic)
        eager_forwards, eager_loss = [network.forward for network in networks], self.trainer.compute_loss
        config = self.config
        minibatch_size = config.num_envs * config.num_steps // config.num_minibatches
        try:
            for network, forward in zip(networks, eager_forwards):
                network.forward = torch.compile(forward)
            self.trainer.compute_loss = torch.compile(eager_loss)
            with torch.no_grad():
                self.model.act(torch.zeros(config.num_envs, self.obs_size, device=self.device))
            zeros = torch.zeros(minibatch_size, device=self.device)
            actions = torch.zeros((minibatch_size, len(self.action_dims)), dtype=torch.long, device=self.device)
            loss, _ = self.trainer.compute_loss(torch.zeros(minibatch_size, self.obs_size, device=self.device),
                                                actions, zeros, zeros + 1, zeros, zeros)
            loss.backward()
            self.trainer.optimizer.zero_grad()
        except Exception as error:
            for network, forward in zip(networks, eager_forwards):
                network.forward = forward
            self.trainer.compute_loss = eager_loss
            print(f"warning: torch.compile failed ({type(error).__name__}: {str(error).splitlines()[0]}); "
                  f"running eagerly", file=sys.stderr)

    def start_workers(self):
        """Create the Games: num_workers child processes with a Game of num_envs / num_workers envs each
        (or one Game of all envs here with --num-workers 0). Observations land in one [num_envs, obs_size]
        array that the trainer reads as a tensor without copying."""
        config = self.config
        shape = (config.num_envs, self.obs_size)
        if config.num_workers == 0:
            self.obs_array = np.zeros(shape, dtype=np.float32)
        else:
            self.shared_obs = shared_memory.SharedMemory(create=True, size=int(np.prod(shape)) * 4)
            self.obs_array = np.ndarray(shape, dtype=np.float32, buffer=self.shared_obs.buf)
        games_per_worker = config.num_envs // max(config.num_workers, 1)
        for index in range(max(config.num_workers, 1)):
            first = index * games_per_worker
            seed = config.seed + self.ranks.rank * config.num_envs + first
            worker = Worker(index, config.env, seed, self.obs_array[first:first + games_per_worker],
                            in_process=config.num_workers == 0,
                            inherited_trainer_ends=[w.trainer_end for w in self.workers])
            worker.first = first
            self.workers.append(worker)
        if self.shared_obs is not None:
            # The children have the memory mapped now, so its name is no longer needed: unlinking it at
            # once means no segment is ever left behind in /dev/shm, however this process ends.
            self.shared_obs.unlink()
        self.obs_tensor = torch.from_numpy(self.obs_array)

    def stop_workers(self):
        for worker in self.workers:
            worker.close()
        self.workers = []
        if self.shared_obs is not None:
            self.obs_tensor = self.obs_array = None  # drop the views before unmapping the memory
            self.shared_obs.close()
            self.shared_obs = None

    def step_envs(self, actions: np.ndarray):
        """Step every game: send all workers their actions first, then collect, so children run in
        parallel. Returns rewards, terminated, truncated ([num_envs] each) and two dicts keyed by env
        index: final observations of ended episodes and statistics of ended games."""
        for worker in self.workers:
            worker.send_step(actions[worker.first:worker.first + len(worker.obs_view)])
        results = [worker.receive() for worker in self.workers]
        if len(results) == 1:
            return results[0]
        final_obs, episodes = {}, {}
        for worker, (_, _, _, worker_final_obs, worker_episodes) in zip(self.workers, results):
            final_obs.update({worker.first + i: obs for i, obs in worker_final_obs.items()})
            episodes.update({worker.first + i: episode for i, episode in worker_episodes.items()})
        rewards, terminated, truncated = (np.concatenate(parts) for parts in list(zip(*results))[:3])
        return rewards, terminated, truncated, final_obs, episodes

    # ----- training -------------------------------------------------------------------------------

    def train(self) -> dict:
        config = self.config
        checkpoint = load_checkpoint(config.resume) if config.resume else None
        if checkpoint is not None:
            config = resumed_config(checkpoint, config)
        self.start_time = time.perf_counter()  # setup counts: it holds the compilation, if any
        self.setup(config, checkpoint)
        config = self.config
        self.writer = make_writer(self.run_dir, config) if self.ranks.rank == 0 else None  # rank 0 logs for all
        self.recent_returns, self.recent_lengths = deque(maxlen=100), deque(maxlen=100)
        self.episodes = 0
        self.solved_step = self.solved_seconds = None
        self.interrupted = False
        self.first_update_end = None  # (time, step) once the first update is done
        self.last_print = 0.0
        self.checkpoint_path = self.run_dir / "checkpoint.pt"
        last_checkpoint_step = self.global_step
        failure = None
        try:
            self.start_workers()
            self.allocate_rollout()
            next_obs = self.obs_tensor.to(self.device)
            while self.global_step < config.total_timesteps:
                self.anneal_learning_rate()
                next_obs = self.collect_rollout(next_obs)
                if self.solved_step is not None:
                    break  # solved in the middle of a rollout: stop at once, the policy is good enough
                learner_before = copy.deepcopy(self.learner_state())  # to fall back on if the update fails
                try:
                    stats = self.update(next_obs)
                    if not all(math.isfinite(v) for v in stats.values()):
                        raise NonFiniteLoss(f"non-finite loss or gradient in update {self.updates + 1} "
                                            f"({', '.join(f'{k}={v}' for k, v in stats.items())}); stopped "
                                            f"with the weights of the update before")
                except (NonFiniteLoss, RankError):  # (a RankError: a rank died in the middle of the update)
                    self.restore(learner_before)
                    raise
                self.updates += 1
                if self.first_update_end is None:
                    self.first_update_end = (time.perf_counter(), self.global_step)
                self.log_update(stats)
                if self.global_step - last_checkpoint_step >= config.checkpoint_every:
                    self.save_checkpoint()
                    last_checkpoint_step = self.global_step
        except Interrupted:
            self.interrupted = True
        except (WorkerError, NonFiniteLoss, RankError) as error:
            failure = error
        finally:
            self.stop_workers()
        if failure is None:  # then all ranks are here together: check that they trained the same network
            try:
                self.ranks.check_same(self.model.state_dict().values())
            except RankError as error:
                failure = error
        self.save_checkpoint()
        summary = self.write_summary()
        if self.writer is not None:
            self.writer.close()
            self.print_progress(final=True)
        if failure is not None:
            raise failure
        return summary

    def allocate_rollout(self):
        """The rollout buffer: one row per step and env, on the training device."""
        shape, device = (self.config.num_steps, self.config.num_envs), self.device
        self.rollout_obs = torch.zeros(shape + (self.obs_size,), device=device)
        self.rollout_actions = torch.zeros(shape + (len(self.action_dims),), dtype=torch.long, device=device)
        self.rollout_log_probs = torch.zeros(shape, device=device)
        self.rollout_values = torch.zeros(shape, device=device)
        self.rollout_rewards = torch.zeros(shape, device=device)
        self.rollout_dones = torch.zeros(shape, device=device)

    def anneal_learning_rate(self):
        """Linear learning-rate annealing (37 details, #4): from learning_rate at step 0 to 0 at the end,
        set by the step at which each rollout starts, so that a resumed run continues the schedule."""
        config = self.config
        if config.anneal_lr:
            self.trainer.optimizer.lr = config.learning_rate * max(0.0, 1.0 - self.global_step / config.total_timesteps)

    @torch.inference_mode()  # like no_grad, and skips autograd's version counting too: faster still
    def collect_rollout(self, next_obs: torch.Tensor) -> torch.Tensor:
        """Play num_steps steps in every game with the current policy, filling the rollout buffer.
        Returns the observation after the last step."""
        config = self.config
        ended = []  # (global step, statistics) of the games that end, recorded after the rollout
        for step in range(config.num_steps):
            # Ctrl-C or SIGTERM: alone, stop at once; under torchrun, all ranks stop together after the rollout.
            if self.stop_signal is not None and not self.ranks.distributed:
                break
            self.rollout_obs[step] = next_obs
            actions, log_prob, value = self.model.act(next_obs)
            self.rollout_actions[step] = actions
            self.rollout_log_probs[step] = log_prob
            self.rollout_values[step] = value
            rewards, terminated, truncated, final_obs, episodes = self.step_envs(actions.cpu().numpy())
            next_obs = self.obs_tensor.to(self.device)
            rewards = torch.from_numpy(rewards).to(self.device)
            # Truncation is not death: an episode cut by a time limit would have gone on, so its last
            # reward gets the value of where it stood, gamma * V(final observation), added. Then the
            # done flag below can cut GAE's sum for both kinds of endings (see compute_gae).
            cut = [i for i in final_obs if truncated[i] and not terminated[i]]
            if cut:
                cut_obs = torch.from_numpy(np.stack([final_obs[i] for i in cut])).to(self.device)
                rewards[cut] += config.gamma * self.model.value(cut_obs)
            self.rollout_rewards[step] = rewards
            self.rollout_dones[step] = torch.from_numpy(terminated | truncated).to(self.device)
            self.global_step += config.num_envs * self.ranks.world_size
            ended += [(self.global_step, episode) for episode in episodes.values()]
        self.share_rollout(ended)
        return next_obs

    def share_rollout(self, ended: list):
        """Record the games that ended in the rollout, and stop (raise Interrupted) if asked to. Under
        torchrun, this is where the ranks meet once per rollout: each learns the games of every rank and
        whether any rank was asked to stop. All record the same games in the same order (by step, then by
        rank), so they hold the same recent returns and take the same --target-return decision."""
        shared = self.ranks.gather((ended, self.stop_signal))
        for step, episode in sorted((game for games, _ in shared for game in games), key=lambda game: game[0]):
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

    def update(self, next_obs: torch.Tensor) -> dict:
        """GAE over the rollout, then update_epochs passes of shuffled minibatches. Returns the mean
        diagnostics of the update as floats (the only host sync of the update)."""
        config = self.config
        with torch.no_grad():
            last_value = self.model.value(next_obs)
        advantages = compute_gae(self.rollout_rewards, self.rollout_values, self.rollout_dones, last_value,
                                 config.gamma, config.gae_lambda)
        returns = advantages + self.rollout_values
        batch = (self.rollout_obs.flatten(0, 1), self.rollout_actions.flatten(0, 1),
                 self.rollout_log_probs.flatten(), advantages.flatten(), returns.flatten(),
                 self.rollout_values.flatten())
        batch_size = config.num_envs * config.num_steps
        minibatch_size = batch_size // config.num_minibatches
        totals, count = {}, 0
        for epoch in range(config.update_epochs):
            order = torch.randperm(batch_size, device=self.device)
            for start in range(0, batch_size, minibatch_size):
                indices = order[start:start + minibatch_size]
                stats = self.trainer.update(*(tensor[indices] for tensor in batch))
                for key, value in stats.items():
                    totals[key] = totals.get(key, 0.0) + value.detach()
                count += 1
            # Early stop (37 details, #12, optional): once the policy has moved too far from the one that
            # collected the data, further epochs would only push it beyond the trust region. (Under torchrun,
            # by the mean KL of the ranks, so that all stop after the same epoch.)
            if config.target_kl is not None and self.ranks.mean([stats["approx_kl"].item()])[0] > config.target_kl:
                break
        stats = {key: (value / count).item() for key, value in totals.items()}
        # Explained variance: 1 means the value function predicts the returns perfectly, 0 not at all.
        # A constant return (e.g. all episodes alike) leaves nothing to explain: 0.
        returns_variance = returns.var().item()
        stats["explained_variance"] = (0.0 if returns_variance == 0 else
                                       1 - (returns - self.rollout_values).var().item() / returns_variance)
        # Under torchrun, the means over the ranks: rank 0 logs those of the global batch, and all ranks see
        # the same values when train() checks them for NaN.
        return dict(zip(stats, self.ranks.mean(list(stats.values()))))

    # ----- logging, checkpoints, summary -----------------------------------------------------------

    def steady_speed(self) -> typing.Optional[float]:
        """Steps per second since the end of the first update (which holds one-time costs)."""
        if self.first_update_end is None:
            return None
        end_time, end_step = self.first_update_end
        elapsed = time.perf_counter() - end_time
        return (self.global_step - end_step) / elapsed if elapsed > 0 and self.global_step > end_step else None

    def log_update(self, stats: dict):
        step, writer = self.global_step, self.writer
        if writer is None:
            return  # under torchrun, rank 0 logs and prints for all
        for key, value in stats.items():
            if key != "grad_norm":
                writer.add_scalar(f"losses/{key}", value, step)
        writer.add_scalar("losses/grad_norm", stats["grad_norm"], step)
        writer.add_scalar("charts/learning_rate", self.trainer.optimizer.lr, step)
        speed = self.steady_speed()
        if speed is not None:
            writer.add_scalar("charts/steps_per_second", speed, step)
        if time.perf_counter() - self.last_print >= 1.0:
            self.print_progress()

    def print_progress(self, final: bool = False):
        self.last_print = time.perf_counter()
        total = self.config.total_timesteps
        speed = self.steady_speed() or self.global_step / max(self.last_print - self.start_time, 1e-9)
        eta = time.strftime("%H:%M:%S", time.gmtime(max(total - self.global_step, 0) / max(speed, 1e-9)))
        mean = lambda values: f"{np.mean(values):.1f}" if values else "-"
        print(f"step {self.global_step:,}/{total:,} ({100 * self.global_step / total:.1f}%) | "
              f"{speed:,.0f} steps/s | eta {eta} | return {mean(self.recent_returns)} | "
              f"length {mean(self.recent_lengths)} | updates {self.updates}"
              + (" | done" if final else ""), flush=True)

    def learner_state(self) -> dict:
        """Everything needed to continue learning: only tensors, numbers, strings, lists and dicts, so
        that torch.load(..., weights_only=True) can read it back (a checkpoint cannot run code)."""
        state = {
            "script": SCRIPT, "env": self.config.env, "obs_size": self.obs_size,
            "action_dims": self.action_dims, "binary": self.binary,
            "config": dataclasses.asdict(self.config),
            "model": self.model.state_dict(), "optimizer": self.trainer.optimizer.state_dict(),
            "global_step": self.global_step, "updates": self.updates,
            "rng": {"torch": torch.get_rng_state()},
        }
        return state

    def restore(self, state: dict):
        try:
            self.model.load_state_dict(state["model"])
        except RuntimeError as error:
            raise UsageError(f"the checkpoint's network does not fit {self.config.env} with hidden size "
                             f"{self.config.hidden_size}: {str(error).splitlines()[-1].strip()}") from None
        self.trainer.optimizer.load_state_dict(state["optimizer"])
        self.global_step, self.updates = int(state["global_step"]), int(state["updates"])
        torch.set_rng_state(state["rng"]["torch"])

    def save_checkpoint(self):
        """Write to a temporary file, then rename: a crash or a full disk never leaves half a checkpoint,
        and a failed write keeps the previous one. Under torchrun, rank 0 writes (all hold the same learner)."""
        if self.ranks.rank != 0:
            return
        temporary = self.checkpoint_path.with_suffix(".tmp")
        try:
            torch.save(self.learner_state(), temporary)
            os.replace(temporary, self.checkpoint_path)
        except OSError as error:
            temporary.unlink(missing_ok=True)
            kept = "the previous checkpoint is kept" if self.checkpoint_path.exists() else "no checkpoint"
            print(f"warning: could not write {self.checkpoint_path} ({os.strerror(error.errno) if error.errno else error}); "
                  f"{kept}", file=sys.stderr)

    def write_summary(self) -> dict:
        now = time.perf_counter()
        speed = self.steady_speed()
        summary = {
            "script": SCRIPT, "env": self.config.env, "seed": self.config.seed,
            "steps": self.global_step,
            "seconds": round(now - self.start_time, 3),
            "warmup_seconds": (round(self.first_update_end[0] - self.start_time, 3)
                               if self.first_update_end else None),
            "steps_per_second": round(speed, 1) if speed else None,
            "episodes": self.episodes,
            "mean_return_100": float(np.mean(self.recent_returns)) if self.recent_returns else None,
            "target_return": self.config.target_return,
            "solved_step": self.solved_step,
            "solved_seconds": round(self.solved_seconds, 3) if self.solved_seconds is not None else None,
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

    # ----- evaluation -----------------------------------------------------------------------------

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Play --eval-episodes whole games with a checkpoint's policy and report the real score."""
        checkpoint = load_checkpoint(self.config.eval)
        config = resumed_config(checkpoint, self.config)
        check_settings(config)
        if config.eval_episodes <= 0:
            raise UsageError("--eval-episodes must be positive")
        self.obs_size, self.action_dims, self.binary = inspect_env(config.env)
        model = Model(self.obs_size, self.action_dims, self.binary, config.hidden_size)
        model.load_state_dict(checkpoint["model"])
        torch.manual_seed(config.seed)
        run_dir = Path(self.config.run_dir) if self.config.run_dir else Path(config.eval).parent
        game = Game(config.env, config.seed, num_envs=1, render_mode="rgb_array" if config.video else None)
        video = None
        obs = game.reset()
        returns = []
        try:
            while len(returns) < config.eval_episodes:
                if config.video:
                    video = write_frame(video, game, run_dir / "eval.mp4")
                actions, _, _ = model.act(torch.from_numpy(obs), greedy=config.greedy)
                obs, _, _, _, info = game.step(actions.numpy())
                if "episode" in info:
                    returns.append(float(info["episode"]["return"][0]))
        finally:
            game.close()
            if video is not None:
                video.release()
        mean, std = float(np.mean(returns)), float(np.std(returns))
        how = "greedy" if config.greedy else "sampled"
        print(f"eval {config.env}: return {mean:.2f} ± {std:.2f} over {len(returns)} episodes ({how} actions)")
        if video is not None:
            print(f"video: {run_dir / 'eval.mp4'}")
        return {"script": SCRIPT, "env": config.env, "episodes": len(returns), "mean_return": mean,
                "std_return": std, "returns": returns, "greedy": config.greedy,
                "video": str(run_dir / "eval.mp4") if video is not None else None}


def write_frame(video, game: Game, path: Path):
    """Append the game's current picture to the mp4 (OpenCV's VideoWriter, opened at the first frame)."""
    import cv2  # only --video needs OpenCV

    frame = game.render()
    if video is None:
        path.parent.mkdir(parents=True, exist_ok=True)
        fps = game.envs.metadata.get("render_fps", 30)
        video = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), fps, (frame.shape[1], frame.shape[0]))
        if not video.isOpened():
            raise UsageError(f"OpenCV cannot write {path}")
    video.write(cv2.cvtColor(frame, cv2.COLOR_RGB2BGR))
    return video


# ----- checking the input ---------------------------------------------------------------------------


def check_settings(config: Config):
    """Refuse settings that cannot work, with one line that says what to change."""
    for name in ("total_timesteps", "num_envs", "num_steps", "num_minibatches", "update_epochs",
                 "hidden_size", "checkpoint_every"):
        if getattr(config, name) <= 0:
            raise UsageError(f"--{name.replace('_', '-')} must be positive, not {getattr(config, name)}")
    if config.num_workers < 0:
        raise UsageError(f"--num-workers must be 0 (games in this process) or more, not {config.num_workers}")
    if config.num_workers and config.num_envs % config.num_workers:
        raise UsageError(f"--num-workers {config.num_workers} must divide --num-envs {config.num_envs}")
    batch_size = config.num_envs * config.num_steps
    if batch_size % config.num_minibatches:
        raise UsageError(f"the batch of {batch_size} steps (--num-envs x --num-steps) does not split into "
                         f"--num-minibatches {config.num_minibatches}")
    if batch_size // config.num_minibatches < 2:
        raise UsageError(f"minibatches of {batch_size // config.num_minibatches} step cannot be normalised: "
                         f"raise --num-envs or --num-steps, or lower --num-minibatches")


def inspect_env(env_id: str):
    """Check that the env exists and that this script can play it. Returns (observation size, number of
    choices of each action dimension, whether the actions are binary)."""
    if env_id not in gym.registry:
        try:
            import ale_py  # registers the Atari ids, to tell the user where those belong

            gym.register_envs(ale_py)
        except ImportError:
            pass
        if env_id in gym.registry:
            raise UsageError(f"{env_id} is an Atari game: use ppo_atari.py")
        close = difflib.get_close_matches(env_id, list(gym.registry), n=3, cutoff=0.6)
        hint = f"; did you mean {' or '.join(close)}?" if close else "; see gymnasium.pprint_registry()"
        raise UsageError(f"unknown env {env_id!r}{hint}")
    try:
        env = gym.make(env_id)
    except Exception as error:
        raise UsageError(f"cannot make {env_id}: {type(error).__name__}: {error}") from None
    obs_space, action_space = env.observation_space, env.action_space
    env.close()
    if not isinstance(obs_space, gym.spaces.Box):
        raise UsageError(f"{env_id} has a {type(obs_space).__name__} observation space; this script needs a Box "
                         f"(a vector of numbers)")
    if obs_space.dtype == np.uint8 and len(obs_space.shape) >= 2:
        raise UsageError(f"{env_id} observes images {obs_space.shape}: use ppo_atari.py, which has a CNN")
    if isinstance(action_space, gym.spaces.Discrete):
        return int(np.prod(obs_space.shape)), [int(action_space.n)], False
    if isinstance(action_space, gym.spaces.MultiDiscrete):
        return int(np.prod(obs_space.shape)), [int(n) for n in action_space.nvec.reshape(-1)], False
    if isinstance(action_space, gym.spaces.MultiBinary):
        return int(np.prod(obs_space.shape)), [2] * int(np.prod(action_space.shape)), True
    raise UsageError(f"{env_id} has a {action_space} action space; this script handles Discrete, MultiDiscrete "
                     f"and MultiBinary actions (continuous Box actions need a Gaussian policy, planned as "
                     f"ppo_continuous.py)")


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
    run_dir = Path(config.run_dir or f"runs/{config.env.replace('/', '-')}__{SCRIPT}__{config.seed}__{int(time.time())}")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as error:
        raise UsageError(f"cannot write to --run-dir {run_dir}: {error.strerror or error}") from None
    return run_dir


def make_writer(run_dir: Path, config: Config):
    """TensorBoard writer, with the hyperparameters as a text table."""
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(run_dir))
    rows = "\n".join(f"|{key}|{value}|" for key, value in dataclasses.asdict(config).items())
    writer.add_text("hyperparameters", f"|param|value|\n|-|-|\n{rows}")
    return writer


def load_checkpoint(path: str) -> dict:
    """Read a checkpoint of this script, refusing clearly what is missing, damaged or foreign."""
    if not Path(path).is_file():
        raise UsageError(f"checkpoint {path} not found")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:
        raise UsageError(f"{path} is not a readable checkpoint (truncated or corrupt?): {type(error).__name__}") from None
    if not isinstance(checkpoint, dict) or "script" not in checkpoint:
        raise UsageError(f"{path} is not a checkpoint of this library")
    if checkpoint["script"] != SCRIPT:
        raise UsageError(f"{path} was written by {checkpoint['script']}.py, not {SCRIPT}.py: use that script")
    return checkpoint


def resumed_config(checkpoint: dict, given: Config) -> Config:
    """The settings of a resumed (or evaluated) run: the checkpoint's, except those given differently from
    their defaults now (e.g. a new --total-timesteps). A different env or network is refused."""
    saved = {f.name: checkpoint["config"][f.name] for f in dataclasses.fields(Config) if f.name in checkpoint["config"]}
    config = Config(**saved)
    for f in dataclasses.fields(Config):
        value = getattr(given, f.name)
        if value != f.default:
            if f.name in ("env", "hidden_size") and value != saved.get(f.name):
                raise UsageError(f"the checkpoint was trained with --{f.name.replace('_', '-')} "
                                 f"{saved.get(f.name)}, not {value}")
            config = dataclasses.replace(config, **{f.name: value})
    return config


# ----- command line ---------------------------------------------------------------------------------


def parse_config(argv=None) -> Config:
    """The command line: one flag per Config field, with its default and explanation in --help."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for f in dataclasses.fields(Config):
        flag = "--" + f.name.replace("_", "-")
        kind = next(t for t in (bool, int, float, str) if t is f.type or t in typing.get_args(f.type))
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=f.metadata["help"])
        else:
            parser.add_argument(flag, type=kind, default=f.default, help=f.metadata["help"])
    return Config(**vars(parser.parse_args(argv)))


if __name__ == "__main__":
    main = Main(parse_config())
    try:
        main.run()
    except UsageError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    except (WorkerError, NonFiniteLoss, RankError) as error:
        print(f"error: {error}; the checkpoint of the last finished update is kept", file=sys.stderr)
        sys.exit(1)
    if main.stop_signal is not None:
        sys.exit(128 + main.stop_signal)
