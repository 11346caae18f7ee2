"""Which weights produced a response: each version, its manifest digest and its tokens.

An engine names the weights each output token came from by a label (vLLM's weight-version
label, which `finish_weight_update(weight_version=...)` sets), and reports a finished
completion's tokens as label spans. A rollout resolves each label to the weightsync
version its workers served under it and that version's manifest digest (`Provenance`);
`spans_of_labels` turns the engine's spans into `VersionSpan`s, and `fingerprint` writes
the versions a response used as one string, OpenAI's `system_fingerprint`:

    weightsync:v7:3f2a9c01d4e5b6a7             every token from version 7
    weightsync:v6:a1b2c3d4e5f60718+v7:3f2a...  a generation that spanned the flip from 6 to 7
    weightsync:v0:-                            the weights the engine started with (no manifest)

Each version is `v<version>:<the first 16 hex digits of its manifest digest>`, in the order
the response first used them; `-` where no manifest digest names the weights.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

PREFIX = "weightsync:"
DIGEST_CHARS = 16  # of the manifest's sha256 in a fingerprint: 64 bits tell any two versions apart
NO_DIGEST = "-"
_ENTRY_RE = re.compile(rf"^v(0|[1-9][0-9]*):([0-9a-f]{{{DIGEST_CHARS}}}|-)$")


@dataclass(frozen=True)
class Provenance:
    """The weights of one version: `manifest_digest` is the version's manifest digest
    (sha256 hex), "" where none names the weights (version 0, the weights the engine
    started with, or a label no worker could resolve)."""

    version: int
    manifest_digest: str = ""

    def tag(self) -> str:
        """`v<version>:<digest prefix>`, one entry of a fingerprint."""
        return f"v{self.version}:{self.manifest_digest[:DIGEST_CHARS] or NO_DIGEST}"


@dataclass(frozen=True)
class VersionSpan:
    """Output tokens `[start, end)` were sampled by `version`'s weights; `label` is the
    engine's own name for them (vLLM's weight-version label; "" where the engine has none)."""

    start: int
    end: int
    version: int
    manifest_digest: str = ""
    label: str = ""

    @property
    def provenance(self) -> Provenance:
        return Provenance(self.version, self.manifest_digest)


def version_of_label(label: str | None) -> int:
    """The version an engine's label names by itself: the digits `finish_weight_update`
    was given, else 0 (vLLM's engine starts with the label "default")."""
    if label is None or not label.isascii() or not label.isdigit():
        return 0
    return int(label)


def spans_of_labels(
    labels: Iterable[tuple[str, int, int]], resolve: Callable[[str], Provenance], tokens: int
) -> tuple[VersionSpan, ...]:
    """An engine's label spans `(label, start, end)` over a completion of `tokens` output
    tokens as version spans: each label resolved, spans clipped to the tokens (vLLM trims
    a stop string's surplus tokens after it began a span), empty ones dropped, and
    adjacent spans of the same weights merged (a label set again, or two labels one
    version), keeping the first's label.

    Raises:
        ValueError: the spans do not cover `[0, tokens)` in order, one after the other.
    """
    out: list[VersionSpan] = []
    at = 0
    for label, first, last in labels:
        start, end = min(first, tokens), min(last, tokens)
        if start != at or end < start:
            raise ValueError(f"label {label!r} spans tokens [{first}, {last}), expected a span from token {at}")
        at = end
        if start == end:
            continue
        p = resolve(label)
        if out and out[-1].provenance == p:
            out[-1] = VersionSpan(out[-1].start, end, p.version, p.manifest_digest, out[-1].label)
        else:
            out.append(VersionSpan(start, end, p.version, p.manifest_digest, label))
    if at != tokens:
        raise ValueError(f"the labels cover tokens [0, {at}) of {tokens}")
    return tuple(out)


def versions_used(completions: Iterable[Sequence[VersionSpan]]) -> tuple[Provenance, ...]:
    """The weights a response's completions used, each once, in the order they first appear."""
    seen: dict[Provenance, None] = {}
    for spans in completions:
        for s in spans:
            seen.setdefault(s.provenance)
    return tuple(seen)


def fingerprint(used: Sequence[Provenance]) -> str:
    """`used` (`versions_used`) as one string; ValueError where it is empty."""
    if not used:
        raise ValueError("a fingerprint names at least one version")
    return PREFIX + "+".join(p.tag() for p in used)


def parse_fingerprint(text: str) -> tuple[tuple[int, str], ...]:
    """A fingerprint's `(version, manifest digest prefix)` entries, in its order (the prefix
    "" where it says `-`).

    Raises:
        ValueError: `text` is not a weightsync fingerprint (vLLM's own, or another server's).
    """
    if not text.startswith(PREFIX):
        raise ValueError(f"{text!r:.80} is not a weightsync fingerprint (it starts with {PREFIX!r})")
    out = []
    for entry in text[len(PREFIX) :].split("+"):
        m = _ENTRY_RE.match(entry)
        if m is None:
            raise ValueError(f"{entry!r:.80} is not v<version>:<{DIGEST_CHARS} hex digits or ->")
        out.append((int(m.group(1)), "" if m.group(2) == NO_DIGEST else m.group(2)))
    return tuple(out)
