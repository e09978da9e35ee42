"""Choose a strategy per node by integer linear programming (PuLP, with HiGHS or CBC).

The problem is first compiled to *decision groups*: nodes tied together share one set of one-hot
binaries, and nodes with a single strategy are constants. Edges then become either linear terms
(when one end is constant, both ends are the same group, or the matrix is separable into a row
part plus a column part) or a pairwise term linearised with the transportation polytope:

    e[i][j] >= 0,  sum_j e[i][j] = s_src[i],  sum_i e[i][j] = s_dst[j]

which is exact for one-hot binaries (the only feasible e is the product) and gives a tighter LP
relaxation than the usual `e >= s_src + s_dst - 1` form. Costs enter the solver in microseconds and
memory in MiB so that coefficients sit near 1; everything reported back is in seconds and bytes,
recomputed by `evaluate()` from the chosen indices.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import pulp

from hloplan.solver.evaluate import evaluate, memory_fits
from hloplan.solver.problem import ShardingProblem, Solution, SolveStats
from hloplan.units import format_bytes

__all__ = [
    "InfeasibilityDetails",
    "InfeasibleError",
    "SolverError",
    "available_solvers",
    "solve",
]

_TIME_SCALE = 1e6  # seconds -> microseconds inside the solver
_MEMORY_SCALE = 1.0 / 2**20  # bytes -> MiB inside the solver
_MIP_REL_GAP = 1e-6  # HiGHS defaults to 1e-4, which would let two backends disagree visibly
_SEPARABLE_TOL = 1e-12  # relative to the largest entry of a cost matrix
_MIN_PEAK_TIME_LIMIT = 10.0  # seconds spent explaining an infeasible budget, at most
_DOMINANT_NODES = 5


class SolverError(RuntimeError):
    """The solver produced no usable solution (and did not prove the problem infeasible)."""


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


class InfeasibleError(SolverError):
    """No choice of strategies fits the memory budget; `details` says by how much."""

    def __init__(self, message: str, details: InfeasibilityDetails) -> None:
        super().__init__(message, details)
        self.message = message
        self.details = details

    def __str__(self) -> str:
        return self.message


# --------------------------------------------------------------------------- compiled model


@dataclass(frozen=True)
class _Group:
    """Nodes that take one decision together (a tie group, or a single node)."""

    nodes: tuple[int, ...]
    size: int

    @property
    def rep(self) -> int:
        """The first member's node index; names the solver variables deterministically."""
        return self.nodes[0]


@dataclass(frozen=True)
class _Row:
    """One live point over decision groups: constant + sum_g coeffs[g][choice[g]] bytes."""

    point: int
    constant: float
    coeffs: dict[int, list[float]]

    @property
    def min_load(self) -> float:
        return sum(min(c) for c in self.coeffs.values())

    @property
    def max_load(self) -> float:
        return sum(max(c) for c in self.coeffs.values())


@dataclass
class _Model:
    groups: list[_Group]
    group_of: list[int]  # per node: its group, or -1 for a single-strategy (constant) node
    linear: list[list[float]]  # per group and strategy, seconds
    pairs: dict[tuple[int, int], list[list[float]]]  # (a, b) with a < b: matrix[i_a][j_b], seconds
    constant: float  # seconds that no decision changes
    rows: list[_Row] = field(default_factory=list)

    def to_choice(self, group_choice: Sequence[int]) -> Solution:
        """Expand one index per group to one index per node."""
        return Solution(tuple(0 if g < 0 else group_choice[g] for g in self.group_of))


def _group_nodes(problem: ShardingProblem) -> tuple[list[_Group], list[int]]:
    """Decision groups in order of their first node, and each node's group (-1: constant)."""
    members: dict[object, list[int]] = {}
    for index, node in enumerate(problem.nodes):
        key = ("tie", node.tie) if node.tie is not None else ("node", index)
        members.setdefault(key, []).append(index)
    groups: list[_Group] = []
    group_of = [-1] * len(problem.nodes)
    for nodes in members.values():
        size = len(problem.nodes[nodes[0]].strategies)
        if size == 1:
            continue
        for index in nodes:
            group_of[index] = len(groups)
        groups.append(_Group(tuple(nodes), size))
    return groups, group_of


