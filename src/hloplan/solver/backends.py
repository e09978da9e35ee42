"""The ILP of a compiled model in arrays, and the backends that solve it (HiGHS through highspy,
CBC through PuLP).

Each group's strategies are one-hot binaries; a pairwise cost between two groups is linearised
with the transportation polytope:

    e[i][j] >= 0,  sum_j e[i][j] = s_src[i],  sum_i e[i][j] = s_dst[j]

which is exact for one-hot binaries (the only feasible e is the product) and gives a tighter LP
relaxation than the usual `e >= s_src + s_dst - 1` form. Costs enter the solver in microseconds and
memory in MiB so that coefficients sit near 1.

The solver sees memory in one of two exact forms:

- lazily (HiGHS, the default there): the model starts without memory rows; after each solve the
  loads of every point are recomputed under the solver's values and the most violated points are
  added as rows, until none is violated. Most points never bind (a train step peaks around the
  end of the forward pass), so the LP stays small: a Llama3-8B-shaped step needs 32 of 4,029
  rows.
- as a chain (CBC, and on request): one continuous load variable per binding point,
  `L_k = L_{k-1} + (the coefficients that changed since the previous binding point)`, with
  `L_k <= budget - fixed_k` as its bound: nonzeros linear in the events instead of one dense row
  per point.

HiGHS is driven directly through highspy's arrays (PuLP spent about a quarter of the solve
building its own model); CBC goes through PuLP, so both backends remain comparable. `run`
returns PuLP's solution status either way.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import pulp

from hloplan.solver.evaluate import MEMORY_RTOL
from hloplan.solver.model import Model

__all__ = ["INTEGRALITY_TOL", "MEMORY_SCALE", "MIP_NODE_LIMIT", "MIP_REL_GAP", "TIME_SCALE", "Built", "Lp",
           "SolverError", "add_chain", "add_memory_rows", "available_solvers", "build",
           "classes", "fix_by_reduced_costs", "fix_columns", "group_values", "pick_backend", "preseed_rows",
           "read_choice", "run", "run_lazy", "seed_rows", "start_values"]

TIME_SCALE = 1e6  # seconds -> microseconds inside the solver
MEMORY_SCALE = 1.0 / 2**20  # bytes -> MiB inside the solver
MIP_REL_GAP = 1e-6  # HiGHS defaults to 1e-4, which would let two backends disagree visibly
# Branch and bound stops after this many nodes per solve: a limit on work, not seconds, so
# that a search it stops returns the same plan on any machine (the time limit stays a safety
# net, and a plan it cuts short is reported as depending on the machine's speed). The planner's
# ILPs close their gap at the root or within tens of nodes; a node of a 150k-variable ILP takes
# a fraction of a second on one core.
MIP_NODE_LIMIT = 500
INTEGRALITY_TOL = 1e-6
# Lazy memory rows: at most this many violated points are added per round (the most violated
# first), and points within this fraction of the budget under the relaxation's values are added
# before branch and bound starts (they are the ones an integer solution is likely to push over).
_LAZY_ROWS_PER_ROUND = 32
_LAZY_NEAR_BUDGET = 0.02
_LAZY_MAX_PRESEED = 256
# Before the first LP, rows are seeded at the points whose smallest possible load is within
# this fraction of the budget (memory-tight programs; see seed_rows). Measured: Llama3-8B
# steps sit at 0.88-0.93 of the budget and gain; GPTs at 0.04-0.18 lose; a GPT of hidden
# 8192 at 0.47-0.49 gains.
_SEED_NEAR_BUDGET = 0.6


class SolverError(RuntimeError):
    """The solver produced no usable solution (and did not prove the problem infeasible)."""


def classes(matrix: np.ndarray) -> list[list[int]]:
    """Indices of equal rows of `matrix`, grouped, in order of first appearance."""
    groups: dict[bytes, list[int]] = {}
    for index, row in enumerate(matrix):
        groups.setdefault(row.tobytes(), []).append(index)
    return list(groups.values())


@dataclass
class Lp:
    """Columns and rows of a (mixed-integer) linear program, for either backend."""

    cost: list[float] = field(default_factory=list)  # per column, scaled
    upper: list[float] = field(default_factory=list)  # math.inf: unbounded
    lower: list[float] = field(default_factory=list)
    binary: list[bool] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    row_index: list[list[int]] = field(default_factory=list)
    row_value: list[list[float]] = field(default_factory=list)
    row_lower: list[float] = field(default_factory=list)
    row_upper: list[float] = field(default_factory=list)
    row_names: list[str] = field(default_factory=list)

    def column(self, name: str, cost: float = 0.0, lower: float = 0.0,
               upper: float = math.inf, binary: bool = False) -> int:
        self.cost.append(cost)
        self.lower.append(lower)
        self.upper.append(upper)
        self.binary.append(binary)
        self.names.append(name)
        return len(self.cost) - 1

    def columns(self, names: list[str], cost: Sequence[float], lower: float = 0.0,
                upper: float = math.inf, binary: bool = False) -> list[int]:
        """Many columns with the same bounds; their indices."""
        first = len(self.cost)
        self.cost.extend(float(c) for c in cost)
        count = len(self.cost) - first
        self.lower.extend([lower] * count)
        self.upper.extend([upper] * count)
        self.binary.extend([binary] * count)
        self.names.extend(names)
        return list(range(first, first + count))

    def row(self, name: str, index: list[int], value: list[float], lower: float,
            upper: float) -> int:
        self.row_index.append(index)
        self.row_value.append(value)
        self.row_lower.append(lower)
        self.row_upper.append(upper)
        self.row_names.append(name)
        return len(self.row_lower) - 1


@dataclass
class Built:
    """The ILP, how its columns map back to choices, and the backend's model of it."""

    model: Model
    lp: Lp
    backend: str
    s: list[list[int]]  # per group: the columns of its one-hot binaries
    e: dict[tuple[int, int], tuple[list[list[int]], list[list[int]], list[list[int]]]]
    memory_rows: dict[int, int] = field(default_factory=dict)  # live point -> row (lazy form)
    chain: list[tuple[int, int]] = field(default_factory=list)  # (live point, load column)
    launches: list[int] = field(default_factory=list)  # per model launch: its column
    lazy: bool = False
    peak: int | None = None  # the peak column of the min-peak model
    values: np.ndarray | None = None  # the last solve's column values
    objective: float | None = None  # ... and objective (scaled)
    dual_bound: float | None = None  # the MIP's lower bound (scaled), when the backend has one
    solver_model: object = None  # highspy.Highs, or (pulp.LpProblem, variables)
    synced_rows: int = 0  # rows already in the backend's model
    integer: bool = False  # whether the backend's model currently has integer columns
    gap: float = MIP_REL_GAP  # the relative gap at which branch and bound stops
    node_limit: int = MIP_NODE_LIMIT  # branch-and-bound nodes per MIP solve, at most
    mip_presolve: bool = False  # HiGHS's MIP presolve (see _highs_run)
    # What stopped solves short of their gap: the clock ("time_limited": the result depends
    # on the machine's speed) or the node limit (the same result on any machine).
    time_limited: bool = False
    node_limited: bool = False
    nodes: int = 0  # branch-and-bound nodes of the MIP solves so far

    @property
    def variables(self) -> int:
        return len(self.lp.cost)

    @property
    def constraints(self) -> int:
        return len(self.lp.row_lower)


