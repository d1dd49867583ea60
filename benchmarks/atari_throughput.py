"""Training throughput on Atari Breakout: `ppo_atari.py` against Stable-Baselines3 PPO.

What it measures
----------------
The *steady* training speed, in environment steps per second (one step = one agent action = 4
emulator frames), of whole PPO training: collecting rollouts and updating the network, as a long run
sees it. One-time costs (imports, creating the games, `torch.compile`, the first update) are left out
of it and reported apart as the warm-up:

- steady steps/s = (steps at the end - steps at the end of the first update)
                   / (time at the end - time at the end of the first update)
- warm-up s      = time from the start of training to the end of the first update.

Two implementations with the same hyperparameters (the PPO paper's Atari settings: 8 games, 128
steps per game and rollout, 4 epochs of 4 minibatches of 256, learning rate 2.5e-4 annealed linearly
to 0, clip 0.1 for the ratio and the value, entropy 0.01, value 0.5, gradient norm 0.5, gamma 0.99,
GAE lambda 0.95), each run in its own subprocess:

1. ours: `python ppo_atari.py --env BreakoutNoFrameskip-v4 --seed S --total-timesteps N --run-dir <tmp>
   [variant args]`, run from the repository root. The numbers are the script's own, read from
   `<tmp>/summary.json`: `steps_per_second` (measured from the end of the first update) and
   `warmup_seconds` (from the start of training, games included, to the end of the first update).
   Several variants can be compared in one run with `--ours LABEL:ARGS` (repeatable), e.g.
   `--ours "eager:--no-compile" --ours "compiled:--compile"`. Our steady interval also holds the end
   of the run (stopping the workers, the final checkpoint), a fraction of a second.
2. SB3: `make_atari_env(env, n_envs=8, seed=S)` (AtariWrapper: the same DQN preprocessing) +
   `VecFrameStack(n_stack=4)`, `PPO("CnnPolicy", n_steps=128, batch_size=256, n_epochs=4, ...,
   device="cpu")` (`--sb3-device cuda`: on the GPU), in a child process of this same file
   (`--_sb3-child`). SB3 clips the value loss only when `clip_range_vf` is set: it is set to 0.1
   here, as ours clips it with the ratio's range.
   A callback takes (time, num_timesteps) at the second `_on_rollout_start` (the end of the first
   rollout + update) and at `_on_training_end`; the warm-up runs from the call of `learn()` (the
   games are made before it, so SB3's warm-up holds their reset but not their creation) to the
   second `_on_rollout_start`. SB3's games run in this process (`DummyVecEnv`, its default) unless
   `--sb3-vec-env subproc` is given; ours run in 2 worker processes by default.

The runs are interleaved (seed 1: every ours variant, then SB3; seed 2: ...) so that background load
hits all alike. Run only one benchmark at a time on a machine.

The output is a markdown table per run (implementation, variant/backend, compile, seed, steps,
steady steps/s, warm-up s, ratio of steady speed to SB3's on the same seed), a table of the medians
over seeds with the ratio to SB3's median, and the machine and date. `--json PATH` writes the same
as JSON.

Memory (`--memory`, off by default)
-----------------------------------
The extra memory a longer rollout costs ours: `ppo_atari.py` runs twice for one rollout + update
(`--total-timesteps num_envs * num_steps`), with `--num-envs 16 --num-steps 2048 --num-minibatches 128`
and `--num-envs 16 --num-steps 128 --num-minibatches 8`, i.e. the same minibatch size (256), so that
only the rollout buffer differs. Each runs inside a fresh wrapper process (`--_rss-child`) that
executes the script with `runpy` and reports its own peak resident set size (`ru_maxrss` of
`RUSAGE_SELF`: the trainer process, which holds the rollout buffer; the game workers are separate
processes and not counted). The result is the difference of the peaks divided by the difference of
the stored steps (16 x 1920): bytes per extra stored step. The rollout buffer alone holds 7,081 bytes
per step (one uint8 84x84 picture, an int64 action, four float32s and a bool), plus 4 pictures per
game for the stacks' older pictures and the zero picture.

How to run it (from the repository root)
----------------------------------------
    pip install -r requirements.txt -r benchmarks/requirements.txt
    python benchmarks/atari_throughput.py
    python benchmarks/atari_throughput.py --seeds 1 2 3 --json atari_throughput.json
    python benchmarks/atari_throughput.py --ours "eager:--no-compile" --ours "compiled:--compile"
    python benchmarks/atari_throughput.py --impl ours --ours "0 workers:--num-workers 0" --ours "2 workers:"
    python benchmarks/atari_throughput.py --impl ours --memory
"""

