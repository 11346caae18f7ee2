"""An attacker on the coordinator's host: another process (another user, or a pod sharing the
network namespace) that tries to take over a session. Run as
`python -m tests.integration.attacker ADDRESS SESSION [--token T]`; prints one JSON object,
each attack's outcome: "OK" where it went through, else the error's class and message.

It sends `--token` (none by default) and never looks for a credential of its own: run it
with a HOME of its own and no WEIGHTSYNC_CREDENTIAL, as another user would be.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

from devtools.synthetic import good_report
from tests.unit.helpers import make_part, sample_arrays
from weightsync.client import CoordinatorClient
from weightsync.manifest import Endpoint
from weightsync.security import Security


def attacks(session: str, generation: int, agent_id: str) -> dict[str, Callable[[CoordinatorClient], Any]]:
    """Each attack the issue names, by name."""
    part, _ = make_part(sample_arrays(7))

    def refuse(c: CoordinatorClient, version: int) -> Any:
        c.register_agent(session, agent_id, trainer=False, endpoint=Endpoint())
        header, manifest = c.get_manifest(session, version, agent_id=agent_id)
        report = good_report(session, version, header.version.manifest_digest, manifest)
        report.agent_id, report.local_error = agent_id, "refused by an attacker"
        return c.report_applied(report, retries=0)

    return {
        "status": lambda c: c.status(session),
        "open_session_as_trainer": lambda c: c.open_session(session, trainer=True, incarnation="evil"),
        "publish_v1000": lambda c: c.publish_part(
            session, generation=generation, version=1000, idempotency_key="evil", part=part
        ),
        "force_release_v1": lambda c: c.release_version(session, 1, generation=generation, force=True),
        "abort_v1": lambda c: c.abort_version(session, generation=generation, version=1, reason="evil"),
        "delete_session_force": lambda c: c.delete_session(session, force=True),
        "register_r0": lambda c: c.register_agent(session, "r0", trainer=False, endpoint=Endpoint()),
        "register_and_refuse_v1": lambda c: refuse(c, 1),
        "register_and_refuse_v2": lambda c: refuse(c, 2),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("address")
    p.add_argument("session")
    p.add_argument("--token", default="")
    p.add_argument("--generation", type=int, default=1)
    p.add_argument("--agent-id", default="evil")
    p.add_argument("--only", action="append", default=[])
    args = p.parse_args()
    outcomes: dict[str, str] = {}
    with CoordinatorClient(args.address, timeout_s=30, retries=0, security=Security(token=args.token)) as client:
        for name, attack in attacks(args.session, args.generation, args.agent_id).items():
            if args.only and name not in args.only:
                continue
            try:
                attack(client)
                outcomes[name] = "OK"
            except Exception as e:  # noqa: BLE001 - every outcome is reported
                outcomes[name] = f"{type(e).__name__}: {e}"
    print(json.dumps(outcomes))


if __name__ == "__main__":
    main()
