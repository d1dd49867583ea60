"""PPO for Atari games from pixels, in one file: the PPO paper's Atari setup, annotated.

Proximal Policy Optimization (Schulman et al., 2017, "PPO paper") with the Atari preprocessing of
DeepMind's DQN (Mnih et al., 2015) and the implementation details of CleanRL and Stable-Baselines3
("The 37 Implementation Details of PPO", Huang et al., 2022, "37 details"), whose published scores
(10M steps: Breakout ~400, Pong ~20, BeamRider ~1,900) are the yardstick. Read it top to bottom:

1. `Game`    - one Atari game, preprocessed as the published agents see it: no-op starts, 4-frame
               action repeat with max-pooling, 84x84 grayscale, 4-frame stack, life loss as the end
               of a training episode, FIRE to start, rewards clipped to their sign.
2. `Worker`  - runs several Games in a child process (observations through shared memory) or here;
               `VectorGames` plays the same games in ale-py's C++ vector env, the default engine.
3. `Model`   - the Nature CNN shared by a policy head and a value head.
4. `Trainer` - one clipped PPO update on a minibatch.
5. `Main`    - the loop: rollout, GAE, epochs of minibatches, logging, checkpoints, evaluation.

Run it:      python ppo_atari.py --env BreakoutNoFrameskip-v4     (--help lists every flag)
On N GPUs:   torchrun --standalone --nproc_per_node N ppo_atari.py     (data parallel: see `Ranks`)
In a notebook:  from ppo_atari import Config, Main; Main(Config(total_timesteps=50_000)).run()
10M steps take hours even on a GPU; on a 2-core CPU, 6 or 7 hours (see README).
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

    # The game and the run.
    env: str = option("BreakoutNoFrameskip-v4", "Atari game id: *NoFrameskip-v4 or ALE/*-v5")
    seed: int = option(1, "seeds python, numpy, torch and every game (game i of rank r gets seed + r * num_envs + i)")
    total_timesteps: int = option(10_000_000, "agent steps over all games (of all ranks, under torchrun; one step = 4 frames)")
    device: str = option("auto", "auto | cpu | cuda: auto takes CUDA when present")
    run_dir: typing.Optional[str] = option(None, "logs, checkpoint and summary go here (default runs/<env>__<script>__<seed>__<time>)")
    target_return: typing.Optional[float] = option(None, "stop once the mean score of the last 100 games reaches this")
    checkpoint_every: int = option(500_000, "save a checkpoint every this many steps (and always at the end)")
    resume: typing.Optional[str] = option(None, "continue training from this checkpoint")
    eval: typing.Optional[str] = option(None, "no training: play --eval-episodes whole games with this checkpoint")
    eval_episodes: int = option(10, "games played by --eval")
    greedy: bool = option(False, "with --eval, take the most likely action instead of sampling")
    video: bool = option(False, "with --eval, write an mp4 of the games into the run dir")
    # Measured here (2 cores, Breakout, 40,960 steps side by side, the Game backend): 341 steps/s compiled,
    # 304 eager; compiling takes 5-10 s once, at start-up (part of summary.json's warmup_seconds).
    compile: bool = option(True, "torch.compile inference and the update (eager, with a warning, where it cannot)")
    # reduce-overhead records CUDA graphs: one launch replays a whole forward or backward, which matters on
    # a GPU where the many small kernels of a batch of 8 would each wait for the CPU. On a CPU it does nothing.
    compile_mode: str = option("default", "torch.compile mode: default | reduce-overhead (CUDA graphs, for GPUs) | max-autotune")
    # bfloat16 halves the update's time on CPUs with AMX (measured here: 45 against 96 ms per minibatch) and
    # on recent GPUs, but rounds the body's numbers: float32, as every published PPO result, is the default.
    precision: str = option("float32", "float32 | bfloat16: the network's body in bfloat16 (autocast; see Model)")

    # Collecting experience.
    # Measured here (2 cores, Breakout, 40,960 steps side by side, compiled): ale-vector 478 steps/s, the
    # Game in 2 workers 360. tests/test_atari_game.py checks that both play the same games (VectorGames).
    env_backend: str = option("ale-vector", "ale-vector: ale-py's C++ vector env | game: the Game class below, in --num-workers processes")
    num_envs: int = option(8, "games played side by side (by each rank, under torchrun)")
    # Measured here (2 cores, 20,480 steps, 3 interleaved rounds): 2 workers 303-376 steps/s (median 359),
    # 0 workers 331-348 (median 347); 1 and 4 workers were no faster in a shorter comparison. The gap
    # is within this machine's noise; 2 lets the games of each worker step in parallel on the two cores.
    num_workers: int = option(2, "with --env-backend game: child processes that run the games (0 = in this process)")
    num_steps: int = option(128, "steps per game in each rollout; a rollout is num_envs * num_steps steps")

    # The PPO update.
    learning_rate: float = option(2.5e-4, "Adam step size at the start, annealed linearly to 0")
    anneal_lr: bool = option(True, "anneal the learning rate linearly to 0 over the run")
    gamma: float = option(0.99, "discount factor")
    gae_lambda: float = option(0.95, "GAE lambda: bias (0) vs variance (1) of the advantage")
    num_minibatches: int = option(4, "minibatches each rollout is split into")
    update_epochs: int = option(4, "passes over each rollout")
    clip_coef: float = option(0.1, "PPO's clip range for the probability ratio")
    clip_value_loss: bool = option(True, "clip the value update around the rollout's values, as the PPO paper's code does")
    ent_coef: float = option(0.01, "weight of the entropy bonus")
    vf_coef: float = option(0.5, "weight of the value loss")
    max_grad_norm: float = option(0.5, "clip the global gradient norm to this")
    target_kl: typing.Optional[float] = option(None, "stop an update's epochs early once the approximate KL passes this")


class UsageError(ValueError):
    """Bad input from the user: the command line prints its message on one line and exits with status 2."""


def make_atari(env_id: str, **options) -> gym.Env:
    """gym.make for an Atari id, without the emulator's start-up banner on stderr."""
    ale_py.ALEInterface.setLoggerMode(ale_py.LoggerMode.Error)
    return gym.make(env_id, **options)


