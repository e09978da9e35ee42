"""Composites, decomposition functions and custom_calls survive every pass and re-parse.

jax emits jax.lax.top_k as a `stablehlo.composite "chlo.top_k"` whose decomposition is the
private function @chlo.top_k.impl; jnp.linalg.cholesky as a LAPACK custom_call; jax.lax.composite a user's own composite. The planned
module keeps them (the composite one op, its decomposition function beside it) and the plan,
compiled on 8 simulated devices, gives the single-device result: as one program, and cut into
pipeline stages and microbatches (where each composite becomes its decomposition's ops).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import hloplan
from fixtures import moe_topk
from hloplan.compiler import PipelineOptions

pytestmark = pytest.mark.usefixtures("devices8")


def _scaled_tanh(x, *, scale):
    return jnp.tanh(x) * scale


def misc(x, w):
    logits = x @ w
    # A user's own composite (its decomposition a private function, called twice).
    scaled = jax.lax.composite(_scaled_tanh, name="test.scaled_tanh")
    logits = scaled(logits, scale=0.5) + scaled(logits, scale=0.25)
    values, indices = jax.lax.top_k(logits, 2)
    inv = jax.scipy.special.erfinv(jnp.tanh(values) * 0.5)
    gram = x[:4, :4] @ x[:4, :4].T + 4 * jnp.eye(4)
    approx, _ = jax.lax.approx_max_k(logits, 2)  # a custom_call with a called computation
    return (inv * 2.0, indices, jnp.linalg.cholesky(gram), jnp.sort(logits, axis=-1),
            jax.lax.erf_inv(jnp.tanh(logits) * 0.25), approx)


@pytest.fixture(scope="module")
def misc_program():
    x = jax.random.normal(jax.random.PRNGKey(0), (16, 8))
    w = jax.random.normal(jax.random.PRNGKey(1), (8, 4))
    exported = export.export(jax.jit(misc))(x, w)
    text = exported.mlir_module()
    assert 'stablehlo.composite "chlo.top_k"' in text and "custom_call @lapack" in text
    assert 'stablehlo.composite "test.scaled_tanh"' in text
    return exported.serialize(), (x, w), jax.jit(misc)(x, w)


@pytest.fixture(scope="module")
def moe_program():
    params = moe_topk.concrete(moe_topk.params_spec())
    x, y = moe_topk.concrete(moe_topk.batch_spec(), seed=1)
    exported = export.export(jax.jit(moe_topk.train_step))(params, x, y)
    return exported.serialize(), (params, x, y), jax.jit(moe_topk.train_step)(params, x, y)


@pytest.mark.parametrize("mesh", ["1", "8", "2x4"])
def test_composite_and_custom_call_survive(misc_program, tmp_path, helpers, mesh):
    data, args, expected = misc_program
    result = hloplan.compile(data, mesh, output=tmp_path / "plan", device="toy")
    module = (tmp_path / "plan" / "module.mlir").read_text()
    assert 'stablehlo.composite "chlo.top_k"' in module
    assert "func.func private @chlo.top_k.impl" in module
    assert module.count('stablehlo.composite "test.scaled_tanh"') == 2
    assert "stablehlo.custom_call @lapack" in module
    assert "custom_call @ApproxTopK" in module and "@top_k_gt_f32_comparator(" in module
    assert result.plan["mesh"]
    helpers.assert_trees_close(hloplan.load(tmp_path / "plan")(*args), expected)


@pytest.mark.parametrize("mesh", ["8", "2x4"])
def test_top_k_routed_moe_train_step(moe_program, tmp_path, helpers, mesh):
    data, args, expected = moe_program
    hloplan.compile(data, mesh, output=tmp_path / "plan", device="toy")
    module = (tmp_path / "plan" / "module.mlir").read_text()
    assert module.count('stablehlo.composite "chlo.top_k"') == 2  # one per layer
    helpers.assert_trees_close(hloplan.load(tmp_path / "plan")(*args), expected)


def test_top_k_routed_moe_pipelined(moe_program, tmp_path, helpers):
    data, args, expected = moe_program
    result = hloplan.compile(data, "8", output=tmp_path / "plan", device="toy",
                             pipeline=PipelineOptions(2, 4, "gpipe"))
    assert (result.plan["pipeline"]["stages"], result.plan["pipeline"]["microbatches"]) == (2, 4)
    got = hloplan.load(tmp_path / "plan")(*args)
    helpers.assert_trees_close(jax.tree.map(np.asarray, got), expected)


def test_top_k_routed_moe_through_hloplan_shard(moe_program, helpers):
    """The in-process API on the same step: its shardings split the experts (or tokens), and
    jax.jit with them gives the single-device step."""
    _, args, expected = moe_program
    mesh = jax.sharding.Mesh(np.array(jax.devices("cpu")[:8]).reshape(2, 4), ("data", "expert"),
                             axis_types=(jax.sharding.AxisType.Auto,) * 2)
    planned = hloplan.shard(moe_topk.train_step, *args, mesh=mesh, device="toy")
    assert any(s.spec != jax.sharding.PartitionSpec()
               for s in jax.tree.leaves(planned.in_shardings))
    helpers.assert_trees_close(jax.tree.map(np.asarray, planned(*args)), expected)
