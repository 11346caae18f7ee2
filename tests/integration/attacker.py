"""An attacker on the coordinator's host: another process (another user, or a pod sharing the
network namespace) that tries to take over a session. Run as
`python -m tests.integration.attacker ADDRESS SESSION [--token T]`; prints one JSON object,
each attack's outcome: "OK" where it went through, else the gRPC status the coordinator
answered and its message (`PERMISSION_DENIED: agent_id: ...`).

It sends `--token` (none by default) and never looks for a credential of its own: run it
with a HOME of its own and no WEIGHTSYNC_CREDENTIAL, as another user would be.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

from devtools.synthetic import good_report
from tests.unit.helpers import make_part, sample_arrays
from weightsync._proto import types_pb2 as tpb
from weightsync.client import CoordinatorClient
from weightsync.errors import DeadlineExceeded, WeightsyncError, status_name_for
from weightsync.manifest import Endpoint
from weightsync.security import Security

JOIN_WAIT_S = 60.0  # how long `join_then_refuse` keeps its lease while it waits for the version


def attacks(
    session: str, generation: int, agent_id: str, version: int
) -> dict[str, Callable[[CoordinatorClient], Any]]:
    """Each attack the issue names, by name."""
    part, _ = make_part(sample_arrays(7))

    def refuse(c: CoordinatorClient, version: int) -> Any:
        c.register_agent(session, agent_id, trainer=False, endpoint=Endpoint())
        return refuse_registered(c, version)

    def refuse_registered(c: CoordinatorClient, version: int) -> Any:
        header, manifest = c.get_manifest(session, version, agent_id=agent_id)
        report = good_report(session, version, header.version.manifest_digest, manifest)
        report.agent_id, report.local_error = agent_id, "refused by an attacker"
        return c.report_applied(report, retries=0)

    def join_then_refuse(c: CoordinatorClient) -> Any:
        """Joins before `version` is published, keeps its lease until the version is READY
        (it is then one of the rollouts the version requires), and refuses it."""
        c.register_agent(session, agent_id, trainer=False, endpoint=Endpoint())
        deadline = time.monotonic() + JOIN_WAIT_S
        while not any(v.version == version and v.state == tpb.READY for v in c.status(session).versions):
            if time.monotonic() > deadline:
                raise DeadlineExceeded(f"version {version} was not READY within {JOIN_WAIT_S}s")
            c.heartbeat(session, agent_id)
            time.sleep(0.1)
        return refuse_registered(c, version)

    return {
        "status": lambda c: c.status(session),
        "open_session_as_trainer": lambda c: c.open_session(session, trainer=True, incarnation="evil"),
        "publish_v1000": lambda c: c.publish_part(
            session, generation=generation, version=1000, idempotency_key="evil", part=part
        ),
        "force_release_v1": lambda c: c.release_version(session, 1, generation=generation, force=True),
        "abort_v1": lambda c: c.abort_version(session, generation=generation, version=1, reason="evil"),
        "register_r0": lambda c: c.register_agent(session, "r0", trainer=False, endpoint=Endpoint()),
        "register_and_refuse_v1": lambda c: refuse(c, 1),
        "register_and_refuse_v2": lambda c: refuse(c, 2),
        "delete_session_force": lambda c: c.delete_session(session, force=True),  # last: the session goes
        "join_then_refuse": join_then_refuse,  # only when named (--only): it waits for --version
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("address")
    p.add_argument("session")
    p.add_argument("--token", default="")
    p.add_argument("--generation", type=int, default=1)
    p.add_argument("--agent-id", default="evil")
    p.add_argument("--version", type=int, default=1, help="the version join_then_refuse waits for and refuses")
    p.add_argument("--only", action="append", default=[])
    args = p.parse_args()
    outcomes: dict[str, str] = {}
    with CoordinatorClient(args.address, timeout_s=30, retries=0, security=Security(token=args.token)) as client:
        for name, attack in attacks(args.session, args.generation, args.agent_id, args.version).items():
            if args.only and name not in args.only or not args.only and name == "join_then_refuse":
                continue
            try:
                attack(client)
                outcomes[name] = "OK"
            except WeightsyncError as e:  # what the coordinator answered, as its status
                outcomes[name] = f"{status_name_for(e)}: {e}"
            except Exception as e:  # noqa: BLE001 - every outcome is reported
                outcomes[name] = f"client error {type(e).__name__}: {e}"
    print(json.dumps(outcomes))


if __name__ == "__main__":
    main()
