"""Calls carried on a Heartbeats stream: the agent side's bookkeeping and its fallbacks."""

from __future__ import annotations

import time

import pytest

from weightsync._proto import coordinator_pb2 as pb
from weightsync.carried_calls import CARRIED_METHODS, carried_call
from weightsync.errors import DigestMismatch, TransportUnavailable
from weightsync.heartbeat import _OpenStream
from weightsync.rpc import to_status


def test_every_carried_field_names_a_coordinator_method_taking_that_request() -> None:
    methods = pb.DESCRIPTOR.services_by_name["Coordinator"].methods_by_name
    oneof = pb.HeartbeatRequest.DESCRIPTOR.oneofs_by_name["call"]
    assert {f.name for f in oneof.fields} == set(CARRIED_METHODS)
    for f in oneof.fields:
        assert methods[CARRIED_METHODS[f.name]].input_type is f.message_type
    assert carried_call(pb.HeartbeatRequest(session="s", agent_id="a")) is None
    name, call = carried_call(pb.HeartbeatRequest(report_applied=pb.ReportAppliedRequest(version=3)))
    assert name == "ReportApplied" and call.version == 3


def test_answers_reach_their_call_and_an_error_status_raises_the_rpcs_error() -> None:
    stream = _OpenStream(answer_within_s=1.0)
    manifest = stream.submit("get_manifest", pb.GetManifestRequest(session="s", agent_id="a"))
    report = stream.submit("report_applied", pb.ReportAppliedRequest(session="s"))
    sent = [stream.outgoing.get_nowait(), stream.outgoing.get_nowait()]
    assert [r.WhichOneof("call") for r in sent] == ["get_manifest", "report_applied"]
    assert sent[0].call_id != sent[1].call_id
    assert stream.answered(pb.HeartbeatResponse(carries_calls=True))  # a beat's answer
    assert stream.carries
    piece = pb.ManifestPiece()
    assert not stream.answered(pb.HeartbeatResponse(call_id=sent[0].call_id, manifest_piece=piece))
    assert not manifest.done.is_set()
    status = to_status(DigestMismatch("tensor w: digest differs", field="tensors"))
    stream.answered(pb.HeartbeatResponse(call_id=sent[1].call_id, last=True, error=status))
    assert report.done.is_set() and isinstance(report.error, DigestMismatch) and report.error.field == "tensors"
    stream.answered(pb.HeartbeatResponse(call_id=sent[0].call_id, manifest_piece=piece, last=True))
    assert manifest.done.is_set() and manifest.error is None and len(manifest.answers) == 2
    stream.answered(pb.HeartbeatResponse(call_id=99, last=True))  # nobody waits for it: dropped


def test_a_stream_that_ends_fails_its_calls_so_callers_make_the_rpc() -> None:
    stream = _OpenStream(answer_within_s=1.0)
    stream.answered(pb.HeartbeatResponse(carries_calls=True))
    waiting = stream.submit("report_applied", pb.ReportAppliedRequest())
    stream.close()
    assert waiting.done.is_set() and isinstance(waiting.error, TransportUnavailable)
    assert not stream.carries
    with pytest.raises(TransportUnavailable):
        stream.submit("report_applied", pb.ReportAppliedRequest())


def test_a_beat_is_overdue_only_when_nothing_was_heard_since() -> None:
    stream = _OpenStream(answer_within_s=1.0)
    assert not stream.overdue(100.0)  # no beat out
    stream.beat_sent(10.0)
    assert not stream.overdue(10.5) and stream.overdue(11.5)
    assert stream.wake_in(10.5, next_beat=20.0) == pytest.approx(0.5)
    call = stream.submit("get_manifest", pb.GetManifestRequest())
    call_id = stream.outgoing.get_nowait().call_id
    stream.answered(pb.HeartbeatResponse(call_id=call_id, manifest_piece=pb.ManifestPiece()))  # a sign of life
    assert not stream.overdue(time.monotonic() + 0.5)
    assert stream.overdue(time.monotonic() + 1.5)
    stream.answered(pb.HeartbeatResponse())  # the beat's answer
    assert not stream.overdue(time.monotonic() + 5)
    assert not call.done.is_set()


def test_a_client_falls_back_to_the_rpc_when_the_stream_ended_first() -> None:
    from weightsync.client import CoordinatorClient

    class EndedStream:
        calls: list[str] = []

        def carry(self, call: str, request: object, timeout_s: float) -> None:
            self.calls.append(call)
            raise TransportUnavailable("the heartbeat stream ended before the call was answered")

    client = CoordinatorClient("127.0.0.1:1", timeout_s=0.2, retries=0)
    client.carrier = EndedStream()
    with pytest.raises(TransportUnavailable) as exc:  # the RPC was made: nothing listens there
        client.report_applied(pb.ReportAppliedRequest(session="s", version=1, agent_id="a"))
    assert EndedStream.calls == ["report_applied"] and "stream ended" not in exc.value.message
    client.close()