class Game:
    """One Atari game, preprocessed as DQN, the PPO paper, CleanRL and SB3 do it. Each step:

    - Action repeat (MaxAndSkipEnv): the action is held for 4 emulator frames and their rewards are
      summed; the repeat stops early if the game ends inside it. The agent acts 4x less often, so it
      sees further for the same compute, and 4 frames rarely change what the right action is.
    - Max-pooling: the picture is the pixel-wise max of the last two frames, because Atari sprites
      flicker (some are drawn only every other frame).
    - Grayscale, 84x84 (WarpFrame): the frames come from the emulator already in grayscale
      (`obs_type="grayscale"`, as gymnasium's AtariPreprocessing and ale-py's vector env read them)
      and are shrunk with area interpolation, which averages pixels instead of dropping them.
    - Frame stack (VecFrameStack): the observation is the last 4 pictures, so that speed and direction
      can be seen. When a training episode (re)starts, the stack is zeros and the first picture, as in
      SB3 and ale-py's vector env, so no picture of the episode before leaks into the new one.
    - Life loss ends the training episode (EpisodicLifeEnv): `terminated=True`, so the value of losing
      a life is learned as the end of everything, which helps a lot early on. The game itself goes on.
    - FIRE to start (FireResetEnv): games like Breakout wait for FIRE after a (re)start; the Game
      presses it so that an agent does not stall.
    - Reward clipping (ClipRewardEnv): the training reward is the sign of the score change, so one
      step size fits games whose points differ by orders of magnitude. `info["episode"]` reports the
      real score, unclipped, summed over all lives, and the game's length in agent steps.
    - No-op starts (NoopResetEnv): after a real reset, 1..30 random NOOP frames, so that the games
      do not all start from the same picture (`noop_max=0`: none, for tests that need the exact start).

    Observations are uint8 (the model scales them by 1/255): 4 times less memory than float32.
    """

    def __init__(self, env_id: str, seed: int, noop_max: int = 30, render_mode: typing.Optional[str] = None):
        # frameskip=1: the Game does the skipping itself (ALE/*-v5 ids would otherwise skip 4 frames
        # and the max-pool would see the wrong frames). v5's sticky actions (each frame, the previous
        # action is repeated with probability 0.25) are left as the id asks.
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
        frame, _ = self.env.reset(seed=self.seed)  # seed only the first reset; later ones continue its stream
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
        """The action for 4 frames, or fewer if the game ends (or hits ALE's 108,000-frame limit)."""
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
        """FIRE, then action 2, as FireResetEnv does (some games start only after both); the points they
        score count in the game's score."""
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
            # As EpisodicLifeEnv + FireResetEnv: one NOOP step, then FIRE where the game needs it, and
            # the next training episode starts from a fresh stack: zeros and the current picture.
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


