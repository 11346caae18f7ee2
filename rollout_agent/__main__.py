"""Entry point: `python -m rollout_agent`, the rollout sidecar (a NumPy dict, a JAX model or
an in-process vLLM engine takes the weights)."""

from __future__ import annotations

import functools
import logging
import os
import sys
from collections.abc import Sequence

from rollout_agent.agent import SERVICE_NAME, RolloutAgent, RolloutAgentServicer
from rollout_agent.audit.audited import Audited
from rollout_agent.audit.auditor import Auditor
from rollout_agent.config import RolloutConfig
from rollout_agent.engines.applier import Applier
from rollout_agent.engines.dict_applier import DictApplier
from rollout_agent.sync.flip import FlipBoard
from rollout_agent.sync.round import sync_version
from rollout_agent.wiring import RolloutWiring, wire_rollout
from weightsync._proto import rollout_agent_pb2_grpc as pb_grpc
from weightsync.config import load_config
from weightsync.errors import WeightsyncError
from weightsync.logs import bind, setup_logging
from weightsync.metrics import build_metrics
from weightsync.server import SMALL_REQUEST_BYTES, Service, start_server, wait_for_signal, write_ready_file

log = logging.getLogger("rollout_agent")
FOLLOWED_POLL_S = 10.0  # a waited flip's record read from the status, where the watch missed it


def main(argv: Sequence[str] | None = None) -> int:
    cfg = load_config(RolloutConfig, "rollout", argv, os.environ, prog="weightsync-rollout")
    setup_logging(cfg.log_level, cfg.log_format)
    try:
        return _run(cfg)
    except WeightsyncError as e:  # a start-up error (a port taken): one line naming the flag
        log.error("cannot start: %s", e)
        return 2


def _run(cfg: RolloutConfig) -> int:
    stop = wait_for_signal()
    agent_id = cfg.agent_id or f"rollout-{os.getpid()}"
    bind(session=cfg.session, agent_id=agent_id)
    metrics = build_metrics("rollout")
    if cfg.engine == "vllm":
        from rollout_agent.vllm_worker.engine import VllmEngineSyncer
        from rollout_agent.vllm_worker.rollout import in_process

        # The engine's weightsync backend pulls, applies and reports (same settings, same
        # agent id, same instance); this process follows the session and drives its update API.
        wiring = wire_rollout(cfg, agent_id, on_verdict=None, server_host=cfg.host)
        engine = VllmEngineSyncer(
            cfg.model,
            cfg.init_info(agent_id=agent_id, instance=wiring.instance),
            dtype=cfg.dtype,
            kv_cache_bytes=cfg.kv_cache_bytes,
        )
        worker = in_process(agent_id)  # the engine's weightsync backend: it audits, and reports its audits
        if worker is not None:
            worker.auditor.metrics = metrics
            worker.auditor.exclusive = engine.held  # its audits read every layer, the engine held
        agent = RolloutAgent(
            wiring,
            engine.sync,
            metrics=metrics,
            completion=lambda: engine.complete(cfg.prompt),
            sampler=engine.sample,
            no_version_warn_s=cfg.no_version_warn_s,
            auditor=worker.auditor if worker is not None else None,
            owns_auditor=False,
        )
        closers = [engine.close]
    else:
        wiring = wire_rollout(
            cfg,
            agent_id,
            on_verdict=lambda v, ok, mismatch: agent.on_verdict(v, ok, mismatch),
            server_host=cfg.host,
            metrics=metrics,
        )
        assert wiring.puller is not None
        held = DictApplier(cfg.dump_dir or None) if cfg.engine == "numpy" else _jax_applier(cfg, wiring)
        applier = Audited(held, wiring.failpoints)
        # the NumPy engine answers Sample with a readout of the arrays it serves (engines/readout.py)
        sampler = (lambda spec: held.sample(spec, agent.engine.provenance)) if isinstance(held, DictApplier) else None
        # A following rollout's watch feeds it; one that does not follow asks more often.
        flips = FlipBoard(wiring.client, cfg.session, poll_s=FOLLOWED_POLL_S if cfg.follow else 1.0)
        agent = RolloutAgent(
            wiring,
            functools.partial(
                sync_version,
                wiring.puller,
                applier,
                apply_mode=cfg.apply_mode,
                failpoints=wiring.failpoints,
                metrics=metrics,
                outbox=wiring.outbox,
                flips=flips,
                on_manifest=lambda version, digest: agent.engine.knows(version, digest),
            ),
            metrics=metrics,
            outbox=wiring.outbox,
            flips=flips,
            sampler=sampler,
            no_version_warn_s=cfg.no_version_warn_s,
            auditor=Auditor(applier, session=cfg.session, interval_s=cfg.audit_interval_s, metrics=metrics),
        )
        closers = [wiring.close_data_plane]
    running = start_server(
        [Service(pb_grpc.add_RolloutAgentServicer_to_server, RolloutAgentServicer(agent), SERVICE_NAME)],
        host=cfg.host,
        port=cfg.port,
        metrics=metrics,
        metrics_port=cfg.metrics_port,
        metrics_host=cfg.metrics_host,
        security=cfg.security(),
        max_request_bytes=SMALL_REQUEST_BYTES,
        not_serving=[SERVICE_NAME],  # until it serves the session's committed version (readiness)
    )
    agent.readiness.watch(lambda ready: running.set_serving(SERVICE_NAME, ready))
    if running.metrics_http is not None:
        running.metrics_http.ready = lambda: agent.readiness.ready  # GET /ready
    wiring.server_address = running.address
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
    wiring.client.close()
    return 0


def _jax_applier(cfg: RolloutConfig, wiring: RolloutWiring) -> Applier:
    """A JAX model of --jax-preset, zeros until the first version, sharded over the local
    devices as its layout's engine shards it, and the applier that writes into it."""
    import jax

    from rollout_agent.engines.jax.applier import JaxApplier
    from rollout_agent.engines.jax.model import PROFILES, empty_leaves, family_map, mesh_of
    from rollout_agent.engines.jax.targets import WeightsHolder
    from weightsync.model_shapes import PRESETS

    shape = PRESETS[cfg.jax_preset]
    devices = jax.local_devices()
    rows, cols = (int(x) for x in cfg.jax_mesh.split("x")) if cfg.jax_mesh else (1, len(devices))
    name_map = family_map("qwen3", cfg.jax_layout, shape)
    profile = PROFILES["tpu_inference" if cfg.jax_layout == "tpu_inference" else "none"]
    holder = WeightsHolder(
        empty_leaves(name_map, shape, shape.layers, shape.tied, mesh_of((rows, cols), devices), profile)
    )
    failpoints = wiring.failpoints
    log.info("jax engine: %s over a %dx%d mesh of %s devices", cfg.jax_preset, rows, cols, devices[0].platform)
    return JaxApplier(
        holder, name_map, mode=cfg.jax_mode,
        corrupt_next=lambda: failpoints.fire("jax_applier.corrupt_after_check"),
    )  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
