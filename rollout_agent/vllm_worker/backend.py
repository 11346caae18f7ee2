"""vLLM weight-transfer backend `weightsync`: orchestrators drive it with vLLM's own API.

    llm = LLM(model, weight_transfer_config={"backend": "weightsync"})
    llm.init_weight_transfer_engine({"init_info": {"coordinator": "host:port", "session": "job"}})
    llm.start_weight_update()
    llm.update_weights({"update_info": {"version": 7}})      # or "latest"
    llm.finish_weight_update(weight_version="7")
    llm.reset_prefix_cache()                                  # finish does not do it

`update_weights` does the whole atomic round (pull, verify every byte, check names,
layerwise reload, handshake); it raises when the version was not applied, leaving the
previous weights serving. start/finish only bracket the round.

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
from dataclasses import dataclass
from typing import Any

from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo

from rollout_agent.settings import InitInfo
from rollout_agent.vllm_worker.rollout import VllmRollout, worker_index
from weightsync.config import option
from weightsync.errors import InvalidArgument


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
    return WeightsyncInitInfo(**init_dict)


def parse_update_info(update_dict: Any) -> WeightsyncUpdateInfo:
    """`update_info`'s version ("latest" when absent); its other keys are ignored."""
    if not isinstance(update_dict, dict):
        raise InvalidArgument(f"must be a dict, got {type(update_dict).__name__}", field="update_info")
    return WeightsyncUpdateInfo(version=update_dict.get("version", "latest"))


class WeightsyncEngine(WeightTransferEngine[WeightsyncInitInfo, WeightsyncUpdateInfo]):
    init_info_cls = WeightsyncInitInfo
    update_info_cls = WeightsyncUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: Any, model: Any) -> None:
        super().__init__(config, vllm_config, device, model)
        self.rollout: VllmRollout | None = None

    def parse_init_info(self, init_dict: dict[str, Any]) -> WeightsyncInitInfo:
        return parse_init_info(init_dict)

    def parse_update_info(self, update_dict: dict[str, Any]) -> WeightsyncUpdateInfo:
        return parse_update_info(update_dict)

    def init_transfer_engine(self, init_info: WeightsyncInitInfo) -> None:
        if self.rollout is not None:
            self.rollout.close()
        index = worker_index(self.parallel_config)
        self.rollout = VllmRollout(init_info, self.model, self.model_config, rank=index)

    def start_weight_update(self) -> None:
        if self.rollout is None:
            raise RuntimeError("weightsync: not initialized; call init_weight_transfer_engine first")

    def receive_weights(self, update_info: WeightsyncUpdateInfo) -> None:
        if self.rollout is None:
            raise RuntimeError("weightsync: not initialized; call init_weight_transfer_engine first")
        result = self.rollout.sync(update_info.version)
        if not result.ok:
            raise RuntimeError(f"weightsync: version {result.version} not applied: {result.mismatch}")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base synchronizes the accelerator after receiving; loads here are synchronous.
        self.receive_weights(self.parse_update_info(update_info))

    def finish_weight_update(self) -> None:
        """Nothing left: the round completed (or was refused) inside update_weights."""

    def shutdown(self) -> None:
        if self.rollout is not None:
            self.rollout.close()
            self.rollout = None
