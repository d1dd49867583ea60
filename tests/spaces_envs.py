"""Small envs of nested spaces for tests/test_spaces.py, registered on import. A command line reaches
them as `--env spaces_envs:TestHybrid-v0` with tests/ on PYTHONPATH."""
import gymnasium as gym
import numpy as np
from gymnasium import spaces


class HybridEnv(gym.Env):
    """A hybrid action: a Dict of a Discrete choice and a Box parameter. One step: see a mode m
    (one of 3) and a target t in [-1, 1], both uniform; act with a choice c and a parameter p in
    [-1, 1]. Reward: 1 - |p - t| if c = m, else 0.

    The optimum is 1 a step. Since 1 - |p - t| <= 1 with equality only at p = t, and a wrong choice
    gets 0 whatever p, the return is at most 1, reached by c = m, p = t (t lies inside p's bounds).
    Uniformly random actions (c uniform, p uniform on [-1, 1], as action_space.sample() draws
    them) get 1/9: the choice is right with probability 1/3, and for independent uniform p, t on
    [-1, 1], E|p - t| = (1/4) * integral over the square of |p - t| = (1/4) * 8/3 = 2/3, so
    E[1 - |p - t|] = 1/3 and the mean reward is 1/3 * 1/3 = 1/9 (about 0.111)."""

    observation_space = spaces.Dict({"mode": spaces.Discrete(3),
                                     "target": spaces.Box(-1, 1, (1,), np.float32)})
    action_space = spaces.Dict({"choice": spaces.Discrete(3),
                                "parameter": spaces.Box(-1, 1, (1,), np.float32)})

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.mode = int(self.np_random.integers(3))
        self.target = self.np_random.uniform(-1, 1, (1,)).astype(np.float32)
        return {"mode": self.mode, "target": self.target}, {}

    def step(self, action):
        assert self.action_space.contains(action), action
        right = int(action["choice"]) == self.mode
        reward = float(right) * (1.0 - abs(float(action["parameter"][0]) - float(self.target[0])))
        return {"mode": self.mode, "target": self.target.copy()}, reward, True, False, {}


class ForbiddenMoveError(RuntimeError):
    """A masked env was sent an action its mask forbade."""


class ObservedMaskEnv(gym.Env):
    """PettingZoo's convention: the observation is a Dict of the observation and an "action_mask".
    Each step allows a random non-empty set of the 4 actions; a forbidden one raises. Reward 1 for
    the highest allowed action, else 0 (the observation shows the mask again as numbers)."""

    observation_space = spaces.Dict({"observation": spaces.Box(0, 1, (4,), np.float32),
                                     "action_mask": spaces.MultiBinary(4)})
    action_space = spaces.Discrete(4)

    def draw(self):
        self.mask = np.zeros(4, np.int8)
        self.mask[self.np_random.choice(4, size=int(self.np_random.integers(1, 4)), replace=False)] = 1
        return {"observation": self.mask.astype(np.float32), "action_mask": self.mask.copy()}

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return self.draw(), {}

    def step(self, action):
        if not self.mask[action]:
            raise ForbiddenMoveError(f"action {action} is forbidden by the mask {self.mask}")
        reward = float(action == np.flatnonzero(self.mask).max())
        return self.draw(), reward, False, False, {}


class InfoMaskEnv(gym.Env):
    """gymnasium's convention (as Taxi-v3): the mask is in `info`, here for a MultiDiscrete([3, 2])
    action (3 + 2 entries) and a Tuple observation of a Discrete and a Box. A forbidden choice
    raises. Reward: 1 when both choices are the first allowed ones."""

    observation_space = spaces.Tuple((spaces.Discrete(4, start=1), spaces.Box(-1, 1, (2,), np.float32)))
    action_space = spaces.MultiDiscrete([3, 2])

    def draw(self):
        self.mask = np.zeros(5, np.int8)
        self.mask[self.np_random.choice(3, size=int(self.np_random.integers(1, 3)), replace=False)] = 1
        self.mask[3 + int(self.np_random.integers(2))] = 1
        obs = (int(self.np_random.integers(1, 5)), self.np_random.uniform(-1, 1, 2).astype(np.float32))
        return obs, {"action_mask": self.mask.copy()}

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return self.draw()

    def step(self, action):
        if not (self.mask[action[0]] and self.mask[3 + action[1]]):
            raise ForbiddenMoveError(f"action {action} is forbidden by the mask {self.mask}")
        reward = float(action[0] == np.flatnonzero(self.mask[:3])[0])
        obs, info = self.draw()
        return obs, reward, False, False, info


class GridEnv(gym.Env):
    """MiniGrid's observation without MiniGrid: a Dict of a 7x7x3 uint8 image, a direction and a
    Text mission (which the script leaves out). The lit cell of the image says which of 3 actions
    pays 1; 5 steps an episode (a time limit)."""

    observation_space = spaces.Dict({"image": spaces.Box(0, 255, (7, 7, 3), np.uint8),
                                     "direction": spaces.Discrete(4),
                                     "mission": spaces.Text(20, charset="abcdefghijklmnopqrstuvwxyz ")})
    action_space = spaces.Discrete(3)

    def draw(self):
        self.goal = int(self.np_random.integers(3))
        image = np.zeros((7, 7, 3), np.uint8)
        image[self.goal, self.goal] = 255
        return {"image": image, "direction": int(self.np_random.integers(4)), "mission": "find it"}

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return self.draw(), {}

    def step(self, action):
        reward = float(action == self.goal)
        return self.draw(), reward, False, False, {}


