"""Which values XLA's TPU compiler writes out, where its fusion differs from the generic rules of
op_rules (the memory estimate's `[buffers] fused_reductions = true` device models).

Each rule is one seen in libtpu's buffer assignment (libtpu 0.0.42, `xla_dump_to` of
benchmarks/tpu_memory.py's train steps); the estimate applies them to the set of values it
holds no buffer for (build-sharding-problem's `unmaterialized`).
"""

from __future__ import annotations

from hloplan.graph import Graph
from hloplan.op_rules import ELEMENTWISE, fusible_consumer, fusible_producer, outer_product


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


def reduced_matmul_sums(graph: Graph, unmaterialized: set[int]) -> dict[int, set[int]]:
    """Fused values that XLA's TPU compiler writes out in place of the matmul result they are
    made from: a matmul result read by one elementwise op, followed through elementwise
    values of its shape that each have one reader (a bias add) to one with several readers,
    a reduction among them (a residual sum whose LayerNorm takes its mean). The matmul's
    kernel computes that value and the reductions reading it (an output fusion writing
    several results); the matmul result never exists, and the values the chain adds in
    (the residual, the bias) are read there and nowhere later. hf_bart's post-LN layers
    (libtpu 0.0.42, v5e:16x16, 8 x 512 tokens per device): `out_proj` and `fc2` each write
    `f32[8,512,1024]` `x + h @ w + b` with its row sum and sum of squares, and no buffer of
    the matmul result; so does a pre-LN MLP stack compiled deviceless on v5e:2x2 (`x + h @ w2
    + b2`). Written value id -> the values of the chain it replaces (the matmul result
    included)."""
    out: dict[int, set[int]] = {}
    for op in graph.ops:
        if op.name not in _MATMULS or len(op.results) != 1:
            continue
        value = graph.values[op.results[0]]
        if value.type is None or value.id in graph.outputs:
            continue
        chain: set[int] = set()
        while True:
            if len(value.users) != 1 or value.id in graph.outputs:
                break
            reader = graph.ops[value.users[0]]
            result = graph.values[reader.results[0]] if len(reader.results) == 1 else None
            if (result is None or (reader.parent, reader.region) != (op.parent, op.region)
                    or reader.name.removeprefix("stablehlo.") not in ELEMENTWISE
                    or not reader.name.startswith("stablehlo.")
                    or result.type is None or result.type.shape != value.type.shape):
                break
            chain.add(value.id)
            value = result
        # A convolution's kernel writes the value even where it is written out anyway (a
        # multi-output value: a ReLU gradient's select that a GroupNorm backward reduces and
        # multiplies); a dot_general's keeps its result's buffer there (tpu_fusion).
        if (not chain or value.id in graph.outputs
                or (value.id not in unmaterialized and op.name != "stablehlo.convolution")
                or not any(graph.ops[u].name == "stablehlo.reduce"
                           and (graph.ops[u].parent, graph.ops[u].region) == (op.parent, op.region)
                           for u in value.users)
                # Read by reductions alone (directly or through an elementwise op only they
                # read), the sum is made inside their kernel (combined_values): not written.
                or not _read_beyond_reductions(graph, value)):
            continue
        out[value.id] = chain
    return out


def in_place_sums(graph: Graph, unmaterialized: set[int]) -> dict[int, int]:
    """Convolution sums (reduced_matmul_sums) that XLA's TPU compiler writes into the buffer
    of a written-out value their kernel adds in: one of the sum's shape and dtype, not a
    program input or output, that the kernel reads last (every reader is the sum's op or an
    unmaterialized op of its chain). The kernel reads it elementwise, so its output aliases
    it (the fusion's `aliasing_operands`): the two never hold separate buffers. A ResNet
    block's two input gradients (flax linen ResNet with GroupNorm, libtpu 0.0.42, v5e:2x4,
    32 images of 64x64 per device): `fusion.227`, Block_1's 1x1 Conv_0 gradient, is written
    out (`f32[32,64,64,64]`, 64 MiB tiled); `fusion.197` computes Conv_1's gradient, adds
    `fusion.227`, writes the ReLU gradient's select with its GroupNorm reductions into
    `fusion.227`'s buffer (one slice of the buffer assignment for both). Convolutions'
    sums only: reduced_matmul_sums finds a dot_general's among unmaterialized values alone,
    and none written into an operand's buffer was seen. Written value id -> the value whose
    buffer it takes."""
    out: dict[int, int] = {}
    for written, chain in reduced_matmul_sums(graph, unmaterialized).items():
        value = graph.values[written]
        if written in unmaterialized or not chain <= unmaterialized:
            continue
        kernel = {graph.values[v].producer for v in chain} | {value.producer}
        operands = sorted({v for index in kernel for v in graph.ops[index].operands})
        for operand in operands:
            source = graph.values[operand]
            type_ = source.type
            if (operand in unmaterialized or operand in chain or operand in graph.outputs
                    or operand in graph.arguments or type_ is None or type_.shape != value.type.shape
                    or type_.dtype != value.type.dtype
                    or not all(u in kernel for u in source.users)):
                continue
            out[written] = operand
            break
    return out


