"""Runs that stop: bad input, dying workers, Ctrl-C, a dying trainer, a full disk, NaN, corrupt
checkpoints. Each test injects the fault for real (signals, killed processes, broken files), in both
scripts wherever it applies."""
import errno
import gc
import importlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import ppo_atari as pa
import ppo_cartpole as pc
from conftest import ROOT, children, wait_until_gone

# Small runs of each script: 2 workers, a batch of 128 (cartpole) or 64 (atari) steps. Atari runs its
# Games in worker processes here (--env-backend game): their faults are what these tests inject.
SMALL = {
    "ppo_cartpole": ["--num-envs", 8, "--num-steps", 16, "--num-workers", 2, "--num-minibatches", 2],
    "ppo_atari": ["--num-envs", 2, "--num-steps", 32, "--num-workers", 2, "--num-minibatches", 2,
                  "--env-backend", "game"],
}
BATCH = {"ppo_cartpole": 8 * 16, "ppo_atari": 2 * 32}
MODULES = {"ppo_cartpole": pc, "ppo_atari": pa}


def run_script(script, *args, timeout=240):
    """Run a script eagerly (--no-compile: compiling would cost each test seconds)."""
    return subprocess.run([sys.executable, f"{script}.py", "--no-compile", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def start_script(script, run_dir, *args):
    """Start a long run in its own process group (as a terminal would) and wait for its first checkpoint."""
    command = [f"{script}.py", "--no-compile", *SMALL[script], "--total-timesteps", 10 ** 8,
               "--checkpoint-every", BATCH[script],
               "--run-dir", run_dir, *args]
    process = subprocess.Popen(
        [sys.executable, *map(str, command)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 120
    while not (run_dir / "checkpoint.pt").exists():
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, "no checkpoint within 120 s"
        time.sleep(0.1)
    return process


def learning_rate_of(checkpoint):
    """The learning rate of the last update before a checkpoint (hand-written Adam, or torch.optim's)."""
    optimizer = checkpoint["optimizer"]
    return optimizer["lr"] if "lr" in optimizer else optimizer["param_groups"][0]["lr"]


def workers_of(pid):
    """The worker processes of a trainer: its children, less multiprocessing's resource tracker (a helper
    that shared memory starts, which exits by itself with the trainer)."""
    return [child for child in children(pid)
            if b"resource_tracker" not in Path(f"/proc/{child}/cmdline").read_bytes()]


def shared_memory_of(pids):
    """The names in /dev/shm that these live processes map (one already unlinked reads "NAME
    (deleted)"): only the run's own, so that tests running beside it cannot blur the check."""
    return {line.split(maxsplit=5)[5].removesuffix(" (deleted)") for pid in pids
            for line in Path(f"/proc/{pid}/maps").read_text().splitlines() if "/dev/shm/" in line}


# ----- bad input -------------------------------------------------------------------------------------


@pytest.mark.parametrize("script", ["ppo_cartpole", "ppo_atari"])
@pytest.mark.parametrize("args,message", [
    (["--num-steps", 0], "--num-steps must be positive"),
    (["--total-timesteps", -5], "--total-timesteps must be positive"),
    (["--num-workers", -1], "--num-workers must be 0"),
    (["--device", "cuda"], "no CUDA device"),
    (["--num-minibatches", 3], "does not split into --num-minibatches 3"),
])
def test_bad_settings_exit_2_with_one_line(script, args, message, tmp_path):
    result = run_script(script, *args, "--run-dir", tmp_path / "run")
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("script", ["ppo_cartpole", "ppo_atari"])
def test_a_run_dir_under_a_file_is_refused(script, tmp_path):
    (tmp_path / "file").write_text("")
    result = run_script(script, "--run-dir", tmp_path / "file" / "run")
    assert result.returncode == 2 and "cannot write to --run-dir" in result.stderr
    assert "Traceback" not in result.stderr


def make_checkpoint(script, run_dir):
    module = MODULES[script]
    small = {"ppo_cartpole": dict(num_envs=8, num_steps=16), "ppo_atari": dict(num_envs=2, num_steps=32)}[script]
    module.Main(module.Config(total_timesteps=BATCH[script], num_workers=0, compile=False, run_dir=str(run_dir),
                              **small)).run()
    return run_dir / "checkpoint.pt"


@pytest.mark.parametrize("script", ["ppo_cartpole", "ppo_atari"])
def test_truncated_and_foreign_checkpoints_are_refused(script, tmp_path):
    checkpoint = make_checkpoint(script, tmp_path / "run")
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(checkpoint.read_bytes()[: checkpoint.stat().st_size // 2])
    other = "ppo_atari" if script == "ppo_cartpole" else "ppo_cartpole"
    for flag in ("--resume", "--eval"):
        result = run_script(script, flag, truncated, "--run-dir", tmp_path / "new")
        assert result.returncode == 2 and "not a readable checkpoint" in result.stderr, result.stderr
        result = run_script(other, flag, checkpoint, "--run-dir", tmp_path / "new")
        assert result.returncode == 2 and f"was written by {script}.py, not {other}.py" in result.stderr
        assert "Traceback" not in result.stderr
    # Weights that do not fit the network (as another version of the script might write them).
    state = torch.load(checkpoint, weights_only=True)
    state["model"].pop(next(iter(state["model"])))
    torch.save(state, tmp_path / "misfit.pt")
    for flag in ("--resume", "--eval"):
        result = run_script(script, flag, tmp_path / "misfit.pt", "--run-dir", tmp_path / flag)
        assert result.returncode == 2 and "network does not fit" in result.stderr, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("script,other_env", [("ppo_cartpole", "Acrobot-v1"), ("ppo_atari", "ALE/Pong-v5")])
def test_resuming_with_another_env_is_refused(script, other_env, tmp_path):
    checkpoint = make_checkpoint(script, tmp_path / "run")
    result = run_script(script, "--resume", checkpoint, "--env", other_env)
    assert result.returncode == 2
    default_env = MODULES[script].Config().env
    assert f"trained with --env {default_env}, not {other_env}" in result.stderr


# ----- dying workers, Ctrl-C, a dying trainer ------------------------------------------------------


@pytest.mark.parametrize("script", ["ppo_cartpole", "ppo_atari"])
def test_a_killed_worker_stops_the_run_within_seconds(script, tmp_path):
    process = start_script(script, tmp_path / "run")
    every_child = children(process.pid)
    workers = workers_of(process.pid)
    assert len(workers) == 2
    os.kill(workers[1], signal.SIGKILL)
    _, stderr = process.communicate(timeout=20)
    assert process.returncode == 1
    assert "worker 1" in stderr and "died (killed by signal SIGKILL)" in stderr
    assert wait_until_gone(every_child)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["interrupted"] is False and summary["steps"] > 0
    checkpoint = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)
    assert checkpoint["script"] == script and checkpoint["global_step"] > 0


def test_a_game_that_raises_in_a_worker_names_the_worker_the_env_and_the_error(tmp_path):
    config = pc.Config(env="TestExplode-v0", num_envs=4, num_workers=2, num_steps=8, num_minibatches=2,
                       run_dir=str(tmp_path))
    with pytest.raises(pc.WorkerError, match=r"worker 0 \(TestExplode-v0\) failed: RuntimeError: boom at step 5"):
        pc.Main(config).run()
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == 4 * 4


def test_an_atari_game_that_raises_in_a_worker_names_the_worker_the_env_and_the_error(tmp_path, monkeypatch):
    step = pa.Game.step

    def step_then_fail(self, action):
        if self.episode_length == 20:
            raise ValueError("emulator fault")
        return step(self, action)

    monkeypatch.setattr(pa.Game, "step", step_then_fail)  # forked workers inherit the patch
    config = pa.Config(num_envs=2, num_workers=2, num_steps=32, num_minibatches=2, compile=False,
                       env_backend="game", run_dir=str(tmp_path))
    with pytest.raises(pa.WorkerError,
                       match=r"worker \d \(BreakoutNoFrameskip-v4\) failed: ValueError: emulator fault"):
        pa.Main(config).run()
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == 20 * 2


class TrainersGarbage:
    """An object in a reference cycle that the trainer has not collected yet; its finalizer writes
    the id of the process that ran it."""

    def __init__(self, path):
        self.path, self.cycle = path, self

    def __del__(self):
        with open(self.path, "a") as file:
            file.write(f"{os.getpid()}\n")


WORKER_RUNS = {  # one rollout of each script, its games in 2 worker processes
    "ppo_cartpole": dict(num_envs=4, num_steps=8, num_workers=2, total_timesteps=32),
    "ppo_atari": dict(num_envs=2, num_steps=8, num_workers=2, num_minibatches=2, total_timesteps=16,
                      env_backend="game", compile=False),
    "ppo_continuous": dict(num_envs=4, num_steps=8, num_workers=2, total_timesteps=32),
    "ppo_memory": dict(memory="lstm", num_envs=4, num_steps=8, num_workers=2, total_timesteps=32),
    "ppo_multiagent": dict(num_envs=2, num_steps=25, num_workers=2, total_timesteps=50),
    "ppo_spaces": dict(num_envs=4, num_steps=8, num_workers=2, num_minibatches=2, total_timesteps=32),
}


@pytest.mark.parametrize("script", sorted(WORKER_RUNS))
def test_workers_never_finalize_the_trainers_objects(script, tmp_path, monkeypatch):
    """A forked worker holds a copy of all the trainer's objects, its uncollected garbage too; were
    its collector to free them, their finalizers would close, unmap or join (C++ threads that do not
    exist in the child) what belongs to the trainer. A full collection in each worker, forced at
    its start, must leave the trainer's garbage to the trainer."""
    module = importlib.import_module(script)
    child_loop = module.Worker.child_loop

    def collect_first(self, *args):
        gc.collect()
        return child_loop(self, *args)

    monkeypatch.setattr(module.Worker, "child_loop", collect_first)  # forked workers inherit it
    finalized = tmp_path / "finalized_in"
    gc.disable()  # the garbage is still there when the workers fork
    try:
        TrainersGarbage(finalized)
        module.Main(module.Config(**WORKER_RUNS[script], run_dir=str(tmp_path / "run"))).run()
        assert not finalized.exists()
    finally:
        gc.enable()
    gc.collect()
    assert finalized.read_text() == f"{os.getpid()}\n"  # the trainer's own collection frees it


@pytest.mark.parametrize("script", ["ppo_cartpole", "ppo_atari"])
def test_ctrl_c_saves_and_resume_continues_the_schedule(script, tmp_path):
    process = start_script(script, tmp_path / "run")
    workers = children(process.pid)
    segments = shared_memory_of([process.pid, *workers])
    os.killpg(process.pid, signal.SIGINT)  # a terminal's Ctrl-C reaches the whole group
    process.communicate(timeout=30)
    assert process.returncode == 128 + signal.SIGINT
    assert wait_until_gone(workers)
    assert segments and not any(os.path.exists(name) for name in segments), segments
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["interrupted"] is True
    stopped = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)
    stopped_at, rate_before = stopped["global_step"], learning_rate_of(stopped)
    assert summary["steps"] == stopped_at > 0

    new_total = stopped_at + 2 * BATCH[script]
    result = run_script(script, "--resume", tmp_path / "run" / "checkpoint.pt", "--total-timesteps", new_total)
    assert result.returncode == 0, result.stderr
    resumed = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)
    assert resumed["global_step"] == new_total
    # The total changed: the rate anneals from the one of the last update before the checkpoint to 0
    # over the steps left (it never jumps up), and the last update started at new_total - BATCH.
    expected_lr = rate_before * (1 - (new_total - BATCH[script] - stopped_at) / (new_total - stopped_at))
    assert learning_rate_of(resumed) == pytest.approx(expected_lr)


def test_a_second_ctrl_c_stops_at_once_and_keeps_the_last_checkpoint(tmp_path):
    # 3,000 epochs: each update takes seconds, which the first Ctrl-C would wait for.
    process = start_script("ppo_cartpole", tmp_path / "run", "--update-epochs", 3000)
    workers = children(process.pid)
    segments = shared_memory_of([process.pid, *workers])
    time.sleep(1)  # past the second rollout (milliseconds), into its update (9 s idle)
    os.killpg(process.pid, signal.SIGINT)
    time.sleep(0.5)
    os.killpg(process.pid, signal.SIGINT)
    stopped = time.monotonic()
    _, stderr = process.communicate(timeout=30)
    assert time.monotonic() - stopped < 5, stderr
    assert process.returncode == 128 + signal.SIGINT
    assert "stopping after this update; a second Ctrl-C stops at once" in stderr
    assert stderr.strip().splitlines()[-1] == \
        "error: stopped at once; the checkpoint of the last finished update is kept"
    assert wait_until_gone(workers)
    assert segments and not any(os.path.exists(name) for name in segments), segments
    # the checkpoint of the first update, whole: the second was cut short
    assert torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)["global_step"] == \
        BATCH["ppo_cartpole"]


def test_ctrl_c_with_the_ale_vector_backend_saves_and_leaves_no_thread_running(tmp_path):
    process = start_script("ppo_atari", tmp_path / "run", "--env-backend", "ale-vector")
    os.killpg(process.pid, signal.SIGINT)
    process.communicate(timeout=30)  # the vector env's threads live in the trainer: it must exit, not hang
    assert process.returncode == 128 + signal.SIGINT
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["interrupted"] is True
    assert summary["steps"] == torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)["global_step"] > 0


def test_sigterm_to_the_trainer_alone_saves_too(tmp_path):
    process = start_script("ppo_cartpole", tmp_path / "run")
    workers = children(process.pid)
    process.send_signal(signal.SIGTERM)
    process.communicate(timeout=30)
    assert process.returncode == 128 + signal.SIGTERM
    assert wait_until_gone(workers)
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["interrupted"] is True


@pytest.mark.parametrize("script", ["ppo_cartpole", "ppo_atari"])
def test_a_killed_trainer_leaves_no_worker_behind(script, tmp_path):
    process = start_script(script, tmp_path / "run")
    workers = children(process.pid)
    assert workers
    process.kill()
    process.communicate(timeout=10)
    assert wait_until_gone(workers, seconds=10)


# ----- NaN, a full disk ----------------------------------------------------------------------------


@pytest.mark.parametrize("script", ["ppo_cartpole", "ppo_atari"])
def test_a_non_finite_loss_stops_with_the_last_good_weights(script, tmp_path, monkeypatch):
    module = MODULES[script]
    original = module.Model.evaluate_actions
    calls = {"n": 0}

    def evaluate_then_poison(self, obs, actions):
        calls["n"] += 1
        log_prob, entropy, value = original(self, obs, actions)
        if calls["n"] > 2 * 4 * 2:  # from the 3rd update on (epochs x minibatches per update)
            value = value * float("nan")
        return log_prob, entropy, value

    monkeypatch.setattr(module.Model, "evaluate_actions", evaluate_then_poison)
    small = {"ppo_cartpole": dict(num_envs=8, num_steps=16, update_epochs=4),
             "ppo_atari": dict(num_envs=2, num_steps=32)}[script]
    config = module.Config(total_timesteps=10 * BATCH[script], num_workers=0, num_minibatches=2, compile=False,
                           checkpoint_every=10 ** 9, run_dir=str(tmp_path), **small)
    with pytest.raises(module.NonFiniteLoss, match="non-finite loss or gradient in update 3"):
        module.Main(config).run()
    checkpoint = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    assert checkpoint["updates"] == 2
    assert all(torch.isfinite(tensor).all() for tensor in checkpoint["model"].values())


@pytest.mark.parametrize("script", ["ppo_cartpole", "ppo_atari"])
def test_a_failed_checkpoint_write_keeps_the_previous_one(script, tmp_path, monkeypatch, capsys):
    module = MODULES[script]
    real_save = torch.save
    saves = {"n": 0}

    def save_then_fill_the_disk(obj, path, *args, **kwargs):
        saves["n"] += 1
        if saves["n"] > 1:
            with open(path, "wb") as half_written:
                half_written.write(b"half")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(module.torch, "save", save_then_fill_the_disk)
    small = {"ppo_cartpole": dict(num_envs=8, num_steps=16), "ppo_atari": dict(num_envs=2, num_steps=32)}[script]
    config = module.Config(total_timesteps=3 * BATCH[script], num_workers=0, num_minibatches=2, compile=False,
                           checkpoint_every=BATCH[script], run_dir=str(tmp_path), **small)
    summary = module.Main(config).run()
    assert "No space left on device" in capsys.readouterr().err
    checkpoint = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    assert checkpoint["global_step"] == BATCH[script]  # the first save, kept whole
    assert not list(tmp_path.glob("*.tmp"))
    assert summary["steps"] == 3 * BATCH[script]
