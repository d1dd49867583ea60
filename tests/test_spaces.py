"""ppo_spaces.py: nests of observation and action spaces, action masks, the spec check of a user's env;
its pieces against reference values, its runs through the command line, and one learning check."""
import json
import os
import signal
import subprocess
import sys
import time

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium import spaces

import ppo_spaces as ps
import spaces_envs
from conftest import ROOT, children, wait_until_gone

ENVIRON = {**os.environ, "PYTHONPATH": str(ROOT / "tests"), "OMP_NUM_THREADS": "1"}
# Small runs of Taxi-v4 (the default env, masks in info): 4 games x 32 steps = 128 steps per update.
SMALL = ["--num-envs", 4, "--num-steps", 32, "--num-minibatches", 2, "--device", "cpu"]


def run_script(*args, timeout=120):
    return subprocess.run([sys.executable, "ppo_spaces.py", *map(str, args)], cwd=ROOT, env=ENVIRON,
                          capture_output=True, text=True, timeout=timeout)


def error_line(result):
    """The one line of a refusal: exit status 2, stderr one line starting with "error: "."""
    lines = result.stderr.splitlines()
    assert result.returncode == 2, (result.stdout[-2000:], lines[-20:])
    assert len(lines) == 1 and lines[0].startswith("error: "), lines[-20:]
    return lines[0]


def small_config(tmp_path, **settings):
    return ps.Config(**{"num_envs": 4, "num_steps": 16, "num_minibatches": 2, "total_timesteps": 128,
                        "device": "cpu", "run_dir": str(tmp_path / "run"), **settings})


def observation_of(values: list, mask=()):
    """A flat observation as a Game makes it: the observed leaves' numbers in turn, then the mask."""
    parts = [np.asarray(value, np.float32).reshape(-1) for value in values] + [np.asarray(mask, np.float32)]
    return torch.from_numpy(np.concatenate(parts))[None]


# ----- leaves and nests ----------------------------------------------------------------------------


def test_leaves_are_listed_depth_first_and_nest_of_rebuilds_the_nest():
    space = spaces.Dict({"a": spaces.Tuple((spaces.Discrete(2), spaces.Dict({"b": spaces.Box(0, 1, (2,))}))),
                         "c": spaces.MultiBinary(3)})
    paths = [path for path, _ in ps.leaves(space)]
    assert paths == [("a", 0), ("a", 1, "b"), ("c",)]
    nest = ps.nest_of(space, iter([1, "box", "bits"]))
    assert nest == {"a": (1, {"b": "box"}), "c": "bits"}
    assert ps.leaves(spaces.Discrete(3)) == [((), spaces.Discrete(3))]


def test_a_game_flattens_observations_with_the_mask_last_and_builds_the_env_s_action_nest():
    game = ps.Game("TestInfoMask-v0", seed=3)
    obs = game.reset()
    raw = game.env.unwrapped
    assert obs.dtype == np.float32 and obs.shape == (1 + 2 + 5,) and game.mask_size == 5
    assert obs[-5:].tolist() == raw.mask.tolist()  # the mask from info, in the last columns
    assert 1 <= obs[0] <= 4  # the Discrete(4, start=1) as its value: the Encoder subtracts the start
    action = game.env_action(np.array([2.0, 1.0], np.float32))
    assert action.dtype == np.int64 and action.tolist() == [2, 1]
    hybrid = ps.Game("TestHybrid-v0", seed=1)
    hybrid.reset()
    nest = hybrid.env_action(np.array([2.0, 3.5], np.float32))  # a parameter beyond its bound
    assert int(nest["choice"]) == 2 and nest["parameter"].tolist() == [1.0]  # sent clipped
    assert hybrid.env.action_space.contains(nest)


# ----- encoders ------------------------------------------------------------------------------------


def test_one_hot_encodes_each_dimension_counting_from_the_space_s_start():
    encoder = ps.OneHot(spaces.Discrete(5, start=2))
    assert encoder(torch.tensor([[4.0], [2.0]])).tolist() == [[0, 0, 1, 0, 0], [1, 0, 0, 0, 0]]
    multi = ps.OneHot(spaces.MultiDiscrete([3, 2], start=[1, 0]))
    assert multi.features == 5
    assert multi(torch.tensor([[3.0, 0.0]])).tolist() == [[0, 0, 1, 1, 0]]


@pytest.mark.parametrize("shape,flat_features,convolutions", [
    ((84, 84, 3), 64 * 9 * 9, 3),  # 84 -> 41 -> 20 -> 9, stride 2
    ((4, 64, 64), 64 * 13 * 13, 3),  # 64 -> 31 -> 15 (stride 2), then 15 -> 13 (stride 1)
    ((16, 20, 3), 64 * 3 * 5, 3),  # the smallest side that strides: 16 -> 7, then 7 -> 5 -> 3
    ((7, 7, 3), 7 * 7 * 3, 0),  # MiniGrid's view: a side under 16, the image whole to the linear layer
    ((3, 7, 7), 3 * 7 * 7, 0),
    ((15, 40, 3), 15 * 40 * 3, 0),  # one side under 16 is enough
    ((10, 12), 10 * 12, 0),  # one channel
    ((2, 2, 3), 3 * 2 * 2, 0),
])
def test_the_cnn_is_sized_to_the_image_and_a_side_under_16_goes_whole_to_the_linear_layer(
        shape, flat_features, convolutions):
    encoder = ps.ImageEncoder(shape, hidden_size=32)
    linear = [module for module in encoder.cnn if isinstance(module, torch.nn.Linear)][0]
    assert linear.in_features == flat_features
    assert sum(isinstance(module, torch.nn.Conv2d) for module in encoder.cnn) == convolutions
    pixels = torch.randint(0, 256, (5, int(np.prod(shape))), dtype=torch.uint8).float()
    assert encoder(pixels).shape == (5, 32)


