"""Recompute what a solution costs, without any solver.

The ILP reports an objective, but that number passes through scaling, solver tolerances and the
linearisation of edges; `evaluate` is the independent arithmetic that tests, the explainer and the
CLI trust. It reads only the plain-data problem and a strategy index per node.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Integral

import numpy as np

from hloplan.solver.liveness import Liveness
from hloplan.solver.problem import ShardingProblem, Solution
from hloplan.units import format_bytes

__all__ = ["MEMORY_RTOL", "Evaluation", "evaluate", "live_point_bytes", "memory_fits"]

# Relative slack on the memory budget: sums of float byte counts taken in a different order (here
# and inside the solver) may differ in the last bits; a solution that sits exactly on the budget must
# not flip to "infeasible" because of that.
MEMORY_RTOL = 1e-9
_EXACT = 2.0**52  # whole numbers of bytes below this add up exactly in float64


@dataclass(frozen=True)
class Evaluation:
    """The cost and memory of one solution; all times in seconds, memory in bytes per device."""

    compute: float
    # The chosen strategies' communication plus the merged collectives' launches below.
    communication: float
    resharding: float
    total: float
    # Bytes at each live point, in the order of `problem.live_points`.
    memory: tuple[float, ...]
    peak_memory: float
    # Index of the live point with the largest footprint; None when the problem has none.
    peak_point: int | None
    budget: float
    feasible: bool
    violations: tuple[str, ...]
    # Per node: (compute, communication, resharding into the node). An edge's cost is charged to
    # its destination, so the third column sums to `resharding`.
    per_node: tuple[tuple[float, float, float], ...]
    # The launches (problem.launches) this solution pays: (label, seconds), in problem order.
    launches: tuple[tuple[str, float], ...] = ()


def memory_fits(used: float, budget: float) -> bool:
    """Whether `used` bytes fit in `budget`, allowing for float summation noise."""
    return used <= budget + MEMORY_RTOL * abs(budget)


def _check_solution(problem: ShardingProblem, solution: Solution) -> None:
    """Raise ValueError when `solution` cannot be a choice for `problem`."""
    if len(solution.choice) != len(problem.nodes):
        raise ValueError(
            f"solution has {len(solution.choice)} choices for {len(problem.nodes)} nodes"
        )
    for index, (node, pick) in enumerate(zip(problem.nodes, solution.choice, strict=True)):
        if not isinstance(pick, Integral) or not 0 <= pick < len(node.strategies):
            raise ValueError(
                f"node {index} ({node.name}) has {len(node.strategies)} strategies; "
                f"the solution picks {pick!r}"
            )


def copy_bytes(edge, i: int, j: int) -> float:
    """Bytes of the resharded copy `edge`'s destination reads under strategies i (source) and
    j (destination), held over the edge's span (copy_spans); 0 when no reshard."""
    carried = edge.carried[j] if edge.carried else 0.0
    if not edge.copies or edge.costs[i][j] <= 0:
        return carried
    return carried + edge.copies[j] + (edge.relayout[i][j] if edge.relayout else 0.0)


def copy_delta(edge, choice, moved, k: int) -> float:
    """Change in `edge`'s resharded-copy bytes when the nodes in `moved` switch to strategy k
    and the others keep `choice`."""
    i, j = choice[edge.src], choice[edge.dst]
    return (copy_bytes(edge, k if edge.src in moved else i, k if edge.dst in moved else j)
            - copy_bytes(edge, i, j))


def reads_loop_copy(problem: ShardingProblem, e: int, pick, at: int,
                    spans: dict[int, tuple[int, int]]) -> bool:
    """Whether edge `e`'s destination reads its value as a resharded copy held at point `at`,
    with strategies `pick(node)`: the edge reshards it (a copy over a span covering `at`), or
    reshards nothing and shares the copy of the edge it reads through (Edge.via)."""
    seen = set()
    while e is not None and e not in seen:
        seen.add(e)
        edge = problem.edges[e]
        i, j = pick(edge.src), pick(edge.dst)
        if edge.costs[i][j] > 0:
            span = spans.get(e)
            # the copy itself, whatever its relayout bytes (which can credit a source back)
            return (bool(edge.copies) and edge.copies[j] > 0 and span is not None
                    and span[0] <= at <= span[1])
        e = edge.via
    return False


def loop_copy_edges(problem: ShardingProblem) -> list[tuple[int, frozenset[int]]]:
    """(edge, the nodes its reads_loop_copy test depends on) of every edge with Edge.loop_copy."""
    out = []
    for e, edge in enumerate(problem.edges):
        if not edge.loop_copy:
            continue
        nodes, seen, chain = set(), set(), e
        while chain is not None and chain not in seen:
            seen.add(chain)
            nodes.update((problem.edges[chain].src, problem.edges[chain].dst))
            chain = problem.edges[chain].via
        out.append((e, frozenset(nodes)))
    return out