def _read_beyond_reductions(graph: Graph, value) -> bool:
    """Whether a kernel other than reductions reads `value`: a reader that is neither a
    reduce nor an elementwise op whose one result only reduces read."""
    for user in value.users:
        reader = graph.ops[user]
        if reader.name == "stablehlo.reduce":
            continue
        if (reader.name.removeprefix("stablehlo.") in ELEMENTWISE and len(reader.results) == 1
                and all(graph.ops[u].name == "stablehlo.reduce"
                        for u in graph.values[reader.results[0]].users)):
            continue
        return True
    return False


def normalized_values(graph: Graph, unmaterialized: set[int], free: set[int]) -> set[int]:
    """Elementwise values read by matmuls (and by elementwise ops), made by a fused chain
    from one written-out value of their shape, row statistics of it (reductions of the
    chain's values) and smaller values of its dtype broadcast into it (a norm's scale and
    bias): XLA's TPU compiler recomputes such a value inside each kernel that reads it, the
    matmuls' included, and writes no buffer for it; its source and statistics stay live
    until the last reader. A LayerNorm's output `(s - mean) * rsqrt(var) * scale + bias`, read by
    the next layer's matmuls, the residual sum after them and the weight gradients: hf_bart
    on v5e:16x16 (libtpu 0.0.42, 8 x 512 tokens per device) holds the f32 residual sum s
    (reduced_matmul_sums) and its two row sums, and no buffer of any of its 22 norms'
    outputs; so does a pre-LN MLP stack compiled deviceless on v5e:2x2. Value ids."""
    out = set()
    for op, value in _elementwise_results(graph):
        if (value.id in unmaterialized or value.id in graph.outputs or value.type is None
                or not value.users):
            continue
        readers = [graph.ops[u] for u in value.users]
        if (not any(u.name in _MATMULS for u in readers)
                or not all(u.name in _MATMULS or (fusible_consumer(u.name)
                                                  and (u.parent, u.region) == (op.parent, op.region))
                           for u in readers)):
            continue
        found = _fused_chain(graph, op, unmaterialized)
        if found is None:
            continue
        chain, leaves = found
        _, statistics = _chain_statistics(graph, chain, leaves, free)
        broadcast = {v for v in leaves - free - statistics
                     if _broadcast_into(graph, v, value.type)}
        held = leaves - free - statistics - broadcast
        # Only a norm's scale and bias besides: a chain reading integers (a cross entropy's
        # labels in `softmax - one_hot`) is not a norm, and libtpu writes that gradient
        # (models.py's gpt and llama).
        if (statistics and len(held) == 1
                and graph.type_of(next(iter(held))).shape == value.type.shape
                and all(graph.type_of(v).dtype == value.type.dtype for v in broadcast)):
            out.add(value.id)
    return out


def gated_values(graph: Graph, unmaterialized: set[int], free: set[int]) -> set[int]:
    """Elementwise values read only by matmuls, made by a fused chain from two or more
    written-out matmul results of their own shape with one input (and values free to make)
    that are all read again after the value's last matmul, directly or through a fused value
    of the chain: a gated MLP's product `act(x @ w_gate) * (x @ w_up)`, whose backward pass
    reads both matmul results for the product's derivative. XLA's TPU compiler recomputes such a value inside
    each kernel that reads it and writes no buffer for it, as it does norm outputs
    (normalized_values): keras_gemma's GeGLU and hf_llama's SwiGLU on v5e:16x16 (libtpu
    0.0.42, 8 x 512 tokens per device: the f32 gate and up results live into the backward
    pass, the product recomputed in the down projection's forward kernel and in its weight
    gradient's; no buffer of it), models.py's llama on v5e:16x16 alike. A
    collective-matmul loop reading it carries it as a buffer, written in bf16 where the
    forward pass makes it and kept until the loop (hf_llama and models.py's llama on
    v5e:2x4, whose weight gradients are `while` loops: `bf16[8,512,8192]` written beside the
    up matmul's result, live into the backward pass): build_sharding_problem
    `_hold_carried_copies`. Read by a batched matmul, it is written (keras_moe's expert
    product, read by `bseh,ehd->bsed`, on v5e:16x16: `bf16[8,512,8,2048]` per layer live
    into the backward pass), and so is one read by a convolution (not seen). One made from
    a single such value is operand_fused_values'; GPT's `gelu(x @ w + b)` reads a bias
    besides, smaller than it: biased_activations'. Value ids."""
    out = set()
    for value, chain, leaves in _matmul_read_chains(graph, unmaterialized):
        sources = leaves - free
        # The sources are matmul results of one input (`x @ w_gate`, `x @ w_up`), as against
        # a backward pass's product of a gradient and an activation's derivative.
        producers = [graph.ops[graph.values[v].producer] for v in sources]
        if (len(sources) < 2
                or len(_same_shape_sources(graph, sources, free, value.type)) != len(sources)
                or not all(p.name == "stablehlo.dot_general" for p in producers)
                or len({p.operands[0] for p in producers}) != 1):
            continue
        made, late = _read_late(graph, value, chain, sources)
        # A fused value of the chain read late is recomputed there from all the sources.
        if late & made or sources <= late:
            out.add(value.id)
    return out