def _separable(matrix: list[list[float]]) -> bool:
    """Whether matrix[i][j] == row[i] + col[j] for some vectors (then it is two linear terms)."""
    scale = max((abs(v) for row in matrix for v in row), default=0.0)
    tol = _SEPARABLE_TOL * max(scale, 1e-300)
    base = matrix[0][0]
    return all(
        abs(matrix[i][j] - (matrix[i][0] + matrix[0][j] - base)) <= tol
        for i in range(len(matrix))
        for j in range(len(matrix[0]))
    )


def _add_edges(problem: ShardingProblem, model: _Model) -> None:
    """Fold every edge into linear terms, the constant, or a merged pairwise matrix."""
    for edge in problem.edges:
        gs, gd = model.group_of[edge.src], model.group_of[edge.dst]
        costs = edge.costs
        if gs < 0 and gd < 0:
            model.constant += costs[0][0]
        elif gs < 0:
            for j, c in enumerate(costs[0]):
                model.linear[gd][j] += c
        elif gd < 0:
            for i, row in enumerate(costs):
                model.linear[gs][i] += row[0]
        elif gs == gd:  # same tie group: both ends pick the same index
            for i in range(model.groups[gs].size):
                model.linear[gs][i] += costs[i][i]
        else:
            a, b = min(gs, gd), max(gs, gd)
            matrix = model.pairs.setdefault(
                (a, b), [[0.0] * model.groups[b].size for _ in range(model.groups[a].size)]
            )
            for i, row in enumerate(costs):
                for j, c in enumerate(row):
                    if gs == a:
                        matrix[i][j] += c
                    else:
                        matrix[j][i] += c
    for (a, b), matrix in list(model.pairs.items()):
        if _separable(matrix):  # includes the all-zero matrix
            for i, row in enumerate(matrix):
                model.linear[a][i] += row[0] - matrix[0][0]
            for j, c in enumerate(matrix[0]):
                model.linear[b][j] += c
            del model.pairs[(a, b)]


def _add_rows(problem: ShardingProblem, model: _Model) -> None:
    """Express each live point over decision groups (a node listed twice counts once)."""
    for p, point in enumerate(problem.live_points):
        constant = point.fixed_bytes
        coeffs: dict[int, list[float]] = {}
        for index in dict.fromkeys(point.nodes):
            node, g = problem.nodes[index], model.group_of[index]
            if g < 0:
                constant += node.strategies[0].memory
                continue
            row = coeffs.setdefault(g, [0.0] * model.groups[g].size)
            for i, strategy in enumerate(node.strategies):
                row[i] += strategy.memory
        model.rows.append(_Row(p, constant, coeffs))


def _compile(problem: ShardingProblem) -> _Model:
    groups, group_of = _group_nodes(problem)
    model = _Model(groups, group_of, [[0.0] * g.size for g in groups], {}, 0.0)
    for index, node in enumerate(problem.nodes):
        g = group_of[index]
        if g < 0:
            model.constant += node.strategies[0].cost
        else:
            for i, strategy in enumerate(node.strategies):
                model.linear[g][i] += strategy.cost
    _add_edges(problem, model)
    _add_rows(problem, model)
    return model


def _binding_rows(model: _Model, budget: float) -> list[_Row]:
    """Rows that some choice could push over the budget (the others need no constraint)."""
    if math.isinf(budget):
        return []
    return [r for r in model.rows if not memory_fits(r.constant + r.max_load, budget)]


def _objective(model: _Model, choice: Sequence[int]) -> float:
    """Seconds for one index per group, from the compiled model."""
    total = model.constant + sum(model.linear[g][i] for g, i in enumerate(choice))
    for (a, b), matrix in model.pairs.items():
        total += matrix[choice[a]][choice[b]]
    return total


# --------------------------------------------------------------------------- heuristic start


def _fits(rows: list[_Row], budget: float, choice: Sequence[int]) -> bool:
    return all(
        memory_fits(r.constant + sum(c[choice[g]] for g, c in r.coeffs.items()), budget)
        for r in rows
    )


