r"""Does `ppo_multiagent.py` learn MPE2's simple_spread_v3 as well as Stable-Baselines3 with
SuperSuit's parameter sharing, and how soon? Curves over seeds, and a race to SB3's final return.

What it measures
----------------
The return per agent of every episode finished in training (the mean over the env's 3 agents of
their returns; simple_spread gives every agent the shared coverage reward plus its own collision
penalty, 25 steps an episode), against agent steps (one agent acting once is one step, summed over
all agents and envs, as SB3 with SuperSuit counts), for each seed (default 1 2 3) with a budget of
`--steps` (default 600,000), for four variants:

1. `central`: `python ppo_multiagent.py --seed S --total-timesteps N --run-dir <tmp>`, its defaults
   (MAPPO's centralised critic: the value sees the env's global state and the agent's one-hot id).
   Each finished episode's (step, return per agent, length) is read from the run dir's TensorBoard
   event file (`charts/episodic_return`, `charts/episodic_length`).
2. `independent`: the same with `--no-central-value` (independent PPO: the value sees the agent's
   own observation).
3. `sb3`: Stable-Baselines3 PPO on PettingZoo's documented parameter-sharing recipe (its SB3
   tutorial for vector-observation envs, sb3_waterworld_vector.py): `simple_spread_v3.parallel_env()`,
   `reset(seed=S)`, SuperSuit's `pettingzoo_env_to_vec_env_v1` (each agent a slot of a vector env)
   and `concat_vec_envs_v1(env, 8, num_cpus=2, base_class="stable_baselines3")` (24 slots), SB3's
   `VecMonitor` to report episodes, then `PPO("MlpPolicy", env, learning_rate=1e-3,
   batch_size=256, seed=S, device="cpu")`, SB3's other defaults (n_steps 2048, 10 epochs, gamma
   0.99), `learn(total_timesteps=N)`, in a child process of this same file (`--_sb3-child`). Each
   slot is one agent: an episode record is one agent's return, and SuperSuit's conversion treats
   the 25-step cut as a death (no bootstrap).
4. `random`: uniformly random actions for every agent in `simple_spread_v3.parallel_env()`, in this
   process, `--random-episodes` episodes (default 100); the return per agent as above.

Then, with `--race` (after SB3's runs, whose logs may be kept from an earlier call): R = the mean
over the seeds of SB3's final return (its last 100 episode records), and for each seed
`python ppo_multiagent.py --seed S --target-return R` with everything else at its defaults; its
`solved_seconds` (wall time from the start of training until the mean return per agent of its last
100 episodes reached R) against SB3's median wall time for the budget. The issue asks for at most a
third.

The training runs go one after the other, interleaved (seed 1: central, independent, sb3; seed 2:
...) so that background load hits all alike. Run only one benchmark at a time on a machine.

Outputs
-------
The layout of cartpole_learning.py's (harness.py's): `<results-dir>/<variant>_seed<S>.csv`,
`random.csv`, `runs.json`, `table.md`, the plot (by default
`benchmarks/plots/multiagent_learning.png` with the default results dir); with `--race`, its runs in
runs.json (`race_seed<S>`) and its table in `race.md` (also printed).

How to run it (from the repository root)
----------------------------------------
    pip install -r requirements.txt -r benchmarks/requirements.txt
    python benchmarks/multiagent_learning.py --race            # all variants, seeds 1 2 3, race
    python benchmarks/multiagent_learning.py --variants sb3    # SB3 again; the others' logs kept
    python benchmarks/multiagent_learning.py --race-only       # the race alone, from kept SB3 logs
    python benchmarks/multiagent_learning.py --plot-only       # table and plot from the kept logs
    python benchmarks/multiagent_learning.py --steps 6000 --seeds 1 --random-episodes 5 --race \
        --results-dir /tmp/multiagent_learning_test        # a quick check of the benchmark
"""

import argparse
import datetime
import json
import shlex
import statistics
import sys
import time

from harness import (REPO_ROOT, WINDOW, Learning, check_learning_arguments, check_ready, fmt,
                     learning_arguments, learning_report, load_runs, machine, machine_line,
                     read_csv, run_learning, run_our_script, run_ours_logged, run_sb3_logged,
                     save_run, sb3_learn_and_record)

# This file's top level imports only the standard library (and harness.py, which does too), so that
# the SB3 child pays for its own imports just like our script does.