def test_an_hwc_image_and_its_chw_transpose_give_the_same_features():
    hwc, chw = ps.ImageEncoder((7, 7, 3), 16), ps.ImageEncoder((3, 7, 7), 16)
    chw.load_state_dict(hwc.state_dict())
    image = torch.randint(0, 256, (2, 7, 7, 3)).float()
    assert torch.allclose(hwc(image.reshape(2, -1)), chw(image.permute(0, 3, 1, 2).reshape(2, -1)), atol=1e-6)


def test_the_encoder_reads_each_leaf_by_its_kind_and_leaves_text_out():
    obs_space = spaces.Dict({"image": spaces.Box(0, 255, (7, 7, 3), np.uint8), "direction": spaces.Discrete(4),
                             "position": spaces.Box(-5, 5, (3,), np.float32), "bits": spaces.MultiBinary(2),
                             "mission": spaces.Text(10)})
    encoder = ps.Encoder(obs_space, hidden_size=16)
    observed = ps.observed_leaves(obs_space)
    assert [path for path, _ in observed] == [p for p, s in ps.leaves(obs_space) if p != ("mission",)]
    sizes = {path[0]: size for (path, _), size in zip(observed, encoder.sizes)}
    assert sizes == {"image": 147, "direction": 1, "position": 3, "bits": 2}
    assert encoder.features == 16 + 4 + 3 + 2
    starts = dict(zip([path[0] for path, _ in observed], np.cumsum(encoder.sizes) - encoder.sizes))
    box = [*range(starts["image"], starts["image"] + 147), *range(starts["position"], starts["position"] + 3)]
    assert encoder.box_columns == sorted(box)  # the Box leaves, vector and image, are normalised
    values = {"image": np.zeros((7, 7, 3)), "direction": 2, "position": [1, 2, 3], "bits": [1, 0]}
    features = encoder(observation_of([values[path[0]] for path, _ in observed]))[0]
    assert features.shape == (encoder.features,)
    expected = {"direction": [0, 0, 1, 0], "position": [1, 2, 3], "bits": [1, 0]}
    at = 0  # the features follow the leaves' order
    for path, _ in observed:
        width = 16 if path == ("image",) else len(expected[path[0]])
        if path != ("image",):
            assert features[at:at + width].tolist() == expected[path[0]], path
        at += width


# ----- the policy: heads per leaf, sums over leaves, masks -----------------------------------------

OBS_SPACE = spaces.Box(-1, 1, (3,), np.float32)
ACTION_SPACE = spaces.Dict({"a": spaces.Discrete(3), "b": spaces.MultiDiscrete([2, 4]), "c": spaces.MultiBinary(2),
                            "d": spaces.Box(-1, 1, (2,), np.float32)})


def reference_distributions(model, obs):
    """The policy's leaves rebuilt with torch.distributions, by hand from the actor's outputs."""
    outputs = dict(zip(model.names, model.actor(model.encoder(obs)).split([h.size for h in model.heads], -1)))
    b = outputs["b"].view(-1, 2, 4)
    c = outputs["c"].view(-1, 2, 2)
    std = model.heads[model.names.index("d")].log_std.exp()
    return {"a": [torch.distributions.Categorical(logits=outputs["a"])],
            "b": [torch.distributions.Categorical(logits=b[:, 0, :2]),
                  torch.distributions.Categorical(logits=b[:, 1, :4])],
            "c": [torch.distributions.Categorical(logits=c[:, 0]), torch.distributions.Categorical(logits=c[:, 1])],
            "d": [torch.distributions.Normal(outputs["d"][:, 0], std[0]),
                  torch.distributions.Normal(outputs["d"][:, 1], std[1])]}


def test_log_probability_and_entropy_of_a_nested_action_are_the_sums_over_its_leaves():
    torch.manual_seed(0)
    model = ps.Model(OBS_SPACE, ACTION_SPACE, hidden_size=8)
    with torch.no_grad():
        model.heads[model.names.index("d")].log_std.copy_(torch.tensor([-0.5, 0.3]))
        for parameter in model.actor.parameters():  # away from the near-uniform start
            parameter.mul_(20)
    obs = torch.rand(6, 3) * 2 - 1
    with torch.no_grad():
        actions, act_log_prob, _ = model.act(obs)
        log_prob, entropy, _ = model.evaluate_actions(obs, actions)
        reference = reference_distributions(model, obs)
    assert set(actions) == {"a", "b", "c", "d"}
    assert [actions[name].shape[1] for name in "abcd"] == [1, 2, 2, 2]
    assert actions["a"].dtype == torch.long and actions["d"].dtype == torch.float32
    expected_log_prob = sum(d.log_prob(actions[name][:, i]) for name, ds in reference.items()
                            for i, d in enumerate(ds))
    expected_entropy = sum(d.entropy() for ds in reference.values() for d in ds)
    assert torch.allclose(log_prob, expected_log_prob, atol=1e-5)
    assert torch.allclose(act_log_prob, expected_log_prob, atol=1e-5)
    assert torch.allclose(entropy, expected_entropy, atol=1e-5)
    assert actions["b"][:, 0].max() <= 1  # a padded choice of the 2-choice dimension never comes


def test_greedy_takes_the_most_likely_choice_and_the_gaussian_mean():
    torch.manual_seed(1)
    model = ps.Model(OBS_SPACE, ACTION_SPACE, hidden_size=8)
    obs = torch.rand(4, 3)
    with torch.no_grad():
        actions, _, _ = model.act(obs, greedy=True)
        reference = reference_distributions(model, obs)
    assert torch.equal(actions["a"][:, 0], reference["a"][0].probs.argmax(-1))
    assert torch.allclose(actions["d"][:, 1], reference["d"][1].mean)


MASKED_OBS = spaces.Dict({"observation": spaces.Box(0, 1, (2,), np.float32), "action_mask": spaces.MultiBinary(7)})
MASKED_ACTIONS = spaces.Tuple((spaces.Discrete(4), spaces.MultiDiscrete([2, 1]), spaces.Box(-1, 1, (1,))))


