"""Bad --env values answered in one line that says what to do (issue 41, item 5): a gymnasium
"module:Id" id is read as gymnasium reads it, a PettingZoo id is sent to ppo_multiagent.py, and
ppo_atari.py plays the DQN setting's ids only."""
import pytest

from test_command_line import error_line, run_script

SINGLE_AGENT = ["ppo_cartpole", "ppo_continuous", "ppo_memory", "ppo_spaces", "ppo_atari"]


@pytest.mark.parametrize("script", ["ppo_cartpole", "ppo_continuous", "ppo_memory"])
def test_a_module_id_is_imported_then_read(script, tmp_path):
    # DoorKey observes a Dict: the scripts of flat observations send it to ppo_spaces.py
    line = error_line(run_script(script, "--env", "minigrid:MiniGrid-DoorKey-5x5-v0",
                                 "--device", "cpu", "--run-dir", tmp_path / "run", timeout=120))
    assert "unknown env" not in line and "ppo_spaces.py" in line, line


def test_a_module_that_is_not_installed_is_named(tmp_path):
    line = error_line(run_script("ppo_cartpole", "--env", "no_such_module:Thing-v0",
                                 "--device", "cpu", "--run-dir", tmp_path / "run", timeout=120))
    assert "no_such_module" in line and "unknown env" not in line, line


@pytest.mark.parametrize("script", SINGLE_AGENT)
def test_a_pettingzoo_id_is_sent_to_the_multiagent_script(script, tmp_path):
    line = error_line(run_script(script, "--env", "mpe2.simple_spread_v3", "--device", "cpu",
                                 "--run-dir", tmp_path / "run", timeout=120))
    assert "ppo_multiagent.py" in line, line


@pytest.mark.parametrize("env_id", ["Pong-v4", "PongDeterministic-v4"])
def test_atari_refuses_the_frame_skipping_ids(env_id, tmp_path):
    line = error_line(run_script("ppo_atari", "--env", env_id, "--device", "cpu", "--no-compile",
                                 "--total-timesteps", 64, "--num-envs", 2, "--num-steps", 32,
                                 "--run-dir", tmp_path / "run", timeout=120))
    assert "PongNoFrameskip-v4" in line and "ALE/Pong-v5" in line, line
