"""Solver, evaluator and explainer on hand-sized problems whose optimum is worked out here.

Costs are in milliseconds (MS) and memory in GiB so that the solver's internal scaling is
exercised with realistic magnitudes; each test writes out the arithmetic that decides the answer.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random

import pulp
import pytest

from hloplan.diagnostics import NoPlanFits
from hloplan.solver.evaluate import evaluate
from hloplan.solver.explain import compare, format_bytes, format_seconds, next_best
from hloplan.solver.ilp import InfeasibleError, SolverError, available_solvers, solve
from hloplan.solver.problem import (
    Edge,
    Launch,
    LivePoint,
    LiveRange,
    Node,
    ShardingProblem,
    Solution,
    Strategy,
)

MS = 1e-3
GIB = float(2**30)
BACKENDS = available_solvers()


def node(name: str, *strategies: tuple, tie: int | None = None) -> Node:
    """A node from (name, compute_ms, comm_ms, memory_gib[, collectives]) tuples."""
    built = []
    for spec in strategies:
        label, compute, comm, memory, *rest = spec
        built.append(
            Strategy(label, compute * MS, comm * MS, memory * GIB, tuple(rest[0]) if rest else ())
        )
    return Node(name, tuple(built), tie=tie)


def mismatch(cost_ms: float, k: int = 2) -> tuple[tuple[float, ...], ...]:
    """A k x k resharding matrix: free when both ends pick the same index, `cost_ms` otherwise."""
    return tuple(tuple(0.0 if i == j else cost_ms * MS for j in range(k)) for i in range(k))


def brute_force(problem: ShardingProblem) -> tuple[float, tuple[int, ...]]:
    """The optimum by enumeration: the reference for the solver on small problems."""
    sizes = [range(len(n.strategies)) for n in problem.nodes]
    best = (math.inf, ())
    for choice in itertools.product(*sizes):
        evaluation = evaluate(problem, Solution(choice))
        if evaluation.feasible and evaluation.total < best[0]:
            best = (evaluation.total, choice)
    return best


def random_problem(
    seed: int, n: int, k: int, m: int, *, ties: bool = False, tight: float = 0.5,
    launches: int = 0, transients: bool = False,
) -> ShardingProblem:
    """A reproducible random problem with dense edges, live points and a budget between the
    smallest and largest possible peaks (`tight` = 0 is the smallest), and `launches` costs
    each paid once when some of its member nodes pick one of its strategies."""
    rng = random.Random(seed)
    nodes = []
    for i in range(n):
        tie = i % 3 if ties and i < 6 else None
        strategies = tuple(
            (f"s{j}", rng.uniform(0, 1), rng.uniform(0, 1), rng.choice([0.25, 0.5, 1, 2]))
            for j in range(k)
        )
        made = node(f"n{i}", *strategies, tie=tie)
        if transients:  # some strategies hold more bytes where the node is first live
            made = Node(made.name, tuple(
                Strategy(st.name, st.compute_cost, st.communication_cost, st.memory,
                         transient=rng.choice([0.0, 0.0, 1.0, 3.0]) * GIB)
                for st in made.strategies), tie=made.tie)
        nodes.append(made)
    edges = []
    for _ in range(m):
        a, b = rng.sample(range(n), 2)
        costs = tuple(
            tuple(0.0 if i == j else rng.uniform(0, 2) * MS for j in range(k)) for i in range(k)
        )
        edges.append(Edge(a, b, costs))
    points = tuple(
        LivePoint(tuple(rng.sample(range(n), min(n, 6))), 0.5 * GIB, f"p{p}")
        for p in range(max(1, n // 4))
    )

    def extreme(pick) -> float:
        return max(
            lp.fixed_bytes + sum(pick(s.memory for s in nodes[i].strategies) for i in lp.nodes)
            for lp in points
        )

    budget = extreme(min) + tight * (extreme(max) - extreme(min))
    paid = tuple(
        Launch(f"l{q}", rng.uniform(0.5, 3) * MS, tuple(
            (i, tuple(sorted(rng.sample(range(k), rng.randint(1, k - 1)))))
            for i in sorted(rng.sample(range(n), rng.randint(1, 3)))))
        for q in range(launches)
    )
    return ShardingProblem(tuple(nodes), tuple(edges), points, budget, f"random{seed}",
                           launches=paid)


# --------------------------------------------------------------------------- choices


def test_edge_costs_change_the_choice():
    # a: R=3, S=2; b: R=1, S=5 (ms). Alone: a=S, b=R, 2 + 1 = 3 ms.
    a = node("a", ("R", 3, 0, 1), ("S", 2, 0, 1))
    b = node("b", ("R", 1, 0, 1), ("S", 5, 0, 1))
    alone = ShardingProblem((a, b))
    solution, stats = solve(alone)
    assert solution.choice == (1, 0)
    assert stats.objective == pytest.approx(3 * MS)
    # A 10 ms reshard on mismatch: (R,R) = 3+1 = 4 beats (S,S) = 2+5 = 7 and (S,R) = 2+1+10 = 13.
    coupled = ShardingProblem((a, b), (Edge(0, 1, mismatch(10)),))
    solution, stats = solve(coupled)
    assert solution.choice == (0, 0)
    assert stats.status == "optimal"
    assert stats.objective == pytest.approx(4 * MS)
    assert stats.gap == pytest.approx(0, abs=1e-6)


def test_memory_budget_forces_costlier_strategy():
    # R: 1 ms, 8 GiB; S: 2 ms (+0.5 ms comm), 4 GiB. Fixed 1 GiB at the live point.
    # Budget 6 GiB: R needs 1+8 = 9 > 6, S needs 1+4 = 5 <= 6, so S at 2.5 ms.
    a = node("a", ("R", 1, 0, 8), ("S", 2, 0.5, 4))
    problem = ShardingProblem(
        (a, node("b", ("R", 1, 0, 1), ("S", 1, 0, 1))),
        (Edge(0, 1, mismatch(0.1)),),
        (LivePoint((0,), 1 * GIB, "after a"),),
        6 * GIB,
    )
    solution, stats = solve(problem)
    assert solution.choice[0] == 1
    # b follows a to avoid the 0.1 ms reshard: 2.5 + 1 = 3.5 ms.
    assert solution.choice[1] == 1
    assert stats.objective == pytest.approx(3.5 * MS)
    evaluation = evaluate(problem, solution)
    assert evaluation.peak_memory == 5 * GIB
    assert evaluation.feasible


def test_transient_bytes_count_at_the_first_live_point_only():
    # g: "all-reduce" 2 ms, 4 GiB of partial sums kept; "reduce-scatter" 1 ms, 1 GiB kept but
    # 4 GiB while made (3 GiB transient). h (2 GiB) is born at the next point, while g lives.
    # Budget 5.5 GiB: points 0/1 hold g and g + h. All-reduce: 4 / 6 GiB (over);
    # reduce-scatter: 1 + 3 / 1 + 2 = 4 / 3 GiB: fits. Budget 3.5 GiB: only the transient,
    # counted at point 0 alone, keeps reduce-scatter out (4 > 3.5): nothing fits.
    g = Node("g", (Strategy("all-reduce", 2 * MS, 0.0, 4 * GIB),
                   Strategy("reduce-scatter", 1 * MS, 0.0, 1 * GIB, transient=3 * GIB)))
    h = Node("h", (Strategy("r", 0.0, 0.0, 2 * GIB),))
    points = (LivePoint((), 0.0, "after g"), LivePoint((), 0.0, "after h"))
    ranges = (LiveRange(0, 0, 1), LiveRange(1, 1, 1))
    problem = ShardingProblem((g, h), (), points, 5.5 * GIB, live_ranges=ranges)
    problem.validate()
    assert evaluate(problem, Solution((1, 0))).memory == (4 * GIB, 3 * GIB)
    assert evaluate(problem, Solution((0, 0))).memory == (4 * GIB, 6 * GIB)
    for backend in BACKENDS:
        solution, _ = solve(problem, solver=backend)
        assert solution.choice == (1, 0)
    tight = ShardingProblem((g, h), (), points, 3.5 * GIB, live_ranges=ranges)
    with pytest.raises(InfeasibleError) as info:
        solve(tight)
    assert info.value.details.min_peak == 4 * GIB


def test_infeasible_budget_reports_shortfall():
    # The smallest peak is fixed 1 GiB + S's 4 GiB = 5 GiB; a 4 GiB budget is short by 1 GiB.
    a = node("a", ("R", 1, 0, 8), ("S", 2, 0, 4))
    b = node("b", ("R", 1, 0, 1), ("S", 1, 0, 1))
    problem = ShardingProblem(
        (a, b), (Edge(0, 1, mismatch(1)),), (LivePoint((0,), 1 * GIB, "after a"),), 4 * GIB
    )
    with pytest.raises(InfeasibleError) as info:
        solve(problem)
    details = info.value.details
    assert details.proven
    assert details.min_peak == 5 * GIB
    assert details.shortfall == 1 * GIB
    assert details.live_point_label == "after a"
    assert details.fixed_bytes == 1 * GIB
    assert details.dominant[0] == (0, "a", 4 * GIB)
    assert "1.00 GiB over budget" in str(info.value)


def test_infeasible_budget_with_resharded_copies_is_a_lower_bound():
    """B reads A in another layout whatever both pick (a 40-byte copy on every pairing): the
    smallest peak the ILP's model finds (20 bytes) leaves the copy out, so the message says
    "at least" and what the plan reaching it holds with its copy (60 bytes)."""
    a = Node("A", (Strategy("x", 0.0, memory=10.0), Strategy("y", 1.0, memory=10.0)))
    b = Node("B", (Strategy("p", 0.0, memory=10.0), Strategy("q", 0.6, memory=10.0)))
    always = Edge(0, 1, ((0.5, 0.5), (0.5, 0.5)), copies=(40.0, 40.0))
    problem = ShardingProblem((a, b), (always,), (LivePoint((0,)), LivePoint((0, 1))), 5.0)
    with pytest.raises(InfeasibleError) as info:
        solve(problem)
    details = info.value.details
    assert details.min_peak == 20.0 and not details.proven
    assert details.with_copies == 60.0
    assert "the smallest achievable peak is at least 20 B" in str(info.value)
    assert "peaks at 60 B with the resharded copies" in str(info.value)


def test_fixed_bytes_alone_over_budget():
    # 10 GiB fixed already exceeds 6 GiB; with a's smallest 4 GiB the peak is at least 14 GiB.
    a = node("a", ("R", 1, 0, 8), ("S", 2, 0, 4))
    problem = ShardingProblem((a,), (), (LivePoint((0,), 10 * GIB),), 6 * GIB)
    with pytest.raises(InfeasibleError) as info:
        solve(problem)
    assert info.value.details.min_peak == 14 * GIB
    assert info.value.details.shortfall == 8 * GIB


@pytest.mark.parametrize("backend", BACKENDS)
def test_infeasible_only_jointly_is_caught_by_the_solver(backend):
    # a and b are tied. Index 0: a 1 GiB, b 5 GiB; index 1: a 5 GiB, b 1 GiB. Each live point
    # alone fits 3 GiB, but any common index puts 5 GiB at one of them: min peak 5 GiB.
    a = node("a", ("X", 1, 0, 1), ("Y", 1, 0, 5), tie=0)
    b = node("b", ("X", 1, 0, 5), ("Y", 1, 0, 1), tie=0)
    problem = ShardingProblem(
        (a, b), (), (LivePoint((0,), 0, "pa"), LivePoint((1,), 0, "pb")), 3 * GIB
    )
    with pytest.raises(InfeasibleError) as info:
        solve(problem, solver=backend)
    assert info.value.details.min_peak == 5 * GIB
    assert info.value.details.shortfall == 2 * GIB


def test_ties_force_equal_choices():
    # Tied a, b share one index. a: R=5, S=1; b: R=1, S=2.
    # Untied the optimum is (S, R) = 1 + 1 = 2 ms; tied: R = 5+1 = 6, S = 1+2 = 3, so (S, S).
    a = node("a", ("R", 5, 0, 0), ("S", 1, 0, 0), tie=7)
    b = node("b", ("R", 1, 0, 0), ("S", 2, 0, 0), tie=7)
    c = node("c", ("R", 1, 0, 0), ("S", 0, 0, 0))
    # An edge inside the tie group costs its diagonal: 0.5 ms on S.
    inner = Edge(0, 1, ((0.0, 9 * MS), (9 * MS, 0.5 * MS)))
    problem = ShardingProblem((a, b, c), (inner, Edge(1, 2, mismatch(3))))
    solution, stats = solve(problem)
    # c follows b (S, saving 1 ms and avoiding the 3 ms reshard): 1 + 2 + 0.5 + 0 = 3.5 ms.
    assert solution.choice == (1, 1, 1)
    assert stats.objective == pytest.approx(3.5 * MS)
    broken = evaluate(problem, Solution((1, 0, 1)))
    assert not broken.feasible
    assert any("tie group 7" in v for v in broken.violations)


def test_single_strategy_nodes_are_constants():
    # c and b have one strategy each. Edges touching them become linear terms on a:
    #   c -> a costs 4 ms if a picks S; a -> b costs 0.25 ms if a picks R; c -> b is 1 ms always.
    # So a: R = 3 + 0.25 = 3.25 vs S = 2 + 4 = 6 -> R, and d follows a (10 ms on mismatch).
    # Total: c 0.5 + a 3.25 + c->b 1 + d 1 = 5.75 ms.
    c = node("c", ("only", 0.5, 0, 2))
    a = node("a", ("R", 3, 0, 1), ("S", 2, 0, 1))
    b = node("b", ("only", 0, 0, 0))
    d = node("d", ("R", 1, 0, 0), ("S", 1, 0, 0))
    edges = (
        Edge(0, 1, ((0.0, 4 * MS),)),
        Edge(1, 2, ((0.25 * MS,), (0.0,))),
        Edge(0, 2, ((1 * MS,),)),
        Edge(1, 3, mismatch(10)),
    )
    problem = ShardingProblem((c, a, b, d), edges, (LivePoint((0, 1), 0),), 8 * GIB)
    solution, stats = solve(problem)
    assert solution.choice == (0, 0, 0, 0)
    assert stats.objective == pytest.approx(5.75 * MS)
    # c's 2 GiB counts at the live point with a's 1 GiB.
    assert evaluate(problem, solution).peak_memory == 3 * GIB


def test_no_decision_returns_immediately():
    problem = ShardingProblem(
        (node("c", ("only", 1, 2, 1)), node("d", ("only", 0, 0, 1))), (Edge(0, 1, ((3 * MS,),)),)
    )
    solution, stats = solve(problem)
    assert solution.choice == (0, 0)
    assert stats.variables == 0
    assert stats.status == "optimal"
    assert stats.objective == pytest.approx(6 * MS)


def test_parallel_edges_are_summed():
    # a: R=0, S=4; b: R=5, S=0. One 3 ms mismatch edge: (R,S) = 3 < (S,S) = 4, so mismatch.
    # Two of them (one drawn b -> a): (R,S) = 6 > (S,S) = 4, so both pick S.
    a = node("a", ("R", 0, 0, 0), ("S", 4, 0, 0))
    b = node("b", ("R", 5, 0, 0), ("S", 0, 0, 0))
    once = ShardingProblem((a, b), (Edge(0, 1, mismatch(3)),))
    assert solve(once)[0].choice == (0, 1)
    zero = Edge(0, 1, mismatch(0))
    twice = ShardingProblem((a, b), (Edge(0, 1, mismatch(3)), Edge(1, 0, mismatch(3)), zero))
    solution, stats = solve(twice)
    assert solution.choice == (1, 1)
    assert stats.objective == pytest.approx(4 * MS)


def test_separable_edges_fold_into_linear_terms():
    # costs[i][j] = row[i] + col[j] never couples the ends; the solver must still price it.
    a = node("a", ("R", 1, 0, 0), ("S", 2, 0, 0), ("T", 3, 0, 0))
    b = node("b", ("R", 2, 0, 0), ("S", 1, 0, 0))
    row, col = (0.0, 5.0, 0.5), (2.0, 0.0)
    costs = tuple(tuple((r + c) * MS for c in col) for r in row)
    problem = ShardingProblem((a, b), (Edge(0, 1, costs),))
    solution, stats = solve(problem)
    # a: R 1+0, S 2+5, T 3+0.5 -> R; b: R 2+2, S 1+0 -> S; total 1 + 1 = 2 ms.
    assert solution.choice == (0, 1)
    assert stats.objective == pytest.approx(2 * MS)


# --------------------------------------------------------------------------- backends


@pytest.mark.parametrize("probe", [True, False])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_backends_agree_with_brute_force(seed, probe, monkeypatch):
    from hloplan.solver import ilp

    if not probe:  # branch and bound itself, without the root's probing
        monkeypatch.setattr(ilp, "PROBE_GROUPS", 0)
    problem = random_problem(seed, n=7, k=3, m=12, ties=True, tight=0.4)
    expected, _ = brute_force(problem)
    objectives = {}
    for backend in BACKENDS:
        solution, stats = solve(problem, solver=backend)
        assert stats.solver == backend and stats.status == "optimal"
        evaluation = evaluate(problem, solution)
        assert evaluation.feasible
        # The reported objective is evaluate()'s arithmetic; the solver's own agrees.
        assert stats.objective == evaluation.total
        if "nodes" in stats.extra or not probe:  # branch and bound ran
            assert stats.extra["solver_objective"] == pytest.approx(evaluation.total, rel=1e-6)
        assert stats.bound <= stats.objective
        assert stats.bound <= expected * (1 + 1e-9)
        objectives[backend] = stats.objective
    assert objectives
    for objective in objectives.values():
        assert objective == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_transients_agree_with_brute_force(seed):
    problem = random_problem(seed, n=7, k=3, m=10, ties=True, tight=0.8, transients=True)
    expected, choice = brute_force(problem)
    assert choice, "some choice must fit"
    for backend in BACKENDS:
        solution, stats = solve(problem, solver=backend)
        assert evaluate(problem, solution).feasible
        assert stats.objective == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_launches_agree_with_brute_force(seed):
    problem = random_problem(seed, n=7, k=3, m=8, ties=True, tight=0.5, launches=3)
    expected, _ = brute_force(problem)
    for backend in BACKENDS:
        solution, stats = solve(problem, solver=backend)
        assert stats.status == "optimal"
        assert stats.objective == evaluate(problem, solution).total
        assert stats.objective == pytest.approx(expected, rel=1e-6)


def test_a_launch_is_paid_once_by_all_its_members():
    # Each of a and b saves 1 ms by reduce-scattering ("RS"); the merged reduce-scatter's
    # launch costs 1.5 ms: worth it for both together, not for one alone.
    a = node("a", ("AR", 2, 0, 0), ("RS", 1, 0, 0))
    b = node("b", ("AR", 2, 0, 0), ("RS", 1, 0, 0))
    c = node("c", ("AR", 2, 0, 0), ("RS", 1.6, 0, 0))
    launch = Launch("reduce-scatter(x)", 1.5 * MS, ((0, (1,)), (1, (1,))))
    both = ShardingProblem((a, b), launches=(launch,))
    assert evaluate(both, Solution((1, 1))).total == pytest.approx(3.5 * MS)
    assert evaluate(both, Solution((1, 1))).launches == (("reduce-scatter(x)", 1.5 * MS),)
    assert evaluate(both, Solution((0, 0))).launches == ()
    for backend in BACKENDS:
        assert solve(both, solver=backend)[0].choice == (1, 1)
    alone = ShardingProblem((a, c), launches=(launch,))  # c gains only 0.4 ms from RS
    for backend in BACKENDS:
        assert solve(alone, solver=backend)[0].choice == (0, 0)
    # A member that cannot avoid the launch (one strategy, a member) makes it a constant.
    forced = ShardingProblem((a, node("d", ("RS", 1, 0, 0))), launches=(
        Launch("reduce-scatter(x)", 1.5 * MS, ((0, (1,)), (1, (0,)))),))
    solution, stats = solve(forced)
    assert solution.choice == (1, 0) and stats.objective == pytest.approx(3.5 * MS)


def test_explanations_price_launches():
    a = node("a", ("AR", 2, 0, 0), ("RS", 1, 0, 0))
    b = node("b", ("AR", 2, 0, 0), ("RS", 1, 0, 0))
    problem = ShardingProblem((a, b), launches=(
        Launch("reduce-scatter(x)", 1.5 * MS, ((0, (1,)), (1, (1,)))),))
    chosen, alternative = Solution((1, 1)), Solution((0, 0))
    reasons = compare(problem, chosen, alternative)
    gained = evaluate(problem, alternative).total - evaluate(problem, chosen).total
    assert sum(r.delta_total for r in reasons) == pytest.approx(gained)
    # Moving a alone keeps the launch (b still pays it): 1 ms slower, no launch saved.
    _, moved = next_best(problem, chosen, 0)
    assert moved.total - evaluate(problem, chosen).total == pytest.approx(1 * MS)


def test_malformed_launches_are_rejected():
    a = node("a", ("AR", 2, 0, 0), ("RS", 1, 0, 0))
    for launch in (Launch("l", 1.0, ((1, (0,)),)), Launch("l", 1.0, ((0, (2,)),)),
                   Launch("l", -1.0, ((0, (0,)),))):
        with pytest.raises(ValueError):
            ShardingProblem((a,), launches=(launch,)).validate()


def test_solve_is_deterministic():
    problem = random_problem(5, n=12, k=3, m=25, ties=True)
    for backend in BACKENDS:
        first, _ = solve(problem, solver=backend)
        second, _ = solve(problem, solver=backend)
        assert first == second


@pytest.mark.parametrize("backend", BACKENDS)
def test_time_limit_reports_status(backend):
    # 60 nodes x 4 strategies with dense edges takes seconds to prove optimal; 0.01 s cannot.
    problem = random_problem(11, n=60, k=4, m=150)
    solution, stats = solve(problem, solver=backend, time_limit=0.01)
    assert stats.status in ("optimal", "time_limit")
    assert evaluate(problem, solution).feasible
    assert stats.objective == evaluate(problem, solution).total
    assert stats.bound <= stats.objective
    if stats.status == "time_limit":
        assert stats.gap >= 0
        assert stats.extra["raw_status"] != "Optimal Solution Found"
        assert stats.extra["deterministic"] is False  # the clock stopped it


@pytest.mark.parametrize("backend", BACKENDS)
def test_node_limit_stops_the_search_the_same_way_on_any_machine(backend):
    # Needs tens of branch-and-bound nodes to prove optimal; with none allowed the search
    # stops at the root, by a count of work: the status says so, and the plan is reproducible.
    problem = random_problem(11, n=60, k=4, m=150)
    first, stats = solve(problem, solver=backend, node_limit=0, time_limit=600)
    assert stats.status == "node_limit"
    assert stats.extra["deterministic"] is True
    assert stats.gap > 1e-6 and stats.bound <= stats.objective
    assert evaluate(problem, first).feasible
    assert stats.objective == evaluate(problem, first).total
    again, _ = solve(problem, solver=backend, node_limit=0, time_limit=600)
    assert again == first
    _, proven = solve(problem, solver=backend, time_limit=600)
    assert proven.status == "optimal" and proven.objective <= stats.objective


def test_no_solver_solution_falls_back_to_the_heuristic(monkeypatch):
    # Simulate a solver stopped before any incumbent: the local-search start is returned,
    # flagged as unproven, with no bound.
    from hloplan.solver import backends, heuristics

    monkeypatch.setattr(backends, "run", lambda *args, **kwargs: pulp.LpSolutionNoSolutionFound)
    problem = random_problem(3, n=8, k=3, m=12)
    solution, stats = solve(problem)
    assert stats.status == "time_limit"
    assert stats.extra["source"] == "heuristic"
    assert stats.extra["raw_status"] == "No Solution Found"
    assert evaluate(problem, solution).feasible
    assert stats.bound == -math.inf and stats.gap == math.inf
    monkeypatch.setattr(heuristics, "feasible_start", lambda *args: None)
    with pytest.raises(SolverError, match="no solution within"):
        solve(problem)


def test_unknown_solver_is_rejected():
    with pytest.raises(ValueError, match="unknown solver"):
        solve(ShardingProblem((node("a", ("R", 1, 0, 0)),)), solver="gurobi")


# --------------------------------------------------------------------------- evaluate


def test_evaluate_breaks_down_costs():
    a = node("a", ("R", 1, 0.5, 2), ("S", 2, 0, 1))
    b = node("b", ("R", 3, 0.25, 4), ("S", 1, 0, 2))
    problem = ShardingProblem(
        (a, b),
        (Edge(0, 1, mismatch(7)), Edge(1, 0, mismatch(0.5))),
        (LivePoint((0, 1, 1), 1 * GIB, "both"), LivePoint((1,), 0, "b")),
        5 * GIB,
    )
    evaluation = evaluate(problem, Solution((0, 1)))
    # compute 1 + 1; comm 0.5 + 0; resharding 7 into b, 0.5 into a.
    assert evaluation.compute == pytest.approx(2 * MS)
    assert evaluation.communication == pytest.approx(0.5 * MS)
    assert evaluation.resharding == pytest.approx(7.5 * MS)
    assert evaluation.total == pytest.approx(10 * MS)
    flat = [cost for row in evaluation.per_node for cost in row]
    assert flat == pytest.approx([1 * MS, 0.5 * MS, 0.5 * MS, 1 * MS, 0, 7 * MS])
    # "both": 1 fixed + 2 (a R) + 2 (b S, listed twice, counted once) = 5 GiB; "b": 2 GiB.
    assert evaluation.memory == (5 * GIB, 2 * GIB)
    assert evaluation.peak_memory == 5 * GIB and evaluation.peak_point == 0
    assert evaluation.feasible
    over = evaluate(problem, Solution((0, 0)))
    assert over.peak_memory == 7 * GIB
    assert not over.feasible
    assert over.violations == (
        "live point both needs 7.00 GiB > 5.00 GiB budget (over by 2.00 GiB)",
    )


def test_evaluate_rejects_malformed_solutions():
    problem = ShardingProblem((node("a", ("R", 1, 0, 0), ("S", 1, 0, 0)),))
    with pytest.raises(ValueError, match="1 nodes"):
        evaluate(problem, Solution((0, 0)))
    with pytest.raises(ValueError, match="picks 2"):
        evaluate(problem, Solution((2,)))
    with pytest.raises(ValueError, match="picks -1"):
        evaluate(problem, Solution((-1,)))


# --------------------------------------------------------------------------- explain


def _explained_problem() -> ShardingProblem:
    # x: R = 2 ms compute, 8 GiB; S(data) = 0.8 ms compute + 0.3 ms all-reduce, 4 GiB.
    # y: R = 1 ms, S = 1 ms; a 2 ms reshard when x and y disagree. Budget 10 GiB, 4 GiB fixed.
    x = node("x", ("R", 2, 0, 8), ("S(data)", 0.8, 0.3, 4, [("all-reduce", "data", 1e6)]))
    y = node("y", ("R", 1, 0, 1), ("S", 1, 0, 1))
    return ShardingProblem(
        (x, y), (Edge(0, 1, mismatch(2)),), (LivePoint((0,), 4 * GIB, "x out"),), 10 * GIB
    )


def test_compare_explains_with_signed_deltas():
    problem = _explained_problem()
    chosen, _ = solve(problem)
    # x=S(data): 0.8 + 0.3 + y 1 = 2.1 ms, 8 GiB; x=R would be 2 + 1 = 3 ms and 12 GiB > 10 GiB.
    assert chosen.choice == (1, 1)
    reasons = compare(problem, chosen, Solution((0, 1)))
    assert len(reasons) == 1
    (reason,) = reasons
    assert (reason.node, reason.name) == (0, "x")
    assert (reason.from_strategy, reason.to_strategy) == ("S(data)", "R")
    assert reason.delta_compute == pytest.approx(1.2 * MS)  # chosen saves compute
    assert reason.delta_communication == pytest.approx(-0.3 * MS)  # chosen pays an all-reduce
    assert reason.delta_resharding == pytest.approx(2 * MS)  # R would disagree with y = S
    assert reason.delta_peak_memory == 4 * GIB
    assert reason.text == (
        "x: 'S(data)' instead of 'R' saves 1.20 ms of compute, costs 300 us of all-reduce, "
        "saves 2.00 ms of resharding; peak memory 12.0 GiB > 10.0 GiB budget"
    )


def test_compare_attributes_each_edge_once():
    problem = _explained_problem()
    reasons = compare(problem, Solution((1, 1)), Solution((0, 0)))
    # Both nodes change; the edge stays matched, so there is no resharding difference at all.
    assert [r.node for r in reasons] == [0, 1]  # the budget-breaking switch comes first
    assert sum(r.delta_resharding for r in reasons) == 0
    assert reasons[1].text == "y: 'S' instead of 'R' costs the same"


def test_next_best_changes_one_decision():
    problem = _explained_problem()
    chosen = Solution((1, 1))
    result = next_best(problem, chosen, 1)
    assert result is not None
    alternative, evaluation = result
    # y=R disagrees with x=S(data): + 2 ms reshard, 4.1 ms in all (2.1 ms chosen).
    assert alternative.choice == (1, 0)
    assert evaluation.total == pytest.approx(4.1 * MS)
    # x's only alternative breaks the budget, but it is still the next best (and says so).
    alternative, evaluation = next_best(problem, chosen, 0)
    assert alternative.choice == (0, 1) and not evaluation.feasible
    assert next_best(ShardingProblem((node("c", ("only", 1, 0, 0)),)), Solution((0,)), 0) is None


def test_next_best_moves_tie_groups_together():
    a = node("a", ("R", 1, 0, 0), ("S", 2, 0, 0), ("T", 9, 0, 0), tie=1)
    b = node("b", ("R", 1, 0, 0), ("S", 2, 0, 0), ("T", 0, 0, 0), tie=1)
    problem = ShardingProblem((a, b))
    # From R (2 ms): S costs 4 ms, T costs 9 ms -> S, for both members.
    alternative, evaluation = next_best(problem, Solution((0, 0)), 1)
    assert alternative.choice == (1, 1)
    assert evaluation.feasible and evaluation.total == pytest.approx(4 * MS)


def test_formatting_helpers():
    assert format_seconds(1.2e-3) == "1.20 ms"
    assert format_seconds(2.5) == "2.50 s"
    assert format_seconds(4.5e-6) == "4.50 us"
    assert format_bytes(14 * GIB) == "14.0 GiB"
    assert format_bytes(3 * 2**20) == "3.00 MiB"
    assert format_bytes(1536) == "1.50 KiB"


# -- resharded copies ---------------------------------------------------------------------------


def _copy_problem(budget: float) -> ShardingProblem:
    """A feeds B. A's cheap strategy makes layout X, its dear one Y; B's cheap strategy reads Y
    (from X: a reshard, 0.5 s, and a 40-byte gathered copy held while B runs), its dear one X."""
    a = Node("A", (Strategy("x", 0.0, memory=10.0), Strategy("y", 1.0, memory=10.0)))
    b = Node("B", (Strategy("reads y", 0.0, memory=10.0), Strategy("reads x", 0.6, memory=10.0)))
    edge = Edge(0, 1, ((0.5, 0.0), (0.0, 0.5)), copies=(40.0, 40.0))
    points = (LivePoint((0,)), LivePoint((0, 1)))
    return ShardingProblem((a, b), (edge,), points, budget)


def test_evaluate_holds_a_resharded_copy_at_its_readers_first_point():
    problem = _copy_problem(float("inf"))
    resharded = evaluate(problem, Solution((0, 0)))
    assert resharded.memory == (10.0, 60.0)
    assert evaluate(problem, Solution((0, 0)), copies=False).memory == (10.0, 20.0)
    assert evaluate(problem, Solution((0, 1))).memory == (10.0, 20.0)  # no reshard, no copy
    assert evaluate(problem, Solution((1, 0))).memory == (10.0, 20.0)


def test_a_copy_held_over_a_span_is_seen_by_the_re_solve():
    """The copy B reads is held until a later reader at point 2 (Edge.held), where C makes the
    peak: the re-solve must see it there, not only at B's first point (where it fits)."""
    from hloplan.compiler import make_options
    from hloplan.passes.solve_sharding import SolveSharding
    from hloplan.state import CompileState

    base = _copy_problem(60.0)
    c = Node("C", (Strategy("c", memory=30.0),))
    points = (LivePoint((0,)), LivePoint((0, 1)), LivePoint((0, 1, 2)))
    problem = dataclasses.replace(
        base, nodes=(*base.nodes, c), live_points=points,
        edges=(dataclasses.replace(base.edges[0], held=(1, 2)),))
    problem.validate()
    assert evaluate(problem, Solution((0, 0, 0))).memory == (10.0, 60.0, 90.0)
    assert evaluate(problem, Solution((0, 1, 0))).memory == (10.0, 20.0, 50.0)
    state = CompileState(program=None, options=make_options("8", device="toy"), problem=problem)
    SolveSharding().apply(state)
    assert state.solution.choice == (0, 1, 0)
    assert state.facts["memory_tightened"] == 1


