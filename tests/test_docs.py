"""README.md held to the code it describes: every flag it names exists in the script it names it
with (a flag of the shared-flags table, in every script), every figure it states about the code
(the number of scripts; lines of a lesson or a file, should it give any) is the files', every
script is named, and every file and heading it links to exists. Each check reads the README's text
and returns its problems; the last tests feed each a broken text, so each is seen to fail."""
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import ROOT

README = ROOT / "README.md"
SCRIPTS = sorted(path.name for path in ROOT.glob("ppo_*.py"))
BANNER = "# ==== Below: speed, safety and scale. PPO is complete above."
SCRIPT = re.compile(r"\bppo_[a-z]+\.py\b")
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9_-]*[a-z0-9]")
HELP_FLAG = re.compile(r"^  (--[a-z0-9-]+)(?:, (--[a-z0-9-]+))?", re.MULTILINE)
# Flags of the other programs the README shows (torchrun, TensorBoard): no script's to check.
FOREIGN = {"--standalone", "--nproc_per_node", "--nnodes", "--rdzv_backend", "--rdzv_endpoint",
           "--rdzv_id", "--logdir"}
NUMBERS = {word: number for number, word in enumerate(
    "zero one two three four five six seven eight nine ten eleven twelve".split())}
LINK = re.compile(r"\]\(([^)\s]*)\)")


