"""vLLM's trainer-side API with the `weightsync` backend, against vLLM's own pieces.

A tiny Qwen3 is trained a step at a time by torch (float32, as the engines serve) and sent by
`WeightTransferTrainerFactory.trainer_init(WeightsyncTrainerInitInfo(...))`'s engine through
vLLM's `HTTPVLLMWeightSyncClient` to vLLM's OpenAI server (dev mode, tensor parallel 2,
started once for the module, dummy weights), and through a client calling an in-process
`LLM`'s methods. After each version the served log-probs equal transformers' with the
trainer's weights within 1e-5. Ray is not installed beside the lock: vLLM's Ray client
has no test here. A version or an init_info the server's workers refuse is raised once,
so the server's calls after it work (the last tests).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

vllm = pytest.importorskip("vllm")
torch = pytest.importorskip("torch")
requests = pytest.importorskip("requests")

from vllm.distributed.weight_transfer import (  # noqa: E402
    HTTPVLLMWeightSyncClient,
    ModuleSource,
    WeightSource,
    WeightTransferTrainerFactory,
)
from vllm.distributed.weight_transfer.base import (  # noqa: E402
    ParamMeta,
    WeightTransferInitRequest,
    WeightTransferUpdateRequest,
)

from devtools.spoiled_source import Spoiled  # noqa: E402
from tests.conftest import unmapped  # noqa: E402
from tests.e2e.test_vllm import ENGINE_ARGS, NEW_TOKENS, PROMPT, transformers_logprobs, vllm_run  # noqa: E402
from tests.unit.helpers import python_path  # noqa: E402
from tests.unit.test_vllm_trainer import RecordingClient  # noqa: E402
from trainer_agent.vllm_trainer import EXTENSION, WeightsyncTrainerEngine, WeightsyncTrainerInitInfo  # noqa: E402
from weightsync.client import CoordinatorClient  # noqa: E402
from weightsync.errors import FailedPrecondition, StaleGeneration, VersionNotApplied  # noqa: E402

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
TARGET = [20, 21, 22, 23]  # what the training step makes more likely after PROMPT
LOGPROB_ATOL = 1e-5
TP = 2  # the server's workers: each pulls and registers as a rollout of its own
MISSING = "model.layers.0.self_attn.v_proj.weight"
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"  # the tiny tokenizer has none


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _vllm_shm() -> set[Path]:
    """vLLM-CPU's shared-memory files: its TP groups' and its message queues' (Python's
    `shared_memory`, `psm_*`). Its shutdown kills the workers that would remove them, and
    a server killed past its grace removes none."""
    shm = Path("/dev/shm")
    return set(shm.glob("vllm_dist_*")) | set(shm.glob("psm_*"))


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """vLLM's OpenAI server (multiprocess, TP 2, dummy weights) with the weightsync backend
    in dev mode; its base URL. Its log is printed when it does not come up; its process
    group and the shared-memory files it leaves are removed at the end."""
    shm_before = _vllm_shm()
    port = _free_port()
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    env.update(VLLM_SERVER_DEV_MODE="1", HF_HUB_OFFLINE="1", VLLM_CPU_OMP_THREADS_BIND="0|1")
    args = [str(model_dir), "--host", "127.0.0.1", "--port", str(port), "--load-format", "dummy"]
    args += ["--tensor-parallel-size", str(TP), "--max-model-len", "128", "--kv-cache-memory-bytes", str(64 << 20)]
    args += ["--dtype", "float32", "--enforce-eager", "--block-size", "32", "--seed", "0"]
    args += ["--weight-transfer-config", '{"backend": "weightsync"}', "--worker-extension-cls", EXTENSION]
    args += ["--chat-template", CHAT_TEMPLATE]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "rollout_agent.vllm_cli", "serve", *args],  # `vllm serve` of the CPU wheel
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=ROOT,
            start_new_session=True,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"vLLM's server did not come up:\n{log_path.read_text()[-6000:]}")
            try:
                if requests.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            time.sleep(0.5)
        yield base
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # workers it left
            proc.wait(10)
        time.sleep(0.5)
        for path in unmapped(_vllm_shm() - shm_before):
            path.unlink(missing_ok=True)


class LLMClient:
    """A `VLLMWeightSyncClient` over an in-process `vllm.LLM`: its methods, with the
    requests vLLM's Ray client sends its actors."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=init_info))

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info: Any) -> None:
        self.llm.update_weights(WeightTransferUpdateRequest(update_info=update_info))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version=weight_version)


