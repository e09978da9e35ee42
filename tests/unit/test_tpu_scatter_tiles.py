"""Reduce-scatters as libtpu compiles them (its all-reduce-scatter kernel scatters the (8, 128)
tiles of the partial sums' layout): the device model's `[collectives] scatter-tiles`, the bytes
CommModel.tiled_scatter gives, the strategies that list and price them, and libtpu itself where
it is installed."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hloplan.cost_models import CommModel, DeviceModelError, load_device_model
from hloplan.cost_models.hardware import _load_text
from hloplan.graph import TensorType
from hloplan.mesh import parse_mesh
from hloplan.op_rules import Factor, OpRule
from hloplan.strategies import enumerate_strategies
from hloplan.tpu import libtpu_available

needs_libtpu = pytest.mark.skipif(not libtpu_available(),
                                  reason="libtpu is not installed (pip install '.[tpu]')")

# Reduce-scattered matmuls on v5e:2x4 (mesh x=2, y=4), f32: the einsum, its operands' shapes and
# layouts and the result's, and what libtpu 0.0.42 compiled: (reduce-scatter bytes sent per
# device, collective-permute bytes) as hlo_stats counts them. Each is a row of the
# tiled_scatter table below too (the result's shard, the scattered dim, n, the partial sums'
# bytes and the permute's).
X, Y = "x", "y"
PROBES = [
    # 1,026 rows over x (hf_bart's position embeddings): 513 a shard, padded to 520, 7 permuted
    ("br,bc->rc", (256, 1026), (256, 1024), (X, None), (X, Y), (X, Y), (532480, 7168)),
    # over y (n = 4): 258 rows a shard, padded to 264; the last device lacks 3 x 6 rows
    ("br,bc->rc", (256, 1032), (256, 1024), (Y, None), (Y, X), (Y, X), (1622016, 36864)),
    ("br,bc->rc", (256, 44), (256, 1024), (Y, None), (Y, X), (Y, X), (98304, 30720)),
    # too much padding: an all-reduce and a slice, the partial sums' own bytes
    ("br,bc->rc", (256, 40), (256, 1024), (Y, None), (Y, X), (Y, X), (61440, 0)),
    ("br,bc->rc", (256, 6), (256, 1024), (X, None), (X, Y), (X, Y), (3072, 0)),
    # [1026, 192] is kept rows-minor (it pads least so): its own bytes
    ("br,bc->rc", (256, 1026), (256, 768), (X, None), (X, Y), (X, Y), (393984, 0)),
    # a major dim scattered: the buffer's tiles; [16, 20, 100] as [16, 24, 100], and a
    # matmul's [16, 128, 192] kept 128 minor (no padding; a gather's is row-major, below)
    ("bsr,bsc->src", (64, 16, 128), (64, 16, 768), (X, None, None), (X, None, Y),
     (X, None, Y), (786432, 0)),
    ("bsr,bsc->src", (64, 16, 20), (64, 16, 400), (X, None, None), (X, None, Y),
     (X, None, Y), (76800, 0)),
]
# (shard, dim, n, row_major) -> (partial sums' bytes, collective-permute bytes), f32
TILED = [
    ((513, 256), 0, 2, False, (1064960, 7168)),
    ((258, 512), 0, 4, False, (2162688, 36864)),
    ((11, 512), 0, 4, False, (131072, 30720)),
    ((10, 512), 0, 4, False, (81920, 0)),
    ((3, 256), 0, 2, False, (6144, 0)),
    ((513, 192), 0, 2, False, (787968, 0)),
    ((8, 128, 192), 0, 2, False, (1572864, 0)),  # kept 128 minor: pads nothing
    ((8, 128, 192), 0, 2, True, (2097152, 0)),  # a gather's (hf_bert's lookup): 192 to 256
    ((8, 20, 100), 0, 2, False, (153600, 0)),
    ((8, 5, 256), 0, 2, False, (81920, 0)),  # rows shorter than a tile stay as they are
    ((513, 192), 0, 2, True, (798720, 5376)),  # a scatter's: row-major
    ((8, 511, 1), 0, 8, True, (130816, 0)),  # size-1 dims take no tile: [64, 511]
]


def test_scatter_tiles_table():
    for name in ("tpu-v5e", "tpu-v6e", "tpu-v5p"):
        assert load_device_model(name).scatter_tiles == (8, 128)
    for name in ("cpu", "h100"):
        assert load_device_model(name).scatter_tiles is None
    text = ('name = "t"\nplatform = "tpu"\nmemory = "1GiB"\nhbm_bandwidth = 1e10\n[flops]\n'
            'default = 1e9\n[[interconnect]]\nname = "ici"\ndevices = 0\nbandwidth = 1e10\n'
            'latency = 1e-6\n[collectives]\n')
    assert _load_text(text + "scatter_tiles = [16, 128]\n", "ok.toml").scatter_tiles == (16, 128)
    for bad in ("[8]", "[8, 0]", '"8x128"', "[8.0, 128]"):
        with pytest.raises(DeviceModelError, match="must be two positive integers"):
            _load_text(text + f"scatter-tiles = {bad}\n", "bad.toml")


@pytest.mark.parametrize("shard, dim, n, row_major, expected", TILED)
def test_tiled_scatter(shard, dim, n, row_major, expected):
    tpu = CommModel(load_device_model("tpu-v5e"), parse_mesh("x=2,y=4"))
    assert tpu.tiled_scatter(shard, 4, dim, n, row_major) == pytest.approx(expected)
    # Other platforms move the partial sums' own bytes.
    cpu = CommModel(load_device_model("cpu"), parse_mesh("x=2,y=4"))
    own = 4 * n
    for size in shard:
        own *= size
    assert cpu.tiled_scatter(shard, 4, dim, n, row_major) == (own, 0.0)


def _gradient(comm, rows=1026, width=1024, tokens=4096):
    """dE[r, c] = G[t, r]^T H[t, c]: hf_bart's position-embedding gradient as a matmul."""
    rule = OpRule(factors=(Factor(tokens, "reduce"), Factor(rows), Factor(width)),
                  operands=(((0,), (1,)), ((0,), (2,))), results=(((1,), (2,)),),
                  flops=2.0 * tokens * rows * width, matmul=(((1,), 1), ((0,), 1), ((2,), 1)))
    strategies = enumerate_strategies(rule, [TensorType((tokens, rows), "f32"),
                                             TensorType((tokens, width), "f32")],
                                      [TensorType((rows, width), "f32")], comm.mesh, comm)
    return {(s.results, s.reduced_axes): s for s in strategies}


