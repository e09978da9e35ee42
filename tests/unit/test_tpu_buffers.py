"""The TPU compiler's buffer rules (hloplan.tpu_buffers, applied by build-sharding-problem on
device models with `[buffers] fused_reductions = true`): which values libtpu never writes
out. Tiny programs on abstract shapes; no libtpu needed."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import export

import hloplan
from hloplan.mesh import MeshSpec
from hloplan.op_rules import folded_transposes, free_values, fused_values, outer_product
from hloplan.passes.build_sharding_problem import matmul_narrowed, tpu_unmaterialized
from hloplan.strategies import local_bytes
from hloplan.tpu_buffers import (
    biased_activations,
    broadcast_operands,
    combined_values,
    fused_selects,
    gated_values,
    in_place_sums,
    matmul_recomputed_sources,
    normalized_values,
    operand_fused_values,
    output_fused_matmuls,
    pad_operands,
    reduced_fused_values,
    reduced_matmul_sums,
    select_scatters,
    sliced_matmuls,
)

S, F32 = jax.ShapeDtypeStruct, jnp.float32


def _state(step, *args, device="tpu-v5e"):
    data = export.export(jax.jit(step))(*args).serialize()
    return hloplan.compile(data, "8", device=device, mesh_views="off").state


def _ops(graph, name):
    return [op for op in graph.ops if op.name == name]


def _label_grad(g, labels):
    """A cross entropy's label gradient: one element per row scattered into zeros."""
    zeros = jnp.zeros((64, 1024), F32)
    onehot = zeros.at[jnp.arange(64), labels].add(g)
    return jnp.tanh(onehot + 1.0) @ jnp.ones((1024, 8), F32)


def _row_scatter(rows, index):
    """Whole rows scattered: an update window, not a select."""
    return jnp.tanh(jnp.zeros((64, 1024), F32).at[index].add(rows) + 1.0) @ jnp.ones((1024, 8))


def test_one_element_scatters_into_zeros_are_fused_selects() -> None:
    graph = _state(_label_grad, S((64,), F32), S((64,), jnp.int32)).graph
    scatter, = _ops(graph, "stablehlo.scatter")
    free = free_values(graph)
    assert select_scatters(graph, free) == {scatter.index}
    assert fused_selects(graph, free) == {scatter.results[0]}
    rows = _state(_row_scatter, S((8, 1024), F32), S((8,), jnp.int32)).graph
    assert _ops(rows, "stablehlo.scatter") and not select_scatters(rows, free_values(rows))


def _shifted(x, w):
    """logits[:, :-1] of a matmul (a shifted language-model loss)."""
    logits = (x @ w)[:, :-1]
    return jnp.sum(jnp.exp(logits))


def _read_twice(x, w):
    logits = x @ w
    return jnp.sum(jnp.exp(logits[:, :-1])) + jnp.sum(logits)


def test_matmuls_read_by_one_slice_are_sliced_through() -> None:
    args = (S((8, 64, 128), F32), S((128, 1024), F32))
    graph = _state(_shifted, *args).graph
    dot, = _ops(graph, "stablehlo.dot_general")
    assert sliced_matmuls(graph) == {dot.results[0]}
    assert not sliced_matmuls(_state(_read_twice, *args).graph)


def _backward_hidden(g, w2, h, a, w1):
    """The hidden gradient g @ w2^T times an activation's derivative (several elementwise ops,
    one written-out product), read by the next matmul."""
    dh = g @ w2.T
    return (dh * h + dh * jnp.tanh(h) * a) @ w1


def _two_outputs(g, w2, h, a, w1):
    dh = g @ w2.T
    return (dh * h) @ w1, (dh + a) @ w1


def test_matmuls_output_fused_into_one_kernel() -> None:
    args = (S((256, 128), F32), S((512, 128), F32), S((256, 512), F32), S((256, 512), F32),
            S((512, 64), F32))
    graph = _state(_backward_hidden, *args).graph
    fused = fused_values(graph, folded_transposes(graph))
    dh = next(op for op in _ops(graph, "stablehlo.dot_general")
              if graph.type_of(op.results[0]).shape == (256, 512))
    assert dh.results[0] in output_fused_matmuls(graph, fused)
    # Its readers make two written-out values (each read by a matmul): no output fusion.
    graph = _state(_two_outputs, *args).graph
    fused = fused_values(graph, folded_transposes(graph))
    dh = next(op for op in _ops(graph, "stablehlo.dot_general")
              if graph.type_of(op.results[0]).shape == (256, 512))
    assert dh.results[0] not in output_fused_matmuls(graph, fused)


def _activation_recomputed(x, w1, w2, g):
    """A GELU-like activation read by the next matmul and its weight gradient, whose
    pre-activation the backward pass reads after both (for the activation's derivative)."""
    h = x @ w1
    a = h * jnp.tanh(h)
    y = a @ w2
    dw2 = jnp.einsum("bf,bd->fd", a, g)
    dh = (g @ w2.T) * (1.0 - jnp.square(jnp.tanh(h)))
    return y, dw2, dh


def _activation_kept(x, w1, w2, g):
    """The same, the pre-activation last read before the weight gradient: the activation is
    written out (it outlives what it is made from)."""
    h = x @ w1
    a = h * jnp.tanh(h)
    y = a @ w2
    dh = (g @ w2.T) * (1.0 - jnp.square(jnp.tanh(h)))
    dw2 = jnp.einsum("bf,bd->fd", a, g)
    return y, dw2, dh


def _gated(x, w1, w2, g):
    """Made from two held values (a gated MLP's product): recomputed in each matmul too
    (gated_values), not by the one-source rule."""
    h, u = x @ w1, x @ (w1 * 2.0)
    a = h * jnp.tanh(h) * u
    y = a @ w2
    dw2 = jnp.einsum("bf,bd->fd", a, g)
    dh = (g @ w2.T) * (1.0 - jnp.square(jnp.tanh(h))) * u
    return y, dw2, dh


