"""Plans an expert would recognise, asserted on plan structure (never on timings).

An MLP train step (SGD), exported abstractly at realistic sizes and planned for 8 H100s:
- large batch, small weights: data parallel (batch split, weights replicated, gradients
  all-reduced);
- small batch, large weights: Megatron-style tensor parallel (column then row splits, the
  activations replicated between them, an all-reduce after each row-parallel matmul);
- a memory budget below the replicated weights: the weights end up sharded, and the plan fits;
- a budget nothing fits: a clear error saying by how much.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax import export

import hloplan
from hloplan.diagnostics import HloplanError
from hloplan.units import parse_bytes


def mlp_step(params, x, y):
    def loss(p):
        h = x
        for i, w in enumerate(p):
            h = h @ w
            if i < len(p) - 1:
                h = jax.nn.relu(h)
        return jnp.mean((h - y) ** 2)

    value, grads = jax.value_and_grad(loss)(params)
    return value, jax.tree.map(lambda p, g: p - 1e-3 * g, params, grads)


def export_mlp(batch: int, hidden: int, layers: int) -> bytes:
    s = jax.ShapeDtypeStruct
    params = [s((hidden, hidden), jnp.float32) for _ in range(layers)]
    data = s((batch, hidden), jnp.float32)
    return export.export(jax.jit(mlp_step))(params, data, data).serialize()


def specs(plan: dict) -> dict[str, list]:
    return {a["name"]: a["spec"] for a in plan["arguments"]}


def test_large_batch_small_weights_is_data_parallel():
    plan = hloplan.compile(export_mlp(batch=65536, hidden=1024, layers=4), "8", device="h100").plan
    spec = specs(plan)
    assert spec["x"] == [["x"], []] and spec["y"] == [["x"], []]
    weights = [spec[f"params[{i}]"] for i in range(4)]
    assert all(not any(w) for w in weights), weights  # replicated
    kinds = {c["kind"] for c in plan["estimate"]["collectives"]}
    assert "all-reduce" in kinds  # the weight gradients


def test_small_batch_large_weights_is_megatron_tensor_parallel():
    plan = hloplan.compile(export_mlp(batch=64, hidden=8192, layers=4), "8", device="h100").plan
    spec = specs(plan)
    assert not any(spec["x"]), spec["x"]  # the small batch is not split
    weights = [spec[f"params[{i}]"] for i in range(4)]
    # Alternating column-parallel ([-, x]) and row-parallel ([x, -]) layers.
    assert weights[0] == [[], ["x"]] and weights[1] == [["x"], []], weights
    assert weights[2] == [[], ["x"]] and weights[3] == [["x"], []], weights
    all_reduces = [c for c in plan["estimate"]["collectives"] if c["kind"] == "all-reduce"]
    assert all_reduces and all_reduces[0]["count"] >= 2


def test_memory_budget_shards_the_weights():
    data = export_mlp(batch=65536, hidden=4096, layers=8)
    free = hloplan.compile(data, "8", device="h100").plan
    replicated_weights = sum(a["bytes"] for a in free["arguments"] if a["name"].startswith("params"))
    budget = parse_bytes("2GiB")
    assert budget < free["estimate"]["peak_memory_bytes"] + replicated_weights
    tight = hloplan.compile(data, "8", device="h100", memory_budget="2GiB").plan
    assert tight["estimate"]["peak_memory_bytes"] <= budget
    sharded = [a for a in tight["arguments"] if a["name"].startswith("params") and any(a["spec"])]
    assert len(sharded) > len([a for a in free["arguments"]
                               if a["name"].startswith("params") and any(a["spec"])])


def test_budget_nothing_fits_is_an_error():
    with pytest.raises(HloplanError) as info:
        hloplan.compile(export_mlp(batch=1024, hidden=8192, layers=8), "8", device="h100",
                        memory_budget="100MiB")
    text = "\n".join(d.format() for d in info.value.diagnostics)
    assert "no plan fits the memory budget of 100 MiB" in text
    assert "over budget" in text
