"""README.md and docs/: the examples tests run are where the tests look for them, the README
stays a page a newcomer reads, and nothing points outside the repository or at history."""

from __future__ import annotations

import re

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
