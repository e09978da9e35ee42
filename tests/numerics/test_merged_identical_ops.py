"""A layer-norm train step planned for tpu-v5e on 2x4 (whose device model merges identical ops,
[collectives] merge-identical: the scale broadcast in the forward pass and again in the backward
pass is one decision) and run on 8 simulated CPU devices: the sharded step equals the
single-device one, with the merged ops' readers resharding from their one layout."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import hloplan
from hloplan.passes.build_sharding_problem import identical_key

pytestmark = pytest.mark.usefixtures("devices8")


def _loss(params, x):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    h = (x - mean) * jax.lax.rsqrt(var + 1e-5) * params["scale"] + params["offset"]
    h = jnp.tanh(h @ params["w"])
    return jnp.mean((h @ params["w"].T) ** 2)


def step(params, x):
    loss, grads = jax.value_and_grad(_loss)(params, x)
    return loss, jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)


def _args():
    keys = jax.random.split(jax.random.key(0), 3)
    params = {"scale": 1.0 + 0.1 * jax.random.normal(keys[0], (512,)),
              "offset": jnp.zeros((512,)),
              "w": jax.random.normal(keys[1], (512, 1024)) / 512**0.5}
    return params, jax.random.normal(keys[2], (16, 128, 512))


def test_merged_identical_ops_keep_the_step(tmp_path):
    args = _args()
    path = tmp_path / "step.jaxexport"
    path.write_bytes(export.export(jax.jit(step), platforms=("cpu", "tpu"))(*args).serialize())
    result = hloplan.compile(path, "2x4", output=tmp_path / "plan", device="tpu-v5e")
    state = result.state
    groups: dict = {}
    for op in state.graph.ops:
        key = identical_key(state.graph, op)
        if key is not None and op.index in state.space.strategies:
            groups.setdefault(key, []).append(op.index)
    merged = [ops for ops in groups.values() if len(ops) > 1]
    assert merged, "the step repeats an op"
    for ops in merged:
        assert len({state.chosen(i).results for i in ops}) == 1

    got = hloplan.load(tmp_path / "plan")(*args)
    expected = jax.jit(step)(*args)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
