r"""Do action masks help `ppo_spaces.py` learn Taxi, and how does it compare with sb3-contrib's
MaskablePPO? Learning curves over seeds, and the steps and seconds to a mean return of 7.

What it measures
----------------
The return of every episode finished in training, against environment steps (summed over all
envs), for each seed (default 1 2 3) with the same budget of `--steps` N for every trained variant
(default 200,000, ppo_spaces.py's own default), on gymnasium's Taxi-v4 (Taxi-v3 with the v4 fix
of its rainy and fickle options, both off by default: the same game; gymnasium 1.4 no longer makes
Taxi-v3). For each run: the first step, and the seconds from launching its process, at which the
mean return of the last 100 finished episodes reaches 7 (issue 22's target; Taxi's
reward_threshold is 8, its optimum about 8.46), and that mean at the end. Four variants:

1. `masks`: `python ppo_spaces.py --env Taxi-v4 --seed S --total-timesteps N --run-dir <tmp>`,
   with the script's defaults: the action mask read from `info["action_mask"]` of every reset and
   step, masked actions given probability 0 when acting and in the update (16 envs x 128 steps a
   rollout, learning rate 2.5e-3 annealed to 0 over N, entropy bonus 0.01; it stops after the
   rollout that reaches N: 98 rollouts, 200,704 steps by default).
2. `no-masks`: the same plus `--no-action-mask` (the mask ignored: all 6 actions always allowed).
   For both, each finished episode's (step, return, length) and the wall-clock time it was logged
   at are read from the run dir's TensorBoard events (`charts/episodic_return`,
   `charts/episodic_length`; EventAccumulator, keeping all).
3. `maskable`: sb3-contrib's MaskablePPO, in a child process of this same file (`--_sb3-child`).
   The rl-baselines3-zoo has no hyperparameters for Taxi (none in hyperparams/ppo.yml, and no
   MaskablePPO file), so it runs with sb3-contrib's own defaults, those of MaskablePPO's
   constructor: `MaskablePPO("MlpPolicy", env, seed=S, device="cpu")`, i.e. learning rate 3e-4 (constant),
   n_steps 2048, batch 64, 10 epochs, gamma 0.99, GAE lambda 0.95, clip range 0.2, no entropy
   bonus, vf_coef 0.5, max_grad_norm 0.5, separate 64-64 tanh MLPs for policy and value (SB3 feeds
   the Discrete(500) observation as a one-hot), on 1 env: `make_vec_env("Taxi-v4", n_envs=1,
   seed=S)` (what MaskablePPO builds itself from an env id). The mask is the env's own: a wrapper
   keeps `info["action_mask"]` of the last reset or step, and sb3-contrib's `ActionMasker` hands it
   to MaskablePPO (which reads `action_masks()` before every step), so both implementations see the
   same masks. `learn(total_timesteps=N)`; it stops after the rollout that reaches N (98 rollouts,
   200,704 steps by default). A callback records each finished episode (the Monitor's
   `info["episode"]`) at `self.num_timesteps` with its wall-clock time (harness.py's
   `sb3_learn_and_record`).
4. `random`: the floor: uniformly random *allowed* actions (a uniform choice among those the mask
   allows), in `gymnasium.make("Taxi-v4")` in this process, `--random-episodes` episodes (default
   100), reported as mean ± std and standard error and drawn in the plot. As cheap, and only in the
   table's note and runs.json (it would squash the plot), uniformly random actions that ignore the
   mask, as many episodes.

The implementations do not share hyperparameters: each runs its own defaults, so this compares
what a user gets from either out of the box (their budgets are the same N, and each runs 2,048
steps a rollout). Seconds are counted from the moment this file launches the run's process, so
they include Python's start-up and the imports on both sides ("time from launch"); ours logs its
episodes at the end of each rollout, MaskablePPO's callback as they end. The training runs go one
after another, interleaved by seed (seed 1: masks, no-masks, maskable; seed 2: ...), so that
background load hits all alike. Run it alone on an idle machine: on 2 cores anything beside it
changes the seconds, not the steps. (The default run took 11 minutes on an idle 2-core Intel
Xeon on 2026-11-25: MaskablePPO runs near 1,160 steps/s on its one env, about 3 minutes a run,
ours near 10,000-11,000, about 20 seconds a run.)

The budget: 200,000 steps is ppo_spaces.py's default, and both reach 7 well within it (ours with
masks at 66k-86k steps on seeds 1-3, MaskablePPO at 57k-67k). Ours anneals
its learning rate over the budget, so its curve depends on it: seed 1 reached 7 at 97k steps with a
150k budget and 75k with 300k, but never with 90k (it settled at -200, a policy that never
delivers). MaskablePPO's constant learning rate makes its curve the same for any budget.

Outputs
-------
The layout of cartpole_learning.py (harness.py runs, keeps and plots; see there), in
`--results-dir` (default benchmarks/results/spaces_learning/); every run's log is kept, so that
`--plot-only` redoes the report without training:
- `<variant>_seed<S>.csv`: `step,return,length`, one row per finished episode.
- `random.csv`: `episode,return,length` of the random allowed actions; `random_unmasked.csv`: the
  same for random actions that ignore the mask.
- `runs.json`: per run (key `<variant>_seed<S>`, `random` or `random_unmasked`): the command, date,
  wall seconds, steps, episodes, steps/s (steady: from the end of the first update), exit status,
  `target_step` and `target_seconds` (the first step and the seconds from launch at which the
  100-episode mean reached 7; null if never), the machine line and the package versions.
- `table.md` (also printed): harness.py's table (per variant, each seed's mean return of its last
  100 training episodes at the end, the mean ± std over seeds; each seed's first step at which that
  mean reached 7 and the mean ± std over the seeds that reached it; the random policy; the machine,
  dates and versions; its "ratio to SB3" column stays empty: no variant is called sb3, and ratios of
  returns that cross zero mean nothing), then this file's table of steps and seconds to 7 per seed,
  with the mean over the seeds that reached it and MaskablePPO's mean seconds over `masks`'.
- The plot (`--plot`; by default benchmarks/plots/spaces_taxi_learning.png with the default
  results dir, else inside the results dir): for each run, the mean return of its last 100
  episodes every `--plot-every` steps (from its 10th episode on); per variant, the mean over seeds
  as a line and the min–max over seeds as a band; the random allowed actions' mean ± one standard
  error; 7 dotted.

How to run it (from the repository root)
----------------------------------------
    pip install -r requirements.txt -r benchmarks/requirements.txt
    python benchmarks/spaces_learning.py                      # all four; seeds 1 2 3; 200k steps
    python benchmarks/spaces_learning.py --variants maskable  # again; the others' logs are kept
    python benchmarks/spaces_learning.py --plot-only          # tables and plot from the kept logs
    python benchmarks/spaces_learning.py --steps 5000 --seeds 1 --random-episodes 5 \
        --results-dir /tmp/spaces_learning_test             # a quick check of the benchmark
"""

