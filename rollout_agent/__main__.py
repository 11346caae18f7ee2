"""Entry point: `python -m rollout_agent`, the rollout sidecar (NumPy dict applier)."""

from __future__ import annotations

import functools
import logging
import os
import socket
import sys
from collections.abc import Sequence

from rollout_agent.agent import SERVICE_NAME, RolloutAgent, RolloutAgentServicer
from rollout_agent.appliers import DictApplier
from rollout_agent.config import RolloutConfig
from rollout_agent.outbox import ReportOutbox
from rollout_agent.puller import WeightPuller
from rollout_agent.relay import Relay
from rollout_agent.sync import sync_version
from weightsync._proto import rollout_agent_pb2_grpc as pb_grpc
from weightsync.client import CoordinatorClient
from weightsync.config import advertised, load_config
from weightsync.failpoints import Failpoints
from weightsync.manifest import Endpoint
from weightsync.metrics import build_metrics
from weightsync.server import Service, setup_logging, start_server, wait_for_signal, write_ready_file

log = logging.getLogger("rollout_agent")


def main(argv: Sequence[str] | None = None) -> int:
    cfg = load_config(RolloutConfig, "rollout", argv, os.environ, prog="weightsync-rollout")
    setup_logging(cfg.log_level)
    stop = wait_for_signal()
    agent_id = cfg.agent_id or f"rollout-{os.getpid()}"
    metrics = build_metrics("rollout")
    security = cfg.security()
    client = CoordinatorClient(cfg.coordinator, security=security)
    relay: Relay | None = None
    if cfg.engine == "vllm":
        from rollout_agent.vllm_engine import VllmEngineSyncer

        engine = VllmEngineSyncer(
            cfg.model,
            coordinator=cfg.coordinator,
            session=cfg.session,
            agent_id=agent_id,
            dtype=cfg.dtype,
            kv_cache_bytes=cfg.kv_cache_bytes,
            init_extra={
                "weight_sync_mode": cfg.weight_sync_mode,
                "fs_root": cfg.fs_root,
                "streams": cfg.streams,
                "window_chunks": cfg.window_chunks,
                "max_attempts": cfg.max_attempts,
                "apply_mode": cfg.apply_mode,
                "tls_ca_file": cfg.tls_ca_file,
                "tls_cert_file": cfg.tls_cert_file,
                "tls_key_file": cfg.tls_key_file,
                "auth_token": cfg.auth_token,
            },
        )
        agent = RolloutAgent(
            client, cfg.session, agent_id, engine.sync, metrics=metrics, completion=lambda: engine.complete(cfg.prompt)
        )
        closers = [engine.close]
    else:
        if cfg.weight_sync_mode in ("relay", "") and cfg.apply_mode == "atomic":
            # Re-serve what we pull (used when this rollout's or the session's mode is relay).
            relay = Relay(
                cfg.session,
                host=cfg.host,
                port=cfg.relay_port,
                wait_s=cfg.relay_wait_s,
                failpoints=Failpoints(cfg.failpoints),
            )
        outbox = ReportOutbox(client, lambda v, ok, mismatch: agent.on_verdict(v, ok, mismatch))
        puller = WeightPuller(
            client,
            cfg.session,
            agent_id,
            transport=cfg.weight_sync_mode,
            host_id=cfg.host_id,
            fs_root=cfg.fs_root,
            streams=cfg.streams,
            window_chunks=cfg.window_chunks,
            max_attempts=cfg.max_attempts,
            timeout_s=cfg.timeout_s,
            metrics=metrics,
            relay=relay.source if relay else None,
            security=security,
        )
        applier = DictApplier(cfg.dump_dir or None)
        failpoints = Failpoints(cfg.failpoints)
        agent = RolloutAgent(
            client,
            cfg.session,
            agent_id,
            functools.partial(
                sync_version,
                puller,
                applier,
                apply_mode=cfg.apply_mode,
                failpoints=failpoints,
                metrics=metrics,
                outbox=outbox,
            ),
            metrics=metrics,
            outbox=outbox,
        )
        closers = [puller.close, *([relay.close] if relay else [])]
    running = start_server(
        [Service(pb_grpc.add_RolloutAgentServicer_to_server, RolloutAgentServicer(agent), SERVICE_NAME)],
        host=cfg.host,
        port=cfg.port,
        metrics=metrics,
        metrics_port=cfg.metrics_port,
        security=security,
    )
    relay_address = advertised(relay.address, cfg.advertise_host) if relay else ""
    agent.endpoint = Endpoint(
        advertised(running.address, cfg.advertise_host),
        ("grpc", "relay") if relay_address else ("grpc",),
        cfg.host_id or socket.gethostname(),
        tcp_address=relay_address,
    )
    agent.start(follow=cfg.follow)
    write_ready_file(cfg.ready_file, address=running.address, metrics_port=running.metrics_port, agent_id=agent_id)
    log.info("rollout %s ready on %s session=%s", agent_id, running.address, cfg.session)
    stop.wait()
    # Graceful exit: health says NOT_SERVING first, then the lease ends (deregister), then
    # the servers stop.
    running.enter_graceful_shutdown()
    agent.stop()
    running.stop(grace_s=1.0)
    for close in closers:
        close()
    client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