def test_a_masked_choice_is_never_sampled_and_the_entropy_is_over_the_allowed_ones():
    torch.manual_seed(2)
    mask = [1, 0, 1, 0, 0, 1, 1]  # Discrete(4): 0 and 2 allowed; MultiDiscrete: 1 of 2, the only 1
    obs = observation_of([[0.5, 0.5]], mask).expand(3000, -1)
    masked = ps.Model(MASKED_OBS, MASKED_ACTIONS, hidden_size=8, masked=True)
    assert masked.mask_size == 4 + 3
    with torch.no_grad():
        actions, log_prob, _ = masked.act(obs)
        _, entropy, _ = masked.evaluate_actions(obs, actions)
        output = masked.actor(masked.encoder(obs[:1]))[0]
    assert set(actions["0"][:, 0].tolist()) == {0, 2}
    assert set(actions["1"][:, 0].tolist()) == {1} and set(actions["1"][:, 1].tolist()) == {0}
    allowed = torch.distributions.Categorical(logits=output[[0, 2]])
    gaussian = torch.distributions.Normal(torch.zeros(1), masked.heads[2].log_std.exp())
    assert torch.allclose(entropy[0], allowed.entropy() + gaussian.entropy().sum(), atol=1e-5)
    # Without the mask the same network samples every choice: the check above can fail.
    unmasked = ps.Model(MASKED_OBS, MASKED_ACTIONS, hidden_size=8, masked=False)
    unmasked.load_state_dict(masked.state_dict())
    with torch.no_grad():
        free, _, _ = unmasked.act(obs)
    assert set(free["0"][:, 0].tolist()) == {0, 1, 2, 3}


def test_the_ratio_is_1_before_the_first_gradient_step_with_masks_that_change_every_step(tmp_path, monkeypatch):
    ratios = []
    ppo_loss = ps.Trainer.ppo_loss

    def recording(minibatch, new_log_probs, entropy, new_values, config):
        ratios.append((new_log_probs - minibatch.old_log_probs).exp().detach())
        return ppo_loss(minibatch, new_log_probs, entropy, new_values, config)

    monkeypatch.setattr(ps.Trainer, "ppo_loss", staticmethod(recording))
    for env in ("TestObservedMask-v0", "TestInfoMask-v0"):
        ratios.clear()
        ps.Main(small_config(tmp_path / env, env=env, update_epochs=2, num_minibatches=1)).run()
        assert torch.allclose(ratios[0], torch.ones_like(ratios[0]), atol=1e-5), env  # the first step
        assert not torch.allclose(ratios[-1], torch.ones_like(ratios[-1]), atol=1e-5)  # it learned after


def test_a_truncated_episode_is_bootstrapped_from_its_final_observation_and_a_terminated_one_is_not(
        tmp_path, monkeypatch):
    # TestCount-v0 (tests/conftest.py) is truncated after 3 steps, when its observation is [3].
    main = ps.Main(small_config(tmp_path / "count", env="TestCount-v0", num_envs=2, num_steps=7,
                                total_timesteps=14, num_minibatches=1, update_epochs=1,
                                normalize_observations=False, scale_rewards=False))  # raw: 1 a step
    calls, value = [], ps.Model.value

    def value_recording(model, obs):
        values = value(model, obs)
        calls.append((obs.tolist(), values.tolist()))
        return values

    monkeypatch.setattr(ps.Model, "value", value_recording)
    main.run()
    assert main.rollout.dones[:, 0].tolist() == [0, 0, 1, 0, 0, 1, 0]
    # Both envs end together: each bootstrap is one call with both final observations [3] (which the
    # policy itself never sees: a game restarts at once); the last call is GAE's last value.
    assert [obs for obs, _ in calls[:-1]] == [[[3.0], [3.0]]] * 2
    first, second, gamma = calls[0][1][0], calls[1][1][0], main.config.gamma
    assert main.rollout.rewards[:, 0].tolist() == pytest.approx([1, 1, 1 + gamma * first, 1, 1, 1 + gamma * second, 1])
    # TestHybrid-v0 terminates every step: no value is asked for but GAE's last one, nothing bootstrapped.
    hybrid = ps.Main(small_config(tmp_path / "hybrid", env="TestHybrid-v0", total_timesteps=64))
    calls.clear()
    hybrid.run()
    assert hybrid.rollout.dones.eq(1).all() and len(calls) == 1


def test_the_model_s_running_statistics_merge_exactly_and_normalise_only_the_box_columns():
    # Chan et al.'s merge of batches of any sizes gives the mean and variance of all the rows at once.
    obs_space = spaces.Dict({"mode": spaces.Discrete(3), "target": spaces.Box(-9, 9, (2,), np.float32)})
    model = ps.Model(obs_space, spaces.Discrete(2), hidden_size=8, normalize=True, obs_clip=3.0)
    stats = model.obs_stats
    assert model.encoder.box_columns == [1, 2] and {"obs_stats.mean", "obs_stats.var", "obs_stats.count"} <= set(
        model.state_dict())  # saved with the weights: part of the policy
    rows = torch.from_numpy(np.random.default_rng(0).normal(2.0, 3.0, (17, 3)).astype(np.float32))
    rows[:, 0] = torch.randint(0, 3, (17,)).float()
    for batch in (rows[:5], rows[5:6], rows[6:]):
        normalised = stats.normalize(batch)
    numbers = rows[:, 1:].double()
    assert float(stats.count) == pytest.approx(1e-4 + 17)
    assert torch.allclose(stats.mean, numbers.sum(0) / (17 + 1e-4))
    assert torch.allclose(stats.var, numbers.var(0, correction=0), rtol=1e-4)
    expected = ((batch[:, 1:].double() - stats.mean) / (stats.var + 1e-8).sqrt()).clamp(-3, 3).float()
    assert torch.equal(normalised[:, 0], batch[:, 0]) and torch.allclose(normalised[:, 1:], expected)
    before = stats.state_dict()
    stats.normalize(rows, update=False)  # a final observation: read, not merged
    assert all(torch.equal(before[key], value) for key, value in stats.state_dict().items())
    off = ps.Model(obs_space, spaces.Discrete(2), hidden_size=8)  # --no-normalize-observations
    assert off.obs_stats.normalize(rows) is rows and float(off.obs_stats.count) == pytest.approx(1e-4)


