r"""Which memory learns stateless CartPole fastest? `ppo_memory.py`'s kinds against sb3-contrib's
RecurrentPPO, in steps and in seconds: the question of RLlib's trajectory-view table, today.

What it measures
----------------
For each `--memory` kind of `ppo_memory.py` (none, framestack, lstm, gru, attention) and for each
seed (default 1 2 3): the first step, and the seconds from launching the process, at which the
mean return of the last 100 finished episodes reaches 150 and 475, on StatelessCartPole-v1
(CartPole-v1 with the two velocities removed: the cart's position and the pole's angle, 2 numbers).
Side by side with the same for sb3-contrib's RecurrentPPO and a random policy:

1. Ours: `python ppo_memory.py --memory KIND --seed S --total-timesteps N --target-return 475
   --run-dir <tmp>`, with the script's defaults (and the kind's own defaults, see its --help).
   N is `--steps` (default 200,000) for none, framestack, lstm and gru, and `--attention-steps`
   (default 500,000) for attention; the learning rate anneals to 0 over N, and the run stops at the
   end of the rollout in which the 100-episode mean reached 475. Each finished episode's (step,
   return, length) and the wall-clock time it was logged at come from the run dir's TensorBoard
   events (`charts/episodic_return`, `charts/episodic_length`; logged at the end of each rollout).
2. `sb3`: sb3-contrib's RecurrentPPO (`MlpLstmPolicy`) with rl-baselines3-zoo's tuned
   CartPoleNoVel-v1 settings (hyperparams/ppo_lstm.yml): 8 envs, n_steps 32, batch 256, 20 epochs,
   gamma 0.98, GAE lambda 0.8, no entropy bonus, learning rate `lin_1e-3`, clip range `lin_0.2`,
   `normalize: True` (VecNormalize of the observations and the rewards, gamma 0.98), policy_kwargs
   ortho_init=False, ReLU, an LSTM of 64 units for the actor and one for the critic
   (enable_critic_lstm), net_arch pi [64] vf [64]; on the CPU. Its linear schedules anneal over the
   budget `learn` is given: `--sb3-steps`, default 200,000, ours' budget. (The zoo's n_timesteps
   for this env is 100,000: with it, RecurrentPPO ended below 475 on 2 of seeds 1-3, so it would
   have no time to 475 to compare; benchmarks/README.md gives that run.) The
   zoo's CartPoleNoVel-v1 zeroes the two velocities and keeps 4 numbers (rl_zoo3's
   MaskVelocityWrapper), where ours removes them: the same information; this file rebuilds that
   wrapper. A callback records each finished episode (the Monitor's `info["episode"]`, the raw
   return, under VecNormalize) with its wall-clock time, and stops learning once the 100-episode
   mean reaches 475, as `--target-return 475` stops ours. It runs in a child process of this same
   file (`--_sb3-child`).
3. `random`: uniformly random actions in CartPole-v1 (the velocities change nothing for it), in this
   process, `--random-episodes` episodes.

Seconds are counted from the moment this file launches the run's process, so they include Python's
start-up and the imports on both sides ("time from launch"). The runs go one after another,
interleaved by seed (seed 1: every variant, seed 2: ...), so that background load hits all alike.
Run it alone on an idle machine: on 2 cores anything beside it changes the seconds, not the steps.

Outputs
-------
The layout of cartpole_learning.py (harness.py runs, keeps and plots; see there), in
`--results-dir` (default benchmarks/results/memory_table/): `<variant>_seed<S>.csv` (step, return,
length of every episode), `random.csv`, `runs.json` (per run: the command, date, machine, and
`seconds_to`: the seconds from launch to each target), `table.md` (harness.py's table of returns
and first steps at 475, then this file's table of steps and seconds to 150 and to 475 per seed,
with the mean over the seeds that reached it and the ratio of lstm's mean seconds to 475 to
RecurrentPPO's), and the learning-curve plot (default benchmarks/plots/memory_learning.png).

How to run it (from the repository root)
----------------------------------------
    pip install -r requirements.txt -r benchmarks/requirements.txt
    python benchmarks/memory_table.py                      # all kinds, RecurrentPPO, random
    python benchmarks/memory_table.py --variants lstm sb3  # some again; the others' logs are kept
    python benchmarks/memory_table.py --plot-only          # table and plot from the kept logs
    python benchmarks/memory_table.py --seeds 1 --steps 4096 --attention-steps 4096 \
        --sb3-steps 2048 --random-episodes 10 --results-dir /tmp/memory_table_test   # a quick check
"""

