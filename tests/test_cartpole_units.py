"""ppo_cartpole.py, piece by piece, against values worked out by hand or by the reference library."""
import math

import gymnasium as gym
import numpy as np
import pytest
import torch

import ppo_cartpole as pc


def ppo_loss(ratios, raw_advantages=(1.0, -1.0), **changes):
    config = pc.with_preset(pc.Config(**changes))  # (CartPole-v1's preset: no entropy bonus)
    new_log_prob = torch.log(torch.tensor(ratios))
    old_log_prob = torch.zeros(2)
    new_value, old_value, returns = torch.tensor([1.0, 2.0]), torch.tensor([0.5, 2.5]), torch.tensor([2.0, 2.0])
    entropy = torch.tensor([0.6, 0.8])
    minibatch = pc.Minibatch(obs=None, actions=None, old_log_probs=old_log_prob,
                             advantages=torch.tensor(raw_advantages), returns=returns, old_values=old_value)
    return pc.Trainer.ppo_loss(minibatch, new_log_prob, entropy, new_value, config)


# Advantages (1, -1) normalise to (+1/sqrt(2), -1/sqrt(2)) = (+-0.70711): mean 0, unbiased std sqrt(2).
A = 1 / math.sqrt(2)


def test_policy_loss_clip_inactive():
    _, stats = ppo_loss([1.1, 0.9])
    assert stats["policy_loss"].item() == pytest.approx((-A * 1.1 + A * 0.9) / 2, abs=1e-5)
    assert stats["clip_fraction"].item() == 0.0


def test_policy_loss_clip_active_limits_the_gain_both_ways():
    # ratio 1.5 with A > 0 is clipped to 1.2; ratio 0.5 with A < 0 is clipped to 0.8
    _, stats = ppo_loss([1.5, 0.5])
    assert stats["policy_loss"].item() == pytest.approx((-A * 1.2 + A * 0.8) / 2, abs=1e-5)
    assert stats["clip_fraction"].item() == 1.0
    expected_kl = ((0.5 - math.log(1.5)) + (-0.5 - math.log(0.5))) / 2
    assert stats["approx_kl"].item() == pytest.approx(expected_kl, abs=1e-6)


def test_policy_loss_clip_never_makes_the_objective_optimistic():
    # ratio 1.5 with A < 0: the unclipped term is the worse one and is kept
    _, stats = ppo_loss([1.5, 1.5])
    assert stats["policy_loss"].item() == pytest.approx((-A * 1.2 + A * 1.5) / 2, abs=1e-5)


def test_value_loss_unclipped_and_clipped():
    _, stats = ppo_loss([1.0, 1.0], clip_value_loss=False)
    assert stats["value_loss"].item() == pytest.approx(0.5 * (1.0 + 0.0) / 2)
    # clipped values: 0.5 + 0.2 = 0.7 and 2.5 - 0.2 = 2.3; max of squared errors: 1.69 and 0.09
    _, stats = ppo_loss([1.0, 1.0], clip_value_loss=True)
    assert stats["value_loss"].item() == pytest.approx(0.5 * (1.69 + 0.09) / 2, abs=1e-6)


def test_total_loss_combines_the_pieces():
    loss, stats = ppo_loss([1.1, 0.9], ent_coef=0.01, vf_coef=0.5)
    expected = stats["policy_loss"] - 0.01 * 0.7 + 0.5 * stats["value_loss"]
    assert loss.item() == pytest.approx(expected.item(), abs=1e-6)


@pytest.mark.parametrize("dims,binary", [([5], False), ([3, 4, 2], False), ([2, 2, 2], True)])
def test_action_heads_match_torch_distributions(dims, binary):
    torch.manual_seed(0)
    model = pc.Model(6, dims, binary)
    # make the policy far from uniform so that the check means something
    torch.nn.init.normal_(model.actor[-1].weight, std=1.0)
    obs = torch.randn(32, 6)
    actions, log_prob, value = model.act(obs)
    assert actions.shape == (32, len(dims)) and log_prob.shape == (32,) and value.shape == (32,)
    for d, n in enumerate(dims):
        assert 0 <= actions[:, d].min() and actions[:, d].max() < n
    out = model.actor(obs)
    if binary:
        reference = [torch.distributions.Bernoulli(logits=out[:, d]) for d in range(len(dims))]
    else:
        parts = out.view(32, len(dims), max(dims))
        reference = [torch.distributions.Categorical(logits=parts[:, d, :n]) for d, n in enumerate(dims)]
    expected_log_prob = sum(dist.log_prob(actions[:, d].float() if binary else actions[:, d])
                            for d, dist in enumerate(reference))
    expected_entropy = sum(dist.entropy() for dist in reference)
    new_log_prob, entropy, _ = model.evaluate_actions(obs, actions)
    assert torch.allclose(log_prob, expected_log_prob, atol=1e-5)
    assert torch.allclose(new_log_prob, expected_log_prob, atol=1e-5)
    assert torch.allclose(entropy, expected_entropy, atol=1e-5)