def test_an_image_is_standardised_number_by_number_as_a_box_vector_is_and_read_as_pixels_without():
    # MiniGrid's kind of image: codes 0-10 in a Box declared 0-255 (divided by 255, all near 0).
    obs_space = spaces.Dict({"direction": spaces.Discrete(4), "image": spaces.Box(0, 255, (3, 3, 2), np.uint8)})
    model = ps.Model(obs_space, spaces.Discrete(3), hidden_size=8, normalize=True)
    assert model.encoder.box_columns == list(range(1, 19)) and model.encoder.encoders[1].divisor == 1.0
    codes = torch.randint(0, 11, (64, 18), generator=torch.Generator().manual_seed(0)).float()
    rows = torch.cat([torch.randint(0, 4, (64, 1)).float(), codes], 1)
    normalised = model.obs_stats.normalize(rows)
    assert torch.equal(normalised[:, 0], rows[:, 0])  # the direction is one-hot encoded instead
    mean, std = codes.double().mean(0), codes.double().std(0, correction=0)
    assert torch.allclose(normalised[:, 1:], ((codes - mean) / std).float(), atol=1e-3)  # each number its own
    # --no-normalize-observations: pixels, divided by 255 (the same CNN, fed x / 255, gives the same features).
    pixels = ps.Model(obs_space, spaces.Discrete(3), hidden_size=8)
    assert not pixels.obs_stats.active and pixels.encoder.encoders[1].divisor == 255.0
    pixels.load_state_dict(model.state_dict())
    image = rows[:4, 1:]
    assert torch.allclose(pixels.encoder.encoders[1](image * 255), model.encoder.encoders[1](image), atol=1e-5)


def test_rewards_are_divided_by_the_running_std_of_the_discounted_return_which_restarts_after_an_end():
    stats, gamma = ps.RunningMeanStd([0], clip=10.0), 0.9
    returns = torch.zeros(2, dtype=torch.float64)  # R of each of 2 games
    rewards, ended = [[1.0, 0.0], [0.0, 2.0], [3.0, 1.0]], [[False, True], [False, False], [True, False]]
    expected_returns, seen = np.zeros(2), []
    for reward, end in zip(rewards, ended):
        scaled = stats.scale(torch.tensor(reward), returns, torch.tensor(end), gamma)
        expected_returns = gamma * expected_returns + np.array(reward)
        seen += expected_returns.tolist()  # every game's R of every step so far
        assert scaled.tolist() == pytest.approx((np.array(reward) / np.std(seen)).tolist(), rel=1e-3)
        expected_returns[np.array(end)] = 0.0  # a new episode's R starts from 0
        assert returns.tolist() == pytest.approx(expected_returns.tolist())
    assert float(stats.count) == pytest.approx(1e-4 + 6)
    stats.count.fill_(1e6), stats.var.fill_(1e-6)  # a long run of returns near 0: the first reward is huge
    huge = stats.scale(torch.tensor([1.0, 0.0]), returns.zero_(), torch.tensor([False, False]), gamma)
    assert huge.tolist() == [10.0, 0.0]  # clipped, as SB3's VecNormalize clips
    off, reward = ps.RunningMeanStd([0], active=False), torch.tensor([5.0, 1.0])  # --no-scale-rewards
    assert off.scale(reward, returns, torch.tensor([False, False]), gamma) is reward


# ----- the spec check --------------------------------------------------------------------------------


@pytest.mark.parametrize("flaw,problem", [
    ("dtype", "step 3's observation['position'] has dtype float64, not float32"),
    ("shape", "step 3's observation['position'] has shape (3,), not (2,)"),
    ("key", "step 3's observation has the keys ['position'], not the keys ['count', 'position']"),
    ("bounds", "step 3's observation['count'] = 5 is outside Discrete(3)"),
    ("reward", "step 3's reward is nan, not a finite number"),
    ("start", "reset()'s observation['position'] has dtype float64, not float32"),
])
def test_the_spec_check_names_the_first_mismatch(flaw, problem):
    env_id = f"TestFlawed{flaw.title()}-v0"
    with pytest.raises(ps.UsageError) as refused:
        ps.check_env_specs(env_id, seed=1)
    assert str(refused.value) == f"{env_id} does not keep to its spaces: {problem} (--no-check-env skips this check)"


@pytest.mark.parametrize("env_id", ["Taxi-v4", "Blackjack-v1", "FrozenLake-v1", "TestHybrid-v0", "TestGrid-v0",
                                    "TestInfoMask-v0", "TestObservedMask-v0"])
def test_the_spec_check_passes_envs_that_keep_to_their_spaces(env_id):
    ps.check_env_specs(env_id, seed=1)  # (the masked test envs raise on a forbidden random action)


def test_inspect_env_refuses_what_it_cannot_play_and_names_what_it_leaves_out():
    with pytest.raises(ps.UsageError, match=r"^TestTextAction-v0's action space has a Text space: "):
        ps.inspect_env(ps.Config(env="TestTextAction-v0"))
    with pytest.raises(ps.UsageError) as refused:
        ps.inspect_env(ps.Config(env="TestWrongMask-v0"))
    assert "has 5 entries, but its Discrete and MultiDiscrete actions have 6 choices" in str(refused.value)
    # The mask ignored: fine (without the check, whose random actions this env would refuse).
    ps.inspect_env(ps.Config(env="TestWrongMask-v0", action_mask=False, check_env=False))
    grid = ps.inspect_env(ps.Config(env="TestGrid-v0"))
    assert grid.notes == ["observation mission (Text) left out: no fixed-size numbers to encode"]
    assert grid.obs_size == 147 + 1 and not grid.masked
    taxi = ps.inspect_env(ps.Config(env="Taxi-v4"))
    assert taxi.masked and taxi.obs_size == 1 + 6 and taxi.notes == ['action mask: info["action_mask"], 6 choices']