ENV = "mpe2.simple_spread_v3"
OUR_VARIANT_ARGS = {"central": [], "independent": ["--no-central-value"]}
BENCH = Learning(
    name="multiagent_learning",
    script=REPO_ROOT / "ppo_multiagent.py",
    variants=("central", "independent", "sb3", "random"),
    labels={"central": "ours, ppo_multiagent.py (defaults: centralised value, MAPPO)",
            "independent": "ours, --no-central-value (independent PPO)",
            "sb3": "SB3 PPO + SuperSuit parameter sharing (PettingZoo's recipe)",
            "random": "random policy"},
    colors={"central": "tab:blue", "independent": "tab:orange", "sb3": "tab:green",
            "random": "tab:gray"},
    packages=("torch", "pettingzoo", "mpe2", "stable-baselines3", "supersuit", "numpy"),
    unit="episode",
    score="return per agent",
    x_label="agent steps (all agents of all envs)",
    y_label=f"return per agent (mean of the last {WINDOW} training episodes)",
    note=f"(each anneals its learning rate over it; SB3 does not). Return per agent: the mean "
    f"over the agents of an episode's returns; ours counts an env's episode as one record, SB3 "
    f"each agent's; the value is the mean of each run's last {WINDOW} records at its end "
    f"(stochastic policy); std over seeds; ratio = variant mean / SB3 mean (returns are "
    f"negative: below 1 is better). steps/s: steady training speed in agent steps (from the end "
    f"of the first update), mean over seeds. Random policy: uniformly random actions.",
    legend_loc="lower right",
)


# --------------------------------------------------------------------------------------------------
# The SB3 reference, run in a child process; the random policy, in this process
# --------------------------------------------------------------------------------------------------


def sb3_child(seed, out_file, total_timesteps):
    """Train SB3 PPO on SuperSuit's parameter-sharing conversion; write every finished episode
    record (one agent's) and the timings as JSON."""
    setup_start = time.perf_counter()
    import supersuit as ss
    from mpe2 import simple_spread_v3
    from stable_baselines3 import PPO
    from stable_baselines3.common.utils import set_random_seed
    from stable_baselines3.common.vec_env import VecMonitor

    env = simple_spread_v3.parallel_env()
    env.reset(seed=seed)
    env = ss.pettingzoo_env_to_vec_env_v1(env)
    env = ss.concat_vec_envs_v1(env, 8, num_cpus=2, base_class="stable_baselines3")
    env = VecMonitor(env)
    # Not PPO(seed=...): it calls env.seed(), which SuperSuit's vector envs lack (AttributeError,
    # and the worker processes of num_cpus=2 then keep the child alive). The env is seeded above.
    set_random_seed(seed)
    model = PPO("MlpPolicy", env, learning_rate=1e-3, batch_size=256, device="cpu", verbose=0)
    sb3_learn_and_record(model, env, total_timesteps, out_file, setup_start)


def play_random(args):
    """`args.random_count` episodes of uniformly random actions: (returns per agent, lengths,
    how)."""
    import numpy as np
    from mpe2 import simple_spread_v3

    env = simple_spread_v3.parallel_env()
    rng = np.random.default_rng(args.random_seed)
    returns, lengths = [], []
    env.reset(seed=args.random_seed)  # seeded once; each later reset goes on from there
    while len(returns) < args.random_count:
        totals, length = dict.fromkeys(env.agents, 0.0), 0
        while env.agents:
            actions = {agent: int(rng.integers(env.action_space(agent).n)) for agent in env.agents}
            _, rewards, _, _, _ = env.step(actions)
            for agent, reward in rewards.items():
                totals[agent] += float(reward)
            length += 1
        returns.append(statistics.fmean(totals.values()))
        lengths.append(length)
        env.reset()
    env.close()
    command = (f"in this process: mpe2.simple_spread_v3.parallel_env(), reset(seed="
               f"{args.random_seed}) once, uniformly random actions, "
               f"numpy.random.default_rng({args.random_seed}); return per agent")
    return returns, lengths, command


def run_variant(variant, seed, args):
    """One training run: (run record, episodes, output tail)."""
    if variant == "sb3":
        return run_sb3_logged(__file__, seed, ["--steps", str(args.steps)], args)
    script_args = ["--seed", str(seed), "--total-timesteps", str(args.steps),
                   *OUR_VARIANT_ARGS[variant]]
    return run_ours_logged(BENCH.script, script_args, f"{variant}_seed{seed}", args)


