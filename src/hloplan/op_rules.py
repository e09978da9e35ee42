"""Sharding rules per op, as factors (the Shardy formulation), on plain data.

Every dimension of every operand and result maps to factors (a tuple, major to minor; a reshape
can merge or split dims). Sharding a factor over mesh axes shards every tensor dimension whose
leading factor it is. Factor kinds:
- "pass": the dimension passes through the op (batch, free dims of a matmul, elementwise dims);
- "reduce": contracted or reduced away; sharding it leaves partial sums, so the result needs an
  all-reduce over those axes;
- "replicate": must not be sharded for the op to run locally (concatenated, sliced, sorted dims).
The problem builder enumerates mesh-axis-to-factor assignments over these rules.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hloplan.graph import Graph, Op, TensorType

Dims = tuple[tuple[int, ...], ...]  # per tensor dim: factor ids, major to minor


@dataclass(frozen=True)
class Factor:
    size: int
    kind: str = "pass"  # "pass" | "reduce" | "replicate"


@dataclass(frozen=True)
class OpRule:
    factors: tuple[Factor, ...]
    operands: tuple[Dims | None, ...]  # None: not a tensor we plan (token), any layout is fine
    results: tuple[Dims, ...]
    flops: float = 0.0
    reduction: str = "sum"  # combiner of a "reduce" factor: sum, max, min, prod, and, or
    # The op creates its result from nothing (constant, iota): any sharding is free.
    free: bool = False
    # Why the op is planned replicated, when it is (unknown op, unsupported form).
    fallback: str | None = None
    # Pointwise: each operand dim has the same factor as the result dim: candidates to follow.
    pointwise: bool = False
    # Dots: the (m, k, n) of the matmul they run, each as (factors, constant): the product of
    # those factors' local sizes times the constant (batch dims count in m). The cost model
    # prices them at the device's rate for that shape (matmul_flops_for). A 1x1 convolution is
    # such a matmul (batch x pixels, in features, out features).
    matmul: tuple[tuple[tuple[int, ...], int], ...] | None = None
    # Convolutions with a kernel wider than one tap: the (m, k, n) of their implicit matmul
    # (batch x output pixels, in features x taps, out features), in the same form. They read
    # their input once for all taps, so an explicit matmul's rate (bound by reading an m x k
    # operand when n is small) does not describe them: priced at the device's measured
    # convolution rates (conv_flops_for) where it has them.
    conv: tuple[tuple[tuple[int, ...], int], ...] | None = None
    # Convolutions: the share of their window taps (output positions x kernel taps) that land
    # on the input rather than in its padding (window_taps). 1: none in padding.
    tap_fraction: float = 1.0
    # gather / scatter: "gather" or "scatter" (one operand). They touch operand 0 only at the
    # indexed rows, and a scatter updates it in place (TPU pricing: strategies._price).
    indexed: str | None = None


ELEMENTWISE = {
    "abs", "add", "and", "atan2", "cbrt", "ceil", "clamp", "compare", "complex", "convert",
    "cosine", "count_leading_zeros", "divide", "exponential", "exponential_minus_one", "floor",
    "imag", "is_finite", "log", "log_plus_one", "logistic", "maximum", "minimum", "multiply",
    "negate", "not", "or", "popcnt", "power", "real", "reduce_precision", "remainder",
    "round_nearest_afz", "round_nearest_even", "rsqrt", "select", "shift_left",
    "shift_right_arithmetic", "shift_right_logical", "sign", "sine", "sqrt", "subtract", "tan",
    "tanh", "xor", "bitcast_convert",
}
CHLO_ELEMENTWISE = {
    "acos", "acosh", "asin", "asinh", "atan", "atanh", "bessel_i1e", "conj", "cosh", "digamma",
    "erf", "erf_inv", "erfc", "is_inf", "is_neg_inf", "is_pos_inf", "lgamma", "next_after",
    "polygamma", "sinh", "tan", "zeta", "square",
}
TRANSCENDENTAL = {"exponential", "exponential_minus_one", "log", "log_plus_one", "logistic",
                  "tanh", "sine", "cosine", "tan", "rsqrt", "sqrt", "cbrt", "power", "atan2", "erf",
                  "erf_inv", "lgamma", "digamma"}
FREE_OPS = {"stablehlo.constant", "stablehlo.iota", "sdy.constant"}
# Cheap layout ops that stay free when all their operands are free (scalar splats, ...).
FREE_IF_INPUTS_FREE = {"stablehlo.broadcast_in_dim", "stablehlo.reshape", "stablehlo.convert",
                       "stablehlo.transpose"}
IDENTITY_PSEUDO = {"barrier.result", "while.carry"}

_COMBINERS = {"stablehlo.add": "sum", "stablehlo.maximum": "max", "stablehlo.minimum": "min",
              "stablehlo.multiply": "prod", "stablehlo.and": "and", "stablehlo.or": "or"}


class _Builder:
    """Collects factors while a rule is being written."""

    def __init__(self) -> None:
        self.factors: list[Factor] = []

    def new(self, size: int, kind: str = "pass") -> tuple[int, ...]:
        if size <= 1:
            return ()
        self.factors.append(Factor(size, kind))
        return (len(self.factors) - 1,)

    def fresh_dims(self, shape, kind: str = "pass") -> Dims:
        return tuple(self.new(s, kind) for s in shape)

    def rule(self, operands, results, **kwargs) -> OpRule:
        return OpRule(tuple(self.factors), tuple(operands), tuple(results), **kwargs)


def _replicated(graph: Graph, op: Op, reason: str | None, flops: float = 0.0) -> OpRule:
    """Every dim unsharded (the fallback, and ops whose form we do not split)."""
    operands = [None if graph.type_of(v) is None else tuple(() for _ in graph.type_of(v).shape)
                for v in op.operands]
    results = [tuple(() for _ in (graph.type_of(v).shape if graph.type_of(v) else ()))
               for v in op.results]
    return OpRule((), tuple(operands), tuple(results), flops=flops, fallback=reason)


def _type(graph: Graph, value_id: int) -> TensorType:
    type_ = graph.type_of(value_id)
    assert type_ is not None
    return type_


def rule_for(graph: Graph, op: Op) -> OpRule:
    """The sharding rule of one op. Unknown ops get the replicated fallback, with a reason."""
    name = op.name
    short = _short(name)
    if any(graph.type_of(v) is None for v in op.results) and name not in ("stablehlo.while",):
        return _replicated(graph, op, None)
    if name in FREE_OPS:
        b = _Builder()
        return b.rule([], [b.fresh_dims(_type(graph, op.results[0]).shape)], free=True)
    if name in ("arg",) or name in IDENTITY_PSEUDO:
        b = _Builder()
        dims = b.fresh_dims(_type(graph, op.results[0]).shape)
        return b.rule([dims for _ in op.operands], [dims], pointwise=name != "arg")
    if name == "case.result":
        b = _Builder()
        dims = b.fresh_dims(_type(graph, op.results[0]).shape)
        return b.rule([dims for _ in op.operands], [dims])
    if is_elementwise(name):
        return _elementwise(graph, op, short)
    handler = _HANDLERS.get(name)
    if handler is not None:
        return handler(graph, op)
    if name == "stablehlo.composite":
        rule = _COMPOSITES.get(op.attrs.get("composite", ""))
        if rule is not None:
            return rule(graph, op)
        return _replicated(graph, op, f"composite '{op.attrs.get('composite', '?')}' is not "
                           "known to the planner")
    if name == "stablehlo.custom_call":
        target = op.attrs.get("target", "?")
        return _replicated(graph, op, f"custom_call @{target} is not understood by the planner")
    if name.startswith("sdy.") or name in ("stablehlo.all_reduce", "stablehlo.all_gather",
                                           "stablehlo.reduce_scatter", "stablehlo.all_to_all",
                                           "stablehlo.collective_permute"):
        return _replicated(graph, op, "the program already contains sharding or collective ops")
    return _replicated(graph, op, f"op '{name}' is not known to the planner")


def _elementwise(graph: Graph, op: Op, short: str) -> OpRule:
    out = _type(graph, op.results[0])
    b = _Builder()
    dims = b.fresh_dims(out.shape)
    operands = []
    for v in op.operands:
        t = graph.type_of(v)
        # clamp and select accept scalar operands
        operands.append(dims if t is not None and t.rank == out.rank else tuple(() for _ in (t.shape if t else ())))
    per_element = 8.0 if short in TRANSCENDENTAL else 1.0
    return b.rule(operands, [dims], flops=per_element * out.elements, pointwise=True)


def _dot_general(graph: Graph, op: Op) -> OpRule:
    a = op.attrs
    lhs, rhs = _type(graph, op.operands[0]), _type(graph, op.operands[1])
    b = _Builder()
    lhs_dims: list[tuple[int, ...]] = [()] * lhs.rank
    rhs_dims: list[tuple[int, ...]] = [()] * rhs.rank
    result: list[tuple[int, ...]] = []
    m: tuple[int, ...] = ()
    k: tuple[int, ...] = ()
    n: tuple[int, ...] = ()
    for ld, rd in zip(a["lhs_batch"], a["rhs_batch"]):
        f = b.new(lhs.shape[ld])
        lhs_dims[ld] = rhs_dims[rd] = f
        result.append(f)
        m += f
    contracting = 1
    for ld, rd in zip(a["lhs_contracting"], a["rhs_contracting"]):
        f = b.new(lhs.shape[ld], "reduce")
        lhs_dims[ld] = rhs_dims[rd] = f
        contracting *= lhs.shape[ld]
        k += f
    for d in range(lhs.rank):
        if d not in a["lhs_batch"] and d not in a["lhs_contracting"]:
            lhs_dims[d] = b.new(lhs.shape[d])
            result.append(lhs_dims[d])
            m += lhs_dims[d]
    for d in range(rhs.rank):
        if d not in a["rhs_batch"] and d not in a["rhs_contracting"]:
            rhs_dims[d] = b.new(rhs.shape[d])
            result.append(rhs_dims[d])
            n += rhs_dims[d]
    out = _type(graph, op.results[0])
    return b.rule([tuple(lhs_dims), tuple(rhs_dims)], [tuple(result)],
                  flops=2.0 * out.elements * contracting, matmul=((m, 1), (k, 1), (n, 1)))


def _dot(graph: Graph, op: Op) -> OpRule:
    """stablehlo.dot: a vector or matrix lhs contracts its last dim with the rhs's first."""
    lhs, rhs = _type(graph, op.operands[0]), _type(graph, op.operands[1])
    b = _Builder()
    lhs_free = tuple(b.new(n) for n in lhs.shape[:-1])
    contracted = b.new(lhs.shape[-1], "reduce")
    rhs_free = tuple(b.new(n) for n in rhs.shape[1:])
    out = _type(graph, op.results[0])
    return b.rule([(*lhs_free, contracted), (contracted, *rhs_free)], [(*lhs_free, *rhs_free)],
                  flops=2.0 * out.elements * lhs.shape[-1],
                  matmul=((sum(lhs_free, ()), 1), (contracted, 1), (sum(rhs_free, ()), 1)))


