"""Optional TLS / mTLS and per-role bearer tokens for every gRPC server and client.

Everything is off by default (plaintext, no tokens: loopback and the demo). A deployment
turns on, independently:
- TLS: servers present `cert_file` / `key_file`; clients verify servers with `ca_file`.
- mTLS: servers with `require_client_cert` demand a client certificate signed by
  `ca_file`; clients present `cert_file` / `key_file` (one identity per agent, as a
  sidecar is both server and client).
- Bearer tokens: servers with `tokens_file` (JSON `{"trainer": ..., "rollout": ...,
  "admin": ...}`) require `authorization: Bearer <token>` on every call except health and
  reflection; the token's role decides what it may call (`ROLE_RULES`). Clients send
  `token`. A missing or unknown token is UNAUTHENTICATED, a role calling outside its
  rules PERMISSION_DENIED. Pods should get agent credentials (`agent_credential`,
  derived from the role token): one acts only for its own agent ids, and the file's
  `"revoked"` list refuses it from its next call. A server that must not hold the role
  tokens (an agent's own server in a pod) is given `"verifiers"` instead: the SHA-256 of
  each credential it accepts, from which no credential can be made. Whatever the token,
  the coordinator binds each agent id to the process that registered it (its agent key:
  `coordinator.agent_keys`), so a rollout cannot heartbeat, re-register or report as
  another agent, nor as the trainer.

The tcp / relay data plane is not covered: its reads carry per-version access tokens and
every byte is checked against the manifest's digests (docs/design.md "Security").
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import logging
import os
import secrets
import ssl
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

import grpc

from weightsync._proto import types_pb2 as tpb
from weightsync.carried_calls import AGENT_METHODS, COORDINATOR, calls_in
from weightsync.credentials import found_credential, read_credential
from weightsync.errors import InvalidArgument, PermissionDenied, Unauthenticated
from weightsync.validation import check_agent_id

ROLES = ("trainer", "rollout", "admin")
# Methods only some roles may call (admin may call everything); unlisted: any role.
ROLE_RULES: dict[str, frozenset[str]] = {
    **{COORDINATOR + m: frozenset({"trainer"}) for m in ("PublishVersion", "AbortVersion", "ReleaseVersion")},
    COORDINATOR + "ReportApplied": frozenset({"rollout"}),
    "/weightsync.v1.TrainerAgent/ReadChunks": frozenset({"rollout"}),
    "/weightsync.v1.RolloutAgent/Sync": frozenset({"trainer"}),
    "/weightsync.v1.RolloutAgent/Sample": frozenset({"trainer"}),  # the engine's time is the trainer's
    "/weightsync.v1.RolloutAgent/Audit": frozenset({"trainer"}),
    COORDINATOR + "AuditSession": frozenset({"trainer"}),  # a fresh one makes every rollout audit
    COORDINATOR + "DeleteSession": frozenset(),  # admin only
}
# Methods whose request names a role: it must be the caller's (a rollout token cannot
# attach as the trainer and bump the generation).
ROLE_IN_REQUEST = (COORDINATOR + "OpenSession", COORDINATOR + "RegisterAgent")
AGENT_TOKEN_PREFIX = "wsagent:"
AGENT_ROLES = ("trainer", "rollout")  # the roles agent credentials are made for
REVOKED = "revoked"  # the tokens file's list of revoked agent credentials
VERIFIERS = "verifiers"  # the tokens file's list of accepted credentials' digests
VERIFIER_PREFIX = "sha256:"
UNCHECKED_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
_ROLE_OF_ENUM = {tpb.TRAINER: "trainer", tpb.ROLLOUT: "rollout"}
log = logging.getLogger(__name__)
T = TypeVar("T")


def _read(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise InvalidArgument(f"cannot read {path!r}: {e.strerror}", field=what) from None


def read_token(path: str, role: str = "") -> str:
    """A bearer token kept in a file (a mounted Secret rather than an environment variable):
    the file's text, or `role`'s entry where it is a tokens file (`weightsync.credentials`)."""
    return read_credential(path, role)


def load_tokens(path: str) -> dict[str, str]:
    """role -> token from a JSON file; roles outside ROLES and empty tokens are refused. A
    `"revoked"` list beside them names agent credentials refused, a `"verifiers"` list the
    credentials accepted without the role's token (`load_auth`)."""
    return load_auth(path)[0]


