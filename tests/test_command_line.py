"""Every script's command line as a user meets it (issue 21): bad input answered in one line (argparse's
errors and --help before torch is imported), the run folder, the start-up block and the exit line,
resume and eval from a run folder, and no stray warnings. One short run per script is shared by the
checks of the run folder, the start-up block and resume."""
import ast
import dataclasses
import importlib
import io
import json
import os
import re
import resource
import statistics
import subprocess
import sys

import pytest
import torch

from conftest import ROOT

SCRIPTS = [
    "ppo_cartpole", "ppo_atari", "ppo_continuous", "ppo_memory", "ppo_multiagent", "ppo_spaces"]

# Small runs: the flags of a rollout of ROLLOUT[script] steps (the unit of --total-timesteps: agent
# steps for ppo_multiagent.py, whose simple_spread has 3 agents).
SMALL = {
    "ppo_cartpole": ["--num-envs", 4, "--num-steps", 16],
    "ppo_atari": ["--num-envs", 2, "--num-steps", 32],
    "ppo_continuous": ["--num-envs", 4, "--num-steps", 16, "--num-minibatches", 2],
    "ppo_memory": ["--num-envs", 4, "--num-steps", 16, "--num-minibatches", 2],
    "ppo_multiagent": ["--num-envs", 2, "--num-steps", 8, "--num-workers", 0],
    "ppo_spaces": ["--num-envs", 4, "--num-steps", 16],
}
ROLLOUT = {"ppo_cartpole": 64, "ppo_atari": 64, "ppo_continuous": 64, "ppo_memory": 64,
           "ppo_multiagent": 2 * 8 * 3, "ppo_spaces": 64}
# Flags of every run: eager (compiling costs ppo_atari.py a minute) and on the CPU.
RUN_FLAGS = {script: ["--device", "cpu"] for script in SCRIPTS}
RUN_FLAGS["ppo_atari"] = ["--device", "cpu", "--no-compile"]
CHECKPOINT = "checkpoint.pt"

# A terminal without a session's runtime folder: SDL complains there unless the script prevents it.
ENVIRON = {**{key: value for key, value in os.environ.items() if key != "XDG_RUNTIME_DIR"},
           "OMP_NUM_THREADS": "1"}


def run_script(script, *args, importtime=False, timeout=300):
    """Run a script from the repository root; with importtime, stderr also lists every import."""
    python = [sys.executable, "-X", "importtime"] if importtime else [sys.executable]
    return subprocess.run([*python, f"{script}.py", *map(str, args)], cwd=ROOT, env=ENVIRON,
                          capture_output=True, text=True, timeout=timeout)


def imports_torch(stderr):
    """Whether `python -X importtime` reported an import of torch or of one of its modules."""
    names = [line.rsplit("|", 1)[1].strip() for line in stderr.splitlines()
             if line.startswith("import time:")]
    return any(name == "torch" or name.startswith("torch.") for name in names)


def error_line(result):
    """The one line a refusal prints: exit status 2, stderr (less -X importtime's lines) exactly one
    non-empty line starting with "error: " (so no traceback and no usage dump)."""
    lines = [line for line in result.stderr.splitlines() if not line.startswith("import time:")]
    status = result.returncode
    assert status == 2, (result.stdout[-2000:], lines[-20:])
    assert len(lines) == 1 and lines[0].startswith("error: "), lines[-20:]
    return lines[0]


def refused_before_torch(script, *args, tmp_path):
    """Run a small, short training command ending in args (the last value of a flag wins), which
    must be refused before torch is imported; return the error line."""
    result = run_script(script, *SMALL[script], "--total-timesteps", ROLLOUT[script],
                        *RUN_FLAGS[script], "--run-dir", tmp_path / "run", *args,
                        importtime=True, timeout=120)
    line = error_line(result)
    torch_imported = imports_torch(result.stderr)
    assert not torch_imported, f"torch was imported before the refusal: {line}"
    return line


# ----- which flags each script has --------------------------------------------------------------


