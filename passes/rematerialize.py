"""rematerialize: recompute cheap activations in the backward pass instead of keeping them.

A train step's memory peaks where the forward pass ends: every activation the backward pass
reads is live there. Many of them are cheap functions of a few others: a batch norm keeps the
centred input, the normalized input and the ReLU output (or its mask), all elementwise in the
convolution's output and two per-channel statistics. This pass keeps the values that are
expensive to make (matmul and convolution outputs, reductions, arguments) and recomputes the
elementwise ones right before their first use after the peak, reading the kept values through
a `stablehlo.optimization_barrier` that also waits for a value of the backward pass: XLA can
neither merge the recomputation with the forward one (CSE) nor schedule it early. This is
`jax.checkpoint` with a save-matmuls policy, chosen by hloplan on the exported program.

The choice is plain data (`plan_recompute` reads only the Graph): values live across the peak
are grouped by the kept values their recomputation needs that were not live there already,
and a group is recomputed when it frees more bytes than those kept values add.

Off in the default pipeline: `hloplan compile` turns it on when no plan fits the memory budget.
"""

from __future__ import annotations

from dataclasses import dataclass

from hloplan import ir
from hloplan.graph import Graph
from hloplan.op_rules import CHLO_ELEMENTWISE, ELEMENTWISE, FREE_OPS, MATMULS, free_values
from hloplan.state import CompileState

# Ops recomputed after the peak: elementwise math and the layout ops XLA fuses into it.
RECOMPUTABLE = ({f"stablehlo.{name}" for name in ELEMENTWISE}
                | {f"chlo.{name}" for name in CHLO_ELEMENTWISE}
                | {"stablehlo.broadcast_in_dim", "stablehlo.reshape", "stablehlo.transpose"}
                | FREE_OPS)

@dataclass(frozen=True)
class Recompute:
    """Clones of `ops` (program order) made right before op `before`; ops `users` (all after
    the peak) read the clones of `values` instead of the originals. The clones read `kept`
    (values made before the peak) through one optimization barrier that also takes `trigger`
    (made after the peak), if any."""

    before: int
    ops: tuple[int, ...]
    values: tuple[int, ...]
    users: tuple[int, ...]
    kept: tuple[int, ...]
    trigger: int | None


@dataclass(frozen=True)
class RecomputePlan:
    peak_after: int  # op index at which the (unsharded) live bytes peak
    peak_bytes: int
    freed_bytes: int  # fewer bytes live at the peak once the groups are recomputed
    groups: tuple[Recompute, ...]

    @property
    def values(self) -> int:
        return sum(len(g.values) for g in self.groups)

    @property
    def ops(self) -> int:
        return sum(len(g.ops) for g in self.groups)


@dataclass(frozen=True)
class Rematerialize:
    name: str = "rematerialize"
    enabled: bool = False
    # A group is recomputed only when it frees at least this fraction of the bytes it frees
    # and adds together (a group that trades one tensor for another of the same size is not).
    min_gain: float = 0.05
    # At most this many ops are cloned to recompute one value.
    max_chain: int = 64
    # Recompute only until this fraction of the unsharded peak is freed (cheapest per byte
    # first). compile recomputes everything that pays (1.0) when no plan fits as the program
    # stands; --pass-option rematerialize.free_fraction=F asks for less.
    free_fraction: float = 1.0

    def apply(self, state: CompileState) -> None:
        if not self.enabled:
            return
        graph, handles = ir.extract_graph(state.program.module, state.filename)
        plan = plan_recompute(graph, self.min_gain, self.max_chain, self.free_fraction)
        if plan is None or not plan.groups:
            state.facts["rematerialized"] = {"values": 0}
            return
        ir.rematerialize(handles, plan.groups)
        state.facts["rematerialized"] = {
            "values": plan.values, "ops": plan.ops, "groups": len(plan.groups),
            "peak_bytes": plan.peak_bytes, "freed_bytes": plan.freed_bytes}


def _top_positions(graph: Graph) -> list[int]:
    """Each op's top-level ancestor (itself when it is in @main's body)."""
    top = []
    for op in graph.ops:
        top.append(op.index if op.parent is None else top[op.parent])
    return top