def build(model: Model, binding: list[int], budget: float, backend: str,
           lazy: bool) -> Built:
    """The ILP: one-hot binaries per group, transportation edges and memory (lazy or chain)."""
    lp = Lp()
    named = backend != "highs"  # PuLP needs names; highspy takes columns by index
    s = []
    for g, group in enumerate(model.groups):
        size = group.size
        columns = lp.columns([f"s_{group.rep}_{i}" for i in range(size)] if named else [""] * size,
                             model.linear[g] * TIME_SCALE, 0.0, 1.0, True)
        s.append(columns)
        lp.row(f"one_{group.rep}", columns, [1.0] * len(columns), 1.0, 1.0)
    e = {}
    for (a, b), matrix in sorted(model.pairs.items()):
        ra, rb = model.groups[a].rep, model.groups[b].rep
        # Strategies whose rows (columns) of the matrix are equal are interchangeable for this
        # edge: aggregate them, so the transportation grid is classes x classes, not the full
        # strategy product. Exact: the class sums of a one-hot choice are one-hot.
        row_classes = classes(matrix)
        col_classes = classes(matrix.T)
        rows_, cols_ = len(row_classes), len(col_classes)
        costs = matrix[np.ix_([m[0] for m in row_classes], [m[0] for m in col_classes])]
        names = ([f"e_{ra}_{rb}_{i}_{j}" for i in range(rows_) for j in range(cols_)] if named
                 else [""] * (rows_ * cols_))
        flat = lp.columns(names, costs.ravel() * TIME_SCALE)
        grid = [flat[i * cols_:(i + 1) * cols_] for i in range(rows_)]
        e[(a, b)] = (grid, row_classes, col_classes)
        for i, line in enumerate(grid):
            lp.row(f"src_{ra}_{rb}_{i}", line + [s[a][m] for m in row_classes[i]],
                   [1.0] * len(line) + [-1.0] * len(row_classes[i]), 0.0, 0.0)
        for j, members in enumerate(col_classes):
            lp.row(f"dst_{ra}_{rb}_{j}", [line[j] for line in grid] + [s[b][m] for m in members],
                   [1.0] * len(grid) + [-1.0] * len(members), 0.0, 0.0)
    launches = []
    for k, launch in enumerate(model.launches):
        # paid >= the one-hot sum over a member group's paying strategies, for every member
        # group; it needs no integrality: at an integral choice the cheapest `paid` is 0 or 1.
        paid = lp.column(f"launch_{k}" if named else "", launch.cost * TIME_SCALE, 0.0, 1.0)
        launches.append(paid)
        for g, picks in launch.members.items():
            lp.row(f"launch_{k}_{model.groups[g].rep}", [s[g][int(i)] for i in picks] + [paid],
                   [1.0] * len(picks) + [-1.0], -math.inf, 0.0)
    built = Built(model, lp, backend, s, e, lazy=lazy, launches=launches)
    if not lazy:
        add_chain(built, binding, budget)
    return built


