"""Reduce-scatter forms of a partial-sum strategy (strategies._scatter_variants): onto an
unsharded dim over the reduced axes, and onto a dim already split, the reduced axes after its
own (whatever the mesh order), as libtpu compiles an all-reduce whose reader slices it there."""

from __future__ import annotations

import pytest

from hloplan.cost_models import CommModel
from hloplan.cost_models.hardware import load_device_model
from hloplan.graph import TensorType
from hloplan.mesh import parse_mesh
from hloplan.op_rules import Factor, OpRule
from hloplan.strategies import enumerate_strategies

TOKENS, VOCAB, WIDTH = 4096, 50257, 768  # hf_gpt2's output head: no axis divides the vocabulary


def _head_gradient(comm):
    """dE[v, d] = G[t, v]^T H[t, d]: the contraction t, then v (lhs) and d (rhs)."""
    rule = OpRule(factors=(Factor(TOKENS, "reduce"), Factor(VOCAB), Factor(WIDTH)),
                  operands=(((0,), (1,)), ((0,), (2,))), results=(((1,), (2,)),),
                  flops=2.0 * TOKENS * VOCAB * WIDTH, matmul=(((1,), 1), ((0,), 1), ((2,), 1)))
    return enumerate_strategies(rule, [TensorType((TOKENS, VOCAB), "f32"),
                                       TensorType((TOKENS, WIDTH), "f32")],
                                [TensorType((VOCAB, WIDTH), "f32")], comm.mesh, comm)


@pytest.fixture
def comm():
    return CommModel(load_device_model("tpu-v5e"), parse_mesh("x=2,y=4"))


def test_scatter_onto_a_split_dim_in_either_mesh_order(comm):
    strategies = {(s.results, s.reduced_axes): s for s in _head_gradient(comm)}
    # d split over y, the tokens over x: all-reduce over x, or reduce-scatter it onto d after y.
    reduced = strategies[((((), (1,)),), (0,))]
    scattered = strategies[((((), (1, 0)),), (0,))]
    assert [c[0] for c in reduced.collectives] == ["all-reduce"]
    assert [c[0] for c in scattered.collectives] == ["reduce-scatter"]
    # Half the bytes: (n-1)/n of the partial sums, not 2(n-1)/n.
    assert scattered.collectives[0][2] == pytest.approx(reduced.collectives[0][2] / 2)
    assert scattered.communication < reduced.communication
    assert scattered.memory == pytest.approx(reduced.memory / 2)
    # In mesh order: d split over x, the tokens over y, reduce-scattered onto d after x.
    assert ((((), (0, 1)),), (1,)) in strategies
    # Not onto the vocabulary, which no axis divides.
    assert not any(s.results[0][0] for s in strategies.values())


def test_reorder_after_the_scatter_is_priced(comm):
    # Read in mesh order, the [-, (y, x)] result is permuted; the [-, y] one too (each
    # device's slice of its block is another device's shard).
    shard = VOCAB * WIDTH * 4 / 8
    for src in (((), (1, 0)), ((), (1,))):
        cost = comm.reshard((VOCAB, WIDTH), 4, src, ((), (0, 1)))
        assert cost.collectives == (("collective-permute", (0, 1), shard),)
