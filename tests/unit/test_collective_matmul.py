"""libtpu's collective matmul (windowed einsum) in the compute pricing: a matmul whose result is
reduce-scattered over the axes its contraction is sharded on runs as n/2 chunk kernels, each
reading the stationary operand whole, with the partial sums' collective-permutes hidden behind
the chunks, and holds a copy of an operand instead of the whole partial sums
(strategies.collective_matmul_time; `collective-matmul = true` in [collectives])."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from hloplan.cost_models import CommModel, DeviceModelError, load_device_model
from hloplan.cost_models.hardware import _load_text
from hloplan.graph import TensorType
from hloplan.mesh import parse_mesh
from hloplan.op_rules import Factor, OpRule
from hloplan.strategies import enumerate_strategies

RATE, BANDWIDTH, LINK = 1e14, 2e11, 1e10

MODEL = f"""\
name = "toy-tpu"
platform = "tpu"
memory = "16GiB"
hbm_bandwidth = {BANDWIDTH}

[flops]
default = {RATE}

[[interconnect]]
name = "ici"
devices = 0
bandwidth = {LINK}
latency = 0.0

[collectives]
matmul-input-dtype = "bf16"
"""


def _weight_gradient(tokens: int, d: int, f: int) -> tuple[OpRule, list, list]:
    """dW[d, f] = X[t, d]^T G[t, f]: the contraction t, then d (lhs) and f (rhs)."""
    rule = OpRule(factors=(Factor(tokens, "reduce"), Factor(d), Factor(f)),
                  operands=(((0,), (1,)), ((0,), (2,))), results=(((1,), (2,)),),
                  flops=2.0 * tokens * d * f, matmul=(((1,), 1), ((0,), 1), ((2,), 1)))
    return (rule, [TensorType((tokens, d), "f32"), TensorType((tokens, f), "f32")],
            [TensorType((d, f), "f32")])


def _scattered(devices: int, tokens: int, d: int, f: int, collective_matmul: bool,
               hbm=None, overlap: float | None = None, async_devices: int | None = None):
    """The strategy that shards t over all devices and reduce-scatters dW over them on d."""
    table = "collective-matmul = true\n" if collective_matmul else ""
    if overlap is not None:
        table += f"collective-matmul-overlap = {overlap}\n"
    if async_devices is not None:
        table += f"collective-matmul-async-devices = {async_devices}\n"
    comm = CommModel(_load_text(MODEL + table, "toy.toml"), parse_mesh(str(devices)))
    rule, operands, results = _weight_gradient(tokens, d, f)
    (strategy,) = [s for s in enumerate_strategies(rule, operands, results, comm.mesh, comm,
                                                   hbm=hbm)
                   if s.reduced_axes == (0,) and s.results == (((0,), ()),)]
    return strategy


def test_chunks_reread_the_stationary_operand():
    # 16 devices: 8 chunk kernels, each two 1/16 chunks of d; G (t/16 x 8192) is read by each.
    n, tokens, d, f = 16, 16 * 16384, 1024, 8192
    plain = _scattered(n, tokens, d, f, collective_matmul=False)
    looped = _scattered(n, tokens, d, f, collective_matmul=True)
    bf16, f32, kernels = 2, 4, n // 2
    local_t = tokens // n
    chunk_bytes = (local_t * f * bf16 + local_t * d * bf16 / kernels + d * f * f32 / kernels)
    chunk_flops = 2.0 * local_t * d * f / kernels
    expected = (kernels * max(chunk_flops / RATE, chunk_bytes / BANDWIDTH)
                + 3 * d * f * f32 / BANDWIDTH)
    assert chunk_bytes / BANDWIDTH > chunk_flops / RATE  # HBM-bound chunks
    assert looped.compute == pytest.approx(expected)
    # G fused into the matmul (a softmax gradient recomputed from the logits): each chunk
    # kernel still remakes it whole, as libtpu's loop over hf_bert's vocabulary does.
    fused = _scattered(n, tokens, d, f, collective_matmul=True, hbm=((True, False), (True,)))
    assert fused.compute == pytest.approx(expected)
    assert looped.compute > plain.compute
    # The partial sums travel while the chunks compute: only the last two chunks' sends and
    # what outlasts the compute are not hidden.
    # The loop is priced as what it sends: n + 1 collective-permutes of 1/n of the partial
    # sums, where the reduce-scatter sends (n - 1)/n of them.
    sent = (n - 1) / n * d * f * f32 / LINK
    assert plain.communication == pytest.approx(sent)
    permuted = (n + 1) / n * d * f * f32 / LINK
    assert looped.communication == pytest.approx(
        max(0.0, permuted - looped.compute) + 2 * permuted / n)
    # Listed as libtpu compiles the loop: n + 1 collective-permutes of 1/n of the partial sums.
    assert plain.collectives == (("reduce-scatter", "x", (n - 1) / n * d * f * f32),)
    assert looped.collectives == (("collective-permute", "x", d * f * f32 / n),) * (n + 1)
    # Memory: the plain form holds the unscattered partial sums while it makes them; the loop
    # holds only chunks of them, but a copy of an operand in its own layout (the larger, bf16).
    assert plain.transient == d * f * f32 * (n - 1) / n
    assert looped.transient == local_t * f * bf16
    # The loop's two accumulators (one per ring direction), each of the result's size: held
    # from before the first loop (solver/liveness.py); the plain form has none.
    assert plain.accumulators == 0.0
    assert looped.accumulators == 2 * d * f * f32 / n


def test_the_share_of_the_loop_sends_counted_as_hidden():
    # collective-matmul-overlap = 0 counts every send of the loop in full, as the compiled
    # score counts every collective; a share between counts that part of what could hide.
    n, tokens, d, f = 16, 16 * 16384, 1024, 8192
    sent = (n + 1) / n * d * f * 4 / LINK  # the loop's n + 1 collective-permutes
    hidden = _scattered(n, tokens, d, f, collective_matmul=True)
    exposed = hidden.communication
    assert exposed < sent / 2
    assert _scattered(n, tokens, d, f, True, overlap=1.0).communication == pytest.approx(exposed)
    counted = _scattered(n, tokens, d, f, True, overlap=0)
    assert counted.communication == pytest.approx(sent)
    half = _scattered(n, tokens, d, f, True, overlap=0.5)
    assert half.communication == pytest.approx((sent + exposed) / 2)
    # What is not counted is recorded as hidden (plan.json's hidden_s).
    assert hidden.hidden == pytest.approx(sent - exposed)
    assert half.hidden == pytest.approx((sent - exposed) / 2) and counted.hidden == 0.0
    # Only the communication is counted differently: the loop's kernels, collectives and memory
    # are the loop's.
    for other in (counted, half):
        assert (other.compute, other.collectives, other.transient, other.accumulators) == (
            hidden.compute, hidden.collectives, hidden.transient, hidden.accumulators)


def test_loop_sends_are_counted_in_full_on_slices_past_the_async_limit():
    # libtpu runs the loop's collective-permutes synchronously on v5e slices of more than 16
    # chips: nothing hides them there (collective-matmul-async-devices = 16 says so).
    n, tokens, d, f = 16, 16 * 16384, 1024, 8192
    sent = (n + 1) / n * d * f * 4 / LINK
    within = _scattered(n, tokens, d, f, True, async_devices=16)
    assert within.hidden > 0 and within.communication == pytest.approx(sent - within.hidden)
    past = _scattered(n, tokens, d, f, True, async_devices=8)
    assert past.hidden == 0.0 and past.communication == pytest.approx(sent)
    v5e = load_device_model("tpu-v5e")
    assert v5e.collective_matmul_async_devices == 16
    assert [v5e.collective_matmul_overlap_on(k) for k in (4, 8, 16, 32, 256)] == [1, 1, 1, 0, 0]
    unlimited = dataclasses.replace(v5e, collective_matmul_async_devices=None)
    assert unlimited.collective_matmul_overlap_on(256) == 1.0
    for bad in ("0", "-4", "2.5", "true", '"16"'):
        with pytest.raises(DeviceModelError, match="positive integer"):
            _load_text(MODEL + f"collective-matmul-async-devices = {bad}\n", "bad.toml")


def test_no_loop_where_communication_dwarfs_compute_or_beyond_32_devices():
    # A short contraction: the reduce-scatter takes far longer than the matmul, so libtpu's
    # cost check keeps one matmul and one reduce-scatter.
    short = (16, 16 * 8, 1024, 8192)
    assert (_scattered(*short, collective_matmul=True).compute
            == _scattered(*short, collective_matmul=False).compute)
    assert [c[0] for c in _scattered(*short, collective_matmul=True).collectives] == [
        "reduce-scatter"]
    wide = (64, 64 * 16384, 1024, 8192)  # XLA windows an einsum over at most 32 devices
    assert (_scattered(*wide, collective_matmul=True).compute
            == _scattered(*wide, collective_matmul=False).compute)
    for unlooped in (short, wide):
        assert _scattered(*unlooped, collective_matmul=True).accumulators == 0.0


def test_collective_matmul_field():
    assert _load_text(MODEL, "toy.toml").collective_matmul is False
    assert _load_text(MODEL + "collective_matmul = true\n", "toy.toml").collective_matmul
    with pytest.raises(DeviceModelError, match="must be true or false"):
        _load_text(MODEL + 'collective-matmul = "yes"\n', "bad.toml")
    assert _load_text(MODEL, "toy.toml").collective_matmul_intensity is None
    assert _load_text(MODEL + "collective-matmul-intensity = 4224\n",
                      "toy.toml").collective_matmul_intensity == 4224.0
    with pytest.raises(DeviceModelError, match="must be positive"):
        _load_text(MODEL + "collective-matmul-intensity = 0\n", "bad.toml")
    assert _load_text(MODEL, "toy.toml").collective_matmul_overlap == 1.0
    assert _load_text(MODEL + "collective-matmul-overlap = 0\n",
                      "toy.toml").collective_matmul_overlap == 0.0
    for bad in ("1.5", "-0.1"):
        with pytest.raises(DeviceModelError, match="between 0 and 1|must not be negative"):
            _load_text(MODEL + f"collective-matmul-overlap = {bad}\n", "bad.toml")


def _v5e_scattered(mesh: str, tokens: int, d: int, f: int, dtype: str = "f32"):
    """tpu-v5e's strategy for dW[d, f] = X[t, d]^T G[t, f] with t sharded over every axis of
    `mesh` (`tokens` per device) and dW reduce-scattered over them on d."""
    comm = CommModel(load_device_model("tpu-v5e"), parse_mesh(mesh))
    every = tuple(range(len(comm.mesh.axis_sizes)))
    rule, operands, results = _weight_gradient(tokens * comm.mesh.size, d, f)
    operands = [TensorType(t.shape, dtype) for t in operands]
    results = [TensorType(t.shape, dtype) for t in results]
    (strategy,) = [s for s in enumerate_strategies(rule, operands, results, comm.mesh, comm)
                   if s.reduced_axes == every and s.results == ((every, ()),)]
    return strategy


# Where libtpu starts looping (tpu-v5e's collective-matmul-intensity, 4,224 FLOPs per device
# per byte of one chunk of the partial sums), whatever d and f: (mesh, dtype, tokens per device).
LOOPS_FROM = [("2x4", "f32", 1056), ("2x4", "bf16", 528), ("4x4", "f32", 528),
              ("4x8", "f32", 264)]


@pytest.mark.parametrize("mesh, dtype, tokens", LOOPS_FROM)
@pytest.mark.parametrize("d, f", [(768, 768), (128, 128), (4096, 4096), (256, 4096)])
def test_a_dot_loops_from_libtpus_intensity(mesh, dtype, tokens, d, f):
    """libtpu's windowed-einsum check compares the dot's FLOPs per device with one chunk of its
    partial sums, nothing else: with the [matmul] table's rates or a bound on the partial
    sums' bytes, HF GPT-2's 768 x 768 attention-projection gradients over 8 devices (4,096
    tokens per device, 2.4 MB of partial sums; libtpu loops them) were kept as one matmul."""
    n = parse_mesh(mesh).size
    kept = _v5e_scattered(mesh, tokens - 1, d, f, dtype)
    looped = _v5e_scattered(mesh, tokens, d, f, dtype)
    assert [c[0] for c in kept.collectives] == ["reduce-scatter"] and not kept.accumulators
    assert [c[0] for c in looped.collectives] == ["collective-permute"] * (n + 1)
    assert looped.accumulators > 0


def test_hf_gpt2_attention_projection_gradient_loops():
    looped = _v5e_scattered("2x4", 4096, 768, 768)
    assert [c[0] for c in looped.collectives] == ["collective-permute"] * 9
    # an activation gradient G[t, f] W[d, f]^T contracts f: over 8 devices libtpu loops it
    # from f = 8,448 (the same intensity), whatever the tokens
    comm = CommModel(load_device_model("tpu-v5e"), parse_mesh("2x4"))
    for f, loops in ((8440, False), (8448, True)):
        rule = OpRule(factors=(Factor(1024), Factor(1024), Factor(f, "reduce")),
                      operands=(((0,), (2,)), ((1,), (2,))), results=(((0,), (1,)),),
                      flops=2.0 * 1024 * 1024 * f, matmul=(((0,), 1), ((2,), 1), ((1,), 1)))
        types = [TensorType((1024, f), "f32"), TensorType((1024, f), "f32")]
        (strategy,) = [s for s in enumerate_strategies(rule, types, [TensorType((1024, 1024),
                                                                                "f32")],
                                                      comm.mesh, comm)
                       if s.reduced_axes == (0, 1) and s.results == (((), (0, 1)),)
                       and s.operands == (((), (0, 1)), ((), (0, 1)))]
        assert bool(strategy.accumulators) is loops


# A weight gradient that libtpu loops over 8 devices (8,192 tokens per device, [512, 2048]).
LOOP_DEVICES, LOOP_TOKENS, LOOP_D, LOOP_F = 8, 8 * 8192, 512, 2048


def _planned_weight_gradient():
    """hloplan's plan (compiler result) of that weight gradient for tpu-v5e on 8 devices."""
    import jax
    import jax.numpy as jnp

    from hloplan.compiler import compile_bytes, make_options

    def grad(x, g):
        return jnp.einsum("td,tf->df", x, g)

    args = [jax.ShapeDtypeStruct((LOOP_TOKENS, LOOP_D), jnp.float32),
            jax.ShapeDtypeStruct((LOOP_TOKENS, LOOP_F), jnp.float32)]
    exported = jax.export.export(jax.jit(grad), platforms=("tpu",))(*args)
    return compile_bytes(bytes(exported.serialize()), "grad.jaxexport",
                         make_options(str(LOOP_DEVICES), device="tpu-v5e", mesh_views="off"))