def _convolution(graph: Graph, op: Op) -> OpRule:
    a = op.attrs
    lhs, rhs = _type(graph, op.operands[0]), _type(graph, op.operands[1])
    out = _type(graph, op.results[0])
    b = _Builder()
    lhs_dims: list[tuple[int, ...]] = [()] * lhs.rank
    rhs_dims: list[tuple[int, ...]] = [()] * rhs.rank
    out_dims: list[tuple[int, ...]] = [()] * out.rank
    grouped = a["feature_group_count"] > 1 or a["batch_group_count"] > 1
    batch = b.new(lhs.shape[a["input_batch"]], "replicate" if a["batch_group_count"] > 1 else "pass")
    lhs_dims[a["input_batch"]] = batch
    if lhs.shape[a["input_batch"]] == out.shape[a["output_batch"]]:
        out_dims[a["output_batch"]] = batch
    if not grouped:
        feature = b.new(lhs.shape[a["input_feature"]], "reduce")
        lhs_dims[a["input_feature"]] = rhs_dims[a["kernel_input_feature"]] = feature
        out_feature = b.new(rhs.shape[a["kernel_output_feature"]])
        rhs_dims[a["kernel_output_feature"]] = out_dims[a["output_feature"]] = out_feature
    kernel_volume = 1
    for d in a["kernel_spatial"]:
        kernel_volume *= rhs.shape[d]
    in_features = rhs.shape[a["kernel_input_feature"]]
    shape = {}
    if not grouped:
        pixels = math.prod(out.shape[d] for d in a["output_spatial"])
        if out_dims[a["output_batch"]]:
            m = (out_dims[a["output_batch"]], pixels)
        else:  # batch not a factor of the result: a constant
            m = ((), pixels * out.shape[a["output_batch"]])
        gemm = (m, (feature, kernel_volume), (out_feature, 1))
        shape = {"matmul": gemm} if kernel_volume == 1 else {"conv": gemm}
    return b.rule([tuple(lhs_dims), tuple(rhs_dims)], [tuple(out_dims)],
                  flops=2.0 * out.elements * kernel_volume * in_features,
                  tap_fraction=_tap_fraction(a, lhs, rhs, out), **shape)


