r"""Does a Pendulum policy trained across many gravities hold up better away from g = 10?

What it measures
----------------
For each seed (default 1 2 3), two training runs of `ppo_continuous.py --env-backend torch` with
the same budget (`--steps`, default 200,000: the script's default, by which gymnasium's physics
reaches a 100-episode mean of about -200):
- `fixed`: `python ppo_continuous.py --env-backend torch --seed S --total-timesteps N`, gymnasium's
  physics (g = 10 in every game);
- `drawn`: the same with `--physics g=6:14`: each game's gravity drawn from U(6, 14) at each of
  its resets (domain randomisation), the rest gymnasium's.
Then each run's final policy plays `--eval-episodes` (default 100) episodes at each gravity of
`--eval-g` (default 6 10 14): `--eval RUN --physics g=G`, through `Main(Config(...))` in this
process, which plays them on torch Pendulums side by side, one episode each, with sampled actions
and the run's seed (so both variants of a seed start from the same states).

The table gives, per variant and gravity, the mean ± standard deviation over seeds of each run's
100-episode mean return, the paired difference drawn - fixed (same seed, same starting states),
and each run's last 100 training episodes. Results: runs.json and table.md in
benchmarks/results/pendulum_physics/; the runs' folders (checkpoints, logs) in
runs/pendulum_physics/, which git ignores.

How to run it (from the repository root)
----------------------------------------
    python benchmarks/pendulum_physics.py               # seeds 1 2 3, 200k steps each
    python benchmarks/pendulum_physics.py --table-only  # the table again, from runs.json
    python benchmarks/pendulum_physics.py --steps 10240 --seeds 1 --eval-episodes 5 \
        --results-dir /tmp/pendulum_physics_test        # a quick check of the benchmark
"""

import argparse
import datetime
import json
import shlex
import sys
import tempfile
from pathlib import Path

from harness import (REPO_ROOT, display, fmt, load_runs, machine, machine_line, mean_std,
                     report_failure, run_status, save_run, timed_run)

SCRIPT = REPO_ROOT / "ppo_continuous.py"
PACKAGES = ("torch", "gymnasium", "numpy")
VARIANTS = {"fixed": "", "drawn": "g=6:14"}  # variant: its --physics
LABELS = {"fixed": "g fixed at 10 (gymnasium's physics)",
          "drawn": "g drawn from U(6, 14) per game at each reset (`--physics g=6:14`)"}


def train(variant, seed, args):
    """One training run through the command line: its record (command, status, summary's)."""
    run_dir = args.runs_dir / f"{variant}_seed{seed}"
    cmd = [sys.executable, display(SCRIPT), "--env-backend", "torch", "--seed", str(seed),
           "--total-timesteps", str(args.steps), "--run-dir", display(run_dir), "--overwrite"]
    if VARIANTS[variant]:
        cmd += ["--physics", VARIANTS[variant]]
    with tempfile.TemporaryDirectory(prefix="pendulum_physics_log_") as log_dir:
        returncode, _, tail = timed_run(cmd, args.timeout, log_dir)
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else None
    status = run_status(returncode, summary, args.timeout)
    if status != "ok":
        report_failure(variant, seed, status, tail)
    return {"variant": variant, "seed": seed, "physics": VARIANTS[variant], "status": status,
            "command": "python " + shlex.join(cmd[1:]), "run_dir": display(run_dir),
            "steps": summary and summary["steps"],
            "train_mean_return_100": summary and summary["mean_return_100"]}


def evaluate(run_dir, g, episodes):
    """`--eval RUN --physics g=G --eval-episodes N`, in this process: (mean, std) of the returns."""
    sys.path.insert(0, str(REPO_ROOT))
    import ppo_continuous as pc

    result = pc.Main(pc.Config(eval=str(REPO_ROOT / run_dir), physics=f"g={g:g}",
                               eval_episodes=episodes)).run()
    return {"mean_return": result["mean_return"], "std_return": result["std_return"],
            "episodes": result["episodes"]}


