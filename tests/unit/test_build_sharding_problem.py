"""build-sharding-problem: one reshard per value and layout, as XLA does it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import export

import hloplan
from hloplan.solver.evaluate import evaluate
from hloplan.solver.problem import first_live_points


def _step(ws, x):
    def loss(ws):
        return jnp.mean((jnp.tanh(x @ ws[0]) @ ws[1]) ** 2)

    return jax.tree.map(lambda w, g: w - 1e-3 * g, ws, jax.grad(loss)(ws))


def _compiled():
    s = jax.ShapeDtypeStruct
    w = s((2048, 2048), jnp.float32)
    data = export.export(jax.jit(_step))((w, w), s((8192, 2048), jnp.float32)).serialize()
    return hloplan.compile(data, "8", device="h100", mesh_views="off").state


def test_later_matmuls_read_a_weight_from_the_previous_ones_layout():
    state = _compiled()
    graph, space, problem = state.graph, state.space, state.problem
    w = graph.arguments[1]  # the second layer's weight
    matmuls = [u for u in dict.fromkeys(graph.values[w].users)
               if graph.ops[u].name == "stablehlo.dot_general"]
    assert len(matmuls) == 2  # forward, and the input gradient's matmul
    arg_node = space.node_of[graph.values[w].producer]
    first, second = (space.node_of[m] for m in matmuls)
    # The second matmul's edge comes from the first (one gather serves both), none from w.
    assert not any(e.src == arg_node and e.dst == second for e in problem.edges)
    shared = [e for e in problem.edges if e.src == first and e.dst == second]
    assert len(shared) == 1 and "as %" in shared[0].label
    # Same layout on both ends costs nothing; the edge's matrix is a real reshard otherwise.
    src = [s.operands[graph.ops[matmuls[0]].operands.index(w)]
           for s in space.strategies[matmuls[0]]]
    dst = [s.operands[graph.ops[matmuls[1]].operands.index(w)]
           for s in space.strategies[matmuls[1]]]
    costs = shared[0].costs
    for i, a in enumerate(src):
        for j, b in enumerate(dst):
            if a == b:
                assert costs[i][j] == 0
    assert max(max(row) for row in costs) > 0


def test_a_shared_copy_is_held_until_the_last_matmul_reading_it():
    """The forward matmul's copy of a weight is the one the backward matmul reads (one gather
    for both), so it is held from the first one's live point to the second one's."""
    state = _compiled()
    graph, space, problem = state.graph, state.space, state.problem
    w = graph.arguments[1]
    first, second = (space.node_of[u] for u in dict.fromkeys(graph.values[w].users)
                     if graph.ops[u].name == "stablehlo.dot_general")
    arg_node = space.node_of[graph.values[w].producer]
    firsts = first_live_points(problem)
    assert firsts[first] < firsts[second]
    read = [e for e in problem.edges if e.src == arg_node and e.dst == first]
    assert len(read) == 1 and read[0].held == (firsts[first], firsts[second])
    # The second read, from the first one's layout, is held only while it runs.
    again = [e for e in problem.edges if e.src == first and e.dst == second]
    assert len(again) == 1 and again[0].held is None


def test_gradient_matmuls_share_one_reshard_of_the_output_gradient():
    """The backward pass reads the output gradient twice (the weight's gradient and the input's):
    XLA gathers it once for both, so the second matmul reads it as the first one does."""
    state = _compiled()
    graph, space, problem = state.graph, state.space, state.problem
    arguments = set(graph.arguments)
    shared_values = []
    for value in graph.values:
        readers = [u for u in dict.fromkeys(value.users)
                   if graph.ops[u].name == "stablehlo.dot_general"]
        if value.id not in arguments and len(readers) == 2:
            shared_values.append((value, readers))
    assert shared_values  # each layer's output gradient
    for value, (first, second) in shared_values:
        producer = space.node_of[value.producer]
        assert not any(e.src == producer and e.dst == space.node_of[second]
                       for e in problem.edges)
        assert any(e.src == space.node_of[first] and e.dst == space.node_of[second]
                   and f"%{value.id} (as %{first}" in e.label for e in problem.edges)


def test_the_chosen_plan_is_priced_by_the_evaluator_as_the_solver_did():
    state = _compiled()
    figures = evaluate(state.problem, state.solution)
    assert abs(figures.total - state.stats.objective) <= 1e-9 + 1e-6 * figures.total


def _shifted_logits(logits):
    # The max broadcast back over the vocabulary: as large as the logits, and never written out
    # by XLA (the subtract's kernel recomputes it).
    return logits - jnp.max(logits, axis=-1, keepdims=True)


def test_a_broadcast_read_only_by_fused_kernels_takes_no_memory():
    logits = jax.ShapeDtypeStruct((4096, 8192), jnp.float32)
    data = export.export(jax.jit(_shifted_logits))(logits).serialize()
    state = hloplan.compile(data, "8", device="h100").state
    graph, space, problem = state.graph, state.space, state.problem
    broadcasts = [op for op in graph.ops if op.name == "stablehlo.broadcast_in_dim"
                  and graph.type_of(op.results[0]).shape == (4096, 8192)]
    assert broadcasts
    for op in broadcasts:
        node = space.node_of[op.index]
        assert not any(r.node == node for r in problem.live_ranges)
    # The logits and the difference: with the broadcast counted, three logits-sized values.
    peak = evaluate(problem, state.solution).peak_memory
    assert peak < 2.5 * 4096 * 8192 * 4 / 8


def test_reduce_scattered_partial_sums_are_held_whole_while_made():
    """A weight gradient reduce-scattered over the 8 data-parallel devices is computed as a
    whole [2048, 2048] partial sum on each (16 MiB) before the collective shrinks it to its
    shard (2 MiB): the strategy keeps 2 MiB and holds 14 MiB more where it is made."""
    state = _compiled()
    graph, space, problem = state.graph, state.space, state.problem
    grads = [op.index for op in graph.ops if op.name == "stablehlo.dot_general"
             and graph.type_of(op.results[0]).shape == (2048, 2048)]
    assert grads
    scattered = [s for s in problem.nodes[space.node_of[grads[0]]].strategies
                 if "reduce-scatter(x)" in s.name]
    assert scattered
    for s in scattered:
        assert s.memory == 2048 * 2048 * 4 / 8
        assert s.transient == 2048 * 2048 * 4 - s.memory
    summed = [s for s in problem.nodes[space.node_of[grads[0]]].strategies
              if "all-reduce(x)" in s.name]
    assert summed and all(s.transient == 0 for s in summed)


def _gelu_step(ws, x):
    def loss(ws):
        return jnp.mean((jax.nn.gelu(x @ ws[0], approximate=True) @ ws[1]) ** 2)

    return jax.tree.map(lambda w, g: w - 1e-3 * g, ws, jax.grad(loss)(ws))


def _forward_values_held_into_backward(state, shape) -> list[str]:
    """Names of the ops whose `shape`-d results the plan holds from the forward pass to the
    backward pass's first live point."""
    graph, space, problem = state.graph, state.space, state.problem
    backward = min(p for p, point in enumerate(problem.live_points)
                   if "transpose(jvp())" in point.label)
    held = []
    for r in problem.live_ranges:
        op = graph.ops[space.op_of[r.node]]
        if (op.name != "arg" and "transpose(jvp())" not in op.label and r.last >= backward
                and graph.type_of(op.results[0]).shape == shape):
            held.append(op.name)
    return sorted(held)


