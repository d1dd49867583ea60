r"""Does `ppo_atari.py` learn Breakout as well as Stable-Baselines3? Learning curves over seeds.

What it measures
----------------
The real game score (unclipped, summed over all lives) of every whole game finished in training,
against environment steps (agent steps, one step = 4 emulator frames), for four variants, each seed
(default 1 2 3) with a budget of `--steps` (default 200,000). Both implementations anneal the
learning rate linearly to 0 over exactly that budget and stop after the rollout (8 games x 128
steps) that reaches it: 196 rollouts, 200,704 steps.

1. `ale-vector`: ours with its default backend, ale-py's C++ vector env:
   `python ppo_atari.py --env BreakoutNoFrameskip-v4 --seed S --total-timesteps N --run-dir <tmp>`.
2. `game`: the same plus `--env-backend game` (the Game class, in worker processes).
   For both, each finished game's (step, return, length) is read from the run dir's TensorBoard
   event file (`charts/episodic_return`, `charts/episodic_length`; EventAccumulator, keeping all).
3. `sb3`: Stable-Baselines3 PPO with identical hyperparameters, in a child process of this same
   file (`--_sb3-child`): `make_atari_env(env, n_envs=8, seed=S)` + `VecFrameStack(n_stack=4)`,
   `PPO("CnnPolicy", n_steps=128, batch_size=256 (8 x 128 / 4 minibatches), n_epochs=4,
   learning_rate=linear_schedule(2.5e-4), clip_range=0.1, clip_range_vf=0.1, ent_coef=0.01,
   vf_coef=0.5, max_grad_norm=0.5, gamma=0.99, gae_lambda=0.95, Adam eps=1e-5, seed=S,
   device="cpu")`, `learn(total_timesteps=N)`. SB3's own default Adam eps is 1e-8: it is set to
   1e-5 here (`policy_kwargs=dict(optimizer_kwargs=dict(eps=1e-5))`) to match ours. A callback
   reads `self.locals["infos"]` for `"episode"` entries: SB3's Monitor sits beneath AtariWrapper, so
   its return is the raw, unclipped score over all lives; it is recorded with `self.num_timesteps`
   at that step. The Monitor's length counts emulator frames, so the callback counts each game's
   agent steps itself, as ours does.
4. `random`: uniformly random actions, played in this process through `ppo_atari.Game` (the same
   preprocessing and score as ours: no-op starts, 4-frame repeat, FIRE after a reset and a lost
   life), `--random-games` whole games (default 100), reported as mean ± std and standard error.
   (The DQN paper, Mnih et al. 2015, quotes 1.7 for a random policy on Breakout.)

The training runs go one after the other, interleaved (seed 1: ale-vector, game, sb3; seed 2: ...)
so that background load hits all alike. Run only one benchmark at a time on a machine.

What differs between ours and SB3 despite identical hyperparameters
--------------------------------------------------------------------
- Value loss: SB3's `clip_range_vf` keeps only the clipped prediction, `mse(returns, clipped)`;
  ours takes `0.5 * max(unclipped error², clipped error²)` (the PPO paper's code). With vf_coef
  0.5, SB3's value gradient is twice ours where the clip does not bite, and zero where it does.
- Preprocessing: SB3's AtariWrapper defaults (noop_max=30, frame_skip=4 with the max of the last
  two frames, 84x84, terminal_on_life_loss=True, clip_reward=True, FireResetEnv) are the Game
  backend's rules. Small differences: SB3 turns RGB frames grey with OpenCV where ours reads ALE's
  grayscale frames; after a lost life SB3's NOOP step and FIRE + action 2 happen in `reset()`
  (EpisodicLifeEnv under FireResetEnv), unseen by the agent, as in the Game; VecFrameStack
  zero-fills the stack at every episode end, life losses included, as the Game does. The ale-vector
  backend differs more: it presses FIRE for one frame at a game's start and, after a lost life,
  sends FIRE on the next agent step in place of the policy's action (a step the agent sees), and
  its frame stack runs on through a lost life (see `VectorGames`).
- SB3's games run one after the other in its process (`DummyVecEnv`), and it is not compiled;
  ours is (torch.compile). Speeds are recorded, but this benchmark is about scores.

Outputs
-------
Every run's log is kept, so that the report can be redone without training (`--plot-only`):
- `<results-dir>/<variant>_seed<S>.csv`: `step,return,length`, one row per finished game (step:
  agent steps when it ended; length: agent steps of the game).
- `<results-dir>/random.csv`: `game,return,length`.
- `<results-dir>/runs.json`: per run (key `<variant>_seed<S>`, or `random`): the command, date,
  wall seconds, steps, games, steps/s (ours: summary.json's steady speed; SB3: the same measure,
  from the end of its first update), exit status, the machine line and the package versions. A run
  of some variants updates only their keys and files; the others' are kept.
- `<results-dir>/table.md` (also printed): per variant, each seed's mean score of its last 100
  training games at the end, the mean ± std over seeds and the ratio to SB3's mean; the random
  policy; the machine, dates and versions.
- The plot (`--plot`; by default `benchmarks/plots/atari_breakout_learning.png` with the default
  results dir, else inside the results dir): for each run, the mean score of its last 100 games
  every `--plot-every` steps (from its 10th game on); per variant, the mean over seeds as a line
  and the min–max over seeds as a band; the random policy's mean ± one standard error.
The report shows every variant with logs for `--seeds` (with `--plot-only`, those of `--variants`).
The running, the logs, the table and the plot are harness.py's, shared with cartpole_learning.py.

How to run it (from the repository root)
----------------------------------------
    pip install -r requirements.txt -r benchmarks/requirements.txt
    python benchmarks/atari_learning.py                      # all four, seeds 1 2 3, 200k steps
    python benchmarks/atari_learning.py --variants sb3       # SB3 again; the others' logs are kept
    python benchmarks/atari_learning.py --plot-only          # table and plot from the kept logs
    python benchmarks/atari_learning.py --env PongNoFrameskip-v4 --results-dir \
        benchmarks/results/atari_pong --plot-only --variants ale-vector random --targets 18 20
    python benchmarks/atari_learning.py --steps 8192 --seeds 1 2 --random-games 5 \
        --plot-every 1024 --results-dir /tmp/atari_learning_test   # a quick check of the benchmark
"""