def _argmin(values: Sequence[float]) -> int:
    return min(range(len(values)), key=values.__getitem__)


def _improve(model: _Model, rows: list[_Row], budget: float, choice: list[int]) -> None:
    """First-improvement local search over single groups, keeping every row under budget."""
    neighbours: list[list[tuple[int, list[list[float]], bool]]] = [[] for _ in model.groups]
    for (a, b), matrix in model.pairs.items():
        neighbours[a].append((b, matrix, True))
        neighbours[b].append((a, matrix, False))
    member_rows: list[list[int]] = [[] for _ in model.groups]
    for r, row in enumerate(rows):
        for g in row.coeffs:
            member_rows[g].append(r)
    loads = [r.constant + sum(c[choice[g]] for g, c in r.coeffs.items()) for r in rows]

    def local_cost(g: int, i: int) -> float:
        cost = model.linear[g][i]
        for other, matrix, forward in neighbours[g]:
            cost += matrix[i][choice[other]] if forward else matrix[choice[other]][i]
        return cost

    for _ in range(4):
        improved = False
        for g, group in enumerate(model.groups):
            current = choice[g]
            best, best_cost = current, local_cost(g, current)
            for i in range(group.size):
                cost = local_cost(g, i)
                if cost < best_cost - 1e-15 * abs(best_cost) and all(
                    memory_fits(
                        loads[r] + rows[r].coeffs[g][i] - rows[r].coeffs[g][current], budget
                    )
                    for r in member_rows[g]
                ):
                    best, best_cost = i, cost
            if best != current:
                for r in member_rows[g]:
                    loads[r] += rows[r].coeffs[g][best] - rows[r].coeffs[g][current]
                choice[g] = best
                improved = True
        if not improved:
            return


def _heuristic(model: _Model, budget: float) -> list[int] | None:
    """A feasible start for the solver (and a fallback if it finds nothing), or None."""
    rows = _binding_rows(model, budget)
    cheapest = [_argmin(costs) for costs in model.linear]
    if _fits(rows, budget, cheapest):
        choice = cheapest
    else:
        memory = [[0.0] * g.size for g in model.groups]
        for row in rows:
            for g, coeffs in row.coeffs.items():
                for i, c in enumerate(coeffs):
                    memory[g][i] += c
        choice = [
            min(range(g.size), key=lambda i, k=k: (memory[k][i], model.linear[k][i]))
            for k, g in enumerate(model.groups)
        ]
        if not _fits(rows, budget, choice):
            return None
    _improve(model, rows, budget, choice)
    return choice


# --------------------------------------------------------------------------- PuLP model


_INTEGRALITY_TOL = 1e-6


def _classes(matrix: list[list[float]]) -> list[list[int]]:
    """Indices of equal rows of `matrix`, grouped, in order of first appearance."""
    groups: dict[tuple[float, ...], list[int]] = {}
    for index, row in enumerate(matrix):
        groups.setdefault(tuple(row), []).append(index)
    return list(groups.values())


def _new_var(prob: pulp.LpProblem, name: str, low: float, up: float | None, cat: str):
    """A PuLP variable, without the PuLP 3.3 deprecation of the LpVariable constructor."""
    if hasattr(prob, "add_variable"):
        return prob.add_variable(name, low, up, cat=cat)
    return pulp.LpVariable(name, low, up, cat=cat)


@dataclass
class _Built:
    prob: pulp.LpProblem
    s: list[list[pulp.LpVariable]]
    e: dict[tuple[int, int], tuple[list[list[pulp.LpVariable]], list[list[int]], list[list[int]]]]


