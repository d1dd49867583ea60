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
   step, masked actions given probability 0 when acting and in the update (16 envs x 32 steps a
   rollout in 16 minibatches of 32, learning rate 2.5e-3 annealed to 0 over N, entropy bonus
   0.01; it stops after the rollout that reaches N: 391 rollouts, 200,192 steps by default).
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
what a user gets from either out of the box (their budgets are the same N; ours runs 512 steps a
rollout, MaskablePPO 2,048). Seconds are counted from the moment this file launches the run's process, so
they include Python's start-up and the imports on both sides ("time from launch"); ours logs its
episodes at the end of each rollout, MaskablePPO's callback as they end. The training runs go one
after another, interleaved by seed (seed 1: masks, no-masks, maskable; seed 2: ...), so that
background load hits all alike. Run it alone on an idle machine: on 2 cores anything beside it
changes the seconds, not the steps. (The default run took 16 minutes on an idle 2-core AMD
EPYC on 2026-11-29: MaskablePPO runs near 1,100 steps/s on its one env, about 3 minutes a run,
ours near 3,100-3,300, about a minute a run.)

The budget: 200,000 steps is ppo_spaces.py's default, and both reach 7 well within it (ours with
masks at 27k-65k steps on seeds 1-3, MaskablePPO at 54k-72k; AMD EPYC, 2026-11-29). Ours
anneals its learning rate over the budget, so its curve depends on it: with the defaults of
2026-11-25, seed 1 reached 7 at 97k steps with a 150k budget and 75k with 300k, but never with 90k
(it settled at -200, a policy that never delivers). MaskablePPO's constant learning rate makes its
curve the same for any budget.

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
    python benchmarks/spaces_learning.py --env Blackjack-v1   # Blackjack: ours and random, below
    python benchmarks/spaces_learning.py --env TestHybrid-v0  # a Dict action: ours and random
    python benchmarks/spaces_learning.py --env MiniGrid-DoorKey-5x5-v0  # ours, SB3 PPO, random

Blackjack-v1 (`--env Blackjack-v1`: issue 22's "Blackjack-v1 (Tuple observation) against random
play")
------------------------------------------------------------------------------------------------
Gymnasium's Blackjack-v1 with its defaults (sab=False, natural=False: an infinite deck, the dealer
stands on every 17, a natural pays 1 like any win, no doubling or splitting): a Tuple observation
(Discrete(32) player sum, Discrete(11) dealer card, Discrete(2) usable ace: one one-hot encoder
each), 2 actions (stick, hit), no mask, returns -1 / 0 / +1, 1-3 steps an episode. Two variants:

1. `ours`: `python ppo_spaces.py --env Blackjack-v1 --seed S --total-timesteps N --run-dir <tmp>`
   with the script's defaults (the Taxi ones above): they learn, so no setting is changed. A
   one-seed probe (seed 1, 300,000 steps) had a mean return of -0.17 over its first 20,000
   episodes and -0.04 over its last 20,000, against -0.047 for the optimal policy. Budget
   `--steps` 300,000 (default with this env): in the full run (2026-11-29, an idle 2-core AMD
   EPYC) seeds 1-3 averaged -0.053, -0.051 and -0.051 over their episodes after step
   100k (standard errors 0.003), and a 1,000-episode mean (standard error 0.03) still strays
   0.05 from the optimum now and then; a run took 2 minutes, the whole benchmark (3 seeds, the
   random policy, the report) 6 min 16 s. Its episodes are read as for Taxi: about 197,000 a
   run, so each `ours_seed<S>.csv` is about 2.4 MB.
2. `random`: uniformly random actions (stick or hit with probability 1/2 each),
   `--random-episodes` (default 100,000 with this env; a standard error near 0.003).

No MaskablePPO (Blackjack has no masks) and no target step: with returns of -1 / 0 / +1 (a standard
deviation near 0.9), a 100-episode mean has a standard error near 0.09, larger than the differences
that matter near the optimum (hundredths), and a 100-episode target near it would be "reached" by
chance. Instead, after harness.py's table (its "return at end": the last 100 episodes), this file's
table gives each run's mean return over its last 1,000 training episodes with its standard error,
and over its last 10,000, against the random floor and the optimal policy's value, with the share of
the gap from random play to the optimum closed (the training policy samples its actions, so it stays
a little under a greedy one).

The optimal value is computed exactly, in this file (`blackjack_values`), by dynamic programming
over the env's rules as written in gymnasium's `blackjack.py` (cards 1-10 with 10 four times as
likely, drawn with replacement; the dealer draws to a sum of 17 or more with a usable ace counted
as 11; the player's hit busts above 21 for -1; stick compares the scores, a dealer bust counting as
0): the value of the best of stick and hit in each (player cards' sum, ace held, dealer's card),
averaged over the first two cards and the dealer's card. With a deck this infinite the observation
holds all that matters, so the best policy on it is the optimum: -0.0466 a hand (-0.04656).
Played in the env for 200,000 hands (seed 123) that policy gave -0.045 (standard error 0.002).
The same recursion with each action taken with probability 1/2 gives the random floor exactly
(-0.3959), which the table shows beside the played one.

