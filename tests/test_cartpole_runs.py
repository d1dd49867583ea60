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


# ----- issue 40: presets, the general setting, observation normalisation ------------------------------


def settings_line(stdout):
    lines = [line for line in stdout.splitlines() if line.startswith("settings: ")]
    assert len(lines) == 1, stdout
    return lines[0]


def preset_fields(config):
    return {name: getattr(config, name) for name in pc.PRESET_FIELDS}


def test_cartpole_gets_its_preset_and_names_it_at_start_up(tmp_path, capsys):
    main = pc.Main(pc.Config(total_timesteps=2048, run_dir=str(tmp_path)))
    main.run()
    assert preset_fields(main.config) == pc.PRESETS["CartPole-v1"]
    assert settings_line(capsys.readouterr().out) == (
        "settings: CartPole-v1's preset (benchmarks/README.md), and --total-timesteps 2048")
    saved = torch.load(tmp_path / "checkpoint.pt", weights_only=True)["config"]
    assert {name: saved[name] for name in pc.PRESET_FIELDS} == pc.PRESETS["CartPole-v1"]


def test_the_lesson_alone_takes_the_preset_too():
    main = pc.Main(pc.Config(total_timesteps=2048))
    main.train(pc.Run)  # the lesson's plain run, as a notebook runs the lesson pasted alone
    assert preset_fields(main.config) == pc.PRESETS["CartPole-v1"]


@pytest.mark.parametrize("env,flags", [("CartPole-v1", dict(preset=False)), ("Acrobot-v1", {})])
def test_no_preset_and_other_envs_get_the_general_setting(env, flags, tmp_path, capsys):
    main = pc.Main(pc.Config(env=env, total_timesteps=2048, run_dir=str(tmp_path), **flags))
    main.run()
    assert preset_fields(main.config) == pc.GENERAL_SETTING
    line = settings_line(capsys.readouterr().out)
    assert line.startswith("settings: the general setting (benchmarks/README.md), and ")
    assert ("--no-preset" in line) == (env == "CartPole-v1")


def test_a_flag_given_wins_over_the_preset_also_on_resume(tmp_path, capsys):
    run_dir = str(tmp_path / "run")
    assert pc.command_line(["--update-epochs", "3", "--total-timesteps", "2048",
                            "--run-dir", run_dir]) == 0
    assert "--update-epochs 3" in settings_line(capsys.readouterr().out)
    # Resumed without the flag: the checkpoint's 3 goes on, not the preset's 8; typed again, it wins.
    assert pc.command_line(["--resume", run_dir, "--total-timesteps", "4096"]) == 0
    assert "--update-epochs 3" in settings_line(capsys.readouterr().out)
    assert pc.command_line(["--resume", run_dir, "--total-timesteps", "6144",
                            "--update-epochs", "5"]) == 0
    checkpoint = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)
    assert checkpoint["config"]["update_epochs"] == 5
    assert checkpoint["config"]["learning_rate"] == pc.PRESETS["CartPole-v1"]["learning_rate"]
    assert checkpoint["optimizer"]["state"][0]["step"] == 2 * (3 + 3 + 5)  # minibatches x epochs


SMALL_ACROBOT = dict(env="Acrobot-v1", num_envs=4, num_steps=16, num_minibatches=2,
                     update_epochs=1, normalize_observations=True)


def test_observation_statistics_are_saved_and_restored_by_resume_and_eval(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    pc.Main(pc.Config(total_timesteps=128, run_dir=str(run_dir), **SMALL_ACROBOT)).run()
    saved = torch.load(run_dir / "checkpoint.pt", weights_only=True)["normalizer"]["obs"]
    assert saved["count"].item() == pytest.approx(4 + 2 * 16 * 4)  # the first observations, 2 rollouts
    assert (saved["var"] != 1).all() and (saved["mean"] != 0).all()

    restored = {}
    prepare_learner = pc.RunGuard.prepare_learner

    def prepare_and_look(guard):  # the statistics the resumed run starts from
        step = prepare_learner(guard)
        stats = pc.statistics_state(guard.main.model.obs_stats)
        restored.update({key: value.clone() for key, value in stats.items()})
        return step

    monkeypatch.setattr(pc.RunGuard, "prepare_learner", prepare_and_look)
    pc.Main(pc.Config(resume=str(run_dir), total_timesteps=192)).run()
    assert all(torch.equal(restored[key], saved[key]) for key in saved)
    resumed = torch.load(run_dir / "checkpoint.pt", weights_only=True)["normalizer"]["obs"]
    assert resumed["count"].item() == pytest.approx(saved["count"].item() + 4 + 16 * 4)

    # --eval normalises with the checkpoint's statistics, frozen: the policy sees what training saw.
    seen, act = [], pc.Model.act

    def look_and_act(model, obs, greedy=False):  # what the policy sees, and the statistics then
        seen.append((obs.clone(), model.obs_stats.count.clone()))
        return act(model, obs, greedy)

    monkeypatch.setattr(pc.Model, "act", look_and_act)
    pc.Main(pc.Config(eval=str(run_dir), eval_episodes=1)).run()
    first_obs = torch.from_numpy(pc.Game("Acrobot-v1", 1).reset()).double()
    expected = ((first_obs - resumed["mean"]) / (resumed["var"] + 1e-8).sqrt()).clamp(-10, 10)
    torch.testing.assert_close(seen[0][0][0], expected.float())
    assert all(torch.equal(count, resumed["count"]) for _, count in seen)  # never updated


def test_observation_statistics_are_the_same_with_workers(tmp_path):
    states = []
    for workers in (0, 2):
        run_dir = tmp_path / str(workers)
        pc.Main(pc.Config(total_timesteps=128, num_workers=workers, run_dir=str(run_dir),
                          **SMALL_ACROBOT)).run()
        states.append(torch.load(run_dir / "checkpoint.pt", weights_only=True))
    for key, value in states[0]["model"].items():
        assert torch.equal(value, states[1]["model"][key]), key
    for key, value in states[0]["normalizer"]["obs"].items():
        assert torch.equal(value, states[1]["normalizer"]["obs"][key]), key


def test_ranks_merge_their_observation_statistics(tmp_path):
    # 2 ranks x 4 Acrobots x 16 steps x 2 rollouts: rank 0 (which saves) holds the statistics of
    # both ranks' observations; tests/test_cartpole_units.py checks the merge's numbers.
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
               "2", "ppo_cartpole.py", "--env", "Acrobot-v1", "--num-envs", "4", "--num-steps",
               "16", "--num-minibatches", "2", "--update-epochs", "1", "--total-timesteps", "256",
               "--run-dir", str(tmp_path)]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    saved = torch.load(tmp_path / "checkpoint.pt", weights_only=True)["normalizer"]["obs"]
    assert saved["count"].item() == pytest.approx(2 * (4 + 2 * 16 * 4))


def test_box2d_missing_is_one_line_naming_the_install(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "Box2D", None)  # `import Box2D` raises ImportError
    status = pc.command_line(["--env", "LunarLander-v3", "--run-dir", str(tmp_path / "run")])
    error = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(error) == 1
    assert error[0] == ('error: LunarLander-v3 runs on Box2D, which is not installed: '
                        'pip install "gymnasium[box2d]"')
