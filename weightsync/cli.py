"""wsctl: inspect a weightsync session (status, versions, manifest, watch) and act on it."""

from __future__ import annotations

import argparse
import json
import os
import stat
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from google.protobuf.json_format import MessageToDict
from google.protobuf.timestamp_pb2 import Timestamp
from rich.console import Console
from rich.live import Live
from rich.table import Table

from weightsync._proto import coordinator_pb2 as pb
from weightsync._proto import types_pb2 as tpb
from weightsync.client import CoordinatorClient
from weightsync.config import bounded_number
from weightsync.credentials import CREDENTIAL_ENV
from weightsync.digests import hex64
from weightsync.errors import DeadlineExceeded, InvalidArgument, NotFound, WeightsyncError, status_name_for
from weightsync.security import (
    REVOKED,
    VERIFIERS,
    Security,
    agent_credential,
    agent_token,
    credential_serial,
    credential_verifier,
    load_tokens,
    read_token,
    with_credential,
)
from weightsync.transports.fs import FsStore, store_error
from weightsync.transports.fs_options import parse_fs_options
from weightsync.validation import UINT32_MAX, check_address
from weightsync.wire import unix_seconds

STATE_STYLE = {
    "STAGING": "yellow",
    "READY": "cyan",
    "COMMITTED": "green",
    "PARTIAL": "magenta",
    "FAILED": "red",
    "RELEASED": "dim",
}


def _state(v: tpb.VersionInfo) -> str:
    return tpb.VersionState.Name(v.state)


def _ts(ts: Timestamp) -> str:
    t = unix_seconds(ts)
    return time.strftime("%H:%M:%S", time.localtime(t)) if t else "-"


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f}"


def versions_table(versions: Sequence[tpb.VersionInfo], handshakes: Sequence[Any] = ()) -> Table:
    table = Table(title="versions")
    for col in (
        "version",
        "state",
        "ranks",
        "MiB",
        "stage s",
        "handshakes ok/all",
        "leases",
        "ready",
        "committed",
        "flip",
        "skew ms",
        "reason",
    ):
        table.add_column(col)
    for v in versions:
        hs = [h for h in handshakes if h.version == v.version]
        state = _state(v)
        table.add_row(
            str(v.version),
            f"[{STATE_STYLE.get(state, '')}]{state}[/]",
            f"{v.sealed_ranks}/{v.trainer_ranks}",
            _mib(v.total_bytes),
            f"{v.stage_seconds:.3f}",
            f"{sum(h.ok for h in hs)}/{len(hs)}",
            str(v.leases),
            _ts(v.ready_at),
            _ts(v.committed_at),
            _flip(v),
            f"{v.flip_skew_seconds * 1e3:.1f}" if v.HasField("flip_skew_seconds") else "-",
            v.reason,
        )
    return table


def _flip(v: tpb.VersionInfo) -> str:
    """How the version's rollouts took it: independent, or atomic and where its flip stands."""
    if v.flip_policy != tpb.ATOMIC:
        return "independent" if v.flip_policy == tpb.INDEPENDENT else "-"
    if v.HasField("flip_decided_at"):
        return f"atomic: decided {_ts(v.flip_decided_at)}"
    return f"atomic: {v.prepared} prepared"