import argparse
import ast
import datetime
import functools
import json
import shlex
import statistics
import sys
import tempfile
import time
from collections import deque
from pathlib import Path

from harness import (REPO_ROOT, check_ready, fmt, linear_schedule, machine, machine_line, report_failure,
                     run_our_script, run_status, timed_run, warn_if_busy)

# This file's top level imports only the standard library (and harness.py, which does too), so that
# the SB3 child process pays for its own imports (SB3, torch, gymnasium, ale-py) just like our script
# does, and so that the memory wrapper adds nothing but the interpreter to the peak it measures.

OUR_SCRIPT = REPO_ROOT / "ppo_atari.py"
DEFAULT_ENV = "BreakoutNoFrameskip-v4"
WINDOW = 100  # games in the mean return reported in the JSON (a sanity check, not a speed)
PACKAGES = ("torch", "gymnasium", "ale-py", "stable-baselines3")  # whose versions the report names
# What ppo_atari.py's rollout buffer holds per stored step: one uint8 84x84 picture, an int64 action,
# float32 log-prob, value, reward and done, a bool restart flag (plus 4 pictures per game, not per step).
ROLLOUT_BYTES_PER_STEP = 84 * 84 + 8 + 4 * 4 + 1

# The shared hyperparameters (the PPO paper's Atari settings, ppo_atari.py's defaults).
NUM_ENVS, NUM_STEPS, BATCH_SIZE, EPOCHS = 8, 128, 256, 4
LEARNING_RATE, CLIP, ENT_COEF, VF_COEF, MAX_GRAD_NORM, GAMMA, GAE_LAMBDA = 2.5e-4, 0.1, 0.01, 0.5, 0.5, 0.99, 0.95


# --------------------------------------------------------------------------------------------------
# The SB3 reference, run in a child process
# --------------------------------------------------------------------------------------------------


def make_ale_env(env_id, **kwargs):
    """gym.make for SB3's SubprocVecEnv: its children start by forkserver or spawn, fresh interpreters
    where no import of ale_py has registered the Atari ids yet."""
    import ale_py  # noqa: F401
    import gymnasium

    return gymnasium.make(env_id, **kwargs)


