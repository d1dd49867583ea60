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
- `linear_schedule` is SB3's linear decay to 0, for the SB3 reference runs.

Only the ppo_*.py scripts are single files; the benchmarks import this module with
`from harness import ...`, which works because `python benchmarks/x.py` puts `benchmarks/` first on
`sys.path` (for the script and for the children it starts from that same file). Like the benchmarks'
top level, this module imports only the standard library, so that a child process pays for its own
imports of torch, gymnasium or SB3.
"""

import importlib.metadata
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
TAIL_LINES = 25  # lines of a failed run's output to show


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
