"""rematerialize's choice on plain-data graphs (no MLIR): which values live across the peak are
recomputed, from which kept values, where, and what the barrier waits for."""

from __future__ import annotations

from hloplan.graph import Graph, TensorType
from hloplan.passes.rematerialize import plan_recompute

ACT = TensorType((64, 256), "f32")  # 64 KiB
STAT = TensorType((256,), "f32")
W = TensorType((64, 64), "f32")  # 16 KiB: activations dominate, as in a train step
SCALAR = TensorType((), "f32")
MATMUL = {"lhs_batch": (), "rhs_batch": (), "lhs_contracting": (1,), "rhs_contracting": (0,)}


def _op(g: Graph, name: str, *operands: int, type_=ACT) -> int:
    return g.add_op(name, tuple(operands), [type_], attrs=MATMUL if "dot" in name else {}).results[0]


def _normalized_relu(g: Graph, x: int, w: int, zeros: int) -> dict:
    y = _op(g, "stablehlo.dot_general", x, w)
    mean = _op(g, "stablehlo.reduce", y, type_=STAT)
    c = _op(g, "stablehlo.subtract", y, _op(g, "stablehlo.broadcast_in_dim", mean))
    return dict(y=y, mean=mean, c=c, r=_op(g, "stablehlo.maximum", c, zeros))


def _relu_backward(g: Graph, layer: dict, x: int, w: int, dr: int, zeros: int) -> tuple[int, int]:
    """The weight gradient and the gradient for the layer's input."""
    mask = _op(g, "stablehlo.compare", layer["c"], zeros, type_=TensorType(ACT.shape, "i1"))
    layer["mask"] = mask
    dy = _op(g, "stablehlo.select", mask, dr, zeros)
    return _op(g, "stablehlo.dot_general", x, dy, type_=W), _op(g, "stablehlo.dot_general", dy, w)


def _batch_norm_relu_step():
    """Two layers of y = x w, c = y - mean(y), r = max(c, 0), then z = r2 w3 and a loss. The
    backward pass reads each layer's c (relu mask) and input (weight gradient): layer 1's c1
    and r1 live across the turn, both elementwise in y1 and its mean."""
    g = Graph()
    x, w1, w2, w3 = (_op(g, "arg", type_=t) for t in (ACT, W, W, W))
    g.arguments = [x, w1, w2, w3]
    zeros = _op(g, "stablehlo.broadcast_in_dim", _op(g, "stablehlo.constant", type_=SCALAR))
    one = _normalized_relu(g, x, w1, zeros)
    two = _normalized_relu(g, one["r"], w2, zeros)
    z = _op(g, "stablehlo.dot_general", two["r"], w3)
    loss = _op(g, "stablehlo.reduce", z, type_=SCALAR)
    dz = _op(g, "stablehlo.broadcast_in_dim", loss)
    gw3 = _op(g, "stablehlo.dot_general", two["r"], dz, type_=W)
    dr2 = _op(g, "stablehlo.dot_general", dz, w3)
    gw2, dr1 = _relu_backward(g, two, one["r"], w2, dr2, zeros)
    gw1, _ = _relu_backward(g, one, x, w1, dr1, zeros)
    g.outputs = [loss, gw1, gw2, gw3]
    return g, dict(one=one, two=two, dz=dz, dr1=dr1, gw2=gw2)


def test_recomputes_elementwise_activations_from_the_matmul_output_and_its_statistics():
    g, v = _batch_norm_relu_step()
    one = v["one"]
    plan = plan_recompute(g)
    producer = {value.id: value.producer for value in g.values}
    assert producer[v["two"]["r"]] < plan.peak_after < producer[v["gw2"]]
    recomputed = {value for group in plan.groups for value in group.values}
    # c1 and r1, and the loss gradient (a broadcast of the loss, live across the peak too).
    assert recomputed == {one["c"], one["r"], v["dz"]}
    # Keeping y1 (dead at the peak) and its mean frees c1 and r1; dz frees its own bytes.
    assert plan.freed_bytes == 2 * ACT.nbytes - STAT.nbytes
    first = next(group for group in plan.groups if one["r"] in group.values)
    assert first.before == producer[v["gw2"]]  # r1's first use after the peak
    assert set(first.kept) == {one["y"], one["mean"]}
    assert first.trigger == g.ops[producer[v["gw2"]]].operands[1]  # the incoming gradient
    assert sorted(g.ops[i].name for i in first.ops) == [
        "stablehlo.broadcast_in_dim", "stablehlo.maximum", "stablehlo.subtract"]
    # The uses after the peak read the clones: r1 by the layer-2 weight gradient, c1 by its
    # relu mask; the uses before it (layer 2's matmul, layer 1's maximum) read the originals.
    users = {u for group in plan.groups if v["dz"] not in group.values for u in group.users}
    assert users == {producer[v["gw2"]], producer[one["mask"]]}


