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
    # Over 8 (v5e:4x8, below): the permutes reach back past the next device (20 rows padded
    # to 24: 7 x 4 rows, 24 + 4); a minor dim of an odd number of whole lane tiles pads the
    # rows to 16 (24 to 32 on 128 lanes; 6 over 4 stays unpadded, 16 being too many)
    ((20, 1024), 0, 8, False, (786432, 114688)),
    ((24, 128), 0, 8, False, (131072, 28672)),
    ((11, 128), 0, 8, False, (65536, 17920)),
    ((20, 128), 0, 8, False, (81920, 0)),
    ((6, 128), 0, 4, False, (12288, 0)),
    ((24, 384), 0, 8, False, (393216, 86016)),
    # partial lane tiles: whole row tiles (hf_bert's [30522, 192] head gradient, unpadded)
    ((30522, 24), 1, 8, False, (23440896, 0)),
    # Pieces of at most 1071 x n^-0.635 tiles (the scatter-adds of CHUNKED below): 64 lanes
    # count as one lane tile, odd, so [2000, 64] over 16 (250 row tiles) takes 2 x 2 pieces
    # and pads to 2,016 rows (the corpus's embedding gradients on v5e:16x16); two lane tiles
    # of 256 row tiles over 16, 3 pieces: 2,064 rows; 241 row tiles over 32: 6 pieces
    ((2000, 64), 0, 16, True, (16 * 2016 * 256, 15 * 16 * 256)),
    ((2048, 256), 0, 16, True, (16 * 2064 * 1024, 15 * 16 * 1024)),
    ((1928, 128), 0, 32, True, (32 * 1968 * 512, 31 * 40 * 512)),
    # over 4, 500 row tiles of one lane tile fit 2 pieces of 444; of two, 3 pieces
    ((4000, 128), 0, 4, True, (4 * 4000 * 512, 0)),
    ((4000, 256), 0, 4, True, (4 * 4008 * 1024, 3 * 8 * 1024)),
    # over 256 devices (v5e:16x16's both axes) no shard is padded
    ((136, 128), 0, 256, True, (256 * 136 * 512, 0)),
    # rows of more than 3 lane tiles: a pair of pieces (127 tiles, 24 rows over 8: 32 rows,
    # reduce-scattered matmuls on v5e:4x8); hf_gpt2's head gradient, 393 tiles, 96 rows over
    # 2, whole pairs: unpadded (tests/unit/test_scatter_variants.py)
    ((24, 127 * 128), 0, 8, False, (8 * 32 * 127 * 512, 7 * 8 * 127 * 512)),
    ((96, 50257), 0, 2, False, (2 * 96 * 50257 * 4, 0)),
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
    chunk = "{tiles = 1071, exponent = 0.635, max-devices = 32, max-lane-tiles = 3}"
    read = _load_text(text + f"scatter-chunk = {chunk}\n", "ok.toml").scatter_chunk
    assert (read.tiles(16), read.max_devices, read.max_lane_tiles) == (
        pytest.approx(184.15, abs=0.01), 32, 3)
    assert load_device_model("tpu-v5e").scatter_chunk == read
    assert load_device_model("tpu-v6e").scatter_chunk is None
    for bad, message in (("{tiles = 1071}", "must be a table of"),
                         (chunk.replace("32", "1"), "max-devices' must be an integer"),
                         (chunk.replace("1071", "-1"), "must be positive")):
        with pytest.raises(DeviceModelError, match=message):
            _load_text(text + f"scatter-chunk = {bad}\n", "bad.toml")


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
x, y = json.loads(sys.argv[2])
devices = topology_devices(parse_topology(f"v5e:{x}x{y}"))
mesh = Mesh(np.array(devices).reshape(x, y), ("x", "y"), axis_types=(AxisType.Auto,) * 2)
def sp(spec):
    return NamedSharding(mesh, P(*[tuple(a) if isinstance(a, list) else a for a in spec]))
out = []
for eq, a, b, sa, sb, so in json.loads(sys.argv[1]):
    f = jax.jit(lambda u, v: jnp.einsum(eq, u, v), in_shardings=(sp(sa), sp(sb)),
                out_shardings=sp(so))
    text = f.lower(jax.ShapeDtypeStruct(a, jnp.float32),
                   jax.ShapeDtypeStruct(b, jnp.float32)).compile().as_text()
    stats = collective_stats(text, mesh_axes=[("x", x), ("y", y)])
    sent = {}
    for op in stats.ops:
        sent[op.kind] = sent.get(op.kind, 0) + op.total_bytes_sent
    out.append([sent.get("reduce-scatter", 0), sent.get("collective-permute", 0)])
