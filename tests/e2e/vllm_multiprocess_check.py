"""Run by test_vllm.py in a fresh interpreter: vLLM in its default multiprocess mode.

Only the plugin entry point reaches vLLM's EngineCore and worker processes, so this proves
the `weightsync` backend registers there. Prints one JSON line.
"""

from __future__ import annotations

import json
import sys

import numpy as np
from safetensors.numpy import load_file

from trainer_agent.publish.publisher import WeightPublisher
from trainer_agent.settings import PublisherSettings


def main(model_dir: str, coordinator: str) -> None:
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=model_dir,
        dtype="float32",
        enforce_eager=True,
        max_model_len=128,
        kv_cache_memory_bytes=64 << 20,
        block_size=32,
        seed=0,
        weight_transfer_config={"backend": "weightsync"},
    )
    llm.init_weight_transfer_engine(
        {"init_info": {"coordinator": coordinator, "session": "mp", "agent_id": "mp-engine"}}
    )
    base = load_file(f"{model_dir}/model.safetensors")
    rng = np.random.default_rng(5)
    with WeightPublisher(PublisherSettings(coordinator=coordinator, session="mp", min_rollouts=1)) as pub:
        pub.publish({k: (v + 0.05 * rng.standard_normal(v.shape)).astype(v.dtype) for k, v in base.items()}, 1)
        llm.start_weight_update()
        llm.update_weights({"update_info": {"version": "latest"}})
        llm.finish_weight_update(weight_version="1")
        llm.reset_prefix_cache()
        out = llm.generate(
            [{"prompt_token_ids": [1, 5, 6, 7, 8]}], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        )
        state = pub.wait_committed(1, 60)
    llm.shutdown_weight_transfer_engine()
    print(
        json.dumps(
            {"tokens": list(out[0].outputs[0].token_ids), "weight_version": llm.get_weight_version(), "state": state}
        )
    )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
