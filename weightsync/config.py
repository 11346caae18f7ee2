"""Config dataclasses become flags and WEIGHTSYNC_<COMPONENT>_<FIELD> variables.

Each field's `metadata["help"]` is its --help text. A flag wins over the environment;
an unknown WEIGHTSYNC_<COMPONENT>_* variable prints a warning. Only entry points call
`load_config`, so nothing below the CLI reads os.environ.
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import math
import sys
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

from weightsync.addresses import bare_host, is_unix, join_host_port, split_host_port
from weightsync.credentials import CREDENTIAL_ENV
from weightsync.errors import InvalidArgument
from weightsync.security import Security, read_token, with_credential
from weightsync.validation import INT64_MAX, check_host, check_unix_address

C = TypeVar("C")


def advertised(address: str, advertise_host: str) -> str:
    """host:port as other agents should dial it: the port bound, the advertised host. A unix
    socket is dialed at its path."""
    if not advertise_host or is_unix(address):
        return address
    return join_host_port(advertise_host, split_host_port(address)[1])


def option(default: Any, help: str, **kw: Any) -> Any:  # noqa: A002 - mirrors argparse
    """A dataclass field with --help text."""
    return field(default=default, metadata={"help": help, **kw})


def secret_option(default: Any, help: str, **kw: Any) -> Any:  # noqa: A002 - mirrors argparse
    """A field that may hold credentials: left out of the dataclass's repr."""
    return field(default=default, repr=False, metadata={"help": help, **kw})


# Durations past a year are a typo; near 1e20 s they overflow clocks and deadlines.
MAX_SECONDS = 365 * 86400.0


def check_bounds(obj: Any, names: Sequence[str], low: float, high: float | None = None) -> None:
    """InvalidArgument naming the first of `names` whose value on `obj` is below `low`
    (or above `high`), or is not a finite number: the settings classes' numeric checks."""
    for name in names:
        value = getattr(obj, name)
        if not low <= value <= (math.inf if high is None else high) or value == math.inf:  # nan compares false
            bound = f">= {low}" if high is None else f"in [{low}, {high}]"
            raise InvalidArgument(f"must be a finite number {bound}, got {value}", field=name)


def check_positive(obj: Any, names: Sequence[str]) -> None:
    """InvalidArgument naming the first of `names` whose value is not a number in
    (0, MAX_SECONDS] (deadlines and timeouts: 1e20 s overflowed the first deadline made)."""
    for name in names:
        value = getattr(obj, name)
        if not 0 < value <= MAX_SECONDS:  # nan compares false
            raise InvalidArgument(f"must be a number in (0, {MAX_SECONDS:.0f}], got {value}", field=name)


@dataclass
class PeerConfig:
    """How a process is reached and reaches its peers: a server's, or a rollout's inside a
    vLLM worker (which serves no gRPC of its own)."""

    # The role whose token this process sends: its entry of a tokens file given as its
    # credential, and of the default credential of the coordinator it dials ("": none).
    AUTH_ROLE: ClassVar[str] = ""

    advertise_host: str = option("", "Host other agents use to reach this one (e.g. the pod IP); default --host.")
    tls_cert_file: str = option("", "PEM certificate this process serves with TLS (and presents to mTLS servers).")
    tls_key_file: str = option("", "PEM private key of --tls-cert-file.")
    tls_ca_file: str = option(
        "",
        "PEM CA that signs the servers this process dials (TLS on its channels); "
        "with --tls-require-client-cert it also checks clients.",
    )
    auth_token: str = option("", "Bearer token this process sends on its calls (its role's token).")
    auth_token_file: str = option(
        "",
        "File holding that token (e.g. a mounted Secret; read again when it changes), or a tokens file (JSON: this "
        f"process's role's entry is sent); instead of --auth-token. Default ${CREDENTIAL_ENV}, else the credential "
        "the coordinator dialed made for this user (docs/operations.md#credentials).",
    )

    def check_peer(self) -> None:
        """InvalidArgument for an advertised host other agents could not dial."""
        if self.advertise_host:
            check_host(self.advertise_host, "advertise_host")

    def token(self) -> str:
        """The bearer token: --auth-token, else the contents of --auth-token-file."""
        if self.auth_token and self.auth_token_file:
            raise InvalidArgument("give --auth-token or --auth-token-file, not both", field="auth_token_file")
        return read_token(self.auth_token_file, self.AUTH_ROLE) if self.auth_token_file else self.auth_token

    def dialed_coordinator(self) -> str:
        """The coordinator this process dials ("": none), whose default credential it sends
        when it is given none."""
        return str(getattr(self, "coordinator", ""))

    def security(self) -> Security:
        """TLS / mTLS and the bearer token for this process's channels."""
        security = Security(
            self.tls_cert_file,
            self.tls_key_file,
            self.tls_ca_file,
            token=self.token(),
            token_file=self.auth_token_file,
            token_role=self.AUTH_ROLE,
        )
        return with_credential(security, self.dialed_coordinator(), self.AUTH_ROLE) if self.AUTH_ROLE else security


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