def test_no_plan_fits_says_the_smallest_peak_any_plan_reaches():
    from hloplan.compiler import make_options
    from hloplan.passes.solve_sharding import SolveSharding
    from hloplan.state import CompileState

    # A's smaller strategy takes 40 bytes, on top of 10 fixed: 50 against a budget of 30.
    problem = ShardingProblem(
        (Node("A", (Strategy("x", memory=60.0), Strategy("y", memory=40.0))),),
        (), (LivePoint((0,), 10.0),), 30.0)
    state = CompileState(program=None, options=make_options("8", device="toy"), problem=problem)
    with pytest.raises(NoPlanFits) as info:
        SolveSharding().apply(state)
    (diagnostic,) = info.value.diagnostics
    assert ("the smallest peak any plan reaches is 50 B, 20 B over the 30 B it was planned "
            "under") in diagnostic.notes


def test_solve_sharding_plans_again_when_resharded_copies_break_the_budget():
    from hloplan.compiler import make_options
    from hloplan.passes.solve_sharding import SolveSharding
    from hloplan.state import CompileState

    problem = _copy_problem(30.0)
    # The ILP alone picks the cheapest plan (0.5 s), whose copy makes its peak 60 bytes.
    assert solve(problem)[0].choice == (0, 0)
    state = CompileState(program=None, options=make_options("8", device="toy"), problem=problem)
    SolveSharding().apply(state)
    assert state.solution.choice == (0, 1)  # B reads A's layout: no copy, 20 bytes
    assert evaluate(problem, state.solution).feasible
    assert state.facts["memory_tightened"] == 1
    # A copy no plan avoids: no plan fits, and the error says why.
    forced = ShardingProblem(
        (Node("A", (Strategy("x", memory=10.0),)), Node("B", (Strategy("reads y", memory=10.0),))),
        (Edge(0, 1, ((0.5,),), copies=(40.0,)),), (LivePoint((0,)), LivePoint((0, 1))), 30.0)
    state = CompileState(program=None, options=make_options("8", device="toy"), problem=forced)
    with pytest.raises(NoPlanFits, match="no plan fits the memory budget") as info:
        SolveSharding().apply(state)
    assert "resharded copies" in str(info.value)


