"""ppo_atari.py as a user runs it, and a learning check cheap enough for CI."""
import json
import subprocess
import sys
import types

import cv2
import numpy as np
import pytest
import torch

import ppo_atari as pa
from conftest import ROOT


def run_script(*args, timeout=240):
    """Run ppo_atari.py eagerly (--no-compile: compiling would cost each test seconds; two tests below
    check compilation itself)."""
    return subprocess.run([sys.executable, "ppo_atari.py", "--no-compile", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def patch_task(batch: int, generator: torch.Generator):
    """A synthetic pixel game: black 4x84x84 frames with one bright 20x20 patch in one of the four
    quadrants, the same in all 4 stacked frames. The right action is the patch's quadrant; reward 1 if
    right, else 0. Returns (uint8 observations, right actions)."""
    quadrant = torch.randint(0, 4, (batch,), generator=generator)
    obs = torch.zeros(batch, 4, 84, 84, dtype=torch.uint8)
    for i, q in enumerate(quadrant.tolist()):
        top, left = 10 + 42 * (q // 2), 10 + 42 * (q % 2)
        obs[i, :, top:top + 20, left:left + 20] = 255
    return obs, quadrant


def test_model_and_trainer_learn_a_pixel_task():
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    model = pa.Model(num_actions=4)
    trainer = pa.Trainer(model, pa.Config(learning_rate=1e-3))
    for _ in range(20):  # 10 already reach an accuracy of 1 (seed 0)
        obs, right = patch_task(128, generator)
        with torch.no_grad():
            actions, log_prob, value = model.act(obs)
        reward = (actions == right).float()
        # one-step episodes: the return is the reward, the advantage is reward - value (GAE with done=1)
        for _ in range(2):
            for half in (slice(0, 64), slice(64, 128)):
                trainer.gradient_step(pa.Minibatch(obs[half], actions[half], log_prob[half],
                                                   (reward - value)[half], reward[half], value[half]))
    obs, right = patch_task(256, generator)
    with torch.no_grad():
        greedy, _, value = model.act(obs, greedy=True)
    accuracy = (greedy == right).float().mean().item()
    assert accuracy >= 0.95  # chance is 0.25
    assert value.mean().item() == pytest.approx(1.0, abs=0.25)  # it also learned what a state is worth


def test_command_line_run_resume_eval_and_video(tmp_path):
    run_dir = tmp_path / "run"
    common = ["--num-envs", 2, "--num-steps", 64, "--num-minibatches", 2, "--run-dir", run_dir]
    result = run_script("--total-timesteps", 256, "--num-workers", 2, *common)
    assert result.returncode == 0, result.stderr
    assert "step 256/256 (100.0%)" in result.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["script"] == "ppo_atari" and summary["steps"] == 256 and summary["interrupted"] is False
    assert list(run_dir.glob("events.out.tfevents.*"))
    checkpoint = torch.load(run_dir / "checkpoint.pt", weights_only=True)
    assert checkpoint["global_step"] == 256 and checkpoint["updates"] == 2 and checkpoint["num_actions"] == 4

    result = run_script("--resume", run_dir / "checkpoint.pt", "--total-timesteps", 512, "--num-workers", 0)
    assert result.returncode == 0, result.stderr
    assert "leaked" not in result.stderr  # ale-py's vector engine is freed before the exit's gc.freeze()
    resumed = torch.load(run_dir / "checkpoint.pt", weights_only=True)
    assert resumed["global_step"] == 512 and resumed["updates"] == 4

    result = run_script("--eval", run_dir / "checkpoint.pt", "--eval-episodes", 1, "--video")
    assert result.returncode == 0, result.stderr
    assert "over 1 episode (" in result.stdout
    video = cv2.VideoCapture(str(run_dir / "eval.mp4"))
    ok, frame = video.read()
    assert ok and frame.shape == (210, 160, 3)
    assert frame.std() > 0  # a picture, not a blank frame


def test_same_seed_same_weights_in_process_and_in_workers_and_with_the_vector_env(tmp_path):
    weights = {}
    for name, backend, workers in (("a", "game", 0), ("b", "game", 0), ("c", "game", 2),
                                   ("d", "ale-vector", 0), ("e", "ale-vector", 0)):
        config = pa.Config(seed=5, total_timesteps=128, num_envs=2, num_steps=64, num_minibatches=2,
                           num_workers=workers, env_backend=backend, compile=False, run_dir=str(tmp_path / name))
        pa.Main(config).run()
        weights[name] = torch.load(tmp_path / name / "checkpoint.pt", weights_only=True)["model"]
    for key in weights["a"]:
        assert torch.equal(weights["a"][key], weights["b"][key]), key
        assert torch.equal(weights["a"][key], weights["c"][key]), key
        assert torch.equal(weights["d"][key], weights["e"][key]), key  # the vector env's threads: still repeatable
    assert not all(torch.equal(weights["a"][key], weights["d"][key]) for key in weights["a"])  # other games


@pytest.mark.parametrize("args,message", [
    (["--env", "BreakoutNoFrameskip-v9"], "unknown env 'BreakoutNoFrameskip-v9'; did you mean BreakoutNoFrameskip-v4"),
    (["--env", "CartPole-v1"], "CartPole-v1 is not an Atari game: use ppo_cartpole.py"),
    (["--num-envs", "0"], "--num-envs must be positive"),
    (["--num-workers", "3"], "--num-workers 3 must divide --num-envs 8"),
    (["--precision", "float16"], "unknown --precision 'float16': use float32 or bfloat16"),
    (["--env-backend", "envpool"], "unknown --env-backend 'envpool': use game or ale-vector"),
    (["--eval", "no/such.pt"], "checkpoint no/such.pt not found"),
])
def test_bad_input_exits_2_with_one_line(args, message, tmp_path):
    result = run_script(*args, "--run-dir", tmp_path / "run")
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_the_memory_a_run_asks_for_counts_its_games_rollout_and_update(tmp_path, monkeypatch):
    # Before anything is made, a run asks for what it will hold on the host: each game's emulator
    # and, per step of each game, one stored picture and the update's activations (peak RSS, see
    # RunGuard.setup: ~2 MB a game, 75-90 KB a step with 4 minibatches).
    asked = []

    def refuse(needed, what):
        asked.append(needed)
        raise pa.UsageError(f"{what} would take {needed}")

    monkeypatch.setattr(pa, "refuse_what_will_not_fit", refuse)
    for num_envs, num_steps in ((8, 128), (16, 128), (8, 256)):  # the default; twice its games, steps
        config = pa.Config(num_envs=num_envs, num_steps=num_steps, total_timesteps=num_envs * num_steps,
                           device="cpu", compile=False, run_dir=str(tmp_path / "run"))
        with pytest.raises(pa.UsageError, match="^the games, the rollout and the update would"):
            pa.Main(config).run()
    assert not (tmp_path / "run").exists()
    per_step = (asked[2] - asked[0]) / (8 * 128)
    per_game = (asked[1] - asked[0]) / 8 - 128 * per_step
    assert 70_000 <= per_step <= 100_000 and 1_000_000 <= per_game <= 3_000_000
    assert asked[0] < 2 ** 30  # the default asks for about 100 MB


def test_a_cartpole_checkpoint_is_refused(tmp_path):
    import ppo_cartpole as pc

    pc.Main(pc.Config(total_timesteps=1024, run_dir=str(tmp_path / "cartpole"))).run()
    result = run_script("--eval", tmp_path / "cartpole" / "checkpoint.pt")
    assert result.returncode == 2
    assert "was written by ppo_cartpole.py, not ppo_atari.py" in result.stderr


@pytest.mark.parametrize("backend", ["game", "ale-vector"])  # ale-vector: stacks go on through a life loss
def test_rebuilt_stacks_equal_the_games_stacks_across_episode_and_life_boundaries(tmp_path, backend, monkeypatch):
    seen, counts = [], []
    act, learn = pa.Model.act, pa.Main.learn

    def act_and_record(model, obs, greedy=False):
        seen.append(obs.clone())
        return act(model, obs, greedy)

    def check_then_learn(main, advantages, returns):
        # the later rollouts start from stacks that reach into the one before
        rebuilt = main.rollout.stacks(torch.arange(100 * 2))
        assert torch.equal(rebuilt, torch.stack(seen).flatten(0, 1)), f"rollout {len(counts)}"
        # fresh[t]: step t's stack started afresh, after an ending at step t - 1
        counts.append((int(main.rollout.dones[:-1].sum()), int(main.rollout.fresh[1:].sum())))
        seen.clear()
        return learn(main, advantages, returns)

    monkeypatch.setattr(pa.Model, "act", act_and_record)
    monkeypatch.setattr(pa.Main, "learn", check_then_learn)
    pa.Main(pa.Config(run_dir=str(tmp_path), num_workers=0, compile=False, num_envs=2, num_steps=100,
                      total_timesteps=3 * 100 * 2, env_backend=backend)).run()
    assert len(counts) == 3
    boundaries, restarts = (sum(column) for column in zip(*counts))
    assert boundaries >= 4  # random Breakout play loses a life every few dozen steps...
    assert restarts >= 1  # ...and a game every 150 or so
    if backend == "game":
        assert restarts == boundaries  # every training episode restarts the stack
    else:
        assert restarts < boundaries  # only a game over does


def test_the_rollout_buffer_stores_each_picture_once():
    rollout = pa.PictureRollout(pa.Config(num_envs=2, num_steps=2048), torch.device("cpu"))
    buffers = [value for value in vars(rollout).values() if isinstance(value, torch.Tensor)]
    bytes_per_step = sum(tensor.nbytes for tensor in buffers) / (2048 * 2)
    assert bytes_per_step <= 7_100  # a float32 stack would be 112,896, a uint8 stack 28,224


def test_an_update_is_a_clipped_gradient_step_of_adam_with_eps_1e_5():
    # Two Trainer.gradient_step calls against the textbook: the gradient of compute_loss, scaled to a global
    # norm of at most max_grad_norm, then Adam (beta 0.9, 0.999, eps 1e-5, bias-corrected).
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(2)
    batch = 16
    minibatch = (torch.randint(0, 256, (batch, 4, 84, 84), dtype=torch.uint8, generator=generator),
                 torch.randint(0, 4, (batch,), generator=generator),
                 *(torch.randn(batch, generator=generator) for _ in range(4)))
    config = pa.Config(learning_rate=1e-3, max_grad_norm=0.5)
    model = pa.Model(num_actions=4)
    reference = {name: p.detach().clone() for name, p in model.named_parameters()}
    first, second = {name: torch.zeros_like(p) for name, p in reference.items()}, {name: torch.zeros_like(p) for name, p in reference.items()}
    trainer = pa.Trainer(model, config)
    clipped = 0
    for step in (1, 2):
        reference_model = pa.Model(num_actions=4)
        reference_model.load_state_dict(reference)
        loss, _ = pa.Trainer(reference_model, config).compute_loss(pa.Minibatch(*minibatch))
        grads = dict(zip(reference, torch.autograd.grad(loss, list(reference_model.parameters()))))
        norm = torch.sqrt(sum((g ** 2).sum() for g in grads.values()))
        scale = min(1.0, config.max_grad_norm / (float(norm) + 1e-6))
        clipped += scale < 1.0
        for name, g in grads.items():
            g = g * scale
            first[name] = 0.9 * first[name] + 0.1 * g
            second[name] = 0.999 * second[name] + 0.001 * g ** 2
            step_size = config.learning_rate / (1 - 0.9 ** step)
            denominator = (second[name] / (1 - 0.999 ** step)).sqrt() + 1e-5
            reference[name] = reference[name] - step_size * first[name] / denominator
        trainer.gradient_step(pa.Minibatch(*minibatch))
    assert clipped >= 1  # the clip was exercised
    for name, p in model.named_parameters():
        assert torch.allclose(p.detach(), reference[name], rtol=1e-4, atol=1e-6), name
    # eps matters here: with 1e-8 the smallest gradients would move their weights visibly further
    assert any(float(second[name].min().sqrt()) < 1e-4 for name in second)


def test_bfloat16_rounds_the_body_but_keeps_float32_heads_weights_and_gradients():
    torch.manual_seed(0)
    obs = torch.randint(0, 256, (16, 4, 84, 84), dtype=torch.uint8)
    exact, rounded = pa.Model(num_actions=4), pa.Model(num_actions=4, bfloat16=True)
    rounded.load_state_dict(exact.state_dict())
    (logits, values), (logits_bf16, values_bf16) = exact(obs), rounded(obs)
    assert logits_bf16.dtype == values_bf16.dtype == torch.float32
    assert not torch.equal(values, values_bf16)  # the body did run in bfloat16...
    assert torch.allclose(values, values_bf16, rtol=0.05, atol=0.05)  # ...to about 3 significant digits
    assert torch.allclose(logits, logits_bf16, rtol=0.05, atol=1e-3)
    values_bf16.sum().backward()
    assert all(p.grad.dtype == torch.float32 for p in rounded.parameters() if p.grad is not None)


def test_compiled_and_eager_updates_give_the_same_loss_and_gradients():
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    batch = 32
    obs = torch.randint(0, 256, (batch, 4, 84, 84), dtype=torch.uint8, generator=generator)
    actions = torch.randint(0, 4, (batch,), generator=generator)
    old_log_prob = torch.log(torch.full((batch,), 0.25)) + 0.1 * torch.randn(batch, generator=generator)
    advantages, returns, old_value = (torch.randn(batch, generator=generator) for _ in range(3))
    eager_model, compiled_model = pa.Model(num_actions=4), pa.Model(num_actions=4)
    compiled_model.load_state_dict(eager_model.state_dict())
    results = []
    for model, compiled in ((eager_model, False), (compiled_model, True)):
        trainer = pa.Trainer(model, pa.Config())
        compute_loss = torch.compile(trainer.compute_loss) if compiled else trainer.compute_loss
        loss, stats = compute_loss(pa.Minibatch(obs, actions, old_log_prob, advantages, returns, old_value))
        loss.backward()
        results.append((loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}))
    (eager_loss, eager_grads), (compiled_loss, compiled_grads) = results
    assert torch.allclose(eager_loss, compiled_loss, rtol=1e-4, atol=1e-6)
    for name in eager_grads:
        assert torch.allclose(eager_grads[name], compiled_grads[name], rtol=1e-3, atol=1e-6), name


def test_a_machine_that_cannot_compile_runs_eagerly_with_one_warning(tmp_path, monkeypatch, capsys):
    def cannot_compile(function, **options):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(pa.torch, "compile", cannot_compile)
    config = pa.Config(compile=True, num_envs=2, num_steps=32, num_minibatches=2, total_timesteps=64,
                       num_workers=0, run_dir=str(tmp_path))
    summary = pa.Main(config).run()
    captured = capsys.readouterr()
    warnings = [line for line in captured.err.splitlines() if "torch.compile" in line]
    assert warnings == ["warning: torch.compile failed (RuntimeError: no compiler here); running eagerly"]
    assert summary["steps"] == 64
    # the start-up line names the learner as asked for (compiled), before compiling was tried
    assert "learner: the lesson's torch code (Model, Trainer, compute_gae), torch.compile" in \
        captured.out.splitlines()


@pytest.mark.parametrize("backend,workers,engine", [
    ("ale-vector", 0, "engine: ale-py's vector engine (C++), the same game as Game; "
                      "--env-backend game plays the lesson's Game"),
    ("game", 2, "engine: the lesson's Game, 1 per Worker in 2 child processes"),
    ("game", 0, "engine: the lesson's Game, in this process"),
])
def test_the_start_up_lines_name_the_learner_and_the_engine(backend, workers, engine, tmp_path, capsys):
    pa.Main(pa.Config(num_envs=2, num_steps=32, num_minibatches=2, total_timesteps=64, num_workers=workers,
                      env_backend=backend, compile=False, run_dir=str(tmp_path))).run()
    lines = capsys.readouterr().out.splitlines()
    assert "learner: the lesson's torch code (Model, Trainer, compute_gae)" in lines
    assert engine in lines


def test_the_lesson_alone_trains_the_network_the_whole_file_trains_with_the_lessons_game(tmp_path):
    # The file cut at the banner, run as a pasted notebook cell: it defines everything it uses, and
    # its plain Run (the Games in Workers) trains bitwise the network of the whole file's
    # --env-backend game (RunGuard, GuardedWorkers).
    source = (ROOT / "ppo_atari.py").read_text()
    namespace = {"__name__": "lesson"}
    exec(compile(source[:source.index("\n# ==== Below")], "lesson", "exec"), namespace)
    settings = dict(seed=3, num_envs=2, num_steps=32, num_minibatches=2, total_timesteps=128, num_workers=2,
                    compile=False, device="cpu")
    alone = namespace["Main"](namespace["Config"](**settings))
    summary = alone.run()
    assert {"script", "env", "seed", "steps", "seconds", "episodes", "mean_return_100", "solved_step"} <= set(summary)
    assert summary["steps"] == 128 and summary["script"] == "ppo_atari" and summary["solved_step"] is None
    assert "RunGuard" not in namespace and isinstance(alone.guard, namespace["Run"])
    whole = pa.Main(pa.Config(**settings, env_backend="game", run_dir=str(tmp_path)))
    whole.run()
    trained = alone.model.state_dict()
    assert trained.keys() == whole.model.state_dict().keys()
    for key, value in whole.model.state_dict().items():
        assert torch.equal(trained[key], value), key
    assert not torch.equal(trained["actor.weight"], pa.Model(4).actor.weight)  # it did learn something


def test_a_time_limit_cut_gets_gamma_times_the_value_of_its_final_observation_and_a_death_nothing():
    # Three games through Main.collect_rollout: on the second step, game 0 is cut by the time limit
    # (truncated, not terminated), game 1 loses a life (terminated), game 2 both at once. Only game 0's
    # reward gets gamma * V(final observation): its episode would have gone on (compute_gae's convention).
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    observations = lambda: torch.randint(0, 256, (3, 4, 84, 84), dtype=torch.uint8, generator=generator)
    final_obs = observations()
    no, rewards = np.zeros(3, dtype=bool), [np.array([1.0, -1.0, 0.0], np.float32), np.array([1.0, -1.0, 1.0], np.float32)]
    results = [pa.StepResult(rewards[0], no, no, {}, {}),
               pa.StepResult(rewards[1], np.array([False, True, True]), np.array([True, False, True]),
                             {i: final_obs[i].numpy() for i in range(3)}, {0: {"return": 4.0, "length": 2}})]

    class Games:  # what an engine gives the loop
        def __init__(self):
            self.obs, self.played = observations(), 0

        def observations(self):
            return self.obs

        def step(self, actions):
            self.obs, self.played = observations(), self.played + 1
            return results[self.played - 1]

    config, ended = pa.Config(num_envs=3, num_steps=2, gamma=0.9), []
    main = pa.Main(config)
    main.model, main.rollout, main.games, main.global_step = pa.Model(4), pa.Rollout(config, torch.device("cpu")), Games(), 0
    main.guard = types.SimpleNamespace(device=torch.device("cpu"), steps_per_step=3, stop_at_once=lambda: False,
                                       after_rollout=ended.extend)
    main.collect_rollout(main.games.observations())
    with torch.no_grad():
        value = main.model.value(final_obs)[0]
    assert abs(value.item()) > 1e-3  # (so that a missing bootstrap shows)
    expected = torch.tensor([[1.0, -1.0, 0.0], [1.0, -1.0, 1.0]])
    expected[1, 0] += 0.9 * value
    torch.testing.assert_close(main.rollout.rewards, expected, rtol=0, atol=1e-6)
    assert main.rollout.dones.tolist() == [[0, 0, 0], [1, 1, 1]]  # GAE stops at all three
    assert main.global_step == 6 and ended == [(6, {"return": 4.0, "length": 2})]


def test_a_checkpoint_that_names_the_actor_policy_still_loads():
    # Before the heads were named actor and critic in every script, ppo_atari.py's actor was `policy`.
    model = pa.Model(4)
    older = {key.replace("actor.", "policy.", 1): value for key, value in model.state_dict().items()}
    assert "policy.weight" in older and "actor.weight" not in older
    loaded = pa.Model(4)
    pa.load_weights(loaded, older, pa.Config())
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
