"""Strategies of one op: every assignment of mesh axes to the op's factors that is legal.

Plain data in, plain data out: an `OpRule` (see op_rules), the tensor types and a mesh give a
list of `OpStrategy`, each with its result and operand shardings, compute and communication cost
and per-device output bytes.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from hloplan.cost_models import CommModel
from hloplan.graph import TensorType, dtype_bytes
from hloplan.mesh import MeshSpec
from hloplan.op_rules import Dims, OpRule

Spec = tuple[tuple[int, ...], ...]  # per dim: mesh axis indices, major to minor


@dataclass(frozen=True)
class OpStrategy:
    results: tuple[Spec, ...]
    operands: tuple[Spec | None, ...]
    reduced_axes: tuple[int, ...] = ()
    compute: float = 0.0
    communication: float = 0.0
    memory: float = 0.0
    collectives: tuple[tuple[str, str, float], ...] = ()
    name: str = ""
    transient: float = 0.0  # bytes held only while made (unscattered partial sums)
    # A collective-matmul loop's accumulators (0: the strategy does not loop): libtpu sums the
    # two ring directions' partial sums into two buffers of the result's size.
    accumulators: float = 0.0
    # The operand whose copy `transient` holds (a collective-matmul loop's copy of its larger
    # operand, collective_matmul_copy_bytes); -1: none.
    copied: int = -1
    # Of `communication`'s collectives, the seconds counted as hidden behind the op's own
    # kernels (a collective-matmul loop's sends; collective_matmul_overlap), not included.
    hidden: float = 0.0


def axis_roles(strategy: OpStrategy, ndim: int) -> tuple[tuple[int, ...], ...]:
    """What a strategy does with each mesh axis: per axis, the dim of each result and operand
    it shards (-1: none; operands not planned are skipped) and whether partial sums are reduced
    over it. Strategies with equal roles on an axis use that axis alike, whatever they do with
    the others: the solver plans big meshes on views where axes share roles."""
    tensors = [spec for spec in (*strategy.results, *strategy.operands) if spec is not None]
    roles = []
    for axis in range(ndim):
        where = tuple(next((d for d, axes in enumerate(spec) if axis in axes), -1)
                      for spec in tensors)
        roles.append((*where, int(axis in strategy.reduced_axes)))
    return tuple(roles)


def replicated(rank: int) -> Spec:
    return tuple(() for _ in range(rank))


def shards(spec: Spec, mesh: MeshSpec) -> int:
    count = 1
    for axes in spec:
        for axis in axes:
            count *= mesh.axis_sizes[axis]
    return count


def local_bytes(type_: TensorType, spec: Spec, mesh: MeshSpec) -> float:
    total = type_.itemsize
    for size, axes in zip(type_.shape, spec):
        split = 1
        for axis in axes:
            split *= mesh.axis_sizes[axis]
        total *= -(-size // split)
    return float(total)


def local_shape(type_: TensorType, spec: Spec, mesh: MeshSpec) -> tuple[int, ...]:
    """One device's shard of a `type_` tensor laid out `spec` (dims rounded up, as XLA pads)."""
    return tuple(-(-size // shards((axes,), mesh)) for size, axes in zip(type_.shape, spec))


def scattered_bytes(comm: CommModel, type_: TensorType, spec: Spec, reduced: tuple[int, ...],
                    mesh: MeshSpec, row_major: bool = False) -> tuple[float, float]:
    """(The partial sums a reduce-scatter over `reduced` into `spec` moves, the bytes of the
    collective-permute after it): the scattered dim is the one `spec` ends with the reduced
    axes on; the compiler's tiles may pad it (CommModel.tiled_scatter; `row_major`: a gather's
    or a scatter's partial sums, kept in the program's order of dims)."""
    n = shards((tuple(reduced),), mesh)
    for dim, axes in enumerate(spec):
        if len(axes) >= len(reduced) and tuple(axes[len(axes) - len(reduced):]) == tuple(reduced):
            return comm.tiled_scatter(local_shape(type_, spec, mesh), type_.itemsize, dim, n,
                                      row_major)
    return local_bytes(type_, spec, mesh) * n, 0.0


def scatter_passes_updates(rule: OpRule, results, operands, reduced, operand_types,
                           result_types, mesh: MeshSpec) -> bool:
    """Whether XLA's SPMD partitioner compiles a scatter whose summed updates are to be
    reduce-scattered onto a window dim (one the updates share with the result) as an "operand
    passthrough" scatter instead: it moves the reduced axes of the updates from their scatter
    dims to that window dim (an all-to-all), gathers the indices over them and scatters into its
    own shard, with no partial sums to reduce. It does so where the whole result and the
    updates split as the indices are (what scattering each device's own updates into a whole
    copy holds) are at least twice the updates split as the result's window dims are (libtpu
    0.0.42 on v5e:4x8, ids [(x, y), -], updates [(x, y), -, -], result [-, (x, y)]: 8,192
    tokens of width 768 pass from 256 rows, 250 rows are reduce-scattered; 32,768 tokens from
    1,024 rows, 512 reduce-scattered; ids [y, -] and updates [y, -, x] pass at 2 rows; the ids'
    own bytes do not count), where the ids are split over the summed axes on one dim and the
    result over every mesh axis. hf_bert's and hf_gpt2's embedding gradients on v5e:16x16, `[-, y]`
    partial over x onto `[-, (y, x)]`: an all-to-all(x) of the updates and an all-gather(x)
    of the ids (tests/unit/test_tpu_scatter_tiles.py)."""
    if rule.indexed != "scatter" or len(results) != 1 or len(operands) != 3 \
            or any(t is None or s is None for t, s in zip(operand_types, operands)):
        return False
    spec = results[0]
    n = len(reduced)
    dims = [d for d, axes in enumerate(spec)
            if len(axes) >= n and tuple(axes[len(axes) - n:]) == tuple(reduced)]
    if not dims:
        return False
    updates_factors = {f for factors in rule.operands[2] for f in factors}
    if not set(rule.results[0][dims[0]]) & updates_factors:
        return False  # onto the indexed rows: the partial sums are reduced
    if shards(spec, mesh) != mesh.size:
        # A mesh axis the result is replicated over: the partitioner splits the ids over it
        # too and all-reduces what each part scatters (hf_bert's `[-, y]` word-embedding
        # gradient on v5e:2x4: a reduce-scatter over x, read through slices), not modelled.
        return False
    if len([axes for axes in operands[1] if set(axes) & set(reduced)]) != 1:
        # Ids split over two dims (hf_gpt2's position ids `[y, x, -]` on v5e:2x4): libtpu
        # reduce-scatters (up to a table 0.5 x the whole updates at least; from some size
        # above that it gathers the whole updates instead, not modelled).
        return False
    window_split = 1
    for d, factors in enumerate(rule.results[0]):
        if set(factors) & updates_factors:
            window_split *= shards((spec[d],), mesh)
    updates = float(operand_types[2].nbytes)
    return (result_types[0].nbytes + updates / shards(operands[1], mesh)
            >= 2 * updates / window_split)


def spec_text(spec: Spec, mesh: MeshSpec) -> str:
    """P-like text: [data, -] / [(data, model), -]; [] for scalars."""
    parts = []
    for axes in spec:
        names = [mesh.axis_names[a] for a in axes]
        parts.append("-" if not names else names[0] if len(names) == 1 else "(" + ", ".join(names) + ")")
    return "[" + ", ".join(parts) + "]"


def spec_names(spec: Spec, mesh: MeshSpec) -> tuple[tuple[str, ...], ...]:
    return tuple(tuple(mesh.axis_names[a] for a in axes) for axes in spec)


def _derive(dims: Dims, factor_axes: list[list[int]], is_result: bool) -> Spec | None:
    spec = []
    for factors in dims:
        if not factors:
            spec.append(())
            continue
        if is_result and any(factor_axes[f] for f in factors[1:]):
            return None  # a minor factor of a merged dim cannot be sharded in place
        spec.append(tuple(factor_axes[factors[0]]))
    return tuple(spec)


def enumerate_strategies(rule: OpRule, operand_types: list[TensorType | None],
                         result_types: list[TensorType], mesh: MeshSpec, comm: CommModel,
                         multiplier: float = 1.0, flops_dtype: str = "f32",
                         hbm: tuple[tuple[bool, ...], tuple[bool, ...]] | None = None,
                         serial: tuple[bool, ...] | None = None, overlap: bool = False,
                         restreamed: tuple[bool, ...] | None = None,
                         ) -> list[OpStrategy]:
    """All legal strategies of an op, in a deterministic order (replicated first). `hbm`: per
    operand and per result, whether it goes through HBM (False: fused into a neighbour's
    kernel, op_rules.hbm_traffic); default: all do. `serial`: per operand, whether its read
    adds to the op's time rather than overlapping its FLOPs (op_rules.serial_reads).
    `restreamed`: per operand, whether it is a recomputed softmax the kernel reads again for
    each output tile (op_rules.restreamed_reads, restream_passes). `overlap`:
    a matmul whose kernel is HBM-bound with the ops fused into it (build_sharding_problem's
    _overlapped_matmuls): its FLOPs hide under that traffic, so it is priced at its own
    traffic alone."""
    shardable = [f for f, factor in enumerate(rule.factors) if factor.kind != "replicate"]
    choices = [None, *shardable]
    seen: set = set()
    out: list[OpStrategy] = []
    for assignment in itertools.product(choices, repeat=mesh.ndim):
        factor_axes: list[list[int]] = [[] for _ in rule.factors]
        for axis, factor in enumerate(assignment):
            if factor is not None:
                factor_axes[factor].append(axis)
        if not _divides(rule, factor_axes, mesh):
            continue
        results = []
        for dims in rule.results:
            spec = _derive(dims, factor_axes, is_result=True)
            if spec is None:
                break
            results.append(spec)
        else:
            operands = tuple(None if dims is None else _derive(dims, factor_axes, is_result=False)
                             for dims in rule.operands)
            reduced = tuple(sorted(a for f, axes in enumerate(factor_axes)
                                   if rule.factors[f].kind == "reduce" for a in axes))
            key = (tuple(results), operands, reduced)
            if key in seen:
                continue
            seen.add(key)
            out.append(_price(rule, tuple(results), operands, reduced, factor_axes, operand_types,
                              result_types, mesh, comm, multiplier, flops_dtype, hbm=hbm,
                              serial=serial, overlap=overlap, restreamed=restreamed))
            # A gather's partial sums are all-reduced: given a result layout that
            # reduce-scatters them, XLA's partitioner all-gathers the table instead (v5e:2x4,
            # table [x, -], indices [y, -], result [y, x, -]).
            variants = ([] if rule.indexed == "gather"
                        else _scatter_variants(results, reduced, result_types, mesh))
            for scattered in variants:
                key = (scattered, operands, reduced)
                if key not in seen:
                    seen.add(key)
                    out.append(_price(rule, scattered, operands, reduced, factor_axes,
                                      operand_types, result_types, mesh, comm, multiplier,
                                      flops_dtype, scatter=True, hbm=hbm, serial=serial,
                                      overlap=overlap, restreamed=restreamed))
    return out


def _scatter_variants(results: list[Spec], reduced: tuple[int, ...],
                      result_types: list[TensorType], mesh: MeshSpec) -> list[tuple[Spec, ...]]:
    """Reduce-scatter forms of a partial-sum strategy: the one result keeps the shard of one of
    its dims over all the reduced axes (Alpa's "RS" strategies; ZeRO-2 gradients). Where no
    unsharded dim divides, onto a dim already sharded: the reduced axes split each device's
    block further, after its axes (a [-, y] result reduce-scattered over x is [-, (y, x)],
    whatever the mesh order). libtpu compiles an all-reduce whose reader slices it so as that
    reduce-scatter, followed by a collective-permute where the reader wants [-, (x, y)]
    (hf_gpt2's tied-embedding gradient on v5e:2x4: the 50,257-row vocabulary takes no axis).
    Only there: elsewhere such a form costs what the unsharded dim's does, and the ties it
    adds change plans for nothing."""
    if not reduced or len(results) != 1:
        return []
    spec, type_ = results[0], result_types[0]
    split = 1
    for axis in reduced:
        split *= mesh.axis_sizes[axis]
    out = []
    for dim, (size, axes) in enumerate(zip(type_.shape, spec)):
        if not axes and size % split == 0:
            out.append((tuple(tuple(reduced) if d == dim else a for d, a in enumerate(spec)),))
    if out:
        return out
    for dim, (size, axes) in enumerate(zip(type_.shape, spec)):
        if axes and size % (split * shards((axes,), mesh)) == 0:
            out.append((tuple(a + tuple(reduced) if d == dim else a
                              for d, a in enumerate(spec)),))
    return out


def _divides(rule: OpRule, factor_axes: list[list[int]], mesh: MeshSpec) -> bool:
    for factor, axes in zip(rule.factors, factor_axes):
        split = 1
        for axis in axes:
            split *= mesh.axis_sizes[axis]
        if factor.size % split:
            return False
    return True


def local_matmul_dims(rule: OpRule, factor_axes, mesh: MeshSpec) -> list[tuple]:
    """The local (m, k, n) of a dot or convolution under `factor_axes`: each dim's factors and
    its size on one device (no factor sharded: the whole shape)."""
    dims = []
    for factors, constant in rule.matmul or rule.conv:
        size = float(constant)
        for f in factors:
            shards = 1
            for axis in factor_axes[f]:
                shards *= mesh.axis_sizes[axis]
            size *= rule.factors[f].size / shards
        dims.append((factors, size))
    return dims


def row_tiles(size: float, max_tile: int) -> int:
    """How many output tiles libtpu's matmul kernel splits a dim of `size` into: the largest
    tile of whole 128-wide vector lanes, at most `max_tile`, that divides the dim padded to 128
    (with 768, the output windows of the benchmark language models' vocabulary weight
    gradients on v5e, libtpu 0.0.42: 2048 rows in 4 tiles of 512, 1536 in 2 of 768, 1024 in 2
    of 512; libtpu's own choice depends on the kernel's fused work too, docs/tpu.md)."""
    lanes = max(1, math.ceil(size / 128))
    per_tile = max(1, max_tile // 128)
    return lanes // max(d for d in range(1, min(per_tile, lanes) + 1) if lanes % d == 0)


def restream_passes(rule: OpRule, k: int, factor_axes, mesh: MeshSpec,
                    max_tile: int | None, operand_bytes: tuple[float, ...]) -> int:
    """How many times a matmul's kernel reads its operand `k`, a softmax (or its gradient) it
    recomputes in its prologue (op_rules.restreamed_reads). Where the matmul contracts that
    operand's leading dims (a weight gradient: the tokens) and it is the larger of the two,
    the kernel tiles the output along the other operand's free dims (row_tiles) and
    recomputes the operand for each tile. On a v5e chip a language model's vocabulary weight
    gradient, [d, vocab] from the tokens' activations and the softmax gradient of the logits,
    takes its FLOPs' time plus the logits' read once per tile of d: llama's 2048 in 4 tiles of
    512 (15.9 ms: 6.1 ms of FLOPs, 4 x 1.7 of logits, 2.6 of other traffic), gpt's 1536 in 2
    of 768 (16.1 ms: 7.1, 2 x 2.6, 3.0); the activation gradient, which contracts the logits'
    last dim (the vocabulary), reads them once. (The corpus programs' weight gradients at
    d = 1024, which libtpu tiles whole, read them once: docs/tpu.md.) 1 otherwise, without
    a tile size, and for convolutions."""
    if (rule.matmul is None or max_tile is None or len(operand_bytes) != 2
            or rule.operands[k] is None or rule.operands[1 - k] is None
            or operand_bytes[k] < 2 * operand_bytes[1 - k]):
        return 1
    contracted = set(rule.matmul[1][0])
    if not rule.operands[k] or set(rule.operands[k][-1]) & contracted:
        return 1
    own = {f for dims in rule.operands[k] for f in dims}
    size = 1.0
    for dims in rule.operands[1 - k]:
        for f in dims:
            if f not in own:
                size *= rule.factors[f].size / shards((factor_axes[f],), mesh)
    return row_tiles(size, max_tile)


def _matmul_time(rule: OpRule, factor_axes, mesh: MeshSpec, comm: CommModel, moved: float,
                 flops_dtype: str, split: int) -> float:
    """Roofline time of a dot or convolution at the device's rate for its local (m, k, n)
    ([matmul] table; [conv] for convolutions wider than one tap): the chip's matmul kernels
    run far below the square-matmul rate when a dim is short or the contraction long."""
    dims = [size for _, size in local_matmul_dims(rule, factor_axes, mesh)]
    rate = (comm.model.matmul_flops_for(flops_dtype, *dims) if rule.matmul is not None
            else comm.model.conv_flops_for(flops_dtype, *dims))
    return max(rule.flops / split / rate, moved / comm.model.hbm_bandwidth)


# XLA's SPMD partitioner windows an einsum over at most this many devices
# (SpmdPartitionerOptions.max_windowed_einsum_iteration).
MAX_COLLECTIVE_MATMUL_DEVICES = 32


def collective_matmul_time(rule: OpRule, result: Spec, reduced: tuple[int, ...], factor_axes,
                           operands, operand_types, reads, partial_bytes: float, mesh: MeshSpec,
                           comm: CommModel, flops_dtype: str, split: int,
                           plain: float) -> float | None:
    """Compute time of a reduce-scattered matmul (or convolution) as XLA's TPU compiler runs it,
    or None where it keeps one matmul and one reduce-scatter.

    libtpu's SPMD partitioner turns a matmul whose operands share the sharded contraction and
    whose result is reduce-scattered over those axes into a loop ("windowed einsum", collective
    matmul): over n devices, n/2 chunk kernels (bidirectional: two 1/n chunks of the scattered
    result dim each) whose partial sums travel the ring as collective-permutes while the next
    chunk computes. Each chunk kernel reads the stationary operand (the one without the
    scattered dim) whole, 1/(n/2) of the other, and writes its partial sums, which a second
    kernel adds to the received accumulators. It does so where it expects the loop to pay:
    max(compute, communication) + two chunks' communication under compute + communication
    (dot_handler.cc's cost check, which prices the communication as an all-reduce of the
    partial sums), i.e. min(compute, communication) > 2 communication / n, over at most
    MAX_COLLECTIVE_MATMUL_DEVICES devices. Where the device model gives the intensity libtpu's
    check works out to (`collective-matmul-intensity`), a dot or a convolution (its FLOPs
    without the window taps in the padding, OpRule.tap_fraction) loops where its FLOPs per
    device per byte of one chunk of its partial sums reach it: libtpu's check depends on nothing else
    (not on the dims' sizes, the dtype or n apart from the chunk; the [matmul] table's rates,
    which do, would loop small dots libtpu keeps and keep long ones it loops).
    The device model may also limit the devices a loop spans
    (DeviceModel.collective_matmul_spans).
    """
    n = 1
    for axis in reduced:
        n *= mesh.axis_sizes[axis]
    scattered = [d for d, axes in enumerate(result) if axes == tuple(reduced)]
    if n < 4 or n > MAX_COLLECTIVE_MATMUL_DEVICES or n % 2 or len(scattered) != 1 \
            or len(rule.operands) != 2:
        return None
    devices = mesh.size
    replicated = not any(axis not in reduced for axes in factor_axes for axis in axes)
    if not comm.model.collective_matmul_spans(devices, n, replicated):
        return None
    intensity = comm.model.collective_matmul_intensity
    if intensity is not None:
        # A convolution's FLOPs as libtpu's check counts them: its taps in the padding left
        # out (tap_fraction).
        if rule.flops * rule.tap_fraction / split < intensity * partial_bytes / n:
            return None
    else:
        # dot_handler's cost check prices the communication as an all-reduce of the partial
        # sums.
        all_reduce = (comm.bytes_sent("all-reduce", partial_bytes, reduced)
                      / comm.group(reduced).bandwidth)
        if min(plain, all_reduce) <= 2 * all_reduce / n:
            return None
    narrow = comm.model.matmul_input_dtype
    chunk_factors = set(rule.results[0][scattered[0]])
    kernels = n // 2
    moving = [i for i, dims in enumerate(rule.operands)
              if dims is not None and chunk_factors & {f for d in dims for f in d}]
    if len(moving) != 1:
        return None
    dims = [size / kernels if chunk_factors & set(factors) else size
            for factors, size in local_matmul_dims(rule, factor_axes, mesh)]
    # The loop reads its operands in the MXU's input dtype (libtpu rounds f32 operands at
    # default precision to bf16 once, before the loop). Every chunk kernel reads the
    # stationary operand whole; one fused into the matmul (a softmax gradient recomputed from
    # the logits) is remade in each: hf_bert's vocabulary weight gradient looped over v5e:4x8's
    # 32 chips reads its 250 MB logit gradient in each of 16 chunk kernels (6.4 ms).
    read = 0.0
    for i, (t, spec, reads_it) in enumerate(zip(operand_types, operands, reads)):
        if t is not None and spec is not None and (reads_it or i != moving[0]):
            scale = mxu_itemsize(t, comm.model) / t.itemsize
            read += scale * local_bytes(t, spec, mesh) / (kernels if i == moving[0] else 1)
    chunk_bytes = read + partial_bytes / kernels
    dtype = narrow if narrow and flops_dtype == "f32" else flops_dtype
    if rule.matmul is not None and comm.model.matmul:
        rate = comm.model.matmul_flops_for(dtype, *dims)
    elif rule.matmul is None and comm.model.conv:
        rate = comm.model.conv_flops_for(dtype, *dims)
    else:
        rate = comm.model.flops_for(dtype)
    per_kernel = max(rule.flops / split / kernels / rate,
                     chunk_bytes / comm.model.hbm_bandwidth)
    # The accumulator kernels read the partial sums and the received accumulators and write
    # the sums: three passes over the partial sums in all. The loop is never faster than the
    # one matmul it replaces.
    return max(plain, kernels * per_kernel + 3 * partial_bytes / comm.model.hbm_bandwidth)


def collective_matmul_sends(partial_bytes: float, n: int, axes: str,
                            multiplier: float) -> list[tuple[str, str, float]]:
    """The collectives of a collective matmul's loop as libtpu compiles them, one entry per
    execution: each of the n/2 steps sends a chunk of the partial sums (1/n of them) each way
    round the ring, and one more hop after the loop joins the two directions' sums: n + 1
    collective-permutes of partial_bytes / n over the reduced axes (the reduce-scatter's
    (n - 1) / n of the partial sums, sent as (n + 1) / n)."""
    return [("collective-permute", axes, partial_bytes / n * multiplier)] * (n + 1)


def mxu_itemsize(type_: TensorType, model) -> int:
    """Bytes per element of `type_` as the device's matmul units read it: an f32 value in the
    model's matmul_input_dtype where it has one (XLA's TPU compiler converts it for the MXU)."""
    narrow = model.matmul_input_dtype
    return dtype_bytes(narrow) if narrow and type_.dtype == "f32" else type_.itemsize


def collective_matmul_copy_bytes(operands, operand_types, mesh: MeshSpec,
                                 comm: CommModel) -> tuple[float, int]:
    """Bytes of the larger of a collective matmul's operands as its loop carries them (local,
    in the MXU's input dtype), and that operand's position (the first of equal ones; -1:
    none)."""
    largest, position = 0.0, -1
    for k, (t, spec) in enumerate(zip(operand_types, operands)):
        if t is not None and spec is not None:
            scale = mxu_itemsize(t, comm.model) / t.itemsize
            nbytes = scale * local_bytes(t, spec, mesh)
            if nbytes > largest:
                largest, position = nbytes, k
    return largest, position


def _price(rule: OpRule, results, operands, reduced, factor_axes, operand_types, result_types,
           mesh: MeshSpec, comm: CommModel, multiplier: float, flops_dtype: str,
           scatter: bool = False,
           hbm: tuple[tuple[bool, ...], tuple[bool, ...]] | None = None,
           serial: tuple[bool, ...] | None = None, overlap: bool = False,
           restreamed: tuple[bool, ...] | None = None) -> OpStrategy:
    """Costs of one strategy; `scatter`: the partial sums are reduce-scattered into `results`
    (whose dims carry the reduced axes) instead of all-reduced."""
    split = 1
    for axes in factor_axes:
        for axis in axes:
            split *= mesh.axis_sizes[axis]
    result_bytes = [local_bytes(t, s, mesh) for t, s in zip(result_types, results)]
    reduce_split = 1
    for axis in reduced:
        reduce_split *= mesh.axis_sizes[axis]
    passed = scatter and scatter_passes_updates(rule, results, operands, reduced, operand_types,
                                                result_types, mesh)
    # The op itself computes the unscattered partial sums; the collective shrinks them.
    computed_bytes = ([b * reduce_split for b in result_bytes] if scatter and not passed
                      else result_bytes)
    reads, writes = hbm if hbm is not None else ((True,) * len(operands),
                                                (True,) * len(results))
    moved = sum(b for b, written in zip(computed_bytes, writes) if written)
    serial_bytes = 0.0  # read apart from the FLOPs: added to the roofline, not under its max
    local = tuple(0.0 if t is None or s is None else local_bytes(t, s, mesh)
                  for t, s in zip(operand_types, operands))
    for k, (t, s, read) in enumerate(zip(operand_types, operands, reads)):
        if restreamed is not None and restreamed[k] and t is not None and s is not None:
            # The reads past the first (one per further output tile) wait on the recompute;
            # the first is the operand's own read, or its fused producers' (not fused: read).
            serial_bytes += local[k] * (restream_passes(
                rule, k, factor_axes, mesh, comm.model.matmul_row_tile, local) - 1)
        if t is not None and s is not None and read:
            if serial is not None and serial[k]:
                serial_bytes += local[k]
            else:
                moved += local[k]
    if rule.indexed and comm.model.platform == "tpu":
        # XLA's TPU gather reads the rows it gathers; its scatter updates its operand in place
        # (reads the updates, reads and writes the rows they hit), not the whole table.
        indices = local_bytes(operand_types[1], operands[1], mesh)
        if rule.indexed == "gather":
            moved = 2 * result_bytes[0] + indices
        else:
            moved = 3 * local_bytes(operand_types[2], operands[2], mesh) + indices
    if rule.free:
        compute = 0.0
    elif ((rule.matmul is not None and comm.model.matmul)
          or (rule.conv is not None and comm.model.conv)):
        compute = ((moved / comm.model.hbm_bandwidth if overlap else
                    _matmul_time(rule, factor_axes, mesh, comm, moved, flops_dtype, split))
                   + serial_bytes / comm.model.hbm_bandwidth)
    else:
        compute = (comm.compute_time(rule.flops / split, moved, flops_dtype)
                   + serial_bytes / comm.model.hbm_bandwidth)
    # Convolutions too: XLA's convolution handler windows them as it does dots.
    if (scatter and (rule.matmul is not None or rule.conv is not None)
            and comm.model.collective_matmul and not rule.free):
        chunked = collective_matmul_time(rule, results[0], reduced, factor_axes, operands,
                                         operand_types, reads, computed_bytes[0], mesh, comm,
                                         flops_dtype, split, compute)
    else:
        chunked = None
    if chunked is not None:
        compute = chunked
    communication = 0.0
    collectives = []
    kind = "reduce-scatter" if scatter else "all-reduce"
    if passed:
        # The updates' reduced axes moved onto the window dim, the indices gathered over them
        # (scatter_passes_updates): what the scatter then holds beside its result.
        kind = "all-to-all"
        moved_updates = local_bytes(operand_types[2], operands[2], mesh)
        gathered = local_bytes(operand_types[1], operands[1], mesh) * reduce_split
        for what, nbytes in (("all-to-all", moved_updates), ("all-gather", gathered)):
            communication += comm.collective(what, nbytes, reduced)
            sent = comm.bytes_sent(what, nbytes, reduced)
            if sent:
                collectives.append((what, comm.axes_label(reduced), sent * multiplier))
    elif reduced:
        for k, nbytes in enumerate(computed_bytes):
            if chunked is not None:
                # priced as the collective-permutes it sends, as listed
                communication += (reduce_split + 1) * comm.collective_permute(
                    nbytes / reduce_split, reduced)
                collectives.extend(collective_matmul_sends(nbytes, reduce_split,
                                                           comm.axes_label(reduced), multiplier))
                continue
            permuted = 0.0
            if scatter:
                # libtpu scatters the tiles of the partial sums' layout (padded shards, and a
                # collective-permute of the rows a shard holds too many)
                nbytes, permuted = scattered_bytes(comm, result_types[k], results[k], reduced,
                                                   mesh, row_major=rule.indexed is not None)
            communication += comm.collective(kind, nbytes, reduced)
            sent = comm.bytes_sent(kind, nbytes, reduced)
            if sent:
                collectives.append((kind, comm.axes_label(reduced), sent * multiplier))
            if permuted:
                communication += comm.collective_permute(permuted, reduced)
                collectives.append(("collective-permute", comm.axes_label(reduced),
                                    permuted * multiplier))
    transient = sum(computed_bytes) - sum(result_bytes)
    if passed:
        transient = moved_updates + gathered
    copied, hidden = -1, 0.0
    if chunked is not None:
        # The loop sends each chunk's partial sums while the next chunk computes: only what
        # outlasts the compute, and the last two chunks' sends, cannot be hidden; the device
        # model says how much of the rest the plan counts as hidden on this slice
        # (collective_matmul_overlap_on).
        exposed = max(0.0, communication - compute) + 2 * communication / reduce_split
        hidden = (comm.model.collective_matmul_overlap_on(comm.mesh.size)
                  * (communication - exposed))
        communication -= hidden
        # It never holds the whole partial sums, but carries its operands in its own layouts:
        # libtpu copies one of them (in the MXU's input dtype) before the loop, which one
        # depending on layouts; the larger is counted. Where that operand reaches the loop
        # resharded, the loop reads the reshard's copy instead (Edge.loop_copy).
        transient, copied = collective_matmul_copy_bytes(operands, operand_types, mesh, comm)
    accumulators = 2.0 * sum(result_bytes) if chunked is not None else 0.0
    name = ", ".join(spec_text(s, mesh) for s in results) or "()"
    if reduced:
        name += f" + {kind}(" + comm.axes_label(reduced) + ")"
    if operands and any(s is not None and any(s) for s in operands) or reduced:
        name += " <- " + " ".join(spec_text(s, mesh) for s in operands if s is not None)
    return OpStrategy(results, operands, reduced, compute * multiplier,
                      communication * multiplier, sum(result_bytes), tuple(collectives), name,
                      transient=transient, accumulators=accumulators, copied=copied,
                      hidden=hidden * multiplier)
