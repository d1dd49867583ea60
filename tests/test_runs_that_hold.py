"""Runs that hold (issue 41), through the command line where the user meets each case: a flag typed
on --resume wins whatever its value, output that cannot be written never stops a run or loses it,
and a flag's prefix is not taken for the flag."""
import dataclasses
import importlib
import json
import subprocess
import sys
import time

import pytest
import torch

from conftest import ROOT
from test_command_line import ENVIRON, ROLLOUT, RUN_FLAGS, SCRIPTS, SMALL, error_line, run_script


def small_run(script, run_dir, total, *args):
    return run_script(script, *SMALL[script], *RUN_FLAGS[script], "--total-timesteps", total,
                      "--run-dir", run_dir, *args, timeout=300)


def test_a_flag_typed_on_resume_wins_even_when_it_equals_the_default(tmp_path):
    # Through the command line once (typed_fields and the command line are the same everywhere)...
    script = "ppo_cartpole"
    first = small_run(script, tmp_path / "run", ROLLOUT[script], "--no-anneal-lr")
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = run_script(script, "--resume", tmp_path / "run", "--total-timesteps",
                         2 * ROLLOUT[script], "--anneal-lr", timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    config = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)["config"]
    assert config["anneal_lr"] is True  # typed, though it is the default: it wins
    assert config["total_timesteps"] == 2 * ROLLOUT[script]


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_script_resumes_with_the_flags_typed_and_the_checkpoint_s_others(script, tmp_path):
    # ...and each script's resumed_config: a typed flag wins whatever its value; in code (a Config
    # without the command line's `typed`), a value equal to the default keeps the checkpoint's.
    module = importlib.import_module(script)
    saved = dataclasses.asdict(module.Config(anneal_lr=False, seed=7))
    checkpoint = {"config": saved, "path": str(tmp_path / "checkpoint.pt")}
    argv = ["--anneal-lr"]
    typed = module.parse_config(argv)
    typed.typed = module.typed_fields(argv)
    assert module.resumed_config(checkpoint, typed).anneal_lr is True
    resumed = module.resumed_config(checkpoint, module.Config())
    assert resumed.anneal_lr is False and resumed.seed == 7


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_closed_stdout_neither_stops_nor_loses_the_run(script, tmp_path):
    # `python ppo_x.py | head -1`: the reader goes away after the first line.
    total = 4 * ROLLOUT[script]
    command = [sys.executable, f"{script}.py", *map(str, SMALL[script]), *RUN_FLAGS[script],
               "--total-timesteps", str(total), "--run-dir", str(tmp_path / "run")]
    process = subprocess.Popen(command, cwd=ROOT, env=ENVIRON, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    process.stdout.readline()
    process.stdout.close()
    stderr = process.stderr.read()
    assert process.wait(timeout=300) == 0, stderr[-3000:]
    assert "Traceback" not in stderr and "BrokenPipeError" not in stderr, stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == total and (tmp_path / "run" / "checkpoint.pt").exists()


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_prefix_of_a_flag_is_refused_and_the_flag_suggested(script):
    line = error_line(run_script(script, "--learning-rat", "0.1", timeout=120))
    assert "--learning-rat" in line and "did you mean --learning-rate?" in line, line


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_resume_names_the_learning_rate_it_goes_on_at(script, tmp_path):
    # A run stopped at a quarter of its total: forged from a finished one-rollout run by giving
    # its checkpoint four rollouts as the total, which is what a stop there saves.
    first = small_run(script, tmp_path / "run", ROLLOUT[script])
    assert first.returncode == 0, first.stderr[-3000:]
    path = tmp_path / "run" / "checkpoint.pt"
    checkpoint = torch.load(path, weights_only=True)
    checkpoint["config"]["total_timesteps"] = 4 * ROLLOUT[script]
    torch.save(checkpoint, path)
    resumed = run_script(script, "--resume", tmp_path / "run", timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    start_step, start_rate = checkpoint["anneal_from"]
    assert start_step == 0
    line = next(line for line in resumed.stdout.splitlines() if line.startswith("resuming from"))
    rate = start_rate * (1 - 1 / 4)  # the next update's, not the start's
    assert f"at step {ROLLOUT[script]:,} (learning rate {rate:.6g}, annealed to 0 by step " \
           f"{4 * ROLLOUT[script]:,})" in line, line


def test_a_new_learning_rate_on_resume_is_taken_without_annealing(tmp_path):
    script = "ppo_cartpole"
    first = small_run(script, tmp_path / "run", ROLLOUT[script], "--no-anneal-lr")
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = run_script(script, "--resume", tmp_path / "run", "--total-timesteps",
                         2 * ROLLOUT[script], "--learning-rate", 0.001, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "(learning rate 0.001)" in resumed.stdout
    checkpoint = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)
    assert checkpoint["optimizer"]["param_groups"][0]["lr"] == 0.001


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_setting_that_will_not_fit_in_memory_is_refused_before_anything_is_made(script, tmp_path):
    started = time.monotonic()
    result = run_script(script, *RUN_FLAGS[script], "--num-envs", 10 ** 6, "--num-steps", 10 ** 5,
                        "--run-dir", tmp_path / "run", timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    assert error_line(result).endswith("GiB free: lower --num-envs or --num-steps")
    assert time.monotonic() - started < 60  # refused at set-up, not after minutes of allocating
    assert not (tmp_path / "run").exists()
