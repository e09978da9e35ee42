"""benchmarks/hand_plans.py's data-parallel and FSDP plans for a program known only by its
single-device export (the corpus's hand baselines on TPU): the shardings they give, and the
sharded program's result on 8 CPU devices against the single-device one."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import hand_plans  # noqa: E402


def _step(state, batch):
    """A keras-style step: (state, batch) -> (loss, new state), the state a dict and a list."""
    params, moments = state
    x, y = batch

    def loss_fn(p):
        h = jnp.tanh(x @ p["w1"] + p["b1"])
        return jnp.mean((h @ p["w2"] - y) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    moments = [0.9 * m + g for m, g in zip(moments, jax.tree.leaves(grads))]
    params = jax.tree.map(lambda p, m: p - 0.1 * m, params, jax.tree.unflatten(
        jax.tree.structure(params), moments))
    return loss, (params, moments)


def _example():
    rng = np.random.default_rng(0)
    params = {"b1": rng.standard_normal(24, dtype=np.float32),
              "w1": rng.standard_normal((16, 24), dtype=np.float32),
              "w2": rng.standard_normal((24, 4), dtype=np.float32)}
    moments = [np.zeros_like(v) for v in jax.tree.leaves(params)]
    batch = (rng.standard_normal((32, 16), dtype=np.float32),
             rng.standard_normal((32, 4), dtype=np.float32))
    return (params, moments), batch


def test_dp_and_fsdp_shardings_and_results(devices8):
    state, batch = _example()
    exported = jax.export.export(jax.jit(_step, donate_argnums=(0,)))(state, batch)
    mesh = jax.make_mesh((2, 4), ("x", "y"), devices=devices8)
    plans = hand_plans.exported_plans(exported, (0,), mesh)
    assert set(plans) == {"dp", "fsdp"}

    dp_in, dp_out = plans["dp"]
    assert all(s.spec == P() for s in jax.tree.leaves(dp_in[0]))
    assert [s.spec for s in jax.tree.leaves(dp_in[1])] == [P(("x", "y"))] * 2
    fsdp_in, fsdp_out = plans["fsdp"]
    # b1 (24) and w1's 24 columns divide by 8, w2's 24 rows too; each on its largest such dim
    assert [s.spec for s in jax.tree.leaves(fsdp_in[0][0])] == [
        P(("x", "y")), P(None, ("x", "y")), P(("x", "y"), None)]
    # the loss comes first and is replicated; the new state keeps the state's shardings
    assert fsdp_out[0].spec == P()
    assert [s.spec for s in jax.tree.leaves(fsdp_out[1])] == \
        [s.spec for s in jax.tree.leaves(fsdp_in[0])]

    expected = _step(state, batch)
    for name, shardings in plans.items():
        compiled = hand_plans.compile_exported_plan(exported, (0,), shardings)
        placed = jax.device_put((state, batch), shardings[0])
        got = compiled(*placed)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5,
                                       err_msg=name)
