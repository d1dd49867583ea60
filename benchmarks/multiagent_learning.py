r"""Does `ppo_multiagent.py` learn MPE2's envs, and how does it compare? Curves over seeds for the
cooperative envs (against Stable-Baselines3 with SuperSuit), matchups against random opponents for
the competitive ones.

`--env` picks the setting (default `simple_spread`):

- `simple_spread` (mpe2.simple_spread_v3, 3 alike agents, cooperative; budget 600,000 agent steps):
  1. `central`: `python ppo_multiagent.py --seed S --total-timesteps N --run-dir <tmp>`, its
     defaults (MAPPO's centralised critic: the value sees the env's global state and the agent's
     one-hot id). Each finished episode's (step, return per agent, length) is read from the run
     dir's TensorBoard event file (`charts/episodic_return`, `charts/episodic_length`).
  2. `independent`: the same with `--no-central-value` (independent PPO).
  3. `continuous`: the same with `--env-kwargs continuous_actions=True` (Box actions, a Gaussian
     policy: MPE2's 5 action numbers in [0, 1], clipped).
  4. `sb3`: Stable-Baselines3 PPO on PettingZoo's documented parameter-sharing recipe (its SB3
     tutorial for vector-observation envs, sb3_waterworld_vector.py): `parallel_env()`,
     `reset(seed=S)`, SuperSuit's `pettingzoo_env_to_vec_env_v1` (each agent a slot of a vector
     env) and `concat_vec_envs_v1(env, 8, num_cpus=2, base_class="stable_baselines3")`, SB3's
     `VecMonitor` to report episodes, then `PPO("MlpPolicy", env, learning_rate=1e-3,
     batch_size=256, seed=S, device="cpu")`, SB3's other defaults (n_steps 2048, 10 epochs, gamma
     0.99), `learn(total_timesteps=N)`, in a child process of this same file (`--_sb3-child`).
     Each slot is one agent: an episode record is one agent's return, and SuperSuit's conversion
     treats the 25-step cut as a death (no bootstrap).
  5. `sb3_continuous`: `sb3` on `parallel_env(continuous_actions=True)` (SB3's Gaussian policy
     on the 5 action numbers, which the env clips to [0, 1]).
  6. `random`: uniformly random actions for every agent, in this process, `--random-episodes`
     episodes (default 100); the return per agent as above.
  With `--race` (after SB3's runs, whose logs may be kept from an earlier call): R = the mean over
  the seeds of SB3's final return (its last 100 episode records), and for each seed
  `python ppo_multiagent.py --seed S --target-return R` with everything else at its defaults; its
  `solved_seconds` against SB3's median wall time for the budget.
- `speaker_listener` (mpe2.simple_speaker_listener_v4: a speaker that sees the goal's colour and
  talks, Discrete(3), observation 3; a listener that hears it and moves, Discrete(5), observation
  11; both paid the same, so the team's return is twice the return per agent; budget 400,000
  agent steps): `ours` (its defaults: a policy group each, `speaker` and `listener`), `sb3` as
  above on SuperSuit's `pad_observations_v0` and `pad_action_space_v0` (PettingZoo's way to give
  two kinds of agent one shared policy: observations padded with zeros to 11, the speaker's
  actions 3 and 4 mean its action 0), and `random`.
- `tag`, `adversary`, `world_comm` (mpe2.simple_tag_v3: 3 predators, 1 prey; simple_adversary_v3:
  1 adversary, 2 agents; simple_world_comm_v3: 1 leader, 3 adversaries, 2 agents; competitive;
  budget 400,000 agent steps): `ours` trains every group at once (its defaults: a group per kind
  of agent) with its run dir kept (`<results-dir>/runs/seed<S>`); each group's curve is read from
  `charts/<group>/episodic_return`. Then the matchups, in this process, `--matchup-episodes`
  episodes each (default 100, sampled actions, env and sampling seeded with the seed): for each
  seed's final checkpoint, each group trained against uniformly random opponents, and all groups
  trained; and all groups random. A trained group should earn more against random opponents than
  a random group does (predators catch more, prey is caught less).

The training runs go one after the other, interleaved over the seeds, so that background load hits
all alike. Run only one benchmark at a time on a machine.

Outputs
-------
Curves: the layout of cartpole_learning.py's (harness.py's): `<results-dir>/<variant>_seed<S>.csv`,
`random.csv`, `runs.json`, `table.md`, the plot (by default
`benchmarks/plots/multiagent_learning.png` for simple_spread, `multiagent_<env>.png` for the
others); with `--race`, `race.md`. Matchups:
`<results-dir>/ours_seed<S>_<group>.csv` (each group's training episodes), `matchups.json`,
`runs.json`, `table.md` and the plot `multiagent_<env>.png` (the matchups' returns per agent, and
each group's training curve).

How to run it (from the repository root)
----------------------------------------
    pip install -r requirements.txt -r benchmarks/requirements.txt
    python benchmarks/multiagent_learning.py --race            # simple_spread, all variants, race
    python benchmarks/multiagent_learning.py --variants continuous   # one more; the others kept
    python benchmarks/multiagent_learning.py --env speaker_listener   # ours, SB3 padded, random
    python benchmarks/multiagent_learning.py --env tag         # also adversary, world_comm
    python benchmarks/multiagent_learning.py --plot-only       # table and plot from the kept logs
    python benchmarks/multiagent_learning.py --env tag --steps 8000 --seeds 1 \
        --matchup-episodes 5 --results-dir /tmp/multiagent_tag_test   # a quick check
"""