def step_games(games: list, actions: np.ndarray, obs_out: np.ndarray):
    """Step each Game with its action, write the next observations into `obs_out` (one row per game),
    and return what the trainer needs besides: rewards, terminations, truncations, the final
    observations of the episodes that ended, and the statistics of the games that ended."""
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


class WorkerError(RuntimeError):
    """A worker process died or one of its Games raised: the run stops with this message."""


class Worker:
    """Runs a few Games, either in a child process or, with `in_process=True`, right here.

    The trainer and a child talk through a `multiprocessing` pipe: the trainer sends the actions, the
    child steps its Games and answers with rewards, flags and finished-episode statistics. Observations,
    the one large array, do not go through the pipe: the child writes them straight into shared memory
    (`obs_view`, a numpy view over a `multiprocessing.shared_memory` block that the trainer reads as a
    torch tensor without a copy).

    Children are started with `fork`: they inherit the shared memory mapping and start in milliseconds,
    instead of importing torch again as `spawn` would. A child ignores SIGINT (a terminal's Ctrl-C
    reaches every process of the group; the trainer decides how to stop) and exits by itself when the
    trainer's end of its pipe closes, so a trainer that dies, however, never leaves a worker behind.
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
        # A forked child holds copies of every pipe end the trainer had. Closing the trainer's ends makes
        # a recv() here fail with EOFError as soon as the trainer is gone.
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

    def receive(self, timeout: float = 120.0):
        """The result of the last `send_step`. Waits on the pipe and on the process at once, so a child
        that dies is noticed at once instead of blocking `recv()` forever."""
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
        if not ready:
            raise WorkerError(f"worker {self.index} ({self.env_id}) did not answer within {timeout:.0f} s")
        self.process.join(timeout=1.0)
        code = self.process.exitcode
        how = (f"killed by signal {signal.Signals(-code).name}" if code is not None and code < 0
               else f"exit code {code}")
        raise WorkerError(f"worker {self.index} ({self.env_id}) died ({how})")

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


class VectorGames:
    """All the games at once in ale-py's own vector env, `ale_py.vector_env.AtariVectorEnv`
    (`--env-backend ale-vector`). The Game above is the lesson: each step of the preprocessing in
    Python you can read. This is the engine: the same preprocessing in C++, the games stepped by a pool
    of threads inside this process, with no child processes and no pipes.

    It is configured to keep the Game's contract: the same grayscale frames, 4-frame repeat with the
    max of the last two frames before the 84x84 area resize, a stack of zeros and the first picture at
    a reset, no-op starts, sticky actions as the env id asks, ALE's 108,000-frame limit as truncation,
    raw rewards (clipped here, so that the real score can be reported), and a life loss reported as a
    termination (`life_loss_info`) while the game goes on (`episodic_life=False`). With same-step
    autoreset, an ended game's next observation is already the new game's first.

    What cannot be configured away (tests/test_atari_game.py steps both with the same actions and
    checks everything else for equality):
    - FIRE: the vector env presses FIRE for one frame at a reset and never after a life loss; the Game
      presses FIRE then 2 for 4 frames each, at both (FireResetEnv). Agents learn to press FIRE.
      (`episodic_life=True` is no way out: in ale-py 0.12.1 it restarts the whole game at a lost life.)
    - After a life loss the vector env plays on: no NOOP step, and the frame stack goes on through
      the loss; the Game takes EpisodicLifeEnv's NOOP step and restarts its stack. So here a stack
      restarts only when a game ends (`restarted`), and the rollout buffer rebuilds stacks that way.
    - The last observation of a game that ended (`final_obs`) has the same older pictures, but its
      newest is built from other frames than the Game's (tests: under 5% of its pixels differ; when
      the repeat is cut short it repeats the picture before). It is read only to bootstrap a game cut
      by the time limit, at most once per 27,000 steps.
    - No-op counts are drawn by the vector env's own seeded generator, not the Game's, and points
      scored during no-ops or FIRE at a reset are not seen (rare; the Game counts them).
    """

    def __init__(self, env_id: str, seeds: list, obs_out: np.ndarray, noop_max: int = 30):
        from ale_py.vector_env import AtariVectorEnv

        settings = gym.spec(env_id).kwargs  # the ROM and what the id asks for: sticky actions, frame limit
        self.env = AtariVectorEnv(
            settings["game"], len(seeds),
            repeat_action_probability=settings.get("repeat_action_probability", 0.0),
            full_action_space=settings.get("full_action_space", False),
            max_num_frames_per_episode=settings.get("max_num_frames_per_episode", 108_000),
            frameskip=FRAME_SKIP, stack_num=FRAME_STACK, img_height=FRAME_SIZE, img_width=FRAME_SIZE,
            grayscale=True, maxpool=True, noop_max=noop_max, use_fire_reset=True,
            reward_clipping=False, episodic_life=False, life_loss_info=True, autoreset_mode="SameStep")
        self.obs_out = obs_out
        obs, info = self.env.reset(seed=np.array(seeds))  # seeds only the first reset
        obs_out[:] = obs
        self.lives = info["lives"]
        self.episode_returns = np.zeros(len(seeds))
        self.episode_lengths = np.zeros(len(seeds), dtype=np.int64)

    def step(self, actions: np.ndarray):
        """Step every game; returns what Main.step_envs does."""
        obs, raw_rewards, terminated, truncated, info = self.env.step(actions)
        self.obs_out[:] = obs
        self.episode_returns += raw_rewards
        self.episode_lengths += 1
        # A termination is a life loss if the game went on with fewer lives, else the game is over and
        # the env has already started a new one (with full lives, or 0 again in games without lives).
        game_over = terminated & (info["lives"] >= self.lives)
        self.lives = info["lives"]
        restarted = game_over | truncated
        final_obs, episodes = {}, {}
        for i in np.flatnonzero(restarted):
            final_obs[i] = info["final_obs"][i]  # only an ended game's is real: after a life loss, obs goes on
            episodes[i] = {"return": float(self.episode_returns[i]), "length": int(self.episode_lengths[i])}
            self.episode_returns[i], self.episode_lengths[i] = 0.0, 0
        return np.sign(raw_rewards).astype(np.float32), terminated, truncated, restarted, final_obs, episodes

    def close(self):
        self.env.close()


def orthogonal(layer: nn.Module, gain: float = math.sqrt(2)) -> nn.Module:
    """Orthogonal weights of the given gain and zero biases (37 details, #2: the body gets sqrt(2), the
    policy output 0.01 so that all actions start equally likely, the value output 1)."""
    nn.init.orthogonal_(layer.weight, gain)
    nn.init.zeros_(layer.bias)
    return layer


class Model(nn.Module):
    """The Nature CNN (Mnih et al., 2015) with two heads on one shared body: a policy over the game's
    actions and a value. Sharing the body is what the PPO paper did on Atari: both heads need the
    same picture understood, and one CNN costs half of two.

    Input: uint8 [batch, 4, 84, 84], scaled to [0, 1] here, so that nothing upstream ever holds
    float copies of the observations.

    `bfloat16=True` (`--precision bfloat16`) runs the body's layers in bfloat16 under autocast: the
    weights, the gradients and Adam stay float32, and the two heads read the body's output in float32,
    so the action probabilities and values keep their precision. It changes the numbers (about 3
    significant digits inside the body), not the algorithm.
    """

    def __init__(self, num_actions: int, bfloat16: bool = False):
        super().__init__()
        self.bfloat16 = bfloat16
        self.body = nn.Sequential(
            orthogonal(nn.Conv2d(FRAME_STACK, 32, kernel_size=8, stride=4)), nn.ReLU(),  # -> 32 x 20 x 20
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
        """Choose actions for a batch of observations: (actions [batch], their log-probabilities, the
        values of the observations)."""
        logits, value = self(obs)
        log_probs = torch.log_softmax(logits, dim=-1)
        if greedy:
            actions = log_probs.argmax(-1)
        else:
            actions = torch.multinomial(log_probs.exp(), 1).squeeze(-1)
        return actions, log_probs.gather(-1, actions.unsqueeze(-1)).squeeze(-1), value

    def evaluate(self, obs: torch.Tensor, actions: torch.Tensor):
        """For the update: log-probabilities of the taken actions under the current policy, the entropy
        of the policy, and the values, all [batch]."""
        logits, value = self(obs)
        log_probs = torch.log_softmax(logits, dim=-1)
        log_prob = log_probs.gather(-1, actions.unsqueeze(-1)).squeeze(-1)
        entropy = -(log_probs.exp() * log_probs).sum(-1)
        return log_prob, entropy, value


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


class RankError(RuntimeError):
    """Under torchrun: another rank is gone (a collective failed), or the ranks' weights differ at the end."""


