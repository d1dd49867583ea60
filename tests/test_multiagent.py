"""ppo_multiagent.py: the (env, agent) batch layout, absent agents kept out of the losses, agent ids
and the global-state value input, on a small env of tests/multiagent_envs.py whose agents finish at
different times; then runs through the API and the command line: checkpoint, --resume, --eval and
--video, torchrun, bad input, Ctrl-C, reproducibility, and learning on MPE2 envs."""
import json
import os
import signal
import subprocess
import sys
import time

import cv2
import numpy as np
import pytest
import torch

import multiagent_envs
import ppo_multiagent as pm
from conftest import ROOT, children, wait_until_gone

DYING = "multiagent_envs.dying_v0"
SPREAD = "mpe2.simple_spread_v3"
# simple_spread, small: 4 envs x 3 agents x 25 steps = 300 agent steps per update.
SMALL = dict(num_envs=4, num_steps=25, num_workers=0, update_epochs=2, device="cpu")
BATCH = 4 * 3 * 25
# With tests/ on the path, a script run can name the envs of tests/multiagent_envs.py.
ENVIRON = {**os.environ, "PYTHONPATH": str(ROOT / "tests"), "OMP_NUM_THREADS": "1"}


def run_script(*args, timeout=300):
    return subprocess.run([sys.executable, "ppo_multiagent.py", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout, env=ENVIRON)


def checkpoint_of(run_dir):
    return torch.load(run_dir / "checkpoint.pt", weights_only=True)


def dying_run(tmp_path, **options):
    """One rollout of 8 steps in the dying env; the Main, to look into its rollout buffer."""
    settings = dict(env=DYING, num_envs=4, num_steps=8, num_workers=2, seed=10, update_epochs=1,
                    total_timesteps=4 * 3 * 8, device="cpu", run_dir=str(tmp_path), **options)
    main = pm.Main(pm.Config(**settings))
    main.run()
    return main


# ----- the batch layout, absent agents, ids and the global state --------------------------------


def test_every_agent_of_every_env_is_a_row_and_the_layout_round_trips(tmp_path):
    main = dying_run(tmp_path)
    rollout, agents = main.rollout, 3
    for step in range(8):
        t = step % 6  # the episodes last 6 steps
        for env in range(4):
            for slot in range(agents):
                row = env * agents + slot
                present = t < multiagent_envs.DyingEnv.LIFETIMES[slot]
                assert rollout.mask[step, row] == float(present), (step, env, slot)
                expected = [slot, t, 10 + env] if present else [0, 0, 0]
                assert rollout.obs[step, row, :3].tolist() == expected, (step, env, slot)
    # A minibatch's flat index step * rows + env * agents + slot finds the same row again.
    indices = torch.arange(8 * 12)
    minibatch = rollout.minibatch(indices, torch.zeros(8, 12), torch.zeros(8, 12))
    assert torch.equal(minibatch.obs.view(8, 12, -1), rollout.obs)
    assert torch.equal(minibatch.mask.view(8, 12), rollout.mask)


def test_agents_that_end_early_are_done_at_their_end_and_absent_after(tmp_path):
    main = dying_run(tmp_path)
    rollout = main.rollout
    for slot, lifetime in enumerate(multiagent_envs.DyingEnv.LIFETIMES):
        row = slot  # env 0
        for step in range(8):
            t = step % 6
            alive = t < lifetime
            # done at its last step (terminated, or for the last agent truncated), and on every
            # absent step, so that GAE never reaches across an absence
            assert rollout.dones[step, row] == float(t == lifetime - 1 or not alive), (slot, step)
            assert rollout.rewards[step, row] == 0 or alive
    # The last agent was truncated at t = 6: its reward holds gamma * V(final row) on top of 3.
    assert rollout.rewards[5, 2] != 3.0 and rollout.rewards[4, 2] == 3.0
    # Returns: per agent 28 / 3 (the mean over the agents), per team 28 (their sum).
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["episodes"] == 4 and summary["num_agents"] == 3
    assert summary["mean_return_100"] == pytest.approx(28 / 3)
    assert summary["mean_team_return_100"] == pytest.approx(28)
    assert summary["steps"] == 4 * 3 * 8 and summary["env_steps"] == 4 * 8


def test_an_absent_agents_rows_never_reach_the_loss(tmp_path):
    main = dying_run(tmp_path)
    rollout = main.rollout
    advantages = torch.randn(8, 12)
    minibatch = rollout.minibatch(torch.arange(8 * 12), advantages, advantages + rollout.values)
    absent = minibatch.mask == 0
    assert absent.sum() == 4 * (4 + 2)  # in 8 steps (t = 0-5, 0, 1) of 4 envs: dead agents' steps
    poisoned = minibatch._replace(
        obs=torch.where(absent[:, None], 1e4 * torch.randn_like(minibatch.obs), minibatch.obs),
        actions=torch.where(absent, 1 - minibatch.actions, minibatch.actions),
        old_log_probs=torch.where(absent, -1e3, minibatch.old_log_probs),
        advantages=torch.where(absent, 1e6, minibatch.advantages),
        returns=torch.where(absent, -1e6, minibatch.returns),
        old_values=torch.where(absent, 1e5, minibatch.old_values))

    def loss_and_gradients(batch):
        main.model.zero_grad()
        loss, stats = main.trainer.compute_loss(batch)
        loss.backward()
        return loss, stats, [p.grad.clone() for p in main.model.parameters()]

    loss, stats, gradients = loss_and_gradients(minibatch)
    poisoned_loss, poisoned_stats, poisoned_gradients = loss_and_gradients(poisoned)
    assert torch.equal(loss, poisoned_loss)
    for key in stats:
        assert torch.equal(stats[key], poisoned_stats[key]), key
    for mine, other in zip(gradients, poisoned_gradients):
        assert torch.equal(mine, other)


def test_the_agent_id_and_the_global_state_are_in_the_rows(tmp_path):
    main = dying_run(tmp_path, agent_id=True, central_value=True)
    obs = main.rollout.obs[0]  # the first step: t = 0, every agent alive
    assert obs.shape == (12, 3 + 3 + 4 + 3)  # observation, id; state, id
    eye = torch.eye(3)
    for env in range(4):
        for slot in range(3):
            row = obs[env * 3 + slot]
            assert row[:3].tolist() == [slot, 0, 10 + env]
            assert torch.equal(row[3:6], eye[slot])
            assert row[6:10].tolist() == [0, 1, 1, 1]  # the env's state: t, who is alive
            assert torch.equal(row[10:], eye[slot])
    assert main.model.policy_size == 6


@pytest.mark.parametrize("central_value", [True, False])
def test_the_critic_reads_the_global_state_only_with_central_value(central_value):
    torch.manual_seed(0)
    value_size = 5 if central_value else 4  # the value columns, or the policy's again
    model = pm.Model(policy_size=4, value_size=value_size, num_actions=3,
                     central_value=central_value)
    rows = torch.randn(6, 9 if central_value else 4)
    other = rows.clone()
    other[:, 4:] += 1.0  # change the value columns (without central value: nothing)
    assert torch.equal(model.log_probs(rows), model.log_probs(other))
    assert torch.equal(model.value(rows), model.value(other)) != central_value
    changed_policy_columns = rows.clone()
    changed_policy_columns[:, :4] += 1.0
    assert torch.equal(model.value(rows), model.value(changed_policy_columns)) == central_value


def test_heterogeneous_and_continuous_envs_are_refused():
    with pytest.raises(pm.UsageError, match="agents of different kinds.*one shared policy"):
        pm.inspect_env("mpe2.simple_tag_v3", {}, False)
    with pytest.raises(pm.UsageError, match="ppo_continuous.py"):
        pm.inspect_env(SPREAD, {"continuous_actions": True}, False)
    spec = pm.inspect_env(SPREAD, {"N": 4}, True)
    assert spec == pm.EnvSpec(num_agents=4, obs_size=24, num_actions=5, state_size=96)


def test_env_kwargs_are_read_as_python_values():
    assert pm.parse_env_kwargs("N=5, local_ratio=0.3,name=abc,flag=True") == {
        "N": 5, "local_ratio": 0.3, "name": "abc", "flag": True}
    assert pm.parse_env_kwargs("") == {}


def test_adam_matches_torch_adam():
    torch.manual_seed(0)
    ours, theirs = torch.randn(5, 3, requires_grad=True), None
    theirs = ours.detach().clone().requires_grad_(True)
    mine, reference = pm.Adam([ours], lr=1e-2, eps=1e-5), torch.optim.Adam([theirs], lr=1e-2,
                                                                            eps=1e-5)
    for _ in range(5):
        gradient = torch.randn(5, 3)
        ours.grad, theirs.grad = gradient.clone(), gradient.clone()
        mine.step()
        reference.step()
    assert torch.allclose(ours, theirs, atol=1e-7)


# ----- runs --------------------------------------------------------------------------------------


def final_weights(run_dir):
    return checkpoint_of(run_dir)["model"]


def test_same_seed_same_weights_in_process_and_in_workers(tmp_path):
    runs = {}
    for name, workers in (("a", 0), ("b", 0), ("c", 2)):
        config = pm.Config(seed=3, total_timesteps=3 * BATCH, run_dir=str(tmp_path / name),
                           **dict(SMALL, num_workers=workers))
        pm.Main(config).run()
        runs[name] = final_weights(tmp_path / name)
    for key in runs["a"]:
        assert torch.equal(runs["a"][key], runs["b"][key]), key
        assert torch.equal(runs["a"][key], runs["c"][key]), key
    pm.Main(pm.Config(seed=4, total_timesteps=3 * BATCH, run_dir=str(tmp_path / "d"),
                      **SMALL)).run()
    assert not torch.equal(final_weights(tmp_path / "d")["actor.0.weight"],
                           runs["a"]["actor.0.weight"])


def test_command_line_run_resume_eval_and_video(tmp_path):
    run_dir = tmp_path / "run"
    small = ["--num-envs", 4, "--num-steps", 25, "--update-epochs", 2]
    result = run_script(*small, "--total-timesteps", BATCH, "--run-dir", run_dir)
    assert result.returncode == 0, result.stderr
    assert f"step {BATCH:,}/{BATCH:,} (100.0%) | env steps 100 |" in result.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == BATCH and summary["env_steps"] == BATCH // 3
    assert summary["episodes"] == 4 and summary["mean_return_100"] is not None
    assert summary["mean_team_return_100"] == pytest.approx(3 * summary["mean_return_100"])
    assert list(run_dir.glob("events.out.tfevents.*"))
    checkpoint = checkpoint_of(run_dir)
    assert checkpoint["global_step"] == BATCH and checkpoint["updates"] == 1
    assert checkpoint["env"] == SPREAD and checkpoint["spec"] == [3, 18, 5, 54]

    result = run_script("--resume", run_dir / "checkpoint.pt", "--total-timesteps", 2 * BATCH)
    assert result.returncode == 0, result.stderr
    resumed = checkpoint_of(run_dir)
    assert resumed["global_step"] == 2 * BATCH and resumed["updates"] == 2
    assert resumed["optimizer"]["steps"] == 2 * 2 * 2  # updates x epochs x minibatches

    result = run_script("--eval", run_dir / "checkpoint.pt", "--eval-episodes", 2, "--video")
    assert result.returncode == 0, result.stderr
    assert "over 2 episodes" in result.stdout and "per team" in result.stdout
    video = cv2.VideoCapture(str(run_dir / "eval.mp4"))
    ok, frame = video.read()
    assert ok and frame.shape[2] == 3
    frames = 1 + sum(1 for _ in iter(lambda: video.read()[0], False))
    assert frames == 2 * 25


def test_two_ranks_under_torchrun_train_one_network(tmp_path):
    settings = ["--num-envs", 2, "--num-steps", 25, "--num-workers", 0, "--update-epochs", 2]
    global_batch = 2 * 2 * 3 * 25
    args = [*settings, "--total-timesteps", 2 * global_batch, "--run-dir", tmp_path]
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         "ppo_multiagent.py", *map(str, args)], cwd=ROOT, capture_output=True, text=True,
        timeout=300, env=ENVIRON)
    assert result.returncode == 0, result.stderr  # 0: the end-of-run weight check passed too
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 2 * global_batch
    assert summary["episodes"] == 2 * 2 * 2  # both ranks' episodes
    assert checkpoint_of(tmp_path)["optimizer"]["steps"] == 2 * 2 * 2
    assert result.stdout.count("finished at step") == 1  # rank 0 alone prints