import argparse
import dataclasses
import datetime
import json
import shlex
import statistics
import sys
import tempfile
import textwrap
import time

from harness import (REPO_ROOT, WINDOW, Learning, check_learning_arguments, check_ready, display,
                     fmt, learning_arguments, learning_report, load_runs, machine,
                     machine_line, mean_std, read_csv, run_learning, run_our_script,
                     run_ours_logged, run_sb3_logged, run_status, save_run, sb3_learn_and_record,
                     timed_run, warn_if_busy, write_csv)

# This file's top level imports only the standard library (and harness.py, which does too), so that
# the SB3 child pays for its own imports just like our script does.

SCRIPT = REPO_ROOT / "ppo_multiagent.py"
PACKAGES = ("torch", "pettingzoo", "mpe2", "stable-baselines3", "supersuit", "numpy")


@dataclasses.dataclass
class Setting:
    """One --env: the PettingZoo env, how it is shown (curves or matchups), its budget, and for
    curves the variants: ours with extra arguments, SB3 (with padding or not), random."""

    env: str
    mode: str  # "curves" or "matchups"
    steps: int
    our_variants: dict = dataclasses.field(default_factory=dict)  # variant -> our extra arguments
    sb3_pad: bool = False  # SuperSuit's pad_observations_v0 and pad_action_space_v0 for SB3
    sb3_variants: dict = dataclasses.field(default_factory=lambda: {"sb3": {}})  # -> env kwargs


SETTINGS = {
    "simple_spread": Setting("mpe2.simple_spread_v3", "curves", 600_000, {
        "central": [], "independent": ["--no-central-value"],
        "continuous": ["--env-kwargs", "continuous_actions=True"]},
        sb3_variants={"sb3": {}, "sb3_continuous": {"continuous_actions": True}}),
    "speaker_listener": Setting("mpe2.simple_speaker_listener_v4", "curves", 400_000,
                                {"ours": []}, sb3_pad=True),
    "tag": Setting("mpe2.simple_tag_v3", "matchups", 400_000),
    "adversary": Setting("mpe2.simple_adversary_v3", "matchups", 400_000),
    "world_comm": Setting("mpe2.simple_world_comm_v3", "matchups", 400_000),
}
LABELS = {"central": "ours, ppo_multiagent.py (defaults: centralised value, MAPPO)",
          "independent": "ours, --no-central-value (independent PPO)",
          "continuous": "ours, continuous_actions=True (Gaussian policy)",
          "ours": "ours, ppo_multiagent.py (defaults: a policy group per kind of agent)",
          "sb3": "SB3 PPO + SuperSuit parameter sharing (PettingZoo's recipe)",
          "sb3_padded": "SB3 PPO + SuperSuit, observations and actions padded (one policy)",
          "sb3_continuous": "SB3 PPO + SuperSuit, continuous_actions=True (Gaussian policy)",
          "random": "random policy"}
