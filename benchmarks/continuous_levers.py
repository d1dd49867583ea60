"""The levers of ppo_continuous.py's NumPy path (`--numpy-on-cpu`), each timed alone, then together.

What it measures, on MuJoCo's HalfCheetah-v5 sizes (17 observations, 6 actions, 64-64 MLPs) and with
CleanRL's settings (one env, 2048 steps a rollout, minibatches of 64), in microseconds, after a
warm-up, the lesson's torch code against the NumPy path's, side by side in one process:
1. one gradient step on 64 rows (`Trainer.gradient_step` with autograd, against
   `NumpyLearner.gradient_step` with the gradient written out); and within it the global gradient
   clip and Adam's step (`clip_grad_norm_` and `torch.optim.Adam.step`, against
   `NumpyLearner.clip_and_step` on the flat arrays);
2. the policy and the statistics of one step for one game (`Model.act`, `RunningMeanStd.normalize`
   and `RunningMeanStd.scale`, against `numpy_mlp` twice, the Gaussian sample, `numpy_normalize`
   and `numpy_merge`);
3. GAE over a rollout of 2048 steps of one game (`compute_gae` against
   `NumpyPlayer.estimate_advantages`, the critic's forward pass for the last value included);
4. whole runs: `--total-timesteps` (default 30,720) steps of HalfCheetah-v5 with CleanRL's flags,
   `--no-numpy-on-cpu` and then the default, each the steady steps/s of its summary.json.

    python benchmarks/continuous_levers.py            # needs gymnasium[mujoco]; an idle machine
"""
import argparse
import json
import math
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import ppo_continuous as pc  # noqa: E402  (the script under test, from the repository root)
from harness import REPO_ROOT, machine, machine_line, microseconds, warn_if_busy  # noqa: E402

OBS, ACTIONS, ROWS, STEPS = 17, 6, 64, 2048
CLEANRL_FLAGS = ["--env", "HalfCheetah-v5", "--num-envs", "1", "--num-steps", "2048",
                 "--num-minibatches", "32", "--update-epochs", "10", "--learning-rate", "3e-4",
                 "--gamma", "0.99", "--gae-lambda", "0.95", "--clip-value-loss"]


def learners(config):
    """Two copies of one model: one learns with the lesson's Trainer, one with NumpyLearner."""
    torch.manual_seed(0)
    lesson_model = pc.Model(OBS, ACTIONS)
    numpy_model = pc.Model(OBS, ACTIONS)
    numpy_model.load_state_dict(lesson_model.state_dict())
    lesson = pc.Trainer(lesson_model, config, pc.Adam)
    numpy_trainer = pc.Trainer(numpy_model, config, pc.Adam)
    fast = pc.NumpyLearner(types.SimpleNamespace(model=numpy_model, trainer=numpy_trainer,
                                                 config=config))
    return lesson, fast


def gradient_steps(config) -> list:
    lesson, fast = learners(config)
    minibatch = pc.Minibatch(torch.randn(ROWS, OBS), torch.randn(ROWS, ACTIONS),
                             torch.randn(ROWS) - 8, torch.randn(ROWS), torch.randn(ROWS),
                             torch.randn(ROWS))
    params = list(lesson.model.parameters())
    loss, _ = lesson.compute_loss(minibatch)
    loss.backward()  # (gradients in place for the clip and Adam alone)

    def torch_clip_and_adam():
        torch.nn.utils.clip_grad_norm_(params, config.max_grad_norm)
        lesson.optimizer.step()

    return [("a gradient step on 64 rows", microseconds(lambda: lesson.gradient_step(minibatch),
                                                         2000),
             microseconds(lambda: fast.gradient_step(minibatch), 2000)),
            ("  of which: the gradient clip and Adam", microseconds(torch_clip_and_adam, 2000),
             microseconds(fast.clip_and_step, 2000))]