def _tap_fraction(attrs: dict, lhs: TensorType, rhs: TensorType, out: TensorType) -> float:
    """The share of a convolution's window taps that land on its input (window_taps)."""
    spatial = len(attrs["kernel_spatial"])
    padding = attrs.get("padding") or [0] * (2 * spatial)
    fraction = 1.0
    for d in range(spatial):
        size = rhs.shape[attrs["kernel_spatial"][d]]
        n_out = out.shape[attrs["output_spatial"][d]]
        if size == 1 and not padding[2 * d]:
            continue
        valid = window_taps(lhs.shape[attrs["input_spatial"][d]], n_out, size,
                            (attrs.get("window_strides") or [1] * spatial)[d], padding[2 * d],
                            (attrs.get("lhs_dilation") or [1] * spatial)[d],
                            (attrs.get("rhs_dilation") or [1] * spatial)[d])
        if valid is None:
            return 1.0
        fraction *= valid / (n_out * size)
    return fraction


def window_taps(n_in: int, n_out: int, size: int, stride: int, pad_low: int,
                lhs_dilate: int = 1, rhs_dilate: int = 1) -> int | None:
    """Over one spatial dim of a convolution, the (output position, kernel tap) pairs that land
    on an input element rather than in the padding or between dilated elements; None where
    the dim is too long to count (over 4 M pairs)."""
    if n_out * size > 1 << 22:
        return None
    extent = (n_in - 1) * lhs_dilate + 1
    valid = 0
    for o in range(n_out):
        for k in range(size):
            at = o * stride + k * rhs_dilate - pad_low
            valid += 0 <= at < extent and at % lhs_dilate == 0
    return valid


def _reduce(graph: Graph, op: Op) -> OpRule:
    count = len(op.results)
    inputs = op.operands[:count]
    operand = _type(graph, inputs[0])
    reduced = set(op.attrs.get("dimensions", []))
    combiner = op.attrs.get("combiner", "complex")
    kind = "reduce" if count == 1 and combiner in _COMBINERS else "replicate"
    b = _Builder()
    dims = []
    result = []
    for d, size in enumerate(operand.shape):
        if d in reduced:
            dims.append(b.new(size, kind))
        else:
            f = b.new(size)
            dims.append(f)
            result.append(f)
    operands = [tuple(dims)] * count + [tuple()] * (len(op.operands) - count)
    return b.rule(operands, [tuple(result)] * count, flops=float(operand.elements * count),
                  reduction=_COMBINERS.get(combiner, "sum"))


def _broadcast_in_dim(graph: Graph, op: Op) -> OpRule:
    operand, out = _type(graph, op.operands[0]), _type(graph, op.results[0])
    b = _Builder()
    result = b.fresh_dims(out.shape)
    dims = []
    for i, d in enumerate(op.attrs.get("broadcast_dimensions", [])):
        dims.append(result[d] if operand.shape[i] == out.shape[d] else ())
    return b.rule([tuple(dims)], [result], flops=0.0, pointwise=False)


def _transpose(graph: Graph, op: Op) -> OpRule:
    operand = _type(graph, op.operands[0])
    b = _Builder()
    dims = b.fresh_dims(operand.shape)
    perm = op.attrs["permutation"]
    return b.rule([dims], [tuple(dims[p] for p in perm)])


def _reshape(graph: Graph, op: Op) -> OpRule:
    """Groups of dims with equal products; within a group, the factors of the finer side.

    A dim made of several factors can be sharded by its major factor only."""
    src, dst = _type(graph, op.operands[0]).shape, _type(graph, op.results[0]).shape
    b = _Builder()
    src_dims: list[tuple[int, ...]] = [()] * len(src)
    dst_dims: list[tuple[int, ...]] = [()] * len(dst)
    i = j = 0
    while i < len(src) or j < len(dst):
        # skip size-1 dims: they carry no factor
        if i < len(src) and src[i] == 1:
            i += 1
            continue
        if j < len(dst) and dst[j] == 1:
            j += 1
            continue
        if i >= len(src) or j >= len(dst):
            break
        gi, gj = [i], [j]
        ps, pd = src[i], dst[j]
        while ps != pd:
            if ps < pd:
                i += 1
                gi.append(i)
                ps *= src[i]
            else:
                j += 1
                gj.append(j)
                pd *= dst[j]
        i += 1
        j += 1
        if len(gi) == 1:  # one src dim splits into dst dims: factors are the dst dims
            factors = [b.new(dst[d]) for d in gj]
            for d, f in zip(gj, factors):
                dst_dims[d] = f
            src_dims[gi[0]] = tuple(x for f in factors for x in f)
        elif len(gj) == 1:  # src dims merge into one dst dim
            factors = [b.new(src[d]) for d in gi]
            for d, f in zip(gi, factors):
                src_dims[d] = f
            dst_dims[gj[0]] = tuple(x for f in factors for x in f)
        # many-to-many groups stay unsharded
    return b.rule([tuple(src_dims)], [tuple(dst_dims)])


