"""The solver's compiled model of a sharding problem: decision groups, costs and memory.

`compile_model(problem)` turns a `ShardingProblem` into *decision groups*: nodes tied together
share one decision, and nodes with a single strategy are constants. Edges become either linear
terms (when one end is constant, both ends are the same group, or the matrix is separable into a
row part plus a column part) or a pairwise cost matrix between two groups. Everything here is in
seconds and bytes; the backends (`backends.py`) scale it for the solver.

Memory. Live points follow each other in program order, and consecutive points share most of
their live values, so the model keeps the bytes of every point as *events*: the decision groups
whose coefficients change at that point (`Memory`, from the problem's liveness sweep,
`liveness.py`); the loads of all points under a choice cost time linear in the events, never
points x live values.

A model answers, for one strategy index per group: its seconds (`Model.objective`), whether it
fits a budget (`Model.fits`); and it can be restricted to a subset of each group's strategies
(`Model.restrict`), which is how `axes.py` and the neighbourhood search solve parts of a problem
without rebuilding it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from hloplan.solver.evaluate import MEMORY_RTOL
from hloplan.solver.liveness import sweep
from hloplan.solver.problem import ShardingProblem, Solution

__all__ = ["Group", "Launch", "Memory", "Model", "ModelInfeasible", "compile_model"]

_SEPARABLE_TOL = 1e-12  # relative to the largest entry of a cost matrix


@dataclass(frozen=True)
class Group:
    """Nodes that take one decision together (a tie group, or a single node)."""

    nodes: tuple[int, ...]
    size: int

    @property
    def rep(self) -> int:
        """The first member's node index; names the solver variables deterministically."""
        return self.nodes[0]


class Memory:
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
        constant = 0.0
        nodes = problem.nodes
        transients: dict[int, np.ndarray] = {}  # id(strategies) -> transient bytes
        accumulators: dict[int, np.ndarray] = {}  # id(strategies) -> loop accumulator bytes
        for point in sweep(problem, copies=False):
            p = point.point
            changed: dict[int, np.ndarray] = {}
            for sign, moved, kind, cache in (
                    (1.0, point.entering, "memory", vectors),
                    (-1.0, point.leaving, "memory", vectors),
                    (1.0, point.transient_in, "transient", transients),
                    (-1.0, point.transient_out, "transient", transients),
                    (1.0, point.accumulating_in, "accumulators", accumulators),
                    (-1.0, point.accumulating_out, "accumulators", accumulators)):
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

    def restricted(self, allowed: Sequence[np.ndarray]) -> Memory:
        """This memory with group g limited to the strategies `allowed[g]`."""
        out = object.__new__(Memory)
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

    def subset(self, kept: Sequence[int]) -> Memory:
        """This memory over the groups `kept` only (index r: group kept[r]); the others' bytes
        are left out, which is exact at the points where they are the same under every
        strategy (`reduce.eliminate` drops only such groups from the binding points)."""
        out = object.__new__(Memory)
        out.count = self.count
        out.sizes = [self.sizes[g] for g in kept]
        out.constant = self.constant
        out.at = [self.at[g] for g in kept]
        out.vectors = [self.vectors[g] for g in kept]
        out._extremes()
        return out

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

    def groups_at(self, points: Sequence[int]) -> set[int]:
        """The groups with a coefficient in some of the given points' rows (the keys `rows`
        would give them), found without building the rows."""
        wanted = np.array(sorted(set(points)), dtype=np.int64)
        out: set[int] = set()
        for g, live in enumerate(self.live):
            latest = self._latest(g, wanted)
            latest = latest[latest >= 0]
            if len(latest) and live[latest].any():
                out.add(g)
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
class Launch:
    """A launch in group terms: paid when some group in `members` picks one of its indices
    there. Several nodes of one group pick one index, so their indices are united."""

    cost: float
    members: dict[int, np.ndarray]

    def paid(self, choice: Sequence[int]) -> bool:
        return any(choice[g] in picks for g, picks in self.members.items())

    def restricted(self, groups: list[Group], allowed: Sequence[np.ndarray]
                   ) -> tuple[Launch | None, bool]:
        """This launch with group g limited to `allowed[g]` (index i of the result paying when
        allowed[g][i] did), and whether every remaining choice pays it (then it is a
        constant). (None, False): no choice can pay it."""
        kept = {g: np.flatnonzero(np.isin(allowed[g], picks)) for g, picks in self.members.items()}
        kept = {g: picks for g, picks in kept.items() if len(picks)}
        if any(len(picks) == groups[g].size for g, picks in kept.items()):
            return None, True
        return (Launch(self.cost, kept) if kept else None), False