def cmd_status(client: CoordinatorClient, args: argparse.Namespace, console: Console) -> int:
    st = client.status(args.session, args.limit)
    if args.json:
        print(json.dumps(MessageToDict(st, preserving_proto_field_name=True)))
        return 0
    console.print(
        f"session [bold]{st.session}[/]  generation {st.generation}  trainer ranks {st.trainer_ranks}  "
        f"min rollouts {st.min_rollouts}  {_flip_settings(st)}"
    )
    agents = Table(title="agents")
    for col in ("agent", "role", "rank", "generation", "endpoint", "host", "alive", "version"):
        agents.add_column(col)
    for a in st.agents:
        fenced = a.role == tpb.TRAINER and a.generation and a.generation < st.generation
        agents.add_row(
            a.agent_id,
            tpb.Role.Name(a.role),
            str(a.rank),
            (f"[red]{a.generation} (fenced)[/]" if fenced else str(a.generation)) if a.role == tpb.TRAINER else "",
            a.endpoint.address,
            a.endpoint.host_id,
            "yes" if a.alive else "[red]no[/]",
            str(a.current_version),
        )
    console.print(agents)
    console.print(versions_table(st.versions, st.handshakes))
    if st.handshakes:
        hs = Table(title="handshakes")
        for col in ("version", "agent", "ok", "pull s", "apply s", "MiB", "mismatch"):
            hs.add_column(col)
        for h in st.handshakes[: args.limit * 4]:
            hs.add_row(
                str(h.version),
                h.agent_id,
                "[green]OK[/]" if h.ok else "[red]DATA_LOSS[/]",
                f"{h.timings.pull_seconds:.3f}",
                f"{h.timings.apply_seconds:.3f}",
                _mib(h.bytes_pulled),
                h.mismatch,
            )
        console.print(hs)
    return 0


def _flip_settings(st: pb.GetStatusResponse) -> str:
    """The session's flip policy, and for atomic its deadline and prepared-loss rule."""
    if st.flip_policy != tpb.ATOMIC:
        return "flip independent"
    loss = tpb.PreparedLoss.Name(st.prepared_loss).lower()
    return f"flip atomic (prepare within {st.prepare_timeout_seconds:g} s; a rollout lost once prepared: {loss})"


def cmd_versions(client: CoordinatorClient, args: argparse.Namespace, console: Console) -> int:
    st = client.status(args.session, args.limit)
    if args.json:
        print(json.dumps([MessageToDict(v, preserving_proto_field_name=True) for v in st.versions]))
        return 0
    console.print(versions_table(st.versions, st.handshakes))
    return 0


def cmd_manifest(client: CoordinatorClient, args: argparse.Namespace, console: Console) -> int:
    header, manifest = client.get_manifest(args.session, args.version)
    digests = manifest.tensor_digests()
    sums = manifest.tensor_sums()
    shards = manifest.shards_of()
    if args.json:
        out = {
            "header": MessageToDict(header, preserving_proto_field_name=True),
            "manifest_digest": manifest.digest(),
            "parts": [p.to_dict() for p in manifest.parts],
        }
        print(json.dumps(out))
        return 0
    v = header.version
    agg = header.aggregates
    console.print(
        f"version [bold]{v.version}[/] {_state(v)}  digest {v.manifest_digest[:16]}…  chunk {header.chunk_bytes} B  "
        f"tensors {agg.tensor_count}  elements {agg.element_count:,}  grand_total {agg.grand_total:.6g}"
    )
    parts = Table(title="parts")
    for col in ("rank", "endpoint", "MiB", "chunks", "stage s"):
        parts.add_column(col)
    for p in header.parts:
        parts.add_row(
            str(p.rank), p.endpoint.address, _mib(p.total_bytes), str(p.chunk_count), f"{p.stage_seconds:.3f}"
        )
    console.print(parts)
    table = Table(title="tensors")
    for col in ("name", "dtype", "shape", "shards", "xxh3", "sum"):
        table.add_column(col)
    for name, spec in manifest.tensors.items():
        table.add_row(
            name, spec.dtype, str(list(spec.shape)), str(len(shards[name])), hex64(digests[name]), f"{sums[name]:.6g}"
        )
    console.print(table)
    return 0