def _build(model: _Model, rows: list[_Row], budget: float) -> _Built:
    """The ILP: one-hot binaries per group, transportation edges, memory rows."""
    prob = pulp.LpProblem("hloplan", pulp.LpMinimize)
    terms: list[tuple[pulp.LpVariable, float]] = []
    s = []
    for g, group in enumerate(model.groups):
        row = [_new_var(prob, f"s_{group.rep}_{i}", 0, 1, pulp.LpBinary) for i in range(group.size)]
        s.append(row)
        prob += pulp.LpAffineExpression([(v, 1.0) for v in row]) == 1, f"one_{group.rep}"
        terms += [(v, c * _TIME_SCALE) for v, c in zip(row, model.linear[g], strict=True) if c]
    e = {}
    for (a, b), matrix in sorted(model.pairs.items()):
        ra, rb = model.groups[a].rep, model.groups[b].rep
        # Strategies whose rows (columns) of the matrix are equal are interchangeable for this
        # edge: aggregate them, so the transportation grid is classes x classes, not the full
        # strategy product. Exact: the class sums of a one-hot choice are one-hot.
        row_classes = _classes(matrix)
        col_classes = _classes([list(col) for col in zip(*matrix)])
        grid = [
            [
                _new_var(prob, f"e_{ra}_{rb}_{i}_{j}", 0, None, pulp.LpContinuous)
                for j in range(len(col_classes))
            ]
            for i in range(len(row_classes))
        ]
        e[(a, b)] = (grid, row_classes, col_classes)
        for i, line in enumerate(grid):
            expr = pulp.LpAffineExpression(
                [(v, 1.0) for v in line] + [(s[a][m], -1.0) for m in row_classes[i]])
            prob += expr == 0, f"src_{ra}_{rb}_{i}"
        for j, members in enumerate(col_classes):
            expr = pulp.LpAffineExpression(
                [(line[j], 1.0) for line in grid] + [(s[b][m], -1.0) for m in members])
            prob += expr == 0, f"dst_{ra}_{rb}_{j}"
        terms += [
            (grid[i][j], matrix[rows_[0]][cols_[0]] * _TIME_SCALE)
            for i, rows_ in enumerate(row_classes)
            for j, cols_ in enumerate(col_classes)
            if matrix[rows_[0]][cols_[0]]
        ]
    for row in rows:
        expr = pulp.LpAffineExpression(
            [
                (s[g][i], c * _MEMORY_SCALE)
                for g, cs in sorted(row.coeffs.items())
                for i, c in enumerate(cs)
                if c
            ]
        )
        prob += expr <= (budget - row.constant) * _MEMORY_SCALE, f"mem_{row.point}"
    prob.setObjective(pulp.LpAffineExpression(terms))
    return _Built(prob, s, e)


def _start_values(built: _Built, choice: Sequence[int]) -> dict[str, float]:
    """Variable values for a MIP start: the one-hot choice and the matching edge products."""
    values = {}
    for g, row in enumerate(built.s):
        for i, v in enumerate(row):
            values[v.name] = 1.0 if i == choice[g] else 0.0
    for (a, b), (grid, row_classes, col_classes) in built.e.items():
        for i, line in enumerate(grid):
            for j, v in enumerate(line):
                hit = choice[a] in row_classes[i] and choice[b] in col_classes[j]
                values[v.name] = 1.0 if hit else 0.0
    return values


def _read_choice(built: _Built) -> list[int] | None:
    """The index per group the solver set to 1, or None if the values are not a one-hot choice."""
    choice = []
    for row in built.s:
        values = [v.value() or 0.0 for v in row]
        best = _argmin([-x for x in values])
        if values[best] < 0.5:
            return None
        choice.append(best)
    return choice


# --------------------------------------------------------------------------- backends


def _cbc_path() -> str | None:
    """Path of the CBC binary bundled with PuLP, if it can be run."""
    path = getattr(pulp.PULP_CBC_CMD, "pulp_cbc_path", None)
    if path and os.path.isfile(path) and os.access(path, os.X_OK):
        return path
    return None


def _cbc_available() -> bool:
    return bool(pulp.COIN_CMD(msg=False).available()) or _cbc_path() is not None


def _highs_available() -> bool:
    return bool(pulp.HiGHS(msg=False).available())


def available_solvers() -> list[str]:
    """Backends `solve(solver=...)` can use here, preferred first."""
    return [name for name, ok in (("highs", _highs_available()), ("cbc", _cbc_available())) if ok]


