"""Plan meshes of three or more axes on two-axis views, then improve two axes at a time.

On a mesh of n axes an op has up to (factors + 1)^n strategies (188 for a matmul on 16x8x8,
over 400 with reduce-scatter variants), and the ILP's edge grids grow with their square: a
2-layer GPT-3 on 16x8x8 is a 924k-variable ILP (80 s), a 96-layer one does not fit a minute.
Every strategy says what it does with each mesh axis (`Strategy.axes`, see
`strategies.axis_roles`); both steps below solve the exact ILP of a *restriction* of the
problem to some of those strategies, so every plan they return is feasible for the full problem:

1. A view: two axes act as one (equal roles: they shard the same dims and reduce together),
   which is planning for the mesh with those two axes merged; an op keeps about as many
   strategies as on a two-axis mesh. Pairs of axes on the same interconnect level go first
   (on 16x8x8 H100 hosts, the two inter-host axes: a 128 x 8 view); a view nothing fits in is
   skipped.
2. Moves: all axes but a pair held at the incumbent's roles, the ILP re-solved over every role
   of those two; pair after pair while the plan improves and time remains. The first rounds
   solve only each move's LP relaxation (rounded and repaired when fractional), which finds
   most of the gain at a fraction of the time; then moves are solved exactly.

The search's limits are counts of rounds, not seconds, so the plan is the same on a busy machine
(the time limit only stops a search that overruns it: status "time_limit"). On a 96-layer GPT-3
on 16x8x8 it plans in about 20 s a step 1.1% slower than the whole ILP's optimum (which takes 8
minutes); on the 2-layer one, 12% slower (the whole ILP: 90 s). Which basin the moves end in
depends on the start: a view solved exactly is a better start than its LP rounding.

The result is at least as good as the view's optimum but not proven optimal: the status is
"decomposed" and the bound is the largest lower bound known (the full problem's LP relaxation is
what this avoids solving). Small problems (and meshes of fewer than three axes) are solved
whole by `ilp.solve`.
"""

from __future__ import annotations

import itertools
import math
import time

import numpy as np

from hloplan.solver import backends, clock, ilp
from hloplan.solver.evaluate import memory_fits
from hloplan.solver.model import ModelInfeasible, compile_model
from hloplan.solver.problem import ShardingProblem, Solution, SolveStats

__all__ = ["full_problem_variables", "solve"]

# Solve whole when the full ILP would have at most this many edge-grid variables (the 2-layer
# GPT-3 on 16x8x8 has 924k and takes 80 s; Llama3-8B on 8x4 has 87k and takes seconds).
MAX_FULL_VARIABLES = 250_000
# Rounds of moves: LP-rounded ones until they stop paying, then exact ones (each exact round
# costs about as much as all the LP rounds; 0 by default keeps a 96-layer GPT-3 near 20 s).
LP_ROUNDS = 12
EXACT_ROUNDS = 0
# A round of moves that improves the plan by less than this (relative) ends a descent.
_MIN_GAIN = 1e-4


def full_problem_variables(model) -> int:
    """Binaries plus transportation-grid variables of the whole problem's ILP."""
    count = sum(g.size for g in model.groups)
    for matrix in model.pairs.values():
        count += len(backends.classes(matrix)) * len(backends.classes(matrix.T))
    return count


def _roles(problem: ShardingProblem, model) -> list[list[tuple]] | None:
    """Per group, the axis roles of each strategy (None if some strategy has none)."""
    out = []
    for group in model.groups:
        roles = [s.axes for s in problem.nodes[group.rep].strategies]
        if any(not r for r in roles):
            return None
        out.append(roles)
    return out


def _pairs(ndim: int, links: tuple | None) -> list[tuple[int, int]]:
    """Axis pairs, those on one interconnect level first, then adjacent ones, then by index."""
    def key(pair: tuple[int, int]) -> tuple:
        i, j = pair
        same = links is not None and links[i] == links[j]
        return (not same, j - i, i)

    return sorted(itertools.combinations(range(ndim), 2), key=key)


def solve(
    problem: ShardingProblem,
    *,
    time_limit: float = 60.0,
    solver: str = "auto",
    threads: int = 1,
    decompose: str = "auto",
    links: tuple | None = None,
    exact_rounds: int = EXACT_ROUNDS,
    gap: float = backends.MIP_REL_GAP,
) -> tuple[Solution, SolveStats]:
    """`ilp.solve`, or the view-and-moves search above for big problems on 3+ axis meshes.

    `decompose`: "auto" (when the full ILP would exceed MAX_FULL_VARIABLES), "always" or
    "never". `links`: the interconnect of each mesh axis (equal entries: same level), to pick
    the view. `gap`: the relative gap at which a whole-problem solve may stop (`ilp.solve`).
    """
    if decompose not in ("auto", "always", "never"):
        raise ValueError(f"unknown decompose {decompose!r}: expected auto, always or never")
    if decompose == "never":
        return ilp.solve(problem, time_limit=time_limit, solver=solver, threads=threads, gap=gap)
    started = time.perf_counter()
    problem.validate()
    model = compile_model(problem)
    roles = _roles(problem, model)
    ndim = len(roles[0][0]) if roles and roles[0] else 0
    if (roles is None or ndim < 3
            or (decompose == "auto" and full_problem_variables(model) <= MAX_FULL_VARIABLES)):
        return ilp.solve_compiled(problem, model, time_limit=time_limit, solver=solver,
                                  threads=threads, gap=gap, started=started)
    backend = backends.pick_backend(solver)
    budget = problem.memory_budget
    memory = model.memory
    if memory.count and not all(memory_fits(float(v), budget) for v in memory.min_load):
        raise ilp.infeasible_error(problem, model, backend, time_limit, threads)
    # The search's own limits are counts (rounds of moves), so the plan does not depend on
    # the machine's speed or load; the time limit only stops a search that overruns it.
    deadline = started + time_limit
    pairs = _pairs(ndim, links)
    search = None
    for i, j in pairs:  # the first view anything fits in
        search = _Search(model, roles, budget, backend, deadline, threads)
        if search.view(i, j):
            break
        search = None
    if search is None:  # no view fits: the whole problem
        return ilp.solve_compiled(problem, model,
                                  time_limit=max(deadline - time.perf_counter(), 1.0),
                                  solver=solver, threads=threads, gap=gap)
    search.descend(pairs, branch=False, rounds=LP_ROUNDS)
    search.descend(pairs, branch=True, rounds=exact_rounds)
    status = "decomposed" if time.perf_counter() < deadline else "time_limit"
    deterministic = status == "decomposed" and not search.clocked
    if not deterministic:
        clock.cut("the axis-view search")
    return ilp.solve_stats(
        problem, model.to_choice(search.choice), solver=backend, status=status,
        bound=-math.inf, started=started, variables=search.variables,
        constraints=search.constraints,
        extra={"backend": backend, "source": "axis views", "steps": search.steps,
               "full_variables": full_problem_variables(model),
               "deterministic": deterministic})