def test_sampling_follows_the_policy_probabilities():
    torch.manual_seed(0)
    model = pc.Model(3, [3], False)
    with torch.no_grad():
        model.actor[-1].weight.zero_()
        model.actor[-1].bias.copy_(torch.log(torch.tensor([0.2, 0.3, 0.5])))
    actions, _, _ = model.act(torch.zeros(20_000, 3))
    frequencies = torch.bincount(actions[:, 0], minlength=3).float() / 20_000
    assert torch.allclose(frequencies, torch.tensor([0.2, 0.3, 0.5]), atol=0.015)
    greedy, _, _ = model.act(torch.zeros(4, 3), greedy=True)
    assert (greedy == 2).all()


def test_orthogonal_init_gains():
    model = pc.Model(4, [2], False)
    for linear, gain in [(model.actor[0], math.sqrt(2)), (model.actor[2], math.sqrt(2)), (model.actor[4], 0.01),
                         (model.critic[0], math.sqrt(2)), (model.critic[4], 1.0)]:
        w = linear.weight.detach()
        rows, cols = w.shape
        gram = w @ w.T if rows <= cols else w.T @ w
        assert torch.allclose(gram, gain ** 2 * torch.eye(min(rows, cols)), atol=1e-5)
        assert (linear.bias == 0).all()


def games_of(env_id, count, seed=0):
    """`count` Games as a Worker holds them (game i seeded with seed + i), and their observations."""
    games = [pc.Game(env_id, seed + i) for i in range(count)]
    return games, np.stack([game.reset() for game in games])


def test_game_reports_episode_and_final_obs_and_resets_itself():
    games, obs = games_of("TestCount-v0", 2)  # truncated after 3 steps
    assert obs.tolist() == [[0.0], [0.0]]
    for t in (1, 2):
        rewards, terminated, truncated, final_obs, episodes = pc.Worker.step_games(games, np.array([[0], [1]]), obs)
        assert obs.tolist() == [[t], [t]] and rewards.tolist() == [1, 1] and final_obs == episodes == {}
        assert not terminated.any() and not truncated.any()
    rewards, terminated, truncated, final_obs, episodes = pc.Worker.step_games(games, np.array([[1], [0]]), obs)
    assert not terminated.any() and truncated.all()
    assert {i: o.tolist() for i, o in final_obs.items()} == {0: [3.0], 1: [3.0]}
    assert obs.tolist() == [[0.0], [0.0]]
    assert episodes == {0: {"return": 3.0, "length": 3}, 1: {"return": 3.0, "length": 3}}


