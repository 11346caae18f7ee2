"""vLLM's trainer side of the weight-transfer API, backend `weightsync`: a trainer written
against vLLM's flow switches to weightsync by its init info (and the server's backend).

    from trainer_agent.vllm_trainer import WeightsyncTrainerInitInfo   # registers "weightsync"

    engine = WeightTransferTrainerFactory.trainer_init(
        init_info=WeightsyncTrainerInitInfo("coordinator:50051", "my-job", rank=0),
        client=HTTPVLLMWeightSyncClient(base_url),     # or any VLLMWeightSyncClient
        source=ModuleSource(model),
    )
    engine.send_weights()    # each step: publish the next version, the engine applies it
    engine.shutdown()

The pause can be the apply alone: `send_weights()` is `publish_weights()` (the server's
workers pull and verify the version while the engine generates) then `apply_weights()`
(start/update/finish: the apply only). An orchestrator splits them around vLLM's `/pause`:

    engine.publish_weights()
    engine.wait_prefetched()   # every worker holds it verified (needs the worker extension)
    pause; engine.apply_weights(); resume

Importing this module registers the engine with vLLM's `WeightTransferTrainerFactory` (vLLM
loads no trainer-side plugins); it needs vLLM (the vllm extra), `import trainer_agent` does
not.

Ranks: the sender (rank 0) publishes every tensor and drives the worker through the
client. Other ranks hold no publisher and touch no client: they read `metadata()` and
iterate the source each round, as vLLM's NCCL and IPC engines do, so that collectives
inside it (FSDP's `full_tensor()`, a Megatron export) stay in lockstep.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar, Self

from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
)
from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

from trainer_agent.publish.publisher import WeightPublisher
from trainer_agent.settings import PublisherSettings
from weightsync.config import MAX_SECONDS
from weightsync.errors import FailedPrecondition, InvalidArgument, VersionNotApplied, WeightsyncError
from weightsync.rpc import wait_reachable

log = logging.getLogger(__name__)
BACKEND = "weightsync"
MAX_REASONS = 5  # failed handshakes quoted in one error
EXTENSION = "rollout_agent.vllm_worker_extension.WeightsyncWorkerExtension"
# PublisherSettings fields the init info sets itself (its own fields, or fixed: one publisher)
_OWN = ("coordinator", "session", "rank", "world_size", "tls_ca_file", "tls_cert_file", "tls_key_file")


@dataclass
class WeightsyncTrainerInitInfo(TrainerInitInfo):
    """Trainer-side init info of the `weightsync` backend. Its keyword-only `rank` (vLLM's
    `TrainerInitInfo` field) is this trainer process's rank; rank 0 is the sender.

    Args:
        coordinator: the coordinator's address (host:port or unix:/path).
        session: the session the trainer publishes into and the worker follows.
        tls_ca_file: TLS of the trainer's channels and chunk servers (PublisherSettings'
            field); passed on to the worker.
        tls_cert_file: the trainer's certificate (PublisherSettings' field).
        tls_key_file: its key (PublisherSettings' field).
        publisher: further `PublisherSettings` fields (weight_dtype, chunk_bytes, host,
            advertise_host, weight_sync_mode, auth_token_file, incarnation, ...).
        worker: the worker's init_info beyond coordinator, session and tls_ca_file, which
            it may override (agent_id, weight_sync_mode, prefetch, its auth token, ...;
            docs/configuration.md#vllm-init_info).
        commit_timeout_s: how long `send_weights` waits, after the round, for the version
            to be COMMITTED (every required rollout applied it); 0 returns once the engine
            behind the client applied it.
        connect_timeout_s: how long `trainer_init` waits for the coordinator to accept a
            connection before it fails naming the address (TransportUnavailable); also the
            publisher's `attach_wait_s` unless `publisher` sets it.
        packed: vLLM's wire parameter of its NCCL and IPC trainer engines: accepted and
            ignored (weightsync chunks every version itself).
    """

    backend: ClassVar[str] = BACKEND

    coordinator: str
    session: str
    tls_ca_file: str = ""
    tls_cert_file: str = ""
    tls_key_file: str = ""
    publisher: dict[str, Any] = field(default_factory=dict)
    worker: dict[str, Any] = field(default_factory=dict)
    commit_timeout_s: float = 60.0
    connect_timeout_s: float = 10.0
    packed: bool = False

    def __post_init__(self) -> None:
        for name in ("publisher", "worker"):
            if not isinstance(getattr(self, name), dict):
                raise InvalidArgument(f"must be a dict, got {type(getattr(self, name)).__name__}", field=name)
        for name in ("commit_timeout_s", "connect_timeout_s"):
            if not 0 <= getattr(self, name) <= MAX_SECONDS:  # nan compares false
                raise InvalidArgument(f"must be in [0, {MAX_SECONDS:.0f}], got {getattr(self, name)}", field=name)
        if not isinstance(self.packed, bool):
            raise InvalidArgument(f"must be true or false, got {self.packed!r:.40}", field="packed")

    def publisher_settings(self) -> PublisherSettings:
        """The sender's publisher: one rank publishing every tensor; InvalidArgument naming
        `publisher.<key>` for a key PublisherSettings does not have or the init info sets."""
        known = {f.name for f in dataclasses.fields(PublisherSettings)}
        for key in self.publisher:
            if key in _OWN:
                raise InvalidArgument(
                    "is set by the init info itself (its own field, or fixed)", field=f"publisher.{key}"
                )
            if key not in known:
                raise InvalidArgument("is not a PublisherSettings field", field=f"publisher.{key}")
        own = {
            name: getattr(self, name)
            for name in ("coordinator", "session", "tls_ca_file", "tls_cert_file", "tls_key_file")
        }
        return PublisherSettings(**own, **{"attach_wait_s": self.connect_timeout_s, **self.publisher})

    def worker_init_info(self) -> dict[str, Any]:
        """What the sender sends the worker side (plain data; its `init_info`)."""
        own = {"coordinator": self.coordinator, "session": self.session}
        if self.tls_ca_file:
            own["tls_ca_file"] = self.tls_ca_file
        return {**own, **self.worker}


class WeightsyncTrainerEngine(TrainerWeightTransferEngine[WeightsyncTrainerInitInfo]):
    """Publishes the source's tensors as the next version, then has the worker apply it
    with vLLM's start/update/finish round (`update_info` {"version": N}, finish's
    `weight_version` "N"). Versions continue from the session's newest, so a restarted
    trainer goes on numbering where the last one stopped (and fences it)."""

    init_info_cls = WeightsyncTrainerInitInfo

    def __init__(
        self,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource,
        is_sender: bool = True,
        publisher: WeightPublisher | None = None,
        commit_timeout_s: float = 60.0,
    ) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.publisher = publisher
        self.commit_timeout_s = commit_timeout_s
        self.version = publisher.attached_latest_version if publisher is not None else 0  # the last one sent
        self._unapplied = 0  # published by publish_weights, not yet given to apply_weights

    @classmethod
    def trainer_init(
        cls,
        init_info: WeightsyncTrainerInitInfo,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource | None = None,
    ) -> Self:
        """On the sender: attaches a publisher to the session (a new incarnation: an older
        trainer of the session is fenced), then sends the worker its init info. Other
        ranks only keep the source.

        Raises:
            InvalidArgument: no source, or a bad init info (the field named).
            TransportUnavailable: the coordinator accepted no connection within
                `connect_timeout_s` (its address named).
            FailedPrecondition: the worker side refused its init info (its reason, with
                an HTTP error's body); the publisher is closed again.
        """
        if source is None:
            raise InvalidArgument("the weightsync trainer engine sends a WeightSource each round", field="source")
        if not init_info.is_sender:
            return cls(client=client, source=source, is_sender=False)
        settings = init_info.publisher_settings()
        wait_reachable(settings.coordinator, init_info.connect_timeout_s, settings.security(), what="coordinator")
        publisher = WeightPublisher(settings).start()
        try:
            client.init_weight_transfer_engine(init_info.worker_init_info())
        except Exception as e:
            publisher.close(cancel_pending=True)
            raise FailedPrecondition(f"the worker side refused its init info: {_described(e)}") from e
        except BaseException:
            publisher.close(cancel_pending=True)
            raise
        return cls(
            client=client,
            source=source,
            publisher=publisher,
            commit_timeout_s=init_info.commit_timeout_s,
        )

    def send_weights(self) -> None:
        """Publishes every tensor of the source as the next version, then runs start,
        update and finish: `publish_weights()` then `apply_weights()`.

        Raises:
            VersionNotApplied: start or update failed (the worker's reason, from its
                handshake, else the client's error; finish is not called), or the version
                was aborted or released before it committed (FAILED, RELEASED).
            DeadlineExceeded: the version was not COMMITTED within commit_timeout_s (what
                it waits for: a rollout that refused it, PARTIAL, retries it).
            FailedPrecondition: finish_weight_update failed after the version was applied.
            StaleGeneration: a newer trainer attached to the session; nothing was sent.
            InvalidArgument: a tensor weightsync cannot carry, or iteration that does not
                match `metadata()` (the tensor named); nothing was sent.
        """
        self.publish_weights()
        self.apply_weights()

    def publish_weights(self) -> int:
        """Publishes every tensor of the source as the next version (streamed into the
        arena as the source materializes them) and returns it; calls no client method. The
        server's workers, whose prefetch follows the session, pull and verify it while the
        engine generates; `apply_weights()` then applies it. Every rank calls it (the
        source's collectives); other ranks return 0.

        Raises:
            StaleGeneration, InvalidArgument: as `send_weights`; nothing was sent.
        """
        assert self.source is not None
        meta = self.source.metadata()  # a collective for some sources: every rank calls it
        if not self.is_sender:
            for _ in self.source:  # only the trainer-side collectives
                pass
            return 0
        publisher = self._publisher()
        version = max(self.version, publisher.attached_latest_version) + 1
        self.version = version
        specs = [(m.name, m.dtype, m.shape) for m in meta]
        publisher.publish_stream(iter(self.source), version, specs=specs)
        self._unapplied = version
        return version

    def wait_prefetched(self, timeout_s: float = 60.0, poll_s: float = 0.05) -> bool:
        """Waits until every worker behind the client holds the version last published
        pulled and verified (its update then only applies), asking them through vLLM's
        `collective_rpc` (dev-mode `/collective_rpc` for the HTTP client) a call that
        returns at once, every `poll_s`. False after `timeout_s`, or at once where a worker
        does not prefetch (`init_info.prefetch` off): apply anyway, the update pulls or
        waits for the rest of the prefetch inside the pause. The server needs
        `--worker-extension-cls rollout_agent.vllm_worker_extension.WeightsyncWorkerExtension`.

        Raises:
            FailedPrecondition: the workers cannot be asked (no extension, a client without
                collective_rpc or base_url), or nothing was published to wait for.
        """
        if not self.is_sender:
            return True
        if not self._unapplied:
            raise FailedPrecondition("nothing published to wait for; call publish_weights first")
        deadline = time.monotonic() + timeout_s
        while True:
            answers = _collective_rpc(self.client, "weightsync_ready", str(self._unapplied))
            if answers and all(isinstance(a, dict) and a.get("ready") for a in answers):
                return True
            if time.monotonic() >= deadline or any(isinstance(a, dict) and a.get("prefetch") is False for a in answers):
                return False  # (a worker without prefetch never holds a version ahead: no use waiting)
            time.sleep(poll_s)

    def apply_weights(self) -> None:
        """Has the workers apply the version last published: start, update and finish
        (the part of a round the engine's pause must cover), then waits for its commit.

        Raises:
            VersionNotApplied: as `send_weights`.
            DeadlineExceeded: as `send_weights`.
            FailedPrecondition: as `send_weights`, and when nothing was published since
                the last apply.
        """
        if not self.is_sender:
            return
        publisher = self._publisher()
        version, self._unapplied = self._unapplied, 0
        if not version:
            raise FailedPrecondition("nothing published to apply; call publish_weights first")
        try:
            self.client.start_weight_update()
            self.client.update_weights({"version": version})
        except Exception as e:
            raise VersionNotApplied(f"version {version} was not applied: {self._reasons(version, e)}") from e
        try:
            self.client.finish_weight_update(weight_version=str(version))
        except Exception as e:
            raise FailedPrecondition(
                f"version {version} was applied, and finish_weight_update failed: {_described(e)}"
            ) from e
        if self.commit_timeout_s:
            state = publisher.wait_committed(version, self.commit_timeout_s)
            if state != "COMMITTED":
                raise VersionNotApplied(f"version {version} is {state}: {self._reasons(version, None)}")

    def _publisher(self) -> WeightPublisher:
        if self.publisher is None:
            raise InvalidArgument("this engine was shut down; call trainer_init again", field="engine")
        return self.publisher

    def _reasons(self, version: int, error: Exception | None) -> str:
        """The failed handshakes of `version` (agent: reason), else what the client raised."""
        assert self.publisher is not None
        try:
            status = self.publisher.client.status(self.publisher.session, 8)
            failed = [h for h in status.handshakes if h.version == version and not h.ok]
        except WeightsyncError as e:
            failed, error = [], error or e
        if failed:
            shown = "; ".join(f"{h.agent_id}: {h.mismatch}" for h in failed[:MAX_REASONS])
            return shown + (f" (and {len(failed) - MAX_REASONS} more)" if len(failed) > MAX_REASONS else "")
        if error is None:
            return "no rollout reported a failure"
        return f"the worker side raised {_described(error)}"

    def shutdown(self) -> None:
        """Detaches: closes the publisher (its chunk servers, arena and heartbeat); the
        worker keeps the weights it has. Idempotent."""
        if self.publisher is not None:
            self.publisher.close(cancel_pending=True)
            self.publisher = None


def _described(error: Exception) -> str:
    """An exception as one line; an HTTP error with the body the server sent."""
    text = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    body = getattr(getattr(error, "response", None), "text", "")
    return f"{text} ({body[:500]})" if body else text


def _collective_rpc(client: VLLMWeightSyncClient, method: str, *args: str) -> list[Any]:
    """Each worker's answer to `method` (the worker extension's): the client's own
    `collective_rpc` where it has one (an in-process `LLM`'s), else vLLM's dev-mode
    `/collective_rpc` route at an HTTP client's `base_url`."""
    hint = f"start the server with --worker-extension-cls {EXTENSION} (and VLLM_SERVER_DEV_MODE=1)"
    call = getattr(client, "collective_rpc", None)
    base_url = getattr(client, "base_url", None)
    try:
        if call is not None:
            return list(call(method, args=args))
        if base_url is None:
            raise FailedPrecondition(
                f"{type(client).__name__} has neither collective_rpc nor base_url to ask the workers"
            )
        import requests  # vLLM's dependency, as its HTTP client's

        timeout = getattr(client, "timeout", 60)
        response = requests.post(f"{base_url}/collective_rpc", json={"method": method, "args": args}, timeout=timeout)
        response.raise_for_status()
        return list(response.json().get("results") or [])
    except WeightsyncError:
        raise
    except Exception as e:
        raise FailedPrecondition(f"the workers could not be asked {method}: {_described(e)}; {hint}") from e


def _register() -> None:
    try:
        WeightTransferTrainerFactory.register_engine(BACKEND, __name__, WeightsyncTrainerEngine.__name__)
    except ValueError:
        log.debug("the %r trainer engine is registered already", BACKEND)


_register()
