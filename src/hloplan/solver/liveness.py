"""One sweep over a problem's live points: what each point holds, as changes from the previous.

The memory rules of a `ShardingProblem`, defined here and nowhere else:

- results: a node's values are live at the points that list it and over its live range
  (`LiveRange`); a node listed twice at one point counts once.
- transient bytes: a node holds its strategy's `transient` bytes at the point where its values
  are made only (`first_live_points`: the first point that lists it, or its range's made point,
  or for a node that holds no results its `ShardingProblem.made_only` point; none when that
  point is no longer checked), gone at the next.
- resharded copies: the copy an edge's reader needs (`Edge.copies`) is held over the edge's span
  (`copy_spans`: `Edge.held`, or the reader's made point), less the points it releases
  (`Edge.released`; `held_runs`).
- loop accumulators: a node holds its strategy's `accumulators` bytes (a collective-matmul
  loop's) from the made point of the first node that can loop to its own made point
  (`accumulator_spans`): libtpu allocates every loop's accumulators before the first loop
  runs (on the Llama-8B-class step on v5e:16x16, its 194 `AllocateBuffer`s after the output
  head's forward matmul, before the head's weight-gradient loop; on an MLP on v5e:2x4, all
  six at the program's start), each live until its loop ends.

`sweep(problem)` walks the points in order and yields, per point, which nodes' results join and
leave, whose transient bytes start and stop, and which copies start and stop being held.
Consecutive points share most of their live values, so the events are few: every consumer (the
ILP's memory rows, the evaluator, layer tying's dominance test, the decision index, the
infeasibility report) runs in time linear in the events, never points x live values.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from hloplan.solver.problem import ShardingProblem

__all__ = ["PointEvents", "accumulator_spans", "copy_spans", "first_live_points", "held_runs",
           "sweep"]


def first_live_points(problem: ShardingProblem) -> dict[int, int]:
    """Per node live somewhere, the point where its values are made: the only point where it
    holds its strategy's transient bytes."""
    first: dict[int, int] = {}
    for p, point in enumerate(problem.live_points):
        for index in point.nodes:
            first.setdefault(index, p)
    for r in problem.live_ranges:
        if r.made:
            first[r.node] = min(first.get(r.node, r.made_point), r.made_point)
        elif first.get(r.node, -1) >= r.first:  # made at a point no longer checked
            del first[r.node]
    for node, p in problem.made_only:  # no results: listed nowhere else
        first.setdefault(node, p)
    return first


def copy_spans(problem: ShardingProblem, made: dict[int, int] | None = None
               ) -> list[tuple[int, int, int]]:
    """(edge index, first, last live point) of every resharded copy an edge may make
    (Edge.copies, Edge.held; `made`: first_live_points(problem), when at hand)."""
    spans = []
    for e, edge in enumerate(problem.edges):
        if not edge.copies and not edge.carried:
            continue
        if edge.held is not None:
            spans.append((e, *edge.held))
            continue
        if made is None:
            made = first_live_points(problem)
        if edge.dst in made:
            spans.append((e, made[edge.dst], made[edge.dst]))
    return spans


def held_runs(start: int, end: int, released: tuple[int, ...]) -> list[tuple[int, int]]:
    """The runs of consecutive points from `start` to `end` (inclusive) less `released`."""
    runs, first = [], start
    for point in sorted(p for p in set(released) if start <= p <= end):
        if point > first:
            runs.append((first, point - 1))
        first = point + 1
    if first <= end:
        runs.append((first, end))
    return runs


def accumulator_spans(problem: ShardingProblem, made: dict[int, int] | None = None
                      ) -> list[tuple[int, int, int]]:
    """(node, first, last live point) of every node with a strategy that holds loop
    accumulators (Strategy.accumulators): from the first such node's made point to its own.
    The start does not depend on the plan: the first node that can loop, looped or not."""
    if made is None:
        made = first_live_points(problem)
    loops = [(point, node) for node, point in made.items()
             if any(s.accumulators for s in problem.nodes[node].strategies)]
    if not loops:
        return []
    start = min(loops)[0]
    return sorted((node, start, point) for point, node in loops)


