"""Provenance on vLLM's OpenAI responses: each completion names the weightsync version and
manifest digest that produced it, with each version's token range where a generation
spans a flip.

vLLM labels every output token with the engine's weight-version label (what
`finish_weight_update(weight_version=...)` or `update_weight_version` set) and hands a
finished completion's label spans to the server (`CompletionOutput.weight_versions`). In
vLLM's API server process this module

- resolves each label when it is set: before the engine takes it, every worker is asked
  which version its engine holds and that version's manifest digest (the worker
  extension's `weightsync_provenance`, through `collective_rpc`), and the answer is kept
  as the label's (`LabelBook`);
- writes each completion's spans, resolved, into the response: `weight_versions` on each
  choice (vLLM's own span shape, `version` being its label, with a `weightsync` object
  beside it: the version and its `manifest_digest`), and `system_fingerprint` naming the
  versions the response used (`weightsync.provenance.fingerprint`), in place of vLLM's
  own fingerprint, for `/v1/completions` and `/v1/chat/completions`, streamed or not. A
  stream carries them on each choice's last chunk (with `stream_options.include_usage`,
  the fingerprint of every choice on the usage chunk).

Only where the engine moves its weights with weightsync (its weight-transfer backend, or a
weightsync worker extension), and only where vLLM writes a fingerprint
(`--fingerprint-mode none` keeps it out; the spans are written still). A label set while
no worker could answer (the server started without a weightsync worker extension, no
rollout attached) names its digits' version and no digest (`-`).

The plugin (`rollout_agent.vllm_plugin`) installs it in vLLM's server process only.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import logging
import threading
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable, Sequence
from typing import Any

from weightsync.provenance import Provenance, VersionSpan, fingerprint, spans_of_labels, version_of_label, versions_used

log = logging.getLogger("vllm.plugins.weightsync")

BACKEND = "weightsync"
RESOLVE_TIMEOUT_S = 30.0  # the workers answer from memory; the engine runs the call between two steps
_WRAPPED = "__weightsync_provenance__"


class LabelBook:
    """What each weight-version label named when it was set: the version the engine's
    workers held and its manifest digest. A label set again names what they held then.
    Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_label: dict[str, Provenance] = {}

    def record(self, label: str, answers: Sequence[Any]) -> Provenance | None:
        """Keeps what the workers answered (`weightsync_provenance`, one dict each) as
        `label`'s; None (and the label forgotten) where no worker has a rollout attached,
        or the workers hold different versions."""
        attached = {(a["version"], a["manifest_digest"]) for a in answers if isinstance(a, dict) and "version" in a}
        if len(attached) > 1:
            log.error("weightsync: the engine's workers hold different versions under label %r: %s", label, answers)
        found = Provenance(*next(iter(attached))) if len(attached) == 1 else None
        with self._lock:
            if found is None:
                self._by_label.pop(label, None)
            else:
                self._by_label[label] = found
        return found

    def resolve(self, label: str) -> Provenance:
        """`label`'s weights: as recorded, else the version its digits name, with no
        digest (vLLM's starting label "default": version 0)."""
        with self._lock:
            found = self._by_label.get(label)
        return found if found is not None else Provenance(version_of_label(label))


BOOK = LabelBook()  # the server process's: labels are the engine's, one per process


def completion_spans(output: Any, tokens: int | None, book: LabelBook) -> tuple[VersionSpan, ...] | None:
    """A finished `CompletionOutput`'s spans, resolved; None where the engine reported none
    (an output not finished yet) or they do not cover its tokens (logged). `tokens`: its
    output tokens (None: as far as its spans reach, for a streamed output's last delta)."""
    spans = getattr(output, "weight_versions", None)
    if spans is None:
        return None
    labels = [(str(s.version), int(s.start), int(s.end)) for s in spans]
    if tokens is None:
        tokens = labels[-1][2] if labels else 0
    try:
        return spans_of_labels(labels, book.resolve, tokens)
    except ValueError as e:
        log.warning("weightsync: a completion's weight-version spans are not whole, so it names none: %s", e)
        return None


def span_dicts(spans: Sequence[VersionSpan]) -> list[dict[str, Any]]:
    """A choice's `weight_versions`: vLLM's span (its label as `version`, `start`, `end`)
    and, under `weightsync`, the version and its manifest digest (its own key, so fields
    vLLM may add to its spans meet none of ours)."""
    return [
        {
            "version": s.label,
            "start": s.start,
            "end": s.end,
            "weightsync": {"version": s.version, "manifest_digest": s.manifest_digest},
        }
        for s in spans
    ]


