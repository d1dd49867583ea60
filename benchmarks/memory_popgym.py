r"""Does `ppo_memory.py`'s memory learn beyond stateless CartPole? Its kinds, with their defaults,
on a suite of partially observed games: learning curves and final returns over seeds.

What it measures
----------------
For each game of `--envs` and each `--memory` kind of `--variants` (default lstm, gru, none) and
seed (default 1 2 3): `python ppo_memory.py --env GAME --memory KIND --seed S --total-timesteps N
--run-dir <tmp>`, every other setting at its default (the kind's own defaults: `--help`), N =
`--steps` (default 200,000; the learning rate anneals to 0 over it). The return of every episode
finished in training, against environment steps, comes from the run dir's TensorBoard events
(`charts/episodic_return`, logged at the end of each rollout). Beside them, a random policy:
uniformly random actions (`action_space.sample()`), `--random-episodes` episodes.

The games (`GAMES`): StatelessCartPole-v1 and StatelessAcrobot-v1 (ppo_memory.py's own: CartPole-v1
and Acrobot-v1 with their velocities removed; the random policy plays the full game, which the
velocities do not change for it), and POPGym's (Morad et al., ICLR 2023; `pip install popgym`):
RepeatFirstEasy and RepeatPreviousEasy (recall: name the suit of the first card dealt, or of the
one dealt 4 cards ago), CountRecallEasy (counting: how often has this card been dealt),
PositionOnlyCartPoleEasy and NoisyPositionOnlyCartPoleEasy (control: CartPole without
velocities, 200 steps, reward 1/200 a step; the second with noisy observations). A POPGym game's
returns lie in [-1, 1]: its "MMER" in the paper is the best mean episodic return over training.

Outputs
-------
Per game, the layout of memory_table.py in `--results-dir`/GAME/ (default
benchmarks/results/memory_popgym/GAME/): `<kind>_seed<S>.csv` (step, return, length of every
episode), `random.csv`, `runs.json`, `table.md` (harness.py's table: the mean return of the last 100
episodes per seed, mean ± std over seeds, and, where the game has a target, the first step at
which the moving mean reached it), and the plot benchmarks/plots/memory_<game>.png (inside the
results dir for another results dir). Then `summary.md` in `--results-dir`: one line per game and
kind, the final return over seeds and the "late drop": the largest fall, in the last quarter of a
run, of the 100-episode mean below its best so far, in per cent of that best's height above the
random policy (issue 24 asks for at most 10%).

How to run it (from the repository root)
----------------------------------------
    pip install -r requirements.txt -r benchmarks/requirements.txt   # (popgym is in the latter)
    python benchmarks/memory_popgym.py                          # every game, lstm gru none, 3 seeds
    python benchmarks/memory_popgym.py --envs popgym-RepeatFirstEasy-v0 --seeds 1
    python benchmarks/memory_popgym.py --plot-only              # tables and plots from kept logs
"""

import argparse
import statistics
import sys

from harness import (PLOTS_DIR, REPO_ROOT, WINDOW, Learning, check_ready, fmt, learning_arguments,
                     learning_report, load_report, mean_std, random_episodes, run_learning,
                     run_ours_logged)

KINDS = ("lstm", "gru", "none", "framestack", "attention")
# Game -> (the game a random policy plays, a return drawn as a target line or None).
GAMES = {
    "StatelessCartPole-v1": ("CartPole-v1", 475.0),
    "StatelessAcrobot-v1": ("Acrobot-v1", -100.0),
    "popgym-RepeatFirstEasy-v0": ("popgym-RepeatFirstEasy-v0", None),
    "popgym-RepeatPreviousEasy-v0": ("popgym-RepeatPreviousEasy-v0", None),
    "popgym-CountRecallEasy-v0": ("popgym-CountRecallEasy-v0", None),
    "popgym-PositionOnlyCartPoleEasy-v0": ("popgym-PositionOnlyCartPoleEasy-v0", None),
    "popgym-NoisyPositionOnlyCartPoleEasy-v0": ("popgym-NoisyPositionOnlyCartPoleEasy-v0", None),
}
COLORS = {"lstm": "tab:blue", "gru": "tab:cyan", "none": "tab:olive", "framestack": "tab:orange",
          "attention": "tab:purple", "random": "tab:gray"}


def bench_for(env):
    """The harness's description of one game's runs."""
    return Learning(
        name=f"memory_popgym/{env}", script=REPO_ROOT / "ppo_memory.py",
        variants=(*KINDS, "random"),
        labels={**{kind: f"ours, --memory {kind}" for kind in KINDS}, "random": "random policy"},
        colors=COLORS, packages=("torch", "gymnasium", "popgym", "numpy"), unit="episode",
        score="return", x_label="environment steps (all envs)",
        y_label=f"episode return (mean of the last {WINDOW} training episodes)",
        note="(every kind with its defaults). Return: the mean of the last 100 episodes at the "
        "run's end (stochastic policy); std over seeds. Random policy: action_space.sample().",
        target=GAMES[env][1], legend_loc="upper left")


