"""Which values XLA's TPU compiler writes out, where its fusion differs from the generic rules of
op_rules (the memory estimate's `[buffers] fused_reductions = true` device models).

Each rule is one seen in libtpu's buffer assignment (libtpu 0.0.42, `xla_dump_to` of
benchmarks/tpu_memory.py's train steps); the estimate applies them to the set of values it
holds no buffer for (build-sharding-problem's `unmaterialized`).
"""

from __future__ import annotations

from hloplan.graph import Graph
from hloplan.op_rules import fusible_consumer, fusible_producer


def select_scatters(graph: Graph, free: set[int]) -> set[int]:
    """Scatters XLA rewrites as an elementwise select: one element per index (no update
    window beyond size-1 dims) into a splat (a constant broadcast). `scatter-add` of a cross
    entropy's label gradient into zeros over the vocabulary becomes
    `select(iota == label, update, 0)`, fused into the kernel that reads it; the scattered
    f32 logit-sized value is never written out. Op indices."""
    out = set()
    for op in graph.ops:
        if op.name != "stablehlo.scatter" or len(op.operands) != 3 or len(op.results) != 1:
            continue
        operand, _, updates = op.operands
        update_type = graph.type_of(updates)
        if operand not in free or update_type is None:
            continue
        window = 1
        for dim in op.attrs.get("update_window_dims", ()):
            window *= update_type.shape[dim]
        if window == 1:
            out.add(op.index)
    return out


def fused_selects(graph: Graph, free: set[int]) -> set[int]:
    """Values of select_scatters read only by fusible ops of their region: computed inside
    those ops' kernel, no buffer."""
    out = set()
    for index in select_scatters(graph, free):
        op = graph.ops[index]
        value = graph.values[op.results[0]]
        if value.id in graph.outputs or not value.users:
            continue
        if all(fusible_consumer(graph.ops[u].name)
               and (graph.ops[u].parent, graph.ops[u].region) == (op.parent, op.region)
               for u in value.users):
            out.add(value.id)
    return out


def sliced_matmuls(graph: Graph) -> set[int]:
    """Matmul results read only by one slice: XLA slices the matmul's operands instead
    (every dim of a dot's result is a batch or free dim of an operand), so only the slice is
    written out (libtpu: a shifted cross entropy's `logits[:, :-1]` is a matmul of the sliced
    activations, the whole logits never exist). Value ids."""
    out = set()
    for op in graph.ops:
        if op.name != "stablehlo.dot_general" or len(op.results) != 1:
            continue
        value = graph.values[op.results[0]]
        if (value.id not in graph.outputs and len(value.users) == 1
                and graph.ops[value.users[0]].name == "stablehlo.slice"):
            out.add(value.id)
    return out


def output_fused_matmuls(graph: Graph, fused: set[int], limit: int = 64) -> set[int]:
    """Matmul results read only by elementwise and layout ops that make one written-out
    value between them (following the fused values they make, none read elsewhere): XLA's
    TPU compiler computes the matmul inside that kernel (an output fusion) and writes only
    its result. A GELU MLP's backward pass: the hidden gradient `g @ w2^T`, multiplied by
    the activation's derivative in a dozen ops, is one kernel writing the bf16 product; the
    f32 matmul result never exists. Value ids."""
    out = set()
    for op in graph.ops:
        if op.name != "stablehlo.dot_general" or len(op.results) != 1:
            continue
        value = graph.values[op.results[0]]
        if value.id in graph.outputs or not value.users:
            continue
        seen: set[int] = set()
        sinks: set[int] = set()
        stack = list(value.users)
        ok = True
        while stack and ok:
            index = stack.pop()
            if index in seen:
                continue
            seen.add(index)
            user = graph.ops[index]
            if (len(seen) > limit or not fusible_producer(user.name)
                    or (user.parent, user.region) != (op.parent, op.region)):
                ok = False
                break
            for result in user.results:
                if result in fused:
                    stack.extend(graph.values[result].users)
                else:
                    sinks.add(result)
            ok = len(sinks) <= 1
        if ok and len(sinks) == 1:
            out.add(value.id)
    return out


def pad_operands(graph: Graph, unmaterialized: set[int]) -> set[int]:
    """Values a written-out pad reads: XLA's TPU compiler gives such a pad a kernel of its
    own, which reads its operand from a buffer (the elementwise chain making the operand is
    not fused into it). A shifted cross entropy's logit gradient, padded back to the
    sequence length for the matmuls, is written out once unpadded and once padded. (A pad a
    convolution reads is left to the generic rules: XLA can fold it into the window.)"""
    out = set()
    for op in graph.ops:
        if (op.name == "stablehlo.pad" and op.results[0] not in unmaterialized
                and not any(graph.ops[u].name == "stablehlo.convolution"
                            for u in graph.values[op.results[0]].users)):
            out.add(op.operands[0])
    return out