@dataclass
class Model:
    groups: list[Group]
    group_of: list[int]  # per node: its group, or -1 for a single-strategy (constant) node
    linear: list[np.ndarray]  # per group and strategy, seconds
    pairs: dict[tuple[int, int], np.ndarray]  # (a, b) with a < b: matrix[i_a][j_b], seconds
    constant: float  # seconds that no decision changes
    memory: Memory | None = None
    # Launches (problem.launches) whose payment depends on the choice.
    launches: list[Launch] = field(default_factory=list)

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

    def restrict(self, allowed: Sequence[np.ndarray]) -> Model:
        """This model with group g limited to the strategies `allowed[g]` (indices, in order);
        index i of the result is strategy allowed[g][i] of this model."""
        groups = [Group(g.nodes, len(keep)) for g, keep in zip(self.groups, allowed, strict=True)]
        restricted = Model(groups, self.group_of,
                           [costs[keep] for costs, keep in zip(self.linear, allowed, strict=True)],
                           {(a, b): matrix[np.ix_(allowed[a], allowed[b])]
                            for (a, b), matrix in self.pairs.items()},
                           self.constant)
        for launch in self.launches:
            kept, always = launch.restricted(groups, allowed)
            if always:
                restricted.constant += launch.cost
            elif kept is not None:
                restricted.launches.append(kept)
        _fold_separable(restricted)
        restricted.memory = self.memory.restricted(allowed)
        return restricted

    def launch_costs(self, choice: Sequence[int]) -> float:
        """Seconds of the launches `choice` (one index per group) pays."""
        return sum(launch.cost for launch in self.launches if launch.paid(choice))

    def objective(self, choice: Sequence[int]) -> float:
        """Seconds for one index per group."""
        total = self.constant + sum(float(self.linear[g][i]) for g, i in enumerate(choice))
        for (a, b), matrix in self.pairs.items():
            total += float(matrix[choice[a], choice[b]])
        return total + self.launch_costs(choice)

    def binding_points(self, budget: float) -> list[int]:
        """Points that some choice could push over the budget (the others need no constraint)."""
        if math.isinf(budget):
            return []
        limit = budget + MEMORY_RTOL * abs(budget)
        return [int(p) for p in np.flatnonzero(self.memory.max_load > limit)]

    def fits(self, budget: float, choice: Sequence[int]) -> bool:
        """Whether one index per group keeps every live point within the budget."""
        if not self.memory.count or math.isinf(budget):
            return True
        limit = budget + MEMORY_RTOL * abs(budget)
        return bool((self.memory.choice_loads(choice) <= limit).all())

    def neighbours(self) -> list[list[tuple[int, np.ndarray, bool]]]:
        """Per group: (other group, pair matrix, whether this group indexes its rows)."""
        out: list[list[tuple[int, np.ndarray, bool]]] = [[] for _ in self.groups]
        for (a, b), matrix in self.pairs.items():
            out[a].append((b, matrix, True))
            out[b].append((a, matrix, False))
        return out

    def local_costs(self, neighbours, g: int, choice: Sequence[int]) -> np.ndarray:
        """Seconds of each strategy of group g, the other groups' choices held fixed
        (`neighbours`: `self.neighbours()`)."""
        cost = self.linear[g].copy()
        for other, matrix, forward in neighbours[g]:
            cost += matrix[:, choice[other]] if forward else matrix[choice[other], :]
        return cost


def _group_nodes(problem: ShardingProblem) -> tuple[list[Group], list[int]]:
    """Decision groups in order of their first node, and each node's group (-1: constant)."""
    members: dict[object, list[int]] = {}
    for index, node in enumerate(problem.nodes):
        key = ("tie", node.tie) if node.tie is not None else ("node", index)
        members.setdefault(key, []).append(index)
    groups: list[Group] = []
    group_of = [-1] * len(problem.nodes)
    for nodes in members.values():
        size = len(problem.nodes[nodes[0]].strategies)
        if size == 1:
            continue
        for index in nodes:
            group_of[index] = len(groups)
        groups.append(Group(tuple(nodes), size))
    return groups, group_of


def separable(matrix: np.ndarray) -> bool:
    """Whether matrix[i][j] == row[i] + col[j] for some vectors (then it is two linear terms)."""
    scale = float(np.abs(matrix).max()) if matrix.size else 0.0
    tol = _SEPARABLE_TOL * max(scale, 1e-300)
    rebuilt = matrix[:, :1] + matrix[:1, :] - matrix[0, 0]
    return bool((np.abs(matrix - rebuilt) <= tol).all())


def _add_edges(problem: ShardingProblem, model: Model) -> None:
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


def _fold_separable(model: Model) -> None:
    """Pairs whose matrix is separable become linear terms."""
    for (a, b), matrix in list(model.pairs.items()):
        if separable(matrix):  # includes the all-zero matrix
            model.linear[a] += matrix[:, 0] - matrix[0, 0]
            model.linear[b] += matrix[0]
            del model.pairs[(a, b)]


def compile_model(problem: ShardingProblem) -> Model:
    """The compiled model of `problem` (which `problem.validate()` accepts)."""
    groups, group_of = _group_nodes(problem)
    model = Model(groups, group_of, [np.zeros(g.size) for g in groups], {}, 0.0)
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
    model.memory = Memory(problem, group_of, [g.size for g in groups])
    return model


def _add_launches(problem: ShardingProblem, model: Model) -> None:
    """Each launch in group terms (`Launch`); a launch some node pays under every choice (a
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
        kept, forced = Launch(launch.cost, {g: np.array(sorted(p)) for g, p
                                             in sorted(members.items())}).restricted(
            model.groups, everything)
        if always or forced:
            model.constant += launch.cost
        elif kept is not None:
            model.launches.append(kept)



class ModelInfeasible(Exception):
    """The compiled model has no choice that fits the budget."""

