"""Provenance on every response: label spans to version spans, fingerprints, what a rollout
keeps of the versions it applied, and how vLLM's server writes them into its responses."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_agent.sync.engine_version import KEPT_DIGESTS, EngineVersion
from rollout_agent.sync.round import SyncResult
from rollout_agent.vllm_worker import openai_provenance
from rollout_agent.vllm_worker.openai_provenance import (
    LabelBook,
    StreamNotes,
    annotate,
    completion_spans,
    span_dicts,
)
from weightsync.provenance import (
    Provenance,
    VersionSpan,
    fingerprint,
    parse_fingerprint,
    spans_of_labels,
    version_of_label,
    versions_used,
)

D6, D7 = "a1" * 32, "b2" * 32
WEIGHTS = {"6": Provenance(6, D6), "7": Provenance(7, D7), "again-7": Provenance(7, D7), "default": Provenance(0)}
digests = st.text("0123456789abcdef", min_size=64, max_size=64)


def label_runs(labels: list[str]) -> list[tuple[str, int, int]]:
    """Per-token labels as vLLM reports them: a span opens where the label changes."""
    runs: list[tuple[str, int, int]] = []
    for i, label in enumerate(labels):
        if runs and runs[-1][0] == label:
            runs[-1] = (label, runs[-1][1], i + 1)
        else:
            runs.append((label, i, i + 1))
    return runs


@settings(max_examples=300, deadline=None)
@given(labels=st.lists(st.sampled_from(sorted(WEIGHTS)), max_size=40), cut=st.integers(0, 40))
def test_version_spans_name_each_tokens_weights_once_in_order(labels: list[str], cut: int) -> None:
    """Whatever the labels and however many tokens a stop string trimmed after the spans
    were opened, every kept token is in exactly one span, of the weights its label names,
    and no two neighbours name the same weights (a label set again, or two labels of one
    version, make one span)."""
    tokens = min(cut, len(labels))
    spans = spans_of_labels(label_runs(labels), WEIGHTS.__getitem__, tokens)
    assert [(s.start, s.end) for s in spans] == list(zip([0] + [s.end for s in spans[:-1]], [s.end for s in spans]))
    assert (spans[-1].end if spans else 0) == tokens and all(s.start < s.end for s in spans)
    per_token = [s.provenance for s in spans for _ in range(s.start, s.end)]
    assert per_token == [WEIGHTS[label] for label in labels[:tokens]]
    assert all(a.provenance != b.provenance for a, b in zip(spans, spans[1:]))
    assert all(s.label == labels[s.start] for s in spans)


@pytest.mark.parametrize(
    ("runs", "tokens", "match"),
    [
        ([("6", 0, 3), ("7", 4, 6)], 6, r"label '7' spans tokens \[4, 6\), expected a span from token 3"),
        ([("6", 0, 3), ("7", 2, 6)], 6, r"expected a span from token 3"),
        ([("6", 1, 3)], 3, r"expected a span from token 0"),
        ([("6", 0, 3)], 5, r"the labels cover tokens \[0, 3\) of 5"),
        ([("6", 0, 3), ("7", 3, 2)], 5, r"label '7' spans tokens \[3, 2\)"),
    ],
)
def test_spans_that_do_not_cover_the_tokens_in_order_are_refused(
    runs: list[tuple[str, int, int]], tokens: int, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        spans_of_labels(runs, WEIGHTS.__getitem__, tokens)


@given(used=st.lists(st.builds(Provenance, st.integers(0, 10**12), digests | st.just("")), min_size=1, max_size=4))
def test_a_fingerprint_reads_back_as_the_versions_it_names(used: list[Provenance]) -> None:
    text = fingerprint(used)
    assert text.startswith("weightsync:v")
    assert parse_fingerprint(text) == tuple((p.version, p.manifest_digest[:16]) for p in used)


def test_fingerprints_as_documented() -> None:
    assert fingerprint([Provenance(7, D7)]) == "weightsync:v7:b2b2b2b2b2b2b2b2"
    assert fingerprint([Provenance(6, D6), Provenance(7, D7)]) == "weightsync:v6:a1a1a1a1a1a1a1a1+v7:b2b2b2b2b2b2b2b2"
    assert fingerprint([Provenance(0)]) == "weightsync:v0:-"
    with pytest.raises(ValueError, match="at least one version"):
        fingerprint([])


@pytest.mark.parametrize(
    "text", ["vllm-0.32.0-abcdef12", "weightsync:", "weightsync:v7", "weightsync:v07:-", "weightsync:v7:abc", "v7:-"]
)
def test_what_is_not_a_weightsync_fingerprint_is_refused(text: str) -> None:
    with pytest.raises(ValueError):
        parse_fingerprint(text)


def test_a_response_uses_each_version_once_in_the_order_it_first_appears() -> None:
    a = (VersionSpan(0, 2, 7, D7), VersionSpan(2, 5, 6, D6))
    b = (VersionSpan(0, 5, 6, D6),)
    assert versions_used([b, a]) == (Provenance(6, D6), Provenance(7, D7))
    assert versions_used([a, b]) == (Provenance(7, D7), Provenance(6, D6))
    assert versions_used([]) == ()


def test_an_engine_label_names_a_version_by_its_digits() -> None:
    assert version_of_label("12") == 12
    assert version_of_label("default") == 0  # what vLLM's engine starts with
    assert version_of_label("step-3") == 0 and version_of_label("²") == 0 and version_of_label(None) == 0


def test_a_rollout_keeps_the_digest_of_each_version_it_applied() -> None:
    engine = EngineVersion()
    assert engine.provenance() == Provenance(0)
    engine.after_round(SyncResult(3, ok=False, manifest_digest=D6, failure="data_loss"))  # not applied
    assert engine.provenance(3) == Provenance(3)
    engine.after_round(SyncResult(4, ok=False, manifest_digest=D6, handshake_pending=True))  # applied
    engine.after_round(SyncResult(5, ok=True, manifest_digest=D7))
    assert engine.provenance() == Provenance(5, D7) and engine.provenance(4) == Provenance(4, D6)
    for v in range(6, 6 + KEPT_DIGESTS):
        engine.after_round(SyncResult(v, ok=True, manifest_digest=D7))
    assert engine.provenance(5) == Provenance(5) and engine.provenance(6) == Provenance(6, D7)
    engine.after_round(SyncResult(6, ok=True, manifest_digest=D6))  # applied again: kept as the newest
    engine.after_round(SyncResult(6 + KEPT_DIGESTS, ok=True, manifest_digest=D7))
    assert engine.provenance(6) == Provenance(6, D6) and engine.provenance(7) == Provenance(7)
    engine.forget()
    assert engine.provenance(6) == Provenance(6) and engine.provenance() == Provenance(0)


def test_a_label_names_what_every_worker_held_when_it_was_set() -> None:
    book = LabelBook()
    worker = {"session": "s", "agent_id": "a", "version": 7, "manifest_digest": D7}
    assert book.record("7", [worker, {**worker, "agent_id": "a-r1"}]) == Provenance(7, D7)
    assert book.resolve("7") == Provenance(7, D7)
    assert book.record("step-8", [{**worker, "version": 8, "manifest_digest": D6}]) == Provenance(8, D6)
    assert book.resolve("step-8") == Provenance(8, D6)  # whatever the label says: what the workers held
    assert book.record("7", [{"attached": False}]) is None  # set again with nothing attached: forgotten
    assert book.resolve("7") == Provenance(7)
    assert book.record("9", [worker, {**worker, "version": 6, "manifest_digest": D6}]) is None  # workers differ
    assert book.resolve("9") == Provenance(9) and book.resolve("default") == Provenance(0)


def output(
    spans: list[tuple[str, int, int]] | None, tokens: int, finish: str | None = "length", index: int = 0
) -> SimpleNamespace:
    """A vLLM `CompletionOutput` as far as provenance reads it."""
    found = None if spans is None else [SimpleNamespace(version=v, start=s, end=e) for v, s, e in spans]
    return SimpleNamespace(weight_versions=found, token_ids=list(range(tokens)), finish_reason=finish, index=index)


@pytest.fixture
def book() -> LabelBook:
    b = LabelBook()
    b.record("6", [{"version": 6, "manifest_digest": D6}])
    b.record("7", [{"version": 7, "manifest_digest": D7}])
    return b


def test_a_response_names_its_choices_spans_and_the_versions_they_used(book: LabelBook) -> None:
    response = SimpleNamespace(choices=[SimpleNamespace() for _ in range(3)], system_fingerprint="x")
    outs = [output([("7", 0, 4)], 4), output([("6", 0, 1), ("7", 1, 4)], 4), output(None, 2)]
    annotate(response, [completion_spans(o, len(o.token_ids), book) for o in outs])
    assert response.choices[0].weight_versions == [
        {"version": "7", "start": 0, "end": 4, "weightsync": {"version": 7, "manifest_digest": D7}}
    ]
    assert [s["weightsync"]["version"] for s in response.choices[1].weight_versions] == [6, 7]
    assert not hasattr(response.choices[2], "weight_versions")  # the engine reported no spans
    assert response.system_fingerprint == f"weightsync:v7:{D7[:16]}+v6:{D6[:16]}"
    quiet = SimpleNamespace(choices=[SimpleNamespace()], system_fingerprint=None)  # --fingerprint-mode none
    annotate(quiet, [completion_spans(outs[0], 4, book)])
    assert quiet.system_fingerprint is None and quiet.choices[0].weight_versions


def test_spans_that_are_not_whole_name_nothing(book: LabelBook) -> None:
    assert completion_spans(output([("7", 1, 4)], 4), 4, book) is None
    assert completion_spans(output([("7", 0, 4)], 4), None, book) == (VersionSpan(0, 4, 7, D7, "7"),)


def sse(chunk: dict) -> str:
    return f"data: {json.dumps(chunk, separators=(',', ':'))}\n\n"


def test_a_stream_names_each_choice_on_its_last_chunk(book: LabelBook) -> None:
    """n=2: each choice's terminal chunk carries its spans and its own versions; the usage
    chunk (no choices) names every choice's; other items pass untouched."""
    notes = StreamNotes()
    middle = sse({"choices": [{"index": 0, "text": "w1", "finish_reason": None}]})
    assert notes.rewrite(middle) is middle
    notes.note(0, output(None, 0, finish=None), book)  # not finished: nothing noted
    notes.note(1, output([("6", 0, 2), ("7", 2, 5)], 0), book)  # a streamed last delta: its spans say how far
    notes.note(0, output([("7", 0, 5)], 0), book)
    ended = {"choices": [{"index": 1, "finish_reason": "length"}], "system_fingerprint": "vllm-0.32.0-abcdef12"}
    one = json.loads(notes.rewrite(sse(ended))[6:])
    assert one["system_fingerprint"] == f"weightsync:v6:{D6[:16]}+v7:{D7[:16]}"
    assert [s["end"] for s in one["choices"][0]["weight_versions"]] == [2, 5]
    zero = json.loads(notes.rewrite(sse({"choices": [{"index": 0, "finish_reason": "length"}]}))[6:])
    assert "system_fingerprint" not in zero and zero["choices"][0]["weight_versions"] == span_dicts(notes.spans[0])
    usage = json.loads(notes.rewrite(sse({"choices": [], "usage": {}, "system_fingerprint": "vllm"}))[6:])
    assert usage["system_fingerprint"] == f"weightsync:v7:{D7[:16]}+v6:{D6[:16]}"  # choice 0's first
    for passing in ("data: [DONE]\n\n", sse({"error": {"message": "x"}}), b"bytes"):
        assert notes.rewrite(passing) is passing


