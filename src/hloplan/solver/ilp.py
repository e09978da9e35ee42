"""Choose a strategy per node by integer linear programming (HiGHS through highspy, or CBC).

`solve(problem)` is the entry point: it compiles the problem (`model.compile_model`: decision
groups, linear and pairwise costs, memory as events), builds its ILP (`backends.build`: one-hot
binaries, transportation edges, memory rows added lazily or as a chain) and solves it
(`solve_model`). Everything reported back is in seconds and bytes, recomputed by `evaluate()`
from the chosen indices.

The LP relaxation of this formulation is usually integral, and is solved first. When it is
fractional, branch and bound starts from its rounding, repaired to fit the budget and improved
by local search, dives and neighbourhood search (`heuristics.py`); binaries whose reduced costs
price them out of any plan better than that start are fixed first (exact; a Llama3-8B step
fixes 1,560 of 5,196). Before branch and bound, `_probe` solves the LP once per strategy of
the groups with the most pairwise neighbours: the smallest of those bounds the optimum, often
close enough to stop there, and an integral branch is a plan no rounding of the root LP
reaches.

`solve_model` works on a compiled model, so that `axes.py` can solve restrictions of one
(`Model.restrict`) without rebuilding the problem; `solve_compiled` is `solve` for a model
already compiled. A budget nothing fits raises InfeasibleError with the smallest achievable
peak (`infeasible_error`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import pulp

from hloplan.solver import backends, clock, heuristics
from hloplan.solver.backends import (
    INTEGRALITY_TOL,
    MEMORY_SCALE,
    MIP_NODE_LIMIT,
    MIP_REL_GAP,
    TIME_SCALE,
    Built,
    SolverError,
    available_solvers,
)
from hloplan.solver.evaluate import MEMORY_RTOL, evaluate, memory_fits
from hloplan.solver.model import Model, ModelInfeasible, compile_model
from hloplan.solver.problem import ShardingProblem, Solution, SolveStats
from hloplan.solver.reduce import eliminate
from hloplan.units import format_bytes

__all__ = [
    "InfeasibilityDetails",
    "InfeasibleError",
    "Outcome",
    "SolverError",
    "available_solvers",
    "infeasible_error",
    "solve",
    "solve_compiled",
    "solve_model",
    "solve_stats",
]

_MIN_PEAK_TIME_LIMIT = 10.0  # seconds spent explaining an infeasible budget, at most
_DOMINANT_NODES = 5
# Probing (`_probe`): at most this many groups, and this many branch LPs in all.
PROBE_GROUPS = 3
PROBE_LPS = 48


@dataclass(frozen=True)
class InfeasibilityDetails:
    """Why no solution fits the memory budget, and by how much."""

    budget: float
    # Smallest achievable peak memory in bytes; a lower bound on it when `proven` is False.
    min_peak: float
    proven: bool
    # min_peak - budget: how much the budget would have to grow (at least).
    shortfall: float
    # The live point that sets min_peak under `solution`, if any.
    live_point: int | None
    live_point_label: str
    fixed_bytes: float
    # The largest chosen footprints at that live point: (node index, node name, bytes), largest first.
    dominant: tuple[tuple[int, str, float], ...]
    # A solution reaching the smallest peak found (None when none was found).
    solution: Solution | None
    # That solution's peak with the resharded copies its operands need, when they add to it
    # (min_peak is then a lower bound, proven False).
    with_copies: float | None = None


class InfeasibleError(SolverError):
    """No choice of strategies fits the memory budget; `details` says by how much."""

    def __init__(self, message: str, details: InfeasibilityDetails) -> None:
        super().__init__(message, details)
        self.message = message
        self.details = details

    def __str__(self) -> str:
        return self.message


def _min_peak_choice(
    model: Model, backend: str, time_limit: float, threads: int
) -> tuple[list[int] | None, bool]:
    """Minimise the largest live point (ILP); return a choice per group and whether proven."""
    if not model.groups:
        return [], True
    memory = model.memory
    # Only points whose largest load reaches the largest smallest load can set the peak.
    floor = float(memory.min_load.max()) if memory.count else 0.0
    points = [int(p) for p in np.flatnonzero(memory.max_load >= floor)]
    lp = backends.Lp()
    s = []
    for group in model.groups:
        columns = [lp.column(f"s_{group.rep}_{i}", 0.0, 0.0, 1.0, True)
                   for i in range(group.size)]
        s.append(columns)
        lp.row(f"one_{group.rep}", columns, [1.0] * len(columns), 1.0, 1.0)
    built = Built(model, lp, backend, s, {}, mip_presolve=True)
    backends.add_chain(built, points, None)
    built.peak = lp.column("peak", 1.0, 0.0)
    for p, load in built.chain:
        lp.row(f"peak_{p}", [load, built.peak], [1.0, -1.0], -math.inf,
               -float(memory.constant[p]) * MEMORY_SCALE)
    status = backends.run(built, backend, time_limit=time_limit, threads=threads)
    if built.time_limited:  # the smallest peak reported (and searched on by pipelines) varies
        clock.cut("the smallest-peak ILP of an infeasible budget")
    if status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        return None, False
    return backends.read_choice(built), status == pulp.LpSolutionOptimal


def infeasible_error(
    problem: ShardingProblem, model: Model, backend: str | None, time_limit: float, threads: int
) -> InfeasibleError:
    """Build the error for a budget nothing fits, with the smallest achievable peak."""
    budget = problem.memory_budget
    memory = model.memory
    lower = float(memory.min_load.max()) if memory.count else 0.0
    choice, proven = (None, False)
    if backend is not None:
        choice, proven = _min_peak_choice(
            model, backend, min(time_limit, _MIN_PEAK_TIME_LIMIT), threads
        )
    solution = model.to_choice(choice) if choice is not None else None
    point, fixed, dominant = None, 0.0, ()
    min_peak, with_copies = lower, None
    if solution is not None:
        evaluation = evaluate(problem, solution, copies=False)
        if proven:
            min_peak = evaluation.peak_memory
            # Found without the resharded copies operands need (the ILP's model): a lower
            # bound, exact only when the plan reaching it makes no copy that adds to it.
            peak_with_copies = evaluate(problem, solution).peak_memory
            if peak_with_copies > min_peak * (1 + MEMORY_RTOL):
                proven, with_copies = False, peak_with_copies
        point = evaluation.peak_point
    if point is None and problem.live_points:
        point = int(np.argmax(memory.min_load))
    label = ""
    if point is not None:
        live = problem.live_points[point]
        label, fixed = live.label or f"#{point}", live.fixed_bytes
        if solution is not None:
            sizes = [
                (i, problem.nodes[i].name, problem.nodes[i].strategies[solution.choice[i]].memory)
                for i in problem.nodes_at(point)
            ]
            sizes.sort(key=lambda t: (-t[2], t[0]))
            dominant = tuple(sizes[:_DOMINANT_NODES])
    details = InfeasibilityDetails(
        budget=budget,
        min_peak=min_peak,
        proven=proven,
        shortfall=min_peak - budget,
        live_point=point,
        live_point_label=label,
        fixed_bytes=fixed,
        dominant=dominant,
        solution=solution,
        with_copies=with_copies,
    )
    return InfeasibleError(_infeasible_message(details), details)


def _infeasible_message(d: InfeasibilityDetails) -> str:
    qualifier = "" if d.proven else "at least "
    text = (
        f"memory budget {format_bytes(d.budget)} cannot be met: the smallest achievable peak is "
        f"{qualifier}{format_bytes(d.min_peak)}"
    )
    if d.live_point is not None:
        text += f" at live point {d.live_point_label}"
    text += f", {qualifier}{format_bytes(max(d.shortfall, 0.0))} over budget"
    if d.fixed_bytes:
        text += f"; {format_bytes(d.fixed_bytes)} there is fixed"
    if d.dominant:
        largest = ", ".join(f"{name} ({format_bytes(b)})" for _, name, b in d.dominant)
        text += f"; largest there: {largest}"
    if d.with_copies is not None:
        text += (f"; the plan reaching it peaks at {format_bytes(d.with_copies)} with the "
                 "resharded copies its operands need")
    return text


def solve_stats(
    problem: ShardingProblem,
    solution: Solution,
    *,
    solver: str,
    status: str,
    bound: float,
    started: float,
    variables: int,
    constraints: int,
    extra: dict,
) -> tuple[Solution, SolveStats]:
    evaluation = evaluate(problem, solution, copies=False)
    if not evaluation.feasible:
        raise SolverError(f"{solver} returned an infeasible solution: {evaluation.violations}")
    objective = evaluation.total
    bound = min(bound, objective)
    gap = (objective - bound) / max(abs(objective), 1e-12) if math.isfinite(bound) else math.inf
    return solution, SolveStats(
        solver=solver,
        status=status,
        objective=objective,
        bound=bound,
        gap=max(gap, 0.0),
        seconds=time.perf_counter() - started,
        variables=variables,
        constraints=constraints,
        extra=extra,
    )


def solve(
    problem: ShardingProblem,
    *,
    time_limit: float = 60.0,
    solver: str = "auto",
    threads: int = 1,
    memory_rows: str = "auto",
    gap: float = MIP_REL_GAP,
    node_limit: int = MIP_NODE_LIMIT,
) -> tuple[Solution, SolveStats]:
    """Find the cheapest strategy per node that fits the memory budget.

    `solver` is "auto" (HiGHS when highspy is importable, else CBC), "highs" or "cbc". With the
    default single thread the result is deterministic unless the time limit cuts the solve
    short. Status is "optimal", "within_gap" (the plan is proven within the relative `gap` of
    the optimum, but not to 1e-6), "node_limit" when branch and bound stopped at `node_limit`
    nodes with a feasible but unproven solution (a limit on work: the same plan on any
    machine), or "time_limit" when the clock stopped the search (the best solution found is
    returned; it depends on the machine's speed). `SolveStats.extra["deterministic"]` is False
    whenever the time limit cut some part of the solve. `SolveStats.gap` is always the gap to
    the best bound known. Raises InfeasibleError when no choice fits the budget, SolverError
    when the solver found nothing usable in time.

    `memory_rows` is "lazy" (rows added as solutions violate them), "chain" (every binding
    point, through load variables) or "auto" (lazy for HiGHS, chain for CBC); both are exact.
    `gap`: the relative gap at which the search may stop (default 1e-6: optimal).
    """
    started = time.perf_counter()
    problem.validate()
    _backend(solver, memory_rows)  # bad options fail before compiling
    return solve_compiled(problem, compile_model(problem), time_limit=time_limit, solver=solver,
                          threads=threads, memory_rows=memory_rows, gap=gap, started=started,
                          node_limit=node_limit)


def solve_compiled(
    problem: ShardingProblem,
    model: Model,
    *,
    time_limit: float = 60.0,
    solver: str = "auto",
    threads: int = 1,
    memory_rows: str = "auto",
    gap: float = MIP_REL_GAP,
    started: float | None = None,
    node_limit: int = MIP_NODE_LIMIT,
) -> tuple[Solution, SolveStats]:
    """`solve` for a validated problem and its compiled model (`compile_model(problem)`);
    `started`: when the solve began (its seconds are counted from there; default: now)."""
    started = time.perf_counter() if started is None else started
    backend = _backend(solver, memory_rows)
    budget = problem.memory_budget
    memory = model.memory
    if memory.count and not all(memory_fits(float(v), budget) for v in memory.min_load):
        raise infeasible_error(problem, model, backend, time_limit, threads)
    binding = model.binding_points(budget)
    if not model.groups or (not model.pairs and not binding and not model.launches):
        return _solve_directly(problem, model, started)
    lazy = memory_rows == "lazy" or (memory_rows == "auto" and backend == "highs")
    return _solve_ilp(problem, model, backend, time_limit, threads, started, lazy, gap,
                      node_limit)


def _backend(solver: str, memory_rows: str) -> str:
    backend = backends.pick_backend(solver)
    if memory_rows not in ("auto", "lazy", "chain"):
        raise ValueError(f"unknown memory_rows {memory_rows!r}: expected auto, lazy or chain")
    return backend


def _solve_directly(
    problem: ShardingProblem, model: Model, started: float
) -> tuple[Solution, SolveStats]:
    """Each group's cheapest strategy: optimal when nothing couples the decisions."""
    choice = [int(np.argmin(costs)) for costs in model.linear]
    return solve_stats(
        problem,
        model.to_choice(choice),
        solver="direct",
        status="optimal",
        bound=math.inf,
        started=started,
        variables=0,
        constraints=0,
        extra={"backend": None},
    )


def _solver_choice(model: Model, built: Built, status: int, budget: float) -> list[int] | None:
    """The solver's choice if it has one that fits every live point.

    A binary within the solver's integrality tolerance of 1 can still leave a memory row a few
    bytes over once rounded; such a choice is discarded rather than reported as feasible.
    """
    if status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        return None
    choice = backends.read_choice(built)
    if choice is None or not model.fits(budget, choice):
        return None
    return choice


def _integral_choice(built: Built) -> list[int] | None:
    """The relaxation's choice when every one-hot group came out integral."""
    groups = backends.group_values(built)
    if groups is None:
        return None
    choice = []
    for values in groups:
        best = int(np.argmax(values))
        if values[best] < 1.0 - INTEGRALITY_TOL:
            return None
        choice.append(best)
    return choice


@dataclass
class Outcome:
    """What solving a compiled model gave: a choice per group and how good it is known to be."""

    choice: list[int]
    status: str  # "optimal", "within_gap", "node_limit", "time_limit" or "lp_rounded"
    bound: float  # seconds, a lower bound on the optimum (-inf: none)
    variables: int
    constraints: int
    extra: dict


def solve_model(
    model: Model,
    budget: float,
    backend: str,
    deadline: float,
    threads: int,
    lazy: bool,
    start: list[int] | None = None,
    branch: bool = True,
    gap: float = MIP_REL_GAP,
    search: bool = True,
    reduce: bool = True,
    node_limit: int = MIP_NODE_LIMIT,
) -> Outcome:
    """Solve a compiled model. `start`: a choice known to fit, used as the incumbent when the
    solver's own start is worse. `branch=False` stops after the LP relaxation: its choice when
    integral, else the better of the repaired rounding and `start` (status "lp_rounded").
    `node_limit`: branch-and-bound nodes per MIP solve (status "node_limit" when it stops
    the search unproven; "time_limit" when the clock did, `extra["time_limited"]`).
    `gap`: stop once the incumbent is proven within this relative gap of the optimum (status
    "optimal" when that gap is at most MIP_REL_GAP, else "within_gap"; the gap is reported).
    `search`: improve a fractional LP's rounding by neighbourhood search before branching.
    `reduce`: first eliminate the groups only pairwise costs tie to the rest (exact;
    `reduce.eliminate`).
    Raises ModelInfeasible, or SolverError when nothing usable was found in time."""
    binding = model.binding_points(budget)
    if not model.groups or (not model.pairs and not binding and not model.launches):
        choice = [int(np.argmin(costs)) for costs in model.linear]
        return Outcome(choice, "optimal", model.objective(choice), 0, 0,
                       {"backend": None, "source": "direct"})
    if reduce:
        reduction = eliminate(model, budget)
        if reduction.eliminated:
            outcome = solve_model(reduction.model, budget, backend, deadline, threads, lazy,
                                  reduction.restrict(start), branch, gap, search, reduce=False,
                                  node_limit=node_limit)
            outcome.choice = reduction.expand(outcome.choice)
            outcome.extra["eliminated_groups"] = reduction.eliminated
            return outcome
    built = backends.build(model, binding, budget, backend, lazy)
    built.gap = max(float(gap), MIP_REL_GAP)
    built.node_limit = int(node_limit)
    kind = "lazy" if lazy else "chain"
    backends.seed_rows(built, budget, binding)
    # The LP relaxation of this formulation is usually integral (as reported for Alpa-style
    # ILPs) and several times faster than branch and bound: when its optimum is one-hot it is
    # the ILP optimum, proven by its own bound.
    status = backends.run_lazy(built, backend, budget, deadline, threads, mip=False)
    if status == pulp.LpSolutionInfeasible:
        raise ModelInfeasible()
    relaxed = backends.group_values(built) if status == pulp.LpSolutionOptimal else None
    lp_bound = built.objective if status == pulp.LpSolutionOptimal else None
    choice = _integral_choice(built) if relaxed is not None else None
    if choice is not None and model.fits(budget, choice):
        bound = lp_bound / TIME_SCALE + model.constant
        return Outcome(choice, "optimal", bound, built.variables, built.constraints,
                        {"backend": backend, "raw_status": "LP relaxation integral",
                         "source": "lp", "solver_objective": bound, "memory_rows": kind,
                         "lazy_rows": len(built.memory_rows)})
    heuristic = heuristics.feasible_start(model, budget, relaxed)
    if start is not None and model.fits(budget, start) and (
            heuristic is None or model.objective(start) < model.objective(heuristic)):
        heuristic = list(start)
    if not branch:
        if heuristic is None:
            raise SolverError("no rounding of the LP relaxation fits")
        return Outcome(heuristic, "lp_rounded",
                        lp_bound / TIME_SCALE + model.constant if lp_bound is not None
                        else -math.inf, built.variables, built.constraints,
                        {"backend": backend, "source": "rounded LP", "memory_rows": kind,
                         "lazy_rows": len(built.memory_rows),
                         "time_limited": built.time_limited})
    extra: dict = {
        "backend": backend,
        "heuristic_objective": model.objective(heuristic) if heuristic is not None else None,
        "memory_rows": kind,
        "relative_gap_limit": built.gap,
    }
    source = "heuristic"
    if search and relaxed is not None:
        followed = heuristics.follow_flows(model, budget, built)
        if followed is not None and (heuristic is None
                                     or model.objective(followed) < model.objective(heuristic)):
            extra["flow_objective"] = model.objective(followed)
            heuristic, source = followed, "flow rounding"
    # The LP optimum bounds every plan: stop as soon as the incumbent is close enough to it.
    lp_seconds = lp_bound / TIME_SCALE + model.constant if lp_bound is not None else None

    def within_gap(choice) -> bool:
        if choice is None or lp_seconds is None:
            return False
        objective = model.objective(choice)
        return objective - lp_seconds <= built.gap * abs(objective)

    if (search and heuristic is not None and relaxed is not None and not within_gap(heuristic)
            and len(heuristics.fractional_groups(relaxed))
            > heuristics.NEIGHBOURHOOD_MAX_FRACTION * len(model.groups)):
        # Fractional nearly everywhere: a neighbourhood would be the whole problem. Dive.
        dived, dives = heuristics.dive(model, budget, backend, deadline, threads, lazy, relaxed)
        extra["dive_rounds"] = dives
        if dived is not None and model.objective(dived) < model.objective(heuristic):
            extra["dive_objective"] = model.objective(dived)
            heuristic, source = dived, "LP dive"
    if (search and heuristic is not None and relaxed is not None
            and not within_gap(heuristic)):
        def solve_sub(sub: Model, sub_start: list[int]) -> list[int]:
            return solve_model(sub, budget, backend, deadline, threads, lazy, sub_start,
                               search=False, node_limit=node_limit).choice

        found, rounds = heuristics.search_neighbourhoods(model, budget, relaxed, heuristic,
                                                         deadline, solve_sub)
        extra["neighbourhood_rounds"] = rounds
        if found is not None:
            extra["neighbourhood_objective"] = model.objective(found)
            heuristic, source = found, "neighbourhood search"
    if within_gap(heuristic):
        extra.update(raw_status="within gap of the LP relaxation", source=source,
                     lazy_rows=len(built.memory_rows))
        return Outcome(heuristic, _proven_status(model.objective(heuristic), lp_seconds),
                        lp_seconds, built.variables, built.constraints, extra)
    fixed = 0
    probe_bound = -math.inf
    if heuristic is not None and relaxed is not None:
        fixed = backends.fix_by_reduced_costs(
            built, (model.objective(heuristic) - model.constant) * TIME_SCALE)
    if search and heuristic is not None and relaxed is not None:
        def solve_branch(sub: Model) -> Outcome:
            return solve_model(sub, budget, backend, deadline, threads, lazy, branch=False,
                               search=False, node_limit=node_limit)

        probe = _probe(model, budget, built, relaxed, heuristic, built.gap, deadline,
                       solve_branch)
        extra.update(probed_groups=probe.groups, probe_lps=probe.lps)
        if probe.time_limited:
            built.time_limited = True
        if probe.choice is not None:
            extra["probe_objective"] = model.objective(probe.choice)
            heuristic, source = probe.choice, "probing"
        probe_bound = probe.bound
        objective = model.objective(heuristic)
        if objective - probe_bound <= built.gap * abs(objective):
            extra.update(raw_status="within gap of the probed LP bound", source=source,
                         lazy_rows=len(built.memory_rows), fixed_by_reduced_cost=fixed,
                         time_limited=built.time_limited)
            return Outcome(heuristic, _proven_status(objective, probe_bound), probe_bound,
                           built.variables, built.constraints, extra)
        fixed += backends.fix_columns(built, probe.pruned)
    values = backends.start_values(built, heuristic) if heuristic is not None else None
    backends.preseed_rows(built, budget)
    status = backends.run_lazy(built, backend, budget, deadline, threads, mip=True, start=values)
    if status == pulp.LpSolutionInfeasible:
        raise ModelInfeasible()
    extra.update({
        "raw_status": pulp.LpSolution.get(status, str(status)),
        "source": "solver",
        "lazy_rows": len(built.memory_rows),
        "fixed_by_reduced_cost": fixed,
        "nodes": built.nodes,
        "node_limit": built.node_limit,
    })
    choice = _solver_choice(model, built, status, budget)
    bound = None
    if choice is not None:
        extra["solver_objective"] = (built.objective or 0.0) / TIME_SCALE + model.constant
        bound = built.dual_bound
        if (status != pulp.LpSolutionOptimal and heuristic is not None
                and model.objective(heuristic) < model.objective(choice)):
            choice, extra["source"] = heuristic, "heuristic"
    elif heuristic is not None:
        choice, extra["source"] = heuristic, "heuristic"
    else:
        # _solve_ilp wraps this with the time limit and what to do.
        raise SolverError(f"status: {extra['raw_status']}")
    proven = status == pulp.LpSolutionOptimal and extra["source"] == "solver"
    if bound is None:
        bound = lp_bound
    if bound is None and not proven:
        # Any LP optimum over a subset of the memory rows is a lower bound too.
        remaining = max(deadline - time.perf_counter(), 1.0)
        if backends.run(built, backend, time_limit=remaining, threads=threads,
                        mip=False) == pulp.LpSolutionOptimal:
            bound = built.objective
    bound = bound / TIME_SCALE + model.constant if bound is not None else -math.inf
    # Probing's bound holds for the whole problem (its branches cover every plan).
    bound = max(bound, probe_bound)
    extra["time_limited"] = built.time_limited
    if not proven:
        # Stopped by the node limit alone: the same plan on any machine. Anything else (the
        # clock, or a solver that gave up) may not be.
        status_text = ("node_limit" if built.node_limited and not built.time_limited
                       else "time_limit")
    elif built.gap <= MIP_REL_GAP:
        status_text = "optimal"  # proven by the backend to its strictest gap
    else:
        status_text = _proven_status(model.objective(choice), bound)
    return Outcome(choice, status_text, bound, built.variables, built.constraints, extra)


@dataclass
class _Probed:
    """What probing found: a better choice (None: none), the bound it proves (seconds), the
    (group, strategy) branches no plan better than the incumbent takes, and its work."""

    choice: list[int] | None
    bound: float
    pruned: list[tuple[int, int]]
    groups: int
    lps: int
    time_limited: bool


def _probe(model: Model, budget: float, built: Built, relaxed: list[np.ndarray],
           incumbent: list[int], gap: float, deadline: float,
           solve_branch) -> _Probed:
    """Branch on whole groups at the root: for a group the LP splits, solve the LP relaxation
    once per strategy with the group held at it (`solve_branch(sub)`: `solve_model` of the
    restriction, branch=False). Every plan takes one strategy per group, so the smallest of
    those LP bounds bounds the optimum, and it is much tighter than the root LP's where the
    LP averages layouts that no plan can mix: a 2-layer Hugging Face Llama on v5e 4x8 has its
    root LP 0.99% under its optimum, and held at the optimum's strategy for the group with the
    most pairwise neighbours (a broadcast that 31 groups read) the LP comes out integral at
    the optimum, which no rounding of the root LP's layouts reaches; the other strategies'
    LPs bound the optimum within 0.34%. A branch LP is smaller than the root's (the held
    group drops out, and `reduce.eliminate` folds the chains it split). Groups go by number of pairwise neighbours,
    at most PROBE_GROUPS of them and PROBE_LPS LPs, until the incumbent is proven within
    `gap`. Strategies that reduced costs price out of any plan better than the incumbent
    (`backends.fix_by_reduced_costs`, run again whenever probing improves it) are left out of
    every branch LP, and their own branches are not solved: their plans cost at least the
    incumbent. Exact: the bound holds for every plan, and a branch is pruned (fixed out of the
    MIP that follows) only when its LP bound is at least the incumbent's objective."""
    degree = [0] * len(model.groups)
    for a, b in model.pairs:
        degree[a] += 1
        degree[b] += 1
    order = sorted(heuristics.fractional_groups(relaxed), key=lambda g: (-degree[g], g))
    best, objective = list(incumbent), model.objective(incumbent)
    improved = False
    bound, lps, groups, clocked = -math.inf, 0, 0, False
    branch_bounds: dict[tuple[int, int], float] = {}

    def open_strategies(g: int) -> np.ndarray:
        columns = built.s[g]
        low = np.array([built.lp.lower[c] for c in columns])
        high = np.array([built.lp.upper[c] for c in columns])
        one = np.flatnonzero(low > 0.5)
        return one if len(one) else np.flatnonzero(high > 0.5)

    for g in order[:PROBE_GROUPS]:
        if lps + len(open_strategies(g)) > PROBE_LPS:
            continue
        group_bound = math.inf
        # The LP's strategies first: they are where a better plan is likeliest.
        for s in sorted(open_strategies(g).tolist(), key=lambda i: (-relaxed[g][i], i)):
            if s not in open_strategies(g):  # priced out by an incumbent found meanwhile
                continue
            if time.perf_counter() >= deadline:
                clocked = True
                break
            allowed = [np.array([s]) if h == g else open_strategies(h)
                       for h in range(len(model.groups))]
            if any(not len(keep) for keep in allowed):
                continue  # no plan better than the incumbent takes s
            sub = model.restrict(allowed)
            if sub.memory.count and not all(memory_fits(float(v), budget)
                                            for v in sub.memory.min_load):
                branch_bounds[(g, s)] = math.inf  # s alone puts some point over the budget
                continue
            lps += 1
            try:
                outcome = solve_branch(sub)
            except ModelInfeasible:
                branch_bounds[(g, s)] = math.inf
                continue
            except SolverError:
                group_bound = -math.inf
                continue
            clocked = clocked or bool(outcome.extra.get("time_limited"))
            branch_bounds[(g, s)] = outcome.bound
            group_bound = min(group_bound, outcome.bound)
            choice = [int(keep[i]) for keep, i in zip(allowed, outcome.choice, strict=True)]
            if model.fits(budget, choice):
                heuristics.improve(model, budget, choice)
                if model.objective(choice) < objective - 1e-12 * abs(objective):
                    best, objective, improved = choice, model.objective(choice), True
                    backends.fix_by_reduced_costs(
                        built, (objective - model.constant) * TIME_SCALE)
        else:
            groups += 1
            # Strategies not solved were priced out: their plans cost at least the incumbent.
            bound = max(bound, min(group_bound, objective))
            if objective - bound <= gap * abs(objective):
                break
            continue
        break  # out of time
    # The incumbent's own strategies stay: it remains the MIP's start.
    pruned = sorted((g, i) for (g, i), value in branch_bounds.items()
                    if value >= objective and best[g] != i)
    return _Probed(best if improved else None, bound, pruned, groups, lps, clocked)


def _proven_status(objective: float, bound: float) -> str:
    """"optimal" when `bound` proves `objective` optimal to MIP_REL_GAP, else "within_gap"."""
    return "optimal" if objective - bound <= MIP_REL_GAP * abs(objective) else "within_gap"


def _solve_ilp(
    problem: ShardingProblem,
    model: Model,
    backend: str,
    time_limit: float,
    threads: int,
    started: float,
    lazy: bool,
    gap: float = MIP_REL_GAP,
    node_limit: int = MIP_NODE_LIMIT,
) -> tuple[Solution, SolveStats]:
    deadline = started + time_limit
    try:
        outcome = solve_model(model, problem.memory_budget, backend, deadline, threads, lazy,
                              gap=gap, node_limit=node_limit)
    except ModelInfeasible:
        raise infeasible_error(problem, model, backend, time_limit, threads) from None
    except SolverError as exc:
        raise SolverError(f"{backend} found no solution within {time_limit:g} s "
                          f"({exc}); raise the time limit") from None
    # Every limit the search itself sets is a count (rounds, windows, nodes): only the clock
    # can make the plan depend on the machine. It cut the solve when a backend stopped at it,
    # or when the solve ran past the deadline (a heuristic then skips its remaining rounds).
    clocked = bool(outcome.extra.pop("time_limited", False)) or time.perf_counter() >= deadline
    outcome.extra["deterministic"] = not clocked
    if clocked:
        clock.cut(f"a {len(model.groups)}-decision ILP")
    status = outcome.status
    if clocked and status == "node_limit":
        status = "time_limit"
    return solve_stats(
        problem,
        model.to_choice(outcome.choice),
        solver=backend,
        status=status,
        bound=outcome.bound,
        started=started,
        variables=outcome.variables,
        constraints=outcome.constraints,
        extra=outcome.extra,
    )
