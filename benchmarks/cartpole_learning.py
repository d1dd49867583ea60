r"""Does `ppo_cartpole.py` learn CartPole-v1 as well as Stable-Baselines3? Curves over seeds.

What it measures
----------------
The return of every episode finished in training, against environment steps (summed over all
envs), for each seed (default 1 2 3) with a budget of `--steps` (default 100,000, the
rl-baselines3-zoo's budget for CartPole-v1), and how soon the mean return of the last 100 finished
episodes reaches 475 (CartPole-v1's reward threshold), for three variants:

1. `ours`: `python ppo_cartpole.py --seed S --total-timesteps N --run-dir <tmp>`, with its defaults
   (64 envs x 32 steps a rollout, the learning rate annealed to 0 over N; it stops after the rollout
   that reaches N: 49 rollouts, 100,352 steps). Each finished episode's (step, return, length) is
   read from the run dir's TensorBoard event file (`charts/episodic_return`,
   `charts/episodic_length`; EventAccumulator, keeping all).
2. `sb3`: Stable-Baselines3 PPO with rl-baselines3-zoo's tuned CartPole-v1 hyperparameters, exactly
   those of cartpole_time_to_solve.py (harness.py's `sb3_zoo_cartpole`: `MlpPolicy`, 8 envs,
   n_steps 32, batch 256, 20 epochs, gamma 0.98, GAE lambda 0.8, no entropy bonus, learning rate
   `lin_1e-3`, clip range `lin_0.2`, CPU), `learn(total_timesteps=N)` (391 rollouts of 256 steps,
   100,096 steps), in a child process of this same file (`--_sb3-child`). A callback records each
   finished episode (the Monitor's `info["episode"]`) at `self.num_timesteps`.
3. `random`: uniformly random actions in `gymnasium.make("CartPole-v1")`, in this process,
   `--random-episodes` episodes (default 100), reported as mean ± std and standard error.

The two implementations do not share hyperparameters: each runs its own tuned defaults, so this
compares what a user gets from either out of the box. The training runs go one after the other,
interleaved (seed 1: ours, sb3; seed 2: ...) so that background load hits both alike. Run only one
benchmark at a time on a machine.

Outputs
-------
The same layout as atari_learning.py's (the running, the logs, the table and the plot are
harness.py's, shared with it); every run's log is kept, so that `--plot-only` redoes the report
without training:
- `<results-dir>/<variant>_seed<S>.csv`: `step,return,length`, one row per finished episode.
- `<results-dir>/random.csv`: `episode,return,length`.
- `<results-dir>/runs.json`: per run (key `<variant>_seed<S>`, or `random`): the command, date,
  wall seconds, steps, episodes, steps/s (steady: from the end of the first update), exit status,
  the machine line and the package versions. A run of some variants updates only their keys.
- `<results-dir>/table.md` (also printed): per variant, each seed's mean return of its last 100
  training episodes at the end, the mean ± std over seeds and the ratio to SB3's mean; each seed's
  first step at which that 100-episode mean reached 475 (– if never), and the mean ± std over the
  seeds that reached it; the random policy; the machine, dates and versions.
- The plot (`--plot`; by default `benchmarks/plots/cartpole_learning.png` with the default results
  dir, else inside the results dir): for each run, the mean return of its last 100 episodes every
  `--plot-every` steps (from its 10th episode on); per variant, the mean over seeds as a line and
  the min–max over seeds as a band; the random policy's mean ± one standard error; 475 dotted.

How to run it (from the repository root)
----------------------------------------
    pip install -r requirements.txt -r benchmarks/requirements.txt
    python benchmarks/cartpole_learning.py                   # ours, SB3, random; seeds 1 2 3; 100k
    python benchmarks/cartpole_learning.py --variants sb3    # SB3 again; the others' logs are kept
    python benchmarks/cartpole_learning.py --plot-only       # table and plot from the kept logs
    python benchmarks/cartpole_learning.py --steps 20000 --seeds 1 2 --random-episodes 10 \
        --results-dir /tmp/cartpole_learning_test        # a quick check of the benchmark
"""

import argparse
import time

from harness import (REPO_ROOT, WINDOW, Learning, check_learning_arguments, check_ready,
                     learning_arguments, learning_report, run_learning, run_ours_logged,
                     run_sb3_logged, sb3_learn_and_record, sb3_zoo_cartpole)

