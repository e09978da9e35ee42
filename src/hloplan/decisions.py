"""Why the plan looks the way it does: the most consequential choices and what they beat.

`top_decisions(state)` feeds plan.json's "decisions". A decision is one problem node (with the
nodes tied to it: they move together): the largest arguments (parameters, optimizer state) and
the ops with the largest chosen cost. For each, the next-best alternative is what
`solver.explain.next_best` picks (every other strategy index of the group, all unrelated nodes
fixed; feasible first, then the lowest total cost, then the lowest index) and the deltas are what
`solver.explain.compare` reports, summed over the group (alternative minus chosen: a positive
delta is what the chosen strategy saves).

Calling next_best per decision re-evaluates the whole problem once per strategy: O(nodes x live
points) each, seconds on a thousand-node program, and this runs inside every compile. So the same
arithmetic is done locally here: only the edges and live points that touch the group change.
tests/unit/test_explain.py checks that both give the same answer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hloplan.solver.evaluate import (
    MEMORY_RTOL,
    Evaluation,
    copy_delta,
    evaluate,
    loop_copy_edges,
    reused_loop_copies,
    reused_loop_copy_changes,
)
from hloplan.solver.liveness import Liveness
from hloplan.solver.problem import ShardingProblem, Solution
from hloplan.state import CompileState
from hloplan.strategies import OpStrategy, spec_names
from hloplan.units import format_bytes, format_seconds

__all__ = ["Alternative", "DecisionIndex", "partition_spec_text", "top_decisions"]

# Differences smaller than this (seconds or bytes) are float noise, not reasons (as in explain).
_EPS = 1e-15


def _round(x: float) -> float:
    return float(f"{x:.6g}")


def partition_spec_text(spec_axes) -> str:
    """jax-style text of a spec given as per-dim axis-name lists: P(None, ('x', 'y')); P()."""
    entries = [None if not axes else axes[0] if len(axes) == 1 else tuple(axes)
               for axes in spec_axes]
    while entries and entries[-1] is None:
        entries.pop()
    # One multi-axis entry is written as jax prints it, P(('x', 'y'),), not P(('x', 'y')).
    trailing = "," if len(entries) == 1 and isinstance(entries[0], tuple) else ""
    return "P(" + ", ".join(repr(e) for e in entries) + trailing + ")"


@dataclass(frozen=True)
class Alternative:
    """The best other strategy index for a group, and what switching to it changes."""

    strategy: int
    delta_compute: float
    delta_communication: float
    delta_resharding: float
    delta_own_memory: float  # the group's own per-device output bytes
    peak_memory: float  # peak bytes per device after the switch
    delta_peak_memory: float
    feasible: bool

    @property
    def delta_total(self) -> float:
        return self.delta_compute + self.delta_communication + self.delta_resharding


class DecisionIndex:
    """What one solution costs, indexed so that moving one tie group is cheap to price."""

    def __init__(self, problem: ShardingProblem, solution: Solution,
                 evaluation: Evaluation | None = None):
        self.problem = problem
        self.choice = solution.choice
        self.evaluation = evaluation if evaluation is not None else evaluate(problem, solution)
        n = len(problem.nodes)
        self.ties: dict[int, list[int]] = {}
        for index, node in enumerate(problem.nodes):
            if node.tie is not None:
                self.ties.setdefault(node.tie, []).append(index)
        self.broken_ties = {tie for tie, members in self.ties.items()
                            if len({self.choice[i] for i in members}) > 1}
        self.edges_of: list[list[int]] = [[] for _ in range(n)]
        for e, edge in enumerate(problem.edges):
            self.edges_of[edge.src].append(e)
            if edge.dst != edge.src:
                self.edges_of[edge.dst].append(e)
        self.points_of = problem.points_of_nodes()
        self.launches_of: list[list[int]] = [[] for _ in range(n)]
        # Per launch: its members' paying indices, and how many members the solution has
        # paying (a move changes the count by its own nodes only).
        self.launch_picks: list[dict[int, set[int]]] = []
        self.launch_paying: list[int] = []
        for k, launch in enumerate(problem.launches):
            picks = {node: set(p) for node, p in launch.members}
            self.launch_picks.append(picks)
            self.launch_paying.append(sum(self.choice[node] in p for node, p in picks.items()))
            for member in picks:
                self.launches_of[member].append(k)
        self.memory = np.asarray(self.evaluation.memory, dtype=float)
        liveness = Liveness(problem)
        self.first_live = liveness.made  # where each node holds its transient bytes
        self.copy_span = liveness.span_of
        self.accumulator_span = {n: (start, end) for n, start, end in liveness.accumulators}
        self.loop_copies = loop_copy_edges(problem)  # loops that may read a resharded operand
        budget = problem.memory_budget
        self.limit = budget + MEMORY_RTOL * abs(budget)
        self.over = {p for p in range(len(self.memory)) if not self.memory[p] <= self.limit}
        # Points by footprint, largest first: the peak of the points a move leaves alone is the
        # first of these it does not touch.
        self.by_size = sorted(range(len(self.memory)), key=lambda p: (-self.memory[p], p))

    def group(self, node: int) -> list[int]:
        tie = self.problem.nodes[node].tie
        return [node] if tie is None else self.ties[tie]

    def alternatives(self, node: int) -> list[Alternative]:
        """Every other strategy index for `node`'s group, priced as `evaluate` would."""
        problem, choice = self.problem, self.choice
        group = self.group(node)
        members = set(group)
        count = len(problem.nodes[node].strategies)
        ks = [k for k in range(count) if k != choice[node]]
        if not ks:
            return []
        compute = np.zeros(count)
        communication = np.zeros(count)
        own = np.zeros(count)
        for g in group:
            strategies = problem.nodes[g].strategies
            mine = strategies[choice[g]]
            compute += [s.compute_cost - mine.compute_cost for s in strategies]
            communication += [s.communication_cost - mine.communication_cost for s in strategies]
            own += [s.memory - mine.memory for s in strategies]
        communication += self._launch_deltas(group, count)
        resharding = np.zeros(count)
        seen_edges: set[int] = set()
        for g in group:
            for e in self.edges_of[g]:
                if e in seen_edges:
                    continue
                seen_edges.add(e)
                edge = problem.edges[e]
                base = edge.costs[choice[edge.src]][choice[edge.dst]]
                src_moves, dst_moves = edge.src in members, edge.dst in members
                for k in range(count):
                    i = k if src_moves else choice[edge.src]
                    j = k if dst_moves else choice[edge.dst]
                    resharding[k] += edge.costs[i][j] - base
        peaks, fits = self._memory(group, count)
        others_ok = not (self.broken_ties - {problem.nodes[node].tie})
        base_peak = self.evaluation.peak_memory
        return [Alternative(k, float(compute[k]), float(communication[k]), float(resharding[k]),
                            float(own[k]), float(peaks[k]), float(peaks[k] - base_peak),
                            bool(fits[k]) and others_ok) for k in ks]

    def _launch_deltas(self, group: list[int], count: int) -> np.ndarray:
        """Per strategy index of the group, the change in the launches the plan pays."""
        delta = np.zeros(count)
        for k in sorted({k for g in group for k in self.launches_of[g]}):
            picks = self.launch_picks[k]
            moved = [picks[g] for g in group if g in picks]
            others = self.launch_paying[k] - sum(self.choice[g] in picks[g]
                                                 for g in group if g in picks)
            paid = self.launch_paying[k] > 0
            for index in range(count):
                now = others > 0 or any(index in p for p in moved)
                delta[index] += self.problem.launches[k].cost * (now - paid)
        return delta

    def _memory(self, group: list[int], count: int) -> tuple[np.ndarray, np.ndarray]:
        """Peak bytes and whether every live point fits, per strategy index of the group."""
        if not len(self.memory):
            return np.zeros(count), np.ones(count, dtype=bool)
        copies = self._copy_deltas(group, count)
        for g in group:  # its loop accumulators, over their span
            span = self.accumulator_span.get(g)
            if span is not None:
                strategies = self.problem.nodes[g].strategies
                held = strategies[self.choice[g]].accumulators
                row = np.array([s.accumulators - held for s in strategies])
                for p in range(span[0], span[1] + 1):
                    copies[p] = copies[p] + row if p in copies else row
        for p, row in self._reuse_deltas(group, count).items():
            copies[p] = copies[p] + row if p in copies else row
        touched = sorted({p for g in group for p in self.points_of[g]} | set(copies))
        position = {p: i for i, p in enumerate(touched)}
        delta = np.zeros((len(touched), count))
        for p, row in copies.items():
            delta[position[p]] += row
        for g in group:
            strategies = self.problem.nodes[g].strategies
            mine = strategies[self.choice[g]].memory
            row = np.array([s.memory - mine for s in strategies])
            rows = [position[p] for p in self.points_of[g]]
            if rows:
                delta[rows] += row
            first = self.first_live.get(g)
            if first is not None and first in position:  # its transient bytes there
                flash = strategies[self.choice[g]].transient
                delta[position[first]] += np.array([s.transient - flash for s in strategies])
        loads = self.memory[touched][:, None] + delta
        peaks = loads.max(axis=0) if touched else np.full(count, -np.inf)
        fits = (loads <= self.limit).all(axis=0) if touched else np.ones(count, dtype=bool)
        touched_set = set(touched)
        rest = next((p for p in self.by_size if p not in touched_set), None)
        if rest is not None:
            peaks = np.maximum(peaks, self.memory[rest])
        if self.over - touched_set:
            fits = np.zeros(count, dtype=bool)
        return peaks, fits

    def _reuse_deltas(self, group: list[int], count: int) -> dict[int, np.ndarray]:
        """Per live point, the change in the loop copies not held there because the loop reads
        a resharded operand (evaluate.reused_loop_copies), per strategy index of the group."""
        members = set(group)
        edges = [(e, nodes) for e, nodes in self.loop_copies if nodes & members]
        if not edges:
            return {}
        choice = self.choice
        base = reused_loop_copies(self.problem, choice.__getitem__, self.first_live,
                                  self.copy_span, edges)
        deltas: dict[int, np.ndarray] = {}
        for k in range(count):
            changes = reused_loop_copy_changes(
                self.problem, base, lambda n, k=k: k if n in members else choice[n],
                self.first_live, self.copy_span, edges)
            for n, change in changes.items():
                if change:
                    p = self.first_live[n]
                    row = deltas.setdefault(p, np.zeros(count))
                    row[k] += change
        return deltas

    def _copy_deltas(self, group: list[int], count: int) -> dict[int, np.ndarray]:
        """Per live point, the change in resharded-copy bytes held there, per strategy index of
        the group (a copy is held over its span, Edge.held)."""
        problem, choice = self.problem, self.choice
        members = set(group)
        deltas: dict[int, np.ndarray] = {}
        seen: set[int] = set()
        for g in group:
            for e in self.edges_of[g]:
                span = self.copy_span.get(e)
                if e in seen or span is None:
                    continue
                seen.add(e)
                edge = problem.edges[e]
                row = np.array([copy_delta(edge, choice, members, k) for k in range(count)])
                if row.any():
                    for p in range(span[0], span[1] + 1):
                        deltas[p] = deltas[p] + row if p in deltas else row
        return deltas

    def next_best(self, node: int) -> Alternative | None:
        """The alternative `solver.explain.next_best` picks: feasible, cheapest, lowest index."""
        options = self.alternatives(node)
        if not options:
            return None
        return min(options, key=lambda a: (not a.feasible, a.delta_total, a.strategy))