def test_plan_lists_the_loop_collective_permutes(tmp_path):
    """plan.json's predicted collectives (what `hloplan verify` sets beside the compiled ones)
    list a windowed weight gradient as its loop's collective-permutes, counted per execution as
    hlo_stats counts them, and no reduce-scatter."""
    result = _planned_weight_gradient()
    n, d, f = LOOP_DEVICES, LOOP_D, LOOP_F
    listed = {c["kind"]: c for c in result.plan["estimate"]["collectives"]}
    assert "reduce-scatter" not in listed
    permutes = listed["collective-permute"]
    assert permutes["axes"] == "x" and permutes["count"] == n + 1
    assert permutes["bytes"] == pytest.approx((n + 1) * d * f * 4 / n, rel=1e-4)
    # The loop's sends counted as hidden behind its chunk kernels, per op and in all.
    estimate = result.plan["estimate"]
    looped = [op for op in result.plan["ops"] if op.get("hidden_s")]
    assert looped and estimate["hidden_s"] == pytest.approx(
        sum(op["hidden_s"] for op in looped), rel=1e-4)


def test_copies_read_after_a_loop_are_held_across_it():
    """libtpu makes the reshards of the op after a collective-matmul loop before the loop
    (passes/build_sharding_problem.hold_copies_across_loops): the copies that op reads are
    held from the loop's live point too; a reader after an op that cannot loop, and the loop's
    own copies, keep their spans."""
    from hloplan.passes.build_sharding_problem import hold_copies_across_loops
    from hloplan.solver.evaluate import evaluate
    from hloplan.solver.problem import Edge, LivePoint, Node, ShardingProblem, Solution, Strategy

    loop = Node("loop", (Strategy("plain", memory=1.0),
                         Strategy("looped", memory=1.0, accumulators=2.0)))
    matmul = Node("matmul", (Strategy("a", memory=1.0), Strategy("b", memory=1.0)))
    weight = Node("weight", (Strategy("sharded", memory=4.0), Strategy("whole", memory=16.0)))
    gathered = ((0.0, 1.0), (1.0, 0.0))  # a copy where the layouts differ
    edges = (Edge(2, 1, gathered, copies=(16.0, 16.0)),  # read by the op after the loop
             Edge(2, 0, gathered, copies=(16.0, 16.0)),  # read by the loop itself
             Edge(2, 3, gathered, copies=(16.0, 16.0)))  # read after a plain matmul
    nodes = (loop, matmul, weight, dataclasses.replace(matmul, name="next"))
    points = (LivePoint((2,)), LivePoint((0, 2)), LivePoint((1, 2)), LivePoint((3, 2)))
    problem = ShardingProblem(nodes, edges, points)
    held = hold_copies_across_loops(problem).edges
    assert held[0].held == (1, 2)
    assert held[1].held is None and held[2].held is None
    memory = evaluate(hold_copies_across_loops(problem), Solution((1, 1, 0, 1))).memory
    # At the loop: the weight, the loop's result and accumulators, its own copy and the next
    # op's copy; at the next op: the weight, its result and its copy.
    assert memory == (4.0, 4.0 + 1.0 + 2.0 + 16.0 + 16.0, 4.0 + 1.0 + 16.0, 4.0 + 1.0 + 16.0)
    no_loops = dataclasses.replace(problem, nodes=(matmul, matmul, weight, matmul))
    assert hold_copies_across_loops(no_loops) is no_loops