def sb3_child(seed, out_file, args):
    """Train SB3 PPO with our hyperparameters for args.steps steps, timing it; write a small JSON."""
    import ale_py  # noqa: F401  (importing it registers the Atari ids with gymnasium)
    import torch
    from stable_baselines3 import PPO
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.env_util import make_atari_env
    from stable_baselines3.common.vec_env import SubprocVecEnv, VecFrameStack

    class SteadyClock(BaseCallback):
        """Takes (time, steps) at the end of the first rollout + update and at the end of training,
        and keeps the real scores of finished games (the Monitor's `info["episode"]["r"]`)."""

        def __init__(self):
            super().__init__()
            self.rollouts_started = 0
            self.first_update_end = self.end = None
            self.returns = deque(maxlen=WINDOW)
            self.episodes = 0

        def _on_rollout_start(self):
            self.rollouts_started += 1
            if self.rollouts_started == 2:  # the first rollout and its update are done
                self.first_update_end = (time.perf_counter(), self.num_timesteps)

        def _on_step(self):
            for info in self.locals["infos"]:
                if "episode" in info:  # the Monitor sits under AtariWrapper: whole games, real score
                    self.returns.append(float(info["episode"]["r"]))
                    self.episodes += 1
            return True

        def _on_training_end(self):
            self.end = (time.perf_counter(), self.num_timesteps)

    setup_start = time.perf_counter()
    if args.sb3_vec_env == "subproc":
        # The same env as the id would give (make_vec_env adds render_mode="rgb_array" to an id), made
        # by a function that registers the Atari ids in the child first.
        games = make_atari_env(functools.partial(make_ale_env, args.env), n_envs=NUM_ENVS, seed=seed,
                               env_kwargs={"render_mode": "rgb_array"}, vec_env_cls=SubprocVecEnv)
    else:
        games = make_atari_env(args.env, n_envs=NUM_ENVS, seed=seed)  # DummyVecEnv: all in this process
    env = VecFrameStack(games, n_stack=4)
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
        device=args.sb3_device,
        seed=seed,
        verbose=0,
    )
    clock = SteadyClock()
    learn_start = time.perf_counter()
    model.learn(total_timesteps=args.steps, callback=clock)
    learn_end = time.perf_counter()
    env.close()
    steady = None
    if clock.first_update_end and clock.end and clock.end[1] > clock.first_update_end[1]:
        steady = (clock.end[1] - clock.first_update_end[1]) / (clock.end[0] - clock.first_update_end[0])
    result = {
        "steps": model.num_timesteps,
        "steps_per_second": steady,
        "warmup_seconds": clock.first_update_end[0] - learn_start if clock.first_update_end else None,
        "setup_seconds": learn_start - setup_start,  # making the games and the model, before learn()
        "learn_seconds": learn_end - learn_start,
        "episodes": clock.episodes,
        "mean_return_100": sum(clock.returns) / len(clock.returns) if clock.returns else None,
        "torch_threads": torch.get_num_threads(),
    }
    Path(out_file).write_text(json.dumps(result, indent=2))


# --------------------------------------------------------------------------------------------------
# The memory wrapper, run in a child process
# --------------------------------------------------------------------------------------------------


def rss_child(out_file, script_args):
    """Run ppo_atari.py in this very process (as `python ppo_atari.py ARGS` would) and write its peak
    resident set size. A fresh process per measurement: ru_maxrss only ever grows."""
    import resource
    import runpy

    sys.argv = [str(OUR_SCRIPT), *script_args]
    sys.path[0] = str(REPO_ROOT)  # what `python ppo_atari.py` puts first on the path
    exit_code = 0
    try:
        runpy.run_path(str(OUR_SCRIPT), run_name="__main__")
    except SystemExit as stop:
        exit_code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    finally:
        scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss is bytes on macOS, KiB on Linux
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale
        Path(out_file).write_text(json.dumps({"peak_rss_bytes": peak, "exit_code": exit_code}))
    sys.exit(exit_code)


# --------------------------------------------------------------------------------------------------
# Running and timing one subprocess
# --------------------------------------------------------------------------------------------------