def load_auth(path: str) -> tuple[dict[str, str], frozenset[str], frozenset[str]]:
    """(role -> token, revoked serials, verifiers) of a tokens file: JSON `{"trainer": ...,
    "rollout": ..., "admin": ..., "revoked": [serial, ...], "verifiers": ["sha256:<hex>",
    ...]}`, every key optional but one role token or one verifier.

    Raises:
        InvalidArgument: naming `auth_tokens_file`, for a file that is no such object.
    """
    try:
        tokens = json.loads(_read(path, "auth_tokens_file"))
    except json.JSONDecodeError as e:
        raise InvalidArgument(f"{path!r} is not JSON: {e}", field="auth_tokens_file") from None
    if not isinstance(tokens, dict) or not tokens:
        raise InvalidArgument(f"{path!r} must hold an object of role -> token", field="auth_tokens_file")
    lists = {}
    for key in (REVOKED, VERIFIERS):
        lists[key] = tokens.pop(key, [])
        if not isinstance(lists[key], list) or not all(isinstance(r, str) for r in lists[key]):
            raise InvalidArgument(f"{path!r}: {key!r} must be a list of strings", field="auth_tokens_file")
    for verifier in lists[VERIFIERS]:
        digest = verifier.removeprefix(VERIFIER_PREFIX)
        if not verifier.startswith(VERIFIER_PREFIX) or len(digest) != 64 or digest.strip("0123456789abcdef"):
            raise InvalidArgument(
                f"{path!r}: {verifier!r} is no verifier (`wsctl verifiers` prints them: sha256:<64 hex digits>)",
                field="auth_tokens_file",
            )
    if not tokens and not lists[VERIFIERS]:
        raise InvalidArgument(f"{path!r} holds neither a role token nor a verifier", field="auth_tokens_file")
    for role, token in tokens.items():
        if role not in ROLES:
            raise InvalidArgument(
                f"unknown role {role!r} (roles: {', '.join(ROLES)}; lists: {REVOKED}, {VERIFIERS})",
                field="auth_tokens_file",
            )
        if not isinstance(token, str) or len(token) < 16:
            raise InvalidArgument(
                f"the {role} token must be a string of at least 16 characters", field="auth_tokens_file"
            )
    if len(set(tokens.values())) != len(tokens):
        raise InvalidArgument("two roles share one token", field="auth_tokens_file")
    return tokens, frozenset(lists[REVOKED]), frozenset(lists[VERIFIERS])