import argparse
import datetime
import importlib.metadata
import json
import shlex
import statistics
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from harness import (REPO_ROOT, WINDOW, Learning, check_learning_arguments, check_ready,
                     first_reaching, fmt, learning_arguments, learning_report, load_report,
                     mean_std, nice_prefix, read_csv, run_learning, run_sb3_logged, run_status,
                     save_run, sb3_learn_and_record, timed_run, write_csv)

# This file's top level imports only the standard library (and harness.py, which does too), so that
# the MaskablePPO child pays for its own imports just like our script does.

ENV = "Taxi-v4"
TARGET_RETURN = 7.0  # issue 22's target, over 100 consecutive episodes (reward_threshold: 8)
BENCH = Learning(
    name="spaces_learning",
    script=REPO_ROOT / "ppo_spaces.py",
    variants=("masks", "no-masks", "maskable", "random"),
    labels={"masks": "ours, ppo_spaces.py (defaults: masks)",
            "no-masks": "ours, ppo_spaces.py --no-action-mask",
            "maskable": "sb3-contrib MaskablePPO (its defaults, masks)",
            "random": "random allowed actions"},
    colors={"masks": "tab:blue", "no-masks": "tab:orange", "maskable": "tab:green",
            "random": "tab:gray"},
    packages=("torch", "gymnasium", "stable-baselines3", "sb3-contrib", "numpy"),
    unit="episode",
    score="return",
    x_label="environment steps (all envs)",
    y_label=f"episode return (mean of the last {WINDOW} training episodes)",
    note=f"(ours anneals its learning rate over it; MaskablePPO keeps its constant 3e-4). Return: "
    f"the mean return of each run's last {WINDOW} training episodes at its end (stochastic "
    f"policy); std over seeds; no ratio: no SB3 PPO variant here. First step at "
    f"≥ {TARGET_RETURN:g}: the first step at which the mean return of the run's last {WINDOW} "
    f"finished episodes reached {TARGET_RETURN:g} (– if never); its mean ± std is over the seeds "
    "that reached it. steps/s: "
    "steady training speed (from the end of the first update), mean over seeds. Random policy: "
    f"uniformly random actions among those info[\"action_mask\"] allows, in gymnasium's {ENV}.",
    target=TARGET_RETURN,
    legend_loc="center right",
)