def default_compile():
    """ppo_atari.py's default for --compile, read from its Config without importing it (no torch here)."""
    try:
        tree = ast.parse(OUR_SCRIPT.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and node.name == "Config":
                for item in node.body:
                    if (isinstance(item, ast.AnnAssign) and getattr(item.target, "id", None) == "compile"
                            and isinstance(item.value, ast.Call) and item.value.args):
                        return bool(ast.literal_eval(item.value.args[0]))
    except (OSError, SyntaxError, ValueError):
        pass
    return None


def compile_setting(extra_args):
    """'on' or 'off' as the command line asks (the last --compile/--no-compile wins), else the default."""
    asked = None
    for arg in shlex.split(extra_args):
        if arg in ("--compile", "--no-compile"):
            asked = arg == "--compile"
    if asked is None:
        asked = default_compile()
    return {True: "on", False: "off", None: "default"}[asked]


def run_ours(variant, seed, args):
    label, extra = variant
    cmd, status, wall, tail, summary, stderr = run_our_script(
        OUR_SCRIPT, ["--env", args.env, "--seed", str(seed), "--total-timesteps", str(args.steps)], extra,
        seed, args.timeout)
    compiled = compile_setting(extra)
    if compiled == "on" and "torch.compile failed" in stderr:
        compiled = "failed, ran eagerly"  # the script's one-line warning when it cannot compile
    row = {
        "implementation": "ours",
        "variant": label,
        "args": extra,
        "backend": f"{label}" + (f" ({extra})" if extra else " (no extra args)"),
        "compile": compiled,
        "seed": seed,
        "status": status,
        "steps": summary.get("steps") if summary else None,
        "steps_per_second": summary.get("steps_per_second") if summary else None,
        "warmup_seconds": summary.get("warmup_seconds") if summary else None,
        "train_seconds": summary.get("seconds") if summary else None,
        "wall_seconds": wall,
        "episodes": summary.get("episodes") if summary else None,
        "mean_return_100": summary.get("mean_return_100") if summary else None,
        "command": shlex.join(cmd),
    }
    if status != "ok":
        report_failure(f"ours [{label}]", seed, status, tail)
    return row


def run_sb3(seed, args):
    with tempfile.TemporaryDirectory(prefix=f"sb3_seed{seed}_") as tmp:
        out_file = Path(tmp) / "result.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--_sb3-child", str(seed), str(out_file),
               "--env", args.env, "--steps", str(args.steps), "--sb3-vec-env", args.sb3_vec_env,
               "--sb3-device", args.sb3_device]
        returncode, wall, tail = timed_run(cmd, args.timeout, tmp)
        result = json.loads(out_file.read_text()) if out_file.exists() else None
    status = run_status(returncode, result, args.timeout, missing="no result written")
    vec_env = "SubprocVecEnv" if args.sb3_vec_env == "subproc" else "DummyVecEnv"
    row = {
        "implementation": "sb3",
        "variant": "sb3",
        "args": "",
        "backend": f"CnnPolicy, {vec_env}, {args.sb3_device}",
        "compile": "off",
        "seed": seed,
        "status": status,
        "wall_seconds": wall,
        "command": shlex.join(cmd),
    }
    for key in ("steps", "steps_per_second", "warmup_seconds", "setup_seconds", "learn_seconds",
                "episodes", "mean_return_100", "torch_threads"):
        row[key] = result.get(key) if result else None
    row["train_seconds"] = row.pop("learn_seconds")
    if status != "ok":
        report_failure("sb3", seed, status, tail)
    return row


