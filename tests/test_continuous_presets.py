"""ppo_continuous.py's presets (issue 40): Pendulum-v1 and LunarLanderContinuous-v3 take their own,
named at start-up; any other env, or --no-preset, the general setting (CleanRL's for MuJoCo); a flag
given wins, also on --resume; --help gives each preset field's default by env; an env on Box2D
without Box2D is refused in one line."""
import sys

import pytest
import torch

import ppo_continuous as pc

# The defaults before issue 40, which won Pendulum's race: the preset keeps them to the bit.
BEFORE_PRESETS = dict(learning_rate=1e-3, gamma=0.97, num_minibatches=4, clip_value_loss=False,
                      num_envs=16, num_steps=64)
# CleanRL's settings for MuJoCo (benchmarks/continuous_mujoco.py's flags): the general setting.
CLEANRL_MUJOCO = dict(learning_rate=3e-4, gamma=0.99, num_minibatches=32, clip_value_loss=True,
                      num_envs=1, num_steps=2048)


def settings_line(stdout):
    lines = [line for line in stdout.splitlines() if line.startswith("settings: ")]
    assert len(lines) == 1, stdout
    return lines[0]


def preset_fields(config):
    return {name: getattr(config, name) for name in pc.PRESET_FIELDS}


def test_the_preset_fills_only_the_fields_left_at_none():
    assert pc.PRESETS["Pendulum-v1"] == BEFORE_PRESETS
    assert pc.PRESETS["LunarLanderContinuous-v3"] == {**CLEANRL_MUJOCO, "gamma": 0.999}
    for config in (pc.Config(), pc.Config(env_backend="torch")):  # the torch engine: Pendulum too
        assert preset_fields(pc.with_preset(config)) == pc.PRESETS["Pendulum-v1"]
    for config in (pc.Config(preset=False), pc.Config(env="MountainCarContinuous-v0")):
        assert preset_fields(pc.with_preset(config)) == pc.GENERAL_SETTING
    hopper = pc.with_preset(pc.Config(env="Hopper-v5"))  # CleanRL's, with nothing but --env
    assert preset_fields(hopper) == CLEANRL_MUJOCO and hopper.update_epochs == 10
    assert (hopper.gae_lambda, hopper.ent_coef, hopper.normalize_observations) == (0.95, 0, True)
    given = pc.with_preset(pc.Config(env="Hopper-v5", learning_rate=1e-4, clip_value_loss=False))
    assert (given.learning_rate, given.clip_value_loss) == (1e-4, False)
    assert given.num_envs == pc.GENERAL_SETTING["num_envs"]
    assert pc.preset_of(pc.Config()) == ("Pendulum-v1's preset", pc.PRESETS["Pendulum-v1"])
    assert pc.preset_of(pc.Config(preset=False))[0] == "the general setting"
    assert all(getattr(pc.Config(), name) is None for name in pc.PRESET_FIELDS)


def test_pendulum_gets_its_preset_and_names_it_at_start_up(tmp_path, capsys):
    main = pc.Main(pc.Config(total_timesteps=1024, run_dir=str(tmp_path)))
    main.run()
    assert preset_fields(main.config) == BEFORE_PRESETS
    assert settings_line(capsys.readouterr().out) == (
        "settings: Pendulum-v1's preset (benchmarks/README.md), and --total-timesteps 1024")
    saved = torch.load(tmp_path / "checkpoint.pt", weights_only=True)["config"]
    assert preset_fields(pc.Config(**{name: saved[name] for name in pc.PRESET_FIELDS})) == (
        BEFORE_PRESETS)


def test_the_lander_gets_its_preset_and_names_it_at_start_up(tmp_path, capsys):
    main = pc.Main(pc.Config(env="LunarLanderContinuous-v3", total_timesteps=2048, update_epochs=1,
                             run_dir=str(tmp_path)))  # one rollout, one epoch
    main.run()
    assert preset_fields(main.config) == pc.PRESETS["LunarLanderContinuous-v3"]
    assert settings_line(capsys.readouterr().out) == (
        "settings: LunarLanderContinuous-v3's preset (benchmarks/README.md), and --update-epochs 1 "
        "--env LunarLanderContinuous-v3 --total-timesteps 2048")