def _reading_through_a_shared_reshard():
    """A value (node 0, layout a or b), read by a matmul (node 1, in a or b) and, sharing
    that matmul's reshard, by a node that can loop (node 2, in a; its looped strategy copies
    the value: 8 bytes of transient, Edge.loop_copy)."""
    from hloplan.solver.problem import Edge, LivePoint, Node, ShardingProblem, Strategy

    value = Node("value", (Strategy("a", memory=4.0), Strategy("b", memory=4.0)))
    matmul = Node("matmul", (Strategy("reads a", memory=1.0), Strategy("reads b", memory=1.0)))
    loop = Node("loop", (Strategy("plain", memory=1.0, transient=32.0),
                         Strategy("looped", memory=1.0, transient=8.0, accumulators=2.0)))
    differ = ((0.0, 1.0), (1.0, 0.0))  # a copy where the layouts differ
    edges = (Edge(0, 1, differ, copies=(8.0, 8.0), held=(1, 2)),
             # the loop reads the value in a: from the matmul's layout, free where it is a
             Edge(1, 2, ((0.0, 0.0), (1.0, 1.0)), copies=(8.0, 8.0), loop_copy=(0.0, 8.0),
                  via=0))
    points = (LivePoint((0,)), LivePoint((0, 1)), LivePoint((0, 2)))
    return ShardingProblem((value, matmul, loop), edges, points)


