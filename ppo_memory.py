"""PPO with memory, for games whose observation hides part of the state, in one file.

Proximal Policy Optimization (Schulman et al., 2017: "PPO paper") with the details of CleanRL and
SB3 ("The 37 Implementation Details of PPO", Huang et al., 2022: "37 details"; its "LSTM details").

The idea. PPO plays a batch of games (a "rollout") with the current policy, learns from it for
several epochs, and keeps the new policy near the one that played by clipping the probability
ratio rho_t = pi(a_t | h_t) / pi_old(a_t | h_t) (`Trainer.ppo_loss` derives it); the advantage
A_t, how much better a_t did than the value V(h_t) expected, comes from GAE (`compute_gae`).
Stateless CartPole (the default) hides the velocities: the policy acts on the history h_t =
(o_1, a_1, r_1, ..., o_t), which --memory keeps as the last step alone (none), the last k steps
side by side (framestack), a state carried along (lstm, gru) or a gated Transformer-XL block over
the last M steps (attention). rho_t is right only if training sees what the rollout saw.

Run it:         python ppo_memory.py --memory lstm   (stateless CartPole; --help lists every flag)
On N GPUs:      torchrun --standalone --nproc_per_node N ppo_memory.py   (data parallel: `Ranks`)
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

SCRIPT = "ppo_memory"


def option(default, help, check=None, choices=None):  # a Config field, its --help, its valid range
    return dataclasses.field(default=default,
                             metadata={"help": help, "check": check, "choices": choices})


# Each kind's own settings, for the fields Config leaves at None (benchmarks/README.md): lstm, gru
# and attention scale their rewards (unscaled, no setting met every seed of both games); lstm and
# gru look further ahead (gamma 0.99: at 0.98, a cart drifting off after ~150 steps went unseen).
KIND_FIELDS = ("learning_rate", "num_steps", "num_minibatches", "update_epochs", "hidden_size",
               "vf_coef", "gamma", "scale_rewards")
KIND_DEFAULTS = {kind: dict(zip(KIND_FIELDS, values)) for kind, values in {
    "none": (8e-3, 32, 2, 8, 64, 0.5, 0.98, False),
    "framestack": (8e-3, 32, 2, 8, 64, 0.5, 0.98, False),
    "lstm": (3e-3, 32, 4, 8, 128, 0.5, 0.99, True),
    "gru": (3e-3, 32, 4, 8, 128, 0.5, 0.99, True),
    "attention": (3e-3, 32, 4, 8, 64, 0.03, 0.98, True),
}.items()}


@dataclasses.dataclass
class Config:
    """Every setting of a run, each a command-line flag (`num_envs` -> `--num-envs`). A field left
    at None takes its --memory kind's value (KIND_DEFAULTS, just above)."""

    # PPO's hyperparameters.
    learning_rate: Optional[float] = option(None, "Adam's step size, annealed linearly to 0", "> 0")
    anneal_lr: bool = option(True, "anneal the learning rate linearly to 0 over the run")
    gamma: Optional[float] = option(None, "discount, by kind: 0.98 looks ~50 steps ahead", "(0, 1]")
    gae_lambda: float = option(0.95, "GAE: bias (0) vs variance (1) of the advantage", "[0, 1]")
    num_minibatches: Optional[int] = option(None, "minibatches per rollout, by env", "> 0")
    update_epochs: Optional[int] = option(None, "passes over each rollout", "> 0")
    clip_coef: float = option(0.2, "PPO's clip range for the probability ratio", "> 0")
    clip_value_loss: bool = option(False, "clip the value update too")
    ent_coef: float = option(0.0, "weight of the entropy bonus", ">= 0")
    vf_coef: Optional[float] = option(None, "weight of the value loss", ">= 0")
    max_grad_norm: float = option(0.5, "clip the global gradient norm to this", "> 0")
    target_kl: Optional[float] = option(None, "stop an update's epochs at this approx KL", "> 0")
    hidden_size: Optional[int] = option(None, "units of MLP layers and memory", "> 0")
    # Memory (the default kind solves stateless CartPole fastest: benchmarks/README.md).
    memory: str = option("framestack", "what the policy remembers", choices=tuple(KIND_DEFAULTS))
    frame_stack: int = option(4, "with --memory framestack: steps the policy sees", "> 0")
    attention_span: int = option(16, "with --memory attention: steps each step attends to", "> 0")
    prev_action_reward: bool = option(True, "give the model the previous action and reward too")
    normalize_observations: bool = option(True, "scale observations by a running mean and std")
    obs_clip: float = option(10.0, "clip normalised observations to +-this", "> 0")
    scale_rewards: Optional[bool] = option(None, "divide rewards by the running std of the return")
    # Collecting experience.
    env: str = option("StatelessCartPole-v1", "gymnasium id (popgym-* too): Discrete actions")
    num_envs: int = option(64, "games played side by side (by each rank, under torchrun)", "> 0")
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
    compile: bool = option(False, "torch.compile the loss (off: it takes longer than it saves)")


def with_kind_defaults(config: Config) -> Config:
    """The config with each field left at None set to its --memory kind's value."""
    chosen = {name: value for name, value in KIND_DEFAULTS.get(config.memory, {}).items()
              if getattr(config, name) is None}  # (an unknown kind: refused below the banner)
    return dataclasses.replace(config, **chosen)


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
        help, default = f.metadata["help"], f.default
        help += f" (valid: {f.metadata['check']})" if f.metadata["check"] else ""
        if f.name in KIND_FIELDS:  # each kind's value (Config keeps None; --help adds no default)
            help += " (default: " + ", ".join(
                f"{memory} {settings[f.name]}" for memory, settings in KIND_DEFAULTS.items()) + ")"
            default = argparse.SUPPRESS
        parser.add_argument(flag, default=default, help=help,
                            **({"action": argparse.BooleanOptionalAction} if kind is bool else
                               {"type": whole_number if kind is int else kind,
                                "choices": f.metadata["choices"]}))
    return Config(**vars(parser.parse_args(argv)))


if __name__ == "__main__" and "__file__" in globals():
    parse_config()  # --help and a mistyped flag answer here; `command_line` (the end) runs it all

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn

# The partially observed games: classic-control games without their velocities (a velocity is the
# change between two observations: only a memory can know it). id -> (the game, the entries kept).
STATELESS_ENVS = {"StatelessCartPole-v1": ("CartPole-v1", [0, 2]),  # cart position, pole angle
                  "StatelessAcrobot-v1": ("Acrobot-v1", [0, 1, 2, 3])}  # cos, sin of both angles


def make_stateless_env(base: str, keep: list, **kwargs) -> gym.Env:
    env = gym.make(base, **kwargs)
    space = env.observation_space
    kept = gym.spaces.Box(space.low[keep], space.high[keep], dtype=space.dtype)
    return gym.wrappers.TransformObservation(env, lambda obs: obs[keep], kept)


def register_stateless_envs():  # once, by the first Game (importing this file changes nothing)
    for env_id, (base, keep) in STATELESS_ENVS.items():
        if env_id not in gym.registry:
            gym.register(env_id, make_stateless_env, kwargs={"base": base, "keep": keep})


