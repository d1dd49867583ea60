"""PPO for teams of agents, each team (policy group) sharing one policy, on PettingZoo parallel
envs (MPE2's simple_spread by default), after the PPO paper (Schulman et al., 2017), "The 37
Implementation Details of PPO" (Huang et al., 2022: "37 details") and MAPPO (Yu et al., 2022).

PPO plays a rollout with the current policy, learns from it for several epochs of minibatch steps,
and clips the probability ratio rho_t = pi(a_t|s_t) / pi_old(a_t|s_t) so that the new policy stays
near the one that played (`Trainer.ppo_loss` derives it); advantages come from the rewards r_t by
GAE (`compute_gae`). Many agents: agents of one kind (same observations and actions) form a policy
group, one network playing every agent of its group in every env (parameter sharing), each agent's
step a row of its group's batch (`assign_groups`, `Game`): predators and prey get a network each.
The critic sees the env's global state (MAPPO) or the agent's own observation (`Model`); absent
agents are masked out of every loss (`Trainer`). Discrete actions: a softmax; Box: a Gaussian.

Run it:         python ppo_multiagent.py   (--help lists every flag; --env-kwargs N=5: 5 agents)
Two teams:      python ppo_multiagent.py --env mpe2.simple_tag_v3  (adversary, agent; --groups)
On N GPUs:      torchrun --standalone --nproc_per_node N ppo_multiagent.py  (data parallel)
In a notebook:  Main(Config(total_timesteps=60_000)).run() (imported, or pasted down to the banner)
"""

import argparse
import contextlib
import dataclasses
import difflib
import math
import multiprocessing
import os
import pkgutil
import time
import typing
from collections import deque, namedtuple
from typing import Optional

SCRIPT = "ppo_multiagent"


def option(default, help, check=None):  # a Config field, its --help line, its valid range
    return dataclasses.field(default=default, metadata={"help": help, "check": check})


@dataclasses.dataclass
class Config:
    """Every setting of a run, each also a flag (`num_envs` -> `--num-envs`); the defaults learn
    simple_spread fastest (benchmarks/README.md). A step is one agent acting once (as in SB3)."""

    # PPO's hyperparameters.
    learning_rate: float = option(2e-3, "Adam's step size, annealed linearly to 0", "> 0")
    anneal_lr: bool = option(True, "anneal the learning rate linearly to 0 over the run")
    gamma: float = option(0.95, "discount: 0.95 looks ~20 steps ahead, about an episode", "(0, 1]")
    gae_lambda: float = option(0.95, "GAE: bias (0) vs variance (1) of the advantage", "[0, 1]")
    num_minibatches: int = option(2, "minibatches each rollout is split into", "> 0")
    update_epochs: int = option(10, "passes over each rollout", "> 0")
    clip_coef: float = option(0.2, "PPO's clip range for the probability ratio", "> 0")
    clip_value_loss: bool = option(False, "clip the value update too")
    ent_coef: float = option(0.01, "weight of the entropy bonus", ">= 0")
    vf_coef: float = option(0.5, "weight of the value loss", ">= 0")
    max_grad_norm: float = option(10.0, "clip each group's gradient norm to this (MAPPO)", "> 0")
    target_kl: Optional[float] = option(None, "stop an update's epochs at this approx KL", "> 0")
    hidden_size: int = option(64, "units in each of the two hidden layers of both MLPs", "> 0")
    agent_id: bool = option(False, "show each agent a one-hot of its index in its group")
    central_value: bool = option(True, "the critic sees the global state and agent id (MAPPO)")
    # Collecting experience.
    env: str = option("mpe2.simple_spread_v3", "PettingZoo parallel env, as module.name")
    env_kwargs: str = option("", "the env's own options, e.g. N=5,local_ratio=0.3")
    groups: str = option("", "prefix=group, e.g. adversary=predators,agent=prey; empty: by kind")
    num_envs: int = option(16, "envs played side by side (by each rank, under torchrun)", "> 0")
    num_workers: int = option(2, "child processes that run the envs (0 = in this process)", ">= 0")
    num_steps: int = option(25, "env steps per env in each rollout", "> 0")
    # The run.
    seed: int = option(1, "seeds everything; env i of rank r gets seed + r * num_envs + i", ">= 0")
    total_timesteps: int = option(600_000, "agent steps over all agents, envs (and ranks)", "> 0")
    device: str = option("auto", "auto | cpu | cuda: auto takes CUDA when present")
    run_dir: Optional[str] = option(
        None, "logs, checkpoint and summary go here (default runs/<env>__<script>__<seed>__<time>)")
    overwrite: bool = option(False, "replace the run already in --run-dir instead of refusing")
    target_return: Optional[float] = option(None, "stop when 100 episodes average this per agent")
    target_group: str = option("", "--target-return is this group's per agent; empty: all agents'")
    checkpoint_every: int = option(200_000, "save a checkpoint every this many steps", "> 0")
    resume: Optional[str] = option(None, "continue training from this checkpoint or run folder")
    eval: Optional[str] = option(None, "play --eval-episodes episodes with this checkpoint or run")
    eval_episodes: int = option(10, "episodes played by --eval", "> 0")
    greedy: bool = option(False, "with --eval, take the most likely action instead of sampling")
    video: bool = option(False, "with --eval, write an mp4 of the episodes into the run dir")
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

import numpy as np
import torch
import torch.nn as nn


def assign_groups(agents: list, kinds: list, prefixes: dict) -> dict:
    """Policy groups, {group name: slots of its agents}, whose agents share one actor-critic, so
    observe and act alike. By default one group per kind (`kinds[slot]`: that agent's observation
    and action spaces), named by its agents' common name prefix (adversary_0, adversary_1 ->
    "adversary"). With `prefixes` ({name prefix: group}, from --groups) an agent joins the group of
    the longest prefix its name starts with; one that matches none is a ValueError."""
    groups = {}
    for slot, agent in enumerate(agents):
        matches = [prefix for prefix in prefixes if agent.startswith(prefix)]
        if prefixes and not matches:
            raise ValueError(f"agent {agent} matches no name prefix of --groups")
        key = prefixes[max(matches, key=len)] if prefixes else kinds[slot]
        groups.setdefault(key, []).append(slot)
    if prefixes:
        return groups
    named = {}  # each kind's name: its agents' common prefix, without _<number>
    for slots in groups.values():
        name = os.path.commonprefix([agents[slot] for slot in slots]).rstrip("_0123456789")
        named[name if name and name not in named else f"{name or 'group'}{len(named)}"] = slots
    return named


# A policy group: its agents (names; slots, their places in possible_agents), an observation's size,
# its action space (as gymnasium writes it) and actions (Discrete: the choices; Box: the dimensions,
# clipped to low..high), and the columns of its rows (`Game`) the policy reads, the critic, in all.
GroupSpec = namedtuple("GroupSpec", "name agents slots obs_size action_space num_actions "
                       "continuous low high policy_size value_size row_size")
# An env: its agent slots, its global state's size (0 without --central-value), its groups (in the
# order of their first agents), widest action (Box: dimensions, else 1) and row, and rows' flags.
EnvSpec = namedtuple("EnvSpec", "num_agents state_size groups action_columns width agent_id "
                     "central_value")


def describe_env(env, config: Config, prefixes: dict) -> EnvSpec:
    """A (reset) env's policy groups and the sizes of their networks and rows (`Game`)."""
    agents, groups = list(env.possible_agents), []
    spaces = [(env.observation_space(agent), env.action_space(agent)) for agent in agents]
    state_size = int(np.asarray(env.state()).size) if config.central_value else 0
    for name, slots in assign_groups(agents, [str(pair) for pair in spaces], prefixes).items():
        obs_space, action_space = spaces[slots[0]]
        obs_size, continuous = int(np.prod(obs_space.shape)), action_space.shape != ()  # a Box
        policy_size = obs_size + (len(slots) if config.agent_id else 0)
        value_size = state_size + len(slots) if config.central_value else policy_size
        bounds = (action_space.low.tolist(), action_space.high.tolist()) if continuous else ([], [])
        groups.append(GroupSpec(
            name, [agents[slot] for slot in slots], list(slots), obs_size, str(action_space),
            int(action_space.shape[0] if continuous else action_space.n), continuous, *bounds,
            policy_size, value_size, policy_size + (value_size if config.central_value else 0)))
    return EnvSpec(len(agents), state_size, tuple(groups),
                   max(group.num_actions if group.continuous else 1 for group in groups),
                   max(group.row_size for group in groups), config.agent_id, config.central_value)