Outputs as for Taxi, in benchmarks/results/spaces_learning_blackjack/ (`ours_seed<S>.csv`,
`random.csv`, `runs.json`, `table.md`: harness.py's table, then this file's), and the plot
benchmarks/plots/spaces_blackjack_learning.png, this file's own: the mean return of each run's last
1,000 episodes every `--plot-every` steps (from its 1,000th on), per variant the mean over seeds
and the min–max band; the random floor ± one standard error; the optimal value dotted.

TestHybrid-v0 (`--env TestHybrid-v0`: issue 22's "a hybrid-action env written in tests/ learns to
within 5% of the optimum")
------------------------------------------------------------------------------------------------
tests/spaces_envs.py's HybridEnv (tests/ is put on the path; our script gets `--env
spaces_envs:TestHybrid-v0`): one step an episode; the observation a Dict of a mode (Discrete(3))
and a target t in [-1, 1]; the action a Dict of a choice (Discrete(3)) and a parameter p (Box in
[-1, 1]); reward 1 - |p - t| for the right choice, else 0. Its docstring derives the optimum, 1 (the
right choice, p = t), and the value of uniformly random actions, 1/9. Two variants:

1. `ours`: `python ppo_spaces.py --env spaces_envs:TestHybrid-v0 --seed S --total-timesteps N
   --run-dir <tmp>`, the script's defaults (those Taxi, Blackjack and MiniGrid run with). Budget
   `--steps` 100,000 (default with this env).
2. `random`: `action_space.sample()` (harness.py's `random_episodes`), `--random-episodes`
   (default 100,000 with this env).

The target is 0.95, within 5% of the optimum: harness.py's table gives the first step at which the
100-episode mean reached it; this file's table then the mean return of each run's last 1,000
episodes ± its standard error and its share of the optimum; the plot (benchmarks/plots/
spaces_hybrid_learning.png) the 1,000-episode mean, the random floor and the optimum. Logs in
benchmarks/results/spaces_learning_hybrid/.

MiniGrid-DoorKey-5x5-v0 (`--env MiniGrid-DoorKey-5x5-v0`: issue 22's "MiniGrid-DoorKey-5x5-v0 with
its full Dict observation, against SB3 PPO with MultiInputPolicy at the same budget")
------------------------------------------------------------------------------------------------
minigrid's DoorKey-5x5 (`pip install minigrid`): pick up the key, open the door, reach the goal;
reward 1 - 0.9 * (steps / 250) on reaching it, else 0; 250 steps at most (a truncation). Its
observation is a Dict of a 7x7x3 uint8 image (the agent's view, as object, colour and state codes),
a direction (Discrete(4)) and a mission (a MissionSpace of text). Three variants, each over seeds
1-3 with the same budget `--steps` N (default 300,000):

1. `ours`: `python ppo_spaces.py --env minigrid:MiniGrid-DoorKey-5x5-v0 --seed S
   --total-timesteps N --run-dir <tmp>` with the script's defaults: the full Dict observation,
   the 7x7x3 image whole into the linear layer (a side under 16), the direction one-hot, the
   mission left out with one start-up line. The defaults were chosen by measurement (below).
2. `sb3`: Stable-Baselines3 PPO with MultiInputPolicy, in a child process of this file
   (`minigrid_sb3_child`): the rl-baselines3-zoo's DoorKey-5x5 recipe from the days it used the Dict
   observation (rl_zoo3 1.8, hyperparams/ppo.yml; its later versions flatten everything with
   minigrid's FlatObsWrapper into an MlpPolicy instead). SB3 cannot take the mission leaf, so
   gymnasium's `FilterObservation(env, ["image", "direction"])` drops it: the recipe is that
   entry (normalize, 8 envs, n_steps 128, batch 64, 10 epochs, gamma 0.99, GAE lambda 0.95, clip
   0.2, no entropy bonus, learning rate 2.5e-4 constant) with the mission dropped. `normalize`
   is VecNormalize over the image and the rewards (SB3 can normalise only Box keys; the direction
   is one-hot encoded); the normalised image is flattened by SB3's CombinedExtractor into 64-64
   tanh MLPs. Each finished episode is recorded with its raw return, as for MaskablePPO above.
3. `random`: `action_space.sample()`, `--random-episodes` (default 100).

Reported as for Taxi: harness.py's table (each seed's final 100-episode mean return and its first
step at a mean of 0.9), then this file's table of steps and seconds from launch to 0.9 (means and
medians) with SB3's mean seconds over ours; the plot benchmarks/plots/spaces_doorkey_learning.png.
Logs in benchmarks/results/spaces_learning_doorkey/. To time more seeds, `--stop-at-target --seeds
1 2 ... 10` ends every trained run at the target (ours by `--target-return`, SB3 by its callback's
`stop_at`), which changes no step before it: the same steps and seconds, in a fraction of the time.

How the defaults came to learn DoorKey. With the defaults of 2026-11-25 (Taxi's: 16 envs x 128
steps, 4 minibatches, learning rate 2.5e-3) DoorKey never reached 0.9: the mean fell from 0.6 in the
first rollout to 0.0-0.1, a policy that wanders until the time limit. SB3's recipe in our flags (8
envs x 128 steps, 16 minibatches of 64, 10 epochs, learning rate 2.5e-4) reached it at 35k steps
(seed 1), and a scratch copy that read MiniGrid's codes (0-10 in a uint8 Box declared 0-255)
standardised by running statistics, as SB3's VecNormalize does, rather than divided by 255, at 18k.
Both went into the script (issue 36): observations normalised by running statistics, and the
defaults of benchmarks/README.md's speed sweep (16 envs x 32 steps, 16 minibatches, 4 epochs,
learning rate 2.5e-3), which reach 0.9 on DoorKey and keep Taxi, Blackjack and the hybrid env.
Then 4 minibatches for observations with an image leaf (benchmarks/README.md, "Minibatches by
observation kind"): DoorKey's median over seeds 1-10 fell from 20,048 steps to 16,176.
"""

import argparse
import datetime
import importlib.metadata
import json
import os
import shlex
import statistics
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from harness import (REPO_ROOT, WINDOW, Learning, append_table, check_learning_arguments,
                     check_ready, display, first_reaching, fmt, learning_arguments, learning_plot,
                     learning_report, load_report, mean_std, nice_prefix, read_csv, random_episodes,
                     read_timed_episodes, run_learning, run_sb3_logged, run_status, save_run,
                     sb3_learn_and_record, timed_run, write_csv)

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

BLACKJACK = "Blackjack-v1"
FINAL_WINDOW, LONG_WINDOW = 1_000, 10_000  # episodes in this file's Blackjack table and plot
BLACKJACK_BENCH = Learning(
    name="spaces_learning_blackjack",
    script=REPO_ROOT / "ppo_spaces.py",
    variants=("ours", "random"),
    labels={"ours": "ours, ppo_spaces.py (defaults)", "random": "uniformly random actions"},
    colors={"ours": "tab:blue", "random": "tab:gray"},
    packages=("torch", "gymnasium", "numpy"),
    unit="episode",
    score="return",
    x_label="environment steps (all envs)",
    y_label=f"episode return (mean of the last {FINAL_WINDOW:,} training episodes)",
    note=f"(ours anneals its learning rate over it). Return: the mean return of each run's last "
    f"{WINDOW} training episodes at its end (stochastic policy; a standard error near 0.1: see "
    f"the next table for the last {FINAL_WINDOW:,}); std over seeds; no ratio: no SB3 variant. "
    "steps/s: steady training speed (from the end of the first update), mean over seeds. Random "
    f"policy: stick or hit with probability 1/2 each, in gymnasium's {BLACKJACK}.",
    legend_loc="lower right",
)

HYBRID = "TestHybrid-v0"  # tests/spaces_envs.py's HybridEnv: a Dict of a choice and a parameter
HYBRID_OPTIMUM, HYBRID_RANDOM = 1.0, 1 / 9  # derived in HybridEnv's docstring
HYBRID_TARGET = 0.95 * HYBRID_OPTIMUM  # within 5% of the optimum
HYBRID_BENCH = Learning(
    name="spaces_learning_hybrid",
    script=REPO_ROOT / "ppo_spaces.py",
    variants=("ours", "random"),
    labels={"ours": "ours, ppo_spaces.py (defaults)",
            "random": "uniformly random actions"},
    colors={"ours": "tab:blue", "random": "tab:gray"},
    packages=("torch", "gymnasium", "numpy"),
    unit="episode",
    score="return",
    x_label="environment steps (all envs; one step an episode)",
    y_label=f"episode return (mean of the last {FINAL_WINDOW:,} training episodes)",
    note=f"(ours anneals its learning rate over it). Return: the mean return of each run's last "
    f"{WINDOW} training episodes at its end (the policy samples: the Gaussian's spread costs a "
    f"little); std over seeds; no ratio: no SB3 variant (SB3 has no Dict actions). First step at "
    f"≥ {HYBRID_TARGET:g}: within 5% of the optimum {HYBRID_OPTIMUM:g} (– if never). steps/s: "
    "steady training speed, mean over seeds. Random policy: action_space.sample() (a uniform "
    f"choice and parameter; exactly {HYBRID_RANDOM:.4f} in expectation).",
    target=HYBRID_TARGET,
    legend_loc="center right",
)

DOORKEY = "MiniGrid-DoorKey-5x5-v0"
DOORKEY_TARGET = 0.9  # issue 22's target, over 100 consecutive episodes
DOORKEY_BENCH = Learning(
    name="spaces_learning_doorkey",
    script=REPO_ROOT / "ppo_spaces.py",
    variants=("ours", "sb3", "random"),
    labels={"ours": "ours, ppo_spaces.py (defaults)",
            "sb3": "SB3 PPO, MultiInputPolicy (rl-zoo 1.8 recipe, mission dropped)",
            "random": "uniformly random actions"},
    colors={"ours": "tab:blue", "sb3": "tab:red", "random": "tab:gray"},
    packages=("torch", "gymnasium", "minigrid", "stable-baselines3", "numpy"),
    unit="episode",
    score="return",
    x_label="environment steps (all envs)",
    y_label=f"episode return (mean of the last {WINDOW} training episodes)",
    note=f"(ours anneals its learning rate over it; SB3 keeps its constant 2.5e-4). Return: the "
    f"mean return of each run's last {WINDOW} training episodes at its end (stochastic "
    f"policies); std over seeds; ratio: to SB3's mean. First step at ≥ {DOORKEY_TARGET:g}: the "
    f"first step at which the mean return of the run's last {WINDOW} finished episodes reached "
    f"{DOORKEY_TARGET:g} (– if never); its mean ± std is over the seeds that reached it. steps/s: "
    "steady training speed (from the end of the first update), mean over seeds. Random policy: "
    f"action_space.sample() in minigrid's {DOORKEY}.",
    target=DOORKEY_TARGET,
    legend_loc="lower right",
)
EMPTY = "MiniGrid-Empty-Random-6x6-v0"  # issue 36: reach the goal square from a random start
EMPTY_BENCH = Learning(
    name="spaces_learning_empty",
    script=REPO_ROOT / "ppo_spaces.py",
    variants=("ours", "sb3", "random"),
    labels={"ours": "ours, ppo_spaces.py (defaults)",
            "sb3": "SB3 PPO, MultiInputPolicy (rl-zoo's MiniGrid recipe, mission dropped)",
            "random": "uniformly random actions"},
    colors={"ours": "tab:blue", "sb3": "tab:red", "random": "tab:gray"},
    packages=("torch", "gymnasium", "minigrid", "stable-baselines3", "numpy"),
    unit="episode",
    score="return",
    x_label="environment steps (all envs)",
    y_label=f"episode return (mean of the last {WINDOW} training episodes)",
    note=DOORKEY_BENCH.note.replace(DOORKEY, EMPTY),
    target=DOORKEY_TARGET,
    legend_loc="lower right",
)
BENCHES = {ENV: BENCH, BLACKJACK: BLACKJACK_BENCH, HYBRID: HYBRID_BENCH, DOORKEY: DOORKEY_BENCH,
           EMPTY: EMPTY_BENCH}
MINIGRID = (DOORKEY, EMPTY)  # ours against SB3's MiniGrid recipe (`minigrid_sb3_child`)
# The --env our script and gymnasium.make are given: an env outside gymnasium comes with the
# module that registers it (tests/ is put on the path for spaces_envs).
ENV_IDS = {HYBRID: f"spaces_envs:{HYBRID}", DOORKEY: f"minigrid:{DOORKEY}",
           EMPTY: f"minigrid:{EMPTY}"}
TESTS_DIR = REPO_ROOT / "tests"


# --------------------------------------------------------------------------------------------------
# The runs: ours through its command line, MaskablePPO in a child process, the random policy here
# --------------------------------------------------------------------------------------------------


def seconds_to_target(episodes, launch, target):
    """(step, seconds from `launch`, a time.time()) of the first episode after which the mean
    return of the last WINDOW episodes reached the target, or (None, None); episodes carry their
    wall time last."""
    step = first_reaching([episode[:3] for episode in episodes], target)
    if step is None:
        return None, None
    wall_time = next(episode[-1] for episode in episodes if episode[0] == step)
    return step, round(wall_time - launch, 2)


def run_ours(variant, seed, args):
    """One run of ppo_spaces.py: (run record, episodes, output tail)."""
    masks = ["--no-action-mask"] if variant == "no-masks" else []  # "ours": the defaults
    with tempfile.TemporaryDirectory(prefix=f"{variant}_seed{seed}_") as tmp, \
            tempfile.TemporaryDirectory(prefix=f"{variant}_seed{seed}_log_") as log_dir:
        stop = ["--target-return", str(BENCHES[args.env].target)] if args.stop_at_target else []
        cmd = [*nice_prefix(args), sys.executable, str(BENCH.script), "--env",
               ENV_IDS.get(args.env, args.env), "--seed",
               str(seed), "--total-timesteps", str(args.steps), *masks, *stop, "--run-dir", tmp,
               *shlex.split(args.our_args)]
        launch = time.time()
        returncode, wall, tail = timed_run(cmd, args.timeout, log_dir)
        summary_path = Path(tmp) / "summary.json"
        summary = json.loads(summary_path.read_text()) if summary_path.exists() else None
        episodes = read_timed_episodes(tmp)
    target = BENCHES[args.env].target
    step, seconds = (seconds_to_target(episodes, launch, target) if target is not None
                     else (None, None))
    record = {"status": run_status(returncode, summary, args.timeout), "exit_status": returncode,
              "command": shlex.join(cmd), "wall_seconds": round(wall, 2),
              "steps": summary.get("steps") if summary else None,
              "steps_per_second": summary.get("steps_per_second") if summary else None,
              "target_step": step, "target_seconds": seconds}
    return record, [episode[:3] for episode in episodes], tail


def run_variant(variant, seed, args):
    """One training run: (run record, episodes, output tail)."""
    stop = ["--stop-at-target"] if args.stop_at_target else []
    if variant == "maskable":  # its record gets target_step and target_seconds from harness.py
        return run_sb3_logged(__file__, seed, ["--steps", str(args.steps), *stop], args,
                              target=TARGET_RETURN)
    if variant == "sb3":
        return run_sb3_logged(__file__, seed, ["--env", args.env, "--steps", str(args.steps),
                                               *stop], args, target=DOORKEY_TARGET)
    return run_ours(variant, seed, args)


def sb3_child(seed, out_file, total_timesteps, stop_at=None):
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
    sb3_learn_and_record(model, env, total_timesteps, out_file, setup_start, stop_at)


def minigrid_sb3_child(env_id, seed, out_file, total_timesteps, stop_at=None):
    """Train SB3 PPO on a MiniGrid env (DoorKey-5x5, Empty-Random-6x6) with the
    rl-baselines3-zoo's recipe for MiniGrid-DoorKey-5x5-v0 from the days of its Dict observation
    (rl_zoo3 1.8, hyperparams/ppo.yml; in rl_zoo3 2.0 the same numbers are its "minigrid-defaults"
    for every MiniGrid env, Empty-Random-5x5 first, on a flattened observation): MultiInputPolicy,
    normalize, 8 envs, n_steps 128, batch 64, 10 epochs, gamma 0.99, GAE lambda 0.95, clip 0.2, no
    entropy bonus, learning rate 2.5e-4); SB3 cannot take the Text-like mission leaf, so
    gymnasium's FilterObservation keeps "image" and "direction" (the zoo's later recipe flattens
    everything with minigrid's FlatObsWrapper and an MlpPolicy instead). VecNormalize normalises
    the image (the direction, a Discrete, cannot be: SB3 one-hot encodes it) and the rewards; a
    normalised image is no longer an image to SB3, so its CombinedExtractor flattens it (as it
    would have in the zoo's day: NatureCNN needs 36x36 pixels or more) into the 64-64 tanh MLPs.
    Every finished episode is recorded with its raw return (the Monitor sits below VecNormalize)."""
    setup_start = time.perf_counter()
    import minigrid  # noqa: F401  (registers the MiniGrid ids)
    from gymnasium.wrappers import FilterObservation
    from stable_baselines3 import PPO
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.vec_env import VecNormalize

    env = make_vec_env(env_id, n_envs=8, seed=seed,
                       wrapper_class=lambda env: FilterObservation(env, ["image", "direction"]))
    env = VecNormalize(env, norm_obs_keys=["image"], gamma=0.99)
    model = PPO("MultiInputPolicy", env, n_steps=128, batch_size=64, n_epochs=10, gamma=0.99,
                gae_lambda=0.95, clip_range=0.2, ent_coef=0.0, learning_rate=2.5e-4, seed=seed,
                device="cpu", verbose=0)
    sb3_learn_and_record(model, env, total_timesteps, out_file, setup_start, stop_at)


def random_allowed(args, use_mask):
    """`args.random_count` episodes of uniformly random actions, among those the mask allows with
    `use_mask`, else among all 6: (returns, lengths, how)."""
    import gymnasium as gym
    import numpy as np

    env = gym.make(args.env)
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
           else "uniformly random actions, the mask ignored" if args.env == ENV
           else "uniformly random actions")
    command = (f"in this process: gymnasium.make({args.env!r}), "
               f"reset(seed={args.random_seed}) once, "
               f"{how}, numpy.random.default_rng({args.random_seed})")
    return returns, lengths, command


def play_random(args):
    """The floor, random allowed actions: (returns, lengths, how), which run_learning keeps. Also,
    as cheap, random actions that ignore the mask, kept here (random_unmasked.csv, runs.json).
    Blackjack has no mask: uniformly random actions only."""
    if args.env in ENV_IDS:  # a Dict action (hybrid) or an env from another package
        return random_episodes(ENV_IDS[args.env], args.random_count, args.random_seed)
    if args.env != ENV:
        return random_allowed(args, use_mask=False)
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


# (ours, the reference, the reference's name in the ratio line) per env with a table of seconds
TIMED = {ENV: ("masks", "maskable", "MaskablePPO's mean seconds to {target} / ours with masks"),
         DOORKEY: ("ours", "sb3", "SB3 PPO's mean seconds to {target} / ours"),
         EMPTY: ("ours", "sb3", "SB3 PPO's mean seconds to {target} / ours")}


def time_table(args):
    """Per variant: each seed's first step and seconds from launch at which the 100-episode mean
    reached the target (7 on Taxi, 0.9 on DoorKey; – if never), the means over the seeds that
    reached it; the reference's mean seconds over ours' (MaskablePPO, SB3 PPO); the random
    policies."""
    bench = BENCHES[args.env]
    target, (ours_variant, theirs_variant, ratio_words) = bench.target, TIMED[args.env]
    runs, trained, random_returns, _, _ = load_report(bench, args)
    seeds_heading = "".join(f" seed {seed} |" for seed in args.seeds)
    lines = [f"| variant |{seeds_heading} mean steps | median steps | mean seconds | median "
             "seconds | final return, mean |", "| --- |" + " ---: |" * (len(args.seeds) + 5)]
    mean_seconds = {}
    for variant, seeds in trained.items():
        cells, steps, seconds, finals = "", [], [], []
        for seed in args.seeds:
            if seed not in seeds:
                cells += " – |"
                continue
            record, episodes = seeds[seed]
            step = first_reaching(episodes, target)
            second = record.get("target_seconds")
            cells += f" {fmt(step, ',')} ({fmt(second, '.1f')} s) |"
            if step is not None and second is not None:
                steps.append(step)
                seconds.append(second)
            if episodes:
                finals.append(statistics.fmean(e[1] for e in episodes[-WINDOW:]))
        share = f" ({len(steps)}/{len(seeds)} seeds)" if len(steps) < len(seeds) else ""
        mean_seconds[variant] = mean_std(seconds)[0] if len(steps) == len(seeds) else None
        medians = [statistics.median(values) if values else None for values in (steps, seconds)]
        lines.append(f"| {bench.labels[variant]} |{cells} {fmt(mean_std(steps)[0], ',.0f')}{share}"
                     f" | {fmt(medians[0], ',.0f')}{share} | {fmt(mean_std(seconds)[0], '.1f')}"
                     f"{share} | {fmt(medians[1], '.1f')}{share} |"
                     f" {fmt(mean_std(finals)[0], '.2f')} |")
    ours, theirs = mean_seconds.get(ours_variant), mean_seconds.get(theirs_variant)
    ratio = (ratio_words.format(target=f"{target:g}") + ": "
             f"{fmt(theirs / ours if ours and theirs else None, '.2f')}x")
    notes = (f"Each cell: the first step at which the mean return of the last {WINDOW} finished "
             f"episodes reached {target:g}, and in brackets the seconds from launching the "
             "run's process (imports included) to the moment that episode was logged; – if "
             "never. "
             "Means and medians over the seeds that reached it (all seeds for the ratio below). "
             f"Final return: the mean over seeds of each run's last {WINDOW} episodes' mean (at "
             "the target for runs that --stop-at-target ended there).")
    floors = []
    if random_returns:
        mean, std = mean_std(random_returns)
        floors.append(f"{bench.labels['random']} (the floor) {mean:.2f} ± {std:.2f} over "
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


# --------------------------------------------------------------------------------------------------
# Blackjack: the exact values of the optimal and the random policy, the table and the plot
# --------------------------------------------------------------------------------------------------


def blackjack_values():
    """(optimal, random): the exact expected return of a hand of gymnasium's Blackjack-v1
    (sab=False, natural=False) under the optimal policy and under stick or hit with probability 1/2,
    by dynamic programming over its rules (blackjack.py): cards 1-10 (10 four times as likely) drawn
    with replacement; an ace counts 11 while that keeps the sum at 21 or under; the dealer draws to
    17 or more; a hit over 21 loses 1; stick compares the scores, a dealer bust scoring 0. A hand is
    its cards' sum with aces as 1 and whether it holds an ace; with an infinite deck that (and the
    dealer's card) is all that matters, and it is what the observation tells."""
    from fractions import Fraction
    from functools import lru_cache

    card = {c: Fraction(4 if c == 10 else 1, 13) for c in range(1, 11)}

    def total(cards_sum, ace):  # an ace counted as 11 where that does not bust
        return cards_sum + 10 if ace and cards_sum + 10 <= 21 else cards_sum

    @lru_cache(maxsize=None)
    def dealer(cards_sum, ace):  # {final score (0: bust): probability}
        if total(cards_sum, ace) >= 17:
            return {0 if total(cards_sum, ace) > 21 else total(cards_sum, ace): Fraction(1)}
        scores = {}
        for c, p in card.items():
            for score, q in dealer(cards_sum + c, ace or c == 1).items():
                scores[score] = scores.get(score, 0) + p * q
        return scores

    @lru_cache(maxsize=None)
    def stick(cards_sum, ace, up):  # the dealer's hole card is drawn like any other
        mine = total(cards_sum, ace)
        return sum(p * q * ((mine > score) - (mine < score)) for c, p in card.items()
                   for score, q in dealer(up + c, up == 1 or c == 1).items())

    @lru_cache(maxsize=None)
    def value(cards_sum, ace, up, best):
        def after(c):
            if total(cards_sum + c, ace or c == 1) > 21:
                return -1
            return value(cards_sum + c, ace or c == 1, up, best)
        hit = sum(p * after(c) for c, p in card.items())
        both = (stick(cards_sum, ace, up), hit)
        return max(both) if best else sum(both) / 2

    def start(best):
        return sum(p_up * p1 * p2 * value(c1 + c2, c1 == 1 or c2 == 1, up, best)
                   for up, p_up in card.items() for c1, p1 in card.items()
                   for c2, p2 in card.items())

    return float(start(True)), float(start(False))


def last_mean(episodes, count):
    """(mean, standard error) of the returns of the last `count` episodes, or (None, None)."""
    returns = [e[1] for e in episodes[-count:]]
    if len(returns) < 2:
        return None, None
    return statistics.fmean(returns), statistics.stdev(returns) / len(returns) ** 0.5


def blackjack_table(args, trained, random_returns, optimal, random_exact):
    """Per seed the mean return of the last FINAL_WINDOW episodes ± its standard error, the mean
    over seeds, the last LONG_WINDOW's, the share of the gap from random to optimal closed; the
    random floor as played and exact; the optimal value."""
    seeds_heading = "".join(f" seed {seed}: last {FINAL_WINDOW:,} |" for seed in args.seeds)
    lines = [f"| variant |{seeds_heading} mean ± std over seeds | last {LONG_WINDOW:,}, mean over "
             "seeds | gap closed (random → optimal) |",
             "| --- |" + " ---: |" * (len(args.seeds) + 3)]
    floor = mean_std(random_returns)[0] if random_returns else random_exact
    for variant, seeds in trained.items():
        finals, longs, cells = [], [], ""
        for seed in args.seeds:
            mean, error = last_mean(seeds[seed][1], FINAL_WINDOW) if seed in seeds else (None, None)
            cells += f" {fmt(mean, '.3f')} ± {fmt(error, '.3f')} |" if mean is not None else " – |"
            if mean is not None:
                finals.append(mean)
                longs.append(last_mean(seeds[seed][1], LONG_WINDOW)[0])
        mean, std = mean_std(finals)
        long = mean_std(longs)[0]
        gap = None if mean is None else (mean - floor) / (optimal - floor)
        lines.append(f"| {BLACKJACK_BENCH.labels[variant]} |{cells} **{fmt(mean, '.3f')}** ± "
                     f"{fmt(std, '.3f')} | {fmt(long, '.3f')} | {fmt(gap, '.0%')} |")
    blank = " – |" * len(args.seeds)
    if random_returns:
        mean, std = mean_std(random_returns)
        error = std / len(random_returns) ** 0.5
        lines.append(f"| {BLACKJACK_BENCH.labels['random']}, played |{blank} {mean:.3f} ± "
                     f"{error:.3f} (standard error, {len(random_returns):,} episodes) | – | 0% |")
    lines.append(f"| {BLACKJACK_BENCH.labels['random']}, exact |{blank} {random_exact:.4f} "
                 "| – | – |")
    lines.append(f"| the optimal policy, exact |{blank} {optimal:.4f} | – | 100% |")
    notes = (f"Each seed: the mean return of the run's last {FINAL_WINDOW:,} training episodes "
             "(its policy samples its actions) ± its standard error; mean ± std over seeds of "
             "those; "
             f"the mean over seeds of each run's last {LONG_WINDOW:,}; gap closed: (that "
             f"{FINAL_WINDOW:,}-episode mean − random) / (optimal − random), with random the "
             "played floor. Exact values: this file's blackjack_values, dynamic programming over "
             f"gymnasium's {BLACKJACK} rules (sab=False, natural=False); the optimal one is the "
             "best policy's expected return a hand, the random one that of stick or hit with "
             "probability 1/2.")
    return "\n".join(lines + [""] + textwrap.wrap(notes, width=100)) + "\n"


def blackjack_report(args):
    """Append this file's table to table.md (after harness.py's) and print it; redraw the plot with
    the FINAL_WINDOW-episode mean and the optimal value."""
    _, trained, random_returns, budgets, _ = load_report(BLACKJACK_BENCH, args)
    optimal, random_exact = blackjack_values()
    text = blackjack_table(args, trained, random_returns, optimal, random_exact)
    print()
    print(text, end="")
    with open(args.results_dir / "table.md", "a") as table:
        table.write("\n" + text)
    # A FINAL_WINDOW-episode mean: one of 100 is too noisy on Blackjack's -1 / 0 / +1.
    learning_plot(BLACKJACK_BENCH, args, trained, random_returns, budgets, args.plot,
                  window=FINAL_WINDOW, min_episodes=FINAL_WINDOW,
                  reference=(optimal, f"optimal policy, exact: {optimal:.4f} a hand"))
    print(f"\nredrew {display(args.plot)} (last {FINAL_WINDOW:,} episodes, the optimal value)")


# --------------------------------------------------------------------------------------------------
# The hybrid action: the final returns against the optimum, the plot
# --------------------------------------------------------------------------------------------------


def hybrid_report(args):
    """Append to table.md (after harness.py's) and print: per seed the mean return of the last
    FINAL_WINDOW episodes ± its standard error as a share of the optimum, and whether it is
    within 5% of it; redraw the plot with the FINAL_WINDOW-episode mean and the optimum."""
    _, trained, random_returns, budgets, _ = load_report(HYBRID_BENCH, args)
    seeds_heading = "".join(f" seed {seed}: last {FINAL_WINDOW:,} |" for seed in args.seeds)
    lines = [f"| variant |{seeds_heading} mean over seeds | share of the optimum |",
             "| --- |" + " ---: |" * (len(args.seeds) + 2)]
    for variant, seeds in trained.items():
        finals, cells = [], ""
        for seed in args.seeds:
            mean, error = last_mean(seeds[seed][1], FINAL_WINDOW) if seed in seeds else (None, None)
            cells += f" {fmt(mean, '.3f')} ± {fmt(error, '.3f')} |" if mean is not None else " – |"
            if mean is not None:
                finals.append(mean)
        mean = mean_std(finals)[0]
        share = None if mean is None else mean / HYBRID_OPTIMUM
        lines.append(f"| {HYBRID_BENCH.labels[variant]} |{cells} **{fmt(mean, '.3f')}** | "
                     f"{fmt(share, '.1%')} |")
    blank = " – |" * len(args.seeds)
    if random_returns:
        mean, std = mean_std(random_returns)
        lines.append(f"| {HYBRID_BENCH.labels['random']}, played |{blank} {mean:.3f} ± "
                     f"{std / len(random_returns) ** 0.5:.3f} (standard error) | "
                     f"{mean / HYBRID_OPTIMUM:.1%} |")
    lines.append(f"| {HYBRID_BENCH.labels['random']}, exact (1/9) |{blank} {HYBRID_RANDOM:.4f} | "
                 f"{HYBRID_RANDOM / HYBRID_OPTIMUM:.1%} |")
    lines.append(f"| the optimum (c = m, p = t) |{blank} {HYBRID_OPTIMUM:.4f} | 100.0% |")
    notes = (f"Each seed: the mean return of the run's last {FINAL_WINDOW:,} training episodes "
             "(one step each; its policy samples the choice and the Gaussian parameter) ± its "
             f"standard error; within 5% of the optimum means at least {HYBRID_TARGET:g}. The "
             "optimum and the random policy's value are derived in HybridEnv's docstring "
             "(tests/spaces_envs.py).")
    text = "\n".join(lines + [""] + textwrap.wrap(notes, width=100)) + "\n"
    print()
    print(text, end="")
    with open(args.results_dir / "table.md", "a") as table:
        table.write("\n" + text)
    learning_plot(HYBRID_BENCH, args, trained, random_returns, budgets, args.plot,
                  window=FINAL_WINDOW, min_episodes=FINAL_WINDOW,
                  reference=(HYBRID_OPTIMUM, f"optimum {HYBRID_OPTIMUM:g} (target "
                             f"{HYBRID_TARGET:g}: within 5%)"))
    print(f"\nredrew {display(args.plot)} (last {FINAL_WINDOW:,} episodes, the optimum)")


# --------------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------------


# Per env: the default budget, the timeout of a run, and the plot's file name.
DEFAULTS = {ENV: (200_000, 1800.0, "spaces_taxi_learning.png"),
            BLACKJACK: (300_000, 900.0, "spaces_blackjack_learning.png"),
            HYBRID: (100_000, 900.0, "spaces_hybrid_learning.png"),
            DOORKEY: (300_000, 1800.0, "spaces_doorkey_learning.png"),
            EMPTY: (100_000, 1800.0, "spaces_empty_learning.png")}


def parse_args():
    # --env first: the variants and the defaults depend on it
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--env", choices=list(BENCHES), default=ENV)
    env = pre.parse_known_args()[0].env
    bench = BENCHES[env]
    parser = argparse.ArgumentParser(
        description="Learning curves and steps and seconds to a 100-episode mean return of 7 on "
        "Taxi-v4 over seeds: ppo_spaces.py with and without action masks, sb3-contrib's "
        "MaskablePPO with its defaults, and random allowed actions. With --env Blackjack-v1: "
        "ppo_spaces.py against random actions and the exact optimal value; TestHybrid-v0: "
        "ppo_spaces.py on a Dict action (tests/spaces_envs.py) against its optimum; "
        "MiniGrid-DoorKey-5x5-v0: ppo_spaces.py against SB3 PPO, steps and seconds to 0.9.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--env", choices=list(BENCHES), default=ENV,
                        help="Taxi-v4: four variants, the steps to 7; Blackjack-v1: ours and "
                        "random, the final returns against the optimal policy's; TestHybrid-v0: "
                        "ours and random against the optimum; MiniGrid-DoorKey-5x5-v0: ours, SB3 "
                        "and random, the steps to 0.9 (--help with it shows its defaults)")
    steps, timeout, plot_name = DEFAULTS[env]
    learning_arguments(parser, bench, steps=steps, timeout=timeout, plot_every=2000,
                       plot_help=f"the PNG (default: benchmarks/plots/{plot_name} for the "
                       "default results dir, else inside the results dir)")
    if env in (BLACKJACK, HYBRID):
        parser.set_defaults(random_count=100_000)
    if env in TIMED:
        parser.add_argument("--stop-at-target", action="store_true",
                            help="end each trained run once its 100-episode mean reaches the "
                            "target (ours by --target-return, the reference by a callback): the "
                            "steps and seconds to it are the same, the runs shorter")
    else:
        parser.set_defaults(stop_at_target=False)
    args = parser.parse_args()
    check_learning_arguments(parser, args, bench, plot_name)
    return args


def check_installed(package, line):
    try:
        importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        print(f"error: {package} is not installed; {line}", file=sys.stderr)
        sys.exit(2)


def main():
    args = parse_args()
    bench = BENCHES[args.env]
    if args.sb3_child:
        seed, out_file = args.sb3_child
        stop_at = bench.target if args.stop_at_target else None
        if args.env in MINIGRID:
            minigrid_sb3_child(args.env, int(seed), out_file, args.steps, stop_at)
        else:
            sb3_child(int(seed), out_file, args.steps, stop_at)
        return
    if args.env == HYBRID:  # our script and gymnasium find spaces_envs on the path
        sys.path.insert(0, str(TESTS_DIR))
        os.environ["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(TESTS_DIR), os.environ.get("PYTHONPATH")]))
    if args.plot_only:
        learning_report(bench, args)  # harness.py's table and plot
    else:
        check_ready(bench.script if set(bench.trained) & set(args.variants) else None,
                    sb3=bool({"maskable", "sb3"} & set(args.variants)))
        if "maskable" in args.variants:
            check_installed("sb3-contrib", "pip install -r benchmarks/requirements.txt")
        if args.env in MINIGRID:
            check_installed("minigrid", "pip install -r benchmarks/requirements.txt")
        run_learning(bench, args, run_variant, play_random)  # ends with learning_report
    if args.env in TIMED:
        append_table(args.results_dir, time_table(args))
    elif args.env == BLACKJACK:
        blackjack_report(args)
    else:
        hybrid_report(args)


if __name__ == "__main__":
    main()
