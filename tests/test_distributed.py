"""ppo_cartpole.py and ppo_atari.py under torchrun: data-parallel ranks on CPU (gloo), started as a user
starts them (`python -m torch.distributed.run --standalone --nproc_per_node N ppo_cartpole.py ...`). Each test
starts real processes and, where it applies, injects the fault for real (signals, a killed rank, diverging
weights). The logic the scripts share is tested on CartPole, which is fast; the Atari tests at the end check
the Atari script's own wiring."""
import json
import os
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch

import ppo_atari as pa
import ppo_cartpole as pc
from conftest import ROOT, children, wait_until_gone

# 2 ranks x 8 envs x 16 steps: a global batch of 256 steps per update.
SMALL = ["--num-envs", 8, "--num-steps", 16, "--num-minibatches", 2]
GLOBAL_BATCH = 2 * 8 * 16
# Atari, eagerly (compiling would cost each rank seconds): 2 ranks x 2 games x 32 steps = 128 steps per update.
ATARI = ["--no-compile", "--num-envs", 2, "--num-steps", 32, "--num-minibatches", 2]
ATARI_BATCH = 2 * 2 * 32


def torchrun(*args, nproc=2, script="ppo_cartpole.py"):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
            str(script), *map(str, args)]


def run(*args, nproc=2, script="ppo_cartpole.py", timeout=60, env=None):
    return subprocess.run(torchrun(*args, nproc=nproc, script=script), cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=env)


def summary_of(run_dir):
    return json.loads((run_dir / "summary.json").read_text())


def checkpoint_of(run_dir):
    return torch.load(run_dir / "checkpoint.pt", weights_only=True)


def no_traceback_of_ours(stderr, script="ppo_cartpole.py"):
    """torchrun prints a traceback of its own when a rank fails; the ranks must not."""
    return f'{script}", line' not in stderr


def ranks_of(torchrun_pid):
    """{rank: pid} of the processes torchrun started, from the RANK in their environment."""
    ranks = {}
    for pid in children(torchrun_pid):
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        ranks[next(int(entry[5:]) for entry in environ if entry.startswith(b"RANK="))] = pid
    return ranks


def everything_below(torchrun_pid):
    """The ranks and their children (the workers, and multiprocessing's resource tracker)."""
    ranks = list(ranks_of(torchrun_pid).values())
    return ranks + [child for rank in ranks for child in children(rank)]


