r"""Do `ppo_cartpole.py` and `ppo_continuous.py` learn the envs they are for beyond their default
one, with nothing but `--env`? Learning curves over seeds against Stable-Baselines3 PPO with its
library defaults (issue 40). `--script` picks the script and its study (`STUDIES`): its envs,
budgets, targets, search candidates, results folder and plot.

What it measures
----------------
`--mode learning` (the default): for each of `--envs` (default: the study's; ppo_cartpole.py:
LunarLander-v3, Acrobot-v1 500,000 steps, MountainCar-v0 1,000,000; ppo_continuous.py:
LunarLanderContinuous-v3 500,000, BipedalWalker-v3 1,000,000; `--steps` sets one for all) and seed
(default 1 2 3), the return of every episode finished in training against environment steps (summed
over all envs), for three variants:

1. `ours`: `python SCRIPT --env E --seed S --total-timesteps N --run-dir <tmp>`, nothing else: the
   script's preset for E where it has one, else its general setting. Each finished episode's
   (step, return, length) is read from the run dir's TensorBoard events (harness.py's
   `run_ours_logged`).
2. `sb3`: Stable-Baselines3 PPO with its library defaults, nothing tuned, as a new user would run
   it: `PPO("MlpPolicy", make_vec_env(E, n_envs=1, seed=S), seed=S, device="cpu")` (1 env x 2048
   steps, minibatches of 64, 10 epochs, Adam 3e-4 constant, gamma 0.99, GAE lambda 0.95, clip 0.2,
   no entropy bonus, separate 64-64 tanh MLPs, no normalisation; for Box actions a
   state-independent log std from 0),
   `learn(total_timesteps=N)`, in a child process of this same file (`--_sb3-child`); a callback
   records each finished episode (harness.py's `sb3_learn_and_record`).
3. `random`: `--random-episodes` episodes (default 100) of `action_space.sample()` in
   `gymnasium.make(E)` (harness.py's `random_episodes`).

The runs of an env go one after another, interleaved by seed (seed 1: ours, sb3; seed 2: ...).
Steps and returns do not depend on the machine's load; seconds and steps/s do, so they are
results only from a machine that ran nothing else.

`--mode search`: the search for the general setting and the presets. Each of `--candidates` (named
sets of flags, the study's `candidates` below; `--no-preset` is added to each, so that the default
env runs them too) on each of
`--envs` and `--seeds`, ours only; per run the mean return of the last 100 episodes at the end, the
best such mean during the run, and the first step at which it reached the env's target.

Outputs (in `--results-dir`, default benchmarks/results/cartpole_envs/ or continuous_envs/)
-----------------------------------------------------------------------------------------
- `<env>/`: harness.py's kept logs of `--mode learning` (`<variant>_seed<S>.csv`, `random.csv`,
  `runs.json`, `table.md`: each seed's 100-episode mean at the end, mean ± std over seeds, the first
  step at the env's target; `learning.png`, harness.py's plot of the env alone) and `curves.json`:
  per run, the budget, the steps run, the final 100-episode mean, the first step at the target and
  the curve, [step, mean return of the last 100 episodes] every `--plot-every` steps from the run's
  10th episode on; the random policy's mean and std.
- `search.json`: every search run, keyed `<env> <candidate> seed<S>` (its flags, steps, final and
  best 100-episode mean, first step at the target, date, machine); `search.md`: the table of all.
- The plot (`--plot`, default benchmarks/plots/cartpole_envs.png or continuous_envs.png): a panel
  per env; per variant the mean over seeds of the curves as a line and the min–max over seeds as a
  band; the random policy's mean ± one standard error; the env's target dotted.

How to run it (from the repository root)
----------------------------------------
    pip install -r requirements.txt -r benchmarks/requirements.txt
    python benchmarks/beyond_default_env.py                # ppo_cartpole.py: ours, SB3, random
    python benchmarks/beyond_default_env.py --script ppo_continuous   # LunarLanderContinuous, ...
    python benchmarks/beyond_default_env.py --envs LunarLander-v3 --variants sb3   # SB3 alone
    python benchmarks/beyond_default_env.py --plot-only    # tables, curves.json, plot from the logs
    python benchmarks/beyond_default_env.py --mode search --envs LunarLander-v3 --seeds 1 \
        --candidates cleanrl sb3                           # two candidates of the search
    python benchmarks/beyond_default_env.py --envs Acrobot-v1 --steps 20000 --seeds 1 \
        --random-episodes 5 --results-dir /tmp/cartpole_envs_test   # a quick check
"""