def reused_loop_copies(problem: ShardingProblem, pick, made: dict[int, int],
                       spans: dict[int, tuple[int, int]],
                       edges: list[tuple[int, frozenset[int]]] | None = None
                       ) -> dict[int, float]:
    """Per node, the transient bytes its collective-matmul loop does not hold under strategies
    `pick(node)`: its copy of an operand that reaches it as a resharded copy, held at the
    loop's made point (Edge.loop_copy); libtpu's loop reads that copy."""
    out: dict[int, float] = {}
    for e, _ in loop_copy_edges(problem) if edges is None else edges:
        edge = problem.edges[e]
        nbytes = edge.loop_copy[pick(edge.dst)]
        at = made.get(edge.dst)
        if nbytes and at is not None and reads_loop_copy(problem, e, pick, at, spans):
            out[edge.dst] = out.get(edge.dst, 0.0) + nbytes
    return out


def reused_loop_copy_changes(problem: ShardingProblem, base: dict[int, float], moved,
                             made: dict[int, int], spans: dict[int, tuple[int, int]],
                             edges: list[tuple[int, frozenset[int]]]) -> dict[int, float]:
    """Per loop node, how many more transient bytes it holds under strategies `moved(node)`
    than where it reuses `base` (reused_loop_copies over `edges` of the current strategies):
    loop copies it reads resharded under one and not the other."""
    after = reused_loop_copies(problem, moved, made, spans, edges)
    return {n: base.get(n, 0.0) - after.get(n, 0.0) for n in base.keys() | after.keys()}


def live_point_bytes(problem: ShardingProblem, solution: Solution, copies: bool = True
                     ) -> tuple[float, ...]:
    """Bytes at each live point: its fixed bytes plus what the liveness rules (liveness.py)
    hold there under the chosen strategies: results, transient bytes where values are made,
    loop accumulators, and with `copies` the resharded copies over their spans (the ILP's
    model leaves those out, see passes/solve_sharding.py).

    A node listed twice at one point is counted once: a value is either live there or not.
    """
    picked = [node.strategies[pick] for node, pick in zip(problem.nodes, solution.choice)]
    memory = [s.memory for s in picked]
    transient = [s.transient for s in picked]
    accumulators = [s.accumulators for s in picked]
    liveness = Liveness(problem, copies)
    if copies:  # a loop reading a resharded operand holds no copy of its own
        for n, reused in reused_loop_copies(problem, solution.choice.__getitem__,
                                            liveness.made, liveness.span_of).items():
            transient[n] -= reused
    copied = {}
    for e, _, _ in liveness.spans:
        edge = problem.edges[e]
        copied[e] = copy_bytes(edge, solution.choice[edge.src], solution.choice[edge.dst])
    values = np.array([*memory, *transient, *accumulators, *copied.values(),
                       *(p.fixed_bytes for p in problem.live_points)], dtype=float)
    exact = bool((np.floor(values) == values).all() and (np.abs(values) < _EXACT).all())
    # What each point holds, walked from the sweep's events (consecutive points share most of
    # their values): whole bytes add up exactly in any order, so a running sum is exact;
    # other bytes are summed afresh at each point.
    totals = []
    if exact:
        running = 0.0
        for events in liveness.sweep():
            for i in events.entering:
                running += memory[i]
            for i in events.leaving:
                running -= memory[i]
            for i in events.transient_in:
                running += transient[i]
            for i in events.transient_out:
                running -= transient[i]
            for i in events.accumulating_in:
                running += accumulators[i]
            for i in events.accumulating_out:
                running -= accumulators[i]
            for e in events.copies_in:
                running += copied[e]
            for e in events.copies_out:
                running -= copied[e]
            totals.append(events.fixed_bytes + running)
        return tuple(totals)
    held: dict[tuple[int, int], int] = {}  # (kind, index) -> count; kinds index `sizes`
    sizes = (memory, transient, copied, accumulators)
    for events in liveness.sweep():
        for sign, moved, kind in ((1, events.entering, 0), (-1, events.leaving, 0),
                                  (1, events.transient_in, 1), (-1, events.transient_out, 1),
                                  (1, events.copies_in, 2), (-1, events.copies_out, 2),
                                  (1, events.accumulating_in, 3),
                                  (-1, events.accumulating_out, 3)):
            for index in moved:
                count = held.get((kind, index), 0) + sign
                if count:
                    held[kind, index] = count
                else:
                    del held[kind, index]
        totals.append(math.fsum([events.fixed_bytes, *(sizes[k][i] for k, i in held)]))
    return tuple(totals)