def config_flags(script):
    """The flags of the fields of a script's Config, read from its source."""
    tree = ast.parse((ROOT / f"{script}.py").read_text())
    config = next(node for node in tree.body
                  if isinstance(node, ast.ClassDef) and node.name == "Config")
    return {"--" + item.target.id.replace("_", "-") for item in config.body
            if isinstance(item, ast.AnnAssign)}


def help_entries(text):
    """--help's option entries: {first long flag: (its option strings, the entry on one line)}."""
    entries, current = {}, None
    for line in text.splitlines():
        if line.startswith("  -"):
            flags = re.findall(r"--[a-z][a-z0-9-]*", line[2:].split("  ")[0])
            current = flags[0]
            entries[current] = (flags, line.strip())
        elif current and line.startswith("   "):
            entries[current] = (entries[current][0], entries[current][1] + " " + line.strip())
        else:
            current = None
    return entries


def flags_in_help(text):
    return {flag for flags, _ in help_entries(text).values() for flag in flags}


def listed_flags(script):
    """The flags a script's --help lists (its Config's fields if --help fails: the checks of the
    flags then run and fail, rather than vanish)."""
    result = subprocess.run([sys.executable, f"{script}.py", "--help"], cwd=ROOT, env=ENVIRON,
                            capture_output=True, text=True, timeout=120)
    return flags_in_help(result.stdout) if result.returncode == 0 else config_flags(script)


FLAGS = {script: listed_flags(script) for script in SCRIPTS}


@pytest.fixture(params=SCRIPTS)
def script(request):
    """Each script in turn (a test parametrised by script itself overrides this)."""
    return request.param


# ----- 1. ranges and combinations: one clear message, exit 2 -------------------------------------
# The flags are parsed before torch is imported; their ranges are checked right after the imports
# (check_settings), before anything starts. The checks run here in this process, through the
# scripts' own parse_config and check_settings; one command line per script shows the way out.

OUT_OF_RANGE = [
    ("--gamma", "2"), ("--gamma", "0"), ("--gamma", "nan"), ("--gae-lambda", "1.5"),
    ("--learning-rate", "-1"), ("--learning-rate", "nan"), ("--learning-rate", "inf"),
    ("--clip-coef", "0"), ("--ent-coef", "-1"), ("--vf-coef", "-1"), ("--max-grad-norm", "0"),
    ("--target-kl", "0"), ("--total-timesteps", "0"), ("--num-envs", "0"), ("--num-steps", "0"),
    ("--num-minibatches", "0"), ("--update-epochs", "0"), ("--hidden-size", "0"),
    ("--checkpoint-every", "0"), ("--eval-episodes", "0"), ("--num-workers", "-1"),
    ("--seed", "-1"), ("--target-return", "nan"),
]


def refusal(script, *args):
    """The message with which a script refuses these flags, before any run starts."""
    module = importlib.import_module(script)
    with pytest.raises(module.UsageError) as refused:
        module.check_settings(module.parse_config([str(arg) for arg in args]))
    return str(refused.value)


@pytest.mark.parametrize("script,flag,value", [
    pytest.param(script, flag, value, id=f"{script}-{flag[2:]}={value}")
    for script in SCRIPTS for flag, value in OUT_OF_RANGE if flag in FLAGS[script]])
def test_a_value_out_of_range_is_refused(script, flag, value):
    assert refusal(script, flag, value).startswith(f"{flag} must be ")


def test_a_value_out_of_range_is_one_line_and_exit_2_on_the_command_line(script, tmp_path):
    result = run_script(script, *RUN_FLAGS[script], "--run-dir", tmp_path / "run", "--gamma", "2")
    assert error_line(result) == "error: --gamma must be in (0, 1], not 2.0"
    assert not (tmp_path / "run").exists()  # refused before anything started


@pytest.mark.parametrize("total", ["1e6", "1_000_000"])
def test_a_whole_number_may_be_written_with_an_exponent_or_underscores(script, total):
    assert importlib.import_module(script).parse_config(["--total-timesteps", total]) \
        .total_timesteps == 1_000_000


