"""PPO for environments of any gymnasium space: nests of observations and actions, action masks.

Proximal Policy Optimization (Schulman et al., 2017: "PPO paper") with the details of CleanRL and
SB3 ("The 37 Implementation Details of PPO", Huang et al., 2022: "37 details"; "continuous #1-#9").

The idea. Policy gradient uses each batch of games once: afterwards the policy has changed. PPO
reuses each batch ("rollout") for several epochs of minibatch steps, keeping the new policy near the
one that played by clipping the probability ratio rho_t = pi(a_t|s_t) / pi_old(a_t|s_t)
(`Trainer.ppo_loss`). The advantage A_t, how much better a_t did than the value V(s_t) expected,
comes from the rewards r_t by GAE (`compute_gae`). An observation is a nest (Dict, Tuple) of leaves,
each read by an encoder of its kind (`Encoder`); an action is a nest of leaves, each drawn from a
head of its own (`ActionHead`); an action mask gives the choices it forbids probability 0.

Run it:         python ppo_spaces.py            (Taxi-v4, with its action masks; --help lists flags)
On N GPUs:      torchrun --standalone --nproc_per_node N ppo_spaces.py   (data parallel: `Ranks`)
In a notebook:  Main(Config(total_timesteps=50_000)).run() (imported, or pasted down to the banner)
"""

import argparse
import contextlib
import dataclasses
import difflib
import functools
import math
import multiprocessing
import time
import typing
from collections import deque
from typing import Optional

SCRIPT = "ppo_spaces"


def option(default, help, check=None):  # a Config field, its --help line, its valid range
    return dataclasses.field(default=default, metadata={"help": help, "check": check})


@dataclasses.dataclass
class Config:
    """Every setting of a run, each a command-line flag (`num_envs` -> `--num-envs`). Taxi-v4
    learns in seconds on a CPU: a Discrete observation, masks in `info` (no driving into walls)."""

    # PPO's hyperparameters.
    learning_rate: float = option(2.5e-3, "Adam's step size, annealed linearly to 0", "> 0")
    anneal_lr: bool = option(True, "anneal the learning rate linearly to 0 over the run")
    gamma: float = option(0.99, "discount: 0.99 looks ~100 steps ahead, a taxi ride", "(0, 1]")
    gae_lambda: float = option(0.95, "GAE: bias (0) vs variance (1) of the advantage", "[0, 1]")
    num_minibatches: Optional[int] = option(None, "minibatches each rollout is split into "
                                            "(None: 4 with an image leaf, else 16)", "> 0")
    update_epochs: int = option(4, "passes over each rollout", "> 0")
    clip_coef: float = option(0.2, "PPO's clip range for the probability ratio", "> 0")
    clip_value_loss: bool = option(False, "clip the value update too")
    ent_coef: float = option(0.01, "weight of the entropy bonus", ">= 0")
    vf_coef: float = option(0.5, "weight of the value loss", ">= 0")
    max_grad_norm: float = option(0.5, "clip the global gradient norm to this", "> 0")
    target_kl: Optional[float] = option(None, "stop an update's epochs at this approx KL", "> 0")
    hidden_size: int = option(64, "units of the MLPs' hidden layers and a CNN's output", "> 0")
    normalize_observations: bool = option(True, "normalise Box leaves by running mean and std")
    obs_clip: float = option(10.0, "clip normalised observations to +-this", "> 0")
    scale_rewards: bool = option(True, "divide rewards by the running std of the discounted return")
    action_mask: bool = option(True, "forbid what the env's action_mask forbids (if it has one)")
    check_env: bool = option(True, "first check the env's observations against its spaces")

    # Collecting experience.
    env: str = option("Taxi-v4", "gymnasium id: any nest of Box, Discrete, Multi* spaces")
    num_envs: int = option(16, "games played side by side (by each rank, under torchrun)", "> 0")
    num_workers: int = option(0, "child processes that run the games (0 = in this process)", ">= 0")
    num_steps: int = option(32, "steps per game in a rollout of num_envs * num_steps", "> 0")

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
    compile: bool = option(False, "torch.compile (off: networks this small gain nothing)")


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

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn
from gymnasium import spaces


def leaves(space, path: tuple = ()) -> list:
    """The leaves of a nest (Dict, Tuple) of spaces, depth first: [(path, space)], a path the keys
    and indexes that lead to the leaf (("image",), (0, "x"); () for a space that is a leaf)."""
    if isinstance(space, (spaces.Dict, spaces.Tuple)):
        subs = space.spaces.items() if isinstance(space, spaces.Dict) else enumerate(space)
        return [leaf for key, sub in subs for leaf in leaves(sub, path + (key,))]
    return [(path, space)]


def nest_of(space, values):  # the nest of `space`, its leaves' values taken in turn from `values`
    if isinstance(space, spaces.Dict):
        return {key: nest_of(sub, values) for key, sub in space.spaces.items()}
    if isinstance(space, spaces.Tuple):
        return tuple(nest_of(sub, values) for sub in space)
    return next(values)


def obs_kind(space) -> Optional[str]:
    """How `Encoder` reads an observation leaf: "image" (a uint8 Box of 2 or 3 dimensions), "vector"
    (another Box), "one-hot" (Discrete, MultiDiscrete), "bits" (MultiBinary); None: left out (Text,
    Graph, Sequence: no fixed-size numbers), as is a key "action_mask" (Game reads the mask)."""
    if isinstance(space, spaces.Box):
        return "image" if space.dtype == np.uint8 and len(space.shape) in (2, 3) else "vector"
    if isinstance(space, (spaces.Discrete, spaces.MultiDiscrete)):
        return "one-hot"
    return "bits" if isinstance(space, spaces.MultiBinary) else None


def observed_leaves(space) -> list:  # [(path, leaf)] of the leaves that Encoder reads
    return [(path, leaf) for path, leaf in leaves(space)
            if obs_kind(leaf) and path != ("action_mask",)]


def default_minibatches(obs_space) -> int:
    """--num-minibatches left at None: 4 with an image leaf (cheaper, and as good on MiniGrid), else
    16 (Taxi's masks and a Dict action of a choice and a number need them): benchmarks/README.md."""
    return 4 if any(obs_kind(leaf) == "image" for _, leaf in observed_leaves(obs_space)) else 16


class Game:
    """One gymnasium env as PPO sees it: an observation as one float32 vector (its observed leaves,
    then the action mask if the env gives one: 1 allowed, 0 forbidden), an action as one float32 row
    (its leaves' numbers). An ended episode restarts in the same step: `step` returns the next one's
    first observation, in `info` the ended one's last ("final_obs"), return, length ("episode")."""

    def __init__(self, env_id: str, seed: int, **options):  # options: gym.make's (render_mode)
        self.env = gym.make(env_id, **options)
        self.seed, self.close = seed, self.env.close
        self.observed = observed_leaves(self.env.observation_space)
        self.mask_size = None  # the action mask's size: seen at the first reset

    def observe(self, obs, info: dict) -> np.ndarray:
        # The mask: in `info` (gymnasium's convention: Taxi-v4) or the observation (PettingZoo's).
        mask = obs["action_mask"] if isinstance(obs, dict) and "action_mask" in obs else (
            info.get("action_mask", np.ones(self.mask_size or 0)))  # silent: all allowed
        self.mask_size = np.size(mask) if self.mask_size is None else self.mask_size
        values = [functools.reduce(lambda nest, key: nest[key], path, obs)  # nest[k1][k2]...
                  for path, _ in self.observed] + [mask]
        return np.concatenate([np.asarray(value, np.float32).reshape(-1) for value in values])

    def reset(self) -> np.ndarray:
        obs, info = self.env.reset(seed=self.seed)  # seeded once; restarts continue its stream
        self.seed, self.episode_return, self.episode_length = None, 0.0, 0
        return self.observe(obs, info)

    def env_action(self, action: np.ndarray):
        """The env's nest from the row, leaf by leaf: a choice counted from its space's start, a
        Box's numbers clipped to its bounds (continuous #5: the rollout keeps the sampled ones)."""
        values, end = [], 0
        for _, space in leaves(self.env.action_space):
            start, end = end, end + int(np.prod(space.shape))  # (Discrete: shape (), 1 number)
            part = action[start:end]
            if isinstance(space, spaces.Box):
                part = np.clip(part, space.low.reshape(-1), space.high.reshape(-1))
            value = part.reshape(space.shape) + getattr(space, "start", 0)
            values.append(value.astype(space.dtype)[()])  # (a Discrete's: a number, not an array)
        return nest_of(self.env.action_space, iter(values))

    def step(self, action: np.ndarray):
        obs, reward, terminated, truncated, info = self.env.step(self.env_action(action))
        self.episode_return += float(reward)
        self.episode_length += 1
        obs, info = self.observe(obs, info), {}
        if terminated or truncated:
            episode = {"return": self.episode_return, "length": self.episode_length}
            obs, info = self.reset(), {"final_obs": obs, "episode": episode}
        return obs, reward, terminated, truncated, info