@dataclass(frozen=True)
class Held:
    """One thing a live point holds under a solution: a node's results ("result"), a node's
    transient bytes where its values are made ("made"), a node's loop accumulators
    ("accumulators"), or the resharded copy an edge's destination reads ("copy"; `index` is
    then the edge's)."""

    kind: str
    index: int
    bytes: float


def point_contents(problem: ShardingProblem, solution: Solution, point: int) -> list[Held]:
    """What live point `point` holds under `solution`, largest first (ties by kind, index):
    with the point's fixed bytes, these add up to live_point_bytes at that point."""
    picked = [node.strategies[pick] for node, pick in zip(problem.nodes, solution.choice)]
    held = [Held("result", n, picked[n].memory) for n in problem.nodes_at(point)]
    liveness = Liveness(problem)
    reused = reused_loop_copies(problem, solution.choice.__getitem__, liveness.made,
                                liveness.span_of)
    held += [Held("made", n, picked[n].transient - reused.get(n, 0.0))
             for n, made in liveness.made.items() if made == point and picked[n].transient]
    held += [Held("accumulators", n, picked[n].accumulators)
             for n, start, end in liveness.accumulators if start <= point <= end]
    for e, start, end in liveness.runs:
        edge = problem.edges[e]
        made = copy_bytes(edge, solution.choice[edge.src], solution.choice[edge.dst])
        if start <= point <= end and made:
            held.append(Held("copy", e, made))
    return sorted((h for h in held if h.bytes), key=lambda h: (-h.bytes, h.kind, h.index))


def _tie_violations(problem: ShardingProblem, solution: Solution) -> list[str]:
    """One message per tie group whose members do not all pick the same strategy index."""
    groups: dict[int, list[int]] = {}
    for index, node in enumerate(problem.nodes):
        if node.tie is not None:
            groups.setdefault(node.tie, []).append(index)
    messages = []
    for tie, members in groups.items():
        picks = {solution.choice[index] for index in members}
        if len(picks) > 1:
            named = ", ".join(
                f"{problem.nodes[i].name}={problem.nodes[i].strategies[solution.choice[i]].name!r}"
                for i in members
            )
            messages.append(f"tie group {tie} must pick one strategy but picks: {named}")
    return messages


def _memory_violations(problem: ShardingProblem, memory: tuple[float, ...]) -> list[str]:
    """One message per live point over the budget."""
    messages = []
    for index, (point, used) in enumerate(zip(problem.live_points, memory, strict=True)):
        if not memory_fits(used, problem.memory_budget):
            label = point.label or f"#{index}"
            messages.append(
                f"live point {label} needs {format_bytes(used)} "
                f"> {format_bytes(problem.memory_budget)} budget "
                f"(over by {format_bytes(used - problem.memory_budget)})"
            )
    return messages


def evaluate(problem: ShardingProblem, solution: Solution, copies: bool = True) -> Evaluation:
    """Cost, memory and feasibility of `solution`, by plain arithmetic.

    Raises ValueError when the solution has the wrong length or picks a strategy that does not
    exist. Infeasibility (memory over budget, broken ties) is reported, not raised, so that callers
    can show how far off a candidate is.
    """
    _check_solution(problem, solution)
    chosen = [
        node.strategies[pick] for node, pick in zip(problem.nodes, solution.choice, strict=True)
    ]
    resharding_in = [0.0] * len(problem.nodes)
    for edge in problem.edges:
        resharding_in[edge.dst] += edge.costs[solution.choice[edge.src]][solution.choice[edge.dst]]
    per_node = tuple(
        (strategy.compute_cost, strategy.communication_cost, resharding_in[index])
        for index, strategy in enumerate(chosen)
    )
    compute = sum(s.compute_cost for s in chosen)
    launches = tuple((launch.label, launch.cost) for launch in problem.launches
                     if launch.active(solution.choice))
    communication = sum(s.communication_cost for s in chosen) + sum(c for _, c in launches)
    resharding = sum(resharding_in)
    memory = live_point_bytes(problem, solution, copies)
    peak_point = max(range(len(memory)), key=memory.__getitem__) if memory else None
    peak = memory[peak_point] if peak_point is not None else 0.0
    violations = _memory_violations(problem, memory) + _tie_violations(problem, solution)
    return Evaluation(
        compute=compute,
        communication=communication,
        resharding=resharding,
        total=compute + communication + resharding,
        memory=memory,
        peak_memory=peak,
        peak_point=peak_point,
        budget=problem.memory_budget,
        feasible=not violations,
        violations=tuple(violations),
        per_node=per_node,
        launches=launches,
    )