def test_the_preset_learns_as_the_same_values_given_by_hand(tmp_path):
    # Pendulum's preset is the defaults before issue 40: one rollout, the same weights to the bit.
    weights = []
    for name, given in (("preset", {}), ("by_hand", BEFORE_PRESETS)):
        pc.Main(pc.Config(total_timesteps=1024, run_dir=str(tmp_path / name), **given)).run()
        weights.append(torch.load(tmp_path / name / "checkpoint.pt", weights_only=True)["model"])
    assert all(torch.equal(value, weights[1][key]) for key, value in weights[0].items())


def test_the_lesson_alone_takes_the_preset_too():
    main = pc.Main(pc.Config(total_timesteps=1024))
    main.train(pc.Run)  # the lesson's plain run, as a notebook runs the lesson pasted alone
    assert preset_fields(main.config) == pc.PRESETS["Pendulum-v1"]


@pytest.mark.parametrize("env,flags", [("Pendulum-v1", dict(preset=False)),
                                       ("MountainCarContinuous-v0", {})])
def test_no_preset_and_other_envs_get_the_general_setting(env, flags, tmp_path, capsys):
    steps = pc.GENERAL_SETTING["num_envs"] * pc.GENERAL_SETTING["num_steps"]  # one rollout
    main = pc.Main(pc.Config(env=env, total_timesteps=steps, update_epochs=1,
                             run_dir=str(tmp_path), **flags))
    main.run()
    assert preset_fields(main.config) == pc.GENERAL_SETTING
    line = settings_line(capsys.readouterr().out)
    assert line.startswith("settings: the general setting (benchmarks/README.md), and ")
    assert ("--no-preset" in line) == (env == "Pendulum-v1")
    assert "--num-envs" not in line and "--learning-rate" not in line  # the setting's own values


def test_a_flag_given_wins_over_the_preset_also_on_resume(tmp_path, capsys):
    run_dir = str(tmp_path / "run")
    assert pc.command_line(["--num-minibatches", "2", "--update-epochs", "1",
                            "--total-timesteps", "1024", "--run-dir", run_dir]) == 0
    assert "--num-minibatches 2" in settings_line(capsys.readouterr().out)
    # Resumed without it: the checkpoint's 2 goes on, not the preset's 4; typed again, it wins.
    assert pc.command_line(["--resume", run_dir, "--total-timesteps", "2048"]) == 0
    assert "--num-minibatches 2" in settings_line(capsys.readouterr().out)
    assert pc.command_line(["--resume", run_dir, "--total-timesteps", "3072",
                            "--num-minibatches", "8"]) == 0
    checkpoint = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)
    assert checkpoint["config"]["num_minibatches"] == 8
    assert checkpoint["config"]["gamma"] == pc.PRESETS["Pendulum-v1"]["gamma"]
    assert checkpoint["optimizer"]["state"][0]["step"] == 2 + 2 + 8  # minibatches x 1 epoch


def test_help_gives_each_preset_field_its_default_by_env(capsys):
    with pytest.raises(SystemExit):
        pc.parse_config(["--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps the lines
    for name in pc.PRESET_FIELDS:  # Pendulum's differ in each; the lander's in gamma alone
        pendulum, general = pc.PRESETS["Pendulum-v1"][name], pc.GENERAL_SETTING[name]
        lander = "LunarLanderContinuous-v3 0.999, " if name == "gamma" else ""
        assert f"(default: Pendulum-v1 {pendulum}, {lander}other envs {general})" in text, name
    assert "--preset, --no-preset the env's preset where it has one" in text
    config = pc.parse_config(["--no-preset", "--clip-value-loss"])
    assert (config.preset, config.clip_value_loss, config.gamma) == (False, True, None)
    assert pc.parse_config([]) == pc.Config()


def test_box2d_missing_is_one_line_naming_the_install(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "Box2D", None)  # `import Box2D` raises ImportError
    status = pc.command_line(["--env", "LunarLanderContinuous-v3",
                              "--run-dir", str(tmp_path / "run")])
    error = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(error) == 1
    assert error[0] == ('error: LunarLanderContinuous-v3 runs on Box2D, which is not installed: '
                        'pip install "gymnasium[box2d]"')
