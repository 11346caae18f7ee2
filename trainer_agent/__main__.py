"""Entry point: `python -m trainer_agent` runs a JAX trainer that publishes every step."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from trainer_agent import synthetic
from trainer_agent.config import TrainerConfig
from trainer_agent.publish.publisher import WeightPublisher
from trainer_agent.stage.staging import HostShard
from weightsync.config import load_config
from weightsync.errors import DeadlineExceeded, StaleGeneration, WeightsyncError
from weightsync.logs import bind, setup_logging
from weightsync.server import wait_for_signal, write_ready_file

log = logging.getLogger("trainer_agent")
EXIT_FENCED = 3  # a newer incarnation owns the session


def rank_rows(params: Mapping[str, Any], rank: int, world_size: int) -> dict[str, Any]:
    """This rank's rows [r*n/W, (r+1)*n/W) of every tensor (dim 0), as HostShards."""
    if world_size == 1:
        return dict(params)
    out = {}
    for name, value in params.items():
        arr = np.asarray(value)
        n = arr.shape[0]
        lo, hi = rank * n // world_size, (rank + 1) * n // world_size
        out[name] = HostShard(name, arr[lo:hi], tuple(arr.shape), (lo,) + (0,) * (arr.ndim - 1))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return _run(argv)
    except KeyboardInterrupt:
        log.info("stopped by signal; arena released")
        return 0
    except WeightsyncError as e:  # what the operator must change (or an outage past the retries): said in one line
        log.error("stopped: %s", e)
        return 1


def _run(argv: Sequence[str] | None) -> int:
    cfg = load_config(TrainerConfig, "trainer", argv, os.environ, prog="weightsync-trainer")
    setup_logging(cfg.log_level, cfg.log_format)
    stop = wait_for_signal(interrupt=True)
    params = synthetic.params_after(cfg.model_size, cfg.seed, cfg.start_version - 1, cfg.lr)
    with WeightPublisher(cfg).start(next_version=cfg.start_version) as pub:
        bind(session=cfg.session, agent_id=pub.agent_id)
        write_ready_file(
            cfg.ready_file,
            address=pub.server.address,
            metrics_port=pub.server.metrics_port,
            agent_id=pub.agent_id,
            platform=jax.default_backend(),  # where the weights live: "cpu", "tpu"
        )
        for step in range(cfg.start_version, cfg.start_version + cfg.steps):
            if stop.is_set():
                break
            # JAX dispatches asynchronously: finish the step so staging time is staging alone.
            params = jax.block_until_ready(synthetic.train_step(params, step, cfg.seed, cfg.lr))
            try:  # an outage or a full disk is ridden out inside, for --publish-wait-s
                result = pub.publish(rank_rows(params, cfg.rank, cfg.world_size), step)
            except StaleGeneration as e:
                log.error("version %d not published: %s", step, e.message)
                if not cfg.stay_fenced:
                    return EXIT_FENCED
                break
            if cfg.wait_commit:
                _wait_committed(pub, step, cfg.commit_timeout_s)
            else:
                log.info("step=%d version=%d state=%s", step, step, result.state)
            if cfg.step_interval_s > 0:
                stop.wait(cfg.step_interval_s)
        if cfg.hold:
            while not stop.wait(0.2):
                if pub.fenced and not cfg.stay_fenced:
                    log.error("exiting: fenced by generation %d (pass --stay-fenced to keep serving)", pub.fenced_by)
                    return EXIT_FENCED
    return 0


def _wait_committed(pub: WeightPublisher, step: int, timeout_s: float) -> None:
    """Waits for the step's version to commit; training goes on whatever it ends as. A
    version that did not commit in time stays served from its slot (its rollouts retry
    it), so it can still commit; one that failed or was released is logged with why."""
    try:
        state = pub.wait_committed(step, timeout_s)
    except DeadlineExceeded as e:
        log.warning("step=%d version=%d not committed yet, training on: %s", step, step, e.message)
        return
    if state == "COMMITTED":
        log.info("step=%d version=%d state=%s", step, step, state)
    else:
        log.warning("step=%d version=%d ended %s, training on", step, step, state)


if __name__ == "__main__":
    sys.exit(main())