def test_solve_sharding_loosens_the_budget_when_the_held_copies_rule_out_every_plan():
    """B reads A (a 40-byte copy on a mismatch) and C (a 4-byte one). The cheapest plan
    (a0, c1, b1) copies A's value: 70 bytes against 31. Held as that plan's sources make them,
    the copies charge b0 4 bytes (from c1) and b1 40 (from a0), so no plan fits 31; yet
    (a0, c0, b0) reads no copy (30 bytes). Solved under 1.1 x the budget it is found, and
    kept because its peak with the copies it reads fits."""
    from hloplan.compiler import make_options
    from hloplan.passes.solve_sharding import SolveSharding
    from hloplan.state import CompileState

    a = Node("A", (Strategy("a0", 0.0, memory=10.0), Strategy("a1", 1.0, memory=10.0)))
    c = Node("C", (Strategy("c0", 0.2, memory=10.0), Strategy("c1", 0.0, memory=10.0)))
    b = Node("B", (Strategy("b0", 0.35, memory=10.0), Strategy("b1", 0.0, memory=10.0)))
    mismatch_half = ((0.0, 0.5), (0.5, 0.0))
    edges = (Edge(0, 2, mismatch_half, copies=(40.0, 40.0)),
             Edge(1, 2, mismatch_half, copies=(4.0, 4.0)))
    problem = ShardingProblem((a, c, b), edges, (LivePoint((0, 1, 2)),), 31.0)
    assert solve(problem)[0].choice == (0, 1, 1)
    assert evaluate(problem, Solution((0, 1, 1))).peak_memory == 70.0
    state = CompileState(program=None, options=make_options("8", device="toy"), problem=problem)
    SolveSharding().apply(state)
    assert state.solution.choice == (0, 0, 0)
    assert evaluate(problem, state.solution).peak_memory == 30.0
    assert state.facts["memory_loosened"] == 1.1
    # Without loosening the same problem gets no plan; the error does not pass the held
    # copies' smallest peak (34 bytes) off as what any plan needs (30 does).
    state = CompileState(program=None, options=make_options("8", device="toy"), problem=problem)
    with pytest.raises(NoPlanFits) as info:
        SolveSharding(loosen=()).apply(state)
    assert info.value.min_peak is None
    (diagnostic,) = info.value.diagnostics
    assert any(note.startswith("plans fit the budget without the resharded copies")
               for note in diagnostic.notes), diagnostic.notes
    assert not any(note.startswith("the smallest peak any plan reaches")
                   for note in diagnostic.notes), diagnostic.notes