def one_step_of_play(config) -> tuple:
    torch.manual_seed(0)
    model = pc.Model(OBS, ACTIONS)
    obs_stats = pc.RunningMeanStd((OBS,), "cpu")
    return_stats = pc.RunningMeanStd((), "cpu")
    returns, obs, reward = torch.zeros(1, dtype=torch.float64), torch.randn(1, OBS), torch.ones(1)
    ended = torch.zeros(1, dtype=torch.bool)
    fast = pc.NumpyPlayer(types.SimpleNamespace(model=model, config=config, guard=None))
    numpy_returns, numpy_obs, numpy_reward = returns.numpy().copy(), obs.numpy(), reward.numpy()
    std, noise = np.exp(fast.log_std), np.random.default_rng(0).standard_normal((1, ACTIONS))

    @torch.inference_mode()
    def lesson_step():
        model.act(obs_stats.normalize(obs, config.obs_clip))
        return_stats.scale(reward, returns, ended, config.gamma, config.reward_clip)

    def numpy_step():
        normalized = pc.numpy_normalize(obs_stats, numpy_obs, config.obs_clip)
        mean = pc.numpy_mlp(fast.actor, normalized)
        pc.numpy_mlp(fast.critic, normalized)
        sampled = mean + std * noise
        (-0.5 * ((sampled - mean) / std) ** 2 - fast.log_std - 0.5 * math.log(2 * math.pi)).sum(-1)
        numpy_returns[:] = numpy_returns * config.gamma + numpy_reward
        pc.numpy_merge(return_stats, numpy_returns)
        np.minimum(np.maximum(numpy_reward / np.sqrt(return_stats.var.numpy() + 1e-8), -10), 10)

    return ("the policy and statistics of one step", microseconds(lesson_step, 5000),
            microseconds(numpy_step, 5000))


def advantages(config) -> tuple:
    torch.manual_seed(0)
    model = pc.Model(OBS, ACTIONS)
    rollout = pc.Rollout(config, OBS, ACTIONS, torch.device("cpu"))
    rollout.rewards.normal_()
    rollout.values.normal_()
    rollout.dones.bernoulli_(0.001)
    next_obs = torch.randn(1, OBS)
    fast = pc.NumpyPlayer(types.SimpleNamespace(model=model, config=config, guard=None,
                                                rollout=rollout))

    @torch.no_grad()
    def lesson_gae():
        gae = pc.compute_gae(rollout.rewards, rollout.values, rollout.dones,
                             model.value(next_obs), config.gamma, config.gae_lambda)
        return gae, gae + rollout.values

    return (f"GAE over {STEPS:,} steps of one game", microseconds(lesson_gae, 20),
            microseconds(lambda: fast.estimate_advantages(next_obs), 20))


def whole_run(steps: int, numpy_on_cpu: bool) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        flag = "--numpy-on-cpu" if numpy_on_cpu else "--no-numpy-on-cpu"
        subprocess.run([sys.executable, "ppo_continuous.py", *CLEANRL_FLAGS, "--seed", "1",
                        "--total-timesteps", str(steps), "--device", "cpu", "--run-dir", tmp,
                        "--overwrite", flag], cwd=REPO_ROOT, check=True, capture_output=True)
        return json.loads((Path(tmp) / "summary.json").read_text())["steps_per_second"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--total-timesteps", type=int, default=30_720)
    args = parser.parse_args()
    info = machine(("torch", "numpy", "gymnasium", "mujoco"))
    warn_if_busy(info, "lowers the speeds measured, not always alike")
    torch.set_num_threads(1)  # as ppo_continuous.py runs
    config = pc.Config(num_envs=1, num_steps=STEPS, num_minibatches=32, clip_value_loss=True,
                       gamma=0.99)
    rows = [*gradient_steps(config), one_step_of_play(config), advantages(config)]
    print("| lever | torch, us | NumPy, us | torch / NumPy |\n| --- | ---: | ---: | ---: |")
    for name, lesson, fast in rows:
        print(f"| {name} | {lesson:,.1f} | {fast:,.1f} | {lesson / fast:.1f} |")
    slow, fast = (whole_run(args.total_timesteps, flag) for flag in (False, True))
    print(f"\nHalfCheetah-v5, {args.total_timesteps:,} steps with CleanRL's flags, steady steps/s: "
          f"--no-numpy-on-cpu {slow:,.0f}, --numpy-on-cpu {fast:,.0f} ({fast / slow:.2f}x)")
    print("\n" + machine_line(info, ("torch", "numpy", "gymnasium", "mujoco")))


if __name__ == "__main__":
    main()