class Game:
    """One PettingZoo parallel env whose agents the groups' policies play; each value is an array
    over its agent slots (`possible_agents`). An agent's row, what its group's networks read: its
    observation; with --agent-id a one-hot of its place in its group (so that alike agents can act
    apart); with --central-value the env's global state and the one-hot again (the critic's input);
    zeros up to `spec.width`. An absent agent (done early, or not yet there) has a row of zeros and
    `present` False. All done, the env restarts at once."""

    def __init__(self, env_id: str, seed: int, spec: EnvSpec, env_kwargs: Optional[dict] = None):
        self.env = pkgutil.resolve_name(env_id).parallel_env(**(env_kwargs or {}))
        self.agents, self.seed, self.spec = list(self.env.possible_agents), seed, spec
        self.num_agents, self.groups = len(self.agents), {g.name: g.slots for g in spec.groups}
        # Each slot's one-hot within its group; a Discrete action is one number, a Box a vector.
        self.one_hot = {slot: np.eye(len(slots), dtype=np.float32)[i]
                        for slots in self.groups.values() for i, slot in enumerate(slots)}
        self.discrete = [self.env.action_space(agent).shape == () for agent in self.agents]

    def reset(self) -> np.ndarray:
        # Seed only the first reset: later restarts continue the env's own random stream.
        observations, _ = self.env.reset(seed=self.seed)
        self.seed, self.length = None, 0
        self.returns, self.ever_present = np.zeros(self.num_agents), np.zeros(self.num_agents, bool)
        return self.observe(observations)

    def observe(self, observations: dict) -> np.ndarray:  # marks the agents in the env present
        self.present = np.array([agent in self.env.agents for agent in self.agents])
        self.ever_present |= self.present
        return self.rows(observations, self.present)

    def rows(self, observations: dict, which) -> np.ndarray:  # [agents, width]: 0 unless which
        agent_id, central_value = self.spec.agent_id, self.spec.central_value
        state = np.asarray(self.env.state(), np.float32).ravel() if central_value else None
        rows = np.zeros((self.num_agents, self.spec.width), np.float32)
        for slot, agent in enumerate(self.agents):
            if which[slot]:
                row = np.concatenate([np.asarray(observations[agent], np.float32).ravel()]
                                     + [self.one_hot[slot]] * agent_id
                                     + [state, self.one_hot[slot]] * central_value)
                rows[slot, :len(row)] = row
        return rows

    def step(self, actions: np.ndarray):  # [agents, columns]: a slot's action (unused if absent)
        acting = {agent: int(actions[i, 0]) if self.discrete[i] else
                  actions[i, :self.env.action_space(agent).shape[0]]
                  for i, agent in enumerate(self.agents) if self.present[i]}
        observations, rewards, terminations, truncations, _ = self.env.step(acting)
        reward = np.array([rewards.get(agent, 0.0) for agent in self.agents], np.float32)
        terminated, truncated = (np.array([bool(flags.get(agent, False)) for agent in self.agents])
                                 for flags in (terminations, truncations))
        self.returns, self.length = self.returns + reward, self.length + 1
        info, ended = {}, terminated | truncated
        if ended.any():  # the last rows of the agents whose episode ended, marked by _final_obs
            info["_final_obs"], info["final_obs"] = ended, self.rows(observations, ended)
        if self.env.agents:
            return self.observe(observations), reward, terminated, truncated, info
        # All done: returns per agent (the mean) and per team (the sum), of all and of each group.
        team = lambda slots: self.returns[slots][self.ever_present[slots]]  # noqa: E731
        both = lambda slots: {"return": float(team(slots).mean()),  # noqa: E731
                              "team_return": float(team(slots).sum())}
        info["episode"] = {**both(slice(None)), "length": self.length,
                           "groups": {name: both(slots) for name, slots in self.groups.items()}}
        return self.reset(), reward, terminated, truncated, info


class StepResult(typing.NamedTuple):
    """What one step of all the envs gives the trainer besides the rows, by row."""

    rewards: np.ndarray  # [rows]
    terminated: np.ndarray  # [rows] bool: the agent's episode ended in the game
    truncated: np.ndarray  # [rows] bool: a time limit cut the agent's episode
    final_obs: dict  # row -> the last row of the agent whose episode ended there
    episodes: dict  # env index -> {"return", "team_return", "length"} of an episode that ended


class Worker:
    """Runs several Games in a child process, so that envs play on several cores. The trainer sends
    actions through a pipe; the child answers with rewards, flags and ended episodes. The rows, the
    one large array, skip the pipe: they go into shared memory (`obs_view`), read as a tensor."""

    def __init__(self, index: int, env_id: str, seeds: list, options: dict, obs_view: np.ndarray):
        self.index, self.env_id, self.obs_view = index, env_id, obs_view
        self.trainer_end, child_end = multiprocessing.Pipe()
        self.process = multiprocessing.get_context("fork").Process(
            target=self.child_loop, args=(child_end, seeds, options),
            name=f"{SCRIPT}-worker-{index}", daemon=True)
        self.process.start()
        child_end.close()
        self.present_array = self.receive()  # which agents are in their envs (once reset)

    @staticmethod
    def step_games(games: list, actions: np.ndarray, obs_out: np.ndarray) -> list:
        """Step each Game on its agents' rows of `actions`, its next rows into `obs_out`. For each:
        (rewards, terminated, truncated, present), a value per agent, and its info."""
        results = [game.step(part) for game, part in zip(games, np.split(actions, len(games)))]
        obs_out[:] = np.concatenate([obs for obs, *_ in results])
        return [(*result[1:4], game.present, result[4]) for game, result in zip(games, results)]

    def child_loop(self, conn, seeds: list, options: dict):  # in the child, until told to stop
        games = [Game(self.env_id, seed, **options) for seed in seeds]  # Game i: seeds[i]
        self.obs_view[:] = np.concatenate([game.reset() for game in games])
        conn.send(("ok", np.concatenate([game.present for game in games])))
        while (command := conn.recv())[0] == "step":
            conn.send(("ok", self.step_games(games, command[1], self.obs_view)))

    def step(self, actions: np.ndarray) -> StepResult:
        """step_games' answers, env by env, as one StepResult by row (env * num_agents + slot)."""
        self.send_step(actions)
        games = self.receive()
        rewards, terminated, truncated, self.present_array = (np.concatenate(part)
                                                              for part in list(zip(*games))[:4])
        agents = len(rewards) // len(games)
        final_obs = {env * agents + slot: info["final_obs"][slot] for env, (*_, info)
                     in enumerate(games) for slot in np.flatnonzero(info.get("_final_obs", ()))}
        episodes = {env: info["episode"] for env, (*_, info) in enumerate(games)
                    if "episode" in info}
        return StepResult(rewards, terminated, truncated, final_obs, episodes)

    def send_step(self, actions: np.ndarray):
        self.trainer_end.send(("step", actions))

    def receive(self):  # the child's answer to the last command (the rows are in obs_view by then)
        return self.trainer_end.recv()[1]

    def observations(self) -> torch.Tensor:  # the Games' current rows (shared memory)
        return torch.from_numpy(self.obs_view)

    def close(self):
        self.trainer_end.send(("close", None))
        self.process.join()


def layer(in_size: int, out_size: int, gain: float = math.sqrt(2)) -> nn.Linear:
    """A linear layer: orthogonal weights of the given gain, zero biases (37 details, #2: sqrt(2)
    in hidden layers; 0.01 at the policy output, all actions starting equally likely; 1 at V)."""
    linear = nn.Linear(in_size, out_size)
    nn.init.orthogonal_(linear.weight, gain)
    nn.init.zeros_(linear.bias)
    return linear


class RunningMeanStd(nn.Module):
    """Running mean and variance of a group's value targets, for value normalisation (`Model`):
    buffers (saved with the weights, never moved by Adam), merged once per rollout by Chan et al.'s
    (1979) parallel formula, exact for any split: with delta = mean_b - mean_a, n = n_a + n_b,
        mean = mean_a + delta n_b / n,   var = (var_a n_a + var_b n_b + delta^2 n_a n_b / n) / n"""

    def __init__(self):
        super().__init__()
        self.register_buffer("mean", torch.zeros(()))
        self.register_buffer("var", torch.ones((), dtype=torch.float64))
        self.register_buffer("count", torch.zeros((), dtype=torch.float64))

    def std(self) -> torch.Tensor:  # float32, at least 1e-3 (a constant target: V stays finite)
        return self.var.sqrt().float()

    @torch.no_grad()
    def update(self, batch: torch.Tensor, pooled=lambda moments: moments):
        """Merge a batch in (`pooled`: torchrun's hook, the moments' mean over the ranks)."""
        batch = batch.double()
        count, total, squares = pooled(
            [float(batch.numel()), batch.sum().item(), (batch ** 2).sum().item()])
        mean, seen, seen_mean = total / max(count, 1.0), self.count.item(), self.mean.item()
        var = max(squares / max(count, 1.0) - mean ** 2, 0.0)
        if seen + count > 0:
            merged, delta = seen + count, mean - seen_mean
            spread = self.var.item() * seen + var * count + delta ** 2 * seen * count / merged
            std = float(np.float32(max(math.sqrt(spread / merged), 1e-3)))  # V's scale, in float32
            self.mean.fill_(seen_mean + delta * count / merged)
            self.var.fill_(std * std)  # its square, exact in float64: std() gives it back
            self.count.fill_(merged)