def test_matmul_operands_made_from_held_values_are_recomputed() -> None:
    args = (S((256, 128), F32), S((128, 512), F32), S((512, 128), F32), S((256, 128), F32))
    for step, one_source, recomputed in ((_activation_recomputed, True, True),
                                         (_activation_kept, False, False),
                                         (_gated, False, True)):
        graph = _state(step, *args).graph
        fused = fused_values(graph, folded_transposes(graph))
        activation, = (op.results[0] for op in _ops(graph, "stablehlo.multiply")
                       if len(graph.values[op.results[0]].users) == 2)
        assert (activation in operand_fused_values(graph, fused, free_values(graph))) == one_source
        assert (activation in tpu_unmaterialized(graph, fused)) == recomputed


def _biased_mlp(x, w1, b, w2, g, approximate, derivative):
    """An MLP's `gelu(x @ w1 + b) @ w2` and its gradients; `derivative`: the gradient reaches
    the pre-activation (GELU's derivative, read after the weight gradient of w2), else only
    w2's weight gradient is taken."""
    def hidden(w1, b):
        return jax.nn.gelu(x @ w1 + b, approximate=approximate)

    if derivative:
        y, vjp = jax.vjp(lambda w1, b, w2: hidden(w1, b) @ w2, w1, b, w2)
        return y, vjp(g)
    a = hidden(w1, b)
    return a @ w2, jnp.einsum("bf,bd->fd", a, g)


def test_biased_activations_are_recomputed_in_their_matmuls() -> None:
    """libtpu writes `x @ w1 + b` in the matmul's kernel and recomputes the GELU in each
    matmul reading it where GELU's derivative reads the sum after them (hf_bert on
    v5e:16x16: no buffer of the activation); without that later reader the activation is
    written out. Exact GELU (erf's polynomials, about 70 ops) and the tanh form alike; a
    loop carries it as it does gated products (tpu_fusion's fourth set)."""
    from hloplan.passes.build_sharding_problem import tpu_fusion

    args = (S((256, 128), F32), S((128, 512), F32), S((512,), F32), S((512, 128), F32),
            S((256, 128), F32))
    for approximate in (False, True):
        for derivative in (True, False):
            graph = _state(lambda *a, approximate=approximate, derivative=derivative:
                           _biased_mlp(*a, approximate, derivative), *args).graph
            fused = fused_values(graph, folded_transposes(graph))
            activation, = (op.results[0] for op in graph.ops if op.results
                           and graph.type_of(op.results[0]) is not None
                           and graph.type_of(op.results[0]).shape == (256, 512)
                           and graph.values[op.results[0]].users
                           and all(graph.ops[u].name == "stablehlo.dot_general"
                                   for u in graph.values[op.results[0]].users)
                           and op.name != "stablehlo.dot_general")
            unmaterialized, _, carried, gated = tpu_fusion(graph, fused)
            assert (activation in unmaterialized) == derivative, (approximate, derivative)
            assert (activation in gated and activation in carried) == derivative
            free = free_values(graph)
            assert (activation in biased_activations(graph, fused, free)) == derivative
            assert activation not in operand_fused_values(graph, fused, free)


def _normed_conv(x, w1, w2, scale, bias, g, read):
    """A pre-activation block: relu(norm(h)) of a convolution's output h, with per-channel
    statistics, scale and bias, read by the next convolution and by its kernel gradient;
    `read` is what reads h after both (the norm's backward pass)."""
    dims = ("NHWC", "HWIO", "NHWC")
    h = jax.lax.conv_general_dilated(x, w1, (1, 1), "SAME", dimension_numbers=dims)
    mean = h.mean(axis=(1, 2), keepdims=True)
    var = jnp.square(h).mean(axis=(1, 2), keepdims=True) - jnp.square(mean)
    a = jax.nn.relu((h - mean) * jax.lax.rsqrt(var + 1e-5) * scale + bias)

    def conv(kernel):
        return jax.lax.conv_general_dilated(a, kernel, (1, 1), "SAME", dimension_numbers=dims)

    y, vjp = jax.vjp(conv, w2)
    return y, vjp(g)[0], read(h)


def test_convolution_inputs_are_recomputed_with_their_norms() -> None:
    """libtpu computes a convolution's input relu(norm(h)) inside each convolution reading it,
    from h and the per-channel values broadcast into it (linen_resnet's pre-activation
    blocks: no buffer for the relu, 8 MiB per block per device on v5e:4x8), where h is held
    past them anyway; a dot's operand made with a bias is biased_activations' (GPT's
    `gelu(x @ w + b)`)."""
    f32 = jnp.float32
    args = (S((8, 16, 16, 32), f32), S((3, 3, 32, 64), f32), S((3, 3, 64, 64), f32),
            S((64,), f32), S((64,), f32), S((8, 16, 16, 64), f32))
    for read, recomputed in ((lambda h: jnp.tanh(h) * 2.0, True), (lambda h: None, False)):
        graph = _state(lambda *a, read=read: _normed_conv(*a, read), *args).graph
        fused = fused_values(graph, folded_transposes(graph))
        relu, = (op.results[0] for op in _ops(graph, "stablehlo.maximum")
                 if len(graph.values[op.results[0]].users) == 2)
        assert (relu in operand_fused_values(graph, fused, free_values(graph))) == recomputed


def _padded(x, w, z):
    """An elementwise gradient padded back for two matmuls (Flax GPT-2's shifted logits)."""
    y = jnp.pad(jnp.tanh(x) * 2.0, ((0, 0), (0, 1), (0, 0)))
    return jnp.einsum("bsv,vd->bsd", y, w), jnp.einsum("bsv,bsd->vd", y, z)


