"""The fs mode on real object-store protocols: s3:// through s3fs against moto's server and
gs:// through gcsfs against fake-gcs-server, each a process on 127.0.0.1, with the guarantees
a local disk gives (a part is read whole and verified or not at all, leftovers removed)."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from devtools.object_stores import Emulator, ObjectStore, emulators, missing_packages
from rollout_agent.engines.dict_applier import DictApplier
from rollout_agent.pull.puller import WeightPuller
from rollout_agent.sync.round import sync_version
from tests.integration.support import publish_and_sync
from trainer_agent.publish.publisher import WeightPublisher
from trainer_agent.settings import PublisherSettings
from weightsync.client import CoordinatorClient
from weightsync.errors import InvalidArgument
from weightsync.server import RunningServer
from weightsync.transports.fs_options import parse_fs_options

PROTOCOLS = ["s3", "gs"]


@pytest.fixture(scope="module")
def started(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Emulator]]:
    yield from emulators(PROTOCOLS, tmp_path_factory.mktemp("emulators"))


@pytest.fixture(params=PROTOCOLS)
def store(request: pytest.FixtureRequest, started: dict[str, Emulator]) -> Iterator[ObjectStore]:
    """A fresh bucket on the protocol's emulator; its proxy's faults cleared after."""
    if request.param not in started:
        pytest.skip(missing_packages(request.param))
    s = started[request.param].new_store()
    try:
        yield s
    finally:
        s.proxy.clear()


def _params(seed: int, n: int = 3, shape: tuple[int, int] = (64, 80)) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {f"model.layers.{i}.mlp.down_proj.weight": rng.standard_normal(shape).astype(np.float32) for i in range(n)}


def _settings(address: str, store: ObjectStore, **kw: object) -> PublisherSettings:
    return PublisherSettings(
        coordinator=address,
        session="job",
        chunk_bytes=8192,
        fs_root=store.root,
        fs_option=tuple(f"{k}={v}" for k, v in store.options.items()),
        **kw,  # type: ignore[arg-type]
    )


def _objects(store: ObjectStore) -> list[str]:
    fs = store.filesystem()
    return sorted(p[len(store.bucket) + 1 :] for p in fs.find(store.bucket))


@contextmanager
def _store_only(address: str, store: ObjectStore, **puller: Any) -> Iterator[tuple[WeightPublisher, WeightPuller]]:
    """A trainer publishing into `store` and rollout r0 pulling from it alone (the trainer's
    chunk server stopped); the puller and the client closed on the way out."""
    client = CoordinatorClient(address)
    client.open_session("job", trainer=False)
    try:
        with WeightPublisher(_settings(address, store)) as pub:
            client.register_agent("job", "r0", trainer=False, endpoint=pub.endpoint)
            rollout = WeightPuller(
                client, "job", "r0", mode="fs", fs_root=store.root, fs_options=_typed(store), **puller
            )
            pub.server.stop(0)  # the trainer's chunk server is gone: only the store can serve
            try:
                yield pub, rollout
            finally:
                rollout.close()
    finally:
        client.close()


def _typed(store: ObjectStore) -> dict[str, object]:
    return parse_fs_options([f"{k}={v}" for k, v in store.options.items()])


def test_publish_pull_and_verify_through_the_store_alone(
    inprocess_coordinator: RunningServer, no_arena_leak: None, store: ObjectStore
) -> None:
    with _store_only(inprocess_coordinator.address, store) as (pub, puller):
        publish_and_sync(pub, puller, _params(1))
        objects = _objects(store)
        assert {o.split("/")[2] for o in objects} == {"v2", "v3"}, objects  # v1's slot was reused
    wsctl = [sys.executable, "-m", "weightsync.cli", "--coordinator", inprocess_coordinator.address, "--json"]
    done = subprocess.run(
        [*wsctl, "delete-session", "job", "--force", "--fs-root", store.root, *store.cli_options()],
        env={**os.environ, **store.env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["fs_store_removed"] is True and _objects(store) == []


def _part_reads(store: ObjectStore, since: int) -> list[str]:
    """Requests since the `since`-th that read a part's bytes (a GET of part.bin)."""
    return [p for m, p in store.proxy.seen[since:] if m == "GET" and "part.bin" in urllib.parse.unquote(p)]