class Game:
    """One gymnasium env, observations as flat float32 vectors (discrete ones one-hot, as POPGym's
    cards). An ended episode restarts in the same step: `step` returns the next episode's first
    observation, the ended one's last in `info["final_obs"]`, its return and length in `info`."""

    def __init__(self, env_id: str, seed: int, **options):  # options: gym.make's (render_mode)
        register_stateless_envs()
        self.env = gym.make(env_id, **options)
        self.seed, self.first_action = seed, self.env.action_space.start

    def reset(self) -> np.ndarray:
        obs, _ = self.env.reset(seed=self.seed)  # seeded once; restarts continue its stream
        self.seed, self.episode_return, self.episode_length = None, 0.0, 0
        return gym.spaces.flatten(self.env.observation_space, obs).astype(np.float32)

    def step(self, action: int):  # (the model counts actions from 0, the env from its `start`)
        obs, reward, terminated, truncated, _ = self.env.step(action + self.first_action)
        obs, info = gym.spaces.flatten(self.env.observation_space, obs).astype(np.float32), {}
        self.episode_return += reward
        self.episode_length += 1
        if terminated or truncated:
            episode = {"return": float(self.episode_return), "length": self.episode_length}
            obs, info = self.reset(), {"final_obs": obs, "episode": episode}
        return obs, np.float32(reward), terminated, truncated, info


class StepResult(typing.NamedTuple):  # a step of all the games, besides the observations
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

    @staticmethod
    def step_games(games: list, actions: np.ndarray, obs_out: np.ndarray) -> tuple:
        """Step each Game, observations into obs_out: the other fields of a StepResult."""
        rewards, final_obs, episodes = np.zeros(len(games), dtype=np.float32), {}, {}
        terminated, truncated = np.zeros(len(games), bool), np.zeros(len(games), bool)
        for i, game in enumerate(games):
            obs_out[i], rewards[i], terminated[i], truncated[i], info = game.step(actions[i])
            if "episode" in info:
                final_obs[i], episodes[i] = info["final_obs"], info["episode"]
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


def layer(in_size: int, out_size: int, gain: float = math.sqrt(2)) -> nn.Linear:
    """Orthogonal weights of the given gain, zero biases (37 details, #2: sqrt(2) for hidden layers,
    0.01 for the policy output so that all actions start equally likely, 1 for the value)."""
    linear = nn.Linear(in_size, out_size)
    nn.init.orthogonal_(linear.weight, gain)
    nn.init.zeros_(linear.bias)
    return linear


class RunningMeanStd:
    """Running mean and variance of each observation entry, to normalise them (37 details,
    continuous-action #6: an angle of 0.05 rad beside a one-hot action of 1 would barely move a
    cell's gates), and of the discounted return, to scale the rewards (#8): a view of the Model's
    buffers, merged with each rollout by Chan et al.'s (1979) formula, exact for any split (delta =
    mean_b - mean_a, n = n_a + n_b): mean = mean_a + delta n_b / n,
    var = (var_a n_a + var_b n_b + delta^2 n_a n_b / n) / n"""

    def __init__(self, model: nn.Module, name: str):  # model's buffers name_mean, name_var, ...
        self.mean, self.var, self.count = (getattr(model, f"{name}_{part}")
                                           for part in ("mean", "var", "count"))

    @torch.no_grad()
    def update(self, batch: torch.Tensor, pooled=lambda moments, new: (moments, new)):
        """Merge a batch [n, size] in (`pooled`: torchrun's hook, pooling every rank's batch)."""
        size, count, new = batch.shape[-1], self.count.clone(), len(batch)
        moments, new = pooled(batch.mean(0).tolist() + batch.square().mean(0).tolist(), new)
        batch_mean = torch.tensor(moments[:size], device=batch.device)
        batch_var = torch.tensor(moments[size:], device=batch.device) - batch_mean ** 2
        delta, total, batch_var = batch_mean - self.mean, count + new, batch_var.clamp(min=0)
        self.mean += delta * new / total
        self.var.copy_((self.var * count + batch_var * new + delta ** 2 * count * new / total)
                       / total)
        self.count += new

    def scale(self, numbers: torch.Tensor) -> torch.Tensor:  # divided by the std, not centred
        return numbers / (self.var + 1e-8).sqrt()

    def normalize(self, obs: torch.Tensor, clip: float) -> torch.Tensor:  # continuous-action #7
        return self.scale(obs - self.mean).clamp(-clip, clip)


def encode_inputs(model: "Model", obs, prev_actions=None, prev_rewards=None, new_episode=None):
    """The model's input rows x_t = [o_t, one-hot(a_(t-1)), r_(t-1)], the last two 0 where an
    episode starts (`new_episode`, or no prev_actions); o_t normalised, once for all epochs."""
    if model.config.normalize_observations:
        obs = model.obs_stats.normalize(obs, model.config.obs_clip)
    if not model.config.prev_action_reward:
        return obs
    if prev_actions is None:
        return torch.cat([obs, obs.new_zeros(obs.shape[0], model.num_actions + 1)], dim=1)
    keep = 1.0 - new_episode.float()
    one_hot = nn.functional.one_hot(prev_actions, model.num_actions).float() * keep[:, None]
    return torch.cat([obs, one_hot, (prev_rewards.float() * keep)[:, None]], dim=1)


def episode_windows(inputs: torch.Tensor, starts: torch.Tensor, k: int) -> tuple:
    """The window of each row t, rows t-k+1..t gathered by index from rows stored once, and the
    window mask: which of them belong to row t's episode (not those before its start).
    [L, B, D] -> (windows [L-k+1, B, k, D] of rows k-1..L-1, oldest first; mask [L-k+1, B, k])."""
    length = inputs.shape[0]
    rows = torch.arange(k - 1, length, device=inputs.device)
    frames = rows[:, None] - (k - 1) + torch.arange(k, device=inputs.device)  # [T, k]
    # Where each row's episode began: the latest start at or before it (0 if none: all belong).
    start_rows = torch.arange(length, device=inputs.device)[:, None] * starts.long()
    episode_start = start_rows.cummax(dim=0).values[rows]  # [T, B]
    in_episode = frames[:, None, :] >= episode_start[:, :, None]  # [T, B, k]
    return inputs[frames].transpose(1, 2), in_episode


def stack_frames(inputs: torch.Tensor, starts: torch.Tensor, k: int) -> torch.Tensor:
    """Framestack: each window's rows side by side, earlier episodes' zeroed: [L-k+1, B, k*D]."""
    windows, in_episode = episode_windows(inputs, starts, k)
    return (windows * in_episode[..., None]).flatten(2)


class GRUGate(nn.Module):
    """GTrXL's gate (Parisotto et al., 2020, eq. 8-11), a GRU joining a sublayer's output y to the
    stream x: r = sigmoid(W_r y + U_r x), z = sigmoid(W_z y + U_z x - b_g), out = (1 - z) x + z h
    with h = tanh(W_g y + U_g (r x)). b_g = 2: z starts near 0.12, the block near the identity."""

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


