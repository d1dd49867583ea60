"""The levers of ppo_cartpole.py's NumPy path (`--numpy-on-cpu`), each timed alone.

What it measures, on CartPole-v1's sizes (4 observations, 2 actions, 64-64 MLPs) and with the
script's defaults (64 poles, minibatches of 1,024 rows), in microseconds, after a warm-up, the
lesson's torch code against the NumPy path's, side by side in one process, one thread each:
1. tanh on a [1024, 64] array (`torch.tanh` against `np.tanh`): four of them in a gradient step's
   forward pass, and slow in torch on some CPUs;
2. one gradient step on 1,024 rows (`Trainer.gradient_step` with autograd, against
   `NumpyLearner.gradient_step` with the gradient written out);
3. the policy of one step for 64 poles (`Model.act` under inference mode, against `numpy_mlp`
   twice, `numpy_log_policy` and the inverted distribution function of `NumpyPlayer`).
Whole runs, launch to solved: `cartpole_time_to_solve.py --impl ours --our-args
"--no-numpy-on-cpu"` against the default.

    python benchmarks/cartpole_levers.py            # on an idle machine
"""
import sys
import types
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import ppo_cartpole as pc  # noqa: E402  (the script under test, from the repository root)
from harness import machine, machine_line, microseconds, warn_if_busy  # noqa: E402

OBS, POLES, ROWS, HIDDEN = 4, 64, 1024, 64
PACKAGES = ("torch", "numpy", "gymnasium")


def tanh() -> tuple:
    x = torch.randn(ROWS, HIDDEN)
    array = x.numpy()
    return (f"tanh of [{ROWS:,}, {HIDDEN}]", microseconds(lambda: torch.tanh(x), 2000),
            microseconds(lambda: np.tanh(array), 2000))


def gradient_step(config) -> tuple:
    torch.manual_seed(0)
    lesson_model = pc.Model(OBS, [2], False)
    numpy_model = pc.Model(OBS, [2], False)
    numpy_model.load_state_dict(lesson_model.state_dict())
    lesson, numpy_trainer = pc.Trainer(lesson_model, config), pc.Trainer(numpy_model, config)
    fast = pc.NumpyLearner(types.SimpleNamespace(model=numpy_model, trainer=numpy_trainer,
                                                 config=config))
    minibatch = pc.Minibatch(torch.randn(ROWS, OBS), torch.randint(0, 2, (ROWS, 1)),
                             torch.full((ROWS,), -0.69), torch.randn(ROWS), torch.randn(ROWS),
                             torch.randn(ROWS))
    return (f"a gradient step on {ROWS:,} rows",
            microseconds(lambda: lesson.gradient_step(minibatch), 500),
            microseconds(lambda: fast.gradient_step(minibatch), 500))


def one_step_of_play() -> tuple:
    torch.manual_seed(0)
    model = pc.Model(OBS, [2], False)
    obs = torch.randn(POLES, OBS)
    array, uniforms = obs.numpy(), np.random.default_rng(0).random((POLES, 1, 1))
    actor, critic = pc.numpy_layers(model.actor), pc.numpy_layers(model.critic)

    @torch.inference_mode()
    def lesson_step():
        model.act(obs)

    def numpy_step():  # NumpyPlayer.collect_rollout's arithmetic for one step
        log_policy = pc.numpy_log_policy(model, pc.numpy_mlp(actor, array))
        actions = (np.cumsum(np.exp(log_policy), -1) <= uniforms).sum(-1)
        np.take_along_axis(log_policy, actions[..., None], -1).sum((-1, -2))
        pc.numpy_mlp(critic, array)

    return (f"the policy of one step for {POLES} poles", microseconds(lesson_step, 5000),
            microseconds(numpy_step, 5000))


def main():
    info = machine(PACKAGES)
    warn_if_busy(info, "lowers the speeds measured, not always alike")
    torch.set_num_threads(1)  # as ppo_cartpole.py runs
    rows = [tanh(), gradient_step(pc.Config()), one_step_of_play()]
    print("| lever | torch, us | NumPy, us | torch / NumPy |\n| --- | ---: | ---: | ---: |")
    for name, lesson, fast in rows:
        print(f"| {name} | {lesson:,.1f} | {fast:,.1f} | {lesson / fast:.1f} |")
    print("\n" + machine_line(info, PACKAGES))


if __name__ == "__main__":
    main()