class Recorded(RecordingClient):
    """Records each call, then makes it on `inner`."""

    def __init__(self, inner: Any) -> None:
        super().__init__()
        self.inner = inner

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        super().init_weight_transfer_engine(init_info)
        self.inner.init_weight_transfer_engine(init_info)

    def start_weight_update(self) -> None:
        super().start_weight_update()
        self.inner.start_weight_update()

    def update_weights(self, update_info: Any) -> None:
        super().update_weights(update_info)
        self.inner.update_weights(update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        super().finish_weight_update(weight_version)
        self.inner.finish_weight_update(weight_version)

    def names(self) -> list[str]:
        return [name for name, _ in self.calls]


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> Iterator[Any]:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process
    engine = vllm.LLM(model=str(model_dir), weight_transfer_config={"backend": "weightsync"}, **ENGINE_ARGS)
    yield engine
    engine.shutdown_weight_transfer_engine()


class Without(WeightSource):
    """A module's parameters but one: what a trainer of another architecture would send."""

    def __init__(self, module: Any, name: str) -> None:
        self.inner, self.name = ModuleSource(module), name

    def metadata(self) -> list[ParamMeta]:
        return [m for m in self.inner.metadata() if m.name != self.name]

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        return ((n, t) for n, t in self.inner if n != self.name)


def trainer_model(model_dir: Path) -> Any:
    import transformers

    model = transformers.Qwen3ForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    return model


def train_step(model: Any) -> None:
    """One SGD step on PROMPT + TARGET: every parameter that takes part changes."""
    model.train()
    ids = torch.tensor([PROMPT + TARGET])
    model(ids, labels=ids).loss.backward()
    model.optimizer.step()
    model.optimizer.zero_grad()


def served_http(base: str) -> tuple[list[int], list[float], list[float]]:
    """The same through the OpenAI completions API (token ids in, echo for the prompt's)."""
    model = requests.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"]
    body = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": NEW_TOKENS,
        "temperature": 0,
        "logprobs": 0,
        "echo": True,
        "ignore_eos": True,
        "return_tokens_as_token_ids": True,
    }
    choice = requests.post(f"{base}/v1/completions", json=body, timeout=60).json()["choices"][0]
    tokens = [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]]
    lps = choice["logprobs"]["token_logprobs"]
    assert tokens[: len(PROMPT)] == PROMPT
    return tokens[len(PROMPT) :], lps[1 : len(PROMPT)], lps[len(PROMPT) :]


def assert_serves(got: tuple, want: tuple) -> None:
    assert got[0] == want[0], f"greedy tokens differ: vLLM {got[0]} vs transformers {want[0]}"
    np.testing.assert_allclose(got[1], want[1], atol=LOGPROB_ATOL, rtol=0)
    np.testing.assert_allclose(got[2], want[2], atol=LOGPROB_ATOL, rtol=0)


def send_http(engine: Any, base: str) -> None:
    """vLLM's examples' order: pause (which clears the prefix cache), send, resume."""
    requests.post(f"{base}/pause", timeout=60).raise_for_status()
    try:
        engine.send_weights()
    finally:
        requests.post(f"{base}/resume", timeout=60).raise_for_status()


def handshakes(coordinator: str, session: str, version: int) -> dict[str, Any]:
    with CoordinatorClient(coordinator) as c:
        return {h.agent_id: h for h in c.status(session).handshakes if h.version == version}


def test_vllms_http_client_syncs_each_trained_step_to_vllms_server(
    server: str, coordinator: str, model_dir: Path
) -> None:
    # the module's first test on the server: no weight-transfer engine yet, nothing to serve
    probe = requests.get(f"{server}/weightsync/ready", timeout=30)
    assert probe.status_code == 503 and "init_weight_transfer_engine" in probe.text, probe.text
    model = trainer_model(model_dir)
    info = WeightsyncTrainerInitInfo(coordinator, "http", rank=0, worker={"agent_id": "srv", "weight_sync_mode": "tcp"})
    engine = WeightTransferTrainerFactory.trainer_init(
        init_info=info, client=HTTPVLLMWeightSyncClient(server), source=ModuleSource(model)
    )
    try:
        assert isinstance(engine, WeightsyncTrainerEngine)
        for step in (1, 2):
            train_step(model)
            send_http(engine, server)
            assert engine.version == step
            assert requests.get(f"{server}/weight_info", timeout=10).json()["weight_version"] == str(step)
            assert_serves(served_http(server), transformers_logprobs(model))
            reports = handshakes(coordinator, "http", step)
            assert sorted(reports) == ["srv", "srv-r1"] and all(h.ok for h in reports.values())  # one per TP worker
            # the readiness probe: every worker serves the session's newest committed version
            probe = requests.get(f"{server}/weightsync/ready", timeout=30)
            assert probe.status_code == 200, probe.text
            workers = probe.json()["workers"]
            assert sorted(w["agent_id"] for w in workers) == ["srv", "srv-r1"]
            assert all((w["ready"], w["serving"], w["committed"]) == (True, step, step) for w in workers), workers
    finally:
        engine.shutdown()


