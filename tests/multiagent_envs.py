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