def _same_except(graph: Graph, op: Op, fixed: set[int], operand_count: int | None = None) -> OpRule:
    """Operands and result share every dim but those in `fixed`, which stay unsharded."""
    out = _type(graph, op.results[0])
    b = _Builder()
    dims = tuple(() if d in fixed else b.new(s) for d, s in enumerate(out.shape))
    operands = []
    for k, v in enumerate(op.operands):
        t = graph.type_of(v)
        if operand_count is not None and k >= operand_count:
            operands.append(tuple(() for _ in t.shape) if t else None)
        elif t is not None and t.rank == out.rank:
            operands.append(dims)
        else:
            operands.append(tuple(() for _ in t.shape) if t else None)
    return b.rule(operands, [dims] * len(op.results), flops=float(out.elements))


def _concatenate(graph: Graph, op: Op) -> OpRule:
    return _same_except(graph, op, {op.attrs["dimension"]})


def _slice(graph: Graph, op: Op) -> OpRule:
    operand, out = _type(graph, op.operands[0]), _type(graph, op.results[0])
    fixed = {d for d in range(out.rank) if operand.shape[d] != out.shape[d]}
    return _same_except(graph, op, fixed, operand_count=1)


def _pad(graph: Graph, op: Op) -> OpRule:
    operand, out = _type(graph, op.operands[0]), _type(graph, op.results[0])
    fixed = {d for d in range(out.rank) if operand.shape[d] != out.shape[d]}
    return _same_except(graph, op, fixed, operand_count=1)


def _dynamic_update_slice(graph: Graph, op: Op) -> OpRule:
    operand, update = _type(graph, op.operands[0]), _type(graph, op.operands[1])
    fixed = {d for d in range(operand.rank) if operand.shape[d] != update.shape[d]}
    return _same_except(graph, op, fixed, operand_count=2)


def _reverse(graph: Graph, op: Op) -> OpRule:
    return _same_except(graph, op, set(op.attrs.get("dimensions", [])))


def _sort(graph: Graph, op: Op) -> OpRule:
    return _same_except(graph, op, {op.attrs.get("dimension", -1) % _type(graph, op.results[0]).rank})


def _top_k(graph: Graph, op: Op) -> OpRule:
    """chlo.top_k: values and indices of the k largest along the last dim. The leading dims
    (tokens) pass through; the last (the experts of a router) is whole on each device. Priced
    as its decomposition, a sort of each row."""
    rule = _same_except(graph, op, {_type(graph, op.operands[0]).rank - 1})
    operand = _type(graph, op.operands[0])
    row = max(operand.shape[-1], 2) if operand.shape else 2
    return OpRule(rule.factors, rule.operands, rule.results,
                  flops=float(operand.elements * math.log2(row)))


def _windowed(graph: Graph, op: Op) -> OpRule:
    """reduce_window / select_and_scatter: dims with a window or stride > 1 stay unsharded."""
    out = _type(graph, op.results[0])
    window = op.attrs.get("window_dimensions", [1] * out.rank)
    strides = op.attrs.get("window_strides", [1] * out.rank)
    fixed = {d for d in range(out.rank) if window[d] != 1 or strides[d] != 1}
    count = len(op.results) if op.name == "stablehlo.reduce_window" else 2
    rule = _same_except(graph, op, fixed, operand_count=count)
    volume = 1
    for w in window:
        volume *= w
    return OpRule(rule.factors, rule.operands, rule.results, flops=float(out.elements * volume))


def _gather(graph: Graph, op: Op) -> OpRule:
    a = op.attrs
    operand, indices = _type(graph, op.operands[0]), _type(graph, op.operands[1])
    out = _type(graph, op.results[0])
    b = _Builder()
    operand_dims: list[tuple[int, ...]] = [()] * operand.rank
    indices_dims: list[tuple[int, ...]] = [()] * indices.rank
    out_dims: list[tuple[int, ...]] = [()] * out.rank
    batch_out = [d for d in range(out.rank) if d not in a["offset_dims"]]
    batch_idx = [d for d in range(indices.rank) if d != a["index_vector_dim"]]
    for od, idd in zip(batch_out, batch_idx):
        f = b.new(out.shape[od])
        out_dims[od] = indices_dims[idd] = f
        if idd in a["indices_batching"]:
            operand_dims[a["operand_batching"][a["indices_batching"].index(idd)]] = f
    window_operand = [d for d in range(operand.rank)
                      if d not in a["collapsed"] and d not in a["operand_batching"]]
    for od, d in zip(a["offset_dims"], window_operand):
        full = a["slice_sizes"][d] == operand.shape[d] and d not in a["start_index_map"]
        f = b.new(out.shape[od])
        out_dims[od] = f
        if full:
            operand_dims[d] = f
    # A dim indexed one row at a time (an embedding lookup's vocabulary) can be sharded as a
    # masked lookup: each device gathers the indices in its row range, zeros for the others,
    # and the partial results are summed. XLA's SPMD partitioner does this for a gather whose
    # operand is sharded on such a dim (a select and an all-reduce over the dim's axes).
    for d in _indexed_rows(a["start_index_map"], a["collapsed"], a["slice_sizes"]):
        operand_dims[d] = b.new(operand.shape[d], "reduce")
    return b.rule([tuple(operand_dims), tuple(indices_dims)], [tuple(out_dims)],
                  flops=float(out.elements), indexed="gather")


def _indexed_rows(index_map, collapsed, slice_sizes=None) -> list[int]:
    """Operand dims a gather or scatter indexes one row at a time: in its index map, with a
    window of size 1 collapsed away (table[ids]'s vocabulary; a scatter's inserted window
    dims have size 1)."""
    return [d for d in index_map
            if d in collapsed and (slice_sizes is None or slice_sizes[d] == 1)]