def test_video_and_greedy_without_eval_are_refused(script):
    assert refusal(script, "--video") == "--video is for --eval's games: add --eval PATH"
    assert refusal(script, "--greedy") == "--greedy is for --eval's games: add --eval PATH"


def test_eval_with_resume_is_refused(script):
    assert refusal(script, "--eval", "x", "--resume", "x") == \
        "--eval plays a checkpoint, --resume trains on from one: give one"


# ----- 2. argparse's own errors: one line, exit 2, before torch ---------------------------------


def test_a_mistyped_flag_is_one_line_suggesting_the_right_one(script, tmp_path):
    line = refused_before_torch(script, "--gama", "2", tmp_path=tmp_path)
    assert "--gama" in line and line.endswith("; did you mean --gamma?"), line


def test_a_missing_value_is_one_line_naming_the_flag(script, tmp_path):
    line = refused_before_torch(script, "--gamma", tmp_path=tmp_path)
    assert line.startswith("error: argument --gamma: "), line


def test_a_fraction_for_a_whole_number_is_one_line_naming_the_flag(script, tmp_path):
    line = refused_before_torch(script, "--total-timesteps", "1.5", tmp_path=tmp_path)
    assert line == "error: argument --total-timesteps: expected a whole number, not '1.5'"


# ----- 5. --help ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def help_runs():
    """Each script's `--help`, run once under -X importtime (stdout: the help; stderr: imports)."""
    runs = {}

    def help_of(script):
        if script not in runs:
            runs[script] = run_script(script, "--help", importtime=True, timeout=120)
            assert runs[script].returncode == 0, runs[script].stderr[-2000:]
        return runs[script]
    return help_of


def test_help_lists_every_flag(script, help_runs):
    listed = flags_in_help(help_runs(script).stdout)
    assert config_flags(script) | {"--overwrite"} <= listed, sorted(listed)


def test_help_shows_each_default_once(script, help_runs):
    entries = help_entries(help_runs(script).stdout)
    for flag in sorted(config_flags(script) & set(entries)):
        assert entries[flag][1].count("(default:") == 1, entries[flag][1]


def test_help_shows_each_number_s_valid_range(script, help_runs):
    entries = help_entries(help_runs(script).stdout)
    module = importlib.import_module(script)
    for field in dataclasses.fields(module.Config):
        flag, rule = "--" + field.name.replace("_", "-"), field.metadata["check"]
        if rule is not None:
            assert f"(valid: {rule})" in entries[flag][1], entries[flag][1]
    assert "(valid: > 0)" in entries["--learning-rate"][1]


def test_help_does_not_import_torch(script, help_runs):
    torch_imported = imports_torch(help_runs(script).stderr)
    assert not torch_imported


def test_help_answers_within_a_second(script):
    # The CPU seconds --help's process spends (a second on an idle core), not the wall clock's:
    # those grow with whatever else runs beside it (pytest-xdist's other workers).
    seconds = []
    for _ in range(3):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        result = run_script(script, "--help", timeout=60)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        seconds.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
        assert result.returncode == 0, result.stderr[-2000:]
    assert statistics.median(seconds) < 1.0, seconds


@pytest.mark.parametrize("script", ["ppo_continuous"])  # its NumPy path
@pytest.mark.parametrize("given", [None, "2"])
def test_the_command_line_gives_numpy_one_thread_before_numpy_loads(script, given):
    # OpenBLAS reads OPENBLAS_NUM_THREADS once, as NumPy loads; a user's own setting is kept.
    driver = ("import os, runpy, sys\n"
              "sys.argv = sys.argv[1:]  # the script's path, then its flags\n"
              "try:\n    runpy.run_path(sys.argv[0], run_name='__main__')\n"
              "except SystemExit:\n    pass\n"
              "print(os.environ.get('OPENBLAS_NUM_THREADS'), 'numpy' in sys.modules)")
    env = {key: value for key, value in os.environ.items() if key != "OPENBLAS_NUM_THREADS"}
    if given:
        env["OPENBLAS_NUM_THREADS"] = given
    result = subprocess.run([sys.executable, "-c", driver, str(ROOT / f"{script}.py"), "--help"],
                            env=env, capture_output=True, text=True, timeout=60)
    assert result.stdout.splitlines()[-1] == f"{given or 1} False"


