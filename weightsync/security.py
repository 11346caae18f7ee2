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
  rules PERMISSION_DENIED.

The tcp / relay data plane is not covered: its reads carry per-version access tokens and
every byte is checked against the manifest's digests (DESIGN "Data plane").
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from weightsync._proto import types_pb2 as tpb
from weightsync.errors import InvalidArgument, PermissionDenied, Unauthenticated

ROLES = ("trainer", "rollout", "admin")
# Methods only some roles may call (admin may call everything); unlisted: any role.
ROLE_RULES: dict[str, frozenset[str]] = {
    "/weightsync.v1.Coordinator/PublishVersion": frozenset({"trainer"}),
    "/weightsync.v1.Coordinator/AbortVersion": frozenset({"trainer"}),
    "/weightsync.v1.Coordinator/ReleaseVersion": frozenset({"trainer"}),
    "/weightsync.v1.Coordinator/ReportApplied": frozenset({"rollout"}),
    "/weightsync.v1.TrainerAgent/ReadChunks": frozenset({"rollout"}),
    "/weightsync.v1.RolloutAgent/Sync": frozenset({"trainer"}),
}
# Methods whose request names a role: it must be the caller's (a rollout token cannot
# attach as the trainer and bump the generation).
ROLE_IN_REQUEST = ("/weightsync.v1.Coordinator/OpenSession", "/weightsync.v1.Coordinator/RegisterAgent")
UNCHECKED_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
_ROLE_OF_ENUM = {tpb.TRAINER: "trainer", tpb.ROLLOUT: "rollout"}


def _read(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise InvalidArgument(what, f"cannot read {path!r}: {e.strerror}") from None


def load_tokens(path: str) -> dict[str, str]:
    """role -> token from a JSON file; roles outside ROLES and empty tokens are refused."""
    try:
        tokens = json.loads(_read(path, "auth_tokens_file"))
    except json.JSONDecodeError as e:
        raise InvalidArgument("auth_tokens_file", f"{path!r} is not JSON: {e}") from None
    if not isinstance(tokens, dict) or not tokens:
        raise InvalidArgument("auth_tokens_file", f"{path!r} must hold an object of role -> token")
    for role, token in tokens.items():
        if role not in ROLES:
            raise InvalidArgument("auth_tokens_file", f"unknown role {role!r} (roles: {', '.join(ROLES)})")
        if not isinstance(token, str) or len(token) < 16:
            raise InvalidArgument("auth_tokens_file", f"the {role} token must be a string of at least 16 characters")
    if len(set(tokens.values())) != len(tokens):
        raise InvalidArgument("auth_tokens_file", "two roles share one token")
    return tokens


@dataclass(frozen=True)
class Security:
    """This process's TLS material and bearer token (all optional; see the module doc)."""

    cert_file: str = ""
    key_file: str = ""
    ca_file: str = ""
    require_client_cert: bool = False
    token: str = ""
    tokens_file: str = ""

    def __post_init__(self) -> None:
        if bool(self.cert_file) != bool(self.key_file):
            raise InvalidArgument("tls_key_file" if self.cert_file else "tls_cert_file", "set both or neither")
        if self.require_client_cert and not (self.ca_file and self.cert_file):
            raise InvalidArgument("tls_require_client_cert", "needs tls_ca_file and this server's own certificate")

    def check_files(self) -> None:
        """Reads every configured file now (entry points fail at start, naming the flag)."""
        for path, what in ((self.cert_file, "tls_cert_file"), (self.key_file, "tls_key_file"), (self.ca_file, "tls_ca_file")):
            if path:
                _read(path, what)
        if self.tokens_file:
            load_tokens(self.tokens_file)

    def server_credentials(self) -> grpc.ServerCredentials | None:
        """TLS (mTLS with require_client_cert) for a server; None serves plaintext."""
        if not self.cert_file:
            return None
        pair = (_read(self.key_file, "tls_key_file"), _read(self.cert_file, "tls_cert_file"))
        roots = _read(self.ca_file, "tls_ca_file") if self.require_client_cert else None
        return grpc.ssl_server_credentials([pair], root_certificates=roots, require_client_auth=self.require_client_cert)

    def server_interceptors(self) -> list[grpc.ServerInterceptor]:
        """The bearer-token check, when this server has a tokens file."""
        return [BearerAuth(load_tokens(self.tokens_file))] if self.tokens_file else []

    def channel(self, address: str, options: Sequence[tuple[str, Any]]) -> grpc.Channel:
        """A channel to `address`: TLS when a CA is set (with this process's certificate
        for servers that demand one), carrying the bearer token when one is set."""
        if self.ca_file:
            creds = grpc.ssl_channel_credentials(
                root_certificates=_read(self.ca_file, "tls_ca_file"),
                private_key=_read(self.key_file, "tls_key_file") if self.key_file else None,
                certificate_chain=_read(self.cert_file, "tls_cert_file") if self.cert_file else None,
            )
            channel = grpc.secure_channel(address, creds, options=list(options))
        else:
            channel = grpc.insecure_channel(address, options=list(options))
        return grpc.intercept_channel(channel, _BearerToken(self.token)) if self.token else channel


PLAINTEXT = Security()


class _BearerToken(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds `authorization: Bearer <token>` to every call."""

    def __init__(self, token: str) -> None:
        self._header = ("authorization", f"Bearer {token}")

    def _with_token(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        metadata = [*(details.metadata or ()), self._header]
        return _CallDetails(details.method, details.timeout, metadata, details.credentials,
                            details.wait_for_ready, details.compression)

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


class BearerAuth(grpc.ServerInterceptor):
    """Checks the caller's bearer token and its role's rules before the servicer runs.

    Install inside `rpc.StatusInterceptor`, which turns the raised errors into statuses.
    """

    def __init__(self, tokens: Mapping[str, str]) -> None:
        self._tokens = dict(tokens)

    def role_of(self, metadata: Sequence[tuple[str, Any]] | None) -> str:
        """The role whose token the call carries; Unauthenticated when none matches."""
        header = next((v for k, v in metadata or () if k == "authorization"), "")
        scheme, _, token = str(header).partition(" ")
        if scheme.lower() == "bearer" and token:
            for role, known in self._tokens.items():
                if hmac.compare_digest(known.encode(), token.encode()):
                    return role
        raise Unauthenticated("authorization: missing or unknown bearer token")

    def intercept_service(self, continuation: Callable[[Any], Any], details: grpc.HandlerCallDetails) -> Any:
        handler = continuation(details)
        method = details.method
        if handler is None or method.startswith(UNCHECKED_PREFIXES):
            return handler
        for kind in ("unary_unary", "unary_stream", "stream_unary", "stream_stream"):
            fn = getattr(handler, kind)
            if fn is not None:
                return handler._replace(**{kind: self._guard(fn, method, details.invocation_metadata)})
        return handler

    def _guard(self, fn: Callable[..., Any], method: str, metadata: Any) -> Callable[..., Any]:
        def guarded(request: Any, context: grpc.ServicerContext) -> Any:
            role = self.role_of(metadata)
            allowed = ROLE_RULES.get(method)
            if role != "admin" and allowed is not None and role not in allowed:
                raise PermissionDenied(f"role {role!r} may not call {method.rsplit('/', 1)[-1]}")
            if role != "admin" and method in ROLE_IN_REQUEST:
                asked = _ROLE_OF_ENUM.get(request.role)
                if asked is not None and asked != role:
                    raise PermissionDenied(f"role: a {role} token cannot act as {asked}", field="role")
            return fn(request, context)

        return guarded
