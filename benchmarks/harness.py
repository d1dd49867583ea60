"""What the benchmark scripts share: running and timing a subprocess, reporting its failure, and
describing the machine.

- `timed_run` runs one command from the repository root in its own process group, with its output
  in files, and returns its exit status (None on timeout), its wall seconds and the tail of its
  output; `kill_group` stops such a child and everything it started. `run_our_script` runs a
  ppo_*.py script that way in a fresh run dir and reads the summary.json it writes.
- `run_status` and `report_failure` turn a run's outcome into the status string of the result
  tables and print what went wrong in line with the progress output.
- `check_ready` stops a benchmark early when our script or Stable-Baselines3 is missing.
- `machine` describes the CPU, the platform, the load average and the versions of the packages a
  benchmark names, `warn_if_busy` warns of a high load average and `machine_line` is the report's
  line about it all; `fmt` formats a number that may be missing.
- `linear_schedule` is SB3's linear decay to 0, for the SB3 reference runs; `sb3_zoo_cartpole`
  makes SB3 PPO with rl-baselines3-zoo's tuned CartPole-v1 hyperparameters.
- Learning curves over seeds (atari_learning.py, cartpole_learning.py): a `Learning` names a
  benchmark's variants, labels and words; `learning_arguments` adds the options they share;
  `run_learning` runs the random policy and the training runs (`run_ours_logged` reads each
  finished episode from our run dir's TensorBoard events with `read_episodes`; `run_sb3_logged`
  starts an SB3 child that ends with `sb3_learn_and_record`) and keeps each run's CSV log and its
  record in runs.json; `learning_report` makes the table (`learning_table`) and the plot
  (`learning_plot`: the mean of the last 100 episodes on a step grid, `curve`, as the mean and the
  min–max over seeds, and the random policy's mean ± standard error) from the kept logs only;
  `keep_run` keeps a run of ours made by hand (`--keep-run`: one too long for a sitting, resumed
  across days) as if the benchmark had run it.

Only the ppo_*.py scripts are single files; the benchmarks import this module with
`from harness import ...`, which works because `python benchmarks/x.py` puts `benchmarks/` first on
`sys.path` (for the script and for the children it starts from that same file). Like the benchmarks'
top level, this module imports only the standard library, so that a child process pays for its own
imports of torch, gymnasium or SB3.
"""

import argparse
import collections
import csv
import datetime
import importlib.metadata
import json
import math
import os
import platform
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
TAIL_LINES = 25  # lines of a failed run's output to show


def microseconds(function, repeats: int) -> float:
    """The mean time of one call, after 10 calls of warm-up."""
    for _ in range(10):
        function()
    start = time.perf_counter()
    for _ in range(repeats):
        function()
    return (time.perf_counter() - start) / repeats * 1e6


def linear_schedule(initial_value):
    """Decays linearly from `initial_value` to 0 over the whole budget (the rl-zoo's `lin_<x>`, and how
    ours anneals its learning rate).

    SB3 calls a schedule with `progress_remaining`, which goes from 1 at the start to 0 at
    `total_timesteps`. A larger budget therefore also stretches the decay.
    """

    def schedule(progress_remaining):
        return progress_remaining * initial_value

    return schedule


def kill_group(proc):
    """Stop a child and everything it started (it leads its own process group)."""
    for sig, grace in ((signal.SIGINT, 10.0), (signal.SIGKILL, 5.0)):
        if proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, sig)  # SIGINT first: our script then still writes summary.json
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass


def timed_run(cmd, timeout, log_dir):
    """Run `cmd` from the repo root; return (returncode or None on timeout, wall seconds, output tail).

    stdout and stderr go to files, not pipes, so a chatty child can never block on a full pipe.
    The tail is the end of stderr (or of stdout, when stderr is empty), for the failure report.
    """
    stdout_path, stderr_path = Path(log_dir) / "stdout.txt", Path(log_dir) / "stderr.txt"
    with open(stdout_path, "wb") as out, open(stderr_path, "wb") as err:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=out, stderr=err, start_new_session=True)
        try:
            returncode = proc.wait(timeout=timeout)
            wall = time.perf_counter() - start
        except subprocess.TimeoutExpired:
            wall = time.perf_counter() - start
            returncode = None
        finally:
            kill_group(proc)  # on timeout or Ctrl-C of the benchmark; a no-op after a clean exit
    lines = stderr_path.read_text(errors="replace").splitlines()
    lines = lines or stdout_path.read_text(errors="replace").splitlines()
    return returncode, wall, "\n".join(lines[-TAIL_LINES:])


