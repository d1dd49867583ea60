"""Small PettingZoo parallel envs for tests/test_multiagent.py, named on the command line as
`--env multiagent_envs.dying_v0` (with tests/ on PYTHONPATH)."""
import types

import numpy as np
from gymnasium import spaces
from pettingzoo import ParallelEnv


class DyingEnv(ParallelEnv):
    """Three agents that finish at different times: agent i terminates after LIFETIMES[i] steps,
    except the last, whom a time limit cuts (truncation) at the last of them. Agent i earns i + 1
    per step, so the returns are 2 x 1, 4 x 2 and 6 x 3: 28 for the team, 28 / 3 per agent.

    Agent i observes [i, t, the seed of the env's first reset]: a row tells whose it is, when, and
    in which env copy. The global state is [t, which agents are alive]. Actions do nothing.
    """

    metadata = {"name": "dying_v0", "render_modes": []}
    LIFETIMES = (2, 4, 6)

    def __init__(self, render_mode=None):
        self.possible_agents = [f"agent_{i}" for i in range(3)]
        self.agents = []
        self.render_mode = render_mode
        self.marker = -1.0

    def observation_space(self, agent):
        return spaces.Box(-1e6, 1e6, (3,), np.float32)

    def action_space(self, agent):
        return spaces.Discrete(2)

    def observe(self):
        return {agent: np.array([self.possible_agents.index(agent), self.t, self.marker],
                                np.float32) for agent in self.agents}

    def state(self):
        alive = [float(agent in self.agents) for agent in self.possible_agents]
        return np.array([self.t, *alive], np.float32)

    def reset(self, seed=None, options=None):
        if seed is not None:
            self.marker = float(seed)
        self.agents, self.t = list(self.possible_agents), 0
        return self.observe(), {agent: {} for agent in self.agents}

    def step(self, actions):
        assert set(actions) == set(self.agents), (actions, self.agents)  # only the living act
        self.t += 1
        acted = list(self.agents)
        rewards = {agent: float(self.possible_agents.index(agent) + 1) for agent in acted}
        last = max(self.LIFETIMES)
        ends = {agent: self.t >= self.LIFETIMES[self.possible_agents.index(agent)]
                for agent in acted}
        terminations = {agent: ends[agent] and self.t < last for agent in acted}
        truncations = {agent: ends[agent] and self.t >= last for agent in acted}
        observations = {agent: np.array([self.possible_agents.index(agent), self.t, self.marker],
                                        np.float32) for agent in acted}
        self.agents = [agent for agent in acted if not ends[agent]]
        return observations, rewards, terminations, truncations, {agent: {} for agent in acted}


dying_v0 = types.SimpleNamespace(parallel_env=DyingEnv)


class MixedEnv(ParallelEnv):
    """Agents of two kinds, one acting with a Box and two with a Discrete action, for 5 steps (a
    time limit: truncation). pointer_0 observes a target point in [-1, 1]^2 and is paid minus the
    squared distance of its action to it; chooser_i observes a one-hot of a class of 3 and is paid 1
    for choosing it. The targets are drawn anew each step from the env's seeded generator. Every
    action dict the envs of this process receive is kept in `MixedEnv.received` (a class list, for
    runs with --num-workers 0), to check what arrives: Box actions clipped, Discrete ones ints."""

    metadata = {"name": "mixed_v0", "render_modes": []}
    LENGTH = 5
    received = []

    def __init__(self, render_mode=None):
        self.possible_agents = ["pointer_0", "chooser_0", "chooser_1"]
        self.agents, self.render_mode = [], render_mode
        self.rng = np.random.default_rng(0)

    def observation_space(self, agent):
        return spaces.Box(-1.0, 1.0, (2,) if agent.startswith("pointer") else (3,), np.float32)

    def action_space(self, agent):
        if agent.startswith("pointer"):
            return spaces.Box(-1.0, 1.0, (2,), np.float32)
        return spaces.Discrete(3)

    def draw(self):
        self.point = self.rng.uniform(-1, 1, 2).astype(np.float32)
        self.classes = self.rng.integers(3, size=2)
        return {"pointer_0": self.point.copy(),
                **{f"chooser_{i}": np.eye(3, dtype=np.float32)[c]
                   for i, c in enumerate(self.classes)}}

    def state(self):
        return np.concatenate([self.point, self.classes.astype(np.float32)])

    def reset(self, seed=None, options=None):
        if seed is not None:
            self.rng = np.random.default_rng(seed)
        self.agents, self.t = list(self.possible_agents), 0
        return self.draw(), {agent: {} for agent in self.agents}

    def step(self, actions):
        self.received.append(actions)
        miss = np.asarray(actions["pointer_0"]) - self.point
        rewards = {"pointer_0": -float(np.sum(miss ** 2)),
                   **{f"chooser_{i}": float(actions[f"chooser_{i}"] == c)
                      for i, c in enumerate(self.classes)}}
        self.t += 1
        done = self.t >= self.LENGTH
        observations = self.draw()
        acted, self.agents = self.agents, [] if done else self.agents
        return (observations, rewards, {agent: False for agent in acted},
                {agent: done for agent in acted}, {agent: {} for agent in acted})


mixed_v0 = types.SimpleNamespace(parallel_env=MixedEnv)
