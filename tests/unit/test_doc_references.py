"""What README.md and docs/ name exists: every command's `make` target and flags, every
Prometheus metric and recording rule, the bench script behind each README figure, and every
test a page cites."""

from __future__ import annotations

import argparse
import ast
import json
import re
import shlex
import shutil
import subprocess
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest
import yaml

from tests.doc_snippets import PAGES, ROOT

FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```$", re.S | re.M)
INLINE = re.compile(r"`([^`\n]+)`")
SCRIPT = re.compile(r"^(?:bench|devtools|examples)/\w+\.py$")
# Modules whose flags come from a settings dataclass (weightsync.config.build_parser).
CONFIG_MODULES = {
    "coordinator": ("coordinator.config", "CoordinatorConfig"),
    "trainer_agent": ("trainer_agent.config", "TrainerConfig"),
    "rollout_agent": ("rollout_agent.config", "RolloutConfig"),
}
# `make` variables whose value is command-line flags of the script the target runs.
MAKE_ARG_VARS = ("DEMO_ARGS", "BENCH_ARGS")


def commands() -> Iterator[tuple[str, list[str]]]:
    """(page, tokens) of every shell command in a fenced block or an inline code span."""
    for page in PAGES:
        text = page.read_text()
        texts = [code for lang, code in FENCE.findall(text) if lang.strip() not in ("python", "mermaid", "json")]
        texts += INLINE.findall(FENCE.sub("", text))
        for code in texts:
            code = re.sub(r"\\\n\s*", " ", code)  # continued lines
            for line in code.splitlines():
                line = line.split(" #", 1)[0]
                for part in re.split(r"&&|\|\||[|;]", line):
                    try:
                        tokens = shlex.split(part)
                    except ValueError:
                        continue
                    while tokens and re.fullmatch(r"[A-Z_]+=.*", tokens[0]):  # VAR=value before the command
                        tokens = tokens[1:]
                    if tokens:
                        yield page.name, tokens


def flags(tokens: list[str]) -> set[str]:
    """The --options among `tokens` (`[--force]` and `--x=1` included)."""
    return {t.strip("[]").split("=", 1)[0] for t in tokens if t.strip("[]").startswith("--")}


def parser_options(parser: argparse.ArgumentParser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings}  # argparse lists its actions nowhere else


@cache
def script_options(path: Path) -> frozenset[str]:
    """The option strings a script's `add_argument` calls name (read, not run: bench
    scripts import JAX and torch)."""
    found = {"--help"}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
            names = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            found |= {n for n in names if n.startswith("-")}
            if any(k.arg == "action" and "BooleanOptional" in ast.unparse(k.value) for k in node.keywords):
                found |= {"--no-" + n[2:] for n in names if n.startswith("--")}
    return frozenset(found)


@cache
def module_options(module: str) -> frozenset[str] | None:
    """The options of `python -m module`; None for a module outside this repository."""
    import importlib

    if module in CONFIG_MODULES:
        from weightsync.config import build_parser

        where, name = CONFIG_MODULES[module]
        return frozenset(parser_options(build_parser(getattr(importlib.import_module(where), name), module)))
    if module == "devtools.demo":
        from devtools import demo

        return frozenset(parser_options(demo.build_parser()))
    path = ROOT / (module.replace(".", "/") + ".py")
    main = ROOT / module.replace(".", "/") / "__main__.py"
    for candidate in (path, main):
        if candidate.exists():
            return script_options(candidate)
    return None


@cache
def make_targets() -> dict[str, str]:
    """Makefile target -> its recipe."""
    targets: dict[str, str] = {}
    current = None
    for line in (ROOT / "Makefile").read_text().splitlines():
        if m := re.match(r"^([a-z][\w-]*):(?!=)", line):
            current = m.group(1)
            targets[current] = ""
        elif line.startswith("\t") and current:
            targets[current] += line + "\n"
        elif line.strip() and not line.startswith("#"):
            current = None
    return targets


def make_arg_options(target: str) -> frozenset[str]:
    """The options `DEMO_ARGS` / `BENCH_ARGS` of `make target` reach."""
    recipe = make_targets()[target]
    if m := re.search(r"\b((?:bench|devtools)/\w+\.py)", recipe):
        return script_options(ROOT / m.group(1))
    if m := re.search(r"-m ([\w.]+)", recipe):
        return module_options(m.group(1)) or frozenset()
    return frozenset()


def wsctl_problems(tokens: list[str]) -> list[str]:
    """wsctl's command (the first word that is no global option's value) and its options."""
    from weightsync.cli import build_parser

    parser = build_parser()
    takes_value = {s for a in parser._actions if a.nargs != 0 for s in a.option_strings}
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    command, skip = None, False
    for token in tokens[1:]:
        if skip or token == "...":  # `wsctl ... status`: the global options left out
            skip = False
        elif token.startswith("-"):
            skip = token in takes_value
        else:
            command = token
            break
    if command is not None and command not in sub.choices:
        return [f"no wsctl command {command!r}"]
    known = parser_options(parser) | (parser_options(sub.choices[command]) if command else set())
    return [f"wsctl {command or ''}: no option {f}" for f in sorted(flags(tokens) - known)]


def problems_of(tokens: list[str]) -> list[str]:
    """What a command names that does not exist (empty: all of it does, or it is not ours)."""
    head, args = tokens[0], tokens[1:]
    if head == "make":
        targets = make_targets()
        names = [a for a in args if not a.startswith("-") and "=" not in a]
        bad = [f"no make target {t!r}" for t in names if t not in targets]
        for a in args:
            var, _, value = a.partition("=")
            if var in MAKE_ARG_VARS and names and names[0] in targets and value not in ("", "..."):
                known = make_arg_options(names[0])
                bad += [f"make {names[0]} {var}: no option {f}" for f in sorted(flags(shlex.split(value)) - known)]
        return bad
    if head == "wsctl":
        return wsctl_problems(tokens)
    if head in ("python", "python3") and args[:1] == ["-m"] and len(args) > 1:
        known = module_options(args[1])
        return [] if known is None else [f"python -m {args[1]}: no option {f}" for f in sorted(flags(args) - known)]
    if head in ("python", "python3") and args:
        head, args = args[0], args[1:]
    if SCRIPT.match(head):
        path = ROOT / head
        if not path.exists():
            return [f"no script {head}"]
        return [f"{head}: no option {f}" for f in sorted(flags(args) - script_options(path))]
    return []


def test_every_command_the_docs_name_has_its_target_and_flags() -> None:
    checked = 0
    bad = []
    for page, tokens in commands():
        problems = problems_of(tokens)
        checked += tokens[0] in ("make", "wsctl", "python", "python3") or bool(SCRIPT.match(tokens[0]))
        bad += [f"{page}: {' '.join(tokens)}: {p}" for p in problems]
    assert checked > 50, f"only {checked} commands found: is the parser reading the pages?"
    assert not bad, "\n".join(bad)


def test_the_readmes_demo_variants_and_other_targets_exist() -> None:
    text = (ROOT / "README.md").read_text()
    variants = next(p for p in text.split("\n\n") if "`DEMO_ARGS` chooses" in p)
    named = {f for span in re.findall(r"`([^`]+)`", variants) for f in flags(span.split())}
    assert len(named) > 5 and named <= module_options("devtools.demo"), named - module_options("devtools.demo")
    table = text.split("\n## Other targets\n", 1)[1]
    first_cells = [line.split(" | ", 1)[0] for line in table.splitlines() if line.startswith("| `")]
    targets = {span.removeprefix("make ") for cell in first_cells for span in INLINE.findall(cell)}
    assert len(targets) > 10 and targets <= make_targets().keys(), targets - make_targets().keys()


# A test a page cites: `tests/<dir>/<file>.py`, or `tests/<dir>/<file>.py::test_name`.
CITED_TEST = re.compile(r"`(tests/[\w/]+\.py)(?:::(\w+))?`")


def cited_test_problems(text: str) -> list[str]:
    """What a page's cited tests name that does not exist: the file, or the test in it."""
    bad = []
    for path, name in CITED_TEST.findall(text):
        if not (ROOT / path).is_file():
            bad.append(f"no file {path}")
        elif name and not re.search(rf"^def {name}\(", (ROOT / path).read_text(), re.M):
            bad.append(f"no test {name} in {path}")
    return bad


def test_every_test_the_docs_cite_exists() -> None:
    bad = [f"{page.name}: {problem}" for page in PAGES for problem in cited_test_problems(page.read_text())]
    assert not bad, "\n".join(bad)
    cited = CITED_TEST.findall((ROOT / "docs" / "operations.md").read_text())
    assert len(cited) >= 10, "the threat model cites its tests"
    assert cited_test_problems("`tests/unit/test_docs.py::test_nothing`") == [
        "no test test_nothing in tests/unit/test_docs.py"
    ]


def test_the_command_check_catches_a_missing_target_or_flag() -> None:
    assert problems_of(["make", "bench-nothing"]) == ["no make target 'bench-nothing'"]
    assert problems_of(["make", "demo", "DEMO_ARGS=--steps 3 --no-such-flag"]) == [
        "make demo DEMO_ARGS: no option --no-such-flag"
    ]
    assert problems_of(["wsctl", "versions", "--json", "--handshakes"]) == ["wsctl versions: no option --handshakes"]
    assert problems_of(["wsctl", "--session", "job", "statuss"]) == ["no wsctl command 'statuss'"]
    assert not problems_of(["wsctl", "--coordinator", "h:1", "--session", "job", "status", "--json"])
    assert problems_of(["python", "-m", "rollout_agent", "--engine", "vllm", "--modle", "D"]) == [
        "python -m rollout_agent: no option --modle"
    ]
    assert problems_of(["python", "bench/apply.py", "--preset", "0.6b", "--group-by"]) == [
        "bench/apply.py: no option --group-by"
    ]
    assert problems_of(["bench/nothing.py"]) == ["no script bench/nothing.py"]
    assert not problems_of(["python", "-m", "vllm.entrypoints.openai.api_server", "--anything"])


# Metrics ---------------------------------------------------------------------------------

HISTOGRAM_SUFFIXES = ("_bucket", "_count", "_sum")


@cache
def exported_metrics() -> frozenset[str]:
    """Every series name the code registers: the shared metrics and the coordinator's fleet
    collector, with the suffixes Prometheus adds."""
    from coordinator.fleet_metrics import FleetCollector
    from weightsync.metrics import build_metrics

    families = list(build_metrics("docs").registry.collect()) + list(FleetCollector(None).describe())  # type: ignore[arg-type]  # describe reads no store
    names = set()
    for f in families:
        names.add(f.name)
        names |= {s.name for s in f.samples}
        if f.type == "counter":
            names.add(f.name + "_total")
        elif f.type == "histogram":
            names |= {f.name + s for s in HISTOGRAM_SUFFIXES}
        elif f.type == "info":
            names.add(f.name + "_info")
    return frozenset(names)


@cache
def code_functions() -> frozenset[str]:
    """`weightsync_*` functions of the code (the worker extensions' collective_rpc methods):
    names the docs give that are not metrics."""
    found = set()
    for package in ("rollout_agent", "trainer_agent", "coordinator", "weightsync"):
        for path in (ROOT / package).rglob("*.py"):
            found |= {
                n.name
                for n in ast.walk(ast.parse(path.read_text()))
                if isinstance(n, ast.FunctionDef) and n.name.startswith("weightsync_")
            }
    return frozenset(found)


def metrics_section_names(text: str) -> set[str]:
    """The names in operations.md's metrics table, which drops the `weightsync_` prefix (a
    name in parentheses there is what moves the metric, such as `publish_async`)."""
    section = text.split("\n## Metrics\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and "---" not in line][1:]
    cells = [line.split(" | ", 1)[1] for line in rows]
    return {"weightsync_" + m for cell in cells for m in re.findall(r"(?<!\()`([a-z][a-z0-9_]*)(?:\{[^`]*\})?`", cell)}


def test_every_metric_the_docs_name_is_registered_by_the_code() -> None:
    exported = exported_metrics()
    assert "weightsync_fenced" in exported and "weightsync_agents" in exported
    bad = []
    for page in PAGES:
        text = page.read_text()
        named = set(re.findall(r"\bweightsync_[a-z0-9_]*[a-z0-9]\b", text)) - code_functions()
        if page.name == "operations.md":
            table = metrics_section_names(text)
            assert len(table) > 20, "the metrics table was not found"
            named |= table
        bad += [f"{page.name}: {m}" for m in sorted(named - exported)]
    assert not bad, "metrics the docs name that no code registers:\n" + "\n".join(bad)


def test_every_recording_rule_the_docs_name_is_in_the_rules() -> None:
    rules = yaml.safe_load((ROOT / "deploy/components/prometheus-rules/rules.yaml").read_text())
    recorded = {r["record"] for g in rules["groups"] for r in g["rules"] if "record" in r}
    for page in PAGES:
        # (a response's fingerprint, weightsync:v<version>:<digest>, is no rule: weightsync.provenance)
        for name in re.findall(r"\bweightsync:(?!v[0-9]+:)[a-z0-9_]+:[a-z0-9_]+", page.read_text()):
            assert name in recorded, f"{page.name} names the recording rule {name}, which rules.yaml lacks"


# README figures --------------------------------------------------------------------------


def test_each_readme_figure_names_the_bench_that_measured_it() -> None:
    """The modes table's figures come from the bench its lead-in names, or from the one a
    row names; each such bench exists and performance.md holds the row's seconds."""
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Data-plane modes\n", 1)[1].split("\n## ", 1)[0]
    lead, _, table = section.partition("\n| mode |")
    default = re.findall(r"`(bench/\w+\.py)`", lead)
    assert len(default) == 1, "the table's lead-in names the one bench its figures come from"
    sections = (ROOT / "docs/performance.md").read_text().split("\n## ")
    rows = [line for line in table.splitlines()[2:] if line.startswith("| ")]
    assert len(rows) >= 6
    for row in rows:
        measured = row.rstrip(" |").rsplit(" | ", 1)[1]
        scripts = re.findall(r"`(bench/\w+\.py)`", measured) or default
        for script in scripts:
            assert (ROOT / script).exists(), f"{script} (README: {row[:40]}...) does not exist"
        sources = [s for s in sections if any(f"`{script}" in s for script in scripts)]
        assert sources, f"performance.md has no section for {scripts}"
        for seconds in re.findall(r"\b(\d+\.\d+)(?:-\d+\.\d+)? s\b", measured):
            assert any(re.search(rf"(?<![\d.]){re.escape(seconds)}(?![\d])", s) for s in sources), (
                f"README figure {seconds} s ({row[:40]}...) is not in performance.md's section of {scripts}"
            )


# Figures and their sources ---------------------------------------------------------------

FIGURES = ROOT / "docs" / "figures"
# A measured figure's source: a line of its own in the section that holds the figure, naming
# the JSON kept under docs/figures/ and, as that JSON says, the run's date, commit, machine
# and command.
SOURCE = re.compile(
    r"^Source: \[(?:docs/)?figures/([\w.-]+)\.json\]\((?:docs/)?figures/\1\.json\)( \(transcribed\))?: "
    r"(\d{4}-\d\d-\d\d), commit ([0-9a-f]{7,40}), (\w+), (?:`([^`]+)`|command not recorded)\.$",
    re.M,
)
SOURCE_FIELDS = {"name", "date", "commit", "machine", "command", "transcribed", "printed"}
# A decimal, `x` after it allowed (a ratio); not a name such as the 0.6b preset or 6.2e-6.
NUMBER = r"(?<![\w./])\d[\d,]*\.\d+(?![\d.]|[A-Za-wyz_])"
UNIT = r"(?:GB/s|MB/s|MiB/s|Gbit/s|tokens/s|CPU-s|GiB|MiB|KiB|GB|MB|ms|µs|s|x|%)"
# What reads as a measurement: a decimal with a unit (a range's first bound included), a
# decimal alone in a table cell, a rate.
MEASURED = re.compile(
    rf"(?P<a>{NUMBER})(?:[-–]\d[\d,]*(?:\.\d+)?)? ?{UNIT}(?![\w/])|(?<=\| )(?P<b>{NUMBER})\*? (?=\|)"
    r"|(?<![\w.])(?P<c>\d+) ?(?:GB/s|MB/s|MiB/s|tokens/s)(?![\w/])"
)
# Decimals with a unit that are no measurement: the presets' sizes, and settings a page quotes.
NOT_MEASURED = {
    "*": {"1.19 GB"},
    "design.md": {"2.5 s", "0.5 s"},
    "failures.md": {"2.5 s", "0.5 s"},
    "jax-applier.md": {"0.2 s"},
    "performance.md": {"15.7 GiB", "2.5 s"},
}


def sections(text: str) -> list[tuple[str, str]]:
    """(heading, body) of a page's sections, fenced code left out (its `#` lines are shell
    comments); the text before the first heading is the section ''."""
    parts = re.split(r"^(#{1,6} .*)$", FENCE.sub("", text), flags=re.M)
    return [("", parts[0]), *zip(parts[1::2], parts[2::2])]


@cache
def figure_sources() -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in sorted(FIGURES.glob("*.json"))}


def _numbers(text: str) -> list[float]:
    """Every decimal a source printed, whatever follows it (`6.4G`, `0.6b`)."""
    return [float(n.replace(",", "")) for n in re.findall(r"(?<![\w.])\d[\d,]*\.\d+(?!\.?\d)", text)]


def _sourced(figure: str, printed: list[float]) -> bool:
    """Whether a figure as a page writes it (`0.996`, `1,142`, `1.72` of a `%`) is among the
    numbers a source printed, to the figure's own precision."""
    value = float(figure.replace(",", ""))
    digits = len(figure.partition(".")[2])
    candidates = (value, value / 100)  # a share may be printed as a fraction
    return any(abs(c - p) <= 0.5 * 10 ** -(digits + 2 * i) for i, c in enumerate(candidates) for p in printed)


def figure_problems(page: str, text: str) -> list[str]:
    """What a page states as measured without a source, and every decimal of a section with
    sources that none of them printed."""
    sources = figure_sources()
    allowed = NOT_MEASURED["*"] | NOT_MEASURED.get(page, set())
    bad = []
    for heading, body in sections(text):
        cited = SOURCE.findall(body)
        prose = INLINE.sub("``", SOURCE.sub("", body))  # inline code holds flags, not figures
        prose = re.sub(r"\bPython 3\.\d+", "Python", prose)
        where = f"{page} {heading or '(top)'}"
        if not cited:
            for m in MEASURED.finditer(prose):
                if m.group(0).strip() not in allowed:
                    bad.append(f"{where}: {m.group(0).strip()!r} reads as measured and the section names no source")
            continue
        printed = [n for name, *_ in cited if name in sources for n in _numbers(" ".join(sources[name]["printed"]))]
        for m in re.finditer(NUMBER, prose):
            if not _sourced(m.group(0), printed) and not any(m.group(0) in a for a in allowed):
                bad.append(f"{where}: {m.group(0)} is in none of {[c[0] for c in cited]}")
    return bad


def test_every_figure_source_names_its_date_commit_machine_and_command() -> None:
    sources = figure_sources()
    assert len(sources) > 20, "docs/figures/ holds too few sources"
    machines = (ROOT / "docs/performance.md").read_text()
    for name, data in sources.items():
        assert SOURCE_FIELDS <= data.keys(), f"figures/{name}.json lacks {SOURCE_FIELDS - data.keys()}"
        assert data["name"] == name and data["printed"], name
        assert re.fullmatch(r"\d{4}-\d\d-\d\d", data["date"]) and re.fullmatch(r"[0-9a-f]{7,40}", data["commit"]), name
        machine = data["machine"]
        assert f"**{machine}**" in machines, f"figures/{name}.json: performance.md describes no machine {machine!r}"
        assert data["command"] or data.get("note"), f"figures/{name}.json: no command, and no note saying why"


def test_every_figure_source_names_a_commit_of_this_repository() -> None:
    if why := no_history_here():
        pytest.skip(why)
    git = ["git", "-C", str(ROOT)]
    for name, data in figure_sources().items():
        found = subprocess.run([*git, "cat-file", "-e", f"{data['commit']}^{{commit}}"], capture_output=True)
        assert found.returncode == 0, f"figures/{name}.json: commit {data['commit']} is not in this repository"


def no_history_here() -> str:
    """Why this tree holds no history of its own to look commits up in ("" where it does): a
    copy without `.git` (a TPU host's carried copy, an sdist, a tarball), whose `git -C`
    would answer for whatever repository lies above it; no git; a shallow clone; a `.git`
    that does not track the tree's figure files (a copy laid where an older checkout's
    history lies, as on a TPU host's device copy)."""
    if not (ROOT / ".git").exists():
        return f"no .git in {ROOT}: a copy of the tree, without its history"
    if shutil.which("git") is None:
        return "no git on PATH"
    probe = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--show-toplevel", "--is-shallow-repository"],
                           capture_output=True, text=True)  # fmt: skip
    if probe.returncode != 0:
        return f"git cannot read {ROOT}: {probe.stderr.strip()[-200:]}"
    top, shallow = probe.stdout.split()
    if Path(top).resolve() != ROOT.resolve():
        return f"{ROOT} is inside another repository ({top})"
    if shallow != "false":
        return "a shallow clone"
    untracked = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=all", "--",
                                "docs/figures"], capture_output=True, text=True).stdout  # fmt: skip
    if any(line.startswith("??") for line in untracked.splitlines()):
        return f"figure files this .git does not track (a copy laid beside another history): {untracked.split()[1]}"
    return ""


