"""Bad and odd input, as a new user types it: every script against the same matrix of cases.

What it measures
----------------
For each script (or the ones named) and each case below, one run of
`python ppo_<x>.py <case's flags> --run-dir <fresh tmp dir>/run` from the repository root. A case
is *clean* when the run exits with status 2 within its time limit, stderr is exactly one line that
starts with "error: ", no traceback was printed, and the run dir it was given was not made. The
cases:

- flags: unknown, misspelled, a prefix of a real flag, a missing value, a word for a number, a
  fraction for a whole number;
- numbers: each flag with a valid range (--help shows it) given a value outside it, and each float
  flag given nan and inf;
- combinations: --video or --greedy without --eval, --eval with --resume, minibatches that do not
  split the batch, a device that is not there, a rollout larger than the memory free;
- checkpoints for --resume and for --eval: a missing path, an empty folder, an empty file, a file
  that is not a checkpoint, a truncated checkpoint, and another script's checkpoint;
- run folders: under a file, in a folder that cannot be written, one that holds another run;
- envs: an unknown id, a misspelled id, and each other script's default env (which this script
  must refuse, naming the script that takes it, or take).

A case whose env another script takes may also be taken (exit 0 after a short run) where this
script handles it: such a case counts as clean when the run trains to its end. The report lists the
unclean cases with their exit status and the first lines of stderr, and the count per script.

How to run it (from the repository root; about 5 minutes on 2 cores)
    python benchmarks/bad_input.py
    python benchmarks/bad_input.py --scripts ppo_cartpole ppo_spaces --json bad_input.json
"""

import argparse
import dataclasses
import importlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import REPO_ROOT, machine, machine_line

SCRIPTS = ["ppo_cartpole", "ppo_atari", "ppo_continuous", "ppo_memory", "ppo_multiagent",
           "ppo_spaces"]
# A tiny run of each script, to make the checkpoints the checkpoint cases need.
SMALL = {
    "ppo_cartpole": ["--num-envs", "4", "--num-steps", "16", "--total-timesteps", "64"],
    "ppo_atari": ["--num-envs", "2", "--num-steps", "32", "--total-timesteps", "64",
                  "--no-compile"],
    "ppo_continuous": ["--num-envs", "4", "--num-steps", "16", "--num-minibatches", "2",
                       "--total-timesteps", "64"],
    "ppo_memory": ["--num-envs", "4", "--num-steps", "16", "--num-minibatches", "2",
                   "--total-timesteps", "64"],
    "ppo_multiagent": ["--num-envs", "2", "--num-steps", "8", "--num-workers", "0",
                       "--total-timesteps", "48"],
    "ppo_spaces": ["--num-envs", "4", "--num-steps", "16", "--total-timesteps", "64"],
}
FOREIGN = {"ppo_cartpole": "ppo_atari"}  # whose checkpoint each script is given (else cartpole's)
TIME_LIMIT = 120  # seconds a refusal may take (an env id is looked up, a checkpoint loaded)
ENVIRON = {**os.environ, "OMP_NUM_THREADS": "1"}


def config_fields(script: str) -> list:
    sys.path.insert(0, str(REPO_ROOT))
    return dataclasses.fields(importlib.import_module(script).Config)


def out_of_range(rule: str):
    """A value the rule refuses."""
    return {"> 0": "0", ">= 0": "-1", "(0, 1]": "0", "[0, 1]": "1.5"}[rule]


def cases(script: str, files: dict) -> list:
    """(name, flags, may_train) for one script; may_train: an exit 0 counts as clean too."""
    fields = {field.name: field for field in config_fields(script)}
    flag = lambda name: "--" + name.replace("_", "-")
    found = [
        ("unknown flag", ["--colour", "red"], False),
        ("misspelled flag", ["--learnign-rate", "0.1"], False),
        ("prefix of a flag", ["--learning-rat", "0.1"], False),
        ("missing value", ["--num-envs"], False),
        ("word for a number", ["--learning-rate", "fast"], False),
        ("fraction for a whole number", ["--num-envs", "2.5"], False),
        ("--video without --eval", ["--video"], False),
        ("--greedy without --eval", ["--greedy"], False),
        ("--eval with --resume", ["--eval", files["own"], "--resume", files["own"]], False),
        ("minibatches that do not split", ["--num-envs", "3", "--num-steps", "3",
                                           "--num-minibatches", "2"], False),
        ("no such device", ["--device", "cuda:7"], False),
        ("a device that is not one", ["--device", "tpu"], False),
        ("a rollout larger than memory", ["--num-envs", "1000000", "--num-steps", "100000"],
         False),
        ("unknown env", ["--env", "NoSuchGame-v0"], False),
        ("misspelled env", ["--env", "CartPol-v1"], False),
    ]
    for name, field in fields.items():
        rule = field.metadata.get("check")
        if rule:
            found.append((f"{flag(name)} out of range", [flag(name), out_of_range(rule)], False))
        if "float" in str(field.type):
            found += [(f"{flag(name)} nan", [flag(name), "nan"], False),
                      (f"{flag(name)} inf", [flag(name), "inf"], False)]
    for option in ("--resume", "--eval"):
        found += [(f"{option} missing path", [option, "/no/such/run"], False),
                  (f"{option} empty folder", [option, files["empty folder"]], False),
                  (f"{option} empty file", [option, files["empty file"]], False),
                  (f"{option} not a checkpoint", [option, files["text file"]], False),
                  (f"{option} truncated checkpoint", [option, files["truncated"]], False),
                  (f"{option} another script's checkpoint", [option, files["foreign"]], False)]
    found += [("run dir under a file", ["--run-dir", files["text file"] + "/run"], False),
              ("run dir that cannot be written", ["--run-dir", "/proc/run"], False),
              ("run dir holding another run", ["--run-dir", files["own folder"]], False)]
    for other, env in DEFAULT_ENVS.items():
        if other != script:
            found.append((f"{other}'s env {env}", ["--env", env], True))
    return found