def annotate(response: Any, spans: Sequence[tuple[VersionSpan, ...] | None]) -> None:
    """Writes the choices' spans (in order) and the fingerprint of all of them into a
    non-streamed response; its fingerprint stays vLLM's where no choice has spans, or
    where vLLM writes none."""
    if len(response.choices) != len(spans):
        log.warning("weightsync: %d choices and %d completions: the response names no versions",
                    len(response.choices), len(spans))  # fmt: skip
        return
    for choice, s in zip(response.choices, spans, strict=True):
        if s is not None:
            choice.weight_versions = span_dicts(s)
    used = versions_used(s for s in spans if s is not None)
    if used and response.system_fingerprint is not None:
        response.system_fingerprint = fingerprint(used)


class StreamNotes:
    """A stream's finished choices (by their index in the stream) and their spans, noted as
    the engine's outputs pass on their way to vLLM's chunk writer, which writes each
    output's chunk after it reads the output."""

    def __init__(self) -> None:
        self.spans: dict[int, tuple[VersionSpan, ...]] = {}
        self.unwritten: set[int] = set()  # finished, their last chunk not yet annotated

    def note(self, index: int, output: Any, book: LabelBook) -> None:
        if output.finish_reason is None:
            return
        spans = completion_spans(output, None, book)
        if spans is not None:
            self.spans[index] = spans
            self.unwritten.add(index)

    def rewrite(self, item: Any) -> Any:
        """One SSE item of the stream, with spans on each finished choice's chunk and the
        fingerprint of the chunk's choices (all of them on a chunk without choices, the
        usage chunk). Items nothing is written into pass as they are, unparsed."""
        if not isinstance(item, str) or not item.startswith("data: {"):
            return item
        if not self.unwritten and '"system_fingerprint"' not in item:
            return item
        try:
            chunk = json.loads(item[len("data: ") :])
        except ValueError:
            return item
        choices = chunk.get("choices")
        if not isinstance(choices, list):
            return item
        changed = False
        for c in choices:
            i = c.get("index")
            if c.get("finish_reason") is not None and i in self.unwritten:
                c["weight_versions"] = span_dicts(self.spans[i])
                self.unwritten.discard(i)
                changed = True
        named = [c.get("index") for c in choices] if choices else sorted(self.spans)
        used = versions_used(self.spans[i] for i in named if i in self.spans)
        if used and chunk.get("system_fingerprint") is not None:
            chunk["system_fingerprint"] = fingerprint(used)
            changed = True
        return f"data: {json.dumps(chunk, separators=(',', ':'), ensure_ascii=False)}\n\n" if changed else item


def _active(serving: Any) -> bool:
    """Whether `serving`'s engine moves its weights with weightsync (`_weightsync_engine`)."""
    return _weightsync_engine(getattr(getattr(serving, "engine_client", None), "vllm_config", None))


async def _noting(results: AsyncIterator[Any], on: Callable[[Any], None]) -> AsyncIterator[Any]:
    """`results` as they are, each shown to `on` first; closed with this generator (vLLM
    aborts a request whose result generator closes: a client that left)."""
    try:
        async for item in results:
            on(item)
            yield item
    finally:
        if hasattr(results, "aclose"):
            await results.aclose()


async def _rewritten(stream: AsyncGenerator[Any, None], notes: StreamNotes) -> AsyncIterator[Any]:
    async with contextlib.aclosing(stream):
        async for item in stream:
            yield notes.rewrite(item)


def _completion_response(original: Callable[..., Any]) -> Callable[..., Any]:
    """`OpenAIServingCompletion.request_output_to_completion_response`: one choice per
    output of each prompt's final result, in order."""

    @functools.wraps(original)
    def wrapper(self: Any, final_res_batch: Any, *args: Any, **kwargs: Any) -> Any:
        response = original(self, final_res_batch, *args, **kwargs)
        if _active(self):
            outputs = [o for res in final_res_batch for o in res.outputs]
            annotate(response, [completion_spans(o, len(o.token_ids), BOOK) for o in outputs])
        return response

    return wrapper


def _chat_response(original: Callable[..., Any]) -> Callable[..., Any]:
    """`OpenAIServingChat.chat_completion_full_generator`: one choice per output of the
    request's final result."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        if not _active(bound.arguments["self"]):
            return await original(*args, **kwargs)
        final: list[Any] = []
        bound.arguments["result_generator"] = _noting(bound.arguments["result_generator"], final.append)
        response = await original(*bound.args, **bound.kwargs)
        if final and hasattr(response, "choices"):
            annotate(response, [completion_spans(o, len(o.token_ids), BOOK) for o in final[-1].outputs])
        return response

    return wrapper


Outputs = Callable[[Any, Any], Iterable[tuple[int, Any]]]


def _stream(original: Callable[..., Any], outputs: Outputs) -> Callable[..., Any]:
    """A stream generator of vLLM's (`completion_stream_generator`,
    `chat_completion_stream_generator`); `outputs(request, item)` are the outputs of one
    item of its result generator, each with its choice index in the stream."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        bound = signature.bind(*args, **kwargs)
        if not _active(bound.arguments["self"]):
            return original(*args, **kwargs)
        notes, request = StreamNotes(), bound.arguments["request"]

        def on(item: Any) -> None:
            for i, output in outputs(request, item):
                notes.note(i, output, BOOK)

        bound.arguments["result_generator"] = _noting(bound.arguments["result_generator"], on)
        return _rewritten(original(*bound.args, **bound.kwargs), notes)

    return wrapper