@pytest.mark.parametrize("choice, at_loop", [
    ((1, 0, 1), 4.0 + 1.0 + 2.0 + 8.0),  # the matmul's all-gather, read by the loop: no copy
    ((0, 0, 1), 4.0 + 1.0 + 2.0 + 8.0),  # read in its own layout: the loop copies it
    ((0, 1, 1), 4.0 + 1.0 + 2.0 + 8.0 + 8.0),  # resharded from the matmul's copy: a second
    ((1, 0, 0), 4.0 + 1.0 + 8.0 + 32.0),  # not looped: its own transient beside the copy
])
def test_a_loop_reads_its_operand_resharded_without_a_copy_of_its_own(choice, at_loop):
    """libtpu's collective-matmul loop reads an operand that reaches it resharded where the
    reshard leaves it (llama on v5e:16x16: the head's weight-gradient loop reads the
    activation all-gathered for the forward head matmul): the evaluator holds the reshard's
    copy and not the loop's own (Edge.loop_copy, through Edge.via for a shared reshard); the
    ILP's model, without copies, holds the loop's copy instead."""
    from hloplan.solver.evaluate import evaluate, point_contents
    from hloplan.solver.problem import Solution

    problem = _reading_through_a_shared_reshard()
    solution = Solution(choice)
    memory = evaluate(problem, solution).memory
    assert memory[2] == at_loop
    held = point_contents(problem, solution, 2)
    assert sum(h.bytes for h in held) == at_loop
    made = sum(h.bytes for h in held if h.kind == "made")
    assert made == (0.0 if choice[:2] in ((1, 0), (0, 1)) and choice[2] else
                    problem.nodes[2].strategies[choice[2]].transient)
    without = evaluate(problem, solution, copies=False).memory
    assert without[2] == 4.0 + 1.0 + problem.nodes[2].strategies[choice[2]].transient + (
        2.0 if choice[2] else 0.0)


