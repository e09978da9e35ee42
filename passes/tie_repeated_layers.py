"""tie-repeated-layers: one decision for every copy of a repeated layer.

An unrolled Python loop over layers emits the same ops once per layer: same op names and
attributes, same tensor types, same source line and name label (the same Python line produces
each layer's op). This pass finds such repeats on the plain-data graph and ties their strategy
variables, so the ILP grows with the number of distinct blocks, not with depth. (The body of a
`stablehlo.while` is one copy already.)

- A structural colour per op: op name, attributes, operand and result types, source location,
  name label, trip-count multiplier and enclosing loop; arguments are coloured by type only
  (their names differ per layer). Weisfeiler-Lehman refinement over `hops` rounds mixes in the
  colours of producers (by operand position) and consumers (as a multiset): ops whose k-hop
  neighbourhoods look alike get one colour, so a layer's first and last ops, next to the
  embedding or the loss, keep their own colour while the interior of every layer repeats.
- Planned ops of one colour with the same strategy list (count and names) share a tie id.
  Existing ties (pointwise followers share their leader's variable) are merged by union-find
  over tie ids, so those groups stay intact; a tie group always has one strategy count.
- Arguments (parameters, optimizer state) are tied only when, in addition, their consumers
  ended up tied: layer i's and layer j's weights, not two tensors of one shape with different
  roles.
- Memory checks: once the ties hold, a live point whose bytes another point's bytes bound for
  every choice (same decisions, at least as many of their nodes, at least as many fixed bytes)
  is dropped. Exact (the peak over the kept points is the peak over all of them); in the
  forward pass a tied layer's checks are covered by the next layer's, where more activations
  are live. (The backward pass trades activations for gradients: those checks stay.) Class
  counts are kept up to date point to point (live ranges join and leave), and each point is
  compared with at most 256 kept candidates, so the time stays linear in the points; a
  dominated point beyond them is kept, which costs nothing but a redundant check.

With `compare_untied`, the pass also solves the untied and the tied problem and records the
relative objective difference (the price of tying) in `state.facts["tied_gap"]`.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass

from hloplan.graph import Graph
from hloplan.solver.liveness import Liveness
from hloplan.solver.problem import ShardingProblem
from hloplan.state import CompileState, PlanSpace

# Attributes that hold op indices or value ids: they differ between copies of a layer.
_ID_ATTRS = frozenset({"yield", "carries", "results"})
# Memory-check pruning compares a point with at most this many kept candidates (the latest
# kept that share its rarest class): a bound on its time; dominated points beyond it are kept.
_CANDIDATES = 256


@dataclass(frozen=True)
class TieRepeatedLayers:
    name: str = "tie-repeated-layers"
    # Weisfeiler-Lehman rounds: how far (in dataflow hops) two ops must look alike to be tied.
    hops: int = 3
    # Drop memory checks that another live point dominates once ties hold (exact).
    prune_live_points: bool = True
    # Also solve the untied and the tied problem and record the tied plan's gap (benchmarks).
    compare_untied: bool = False
    # Copies of a layer take `period` decisions in turn (layer k: decision k mod period).
    # 2 lets a stack of identical dense layers alternate column and row splits (Megatron's
    # pairing across layers), which one shared decision cannot express; 1 suits transformer
    # blocks, which pair column and row splits inside each block.
    period: int = 1
    # Tie only problems with more decisions than this: smaller ones solve in seconds untied,
    # and tying can cost plan quality (identical MLP layers want alternating column/row
    # splits, which one shared decision cannot express).
    min_decisions: int = 1000
    # ... or more resharding-cost entries than this (strategies multiply on meshes of 3+ axes:
    # a 2-layer GPT on 16x8x8 has 458 decisions but 6.7M entries, a 1.6M-variable ILP).
    min_edge_cells: int = 2_000_000

    def apply(self, state: CompileState) -> None:
        graph, space, problem = state.graph, state.space, state.problem
        if graph is None or space is None or problem is None:
            raise RuntimeError("tie-repeated-layers runs after build-sharding-problem")
        cells = sum(len(edge.costs) * len(edge.costs[0]) for edge in problem.edges)
        if (decision_count(problem) <= self.min_decisions and cells <= self.min_edge_cells
                and not self.compare_untied):
            state.facts["tied_groups"] = 0
            return
        started = time.perf_counter()
        colors = structural_colors(graph, space, self.hops)
        ties = tie_ids(graph, space, problem, colors, self.period)
        tied = dataclasses.replace(problem, nodes=tuple(
            node if node.tie == tie else dataclasses.replace(node, tie=tie)
            for node, tie in zip(problem.nodes, ties)))
        _check_tie_counts(tied)
        if self.prune_live_points:
            kept = dominant_live_points(tied)
            state.facts["live_points_before_pruning"] = len(tied.live_points)
            state.facts["live_points_after_pruning"] = len(kept)
            tied = tied.with_live_points(kept)
        before, after = decision_count(problem), decision_count(tied)
        groups = _repeated_groups(problem, ties)
        state.problem = tied
        state.facts["tied_groups"] = len(groups)
        state.facts["tied_nodes"] = sum(len(g) for g in groups)
        state.facts["decisions_before_tying"] = before
        state.facts["decisions_after_tying"] = after
        state.facts["tie_seconds"] = time.perf_counter() - started
        message = (f"tie-repeated-layers: {state.facts['tied_nodes']} ops in {len(groups)} "
                   f"repeated groups tied; decisions {before} -> {after}")
        if self.prune_live_points:
            message += (f"; memory checks {state.facts['live_points_before_pruning']} -> "
                        f"{state.facts['live_points_after_pruning']}")
        state.log.remark(message)
        if self.compare_untied:
            state.facts.update(compare_tied(problem, tied, state.options))
            state.log.remark(describe_comparison(state.facts))


# --------------------------------------------------------------------------- structural colours


def _initial_labels(graph: Graph, space: PlanSpace) -> list[tuple]:
    values, free_values, fallbacks = graph.values, space.free_values, space.fallbacks
    labels = []
    for op in graph.ops:
        # Types compare as themselves (shape, dtype): no need to format them.
        results = tuple([values[v].type for v in op.results])
        if op.name == "arg":
            # Arguments differ by name only: their consumers tell their role.
            labels.append(("arg", results))
            continue
        free = tuple([v in free_values for v in op.results])
        attrs = tuple(sorted([(k, repr(v)) for k, v in op.attrs.items() if k not in _ID_ATTRS]))
        operands = tuple([values[v].type for v in op.operands])
        parent = graph.ops[op.parent].name if op.parent is not None else None
        labels.append((op.name, attrs, operands, results, free, str(op.location), op.label,
                       op.multiplier, parent, op.region, op.planned,
                       op.index in fallbacks))
    return labels


def _compact(signatures: list) -> list[int]:
    """Equal signatures -> equal small ints, numbered in order of first appearance."""
    ids: dict = {}
    return [ids.setdefault(s, len(ids)) for s in signatures]


def structural_colors(graph: Graph, space: PlanSpace, hops: int) -> list[int]:
    """A colour per op: equal colours mean equal ops with alike `hops`-hop neighbourhoods."""
    producers: list[tuple[tuple[int, int], ...]] = []
    consumers: list[tuple[tuple[int, int, int], ...]] = []
    for op in graph.ops:
        operands = list(op.operands)
        if op.name == "while.carry" and "yield" in op.attrs:
            operands.append(op.attrs["yield"])
        producers.append(tuple((graph.values[v].producer, graph.values[v].result_index)
                               for v in operands))
        users = []
        for r, v in enumerate(op.results):
            for user in dict.fromkeys(graph.values[v].users):
                user_op = graph.ops[user]
                for k, operand in enumerate(user_op.operands):
                    if operand == v:
                        users.append((r, user, k))
                if user_op.attrs.get("yield") == v:
                    users.append((r, user, -1))
        consumers.append(tuple(users))
    colors = _compact(_initial_labels(graph, space))
    for _ in range(hops):
        c = colors
        refined = _compact([
            (c[i],
             tuple([(c[p], r) for p, r in producers[i]]),
             tuple(sorted([(r, c[u], k) for r, u, k in consumers[i]])))
            for i in range(len(c))])
        if len(set(refined)) == len(set(colors)):
            break  # stable partition: more rounds change nothing
        colors = refined
    return colors


# --------------------------------------------------------------------------- ties


class _UnionFind:
    def __init__(self) -> None:
        self.parent: dict[int, int] = {}

    def find(self, x: int) -> int:
        root = x
        while self.parent.get(root, root) != root:
            root = self.parent[root]
        while x != root:
            self.parent[x], x = root, self.parent.get(x, x)
        return root

    def union(self, a: int, b: int) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[max(ra, rb)] = min(ra, rb)


def tie_ids(graph: Graph, space: PlanSpace, problem: ShardingProblem,
            colors: list[int], period: int = 1) -> list[int | None]:
    """The new tie id of every node (None: a decision of its own)."""
    nodes = problem.nodes
    # A node's unit: its existing tie id, or its own op index (never another group's tie id:
    # tie ids are the op indices of their leaders).
    unit = [node.tie if node.tie is not None else space.op_of[i] for i, node in enumerate(nodes)]
    count = {}
    for i, node in enumerate(nodes):
        count.setdefault(unit[i], len(node.strategies))
    names = [tuple(s.name for s in node.strategies) for node in nodes]
    uf = _UnionFind()

    def tie_buckets(buckets: dict) -> None:
        for members in buckets.values():
            first = members[0]
            for other in members[1:]:
                if count[uf.find(unit[first])] == count[uf.find(unit[other])]:
                    uf.union(unit[first], unit[other])

    buckets: dict = {}
    args = []
    for i in range(len(nodes)):
        op = graph.ops[space.op_of[i]]
        if op.name == "arg":
            args.append(i)
        elif len(nodes[i].strategies) > 1:
            buckets.setdefault((colors[op.index], names[i]), []).append(i)
    tie_buckets(buckets)
    # Arguments: alike, and consumed by ops that are tied now.
    buckets = {}
    for i in args:
        if len(nodes[i].strategies) <= 1:
            continue
        op = graph.ops[space.op_of[i]]
        used_by = []
        for v in op.results:
            for user in graph.values[v].users:
                node = space.node_of.get(user)
                used_by.append(("tied", uf.find(unit[node])) if node is not None
                               else ("op", colors[user]))
        key = (colors[op.index], names[i], tuple(sorted(set(used_by))))
        buckets.setdefault(key, []).append(i)
    tie_buckets(buckets)
    # With a period p > 1, the copies of a group (its previous decisions, in program order)
    # take p decisions in turn: copy k joins decision k mod p.
    key = [uf.find(unit[i]) for i in range(len(nodes))]
    if period > 1:
        start: dict[int, int] = {}  # unit -> its first op
        for i in range(len(nodes)):
            start[unit[i]] = min(start.get(unit[i], space.op_of[i]), space.op_of[i])
        copies: dict[int, list[int]] = {}
        for u in sorted(start, key=start.__getitem__):
            copies.setdefault(uf.find(u), []).append(u)
        turn = {u: k % period for members in copies.values() for k, u in enumerate(members)}
        key = [(key[i], turn[unit[i]]) for i in range(len(nodes))]
    # Tie id of a group: the smallest op index in it (an untouched group keeps its id).
    first: dict = {}
    size: dict = {}
    for i in range(len(nodes)):
        first[key[i]] = min(first.get(key[i], space.op_of[i]), space.op_of[i])
        size[key[i]] = size.get(key[i], 0) + 1
    return [first[k] if size[k] > 1 else None for k in key]


def _check_tie_counts(problem: ShardingProblem) -> None:
    """What validate() checks of ties, without walking every edge matrix again."""
    counts: dict[int, int] = {}
    for node in problem.nodes:
        if node.tie is not None and counts.setdefault(node.tie, len(node.strategies)) != len(
                node.strategies):
            raise ValueError(f"tie group {node.tie} mixes strategy counts")


def decision_count(problem: ShardingProblem) -> int:
    """Decisions the ILP takes: tie groups and untied nodes with more than one strategy."""
    seen = set()
    for i, node in enumerate(problem.nodes):
        if len(node.strategies) > 1:
            seen.add(("tie", node.tie) if node.tie is not None else ("node", i))
    return len(seen)


def _repeated_groups(problem: ShardingProblem, ties: list[int | None]) -> list[list[int]]:
    """Tie groups that join nodes which were separate decisions before this pass."""
    groups: dict[int, list[int]] = {}
    for i, tie in enumerate(ties):
        if tie is not None:
            groups.setdefault(tie, []).append(i)
    out = []
    for members in groups.values():
        units = {("tie", problem.nodes[i].tie) if problem.nodes[i].tie is not None else ("node", i)
                 for i in members}
        if len(units) > 1:
            out.append(members)
    return out


# --------------------------------------------------------------------------- memory checks


def dominant_live_points(problem: ShardingProblem) -> list[int]:
    """Indices (in order) of the live points no other point dominates under the problem's ties.

    A point's bytes are its fixed bytes plus, per decision, the chosen strategy's memory summed
    over its nodes there (and the transient bytes of those first live there, and the resharded
    copies held there). Nodes of one decision with the same memory per strategy form a class;
    point P is dominated by Q when Q has at least P's fixed bytes and at least as many nodes of
    every class: then Q holds at least as many bytes as P whatever the (tie-respecting) choice,
    and checking Q suffices. With repeated layers tied, a forward-pass point is dominated by the
    same point of a later layer, where more activations are live. Exact: the peak over the kept
    points is the peak over all of them.
    """
    points = problem.live_points
    if len(points) < 2:
        return list(range(len(points)))
    import numpy as np

    class_ids: dict = {}
    class_of = np.full(len(problem.nodes), -1, dtype=np.int64)  # -1: no decision changes it
    constant_of = np.zeros(len(problem.nodes))  # bytes of the nodes of class -1
    class_max = []
    memories: dict[int, tuple] = {}  # id(strategies) -> memory per strategy (nodes share lists)
    for index, node in enumerate(problem.nodes):
        memory = memories.get(id(node.strategies))
        if memory is None:
            memory = memories[id(node.strategies)] = tuple(s.memory for s in node.strategies)
        if len(memory) == 1 or min(memory) == max(memory):
            constant_of[index] = memory[0]
            continue
        key = (("tie", node.tie) if node.tie is not None else ("node", index), memory)
        if key not in class_ids:
            class_ids[key] = len(class_ids)
            class_max.append(max(memory))
        class_of[index] = class_ids[key]
    # A node's transient bytes (held where it is made) and its loop accumulators (held over
    # its accumulator span, liveness.py) each count as a node of their own there, of a class
    # of their own: node -> class, -1 where every choice holds the same bytes (then constant).
    liveness = Liveness(problem)

    def extra_classes(kind: str, indices, bytes_of) -> tuple[dict[int, int], dict[int, float]]:
        classes: dict[int, int] = {}
        constant: dict[int, float] = {}
        for index in indices:
            node = problem.nodes[index]
            held = tuple(bytes_of(s) for s in node.strategies)
            if not any(held):
                continue
            if min(held) == max(held):
                classes[index], constant[index] = -1, held[0]
                continue
            key = (kind, ("tie", node.tie) if node.tie is not None else ("node", index), held)
            if key not in class_ids:
                class_ids[key] = len(class_ids)
                class_max.append(max(held))
            classes[index] = class_ids[key]
        return classes, constant

    flash_class, flash_constant = extra_classes("flash", liveness.made,
                                                lambda s: s.transient)
    loop_class, loop_constant = extra_classes(
        "loop", (index for index, _, _ in liveness.accumulators), lambda s: s.accumulators)
    # A resharded copy counts over its span as an item of a class keyed by its two decisions
    # and its tables: copies with equal keys hold equal bytes under any tie-respecting choice.
    copy_class: dict[int, int] = {}  # edge -> class
    for e, _, _ in liveness.spans:
        edge = problem.edges[e]
        if not any(edge.copies) and not any(edge.carried):
            continue
        key = ("copy", *(("tie", problem.nodes[n].tie) if problem.nodes[n].tie is not None
                         else ("node", n) for n in (edge.src, edge.dst)),
               id(edge.costs), edge.copies, edge.relayout, edge.carried)
        if key not in class_ids:
            class_ids[key] = len(class_ids)
            class_max.append(max(edge.copies, default=0.0)
                             + max(map(max, edge.relayout), default=0.0)
                             + max(edge.carried, default=0.0))
        copy_class[e] = class_ids[key]
    width = max(len(class_ids), 1)
    largest = np.array(class_max + [0.0] * (width - len(class_max)))
    # Walk the points keeping the class counts up to date from the liveness sweep's events.
    # First pass: each point's net change of class counts and its constant bytes, without
    # numpy (cheap).
    class_list = class_of.tolist()
    constant_list = constant_of.tolist()
    changes: list[dict[int, int]] = []  # per point: class -> net change from the previous one
    constants: list[float] = []
    constant_sum = 0.0  # whole bytes: the running sum is exact
    for events in liveness.sweep():
        change: dict[int, int] = {}
        for sign, moved, classes, constant_bytes in (
                (1, events.entering, class_list, constant_list),
                (-1, events.leaving, class_list, constant_list),
                (1, events.transient_in, flash_class, flash_constant),
                (-1, events.transient_out, flash_class, flash_constant),
                (1, events.accumulating_in, loop_class, loop_constant),
                (-1, events.accumulating_out, loop_class, loop_constant),
                (1, [e for e in events.copies_in if e in copy_class], copy_class, None),
                (-1, [e for e in events.copies_out if e in copy_class], copy_class, None)):
            for index in moved:
                c = classes[index]
                if c < 0:
                    constant_sum += sign * constant_bytes[index]
                else:
                    change[c] = change.get(c, 0) + sign
        changes.append({c: n for c, n in change.items() if n})
        constants.append(events.fixed_bytes + constant_sum)
    # A point its neighbour dominates goes at once: the next point when it only gains nodes
    # and constant bytes, the previous one when it only lost some (strictly, so that of two
    # equal neighbours one stays). Dominance is transitive, so a dropped point is always
    # dominated by a kept one; most points of a layer's forward pass go here.
    count = len(points)
    dropped = [False] * count
    for p in range(1, count):
        change = changes[p].values()
        if constants[p] >= constants[p - 1] and all(n > 0 for n in change):
            dropped[p - 1] = True
        elif constants[p] <= constants[p - 1] and all(n < 0 for n in change) and (
                changes[p] or constants[p] < constants[p - 1]):
            dropped[p] = True
    # Second pass: the class counts of the points that stay.
    summaries = {}  # point: (constant bytes, classes, counts, bytes at the largest choice)
    counts = np.zeros(width, dtype=np.int64)
    for p in range(count):
        for c, n in changes[p].items():
            counts[c] += n
        if dropped[p]:
            continue
        columns = np.flatnonzero(counts)
        needed = counts[columns]
        constant = constants[p]
        summaries[p] = (constant, columns, needed, constant + float(needed @ largest[columns]))
    # Likely dominators first: the points with the most bytes at their largest.
    order = sorted(summaries, key=lambda p: (-summaries[p][3], p))
    capacity = 64
    kept_counts = np.zeros((width, capacity), dtype=np.int64)  # class x kept point
    kept_constant = np.zeros(capacity)
    having = np.zeros(width, dtype=np.int64)  # class -> how many kept points have it
    kept: list[int] = []
    for p in order:
        constant, columns, needed, _ = summaries[p]
        n = len(kept)
        if n:
            # A dominator has every class of this point: look among the kept points that
            # have its rarest one (all of them when it has none).
            if len(columns):
                rarest = columns[int(np.argmin(having[columns]))]
                rows = np.flatnonzero(kept_counts[rarest, :n])[-_CANDIDATES:]
            else:
                rows = np.arange(max(n - _CANDIDATES, 0), n)
            if len(rows):
                rows = rows[kept_constant[rows] >= constant]
            if len(rows) and len(columns):
                if (kept_counts[columns[:, None], rows] >= needed[:, None]).all(axis=0).any():
                    continue
            elif len(rows):
                continue
        if n == capacity:
            capacity *= 2
            kept_counts = np.concatenate([kept_counts, np.zeros_like(kept_counts)], axis=1)
            kept_constant = np.concatenate([kept_constant, np.zeros_like(kept_constant)])
        kept_counts[columns, n] = needed
        kept_constant[n] = constant
        having[columns] += 1
        kept.append(p)
    return sorted(kept)


# --------------------------------------------------------------------------- price of tying


def compare_tied(untied: ShardingProblem, tied: ShardingProblem, options) -> dict:
    """Solve both problems and report the price of tying.

    `tied_gap`: (tied - untied) / untied objective, exact when both statuses are "optimal";
    `tied_gap_bound`: the same against the untied solver's lower bound, an upper bound on the
    true price of tying even when the untied solve stopped at its time limit.
    """
    from hloplan.solver.ilp import SolverError, solve

    facts: dict = {}
    for key, problem in (("untied", untied), ("tied", tied)):
        started = time.perf_counter()
        try:
            _, stats = solve(problem, time_limit=options.time_limit, solver=options.solver)
        except SolverError as exc:
            facts[f"{key}_status"] = f"failed: {type(exc).__name__}"
            facts[f"{key}_solve_seconds"] = time.perf_counter() - started
            continue
        facts[f"{key}_status"] = stats.status
        facts[f"{key}_how"] = stats.extra.get("raw_status", stats.solver)
        facts[f"{key}_objective"] = stats.objective
        facts[f"{key}_bound"] = stats.bound
        facts[f"{key}_solve_seconds"] = stats.seconds
        facts[f"{key}_variables"] = stats.variables
        facts[f"{key}_constraints"] = stats.constraints
    if "untied_objective" in facts and "tied_objective" in facts:
        tied_objective = facts["tied_objective"]
        base, bound = facts["untied_objective"], facts["untied_bound"]
        facts["tied_gap"] = (tied_objective - base) / max(abs(base), 1e-12)
        if math.isfinite(bound) and bound > 0:
            facts["tied_gap_bound"] = (tied_objective - bound) / max(abs(bound), 1e-12)
        facts["tied_gap_exact"] = facts["untied_status"] == facts["tied_status"] == "optimal"
    return facts


def describe_comparison(facts: dict) -> str:
    """One line on the price of tying, from compare_tied's facts."""
    head = "tie-repeated-layers: untied ILP"
    if "tied_gap" not in facts:
        return (f"{head} not compared (untied: {facts.get('untied_status')}, tied: "
                f"{facts.get('tied_status')})")
    # No seconds: remarks go into plan.json, which is deterministic.
    untied = f"untied {facts['untied_status']}, {facts['untied_variables']} variables"
    if facts["tied_gap_exact"]:
        return f"{head}: the tied plan is {facts['tied_gap']:+.3%} from the untied optimum ({untied})"
    line = f"{head}: the tied plan is {facts['tied_gap']:+.3%} from the untied incumbent"
    if "tied_gap_bound" in facts:
        line += f", at most {facts['tied_gap_bound']:+.3%} above its bound"
    return f"{line} ({untied}; tied {facts['tied_status']})"
