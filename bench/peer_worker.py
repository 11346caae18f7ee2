"""One process of a peer method in the transfer benchmark, driven over stdin/stdout.

    python bench/peer_worker.py METHOD ROLE RANK N SIZE PORT PATH

Prints one JSON line when ready ({"baseline_rss": ...}); then for each "go" line runs
one transfer and prints {"t_end": ..., "ok": ...}; "quit" prints {"peak_rss": ...}.
Methods: safetensors and orbax (readers of a checkpoint the driver writes under PATH),
gloo (torch.distributed broadcast, rank 0 sends), jax_transfer
(jax.experimental.transfer: rank 0 serves, readers pull). Readers keep nothing between
rounds unless the method itself reuses memory (gloo receives into one buffer).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import model, model_bytes, peak_rss_bytes, rss_bytes, shapes  # noqa: E402


def say(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def main() -> None:
    method, role, rank, n, size, port, path = sys.argv[1:8]
    rank, n, port = int(rank), int(n), int(port)
    baseline = rss_bytes()
    step = make_step(method, role, rank, n, size, port, path)
    say(baseline_rss=baseline, **getattr(step, "ready_info", {}))
    for line in sys.stdin:
        cmd = line.split()
        if not cmd or cmd[0] == "quit":
            break
        ok = step(int(cmd[1]))
        say(t_end=time.time(), ok=bool(ok))
    say(peak_rss=peak_rss_bytes(), baseline_rss=baseline)


def make_step(method: str, role: str, rank: int, n: int, size: str, port: int, path: str):  # noqa: ANN201
    nbytes = model_bytes(size)
    if method == "safetensors":
        from safetensors.numpy import load_file

        def step(it: int) -> bool:
            tensors = load_file(f"{path}/v{it}.safetensors")
            return sum(t.nbytes for t in tensors.values()) == nbytes

        return step
    if method == "orbax":
        import jax
        import orbax.checkpoint as ocp

        ckpt = ocp.StandardCheckpointer()
        abstract = {k: jax.ShapeDtypeStruct(s, jax.numpy.bfloat16) for k, s in shapes(size).items()}

        def step(it: int) -> bool:
            tree = ckpt.restore(f"{path}/v{it}", abstract)
            jax.block_until_ready(tree)
            return sum(v.nbytes for v in tree.values()) == nbytes

        return step
    if method == "gloo":
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n + 1)
        if rank == 0:
            flat = np.concatenate([v.view(np.uint8).reshape(-1) for v in model(size).values()])
            buf = torch.from_numpy(flat)
        else:
            buf = torch.empty(nbytes, dtype=torch.uint8)
            buf.fill_(0)  # populated once, reused every round

        def step(it: int) -> bool:
            dist.barrier()
            dist.broadcast(buf, src=0)
            return buf.numel() == nbytes

        return step
    if method == "jax_transfer":
        import jax
        from jax.experimental import transfer

        dev = jax.devices()[0]
        server = transfer.start_transfer_server(dev.client, "127.0.0.1:0", ["127.0.0.1:0"])
        if rank == 0:
            arrays = [jax.device_put(v, dev) for v in model(size).values()]
            jax.block_until_ready(arrays)

            def step(it: int) -> bool:  # arm one pull per reader for this round
                for r in range(1, n + 1):
                    server.await_pull(it * 1000 + r, arrays)
                return True

            step.ready_info = {"address": server.address()}  # type: ignore[attr-defined]
            return step
        sharding = jax.sharding.SingleDeviceSharding(dev)
        specs = [jax.ShapeDtypeStruct(s, jax.numpy.bfloat16, sharding=sharding) for s in shapes(size).values()]
        conn = server.connect(path)  # path: the sender's address

        def step(it: int) -> bool:
            out = conn.pull(it * 1000 + rank, specs)
            jax.block_until_ready(out)
            return sum(a.nbytes for a in out) == nbytes

        return step
    raise SystemExit(f"unknown method {method!r}")


if __name__ == "__main__":
    main()
