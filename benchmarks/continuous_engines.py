r"""How fast does Pendulum-v1 step as batched torch code, against gymnasium's vector env?

What it measures
----------------
Environment steps per second (all envs) of the environment alone, no policy: uniformly random
torques in [-2, 2], drawn before the clock starts, for `--num-envs` (default 1 64 1024 4096) copies
of Pendulum-v1 on two engines:

- `gymnasium`: `gymnasium.make_vec("Pendulum-v1", N, vectorization_mode="sync")`, the engine of
  `--env-backend game` (ppo_continuous.py's Game, in one process): one Python Pendulum per env,
  stepped in a loop, autoresetting;
- `torch`: ppo_continuous.py's `TorchPendulum(N)` (`--env-backend torch`): the N states in one
  tensor, a step of all of them a few tensor operations, restarting ended games in the same step;
  on the CPU with one thread (what a run sets), and on CUDA when `--device cuda` is given.

Each engine steps for at least `--seconds` (default 2) after a warm-up of 20 steps, in this same
process, one engine after the other, and takes the best of `--repeats` (default 3) such
measurements (the least disturbed). The table gives steps/s per engine and the ratio torch /
gymnasium per N, and where the ratio crosses 1.

How to run it (from the repository root)
----------------------------------------
    pip install -r requirements.txt
    python benchmarks/continuous_engines.py
    python benchmarks/continuous_engines.py --num-envs 1 16 256 --seconds 0.5   # a quick check
"""

import argparse
import datetime
import sys
import time

from harness import REPO_ROOT, fmt, machine, machine_line, warn_if_busy

PACKAGES = ("torch", "gymnasium", "numpy")


def steps_per_second(step, num_envs, seconds, repeats):
    """The best of `repeats` measurements of `step()` (one step of all envs) over `seconds`."""
    for _ in range(20):
        step()
    best = 0.0
    for _ in range(repeats):
        count, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < seconds:
            step()
            count += 1
        best = max(best, count * num_envs / elapsed)
    return best


def gymnasium_engine(num_envs, seconds, repeats):
    import gymnasium as gym
    import numpy as np

    envs = gym.make_vec("Pendulum-v1", num_envs, vectorization_mode="sync")
    envs.reset(seed=1)
    torques = np.random.default_rng(1).uniform(-2, 2, (256, num_envs, 1)).astype(np.float32)
    count = iter(range(10 ** 12))
    speed = steps_per_second(lambda: envs.step(torques[next(count) % 256]), num_envs, seconds,
                             repeats)
    envs.close()
    return speed


def torch_engine(num_envs, seconds, repeats, device_name):
    import torch

    sys.path.insert(0, str(REPO_ROOT))
    from ppo_continuous import TorchPendulum

    torch.set_num_threads(1)  # as a run sets it
    device = torch.device(device_name)
    engine = TorchPendulum(num_envs, seed=1, device=device)
    torques = torch.rand(256, num_envs, 1, device=device) * 4 - 2
    count = iter(range(10 ** 12))

    def step():
        engine.step(torques[next(count) % 256])
        engine.observations()
        if device.type == "cuda":
            torch.cuda.synchronize()

    return steps_per_second(step, num_envs, seconds, repeats)


def main():
    parser = argparse.ArgumentParser(
        description="Pendulum-v1 env steps/s: ppo_continuous.py's torch engine against "
        "gymnasium's sync vector env, for several numbers of envs.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--num-envs", type=int, nargs="+", default=[1, 64, 1024, 4096])
    parser.add_argument("--seconds", type=float, default=2.0, help="per measurement")
    parser.add_argument("--repeats", type=int, default=3, help="measurements per cell; the best")
    parser.add_argument("--device", default="cpu", help="the torch engine's device")
    args = parser.parse_args()
    if min(args.num_envs) <= 0 or args.seconds <= 0 or args.repeats <= 0:
        parser.exit(2, "error: --num-envs, --seconds and --repeats must be positive\n")
    info = machine(PACKAGES)
    warn_if_busy(info, "lowers the speeds measured")
    lines = [f"| envs | gymnasium sync vector env, steps/s | torch engine ({args.device}), "
             "steps/s | torch / gymnasium |", "| ---: | ---: | ---: | ---: |"]
    ratios = {}
    for num_envs in args.num_envs:
        gym_speed = gymnasium_engine(num_envs, args.seconds, args.repeats)
        torch_speed = torch_engine(num_envs, args.seconds, args.repeats, args.device)
        ratios[num_envs] = torch_speed / gym_speed
        lines.append(f"| {num_envs:,} | {gym_speed:,.0f} | {torch_speed:,.0f} | "
                     f"{ratios[num_envs]:.1f} |")
        print(lines[-1], flush=True)
    faster = [n for n, ratio in ratios.items() if ratio > 1]
    slower = [n for n, ratio in ratios.items() if ratio <= 1]
    crossover = (f"the torch engine is faster from {min(faster):,} envs on"
                 + (f" and slower at {', '.join(f'{n:,}' for n in slower)}" if slower else "")
                 if faster else "the torch engine is slower at every size measured")
    now = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    lines += ["", f"Crossover: {crossover}. Best of {args.repeats} measurements of "
              f"{fmt(args.seconds, 'g')} s each; random torques, no policy.", "",
              machine_line(info, PACKAGES), "", f"measured: {now}"]
    print("\n" + "\n".join(lines))


if __name__ == "__main__":
    main()