def _completion_outputs(request: Any, item: Any) -> Iterable[tuple[int, Any]]:
    prompt, res = item  # (prompt index, RequestOutput): choices run n per prompt
    return ((o.index + prompt * (request.n or 1), o) for o in res.outputs)


def _chat_outputs(request: Any, item: Any) -> Iterable[tuple[int, Any]]:
    return ((o.index, o) for o in item.outputs)


def _label_setter(original: Callable[..., Any]) -> Callable[..., Any]:
    """`AsyncLLM.update_weight_version` (which `finish_weight_update` calls with its
    `weight_version`): resolves the label before the engine takes it."""

    @functools.wraps(original)
    async def wrapper(self: Any, new_version: str, *args: Any, **kwargs: Any) -> Any:
        config = getattr(self, "vllm_config", None)
        if workers_answer(config):
            try:
                answers = await self.collective_rpc("weightsync_provenance", timeout=RESOLVE_TIMEOUT_S)
                found = BOOK.record(new_version, answers)
                log.info("weightsync: weight-version label %r names %s", new_version, found or "no resolved version")
            except Exception as e:  # noqa: BLE001 - the label is the caller's: it is set whatever the workers say
                BOOK.record(new_version, [])
                log.warning("weightsync: label %r not resolved (%s: %s); responses name its digits' version alone",
                            new_version, type(e).__name__, e)  # fmt: skip
        elif _weightsync_engine(config):
            _warn_no_extension()
        return await original(self, new_version, *args, **kwargs)

    return wrapper


@functools.cache
def _extension_answers(qualname: str, method: str) -> bool:
    from vllm.utils.import_utils import resolve_obj_by_qualname

    try:
        return hasattr(resolve_obj_by_qualname(qualname), method)
    except Exception:  # noqa: BLE001 - the engine itself reports an extension it cannot load
        return False


def workers_answer(config: Any, method: str = "weightsync_provenance") -> bool:
    """Whether the engine's workers answer `method` (a worker extension of weightsync's).
    Only then is it called: vLLM 0.32's `collective_rpc` leaves the replies after a failed
    one queued for the next call (vllm-project/vllm#49972), so a method the workers lack
    is never tried."""
    qualname = getattr(getattr(config, "parallel_config", None), "worker_extension_cls", "") or ""
    return bool(qualname) and _extension_answers(qualname, method)


def _weightsync_engine(config: Any) -> bool:
    """Whether the engine moves its weights with weightsync: its weight-transfer backend,
    or a worker extension of weightsync's (the TPU one runs without the backend)."""
    backend = getattr(getattr(config, "weight_transfer_config", None), "backend", None)
    return backend == BACKEND or workers_answer(config)


@functools.cache
def _warn_no_extension() -> None:
    log.warning(
        "weightsync: this server's workers cannot say which version they hold, so responses name a label's "
        "digits alone, with no manifest digest: start it with --worker-extension-cls "
        "rollout_agent.vllm_worker_extension.WeightsyncWorkerExtension"
    )


def _wrap(cls: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    original = getattr(cls, name, None)
    if original is None:
        log.warning("weightsync: vLLM's %s has no %s: its responses name no weightsync version", cls.__name__, name)
        return
    if getattr(original, _WRAPPED, False):
        return
    wrapped = make(original)
    setattr(wrapped, _WRAPPED, True)
    setattr(cls, name, wrapped)


def install() -> None:
    """Wraps vLLM's label setter and its OpenAI completion and chat responses, once per
    process (a vLLM without one of them keeps that one as it is, with a warning)."""
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
    from vllm.v1.engine.async_llm import AsyncLLM

    _wrap(AsyncLLM, "update_weight_version", _label_setter)
    _wrap(OpenAIServingCompletion, "request_output_to_completion_response", _completion_response)
    _wrap(OpenAIServingCompletion, "completion_stream_generator", lambda f: _stream(f, _completion_outputs))
    _wrap(OpenAIServingChat, "chat_completion_full_generator", _chat_response)
    _wrap(OpenAIServingChat, "chat_completion_stream_generator", lambda f: _stream(f, _chat_outputs))