def cmd_watch(client: CoordinatorClient, args: argparse.Namespace, console: Console) -> int:
    seen = 0
    seq = args.since
    deadline = time.monotonic() + args.timeout if args.timeout else None
    live = None if args.json else Live(console=console, auto_refresh=False)
    try:
        if live is not None:
            live.start()
        while True:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return 0
            try:
                for ev in client.watch(args.session, seq, timeout_s=remaining):
                    seq = ev.seq
                    seen += 1
                    if args.json:
                        print(json.dumps(MessageToDict(ev, preserving_proto_field_name=True)), flush=True)
                    else:
                        st = client.status(args.session, args.limit)
                        live.update(versions_table(st.versions, st.handshakes), refresh=True)  # type: ignore[union-attr]
                    if args.count and seen >= args.count:
                        return 0
            except DeadlineExceeded:
                return 0
    finally:
        if live is not None:
            live.stop()


def cmd_delete_session(client: CoordinatorClient, args: argparse.Namespace, console: Console) -> int:
    """A finished job's session and all stored for it; named in full (never the default).
    With --fs-root, its directory in the fs store too (the coordinator cannot reach the
    store), also for a session deleted before (NOT_FOUND: no manifest names those parts)."""
    # a root or option it cannot use: refused before the delete
    store = FsStore(args.fs_root, parse_fs_options(args.fs_option)) if args.fs_root else None
    try:
        deleted: pb.DeleteSessionResponse | None = client.delete_session(args.name, force=args.force)
    except NotFound:
        if store is None:
            raise
        deleted = None
    store_removed = False
    if store is not None:
        try:
            store_removed = store.remove_session(args.name)
        except OSError as e:
            raise store_error(
                e, f"the session was deleted; its directory under {args.fs_root} was not removed", writing=True
            ) from e
        if deleted is None and not store_removed:
            raise NotFound(f"session {args.name!r} not found, nor its directory under {args.fs_root}")
    if args.json:
        out: dict[str, Any] = {"versions": "0", "agents": 0}
        if deleted is not None:
            out = MessageToDict(deleted, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
        if args.fs_root:
            out["fs_store_removed"] = store_removed
        print(json.dumps(out))
        return 0
    if deleted is None:
        console.print(f"session {args.name!r} was deleted before")
    else:
        console.print(f"deleted session {args.name!r}: {deleted.versions} version(s), {deleted.agents} agent(s)")
    if args.fs_root:
        where = f"{args.fs_root.rstrip('/')}/{args.name}"
        console.print(f"removed {where}" if store_removed else f"the fs store holds nothing of it ({where})")
    return 0


def audit_table(audits: pb.AuditSessionResponse) -> Table:
    """One row per live rollout: the version it serves and what its last audit found."""
    table = Table(title=f"audit of {audits.session} (newest committed version {audits.committed_version})")
    for col in ("agent", "serves", "audited", "result", "tensors", "unaudited", "audit s", "age s", "heals", "differs"):
        table.add_column(col)
    for r in audits.rollouts:
        a = r.audit
        if not r.HasField("audit"):
            result = "[yellow]none reported[/]"
        elif not a.version:
            result = "no version yet"
        elif a.exact:
            result = "[green]EXACT[/]"
        else:
            result = f"[red]MISMATCH {a.mismatch_count}[/]"
        if audits.request_seq and r.HasField("audit") and not r.answered:
            result += " [yellow](older: no answer)[/]"
        if a.unserved_version:
            result += f" [red]v{a.unserved_version} not served[/]"
        differs = ", ".join(m.tensor for m in a.mismatches[:4])
        if a.mismatch_count > 4:
            differs += f" (+{a.mismatch_count - 4})"
        table.add_row(
            r.agent_id,
            str(r.current_version),
            str(a.version) if r.HasField("audit") else "-",
            result,
            str(a.tensors),
            str(a.unaudited),
            f"{a.seconds:.3f}",
            f"{a.age_seconds:.1f}",
            str(a.heals),
            differs,
        )
    return table


def audit_clean(audits: pb.AuditSessionResponse) -> bool:
    """Every live rollout reported an audit (answering the request, when fresh) that found
    the version it was given, exactly, and serves it."""
    return all(
        r.HasField("audit") and r.audit.exact and not r.audit.unserved_version
        and (r.answered or not audits.request_seq)
        for r in audits.rollouts
    )  # fmt: skip


def cmd_audit(client: CoordinatorClient, args: argparse.Namespace, console: Console) -> int:
    """What every live rollout serves, audited bit for bit against the version it was given
    (its last audit; --fresh: each audits now). Exit 1 unless every one is exact."""
    audits = client.audit_session(args.session, fresh=args.fresh, wait_s=args.wait_s)
    if args.json:
        print(
            json.dumps(
                MessageToDict(audits, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
            )
        )
    else:
        console.print(audit_table(audits))
    return 0 if audit_clean(audits) else 1


def _acting_generation(client: CoordinatorClient, args: argparse.Namespace) -> int:
    """The generation a write carries: --generation, else the session's current one (the
    operator acts for the trainer that runs now; a trainer replaced meanwhile makes the
    write FAILED_PRECONDITION, not a write for the wrong run)."""
    return args.generation or client.status(args.session, 1).generation


def _print_version(v: tpb.VersionInfo, args: argparse.Namespace, console: Console) -> int:
    if args.json:
        print(json.dumps(MessageToDict(v, preserving_proto_field_name=True)))
    else:
        console.print(versions_table([v]))
    return 0


def cmd_abort_version(client: CoordinatorClient, args: argparse.Namespace, console: Console) -> int:
    """A version that cannot commit (STAGING, READY or PARTIAL) -> FAILED, with the reason
    recorded; rollouts do not take it, and the trainer's wait for it ends."""
    v = client.abort_version(
        args.session, generation=_acting_generation(client, args), version=args.version, reason=args.reason
    )
    return _print_version(v, args, console)


def cmd_release_version(client: CoordinatorClient, args: argparse.Namespace, console: Console) -> int:
    """A version -> RELEASED, so the trainer may reuse its slot; refused while a live rollout
    holds a lease on it (the message names them), and for the session's newest COMMITTED
    version (servable until a newer one commits), unless --force."""
    v = client.release_version(
        args.session, args.version, generation=_acting_generation(client, args), force=args.force
    )
    return _print_version(v, args, console)


COMMANDS = {
    "status": cmd_status,
    "versions": cmd_versions,
    "manifest": cmd_manifest,
    "watch": cmd_watch,
    "delete-session": cmd_delete_session,
    "abort-version": cmd_abort_version,
    "release-version": cmd_release_version,
    "audit": cmd_audit,
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="wsctl", description=__doc__)
    p.add_argument(
        "--coordinator",
        default=None,
        help="host:port or unix:/path (default: $WEIGHTSYNC_WSCTL_COORDINATOR or 127.0.0.1:50051)",
    )
    p.add_argument("--session", default=None, help="session (default: $WEIGHTSYNC_WSCTL_SESSION or demo)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--timeout-s", type=bounded_number(0.001, float), default=10.0, help="deadline of each call")
    for name, what in (
        ("tls-ca-file", "PEM CA of the coordinator's certificate (TLS)"),
        ("tls-cert-file", "PEM client certificate (mTLS)"),
        ("tls-key-file", "its PEM key"),
        ("auth-token", "bearer token (any role may read)"),
    ):
        var = "WEIGHTSYNC_WSCTL_" + name.upper().replace("-", "_")
        p.add_argument(f"--{name}", default=os.environ.get(var, ""), help=f"{what} (default: ${var})")
    # --json is accepted after the subcommand too (`wsctl versions --json`); SUPPRESS keeps
    # a --json given before it when the subcommand has none.
    json_after = argparse.ArgumentParser(add_help=False)
    json_after.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="machine-readable output")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("status", help="session, agents, versions, handshakes", parents=[json_after])
    s.add_argument("--limit", type=bounded_number(0, high=UINT32_MAX), default=10)
    s = sub.add_parser("versions", help="versions, newest first", parents=[json_after])
    s.add_argument("--limit", type=bounded_number(0, high=UINT32_MAX), default=20)
    s = sub.add_parser("manifest", help="one version's manifest (0 = newest servable)", parents=[json_after])
    s.add_argument("version", type=bounded_number(0))
    s = sub.add_parser("watch", help="follow version events live", parents=[json_after])
    s.add_argument("--since", type=bounded_number(0), default=0, help="replay events after this sequence number")
    s.add_argument("--count", type=bounded_number(0), default=0, help="exit after N events")
    s.add_argument("--timeout", type=bounded_number(0, float), default=0, help="exit after N seconds")
    s.add_argument("--limit", type=bounded_number(0, high=UINT32_MAX), default=10)
    s = sub.add_parser(
        "audit",
        help="every live rollout's audit of the weights it serves (exit 1 unless all exact; trainer or admin token)",
        parents=[json_after],
    )
    s.add_argument("--fresh", action="store_true", help="every live rollout audits now (default: its last audit)")
    s.add_argument(
        "--wait-s", type=bounded_number(0, float, high=120), default=0, help="--fresh: how long to wait (0: 15 s)"
    )
    s = sub.add_parser(
        "delete-session", help="delete a finished job's session and all stored for it (admin)", parents=[json_after]
    )
    s.add_argument("name", help="the session, in full (--session is not used here)")
    s.add_argument("--force", action="store_true", help="even while agents hold live leases")
    s.add_argument(
        "--fs-root",
        default="",
        help="the fs store's root (the trainers' --fs-root): remove the session's directory there too",
    )
    s.add_argument(
        "--fs-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a storage option of --fs-root, as the trainers' --fs-option (repeatable)",
    )
    generation = argparse.ArgumentParser(add_help=False)
    generation.add_argument(
        "--generation",
        type=bounded_number(0),
        default=0,
        help="the trainer generation the write carries (default: the session's current one)",
    )
    s = sub.add_parser(
        "abort-version",
        help="mark a version that cannot commit FAILED (admin or trainer token)",
        parents=[json_after, generation],
    )
    s.add_argument("version", type=bounded_number(1))
    s.add_argument("--reason", required=True, help="recorded with the version (shown in `versions`)")
    s = sub.add_parser(
        "release-version",
        help="mark a version RELEASED so its slot may be reused (admin or trainer token)",
        parents=[json_after, generation],
    )
    s.add_argument("version", type=bounded_number(1))
    s.add_argument(
        "--force",
        action="store_true",
        help="even while live rollouts hold leases on it, and even the session's newest COMMITTED version",
    )
    s = sub.add_parser("agent-token", help="print the bearer token of one agent (offline; derived from the role token)")
    s.add_argument("--auth-tokens-file", required=True, help="the servers' role -> token JSON")
    s.add_argument("--role", required=True, choices=("trainer", "rollout"))
    s.add_argument("--agent-id", required=True)
    s = sub.add_parser(
        "credential",
        help="print a workload's own credential: a token acting for its agent ids only, revocable (offline)",
    )
    s.add_argument("--auth-tokens-file", required=True, help="the servers' role -> token JSON")
    s.add_argument("--role", required=True, choices=("trainer", "rollout"))
    s.add_argument("--agent-id", required=True, action="append", help="an id it may act as (repeatable)")
    s.add_argument("--serial", default="", help="its name in the revoked list (default: drawn)")
    s = sub.add_parser(
        "revoke", help="revoke a workload's credential: servers reading the tokens file refuse it within a second"
    )
    s.add_argument("--auth-tokens-file", required=True, help="the servers' role -> token JSON (rewritten in place)")
    s.add_argument("credential", help="the credential, or its serial")
    s = sub.add_parser(
        "verifiers",
        help="print a tokens file for agents' own servers that accepts these credentials and makes none (offline)",
    )
    s.add_argument("credential_file", nargs="+", help="a file holding one credential (`wsctl credential`'s output)")
    return p


def cmd_credential(args: argparse.Namespace) -> int:
    """A workload's own credential: mount it alone into its pod (never the tokens file)."""
    role_token = load_tokens(args.auth_tokens_file).get(args.role)
    if role_token is None:
        raise InvalidArgument(f"{args.auth_tokens_file!r} holds no {args.role} token", field="role")
    print(agent_credential(role_token, args.role, args.agent_id, args.serial))
    return 0


def cmd_revoke(args: argparse.Namespace) -> int:
    """Adds the credential's serial (the whole token where it has none) to the tokens file's
    revoked list, written whole under the file's mode (servers read it again on change)."""
    load_tokens(args.auth_tokens_file)  # refused as a server would refuse it
    path = Path(args.auth_tokens_file)
    body = json.loads(path.read_text())
    entry = credential_serial(args.credential) or args.credential
    body[REVOKED] = sorted({*body.get(REVOKED, []), entry})
    made = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(made, os.O_WRONLY | os.O_CREAT | os.O_EXCL, stat.S_IMODE(path.stat().st_mode))
    with os.fdopen(fd, "w") as f:
        json.dump(body, f, indent=1)
    os.replace(made, path)
    print(f"revoked {entry}")
    return 0


def cmd_verifiers(args: argparse.Namespace) -> int:
    """`{"verifiers": [...]}`: an agent's server given it as --auth-tokens-file accepts
    exactly these credentials (under their role and ids, refused once revoked), and no
    credential can be made from it, so every pod may mount it (a ConfigMap)."""
    verifiers = sorted({credential_verifier(read_token(path)) for path in args.credential_file})
    print(json.dumps({VERIFIERS: verifiers}, indent=1))
    return 0


def cmd_agent_token(args: argparse.Namespace) -> int:
    """An agent token acts only for its agent id: hand each pod its own, never the role token."""
    role_token = load_tokens(args.auth_tokens_file).get(args.role)
    if role_token is None:
        raise InvalidArgument(f"{args.auth_tokens_file!r} holds no {args.role} token", field="role")
    print(agent_token(role_token, args.role, args.agent_id))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.coordinator = args.coordinator or os.environ.get("WEIGHTSYNC_WSCTL_COORDINATOR", "127.0.0.1:50051")
    args.session = args.session or os.environ.get("WEIGHTSYNC_WSCTL_SESSION", "demo")
    # Piped output is not cut to 80 columns: tensor names stay whole for grep and scripts.
    console = Console(width=None if sys.stdout.isatty() else 200)
    try:
        if args.command == "agent-token":
            return cmd_agent_token(args)
        if args.command == "credential":
            return cmd_credential(args)
        if args.command == "revoke":
            return cmd_revoke(args)
        if args.command == "verifiers":
            return cmd_verifiers(args)
        check_address(args.coordinator, "coordinator")
        credential = "" if args.auth_token else os.environ.get(CREDENTIAL_ENV, "")
        token = read_token(credential, "admin") if credential else args.auth_token
        security = Security(
            args.tls_cert_file,
            args.tls_key_file,
            args.tls_ca_file,
            token=token,
            token_file=credential,
            token_role="admin",
        )
        security = with_credential(security, args.coordinator, "admin")
        security.check_files()
    except WeightsyncError as e:
        print(f"wsctl: {e.message}", file=sys.stderr)
        return 2
    with CoordinatorClient(args.coordinator, timeout_s=args.timeout_s, retries=1, security=security) as client:
        try:
            return COMMANDS[args.command](client, args, console)
        except WeightsyncError as e:
            code = getattr(e, "grpc_code", None) or status_name_for(e)  # the server's, else ours for the error
            print(f"wsctl: {code}: {e.message}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            return 130


if __name__ == "__main__":
    sys.exit(main())