@dataclass(frozen=True)
class Security:
    """This process's TLS material and bearer token (all optional; see the module doc)."""

    cert_file: str = ""
    key_file: str = ""
    ca_file: str = ""
    require_client_cert: bool = False
    token: str = ""
    tokens_file: str = ""
    token_file: str = ""  # where `token` came from: channels read it again when it changes
    token_role: str = ""  # the role whose token a tokens file at `token_file` gives

    def __post_init__(self) -> None:
        if bool(self.cert_file) != bool(self.key_file):
            raise InvalidArgument("set both or neither", field="tls_key_file" if self.cert_file else "tls_cert_file")
        if self.require_client_cert and not (self.ca_file and self.cert_file):
            raise InvalidArgument(
                "needs tls_ca_file and this server's own certificate", field="tls_require_client_cert"
            )

    def check_files(self) -> None:
        """Reads every configured file now (entry points fail at start, naming the flag)."""
        for path, what in (
            (self.cert_file, "tls_cert_file"),
            (self.key_file, "tls_key_file"),
            (self.ca_file, "tls_ca_file"),
        ):
            if path:
                _read(path, what)
        _check_pem(self.cert_file, self.key_file, self.ca_file)
        if self.tokens_file:
            load_tokens(self.tokens_file)

    def server_credentials(self) -> grpc.ServerCredentials | None:
        """TLS (mTLS with require_client_cert) for a server; None serves plaintext."""
        if not self.cert_file:
            return None
        # Read again when the files change (cert-manager renews a mounted Secret in place): a
        # server that kept its first read served the old certificate until restarted, and
        # every new connection failed once it expired. grpc asks at each new handshake.
        files = (self.key_file, self.cert_file, self.ca_file if self.require_client_cert else "")
        served = _FileValue(_certificate(*files), files, lambda: _certificate(*files), "TLS certificate files", 0.0)
        return grpc.dynamic_ssl_server_credentials(
            served.value,
            lambda: served.value if served.refresh() else None,  # None: keep the current one
            require_client_authentication=self.require_client_cert,
        )

    def request_checks(self) -> list[BearerAuth]:
        """The bearer-token check, when this server has a tokens file."""
        return [BearerAuth.from_file(self.tokens_file)] if self.tokens_file else []

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """TLS credentials from the files as they are now (this process's certificate where
        it has one); InvalidArgument naming the flag of a file that is no PEM pair, so a
        bad renewal keeps the channel made before it."""
        _check_pem(self.cert_file, self.key_file, self.ca_file)
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca_file, "tls_ca_file"),
            private_key=_read(self.key_file, "tls_key_file") if self.key_file else None,
            certificate_chain=_read(self.cert_file, "tls_cert_file") if self.cert_file else None,
        )

    def channel(self, address: str, options: Sequence[tuple[str, Any]]) -> grpc.Channel:
        """A channel to `address`: TLS when a CA is set (with this process's certificate
        for servers that demand one), carrying the bearer token when one is set."""
        if not self.ca_file:
            channel = grpc.insecure_channel(address, options=list(options))
            if not self.token and not self.token_file:
                return channel
            return grpc.intercept_channel(channel, _BearerToken(self.token, path=self.token_file, role=self.token_role))

        def secure() -> grpc.Channel:
            return grpc.secure_channel(address, self.channel_credentials(), options=list(options))

        # The interceptor asks the renewing channel for a callable at every call, so each
        # call goes out on the channel made from the files as they are now.
        renewing = _RenewingChannel(secure, (self.cert_file, self.key_file, self.ca_file))
        return grpc.intercept_channel(renewing, _BearerToken(self.token, path=self.token_file, role=self.token_role))


PLAINTEXT = Security()


def with_credential(security: Security | None, address: str, role: str) -> Security:
    """`security` carrying the default credential of the coordinator at `address` for `role`
    (`weightsync.credentials`): as it is where it carries a token already, or `address` is a
    unix socket. A credential not there yet is read once it appears (a client started
    before its coordinator)."""
    security = security or PLAINTEXT
    path = "" if security.token or security.token_file else found_credential(address)
    if not path:
        return security
    try:
        token = read_credential(path, role)
    except InvalidArgument:
        token = ""
    return dataclasses.replace(security, token=token, token_file=path, token_role=role)


class AioCalls:
    """An asyncio channel to `address` with `security`'s TLS (the files as they are now:
    made again when they change, looked at most once a second as a call starts), and the
    metadata each call carries (the bearer token, read again when its file changes). Made,
    used and closed inside one event loop."""

    def __init__(self, security: Security, address: str, options: Sequence[tuple[str, Any]]) -> None:
        self._security, self._address, self._options = security, address, list(options)
        paths = (security.cert_file, security.key_file, security.ca_file) if security.ca_file else ()
        self._channel = _FileValue(self._make(), paths, self._make, "TLS client files", 1.0)
        self._token = _token_value(security.token, security.token_file, security.token_role)
        self._retired: list[grpc.aio.Channel] = []

    def _make(self) -> grpc.aio.Channel:
        if not self._security.ca_file:
            return grpc.aio.insecure_channel(self._address, options=self._options)
        return grpc.aio.secure_channel(self._address, self._security.channel_credentials(), options=self._options)

    def channel(self) -> grpc.aio.Channel:
        """The channel made from the files as they are now (one replaced is closed with
        this object: calls in flight finish on it)."""
        before = self._channel.value
        if self._channel.refresh():
            self._retired.append(before)
        return self._channel.value

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return _bearer(self._token.get())

    async def close(self) -> None:
        for channel in (*self._retired, self._channel.value):
            await channel.close()


