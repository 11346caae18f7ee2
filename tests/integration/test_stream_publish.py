"""Converter -> publish_stream -> puller -> applier, against an in-process coordinator."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from rollout_agent.engines.dict_applier import DictApplier
from rollout_agent.pull.puller import WeightPuller
from rollout_agent.sync.round import sync_version
from tests.integration.support import publish_and_sync
from tests.unit.maxtext_reference import to_maxtext, with_style
from tests.unit.test_convert import H, K, L, N, hf_weights
from trainer_agent.convert import ConvertOptions, ModelDims, convert_maxtext
from trainer_agent.publish.publisher import WeightPublisher
from trainer_agent.settings import PublisherSettings
from weightsync.client import CoordinatorClient
from weightsync.errors import ResourceExhausted
from weightsync.server import RunningServer


def test_streamed_maxtext_conversion_syncs_bit_exactly(
    inprocess_coordinator: RunningServer, no_arena_leak: None
) -> None:
    hf = hf_weights("llama3")
    dims = ModelDims(layers=L, heads=N, kv_heads=K, head_dim=H, vocab=128)
    expected = dict(
        convert_maxtext(
            with_style(to_maxtext(hf, "llama3", layers=L, heads=N, kv_heads=K, head_dim=H, vocab_pad=8), "linen"),
            "llama3",
            dims,
            ConvertOptions(weight_dtype="bfloat16"),
        )
    )
    capacity = sum(a.nbytes + 256 for a in expected.values())
    client = CoordinatorClient(inprocess_coordinator.address)
    client.open_session("job", trainer=False)
    with WeightPublisher(
        PublisherSettings(coordinator=inprocess_coordinator.address, session="job", chunk_bytes=16384)
    ) as pub:
        client.register_agent("job", "r0", trainer=False, endpoint=pub.endpoint)
        tree = with_style(to_maxtext(hf, "llama3", layers=L, heads=N, kv_heads=K, head_dim=H, vocab_pad=8), "linen")
        stream = convert_maxtext(tree, "llama3", dims, ConvertOptions(weight_dtype="bfloat16"))
        result = pub.publish_stream(stream, 1, capacity_bytes=capacity)
        assert result.state == "READY" and pub.last_path.startswith("stream")
        applier = DictApplier()
        puller = WeightPuller(client, "job", "r0", window_chunks=3)
        outcome = sync_version(puller, applier, 1)
        puller.close()
        assert outcome.ok, outcome.mismatch
        assert set(applier.weights) == set(expected)
        for name, ref in expected.items():
            assert applier.weights[name].dtype == ref.dtype
            assert np.array_equal(applier.weights[name].view(np.uint16), ref.view(np.uint16)), name
        assert pub.wait_committed(1, 30) == "COMMITTED"
        with pytest.raises(ResourceExhausted, match="capacity_bytes"):
            big = [("model.big.weight", np.zeros(pub.arena.slot_bytes + 1, np.uint8))]
            pub.publish_stream(iter(big), 2, capacity_bytes=1024)  # reserve less than the stream needs
    client.close()


def test_streaming_apply_mode_bounds_memory_and_is_not_atomic(
    inprocess_coordinator: RunningServer, no_arena_leak: None
) -> None:
    rng = np.random.default_rng(0)
    params = {
        f"model.layers.{i}.mlp.up_proj.weight": rng.standard_normal((64, 256)).astype(np.float32) for i in range(6)
    }
    params["model.norm.weight"] = rng.standard_normal(256).astype(np.float32)
    client = CoordinatorClient(inprocess_coordinator.address)
    client.open_session("job", trainer=False)
    with WeightPublisher(
        PublisherSettings(coordinator=inprocess_coordinator.address, session="job", chunk_bytes=8192)
    ) as pub:
        client.register_agent("job", "r0", trainer=False, endpoint=pub.endpoint)
        applier = DictApplier()
        puller = WeightPuller(client, "job", "r0", window_chunks=2)
        pub.publish(params, 1)
        outcome = sync_version(puller, applier, 1, apply_mode="streaming")
        assert outcome.ok, outcome.mismatch
        assert puller._buffers == {}  # no whole-version receive buffer was ever allocated
        assert all(np.array_equal(applier.weights[k], v) for k, v in params.items())
        # a bad chunk late in the version: earlier groups are already live (documented)
        later = {k: v + 1 for k, v in params.items()}
        result = pub.publish(later, 2)
        entry = pub.table.entries()[result.slot]
        pub.arena.slot(result.slot)[entry.chunks[-1].offset] ^= 1
        outcome = sync_version(puller, applier, 2, apply_mode="streaming")
        assert not outcome.ok and "not atomic" in outcome.mismatch
        assert np.array_equal(
            applier.weights["model.layers.0.mlp.up_proj.weight"], later["model.layers.0.mlp.up_proj.weight"]
        )
        assert applier.version == 1
        puller.close()
    client.close()


@pytest.mark.parametrize(("host_id", "expected"), [("", "shm"), ("another-host", "tcp")])
def test_shm_transport_on_the_same_host_and_tcp_fallback(
    inprocess_coordinator: RunningServer, no_arena_leak: None, host_id: str, expected: str
) -> None:
    rng = np.random.default_rng(3)
    params = {
        f"model.layers.{i}.self_attn.q_proj.weight": rng.standard_normal((96, 64)).astype(np.float32) for i in range(3)
    }
    client = CoordinatorClient(inprocess_coordinator.address)
    client.open_session("job", trainer=False)
    with WeightPublisher(
        PublisherSettings(coordinator=inprocess_coordinator.address, session="job", chunk_bytes=8192)
    ) as pub:
        client.register_agent("job", "r0", trainer=False, endpoint=pub.endpoint)
        puller = WeightPuller(client, "job", "r0", mode="shm", host_id=host_id)
        for version in (1, 2, 3):  # slots alternate: the mapping is reused, the offset follows
            params = {k: v * 2 for k, v in params.items()}
            pub.publish(params, version)
            applier = DictApplier()
            outcome = sync_version(puller, applier, version)
            assert outcome.ok, outcome.mismatch
            assert all(np.array_equal(applier.weights[k], v) for k, v in params.items())
        _, manifest = client.get_manifest("job", 3)
        assert puller.transport_for(manifest.parts[0]) == expected
        assert manifest.parts[0].endpoint.shm_path == str(pub.arena.path)
        # shm too copies every byte into this process's receive buffer and verifies it there:
        # what is checked is what is applied, whatever writes to the trainer's arena later
        assert puller._buffers[0].nbytes >= manifest.parts[0].total_bytes
        if expected == "shm":  # a bad byte in the arena itself: refused, the engine keeps version 3
            result = pub.publish({k: v + 1 for k, v in params.items()}, 4)
            entry = pub.table.entries()[result.slot]
            pub.arena.slot(result.slot)[entry.chunks[1].offset + 3] ^= 0x10
            outcome = sync_version(puller, applier, 4)
            assert not outcome.ok and "chunk 1 digest mismatch" in outcome.mismatch and not outcome.transient
            assert applier.version == 3 and all(np.array_equal(applier.weights[k], v) for k, v in params.items())
        puller.close()
    client.close()


@pytest.mark.parametrize("kind", ["local", "memory"])
def test_fs_transport_needs_no_route_to_the_trainer_and_collects_old_versions(
    inprocess_coordinator: RunningServer, no_arena_leak: None, tmp_path: Path, kind: str
) -> None:
    import uuid

    from weightsync.transports.fs import FsStore

    root = str(tmp_path / "store") if kind == "local" else f"memory://ws-{uuid.uuid4().hex[:8]}"
    rng = np.random.default_rng(4)
    params = {
        f"model.layers.{i}.mlp.down_proj.weight": rng.standard_normal((64, 80)).astype(np.float32) for i in range(3)
    }
    client = CoordinatorClient(inprocess_coordinator.address)
    client.open_session("job", trainer=False)
    with WeightPublisher(
        PublisherSettings(coordinator=inprocess_coordinator.address, session="job", chunk_bytes=8192, fs_root=root)
    ) as pub:
        client.register_agent("job", "r0", trainer=False, endpoint=pub.endpoint)
        puller = WeightPuller(client, "job", "r0", mode="fs", fs_root=root)
        pub.server.stop(0)  # the trainer's chunk server is gone: only the store can serve
        publish_and_sync(pub, puller, params)
        assert FsStore(root).versions("job") == [2, 3]  # v1's slot was reused: its files are gone
        # A root that is not the trainer's store says so, not that the part is unfinished
        # ("has no _SUCCESS marker yet", which sent operators to look at the trainer).
        elsewhere = WeightPuller(client, "job", "r0", mode="fs", fs_root=root + "-elsewhere")
        bad = sync_version(elsewhere, DictApplier(), 3)
        assert not bad.ok and "does not exist here" in bad.mismatch and bad.transient
        FsStore(root + "-empty").fs.makedirs(FsStore(root + "-empty").root, exist_ok=True)
        empty = WeightPuller(client, "job", "r0", mode="fs", fs_root=root + "-empty")
        bad = sync_version(empty, DictApplier(), 3)
        assert not bad.ok and "is not under" in bad.mismatch and "shared with this host" in bad.mismatch
        store = FsStore(root)
        (marker,) = [p for p in store.fs.find(store.root) if p.endswith("/_SUCCESS") and "/v3/" in p]
        store.fs.rm(marker)
        bad = sync_version(puller, DictApplier(), 3)
        assert not bad.ok and "has no _SUCCESS marker" in bad.mismatch
        puller.close()
        elsewhere.close()
        empty.close()
    client.close()


def test_rollouts_without_a_mode_follow_the_sessions(inprocess_coordinator: RunningServer, no_arena_leak: None) -> None:
    params = {"model.norm.weight": np.arange(4096, dtype=np.float32)}
    client = CoordinatorClient(inprocess_coordinator.address)
    with WeightPublisher(
        PublisherSettings(coordinator=inprocess_coordinator.address, session="job", weight_sync_mode="shm")
    ) as pub:
        client.register_agent("job", "r0", trainer=False, endpoint=pub.endpoint)
        puller = WeightPuller(client, "job", "r0")  # no mode of its own
        pub.publish(params, 1)
        outcome = sync_version(puller, DictApplier(), 1)
        assert outcome.ok, outcome.mismatch
        header, manifest = client.get_manifest("job", 1)
        assert header.weight_sync_mode == "shm"
        assert puller.transport_for(manifest.parts[0], puller.plan(header).mode) == "shm"
        puller.close()
    client.close()


def test_a_failing_fs_store_is_a_retryable_error_not_a_crash(
    inprocess_coordinator: RunningServer, no_arena_leak: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store's own OSErrors (a full or broken disk, a part collected while a rollout
    read it, a network store's hiccup) escaped as exceptions: a trainer's publish crashed
    the sidecar instead of being retried. They are UNAVAILABLE (or RESOURCE_EXHAUSTED when
    full) naming fs_root, and nothing half-written is ever read; a write the store refuses
    until someone acts (a file where a directory must go, a read-only store) is
    FAILED_PRECONDITION, not tried again for publish_wait_s."""
    import errno

    from weightsync.errors import FailedPrecondition, TransportUnavailable

    root = tmp_path / "store"
    params = {"model.norm.weight": np.arange(4096, dtype=np.float32)}
    client = CoordinatorClient(inprocess_coordinator.address)
    client.open_session("job", trainer=False)
    settings = PublisherSettings(
        coordinator=inprocess_coordinator.address,
        session="job",
        chunk_bytes=8192,
        fs_root=str(root),
        publish_wait_s=0,  # the error itself, not `publish` riding it out
    )
    with WeightPublisher(settings) as pub:
        client.register_agent("job", "r0", trainer=False, endpoint=pub.endpoint)
        blocker = root / "job" / "v1"
        blocker.parent.mkdir(parents=True)
        blocker.write_bytes(b"")  # where the version's directory must go: every write under it fails
        with pytest.raises(FailedPrecondition, match="cannot write .* not writable") as refused:
            pub.publish(params, 1)
        assert refused.value.field == "fs_root"
        blocker.unlink()

        def broken(*args: object, **kwargs: object) -> None:
            raise OSError(errno.EIO, "Input/output error")

        with monkeypatch.context() as patch:
            patch.setattr(pub.fs_store.fs, "open", broken)  # fsspec's shared instance: undone below
            with pytest.raises(TransportUnavailable, match="cannot write") as failed:
                pub.publish(params, 1)
        assert failed.value.field == "fs_root"
        pub.publish(params, 1)  # the same version again, once the store works
        puller = WeightPuller(client, "job", "r0", mode="fs", fs_root=str(root))
        (part,) = (root / "job" / "v1" / "r0").glob("*/part.bin")
        part.unlink()  # collected while its marker still says ready
        gone = sync_version(puller, DictApplier(), 1)
        assert not gone.ok and "fs_root: cannot read" in gone.mismatch
        puller.close()
    client.close()


