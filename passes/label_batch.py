"""label-batch: find the batch axis and the accumulation frontier of a train step.

An analysis, not a pass of the compile pipeline: the pipeline and accumulation planner
(hloplan.pipeline_parallel) runs it on the inlined graph through `analyse_program`.

Starting from the inputs that carry the batch, the label (which dim of each value is the batch)
is propagated through the ops' factor rules (op_rules): a pass-through factor keeps it, a
sum over it (a weight gradient's dot_general, a bias gradient's or the loss's reduce-sum, a
scatter-add) ends it: that value is a partial sum over the batch, on the accumulation frontier.

Splitting the batch into microbatches is exact when the program factors into
- part A, per microbatch: everything from the batch inputs up to the frontier, and
- part B, once per step: everything after the frontier (scaling, the optimizer update),
and no part-B op reads a batch-labelled value (batch statistics, as in BatchNorm, or a max over
the batch make it inexact). Where that does not hold, the pass says why, at the op.

A sum over the batch computed from the batch inputs alone (a masked mean's token count,
`sum(weights)`) is a statistic of the data, not of the model: it is computed once per step on
the whole batch (part P, the prologue, before the microbatches) and read by every microbatch as
a constant, so losses normalised by it split exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hloplan.diagnostics import Diagnostic, HloplanError
from hloplan.graph import Graph, Op
from hloplan.op_rules import FREE_IF_INPUTS_FREE, rule_for

SUM_OPS = {"stablehlo.dot_general", "stablehlo.convolution", "stablehlo.reduce",
           "stablehlo.scatter"}
UNPLANNED = {"stablehlo.while", "stablehlo.case", "stablehlo.if"}


class BatchError(Exception):
    def __init__(self, op: Op | None, message: str):
        super().__init__(message)
        self.op = op
        self.message = message


@dataclass
class BatchAnalysis:
    batch_args: list[int]  # argument positions
    batch_size: int
    label: dict[int, int] = field(default_factory=dict)  # value id -> batch dim
    frontier: set[int] = field(default_factory=set)  # value ids: partial sums over the batch
    part_a: set[int] = field(default_factory=set)  # op indices run per microbatch
    part_b: set[int] = field(default_factory=set)  # op indices run once per step
    # The units computing sums over the batch of the batch inputs alone, once per step on the
    # whole batch before the microbatches (part P).
    part_p: set[int] = field(default_factory=set)  # op indices

    def describe(self, graph: Graph) -> str:
        names = ", ".join(graph.argument_names[i] for i in self.batch_args)
        return (f"batch of {self.batch_size} in {names}; {len(self.frontier)} values accumulated "
                f"over microbatches")


def data_statistics(graph: Graph, batch_args: list[int], frontier: set[int]) -> set[int]:
    """Frontier values computed from the batch inputs and constants alone (no parameter, no
    other argument): sums over the batch of the data itself, such as a masked mean's count."""
    batch = {graph.arguments[p] for p in batch_args}
    others = set(graph.arguments) - batch
    pure: dict[int, bool] = {}

    def data_only(value_id: int) -> bool:
        stack = [value_id]
        while stack:  # the graph outside loops is acyclic: a depth-first walk ends
            v = stack[-1]
            if v in pure:
                stack.pop()
                continue
            if v in others or v in batch:
                pure[v] = v in batch
                stack.pop()
                continue
            op = graph.producer(v)
            if op.name in UNPLANNED or op.name.startswith("while.") or op.parent is not None:
                pure[v] = False  # loops and their bodies are not split this way
                stack.pop()
                continue
            waiting = [u for u in op.operands if u not in pure]
            if waiting:
                stack.extend(waiting)
                continue
            pure[v] = all(pure[u] for u in op.operands)
            stack.pop()
        return pure[value_id]

    return {v for v in frontier if data_only(v)}


def propagate(graph: Graph, batch_args: list[int]) -> tuple[dict[int, int], set[int], set[int]]:
    """Labels, frontier and data statistics (computed once per step, see the module's
    docstring): statistics are found on a first sweep, and the second treats them as
    constants, so that what reads them with per-example values stays per microbatch."""
    label, frontier = _propagate_assuming(graph, batch_args, frozenset())
    statistics = data_statistics(graph, batch_args, frontier)
    if not statistics:
        return label, frontier, set()
    label, frontier = _propagate_assuming(graph, batch_args, frozenset(statistics))
    return label, frontier, statistics