def test_padded_scatter_is_listed_and_priced():
    mesh = parse_mesh("x=2,y=4")
    v5e = load_device_model("tpu-v5e")
    # The contraction over x, the width over y, reduce-scattered over x onto the rows.
    key = ((((0,), (1,)),), (0,))
    tpu = _gradient(CommModel(v5e, mesh))[key]
    assert [(kind, axes) for kind, axes, _ in tpu.collectives] == [
        ("reduce-scatter", "x"), ("collective-permute", "x")]
    assert [sent for _, _, sent in tpu.collectives] == pytest.approx([1040 * 256 * 4 / 2,
                                                                      7 * 256 * 4])
    cpu = _gradient(CommModel(load_device_model("cpu"), mesh))[key]
    assert [(kind, sent) for kind, _, sent in cpu.collectives] == [
        ("reduce-scatter", pytest.approx(1026 * 256 * 4 / 2))]
    # The padding and the permute cost time: more than the same model without the tiles.
    from dataclasses import replace

    untiled = _gradient(CommModel(replace(v5e, scatter_tiles=None), mesh))[key]
    assert tpu.communication > untiled.communication
    # Whole tiles: nothing added.
    even = _gradient(CommModel(v5e, mesh), rows=1040)[key]
    assert [kind for kind, _, _ in even.collectives] == ["reduce-scatter"]


_LIBTPU_PROBES = """
import json, sys
import numpy as np, jax, jax.numpy as jnp
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P
from hloplan.hlo_stats import collective_stats
from hloplan.tpu import parse_topology, topology_devices
devices = topology_devices(parse_topology("v5e:2x4"))
mesh = Mesh(np.array(devices).reshape(2, 4), ("x", "y"), axis_types=(AxisType.Auto,) * 2)
def sp(spec):
    return NamedSharding(mesh, P(*spec))
out = []
for eq, a, b, sa, sb, so in json.loads(sys.argv[1]):
    f = jax.jit(lambda u, v: jnp.einsum(eq, u, v), in_shardings=(sp(sa), sp(sb)),
                out_shardings=sp(so))
    text = f.lower(jax.ShapeDtypeStruct(a, jnp.float32),
                   jax.ShapeDtypeStruct(b, jnp.float32)).compile().as_text()
    stats = collective_stats(text, mesh_axes=[("x", 2), ("y", 4)])
    sent = {}
    for op in stats.ops:
        sent[op.kind] = sent.get(op.kind, 0) + op.total_bytes_sent
    out.append([sent.get("reduce-scatter", 0), sent.get("collective-permute", 0)])
print(json.dumps(out))
"""


@needs_libtpu
def test_tiled_scatters_as_libtpu_compiles_them():
    from hloplan.tpu import child_env

    cases = [probe[:6] for probe in PROBES]
    done = subprocess.run([sys.executable, "-c", _LIBTPU_PROBES, json.dumps(cases)],
                          env=child_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    compiled = json.loads(done.stdout.strip().splitlines()[-1])
    comm = CommModel(load_device_model("tpu-v5e"), parse_mesh("x=2,y=4"))
    for probe, (scattered, permuted) in zip(PROBES, compiled, strict=True):
        eq, a, b, _, sb, so, expected = probe
        assert (scattered, permuted) == pytest.approx(expected), probe
        # The model's: the result's shard, scattered over x (n = 2) or y (n = 4) onto the dim
        # the contraction's axis lands on.
        axis = sb[0]
        n = 2 if axis == X else 4
        dim = so.index(axis)
        out = eq.split("->")[1]
        sizes = {**dict(zip(eq.split("->")[0].split(",")[0], a)),
                 **dict(zip(eq.split("->")[0].split(",")[1], b))}
        shard = [sizes[c] // ((2 if so[k] == X else 4) if so[k] else 1)
                 for k, c in enumerate(out)]
        partial, permute = comm.tiled_scatter(shard, 4, dim, n)
        assert (partial * (n - 1) / n, permute) == pytest.approx((scattered, permuted)), probe