import argparse
import re
import sys
import time

from harness import (REPO_ROOT, WINDOW, Learning, check_learning_arguments, check_ready, keep_run,
                     learning_arguments, learning_report, linear_schedule, run_learning,
                     run_ours_logged, run_sb3_logged, sb3_learn_and_record)

# This file's top level imports only the standard library (and harness.py, which does too), so that
# the SB3 child pays for its own imports just like our script does.

DEFAULT_ENV = "BreakoutNoFrameskip-v4"
OUR_VARIANT_ARGS = {"ale-vector": [], "game": ["--env-backend", "game"]}
BENCH = Learning(
    name="atari_learning",
    script=REPO_ROOT / "ppo_atari.py",
    variants=("ale-vector", "game", "sb3", "random"),
    labels={"ale-vector": "ours, ale-vector backend (default)", "game": "ours, game backend",
            "sb3": "SB3 PPO (same hyperparameters)", "random": "random policy"},
    colors={"ale-vector": "tab:blue", "game": "tab:orange", "sb3": "tab:green",
            "random": "tab:gray"},
    packages=("torch", "gymnasium", "ale-py", "stable-baselines3", "numpy"),
    unit="game",
    score="score",
    x_label="environment steps (agent steps, 4 frames each)",
    y_label=f"game score (mean of the last {WINDOW} training games)",
    note=f"(the learning rate annealed over it). Score: the mean real game score (unclipped, all "
    f"lives) of each run's last {WINDOW} training games at its end (stochastic policy); std over "
    "seeds; ratio = variant mean / SB3 mean. steps/s: steady training speed (from the end of the "
    "first update), mean over seeds. Random policy: uniformly random actions through "
    "ppo_atari.Game.",
)

# The shared hyperparameters (the PPO paper's Atari settings, ppo_atari.py's defaults).
NUM_ENVS, NUM_STEPS, BATCH_SIZE, EPOCHS = 8, 128, 256, 4
LEARNING_RATE, CLIP, ENT_COEF, VF_COEF, MAX_GRAD_NORM = 2.5e-4, 0.1, 0.01, 0.5, 0.5
GAMMA, GAE_LAMBDA, ADAM_EPS = 0.99, 0.95, 1e-5


# --------------------------------------------------------------------------------------------------
# The SB3 reference, run in a child process
# --------------------------------------------------------------------------------------------------


