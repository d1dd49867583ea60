"""Every script's compute_gae against advantages worked out by hand (GUIDE.md section 4: dones[t]
= 1 when the episode ended at step t; a truncation's gamma * V(final obs) is already in rewards[t])."""
import importlib

import pytest
import torch

SCRIPTS = ["ppo_cartpole", "ppo_atari", "ppo_continuous", "ppo_memory", "ppo_multiagent",
           "ppo_spaces"]


@pytest.fixture(params=SCRIPTS)
def gae(request):
    compute_gae = importlib.import_module(request.param).compute_gae

    def advantages(rewards, values, dones, last_value, gamma=0.9, lam=0.8):
        as_tensor = lambda x: torch.tensor(x, dtype=torch.float32)
        return compute_gae(as_tensor(rewards), as_tensor(values), as_tensor(dones),
                           as_tensor(last_value), gamma, lam)
    return advantages


def test_gae_without_episode_end_matches_hand_computation(gae):
    # deltas: 1 + .9*.4 - .5 = .86, 1 + .9*.3 - .4 = .87, 1 + .9*.2 - .3 = .88; gamma*lambda = .72
    advantages = gae([[1], [1], [1]], [[.5], [.4], [.3]], [[0], [0], [0]], [.2])
    expected = [[0.86 + 0.72 * (0.87 + 0.72 * 0.88)], [0.87 + 0.72 * 0.88], [0.88]]
    assert torch.allclose(advantages, torch.tensor(expected), atol=1e-6)


def test_gae_termination_cuts_the_sum_and_ignores_the_next_value(gae):
    advantages = gae([[1], [1], [1]], [[.5], [.4], [.3]], [[0], [1], [0]], [.2])
    # step 1 ends the episode: its advantage is 1 - 0.4, and step 0 sees only that
    assert torch.allclose(advantages, torch.tensor([[0.86 + 0.72 * 0.6], [0.6], [0.88]]),
                          atol=1e-6)


def test_gae_truncation_uses_the_bootstrapped_reward(gae):
    # truncated at step 1 with V(final obs) = 0.7: the trainer put 1 + 0.9 * 0.7 = 1.63 in rewards[1]
    advantages = gae([[1], [1.63], [1]], [[.5], [.4], [.3]], [[0], [1], [0]], [.2])
    assert torch.allclose(advantages, torch.tensor([[0.86 + 0.72 * 1.23], [1.23], [0.88]]),
                          atol=1e-6)


def test_gae_episode_end_at_the_last_step_ignores_last_value(gae):
    advantages = gae([[1, 1], [1, 1], [1, 1]], [[.5, .5], [.4, .4], [.3, .3]],
                     [[0, 0], [0, 0], [0, 1]], [.2, 100.0])
    assert torch.allclose(advantages[:, 1], torch.tensor([0.86 + 0.72 * (0.87 + 0.72 * 0.7),
                                                          0.87 + 0.72 * 0.7, 0.7]))
    assert torch.allclose(advantages[:, 0], torch.tensor([0.86 + 0.72 * (0.87 + 0.72 * 0.88),
                                                          0.87 + 0.72 * 0.88, 0.88]))


@pytest.mark.parametrize("lam,first", [(0.0, 1.0), (0.5, 1.45), (1.0, 1.9)])
def test_gae_carries_the_next_advantage_by_gamma_times_lambda_not_gamma(gae, lam, first):
    # Values 0, rewards 1: both TD errors are 1, and A_0 = 1 + gamma * lambda * A_1. A recursion
    # with gamma alone would give 1.9 whatever lambda; lambda 0 is the one-step estimate, 1 the
    # discounted return.
    advantages = gae([[1], [1]], [[0], [0]], [[0], [0]], [0], gamma=0.9, lam=lam)
    assert advantages[:, 0].tolist() == pytest.approx([first, 1.0])