# ----- runs ----------------------------------------------------------------------------------------------


def test_masks_hold_in_every_step_of_a_run_and_without_them_the_env_is_sent_forbidden_moves(tmp_path):
    summary = ps.Main(small_config(tmp_path / "a", env="TestObservedMask-v0", num_workers=2)).run()
    assert summary["steps"] == 128 and summary["interrupted"] is False
    ps.Main(small_config(tmp_path / "b", env="TestInfoMask-v0")).run()
    with pytest.raises(spaces_envs.ForbiddenMoveError):
        ps.Main(small_config(tmp_path / "c", env="TestInfoMask-v0", action_mask=False)).run()


def test_an_image_a_direction_and_a_text_in_a_dict_and_a_tuple_observation(tmp_path, capsys):
    summary = ps.Main(small_config(tmp_path / "grid", env="TestGrid-v0")).run()
    assert summary["episodes"] == 4 * 6  # 4 games of 32 steps: 6 whole episodes of 5 steps each
    assert "observation mission (Text) left out: no fixed-size numbers to encode" in capsys.readouterr().out
    blackjack = ps.Main(small_config(tmp_path / "blackjack", env="Blackjack-v1")).run()
    assert blackjack["episodes"] > 0


def test_minigrid_s_doorkey_plays_with_its_image_and_direction_and_its_mission_left_out(tmp_path, capsys):
    import minigrid  # noqa: F401  (requirements-dev.txt; the benchmark's env)

    summary = ps.Main(small_config(tmp_path, env="minigrid:MiniGrid-DoorKey-5x5-v0")).run()
    assert summary["steps"] == 128
    assert "observation mission (MissionSpace) left out: no fixed-size numbers to encode" in capsys.readouterr().out
    doorkey = ps.inspect_env(ps.Config(env="minigrid:MiniGrid-DoorKey-5x5-v0"))
    assert doorkey.obs_size == 1 + 7 * 7 * 3 and not doorkey.masked  # direction, image (keys sorted)


def test_command_line_run_resume_and_eval_with_video_on_taxi(tmp_path):
    run_dir = tmp_path / "run"
    result = run_script(*SMALL, "--total-timesteps", 256, "--run-dir", run_dir)
    assert result.returncode == 0, result.stderr[-3000:]
    assert 'action mask: info["action_mask"], 6 choices' in result.stdout
    # The start-up lines name the learner and what plays the games.
    assert "learner: the lesson's torch code (Model, Trainer, compute_gae)\n" in result.stdout
    assert "engine: the lesson's Game, 4 in this process\n" in result.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert set(summary) == {"script", "env", "seed", "steps", "seconds", "warmup_seconds", "steps_per_second",
                            "episodes", "mean_return_100", "target_return", "solved_step", "solved_seconds",
                            "interrupted", "checkpoint", "world_size", "resumed_at_step"}
    assert summary["script"] == "ppo_spaces" and summary["env"] == "Taxi-v4" and summary["steps"] == 256
    checkpoint = torch.load(run_dir / "checkpoint.pt", weights_only=True)
    assert checkpoint["global_step"] == 256 and checkpoint["updates"] == 2 and checkpoint["obs_size"] == 7

    result = run_script("--resume", run_dir, "--total-timesteps", 512, "--device", "cpu")
    assert result.returncode == 0, result.stderr[-3000:]
    resumed = torch.load(run_dir / "checkpoint.pt", weights_only=True)
    assert resumed["global_step"] == 512 and resumed["updates"] == 4
    assert resumed["optimizer"]["state"][0]["step"] == 4 * 4 * 2  # updates x epochs x minibatches

    result = run_script("--eval", run_dir, "--eval-episodes", 2, "--video", "--device", "cpu")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "eval Taxi-v4: return" in result.stdout and "over 2 episodes" in result.stdout
    assert (run_dir / "eval.mp4").stat().st_size > 0


def test_a_user_env_by_module_name_and_the_normaliser_in_the_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    result = run_script("--env", "spaces_envs:TestHybrid-v0", *SMALL, "--total-timesteps", 128, "--num-workers", 2,
                        "--run-dir", run_dir)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "engine: the lesson's Game, 2 per Worker in 2 child processes\n" in result.stdout
    checkpoint = torch.load(run_dir / "checkpoint.pt", weights_only=True)
    weights = checkpoint["model"]  # the running statistics are the Model's buffers, `obs_stats`
    assert weights["obs_stats.mean"].shape == (1,)  # the Box target; the Discrete mode is one-hot
    assert float(weights["obs_stats.count"]) == pytest.approx(1e-4 + 128 + 4)  # every obs, once
    result = run_script("--eval", run_dir, "--eval-episodes", 3, "--greedy", "--device", "cpu")
    assert result.returncode == 0 and "over 3 episodes (greedy actions)" in result.stdout, result.stderr