class GatedAttention(nn.Module):
    """--memory attention: a linear+tanh encoder and one block of the Gated Transformer-XL (GTrXL,
    Parisotto et al., 2020): each step queries its window of the last M steps, never across an
    episode start; positions relative to the step; pre-LayerNorm; a `GRUGate` for the residual.
    No state: training re-encodes the stored rows with the current weights, so the ratio starts at
    exactly 1 (CleanRL's ppo_trxl caches each layer's states, stale after one epoch)."""

    def __init__(self, input_size: int, size: int, span: int, heads: int = 4):
        super().__init__()
        self.encoder = nn.Sequential(layer(input_size, size), nn.Tanh())
        self.span, self.heads = span, heads
        self.attention_norm, self.mlp_norm = nn.LayerNorm(size), nn.LayerNorm(size)
        self.query, self.key_value = layer(size, size, 1.0), layer(size, 2 * size, 1.0)
        self.attention_output = layer(size, size, 1.0)
        self.mlp = nn.Sequential(layer(size, size), nn.ReLU(), layer(size, size, 1.0))
        self.attention_gate, self.mlp_gate = GRUGate(size), GRUGate(size)
        # Slot j lies span - 1 - j steps back: fixed sinusoids of that distance (Vaswani et al.).
        angles = torch.arange(span - 1, -1, -1.0)[:, None] * torch.exp(
            torch.arange(0, size, 2) * (-math.log(10_000.0) / size))  # distance * frequency
        codes = torch.stack([angles.sin(), angles.cos()], dim=-1).flatten(1)  # sin, cos, sin, ...
        self.register_buffer("distance_codes", codes, persistent=False)

    def forward(self, inputs: torch.Tensor, starts: torch.Tensor, memory: tuple):
        """Rows [L, B, D] -> (the newest M-windows' features [L-M+1, B, F], memory: () as given)."""
        windows, in_episode = episode_windows(self.encoder(inputs), starts, self.span)
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
        return self.mlp_gate(stream, torch.relu(self.mlp(self.mlp_norm(stream)))), memory


class RecurrentCell(nn.Module):
    """--memory lstm, gru: a linear+tanh encoder and one cell (CleanRL's LSTM PPO; LSTM details, #1:
    orthogonal weights, zero biases), stepped along rows [L, B, D] from the state before them."""

    def __init__(self, kind: str, input_size: int, hidden: int):
        super().__init__()
        self.encoder = nn.Sequential(layer(input_size, hidden), nn.Tanh())
        self.cell = (nn.LSTMCell if kind == "lstm" else nn.GRUCell)(hidden, hidden)
        for name, weights in self.cell.named_parameters():
            nn.init.orthogonal_(weights) if "weight" in name else nn.init.zeros_(weights)

    def forward(self, inputs: torch.Tensor, starts: torch.Tensor, memory: tuple):
        features = []  # h of each row [L, B, hidden], and the state after the last
        for x, start in zip(self.encoder(inputs), starts):
            # LSTM details, #3: the state restarts at zero where an episode starts (a reset at the
            # end of the one before), in a rollout and in training (#5: rebuilt step by step).
            memory = tuple(state * (1.0 - start)[:, None] for state in memory)
            memory = self.cell(x, memory) if len(memory) == 2 else (self.cell(x, memory[0]),)
            features.append(memory[0])
        return torch.stack(features), memory


class Model(nn.Module):
    """The actor-critic with memory, over `inputs` [L, B, D] (rows of `encode_inputs`), `starts`
    [L, B] (1 where an episode starts) and `memory` (the state before the first row: the actor's
    (h, c) and the critic's for lstm, (h,) each for gru, () otherwise). none, framestack: the last 1
    or k rows side by side into separate 64-64 tanh MLPs (37 details, #13); lstm, gru, attention:
    a RecurrentCell (GatedAttention) each for actor and critic, as sb3-contrib's RecurrentPPO (one
    shared cell, pulled by the value loss too, fails StatelessAcrobot). It holds the statistics."""

    def __init__(self, obs_size: int, num_actions: int, config: Config):
        super().__init__()
        self.kind, self.num_actions, self.config = config.memory, num_actions, config
        for name, size in (("obs", obs_size), ("return", 1)):  # `obs_stats`, `return_stats`
            self.register_buffer(f"{name}_mean", torch.zeros(size))
            self.register_buffer(f"{name}_var", torch.ones(size))
            self.register_buffer(f"{name}_count", torch.tensor(1e-4))
        self.input_size = obs_size + (num_actions + 1 if config.prev_action_reward else 0)
        # Rows of the rollout that one step reads: its own, and the k - 1 (M - 1) before it.
        self.window = {"framestack": config.frame_stack, "attention": config.attention_span}.get(
            self.kind, 1)
        hidden, self.stacks_frames = config.hidden_size, self.kind in ("none", "framestack")
        if self.stacks_frames:
            mlp = lambda out_size, gain: nn.Sequential(
                layer(self.input_size * self.window, hidden), nn.Tanh(), layer(hidden, hidden),
                nn.Tanh(), layer(hidden, out_size, gain))
            self.critic, self.actor = mlp(1, 1.0), mlp(num_actions, 0.01)
            return
        self.actor_memory, self.critic_memory = (
            GatedAttention(self.input_size, hidden, self.window) if self.kind == "attention"
            else RecurrentCell(self.kind, self.input_size, hidden) for _ in range(2))
        self.critic, self.actor = layer(hidden, 1, gain=1.0), layer(hidden, num_actions, gain=0.01)

    obs_stats = property(lambda self: RunningMeanStd(self, "obs"))  # o_t's, to normalise them
    return_stats = property(lambda self: RunningMeanStd(self, "return"))  # R_t's: scale rewards

    def initial_memory(self, batch: int, device=None) -> tuple:  # zeros (LSTM details, #2)
        hidden, count = self.config.hidden_size, {"lstm": 4, "gru": 2}.get(self.kind, 0)
        return tuple(torch.zeros(batch, hidden, device=device) for _ in range(count))

    def remember(self, inputs: torch.Tensor, starts: torch.Tensor, memory: tuple):
        """Rows [L, B, D] -> (features [L', B, F], the memory after the last row). The rollout
        passes a step (and its window) and the games' state; training, a whole rollout and its
        first state (`Rollout.first_memory`): the same rows, the same states, with a gradient."""
        if self.stacks_frames:  # none: a window of 1
            return stack_frames(inputs, starts, self.window), memory
        half = len(memory) // 2  # the actor's state, then the critic's; their h side by side
        actor, actor_memory = self.actor_memory(inputs, starts, memory[:half])
        critic, critic_memory = self.critic_memory(inputs, starts, memory[half:])
        return torch.cat([actor, critic], dim=-1), actor_memory + critic_memory

    def heads(self, features: torch.Tensor) -> tuple:
        """The policy's logits [..., actions] and V(h) [...] (memory kinds: each from its half)."""
        halves = (features, features) if self.stacks_frames else features.chunk(2, dim=-1)
        return self.actor(halves[0]), self.critic(halves[1]).squeeze(-1)

    def act(self, inputs, starts, memory, greedy: bool = False):
        """Actions for each env's last row: (actions [B], log-probs, values, memory after it)."""
        features, memory = self.remember(inputs, starts, memory)
        logits, values = self.heads(features[-1])
        log_probs = torch.log_softmax(logits, dim=-1)
        actions = log_probs.argmax(-1) if greedy else torch.multinomial(log_probs.exp(), 1)[:, 0]
        log_prob = log_probs.gather(-1, actions[:, None]).squeeze(-1)
        return actions, log_prob, values, memory

    def evaluate_actions(self, inputs, starts, memory, actions):
        """For the loss: log pi(a_t | h_t), the entropy and V, each [T * B], time-major."""
        logits, values = self.heads(self.remember(inputs, starts, memory)[0])
        log_probs = torch.log_softmax(logits, dim=-1)
        log_prob = log_probs.gather(-1, actions.unsqueeze(-1)).squeeze(-1)
        entropy = -(log_probs.exp() * log_probs).sum(-1)
        return log_prob.flatten(), entropy.flatten(), values.flatten()


