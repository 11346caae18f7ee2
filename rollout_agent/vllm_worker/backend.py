"""vLLM weight-transfer backend `weightsync`: orchestrators drive it with vLLM's own API.

    llm = LLM(model, weight_transfer_config={"backend": "weightsync"})
    llm.init_weight_transfer_engine({"init_info": {"coordinator": "host:port", "session": "job"}})
    llm.start_weight_update()
    llm.update_weights({"update_info": {"version": 7}})      # or "latest"
    llm.finish_weight_update(weight_version="7")
    llm.reset_prefix_cache()                                  # finish does not do it

`update_weights` does the whole atomic round (pull, verify every byte, check names,
a dry run through the model's own loaders, layerwise reload, handshake); it raises when
the version was not applied, leaving the previous weights serving. start/finish only
bracket the round.

The workers of a TP/PP engine agree before any applies (`workers`): all apply, or none.
A refused version, or a refused `init_info`, is raised by the engine's last worker alone;
the others end their round as vLLM's worker ends it on an error, and return. vLLM 0.32's
`collective_rpc` raises at the first failed reply it reads, in rank order, and leaves
the replies after it queued for the next call (vllm-project/vllm#49972): raised by every
worker, an error made the engine answer each later call with the one before's reply, and
left a worker that had not failed inside its round ("start_weight_update called while a
weight update is already active"). Raised by the last worker, every reply is read, and
the next start/update/finish round works with no other call.

What vLLM's own flow sends is taken as vLLM's engines take it, with two differences: an
`init_info` key the backend does not know is refused naming it (`InvalidArgument`,
`init_info.<key>`; vLLM's engines refuse one too, as a TypeError), except `packed`, vLLM's
wire parameter, accepted and ignored (weightsync chunks every version itself); keys of
`update_info` other than `version` (vLLM's NCCL flow sends names, dtype_names, shapes,
packed) are ignored. Every worker of a TP/PP/DP engine given one `agent_id` registers as a
rollout of its own: worker r > 0 as `<agent_id>-r<r>` (`rollout.worker_agent_id`).
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import os
import sys
from dataclasses import dataclass
from typing import Any

from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo

from rollout_agent.settings import InitInfo
from rollout_agent.vllm_worker.rollout import VllmRollout, worker_index
from rollout_agent.vllm_worker.workers import EngineWorkers, Verdict
from weightsync.config import option
from weightsync.credentials import CREDENTIAL_ENV
from weightsync.errors import InvalidArgument

log = logging.getLogger("vllm.plugins.weightsync")


@dataclass
class WeightsyncInitInfo(InitInfo, WeightTransferInitInfo):
    """`rollout_agent.settings.SyncSettings`' fields (coordinator, session, agent_id,
    weight_sync_mode, ...), named `init_info.<field>` in errors."""

    packed: bool = option(
        False, "vLLM's wire parameter of its NCCL and IPC engines: accepted and ignored (weightsync chunks itself)."
    )

    def check(self) -> None:
        if not isinstance(self.packed, bool):
            raise InvalidArgument(f"must be true or false, got {self.packed!r:.40}", field="init_info.packed")
        super().check()


@dataclass
class WeightsyncUpdateInfo(WeightTransferUpdateInfo):
    """Which version to sync: an integer or "latest"."""

    version: Any = "latest"


def parse_init_info(init_dict: Any) -> WeightsyncInitInfo:
    """`init_info` as the backend's settings; InvalidArgument naming a key it does not know
    (with the closest known one), or the first bad value."""
    if not isinstance(init_dict, dict):
        raise InvalidArgument(f"must be a dict, got {type(init_dict).__name__}", field="init_info")
    known = [f.name for f in dataclasses.fields(WeightsyncInitInfo)]
    for key in init_dict:
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else " (docs/configuration.md#vllm-init_info lists them)"
            raise InvalidArgument(
                f"is not a key of the weightsync backend's init_info{hint}", field=f"init_info.{key!s:.60}"
            )
    if not init_dict.get("auth_token") and not init_dict.get("auth_token_file") and os.environ.get(CREDENTIAL_ENV):
        # the worker is vLLM's process: its environment is this rollout's entry point's
        init_dict = {**init_dict, "auth_token_file": os.environ[CREDENTIAL_ENV]}
    return WeightsyncInitInfo(**init_dict)


def parse_update_info(update_dict: Any) -> WeightsyncUpdateInfo:
    """`update_info`'s version ("latest" when absent); its other keys are ignored."""
    if not isinstance(update_dict, dict):
        raise InvalidArgument(f"must be a dict, got {type(update_dict).__name__}", field="update_info")
    return WeightsyncUpdateInfo(version=update_dict.get("version", "latest"))


