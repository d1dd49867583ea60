r"""Does `ppo_continuous.py` learn Pendulum-v1 as well as Stable-Baselines3, and how much sooner?

What it measures
----------------
1. Learning curves: the return of every episode finished in training, against environment steps
   (all envs), for each seed (default 1 2 3) with a budget of `--steps` (default 200,000), for
   four variants:
   - `gym`: `python ppo_continuous.py --seed S --total-timesteps N` (its defaults: gymnasium's
     Pendulum-v1 in Games);
   - `torch`: the same with `--env-backend torch` (Pendulum written in torch; the same 16 envs x
     64 steps since 2026-11-27, 64 x 16 before);
   - `sb3`: Stable-Baselines3 PPO with rl-baselines3-zoo's tuned Pendulum-v1 hyperparameters
     (`MlpPolicy`, 4 envs x 1024 steps, batch 64, 10 epochs, gamma 0.9, GAE lambda 0.95,
     learning rate 1e-3, clip range 0.2, no entropy bonus, gSDE resampled every 4 steps; the zoo
     trains it for 1e5 steps, here for the same N as ours; nothing in it is annealed), CPU, in a
     child process of this same file (`--_sb3-child`);
   - `random`: uniformly random torques in `gymnasium.make("Pendulum-v1")`, `--random-episodes`
     episodes (default 100).
   Logs, runs.json, table.md and the plot (`benchmarks/plots/continuous_pendulum.png`) as in
   cartpole_learning.py (harness.py's), with -200 as the target line.
2. Time to -200 (`--time-runs`, on by default): from launch to the moment the mean return of the
   last 100 finished training episodes reaches -200, seeds as above, side by side:
   - ours: the issue's exact commands, which stop at the target:
     `python ppo_continuous.py --seed S --target-return -200 --total-timesteps 200000` and
     `python ppo_continuous.py --env-backend torch --seed S --target-return -200`; the time is the
     process's wall time (launch to exit, imports and the last checkpoint included), and its
     start-up is the wall time minus summary.json's `seconds` (imports, env creation, the spec
     check of the torch engine);
   - SB3: read from its curve run above: from the child's launch to the end of the episode at which
     its 100-episode mean first reached -200 (its imports included, its later training not).
   The table (`time.md`) gives each seed's seconds and steps, the median, and SB3's median over
   ours.

The runs go one after the other (seed 1: gym, torch, sb3; seed 2: ...), so that background load
hits all alike. Run nothing else on the machine meanwhile; the table names its CPU.

How to run it (from the repository root)
----------------------------------------
    pip install -r requirements.txt -r benchmarks/requirements.txt
    python benchmarks/continuous_pendulum.py                  # curves and times; seeds 1 2 3
    python benchmarks/continuous_pendulum.py --plot-only      # table and plot from the kept logs
    python benchmarks/continuous_pendulum.py --steps 20000 --seeds 1 --random-episodes 5 \
        --results-dir /tmp/continuous_pendulum_test      # a quick check of the benchmark
"""

import argparse
import datetime
import shlex
import statistics
import time

from harness import (REPO_ROOT, Learning, check_learning_arguments, check_ready, fmt,
                     learning_arguments, learning_report, load_runs, machine, machine_line,
                     random_episodes, run_learning, run_our_script, run_ours_logged, run_sb3_logged,
                     report_failure, save_run, sb3_learn_and_record)