def test_games_step_exactly_as_gymnasiums_same_step_vector_env():
    """N Games seeded seed + i give, bit for bit, what gymnasium's SyncVectorEnv in same-step mode gives."""
    games, obs = games_of("Acrobot-v1", 3, seed=5)
    library = gym.make_vec("Acrobot-v1", 3, vectorization_mode="sync",
                           vector_kwargs={"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP})
    library_obs, _ = library.reset(seed=5)
    assert np.array_equal(obs, library_obs)
    rng, ended = np.random.default_rng(0), 0
    for _ in range(1200):
        actions = rng.integers(0, 3, size=(3, 1))
        rewards, terminated, truncated, final_obs, _ = pc.Worker.step_games(games, actions, obs)
        library_obs, library_rewards, library_terminated, library_truncated, info = library.step(actions[:, 0])
        assert np.array_equal(obs, library_obs) and np.array_equal(rewards, library_rewards.astype(np.float32))
        assert np.array_equal(terminated, library_terminated) and np.array_equal(truncated, library_truncated)
        for i, final in final_obs.items():
            ended += 1
            assert np.array_equal(final, info["final_obs"][i])
    assert ended >= 3  # Acrobot's random play is cut at 500 steps


def test_game_converts_actions_to_the_env_form():
    assert pc.Game("TestGuessDims-v0", 0).env_action(np.array([2, 3])).tolist() == [2, 3]
    assert pc.Game("TestCopyBits-v0", 0).env_action(np.array([1, 0, 1, 1])).tolist() == [1, 0, 1, 1]
    assert pc.Game("CartPole-v1", 0).env_action(np.array([1])) == 1


def cartpole_engine(env_id, count, seed):
    obs = np.zeros((count, 4), np.float32)
    return pc.CartPoleGames().start_games(env_id, seed, obs), obs


def test_same_step_cartpole_follows_the_library_step_by_step():
    """Our CartPole restarts an ended pole at once; gymnasium's CartPoleVectorEnv one call later, ignoring
    that call's action. With one pole and the same seed, both must give the same numbers once the
    library's restart call (and its reward 0) is taken out."""
    poles, ours_obs = cartpole_engine("CartPole-v1", 1, seed=7)
    library = gym.make_vec("CartPole-v1", num_envs=1, vectorization_mode="vector_entry_point")
    assert isinstance(poles, pc.SameStepCartPole)
    library_obs, _ = library.reset(seed=7)
    assert np.array_equal(ours_obs, library_obs)
    rng = np.random.default_rng(0)
    episodes = 0
    for _ in range(3000):
        action = rng.integers(0, 2, size=1)
        reward, terminated, truncated, final_obs, _ = pc.CartPoleGames.step_games(poles, action[:, None], ours_obs)
        library_obs, library_reward, library_terminated, library_truncated, _ = library.step(action)
        assert reward[0] == library_reward[0] and terminated[0] == library_terminated[0]
        assert truncated[0] == library_truncated[0]
        if terminated[0] or truncated[0]:
            episodes += 1
            assert np.array_equal(final_obs[0], library_obs[0])
            library_obs, library_reward, _, _, _ = library.step(np.array([0]))  # the library's restart call
            assert library_reward[0] == 0
        assert np.array_equal(ours_obs, library_obs)
    assert episodes > 50  # random play ends an episode every ~20 steps


def test_cartpole_v0_keeps_its_time_limit():
    poles, _ = cartpole_engine("CartPole-v0", 1, seed=0)
    assert poles.max_episode_steps == 200
    assert pc.Game("CartPole-v0", 0).env.spec.max_episode_steps == 200


def test_truncated_episodes_are_bootstrapped_from_the_final_observation(tmp_path):
    # TestCount-v0 is truncated after 3 steps, when its observation is [3]: one rollout of 7 steps
    main = pc.Main(pc.Config(env="TestCount-v0", num_envs=2, num_steps=7, total_timesteps=14,
                             num_minibatches=1, update_epochs=1, normalize_observations=False,
                             run_dir=str(tmp_path)))  # (raw observations: [3] is the final one)
    values_of_final_obs = []
    value = pc.Model.value

    def value_recording_final_obs(model, obs):
        values = value(model, obs)
        if (obs == 3).all():  # a final observation: the policy itself never sees [3] (reset first)
            values_of_final_obs.append((obs.tolist(), values.tolist()))
        return values

    pc.Model.value = value_recording_final_obs
    try:
        main.run()
    finally:
        pc.Model.value = value
    dones = main.rollout.dones[:, 0].tolist()
    assert dones == [0, 0, 1, 0, 0, 1, 0]
    # both envs end together, so each bootstrap is one call with both final observations [3]
    assert [obs for obs, _ in values_of_final_obs] == [[[3.0], [3.0]]] * 2
    gamma = main.config.gamma
    first, second = values_of_final_obs[0][1][0], values_of_final_obs[1][1][0]
    expected = [1, 1, 1 + gamma * first, 1, 1, 1 + gamma * second, 1]
    assert main.rollout.rewards[:, 0].tolist() == pytest.approx(expected, abs=1e-6)
    assert main.guard.log.episodes == 4


def test_inspect_env_describes_the_spaces():
    assert pc.inspect_env("CartPole-v1") == (4, [2], False)
    assert pc.inspect_env("TestGuessDims-v0") == (7, [3, 4], False)
    assert pc.inspect_env("TestCopyBits-v0") == (4, [2, 2, 2, 2], True)
    with pytest.raises(pc.UsageError, match="Box"):
        pc.inspect_env("Pendulum-v1")
    with pytest.raises(pc.UsageError, match="Discrete observation"):
        pc.inspect_env("FrozenLake-v1")


def test_command_line_flags_come_from_config():
    config = pc.parse_config(["--env", "Acrobot-v1", "--num-envs", "8", "--no-anneal-lr", "--target-kl", "0.02"])
    assert (config.env, config.num_envs, config.anneal_lr, config.target_kl) == ("Acrobot-v1", 8, False, 0.02)
    assert pc.parse_config([]) == pc.Config()


def test_the_preset_fills_only_the_fields_left_at_none():
    assert {name: getattr(pc.with_preset(pc.Config()), name) for name in pc.PRESET_FIELDS} == (
        pc.PRESETS["CartPole-v1"])
    for config in (pc.Config(preset=False), pc.Config(env="Acrobot-v1")):
        filled = pc.with_preset(config)
        assert {name: getattr(filled, name) for name in pc.PRESET_FIELDS} == pc.GENERAL_SETTING
    given = pc.with_preset(pc.Config(learning_rate=1e-3, normalize_observations=True))
    assert (given.learning_rate, given.normalize_observations) == (1e-3, True)
    assert given.num_envs == pc.PRESETS["CartPole-v1"]["num_envs"]
    assert pc.preset_of(pc.Config()) == ("CartPole-v1's preset", pc.PRESETS["CartPole-v1"])
    assert pc.preset_of(pc.Config(preset=False))[0] == "the general setting"


def test_help_gives_each_preset_field_its_default_by_env(capsys):
    with pytest.raises(SystemExit):
        pc.parse_config(["--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps the lines
    general, cartpole = pc.GENERAL_SETTING["gamma"], pc.PRESETS["CartPole-v1"]["gamma"]
    assert f"(default: CartPole-v1 {cartpole}, other envs {general})" in text
    config = pc.parse_config(["--no-preset", "--normalize-observations"])
    assert (config.preset, config.normalize_observations, config.gamma) == (False, True, None)


def test_running_mean_std_merges_batches_exactly_and_normalises():
    generator = torch.Generator().manual_seed(0)
    batches = [torch.randn(n, 3, generator=generator) * 5 + 2 for n in (7, 1, 12)]
    whole, parts = pc.RunningMeanStd((3,)), pc.RunningMeanStd((3,))
    whole.update(torch.cat(batches))
    for batch in batches:
        parts.update(batch)
    for key in ("count", "mean", "var"):
        torch.testing.assert_close(getattr(parts, key), getattr(whole, key))
    data = torch.cat(batches).double()  # the prior (count 1e-4, mean 0, variance 1) barely counts
    torch.testing.assert_close(whole.mean, data.mean(0), rtol=0, atol=1e-4)
    torch.testing.assert_close(whole.var, data.var(0, correction=0), rtol=1e-4, atol=1e-4)
    obs = torch.tensor([[2.0, 2.0, 1e6]])
    normalized = whole.normalize(obs, clip=10.0, update=False)
    expected = ((obs.double() - whole.mean) / (whole.var + 1e-8).sqrt()).clamp(-10, 10).float()
    assert torch.equal(normalized, expected) and normalized[0, 2] == 10.0
    assert whole.count.item() == pytest.approx(20 + 1e-4)  # update=False: not merged
    off = pc.RunningMeanStd((3,), active=False)
    assert off.normalize(obs, clip=10.0) is obs and off.count.item() == 1e-4


def test_merge_over_ranks_gives_every_rank_the_statistics_of_all():
    generator = torch.Generator().manual_seed(1)
    first, own, others = (torch.randn(n, 2, generator=generator) * 3 + 1 for n in (5, 8, 6))
    before = pc.RunningMeanStd((2,))
    before.update(first)
    before_state = {key: value.clone() for key, value in pc.statistics_state(before).items()}
    ranks = {}
    for name, batch in (("other", others), ("own", own)):  # each rank's statistics after a rollout
        ranks[name] = pc.RunningMeanStd((2,))
        pc.load_statistics(ranks[name], before_state)
        ranks[name].update(batch)
    shares = []  # the other rank's share, as it sends it

    class Gather:  # two ranks' collective: this rank's share after the other's (rank order)
        distributed = True

        def __init__(self, others):
            self.others = others

        def gather(self, share):
            shares.append(share)
            return [*self.others, share]

    pc.merge_over_ranks(Gather([]), ranks["other"], before_state)
    pc.merge_over_ranks(Gather(shares[:1]), ranks["own"], before_state)
    everything = pc.RunningMeanStd((2,))
    everything.update(torch.cat([first, others, own]))
    for key in ("count", "mean", "var"):
        torch.testing.assert_close(getattr(ranks["own"], key), getattr(everything, key))
    inactive = pc.RunningMeanStd((2,), active=False)
    pc.merge_over_ranks(Gather([]), inactive, before_state)  # off: no collective, no change
    assert shares[2:] == [] and inactive.count.item() == 1e-4