def compute_gae(rewards, values, dones, last_value, gamma: float, gae_lambda: float):
    """Generalized Advantage Estimation (Schulman et al., 2016; PPO paper, eq. 11-12).

    rewards, values, dones: [T, N] (time, env); last_value: [N], the value of the observation after
    the last step. Returns the advantages [T, N]; the value targets are advantages + values.

    A_t = Q(s_t, a_t) - V(s_t) (s_t: here the history h_t): how much better a_t did than the critic
    expected. With the TD error delta_t = r_t + gamma V(s_(t+1)) - V(s_t), the k-step estimators
    A_t^(k) = sum_(l<k) gamma^l delta_(t+l) = sum_(l<k) gamma^l r_(t+l) + gamma^k V(s_(t+k)) -
    V(s_t) trade bias for variance: few steps lean on V (biased where V is wrong), many on the
    sampled rewards (unbiased, but each adds its noise). GAE averages them, weighted (1 - lambda)
    lambda^(k-1); the sum telescopes into discounted TD errors, computed backwards:
    $\\hat{A}_t = \\sum_l (\\gamma\\lambda)^l \\delta_{t+l}
                = \\delta_t + \\gamma\\lambda (1 - d_t) \\hat{A}_{t+1}$
    (lambda = 0: the one-step estimate; 1: the sampled return minus V). `dones[t] = 1` (d_t) when
    the episode ended at step t, by termination or truncation: the sum stops there (a truncation's
    gamma * V(final observation) is already in rewards[t]). (CleanRL's `dones[t]` means "obs[t]
    starts a new episode", one step later; the advantages are the same.)
    """
    advantages = torch.zeros_like(rewards)
    next_advantage, next_value = torch.zeros_like(last_value), last_value
    for t in reversed(range(rewards.shape[0])):
        not_done = 1.0 - dones[t]
        delta = rewards[t] + gamma * next_value * not_done - values[t]
        advantages[t] = next_advantage = delta + gamma * gae_lambda * not_done * next_advantage
        next_value = values[t]
    return advantages


class Minibatch(typing.NamedTuple):
    """Whole env sequences (LSTM details, #4: minibatches split the envs, not the steps, so that the
    memory can be rebuilt); the per-step fields flattened to [T * B], time-major."""

    inputs: torch.Tensor  # [window - 1 + T, B, input_size]: the model's input rows
    starts: torch.Tensor  # [window - 1 + T, B]: 1 where a step starts an episode
    memory: tuple  # the recurrent state at the start of the rollout, [B, hidden] each
    actions: torch.Tensor  # [T, B], the actions taken
    old_log_probs: torch.Tensor  # their log-probabilities then
    advantages: torch.Tensor  # from GAE
    returns: torch.Tensor  # the value targets: advantages + old values
    old_values: torch.Tensor  # the values then


class Rollout:
    """Each step as the rollout saw it: input rows stored once (row `history` + step; the first
    window - 1 are the last rollout's), start flags, and `first_memory`, the state the games carried
    in (LSTM details, #5). A sequence is one env's whole rollout: no padding, no step masked out."""

    def __init__(self, config: Config, model: Model, device: torch.device):
        self.history = model.window - 1
        rows = (self.history + config.num_steps, config.num_envs)
        self.inputs = torch.zeros(rows + (model.input_size,), device=device)
        self.starts = torch.zeros(rows, device=device)
        shape = (config.num_steps, config.num_envs)
        self.actions = torch.zeros(shape, dtype=torch.long, device=device)
        self.log_probs, self.values, self.rewards, self.dones, self.discounted_returns = (
            torch.zeros(shape, device=device) for _ in range(5))
        self.observations = torch.zeros(shape + model.obs_mean.shape, device=device)  # for stats
        self.first_memory = ()

    def keep_history(self):  # the last `history` rows to the front, before new ones overwrite them
        if self.history:
            self.inputs[:self.history] = self.inputs[-self.history:].clone()
            self.starts[:self.history] = self.starts[-self.history:].clone()

    def minibatch(self, indices: torch.Tensor, advantages, returns) -> Minibatch:
        """The whole sequences of the envs `indices`, in time order, with their start states."""
        return Minibatch(self.inputs[:, indices], self.starts[:, indices],
                         tuple(state[indices] for state in self.first_memory),
                         self.actions[:, indices], self.log_probs[:, indices].flatten(),
                         advantages[:, indices].flatten(), returns[:, indices].flatten(),
                         self.values[:, indices].flatten())


