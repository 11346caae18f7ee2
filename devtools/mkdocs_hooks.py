"""mkdocs hooks (`mkdocs.yml`): the site's home page is README.md and its changelog page is
CHANGELOG.md, both outside docs/. Links are written for the repository (README to
`docs/x.md`, pages to `../README.md`) and rewritten here for the site, so both work."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[1]
# repository link -> site link, in the generated pages and in every page of docs/
TO_SITE = (("](docs/", "]("), ("](../README.md", "](index.md"), ("](CHANGELOG.md", "](changelog.md"))
TO_SITE_IN_DOCS = (("](../README.md", "](index.md"), ("](../CHANGELOG.md", "](changelog.md"))


def _for_site(text: str, rewrites: tuple[tuple[str, str], ...]) -> str:
    for old, new in rewrites:
        text = text.replace(old, new)
    return text


def on_files(files: Files, config: Any) -> Files:
    """Adds index.md (the README) and changelog.md (the changelog) as generated pages."""
    for name, source in (("index.md", "README.md"), ("changelog.md", "CHANGELOG.md")):
        text = _for_site((ROOT / source).read_text(), TO_SITE)
        files.append(File.generated(config, name, content=text))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    """Links from docs/ pages to the README or the changelog point at their site pages."""
    return _for_site(markdown, TO_SITE_IN_DOCS)