COLORS = {"central": "tab:blue", "independent": "tab:orange", "continuous": "tab:purple",
          "ours": "tab:blue", "sb3": "tab:green", "sb3_continuous": "tab:olive",
          "random": "tab:gray"}


def curves_bench(name, setting):
    variants = (*setting.our_variants, *setting.sb3_variants, "random")
    return Learning(
        name="multiagent_learning" if name == "simple_spread" else f"multiagent_{name}",
        script=SCRIPT, variants=variants,
        labels={v: LABELS["sb3_padded" if v == "sb3" and setting.sb3_pad else v] for v in variants},
        colors={v: COLORS[v] for v in variants}, packages=PACKAGES, unit="episode",
        score="return per agent", x_label="agent steps (all agents of all envs)",
        y_label=f"return per agent (mean of the last {WINDOW} training episodes)",
        note=f"(each anneals its learning rate over it; SB3 does not). Return per agent: the mean "
        f"over the agents of an episode's returns; ours counts an env's episode as one record, SB3 "
        f"each agent's; the value is the mean of each run's last {WINDOW} records at its end "
        f"(stochastic policy); std over seeds; ratio = variant mean / SB3 mean (returns are "
        f"negative: below 1 is better). steps/s: steady training speed in agent steps (from the "
        f"end of the first update), mean over seeds. Random policy: uniformly random actions.",
        legend_loc="lower right")


# --------------------------------------------------------------------------------------------------
# The SB3 reference, run in a child process; the random policy, in this process
# --------------------------------------------------------------------------------------------------


def sb3_child(seed, out_file, total_timesteps, env_id, pad, env_kwargs):
    """Train SB3 PPO on SuperSuit's parameter-sharing conversion of `env_id`'s parallel_env(
    **env_kwargs) (with `pad`: observations and actions padded to one shape first); write every
    finished episode record (one agent's) and the timings as JSON."""
    setup_start = time.perf_counter()
    import importlib

    import supersuit as ss
    from stable_baselines3 import PPO
    from stable_baselines3.common.utils import set_random_seed
    from stable_baselines3.common.vec_env import VecMonitor

    env = importlib.import_module(env_id).parallel_env(**env_kwargs)
    if pad:
        env = ss.pad_action_space_v0(ss.pad_observations_v0(env))
    env.reset(seed=seed)
    env = ss.pettingzoo_env_to_vec_env_v1(env)
    env = ss.concat_vec_envs_v1(env, 8, num_cpus=2, base_class="stable_baselines3")
    env = VecMonitor(env)
    # Not PPO(seed=...): it calls env.seed(), which SuperSuit's vector envs lack (AttributeError,
    # and the worker processes of num_cpus=2 then keep the child alive). The env is seeded above.
    set_random_seed(seed)
    model = PPO("MlpPolicy", env, learning_rate=1e-3, batch_size=256, device="cpu", verbose=0)
    sb3_learn_and_record(model, env, total_timesteps, out_file, setup_start)


def play_random(args):
    """`args.random_count` episodes of uniformly random actions: (returns per agent, lengths,
    how)."""
    import importlib

    import numpy as np

    env = importlib.import_module(args.env).parallel_env()
    rng = np.random.default_rng(args.random_seed)
    returns, lengths = [], []
    env.reset(seed=args.random_seed)  # seeded once; each later reset goes on from there
    while len(returns) < args.random_count:
        totals, length = dict.fromkeys(env.agents, 0.0), 0
        while env.agents:
            actions = {agent: int(rng.integers(env.action_space(agent).n)) for agent in env.agents}
            _, rewards, _, _, _ = env.step(actions)
            for agent, reward in rewards.items():
                totals[agent] += float(reward)
            length += 1
        returns.append(statistics.fmean(totals.values()))
        lengths.append(length)
        env.reset()
    env.close()
    command = (f"in this process: {args.env}.parallel_env(), reset(seed={args.random_seed}) once, "
               f"uniformly random actions, numpy.random.default_rng({args.random_seed}); return "
               f"per agent")
    return returns, lengths, command


def run_variant(variant, seed, args):
    """One training run: (run record, episodes, output tail)."""
    if variant in args.setting.sb3_variants:
        child_args = ["--steps", str(args.steps), "--env", args.env_name, "--sb3-variant", variant]
        return run_sb3_logged(__file__, seed, child_args, args)
    script_args = ["--env", args.env, "--seed", str(seed), "--total-timesteps", str(args.steps),
                   *args.setting.our_variants[variant]]
    return run_ours_logged(SCRIPT, script_args, f"{variant}_seed{seed}", args)