class Model(nn.Module):
    """The actor-critic of one group, shared by its agents: separate policy and value MLPs, 64-64
    tanh (37 details, #13). The policy reads a row's first `policy_size` columns (`Game`), what its
    agent sees alone; the critic the next `value_size` with --central-value (MAPPO paper, section 4:
    the global state and whose value it is), else the policy's columns. Value normalisation (MAPPO,
    suggestion 1): V in units of the running mean and std of the group's value targets
    (`return_stats`, merged in `learn`). Discrete actions: a softmax. Box actions (`continuous`),
    as in ppo_continuous.py: a Gaussian around the actor's output whose log std (one per dimension,
    from 0) depends on no state; the dimensions are independent: their log-probabilities sum."""

    def __init__(self, policy_size, value_size, num_actions, central_value, hidden_size=64,
                 continuous=False):
        super().__init__()
        self.policy_size, self.value_size = policy_size, value_size
        self.central_value, self.continuous = central_value, continuous
        mlp = lambda inputs, outputs, gain: nn.Sequential(  # noqa: E731
            layer(inputs, hidden_size), nn.Tanh(), layer(hidden_size, hidden_size), nn.Tanh(),
            layer(hidden_size, outputs, gain))
        self.critic, self.actor = mlp(value_size, 1, 1.0), mlp(policy_size, num_actions, 0.01)
        if continuous:
            self.log_std = nn.Parameter(torch.zeros(1, num_actions))
        self.return_stats = RunningMeanStd()

    def value(self, rows: torch.Tensor) -> torch.Tensor:
        start = self.policy_size if self.central_value else 0
        values = self.critic(rows[:, start:start + self.value_size]).squeeze(-1)
        return values * self.return_stats.std() + self.return_stats.mean

    def act(self, rows: torch.Tensor, greedy: bool = False):  # actions, log-probabilities, values
        output = self.actor(rows[:, :self.policy_size])
        if self.continuous:  # the sampled action, unbounded: the trainer clips what the env gets
            actions = output if greedy else output + self.log_std.exp() * torch.randn_like(output)
        else:
            log_probs = torch.log_softmax(output, dim=-1)  # of each action: [batch, actions]
            actions = (log_probs.argmax(-1) if greedy
                       else torch.multinomial(log_probs.exp(), 1)[:, 0])
        return actions, self.log_prob_and_entropy(output, actions)[0], self.value(rows)

    def evaluate_actions(self, rows: torch.Tensor, actions: torch.Tensor):  # for the loss
        output = self.actor(rows[:, :self.policy_size])
        return (*self.log_prob_and_entropy(output, actions), self.value(rows))

    def log_prob_and_entropy(self, output: torch.Tensor, actions: torch.Tensor):
        """log pi(a|s) of the actions taken, and the policy's entropy, from the actor's output.
        Box: $\\sum_i -(a_i - \\mu_i)^2 / (2\\sigma_i^2) - \\log\\sigma_i - \\tfrac12 \\log 2\\pi$
        and, the same in every state, $H = \\sum_i \\log(2\\pi e \\sigma_i^2) / 2$."""
        if self.continuous:
            log_std = self.log_std.expand_as(output)
            squared = ((actions - output) / log_std.exp()) ** 2
            log_prob = (-0.5 * squared - log_std - 0.5 * math.log(2 * math.pi)).sum(-1)
            entropy = (0.5 + 0.5 * math.log(2 * math.pi) + self.log_std).sum(-1).expand(len(output))
            return log_prob, entropy
        log_probs = torch.log_softmax(output, dim=-1)
        log_prob = log_probs.gather(-1, actions.unsqueeze(-1)).squeeze(-1)  # of those taken
        return log_prob, -(log_probs.exp() * log_probs).sum(-1)


def compute_gae(rewards, values, dones, last_value, gamma: float, gae_lambda: float):
    """Generalized Advantage Estimation (Schulman et al., 2016; PPO paper, eq. 11-12): advantages
    [T, N] from rewards, values, dones [T, N] (time, row: an agent of an env) and last_value [N],
    the value after the last step. The value targets are advantages + values.

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
    = 1 when the agent's episode ended at step t, after action t (terminated or truncated; a
    truncation's rewards[t] already holds gamma * V(final row)), or the agent was absent: it cuts
    the sum there. CleanRL's `dones[t]` means "obs[t] starts a new episode", one step later."""
    advantages, next_value = torch.zeros_like(rewards), last_value
    next_advantage = torch.zeros_like(last_value)
    for t in reversed(range(rewards.shape[0])):
        not_done = 1.0 - dones[t]
        delta = rewards[t] + gamma * next_value * not_done - values[t]
        next_advantage = delta + gamma * gae_lambda * not_done * next_advantage
        advantages[t] = next_advantage
        next_value = values[t]
    return advantages


class Minibatch(typing.NamedTuple):
    """A shuffled slice of a group's rollout, a row per agent step: what the Trainer learns from."""

    obs: torch.Tensor  # [batch, row size], the rows the networks read
    actions: torch.Tensor  # [batch] (Discrete: the index) or [batch, dims] (Box: as sampled)
    old_log_probs: torch.Tensor  # their log-probabilities then
    advantages: torch.Tensor  # from GAE
    returns: torch.Tensor  # the value targets: advantages + old values
    old_values: torch.Tensor  # the values then
    mask: torch.Tensor  # 1 where an agent was present and acted, 0 for an absent agent's row


class Rollout:
    """One group's rollout buffer, [num_steps, rows] (a row per agent of the group in each env), on
    the device. `rows` says where those are among all the envs' rows (agent slot s of env e: row
    e * num_agents + s); `members` holds the same, as a set."""

    def __init__(self, config: Config, group, num_agents: int, device: torch.device):
        self.rows = torch.tensor([env * num_agents + slot for env in range(config.num_envs)
                                  for slot in group.slots], device=device)
        self.members = set(self.rows.tolist())
        self.row_size, shape = group.row_size, (config.num_steps, len(self.rows))
        self.bounds = (torch.tensor(group.low, device=device),  # of a Box action
                       torch.tensor(group.high, device=device)) if group.continuous else None
        self.obs = torch.zeros(shape + (group.row_size,), device=device)
        self.actions = (torch.zeros(shape + (group.num_actions,), device=device) if group.continuous
                        else torch.zeros(shape, dtype=torch.long, device=device))
        # The actions' log-probabilities and values then; mask: 1 where the agent is present.
        self.log_probs, self.values, self.rewards, self.dones, self.mask = (
            torch.zeros(shape, device=device) for _ in range(5))

    def minibatch(self, indices, advantages, returns) -> Minibatch:  # index: step * rows + row
        rows = lambda tensor: tensor.flatten(0, 1)[indices]  # noqa: E731
        return Minibatch(rows(self.obs), rows(self.actions), rows(self.log_probs), rows(advantages),
                         rows(returns), rows(self.values), rows(self.mask))


