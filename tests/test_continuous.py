"""ppo_continuous.py: the pieces against hand-computed or reference values (gymnasium's Pendulum,
torch.distributions), then runs through the API and the command line: the running statistics in
checkpoints, --eval and --resume, bad input, learning, reproducibility, Ctrl-C and torchrun."""
import json
import math
import os
import signal
import subprocess
import sys
import time
import types

import gymnasium as gym
import numpy as np
import pytest
import torch

import ppo_continuous as pc
from conftest import ROOT, assert_numpy_learner_steps_as_the_lesson, children, wait_until_gone

CPU = torch.device("cpu")
SMALL = dict(num_envs=4, num_steps=32, num_minibatches=2, update_epochs=2, device="cpu")
BATCH = 4 * 32


# Generous limits: they catch a hang, not slowness (a loaded machine starts torch slowly).
def run_script(*args, timeout=600):
    return subprocess.run([sys.executable, "ppo_continuous.py", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def checkpoint_of(run_dir):
    return torch.load(run_dir / "checkpoint.pt", weights_only=True)


# ----- the torch Pendulum against gymnasium's ------------------------------------------------------


def test_torch_pendulum_steps_like_gymnasium_from_the_same_states():
    env = gym.make("Pendulum-v1")
    env.reset(seed=0)
    rng = np.random.default_rng(0)
    # Angles beyond +-pi (never wrapped), speeds near and at the +-8 limit, torques beyond +-2.
    states = np.column_stack([rng.uniform(-12, 12, 64), rng.uniform(-8, 8, 64)])
    states[:4, 1] = [7.9, -7.9, 8.0, -8.0]
    torques = rng.uniform(-4, 4, 64).astype(np.float32)
    engine = pc.TorchPendulum(64, seed=0, device=CPU)
    engine.state = torch.tensor(states)
    result = engine.step(torch.from_numpy(torques)[:, None])
    for i in range(64):
        env.unwrapped.state = states[i].copy()
        obs, reward, terminated, truncated, _ = env.step(torques[i:i + 1])
        assert np.allclose(result.final_obs[i].numpy(), obs, atol=1e-6), i
        assert np.allclose(engine.observations()[i].numpy(), obs, atol=1e-6), i
        assert np.allclose(engine.state[i].numpy(), env.unwrapped.state, rtol=1e-6, atol=1e-7), i
        assert result.rewards[i].item() == pytest.approx(reward, rel=1e-5, abs=1e-6), i
        assert not result.terminated[i] and not result.truncated[i] and not terminated
    assert (engine.state[:, 1].abs() <= 8).all() and engine.state[:, 1].abs().max() == 8
    assert engine.state[:, 0].abs().max() > math.pi  # the angle is not wrapped


def test_torch_pendulum_truncates_at_200_steps_and_restarts_in_the_same_step():
    assert gym.spec("Pendulum-v1").max_episode_steps == pc.TorchPendulum.MAX_EPISODE_STEPS == 200
    engine = pc.TorchPendulum(512, seed=3, device=CPU)
    for start in (engine.state,):
        assert (start[:, 0].abs() <= math.pi).all() and (start[:, 1].abs() <= 1).all()
        assert start[:, 0].min() < -3 and start[:, 0].max() > 3  # th ~ U(-pi, pi)
        assert start[:, 1].min() < -0.95 and start[:, 1].max() > 0.95  # thdot ~ U(-1, 1)
    returns = torch.zeros(512, dtype=torch.float64)
    for step in range(1, 201):
        before = engine.state.clone()
        result = engine.step(torch.zeros(512, 1))
        returns += result.rewards.double()
        assert bool(result.truncated.all()) == (step == 200) and not result.terminated.any()
    assert (result.episode_lengths == 200).all()
    assert torch.allclose(result.episode_returns, returns, rtol=1e-5)
    # The last observation of the ended episode is where its state went (by hand, torque 0),
    # the new one a fresh start.
    theta_dot = (before[:, 1] + 15 * before[:, 0].sin() * 0.05).clamp(-8, 8)
    theta = before[:, 0] + theta_dot * 0.05
    expected_last = torch.stack([theta.cos(), theta.sin(), theta_dot], 1).float()
    assert torch.allclose(result.final_obs, expected_last, atol=1e-6)
    assert not torch.allclose(engine.observations(), expected_last, atol=0.1)
    assert (engine.state[:, 1].abs() <= 1).all() and (engine.steps == 0).all()
    assert not engine.step(torch.zeros(512, 1)).truncated.any()


def test_each_games_physics_steps_like_gymnasiums_pendulum_with_the_same_parameters():
    # All six parameters drawn per game; gymnasium's Pendulum-v1 takes g (gym.make's g=), and its
    # step reads the others from the env, set here. Torques up to +-4 meet each game's own bound.
    physics = {"g": (0.0, 20.0), "m": (0.5, 2.0), "l": (0.5, 2.0), "max_speed": (2.0, 10.0),
               "max_torque": (0.5, 2.0), "dt": (0.01, 0.1)}
    engine = pc.TorchPendulum(64, seed=0, device=CPU, physics=physics)
    for name, (low, high) in physics.items():
        drawn = getattr(engine, name)
        assert drawn.shape == (64,) and low <= drawn.min() < drawn.max() < high, name
    rng = np.random.default_rng(0)
    states = np.column_stack([rng.uniform(-12, 12, 64), rng.uniform(-10, 10, 64)])
    torques = rng.uniform(-4, 4, 64).astype(np.float32)
    engine.state = torch.tensor(states)
    result = engine.step(torch.from_numpy(torques)[:, None])
    for i in range(64):
        # (gymnasium's declared spaces hold its max_speed of 8: no checker warning at 10)
        env = gym.make("Pendulum-v1", g=engine.g[i].item(), disable_env_checker=True)
        env.reset(seed=0)
        for name in ("m", "l", "max_speed", "max_torque", "dt"):
            setattr(env.unwrapped, name, getattr(engine, name)[i].item())
        env.unwrapped.state = states[i].copy()
        obs, reward, _, _, _ = env.step(torques[i:i + 1])
        assert np.allclose(result.final_obs[i].numpy(), obs, atol=1e-6), i
        assert np.allclose(engine.state[i].numpy(), env.unwrapped.state, rtol=1e-6, atol=1e-7), i
        assert result.rewards[i].item() == pytest.approx(reward, rel=1e-5, abs=1e-6), i
    assert (engine.state[:, 1].abs() == engine.max_speed).any()  # some games at their own bound
    assert (engine.state[:, 1].abs() <= engine.max_speed).all()


def test_ranges_are_drawn_per_game_at_each_reset_and_fixed_values_draw_nothing():
    engine = pc.TorchPendulum(512, seed=3, device=CPU, physics={"g": (6.0, 14.0), "m": (1.2, 1.2)})
    first_g = engine.g.clone()
    assert 6 <= first_g.min() < 6.1 and 13.9 < first_g.max() < 14 and len(first_g.unique()) == 512
    assert (engine.m == 1.2).all() and (engine.l == 1.0).all() and (engine.dt == 0.05).all()
    engine.steps[:256] = 100  # the first half of the games ends its episodes 100 steps sooner
    for _ in range(100):
        engine.step(torch.zeros(512, 1))
    assert (engine.g[:256] != first_g[:256]).all() and torch.equal(engine.g[256:], first_g[256:])
    assert 6 <= engine.g.min() and engine.g.max() < 14 and (engine.m == 1.2).all()
    torch.testing.assert_close(engine.gravity_gain, 3 * engine.g / 2, rtol=0, atol=0)
    second_g = engine.g.clone()
    for _ in range(100):
        engine.step(torch.zeros(512, 1))
    assert (engine.g[256:] != second_g[256:]).all() and torch.equal(engine.g[:256], second_g[:256])
    # Fixed values, gymnasium's or not, draw nothing: the starting states are those of gymnasium's
    # physics, from the same generator's stream.
    fixed, default = (pc.TorchPendulum(512, seed=3, device=CPU, physics=physics)
                      for physics in ({"g": (12.0, 12.0), "dt": (0.02, 0.02)}, None))
    for _ in range(201):
        fixed.step(torch.zeros(512, 1))
        default.step(torch.zeros(512, 1))
    assert torch.equal(fixed.generator.get_state(), default.generator.get_state())
    assert not torch.equal(fixed.state, default.state) and (fixed.g == 12).all()


def test_gymnasiums_physics_given_or_not_steps_bit_for_bit_as_gymnasiums_formula():
    # The step's float64 arithmetic is gymnasium's, in its order: with gymnasium's values, given or
    # not, it gives the bits of gymnasium's formula on Python numbers (the engine before --physics).
    rng = np.random.default_rng(1)
    states = torch.tensor(np.column_stack([rng.uniform(-12, 12, 64), rng.uniform(-8, 8, 64)]))
    torques = torch.from_numpy(rng.uniform(-4, 4, (64, 1)).astype(np.float32))
    theta, theta_dot = states.unbind(1)
    u = torques[:, 0].double().clamp(-2.0, 2.0)
    theta_dot = (theta_dot + (3 * 10.0 / (2 * 1.0) * theta.sin() + 3.0 / (1.0 * 1.0 ** 2) * u)
                 * 0.05).clamp(-8.0, 8.0)
    expected = torch.stack([theta + theta_dot * 0.05, theta_dot], dim=1)
    for physics in (None, {"g": (10.0, 10.0), "dt": (0.05, 0.05)}, {"g": (10.5, 10.5)}):
        engine = pc.TorchPendulum(64, seed=0, device=CPU, physics=physics)
        engine.state = states.clone()
        engine.step(torques)
        assert torch.equal(engine.state, expected) == (physics != {"g": (10.5, 10.5)}), physics


def test_the_spec_check_passes_the_torch_pendulum_and_catches_a_wrong_one():
    env = gym.make("Pendulum-v1")
    pc.check_env_specs(pc.TorchPendulum(4, 0, CPU), 4, env.observation_space, env.action_space)
    # With gymnasium's physics the engine declares gymnasium's spaces, and its documented worst
    # reward, -(pi^2 + 0.1 * 8^2 + 0.001 * 2^2); with its own, the bounds its games can reach.
    default = pc.TorchPendulum(4, 0, CPU)
    assert default.observation_space == env.observation_space
    assert default.reward_range == (pytest.approx(-16.2736044), 0.0)
    faster = pc.TorchPendulum(4, 0, CPU, {"max_speed": (4.0, 12.0), "max_torque": (1.0, 1.0)})
    assert faster.observation_space.high.tolist() == [1, 1, 12]
    assert faster.reward_range == (pytest.approx(-(math.pi ** 2 + 14.4 + 0.001)), 0.0)
    pc.check_env_specs(faster, 4, faster.observation_space, env.action_space)

    class Float64Rewards(pc.TorchPendulum):
        def step(self, actions):
            return super().step(actions)._replace(rewards=torch.zeros(4, dtype=torch.float64))

    with pytest.raises(RuntimeError, match="a reward has dtype torch.float64"):
        pc.check_env_specs(Float64Rewards(4, 0, CPU), 4, env.observation_space, env.action_space)

    unclipped = pc.TorchPendulum(4, 0, CPU, {"max_speed": (100.0, 100.0)})
    with pytest.raises(RuntimeError, match="out of bounds"):
        pc.check_env_specs(unclipped, 4, env.observation_space, env.action_space)


# ----- the Gaussian policy -------------------------------------------------------------------------


def test_gaussian_log_prob_and_entropy_match_torch_distributions():
    torch.manual_seed(0)
    model = pc.Model(obs_size=5, action_size=3)
    with torch.no_grad():
        model.log_std.copy_(torch.tensor([[-0.5, 0.0, 0.7]]))
    obs, actions = torch.randn(10, 5), 3 * torch.randn(10, 3)
    log_prob, entropy, value = model.evaluate_actions(obs, actions)
    normal = torch.distributions.Normal(model.actor(obs), model.log_std.exp())
    assert torch.allclose(log_prob, normal.log_prob(actions).sum(-1), atol=1e-5)
    assert torch.allclose(entropy, normal.entropy().sum(-1), atol=1e-6)
    assert torch.equal(value, model.critic(obs).squeeze(-1))
    sampled, sampled_log_prob, _ = model.act(obs)
    assert torch.allclose(sampled_log_prob, normal.log_prob(sampled).sum(-1), atol=1e-5)
    greedy, _, _ = model.act(obs, greedy=True)
    assert torch.equal(greedy, model.actor(obs))
    assert torch.equal(pc.Model(5, 3).log_std, torch.zeros(1, 3))  # sigma starts at 1


# ----- the loss, by hand -------------------------------------------------------------------------


# A minibatch of 3 steps with advantages 1, 2, 3 and probability ratios 1, 1.5, 0.5 (clip 0.2). Normalised
# per minibatch (37 details, #7) the advantages are -1, 0, 1 (mean 2, std 1), and the clipped surrogate,
# -min(rho A, clip(rho) A) per step, is: step 0: -min(-1, -1) = 1; step 1: 0; step 2: -min(0.5, 0.8) = -0.5;
# its mean 0.5 / 3. Unnormalised it would be -(1 + 2.4 + 1.5) / 3 = -1.633 (step 1: -min(3, 2.4) = -2.4).
ADVANTAGES, RATIOS = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1.0, 1.5, 0.5])
POLICY_LOSS = 0.5 / 3
APPROX_KL = ((1.5 - 1 - math.log(1.5)) + (0.5 - 1 - math.log(0.5))) / 3  # mean of (rho - 1) - log rho
CLIP_FRACTION = 2 / 3  # |rho - 1| > 0.2 at steps 1 and 2