def _scatter(graph: Graph, op: Op) -> OpRule:
    """Window dims pass through; scatter (batch) dims of the updates are summed when the
    combiner is an add, else they stay unsharded."""
    a = op.attrs
    count = len(op.results)
    operand = _type(graph, op.operands[0])
    indices = _type(graph, op.operands[count])
    updates = _type(graph, op.operands[count + 1])
    if count != 1:
        return _replicated(graph, op, None)
    b = _Builder()
    operand_dims: list[tuple[int, ...]] = [()] * operand.rank
    indices_dims: list[tuple[int, ...]] = [()] * indices.rank
    update_dims: list[tuple[int, ...]] = [()] * updates.rank
    window_operand = [d for d in range(operand.rank)
                      if d not in a["inserted_window_dims"] and d not in a["operand_batching"]]
    for ud, d in zip(a["update_window_dims"], window_operand):
        if updates.shape[ud] == operand.shape[d] and d not in a["scatter_to_operand"]:
            f = b.new(operand.shape[d])
            operand_dims[d] = update_dims[ud] = f
    # A row-sharded operand (a vocabulary-sharded table's gradient): each device scatters
    # the updates whose indices fall in its rows (XLA's SPMD partitioner masks the others).
    for d in _indexed_rows(a["scatter_to_operand"], a["inserted_window_dims"]):
        if d not in a["operand_batching"]:
            operand_dims[d] = b.new(operand.shape[d])
    kind = "reduce" if a.get("combiner") == "stablehlo.add" else "replicate"
    scatter_updates = [d for d in range(updates.rank) if d not in a["update_window_dims"]]
    scatter_indices = [d for d in range(indices.rank) if d != a["index_vector_dim"]]
    for ud, idd in zip(scatter_updates, scatter_indices):
        if idd in a["indices_batching"]:  # batching dims pass through operand, indices, updates
            od = a["operand_batching"][a["indices_batching"].index(idd)]
            f = b.new(updates.shape[ud])
            update_dims[ud] = indices_dims[idd] = operand_dims[od] = f
            continue
        f = b.new(updates.shape[ud], kind)
        update_dims[ud] = indices_dims[idd] = f
    return b.rule([tuple(operand_dims), tuple(indices_dims), tuple(update_dims)],
                  [tuple(operand_dims)], flops=float(updates.elements), indexed="scatter")


# -- HBM traffic under fusion ------------------------------------------------------------------
# XLA fuses chains of cheap ops into one kernel (loop fusion; reductions absorb their inputs:
# input fusion): a value made by a fusible op and read only by fusible consumers never goes
# through HBM. Pricing every op as if it read and wrote HBM (no fusion) overstates elementwise
# work several-fold (an Adam update is ~15 ops but one kernel reading p, g, m, v and writing
# p, m, v), which overvalues sharding it against communication.
_LAYOUT_OPS = {"broadcast_in_dim", "reshape", "transpose", "slice", "concatenate", "pad",
               "reverse", "dynamic_slice", "iota", "constant"}
# Pseudo ops of the graph (arguments, loop carries, ...) move no data themselves.
NO_TRAFFIC_OPS = {"arg", "case.result", *IDENTITY_PSEUDO}


def _short(name: str) -> str:
    return name.split(".", 1)[1] if "." in name else name


def is_elementwise(name: str) -> bool:
    """Whether an op of this name is a StableHLO or CHLO elementwise op."""
    short = _short(name)
    return (name.startswith("stablehlo.") and short in ELEMENTWISE) or (
        name.startswith("chlo.") and short in CHLO_ELEMENTWISE)


def fusible_producer(name: str) -> bool:
    """Whether XLA fuses an op of this name into the kernel of its consumer."""
    short = _short(name)
    if name.startswith("chlo."):
        return short in CHLO_ELEMENTWISE
    return name.startswith(("stablehlo.", "sdy.")) and (short in ELEMENTWISE
                                                       or short in _LAYOUT_OPS)


def fusible_consumer(name: str) -> bool:
    """Whether an op of this name reads fusible producers inside its own kernel."""
    return fusible_producer(name) or name == "stablehlo.reduce"


def _contiguous_run(dims: list[int]) -> bool:
    return dims == list(range(dims[0], dims[0] + len(dims))) if dims else True


def _foldable_into_dot(perm: list[int], dot: Op, position: int) -> bool:
    """Whether a transpose with permutation `perm` can become dot `dot`'s operand `position`
    (XLA's GPU CanFoldTransposeOperandIntoDot, for row-major operands): the non-contracting
    dims keep their order, and in the transpose's operand the batch dims lead and the
    contracting and non-contracting dims each form one contiguous, ordered run."""
    side = "lhs" if position == 0 else "rhs"
    batch = list(dot.attrs[f"{side}_batch"])
    contracting = list(dot.attrs[f"{side}_contracting"])
    free = [d for d in range(len(perm)) if d not in batch and d not in contracting]
    batch_src, contracting_src, free_src = ([perm[d] for d in dims]
                                           for dims in (batch, contracting, free))
    return (batch_src == list(range(len(batch))) and free_src == sorted(free_src)
            and _contiguous_run(contracting_src) and _contiguous_run(free_src))


def folded_transposes(graph: Graph) -> set[int]:
    """Transposes that XLA folds into the dots reading them (TransposeFolding): a GEMM reads
    its operands transposed at no cost, so such a transpose is no kernel and its operand is
    read by the dots straight from HBM."""
    folded = set()
    for op in graph.ops:
        if op.name != "stablehlo.transpose":
            continue
        result = op.results[0]
        users = [(user, position) for user in dict.fromkeys(graph.values[result].users)
                 for position, v in enumerate(graph.ops[user].operands) if v == result]
        if users and all(graph.ops[u].name == "stablehlo.dot_general"
                         and _foldable_into_dot(list(op.attrs["permutation"]), graph.ops[u], at)
                         for u, at in users):
            folded.add(op.index)
    return folded