class Ranks:
    """The processes ("ranks") of one run started by torchrun, and the few things they do together.

    `torchrun --nproc_per_node N ppo_atari.py ...` (or any torch.distributed launcher, over several
    machines too) starts N copies of this script and tells each its rank and the world size in the
    environment (RANK, WORLD_SIZE, LOCAL_RANK). This is data parallelism, as in CleanRL's multi-GPU PPO
    (ppo_atari_multigpu.py): each rank plays its own --num-envs games (game i of rank r gets seed + r *
    num_envs + i, with either --env-backend), collects its own rollout and splits it into its own
    --num-minibatches; but before each gradient step the ranks average their gradients, so all take the
    same step and hold the same weights.
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
        one vector (1.7M floats, 6.7 MB, per minibatch). Why not DistributedDataParallel: DDP overlaps the
        exchange with the backward pass, bucket by bucket, which pays for networks many times this size; and
        it wraps the model, so the compiled forward and loss (compile_model) and the checkpoint's parameter
        names would all go through the wrapper. One message keeps the averaging outside the compiled code,
        in sight in Trainer.update, before the clip: every rank clips the same global gradient, and every
        rank's fused Adam takes the same step."""
        if not self.distributed:
            return
        grads = [p.grad for p in parameters]
        flat = torch.cat([grad.flatten() for grad in grads])
        self.collective(dist.all_reduce, flat)  # sum
        flat /= self.world_size
        for grad, part in zip(grads, flat.split([grad.numel() for grad in grads])):
            grad.copy_(part.view_as(grad))  # (copy_ keeps each gradient's layout, channels-last included)

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
        # Adam with eps 1e-5 instead of 1e-8 (37 details, #3), as the PPO paper's code. fused=True does
        # the same arithmetic in one kernel: 0.9 ms per step for these 1.7M weights here, against 3.8-6 ms.
        self.optimizer = torch.optim.Adam(model.parameters(), lr=config.learning_rate, eps=1e-5, fused=True)

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

        # Value loss (37 details, #9): squared error to the GAE returns, clipped like the policy around
        # the values of the rollout, as in the PPO paper's Atari runs (on by default here).
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
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if self.ranks is not None:  # (after the backward, outside the compiled loss)
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
        self.vector_games = None
        self.shared_obs = None
        self.obs_staging = None
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
        self.num_actions = inspect_env(config.env)
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
        # Channels-last weights let the CPU's convolution kernels (oneDNN) skip a layout conversion per
        # layer: one eager minibatch update took 93 ms instead of 130 here, measured alone.
        self.model = Model(self.num_actions, bfloat16=config.precision == "bfloat16").to(
            self.device, memory_format=torch.channels_last)
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
        """torch.compile fuses the network's operations into fewer, faster kernels, for the rollout's
        inference and for the update's loss (its backward is compiled with it). Compiling the bound methods,
        not the module, keeps the checkpoint's parameter names as they are. Both are compiled here, on
        inputs of the sizes they will see, so that a machine that cannot compile falls back to eager at
        once, with a one-line warning."""
        eager_forward, eager_loss = self.model.forward, self.trainer.compute_loss
        config = self.config
        minibatch_size = config.num_envs * config.num_steps // config.num_minibatches
        try:
            self.model.forward = torch.compile(eager_forward, mode=config.compile_mode)
            self.trainer.compute_loss = torch.compile(eager_loss, mode=config.compile_mode)
            obs = torch.zeros((config.num_envs, FRAME_STACK, FRAME_SIZE, FRAME_SIZE), dtype=torch.uint8, device=self.device)
            # The network runs under inference_mode in the rollout and under no_grad for the update's last
            # value: the compiled code is specialised to each, so both are compiled now.
            with torch.inference_mode():
                self.model.act(obs)
            with torch.no_grad():
                self.model.value(obs)
            minibatch = torch.zeros((minibatch_size, FRAME_STACK, FRAME_SIZE, FRAME_SIZE), dtype=torch.uint8, device=self.device)
            # (distinct tensors: the compiled code is specialised to which arguments are the same tensor)
            actions, log_probs, advantages, returns, values = (
                torch.zeros(minibatch_size, device=self.device) for _ in range(5))
            loss, _ = self.trainer.compute_loss(minibatch, actions.long(), log_probs, advantages + 1, returns, values)
            loss.backward()
            self.trainer.optimizer.zero_grad(set_to_none=True)
        except Exception as error:
            self.model.forward, self.trainer.compute_loss = eager_forward, eager_loss
            print(f"warning: torch.compile failed ({type(error).__name__}: {str(error).splitlines()[0]}); "
                  f"running eagerly", file=sys.stderr)

    def start_workers(self):
        """Create the Games: num_workers child processes with num_envs / num_workers Games each (or all
        Games here with --num-workers 0), or ale-py's vector env. Observations land in one uint8
        [num_envs, 4, 84, 84] array that the trainer reads as a tensor without copying. Game i of rank r
        is seeded with seed + r * num_envs + i (rank 0's games are those of a run alone)."""
        config = self.config
        first_seed = config.seed + self.ranks.rank * config.num_envs
        shape = (config.num_envs, FRAME_STACK, FRAME_SIZE, FRAME_SIZE)
        if self.device.type == "cuda":
            self.obs_staging = torch.empty(shape, dtype=torch.uint8, pin_memory=True)
        if config.env_backend == "ale-vector":
            self.obs_array = np.zeros(shape, dtype=np.uint8)
            self.vector_games = VectorGames(config.env, [first_seed + i for i in range(config.num_envs)],
                                            self.obs_array)
            self.obs_tensor = torch.from_numpy(self.obs_array)
            return
        if config.num_workers == 0:
            self.obs_array = np.zeros(shape, dtype=np.uint8)
        else:
            self.shared_obs = shared_memory.SharedMemory(create=True, size=int(np.prod(shape)))
            self.obs_array = np.ndarray(shape, dtype=np.uint8, buffer=self.shared_obs.buf)
        games_per_worker = config.num_envs // max(config.num_workers, 1)
        for index in range(max(config.num_workers, 1)):
            first = index * games_per_worker
            seeds = [first_seed + i for i in range(first, first + games_per_worker)]
            worker = Worker(index, config.env, seeds, self.obs_array[first:first + games_per_worker],
                            in_process=config.num_workers == 0,
                            inherited_trainer_ends=[w.trainer_end for w in self.workers])
            worker.first = first
            self.workers.append(worker)
        if self.shared_obs is not None:
            # The children have the memory mapped now, so its name is no longer needed: unlinking it at
            # once means no segment is ever left behind in /dev/shm, however this process ends.
            self.shared_obs.unlink()
        self.obs_tensor = torch.from_numpy(self.obs_array)

    def observations(self) -> torch.Tensor:
        """The games' current observations on the training device. On the CPU that is the array the
        games write into, without a copy. On a GPU they pass through a page-locked host buffer, which
        the GPU reads directly and asynchronously (overwriting it next step is safe: `actions.cpu()`
        in between waits for the GPU)."""
        if self.obs_staging is None:
            return self.obs_tensor
        self.obs_staging.copy_(self.obs_tensor)
        return self.obs_staging.to(self.device, non_blocking=True)

    def stop_workers(self):
        for worker in self.workers:
            worker.close()
        self.workers = []
        if self.vector_games is not None:
            self.vector_games.close()
            self.vector_games = None
        if self.shared_obs is not None:
            self.obs_tensor = self.obs_array = None  # drop the views before unmapping the memory
            self.shared_obs.close()
            self.shared_obs = None

    def step_envs(self, actions: np.ndarray):
        """Step every game: send all workers their actions first, then collect, so children run in
        parallel. Returns rewards, terminated, truncated, restarted ([num_envs] each: `restarted` says
        whose frame stack starts afresh) and two dicts keyed by env index: final observations of ended
        episodes and statistics of ended games."""
        if self.vector_games is not None:
            return self.vector_games.step(actions)
        rewards, terminated, truncated, final_obs, episodes = self.step_workers(actions)
        return rewards, terminated, truncated, terminated | truncated, final_obs, episodes

    def step_workers(self, actions: np.ndarray):
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
            next_obs = self.observations()
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
        """The rollout buffer: one row per step and env, on the training device.

        Consecutive observations of a game share 3 of their 4 pictures, so the buffer stores each 84x84
        picture once (the newest of each observation, 7,056 bytes per step instead of 28,224 for the
        stacks) and rebuilds the stacks of a minibatch by indexing (`stacks`). `rollout_pictures` has
        num_steps + 4 rows per game: rows 0-2 hold the 3 older pictures of the rollout's first stack
        (they come from the rollout before), row 3 + t the newest picture of step t, and the last row
        stays zeros, the picture before the start of an episode.
        """
        config, device = self.config, self.device
        shape = (config.num_steps, config.num_envs)
        self.rollout_pictures = torch.zeros((config.num_steps + FRAME_STACK, config.num_envs, FRAME_SIZE, FRAME_SIZE),
                                            dtype=torch.uint8, device=device)
        self.rollout_actions = torch.zeros(shape, dtype=torch.long, device=device)
        self.rollout_log_probs = torch.zeros(shape, device=device)
        self.rollout_values = torch.zeros(shape, device=device)
        # What the games return stays on the host during the rollout (page-locked on a GPU) and moves to
        # the device once per update: one copy each, instead of three small copies per step.
        pinned = device.type == "cuda"
        self.rollout_rewards = torch.zeros(shape, pin_memory=pinned)
        self.rollout_dones = torch.zeros(shape, pin_memory=pinned)
        # The stack restarted after step t (with the Game, at every done; see VectorGames for the other).
        self.rollout_restarts = torch.zeros(shape, dtype=torch.bool, pin_memory=pinned)

    def anneal_learning_rate(self):
        """Linear learning-rate annealing (37 details, #4): from learning_rate at step 0 to 0 at the end,
        set by the step at which each rollout starts, so that a resumed run continues the schedule."""
        config = self.config
        if config.anneal_lr:
            self.trainer.optimizer.param_groups[0]["lr"] = (
                config.learning_rate * max(0.0, 1.0 - self.global_step / config.total_timesteps))

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
            if step == 0:
                self.rollout_pictures[:FRAME_STACK - 1] = next_obs[:, :-1].transpose(0, 1)
            self.rollout_pictures[FRAME_STACK - 1 + step] = next_obs[:, -1]
            actions, log_prob, value = self.model.act(next_obs)
            self.rollout_actions[step] = actions
            self.rollout_log_probs[step] = log_prob
            self.rollout_values[step] = value
            rewards, terminated, truncated, restarted, final_obs, episodes = self.step_envs(actions.cpu().numpy())
            next_obs = self.observations()
            # Truncation is not death: an episode cut by a time limit would have gone on, so its last
            # reward gets the value of where it stood, gamma * V(final observation), added. Then the
            # done flag below can cut GAE's sum for both kinds of endings (see compute_gae).
            cut = [i for i in final_obs if truncated[i] and not terminated[i]]
            if cut:
                cut_obs = torch.from_numpy(np.stack([final_obs[i] for i in cut])).to(self.device)
                rewards[cut] += config.gamma * self.model.value(cut_obs).cpu().numpy()
            self.rollout_rewards[step] = torch.from_numpy(rewards)
            self.rollout_dones[step] = torch.from_numpy(terminated | truncated)
            self.rollout_restarts[step] = torch.from_numpy(restarted)
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
        # (non_blocking: the host buffers are not written again before this update's results are read)
        rewards, dones = (tensor.to(self.device, non_blocking=True) for tensor in (self.rollout_rewards, self.rollout_dones))
        advantages = compute_gae(rewards, self.rollout_values, dones, last_value, config.gamma, config.gae_lambda)
        returns = advantages + self.rollout_values
        self.find_episode_starts()
        batch = (self.rollout_actions.flatten(), self.rollout_log_probs.flatten(), advantages.flatten(),
                 returns.flatten(), self.rollout_values.flatten())
        batch_size = config.num_envs * config.num_steps
        minibatch_size = batch_size // config.num_minibatches
        totals, count = {}, 0
        for epoch in range(config.update_epochs):
            order = torch.randperm(batch_size, device=self.device)
            for start in range(0, batch_size, minibatch_size):
                indices = order[start:start + minibatch_size]
                stats = self.trainer.update(self.stacks(indices), *(tensor[indices] for tensor in batch))
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

    def find_episode_starts(self):
        """For each step and env, the step at which its stack last restarted within this rollout
        (-4 when it restarted before: the rollout's first stack already holds what it needs). A stack
        never reaches back past its restart: a restarted stack is zeros and the first picture."""
        restarts = self.rollout_restarts.to(self.device, non_blocking=True)
        step_index = torch.arange(self.config.num_steps, device=self.device)[:, None].expand_as(restarts)
        started = torch.zeros_like(restarts)
        started[1:] = restarts[:-1]  # a stack that restarted after step t-1 starts at step t
        self.episode_starts = torch.where(started, step_index, -FRAME_STACK).cummax(dim=0).values

    def stacks(self, indices: torch.Tensor) -> torch.Tensor:
        """The observations [batch, 4, 84, 84] of flat rollout indices (step * num_envs + env), rebuilt
        from the stored pictures exactly as the games built them."""
        num_envs = self.config.num_envs
        steps, envs = indices // num_envs, indices % num_envs
        # Picture k of the stack at step t is the newest picture of step t - 3 + k, in row t + k of
        # rollout_pictures; a picture from before the stack's restart is the zero picture (last row).
        sources = steps[:, None] - (FRAME_STACK - 1) + torch.arange(FRAME_STACK, device=self.device)
        rows = torch.where(sources >= self.episode_starts[steps, envs][:, None], sources + FRAME_STACK - 1,
                           len(self.rollout_pictures) - 1)
        # One gather of whole 84x84 pictures from the buffer seen as a list of pictures.
        pictures = self.rollout_pictures.view(-1, FRAME_SIZE, FRAME_SIZE)
        return pictures.index_select(0, (rows * num_envs + envs[:, None]).flatten()).view(
            len(indices), FRAME_STACK, FRAME_SIZE, FRAME_SIZE)

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
        writer.add_scalar("charts/learning_rate", self.trainer.optimizer.param_groups[0]["lr"], step)
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
            "script": SCRIPT, "env": self.config.env, "num_actions": self.num_actions,
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
            raise UsageError(f"the checkpoint's network does not fit {self.config.env} "
                             f"({self.num_actions} actions): {str(error).splitlines()[-1].strip()}") from None
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
        """Play --eval-episodes whole games (all lives) with a checkpoint's policy and report the real,
        unclipped score."""
        checkpoint = load_checkpoint(self.config.eval)
        config = resumed_config(checkpoint, self.config)
        check_settings(config)
        if config.eval_episodes <= 0:
            raise UsageError("--eval-episodes must be positive")
        self.num_actions = inspect_env(config.env)
        model = Model(self.num_actions, bfloat16=config.precision == "bfloat16")
        model.load_state_dict(checkpoint["model"])
        torch.manual_seed(config.seed)
        run_dir = Path(self.config.run_dir) if self.config.run_dir else Path(config.eval).parent
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
        print(f"eval {config.env}: return {mean:.2f} ± {std:.2f} over {len(returns)} episodes ({how} actions)")
        if video is not None:
            print(f"video: {run_dir / 'eval.mp4'}")
        return {"script": SCRIPT, "env": config.env, "episodes": len(returns), "mean_return": mean,
                "std_return": std, "returns": returns, "greedy": config.greedy,
                "video": str(run_dir / "eval.mp4") if video is not None else None}


