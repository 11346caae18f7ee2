"""The stand-in trainer's model: what its init and steps compute, and the device memory
they need at the large presets (compiled for their shapes, nothing allocated)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import jaxpr_as_fun

from trainer_agent import synthetic

CHIP_BYTES = 16 << 30  # a TPU v5e chip's HBM
ROOM_BYTES = 6 << 30  # what the runtime and the publisher's staging need of it besides
PIECE_BYTES = 128 << 20  # a piece's noise (16 MiB of fp32) and the temporaries of drawing it


def _extra_bytes(fn: Callable[..., Any], *args: Any) -> int:
    """The most device memory any jitted call of `fn(*args)` needs beyond its inputs:
    temporaries and the outputs its donated inputs do not hold, from each distinct call
    compiled for the shapes alone."""
    worst = 0
    seen: set[int] = set()
    for eqn in jax.make_jaxpr(fn)(*args).eqns:
        closed = eqn.params.get("jaxpr")
        if eqn.primitive.name not in ("jit", "pjit") or id(closed) in seen:
            continue
        seen.add(id(closed))
        donated = tuple(i for i, d in enumerate(eqn.params["donated_invars"]) if d)
        shapes = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in closed.jaxpr.invars]
        m = jax.jit(jaxpr_as_fun(closed), donate_argnums=donated).lower(*shapes).compile().memory_analysis()
        worst = max(worst, m.temp_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes)
    return worst


@pytest.mark.parametrize(("preset", "dtype", "leaves"), [("1.7b", "float32", 0), ("4b", "bfloat16", 1)])
def test_a_large_preset_inits_and_steps_in_its_own_bytes_and_one_piece(preset: str, dtype: str, leaves: int) -> None:
    """Beyond the model, no call of init or step needs more than one piece's noise and
    temporaries (and on the CPU, which copies a bf16 leaf it updates by rows, that leaf):
    4b trains on a 16 GB chip with room to stage what it publishes."""
    params = jax.eval_shape(lambda: synthetic.initial_params(preset))
    model = sum(p.size * p.dtype.itemsize for p in params.values())
    bound = PIECE_BYTES + leaves * max(p.size * p.dtype.itemsize for p in params.values())
    for what, extra in (
        ("init", _extra_bytes(lambda: synthetic.initial_params(preset))),
        ("step", _extra_bytes(lambda p: synthetic.train_step(p, 1), params)),
    ):
        assert extra <= bound, f"{what}: {extra / 1e9:.2f} GB beyond the model's {model / 1e9:.2f} GB"
    assert {str(p.dtype) for p in params.values()} == {dtype}
    assert model + bound <= CHIP_BYTES - ROOM_BYTES


def test_master_dtypes() -> None:
    assert {p: str(synthetic.master_dtype(p)) for p in synthetic.PRESETS} == {
        **dict.fromkeys(synthetic.PRESETS, "float32"),
        "4b": "bfloat16",
    }


def test_steps_are_deterministic_move_every_leaf_and_consume_their_input() -> None:
    a = synthetic.initial_params("tiny", 3)
    b = synthetic.initial_params("tiny", 3)
    assert list(a) == list(synthetic.param_shapes(synthetic.PRESETS["tiny"]))
    assert all(v.dtype == jnp.float32 and np.array_equal(v, b[k]) for k, v in a.items())
    before = {k: np.array(v) for k, v in a.items()}
    a = synthetic.train_step(a, 1, 3, 1e-2)
    assert not any(v.is_deleted() for v in b.values())
    b_stepped = synthetic.train_step(dict(reversed(b.items())), 1, 3, 1e-2)  # any dict order draws alike
    assert all(old.is_deleted() for old in b.values())  # donated
    for k, v in a.items():
        assert np.array_equal(v, b_stepped[k]), k
        assert np.all(np.asarray(v) != before[k]), k
        assert abs(float(np.std(np.asarray(v) - before[k])) - 1e-2) < 4e-3, k
    after = synthetic.params_after("tiny", 3, 1, 1e-2)
    assert all(np.array_equal(v, a[k]) for k, v in after.items())


def test_bf16_masters_start_as_the_fp32_ones_rounded_and_stay_bf16() -> None:
    fp32 = synthetic.initial_params("tiny", 0)
    bf16 = synthetic.initial_params("tiny", 0, jnp.bfloat16)
    for k, v in bf16.items():
        assert v.dtype == jnp.bfloat16 and np.array_equal(v, fp32[k].astype(jnp.bfloat16)), k
    embed = np.asarray(bf16["model.embed_tokens.weight"], np.float32)
    stepped = synthetic.train_step(bf16, 1)
    assert all(v.dtype == jnp.bfloat16 for v in stepped.values())
    assert np.mean(np.asarray(stepped["model.embed_tokens.weight"], np.float32) != embed) > 0.5


def test_a_large_leaf_is_drawn_block_by_block_of_whole_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(synthetic, "BLOCK", 128)
    shapes = {"b": (5,), "a": (70, 8), "c": (3, 4)}
    assert list(synthetic._pieces(shapes, 128)) == [
        *((("a",), start, 16) for start in range(0, 64, 16)),
        (("a",), 64, 6),
        (("b", "c"), 0, 0),
    ]
    for dtype in (jnp.float32, jnp.bfloat16):
        out = synthetic.train_step(_zeros(shapes, dtype), 1, lr=-1.0)  # the noise itself
        a = np.asarray(out["a"], np.float32)
        assert np.all(a != 0) and abs(float(a.mean())) < 0.15 and 0.85 < float(a.std()) < 1.15
        blocks = [a[i : i + 16] for i in range(0, 70, 16)]  # each its own draw
        assert all(not np.array_equal(b[:6], blocks[0][:6]) for b in blocks[1:])
        again = synthetic.train_step(_zeros(shapes, dtype), 1, lr=-1.0)
        assert all(np.array_equal(v, again[k]) for k, v in out.items())


def _zeros(shapes: dict[str, tuple[int, ...]], dtype: Any) -> dict[str, jax.Array]:
    return {k: jnp.zeros(s, dtype) for k, s in shapes.items()}