# --------------------------------------------------------------------------------------------------
# Matchups: each group trained against random opponents (competitive envs)
# --------------------------------------------------------------------------------------------------


def read_group_episodes(run_dir):
    """{group: [(step, return per agent, length)]} from `charts/<group>/episodic_return`."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    events.Reload()
    tags = events.Tags()["scalars"]
    lengths = events.Scalars("charts/episodic_length") if "charts/episodic_length" in tags else []
    groups = {}
    for tag in tags:
        parts = tag.split("/")
        if len(parts) == 3 and parts[2] == "episodic_return":
            groups[parts[1]] = [(e.step, e.value, int(n.value))
                                for e, n in zip(events.Scalars(tag), lengths)]
    return groups


def train_matchup_runs(args, info):
    """Train ours on each seed with the run dir kept; keep each group's episodes as CSV."""
    common = {"env": args.env, "machine_line": machine_line(info, PACKAGES), "machine": info,
              "benchmark_command": shlex.join([sys.executable, *sys.argv]), "budget": args.steps}
    for seed in args.seeds:
        run_dir = args.results_dir / "runs" / f"seed{seed}"
        cmd = [sys.executable, str(SCRIPT), "--env", args.env, "--seed", str(seed),
               "--total-timesteps", str(args.steps), "--run-dir", str(run_dir), "--overwrite",
               *shlex.split(args.our_args)]
        print(f"running ours seed {seed} ({args.steps:,} steps) ...", flush=True)
        date = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        with tempfile.TemporaryDirectory(prefix=f"ours_seed{seed}_log_") as log_dir:
            returncode, wall, tail = timed_run(cmd, args.timeout, log_dir)
        summary_path = run_dir / "summary.json"
        summary = json.loads(summary_path.read_text()) if summary_path.exists() else None
        status = run_status(returncode, summary, args.timeout)
        groups = read_group_episodes(run_dir) if run_dir.exists() else {}
        for group, episodes in groups.items():
            write_csv(args.results_dir / f"ours_seed{seed}_{group}.csv",
                      ["step", "return", "length"], episodes)
        save_run(args.results_dir, f"ours_seed{seed}", {
            "variant": "ours", "seed": seed, **common, "date": date, "status": status,
            "exit_status": returncode, "command": shlex.join(cmd), "wall_seconds": round(wall, 2),
            "steps": summary and summary["steps"], "groups": sorted(groups),
            "summary": summary})
        finals = {group: statistics.fmean(e[1] for e in episodes[-WINDOW:])
                  for group, episodes in groups.items() if episodes}
        print(f"  {status}; last {WINDOW} training episodes, return per agent: "
              + ", ".join(f"{group} {value:.2f}" for group, value in finals.items()), flush=True)
        if status != "ok":
            print(tail)


def play(env_id, spec, config, models, trained, episodes, seed):
    """`episodes` episodes with the groups in `trained` played by their models (sampled actions)
    and the others uniformly at random: [{group: return per agent}] of each episode."""
    import numpy as np
    import torch

    import ppo_multiagent as pm

    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    game = pm.Game(env_id, seed, {}, config.agent_id, config.central_value,
                   {group.name: group.slots for group in spec.groups},
                   max(group.row_size for group in spec.groups))
    rows, results = game.reset(), []
    with torch.no_grad():
        while len(results) < episodes:
            actions = np.zeros((spec.num_agents, 1), np.float32)
            for group in spec.groups:
                if group.name in trained:
                    rows_of_group = torch.from_numpy(rows[group.slots, :group.row_size])
                    actions[group.slots, 0] = models[group.name].act(rows_of_group)[0].numpy()
                else:
                    actions[group.slots, 0] = rng.integers(group.num_actions, size=len(group.slots))
            rows, _, _, _, info = game.step(actions)
            if "episode" in info:
                results.append({name: values["return"]
                                for name, values in info["episode"]["groups"].items()})
    game.env.close()
    return results


