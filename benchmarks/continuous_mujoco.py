r"""ppo_continuous.py on MuJoCo robots: training speed against Stable-Baselines3 with the same
hyperparameters, and learning curves at 1M steps against CleanRL's published scores.

What it measures
----------------
One set of flags for every MuJoCo env, CleanRL's `ppo_continuous_action.py` settings (1 env x 2048
steps, 32 minibatches x 10 epochs, Adam 3e-4 annealed to 0, gamma 0.99, GAE lambda 0.95, clip 0.2
for the ratio and for the value loss, entropy 0, value coefficient 0.5, max gradient norm 0.5, 64-64
tanh networks, observation normalisation and reward scaling, each clipped at 10): `OUR_FLAGS`
below.

1. `--mode speed`: for each `--envs` (default HalfCheetah-v5 Hopper-v5), seed 1, `--speed-steps`
   (default 100,000) steps, side by side, one after the other: ours with OUR_FLAGS, and SB3 PPO
   with the same hyperparameters (`MlpPolicy` 64-64 tanh with separate networks, orthogonal init,
   `VecNormalize` with the same clipping and gamma, batch 64, learning rate linear from 3e-4,
   `clip_range_vf=0.2`), on the CPU. The table gives each one's steady steps/s (from the end of the
   first update) and ours / SB3.
2. `--mode learning`: for each env, seeds 1-3 (`--seeds`), `--steps` (default 1,000,000) steps of
   ours with OUR_FLAGS, and 100 episodes of a random policy; the kept logs, table and plot
   (`benchmarks/plots/continuous_<env>.png`) of harness.py, with CleanRL's published 1M-step score
   (its v4 envs: HalfCheetah 1442.6 ± 46.0, Hopper 2382.9 ± 271.7, mean ± std over its seeds) in the
   table's note and drawn as the target line at its mean minus one std.

How to run it (from the repository root)
----------------------------------------
    pip install -r requirements.txt -r benchmarks/requirements.txt "gymnasium[mujoco]"
    python benchmarks/continuous_mujoco.py --mode speed
    python benchmarks/continuous_mujoco.py --mode learning --envs Hopper-v5   # hours on 2 cores
    python benchmarks/continuous_mujoco.py --mode speed --speed-steps 4096 \
        --results-dir /tmp/continuous_mujoco_test         # a quick check of the benchmark
"""

import argparse
import datetime
import shlex
import time
from pathlib import Path

from harness import (REPO_ROOT, Learning, check_ready, fmt, learning_report, machine,
                     machine_line, random_episodes, run_learning, run_ours_logged, run_sb3_logged,
                     save_run, sb3_learn_and_record, warn_if_busy)

SCRIPT = REPO_ROOT / "ppo_continuous.py"
PACKAGES = ("torch", "gymnasium", "mujoco", "stable-baselines3", "numpy")
RESULTS = REPO_ROOT / "benchmarks" / "results" / "continuous_mujoco"
OUR_FLAGS = ["--num-envs", "1", "--num-steps", "2048", "--num-minibatches", "32",
             "--update-epochs", "10", "--learning-rate", "3e-4", "--gamma", "0.99",
             "--gae-lambda", "0.95", "--clip-value-loss"]
# CleanRL's ppo_continuous_action.py at 1M steps (its MuJoCo v4 benchmark): mean, std over seeds.
CLEANRL = {"HalfCheetah-v5": (1442.6, 46.0), "Hopper-v5": (2382.9, 271.7)}


def sb3_child(env_id, seed, out_file, total_timesteps):
    """SB3 PPO with OUR_FLAGS' hyperparameters on one env, VecNormalize as ours normalises."""
    setup_start = time.perf_counter()
    from stable_baselines3 import PPO
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.vec_env import VecNormalize

    from harness import linear_schedule

    env = VecNormalize(make_vec_env(env_id, n_envs=1, seed=seed), gamma=0.99, clip_obs=10.0,
                       clip_reward=10.0)
    model = PPO("MlpPolicy", env, n_steps=2048, batch_size=64, n_epochs=10,
                learning_rate=linear_schedule(3e-4), gamma=0.99, gae_lambda=0.95, clip_range=0.2,
                clip_range_vf=0.2, ent_coef=0.0, vf_coef=0.5, max_grad_norm=0.5, device="cpu",
                seed=seed, verbose=0)
    sb3_learn_and_record(model, env, total_timesteps, out_file, setup_start)