def fuses_matmuls(platform: str) -> bool:
    """Whether the XLA backend of `platform` fuses matmuls with their elementwise neighbours.
    XLA's TPU compiler does (its convolution fusions take the elementwise producers of their
    operands, a layer norm's scale-and-shift say, and the elementwise consumers and reductions
    of their result: bias, activation, an optimizer's update of the weight whose gradient the
    matmul makes). XLA's CPU and GPU compilers call a GEMM library and fuse at most a bias
    into it, so they do not."""
    return platform == "tpu"


def fused_values(graph: Graph, folded: set[int] | None = None,
                 matmul_fusion: bool = False, outer_products: bool = False) -> set[int]:
    """Values that stay inside a fused kernel: made by a fusible op, not returned, and read
    only by fusible ops of the same region (a transpose folded into dots is not one: the
    dots read its operand). With `matmul_fusion` (fuses_matmuls), also a matmul's result read
    by one fusible op, and a fusible op's result read by matmuls and fusible ops. With
    `outer_products`, a dot_general that contracts nothing (outer_product) is a fusible op."""
    outputs = set(graph.outputs)
    folded = folded_transposes(graph) if folded is None else folded
    fused = set()
    for value in graph.values:
        if value.type is None or value.id in outputs or not value.users:
            continue
        producer = graph.ops[value.producer]
        # A matmul fuses its result into its one reader only (output fusion); read by several
        # kernels, the result is written out once.
        from_matmul = matmul_fusion and producer.name in MATMULS
        if not (fusible_producer(producer.name) or (from_matmul and len(set(value.users)) == 1)
                or (outer_products and outer_product(producer))):
            continue
        if _readers_fuse(graph, value, producer, folded, matmul_fusion and not from_matmul,
                         outer_products):
            fused.add(value.id)
    return fused


def outer_product(op: Op) -> bool:
    """Whether `op` is a dot_general that contracts nothing: each result element is the
    product of one element of each operand, which XLA's algebraic simplifier rewrites as a
    multiply of the two broadcast, an elementwise op libtpu fuses like any other (Flax
    BERT's `einsum("...hqk,h->...hqk", probs, head_mask)` scales the attention
    probabilities per head; hf_bert on v5e:16x16 and 2x4, libtpu 0.0.42: no buffer of the
    scaled probabilities or of their gradient)."""
    return (op.name == "stablehlo.dot_general" and "lhs_contracting" in op.attrs
            and not op.attrs["lhs_contracting"] and not op.attrs.get("rhs_contracting"))


def _readers_fuse(graph: Graph, value, producer: Op, folded: set[int],
                  matmul_readers: bool, outer_products: bool = False) -> bool:
    """Whether every reader of `value` can take it inside its kernel: a fusible op (or, with
    `matmul_readers`, a matmul; with `outer_products`, an outer_product) of the producer's
    region, not a transpose folded into dots."""
    return all((fusible_consumer(graph.ops[u].name)
                or (matmul_readers and graph.ops[u].name in MATMULS)
                or (outer_products and outer_product(graph.ops[u])))
               and u not in folded
               and (graph.ops[u].parent, graph.ops[u].region) == (producer.parent, producer.region)
               for u in value.users)


def output_fused_values(graph: Graph, folded: set[int] | None = None,
                        matmul_fusion: bool = False) -> set[int]:
    """Returned values that fused_values would keep inside a kernel were they not returned: made
    by a fusible op and read only by fusible ops of the same region (an optimizer's new
    moments, returned and read by the update of the weight). XLA makes such a value and its
    readers one multi-output kernel, which writes the value out once and hands it to its
    readers in the kernel: they do not read it back from HBM, and the kernel reads each of its
    other inputs once (shared_reads over fused_values and these)."""
    outputs = set(graph.outputs)
    folded = folded_transposes(graph) if folded is None else folded
    kept = set()
    for value_id in outputs:
        value = graph.values[value_id]
        if value.type is None or not value.users:
            continue
        producer = graph.ops[value.producer]
        if not fusible_producer(producer.name):
            continue
        if _readers_fuse(graph, value, producer, folded, matmul_fusion):
            kept.add(value_id)
    return kept


def free_values(graph: Graph) -> set[int]:
    """Values made from constants alone (splats, iotas, and slices of them: a row of Flax
    BERT's all-ones head mask `ones((layers, heads))[i]`, which XLA folds to a constant): any
    shape of them is free to make."""
    free: set[int] = set()
    for op in graph.ops:
        if op.name in FREE_OPS or (op.name in (*FREE_IF_INPUTS_FREE, "stablehlo.slice")
                                   and op.operands and all(v in free for v in op.operands)):
            free.update(op.results)
    return free


# Ops XLA's fusion treats as cheap (InstructionFusion::IsExpensive is false for real element
# types): it clones them into every kernel that reads them rather than write their results
# out, when every reader fuses them. A broadcast, ReLU's mask `x > 0` (made in the forward
# pass for the backward select: XLA keeps x, not the 1-byte mask), GELU's polynomial and
# 1 - tanh^2, a bias added to a matmul's output. Divides, exponentials, logs, tanh and other
# transcendentals are expensive: one read by several kernels is written out once.
_RECOMPUTED_IN_CONSUMERS = frozenset(f"stablehlo.{name}" for name in (
    "broadcast_in_dim", "compare", "abs", "add", "and", "ceil", "clamp", "convert", "floor",
    "is_finite", "maximum", "minimum", "multiply", "negate", "not", "or", "xor", "popcnt",
    "real", "imag", "reduce_precision", "round_nearest_afz", "round_nearest_even", "select",
    "shift_left", "shift_right_arithmetic", "shift_right_logical", "sign", "subtract",
    "sine", "cosine", "count_leading_zeros", "bitcast_convert", "reshape", "transpose",
    "slice", "concatenate", "pad", "reverse", "dynamic_slice", "iota"))


def _recomputed_in_consumers(graph: Graph, op: Op) -> bool:
    if op.name not in _RECOMPUTED_IN_CONSUMERS:
        return False
    if op.name == "stablehlo.convert":
        # Rounding f32 to bf16 is expensive to XLA (NaN checks); widening is a shift.
        source, result = (graph.values[v].type for v in (op.operands[0], op.results[0]))
        return not (result is not None and source is not None
                    and result.dtype == "bf16" and source.dtype == "f32")
    return True


