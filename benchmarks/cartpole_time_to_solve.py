"""Time to solve CartPole-v1: `ppo_cartpole.py` against Stable-Baselines3 PPO.

What it measures
----------------
The wall-clock time of the *whole process*, from launch to exit, until CartPole-v1 is solved: the
mean return of the last 100 finished episodes is at least 475. Python startup, imports, environment
and model creation all count, because that is what a user waits for. Each run is a subprocess; the
parent times it with `time.perf_counter` from `Popen` to exit.

Two implementations, side by side in one run, for each seed (default 1 2 3):

1. ours: `python ppo_cartpole.py --seed S --target-return 475 --run-dir <tmpdir> [--our-args ...]`,
   run from the repository root. It stops by itself at the target; the result is read from
   `<tmpdir>/summary.json` (solved iff `solved_step` is not null).
2. SB3: Stable-Baselines3 PPO with the rl-baselines3-zoo hyperparameters for CartPole-v1
   (`MlpPolicy`, 8 envs, n_steps 32, batch 256, 20 epochs, gamma 0.98, GAE lambda 0.8, no entropy
   bonus, learning rate `lin_1e-3`, clip range `lin_0.2`, 1e5 timesteps, CPU; harness.py's
   `sb3_zoo_cartpole`, which cartpole_learning.py uses too). It runs in a child
   process of this same file (`--_sb3-child`), with a callback that stops training as soon as the
   mean of the last 100 finished episodes (from the Monitor's `info["episode"]["r"]`) reaches 475.
   If the budget ends first, the run is reported as not solved.

The runs are interleaved (seed 1 ours, seed 1 SB3, seed 2 ours, ...) so that background load hits
both alike. Run only one benchmark at a time on a machine.

The output is a markdown table (implementation, seed, solved, env steps, process wall seconds, plus
the in-process training seconds and the final mean return), the median wall seconds of each
implementation over its solved seeds with the ratio SB3 / ours, and the machine and date.
`--json PATH` writes the same as JSON.

How to run it (from the repository root)
----------------------------------------
    pip install -r requirements.txt -r benchmarks/requirements.txt
    python benchmarks/cartpole_time_to_solve.py
    python benchmarks/cartpole_time_to_solve.py --seeds 1 2 3 4 5 --json cartpole.json
    python benchmarks/cartpole_time_to_solve.py --our-args "--num-workers 0 --no-compile"
    python benchmarks/cartpole_time_to_solve.py --impl sb3 --sb3-timesteps 300000
"""

import argparse
import datetime
import json
import shlex
import statistics
import sys
import tempfile
import time
from collections import deque
from pathlib import Path

from harness import (REPO_ROOT, check_ready, fmt, machine, machine_line, report_failure,
                     run_our_script, sb3_zoo_cartpole, timed_run, warn_if_busy)

# This file's top level imports only the standard library (and harness.py, which does too), so that
# the SB3 child process pays for Python startup and its own imports (SB3, torch, gymnasium) just like
# our script does.

OUR_SCRIPT = REPO_ROOT / "ppo_cartpole.py"
TARGET_RETURN = 475.0  # CartPole-v1's reward threshold, over 100 consecutive episodes
WINDOW = 100  # episodes in the moving mean
PACKAGES = ("torch", "gymnasium", "stable-baselines3")  # whose versions the report names


# --------------------------------------------------------------------------------------------------
# The SB3 reference, run in a child process
# --------------------------------------------------------------------------------------------------