class Trainer:
    """One PPO step on a minibatch of every group: clipped surrogate, value loss, entropy bonus,
    gradient clip. `models`: each group's Model, by group name."""

    def __init__(self, models: nn.ModuleDict, config: Config, optimizer: type = torch.optim.Adam):
        self.models, self.config = models, config
        # Adam with eps 1e-5, not 1e-8 (37 details, #3).
        self.optimizer = optimizer(models.parameters(), lr=config.learning_rate, eps=1e-5)
        self.average_gradients = lambda parameters: None  # torchrun's hook (see gradient_step)

    @staticmethod
    def ppo_loss(minibatch: Minibatch, new_log_probs, entropy, new_values, config, value_scale):
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
        pulling. Why the minimum: a pessimistic bound, so that a move that made things worse
        (rho_t < 1 - eps with A_t > 0) is never hidden: the unclipped term is then the smaller
        one, and its gradient pulls back."""
        mask = minibatch.mask
        mean = lambda values: (values * mask).sum() / mask.sum().clamp(min=1)  # noqa: E731
        # Every mean is over the present agents' rows; torch.where, not a product, keeps an absent
        # agent's numbers out, even as 0 * inf. Advantage normalisation (37 details, #7):
        advantages = torch.where(mask > 0, minibatch.advantages, 0.0)
        centred = advantages - mean(advantages)
        std = (mean(centred ** 2) * mask.sum() / (mask.sum() - 1).clamp(min=1)).sqrt()
        advantages = torch.where(mask > 0, centred / (std + 1e-8), 0.0)
        # L_clip, negated: the max of the negated terms is the min above (37 details, #8).
        log_ratio = torch.where(mask > 0, new_log_probs - minibatch.old_log_probs, 0.0)
        ratio = log_ratio.exp()  # rho_t
        clipped_ratio = ratio.clamp(1 - config.clip_coef, 1 + config.clip_coef)
        policy_loss = mean(torch.max(-advantages * ratio, -advantages * clipped_ratio))
        # Value loss (37 details, #9) in units of the targets' std (value_scale: see Model).
        scaled = lambda x: torch.where(mask > 0, x, 0.0) / value_scale  # noqa: E731
        returns, old, new = map(scaled, (minibatch.returns, minibatch.old_values, new_values))
        value_error = (new - returns) ** 2
        if config.clip_value_loss:  # the new value moves at most clip_coef from the old one
            clipped = old + (new - old).clamp(-config.clip_coef, config.clip_coef)
            value_error = torch.max(value_error, (clipped - returns) ** 2)
        value_loss = 0.5 * mean(value_error)
        # Entropy bonus (37 details, #10): rewards a spread-out policy, which keeps exploring.
        entropy_mean = mean(entropy)
        loss = policy_loss - config.ent_coef * entropy_mean + config.vf_coef * value_loss
        # Diagnostics (37 details, #12): approx KL by (rho_t - 1) - log rho_t (Schulman,
        # "Approximating KL divergence", 2020), and the share of samples the clip touched.
        with torch.no_grad():
            stats = {"policy_loss": policy_loss, "value_loss": value_loss, "entropy": entropy_mean,
                     "approx_kl": mean((ratio - 1) - log_ratio),
                     "clip_fraction": mean(((ratio - 1).abs() > config.clip_coef).float())}
        return loss, stats

    def compute_loss(self, minibatches: dict):  # under the current weights (--compile's part)
        """Each group's loss from its own rows and network, summed. A group's weights get only its
        own loss's gradient (the others' do not depend on them): one backward pass and one Adam
        step update every group as separate PPO updates would. The diagnostics: groups' means."""
        results = []  # each group's (loss, diagnostics)
        for name, minibatch in minibatches.items():
            model = self.models[name]  # ppo_loss gets its log pi(a|s), entropy, V and V's scale
            results.append(self.ppo_loss(minibatch, *model.evaluate_actions(
                minibatch.obs, minibatch.actions), self.config, model.return_stats.std()))
        losses, stats = zip(*results)
        return torch.stack(losses).sum(), {key: torch.stack([group[key] for group in stats]).mean()
                                           for key in stats[0]}

    def gradient_step(self, minibatches: dict) -> dict:
        """Loss, backward, the ranks' mean gradient (torchrun), norm clip, Adam: the diagnostics."""
        loss, stats = self.compute_loss(minibatches)
        self.optimizer.zero_grad()
        loss.backward()
        self.average_gradients(self.models.parameters())  # hook: under torchrun, the ranks' mean
        # Gradient clipping (37 details, #11), by each group's norm: a rare huge step cannot undo
        # a policy, and one group's gradients never shrink another's step.
        stats["grad_norm"] = torch.stack([
            nn.utils.clip_grad_norm_(model.parameters(), self.config.max_grad_norm)
            for model in self.models.values()]).mean()
        self.optimizer.step()
        return stats


class Run:
    """The plain run `Main.train` talks to: seeds, device, the env's groups and sizes, the games,
    progress, summary. `RunGuard`, below the banner, extends it: Ctrl-C, checkpoints, NaN guard,
    torchrun, logging, --env-kwargs and --groups, Workers made safe."""

    def __init__(self, main: "Main"):
        self.main, self.config, self.games, self.summary = main, main.config, None, None
        self.returns, self.judged = deque(maxlen=100), deque(maxlen=100)  # all's; the target's
        self.updates, self.solved_step = 0, None  # solved_step: where the target was reached

    def __enter__(self) -> "Run":
        """The env's groups (one per kind of agent), their Models' sizes; seed torch; the device."""
        config, self.start_time = self.config, time.perf_counter()
        if config.env_kwargs or config.groups:
            raise ValueError("the whole file's machinery applies --env-kwargs and --groups")
        env = pkgutil.resolve_name(config.env).parallel_env()
        env.reset(seed=0)
        self.spec = describe_env(env, config, {})
        env.close()
        torch.manual_seed(config.seed)
        cuda = config.device != "cpu" and torch.cuda.is_available()
        self.device = torch.device("cuda" if cuda else "cpu")
        self.steps_per_step = config.num_envs * self.spec.num_agents  # agent steps per env step
        return self

    prepare_learner = lambda self: 0  # the step to start from (RunGuard's: --resume's)
    stop_at_once = lambda self: False  # end the rollout now (RunGuard's: after Ctrl-C)
    mean = lambda self, value: value  # its mean over the ranks (RunGuard's: under torchrun)
    optimizer = torch.optim.Adam  # the Trainer's (RunGuard's: a copy, the same steps, 2 s sooner)

    def start_games(self) -> Worker:
        """All the envs in one Worker, env i seeded with seed + i (RunGuard's: --num-workers)."""
        config, spec = self.config, self.spec
        obs = torch.zeros(config.num_envs * spec.num_agents, spec.width)  # by env, then slot
        seeds = [config.seed + i for i in range(config.num_envs)]
        self.games = Worker(0, config.env, seeds, {"spec": spec}, obs.share_memory_().numpy())
        return self.games

    def after_rollout(self, ended: list):
        """Record the (global step, episode) of the episodes that ended; note the target's step."""
        target, group = self.config.target_return, self.config.target_group
        for step, episode in ended:
            self.returns.append(episode["return"])
            self.judged.append(episode["groups"][group]["return"] if group else episode["return"])
            if (target is not None and self.solved_step is None and len(self.judged) == 100
                    and np.mean(self.judged) >= target):
                self.solved_step = step

    def after_update(self, stats: dict):
        """A progress line: the step, the speed, the mean return per agent of the last 100."""
        self.updates, step = self.updates + 1, self.main.global_step
        speed, mean = step / (time.perf_counter() - self.start_time), np.mean(self.returns or [0])
        print(f"step {step:,} | {speed:,.0f} steps/s | return per agent {mean:.2f} | updates "
              f"{self.updates}")

    def __exit__(self, kind, error, traceback):
        """Close the games and keep the summary; an error goes on up."""
        if self.games is not None:
            self.games.close()
        self.summary = {"script": SCRIPT, "env": self.config.env,
                        "steps": getattr(self.main, "global_step", 0),
                        "mean_return_100": float(np.mean(self.returns)) if self.returns else None,
                        "solved_step": self.solved_step}

    @staticmethod
    def evaluate(config: Config) -> dict:  # --eval: the machinery's (below the banner)
        raise NotImplementedError("--eval plays a checkpoint: the machinery below the banner")