import argparse
import json
import shlex
import statistics
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from harness import (REPO_ROOT, WINDOW, Learning, append_table, check_learning_arguments,
                     check_ready, first_reaching, fmt, learning_arguments, learning_report,
                     linear_schedule, load_report, mean_std, nice_prefix, read_timed_episodes,
                     run_learning, run_sb3_logged, run_status, timed_run)

# This file's top level imports only the standard library (and harness.py, which does too), so that
# the SB3 child pays for its own imports just like our script does.

ENV = "StatelessCartPole-v1"
KINDS = ("none", "framestack", "lstm", "gru", "attention")
TARGETS = (150.0, 475.0)  # RLlib's table's 150, and CartPole-v1's reward threshold
BENCH = Learning(
    name="memory_table",
    script=REPO_ROOT / "ppo_memory.py",
    variants=(*KINDS, "sb3", "random"),
    labels={"none": "ours, --memory none", "framestack": "ours, --memory framestack",
            "lstm": "ours, --memory lstm", "gru": "ours, --memory gru",
            "attention": "ours, --memory attention",
            "sb3": "sb3-contrib RecurrentPPO (rl-zoo CartPoleNoVel-v1)", "random": "random policy"},
    colors={"none": "tab:olive", "framestack": "tab:orange", "lstm": "tab:blue", "gru": "tab:cyan",
            "attention": "tab:purple", "sb3": "tab:green", "random": "tab:gray"},
    packages=("torch", "gymnasium", "stable-baselines3", "sb3-contrib", "numpy"),
    unit="episode",
    score="return",
    x_label="environment steps (all envs)",
    y_label=f"episode return (mean of the last {WINDOW} training episodes)",
    note=f"(ours: --steps, attention --attention-steps; RecurrentPPO: --sb3-steps, over which its "
    f"schedules anneal); every run stops once the mean return of its last {WINDOW} episodes "
    f"reaches {TARGETS[-1]:g}. Return: that mean at the run's end (stochastic policy); std over "
    "seeds; ratio = variant mean / RecurrentPPO's mean. steps/s: steady training speed, mean over "
    "seeds. Random policy: uniformly random actions in CartPole-v1.",
    target=TARGETS[-1],
    legend_loc="center right",
)


# --------------------------------------------------------------------------------------------------
# The runs: ours through its command line, RecurrentPPO in a child process, the random policy here
# --------------------------------------------------------------------------------------------------


def seconds_to(episodes, launch):
    """{target: seconds from `launch` (a time.time()) to the first episode after which the mean
    return of the last WINDOW episodes reached it, or None}; episodes carry their wall time last."""
    reached, recent = {}, []
    for episode in episodes:
        recent = (recent + [episode[1]])[-WINDOW:]
        mean = statistics.fmean(recent) if len(recent) == WINDOW else None
        for target in TARGETS:
            if target not in reached and mean is not None and mean >= target:
                reached[target] = round(episode[-1] - launch, 2)
    return {str(target): reached.get(target) for target in TARGETS}


def run_ours(kind, seed, args):
    """One run of ppo_memory.py: (run record, episodes, output tail)."""
    budget = args.attention_steps if kind == "attention" else args.steps
    with tempfile.TemporaryDirectory(prefix=f"{kind}_seed{seed}_") as tmp, \
            tempfile.TemporaryDirectory(prefix=f"{kind}_seed{seed}_log_") as log_dir:
        cmd = [*nice_prefix(args), sys.executable, str(BENCH.script), "--memory", kind, "--seed",
               str(seed), "--total-timesteps", str(budget), "--target-return", str(TARGETS[-1]),
               "--run-dir", tmp, *shlex.split(args.our_args)]
        launch = time.time()
        returncode, wall, tail = timed_run(cmd, args.timeout, log_dir)
        summary_path = Path(tmp) / "summary.json"
        summary = json.loads(summary_path.read_text()) if summary_path.exists() else None
        episodes = read_timed_episodes(tmp)
    record = {"status": run_status(returncode, summary, args.timeout), "exit_status": returncode,
              "command": shlex.join(cmd), "wall_seconds": round(wall, 2), "budget": budget,
              "steps": summary.get("steps") if summary else None,
              "steps_per_second": summary.get("steps_per_second") if summary else None,
              "seconds_to": seconds_to(episodes, launch)}
    return record, [episode[:3] for episode in episodes], tail