def test_written_out_pads_keep_their_operand_in_bf16() -> None:
    graph = _state(_padded, S((4, 63, 256), F32), S((256, 16), F32), S((4, 64, 16), F32)).graph
    pad, = _ops(graph, "stablehlo.pad")
    operand = pad.operands[0]
    fused = fused_values(graph, folded_transposes(graph))
    assert operand in fused  # the generic rules compute it inside the pad
    assert pad_operands(graph, fused) == {operand}
    assert operand not in tpu_unmaterialized(graph, fused)
    # Read only by the pad, which matmuls read: converted to bf16 before the pad.
    narrowed = matmul_narrowed(graph, folded_transposes(graph), "bf16")
    assert narrowed.get(graph.values[operand].producer) == 0.5


def _tied_head(x, w, g):
    """A tied output head: the embedding table transposed, read by two matmuls."""
    wt = w.T
    return x @ wt, jnp.einsum("bv,dv->bd", g, wt)


def test_a_transposed_matmul_operand_is_held_in_bf16() -> None:
    graph = _state(_tied_head, S((64, 128), F32), S((512, 128), F32), S((64, 512), F32)).graph
    transpose, = _ops(graph, "stablehlo.transpose")
    folded = folded_transposes(graph)
    assert transpose.index in folded
    assert matmul_narrowed(graph, folded, "bf16").get(transpose.index) == 0.5


def test_cpu_and_gpu_models_keep_the_generic_rules() -> None:
    """The rules are the TPU compiler's: on cpu and h100 the label-gradient scatter is kept."""
    for device in ("cpu", "h100"):
        state = _state(_label_grad, S((64,), F32), S((64,), jnp.int32), device=device)
        space = state.space
        scatter, = _ops(state.graph, "stablehlo.scatter")
        node = space.node_of[scatter.index]
        live = {r.node for r in state.problem.live_ranges}
        assert node in live
    tpu = _state(_label_grad, S((64,), F32), S((64,), jnp.int32))
    scatter, = _ops(tpu.graph, "stablehlo.scatter")
    assert tpu.space.node_of[scatter.index] not in {r.node for r in tpu.problem.live_ranges}


def _padded_conv(x, w):
    y = jnp.pad(jnp.tanh(x) * 2.0, ((0, 0), (0, 0), (1, 1), (1, 1)))
    return jax.lax.conv(y, w, (1, 1), "VALID")


def test_pads_convolutions_read_keep_the_generic_rules() -> None:
    graph = _state(_padded_conv, S((8, 4, 16, 16), F32), S((8, 4, 3, 3), F32)).graph
    pad, = _ops(graph, "stablehlo.pad")
    fused = fused_values(graph, folded_transposes(graph))
    assert not pad_operands(graph, fused)


def _attention(q, k, v):
    """A softmax's probabilities, read by the value matmul and (in the backward pass) by the
    value gradient's matmul; the backward pass reads the exponentials too."""
    def loss(q, k, v):
        probs = jax.nn.softmax(jnp.einsum("bqd,bkd->bqk", q, k), axis=-1)
        return jnp.sum(jnp.einsum("bqk,bkd->bqd", probs, v) ** 2)
    return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)


def _probs_kept(q, k, v):
    """The probabilities normalized by a sum of other values: written out."""
    def loss(q, k, v):
        scores = jnp.exp(jnp.einsum("bqd,bkd->bqk", q, k))
        probs = scores / jnp.sum(jnp.exp(q), axis=-1, keepdims=True)
        return jnp.sum(jnp.einsum("bqk,bkd->bqd", probs, v) ** 2)
    return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)


def _probabilities(graph):
    """The attention probabilities: the one [4, 256, 256] divide read only by matmuls."""
    probs, = (op.results[0] for op in _ops(graph, "stablehlo.divide")
              if graph.type_of(op.results[0]).shape == (4, 256, 256)
              and all(graph.ops[u].name == "stablehlo.dot_general"
                      for u in graph.values[op.results[0]].users))
    return probs


def test_softmax_probabilities_are_recomputed_from_the_held_scores() -> None:
    """libtpu (gpt on v5e:16x16) keeps each layer's f32 scores and their row max and sum, and
    recomputes the probabilities in the kernels that read them: no buffer for them. A value
    divided by the row sums of something else is still written out."""
    args = (S((4, 256, 128), F32),) * 3
    for step, recomputed in ((_attention, True), (_probs_kept, False)):
        graph = _state(step, *args).graph
        fused = fused_values(graph, folded_transposes(graph))
        probs = _probabilities(graph)
        assert (probs in operand_fused_values(graph, fused, free_values(graph))) == recomputed
        assert (probs in tpu_unmaterialized(graph, fused)) == recomputed


def _masked_attention(q, k, v, mask):
    """_attention with a padding mask, one value per key, added to the scores."""
    def loss(q, k, v):
        scores = jnp.einsum("bqd,bkd->bqk", q, k) + mask[:, None, :]
        probs = jax.nn.softmax(scores, axis=-1)
        return jnp.sum(jnp.einsum("bqk,bkd->bqd", probs, v) ** 2)
    return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)


def _masked_activation(x, w1, w2, g, mask):
    """_activation_recomputed with a value per column broadcast into the activation and no
    statistics of its own values: written out (two held values, as `_gated`)."""
    h = x @ w1
    a = h * jnp.tanh(h) + mask
    y = a @ w2
    dw2 = jnp.einsum("bf,bd->fd", a, g)
    dh = (g @ w2.T) * (1.0 - jnp.square(jnp.tanh(h)))
    return y, dw2, dh


def _logit_grad_matmuls(logits, w, x, labels):
    """A cross entropy's logit gradient `softmax - one_hot`, made from held logits (an
    argument) and read by two matmuls."""
    grad = jax.nn.softmax(logits, axis=-1) - jax.nn.one_hot(labels, logits.shape[-1])
    return grad @ w, jnp.einsum("bsv,bsd->vd", grad, x)


