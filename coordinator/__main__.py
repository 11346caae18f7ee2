"""Entry point: `python -m coordinator` (or `weightsync-coordinator`)."""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from coordinator.config import CoordinatorConfig
from coordinator.database import quarantine
from coordinator.records import VersionRecord
from coordinator.servicer import CoordinatorServicer, coordinator_service
from coordinator.store import SessionStore
from coordinator.watch import WatchHub
from weightsync.config import load_config
from weightsync.credentials import CREDENTIAL_ENV, CREDENTIAL_NAME, keep_credential, link_credential, unlink_credential
from weightsync.errors import WeightsyncError
from weightsync.failpoints import Failpoints
from weightsync.gc_freeze import FreezingCollector
from weightsync.logs import setup_logging
from weightsync.metrics import build_metrics
from weightsync.server import start_server, wait_for_signal, write_ready_file

log = logging.getLogger("coordinator")
# A thread running Python (a 100,000-tensor publish) keeps the GIL for up to the switch
# interval each time another wants it back, and a status call takes it back after every
# SQLite call: at CPython's 5 ms, another session's GetStatus p99 during such a publish was
# 290-466 ms, at 0.5 ms 194-264 ms (three paired runs of bench/control.py each).
GIL_SWITCH_INTERVAL_S = 0.0005
# The database was found damaged while serving: the file is moved aside; a supervisor's
# restart (Kubernetes, systemd) begins a new one, and agents and trainers attach again.
EXIT_DATABASE_DAMAGED = 4
EXIT_FAILPOINT = 17


def main(argv: Sequence[str] | None = None) -> int:
    cfg = load_config(CoordinatorConfig, "coordinator", argv, os.environ, prog="weightsync-coordinator")
    setup_logging(cfg.log_level, cfg.log_format)
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    hub = WatchHub()
    try:
        store = SessionStore(
            cfg.db_path,
            lease_ttl_s=cfg.lease_ttl_s,
            listener=hub,
            retain_versions=cfg.retain_versions,
            forget_agents_after_s=cfg.forget_agents_after_s,
            max_sessions=cfg.max_sessions,
        )
    except WeightsyncError as e:
        log.error("cannot start: %s", e.message)
        return 2
    security = cfg.security()
    credential: Path | None = None
    if cfg.requires_credential():
        credential = Path(cfg.credential_path() or Path(tempfile.mkdtemp(prefix="weightsync-")) / CREDENTIAL_NAME)
        try:
            keep_credential(credential)
        except (OSError, WeightsyncError) as e:
            log.error("cannot start: %s", getattr(e, "message", e))
            store.close()
            return 2
        security = dataclasses.replace(security, tokens_file=str(credential))
    metrics = build_metrics("coordinator")
    failpoints = Failpoints(cfg.failpoints)
    if failpoints.armed("coordinator.exit_after_flip_decision"):
        store.on_flip_decided = lambda rec: _exit_after_decision(failpoints, rec)
    stop = wait_for_signal()
    store.db.on_corrupt = lambda _error: stop.set()
    servicer = CoordinatorServicer(store, hub, metrics)
    try:
        running = start_server(
            [coordinator_service(servicer)],
            host=cfg.host,
            port=cfg.port,
            metrics=metrics,
            metrics_port=cfg.metrics_port,
            metrics_host=cfg.metrics_host,
            max_workers=cfg.max_workers,
            security=security,
        )
    except WeightsyncError as e:  # a port taken
        log.error("cannot start: %s", e.message)
        servicer.close()
        store.close()
        return 2
    collector = (
        FreezingCollector(cfg.gc_refresh_s, metrics.gc_pause_seconds, metrics.gc_frozen_objects).install()
        if cfg.gc_refresh_s
        else None
    )
    linked = None
    if credential is not None:
        linked = link_credential(running.address, credential)
        log.info(
            "auth: every call needs a bearer token of %s (mode 0600: this user's alone; its clients find it%s, or "
            "through %s); --auth none takes calls without one",
            credential,
            f" through {linked}" if linked else "",
            CREDENTIAL_ENV,
        )
    write_ready_file(
        cfg.ready_file,
        address=running.address,
        metrics_port=running.metrics_port,
        db_path=cfg.db_path,
        credential=str(credential.resolve() if credential else ""),
    )
    log.info("coordinator ready address=%s db=%s", running.address, cfg.db_path)
    failing = False
    while not stop.wait(cfg.lease_ttl_s / 2):
        try:
            servicer.sweep()
            if store.prune():
                log.info("retention: older versions summarized; database %d bytes", store.database_bytes())
            if forgotten := store.forget_agents():
                log.info(
                    "retention: %d agent(s) expired over %.0fs ago forgotten", forgotten, cfg.forget_agents_after_s
                )
            if sessions := store.forget_empty_sessions():
                log.info("retention: sessions no trainer opened and left empty forgotten: %s", ", ".join(sessions))
            metrics.database_bytes.set(store.database_bytes())
        except Exception as e:  # noqa: BLE001 - a locked or full database passes; ending here would end the process
            if not failing:  # once per outage
                log.warning("housekeeping failed (%s); trying again every %.1fs", e, cfg.lease_ttl_s / 2, exc_info=e)
            failing = True
        else:
            if failing:
                log.info("housekeeping recovered")
            failing = False
        if collector:
            collector.flush()
            if collector.refresh_due():
                collector.refresh()
    log.info("closing: watch and heartbeat streams end, then the server stops (calls in flight get 5s)")
    hub.close()
    running.stop()
    if credential is not None:
        unlink_credential(linked, credential)
        if not cfg.credential_path():  # the private directory drawn for an in-memory database
            shutil.rmtree(credential.parent, ignore_errors=True)
    servicer.close()
    store.close()
    if store.db.corrupt is not None and cfg.db_path != ":memory:":
        kept = quarantine(Path(cfg.db_path))
        log.error(
            "stopped: the database was damaged (%s); moved to %s, a restart begins a new one", store.db.corrupt, kept
        )
        return EXIT_DATABASE_DAMAGED
    log.info("coordinator stopped")
    return 0


def _exit_after_decision(failpoints: Failpoints, rec: VersionRecord) -> None:
    """The failpoint: a coordinator lost between writing a flip decision and telling anyone."""
    if failpoints.fire("coordinator.exit_after_flip_decision"):
        log.error("failpoint coordinator.exit_after_flip_decision: exiting after version %d's decision", rec.version)
        os._exit(EXIT_FAILPOINT)


if __name__ == "__main__":
    sys.exit(main())