def table(args):
    """The markdown table from runs.json."""
    runs = load_runs(args.results_dir)
    means = {(variant, seed, g): runs.get(f"{variant}_seed{seed}", {}).get("eval", {})
             .get(f"{g:g}", {}).get("mean_return")
             for variant in VARIANTS for seed in args.seeds for g in args.eval_g}
    keys = [f"{variant}_seed{seed}" for variant in VARIANTS for seed in args.seeds]
    steps = sorted({runs[key]["steps"] for key in keys if runs.get(key, {}).get("steps")})
    gravities = "".join(f" g = {g:g} |" for g in args.eval_g)
    lines = [f"| training ({' or '.join(f'{n:,}' for n in steps)} steps, seeds "
             f"{', '.join(map(str, args.seeds))}) |{gravities} training's last 100 episodes |",
             "| --- |" + " ---: |" * (len(args.eval_g) + 1)]

    def cell(values):
        if None in values or not values:
            return " – |"
        mean, std = mean_std(values)
        return f" {mean:.1f} ± {std:.1f} |"

    for variant, label in LABELS.items():
        trained = [runs.get(f"{variant}_seed{seed}", {}).get("train_mean_return_100")
                   for seed in args.seeds]
        lines.append(f"| {label} |" + "".join(
            cell([means[variant, seed, g] for seed in args.seeds]) for g in args.eval_g)
            + cell(trained))
    differences = "".join(cell([
        None if None in (means["drawn", seed, g], means["fixed", seed, g])
        else means["drawn", seed, g] - means["fixed", seed, g] for seed in args.seeds])
        for g in args.eval_g)
    lines.append(f"| drawn - fixed, paired by seed |{differences} |")
    lines += ["", "Each cell: the mean ± standard deviation over seeds of one number per run. At "
              f"g = G: the mean return of {args.eval_episodes} episodes of `ppo_continuous.py "
              "--eval RUN --physics g=G` (torch Pendulums, one episode each, sampled actions, "
              "the run's seed: the same starting states for both variants of a seed). Training: "
              "the mean return of the run's last 100 training episodes (the drawn variant's at "
              "mixed gravities). Per run:", ""]
    for key in (key for key in keys if key in runs):
        record = runs[key]
        at = ", ".join(f"g {g:g}: " + fmt(means[record["variant"], record["seed"], g], ".1f")
                       for g in args.eval_g)
        lines.append(f"- {key}: {at}; training {fmt(record['train_mean_return_100'], '.1f')} "
                     f"({record['status']}; `{record['command']}`)")
    for line in sorted({runs[key]["machine_line"] for key in keys if key in runs}):
        lines += ["", line]
    return "\n".join(lines) + "\n"


def parse_args():
    parser = argparse.ArgumentParser(
        description="ppo_continuous.py's torch Pendulum trained with g fixed at 10 and with g "
        "drawn from U(6, 14), the same budget, seeds over; each evaluated at several gravities.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--steps", type=int, default=200_000, help="training steps of each run")
    parser.add_argument("--eval-g", type=float, nargs="+", default=[6.0, 10.0, 14.0],
                        help="the gravities each policy is evaluated at")
    parser.add_argument("--eval-episodes", type=int, default=100, help="episodes at each gravity")
    parser.add_argument("--timeout", type=float, default=1800.0,
                        help="seconds a training run may take")
    parser.add_argument("--results-dir", type=Path,
                        default=REPO_ROOT / "benchmarks" / "results" / "pendulum_physics")
    parser.add_argument("--runs-dir", type=Path, default=REPO_ROOT / "runs" / "pendulum_physics",
                        help="where the training runs' folders go")
    parser.add_argument("--table-only", action="store_true", help="the table from runs.json")
    return parser.parse_args()


def main():
    args = parse_args()
    args.results_dir.mkdir(parents=True, exist_ok=True)
    if not args.table_only:
        info = machine(PACKAGES)
        for seed in args.seeds:
            for variant in VARIANTS:
                print(f"{variant} seed {seed}: training {args.steps:,} steps ...", flush=True)
                date = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
                record = train(variant, seed, args)
                if record["status"] == "ok":
                    record["eval"] = {f"{g:g}": evaluate(record["run_dir"], g, args.eval_episodes)
                                      for g in args.eval_g}
                record.update(date=date, machine_line=machine_line(info, PACKAGES))
                save_run(args.results_dir, f"{variant}_seed{seed}", record)
    text = table(args)
    (args.results_dir / "table.md").write_text(text)
    print("\n" + text, end="")


if __name__ == "__main__":
    main()
