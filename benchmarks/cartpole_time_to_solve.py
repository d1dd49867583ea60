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
   bonus, learning rate `lin_1e-3`, clip range `lin_0.2`, 1e5 timesteps, CPU). It runs in a child
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
import importlib.metadata
import json
import os
import platform
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import deque
from pathlib import Path

# This file's top level imports only the standard library, so that the SB3 child process pays for
# Python startup and its own imports (SB3, torch, gymnasium) just like our script does.

REPO_ROOT = Path(__file__).resolve().parent.parent
OUR_SCRIPT = REPO_ROOT / "ppo_cartpole.py"
TARGET_RETURN = 475.0  # CartPole-v1's reward threshold, over 100 consecutive episodes
WINDOW = 100  # episodes in the moving mean
TAIL_LINES = 25  # lines of a failed run's output to show


# --------------------------------------------------------------------------------------------------
# The SB3 reference, run in a child process
# --------------------------------------------------------------------------------------------------


def linear_schedule(initial_value):
    """The zoo's `lin_<x>`: decays linearly from `initial_value` to 0 over the whole budget.

    SB3 calls a schedule with `progress_remaining`, which goes from 1 at the start to 0 at
    `total_timesteps`. A larger `--sb3-timesteps` therefore also stretches the decay.
    """

    def schedule(progress_remaining):
        return progress_remaining * initial_value

    return schedule


def sb3_child(seed, out_file, total_timesteps):
    """Train SB3 PPO with the zoo settings until solved or out of budget; write a small JSON."""
    from stable_baselines3 import PPO
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.env_util import make_vec_env

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
    env = make_vec_env("CartPole-v1", n_envs=8, seed=seed)
    model = PPO(
        "MlpPolicy",
        env,
        n_steps=32,
        batch_size=256,
        n_epochs=20,
        gamma=0.98,
        gae_lambda=0.8,
        ent_coef=0.0,
        learning_rate=linear_schedule(1e-3),
        clip_range=linear_schedule(0.2),
        device="cpu",
        seed=seed,
        verbose=0,
    )
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


def kill_group(proc):
    """Stop a child and everything it started (it leads its own process group)."""
    for sig, grace in ((signal.SIGINT, 10.0), (signal.SIGKILL, 5.0)):
        if proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, sig)  # SIGINT first: our script then still writes summary.json
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass


def timed_run(cmd, timeout, log_dir):
    """Run `cmd` from the repo root; return (returncode or None on timeout, wall seconds, output tail).

    stdout and stderr go to files, not pipes, so a chatty child can never block on a full pipe.
    The tail is the end of stderr (or of stdout, when stderr is empty), for the failure report.
    """
    stdout_path, stderr_path = Path(log_dir) / "stdout.txt", Path(log_dir) / "stderr.txt"
    with open(stdout_path, "wb") as out, open(stderr_path, "wb") as err:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=out, stderr=err, start_new_session=True)
        try:
            returncode = proc.wait(timeout=timeout)
            wall = time.perf_counter() - start
        except subprocess.TimeoutExpired:
            wall = time.perf_counter() - start
            returncode = None
        finally:
            kill_group(proc)  # on timeout or Ctrl-C of the benchmark; a no-op after a clean exit
    lines = stderr_path.read_text(errors="replace").splitlines()
    lines = lines or stdout_path.read_text(errors="replace").splitlines()
    return returncode, wall, "\n".join(lines[-TAIL_LINES:])


def report_failure(name, seed, status, tail):
    """Say what went wrong, in line with the progress output. A timeout's tail is only the
    traceback of our own SIGINT, so it is left out."""
    print(f"  !! {name} seed {seed}: {status}", flush=True)
    if tail and not status.startswith("timeout"):
        print("  output (tail):")
        for line in tail.splitlines():
            print(f"  | {line}")
        sys.stdout.flush()


def run_ours(seed, args):
    # The run dir holds only what our script writes; its captured output goes to a second folder.
    with tempfile.TemporaryDirectory(prefix=f"ours_seed{seed}_") as tmp, \
            tempfile.TemporaryDirectory(prefix=f"ours_seed{seed}_log_") as log_dir:
        cmd = [sys.executable, str(OUR_SCRIPT), "--seed", str(seed),
               "--target-return", str(TARGET_RETURN), "--run-dir", tmp]
        cmd += shlex.split(args.our_args)
        returncode, wall, tail = timed_run(cmd, args.timeout, log_dir)
        summary_path = Path(tmp) / "summary.json"
        summary = json.loads(summary_path.read_text()) if summary_path.exists() else None
    row = {"implementation": "ours", "seed": seed, "wall_seconds": wall, "command": shlex.join(cmd)}
    if returncode is None:
        status = f"timeout after {args.timeout:g} s"
    elif returncode != 0:
        status = f"crashed (exit status {returncode})"
    elif summary is None:
        status = "no summary.json written"
    else:
        status = "ok"
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


def machine():
    def version(package):
        try:
            return importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    cpu = platform.processor()
    if not cpu or cpu == platform.machine():  # Linux often says only "x86_64" here
        try:
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
        except OSError:
            pass
    return {
        "cpu": cpu or platform.machine(),
        "nproc": os.cpu_count(),
        "platform": platform.platform(),
        "load_average_at_start": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        "python": platform.python_version(),
        "torch": version("torch"),
        "gymnasium": version("gymnasium"),
        "stable_baselines3": version("stable-baselines3"),
    }


def fmt(value, spec):
    return "–" if value is None else format(value, spec)


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
    print(f"machine: {info['cpu']}, nproc {info['nproc']}, {info['platform']}, python {info['python']}, "
          f"torch {info['torch']}, gymnasium {info['gymnasium']}, "
          f"stable-baselines3 {info['stable_baselines3']}, "
          f"load average at start {info['load_average_at_start']}")
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
    if "ours" in args.impl and not OUR_SCRIPT.exists():
        print(f"error: {OUR_SCRIPT} not found; run from a checkout that has it, or pass --impl sb3",
              file=sys.stderr)
        sys.exit(2)
    if "sb3" in args.impl:
        try:
            importlib.metadata.version("stable-baselines3")
        except importlib.metadata.PackageNotFoundError:
            print("error: stable-baselines3 is not installed; "
                  "pip install -r benchmarks/requirements.txt", file=sys.stderr)
            sys.exit(2)

    runners = {"ours": run_ours, "sb3": run_sb3}
    info = machine()  # taken now, so the load average is the one the runs start under
    if info["load_average_at_start"] and info["load_average_at_start"] > 0.5:
        print(f"warning: 1-minute load average is {info['load_average_at_start']} before starting; "
              "other work on this machine will slow both implementations", flush=True)
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