print(json.dumps(out))
"""


@pytest.mark.libtpu
def test_tiled_scatters_as_libtpu_compiles_them():
    from hloplan.tpu import child_env

    cases = [probe[:6] for probe in PROBES]
    done = subprocess.run([sys.executable, "-c", _LIBTPU_PROBES, json.dumps(cases), "[2, 4]"],
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


# Reduce-scattered matmuls on v5e:4x8 (x=4, y=8), f32, as above, with the model's arguments:
# (the result's shard, the scattered dim, n).
PROBES_4X8 = [
    # hf_bert's output-head weight gradient: [30522, 192] partial sums kept 30,522 minor, 24
    # columns a device, unpadded
    ("tv,td->vd", (1024, 30522), (1024, 768), (Y, None), (Y, X), (None, (X, Y)),
     (20510784, 0), ((30522, 24), 1, 8)),
    # 20 rows over 8 on 256 lanes: padded to 24, permutes of 24 and 4 rows
    ("br,bc->rc", (256, 160), (256, 1024), (Y, None), (Y, X), (Y, X), (172032, 28672),
     ((20, 256), 0, 8)),
    # on 128 lanes (one tile): whole pairs of row tiles, 24 rows padded to 32; 20 rows not
    ("br,bc->rc", (256, 192), (256, 512), (Y, None), (Y, X), (Y, X), (114688, 28672),
     ((24, 128), 0, 8)),
    ("br,bc->rc", (256, 160), (256, 512), (Y, None), (Y, X), (Y, X), (71680, 0),
     ((20, 128), 0, 8)),
    ("br,bc->rc", (256, 24), (256, 1024), (X, None), (X, Y), (X, Y), (9216, 0),
     ((6, 128), 0, 4)),
]


@pytest.mark.libtpu
def test_tiled_scatters_over_8_as_libtpu_compiles_them():
    from hloplan.tpu import child_env

    cases = [probe[:6] for probe in PROBES_4X8]
    done = subprocess.run([sys.executable, "-c", _LIBTPU_PROBES, json.dumps(cases), "[4, 8]"],
                          env=child_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    compiled = json.loads(done.stdout.strip().splitlines()[-1])
    comm = CommModel(load_device_model("tpu-v5e"), parse_mesh("x=4,y=8"))
    for probe, sent in zip(PROBES_4X8, compiled, strict=True):
        expected, (shard, dim, n) = probe[6], probe[7]
        assert tuple(sent) == pytest.approx(expected), probe
        partial, permute = comm.tiled_scatter(shard, 4, dim, n)
        assert (partial * (n - 1) / n, permute) == pytest.approx(expected), probe


def _scatter_add(comm, rows, tokens=(8192,), width=768):
    """table[ids] += updates: an embedding gradient as op_rules reads a scatter-add (the
    tokens, of one dim or of two, summed, the width passed through, the rows indexed)."""
    count = 8192
    summed = tuple(range(2, 2 + len(tokens)))
    rule = OpRule(factors=(Factor(rows), Factor(width), *(Factor(t, "reduce") for t in tokens)),
                  operands=(((0,), (1,)), (*((f,) for f in summed), ()),
                            (*((f,) for f in summed), (1,))),
                  results=(((0,), (1,)),), flops=float(count * width), indexed="scatter")
    types = [TensorType((rows, width), "f32"), TensorType((*tokens, 1), "i32"),
             TensorType((*tokens, width), "f32")]
    strategies = enumerate_strategies(rule, types, [TensorType((rows, width), "f32")],
                                      comm.mesh, comm)
    return {(s.results, s.operands[1:], s.reduced_axes): s for s in strategies}


# The tokens split over (x, y), the result's width over (x, y): passed through (all-to-all of
# the updates, all-gather of the ids) from 256 rows, reduce-scattered below (v5e:4x8).
_PASSED = ((((), (0, 1)),), (((0, 1), ()), ((0, 1), ())), (0, 1))


@pytest.mark.parametrize("rows, expected", [
    (1024, [("all-to-all", "x,y", 761856), ("all-gather", "x,y", 31744)]),
    (256, [("all-to-all", "x,y", 761856), ("all-gather", "x,y", 31744)]),
    (250, [("reduce-scatter", "x,y", 744000)]),
])
def test_scatter_passes_its_updates(rows, expected):
    comm = CommModel(load_device_model("tpu-v5e"), parse_mesh("x=4,y=8"))
    strategy = _scatter_add(comm, rows)[_PASSED]
    assert [(kind, axes, pytest.approx(sent)) for kind, axes, sent in strategy.collectives] \
        == expected
    if expected[0][0] == "all-to-all":
        assert "all-to-all(x,y)" in strategy.name and strategy.transient == 786432 + 32768


# The ids split over two dims, [y, x, -]: reduce-scattered (v5e:4x8, 1,024 rows).
_TWO_DIMS = ((((), (0, 1)),), (((1,), (0,), ()), ((1,), (0,), ())), (0, 1))


def test_scatter_onto_a_replicated_axis_is_reduced():
    # Tokens over y, the result [-, y]: x unused, the partitioner splits the ids over it.
    comm = CommModel(load_device_model("tpu-v5e"), parse_mesh("x=4,y=8"))
    key = ((((), (1,)),), (((1,), ()), ((1,), ())), (1,))
    strategy = _scatter_add(comm, 1024)[key]
    assert [kind for kind, _, _ in strategy.collectives] == ["reduce-scatter"]


def test_scatter_of_ids_split_twice_is_reduced():
    comm = CommModel(load_device_model("tpu-v5e"), parse_mesh("x=4,y=8"))
    strategy = _scatter_add(comm, 1024, tokens=(64, 128))[_TWO_DIMS]
    assert [(kind, axes, pytest.approx(sent)) for kind, axes, sent in strategy.collectives] \
        == [("reduce-scatter", "x,y", 3047424)]


_LIBTPU_SCATTERS = """
import json, sys
import numpy as np, jax, jax.numpy as jnp
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P
from hloplan.hlo_stats import collective_stats
from hloplan.tpu import parse_topology, topology_devices
devices = topology_devices(parse_topology("v5e:4x8"))
mesh = Mesh(np.array(devices).reshape(4, 8), ("x", "y"), axis_types=(AxisType.Auto,) * 2)
out = []
for rows, tokens in json.loads(sys.argv[1]):
    split = [("x", "y")] if len(tokens) == 1 else ["y", "x"]
    f = jax.jit(lambda ids, upd: jnp.zeros((rows, 768), jnp.float32).at[ids[..., 0]].add(upd),
                in_shardings=(NamedSharding(mesh, P(*split)), NamedSharding(mesh, P(*split))),
                out_shardings=NamedSharding(mesh, P(None, ("x", "y"))))
    text = f.lower(jax.ShapeDtypeStruct((*tokens, 1), jnp.int32),
                   jax.ShapeDtypeStruct((*tokens, 768), jnp.float32)).compile().as_text()
    stats = collective_stats(text, mesh_axes=[("x", 4), ("y", 8)])
    sent = {}
    for op in stats.ops:
        key = op.kind + "(" + ",".join(op.axes) + ")"
        sent[key] = sent.get(key, 0) + op.total_bytes_sent
    out.append(sent)