class StepResult(typing.NamedTuple):
    """What one step of all the games gives the trainer, besides the observations."""

    rewards: np.ndarray  # [num_envs]
    terminated: np.ndarray  # [num_envs] bool: the episode ended in the game
    truncated: np.ndarray  # [num_envs] bool: a time limit cut the episode
    final_obs: dict  # env index -> the last observation (as Game gives it) of its episode
    episodes: dict  # env index -> {"return", "length"} of the episode that ended there

    @classmethod
    def of(cls, steps: list) -> "StepResult":
        """From each game's (reward, terminated, truncated, info), in the order of the envs."""
        rewards, terminated, truncated, infos = zip(*steps)
        ended = {i: info for i, info in enumerate(infos) if "episode" in info}
        return cls(np.array(rewards, np.float32), np.array(terminated, bool),
                   np.array(truncated, bool), {i: ended[i]["final_obs"] for i in ended},
                   {i: ended[i]["episode"] for i in ended})


def packed(actions: dict) -> np.ndarray:
    """Each env's actions, leaf after leaf, in one float32 row: what Game.env_action reads."""
    return torch.cat([action.float() for action in actions.values()], dim=-1).cpu().numpy()


class Worker:
    """Plays several Games in a (forked) child process beside the trainer: actions go down a pipe,
    rewards, end flags and infos come back; observations, the one large array, skip the pipe
    (shared memory: `obs_view`, read as a tensor with no copy)."""

    def __init__(self, index: int, env_id: str, seed: int, obs_view: np.ndarray):
        self.index, self.env_id, self.obs_view = index, env_id, obs_view
        self.trainer_end, child_end = multiprocessing.Pipe()
        self.process = multiprocessing.get_context("fork").Process(
            target=self.child_loop, args=(child_end, env_id, seed, obs_view),
            name=f"{SCRIPT}-worker-{index}", daemon=True)
        self.process.start()
        child_end.close()
        self.receive()  # the child's first answer comes once its Games are reset

    def child_loop(self, conn, env_id: str, seed: int, obs_view: np.ndarray):
        games = [Game(env_id, seed + i) for i in range(len(obs_view))]  # game i: seed + i
        obs_view[:] = [game.reset() for game in games]
        conn.send(("ok", None))
        while (command := conn.recv())[0] == "step":
            steps = [game.step(action) for game, action in zip(games, command[1])]
            obs_view[:] = [obs for obs, *_ in steps]
            conn.send(("ok", [rest for _, *rest in steps]))

    def step(self, actions: dict) -> StepResult:  # its Games' step
        self.trainer_end.send(("step", packed(actions)))
        return StepResult.of(self.receive())

    def observations(self) -> torch.Tensor:  # its Games' current ones (shared memory: no copy)
        return torch.from_numpy(self.obs_view)

    def receive(self) -> list:  # the child's answer: (reward, terminated, truncated, info) by game
        return self.trainer_end.recv()[1]

    def close(self):
        self.trainer_end.send(("close", None))  # (any command but "step" ends the child's loop)
        self.process.join()


def layer(in_size: int, out_size: int, gain: float = math.sqrt(2), kind=nn.Linear, **options):
    """A linear (or other `kind` of) layer, orthogonal weights of the given gain, zero biases (37
    details, #2: sqrt(2) in the body; 0.01 for the policy, all actions starting alike; 1 for V)."""
    module = kind(in_size, out_size, **options)
    nn.init.orthogonal_(module.weight, gain)
    nn.init.zeros_(module.bias)
    return module


class OneHot(nn.Module):
    """A Discrete or MultiDiscrete leaf as a one-hot vector per dimension, side by side: a choice is
    a name, not an amount (as a number, the net would take choice 3 for "more" than choice 2)."""

    def __init__(self, space):
        super().__init__()
        choices = np.ravel(space.n if isinstance(space, spaces.Discrete) else space.nvec)
        self.features = int(choices.sum())
        first = torch.tensor(np.cumsum(choices) - choices - np.ravel(space.start))
        self.register_buffer("first", first, persistent=False)  # one-hot position = value + first

    def forward(self, values: torch.Tensor) -> torch.Tensor:  # [batch, dims] -> [batch, features]
        return nn.functional.one_hot(values.long() + self.first, self.features).sum(-2).float()