def sb3_child(seed, out_file, total_timesteps):
    """Train SB3 PPO with the zoo settings until solved or out of budget; write a small JSON."""
    from stable_baselines3.common.callbacks import BaseCallback

    class StopWhenSolved(BaseCallback):
        """Keeps the returns of finished episodes; stops training once the last 100 average >= 475."""

        def __init__(self):
            super().__init__()
            self.returns = deque(maxlen=WINDOW)
            self.episodes = 0
            self.solved_step = None

        def mean_return(self):
            return sum(self.returns) / len(self.returns) if self.returns else None

        def _on_step(self):
            # `make_vec_env` wraps each env in a Monitor, which puts the finished episode's
            # return into `info["episode"]["r"]`.
            for info in self.locals["infos"]:
                if "episode" in info:
                    self.returns.append(float(info["episode"]["r"]))
                    self.episodes += 1
            if len(self.returns) == WINDOW and self.mean_return() >= TARGET_RETURN:
                self.solved_step = self.num_timesteps
                return False  # stops `learn()`
            return True

    start = time.perf_counter()  # after the imports: env creation, model creation and learning
    env, model = sb3_zoo_cartpole(seed)
    callback = StopWhenSolved()
    model.learn(total_timesteps=total_timesteps, callback=callback)
    seconds = time.perf_counter() - start
    env.close()
    result = {
        "solved": callback.solved_step is not None,
        "steps": model.num_timesteps,
        "seconds": seconds,
        "episodes": callback.episodes,
        "mean_return_100": callback.mean_return(),
        "total_timesteps": total_timesteps,
    }
    Path(out_file).write_text(json.dumps(result, indent=2))


# --------------------------------------------------------------------------------------------------
# Running and timing one subprocess
# --------------------------------------------------------------------------------------------------


def run_ours(seed, args):
    cmd, status, wall, tail, summary, _ = run_our_script(
        OUR_SCRIPT, ["--seed", str(seed), "--target-return", str(TARGET_RETURN)], args.our_args, seed, args.timeout)
    row = {"implementation": "ours", "seed": seed, "wall_seconds": wall, "command": shlex.join(cmd)}
    solved = summary is not None and summary.get("solved_step") is not None
    row.update({
        "status": status,
        "solved": solved,
        "steps": (summary["solved_step"] if solved else summary.get("steps")) if summary else None,
        "train_seconds": (summary.get("solved_seconds") if solved else summary.get("seconds"))
        if summary else None,
        "mean_return_100": summary.get("mean_return_100") if summary else None,
    })
    if status != "ok":
        report_failure("ours", seed, status, tail)
    return row


def run_sb3(seed, args):
    with tempfile.TemporaryDirectory(prefix=f"sb3_seed{seed}_") as tmp:
        out_file = Path(tmp) / "result.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--_sb3-child", str(seed), str(out_file),
               "--sb3-timesteps", str(args.sb3_timesteps)]
        returncode, wall, tail = timed_run(cmd, args.timeout, tmp)
        result = json.loads(out_file.read_text()) if out_file.exists() else None
    if returncode is None:
        status = f"timeout after {args.timeout:g} s"
    elif returncode != 0 or result is None:
        status = f"crashed (exit status {returncode})"
    else:
        status = "ok"
    row = {
        "implementation": "sb3",
        "seed": seed,
        "wall_seconds": wall,
        "status": status,
        "solved": bool(result and result["solved"]),
        "steps": result["steps"] if result else None,
        "train_seconds": result["seconds"] if result else None,
        "mean_return_100": result["mean_return_100"] if result else None,
        "sb3_timesteps": args.sb3_timesteps,
    }
    if status != "ok":
        report_failure("sb3", seed, status, tail)
    return row


# --------------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------------


def summarize(rows, implementations):
    summary = {}
    for name in implementations:
        solved = [r["wall_seconds"] for r in rows if r["implementation"] == name and r["solved"]]
        total = sum(r["implementation"] == name for r in rows)
        summary[name] = {
            "solved_seeds": len(solved),
            "seeds": total,
            "median_wall_seconds": statistics.median(solved) if solved else None,
        }
    ours = summary.get("ours", {}).get("median_wall_seconds")
    sb3 = summary.get("sb3", {}).get("median_wall_seconds")
    summary["ratio_sb3_over_ours"] = sb3 / ours if ours and sb3 else None
    return summary


