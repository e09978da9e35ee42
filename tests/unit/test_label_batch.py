"""label-batch on batch-shaped values a program makes without batch data (planning only, no
devices): masks like `jnp.ones_like(tokens)`, position ids broadcast from an iota over the
sequence and the embeddings gathered with them are labelled as the batch, so microbatching
resizes them; a value that differs from example to example without coming from the batch (an
iota over the batch) is refused at its op, and so are batch statistics."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax import export

from hloplan import ir
from hloplan.compiler import make_options
from hloplan.passes.extract_graph import ExtractGraph
from hloplan.passes.inline_calls import InlineCalls
from hloplan.passes.label_batch import BatchError, analyse
from hloplan.passmanager import run_passes

B, S, D, V = 8, 6, 16, 32
PARAMS = {"table": jax.ShapeDtypeStruct((V, D), jnp.float32),
          "pos": jax.ShapeDtypeStruct((S, D), jnp.float32),
          "w": jax.ShapeDtypeStruct((D, D), jnp.float32)}
TOKENS = jax.ShapeDtypeStruct((B, S), jnp.int32)


def _graph(loss):
    def step(params, tokens):  # SGD: the parameters are state, so tokens are the batch
        value, grads = jax.value_and_grad(loss)(params, tokens)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), value

    exported = export.export(jax.jit(step))(PARAMS, TOKENS)
    program = ir.load_program(exported.serialize(), "step.jaxexport")
    return run_passes(program, make_options("8", device="toy"),
                        [InlineCalls(), ExtractGraph()]).graph


def _ops_labelled(graph, analysis, name: str) -> list:
    return [op for op in graph.ops if op.name == name and op.results
            and analysis.label.get(op.results[0]) is not None]


def test_mask_and_position_ids_made_in_the_program_are_labelled_as_the_batch():
    def loss(params, tokens):
        mask = jnp.ones_like(tokens)  # attention-mask style: batch-shaped, no batch data
        positions = jnp.broadcast_to(jnp.arange(S)[None, :], tokens.shape)  # HF position ids
        h = params["table"][tokens] + params["pos"][positions]
        h = jnp.tanh(h @ params["w"]) * mask[..., None]
        return (h ** 2).sum() / mask.sum()

    graph = _graph(loss)
    analysis = analyse(graph)
    assert analysis.batch_size == B
    # the position ids' gather and the mask's broadcast are resized with the batch
    assert _ops_labelled(graph, analysis, "stablehlo.gather")
    assert _ops_labelled(graph, analysis, "stablehlo.broadcast_in_dim")
    assert analysis.part_a and analysis.part_b


def test_an_iota_over_the_batch_is_not_the_same_in_every_microbatch():
    def loss(params, tokens):
        h = params["table"][tokens] @ params["w"]
        row = jnp.arange(B, dtype=jnp.float32)[:, None, None]  # differs per example
        return (h * row).sum()

    graph = _graph(loss)
    with pytest.raises(BatchError) as info:
        analyse(graph)
    assert "does not come from the batch inputs" in info.value.message
    assert info.value.op.name == "stablehlo.multiply"
    assert info.value.op.location is not None


def test_rows_sliced_from_a_parameter_differ_from_example_to_example():
    def loss(params, tokens):
        h = params["table"][tokens] @ params["w"]
        rows = params["table"][:B, None, :]  # one parameter row per example
        return (h * rows).sum()

    graph = _graph(loss)
    with pytest.raises(BatchError) as info:
        analyse(graph)
    assert "does not come from the batch inputs" in info.value.message


def test_batch_statistics_are_refused_at_their_op():
    def loss(params, tokens):
        h = params["table"][tokens] @ params["w"]
        h = (h - h.mean(axis=0)) / (h.std(axis=0) + 1e-5)  # BatchNorm's normalisation
        return (h ** 2).sum()

    graph = _graph(loss)
    with pytest.raises(BatchError) as info:
        analyse(graph)
    assert "batch statistics" in info.value.message