ENV = "Pendulum-v1"
TARGET_RETURN = -200
PACKAGES = ("torch", "gymnasium", "stable-baselines3", "numpy")
BENCH = Learning(
    name="continuous_pendulum",
    script=REPO_ROOT / "ppo_continuous.py",
    variants=("gym", "torch", "sb3", "random"),
    labels={"gym": "ours, ppo_continuous.py (defaults)",
            "torch": "ours, --env-backend torch (defaults)",
            "sb3": "SB3 PPO (rl-zoo tuned hyperparameters, gSDE)", "random": "random policy"},
    colors={"gym": "tab:blue", "torch": "tab:purple", "sb3": "tab:green", "random": "tab:gray"},
    packages=PACKAGES,
    unit="episode",
    score="return",
    x_label="environment steps (all envs)",
    y_label="episode return (mean of the last 100 training episodes)",
    note="(ours anneals its learning rate over it; SB3's zoo settings anneal nothing). Return: the "
    "mean return of each run's last 100 training episodes at its end (stochastic policy); std over "
    "seeds; ratio = variant mean / SB3 mean (returns are negative: below 1 is better). First step "
    f"at ≥ {TARGET_RETURN:g}: the first step at which the mean return of the run's last 100 "
    f"finished episodes reached {TARGET_RETURN:g} (– if never). steps/s: steady training speed "
    "(from the end of the first update), mean over seeds. Random policy: uniform torques in "
    f"gymnasium's {ENV}.",
    target=TARGET_RETURN,
    legend_loc="lower right",
)
# The issue's commands for the time to the target: (variant, arguments after --seed S).
TIME_COMMANDS = {
    "gym": ["--target-return", str(TARGET_RETURN), "--total-timesteps", "200000"],
    "torch": ["--env-backend", "torch", "--target-return", str(TARGET_RETURN)],
}


# --------------------------------------------------------------------------------------------------
# The SB3 reference, run in a child process; the random policy, in this process
# --------------------------------------------------------------------------------------------------


def sb3_child(seed, out_file, total_timesteps):
    """Train SB3 PPO with the zoo's Pendulum-v1 settings; write every finished episode (with the
    time it ended) and the timings as JSON."""
    setup_start = time.perf_counter()
    from stable_baselines3 import PPO
    from stable_baselines3.common.env_util import make_vec_env

    env = make_vec_env(ENV, n_envs=4, seed=seed)
    model = PPO("MlpPolicy", env, n_steps=1024, batch_size=64, n_epochs=10, gamma=0.9,
                gae_lambda=0.95, learning_rate=1e-3, clip_range=0.2, ent_coef=0.0, use_sde=True,
                sde_sample_freq=4, device="cpu", seed=seed, verbose=0)
    sb3_learn_and_record(model, env, total_timesteps, out_file, setup_start)


def play_random(args):
    """`args.random_count` episodes of uniformly random torques: (returns, lengths, how)."""
    return random_episodes(ENV, args.random_count, args.random_seed)


def run_variant(variant, seed, args):
    """One curve run: (run record, episodes, output tail)."""
    if variant == "sb3":
        return run_sb3_logged(__file__, seed, ["--steps", str(args.steps)], args,
                              target=TARGET_RETURN)
    script_args = ["--seed", str(seed), "--total-timesteps", str(args.steps)]
    if variant == "torch":
        script_args += ["--env-backend", "torch"]
    return run_ours_logged(BENCH.script, script_args, f"{variant}_seed{seed}", args)


# --------------------------------------------------------------------------------------------------
# Time to the target
# --------------------------------------------------------------------------------------------------


def time_runs(args):
    """Run the issue's commands of ours to the target, seed after seed; keep each in runs.json."""
    info = machine(PACKAGES)
    for seed in args.seeds:
        for variant, extra in TIME_COMMANDS.items():
            key = f"time_{variant}_seed{seed}"
            print(f"time to {TARGET_RETURN:g}: {variant} seed {seed} ...", flush=True)
            date = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
            cmd, status, wall, tail, summary, _ = run_our_script(
                BENCH.script, ["--seed", str(seed), *extra], args.our_args, seed, args.timeout)
            if status == "ok" and summary["solved_step"] is None:
                status = f"did not reach {TARGET_RETURN:g} ({summary['steps']:,} steps)"
            record = {"variant": variant, "seed": seed, "env": ENV, "date": date,
                      "command": shlex.join(cmd), "status": status, "wall_seconds": round(wall, 2),
                      "machine_line": machine_line(info, PACKAGES)}
            if summary:
                record.update(steps=summary["steps"], target_step=summary["solved_step"],
                              training_seconds=summary["seconds"],
                              startup_seconds=round(wall - summary["seconds"], 2))
            save_run(args.results_dir, key, record)
            if status != "ok":
                report_failure(variant, seed, status, None if summary else tail)
            print(f"  {wall:.1f} s from launch to exit, "
                  f"target at step {fmt(record.get('target_step'), ',')}", flush=True)