def test_publishing_first_the_pause_covers_only_the_apply(server: str, coordinator: str, model_dir: Path) -> None:
    """publish_weights returns before the server applied anything (it still serves the last
    version); wait_prefetched sees both TP workers hold the new one verified; apply_weights
    inside /pause../resume applies what they hold (the pause's length against the apply's is
    bench/vllm_trainer.py --end-to-end's). vLLM's `packed=` rides along on the trainer side."""
    model = trainer_model(model_dir)
    info = WeightsyncTrainerInitInfo(coordinator, "split", rank=0, packed=False, worker={"agent_id": "sp"})
    client = HTTPVLLMWeightSyncClient(server)
    engine = WeightsyncTrainerEngine.trainer_init(info, client=client, source=ModuleSource(model))
    try:
        for step in (1, 2):
            train_step(model)
            before = requests.get(f"{server}/weight_info", timeout=10).json()["weight_version"]
            assert engine.publish_weights() == step
            assert requests.get(f"{server}/weight_info", timeout=10).json()["weight_version"] == before
            assert engine.wait_prefetched(timeout_s=120)
            requests.post(f"{server}/pause", timeout=60).raise_for_status()
            engine.apply_weights()
            requests.post(f"{server}/resume", timeout=60).raise_for_status()
            assert requests.get(f"{server}/weight_info", timeout=10).json()["weight_version"] == str(step)
            assert_serves(served_http(server), transformers_logprobs(model))
            reports = handshakes(coordinator, "split", step)
            assert sorted(reports) == ["sp", "sp-r1"] and all(h.ok for h in reports.values())
        with pytest.raises(FailedPrecondition, match="nothing published"):
            engine.apply_weights()
    finally:
        engine.shutdown()


def test_vllms_server_takes_what_vllms_own_flows_send(server: str, coordinator: str, model_dir: Path) -> None:
    """update_info keys of vLLM's NCCL flow beside ours, and `packed` in the init info."""
    post = lambda path, body=None: requests.post(f"{server}/{path}", json=body, timeout=120)  # noqa: E731
    model = trainer_model(model_dir)
    info = WeightsyncTrainerInitInfo(coordinator, "flows", rank=0, worker={"packed": True, "weight_sync_mode": "tcp"})
    engine = WeightTransferTrainerFactory.trainer_init(
        init_info=info, client=HTTPVLLMWeightSyncClient(server), source=ModuleSource(model)
    )
    try:
        train_step(model)
        send_http(engine, server)  # version 1
        assert post("start_weight_update").status_code == 200
        extra = {"names": ["lm_head.weight"], "dtype_names": ["float32"], "shapes": [[1024, 64]], "packed": True}
        assert post("update_weights", {"update_info": {"version": 1, **extra}}).status_code == 200
        assert post("finish_weight_update", {"weight_version": "1"}).status_code == 200
        assert_serves(served_http(server), transformers_logprobs(model))
    finally:
        engine.shutdown()


