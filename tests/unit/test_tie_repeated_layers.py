"""tie-repeated-layers: copies of an unrolled layer share one decision, other ops do not."""

from __future__ import annotations

import dataclasses
import itertools
import random
from collections import defaultdict

import jax
import jax.numpy as jnp
import pytest
from jax import export

from hloplan import ir
from hloplan.compiler import make_options
from hloplan.passes.build_sharding_problem import BuildShardingProblem
from hloplan.passes.extract_graph import ExtractGraph
from hloplan.passes.inline_calls import InlineCalls
from hloplan.passes.propagate_sharding import PropagateSharding
from hloplan.passes.solve_sharding import SolveSharding
from hloplan.passes.tie_repeated_layers import (
    TieRepeatedLayers,
    decision_count,
    dominant_live_points,
    structural_colors,
    tie_ids,
)
from hloplan.passmanager import run_passes
from hloplan.solver.axes import full_problem_variables
from hloplan.solver.evaluate import evaluate
from hloplan.solver.model import compile_model
from hloplan.solver.problem import (
    Edge,
    LivePoint,
    Node,
    ShardingProblem,
    Solution,
    Strategy,
)

LAYERS = 6
WIDTH = 64


def _mlp_stack_step(params, x, y):
    def loss(ps):
        h = x
        for p in ps["layers"]:  # unrolled: the same lines emit every layer's ops
            h = jnp.tanh(h @ p["w"] + p["b"])
        return jnp.mean((h @ ps["head"] - y) ** 2)

    value, grads = jax.value_and_grad(loss)(params)
    return value, jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)


def _stack_program_args():
    f32 = jnp.float32
    layer = {"w": jax.ShapeDtypeStruct((WIDTH, WIDTH), f32), "b": jax.ShapeDtypeStruct((WIDTH,), f32)}
    params = {"layers": [layer] * LAYERS, "head": jax.ShapeDtypeStruct((WIDTH, 16), f32)}
    return params, jax.ShapeDtypeStruct((32, WIDTH), f32), jax.ShapeDtypeStruct((32, 16), f32)


def _stack_program() -> ir.Program:
    exported = export.export(jax.jit(_mlp_stack_step), platforms=("cpu",))(*_stack_program_args())
    return ir.load_program(bytes(exported.serialize()), "stack.jaxexport")


def _distinct_roles_step(w, u, x):
    # w and u have one shape but different roles: w multiplies, u is added.
    return jnp.sum(jnp.tanh(x @ w) + u)


def _roles_program() -> ir.Program:
    s = jax.ShapeDtypeStruct((WIDTH, WIDTH), jnp.float32)
    exported = export.export(jax.jit(_distinct_roles_step), platforms=("cpu",))(s, s, s)
    return ir.load_program(bytes(exported.serialize()), "roles.jaxexport")


FRONT = [InlineCalls(), ExtractGraph(), BuildShardingProblem()]


def _run(program: ir.Program, passes, mesh: str = "2x4"):
    return run_passes(program, make_options(mesh, device="toy"), passes)


@pytest.fixture(scope="module")
def stack_states():
    """(untied state, tied state) of the MLP stack on a 2x4 mesh (no solve)."""
    untied = _run(_stack_program(), list(FRONT))
    tied = _run(_stack_program(), [*FRONT, TieRepeatedLayers(min_decisions=0)])
    return untied, tied


def _groups(problem: ShardingProblem) -> dict[int, list[int]]:
    groups = defaultdict(list)
    for i, node in enumerate(problem.nodes):
        if node.tie is not None:
            groups[node.tie].append(i)
    return groups


def _arg_node(state, name: str | int) -> int:
    index = name if isinstance(name, int) else state.graph.argument_names.index(name)
    op = state.graph.values[state.graph.arguments[index]].producer
    return state.space.node_of[op]


def _forward_dots(state) -> list[int]:
    """Nodes of the forward matmuls h @ w, one per layer, in layer order."""
    graph, nodes = state.graph, []
    for op in graph.ops:
        if op.name == "stablehlo.dot_general" and "transpose" not in op.label:
            if graph.type_of(op.results[0]).shape == (32, WIDTH):
                nodes.append(state.space.node_of[op.index])
    return nodes