# ----- the shared runs: a first short run, a resumed one, an eval -------------------------------

FIRST_TOTAL = {script: ROLLOUT[script] * 3 // 2 for script in SCRIPTS}  # rounded up: 2 updates
RESUMED_TOTAL = {script: ROLLOUT[script] * 4 for script in SCRIPTS}  # 2 more updates


def train_first(script, run_dir, *args):
    """A first run into run_dir: FIRST_TOTAL steps, rounded up to 2 rollouts."""
    return run_script(script, *SMALL[script], "--total-timesteps", FIRST_TOTAL[script],
                      *RUN_FLAGS[script], "--run-dir", run_dir, *args)


def folder_files(run_dir):
    return {path.name: path.read_bytes() for path in run_dir.iterdir() if path.is_file()}


def copy_of(run, tmp_path):
    """A copy of the first run's folder as the run left it, for a check that changes it."""
    run_dir = tmp_path / "copy"
    run_dir.mkdir()
    for name, content in run["files"].items():
        (run_dir / name).write_bytes(content)
    return run_dir


def finished(result, run_dir):
    """A run that must have ended well: its folder, its output, its summary."""
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"dir": run_dir, "result": result, "summary": summary}


class SharedRuns:
    """Each script's runs, made once and read by several checks."""

    def __init__(self, tmp_path_factory):
        self.folders, self.made = tmp_path_factory, {}

    def once(self, kind, script, make):
        if (kind, script) not in self.made:
            self.made[kind, script] = make(self.folders.mktemp(f"{script}-{kind}"))
        return self.made[kind, script]

    def first(self, script):
        """The first run, with its files as they were when it ended."""
        def make(folder):
            run = finished(train_first(script, folder / "run"), folder / "run")
            return {**run, "files": folder_files(run["dir"])}
        return self.once("first", script, make)

    def resumed(self, script):
        """The first run resumed from its folder, into that folder, with a larger total."""
        def make(folder):
            run_dir = copy_of(self.first(script), folder)
            return finished(run_script(script, "--resume", run_dir, "--run-dir", run_dir,
                                       "--total-timesteps", RESUMED_TOTAL[script],
                                       *RUN_FLAGS[script]), run_dir)
        return self.once("resumed", script, make)

    def evaluated(self, script):
        """One game played, and filmed, by the first run's policy, named by its folder."""
        def make(folder):
            run_dir = copy_of(self.first(script), folder)
            result = run_script(script, "--eval", run_dir, "--eval-episodes", 1, "--video",
                                *RUN_FLAGS[script])
            assert result.returncode == 0, result.stderr[-3000:]
            return {"dir": run_dir, "result": result}
        return self.once("eval", script, make)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return SharedRuns(tmp_path_factory)


PROGRESS = re.compile(r"step ([\d,]+)/([\d,]+) \((\d+\.\d)%\)")


def number(text):
    return int(text.replace(",", ""))


def start_up_block(stdout):
    """The lines before the first progress line."""
    lines = stdout.splitlines()
    first = next(index for index, line in enumerate(lines) if PROGRESS.match(line))
    return lines[:first]


# ----- 6. an existing run folder ------------------------------------------------------------------


def test_a_run_dir_holding_a_run_is_refused_and_left_untouched(script, runs):
    first = runs.first(script)
    run_dir = first["dir"]
    before = folder_files(run_dir)
    assert {CHECKPOINT, "summary.json"} <= set(before)
    line = error_line(train_first(script, run_dir, "--seed", 2))
    assert line == (f"error: --run-dir {run_dir} already holds a run: continue it with --resume "
                    f"{run_dir}, or choose another --run-dir (--overwrite replaces it)")
    assert folder_files(run_dir) == before == first["files"]


def test_overwrite_replaces_the_run_in_a_run_dir(script, runs, tmp_path):
    run_dir = copy_of(runs.first(script), tmp_path)
    result = train_first(script, run_dir, "--seed", 2, "--overwrite")
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((run_dir / "summary.json").read_text())["seed"] == 2
    assert len(list(run_dir.glob("events.out.tfevents.*"))) == 1  # the old run's log is gone
    assert (run_dir / CHECKPOINT).read_bytes() != runs.first(script)["files"][CHECKPOINT]


