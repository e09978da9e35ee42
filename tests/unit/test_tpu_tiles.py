"""Buffers in XLA's TPU tiled layouts (hloplan.tpu_buffers.tiled_elements, applied by
build-sharding-problem on device models with `[buffers] tiled_layouts = true`). The sizes are
libtpu's own (0.0.42, v5e: allocation sizes of its buffer assignment for these shapes);
planning runs on abstract shapes, no libtpu needed."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from jax import export

from hloplan.compiler import compile_bytes, make_options
from hloplan.cost_models import DeviceModelError, load_device_model
from hloplan.strategies import local_bytes
from hloplan.tpu_buffers import (
    gathers_rows,
    relaid_rows,
    scatter_updates_shape,
    tiled_elements,
)

S, F32 = jax.ShapeDtypeStruct, jnp.float32


@pytest.mark.parametrize(("shape", "itemsize", "nbytes"), [
    ((), 4, 512),                      # f32[]{:T(128)}
    ((5,), 4, 512),                    # f32[5]{0:T(128)}
    ((5,), 2, 512),                    # bf16[5]{0:T(256)(128)(2,1)}
    ((1000,), 4, 4096),                # f32[1000]{0:T(1024)}
    ((1000,), 1, 1024),                # s8 / pred[1000]{0:T(1024)(128)(4,1)}
    ((100000,), 4, 401408),
    ((3, 5), 4, 2048),                 # f32[3,5]{1,0:T(4,128)}
    ((3, 5), 2, 1024),                 # bf16[3,5]{1,0:T(4,128)(2,1)}
    ((3, 5), 1, 512),                  # s8[3,5]{1,0:T(4,128)(4,1)}
    ((1, 1000), 4, 4096),              # f32[1,1000]{1,0:T(1,128)}
    ((1000, 1), 4, 4096),              # f32[1000,1]{0,1:T(1,128)}: the long dim minor
    ((1000, 8), 4, 32768),             # f32[1000,8]{0,1:T(8,128)}
    ((65536, 8), 4, 2097152),
    ((4096, 300), 4, 4980736),         # f32[4096,300]{0,1:T(8,128)}: 300 rows padded to 304
    ((4096, 300), 2, 2490368),         # bf16: second-minor tile 8 as well
    ((4096, 300), 1, 1245184),         # s8 and pred: 8 too
    ((4096, 12), 2, 131072),
    ((4096, 20), 1, 98304),
    ((7, 3, 5), 4, 10240),             # f32[7,3,5]{0,1,2:T(4,128)}
    ((2, 7, 3, 5), 4, 15360),          # f32[2,7,3,5]{1,0,3,2:T(2,128)}
    ((64, 100, 6), 2, 98304),          # bf16[64,100,6]{1,0,2:T(8,128)(2,1)}
])
def test_tiled_bytes_are_libtpus_allocations(shape, itemsize, nbytes) -> None:
    assert tiled_elements(shape, itemsize) * itemsize == nbytes


def test_scatters_keep_the_programs_order_of_dims() -> None:
    """libtpu's scatter: `f32[32000,8]{1,0:T(8,128)}` result, updates read as
    `f32[65536,8]{1,0:T(8,128)}` (a 32 MiB copy of 2 MiB)."""
    assert tiled_elements((32000, 8), 4, row_major=True) * 4 == 16384000
    assert tiled_elements((32000, 8), 4) * 4 == 1024000
    assert scatter_updates_shape((64, 1024, 8), (2,)) == (65536, 8)
    assert tiled_elements((65536, 8), 4, row_major=True) * 4 == 33554432
    assert scatter_updates_shape((4, 6, 3, 8), (1, 3)) == (12, 6, 8)


def test_device_models() -> None:
    for name in ("tpu-v5e", "tpu-v5p", "tpu-v6e"):
        assert load_device_model(name).tiled_layouts
    for name in ("cpu", "h100"):
        assert not load_device_model(name).tiled_layouts


def test_bad_tiled_layouts(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    cpu_toml = Path(__file__).resolve().parents[2] / "cost_models" / "cpu.toml"
    text = cpu_toml.read_text().replace('name = "cpu"', 'name = "bad"')
    path.write_text(text + "\n[buffers]\ntiled_layouts = \"yes\"\n")
    with pytest.raises(DeviceModelError, match="'buffers.tiled_layouts' must be true or false"):
        load_device_model(path)


def _state(step, args, device: str, tiled: bool | None = None, mesh: str = "8"):
    data = export.export(jax.jit(step))(*args).serialize()
    options = make_options(mesh, device=device, mesh_views="off")
    if tiled is not None:
        options = dataclasses.replace(options, device=dataclasses.replace(
            options.device, tiled_layouts=tiled))
    return compile_bytes(data, "step.jaxexport", options).state


def _narrow(x):
    """A [4096, 5, 3] value: the minor dims 5 and 3 pad on TPU."""
    return jnp.tanh(x) * 2.0


def _strategy_bytes(state, op, row_major: bool = False) -> list[tuple[float, float]]:
    """(bytes of its results in TPU tiles, bytes unpadded) of each strategy of `op`."""
    mesh = state.options.mesh
    node = state.problem.nodes[state.space.node_of[op.index]]
    out = []
    for strategy, plain in zip(state.space.strategies[op.index], node.strategies, strict=True):
        tiled = 0.0
        for value, spec in zip(op.results, strategy.results):
            type_ = state.graph.type_of(value)
            shape = tuple(-(-size // _split(axes, mesh)) for size, axes in zip(type_.shape, spec))
            tiled += tiled_elements(shape, type_.itemsize, row_major) * type_.itemsize
        out.append((plain.memory, tiled,
                    sum(local_bytes(state.graph.type_of(v), s, mesh)
                        for v, s in zip(op.results, strategy.results))))
    return out


def _split(axes, mesh) -> int:
    count = 1
    for axis in axes:
        count *= mesh.axis_sizes[axis]
    return count


def test_tpu_buffers_are_held_in_tiles() -> None:
    """On tpu-v5e each strategy holds its results' tiled bytes (`[4096/k, 5, 3]`: 4096 minor,
    5 rows padded to 8); on cpu and h100 the bytes of the local shard, as before."""
    state = _state(_narrow, (S((4096, 5, 3), F32),), "tpu-v5e")
    tanh = next(op for op in state.graph.ops if op.name == "stablehlo.tanh")
    rows = _strategy_bytes(state, tanh)
    assert rows and all(memory == tiled for memory, tiled, _ in rows)
    assert any(tiled > plain for _, tiled, plain in rows)
    untiled = _state(_narrow, (S((4096, 5, 3), F32),), "tpu-v5e", tiled=False)
    tanh = next(op for op in untiled.graph.ops if op.name == "stablehlo.tanh")
    assert all(memory == plain for memory, _, plain in _strategy_bytes(untiled, tanh))
    for device in ("cpu", "h100"):
        state = _state(_narrow, (S((4096, 5, 3), F32),), device)
        for op in state.graph.ops:
            if op.index in state.space.node_of:
                assert all(memory == plain for memory, _, plain in _strategy_bytes(state, op))


def _embedding_grad(table, ids, h):
    """An embedding table's gradient: rows of `h` scattered into zeros by token id."""
    grad = jnp.zeros(table.shape, F32).at[ids].add(jnp.tanh(h) * 2.0)
    return table - 0.1 * grad