def _row_terms(built: Built, coefficients: dict[int, np.ndarray],
               scale: float) -> tuple[list[int], list[float]]:
    index, value = [], []
    for g in sorted(coefficients):
        for i, c in enumerate(coefficients[g]):
            if c:
                index.append(built.s[g][i])
                value.append(float(c) * scale)
    return index, value


def add_memory_rows(built: Built, points: Sequence[int], budget: float) -> None:
    """Rows `sum coefficients * s <= budget - constant` for the given points (lazy form)."""
    points = [p for p in sorted(set(points)) if p not in built.memory_rows]
    memory = built.model.memory
    for p, coefficients in sorted(memory.rows(points).items()):
        index, value = _row_terms(built, coefficients, MEMORY_SCALE)
        built.memory_rows[p] = built.lp.row(
            f"mem_{p}", index, value, -math.inf,
            (budget - float(memory.constant[p])) * MEMORY_SCALE)


def add_chain(built: Built, points: Sequence[int], budget: float | None) -> None:
    """Load columns L_k = L_{k-1} + (changed coefficients) . s for increasing points, with
    L_k <= budget - constant_k (no bound when `budget` is None: the min-peak model)."""
    memory = built.model.memory
    previous = None
    for p, delta in memory.chain(sorted(points)):
        upper = math.inf if budget is None else (budget - float(memory.constant[p])) * MEMORY_SCALE
        load = built.lp.column(f"load_{p}", 0.0, -math.inf, upper)
        index, value = _row_terms(built, delta, -MEMORY_SCALE)
        if previous is not None:
            index.append(previous)
            value.append(-1.0)
        built.lp.row(f"chain_{p}", [load, *index], [1.0, *value], 0.0, 0.0)
        built.chain.append((p, load))
        previous = load