def unmaterialized_values(graph: Graph, fused: set[int]) -> set[int]:
    """Fused values that take no memory: results of cheap ops (_RECOMPUTED_IN_CONSUMERS)
    read only by elementwise and layout ops. XLA recomputes them inside every kernel that
    reads them, so they are never written out, however large (the max of a softmax broadcast
    over the vocabulary, the five elementwise residuals jax saves for GELU's backward pass);
    their operands live until then instead (chains of them carry through to written-out
    values). Kept: a value made by an expensive op (exp, tanh, divide, ...), which XLA writes
    out once rather than recompute in each reader, and one a reduction reads directly or
    through an op read only by reductions (a batch norm's centred input, squared for the
    variance): XLA's CPU compiler hands such a reduction to a library kernel that reads that
    value from memory, and once written out the value is read from there by every kernel (a
    GPU might fuse it; the estimate errs on the side of fitting)."""
    def read_by_reduction(v: int) -> bool:
        users = graph.values[v].users
        return bool(users) and all(graph.ops[u].name == "stablehlo.reduce" for u in users)

    return {v for v in fused
            if _recomputed_in_consumers(graph, graph.ops[graph.values[v].producer])
            and all(fusible_producer(graph.ops[u].name)
                    and not any(read_by_reduction(r) for r in graph.ops[u].results)
                    for u in graph.values[v].users)}


MATMULS = {"stablehlo.dot_general", "stablehlo.dot", "stablehlo.convolution"}


def feeding_matmuls(graph: Graph) -> set[int]:
    """Ops whose results a matmul or convolution reads, directly or through other ops (loop
    carries included). Their collectives sit on the step's dependency chain: a partial sum
    all-reduced before the next layer's matmul, batch-norm statistics. XLA cannot merge such
    collectives with others, unlike gradient all-reduces, which feed only the optimizer update."""
    found: set[int] = set()
    stack = [op.index for op in graph.ops if op.name in MATMULS]
    while stack:
        op = graph.ops[stack.pop()]
        inputs = list(op.operands)
        if op.name == "while.carry" and "yield" in op.attrs:
            inputs.append(op.attrs["yield"])  # the loop's back edge
        for value_id in inputs:
            producer = graph.values[value_id].producer
            if producer not in found:
                found.add(producer)
                stack.append(producer)
    return found