def test_the_lessons_ppo_loss_against_hand_computed_values():
    config = pc.Config(clip_coef=0.2, ent_coef=0.01, vf_coef=0.5, clip_value_loss=False)
    new_log_probs = torch.tensor([-1.0, -2.0, -0.5])
    new_values, returns = torch.tensor([0.5, 1.0, -1.0]), torch.tensor([1.5, 0.0, 1.0])
    minibatch = pc.Minibatch(torch.zeros(3, 2), torch.zeros(3, 1), new_log_probs - RATIOS.log(),
                             ADVANTAGES, returns, torch.zeros(3))
    entropy = torch.tensor([1.0, 2.0, 3.0])  # mean 2
    loss, stats = pc.Trainer.ppo_loss(minibatch, new_log_probs, entropy, new_values, config)
    value_loss = 0.5 * (1 + 1 + 4) / 3  # half the mean squared error to the returns: 1
    assert stats["policy_loss"].item() == pytest.approx(POLICY_LOSS, rel=1e-6)
    assert stats["value_loss"].item() == pytest.approx(value_loss, rel=1e-6)
    assert stats["entropy"].item() == pytest.approx(2.0)
    assert stats["approx_kl"].item() == pytest.approx(APPROX_KL, rel=1e-5)
    assert stats["clip_fraction"].item() == pytest.approx(CLIP_FRACTION)
    assert loss.item() == pytest.approx(POLICY_LOSS - 0.01 * 2.0 + 0.5 * value_loss, rel=1e-6)


