"""A masked lookup's all-reduced rows sliced by their one reader (build_sharding_problem's
scatter-first gathers): libtpu compiles the all-reduce and the slice as a reduce-scatter, then
reshards the scattered rows; the plan is priced and listed so (hf_bert's, haiku_transformer's
and llama's embedding lookups on v5e:2x4)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax import export

import hloplan
from hloplan.cost_models import CommModel, load_device_model
from hloplan.graph import TensorType
from hloplan.mesh import parse_mesh
from hloplan.passes.build_sharding_problem import scatter_first_layout, scatter_first_reshard
from hloplan.strategies import local_bytes

X, Y = 0, 1
SIZES = (2, 4)  # v5e:2x4 as x=2, y=4


def test_the_scattered_layout_puts_the_summed_axes_where_the_reader_has_them():
    shape = (16, 128, 256)
    # hf_bert: [-, -, y] summed over x, read [y, x, -]: scattered to [-, x, y].
    assert scatter_first_layout(((), (), (Y,)), ((Y,), (X,), ()), (X,), shape,
                                SIZES) == ((), (X,), (Y,))
    # A plain slice: the scattered layout is the reader's.
    assert scatter_first_layout(((), (), ()), ((X, Y), (), ()), (X, Y), shape,
                                SIZES) == ((X, Y), (), ())
    # In the reader's order on a dim.
    assert scatter_first_layout(((), (), ()), ((Y, X), (), ()), (X, Y), shape,
                                SIZES) == ((Y, X), (), ())
    # The reader leaves a summed axis out: an all-reduce stays one.
    assert scatter_first_layout(((), (), (Y,)), ((), (Y,), ()), (X,), shape, SIZES) is None
    assert scatter_first_layout(((), (), ()), ((X,), (), ()), (X, Y), shape, SIZES) is None
    # Nothing summed, or a layout that does not divide.
    assert scatter_first_layout(((), (), ()), ((X,), (), ()), (), shape, SIZES) is None
    assert scatter_first_layout(((), (), ()), ((X,), (), ()), (X,), (3, 128, 256),
                                SIZES) is None


def test_the_scattered_rows_move_to_their_dim_unless_scattered_onto_the_first():
    comm = CommModel(load_device_model("tpu-v5e"), parse_mesh("2x4"))
    type_ = TensorType((16, 128, 1024), "f32")
    shard = 16 * 128 * 1024 * 4 / 8

    def listed(src, reduced, dst):
        mid = scatter_first_layout(src, dst, reduced, type_.shape, SIZES)
        return [(kind, axes, sent) for kind, axes, sent in
                scatter_first_reshard(comm, type_, reduced, mid, dst).collectives]

    # haiku_transformer (libtpu, v5e:2x4): `[-, -, y]` summed over x, read `[y, x, -]`:
    # scattered onto dim 0, an all-to-all moves x to dim 1, another moves y to dim 0.
    assert listed(((), (), (Y,)), (X,), ((Y,), (X,), ())) == [
        ("all-to-all", (X,), shard / 2), ("all-to-all", (Y,), shard * 3 / 4)]
    # keras_gemma: `[-, -, x]` summed over y, read `[y, x, -]`: scattered onto dim 0 where the
    # reader has y; only x moves.
    assert listed(((), (), (X,)), (Y,), ((Y,), (X,), ())) == [
        ("all-to-all", (X,), shard / 2)]


def _embed(table, ids, x):
    return jnp.tanh(table[ids] + x)


def _plan(device):
    s = jax.ShapeDtypeStruct
    data = export.export(jax.jit(_embed))(s((4096, 256), jnp.float32),
                                          s((16, 128), jnp.int32),
                                          s((16, 128, 256), jnp.float32)).serialize()
    return hloplan.compile(data, "2x4", device=device, mesh_views="off").state


def test_the_lookup_is_priced_as_the_reduce_scatter_its_reader_makes_of_it():
    state = _plan("tpu-v5e")
    graph, space, problem, comm = state.graph, state.space, state.problem, state.comm
    gather = next(op for op in graph.ops if op.name == "stablehlo.gather")
    add = next(op for op in graph.ops
               if op.name == "stablehlo.add" and gather.results[0] in op.operands)
    reads, before = space.scatter_first[gather.index]
    assert reads == ((add.index, 0),)
    position = 0
    type_ = graph.type_of(gather.results[0])
    after = space.strategies[gather.index]
    edge = next(e for e in problem.edges
                if e.src == space.node_of[gather.index] and e.dst == space.node_of[add.index])
    summed = sliced = 0
    kinds = {True: 0, False: 0}  # reshards from `mid` with an all-to-all, without
    for i, (old, new) in enumerate(zip(before, after)):
        if not old.reduced_axes:
            assert new.communication == old.communication
            continue
        summed += 1
        nbytes = local_bytes(type_, old.results[0], comm.mesh)
        assert old.communication == pytest.approx(
            comm.collective("all-reduce", nbytes, old.reduced_axes))
        assert new.communication == pytest.approx(
            comm.collective("reduce-scatter", nbytes, old.reduced_axes))
        assert new.communication < old.communication
        for j, c in enumerate(space.strategies[add.index]):
            dst = c.operands[position]
            mid = scatter_first_layout(old.results[0], dst, old.reduced_axes, type_.shape,
                                       comm.mesh.axis_sizes)
            if mid is None:  # the all-reduce charged back, with the reshard from its layout
                reshard = 0.0 if dst == old.results[0] else comm.reshard(
                    type_.shape, type_.itemsize, old.results[0], dst).seconds
                assert edge.costs[i][j] == pytest.approx(
                    reshard + old.communication - new.communication)
            elif mid == dst:  # the slice alone: nothing beyond the reduce-scatter
                assert edge.costs[i][j] == 0
                sliced += 1
            else:  # scattered onto the first dim, the summed axes `mid` has elsewhere
                # moved to their dim, then the reshard from there
                axes = tuple(a for a in old.reduced_axes if a not in mid[0])
                moved = (comm.all_to_all(local_bytes(type_, mid, comm.mesh), axes)
                         if axes else 0.0)
                reshard = comm.reshard(type_.shape, type_.itemsize, mid, dst).seconds
                assert edge.costs[i][j] == pytest.approx(moved + reshard)
                kinds[bool(axes)] += 1
    assert summed and sliced  # the masked lookup is among the strategies
    assert all(kinds.values())  # both forms of the reshard from the scattered layout


def test_only_where_libtpu_compiles():
    assert not _plan("cpu").space.scatter_first
