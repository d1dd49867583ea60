"""Does `ppo_atari.py` learn Breakout in a short run? Its score after 100k steps against a random policy.

What it measures
----------------
For each seed (default 1 2 3), one training run of
`python ppo_atari.py --env BreakoutNoFrameskip-v4 --seed S --total-timesteps 100000 --run-dir <tmpdir>
[--our-args ...]` from the repository root, one after the other. The score is the script's own
`mean_return_100` from `<tmpdir>/summary.json`: the mean real game score (unclipped, all lives) of the
last 100 games finished during training, played by the stochastic training policy. The parent also
times each process from launch to exit.

The yardstick is a policy that presses uniformly random buttons, measured here in the very same
preprocessing: `ppo_atari.Game` (no-op starts, 4-frame repeat, FIRE after a reset and a lost life,
score over all lives) plays `--random-games` whole games (default 30) in this process, and the mean
and standard deviation of their `info["episode"]["return"]` are reported. (For reference, the DQN
paper (Mnih et al., 2015) quotes 1.7 for a random policy on Breakout.) 100k steps is early in training: the
published 10M-step runs reach ~400; what this shows is that learning has clearly started.

The output is a markdown table (seed, steps, mean_return_100, games finished, process wall seconds),
the mean over seeds, the random policy's mean ± std, and the machine and date. `--json PATH` writes
the same as JSON.

How to run it (from the repository root)
----------------------------------------
    pip install -r requirements.txt
    python benchmarks/atari_learning.py
    python benchmarks/atari_learning.py --seeds 1 2 3 4 5 --json atari_learning.json
    python benchmarks/atari_learning.py --steps 200000 --our-args "--num-workers 0"
"""

import argparse
import datetime
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

from harness import REPO_ROOT, check_ready, fmt, machine, machine_line, report_failure, run_our_script, warn_if_busy

OUR_SCRIPT = REPO_ROOT / "ppo_atari.py"
DEFAULT_ENV = "BreakoutNoFrameskip-v4"
PACKAGES = ("torch", "gymnasium", "ale-py")  # whose versions the report names


# --------------------------------------------------------------------------------------------------
# The random policy, in this process
# --------------------------------------------------------------------------------------------------


def random_policy(env_id, games, seed):
    """Play `games` whole games with uniformly random actions through ppo_atari's own Game, so that the
    preprocessing and the score are exactly those of the training runs. Returns the scores and lengths."""
    sys.path.insert(0, str(REPO_ROOT))
    import numpy as np
    from ppo_atari import Game

    game = Game(env_id, seed)  # one Game plays the games one after the other; it resets itself
    rng = np.random.default_rng(seed)
    num_actions = int(game.env.action_space.n)
    returns, lengths = [], []
    game.reset()
    while len(returns) < games:
        _, _, _, _, info = game.step(int(rng.integers(num_actions)))
        if "episode" in info:
            returns.append(float(info["episode"]["return"]))
            lengths.append(int(info["episode"]["length"]))
    game.close()
    return returns, lengths


# --------------------------------------------------------------------------------------------------
# Running and timing one subprocess
# --------------------------------------------------------------------------------------------------


def run_ours(seed, args):
    cmd, status, wall, tail, summary, _ = run_our_script(
        OUR_SCRIPT, ["--env", args.env, "--seed", str(seed), "--total-timesteps", str(args.steps)], args.our_args,
        seed, args.timeout)
    row = {
        "seed": seed,
        "status": status,
        "steps": summary.get("steps") if summary else None,
        "mean_return_100": summary.get("mean_return_100") if summary else None,
        "episodes": summary.get("episodes") if summary else None,
        "wall_seconds": wall,
        "train_seconds": summary.get("seconds") if summary else None,
        "steps_per_second": summary.get("steps_per_second") if summary else None,
        "command": shlex.join(cmd),
    }
    if status != "ok":
        report_failure("ours", seed, status, tail)
    return row


# --------------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------------


def mean_std(values):
    """(mean, sample standard deviation) of a list; the std is 0 for one value, both None for none."""
    if not values:
        return None, None
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def summarize(rows, random_returns, random_lengths):
    scores = [r["mean_return_100"] for r in rows if r["status"] == "ok" and r["mean_return_100"] is not None]
    mean, std = mean_std(scores)
    random_mean, random_std = mean_std(random_returns)
    return {
        "seeds_ok": len(scores),
        "seeds": len(rows),
        "mean_return_100_over_seeds": mean,
        "std_over_seeds": std,
        "random_games": len(random_returns),
        "random_mean_return": random_mean,
        "random_std_return": random_std,
        "random_mean_length": statistics.fmean(random_lengths) if random_lengths else None,
        "ours_minus_random": mean - random_mean if mean is not None and random_mean is not None else None,
    }