class Main:
    """The loop (37 details, #6): `Main(config).run()` trains (or --eval plays); the summary."""

    def __init__(self, config: Config):  # anneal_from: (step, rate) where annealing starts
        self.config, self.guard, self.anneal_from = config, None, (0, config.learning_rate)

    def run(self) -> dict:
        # The one lookup of the machinery: RunGuard extends Run; cut at the banner, Run runs alone.
        run_class = globals().get("RunGuard", Run)
        return run_class.evaluate(self.config) if self.config.eval else self.train(run_class)

    def train(self, run_class: type) -> dict:
        self.guard = run_class(self)  # seeds, the games, the progress line, the summary
        with self.guard as guard:
            config, groups = self.config, guard.spec.groups  # (the checkpoint's, when resuming)
            self.models = nn.ModuleDict({  # a network per group, sized to its agents' spaces
                group.name: Model(group.policy_size, group.value_size, group.num_actions,
                                  config.central_value, config.hidden_size, group.continuous)
                for group in groups}).to(guard.device)
            self.trainer = Trainer(self.models, config, guard.optimizer)
            self.global_step = guard.prepare_learner()  # 0, or --resume's; compile, sync ranks
            self.games = guard.start_games()  # Workers; rows through shared memory
            self.rollouts = {group.name: Rollout(config, group, guard.spec.num_agents,
                                                 guard.device) for group in groups}
            next_obs = self.games.observations().to(guard.device)
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
        """Linear learning-rate annealing (37 details, #4), from `anneal_from` to 0 at the end."""
        start_step, start_rate = self.anneal_from
        progress = (self.global_step - start_step) / (self.config.total_timesteps - start_step)
        rate = start_rate * max(0.0, 1.0 - progress) if self.config.anneal_lr else start_rate
        for group in self.trainer.optimizer.param_groups:
            group["lr"] = rate

    @torch.inference_mode()  # like no_grad, and skips autograd's version counting too: faster
    def collect_rollout(self, next_obs: torch.Tensor) -> torch.Tensor:
        """Play num_steps steps of every env into the groups' rollouts; returns the next rows."""
        config, device, ended = self.config, self.guard.device, []
        for step in range(config.num_steps):
            if self.guard.stop_at_once():  # Ctrl-C (see RunGuard)
                break
            present = torch.from_numpy(self.games.present_array).float().to(device)  # 1 or 0
            # What the envs get: a row per agent (a Discrete action's index, a Box action's numbers)
            env_actions = torch.zeros(len(next_obs), self.guard.spec.action_columns, device=device)
            for name, rollout in self.rollouts.items():  # each group plays its own agents
                rows, model = next_obs[rollout.rows, :rollout.row_size], self.models[name]
                rollout.obs[step], rollout.mask[step] = rows, present[rollout.rows]
                actions, rollout.log_probs[step], rollout.values[step] = model.act(rows)
                rollout.actions[step] = actions  # Box: as sampled; the env gets it clipped
                sent = actions.clamp(*rollout.bounds) if rollout.bounds else actions[:, None]
                env_actions[rollout.rows, :sent.shape[1]] = sent.to(env_actions.dtype)
            result = self.games.step(env_actions.cpu().numpy())
            next_obs = self.games.observations().to(device)
            rewards = torch.from_numpy(result.rewards).to(device)
            ends = torch.from_numpy(result.terminated | result.truncated).to(device).float()
            # Truncation is not death: an episode cut by a time limit (as MPE2's are, after 25
            # steps) would have gone on, so its last reward gets gamma * V(final row).
            cut = [row for row in result.final_obs
                   if result.truncated[row] and not result.terminated[row]]
            for name, rollout in self.rollouts.items():
                if mine := [row for row in cut if row in rollout.members]:
                    final_rows = torch.from_numpy(np.stack([result.final_obs[row] for row in mine]))
                    value = self.models[name].value(final_rows[:, :rollout.row_size].to(device))
                    rewards[mine] += config.gamma * value
                rollout.rewards[step] = rewards[rollout.rows]
                # An absent agent's row is done too, so that GAE never links steps across it.
                rollout.dones[step] = torch.maximum(ends[rollout.rows], 1 - rollout.mask[step])
            self.global_step += self.guard.steps_per_step  # agent rows of every rank
            ended += [(self.global_step, episode) for episode in result.episodes.values()]
        self.guard.after_rollout(ended)  # record the episodes (RunGuard's: stop on Ctrl-C)
        return next_obs

    @torch.no_grad()
    def estimate_advantages(self, next_obs: torch.Tensor):  # GAE by group: {name: [steps, rows]}
        advantages, returns = {}, {}
        for name, rollout in self.rollouts.items():
            last_value = self.models[name].value(next_obs[rollout.rows, :rollout.row_size])
            advantages[name] = compute_gae(rollout.rewards, rollout.values, rollout.dones,
                                           last_value, self.config.gamma, self.config.gae_lambda)
            returns[name] = advantages[name] + rollout.values
        return advantages, returns

    def learn(self, advantages: dict, returns: dict) -> dict:
        """update_epochs passes over the rollouts in shuffled minibatches; the mean diagnostics.
        Each group's rows are shuffled apart, so every minibatch holds its share of each group."""
        config, steps, device = self.config, [], self.guard.device
        for name, rollout in self.rollouts.items():  # value normalisation (Model), present rows
            self.models[name].return_stats.update(returns[name][rollout.mask > 0], self.guard.mean)
        for epoch in range(config.update_epochs):
            parts = {name: torch.randperm(returns[name].numel(), device=device).tensor_split(
                config.num_minibatches) for name in self.rollouts}  # a group's rows, shuffled
            for k in range(config.num_minibatches):
                minibatches = {name: rollout.minibatch(parts[name][k], advantages[name],
                                                       returns[name])
                               for name, rollout in self.rollouts.items()}
                steps.append(self.trainer.gradient_step(minibatches))  # diagnostics, as tensors
            # Early stop (37 details, #12, optional): by the ranks' mean, so that all stop together.
            if (config.target_kl is not None
                    and self.guard.mean(steps[-1]["approx_kl"].item()) > config.target_kl):
                break
        stats = {key: torch.stack([step[key].detach() for step in steps]).mean().item()
                 for key in steps[0]}  # the update's one host sync (--target-kl: one an epoch)
        # Explained variance: 1 when V predicts the present agents' returns, 0 if not (or constant).
        values, targets = (torch.cat(part) for part in zip(*(
            (rollout.values[rollout.mask > 0], returns[name][rollout.mask > 0])
            for name, rollout in self.rollouts.items())))
        variance = targets.var().item() if len(targets) > 1 else 0.0
        stats["explained_variance"] = variance and 1 - (targets - values).var().item() / variance
        return stats


# ==== Below: speed, safety and scale. PPO is complete above. ======================================
#
# A reader of PPO may stop here. What follows makes the lesson fast, safe and scalable, section by
# section: `RunGuard` and `RunLog` extend the lesson's plain `Run` (Ctrl-C, failures, logging).

import ast
import copy
import datetime
import gc
import hashlib
import importlib
import inspect
import json
import logging
import multiprocessing.connection
import random
import signal
import sys
import threading
from pathlib import Path

import gymnasium as gym
import torch.distributed as dist  # already loaded by `import torch`: costs nothing more

# ----- Engines: the games, fast and guarded; the learner compiled; Adam written out ---------------


class GuardedWorker(Worker):
    """A Worker made safe for long runs. The child ignores SIGINT (a terminal's Ctrl-C reaches the
    whole group: the trainer decides how to stop), reports its Games' errors in one line, and closes
    its copies of the trainer's pipe ends, so that it exits once the trainer is gone. The trainer
    waits on the pipe and the process at once: a child that dies is a WorkerError, not a hang."""

    def __init__(self, index: int, env_id: str, seeds: list, options: dict,
                 obs_view: np.ndarray, inherited_trainer_ends: list):
        self.inherited_trainer_ends = inherited_trainer_ends
        super().__init__(index, env_id, seeds, options, obs_view)

    def child_loop(self, conn, seeds: list, options: dict):
        gc.freeze()  # the trainer's objects (its garbage too) are not the child's to finalize
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        for end in [self.trainer_end, *self.inherited_trainer_ends]:  # earlier Workers' too
            end.close()
        try:
            super().child_loop(conn, seeds, options)
        except Exception as error:  # (the trainer gone, EOFError: the send fails, and it exits)
            with contextlib.suppress(OSError):
                conn.send(("error", f"{type(error).__name__}: {error}"))
        finally:
            os._exit(0)  # skip the inherited atexit handlers (they belong to the trainer)

    def send_step(self, actions: np.ndarray):
        with contextlib.suppress(OSError):  # a child that is gone: receive() says how
            super().send_step(actions)

    def receive(self, timeout: float = 120.0):
        name = f"worker {self.index} ({self.env_id})"
        ready = multiprocessing.connection.wait([self.trainer_end, self.process.sentinel], timeout)
        if not ready:
            raise WorkerError(f"{name} did not answer within {timeout:.0f} s")
        if self.trainer_end in ready:
            with contextlib.suppress(EOFError, OSError):  # a closed pipe: the child is dead
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

    def __init__(self, index: int, env_id: str, seeds: list, options: dict,
                 obs_view: np.ndarray, inherited_trainer_ends: list):
        self.index, self.env_id, self.obs_view, self.trainer_end = index, env_id, obs_view, None
        self.games = [Game(env_id, seed, **options) for seed in seeds]
        self.obs_view[:] = np.concatenate([game.reset() for game in self.games])
        self.present_array = np.concatenate([game.present for game in self.games])

    def send_step(self, actions: np.ndarray):
        self.actions = actions

    def receive(self) -> list:
        return self.step_games(self.games, self.actions, self.obs_view)

    def close(self):
        for game in self.games:
            game.env.close()


class WorkerPool(Worker):
    """All the envs of this rank, as one Worker of num_envs Games (Game i seeded with first_seed +
    i): max(num_workers, 1) GuardedWorkers (one InProcessWorker with --num-workers 0), their rows
    in one array in shared memory; a failure to start one closes those started so far."""

    def __init__(self, config: Config, spec: EnvSpec, first_seed: int):
        self.workers, count = [], max(config.num_workers, 1)
        self.obs_view = torch.zeros(config.num_envs * spec.num_agents,
                                    spec.width).share_memory_().numpy()  # by env, then slot
        options = {"spec": spec, "env_kwargs": parse_env_kwargs(config.env_kwargs)}
        worker_class = InProcessWorker if config.num_workers == 0 else GuardedWorker
        seeds = np.split(first_seed + np.arange(config.num_envs), count)
        try:
            for index, rows in enumerate(np.split(self.obs_view, count)):  # a Worker's view
                self.workers.append(worker_class(
                    index, config.env, seeds[index].tolist(), options, rows,
                    [worker.trainer_end for worker in self.workers if worker.trainer_end]))
        except BaseException:
            self.close()  # the workers started so far
            raise
        self.present_array = np.concatenate([worker.present_array for worker in self.workers])

    def send_step(self, actions: np.ndarray):  # all first, then `receive`: they play in parallel
        for worker, part in zip(self.workers, np.split(actions, len(self.workers))):
            worker.send_step(part)

    def receive(self) -> list:  # every Game's answer, env by env
        return [game for worker in self.workers for game in worker.receive()]

    def close(self):
        for worker in self.workers:
            worker.close()
        self.workers = []