import argparse
import datetime
import json
import math
import shlex
import statistics
import time
from pathlib import Path
from typing import NamedTuple

from harness import (MIN_EPISODES, REPO_ROOT, WINDOW, Learning, check_ready, curve, display,
                     first_reaching, fmt, learning_table, load_report, machine, machine_line,
                     mean_std, random_episodes, run_learning, run_ours_logged, run_sb3_logged,
                     sb3_learn_and_record, warn_if_busy)

# This file's top level imports only the standard library (and harness.py, which does too), so that
# the SB3 child pays for its own imports just like our script does.


class Study(NamedTuple):
    """One script's study: where it runs, what it runs on, what it tries."""

    script: Path
    results: Path  # the default --results-dir
    plot: Path  # the default --plot
    packages: tuple  # whose versions the tables name
    budgets: dict  # env id -> steps a run (the default --envs: its keys)
    targets: dict  # env id -> the line the issue asks of it (None: SB3's own final return)
    candidates: dict  # name -> the script's settings, every preset field given
    label: str  # ours, in the tables and plots


# ppo_cartpole.py's candidates for its general setting (every field of its presets given, so that
# a candidate does not depend on the script's own table).
CARTPOLE = dict(learning_rate=8e-3, gamma=0.98, num_minibatches=2, update_epochs=8, ent_coef=0.0,
                normalize_observations=False, num_envs=64, num_steps=32)
CLEANRL = dict(learning_rate=2.5e-4, gamma=0.99, num_minibatches=4, update_epochs=4,
               ent_coef=0.01, normalize_observations=False, num_envs=4, num_steps=128)
SB3 = dict(learning_rate=3e-4, gamma=0.99, num_minibatches=32, update_epochs=10, ent_coef=0.0,
           normalize_observations=False, num_envs=1, num_steps=2048, anneal_lr=False)
ENVS16 = dict(learning_rate=3e-4, gamma=0.99, num_minibatches=8, update_epochs=10, ent_coef=0.0,
              normalize_observations=True, num_envs=16, num_steps=128)
# ppo_continuous.py's, for its general setting and presets.
PENDULUM = dict(learning_rate=1e-3, gamma=0.97, num_minibatches=4, clip_value_loss=False,
                num_envs=16, num_steps=64)
CLEANRL_MUJOCO = dict(learning_rate=3e-4, gamma=0.99, num_minibatches=32, clip_value_loss=True,
                      num_envs=1, num_steps=2048)