def start_values(built: Built, choice: Sequence[int]) -> np.ndarray:
    """Column values for a MIP start: the one-hot choice, the matching edge products and the
    chain's loads."""
    values = np.zeros(built.variables)
    for g, columns in enumerate(built.s):
        values[columns[choice[g]]] = 1.0
    for (a, b), (grid, row_classes, col_classes) in built.e.items():
        i = next(k for k, members in enumerate(row_classes) if choice[a] in members)
        j = next(k for k, members in enumerate(col_classes) if choice[b] in members)
        values[grid[i][j]] = 1.0
    for column, launch in zip(built.launches, built.model.launches, strict=True):
        values[column] = float(launch.paid(choice))
    if built.chain:
        loads = built.model.memory.choice_loads(choice) - built.model.memory.constant
        for p, column in built.chain:
            values[column] = loads[p] * MEMORY_SCALE
        if built.peak is not None:
            values[built.peak] = float(max(built.model.memory.choice_loads(choice)[
                [p for p, _ in built.chain]] * MEMORY_SCALE))
    return values


def group_values(built: Built) -> list[np.ndarray] | None:
    if built.values is None:
        return None
    return [built.values[columns] for columns in built.s]


def read_choice(built: Built) -> list[int] | None:
    """The index per group the solver set to 1, or None if the values are not a one-hot choice."""
    groups = group_values(built)
    if groups is None:
        return None
    choice = []
    for values in groups:
        best = int(np.argmax(values))
        if values[best] < 0.5:
            return None
        choice.append(best)
    return choice


def _cbc_path() -> str | None:
    """Path of the CBC binary bundled with PuLP, if it can be run."""
    path = getattr(pulp.PULP_CBC_CMD, "pulp_cbc_path", None)
    if path and os.path.isfile(path) and os.access(path, os.X_OK):
        return path
    return None


def _cbc_available() -> bool:
    return bool(pulp.COIN_CMD(msg=False).available()) or _cbc_path() is not None


def _highs_available() -> bool:
    try:
        import highspy  # noqa: F401
    except ImportError:
        return False
    return True


def available_solvers() -> list[str]:
    """Backends `solve(solver=...)` can use here, preferred first."""
    return [name for name, ok in (("highs", _highs_available()), ("cbc", _cbc_available())) if ok]


def pick_backend(solver: str) -> str:
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


@contextlib.contextmanager
def _native_stdout_silenced():
    """HiGHS prints a banner from C++ straight to file descriptor 1; stdout carries IR and JSON
    for our users, so point fd 1 at /dev/null while the solver runs."""
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


def _highs_sync(built: Built, highspy) -> object:
    """Create the highspy model, or add the rows added since the last sync."""
    lp = built.lp
    h = built.solver_model
    if h is None:
        h = highspy.Highs()
        h.setOptionValue("output_flag", False)
        n = len(lp.cost)
        inf = highspy.kHighsInf
        h.addVars(n, np.array([-inf if math.isinf(v) else v for v in lp.lower]),
                  np.array([inf if math.isinf(v) else v for v in lp.upper]))
        h.changeColsCost(n, np.arange(n, dtype=np.int32), np.array(lp.cost))
        built.solver_model = h
    start = built.synced_rows
    count = len(lp.row_lower) - start
    if count:
        inf = highspy.kHighsInf
        lengths = [len(index) for index in lp.row_index[start:]]
        starts = np.zeros(count, dtype=np.int32)
        if count > 1:
            starts[1:] = np.cumsum(lengths[:-1])
        index = np.fromiter((i for row in lp.row_index[start:] for i in row), dtype=np.int32,
                            count=sum(lengths))
        value = np.fromiter((v for row in lp.row_value[start:] for v in row), dtype=float,
                            count=sum(lengths))
        h.addRows(count, np.array([-inf if math.isinf(v) else v for v in lp.row_lower[start:]]),
                  np.array([inf if math.isinf(v) else v for v in lp.row_upper[start:]]),
                  len(index), starts, index, value)
        built.synced_rows = len(lp.row_lower)
    return h


