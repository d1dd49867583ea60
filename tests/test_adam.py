"""Every script's Adam (torch.optim.Adam written out, below the banner) against torch.optim.Adam: the
same weights and moments bit for bit on the CPU, with the learning rate set through param_groups as
Main's annealing sets it; the checkpoints written with torch.optim.Adam resume; and the whole file
hands it to the Trainer only while the lesson names torch.optim.Adam."""
import importlib
import importlib.util
import io

import pytest
import torch
from torch import nn

from conftest import ROOT

SCRIPTS = ["ppo_cartpole", "ppo_atari", "ppo_continuous", "ppo_memory", "ppo_multiagent",
           "ppo_spaces"]


@pytest.fixture(params=SCRIPTS)
def script(request):
    return importlib.import_module(request.param)


def network(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def train(model, optimizer, steps, first=0):
    """`steps` steps on a fixed random regression, the rate lowered each step as annealing does."""
    for step in range(first, first + steps):
        generator = torch.Generator().manual_seed(step)
        x, y = torch.randn(16, 5, generator=generator), torch.randn(16, 3, generator=generator)
        optimizer.param_groups[0]["lr"] = 3e-3 * (1 - step / 100)
        optimizer.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        optimizer.step()


def saved_and_loaded(state: dict) -> dict:
    """`state` through torch.save and torch.load, as a checkpoint takes it."""
    file = io.BytesIO()
    torch.save(state, file)
    file.seek(0)
    return torch.load(file, weights_only=True)


def assert_same(model_a, optimizer_a, model_b, optimizer_b):
    for a, b in zip(model_a.parameters(), model_b.parameters()):
        assert torch.equal(a, b)
    state_a, state_b = optimizer_a.state_dict()["state"], optimizer_b.state_dict()["state"]
    assert state_a.keys() == state_b.keys() == set(range(4))
    for index in state_a:
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(state_a[index][key], state_b[index][key]), (index, key)


def test_adam_steps_as_torch_optim_adam_bit_for_bit(script):
    adam = script.Adam
    mine, theirs = network(), network()
    my_adam = adam(mine.parameters(), lr=3e-3, eps=1e-5)
    torch_adam = torch.optim.Adam(theirs.parameters(), lr=3e-3, eps=1e-5)
    train(mine, my_adam, 20)
    train(theirs, torch_adam, 20)
    assert not torch.equal(next(mine.parameters()), next(network().parameters()))  # it moved
    assert_same(mine, my_adam, theirs, torch_adam)


def test_adam_resumes_a_checkpoint_of_torch_optim_adam(script):
    """Checkpoints written with torch.optim.Adam (this library's until 2026-11) resume through the
    script's load_optimizer: the run goes on as one that was never stopped."""
    adam, load_optimizer = script.Adam, script.load_optimizer
    first, straight = network(), network()
    first_optimizer = torch.optim.Adam(first.parameters(), lr=3e-3, eps=1e-5)
    straight_optimizer = adam(straight.parameters(), lr=3e-3, eps=1e-5)
    train(first, first_optimizer, 10)
    train(straight, straight_optimizer, 20)
    resumed = network(seed=1)
    resumed.load_state_dict(first.state_dict())
    resumed_optimizer = adam(resumed.parameters(), lr=1.0, eps=1e-5)
    load_optimizer(resumed_optimizer, saved_and_loaded(first_optimizer.state_dict()))
    assert resumed_optimizer.param_groups[0]["lr"] == pytest.approx(3e-3 * (1 - 9 / 100))
    train(resumed, resumed_optimizer, 10, first=10)
    assert_same(resumed, resumed_optimizer, straight, straight_optimizer)


def test_a_weight_without_a_gradient_is_left_as_torch_optim_adam_leaves_it(script):
    mine, theirs = network(), network()
    unused_mine, unused_theirs = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(3))
    my_adam = script.Adam([*mine.parameters(), unused_mine], lr=3e-3, eps=1e-5)
    torch_adam = torch.optim.Adam([*theirs.parameters(), unused_theirs], lr=3e-3, eps=1e-5)
    train(mine, my_adam, 5)
    train(theirs, torch_adam, 5)
    assert torch.equal(unused_mine, torch.ones(3)) and my_adam.state[4]["step"] == 0
    for a, b in zip(mine.parameters(), theirs.parameters()):
        assert torch.equal(a, b)


def test_the_whole_file_writes_out_adam_only_while_the_lesson_names_torch_optim_adam(script, tmp_path):
    assert script.Run.optimizer is torch.optim.Adam and script.RunGuard.optimizer is script.Adam
    source = (ROOT / f"{script.__name__}.py").read_text()
    named = "    optimizer = torch.optim.Adam  #"
    assert source.count(named) == 1
    path = tmp_path / f"edited_{script.__name__}.py"
    path.write_text(source.replace(named, "    optimizer = torch.optim.SGD  #"))  # a reader's edit
    spec = importlib.util.spec_from_file_location(path.stem, path)
    edited = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(edited)
    assert edited.RunGuard.optimizer is torch.optim.SGD