def test_a_checkpoint_of_the_earlier_hand_written_adam_and_normalizer_resumes_as_the_same_learner(tmp_path):
    # Before torch.optim.Adam and the Model's `obs_stats`, a checkpoint held {"steps", "lr", "exp_avg",
    # "exp_avg_sq"} and the statistics apart ("normalizer"): resumed, it trains on exactly as today's.
    ps.Main(small_config(tmp_path, env="TestHybrid-v0", scale_rewards=False)).run()  # into tmp_path / "run"
    (tmp_path / "run").rename(tmp_path / "new")
    checkpoint = torch.load(tmp_path / "new" / "checkpoint.pt", weights_only=True)
    optimizer, weights = checkpoint["optimizer"], checkpoint["model"]
    moments = [optimizer["state"][i] for i in range(len(optimizer["state"]))]
    # ... and before the rewards were scaled: no return_stats, no --scale-rewards (it resumes unscaled).
    config = {key: value for key, value in checkpoint["config"].items() if key != "scale_rewards"}
    old = {**checkpoint, "config": config,
           "model": {k: v for k, v in weights.items() if not k.startswith(("obs_stats.", "return_stats."))},
           "normalizer": {"obs": {key: weights[f"obs_stats.{key}"] for key in ("count", "mean", "var")}},
           "optimizer": {"steps": int(moments[0]["step"]), "lr": optimizer["param_groups"][0]["lr"],
                         "exp_avg": [m["exp_avg"] for m in moments], "exp_avg_sq": [m["exp_avg_sq"] for m in moments]}}
    (tmp_path / "old").mkdir()
    torch.save(old, tmp_path / "old" / "checkpoint.pt")
    for folder in ("new", "old"):
        ps.Main(ps.Config(resume=str(tmp_path / folder), total_timesteps=256, device="cpu")).run()
    new, resumed = (torch.load(tmp_path / folder / "checkpoint.pt", weights_only=True) for folder in ("new", "old"))
    assert resumed["global_step"] == new["global_step"] == 256 and "normalizer" not in resumed
    assert resumed["config"]["scale_rewards"] is False and float(resumed["model"]["return_stats.count"]) == 1e-4
    assert all(torch.equal(resumed["model"][key], value) for key, value in new["model"].items())
    for mine, theirs in zip(resumed["optimizer"]["state"].values(), new["optimizer"]["state"].values()):
        assert all(torch.equal(mine[key], theirs[key]) for key in ("step", "exp_avg", "exp_avg_sq"))
    torch.save(old, tmp_path / "old" / "checkpoint.pt")  # --eval reads the old form too
    played = ps.evaluate_checkpoint(ps.Config(eval=str(tmp_path / "old"), eval_episodes=2, device="cpu"))
    assert played["episodes"] == 2


