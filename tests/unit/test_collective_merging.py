"""Which collectives XLA can merge: the planner amortises the latency of gradient all-reduces
over the combiner's buffer, but a collective whose result a later matmul reads (a partial sum
before the next layer, batch statistics) is on the step's dependency chain and pays in full."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hloplan.cost_models import CommModel, load_device_model
from hloplan.graph import Graph, TensorType
from hloplan.mesh import parse_mesh
from hloplan.op_rules import feeding_matmuls, rule_for
from hloplan.passes.build_sharding_problem import _ProblemBuilder

ACT = TensorType((4096, 512), "f32")  # batch x features
W = TensorType((512, 512), "f32")
STAT = TensorType((512,), "f32")
MATMUL = {"lhs_batch": [], "rhs_batch": [], "lhs_contracting": [1], "rhs_contracting": [0]}
GRAD = {"lhs_batch": [], "rhs_batch": [], "lhs_contracting": [0], "rhs_contracting": [0]}


def _step() -> tuple[Graph, dict[str, int]]:
    """h = x @ w1; mean over the batch (batch statistics) scales h; y = h' @ w2; the weight
    gradient x^T @ y is returned."""
    g = Graph()
    x, w1, w2 = (g.add_op("arg", (), [t]).results[0] for t in (ACT, W, W))
    g.arguments = [x, w1, w2]
    h = g.add_op("stablehlo.dot_general", (x, w1), [ACT], attrs=MATMUL)
    mean = g.add_op("stablehlo.reduce", (h.results[0],), [STAT],
                    attrs={"dimensions": [0], "combiner": "stablehlo.add"})
    wide = g.add_op("stablehlo.broadcast_in_dim", (mean.results[0],), [ACT],
                    attrs={"broadcast_dimensions": [1]})
    scaled = g.add_op("stablehlo.multiply", (h.results[0], wide.results[0]), [ACT])
    y = g.add_op("stablehlo.dot_general", (scaled.results[0], w2), [ACT], attrs=MATMUL)
    grad = g.add_op("stablehlo.dot_general", (x, y.results[0]), [W], attrs=GRAD)
    g.outputs = [grad.results[0]]
    return g, {"mean": mean.index, "grad": grad.index, "scaled": scaled.index, "y": y.index}


def test_ops_feeding_a_matmul_are_found_and_gradients_are_not() -> None:
    g, ops = _step()
    feeding = feeding_matmuls(g)
    assert ops["mean"] in feeding and ops["scaled"] in feeding and ops["y"] in feeding
    assert ops["grad"] not in feeding


def test_a_loop_carry_feeds_the_next_iteration_through_its_back_edge() -> None:
    g = Graph()
    w = g.add_op("arg", (), [W]).results[0]
    carry = g.add_op("while.carry", (w,), [W], attrs={"result": 0}, parent=None)
    g.add_op("stablehlo.dot_general", (carry.results[0], carry.results[0]), [W], attrs=MATMUL)
    later = g.add_op("stablehlo.add", (carry.results[0], carry.results[0]), [W])
    carry.attrs["yield"] = later.results[0]
    g.values[later.results[0]].users.append(carry.index)
    assert later.index in feeding_matmuls(g)


def _all_reduce_costs(builder: _ProblemBuilder, g: Graph, index: int) -> list[float]:
    op = g.ops[index]
    strategies = builder._strategies(op, rule_for(g, op))
    return [s.communication for s in strategies if s.reduced_axes and "all-reduce" in s.name]


def test_chained_collectives_pay_their_whole_latency() -> None:
    g, ops = _step()
    mesh = parse_mesh("4x8")
    h100 = load_device_model("h100")
    merged = CommModel(h100, mesh, hosts=4, combine=h100.combiner)
    unmerged = CommModel(h100, mesh, hosts=4)
    builder = _ProblemBuilder(g, merged, False, SimpleNamespace(log=None))
    # The batch statistics' all-reduce over the batch axes: full latency (62 steps over
    # InfiniBand for both axes), as XLA cannot merge it with the next layer's.
    stats = _all_reduce_costs(builder, g, ops["mean"])
    assert stats
    full = unmerged.all_reduce(STAT.nbytes, (0, 1))
    assert max(stats) == pytest.approx(full)
    assert full > 62 * 10e-6
    # The weight gradient's all-reduce: its latency is amortised over a 30 MiB buffer.
    grads = _all_reduce_costs(builder, g, ops["grad"])
    assert grads
    assert min(grads) < unmerged.all_reduce(W.nbytes, (0, 1)) / 2


def test_a_plan_pays_one_launch_of_each_merged_collective() -> None:
    """The gradient's all-reduce prices only its share of the merged buffers' latency; the
    first buffer's launch is a launch of the problem, paid once by any plan that all-reduces a
    gradient over those axes. The batch statistics' chained all-reduce is in no launch."""
    g, ops = _step()
    mesh = parse_mesh("4x8")
    h100 = load_device_model("h100")
    merged = CommModel(h100, mesh, hosts=4, combine=h100.combiner)
    builder = _ProblemBuilder(g, merged, False, SimpleNamespace(log=None))
    space, problem = builder.build(float("inf"))
    grad, mean = space.node_of[ops["grad"]], space.node_of[ops["mean"]]
    launched = {node for launch in problem.launches for node, _ in launch.members}
    assert grad in launched and mean not in launched
    by_label = {launch.label: launch for launch in problem.launches}
    launch = by_label["all-reduce(x,y)"]
    assert launch.cost == pytest.approx(merged.launch_latency("all-reduce", ("x", "y")))
    assert launch.cost == pytest.approx(CommModel(h100, mesh, hosts=4).all_reduce(0.1, (0, 1)),
                                        rel=1e-3)
    # Exactly the strategies that all-reduce the gradient over both axes pay it.
    picks = dict(launch.members)[grad]
    strategies = problem.nodes[grad].strategies
    assert set(picks) == {i for i, s in enumerate(strategies)
                          if any(c[:2] == ("all-reduce", "x,y") for c in s.collectives)}
    assert merged.launch_latency("all-gather", ("x",)) == 0.0  # not merged: full price already


