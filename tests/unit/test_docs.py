"""README.md and docs/: the examples tests run are where the tests look for them, the README
stays a page a newcomer reads, and nothing points outside the repository or at history; code
and tests state the behaviour they hold, not the story of a fix."""

from __future__ import annotations

import re
from pathlib import Path

from tests.doc_snippets import COORDINATOR, PAGES, ROOT, snippets

# Each snippet and the test that runs it against a real coordinator.
RUN_BY = {
    "trainer": "tests/integration/test_doc_snippets.py",
    "trainer-async": "tests/integration/test_doc_snippets.py",
    "vllm": "tests/e2e/test_doc_snippet_vllm.py",
    "vllm-trainer": "tests/e2e/test_vllm_trainer.py",
}
MAX_README_LINES = 250
# History lives in git: pages say why the code is as it is, not which round of work made it so.
HISTORY = re.compile(r"issue \d|round \d|session \d+|measured\s+again|before\s+the\s+fix|was\s+fixed", re.I)
# How a fix reads in a docstring or comment ("X now does Y", "once crashed", "# before: ...",
# "used to"): what the code does belongs there, how it came to do it in the commit message.
STORY = re.compile(
    r"\bissue\s+\d+|\(issue\b|\bround\s+\d|before\s+the\s+fix|was\s+fixed|\bused\s+to\b|(?:\(|#\s*)before:"
    r"|\bmeasured\s+again|\bonce\s+(?:came|crashed|bound|emitted|raised|failed|broke|hung|took)\b"
    r"|\bnow\s+(?:does|ends|answers|finds|releases|abandons|names|needs?|takes|gives|waits|opens|closes|arrive"
    r"|raises|refuses|keeps|says\s+which)\b|\b(?:are|is)\s+now\s+(?:`|[a-z]+ed\b)|\bat\s+(?:start|once)\s+now\b"
    r"|\b(?:failure|error)\s+now\b",
    re.I,
)
CODE_DIRS = ("coordinator", "rollout_agent", "trainer_agent", "weightsync", "devtools", "bench", "examples", "tests")
CODE_DIRS += ("native", "protos", "deploy", ".ci")
CODE_SUFFIXES = {".py", ".cc", ".h", ".proto", ".sh", ".yaml", ".yml", ".txt"}
CODE_FILES = ("Makefile", "setup.py", "pyproject.toml", "deploy/Containerfile", ".ci/run")
GENERATED = ROOT / "weightsync" / "_proto"


def test_every_snippet_compiles_dials_the_coordinator_and_has_a_test_that_runs_it() -> None:
    found = snippets()
    assert set(found) == set(RUN_BY), "a snippet without a test, or a test without its snippet"
    for name, (page, code) in found.items():
        compile(code, f"{page.name}:{name}", "exec")
        assert COORDINATOR in code, name
        assert f'"{name}"' in (ROOT / RUN_BY[name]).read_text(), f"{RUN_BY[name]} does not run {name!r}"


def test_the_readme_is_short() -> None:
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines; move detail into docs/"


def test_no_page_points_outside_the_repository_or_tells_history() -> None:
    for page in (*PAGES, ROOT / "CHANGELOG.md"):
        text = page.read_text()
        assert "shared/" not in text, f"{page.name} points outside the repository"
        assert not (hit := HISTORY.search(text)), f"{page.name}: {hit.group(0)!r} tells history, not why"
        if page in PAGES:  # the changelog's job is to tell what changed
            assert not (hit := STORY.search(text)), f"{page.name}: {hit.group(0)!r} tells the story of a fix"


def _code_files() -> list[Path]:
    found = [ROOT / name for name in CODE_FILES]
    for top in CODE_DIRS:
        found += [p for p in (ROOT / top).rglob("*") if p.suffix in CODE_SUFFIXES and GENERATED not in p.parents]
    return [p for p in found if p.is_file() and p.resolve() != Path(__file__).resolve()]  # this file quotes them


def test_code_and_tests_state_behaviour_not_the_story_of_a_fix() -> None:
    files = _code_files()
    assert len(files) > 200, "the walk found too few files"
    told = []
    for path in files:
        text = path.read_text(errors="replace")
        for hit in STORY.finditer(text):
            line = text.count("\n", 0, hit.start()) + 1
            told.append(f"{path.relative_to(ROOT)}:{line}: {hit.group(0)!r}")
    assert not told, "these tell history; say what the code does (history goes in the commit message):\n" + "\n".join(
        told
    )


def test_the_story_check_catches_a_fix_told_in_a_docstring() -> None:
    for story in (
        "It raises at once now, frees its slot",
        "The trainer now opens it again",
        "uint64 values once came back INTERNAL",
        "# before: [1, 2, 3], and 2 more per restart",
        "Addresses are now `[::1]:port`.",
        "what the delta codec makes of it (issue 15)",
        "Per leaf, the apply used to dispatch a transfer",
    ):
        assert STORY.search(story), story
    for behaviour in (
        "the stream the loop reads now",
        "Ends an agent's lease now (graceful exit)",
        "ready now, within",
    ):
        assert not STORY.search(behaviour), behaviour