CONTINUOUS_ENVS16 = {**CLEANRL_MUJOCO, "num_envs": 16, "num_steps": 128}
STUDIES = {
    "ppo_cartpole": Study(
        script=REPO_ROOT / "ppo_cartpole.py",
        results=REPO_ROOT / "benchmarks" / "results" / "cartpole_envs",
        plot=REPO_ROOT / "benchmarks" / "plots" / "cartpole_envs.png",
        packages=("torch", "gymnasium", "box2d", "stable-baselines3", "numpy"),
        budgets={"LunarLander-v3": 500_000, "Acrobot-v1": 500_000, "MountainCar-v0": 1_000_000},
        targets={"LunarLander-v3": None, "Acrobot-v1": -100.0, "MountainCar-v0": -150.0,
                 "CartPole-v1": 475.0},
        candidates={
            "cartpole": CARTPOLE,  # CartPole-v1's preset, the defaults before issue 40
            "cleanrl": CLEANRL,  # CleanRL's ppo.py (classic control)
            "cleanrl_norm": {**CLEANRL, "normalize_observations": True},
            "sb3": SB3,  # SB3's defaults (1 env x 2048 steps, minibatches of 64, no annealing)
            "sb3_norm": {**SB3, "normalize_observations": True},
            "envs16": ENVS16,  # in between: SB3's update on 16 envs x 128 steps
            "envs16_ent": {**ENVS16, "ent_coef": 0.01},
            "envs16_mb64": {**ENVS16, "num_minibatches": 32},  # SB3's gradient steps per sample
            "envs16_mb128": {**ENVS16, "num_minibatches": 16},
            "envs16_lr1e3": {**ENVS16, "learning_rate": 1e-3},
            "envs16_ent_mb64": {**ENVS16, "ent_coef": 0.01, "num_minibatches": 32},
            "envs16_ent_lr1e3": {**ENVS16, "ent_coef": 0.01, "learning_rate": 1e-3}},
        label="ours, ppo_cartpole.py --env only (general setting)"),
    "ppo_continuous": Study(
        script=REPO_ROOT / "ppo_continuous.py",
        results=REPO_ROOT / "benchmarks" / "results" / "continuous_envs",
        plot=REPO_ROOT / "benchmarks" / "plots" / "continuous_envs.png",
        packages=("torch", "gymnasium", "box2d", "mujoco", "stable-baselines3", "numpy"),
        budgets={"LunarLanderContinuous-v3": 500_000, "BipedalWalker-v3": 1_000_000},
        targets={"LunarLanderContinuous-v3": None, "BipedalWalker-v3": None,
                 "Pendulum-v1": -200.0},
        candidates={
            "pendulum": PENDULUM,  # Pendulum-v1's preset, the defaults before issue 40
            "cleanrl_mujoco": CLEANRL_MUJOCO,  # CleanRL's ppo_continuous_action.py (MuJoCo)
            "envs16": CONTINUOUS_ENVS16,  # the same update on 16 envs x 128 steps
            "envs16_noclip": {**CONTINUOUS_ENVS16, "clip_value_loss": False},
            "envs8": {**CLEANRL_MUJOCO, "num_envs": 8, "num_steps": 256},
            "cleanrl_mujoco_ent": {**CLEANRL_MUJOCO, "ent_coef": 0.01},
            "cleanrl_mujoco_g999": {**CLEANRL_MUJOCO, "gamma": 0.999},  # a landing: far ahead
            "cleanrl_mujoco_noclip": {**CLEANRL_MUJOCO, "clip_value_loss": False}},  # SB3's loss
        label="ours, ppo_continuous.py --env only (its preset, else the general setting)"),
}


def flags_of(settings):
    """The script's flags for a dict of its Config fields."""
    return [word for name, value in settings.items() for word in (
        [f"--{'' if value else 'no-'}{name.replace('_', '-')}"] if isinstance(value, bool)
        else [f"--{name.replace('_', '-')}", str(value)])]


def sb3_child(env_id, seed, out_file, total_timesteps):
    """SB3 PPO with its library defaults on one env of `env_id`; every finished episode to JSON."""
    setup_start = time.perf_counter()
    from stable_baselines3 import PPO
    from stable_baselines3.common.env_util import make_vec_env

    env = make_vec_env(env_id, n_envs=1, seed=seed)
    model = PPO("MlpPolicy", env, seed=seed, device="cpu", verbose=0)
    sb3_learn_and_record(model, env, total_timesteps, out_file, setup_start)


def bench_for(study, env_id):
    """harness.py's description of one env's learning benchmark."""
    target = study.targets.get(env_id)
    return Learning(
        name=f"{study.results.name}/{env_id}", script=study.script,
        variants=("ours", "sb3", "random"),
        labels={"ours": study.label,
                "sb3": "SB3 PPO (library defaults)", "random": "random policy"},
        colors={"ours": "tab:blue", "sb3": "tab:green", "random": "tab:gray"},
        packages=study.packages, unit="episode", score="return",
        x_label="environment steps (all envs)",
        y_label=f"mean return of the last {WINDOW} training episodes",
        note=(f"(ours anneals its learning rate over it, SB3 keeps 3e-4). Return: the mean return "
              f"of each run's last {WINDOW} training episodes at its end (stochastic policy); std "
              "over seeds; ratio = variant mean / SB3 mean (meaningless for negative returns). "
              "steps/s: steady speed (from the end of the first update), mean over seeds, on a "
              "machine that may have run other work. Random policy: action_space.sample()."),
        target=target, legend_loc="lower right")