def test_interior_layers_share_decisions(stack_states):
    untied, tied = stack_states
    problem = tied.problem
    problem.validate()
    dots = _forward_dots(tied)
    assert len(dots) == LAYERS
    ties = [problem.nodes[n].tie for n in dots]
    # Interior layers look alike for `hops` rounds in both directions: one decision.
    interior = ties[2:-2]
    assert interior[0] is not None and len(set(interior)) == 1
    # The parameters of the interior layers are tied, and to nothing of another role.
    w2 = _arg_node(tied, "params.layers[2].w")
    w3 = _arg_node(tied, "params.layers[3].w")
    assert problem.nodes[w2].tie is not None and problem.nodes[w2].tie == problem.nodes[w3].tie
    head = _arg_node(tied, "params.head")
    assert problem.nodes[head].tie != problem.nodes[w2].tie
    # Fewer decisions than before, reported in facts and as a remark.
    facts = tied.facts
    assert facts["decisions_after_tying"] < facts["decisions_before_tying"]
    assert facts["decisions_before_tying"] == decision_count(untied.problem)
    assert facts["decisions_after_tying"] == decision_count(problem)
    assert facts["tied_groups"] > 0 and facts["tied_nodes"] >= 2 * facts["tied_groups"]
    assert any(d.severity == "remark" and "tie-repeated-layers" in d.message
               for d in tied.log.entries)


def test_ties_only_join_equal_strategy_lists_and_keep_follower_groups(stack_states):
    untied, tied = stack_states
    graph, space = tied.graph, tied.space
    for members in _groups(tied.problem).values():
        # Followers name their strategies their own way; alike ops in one group agree.
        by_kind = defaultdict(set)
        for i in members:
            op = graph.ops[space.op_of[i]]
            kind = (op.name, tuple(str(graph.type_of(v)) for v in op.results))
            by_kind[kind].add(tuple(s.name for s in tied.problem.nodes[i].strategies))
        assert all(len(names) == 1 for names in by_kind.values())
    # Nodes that followed one leader before still share a decision.
    for members in _groups(untied.problem).values():
        assert len({tied.problem.nodes[i].tie for i in members}) == 1
    # Only ties were added: strategies, edges and live points are unchanged (but for the
    # spans of resharded copies, over the kept points).
    assert [dataclasses.replace(n, tie=None) for n in tied.problem.nodes] == [
        dataclasses.replace(n, tie=None) for n in untied.problem.nodes]
    assert [dataclasses.replace(e, held=None, copies=()) for e in tied.problem.edges] == [
        dataclasses.replace(e, held=None, copies=()) for e in untied.problem.edges]
    # Live points: a subset, in order (the dominated ones are dropped).
    kept = iter(untied.problem.live_points)
    assert all(any(p == q for q in kept) for p in tied.problem.live_points)


def test_same_shape_arguments_with_different_roles_stay_apart():
    state = _run(_roles_program(), [*FRONT, TieRepeatedLayers(min_decisions=0)])
    w, u = _arg_node(state, 0), _arg_node(state, 1)
    nodes = state.problem.nodes
    assert nodes[w].tie is None or nodes[w].tie != nodes[u].tie


def test_alike_ops_with_different_strategy_lists_are_not_tied(stack_states):
    _, tied = stack_states
    state = dataclasses.replace(tied)  # a shallow copy: graph and space are only read
    problem = state.problem
    # Give every op the same colour: only the strategy lists can keep them apart now.
    colors = [0] * len(state.graph.ops)
    untied = dataclasses.replace(problem, nodes=tuple(
        dataclasses.replace(n, tie=None) for n in problem.nodes))
    ties = tie_ids(state.graph, state.space, untied, colors)
    joined = defaultdict(set)
    for node, tie in zip(untied.nodes, ties):
        if tie is not None:
            joined[tie].add(tuple(s.name for s in node.strategies))
    assert joined and all(len(names) == 1 for names in joined.values())


