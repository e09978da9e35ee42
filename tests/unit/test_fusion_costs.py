"""Compute costs under fusion: values XLA keeps inside one kernel pay no HBM traffic, graph
pseudo ops (arguments, loop carries) move nothing, and only streamed inputs pay for arriving."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax import export

import hloplan
from hloplan.cost_models import CommModel, load_device_model
from hloplan.graph import Graph, TensorType
from hloplan.mesh import parse_mesh
from hloplan.op_rules import folded_transposes, fused_values, hbm_traffic, rule_for
from hloplan.strategies import enumerate_strategies

F32 = TensorType((1024, 1024), "f32")


def _chain() -> tuple[Graph, dict[str, int]]:
    """w (state), x (data) -> dot -> tanh -> multiply(tanh, tanh) -> reduce -> output, and
    tanh also returned."""
    g = Graph()
    w = g.add_op("arg", (), [F32]).results[0]
    x = g.add_op("arg", (), [F32]).results[0]
    g.arguments = [w, x]
    dot = g.add_op("stablehlo.dot_general", (x, w), [F32],
                   attrs={"lhs_batch": [], "rhs_batch": [], "lhs_contracting": [1],
                          "rhs_contracting": [0]}).results[0]
    tanh = g.add_op("stablehlo.tanh", (dot,), [F32]).results[0]
    square = g.add_op("stablehlo.multiply", (tanh, tanh), [F32]).results[0]
    total = g.add_op("stablehlo.reduce", (square,), [TensorType((1024,), "f32")],
                     attrs={"dimensions": [1], "combiner": "stablehlo.add"}).results[0]
    exp = g.add_op("stablehlo.exponential", (tanh,), [F32]).results[0]
    g.outputs = [total, exp]
    return g, {"w": w, "x": x, "dot": dot, "tanh": tanh, "square": square, "total": total,
               "exp": exp}


def test_fused_values_follow_xla_loop_and_input_fusion():
    g, v = _chain()
    fused = fused_values(g)
    # tanh feeds only elementwise ops; square feeds only a reduce (input fusion).
    assert v["tanh"] in fused and v["square"] in fused
    # A dot's result is materialised; so are outputs and arguments.
    assert not fused & {v["dot"], v["total"], v["exp"], v["w"], v["x"]}


def test_a_value_read_by_a_dot_is_materialised():
    g, v = _chain()
    scaled = g.add_op("stablehlo.multiply", (v["x"], v["x"]), [F32]).results[0]
    g.add_op("stablehlo.dot_general", (scaled, v["w"]), [F32],
             attrs={"lhs_batch": [], "rhs_batch": [], "lhs_contracting": [1],
                    "rhs_contracting": [0]})
    assert scaled not in fused_values(g)


def test_hbm_traffic_per_operand_and_result():
    g, v = _chain()
    fused = fused_values(g)
    ops = {op.results[0]: op for op in g.ops}
    # square reads tanh twice inside the kernel and writes into the reduce's kernel.
    assert hbm_traffic(g, ops[v["square"]], fused) == ((False, False), (False,))
    # tanh reads the dot's output from HBM.
    assert hbm_traffic(g, ops[v["tanh"]], fused) == ((True,), (False,))
    # Arguments move nothing, unless streamed in every step.
    assert hbm_traffic(g, ops[v["w"]], fused) == ((), (False,))
    assert hbm_traffic(g, ops[v["x"]], fused, frozenset({v["x"]})) == ((), (True,))


def _dot(g: Graph, lhs: int, rhs: int, out: TensorType, lhs_contracting=(1,), rhs_contracting=(0,),
         lhs_batch=(), rhs_batch=()) -> int:
    return g.add_op("stablehlo.dot_general", (lhs, rhs), [out],
                    attrs={"lhs_batch": list(lhs_batch), "rhs_batch": list(rhs_batch),
                           "lhs_contracting": list(lhs_contracting),
                           "rhs_contracting": list(rhs_contracting)}).results[0]


def test_a_transpose_read_only_by_dots_is_folded_into_them():
    """The backward pass of `W @ x` under vmap: relu mask -> transpose -> two dots (weight and
    input gradients). XLA folds the transpose into both GEMMs, so the mask is written to HBM
    and the transpose is no kernel; a reshard of the mask then costs only its collective."""
    g, v = _chain()
    mask = g.add_op("stablehlo.multiply", (v["x"], v["w"]), [F32]).results[0]
    flipped = g.add_op("stablehlo.transpose", (mask,), [F32], attrs={"permutation": [1, 0]})
    _dot(g, flipped.results[0], v["w"], F32)
    _dot(g, v["x"], flipped.results[0], F32)
    assert folded_transposes(g) == {flipped.index}
    fused = fused_values(g)
    assert mask not in fused
    assert hbm_traffic(g, flipped, fused, folded={flipped.index}) == ((False,), (False,))
    # Unfolded (an elementwise user too), the mask stays inside the transpose's kernel.
    g.add_op("stablehlo.negate", (flipped.results[0],), [F32])
    assert folded_transposes(g) == set() and mask in fused_values(g)


def test_a_transpose_that_reorders_a_dots_free_dims_is_not_folded():
    g = Graph()
    t3 = TensorType((4, 8, 16), "f32")
    x = g.add_op("arg", (), [t3]).results[0]
    y = g.add_op("arg", (), [TensorType((16, 2), "f32")]).results[0]
    g.arguments = [x, y]
    # [a, b, c] -> [b, a, c]: the lhs's free dims (b, a) would come out swapped.
    swapped = g.add_op("stablehlo.transpose", (x,), [TensorType((8, 4, 16), "f32")],
                       attrs={"permutation": [1, 0, 2]})
    _dot(g, swapped.results[0], y, TensorType((8, 4, 2), "f32"), lhs_contracting=(2,))
    # [a, b, c] -> [a, c, b] contracting c: free dims (a, b) keep their order.
    kept = g.add_op("stablehlo.transpose", (x,), [TensorType((4, 16, 8), "f32")],
                    attrs={"permutation": [0, 2, 1]})
    _dot(g, kept.results[0], y, TensorType((4, 8, 2), "f32"), lhs_contracting=(1,))
    assert folded_transposes(g) == {kept.index}


def test_fused_operands_are_not_priced():
    g, v = _chain()
    mesh = parse_mesh("8")
    comm = CommModel(load_device_model("h100"), mesh)
    op = next(o for o in g.ops if o.results[0] == v["square"])
    rule = rule_for(g, op)
    types = [F32, F32]
    unfused = enumerate_strategies(rule, types, [F32], mesh, comm)
    fused = enumerate_strategies(rule, types, [F32], mesh, comm,
                                 hbm=hbm_traffic(g, op, fused_values(g)))
    assert [s.name for s in unfused] == [s.name for s in fused]
    # Replicated: 3 x 4 MiB through HBM unfused, nothing fused (elementwise FLOPs are tiny).
    assert unfused[0].compute == pytest.approx(3 * F32.nbytes / 3.35e12, rel=1e-6)
    assert fused[0].compute < unfused[0].compute / 100


def _sgd_step(w, x):
    return w - 1e-3 * jax.grad(lambda w: jnp.mean((x @ w) ** 2))(w)


def test_streamed_inputs_are_priced_and_state_is_not():
    s = jax.ShapeDtypeStruct
    data = export.export(jax.jit(_sgd_step))(s((512, 512), jnp.float32),
                                             s((4096, 512), jnp.float32)).serialize()
    result = hloplan.compile(data, "8", device="h100")
    state = result.state
    arg_nodes = {}
    for op in state.graph.ops:
        if op.name == "arg" and op.index in state.space.node_of:
            arg_nodes[op.results[0]] = state.problem.nodes[state.space.node_of[op.index]]
    w, x = state.graph.arguments
    assert all(st.compute_cost == 0 for st in arg_nodes[w].strategies)
    costs = sorted(st.compute_cost for st in arg_nodes[x].strategies)
    # Each device receives its share of the batch: replicated costs 8 times a split.
    assert costs[0] > 0 and costs[-1] == pytest.approx(8 * costs[0])


def test_resharding_a_fused_value_pays_for_materialising_it():
    from types import SimpleNamespace

    from hloplan.passes.build_sharding_problem import _ProblemBuilder

    g, v = _chain()
    mesh = parse_mesh("8")
    comm = CommModel(load_device_model("h100"), mesh)
    builder = _ProblemBuilder(g, comm, False, SimpleNamespace(log=None))
    split, whole = ((0,), ()), ((), ())
    assert v["tanh"] in builder.fused and v["dot"] not in builder.fused
    ids = [builder._specs_id(("t", k), lambda s=s: [s]) for k, s in enumerate((split, whole))]
    plain = builder._matrix(F32, ids[0], ids[1], 1.0, fused=False)[0][0]
    fused = builder._matrix(F32, ids[0], ids[1], 1.0, fused=True)[0][0]
    # An all-gather out of a fusion: the 1/8 shard is written and the whole read back.
    assert plain > 0
    assert fused - plain == pytest.approx((F32.nbytes / 8 + F32.nbytes) / 3.35e12)
    # Slicing a replicated value needs no collective and stays fused.
    assert builder._matrix(F32, ids[1], ids[0], 1.0, fused=True) is None


def test_tpu_matmuls_fuse_their_elementwise_neighbours():
    from hloplan.op_rules import fuses_matmuls

    g, v = _chain()
    scaled = g.add_op("stablehlo.multiply", (v["x"], v["x"]), [F32]).results[0]
    second = g.add_op("stablehlo.dot_general", (scaled, v["w"]), [F32],
                      attrs={"lhs_batch": [], "rhs_batch": [], "lhs_contracting": [1],
                             "rhs_contracting": [0]}).results[0]
    relu = g.add_op("stablehlo.maximum", (second, second), [F32]).results[0]
    other = g.add_op("stablehlo.negate", (second,), [F32]).results[0]
    g.outputs = [*g.outputs, relu, other]
    assert fuses_matmuls("tpu") and not fuses_matmuls("cuda") and not fuses_matmuls("cpu")
    assert not {scaled, v["dot"]} & fused_values(g)
    fused = fused_values(g, matmul_fusion=True)
    # A producer read by a dot is fused into it; a dot's result read by one elementwise op is
    # in that op's kernel (output fusion); read by two kernels, it is written out.
    assert scaled in fused and v["dot"] in fused and second not in fused
    assert v["tanh"] in fused and v["x"] not in fused


def test_a_fused_kernel_reads_each_value_once():
    from hloplan.op_rules import shared_reads

    g = Graph()
    x = g.add_op("arg", (), [F32]).results[0]
    w = g.add_op("arg", (), [F32]).results[0]
    g.arguments = [x, w]
    tanh = g.add_op("stablehlo.tanh", (x,), [F32])
    mul = g.add_op("stablehlo.multiply", (tanh.results[0], x), [F32])
    dot = g.add_op("stablehlo.dot_general", (x, w), [F32],
                   attrs={"lhs_batch": [], "rhs_batch": [], "lhs_contracting": [1],
                          "rhs_contracting": [0]})
    g.outputs = [mul.results[0], dot.results[0]]
    fused = fused_values(g)
    shared = shared_reads(g, fused)
    # tanh and multiply are one kernel: it reads x once; the dot is a kernel of its own.
    assert shared == {(mul.index, 1)}
    assert hbm_traffic(g, mul, fused, shared=shared) == ((False, False), (True,))
    assert hbm_traffic(g, mul, fused) == ((False, True), (True,))
    assert hbm_traffic(g, dot, fused, shared=shared)[0] == (True, True)


def _two_matmuls_of_a_fused_value():
    """x * x read by two matmuls with w (a forward and a backward reader)."""
    g = Graph()
    x = g.add_op("arg", (), [F32]).results[0]
    w = g.add_op("arg", (), [F32]).results[0]
    g.arguments = [x, w]
    normed = g.add_op("stablehlo.multiply", (x, x), [F32]).results[0]
    attrs = {"lhs_batch": [], "rhs_batch": [], "lhs_contracting": [1], "rhs_contracting": [0]}
    forward = g.add_op("stablehlo.dot_general", (normed, w), [F32], attrs=attrs)
    backward = g.add_op("stablehlo.dot_general", (normed, w), [F32], attrs=attrs)
    g.outputs = [forward.results[0], backward.results[0]]
    return g, normed, forward, backward


def test_matmuls_on_tpu_read_a_fused_operand_each():
    from hloplan.op_rules import matmul_rereads

    g, normed, forward, backward = _two_matmuls_of_a_fused_value()
    fused = fused_values(g, matmul_fusion=True)
    rereads = matmul_rereads(g, fused)
    # The multiply is fused into both matmuls' kernels: the second reads its input again.
    assert normed in fused and rereads == {(backward.index, 0)}
    assert hbm_traffic(g, forward, fused, rereads=rereads)[0] == (False, True)
    assert hbm_traffic(g, backward, fused, rereads=rereads)[0] == (True, True)


def _embedding_step(table, ids):
    def loss(table):
        return jnp.sum(jnp.tanh(table[ids]))

    return table - 1e-3 * jax.grad(loss)(table)


def test_tpu_gather_and_scatter_touch_only_the_indexed_rows():
    """An embedding lookup (gather) and its gradient (scatter-add) on a 256 MiB table with 8 ids:
    on tpu they move the 8 rows, not the table; on cpu the whole table is read and written."""
    s = jax.ShapeDtypeStruct
    data = export.export(jax.jit(_embedding_step))(
        s((65536, 1024), jnp.float32), s((8,), jnp.int32)).serialize()
    table = 65536 * 1024 * 4
    per_op = {}
    for device in ("tpu-v5e", "cpu"):
        state = hloplan.compile(data, "1", device=device, mesh_views="off").state
        model = load_device_model(device)
        per_op[device] = {
            op.name: min(st.compute_cost for st in
                         state.problem.nodes[state.space.node_of[op.index]].strategies)
            for op in state.graph.ops
            if op.name in ("stablehlo.gather", "stablehlo.scatter")
            and op.index in state.space.node_of}
        assert set(per_op[device]) == {"stablehlo.gather", "stablehlo.scatter"}
        bound = table / model.hbm_bandwidth
        if device == "tpu-v5e":
            assert all(t < bound / 100 for t in per_op[device].values()), per_op
        else:
            assert per_op[device]["stablehlo.scatter"] >= bound, per_op


def test_a_recomputed_matmul_operand_is_read_apart_from_the_flops():
    """The second matmul reading a fused operand recomputes it in its prologue: on TPU that
    read adds to the matmul's FLOP time (op_rules.serial_reads) instead of hiding under it."""
    from hloplan.op_rules import matmul_rereads, serial_reads

    g, normed, forward, backward = _two_matmuls_of_a_fused_value()
    fused = fused_values(g, matmul_fusion=True)
    rereads = matmul_rereads(g, fused)
    assert serial_reads(forward, rereads) is None
    assert serial_reads(backward, rereads) == (True, False)
    mesh = parse_mesh("1")
    model = load_device_model("tpu-v5e")
    comm = CommModel(model, mesh)
    rule = rule_for(g, backward)
    hbm = hbm_traffic(g, backward, fused, rereads=rereads)
    overlapped = enumerate_strategies(rule, [F32, F32], [F32], mesh, comm, hbm=hbm)[0]
    serial = enumerate_strategies(rule, [F32, F32], [F32], mesh, comm, hbm=hbm,
                                  serial=serial_reads(backward, rereads))[0]
    flops = model.matmul_flops_for("f32", 1024, 1024, 1024)
    assert overlapped.compute == pytest.approx(max(2 * 1024**3 / flops,
                                                   3 * F32.nbytes / model.hbm_bandwidth))
    assert serial.compute == pytest.approx(max(2 * 1024**3 / flops,
                                               2 * F32.nbytes / model.hbm_bandwidth)
                                           + F32.nbytes / model.hbm_bandwidth)