@pytest.mark.parametrize("seed", range(4))
def test_point_contents_add_up_to_each_points_bytes(seed):
    """What explain lists at the peak (values, partial sums where made, resharded copies over
    their spans) adds up, with the fixed bytes, to the evaluator's bytes at every point."""
    from hloplan.solver.evaluate import point_contents

    base = random_problem(seed, 10, 3, 12, transients=True)
    rng = random.Random(seed)
    listed = {i for point in base.live_points for i in point.nodes}
    ranges = tuple(LiveRange(i, *sorted(rng.sample(range(len(base.live_points)), 2)))
                   for i in range(10) if i not in listed and len(base.live_points) > 1)
    edges = tuple(dataclasses.replace(e, copies=(5.0, 7.0, 0.0),
                                      held=(0, len(base.live_points) - 1) if i % 2 else None)
                  for i, e in enumerate(base.edges))
    problem = dataclasses.replace(base, edges=edges, live_ranges=ranges)
    problem.validate()
    solution = Solution(tuple(rng.randrange(3) for _ in problem.nodes))
    memory = evaluate(problem, solution).memory
    for p, point in enumerate(problem.live_points):
        held = point_contents(problem, solution, p)
        assert sum(h.bytes for h in held) + point.fixed_bytes == pytest.approx(memory[p])
        assert [h.bytes for h in held] == sorted((h.bytes for h in held), reverse=True)
        assert {h.kind for h in held} <= {"result", "made", "copy"}
    assert any(h.kind == "copy" for p in range(len(problem.live_points))
               for h in point_contents(problem, solution, p))