def test_launches_cheaper_than_the_threshold_are_left_to_the_shares() -> None:
    """BuildShardingProblem keeps a launch only when it costs at least min_launch_s: on 4 nodes
    an all-reduce launch over both axes is 0.62 ms (62 ring steps), under the 1 ms GPU default; over
    the 128 nodes of a 16x8x8 mesh it would be 20 ms."""
    g, ops = _step()
    h100 = load_device_model("h100")
    merged = CommModel(h100, parse_mesh("4x8"), hosts=4, combine=h100.combiner)
    assert merged.launch_latency("all-reduce", ("x", "y")) < 1e-3
    kept = _ProblemBuilder(g, merged, False, SimpleNamespace(log=None), min_launch_s=1e-3)
    _, problem = kept.build(float("inf"))
    assert problem.launches == ()
    big = CommModel(h100, parse_mesh("16x8x8"), hosts=128, combine=h100.combiner)
    assert big.launch_latency("all-reduce", ("x", "y", "z")) > 0.02


def test_a_tpu_model_prices_launches_from_a_tenth_of_a_millisecond() -> None:
    """On a TPU device model every merged launch of 0.1 ms or more is an ILP term: over
    v5e:16x16's 256 chips an all-reduce's 510 ring steps take 0.51 ms, under the 1 ms a GPU
    model starts at; over one 16-chip axis, 30 steps, it is left to the shares."""
    import jax
    import jax.numpy as jnp

    from hloplan.compiler import compile_bytes, make_options

    def step(w, x):
        grad = jax.grad(lambda w: jnp.mean(jnp.tanh(x @ w) ** 2))(w)
        return w - 0.1 * grad

    args = (jax.ShapeDtypeStruct((256, 256), jnp.float32),
            jax.ShapeDtypeStruct((1024, 256), jnp.float32))
    data = jax.export.export(jax.jit(step))(*args).serialize()
    state = compile_bytes(data, "step.jaxexport",
                          make_options("16x16", device="tpu-v5e", mesh_views="off")).state
    costs = {launch.label: launch.cost for launch in state.problem.launches}
    merged = CommModel(load_device_model("tpu-v5e"), parse_mesh("16x16"),
                       combine=load_device_model("tpu-v5e").combiner)
    assert costs["all-reduce(x,y)"] == pytest.approx(merged.launch_latency("all-reduce", (0, 1)))
    assert 1e-4 < costs["all-reduce(x,y)"] < 1e-3
    assert "all-reduce(x)" not in costs
    assert merged.launch_latency("all-reduce", (0,)) < 1e-4