def test_the_reads_of_a_looped_matmul_carry_its_operand_copy():
    """build_sharding_problem puts each looped strategy's operand copy (its transient) on the
    edge reading that operand (Edge.loop_copy), so that the evaluator can drop it where the
    operand arrives resharded; strategies that do not loop copy nothing."""
    result = _planned_weight_gradient()
    problem = result.state.problem
    loops = [i for i, node in enumerate(problem.nodes)
             if any(s.accumulators for s in node.strategies)]
    assert loops
    for loop in loops:
        strategies = problem.nodes[loop].strategies
        carried = [e for e in problem.edges if e.dst == loop and e.loop_copy]
        assert carried
        found = 0
        for j, s in enumerate(strategies):
            copies = [e.loop_copy[j] for e in carried if e.loop_copy[j]]
            # one operand's copy, where an edge reads it (none: never resharded)
            assert copies in ([], [s.transient]) if s.accumulators else copies == []
            found += bool(copies)
        assert found


# A weight gradient compiled by libtpu for a topology, the tokens sharded over both axes and
# the result reduce-scattered over them on d: its collectives as hlo_stats counts them.
_LIBTPU_WEIGHT_GRADIENTS = """
import json, sys
import jax, numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec
from hloplan.hlo_stats import collective_stats
from hloplan.tpu import parse_topology, topology_devices
out = []
for topology, tokens, d, f, dtype in json.loads(sys.argv[1]):
    shape = [int(s) for s in topology.split(":")[1].split("x")]
    devices = topology_devices(parse_topology(topology))
    mesh = Mesh(np.array(devices).reshape(shape), ("x", "y"), axis_types=(AxisType.Auto,) * 2)
    rows = NamedSharding(mesh, PartitionSpec(("x", "y"), None))
    n = len(devices)
    compiled = jax.jit(lambda x, g: jax.numpy.einsum("td,tf->df", x, g),
                       in_shardings=(rows, rows), out_shardings=rows).lower(
        jax.ShapeDtypeStruct((tokens * n, d), dtype),
        jax.ShapeDtypeStruct((tokens * n, f), dtype)).compile()
    stats = collective_stats(compiled.as_text(), mesh_axes=[("x", shape[0]), ("y", shape[1])])
    out.append([[op.kind, "".join(sorted(op.axes)), op.total_bytes_sent] for op in stats.ops])
print(json.dumps(out))
"""


