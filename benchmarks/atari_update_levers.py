"""One PPO minibatch update of ppo_atari.py, timed alone under each speed lever.

What it measures: the milliseconds of `Trainer.gradient_step` (forward, loss, backward, gradient clip, Adam)
on one minibatch of 256 random uint8 observations, after 3 warm-up updates (which hold any
compilation), for eager vs channels-last weights vs torch.compile (default and max-autotune modes),
1 vs 2 torch threads, and, for comparison only, bfloat16 autocast (a change of precision, which
ppo_atari.py does not make). It isolates the update, which the training loop spends most of its time
in; `atari_throughput.py` measures what the levers give in the whole loop.

    python benchmarks/atari_update_levers.py
"""
import datetime
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import ppo_atari  # noqa: E402  (the script under test, from the repository root)

MINIBATCH = 256
REPEATS = 20


def time_update(channels_last: bool, compiled, threads: int, bfloat16: bool = False):
    """(ms per update after warm-up, seconds of the 3 warm-up updates). `compiled`: False or a
    torch.compile mode."""
    torch.manual_seed(0)
    torch.set_num_threads(threads)
    model = ppo_atari.Model(num_actions=4)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    trainer = ppo_atari.Trainer(model, ppo_atari.Config())
    if compiled:
        trainer.compute_loss = torch.compile(trainer.compute_loss, mode=compiled)
    if bfloat16:
        loss = trainer.compute_loss
        trainer.compute_loss = lambda *args: torch.autocast("cpu", dtype=torch.bfloat16)(loss)(*args)
    batch = ppo_atari.Minibatch(torch.randint(0, 256, (MINIBATCH, 4, 84, 84), dtype=torch.uint8),
                                torch.randint(0, 4, (MINIBATCH,)), torch.randn(MINIBATCH) - 1.4,
                                torch.randn(MINIBATCH), torch.randn(MINIBATCH), torch.randn(MINIBATCH))
    start = time.perf_counter()
    for _ in range(3):
        trainer.gradient_step(batch)
    warm_up = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(REPEATS):
        trainer.gradient_step(batch)
    return (time.perf_counter() - start) / REPEATS * 1000, warm_up


def main():
    print("| layout | compile | threads | precision | ms per minibatch update | warm-up s (3 updates) |")
    print("| --- | --- | ---: | --- | ---: | ---: |")
    for channels_last, compiled, threads, bfloat16 in [
            (False, False, 2, False), (True, False, 2, False), (False, False, 1, False),
            (False, "default", 2, False), (True, "default", 2, False), (True, "max-autotune", 2, False),
            (True, "default", 2, True)]:
        ms, warm_up = time_update(channels_last, compiled, threads, bfloat16)
        layout = "channels-last" if channels_last else "contiguous"
        precision = "bfloat16 autocast" if bfloat16 else "float32"
        print(f"| {layout} | {compiled or 'off'} | {threads} | {precision} | {ms:.0f} | {warm_up:.1f} |", flush=True)
    print(f"\nminibatch {MINIBATCH}, mean of {REPEATS} updates; machine: {platform.processor() or platform.machine()}, "
          f"{torch.get_num_threads()} threads max, python {platform.python_version()}, torch {torch.__version__}; "
          f"date {datetime.date.today()}")


if __name__ == "__main__":
    main()
