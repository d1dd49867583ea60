"""The shape every script shares: the lesson (PPO, complete) above a banner, the machinery below; the
same parts in the same order with the same names; no line wider than a notebook cell."""
import ast

import pytest

from conftest import ROOT

BANNER = "# ==== Below: speed, safety and scale. PPO is complete above."
# The latest line the banner may stand on: the lesson stays short enough to read in one sitting.
LESSON_LINES = {"ppo_cartpole.py": 600, "ppo_atari.py": 700, "ppo_continuous.py": 600,
                "ppo_memory.py": 600, "ppo_multiagent.py": 800}
LESSON = ["Config", "Game", "Worker", "Model", "compute_gae", "Minibatch", "Trainer", "Main"]
MAIN_METHODS = ["__init__", "run", "train", "anneal_learning_rate", "collect_rollout",
                "estimate_advantages", "learn"]


def parsed(script):
    source = (ROOT / script).read_text()
    return source, ast.parse(source)


def top_level(tree):
    return {node.name: node for node in tree.body if isinstance(node, (ast.ClassDef, ast.FunctionDef))}


@pytest.mark.parametrize("script", sorted(LESSON_LINES))
def test_the_lesson_ends_at_the_banner_and_holds_the_parts_in_order(script):
    source, tree = parsed(script)
    lines = source.splitlines()
    banners = [number for number, line in enumerate(lines, 1) if line.startswith(BANNER)]
    assert len(banners) == 1 and banners[0] <= LESSON_LINES[script], banners
    definitions = top_level(tree)
    above = [name for name, node in definitions.items() if node.lineno < banners[0]]
    assert [name for name in above if name in LESSON] == LESSON  # all of them, in this order
    # Above the banner: the lesson and the `option` helper of Config, and the helpers of the parts.
    assert set(above) - set(LESSON) <= {"option", "step_game", "step_games", "layer", "orthogonal"}


@pytest.mark.parametrize("script", sorted(LESSON_LINES))
def test_model_trainer_and_main_share_no_method_name_and_train_fits_a_screen(script):
    _, tree = parsed(script)
    definitions = top_level(tree)
    methods = {name: {node.name for node in definitions[name].body if isinstance(node, ast.FunctionDef)}
               for name in ("Model", "Trainer", "Main")}
    methods = {name: names - {"__init__"} for name, names in methods.items()}
    assert not methods["Model"] & methods["Trainer"]
    assert not methods["Model"] & methods["Main"]
    assert not methods["Trainer"] & methods["Main"]
    main = definitions["Main"]
    assert [node.name for node in main.body if isinstance(node, ast.FunctionDef)] == MAIN_METHODS
    train = next(node for node in main.body if getattr(node, "name", None) == "train")
    assert train.end_lineno - train.lineno + 1 <= 40


def members(tree, name):
    node = top_level(tree)[name]
    return ({item.name for item in node.body if isinstance(item, ast.FunctionDef)}
            | {item.target.id for item in node.body if isinstance(item, ast.AnnAssign)})


def test_both_scripts_name_the_same_things_alike():
    _, cartpole = parsed("ppo_cartpole.py")
    _, atari = parsed("ppo_atari.py")
    for name in ("Minibatch", "Worker", "Trainer", "Main", "RunGuard"):
        assert members(cartpole, name) == members(atari, name), name
    # Atari's step result and rollout add what stored-once frames need (`restarted`, the pictures).
    for name in ("StepResult", "Rollout", "WorkerPool"):
        assert members(cartpole, name) - {"observations"} <= members(atari, name), name
    machinery = ["Ranks", "RunGuard", "learner_state", "restore_learner", "save_checkpoint",
                 "load_checkpoint", "resumed_config", "evaluate_checkpoint", "check_settings",
                 "inspect_env", "parse_config", "command_line"]
    for tree in (cartpole, atari):
        definitions = list(top_level(tree))
        assert [name for name in definitions if name in machinery] == machinery


@pytest.mark.parametrize("script", sorted(LESSON_LINES))
def test_no_line_is_wider_than_100_columns_and_no_file_outside_the_repository_is_named(script):
    source, _ = parsed(script)
    wide = [number for number, line in enumerate(source.splitlines(), 1) if len(line) > 100]
    assert wide == []
    assert "GUIDE.md" not in source and "../shared" not in source