def test_scatters_hold_their_row_major_buffers_while_made() -> None:
    args = (S((1000, 8), F32), S((64, 128), jnp.int32), S((64, 128, 8), F32))
    state = _state(_embedding_grad, args, "tpu-v5e")
    scatter = next(op for op in state.graph.ops if op.name == "stablehlo.scatter")
    node = state.problem.nodes[state.space.node_of[scatter.index]]
    untiled = _state(_embedding_grad, args, "tpu-v5e", tiled=False)
    plain = untiled.problem.nodes[untiled.space.node_of[scatter.index]]
    replicated = [k for k, s in enumerate(state.space.strategies[scatter.index])
                  if not any(s.results[0]) and not any(s.operands[2])]
    assert replicated
    for k in replicated:
        # Kept: [1000, 8] with the 1000 rows minor (32 KiB); while made: the [1000, 8]
        # result with its 8 columns minor (500 KiB) and the [8192, 8] updates (4 MiB).
        assert node.strategies[k].memory == 32768
        assert node.strategies[k].transient == plain.strategies[k].transient + (
            1000 * 128 * 4 + 8192 * 128 * 4 - 32768)
    for device in ("cpu", "h100"):
        other = _state(_embedding_grad, args, device)
        op = next(op for op in other.graph.ops if op.name == "stablehlo.scatter")
        n = other.problem.nodes[other.space.node_of[op.index]]
        for strategy, s in zip(other.space.strategies[op.index], n.strategies, strict=True):
            assert s.memory == local_bytes(other.graph.type_of(op.results[0]),
                                           strategy.results[0], other.options.mesh)
            assert s.transient == strategy.transient


