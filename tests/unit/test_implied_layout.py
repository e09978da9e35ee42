"""propagate-sharding's implied_layout: the result layouts XLA's propagation derives from the
operands' alone (those results are left unconstrained on TPU device models)."""

from __future__ import annotations

from types import SimpleNamespace

from hloplan.passes.propagate_sharding import implied_layout

X, Y = (0,), (1,)


def _op(name, **attrs):
    return SimpleNamespace(name=name, attrs=attrs)


def test_elementwise_takes_its_operands_one_layout():
    add = _op("stablehlo.add")
    assert implied_layout(add, [((8, 4), (X, ())), ((8, 4), (X, ()))], (8, 4)) == (X, ())
    # a constant operand (no layout) takes its reader's
    assert implied_layout(add, [((8, 4), (X, ())), ((8, 4), None)], (8, 4)) == (X, ())
    assert implied_layout(add, [((8, 4), (X, ())), ((8, 4), ((), Y))], (8, 4)) is None
    assert implied_layout(add, [((8, 4), None), ((8, 4), None)], (8, 4)) is None


def test_reshape_keeps_the_sharded_dims_it_keeps_whole():
    reshape = _op("stablehlo.reshape")
    # [batch, tokens, 256] -> [batch, tokens, 8, 32]: batch and tokens kept
    assert implied_layout(reshape, [((16, 64, 256), (X, Y, ()))], (16, 64, 8, 32)) == \
        (X, Y, (), ())
    # the sharded dim split in two: XLA's choice, not implied
    assert implied_layout(reshape, [((16, 64, 256), ((), (), X))], (16, 64, 8, 32)) is None
    # [16, 64, 8, 32] -> [16, 64, 256] with the groups' dim sharded: merged, not implied
    assert implied_layout(reshape, [((16, 64, 8, 32), ((), (), X, ()))], (16, 64, 256)) is None
    assert implied_layout(reshape, [((16, 64, 8, 32), (X, (), (), ()))], (16, 64, 256)) == \
        (X, (), ())


def test_transpose_and_broadcast():
    transpose = _op("stablehlo.transpose", permutation=[1, 0, 2])
    assert implied_layout(transpose, [((4, 8, 2), (X, (), Y))], (8, 4, 2)) == ((), X, Y)
    broadcast = _op("stablehlo.broadcast_in_dim", broadcast_dimensions=[0, 2])
    assert implied_layout(broadcast, [((16, 32), (X, ()))], (16, 8, 32)) == (X, (), ())
    # a sharded dim of size 1 broadcast to a larger one is not kept
    assert implied_layout(broadcast, [((1, 32), (X, ()))], (16, 8, 32)) is None


def test_other_ops_are_not_implied():
    assert implied_layout(_op("stablehlo.dot_general"), [((8, 4), (X, ())), ((4, 2), None)],
                          (8, 2)) is None
    assert implied_layout(_op("stablehlo.slice"), [((8, 4), (X, ()))], (4, 4)) is None
