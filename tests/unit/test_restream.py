"""A matmul that recomputes a softmax (or its gradient) in its prologue and contracts its
leading dims (a vocabulary weight gradient) reads it once per output tile of the other
operand's free dims (strategies.restream_passes), as libtpu's kernels do on a v5e chip."""

from __future__ import annotations

import dataclasses

import pytest

from hloplan.cost_models import CommModel, load_device_model
from hloplan.graph import Graph, TensorType
from hloplan.mesh import parse_mesh
from hloplan.op_rules import fused_values, restreamed_reads, rule_for, softmax_reads
from hloplan.strategies import enumerate_strategies, restream_passes, row_tiles

TOKENS, VOCAB, WIDTH = 1024, 8192, 2048


@pytest.mark.parametrize("size, tiles", [(2048, 4), (1536, 2), (1024, 2), (768, 1), (128, 1),
                                         (100, 1), (5632, 11), (3072, 4)])
def test_row_tiles_take_the_widest_dividing_tile(size, tiles):
    """libtpu's output windows of the benchmark language models' vocabulary weight gradients:
    2048 rows in tiles of 512, 1536 in 768, 1024 in 512."""
    assert row_tiles(size, 768) == tiles


def test_row_tiles_of_a_wider_tile():
    assert row_tiles(2048, 2048) == 1 and row_tiles(4096, 1024) == 4


def _softmax_gradient_matmuls():
    """x [tokens, width]; s = exp(z - max z) (a softmax's numerator, z [tokens, vocab]) read by
    the weight gradient dot(s, x) over the tokens -> [vocab, width] and by the activation
    gradient dot(s, w) over the vocabulary -> [tokens, width]."""
    g = Graph()
    z_t, x_t = TensorType((TOKENS, VOCAB), "f32"), TensorType((TOKENS, WIDTH), "f32")
    w_t = TensorType((VOCAB, WIDTH), "f32")
    z = g.add_op("arg", (), [z_t]).results[0]
    x = g.add_op("arg", (), [x_t]).results[0]
    w = g.add_op("arg", (), [w_t]).results[0]
    g.arguments = [z, x, w]
    peak = g.add_op("stablehlo.reduce", (z,), [TensorType((TOKENS,), "f32")],
                    attrs={"dimensions": [1], "combiner": "stablehlo.maximum"}).results[0]
    spread = g.add_op("stablehlo.broadcast_in_dim", (peak,), [z_t],
                      attrs={"broadcast_dimensions": [0]}).results[0]
    shifted = g.add_op("stablehlo.subtract", (z, spread), [z_t]).results[0]
    s = g.add_op("stablehlo.exponential", (shifted,), [z_t]).results[0]
    weight_grad = g.add_op("stablehlo.dot_general", (s, x), [w_t], attrs={
        "lhs_batch": [], "rhs_batch": [], "lhs_contracting": [0], "rhs_contracting": [0]})
    act_grad = g.add_op("stablehlo.dot_general", (s, w), [x_t], attrs={
        "lhs_batch": [], "rhs_batch": [], "lhs_contracting": [1], "rhs_contracting": [0]})
    g.outputs = [weight_grad.results[0], act_grad.results[0]]
    return g, weight_grad, act_grad


def test_every_matmul_reading_a_recomputed_softmax_is_flagged():
    g, weight_grad, act_grad = _softmax_gradient_matmuls()
    fused = fused_values(g, matmul_fusion=True)
    normalized = softmax_reads(g, fused)
    assert normalized == {(weight_grad.index, 0), (act_grad.index, 0)}
    assert restreamed_reads(weight_grad, normalized) == (True, False)
    assert restreamed_reads(g.ops[0], normalized) is None


