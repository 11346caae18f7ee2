"""The fs mode on real object-store protocols: s3:// through s3fs against moto's server and
gs:// through gcsfs against fake-gcs-server, each a process on 127.0.0.1, with the guarantees
a local disk gives (a part is read whole and verified or not at all, leftovers removed)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from rollout_agent.appliers import DictApplier
from rollout_agent.puller import WeightPuller
from rollout_agent.sync import sync_version
from tests.integration.object_stores import Emulator, ObjectStore, emulators, missing_packages
from trainer_agent.publisher import WeightPublisher
from trainer_agent.settings import PublisherSettings
from weightsync.client import CoordinatorClient
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


def test_publish_pull_and_verify_through_the_store_alone(
    inprocess_coordinator: RunningServer, no_arena_leak: None, store: ObjectStore
) -> None:
    client = CoordinatorClient(inprocess_coordinator.address)
    client.open_session("job", trainer=False)
    params = _params(1)
    with WeightPublisher(_settings(inprocess_coordinator.address, store)) as pub:
        client.register_agent("job", "r0", trainer=False, endpoint=pub.endpoint)
        puller = WeightPuller(
            client,
            "job",
            "r0",
            mode="fs",
            fs_root=store.root,
            fs_options=parse_fs_options([f"{k}={v}" for k, v in store.options.items()]),
        )
        pub.server.stop(0)  # the trainer's chunk server is gone: only the store can serve
        for version in (1, 2, 3):
            params = {k: v + 1 for k, v in params.items()}
            pub.publish(params, version)
            applier = DictApplier()
            outcome = sync_version(puller, applier, version)
            assert outcome.ok, outcome.mismatch
            assert all(np.array_equal(applier.weights[k], v) for k, v in params.items())
        puller.close()
        objects = _objects(store)
        assert {o.split("/")[2] for o in objects} == {"v2", "v3"}, objects  # v1's slot was reused
    client.close()