print(json.dumps(out))
"""


@pytest.mark.libtpu
def test_scatters_pass_updates_as_libtpu_compiles_them():
    from hloplan.tpu import child_env

    cases = [(1024, (8192,)), (256, (8192,)), (250, (8192,)), (1024, (64, 128))]
    done = subprocess.run([sys.executable, "-c", _LIBTPU_SCATTERS, json.dumps(cases)],
                          env=child_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    compiled = json.loads(done.stdout.strip().splitlines()[-1])
    comm = CommModel(load_device_model("tpu-v5e"), parse_mesh("x=4,y=8"))
    for (rows, tokens), sent in zip(cases, compiled, strict=True):
        key = _PASSED if len(tokens) == 1 else _TWO_DIMS
        strategy = _scatter_add(comm, rows, tokens)[key]
        predicted = {f"{kind}({axes})": nbytes for kind, axes, nbytes in strategy.collectives}
        # hlo_stats names the axes of a group over both in the mesh's order or the ids'
        sent = {key.replace("(y,x)", "(x,y)"): nbytes for key, nbytes in sent.items()}
        assert sent == pytest.approx(predicted), (rows, tokens)


# Scatter-adds reduce-scattered onto their rows (f32), as libtpu 0.0.42 compiles them: the
# topology, the mesh (x, y), the axes the ids, the updates' rows and the result's rows are
# split over, the table's shape, and the model's (shard, n).
CHUNKED = [
    ("v5e:16x16", (16, 16), ("x",), (32000, 1024), ((2000, 64), 16)),
    ("v5e:16x16", (16, 16), ("x",), (32768, 4096), ((2048, 256), 16)),
    ("v5e:16x16", (16, 16), ("x",), (16000, 2048), ((1000, 128), 16)),
    ("v5e:4x8", (4, 8), ("x",), (16000, 2048), ((4000, 256), 4)),
    ("v5e:4x8", (4, 8), ("x", "y"), (61696, 128), ((1928, 128), 32)),
    ("v5e:16x16", (16, 16), ("x", "y"), (34816, 128), ((136, 128), 256)),
]

_LIBTPU_CHUNKED = """
import json, sys
import numpy as np, jax, jax.numpy as jnp
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P
from hloplan.hlo_stats import collective_stats
from hloplan.tpu import parse_topology, topology_devices
out = []
for topology, (x, y), axes, (rows, width) in json.loads(sys.argv[1]):
    devices = topology_devices(parse_topology(topology))
    mesh = Mesh(np.array(devices).reshape(x, y), ("x", "y"), axis_types=(AxisType.Auto,) * 2)
    split = tuple(axes)
    cols = None if len(axes) == 2 else "y"
    f = jax.jit(lambda ids, upd: jnp.zeros((rows, width), jnp.float32).at[ids].add(upd),
                in_shardings=(NamedSharding(mesh, P(split)), NamedSharding(mesh, P(split, cols))),
                out_shardings=NamedSharding(mesh, P(split, cols)))
    text = f.lower(jax.ShapeDtypeStruct((262144,), jnp.int32),
                   jax.ShapeDtypeStruct((262144, width), jnp.float32)).compile().as_text()
    sent = {}
    for op in collective_stats(text, mesh_axes=[("x", x), ("y", y)]).ops:
        sent[op.kind] = sent.get(op.kind, 0) + op.total_bytes_sent
    out.append([sent.get("reduce-scatter", 0), sent.get("collective-permute", 0)])