# -- turning indices into sentences ----------------------------------------------------------


class _Describer:
    def __init__(self, state: CompileState, index: DecisionIndex):
        self.state = state
        self.index = index
        self.mesh = state.options.mesh
        graph = state.graph
        self.yield_consumers: dict[int, list[int]] = {}
        for op in graph.ops:
            if op.name == "while.carry" and "yield" in op.attrs and op.index in state.space.strategies:
                self.yield_consumers.setdefault(op.attrs["yield"], []).append(op.index)

    def ops_of(self, group: list[int]) -> list[int]:
        return [self.state.space.op_of[g] for g in group]

    def collectives(self, ops: list[int], k: int | None) -> dict[str, list[str]]:
        """'kind(axes)' of the collectives the group's ops issue ("ops") and of the resharding
        into and out of them ("resharding"), with the group on strategy index `k` (None: as
        chosen)."""
        state, graph, space = self.state, self.state.graph, self.state.space
        moved = set(ops)

        def pick(op_index: int) -> OpStrategy:
            if k is not None and op_index in moved:
                return space.strategies[op_index][k]
            return state.chosen(op_index)

        own: dict[str, None] = {}
        labels: dict[str, None] = {}
        for op_index in ops:
            for kind, axes, _ in pick(op_index).collectives:
                own[f"{kind}({axes})"] = None
        consumers = set(ops)
        for op_index in ops:
            for value_id in graph.ops[op_index].results:
                consumers.update(u for u in graph.values[value_id].users if u in space.strategies)
                consumers.update(self.yield_consumers.get(value_id, ()))
        for consumer in sorted(consumers):
            op = graph.ops[consumer]
            strategy = pick(consumer)
            pairs = [(v, strategy.operands[i] if i < len(strategy.operands) else None)
                     for i, v in enumerate(op.operands)]
            if op.name == "while.carry" and "yield" in op.attrs:
                pairs.append((op.attrs["yield"], strategy.results[0]))
            for value_id, required in pairs:
                value = graph.values[value_id]
                if (required is None or value.type is None or value_id in space.free_values
                        or value.producer not in space.strategies):
                    continue
                if consumer not in moved and value.producer not in moved:
                    continue
                given = pick(value.producer).results[value.result_index]
                if given == required:
                    continue
                cost = state.comm.reshard(value.type.shape, value.type.itemsize, given, required)
                for kind, axes, _ in cost.collectives:
                    labels[f"{kind}({state.comm.axes_label(axes)})"] = None
        return {"ops": sorted(own), "resharding": sorted(labels)}

    def spec(self, op_index: int, k: int) -> list[list[list[str]]]:
        strategy = self.state.space.strategies[op_index][k]
        return [[list(a) for a in spec_names(s, self.mesh)] for s in strategy.results]


