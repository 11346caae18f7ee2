"""What an applier says about the apply it just committed (plain data: no engine imports)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ApplyReport:
    """One committed apply, as the applier saw it.

    `pause_seconds` is how long the engine could not serve because of it: an applier that
    builds the new weights aside while the engine serves pauses only for the swap and the
    engine's refresh; one that writes in place, for the whole apply. HBM figures come from
    the backend's `memory_stats()` (None where it has none, as on CPU): the most bytes in
    use on any device before the apply, and its high-water mark after (the allocator's,
    over the process' life: an earlier, higher peak hides the apply's).
    """

    version: int
    mode: str  # "swap" (built aside, swapped in one step) or "inplace" (leaf by leaf)
    transfer: str = ""  # how leaves reached the devices: "host", "device" or "host+device"
    fingerprint: str = ""  # how the devices' fingerprints were taken: "jit" or "view"
    leaves: int = 0
    bytes: int = 0  # the new leaves' bytes (each global array once)
    device_bytes: int = 0  # bytes written to devices (replicas counted)
    build_seconds: float = 0.0
    wait_seconds: float = 0.0  # of build_seconds: waiting for leaves in flight to land (the rest dispatches)
    groups: int = 0  # leaves built a group at a time (one transfer call and one program each)
    fingerprint_seconds: float = 0.0
    host_fingerprint_seconds: float = 0.0
    swap_seconds: float = 0.0
    refresh_seconds: float = 0.0
    pause_seconds: float | None = None
    hbm_before_bytes: int | None = None
    hbm_peak_bytes: int | None = None
    hbm_limit_bytes: int | None = None
    # in place: leaves whose device copy did not match the verified bytes, built again
    # from the host and then matching (damaged on their way; the damage never served)
    repaired_leaves: tuple[str, ...] = ()