def _propagate_assuming(graph: Graph, batch_args: list[int], prologue: frozenset[int]
                        ) -> tuple[dict[int, int], set[int]]:
    """Batch labels and frontier values from the given argument positions; BatchError if an op
    mixes or drops the batch in a way microbatching cannot follow.

    A loop that accumulates partial sums into a zero-initialised carry (the weight gradients of
    a scanned backward pass) is a fixpoint the forward sweep cannot reach from below: every
    zero-initialised carry is first assumed to be a partial sum, and assumptions its loop body
    does not confirm (a counter starting at 0) are dropped until the labels are consistent."""
    zeros = zero_values(graph)
    assumed = {op.results[0] for op in graph.ops
               if op.name == "while.carry" and op.operands[0] in zeros and "yield" in op.attrs
               and graph.type_of(op.results[0]).dtype.startswith(("f", "bf"))}  # not counters
    order = sorted(assumed, key=lambda v: graph.values[v].producer)
    while True:
        try:
            label, frontier = _propagate(graph, batch_args, assumed, prologue)
        except BatchError:
            if not assumed:
                raise
            assumed.discard(next(v for v in order if v in assumed))  # a wrong assumption
            continue
        wrong = [op.results[0] for op in graph.ops if op.results and op.results[0] in assumed
                 and op.attrs.get("yield") not in frontier]
        if not wrong:
            return label, frontier
        # Drop the first wrong assumption only: a wrong assumption upstream (a forward loop's
        # residual buffer) can spoil a right one downstream (the backward loop's gradients).
        assumed.discard(wrong[0])


def _propagate(graph: Graph, batch_args: list[int], assumed: set[int],
               prologue: frozenset[int] = frozenset()) -> tuple[dict[int, int], set[int]]:
    label: dict[int, int] = {}
    frontier: set[int] = set(assumed)
    for position in batch_args:
        label[graph.arguments[position]] = 0
    rules = {}
    zeros = zero_values(graph)
    tainted: set[int] = set()  # computed from partial sums non-linearly: part B
    for _ in range(8):  # loops carry labels around: iterate to a fixpoint
        changed = False
        for op in graph.ops:
            if op.name in UNPLANNED or op.name == "arg":
                continue
            inputs = list(op.operands)
            if op.name == "while.carry" and "yield" in op.attrs:
                inputs.append(op.attrs["yield"])
            if any(v in frontier or v in tainted for v in inputs):
                if any(v in label for v in inputs):
                    continue  # part B reading per-example values: split_parts explains
                result = _linear_in_frontier(graph, op, inputs, frontier, tainted, zeros)
                target = frontier if result else tainted
                for value_id in op.results:
                    if value_id not in target:
                        target.add(value_id)
                        changed = True
                continue
            labelled = [(k, v) for k, v in enumerate(inputs) if v in label]
            if not labelled:
                continue
            rule = rules.get(op.index) or rules.setdefault(op.index, rule_for(graph, op))
            if op.name == "while.carry":
                dims = [label[v] for _, v in labelled]
                if len(set(dims)) != 1:
                    raise BatchError(op, "a loop carries the batch in different dimensions")
                new = {op.results[0]: dims[0]}
            else:
                new, summed = _through(graph, op, rule, labelled, label)
                if summed:
                    for result in op.results:
                        if result not in frontier and result not in prologue:
                            frontier.add(result)
                            changed = True
            for value_id, dim in new.items():
                if label.get(value_id) != dim:
                    if value_id in label:
                        raise BatchError(op, "the batch moves between dimensions in a loop")
                    label[value_id] = dim
                    changed = True
        if not changed:
            break
    return label, frontier


def zero_values(graph: Graph) -> set[int]:
    """Values that are all zeros: splat 0 constants and broadcasts/reshapes of them."""
    zeros: set[int] = set()
    for op in graph.ops:
        if (op.name == "stablehlo.constant" and op.attrs.get("splat") in (0, 0.0)) or (
                op.name in FREE_IF_INPUTS_FREE and op.operands
                and all(v in zeros for v in op.operands)):
            zeros.update(op.results)
    return zeros