def value_after(model: Model, rollout: Rollout, row: int, new_input: torch.Tensor,
                new_start: torch.Tensor, memory: tuple) -> torch.Tensor:
    """V of the step after rollout row `row` (new_input, new_start), seen by `memory` (the state
    after that row) and the window up to it: what a rollout's end or a time-limit cut bootstraps."""
    earlier = slice(row + 2 - model.window, row + 1)
    features, _ = model.remember(torch.cat([rollout.inputs[earlier], new_input[None]]),
                                 torch.cat([rollout.starts[earlier], new_start[None]]), memory)
    return model.heads(features[-1])[1]


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

        Why a ratio: the actions were drawn by pi_old, the policy that played the rollout, but the
        gradient should raise E_{a ~ pi_theta}[A]. Importance sampling reweights each sample by
        rho_t = pi_theta(a_t|h_t) / pi_old(a_t|h_t): E_{pi_theta}[A] = E_{pi_old}[rho_t A_t]. So
        one rollout serves several epochs, but the estimate worsens as the policies part (rho_t's
        variance grows); and pi_theta must see the history h_t that pi_old saw (`Rollout`).
        Why clip: TRPO bounds the move with a KL constraint; PPO (paper, eq. 7) stops rewarding it
        beyond [1 - eps, 1 + eps]: L_clip = E_t[min(rho_t A_t, clip(rho_t, 1 - eps, 1 + eps) A_t)].
        Once rho_t is out of range in the helpful direction, the clipped term is constant: no
        gradient, the sample stops pulling. Why the minimum: it makes L_clip a pessimistic bound,
        so that a move that made things worse (rho_t < 1 - eps with A_t > 0) is never hidden: the
        unclipped term is then the smaller one, and its gradient pulls back.
        """
        advantages = minibatch.advantages  # normalised per minibatch (37 details, #7)
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
        # Diagnostics (37 details, #12): approx KL by the low-variance (rho - 1) - log rho
        # (Schulman, "Approximating KL divergence", 2020), and the share the clip touched.
        with torch.no_grad():
            approx_kl = ((ratio - 1) - log_ratio).mean()
            clip_fraction = ((ratio - 1).abs() > config.clip_coef).float().mean()
        return loss, {"policy_loss": policy_loss, "value_loss": value_loss, "entropy": entropy_mean,
                      "approx_kl": approx_kl, "clip_fraction": clip_fraction}

    def compute_loss(self, minibatch: Minibatch):  # under the current weights (--compile's part)
        new_log_probs, entropy, new_values = self.model.evaluate_actions(
            minibatch.inputs, minibatch.starts, minibatch.memory, minibatch.actions)
        return self.ppo_loss(minibatch, new_log_probs, entropy, new_values, self.config)

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
    """The plain run `Main.train` talks to: the kind's settings, seeds, device, sizes, the games,
    progress, summary. `RunGuard` (below the banner) extends it: Ctrl-C, checkpoints, torchrun..."""

    solved_step = None  # the step at which --target-return was reached
    config = property(lambda self: self.main.config)  # the run's settings

    def __init__(self, main: "Main"):
        self.main, self.games, self.summary = main, None, None
        self.returns, self.episodes, self.updates = deque(maxlen=100), 0, 0  # the last 100

    def __enter__(self) -> "Run":
        """The kind's settings; seed torch's draws (sampling, shuffling); the device, the sizes."""
        config = self.main.config = with_kind_defaults(self.config)
        self.start_time, self.steps_per_step = time.perf_counter(), config.num_envs
        torch.manual_seed(config.seed)
        use_cuda = config.device != "cpu" and torch.cuda.is_available()
        self.device = torch.device("cuda" if use_cuda else "cpu")
        env = Game(config.env, config.seed).env  # the sizes the Model is built for
        space, actions = env.observation_space, env.action_space
        self.obs_size, self.num_actions = gym.spaces.flatdim(space), int(actions.n)
        env.close()
        return self

    prepare_learner = lambda self: 0  # the step to start from (RunGuard's: --resume's)
    stop_at_once = lambda self: False  # end the rollout now (RunGuard's: after Ctrl-C)
    mean = lambda self, value: value  # a number's mean over the ranks (RunGuard's: torchrun)
    optimizer = torch.optim.Adam  # the Trainer's (RunGuard's: a copy, the same steps, 2 s sooner)
    pooled = lambda self, moments, count: (moments, count)  # a batch's, pooled likewise

    def start_games(self) -> Worker:
        """All the games in one Worker, game i seeded with seed + i (RunGuard's: --num-workers)."""
        obs = torch.zeros(self.config.num_envs, self.obs_size).share_memory_()
        self.games = Worker(0, self.config.env, self.config.seed, obs.numpy())
        return self.games

    def after_rollout(self, ended: list):
        """Record the (global step, episode) of the episodes that ended; note the target."""
        target = self.config.target_return
        for step, episode in ended:
            self.episodes += 1
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
        config, returns = self.config, self.returns
        self.summary = {"script": SCRIPT, "env": config.env, "memory": config.memory,
                        "seed": config.seed, "steps": getattr(self.main, "global_step", 0),
                        "seconds": round(time.perf_counter() - self.start_time, 3),
                        "episodes": self.episodes, "solved_step": self.solved_step,
                        "mean_return_100": float(np.mean(returns)) if returns else None}

    @staticmethod
    def evaluate(config: Config) -> dict:  # --eval: the machinery's (below the banner)
        raise NotImplementedError("--eval plays a checkpoint: the machinery below the banner")


class Main:
    """The loop: `Main(config).run()` trains (or --eval plays) and returns the summary as a dict.
    One iteration (37 details, #6): a rollout carrying the memory, GAE, epochs of PPO steps."""

    def __init__(self, config: Config):  # anneal_from: (step, rate) where annealing starts
        self.config, self.guard = config, None
        self.anneal_from = (0, with_kind_defaults(config).learning_rate)

    def run(self) -> dict:
        # The one lookup of the machinery: RunGuard extends Run; cut at the banner, Run runs alone.
        run_class = globals().get("RunGuard", Run)
        return run_class.evaluate(self.config) if self.config.eval else self.train(run_class)

    def train(self, run_class: type) -> dict:
        self.guard = run_class(self)  # the kind's settings, seeds, the games, progress, summary
        with self.guard as guard:
            config = self.config  # (with the kind's defaults; the checkpoint's, when resuming)
            self.model = Model(guard.obs_size, guard.num_actions, config).to(guard.device)
            self.trainer = Trainer(self.model, config, guard.optimizer)
            self.global_step = guard.prepare_learner()  # 0, or --resume's; compile, torchrun
            self.games = guard.start_games()  # Workers; observations through shared memory
            self.rollout = Rollout(config, self.model, guard.device)
            # Every game starts an episode: zero memory, no previous action or reward.
            self.memory = self.model.initial_memory(config.num_envs, guard.device)
            self.next_input = encode_inputs(self.model, self.games.observations().to(guard.device))
            self.next_start = torch.ones(config.num_envs, device=guard.device)
            self.discounted_returns = torch.zeros(config.num_envs, device=guard.device)  # R_t
            while self.global_step < config.total_timesteps:
                self.anneal_learning_rate()
                self.collect_rollout()  # 1. play with the current policy, carrying the memory
                if guard.solved_step is not None:
                    break  # the target was reached in this rollout: the policy is good enough
                advantages, returns = self.estimate_advantages()  # 2. GAE
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
    def collect_rollout(self):
        """Play num_steps steps in every game, into the rollout, carrying the games' memory."""
        config, rollout, model, device = self.config, self.rollout, self.model, self.guard.device
        rollout.keep_history()
        rollout.first_memory, ended = self.memory, []  # LSTM details, #5: training starts here
        for step in range(config.num_steps):
            if self.guard.stop_at_once():  # Ctrl-C
                break
            row = rollout.history + step
            rollout.inputs[row], rollout.starts[row] = self.next_input, self.next_start
            window = slice(row + 1 - model.window, row + 1)  # this row and the window - 1 before
            actions, rollout.log_probs[step], rollout.values[step], memory = model.act(
                rollout.inputs[window], rollout.starts[window], self.memory)
            rollout.actions[step] = actions
            result = self.games.step(actions.cpu().numpy())
            observations = self.games.observations().to(device)
            raw_rewards = torch.from_numpy(result.rewards).to(device)
            done = torch.from_numpy(result.terminated | result.truncated).to(device).float()
            # Reward scaling (37 details, continuous-action #8): r_t / std(R) with R_t = r_t + gamma
            # R_(t-1), std(R) that of the rollouts before: values near 1 whatever the game pays, so
            # that the value loss does not set the global clip's norm for the policy too. Not
            # centred: a shift would change whether long episodes pay.
            if config.scale_rewards:
                rollout.discounted_returns[step] = returns = (self.discounted_returns * config.gamma
                                                              + raw_rewards)
                self.discounted_returns = returns * (1 - done)  # 0 where an episode ended
                rewards = model.return_stats.scale(raw_rewards)
            else:  # (a copy: a cut below adds to it, and raw_rewards is the next input)
                rewards = raw_rewards.clone()
            # Truncation is not death: a time-limit cut adds gamma * V(final obs) to its last
            # reward, V seen by the memory *after* this step (not a reset one); GAE then cuts there.
            cut = [i for i in result.final_obs if result.truncated[i] and not result.terminated[i]]
            if cut:
                last_obs = observations.clone()
                last_obs[cut] = torch.tensor(np.stack([result.final_obs[i] for i in cut]),
                                             device=device)
                final = encode_inputs(model, last_obs, actions, raw_rewards, done * 0)
                rewards[cut] += config.gamma * value_after(model, rollout, row, final, done * 0,
                                                           memory)[cut]
            rollout.rewards[step], rollout.dones[step] = rewards, done
            rollout.observations[step] = observations
            # The next input: the new observation, this action and reward (zeros if it restarted).
            self.next_input = encode_inputs(model, observations, actions, raw_rewards, done)
            self.next_start, self.memory = done, memory
            self.global_step += self.guard.steps_per_step  # num_envs of every rank
            ended += [(self.global_step, episode) for episode in result.episodes.values()]
        self.guard.after_rollout(ended)  # record the episodes (RunGuard's: stop on Ctrl-C)
        if config.normalize_observations:  # (hook: under torchrun, those of all ranks' batches)
            model.obs_stats.update(rollout.observations.flatten(0, 1), self.guard.pooled)
        if config.scale_rewards:
            model.return_stats.update(rollout.discounted_returns.flatten()[:, None],
                                      self.guard.pooled)

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
        envs, LSTM details, #4); the mean diagnostics."""
        config, steps = self.config, []
        envs_per_minibatch = config.num_envs // config.num_minibatches
        for epoch in range(config.update_epochs):
            order = torch.randperm(config.num_envs, device=self.guard.device)
            for start in range(0, config.num_envs, envs_per_minibatch):
                minibatch = self.rollout.minibatch(order[start:start + envs_per_minibatch],
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
# A reader of PPO may stop here. What follows makes the lesson fast, safe and scalable, section by
# section: `RunGuard` and `RunLog` extend the lesson's plain `Run` (Ctrl-C, failures, logging).

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

# ----- Engines: the games, fast and guarded; the loss compiled; Adam written out ------------------


class GuardedWorker(Worker):
    """A Worker made safe for long runs. The child ignores SIGINT (the trainer decides how to stop),
    reports its Games' errors in one line, and closes its copies of the trainer's pipe ends: it
    exits once the trainer is gone. The trainer waits on the pipe and the process at once: a child
    that dies is reported (WorkerError) instead of blocking `recv()` forever."""

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

    def send_step(self, actions: np.ndarray):  # (WorkerPool sends to all, then receives)
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
        self.games = [Game(env_id, seed + i) for i in range(len(obs_view))]  # as in Worker's child
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
        self.device, self.workers, self.shared_obs = device, [], None
        shape = (config.num_envs, obs_size)
        if config.num_workers == 0:
            self.obs_array = np.zeros(shape, dtype=np.float32)
        else:
            self.shared_obs = shared_memory.SharedMemory(create=True, size=int(np.prod(shape)) * 4)
            self.obs_array = np.ndarray(shape, dtype=np.float32, buffer=self.shared_obs.buf)
        worker_class = GuardedWorker if config.num_workers else InProcessWorker
        games_per_worker = config.num_envs // max(config.num_workers, 1)
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

    def observations(self) -> torch.Tensor:  # on the training device (no copy on the CPU)
        return self.obs_tensor.to(self.device)

    def step(self, actions: np.ndarray) -> StepResult:  # all sent first: children run in parallel
        for worker in self.workers:
            worker.send_step(actions[worker.first:worker.first + len(worker.obs_view)])
        results = [worker.receive() for worker in self.workers]
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


def compile_learner(main: Main):
    """torch.compile the loss and its backward: off by default (the recurrent kinds' Python loop
    compiles into a long graph, seconds small games never earn back). A machine that cannot
    compile falls back to eager at the first minibatch, with a one-line warning."""
    logging.getLogger("torch.utils.cpp_extension").addFilter(not_the_cuda_home_warning)
    trainer = main.trainer
    eager_loss, compiled_loss = trainer.compute_loss, torch.compile(trainer.compute_loss)

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

    solved_step = property(lambda self: self.log.solved_step)  # --target-return was reached
    evaluate = staticmethod(lambda config: evaluate_checkpoint(config))  # --eval
    optimizer = Adam if Run.optimizer is torch.optim.Adam else Run.optimizer  # torch's, faster

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
        config = resumed_config(self.checkpoint, self.config)  # (and the kind's defaults)
        check_settings(config)
        self.obs_size, self.num_actions = inspect_env(config.env)
        refuse_a_rollout_too_large(config, self.obs_size, self.num_actions)
        self.ranks = Ranks(pick_device(config.device))  # under torchrun, a GPU each; alone, one
        self.device = self.ranks.device
        self.steps_per_step = config.num_envs * self.ranks.world_size  # all envs of all ranks
        # Rank 0 names and makes the run dir: the default name holds the time, which may differ.
        self.run_dir = self.ranks.from_rank_0(lambda: make_run_dir(config, self.checkpoint))
        self.main.config = config = dataclasses.replace(config, run_dir=str(self.run_dir))
        # Torch's generator makes the trainer's draws (sampling, shuffling): rank r seeds seed + r.
        self.seed = config.seed + self.ranks.rank
        random.seed(self.seed)
        np.random.seed(self.seed)
        torch.manual_seed(self.seed)
        # One thread is fastest for networks this small (benchmarks/README.md); given back after.
        torch.set_num_threads(1)
        self.updates, self.checkpoint_path = 0, self.run_dir / "checkpoint.pt"
        self.log = RunLog(self, start_time)

    def prepare_learner(self) -> int:
        """--resume's checkpoint, rank 0's weights everywhere, --compile: the step to start at."""
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
        return self.games

    def stop_at_once(self) -> bool:  # under torchrun, all ranks stop together after the rollout
        return self.stop_signal is not None and not self.ranks.distributed

    def mean(self, value: float) -> float:  # over the ranks (the value itself without torchrun)
        return self.ranks.mean([value])[0]

    def pooled(self, moments: list, count: int) -> tuple:  # every rank's batch: the same stats
        return self.ranks.mean(moments), count * self.ranks.world_size

    def after_rollout(self, ended: list):
        """Record the episodes that ended (under torchrun every rank's, by step, then rank: the same
        on all); raise Interrupted if any rank was asked to stop."""
        shared = self.ranks.gather((ended, self.stop_signal))
        for step, episode in sorted((item for rank_ended, _ in shared for item in rank_ended),
                                    key=lambda step_and_episode: step_and_episode[0]):
            self.log.record_episode(episode, step)
        signals = [signum for _, signum in shared if signum is not None]
        if signals:
            self.stop_signal = signals[0]
            raise Interrupted

    def after_update(self, stats: dict):  # the ranks' mean: stop if not finite, else log and save
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

    def give_back(self):  # what the run changed in this process: signal handlers, torch's threads
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

    def start(self):  # the start-up block: what runs where, what is not the default, how far
        guard, config, step = self.guard, self.guard.config, self.main.global_step
        batch = guard.steps_per_step * config.num_steps
        self.last_step = step + max(0, math.ceil((config.total_timesteps - step) / batch)) * batch
        rounded = (f" ({config.total_timesteps:,} rounded up to whole rollouts of {batch:,})"
                   if self.last_step != config.total_timesteps else "")
        self.say(f"{SCRIPT}.py: {config.env} on {guard.device}, seed {config.seed}, "
                 f"{self.last_step:,} steps{rounded}\nrun dir: {guard.run_dir}")
        self.say("learner: the lesson's torch code (Model, Trainer, compute_gae)"
                 + (", torch.compile" if config.compile else ""))
        workers = config.num_workers
        self.say("engine: the lesson's Game, " + (
            f"{config.num_envs // workers} per Worker in {workers} child processes" if workers
            else f"{config.num_envs} in this process"))
        self.say(f"memory: {memory_line(config)}")
        defaults = {f.name: f.default for f in dataclasses.fields(Config)}
        defaults.update(KIND_DEFAULTS[config.memory])  # (a per-kind field: its kind's value)
        changed = [(name.replace("_", "-"), getattr(config, name)) for name in defaults
                   if name != "run_dir" and getattr(config, name) != defaults[name]]
        if changed:
            self.say("settings: " + " ".join(f"--{'' if value else 'no-'}{flag}"
                                              if isinstance(value, bool) else f"--{flag} {value}"
                                              for flag, value in changed))
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
        rate = self.main.trainer.optimizer.param_groups[0]["lr"]
        writer.add_scalar("charts/learning_rate", rate, step)
        speed = self.steady_speed()
        if speed is not None:
            writer.add_scalar("charts/steps_per_second", speed, step)
        if time.perf_counter() - self.last_print >= 1.0:
            self.print_progress()

    def seconds(self) -> float:  # wall-clock, of the whole run: the parts it resumed, and this one
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

    def finish(self, interrupted: bool, failed: bool) -> dict:
        """Write summary.json, print the last progress line (once) and how the run ended."""
        guard, config, step = self.guard, self.guard.config, self.main.global_step
        speed, path = self.steady_speed(), guard.run_dir / "summary.json"
        summary = {
            "script": SCRIPT, "env": config.env, "memory": config.memory, "seed": config.seed,
            "steps": step, "seconds": round(self.seconds(), 3),
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


def memory_line(config: Config) -> str:  # the start-up block's: the kind and its settings
    each = "each for actor and critic"
    what = {"none": "each step alone, in MLPs",
            "framestack": f"the last {config.frame_stack} steps side by side, in MLPs",
            "attention": f"a gated Transformer-XL block {each} over the last "
                         f"{config.attention_span} steps"}.get(config.memory, f"a cell {each}")
    inputs = ", with the previous action and reward" if config.prev_action_reward else ""
    return (f"{config.memory}, {what}, {config.hidden_size} units, sequences of "
            f"{config.num_steps} steps{inputs}")

# ----- Checkpoints, evaluation and video ----------------------------------------------------------


def learner_state(main: Main) -> dict:
    """Everything needed to continue learning: only tensors, numbers, strings, lists and dicts, so
    that torch.load(..., weights_only=True) can read it back (a checkpoint cannot run code)."""
    guard = main.guard
    return {
        "script": SCRIPT, "env": main.config.env, "memory": main.config.memory,
        "obs_size": guard.obs_size, "num_actions": guard.num_actions,
        "config": dataclasses.asdict(main.config), "rng": {"torch": torch.get_rng_state()},
        "model": main.model.state_dict(), "optimizer": main.trainer.optimizer.state_dict(),
        "global_step": main.global_step, "updates": guard.updates,
        "anneal_from": list(main.anneal_from), "log": guard.log.state(),
    }


def load_weights(model: Model, weights: dict, config: Config):
    """Load a checkpoint's weights (--resume, --eval), refusing in one line ones that do not fit."""
    try:
        model.load_state_dict(weights)
    except RuntimeError as error:
        raise UsageError(f"the checkpoint's network does not fit {config.env} with --memory "
                         f"{config.memory}, hidden size {config.hidden_size}: "
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


# The settings a checkpoint's weights are made for: another value cannot resume or evaluate them.
NETWORK_FIELDS = ("env", "hidden_size", "memory", "frame_stack", "attention_span",
                  "prev_action_reward", "normalize_observations")


def resumed_config(checkpoint: Optional[dict], given: Config) -> Config:
    """The settings of a resumed (or evaluated) run: the checkpoint's, but those given (e.g. a new
    --total-timesteps) win; the run dir: the checkpoint's folder unless given. A different env or
    network is refused. Without a checkpoint: the given settings, with the kind's defaults."""
    if checkpoint is None:
        return with_kind_defaults(given)
    fields = dataclasses.fields(Config)
    saved = {f.name: checkpoint["config"][f.name] for f in fields if f.name in checkpoint["config"]}
    saved["run_dir"] = str(Path(checkpoint["path"]).parent)
    typed = getattr(given, "typed", None)  # the command line's flags (None: Config(...) in code)
    changed = {f.name: getattr(given, f.name) for f in fields
               if (f.name in typed if typed is not None else getattr(given, f.name) != f.default)}
    for name in NETWORK_FIELDS:
        if name in changed and changed[name] != saved.get(name):
            raise UsageError(f"the checkpoint was trained with --{name.replace('_', '-')} "
                             f"{saved.get(name)}, not {changed[name]}")
    return Config(**{**saved, **changed})


@torch.no_grad()
def evaluate_checkpoint(given: Config) -> dict:
    """--eval: play --eval-episodes games with a checkpoint's policy and report the return, the
    memory carried as in training (the recurrent state, or the window of the last rows)."""
    check_settings(with_kind_defaults(given))
    checkpoint = load_checkpoint(given.eval)
    config = resumed_config(checkpoint, given)
    model = Model(*inspect_env(config.env), config)
    load_weights(model, checkpoint["model"], config)
    torch.manual_seed(config.seed)
    drawn = {"render_mode": "rgb_array"} if config.video else {}  # (only when asked for)
    game = Game(config.env, config.seed, **drawn)
    video, path, returns = None, Path(config.run_dir) / "eval.mp4", []
    memory, next_start = model.initial_memory(1), torch.ones(1)
    next_input = encode_inputs(model, torch.from_numpy(game.reset())[None])
    inputs, starts = torch.zeros(model.window, 1, model.input_size), torch.zeros(model.window, 1)
    try:
        while len(returns) < config.eval_episodes:
            if config.video:
                video = write_frame(video, game, path)
            inputs = torch.cat([inputs[1:], next_input[None]])
            starts = torch.cat([starts[1:], next_start[None]])
            actions, _, _, memory = model.act(inputs, starts, memory, greedy=config.greedy)
            obs, reward, terminated, truncated, info = game.step(actions.numpy()[0])
            next_start = torch.tensor([float(terminated or truncated)])
            next_input = encode_inputs(model, torch.from_numpy(obs)[None], actions,
                                       torch.tensor([reward]), next_start)
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


def write_frame(video, game: Game, path: Path):  # the game's picture into eval.mp4 (OpenCV)
    import cv2  # only --video needs OpenCV

    # pygame (classic control's pictures) needs no SDL display or sound: dummies, no complaints.
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

# ----- Checking the input; the command line -------------------------------------------------------


RANGES = {"> 0": (lambda x: x > 0, "positive"), ">= 0": (lambda x: x >= 0, "0 or more"),
          "(0, 1]": (lambda x: 0 < x <= 1, "in (0, 1]"),
          "[0, 1]": (lambda x: 0 <= x <= 1, "in [0, 1]")}


def flattens(space: gym.spaces.Space) -> bool:
    """Whether `Game` makes a vector of it: Box, Discrete, MultiDiscrete and MultiBinary spaces (the
    discrete ones one-hot), alone or in a Tuple or Dict (POPGym's Autoencode observes a pair)."""
    if isinstance(space, (gym.spaces.Tuple, gym.spaces.Dict)):
        parts = space.spaces.values() if isinstance(space, gym.spaces.Dict) else space.spaces
        return all(flattens(part) for part in parts)
    return isinstance(space, (gym.spaces.Box, gym.spaces.Discrete, gym.spaces.MultiDiscrete,
                              gym.spaces.MultiBinary))


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


def refuse_a_rollout_too_large(config: Config, obs_size: int, num_actions: int):
    """Refuse what will not fit. A step of a game: an input, an observation, 10 numbers (rollout);
    its share of a minibatch's activations, per unit: 7 (none, framestack), 40 (lstm, gru), 92 + 12
    a step of the span (attention). Peak RSS, 64 to 1024 games of 128 steps: +0.1 GiB framestack,
    +0.5 lstm, +0.6 gru, +2.1 attention; the games' own memory is too small to see."""
    units = {"lstm": 40, "gru": 40, "attention": 92 + 12 * config.attention_span}
    numbers = (2 * obs_size + num_actions + 11
               + units.get(config.memory, 7) * config.hidden_size / config.num_minibatches)
    refuse_what_will_not_fit(int(4 * numbers * config.num_steps * config.num_envs),
                             "the rollout and its update")


def check_settings(config: Config):
    """Refuse, in one line saying what to change, numbers out of range (or not finite) and flags
    that cannot work together."""
    if config.memory not in KIND_DEFAULTS:
        raise UsageError(f"unknown --memory {config.memory!r}: use {', '.join(KIND_DEFAULTS)}")
    for f in dataclasses.fields(Config):
        value, rule = getattr(config, f.name), f.metadata["check"]
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, float) and not math.isfinite(value):
            raise UsageError(f"{flag} must be a finite number, not {value}")
        if rule is not None and value is not None and not RANGES[rule][0](value):
            raise UsageError(f"{flag} must be {RANGES[rule][1]}, not {value}")
    for flag in ("video", "greedy"):
        if getattr(config, flag) and not config.eval:
            raise UsageError(f"--{flag} is for --eval's games: add --eval PATH")
    if config.eval and config.resume:
        raise UsageError("--eval plays a checkpoint, --resume trains on from one: give one")
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
    if config.num_envs % config.num_minibatches:  # whole env sequences (LSTM details, #4)
        raise UsageError(f"the {config.num_envs} envs (--num-envs) do not split into "
                         f"--num-minibatches {config.num_minibatches} (minibatches split the envs)")
    batch_size = config.num_envs * config.num_steps
    if batch_size // config.num_minibatches < 2:
        raise UsageError(f"minibatches of {batch_size // config.num_minibatches} step cannot be "
                         f"normalised: raise --num-envs or --num-steps, or lower --num-minibatches")


def inspect_env(env_id: str):
    """Check that the env exists and that this script can play it: (obs size, number of actions)."""
    register_stateless_envs()
    module, _, registered = env_id.rpartition(":")  # "module:Env-v0": the module registers it
    if registered.startswith("popgym-") and not module:
        module = "popgym"  # (so does POPGym, for its games)
    try:
        importlib.import_module(module or "gymnasium")  # (gymnasium: imported already)
    except ImportError as error:
        hint = ": pip install popgym" if module == "popgym" else ""
        raise UsageError(f"cannot import {module} for --env {env_id} ({error}){hint}") from None
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
        env = gym.make(env_id)
    except Exception as error:
        raise UsageError(f"cannot make {env_id}: {type(error).__name__}: {error}") from None
    obs_space, action_space = env.observation_space, env.action_space
    env.close()
    kind = type(obs_space).__name__
    if not flattens(obs_space):
        nest = kind in ("Dict", "Tuple")
        raise UsageError(f"{env_id} has a {obs_space} observation space; this script reads Box, "
                         f"Discrete, MultiDiscrete, MultiBinary parts: " + (
            "use ppo_spaces.py (no memory), which leaves out the others" if nest
            else f"no script of this library reads {kind} ones yet"))
    if obs_space.dtype == np.uint8 and len(obs_space.shape or ()) >= 2:
        raise UsageError(f"{env_id} observes images {obs_space.shape}; use ppo_spaces.py (a CNN "
                         f"sized to the image) or, for Atari, ppo_atari.py")
    obs_size = gym.spaces.flatdim(obs_space)
    if isinstance(action_space, gym.spaces.Discrete):
        return obs_size, int(action_space.n)
    kind = type(action_space).__name__
    scripts = {"Box": "ppo_continuous.py", "MultiDiscrete": "ppo_cartpole.py",
               "MultiBinary": "ppo_cartpole.py", "Dict": "ppo_spaces.py", "Tuple": "ppo_spaces.py"}
    raise UsageError(f"{env_id} has a {action_space} action space; this script handles Discrete "
                     f"actions" + (f": use {scripts[kind]} (no memory)" if kind in scripts else
                                   f", and no script of this library handles {kind} actions yet"))


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
    default = (f"runs/{config.env.replace('/', '-')}__{SCRIPT}__{config.memory}__{config.seed}"
               f"__{int(time.time())}")
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
