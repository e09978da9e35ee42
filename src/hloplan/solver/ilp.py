"""Choose a strategy per node by integer linear programming (HiGHS through highspy, or CBC).

The problem is first compiled to *decision groups*: nodes tied together share one set of one-hot
binaries, and nodes with a single strategy are constants. Edges then become either linear terms
(when one end is constant, both ends are the same group, or the matrix is separable into a row
part plus a column part) or a pairwise term linearised with the transportation polytope:

    e[i][j] >= 0,  sum_j e[i][j] = s_src[i],  sum_i e[i][j] = s_dst[j]

which is exact for one-hot binaries (the only feasible e is the product) and gives a tighter LP
relaxation than the usual `e >= s_src + s_dst - 1` form. Costs enter the solver in microseconds and
memory in MiB so that coefficients sit near 1; everything reported back is in seconds and bytes,
recomputed by `evaluate()` from the chosen indices.

Memory. Live points follow each other in program order, and consecutive points share most of
their live values, so the compiled model keeps the bytes of every point as *events*: the decision
groups whose coefficients change at that point (`_Memory`); the loads of all points under a
choice cost time linear in the events, never points x live values. The solver sees memory in one
of two exact forms:

- lazily (HiGHS, the default there): the model starts without memory rows; after each solve the
  loads of every point are recomputed under the solver's values and the most violated points are
  added as rows, until none is violated. Most points never bind (a train step peaks around the
  end of the forward pass), so the LP stays small: a Llama3-8B-shaped step needs 32 of 4,029
  rows.
- as a chain (CBC, and on request): one continuous load variable per binding point,
  `L_k = L_{k-1} + (the coefficients that changed since the previous binding point)`, with
  `L_k <= budget - fixed_k` as its bound: nonzeros linear in the events instead of one dense row
  per point.

When the LP relaxation is fractional, branch and bound starts from its rounding, repaired to fit
the budget and improved by local search; binaries whose reduced costs price them out of any
plan better than that start are fixed first (exact; a Llama3-8B step fixes 1,560 of 5,196).

HiGHS is driven directly through highspy's arrays (PuLP spent about a quarter of the solve
building its own model); CBC goes through PuLP, so both backends remain comparable.
`_solve_model` works on a compiled model, so that `axes.py` can solve restrictions of one
(`_restrict`) without rebuilding the problem.
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

from hloplan.solver.evaluate import MEMORY_RTOL, evaluate, memory_fits
from hloplan.solver.problem import ShardingProblem, Solution, SolveStats, first_live_points
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
_INTEGRALITY_TOL = 1e-6
# Lazy memory rows: at most this many violated points are added per round (the most violated
# first), and points within this fraction of the budget under the relaxation's values are added
# before branch and bound starts (they are the ones an integer solution is likely to push over).
_LAZY_ROWS_PER_ROUND = 32
_LAZY_NEAR_BUDGET = 0.02
_LAZY_MAX_PRESEED = 256
# Before the first LP, rows are seeded at the points whose smallest possible load is within
# this fraction of the budget (memory-tight programs; see _seed_rows). Measured: Llama3-8B
# steps sit at 0.88-0.93 of the budget and gain; GPTs at 0.04-0.18 lose; a GPT of hidden
# 8192 at 0.47-0.49 gains.
_SEED_NEAR_BUDGET = 0.6
# The rounded LP relaxation is repaired by at most this many single-group moves (it is usually
# a few bytes over at a handful of points; when it is far off, the solver does better).
_REPAIR_MOVES = 64
# Neighbourhood search (RINS) after a fractional LP: at most this many rounds, each solving
# the sub-ILP of at most this fraction of the groups (a bigger one is as hard as the whole).
_NEIGHBOURHOOD_ROUNDS = 3
_NEIGHBOURHOOD_MAX_FRACTION = 0.25
# A fractional LP with more free groups than that is searched a window at a time, at most this
# many windows per round.
_NEIGHBOURHOOD_WINDOWS = 8
# LP dives when most groups are fractional: fix this fraction of the fractional groups, solve
# the LP again; at most this many LPs. Fixing fewer spoils less (GPT 2 layers on 8x8, one LP
# after fixing 1/2, 1/4, 1/64: 0.7%, 0.5%, 0.01% above the bound) but each LP takes longer.
_DIVE_FRACTION = 0.25
_DIVE_ROUNDS = 4


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


class _Memory:
    """Bytes at every live point as a function of the group choices, kept as events.

    For group g, `at[g]` lists the points where its coefficient vector (bytes per strategy,
    summed over the group's nodes live there) changes and `vectors[g]` the new vectors, one row
    each (a zero row: none of its nodes is live from there on); `constant[p]` holds the bytes no
    decision changes (fixed bytes and single-strategy nodes). Points are taken in the problem's
    order; consecutive points of a program share most of their live values, so there are few
    events, and every question below is a few array operations per group. A node listed twice
    at one point counts once.
    """

    def __init__(self, problem: ShardingProblem, group_of: list[int], sizes: list[int]) -> None:
        count = len(problem.live_points)
        self.count = count
        self.sizes = sizes
        self.constant = np.zeros(count)
        events_at: list[list[int]] = [[] for _ in sizes]
        events: list[list[np.ndarray]] = [[] for _ in sizes]
        vectors: dict[int, np.ndarray] = {}  # id(strategies) -> bytes per strategy
        current: dict[int, np.ndarray] = {}
        previous: set[int] = set()
        constant = 0.0
        nodes = problem.nodes
        transients: dict[int, np.ndarray] = {}  # id(strategies) -> transient bytes
        enter: dict[int, list[int]] = {}
        leave: dict[int, list[int]] = {}
        # A node's first live point also holds its transient bytes (gone at the next).
        flash_in: dict[int, list[int]] = {}
        flash_out: dict[int, list[int]] = {}
        for r in problem.live_ranges:
            enter.setdefault(r.first, []).append(r.node)
            leave.setdefault(r.last + 1, []).append(r.node)
        for index, first in first_live_points(problem).items():
            if any(s.transient for s in nodes[index].strategies):
                flash_in.setdefault(first, []).append(index)
                flash_out.setdefault(first + 1, []).append(index)
        for p, point in enumerate(problem.live_points):
            live = set(point.nodes)
            changed: dict[int, np.ndarray] = {}
            entering = sorted(live - previous) + sorted(enter.get(p, ()))
            leaving = sorted(previous - live) + sorted(leave.get(p, ()))
            for sign, moved, kind, cache in (
                    (1.0, entering, "memory", vectors), (-1.0, leaving, "memory", vectors),
                    (1.0, sorted(flash_in.get(p, ())), "transient", transients),
                    (-1.0, sorted(flash_out.get(p, ())), "transient", transients)):
                for index in moved:
                    g = group_of[index]
                    strategies = nodes[index].strategies
                    if g < 0:
                        constant += sign * getattr(strategies[0], kind)
                        continue
                    vector = cache.get(id(strategies))
                    if vector is None:
                        vector = np.array([getattr(s, kind) for s in strategies], dtype=float)
                        cache[id(strategies)] = vector
                    delta = changed.get(g)
                    changed[g] = sign * vector if delta is None else delta + sign * vector
            for g, delta in changed.items():
                new = current.get(g, 0.0) + delta
                if new.any():
                    current[g] = new
                else:
                    new = np.zeros(sizes[g])
                    current.pop(g, None)
                events_at[g].append(p)
                events[g].append(new)
            self.constant[p] = point.fixed_bytes + constant
            previous = live
        self.at = [np.array(a, dtype=np.int64) for a in events_at]
        self.vectors = [np.array(v) if v else np.zeros((0, size))
                        for v, size in zip(events, sizes, strict=True)]
        self._normalize()
        self._extremes()

    def _normalize(self) -> None:
        """Move each event's smallest coefficient into the constant bytes: under one-hot
        choices (and in the LP, whose one-hot rows are equalities) the loads are the same, and
        a group whose strategies all take the same bytes there drops out of the memory rows
        (a Llama3-8B step's rows lose half their nonzeros, and the LP re-solves twice as fast).
        Whole bytes stay whole."""
        lows = [v.min(axis=1) if len(v) else v[:, 0] for v in self.vectors]
        if not any(low.any() for low in lows):
            return
        self.constant = self._accumulate(lows)
        self.vectors = [v - low[:, None] for v, low in zip(self.vectors, lows, strict=True)]

    def _extremes(self) -> None:
        self.live = [v.any(axis=1) for v in self.vectors]  # per group and event: not all zero
        self.min_load = self._accumulate([v.min(axis=1) if len(v) else v[:, 0]
                                          for v in self.vectors])
        self.max_load = self._accumulate([v.max(axis=1) if len(v) else v[:, 0]
                                          for v in self.vectors])

    def restricted(self, allowed: Sequence[np.ndarray]) -> _Memory:
        """This memory with group g limited to the strategies `allowed[g]`."""
        out = object.__new__(_Memory)
        out.count = self.count
        out.sizes = [len(keep) for keep in allowed]
        out.constant = self.constant
        out.at = self.at
        out.vectors = [v[:, keep] for v, keep in zip(self.vectors, allowed, strict=True)]
        out._normalize()
        out._extremes()
        return out

    def _accumulate(self, values: Sequence[np.ndarray]) -> np.ndarray:
        """Constant bytes plus, per point, each group's value from its latest event (values[g]
        has one entry per event of g). Whole bytes add up exactly."""
        change = np.zeros(self.count + 1)
        for at, value in zip(self.at, values, strict=True):
            if len(at):
                np.add.at(change, at, np.diff(value, prepend=0.0))
        return self.constant + np.cumsum(change[:-1])

    def loads(self, values: Sequence[np.ndarray]) -> np.ndarray:
        """Bytes at every point when group g takes `values[g]` (one-hot or fractional)."""
        return self._accumulate([v @ x for v, x in zip(self.vectors, values, strict=True)])

    def choice_loads(self, choice: Sequence[int]) -> np.ndarray:
        """Bytes at every point under one strategy index per group (exact for whole bytes)."""
        return self._accumulate([v[:, i] for v, i in zip(self.vectors, choice, strict=True)])

    def _latest(self, g: int, points: np.ndarray) -> np.ndarray:
        """Per point, the index of group g's latest event at or before it (-1: none)."""
        return np.searchsorted(self.at[g], points, side="right") - 1

    def rows(self, points: Sequence[int]) -> dict[int, dict[int, np.ndarray]]:
        """The full coefficients (group -> bytes per strategy) of the given points."""
        wanted = np.array(sorted(set(points)), dtype=np.int64)
        out: dict[int, dict[int, np.ndarray]] = {int(p): {} for p in wanted}
        for g, vectors in enumerate(self.vectors):
            live = self.live[g]
            for p, k in zip(wanted.tolist(), self._latest(g, wanted).tolist(), strict=True):
                if k >= 0 and live[k]:
                    out[p][g] = vectors[k]
        return out

    def chain(self, points: Sequence[int]) -> list[tuple[int, dict[int, np.ndarray]]]:
        """For increasing `points`: each one's coefficients minus the previous one's."""
        wanted = np.array(points, dtype=np.int64)
        out: list[tuple[int, dict[int, np.ndarray]]] = [(int(p), {}) for p in wanted]
        for g, vectors in enumerate(self.vectors):
            latest = self._latest(g, wanted)
            before = -1
            for position, k in enumerate(latest.tolist()):
                if k != before:
                    change = (vectors[k] if k >= 0 else 0.0) - (
                        vectors[before] if before >= 0 else 0.0)
                    if np.any(change):
                        out[position][1][g] = change
                    before = k
        return out

    def segments(self) -> list[list[tuple[int, int, np.ndarray]]]:
        """Per group: (first point, end point, coefficients) of the runs where they are constant
        and not all zero."""
        out: list[list[tuple[int, int, np.ndarray]]] = []
        for at, vectors, live in zip(self.at, self.vectors, self.live, strict=True):
            stops = [*at[1:].tolist(), self.count] if len(at) else []
            out.append([(start, stop, vectors[k])
                        for k, (start, stop) in enumerate(zip(at.tolist(), stops, strict=True))
                        if live[k]])
        return out


@dataclass
class _Launch:
    """A launch in group terms: paid when some group in `members` picks one of its indices
    there. Several nodes of one group pick one index, so their indices are united."""

    cost: float
    members: dict[int, np.ndarray]

    def paid(self, choice: Sequence[int]) -> bool:
        return any(choice[g] in picks for g, picks in self.members.items())

    def restricted(self, groups: list[_Group], allowed: Sequence[np.ndarray]
                   ) -> tuple[_Launch | None, bool]:
        """This launch with group g limited to `allowed[g]` (index i of the result paying when
        allowed[g][i] did), and whether every remaining choice pays it (then it is a
        constant). (None, False): no choice can pay it."""
        kept = {g: np.flatnonzero(np.isin(allowed[g], picks)) for g, picks in self.members.items()}
        kept = {g: picks for g, picks in kept.items() if len(picks)}
        if any(len(picks) == groups[g].size for g, picks in kept.items()):
            return None, True
        return (_Launch(self.cost, kept) if kept else None), False


@dataclass
class _Model:
    groups: list[_Group]
    group_of: list[int]  # per node: its group, or -1 for a single-strategy (constant) node
    linear: list[np.ndarray]  # per group and strategy, seconds
    pairs: dict[tuple[int, int], np.ndarray]  # (a, b) with a < b: matrix[i_a][j_b], seconds
    constant: float  # seconds that no decision changes
    memory: _Memory | None = None
    # Launches (problem.launches) whose payment depends on the choice.
    launches: list[_Launch] = field(default_factory=list)

    def to_choice(self, group_choice: Sequence[int]) -> Solution:
        """Expand one index per group to one index per node."""
        return Solution(tuple(0 if g < 0 else int(group_choice[g]) for g in self.group_of))

    def one_hot(self, choice: Sequence[int]) -> list[np.ndarray]:
        values = []
        for g, group in enumerate(self.groups):
            row = np.zeros(group.size)
            row[choice[g]] = 1.0
            values.append(row)
        return values


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


def _separable(matrix: np.ndarray) -> bool:
    """Whether matrix[i][j] == row[i] + col[j] for some vectors (then it is two linear terms)."""
    scale = float(np.abs(matrix).max()) if matrix.size else 0.0
    tol = _SEPARABLE_TOL * max(scale, 1e-300)
    rebuilt = matrix[:, :1] + matrix[:1, :] - matrix[0, 0]
    return bool((np.abs(matrix - rebuilt) <= tol).all())


def _add_edges(problem: ShardingProblem, model: _Model) -> None:
    """Fold every edge into linear terms, the constant, or a merged pairwise matrix."""
    arrays: dict[int, np.ndarray] = {}  # id(costs) -> array (edges share their matrices)
    for edge in problem.edges:
        gs, gd = model.group_of[edge.src], model.group_of[edge.dst]
        costs = arrays.get(id(edge.costs))
        if costs is None:
            costs = np.array(edge.costs, dtype=float)
            arrays[id(edge.costs)] = costs
        if gs < 0 and gd < 0:
            model.constant += float(costs[0, 0])
        elif gs < 0:
            model.linear[gd] += costs[0]
        elif gd < 0:
            model.linear[gs] += costs[:, 0]
        elif gs == gd:  # same tie group: both ends pick the same index
            model.linear[gs] += np.diagonal(costs)
        else:
            a, b = min(gs, gd), max(gs, gd)
            matrix = model.pairs.get((a, b))
            if matrix is None:
                matrix = model.pairs[(a, b)] = np.zeros((model.groups[a].size,
                                                         model.groups[b].size))
            matrix += costs if gs == a else costs.T
    _fold_separable(model)


def _fold_separable(model: _Model) -> None:
    """Pairs whose matrix is separable become linear terms."""
    for (a, b), matrix in list(model.pairs.items()):
        if _separable(matrix):  # includes the all-zero matrix
            model.linear[a] += matrix[:, 0] - matrix[0, 0]
            model.linear[b] += matrix[0]
            del model.pairs[(a, b)]


def _restrict(model: _Model, allowed: Sequence[np.ndarray]) -> _Model:
    """The model with group g limited to the strategies `allowed[g]` (indices, in order);
    index i of the result is strategy allowed[g][i] of the model."""
    groups = [_Group(g.nodes, len(keep)) for g, keep in zip(model.groups, allowed, strict=True)]
    restricted = _Model(groups, model.group_of,
                        [costs[keep] for costs, keep in zip(model.linear, allowed, strict=True)],
                        {(a, b): matrix[np.ix_(allowed[a], allowed[b])]
                         for (a, b), matrix in model.pairs.items()},
                        model.constant)
    for launch in model.launches:
        kept, always = launch.restricted(groups, allowed)
        if always:
            restricted.constant += launch.cost
        elif kept is not None:
            restricted.launches.append(kept)
    _fold_separable(restricted)
    restricted.memory = model.memory.restricted(allowed)
    return restricted


def _compile(problem: ShardingProblem) -> _Model:
    groups, group_of = _group_nodes(problem)
    model = _Model(groups, group_of, [np.zeros(g.size) for g in groups], {}, 0.0)
    costs: dict[int, np.ndarray] = {}
    for index, node in enumerate(problem.nodes):
        g = group_of[index]
        if g < 0:
            model.constant += node.strategies[0].cost
            continue
        vector = costs.get(id(node.strategies))
        if vector is None:
            vector = np.array([s.cost for s in node.strategies], dtype=float)
            costs[id(node.strategies)] = vector
        model.linear[g] += vector
    _add_edges(problem, model)
    _add_launches(problem, model)
    model.memory = _Memory(problem, group_of, [g.size for g in groups])
    return model


def _add_launches(problem: ShardingProblem, model: _Model) -> None:
    """Each launch in group terms (`_Launch`); a launch some node pays under every choice (a
    single-strategy node picks index 0) is a constant."""
    everything = [np.arange(g.size) for g in model.groups]
    for launch in problem.launches:
        if launch.cost <= 0:
            continue
        members: dict[int, set[int]] = {}
        always = False
        for node, picks in launch.members:
            g = model.group_of[node]
            if g < 0:
                always = always or 0 in picks
            else:
                members.setdefault(g, set()).update(picks)
        kept, forced = _Launch(launch.cost, {g: np.array(sorted(p)) for g, p
                                             in sorted(members.items())}).restricted(
            model.groups, everything)
        if always or forced:
            model.constant += launch.cost
        elif kept is not None:
            model.launches.append(kept)


def _launch_costs(model: _Model, choice: Sequence[int]) -> float:
    """Seconds of the launches `choice` (one index per group) pays."""
    return sum(launch.cost for launch in model.launches if launch.paid(choice))


def _binding_points(model: _Model, budget: float) -> list[int]:
    """Points that some choice could push over the budget (the others need no constraint)."""
    if math.isinf(budget):
        return []
    limit = budget + MEMORY_RTOL * abs(budget)
    return [int(p) for p in np.flatnonzero(model.memory.max_load > limit)]


def _objective(model: _Model, choice: Sequence[int]) -> float:
    """Seconds for one index per group, from the compiled model."""
    total = model.constant + sum(float(model.linear[g][i]) for g, i in enumerate(choice))
    for (a, b), matrix in model.pairs.items():
        total += float(matrix[choice[a], choice[b]])
    return total + _launch_costs(model, choice)


def _fits(model: _Model, budget: float, choice: Sequence[int]) -> bool:
    if not model.memory.count or math.isinf(budget):
        return True
    limit = budget + MEMORY_RTOL * abs(budget)
    return bool((model.memory.choice_loads(choice) <= limit).all())


def _argmin(values: Sequence[float]) -> int:
    return min(range(len(values)), key=values.__getitem__)


# --------------------------------------------------------------------------- heuristic start


def _improve(model: _Model, budget: float, choice: list[int]) -> None:
    """Best-improvement local search over single groups, keeping every point under budget."""
    neighbours = _neighbours(model)
    memory = model.memory
    check = memory.count > 0 and not math.isinf(budget)
    limit = budget + MEMORY_RTOL * abs(budget)
    runs = []  # per group: run starts and ends (interleaved) and coefficients, one row per run
    for segments in (memory.segments() if check else [[] for _ in model.groups]):
        bounds = np.array([b for start, stop, _ in segments for b in (start, stop)],
                          dtype=np.int64)
        vectors = np.array([v for _, _, v in segments]) if segments else None
        runs.append((bounds, vectors))
    loads = memory.choice_loads(choice) if check else np.zeros(0)

    for _ in range(4):
        improved = False
        for g in range(len(model.groups)):
            current = choice[g]
            costs = _local_costs(model, neighbours, g, choice)
            threshold = costs[current] - 1e-15 * abs(costs[current])
            better = costs < threshold
            if not better.any():
                continue
            bounds, vectors = runs[g]
            if vectors is not None:
                # The peak of each run where the group is live, and what each strategy adds.
                peaks = np.maximum.reduceat(np.append(loads, -np.inf), bounds)[0::2]
                better &= ((peaks[:, None] + vectors - vectors[:, [current]]) <= limit).all(0)
            candidates = np.flatnonzero(better)
            if not len(candidates):
                continue
            best = int(candidates[np.argmin(costs[candidates])])
            if vectors is not None:
                for k in range(len(vectors)):
                    loads[bounds[2 * k]:bounds[2 * k + 1]] += vectors[k, best] - vectors[k, current]
            choice[g] = best
            improved = True
        if not improved:
            return


def _heuristic(model: _Model, budget: float, relaxed=None) -> list[int] | None:
    """A feasible start for the solver (and a fallback if it finds nothing), or None.

    Tries, in turn, the rounded LP relaxation (`relaxed`: a value vector per group), each
    group's cheapest strategy, and each group's smallest (then cheapest) strategy over the
    binding points; the first that fits is improved by local search.
    """
    candidates = []
    if relaxed is not None:
        candidates.append([int(np.argmax(values)) for values in relaxed])
    candidates.append([int(np.argmin(costs)) for costs in model.linear])
    binding = _binding_points(model, budget)
    if binding:
        # Each group's bytes summed over the binding points, per strategy.
        counts = np.zeros(model.memory.count + 1)
        counts[1:][binding] = 1.0
        counts = np.cumsum(counts)  # counts[p]: binding points before p
        memory = [np.zeros(g.size) for g in model.groups]
        for g, runs in enumerate(model.memory.segments()):
            for start, stop, vector in runs:
                memory[g] += (counts[stop] - counts[start]) * vector
        candidates.append([
            min(range(g.size), key=lambda i, k=k: (memory[k][i], model.linear[k][i]))
            for k, g in enumerate(model.groups)
        ])
    for k, choice in enumerate(candidates):
        if _fits(model, budget, choice) or (k == 0 and relaxed is not None
                                             and _repair(model, budget, choice)):
            _improve(model, budget, choice)
            return choice
    return None


def _neighbours(model: _Model) -> list[list[tuple[int, np.ndarray, bool]]]:
    """Per group: (other group, pair matrix, whether this group indexes its rows)."""
    out: list[list[tuple[int, np.ndarray, bool]]] = [[] for _ in model.groups]
    for (a, b), matrix in model.pairs.items():
        out[a].append((b, matrix, True))
        out[b].append((a, matrix, False))
    return out


def _local_costs(model: _Model, neighbours, g: int, choice: Sequence[int]) -> np.ndarray:
    """Seconds of each strategy of group g, the other groups' choices held fixed."""
    cost = model.linear[g].copy()
    for other, matrix, forward in neighbours[g]:
        cost += matrix[:, choice[other]] if forward else matrix[choice[other], :]
    return cost


def _repair(model: _Model, budget: float, choice: list[int]) -> bool:
    """Move groups to smaller strategies until every point fits (in place); False if stuck.

    Each step takes the move with the least added seconds per byte of overflow removed at the
    points over budget. Repairs a rounded LP relaxation, which sits on the budget: rounding
    its few fractional groups up usually leaves a point a little over.
    """
    memory = model.memory
    limit = budget + MEMORY_RTOL * abs(budget)
    segments = memory.segments()
    bounds = [(np.array([a for a, _, _ in runs], dtype=np.int64),
               np.array([b for _, b, _ in runs], dtype=np.int64)) for runs in segments]
    loads = memory.choice_loads(choice)
    neighbours = _neighbours(model)
    for _ in range(min(2 * len(model.groups) + 1, _REPAIR_MOVES)):
        over = loads - limit
        violated = np.flatnonzero(over > 0)
        if not len(violated):
            return True
        best = None
        for g, group in enumerate(model.groups):
            if not segments[g]:
                continue
            current = choice[g]
            lows = np.searchsorted(violated, bounds[g][0])
            highs = np.searchsorted(violated, bounds[g][1])
            touching = np.flatnonzero(highs > lows)
            if not len(touching):
                continue
            gain = np.zeros(group.size)
            for k in touching.tolist():
                excess = over[violated[lows[k]:highs[k]]]
                vector = segments[g][k][2]
                delta = vector - vector[current]
                gain += excess.sum() - np.maximum(excess[:, None] + delta[None, :], 0.0).sum(0)
            useful = np.flatnonzero(gain > 0)
            if not len(useful):
                continue
            costs = _local_costs(model, neighbours, g, choice)
            ratios = (costs[useful] - costs[current]) / gain[useful]
            k = int(np.argmin(ratios))
            if best is None or ratios[k] < best[0]:
                best = (float(ratios[k]), g, int(useful[k]))
        if best is None:
            return False
        _, g, i = best
        for start, stop, vector in segments[g]:
            loads[start:stop] += vector[i] - vector[choice[g]]
        choice[g] = i
    return bool((loads <= limit).all())


# --------------------------------------------------------------------------- the ILP in arrays


def _classes(matrix: np.ndarray) -> list[list[int]]:
    """Indices of equal rows of `matrix`, grouped, in order of first appearance."""
    groups: dict[bytes, list[int]] = {}
    for index, row in enumerate(matrix):
        groups.setdefault(row.tobytes(), []).append(index)
    return list(groups.values())


@dataclass
class _Lp:
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
class _Built:
    """The ILP, how its columns map back to choices, and the backend's model of it."""

    model: _Model
    lp: _Lp
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
    gap: float = _MIP_REL_GAP  # the relative gap at which branch and bound stops

    @property
    def variables(self) -> int:
        return len(self.lp.cost)

    @property
    def constraints(self) -> int:
        return len(self.lp.row_lower)


def _build(model: _Model, binding: list[int], budget: float, backend: str,
           lazy: bool) -> _Built:
    """The ILP: one-hot binaries per group, transportation edges and memory (lazy or chain)."""
    lp = _Lp()
    named = backend != "highs"  # PuLP needs names; highspy takes columns by index
    s = []
    for g, group in enumerate(model.groups):
        size = group.size
        columns = lp.columns([f"s_{group.rep}_{i}" for i in range(size)] if named else [""] * size,
                             model.linear[g] * _TIME_SCALE, 0.0, 1.0, True)
        s.append(columns)
        lp.row(f"one_{group.rep}", columns, [1.0] * len(columns), 1.0, 1.0)
    e = {}
    for (a, b), matrix in sorted(model.pairs.items()):
        ra, rb = model.groups[a].rep, model.groups[b].rep
        # Strategies whose rows (columns) of the matrix are equal are interchangeable for this
        # edge: aggregate them, so the transportation grid is classes x classes, not the full
        # strategy product. Exact: the class sums of a one-hot choice are one-hot.
        row_classes = _classes(matrix)
        col_classes = _classes(matrix.T)
        rows_, cols_ = len(row_classes), len(col_classes)
        costs = matrix[np.ix_([m[0] for m in row_classes], [m[0] for m in col_classes])]
        names = ([f"e_{ra}_{rb}_{i}_{j}" for i in range(rows_) for j in range(cols_)] if named
                 else [""] * (rows_ * cols_))
        flat = lp.columns(names, costs.ravel() * _TIME_SCALE)
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
        paid = lp.column(f"launch_{k}" if named else "", launch.cost * _TIME_SCALE, 0.0, 1.0)
        launches.append(paid)
        for g, picks in launch.members.items():
            lp.row(f"launch_{k}_{model.groups[g].rep}", [s[g][int(i)] for i in picks] + [paid],
                   [1.0] * len(picks) + [-1.0], -math.inf, 0.0)
    built = _Built(model, lp, backend, s, e, lazy=lazy, launches=launches)
    if not lazy:
        _add_chain(built, binding, budget)
    return built


def _row_terms(built: _Built, coefficients: dict[int, np.ndarray],
               scale: float) -> tuple[list[int], list[float]]:
    index, value = [], []
    for g in sorted(coefficients):
        for i, c in enumerate(coefficients[g]):
            if c:
                index.append(built.s[g][i])
                value.append(float(c) * scale)
    return index, value


def _add_memory_rows(built: _Built, points: Sequence[int], budget: float) -> None:
    """Rows `sum coefficients * s <= budget - constant` for the given points (lazy form)."""
    points = [p for p in sorted(set(points)) if p not in built.memory_rows]
    memory = built.model.memory
    for p, coefficients in sorted(memory.rows(points).items()):
        index, value = _row_terms(built, coefficients, _MEMORY_SCALE)
        built.memory_rows[p] = built.lp.row(
            f"mem_{p}", index, value, -math.inf,
            (budget - float(memory.constant[p])) * _MEMORY_SCALE)


def _add_chain(built: _Built, points: Sequence[int], budget: float | None) -> None:
    """Load columns L_k = L_{k-1} + (changed coefficients) . s for increasing points, with
    L_k <= budget - constant_k (no bound when `budget` is None: the min-peak model)."""
    memory = built.model.memory
    previous = None
    for p, delta in memory.chain(sorted(points)):
        upper = math.inf if budget is None else (budget - float(memory.constant[p])) * _MEMORY_SCALE
        load = built.lp.column(f"load_{p}", 0.0, -math.inf, upper)
        index, value = _row_terms(built, delta, -_MEMORY_SCALE)
        if previous is not None:
            index.append(previous)
            value.append(-1.0)
        built.lp.row(f"chain_{p}", [load, *index], [1.0, *value], 0.0, 0.0)
        built.chain.append((p, load))
        previous = load


def _start_values(built: _Built, choice: Sequence[int]) -> np.ndarray:
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
            values[column] = loads[p] * _MEMORY_SCALE
        if built.peak is not None:
            values[built.peak] = float(max(built.model.memory.choice_loads(choice)[
                [p for p, _ in built.chain]] * _MEMORY_SCALE))
    return values


def _group_values(built: _Built) -> list[np.ndarray] | None:
    if built.values is None:
        return None
    return [built.values[columns] for columns in built.s]


def _read_choice(built: _Built) -> list[int] | None:
    """The index per group the solver set to 1, or None if the values are not a one-hot choice."""
    groups = _group_values(built)
    if groups is None:
        return None
    choice = []
    for values in groups:
        best = int(np.argmax(values))
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
    try:
        import highspy  # noqa: F401
    except ImportError:
        return False
    return True


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


def _highs_sync(built: _Built, highspy) -> object:
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


def _highs_run(built: _Built, *, time_limit: float, threads: int, mip: bool,
               start: np.ndarray | None) -> int:
    import highspy

    with _native_stdout_silenced():
        h = _highs_sync(built, highspy)
        if mip != built.integer:
            columns = np.flatnonzero(built.lp.binary).astype(np.int32)
            kind = highspy.HighsVarType.kInteger if mip else highspy.HighsVarType.kContinuous
            h.changeColsIntegrality(len(columns), columns, np.array([kind] * len(columns)))
            built.integer = mip
        h.setOptionValue("time_limit", max(float(time_limit), 0.01))
        h.setOptionValue("threads", int(threads))
        h.setOptionValue("mip_rel_gap", built.gap)
        # HiGHS's LP presolve removes little from this formulation (a Llama3-8B step: 6% of
        # the columns) and costs more than it saves: its LP solves in half the time without.
        h.setOptionValue("presolve", "choose" if mip else "off")
        if start is not None and mip:
            solution = highspy.HighsSolution()
            solution.col_value = list(start)
            solution.value_valid = True
            h.setSolution(solution)
        h.run()
    status = h.getModelStatus()
    info = h.getInfo()
    ok = highspy.HighsModelStatus
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


def _pulp_model(built: _Built) -> tuple[pulp.LpProblem, list]:
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


def _cbc_run(built: _Built, *, time_limit: float, threads: int, mip: bool,
             start: np.ndarray | None) -> int:
    prob, variables = _pulp_model(built)
    if start is not None and mip:
        for var, value in zip(variables, start):
            var.setInitialValue(float(value))
    path = None if pulp.COIN_CMD(msg=False).available() else _cbc_path()
    solver = pulp.COIN_CMD(mip=mip, msg=False, timeLimit=max(float(time_limit), 0.01),
                           threads=threads, gapRel=built.gap,
                           warmStart=bool(start is not None and mip), path=path)
    with _native_stdout_silenced():
        prob.solve(solver)
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


def _run(
    built: _Built,
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
    run = _highs_run if backend == "highs" else _cbc_run
    return run(built, time_limit=time_limit, threads=threads, mip=mip, start=start)


def _violated(built: _Built, budget: float) -> list[int]:
    """Points over budget under the last solution's values, the most violated first."""
    if built.values is None or not built.lazy or math.isinf(budget):
        return []
    loads = built.model.memory.loads(_group_values(built))
    limit = budget + MEMORY_RTOL * abs(budget)
    over = np.flatnonzero(loads > limit)
    order = sorted(over.tolist(), key=lambda p: (-loads[p], p))
    return [p for p in order if p not in built.memory_rows]


def _run_lazy(built: _Built, backend: str, budget: float, deadline: float, threads: int,
              *, mip: bool, start: np.ndarray | None = None) -> int:
    """`_run`, adding the memory rows the solution violates and solving again until it
    violates none (lazy form); NoSolutionFound when time runs out with a violated solution."""
    while True:
        status = _run(built, backend, time_limit=deadline - time.perf_counter(),
                      threads=threads, mip=mip, start=start)
        if status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
            return status
        violated = _violated(built, budget)
        if not violated:
            return status
        if time.perf_counter() >= deadline:
            built.values = None
            return pulp.LpSolutionNoSolutionFound
        _add_memory_rows(built, violated[:_LAZY_ROWS_PER_ROUND], budget)


def _fix_by_reduced_costs(built: _Built, incumbent: float) -> int:
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
        if len(columns):
            bound = np.full(len(columns), value)
            h.changeColsBounds(len(columns), columns.astype(np.int32), bound, bound)
            for j in columns.tolist():
                built.lp.lower[j] = built.lp.upper[j] = value
    return len(zero) + len(one)


def _seed_rows(built: _Built, budget: float, binding: Sequence[int]) -> None:
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
    _add_memory_rows(built, closest[:_LAZY_ROWS_PER_ROUND].tolist(), budget)


def _preseed_rows(built: _Built, budget: float) -> None:
    """Before branch and bound: add the rows of the points near the budget under the LP's
    values, so that integer solutions rarely violate a missing row (each violation costs a
    new branch and bound)."""
    if built.values is None or not built.lazy or math.isinf(budget):
        return
    loads = built.model.memory.loads(_group_values(built))
    near = np.flatnonzero(loads >= budget * (1.0 - _LAZY_NEAR_BUDGET))
    order = sorted((p for p in near.tolist() if p not in built.memory_rows),
                   key=lambda p: (-loads[p], p))
    _add_memory_rows(built, order[:_LAZY_MAX_PRESEED], budget)


# --------------------------------------------------------------------------- infeasibility


def _min_peak_choice(
    model: _Model, backend: str, time_limit: float, threads: int
) -> tuple[list[int] | None, bool]:
    """Minimise the largest live point (ILP); return a choice per group and whether proven."""
    if not model.groups:
        return [], True
    memory = model.memory
    # Only points whose largest load reaches the largest smallest load can set the peak.
    floor = float(memory.min_load.max()) if memory.count else 0.0
    points = [int(p) for p in np.flatnonzero(memory.max_load >= floor)]
    lp = _Lp()
    s = []
    for group in model.groups:
        columns = [lp.column(f"s_{group.rep}_{i}", 0.0, 0.0, 1.0, True)
                   for i in range(group.size)]
        s.append(columns)
        lp.row(f"one_{group.rep}", columns, [1.0] * len(columns), 1.0, 1.0)
    built = _Built(model, lp, backend, s, {})
    _add_chain(built, points, None)
    built.peak = lp.column("peak", 1.0, 0.0)
    for p, load in built.chain:
        lp.row(f"peak_{p}", [load, built.peak], [1.0, -1.0], -math.inf,
               -float(memory.constant[p]) * _MEMORY_SCALE)
    status = _run(built, backend, time_limit=time_limit, threads=threads)
    if status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        return None, False
    return _read_choice(built), status == pulp.LpSolutionOptimal


def _infeasible(
    problem: ShardingProblem, model: _Model, backend: str | None, time_limit: float, threads: int
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
    gap: float = _MIP_REL_GAP,
    _model: _Model | None = None,
    _started: float | None = None,
) -> tuple[Solution, SolveStats]:
    """Find the cheapest strategy per node that fits the memory budget.

    `solver` is "auto" (HiGHS when highspy is importable, else CBC), "highs" or "cbc". With the
    default single thread the result is deterministic. Status is "optimal", "within_gap" (the
    plan is proven within the relative `gap` of the optimum, but not to 1e-6), or "time_limit"
    when the limit stopped the search with a feasible but unproven solution (the best one found
    is returned). `SolveStats.gap` is always the gap to the best bound known. Raises
    InfeasibleError when no choice fits the budget, SolverError when the solver found nothing
    usable in time.

    `memory_rows` is "lazy" (rows added as solutions violate them), "chain" (every binding
    point, through load variables) or "auto" (lazy for HiGHS, chain for CBC); both are exact.
    `gap`: the relative gap at which the search may stop (default 1e-6: optimal).
    """
    started = time.perf_counter() if _started is None else _started
    if _model is None:
        problem.validate()
    backend = _pick_backend(solver)
    if memory_rows not in ("auto", "lazy", "chain"):
        raise ValueError(f"unknown memory_rows {memory_rows!r}: expected auto, lazy or chain")
    model = _compile(problem) if _model is None else _model
    budget = problem.memory_budget
    memory = model.memory
    if memory.count and not all(memory_fits(float(v), budget) for v in memory.min_load):
        raise _infeasible(problem, model, backend, time_limit, threads)
    binding = _binding_points(model, budget)
    if not model.groups or (not model.pairs and not binding and not model.launches):
        return _solve_directly(problem, model, started)
    lazy = memory_rows == "lazy" or (memory_rows == "auto" and backend == "highs")
    return _solve_ilp(problem, model, backend, time_limit, threads, started, lazy, gap)


def _solve_directly(
    problem: ShardingProblem, model: _Model, started: float
) -> tuple[Solution, SolveStats]:
    """Each group's cheapest strategy: optimal when nothing couples the decisions."""
    choice = [int(np.argmin(costs)) for costs in model.linear]
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


def _solver_choice(model: _Model, built: _Built, status: int, budget: float) -> list[int] | None:
    """The solver's choice if it has one that fits every live point.

    A binary within the solver's integrality tolerance of 1 can still leave a memory row a few
    bytes over once rounded; such a choice is discarded rather than reported as feasible.
    """
    if status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        return None
    choice = _read_choice(built)
    if choice is None or not _fits(model, budget, choice):
        return None
    return choice


def _integral_choice(built: _Built) -> list[int] | None:
    """The relaxation's choice when every one-hot group came out integral."""
    groups = _group_values(built)
    if groups is None:
        return None
    choice = []
    for values in groups:
        best = int(np.argmax(values))
        if values[best] < 1.0 - _INTEGRALITY_TOL:
            return None
        choice.append(best)
    return choice


class _ModelInfeasible(Exception):
    """The compiled model has no choice that fits the budget."""


@dataclass
class _Outcome:
    """What solving a compiled model gave: a choice per group and how good it is known to be."""

    choice: list[int]
    status: str  # "optimal" or "time_limit"
    bound: float  # seconds, a lower bound on the optimum (-inf: none)
    variables: int
    constraints: int
    extra: dict


def _solve_model(
    model: _Model,
    budget: float,
    backend: str,
    deadline: float,
    threads: int,
    lazy: bool,
    start: list[int] | None = None,
    branch: bool = True,
    gap: float = _MIP_REL_GAP,
    search: bool = True,
) -> _Outcome:
    """Solve a compiled model. `start`: a choice known to fit, used as the incumbent when the
    solver's own start is worse. `branch=False` stops after the LP relaxation: its choice when
    integral, else the better of the repaired rounding and `start` (status "time_limit").
    `gap`: stop once the incumbent is proven within this relative gap of the optimum (status
    "optimal" when that gap is at most _MIP_REL_GAP, else "within_gap"; the gap is reported).
    `search`: improve a fractional LP's rounding by neighbourhood search before branching.
    Raises _ModelInfeasible, or SolverError when nothing usable was found in time."""
    binding = _binding_points(model, budget)
    if not model.groups or (not model.pairs and not binding and not model.launches):
        choice = [int(np.argmin(costs)) for costs in model.linear]
        return _Outcome(choice, "optimal", _objective(model, choice), 0, 0,
                        {"backend": None, "source": "direct"})
    built = _build(model, binding, budget, backend, lazy)
    built.gap = max(float(gap), _MIP_REL_GAP)
    kind = "lazy" if lazy else "chain"
    _seed_rows(built, budget, binding)
    # The LP relaxation of this formulation is usually integral (as reported for Alpa-style
    # ILPs) and several times faster than branch and bound: when its optimum is one-hot it is
    # the ILP optimum, proven by its own bound.
    status = _run_lazy(built, backend, budget, deadline, threads, mip=False)
    if status == pulp.LpSolutionInfeasible:
        raise _ModelInfeasible()
    relaxed = _group_values(built) if status == pulp.LpSolutionOptimal else None
    lp_bound = built.objective if status == pulp.LpSolutionOptimal else None
    choice = _integral_choice(built) if relaxed is not None else None
    if choice is not None and _fits(model, budget, choice):
        bound = lp_bound / _TIME_SCALE + model.constant
        return _Outcome(choice, "optimal", bound, built.variables, built.constraints,
                        {"backend": backend, "raw_status": "LP relaxation integral",
                         "source": "lp", "solver_objective": bound, "memory_rows": kind,
                         "lazy_rows": len(built.memory_rows)})
    heuristic = _heuristic(model, budget, relaxed)
    if start is not None and _fits(model, budget, start) and (
            heuristic is None or _objective(model, start) < _objective(model, heuristic)):
        heuristic = list(start)
    if not branch:
        if heuristic is None:
            raise SolverError("no rounding of the LP relaxation fits")
        return _Outcome(heuristic, "time_limit",
                        lp_bound / _TIME_SCALE + model.constant if lp_bound is not None
                        else -math.inf, built.variables, built.constraints,
                        {"backend": backend, "source": "rounded LP", "memory_rows": kind,
                         "lazy_rows": len(built.memory_rows)})
    extra: dict = {
        "backend": backend,
        "heuristic_objective": _objective(model, heuristic) if heuristic is not None else None,
        "memory_rows": kind,
        "relative_gap_limit": built.gap,
    }
    source = "heuristic"
    # The LP optimum bounds every plan: stop as soon as the incumbent is close enough to it.
    lp_seconds = lp_bound / _TIME_SCALE + model.constant if lp_bound is not None else None

    def within_gap(choice) -> bool:
        if choice is None or lp_seconds is None:
            return False
        objective = _objective(model, choice)
        return objective - lp_seconds <= built.gap * abs(objective)

    if (search and heuristic is not None and relaxed is not None and not within_gap(heuristic)
            and len(_fractional_groups(relaxed))
            > _NEIGHBOURHOOD_MAX_FRACTION * len(model.groups)):
        # Fractional nearly everywhere: a neighbourhood would be the whole problem. Dive.
        dived, dives = _dive(model, budget, backend, deadline, threads, lazy, relaxed)
        extra["dive_rounds"] = dives
        if dived is not None and _objective(model, dived) < _objective(model, heuristic):
            extra["dive_objective"] = _objective(model, dived)
            heuristic, source = dived, "LP dive"
    if (search and heuristic is not None and relaxed is not None
            and not within_gap(heuristic)):
        found, rounds = _search_neighbourhoods(model, budget, backend, deadline, threads, lazy,
                                               relaxed, heuristic)
        extra["neighbourhood_rounds"] = rounds
        if found is not None:
            extra["neighbourhood_objective"] = _objective(model, found)
            heuristic, source = found, "neighbourhood search"
    if within_gap(heuristic):
        extra.update(raw_status="within gap of the LP relaxation", source=source,
                     lazy_rows=len(built.memory_rows))
        return _Outcome(heuristic, _proven_status(_objective(model, heuristic), lp_seconds),
                        lp_seconds, built.variables, built.constraints, extra)
    values = _start_values(built, heuristic) if heuristic is not None else None
    fixed = 0
    if heuristic is not None and relaxed is not None:
        fixed = _fix_by_reduced_costs(built, (_objective(model, heuristic) - model.constant)
                                      * _TIME_SCALE)
    _preseed_rows(built, budget)
    status = _run_lazy(built, backend, budget, deadline, threads, mip=True, start=values)
    if status == pulp.LpSolutionInfeasible:
        raise _ModelInfeasible()
    extra.update({
        "raw_status": pulp.LpSolution.get(status, str(status)),
        "source": "solver",
        "lazy_rows": len(built.memory_rows),
        "fixed_by_reduced_cost": fixed,
    })
    choice = _solver_choice(model, built, status, budget)
    bound = None
    if choice is not None:
        extra["solver_objective"] = (built.objective or 0.0) / _TIME_SCALE + model.constant
        bound = built.dual_bound
        if (status != pulp.LpSolutionOptimal and heuristic is not None
                and _objective(model, heuristic) < _objective(model, choice)):
            choice, extra["source"] = heuristic, "heuristic"
    elif heuristic is not None:
        choice, extra["source"] = heuristic, "heuristic"
    else:
        # _solve wraps this with the time limit and what to do.
        raise SolverError(f"status: {extra['raw_status']}")
    proven = status == pulp.LpSolutionOptimal and extra["source"] == "solver"
    if bound is None:
        bound = lp_bound
    if bound is None and not proven:
        # Any LP optimum over a subset of the memory rows is a lower bound too.
        remaining = max(deadline - time.perf_counter(), 1.0)
        if _run(built, backend, time_limit=remaining, threads=threads,
                mip=False) == pulp.LpSolutionOptimal:
            bound = built.objective
    bound = bound / _TIME_SCALE + model.constant if bound is not None else -math.inf
    if not proven:
        status_text = "time_limit"
    elif built.gap <= _MIP_REL_GAP:
        status_text = "optimal"  # proven by the backend to its strictest gap
    else:
        status_text = _proven_status(_objective(model, choice), bound)
    return _Outcome(choice, status_text, bound, built.variables, built.constraints, extra)


def _proven_status(objective: float, bound: float) -> str:
    """"optimal" when `bound` proves `objective` optimal to _MIP_REL_GAP, else "within_gap"."""
    return "optimal" if objective - bound <= _MIP_REL_GAP * abs(objective) else "within_gap"


def _search_neighbourhoods(
    model: _Model,
    budget: float,
    backend: str,
    deadline: float,
    threads: int,
    lazy: bool,
    relaxed: list[np.ndarray],
    incumbent: list[int],
) -> tuple[list[int] | None, int]:
    """Improve a fitting `incumbent` by solving small sub-ILPs exactly (RINS: the groups where
    the LP relaxation is fractional or disagrees with the incumbent, and their neighbours
    through pairwise costs, are free; all others keep the incumbent's strategy). On a
    Llama3-8B step the LP is fractional in one tied group, and the neighbourhood of 12 groups
    solves in 0.1 s to the plan that branch and bound takes seconds to find. When the free
    groups are more than a quarter of the problem (a GPT whose LP splits most groups 0.5/0.5),
    they are freed a window at a time (`_windows`), each window's sub-ILP solved in turn.

    Returns the best choice found (None when nothing better) and the number of sub-ILPs
    solved."""
    neighbours = _neighbours(model)
    rounded = [int(np.argmax(values)) for values in relaxed]
    best, best_objective = None, _objective(model, incumbent)
    current = list(incumbent)
    rounds = 0
    cap = max(1, int(_NEIGHBOURHOOD_MAX_FRACTION * len(model.groups)))
    for _ in range(_NEIGHBOURHOOD_ROUNDS):
        seeds = [g for g, values in enumerate(relaxed)
                 if values[current[g]] < 1.0 - _INTEGRALITY_TOL or current[g] != rounded[g]]
        improved = False
        for free in _windows(seeds, neighbours, cap)[:_NEIGHBOURHOOD_WINDOWS]:
            if time.perf_counter() >= deadline:
                break
            allowed = [np.arange(group.size) if g in free else np.array([current[g]])
                       for g, group in enumerate(model.groups)]
            sub = _restrict(model, allowed)
            rounds += 1
            try:
                outcome = _solve_model(sub, budget, backend, deadline, threads, lazy,
                                       [current[g] if g in free else 0
                                        for g in range(len(model.groups))], search=False)
            except (_ModelInfeasible, SolverError):
                continue
            choice = [int(keep[i]) for keep, i in zip(allowed, outcome.choice, strict=True)]
            if not _fits(model, budget, choice):
                continue
            _improve(model, budget, choice)
            objective = _objective(model, choice)
            if objective < best_objective - 1e-12 * abs(best_objective):
                best, best_objective, current, improved = choice, objective, choice, True
        if not improved:
            break
    return best, rounds


def _fractional_groups(relaxed: list[np.ndarray]) -> list[int]:
    """The groups (in order) whose LP values are not one-hot."""
    return [g for g, values in enumerate(relaxed) if values.max() < 1.0 - _INTEGRALITY_TOL]


def _dive(
    model: _Model,
    budget: float,
    backend: str,
    deadline: float,
    threads: int,
    lazy: bool,
    relaxed: list[np.ndarray],
) -> tuple[list[int] | None, int]:
    """Round a fractional LP by diving: fix a quarter of the fractional groups (in program
    order) to their largest value, solve the LP of the rest again, and repeat until it comes
    out integral. Fixing part of an LP that splits most groups 0.5/0.5 between two layouts
    lets the re-solve pick the matching layouts for the others, which rounding each group on
    its own cannot (GPT 2 layers on 8x8: 485 of 568 groups fractional; rounded 1.8% above the
    LP bound, after one dive 0.5%). Rounding guided by the neighbours' choices, or by the
    LP's pair variables, did worse than plain rounding there.

    Returns the best fitting choice found (improved by local search) and the LPs solved."""
    fixed: dict[int, int] = {}
    values = relaxed
    best, best_objective, solved = None, math.inf, 0
    for _ in range(_DIVE_ROUNDS):
        fractional = [g for g in _fractional_groups(values) if g not in fixed]
        if not fractional or time.perf_counter() >= deadline:
            break
        for g in fractional[:max(1, int(_DIVE_FRACTION * len(fractional)))]:
            fixed[g] = int(np.argmax(values[g]))
        allowed = [np.array([fixed[g]]) if g in fixed else np.arange(group.size)
                   for g, group in enumerate(model.groups)]
        sub = _restrict(model, allowed)
        binding = _binding_points(sub, budget)
        built = _build(sub, binding, budget, backend, lazy)
        _seed_rows(built, budget, binding)
        solved += 1
        if _run_lazy(built, backend, budget, deadline, threads, mip=False) != pulp.LpSolutionOptimal:
            break
        sub_values = _group_values(built)
        values = []
        for keep, group, v in zip(allowed, model.groups, sub_values, strict=True):
            full = np.zeros(group.size)
            full[keep] = v
            values.append(full)
        choice = [int(np.argmax(v)) for v in values]
        if _fits(model, budget, choice) or _repair(model, budget, choice):
            _improve(model, budget, choice)
            objective = _objective(model, choice)
            if objective < best_objective:
                best, best_objective = choice, objective
    return best, solved


def _windows(seeds: list[int], neighbours, cap: int) -> list[set[int]]:
    """The groups to free around `seeds`: one set when the seeds and their neighbours number
    at most `cap`, else consecutive windows of seeds (program order keeps a window's groups
    near each other in the graph), each with its seeds' neighbours, of at most about `cap`."""
    windows: list[set[int]] = []
    window: set[int] = set()
    for g in seeds:
        block = {g, *(other for other, _, _ in neighbours[g])}
        if window and len(window | block) > cap:
            windows.append(window)
            window = set()
        window |= block
    if window:
        windows.append(window)
    return windows


def _solve_ilp(
    problem: ShardingProblem,
    model: _Model,
    backend: str,
    time_limit: float,
    threads: int,
    started: float,
    lazy: bool,
    gap: float = _MIP_REL_GAP,
) -> tuple[Solution, SolveStats]:
    try:
        outcome = _solve_model(model, problem.memory_budget, backend, started + time_limit,
                               threads, lazy, gap=gap)
    except _ModelInfeasible:
        raise _infeasible(problem, model, backend, time_limit, threads) from None
    except SolverError as exc:
        raise SolverError(f"{backend} found no solution within {time_limit:g} s "
                          f"({exc}); raise the time limit") from None
    return _stats(
        problem,
        model.to_choice(outcome.choice),
        solver=backend,
        status=outcome.status,
        bound=outcome.bound,
        started=started,
        variables=outcome.variables,
        constraints=outcome.constraints,
        extra=outcome.extra,
    )
