"""The default credential: what a coordinator without a tokens file requires, and how the
project's clients find it.

A coordinator started with neither `--auth-tokens-file` nor client certificates (and not
`--auth none`) on a TCP address keeps a credential in its state directory:
`credential.json` beside its database, mode 0600, holding one bearer token per role
(`{"trainer": ..., "rollout": ..., "admin": ...}`, the tokens file format). It is made the
first time and kept across restarts, so agents that outlive a coordinator restart keep
working. Whoever can read the file may act as any role; nobody else can call the
coordinator (health and reflection aside). This is Jupyter's answer on localhost: the
server's user holds the secret, the file's mode keeps every other user out.

Clients find it without any setting: the coordinator links it from a per-user index,
`~/.weightsync/coordinators/<host>-<address>` (a directory of mode 0700), named by the
address clients dial. `WEIGHTSYNC_CREDENTIAL` (an entry point's environment) names a
credential file instead: the coordinator's, or a per-workload token file
(`wsctl credential`). A client picks its role's token from a tokens file and sends a
single token as it is.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import stat
from pathlib import Path

from weightsync.addresses import bare_host, is_unix, split_host_port
from weightsync.errors import InvalidArgument

CREDENTIAL_ENV = "WEIGHTSYNC_CREDENTIAL"
CREDENTIAL_NAME = "credential.json"
DEFAULT_ROLES = ("trainer", "rollout", "admin")
log = logging.getLogger(__name__)


def index_dir() -> Path:
    """This user's index of coordinators' credentials."""
    return Path.home() / ".weightsync" / "coordinators"


def _address_key(address: str) -> str:
    """The index entry's name for a coordinator dialed at `address`: loopback and wildcard
    hosts are one machine-local name (a client dials 127.0.0.1 or localhost for a server
    bound to either, or to 0.0.0.0); other hosts are kept as they are."""
    host, port = split_host_port(address)
    host = bare_host(host)
    if host in ("localhost", "0.0.0.0", "::", "") or host.startswith("127.") or host == "::1":
        host = "loopback"
    return f"{socket.gethostname()}-{host.replace(':', '_')}-{port}"


def index_entry(address: str, directory: Path | None = None) -> Path | None:
    """Where the index links the credential of the coordinator at `address` (None for a unix
    socket: its file mode decides who connects, and no credential is made)."""
    if not address or is_unix(address):
        return None
    return (directory or index_dir()) / _address_key(address)


def _private(path: Path) -> bool:
    """True when `path` is this user's and nobody else may read or write it."""
    st = path.stat()
    return st.st_uid == os.getuid() and not st.st_mode & (stat.S_IRWXG | stat.S_IRWXO)


def keep_credential(path: Path) -> dict[str, str]:
    """The role tokens kept at `path`: read when the file is this user's alone, else made
    fresh (mode 0600, never readable by anyone else, not even for a moment).

    Raises:
        InvalidArgument: naming `credential_file`, when the file exists but others may read
            it, or it holds no tokens.
    """
    if path.exists():
        if not _private(path):
            raise InvalidArgument(
                f"{str(path)!r} may be read or written by other users; remove it (a fresh one is made) or chmod 600 it",
                field="credential_file",
            )
        try:
            tokens = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise InvalidArgument(f"cannot read {str(path)!r}: {e}", field="credential_file") from None
        for role in DEFAULT_ROLES:
            if not isinstance(tokens, dict) or not isinstance(tokens.get(role), str) or len(tokens[role]) < 16:
                raise InvalidArgument(f"{str(path)!r} holds no {role} token; remove it", field="credential_file")
        return tokens
    tokens = {role: secrets.token_urlsafe(32) for role in DEFAULT_ROLES}
    path.parent.mkdir(parents=True, exist_ok=True)
    made = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(made, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(tokens, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(made, path)  # whole or absent: a client never reads half a file
    return tokens


def link_credential(address: str, credential: Path, directory: Path | None = None) -> Path | None:
    """Links `credential` from this user's index under `address`; the entry's path, or None
    where it cannot be made (a warning names the variable clients then need)."""
    entry = index_entry(address, directory)
    if entry is None:
        return None
    try:
        entry.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        if not _private(entry.parent):
            raise PermissionError(f"{entry.parent} may be entered by other users")
        _prune(entry.parent)
        made = entry.with_name(f".{entry.name}.{os.getpid()}")
        made.unlink(missing_ok=True)
        made.symlink_to(credential.resolve())
        os.replace(made, entry)
    except OSError as e:
        log.warning(
            "cannot link the credential from %s (%s): clients need %s=%s",
            entry.parent,
            e,
            CREDENTIAL_ENV,
            credential.resolve(),
        )
        return None
    return entry


def unlink_credential(entry: Path | None, credential: Path) -> None:
    """Removes the index entry where it still links `credential` (another coordinator may
    have taken the address since)."""
    if entry is None:
        return
    try:
        if os.readlink(entry) == str(credential.resolve()):
            entry.unlink()
    except OSError:
        pass


def _prune(directory: Path) -> None:
    """Removes entries whose credential is gone (a test's work directory, a state directory
    deleted)."""
    for entry in directory.iterdir():
        if entry.is_symlink() and not entry.exists():
            entry.unlink(missing_ok=True)


def found_credential(address: str, directory: Path | None = None) -> str:
    """The index entry of the coordinator at `address` ("" for a unix socket). The entry may
    not exist yet (a client that starts first): readers look again when it appears."""
    entry = index_entry(address, directory)
    return "" if entry is None else str(entry)


def read_credential(path: str, role: str) -> str:
    """The token a client of `role` sends, from a credential file: its role's entry of a
    tokens file (JSON), else the file's text (one token).

    Raises:
        InvalidArgument: naming `auth_token_file`, for a file that cannot be read, holds
            nothing, or is a tokens file without the role.
    """
    try:
        text = Path(path).read_text().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise InvalidArgument(f"cannot read {path!r}: {getattr(e, 'strerror', e)}", field="auth_token_file") from None
    if not text:
        raise InvalidArgument(f"{path!r} holds no token", field="auth_token_file")
    if not text.startswith("{"):
        return text
    try:
        tokens = json.loads(text)
    except json.JSONDecodeError as e:
        raise InvalidArgument(f"{path!r} is not JSON: {e}", field="auth_token_file") from None
    token = tokens.get(role) if isinstance(tokens, dict) else None
    if not isinstance(token, str) or not token:
        raise InvalidArgument(f"{path!r} is a tokens file without a {role or 'role'!s} token", field="auth_token_file")
    return token