def test_masked_softmax_probabilities_are_recomputed() -> None:
    """A padding mask added to the scores before their row statistics is held with them: libtpu
    (hf_bart on v5e:16x16, 8 x 512 tokens per device) writes the masked f32 scores and their
    row max, recomputes the exponentials in every kernel reading them and writes no buffer
    for the probabilities. An activation with no statistics in its chain keeps counting the
    broadcast value as a second source."""
    args = (S((4, 256, 128), F32),) * 3 + (S((4, 256), F32),)
    graph = _state(_masked_attention, *args).graph
    fused = fused_values(graph, folded_transposes(graph))
    probs = _probabilities(graph)
    assert probs in operand_fused_values(graph, fused, free_values(graph))
    assert probs in tpu_unmaterialized(graph, fused)
    args = (S((256, 128), F32), S((128, 512), F32), S((512, 128), F32), S((256, 128), F32),
            S((512,), F32))
    graph = _state(_masked_activation, *args).graph
    fused = fused_values(graph, folded_transposes(graph))
    activation, = (op.results[0] for op in _ops(graph, "stablehlo.add")
                   if len(graph.values[op.results[0]].users) == 2
                   and graph.type_of(op.results[0]).shape == (256, 512))
    assert activation not in operand_fused_values(graph, fused, free_values(graph))
    # The labels enter a cross entropy's gradient after the row statistics: still a source.
    args = (S((8, 64, 512), F32), S((512, 128), F32), S((8, 64, 128), F32),
            S((8, 64), jnp.int32))
    graph = _state(_logit_grad_matmuls, *args).graph
    fused = fused_values(graph, folded_transposes(graph))
    grad, = (op.results[0] for op in graph.ops if op.results
             and graph.type_of(op.results[0]) is not None
             and graph.type_of(op.results[0]).shape == (8, 64, 512)
             and sum(graph.ops[u].name == "stablehlo.dot_general"
                     for u in graph.values[op.results[0]].users) == 2)
    assert grad not in operand_fused_values(graph, fused, free_values(graph))


def _head_masked_attention(q, k, v):
    """_attention over heads, scaled by Flax BERT's head mask: a row of an all-ones
    `[layers, heads]` array, multiplied in by an einsum that contracts nothing, and the
    result transposed for the value matmul."""
    head_mask = jnp.ones((2, 4), F32)[1]

    def loss(q, k, v):
        probs = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k), axis=-1)
        probs = jnp.einsum("...hqk,h->...hqk", probs, head_mask)
        return jnp.sum(jnp.einsum("bhqk,bkhd->bqhd", probs, v) ** 2)
    return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)


def test_head_masked_probabilities_are_recomputed_from_the_held_scores() -> None:
    """libtpu (hf_bert on v5e:16x16 and 2x4, 8 x 512 tokens per device) keeps each layer's
    f32 scores and writes no buffer for the probabilities scaled by the head mask: the
    mask is a slice of constants and its einsum an elementwise product, so the value the
    matmuls read is made from the scores alone."""
    graph = _state(_head_masked_attention, *(S((4, 128, 4, 32), F32),) * 3).graph
    assert any(outer_product(op) for op in graph.ops)
    fused = fused_values(graph, folded_transposes(graph), outer_products=True)
    scaled, = (op.results[0] for op in _ops(graph, "stablehlo.transpose")
               if graph.type_of(op.results[0]).shape == (4, 4, 128, 128)
               and [graph.ops[u].name for u in graph.values[op.results[0]].users]
               == ["stablehlo.dot_general"] * 2)
    assert scaled in operand_fused_values(graph, fused, free_values(graph))
    assert scaled in tpu_unmaterialized(graph, fused)


def _residual_norm(x, w, b, g):
    """A LayerNorm of a residual sum `x + (x @ w + b)`, differentiated: the sum is read by
    the statistics, the normalization and the backward pass."""
    def norm(x, w, b):
        s = x + x @ w + b
        mean = s.mean(-1, keepdims=True)
        var = jnp.square(s - mean).mean(-1, keepdims=True)
        return jnp.tanh((s - mean) * jax.lax.rsqrt(var + 1e-5))
    y, vjp = jax.vjp(norm, x, w, b)
    return y, vjp(g)


def _residual_sums(x, w, b):
    """The same sum read by reductions only: one kernel reads it."""
    s = x + x @ w + b
    return s.sum(-1), jnp.square(s).sum(-1)


def test_sums_of_two_written_values_read_by_several_kernels_are_written() -> None:
    """libtpu writes a residual sum read by a LayerNorm's statistics and the kernels after
    them in the matmul's kernel, and holds neither the matmul result nor its other source
    for those readers (hf_bert on v5e:16x16); read by reductions only, it is made inside
    their kernel. The matmul result keeps its buffer (its node holds the matmul's copies),
    live until the sum is made."""
    args = (S((256, 128), F32), S((128, 128), F32), S((128,), F32), S((256, 128), F32))
    for step, written in ((_residual_norm, True), (_residual_sums, False)):
        graph = _state(step, *args[:3 + written]).graph
        fused = fused_values(graph, folded_transposes(graph), outer_products=True)
        dot = _ops(graph, "stablehlo.dot_general")[0]
        residual, = graph.values[dot.results[0]].users
        total, = graph.values[graph.ops[residual].results[0]].users
        value = graph.ops[total].results[0]
        assert value in fused
        assert (value in combined_values(graph, fused, free_values(graph))) == written
        unmaterialized = tpu_unmaterialized(graph, fused)
        assert (value not in unmaterialized) == written
        assert dot.results[0] not in unmaterialized


def _cross_entropy_grads(x, w, labels):
    """A cross entropy's gradients: the logits' gradient `softmax - one_hot`, an elementwise
    chain of the f32 logits, read by the input gradient's and the weight gradient's matmuls."""
    def loss(x, w):
        logp = jax.nn.log_softmax(jnp.einsum("bsd,dv->bsv", x, w), axis=-1)
        return -jnp.mean(jnp.sum(logp * jax.nn.one_hot(labels, w.shape[1]), axis=-1))
    return jax.grad(loss, argnums=(0, 1))(x, w)


