"""A GroupNorm step planned for tpu-v5e on 2x4, whose elementwise ops, reshapes and broadcasts
the emitted module leaves to XLA's propagation where their operands imply their layout
(propagate-sharding's constrain_implied; libtpu compiles every constraint as a copy): run on 8
simulated CPU devices, the sharded step equals the single-device one, with fewer constraints
than the module constraining every result and the same collectives."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import hloplan
from hloplan.compiler import compile_bytes, make_options
from hloplan.hlo_stats import collective_stats
from hloplan.passes.propagate_sharding import PropagateSharding
from hloplan.passmanager import pass_pipeline

pytestmark = pytest.mark.usefixtures("devices8")


def _loss(params, x):
    h = jnp.tanh(x @ params["w1"])  # [batch, tokens, 256]
    grouped = h.reshape(*h.shape[:-1], 8, 32)  # GroupNorm over 8 groups
    mean = grouped.mean(-1, keepdims=True)
    var = ((grouped - mean) ** 2).mean(-1, keepdims=True)
    h = ((grouped - mean) * jax.lax.rsqrt(var + 1e-5)).reshape(h.shape) * params["scale"]
    return jnp.mean((h @ params["w2"]) ** 2)


def step(params, x):
    loss, grads = jax.value_and_grad(_loss)(params, x)
    return loss, jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)


def _args():
    keys = jax.random.split(jax.random.key(0), 4)
    params = {"scale": 1.0 + 0.1 * jax.random.normal(keys[0], (256,)),
              "w1": jax.random.normal(keys[1], (128, 256)) / 128**0.5,
              "w2": jax.random.normal(keys[2], (256, 128)) / 256**0.5}
    return params, jax.random.normal(keys[3], (16, 64, 128))


def _plan(data: bytes, constrain_implied):
    passes = [dataclasses.replace(p, constrain_implied=constrain_implied)
              if isinstance(p, PropagateSharding) else p for p in pass_pipeline()]
    return compile_bytes(data, "step.jaxexport", make_options("2x4", device="tpu-v5e"),
                         passes=passes)


def test_implied_layouts_are_left_to_propagation(tmp_path):
    args = _args()
    data = export.export(jax.jit(step), platforms=("cpu", "tpu"))(*args).serialize()
    left = _plan(data, None)  # tpu-v5e: implied results unconstrained
    every = _plan(data, True)
    assert [d["chosen"] for d in left.plan["decisions"]] == \
        [d["chosen"] for d in every.plan["decisions"]]
    assert left.state.facts["implied_results"] > 10
    assert every.state.facts["implied_results"] == 0
    assert left.state.facts["result_constraints"] + left.state.facts["implied_results"] == \
        every.state.facts["result_constraints"]

    runs = {}
    for name, result in (("left", left), ("every", every)):
        result.write(tmp_path / name)
        runner = hloplan.load(tmp_path / name)
        runs[name] = runner(*args)
        text = jax.jit(runner).lower(*args).compile().as_text()
        runs[name + "_collectives"] = sorted(
            (op.kind, op.axes, op.bytes_sent) for op in collective_stats(
                text, mesh_axes=[("x", 2), ("y", 4)]).ops)
    assert runs["every_collectives"]  # the batch-split step all-reduces its gradients
    assert runs["left_collectives"] == runs["every_collectives"]
    expected = jax.jit(step)(*args)
    for a, b in zip(jax.tree.leaves(runs["left"]), jax.tree.leaves(expected)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


def test_rematerialized_step_keeps_its_barrier_results_constrained(tmp_path):
    """jax.checkpoint's optimization barrier is one MLIR op with several results, each its own
    graph op: those results are constrained by their index in the MLIR op."""
    args = _args()
    remat = jax.checkpoint(_loss)

    def remat_step(params, x):
        loss, grads = jax.value_and_grad(remat)(params, x)
        return loss, jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

    data = export.export(jax.jit(remat_step), platforms=("cpu", "tpu"))(*args).serialize()
    result = _plan(data, None)
    graph = result.state.graph
    assert any(op.name == "barrier.result" for op in graph.ops)
    assert result.state.facts["implied_results"] > 0
    result.write(tmp_path / "plan")
    got = hloplan.load(tmp_path / "plan")(*args)
    expected = jax.jit(remat_step)(*args)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


def _update(w, m, v, x, dy):
    g = jnp.einsum("tf,td->fd", dy, x).T  # a weight gradient made as [F, D] for a [D, F] weight
    m = m + (g - m) * 0.1
    v = v + (g * g - v) * 0.001
    return w - 0.01 * m / (jnp.sqrt(v) + 1e-7), m, v


def test_a_transposed_gradient_pinned_after_its_transpose_runs_as_planned(tmp_path):
    """On TPU device models a result only a transpose reads is pinned after the transpose
    (propagate-sharding._only_transposed): the sharded step still equals the single-device
    one."""
    keys = jax.random.split(jax.random.key(1), 5)
    d, f, t = 64, 128, 512
    args = (jax.random.normal(keys[0], (d, f)), 0.1 * jax.random.normal(keys[1], (d, f)),
            jnp.abs(jax.random.normal(keys[2], (d, f))), jax.random.normal(keys[3], (t, d)),
            jax.random.normal(keys[4], (t, f)))
    data = export.export(jax.jit(_update), platforms=("cpu", "tpu"))(*args).serialize()
    result = _plan(data, None)
    assert result.state.facts["pinned_after_transpose"] == 1
    assert _plan(data, True).state.facts["pinned_after_transpose"] == 0
    result.write(tmp_path / "plan")
    got = hloplan.load(tmp_path / "plan")(*args)
    for a, b in zip(got, jax.jit(_update)(*args)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