print(json.dumps(out))
"""


@pytest.mark.libtpu
def test_padded_scatters_split_in_pieces_as_libtpu_compiles_them():
    from hloplan.tpu import child_env

    cases = [list(case[:4]) for case in CHUNKED]
    done = subprocess.run([sys.executable, "-c", _LIBTPU_CHUNKED, json.dumps(cases)],
                          env=child_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    compiled = json.loads(done.stdout.strip().splitlines()[-1])
    comm = CommModel(load_device_model("tpu-v5e"), parse_mesh("x=16,y=16"))
    for case, (scattered, permuted) in zip(CHUNKED, compiled, strict=True):
        shard, n = case[4]
        partial, permute = comm.tiled_scatter(shard, 4, 0, n, row_major=True)
        assert (partial * (n - 1) / n, permute) == pytest.approx((scattered, permuted)), case


# Vectors gathered to every device on v5e:4x4 (x=4, y=4), f32 unless marked: (shape, the dim's
# mesh axes, dtype) -> the collective libtpu 0.0.42 compiles. A vector whose shard is not a
# multiple of 128 elements is written into zeros and all-reduced; other gathers stay gathers.
VECTOR_GATHERS = [
    ((1024,), (X, Y), "float32", "all-reduce"),   # 64 a device
    ((3072,), (X, Y), "float32", "all-reduce"),   # 192
    ((640,), (X,), "float32", "all-reduce"),      # 160
    ((256,), (X,), "float32", "all-reduce"),      # 64
    ((1, 1024), (X, Y), "float32", "all-reduce"),  # dims of size 1 do not count
    ((1024,), (X, Y), "bfloat16", "all-reduce"),
    ((2048,), (X, Y), "float32", "all-gather"),   # 128
    ((512,), (X,), "float32", "all-gather"),      # 128
    ((1024,), (X,), "float32", "all-gather"),     # 256
    ((2048,), (X, Y), "bfloat16", "all-gather"),
    ((2, 1024), (X, Y), "float32", "all-gather"),  # not a vector
    ((128, 64), (X, Y), "float32", "all-gather"),
]


def _vector_gather_kind(comm, shape, axes):
    ids = tuple(comm.mesh.axis_names.index(a) for a in axes)
    src = tuple(ids if d == len(shape) - 1 else () for d in range(len(shape)))
    cost = comm.reshard(shape, 4, src, tuple(() for _ in shape))
    return [kind for kind, _, _ in cost.collectives]


def test_vector_gathers_with_partial_lane_shards_are_all_reduces():
    for name in ("tpu-v5e", "tpu-v6e", "tpu-v5p"):
        assert load_device_model(name).vector_gather_lanes == 128
    text = ('name = "t"\nplatform = "tpu"\nmemory = "1GiB"\nhbm_bandwidth = 1e10\n[flops]\n'
            'default = 1e9\n[[interconnect]]\nname = "ici"\ndevices = 0\nbandwidth = 1e10\n'
            'latency = 1e-6\n[collectives]\n')
    assert _load_text(text + "vector_gather_lanes = 256\n", "ok.toml").vector_gather_lanes == 256
    for bad in ("0", "128.0", "true", '"128"'):
        with pytest.raises(DeviceModelError, match="must be a positive integer"):
            _load_text(text + f"vector-gather-lanes = {bad}\n", "bad.toml")
    comm = CommModel(load_device_model("tpu-v5e"), parse_mesh("x=4,y=4"))
    for shape, axes, _, kind in VECTOR_GATHERS:
        assert _vector_gather_kind(comm, shape, axes) == [kind], (shape, axes)
    # the all-reduce moves the whole vector twice around the ring, as libtpu's does, and pays
    # a launch of the all-gather's n - 1 steps (not a share of a merged buffer)
    model = load_device_model("tpu-v5e")
    comm = CommModel(model, parse_mesh("x=4,y=4"), combine=model.combiner)  # as the planner's
    cost = comm.reshard((1024,), 4, ((0, 1),), ((),))
    (_, _, sent), = cost.collectives
    assert sent == pytest.approx(2 * 15 / 16 * 4096)
    group = comm.group((0, 1))
    assert cost.seconds == pytest.approx(
        sent / group.bandwidth + 15 * group.latency + comm.model.collective_overhead)
    assert comm.collective("all-reduce", 4096, (0, 1)) < cost.seconds / 10
    # a device model without the field gathers
    gpu = CommModel(load_device_model("h100"), parse_mesh("x=4,y=4"))
    assert _vector_gather_kind(gpu, (1024,), (X, Y)) == ["all-gather"]


_LIBTPU_VECTOR_GATHERS = r"""
import json, re, sys
import jax, jax.numpy as jnp
import numpy as np
from jax.experimental import topologies
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
topo = topologies.get_topology_desc(topology_name="v5e:4x4", platform="tpu")
mesh = Mesh(np.array(topo.devices).reshape(4, 4), ("x", "y"))
out = []
for shape, axes, dtype in json.loads(sys.argv[1]):
    spec = P(*([None] * (len(shape) - 1)), tuple(axes))
    f = jax.jit(lambda a: a * 2, in_shardings=NamedSharding(mesh, spec),
                out_shardings=NamedSharding(mesh, P()))
    text = f.lower(jax.ShapeDtypeStruct(tuple(shape), dtype)).compile().as_text()
    out.append(sorted(set(re.findall(
        r"= [^=]*? (all-gather|all-reduce|collective-permute|all-to-all)(?:-start)?\(", text))))
print(json.dumps(out))
"""


@pytest.mark.libtpu
def test_vector_gathers_as_libtpu_compiles_them():
    from hloplan.tpu import child_env

    cases = [[list(shape), list(axes), dtype] for shape, axes, dtype, _ in VECTOR_GATHERS]
    done = subprocess.run([sys.executable, "-c", _LIBTPU_VECTOR_GATHERS, json.dumps(cases)],
                          env=child_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    compiled = json.loads(done.stdout.strip().splitlines()[-1])
    for (shape, axes, dtype, kind), kinds in zip(VECTOR_GATHERS, compiled, strict=True):
        assert kinds == [kind], (shape, axes, dtype)