@pytest.mark.parametrize("backend", BACKENDS)
def test_flow_rounding_follows_one_layout_of_the_lp(backend):
    # Four nodes, every pair paying 1 ms when they pick the same strategy: the LP puts every
    # node at 0.5/0.5 with all its flow on unequal pairs (0 ms). Rounding each node alone
    # picks one strategy everywhere (6 ms); following the flows alternates (2 ms, optimal).
    import time

    from hloplan.solver import backends, heuristics
    from hloplan.solver.model import compile_model

    nodes = tuple(node(f"n{i}", ("a", 0, 0, 1), ("b", 0, 0, 1)) for i in range(4))
    same = tuple(tuple(MS if i == j else 0.0 for j in range(2)) for i in range(2))
    edges = tuple(Edge(a, b, same) for a, b in itertools.combinations(range(4), 2))
    problem = ShardingProblem(nodes, edges)
    model = compile_model(problem)
    built = backends.build(model, [], math.inf, backend, backend == "highs")
    status = backends.run_lazy(built, backend, math.inf, time.perf_counter() + 60, 1, mip=False)
    assert status == pulp.LpSolutionOptimal
    values = backends.group_values(built)
    assert len(heuristics.fractional_groups(values)) == 4
    assert model.objective([int(v.argmax()) for v in values]) == pytest.approx(6 * MS)
    followed = heuristics.follow_flows(model, math.inf, built)
    assert model.objective(followed) == pytest.approx(2 * MS)
    _, stats = solve(problem, solver=backend)
    assert stats.objective == pytest.approx(2 * MS) and stats.status == "optimal"