def test_cheap_elementwise_residuals_are_recomputed_in_the_backward_pass():
    """jax's tanh-GELU saves five elementwise residuals for the backward pass (3x^2, tanh,
    1 - tanh^2, the CDF and the output, besides x); XLA writes out only what is expensive to
    remake (tanh) or read by a non-fused kernel (the output, read by both matmuls), and
    recomputes the rest from x, the first matmul's output, inside the backward kernels (with
    the estimate counting only what XLA writes out, the MLP benchmark's estimate is 1.00x
    XLA's allocation; counting every residual would make it 1.55x)."""
    s = jax.ShapeDtypeStruct
    w = s((2048, 2048), jnp.float32)
    data = export.export(jax.jit(_gelu_step))((w, w), s((8192, 2048), jnp.float32)).serialize()
    state = hloplan.compile(data, "8", device="h100").state
    # Both matmuls' outputs (x, and the loss's square reads the second), tanh, the output.
    assert _forward_values_held_into_backward(state, (8192, 2048)) == [
        "stablehlo.dot_general", "stablehlo.dot_general", "stablehlo.multiply",
        "stablehlo.tanh"]


def _normalize(x):
    mean = jnp.mean(x, axis=0)
    var = jnp.mean(jnp.square(x - mean), axis=0)
    return jnp.sum(jnp.tanh((x - mean) * jax.lax.rsqrt(var + 1e-5)))


def test_a_value_a_reduction_reads_is_held():
    """The centred input of a batch norm, squared only for the variance's reduction: XLA's CPU
    compiler hands that reduction to a library kernel reading the centred input from memory,
    so it is written out, and the backward pass reads it from there."""
    x = jax.ShapeDtypeStruct((8192, 2048), jnp.float32)
    data = export.export(jax.jit(jax.grad(_normalize)))(x).serialize()
    state = hloplan.compile(data, "8", device="h100").state
    held = _forward_values_held_into_backward(state, (8192, 2048))
    assert "stablehlo.subtract" in held, held