def play_matchups(args):
    """With each seed's checkpoint: each group trained against random opponents, all trained, and
    all random (no checkpoint needed, played with the seed's env and draws). Kept in
    matchups.json: {matchup: {seed: {group: mean return per agent}}}."""
    sys.path.insert(0, str(REPO_ROOT))
    import torch.nn as nn

    import ppo_multiagent as pm

    matchups = {}
    for seed in args.seeds:
        checkpoint = pm.load_checkpoint(str(args.results_dir / "runs" / f"seed{seed}"))
        fields = {f.name for f in dataclasses.fields(pm.Config)}
        config = pm.Config(**{k: v for k, v in checkpoint["config"].items() if k in fields})
        spec = pm.inspect_env(config)
        models = nn.ModuleDict({g.name: pm.Model(g.policy_size, g.value_size, g.num_actions,
                                                 config.central_value, config.hidden_size)
                                for g in spec.groups})
        models.load_state_dict(pm.grouped_weights(models, checkpoint["model"]))  # older names too
        names = [group.name for group in spec.groups]
        plays = {f"{name} trained, others random": {name} for name in names}
        plays["all trained"] = set(names)
        plays["all random"] = set()
        for matchup, trained in plays.items():
            results = play(args.env, spec, config, models, trained, args.matchup_episodes, seed)
            matchups.setdefault(matchup, {})[seed] = {
                name: statistics.fmean(result[name] for result in results) for name in names}
            print(f"  seed {seed}, {matchup}: " + ", ".join(
                f"{name} {value:.2f}" for name, value in matchups[matchup][seed].items()),
                flush=True)
    (args.results_dir / "matchups.json").write_text(json.dumps(matchups, indent=2) + "\n")
    return matchups


def matchup_report(args):
    """The table (table.md) and the plot, from matchups.json and the kept CSVs."""
    matchups = json.loads((args.results_dir / "matchups.json").read_text())
    runs = load_runs(args.results_dir)
    names = list(next(iter(matchups["all random"].values())))
    lines = ["| matchup | " + " | ".join(f"{name}: return per agent" for name in names) + " |",
             "| --- |" + " ---: |" * len(names)]
    for matchup, seeds in matchups.items():
        cells = []
        for name in names:
            values = [result[name] for result in seeds.values()]
            mean, std = mean_std(values)
            per_seed = " / ".join(f"{v:.2f}" for v in values)
            trained = matchup == "all trained" or matchup.startswith(f"{name} trained")
            bold = "**" if trained and matchup != "all trained" else ""
            cells.append(f"{bold}{mean:.2f}{bold} ± {std:.2f} ({per_seed})" if len(values) > 1
                         else f"{mean:.2f}")
        lines.append(f"| {matchup} | " + " | ".join(cells) + " |")
    training = []
    for name in names:
        finals = [statistics.fmean(e[1] for e in read_csv(path)[-WINDOW:])
                  for seed in args.seeds
                  if (path := args.results_dir / f"ours_seed{seed}_{name}.csv").exists()]
        mean, std = mean_std(finals)
        training.append(f"{name} {fmt(mean, '.2f')} ± {fmt(std, '.2f')}")
    budgets = sorted({r.get("budget") for key, r in runs.items() if key.startswith("ours_seed")})
    note = (f"{args.env}, ppo_multiagent.py with its defaults (a policy group per kind of "
            f"agent), budget {' / '.join(f'{b:,}' for b in budgets)} agent steps per run, seeds "
            f"{', '.join(map(str, args.seeds))}. Each matchup: {args.matchup_episodes} episodes "
            f"per seed (sampled actions; random: uniform), the return per agent of each group; "
            f"mean ± std over seeds (each seed's value in brackets; all random: the seed's env "
            f"and draws). In bold, a trained group against random opponents. At the end of "
            f"training (self-play, the mean of the last {WINDOW} episodes): "
            f"{', '.join(training)}.")
    lines += [""] + textwrap.wrap(note, width=100)
    for line in sorted({r["machine_line"] for key, r in runs.items() if "machine_line" in r}):
        lines += [""] + textwrap.wrap(line, width=100)
    text = "\n".join(lines) + "\n"
    (args.results_dir / "table.md").write_text(text)
    print("\n" + text, end="")
    matchup_plot(args, matchups, names)
    print(f"\nwrote {display(args.results_dir / 'table.md')} and {display(args.plot)}")