class ImageEncoder(nn.Module):
    """A uint8 image leaf (HWC, CHW: the channels are the shorter end; HW: one channel, last),
    divided by `divisor`: three 3x3 convolutions, stride 2 while its sides are 16 or more (84, 41,
    20, 9), then a linear layer; with a side under 16 (MiniGrid's 7x7x3), the linear layer alone
    (convolutions that cannot stride only add numbers, 147 -> 5x5x32 = 800: compute for nothing)."""

    def __init__(self, shape: tuple, hidden_size: int, divisor: float = 255.0):
        super().__init__()
        self.shape, self.divisor = tuple(shape) if len(shape) == 3 else (*shape, 1), divisor
        self.channels_first, layers, self.features = self.shape[0] < self.shape[-1], [], hidden_size
        channels, *sides = self.shape if self.channels_first else self.shape[-1:] + self.shape[:2]
        for out_channels in (32, 64, 64) if min(sides) >= 16 else ():
            stride = 2 if min(sides) >= 16 else 1
            layers += [layer(channels, out_channels, kind=nn.Conv2d, kernel_size=3, stride=stride),
                       nn.ReLU()]
            channels, sides = out_channels, [(side - 3) // stride + 1 for side in sides]
        self.cnn = nn.Sequential(*layers, nn.Flatten(),
                                 layer(channels * sides[0] * sides[1], hidden_size), nn.ReLU())

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:  # [batch, H*W*C]
        images = pixels.reshape(-1, *self.shape) / self.divisor
        return self.cnn(images if self.channels_first else images.permute(0, 3, 1, 2))  # CHW


class Encoder(nn.Module):
    """One encoder per observed leaf (`obs_kind`), features side by side (SB3's MultiInputPolicy):
    the flat observation split back into its leaves; a vector or bits as they are, a choice
    one-hot, an image by a CNN. The Box leaves' numbers (`box_columns`; images' too: MiniGrid's are
    codes 0-10, near 0 / 255) come normalised by RunningMeanStd, each by its own mean and std."""

    def __init__(self, obs_space, hidden_size: int, image_divisor: float = 255.0):
        super().__init__()
        observed = [(space, obs_kind(space)) for _, space in observed_leaves(obs_space)]
        self.sizes = [int(np.prod(space.shape)) for space, _ in observed]  # (Discrete: 1)
        self.observed_size, ends = sum(self.sizes), np.cumsum(self.sizes).tolist()
        self.box_columns = [column for (_, kind), size, end in zip(observed, self.sizes, ends)
                            if kind in ("vector", "image") for column in range(end - size, end)]
        self.encoders = nn.ModuleList(
            ImageEncoder(space.shape, hidden_size, image_divisor) if kind == "image" else
            OneHot(space) if kind == "one-hot" else nn.Identity() for space, kind in observed)
        self.features = sum(getattr(encoder, "features", size)
                            for encoder, size in zip(self.encoders, self.sizes))

    def forward(self, obs: torch.Tensor) -> torch.Tensor:  # (the mask's columns come after these)
        parts = obs[:, :self.observed_size].split(self.sizes, dim=-1)
        return torch.cat([encoder(part) for encoder, part in zip(self.encoders, parts)], dim=-1)


class ActionHead(nn.Module):
    """The policy for one action leaf, from `size` of the actor's outputs. A Box: a Gaussian per
    number, its mean the output, its log standard deviation a parameter that depends on no state
    (continuous #1-#2). A Discrete, MultiDiscrete or MultiBinary (2 choices a bit): a categorical
    per dimension over the most choices any has. A choice that a dimension lacks, and one the env's
    mask forbids, gets logit -1e9: probability exp(-1e9 - ...) = 0, never sampled; its term
    p log p = 0 drops out of the entropy, which is thus over the allowed choices."""

    def __init__(self, space):
        super().__init__()
        self.continuous, self.maskable = isinstance(space, spaces.Box), False
        if self.continuous:
            self.size = self.width = int(np.prod(space.shape))  # outputs, numbers of an action
            self.dtype, self.log_std = torch.float32, nn.Parameter(torch.zeros(self.size))
            return
        self.maskable = not isinstance(space, spaces.MultiBinary)  # (masks cover the choices)
        choices = ([int(space.n)] if isinstance(space, spaces.Discrete) else np.ravel(
            space.nvec).tolist() if self.maskable else [2] * int(np.prod(space.shape)))
        self.width, self.num_choices, self.dtype = len(choices), max(choices), torch.long
        self.size, self.mask_size = self.width * self.num_choices, sum(choices)
        # Choice c of dimension d is mask column first[d] + c; a missing choice, a 0 past the end.
        first = np.cumsum(choices) - choices
        self.register_buffer("mask_index", torch.tensor(
            [[first[d] + c if c < n else self.mask_size for c in range(self.num_choices)]
             for d, n in enumerate(choices)]), persistent=False)

    def distribution(self, output: torch.Tensor, mask: torch.Tensor):  # mask: [batch, 0]: none
        if self.continuous:
            return torch.distributions.Normal(output, self.log_std.exp().expand_as(output),
                                              validate_args=False)
        allowed = (self.mask_index < self.mask_size if mask.shape[1] == 0 else
                   torch.cat([mask, mask.new_zeros(len(mask), 1)], 1)[:, self.mask_index] > 0)
        logits = output.view(-1, self.width, self.num_choices).masked_fill(~allowed, -1e9)
        return torch.distributions.Categorical(logits=logits, validate_args=False)


class RunningMeanStd(nn.Module):
    """The count, mean and variance of the numbers seen so far in some columns (the observations'
    Box leaves; the discounted return), kept without the numbers, to normalise them as CleanRL and
    SB3 do (continuous #6-#9): float64 buffers of the Model (`obs_stats`, `return_stats`), saved
    with it. Each step's numbers merge in as they come, by Chan, Golub and LeVeque's formula
    (1979), exact for any split (n = n_a + n_b, delta = mean_b - mean_a):
        mean = mean_a + delta n_b / n,   var = (var_a n_a + var_b n_b + delta^2 n_a n_b / n) / n
    From count 1e-4, mean 0, variance 1, as theirs (a safe first division). Inactive: a no-op."""

    def __init__(self, columns: list, clip: float = 10.0, active: bool = True):
        super().__init__()
        self.clip, self.active = clip, active and len(columns) > 0
        self.register_buffer("columns", torch.tensor(columns, dtype=torch.long), persistent=False)
        self.register_buffer("mean", torch.zeros(len(columns), dtype=torch.float64))
        self.register_buffer("var", torch.ones(len(columns), dtype=torch.float64))
        self.register_buffer("count", torch.tensor(1e-4, dtype=torch.float64))

    def merge(self, count: float, mean: torch.Tensor, var: torch.Tensor):  # a batch's, in place
        old_count = self.count.item()
        total, delta = old_count + count, mean - self.mean
        self.var.mul_(old_count / total).add_(var, alpha=count / total)
        self.var.add_(delta.square(), alpha=old_count * count / total ** 2)
        self.mean.add_(delta, alpha=count / total)
        self.count.fill_(total)

    def normalize(self, obs: torch.Tensor, update: bool = True) -> torch.Tensor:
        """(x - mean) / std in its columns, clipped (continuous #7); `update`: merged in first."""
        if not self.active:
            return obs
        numbers = obs[:, self.columns].to(torch.float64)
        if update:
            var, mean = torch.var_mean(numbers, dim=0, correction=0)
            self.merge(float(len(numbers)), mean, var)
        obs = obs.clone()  # (not the games' array: they write the next observations into it)
        obs[:, self.columns] = ((numbers - self.mean) / (self.var + 1e-8).sqrt()).clamp(
            -self.clip, self.clip).to(obs.dtype)
        return obs

    def scale(self, rewards, returns, ended, gamma: float) -> torch.Tensor:
        """Continuous #8-#9: rewards / std(R), R each game's discounted return (R <- gamma R + r, in
        `returns`, 0 at an episode's end), clipped: values of unit scale (benchmarks/README.md)."""
        if not self.active:
            return rewards
        returns.mul_(gamma).add_(rewards)
        self.merge(float(len(returns)), returns.mean(), returns.var(correction=0))
        returns.masked_fill_(ended, 0.0)
        return (rewards / (self.var + 1e-8).sqrt()).clamp(-self.clip, self.clip).float()


class Model(nn.Module):
    """The actor-critic for a nest of spaces, on observations normalised by its `obs_stats`: their
    leaves encoded (`Encoder`), then separate policy and value MLPs, 64-64 tanh (37 details, #13),
    the policy's output split into one head per action leaf (`ActionHead`). Given the state, the
    leaves are drawn independently, so pi(a|s) is the product of theirs: its log, and the entropy,
    are sums over the leaves (as over MultiDiscrete's dimensions, 37 details, #23)."""

    def __init__(self, obs_space, action_space, hidden_size: int = 64, masked: bool = False,
                 normalize: bool = False, obs_clip: float = 10.0, scale_rewards: bool = False):
        super().__init__()
        # Images standardised as Box leaves (by obs_stats), or else read as pixels: divided by 255.
        self.encoder = Encoder(obs_space, hidden_size, 1.0 if normalize else 255.0)
        self.obs_stats = RunningMeanStd(self.encoder.box_columns, obs_clip, active=normalize)
        self.return_stats = RunningMeanStd([0], 10.0, active=scale_rewards)  # (SB3's reward clip)
        self.names = ["/".join(map(str, path)) or "action" for path, _ in leaves(action_space)]
        self.heads = nn.ModuleList(ActionHead(space) for _, space in leaves(action_space))
        # The mask: the observation's last mask_size columns (0: --no-action-mask), heads in turn.
        self.mask_sizes = [head.mask_size if masked and head.maskable else 0 for head in self.heads]
        self.mask_size = sum(self.mask_sizes)
        mlp = lambda out_size, gain: nn.Sequential(  # two tanh hidden layers, then the output
            layer(self.encoder.features, hidden_size), nn.Tanh(),
            layer(hidden_size, hidden_size), nn.Tanh(), layer(hidden_size, out_size, gain=gain))
        self.critic, self.actor = mlp(1, 1.0), mlp(sum(head.size for head in self.heads), 0.01)

    def value(self, obs: torch.Tensor) -> torch.Tensor:  # V(s), [batch]
        return self.critic(self.encoder(obs)).squeeze(-1)

    def policy(self, obs: torch.Tensor, actions: Optional[dict] = None, greedy: bool = False):
        """pi(.|s), a torch distribution per action leaf; the actions (leaf name -> [batch, width]:
        drawn unless given), log pi(a|s) summed over the leaves, and V(s)."""
        features, masks = self.encoder(obs), obs[:, obs.shape[-1] - self.mask_size:]
        outputs = self.actor(features).split([head.size for head in self.heads], dim=-1)
        distributions = [head.distribution(output, mask) for head, output, mask in
                         zip(self.heads, outputs, masks.split(self.mask_sizes, dim=-1))]
        actions = actions or {name: d.mode if greedy else d.sample()
                              for name, d in zip(self.names, distributions)}
        log_prob = sum(d.log_prob(actions[name]).sum(-1)
                       for name, d in zip(self.names, distributions))
        return distributions, actions, log_prob, self.critic(features).squeeze(-1)

    def act(self, obs: torch.Tensor, greedy: bool = False):  # (actions, log pi(a|s), V(s))
        return self.policy(obs, greedy=greedy)[1:]  # a Box's actions kept as sampled (unclipped)

    def evaluate_actions(self, obs: torch.Tensor, actions: dict):
        """For the loss: log pi(a|s) of the taken actions now, the entropy, V(s); all [batch]."""
        distributions, _, log_prob, values = self.policy(obs, actions)
        return log_prob, sum(d.entropy().sum(-1) for d in distributions), values


def compute_gae(rewards, values, dones, last_value, gamma: float, gae_lambda: float):
    """Generalized Advantage Estimation (Schulman et al., 2016; PPO paper, eq. 11-12). rewards,
    values, dones: [T, N] (time, env); last_value: [N], the value of the observation after the last
    step. Returns the advantages [T, N]; the value targets are advantages + values.

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

    obs: torch.Tensor  # [batch, obs_size], as the policy saw them (the mask included)
    actions: dict  # leaf name -> [batch, width], the actions it took (a Box's as sampled)
    old_log_probs: torch.Tensor  # their log-probabilities then
    advantages: torch.Tensor  # from GAE
    returns: torch.Tensor  # the value targets: advantages + old values
    old_values: torch.Tensor  # the values then


class Rollout:
    """The rollout buffer: what the current policy saw, did and got, [num_steps, num_envs, ...]."""

    def __init__(self, config: Config, obs_size: int, model: Model, device: torch.device):
        shape = (config.num_steps, config.num_envs)
        self.obs = torch.zeros(shape + (obs_size,), device=device)
        self.actions = {name: torch.zeros(shape + (head.width,), dtype=head.dtype, device=device)
                        for name, head in zip(model.names, model.heads)}
        self.log_probs, self.values, self.rewards, self.dones = (
            torch.zeros(shape, device=device) for _ in range(4))

    def minibatch(self, indices: torch.Tensor, advantages, returns) -> Minibatch:
        rows = lambda tensor: tensor.flatten(0, 1)[indices]  # flat index: step * num_envs + env
        return Minibatch(rows(self.obs), {name: rows(a) for name, a in self.actions.items()},
                         rows(self.log_probs), rows(advantages), rows(returns), rows(self.values))


class Trainer:
    """One PPO step on a minibatch: clipped surrogate, value loss, entropy bonus, gradient clip."""

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
        unclipped term is the smaller one, and its gradient pulls back. With a nest of actions,
        rho_t is the product of the leaves' ratios: one clip for the whole action."""
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
    `RunGuard`, below the banner, extends it: Ctrl-C, checkpoints, NaN guard, torchrun, workers."""

    solved_step: Optional[int] = None  # the step at which --target-return was reached
    config = property(lambda self: self.main.config)

    def __init__(self, main: "Main"):
        self.main, self.games, self.summary = main, None, None

    def __enter__(self) -> "Run":
        config, self.start_time, self.returns = self.config, time.perf_counter(), deque(maxlen=100)
        torch.manual_seed(config.seed)  # the trainer's draws (sampling, shuffling): all torch's
        cuda = config.device != "cpu" and torch.cuda.is_available()
        self.device = torch.device("cuda" if cuda else "cpu")
        game = Game(config.env, config.seed)  # one env tells the sizes the Model needs
        self.obs_size, self.masked = len(game.reset()), bool(game.mask_size) and config.action_mask
        self.obs_space, self.action_space = game.env.observation_space, game.env.action_space
        game.close()
        minibatches = config.num_minibatches or default_minibatches(self.obs_space)  # None: by kind
        self.main.config = dataclasses.replace(config, num_minibatches=minibatches)
        self.steps_per_step, self.updates, self.episodes = config.num_envs, 0, 0
        return self

    @staticmethod
    def evaluate(config: Config) -> dict:  # --eval: the machinery's (below the banner)
        raise NotImplementedError("--eval plays a checkpoint: the machinery below the banner")

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
        """Record the ended episodes' returns; note when the last 100's mean reaches the target."""
        for step, episode in ended:
            self.episodes, target = self.episodes + 1, self.config.target_return
            self.returns.append(episode["return"])
            if (target is not None and self.solved_step is None and len(self.returns) == 100
                    and np.mean(self.returns) >= target):
                self.solved_step = step

    def after_update(self, stats: dict):
        """Count the update and print a progress line."""
        self.updates, step = self.updates + 1, self.main.global_step
        mean = f"{np.mean(self.returns):.1f}" if self.returns else "-"
        print(f"step {step:,} | {step / (time.perf_counter() - self.start_time):,.0f} steps/s | "
              f"return {mean} | updates {self.updates}")

    def __exit__(self, kind, error, traceback) -> bool:
        """Close the games and sum the run up in `summary`; an error goes on up."""
        if self.games is not None:
            self.games.close()
        self.summary = {"script": SCRIPT, "env": self.config.env, "seed": self.config.seed,
                        "steps": getattr(self.main, "global_step", 0), "episodes": self.episodes,
                        "seconds": round(time.perf_counter() - self.start_time, 3),
                        "mean_return_100": float(np.mean(self.returns)) if self.returns else None,
                        "solved_step": self.solved_step}
        return False


class Main:
    """The loop: `Main(config).run()` trains (or --eval plays) and returns the summary as a dict.
    One iteration (37 details, #6): play num_steps steps in each of num_envs games, estimate each
    step's advantage with GAE, then take update_epochs passes over the rollout in minibatches."""

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
            self.model = Model(guard.obs_space, guard.action_space, config.hidden_size,
                               guard.masked, config.normalize_observations, config.obs_clip,
                               config.scale_rewards)
            self.trainer = Trainer(self.model.to(guard.device), config, guard.optimizer)
            self.discounted_returns = self.model.return_stats.mean.new_zeros(config.num_envs)  # R
            self.global_step = guard.prepare_learner()  # 0, or --resume's; compile, torchrun
            self.games = guard.start_games()
            self.rollout = Rollout(config, guard.obs_size, self.model, guard.device)
            next_obs = self.model.obs_stats.normalize(self.games.observations().to(guard.device))
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
        for step in range(config.num_steps):
            if self.guard.stop_at_once():  # Ctrl-C
                break
            rollout.obs[step] = next_obs  # its mask too: the update will forbid what acting did
            actions, rollout.log_probs[step], rollout.values[step] = self.model.act(next_obs)
            for name, action in actions.items():
                rollout.actions[name][step] = action
            result = self.games.step(actions)
            done = torch.from_numpy(result.terminated | result.truncated).to(device)
            rewards = self.model.return_stats.scale(torch.from_numpy(result.rewards).to(device),
                                                    self.discounted_returns, done, config.gamma)
            # Truncation is not death: an episode cut by a time limit would have gone on, so its
            # last reward gets gamma * V(final obs); done = 1 (either end) keeps GAE in its episode.
            cut = [i for i in result.final_obs if result.truncated[i] and not result.terminated[i]]
            if cut:  # (normalised as the step's other observations, by the statistics so far)
                cut_obs = torch.from_numpy(np.stack([result.final_obs[i] for i in cut]))
                cut_obs = self.model.obs_stats.normalize(cut_obs.to(device), update=False)
                rewards[cut] += config.gamma * self.model.value(cut_obs)
            next_obs = self.model.obs_stats.normalize(self.games.observations().to(device))
            rollout.rewards[step], rollout.dones[step] = rewards, done
            self.global_step += self.guard.steps_per_step  # num_envs of every rank
            ended += [(self.global_step, episode) for episode in result.episodes.values()]
        self.guard.after_rollout(ended)  # record the episodes (RunGuard's: stop on Ctrl-C)
        return next_obs

    @torch.no_grad()
    def estimate_advantages(self, next_obs: torch.Tensor):
        """GAE over the rollout: (advantages, returns), both [num_steps, num_envs]."""
        rollout, last_value = self.rollout, self.model.value(next_obs)
        advantages = compute_gae(rollout.rewards, rollout.values, rollout.dones, last_value,
                                 self.config.gamma, self.config.gae_lambda)
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
# A reader of PPO may stop here. What follows: the games guarded and checked, compilation, `Ranks`
# (torchrun), `RunGuard` and `RunLog` (the lesson's `Run` made safe), checkpoints, evaluation, the
# input checks, the command line.

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
import tracemalloc
import warnings
from multiprocessing import shared_memory
from pathlib import Path

import torch.distributed as dist  # already loaded by `import torch`: costs nothing more

# ----- The games, guarded and checked -------------------------------------------------------------


class GuardedWorker(Worker):
    """A Worker made safe: its child ignores SIGINT (the trainer decides how to stop), plays as an
    InProcessWorker, sends errors as one line, and exits once the trainer is gone (its copies of the
    trainer's pipe ends closed). A child that dies is reported (WorkerError), never waited for."""

    def __init__(self, index: int, env_id: str, seed: int, obs_view: np.ndarray,
                 inherited_trainer_ends: list, guard: "RunGuard"):
        self.inherited_trainer_ends, self.guard = inherited_trainer_ends, guard
        super().__init__(index, env_id, seed, obs_view)

    def child_loop(self, conn, env_id: str, seed: int, obs_view: np.ndarray):
        gc.freeze()  # the trainer's objects (its garbage too) are not the child's to finalize
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        for end in [self.trainer_end, *self.inherited_trainer_ends]:
            end.close()
        try:  # the lesson's loop, its Games played by an InProcessWorker
            games = InProcessWorker(self.index, env_id, seed, obs_view, [], self.guard)
            conn.send(("ok", None))
            while (command := conn.recv())[0] == "step":
                games.send_step(command[1])
                conn.send(("ok", games.receive()))
        except (EOFError, BrokenPipeError, KeyboardInterrupt):
            pass  # the trainer is gone or stopping: just exit
        except Exception as error:  # (a WorkerError of InProcessWorker's names all already)
            failed = f"worker {self.index} ({env_id}) failed: {type(error).__name__}: {error}"
            with contextlib.suppress(OSError):  # ("broken": the env left its spaces)
                conn.send(("broken", str(error)) if isinstance(error, EnvLeftItsSpaces)
                          else ("error", str(error) if isinstance(error, WorkerError) else failed))
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
            with contextlib.suppress(EOFError, OSError):  # (a child that died: how, below)
                status, payload = self.trainer_end.recv()
                if status in ("error", "broken"):  # (the child's line, whole)
                    raise (EnvLeftItsSpaces if status == "broken" else WorkerError)(payload)
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


class WatchedGame(Game):
    """A Game that keeps its env's last observation as it came, to name what broke in it."""

    raw_obs = None

    def observe(self, obs, info: dict) -> np.ndarray:
        self.raw_obs = obs
        return super().observe(obs, info)


class InProcessWorker(Worker):
    """A Worker's Games played here as the lesson's child plays them (--num-workers 0; inside each
    GuardedWorker's child), each step held to the env's spaces (the start-up check saw 100 steps of
    one game), all rows in one test: the observed numbers within their leaves' bounds (with
    --check-env), a mask that allows some choice of each action (with --action-mask); after a Game
    raised, its observation (a shape, a key). One line names the env, the step and what broke."""

    def __init__(self, index: int, env_id: str, seed: int, obs_view: np.ndarray,
                 inherited_trainer_ends: list, guard: "RunGuard"):
        self.index, self.env_id, self.obs_view, self.trainer_end = index, env_id, obs_view, None
        self.env, self.config, self.steps_per_step = guard.env, guard.config, guard.steps_per_step
        self.first_step, self.steps = guard.main.global_step, 0  # steps taken, all Games at once
        low, high = [], []
        for _, space in observed_leaves(self.env.obs_space):
            if isinstance(space, spaces.Box):
                bounds = space.low, space.high
            elif isinstance(space, spaces.MultiBinary):
                bounds = 0, 1
            else:  # Discrete, MultiDiscrete: from start to start + choices - 1
                choices = getattr(space, "nvec", getattr(space, "n", 0))
                bounds = space.start, space.start + choices - 1
            low.append(np.broadcast_to(bounds[0], space.shape).reshape(-1))
            high.append(np.broadcast_to(bounds[1], space.shape).reshape(-1))
        self.low, self.high = (np.concatenate(side).astype(np.float32) for side in (low, high))
        self.dims = mask_dims(self.env.action_space)  # [(name, choices)], the mask's columns
        choices = [n for _, n in self.dims]
        self.dim_starts = np.cumsum(choices) - choices
        self.mask_start = self.env.obs_size - sum(choices)
        self.games = [WatchedGame(env_id, seed + i) for i in range(len(obs_view))]
        self.play(lambda game, row: (game.reset(),))

    def send_step(self, actions: np.ndarray):
        self.actions = actions

    def receive(self) -> list:
        self.steps += 1
        return self.play(lambda game, row: game.step(self.actions[row]))

    def play(self, turn) -> list:
        """Each Game's turn (reset or step): observations into the rows, checked; the rest back."""
        try:
            results = [turn(game, row) for row, game in enumerate(self.games)]
            self.obs_view[:] = [obs for obs, *_ in results]
        except Exception:
            self.find_broken()
            raise
        rows, numbers = self.obs_view, self.obs_view[:, :len(self.low)]
        if self.config.check_env and not ((numbers >= self.low) & (numbers <= self.high)).all():
            self.find_broken()
        if self.env.masked:
            allowed = np.add.reduceat(rows[:, self.mask_start:] > 0, self.dim_starts, axis=1)
            if not allowed.all():
                row, dim = np.argwhere(allowed == 0)[0]
                name, choices = self.dims[dim]
                self.stop(row, f"its action mask forbids all {choices} choices of {name}")
        return [rest for _, *rest in results]

    def find_broken(self):
        """Stop at the first Game whose observation broke the spaces, if one did."""
        for row, game in enumerate(self.games):
            if game.raw_obs is not None and (
                    problem := mismatch(self.env.obs_space, game.raw_obs, "the observation")):
                self.stop(row, problem)

    def stop(self, row: int, problem: str):
        game, env = self.games[row], self.index * len(self.games) + row  # (of this rank)
        step = self.first_step + self.steps * self.steps_per_step
        when = f"step {game.episode_length} of its episode" if game.episode_length else "reset()"
        raise EnvLeftItsSpaces(f"{self.config.env} broke its spaces in env {env} at step "
                               f"{step:,} of the run ({when}): {problem}") from None

    def close(self):
        for game in self.games:
            game.env.close()


class WorkerPool:
    """All the games of this rank: num_workers GuardedWorkers (or an InProcessWorker), their
    observations in one shared-memory segment that no process outlives."""

    def __init__(self, guard: "RunGuard", first_seed: int):
        config, self.device, self.workers, self.shared_obs = guard.config, guard.device, [], None
        shape = (config.num_envs, guard.obs_size)
        if config.num_workers:
            self.shared_obs = shared_memory.SharedMemory(create=True, size=int(np.prod(shape)) * 4)
        buffer = self.shared_obs.buf if self.shared_obs else None  # (None: an array of its own)
        self.obs_array = np.ndarray(shape, np.float32, buffer)
        worker_class = GuardedWorker if config.num_workers else InProcessWorker
        share = config.num_envs // max(config.num_workers, 1)
        try:
            for index in range(max(config.num_workers, 1)):
                self.workers.append(worker_class(
                    index, config.env, first_seed + index * share,
                    self.obs_array[index * share:(index + 1) * share],
                    [w.trainer_end for w in self.workers if w.trainer_end], guard))
        except BaseException:
            self.close()  # the workers started so far
            raise
        if self.shared_obs is not None:  # mapped by the children now: no segment outlives the run
            self.shared_obs.unlink()
        self.obs = torch.from_numpy(self.obs_array)

    def observations(self) -> torch.Tensor:  # the games' current ones, on the training device
        return self.obs.to(self.device)

    def step(self, actions: dict) -> StepResult:
        """Send all Workers their actions first, then collect: the children play in parallel."""
        rows, share = packed(actions), len(self.obs) // len(self.workers)
        for index, worker in enumerate(self.workers):
            worker.send_step(rows[index * share:(index + 1) * share])
        return StepResult.of([step for worker in self.workers for step in worker.receive()])

    def close(self):
        for worker in self.workers:
            worker.close()
        self.workers = []
        if self.shared_obs is not None:
            self.obs = self.obs_array = None  # drop the views before unmapping the memory
            self.shared_obs.close()
            self.shared_obs = None

# ----- Compilation and Adam written out -----------------------------------------------------------


def compile_learner(main: Main):
    """torch.compile, of the networks' forwards and the loss (seconds that small networks never earn
    back: off by default); the bound methods, so the checkpoint's names stay. All compile here, in
    the batch sizes they will see: a machine that cannot falls back to eager, with a warning."""
    logging.getLogger("torch.utils.cpp_extension").addFilter(not_the_cuda_home_warning)
    model, trainer, config, guard = main.model, main.trainer, main.config, main.guard
    networks = (model.encoder, model.actor, model.critic)
    eager_forwards, eager_loss = [network.forward for network in networks], trainer.compute_loss
    rows = config.num_envs * config.num_steps // config.num_minibatches
    first_obs = torch.from_numpy(guard.env.first_obs).to(guard.device)[None]
    try:
        for network, forward in zip(networks, eager_forwards):
            network.forward = torch.compile(forward)
        trainer.compute_loss = torch.compile(eager_loss)
        with torch.no_grad():
            model.act(first_obs.expand(config.num_envs, -1))
            obs = first_obs.expand(rows, -1)
            actions, log_probs, values = model.act(obs)
        loss, _ = trainer.compute_loss(Minibatch(obs, actions, log_probs, values + 1, values,
                                                 values))
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


def merge_over_ranks(ranks: Ranks, model: Model, name: str, weights: dict):
    """Under torchrun, after each rollout: each rank's share is what its statistics `name` gained
    since the last update's `weights` (Chan's formula, inverted); all merge all shares, in order."""
    stats = getattr(model, name)  # obs_stats or return_stats
    if not ranks.distributed or not stats.active:
        return
    before = {key: weights[f"{name}.{key}"] for key in ("mean", "var", "count")}
    old_count, count = float(before["count"]), stats.count.item()
    own = count - old_count
    own_mean = before["mean"] + (stats.mean - before["mean"]) * (count / own if own else 0.0)
    delta = own_mean - before["mean"]
    squares = (stats.var * count - before["var"] * old_count
               - delta.square() * old_count * own / count)
    own_var = squares / own if own else torch.zeros_like(squares)
    stats.load_state_dict(before)
    for count, mean, var in ranks.gather((own, own_mean.cpu(), own_var.cpu())):
        stats.merge(count, mean.to(stats.mean.device), var.to(stats.var.device))

# ----- RunGuard: set-up, Ctrl-C, failures, logging, the summary -----------------------------------


class UsageError(ValueError):
    """Bad input from the user: the command line prints its message on one line, exit status 2."""


class WorkerError(RuntimeError):
    """A worker process died or one of its Games raised: the run stops with this message."""


class EnvLeftItsSpaces(WorkerError):
    """The env left its spaces mid-run (InProcessWorker): bad input as a refused flag is (exit 2),
    though found late; the run stops as after a worker's failure, its last finished update saved."""
    exit_status = 2


class Interrupted(Exception):
    """Ctrl-C or SIGTERM arrived: the run stops at the next step and saves what it has."""


class NonFiniteLoss(RuntimeError):
    """A loss or gradient became NaN or infinite: the run stops rather than train on garbage."""


FAILURES = (WorkerError, NonFiniteLoss, RankError)  # what stops a run with exit status 1


class RunGuard(Run):
    """The lesson's Run made safe. On entry: the settings, --resume's checkpoint, the env (checked),
    the ranks, the run dir, the seeds. In the loop: Ctrl-C, checkpoints, non-finite losses, told by
    its RunLog. On exit, however it ended: the games closed, the last checkpoint and the summary
    saved (a failure raised again after), signal handlers and torch's threads given back."""

    def __init__(self, main: Main):
        super().__init__(main)
        self.stop_signal, self.signals, self.ranks, self.log = None, None, None, None
        self.previous_threads = torch.get_num_threads()

    solved_step = property(lambda self: self.log.solved_step)  # --target-return was reached
    optimizer = Adam if Run.optimizer is torch.optim.Adam else Run.optimizer  # torch's, faster

    @staticmethod
    def evaluate(config: Config) -> dict:
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
        self.checkpoint = load_checkpoint(self.config.resume) if self.config.resume else None
        config = resumed_config(self.checkpoint, self.config) if self.checkpoint else self.config
        check_settings(config)
        self.env = inspect_env(config)  # its spaces (checked), its mask
        self.obs_space, self.action_space, self.obs_size, self.masked = self.env[:4]
        self.minibatches_by_kind = config.num_minibatches is None  # the lesson's default, checked
        minibatches = config.num_minibatches or default_minibatches(self.obs_space)
        config = dataclasses.replace(config, num_minibatches=minibatches)
        check_settings(config)
        refuse_what_will_not_fit(needed_memory(config, self.env), "the rollout and the games")
        # Under torchrun, join the other ranks (each on a GPU of its own); alone, a world of one.
        self.ranks = Ranks(pick_device(config.device))
        self.device = self.ranks.device
        self.steps_per_step = config.num_envs * self.ranks.world_size  # all envs of all ranks
        # Rank 0 names and makes the run dir: the default name holds the time, which may differ.
        self.run_dir = self.ranks.from_rank_0(lambda: make_run_dir(config, self.checkpoint))
        self.main.config = config = dataclasses.replace(config, run_dir=str(self.run_dir))
        # The trainer draws from torch's seeded generator (rank r's: seed + r), each game its own.
        self.seed = config.seed + self.ranks.rank
        random.seed(self.seed)
        np.random.seed(self.seed)
        torch.manual_seed(self.seed)
        # One thread is fastest for networks this small (benchmarks/README.md); given back after.
        torch.set_num_threads(1)
        self.updates, self.checkpoint_path = 0, self.run_dir / "checkpoint.pt"
        self.log = RunLog(self, start_time)

    def prepare_learner(self) -> int:
        """--resume's checkpoint restored, every rank at rank 0's weights, --compile: the step."""
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
        self.last_good_learner = copy.deepcopy(learner_state(main))  # what a failure goes back to
        self.last_checkpoint_step = main.global_step
        return main.global_step

    def start_games(self) -> WorkerPool:  # game i of rank r is seeded with seed + r * num_envs + i
        first_seed = self.config.seed + self.ranks.rank * self.config.num_envs
        self.games = WorkerPool(self, first_seed)  # (the step check reads the run's env and step)
        return self.games

    def stop_at_once(self) -> bool:  # under torchrun, all ranks stop together after the rollout
        return self.stop_signal is not None and not self.ranks.distributed

    def mean(self, value: float) -> float:  # over the ranks (the value itself without torchrun)
        return self.ranks.mean([value])[0]

    def after_rollout(self, ended: list):
        """Record the rollout's episodes; raise Interrupted if asked to stop. Under torchrun the
        ranks meet here: they merge their statistics, learn all episodes (by step, then rank)."""
        for name in ("obs_stats", "return_stats"):
            merge_over_ranks(self.ranks, self.main.model, name, self.last_good_learner["model"])
        shared = self.ranks.gather((ended, self.stop_signal))
        for step, episode in sorted((item for rank_ended, _ in shared for item in rank_ended),
                                    key=lambda step_and_episode: step_and_episode[0]):
            self.log.record_episode(episode, step)
        signals = [signum for _, signum in shared if signum is not None]
        if signals:
            self.stop_signal = signals[0]
            raise Interrupted

    def after_update(self, stats: dict):
        """The ranks' mean diagnostics: stop if one is not finite, else log; save when due."""
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
        """Close the games and, unless the error is bad input or a bug, save the last checkpoint and
        the summary. Ctrl-C ends a run normally; a failure is raised again once all is saved."""
        try:
            if self.games is not None:
                self.games.close()
            if kind is not None and not issubclass(kind, (Interrupted, *FAILURES)):
                return False
            failure = error if isinstance(error, FAILURES) else None
            if failure is not None:  # an update or rollout half done: back to the last finished
                restore_learner(self.main, self.last_good_learner)
            else:  # all ranks are here together: check they trained the same network
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


class RunLog:
    """What a run tells, from rank 0: the start-up block, progress lines (at most one a second),
    TensorBoard, summary.json, a closing line; its counts span resumes, its speeds this process."""

    def __init__(self, guard: RunGuard, start_time: float):
        self.guard, self.main, self.start_time = guard, guard.main, start_time
        saved = (guard.checkpoint or {}).get("log", {})  # what the run counted before a resume
        self.resumed_at_step = int(guard.checkpoint["global_step"]) if guard.checkpoint else None
        self.episodes, self.earlier_seconds = saved.get("episodes", 0), saved.get("seconds", 0.0)
        self.recent_returns = deque(saved.get("recent_returns", []), maxlen=100)
        self.recent_lengths = deque(saved.get("recent_lengths", []), maxlen=100)
        self.solved_step = self.solved_seconds = self.first_update_end = self.printed_step = None
        self.last_print, self.writer, self.say = 0.0, None, lambda line: None
        if guard.ranks.rank == 0:  # rank 0 speaks for all; TensorBoard shows the settings too
            from torch.utils.tensorboard import SummaryWriter

            self.writer, self.say = SummaryWriter(str(guard.run_dir)), tell
            rows = "\n".join(f"|{key}|{value}|" for key, value in
                             dataclasses.asdict(guard.config).items())
            self.writer.add_text("hyperparameters", f"|param|value|\n|-|-|\n{rows}")

    def start(self):
        """What runs where, what differs from the defaults, and how far it goes."""
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
        left_out = ("run_dir", "num_minibatches") if guard.minibatches_by_kind else ("run_dir",)
        changed = [(f.name.replace("_", "-"), getattr(config, f.name))
                   for f in dataclasses.fields(Config)
                   if f.name not in left_out and getattr(config, f.name) != f.default]
        if changed:
            self.say("settings: " + " ".join(f"--{'' if value else 'no-'}{flag}"
                                              if isinstance(value, bool) else f"--{flag} {value}"
                                              for flag, value in changed))
        if guard.minibatches_by_kind:  # (not typed: left out of the settings above)
            self.say(f"minibatches: {config.num_minibatches}, the default for this observation's "
                     "kind (4 with an image leaf, else 16; --num-minibatches sets them)")
        for line in guard.env.notes:  # the leaves left out, where the action mask comes from
            self.say(line)
        if self.resumed_at_step is not None:
            self.main.anneal_learning_rate()  # as the next update will: the rate it takes
            until = f", annealed to 0 by step {self.last_step:,}" if config.anneal_lr else ""
            self.say(f"resuming from {guard.checkpoint['path']} at step {step:,} (learning rate "
                     f"{self.main.trainer.optimizer.param_groups[0]['lr']:.6g}{until})")
        if config.compile:
            self.say("compiling the model and the update (torch.compile, once: up to a minute)...")

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
    """Everything needed to continue learning (the Model's holds its running statistics), in types
    that torch.load(..., weights_only=True) reads back: a checkpoint cannot run code."""
    return {
        "script": SCRIPT, "env": main.config.env, "obs_size": main.guard.obs_size,
        "config": dataclasses.asdict(main.config),
        "model": main.model.state_dict(), "optimizer": main.trainer.optimizer.state_dict(),
        "global_step": main.global_step, "updates": main.guard.updates,
        "anneal_from": list(main.anneal_from), "log": main.guard.log.state(),
        "rng": {"torch": torch.get_rng_state()},
    }


def load_weights(model: Model, checkpoint: dict, config: Config):
    """The checkpoint's Model state into `model`, refused in one line if it does not fit. One from
    before the running statistics were the Model's (its "normalizer") gets them as `obs_stats`."""
    weights = {key: value for key, value in model.state_dict().items() if "return_stats" in key}
    weights.update(checkpoint["model"])  # (fresh return_stats where it is from before them)
    for key, value in checkpoint.get("normalizer", {}).get("obs", {}).items():
        weights.setdefault(f"obs_stats.{key}", value)
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
    load_weights(main.model, state, main.config)
    load_optimizer(main.trainer.optimizer, state["optimizer"])
    main.global_step, main.guard.updates = int(state["global_step"]), int(state["updates"])
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
    """A resumed (or evaluated) run's settings: the checkpoint's, but those given now (typed, or in
    code unlike the defaults); the run dir is the checkpoint's folder. Another env or network is
    refused."""
    fields = dataclasses.fields(Config)
    saved = {f.name: checkpoint["config"][f.name] for f in fields if f.name in checkpoint["config"]}
    saved.setdefault("scale_rewards", False)  # (a checkpoint from before --scale-rewards)
    saved["run_dir"] = str(Path(checkpoint["path"]).parent)
    typed = getattr(given, "typed", None)  # the command line's flags (None: Config(...) in code)
    changed = {f.name: getattr(given, f.name) for f in fields
               if (f.name in typed if typed is not None else getattr(given, f.name) != f.default)}
    for name in ("env", "hidden_size"):
        if name in changed and changed[name] != saved.get(name):
            raise UsageError(f"the checkpoint was trained with --{name.replace('_', '-')} "
                             f"{saved.get(name)}, not {changed[name]}")
    return Config(**{**saved, **changed})

# ----- Evaluation and video -----------------------------------------------------------------------


@torch.no_grad()
def evaluate_checkpoint(given: Config) -> dict:
    """--eval: play --eval-episodes games with a checkpoint's policy (statistics frozen)."""
    check_settings(given)
    checkpoint = load_checkpoint(given.eval)
    config = resumed_config(checkpoint, given)
    env = inspect_env(config)
    model = Model(env.obs_space, env.action_space, config.hidden_size, env.masked,
                  config.normalize_observations, config.obs_clip)
    load_weights(model, checkpoint, config)
    torch.manual_seed(config.seed)
    game = Game(config.env, config.seed, **({"render_mode": "rgb_array"} if config.video else {}))
    video, path, returns, obs = None, Path(config.run_dir) / "eval.mp4", [], game.reset()
    try:
        while len(returns) < config.eval_episodes:
            if config.video:
                video = write_frame(video, game, path)
            obs = model.obs_stats.normalize(torch.from_numpy(obs)[None], update=False)
            actions, _, _ = model.act(obs, greedy=config.greedy)
            obs, _, _, _, info = game.step(packed(actions)[0])
            if "episode" in info:
                returns.append(float(info["episode"]["return"]))
    finally:
        game.close()
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

    # pygame (the classic-control games' pictures) needs neither SDL's display nor its sound.
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
    """Refuse in one line what cannot work: a number out of its field's range; flags at odds."""
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
    batch_size, split = config.num_envs * config.num_steps, config.num_minibatches  # None: by kind
    if split and batch_size % split:
        raise UsageError(f"the batch of {batch_size} steps (--num-envs x --num-steps) does not "
                         f"split into --num-minibatches {split}")
    if split and batch_size // split < 2:
        raise UsageError(f"minibatches of {batch_size // split} step cannot be "
                         f"normalised: raise --num-envs or --num-steps, or lower --num-minibatches")


def needed_memory(config: Config, env: "EnvSpaces") -> int:
    """About the bytes of the rollout and an update (4 a number: a step's observation, its encoded
    features, the networks' activations) and of the games (as tracemalloc counts one). Peak RSS of
    256 envs of 128, then 512 steps: Pendulum-v1 708, then 824 MB (1.2 KB a step), Taxi-v4 902, then
    1192 MB (3.0 KB: its one-hot has 500 features); 1024, then 2048 Taxi envs of 8 steps: 1398, then
    2224 MB (0.8 MB a game; tracemalloc counts 0.74 MB)."""
    features = Encoder(env.obs_space, config.hidden_size).features
    step_bytes = 4 * (env.obs_size + features + 5 * config.hidden_size)
    return config.num_envs * (config.num_steps * step_bytes + env.game_bytes)


class EnvSpaces(typing.NamedTuple):
    """What the run needs to know of its env, found at start-up (`inspect_env`)."""

    obs_space: gym.Space
    action_space: gym.Space
    obs_size: int  # numbers in a Game's flat observation: the observed leaves', then the mask's
    masked: bool  # the env gives an action mask, and --action-mask uses it
    first_obs: np.ndarray  # the flat first observation of game 0 (compilation warms up on it)
    notes: list  # start-up lines: the leaves left out, where the mask comes from
    game_bytes: int  # the memory one Game holds, as tracemalloc counts it


HANDLED = (spaces.Box, spaces.Discrete, spaces.MultiDiscrete, spaces.MultiBinary)
CHOICES = (spaces.Discrete, spaces.MultiDiscrete)  # the action leaves a mask covers


def inspect_env(config: Config) -> EnvSpaces:
    """Check that the env exists and that this script can play it; with --check-env, that it keeps
    to its spaces (check_env_specs). One Game tells the flat observation's size and the mask's."""
    env_id, check = config.env, config.check_env
    if check:  # the spec check's one line says what is wrong: not gymnasium's warnings first
        warnings.filterwarnings("ignore", module=r"gymnasium\.utils\.passive_env_checker")
    module, _, registered = env_id.rpartition(":")  # "module:Env-v0": the module registers it
    if module:
        try:
            importlib.import_module(module)
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
        if registered.startswith(("MiniGrid-", "BabyAI-")) and not module:
            raise UsageError(f"{env_id} comes with minigrid: pip install minigrid, then give "
                             f"--env minigrid:{env_id} (the module registers it)")
        close = difflib.get_close_matches(registered, list(gym.registry), n=3, cutoff=0.6)
        hint = (f"; did you mean {' or '.join(close)}?" if close
                else "; see gymnasium.pprint_registry()")
        raise UsageError(f"unknown env {env_id!r}{hint}")
    tracemalloc.start()  # what one game holds (needed_memory counts num_envs of them)
    try:
        game = Game(env_id, config.seed)
    except Exception as error:
        tracemalloc.stop()
        raise UsageError(f"cannot make {env_id}: {type(error).__name__}: {error}") from None
    try:
        first_obs = game.reset()
    except Exception as error:
        if check:  # a reset that breaks its spaces: the check names how
            check_env_specs(env_id, config.seed)
        raise UsageError(f"{env_id}'s reset() failed: {type(error).__name__}: {error}") from None
    finally:
        game_bytes = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        game.close()
    obs_space, action_space = game.env.observation_space, game.env.action_space
    unhandled = [f"a {type(leaf).__name__} space" + (f" at {'/'.join(map(str, path))}" if path
                                                      else "")
                 for path, leaf in leaves(action_space) if not isinstance(leaf, HANDLED)]
    if unhandled:
        raise UsageError(f"{env_id}'s action space has {unhandled[0]}: this script handles Box, "
                         f"Discrete, MultiDiscrete and MultiBinary leaves in Dict and Tuple nests, "
                         f"and no script of this library handles other actions")
    if not observed_leaves(obs_space):
        raise UsageError(f"{env_id} observes {obs_space}: no leaf of fixed-size numbers (Box, "
                         f"Discrete, MultiDiscrete, MultiBinary), and no script of this library "
                         f"handles such observations")
    notes = [f"observation {'/'.join(map(str, path))} ({type(leaf).__name__}) left out: no "
             f"fixed-size numbers to encode" for path, leaf in leaves(obs_space)
             if not obs_kind(leaf) and path != ("action_mask",)]
    choices = sum(n for _, n in mask_dims(action_space))
    where = ("the observation's action_mask" if isinstance(obs_space, spaces.Dict)
             and "action_mask" in obs_space.spaces else 'info["action_mask"]')
    masked = bool(game.mask_size) and config.action_mask
    if masked and game.mask_size != choices:
        raise UsageError(f"{env_id}'s action mask ({where}) has {game.mask_size} entries, but its "
                         f"Discrete and MultiDiscrete actions have {choices} choices in all: "
                         f"--no-action-mask ignores the mask")
    if game.mask_size:
        notes.append(f"action mask: {where}, " + (f"{choices} choices" if masked
                                                  else "ignored (--no-action-mask)"))
    if check:
        check_env_specs(env_id, config.seed)
    return EnvSpaces(obs_space, action_space, len(first_obs), masked, first_obs, notes, game_bytes)


def check_env_specs(env_id: str, seed: int, steps: int = 100):
    """As TorchRL's check_env_specs: `steps` random (allowed) actions, each observation checked
    against the observation space (keys, shape, dtype, bounds: `mismatch`), each reward (a finite
    number) and end flag (a bool); the first that does not fit is refused in one line."""
    env = gym.make(env_id, disable_env_checker=True)  # (gymnasium's own checker only warns)
    env.action_space.seed(seed)
    where, step = "reset()", 0
    try:
        obs, info = env.reset(seed=seed)
        problem = mismatch(env.observation_space, obs, "reset()'s observation")
        while problem is None and step < steps:
            step, where = step + 1, f"step {step + 1}"
            obs, reward, terminated, truncated, info = env.step(
                random_action(env.action_space, obs, info))
            problem = (mismatch(env.observation_space, obs, f"{where}'s observation")
                       or outcome_mismatch(reward, terminated, truncated, where))
            if problem is None and (terminated or truncated):
                where = f"reset() after step {step}"
                obs, info = env.reset()
                problem = mismatch(env.observation_space, obs, f"{where}'s observation")
    except Exception as error:
        raise UsageError(f"{env_id} failed in {where} of the spec check: {type(error).__name__}: "
                         f"{error} (--no-check-env skips this check)") from None
    finally:
        env.close()
    if problem is not None:
        raise UsageError(f"{env_id} does not keep to its spaces: {problem} "
                         f"(--no-check-env skips this check)")


def random_action(action_space, obs, info: dict):
    """A random action, its choices among those the env's mask allows (if one covers them)."""
    mask = obs["action_mask"] if isinstance(obs, dict) and "action_mask" in obs else (
        info.get("action_mask"))
    dims = [n for _, n in mask_dims(action_space)]
    pieces = (iter(np.split(np.asarray(mask, np.int8).reshape(-1), np.cumsum(dims)[:-1]))
              if mask is not None and np.size(mask) == sum(dims) else None)  # one a dimension
    values = [space.sample() if pieces is None or not isinstance(space, CHOICES) else
              space.sample(mask=next(pieces)) if isinstance(space, spaces.Discrete) else
              space.sample(mask=tuple(next(pieces) for _ in np.ravel(space.nvec)))
              for _, space in leaves(action_space)]  # (in turn: each takes its dimensions' masks)
    return nest_of(action_space, iter(values))


def mask_dims(action_space) -> list:
    """What a mask covers: each Discrete or MultiDiscrete action dimension's (name, choices)."""
    dims = []
    for path, space in leaves(action_space):
        name = "/".join(map(str, path)) or "action"
        if isinstance(space, spaces.Discrete):
            dims.append((name, int(space.n)))
        elif isinstance(space, spaces.MultiDiscrete):
            dims += [(f"{name}[{d}]", int(n)) for d, n in enumerate(np.ravel(space.nvec))]
    return dims


def outcome_mismatch(reward, terminated, truncated, where: str) -> Optional[str]:
    """Why a step's reward or end flags are not what gymnasium's API asks for; None if they are."""
    if not isinstance(reward, (int, float, np.integer, np.floating)) or not math.isfinite(reward):
        return f"{where}'s reward is {reward!r}, not a finite number"
    for name, flag in (("terminated", terminated), ("truncated", truncated)):
        if not isinstance(flag, (bool, np.bool_)):
            return f"{where}'s {name} is {flag!r}, not a bool"
    return None


def mismatch(space, value, where: str) -> Optional[str]:
    """Why `value` does not belong to `space`, naming the first leaf that differs; None if fits."""
    if isinstance(space, spaces.Dict):
        if not isinstance(value, dict) or set(value) != set(space.spaces):
            found = f"the keys {sorted(value)}" if isinstance(value, dict) else type(value).__name__
            return f"{where} has {found}, not the keys {sorted(space.spaces)}"
        return next((problem for key, sub in space.spaces.items()
                     if (problem := mismatch(sub, value[key], f"{where}[{key!r}]"))), None)
    if isinstance(space, spaces.Tuple):
        if not isinstance(value, (tuple, list)) or len(value) != len(space):
            found = f"{len(value)} items" if isinstance(value, (tuple, list)) else repr(value)
            return f"{where} has {found}, not a tuple of {len(space)}"
        return next((problem for index, sub in enumerate(space)
                     if (problem := mismatch(sub, value[index], f"{where}[{index}]"))), None)
    if not isinstance(space, HANDLED):
        return None if space.contains(value) else f"{where} = {value!r} is not in {space}"
    array = np.asarray(value)
    if array.shape != space.shape:
        return f"{where} has shape {array.shape}, not {space.shape}"
    integer = np.issubdtype(array.dtype, np.integer) or array.dtype == bool
    if array.dtype != space.dtype and not (integer and not isinstance(space, spaces.Box)):
        return f"{where} has dtype {array.dtype}, not {space.dtype}"
    if not space.contains(array.astype(space.dtype)[()]):  # (a Discrete: a number)
        return f"{where} = {np.array2string(array, threshold=8)} is outside {space}"
    return None


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