_DONORS = """
module @jit_step {
  func.func public @main(%arg0: tensor<64x64xf32> {jax.buffer_donor = true} loc("w"),
                         %arg1: tensor<64xf32> {tf.aliasing_output = 0 : i32} loc("b"),
                         %arg2: tensor<64x64xf32> loc("x"))
      -> (tensor<64xf32>, tensor<f32>, tensor<64x64xf32>, tensor<64x64xf32>) {
    %0 = stablehlo.add %arg0, %arg2 : tensor<64x64xf32>
    %1 = stablehlo.multiply %arg0, %arg2 : tensor<64x64xf32>
    %2 = stablehlo.constant dense<1.0> : tensor<f32>
    return %arg1, %2, %0, %1 : tensor<64xf32>, tensor<f32>, tensor<64x64xf32>, tensor<64x64xf32>
  }
}
"""


def test_donors_are_read_from_the_module_and_paired_with_outputs():
    """`tf.aliasing_output` names the output a donated argument becomes; a `jax.buffer_donor`
    takes the first output of its type not taken yet, as XLA pairs them. The estimate writes
    that output into the argument's buffer: it is never live on its own, while the other
    output of the same type is held from the program's start."""
    state = hloplan.compile(_DONORS.encode(), "8", device="toy").state
    graph, space, problem = state.graph, state.space, state.problem
    assert graph.donated == {0: None, 1: 0}
    assert graph.output_aliases() == {0: 1, 2: 0}
    live = {r.node for r in problem.live_ranges} | {n for p in problem.live_points
                                                    for n in p.nodes}
    in_place, own = (space.node_of[graph.values[graph.outputs[k]].producer] for k in (2, 3))
    assert in_place not in live
    assert next(r for r in problem.live_ranges if r.node == own).first == 0


def _embed(table, ids, x):
    return jnp.tanh(table[ids] + x)


def test_values_made_from_a_lookup_are_decided_apart_from_it():
    """A pointwise op reading a gather's result does not follow it: the lookup's strategies
    (rows split on their width, or on the vocabulary and summed) are chosen apart from the
    layout of the stream it feeds (a reshard between them where they differ)."""
    s = jax.ShapeDtypeStruct
    data = export.export(jax.jit(_embed))(s((4096, 256), jnp.float32),
                                          s((16, 128), jnp.int32),
                                          s((16, 128, 256), jnp.float32)).serialize()
    state = hloplan.compile(data, "2x4", device="tpu-v5e", mesh_views="off").state
    graph, space, problem = state.graph, state.space, state.problem
    gather = next(op for op in graph.ops if op.name == "stablehlo.gather")
    add = next(op for op in graph.ops if op.name == "stablehlo.add")
    gather_node, add_node = space.node_of[gather.index], space.node_of[add.index]
    assert problem.nodes[add_node].tie != gather.index
    assert len(problem.nodes[add_node].strategies) != len(problem.nodes[gather_node].strategies)
    # The lookup's own forms: summed over the vocabulary's axes, or split on the row width.
    names = [s.name for s in space.strategies[gather.index]]
    assert any("all-reduce" in n for n in names)
    assert not any("reduce-scatter" in n for n in names)


def _residual_gelu_step(ws, x):
    def loss(ws):
        h = x
        for w in ws:
            h = jax.nn.gelu(h @ w) + h
        return jnp.mean(h ** 2)

    return jax.tree.map(lambda w, g: w - 1e-3 * g, ws, jax.grad(loss)(ws))


def test_tpu_holds_a_weights_copy_until_its_fused_input_gradient_matmul():
    """On TPU (libtpu gathers each weight once for its forward matmul and holds the copy until
    the backward input-gradient matmul reads it) the copy is held to the last point checked
    before that matmul, also where the matmul's result is fused into its reader (it holds no
    result, and is made where that kernel runs); on H100 it is held while the forward matmul
    runs."""
    s = jax.ShapeDtypeStruct
    w = s((1024, 1024), jnp.float32)
    data = export.export(jax.jit(_residual_gelu_step))(
        (w, w, w), s((4096, 1024), jnp.float32)).serialize()
    spans = {}
    for device, mesh in (("tpu-v5e", "2x4"), ("h100", "8")):
        state = hloplan.compile(data, mesh, device=device, mesh_views="off").state
        graph, space, problem = state.graph, state.space, state.problem
        firsts = first_live_points(problem)
        weight = graph.arguments[1]
        forward, backward = (u for u in dict.fromkeys(graph.values[weight].users)
                             if graph.ops[u].name == "stablehlo.dot_general")
        # The backward matmul is fused on TPU: it holds no result, and is made at the first
        # point checked from where it runs on (ShardingProblem.made_only).
        made_only = dict(problem.made_only)
        assert (space.node_of[backward] in made_only) == (device == "tpu-v5e")
        assert space.node_of[backward] in firsts
        (read,) = (e for e in problem.edges if e.dst == space.node_of[forward]
                   and e.label.startswith(f"%{weight} "))
        after = [int(p.label.split()[1][1:]) for p in problem.live_points]
        last = max(k for k, op in enumerate(after) if op <= backward)
        spans[device] = (read.held, firsts[space.node_of[forward]], last)
    held, first, last = spans["tpu-v5e"]
    assert held == (first, last) and last > first
    held, first, _ = spans["h100"]
    assert held is None or held[0] == first