def write_frame(video, game: Game, path: Path):
    """Append the game's current picture (in colour) to the mp4 (OpenCV's VideoWriter, opened at the
    first frame). One picture per agent step: the video plays at real speed."""
    frame = game.render()
    if video is None:
        path.parent.mkdir(parents=True, exist_ok=True)
        fps = game.env.metadata.get("render_fps", 60) / FRAME_SKIP
        video = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), fps, (frame.shape[1], frame.shape[0]))
        if not video.isOpened():
            raise UsageError(f"OpenCV cannot write {path}")
    video.write(cv2.cvtColor(frame, cv2.COLOR_RGB2BGR))
    return video


# ----- checking the input ---------------------------------------------------------------------------


def check_settings(config: Config):
    """Refuse settings that cannot work, with one line that says what to change."""
    for name in ("total_timesteps", "num_envs", "num_steps", "num_minibatches", "update_epochs",
                 "checkpoint_every"):
        if getattr(config, name) <= 0:
            raise UsageError(f"--{name.replace('_', '-')} must be positive, not {getattr(config, name)}")
    for name, choices in (("compile_mode", ("default", "reduce-overhead", "max-autotune")),
                          ("precision", ("float32", "bfloat16")), ("env_backend", ("game", "ale-vector"))):
        if getattr(config, name) not in choices:
            raise UsageError(f"unknown --{name.replace('_', '-')} {getattr(config, name)!r}: "
                             f"use {', '.join(choices[:-1])} or {choices[-1]}")
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


def inspect_env(env_id: str) -> int:
    """Check that the env exists and is an Atari game. Returns its number of actions."""
    if env_id not in gym.registry:
        close = difflib.get_close_matches(env_id, list(gym.registry), n=3, cutoff=0.6)
        hint = f"; did you mean {' or '.join(close)}?" if close else "; Atari ids look like ALE/Pong-v5 or PongNoFrameskip-v4"
        raise UsageError(f"unknown env {env_id!r}{hint}")
    if not str(gym.spec(env_id).entry_point).startswith("ale_py"):
        raise UsageError(f"{env_id} is not an Atari game: use ppo_cartpole.py for games with vector observations")
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
            if f.name == "env" and value != saved.get(f.name):
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