def test_the_numpy_learners_loss_against_the_same_hand_computed_values():
    # NumpyLearner computes the loss from the model itself: its minibatch gets the old log-probabilities
    # that give these ratios, and returns 1, -1, 2 away from the values (value loss 0.5 * 6 / 3 = 1).
    torch.manual_seed(0)
    model = pc.Model(2, 1)
    config = pc.with_preset(pc.Config(clip_coef=0.2, ent_coef=0.01, vf_coef=0.5))  # (Pendulum's)
    obs, actions = torch.randn(3, 2), torch.randn(3, 1)
    with torch.no_grad():
        new_log_probs, _, values = model.evaluate_actions(obs, actions)
    minibatch = pc.Minibatch(obs, actions, new_log_probs - RATIOS.log(), ADVANTAGES,
                             values + torch.tensor([1.0, -1.0, 2.0]), values)
    learner = pc.NumpyLearner(types.SimpleNamespace(model=model, trainer=pc.Trainer(model, config, pc.Adam),
                                                    config=config))
    stats = learner.gradient_step(minibatch)  # the diagnostics of the loss before the step
    assert stats["policy_loss"].item() == pytest.approx(POLICY_LOSS, rel=1e-5)
    assert stats["value_loss"].item() == pytest.approx(1.0, rel=1e-5)
    assert stats["entropy"].item() == pytest.approx(0.5 + 0.5 * math.log(2 * math.pi))  # sigma 1
    assert stats["approx_kl"].item() == pytest.approx(APPROX_KL, rel=1e-4)
    assert stats["clip_fraction"].item() == pytest.approx(CLIP_FRACTION)


# ----- running statistics ---------------------------------------------------------------------------


def test_running_mean_std_against_hand_computed_values():
    stats = pc.RunningMeanStd((1,), CPU)  # the prior: count 1e-4, mean 0, var 1
    stats.update(torch.tensor([[1.0], [3.0]]))
    n = 1e-4 + 2
    mean = 2 * 2 / n  # delta 2, n_b 2
    var = (1e-4 * 1 + 2 * 1 + 2 ** 2 * 1e-4 * 2 / n) / n  # M2_a + M2_b + delta^2 n_a n_b / n
    assert stats.count == pytest.approx(n)
    assert stats.mean.item() == pytest.approx(mean, rel=1e-12)
    assert stats.var.item() == pytest.approx(var, rel=1e-12)


def test_merging_two_halves_gives_the_statistics_of_the_union():
    data = torch.randn(1000, 3, dtype=torch.float64) * torch.tensor([1.0, 10.0, 0.1]) + 5
    first, second = (pc.RunningMeanStd((3,), CPU, count=0.0, var=0.0) for _ in range(2))
    for chunk in data[:300].split(7):
        first.update(chunk)
    second.update(data[300:])
    first.merge(second.count, second.mean, second.var)
    assert first.count == 1000
    assert torch.allclose(first.mean, data.mean(0), rtol=1e-12)
    assert torch.allclose(first.var, data.var(0, correction=0), rtol=1e-10)


def test_observations_are_normalised_then_clipped():
    stats = pc.RunningMeanStd((2,), CPU)
    obs = torch.tensor([[1.0, 100.0], [2.0, 100.0], [3.0, -1000.0]])
    out = stats.normalize(obs, clip=1.0)
    expected = ((obs.double() - stats.mean) / torch.sqrt(stats.var + 1e-8)).clamp(-1, 1)
    assert torch.allclose(out, expected.float()) and out.dtype == torch.float32
    assert out[2, 1] == -1.0 and stats.count == pytest.approx(3 + 1e-4)
    frozen = stats.normalize(obs, clip=1.0, update=False)
    assert torch.equal(frozen, out) and stats.count == pytest.approx(3 + 1e-4)


def test_reward_scaling_restarts_the_return_at_every_episode_end_truncation_included():
    return_stats, returns = pc.RunningMeanStd((), CPU), torch.zeros(1, dtype=torch.float64)
    rewards = [1.0, 2.0, 4.0]
    ended = [False, True, False]  # the 2nd step ends an episode (Pendulum: always by truncation)
    # By hand: R = 1, then 0.5 * 1 + 2 = 2.5 (the episode ends: R restarts), then 4 (not 5.25).
    count, mean, var = 1e-4, 0.0, 1.0
    for reward, end, running_return in zip(rewards, ended, [1.0, 2.5, 4.0]):
        total = count + 1
        delta = running_return - mean
        mean, var = mean + delta / total, (var * count + delta ** 2 * count / total) / total
        count = total
        scaled = return_stats.scale(torch.tensor([reward]), returns, torch.tensor([end]),
                                    gamma=0.5, clip=1.5)
        assert scaled.item() == pytest.approx(min(reward / math.sqrt(var + 1e-8), 1.5), rel=1e-6)
        assert return_stats.mean.item() == pytest.approx(mean, rel=1e-9)
        assert returns.item() == (0.0 if end else running_return)
    assert scaled.item() == 1.5  # the last one was clipped