def test_tie_ids_merge_existing_groups_by_union():
    # Nodes 0-1 and 2-3 were follower groups (tie ids 10, 12); 1 and 3 look alike, so both
    # groups become one; node 4 looks like node 0 but has another strategy list: left alone.
    two = (Strategy("a"), Strategy("b"))
    other = (Strategy("a"), Strategy("c"))
    problem = ShardingProblem((Node("n0", two, tie=10), Node("n1", two, tie=10),
                               Node("n2", two, tie=12), Node("n3", two, tie=12),
                               Node("n4", other)))

    @dataclasses.dataclass
    class Op:
        index: int
        name: str = "stablehlo.add"
        results: tuple = ()

    @dataclasses.dataclass
    class Graph:
        ops: list

    @dataclasses.dataclass
    class Space:
        op_of: list
        node_of: dict

    ops = [Op(i) for i in range(15)]
    op_of = [10, 11, 12, 13, 14]
    colors = [0] * 15
    colors[10], colors[11], colors[12], colors[13], colors[14] = 1, 2, 3, 2, 1
    ties = tie_ids(Graph(ops), Space(op_of, {o: n for n, o in enumerate(op_of)}), problem, colors)
    assert ties == [10, 10, 10, 10, None]


def test_colors_are_deterministic_and_refine(stack_states):
    _, tied = stack_states
    once = structural_colors(tied.graph, tied.space, 3)
    again = structural_colors(tied.graph, tied.space, 3)
    assert once == again
    coarse = structural_colors(tied.graph, tied.space, 0)
    # More rounds only split classes.
    assert len(set(once)) >= len(set(coarse))
    by_fine = {}
    for fine, rough in zip(once, coarse):
        assert by_fine.setdefault(fine, rough) == rough


def test_tied_plan_solves_and_matches_untied_optimum():
    state = _run(_stack_program(), [*FRONT, TieRepeatedLayers(compare_untied=True, min_decisions=0),
                                    SolveSharding(), PropagateSharding()], mesh="4")
    facts = state.facts
    assert facts["untied_status"] == "optimal" and facts["tied_status"] == "optimal"
    # Tying shrinks the ILP's formulation (what the solver reports is after reduce.eliminate,
    # which turns this untied stack, a chain, into no ILP at all).
    untied = dataclasses.replace(state.problem, nodes=tuple(
        dataclasses.replace(n, tie=None) for n in state.problem.nodes))
    assert (full_problem_variables(compile_model(state.problem))
            < full_problem_variables(compile_model(untied)))
    # Tying restricts the choice: never better than the untied optimum, here no worse either.
    assert -1e-9 <= facts["tied_gap"] <= 0.01
    chosen = defaultdict(set)
    for i, node in enumerate(state.problem.nodes):
        if node.tie is not None:
            chosen[node.tie].add(state.solution.choice[i])
    assert all(len(c) == 1 for c in chosen.values())


def test_while_loop_programs_pass_through(fixtures_dir):
    data = (fixtures_dir / "scan_train_step.jaxexport").read_bytes()
    state = _run(ir.load_program(data, "scan.jaxexport"), [*FRONT, TieRepeatedLayers(min_decisions=0)])
    state.problem.validate()
    assert state.facts["decisions_after_tying"] <= state.facts["decisions_before_tying"]


def test_pruned_memory_checks_keep_the_peak_of_every_tied_choice(stack_states):
    untied, tied = stack_states
    # The fixture's tied problem has its dominated live points dropped.
    assert len(tied.problem.live_points) < len(untied.problem.live_points)
    assert tied.facts["live_points_after_pruning"] == len(tied.problem.live_points)
    full = dataclasses.replace(tied.problem, live_points=untied.problem.live_points,
                               live_ranges=untied.problem.live_ranges,
                               edges=untied.problem.edges,
                               made_only=untied.problem.made_only)
    assert dominant_live_points(full) == [
        untied.problem.live_points.index(p) for p in tied.problem.live_points]
    rng = random.Random(0)
    for _ in range(20):  # any choice that respects the ties: same peak, same point bytes
        by_tie: dict[int, int] = {}
        choice = tuple(by_tie.setdefault(n.tie, rng.randrange(len(n.strategies)))
                       if n.tie is not None else rng.randrange(len(n.strategies))
                       for n in full.nodes)
        assert (evaluate(full, Solution(choice)).peak_memory
                == evaluate(tied.problem, Solution(choice)).peak_memory)