def _pick_backend(solver: str) -> str:
    name = solver.lower()
    if name not in ("auto", "highs", "cbc"):
        raise ValueError(f"unknown solver {solver!r}: expected 'auto', 'highs' or 'cbc'")
    available = available_solvers()
    if name == "auto":
        if not available:
            raise SolverError("no ILP solver available: install highspy, or CBC for PuLP")
        return available[0]
    if name not in available:
        raise SolverError(f"solver {name!r} is not available here (available: {available})")
    return name


class _HiGHS(pulp.HiGHS):
    """PuLP's HiGHS binding plus a MIP start (PuLP passes none to HiGHS itself)."""

    def __init__(self, *args, start: dict[str, float] | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.start = start

    def callSolver(self, lp: pulp.LpProblem) -> None:  # noqa: N802 - PuLP's name
        if self.start:
            import highspy

            solution = highspy.HighsSolution()
            # buildSolverModel numbers the columns in the order of lp.variables().
            solution.col_value = [self.start.get(v.name, 0.0) for v in lp.variables()]
            solution.value_valid = True
            lp.solverModel.setSolution(solution)
        lp.solverModel.run()


@contextlib.contextmanager
def _native_stdout_silenced():
    """HiGHS prints a banner from C++ straight to file descriptor 1 (PuLP cannot turn it off);
    stdout carries IR and JSON for our users, so point fd 1 at /dev/null while the solver runs."""
    sys.stdout.flush()
    try:
        saved = os.dup(1)
    except OSError:  # no usable fd 1 (embedded interpreters): nothing to protect
        yield
        return
    try:
        with open(os.devnull, "wb") as devnull:
            os.dup2(devnull.fileno(), 1)
            yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def _make_solver(
    backend: str,
    *,
    time_limit: float,
    threads: int,
    mip: bool = True,
    start: dict[str, float] | None = None,
) -> pulp.LpSolver:
    if backend == "highs":
        return _HiGHS(
            mip=mip,
            msg=False,
            timeLimit=time_limit,
            threads=threads,
            gapRel=_MIP_REL_GAP,
            start=start,
        )
    path = None if pulp.COIN_CMD(msg=False).available() else _cbc_path()
    return pulp.COIN_CMD(
        mip=mip,
        msg=False,
        timeLimit=time_limit,
        threads=threads,
        gapRel=_MIP_REL_GAP,
        warmStart=bool(start),
        path=path,
    )


def _run(
    built: _Built,
    backend: str,
    *,
    time_limit: float,
    threads: int,
    mip: bool = True,
    start: dict[str, float] | None = None,
) -> int:
    """Solve `built.prob`; return PuLP's solution status (LpSolution*), not LpStatus.

    LpStatus reads "Optimal" even when a time limit stopped the search with an incumbent; the
    solution status tells "optimal" from "integer feasible". LpStatus is consulted only for
    infeasibility: CBC's "Integer infeasible" maps to LpStatusInfeasible but to no solution status.
    """
    if start and backend == "cbc":
        for name, var in built.prob.variablesDict().items():
            var.setInitialValue(start.get(name, 0.0))
    solver = _make_solver(backend, time_limit=time_limit, threads=threads, mip=mip, start=start)
    with _native_stdout_silenced():
        built.prob.solve(solver)
    if built.prob.status == pulp.LpStatusInfeasible:
        return pulp.LpSolutionInfeasible
    return built.prob.sol_status


def _solver_bound(built: _Built, backend: str, status: int) -> float | None:
    """The solver's own lower bound on the (scaled) objective, if it reports one."""
    if backend == "highs":
        bound = built.prob.solverModel.getInfo().mip_dual_bound
        return bound if math.isfinite(bound) else None
    if status == pulp.LpSolutionOptimal:
        return pulp.value(built.prob.objective) or 0.0
    return None


def _relaxation_bound(built: _Built, backend: str, time_limit: float, threads: int) -> float | None:
    """The LP relaxation's optimum (scaled), a valid if weaker lower bound."""
    status = _run(built, backend, time_limit=time_limit, threads=threads, mip=False)
    if status != pulp.LpSolutionOptimal:
        return None
    return pulp.value(built.prob.objective) or 0.0


# --------------------------------------------------------------------------- infeasibility


def _min_peak_choice(
    model: _Model, backend: str, time_limit: float, threads: int
) -> tuple[list[int] | None, bool]:
    """Minimise the largest live point (ILP); return a choice per group and whether proven."""
    if not model.groups:
        return [], True
    prob = pulp.LpProblem("hloplan_min_peak", pulp.LpMinimize)
    peak = _new_var(prob, "peak", 0, None, pulp.LpContinuous)
    s = []
    for group in model.groups:
        row = [_new_var(prob, f"s_{group.rep}_{i}", 0, 1, pulp.LpBinary) for i in range(group.size)]
        s.append(row)
        prob += pulp.LpAffineExpression([(v, 1.0) for v in row]) == 1, f"one_{group.rep}"
    for row in model.rows:
        terms = [
            (s[g][i], c * _MEMORY_SCALE)
            for g, cs in sorted(row.coeffs.items())
            for i, c in enumerate(cs)
            if c
        ]
        prob += (
            pulp.LpAffineExpression(terms + [(peak, -1.0)]) <= -row.constant * _MEMORY_SCALE,
            f"mem_{row.point}",
        )
    prob.setObjective(pulp.LpAffineExpression([(peak, 1.0)]))
    built = _Built(prob, s, {})
    status = _run(built, backend, time_limit=time_limit, threads=threads)
    if status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        return None, False
    return _read_choice(built), status == pulp.LpSolutionOptimal


def _infeasible(
    problem: ShardingProblem, model: _Model, backend: str | None, time_limit: float, threads: int
) -> InfeasibleError:
    """Build the error for a budget nothing fits, with the smallest achievable peak."""
    budget = problem.memory_budget
    lower = max((r.constant + r.min_load for r in model.rows), default=0.0)
    choice, proven = (None, False)
    if backend is not None:
        choice, proven = _min_peak_choice(
            model, backend, min(time_limit, _MIN_PEAK_TIME_LIMIT), threads
        )
    solution = model.to_choice(choice) if choice is not None else None
    point, fixed, dominant = None, 0.0, ()
    min_peak = lower
    if solution is not None:
        evaluation = evaluate(problem, solution)
        if proven:
            min_peak = evaluation.peak_memory
        point = evaluation.peak_point
    if point is None and problem.live_points:
        point = max(
            range(len(model.rows)), key=lambda p: model.rows[p].constant + model.rows[p].min_load
        )
    label = ""
    if point is not None:
        live = problem.live_points[point]
        label, fixed = live.label or f"#{point}", live.fixed_bytes
        if solution is not None:
            sizes = [
                (i, problem.nodes[i].name, problem.nodes[i].strategies[solution.choice[i]].memory)
                for i in dict.fromkeys(live.nodes)
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
    return text


# --------------------------------------------------------------------------- entry point


def _stats(
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
    evaluation = evaluate(problem, solution)
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
) -> tuple[Solution, SolveStats]:
    """Find the cheapest strategy per node that fits the memory budget.

    `solver` is "auto" (HiGHS when highspy is importable, else CBC), "highs" or "cbc". With the
    default single thread the result is deterministic. Status is "optimal", or "time_limit" when
    the limit stopped the search with a feasible but unproven solution (the best one found is
    returned, its gap to the best bound in `SolveStats.gap`). Raises InfeasibleError when no
    choice fits the budget, SolverError when the solver found nothing usable in time.
    """
    started = time.perf_counter()
    problem.validate()
    backend = _pick_backend(solver)
    model = _compile(problem)
    budget = problem.memory_budget
    if any(not memory_fits(r.constant + r.min_load, budget) for r in model.rows):
        raise _infeasible(problem, model, backend, time_limit, threads)
    rows = _binding_rows(model, budget)
    if not model.groups or (not model.pairs and not rows):
        return _solve_directly(problem, model, started)
    return _solve_ilp(problem, model, rows, backend, time_limit, threads, started)


def _solve_directly(
    problem: ShardingProblem, model: _Model, started: float
) -> tuple[Solution, SolveStats]:
    """Each group's cheapest strategy: optimal when nothing couples the decisions."""
    choice = [_argmin(costs) for costs in model.linear]
    return _stats(
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


def _solver_choice(
    problem: ShardingProblem, model: _Model, built: _Built, status: int
) -> list[int] | None:
    """The solver's choice if it has one that `evaluate()` also finds feasible.

    A binary within the solver's integrality tolerance of 1 can still leave a memory row a few
    bytes over once rounded; such a choice is discarded rather than reported as feasible.
    """
    if status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        return None
    choice = _read_choice(built)
    if choice is None or not evaluate(problem, model.to_choice(choice)).feasible:
        return None
    return choice


def _integral_relaxation(
    built: _Built, backend: str, time_limit: float, threads: int
) -> tuple[list[int], float] | None:
    """The LP relaxation's choice and objective when every one-hot group came out integral."""
    status = _run(built, backend, time_limit=time_limit, threads=threads, mip=False)
    if status != pulp.LpSolutionOptimal:
        return None
    choice = []
    for row in built.s:
        values = [v.value() or 0.0 for v in row]
        best = _argmin([-x for x in values])
        if values[best] < 1.0 - _INTEGRALITY_TOL:
            return None
        choice.append(best)
    return choice, pulp.value(built.prob.objective) or 0.0


def _solve_ilp(
    problem: ShardingProblem,
    model: _Model,
    rows: list[_Row],
    backend: str,
    time_limit: float,
    threads: int,
    started: float,
) -> tuple[Solution, SolveStats]:
    built = _build(model, rows, problem.memory_budget)
    variables, constraints = built.prob.numVariables(), built.prob.numConstraints()
    # The LP relaxation of this formulation is usually integral (as reported for Alpa-style
    # ILPs) and several times faster than branch and bound: when its optimum is one-hot it is
    # the ILP optimum, proven by its own bound.
    relaxed = _integral_relaxation(built, backend, time_limit, threads)
    if relaxed is not None:
        choice, bound = relaxed
        return _stats(
            problem, model.to_choice(choice), solver=backend, status="optimal",
            bound=bound / _TIME_SCALE + model.constant, started=started, variables=variables,
            constraints=constraints,
            extra={"backend": backend, "raw_status": "LP relaxation integral", "source": "lp",
                   "solver_objective": bound / _TIME_SCALE + model.constant})
    heuristic = _heuristic(model, problem.memory_budget)
    start = _start_values(built, heuristic) if heuristic is not None else None
    status = _run(built, backend, time_limit=time_limit, threads=threads, start=start)
    if status == pulp.LpSolutionInfeasible:
        raise _infeasible(problem, model, backend, time_limit, threads)
    extra: dict = {
        "backend": backend,
        "raw_status": pulp.LpSolution.get(status, str(status)),
        "heuristic_objective": _objective(model, heuristic) if heuristic is not None else None,
        "source": "solver",
    }
    choice = _solver_choice(problem, model, built, status)
    bound = None
    if choice is not None:
        scaled = pulp.value(built.prob.objective) or 0.0
        extra["solver_objective"] = scaled / _TIME_SCALE + model.constant
        bound = _solver_bound(built, backend, status)
    elif heuristic is not None:
        choice, extra["source"] = heuristic, "heuristic"
    else:
        raise SolverError(
            f"{backend} found no solution within {time_limit:g} s "
            f"({extra['raw_status']}); raise the time limit"
        )
    proven = status == pulp.LpSolutionOptimal and extra["source"] == "solver"
    if bound is None:
        remaining = max(time_limit - (time.perf_counter() - started), 1.0)
        bound = _relaxation_bound(built, backend, remaining, threads)
    return _stats(
        problem,
        model.to_choice(choice),
        solver=backend,
        status="optimal" if proven else "time_limit",
        bound=bound / _TIME_SCALE + model.constant if bound is not None else -math.inf,
        started=started,
        variables=variables,
        constraints=constraints,
        extra=extra,
    )