def shared_reads(graph: Graph, fused: set[int]) -> set[tuple[int, int]]:
    """(op index, operand position) of reads that a fused kernel makes once for several of its
    ops: ops joined by fused values (matmuls aside: each reads its own operands) are one
    kernel, which reads each value from HBM once however many of its ops use it (a GELU's
    five uses of its input; a softmax's shift, exponential and backward pass of the logits).
    The first reader in program order pays; the others' reads are listed."""
    parent = list(range(len(graph.ops)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for value_id in fused:
        value = graph.values[value_id]
        if graph.ops[value.producer].name in MATMULS:
            continue
        for user in value.users:
            if graph.ops[user].name not in MATMULS:
                parent[root(user)] = root(value.producer)
    seen: set[tuple[int, int]] = set()
    shared = set()
    for op in graph.ops:
        if op.name in MATMULS or op.name in NO_TRAFFIC_OPS:
            continue
        group = root(op.index)
        for position, value_id in enumerate(op.operands):
            if value_id in fused:
                continue
            if (group, value_id) in seen:
                shared.add((op.index, position))
            seen.add((group, value_id))
    return shared


def matmul_rereads(graph: Graph, fused: set[int]) -> set[tuple[int, int]]:
    """(op index, operand position) of matmuls that read a fused value another matmul read
    before: the elementwise ops making it are fused into each matmul's kernel, which reads
    their inputs again (a layer norm's output, used by a projection's forward and weight-gradient
    matmuls, is recomputed in both). Priced as a read of the value itself."""
    readers: set[int] = set()
    rereads = set()
    for op in graph.ops:
        if op.name not in MATMULS:
            continue
        for position, value_id in enumerate(op.operands):
            if value_id in fused:
                if value_id in readers:
                    rereads.add((op.index, position))
                readers.add(value_id)
    return rereads


def matmul_kernels(graph: Graph, fused: set[int]) -> dict[int, list[int]]:
    """Per matmul: the elementwise ops XLA's TPU compiler fuses into its kernel, each given to
    one matmul (the first in program order): its epilogue, the ops reached from its result
    through fused values (bias, activation; the optimizer update of the weight whose gradient
    it makes), and its prologue, the ops making its fused operands (a layer norm's scale and
    shift, an activation of the previous matmul's result), back to values read from HBM.
    Neither crosses another matmul."""
    taken: set[int] = set()
    out: dict[int, list[int]] = {}
    for op in graph.ops:
        if op.name not in MATMULS:
            continue
        ops: list[int] = []
        # Epilogue: forward from the result.
        stack = [v for v in op.results if v in fused]
        while stack:
            for user in dict.fromkeys(graph.values[stack.pop()].users):
                if user in taken or graph.ops[user].name in MATMULS:
                    continue
                taken.add(user)
                ops.append(user)
                stack.extend(v for v in graph.ops[user].results if v in fused)
        # Prologue: back from the fused operands.
        stack = [v for v in op.operands if v in fused]
        while stack:
            producer = graph.values[stack.pop()].producer
            if producer in taken or graph.ops[producer].name in MATMULS:
                continue
            taken.add(producer)
            ops.append(producer)
            stack.extend(v for v in graph.ops[producer].operands if v in fused)
        out[op.index] = ops
    return out


def normalized_rereads(graph: Graph, fused: set[int],
                       rereads: set[tuple[int, int]]) -> set[tuple[int, int]]:
    """The rereads (matmul_rereads) whose recomputed value is normalized by a reduction: made,
    through fused ops, from a reduce's result (a softmax's exp(x - max) / sum and its
    gradient, attention probabilities), read apart from the FLOPs (serial_reads)."""
    memo: dict[int, bool] = {}

    def after_reduction(value_id: int) -> bool:
        if value_id in memo:
            return memo[value_id]
        memo[value_id] = False
        producer = graph.ops[graph.values[value_id].producer]
        found = False
        for operand in producer.operands:
            if operand in fused:
                found = after_reduction(operand)
            else:
                found = graph.ops[graph.values[operand].producer].name == "stablehlo.reduce"
            if found:
                break
        memo[value_id] = found
        return found

    return {(i, k) for i, k in rereads if after_reduction(graph.ops[i].operands[k])}


def softmax_reads(graph: Graph, fused: set[int]) -> set[tuple[int, int]]:
    """(op index, operand position) of every matmul operand that its kernel recomputes as a
    softmax or its gradient: made, through fused ops, from an exponential of a value shifted
    by a reduction's result (exp(x - max), exp(x - logsumexp)). A normalization's output,
    which scales its input by a reduction, and an activation's exponential (SiLU, GELU) are
    not."""
    reads = {(op.index, k) for op in graph.ops if op.name in MATMULS
             for k, value_id in enumerate(op.operands) if value_id in fused}
    reduced: dict[int, bool] = {}
    softmax: dict[int, bool] = {}

    def after_reduction(value_id: int) -> bool:
        if value_id not in reduced:
            reduced[value_id] = False
            producer = graph.ops[graph.values[value_id].producer]
            reduced[value_id] = producer.name == "stablehlo.reduce" or (
                value_id in fused and producer.name not in MATMULS
                and any(after_reduction(v) for v in producer.operands))
        return reduced[value_id]

    def from_softmax(value_id: int) -> bool:
        if value_id not in softmax:
            softmax[value_id] = False
            producer = graph.ops[graph.values[value_id].producer]
            # The kernel's own prologue: back through fused elementwise ops, not past a matmul.
            softmax[value_id] = producer.name not in MATMULS and (
                (producer.name == "stablehlo.exponential"
                 and any(after_reduction(v) for v in producer.operands))
                or any(from_softmax(v) for v in producer.operands if v in fused))
        return softmax[value_id]

    return {(i, k) for i, k in reads if from_softmax(graph.ops[i].operands[k])}


def restreamed_reads(op: Op, softmaxes: set[tuple[int, int]]) -> tuple[bool, ...] | None:
    """Per operand of `op`: whether it is a softmax the kernel recomputes (softmax_reads),
    which it recomputes again for each output tile it makes (strategies.restream_passes
    prices the tiles). None where no operand is such."""
    flags = tuple((op.index, k) in softmaxes for k in range(len(op.operands)))
    return flags if any(flags) else None


def serial_reads(op: Op, rereads: set[tuple[int, int]]) -> tuple[bool, ...] | None:
    """Per operand of `op`: whether its kernel reads it apart from its compute. The planner
    passes the normalized rereads (normalized_rereads): a softmax a matmul recomputes in its
    prologue needs its row statistics before the MXU can use any of it, so reading its inputs
    and the matmul's FLOPs do not overlap (on a v5e chip, the vocabulary matmuls of a language
    model's backward pass that recompute the softmax gradient take their FLOPs' time plus the
    logits' read time). An elementwise recompute (an activation's derivative) streams with the
    MXU work: the MoE's expert matmuls that recompute GELU take the larger of the two. None
    where no operand is such."""
    serial = tuple((op.index, k) in rereads for k in range(len(op.operands)))
    return serial if any(serial) else None


def hbm_traffic(graph: Graph, op: Op, fused: set[int], streamed: frozenset[int] = frozenset(),
                folded: set[int] = frozenset(), shared: set[tuple[int, int]] = frozenset(),
                rereads: set[tuple[int, int]] = frozenset(), kept: set[int] = frozenset(),
                ) -> tuple[tuple[bool, ...], tuple[bool, ...]]:
    """Per operand and per result of `op`: whether it is read or written through HBM.
    `streamed`: argument values written into device memory every step (data inputs; state
    that the step updates in place stays resident). `folded`: folded_transposes(graph), ops
    that are no kernel. `shared`: shared_reads(graph, fused), reads another op of the same
    kernel makes. `rereads`: matmul_rereads(graph, fused), fused operands read again. `kept`:
    output_fused_values(graph), written out but read by their readers inside the kernel."""
    if op.index in folded:
        return (False,), (False,)
    if op.name in NO_TRAFFIC_OPS:
        return (tuple(False for _ in op.operands),
                tuple(op.name == "arg" and v in streamed for v in op.results))
    return (tuple((v not in fused or (op.index, k) in rereads) and (op.index, k) not in shared
                  and v not in kept for k, v in enumerate(op.operands)),
            tuple(v not in fused for v in op.results))


def _dynamic_slice(graph: Graph, op: Op) -> OpRule:
    operand, out = _type(graph, op.operands[0]), _type(graph, op.results[0])
    fixed = {d for d in range(out.rank) if operand.shape[d] != out.shape[d]}
    return _same_except(graph, op, fixed, operand_count=1)


_HANDLERS = {
    "stablehlo.dot_general": _dot_general,
    "stablehlo.dot": _dot,
    "stablehlo.convolution": _convolution,
    "stablehlo.reduce": _reduce,
    "stablehlo.broadcast_in_dim": _broadcast_in_dim,
    "stablehlo.transpose": _transpose,
    "stablehlo.reshape": _reshape,
    "stablehlo.concatenate": _concatenate,
    "stablehlo.slice": _slice,
    "stablehlo.pad": _pad,
    "stablehlo.dynamic_slice": _dynamic_slice,
    "stablehlo.dynamic_update_slice": _dynamic_update_slice,
    "stablehlo.reverse": _reverse,
    "stablehlo.sort": _sort,
    "stablehlo.reduce_window": _windowed,
    "stablehlo.select_and_scatter": _windowed,
    "stablehlo.gather": _gather,
    "stablehlo.scatter": _scatter,
}
_HANDLERS = {k: v for k, v in _HANDLERS.items() if v is not None}
# stablehlo.composite ops, by the composite's name.
_COMPOSITES = {"chlo.top_k": _top_k}
