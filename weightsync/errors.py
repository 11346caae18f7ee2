"""Typed errors of weightsync and their one mapping to gRPC status codes.

    WeightsyncError
    ├── InvalidArgument          INVALID_ARGUMENT   (names the field)
    ├── NotFound                 NOT_FOUND
    │   ├── SessionNotFound
    │   ├── VersionNotFound
    │   └── AgentNotFound
    ├── AlreadyExists            ALREADY_EXISTS
    │   └── VersionConflict
    ├── FailedPrecondition       FAILED_PRECONDITION
    │   ├── StaleGeneration
    │   ├── WrongState
    │   ├── NewestCommitted
    │   ├── SlotBusy
    │   └── VersionNotApplied
    ├── DataLoss                 DATA_LOSS
    │   └── DigestMismatch
    ├── ResourceExhausted        RESOURCE_EXHAUSTED
    ├── Unauthenticated          UNAUTHENTICATED
    ├── PermissionDenied         PERMISSION_DENIED
    │   └── AgentIdHeld
    ├── TransportUnavailable     UNAVAILABLE        (retryable)
    │   └── TransportStalled
    ├── DeadlineExceeded         DEADLINE_EXCEEDED
    └── InternalError            INTERNAL

This module imports neither grpc nor protobuf: codes are names from `grpc.StatusCode`,
resolved by `weightsync.rpc`, the only place that turns errors into statuses and back.
"""

from __future__ import annotations


class WeightsyncError(Exception):
    """Base of every error weightsync raises on purpose: `(message, *, field=None)`.

    With a `field` (the offending request field), the message starts with it
    ("version: must be > 0, got 0"), as every status message naming a field does.
    """

    def __init__(self, message: str, *, field: str | None = None) -> None:
        if field and not message.startswith(f"{field}:"):
            message = f"{field}: {message}"
        super().__init__(message)
        self.message = message
        self.field = field

    def with_message(self, message: str) -> WeightsyncError:
        """The same error class and field with a new message (for adding context)."""
        err = type(self)(message)
        err.field = self.field
        return err


class InvalidArgument(WeightsyncError):
    """A request or value is malformed; `field` names the offending field."""


class NotFound(WeightsyncError):
    """A named thing does not exist."""


class SessionNotFound(NotFound):
    """No session by that name; open it with OpenSession first."""


class VersionNotFound(NotFound):
    """No such version in the session (or not served here)."""


class AgentNotFound(NotFound):
    """Unknown agent or expired lease; register again."""


class AlreadyExists(WeightsyncError):
    """Something with that identity already exists with other content."""


class VersionConflict(AlreadyExists):
    """Different content was published under an existing version."""


class FailedPrecondition(WeightsyncError):
    """The system is not in a state that allows the request."""


class StaleGeneration(FailedPrecondition):
    """A writer carried an older (or unknown) session generation."""


class WrongState(FailedPrecondition):
    """The version is in a state that does not allow the request."""


class NewestCommitted(FailedPrecondition):
    """The version is the session's newest COMMITTED one: it stays servable until a newer
    version commits, so it is not released (a trainer reuses another slot)."""


class SlotBusy(FailedPrecondition):
    """No arena slot could be freed in time (rollouts still lease the versions in them)."""


class VersionNotApplied(FailedPrecondition):
    """A published version the rollouts did not apply (or did not commit in time): their
    reasons, from their handshakes, are in the message."""


class PullAbandoned(FailedPrecondition):
    """A rollout stopped pulling a version another made stale (an update waits for a newer
    one, or a newer trainer generation published one)."""


class DataLoss(WeightsyncError):
    """Bytes or checksums differ from the source."""


class DigestMismatch(DataLoss):
    """A digest or aggregate did not match the source."""


class ResourceExhausted(WeightsyncError):
    """A size or count limit was exceeded."""


class Unauthenticated(WeightsyncError):
    """Missing or invalid credentials."""


class PermissionDenied(WeightsyncError):
    """Credentials are valid but not for this role."""


class AgentIdHeld(PermissionDenied):
    """The call names an agent id without the key of its registration: another process
    holds the id, or this call was keyed before this process's own registration answered
    (the id's new key was in flight). Register again, or send again with the new key."""


class TransportUnavailable(WeightsyncError):
    """A peer could not be reached; retrying may succeed."""


class TransportStalled(TransportUnavailable):
    """A peer kept its connection open and sent nothing for the call's timeout (frozen,
    hung or cut off), as opposed to one that ended the connection or refused it."""


class DeadlineExceeded(WeightsyncError):
    """The call ran past its deadline."""


class InternalError(WeightsyncError):
    """An unexpected failure; see the server log."""


def cannot_listen(field: str, address: str, reason: object) -> FailedPrecondition:
    """The error for a server that cannot bind its port (taken by another process, or an
    address this host does not have): a start-up error naming the flag, not a traceback."""
    return FailedPrecondition(
        f"cannot listen on {address}: {reason} (another process holds the port, or the host has no such address)",
        field=field,
    )


# Failures that may pass by themselves (a peer unreachable or slow): worth another try.
TRANSIENT_ERRORS: tuple[type[WeightsyncError], ...] = (TransportUnavailable, DeadlineExceeded)

# The one table: error class -> grpc.StatusCode member name. Most specific first is not
# needed; lookups walk the MRO.
STATUS_BY_ERROR: dict[type[WeightsyncError], str] = {
    InvalidArgument: "INVALID_ARGUMENT",
    NotFound: "NOT_FOUND",
    AlreadyExists: "ALREADY_EXISTS",
    FailedPrecondition: "FAILED_PRECONDITION",
    DataLoss: "DATA_LOSS",
    ResourceExhausted: "RESOURCE_EXHAUSTED",
    Unauthenticated: "UNAUTHENTICATED",
    PermissionDenied: "PERMISSION_DENIED",
    TransportUnavailable: "UNAVAILABLE",
    DeadlineExceeded: "DEADLINE_EXCEEDED",
    InternalError: "INTERNAL",
}

# Reverse direction for clients: status name -> the class a caller catches.
ERROR_BY_STATUS: dict[str, type[WeightsyncError]] = {v: k for k, v in STATUS_BY_ERROR.items()}


def _subclasses(cls: type[WeightsyncError]) -> list[type[WeightsyncError]]:
    return [cls, *(sub for direct in cls.__subclasses__() for sub in _subclasses(direct))]


def error_for_status(status_name: str, message: str, field: str | None = None, reason: str = "") -> WeightsyncError:
    """The error a client raises for a failed call's status name (INTERNAL when unknown).

    `reason` is the server's class name (sent as a google.rpc.ErrorInfo detail): where it
    names a class of the same status, the client raises that class, so callers can
    catch `AgentNotFound` or `StaleGeneration`, not just `NotFound` or
    `FailedPrecondition`.
    """
    cls = ERROR_BY_STATUS.get(status_name, InternalError)
    if reason and reason != cls.__name__:
        cls = next((sub for sub in _subclasses(cls) if sub.__name__ == reason), cls)
    return cls(message, field=field)


def status_name_for(error: WeightsyncError) -> str:
    """The grpc.StatusCode name for an error instance (walks the class hierarchy)."""
    for cls in type(error).__mro__:
        if cls in STATUS_BY_ERROR:
            return STATUS_BY_ERROR[cls]
    return "INTERNAL"
