"""Identical ops (same name, operands and attributes) that libtpu merges before partitioning
(device model [collectives] merge-identical): one decision for both, so the copy's readers
reshard from the layout the first is made in, as libtpu compiles them (a haiku train step's
layer-norm scale, broadcast in the forward pass and again in the backward pass)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import export

import hloplan
from hloplan.passes.build_sharding_problem import identical_key


def _step(x, y, scale, w):
    # The same broadcast twice (as a layer norm's forward and backward passes make it), one
    # read with x's rows, one with y's transposed rows.
    a = jnp.tanh(x * jnp.broadcast_to(scale, x.shape)) @ w
    b = jnp.tanh(y.T * jnp.broadcast_to(scale, x.shape)) @ w
    return a, b


def _plan(device):
    s = jax.ShapeDtypeStruct
    data = export.export(jax.jit(_step))(s((256, 512), jnp.float32), s((512, 256), jnp.float32),
                                         s((512,), jnp.float32),
                                         s((512, 512), jnp.float32)).serialize()
    return hloplan.compile(data, "2x4", device=device, mesh_views="off").state


def _broadcasts(state):
    graph = state.graph
    found = [op for op in graph.ops if op.name == "stablehlo.broadcast_in_dim"
             and graph.type_of(op.results[0]).shape == (256, 512)]
    assert len(found) == 2
    return found


def test_identical_ops_share_one_decision_where_libtpu_merges_them():
    state = _plan("tpu-v5e")
    first, second = _broadcasts(state)
    assert identical_key(state.graph, first) == identical_key(state.graph, second) is not None
    nodes = [state.problem.nodes[state.space.node_of[op.index]] for op in (first, second)]
    assert nodes[0].tie is not None and nodes[0].tie == nodes[1].tie
    assert state.chosen(first.index).results == state.chosen(second.index).results


def test_apart_where_the_compiler_does_not_merge():
    state = _plan("cpu")  # XLA's CPU compiler keeps both, each in its own layout
    first, second = _broadcasts(state)
    nodes = [state.problem.nodes[state.space.node_of[op.index]] for op in (first, second)]
    assert nodes[0].tie is None or nodes[0].tie != nodes[1].tie


def test_only_ops_the_graph_records_whole():
    state = _plan("tpu-v5e")
    graph = state.graph
    keys = [identical_key(graph, op) for op in graph.ops]
    # arguments and ops with no operands are not merged
    assert all(k is None for op, k in zip(graph.ops, keys) if not op.operands)
    # different operands: different keys
    dots = [op for op in graph.ops if op.name == "stablehlo.dot_general"]
    assert identical_key(graph, dots[0]) != identical_key(graph, dots[1])