def test_a_value_traded_for_one_of_the_same_size_is_kept():
    """Per layer t = tanh(x w): recomputing layer 1's t1 after the peak would keep x w1, as
    large, instead."""
    g = Graph()
    x, w1, w2, w3 = (_op(g, "arg", type_=t) for t in (ACT, W, W, W))
    g.arguments = [x, w1, w2, w3]
    t1 = _op(g, "stablehlo.tanh", _op(g, "stablehlo.dot_general", x, w1))
    t2 = _op(g, "stablehlo.tanh", _op(g, "stablehlo.dot_general", t1, w2))
    loss = _op(g, "stablehlo.reduce", _op(g, "stablehlo.dot_general", t2, w3), type_=SCALAR)
    grad = _op(g, "stablehlo.broadcast_in_dim", loss)
    gws = [_op(g, "stablehlo.dot_general", t2, grad, type_=W)]
    grad = _op(g, "stablehlo.dot_general", grad, w3)
    for inp, t, w in ((t1, t2, w2), (x, t1, w1)):
        dh = _op(g, "stablehlo.multiply", grad, t)
        gws.append(_op(g, "stablehlo.dot_general", inp, dh, type_=W))
        grad = _op(g, "stablehlo.dot_general", dh, w)
    g.outputs = [loss, *gws]
    plan = plan_recompute(g)
    assert g.values[t1].producer < plan.peak_after < g.values[t1].users[-1]  # t1 crosses it
    assert not {t1, t2} & {value for group in plan.groups for value in group.values}


def test_a_matmul_input_another_recomputation_reads_is_kept_not_recomputed():
    """Per layer a = tanh(x w) feeds the next matmul, and b = exp(a) only the backward pass.
    Layer 1's b1 is recomputed from a1; a1 stays (recomputing it would reach back through
    the layer, and the weight gradient reads it anyway)."""
    g = Graph()
    x, w1, w2, w3 = (_op(g, "arg", type_=t) for t in (ACT, W, W, W))
    g.arguments = [x, w1, w2, w3]
    layers = []
    inp = x
    for w in (w1, w2):
        a = _op(g, "stablehlo.tanh", _op(g, "stablehlo.dot_general", inp, w))
        layers.append(dict(x=inp, w=w, a=a, b=_op(g, "stablehlo.exponential", a)))
        inp = a
    loss = _op(g, "stablehlo.reduce", _op(g, "stablehlo.dot_general", inp, w3), type_=SCALAR)
    grad = _op(g, "stablehlo.broadcast_in_dim", loss)
    gws = [_op(g, "stablehlo.dot_general", inp, grad, type_=W)]
    grad = _op(g, "stablehlo.dot_general", grad, w3)
    for layer in reversed(layers):
        layer["first_late_use"] = len(g.ops)
        dh = _op(g, "stablehlo.multiply", _op(g, "stablehlo.multiply", grad, layer["b"]),
                 layer["a"])
        gws.append(_op(g, "stablehlo.dot_general", layer["x"], dh, type_=W))
        grad = _op(g, "stablehlo.dot_general", dh, layer["w"])
    g.outputs = [loss, *gws]
    plan = plan_recompute(g)
    one = layers[0]
    group = next(group for group in plan.groups if one["b"] in group.values)
    assert group.values == (one["b"],) and group.kept == (one["a"],)
    assert group.before == one["first_late_use"]
    assert [g.ops[i].name for i in group.ops] == ["stablehlo.exponential"]
    assert all(one["a"] not in group.values for group in plan.groups)


def test_a_chain_longer_than_the_limit_is_kept():
    g, v = _batch_norm_relu_step()
    recomputed = {value for group in plan_recompute(g, max_chain=2).groups
                  for value in group.values}
    assert recomputed == {v["dz"]}  # one op; c1 and r1 need three


def test_recomputes_the_cheapest_per_byte_first_until_enough_is_freed():
    """dz frees its 64 KiB by recomputing one broadcast; c1 and r1 free 64 KiB (less the
    mean) by recomputing three tensors: asked for a sliver of the peak, only dz is recomputed."""
    g, v = _batch_norm_relu_step()
    plan = plan_recompute(g, free_fraction=1e-6)
    assert [group.values for group in plan.groups] == [(v["dz"],)]
    assert plan.freed_bytes == ACT.nbytes
    everything = plan_recompute(g, free_fraction=1.0)
    assert everything.freed_bytes == 2 * ACT.nbytes - STAT.nbytes