def compile_learner(main: Main):
    """torch.compile the networks' forwards and the loss (its backward with it): seconds networks
    this small never earn back, hence off by default. Bound methods, not modules: the checkpoint's
    names stay. Compiled at once, on inputs of their sizes: if that fails, a warning, then eager."""
    logging.getLogger("torch.utils.cpp_extension").addFilter(not_the_cuda_home_warning)
    models, trainer, config, guard = main.models, main.trainer, main.config, main.guard
    networks = [network for model in models.values() for network in (model.actor, model.critic)]
    eager_forwards, eager_loss = [network.forward for network in networks], trainer.compute_loss
    try:
        for network, forward in zip(networks, eager_forwards):
            network.forward = torch.compile(forward)
        trainer.compute_loss = torch.compile(eager_loss)
        minibatches = {}
        for group in guard.spec.groups:  # a step of every env, and a minibatch, of each group
            rollout = Rollout(config, group, guard.spec.num_agents, guard.device)  # of zeros
            with torch.no_grad():
                models[group.name].act(rollout.obs[0])
            size = rollout.mask.numel() // config.num_minibatches
            minibatches[group.name] = rollout.minibatch(torch.arange(size, device=guard.device),
                                                        rollout.mask, rollout.mask)
        loss, _ = trainer.compute_loss(minibatches)
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
        self.main, self.stop_signal, self.signals, self.updates = main, None, None, 0
        self.previous_threads = torch.get_num_threads()
        self.ranks = self.games = self.log = self.summary = None

    config = property(lambda self: self.main.config)  # the run's (or the checkpoint's) settings
    solved_step = property(lambda self: self.log.solved_step)  # --target-return was reached
    optimizer = Adam if Run.optimizer is torch.optim.Adam else Run.optimizer  # torch's, faster
    evaluate = staticmethod(lambda config: evaluate_checkpoint(config))  # --eval (below)

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
        check_settings(self.config)
        self.checkpoint = load_checkpoint(self.config.resume) if self.config.resume else None
        config = resumed_config(self.checkpoint, self.config) if self.checkpoint else self.config
        self.spec = inspect_env(config)
        check_settings(config, self.spec)
        self.ranks = Ranks(pick_device(config.device))  # torchrun's ranks (alone, a world of one)
        self.device = self.ranks.device
        self.steps_per_step = config.num_envs * self.spec.num_agents * self.ranks.world_size
        # Rank 0 names and makes the run dir: the default name holds the time, which may differ.
        self.run_dir = self.ranks.from_rank_0(lambda: make_run_dir(config, self.checkpoint))
        self.main.config = config = dataclasses.replace(config, run_dir=str(self.run_dir))
        # The trainer draws (sampling, shuffling) from torch's generator; rank r's seeded seed + r.
        self.seed = config.seed + self.ranks.rank
        random.seed(self.seed)
        np.random.seed(self.seed)
        torch.manual_seed(self.seed)
        # One thread is fastest for networks this small (benchmarks/README.md); given back after.
        torch.set_num_threads(1)
        self.checkpoint_path = self.run_dir / "checkpoint.pt"
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
        self.ranks.copy_from_rank_0(main.models.state_dict().values())  # the same start everywhere
        if main.config.compile:
            compile_learner(main)
        self.last_good_learner = copy.deepcopy(learner_state(main))  # what a NaN falls back to
        self.last_checkpoint_step = main.global_step
        return main.global_step

    def start_games(self) -> WorkerPool:  # env i of rank r: seed + r * num_envs + i
        first_seed = self.config.seed + self.ranks.rank * self.config.num_envs
        self.games = WorkerPool(self.config, self.spec, first_seed)
        return self.games

    def stop_at_once(self) -> bool:  # under torchrun, all ranks stop together after the rollout
        return self.stop_signal is not None and not self.ranks.distributed

    def mean(self, value):  # over the ranks, of a number or of each of a list (alone: the value)
        return self.ranks.mean(value) if isinstance(value, list) else self.ranks.mean([value])[0]

    def after_rollout(self, ended: list):
        """Record the rollout's episodes; raise Interrupted if asked to stop. Under torchrun the
        ranks meet here: each learns every rank's episodes (by step, then rank) and signals."""
        shared = self.ranks.gather((ended, self.stop_signal))
        for step, episode in sorted((item for rank_ended, _ in shared for item in rank_ended),
                                    key=lambda step_and_episode: step_and_episode[0]):
            self.log.record_episode(episode, step)
        signals = [signum for _, signum in shared if signum is not None]
        if signals:
            self.stop_signal = signals[0]
            raise Interrupted

    def after_update(self, stats: dict):
        """The ranks' mean diagnostics: stop if one is not finite, else log, and save when due."""
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
                    self.ranks.check_same(self.main.models.state_dict().values())
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
    """What rank 0 tells: the start-up block, a progress line per update (one a second at most),
    TensorBoard, summary.json, a closing line. Counts span resumes; speeds, this process alone."""

    def __init__(self, guard: RunGuard, start_time: float):
        self.guard, self.main, self.start_time = guard, guard.main, start_time
        resumed = guard.checkpoint is not None
        saved = guard.checkpoint.get("log", {}) if resumed else {}
        self.resumed_at_step = int(guard.checkpoint["global_step"]) if resumed else None
        self.episodes, self.earlier_seconds = saved.get("episodes", 0), saved.get("seconds", 0.0)
        groups = saved.get("recent_group_returns", {})  # the last 100 of each, named as in `state`
        self.recent = {key: deque(saved.get(f"recent_{key}s", groups.get(key, [])), maxlen=100)
                       for key in ("return", "team_return", "length", *(
                           f"{group.name}/{kind}" for group in guard.spec.groups
                           for kind in ("return", "team_return")))}
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
        workers = config.num_workers  # what runs: the learner, the engine, the groups
        self.say("learner: the lesson's torch code (Model, Trainer, compute_gae)"
                 + (", torch.compile" if config.compile else ""))
        self.say(f"engine: the lesson's Game, {config.num_envs // workers} per Worker in {workers} "
                 f"child process{'es' * (workers > 1)}" if workers else
                 f"engine: the lesson's Game, {config.num_envs} in this process")
        for group in guard.spec.groups:
            self.say(f"group {group.name}: {', '.join(group.agents)}; actions {group.action_space}")
        if config.compile:
            self.say("compiling the model and the update (torch.compile, once per run; this can "
                     "take a minute)...")

    def record_episode(self, episode: dict, step: int):
        self.episodes += 1
        numbers = {**{key: episode[key] for key in ("return", "team_return", "length")},
                   **{f"{name}/{kind}": value for name, returns in episode["groups"].items()
                      for kind, value in returns.items()}}
        for key, value in numbers.items():  # charts/episodic_return, charts/<group>/team_return...
            self.recent[key].append(value)
            if self.writer is not None:
                group, slash, kind = key.rpartition("/")
                tag = f"episodic_{kind}" if kind in ("return", "length") else kind
                self.writer.add_scalar(f"charts/{group}{slash}{tag}", value, step)
        config = self.guard.config  # the target is all agents' return, or --target-group's
        judged = self.recent[f"{config.target_group}/return" if config.target_group else "return"]
        if (config.target_return is not None and self.solved_step is None and len(judged) == 100
                and np.mean(judged) >= config.target_return):
            self.solved_step, self.solved_seconds = step, self.seconds()

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
        mean = lambda key: f"{np.mean(self.recent[key]):.2f}" if self.recent[key] else "-"
        env_steps = step // self.guard.spec.num_agents
        groups = "".join(f"| {name} {mean(name + '/return')} "
                         for name in self.main.models if len(self.main.models) > 1)
        self.say(f"step {step:,}/{total:,} ({100 * step / total:.1f}%) | env steps {env_steps:,} | "
                 f"{speed:,.0f} steps/s | eta {eta} | return per agent {mean('return')} | team "
                 f"{mean('team_return')} {groups}| length {mean('length')} | updates "
                 f"{self.guard.updates}")

    def state(self) -> dict:
        """What the checkpoint keeps of the log, for a resumed run to count on."""
        recent = {key: list(values) for key, values in self.recent.items()}
        whole = {f"recent_{key}s": recent.pop(key) for key in ("return", "team_return", "length")}
        return {"episodes": self.episodes, "seconds": self.seconds(), **whole,
                "recent_group_returns": recent}

    def finish(self, interrupted: bool, failed: bool) -> dict:
        """Write summary.json, print the last progress line (once) and how the run ended."""
        guard, config, step = self.guard, self.guard.config, self.main.global_step
        summary, path = run_summary(self, interrupted), guard.run_dir / "summary.json"
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


