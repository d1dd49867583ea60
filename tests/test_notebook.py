"""Every script in a real Jupyter kernel (ipykernel, driven by nbclient and jupyter_client): pasted
whole into a cell, imported, and run with %run; what a run changes in the kernel is given back;
interrupting the kernel stops a run cleanly."""
import json
import queue
import time
from pathlib import Path

import nbformat
import pytest
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient

from conftest import ROOT, children, wait_until_gone

SMALL = {  # a few updates of each, in worker processes (a notebook forks them too)
    "ppo_cartpole": "num_envs=8, num_steps=16, num_workers=2, total_timesteps=512",
    "ppo_atari": "num_envs=2, num_steps=32, num_workers=2, num_minibatches=2, total_timesteps=128, "
                 "env_backend='game', compile=False",
    "ppo_continuous": "num_envs=8, num_steps=16, num_workers=2, total_timesteps=512",
    "ppo_memory": "memory='lstm', num_envs=8, num_steps=16, num_workers=2, total_timesteps=512",
    "ppo_multiagent": "num_envs=4, num_steps=25, num_workers=2, total_timesteps=600",
}
# The flags of a short `%run` of each: a budget first, as `--total-timesteps N`.
PERCENT_RUN = {"ppo_cartpole": "--total-timesteps 20000",
               "ppo_atari": "--total-timesteps 128 --num-envs 2 --num-steps 32 "
                            "--num-minibatches 2 --no-compile",
               "ppo_continuous": "--total-timesteps 2048 --num-envs 4 --num-steps 64",
               "ppo_memory": "--total-timesteps 4096 --num-envs 8 --num-steps 32",
               "ppo_multiagent": "--total-timesteps 600 --num-envs 4"}
# What a run may differ in from a same-seed run: the clock.
TIMINGS = {"seconds", "warmup_seconds", "steps_per_second", "solved_seconds", "checkpoint"}


def run_notebook(cells, tmp_path):
    """Execute the cells in a fresh kernel started in the repository root; return each cell's text."""
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(cell) for cell in cells])
    NotebookClient(notebook, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(ROOT)}}).execute()
    return ["".join(output.get("text", "") for output in cell.outputs) for cell in notebook.cells]


def process_state_cell():
    """A cell that prints what a run must leave as it found it: SIGINT's handler, torch's threads."""
    return ("import signal, torch\n"
            "print(json.dumps([str(signal.getsignal(signal.SIGINT)), torch.get_num_threads()]))")


def summaries_of(output):
    return [json.loads(line) for line in output.splitlines() if line.startswith("{")]


@pytest.mark.parametrize("script", sorted(SMALL))
def test_pasted_into_a_cell_it_defines_everything_and_starts_nothing(script, tmp_path):
    source = (ROOT / f"{script}.py").read_text()
    run = f"Main(Config(seed=3, run_dir={str(tmp_path / 'run')!r}, {SMALL[script]})).run()"
    outputs = run_notebook([
        "import json\n" + process_state_cell(),
        source,  # the whole file, as a user pastes it
        "print('defined:', callable(Main), 'runs:', len(list(__import__('pathlib').Path("
        f"{str(tmp_path)!r}).iterdir())))",
        f"print(json.dumps({run}))\nprint(json.dumps({run.replace('seed=3,', 'seed=3, overwrite=True,')}))",
        process_state_cell(),
        # a failing run gives back what it changed too (here: an env it cannot make)
        "try:\n    Main(Config(env='NoSuchEnv-v0')).run()\nexcept UsageError as error:\n"
        "    print('refused:', error)\n" + process_state_cell(),
    ], tmp_path)
    assert outputs[1] == ""  # defining everything prints nothing, and parses no kernel argument
    assert outputs[2] == "defined: True runs: 0\n"  # and starts no run
    first, second = summaries_of(outputs[3])
    assert first["steps"] == second["steps"] > 0 and not first["interrupted"]
    assert {key: value for key, value in first.items() if key not in TIMINGS} == \
        {key: value for key, value in second.items() if key not in TIMINGS}
    assert outputs[4] == outputs[0]  # SIGINT handler and thread count as before the runs
    refused, state = outputs[5].splitlines()
    # Each script says why in its own words (an unknown gymnasium id, or not a PettingZoo module).
    assert refused.startswith("refused: ") and "'NoSuchEnv-v0'" in refused
    assert state + "\n" == outputs[0]


@pytest.mark.parametrize("script", sorted(SMALL))
def test_imported_and_run_with_percent_run(script, tmp_path):
    flags = PERCENT_RUN[script]
    outputs = run_notebook([
        f"import json\nfrom {script} import Config, Main\n"
        f"print(json.dumps(Main(Config(run_dir={str(tmp_path / 'imported')!r}, {SMALL[script]})).run()))",
        f"%run {script}.py {flags} --run-dir {tmp_path / 'percent_run'}",
    ], tmp_path)
    assert summaries_of(outputs[0])[0]["script"] == script
    summary = json.loads((tmp_path / "percent_run" / "summary.json").read_text())
    budget = int(flags.split()[1])  # whole rollouts: at least the budget, less than a rollout more
    assert budget <= summary["steps"] < budget + 2048 and not summary["interrupted"]
    assert "finished at step" in outputs[1]


def test_interrupting_the_kernel_saves_and_leaves_no_worker(tmp_path):
    kernel = KernelManager(kernel_name="python3")
    kernel.start_kernel(cwd=str(ROOT))
    client = kernel.client()
    client.start_channels()
    try:
        client.wait_for_ready(timeout=60)
        run_dir = tmp_path / "run"
        message = client.execute(
            "import json\nfrom ppo_cartpole import Config, Main\n"
            f"summary = Main(Config(total_timesteps=10**8, num_envs=8, num_steps=16, num_workers=2, "
            f"checkpoint_every=128, run_dir={str(run_dir)!r})).run()\n"
            "print(json.dumps(summary))")
        deadline = time.monotonic() + 120
        while not (run_dir / "checkpoint.pt").exists():
            assert time.monotonic() < deadline, "no checkpoint within 120 s"
            time.sleep(0.1)
        # Its workers; multiprocessing's resource tracker stays with the kernel, as it should.
        workers = [child for child in children(kernel.provisioner.process.pid)
                   if b"resource_tracker" not in (Path("/proc") / str(child) / "cmdline").read_bytes()]
        assert len(workers) == 2
        kernel.interrupt_kernel()
        reply = client.get_shell_msg(timeout=60)
        while reply["parent_header"].get("msg_id") != message:
            reply = client.get_shell_msg(timeout=60)
        assert reply["content"]["status"] == "ok"  # no KeyboardInterrupt, no SystemExit
        printed = []
        while True:
            try:
                output = client.get_iopub_msg(timeout=5)
            except queue.Empty:
                break
            printed.append(output["content"].get("text", ""))
        summary = json.loads([line for line in "".join(printed).splitlines() if line.startswith("{")][0])
        assert summary["interrupted"] is True
        assert json.loads((run_dir / "summary.json").read_text())["interrupted"] is True
        assert (run_dir / "checkpoint.pt").exists()
        assert wait_until_gone(workers)
        assert kernel.is_alive()  # the kernel goes on
    finally:
        client.stop_channels()
        kernel.shutdown_kernel(now=True)