class _FileValue(Generic[T]):
    """A value read from files (`paths`; none for a value that came from no file), read
    again when any of them changes (looking at most every `every_s`): a Secret volume
    swaps its files in place. While they cannot be read (half-written, gone for a moment)
    the last value stays, with a warning once."""

    def __init__(self, value: T, paths: Sequence[str], read: Callable[[], T], what: str, every_s: float) -> None:
        self.value, self._read, self._what, self._every_s = value, read, what, every_s
        self._paths = tuple(p for p in paths if p)
        self._stamp = self._stamps()
        self._checked_at = time.monotonic()
        self._failing = False

    def _stamps(self) -> tuple[tuple[int, int, int], ...]:
        # what changes when a file is replaced or rewritten; a file not there yet (a
        # coordinator's credential before it starts) stamps zeros and is read once it appears
        return tuple(_stamp(path) for path in self._paths)

    def refresh(self) -> bool:
        """Reads the files again if they changed since the last read; True when it did."""
        if not self._paths or time.monotonic() - self._checked_at < self._every_s:
            return False
        self._checked_at = time.monotonic()
        try:
            stamp = self._stamps()
            changed = stamp != self._stamp
            if changed:
                self.value, self._stamp = self._read(), stamp
                log.info("%s changed: read again", self._what)
        except (OSError, InvalidArgument) as e:
            if not self._failing:
                log.warning("%s cannot be read (%s); keeping what was read before", self._what, e)
            self._failing = True
            return False
        self._failing = False
        return changed

    def get(self) -> T:
        self.refresh()
        return self.value


def _stamp(path: str) -> tuple[int, int, int]:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return (0, 0, 0)
    return (st.st_ino, st.st_mtime_ns, st.st_size)


def _token_value(token: str, path: str, role: str = "") -> _FileValue[str]:
    """A client's bearer token, read again from `path` (where it came from one) when the
    file changes, looked at most once a second."""
    return _FileValue(token, (path,), lambda: read_token(path, role), "bearer token file", 1.0)


def bearer_metadata(security: Security) -> tuple[tuple[str, str], ...]:
    """The metadata a call made without `security.channel` carries (its bearer token, as
    it is now; none without one): for raw asyncio stubs."""
    return _bearer(security.token)


def _bearer(token: str) -> tuple[tuple[str, str], ...]:
    """The metadata that carries `token` (none without one)."""
    return (("authorization", f"Bearer {token}"),) if token else ()


