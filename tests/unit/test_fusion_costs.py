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


def _adam_step(w, m, v, x):
    g = jax.grad(lambda w: jnp.mean((x @ w) ** 2))(w)
    m = 0.9 * m + 0.1 * g
    v = 0.99 * v + 0.01 * g * g
    return w - 1e-3 * m / (jnp.sqrt(v) + 1e-8), m, v


def _adam_builder(tokens: int, width: int = 4096):
    """The planner's problem builder for one device on tpu-v5e, for an Adam step of one
    width x width weight on a batch of `tokens` rows; and the weight-gradient matmul."""
    from types import SimpleNamespace

    from hloplan.passes.build_sharding_problem import _ProblemBuilder

    s = jax.ShapeDtypeStruct
    weight = s((width, width), jnp.float32)
    data = export.export(jax.jit(_adam_step))(weight, weight, weight,
                                              s((tokens, width), jnp.float32)).serialize()
    graph = hloplan.compile(data, "1", device="tpu-v5e", mesh_views="off").state.graph
    builder = _ProblemBuilder(graph, CommModel(load_device_model("tpu-v5e"), parse_mesh("1")),
                              False, SimpleNamespace(log=None))
    # The weight gradient contracts the tokens: the dot whose operands both have them.
    grad = next(op for op in graph.ops if op.name == "stablehlo.dot_general"
                and all(graph.type_of(v).shape[0] == tokens for v in op.operands))
    return builder, graph, grad


def test_returned_moments_are_read_inside_the_update_kernel():
    """Adam's new moments are returned and read by the weight's update: XLA writes them out
    from the kernel that makes them and hands them to the update there (multi-output fusion),
    so the update reads neither back."""
    from hloplan.op_rules import output_fused_values

    builder, graph, _ = _adam_builder(512)
    kept = output_fused_values(graph, matmul_fusion=True)
    moments = {v for v in graph.outputs if v in kept}
    assert len(moments) == 2 and moments == kept
    readers = [op for op in graph.ops if any(v in moments for v in op.operands)]
    assert readers
    for op in readers:
        reads, _ = hbm_traffic(graph, op, builder.fused, folded=builder.folded,
                               shared=builder.shared, kept=builder.kept)
        assert not any(read for read, v in zip(reads, op.operands) if v in moments)
        reads, _ = hbm_traffic(graph, op, builder.fused, folded=builder.folded)
        assert any(read for read, v in zip(reads, op.operands) if v in moments)
    # Written out all the same.
    for v in moments:
        producer = graph.ops[graph.values[v].producer]
        assert all(hbm_traffic(graph, producer, builder.fused, kept=builder.kept)[1])


@pytest.mark.parametrize("tokens, hbm_bound", [(512, True), (8192, False)])
def test_a_weight_gradient_kernel_with_its_update_takes_the_larger_of_flops_and_traffic(
        tokens, hbm_bound):
    """The Adam update fused into the weight-gradient matmul (4096^2 weight): with 512 tokens
    the kernel's traffic (the update's 6 x 64 MiB) outlasts its FLOPs and the chip streams it
    under them (the matmul costs its own traffic, the kernel its total traffic); with 8192
    tokens the kernel is compute-bound and the update's traffic adds to the FLOPs."""
    from hloplan.op_rules import matmul_kernels

    builder, graph, grad = _adam_builder(tokens)
    model = builder.comm.model
    assert (grad.index in builder.overlapped) == hbm_bound
    update = matmul_kernels(graph, builder.fused | builder.kept)[grad.index]
    assert any(graph.ops[u].name == "stablehlo.sqrt" for u in update)
    strategies = builder._strategies(grad, rule_for(graph, grad))
    flop_s = 2.0 * tokens * 4096**2 / model.matmul_flops_for("f32", 4096, tokens, 4096)
    reads, writes = hbm_traffic(graph, grad, builder.fused, folded=builder.folded,
                                shared=builder.shared, rereads=builder.rereads,
                                kept=builder.kept)
    own = sum(graph.type_of(v).nbytes for v, moved in
              zip((*grad.operands, *grad.results), (*reads, *writes)) if moved)
    expected = own / model.hbm_bandwidth if hbm_bound else max(flop_s, own / model.hbm_bandwidth)
    assert strategies[0].compute == pytest.approx(expected)
    if hbm_bound:
        assert strategies[0].compute < flop_s