def _highs_run(built: Built, *, time_limit: float, threads: int, mip: bool,
               start: np.ndarray | None) -> int:
    import highspy

    with _native_stdout_silenced():
        h = _highs_sync(built, highspy)
        if mip != built.integer:
            columns = np.flatnonzero(built.lp.binary).astype(np.int32)
            kind = highspy.HighsVarType.kInteger if mip else highspy.HighsVarType.kContinuous
            h.changeColsIntegrality(len(columns), columns, np.array([kind] * len(columns)))
            built.integer = mip
        # HiGHS (1.16) holds an LP to its time limit counted over every run of its object
        # (the LP relaxation, the lazy rounds, the MIP and the bound LP after it all run on
        # one), a MIP to its own run's time: either way the limit given is this run's.
        spent = h.getRunTime()
        limit = max(float(time_limit), 0.01)
        h.setOptionValue("time_limit", limit if mip else spent + limit)
        h.setOptionValue("threads", int(threads))
        h.setOptionValue("mip_rel_gap", built.gap)
        h.setOptionValue("mip_max_nodes", int(built.node_limit))
        # HiGHS's presolve removes little from this formulation (a Llama3-8B step: 6% of the
        # columns) and costs more than it saves: its LP solves in half the time without, and
        # its MIP presolve starts a round of sub-MIPs and restarts that took 10x the whole
        # root solve on a 2-layer GPT-3's 128 x 8 view of 16x8x8 (same optimum).
        # The min-peak ILP (small, solved once for a diagnostic) keeps it: among plans of
        # equal peak, presolve's lands on one needing fewer resharded copies
        # (tests/filecheck/solve-sharding.mlir: 24.3 MiB with copies, 32.3 without presolve).
        h.setOptionValue("presolve", "choose" if mip and built.mip_presolve else "off")
        if start is not None and mip:
            solution = highspy.HighsSolution()
            solution.col_value = list(start)
            solution.value_valid = True
            h.setSolution(solution)
        h.run()
    status = h.getModelStatus()
    info = h.getInfo()
    ok = highspy.HighsModelStatus
    # A run that reached its limit may have stopped part of its search there (a MIP's
    # sub-MIPs run on the time left) even when it reports a proven optimum.
    if status == ok.kTimeLimit or h.getRunTime() - spent >= limit:
        built.time_limited = True
    if mip:
        built.nodes += max(int(info.mip_node_count), 0)
        # HiGHS reports its node limit as a solution limit (as it does mip_max_leaves).
        built.node_limited |= status == ok.kSolutionLimit
    has_solution = info.primal_solution_status == 2  # kSolutionStatusFeasible
    built.values = np.array(h.getSolution().col_value) if has_solution else None
    built.objective = info.objective_function_value if has_solution else None
    built.dual_bound = None
    if mip:
        bound = info.mip_dual_bound
        built.dual_bound = bound if math.isfinite(bound) else None
    if status == ok.kOptimal:
        if not mip:
            built.dual_bound = built.objective
        return pulp.LpSolutionOptimal
    if status in (ok.kInfeasible, ok.kUnboundedOrInfeasible):
        built.values = None
        return pulp.LpSolutionInfeasible
    if has_solution and mip:
        return pulp.LpSolutionIntegerFeasible
    built.values = None
    return pulp.LpSolutionNoSolutionFound


def _new_var(prob: pulp.LpProblem, name: str, low: float | None, up: float | None, cat: str):
    """A PuLP variable, without the PuLP 3.3 deprecation of the LpVariable constructor."""
    if hasattr(prob, "add_variable"):
        return prob.add_variable(name, low, up, cat=cat)
    return pulp.LpVariable(name, low, up, cat=cat)


def _pulp_model(built: Built) -> tuple[pulp.LpProblem, list]:
    """The PuLP model of `built.lp` (built once; rows added later are appended)."""
    lp = built.lp
    if built.solver_model is None:
        prob = pulp.LpProblem("hloplan", pulp.LpMinimize)
        variables = [
            _new_var(prob, name, None if math.isinf(-low) else low,
                     None if math.isinf(up) else up,
                     pulp.LpBinary if binary else pulp.LpContinuous)
            for name, low, up, binary in zip(lp.names, lp.lower, lp.upper, lp.binary)]
        prob.setObjective(pulp.LpAffineExpression(
            [(v, c) for v, c in zip(variables, lp.cost) if c]))
        built.solver_model = (prob, variables)
    prob, variables = built.solver_model
    for r in range(built.synced_rows, len(lp.row_lower)):
        expr = pulp.LpAffineExpression(
            [(variables[i], v) for i, v in zip(lp.row_index[r], lp.row_value[r])])
        low, up = lp.row_lower[r], lp.row_upper[r]
        if low == up:
            prob += expr == low, lp.row_names[r]
        elif math.isinf(low):
            prob += expr <= up, lp.row_names[r]
        else:
            prob += expr >= low, lp.row_names[r]
    built.synced_rows = len(lp.row_lower)
    return prob, variables