def test_a_resharded_gradient_is_written_once_unless_split_to_one_element() -> None:
    """The logits' gradient, which each of its two matmuls recomputes from the f32 logits
    (matmul_recomputed_sources), where the last of them reads it resharded: with two
    sequences per device after the all-to-all (llama on v5e:16x16) libtpu writes it once and
    the logits die as it is made, so that reshard's copy is credited the logits' bytes;
    where the all-to-all's reshape only inserts size-1 dims (one sequence per device after
    it: the Llama-8B-class step on v5e:16x16) libtpu makes it again from the logits for the
    all-to-all, which stay live until then: no credit."""
    for batch, credited in ((8, False), (16, True)):
        args = (S((batch, 64, 128), F32), S((128, 512), F32), S((batch, 64), jnp.int32))
        state = _state(_cross_entropy_grads, *args)
        graph = state.graph
        fused = fused_values(graph, folded_transposes(graph))
        unmaterialized = tpu_unmaterialized(graph, fused)
        sources = matmul_recomputed_sources(graph, unmaterialized, unmaterialized,
                                            free_values(graph))
        grad, = (v for v in sources
                 if sum(graph.ops[u].name == "stablehlo.dot_general"
                        for u in graph.values[v].users) == 2)
        logits = graph.values[sources[grad]]
        assert graph.ops[logits.producer].name == "stablehlo.dot_general"
        resharded = [edge.relayout[i][j] if edge.relayout else 0.0
                     for edge in state.problem.edges if edge.label.startswith(f"%{grad} ")
                     and edge.label.endswith(f"-> %{max(graph.values[grad].users)}")
                     for i, row in enumerate(edge.costs) for j, seconds in enumerate(row)
                     if seconds > 0 and edge.copies]
        assert resharded and any(cell < 0 for cell in resharded)
        # Eight sequences on 8 devices: the all-to-alls to one sequence each get no credit.
        assert all(cell < 0 for cell in resharded) == credited


def _biased_head_grads(x, w, b, labels):
    """An output head with a bias (Flax BERT's, haiku's): the logits' gradient is read by the
    bias gradient's reduce_sum and by the weight and input gradients' matmuls."""
    def loss(x, w, b):
        logp = jax.nn.log_softmax(x @ w + b, axis=-1)
        return -jnp.mean(jnp.sum(logp * jax.nn.one_hot(labels, w.shape[1]), axis=-1))
    return jax.grad(loss, argnums=(0, 1, 2))(x, w, b)


def _logit_gradient(graph, vocab: int = 4096):
    grad, = (op.results[0] for op in graph.ops if op.results
             and {graph.ops[u].name for u in graph.values[op.results[0]].users}
             == {"stablehlo.reduce", "stablehlo.dot_general"}
             and graph.type_of(op.results[0]).rank == 2
             and graph.type_of(op.results[0]).shape[1] == vocab)
    return grad


def test_a_gradient_reduced_beside_matmuls_is_recomputed_by_each_reader() -> None:
    """libtpu writes no buffer for a biased head's logit gradient: the bias gradient's
    reduction and both matmuls recompute it from the f32 logits (hf_bert on v5e:2x4 and
    16x16); nor, without the bias, for one only the two matmuls read (keras_gemma on
    v5e:16x16), which the logits' row statistics normalize; an activation only matmuls read,
    made from its pre-activation without such statistics, is written out."""
    args = (S((2048, 256), F32), S((256, 4096), F32), S((4096,), F32), S((2048,), jnp.int32))
    graph = _state(_biased_head_grads, *args).graph
    fused = fused_values(graph, folded_transposes(graph))
    grad = _logit_gradient(graph)
    assert grad in reduced_fused_values(graph, fused | fused_selects(graph, free_values(graph)),
                                        free_values(graph))
    assert grad in tpu_unmaterialized(graph, fused)
    plain = _state(_cross_entropy_grads, S((8, 64, 128), F32), S((128, 512), F32),
                   S((8, 64), jnp.int32)).graph
    plain_fused = fused_values(plain, folded_transposes(plain))
    assert reduced_fused_values(plain, plain_fused | fused_selects(plain, free_values(plain)),
                                free_values(plain))
    kept = _state(_activation_kept, S((256, 128), F32), S((128, 512), F32), S((512, 128), F32),
                  S((256, 128), F32)).graph
    assert not reduced_fused_values(kept, fused_values(kept, folded_transposes(kept)),
                                    free_values(kept))


def _looped_transients(vocab: int, shape: str, mesh: MeshSpec) -> dict[bool, set[float]]:
    """The transients, in units of the logit gradient's local bf16 bytes, of the strategies of
    the biased head's weight gradient that loop, copying the gradient, scattered onto the
    vocabulary: {whether the loop is over more than 4 devices: the units seen}."""
    args = (S((16384, 256), F32), S((256, vocab), F32), S((vocab,), F32),
            S((16384,), jnp.int32))
    data = export.export(jax.jit(_biased_head_grads))(*args).serialize()
    state = hloplan.compile(data, shape, device="tpu-v5e", mesh_views="off").state
    graph = state.graph
    grad = _logit_gradient(graph, vocab)
    seen: dict[bool, set[float]] = {}
    for u in graph.values[grad].users:
        if u not in state.space.strategies or graph.ops[u].name != "stablehlo.dot_general":
            continue
        node = state.problem.nodes[state.space.node_of[u]]
        for op_strategy, strategy in zip(state.space.strategies[u], node.strategies, strict=True):
            k = op_strategy.copied
            if not strategy.accumulators or k < 0 or graph.ops[u].operands[k] != grad:
                continue
            if (graph.type_of(graph.ops[u].results[0]).shape != (vocab, 256)
                    or not op_strategy.results[0][0]):
                continue  # the input gradient, or the weight's scattered onto its other dim
            n = math.prod(mesh.axis_sizes[a] for a in op_strategy.reduced_axes)
            bf16 = local_bytes(graph.type_of(grad), op_strategy.operands[k], mesh) / 2
            seen.setdefault(n > 4, set()).add(round(strategy.transient / bf16, 3))
    return seen


