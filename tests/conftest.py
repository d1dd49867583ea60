"""Shared test helpers: the repository root on sys.path, small envs registered for the tests,
reading processes from /proc, and the NumPy learners' check against the lessons' torch code."""
import copy
import sys
import time
import types
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


class CountEnv(gym.Env):
    """Observation = [steps taken so far]; reward 1 per step; never terminates (a TimeLimit truncates it)."""

    observation_space = gym.spaces.Box(0, 1000, (1,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return np.array([0.0], np.float32), {}

    def step(self, action):
        self.t += 1
        return np.array([self.t], np.float32), 1.0, False, False, {}


class GuessDimsEnv(gym.Env):
    """A one-step MultiDiscrete game: the observation shows, one-hot, the right choice of each of two
    action dimensions (3 and 4 choices); the reward is the number of dimensions guessed right (optimum 2)."""

    observation_space = gym.spaces.Box(0, 1, (7,), np.float32)
    action_space = gym.spaces.MultiDiscrete([3, 4])

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.target = np.array([self.np_random.integers(3), self.np_random.integers(4)])
        obs = np.zeros(7, np.float32)
        obs[self.target[0]] = 1
        obs[3 + self.target[1]] = 1
        return obs, {}

    def step(self, action):
        reward = float(np.sum(np.asarray(action) == self.target))
        return np.zeros(7, np.float32), reward, True, False, {}


class CopyBitsEnv(gym.Env):
    """A one-step MultiBinary game: copy the 4 bits of the observation; reward = share copied right
    (optimum 1)."""

    observation_space = gym.spaces.Box(0, 1, (4,), np.float32)
    action_space = gym.spaces.MultiBinary(4)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.bits = self.np_random.integers(0, 2, 4).astype(np.int8)
        return self.bits.astype(np.float32), {}

    def step(self, action):
        reward = float(np.mean(np.asarray(action) == self.bits))
        return np.zeros(4, np.float32), reward, True, False, {}


gym.register("TestCount-v0", entry_point=CountEnv, max_episode_steps=3)
gym.register("TestGuessDims-v0", entry_point=GuessDimsEnv)
gym.register("TestCopyBits-v0", entry_point=CopyBitsEnv)


class ExplodingEnv(CountEnv):
    """Like CountEnv, but its 5th step raises: a Game that fails inside a worker."""

    def step(self, action):
        if self.t == 4:
            raise RuntimeError("boom at step 5")
        return super().step(action)


gym.register("TestExplode-v0", entry_point=ExplodingEnv, max_episode_steps=100)


# ----- processes, read from /proc (the tests that kill and interrupt runs) ---------------------------


def children(pid):
    """The child processes of pid (from /proc), alive or not yet reaped."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        found += [int(child) for child in (task / "children").read_text().split()]
    return found


def running(pid):
    """True while the process exists and is not a zombie."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in status


def wait_until_gone(pids, seconds=10.0):
    """True once none of pids runs any more; False if some still do after `seconds`."""
    deadline = time.monotonic() + seconds
    while any(running(pid) for pid in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def assert_numpy_learner_steps_as_the_lesson(module, lesson_model, config, minibatch, steps=3):
    """`steps` gradient steps on one minibatch by the lesson's Trainer (autograd + Adam) and by
    module.NumpyLearner on a copy of lesson_model: the same diagnostics, weights and Adam moments up
    to rounding, with the global norm clipped and some ratios clipped."""
    numpy_model = copy.deepcopy(lesson_model)
    lesson = module.Trainer(lesson_model, config, module.Adam)
    numpy_trainer = module.Trainer(numpy_model, config, module.Adam)
    fast = module.NumpyLearner(types.SimpleNamespace(model=numpy_model, trainer=numpy_trainer,
                                                     config=config))
    start = copy.deepcopy(lesson_model.state_dict())
    for _ in range(steps):
        expected, got = lesson.gradient_step(minibatch), fast.gradient_step(minibatch)
        assert got.keys() == expected.keys()
        for key, value in expected.items():
            assert got[key].item() == pytest.approx(value.item(), rel=1e-4, abs=1e-6), key
    assert expected["grad_norm"] > config.max_grad_norm  # the clip scaled the step
    assert 0 < expected["clip_fraction"] < 1
    for name, param in lesson_model.named_parameters():
        torch.testing.assert_close(numpy_model.state_dict()[name], param, rtol=1e-4, atol=1e-6)
        assert not torch.equal(param, start[name])
    mine, theirs = numpy_trainer.optimizer.state_dict(), lesson.optimizer.state_dict()  # Adam's
    assert mine["state"].keys() == theirs["state"].keys() == set(range(len(list(lesson_model.parameters()))))
    for index, state in theirs["state"].items():
        for kind in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(mine["state"][index][kind], state[kind], rtol=1e-4, atol=1e-8)
        assert mine["state"][index]["step"].item() == state["step"].item() == steps