def test_the_example_runs_against_vllms_server(server: str, coordinator: str, model_dir: Path) -> None:
    """examples/rlhf_http_weightsync.py, as CI runs it: the checkpoint's weights replace
    whatever the server held, which then serves transformers' log-probs."""
    import transformers

    env = {**os.environ, "PYTHONPATH": python_path(ROOT)}
    run = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "rlhf_http_weightsync.py"), "--model", str(model_dir)]
        + ["--base-url", server, "--coordinator", coordinator, "--session", "example"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=ROOT,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "AFTER weight sync" in run.stdout and "Weight transfer complete: version 1" in run.stdout
    checkpoint = transformers.Qwen3ForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    requests.post(f"{server}/reset_prefix_cache", timeout=60).raise_for_status()
    assert_serves(served_http(server), transformers_logprobs(checkpoint))


def test_the_readme_trainer_snippet_runs_as_written(server: str, coordinator: str, model_dir: Path) -> None:
    from tests.doc_snippets import snippet

    code = snippet("vllm-trainer", coordinator)
    model = trainer_model(model_dir)
    train_step(model)
    scope: dict[str, Any] = {"base_url": server, "model": model}
    exec(code, scope)  # noqa: S102 - the documented example, as written
    try:
        assert scope["engine"].version == 1
        requests.post(f"{server}/reset_prefix_cache", timeout=60).raise_for_status()
        assert_serves(served_http(server), transformers_logprobs(model))
    finally:
        scope["engine"].shutdown()


def test_vllm_llm_client_runs_init_then_start_update_finish(llm: Any, coordinator: str, model_dir: Path) -> None:
    model = trainer_model(model_dir)
    client = Recorded(LLMClient(llm))
    info = WeightsyncTrainerInitInfo(
        coordinator, "llm", rank=0, worker={"agent_id": "llm-a", "weight_sync_mode": "tcp"}
    )
    engine = WeightTransferTrainerFactory.trainer_init(init_info=info, client=client, source=ModuleSource(model))
    try:
        assert client.calls == [("init", info.worker_init_info())]
        for step in (1, 2):
            train_step(model)
            engine.send_weights()
            llm.reset_prefix_cache()  # vLLM's finish_weight_update does not
            assert client.calls[-3:] == [("start", None), ("update", {"version": step}), ("finish", str(step))]
            assert llm.get_weight_version() == str(step)
            assert_serves(vllm_run(llm), transformers_logprobs(model))
        assert client.names() == ["init"] + ["start", "update", "finish"] * 2
        before = vllm_run(llm)
        engine.source = Without(model, MISSING)
        with pytest.raises(VersionNotApplied, match=f"version 3 was not applied: llm-a: .*{MISSING}"):
            engine.send_weights()
        assert client.names()[-2:] == ["start", "update"]  # and no finish
        llm.reset_prefix_cache()
        assert vllm_run(llm) == before  # the refused version changed nothing
        engine.source = ModuleSource(model)
        train_step(model)
        engine.send_weights()  # the next version applies
        llm.reset_prefix_cache()
        assert engine.version == 4 and llm.get_weight_version() == "4"
        assert_serves(vllm_run(llm), transformers_logprobs(model))
    finally:
        engine.shutdown()


def test_a_second_trainer_generation_fences_the_first(llm: Any, coordinator: str, model_dir: Path) -> None:
    """A restarted trainer attaches to the session: it numbers on from the last version,
    and the first one's sends are refused before its client is called."""
    first_model, second_model = trainer_model(model_dir), trainer_model(model_dir)
    worker = {"agent_id": "llm-f", "weight_sync_mode": "tcp"}
    first_client = Recorded(LLMClient(llm))
    first = WeightTransferTrainerFactory.trainer_init(
        init_info=WeightsyncTrainerInitInfo(coordinator, "fence", rank=0, worker=worker),
        client=first_client,
        source=ModuleSource(first_model),
    )
    second = None
    try:
        for _ in range(2):
            train_step(first_model)
            first.send_weights()
        second = WeightTransferTrainerFactory.trainer_init(
            init_info=WeightsyncTrainerInitInfo(coordinator, "fence", rank=0, worker=worker),
            client=LLMClient(llm),
            source=ModuleSource(second_model),
        )
        train_step(second_model)  # one step from the checkpoint: not the first's weights
        second.send_weights()
        llm.reset_prefix_cache()
        assert second.version == 3 and llm.get_weight_version() == "3"
        calls = len(first_client.calls)
        with pytest.raises(StaleGeneration):
            first.send_weights()
        assert len(first_client.calls) == calls  # nothing reached the worker
        llm.reset_prefix_cache()
        assert_serves(vllm_run(llm), transformers_logprobs(second_model))
    finally:
        first.shutdown()
        if second is not None:
            second.shutdown()


def test_an_init_info_key_the_worker_does_not_know_is_refused_naming_it(
    llm: Any, coordinator: str, model_dir: Path
) -> None:
    info = WeightsyncTrainerInitInfo(coordinator, "keys", rank=0, worker={"master_port": 29500})
    with pytest.raises(FailedPrecondition, match="refused its init info: InvalidArgument: init_info.master_port: "):
        WeightTransferTrainerFactory.trainer_init(
            init_info=info, client=LLMClient(llm), source=ModuleSource(trainer_model(model_dir))
        )


def audited_exact(coordinator: str, session: str) -> dict[str, Any]:
    """Every worker of the session audits the weights its engine serves now (beside the
    engine: the parameters vLLM keeps); each one's verdict."""
    with CoordinatorClient(coordinator) as c:
        found = c.audit_session(session, fresh=True, wait_s=30)
    return {r.agent_id: r.audit for r in found.rollouts}


DEFECTS = [  # three a loader refuses, and one that tensor parallelism alone narrows away
    ("model.layers.1.self_attn.q_proj.weight", lambda t: t[:-1], "rank 1's heads: r1 refuses, r0 could load"),
    ("model.layers.1.mlp.down_proj.weight", lambda t: t.t().contiguous(), "transposed"),
    ("lm_head.weight", lambda t: t[:-1], "a vocabulary row short"),
    ("model.layers.0.self_attn.q_proj.weight", lambda t: torch.cat([t, t[:1]]), "a row long: each rank narrows"),
]


def test_a_version_one_worker_refuses_is_applied_by_none_and_the_next_round_works(
    server: str, coordinator: str, model_dir: Path
) -> None:
    """TP 2, vLLM's HTTP flow: each defect (a shape vLLM's loader refuses on one worker or
    both, or takes in part) is refused before any worker's weights change. The engine still
    says and serves the last version, bit for bit, every worker's audit exact, and the next
    start/update/finish round applies with no other call: the refusal is raised once (by the
    engine's last worker), so vLLM's replies stay in step and no worker is left in its round."""
    model = trainer_model(model_dir)
    info = WeightsyncTrainerInitInfo(coordinator, "torn", rank=0, worker={"agent_id": "tp", "weight_sync_mode": "tcp"})
    client = Recorded(HTTPVLLMWeightSyncClient(server))
    engine = WeightTransferTrainerFactory.trainer_init(init_info=info, client=client, source=ModuleSource(model))
    try:
        train_step(model)
        send_http(engine, server)  # version 1
        for i, (name, spoil, what) in enumerate(DEFECTS):
            before = served_http(server)
            last = engine.version
            train_step(model)  # the refused version's other tensors are new weights
            engine.source = Spoiled(ModuleSource(model), name, spoil)
            with pytest.raises(VersionNotApplied, match=re.escape(repr(name))) as refused:
                send_http(engine, server)
            assert "finish" not in client.names()[-2:], what
            assert requests.get(f"{server}/weight_info", timeout=10).json()["weight_version"] == str(last)
            assert served_http(server) == before, f"{what}: the engine serves other weights after the refusal"
            reports = handshakes(coordinator, "torn", last + 1)
            assert sorted(reports) == ["tp", "tp-r1"] and not any(h.ok for h in reports.values()), refused.value
            audits = audited_exact(coordinator, "torn")
            assert sorted(audits) == ["tp", "tp-r1"], audits
            assert all(a.exact and a.version == last for a in audits.values()), audits
            engine.source = ModuleSource(model)
            send_http(engine, server)  # the next round, with no other call
            assert engine.version == last + 2
            assert requests.get(f"{server}/weight_info", timeout=10).json()["weight_version"] == str(last + 2)
            if i == len(DEFECTS) - 1:
                assert_serves(served_http(server), transformers_logprobs(model))
    finally:
        engine.shutdown()


def test_an_init_info_every_worker_refuses_is_raised_once(server: str, coordinator: str, model_dir: Path) -> None:
    """A refused init_info (every worker parses it alike) is raised by one worker: the
    server's next call gets its own reply, not the refused one's (vllm-project/vllm#49972)."""
    post = lambda path, body=None: requests.post(f"{server}/{path}", json=body, timeout=120)  # noqa: E731
    bad = post("init_weight_transfer_engine", {"init_info": {"coordinator": coordinator, "sesion": "x"}})
    assert bad.status_code >= 400 and "init_info.sesion" in bad.text and "session" in bad.text
    model = trainer_model(model_dir)
    info = WeightsyncTrainerInitInfo(coordinator, "after", rank=0, worker={"weight_sync_mode": "tcp"})
    engine = WeightTransferTrainerFactory.trainer_init(
        init_info=info, client=HTTPVLLMWeightSyncClient(server), source=ModuleSource(model)
    )
    try:
        train_step(model)
        send_http(engine, server)
        assert_serves(served_http(server), transformers_logprobs(model))
    finally:
        engine.shutdown()


def manifest_digests(coordinator: str, session: str) -> dict[int, str]:
    with CoordinatorClient(coordinator) as c:
        return {v.version: v.manifest_digest for v in c.status(session).versions}


def requests_in_flight(base: str) -> float:
    """Requests the server's engine runs or holds waiting (vLLM's gauges, as of its last step)."""
    text = requests.get(f"{base}/metrics", timeout=10).text
    gauges = re.findall(r"^vllm:num_requests_(?:running|waiting)\{[^}]*\} (\S+)$", text, re.M)
    return sum(float(g) for g in gauges)


def span(label: str, start: int, end: int, version: int, digest: str) -> dict[str, Any]:
    """A choice's `weight_versions` entry as the server writes it."""
    return {"version": label, "start": start, "end": end, "weightsync": {"version": version, "manifest_digest": digest}}


def test_an_openai_client_reads_the_version_and_digest_of_every_response(
    server: str, coordinator: str, model_dir: Path
) -> None:
    """The server's responses name the version its workers applied and that version's
    manifest digest (the coordinator's): `system_fingerprint` and each choice's
    `weight_versions`, read by the `openai` client, for completions and chat, streamed or
    not. A streamed request the orchestrator keeps across the pause (`/pause?mode=keep`)
    names both versions, with the token range of each."""
    openai = pytest.importorskip("openai")
    model = trainer_model(model_dir)
    info = WeightsyncTrainerInitInfo(coordinator, "prov", rank=0, worker={"agent_id": "pv", "weight_sync_mode": "tcp"})
    engine = WeightTransferTrainerFactory.trainer_init(
        init_info=info, client=HTTPVLLMWeightSyncClient(server), source=ModuleSource(model)
    )
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)
    try:
        train_step(model)
        send_http(engine, server)  # version 1
        d1 = manifest_digests(coordinator, "prov")[1]
        name = client.models.list().data[0].id
        done = client.completions.create(
            model=name, prompt=PROMPT, max_tokens=NEW_TOKENS, n=2, seed=0, extra_body={"ignore_eos": True}
        )
        assert done.system_fingerprint == f"weightsync:v1:{d1[:16]}"
        assert [c.weight_versions for c in done.choices] == [[span("1", 0, NEW_TOKENS, 1, d1)]] * 2
        chat = client.chat.completions.create(
            model=name, messages=[{"role": "user", "content": "w1 w2 w3"}], max_tokens=3,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert chat.system_fingerprint == f"weightsync:v1:{d1[:16]}"
        assert chat.choices[0].weight_versions == [span("1", 0, 3, 1, d1)]

        total = 100  # tokens the stream asks for
        for _ in range(5):  # until the pause lands while it generates (its 100 tokens take a fraction of a second)
            stream = iter(
                client.completions.create(
                    model=name, prompt=PROMPT, max_tokens=total, temperature=0, stream=True,
                    extra_body={"ignore_eos": True, "return_token_ids": True},
                )
            )  # fmt: skip
            first = next(stream)
            requests.post(f"{server}/pause", params={"mode": "keep"}, timeout=60).raise_for_status()
            if requests_in_flight(server):
                break
            requests.post(f"{server}/resume", timeout=60).raise_for_status()
            list(stream)
        else:
            pytest.fail("every request finished before the pause")
        try:
            train_step(model)
            engine.send_weights()  # version 2, applied while the request waits in the engine
        finally:
            requests.post(f"{server}/resume", timeout=60).raise_for_status()
        chunks = [first, *stream]
        d2 = manifest_digests(coordinator, "prov")[2]
        last = chunks[-1]
        assert last.choices[0].finish_reason == "length"
        assert last.system_fingerprint == f"weightsync:v1:{d1[:16]}+v2:{d2[:16]}"
        flip = last.choices[0].weight_versions[0]["end"]
        assert len(first.choices[0].token_ids) <= flip < total
        assert last.choices[0].weight_versions == [span("1", 0, flip, 1, d1), span("2", flip, total, 2, d2)]
        assert not any(getattr(c.choices[0], "weight_versions", None) for c in chunks[:-1])
        assert sum(len(c.choices[0].token_ids) for c in chunks) == total
        chat_chunks = list(
            client.chat.completions.create(
                model=name, messages=[{"role": "user", "content": "w1"}], max_tokens=3, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
            )
        )  # fmt: skip
        usage, ended = chat_chunks[-1], chat_chunks[-2]  # with usage, the fingerprint rides the usage chunk
        assert not usage.choices and usage.system_fingerprint == f"weightsync:v2:{d2[:16]}"
        assert ended.choices[0].finish_reason == "length"
        assert ended.choices[0].weight_versions == [span("2", 0, 3, 2, d2)]
    finally:
        engine.shutdown()
