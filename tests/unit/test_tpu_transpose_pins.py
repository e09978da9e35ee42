"""propagate-sharding on TPU device models pins a transposed weight gradient after its
transpose, not between the matmul and the transpose: compiled by libtpu for v5e:2x4
(deviceless, on CPU), the optimizer update then runs in the weight's own layout, with no
copies of the weight and its moments into the transposed layout and back."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# The same plan emitted twice: as propagate-sharding pins it, and with the matmul's result
# pinned (the transpose left to propagation); the f32 copies libtpu compiles into each.
_LIBTPU_COPIES = """
import json, re, sys, tempfile
from pathlib import Path
import jax, jax.numpy as jnp
from jax import export
from hloplan.compiler import compile_bytes, make_options
from hloplan.emit.loader import load
from hloplan.passes.propagate_sharding import PropagateSharding
from hloplan.tpu import parse_topology, topology_devices

D, F, T = 512, 2048, 4096

def step(w, m, v, x, dy):
    g = jnp.einsum("tf,td->fd", dy, x).T  # made as [F, D], the weight is [D, F]
    m = m + (g - m) * 0.1
    v = v + (g * g - v) * 0.001
    return w - 0.01 * m / (jnp.sqrt(v) + 1e-7), m, v

S = jax.ShapeDtypeStruct
args = [S((D, F), jnp.float32)] * 3 + [S((T, D), jnp.float32), S((T, F), jnp.float32)]
data = bytes(export.export(jax.jit(step, donate_argnums=(0, 1, 2)),
                           platforms=("tpu",))(*args).serialize())
devices = topology_devices(parse_topology("v5e:2x4"))
counts = []
for pinned_before in (False, True):
    if pinned_before:
        PropagateSharding._only_transposed = lambda *args: None
    result = compile_bytes(data, "step.jaxexport",
                           make_options("2x4", device="tpu-v5e", mesh_views="off"))
    with tempfile.TemporaryDirectory() as tmp:
        result.write(Path(tmp) / "plan")
        text = load(Path(tmp) / "plan", devices=devices).compile_abstract().as_text()
    counts.append([result.plan["arguments"][0]["spec"],
                   len(re.findall(r"= f32\\[\\d+,\\d+\\]\\{[^}]*\\} copy\\(", text))])
print(json.dumps(counts))
"""


@pytest.mark.libtpu
def test_a_transposed_weight_gradient_is_pinned_after_its_transpose():
    from hloplan.tpu import child_env

    done = subprocess.run([sys.executable, "-c", _LIBTPU_COPIES], env=child_env(),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    (spec, copies), (spec_before, copies_before) = json.loads(done.stdout.strip().splitlines()[-1])
    assert spec == spec_before  # the same plan
    assert copies == 0
    # the weight and both moments copied into the transposed layout and the three results back
    assert copies_before == 6