def test_dominated_points_are_dropped_exactly():
    two = (Strategy("a", memory=1.0), Strategy("b", memory=4.0))
    nodes = (Node("x", two), Node("y", two), Node("z", two), Node("c", (Strategy("r", memory=7.0),)))
    points = (
        LivePoint((0,), 0.0),  # dominated by (0, 1): fewer nodes of x's class
        LivePoint((0, 1), 0.0),
        LivePoint((0, 2), 5.0),  # x+z vs x+y: different decisions, both kept
        LivePoint((1, 3), 0.0),  # y + a constant 7 bytes: kept (more constant bytes)
        LivePoint((1, 0), 0.0),  # same as (0, 1): one of the two goes
    )
    problem = ShardingProblem(nodes, live_points=points)
    assert dominant_live_points(problem) == [1, 2, 3]
    tied = dataclasses.replace(problem, nodes=(nodes[0], dataclasses.replace(nodes[1], tie=9),
                                               dataclasses.replace(nodes[2], tie=9), nodes[3]))
    # y and z are one decision with the same memory: x+z is now x+y plus 5 fixed bytes.
    assert dominant_live_points(tied) == [2, 3]


def test_points_holding_a_resharded_copy_are_kept_and_spans_follow_the_kept_points():
    two = (Strategy("a", memory=1.0), Strategy("b", memory=4.0))
    nodes = (Node("x", two), Node("y", two), Node("w", two))
    gathered = ((0.0, 1.0), (1.0, 0.0))  # a copy when x and w differ: 10 bytes
    points = (LivePoint((0, 2)), LivePoint((0, 1, 2)), LivePoint((0, 1, 2)))

    def with_copy(held):
        return ShardingProblem(nodes, (Edge(2, 0, gathered, copies=(10.0, 10.0), held=held),),
                               points)

    # Held at the first point only, the copy keeps it: 2 + 10 bytes beat the next's 3.
    assert dominant_live_points(with_copy((0, 0))) == [0, 2]
    # Held over all three, the point with one node fewer is dominated again.
    assert dominant_live_points(with_copy((0, 2))) == [2]
    for held in ((0, 0), (0, 1), (1, 2), (0, 2)):
        problem = with_copy(held)
        kept = dominant_live_points(problem)
        pruned = problem.with_live_points(kept)
        pruned.validate()
        for choice in itertools.product(range(2), repeat=3):
            full = evaluate(problem, Solution(choice))
            assert evaluate(pruned, Solution(choice)).peak_memory == full.peak_memory
            assert evaluate(pruned, Solution(choice)).memory == tuple(full.memory[p] for p in kept)


def _square_stack_program() -> ir.Program:
    """Eight identical wide square layers on a small batch: tensor parallel wins, and the best
    plan alternates column- and row-split weights from one layer to the next."""
    def loss(ws, x):
        for w in ws:
            x = jnp.tanh(x @ w)
        return jnp.sum(x)

    def step(ws, x):
        value, grads = jax.value_and_grad(loss)(ws, x)
        return value, [w - 0.1 * g for w, g in zip(ws, grads)]

    w = jax.ShapeDtypeStruct((4096, 4096), jnp.float32)
    x = jax.ShapeDtypeStruct((8, 4096), jnp.float32)
    exported = export.export(jax.jit(step), platforms=("cpu",))([w] * 8, x)
    return ir.load_program(bytes(exported.serialize()), "square.jaxexport")