class _Refused:
    """An `init_info` this worker refused, kept for the workers' agreement (see module doc)."""

    def __init__(self, error: Exception) -> None:
        self.error = error


class WeightsyncEngine(WeightTransferEngine[WeightsyncInitInfo, WeightsyncUpdateInfo]):
    init_info_cls = WeightsyncInitInfo
    update_info_cls = WeightsyncUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: Any, model: Any) -> None:
        super().__init__(config, vllm_config, device, model)
        self.rollout: VllmRollout | None = None
        self.workers = EngineWorkers.of_engine()

    def parse_init_info(self, init_dict: dict[str, Any]) -> WeightsyncInitInfo:
        try:
            return parse_init_info(init_dict)
        except InvalidArgument as e:
            return _Refused(e)  # type: ignore[return-value]  # refused in init_transfer_engine, once all agree

    def parse_update_info(self, update_dict: dict[str, Any]) -> WeightsyncUpdateInfo:
        return parse_update_info(update_dict)

    def init_transfer_engine(self, init_info: WeightsyncInitInfo) -> None:
        if self.rollout is not None:
            self.rollout.close()
            self.rollout = None
        error: Exception | None = init_info.error if isinstance(init_info, _Refused) else None
        if error is None:
            try:
                index = worker_index(self.parallel_config)
                self.rollout = VllmRollout(init_info, self.model, self.model_config, rank=index, workers=self.workers)
            except Exception as e:  # noqa: BLE001 - raised once every worker knows
                error = e
        refusal = self.workers.agree(Verdict(0, _why(error)), ()).refusal
        if refusal and self.rollout is not None:  # another worker refused: none follows the session
            self.rollout.close()
            self.rollout = None
        if refusal:
            self._raise_once("init_info", refusal, error)

    def start_weight_update(self) -> None:
        if self.rollout is None:
            raise RuntimeError("weightsync: not initialized; call init_weight_transfer_engine first")

    def receive_weights(self, update_info: WeightsyncUpdateInfo) -> None:
        error: Exception | None = None
        reason, version = "", update_info.version
        if self.rollout is None:
            error = RuntimeError("weightsync: not initialized; call init_weight_transfer_engine first")
        else:
            try:
                result = self.rollout.sync(version)
                version, reason = result.version, "" if result.ok else result.mismatch
            except Exception as e:  # noqa: BLE001 - raised once every worker knows
                error = e
        echo = self.rollout is not None and error is None and self.rollout.echoed == version
        refusal = self.workers.agree(Verdict(0, reason or _why(error), echo=echo), ()).refusal
        if refusal:
            self._raise_once(f"version {version}, not applied", refusal, error)

    def _raise_once(self, what: str, refusal: str, error: Exception | None) -> None:
        """Logs and raises the engine's refusal of `what` on its last worker (one ERROR line,
        `quiet_refusals`); any other worker ends the round it is in, as vLLM ends it on the
        worker that raises (see the module's doc)."""
        if not self.workers.last:
            _end_worker_round(self)
            log.info("weightsync refused %s; the engine's last worker raises it", what)
            return
        log.error("weightsync refused %s: %s", what, refusal)
        if error is not None and self.workers.size == 1:
            raise error  # a worker alone: the caller gets the exception itself
        raise WeightsRefused(f"weightsync refused {what}: {refusal}") from None

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base synchronizes the accelerator after receiving; loads here are synchronous.
        self.receive_weights(self.parse_update_info(update_info))

    def finish_weight_update(self) -> None:
        """Nothing left: the round completed (or was refused) inside update_weights."""

    def shutdown(self) -> None:
        if self.rollout is not None:
            self.rollout.close()
            self.rollout = None


class WeightsRefused(RuntimeError):
    """The engine's workers refused a version or an init_info (the message says why)."""


def _why(error: Exception | None) -> str:
    if error is None:
        return ""
    if isinstance(error, InvalidArgument) or str(error).startswith("weightsync: "):
        return str(error).removeprefix("weightsync: ")
    return f"{type(error).__name__}: {error}"


def _end_worker_round(engine: WeightsyncEngine) -> None:
    """Marks the vLLM worker that called `engine` out of its weight-update round, as its
    `update_weights` does when the engine raises: the worker is the caller a few frames up
    that holds `engine` as its weight_transfer_engine. A worker of another make (no such
    flag) is left as it is."""
    frame = sys._getframe(1)
    while frame is not None:
        worker = frame.f_locals.get("self")
        if worker is not engine and getattr(worker, "weight_transfer_engine", None) is engine:
            if getattr(worker, "_weight_update_active", False):
                worker._weight_update_active = False
                engine.reset_weight_update_target()
            return
        frame = frame.f_back  # type: ignore[assignment]
