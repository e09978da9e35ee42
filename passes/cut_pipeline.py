"""cut-pipeline: assign every top-level op to a pipeline stage and group ops into tasks.

Plain data in (the graph, the batch analysis), plain data out (`PipelineCut`):
- forward ops of the per-microbatch part are cut into contiguous groups: at given positions
  (`cut_at`: the stages the inter-operator DP chose, hloplan.pipeline_parallel.inter_op), or into `stages` groups
  of balanced cost (`cut`: the cut minimising the most expensive stage; `layer_starts` gives the
  DP its candidate layers the same way);
- a backward op goes to the stage of the forward values it reads (its residuals), else to the
  lowest stage among the backward values it reads (gradients flow down the stages);
- per-step ops (the optimizer) go to the highest stage among what they read, so a parameter's
  update runs where its gradient is;
- ops that read only parameters and constants (invariant) are cloned into each task using them.
Within a part, a task is the ops of one stage between two crossings of a stage boundary, so the
task graph is acyclic by construction: phase(op) = max over its inputs of phase(input) + 1 if
the input comes from another stage.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field

from hloplan.graph import Graph
from hloplan.op_rules import rule_for
from hloplan.passes.label_batch import BatchAnalysis, unit_io, units

BACKWARD_MARK = "transpose("  # jax names ops of the backward pass "transpose(jvp(...))/..."
PART_ORDER = {"P": 0, "A": 1, "B": 2}  # the prologue, per microbatch, once per step


@dataclass
class Task:
    index: int
    part: str  # "P": once per step before the microbatches, "A": per microbatch, "B": after
    stage: int
    phase: int
    units: list[int] = field(default_factory=list)  # top-level op indices, program order
    inputs: list[int] = field(default_factory=list)  # value ids
    outputs: list[int] = field(default_factory=list)  # value ids
    cost: float = 0.0  # FLOPs (relative balance only)

    @property
    def name(self) -> str:
        return f"{self.part.lower()}{self.stage}_{self.phase}"


@dataclass
class PipelineCut:
    stages: int
    tasks: list[Task]
    stage_of_arg: dict[int, int]  # argument value id -> stage holding it
    stage_cost: list[float]  # per-microbatch FLOPs per stage
    forward_units: int = 0
    backward_units: int = 0
    starts: list[int] = field(default_factory=list)  # forward position where each stage starts


def unit_cost(graph: Graph, members, flop_rate: float | None = None,
              memory_bandwidth: float | None = None) -> float:
    """FLOPs of a unit; with a device's FLOP/s and memory bandwidth, its roofline seconds on one
    device (max of arithmetic and memory traffic per op: elementwise work is memory-bound)."""
    total = 0.0
    for op in members:
        if op.name in ("stablehlo.while", "stablehlo.case", "stablehlo.if", "arg"):
            continue
        flops = rule_for(graph, op).flops * op.multiplier
        if flop_rate and memory_bandwidth:
            moved = sum(graph.type_of(v).nbytes for v in (*op.operands, *op.results)
                        if graph.type_of(v) is not None) * op.multiplier
            total += max(flops / flop_rate, moved / memory_bandwidth)
        else:
            total += flops
    return total


def balanced_cut(costs: list[float], parts: int) -> list[int]:
    """Start index of each part, for contiguous parts minimising the largest part's cost
    (binary search on the bound with a greedy fill)."""
    n = len(costs)
    if parts <= 1 or n == 0:
        return [0]
    parts = min(parts, n)

    def fill(limit: float) -> list[int] | None:
        starts, running = [0], 0.0
        for i, cost in enumerate(costs):
            if running + cost > limit and running > 0:
                starts.append(i)
                running = 0.0
            running += cost
        return starts if len(starts) <= parts else None

    low, high = max(costs), sum(costs)
    for _ in range(60):
        mid = (low + high) / 2
        if fill(mid) is None:
            low = mid
        else:
            high = mid
    starts = fill(high) or [0]
    # Use every stage: split the largest parts until there are `parts` of them.
    while len(starts) < parts:
        bounds = starts + [n]
        widths = [(sum(costs[bounds[i]:bounds[i + 1]]), i) for i in range(len(starts))
                  if bounds[i + 1] - bounds[i] > 1]
        if not widths:
            break
        _, i = max(widths)
        lo, hi = bounds[i], bounds[i + 1]
        half, acc, split = sum(costs[lo:hi]) / 2, 0.0, lo + 1
        for j in range(lo, hi - 1):
            acc += costs[j]
            if acc >= half:
                split = j + 1
                break
        starts.insert(i + 1, split)
    return starts


def narrow_cut(costs: list[float], crossings: list[int], parts: int,
               slack: float = 0.05) -> list[int]:
    """Like balanced_cut, but among the cuts whose largest part is within `slack` of the best,
    the one that cuts the fewest live values (`crossings[k]`: values made before position k and
    used at or after it): a layer boundary, where only the residual stream crosses, rather than
    the middle of an attention block."""
    n = len(costs)
    if parts <= 1 or n <= 1:
        return [0]
    best = balanced_cut(costs, parts)
    prefix = list(itertools.accumulate(costs, initial=0.0))
    bounds = best + [n]
    limit = max(prefix[bounds[i + 1]] - prefix[bounds[i]] for i in range(len(best)))
    limit *= 1 + slack
    parts = len(best)
    inf = float("inf")
    # score[j][k]: fewest crossings with j cuts, the last at k, every part so far within limit.
    score = [[inf] * (n + 1) for _ in range(parts)]
    back = [[-1] * (n + 1) for _ in range(parts)]
    score[0][0] = 0
    for j in range(1, parts):
        for k in range(1, n):
            for prev in range(k - 1, -1, -1):
                if prefix[k] - prefix[prev] > limit:
                    break
                if score[j - 1][prev] + crossings[k] < score[j][k]:
                    score[j][k] = score[j - 1][prev] + crossings[k]
                    back[j][k] = prev
    ends = [k for k in range(1, n) if score[parts - 1][k] < inf and prefix[n] - prefix[k] <= limit]
    if not ends:
        return best
    k = min(ends, key=lambda e: (score[parts - 1][e], e))
    starts = [k]
    for j in range(parts - 1, 1, -1):
        k = back[j][k]
        starts.append(k)
    return [0] + sorted(starts)


def timed_cut(seconds: list[float], boundary: list[float], parts: int) -> list[int]:
    """Contiguous parts minimising the slowest part, where a part costs its ops' seconds plus
    the transfers at its two boundaries (`boundary[k]`: seconds to move what crosses position
    k). The pipeline's step is about (M + S - 1) times its slowest stage, so this is the cut
    that balances compute and keeps activations small where they cross (layer boundaries)."""
    n = len(seconds)
    if parts <= 1 or n <= 1:
        return [0]
    parts = min(parts, n)
    prefix = list(itertools.accumulate(seconds, initial=0.0))

    def part(start: int, end: int) -> float:
        return (prefix[end] - prefix[start] + (boundary[start] if start > 0 else 0.0)
                + (boundary[end] if end < n else 0.0))

    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    back = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for j in range(1, parts + 1):
        for end in range(j, n + 1):
            if j == parts and end != n:
                continue
            for start in range(end - 1, j - 2, -1):
                if best[j - 1][start] == inf:
                    continue
                compute = prefix[end] - prefix[start]
                if compute >= best[j][end]:
                    break  # longer parts only get slower
                value = max(best[j - 1][start], part(start, end))
                if value < best[j][end]:
                    best[j][end], back[j][end] = value, start
    starts, end = [], n
    for j in range(parts, 0, -1):
        end = back[j][end]
        starts.append(end)
    return sorted(starts)


def _crossings(graph: Graph, forward: list[int], io, weight=None) -> list[float]:
    """For each position k in `forward`, the values made before k and read at or after k (by
    forward units): their count, or the sum of weight(value)."""
    position = {u: i for i, u in enumerate(forward)}
    made_at = {v: position[u] for u in forward for v in io[u][1]}
    last_read: dict[int, int] = {}
    for u in forward:
        for v in io[u][0]:
            if v in made_at:
                last_read[v] = max(last_read.get(v, 0), position[u])
    delta = [0.0] * (len(forward) + 2)
    for v, made in made_at.items():
        if v in last_read and last_read[v] > made:
            w = 1 if weight is None else weight(v)
            delta[made + 1] += w
            delta[last_read[v] + 1] -= w
    out, running = [], 0
    for k in range(len(forward) + 1):
        running += delta[k]
        out.append(running)
    return out


@dataclass
class CutContext:
    """What every cut of one program shares, computed once (`prepare`): the units, what they
    read and make, the parts, and each unit's position on the forward sequence (`key`): a cut
    into contiguous forward ranges puts a unit on the stage whose range holds its key."""

    graph: Graph
    analysis: BatchAnalysis
    all_units: dict[int, list]
    io: dict[int, tuple[set[int], set[int]]]
    producer_unit: dict[int, int]
    invariant: set[int]
    part_a: list[int]
    part_b: list[int]
    part_p: list[int]  # the prologue: data statistics, once per step before the microbatches
    forward: list[int]
    backward: list[int]
    key: dict[int, int]  # unit -> forward position
    arg_key: dict[int, int]  # argument value id -> forward position of the stage holding it


def prepare(graph: Graph, analysis: BatchAnalysis) -> CutContext:
    """Units, parts and keys: a forward unit's key is its position; a backward unit's is the
    largest key among the forward values it reads (its residuals), else the smallest among the
    backward values it reads (gradients flow down the stages), else the last position; a
    per-step unit's is the largest key among what it reads (a parameter counts at the key of
    its first per-microbatch reader), else 0. Stage numbers grow with positions, so the stage
    of a key is the stage these rules give for any contiguous cut."""
    all_units = units(graph)
    io = {u: unit_io(graph, members) for u, members in all_units.items()}
    producer_unit = {v: u for u, (_, produced) in io.items() for v in produced}
    args = set(graph.arguments)
    dependent = _dependent_units(graph, all_units, io, analysis)
    invariant = {u for u in all_units if u not in dependent}
    # An invariant unit that yields a program result is computed once, in part B.
    outputs = set(graph.outputs)
    owned = {u for u in invariant if io[u][1] & outputs}
    invariant -= owned
    part_a = [u for u in sorted(analysis.part_a) if u not in invariant]
    part_b = sorted({u for u in analysis.part_b if u not in invariant} | owned)

    # Backward: jax's transpose(...) ops and anything computed from them (a learning-rate
    # scaling of a gradient that stays per-microbatch); the rest is forward.
    backward_values: set[int] = set()
    backward = []
    for u in part_a:
        reads, produced = io[u]
        if BACKWARD_MARK in (graph.ops[u].label or "") or reads & backward_values:
            backward.append(u)
            backward_values |= produced
    backward_set = set(backward)
    forward = [u for u in part_a if u not in backward_set]
    key: dict[int, int] = {u: k for k, u in enumerate(forward)}
    forward_set = set(forward)
    last = max(len(forward) - 1, 0)
    for u in backward:
        reads = io[u][0]
        fwd = [key[producer_unit[v]] for v in reads if producer_unit.get(v) in forward_set]
        bwd = [key[producer_unit[v]] for v in reads
               if producer_unit.get(v) in key and producer_unit[v] not in forward_set]
        key[u] = max(fwd) if fwd else min(bwd) if bwd else last
    arg_key: dict[int, int] = {}
    for u in part_a:
        for v in io[u][0]:
            if v in args:
                arg_key.setdefault(v, key[u])
    for u in part_b:
        reads = io[u][0]
        known = [key[producer_unit[v]] for v in reads if producer_unit.get(v) in key]
        known += [arg_key[v] for v in reads if v in arg_key]
        key[u] = max(known) if known else 0
        for v in reads:
            if v in args:
                arg_key.setdefault(v, key[u])
    for v in graph.arguments:
        arg_key.setdefault(v, 0)
    part_p = sorted(u for u in analysis.part_p if u not in invariant)
    return CutContext(graph, analysis, all_units, io, producer_unit, invariant, part_a, part_b,
                      part_p, forward, backward, key, arg_key)


def layer_starts(ctx: CutContext, parts: int, flop_rate: float | None = None,
                 link_bandwidth: float | None = None,
                 memory_bandwidth: float | None = None) -> list[int]:
    """Forward positions where `parts` contiguous parts start. With a device's FLOP/s and the
    stage axis's link bandwidth, the parts balance compute plus boundary transfers (timed_cut);
    without, they balance FLOPs and prefer narrow points."""
    graph, forward, io, all_units = ctx.graph, ctx.forward, ctx.io, ctx.all_units
    if flop_rate and link_bandwidth and memory_bandwidth:
        # Seconds on one device, for both sides: a stage's devices split its compute and each
        # sends its own shard of what crosses. Activations cross forward and their gradients
        # cross back: twice the bytes.
        seconds = [unit_cost(graph, all_units[u], flop_rate, memory_bandwidth) for u in forward]
        crossing = _crossings(graph, forward, io,
                              weight=lambda v: 2.0 * graph.type_of(v).nbytes / link_bandwidth)
        return timed_cut(seconds, crossing, parts)
    costs = [unit_cost(graph, all_units[u]) for u in forward]
    return narrow_cut(costs, _crossings(graph, forward, io), parts)


def cut_at(ctx: CutContext, starts: list[int]) -> PipelineCut:
    """The cut whose stage s starts at forward position starts[s] (starts[0] == 0)."""
    stages = len(starts)
    stage = {u: max(bisect.bisect_right(starts, k) - 1, 0) for u, k in ctx.key.items()}
    stage_of_arg = {v: max(bisect.bisect_right(starts, k) - 1, 0) for v, k in ctx.arg_key.items()}
    tasks = _tasks(ctx.graph, ctx.all_units, ctx.io, ctx.producer_unit, stage, ctx.part_a,
                   ctx.part_b, ctx.invariant, ctx.analysis, stages, ctx.part_p)
    stage_cost = [0.0] * stages
    for task in tasks:
        if task.part == "A":
            stage_cost[task.stage] += task.cost
    return PipelineCut(stages, tasks, stage_of_arg, stage_cost, len(ctx.forward),
                       len(ctx.backward), list(starts))


def cut(graph: Graph, analysis: BatchAnalysis, stages: int, flop_rate: float | None = None,
        link_bandwidth: float | None = None, memory_bandwidth: float | None = None) -> PipelineCut:
    """`stages` contiguous stages of balanced cost (see layer_starts)."""
    ctx = prepare(graph, analysis)
    return cut_at(ctx, layer_starts(ctx, stages, flop_rate, link_bandwidth, memory_bandwidth))


def _dependent_units(graph, all_units, io, analysis: BatchAnalysis) -> set[int]:
    """Units that depend on the batch inputs (part A) or on a partial sum (part B). A
    batch-shaped value made from constants (a causal mask) is not: it is cloned into each task
    that reads it."""
    dependent: set[int] = set()
    batch_inputs = {graph.arguments[p] for p in analysis.batch_args}
    produced_by_dependent: set[int] = set()
    for u in sorted(all_units):
        reads, produced = io[u]
        if reads & produced_by_dependent or reads & batch_inputs or reads & analysis.frontier:
            dependent.add(u)
            produced_by_dependent |= produced
    return dependent


def _tasks(graph, all_units, io, producer_unit, stage, part_a, part_b, invariant, analysis,
           stages, part_p=()) -> list[Task]:
    tasks: dict[tuple[str, int, int], Task] = {}
    batch_values = {graph.arguments[p] for p in analysis.batch_args} | analysis.frontier
    # The prologue runs on the first stage, before any microbatch (its units that part A
    # needs too run there as well, per microbatch).
    first = {u: 0 for u in part_p}
    for part, members, where in (("P", part_p, first), ("A", part_a, stage), ("B", part_b, stage)):
        phase = _phases(members, io, producer_unit, where, batch_values)
        for u in members:
            p = phase[u]
            key = (part, where[u], p)
            if key not in tasks:
                tasks[key] = Task(0, part, where[u], p)
            tasks[key].units.append(u)
            tasks[key].cost += unit_cost(graph, all_units[u])
    ordered = sorted(tasks.values(), key=lambda t: (PART_ORDER[t.part], t.phase, t.stage))
    for i, task in enumerate(ordered):
        task.index = i
    # Invariant units are cloned into every task that reads them (transitively).
    for task in ordered:
        needed: list[int] = []
        pending = [v for u in task.units for v in io[u][0]]
        seen: set[int] = set()
        while pending:
            v = pending.pop()
            src = producer_unit.get(v)
            if src is None or src not in invariant or src in seen:
                continue
            seen.add(src)
            needed.append(src)
            pending.extend(io[src][0])
        task.units = sorted(set(task.units) | set(needed))
    program_outputs = set(graph.outputs)
    consumers: dict[int, set[int]] = {}
    for task in ordered:
        produced = {v for u in task.units for v in io[u][1]}
        reads = {v for u in task.units for v in io[u][0]} - produced
        task.inputs = sorted(v for v in reads if _is_input(graph, v, producer_unit, invariant))
        for v in task.inputs:
            consumers.setdefault(v, set()).add(task.index)
    for task in ordered:
        # Only values visible at the top level can leave a task (not those inside loop bodies).
        own = {v for u in task.units if u not in invariant for v in io[u][1]
               if graph.producer(v).parent is None}
        # A partial sum leaves only where another task or the results read it: those inside
        # a task (a weight gradient before its reshape) are neither summed nor held.
        task.outputs = sorted(v for v in own if v in consumers or v in program_outputs)
        if task.part == "P":  # per-example values come from part A's own copy of the units
            task.outputs = [v for v in task.outputs if v not in analysis.label]
    return ordered


def _phases(members: list[int], io, producer_unit, stage, batch_values: set[int]) -> dict[int, int]:
    """phase(u) = max over its sources of phase(source) + 1 if the source is on another stage.

    Units not anchored to the data flow (they read neither the batch, nor partial sums, nor
    anything from another stage, transitively: zero buffers, batch-shaped constants) start at
    their stage's first anchored phase instead of 0, so they join that task rather than forming
    a task of their own ahead of it."""
    member_set = set(members)
    anchored: dict[int, bool] = {}

    def sweep(entry: dict[int, int]) -> dict[int, int]:
        out: dict[int, int] = {}
        for u in members:
            reads = io[u][0]
            sources = [src for src in (producer_unit.get(v) for v in reads)
                       if src in member_set and src in out]
            anchored[u] = bool(reads & batch_values) or any(
                anchored[src] or stage[src] != stage[u] for src in sources)
            p = 0 if anchored[u] else entry.get(stage[u], 0)
            for src in sources:
                p = max(p, out[src] + (1 if stage[src] != stage[u] else 0))
            out[u] = p
        return out

    first = sweep({})
    entry: dict[int, int] = {}
    for u in members:
        if anchored[u]:
            entry[stage[u]] = min(entry.get(stage[u], first[u]), first[u])
    return sweep(entry)


def _is_input(graph: Graph, v: int, producer_unit, invariant) -> bool:
    src = producer_unit.get(v)
    if src is None:
        return True  # an argument
    if src in invariant:
        return False  # cloned into the task
    return graph.ops[src].name != "stablehlo.constant"


def stage_rounds(cut_: PipelineCut) -> dict[int, list[list[int]]]:
    """Per stage, its part-A tasks in phase order: the first is the stage's forward, the rest its
    backward (1F1B runs them as one backward step)."""
    rounds: dict[int, list[list[int]]] = {}
    for task in cut_.tasks:
        if task.part == "A":
            rounds.setdefault(task.stage, []).append([task.index])
    return rounds


def schedule(cut_: PipelineCut, microbatches: int, kind: str) -> list[tuple[int, int]]:
    """A global dispatch order of (task index, microbatch) for the part-A tasks.

    gpipe: every microbatch through each task in turn (all forwards, then all backwards);
    1f1b: per stage, warm-up forwards, then alternate one forward / one backward, then drain;
    the per-stage sequences are merged in an order that respects dependencies."""
    a_tasks = [t for t in cut_.tasks if t.part == "A"]
    if kind == "gpipe":
        order = sorted(a_tasks, key=lambda t: (t.phase, t.stage))
        return [(t.index, m) for t in order for m in range(microbatches)]
    per_stage: dict[int, list[Task]] = {}
    for t in sorted(a_tasks, key=lambda t: t.phase):
        per_stage.setdefault(t.stage, []).append(t)
    stages = cut_.stages
    sequences: dict[int, list[list[tuple[int, int]]]] = {}
    for s, tasks in per_stage.items():
        fwd, bwd = tasks[0], tasks[1:]
        steps: list[list[tuple[int, int]]] = []
        warmup = min(stages - s - 1, microbatches)
        f_next = b_next = 0
        for _ in range(warmup):
            steps.append([(fwd.index, f_next)])
            f_next += 1
        while b_next < microbatches:
            if f_next < microbatches:
                steps.append([(fwd.index, f_next)])
                f_next += 1
            if bwd:
                steps.append([(t.index, b_next) for t in bwd])
            b_next += 1
        sequences[s] = steps
    producers: dict[int, set[int]] = {}
    value_task = {v: t.index for t in a_tasks for v in t.outputs}
    for t in a_tasks:
        producers[t.index] = {value_task[v] for v in t.inputs if v in value_task} - {t.index}
    done: set[tuple[int, int]] = set()
    order: list[tuple[int, int]] = []
    cursors = {s: 0 for s in sequences}
    while any(cursors[s] < len(sequences[s]) for s in sequences):
        progressed = False
        for s in sorted(sequences):
            if cursors[s] >= len(sequences[s]):
                continue
            step = sequences[s][cursors[s]]
            if all((p, m) in done for t, m in step for p in producers[t]):
                for item in step:
                    order.append(item)
                    done.add(item)
                cursors[s] += 1
                progressed = True
        if not progressed:  # should not happen for an acyclic cut: fall back to GPipe order
            return schedule(cut_, microbatches, "gpipe")
    return order