def test_gathers_copy_a_rows_minor_table_row_major() -> None:
    """libtpu keeps `f32[32768,8]` rows minor (`{0,1:T(8,128)}`) and its gather copies it into
    `{1,0:T(8,128)}`, the 8 columns padded to 128; `f32[32768,1024]` is kept row-major."""
    assert relaid_rows((32768, 8), 4) == 32768 * 128 * 4
    assert relaid_rows((32768, 1024), 4) == 0
    assert relaid_rows((128256, 16), 4) == 128256 * 128 * 4
    rows = {"collapsed": (0,), "start_index_map": (0,)}
    assert gathers_rows("stablehlo.gather", rows, 2)
    assert not gathers_rows("stablehlo.gather", {"collapsed": (1,), "start_index_map": (1,)}, 2)
    assert not gathers_rows("stablehlo.scatter", rows, 2)


def _lookup(table, ids):
    return jnp.take(table, ids, axis=0) * 2.0


def test_gathers_hold_the_row_major_copy_of_their_table() -> None:
    args = (S((4096, 512), F32), S((64, 128), jnp.int32))
    state = _state(_lookup, args, "tpu-v5e")
    gather = next(op for op in state.graph.ops if op.name == "stablehlo.gather")
    node_index = state.space.node_of[gather.index]
    node = state.problem.nodes[node_index]
    untiled = _state(_lookup, args, "tpu-v5e", tiled=False)
    plain = untiled.problem.nodes[untiled.space.node_of[gather.index]]
    split = [k for k, s in enumerate(state.space.strategies[gather.index])
             if s.operands[0][1] and not s.operands[0][0]]
    assert split
    for k in split:  # [4096, 64] kept rows minor: copied as [4096, 128] while it gathers
        assert node.strategies[k].transient == plain.strategies[k].transient + 4096 * 128 * 4
        assert node.strategies[k].compute_cost > plain.strategies[k].compute_cost
    # The table all-gathered whole from d-sharded [4096, 64] shards: copied row-major again.
    edges = [e for e in state.problem.edges if e.dst == node_index and e.relayout]
    assert len(edges) == 1
    edge = edges[0]
    src_specs = [s.results[0] for s in state.space.strategies[state.space.op_of[edge.src]]]
    dst_specs = [s.operands[0] for s in state.space.strategies[gather.index]]
    pairs = {(tuple(map(tuple, src_specs[i])), tuple(map(tuple, dst_specs[j])))
             for i, row in enumerate(edge.relayout) for j, copy in enumerate(row) if copy}
    assert pairs == {(((), (0,)), ((), ()))}
    i = next(i for i, s in enumerate(src_specs) if tuple(map(tuple, s)) == ((), (0,)))
    j = next(j for j, s in enumerate(dst_specs) if not any(s))
    assert edge.relayout[i][j] == 4096 * 512 * 4
    other = _state(_lookup, args, "cpu")
    assert not any(e.relayout for e in other.problem.edges)


def test_all_gathers_of_two_dims_hold_a_transposed_copy() -> None:
    """XLA all-gathers a `[y, x]`-sharded table over both axes on a new leading dim and
    copies the shards into place: a second copy of the gathered table, made from it."""
    args = (S((4096, 512), F32), S((64, 128), jnp.int32))
    state = _state(_lookup, args, "tpu-v5e", mesh="2x4")
    gather = next(op for op in state.graph.ops if op.name == "stablehlo.gather")
    node_index = state.space.node_of[gather.index]
    edge = next(e for e in state.problem.edges if e.dst == node_index and e.relayout)
    src_specs = [tuple(map(tuple, s.results[0]))
                 for s in state.space.strategies[state.space.op_of[edge.src]]]
    dst_specs = [tuple(map(tuple, s.operands[0])) for s in state.space.strategies[gather.index]]
    seen = 0
    for i, src in enumerate(src_specs):
        for j, dst in enumerate(dst_specs):
            if sum(1 for a, b in zip(src, dst) if set(a) - set(b)) >= 2:  # two dims gathered
                seen += 1
                assert edge.relayout[i][j] == edge.copies[j] > 0, (src, dst)
    assert seen
    other = _state(_lookup, args, "cpu", mesh="2x4")
    assert not any(e.relayout for e in other.problem.edges)