def test_period_two_lets_identical_layers_alternate():
    facts = {}
    for period in (1, 2):
        state = run_passes(_square_stack_program(), make_options("4", device="h100"), [
            *FRONT, TieRepeatedLayers(compare_untied=True, min_decisions=0, period=period)])
        facts[period] = state.facts
        assert state.facts["tied_gap_exact"]
    # One shared decision per layer cannot alternate: it pays for it (little, since
    # reduce-scatter + all-gather of the small activations replaces the alternation).
    assert facts[1]["tied_gap"] > 1e-4
    # Two decisions in turn can: the untied optimum, with fewer decisions than untied.
    assert abs(facts[2]["tied_gap"]) < 1e-9
    assert (facts[1]["decisions_after_tying"] < facts[2]["decisions_after_tying"]
            < facts[2]["decisions_before_tying"])


def test_compile_reports_tying_and_its_price_in_plan_json(tmp_path):
    """`hloplan compile --pass-option tie-repeated-layers.compare_untied=true`: plan.json says
    what was tied and how far the tied plan is from the untied optimum; a remark says it too."""
    import json

    from click.testing import CliRunner

    from hloplan.cli import main

    exported = export.export(jax.jit(_mlp_stack_step), platforms=("cpu",))(
        *_stack_program_args())
    source = tmp_path / "stack.jaxexport"
    source.write_bytes(bytes(exported.serialize()))
    out = tmp_path / "plan"
    result = CliRunner().invoke(main, [
        "compile", str(source), "--mesh", "4", "--device", "toy", "-o", str(out), "--format",
        "json", "--pass-option", "tie-repeated-layers.min_decisions=0",
        "--pass-option", "tie-repeated-layers.compare_untied=true"])
    assert result.exit_code == 0, result.output
    plan = json.loads((out / "plan.json").read_text())
    tying = plan["solver"]["tying"]
    assert tying["groups"] > 0 and tying["decisions_after"] < tying["decisions_before"]
    assert tying["untied_status"] == "optimal" and tying["gap_to_untied_exact"] is True
    assert -1e-9 <= tying["gap_to_untied"] <= 0.01
    remarks = [d["message"] for d in plan["diagnostics"] if d["severity"] == "remark"]
    assert any("from the untied optimum" in m for m in remarks), remarks
    explained = CliRunner().invoke(main, ["explain", str(out)])
    assert explained.exit_code == 0, explained.output
    assert "from the untied optimum" in explained.output and "repeated layers:" in explained.output
    # Without the option the same program is small enough to solve untied: nothing tied.
    plain = CliRunner().invoke(main, ["compile", str(source), "--mesh", "4", "--device", "toy",
                                      "-o", str(tmp_path / "plain"), "-q"])
    assert plain.exit_code == 0, plain.output
    plain_plan = json.loads((tmp_path / "plain" / "plan.json").read_text())
    assert plain_plan["solver"]["tying"] == {"groups": 0}


def test_unknown_pass_option_is_a_usage_error(tmp_path):
    from click.testing import CliRunner

    from hloplan.cli import main

    out = tmp_path / "plan"
    result = CliRunner().invoke(main, ["compile", "-", "--mesh", "4", "-o", str(out),
                                       "--pass-option", "tie-repeated-layers.no_such_field=1"],
                                input="module {}")
    assert result.exit_code == 2, result.output
    assert "expected PASS.FIELD=VALUE" in result.output
    assert not out.exists()


def test_describe_comparison_separates_exact_and_bounded_gaps():
    from hloplan.passes.tie_repeated_layers import describe_comparison

    exact = {"untied_status": "optimal", "tied_status": "optimal", "untied_variables": 10,
             "tied_gap": 0.0004, "tied_gap_exact": True}
    assert "+0.040% from the untied optimum" in describe_comparison(exact)
    bounded = {**exact, "untied_status": "time_limit", "tied_gap": -0.05, "tied_gap_exact": False,
               "tied_gap_bound": 0.002}
    line = describe_comparison(bounded)
    assert "-5.000% from the untied incumbent" in line and "at most +0.200% above its bound" in line
    assert "not compared" in describe_comparison({"untied_status": "failed: SolverError"})