def _cbc_run(built: Built, *, time_limit: float, threads: int, mip: bool,
             start: np.ndarray | None) -> int:
    prob, variables = _pulp_model(built)
    if start is not None and mip:
        for var, value in zip(variables, start):
            var.setInitialValue(float(value))
    path = None if pulp.COIN_CMD(msg=False).available() else _cbc_path()
    limit = max(float(time_limit), 0.01)
    # CBC 2.10's threaded search ("threads N", N >= 1) now and then leaves its one worker
    # waiting to start until the time limit (about 1 solve in 300, even on a two-variable
    # model), returning an unproven incumbent; "threads 0" (PuLP's default) searches on the
    # main thread and does not.
    solver = pulp.COIN_CMD(mip=mip, msg=False, timeLimit=limit,
                           threads=threads if threads > 1 else None,
                           gapRel=built.gap, warmStart=bool(start is not None and mip), path=path,
                           maxNodes=int(built.node_limit) if mip else None)
    started = time.perf_counter()
    with _native_stdout_silenced():
        prob.solve(solver)
    # PuLP reports neither limit: a solve that ran its whole time is taken as stopped by it,
    # one that stopped earlier without proving optimality as stopped by the node limit.
    if time.perf_counter() - started >= limit:
        built.time_limited = True
    elif mip and prob.sol_status == pulp.LpSolutionIntegerFeasible:
        built.node_limited = True
    if prob.status == pulp.LpStatusInfeasible:
        built.values = None
        return pulp.LpSolutionInfeasible
    status = prob.sol_status
    if status in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        built.values = np.array([v.value() or 0.0 for v in variables])
        built.objective = pulp.value(prob.objective) or 0.0
        built.dual_bound = built.objective if status == pulp.LpSolutionOptimal else None
    else:
        built.values = None
    return status


def run(
    built: Built,
    backend: str,
    *,
    time_limit: float,
    threads: int,
    mip: bool = True,
    start: np.ndarray | None = None,
) -> int:
    """Solve `built` as it stands; return PuLP's solution status (LpSolution*), not LpStatus.

    The values, objective and (for a MIP) lower bound land in `built`. For PuLP, LpStatus reads
    "Optimal" even when a time limit stopped the search with an incumbent; the solution status
    tells "optimal" from "integer feasible"; CBC's "Integer infeasible" maps to LpStatusInfeasible
    but to no solution status.
    """
    solve_with = _highs_run if backend == "highs" else _cbc_run
    return solve_with(built, time_limit=time_limit, threads=threads, mip=mip, start=start)


def _violated(built: Built, budget: float) -> list[int]:
    """Points over budget under the last solution's values, the most violated first."""
    if built.values is None or not built.lazy or math.isinf(budget):
        return []
    loads = built.model.memory.loads(group_values(built))
    limit = budget + MEMORY_RTOL * abs(budget)
    over = np.flatnonzero(loads > limit)
    order = sorted(over.tolist(), key=lambda p: (-loads[p], p))
    return [p for p in order if p not in built.memory_rows]


def run_lazy(built: Built, backend: str, budget: float, deadline: float, threads: int,
              *, mip: bool, start: np.ndarray | None = None) -> int:
    """`run`, adding the memory rows the solution violates and solving again until it
    violates none (lazy form); NoSolutionFound when time runs out with a violated solution."""
    while True:
        status = run(built, backend, time_limit=deadline - time.perf_counter(),
                      threads=threads, mip=mip, start=start)
        if status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
            return status
        violated = _violated(built, budget)
        if not violated:
            return status
        if time.perf_counter() >= deadline:
            built.values = None
            return pulp.LpSolutionNoSolutionFound
        add_memory_rows(built, violated[:_LAZY_ROWS_PER_ROUND], budget)