def env_arguments(args, env_id):
    """`args` for harness.py's functions on one env: its folder, budget, variants and plot."""
    env_args = argparse.Namespace(**vars(args))
    env_args.env, env_args.results_dir = env_id, args.results_dir / env_id
    env_args.steps = args.steps or args.study.budgets.get(env_id, 500_000)
    env_args.plot = env_args.results_dir / "learning.png"  # harness.py's own plot of the env
    return env_args


def learning(args):
    """Per env: ours, SB3 and the random policy over the seeds (harness.py's `run_learning`)."""
    for env_id in args.envs:
        bench, env_args = bench_for(args.study, env_id), env_arguments(args, env_id)

        def run_variant(variant, seed, run_args, env_id=env_id):
            if variant == "sb3":
                return run_sb3_logged(__file__, seed, ["--env", env_id, "--steps",
                                                       str(run_args.steps)], run_args)
            script_args = ["--env", env_id, "--seed", str(seed), "--total-timesteps",
                           str(run_args.steps)]
            return run_ours_logged(args.study.script, script_args, f"{variant}_seed{seed}",
                                   run_args)

        def play_random(run_args, env_id=env_id):
            return random_episodes(env_id, run_args.random_count, run_args.random_seed)

        run_learning(bench, env_args, run_variant, play_random)
        write_curves(bench, env_args)
    report(args)


def write_curves(bench, env_args):
    """`<env>/curves.json` from the kept logs: per run its final mean and its curve."""
    _, trained, random_returns, budgets, _ = load_report(bench, env_args)
    runs = {}
    for variant, seeds in trained.items():
        for seed, (record, episodes) in seeds.items():
            grid = sorted(set(range(env_args.plot_every, record["steps"] + 1,
                                    env_args.plot_every)) | {record["steps"]})
            values = curve(episodes, grid, record["steps"])
            runs[f"{variant}_seed{seed}"] = {
                "variant": variant, "seed": seed, "budget": record["budget"],
                "steps": record["steps"], "episodes": len(episodes),
                "final_mean_100": statistics.fmean(e[1] for e in episodes[-WINDOW:]),
                "first_step_at_target": (first_reaching(episodes, bench.target)
                                         if bench.target is not None else None),
                "curve": [[x, round(y, 3)] for x, y in zip(grid, values) if y is not None]}
    mean, std = mean_std(random_returns or [])
    text = {"env": env_args.env, "target": bench.target, "window": WINDOW,
            "min_episodes": MIN_EPISODES, "grid_every": env_args.plot_every, "budgets": budgets,
            "runs": runs, "random": {"episodes": len(random_returns or []), "mean": mean,
                                     "std": std}}
    (env_args.results_dir / "curves.json").write_text(json.dumps(text, indent=1) + "\n")


def report(args):
    """Each env's table.md and curves.json again, and the plot of all envs, from the kept logs."""
    panels = []
    for env_id in args.envs:
        bench, env_args = bench_for(args.study, env_id), env_arguments(args, env_id)
        if not (env_args.results_dir / "runs.json").exists():
            print(f"{env_id}: no kept logs in {display(env_args.results_dir)}")
            continue
        runs, trained, random_returns, budgets, notes = load_report(bench, env_args)
        text = learning_table(bench, env_args, runs, trained, random_returns, budgets, notes)
        (env_args.results_dir / "table.md").write_text(text)
        write_curves(bench, env_args)
        print(f"\n## {env_id}\n\n{text}", end="")
        panels.append((bench, env_args, trained, random_returns, budgets))
    if panels:
        plot(panels, args.plot, args.study.script.name)
        print(f"\nwrote {display(args.plot)}")


