"""Two dims that exchange their mesh axes ([x, y] -> [y, x]): XLA's partitioner exchanges parts
of each shard among size(larger) / size(smaller) devices of the larger axis, then permutes the
shards into place (CommModel._exchange); checked on XLA's CPU compiler in test_hlo_stats.py and
against libtpu on v5e:4x8 and 4x4 here where it is installed."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hloplan.cost_models import CommModel, load_device_model
from hloplan.mesh import parse_mesh

SHAPE = (16384, 2048)  # f32
CASES = [("v5e:4x8", ((0,), (1,)), ((1,), (0,))),
         ("v5e:4x8", ((1,), (0,)), ((0,), (1,))),
         ("v5e:4x4", ((0,), (1,)), ((1,), (0,)))]


def _predicted(topology: str, src, dst) -> list:
    x, y = (int(s) for s in topology.split(":")[1].split("x"))
    comm = CommModel(load_device_model("tpu-v5e"), parse_mesh(f"x={x},y={y}"))
    return [(kind, "".join("xy"[a] for a in axes), sent)
            for kind, axes, sent in comm.reshard(SHAPE, 4, src, dst).collectives]


def test_exchange_on_4x8_and_4x4():
    shard = SHAPE[0] * SHAPE[1] * 4 / 32
    # 4x8: pairs of y (8 / 4) exchange halves, then the shards are permuted over both axes.
    for src, dst in (CASES[0][1:], CASES[1][1:]):
        assert _predicted("v5e:4x8", src, dst) == [("all-to-all", "y", shard / 2),
                                                   ("collective-permute", "xy", shard)]
    # 4x4: the axes are the same size; the shards only move.
    assert _predicted(*CASES[2]) == [("collective-permute", "xy", shard * 2)]
    # Another change of the two dims is not an exchange.
    assert [k for k, _, _ in _predicted("v5e:4x8", ((0,), (1,)), ((1,), ()))] != [
        "all-to-all", "collective-permute"]


_LIBTPU_EXCHANGES = r"""
import json, sys
import jax, numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec
from hloplan.hlo_stats import collective_stats
from hloplan.tpu import parse_topology, topology_devices
out = []
for topology, src, dst in json.loads(sys.argv[1]):
    shape = tuple(int(s) for s in topology.split(":")[1].split("x"))
    mesh = Mesh(np.array(topology_devices(parse_topology(topology))).reshape(shape),
                ("x", "y"), axis_types=(AxisType.Auto,) * 2)
    def spec(layout):
        return NamedSharding(mesh, PartitionSpec(*(tuple("xy"[a] for a in axes) or None
                                                   for axes in layout)))
    compiled = jax.jit(lambda w: jax.lax.with_sharding_constraint(w, spec(dst)) + 1,
                       in_shardings=spec(src)).lower(
        jax.ShapeDtypeStruct((16384, 2048), np.float32)).compile()
    stats = collective_stats(compiled.as_text(), mesh_axes=list(zip(("x", "y"), shape)))
    out.append([[op.kind, "".join(sorted(op.axes)), op.total_bytes_sent] for op in stats.ops])
print(json.dumps(out))
"""


@pytest.mark.libtpu
def test_exchange_as_libtpu_compiles_it():
    from hloplan.tpu import child_env

    done = subprocess.run([sys.executable, "-c", _LIBTPU_EXCHANGES, json.dumps(CASES)],
                          env=child_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    for case, ops in zip(CASES, json.loads(done.stdout.strip().splitlines()[-1]), strict=True):
        assert _predicted(*case) == [(kind, axes, pytest.approx(sent))
                                     for kind, axes, sent in ops]