def print_report(rows, summary, info, date, args):
    print()
    print("| implementation | seed | solved | env steps | process wall s | in-process s | mean return (last 100) |")
    print("| --- | ---: | :---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        solved = "yes" if r["solved"] else ("no" if r["status"] == "ok" else f"no ({r['status']})")
        print(f"| {r['implementation']} | {r['seed']} | {solved} | {fmt(r['steps'], ',')} "
              f"| {r['wall_seconds']:.1f} | {fmt(r['train_seconds'], '.1f')} "
              f"| {fmt(r['mean_return_100'], '.1f')} |")
    print()
    for name in args.impl:
        s = summary[name]
        print(f"{name}: median process wall time over solved seeds = "
              f"{fmt(s['median_wall_seconds'], '.1f')} s ({s['solved_seeds']}/{s['seeds']} seeds solved)")
    ratio = summary["ratio_sb3_over_ours"]
    if ratio is not None:
        verdict = f"ours is {ratio:.2f}x faster" if ratio >= 1 else f"ours is {1 / ratio:.2f}x slower"
        print(f"ratio SB3 median / ours median = {ratio:.2f} ({verdict})")
    elif len(args.impl) == 2:
        print("ratio SB3 / ours: n/a (an implementation solved no seed)")
    print()
    print("in-process s: ours = summary.json solved_seconds (seconds when not solved); "
          "SB3 = env + model creation + learning, after imports.")
    if "sb3" in args.impl:
        print(f"SB3 budget: {args.sb3_timesteps:,} timesteps (linear schedules decay over it).")
    if args.our_args and "ours" in args.impl:
        print(f"our extra args: {args.our_args}")
    print(machine_line(info, PACKAGES))
    print(f"date: {date}")


# --------------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------------


def parse_args():
    parser = argparse.ArgumentParser(
        description="Whole-process wall time to solve CartPole-v1 (mean return of the last 100 "
        "episodes >= 475): ppo_cartpole.py vs Stable-Baselines3 PPO (rl-zoo settings).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3], help="seeds to run")
    parser.add_argument("--impl", nargs="+", choices=["ours", "sb3"], default=["ours", "sb3"],
                        help="implementations to run")
    parser.add_argument("--our-args", default="",
                        help='extra arguments for ppo_cartpole.py, one string, e.g. "--num-workers 0"')
    parser.add_argument("--sb3-timesteps", type=int, default=100_000,
                        help="SB3 budget (the zoo's n_timesteps is 1e5); the linear schedules decay over it")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds allowed per run")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    parser.add_argument("--_sb3-child", nargs=2, metavar=("SEED", "OUTFILE"), dest="sb3_child",
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.impl = [name for name in ("ours", "sb3") if name in args.impl]  # fixed order, no duplicates
    if args.sb3_timesteps <= 0 or args.timeout <= 0:
        parser.exit(2, "error: --sb3-timesteps and --timeout must be positive\n")
    return args


def main():
    args = parse_args()
    if args.sb3_child:
        seed, out_file = args.sb3_child
        sb3_child(int(seed), out_file, args.sb3_timesteps)
        return
    check_ready(OUR_SCRIPT if "ours" in args.impl else None, sb3="sb3" in args.impl, hint=", or pass --impl sb3")

    runners = {"ours": run_ours, "sb3": run_sb3}
    info = machine(PACKAGES)  # taken now, so the load average is the one the runs start under
    warn_if_busy(info, "will slow both implementations")
    rows = []
    date = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    for seed in args.seeds:  # interleaved: seed 1 ours, seed 1 sb3, seed 2 ours, ...
        for name in args.impl:
            print(f"running {name} seed {seed} ...", flush=True)
            row = runners[name](seed, args)
            print(f"  {'solved' if row['solved'] else 'not solved'}, {fmt(row['steps'], ',')} steps, "
                  f"{row['wall_seconds']:.1f} s wall ({row['status']})", flush=True)
            rows.append(row)

    summary = summarize(rows, args.impl)
    print_report(rows, summary, info, date, args)
    if args.json:
        result = {"date": date, "machine": info, "target_return": TARGET_RETURN,
                  "sb3_timesteps": args.sb3_timesteps, "our_args": args.our_args,
                  "rows": rows, "summary": summary}
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
