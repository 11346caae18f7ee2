"""The Python examples of README.md and docs/ that tests run: a fenced ```python block right
after an HTML comment `<!-- snippet: NAME -->` (invisible on GitHub and on the site)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))
SNIPPET = re.compile(r"^<!-- snippet: ([a-z0-9-]+) -->\n```python\n(.*?)^```$", re.S | re.M)
# What the examples dial; a test puts the address of the coordinator it started there.
COORDINATOR = '"coordinator:50051"'


def snippets() -> dict[str, tuple[Path, str]]:
    """Snippet name -> (the page, its code); a name used twice is an error."""
    found: dict[str, tuple[Path, str]] = {}
    for page in PAGES:
        for name, code in SNIPPET.findall(page.read_text()):
            assert name not in found, f"snippet {name!r} appears in {found[name][0].name} and {page.name}"
            found[name] = (page, code)
    return found


def snippet(name: str, coordinator: str = "") -> str:
    """The code of snippet `name`, dialing `coordinator` where it names one."""
    page, code = snippets()[name]
    assert COORDINATOR in code or not coordinator, f"snippet {name!r} in {page.name} names no {COORDINATOR}"
    return code.replace(COORDINATOR, repr(coordinator)) if coordinator else code