def test_a_loop_reading_a_recomputed_gradient_writes_it() -> None:
    """A collective-matmul loop that stays a loop (over 8 devices: two trips of its unrolled
    body) carries the logit gradient as a buffer. Where it carries it in the value's own
    layout (4,096 words: chunks of 512, vocabulary-minor like the logits) libtpu writes it in
    bf16 for the loop and in f32 for the other readers (hf_bert on v5e:4x8), held with the
    loop (3 x the bf16 bytes); where it wants another (32,000 words: chunks of 4,000,
    carried tokens-minor) the loop's bf16 copy is all (haiku_transformer on v5e:2x4). A loop
    over 4 devices is inlined and its chunk kernels recompute the gradient, copying nothing
    (v5e:2x4, over y)."""
    one_axis = MeshSpec(("x",), (8,))
    assert _looped_transients(4096, "8", one_axis) == {True: {3.0}}
    assert _looped_transients(32000, "8", one_axis) == {True: {1.0}}
    assert _looped_transients(4096, "2x4", MeshSpec(("x", "y"), (2, 4)))[False] == {0.0}


def _repeated_key_scores(repeats):
    """A step scoring query heads against key heads each repeated `repeats` times along the
    heads dim, with its backward pass: one key head repeated to 8 query heads (keras-hub
    Gemma's grouped-query attention: `ops.repeat(key, 8, axis=2)`), or two each to four
    (Flax Llama's `repeat_kv`)."""
    def step(x, wq, wk, g):
        def scores(wq, wk):
            q = jnp.einsum("bsd,dnh->bsnh", x, wq)
            k = jnp.repeat(jnp.einsum("bsd,dnh->bsnh", x, wk), repeats, axis=2)
            return jnp.einsum("bqnh,bknh->bnqk", q, k)

        out, vjp = jax.vjp(scores, wq, wk)
        return out, vjp(g)
    return step


def test_a_key_repeated_over_query_heads_is_repeated_inside_the_matmuls() -> None:
    """libtpu holds a grouped-query attention's keys as the key matmul wrote them, not
    repeated over the query heads (keras_gemma on v5e:16x16: `bf16[8,512,128]` per layer, no
    `[8,512,8,128]` buffer): the repeated value is no buffer, the key head is one; the
    queries' reshape into heads repeats nothing and is written as before."""
    args = (S((4, 128, 256), F32), S((256, 8, 64), F32), S((256, 1, 64), F32),
            S((4, 8, 128, 128), F32))
    graph = _state(_repeated_key_scores(8), *args).graph
    fused = fused_values(graph, folded_transposes(graph))
    unmaterialized = tpu_unmaterialized(graph, fused)
    repeated = broadcast_operands(graph, fused)
    (value, key), = repeated.items()
    assert graph.type_of(value).shape[2] == 8 and graph.type_of(key).elements * 8 == \
        graph.type_of(value).elements
    assert graph.ops[graph.values[key].producer].name == "stablehlo.dot_general"
    assert value in unmaterialized and key not in unmaterialized
    queries = [op.results[0] for op in _ops(graph, "stablehlo.dot_general")
               if graph.type_of(op.results[0]).shape == (4, 128, 8, 64)]
    assert queries and not set(queries) & set(repeated)
    # Repeats interleaved into the key heads' dim are written (hf_llama on v5e:16x16).
    interleaved = _state(_repeated_key_scores(4), S((4, 128, 256), F32), S((256, 8, 64), F32),
                         S((256, 2, 64), F32), S((4, 8, 128, 128), F32)).graph
    assert not broadcast_operands(interleaved,
                                  fused_values(interleaved, folded_transposes(interleaved)))


def test_a_loop_reading_a_gradient_only_matmuls_read_writes_it_in_bf16() -> None:
    """The logits' gradient of a head without a bias, which only the head's two matmuls read
    and each recomputes: a weight-gradient loop that stays a loop (over 8 devices) writes it
    in bf16 for itself, and nothing in f32 (no reduction reads it): its transient is the
    gradient's local bf16 bytes, where the biased head's is three times them."""
    vocab = 4096
    args = (S((16, 1024, 256), F32), S((256, vocab), F32), S((16, 1024), jnp.int32))
    data = export.export(jax.jit(_cross_entropy_grads))(*args).serialize()
    state = hloplan.compile(data, "8", device="tpu-v5e", mesh_views="off").state
    graph, mesh = state.graph, MeshSpec(("x",), (8,))
    grad = next(v.id for v in graph.values if v.type is not None
                and v.type.shape == (16, 1024, vocab) and v.users
                and all(graph.ops[u].name == "stablehlo.dot_general" for u in v.users))
    seen = set()
    for u in graph.values[grad].users:
        node = state.problem.nodes[state.space.node_of[u]]
        for op_strategy, strategy in zip(state.space.strategies[u], node.strategies, strict=True):
            k = op_strategy.copied
            if (not strategy.accumulators or k < 0 or graph.ops[u].operands[k] != grad
                    or graph.type_of(graph.ops[u].results[0]).rank != 2):
                continue  # the input gradient, or no loop copying the gradient
            vocab_dim = graph.type_of(graph.ops[u].results[0]).shape.index(vocab)
            if not op_strategy.results[0][vocab_dim]:
                continue  # scattered onto the width
            bf16 = local_bytes(graph.type_of(grad), op_strategy.operands[k], mesh) / 2
            seen.add(round(strategy.transient / bf16, 3))
    assert seen == {1.0}