def _wheel(hub_c_ms: float | None = None) -> ShardingProblem:
    """A hub read by the five nodes of a ring. Neighbours on the ring pay 1 ms when they pick
    the same strategy (a or b), the hub 0.5 ms with each ring node that picks its strategy. An
    odd ring cannot alternate: every plan pays at least one ring edge. With `hub_c_ms`, the
    hub has a third strategy c, costing that much, that no ring node shares."""
    hub = [("a", 0, 0, 1), ("b", 0, 0, 1)]
    if hub_c_ms is not None:
        hub.append(("c", hub_c_ms, 0, 1))
    k = len(hub)
    nodes = (node("hub", *hub),) + tuple(node(f"n{i}", ("a", 0, 0, 1), ("b", 0, 0, 1))
                                         for i in range(5))
    ring = tuple(tuple(MS if i == j else 0.0 for j in range(2)) for i in range(2))
    spoke = tuple(tuple(0.5 * MS if i == j else 0.0 for j in range(2)) for i in range(k))
    return ShardingProblem(nodes, tuple(Edge(0, 1 + i, spoke) for i in range(5))
                           + tuple(Edge(1 + i, 1 + (i + 1) % 5, ring) for i in range(5)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_probing_the_hub_proves_the_optimum_the_lp_relaxation_cannot(backend):
    # The LP puts every node at 0.5/0.5 with all its flow on unequal pairs: 0 ms, while every
    # plan pays at least 2 ms (a ring edge, and two spokes: the ring's three nodes of one
    # strategy go with the hub's other). Held at a or at b, the hub leaves a ring whose chain
    # `reduce.eliminate` solves exactly: both branch LPs bound the optimum at 2 ms, which
    # proves it with no branch and bound.
    import time

    from hloplan.solver import backends
    from hloplan.solver.model import compile_model

    problem = _wheel()
    model = compile_model(problem)
    built = backends.build(model, [], math.inf, backend, backend == "highs")
    assert backends.run_lazy(built, backend, math.inf, time.perf_counter() + 60, 1,
                             mip=False) == pulp.LpSolutionOptimal
    assert built.objective == pytest.approx(0.0, abs=1e-6)
    expected, _ = brute_force(problem)
    assert expected == pytest.approx(2 * MS)
    solution, stats = solve(problem, solver=backend)
    assert stats.objective == pytest.approx(expected)
    assert stats.status == "optimal" and stats.bound == pytest.approx(expected)
    assert stats.extra["raw_status"] == "within gap of the probed LP bound"
    assert stats.extra["probed_groups"] == 1 and stats.extra["probe_lps"] == 2
    assert "nodes" not in stats.extra  # no branch and bound


@pytest.mark.parametrize("backend", BACKENDS)
def test_probing_finds_a_plan_on_a_strategy_the_lp_leaves_out(backend):
    # The hub's strategy c (0.9 ms, read by no ring node for free) is at 0 in the LP, which
    # averages a and b at 0 ms; the optimum takes it: 0.9 ms + one ring edge (1 ms) = 1.9 ms,
    # against 2 ms with the hub at a or b. Probing the hub from a plan at a finds it.
    import time

    from hloplan.solver import backends, ilp
    from hloplan.solver.model import compile_model

    problem = _wheel(hub_c_ms=0.9)
    expected, best = brute_force(problem)
    assert expected == pytest.approx(1.9 * MS) and best[0] == 2
    model = compile_model(problem)
    built = backends.build(model, [], math.inf, backend, backend == "highs")
    backends.run_lazy(built, backend, math.inf, time.perf_counter() + 60, 1, mip=False)
    relaxed = backends.group_values(built)
    assert relaxed[0][2] == pytest.approx(0.0, abs=1e-9)
    start = [0, 1, 0, 1, 0, 1]  # hub a, the ring alternating but for one edge: 2 ms
    assert model.objective(start) == pytest.approx(2 * MS)

    def solve_branch(sub):
        return ilp.solve_model(sub, math.inf, backend, time.perf_counter() + 60, 1,
                               backend == "highs", branch=False, search=False)

    probed = ilp._probe(model, math.inf, built, relaxed, start, 1e-6,
                        time.perf_counter() + 60, solve_branch)
    assert probed.choice is not None and probed.choice[0] == 2
    assert model.objective(probed.choice) == pytest.approx(expected)
    assert probed.bound == pytest.approx(expected)  # each branch's LP is exact here
    # Branches a and b (2 ms) cannot beat 1.9 ms: fixed out of any MIP that follows.
    assert probed.pruned == [(0, 0), (0, 1)]
    _, stats = solve(problem, solver=backend)
    assert stats.objective == pytest.approx(expected) and stats.status == "optimal"


def test_a_copy_is_not_held_at_the_points_its_edge_releases():
    """Edge.released: points inside the span where the compiler has run the copy's last reader
    already (libtpu's weight-gradient matmuls, after the input-gradient chain)."""
    from hloplan.solver.evaluate import point_contents

    base = _copy_problem(float("inf"))
    c = Node("C", (Strategy("c", memory=30.0),))
    points = (LivePoint((0,)), LivePoint((0, 1)), LivePoint((0, 1, 2)), LivePoint((0, 1)))
    problem = dataclasses.replace(
        base, nodes=(*base.nodes, c), live_points=points,
        edges=(dataclasses.replace(base.edges[0], held=(1, 3), released=(2,)),))
    problem.validate()
    assert evaluate(problem, Solution((0, 0, 0))).memory == (10.0, 60.0, 50.0, 60.0)
    assert [h.kind for h in point_contents(problem, Solution((0, 0, 0)), 2)] == [
        "result", "result", "result"]
    assert "copy" in [h.kind for h in point_contents(problem, Solution((0, 0, 0)), 3)]
    # Kept points only: the released point keeps its place among them.
    kept = problem.with_live_points([0, 2, 3])
    assert kept.edges[0].held == (1, 2) and kept.edges[0].released == (1,)
    assert evaluate(kept, Solution((0, 0, 0))).memory == (10.0, 50.0, 60.0)
    bad = dataclasses.replace(problem, edges=(dataclasses.replace(problem.edges[0],
                                                                  released=(0,)),))
    with pytest.raises(ValueError, match="releases its copy"):
        bad.validate()