@pytest.mark.parametrize("same_trainer", [True, False], ids=["same-publisher", "new-incarnation"])
def test_a_refused_publish_leaves_the_stores_copy_of_that_version_intact(
    inprocess_coordinator: RunningServer, no_arena_leak: None, tmp_path: Path, same_trainer: bool
) -> None:
    """A publish of an existing version with other bytes is refused (ALREADY_EXISTS: a
    caller's mistake, or a trainer restarted from a checkpoint publishing its step again),
    and its fs copy, written first, goes beside the accepted version's part, never over it:
    a rollout that reads that version from the store gets the bytes its manifest describes
    (over it, DATA_LOSS for as long as the version is the newest)."""
    from weightsync.errors import VersionConflict
    from weightsync.transports.fs import FsStore

    root = str(tmp_path / "store")
    accepted = {"model.norm.weight": np.arange(4096, dtype=np.float32)}
    other = {"model.norm.weight": -np.arange(4096, dtype=np.float32)}
    client = CoordinatorClient(inprocess_coordinator.address)
    client.open_session("job", trainer=False)

    def publisher(incarnation: str) -> WeightPublisher:
        settings = PublisherSettings(
            coordinator=inprocess_coordinator.address,
            session="job",
            chunk_bytes=8192,
            fs_root=root,
            incarnation=incarnation,
            publish_wait_s=0,
        )
        return WeightPublisher(settings)

    with publisher("run-1") as first:
        client.register_agent("job", "r0", trainer=False, endpoint=first.endpoint)
        first.publish(accepted, 1)
        if same_trainer:
            with pytest.raises(VersionConflict):
                first.publish(other, 1)
    if not same_trainer:
        with publisher("run-2") as second, pytest.raises(VersionConflict):
            second.publish(other, 1)
    puller = WeightPuller(client, "job", "r0", mode="fs", fs_root=root)
    applier = DictApplier()
    outcome = sync_version(puller, applier, 1)
    assert outcome.ok, outcome.mismatch
    assert np.array_equal(applier.weights["model.norm.weight"], accepted["model.norm.weight"])
    assert FsStore(root).versions("job") == [1]
    # The refused copy is gone too: its bytes are no version's.
    assert len(list((tmp_path / "store" / "job" / "v1" / "r0").iterdir())) == 1
    puller.close()
    client.close()