def _sliced_head_step(ws, x):
    def loss(ws):
        w, head = ws
        h = jnp.tanh(x @ w)
        logits = jnp.einsum("bsd,dv->bsv", h, head)[:, :-1]
        return jnp.mean(jax.nn.logsumexp(logits, axis=-1))

    return jax.tree.map(lambda w, g: w - 1e-3 * g, ws, jax.grad(loss)(ws))


def test_tpu_holds_the_copy_a_sliced_matmul_reads():
    """An output head XLA slices through (`logits[:, :-1]`: the kernel writing the slice
    computes the matmul, which has no live point of its own) reads the head weight's copy
    there, and libtpu holds that copy until the backward input-gradient matmul reads it
    (hf_llama on v5e:4x8, 8 x 512 tokens per device: the head weight all-gathered in bf16,
    125 MiB, live from before the head's forward matmul across the logits' gradient)."""
    s = jax.ShapeDtypeStruct
    data = export.export(jax.jit(_sliced_head_step))(
        (s((1024, 1024), jnp.float32), s((1024, 8192), jnp.float32)),
        s((16, 128, 1024), jnp.float32)).serialize()
    state = hloplan.compile(data, "2x4", device="tpu-v5e", mesh_views="off").state
    graph, space, problem = state.graph, state.space, state.problem
    firsts = first_live_points(problem)
    head = graph.arguments[1]
    forward, backward = (u for u in dict.fromkeys(graph.values[head].users)
                         if graph.ops[u].name == "stablehlo.dot_general"
                         and graph.values[graph.ops[u].results[0]].type.rank == 3)
    # Computed inside the slice's kernel: no result of its own, made where that kernel runs.
    assert space.node_of[forward] in dict(problem.made_only)
    (read,) = (e for e in problem.edges if e.dst == space.node_of[forward]
               and e.label.startswith(f"%{head} "))
    after = [int(p.label.split()[1][1:]) for p in problem.live_points]
    first = min(k for k, op in enumerate(after) if op >= forward)
    assert firsts[space.node_of[forward]] == first
    last = max(k for k, op in enumerate(after) if op <= backward)
    assert last > first
    assert read.held == (first, last)


def _fused_matmul_step(w, x):
    return jnp.tanh(x @ w) * 2.0


def test_tpu_a_matmul_fused_into_its_reader_holds_its_bytes_where_it_is_made():
    """A matmul whose result only its reader's kernel takes (an output fusion: no buffer of
    its own) still runs there: it holds its partial sums before their reduce-scatter and the
    copies it reads at the first point checked from it on, with no result of its own."""
    from hloplan.solver.evaluate import point_contents
    from hloplan.solver.problem import Solution

    s = jax.ShapeDtypeStruct
    data = export.export(jax.jit(_fused_matmul_step))(
        s((2048, 2048), jnp.float32), s((4096, 2048), jnp.float32)).serialize()
    state = hloplan.compile(data, "2x4", device="tpu-v5e", mesh_views="off").state
    graph, space, problem = state.graph, state.space, state.problem
    (matmul,) = (op.index for op in graph.ops if op.name == "stablehlo.dot_general")
    node = space.node_of[matmul]
    made = dict(problem.made_only)
    assert node in made and node not in {r.node for r in problem.live_ranges}
    assert not any(node in point.nodes for point in problem.live_points)
    after = [int(p.label.split()[1][1:]) for p in problem.live_points]
    assert made[node] == min(k for k, op in enumerate(after) if op >= matmul)
    # Under a strategy summing partial products, its transient bytes are held there only.
    strategies = problem.nodes[node].strategies
    pick = max(range(len(strategies)), key=lambda k: strategies[k].transient)
    assert strategies[pick].transient > 0
    choice = list(state.solution.choice)
    choice[node] = pick
    for point in range(len(problem.live_points)):
        held = {(h.kind, h.index): h.bytes
                for h in point_contents(problem, Solution(tuple(choice)), point)}
        assert held.get(("made", node)) == (strategies[pick].transient
                                            if point == made[node] else None)
        assert ("result", node) not in held
