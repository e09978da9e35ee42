"""The exact elimination of groups only pairwise costs tie to the rest (solver/reduce.py).

Plain data, no MLIR: random sparse problems (chains and branch points), checked against the
unreduced model and against enumeration.
"""

from __future__ import annotations

import dataclasses
import math
import random

import numpy as np
import pytest
from test_solver import brute_force

from hloplan.solver.evaluate import evaluate
from hloplan.solver.ilp import available_solvers, solve
from hloplan.solver.model import compile_model
from hloplan.solver.problem import (
    Edge,
    LivePoint,
    Node,
    ShardingProblem,
    Strategy,
)
from hloplan.solver.reduce import eliminate

MS = 1e-3
GIB = 2.0**30
BACKENDS = available_solvers()


def sparse_problem(seed: int, n: int = 9, k: int = 3, extra_edges: int = 3,
                   budget: float = math.inf, sizes: bool = False) -> ShardingProblem:
    """A chain of n nodes plus a few random edges (so some nodes have three or more
    neighbours), every node live at one point; `sizes`: strategies of 1 to k."""
    rng = random.Random(seed)
    counts = [rng.randint(1, k) if sizes else k for _ in range(n)]
    nodes = tuple(Node(f"n{i}", tuple(
        Strategy(f"s{j}", rng.uniform(0, 1) * MS, 0.0, rng.choice([0.5, 1, 2]) * GIB)
        for j in range(counts[i]))) for i in range(n))
    pairs = [(i, i + 1) for i in range(n - 1)] + [tuple(rng.sample(range(n), 2))
                                                  for _ in range(extra_edges)]
    edges = tuple(Edge(a, b, tuple(tuple(rng.uniform(0, 2) * MS for _ in range(counts[b]))
                                   for _ in range(counts[a]))) for a, b in pairs)
    points = (LivePoint(tuple(range(n)), 0.0, "all"),)
    return ShardingProblem(nodes, edges, points, budget, f"sparse{seed}")


@pytest.mark.parametrize("seed", range(6))
def test_expanded_choices_cost_what_the_reduced_model_says(seed):
    # Every choice of the reduced model expands to a choice of the original costing exactly
    # the reduced objective (the eliminated groups at their minimisers), so the optima agree.
    problem = sparse_problem(seed, sizes=seed % 2 == 1)
    model = compile_model(problem)
    reduction = eliminate(model, problem.memory_budget)
    assert reduction.eliminated > 0
    assert len(reduction.kept) + reduction.eliminated == len(model.groups)
    reduced = reduction.model
    rng = np.random.default_rng(seed)
    for _ in range(20):
        choice = [int(rng.integers(g.size)) for g in reduced.groups]
        assert model.objective(reduction.expand(choice)) == pytest.approx(
            reduced.objective(choice), rel=1e-12, abs=1e-15)
    # Reduced objective of an original choice's restriction is a lower bound on its cost.
    full = [int(rng.integers(g.size)) for g in model.groups]
    assert reduced.objective(reduction.restrict(full)) <= model.objective(full) + 1e-15


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seed", range(4))
def test_reduced_solve_finds_the_optimum(backend, seed):
    problem = sparse_problem(seed, n=8, k=3, extra_edges=4)
    _, stats = solve(problem, solver=backend)
    assert stats.status == "optimal"
    assert stats.objective == pytest.approx(brute_force(problem)[0], rel=1e-9)


def test_groups_a_memory_row_sees_are_kept():
    # A budget some choices break: every node is live at the binding point with bytes that
    # depend on its strategy, so none may be eliminated; the solve still meets the budget.
    loose = sparse_problem(1, n=7, k=3)
    model = compile_model(loose)
    smallest = sum(min(s.memory for s in n.strategies) for n in loose.nodes)
    largest = sum(max(s.memory for s in n.strategies) for n in loose.nodes)
    tight = ShardingProblem(loose.nodes, loose.edges, loose.live_points,
                            smallest + 0.3 * (largest - smallest), "tight")
    tight_model = compile_model(tight)
    assert eliminate(model, loose.memory_budget).eliminated == len(model.groups)
    assert eliminate(tight_model, tight.memory_budget).eliminated == 0
    solution, stats = solve(tight)
    assert evaluate(tight, solution).feasible
    assert stats.objective == pytest.approx(brute_force(tight)[0], rel=1e-9)


def test_elimination_is_recorded_and_deterministic():
    problem = sparse_problem(3, n=30, k=4, extra_edges=10)
    first, stats = solve(problem)
    second, _ = solve(problem)
    assert first == second
    assert stats.extra["eliminated_groups"] > 0
    assert stats.extra["deterministic"] is True


@pytest.mark.parametrize("seed", range(4))
def test_groups_at_are_the_groups_in_the_memory_rows(seed):
    # eliminate() pins the groups of the binding rows by Memory.groups_at, which must name the
    # groups Memory.rows gives coefficients (a group whose strategies hold equal bytes at a
    # point has none there).
    rng = random.Random(seed)
    base = sparse_problem(seed, n=12)
    points = tuple(LivePoint(tuple(sorted(rng.sample(range(12), rng.randint(1, 6)))), 0.0,
                             f"p{p}") for p in range(8))
    memory = compile_model(dataclasses.replace(base, live_points=points)).memory
    for _ in range(10):
        wanted = rng.sample(range(len(points)), rng.randint(1, len(points)))
        expected = set().union(*memory.rows(wanted).values())
        assert memory.groups_at(wanted) == expected