def _read_late(graph: Graph, value, chain: set[int], sources: set[int]
               ) -> tuple[set[int], set[int]]:
    """(the chain's values besides `value`, those of them and of `sources` that an op outside
    the chain reads after `value`'s last reader): what the backward pass reads again."""
    last = max(value.users)
    made = {r for index in chain for r in graph.ops[index].results} - {value.id}
    late = {v for v in made | sources
            if any(u > last and u not in chain for u in graph.values[v].users)}
    return made, late


def _matmul_read_chains(graph: Graph, unmaterialized: set[int], limit: int = 64):
    """(value, chain, leaves) of each elementwise value that is written out unless recomputed,
    read only by matmuls with no batch dims, and made by a fused chain (_fused_chain, with
    its op limit): gated_values' and biased_activations' candidates."""
    for op, value in _elementwise_results(graph):
        readers = [graph.ops[u] for u in value.users]
        if (value.id in unmaterialized or value.id in graph.outputs or value.type is None
                or not readers or not all(u.name == "stablehlo.dot_general"
                                          and not u.attrs.get("lhs_batch") for u in readers)):
            continue
        found = _fused_chain(graph, op, unmaterialized, limit=limit)
        if found is not None:
            yield value, *found


def biased_activations(graph: Graph, unmaterialized: set[int], free: set[int]) -> set[int]:
    """Elementwise values read only by matmuls (no batch dims), made by a fused chain from
    one matmul result of their shape and values smaller than it broadcast into it (a bias),
    where that result or a fused value of the chain is read after the value's last matmul
    (the activation's derivative in the backward pass): an MLP's `gelu(x @ w + b)`. XLA's
    TPU compiler adds the bias inside the matmul's kernel, writes the sum `x @ w + b` (which
    the derivative reads) and recomputes the activation inside each matmul that reads it;
    no buffer of the activation. Flax BERT's exact GELU on v5e:16x16 (libtpu 0.0.42, hf_bert
    with 8 x 512 tokens per device): one `f32[8,512,3072]` sum per layer live into the
    backward pass, written by the intermediate matmul's kernel, and no buffer of the GELU,
    read by the output matmul and its weight gradient; hf_gpt2's tanh GELU there alike
    (`f32[8,512,3072]` c_fc sums at libtpu's peak, no GELU). A collective-matmul loop
    reading it carries it as a buffer, written in bf16 in the forward pass and kept until
    the loop (hf_bert on v5e:2x4 and 4x8, whose output weight gradients are `while` loops: a
    `bf16[8,512,3072]` per layer live from the forward pass to its loop), as for gated
    products (gated_values, build_sharding_problem `_hold_carried_copies`). Values that
    operand_fused_values or gated_values take (one held source, two matmul results) are
    theirs. Value ids."""
    out = set()
    # An exact GELU, erf's polynomials included, is about 70 ops.
    for value, chain, leaves in _matmul_read_chains(graph, unmaterialized, limit=256):
        sources = _same_shape_sources(graph, leaves, free, value.type)
        rest = leaves - free - set(sources)
        if (len(sources) != 1 or not rest
                or graph.ops[graph.values[sources[0]].producer].name != "stablehlo.dot_general"
                or not all(_broadcast_into(graph, v, value.type) for v in rest)):
            continue
        if _read_late(graph, value, chain, set(sources))[1]:
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