class PointEvents(NamedTuple):
    """What changes at one live point, against the previous one (each list sorted). A named
    tuple: one is made per point, and consumers walk every point."""

    point: int
    fixed_bytes: float
    # Nodes whose results are live from this point on: those the point lists and the previous
    # one did not, then those whose live range starts here.
    entering: tuple[int, ...]
    # Nodes whose results were live up to the previous point: listed there and not here, then
    # those whose live range ended there.
    leaving: tuple[int, ...]
    # Nodes made here that hold transient bytes under some strategy: they hold them here only.
    transient_in: tuple[int, ...]
    # Nodes made at the previous point that hold transient bytes: gone from here.
    transient_out: tuple[int, ...]
    # Edges whose resharded copy (copy_spans) is held from this point on.
    copies_in: tuple[int, ...]
    # Edges whose copy was held up to the previous point.
    copies_out: tuple[int, ...]
    # Nodes whose loop accumulators (accumulator_spans) are held from this point on.
    accumulating_in: tuple[int, ...] = ()
    # Nodes whose loop accumulators were held up to the previous point.
    accumulating_out: tuple[int, ...] = ()


class Liveness:
    """The made points and copy spans of a problem, and its sweep."""

    def __init__(self, problem: ShardingProblem, copies: bool = True) -> None:
        self.problem = problem
        self.made = first_live_points(problem)
        self.spans = copy_spans(problem, self.made) if copies else []
        self.span_of = {e: (start, end) for e, start, end in self.spans}  # edge -> its span
        # (edge, first, last) of each run of points where the copy is held (its span less the
        # points it releases, Edge.released).
        self.runs = [(e, first, last) for e, start, end in self.spans
                     for first, last in held_runs(start, end, problem.edges[e].released)]
        self.accumulators = accumulator_spans(problem, self.made)

    def sweep(self) -> Iterator[PointEvents]:
        problem = self.problem
        nodes = problem.nodes

        def at(pairs) -> dict[int, tuple[int, ...]]:
            """point -> the sorted indices of the (point, index) pairs there."""
            out: dict[int, list[int]] = {}
            for point, index in pairs:
                out.setdefault(point, []).append(index)
            return {point: tuple(sorted(indices)) for point, indices in out.items()}

        enter = at((r.first, r.node) for r in problem.live_ranges)
        leave = at((r.last + 1, r.node) for r in problem.live_ranges)
        holding: dict[int, bool] = {}  # id(strategies) -> whether some has transient bytes
        flashing = []
        for index, made in self.made.items():
            strategies = nodes[index].strategies
            has = holding.get(id(strategies))
            if has is None:
                has = holding[id(strategies)] = any(s.transient for s in strategies)
            if has:
                flashing.append((made, index))
        flash_in = at(flashing)
        flash_out = at((made + 1, index) for made, index in flashing)
        copy_in = at((start, e) for e, start, _ in self.runs)
        copy_out = at((end + 1, e) for e, _, end in self.runs)
        loop_in = at((start, node) for node, start, _ in self.accumulators)
        loop_out = at((end + 1, node) for node, _, end in self.accumulators)
        previous: set[int] = set()
        empty: tuple[int, ...] = ()
        for p, point in enumerate(problem.live_points):
            entering, leaving = enter.get(p, empty), leave.get(p, empty)
            if point.nodes or previous:
                live = set(point.nodes)
                if live != previous:
                    entering = (*sorted(live - previous), *entering)
                    leaving = (*sorted(previous - live), *leaving)
                previous = live
            yield PointEvents(p, point.fixed_bytes, entering, leaving,
                              flash_in.get(p, empty), flash_out.get(p, empty),
                              copy_in.get(p, empty), copy_out.get(p, empty),
                              loop_in.get(p, empty), loop_out.get(p, empty))


def sweep(problem: ShardingProblem, copies: bool = True) -> Iterator[PointEvents]:
    """The events of every live point of `problem`, in order (`copies=False`: without the
    resharded copies, as the ILP's memory model has them)."""
    return Liveness(problem, copies).sweep()
