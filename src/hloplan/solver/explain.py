"""Say why one solution beats another, node by node, from `evaluate()` arithmetic alone.

The solver only returns indices; users ask "why not replicate this?" The answer is a list of
per-node differences in compute, communication, resharding and peak memory between the chosen
solution and an alternative, each with a sentence. Nothing here calls the solver, so an
explanation can never disagree with the costs that `evaluate()` reports.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from hloplan.solver.evaluate import (
    Evaluation,
    copy_delta,
    evaluate,
    loop_copy_edges,
    memory_fits,
    reused_loop_copies,
    reused_loop_copy_changes,
)
from hloplan.solver.liveness import Liveness
from hloplan.solver.problem import ShardingProblem, Solution, Strategy
from hloplan.units import format_bytes, format_seconds

__all__ = ["Reason", "compare", "format_bytes", "format_seconds", "next_best"]

# Differences smaller than this (seconds or bytes) are noise from float sums, not reasons.
_EPS = 1e-15


@dataclass(frozen=True)
class Reason:
    """One node where `chosen` and `alternative` differ, and what switching it would change.

    `from_strategy` is the chosen strategy, `to_strategy` the alternative's. Every delta is
    alternative minus chosen, so a positive delta is what the chosen strategy saves.
    """

    node: int
    name: str
    from_strategy: str
    to_strategy: str
    delta_compute: float
    delta_communication: float
    # Edge costs that change, charged to the edge's destination if it differs, else its source.
    delta_resharding: float
    # Peak memory if only this node switched, minus the chosen peak (bytes).
    delta_peak_memory: float
    text: str

    @property
    def delta_total(self) -> float:
        return self.delta_compute + self.delta_communication + self.delta_resharding


def _communication_label(chosen: Strategy, alternative: Strategy) -> str:
    """Name the collectives behind a communication difference, e.g. 'all-reduce'."""
    costlier = chosen if chosen.communication_cost > alternative.communication_cost else alternative
    kinds = list(dict.fromkeys(kind for kind, _, _ in costlier.collectives))
    return "/".join(kinds) if kinds else "communication"


def _cost_phrase(delta: float, label: str) -> str | None:
    if delta > _EPS:
        return f"saves {format_seconds(delta)} of {label}"
    if delta < -_EPS:
        return f"costs {format_seconds(-delta)} of {label}"
    return None


def _memory_phrase(delta: float, switched_peak: float, budget: float) -> str | None:
    if delta > _EPS:
        if not memory_fits(switched_peak, budget):
            return f"peak memory {format_bytes(switched_peak)} > {format_bytes(budget)} budget"
        return f"saves {format_bytes(delta)} of peak memory"
    if delta < -_EPS:
        return f"uses {format_bytes(-delta)} more peak memory"
    return None


def _resharding_deltas(
    problem: ShardingProblem, chosen: Solution, alternative: Solution
) -> dict[int, float]:
    """Per changed node, the change in edge costs attributed to it (sums to the total change)."""
    deltas: dict[int, float] = {}
    a, b = chosen.choice, alternative.choice
    for edge in problem.edges:
        if a[edge.src] == b[edge.src] and a[edge.dst] == b[edge.dst]:
            continue
        delta = edge.costs[b[edge.src]][b[edge.dst]] - edge.costs[a[edge.src]][a[edge.dst]]
        owner = edge.dst if a[edge.dst] != b[edge.dst] else edge.src
        deltas[owner] = deltas.get(owner, 0.0) + delta
    return deltas


def _launch_deltas(
    problem: ShardingProblem, chosen: Solution, alternative: Solution
) -> dict[int, float]:
    """Per changed node, the launches the alternative pays and the chosen solution does not
    (minus the reverse), each charged to the first member node whose choice differs."""
    deltas: dict[int, float] = {}
    a, b = chosen.choice, alternative.choice
    for launch in problem.launches:
        delta = launch.cost * (launch.active(b) - launch.active(a))
        if not delta:
            continue
        owner = next(node for node, _ in launch.members if a[node] != b[node])
        deltas[owner] = deltas.get(owner, 0.0) + delta
    return deltas


def _switched_peak(
    problem: ShardingProblem, base: Evaluation, node: int, memory_delta: float,
    transient_delta: float = 0.0, first: int | None = None,
    at_points: dict[int, float] | None = None,
) -> float:
    """Peak memory of `base` with one node's footprint changed by `memory_delta` (its
    transient bytes, at its first live point `first`, by `transient_delta`; and bytes held at
    given points, resharded copies and loop accumulators, by `at_points`)."""
    where = next((r for r in problem.live_ranges if r.node == node), None)
    at_points = at_points or {}
    loads = [
        (used + memory_delta + (transient_delta if p == first else 0.0)
         if node in point.nodes or (where is not None and where.first <= p <= where.last)
         else used) + at_points.get(p, 0.0)
        for p, (point, used) in enumerate(zip(problem.live_points, base.memory, strict=True))
    ]
    return max(loads, default=0.0)


def _copy_deltas(problem: ShardingProblem, choice: tuple[int, ...], node: int, k: int,
                 spans: dict[int, tuple[int, int]], edges_of: dict[int, list[int]]
                 ) -> dict[int, float]:
    """Change in resharded-copy bytes per live point when `node` alone switches to strategy k
    (`edges_of`: node -> indices of the edges with copies that touch it; `spans`: edge -> the
    points holding its copy)."""
    deltas: dict[int, float] = {}
    for e in edges_of.get(node, ()):
        delta = copy_delta(problem.edges[e], choice, (node,), k)
        if delta:
            start, end = spans[e]
            for p in range(start, end + 1):
                deltas[p] = deltas.get(p, 0.0) + delta
    return deltas


def _reuse_changes(problem: ShardingProblem, choice: tuple[int, ...], node: int, k: int,
                   made: dict[int, int], spans: dict[int, tuple[int, int]],
                   loop_copies: list) -> dict[int, float]:
    """Per loop node, the change in its held transient bytes when `node` alone switches to
    strategy k: loop copies it reads resharded no longer, or now does
    (evaluate.reused_loop_copies)."""
    edges = [(e, nodes) for e, nodes in loop_copies if node in nodes]
    if not edges:
        return {}
    base = reused_loop_copies(problem, choice.__getitem__, made, spans, edges)
    return reused_loop_copy_changes(problem, base, lambda n: k if n == node else choice[n],
                                    made, spans, edges)


def compare(problem: ShardingProblem, chosen: Solution, alternative: Solution) -> list[Reason]:
    """Per-node reasons why `chosen` beats `alternative`, most telling first.

    Reasons that would break the memory budget come first, then the largest cost savings.
    """
    base = evaluate(problem, chosen)
    evaluate(problem, alternative)  # validates the alternative's shape
    resharding = _resharding_deltas(problem, chosen, alternative)
    launches = _launch_deltas(problem, chosen, alternative)
    liveness = Liveness(problem)
    firsts = liveness.made
    spans = liveness.span_of
    accumulating = {n: (start, end) for n, start, end in liveness.accumulators}
    loop_copies = loop_copy_edges(problem)
    edges_of: dict[int, list[int]] = {}
    for e in spans:
        edge = problem.edges[e]
        for end in dict.fromkeys((edge.src, edge.dst)):
            edges_of.setdefault(end, []).append(e)
    reasons: list[tuple[bool, Reason]] = []
    for index, node in enumerate(problem.nodes):
        i, j = chosen.choice[index], alternative.choice[index]
        if i == j:
            continue
        mine, other = node.strategies[i], node.strategies[j]
        at_points = _copy_deltas(problem, chosen.choice, index, j, spans, edges_of)
        for n, change in _reuse_changes(problem, chosen.choice, index, j, firsts, spans,
                                        loop_copies).items():
            at_points[firsts[n]] = at_points.get(firsts[n], 0.0) + change
        if index in accumulating and other.accumulators != mine.accumulators:
            start, end = accumulating[index]
            for p in range(start, end + 1):
                at_points[p] = at_points.get(p, 0.0) + other.accumulators - mine.accumulators
        switched = _switched_peak(problem, base, index, other.memory - mine.memory,
                                  other.transient - mine.transient, firsts.get(index),
                                  at_points)
        reason = Reason(
            node=index,
            name=node.name,
            from_strategy=mine.name,
            to_strategy=other.name,
            delta_compute=other.compute_cost - mine.compute_cost,
            delta_communication=other.communication_cost - mine.communication_cost
            + launches.get(index, 0.0),
            delta_resharding=resharding.get(index, 0.0),
            delta_peak_memory=switched - base.peak_memory,
            text="",
        )
        breaks_budget = reason.delta_peak_memory > _EPS and not memory_fits(
            switched, problem.memory_budget
        )
        reason = _with_text(reason, mine, other, switched, problem.memory_budget)
        reasons.append((breaks_budget, reason))
    reasons.sort(key=lambda item: (not item[0], -item[1].delta_total, item[1].node))
    return [reason for _, reason in reasons]


def _with_text(
    reason: Reason, mine: Strategy, other: Strategy, switched_peak: float, budget: float
) -> Reason:
    costs = [
        _cost_phrase(reason.delta_compute, "compute"),
        _cost_phrase(reason.delta_communication, _communication_label(mine, other)),
        _cost_phrase(reason.delta_resharding, "resharding"),
    ]
    text = ", ".join(p for p in costs if p) or "costs the same"
    memory = _memory_phrase(reason.delta_peak_memory, switched_peak, budget)
    if memory:
        text += f"; {memory}"
    head = f"{reason.name}: {reason.from_strategy!r} instead of {reason.to_strategy!r}"
    return replace(reason, text=f"{head} {text}")


def next_best(
    problem: ShardingProblem, solution: Solution, node_index: int
) -> tuple[Solution, Evaluation] | None:
    """The best other strategy for one node, all unrelated nodes fixed, and its evaluation.

    A node in a tie group moves together with its group (moving it alone is never feasible).
    Feasible candidates win over infeasible ones, then the lower total cost, then the lower index;
    so the result is infeasible only when every alternative is. None when the node has only one
    strategy.
    """
    evaluate(problem, solution)  # validates the solution's shape
    node = problem.nodes[node_index]
    group = [
        i
        for i, other in enumerate(problem.nodes)
        if i == node_index or (node.tie is not None and other.tie == node.tie)
    ]
    best: tuple[tuple[bool, float, int], Solution, Evaluation] | None = None
    for k in range(len(node.strategies)):
        if k == solution.choice[node_index]:
            continue
        choice = list(solution.choice)
        for i in group:
            choice[i] = k
        candidate = Solution(tuple(choice))
        evaluation = evaluate(problem, candidate)
        key = (not evaluation.feasible, evaluation.total, k)
        if best is None or key < best[0]:
            best = (key, candidate, evaluation)
    return None if best is None else (best[1], best[2])