# ----- inside a run -----------------------------------------------------------------------------------


@pytest.mark.parametrize("numpy_on_cpu", [False, True])
def test_the_env_gets_clipped_actions_the_rollout_keeps_the_sampled_ones_and_ratio_starts_at_1(
        numpy_on_cpu, tmp_path, monkeypatch):
    sent, first_ratios = [], []
    game_step = pc.Game.step

    def spy_game_step(self, action):
        sent.append(torch.as_tensor(action).clone())
        return game_step(self, action)

    def spy(gradient_step):
        def spy_gradient_step(self, minibatch):
            if not first_ratios:  # before the first gradient step: the recomputed log-probabilities
                model = self.model if isinstance(self, pc.Trainer) else main.model
                new_log_probs, _, _ = model.evaluate_actions(minibatch.obs, minibatch.actions)
                first_ratios.append((new_log_probs - minibatch.old_log_probs).exp())
            return gradient_step(self, minibatch)
        return spy_gradient_step

    monkeypatch.setattr(pc.Game, "step", spy_game_step)
    monkeypatch.setattr(pc.Trainer, "gradient_step", spy(pc.Trainer.gradient_step))
    monkeypatch.setattr(pc.NumpyLearner, "gradient_step", spy(pc.NumpyLearner.gradient_step))
    main = pc.Main(pc.Config(total_timesteps=BATCH, run_dir=str(tmp_path),
                             numpy_on_cpu=numpy_on_cpu, **SMALL))
    main.run()
    assert isinstance(getattr(main.collect_rollout, "__self__", None), pc.NumpyPlayer) == numpy_on_cpu
    stored = main.rollout.actions  # [num_steps, num_envs, 1]
    assert len(sent) == 32 * 4 and (stored.abs() > 2).any()  # sigma 1: some samples beyond +-2
    assert torch.equal(torch.stack(sent).view(32, 4, 1), stored.clamp(-2, 2))
    assert torch.allclose(first_ratios[0], torch.ones_like(first_ratios[0]), atol=1e-5)