def _recomputed_by_two_matmuls(normalized: bool):
    """x -> (softmax-like: exp(x - broadcast(max(x)))) or (elementwise: tanh(x)) -> read by two
    matmuls with w."""
    g = Graph()
    x = g.add_op("arg", (), [F32]).results[0]
    w = g.add_op("arg", (), [F32]).results[0]
    g.arguments = [x, w]
    if normalized:
        row = TensorType((1024,), "f32")
        peak = g.add_op("stablehlo.reduce", (x,), [row],
                        attrs={"dimensions": [1], "combiner": "stablehlo.maximum"}).results[0]
        spread = g.add_op("stablehlo.broadcast_in_dim", (peak,), [F32],
                          attrs={"broadcast_dimensions": [0]}).results[0]
        shifted = g.add_op("stablehlo.subtract", (x, spread), [F32]).results[0]
        value = g.add_op("stablehlo.exponential", (shifted,), [F32]).results[0]
    else:
        value = g.add_op("stablehlo.tanh", (x,), [F32]).results[0]
    attrs = {"lhs_batch": [], "rhs_batch": [], "lhs_contracting": [1], "rhs_contracting": [0]}
    forward = g.add_op("stablehlo.dot_general", (value, w), [F32], attrs=attrs)
    backward = g.add_op("stablehlo.dot_general", (value, w), [F32], attrs=attrs)
    g.outputs = [forward.results[0], backward.results[0]]
    return g, value, backward


@pytest.mark.parametrize("normalized", [True, False])
def test_only_a_recomputed_softmax_is_read_apart_from_the_flops(normalized):
    """Both recompute the value in the second matmul's prologue (a reread); a softmax needs
    its row statistics first, so its read is serial; an elementwise recompute streams."""
    from hloplan.op_rules import matmul_rereads, normalized_rereads

    g, value, backward = _recomputed_by_two_matmuls(normalized)
    fused = fused_values(g, matmul_fusion=True)
    rereads = matmul_rereads(g, fused)
    assert value in fused and rereads == {(backward.index, 0)}
    assert normalized_rereads(g, fused, rereads) == (rereads if normalized else set())


def test_pipeline_bound_takes_a_matmul_kernels_flops_against_all_its_traffic():
    """The pipeline search's lower bound of a matmul takes its fused ops' traffic off its FLOP
    time (those ops count it themselves): an HBM-bound kernel is priced at its traffic, so a
    bound of max(FLOPs, own traffic) + fused traffic would exceed the planner's price."""
    from types import SimpleNamespace

    from hloplan.pipeline_parallel.search import StageSearch

    search = object.__new__(StageSearch)
    search.options = SimpleNamespace(device=SimpleNamespace(hbm_bandwidth=1e12))
    # 1 ms of FLOPs, 0.2 ms of own traffic, 1.5 ms of fused traffic (0.5 ms of it per batch).
    figure = (1e9, 1e12, [(2e8, False)], [], False, [(1e9, False), (1e9, True)])
    assert search._op_seconds(figure, 1, ()) == pytest.approx(2e-4)
    assert search._op_seconds(figure, 2, ()) == pytest.approx(2e-4)
    # Without fused traffic the FLOPs bound it.
    assert search._op_seconds(figure[:5] + ([],), 1, ()) == pytest.approx(1e-3)
    # 0.2 ms of fused traffic: 0.8 ms of FLOPs left over the kernel's.
    assert search._op_seconds(figure[:5] + ([(2e8, False)],), 1, ()) == pytest.approx(8e-4)