# This file's top level imports only the standard library (and harness.py, which does too), so that
# the SB3 child pays for its own imports just like our script does.

ENV = "CartPole-v1"
TARGET_RETURN = 475.0  # CartPole-v1's reward threshold, over 100 consecutive episodes
BENCH = Learning(
    name="cartpole_learning",
    script=REPO_ROOT / "ppo_cartpole.py",
    variants=("ours", "sb3", "random"),
    labels={"ours": "ours, ppo_cartpole.py (defaults)",
            "sb3": "SB3 PPO (rl-zoo tuned hyperparameters)", "random": "random policy"},
    colors={"ours": "tab:blue", "sb3": "tab:green", "random": "tab:gray"},
    packages=("torch", "gymnasium", "stable-baselines3", "numpy"),
    unit="episode",
    score="return",
    x_label="environment steps (all envs)",
    y_label=f"episode return (mean of the last {WINDOW} training episodes)",
    note=f"(each anneals its learning rate over it; SB3 its clip range too). Return: the mean "
    f"return of each run's last {WINDOW} training episodes at its end (stochastic policy); std "
    f"over seeds; ratio = variant mean / SB3 mean. First step at ≥ {TARGET_RETURN:g}: the first "
    f"step at which the mean return of the run's last {WINDOW} finished episodes reached "
    f"{TARGET_RETURN:g} (– if never); its mean ± std is over the seeds that reached it. steps/s: "
    "steady training speed (from the end of the first update), mean over seeds. Random policy: "
    f"uniformly random actions in gymnasium's {ENV}.",
    target=TARGET_RETURN,
    legend_loc="center right",
)


# --------------------------------------------------------------------------------------------------
# The SB3 reference, run in a child process; the random policy, in this process
# --------------------------------------------------------------------------------------------------


def sb3_child(seed, out_file, total_timesteps):
    """Train SB3 PPO with the zoo settings; write every finished episode and the timings as JSON."""
    setup_start = time.perf_counter()
    env, model = sb3_zoo_cartpole(seed)
    sb3_learn_and_record(model, env, total_timesteps, out_file, setup_start)


def play_random(args):
    """`args.random_count` episodes of uniformly random actions: (returns, lengths, how)."""
    import gymnasium as gym
    import numpy as np

    env = gym.make(ENV)
    rng = np.random.default_rng(args.random_seed)
    num_actions = int(env.action_space.n)
    returns, lengths = [], []
    env.reset(seed=args.random_seed)  # seeded once; each later reset goes on from there
    while len(returns) < args.random_count:
        total, length, done = 0.0, 0, False
        while not done:
            _, reward, terminated, truncated, _ = env.step(int(rng.integers(num_actions)))
            total, length, done = total + float(reward), length + 1, terminated or truncated
        returns.append(total)
        lengths.append(length)
        env.reset()
    env.close()
    command = (f"in this process: gymnasium.make({ENV!r}), reset(seed={args.random_seed}) once, "
               f"uniformly random actions, numpy.random.default_rng({args.random_seed})")
    return returns, lengths, command


def run_variant(variant, seed, args):
    """One training run: (run record, episodes, output tail)."""
    if variant == "sb3":
        return run_sb3_logged(__file__, seed, ["--steps", str(args.steps)], args)
    script_args = ["--seed", str(seed), "--total-timesteps", str(args.steps)]
    return run_ours_logged(BENCH.script, script_args, f"{variant}_seed{seed}", args)


# --------------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------------


def parse_args():
    parser = argparse.ArgumentParser(
        description="Learning curves on CartPole-v1 over seeds: ppo_cartpole.py with its defaults, "
        "Stable-Baselines3 PPO with the rl-zoo's tuned hyperparameters, and a random policy.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    learning_arguments(parser, BENCH, steps=100_000, timeout=3600.0, plot_every=1000,
                       plot_help="the PNG (default: benchmarks/plots/cartpole_learning.png for the "
                       "default results dir, else inside the results dir)")
    args = parser.parse_args()
    args.env = ENV
    check_learning_arguments(parser, args, BENCH, "cartpole_learning.png")
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
    check_ready(BENCH.script if "ours" in args.variants else None,
                sb3="sb3" in args.variants)
    run_learning(BENCH, args, run_variant, play_random)


if __name__ == "__main__":
    main()