def run_status(returncode, result, timeout, missing="no summary.json written"):
    """The status of a run from `timed_run`'s returncode and the result it wrote (None if none)."""
    if returncode is None:
        return f"timeout after {timeout:g} s"
    if returncode != 0:
        return f"crashed (exit status {returncode})"
    if result is None:
        return missing
    return "ok"


def run_our_script(script, script_args, extra_args, seed, timeout):
    """Run `python SCRIPT SCRIPT_ARGS --run-dir <tmp> EXTRA_ARGS` with `timed_run`.

    The run dir holds only what the script writes; its captured output goes to a second folder.
    `extra_args` is one string, split as a shell would. Returns (command, status from `run_status`,
    wall seconds, output tail, the run's summary.json or None, the whole of its stderr).
    """
    with tempfile.TemporaryDirectory(prefix=f"ours_seed{seed}_") as tmp, \
            tempfile.TemporaryDirectory(prefix=f"ours_seed{seed}_log_") as log_dir:
        cmd = [sys.executable, str(script), *script_args, "--run-dir", tmp, *shlex.split(extra_args)]
        returncode, wall, tail = timed_run(cmd, timeout, log_dir)
        summary_path = Path(tmp) / "summary.json"
        summary = json.loads(summary_path.read_text()) if summary_path.exists() else None
        stderr = (Path(log_dir) / "stderr.txt").read_text(errors="replace")
    return cmd, run_status(returncode, summary, timeout), wall, tail, summary, stderr


def report_failure(name, seed, status, tail):
    """Say what went wrong, in line with the progress output. A timeout's tail is only the
    traceback of our own SIGINT, so it is left out."""
    print(f"  !! {name} seed {seed}: {status}", flush=True)
    if tail and not status.startswith("timeout"):
        print("  output (tail):")
        for line in tail.splitlines():
            print(f"  | {line}")
        sys.stdout.flush()


def check_ready(our_script=None, sb3=False, hint=""):
    """Exit with status 2 and a one-line error when `our_script` (if given) does not exist (`hint` ends
    that line) or, with `sb3`, when stable-baselines3 is not installed."""
    if our_script is not None and not our_script.exists():
        print(f"error: {our_script} not found; run from a checkout that has it{hint}", file=sys.stderr)
        sys.exit(2)
    if sb3:
        try:
            importlib.metadata.version("stable-baselines3")
        except importlib.metadata.PackageNotFoundError:
            print("error: stable-baselines3 is not installed; "
                  "pip install -r benchmarks/requirements.txt", file=sys.stderr)
            sys.exit(2)


def machine(packages):
    """The machine and the versions of `packages` (distribution names, e.g. "ale-py"), each under its
    name with "_" for "-" ("ale_py"), after the CPU, platform, load average and Python version."""

    def version(package):
        try:
            return importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    cpu = platform.processor()
    if not cpu or cpu == platform.machine():  # Linux often says only "x86_64" here
        try:
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
        except OSError:
            pass
    info = {
        "cpu": cpu or platform.machine(),
        "nproc": os.cpu_count(),
        "platform": platform.platform(),
        "load_average_at_start": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        "python": platform.python_version(),
    }
    for package in packages:
        info[package.replace("-", "_")] = version(package)
    return info


def warn_if_busy(info, consequence):
    """Warn when the load average at start (from `machine`) is above 0.5; `consequence` ends the line."""
    if info["load_average_at_start"] and info["load_average_at_start"] > 0.5:
        print(f"warning: 1-minute load average is {info['load_average_at_start']} before starting; "
              f"other work on this machine {consequence}", flush=True)


def machine_line(info, packages):
    """The report's line about the machine: `info` from `machine(packages)`, the packages in that order."""
    versions = "".join(f"{package} {info[package.replace('-', '_')]}, " for package in packages)
    return (f"machine: {info['cpu']}, nproc {info['nproc']}, {info['platform']}, python {info['python']}, "
            f"{versions}load average at start {info['load_average_at_start']}")


def fmt(value, spec):
    return "–" if value is None else format(value, spec)


# --------------------------------------------------------------------------------------------------
# Learning curves over seeds (atari_learning.py, cartpole_learning.py): running, the kept logs, the
# table and the plot
# --------------------------------------------------------------------------------------------------

RETURN_TAG, LENGTH_TAG = "charts/episodic_return", "charts/episodic_length"
WINDOW = 100  # episodes in the moving mean
MIN_EPISODES = 10  # a curve starts once its run has finished this many episodes
PLOTS_DIR = REPO_ROOT / "benchmarks" / "plots"