@pytest.fixture(scope="module")
def helps():
    """Each script's flags, as its --help lists them (the scripts answer --help before torch)."""
    def flags_of(script):
        result = subprocess.run([sys.executable, str(ROOT / script), "--help"], cwd=ROOT,
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        return {"--help"} | {flag for pair in HELP_FLAG.findall(result.stdout) for flag in pair
                             if flag}
    with ThreadPoolExecutor(len(SCRIPTS)) as pool:
        return dict(zip(SCRIPTS, pool.map(flags_of, SCRIPTS)))


def flag_problems(text: str, helps: dict) -> list:
    """A flag belongs to the script named nearest before it on its line (in a command: the script
    it follows; a flag before any script there is another program's), else to the first named
    after it on the line, else to the last script named above it under the same heading; a flag
    in the table under a "Shared flags" heading belongs to every script; one near no script must
    be some script's."""
    problems, context, in_code, shared = [], None, False, False
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            in_code = not in_code
            continue
        if not in_code and line.startswith("#"):
            context, shared = None, "shared flags" in line.lower()
        named = [(match.start(), match.group()) for match in SCRIPT.finditer(line)]
        for match in FLAG.finditer(line):
            flag = match.group()
            before = [script for start, script in named if start < match.start()]
            after = [script for start, script in named if start > match.start()]
            if flag in FOREIGN or (in_code and not before):
                continue
            if shared and line.startswith("|") and not in_code:
                owners = SCRIPTS
            elif before or after:
                owners = [before[-1] if before else after[0]]
            elif context:
                owners = [context]
            else:
                if not any(flag in flags for flags in helps.values()):
                    problems.append(f"README.md:{number}: {flag} is no script's flag")
                continue
            problems += [f"README.md:{number}: {flag} is not a flag of {script}"
                         for script in owners if flag not in helps[script]]
        if named and not in_code:
            context = named[-1][1]
    return problems


def lesson_and_file_lines(script: str) -> set:
    lines = (ROOT / script).read_text().splitlines()
    banner = [number for number, line in enumerate(lines, 1) if line.startswith(BANNER)]
    return {len(lines)} | ({banner[0] - 1} if banner else set())  # the lesson: above the banner


def figure_problems(text: str, scripts: list) -> list:
    """Every count of scripts is the files'; every script is named and every script named exists;
    a figure in lines is the lesson's or the file's of a script named on its line (of any script
    where the line names none); the torchrun section names every script."""
    problems = []
    for match in re.finditer(r"\b(\w+)\s+scripts\b", text, re.IGNORECASE):
        word = match.group(1).lower()
        count = int(word) if word.isdigit() else NUMBERS.get(word)
        if count is not None and count != len(scripts):
            problems.append(f"README.md says {match.group()}; there are {len(scripts)}")
    named = set(SCRIPT.findall(text))
    problems += [f"README.md never names {script}" for script in scripts if script not in named]
    problems += [f"README.md names {script}, which is not here" for script in named - set(scripts)]
    for number, line in enumerate(text.splitlines(), 1):
        for match in re.finditer(r"\b(\d[\d,]*)\s+lines\b", line):
            figure = int(match.group(1).replace(",", ""))
            about = [script for script in SCRIPT.findall(line) if script in scripts] or scripts
            if not any(figure in lesson_and_file_lines(script) for script in about):
                problems.append(f"README.md:{number}: {match.group()} is no lesson's or file's "
                                f"length of {', '.join(about)}")
    sections = re.split(r"(?m)^## ", text)
    torchrun = [section for section in sections if "torchrun" in section.split("\n", 1)[0]]
    if not torchrun:
        problems.append('README.md has no section headed "torchrun" (the scripts cite it)')
    problems += [f'README.md\'s "torchrun" section does not name {script}'
                 for section in torchrun[:1] for script in scripts
                 if script not in SCRIPT.findall(section)]
    return problems


def speed_problems(text: str) -> list:
    """The introduction's "In all N settings timed ..., by A to B" is the Speed table's: N ratios
    (a cell may hold several, split by ";"), every one a gain, the smallest A and the largest B."""
    claim = re.search(r"In all (\d+) settings timed.*?by ([\d.]+)x to ([\d.]+)x", text, re.DOTALL)
    if not claim:
        return ["README.md's introduction states no speed claim to check"]
    section = re.split(r"(?m)^## ", text.split("\n## Speed", 1)[-1])[0]
    rows = [line.split("|")[1:-1] for line in section.splitlines()
            if line.startswith("| ") and not line.startswith("| --")]
    column = [cells.index(cell) for cells in rows[:1] for cell in cells if cell.strip() == "ratio"]
    ratios = [part.strip() for cells in rows[1:] for part in cells[column[0]].split(";")
              ] if column else []
    gains = [float(ratio[:-1]) for ratio in ratios if re.fullmatch(r"[\d.]+x", ratio)]
    problems = [f"Speed: {ratio} is no gain" for ratio in ratios
                if not re.fullmatch(r"[\d.]+x|[\d-]+% of .*", ratio)
                or (ratio.endswith("x") and float(ratio[:-1]) <= 1)]
    if int(claim.group(1)) != len(ratios):
        problems.append(f"the introduction claims {claim.group(1)} settings; Speed has "
                        f"{len(ratios)}")
    if gains and (float(claim.group(2)), float(claim.group(3))) != (min(gains), max(gains)):
        problems.append(f"the introduction claims {claim.group(2)}x to {claim.group(3)}x; Speed: "
                        f"{min(gains)}x to {max(gains)}x")
    return problems


def anchors(text: str) -> set:
    """GitHub's anchors of a markdown text's headings (outside code blocks)."""
    text = re.sub(r"(?ms)^```.*?^```", "", text)
    found = set()
    for heading in re.findall(r"(?m)^#+ (.*)$", text):
        heading = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
        found.add(re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-"))
    return found


def link_problems(text: str) -> list:
    """Every file linked (the plots in benchmarks/plots/ among them) exists, and every anchor
    into a markdown file of the repository, this one included, is a heading of it."""
    problems = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue  # a web address
        path, _, anchor = target.partition("#")
        file = ROOT / path if path else README
        if not file.exists():
            problems.append(f"README.md links {target}, which is not here")
        elif anchor and anchor not in anchors(text if not path else file.read_text()):
            problems.append(f"README.md links {target}: {path or 'README.md'} has no such heading")
    return problems


def test_every_flag_the_readme_names_is_a_flag_of_the_script_it_names(helps):
    assert flag_problems(README.read_text(), helps) == []


def test_every_figure_about_the_code_is_the_files_and_every_script_is_named():
    assert figure_problems(README.read_text(), SCRIPTS) == []


def test_every_plot_and_file_the_readme_links_exists():
    text = README.read_text()
    assert re.search(r"\]\(benchmarks/plots/[\w.-]+\.png\)", text)  # it shows the results' plots
    assert link_problems(text) == []


def test_the_speed_claim_is_the_speed_tables():
    assert speed_problems(README.read_text()) == []


def test_the_two_commands_are_the_readmes():
    """CI (.ci/run) runs the second as it stands: the README gives both exactly so."""
    lines = README.read_text().splitlines()
    assert ("pip install -r requirements.txt && python ppo_cartpole.py"
            + " " * 26 + "# train") in lines
    assert ("pip install -r requirements.txt -r requirements-dev.txt && python -m pytest"
            + " " * 8 + "# test") in lines


def test_each_check_fails_on_a_broken_text(helps):
    """The checks above are only as good as their power to fail: each is fed a broken text."""
    shared = "### Shared flags\n| flag | default | meaning |\n| `--precision` | x | y |\n"
    assert flag_problems("Run `ppo_atari.py --memory lstm`.\n", helps)      # another script's
    assert flag_problems("```\npython ppo_spaces.py --no-check-envv\n```\n", helps)  # a typo
    assert flag_problems("## Memory: ppo_memory.py\nAlso\n`--precision`\n", helps)  # the section's
    assert flag_problems("Nothing named here: `--learning-rat`.\n", helps)  # no script's at all
    assert flag_problems(shared, helps)                                     # not every script's
    assert not flag_problems("```\ntorchrun --nnodes 2 ppo_atari.py --precision bfloat16\n```\n",
                             helps)
    text = README.read_text()
    assert figure_problems("Five scripts: " + " ".join(SCRIPTS), SCRIPTS)
    assert figure_problems(text.replace(SCRIPTS[0], "ppo_nothing.py"), SCRIPTS)
    assert figure_problems(text + "\nThe lesson of ppo_cartpole.py is 5 lines.\n", SCRIPTS)
    assert figure_problems(re.sub(r"(?m)^## (.*)torchrun", r"## \1", text), SCRIPTS)
    assert speed_problems(re.sub(r"In all (\d+) settings",
                                 lambda claim: f"In all {int(claim.group(1)) + 1} settings", text))
    assert speed_problems(text.replace("| 3.11x |", "| 0.90x |"))
    assert link_problems("![plot](benchmarks/plots/no_such_plot.png)")
    assert link_problems("[details](benchmarks/README.md#no-such-heading)")
    assert link_problems("## Speed\n[speed](#sped)")
    assert not link_problems("## Speed\n[speed](#speed)")