def serving(backend: str) -> SimpleNamespace:
    """An OpenAI serving object of vLLM's, as far as provenance reads it."""
    transfer, parallel = SimpleNamespace(backend=backend), SimpleNamespace(worker_extension_cls="")
    config = SimpleNamespace(weight_transfer_config=transfer, parallel_config=parallel)
    return SimpleNamespace(engine_client=SimpleNamespace(vllm_config=config))


async def chat_stream(self: object, request: object, result_generator: AsyncIterator, request_id: str) -> AsyncIterator:
    """vLLM's chat stream writer, as far as provenance sees it: a chunk per output read, the
    fingerprint on a choice's last."""
    async for res in result_generator:
        for o in res.outputs:
            ended = {"system_fingerprint": "vllm-0.32.0-abcdef12"} if o.finish_reason else {}
            yield sse({"choices": [{"index": o.index, "finish_reason": o.finish_reason}], **ended})
    yield "data: [DONE]\n\n"


def test_a_wrapped_stream_names_its_versions_and_closes_the_engines_results(book: LabelBook) -> None:
    """The stream writer's items come back annotated for a weightsync engine, and as they
    are for another; a client that leaves early closes the engine's result generator."""
    closed: list[bool] = []

    async def results(n: int) -> AsyncIterator:
        try:
            for i in range(n - 1):
                yield SimpleNamespace(outputs=[output(None, 1, finish=None, index=i % 2)])
            yield SimpleNamespace(outputs=[output([("6", 0, 1), ("7", 1, 3)], 1, index=1)])
        finally:
            closed.append(True)

    async def read(stream: AsyncIterator, at_most: int = 100) -> list:
        got = []
        async for item in stream:
            got.append(item)
            if len(got) == at_most:
                break
        await stream.aclose()
        return got

    wrapped = openai_provenance._stream(chat_stream, openai_provenance._chat_outputs)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(openai_provenance, "BOOK", book)
        items = asyncio.run(read(wrapped(serving("weightsync"), None, results(3), "id")))
        last = json.loads(items[-2][6:])
        assert last["system_fingerprint"] == f"weightsync:v6:{D6[:16]}+v7:{D7[:16]}"
        assert [s["weightsync"]["version"] for s in last["choices"][0]["weight_versions"]] == [6, 7]
        assert items[:2] == [sse({"choices": [{"index": i, "finish_reason": None}]}) for i in (0, 1)]
        assert items[-1] == "data: [DONE]\n\n" and closed == [True]
        other = asyncio.run(read(wrapped(serving("nccl"), None, results(3), "id")))
        assert "weightsync" not in "".join(other) and "vllm-0.32.0-abcdef12" in other[-2]
        asyncio.run(read(wrapped(serving("weightsync"), None, results(50), "id"), at_most=2))
        assert closed == [True, True, True]
