"""On a CUDA device (skipped where there is none, as on CI): every script trains there through its
command line, names the device at start-up, writes its summary, and leaves a checkpoint that plays
on the CPU (`--eval`); ppo_atari.py as by default, compiled; ppo_continuous.py with its torch engine
stepping 4,096 games on the GPU. benchmarks/gpu_check.sh runs this file on the device machine."""
import json

import pytest
import torch

from test_command_line import ROLLOUT, SCRIPTS, SMALL, run_script

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
DEVICE = "cuda"


def trains_and_plays(script, run, *flags, rollout):
    """Two rollouts on the device, then one episode of the checkpoint's policy on the CPU."""
    result = run_script(script, *flags, "--total-timesteps", 2 * rollout, "--device", DEVICE,
                        "--run-dir", run, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    start = [line for line in result.stdout.splitlines() if line.startswith(f"{script}.py: ")]
    assert start and f" on {DEVICE}, " in start[0], result.stdout[:500]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] >= 2 * rollout and not summary["interrupted"]
    played = run_script(script, "--eval", run, "--eval-episodes", 1, "--device", "cpu", timeout=900)
    assert played.returncode == 0, played.stderr[-3000:]


@pytest.mark.parametrize("script", SCRIPTS)
def test_trains_on_the_gpu_and_its_checkpoint_plays_on_the_cpu(script, tmp_path):
    trains_and_plays(script, tmp_path / "run", *SMALL[script], rollout=ROLLOUT[script])


def test_the_torch_pendulum_steps_4096_games_on_the_gpu(tmp_path):
    flags = ["--env-backend", "torch", "--num-envs", 4096, "--num-steps", 16]
    trains_and_plays("ppo_continuous", tmp_path / "run", *flags, rollout=4096 * 16)