def _round_up(size: int, tile: int) -> int:
    return -(-size // tile) * tile


def _second_minor_tile(size: int) -> int:
    """libtpu tiles the second-minor dim by 8 rows (every dtype: `T(8,128)`, bf16 `T(8,128)(2,1)`,
    s8 and pred `T(8,128)(4,1)`), by the power of two that holds it when shorter (`T(4,128)` for
    3 rows, `T(1,128)` for one)."""
    tile = 1
    while tile < min(size, 8):
        tile *= 2
    return tile


def tiled_elements(shape: tuple[int, ...], itemsize: int, row_major: bool = False) -> int:
    """Elements of a `shape` buffer in libtpu's tiled layout (libtpu 0.0.42 on v5e): the minor
    dim padded to 128 and the second-minor to 8 (_second_minor_tile); a rank-1 array padded to
    1,024 elements (`T(1024)`, fewer when shorter: `f32[5]{0:T(128)}`, `bf16[5]{0:T(256)}`); a
    scalar takes one 512-byte tile. libtpu picks the layout: its default layout of an array
    (arguments, results, values no op constrains) is the order of dims that pads least
    (`f32[1000,8]{0,1:T(8,128)}`: the 1,000-long dim minor, no padding); `row_major` keeps the
    program's order (a scatter's operand and result keep their window dims minor:
    `f32[524288,8]{1,0:T(8,128)}`, the 8 columns padded to 128, 16 times the bytes)."""
    if not shape:
        return max(1, 512 // itemsize)
    if len(shape) == 1:
        smallest = max(1, 512 // itemsize)
        tile = smallest
        while tile < min(shape[0], 1024):
            tile *= 2
        return _round_up(shape[0], tile)
    return _tiled_count(shape, *minor_dims(shape, row_major))


def _tiled_count(shape: tuple[int, ...], minor: int, second: int) -> int:
    count = _round_up(shape[minor], 128) * _round_up(shape[second],
                                                      _second_minor_tile(shape[second]))
    for dim, size in enumerate(shape):
        if dim not in (minor, second):
            count *= size
    return count


def minor_dims(shape: tuple[int, ...], row_major: bool = False,
               last_two: bool = False) -> tuple[int, int]:
    """The (minor, second-minor) dims of libtpu's tiled layout of a `shape` buffer (rank 2 or
    more): the pair that pads least, the program's order on a tie; `row_major`: the program's
    order (see tiled_elements); `last_two`: the last two dims in the order that pads least (a
    matmul's result, its batch dims major: `f32[16,20,100]` keeps 100 minor, `f32[16,128,192]`
    128)."""
    last = (len(shape) - 1, len(shape) - 2)
    if row_major:
        return last
    best, count = last, _tiled_count(shape, *last)
    for minor in range(len(shape)):
        for second in range(len(shape)):
            if (minor != second and (not last_two or {minor, second} == set(last))
                    and _tiled_count(shape, minor, second) < count):
                best, count = (minor, second), _tiled_count(shape, minor, second)
    return best


def conv_loop_operand_dims(shape: tuple[int, ...], feature: int, batch: int,
                           chunk: int) -> tuple[int, int]:
    """The (minor, second-minor) dims of the copy of a convolution's input (`shape`, local)
    that a collective-matmul loop carries (libtpu 0.0.42 on v5e). The loop of a kernel
    gradient reduce-scattered onto its input features computes `chunk` of them a step,
    slicing the input's `batch` dim (the kernel gradient's lhs batch dim: the activation's
    channels); its convolution contracts over the input's `feature` dim (the activation's
    images). libtpu puts whichever of the two pads less in the lanes, the images on a tie; the
    channels minor, the copy takes the default layout (minor_dims). Kernel gradients of 3x3
    convolutions on v5e:2x4, images sharded over the 8 chips: 8 images, 64 channels (chunks
    of 8) carry `bf16[8,64,64,64]{0,3,2,1:T(8,128)(2,1)}`, the 8 images padded to 128 lanes
    (64 MiB for a 4 MiB array; linen_resnet's second block); 16 images and 64 channels, and 32
    images and 256 channels, carry the images minor too; 8 images and 128 or 256 channels, 4
    images and 64 channels, 32 images and 512 channels carry the channels minor."""
    images = shape[feature]
    if _round_up(images, 128) * chunk <= _round_up(chunk, 128) * images:
        return feature, batch
    return minor_dims(shape)


def conv_loop_operand_elements(shape: tuple[int, ...], feature: int, batch: int,
                               chunk: int) -> int:
    """Elements of that copy (conv_loop_operand_dims) in libtpu's tiles."""
    return _tiled_count(shape, *conv_loop_operand_dims(shape, feature, batch, chunk))


def row_major_results(op_name: str) -> bool:
    """Ops libtpu computes in the program's order of dims: scatters. libtpu's scatter kernel
    writes its result with the updated rows' dims minor and reads its updates as
    `[updates, window]` in that order too: it copies the updates into that layout, scatters,
    and copies the result into the default layout (`f32[32000,8]` embedding gradient of
    `f32[64,1024,8]` updates: a 32 MiB copy of the 2 MiB updates and a 16 MiB result for a
    1 MiB array). See scatter_updates_shape."""
    return op_name == "stablehlo.scatter"


def scatter_updates_shape(shape: tuple[int, ...], window_dims: tuple[int, ...]) -> tuple[int, ...]:
    """The shape libtpu's scatter reads its updates in: the scatter dims (those not in the
    update window) collapsed into one leading dim, the window dims after it in order
    (`[64,1024,8]` with window (2,): `[65536,8]`)."""
    rows = 1
    for dim, size in enumerate(shape):
        if dim not in window_dims:
            rows *= size
    return (rows, *(shape[d] for d in sorted(window_dims)))


def gathers_rows(op_name: str, attrs: dict, operand_rank: int) -> bool:
    """A gather libtpu runs on its operand in the program's order of dims: one whose indexed
    (collapsed) dims all come before its window dims (an embedding lookup `table[ids]`,
    `f32[vocab, d]` gathering rows). Its kernel reads the operand row-major
    (`{1,0:T(8,128)}`, the window dims minor), whatever layout the operand has."""
    if op_name != "stablehlo.gather" or operand_rank < 2:
        return False
    indexed = set(attrs.get("collapsed", ())) | set(attrs.get("start_index_map", ()))
    window = [d for d in range(operand_rank) if d not in indexed]
    return bool(indexed) and bool(window) and max(indexed) < min(window)


def relaid_rows(shape: tuple[int, ...], itemsize: int) -> int:
    """Bytes of the row-major copy libtpu makes of a gather's operand of local `shape` that
    it keeps in another order of dims, or 0 when it keeps it row-major. libtpu lays an array
    out in the order that pads least, row-major on a tie (tiled_elements); a table whose
    window dims are shorter than a tile (`f32[32768,8]`, d sharded 8 ways) is kept
    `{0,1:T(8,128)}`, rows minor, and an all-gather of its window dims keeps that order: the
    gather copies the gathered `f32[32768,64]` into `{1,0:T(8,128)}` (libtpu 0.0.42 on
    v5e:2x4; on the Llama-8B-class step, the f32 `[128256, 4096]` embedding table stored
    sharded on d over 256 devices is copied whole, 2.10 GB, after its all-gather)."""
    row_major = tiled_elements(shape, itemsize, True)
    if row_major > tiled_elements(shape, itemsize):
        return row_major * itemsize
    return 0


_MATMULS = ("stablehlo.dot_general", "stablehlo.convolution")

# Ops that lay out or repeat a value without computing anything.
_EXPANDERS = ("stablehlo.broadcast_in_dim", "stablehlo.reshape")


def broadcast_operands(graph: Graph, unmaterialized: set[int]) -> dict[int, int]:
    """Matmul operands made from one smaller written-out value by a broadcast and reshapes
    only, and read by matmuls alone: XLA's TPU compiler repeats the value inside each
    matmul's kernel and holds no buffer of the repeated one. A grouped-query attention's keys
    and values, `[b, s, 1, h]` broadcast to the 8 query heads and reshaped to `[b, s, 8, h]`
    for the score and value matmuls of the forward and backward passes: libtpu 0.0.42 holds
    the `bf16[8,512,128]` matmul results from the forward pass to the backward one and no
    `[8,512,8,128]` buffer of them (keras-hub Gemma, 8 x 512 tokens per device on
    v5e:16x16). Only a broadcast along new dims (_broadcasts_along_new_dims). Value id ->
    the value it repeats (written out: an output fusion making the operand is made into the
    smaller value instead)."""
    out = {}
    for op in graph.ops:
        if op.name not in _EXPANDERS or len(op.results) != 1:
            continue
        value = graph.values[op.results[0]]
        if (value.id in unmaterialized or value.id in graph.outputs or not value.users
                or not all(graph.ops[u].name in _MATMULS for u in value.users)):
            continue
        source, broadcast = op.operands[0], op.name == "stablehlo.broadcast_in_dim"
        while source in unmaterialized:  # through the fused reshapes and broadcasts
            producer = graph.ops[graph.values[source].producer]
            if producer.name not in _EXPANDERS:
                break
            broadcast |= producer.name == "stablehlo.broadcast_in_dim"
            source = producer.operands[0]
        own = graph.type_of(source)
        if (broadcast and own is not None and value.type is not None
                and own.elements < value.type.elements
                and _broadcasts_along_new_dims(own.shape, value.type.shape)):
            out[value.id] = source
    return out


def _broadcasts_along_new_dims(source: tuple[int, ...], result: tuple[int, ...]) -> bool:
    """Whether `result` holds `source`'s dims longer than 1 in order, its other dims being
    new: the value is `source` broadcast along them, which a matmul's kernel reads in place.
    A repeat that interleaves copies into one of `source`'s dims (Flax Llama's 8 key heads
    repeated to 32: `[b, s, 8, 4, h]` reshaped to `[b, s, 32, h]`) is no such broadcast, and
    libtpu writes it out (`bf16[8,512,8,4,64] broadcast(...)`, hf_llama on v5e:16x16)."""
    dims = iter(result)
    return all(any(size == d for d in dims) for size in source if size > 1)



def operand_fused_values(graph: Graph, unmaterialized: set[int], free: set[int]) -> set[int]:
    """Elementwise values read only by matmuls and computed from one value held past their
    last reader: XLA's TPU compiler computes such a value inside each matmul that reads it
    (an operand fusion) instead of writing it out, since what it is made from stays in HBM
    anyway. A GELU expert MLP (models.py's moe): the activation `gelu(x @ w_in)`, read by the
    `@ w_out` matmul and by w_out's weight gradient, is recomputed in both from the f32
    pre-activation, which the backward pass keeps for GELU's derivative and reads after
    them (libtpu 0.0.42: no buffer for it, 160 MiB per layer per device on v5e:2x4). One made
    from two held values is not this rule's: a SwiGLU's `silu(x @ w_gate) * (x @ w_up)`
    (gated_values) and GPT's `gelu(x @ w + b)`, made from the matmul result and the bias
    (biased_activations); one whose source is last read before the value's last matmul is
    written out (no such case seen in libtpu's dumps). The value is followed back through the fused values it is made
    from (`unmaterialized`) to the written-out ones: besides those free to make (`free`:
    splats, iotas) and reductions of the chain's own values (`_statistic_of`), exactly one,
    an argument or a value read, directly or through a fused value of the chain, by an op
    after the value's last matmul. A softmax's probabilities `exp(s - max) / sum`, read by
    the attention's value matmul and its backward pass's value-gradient matmul, are made
    from the scores and their row max and sum, and the backward pass reads the exponentials
    again: libtpu keeps the f32 scores and the two row statistics and writes no buffer for
    the probabilities (gpt on v5e:16x16 and v5e:2x4: one `f32[b,h,q,k]` per layer at its
    peak, no bf16 one). For a value read only by convolutions, leaves smaller than it
    (broadcast into it) are not sources either: libtpu's kernel gradients recompute a
    pre-activation block's `relu(norm(h))` from h and the norm's per-channel statistics,
    scale and bias (linen_resnet on v5e:2x4 and 4x8, libtpu 0.0.42). Only values an
    elementwise op makes (a weight's transpose is left to the other rules), and no pad on the
    way (a written-out pad is a kernel of its own: pad_operands). Value ids."""
    arguments = set(graph.arguments)
    out = set()
    fused = set(unmaterialized)  # with the values found so far, in program order
    for op, value in _elementwise_results(graph, fused):
        if (value.id in fused or value.id in graph.outputs or not value.users
                or not all(graph.ops[u].name in _MATMULS for u in value.users)):
            continue
        last = max(value.users)
        found = _fused_chain(graph, op, fused)
        if found is None:
            continue
        chain, leaves = found
        made, statistics = _chain_statistics(graph, chain, leaves, free)
        held = leaves - free - statistics
        if all(graph.ops[u].name == "stablehlo.convolution" for u in value.users):
            # A convolution's kernel recomputes its input from the one value of its size the
            # chain reads, with the smaller ones broadcast into it (a norm's statistics,
            # scale and bias): see _broadcast_into.
            held = {v for v in held if not _broadcast_into(graph, v, value.type)}
        elif statistics:
            # Smaller values broadcast into what the statistics are taken of (a padding mask
            # added to the scores before their row max and sum) are held with the
            # statistics: libtpu writes the masked scores in the score matmul's kernel. A
            # value that enters after them (a cross entropy's labels) is a source.
            reduced = _statistics_sources(graph, statistics, made, leaves, free)
            held = {v for v in held
                    if not (v in reduced and _broadcast_into(graph, v, value.type))}
        if len(held) != 1:
            continue
        (leaf,) = held
        # Held past the last matmul: read after it, directly or through a fused value of the
        # chain (which libtpu recomputes there from it: a softmax's exponentials read by the
        # backward pass).
        readers = [u for v in made - {value.id} | {leaf} for u in graph.values[v].users]
        if leaf in arguments or any(u > last and u not in chain for u in readers):
            out.add(value.id)
            fused.add(value.id)
    return out


def combined_values(graph: Graph, fused: set[int], free: set[int]) -> set[int]:
    """Fused elementwise values made from two or more written-out values of their own shape
    and read by a reduction and by another kernel (_reduced_and_read): XLA's TPU compiler
    writes such a value out once, in the kernel making it, rather than recompute it in the
    reduction's kernel and in the kernels after it, each of which would then read all its
    sources. A residual sum `x + (h @ w + b)`, read
    by a LayerNorm's statistics, by its normalization (in the next matmul's kernel) and by
    the backward pass: libtpu writes it in the matmul's kernel with the statistics (an output
    fusion), and the matmul result and x are not held for the later readers (hf_bert with 8 x
    512 tokens per device on v5e:16x16: two `f32[8,512,768]` sums per layer at its peak, no
    matmul result); the backward pass's residual gradient `dx + g @ w^T` likewise, read by a
    LayerNorm gradient's reductions and its input gradient. A product of two such values
    read only by reductions (the LayerNorm gradient's `dy * x_hat`, reduced twice) is made
    inside their one kernel. In program order: a value made from such a sum counts the sum
    as one source. Value ids."""
    selects = frozenset(fused_selects(graph, free))  # a one-hot scatter is a fused select
    fused = fused | selects
    out: set[int] = set()
    for op, value in _elementwise_results(graph):
        if (value.id not in fused or value.type is None or value.id in graph.outputs
                or len(set(value.users)) < 2):
            continue
        found = _fused_chain(graph, op, fused - out, selects)
        if found is None:
            continue
        sources = _same_shape_sources(graph, found[1], free, value.type)
        if len(sources) >= 2 and _reduced_and_read(graph, value, fused - out):
            out.add(value.id)
    return out


def _reduced_and_read(graph: Graph, value, fused: set[int], limit: int = 64) -> bool:
    """Whether `value`, a fused value, is read by a reduction and by a kernel that is not
    that reduction's: following the fused values made from it, a reduction and an op making
    a written-out value (all reductions reading it are one multi-output kernel). True where
    the walk is longer than `limit` ops."""
    sinks = reduces = False
    seen: set[int] = set()
    stack = list(value.users)
    while stack:
        index = stack.pop()
        if index in seen:
            continue
        seen.add(index)
        if len(seen) > limit:
            return True
        user = graph.ops[index]
        if user.name == "stablehlo.reduce":
            reduces = True
            continue
        for result in user.results:
            if result in fused:
                stack.extend(graph.values[result].users)
            else:
                sinks = True
    return sinks and reduces


def _elementwise_results(graph: Graph, fused: set[int] = frozenset()):
    """(op, its result value) of every single-result StableHLO elementwise op, and with
    `fused` of every transpose of one of those values (a layout change of a fused chain, made
    in the kernel that computes the chain: the attention probabilities transposed for the
    value matmul)."""
    for op in graph.ops:
        if len(op.results) == 1 and op.name.startswith("stablehlo.") and (
                op.name.removeprefix("stablehlo.") in ELEMENTWISE
                or (op.name == "stablehlo.transpose" and op.operands[0] in fused)):
            yield op, graph.values[op.results[0]]


def reduced_fused_values(graph: Graph, unmaterialized: set[int], free: set[int]) -> set[int]:
    """Elementwise values read by reductions of their region and by matmuls, and by nothing
    else, made by a fused chain from one written-out value of their own shape (besides values
    free to make and smaller ones broadcast into it: row statistics, labels, a mask): XLA's
    TPU compiler recomputes such a value inside each of its readers' kernels, the reductions'
    and the matmuls', and writes no buffer for it, so its source stays live until the last of
    them. A cross entropy's logit gradient under an output head with a bias (Flax BERT's,
    haiku's): the bias gradient's reduce_sum and the head's input- and weight-gradient matmuls
    each recompute `softmax - one_hot` from the f32 logits (libtpu 0.0.42, hf_bert with 8 x
    512 tokens per device on v5e:2x4 and 16x16: no logit-sized buffer but the logits). A
    collective-matmul loop that stays a loop is the exception (build_sharding_problem's
    `_loop_written`). Value ids."""
    selects = frozenset(fused_selects(graph, free))  # a one-hot scatter is a fused select
    out = set()
    for op, value in _elementwise_results(graph):
        if value.id in unmaterialized or value.id in graph.outputs or value.type is None:
            continue
        readers = [graph.ops[u] for u in value.users]
        reduces = [u for u in readers if u.name == "stablehlo.reduce"
                   and (u.parent, u.region) == (op.parent, op.region)]
        if not all(u in reduces or u.name in _MATMULS for u in readers) \
                or len(reduces) == len(readers):
            continue
        found = _fused_chain(graph, op, unmaterialized, selects)
        if found is None:
            continue
        chain, leaves = found
        sources = _same_shape_sources(graph, leaves, free, value.type)
        if len(sources) != 1:
            continue
        # Read by matmuls alone, only a value the chain normalizes by row statistics of its
        # source (a softmax's) is recomputed here: GPT's `gelu(x @ w + b)` is left to
        # biased_activations.
        if reduces or _chain_statistics(graph, chain, leaves, free)[1]:
            out.add(value.id)
    return out


def matmul_recomputed_sources(graph: Graph, recomputed: set[int], unmaterialized: set[int],
                              free: set[int]) -> dict[int, int]:
    """Of the values every reader recomputes (reduced_fused_values: `recomputed`), those read
    by matmuls alone -> the one written-out value of their shape they are made from. libtpu
    recomputes such a value in each matmul where each reads it as it is made (keras_gemma on
    v5e:16x16: the logits' gradient, `f32[8,512,32000]` logits live until the input
    gradient); where a reader takes it resharded it writes the value once, for the
    collective, and the source dies there (llama on v5e:16x16, 2 sequences per device after
    the all-to-all: the logits die as the gradient is made; see build_sharding_problem
    `_written_for_reshard`)."""
    out = {}
    for value_id in recomputed:
        value = graph.values[value_id]
        if not value.users or value.type is None or not all(
                graph.ops[u].name in _MATMULS for u in value.users):
            continue
        found = _fused_chain(graph, graph.ops[value.producer], unmaterialized)
        if found is None:
            continue
        sources = _same_shape_sources(graph, found[1], free, value.type)
        if len(sources) == 1:
            out[value_id] = sources[0]
    return out


def _same_shape_sources(graph: Graph, leaves: set[int], free: set[int], type_) -> list[int]:
    """The written-out values a fused chain reads (`leaves` less `free`) that have the shape
    of the value it makes (`type_`): its sources, as against values broadcast into it."""
    return [v for v in leaves - free if (graph.type_of(v) or type_).shape == type_.shape]


def _chain_statistics(graph: Graph, chain: set[int], leaves: set[int],
                      free: set[int]) -> tuple[set[int], set[int]]:
    """(The values the fused `chain` of ops makes, the written-out `leaves` that are row
    statistics of them: _statistic_of.)"""
    made = {r for index in chain for r in graph.ops[index].results}
    return made, {v for v in leaves - free if _statistic_of(graph, v, made | leaves, free)}


def _broadcast_into(graph: Graph, value_id: int, type_) -> bool:
    """Whether `value_id` has fewer elements than a value of `type_` (it is broadcast into
    the chain making it: per-channel statistics, scale and bias)."""
    own = graph.type_of(value_id)
    return own is not None and type_ is not None and own.elements < type_.elements


def _fused_chain(graph: Graph, op, unmaterialized: set[int], selects: frozenset[int] = frozenset(),
                 limit: int = 64) -> tuple[set[int], set[int]] | None:
    """The fused chain making `op`'s value and the written-out values it is made from, or
    None: the chain's ops (op indices) are `op` and the producers of the fused values
    (`unmaterialized`) it reads, back to written-out values (its leaves). None where the
    chain leaves `op`'s region, holds a pad or an op no kernel fuses (but the scatters of
    `selects`, fused_selects' values, and dot_generals that contract nothing: elementwise
    products, op_rules.outer_product), or is longer than `limit` ops."""
    chain: set[int] = set()  # ops of the fused chain making the value
    leaves: set[int] = set()  # written-out values it is made from
    stack = [op.index]
    while stack:
        index = stack.pop()
        if index in chain:
            continue
        chain.add(index)
        node = graph.ops[index]
        if ((node.parent, node.region) != (op.parent, op.region)
                or not (fusible_producer(node.name) or set(node.results) & selects
                        or outer_product(node))
                or node.name == "stablehlo.pad"
                or len(chain) > limit):
            return None
        for operand in node.operands:
            if operand in unmaterialized:
                stack.append(graph.values[operand].producer)
            else:
                leaves.add(operand)
    return chain, leaves


def recomputed_sources(graph: Graph, unmaterialized: set[int], free: set[int]) -> dict[int, int]:
    """Written-out elementwise values that XLA's TPU compiler makes again, from what they are
    made from, for a reader that takes them in another layout: value id -> the one
    written-out value of the value's shape that its fused chain (_fused_chain) is made from,
    besides values free to make (`free`) and smaller ones it broadcasts (row statistics,
    labels), which are held anyway. libtpu
    fuses the chain into the kernel that writes the value in the collective's or copy's layout
    rather than reading the written-out value, so that source is live until the reshard is
    made. The Llama-8B-class step on v5e:16x16 (libtpu 0.0.42): the logits' gradient, a cross
    entropy's `softmax - one_hot` converted to bf16, is made from the f32 logits twice, once
    in the layout of the all-to-all feeding the head's input gradient and once in its own for
    the head's weight gradient, and the f32 logits (1,051 MB per device) stay live until the
    second; made once and all-to-all'd, they would die as it is made."""
    out = {}
    for op, value in _elementwise_results(graph):
        if value.id in unmaterialized or value.type is None or not value.users:
            continue
        found = _fused_chain(graph, op, unmaterialized)
        if found is None:
            continue
        sources = _same_shape_sources(graph, found[1], free, value.type)
        if len(sources) == 1:
            out[value.id] = sources[0]
    return out


def _statistics_sources(graph: Graph, statistics: set[int], made: set[int], leaves: set[int],
                        free: set[int]) -> set[int]:
    """The written-out values (`leaves`) that the reductions making `statistics` read,
    through the fused chain's values (`made`)."""
    found: set[int] = set()
    stack = [v for v in (_reduced_value(graph, s, made | leaves, free) for s in statistics)
             if v is not None]
    seen: set[int] = set()
    while stack:
        value_id = stack.pop()
        if value_id in seen:
            continue
        seen.add(value_id)
        if value_id in leaves:
            found.add(value_id)
        elif value_id in made:
            stack.extend(graph.ops[graph.values[value_id].producer].operands)
    return found


def _reduced_value(graph: Graph, value_id: int, made: set[int], free: set[int],
                   limit: int = 8) -> int | None:
    """The value in `made` that `value_id` is a reduction of (as _statistic_of), or None."""
    for _ in range(limit):
        op = graph.ops[graph.values[value_id].producer]
        if op.name == "stablehlo.reduce":
            return op.operands[0] if op.operands[0] in made else None
        operands = [v for v in op.operands if v not in free]
        if op.name == "arg" or len(operands) != 1:
            return None
        value_id = operands[0]
    return None


def _statistic_of(graph: Graph, value_id: int, made: set[int], free: set[int],
                  limit: int = 8) -> bool:
    """Whether `value_id` is a reduction of a value in `made` (the chain's values and the
    written-out values it is made from), through at most `limit` ops
    with one operand besides splats (broadcasts, reshapes, a maximum with a constant): a
    softmax's row max and row sum, which libtpu keeps (small) and reads with the held scores
    in each kernel that recomputes the probabilities."""
    for _ in range(limit):
        op = graph.ops[graph.values[value_id].producer]
        if op.name == "stablehlo.reduce":
            return op.operands[0] in made
        operands = [v for v in op.operands if v not in free]
        if op.name == "arg" or len(operands) != 1:
            return False
        value_id = operands[0]
    return False
