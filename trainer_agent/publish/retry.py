"""What a publish tries again, and how: `ride_out` a call through an outage while its failure
`may_pass` by itself; `refuses_content`: the coordinator refused a part for good."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

from weightsync.errors import (
    TRANSIENT_ERRORS,
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
    SlotBusy,
    StaleGeneration,
    WeightsyncError,
)

log = logging.getLogger("trainer_agent.publish.publisher")  # the publish path logs under one name
T = TypeVar("T")

# Fields of a ResourceExhausted that space freed elsewhere may end.
FULL_DISK_FIELDS = ("database", "fs_root", "arena")


def may_pass(e: WeightsyncError) -> bool:
    """Whether a publish that failed with `e` may succeed later unchanged."""
    if isinstance(e, ResourceExhausted):
        return e.field in FULL_DISK_FIELDS
    return isinstance(e, (*TRANSIENT_ERRORS, SlotBusy))


def refuses_content(e: WeightsyncError) -> bool:
    """Whether the coordinator refused a publish for good without storing it, so that the
    fs copy written for it is read by no one: not a fenced publisher (an earlier try may
    have been taken, its answer lost) and not a failure that may pass."""
    refused = isinstance(e, (AlreadyExists, InvalidArgument, FailedPrecondition, ResourceExhausted))
    return refused and not isinstance(e, StaleGeneration) and not may_pass(e)


def ride_out(what: str, wait_s: float, call: Callable[[], T], may_pass: Callable[[WeightsyncError], bool]) -> T:
    """`call()`, tried again with backoff (0.5 s doubling to 5 s) while it fails with an
    error `may_pass` accepts, for up to `wait_s`; one warning per outage, one line once
    it went through."""
    deadline, delay, failed_at = time.monotonic() + wait_s, 0.5, 0.0
    while True:
        try:
            result = call()
        except WeightsyncError as e:
            left = deadline - time.monotonic()
            if left <= 0 or not may_pass(e):
                raise
            if not failed_at:
                failed_at = time.monotonic()
                log.warning("%s failed (%s); trying again for up to %.0fs", what, e.message, left)
            time.sleep(min(delay, left))
            delay = min(2 * delay, 5.0)
            continue
        if failed_at:
            log.info("%s went through after %.1fs", what, time.monotonic() - failed_at)
        return result