def print_report(rows, summary, info, date, args):
    print()
    print("| seed | env steps | mean_return_100 | games | process wall s |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        score = fmt(r["mean_return_100"], ".2f") if r["status"] == "ok" else f"– ({r['status']})"
        print(f"| {r['seed']} | {fmt(r['steps'], ',')} | {score} | {fmt(r['episodes'], ',')} "
              f"| {r['wall_seconds']:.1f} |")
    s = summary
    spread = f" ± {s['std_over_seeds']:.2f} (std over seeds)" if s["seeds_ok"] > 1 else ""
    print(f"| **mean** ({s['seeds_ok']}/{s['seeds']} seeds) | | "
          f"**{fmt(s['mean_return_100_over_seeds'], '.2f')}**{spread} | | |")
    print()
    print(f"random policy: {fmt(s['random_mean_return'], '.2f')} ± {fmt(s['random_std_return'], '.2f')} "
          f"(mean ± std over {s['random_games']} games of {fmt(s['random_mean_length'], '.0f')} steps on "
          f"average; uniformly random actions through ppo_atari.Game, seed {args.random_seed})")
    if s["ours_minus_random"] is not None:
        print(f"ours - random = {s['ours_minus_random']:+.2f} points per game")
    print()
    print(f"env {args.env}; mean_return_100 = summary.json's mean real score (all lives, unclipped) of the "
          "last 100 games finished in training, stochastic policy.")
    if args.our_args:
        print(f"our extra args: {args.our_args}")
    print(machine_line(info, PACKAGES))
    print(f"date: {date}")


# --------------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------------


def parse_args():
    parser = argparse.ArgumentParser(
        description="Score of ppo_atari.py on Breakout after a short run (mean of the last 100 training "
        "games), per seed, against a random policy in the same preprocessing.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--env", default=DEFAULT_ENV, help="Atari game id")
    parser.add_argument("--steps", type=int, default=100_000, help="env steps per training run")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3], help="seeds to run, one after the other")
    parser.add_argument("--our-args", default="",
                        help='extra arguments for ppo_atari.py, one string, e.g. "--num-workers 0"')
    parser.add_argument("--random-games", type=int, default=30, help="whole games played by the random policy")
    parser.add_argument("--random-seed", type=int, default=1, help="seed of the random policy's game and actions")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds allowed per training run")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    args = parser.parse_args()
    if args.steps <= 0 or args.timeout <= 0 or args.random_games <= 0:
        parser.exit(2, "error: --steps, --timeout and --random-games must be positive\n")
    return args


def main():
    args = parse_args()
    check_ready(OUR_SCRIPT)
    info = machine(PACKAGES)  # taken now, so the load average is the one the runs start under
    warn_if_busy(info, "slows the runs (the scores do not depend on it)")
    date = datetime.datetime.now().astimezone().isoformat(timespec="seconds")

    # The random policy first: it takes seconds, and a broken setup shows before the long runs.
    print(f"random policy: {args.random_games} games of {args.env} ...", flush=True)
    start = time.perf_counter()
    random_returns, random_lengths = random_policy(args.env, args.random_games, args.random_seed)
    random_mean, random_std = mean_std(random_returns)
    print(f"  {random_mean:.2f} ± {random_std:.2f} over {len(random_returns)} games "
          f"({time.perf_counter() - start:.1f} s)", flush=True)

    rows = []
    for seed in args.seeds:
        print(f"running ours seed {seed} ({args.steps:,} steps) ...", flush=True)
        row = run_ours(seed, args)
        print(f"  mean_return_100 {fmt(row['mean_return_100'], '.2f')} over the last "
              f"{min(row['episodes'] or 0, 100)} of {fmt(row['episodes'], ',')} games, "
              f"{fmt(row['steps'], ',')} steps, {row['wall_seconds']:.1f} s wall ({row['status']})", flush=True)
        rows.append(row)

    summary = summarize(rows, random_returns, random_lengths)
    print_report(rows, summary, info, date, args)
    if args.json:
        result = {"date": date, "machine": info, "env": args.env, "steps": args.steps, "our_args": args.our_args,
                  "rows": rows, "summary": summary,
                  "random_policy": {"seed": args.random_seed, "returns": random_returns, "lengths": random_lengths}}
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