def matchup_plot(args, matchups, names):
    """Left: each group's return per agent in each matchup (bars: mean over seeds; ticks: seeds).
    Right: each group's training curve (self-play), mean over seeds and min-max band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from harness import curve

    fig, (bars, curves) = plt.subplots(1, 2, figsize=(13, 5.2), dpi=120)
    kinds = list(matchups)
    width = 0.8 / len(kinds)
    colors = plt.cm.tab10.colors
    for k, matchup in enumerate(kinds):
        for g, name in enumerate(names):
            values = [result[name] for result in matchups[matchup].values()]
            x = g + (k - (len(kinds) - 1) / 2) * width
            bars.bar(x, statistics.fmean(values), width, color=colors[k % 10],
                     label=matchup if g == 0 else None)
            bars.plot([x] * len(values), values, "k_", ms=8)
    bars.set_xticks(range(len(names)), [f"{name}\n(return per agent)" for name in names])
    bars.axhline(0, color="black", lw=0.8)
    bars.set_title(f"{args.env}: matchups, {args.matchup_episodes} episodes per seed", fontsize=11)
    bars.legend(fontsize=8)
    bars.grid(alpha=0.3, axis="y")
    end = args.steps
    grid = list(range(args.plot_every, end + 1, args.plot_every))
    for g, name in enumerate(names):
        logs = [read_csv(path) for seed in args.seeds
                if (path := args.results_dir / f"ours_seed{seed}_{name}.csv").exists()]
        lines = [curve(log, grid, end) for log in logs]
        points = [(x, [c[i] for c in lines]) for i, x in enumerate(grid)
                  if lines and all(c[i] is not None for c in lines)]
        if points:
            xs = [x for x, _ in points]
            curves.plot(xs, [statistics.fmean(v) for _, v in points], color=colors[g], lw=2,
                        label=f"{name} ({len(logs)} seeds)")
            curves.fill_between(xs, [min(v) for _, v in points], [max(v) for _, v in points],
                                color=colors[g], alpha=0.2, lw=0)
    curves.set_title(f"training (every group learning at once), last {WINDOW} episodes",
                     fontsize=11)
    curves.set_xlabel("agent steps (all agents of all envs)")
    curves.set_ylabel("return per agent")
    curves.grid(alpha=0.3)
    curves.legend(fontsize=8)
    fig.tight_layout()
    args.plot.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.plot)
    plt.close(fig)


# --------------------------------------------------------------------------------------------------
# The race: ours, with its defaults and --target-return R, against SB3's wall time for the budget
# --------------------------------------------------------------------------------------------------


def race(args):
    """Run ours to SB3's final return R on each seed; print and keep the table (race.md)."""
    runs = load_runs(args.results_dir)
    finals, walls = [], []
    for seed in args.seeds:
        record, path = runs.get(f"sb3_seed{seed}"), args.results_dir / f"sb3_seed{seed}.csv"
        if record is None or record["status"] != "ok" or not path.exists():
            print(f"error: no kept SB3 run for seed {seed} in {args.results_dir}: run "
                  f"--variants sb3 first", file=sys.stderr)
            sys.exit(1)
        finals.append(statistics.fmean(e[1] for e in read_csv(path)[-WINDOW:]))
        walls.append(record["wall_seconds"])
    target, sb3_wall = statistics.fmean(finals), statistics.median(walls)
    print(f"race: SB3's final return per agent, mean over seeds {target:.2f}; its median wall "
          f"time {sb3_wall:.1f} s; ours with --target-return {target:.4f}", flush=True)
    info = machine(PACKAGES)
    lines = ["| seed | solved step | solved seconds | run seconds | solved / SB3 median wall |",
             "| ---: | ---: | ---: | ---: | ---: |"]
    for seed in args.seeds:
        script_args = ["--seed", str(seed), "--target-return", f"{target:.4f}"]
        date = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        command, status, wall, tail, summary, _ = run_our_script(
            SCRIPT, script_args, args.our_args, seed, args.timeout)
        solved = summary.get("solved_seconds") if summary else None
        save_run(args.results_dir, f"race_seed{seed}", {
            "variant": "race", "seed": seed, "env": args.env, "target_return": target,
            "sb3_median_wall_seconds": sb3_wall, "command": shlex.join(command), "date": date,
            "status": status, "wall_seconds": round(wall, 2), "summary": summary,
            "machine_line": machine_line(info, PACKAGES)})
        ratio = solved / sb3_wall if solved is not None else None
        lines.append(f"| {seed} | {fmt(summary and summary.get('solved_step'), ',')} | "
                     f"{fmt(solved, '.1f')} | {wall:.1f} | {fmt(ratio, '.3f')} |")
        print(f"  seed {seed}: {status}, solved at {fmt(solved, '.1f')} s ({fmt(ratio, '.3f')} of "
              f"SB3's median wall time)", flush=True)
        if status != "ok":
            print(tail)
    lines += ["", f"R = {target:.4f} (SB3's final return per agent, mean over seeds "
                  f"{', '.join(map(str, args.seeds))}: {', '.join(f'{x:.2f}' for x in finals)}); "
                  f"SB3's median wall time {sb3_wall:.1f} s (walls {walls}).",
              "", machine_line(info, PACKAGES)]
    text = "\n".join(lines) + "\n"
    (args.results_dir / "race.md").write_text(text)
    print("\n" + text, end="")