# Ops linear in each operand (sum over microbatches commutes with them when every operand is a
# partial sum or zero).
_LINEAR_ALL = {"stablehlo.add", "stablehlo.subtract", "stablehlo.concatenate", "case.result"}
# Ops linear in one operand when the others are invariant (not per-example, not partial sums).
_LINEAR_ONE = {"stablehlo.negate", "stablehlo.convert", "stablehlo.reshape", "stablehlo.transpose",
               "stablehlo.broadcast_in_dim", "stablehlo.slice", "stablehlo.dynamic_slice",
               "stablehlo.multiply", "stablehlo.dot_general", "barrier.result", "stablehlo.reverse",
               "stablehlo.copy"}


def _linear_in_frontier(graph: Graph, op: Op, inputs: list[int], frontier: set[int],
                        tainted: set[int], zeros: set[int]) -> bool:
    """Whether `op` maps partial sums to a partial sum (so it may run per microbatch)."""
    partial = [k for k, v in enumerate(inputs) if v in frontier]
    if any(v in tainted for v in inputs) or not partial:
        return False
    name = op.name
    if name in _LINEAR_ALL:
        return all(v in frontier or v in zeros for v in inputs)
    if name in _LINEAR_ONE:
        return len(partial) == 1
    if name == "stablehlo.divide":
        return partial == [0]
    if name == "stablehlo.reduce":
        return op.attrs.get("combiner") == "stablehlo.add" and len(partial) == 1 and partial == [0]
    if name == "stablehlo.pad":
        return partial == [0] and inputs[1] in zeros
    if name == "stablehlo.dynamic_update_slice":
        return 1 in partial and (inputs[0] in frontier or inputs[0] in zeros) and all(
            v not in frontier for v in inputs[2:])
    if name == "stablehlo.select":
        return 0 not in partial and all(v in frontier or v in zeros for v in inputs[1:])
    if name == "while.carry":  # a loop accumulating partial sums into a zero-initialised carry
        return all(v in frontier or v in zeros for v in inputs)
    return False


# Ops whose result varies along a dim no operand carries (random bits, opaque calls): never
# the same in every example.
_UNKNOWN_ALONG = {"stablehlo.rng", "stablehlo.rng_bit_generator", "stablehlo.custom_call",
                  "stablehlo.infeed", "stablehlo.recv", "stablehlo.while", "stablehlo.case",
                  "stablehlo.if", "arg"}


def _broadcast_to_batch(graph: Graph, value_id: int, dim: int, label: dict[int, int]) -> bool:
    """Whether `value_id` got its batch-sized dim `dim` without batch data and is the same at
    every position along it (a bias broadcast to every example, `jnp.ones_like(input_ids)`,
    position ids broadcast from an iota over the sequence, embeddings gathered with them): its
    microbatch-sized version, made by the same ops, is then every microbatch's slice of it.
    If so, it and the values it is made from along that dim are labelled, so that microbatching
    resizes them; nothing is labelled otherwise."""
    found: dict[int, int] = {}
    if not _same_along(graph, value_id, dim, label, found):
        return False
    label.update(found)
    return True


def _same_along(graph: Graph, value_id: int, dim: int, label: dict[int, int],
                found: dict[int, int]) -> bool:
    """`_broadcast_to_batch`'s check, collecting into `found` the labels it would add."""
    known = label.get(value_id, found.get(value_id))
    if known is not None:
        return known == dim
    op = graph.producer(value_id)
    type_ = graph.type_of(value_id)
    if op.name in _UNKNOWN_ALONG or op.name.startswith("while.") and op.name != "while.carry":
        return False
    if op.name == "stablehlo.constant":
        ok = "splat" in op.attrs  # resizable, and the same everywhere
    elif op.name == "stablehlo.iota":
        ok = op.attrs.get("iota_dimension") != dim  # counts along another dim
    elif op.name == "stablehlo.broadcast_in_dim":
        mapped = op.attrs.get("broadcast_dimensions", [])
        operand = graph.type_of(op.operands[0])
        source = [i for i, d in enumerate(mapped) if d == dim and operand.shape[i] > 1]
        ok = not source or _same_along(graph, op.operands[0], source[0], label, found)
    elif op.name == "stablehlo.transpose":
        ok = _same_along(graph, op.operands[0], op.attrs["permutation"][dim], label, found)
    elif op.name == "while.carry":  # a loop buffer (scan outputs)
        ok = _same_along(graph, op.operands[0], dim, label, found)
    else:
        ok = _same_along_factor(graph, op, value_id, dim, label, found)
    if ok and type_ is not None:
        found[value_id] = dim
    return ok