def _join(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def _body(alt: Alternative, comm_label: str, reshard_label: str) -> str:
    """'saves 2.00 KiB per device and 61.0 ns of all-reduce(x) per step, but costs ...'."""
    saves: list[str] = []
    costs: list[str] = []
    if alt.delta_own_memory > 0.5:
        saves.append(f"{format_bytes(alt.delta_own_memory)} per device")
    elif alt.delta_own_memory < -0.5:
        costs.append(f"{format_bytes(-alt.delta_own_memory)} more per device")
    timed_saves, timed_costs = False, False
    for delta, label in ((alt.delta_compute, "compute"), (alt.delta_communication, comm_label),
                         (alt.delta_resharding, reshard_label)):
        if delta > _EPS:
            saves.append(f"{format_seconds(delta)} of {label}")
            timed_saves = True
        elif delta < -_EPS:
            costs.append(f"{format_seconds(-delta)} of {label}")
            timed_costs = True
    parts = []
    if saves:
        parts.append("saves " + _join(saves) + (" per step" if timed_saves else ""))
    if costs:
        parts.append("costs " + _join(costs) + (" per step" if timed_costs else ""))
    return ", but ".join(parts) if parts else "costs the same"


def _reason(subject: str, chosen: str, other: str, alt: Alternative, budget: float,
            comm_label: str, reshard_label: str, noise: float = _EPS) -> str:
    """One sentence: what the chosen strategy saves and costs against `other`, and the verdict.
    Step-time differences within `noise` seconds count as equal (solver tolerances)."""
    body = _body(alt, comm_label, reshard_label)
    text = f"{subject} as {chosen} instead of {other} {body}"
    if not alt.feasible:
        if alt.peak_memory > budget + MEMORY_RTOL * abs(budget):
            text += (f"; {other} would need {format_bytes(alt.peak_memory)} > "
                     f"{format_bytes(budget)} budget")
        else:
            text += f"; {other} is infeasible"
        return text
    verdicts = []
    if alt.delta_total > noise:
        verdicts.append(f"be {format_seconds(alt.delta_total)} slower per step")
    elif alt.delta_total < -noise:
        verdicts.append(f"be {format_seconds(-alt.delta_total)} faster per step "
                        "(the plan is not proven optimal)")
    if alt.delta_peak_memory > 0.5:
        verdicts.append(f"raise peak memory by {format_bytes(alt.delta_peak_memory)} to "
                        f"{format_bytes(alt.peak_memory)}")
    elif alt.delta_peak_memory < -0.5:
        verdicts.append(f"lower peak memory by {format_bytes(-alt.delta_peak_memory)}")
    if verdicts:
        text += f"; {other} would " + " and ".join(verdicts)
    else:
        text += f"; {other} is as good (the solver picked one of equals)"
    return text


def _candidates(state: CompileState, index: DecisionIndex, count: int) -> list[tuple[str, int]]:
    """(kind, node) of the decisions to explain: the largest arguments, then the costliest ops,
    half and half (one kind fills in when the other runs short), one per tie group. A tie group is
    described by its leader (the op the others follow), so its kind is the leader's."""
    graph, space, problem = state.graph, state.space, state.problem
    per_node = index.evaluation.per_node
    args, ops = [], []
    for op_index in sorted(space.strategies):
        node = space.node_of[op_index]
        if len(problem.nodes[node].strategies) < 2:
            continue
        op = graph.ops[op_index]
        if op.name == "arg":
            type_ = graph.type_of(op.results[0])
            if type_ is not None and type_.nbytes > 0:
                args.append((-type_.nbytes, op_index, node))
        else:
            cost = sum(per_node[node])
            if cost > 0:
                ops.append((-cost, op_index, node))
    args.sort()
    ops.sort()

    def leader(node: int) -> int:
        tie = problem.nodes[node].tie
        if tie is None:
            return node
        return space.node_of.get(tie, min(index.group(node)))

    seen: set[int] = set()

    def take(ranked, limit: int) -> list[int]:
        out = []
        for _, _, node in ranked:
            if len(out) >= limit:
                break
            head = leader(node)
            if head not in seen:
                seen.add(head)
                out.append(head)
        return out

    first = take(args, count - count // 2)
    rest = take(ops, count - len(first))
    first += take(args, count - len(first) - len(rest))
    return [("argument" if graph.ops[space.op_of[n]].name == "arg" else "op", n)
            for n in first + rest]


def top_decisions(state: CompileState, count: int = 10) -> list[dict]:
    """The `count` most consequential choices of the plan, each with why it beats the next best.

    Plain JSON data, deterministic (rounded floats, a fixed order: arguments by size, then ops by
    cost).
    """
    if count <= 0 or state.problem is None or state.solution is None or not state.problem.nodes:
        return []
    index = DecisionIndex(state.problem, state.solution)
    describe = _Describer(state, index)
    graph, space, problem = state.graph, state.space, state.problem
    budget = problem.memory_budget
    # Differences below 1e-6 of the step are float noise, not reasons. The plan itself is only
    # proven within CompileOptions.gap (1%), so a cheaper alternative can show up: it is said.
    noise = max(_EPS, 1e-6 * abs(index.evaluation.total))
    out = []
    for rank, (kind, node) in enumerate(_candidates(state, index, count), start=1):
        alt = index.next_best(node)
        if alt is None:
            continue
        op_index = space.op_of[node]
        op = graph.ops[op_index]
        group = index.group(node)
        ops = describe.ops_of(group)
        chosen_k = index.choice[node]
        chosen_spec, other_spec = describe.spec(op_index, chosen_k), describe.spec(op_index,
                                                                                    alt.strategy)
        chosen_collectives = describe.collectives(ops, None)
        other_collectives = describe.collectives(ops, alt.strategy)
        comm_label = _kinds_label(chosen_collectives["ops"], other_collectives["ops"],
                                  alt.delta_communication, "communication", resharding=False)
        reshard_label = _kinds_label(chosen_collectives["resharding"],
                                     other_collectives["resharding"], alt.delta_resharding,
                                     "resharding", resharding=True)
        location = str(op.location) if op.location else None
        if kind == "argument":
            name = graph.argument_names[op.attrs["index"]]
            chosen_text = partition_spec_text(chosen_spec[0])
            other_text = partition_spec_text(other_spec[0])
            subject = f"placing {name}"
        else:
            name = op.label or op.name
            chosen_text = problem.nodes[node].strategies[chosen_k].name
            other_text = problem.nodes[node].strategies[alt.strategy].name
            where = f" at {_short_location(location)}" if location else ""
            subject = f"computing %{op_index} {op.name.split('.')[-1]}{where}"
        if len(group) > 1:
            subject += f" (with {len(group) - 1} tied op{'s' if len(group) > 2 else ''})"
        strategies = problem.nodes[node].strategies
        out.append({
            "rank": rank,
            "kind": kind,
            "id": f"%{op_index}",
            "op": op.name,
            "name": name,
            "label": op.label,
            "location": location,
            "tied_ops": len(group),
            "chosen": strategies[chosen_k].name,
            "next_best": strategies[alt.strategy].name,
            "chosen_spec": chosen_spec,
            "next_best_spec": other_spec,
            "chosen_cost_s": _round(sum(sum(index.evaluation.per_node[g]) for g in group)),
            "delta": {
                "compute_s": _round(alt.delta_compute),
                "communication_s": _round(alt.delta_communication),
                "resharding_s": _round(alt.delta_resharding),
                "total_s": _round(alt.delta_total),
                "peak_memory_bytes": int(round(alt.delta_peak_memory)),
                "bytes_per_device": int(round(alt.delta_own_memory)),
            },
            "next_best_feasible": alt.feasible,
            "next_best_peak_memory_bytes": int(round(alt.peak_memory)),
            "collectives": {"chosen": chosen_collectives, "next_best": other_collectives},
            "reason": _reason(subject, chosen_text, other_text, alt, budget, comm_label,
                              reshard_label, noise),
        })
    return out


def _short_location(location: str) -> str:
    """'file.py:12:5' -> 'file.py:12'."""
    head, _, tail = location.rpartition(":")
    return head if head and tail.isdigit() and head.rpartition(":")[2].isdigit() else location


def _kinds_label(chosen: list[str], other: list[str], delta: float, default: str,
                 resharding: bool) -> str:
    """Name what a cost difference is made of: the collectives of the costlier side."""
    costlier, cheaper = (other, chosen) if delta > 0 else (chosen, other)
    kinds = [c for c in costlier if c not in cheaper] or costlier
    if not kinds:
        return default
    listed = ", ".join(kinds[:3]) + (", ..." if len(kinds) > 3 else "")
    return f"{default} ({listed})" if resharding else listed