def fix_by_reduced_costs(built: Built, incumbent: float) -> int:
    """Fix the binaries that the LP relaxation's reduced costs price out of every solution
    better than `incumbent` (scaled objective of a feasible choice): a binary at 0 whose reduced
    cost exceeds incumbent - LP optimum cannot be 1 in such a solution (and one at 1 with the
    opposite cannot be 0). Exact: no solution better than the incumbent is cut off, and rows
    added later only raise the LP bound. HiGHS only (the relaxation just solved in the model).
    Returns how many were fixed."""
    if built.backend != "highs" or built.solver_model is None or built.objective is None:
        return 0
    h = built.solver_model
    solution = h.getSolution()
    if not solution.dual_valid or not solution.value_valid:
        return 0
    reduced = np.asarray(solution.col_dual)
    values = np.asarray(solution.col_value)
    binaries = np.flatnonzero(built.lp.binary)
    slack = incumbent - built.objective + 1e-7 * abs(incumbent) + 1e-3
    zero = binaries[(values[binaries] <= 1e-9) & (reduced[binaries] > slack)]
    one = binaries[(values[binaries] >= 1.0 - 1e-9) & (-reduced[binaries] > slack)]
    for columns, value in ((zero, 0.0), (one, 1.0)):
        _fix(built, columns.tolist(), value)
    return len(zero) + len(one)


def fix_columns(built: Built, branches: Sequence[tuple[int, int]]) -> int:
    """Fix the binaries of (group, strategy) `branches` to 0 (branches probing showed hold no
    plan better than the incumbent); how many were not fixed already."""
    columns = sorted({built.s[g][i] for g, i in branches if built.lp.upper[built.s[g][i]] > 0})
    _fix(built, columns, 0.0)
    return len(columns)


def _fix(built: Built, columns: Sequence[int], value: float) -> None:
    """Fix `columns` at `value` in built.lp and, once made, in the solver's model."""
    if not columns:
        return
    for j in columns:
        built.lp.lower[j] = built.lp.upper[j] = value
    if built.solver_model is None:  # built from built.lp when first run
        return
    if built.backend == "highs":
        bound = np.full(len(columns), value)
        built.solver_model.changeColsBounds(len(columns), np.array(columns, dtype=np.int32),
                                            bound, bound)
    else:
        _, variables = built.solver_model
        for j in columns:
            variables[j].lowBound = variables[j].upBound = value


def seed_rows(built: Built, budget: float, binding: Sequence[int]) -> None:
    """Before the first LP: the rows of the binding points where even the smallest choice
    comes closest to the budget, when it comes close (within _SEED_NEAR_BUDGET of it). They
    are usually the rows the LP would violate (a train step's peak sits at the end of its
    forward pass whatever the plan), and one LP with them is cheaper than a second one after
    adding them (a Llama3-8B step: 0.6 s against 1.5 s). Where memory is loose (a GPT's
    smallest peak at a fifth of the budget) no row is seeded: rows that do not bind only
    weigh on branch and bound (a 48-layer GPT: 13 s against 9 s)."""
    if not binding or not built.lazy or math.isinf(budget):
        return
    points = np.array(binding, dtype=np.int64)
    smallest = built.model.memory.min_load[points]
    close = smallest >= (1.0 - _SEED_NEAR_BUDGET) * budget
    points, smallest = points[close], smallest[close]
    closest = points[np.argsort(-smallest, kind="stable")]
    add_memory_rows(built, closest[:_LAZY_ROWS_PER_ROUND].tolist(), budget)


def preseed_rows(built: Built, budget: float) -> None:
    """Before branch and bound: add the rows of the points near the budget under the LP's
    values, so that integer solutions rarely violate a missing row (each violation costs a
    new branch and bound)."""
    if built.values is None or not built.lazy or math.isinf(budget):
        return
    loads = built.model.memory.loads(group_values(built))
    near = np.flatnonzero(loads >= budget * (1.0 - _LAZY_NEAR_BUDGET))
    order = sorted((p for p in near.tolist() if p not in built.memory_rows),
                   key=lambda p: (-loads[p], p))
    add_memory_rows(built, order[:_LAZY_MAX_PRESEED], budget)