def _same_along_factor(graph: Graph, op: Op, value_id: int, dim: int, label: dict[int, int],
                       found: dict[int, int]) -> bool:
    """Through any other op by its factor rule: the result dim's factor passes through
    (no reduction, window or sort over it) from some operand, and every operand dim holding it
    is the same along it; operands without the factor (a gathered table, a weight) do not vary
    with it."""
    rule = rule_for(graph, op)
    if rule.fallback is not None or value_id not in op.results:
        return False
    dims = rule.results[op.results.index(value_id)]
    if dim >= len(dims) or len(dims[dim]) != 1:
        return False
    factor = dims[dim][0]
    if rule.factors[factor].kind != "pass":
        return False
    carried = False
    for operand, operand_dims in zip(op.operands, rule.operands):
        for d, fs in enumerate(operand_dims or ()):
            if factor not in fs:
                continue
            if fs != (factor,) or not _same_along(graph, operand, d, label, found):
                return False
            carried = True
    # A factor no operand carries is the op's own (a slice, pad or gathered window along the
    # dim): its positions read different elements.
    return carried


def _through(graph: Graph, op: Op, rule, labelled, label) -> tuple[dict[int, int], bool]:
    factors = set()
    for k, value_id in labelled:
        dims = rule.operands[k] if k < len(rule.operands) else None
        dim = label[value_id]
        if dims is None or dim >= len(dims) or not dims[dim]:
            raise BatchError(op, f"'{op.name}' does not keep the batch dimension of operand {k} "
                             "intact (it slices, pads, concatenates or replicates it)")
        factors.add(dims[dim][0])
    if len(factors) != 1:
        raise BatchError(op, f"'{op.name}' combines batch-labelled operands along different dims")
    factor = factors.pop()
    kind = rule.factors[factor].kind
    if kind == "replicate":
        raise BatchError(op, f"'{op.name}' needs the whole batch at once (sort, window or "
                         "concatenation over it)")
    # Any operand holding the factor must be batch-derived too (or free, e.g. a splat): it will
    # be sliced into microbatches with the others.
    for k, value_id in enumerate(op.operands):
        dims = rule.operands[k] if k < len(rule.operands) else None
        if value_id in label or not dims:
            continue
        dim = next((d for d, fs in enumerate(dims) if fs and fs[0] == factor), None)
        if dim is not None and not _broadcast_to_batch(graph, value_id, dim, label):
            raise BatchError(op, f"'{op.name}' combines the batch with operand {k}, which has the "
                             "batch size but does not come from the batch inputs")
    if kind == "reduce":
        if op.name not in SUM_OPS or rule.reduction != "sum":
            raise BatchError(op, f"'{op.name}' reduces over the batch with '{rule.reduction}', "
                             "which is not a sum: microbatches would change the result")
        return {}, True
    result: dict[int, int] = {}
    for value_id, dims in zip(op.results, rule.results):
        for d, fs in enumerate(dims):
            if fs and fs[0] == factor:
                result[value_id] = d
            elif factor in fs:
                raise BatchError(op, f"'{op.name}' merges the batch into another dimension as "
                                 "its minor part")
    if not result:
        raise BatchError(op, f"'{op.name}' drops the batch dimension")
    return result, False