def run_memory(args):
    """Peak RSS of ours with a long and a short rollout at the same minibatch size."""
    num_envs, minibatch = args.memory_num_envs, args.memory_minibatch_size
    runs = []
    for num_steps in args.memory_num_steps:
        batch = num_envs * num_steps
        if batch % minibatch:
            print(f"error: --memory-minibatch-size {minibatch} does not divide the batch of {batch} steps",
                  file=sys.stderr)
            sys.exit(2)
        minibatches = batch // minibatch
        print(f"memory: ours with --num-envs {num_envs} --num-steps {num_steps} "
              f"--num-minibatches {minibatches} (one rollout + update) ...", flush=True)
        with tempfile.TemporaryDirectory(prefix="ours_memory_") as tmp, \
                tempfile.TemporaryDirectory(prefix="ours_memory_log_") as log_dir:
            out_file = Path(log_dir) / "rss.json"
            script_args = ["--env", args.env, "--seed", str(args.seeds[0]), "--total-timesteps", str(batch),
                           "--num-envs", str(num_envs), "--num-steps", str(num_steps),
                           "--num-minibatches", str(minibatches), "--run-dir", tmp]
            cmd = [sys.executable, str(Path(__file__).resolve()), "--_rss-child", str(out_file), *script_args]
            returncode, wall, tail = timed_run(cmd, args.timeout, log_dir)
            result = json.loads(out_file.read_text()) if out_file.exists() else None
        status = run_status(returncode, result, args.timeout, missing="no result written")
        run = {"num_envs": num_envs, "num_steps": num_steps, "num_minibatches": minibatches,
               "minibatch_size": minibatch, "stored_steps": batch, "status": status, "wall_seconds": wall,
               "peak_rss_bytes": result["peak_rss_bytes"] if result and status == "ok" else None,
               "command": shlex.join(cmd)}
        if status != "ok":
            report_failure("memory", args.seeds[0], status, tail)
        else:
            print(f"  peak RSS {run['peak_rss_bytes'] / 2**20:,.0f} MiB, {wall:.1f} s wall", flush=True)
        runs.append(run)
    long, short = max(runs, key=lambda r: r["stored_steps"]), min(runs, key=lambda r: r["stored_steps"])
    extra_steps = long["stored_steps"] - short["stored_steps"]
    per_step = None
    if long["peak_rss_bytes"] is not None and short["peak_rss_bytes"] is not None and extra_steps > 0:
        per_step = (long["peak_rss_bytes"] - short["peak_rss_bytes"]) / extra_steps
    return {"runs": runs, "extra_stored_steps": extra_steps, "bytes_per_extra_step": per_step,
            "rollout_buffer_bytes_per_step": ROLLOUT_BYTES_PER_STEP}


# --------------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------------


def ratio_text(value):
    return "–" if value is None else f"{value:.2f}"


def summarize(rows, groups):
    """Medians over the seeds that ran fine, per (implementation, variant), and the ratio to SB3."""
    summary = []
    for implementation, variant in groups:
        mine = [r for r in rows if r["implementation"] == implementation and r["variant"] == variant]
        ok = [r for r in mine if r["status"] == "ok" and r["steps_per_second"]]
        warmups = [r["warmup_seconds"] for r in ok if r["warmup_seconds"] is not None]
        summary.append({
            "implementation": implementation,
            "variant": variant,
            "backend": mine[0]["backend"] if mine else None,
            "compile": mine[0]["compile"] if mine else None,
            "seeds_ok": len(ok),
            "seeds": len(mine),
            "median_steps_per_second": statistics.median(r["steps_per_second"] for r in ok) if ok else None,
            "median_warmup_seconds": statistics.median(warmups) if warmups else None,
        })
    sb3 = next((s["median_steps_per_second"] for s in summary if s["implementation"] == "sb3"), None)
    for s in summary:
        speed = s["median_steps_per_second"]
        s["ratio_to_sb3"] = speed / sb3 if speed and sb3 else None
    return summary