DEFAULT_ENVS = {"ppo_cartpole": "CartPole-v1", "ppo_atari": "BreakoutNoFrameskip-v4",
                "ppo_continuous": "Pendulum-v1", "ppo_memory": "StatelessCartPole-v1",
                "ppo_multiagent": "mpe2.simple_spread_v3", "ppo_spaces": "Taxi-v3"}


def make_files(script: str, folder: Path) -> dict:
    """The paths the checkpoint and run-folder cases give: a real run of the script, another
    script's checkpoint, and broken files."""
    runs = {}
    for name in {script, FOREIGN.get(script, "ppo_cartpole")}:
        run_dir = folder / name
        if not (run_dir / "checkpoint.pt").exists():
            subprocess.run([sys.executable, f"{name}.py", *SMALL[name], "--run-dir", str(run_dir)],
                           cwd=REPO_ROOT, env=ENVIRON, capture_output=True, timeout=600,
                           check=True)
        runs[name] = run_dir
    (folder / "empty").mkdir(exist_ok=True)
    (folder / "empty.pt").write_bytes(b"")
    (folder / "notes.txt").write_text("not a checkpoint\n")
    checkpoint = (runs[script] / "checkpoint.pt").read_bytes()
    (folder / "truncated.pt").write_bytes(checkpoint[:len(checkpoint) // 2])
    foreign = runs[FOREIGN.get(script, "ppo_cartpole")]
    return {"own": str(runs[script]), "own folder": str(runs[script]),
            "empty folder": str(folder / "empty"), "empty file": str(folder / "empty.pt"),
            "text file": str(folder / "notes.txt"), "truncated": str(folder / "truncated.pt"),
            "foreign": str(foreign / "checkpoint.pt") if foreign != runs[script] else
            str(folder / "truncated.pt")}


def run_case(script: str, flags: list, may_train: bool, folder: Path) -> dict:
    run_dir = folder / "case_run"
    shutil.rmtree(run_dir, ignore_errors=True)
    given = flags if "--run-dir" in flags else [*flags, "--run-dir", str(run_dir)]
    short = SMALL[script] if may_train else []
    started = time.perf_counter()
    try:
        result = subprocess.run([sys.executable, f"{script}.py", *short, *given], cwd=REPO_ROOT,
                                env=ENVIRON, capture_output=True, text=True, timeout=TIME_LIMIT)
        status, stderr = result.returncode, result.stderr
    except subprocess.TimeoutExpired as expired:
        status, stderr = None, (expired.stderr or b"").decode(errors="replace")
    seconds = time.perf_counter() - started
    lines = [line for line in stderr.splitlines() if line.strip()]
    one_line = status == 2 and len(lines) == 1 and lines[0].startswith("error: ")
    # (a case that names its own run dir: that folder is a file's child, unwritable, or a run's)
    refused = one_line and ("--run-dir" in flags or not run_dir.exists())
    trained = may_train and status == 0 and "Traceback" not in stderr
    return {"status": status, "seconds": round(seconds, 2), "stderr": lines[:3],
            "clean": bool(refused or trained)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scripts", nargs="+", default=SCRIPTS, choices=SCRIPTS)
    parser.add_argument("--json", help="write the results here too")
    args = parser.parse_args()
    results, started = {}, time.time()
    with tempfile.TemporaryDirectory() as temporary:
        folder = Path(temporary)
        for script in args.scripts:
            files = make_files(script, folder)
            results[script] = {}
            for name, flags, may_train in cases(script, files):
                outcome = run_case(script, flags, may_train, folder)
                results[script][name] = {"flags": flags, **outcome}
                if not outcome["clean"]:
                    print(f"{script}: {name}: exit {outcome['status']}, {outcome['seconds']} s: "
                          f"{' | '.join(outcome['stderr']) or '(nothing on stderr)'}", flush=True)
            clean = sum(case["clean"] for case in results[script].values())
            print(f"{script}: {clean} of {len(results[script])} clean", flush=True)
    total = sum(len(cases) for cases in results.values())
    clean = sum(case["clean"] for cases in results.values() for case in cases.values())
    print(f"all: {clean} of {total} clean, {time.time() - started:.0f} s")
    packages = ["torch", "gymnasium"]
    info = machine(packages)
    print(machine_line(info, packages))
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": info, "results": results}, indent=1))


if __name__ == "__main__":
    main()