def test_a_publish_refused_as_not_newer_leaves_nothing_in_the_store(
    inprocess_coordinator: RunningServer, no_arena_leak: None, tmp_path: Path
) -> None:
    """A trainer restarted from an older checkpoint publishes steps the session has passed:
    each is refused, and the whole copy of the model each wrote to the store first, under
    a version number the coordinator never held, is removed."""
    from weightsync.errors import FailedPrecondition
    from weightsync.transports.fs import FsStore

    root = str(tmp_path / "store")
    weights = {"model.norm.weight": np.arange(4096, dtype=np.float32)}
    settings = PublisherSettings(
        coordinator=inprocess_coordinator.address, session="job", chunk_bytes=8192, fs_root=root, publish_wait_s=0
    )
    with WeightPublisher(settings) as publisher:
        publisher.publish(weights, 5)
        with pytest.raises(FailedPrecondition, match="not newer"):
            publisher.publish({"model.norm.weight": weights["model.norm.weight"] + 1}, 3)
        assert FsStore(root).versions("job") == [5]
        publisher.publish({"model.norm.weight": weights["model.norm.weight"] + 2}, 6)  # its slot was freed
        assert FsStore(root).versions("job") == [5, 6]


def test_wsctl_deletes_a_finished_sessions_fs_store_directory_with_it(
    inprocess_coordinator: RunningServer, no_arena_leak: None, tmp_path: Path
) -> None:
    """DeleteSession cannot reach the store, so `wsctl delete-session --fs-root` removes the
    finished job's directory there (its last versions: a whole copy of the model per slot),
    and nothing of another session; a root it cannot use deletes nothing."""
    import json
    import subprocess
    import sys

    from weightsync.transports.fs import FsStore

    root = str(tmp_path / "store")
    weights = {"model.norm.weight": np.arange(4096, dtype=np.float32)}
    for session in ("job", "other-job"):
        settings = PublisherSettings(
            coordinator=inprocess_coordinator.address, session=session, chunk_bytes=8192, fs_root=root
        )
        with WeightPublisher(settings) as publisher:
            publisher.publish(weights, 1)
            publisher.publish({"model.norm.weight": weights["model.norm.weight"] + 1}, 2)
    wsctl = [sys.executable, "-m", "weightsync.cli", "--coordinator", inprocess_coordinator.address, "--json"]

    def delete(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*wsctl, "delete-session", *args], capture_output=True, text=True, timeout=60)

    refused = delete("job", "--force", "--fs-root", "bogus://bucket")  # a root it cannot use: nothing deleted
    assert refused.returncode == 2 and "fs_root" in refused.stderr
    with CoordinatorClient(inprocess_coordinator.address) as client:
        assert [v.version for v in client.status("job").versions] == [2, 1]
    done = delete("job", "--force", "--fs-root", root)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"versions": "2", "agents": 0, "fs_store_removed": True}
    store = FsStore(root)
    assert store.versions("job") == [] and store.versions("other-job") == [1, 2]
    again = delete("job", "--fs-root", root)  # nothing left of it anywhere
    assert again.returncode == 2 and "NOT_FOUND" in again.stderr
    # a session deleted before without --fs-root: its directory goes when named again
    assert delete("other-job", "--force").returncode == 0 and store.versions("other-job") == [1, 2]
    late = delete("other-job", "--fs-root", root)
    assert late.returncode == 0, late.stderr
    assert json.loads(late.stdout)["fs_store_removed"] is True and store.versions("other-job") == []