# ----- 7. the start-up block, the progress lines, the exit line --------------------------------


def test_start_up_block_names_the_env_device_rounded_total_run_dir_and_settings(script, runs):
    first = runs.first(script)
    block = start_up_block(first["result"].stdout)
    env, total, rollout = first["summary"]["env"], FIRST_TOTAL[script], ROLLOUT[script]
    assert (f"{script}.py: {env} on cpu, seed 1, {2 * rollout:,} steps ({total:,} rounded up to "
            f"whole rollouts of {rollout:,})") in block, block
    assert f"run dir: {first['dir']}" in block, block
    settings = [line for line in block if line.startswith("settings: ")]
    num_envs = SMALL[script][SMALL[script].index("--num-envs") + 1]
    assert len(settings) == 1 and f"--num-envs {num_envs}" in settings[0], block


def test_start_up_block_names_the_learner_and_the_engine(script, runs):
    block = start_up_block(runs.first(script)["result"].stdout)
    learner = [line for line in block if line.startswith("learner: ")]
    engine = [line for line in block if line.startswith("engine: ")]
    assert len(learner) == 1 and "lesson" in learner[0], block
    assert len(engine) == 1 and "Game" in engine[0], block


def test_progress_never_passes_100_percent_and_the_last_line_comes_once(script, runs):
    first = runs.first(script)
    progress = [PROGRESS.match(line) for line in first["result"].stdout.splitlines()]
    progress = [match for match in progress if match]
    steps = [number(match[1]) for match in progress]
    assert steps == sorted(set(steps)), steps  # increasing: no line printed twice
    assert all(number(match[2]) == 2 * ROLLOUT[script] for match in progress)
    assert all(float(match[3]) <= 100.0 for match in progress)
    assert steps[-1] == first["summary"]["steps"] == 2 * ROLLOUT[script]
    assert float(progress[-1][3]) == 100.0


def test_the_last_line_says_the_run_finished_and_where_its_files_are(script, runs):
    first = runs.first(script)
    run_dir, steps = first["dir"], first["summary"]["steps"]
    last = first["result"].stdout.splitlines()[-1]
    # The time as h:mm:ss, hours unpadded (0:00:12).
    assert re.fullmatch(rf"finished at step {steps:,} after (0|[1-9]\d*):\d\d:\d\d; checkpoint "
                        rf"{re.escape(str(run_dir / CHECKPOINT))}, summary "
                        rf"{re.escape(str(run_dir / 'summary.json'))}", last), last


# ----- 8. resume and eval from a run folder -----------------------------------------------------


def test_resume_from_a_folder_counts_the_whole_run_in_the_summary(script, runs):
    first, resumed = runs.first(script)["summary"], runs.resumed(script)["summary"]
    assert first["resumed_at_step"] is None
    assert resumed["resumed_at_step"] == first["steps"]
    assert resumed["steps"] == RESUMED_TOTAL[script]
    assert resumed["episodes"] >= first["episodes"]
    # The whole run's seconds: those the checkpoint counted, and this process's first update
    # (warmup_seconds) and steady steps (at steps_per_second) on top.
    saved = torch.load(io.BytesIO(runs.first(script)["files"][CHECKPOINT]), weights_only=True)
    steady = resumed["steps"] - resumed["resumed_at_step"] - ROLLOUT[script]
    this_process = resumed["warmup_seconds"] + steady / resumed["steps_per_second"]
    assert resumed["seconds"] >= saved["log"]["seconds"] + 0.99 * this_process, (first, resumed)
    assert resumed["seconds"] > first["seconds"] / 2