def run_variant(variant, seed, args):
    """One training run: (run record, episodes, output tail)."""
    if variant != "sb3":
        return run_ours(variant, seed, args)
    launch = time.time()
    record, episodes, tail = run_sb3_logged(__file__, seed, ["--steps", str(args.sb3_steps)], args)
    record.update(budget=args.sb3_steps, seconds_to=seconds_to(episodes, launch))
    return record, [episode[:3] for episode in episodes], tail


def mask_velocity(env):
    """rl_zoo3's MaskVelocityWrapper for CartPole: the velocities (entries 1 and 3) zeroed, 4
    numbers kept."""
    import gymnasium as gym
    import numpy as np

    mask = np.array([1.0, 0.0, 1.0, 0.0], dtype=np.float32)
    return gym.wrappers.TransformObservation(env, lambda obs: obs * mask, env.observation_space)


def sb3_child(seed, out_file, total_timesteps):
    """Train RecurrentPPO with the zoo's CartPoleNoVel-v1 settings until the 100-episode mean
    reaches the last target; write every finished episode (step, return, length, wall time) and the
    timings as JSON (the format of harness.py's `sb3_learn_and_record`)."""
    setup_start = time.perf_counter()
    import gymnasium as gym
    import torch.nn as nn
    from sb3_contrib import RecurrentPPO
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.vec_env import VecNormalize

    env = make_vec_env(lambda: mask_velocity(gym.make("CartPole-v1")), n_envs=8, seed=seed)
    env = VecNormalize(env, gamma=0.98)  # the zoo's `normalize: True`: observations and rewards
    model = RecurrentPPO(
        "MlpLstmPolicy", env, n_steps=32, batch_size=256, n_epochs=20, gamma=0.98, gae_lambda=0.8,
        ent_coef=0.0, learning_rate=linear_schedule(1e-3), clip_range=linear_schedule(0.2),
        policy_kwargs=dict(ortho_init=False, activation_fn=nn.ReLU, lstm_hidden_size=64,
                           enable_critic_lstm=True, net_arch=dict(pi=[64], vf=[64])),
        device="cpu", seed=seed, verbose=0)

    class RecordEpisodes(BaseCallback):
        """Each finished episode with its wall time; stop at the target, as ours does."""

        def __init__(self):
            super().__init__()
            self.episodes, self.lengths = [], [0] * env.num_envs
            self.rollouts_started = 0
            self.first_update_end = self.end = None

        def _on_rollout_start(self):
            self.rollouts_started += 1
            if self.rollouts_started == 2:
                self.first_update_end = (time.perf_counter(), self.num_timesteps)

        def _on_step(self):
            for i, info in enumerate(self.locals["infos"]):
                self.lengths[i] += 1
                if "episode" in info:
                    self.episodes.append((self.num_timesteps, float(info["episode"]["r"]),
                                          self.lengths[i], time.time()))
                    self.lengths[i] = 0
            recent = [episode[1] for episode in self.episodes[-WINDOW:]]
            return not (len(recent) == WINDOW and statistics.fmean(recent) >= TARGETS[-1])

        def _on_training_end(self):
            self.end = (time.perf_counter(), self.num_timesteps)

    callback = RecordEpisodes()
    learn_start = time.perf_counter()
    model.learn(total_timesteps=total_timesteps, callback=callback)
    learn_end = time.perf_counter()
    env.close()
    steady = None
    if callback.first_update_end and callback.end:
        (t0, s0), (t1, s1) = callback.first_update_end, callback.end
        steady = (s1 - s0) / (t1 - t0) if s1 > s0 else None
    Path(out_file).write_text(json.dumps({
        "steps": model.num_timesteps, "steps_per_second": steady,
        "setup_seconds": learn_start - setup_start, "learn_seconds": learn_end - learn_start,
        "episodes": callback.episodes}))


def play_random(args):
    """`args.random_count` episodes of uniformly random actions: (returns, lengths, how)."""
    import gymnasium as gym
    import numpy as np

    env = gym.make("CartPole-v1")
    rng = np.random.default_rng(args.random_seed)
    returns, lengths = [], []
    env.reset(seed=args.random_seed)  # seeded once; each later reset goes on from there
    while len(returns) < args.random_count:
        total, length, done = 0.0, 0, False
        while not done:
            _, reward, terminated, truncated, _ = env.step(int(rng.integers(2)))
            total, length, done = total + float(reward), length + 1, terminated or truncated
        returns.append(total)
        lengths.append(length)
        env.reset()
    env.close()
    command = (f"in this process: gymnasium.make('CartPole-v1'), reset(seed={args.random_seed}) "
               f"once, uniformly random actions, numpy.random.default_rng({args.random_seed})")
    return returns, lengths, command