def speed(args):
    """Ours and SB3, one after the other, per env; a table of steady steps/s."""
    info = machine(PACKAGES)
    warn_if_busy(info, "lowers the speeds measured, not always alike")
    args.results_dir.mkdir(parents=True, exist_ok=True)
    lines = ["| env | ours, steps/s | SB3, steps/s | ours / SB3 |", "| --- | ---: | ---: | ---: |"]
    for env_id in args.envs:
        speeds = {}
        for variant in ("ours", "sb3"):
            print(f"speed: {variant} on {env_id}, {args.speed_steps:,} steps ...", flush=True)
            date = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
            if variant == "sb3":
                record, _, _ = run_sb3_logged(__file__, 1, ["--env", env_id, "--steps",
                                                            str(args.speed_steps)], args)
            else:
                our_args = ["--env", env_id, "--seed", "1", "--total-timesteps",
                            str(args.speed_steps), *OUR_FLAGS]
                record, _, _ = run_ours_logged(SCRIPT, our_args, f"speed_{env_id}", args)
            speeds[variant] = record["steps_per_second"] if record["status"] == "ok" else None
            save_run(args.results_dir, f"speed_{variant}_{env_id}",
                     {**record, "env": env_id, "date": date,
                      "machine_line": machine_line(info, PACKAGES)})
            print(f"  {fmt(speeds[variant], ',.0f')} steps/s ({record['status']})", flush=True)
        ratio = speeds["ours"] / speeds["sb3"] if speeds["ours"] and speeds["sb3"] else None
        lines.append(f"| {env_id} | {fmt(speeds['ours'], ',.0f')} | {fmt(speeds['sb3'], ',.0f')} "
                     f"| {fmt(ratio, '.2f')} |")
    lines += ["", f"{args.speed_steps:,} steps, seed 1, one after the other; steady speed from the "
              "end of the first update. Ours: " + shlex.join(OUR_FLAGS) + ". SB3: the same "
              "hyperparameters (see the docstring).", "", machine_line(info, PACKAGES)]
    text = "\n".join(lines) + "\n"
    (args.results_dir / "speed.md").write_text(text)
    print("\n" + text, end="")


def learning(args):
    """Per env: ours over the seeds and a random policy, with harness.py's logs, table and plot."""
    for env_id in args.envs:
        mean, std = CLEANRL.get(env_id, (None, None))
        bench = Learning(
            name=f"continuous_mujoco/{env_id}", script=SCRIPT, variants=("ours", "random"),
            labels={"ours": "ours, ppo_continuous.py (CleanRL's settings)",
                    "random": "random policy"},
            colors={"ours": "tab:blue", "random": "tab:gray"}, packages=PACKAGES,
            unit="episode", score="return", x_label="environment steps",
            y_label="episode return (mean of the last 100 training episodes)",
            note=(f"with {shlex.join(OUR_FLAGS)}. CleanRL's published 1M-step score on the v4 "
                  f"env: {fmt(mean, '.1f')} ± {fmt(std, '.1f')}; the target line is its mean "
                  "minus one std." if mean is not None else f"with {shlex.join(OUR_FLAGS)}."),
            target=mean - std if mean is not None else None)
        env_args = argparse.Namespace(**vars(args))
        env_args.env = env_id
        env_args.results_dir = args.results_dir / env_id
        env_args.variants = [v for v in bench.variants if v in args.variants]
        env_args.plot = REPO_ROOT / "benchmarks" / "plots" / f"continuous_{env_id}.png"

        def run_variant(variant, seed, run_args, env_id=env_id):
            script_args = ["--env", env_id, "--seed", str(seed), "--total-timesteps",
                           str(run_args.steps), *OUR_FLAGS]
            return run_ours_logged(SCRIPT, script_args, f"{variant}_seed{seed}", run_args)

        def play_random(run_args, env_id=env_id):
            return random_episodes(env_id, run_args.random_count, run_args.random_seed)

        if args.plot_only:
            learning_report(bench, env_args)
        else:
            run_learning(bench, env_args, run_variant, play_random)


def main():
    parser = argparse.ArgumentParser(
        description="ppo_continuous.py on MuJoCo: speed against SB3 with the same "
        "hyperparameters, and 1M-step learning curves against CleanRL's published scores.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--mode", choices=("speed", "learning"), default="speed")
    parser.add_argument("--envs", nargs="+", default=list(CLEANRL))
    parser.add_argument("--variants", nargs="+", choices=("ours", "random"),
                        default=["ours", "random"], help="--mode learning: what to run")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--steps", type=int, default=1_000_000, help="--mode learning: per run")
    parser.add_argument("--speed-steps", type=int, default=100_000, help="--mode speed: per run")
    parser.add_argument("--random-episodes", type=int, default=100, dest="random_count")
    parser.add_argument("--random-seed", type=int, default=1)
    parser.add_argument("--our-args", default="", help="extra arguments for ppo_continuous.py")
    parser.add_argument("--nice", type=int, default=0, help="start each run under nice -n NICE")
    parser.add_argument("--timeout", type=float, default=4 * 3600.0, help="seconds per run")
    parser.add_argument("--results-dir", type=Path, default=RESULTS)
    parser.add_argument("--plot-every", type=int, default=10_000, help="steps between points")
    parser.add_argument("--plot-only", action="store_true", help="--mode learning: report only")
    parser.add_argument("--env", help=argparse.SUPPRESS)  # the SB3 child's env
    parser.add_argument("--_sb3-child", nargs=2, metavar=("SEED", "OUTFILE"), dest="sb3_child",
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.sb3_child:
        seed, out_file = args.sb3_child
        sb3_child(args.env, int(seed), out_file, args.steps)
        return
    if min(args.steps, args.speed_steps, args.random_count, args.plot_every) <= 0:
        parser.exit(2, "error: --steps, --speed-steps, --random-episodes and --plot-every must "
                    "be positive\n")
    args.results_dir = args.results_dir.resolve()
    check_ready(SCRIPT, sb3=args.mode == "speed")
    speed(args) if args.mode == "speed" else learning(args)


if __name__ == "__main__":
    main()