@pytest.mark.parametrize("args,line", [
    (["--env", "spaces_envs:TestFlawedDtype-v0"],
     "error: spaces_envs:TestFlawedDtype-v0 does not keep to its spaces: step 3's observation['position'] has "
     "dtype float64, not float32 (--no-check-env skips this check)"),
    (["--env", "spaces_envs:TestTextAction-v0"],
     "error: spaces_envs:TestTextAction-v0's action space has a Text space: this script handles Box, Discrete, "
     "MultiDiscrete and MultiBinary leaves in Dict and Tuple nests, and no script of this library handles "
     "other actions"),
    (["--env", "spaces_envs:TestFlawedStart-v0"],  # gymnasium's own warnings do not come first
     "error: spaces_envs:TestFlawedStart-v0 does not keep to its spaces: reset()'s observation['position'] has "
     "dtype float64, not float32 (--no-check-env skips this check)"),
    (["--env", "Taxi-v9"], "error: unknown env 'Taxi-v9'; did you mean Taxi-v4?"),
    (["--env", "MiniGrid-DoorKey-5x5-v0"], "error: MiniGrid-DoorKey-5x5-v0 comes with minigrid: pip install "
     "minigrid, then give --env minigrid:MiniGrid-DoorKey-5x5-v0 (the module registers it)"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, line):
    assert error_line(run_script(*SMALL, "--run-dir", tmp_path / "run", *args)) == line
    assert not (tmp_path / "run").exists()


def test_ctrl_c_in_worker_processes_saves_a_checkpoint_and_the_summary(tmp_path):
    run_dir = tmp_path / "run"
    process = subprocess.Popen(
        [sys.executable, "ppo_spaces.py", "--env", "spaces_envs:TestGrid-v0", "--num-workers", "2",
         *map(str, SMALL), "--total-timesteps", str(10 ** 8), "--checkpoint-every", "128", "--run-dir", str(run_dir)],
        cwd=ROOT, env=ENVIRON, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 60
    while not (run_dir / "checkpoint.pt").exists():
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.1)
    workers = children(process.pid)
    assert len(workers) >= 2  # the workers (and multiprocessing's resource tracker)
    os.killpg(process.pid, signal.SIGINT)  # a terminal's Ctrl-C reaches the whole group
    process.communicate(timeout=30)
    assert process.returncode == 128 + signal.SIGINT
    assert wait_until_gone(workers)
    summary = json.loads((run_dir / "summary.json").read_text())
    checkpoint = torch.load(run_dir / "checkpoint.pt", weights_only=True)
    assert summary["interrupted"] is True and summary["steps"] == checkpoint["global_step"] > 0


def test_the_minibatches_follow_the_observation_kind_unless_given(tmp_path, capsys):
    # None: 4 minibatches with an image leaf (TestCodeGrid-v0's 0-255 image), 16 without (Taxi's Discrete),
    # named at start-up; a value given wins and is a setting like any other.
    assert ps.Config().num_minibatches is None
    for env, expected in (("TestCodeGrid-v0", 4), ("Taxi-v4", 16)):
        main = ps.Main(ps.Config(env=env, num_envs=4, num_steps=16, total_timesteps=64, device="cpu",
                                 run_dir=str(tmp_path / env)))
        main.run()
        assert main.config.num_minibatches == main.trainer.config.num_minibatches == expected
        assert torch.load(tmp_path / env / "checkpoint.pt", weights_only=True)["config"]["num_minibatches"] == expected
        out = capsys.readouterr().out
        assert f"minibatches: {expected}, the default for this observation's kind (4 with an image" in out
        assert "--num-minibatches" not in out.split("settings: ")[1].splitlines()[0]
    given = ps.Main(small_config(tmp_path / "given", env="TestCodeGrid-v0", num_minibatches=2))
    given.run()
    out = capsys.readouterr().out
    assert given.config.num_minibatches == 2 and "--num-minibatches 2" in out and "minibatches: " not in out
    lesson = ps.Main(ps.Config(env="TestCodeGrid-v0", num_envs=4, num_steps=16, total_timesteps=64, device="cpu"))
    lesson.train(ps.Run)  # the lesson's plain run applies the same default
    assert lesson.config.num_minibatches == 4


def test_a_rollout_the_default_minibatches_cannot_split_is_refused_in_one_line():
    # 4 x 3 = 12 steps: Taxi's default of 16 minibatches cannot split them.
    line = error_line(run_script("--num-envs", 4, "--num-steps", 3, "--device", "cpu"))
    assert line == "error: the batch of 12 steps (--num-envs x --num-steps) does not split into --num-minibatches 16"


# ----- an env that breaks its spaces after the start-up check's 100 steps ---------------------------

# 4 games of 32 steps a rollout: each game's 150th step, the run's 600th, falls in the 5th rollout.
LATE = [*SMALL, "--total-timesteps", 1024, "--checkpoint-every", 128, "--no-anneal-lr"]


@pytest.mark.parametrize("env_id,workers,problem", [
    ("TestLateShape-v0", 0, "the observation['position'] has shape (3,), not (2,)"),
    ("TestLateKey-v0", 2, "the observation has the keys ['position'], not the keys ['count', 'position']"),
    ("TestLateBounds-v0", 0, "the observation['count'] = 5 is outside Discrete(3)"),
    ("TestEmptyMaskInInfo-v0", 0, "its action mask forbids all 3 choices of action"),
    ("TestEmptyMaskInObservation-v0", 2, "its action mask forbids all 3 choices of action"),
])
def test_an_env_that_breaks_its_spaces_later_stops_the_run_in_one_line_keeping_the_checkpoint(
        tmp_path, env_id, workers, problem):
    result = run_script("--env", f"spaces_envs:{env_id}", *LATE, "--num-workers", workers,
                        "--run-dir", tmp_path / "run")
    lines = result.stderr.splitlines()
    assert result.returncode == 2 and len(lines) == 1, (result.returncode, lines[-20:])
    assert lines[0] == (f"error: spaces_envs:{env_id} broke its spaces in env 0 at step 600 of the run "
                        f"(step 150 of its episode): {problem}; the checkpoint of the last finished "
                        f"update is kept")
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    checkpoint = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)
    assert summary["steps"] == checkpoint["global_step"] == 512 and checkpoint["updates"] == 4


def test_the_checkpoint_kept_is_the_last_finished_update_s_and_resumes(tmp_path):
    broken = run_script("--env", "spaces_envs:TestLateKey-v0", *LATE, "--run-dir", tmp_path / "broken")
    assert broken.returncode == 2, broken.stderr[-3000:]
    whole = run_script("--env", "spaces_envs:TestLateKey-v0", *LATE, "--total-timesteps", 512,
                       "--run-dir", tmp_path / "whole")  # 4 updates, 149 steps a game: no break
    assert whole.returncode == 0, whole.stderr[-3000:]
    kept, stopped = (torch.load(tmp_path / name / "checkpoint.pt", weights_only=True) for name in ("broken", "whole"))
    assert all(torch.equal(kept["model"][key], value) for key, value in stopped["model"].items())
    for mine, theirs in zip(kept["optimizer"]["state"].values(), stopped["optimizer"]["state"].values()):
        assert all(torch.equal(mine[key], theirs[key]) for key in ("step", "exp_avg", "exp_avg_sq"))
    assert torch.equal(kept["rng"]["torch"], stopped["rng"]["torch"])
    # Resumed, its games start afresh: they break at their 150th step again, the run's 512 + 600th.
    resumed = run_script("--resume", tmp_path / "broken", "--total-timesteps", 2048, "--device", "cpu")
    assert resumed.returncode == 2 and resumed.stderr.splitlines() == [
        "error: spaces_envs:TestLateKey-v0 broke its spaces in env 0 at step 1,112 of the run (step 150 of "
        "its episode): the observation has the keys ['position'], not the keys ['count', 'position']; the "
        "checkpoint of the last finished update is kept"], resumed.stderr[-3000:]


def test_no_check_env_skips_the_check(tmp_path):
    config = small_config(tmp_path, env="TestFlawedDtype-v0", check_env=False)
    assert ps.Main(config).run()["steps"] == 128  # float64 numbers fit the float32 observation


def test_help_lists_the_spaces_flags():
    result = run_script("--help")
    assert result.returncode == 0
    for flag in ("--action-mask", "--no-action-mask", "--check-env", "--no-check-env"):
        assert flag in result.stdout


def test_under_torchrun_two_ranks_train_one_policy(tmp_path):
    args = ["--env", "spaces_envs:TestHybrid-v0", "--num-envs", 4, "--num-steps", 16, "--num-minibatches", 2,
            "--total-timesteps", 256, "--device", "cpu", "--run-dir", tmp_path]
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                             "ppo_spaces.py", *map(str, args)],
                            cwd=ROOT, env=ENVIRON, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 256
    checkpoint = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    # Both ranks' observations merged into one set of statistics: 2 ranks x 4 games x (2 x 16 + 1);
    # their discounted returns too (2 ranks x 4 games x 32 steps); the ranks' weights are checked equal.
    assert float(checkpoint["model"]["obs_stats.count"]) == pytest.approx(1e-4 + 2 * 4 * 33)
    assert float(checkpoint["model"]["return_stats.count"]) == pytest.approx(1e-4 + 2 * 4 * 32)


def test_pasted_into_a_notebook_cell_it_defines_everything_and_starts_nothing(tmp_path):
    namespace = {"__name__": "__main__"}  # a notebook cell: no __file__
    exec(compile((ROOT / "ppo_spaces.py").read_text(), "<cell>", "exec"), namespace)
    assert not (tmp_path / "run").exists()
    summary = namespace["Main"](namespace["Config"](env="TestHybrid-v0", num_envs=4, num_steps=16,
                                                    total_timesteps=64, run_dir=str(tmp_path / "run"))).run()
    assert summary["steps"] == 64