def run_summary(log: RunLog, interrupted: bool) -> dict:
    """summary.json: the run's counts and results; each group's returns under "groups"."""
    guard, config, step = log.guard, log.guard.config, log.main.global_step
    speed = log.steady_speed()
    mean = lambda values: float(np.mean(values)) if values else None  # noqa: E731
    return {
        "script": SCRIPT, "env": config.env, "seed": config.seed, "steps": step,
        "seconds": round(log.seconds(), 3),
        "warmup_seconds": (round(log.first_update_end[0] - log.start_time, 3)
                           if log.first_update_end else None),
        "steps_per_second": round(speed, 1) if speed else None, "episodes": log.episodes,
        "mean_return_100": mean(log.recent["return"]),
        "mean_team_return_100": mean(log.recent["team_return"]),
        "env_steps": step // guard.spec.num_agents, "num_agents": guard.spec.num_agents,
        "target_return": config.target_return, "solved_step": log.solved_step,
        "solved_seconds": (round(log.solved_seconds, 3) if log.solved_seconds is not None
                           else None), "interrupted": interrupted,
        "checkpoint": str(guard.checkpoint_path) if guard.checkpoint_path.exists() else None,
        "world_size": guard.ranks.world_size, "resumed_at_step": log.resumed_at_step,
        "target_group": config.target_group or None,
        "groups": {group.name: {"agents": group.agents,
                                **{f"mean_{kind}_100": mean(log.recent[f"{group.name}/{kind}"])
                                   for kind in ("return", "team_return")}}
                   for group in guard.spec.groups}}

# ----- Checkpoints, evaluation and video ----------------------------------------------------------


def learner_state(main: Main) -> dict:
    """Everything needed to continue learning: only tensors, numbers, strings, lists and dicts, so
    that torch.load(..., weights_only=True) can read it back (a checkpoint cannot run code)."""
    guard = main.guard
    return {"script": SCRIPT, "env": main.config.env, "env_kwargs": main.config.env_kwargs,
            # Each group's [agents, observation size, actions (choices or dimensions), state size].
            "spec": {group.name: [len(group.slots), group.obs_size, group.num_actions,
                                  guard.spec.state_size] for group in guard.spec.groups},
            "groups": {group.name: {"agents": group.agents, "action_space": group.action_space}
                       for group in guard.spec.groups},
            "config": dataclasses.asdict(main.config),
            "model": main.models.state_dict(), "optimizer": main.trainer.optimizer.state_dict(),
            "global_step": main.global_step, "updates": guard.updates,
            "anneal_from": list(main.anneal_from), "log": guard.log.state(),
            "rng": {"torch": torch.get_rng_state()}}