# --------------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------------


def parse_args():
    parser = argparse.ArgumentParser(
        description="ppo_multiagent.py on MPE2: learning curves over seeds against SB3 with "
        "SuperSuit and a random policy (simple_spread, speaker_listener; --race: ours to SB3's "
        "final return), or each trained group against random opponents (tag, adversary, "
        "world_comm).", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--env", choices=SETTINGS, default="simple_spread", dest="env_name",
                        help="the setting (see the module docstring)")
    parser.add_argument("--race", action="store_true",
                        help="simple_spread: then run ours with --target-return (SB3's final "
                        "mean return)")
    parser.add_argument("--race-only", action="store_true",
                        help="run only the race, with the kept SB3 logs")
    parser.add_argument("--matchup-episodes", type=int, default=100,
                        help="matchups: episodes per matchup and seed")
    parser.add_argument("--matchups-only", action="store_true",
                        help="matchups: play them from the kept runs, train nothing")
    parser.add_argument("--sb3-variant", default="sb3", help=argparse.SUPPRESS)  # the child's
    name = next((sys.argv[i + 1] for i, arg in enumerate(sys.argv[:-1]) if arg == "--env"),
                "simple_spread")
    setting = SETTINGS.get(name, SETTINGS["simple_spread"])
    bench = curves_bench(name, setting)
    learning_arguments(parser, bench, steps=setting.steps, timeout=7200.0, plot_every=6000,
                       plot_help="the PNG (default: benchmarks/plots/multiagent_learning.png for "
                       "simple_spread, multiagent_<env>.png for the others, with the default "
                       "results dir; else inside the results dir)")
    args = parser.parse_args()
    args.setting, args.env, args.bench = setting, setting.env, bench
    plot_name = "multiagent_learning.png" if name == "simple_spread" else f"multiagent_{name}.png"
    check_learning_arguments(parser, args, bench, plot_name)
    if (args.race or args.race_only) and name != "simple_spread":
        parser.exit(2, "error: --race is for --env simple_spread\n")
    return args


def main():
    args = parse_args()
    if args.sb3_child:
        seed, out_file = args.sb3_child
        sb3_child(int(seed), out_file, args.steps, args.env, args.setting.sb3_pad,
                  args.setting.sb3_variants[args.sb3_variant])
        return
    if args.setting.mode == "matchups":
        if not args.plot_only:
            check_ready(SCRIPT)
            info = machine(PACKAGES)
            warn_if_busy(info, "slows the runs (the scores do not depend on it)")
            args.results_dir.mkdir(parents=True, exist_ok=True)
            if not args.matchups_only:
                train_matchup_runs(args, info)
            play_matchups(args)
        matchup_report(args)
        return
    if args.plot_only:
        learning_report(args.bench, args)
        return
    check_ready(SCRIPT, sb3=any(v in args.setting.sb3_variants for v in args.variants)
                and not args.race_only)
    if not args.race_only:
        run_learning(args.bench, args, run_variant, play_random)
    if args.race or args.race_only:
        args.results_dir.mkdir(parents=True, exist_ok=True)
        race(args)


if __name__ == "__main__":
    main()