def resume_line(script, runs):
    """The resumed run's line "resuming from PATH at step N (learning rate X, annealed to 0 by step
    M)" (PATH: the folder given or its checkpoint.pt): (N, X, M)."""
    resumed = runs.resumed(script)
    block = start_up_block(resumed["result"].stdout)
    given = "|".join(re.escape(str(path)) for path in (resumed["dir"], resumed["dir"] / CHECKPOINT))
    matches = [re.fullmatch(rf"resuming from (?:{given}) at step ([\d,]+) "
                            r"\(learning rate (\S+), annealed to 0 by step ([\d,]+)\)", line)
               for line in block]
    match = next((match for match in matches if match), None)
    assert match, block
    assert not any("rounded up" in line for line in block)  # a whole number of rollouts
    return number(match[1]), float(match[2]), number(match[3])


def first_schedule(script, runs):
    """The first run's learning rate at a step: its anchor (step, rate), annealed to 0 at its
    total."""
    checkpoint = torch.load(io.BytesIO(runs.first(script)["files"][CHECKPOINT]), weights_only=True)
    start_step, start_rate = checkpoint["anneal_from"]
    return lambda step: start_rate * max(0.0, 1.0 - (step - start_step) /
                                         (FIRST_TOTAL[script] - start_step))


def test_resume_says_where_it_goes_on_and_the_learning_rate_never_rises(script, runs):
    step, rate, until = resume_line(script, runs)
    first_step = runs.first(script)["summary"]["steps"]
    assert step == first_step and until == RESUMED_TOTAL[script]
    # Restarting the schedule towards the new total would jump to half the start, above the rate
    # of the first run's last update (a third of the start).
    last_rate = first_schedule(script, runs)(first_step - ROLLOUT[script])
    assert rate <= last_rate * (1 + 1e-5), (rate, last_rate)
    anchor = torch.load(runs.resumed(script)["dir"] / CHECKPOINT, weights_only=True)["anneal_from"]
    assert list(anchor) == [first_step, pytest.approx(rate, rel=1e-5)]


def test_resume_anneals_from_the_rate_of_the_last_update_before_the_checkpoint(script, runs):
    # The first run ended at its total; a larger total goes on from the rate its last update had
    # (not 0, where its schedule ended, and not the start rate, where a restarted schedule begins).
    checkpoint = torch.load(io.BytesIO(runs.first(script)["files"][CHECKPOINT]), weights_only=True)
    optimizer = checkpoint["optimizer"]
    last_rate = optimizer["lr"] if "lr" in optimizer else optimizer["param_groups"][0]["lr"]
    _, rate, _ = resume_line(script, runs)
    assert 0 < rate == pytest.approx(last_rate, rel=1e-5)


def test_eval_plays_a_run_folder(script, runs):
    evaluated = runs.evaluated(script)
    stdout = evaluated["result"].stdout
    assert re.search(r"over 1 episode\b", stdout), stdout
    video = re.search(r"^video: (.+)$", stdout, re.MULTILINE)
    assert video and (ROOT / video[1]).stat().st_size > 0, stdout


# ----- 9. no stray warnings ---------------------------------------------------------------------


def test_a_cpu_run_prints_no_stray_warning(script, runs):
    for result in (runs.first(script)["result"], runs.evaluated(script)["result"]):
        assert "No CUDA runtime is found" not in result.stderr, result.stderr[-2000:]
        assert "XDG_RUNTIME_DIR" not in result.stderr, result.stderr[-2000:]


# ----- 10. a refused env is sent to a script that plays it ---------------------------------------


@pytest.mark.parametrize("script", [script for script in SCRIPTS  # ppo_memory.py plays them too
                                    if script not in ("ppo_multiagent", "ppo_spaces", "ppo_memory")])
@pytest.mark.parametrize("env_id", ["FrozenLake-v1", "Blackjack-v1"])  # Discrete, Tuple observed
def test_other_observation_spaces_are_sent_to_ppo_spaces_which_plays_them(script, env_id):
    module = importlib.import_module(script)
    with pytest.raises(module.UsageError) as refused:
        module.inspect_env(env_id)
    assert "use ppo_spaces.py" in str(refused.value), str(refused.value)
    spaces = importlib.import_module("ppo_spaces")
    spaces.inspect_env(spaces.Config(env=env_id))  # no refusal: it plays them
