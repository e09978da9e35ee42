"""The liveness sweep (solver/liveness.py): its events rebuild, point by point, what each live
point holds by the rules written out directly here, and the evaluator and the ILP's memory model
built on it agree with a from-scratch sum."""

from __future__ import annotations

import dataclasses
import random

import pytest
from test_solver import random_problem

from hloplan.solver.evaluate import evaluate
from hloplan.solver.liveness import Liveness, accumulator_spans, first_live_points, sweep
from hloplan.solver.model import compile_model
from hloplan.solver.problem import LiveRange, ShardingProblem, Solution


def _problem(seed: int, fractional: bool = False) -> ShardingProblem:
    """A random problem with listed and ranged nodes, transient bytes, loop accumulators (every
    third node's odd strategies) and copies (some held over a span, some at the reader's made
    point only)."""
    base = random_problem(seed, 10, 3, 12, transients=True)
    rng = random.Random(seed)
    count = len(base.live_points)
    listed = {i for point in base.live_points for i in point.nodes}
    ranges = []
    for i in range(10):
        if i not in listed and count > 1:
            first, last = sorted(rng.sample(range(count), 2))
            made_at = rng.choice([None, last])
            ranges.append(LiveRange(i, first, last, made=rng.random() < 0.8,
                                    made_at=None if made_at == first else made_at))
    edges = tuple(dataclasses.replace(e, copies=(5.0, 7.0, 0.0),
                                      held=(1, count - 1) if i % 2 else None)
                  for i, e in enumerate(base.edges))
    nodes = tuple(node if i % 3 else dataclasses.replace(node, strategies=tuple(
        dataclasses.replace(s, accumulators=4.0 * (k % 2)) for k, s in enumerate(node.strategies)))
        for i, node in enumerate(base.nodes))
    problem = dataclasses.replace(base, nodes=nodes, edges=edges, live_ranges=tuple(ranges))
    if fractional:  # bytes that are not whole numbers take the evaluator's other path
        problem = dataclasses.replace(problem, nodes=tuple(
            dataclasses.replace(node, strategies=tuple(
                dataclasses.replace(s, memory=s.memory / 3.0) for s in node.strategies))
            for node in problem.nodes))
    problem.validate()
    return problem


@pytest.mark.parametrize("seed", range(6))
def test_sweep_events_rebuild_what_each_point_holds(seed):
    problem = _problem(seed)
    made = first_live_points(problem)
    spans = Liveness(problem).spans
    live: dict[int, int] = {}
    transient: set[int] = set()
    copies: set[int] = set()
    accumulating: set[int] = set()
    # Loop accumulators: from the made point of the first node that can loop to each one's.
    loops = {n: at for n, at in made.items()
             if any(s.accumulators for s in problem.nodes[n].strategies)}
    start = min(loops.values(), default=0)
    assert accumulator_spans(problem) == sorted((n, start, at) for n, at in loops.items())
    points = list(sweep(problem))
    assert [e.point for e in points] == list(range(len(problem.live_points)))
    for events in points:
        p = events.point
        for index in events.entering:
            live[index] = live.get(index, 0) + 1
        for index in events.leaving:
            live[index] -= 1
        transient |= set(events.transient_in)
        transient -= set(events.transient_out)
        copies |= set(events.copies_in)
        copies -= set(events.copies_out)
        accumulating |= set(events.accumulating_in)
        accumulating -= set(events.accumulating_out)
        assert accumulating == {n for n, at in loops.items() if start <= p <= at}
        assert {n for n, c in live.items() if c} == set(problem.nodes_at(p))
        assert all(c in (0, 1) for c in live.values())
        # Transient bytes: held where the node is made, by nodes that have some.
        assert transient == {n for n, at in made.items() if at == p
                             and any(s.transient for s in problem.nodes[n].strategies)}
        assert copies == {e for e, start, end in spans if start <= p <= end}
        assert events.fixed_bytes == problem.live_points[p].fixed_bytes
    assert any(events.transient_in for events in points)
    assert any(events.copies_in for events in points)
    assert any(events.accumulating_in for events in points)


def _from_scratch(problem: ShardingProblem, solution: Solution, copies: bool) -> list[float]:
    """Bytes per point, summed afresh from the rules."""
    picked = [n.strategies[i] for n, i in zip(problem.nodes, solution.choice, strict=True)]
    made = first_live_points(problem)
    out = []
    for p, point in enumerate(problem.live_points):
        total = point.fixed_bytes + sum(picked[n].memory for n in problem.nodes_at(p))
        total += sum(picked[n].transient for n, at in made.items() if at == p)
        total += sum(picked[n].accumulators for n, start, end in accumulator_spans(problem)
                     if start <= p <= end)
        for e, start, end in Liveness(problem).spans if copies else ():
            edge = problem.edges[e]
            i, j = solution.choice[edge.src], solution.choice[edge.dst]
            if start <= p <= end and edge.costs[i][j] > 0:
                total += edge.copies[j]
        out.append(total)
    return out


@pytest.mark.parametrize("fractional", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_evaluator_and_ilp_memory_follow_the_rules(seed, fractional):
    problem = _problem(seed, fractional)
    rng = random.Random(seed)
    model = compile_model(problem)
    for _ in range(5):
        choice = [rng.randrange(g.size) for g in model.groups]
        solution = model.to_choice(choice)
        for copies in (True, False):
            assert evaluate(problem, solution, copies).memory == pytest.approx(
                _from_scratch(problem, solution, copies), rel=1e-12)
        # The ILP's model leaves the copies out (passes/solve_sharding.py adds them back).
        assert tuple(model.memory.choice_loads(choice)) == pytest.approx(
            _from_scratch(problem, solution, False), rel=1e-12)


def test_a_node_that_holds_no_results_holds_its_transient_bytes_where_it_is_made():
    """ShardingProblem.made_only: a node none of whose values is written out holds its
    transient bytes (and the copies it reads) at its point, and never its results; a point
    dropped by with_live_points takes that along."""
    from hloplan.solver.problem import LivePoint, Node, Strategy

    nodes = (Node("a", (Strategy("s", memory=10.0),)),
             Node("fused", (Strategy("s", memory=100.0, transient=7.0),)))
    points = tuple(LivePoint((0,)) for _ in range(3))
    problem = ShardingProblem(nodes, live_points=points, made_only=((1, 1),))
    problem.validate()
    assert first_live_points(problem) == {0: 0, 1: 1}
    assert evaluate(problem, Solution((0, 0))).memory == (10.0, 17.0, 10.0)
    assert evaluate(problem.with_live_points([1, 2]), Solution((0, 0))).memory == (17.0, 10.0)
    assert evaluate(problem.with_live_points([0, 2]), Solution((0, 0))).memory == (10.0, 10.0)
    with pytest.raises(ValueError, match="has a live range"):
        dataclasses.replace(problem, live_ranges=(LiveRange(1, 0, 2),)).validate()