@pytest.fixture
def start_long_run():
    """Starts a long 2-rank run, each rank with 2 worker processes, in its own process group (as a terminal
    starts it), and returns once rank 0 has written its first checkpoint. Whatever the test's outcome, the
    whole group is killed at the end, so that a failing test leaves no run behind."""
    started = []

    def start(run_dir, script="ppo_cartpole.py", settings=SMALL, global_batch=GLOBAL_BATCH):
        process = subprocess.Popen(
            torchrun(*settings, "--num-workers", 2, "--total-timesteps", 10 ** 8, "--checkpoint-every", global_batch,
                     "--run-dir", run_dir, script=script),
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        started.append(process)
        deadline = time.monotonic() + 60
        while not (run_dir / "checkpoint.pt").exists():
            assert process.poll() is None, process.communicate()
            assert time.monotonic() < deadline, "no checkpoint within 60 s"
            time.sleep(0.1)
        return process

    yield start
    for process in started:
        try:
            os.killpg(process.pid, signal.SIGKILL)  # the ranks and their workers share torchrun's group
        except ProcessLookupError:
            pass
        process.communicate()


def test_two_ranks_train_one_network_and_count_the_steps_of_both(tmp_path):
    result = run(*SMALL, "--total-timesteps", 8 * GLOBAL_BATCH, "--run-dir", tmp_path)
    assert result.returncode == 0, result.stderr  # 0: the end-of-run weight check passed too
    summary = summary_of(tmp_path)
    assert summary["world_size"] == 2 and summary["steps"] == 8 * GLOBAL_BATCH and not summary["interrupted"]
    checkpoint = checkpoint_of(tmp_path)
    assert checkpoint["global_step"] == 8 * GLOBAL_BATCH and checkpoint["updates"] == 8
    assert checkpoint["optimizer"]["state"][0]["step"] == 8 * 8 * 2  # updates x epochs x minibatches, as alone
    assert result.stdout.count("finished at step") == 1  # rank 0 alone prints and logs
    assert len(list(tmp_path.glob("events.out.tfevents.*"))) == 1


def test_ranks_whose_weights_differ_fail_the_run(tmp_path):
    # A driver that nudges rank 1's weights after each update, as a bug in the averaging would.
    driver = tmp_path / "diverge.py"
    driver.write_text(f"""
import sys
sys.path.insert(0, {str(ROOT)!r})
import torch
import ppo_cartpole as pc

learn = pc.Main.learn

def learn_then_nudge_rank_1(self, advantages, returns):
    stats = learn(self, advantages, returns)
    if self.guard.ranks.rank == 1:
        with torch.no_grad():
            self.model.critic[0].bias += 1e-6
    return stats

pc.Main.learn = learn_then_nudge_rank_1
try:
    pc.Main(pc.parse_config()).run()
except pc.RankError as error:
    print(f"error: {{error}}", file=sys.stderr)
    sys.exit(1)
""")
    result = run(*SMALL, "--total-timesteps", 2 * GLOBAL_BATCH, "--run-dir", tmp_path / "run", script=driver)
    assert result.returncode == 1
    assert result.stderr.count("error: the weights of rank 1 differ from rank 0's at the end of the run") == 2


def test_one_rank_under_torchrun_equals_a_run_alone(tmp_path):
    result = run("--seed", 3, "--total-timesteps", 8192, "--run-dir", tmp_path / "torchrun", nproc=1)
    assert result.returncode == 0, result.stderr
    alone = pc.Main(pc.Config(seed=3, total_timesteps=8192, run_dir=str(tmp_path / "alone"))).run()
    summary = summary_of(tmp_path / "torchrun")
    for key in ("steps", "episodes", "mean_return_100", "world_size"):
        assert summary[key] == alone[key], key
    ours, theirs = checkpoint_of(tmp_path / "torchrun"), checkpoint_of(tmp_path / "alone")
    for key in ours["model"]:
        assert torch.equal(ours["model"][key], theirs["model"][key]), key
    for mine, other in zip(ours["optimizer"]["state"].values(), theirs["optimizer"]["state"].values()):
        assert torch.equal(mine["exp_avg_sq"], other["exp_avg_sq"])


def test_target_kl_stops_the_epochs_of_all_ranks_together(tmp_path):
    # At 0.01 the two ranks' own KLs fall on either side of the target in most updates (measured: from the
    # first one): ranks that decided alone would part ways in their collectives and hang or fail.
    result = run(*SMALL, "--target-kl", 0.01, "--total-timesteps", 10 * GLOBAL_BATCH, "--run-dir", tmp_path,
                 timeout=60)
    assert result.returncode == 0, result.stderr
    checkpoint = checkpoint_of(tmp_path)
    assert checkpoint["global_step"] == 10 * GLOBAL_BATCH
    assert checkpoint["optimizer"]["state"][0]["step"] < 10 * 8 * 2  # some updates did stop early


def test_ctrl_c_stops_every_rank_with_a_checkpoint_and_leaves_no_process(tmp_path, start_long_run):
    process = start_long_run(tmp_path)
    assert sorted(ranks_of(process.pid)) == [0, 1]
    processes = everything_below(process.pid)
    assert len(processes) >= 2 + 2 * 2  # two ranks, each with two workers
    os.killpg(process.pid, signal.SIGINT)  # a terminal's Ctrl-C; torchrun passes it on to the ranks
    _, stderr = process.communicate(timeout=30)
    assert wait_until_gone(processes)
    assert no_traceback_of_ours(stderr)
    summary = summary_of(tmp_path)
    assert summary["interrupted"] is True and summary["world_size"] == 2
    assert summary["steps"] == checkpoint_of(tmp_path)["global_step"] > 0


def test_a_signal_to_one_rank_stops_all_ranks_together(tmp_path, start_long_run):
    # SIGTERM to rank 1 alone (as a scheduler might send it on one machine): rank 0 learns of it at the next
    # meeting of the ranks, and both stop after the same rollout. Had rank 1 stopped alone, rank 0 would wait.
    process = start_long_run(tmp_path)
    processes = everything_below(process.pid)
    os.kill(ranks_of(process.pid)[1], signal.SIGTERM)
    _, stderr = process.communicate(timeout=30)
    assert wait_until_gone(processes)
    assert no_traceback_of_ours(stderr) and "lost contact" not in stderr
    summary = summary_of(tmp_path)
    assert summary["interrupted"] is True
    assert summary["steps"] == checkpoint_of(tmp_path)["global_step"] > 0


def test_a_killed_rank_stops_the_other_within_seconds(tmp_path, start_long_run):
    process = start_long_run(tmp_path)
    processes = everything_below(process.pid)
    killed = time.monotonic()
    os.kill(ranks_of(process.pid)[1], signal.SIGKILL)
    _, stderr = process.communicate(timeout=30)
    assert time.monotonic() - killed < 10
    assert wait_until_gone(processes)
    assert "error: rank 0 lost contact with the other ranks" in stderr
    assert no_traceback_of_ours(stderr)
    assert checkpoint_of(tmp_path)["global_step"] > 0  # rank 0 kept the checkpoint of its last finished update


def test_resume_under_torchrun_continues_from_the_checkpoint(tmp_path):
    first = run(*SMALL, "--total-timesteps", 2 * GLOBAL_BATCH, "--run-dir", tmp_path)
    assert first.returncode == 0, first.stderr
    new_total = 5 * GLOBAL_BATCH
    result = run("--resume", tmp_path / "checkpoint.pt", "--total-timesteps", new_total)
    assert result.returncode == 0, result.stderr
    assert f"step {new_total:,}/{new_total:,}" in result.stdout
    resumed = checkpoint_of(tmp_path)
    assert resumed["global_step"] == new_total and resumed["updates"] == 5
    assert resumed["optimizer"]["state"][0]["step"] == 5 * 8 * 2  # Adam went on counting
    # The total changed: the rate anneals from the one of the first run's last update (lr / 2, at
    # step GLOBAL_BATCH of 2) to 0 over the steps left; the last update started at new_total - GLOBAL_BATCH.
    assert resumed["optimizer"]["param_groups"][0]["lr"] == pytest.approx(pc.PRESETS["CartPole-v1"]["learning_rate"] / 2 * (1 - 2 / 3))
    assert summary_of(tmp_path)["steps"] == new_total


# ----- ppo_atari.py: its own wiring (two env backends, the compiled model, the rollout buffer) -------------


def test_two_atari_ranks_train_one_network_and_count_the_steps_of_both(tmp_path):
    result = run(*ATARI, "--total-timesteps", 3 * ATARI_BATCH, "--run-dir", tmp_path, script="ppo_atari.py")
    assert result.returncode == 0, result.stderr  # 0: the end-of-run weight check passed too
    summary = summary_of(tmp_path)
    assert summary["world_size"] == 2 and summary["steps"] == 3 * ATARI_BATCH and not summary["interrupted"]
    checkpoint = checkpoint_of(tmp_path)
    assert checkpoint["global_step"] == 3 * ATARI_BATCH and checkpoint["updates"] == 3
    # updates x epochs x minibatches gradient steps, as alone (Adam counts them per parameter)
    assert all(state["step"].item() == 3 * 4 * 2 for state in checkpoint["optimizer"]["state"].values())
    assert result.stdout.count("finished at step") == 1  # rank 0 alone prints and logs
    assert len(list(tmp_path.glob("events.out.tfevents.*"))) == 1


@pytest.mark.parametrize("backend", ["ale-vector", "game"])
def test_the_atari_games_of_rank_r_are_seeded_after_those_of_the_ranks_before(backend, monkeypatch):
    # Both backends get seed + r * num_envs + i for game i of rank r: rank 2 of 3, 4 games in 2 workers.
    seeds = []

    class Recorder:
        def __init__(self, index, env_id, seed, obs_view, inherited_trainer_ends):
            seeds.extend(seed + i for i in range(len(obs_view)))
            self.trainer_end = None

        def close(self):
            pass

    monkeypatch.setattr(pa, "VectorGames", lambda env_id, game_seeds, device: seeds.extend(game_seeds))
    monkeypatch.setattr(pa, "GuardedWorker", Recorder)
    guard = pa.RunGuard(pa.Main(pa.Config(seed=5, num_envs=4, num_workers=2, env_backend=backend)))
    guard.device, guard.ranks = torch.device("cpu"), types.SimpleNamespace(rank=2, world_size=3, distributed=True)
    games = guard.start_games()
    if backend == "game":
        games.close()
    assert seeds == [5 + 2 * 4 + i for i in range(4)]


def test_one_atari_rank_under_torchrun_equals_a_run_alone(tmp_path):
    settings = [*ATARI, "--seed", 3, "--total-timesteps", 2 * 2 * 32]
    # One torch thread in both (torchrun sets none for one process): the same arithmetic, and on a small, busy
    # machine much faster than two threads that wait for each other.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = run(*settings, "--run-dir", tmp_path / "torchrun", nproc=1, script="ppo_atari.py", env=env)
    assert result.returncode == 0, result.stderr
    alone = subprocess.run([sys.executable, "ppo_atari.py", *map(str, settings), "--run-dir", tmp_path / "alone"],
                           cwd=ROOT, capture_output=True, text=True, timeout=60, env=env)
    assert alone.returncode == 0, alone.stderr
    ours, theirs = summary_of(tmp_path / "torchrun"), summary_of(tmp_path / "alone")
    for key in ("steps", "episodes", "mean_return_100", "world_size"):
        assert ours[key] == theirs[key], key
    ours, theirs = checkpoint_of(tmp_path / "torchrun"), checkpoint_of(tmp_path / "alone")
    for key in ours["model"]:
        assert torch.equal(ours["model"][key], theirs["model"][key]), key
    for mine, other in zip(ours["optimizer"]["state"].values(), theirs["optimizer"]["state"].values()):
        assert torch.equal(mine["exp_avg_sq"], other["exp_avg_sq"])


def test_ctrl_c_stops_every_atari_rank_with_a_checkpoint_and_leaves_no_process(tmp_path, start_long_run):
    # The Game backend, so that each rank has worker processes that must not be left behind.
    process = start_long_run(tmp_path, script="ppo_atari.py", settings=[*ATARI, "--env-backend", "game"],
                             global_batch=ATARI_BATCH)
    processes = everything_below(process.pid)
    assert len(processes) >= 2 + 2 * 2  # two ranks, each with two workers
    os.killpg(process.pid, signal.SIGINT)  # a terminal's Ctrl-C; torchrun passes it on to the ranks
    _, stderr = process.communicate(timeout=30)
    assert wait_until_gone(processes)
    assert no_traceback_of_ours(stderr, "ppo_atari.py")
    summary = summary_of(tmp_path)
    assert summary["interrupted"] is True and summary["world_size"] == 2
    assert summary["steps"] == checkpoint_of(tmp_path)["global_step"] > 0