# --------------------------------------------------------------------------------------------------
# The table of steps and seconds to 150 and 475
# --------------------------------------------------------------------------------------------------


def time_table(args):
    """Per variant and target: each seed's first step and seconds from launch (– if never), and
    the means over the seeds that reached it; then lstm's mean seconds to 475 against
    RecurrentPPO's."""
    runs, trained, _, _, _ = load_report(BENCH, args)
    seeds_heading = "".join(f" seed {seed} |" for seed in args.seeds)
    lines = ["| variant | target |" + seeds_heading + " mean steps | mean seconds |",
             "| --- | ---: |" + " ---: |" * (len(args.seeds) + 2)]
    mean_seconds = {}
    for variant, seeds in trained.items():
        for target in TARGETS:
            cells, steps, seconds = "", [], []
            for seed in args.seeds:
                if seed not in seeds:
                    cells += " – |"
                    continue
                record, episodes = seeds[seed]
                step = first_reaching(episodes, target)
                second = record.get("seconds_to", {}).get(str(target))
                cells += f" {fmt(step, ',')} ({fmt(second, '.1f')} s) |"
                if step is not None and second is not None:
                    steps.append(step)
                    seconds.append(second)
            share = f" ({len(steps)}/{len(seeds)} seeds)" if len(steps) < len(seeds) else ""
            mean_seconds[variant, target] = mean_std(seconds)[0] if len(steps) == len(seeds) \
                else None
            lines.append(f"| {BENCH.labels[variant]} | {target:g} |{cells} "
                         f"{fmt(mean_std(steps)[0], ',.0f')}{share} | "
                         f"{fmt(mean_std(seconds)[0], '.1f')}{share} |")
    ours, theirs = mean_seconds.get(("lstm", TARGETS[-1])), mean_seconds.get(("sb3", TARGETS[-1]))
    ratio = (f"RecurrentPPO's mean seconds to {TARGETS[-1]:g} / lstm's: "
             f"{fmt(theirs / ours if ours and theirs else None, '.2f')}x")
    notes = (f"Each cell: the first step at which the mean return of the last {WINDOW} finished "
             "episodes reached the target, and in brackets the seconds from launching the run's "
             "process (imports included) to the moment that episode was logged; – if never. "
             "Means over the seeds that reached it (all seeds for the ratio below).")
    return "\n".join(lines + [""] + textwrap.wrap(notes, width=100) + ["", ratio]) + "\n"


# --------------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------------


def parse_args():
    parser = argparse.ArgumentParser(
        description="Steps and seconds to a 100-episode mean of 150 and 475 on stateless CartPole: "
        "ppo_memory.py's kinds of memory with their defaults, sb3-contrib's RecurrentPPO with the "
        "rl-zoo's CartPoleNoVel-v1 settings, and a random policy.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    learning_arguments(parser, BENCH, steps=200_000, timeout=3600.0, plot_every=2000,
                       plot_help="the PNG (default: benchmarks/plots/memory_learning.png for the "
                       "default results dir, else inside the results dir)")
    parser.add_argument("--attention-steps", type=int, default=500_000,
                        help="env steps per run of --memory attention (--steps: the other kinds)")
    parser.add_argument("--sb3-steps", type=int, default=200_000,
                        help="RecurrentPPO's budget, over which its linear schedules anneal")
    args = parser.parse_args()
    args.env = ENV
    check_learning_arguments(parser, args, BENCH, "memory_learning.png")
    if min(args.attention_steps, args.sb3_steps) <= 0:
        parser.exit(2, "error: --attention-steps and --sb3-steps must be positive\n")
    return args


def main():
    args = parse_args()
    if args.sb3_child:
        seed, out_file = args.sb3_child
        sb3_child(int(seed), out_file, args.steps)
        return
    if args.plot_only:
        learning_report(BENCH, args)  # harness.py's table and plot
    else:
        check_ready(BENCH.script if set(KINDS) & set(args.variants) else None,
                    sb3="sb3" in args.variants)
        run_learning(BENCH, args, run_variant, play_random)  # ends with learning_report
    append_table(args.results_dir, time_table(args))


if __name__ == "__main__":
    main()