# --------------------------------------------------------------------------------------------------
# The runs: ours through its command line, MaskablePPO in a child process, the random policy here
# --------------------------------------------------------------------------------------------------


def read_timed_episodes(run_dir):
    """Every finished episode's (step, return, length, wall-clock time it was logged at), from the
    TensorBoard events in `run_dir`."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0},  # 0: keep every one
                              purge_orphaned_data=False)
    events.Reload()
    if "charts/episodic_return" not in events.Tags()["scalars"]:
        return []
    returns, lengths = events.Scalars("charts/episodic_return"), events.Scalars(
        "charts/episodic_length")
    return [(r.step, r.value, int(n.value), r.wall_time) for r, n in zip(returns, lengths)]


def seconds_to_target(episodes, launch):
    """(step, seconds from `launch`, a time.time()) of the first episode after which the mean
    return of the last WINDOW episodes reached the target, or (None, None); episodes carry their
    wall time last."""
    step = first_reaching([episode[:3] for episode in episodes], TARGET_RETURN)
    if step is None:
        return None, None
    wall_time = next(episode[-1] for episode in episodes if episode[0] == step)
    return step, round(wall_time - launch, 2)


def run_ours(variant, seed, args):
    """One run of ppo_spaces.py: (run record, episodes, output tail)."""
    masks = [] if variant == "masks" else ["--no-action-mask"]
    with tempfile.TemporaryDirectory(prefix=f"{variant}_seed{seed}_") as tmp, \
            tempfile.TemporaryDirectory(prefix=f"{variant}_seed{seed}_log_") as log_dir:
        cmd = [*nice_prefix(args), sys.executable, str(BENCH.script), "--env", ENV, "--seed",
               str(seed), "--total-timesteps", str(args.steps), *masks, "--run-dir", tmp,
               *shlex.split(args.our_args)]
        launch = time.time()
        returncode, wall, tail = timed_run(cmd, args.timeout, log_dir)
        summary_path = Path(tmp) / "summary.json"
        summary = json.loads(summary_path.read_text()) if summary_path.exists() else None
        episodes = read_timed_episodes(tmp)
    step, seconds = seconds_to_target(episodes, launch)
    record = {"status": run_status(returncode, summary, args.timeout), "exit_status": returncode,
              "command": shlex.join(cmd), "wall_seconds": round(wall, 2),
              "steps": summary.get("steps") if summary else None,
              "steps_per_second": summary.get("steps_per_second") if summary else None,
              "target_step": step, "target_seconds": seconds}
    return record, [episode[:3] for episode in episodes], tail


def run_variant(variant, seed, args):
    """One training run: (run record, episodes, output tail)."""
    if variant == "maskable":  # its record gets target_step and target_seconds from harness.py
        return run_sb3_logged(__file__, seed, ["--steps", str(args.steps)], args,
                              target=TARGET_RETURN)
    return run_ours(variant, seed, args)


def sb3_child(seed, out_file, total_timesteps):
    """Train MaskablePPO with sb3-contrib's defaults on Taxi-v4 with its action masks; write every
    finished episode and the timings as JSON (harness.py's `sb3_learn_and_record`)."""
    setup_start = time.perf_counter()
    import gymnasium as gym
    from sb3_contrib import MaskablePPO
    from sb3_contrib.common.wrappers import ActionMasker
    from stable_baselines3.common.env_util import make_vec_env

    class LastInfoMask(gym.Wrapper):
        """Keeps `info["action_mask"]` of the last reset or step: the mask of the current state
        (the vector env's auto-reset goes through `reset`, so after an episode's end it is the new
        episode's)."""

        def reset(self, **kwargs):
            obs, info = self.env.reset(**kwargs)
            self.mask = info["action_mask"].astype(bool)
            return obs, info

        def step(self, action):
            obs, reward, terminated, truncated, info = self.env.step(action)
            self.mask = info["action_mask"].astype(bool)
            return obs, reward, terminated, truncated, info

    def masked(env):  # make_vec_env puts its Monitor underneath
        return ActionMasker(LastInfoMask(env), lambda inner: inner.mask)

    env = make_vec_env(ENV, n_envs=1, seed=seed, wrapper_class=masked)
    model = MaskablePPO("MlpPolicy", env, seed=seed, device="cpu", verbose=0)
    sb3_learn_and_record(model, env, total_timesteps, out_file, setup_start)


def random_allowed(args, use_mask):
    """`args.random_count` episodes of uniformly random actions, among those the mask allows with
    `use_mask`, else among all 6: (returns, lengths, how)."""
    import gymnasium as gym
    import numpy as np

    env = gym.make(ENV)
    rng = np.random.default_rng(args.random_seed)
    num_actions = int(env.action_space.n)
    returns, lengths = [], []
    _, info = env.reset(seed=args.random_seed)  # seeded once; each later reset goes on from there
    while len(returns) < args.random_count:
        total, length, done = 0.0, 0, False
        while not done:
            action = (rng.choice(np.flatnonzero(info["action_mask"])) if use_mask
                      else rng.integers(num_actions))
            _, reward, terminated, truncated, info = env.step(int(action))
            total, length, done = total + float(reward), length + 1, terminated or truncated
        returns.append(total)
        lengths.append(length)
        _, info = env.reset()
    env.close()
    how = ("uniformly among the actions info['action_mask'] allows" if use_mask
           else "uniformly random actions, the mask ignored")
    command = (f"in this process: gymnasium.make({ENV!r}), reset(seed={args.random_seed}) once, "
               f"{how}, numpy.random.default_rng({args.random_seed})")
    return returns, lengths, command


def play_random(args):
    """The floor, random allowed actions: (returns, lengths, how), which run_learning keeps. Also,
    as cheap, random actions that ignore the mask, kept here (random_unmasked.csv, runs.json)."""
    date = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    start = time.perf_counter()
    returns, lengths, command = random_allowed(args, use_mask=False)
    wall = time.perf_counter() - start
    write_csv(args.results_dir / "random_unmasked.csv", ["episode", "return", "length"],
              [(i + 1, r, n) for i, (r, n) in enumerate(zip(returns, lengths))])
    save_run(args.results_dir, "random_unmasked", {
        "variant": "random_unmasked", "seed": args.random_seed, "env": args.env,
        "command": command, "date": date, "wall_seconds": round(wall, 2),
        "episodes": len(returns), "steps": sum(lengths), "status": "ok"})
    mean, std = mean_std(returns)
    print(f"  (ignoring the mask: {mean:.2f} ± {std:.2f} over {len(returns)} episodes)",
          flush=True)
    return random_allowed(args, use_mask=True)


# --------------------------------------------------------------------------------------------------
# The table of steps and seconds to 7
# --------------------------------------------------------------------------------------------------


def time_table(args):
    """Per variant: each seed's first step and seconds from launch at which the 100-episode mean
    reached 7 (– if never), the means over the seeds that reached it; MaskablePPO's mean seconds
    over masks'; the random policies."""
    runs, trained, random_returns, _, _ = load_report(BENCH, args)
    seeds_heading = "".join(f" seed {seed} |" for seed in args.seeds)
    lines = [f"| variant |{seeds_heading} mean steps | mean seconds | final return, mean |",
             "| --- |" + " ---: |" * (len(args.seeds) + 3)]
    mean_seconds = {}
    for variant, seeds in trained.items():
        cells, steps, seconds, finals = "", [], [], []
        for seed in args.seeds:
            if seed not in seeds:
                cells += " – |"
                continue
            record, episodes = seeds[seed]
            step = first_reaching(episodes, TARGET_RETURN)
            second = record.get("target_seconds")
            cells += f" {fmt(step, ',')} ({fmt(second, '.1f')} s) |"
            if step is not None and second is not None:
                steps.append(step)
                seconds.append(second)
            if episodes:
                finals.append(statistics.fmean(e[1] for e in episodes[-WINDOW:]))
        share = f" ({len(steps)}/{len(seeds)} seeds)" if len(steps) < len(seeds) else ""
        mean_seconds[variant] = mean_std(seconds)[0] if len(steps) == len(seeds) else None
        lines.append(f"| {BENCH.labels[variant]} |{cells} {fmt(mean_std(steps)[0], ',.0f')}{share}"
                     f" | {fmt(mean_std(seconds)[0], '.1f')}{share} |"
                     f" {fmt(mean_std(finals)[0], '.2f')} |")
    ours, theirs = mean_seconds.get("masks"), mean_seconds.get("maskable")
    ratio = (f"MaskablePPO's mean seconds to {TARGET_RETURN:g} / ours with masks: "
             f"{fmt(theirs / ours if ours and theirs else None, '.2f')}x")
    notes = (f"Each cell: the first step at which the mean return of the last {WINDOW} finished "
             f"episodes reached {TARGET_RETURN:g}, and in brackets the seconds from launching the "
             "run's process (imports included) to the moment that episode was logged; – if "
             "never. "
             "Means over the seeds that reached it (all seeds for the ratio below). Final return: "
             f"the mean over seeds of each run's last {WINDOW} episodes' mean.")
    floors = []
    if random_returns:
        mean, std = mean_std(random_returns)
        floors.append(f"random allowed actions (the floor) {mean:.2f} ± {std:.2f} over "
                      f"{len(random_returns)} episodes")
    unmasked = args.results_dir / "random_unmasked.csv"
    if random_returns and unmasked.exists() \
            and runs.get("random_unmasked", {}).get("env", args.env) == args.env:
        returns = [row[1] for row in read_csv(unmasked)]
        mean, std = mean_std(returns)
        floors.append(f"random actions ignoring the mask {mean:.2f} ± {std:.2f} over "
                      f"{len(returns)} episodes")
    lines += [""] + textwrap.wrap(notes, width=100) + ["", ratio]
    if floors:
        lines += [""] + textwrap.wrap(f"Random policies, return mean ± std: {'; '.join(floors)}.",
                                      width=100)
    return "\n".join(lines) + "\n"


def append_time_table(args):
    """Print the table of steps and seconds, and append it to table.md (after harness.py's)."""
    text = time_table(args)
    print()
    print(text, end="")
    with open(args.results_dir / "table.md", "a") as table:
        table.write("\n" + text)


# --------------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------------


def parse_args():
    parser = argparse.ArgumentParser(
        description="Learning curves and steps and seconds to a 100-episode mean return of 7 on "
        "Taxi-v4 over seeds: ppo_spaces.py with and without action masks, sb3-contrib's "
        "MaskablePPO with its defaults, and random allowed actions.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    learning_arguments(parser, BENCH, steps=200_000, timeout=1800.0, plot_every=2000,
                       plot_help="the PNG (default: benchmarks/plots/spaces_taxi_learning.png for "
                       "the default results dir, else inside the results dir)")
    args = parser.parse_args()
    args.env = ENV
    check_learning_arguments(parser, args, BENCH, "spaces_taxi_learning.png")
    return args


def check_sb3_contrib():
    try:
        importlib.metadata.version("sb3-contrib")
    except importlib.metadata.PackageNotFoundError:
        print("error: sb3-contrib is not installed; pip install -r benchmarks/requirements.txt",
              file=sys.stderr)
        sys.exit(2)


def main():
    args = parse_args()
    if args.sb3_child:
        seed, out_file = args.sb3_child
        sb3_child(int(seed), out_file, args.steps)
        return
    if args.plot_only:
        learning_report(BENCH, args)  # harness.py's table and plot
    else:
        check_ready(BENCH.script if {"masks", "no-masks"} & set(args.variants) else None,
                    sb3="maskable" in args.variants)
        if "maskable" in args.variants:
            check_sb3_contrib()
        run_learning(BENCH, args, run_variant, play_random)  # ends with learning_report
    append_time_table(args)


if __name__ == "__main__":
    main()
