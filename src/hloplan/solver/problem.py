"""The sharding problem as plain data.

Independent of MLIR and of PuLP: the ILP builder (`ilp.py`), the evaluator that recomputes a
solution's cost (`evaluate.py`) and the explainer (`explain.py`) all read this.

A node is one decision: which strategy to use for one value (or a group of values tied together,
e.g. an elementwise op that follows its producer). An edge carries the cost of resharding the
source node's output into the layout the destination node's strategy expects. Memory is checked at
program points: the sum, over the nodes live there, of the chosen strategy's per-device bytes, plus
bytes that no decision changes, must stay under the budget. A node is live at a point when the
point lists it, or when one of the problem's live ranges covers the point: a program's values
live from their definition to their last use, so the builder lists each node once, as the run of
consecutive points where it is live, and the memory checks stay linear in the program's size
(listing every live node at every point grows with depth squared: 70M entries for a 96-layer
GPT-3). A launch is a cost paid once when any of several nodes picks one of its strategies:
the first buffer of collectives that XLA merges across ops.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

# The liveness rules (made points, copy spans) live in liveness.py; they are re-exported here
# for the passes that build problems.
from hloplan.solver.liveness import copy_spans, first_live_points  # noqa: F401


@dataclass(frozen=True)
class Strategy:
    """One way to compute a node, with its costs in seconds and its output bytes per device."""

    name: str
    compute_cost: float = 0.0
    communication_cost: float = 0.0
    memory: float = 0.0
    # Collectives this strategy itself issues: (kind, mesh-axes label, bytes per device).
    collectives: tuple[tuple[str, str, float], ...] = ()
    # Optional, per mesh axis: a hashable description of what the strategy does with the axis
    # (strategies.axis_roles). Lets the solver plan meshes of many axes on smaller views.
    axes: tuple = ()
    # Bytes per device held only as the node's values are made: at its first live point
    # (liveness.first_live_points; partial sums at full size before their reduce-scatter
    # shrinks them).
    transient: float = 0.0
    # Bytes of a collective-matmul loop's accumulators (0: the strategy does not loop; see
    # liveness.py for when libtpu holds them).
    accumulators: float = 0.0

    @property
    def cost(self) -> float:
        return self.compute_cost + self.communication_cost

    def plus_transient(self, extra: float) -> Strategy:
        """This strategy holding `extra` more transient bytes: `dataclasses.replace` without
        its per-call field introspection (millions of calls on a 96-layer GPT-3's copies)."""
        if not extra:
            return self
        out = object.__new__(Strategy)
        out.__dict__.update(self.__dict__)
        object.__setattr__(out, "transient", self.transient + extra)
        return out


@dataclass(frozen=True)
class Node:
    name: str
    strategies: tuple[Strategy, ...]
    # Human-readable provenance (op names, source locations) for explain.
    members: tuple[str, ...] = ()
    # Nodes sharing a non-None tie id must choose the same strategy index (repeated layers).
    tie: int | None = None


@dataclass(frozen=True)
class Edge:
    src: int
    dst: int
    # costs[i][j]: seconds to reshard src's output under strategy i for dst's strategy j.
    costs: tuple[tuple[float, ...], ...]
    label: str = ""
    # copies[j]: bytes per device of the resharded copy dst's strategy j reads, made where
    # costs[i][j] > 0 and held while dst runs (an all-gathered operand). Empty: not counted.
    copies: tuple[float, ...] = ()
    # relayout[i][j]: bytes per device held with that resharded copy besides it: a second copy
    # dst's strategy j makes of it in another order of dims (TPU: a gather reads its table
    # row-major; a table all-gathered from a layout with its rows minor is copied), or what
    # the reshard makes the value again from (TPU: tpu_buffers.recomputed_sources). Empty: none.
    relayout: tuple[tuple[float, ...], ...] = ()
    # (first, last): the live points holding the copy. XLA reshards a value once per layout
    # for all the matmuls of a region reading it (the forward and backward matmuls of an
    # FSDP-stored weight share one all-gather) and keeps the copy until the last of them
    # reads it. None: dst's first live point only (liveness.copy_spans).
    held: tuple[int, int] | None = None
    # Live points inside `held` where the copy is not held: the compiler runs the ops of those
    # points after the copy's last reader (liveness.held_runs). Empty: held over all of `held`.
    released: tuple[int, ...] = ()
    # loop_copy[j]: bytes of dst's strategy j's transient that are a collective-matmul loop's
    # copy of this edge's value in j's layout (strategies.collective_matmul_copy_bytes). Where
    # the value reaches dst as a resharded copy held at dst's made point, the loop reads that
    # copy and makes none of its own (evaluate.reused_loop_copies). Empty: none.
    loop_copy: tuple[float, ...] = ()
    # carried[j]: bytes per device dst's strategy j holds of this edge's value over `held`
    # whether or not it reshards it: a collective-matmul loop's buffer of a value every
    # other reader recomputes, written where the value is first read (build_sharding_problem
    # `_hold_carried_copies`). Empty: none.
    carried: tuple[float, ...] = ()
    # The edge whose copy dst reads where this one reshards nothing: a read that shares the
    # previous matmul's reshard of the value (src is that matmul). None: no such edge.
    via: int | None = None


@dataclass(frozen=True)
class LivePoint:
    """A program point where memory is checked."""

    nodes: tuple[int, ...]
    fixed_bytes: float = 0.0
    label: str = ""


@dataclass(frozen=True)
class LiveRange:
    """A node live at every live point from `first` to `last` (indices, inclusive)."""

    node: int
    first: int
    last: int
    # Whether the node's values are made at a checked point (it holds its transient bytes
    # there); False once that point was dropped (with_live_points).
    made: bool = True
    # The point where they are made, when later than `first`: an output's buffer is held
    # from the program's start (XLA allocates it for the whole run). None: `first`.
    made_at: int | None = None

    @property
    def made_point(self) -> int:
        return self.first if self.made_at is None else self.made_at


@dataclass(frozen=True)
class Launch:
    """A collective that XLA merges across the ops issuing it, so a plan pays its launch once.

    XLA's combiners merge independent collectives of one kind over the same devices (the
    gradient all-reduces of a step) into buffers; the strategies that issue one price only
    their share of the buffers' latency, and this launch is the latency of the first buffer,
    paid once by any plan that picks at least one member: `members` lists (node index,
    strategy indices that issue the collective).
    """

    label: str  # e.g. "reduce-scatter(x)"
    cost: float  # seconds
    members: tuple[tuple[int, tuple[int, ...]], ...]

    def active(self, choice: Sequence[int]) -> bool:
        """Whether a plan choosing `choice` (a strategy index per node) pays this launch."""
        return any(choice[node] in picks for node, picks in self.members)


@dataclass(frozen=True)
class ShardingProblem:
    nodes: tuple[Node, ...]
    edges: tuple[Edge, ...] = ()
    live_points: tuple[LivePoint, ...] = ()
    memory_budget: float = float("inf")
    name: str = "problem"
    # Nodes live over runs of consecutive points, each listed once here instead of in every
    # point's `nodes` (a node has at most one range, and no point it covers lists it).
    live_ranges: tuple[LiveRange, ...] = ()
    launches: tuple[Launch, ...] = ()
    # (node, point) of each node none of whose values is written out (XLA computes them
    # inside their readers' kernels, or writes them into a donated argument's buffer): it
    # holds no results, but is made at that point, where it holds its transient bytes and
    # the copies it reads (liveness.first_live_points). A node has no range and is listed
    # at no point besides.
    made_only: tuple[tuple[int, int], ...] = ()

    def nodes_at(self, point: int) -> tuple[int, ...]:
        """The nodes live at one point, sorted, each once (time linear in the ranges)."""
        live = set(self.live_points[point].nodes)
        live.update(r.node for r in self.live_ranges if r.first <= point <= r.last)
        return tuple(sorted(live))

    def with_live_points(self, kept: list[int]) -> ShardingProblem:
        """This problem checking memory only at the points `kept` (increasing indices)."""
        import bisect

        ranges = []
        for r in self.live_ranges:
            first = bisect.bisect_left(kept, r.first)
            last = bisect.bisect_right(kept, r.last) - 1
            if first <= last:
                made = bisect.bisect_left(kept, r.made_point)
                made_here = r.made and made < len(kept) and kept[made] == r.made_point
                ranges.append(LiveRange(r.node, first, last, made_here,
                                        made if made_here and made != first else None))
        # Copies keep their spans over the kept points; one no kept point holds is dropped.
        edges = list(self.edges)
        index_of = {p: k for k, p in enumerate(kept)}
        for e, start, end in copy_spans(self):
            first = bisect.bisect_left(kept, start)
            last = bisect.bisect_right(kept, end) - 1
            released = tuple(index_of[p] for p in edges[e].released if p in index_of)
            edges[e] = (replace(edges[e], held=(first, last), released=released)
                        if first <= last else replace(edges[e], copies=(), held=None,
                                                      released=()))
        # A node made at a dropped point is made at no checked point (as a range's made).
        made_only = tuple((node, index_of[p]) for node, p in self.made_only if p in index_of)
        return replace(self, edges=tuple(edges),
                       live_points=tuple(self.live_points[p] for p in kept),
                       live_ranges=tuple(ranges), made_only=made_only)

    def points_of_nodes(self) -> list[list[int] | range]:
        """Per node, the points where it is live, in increasing order."""
        out: list[list[int] | range] = [[] for _ in self.nodes]
        for p, point in enumerate(self.live_points):
            for node in dict.fromkeys(point.nodes):
                out[node].append(p)
        for r in self.live_ranges:
            out[r.node] = range(r.first, r.last + 1)
        return out

    def validate(self) -> None:
        """Raise ValueError on a malformed problem (sizes that do not agree)."""
        for index, node in enumerate(self.nodes):
            if not node.strategies:
                raise ValueError(f"node {index} ({node.name}) has no strategy")
        checked: set = set()  # (id of a cost matrix, rows, cols): edges share matrices
        for edge in self.edges:
            for end in (edge.src, edge.dst):
                if not 0 <= end < len(self.nodes):
                    raise ValueError(f"edge {edge.label!r} refers to node {end}")
            rows = len(self.nodes[edge.src].strategies)
            cols = len(self.nodes[edge.dst].strategies)
            key = (id(edge.costs), rows, cols)
            if key in checked:
                continue
            if len(edge.costs) != rows or any(len(row) != cols for row in edge.costs):
                raise ValueError(f"edge {edge.src}->{edge.dst} cost matrix is not {rows}x{cols}")
            checked.add(key)
        ties: dict[int, int] = {}
        for node in self.nodes:
            if node.tie is not None:
                count = ties.setdefault(node.tie, len(node.strategies))
                if count != len(node.strategies):
                    raise ValueError(f"tie group {node.tie} mixes strategy counts")
        for point in self.live_points:
            if point.nodes and not (0 <= min(point.nodes) and max(point.nodes) < len(self.nodes)):
                index = next(i for i in point.nodes if not 0 <= i < len(self.nodes))
                raise ValueError(f"live point {point.label!r} refers to node {index}")
        for launch in self.launches:
            if not launch.cost >= 0:
                raise ValueError(f"launch {launch.label!r} costs {launch.cost}")
            for index, picks in launch.members:
                if not 0 <= index < len(self.nodes):
                    raise ValueError(f"launch {launch.label!r} refers to node {index}")
                size = len(self.nodes[index].strategies)
                if not picks or not all(0 <= pick < size for pick in picks):
                    raise ValueError(f"launch {launch.label!r}: node {index} has {size} "
                                     f"strategies, not {picks}")
        for edge in self.edges:
            if edge.held is not None and not 0 <= edge.held[0] <= edge.held[1] < len(
                    self.live_points):
                raise ValueError(f"edge {edge.label!r} holds its copy over {edge.held}, not "
                                 f"within the {len(self.live_points)} live points")
            if edge.released and (edge.held is None or not all(
                    edge.held[0] <= p <= edge.held[1] for p in edge.released)):
                raise ValueError(f"edge {edge.label!r} releases its copy at {edge.released}, "
                                 f"not within its span {edge.held}")
        ranged: dict[int, LiveRange] = {}
        for r in self.live_ranges:
            if not 0 <= r.node < len(self.nodes):
                raise ValueError(f"live range {r} refers to node {r.node}")
            if not 0 <= r.first <= r.last < len(self.live_points):
                raise ValueError(f"live range {r} is not within the {len(self.live_points)} "
                                 "live points")
            if not r.first <= r.made_point <= r.last:
                raise ValueError(f"live range {r} is made outside itself")
            if ranged.setdefault(r.node, r) is not r:
                raise ValueError(f"node {r.node} has two live ranges")
        for node, p in self.made_only:
            if not 0 <= node < len(self.nodes) or not 0 <= p < len(self.live_points):
                raise ValueError(f"node {node} is made at point {p}, not within the "
                                 f"{len(self.nodes)} nodes and {len(self.live_points)} points")
            if node in ranged:
                raise ValueError(f"node {node} is made at point {p} and has a live range")
        if ranged:
            for p, point in enumerate(self.live_points):
                for index in point.nodes:
                    r = ranged.get(index)
                    if r is not None and r.first <= p <= r.last:
                        raise ValueError(f"live point {point.label!r} lists node {index}, "
                                         f"which its live range {r} covers already")


@dataclass(frozen=True)
class Solution:
    """A strategy index per node."""

    choice: tuple[int, ...]


@dataclass(frozen=True)
class SolveStats:
    solver: str
    status: str  # "optimal", "time_limit" (feasible, not proven), "infeasible", ...
    objective: float
    bound: float
    gap: float
    seconds: float
    variables: int
    constraints: int
    extra: dict = field(default_factory=dict)