class _Search:
    def __init__(self, model, roles, budget: float, backend: str, deadline: float,
                 threads: int) -> None:
        self.model, self.roles, self.budget = model, roles, budget
        self.backend, self.deadline, self.threads = backend, deadline, threads
        self.choice: list[int] | None = None
        self.objective = math.inf
        self.steps: list[dict] = []
        self.variables = self.constraints = 0
        self.clocked = False  # whether a backend run stopped at the time limit

    def _solve(self, allowed: list[np.ndarray], label: str, branch: bool = True) -> bool:
        """Solve the restriction; adopt its plan if it is better. Whether it was."""
        started = time.perf_counter()
        if any(not len(keep) for keep in allowed):  # a group with no strategy in this view
            self.steps.append({"step": label, "result": "empty", "seconds": 0.0})
            return False
        sub = self.model.restrict(allowed)
        start = None
        if self.choice is not None:
            position = [{k: i for i, k in enumerate(keep.tolist())} for keep in allowed]
            start = [position[g][k] for g, k in enumerate(self.choice)]
        step = {"step": label, "strategies": int(sum(len(a) for a in allowed))}
        try:
            outcome = ilp.solve_model(sub, self.budget, self.backend, self.deadline,
                                       self.threads, self.backend == "highs", start, branch)
        except ModelInfeasible:
            step.update(result="infeasible", seconds=time.perf_counter() - started)
            self.steps.append(step)
            return False
        except backends.SolverError as exc:
            step.update(result=f"no solution: {exc}", seconds=time.perf_counter() - started)
            self.steps.append(step)
            return False
        self.clocked |= bool(outcome.extra.get("time_limited", False))
        choice = [int(keep[i]) for keep, i in zip(allowed, outcome.choice, strict=True)]
        objective = self.model.objective(choice)
        better = self.choice is None or objective < self.objective - 1e-12 * abs(self.objective)
        step.update(result=outcome.status, objective=objective, variables=outcome.variables,
                    seconds=time.perf_counter() - started)
        self.steps.append(step)
        self.variables = max(self.variables, outcome.variables)
        self.constraints = max(self.constraints, outcome.constraints)
        if better and self.model.fits(self.budget, choice):
            self.choice, self.objective = choice, objective
            return True
        return False

    def descend(self, pairs: list[tuple[int, int]], branch: bool, rounds: int) -> None:
        """Up to `rounds` rounds of moves (each pair, then every axis permuted), until one gains
        too little; `branch=False` solves each move's LP relaxation only (rounded and repaired
        when fractional): a few times faster, and the rounds find most of the gain."""
        for _ in range(rounds):
            if time.perf_counter() >= self.deadline:
                return
            before = self.objective
            for i, j in pairs:
                if time.perf_counter() >= self.deadline:
                    return
                self.move(i, j, branch)
            self.permute()
            if not self.objective < before - _MIN_GAIN * abs(before):
                return

    def permute(self) -> bool:
        """Let every group permute the roles of its axes (a small neighbourhood: at most n!
        strategies per group) to escape plans that use the axes in the wrong order."""
        ndim = len(self.roles[0][0])
        allowed = []
        for roles, current in zip(self.roles, self.choice, strict=True):
            targets = {tuple(roles[current][m] for m in order)
                       for order in itertools.permutations(range(ndim))}
            allowed.append(np.array([k for k, r in enumerate(roles) if tuple(r) in targets],
                                    dtype=np.int64))
        return self._solve(allowed, "permute axes")

    def view(self, i: int, j: int, branch: bool = True) -> bool:
        """Plan with axes i and j merged."""
        allowed = [np.array([k for k, r in enumerate(roles) if r[i] == r[j]], dtype=np.int64)
                   for roles in self.roles]
        return self._solve(allowed, f"view: axes {i} and {j} merged", branch)

    def move(self, i: int, j: int, branch: bool = True) -> bool:
        """Re-plan axes i and j, the others held at the incumbent's roles."""
        fixed = [m for m in range(len(self.roles[0][0])) if m not in (i, j)]
        allowed = []
        for roles, current in zip(self.roles, self.choice, strict=True):
            mine = [roles[current][m] for m in fixed]
            allowed.append(np.array([k for k, r in enumerate(roles)
                                     if [r[m] for m in fixed] == mine], dtype=np.int64))
        return self._solve(allowed, f"move: axes {i} and {j}", branch)