def test_a_normalization_or_an_activation_is_no_softmax():
    """x * rsqrt(mean(x^2)) scales by a reduction without an exponential; exp(x) (an
    activation's) takes no reduction's result: neither is flagged."""
    g = Graph()
    x_t = TensorType((TOKENS, WIDTH), "f32")
    x = g.add_op("arg", (), [x_t]).results[0]
    w = g.add_op("arg", (), [TensorType((WIDTH, WIDTH), "f32")]).results[0]
    g.arguments = [x, w]
    total = g.add_op("stablehlo.reduce", (x,), [TensorType((TOKENS,), "f32")],
                     attrs={"dimensions": [1], "combiner": "stablehlo.add"}).results[0]
    spread = g.add_op("stablehlo.broadcast_in_dim", (total,), [x_t],
                      attrs={"broadcast_dimensions": [0]}).results[0]
    scale = g.add_op("stablehlo.rsqrt", (spread,), [x_t]).results[0]
    normed = g.add_op("stablehlo.multiply", (x, scale), [x_t]).results[0]
    activated = g.add_op("stablehlo.exponential", (x,), [x_t]).results[0]
    attrs = {"lhs_batch": [], "rhs_batch": [], "lhs_contracting": [1], "rhs_contracting": [0]}
    first = g.add_op("stablehlo.dot_general", (normed, w), [x_t], attrs=attrs)
    second = g.add_op("stablehlo.dot_general", (activated, w), [x_t], attrs=attrs)
    g.outputs = [first.results[0], second.results[0]]
    fused = fused_values(g, matmul_fusion=True)
    assert normed in fused and activated in fused
    assert softmax_reads(g, fused) == set()


def _passes(g, op, model, mesh="1"):
    mesh = parse_mesh(mesh)
    rule = rule_for(g, op)
    types = [g.type_of(v) for v in op.operands]
    local = tuple(t.nbytes for t in types)
    return restream_passes(rule, 0, [[] for _ in rule.factors], mesh, model.matmul_row_tile,
                           local)


def test_the_weight_gradient_reads_the_softmax_once_per_row_tile():
    g, weight_grad, act_grad = _softmax_gradient_matmuls()
    model = load_device_model("tpu-v5e")
    assert model.matmul_row_tile == 768
    # The weight gradient's rows are x's width: 2048 in 4 tiles.
    assert _passes(g, weight_grad, model) == 4
    # The activation gradient contracts the softmax's last dim: its rows are the softmax's.
    assert _passes(g, act_grad, model) == 1
    # A model without the tile size reads it once.
    assert _passes(g, weight_grad, dataclasses.replace(model, matmul_row_tile=None)) == 1


def test_the_extra_reads_add_to_the_weight_gradients_time():
    g, weight_grad, _ = _softmax_gradient_matmuls()
    model = load_device_model("tpu-v5e")
    mesh = parse_mesh("1")
    rule = rule_for(g, weight_grad)
    types = [g.type_of(v) for v in weight_grad.operands]
    results = [g.type_of(v) for v in weight_grad.results]
    price = lambda m, flags: enumerate_strategies(  # noqa: E731
        rule, types, results, mesh, CommModel(m, mesh), restreamed=flags)[0].compute
    plain = price(model, None)
    tiled = price(model, (True, False))
    assert tiled - plain == pytest.approx(3 * types[0].nbytes / model.hbm_bandwidth)
    untiled = dataclasses.replace(model, matmul_row_tile=None)
    assert price(untiled, (True, False)) == pytest.approx(price(untiled, None))


def test_a_smaller_recomputed_operand_is_read_once():
    """A layer norm's output [tokens, width] recomputed by a weight gradient against a wider
    activation gradient: the kernel streams the larger operand, not it."""
    g = Graph()
    a_t, b_t = TensorType((TOKENS, 512), "f32"), TensorType((TOKENS, VOCAB), "f32")
    a = g.add_op("arg", (), [a_t]).results[0]
    b = g.add_op("arg", (), [b_t]).results[0]
    g.arguments = [a, b]
    op = g.add_op("stablehlo.dot_general", (a, b), [TensorType((512, VOCAB), "f32")], attrs={
        "lhs_batch": [], "rhs_batch": [], "lhs_contracting": [0], "rhs_contracting": [0]})
    assert _passes(g, op, load_device_model("tpu-v5e")) == 1


def test_the_tile_size_must_be_whole_lanes(tmp_path):
    from hloplan.cost_models import DeviceModelError

    base = (tmp_path / "m.toml")
    base.write_text('name = "m"\nplatform = "tpu"\nmemory = "16GiB"\nhbm_bandwidth = 1e12\n'
                    'matmul_row_tile = 700\n[flops]\ndefault = 1e14\n[[interconnect]]\n'
                    'name = "ici"\ndevices = 0\nbandwidth = 1e11\nlatency = 1e-6\n')
    with pytest.raises(DeviceModelError, match="matmul_row_tile"):
        load_device_model(base)
    base.write_text(base.read_text().replace("700", "512"))
    assert load_device_model(base).matmul_row_tile == 512