def sb3_child(seed, out_file, env_id, total_timesteps):
    """Train SB3 PPO with our hyperparameters; write every finished game and the timings as JSON."""
    import ale_py
    from stable_baselines3 import PPO
    from stable_baselines3.common.env_util import make_atari_env
    from stable_baselines3.common.vec_env import VecFrameStack

    ale_py.ALEInterface.setLoggerMode(ale_py.LoggerMode.Error)  # (its import registers the ids)

    setup_start = time.perf_counter()
    env = VecFrameStack(make_atari_env(env_id, n_envs=NUM_ENVS, seed=seed), n_stack=4)
    model = PPO(
        "CnnPolicy",
        env,
        n_steps=NUM_STEPS,
        batch_size=BATCH_SIZE,
        n_epochs=EPOCHS,
        learning_rate=linear_schedule(LEARNING_RATE),
        clip_range=CLIP,
        clip_range_vf=CLIP,  # ours clips the value loss too (PPO paper's code; 37 details, #9)
        ent_coef=ENT_COEF,
        vf_coef=VF_COEF,
        max_grad_norm=MAX_GRAD_NORM,
        gamma=GAMMA,
        gae_lambda=GAE_LAMBDA,
        policy_kwargs=dict(optimizer_kwargs=dict(eps=ADAM_EPS)),  # SB3's default is 1e-8; ours 1e-5
        seed=seed,
        device="cpu",
        verbose=0,
    )
    # The Monitor sits under AtariWrapper: its return is a whole game's real score, all lives.
    sb3_learn_and_record(model, env, total_timesteps, out_file, setup_start)


# --------------------------------------------------------------------------------------------------
# The random policy, in this process
# --------------------------------------------------------------------------------------------------


def random_policy(env_id, games, seed):
    """Play `games` whole games with uniformly random actions through ppo_atari's own Game, so that
    the preprocessing and the score are exactly those of the training runs. Returns the scores and
    lengths."""
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


def play_random(args):
    returns, lengths = random_policy(args.env, args.random_count, args.random_seed)
    command = (f"in this process: ppo_atari.Game({args.env!r}, {args.random_seed}), "
               f"uniformly random actions, numpy.random.default_rng({args.random_seed})")
    return returns, lengths, command


def run_variant(variant, seed, args):
    """One training run: (run record, games, output tail)."""
    if variant == "sb3":
        return run_sb3_logged(__file__, seed, ["--env", args.env, "--steps", str(args.steps)], args)
    script_args = ["--env", args.env, "--seed", str(seed), "--total-timesteps", str(args.steps),
                   *OUR_VARIANT_ARGS[variant]]
    return run_ours_logged(BENCH.script, script_args, f"{variant}_seed{seed}", args)


# --------------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------------


def parse_args():
    parser = argparse.ArgumentParser(
        description="Learning curves on Breakout over seeds: ppo_atari.py (both backends), "
        "Stable-Baselines3 PPO with the same hyperparameters, and a random policy.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--env", default=DEFAULT_ENV, help="Atari game id")
    parser.add_argument("--targets", type=float, nargs="+", default=None,
                        help="scores whose first reaching (the mean of the last 100 games) the "
                        "table reports per seed, e.g. 18 20 for Pong")
    learning_arguments(parser, BENCH, steps=200_000, timeout=7200.0, plot_every=5000,
                       plot_help="the PNG (default: benchmarks/plots/atari_<game>_learning.png "
                       "for the default results dir, else inside the results dir)")
    args = parser.parse_args()
    game = re.sub(r"NoFrameskip-v\d+$", "", args.env.split("/")[-1]).lower()
    check_learning_arguments(parser, args, BENCH, f"atari_{game}_learning.png")
    return args


def main():
    args = parse_args()
    if args.sb3_child:
        seed, out_file = args.sb3_child
        sb3_child(int(seed), out_file, args.env, args.steps)
        return
    if args.keep_run:
        keep_run(BENCH, args)
        return
    if args.plot_only:
        learning_report(BENCH, args)
        return
    check_ready(BENCH.script if {"ale-vector", "game", "random"} & set(args.variants) else None,
                sb3="sb3" in args.variants)
    run_learning(BENCH, args, run_variant, play_random)


if __name__ == "__main__":
    main()