def test_the_checkpoint_holds_the_statistics_eval_freezes_them_and_resume_restores_them(
        tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    main = pc.Main(pc.Config(total_timesteps=2 * BATCH, run_dir=str(run_dir), **SMALL))
    main.run()
    checkpoint = checkpoint_of(run_dir)
    saved = checkpoint["normalizer"]
    # Every observation the policy was given counts: the first of each game, then one per step.
    assert saved["obs"]["count"].item() == pytest.approx(1e-4 + 4 * (1 + 2 * 32))
    assert torch.equal(saved["obs"]["mean"], main.model.obs_stats.mean)
    assert saved["return"]["count"].item() == pytest.approx(1e-4 + 2 * BATCH)

    # --eval normalises with the saved statistics, and never updates them.
    def no_update(self, batch):
        raise AssertionError("--eval updated the statistics")

    evaluate = dict(eval=str(run_dir / "checkpoint.pt"), eval_episodes=2, run_dir=str(tmp_path))
    with monkeypatch.context() as patch:
        patch.setattr(pc.RunningMeanStd, "update", no_update)
        first = pc.Main(pc.Config(**evaluate)).run()
        again = pc.Main(pc.Config(**evaluate)).run()
    assert first["returns"] == again["returns"] and first["episodes"] == 2
    checkpoint["normalizer"]["obs"]["mean"] += 0.5
    torch.save(checkpoint, tmp_path / "shifted.pt")
    shifted = pc.Main(pc.Config(**{**evaluate, "eval": str(tmp_path / "shifted.pt")})).run()
    assert shifted["returns"] != first["returns"]
    # Weights that do not fit the network (another version's) are refused in one line, not raised.
    del checkpoint["model"]["log_std"]
    torch.save(checkpoint, tmp_path / "misfit.pt")
    with pytest.raises(pc.UsageError, match="network does not fit .*log_std"):
        pc.Main(pc.Config(**{**evaluate, "eval": str(tmp_path / "misfit.pt")})).run()

    # --resume continues from the saved statistics.
    resumed = pc.Main(pc.Config(resume=str(run_dir / "checkpoint.pt"), total_timesteps=3 * BATCH))
    resumed.run()
    assert resumed.model.obs_stats.count == pytest.approx(1e-4 + 4 * (2 + 3 * 32))
    assert checkpoint_of(run_dir)["global_step"] == 3 * BATCH


@pytest.mark.parametrize("backend", ["game", "torch"])
def test_same_seed_same_weights_and_statistics_on_the_cpu(backend, tmp_path):
    def final(name, seed):
        config = pc.Config(seed=seed, total_timesteps=3 * BATCH, env_backend=backend,
                           run_dir=str(tmp_path / name), **SMALL)
        pc.Main(config).run()
        state = checkpoint_of(tmp_path / name)
        return {**state["model"], **{f"obs_{k}": v for k, v in state["normalizer"]["obs"].items()}}

    a, b, other = final("a", 3), final("b", 3), final("c", 4)
    assert a.keys() == b.keys() and all(torch.equal(a[key], b[key]) for key in a)
    assert not torch.equal(a["actor.0.weight"], other["actor.0.weight"])
    assert not torch.equal(a["obs_mean"], other["obs_mean"])


GYMNASIUMS = "g 10, m 1, l 1, max_speed 8, max_torque 2, dt 0.05 (gymnasium's)"
RANGED = ("g 6 to 14, m 1, l 1, max_speed 8, max_torque 2, dt 0.04 (ranges drawn per game at "
          "each reset)")


def test_checkpoints_keep_the_physics_for_resume_and_eval_and_a_typed_physics_wins(tmp_path,
                                                                                     capsys):
    run_dir = str(tmp_path / "run")

    def lines(*args, start="physics: "):  # a command line in this process: its lines `start...`
        assert pc.command_line([*map(str, args)]) == 0
        return [line for line in capsys.readouterr().out.splitlines() if line.startswith(start)]

    # Given in any order, told in gymnasium's, every parameter.
    assert lines("--env-backend", "torch", "--physics", "dt=0.04, g=6:14", "--total-timesteps",
                 BATCH, "--num-envs", 4, "--num-steps", 32, "--num-minibatches", 2,
                 "--device", "cpu", "--run-dir", run_dir) == [f"physics: {RANGED}"]
    assert checkpoint_of(tmp_path / "run")["config"]["physics"] == "dt=0.04, g=6:14"
    # --eval plays the checkpoint's physics (the torch Pendulum), or the one typed, or with
    # --physics '' gymnasium's Pendulum-v1 in the lesson's Game.
    evaluate = ["--eval", run_dir, "--eval-episodes", 3]
    assert lines(*evaluate, start="eval ")[0].startswith(
        f"eval Pendulum-v1, physics {RANGED}: return ")
    assert lines(*evaluate, "--physics", "g=6", start="eval ")[0].startswith(
        "eval Pendulum-v1, physics g 6, m 1, l 1, max_speed 8, max_torque 2, dt 0.05: return ")
    assert lines(*evaluate, "--physics", "", start="eval ")[0].startswith(
        "eval Pendulum-v1: return ")
    # --resume keeps it; a typed --physics wins (and is kept from then on); '' is gymnasium's.
    assert lines("--resume", run_dir, "--total-timesteps", 2 * BATCH) == [f"physics: {RANGED}"]
    assert lines("--resume", run_dir, "--total-timesteps", 3 * BATCH, "--physics", "m=1.5") == [
        "physics: g 10, m 1.5, l 1, max_speed 8, max_torque 2, dt 0.05"]
    assert checkpoint_of(tmp_path / "run")["config"]["physics"] == "m=1.5"
    assert pc.command_line(["--resume", run_dir, "--env-backend", "game"]) == 2  # its physics
    assert capsys.readouterr().err.startswith("error: --physics needs --env-backend torch")
    assert lines("--resume", run_dir, "--total-timesteps", 4 * BATCH, "--physics", "") == [
        f"physics: {GYMNASIUMS}"]
    assert checkpoint_of(tmp_path / "run")["global_step"] == 4 * BATCH


def test_eval_with_physics_plays_gymnasiums_pendulum_with_that_g(tmp_path):
    # A checkpoint of the lesson's Game, played greedily by --eval --physics g=7 on torch
    # Pendulums side by side, one episode each: each game's return is that of gymnasium's
    # Pendulum-v1(g=7) played by the same policy from the same start.
    pc.Main(pc.Config(total_timesteps=BATCH, run_dir=str(tmp_path), **SMALL)).run()
    played = pc.Main(pc.Config(eval=str(tmp_path), eval_episodes=4, greedy=True,
                               physics="g=7")).run()
    assert played["physics"] == "g=7" and played["episodes"] == 4
    checkpoint, model = checkpoint_of(tmp_path), pc.Model(3, 1)
    model.load_state_dict(checkpoint["model"])
    pc.load_statistics(model.obs_stats, checkpoint["normalizer"]["obs"])
    starts = pc.TorchPendulum(4, 1, CPU, {"g": (7.0, 7.0)}).state.numpy()  # --seed 1's
    for start, played_return in zip(starts, played["returns"]):
        env = gym.make("Pendulum-v1", g=7.0)
        env.reset(seed=0)
        env.unwrapped.state, total = start.copy(), 0.0
        obs = np.array([math.cos(start[0]), math.sin(start[0]), start[1]], np.float32)
        for _ in range(200):
            with torch.no_grad():
                normalised = model.obs_stats.normalize(torch.from_numpy(obs)[None], 10.0,
                                                       update=False)
                action = model.act(normalised, greedy=True)[0].clamp(-2, 2)
            obs, reward, _, truncated, _ = env.step(action[0].numpy())
            total += reward
        assert truncated and played_return == pytest.approx(total, rel=1e-6)
    with pytest.raises(pc.UsageError, match="--eval-episodes' games would take about"):
        pc.Main(pc.Config(eval=str(tmp_path), eval_episodes=10 ** 15, physics="g=7")).run()


def test_learns_pendulum(tmp_path):
    # A random policy scores about -1200; the budget is a fraction of the 200k that reach -200.
    summary = pc.Main(pc.Config(seed=1, env_backend="torch", total_timesteps=60 * 1024,
                                device="cpu", run_dir=str(tmp_path))).run()
    # 60 rollouts of 16 games x 64 steps: 19 whole episodes of 200 steps in each game.
    assert summary["steps"] == 60 * 1024 and summary["episodes"] == 16 * 19
    assert summary["mean_return_100"] > -600  # seed 1: -304 (64 games x 16 steps: -693)


# ----- the NumPy path against the lesson's torch code ------------------------------------------


@pytest.mark.parametrize("clip_value_loss", [False, True])
def test_numpy_gradient_steps_match_autograd_and_adam(clip_value_loss):
    torch.manual_seed(0)
    config = pc.with_preset(pc.Config(clip_value_loss=clip_value_loss, ent_coef=0.01,
                                      max_grad_norm=0.1))
    lesson_model = pc.Model(3, 2)
    n = 64
    obs, actions = torch.randn(n, 3), torch.randn(n, 2)
    with torch.no_grad():
        old_log_probs, _, old_values = lesson_model.evaluate_actions(obs, actions)
    # A player far from the learner: some ratios and values move beyond the clip range.
    minibatch = pc.Minibatch(obs, actions, old_log_probs + 0.5 * torch.randn(n), torch.randn(n),
                             torch.randn(n), old_values + 0.5 * torch.randn(n))
    assert_numpy_learner_steps_as_the_lesson(pc, lesson_model, config, minibatch)


def test_the_numpy_path_plays_and_learns_as_the_lesson(tmp_path, monkeypatch):
    # Two rollouts of 100 steps: Pendulum's time limit cuts both games' episodes at the last step.
    settings = dict(num_envs=2, num_steps=100, num_minibatches=4, update_epochs=2, device="cpu",
                    total_timesteps=400, clip_value_loss=True)
    numpy_main = pc.Main(pc.Config(run_dir=str(tmp_path / "numpy"), **settings))
    numpy_summary = numpy_main.run()
    assert isinstance(numpy_main.collect_rollout.__self__, pc.NumpyPlayer)
    # The lesson samples a step at a time, the NumPy path a rollout at once: give the lesson the
    # same noise, drawn as the NumPy path draws it (and so leaving the generator as it does).
    steps, calls, block = settings["num_steps"], [], None

    def rollout_noise(mean):  # step t of a rollout: row t of one draw for the whole rollout
        nonlocal block
        calls.append(len(calls) % steps)
        if calls[-1] == 0:
            block = torch.randn(steps, *mean.shape)
        return block[calls[-1]]

    monkeypatch.setattr(torch, "randn_like", rollout_noise)
    lesson_main = pc.Main(pc.Config(run_dir=str(tmp_path / "lesson"), numpy_on_cpu=False,
                                    **settings))
    lesson_summary = lesson_main.run()
    assert len(calls) == 200
    assert numpy_summary["episodes"] == lesson_summary["episodes"] == 2
    assert numpy_summary["mean_return_100"] == pytest.approx(lesson_summary["mean_return_100"],
                                                             rel=1e-5)
    for name in ("obs", "actions", "log_probs", "values", "rewards", "dones"):
        torch.testing.assert_close(getattr(numpy_main.rollout, name),
                                   getattr(lesson_main.rollout, name), rtol=1e-4, atol=1e-5)
    assert numpy_main.rollout.dones[-1].all()  # the cut, its reward bootstrapped in both
    for name, param in lesson_main.model.state_dict().items():
        torch.testing.assert_close(numpy_main.model.state_dict()[name], param, rtol=1e-4,
                                   atol=1e-5)
    for stats in ("obs_stats", "return_stats"):
        mine, theirs = getattr(numpy_main.model, stats), getattr(lesson_main.model, stats)
        assert mine.count == theirs.count
        torch.testing.assert_close(mine.mean, theirs.mean)
        torch.testing.assert_close(mine.var, theirs.var)


def test_lesson_digest_is_the_digest_of_the_shipped_lesson():
    # A change to a definition the NumPy path stands in for turns the path off (the lesson's torch code
    # runs, as edited) until LESSON_DIGEST is renewed, which only the NumPy path's equality tests allow.
    digests = pc.lesson_digest()
    assert list(digests) == list(pc.NUMPY_STANDS_IN_FOR) and None not in digests.values()
    assert digests == pc.LESSON_DIGEST, (
        "the lesson's definitions that the NumPy path stands in for changed: run the NumPy-vs-lesson "
        "equality tests (python -m pytest tests/test_continuous.py -k numpy), make them pass, then renew "
        "LESSON_DIGEST in ppo_continuous.py with this value:\nLESSON_DIGEST = "
        + json.dumps(digests, indent=4) + "\n")


def a_main_of_one_rank_on_the_cpu():
    """What use_numpy_on_cpu reads of a Main whose RunGuard is set up, alone on the CPU."""
    model, config = pc.Model(3, 1), pc.with_preset(pc.Config(device="cpu"))
    guard = types.SimpleNamespace(device=CPU, ranks=types.SimpleNamespace(world_size=1))
    return types.SimpleNamespace(model=model, trainer=pc.Trainer(model, config, pc.Adam), config=config,
                                 guard=guard)


@pytest.mark.parametrize("changed,line", [
    ({}, "learner: NumPy fast path, equal to the lesson's (tests/test_continuous.py; --no-numpy-on-cpu "
         "runs the lesson's torch code)"),
    ({"Trainer": "0" * 64}, "learner: the lesson's torch code: Trainer differs from the shipped lesson "
                            "(the NumPy fast path steps aside)"),
    ({"Model": "0" * 64, "Main.collect_rollout": None},
     "learner: the lesson's torch code: Model, Main.collect_rollout differ from the shipped lesson (the "
     "NumPy fast path steps aside)"),
])
def test_the_numpy_path_runs_only_while_the_lesson_is_the_shipped_one(changed, line, monkeypatch):
    monkeypatch.setattr(pc, "LESSON_DIGEST", {**pc.LESSON_DIGEST, **changed})
    main = a_main_of_one_rank_on_the_cpu()
    lesson_step = main.trainer.gradient_step
    assert pc.use_numpy_on_cpu(main) == line
    assert (main.trainer.gradient_step == lesson_step) == bool(changed)  # the NumPy step only if equal
    assert hasattr(main, "estimate_advantages") != bool(changed)


def test_a_lesson_whose_source_cannot_be_read_runs_its_torch_code(monkeypatch):
    def no_source(definition):
        raise OSError("could not get source code")  # as in a notebook's cell

    monkeypatch.setattr(pc.inspect, "getsource", no_source)
    assert set(pc.lesson_digest().values()) == {None}
    main = a_main_of_one_rank_on_the_cpu()
    assert pc.use_numpy_on_cpu(main) == ("learner: the lesson's torch code: its source cannot be read here "
                                         "(the NumPy fast path steps aside)")
    assert not hasattr(main, "estimate_advantages")


TORCH_ENGINE = ("engine: the torch Pendulum (Pendulum-v1 in tensors, the same game as Game: "
                "tests/test_continuous.py); --env-backend game plays the lesson's Game")


@pytest.mark.parametrize("settings,learner,engine,physics", [
    ({}, "learner: NumPy fast path, equal to the lesson's",
     "engine: the lesson's Game, 4 in this process", []),
    ({"numpy_on_cpu": False, "num_workers": 2}, "learner: the lesson's torch code",
     "engine: the lesson's Game, 2 per Worker in 2 child processes", []),
    ({"env_backend": "torch"}, "learner: NumPy fast path, equal to the lesson's", TORCH_ENGINE,
     [f"physics: {GYMNASIUMS}"]),  # (another physics: the next test)
])
def test_the_start_up_lines_name_the_learner_the_engine_and_its_physics(
        settings, learner, engine, physics, tmp_path, capsys):
    pc.Main(pc.Config(total_timesteps=BATCH, run_dir=str(tmp_path), **{**SMALL, **settings})).run()
    lines = capsys.readouterr().out.splitlines()
    assert [line for line in lines if line.startswith("learner: ")][0].startswith(learner), lines
    assert [line for line in lines if line.startswith("engine: ")] == [engine], lines
    assert [line for line in lines if line.startswith("physics: ")] == physics, lines


def test_a_lesson_whose_loss_is_zero_runs_as_edited_and_does_not_learn(tmp_path):
    # Issue 35: a reader's edit to the lesson takes effect. A copy whose PPO loss is multiplied by 0 runs
    # the lesson's torch code (its Trainer differs from the shipped one) and stays at a random policy's
    # returns, while the shipped file learns, both with the defaults and seed 1 for 40 rollouts
    # (measured: -1235 and -813; a random policy scores about -1200).
    source = (ROOT / "ppo_continuous.py").read_text()
    end_of_loss = '        return loss, {"policy_loss"'
    assert source.count(end_of_loss) == 1
    edited = tmp_path / "ppo_continuous.py"
    edited.write_text(source.replace(end_of_loss, "        loss = 0 * loss\n" + end_of_loss))
    processes = {name: subprocess.Popen(
        [sys.executable, str(script), "--total-timesteps", str(40 * 1024), "--run-dir", str(tmp_path / name)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for name, script in (("shipped", ROOT / "ppo_continuous.py"), ("zero", edited))}
    results = {name: process.communicate(timeout=600) for name, process in processes.items()}
    for name, process in processes.items():
        assert process.returncode == 0, results[name][1]
    learner = {name: [line for line in stdout.splitlines() if line.startswith("learner: ")]
               for name, (stdout, _) in results.items()}
    assert learner["shipped"][0].startswith("learner: NumPy fast path, equal to the lesson's")
    assert learner["zero"] == ["learner: the lesson's torch code: Trainer differs from the shipped lesson "
                               "(the NumPy fast path steps aside)"]
    returns = {name: json.loads((tmp_path / name / "summary.json").read_text())["mean_return_100"]
               for name in processes}
    assert returns["zero"] < -1100 and returns["shipped"] > -1000, returns


def test_the_lesson_alone_trains_the_network_the_whole_file_trains_with_the_lessons_torch_code(tmp_path):
    # The file cut at the banner, run as a pasted notebook cell: it defines everything it uses, and its
    # plain Run (the Games in one Worker) trains bitwise the network, and the running statistics, of the
    # whole file's --no-numpy-on-cpu (RunGuard, the Games in this process).
    source = (ROOT / "ppo_continuous.py").read_text()
    namespace = {"__name__": "lesson"}
    exec(compile(source[:source.index("\n# ==== Below")], "lesson", "exec"), namespace)
    settings = dict(seed=3, total_timesteps=2 * BATCH, **SMALL)
    alone, threads = namespace["Main"](namespace["Config"](**settings)), torch.get_num_threads()
    torch.set_num_threads(1)  # as RunGuard sets it (two threads may split a sum's terms otherwise)
    try:
        summary = alone.run()
    finally:
        torch.set_num_threads(threads)
    assert {"script", "env", "seed", "steps", "seconds", "episodes", "mean_return_100",
            "solved_step"} <= set(summary)
    assert summary["steps"] == 2 * BATCH and summary["script"] == "ppo_continuous"
    assert "RunGuard" not in namespace and isinstance(alone.guard, namespace["Run"])
    whole = pc.Main(pc.Config(**settings, numpy_on_cpu=False, run_dir=str(tmp_path)))
    whole.run()
    for key, value in whole.model.state_dict().items():
        assert torch.equal(alone.model.state_dict()[key], value), key
    for name in ("mean", "var", "count"):
        assert torch.equal(getattr(alone.model.obs_stats, name), getattr(whole.model.obs_stats, name))
    assert not torch.equal(alone.model.actor[0].weight, namespace["Model"](3, 1).actor[0].weight)


def test_a_checkpoint_of_the_hand_written_adam_and_the_gym_backend_resumes_as_a_new_one(tmp_path):
    # Before torch.optim.Adam, checkpoints held the hand-written Adam's "steps", "lr", "exp_avg" and
    # "exp_avg_sq", and --env-backend was called gym: such a checkpoint resumes exactly as the same one
    # in today's form.
    pc.Main(pc.Config(total_timesteps=2 * BATCH, run_dir=str(tmp_path / "new"), **SMALL)).run()
    checkpoint = checkpoint_of(tmp_path / "new")
    state = checkpoint["optimizer"]["state"]
    assert checkpoint["config"]["env_backend"] == "game" and state[0]["step"].item() == 2 * 2 * 2
    checkpoint["optimizer"] = {"steps": int(state[0]["step"]),
                               "lr": checkpoint["optimizer"]["param_groups"][0]["lr"],
                               "exp_avg": [state[i]["exp_avg"] for i in sorted(state)],
                               "exp_avg_sq": [state[i]["exp_avg_sq"] for i in sorted(state)]}
    checkpoint["config"]["env_backend"] = "gym"
    (tmp_path / "old").mkdir()
    torch.save(checkpoint, tmp_path / "old" / "checkpoint.pt")
    for name in ("new", "old"):
        pc.Main(pc.Config(resume=str(tmp_path / name), total_timesteps=3 * BATCH)).run()
    new, old = checkpoint_of(tmp_path / "new"), checkpoint_of(tmp_path / "old")
    assert old["config"]["env_backend"] == "game" and old["global_step"] == 3 * BATCH
    for key, value in new["model"].items():
        assert torch.equal(old["model"][key], value), key
    for index, value in new["optimizer"]["state"].items():
        assert old["optimizer"]["state"][index]["step"].item() == value["step"].item() == 3 * 2 * 2
        assert torch.equal(old["optimizer"]["state"][index]["exp_avg_sq"], value["exp_avg_sq"])


# ----- the command line -------------------------------------------------------------------------------


@pytest.mark.parametrize("args,message", [
    (["--env", "Pendulum-v9"], "unknown env 'Pendulum-v9'; did you mean Pendulum-v1"),
    (["--num-envs", "0"], "--num-envs must be positive, not 0"),
    (["--env-backend", "jax"], "unknown --env-backend 'jax'"),
    (["--env-backend", "torch", "--env", "MountainCarContinuous-v0"],
     "--env-backend torch has Pendulum-v1 only"),
    # --physics: bad names, ranges and values; what cannot play it.
    (["--env-backend", "torch", "--physics", "G=12"],
     "--physics 'G=12': no parameter 'G'; did you mean g?"),
    (["--env-backend", "torch", "--physics", "mass=2"],
     "no parameter 'mass'; use g, m, l, max_speed, max_torque, dt"),
    (["--env-backend", "torch", "--physics", "g=6:"],
     "'g=6:': write g=value or g=low:high (e.g. g=6:14)"),
    (["--env-backend", "torch", "--physics", "g=6,g=8"], "--physics 'g=8': g is given twice"),
    (["--env-backend", "torch", "--physics", "g=14:6"], "a reversed range: write g=6:14"),
    (["--env-backend", "torch", "--physics", "g=6:6"], "an empty range: write g=6"),
    (["--env-backend", "torch", "--physics", "m=inf"], "--physics 'm=inf': not a finite number"),
    (["--env-backend", "torch", "--physics", "g=-1:5"], "g must be 0 or more"),
    (["--env-backend", "torch", "--physics", "l=0"], "l must be positive"),
    (["--env-backend", "torch", "--physics", "max_torque=1:3"],
     "max_torque must be at most 2, the bound of the policy's actions"),
    (["--physics", "g=12"], "--physics needs --env-backend torch"),
    (["--env", "MountainCarContinuous-v0", "--physics", "g=12"],
     "--physics is Pendulum-v1's, not MountainCarContinuous-v0's"),
    (["--eval", "x", "--video", "--physics", "g=6"], "--video films gymnasium's Pendulum-v1"),
])
def test_bad_input_is_refused_with_one_line_and_status_2(args, message, tmp_path, capsys):
    # In this process, through the command line's own entry point (the one below runs it whole).
    assert pc.command_line([*args, "--run-dir", str(tmp_path / "run")]) == 2
    stderr = capsys.readouterr().err
    assert message in stderr and len(stderr.strip().splitlines()) == 1


def test_a_discrete_env_exits_2_naming_ppo_cartpole(tmp_path):
    result = run_script("--env", "CartPole-v1", "--run-dir", tmp_path / "run")
    assert result.returncode == 2, result.stderr
    assert ("CartPole-v1 has a Discrete(2) action space; this script handles continuous (Box) "
            "actions: use ppo_cartpole.py") in result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_a_mujoco_env_without_mujoco_names_the_pip_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "mujoco", None)  # what `import mujoco` meets when missing
    with pytest.raises(pc.UsageError, match=r'HalfCheetah-v5 runs on MuJoCo, which is not '
                                            r'installed: pip install "gymnasium\[mujoco\]"'):
        pc.inspect_env("HalfCheetah-v5")


def test_a_mujoco_robot_trains_evaluates_and_films_with_offscreen_drawing(tmp_path):
    # Hopper falls: its episodes end by termination, mostly within these few hundred steps.
    run_dir = tmp_path / "run"
    result = run_script("--env", "Hopper-v5", "--num-envs", "4", "--num-steps", "128",
                        "--total-timesteps", 1024, "--run-dir", run_dir)
    assert result.returncode == 0, result.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 1024 and summary["episodes"] > 4
    assert checkpoint_of(run_dir)["normalizer"]["obs"]["mean"].shape == (11,)
    evaluate = ["--eval", run_dir / "checkpoint.pt", "--eval-episodes", 1, "--video"]
    env = {key: value for key, value in os.environ.items() if key not in ("DISPLAY", "MUJOCO_GL")}
    refused = subprocess.run([sys.executable, "ppo_continuous.py", *map(str, evaluate)], cwd=ROOT,
                             capture_output=True, text=True, timeout=600, env=env)
    assert refused.returncode == 2 and refused.stderr.strip() == (
        "error: --video of Hopper-v5 needs a display, or MuJoCo's offscreen drawing: run with "
        "MUJOCO_GL=egl or MUJOCO_GL=osmesa")
    filmed = subprocess.run([sys.executable, "ppo_continuous.py", *map(str, evaluate)], cwd=ROOT,
                            capture_output=True, text=True, timeout=600,
                            env={**env, "MUJOCO_GL": "egl"})
    assert filmed.returncode == 0, filmed.stderr
    assert "eval Hopper-v5: return" in filmed.stdout and (run_dir / "eval.mp4").stat().st_size > 0


def test_a_mujoco_run_and_its_eval_leave_the_working_directory_clean(tmp_path):
    # MuJoCo appends its warnings (gymnasium's HalfCheetah model holds a deprecated attribute) to
    # MUJOCO_LOG.TXT in the working directory unless told where: the run dir, or nowhere.
    script = [sys.executable, str(ROOT / "ppo_continuous.py")]
    train = ["--env", "HalfCheetah-v5", "--num-envs", "2", "--num-steps", "16",
             "--num-minibatches", "2", "--total-timesteps", "32", "--run-dir", "run"]
    for args in (train, ["--eval", "run", "--eval-episodes", "1"]):
        result = subprocess.run(script + args, cwd=tmp_path, capture_output=True, text=True,
                                timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]
    assert os.listdir(tmp_path) == ["run"]


def test_both_engines_play_16_games_of_64_steps_by_default(capsys):
    # The torch engine's own 64 x 16 reached -200 on 3 of seeds 1-5 (benchmarks/README.md).
    config = pc.with_preset(pc.parse_config(["--env-backend", "torch"]))
    assert (config.num_envs, config.num_steps) == (16, 64)
    with pytest.raises(SystemExit) as exit:
        pc.parse_config(["--help"])
    assert exit.value.code == 0
    flat = " ".join(capsys.readouterr().out.split())
    general = pc.GENERAL_SETTING
    assert f"(valid: > 0) (default: Pendulum-v1 16, other envs {general['num_envs']})" in flat
    assert f"(valid: > 0) (default: Pendulum-v1 64, other envs {general['num_steps']})" in flat
    # What a game's physics is, how to give it, and what is physical.
    assert ("--physics PHYSICS the torch Pendulum's g (gravity), m, l (mass, length), max_speed, "
            "max_torque, dt, e.g. g=6:14,m=1.2: a range is drawn per game at each reset; '': "
            "gymnasium's (valid: g >= 0, the rest > 0, max_torque <= 2)") in flat


def test_ctrl_c_saves_the_statistics_and_resume_continues(tmp_path):
    run_dir = tmp_path / "run"
    process = subprocess.Popen(
        [sys.executable, "ppo_continuous.py", "--num-envs", "4", "--num-steps", "32",
         "--num-workers", "2", "--total-timesteps", str(10 ** 8), "--checkpoint-every",
         str(BATCH), "--run-dir", str(run_dir)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True)
    deadline = time.monotonic() + 600
    while not (run_dir / "checkpoint.pt").exists():
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, "no checkpoint within 600 s"
        time.sleep(0.1)
    workers = children(process.pid)
    os.killpg(process.pid, signal.SIGINT)  # a terminal's Ctrl-C reaches the whole group
    process.communicate(timeout=120)
    assert process.returncode == 128 + signal.SIGINT
    assert wait_until_gone(workers)
    summary = json.loads((run_dir / "summary.json").read_text())
    checkpoint = checkpoint_of(run_dir)
    assert summary["interrupted"] is True and summary["steps"] == checkpoint["global_step"] > 0
    observed = checkpoint["normalizer"]["obs"]["count"].item()  # the first 4, then one a step
    assert observed == pytest.approx(1e-4 + 4 + checkpoint["global_step"])

    new_total = checkpoint["global_step"] + 2 * BATCH
    result = run_script("--resume", run_dir / "checkpoint.pt", "--total-timesteps", new_total)
    assert result.returncode == 0, result.stderr
    resumed = checkpoint_of(run_dir)
    assert resumed["global_step"] == new_total
    assert resumed["normalizer"]["obs"]["count"].item() == pytest.approx(
        observed + 4 * (1 + 2 * 32))


def test_two_ranks_merge_their_statistics_exactly(tmp_path):
    steps_per_game = 3 * 32
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         "ppo_continuous.py", "--num-envs", "4", "--num-steps", "32", "--num-minibatches", "2",
         "--update-epochs", "2", "--env-backend", "torch", "--total-timesteps",
         str(2 * 4 * steps_per_game), "--run-dir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr  # 0: the ranks' weights and statistics agree
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 2 * 4 * steps_per_game
    # The union of both ranks' observations (a first one and one per step, per game): merged, not
    # averaged, which would count one rank's.
    stats = checkpoint_of(tmp_path)["normalizer"]
    assert stats["obs"]["count"].item() == pytest.approx(1e-4 + 2 * 4 * (1 + steps_per_game))
    assert stats["return"]["count"].item() == pytest.approx(1e-4 + 2 * 4 * steps_per_game)