def time_table(args):
    """The markdown table of the times to the target, from runs.json."""
    runs = load_runs(args.results_dir)
    rows = {"gym": "ours (gym engine): `" + " ".join(["--seed S", *TIME_COMMANDS["gym"]]) + "`",
            "torch": "ours (torch engine): `" + " ".join(["--seed S", *TIME_COMMANDS["torch"]])
                     + "`",
            "sb3": "SB3 PPO, rl-zoo settings (from its curve run)"}
    medians = {}
    lines = ["| variant |" + "".join(f" seed {s}: s (steps) |" for s in args.seeds)
             + " median s | start-up s (median) | SB3 median / this median |",
             "| --- |" + " ---: |" * (len(args.seeds) + 3)]
    cells_of = {}
    for variant in rows:
        seconds, steps, startups = {}, {}, []
        for seed in args.seeds:
            if variant == "sb3":
                record = runs.get(f"sb3_seed{seed}", {})
                seconds[seed], steps[seed] = record.get("target_seconds"), record.get("target_step")
                if record.get("setup_seconds") is not None:
                    startups.append(record["setup_seconds"])
            else:
                record = runs.get(f"time_{variant}_seed{seed}", {})
                if record.get("status") == "ok":
                    seconds[seed], steps[seed] = record["wall_seconds"], record["target_step"]
                    startups.append(record["startup_seconds"])
        reached = [x for x in seconds.values() if x is not None]
        medians[variant] = statistics.median(reached) if len(reached) == len(args.seeds) else None
        startup = statistics.median(startups) if startups else None
        cells_of[variant] = ("".join(f" {fmt(seconds.get(s), '.1f')} ({fmt(steps.get(s), ',')}) |"
                                     for s in args.seeds)
                             + f" {fmt(medians[variant], '.1f')} | {fmt(startup, '.1f')} |")
    for variant, label in rows.items():
        ratio = (medians["sb3"] / medians[variant]
                 if medians.get("sb3") and medians[variant] else None)
        lines.append(f"| {label} |{cells_of[variant]} {fmt(ratio, '.2f')} |")
    lines += ["", f"{ENV}: seconds from launch until the mean return of the last 100 finished "
              f"training episodes reached {TARGET_RETURN:g} (– if never; the median needs every "
              "seed), with the step it happened at. Ours: the process's whole wall time (it stops "
              "there); start-up: wall time minus summary.json's seconds. SB3: its child's launch "
              "to the end of that episode; start-up: its imports and set-up before learn()."]
    shown = [runs[key] for key in runs if key.startswith(("time_", "sb3_"))]
    for line in sorted({r["machine_line"] for r in shown if "machine_line" in r}):
        lines += ["", line]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------------


def parse_args():
    parser = argparse.ArgumentParser(
        description="Pendulum-v1 over seeds: ppo_continuous.py (gym and torch engines, defaults) "
        "against Stable-Baselines3 PPO with the rl-zoo's tuned settings and a random policy: "
        "learning curves, and the time from launch to a 100-episode mean of -200.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--time-runs", action=argparse.BooleanOptionalAction, default=True,
                        help="also run our commands to the target and write time.md")
    learning_arguments(parser, BENCH, steps=200_000, timeout=1800.0, plot_every=2000,
                       plot_help="the PNG (default: benchmarks/plots/continuous_pendulum.png for "
                       "the default results dir, else inside the results dir)")
    args = parser.parse_args()
    args.env = ENV
    check_learning_arguments(parser, args, BENCH, "continuous_pendulum.png")
    return args


def main():
    args = parse_args()
    if args.sb3_child:
        seed, out_file = args.sb3_child
        sb3_child(int(seed), out_file, args.steps)
        return
    if args.plot_only:
        learning_report(BENCH, args)
    else:
        check_ready(BENCH.script, sb3="sb3" in args.variants)
        run_learning(BENCH, args, run_variant, play_random)  # ends with the curves' report
        if args.time_runs:
            time_runs(args)
    text = time_table(args)
    (args.results_dir / "time.md").write_text(text)
    print("\n" + text, end="")


if __name__ == "__main__":
    main()