def plan_recompute(graph: Graph, min_gain: float = 0.05, max_chain: int = 64,
                   free_fraction: float = 1.0) -> RecomputePlan | None:
    """Which values to recompute after the peak of unsharded live bytes, and where: the
    groups that pay, cheapest per byte freed first, until `free_fraction` of the peak is
    freed (1: all that pay). None when the program has no top-level op."""
    ops, values = graph.ops, graph.values
    if not ops:
        return None
    top = _top_positions(graph)
    free = free_values(graph)
    arguments, outputs = set(graph.arguments), set(graph.outputs)
    end = len(ops)

    def size(v: int) -> int:
        type_ = values[v].type
        return 0 if type_ is None or v in free else type_.nbytes

    last: dict[int, int] = {}
    for value in values:
        if ops[value.producer].parent is None and value.id not in arguments:
            last[value.id] = end if value.id in outputs else max(
                (top[u] for u in value.users), default=value.producer)
    delta = [0] * (end + 2)
    for v, until in last.items():
        delta[values[v].producer] += size(v)
        delta[until + 1] -= size(v)
    running, peak, peak_at = 0, -1, 0
    for t in range(end):
        running += delta[t]
        if running > peak:
            peak, peak_at = running, t

    crossing = {v for v, until in last.items()
                if values[v].producer <= peak_at < until and size(v) > 0}

    def recomputable(v: int) -> bool:
        op = ops[values[v].producer]
        return op.parent is None and op.name in RECOMPUTABLE and len(op.results) == 1

    def late_users(v: int) -> list[int]:
        return sorted({u for u in values[v].users if top[u] > peak_at})

    candidates = [v for v in sorted(crossing) if v not in outputs and recomputable(v)
                  and all(ops[u].parent is None for u in late_users(v))]

    candidate_set = set(candidates)
    matmul_inputs = {x for op in ops if op.name in MATMULS for x in op.operands}

    def boundary(x: int) -> bool:
        """Kept as is by any recomputation that reads it: arguments, what is costly to make,
        and the crossing values that stay (a matmul's input is a layer's natural checkpoint:
        recomputing through it would reach back layer after layer)."""
        return (x in arguments or not recomputable(x)
                or (x in crossing and (x not in candidate_set or x in matmul_inputs)))

    def chain(v: int) -> tuple[set[int], set[int], set[int]] | None:
        """The ops that remake v, the kept values they read, and the other crossing values
        they remake on the way (None: more than max_chain ops)."""
        cloned: set[int] = set()
        kept: set[int] = set()
        through: set[int] = set()
        stack = [v]
        while stack:
            op = ops[values[stack.pop()].producer]
            if op.index in cloned:
                continue
            cloned.add(op.index)
            if len(cloned) > max_chain:
                return None
            for x in op.operands:
                if x in free or values[x].producer > peak_at:
                    continue  # read as is: no buffer, or made after the peak anyway
                if boundary(x):
                    kept.add(x)
                else:
                    if x in crossing:
                        through.add(x)
                    stack.append(x)
        return cloned, kept, through

    chains = {}
    for v in candidates:
        found = chain(v)
        if found is not None:
            chains[v] = found
    # A crossing value another's recomputation reads stays: recomputing it would keep both.
    read = set().union(*(kept for _, kept, _ in chains.values())) if chains else set()
    chains = {v: c for v, c in chains.items() if v not in read}

    # Candidates decided together: those that need the same newly kept value, and a value
    # with the crossing values its recomputation remakes.
    parent = {v: v for v in chains}

    def find(v: int) -> int:
        while parent[v] != v:
            parent[v] = parent[parent[v]]
            v = parent[v]
        return v

    owner: dict[int, int] = {}
    for v, (_, kept, through) in chains.items():
        for x in through:
            if x in chains:
                parent[find(v)] = find(x)
        for k in kept:
            if k in arguments or k in crossing:
                continue
            if k in owner:
                parent[find(v)] = find(owner[k])
            else:
                owner[k] = v
    clusters: dict[int, list[int]] = {}
    for v in chains:
        clusters.setdefault(find(v), []).append(v)
    # Clusters worth recomputing, most bytes freed per byte recomputed first, taken until
    # they free `free_fraction` of the peak.
    worth = []
    for members in clusters.values():
        removed = sum(size(v) for v in members)
        added = sum(size(k) for k in set().union(*(chains[v][1] for v in members))
                    if k not in arguments and k not in crossing)
        if removed - added > min_gain * (removed + added):
            remade = sum(size(r) for index in set().union(*(chains[v][0] for v in members))
                         for r in ops[index].results)
            worth.append(((removed - added) / max(remade, 1), removed - added, sorted(members)))
    worth.sort(key=lambda item: (-item[0], -item[1], item[2][0]))
    chosen: list[int] = []
    freed = 0
    for _, gain, members in worth:
        if freed >= free_fraction * peak:
            break
        chosen.extend(members)
        freed += gain
    return RecomputePlan(peak_at, peak, freed,
                         _groups(graph, chosen, chains, late_users, peak_at, free))


def _groups(graph: Graph, chosen: list[int], chains: dict, late_users, peak_at: int,
            free: set[int]) -> tuple[Recompute, ...]:
    """One Recompute per insertion point, in program order; an op cloned for an earlier group
    is not cloned again (its clone is read)."""
    by_point: dict[int, list[int]] = {}
    for v in chosen:
        by_point.setdefault(late_users(v)[0], []).append(v)
    done: set[int] = set()
    groups = []
    for before in sorted(by_point):
        members = sorted(by_point[before])
        cloned = sorted(set().union(*(chains[v][0] for v in members)) - done)
        done.update(cloned)
        kept = sorted({x for index in cloned for x in graph.ops[index].operands
                       if x not in free and graph.values[x].producer <= peak_at
                       and graph.values[x].producer not in done})
        users = sorted(set().union(*(late_users(v) for v in members)))
        # Clones that read only earlier clones need no barrier: they follow those already.
        trigger = _trigger(graph, before, set(chosen), free) if kept else None
        groups.append(Recompute(before, tuple(cloned), tuple(members), tuple(users),
                                tuple(kept), trigger))
    return tuple(groups)


def _trigger(graph: Graph, before: int, recomputed: set[int], free: set[int]) -> int | None:
    """A tensor op `before` reads, made last (not one of the recomputed values), else the one
    made last before it: the barrier waits for it, so the recomputation stays next to
    `before` (in a train step: it waits for the incoming gradient)."""
    ops, values = graph.ops, graph.values

    def usable(x: int) -> bool:
        producer = ops[values[x].producer]
        return (producer.parent is None and producer.name != "arg" and x not in free
                and x not in recomputed and values[x].type is not None)

    read = [x for x in ops[before].operands if usable(x)]
    if read:
        return max(read, key=lambda x: values[x].producer)
    for index in range(before - 1, -1, -1):
        made = [x for x in ops[index].results if usable(x)]
        if made:
            return made[0]
    return None