def plot(panels, path, script_name):
    """A panel per env: per variant the mean over seeds of the 100-episode curves and their
    min–max band; the random policy's mean ± one standard error; the env's target."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    fig, axes = plt.subplots(1, len(panels), figsize=(max(6 * len(panels), 10), 4.8), dpi=110,
                             squeeze=False)
    for ax, (bench, env_args, trained, random_returns, budgets) in zip(axes[0], panels):
        end = max((r["steps"] for seeds in trained.values() for r, _ in seeds.values()),
                  default=env_args.plot_every)
        grid = list(range(env_args.plot_every, end + 1, env_args.plot_every))
        for variant, seeds in trained.items():
            curves = [curve(episodes, grid, record["steps"]) for record, episodes in
                      seeds.values()]
            points = [(x, [c[k] for c in curves]) for k, x in enumerate(grid)
                      if all(c[k] is not None for c in curves)]
            if points:
                xs, color = [x for x, _ in points], bench.colors[variant]
                ax.plot(xs, [statistics.fmean(v) for _, v in points], color=color, lw=2,
                        label=f"{bench.labels[variant]} ({len(seeds)} seeds)")
                ax.fill_between(xs, [min(v) for _, v in points], [max(v) for _, v in points],
                                color=color, alpha=0.2, lw=0)
        if random_returns:
            mean, std = mean_std(random_returns)
            error = std / math.sqrt(len(random_returns))
            ax.axhline(mean, color=bench.colors["random"], ls="--", lw=1.5,
                       label=f"random policy ({len(random_returns)} episodes, ± 1 s.e.)")
            ax.axhspan(mean - error, mean + error, color=bench.colors["random"], alpha=0.15,
                       lw=0, zorder=0)
        if bench.target is not None:
            ax.axhline(bench.target, color="black", ls=":", lw=1,
                       label=f"target {bench.target:g}")
        seeds = sorted({seed for runs in trained.values() for seed in runs})
        budget = " / ".join(f"{b:,}" for b in budgets) or "–"
        ax.set_title(f"{env_args.env}: {budget} steps, seeds {', '.join(map(str, seeds))}",
                     fontsize=11)
        ax.set_xlabel(bench.x_label)
        ax.set_ylabel(bench.y_label)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x / 1000:g}k" if x else "0"))
        ax.set_xlim(0, end)
        ax.grid(alpha=0.3)
        ax.legend(loc=bench.legend_loc, fontsize=8)
    fig.suptitle(f"{script_name} with nothing but --env, against SB3 PPO's library defaults; "
                 "line: mean over seeds, band: min–max", fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def search(args):
    """Each candidate on each env and seed, ours only; search.json and search.md."""
    study = args.study
    info = machine(study.packages)
    warn_if_busy(info, "slows the runs (the scores do not depend on it)")
    args.results_dir.mkdir(parents=True, exist_ok=True)
    path = args.results_dir / "search.json"
    for env_id in args.envs:
        steps = args.steps or study.budgets.get(env_id, 500_000)
        target = study.targets.get(env_id)
        for name in args.candidates:
            for seed in args.seeds:
                flags = [*flags_of(study.candidates[name]), "--no-preset"]
                print(f"search: {name} on {env_id}, seed {seed}, {steps:,} steps ...", flush=True)
                date = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
                script_args = ["--env", env_id, "--seed", str(seed), "--total-timesteps",
                               str(steps), *flags]
                record, episodes, tail = run_ours_logged(study.script, script_args, name, args)
                means = [statistics.fmean(e[1] for e in episodes[max(0, i - WINDOW + 1):i + 1])
                         for i in range(WINDOW - 1, len(episodes))]
                result = {
                    "env": env_id, "candidate": name, "seed": seed, "flags": shlex.join(flags),
                    "budget": steps, "steps": record["steps"], "status": record["status"],
                    "episodes": len(episodes),
                    "final_mean_100": means[-1] if means else None,
                    "best_mean_100": max(means) if means else None,
                    "first_step_at_target": (first_reaching(episodes, target)
                                             if target is not None else None),
                    "date": date, "machine_line": machine_line(info, study.packages)}
                results = json.loads(path.read_text()) if path.exists() else {}
                results[f"{env_id} {name} seed{seed}"] = result
                path.write_text(json.dumps(dict(sorted(results.items())), indent=1) + "\n")
                if record["status"] != "ok":
                    print(f"  !! {record['status']}\n{tail}", flush=True)
                print(f"  final {fmt(result['final_mean_100'], '.1f')}, best "
                      f"{fmt(result['best_mean_100'], '.1f')}, at target "
                      f"{fmt(result['first_step_at_target'], ',')}", flush=True)
    write_search_table(args.results_dir)


def write_search_table(results_dir):
    """search.md: every kept search run, by env, candidate and seed."""
    results = json.loads((results_dir / "search.json").read_text())
    lines = ["| env | candidate | seed | steps | final 100-episode mean | best | first step at "
             "target | flags (beside --env, --seed, --total-timesteps) |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for result in results.values():
        lines.append(f"| {result['env']} | {result['candidate']} | {result['seed']} | "
                     f"{fmt(result['steps'], ',')} | {fmt(result['final_mean_100'], '.1f')} | "
                     f"{fmt(result['best_mean_100'], '.1f')} | "
                     f"{fmt(result['first_step_at_target'], ',')} | `{result['flags']}` |")
    machines = sorted({result["machine_line"] for result in results.values()})
    text = "\n".join(lines + [""] + machines) + "\n"
    (results_dir / "search.md").write_text(text)
    print("\n" + text, end="")


def main():
    parser = argparse.ArgumentParser(
        description="ppo_cartpole.py or ppo_continuous.py with nothing but --env beyond its "
        "default env, against SB3 PPO's library defaults; and the search for its settings.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--mode", choices=("learning", "search"), default="learning")
    parser.add_argument("--script", choices=tuple(STUDIES), default="ppo_cartpole")
    parser.add_argument("--envs", nargs="+", help="default: the study's")
    parser.add_argument("--variants", nargs="+", choices=("ours", "sb3", "random"),
                        default=["ours", "sb3", "random"], help="--mode learning: what to run")
    parser.add_argument("--candidates", nargs="+",
                        help="--mode search: the flag sets to run (default: all the study's)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--steps", type=int, default=None,
                        help="steps per run (default: each env's budget in the study)")
    parser.add_argument("--random-episodes", type=int, default=100, dest="random_count")
    parser.add_argument("--random-seed", type=int, default=1)
    parser.add_argument("--our-args", default="", help="extra arguments for the script")
    parser.add_argument("--nice", type=int, default=0, help="start each run under nice -n NICE")
    parser.add_argument("--timeout", type=float, default=3 * 3600.0, help="seconds per run")
    parser.add_argument("--results-dir", type=Path, help="default: the study's")
    parser.add_argument("--plot", type=Path, help="default: the study's")
    parser.add_argument("--plot-every", type=int, default=10_000, help="steps between points")
    parser.add_argument("--plot-only", action="store_true",
                        help="run nothing: the tables, curves.json and the plot from the logs")
    parser.add_argument("--env", help=argparse.SUPPRESS)  # the SB3 child's env
    parser.add_argument("--_sb3-child", nargs=2, metavar=("SEED", "OUTFILE"), dest="sb3_child",
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.sb3_child:
        seed, out_file = args.sb3_child
        sb3_child(args.env, int(seed), out_file, args.steps)
        return
    if min(args.steps or 1, args.random_count, args.plot_every) <= 0:
        parser.exit(2, "error: --steps, --random-episodes and --plot-every must be positive\n")
    args.variants = [v for v in ("ours", "sb3", "random") if v in args.variants]  # in order
    study = args.study = STUDIES[args.script]
    args.envs, args.candidates = args.envs or list(study.budgets), args.candidates or list(
        study.candidates)
    unknown = [name for name in args.candidates if name not in study.candidates]
    if unknown:
        parser.exit(2, f"error: {args.script} has no candidate {unknown[0]!r} "
                    f"(its candidates: {', '.join(study.candidates)})\n")
    args.results_dir = (args.results_dir or study.results).resolve()
    args.plot = args.plot or study.plot
    if args.plot_only:
        report(args)
        return
    check_ready(study.script, sb3=args.mode == "learning" and "sb3" in args.variants)
    search(args) if args.mode == "search" else learning(args)


if __name__ == "__main__":
    main()