def units(graph: Graph) -> dict[int, list[Op]]:
    """Top-level units in program order: each op outside regions, with a while or case taking
    its carries/results and every op of its regions along."""
    unit_of: dict[int, int] = {}
    for op in graph.ops:
        if op.name in UNPLANNED:
            for member in op.attrs.get("carries", []) + op.attrs.get("results", []):
                unit_of[member] = op.index
    out: dict[int, list[Op]] = {}
    for op in graph.ops:
        if op.name == "arg":
            continue
        top = op
        while True:
            if top.index in unit_of:
                top = graph.ops[unit_of[top.index]]
            elif top.parent is not None:
                top = graph.ops[top.parent]
            else:
                break
        out.setdefault(top.index, []).append(op)
    return out


def unit_io(graph: Graph, members: list[Op]) -> tuple[set[int], set[int]]:
    """(values a unit reads from outside, values it defines)."""
    reads: set[int] = set()
    produced: set[int] = set()
    for member in members:
        reads.update(member.operands)
        if member.name == "while.carry" and "yield" in member.attrs:
            reads.add(member.attrs["yield"])
        produced.update(member.results)
    return reads - produced, produced


def prologue_units(graph: Graph, statistics: set[int]) -> set[int]:
    """Top-level units computing the data statistics (all of them top-level ops: see
    data_statistics), back to the batch inputs."""
    arguments = set(graph.arguments)
    out: set[int] = set()
    stack = list(statistics)
    seen: set[int] = set()
    while stack:
        v = stack.pop()
        if v in seen or v in arguments:
            continue
        seen.add(v)
        op = graph.producer(v)
        out.add(op.index)
        stack.extend(op.operands)
    return out


def split_parts(graph: Graph, label: dict[int, int], frontier: set[int],
                part_p: set[int] = frozenset()) -> tuple[set[int], set[int]]:
    """Top-level unit indices of part A (per microbatch) and part B (once per step).

    A unit is in part B when it reads a frontier value or a part-B value; in part A when it
    reads a batch-labelled value or produces one (or a frontier value); units that depend on
    neither are invariant and go where they are used (both parts when both use them). The
    prologue's units (`part_p`) are neither, but also run per microbatch where part A reads
    their per-example values."""
    kinds: dict[int, str] = {}
    value_kind: dict[int, str] = {}
    all_units = units(graph)
    for index, members in all_units.items():
        reads, produced = unit_io(graph, members)
        if index in part_p:
            kinds[index] = "P"
            continue
        # Partial sums feed part B, unless the unit maps them linearly to partial sums (then
        # it may run per microbatch, its results summed instead). It does only where it must
        # (a loop that also reads the batch): a linear map of partial sums alone (a gradient's
        # reshape, Adam's (1 - b1) * g) runs once per step on the sums, so that the
        # microbatches hand over, and the loader sums and holds, only the first partial sums.
        reads_partial = bool(reads & frontier) and not (produced and produced <= frontier)
        after_sums = bool(reads & frontier) and not any(v in label for v in reads | produced)
        in_b = any(value_kind.get(v) == "B" for v in reads) or reads_partial or after_sums
        in_a = any(v in label for v in reads | produced) or bool(produced & frontier)
        if in_b and any(v in label for v in reads):
            top = graph.ops[index]
            raise BatchError(top, f"'{top.name}' reads a per-example value after the batch "
                             "was summed (batch statistics, as in BatchNorm): microbatching "
                             "would change the result")
        kind = "B" if in_b else "A" if in_a else "I"
        kinds[index] = kind
        for v in produced:
            value_kind[v] = kind
    unit_of_op = {op.index: index for index, members in all_units.items() for op in members}
    user_units: dict[int, set[int]] = {}
    for index, members in all_units.items():
        _, produced = unit_io(graph, members)
        users = set()
        for v in produced:
            for user in graph.values[v].users:
                if unit_of_op.get(user, index) != index:
                    users.add(unit_of_op[user])
            if v in graph.outputs:
                users.add(-1)  # the program's results are assembled after part B
        user_units[index] = users
    placement: dict[int, set[str]] = {}
    for index in sorted(all_units, reverse=True):
        if kinds[index] == "P":  # and in part A too when a microbatch reads its per-example
            _, produced = unit_io(graph, all_units[index])  # values (not the statistics)
            placement[index] = {"P"} | ({"A"} if any(
                "A" in placement.get(unit_of_op.get(user), ()) for v in produced if v in label
                for user in graph.values[v].users) else set())
            continue
        if kinds[index] != "I":
            placement[index] = {kinds[index]}
            continue
        where: set[str] = set()
        for user in user_units[index]:
            where |= {"B"} if user == -1 else placement.get(user, {"B"})
        placement[index] = where or {"B"}
    part_a = {i for i, where in placement.items() if "A" in where}
    part_b = {i for i, where in placement.items() if "B" in where}
    return part_a, part_b