@pytest.mark.parametrize("args,message", [
    (["--env", "CartPole-v1"], "name a PettingZoo parallel env by module and name"),
    (["--env", "mpe2.no_such_env_v0"], "unknown env 'mpe2.no_such_env_v0'"),
    (["--env", "mpe2.simple_adversary_v3"], "has agents of different kinds"),
    (["--env-kwargs", "continuous_actions=True"], "ppo_continuous.py"),
    (["--env-kwargs", "N"], "write name=value pairs"),
    (["--env-kwargs", "bogus=1"], "cannot make mpe2.simple_spread_v3 with --env-kwargs"),
    (["--num-envs", "0"], "--num-envs must be positive"),
    (["--num-workers", "3"], "--num-workers 3 must divide --num-envs 16"),
    (["--num-minibatches", "7"], "does not split into --num-minibatches 7"),
    (["--resume", "no/such/checkpoint.pt"], "checkpoint no/such/checkpoint.pt not found"),
])
def test_bad_input_exits_2_with_one_line(args, message, tmp_path, capsys):
    assert pm.command_line([*args, "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_bad_input_on_the_command_line_exits_2_without_traceback(tmp_path):
    result = run_script("--env", "mpe2.simple_tag_v3", "--run-dir", tmp_path / "run")
    assert result.returncode == 2
    assert "one shared policy needs every agent to observe and act alike" in result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_ctrl_c_saves_and_resume_continues(tmp_path):
    run_dir = tmp_path / "run"
    args = ["--num-envs", 4, "--num-steps", 25, "--update-epochs", 2, "--num-workers", 2,
            "--total-timesteps", 10 ** 8, "--checkpoint-every", BATCH, "--run-dir", run_dir]
    process = subprocess.Popen(
        [sys.executable, "ppo_multiagent.py", *map(str, args)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True, env=ENVIRON)
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / "checkpoint.pt").exists():
            assert process.poll() is None, process.communicate()
            assert time.monotonic() < deadline, "no checkpoint within 120 s"
            time.sleep(0.1)
        workers = children(process.pid)
        os.killpg(process.pid, signal.SIGINT)  # a terminal's Ctrl-C reaches the whole group
        _, stderr = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
    assert process.returncode == 128 + signal.SIGINT, stderr
    assert wait_until_gone(workers)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["interrupted"] is True
    stopped = checkpoint_of(run_dir)
    stopped_at, rate_before = stopped["global_step"], stopped["optimizer"]["lr"]
    assert summary["steps"] == stopped_at > 0

    new_total = stopped_at + 2 * BATCH
    resumed = pm.Main(pm.Config(resume=str(run_dir / "checkpoint.pt"),
                                total_timesteps=new_total, num_workers=0)).run()
    assert resumed["steps"] == new_total and not resumed["interrupted"]
    # The total changed: the rate anneals from that of the last update before the checkpoint to 0
    # over the steps left (it never jumps up); the last update started at new_total - BATCH.
    lr = checkpoint_of(run_dir)["optimizer"]["lr"]
    assert lr == pytest.approx(rate_before * (1 - (new_total - BATCH - stopped_at) / (2 * BATCH)))


# ----- learning ----------------------------------------------------------------------------------


def test_learns_simple_spread_within_a_step_budget(tmp_path):
    summary = pm.Main(pm.Config(seed=1, total_timesteps=60_000, num_workers=0,
                                run_dir=str(tmp_path))).run()
    # A random policy gets -27.7 per agent (300 episodes; standard error 0.5); seeds 1-3 of this
    # budget end at -22.3 to -23.4.
    assert summary["mean_return_100"] >= -24.5


def test_another_homogeneous_mpe2_env_trains_with_the_defaults(tmp_path):
    summary = pm.Main(pm.Config(env="mpe2.simple_v3", seed=1, total_timesteps=24_000,
                                num_workers=0, run_dir=str(tmp_path))).run()
    assert summary["num_agents"] == 1
    assert summary["mean_return_100"] >= -20  # a random policy gets -41.7 (standard error 1.9)