def _vocab_step(w1, w2, x, y):
    """A softmax classifier's gradients: its input gradient `g @ w2^T` is summed with
    another term in one kernel (an output fusion: no buffer of its own)."""
    def loss(w1, w2):
        logits = jnp.tanh(x @ w1) @ w2
        return -jnp.mean(jnp.sum(jax.nn.one_hot(y, logits.shape[-1])
                                 * jax.nn.log_softmax(logits, axis=-1), axis=-1))
    return jax.grad(loss, argnums=(0, 1))(w1, w2)


def test_a_loop_without_a_result_buffer_is_checked_where_it_runs() -> None:
    """The input gradient of a softmax head, reduce-scattered over 8 devices (a loop that
    stays a loop, carrying the logits' gradient as a buffer) and fused into the kernel that
    sums it, holds no value: the estimate still checks the point after it, where the loop's
    buffer is held (libtpu on v5e:2x4, 128 MiB of logits per device: its peak there)."""
    args = (S((512, 512), F32), S((512, 32768), F32), S((8192, 512), F32),
            S((8192,), jnp.int32))
    data = export.export(jax.jit(_vocab_step))(*args).serialize()
    state = hloplan.compile(data, "2x4", device="tpu-v5e", mesh_views="off").state
    graph = state.graph
    unmaterialized = tpu_unmaterialized(graph, fused_values(graph, folded_transposes(graph)))
    grad, = (v.id for v in graph.values if v.type is not None
             and v.type.shape == (8192, 32768) and v.users
             and all(graph.ops[u].name == "stablehlo.dot_general" for u in v.users))
    assert grad in unmaterialized
    input_gradient, = (u for u in graph.values[grad].users
                       if graph.type_of(graph.ops[u].results[0]).shape == (8192, 512))
    assert graph.ops[input_gradient].results[0] in unmaterialized
    labels = {point.label.split(" ")[1] for point in state.problem.live_points}
    assert f"%{input_gradient}" in labels


def _post_norm(x, w1, w2, scale, bias):
    """Two post-LN residual layers `ln(x + x @ w + b)` (BART's): each norm's output is read by
    the next matmul and the next residual sum."""
    def ln(s):
        mean = jnp.mean(s, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(s - mean), axis=-1, keepdims=True)
        return (s - mean) * jax.lax.rsqrt(var + 1e-5) * scale + bias

    def loss(x, w1, w2):
        h = ln(x + x @ w1 + bias)
        h = ln(h + h @ w2 + bias)
        return jnp.sum(jnp.square(h))
    return jax.grad(loss, argnums=(1, 2))(x, w1, w2)


def _post_norm_values(graph):
    """(the residual sums, the matmul results they add, the norm outputs) of _post_norm's
    forward pass, as value ids."""
    sums, products, norms = set(), set(), set()
    for op in graph.ops:
        label = op.label or ""
        if op.name == "stablehlo.dot_general" and "transpose" not in label:
            products |= set(op.results)
    for op in graph.ops:
        if op.name != "stablehlo.add" or "transpose" in (op.label or ""):
            continue
        users = [graph.ops[u].name for u in graph.values[op.results[0]].users]
        if "stablehlo.reduce" in users and graph.type_of(op.results[0]).rank == 2:
            sums.add(op.results[0])
        elif any(u == "stablehlo.dot_general" for u in users):
            norms.add(op.results[0])
    return sums, products, norms


def test_post_norm_layers_write_the_residual_sum_and_recompute_the_norm() -> None:
    """libtpu writes each residual sum `x + h @ w + b` in the matmul's kernel (with its row
    statistics) and no buffer of the matmul result, and recomputes the norm's output in each
    kernel reading it, the matmuls' included (hf_bart on v5e:16x16, libtpu 0.0.42; a
    deviceless MLP stack on v5e:2x2)."""
    args = (S((512, 256), F32), S((256, 256), F32), S((256, 256), F32), S((256,), F32),
            S((256,), F32))
    graph = _state(_post_norm, *args).graph
    fused = fused_values(graph, folded_transposes(graph))
    sums, products, norms = _post_norm_values(graph)
    assert len(sums) == 2 and len(norms) >= 1
    # The rule finds each sum and the matmul result it replaces; where combined_values
    # writes a sum already (two written-out sources), the matmul result is held until the
    # sum is made instead.
    alone = reduced_matmul_sums(graph, fused)
    assert set(alone) == sums and all(chain & products for chain in alone.values())
    combined = combined_values(graph, fused, free_values(graph))
    written = reduced_matmul_sums(graph, set(fused) - combined)
    assert set(written) | (combined & sums) == sums
    unmaterialized = tpu_unmaterialized(graph, fused)
    assert not sums & unmaterialized
    assert products - unmaterialized <= {p for p in products
                                         if not any(p in c for c in written.values())}
    out = set(fused) - combined
    for value, chain in written.items():
        out = (out - {value}) | chain
    assert norms <= normalized_values(graph, out, free_values(graph))
    assert norms <= unmaterialized


def test_a_loop_reading_a_recomputed_norm_holds_its_bf16_copy() -> None:
    """A weight gradient's collective-matmul loop that stays a loop (over 8 devices) carries
    the norm output it reads as a buffer libtpu writes in bf16 in the forward pass (hf_bart on
    v5e:2x4): the read holds those bytes (Edge.carried) under looping strategies only."""
    args = (S((65536, 1024), F32), S((1024, 1024), F32), S((1024, 1024), F32),
            S((1024,), F32), S((1024,), F32))
    data = export.export(jax.jit(_post_norm))(*args).serialize()
    problem = hloplan.compile(data, "8", device="tpu-v5e", mesh_views="off").state.problem
    carried = [e for e in problem.edges if e.carried]
    assert carried
    for edge in carried:
        strategies = problem.nodes[edge.dst].strategies
        assert all(s.accumulators > 0 for b, s in zip(edge.carried, strategies) if b > 0)
        assert any(b > 0 for b in edge.carried)
        assert edge.held[0] <= edge.held[1]