def test_a_corrupted_object_is_refused_and_a_part_without_its_marker_never_read(
    inprocess_coordinator: RunningServer, no_arena_leak: None, store: ObjectStore
) -> None:
    first, second = _params(2), _params(3)
    fs = store.filesystem()
    with _store_only(inprocess_coordinator.address, store) as (pub, puller):
        pub.publish(first, 1)
        applier = DictApplier()
        assert sync_version(puller, applier, 1).ok
        pub.publish(second, 2)
        (part,) = [p for p in fs.find(store.bucket) if "/v2/" in p and p.endswith("/part.bin")]
        data = bytearray(fs.cat_file(part))
        data[len(data) // 2] ^= 0x01  # one bit, rewritten whole: what a bad copy or a bad disk leaves
        fs.pipe_file(part, bytes(data))
        bad = sync_version(puller, applier, 2)
        assert not bad.ok and "digest" in bad.mismatch.lower(), bad.mismatch
        assert all(np.array_equal(applier.weights[k], v) for k, v in first.items())  # still version 1
        # The marker goes: the part is never read, even one byte of it.
        fs.rm(part.rsplit("/", 1)[0] + "/_SUCCESS")
        seen = len(store.proxy.seen)
        bad = sync_version(puller, applier, 2)
        assert not bad.ok and "has no _SUCCESS marker" in bad.mismatch and bad.transient, bad.mismatch
        assert _part_reads(store, seen) == []
        assert all(np.array_equal(applier.weights[k], v) for k, v in first.items())


def test_throttling_and_transient_5xx_are_ridden_out(
    inprocess_coordinator: RunningServer, no_arena_leak: None, store: ObjectStore
) -> None:
    params = _params(4)
    with _store_only(inprocess_coordinator.address, store) as (pub, puller):
        store.proxy.fail(1, 429, method="PUT" if store.protocol == "s3" else "POST")  # the part's upload
        store.proxy.fail(1, 503, method="PUT" if store.protocol == "s3" else "POST")
        pub.publish(params, 1)
        store.proxy.fail(1, 503, method="GET", path="part.bin")  # a chunk's ranged read
        store.proxy.fail(1, 429, method="GET", path="part.bin")
        applier = DictApplier()
        outcome = sync_version(puller, applier, 1)
        assert outcome.ok, outcome.mismatch
        assert all(np.array_equal(applier.weights[k], v) for k, v in params.items())
        assert [r.hits for r in store.proxy.rules] == [1, 1, 1, 1]  # every fault was met


def test_an_upload_killed_midway_leaves_nothing_to_read_and_the_next_publish_removes_it(
    inprocess_coordinator: RunningServer, no_arena_leak: None, store: ObjectStore
) -> None:
    block = 5 << 20  # S3's smallest multipart part; a multiple of GCS's 256 KiB
    size_option = {"s3": "default_block_size", "gs": "block_size"}[store.protocol]
    writer_options = [*store.cli_options(), "--fs-option", f"{size_option}={block}"]
    # The second block's upload is held: the first is in the store, the part is not whole.
    if store.protocol == "s3":
        held = store.proxy.stall(method="PUT", path="partNumber=2")
    else:  # gcsfs sends each block of a resumable upload to its session
        held = store.proxy.stall(method="POST", path="upload_id=", after=1)
    writer = subprocess.Popen(
        [sys.executable, "-m", "tests.integration.object_store_writer", "--root", store.root, *writer_options,
         "--bytes", str(3 * block)],
        env={**os.environ, **store.env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        assert held.wait(30), writer.communicate(timeout=5)[0] if writer.poll() is not None else "no upload held"
        writer.send_signal(signal.SIGKILL)
        assert writer.wait(10) == -signal.SIGKILL
    finally:
        if writer.poll() is None:
            writer.kill()
        writer.communicate(timeout=10)
        store.proxy.release()
    fs = store.filesystem()
    leftover = [p for p in fs.find(store.bucket) if "/job/v1/" in p]
    assert not any(p.endswith(("/_SUCCESS", "/part.bin")) for p in leftover), leftover
    from weightsync.transports.fs import FsStore

    writer_store = FsStore(store.root, _typed(store))
    pending = writer_store.pending_uploads(f"{store.bucket}/ws/job")
    if store.protocol == "s3":
        assert len(pending) == 1 and writer_store.versions("job") == [1]  # parts kept, and billed
    client = CoordinatorClient(inprocess_coordinator.address)
    client.open_session("job", trainer=False)
    with WeightPublisher(_settings(inprocess_coordinator.address, store)) as pub:
        pub.publish(_params(5), 2)  # the next publish: version 1 is no version the coordinator holds
    assert writer_store.pending_uploads(f"{store.bucket}/ws/job") == []
    assert [p for p in fs.find(store.bucket) if "/job/v1/" in p] == []
    assert writer_store.versions("job") == [2]
    client.close()


# s3 alone: gcsfs takes no secret as a string option (a token string is checked with
# Google's token service, off this host); its credentials come from a file it is named.
@pytest.mark.parametrize("store", ["s3"], indirect=True)
def test_a_secret_given_as_an_option_is_never_logged(
    inprocess_coordinator: RunningServer,
    no_arena_leak: None,
    store: ObjectStore,
    caplog: pytest.LogCaptureFixture,
    capfd: pytest.CaptureFixture[str],
) -> None:
    """Every logger at DEBUG (the clients' own included) through a publish, a pull, a store
    that fails for good, and a malformed option: the secret appears nowhere."""
    secret = "SENTINEL-s3cr3t-4f1c"  # moto takes any credential
    store.options = {**store.options, "secret": secret}
    caplog.set_level(logging.DEBUG)
    with _store_only(inprocess_coordinator.address, store) as (pub, puller):
        pub.publish(_params(6), 1)
        assert sync_version(puller, DictApplier(), 1).ok
        store.proxy.fail(1000, 403, method="GET", path="part.bin")
        bad = sync_version(puller, DictApplier(), 1)
        assert not bad.ok and secret not in bad.mismatch
        store.proxy.clear()
    with pytest.raises(InvalidArgument) as e:
        parse_fs_options([f"secret={secret}", f"secret={secret}"])
    assert secret not in str(e.value)
    assert secret not in caplog.text
    out, err = capfd.readouterr()
    assert secret not in out + err
    assert any("part.bin" in r.getMessage() or r.levelno >= logging.WARNING for r in caplog.records)  # it logged


def test_a_process_given_no_options_takes_endpoint_and_credentials_from_the_environment(
    store: ObjectStore, tmp_path: Path
) -> None:
    """AWS_ENDPOINT_URL and AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY (botocore's own chain),
    STORAGE_EMULATOR_HOST (gcsfs's): a writer with no --fs-option reaches the store."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "GOOGLE_", "STORAGE_EMULATOR"))}
    env |= store.env | {"HOME": str(tmp_path), "NO_GCE_CHECK": "true"}  # no ~/.aws, no metadata server
    seen = len(store.proxy.seen)
    cmd = [sys.executable, "-m", "tests.integration.object_store_writer", "--root", store.root, "--bytes", "4096"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    fs = store.filesystem()
    assert fs.cat_file(f"{store.bucket}/ws/job/v1/r0/0123456789abcdef/part.bin") == bytes(range(256)) * 16
    assert fs.exists(f"{store.bucket}/ws/job/v1/r0/0123456789abcdef/_SUCCESS")
    assert len(store.proxy.seen) > seen  # through the endpoint the environment named


def test_a_lanes_chunks_are_read_concurrently(
    inprocess_coordinator: RunningServer, no_arena_leak: None, store: ObjectStore
) -> None:
    """One lane (streams=1): each ranged GET is held 50 ms by the proxy, and a fetch call's
    chunks overlap (bounded by RANGES_IN_FLIGHT)."""
    from weightsync.transports.fs import RANGES_IN_FLIGHT

    params = _params(7, n=4, shape=(128, 256))  # 512 KiB: 64 chunks of 8 KiB
    with _store_only(inprocess_coordinator.address, store, streams=1, window_chunks=16) as (pub, puller):
        pub.publish(params, 1)
        store.proxy.delay_s = 0.05
        applier = DictApplier()
        outcome = sync_version(puller, applier, 1)
        assert outcome.ok, outcome.mismatch
        assert all(np.array_equal(applier.weights[k], v) for k, v in params.items())
        assert 1 < store.proxy.max_in_flight <= RANGES_IN_FLIGHT
