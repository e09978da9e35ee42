"""An embedding lookup sharded on the vocabulary, run on 8 simulated CPU devices: a train step
whose table (32,768 rows of 33: the rows split over the mesh, the 33 columns do not) outweighs
the lookup's result. The plan keeps the table row-sharded for the lookup (a masked lookup whose
partial rows are all-reduced) and for its gradient (each device scatters the rows it holds), and
the sharded step equals the single-device one."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import hloplan

pytestmark = pytest.mark.usefixtures("devices8")

VOCAB, WIDTH, BATCH, SEQ = 32768, 33, 64, 32


def _loss(params, ids, y):
    h = jnp.tanh(params["table"][ids] @ params["w"])
    return jnp.mean(jnp.square(h - y))


def embedding_step(params, ids, y):
    loss, grads = jax.value_and_grad(_loss)(params, ids, y)
    return loss, jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)


def _args():
    keys = jax.random.split(jax.random.key(0), 4)
    params = {"table": jax.random.normal(keys[0], (VOCAB, WIDTH)),
              "w": jax.random.normal(keys[1], (WIDTH, WIDTH)) / WIDTH**0.5}
    ids = jax.random.randint(keys[2], (BATCH, SEQ), 0, VOCAB)
    y = jax.random.normal(keys[3], (BATCH, SEQ, WIDTH))
    return params, ids, y


def test_vocabulary_sharded_lookup(tmp_path):
    args = _args()
    path = tmp_path / "step.jaxexport"
    path.write_bytes(export.export(jax.jit(embedding_step))(*args).serialize())
    result = hloplan.compile(path, "2x4", output=tmp_path / "plan", device="cpu")
    ops = {op["op"]: op for op in result.plan["ops"]
           if op["op"] in ("stablehlo.gather", "stablehlo.scatter")}
    gather, scatter = ops["stablehlo.gather"], ops["stablehlo.scatter"]
    # The lookup reads the table split on its rows and sums the partial rows.
    assert gather["strategy"].startswith("[-, -, -] + all-reduce(x,y) <- [(x, y), -]")
    # The gradient is scattered into the row-sharded table, nothing reduced.
    assert scatter["strategy"].startswith("[(x, y), -] <- [(x, y), -]")
    table = next(a for a in result.plan["arguments"] if a["name"] == "params.table")
    assert table["spec"] == [["x", "y"], []]

    got = hloplan.load(tmp_path / "plan")(*args)
    expected = jax.jit(embedding_step)(*args)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)

    # XLA partitions it so: the lookup's rows all-reduced, the table never all-gathered.
    text = hloplan.load(tmp_path / "plan").lower(*args).compile().as_text()
    gathers = re.findall(r"= (\S+) all-gather(?:-start)?\(", text)
    assert not any(f"[{VOCAB}," in shape for shape in gathers)
    reduces = re.findall(r"= (\S+) all-reduce(?:-start)?\(", text)
    assert any(f"[{BATCH},{SEQ},{WIDTH}]" in shape or f"[{BATCH * SEQ},{WIDTH}]" in shape
               for shape in reduces), reduces