def state_like_args(graph: Graph) -> set[int]:
    """Argument positions that flow into an output through pointwise ops only (parameters and
    optimizer state updated in place): never batch inputs."""
    return set(state_outputs(graph))


def state_outputs(graph: Graph) -> dict[int, int]:
    """Argument position -> the output value it becomes through pointwise ops of its own type
    (a parameter's or an optimizer moment's next value), for the arguments that have one."""
    outputs = set(graph.outputs)
    state: dict[int, int] = {}
    for position, value_id in enumerate(graph.arguments):
        frontier_ = [value_id]
        seen = set()
        while frontier_:
            v = frontier_.pop()
            if v in outputs:
                state[position] = v
                break
            for user in graph.values[v].users:
                op = graph.ops[user]
                if user in seen or not rule_for(graph, op).pointwise or len(op.results) != 1:
                    continue
                seen.add(user)
                if graph.type_of(op.results[0]) == graph.type_of(value_id):
                    frontier_.append(op.results[0])
    return state


def analyse(graph: Graph, batch_args: list[int] | None = None) -> BatchAnalysis:
    """Find the batch inputs (unless given) and split the program; BatchError when impossible."""
    if batch_args is not None:
        candidates = [batch_args]
    else:
        state = state_like_args(graph)
        sizes: dict[int, list[int]] = {}
        for position, value_id in enumerate(graph.arguments):
            type_ = graph.type_of(value_id)
            if type_ is not None and type_.rank >= 1 and position not in state and type_.shape[0] > 1:
                sizes.setdefault(type_.shape[0], []).append(position)
        candidates = [args for _, args in sorted(sizes.items(), key=lambda kv: (-len(kv[1]), -kv[0]))]
        # Fall back to single arguments when a whole same-size group fails (a weight whose first
        # dim happens to equal the batch size).
        candidates += [[p] for args in list(candidates) if len(args) > 1 for p in args]
    if not candidates:
        raise BatchError(None, "no input has a leading dimension that could be the batch")
    first_error: BatchError | None = None
    for args in candidates:
        sizes_ = {graph.type_of(graph.arguments[p]).shape[0] for p in args}
        if len(sizes_) != 1:
            continue
        try:
            label, frontier, statistics = propagate(graph, args)
            part_p = prologue_units(graph, statistics)
            part_a, part_b = split_parts(graph, label, frontier, part_p)
        except BatchError as exc:
            first_error = first_error or exc
            continue
        return BatchAnalysis(list(args), sizes_.pop(), label, frontier, part_a, part_b, part_p)
    raise first_error or BatchError(None, "no consistent batch input found")


def analyse_program(graph: Graph, batch_arg_names: tuple[str, ...] = ()) -> BatchAnalysis:
    """analyse() with the batch inputs named by the user (if any), its failure a located
    diagnostic."""
    positions = [_resolve_arg(graph, a) for a in batch_arg_names] if batch_arg_names else None
    try:
        return analyse(graph, positions)
    except BatchError as exc:
        op = exc.op
        raise HloplanError(Diagnostic(
            "error", f"cannot split the batch into microbatches: {exc.message}",
            op.location if op else None, op=op.name if op else None,
            notes=("name the batch inputs with --batch-arg NAME, or plan without "
                   "--microbatches/--stages",))) from None


def _resolve_arg(graph: Graph, name: str) -> int:
    if name.isdigit() and int(name) < len(graph.arguments):
        return int(name)
    for position, arg_name in enumerate(graph.argument_names):
        if arg_name == name:
            return position
    raise HloplanError(f"--batch-arg {name!r} names no argument; arguments are: "
                       + ", ".join(graph.argument_names))