@dataclass
class ServerConfig(PeerConfig):
    """Fields every server shares."""

    host: str = option(
        "127.0.0.1",
        "Address to bind the gRPC server and /metrics to, or unix:/path: serve gRPC on that unix socket "
        "(mode 0660; /metrics then binds --metrics-host).",
    )
    port: int = option(0, "gRPC port; 0 picks a free one (see --ready-file). Unused with a unix: --host.")
    metrics_port: int = option(0, "Prometheus /metrics port; 0 picks a free one, -1 disables.")
    metrics_host: str = option("", "Address /metrics binds; default --host, or 127.0.0.1 where --host is unix:.")
    ready_file: str = option("", "Write {address, metrics_port, pid} as JSON here once serving.")
    log_level: str = option("INFO", "Logging level (DEBUG, INFO, WARNING, ERROR).")
    log_format: str = option(
        "text", "text, or json: one object per line naming session, agent_id and version.", choices=["text", "json"]
    )
    tls_require_client_cert: bool = option(False, "mTLS: refuse clients without a certificate signed by --tls-ca-file.")
    auth_tokens_file: str = option(
        "",
        'JSON {"trainer": ..., "rollout": ..., "admin": ...}: require these bearer tokens (per-role rules), or the '
        'agent credentials they made; "revoked": serials refused, "verifiers": credentials taken without the role '
        "tokens (wsctl verifiers). Read again when it changes.",
    )
    insecure: bool = option(
        False,
        "Serve plaintext without bearer tokens on a non-loopback --host (anyone who reaches it may fence "
        "the trainer or publish versions).",
    )

    def __post_init__(self) -> None:
        if self.log_level.upper() not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")
        if not -1 <= self.metrics_port < 65536:
            raise ValueError(f"metrics_port must be in [-1, 65535], got {self.metrics_port}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        try:
            self.check_listen()
            self.check_peer()
            self.security().check_files()
        except InvalidArgument as e:
            raise ValueError(e.message) from None
        if not is_loopback(self.host) and not (self.tls_cert_file or self.auth_tokens_file) and not self.insecure:
            raise ValueError(
                f"--host {self.host} is reachable from other machines: serve TLS (--tls-cert-file), require bearer "
                "tokens (--auth-tokens-file), or pass --insecure to serve plaintext to the network"
            )

    def check_listen(self) -> None:
        """InvalidArgument for a listen address the server could not bind as meant."""
        if self.metrics_host:
            if is_unix(self.metrics_host):
                raise InvalidArgument(
                    "/metrics binds an IP address or host name, not a unix socket", field="metrics_host"
                )
            check_host(self.metrics_host, "metrics_host")
        if not is_unix(self.host):
            return
        check_unix_address(self.host, "host")
        if self.port:
            raise InvalidArgument(f"a unix socket has no port; --host is {self.host}", field="port")
        if self.advertise_host:
            raise InvalidArgument(f"a unix socket is dialed at its path; --host is {self.host}", field="advertise_host")

    def security(self) -> Security:
        """TLS / mTLS and bearer tokens for this process's server and its channels."""
        return dataclasses.replace(
            super().security(), require_client_cert=self.tls_require_client_cert, tokens_file=self.auth_tokens_file
        )


def is_loopback(host: str) -> bool:
    """True for addresses only this machine can reach (127.0.0.0/8, ::1, localhost, a unix
    socket)."""
    if is_unix(host):
        return True
    host = bare_host(host)
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name other than localhost may resolve anywhere


def _base_type(tp: Any) -> Any:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0]
    return tp