def run_variant(kind, seed, args):
    """One run of ppo_memory.py: (run record, episodes, output tail)."""
    script_args = ["--env", args.env, "--memory", kind, "--seed", str(seed), "--total-timesteps",
                   str(args.steps)]
    return run_ours_logged(REPO_ROOT / "ppo_memory.py", script_args, f"{kind}_seed{seed}", args)


def play_random(args):
    if args.env.startswith("popgym-"):
        import popgym  # noqa: F401 (registers its games with gymnasium)
    return random_episodes(GAMES[args.env][0], args.random_count, args.random_seed)


def late_drop(episodes, random_mean):
    """The largest fall, in the last quarter of the run, of the 100-episode mean below its best so
    far, as a share of that best's height above the random policy's mean (None if never above)."""
    returns, end = [e[1] for e in episodes], episodes[-1][0] if episodes else 0
    best, drop = None, None
    for i in range(WINDOW - 1, len(returns)):
        mean = statistics.fmean(returns[i + 1 - WINDOW:i + 1])
        best = mean if best is None else max(best, mean)
        if episodes[i][0] >= 0.75 * end and best > random_mean:
            drop = max(drop or 0.0, (best - mean) / (best - random_mean))
    return drop


def summary(args):
    """summary.md: per game and kind, the final 100-episode mean over the seeds, the late drop."""
    kinds = [kind for kind in args.variants if kind != "random"]
    lines = ["| game | random | " + " | ".join(kinds) + " |",
             "| --- | ---: |" + " ---: |" * len(kinds)]
    for env in args.envs:
        args.env, args.results_dir = env, args.base_dir / env
        _, trained, random_returns, _, _ = load_report(bench_for(env), args)
        random_mean = mean_std(random_returns)[0] if random_returns else None
        cells = []
        for kind in kinds:
            seeds = trained.get(kind, {})
            finals = [statistics.fmean(e[1] for e in episodes[-WINDOW:])
                      for _, episodes in seeds.values() if episodes]
            drops = [late_drop(episodes, random_mean) for _, episodes in seeds.values()
                     if episodes and random_mean is not None]
            worst = max((d for d in drops if d is not None), default=None)
            mean, std = mean_std(finals)
            cells.append(f"{fmt(mean, '.3g')} ± {fmt(std, '.2g')} ({len(finals)} seeds; "
                         f"late drop ≤ {fmt(None if worst is None else 100 * worst, '.0f')}%)")
        lines.append(f"| {env} | {fmt(random_mean, '.3g')} | " + " | ".join(cells) + " |")
    text = "\n".join(lines) + (
        "\n\nEach cell: the mean return of the last 100 episodes at the end, mean ± std over the "
        "seeds; late drop: the largest fall, over the seeds, of the 100-episode mean in the last "
        "quarter of the run below its best so far, in per cent of that best's height above the "
        "random policy.\n")
    print("\n" + text, end="")
    (args.base_dir / "summary.md").write_text(text)


def parse_args():
    parser = argparse.ArgumentParser(
        description="ppo_memory.py's kinds of memory, with their defaults, on partially observed "
        "games (its own and POPGym's): learning curves over seeds against a random policy.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--envs", nargs="+", choices=tuple(GAMES), default=list(GAMES),
                        help="the games")
    learning_arguments(parser, bench_for(next(iter(GAMES))), steps=200_000, timeout=3600.0,
                       plot_every=4000, plot_help="not used: each game's PNG is benchmarks/plots/"
                       "memory_<game>.png (inside --results-dir for another results dir)")
    parser.set_defaults(variants=["lstm", "gru", "none"],
                        results_dir=REPO_ROOT / "benchmarks" / "results" / "memory_popgym")
    args = parser.parse_args()
    args.variants = [kind for kind in (*KINDS, "random") if kind in args.variants]
    if "random" not in args.variants:
        args.variants.append("random")
    if min(args.steps, args.timeout, args.random_count, args.plot_every) <= 0:
        parser.exit(2, "error: --steps, --timeout, --random-episodes and --plot-every must be "
                    "positive\n")
    args.base_dir = args.results_dir.resolve()
    return args


def main():
    args = parse_args()
    if not args.plot_only:
        check_ready(REPO_ROOT / "ppo_memory.py")
    default_dir = args.base_dir == (REPO_ROOT / "benchmarks" / "results" / "memory_popgym")
    for env in args.envs:
        name = env.removeprefix("popgym-").removesuffix("-v0").removesuffix("-v1")
        args.env, args.results_dir = env, args.base_dir / env
        args.plot = (PLOTS_DIR if default_dir else args.results_dir) / f"memory_{name}.png"
        if args.plot_only:
            learning_report(bench_for(env), args)
        else:
            run_learning(bench_for(env), args, run_variant, play_random)
    summary(args)


if __name__ == "__main__":
    sys.exit(main())
