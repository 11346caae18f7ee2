"""A rollout's readiness (docs/design.md "Readiness"): ready once it serves the session's
newest committed version, or a newer one."""

from __future__ import annotations

from rollout_agent.sync.readiness import Readiness
from weightsync._proto import coordinator_pb2 as cpb
from weightsync._proto import types_pb2 as tpb


def status(*versions: tuple[int, int]) -> cpb.GetStatusResponse:
    return cpb.GetStatusResponse(versions=[tpb.VersionInfo(version=v, state=s) for v, s in versions])


def test_not_ready_until_it_serves_the_newest_committed_version_and_told_at_each_change() -> None:
    serving, said = [0], []
    r = Readiness(lambda: serving[0])
    r.watch(said.append)
    r.update()
    assert said == [False] and not r.ready  # the committed version is not known yet
    r.learn(status((3, tpb.READY), (2, tpb.COMMITTED), (1, tpb.COMMITTED)))
    assert (r.ready, r.committed) == (False, 2)
    serving[0] = 2
    r.update()
    r.note(tpb.VersionInfo(version=3, state=tpb.READY))  # not committed: nothing changes
    assert said == [False, True] and r.ready
    r.note(tpb.VersionInfo(version=3, state=tpb.COMMITTED))  # left behind
    assert said == [False, True, False] and r.committed == 3
    serving[0] = 4  # newer than the committed one (an INDEPENDENT session's)
    r.update()
    r.learn(status((1, tpb.COMMITTED)))  # an older view changes nothing
    assert said == [False, True, False, True] and r.committed == 3
    r.forget()  # the session was made again
    assert not r.ready and r.committed == 0


def test_a_session_with_no_committed_version_is_ready_once_read() -> None:
    r = Readiness(lambda: 0)
    r.learn(status((1, tpb.READY)))
    assert r.ready and r.committed == 0
