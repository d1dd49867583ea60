"""ppo_cartpole.py as a user runs it: learning, the command line, checkpoints, evaluation, bad input."""
import json
import subprocess
import sys

import cv2
import pytest
import torch

import ppo_cartpole as pc
from conftest import ROOT


def run_script(*args, timeout=120):
    return subprocess.run([sys.executable, "ppo_cartpole.py", *map(str, args)], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


def test_solves_cartpole_with_the_defaults(tmp_path):
    summary = pc.Main(pc.Config(seed=1, target_return=475, run_dir=str(tmp_path))).run()
    assert summary["solved_step"] is not None and summary["mean_return_100"] >= 475
    assert summary["solved_step"] <= 150_000


def test_learns_a_multidiscrete_game(tmp_path):
    summary = pc.Main(pc.Config(env="TestGuessDims-v0", total_timesteps=20_000, run_dir=str(tmp_path))).run()
    assert summary["mean_return_100"] >= 1.9  # the optimum is 2, a random policy gets 7/12


def test_learns_a_multibinary_game(tmp_path):
    summary = pc.Main(pc.Config(env="TestCopyBits-v0", total_timesteps=20_000, run_dir=str(tmp_path))).run()
    assert summary["mean_return_100"] >= 0.95  # the optimum is 1, a random policy gets 0.5


def final_weights(run_dir):
    return torch.load(run_dir / "checkpoint.pt", weights_only=True)["model"]


def test_same_seed_same_weights_in_process_and_in_workers(tmp_path):
    runs = {}
    # CartPole's vectorised env draws the starts of a whole batch from one generator, so the runs are
    # equal when the envs are batched alike: here one batch, in this process or in one child process.
    for name, workers in (("a", 0), ("b", 0), ("c", 1)):
        config = pc.Config(seed=3, total_timesteps=4096, num_workers=workers, run_dir=str(tmp_path / name))
        pc.Main(config).run()
        runs[name] = final_weights(tmp_path / name)
    for key in runs["a"]:
        assert torch.equal(runs["a"][key], runs["b"][key]), key
        assert torch.equal(runs["a"][key], runs["c"][key]), key
    other = pc.Config(seed=4, total_timesteps=4096, run_dir=str(tmp_path / "d"))
    pc.Main(other).run()
    assert not torch.equal(final_weights(tmp_path / "d")["actor.0.weight"], runs["a"]["actor.0.weight"])


def test_command_line_run_resume_eval_and_video(tmp_path):
    run_dir = tmp_path / "run"
    result = run_script("--total-timesteps", 2048, "--num-workers", 2, "--run-dir", run_dir)
    assert result.returncode == 0, result.stderr
    assert "step 2,048/2,048 (100.0%)" in result.stdout and "steps/s" in result.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    expected_keys = {"script", "env", "seed", "steps", "seconds", "warmup_seconds", "steps_per_second", "episodes",
                     "mean_return_100", "target_return", "solved_step", "solved_seconds", "interrupted",
                     "checkpoint", "world_size", "resumed_at_step"}
    assert set(summary) == expected_keys
    assert summary["steps"] == 2048 and summary["interrupted"] is False and summary["world_size"] == 1
    assert list(run_dir.glob("events.out.tfevents.*"))
    checkpoint = torch.load(run_dir / "checkpoint.pt", weights_only=True)
    assert checkpoint["global_step"] == 2048 and checkpoint["updates"] == 1 and checkpoint["env"] == "CartPole-v1"

    result = run_script("--resume", run_dir / "checkpoint.pt", "--total-timesteps", 4096)
    assert result.returncode == 0, result.stderr
    resumed = torch.load(run_dir / "checkpoint.pt", weights_only=True)
    assert resumed["global_step"] == 4096 and resumed["updates"] == 2
    assert resumed["optimizer"]["state"][0]["step"] == 2 * 8 * 2  # updates x epochs x minibatches: Adam went on counting

    result = run_script("--eval", run_dir / "checkpoint.pt", "--eval-episodes", 3, "--video")
    assert result.returncode == 0, result.stderr
    assert "over 3 episodes" in result.stdout
    video = cv2.VideoCapture(str(run_dir / "eval.mp4"))
    ok, frame = video.read()
    assert ok and frame.shape == (400, 600, 3)
    frames = 1 + sum(1 for _ in iter(lambda: video.read()[0], False))
    assert frames >= 3 * 8  # three games of at least 8 steps each


@pytest.mark.parametrize("args,message", [
    (["--env", "CartPole-v9"], "unknown env 'CartPole-v9'; did you mean CartPole-v1"),
    (["--env", "Pendulum-v1"], "Box(-2.0, 2.0, (1,), float32) action space"),
    (["--env", "BreakoutNoFrameskip-v4"], "is an Atari game: use ppo_atari.py"),
    (["--num-envs", "0"], "--num-envs must be positive"),
    (["--num-workers", "3"], "--num-workers 3 must divide --num-envs 64"),
    (["--num-minibatches", "3"], "does not split into --num-minibatches 3"),
    (["--device", "tpu"], "unknown --device 'tpu'"),
    (["--resume", "no/such/checkpoint.pt"], "checkpoint no/such/checkpoint.pt not found"),
    (["--eval", "no/such/checkpoint.pt"], "checkpoint no/such/checkpoint.pt not found"),
])
def test_bad_input_exits_2_with_one_line(args, message, tmp_path):
    result = run_script(*args, "--run-dir", tmp_path / "run")
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1