class CodeGridEnv(GridEnv):
    """GridEnv with MiniGrid's kind of image: the lit cell holds code 2 (MiniGrid's codes are 0-10 in
    a Box declared 0-255), not 255. An image normalised by its declared range would show it as 0.008."""

    def draw(self):
        obs = super().draw()
        obs["image"][self.goal, self.goal] = 2
        return obs


class FlawedEnv(gym.Env):
    """An env that breaks its own declared spaces at its third step (or step `at` of an episode), as
    `flaw` says: "dtype" (a float64 position), "shape", "key" (the Dict without "count"), "bounds"
    (count 5 of Discrete(3)) or "reward" (NaN); "start": a float64 position from reset() on
    (gymnasium's own checker warns of it at once)."""

    observation_space = spaces.Dict({"count": spaces.Discrete(3),
                                     "position": spaces.Box(-1, 1, (2,), np.float32)})
    action_space = spaces.Discrete(2)

    def __init__(self, flaw: str, at: int = 3):
        self.flaw, self.at, self.t = flaw, at, 0

    def observation(self):
        obs = {"count": self.t % 3, "position": np.zeros(2, np.float32)}
        if self.t >= self.at or self.flaw == "start":
            if self.flaw in ("dtype", "start"):
                obs["position"] = np.zeros(2, np.float64)
            elif self.flaw == "shape":
                obs["position"] = np.zeros(3, np.float32)
            elif self.flaw == "key":
                del obs["count"]
            elif self.flaw == "bounds":
                obs["count"] = 5
        return obs

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return self.observation(), {}

    def step(self, action):
        self.t += 1
        reward = float("nan") if self.flaw == "reward" and self.t >= 3 else 0.0
        return self.observation(), reward, False, False, {}


class EmptyMaskEnv(gym.Env):
    """A Discrete(3) action whose mask (in `info`, or with in_observation in the observation, as
    PettingZoo's) allows every choice until step `at` of an episode, then none. It takes any
    action: a run that trusted the mask would play on, sampling forbidden actions."""

    action_space = spaces.Discrete(3)

    def __init__(self, in_observation: bool, at: int = 150):
        self.in_observation, self.at, self.t = in_observation, at, 0
        position = spaces.Box(0, 1, (1,), np.float32)
        self.observation_space = (spaces.Dict({"position": position,
                                               "action_mask": spaces.MultiBinary(3)})
                                  if in_observation else position)

    def observation(self):
        position, mask = np.zeros(1, np.float32), np.full(3, self.t < self.at, np.int8)
        if self.in_observation:
            return {"position": position, "action_mask": mask}, {}
        return position, {"action_mask": mask}

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return self.observation()

    def step(self, action):
        self.t += 1
        obs, info = self.observation()
        return obs, 0.0, False, False, info


class WrongMaskEnv(InfoMaskEnv):
    """Its 5-entry mask cannot cover a MultiDiscrete([3, 3]) action's 6 choices."""

    action_space = spaces.MultiDiscrete([3, 3])


class TextActionEnv(HybridEnv):
    """Acts with text: no script of the library handles that."""

    action_space = spaces.Text(5)


gym.register("TestHybrid-v0", entry_point=HybridEnv)
gym.register("TestObservedMask-v0", entry_point=ObservedMaskEnv, max_episode_steps=10)
gym.register("TestInfoMask-v0", entry_point=InfoMaskEnv, max_episode_steps=10)
gym.register("TestGrid-v0", entry_point=GridEnv, max_episode_steps=5)
gym.register("TestCodeGrid-v0", entry_point=CodeGridEnv, max_episode_steps=5)
gym.register("TestWrongMask-v0", entry_point=WrongMaskEnv, max_episode_steps=10)
gym.register("TestTextAction-v0", entry_point=TextActionEnv)
for flaw in ("dtype", "shape", "key", "bounds", "reward", "start"):
    gym.register(f"TestFlawed{flaw.title()}-v0", entry_point=FlawedEnv, kwargs={"flaw": flaw},
                 max_episode_steps=20)
# Envs that keep to their spaces for 149 steps, past the start-up check's 100, then break them.
for flaw in ("shape", "key", "bounds"):
    gym.register(f"TestLate{flaw.title()}-v0", entry_point=FlawedEnv,
                 kwargs={"flaw": flaw, "at": 150})
gym.register("TestEmptyMaskInInfo-v0", entry_point=EmptyMaskEnv, kwargs={"in_observation": False})
gym.register("TestEmptyMaskInObservation-v0", entry_point=EmptyMaskEnv,
             kwargs={"in_observation": True})