class _RenewingChannel(grpc.Channel):
    """A TLS channel made again from its files when they change (looked at, at most once a
    second, as a call starts): grpc reads a client's certificate, key and CA only when the
    channel is made, so an agent would keep the certificate it started with, and once it
    expired or its CA was rotated out (cert-manager, SPIFFE: hours) every new connection
    would fail until a restart. Calls in flight finish on the channel they started on; a replaced
    channel is closed `RETIRED_CHANNEL_S` later (streams still on it end as cancelled, and
    their callers open them again, as after a server restart)."""

    RETIRED_CHANNEL_S = 600.0  # longer than any unary call's deadline

    def __init__(self, make: Callable[[], grpc.Channel], paths: Sequence[str]) -> None:
        self._channel = _FileValue(make(), paths, make, "TLS client files", 1.0)
        self._retired: list[tuple[float, grpc.Channel]] = []
        self._lock = threading.Lock()

    def current(self) -> grpc.Channel:
        """The channel made from the files as they are now."""
        with self._lock:
            before = self._channel.value
            if self._channel.refresh():
                self._retired.append((time.monotonic(), before))
            while self._retired and time.monotonic() - self._retired[0][0] > self.RETIRED_CHANNEL_S:
                self._retired.pop(0)[1].close()
            return self._channel.value

    def unary_unary(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return self.current().unary_unary(method, *args, **kwargs)

    def unary_stream(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return self.current().unary_stream(method, *args, **kwargs)

    def stream_unary(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return self.current().stream_unary(method, *args, **kwargs)

    def stream_stream(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return self.current().stream_stream(method, *args, **kwargs)

    def subscribe(self, callback: Callable[..., Any], try_to_connect: bool = False) -> None:
        self.current().subscribe(callback, try_to_connect)

    def unsubscribe(self, callback: Callable[..., Any]) -> None:
        self.current().unsubscribe(callback)

    def close(self) -> None:
        with self._lock:
            for _, channel in self._retired:
                channel.close()
            self._retired.clear()
            self._channel.value.close()

    def __enter__(self) -> _RenewingChannel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _no_passphrase() -> bytes:
    # grpc takes no passphrase: an encrypted key is refused here, not prompted for on a TTY
    return b""


def _check_pem(cert_file: str, key_file: str, ca_file: str) -> None:
    """InvalidArgument unless the certificate and key are PEM and belong together and the CA
    file holds PEM certificates. grpc takes any bytes and fails later: a server then says
    only that its port could not be bound, a client that it could not connect."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    if cert_file and key_file:
        try:
            context.load_cert_chain(cert_file, key_file, password=_no_passphrase)
        except ssl.SSLError as e:
            raise InvalidArgument(
                f"{cert_file!r} and {key_file!r} are not a PEM certificate and its unencrypted private key "
                f"({e.reason or 'not PEM'})",
                field="tls_cert_file",
            ) from None
    if ca_file:
        try:
            context.load_verify_locations(cafile=ca_file)
        except ssl.SSLError as e:
            raise InvalidArgument(
                f"{ca_file!r} holds no PEM certificate ({e.reason or 'not PEM'})", field="tls_ca_file"
            ) from None


def _certificate(key_file: str, cert_file: str, ca_file: str) -> grpc.ServerCertificateConfiguration:
    _check_pem(cert_file, key_file, ca_file)  # a bad renewal keeps the last certificate
    pair = (_read(key_file, "tls_key_file"), _read(cert_file, "tls_cert_file"))
    return grpc.ssl_server_certificate_configuration([pair], _read(ca_file, "tls_ca_file") if ca_file else None)


class _BearerToken(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds `authorization: Bearer <token>` to every call (none when `token` is empty); with
    `path`, the token is read again (at most once a second) when the file changes, so a
    long-lived channel follows a rotated Secret."""

    def __init__(self, token: str, *, path: str = "", role: str = "") -> None:
        self._token = _token_value(token, path, role)

    def _with_token(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        bearer = _bearer(self._token.get())
        if not bearer:  # a TLS channel without a token: the interceptor only renews the channel
            return details
        metadata = [*(details.metadata or ()), *bearer]
        return _CallDetails(
            details.method, details.timeout, metadata, details.credentials, details.wait_for_ready, details.compression
        )

    def intercept_unary_unary(self, continuation: Callable[..., Any], details: Any, request: Any) -> Any:
        return continuation(self._with_token(details), request)

    def intercept_unary_stream(self, continuation: Callable[..., Any], details: Any, request: Any) -> Any:
        return continuation(self._with_token(details), request)

    def intercept_stream_unary(self, continuation: Callable[..., Any], details: Any, requests: Any) -> Any:
        return continuation(self._with_token(details), requests)

    def intercept_stream_stream(self, continuation: Callable[..., Any], details: Any, requests: Any) -> Any:
        return continuation(self._with_token(details), requests)


@dataclass(frozen=True)
class _CallDetails(grpc.ClientCallDetails):
    method: str
    timeout: float | None
    metadata: Any
    credentials: Any
    wait_for_ready: Any
    compression: Any


class BearerAuth:
    """Checks the caller's bearer token and its role's rules before the servicer runs
    (a `rpc.RequestCheck`: `rpc.StatusInterceptor` calls it and maps what it raises).

    A role token acts for any agent of its role; an agent credential (`agent_credential`)
    only for the agent ids it names: calls that name another agent are PERMISSION_DENIED.
    An agent credential is accepted when the role's token made it, or when its verifier
    (`credential_verifier`) is listed, and refused once its serial is revoked.
    """

    def __init__(
        self,
        tokens: Mapping[str, str],
        *,
        revoked: frozenset[str] = frozenset(),
        verifiers: frozenset[str] = frozenset(),
        path: str = "",
    ) -> None:
        """`path`: the file `tokens` came from, read again when it changes (a rotated Secret
        is swapped in place, a revocation added: neither needs a restart)."""
        self._tokens = _FileValue(
            (dict(tokens), revoked, verifiers), (path,), lambda: load_auth(path), "bearer tokens file", 1.0
        )

    @classmethod
    def from_file(cls, path: str) -> BearerAuth:
        """The check of a server given the tokens file at `path` (`load_auth`)."""
        tokens, revoked, verifiers = load_auth(path)
        return cls(tokens, revoked=revoked, verifiers=verifiers, path=path)

    def identity_of(self, metadata: Sequence[tuple[str, Any]] | None) -> tuple[str, frozenset[str]]:
        """(role, the agent ids it is bound to, none for a role token) of the call's token;
        Unauthenticated when none matches, or its credential was revoked."""
        tokens, revoked, verifiers = self._tokens.get()
        header = next((v for k, v in metadata or () if k == "authorization"), "")
        scheme, _, token = str(header).partition(" ")
        if scheme.lower() == "bearer" and token:
            if token.startswith(AGENT_TOKEN_PREFIX):
                fields = token[len(AGENT_TOKEN_PREFIX) :].split(":")
                role, ids, serial, mac = (
                    (fields[0], fields[1], "", fields[2]) if len(fields) == 3 else [*fields, "", "", "", ""][:4]
                )
                known = tokens.get(role)
                made = known is not None and hmac.compare_digest(_agent_mac(known, role, ids, serial), mac)
                # a verifier is a digest of the whole credential, role and ids included
                if made or (role in AGENT_ROLES and ids and credential_verifier(token) in verifiers):
                    if (serial and serial in revoked) or token in revoked:
                        raise Unauthenticated("authorization: this agent credential was revoked")
                    return role, frozenset(ids.split(","))
            else:
                for role, known in tokens.items():
                    if hmac.compare_digest(known.encode(), token.encode()):
                        return role, frozenset()
        raise Unauthenticated("authorization: missing or unknown bearer token")

    def before_read(self, method: str, metadata: Any) -> None:
        """The token, and its role's rule for `method`: all that needs no request."""
        if not method.startswith(UNCHECKED_PREFIXES):
            self._role_allowed(method, metadata)

    def while_streaming(self, method: str, metadata: Any) -> None:
        """Before each message of a response stream: a credential revoked since the call
        began ends it (a watch held open is refused as its next call would be). A token
        that is merely unknown now (role tokens rotated) keeps the stream it opened."""
        if method.startswith(UNCHECKED_PREFIXES):
            return
        try:
            self.identity_of(metadata)
        except Unauthenticated as e:
            if "revoked" in e.message:
                raise

    def _role_allowed(self, method: str, metadata: Any) -> tuple[str, frozenset[str]]:
        """(role, bound agent id) of the call's token, refused when its role may not call `method`."""
        role, bound = self.identity_of(metadata)
        _check_rule(role, method)
        return role, bound

    def __call__(self, method: str, metadata: Any, request: Any) -> None:
        if method.startswith(UNCHECKED_PREFIXES):
            return
        role, bound = self._role_allowed(method, metadata)
        if role == "admin":
            return
        # A stream's requests are checked one by one (`request` is first the iterator);
        # a call carried on a Heartbeats stream is authorized as the RPC it stands for.
        for name, message in calls_in(method, request):
            _check_rule(role, name)
            if name in ROLE_IN_REQUEST:
                asked = _ROLE_OF_ENUM.get(message.role)
                if asked is not None and asked != role:
                    raise PermissionDenied(f"role: a {role} token cannot act as {asked}", field="role")
            if bound and name in AGENT_METHODS and message.agent_id and message.agent_id not in bound:
                raise PermissionDenied(
                    f"agent_id: this token acts for agent {', '.join(map(repr, sorted(bound)))} only", field="agent_id"
                )


def _check_rule(role: str, method: str) -> None:
    """PermissionDenied when `role` may not call `method` (`ROLE_RULES`)."""
    allowed = ROLE_RULES.get(method)
    if role != "admin" and allowed is not None and role not in allowed:
        raise PermissionDenied(f"role {role!r} may not call {method.rsplit('/', 1)[-1]}")


def agent_token(role_token: str, role: str, agent_id: str) -> str:
    """A bearer token that acts as `role` for `agent_id` only, derived from the role's
    token (which stays with the operator): `wsctl agent-token` prints one per pod. It has
    no serial: only a new role token revokes it (`agent_credential` makes revocable ones)."""
    if role not in AGENT_ROLES:
        raise InvalidArgument(f"agent tokens are for trainer or rollout agents, not {role!r}", field="role")
    check_agent_id(agent_id)
    return f"{AGENT_TOKEN_PREFIX}{role}:{agent_id}:{_agent_mac(role_token, role, agent_id, '')}"


def agent_credential(role_token: str, role: str, agent_ids: Sequence[str], serial: str = "") -> str:
    """A workload's own credential: a bearer token that acts as `role` for `agent_ids` only
    (a trainer's ranks, one rollout), derived from the role's token, which stays with the
    operator; `serial` (drawn when not given) names it in the tokens file's `"revoked"`
    list: `wsagent:<role>:<id>[,<id>...]:<serial>:<mac>`. `wsctl credential` prints one."""
    if role not in AGENT_ROLES:
        raise InvalidArgument(f"agent credentials are for trainer or rollout agents, not {role!r}", field="role")
    if not agent_ids:
        raise InvalidArgument("name at least one agent id", field="agent_id")
    for agent_id in agent_ids:
        check_agent_id(agent_id)
    serial = serial or secrets.token_hex(8)
    if not serial.isalnum():
        raise InvalidArgument(f"{serial!r} must be letters and digits", field="serial")
    ids = ",".join(sorted(set(agent_ids)))
    return f"{AGENT_TOKEN_PREFIX}{role}:{ids}:{serial}:{_agent_mac(role_token, role, ids, serial)}"


def credential_serial(credential: str) -> str:
    """The serial of an agent credential ("" for a role token or an agent token without one)."""
    fields = credential.removeprefix(AGENT_TOKEN_PREFIX).split(":")
    return fields[2] if credential.startswith(AGENT_TOKEN_PREFIX) and len(fields) == 4 else ""


def credential_verifier(credential: str) -> str:
    """What a server lists under `"verifiers"` to accept `credential` without holding its
    role's token: `sha256:<hex>` of the whole credential. A credential's MAC is 256 bits
    drawn under the role's secret, so its digest tells nothing that would make another.

    Raises:
        InvalidArgument: naming `credential`, for a role token or anything else that is no
            agent credential (a role token's digest would name no role).
    """
    fields = credential.removeprefix(AGENT_TOKEN_PREFIX).split(":")
    if not credential.startswith(AGENT_TOKEN_PREFIX) or len(fields) not in (3, 4) or fields[0] not in AGENT_ROLES:
        raise InvalidArgument(
            "not an agent credential (wsagent:<role>:<ids>:<serial>:<mac>, from `wsctl credential`)",
            field="credential",
        )
    return VERIFIER_PREFIX + hashlib.sha256(credential.encode()).hexdigest()


def _agent_mac(role_token: str, role: str, ids: str, serial: str) -> str:
    message = f"{role}:{ids}:{serial}" if serial else f"{role}:{ids}"
    return hmac.new(role_token.encode(), message.encode(), hashlib.sha256).hexdigest()