def _gated_mlp(x, w_gate, w_up, w_down):
    """A GeGLU MLP's loss: the product `gelu(x @ w_gate) * (x @ w_up)` is read by the down
    projection and its weight gradient; the backward pass reads both matmul results again."""
    def loss(ws):
        w_gate, w_up, w_down = ws
        h = jax.nn.gelu(x @ w_gate, approximate=True) * (x @ w_up)
        return jnp.mean((h @ w_down) ** 2)

    return jax.grad(loss)((w_gate, w_up, w_down))


def test_gated_products_are_recomputed_in_each_matmul() -> None:
    """keras_gemma's GeGLU and hf_llama's SwiGLU on v5e:16x16 (libtpu 0.0.42): no buffer of
    the product, recomputed from the f32 gate and up results in the down projection's
    forward kernel and in its weight gradient's."""
    args = (S((512, 256), F32), S((256, 1024), F32), S((256, 1024), F32), S((1024, 256), F32))
    graph = _state(_gated_mlp, *args).graph
    fused = fused_values(graph, folded_transposes(graph))
    # The forward product: the first multiply of its shape that only matmuls read.
    product = min(op.results[0] for op in _ops(graph, "stablehlo.multiply")
                  if graph.type_of(op.results[0]).shape == (512, 1024)
                  and graph.values[op.results[0]].users
                  and all(graph.ops[u].name == "stablehlo.dot_general"
                          for u in graph.values[op.results[0]].users))
    unmaterialized = tpu_unmaterialized(graph, fused)
    assert product in unmaterialized
    assert product in gated_values(graph, unmaterialized - {product}, free_values(graph))
    # Both matmul results stay written (the backward pass reads them).
    sources = [v for v in graph.ops[graph.values[product].producer].operands
               if graph.type_of(v).shape == (512, 1024)]
    assert not any(graph.ops[graph.values[v].producer].name == "stablehlo.dot_general"
                   and v in unmaterialized for v in sources)



def _conv(h, w):
    return jax.lax.conv_general_dilated(h, w, (1, 1), "SAME",
                                        dimension_numbers=("NHWC", "HWIO", "NHWC"))


def _norm_relu_convs(x, w0, w1, b):
    """The input gradient of `relu(norm(x) + b)` read by two convolutions (a ResNet block's
    residual and main branches): the two convolutions' input gradients are summed, masked
    by the ReLU's select, and that select is reduced (b's gradient) and multiplied (the
    norm's backward)."""
    def loss(x, b):
        m = jnp.mean(x, axis=(1, 2, 3), keepdims=True)
        v = jnp.mean(jnp.square(x - m), axis=(1, 2, 3), keepdims=True)
        h = jax.nn.relu((x - m) * jax.lax.rsqrt(v + 1e-5) + b)
        return jnp.sum(jnp.square(_conv(h, w0) + _conv(h, w1)))
    return jax.grad(loss, argnums=(0, 1))(x, b)


def test_a_convolution_writes_the_select_its_gradient_sum_makes() -> None:
    """libtpu computes the second convolution's input gradient inside the kernel that writes
    the ReLU gradient's select (with its reductions), into the first one's buffer: that
    convolution result is never written even though the select is (a multi-output value).
    flax linen ResNet on v5e:4x8, 32 images of 64x64 per device: `fusion.199`, Block_1's
    Conv_1 gradient, writes the select; Block_0's Conv_1 gradient alike (`fusion.200`)."""
    args = (S((8, 32, 32, 64), F32), S((3, 3, 64, 64), F32), S((1, 1, 64, 64), F32),
            S((64,), F32))
    graph = _state(_norm_relu_convs, *args).graph
    fused = fused_values(graph, folded_transposes(graph))
    combined = combined_values(graph, fused, free_values(graph))
    select, = (op.results[0] for op in _ops(graph, "stablehlo.select")
               if graph.type_of(op.results[0]).shape == (8, 32, 32, 64))
    assert select in combined  # written out: reduced and read by other kernels
    gradients = {op.results[0] for op in _ops(graph, "stablehlo.convolution")
                 if "transpose" in (op.label or "")}
    sums = reduced_matmul_sums(graph, set(fused) - combined)
    assert select in sums and len(sums[select] & gradients) == 1
    unmaterialized = tpu_unmaterialized(graph, fused)
    assert select not in unmaterialized
    assert len(gradients & unmaterialized) == 1


def test_a_convolution_sum_takes_the_buffer_of_the_gradient_it_adds() -> None:
    """The kernel writing the ReLU gradient's select reads the other convolution's input
    gradient elementwise and last: libtpu writes the select into that gradient's buffer (flax
    linen ResNet on v5e:2x4, 32 images of 64x64 per device: `fusion.197` aliases its output
    with `fusion.227`, Block_1's Conv_0 gradient). The two are never live together."""
    args = (S((8, 32, 32, 64), F32), S((3, 3, 64, 64), F32), S((1, 1, 64, 64), F32),
            S((64,), F32))
    state = _state(_norm_relu_convs, *args)
    graph, space, problem = state.graph, state.space, state.problem
    fused = fused_values(graph, folded_transposes(graph))
    unmaterialized = tpu_unmaterialized(graph, fused)
    select, = (op.results[0] for op in _ops(graph, "stablehlo.select")
               if graph.type_of(op.results[0]).shape == (8, 32, 32, 64))
    written, = (op.results[0] for op in _ops(graph, "stablehlo.convolution")
                if "transpose" in (op.label or "") and op.results[0] not in unmaterialized
                and graph.type_of(op.results[0]).shape == (8, 32, 32, 64))
    assert in_place_sums(graph, unmaterialized) == {select: written}
    ranges = {r.node: r for r in problem.live_ranges}
    gradient = ranges[space.node_of[graph.values[written].producer]]
    made = ranges[space.node_of[graph.values[select].producer]]
    assert gradient.last < made.first