@pytest.mark.libtpu
def test_libtpu_loops_from_the_intensity():
    """Either side of tpu-v5e's collective-matmul-intensity, the strategy lists what libtpu
    compiles: one reduce-scatter, or the loop's collective-permutes, with their bytes."""
    from hloplan.tpu import child_env

    cases = [(mesh, tokens + step, d, f, dtype)
             for mesh, dtype, tokens in LOOPS_FROM[:3] for d, f in ((768, 768),)
             for step in (-1, 0)]
    jax_dtypes = {"f32": "float32", "bf16": "bfloat16"}
    done = subprocess.run(
        [sys.executable, "-c", _LIBTPU_WEIGHT_GRADIENTS,
         json.dumps([[f"v5e:{mesh}", tokens, d, f, jax_dtypes[dtype]]
                     for mesh, tokens, d, f, dtype in cases])],
        env=child_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    for case, ops in zip(cases, json.loads(done.stdout.strip().splitlines()[-1]), strict=True):
        compiled: dict = {}
        for kind, axes, sent in ops:
            compiled[kind, axes] = compiled.get((kind, axes), 0.0) + sent
        predicted: dict = {}
        for kind, axes, sent in _v5e_scattered(*case).collectives:
            key = (kind, axes.replace(",", ""))
            predicted[key] = predicted.get(key, 0.0) + sent
        assert predicted == pytest.approx(compiled), case


def test_every_read_of_a_shared_reshard_names_the_read_it_shares():
    """A chain of matmuls reading one reshard: each read names the read whose copy it shares
    (Edge.via), looping or not, so that a loop at the end of the chain finds the copy through
    readers that cannot loop (linen_resnet on v5e:4x8: a forward convolution between the copy
    and its kernel gradient's loop)."""
    import jax
    import jax.numpy as jnp

    from hloplan.compiler import compile_bytes, make_options

    def step(x, w1, w2, w3):
        return jnp.tanh(x @ w1) @ w3 + jnp.tanh(x @ w2) @ w3

    args = [jax.ShapeDtypeStruct((4096, 512), jnp.float32),
            jax.ShapeDtypeStruct((512, 512), jnp.float32),
            jax.ShapeDtypeStruct((512, 512), jnp.float32),
            jax.ShapeDtypeStruct((512, 512), jnp.float32)]
    exported = jax.export.export(jax.jit(step), platforms=("tpu",))(*args)
    state = compile_bytes(bytes(exported.serialize()), "step.jaxexport",
                          make_options("2x4", device="tpu-v5e", mesh_views="off")).state
    shared = state.space.reads_via
    assert shared
    node_of, edges = state.space.node_of, state.problem.edges
    for (op_index, _), (source, _) in shared.items():
        (edge,) = [e for e in edges if e.dst == node_of[op_index] and e.src == node_of[source]
                   and f"reads it) -> %{op_index}" in e.label]
        assert edge.via is not None and edges[edge.via].dst == node_of[source]