def test_every_source_line_agrees_with_its_json_and_every_json_is_cited() -> None:
    sources = figure_sources()
    cited = set()
    for page in PAGES:
        for name, transcribed, date, commit, machine, command in SOURCE.findall(page.read_text()):
            assert name in sources, f"{page.name} cites figures/{name}.json, which does not exist"
            data = sources[name]
            stated = (bool(transcribed), date, commit, machine, command or None)
            assert stated == (data["transcribed"], data["date"], data["commit"], data["machine"], data["command"]), (
                f"{page.name}: the source line of {name} differs from its JSON"
            )
            cited.add(name)
    assert cited == sources.keys(), f"sources no page cites: {sorted(sources.keys() - cited)}"


def test_every_measured_figure_in_the_docs_has_a_source() -> None:
    bad = [p for page in PAGES for p in figure_problems(page.name, page.read_text())]
    assert not bad, "figures without a source (docs/figures/*.json, cited by a Source: line):\n" + "\n".join(bad)


def test_the_figure_check_catches_a_figure_without_a_source() -> None:
    name, data = next(iter(figure_sources().items()))
    command = f"`{data['command']}`" if data["command"] else "command not recorded"
    line = f"Source: [figures/{name}.json](figures/{name}.json) (transcribed): {data['date']}, "
    line += f"commit {data['commit']}, {data['machine']}, {command}."
    figure = re.findall(NUMBER, " ".join(data["printed"]))[0]
    assert not figure_problems("x.md", f"## A\n\nIt took {figure} s.\n\n{line}\n")
    assert figure_problems("x.md", f"## A\n\nIt took {figure}7 s.\n\n{line}\n"), "a number its source lacks"
    assert figure_problems("x.md", "## A\n\nIt took 0.734 s.\n\n## B\n\n" + line + "\n"), "a section without a source"
    assert figure_problems("x.md", "## A\n\n| run | 1.25 |\n"), "a bare decimal in a table"
    assert not figure_problems("x.md", "## A\n\nThe default is `--lr 0.01`; a 1.19 GB model.\n")
    assert _sourced("1.72", [0.0172]) and _sourced("0.5", [0.54]) and not _sourced("0.6", [0.54])
