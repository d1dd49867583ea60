"""The shape every script shares: the lesson (PPO, complete) above a banner, the machinery below;
the lesson's measures; the same parts in the same order with the same names in every script; no
line wider than a notebook cell."""
import ast
import re

import pytest

from conftest import ROOT

SCRIPTS = ["ppo_atari.py", "ppo_cartpole.py", "ppo_continuous.py", "ppo_memory.py",
           "ppo_multiagent.py", "ppo_spaces.py"]
BANNER = "# ==== Below: speed, safety and scale. PPO is complete above."
# The lesson's measures (GUIDE.md, section 1, and issue 35): the lesson runs alone, so it now holds
# its plain run (Run, StepResult, Worker.step, the env's sizes: 57-67 lines) on top of what it held;
# ppo_multiagent.py's return statistics and ppo_spaces.py's observation normalisation moved into it.
# GUIDE's targets (500; memory 650; multiagent and spaces 600) are not met: benchmarks/README.md,
# "The lessons' measures", says where the lines go. These limits keep a lesson, and a file, from
# growing back.
LESSON_LINES = {"ppo_atari.py": 561, "ppo_cartpole.py": 621, "ppo_continuous.py": 617,
                "ppo_memory.py": 826, "ppo_multiagent.py": 751, "ppo_spaces.py": 774}
FILE_LINES = {"ppo_atari.py": 1627, "ppo_cartpole.py": 1816, "ppo_continuous.py": 2216,
              "ppo_memory.py": 1914, "ppo_multiagent.py": 1957, "ppo_spaces.py": 2070}
LONGEST_DEFINITION = 150
NAMES_FROM_BELOW = 2
LESSON = ["Config", "parse_config", "Game", "Worker", "layer", "Model", "compute_gae", "Minibatch",
          "Rollout", "Trainer", "Main"]
MAIN_METHODS = ["__init__", "run", "train", "anneal_learning_rate", "collect_rollout",
                "estimate_advantages", "learn"]
MACHINERY = ["GuardedWorker", "InProcessWorker", "WorkerPool", "compile_learner",
             "Ranks", "RunGuard", "RunLog", "learner_state", "restore_learner",
             "continued_schedule", "save_checkpoint", "find_checkpoint", "load_checkpoint",
             "resumed_config", "evaluate_checkpoint", "check_settings", "inspect_env",
             "pick_device", "make_run_dir", "command_line"]


def parsed(script):
    source = (ROOT / script).read_text()
    return source, ast.parse(source)


def top_level(tree):
    return {node.name: node for node in tree.body
            if isinstance(node, (ast.ClassDef, ast.FunctionDef))}


def banner_line(source):
    banners = [number for number, line in enumerate(source.splitlines(), 1)
               if line.startswith(BANNER)]
    assert len(banners) == 1, banners
    return banners[0]


@pytest.mark.parametrize("script", SCRIPTS)
def test_the_lesson_ends_at_the_banner_and_holds_the_parts_in_order(script):
    source, tree = parsed(script)
    banner = banner_line(source)
    above = [name for name, node in top_level(tree).items() if node.lineno < banner]
    assert [name for name in above if name in LESSON] == LESSON  # all of them, in this order


@pytest.mark.parametrize("script", SCRIPTS)
def test_the_lesson_measures(script):
    source, tree = parsed(script)
    banner = banner_line(source)
    assert banner - 1 <= LESSON_LINES[script]
    assert len(source.splitlines()) <= FILE_LINES[script]
    lengths = {name: node.end_lineno - node.lineno + 1 for name, node in top_level(tree).items()}
    assert {name: n for name, n in lengths.items() if n > LONGEST_DEFINITION} == {}
    below = {node.name for node in tree.body if node.lineno > banner
             and isinstance(node, (ast.ClassDef, ast.FunctionDef))}
    below |= {target.id for node in tree.body if isinstance(node, ast.Assign)
              and node.lineno > banner for target in node.targets if isinstance(target, ast.Name)}
    used = {name.id for node in tree.body if node.lineno < banner for name in ast.walk(node)
            if isinstance(name, ast.Name) and name.id in below}
    assert used <= {"RunGuard", "evaluate_checkpoint"} and len(used) <= NAMES_FROM_BELOW


@pytest.mark.parametrize("script", SCRIPTS)
def test_torchrun_and_the_processes_plumbing_stay_below_the_banner(script):
    source, _ = parsed(script)
    lesson = source[:source.index(BANNER)]
    for systems_word in ("signal.", "os._exit", "sentinel", "dist.", "world_size", "WorkerError"):
        assert systems_word not in lesson, systems_word
    assert len(re.findall(r"self\.average_gradients\(", lesson)) == 1  # the one torchrun hook