# --------------------------------------------------------------------------------------------------
# The race: ours, with its defaults and --target-return R, against SB3's wall time for the budget
# --------------------------------------------------------------------------------------------------


def race(args):
    """Run ours to SB3's final return R on each seed; print and keep the table (race.md)."""
    runs = load_runs(args.results_dir)
    finals, walls = [], []
    for seed in args.seeds:
        record, path = runs.get(f"sb3_seed{seed}"), args.results_dir / f"sb3_seed{seed}.csv"
        if record is None or record["status"] != "ok" or not path.exists():
            print(f"error: no kept SB3 run for seed {seed} in {args.results_dir}: run "
                  f"--variants sb3 first", file=sys.stderr)
            sys.exit(1)
        finals.append(statistics.fmean(e[1] for e in read_csv(path)[-WINDOW:]))
        walls.append(record["wall_seconds"])
    target, sb3_wall = statistics.fmean(finals), statistics.median(walls)
    print(f"race: SB3's final return per agent, mean over seeds {target:.2f}; its median wall "
          f"time {sb3_wall:.1f} s; ours with --target-return {target:.4f}", flush=True)
    info = machine(BENCH.packages)
    lines = ["| seed | solved step | solved seconds | run seconds | solved / SB3 median wall |",
             "| ---: | ---: | ---: | ---: | ---: |"]
    for seed in args.seeds:
        script_args = ["--seed", str(seed), "--target-return", f"{target:.4f}"]
        date = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        command, status, wall, tail, summary, _ = run_our_script(
            BENCH.script, script_args, args.our_args, seed, args.timeout)
        solved = summary.get("solved_seconds") if summary else None
        save_run(args.results_dir, f"race_seed{seed}", {
            "variant": "race", "seed": seed, "env": args.env, "target_return": target,
            "sb3_median_wall_seconds": sb3_wall, "command": shlex.join(command), "date": date,
            "status": status, "wall_seconds": round(wall, 2), "summary": summary,
            "machine_line": machine_line(info, BENCH.packages)})
        ratio = solved / sb3_wall if solved is not None else None
        lines.append(f"| {seed} | {fmt(summary and summary.get('solved_step'), ',')} | "
                     f"{fmt(solved, '.1f')} | {wall:.1f} | {fmt(ratio, '.3f')} |")
        print(f"  seed {seed}: {status}, solved at {fmt(solved, '.1f')} s ({fmt(ratio, '.3f')} of "
              f"SB3's median wall time)", flush=True)
        if status != "ok":
            print(tail)
    lines += ["", f"R = {target:.4f} (SB3's final return per agent, mean over seeds "
                  f"{', '.join(map(str, args.seeds))}: {', '.join(f'{x:.2f}' for x in finals)}); "
                  f"SB3's median wall time {sb3_wall:.1f} s (walls {walls}).",
              "", machine_line(info, BENCH.packages)]
    text = "\n".join(lines) + "\n"
    (args.results_dir / "race.md").write_text(text)
    print("\n" + text, end="")


# --------------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------------


def parse_args():
    parser = argparse.ArgumentParser(
        description="Learning curves on MPE2 simple_spread_v3 over seeds: ppo_multiagent.py with a "
        "centralised and an independent value, SB3 PPO with SuperSuit's parameter sharing, and a "
        "random policy; --race: ours to SB3's final return.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--race", action="store_true",
                        help="then run ours with --target-return (SB3's final mean return)")
    parser.add_argument("--race-only", action="store_true",
                        help="run only the race, with the kept SB3 logs")
    learning_arguments(parser, BENCH, steps=600_000, timeout=7200.0, plot_every=6000,
                       plot_help="the PNG (default: benchmarks/plots/multiagent_learning.png for "
                       "the default results dir, else inside the results dir)")
    args = parser.parse_args()
    args.env = ENV
    check_learning_arguments(parser, args, BENCH, "multiagent_learning.png")
    return args


def main():
    args = parse_args()
    if args.sb3_child:
        seed, out_file = args.sb3_child
        sb3_child(int(seed), out_file, args.steps)
        return
    if args.plot_only:
        learning_report(BENCH, args)
        return
    check_ready(BENCH.script, sb3="sb3" in args.variants and not args.race_only)
    if not args.race_only:
        run_learning(BENCH, args, run_variant, play_random)
    if args.race or args.race_only:
        args.results_dir.mkdir(parents=True, exist_ok=True)
        race(args)


if __name__ == "__main__":
    main()