def print_report(rows, summary, memory, info, date, args):
    print()
    print("| implementation | variant / backend | compile | seed | env steps | steady steps/s | warm-up s "
          "| ratio to SB3 (steady) |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        sb3 = next((s for s in rows if s["implementation"] == "sb3" and s["seed"] == r["seed"]), None)
        ratio = (r["steps_per_second"] / sb3["steps_per_second"]
                 if sb3 and sb3["steps_per_second"] and r["steps_per_second"] else None)
        speed = fmt(r["steps_per_second"], ",.0f") if r["status"] == "ok" else f"– ({r['status']})"
        print(f"| {r['implementation']} | {r['backend']} | {r['compile']} | {r['seed']} | {fmt(r['steps'], ',')} "
              f"| {speed} | {fmt(r['warmup_seconds'], '.1f')} | {ratio_text(ratio)} |")
    print()
    print(f"medians over seeds {' '.join(map(str, args.seeds))}:")
    print()
    print("| implementation | variant / backend | compile | seeds ok | steady steps/s | warm-up s "
          "| ratio to SB3 (steady) |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: |")
    for s in summary:
        print(f"| {s['implementation']} | {s['backend']} | {s['compile']} | {s['seeds_ok']}/{s['seeds']} "
              f"| {fmt(s['median_steps_per_second'], ',.0f')} | {fmt(s['median_warmup_seconds'], '.1f')} "
              f"| {ratio_text(s['ratio_to_sb3'])} |")
    if memory is not None:
        print()
        print("peak memory of ours (the trainer process), one rollout + update:")
        print()
        print("| --num-envs | --num-steps | --num-minibatches | minibatch size | stored steps | peak RSS MiB |")
        print("| ---: | ---: | ---: | ---: | ---: | ---: |")
        for m in memory["runs"]:
            peak = fmt(m["peak_rss_bytes"] / 2**20 if m["peak_rss_bytes"] is not None else None, ",.0f")
            print(f"| {m['num_envs']} | {m['num_steps']:,} | {m['num_minibatches']} | {m['minibatch_size']} "
                  f"| {m['stored_steps']:,} | {peak if m['status'] == 'ok' else '– (' + m['status'] + ')'} |")
        print()
        print(f"extra peak memory per extra stored step ({memory['extra_stored_steps']:,} steps more): "
              f"{fmt(memory['bytes_per_extra_step'], ',.0f')} bytes "
              f"(the rollout buffer alone holds {ROLLOUT_BYTES_PER_STEP:,} bytes per step)")
    print()
    print("ratio to SB3 = steady steps/s / SB3's steady steps/s (per row: same seed; medians: SB3's median); "
          "> 1 means faster than SB3.")
    print("steady = steps after the first rollout + update / seconds after it; warm-up = start of training "
          "(ours: games included; SB3: call of learn()) to the end of the first update.")
    print(f"env {args.env}, {args.steps:,} steps per run, {NUM_ENVS} envs x {NUM_STEPS} steps per rollout, "
          f"minibatch {BATCH_SIZE}, {EPOCHS} epochs; SB3 with clip_range_vf={CLIP} to clip the value loss as ours does.")
    print(machine_line(info, PACKAGES))
    print(f"date: {date}")


# --------------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------------


def parse_variant(text):
    """'LABEL:ARGS' -> (label, args); the args may be empty ('default:')."""
    label, colon, extra = text.partition(":")
    if not colon or not label.strip():
        raise argparse.ArgumentTypeError(f"expected LABEL:ARGS (e.g. 'eager:--no-compile', 'default:'), "
                                         f"not {text!r}")
    return label.strip(), extra.strip()


def parse_args():
    parser = argparse.ArgumentParser(
        description="Steady training throughput (env steps/s) on Atari: ppo_atari.py vs Stable-Baselines3 "
        "PPO with the same hyperparameters, interleaved, each run in its own subprocess.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--env", default=DEFAULT_ENV, help="Atari game id, for both implementations")
    parser.add_argument("--steps", type=int, default=40_960,
                        help="env steps per run (the learning rate anneals over them); at least 2 rollouts of "
                        f"{NUM_ENVS * NUM_STEPS} steps, so that there is a steady part")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1], help="seeds to run")
    parser.add_argument("--impl", choices=["ours", "sb3", "both"], default="both",
                        help="implementations to run")
    parser.add_argument("--ours", type=parse_variant, action="append", metavar="LABEL:ARGS",
                        default=argparse.SUPPRESS,  # so that --help prints the line below, not "None"
                        help='a variant of ours: a label and extra arguments for ppo_atari.py, e.g. '
                        '"compiled:--compile"; repeatable (default: one variant, "default:", no extra args)')
    parser.add_argument("--sb3-vec-env", choices=["dummy", "subproc"], default="dummy",
                        help="SB3's games in its process (DummyVecEnv, make_atari_env's default) or one "
                        "process each (SubprocVecEnv)")
    parser.add_argument("--sb3-device", choices=["cpu", "cuda"], default="cpu",
                        help="where SB3 learns (ours: its --device, auto by default: CUDA if present)")
    parser.add_argument("--memory", action="store_true",
                        help="also measure the peak memory of ours with a long and a short rollout")
    parser.add_argument("--memory-num-envs", type=int, default=16, help="--num-envs of the memory runs")
    parser.add_argument("--memory-num-steps", type=int, nargs=2, default=[2048, 128], metavar=("LONG", "SHORT"),
                        help="--num-steps of the two memory runs")
    parser.add_argument("--memory-minibatch-size", type=int, default=256,
                        help="minibatch size of both memory runs (sets --num-minibatches)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds allowed per run")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    parser.add_argument("--_sb3-child", nargs=2, metavar=("SEED", "OUTFILE"), dest="sb3_child",
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.impls = ["ours", "sb3"] if args.impl == "both" else [args.impl]
    args.ours = getattr(args, "ours", None) or [("default", "")]
    labels = [label for label, _ in args.ours]
    if len(set(labels)) != len(labels):
        parser.exit(2, f"error: --ours labels must differ, got {', '.join(labels)}\n")
    if args.steps <= 0 or args.timeout <= 0 or args.memory_num_envs <= 0 or args.memory_minibatch_size <= 0 \
            or min(args.memory_num_steps) <= 0:
        parser.exit(2, "error: --steps, --timeout and the --memory-* sizes must be positive\n")
    if args.memory and args.memory_num_steps[0] == args.memory_num_steps[1]:
        parser.exit(2, "error: --memory-num-steps needs two different rollout lengths\n")
    return args


def main():
    if len(sys.argv) >= 3 and sys.argv[1] == "--_rss-child":  # before argparse: the rest is ppo_atari.py's
        rss_child(sys.argv[2], sys.argv[3:])
        return
    args = parse_args()
    if args.sb3_child:
        seed, out_file = args.sb3_child
        sb3_child(int(seed), out_file, args)
        return
    check_ready(OUR_SCRIPT if "ours" in args.impls or args.memory else None, sb3="sb3" in args.impls,
                hint=", or pass --impl sb3")
    if args.steps < 2 * NUM_ENVS * NUM_STEPS:
        print(f"warning: --steps {args.steps:,} is less than two rollouts ({2 * NUM_ENVS * NUM_STEPS:,} steps): "
              "there is no steady part to measure", flush=True)

    info = machine(PACKAGES)  # taken now, so the load average is the one the runs start under
    warn_if_busy(info, "will slow every implementation")
    date = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    groups = [("ours", label) for label, _ in args.ours] if "ours" in args.impls else []
    groups += [("sb3", "sb3")] if "sb3" in args.impls else []
    rows = []
    for seed in args.seeds:  # interleaved: seed 1 every variant of ours, then sb3; seed 2 ...
        for implementation, label in groups:
            name = f"ours [{label}]" if implementation == "ours" else "sb3"
            print(f"running {name} seed {seed} ...", flush=True)
            if implementation == "ours":
                row = run_ours(next(v for v in args.ours if v[0] == label), seed, args)
            else:
                row = run_sb3(seed, args)
            print(f"  {fmt(row['steps_per_second'], ',.0f')} steps/s steady, warm-up "
                  f"{fmt(row['warmup_seconds'], '.1f')} s, {fmt(row['steps'], ',')} steps, "
                  f"{row['wall_seconds']:.1f} s wall ({row['status']})", flush=True)
            rows.append(row)
    memory = run_memory(args) if args.memory else None

    summary = summarize(rows, groups)
    print_report(rows, summary, memory, info, date, args)
    if args.json:
        result = {"date": date, "machine": info, "env": args.env, "steps": args.steps, "seeds": args.seeds,
                  "variants": [{"label": label, "args": extra} for label, extra in args.ours]
                  if "ours" in args.impls else [],
                  "sb3_vec_env": args.sb3_vec_env if "sb3" in args.impls else None,
                  "rows": rows, "summary": summary, "memory": memory}
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