def _parse_bool(text: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean, got {text!r}")


def _parse_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):  # "nan" and "inf" parse; no setting means either
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def bounded_number(low: float, convert: type = int, high: int = INT64_MAX) -> Any:
    """An argparse type: a number in [low, high] (2^63-1 unless given), else a usage error
    rather than a traceback from the request message."""

    def parse(text: str) -> Any:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not low <= value <= high:  # also false for nan and inf
            top = "2^63-1" if high == INT64_MAX else str(high)
            raise argparse.ArgumentTypeError(f"expected a number in [{low}, {top}], got {text!r}")
        return value

    return parse


def _converter(tp: Any) -> Any:
    """What turns a flag's or variable's text into a field of type `tp`."""
    return {bool: _parse_bool, float: _parse_float}.get(tp, tp)


def build_parser(cls: type, prog: str, description: str = "") -> argparse.ArgumentParser:
    """An ArgumentParser with one --flag per dataclass field (defaults None = not given)."""
    parser = argparse.ArgumentParser(prog=prog, description=description or (cls.__doc__ or ""))
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = _base_type(hints[f.name])
        flag = "--" + f.name.replace("_", "-")
        help_text = f.metadata.get("help", "").replace("%", "%%")  # argparse %-formats help
        default = f.default if f.default is not dataclasses.MISSING else None
        if default not in (None, ""):
            help_text += f" (default: {default})"
        if tp is bool:
            parser.add_argument(flag, type=_parse_bool, nargs="?", const=True, default=None, help=help_text)
        elif typing.get_origin(tp) is tuple:  # repeatable: each flag adds one item
            help_text += " Repeatable."
            parser.add_argument(flag, action="append", default=None, help=help_text)
        else:
            choices = f.metadata.get("choices")
            parser.add_argument(flag, type=_converter(tp), default=None, help=help_text, choices=choices)
    return parser


def load_config(
    cls: type[C],
    component: str,
    argv: Sequence[str] | None,
    environ: Mapping[str, str],
    prog: str | None = None,
) -> C:
    """Builds `cls` from flags, then WEIGHTSYNC_<COMPONENT>_<FIELD>, then defaults."""
    parser = build_parser(cls, prog or f"weightsync-{component}")
    args = parser.parse_args(argv)
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    prefix = f"WEIGHTSYNC_{component.upper().replace('-', '_')}_"
    values: dict[str, Any] = {}
    for key, raw in environ.items():
        if not key.startswith(prefix):
            continue
        name = key[len(prefix) :].lower()
        if name not in names:
            print(f"warning: unknown variable {key} ignored (known: {', '.join(sorted(names))})", file=sys.stderr)
            continue
        tp = _base_type(hints[name])
        if typing.get_origin(tp) is tuple:  # the items of a repeatable flag, comma-separated
            values[name] = tuple(item.strip() for item in raw.split(",") if item.strip())
            continue
        try:
            values[name] = _converter(tp)(raw)
        except (ValueError, argparse.ArgumentTypeError) as e:
            parser.error(f"{key}={raw!r}: {e}")
    for name in names:
        given = getattr(args, name)
        if given is not None:
            values[name] = tuple(given) if isinstance(given, list) else given
    if (
        getattr(cls, "AUTH_ROLE", "")
        and environ.get(CREDENTIAL_ENV)
        and not {"auth_token", "auth_token_file"} & {k for k, v in values.items() if v}
    ):
        values["auth_token_file"] = environ[CREDENTIAL_ENV]  # the one variable every client reads
    try:
        return cls(**values)
    except ValueError as e:
        parser.error(str(e))
        raise  # unreachable: parser.error exits