def load_weights(models: nn.ModuleDict, weights: dict, config: Config):
    """A checkpoint's weights into the networks (that they must fit), by today's names: one shared
    network's, without a group's name (before policy groups), are the one group's; return_mean,
    return_std and return_count (before RunningMeanStd) are return_stats' mean, sqrt(var), count."""
    names = list(models)
    if len(names) == 1 and "actor.0.weight" in weights:
        weights = {f"{names[0]}.{key}": value for key, value in weights.items()}
    renamed = {}
    for key, value in weights.items():
        group, _, name = key.rpartition(".")
        if name == "return_std":
            key, value = f"{group}.return_stats.var", value.double() ** 2
        elif name in ("return_mean", "return_count"):
            key = f"{group}.return_stats.{name.removeprefix('return_')}"
        renamed[key] = value
    try:
        models.load_state_dict(renamed)
    except RuntimeError as error:
        raise UsageError(f"the checkpoint's networks do not fit {config.env} with hidden size "
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
    load_weights(main.models, state["model"], main.config)
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
    """The settings of a resumed (or evaluated) run: the checkpoint's, except those given now
    differently from their defaults (e.g. a new --total-timesteps); the run dir is the
    checkpoint's folder unless given. A different env or network is refused."""
    fields = dataclasses.fields(Config)
    saved = {f.name: checkpoint["config"][f.name] for f in fields if f.name in checkpoint["config"]}
    saved["run_dir"] = str(Path(checkpoint["path"]).parent)
    typed = getattr(given, "typed", None)  # the command line's flags (None: Config(...) in code)
    changed = {f.name: getattr(given, f.name) for f in fields
               if (f.name in typed if typed is not None else getattr(given, f.name) != f.default)}
    for name in ("env", "env_kwargs", "groups", "hidden_size", "agent_id", "central_value"):
        if name in changed and changed[name] != saved.get(name):
            raise UsageError(f"the checkpoint was trained with --{name.replace('_', '-')} "
                             f"{saved.get(name)}, not {changed[name]}")
    return Config(**{**saved, **changed})


@torch.no_grad()
def evaluate_checkpoint(given: Config) -> dict:
    """--eval: play --eval-episodes episodes with a checkpoint's policies (each group's agents
    playing their group's) and report the return per agent and per team, of all and each group."""
    check_settings(given)
    checkpoint = load_checkpoint(given.eval)
    config = resumed_config(checkpoint, given)
    env_kwargs, spec = parse_env_kwargs(config.env_kwargs), inspect_env(config)
    models = nn.ModuleDict({group.name: Model(
        group.policy_size, group.value_size, group.num_actions, config.central_value,
        config.hidden_size, group.continuous) for group in spec.groups})
    load_weights(models, checkpoint["model"], config)
    torch.manual_seed(config.seed)
    try:
        drawn = {"render_mode": "rgb_array"} if config.video else {}  # (only when asked for)
        game = Game(config.env, config.seed, spec, {**env_kwargs, **drawn})
    except Exception as error:
        raise UsageError(f"cannot make {config.env} for --video: {type(error).__name__}: "
                         f"{error}") from None
    video, path, rows, episodes = None, Path(config.run_dir) / "eval.mp4", game.reset(), []
    try:
        while len(episodes) < config.eval_episodes:
            if config.video:
                video = write_frame(video, game, path)
            actions = np.zeros((spec.num_agents, spec.action_columns), np.float32)
            for group in spec.groups:
                taken, _, _ = models[group.name].act(
                    torch.from_numpy(rows[group.slots, :group.row_size]), greedy=config.greedy)
                taken = (taken.clamp(torch.tensor(group.low), torch.tensor(group.high))
                         if group.continuous else taken[:, None])  # Box: clipped
                actions[group.slots, :taken.shape[1]] = taken.numpy()
            rows, _, _, _, info = game.step(actions)
            if "episode" in info:
                episodes.append(info["episode"])
    finally:
        game.env.close()
        if video is not None:
            video.release()
    def of(kind: str, group: Optional[str] = None) -> list:  # each episode's, or its group's
        return [(episode["groups"][group] if group else episode)[kind] for episode in episodes]

    stats = lambda values: (float(np.mean(values)), float(np.std(values)))  # noqa: E731
    (mean, std), (team_mean, team_std) = stats(of("return")), stats(of("team_return"))
    groups = {group.name: {f"{kind}_{part}": value for kind in ("return", "team_return")
                           for part, value in zip(("mean", "std"), stats(of(kind, group.name)))}
              for group in spec.groups}
    each = "".join(f"; {name} {values['return_mean']:.2f} ± {values['return_std']:.2f} per agent"
                   for name, values in groups.items() if len(groups) > 1)
    print(f"eval {config.env}: return per agent {mean:.2f} ± {std:.2f}, per team "
          f"{team_mean:.2f} ± {team_std:.2f}{each} over {len(episodes)} episode"
          f"{'s' * (len(episodes) != 1)} ({'greedy' if config.greedy else 'sampled'} actions)")
    if video is not None:
        print(f"video: {path}")
    return {"script": SCRIPT, "env": config.env, "episodes": len(episodes), "mean_return": mean,
            "std_return": std, "mean_team_return": team_mean, "std_team_return": team_std,
            "returns": of("return"), "team_returns": of("team_return"), "groups": groups,
            "greedy": config.greedy, "video": str(path) if video is not None else None}


def write_frame(video, game: Game, path: Path):
    """Append the env's picture to the mp4 (OpenCV's VideoWriter, opened at the first frame)."""
    import cv2  # only --video needs OpenCV

    # pygame (MPE2's drawing) needs neither SDL's display nor its sound, absent on a server.
    os.environ.setdefault("SDL_VIDEODRIVER", "dummy")
    os.environ.setdefault("SDL_AUDIODRIVER", "dummy")
    frame = game.env.render()
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

# ----- Checking the input; the command line -------------------------------------------------------


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


def check_settings(config: Config, spec: Optional["EnvSpec"] = None):
    """Refuse in one line what cannot work: a number out of its range or not finite, flags that
    make no sense together; with the env's groups, a batch that does not split, a --target-group
    that is none of them, a rollout larger than the memory free."""
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
    names = [group.name for group in spec.groups] if spec else []
    if spec and config.target_group and config.target_group not in names:
        raise UsageError(f"--target-group {config.target_group}: {config.env}'s groups are "
                         f"{', '.join(names)}")
    for group in spec.groups if spec else ():
        agents = len(group.slots)
        batch_size = config.num_envs * agents * config.num_steps
        whose = f"group {group.name}'s batch of {batch_size} agent steps (--num-envs x {agents} "
        if batch_size % config.num_minibatches:
            raise UsageError(f"{whose}agents x --num-steps) does not split into "
                             f"--num-minibatches {config.num_minibatches}")
        if batch_size // config.num_minibatches < 2:
            raise UsageError(f"minibatches of {batch_size // config.num_minibatches} step cannot "
                             f"be normalised: raise --num-envs or --num-steps, or lower "
                             f"--num-minibatches")
    if spec is not None:  # Peak RSS on simple_spread (8, 64, 512 envs; 25, 4,000 steps): 2 MB an
        # env (MPE2 draws each on a 700 x 700 canvas), 510 bytes an agent step (a row of 75 floats).
        # The rollout: a row, an action and 7 numbers an agent step; an update makes a copy more.
        numbers = sum(len(group.slots) * (group.row_size + group.num_actions + 7)
                      for group in spec.groups)  # of an env step
        refuse_what_will_not_fit(config.num_envs * (2 ** 21 + 2 * 4 * config.num_steps * numbers),
                                 "the envs and their rollout")


def parse_groups(text: str) -> dict:
    """--groups "adversary=predators,agent=prey" -> {name prefix: group}."""
    prefixes = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        prefix, equals, group = (part.strip() for part in item.partition("="))
        if not equals or not prefix or not group.isidentifier() or prefix in prefixes:
            raise UsageError(f"--groups {text!r}: write name prefix=group pairs separated by "
                             f"commas, each prefix once, each group a name (letters, digits, _), "
                             f"e.g. adversary=predators,agent=prey")
        prefixes[prefix] = group
    return prefixes


def parse_env_kwargs(text: str, module=None) -> dict:
    """--env-kwargs "N=5,local_ratio=0.3" -> {"N": 5, "local_ratio": 0.3}: true, false and none (in
    any case) as True, False and None, numbers as numbers, else the text. Given the env's module, a
    value unlike its option's default (in raw_env's or parallel_env's signature) is refused: a bool
    takes true or false, an int a whole number, a float a number, a str any text."""
    takes = {bool: ((bool,), "true or false"), int: ((int,), "a whole number"),
             float: ((int, float), "a number")}
    pairs, defaults = {}, {}
    with contextlib.suppress(TypeError, ValueError):  # no module, or no signature to read
        maker = getattr(module, "raw_env", getattr(module, "parallel_env", None))
        options = inspect.signature(maker).parameters.values()
        defaults = {option.name: option.default for option in options
                    if option.default is not option.empty}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, equals, written = (part.strip() for part in item.partition("="))
        if not equals or not key.isidentifier():
            raise UsageError(f"--env-kwargs {text!r}: write name=value pairs separated by commas, "
                             f"e.g. N=5,local_ratio=0.3")
        value = {"true": True, "false": False, "none": None}.get(written.lower(), written)
        if value is written and not isinstance(defaults.get(key), str):
            with contextlib.suppress(ValueError, SyntaxError):
                literal = ast.literal_eval(written)  # 5, 0.3, 1e-3, 'quoted text'
                value = literal if type(literal) in (int, float, str) else written
        allowed, kind = takes.get(type(defaults.get(key)), ((type(value),), ""))
        if type(value) not in allowed:
            raise UsageError(f"--env-kwargs {key}={written}: {key} takes {kind}, like its "
                             f"default {defaults[key]!r}")
        pairs[key] = value
    return pairs


def counts_agents(module, env_kwargs: dict) -> bool:
    """Whether a whole number below 1 in env_kwargs counts the env's agents (at 2 the env has more
    than at 1): an env that cannot be made with it was left without agents."""
    below_one = {key: 1 for key, value in env_kwargs.items() if type(value) is int and value < 1}
    for key in below_one:
        with contextlib.suppress(Exception):
            made = [module.parallel_env(**{**env_kwargs, **below_one, key: count})
                    for count in (1, 2)]
            if len(made[1].possible_agents) > len(made[0].possible_agents):
                return True
    return False


def find_env_module(env_id: str):
    """The module (or object) `--env module.name` names, with PettingZoo's parallel_env()."""
    parent, _, name = env_id.rpartition(".")
    if not parent:
        raise UsageError(f"--env {env_id!r}: name a PettingZoo parallel env by module and name, "
                         f"e.g. mpe2.simple_spread_v3 (a gymnasium env: ppo_spaces.py)")
    try:
        module = importlib.import_module(env_id)
    except ModuleNotFoundError as error:
        missing = error.name or ""
        if missing != env_id and not env_id.startswith(missing + "."):
            raise UsageError(f"{env_id} needs the package {missing}: pip install it") from None
        module = None
        with contextlib.suppress(ModuleNotFoundError):
            module = getattr(importlib.import_module(parent), name, None)
        if module is None:
            raise UsageError(f"unknown env {env_id!r}: no such module (PettingZoo envs are named "
                             f"like mpe2.simple_spread_v3)") from None
    if not callable(getattr(module, "parallel_env", None)):
        raise UsageError(f"{env_id} has no parallel_env(): this script plays PettingZoo parallel "
                         f"envs")
    return module


def inspect_env(config: Config) -> EnvSpec:
    """The env's groups (`describe_env`), once it is made: each group's agents must observe alike
    (vectors) and act alike (Discrete or Box)."""
    env_id, module = config.env, find_env_module(config.env)
    env_kwargs, prefixes = parse_env_kwargs(config.env_kwargs, module), parse_groups(config.groups)
    options = f" with --env-kwargs {config.env_kwargs}" if env_kwargs else ""
    try:
        env = module.parallel_env(**env_kwargs)
        env.reset(seed=0)
    except Exception as error:
        if counts_agents(module, env_kwargs):
            raise UsageError(f"{env_id}{options} has no agents") from None
        raise UsageError(f"cannot make {env_id}{options}: {type(error).__name__}: "
                         f"{str(error).splitlines()[0] if str(error) else ''}") from None
    try:
        agents = list(env.possible_agents)
        if not agents:
            raise UsageError(f"{env_id}{options} has no agents")
        spaces = [(env.observation_space(agent), env.action_space(agent)) for agent in agents]
        try:
            groups = assign_groups(agents, [str(pair) for pair in spaces], prefixes)
        except ValueError as error:
            raise UsageError(f"{error}: {env_id}'s agents are {', '.join(agents)}") from None
        for prefix in prefixes:
            if not any(agent.startswith(prefix) for agent in agents):
                raise UsageError(f"--groups: no agent's name starts with {prefix!r} ({env_id}'s "
                                 f"agents are {', '.join(agents)})")
        for name, slots in groups.items():
            for slot in slots:
                if spaces[slot] != spaces[slots[0]]:
                    raise UsageError(
                        f"group {name} has agents of different kinds ({agents[slots[0]]}: "
                        f"{', '.join(map(str, spaces[slots[0]]))}; {agents[slot]}: "
                        f"{', '.join(map(str, spaces[slot]))}): one shared policy needs its "
                        f"agents to observe and act alike; put them in groups of their own")
            check_spaces(env_id, *spaces[slots[0]])
        if config.central_value:
            try:
                env.state()
            except Exception:
                raise UsageError(f"{env_id} gives no global state (state()), which "
                                 f"--central-value needs: pass --no-central-value") from None
        return describe_env(env, config, prefixes)  # the lesson's: the groups' sizes
    finally:
        env.close()


def check_spaces(env_id: str, obs_space, action_space):
    """Refuse what no policy here plays: observations other than vectors, actions other than
    Discrete or Box."""
    if not isinstance(action_space, (gym.spaces.Discrete, gym.spaces.Box)):
        raise UsageError(f"{env_id} has a {action_space} action space; this script handles "
                         f"Discrete and Box actions, and no script of this library handles "
                         f"{type(action_space).__name__} actions for many agents yet")
    kind = type(obs_space).__name__
    if not isinstance(obs_space, gym.spaces.Box):
        raise UsageError(f"{env_id} has a {kind} observation space; no script of this library "
                         f"handles {kind} observations yet")
    if obs_space.dtype == np.uint8 and len(obs_space.shape) >= 2:
        raise UsageError(f"{env_id} observes images {obs_space.shape}; no script of this "
                         f"library handles image observations outside Atari yet")
    if isinstance(action_space, gym.spaces.Box) and len(action_space.shape) != 1:
        raise UsageError(f"{env_id} has {action_space} actions; this script's Gaussian policy "
                         f"takes vectors of actions (one dimension)")


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
    """The run dir, made and tested for writing; one that holds another run is refused, unless
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
