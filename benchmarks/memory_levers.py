r"""One run of `ppo_memory.py` with a lever set, for the recurrent kinds' sweep of issue 24.

    OMP_NUM_THREADS=1 python benchmarks/memory_levers.py NAME [--clip-apart]
        [--give-up STEP MEAN] -- [ppo_memory flags]

runs `Main(Config(...)).run()` in this process with the flags after `--` (every other setting at
its kind's default) and writes benchmarks/results/memory_levers/NAME.json: the flags, the kind's
settings the run used (`settings`: KIND_FIELDS, defaults included), the step at which the
100-episode mean reached `--target-return` (if it did), the mean at the end, its best and where,
the "late drop" (memory_popgym.py's: the largest fall of the mean below its best so far in the
last quarter of the run, in per cent of that best's height above a random policy's, `RANDOM`),
and every episode's (step, return). Runs stop early where hopeless (`--give-up STEP MEAN`: still
below MEAN at STEP). `--clip-apart` clips the actor's and the critic's gradients each to
max_grad_norm instead of all together. `--table` prints every kept result as one markdown table.
"""

import json
import statistics
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS = REPO_ROOT / "benchmarks" / "results" / "memory_levers"
RANDOM = {"StatelessCartPole-v1": 22.0, "StatelessAcrobot-v1": -500.0}


def means_100(episodes):
    returns = [r for _, r in episodes]
    return [(episodes[i][0], statistics.fmean(returns[i - 99:i + 1]))
            for i in range(99, len(returns))]


def late_drop(episodes, random_mean, end):
    best, drop = None, 0.0
    for step, mean in means_100(episodes):
        best = mean if best is None else max(best, mean)
        if step >= 0.75 * end and best > random_mean:
            drop = max(drop, (best - mean) / (best - random_mean))
    return drop


def run(name, argv):
    sys.path.insert(0, str(REPO_ROOT))
    import torch
    import ppo_memory as pm

    clip_apart = "--clip-apart" in argv
    give_up = None
    if "--give-up" in argv:
        i = argv.index("--give-up")
        give_up = (float(argv[i + 1]), float(argv[i + 2]))
        argv = argv[:i] + argv[i + 3:]
    argv = [a for a in argv if a != "--clip-apart"]
    flags = argv[argv.index("--") + 1:] if "--" in argv else []
    config = pm.parse_config(flags + ["--run-dir", tempfile.mkdtemp(prefix=name), "--overwrite"])
    episodes, hopeless = [], []

    record = pm.RunLog.record_episode

    def record_episode(log, episode, step):
        episodes.append((step, episode["return"]))
        record(log, episode, step)
    pm.RunLog.record_episode = record_episode

    after_rollout = pm.RunGuard.after_rollout

    def after_rollout_or_give_up(guard, ended):
        after_rollout(guard, ended)
        step = guard.main.global_step
        if give_up and step >= give_up[0] and not hopeless:
            mean = statistics.fmean(r for _, r in episodes[-100:])
            if mean < give_up[1]:
                hopeless.append((step, mean))
                raise pm.Interrupted
    pm.RunGuard.after_rollout = after_rollout_or_give_up

    if clip_apart:
        def gradient_step(trainer, minibatch):
            loss, stats = trainer.compute_loss(minibatch)
            trainer.optimizer.zero_grad()
            loss.backward()
            model = trainer.model
            actor = [p for n, p in model.named_parameters() if n.startswith("actor")]
            critic = [p for n, p in model.named_parameters() if not n.startswith("actor")]
            stats["grad_norm"] = torch.nn.utils.clip_grad_norm_(actor, config.max_grad_norm)
            torch.nn.utils.clip_grad_norm_(critic, config.max_grad_norm)
            trainer.optimizer.step()
            return stats
        pm.Trainer.gradient_step = gradient_step

    main = pm.Main(config)
    summary = main.run()
    settings = {name: getattr(main.config, name) for name in pm.KIND_FIELDS}  # with its defaults
    curve = means_100(episodes)
    best = max(curve, key=lambda x: x[1]) if curve else (None, None)
    end = summary["steps"]
    result = {
        "name": name, "flags": flags, "clip_apart": clip_apart, "settings": settings,
        "env": config.env,
        "memory": config.memory, "seed": config.seed, "steps": end,
        "solved_step": summary["solved_step"], "final_mean_100": summary["mean_return_100"],
        "best_mean_100": best[1], "best_step": best[0],
        "late_drop": late_drop(episodes, RANDOM.get(config.env, 0.0), end)
        if summary["solved_step"] is None else None,  # (a run stopped at its target: none)
        "gave_up": hopeless[0] if hopeless else None, "episodes": episodes}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(result))
    print(describe(result))


def describe(r):
    if r["solved_step"] is not None:
        outcome = f"at {r['solved_step']:,}"
    else:
        outcome = (f"{r['final_mean_100']:.1f} at {r['steps']:,} (best {r['best_mean_100']:.1f} "
                   f"at {r['best_step']:,}; late drop {100 * r['late_drop']:.0f}%)")
        if r["gave_up"]:
            outcome += " (stopped: hopeless)"
    extra = " --clip-apart" if r["clip_apart"] else ""
    flags = " ".join(r["flags"])
    if "--gamma" not in r["flags"]:  # the default then (0.98 until it was lstm's and gru's 0.99)
        flags += f" (gamma {r['settings']['gamma']})"
    return f"| {r['name']} | {flags}{extra} | {outcome} |"


if __name__ == "__main__":
    if sys.argv[1] == "--table":
        for path in sorted(RESULTS.glob("*.json")):
            print(describe(json.loads(path.read_text())))
    else:
        run(sys.argv[1], sys.argv[2:])