@dataclass(frozen=True)
class Learning:
    """What a learning-curve benchmark names.

    `name`: its results folder under benchmarks/results/; `script`: our ppo_*.py; `variants`: the
    trained ones in order (their logs `<variant>_seed<S>.csv`), then "random"; `labels`, `colors`:
    per variant; `packages`: whose versions the report names; `unit`: the word for an episode
    ("game"), `score`: for its return ("score"); `x_label`, `y_label`: the plot's axes; `note`: the
    table's footnote after "<env>, budget <N> steps per run "; `target`: a return drawn as a line,
    with the first step each run's moving mean reached it in the table (None: neither).
    """

    name: str
    script: Path
    variants: tuple
    labels: dict
    colors: dict
    packages: tuple
    unit: str
    score: str
    x_label: str
    y_label: str
    note: str
    target: float = None
    legend_loc: str = "upper left"

    @property
    def trained(self):
        return tuple(v for v in self.variants if v != "random")

    @property
    def default_results(self):
        return REPO_ROOT / "benchmarks" / "results" / self.name


def learning_arguments(parser, bench, steps, timeout, plot_every, plot_help):
    """Add the options every learning benchmark has (after its own, e.g. `--env`)."""
    unit = bench.unit
    parser.add_argument("--variants", nargs="+", choices=bench.variants,
                        default=list(bench.variants),
                        help="what to run (with --plot-only: what to show)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3], help="seeds to run")
    parser.add_argument("--steps", type=int, default=steps,
                        help="env steps per training run; the learning rate anneals over them")
    parser.add_argument(f"--random-{unit}s", type=int, default=100, dest="random_count",
                        help=f"whole {unit}s played by the random policy")
    parser.add_argument("--random-seed", type=int, default=1,
                        help="seed of the random policy's environment and actions")
    parser.add_argument("--our-args", default="",
                        help=f"extra arguments for {bench.script.name}, one string, "
                        'e.g. "--no-compile"')
    parser.add_argument("--nice", type=int, default=0,
                        help="start each training child under `nice -n NICE` (0: not)")
    parser.add_argument("--timeout", type=float, default=timeout, help="seconds allowed per run")
    parser.add_argument("--results-dir", type=Path, default=bench.default_results,
                        help="where the runs' logs, runs.json and table.md are kept")
    parser.add_argument("--plot", type=Path, default=None, help=plot_help)
    parser.add_argument("--plot-every", type=int, default=plot_every,
                        help="steps between curve points")
    parser.add_argument("--plot-only", action="store_true",
                        help="run nothing: the table and the plot from the kept logs")
    parser.add_argument("--keep-run", nargs=3, metavar=("VARIANT", "SEED", "RUN_DIR"),
                        help="run nothing: keep a finished run of ours made by hand (one too long "
                        "for a sitting, resumed across days) as VARIANT's seed SEED")
    parser.add_argument("--_sb3-child", nargs=2, metavar=("SEED", "OUTFILE"), dest="sb3_child",
                        help=argparse.SUPPRESS)


def check_learning_arguments(parser, args, bench, plot_name):
    """Check the parsed options of `learning_arguments`; the plot goes to benchmarks/plots/PLOT_NAME
    with the default results dir, else into the results dir."""
    args.variants = [v for v in bench.variants if v in args.variants]  # fixed order, no duplicates
    if min(args.steps, args.timeout, args.random_count, args.plot_every) <= 0:
        parser.exit(2, f"error: --steps, --timeout, --random-{bench.unit}s and --plot-every "
                    "must be positive\n")
    args.results_dir = args.results_dir.resolve()
    if args.plot is None:
        folder = PLOTS_DIR if args.results_dir == bench.default_results else args.results_dir
        args.plot = folder / plot_name


def read_episodes(run_dir):
    """Every finished episode's (step, return, length), from the TensorBoard events in `run_dir`."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0},  # 0: keep every one
                              purge_orphaned_data=False)
    events.Reload()
    if RETURN_TAG not in events.Tags()["scalars"]:
        return []
    returns, lengths = events.Scalars(RETURN_TAG), events.Scalars(LENGTH_TAG)
    if [e.step for e in returns] != [e.step for e in lengths]:
        raise RuntimeError(f"{run_dir}: the {RETURN_TAG} and {LENGTH_TAG} events do not pair up")
    return [(r.step, r.value, int(n.value)) for r, n in zip(returns, lengths)]


def nice_prefix(args):
    return ["nice", "-n", str(args.nice)] if args.nice else []


def run_ours_logged(script, script_args, key, args):
    """Train `python SCRIPT SCRIPT_ARGS --run-dir <tmp> --our-args...` in a fresh run dir, under
    `--nice`; returns (run record, its episodes from `read_episodes`, output tail)."""
    with tempfile.TemporaryDirectory(prefix=f"{key}_") as tmp, \
            tempfile.TemporaryDirectory(prefix=f"{key}_log_") as log_dir:
        cmd = [*nice_prefix(args), sys.executable, str(script), *script_args, "--run-dir", tmp,
               *shlex.split(args.our_args)]
        returncode, wall, tail = timed_run(cmd, args.timeout, log_dir)
        summary_path = Path(tmp) / "summary.json"
        summary = json.loads(summary_path.read_text()) if summary_path.exists() else None
        episodes = read_episodes(tmp)
    record = {
        "status": run_status(returncode, summary, args.timeout),
        "exit_status": returncode,
        "command": shlex.join(cmd),
        "wall_seconds": round(wall, 2),
        "steps": summary.get("steps") if summary else None,
        "steps_per_second": summary.get("steps_per_second") if summary else None,
    }
    return record, episodes, tail


def run_sb3_logged(child_file, seed, child_args, args, target=None):
    """Train SB3 in a child process `python CHILD_FILE --_sb3-child SEED <out> CHILD_ARGS` (which
    ends with `sb3_learn_and_record`), under `--nice`; returns (run record, episodes, output
    tail). With a `target` return, the record also holds the first step at which the mean return of
    the last WINDOW episodes reached it and the seconds from the child's launch to that episode's
    end (`target_step`, `target_seconds`; None if never)."""
    with tempfile.TemporaryDirectory(prefix=f"sb3_seed{seed}_") as tmp:
        out_file = Path(tmp) / "result.json"
        cmd = [*nice_prefix(args), sys.executable, str(Path(child_file).resolve()),
               "--_sb3-child", str(seed), str(out_file), *child_args]
        launch = time.time()
        returncode, wall, tail = timed_run(cmd, args.timeout, tmp)
        result = json.loads(out_file.read_text()) if out_file.exists() else None
    status = run_status(returncode, result, args.timeout, missing="no result written")
    record = {
        "status": status,
        "exit_status": returncode,
        "command": shlex.join(cmd),
        "wall_seconds": round(wall, 2),
        "steps": result["steps"] if result else None,
        "steps_per_second": round(result["steps_per_second"], 1)
        if result and result["steps_per_second"] else None,
        "setup_seconds": round(result["setup_seconds"], 2) if result else None,
        "learn_seconds": round(result["learn_seconds"], 2) if result else None,
    }
    episodes = [tuple(episode) for episode in result["episodes"]] if result else []
    if target is not None:
        step = first_reaching(episodes, target)
        index = [episode[0] for episode in episodes].index(step) if step is not None else None
        record["target_step"] = step
        record["target_seconds"] = (round(result["episode_wall_times"][index] - launch, 2)
                                    if index is not None else None)
    return record, episodes, tail


def sb3_learn_and_record(model, env, total_timesteps, out_file, setup_start, stop_at=None):
    """In the SB3 child: `model.learn(total_timesteps)` with a callback that keeps (step, return,
    agent steps) of every finished episode (the Monitor's `info["episode"]`, at
    `self.num_timesteps`; the length counted by the callback itself, since an Atari Monitor counts
    frames) and the wall-clock time (`time.time()`) at which it ended, and the steady speed from the
    end of the first rollout + update; close `env` and write it all to `out_file` as JSON.
    `setup_start`: `time.perf_counter()` before the env was made. `stop_at`: a return at which
    learning ends, once the mean of the last WINDOW episodes reaches it (as our scripts'
    `--target-return`); None: the whole budget."""
    from stable_baselines3.common.callbacks import BaseCallback

    class RecordEpisodes(BaseCallback):
        def __init__(self):
            super().__init__()
            self.episodes, self.lengths = [], [0] * env.num_envs
            self.episode_wall_times = []
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
                    episode = (self.num_timesteps, float(info["episode"]["r"]), self.lengths[i])
                    self.episodes.append(episode)
                    self.episode_wall_times.append(time.time())
                    self.lengths[i] = 0
            if stop_at is None or len(self.episodes) < WINDOW:
                return True
            return statistics.fmean(episode[1] for episode in self.episodes[-WINDOW:]) < stop_at

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
    result = {
        "steps": model.num_timesteps,
        "steps_per_second": steady,
        "setup_seconds": learn_start - setup_start,
        "learn_seconds": learn_end - learn_start,
        "episodes": callback.episodes,
        "episode_wall_times": callback.episode_wall_times,
    }
    Path(out_file).write_text(json.dumps(result))


def random_episodes(env_id, count, seed):
    """`count` episodes of `env_id` with actions from its own action space's `sample()`, seeded once
    with `seed` (env and actions): (returns, lengths, a description of how, for runs.json)."""
    import gymnasium as gym

    env = gym.make(env_id)
    env.action_space.seed(seed)
    returns, lengths = [], []
    env.reset(seed=seed)  # seeded once; each later reset goes on from there
    while len(returns) < count:
        total, length, done = 0.0, 0, False
        while not done:
            _, reward, terminated, truncated, _ = env.step(env.action_space.sample())
            total, length, done = total + float(reward), length + 1, terminated or truncated
        returns.append(total)
        lengths.append(length)
        env.reset()
    env.close()
    return returns, lengths, (f"in this process: gymnasium.make({env_id!r}), reset(seed={seed}) "
                              f"once, action_space.seed({seed}), action_space.sample()")


def sb3_zoo_cartpole(seed):
    """(env, model): Stable-Baselines3 PPO with rl-baselines3-zoo's tuned CartPole-v1
    hyperparameters (8 envs, n_steps 32, batch 256, 20 epochs, gamma 0.98, GAE lambda 0.8, no
    entropy bonus, learning rate `lin_1e-3`, clip range `lin_0.2`; the zoo's budget is 1e5 steps),
    on the CPU. The schedules decay over whatever budget `learn` is given."""
    from stable_baselines3 import PPO
    from stable_baselines3.common.env_util import make_vec_env

    env = make_vec_env("CartPole-v1", n_envs=8, seed=seed)
    model = PPO(
        "MlpPolicy",
        env,
        n_steps=32,
        batch_size=256,
        n_epochs=20,
        gamma=0.98,
        gae_lambda=0.8,
        ent_coef=0.0,
        learning_rate=linear_schedule(1e-3),
        clip_range=linear_schedule(0.2),
        device="cpu",
        seed=seed,
        verbose=0,
    )
    return env, model


def number(value):
    return format(value, ".10g")


def write_csv(path, header, rows):
    temporary = path.with_name(path.name + ".tmp")
    with open(temporary, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows([[number(v) if isinstance(v, float) else v for v in row] for row in rows])
    os.replace(temporary, path)


def read_csv(path):
    """The rows of a kept CSV as (int, float, int) tuples."""
    with open(path, newline="") as f:
        return [(int(row[0]), float(row[1]), int(row[2])) for row in list(csv.reader(f))[1:]]


def load_runs(results_dir):
    path = results_dir / "runs.json"
    return json.loads(path.read_text()) if path.exists() else {}


def append_table(results_dir, text):
    """Print a table, and append it to the results dir's table.md (after `learning_report`'s)."""
    print()
    print(text, end="")
    with open(Path(results_dir) / "table.md", "a") as table:
        table.write("\n" + text)


def save_run(results_dir, key, record):
    """Put one run's record into runs.json under `key`, keeping every other key."""
    runs = load_runs(results_dir)
    runs[key] = record
    temporary = results_dir / "runs.json.tmp"
    temporary.write_text(json.dumps(dict(sorted(runs.items())), indent=2) + "\n")
    os.replace(temporary, results_dir / "runs.json")


def display(path):
    path = Path(path).resolve()
    return str(path.relative_to(REPO_ROOT)) if path.is_relative_to(REPO_ROOT) else str(path)


def mean_std(values):
    """(mean, sample standard deviation) of a list: std 0 for one value, both None for none."""
    if not values:
        return None, None
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def curve(episodes, grid, end, window=WINDOW, min_episodes=MIN_EPISODES):
    """The mean return of the last `window` episodes finished by each grid step (None before
    `min_episodes` episodes, or past the run's end)."""
    values, recent, i = [], collections.deque(maxlen=window), 0
    for x in grid:
        while i < len(episodes) and episodes[i][0] <= x:
            recent.append(episodes[i][1])
            i += 1
        values.append(statistics.fmean(recent) if len(recent) >= min_episodes and x <= end
                      else None)
    return values


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


def first_reaching(episodes, target):
    """The step of the first episode after which the mean return of the last WINDOW episodes (a
    full window) is at least `target`, or None."""
    recent = collections.deque(maxlen=WINDOW)
    for step, value, _ in episodes:
        recent.append(value)
        if len(recent) == WINDOW and statistics.fmean(recent) >= target:
            return step
    return None


def keep_run(bench, args):
    """--keep-run VARIANT SEED RUN_DIR: a run of ours made by hand, kept as if this benchmark had
    run it: its episodes from the run dir's TensorBoard events, its record from its summary.json
    and its checkpoint's settings (the budget)."""
    import torch

    variant, seed, run_dir = args.keep_run[0], int(args.keep_run[1]), Path(args.keep_run[2])
    summary = json.loads((run_dir / "summary.json").read_text())
    config = torch.load(run_dir / "checkpoint.pt", weights_only=True)["config"]
    episodes, info, key = read_episodes(run_dir), machine(bench.packages), f"{variant}_seed{seed}"
    args.results_dir.mkdir(parents=True, exist_ok=True)
    write_csv(args.results_dir / f"{key}.csv", ["step", "return", "length"], episodes)
    save_run(args.results_dir, key, {
        "variant": variant, "seed": seed, "budget": config["total_timesteps"],
        "env": summary["env"], "machine_line": machine_line(info, bench.packages),
        "machine": info, "command": f"made by hand in {run_dir}, kept with --keep-run",
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        f"{bench.unit}s": len(episodes), "steps": summary["steps"],
        "wall_seconds": summary["seconds"], "steps_per_second": summary["steps_per_second"],
        "status": "interrupted" if summary["interrupted"] else "ok", "exit_status": 0})
    print(f"kept {key}: {len(episodes)} {bench.unit}s, {summary['steps']:,} steps, "
          f"{summary['seconds'] / 3600:.2f} h")


def load_report(bench, args):
    """What the report shows: per variant, {seed: (run record, episodes)} for the runs that ended
    well, and the random policy's returns, from the kept logs of `args.results_dir`."""
    runs = load_runs(args.results_dir)
    shown = args.variants if args.plot_only else bench.variants
    trained, notes = {}, []
    for variant in (v for v in bench.trained if v in shown):
        for seed in args.seeds:
            key = f"{variant}_seed{seed}"
            path, record = args.results_dir / f"{key}.csv", runs.get(key)
            if record is None or not path.exists():
                continue
            if record["status"] != "ok" or record.get("env") != args.env:
                why = record["status"] if record["status"] != "ok" else f"env {record.get('env')}"
                notes.append(f"{key} left out: {why}")
                continue
            episodes = read_csv(path)
            record = dict(record, steps=record.get("steps") or (episodes[-1][0] if episodes else 0))
            trained.setdefault(variant, {})[seed] = (record, episodes)
    random_returns = None
    if "random" in shown and (args.results_dir / "random.csv").exists():
        record = runs.get("random", {})
        if record.get("env", args.env) == args.env:
            random_returns = [row[1] for row in read_csv(args.results_dir / "random.csv")]
        else:
            notes.append(f"random left out: env {record.get('env')}")
    for variant, seeds in trained.items():
        missing = [str(seed) for seed in args.seeds if seed not in seeds]
        if missing:
            notes.append(f"{variant}: no kept log of a good run for seed {', '.join(missing)}")
    budgets = sorted({r["budget"] for seeds in trained.values() for r, _ in seeds.values()})
    if len(budgets) > 1:
        notes.append(f"warning: the runs shown had different budgets: {budgets}")
    return runs, trained, random_returns, budgets, notes


def learning_table(bench, args, runs, trained, random_returns, budgets, notes):
    """The markdown report, as one string."""
    finals = {v: {s: statistics.fmean([e[1] for e in episodes[-WINDOW:]]) if episodes else None
                  for s, (_, episodes) in seeds.items()} for v, seeds in trained.items()}
    means = {v: mean_std([x for x in f.values() if x is not None]) for v, f in finals.items()}
    sb3 = means.get("sb3", (None, None))[0]
    unit = bench.unit
    # The returns whose first reaching is reported: the benchmark's target, or --targets.
    targets = getattr(args, "targets", None) or ([bench.target] if bench.target is not None else [])

    def ratio(mean):
        return fmt(mean / sb3 if mean is not None and sb3 else None, ".2f")

    def per_seed(heading=""):
        return "".join(f" {heading if i == 0 else ''}seed {s} |" for i, s in enumerate(args.seeds))

    # With targets, the headings say which seed columns are which.
    target_columns = "".join(per_seed(f"first step at ≥ {target:g}: ") + " mean ± std |"
                             for target in targets)
    seed_columns = per_seed(f"{bench.score} at end: " if target_columns else "")
    lines = [f"| variant |{seed_columns} mean ± std over seeds | ratio to SB3 |{target_columns} "
             f"{unit}s per seed | steps/s |",
             "| --- |" + " ---: |" * (len(args.seeds) + 4 + len(targets) * (len(args.seeds) + 1))]
    for variant, seeds in trained.items():
        cells = "".join(f" {fmt(finals[variant].get(s), '.2f')} |" for s in args.seeds)
        mean, std = means[variant]
        target_cells = ""
        for target in targets:
            reached = {s: first_reaching(episodes, target) for s, (_, episodes) in seeds.items()}
            steps = [x for x in reached.values() if x is not None]
            step_mean, step_std = mean_std(steps)
            share = f" ({len(steps)}/{len(seeds)} seeds)" if len(steps) < len(seeds) else ""
            target_cells += ("".join(f" {fmt(reached.get(s), ',')} |" for s in args.seeds)
                             + f" {fmt(step_mean, ',.0f')} ± {fmt(step_std, ',.0f')}{share} |")
        episodes = " / ".join(str(len(seeds[s][1])) if s in seeds else "–" for s in args.seeds)
        speeds = [r["steps_per_second"] for r, _ in seeds.values() if r.get("steps_per_second")]
        speed = statistics.fmean(speeds) if speeds else None
        lines.append(f"| {bench.labels[variant]} |{cells} **{fmt(mean, '.2f')}** ± "
                     f"{fmt(std, '.2f')} | {ratio(mean)} |{target_cells}"
                     f" {episodes} | {fmt(speed, '.0f')} |")
    if random_returns:
        mean, std = mean_std(random_returns)
        error = std / math.sqrt(len(random_returns))
        never = " – |" * (len(args.seeds) + 1) * len(targets)
        lines.append(f"| {bench.labels['random']} |" + " – |" * len(args.seeds)
                     + f" {mean:.2f} ± {std:.2f} (std over {len(random_returns)} {unit}s; "
                       f"standard error {error:.2f}) | {ratio(mean)} |{never} – | – |")
    budget = " / ".join(f"{b:,}" for b in budgets) or "–"
    lines += [""] + textwrap.wrap(f"{args.env}, budget {budget} steps per run {bench.note}",
                                  width=100)
    shown = [r for seeds in trained.values() for r, _ in seeds.values()]
    shown += [runs["random"]] if random_returns and "random" in runs else []
    for line in sorted({r["machine_line"] for r in shown}):
        lines += [""] + textwrap.wrap(line, width=100)
    dates = sorted(r["date"] for r in shown)
    if dates:
        now = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        lines += ["", f"runs: {dates[0]} to {dates[-1]}; report: {now}"]
    for note in notes:
        lines += ["", note]
    return "\n".join(lines) + "\n"


def learning_plot(bench, args, trained, random_returns, budgets, path, window=WINDOW,
                  min_episodes=MIN_EPISODES, reference=None):
    """Per variant, the mean over seeds of `curve` (over `window` episodes) every `--plot-every`
    steps as a line and the min–max over seeds as a band; the random policy's mean ± one standard
    error; the target, or `reference` = (value, label) in its place."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    end = max((r["steps"] for seeds in trained.values() for r, _ in seeds.values()), default=0)
    fig, ax = plt.subplots(figsize=(9, 5.5), dpi=120)
    for variant, seeds in trained.items():
        ends = {r["steps"] for r, _ in seeds.values()}
        grid = sorted(set(range(args.plot_every, end + 1, args.plot_every)) | ends)
        curves = [curve(episodes, grid, r["steps"], window, min_episodes)
                  for r, episodes in seeds.values()]
        points = [(x, [c[k] for c in curves]) for k, x in enumerate(grid)
                  if all(c[k] is not None for c in curves)]
        if not points:
            continue
        xs = [x for x, _ in points]
        ax.plot(xs, [statistics.fmean(v) for _, v in points], color=bench.colors[variant], lw=2,
                label=f"{bench.labels[variant]} ({len(seeds)} seeds)")
        ax.fill_between(xs, [min(v) for _, v in points], [max(v) for _, v in points],
                        color=bench.colors[variant], alpha=0.2, lw=0)
    if random_returns:
        mean, std = mean_std(random_returns)
        error = std / math.sqrt(len(random_returns))
        ax.axhline(mean, color=bench.colors["random"], ls="--", lw=1.5,
                   label=f"{bench.labels['random']} ({len(random_returns):,} {bench.unit}s, "
                         "± 1 standard error)")
        ax.axhspan(mean - error, mean + error, color=bench.colors["random"], alpha=0.15, lw=0,
                   zorder=0)
    if reference is not None:
        ax.axhline(reference[0], color="black", ls=":", lw=1.2, label=reference[1])
    elif bench.target is not None:
        ax.axhline(bench.target, color="black", ls=":", lw=1,
                   label=f"target {bench.target:g} (mean of {WINDOW} {bench.unit}s)")
    budget = " / ".join(f"{b:,}" for b in budgets) or "–"
    seeds = sorted({seed for runs in trained.values() for seed in runs})
    ax.set_title(f"{args.env}: PPO, {budget} steps, seeds {', '.join(map(str, seeds))}\n"
                 f"line: mean over seeds; band: min–max over seeds", fontsize=11)
    ax.set_xlabel(bench.x_label)
    ax.set_ylabel(bench.y_label)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x / 1000:g}k" if x else "0"))
    ax.set_xlim(0, max(end, args.plot_every))
    ax.grid(alpha=0.3)
    ax.legend(loc=bench.legend_loc, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def learning_report(bench, args):
    """Print the table, write it to table.md and draw the plot, from the kept logs only."""
    runs, trained, random_returns, budgets, notes = load_report(bench, args)
    if not trained and not random_returns:
        print(f"error: no kept logs for these variants and seeds in {display(args.results_dir)}",
              file=sys.stderr)
        sys.exit(1)
    text = learning_table(bench, args, runs, trained, random_returns, budgets, notes)
    print()
    print(text, end="")
    (args.results_dir / "table.md").write_text(text)
    learning_plot(bench, args, trained, random_returns, budgets, args.plot)
    print(f"\nwrote {display(args.results_dir / 'table.md')} and {display(args.plot)}")


def run_learning(bench, args, run_variant, play_random):
    """Run the random policy, then the trained variants interleaved over the seeds (seed 1: each
    variant, seed 2: ...) so that background load hits all alike; keep each run's log and record;
    then `learning_report`. `run_variant(variant, seed, args)` returns (run record, episodes, output
    tail); `play_random(args)` plays `args.random_count` episodes and returns (returns, lengths,
    a description of how, for runs.json)."""
    info = machine(bench.packages)  # taken now, so the load average is the one the runs start under
    warn_if_busy(info, "slows the runs (the scores do not depend on it)")
    args.results_dir.mkdir(parents=True, exist_ok=True)
    common = {"env": args.env, "machine_line": machine_line(info, bench.packages), "machine": info,
              "benchmark_command": shlex.join([sys.executable, *sys.argv])}
    unit = bench.unit

    # The random policy first: it takes seconds, and a broken setup shows before the long runs.
    if "random" in args.variants:
        print(f"random policy: {args.random_count} {unit}s of {args.env} ...", flush=True)
        date = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        start = time.perf_counter()
        returns, lengths, command = play_random(args)
        wall = time.perf_counter() - start
        write_csv(args.results_dir / "random.csv", [unit, "return", "length"],
                  [(i + 1, r, n) for i, (r, n) in enumerate(zip(returns, lengths))])
        save_run(args.results_dir, "random", {
            "variant": "random", "seed": args.random_seed, **common, "command": command,
            "date": date, "wall_seconds": round(wall, 2), f"{unit}s": len(returns),
            "steps": sum(lengths), "steps_per_second": round(sum(lengths) / wall, 1),
            "status": "ok", "exit_status": 0})
        mean, std = mean_std(returns)
        print(f"  {mean:.2f} ± {std:.2f} over {len(returns)} {unit}s ({wall:.1f} s)", flush=True)

    for seed in args.seeds:
        for variant in (v for v in bench.trained if v in args.variants):
            print(f"running {variant} seed {seed} ...", flush=True)  # its budget: the line after
            date = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
            record, episodes, tail = run_variant(variant, seed, args)
            key = f"{variant}_seed{seed}"
            record = {"variant": variant, "seed": seed, "budget": args.steps, **common,
                      "date": date, f"{unit}s": len(episodes), **record}
            csv_path = args.results_dir / f"{key}.csv"
            csv_path.unlink(missing_ok=True)  # a failed run leaves no stale log of an earlier one
            if episodes:
                write_csv(csv_path, ["step", "return", "length"], episodes)
            save_run(args.results_dir, key, record)
            if record["status"] != "ok":
                report_failure(variant, seed, record["status"], tail)
            last = statistics.fmean(e[1] for e in episodes[-WINDOW:]) if episodes else None
            print(f"  mean {bench.score} of the last {min(len(episodes), WINDOW)} of "
                  f"{len(episodes)} {unit}s {fmt(last, '.2f')}, {fmt(record['steps'], ',')} "
                  f"of {fmt(record['budget'], ',')} steps, {record['wall_seconds']:.1f} s wall, "
                  f"{fmt(record['steps_per_second'], '.0f')} steps/s steady ({record['status']})",
                  flush=True)

    learning_report(bench, args)
