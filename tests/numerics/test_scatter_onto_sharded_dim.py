"""A tied embedding whose vocabulary (8,191 rows) no mesh axis divides, planned for tpu-v5e on
2x4 and run on 8 simulated CPU devices: the table can be split on its width only, and the
output head's weight gradient, its width already split over one axis, is reduce-scattered
over the other onto that same dim (a [-, x] result reduce-scattered over y is [-, (x, y)],
strategies._scatter_variants), as libtpu compiles hf_gpt2's tied-embedding gradient. The
sharded step equals the single-device one."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import hloplan

pytestmark = pytest.mark.usefixtures("devices8")

VOCAB, WIDTH, BATCH, SEQ = 8191, 512, 16, 128


def _loss(params, ids, targets):
    h = jnp.tanh(params["table"][ids] @ params["w"])
    logits = h @ params["table"].T
    picked = jnp.take_along_axis(logits, targets[..., None], -1)[..., 0]
    return jnp.mean(jax.nn.logsumexp(logits, -1) - picked)


def tied_step(params, ids, targets):
    loss, grads = jax.value_and_grad(_loss)(params, ids, targets)
    return loss, jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)


def _args():
    keys = jax.random.split(jax.random.key(0), 4)
    params = {"table": 0.02 * jax.random.normal(keys[0], (VOCAB, WIDTH)),
              "w": jax.random.normal(keys[1], (WIDTH, WIDTH)) / WIDTH**0.5}
    ids = jax.random.randint(keys[2], (BATCH, SEQ), 0, VOCAB)
    targets = jax.random.randint(keys[3], (BATCH, SEQ), 0, VOCAB)
    return params, ids, targets


def _scattered_onto_sharded_dim(strategy: str) -> bool:
    """A strategy '[..] + reduce-scatter(A) <- ..' whose result has a dim split over the
    reduced axes A and another axis besides."""
    match = re.match(r"\[(.*)\] \+ reduce-scatter\(([^)]*)\)", strategy)
    if not match:
        return False
    reduced = set(match.group(2).split(","))
    dims = re.findall(r"\(([^)]*)\)|([^,\s]+)", match.group(1))
    for grouped, single in dims:
        axes = set(a.strip() for a in (grouped or single).split(",")) - {"-"}
        if reduced < axes:
            return True
    return False


def test_reduce_scatter_onto_a_sharded_dim(tmp_path):
    args = _args()
    path = tmp_path / "step.jaxexport"
    path.write_bytes(export.export(jax.jit(tied_step), platforms=("cpu", "tpu"))(*args)
                     .serialize())
    result = hloplan.compile(path, "2x4", output=tmp_path / "plan", device="tpu-v5e")
    table = next(a for a in result.plan["arguments"] if a["name"] == "params.table")
    assert table["spec"][0] == []  # 8,191 rows: split on the width only
    dots = [op["strategy"] for op in result.plan["ops"] if op["op"] == "stablehlo.dot_general"]
    assert any(_scattered_onto_sharded_dim(s) for s in dots), dots

    got = hloplan.load(tmp_path / "plan")(*args)
    expected = jax.jit(tied_step)(*args)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


def test_strategy_text_check():
    assert _scattered_onto_sharded_dim("[-, (x, y)] + reduce-scatter(y) <- [y, -, -] [y, -, x]")
    assert _scattered_onto_sharded_dim("[-, (y, x)] + reduce-scatter(x) <- [x, -, -] [x, -, y]")
    assert not _scattered_onto_sharded_dim("[y, x] + reduce-scatter(x) <- [x, -, y] [x, -, -]")
    assert not _scattered_onto_sharded_dim("[-, y] + all-reduce(x) <- [x, -, -] [x, -, y]")