@pytest.mark.parametrize("script", SCRIPTS)
def test_the_ratio_has_a_symbol_of_its_own_and_the_derivations_are_where_they_are_computed(script):
    _, tree = parsed(script)
    definitions = top_level(tree)
    docstring = ast.get_docstring(tree)
    assert "r_t = pi" not in docstring and "rho_t" in docstring
    gae = ast.get_docstring(definitions["compute_gae"])
    assert "k-step" in gae or "A_t^(k)" in gae  # GAE from the k-step estimators
    trainer = definitions["Trainer"]
    ppo_loss = next(node for node in trainer.body if getattr(node, "name", None) == "ppo_loss")
    derivation = ast.get_docstring(ppo_loss)
    for idea in ("Importance sampling", "Why clip", "Why the minimum", "rho_t"):
        assert idea.lower() in derivation.lower(), idea


@pytest.mark.parametrize("script", SCRIPTS)
def test_model_trainer_and_main_share_no_method_name_and_train_fits_a_screen(script):
    _, tree = parsed(script)
    definitions = top_level(tree)
    methods = {name: {node.name for node in definitions[name].body
                      if isinstance(node, ast.FunctionDef)} - {"__init__"}
               for name in ("Model", "Trainer", "Main")}
    assert not methods["Model"] & methods["Trainer"]
    assert not methods["Model"] & methods["Main"]
    assert not methods["Trainer"] & methods["Main"]
    main = definitions["Main"]
    assert [node.name for node in main.body if isinstance(node, ast.FunctionDef)] == MAIN_METHODS
    train = next(node for node in main.body if getattr(node, "name", None) == "train")
    assert train.end_lineno - train.lineno + 1 <= 40


@pytest.mark.parametrize("script", SCRIPTS)
def test_the_machinery_has_the_same_parts_in_the_same_order(script):
    _, tree = parsed(script)
    definitions = list(top_level(tree))
    assert [name for name in definitions if name in MACHINERY] == MACHINERY


# The machinery that is the same in every script, byte for byte: a fix made in one is copied to all.
SAME_EVERYWHERE = ["Adam", "not_the_cuda_home_warning", "Ranks", "RankError", "UsageError",
                   "WorkerError", "Interrupted", "NonFiniteLoss", "FAILURES", "load_optimizer",
                   "continued_schedule", "save_checkpoint", "find_checkpoint", "load_checkpoint",
                   "RANGES", "pick_device", "RUN_FILES", "typed_fields", "tell", "command_line",
                   "refuse_what_will_not_fit", "StopSignals"]


def definition_texts(script):
    """Each module-level definition's source text, decorators included: {name: text}."""
    source, tree = parsed(script)
    lines, texts = source.splitlines(), {}
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
            name = node.name
        elif isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
        else:
            continue
        start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        texts[name] = "\n".join(lines[start - 1:node.end_lineno])
    return texts


@pytest.mark.parametrize("name", SAME_EVERYWHERE)
def test_the_shared_machinery_is_byte_identical_in_every_script(name):
    texts = {script: definition_texts(script).get(name) for script in SCRIPTS}
    assert None not in texts.values(), [script for script, text in texts.items() if text is None]
    first = texts[SCRIPTS[0]]
    assert [script for script, text in texts.items() if text != first] == []


def test_one_name_means_one_thing_in_every_script():
    trees = {script: parsed(script)[1] for script in SCRIPTS}
    for script, tree in trees.items():
        definitions = top_level(tree)
        assert "orthogonal" not in definitions and "layer" in definitions, script
        compile_learner = definitions["compile_learner"]
        assert [arg.arg for arg in compile_learner.args.args] == ["main"], script
        config_fields = {node.target.id for node in definitions["Config"].body
                         if isinstance(node, ast.AnnAssign)}
        assert "normalize_obs" not in config_fields, script
        game = definitions["Game"]
        init = next(node for node in game.body if getattr(node, "name", None) == "__init__")
        assert "num_envs" not in [arg.arg for arg in init.args.args], script  # a Game is one env
    for script in ("ppo_continuous.py", "ppo_memory.py"):
        assert "RunningMeanStd" in top_level(trees[script]), script


@pytest.mark.parametrize("script", SCRIPTS)
def test_no_line_is_wider_than_100_columns_and_no_file_outside_the_repository_is_named(script):
    source, _ = parsed(script)
    wide = [number for number, line in enumerate(source.splitlines(), 1) if len(line) > 100]
    assert wide == []
    assert "GUIDE.md" not in source and "../shared" not in source