def test_the_lesson_alone_cut_at_the_banner_trains_with_its_plain_run(tmp_path, capsys):
    source = (ROOT / "ppo_spaces.py").read_text()
    lesson = source[:source.index("\n# ==== Below")]
    namespace = {"__name__": "lesson"}
    exec(compile(lesson, "lesson", "exec"), namespace)
    assert "RunGuard" not in namespace and "inspect_env" not in namespace
    config = namespace["Config"](env="TestHybrid-v0", num_envs=4, num_workers=2, num_steps=16, total_timesteps=128)
    main = namespace["Main"](config)
    summary = main.run()
    assert {"script", "env", "seed", "steps", "seconds", "episodes", "mean_return_100", "solved_step"} <= set(summary)
    assert summary["steps"] == 128 and summary["episodes"] == 128  # one step an episode
    assert float(main.model.obs_stats.count) == pytest.approx(1e-4 + 128 + 4)  # normalised in the lesson
    assert "step 128 | " in capsys.readouterr().out  # the plain run's progress line
    assert not main.games.process.is_alive()  # the plain run's one Worker (all games) is closed
    with pytest.raises(NotImplementedError, match="--eval plays a checkpoint"):
        namespace["Main"](namespace["Config"](eval=str(tmp_path))).run()


# ----- learning --------------------------------------------------------------------------------------


def test_learns_a_hybrid_action_to_within_5_percent_of_the_optimum(tmp_path):
    # The optimum is 1 (the right choice, the parameter on the target); a random policy gets about 0.1.
    # The defaults, those Taxi and MiniGrid learn with (seeds 1-3 sample 0.946-0.953 at 30k steps).
    config = ps.Config(env="TestHybrid-v0", seed=1, total_timesteps=30_000, device="cpu", run_dir=str(tmp_path))
    summary = ps.Main(config).run()
    assert summary["mean_return_100"] >= 0.9  # sampled, the Gaussian's spread included
    played = ps.evaluate_checkpoint(ps.Config(eval=str(tmp_path), eval_episodes=200, greedy=True, device="cpu"))
    assert played["mean_return"] >= 0.95, played["mean_return"]  # the most likely choice, the mean parameter


def test_learns_a_multibinary_action_and_plays_pendulum_s_box_action(tmp_path):
    # TestCopyBits-v0 (tests/conftest.py): copy 4 bits; the optimum is 1, a random policy gets 0.5.
    summary = ps.Main(ps.Config(env="TestCopyBits-v0", total_timesteps=20_000, num_envs=16, num_steps=32,
                                device="cpu", run_dir=str(tmp_path / "bits"))).run()
    assert summary["mean_return_100"] >= 0.95, summary
    pendulum = ps.Main(small_config(tmp_path / "pendulum", env="Pendulum-v1", total_timesteps=256)).run()
    assert pendulum["steps"] == 256 and pendulum["episodes"] == 0  # (200 steps an episode; 4 games)


def test_learns_from_an_image_of_small_codes_as_minigrid_s(tmp_path):
    # TestCodeGrid-v0 (tests/spaces_envs.py): the lit cell of a 0-255 image holds code 2; its action pays 1 a
    # step, 5 steps an episode: the optimum is 5, random play 5/3. Standardised, the code stands out: the
    # defaults learn it (divided by 255 instead, as before, the return stays near 5/3 in this budget).
    summary = ps.Main(ps.Config(env="TestCodeGrid-v0", seed=1, total_timesteps=16_384, target_return=4.5,
                                device="cpu", run_dir=str(tmp_path))).run()
    assert summary["solved_step"] is not None, summary


def test_the_defaults_learn_minigrid_s_empty_room_from_its_7x7_view_read_whole(tmp_path):
    import minigrid  # noqa: F401  (requirements-dev.txt; the benchmark's env)

    # Reach the goal square from a random start: 1 - 0.9 * steps / 144 on reaching it; random play gets about
    # 0.28. The 7x7x3 view (a side under 16) goes whole to the linear layer; the defaults' 16 x 32-step
    # rollouts, in 4 minibatches of 128 with an image, learn it in about 5,000 steps (benchmarks/README.md).
    config = ps.Config(env="minigrid:MiniGrid-Empty-Random-6x6-v0", seed=1, total_timesteps=20_000,
                       target_return=0.9, device="cpu", run_dir=str(tmp_path))
    main = ps.Main(config)
    summary = main.run()
    assert not any(isinstance(module, torch.nn.Conv2d) for module in main.model.modules())
    assert summary["solved_step"] is not None, summary


def test_the_defaults_learn_minigrid_s_doorkey_from_its_whole_dict_observation(tmp_path):
    import minigrid  # noqa: F401

    # Pick up the key, open the door, reach the goal: 1 - 0.9 * steps / 250; random play gets about 0.02. The
    # image and the direction read, the mission left out; the defaults (4 minibatches with an image) reached a
    # 100-episode mean of 0.9 at 13,376 steps on seed 3, and by 57,856 on every seed of 1-10 (benchmarks/README.md).
    config = ps.Config(env="minigrid:MiniGrid-DoorKey-5x5-v0", seed=3, total_timesteps=300_000,
                       target_return=0.9, device="cpu", run_dir=str(tmp_path))
    summary = ps.Main(config).run()
    assert summary["solved_step"] is not None and summary["solved_step"] <= 60_000, summary


def test_the_default_taxi_with_its_masks_reaches_a_mean_return_of_7(tmp_path):
    # The optimum is about 8 (20 for the drop-off, -1 a step); a random policy gets about -200 even with masks
    # (it drives until the time limit).
    summary = ps.Main(ps.Config(seed=1, target_return=7, total_timesteps=150_000, device="cpu",
                                run_dir=str(tmp_path))).run()
    assert summary["solved_step"] is not None, summary  # the mean of 100 episodes reached 7 at that step

