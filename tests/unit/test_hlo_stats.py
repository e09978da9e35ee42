"""Tests for hloplan.hlo_stats: collectives and memory measured from compiled HLO text."""

from __future__ import annotations

import math
import os
import re
import sys
from types import SimpleNamespace

import numpy as np
import pytest

_JAX_PREIMPORTED = "jax" in sys.modules
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from hloplan.hlo_stats import (  # noqa: E402
    CollectiveStats,
    _axes_of_groups,
    collective_stats,
    compiled_kernels,
    dumped_live_peak,
    dumped_temp_bytes,
    kernel_stats,
    live_at,
    live_peak,
    live_range_peak,
    memory_stats,
    parse_replica_groups,
    preallocated_temp_bytes,
    shape_bytes,
)

MESH_AXES = (("data", 2), ("model", 4))


# ---------------------------------------------------------------------------------------------
# Shapes and replica groups on hand-written text


@pytest.mark.parametrize(
    ("shape", "nbytes"),
    [
        ("f32[16,32]{1,0}", 16 * 32 * 4),
        ("f32[]", 4),
        ("pred[7]", 7),
        ("s8[3,3]", 9),
        ("u8[4]", 4),
        ("s32[2]", 8),
        ("u32[2]", 8),
        ("s64[2]", 16),
        ("f16[10]", 20),
        ("bf16[8,8]{0,1}", 128),
        ("f64[3]", 24),
        ("f8e4m3fn[32]", 32),
        ("f8e5m2[2,2]", 4),
        ("c64[2]", 16),
        ("s4[3]", 2),
        ("token[]", 0),
        ("f32[<=16,4]", 256),
        ("f32[8,128]{1,0:T(8,128)}", 4096),
        ("(s32[], f32[16,64]{1,0}, /*index=2*/bf16[4])", 4 + 4096 + 8),
        ("((f32[2], f32[2]), f32[4])", 32),
    ],
)
def test_shape_bytes(shape: str, nbytes: int) -> None:
    assert shape_bytes(shape) == nbytes


def test_shape_bytes_rejects_unknown_type() -> None:
    with pytest.raises(ValueError):
        shape_bytes("q99[4]")


def _groups(text: str, **kw: int) -> list[list[int]]:
    arr = parse_replica_groups(text, **kw)
    assert arr is not None
    return arr.tolist()


def test_replica_groups_explicit_and_empty() -> None:
    assert _groups("{{0,1},{2,3}}") == [[0, 1], [2, 3]]
    assert _groups("{{0,4},{1,5},{2,6},{3,7}}") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert _groups("{}", num_devices=4) == [[0, 1, 2, 3]]
    assert parse_replica_groups("{}") is None
    assert _groups("{{0, 1, 2}}") == [[0, 1, 2]]


def test_replica_groups_iota() -> None:
    assert _groups("[2,4]<=[8]") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert _groups("[4,2]<=[2,4]T(1,0)") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert _groups("[1,8]<=[8]") == [list(range(8))]
    # [2,2,2] transposed (0,2,1): groups of devices differing in the middle bit.
    assert _groups("[4,2]<=[2,2,2]T(0,2,1)") == [[0, 2], [1, 3], [4, 6], [5, 7]]


def test_replica_groups_mesh_form() -> None:
    # What XLA 0.10 prints for a reduction over "model" of a (data=2, model=4) mesh.
    text = "mesh['axis_0'=1,'axis_1'=4,'axis_2'=2], device_ids=([2,4]T(1,0)) {'axis_1'}"
    assert _groups(text) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert _groups("mesh['axis_0'=1,'axis_1'=2,'axis_2'=4] {'axis_1'}") == [
        [0, 4],
        [1, 5],
        [2, 6],
        [3, 7],
    ]
    assert _groups("mesh['a'=2,'b'=4] {'a','b'}") == [list(range(8))]
    assert _groups("mesh['a'=2,'b'=4] {'b','a'}") == [[0, 4, 1, 5, 2, 6, 3, 7]]
    # Unquoted names and an explicit device-id list.
    assert _groups("mesh[x=2,y=2], device_ids=(3,2,1,0) {y}") == [[3, 2], [1, 0]]
    # Sub-axis x:(2)2 of an 8-device axis: devices 2 apart.
    assert _groups("mesh['x'=8] {'x':(2)2}") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    # Pre-size counts the more major part (Shardy convention): x:(1)2 is the major half.
    assert _groups("mesh['x'=8] {'x':(1)2}") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert _groups("mesh['x'=8] {'x':(1)2,'x':(4)2}") == [[0, 1, 4, 5], [2, 3, 6, 7]]


def test_replica_groups_garbage() -> None:
    with pytest.raises(ValueError):
        parse_replica_groups("bogus")


# ---------------------------------------------------------------------------------------------
# Whole modules, hand-written


_SNIPPET_SYNC = """\
HloModule m, num_partitions=8

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %a = f32[] add(%x, %y)
}

ENTRY %main (p0: f32[16,32], p1: bf16[8]) -> f32[16,32] {
  %p0 = f32[16,32]{1,0} parameter(0), sharding={replicated}
  %p1 = bf16[8]{0} parameter(1)
  %ar = (f32[16,32]{1,0}, bf16[8]{0}) all-reduce(%p0, %p1), channel_id=1, replica_groups={{0,1,2,3},{4,5,6,7}}, use_global_device_ids=true, to_apply=%add
  %g0 = f32[16,32]{1,0} get-tuple-element(%ar), index=0
  %ag = f32[16,64]{1,0} all-gather(%g0), channel_id=2, replica_groups=[4,2]<=[2,4]T(1,0), dimensions={1}, use_global_device_ids=true
  %rs = f32[16,8]{1,0} reduce-scatter(%g0), channel_id=3, replica_groups={}, dimensions={1}, to_apply=%add
  %a2a = f32[16,32]{1,0} all-to-all(%g0), channel_id=4, replica_groups=[2,4]<=[8], dimensions={1}
  %cp = f32[16,32]{1,0} collective-permute(%a2a), channel_id=5, source_target_pairs={{0,4},{4,0},{1,5},{5,1}}
  ROOT %cb = f32[16,32]{1,0} collective-broadcast(%cp), channel_id=6, replica_groups={{0,1}}
}
"""


def test_sync_collectives_bytes_groups_axes() -> None:
    stats = collective_stats(_SNIPPET_SYNC, mesh_axes=MESH_AXES)
    ops = {op.name: op for op in stats.ops}
    assert [op.kind for op in stats.ops] == [
        "all-reduce",
        "all-gather",
        "reduce-scatter",
        "all-to-all",
        "collective-permute",
        "collective-broadcast",
    ]
    ar = ops["ar"]  # tuple all-reduce: operand sizes add up
    assert ar.operand_bytes == ar.result_bytes == 2048 + 16
    assert ar.group_size == 4 and ar.num_groups == 2 and ar.axes == ("model",)
    assert ar.bytes_sent == pytest.approx(2 * 3 / 4 * 2064)
    ag = ops["ag"]
    assert ag.group_size == 2 and ag.axes == ("data",)
    assert ag.result_bytes == 4096 and ag.bytes_sent == pytest.approx(4096 / 2)
    rs = ops["rs"]  # {} = all devices, taken from num_partitions
    assert rs.group_size == 8 and rs.axes == ("data", "model")
    assert rs.bytes_sent == pytest.approx(7 / 8 * 2048)
    a2a = ops["a2a"]
    assert a2a.group_size == 4 and a2a.axes == ("model",)
    assert a2a.bytes_sent == pytest.approx(3 / 4 * 2048)
    cp = ops["cp"]
    assert cp.bytes_sent == 2048 and cp.axes == ("data",)
    assert cp.replica_groups == ((0, 4), (4, 0), (1, 5), (5, 1))
    cb = ops["cb"]
    assert cb.group_size == 2 and cb.bytes_sent == 2048
    assert cb.axes == ()  # a single group {0,1} does not cover the mesh
    assert all(op.trip_count == 1 and op.trip_count_known for op in stats.ops)
    assert stats.total_bytes == pytest.approx(sum(op.bytes_sent for op in stats.ops))
    assert stats.by_kind()["all-reduce"] == (1, pytest.approx(ar.bytes_sent))


def test_without_mesh_axes_are_empty_and_num_devices_override() -> None:
    stats = collective_stats(_SNIPPET_SYNC, num_devices=4)
    assert all(op.axes == () for op in stats.ops)
    rs = next(op for op in stats.ops if op.kind == "reduce-scatter")
    assert rs.group_size == 4


_SNIPPET_ASYNC = """\
HloModule m, num_partitions=4

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %a = f32[] add(%x, %y)
}

%rs_body (p: f32[64]) -> f32[16] {
  %p = f32[64]{0} parameter(0)
  ROOT %rs = f32[16]{0} reduce-scatter(%p), channel_id=9, replica_groups={{0,1,2,3}}, dimensions={0}, to_apply=%add
}

ENTRY %main (p0: f32[64]) -> f32[64] {
  %p0 = f32[64]{0} parameter(0)
  %ars = f32[64]{0} all-reduce-start(%p0), channel_id=1, replica_groups={{0,1,2,3}}, to_apply=%add
  %ard = f32[64]{0} all-reduce-done(%ars)
  %ags = (f32[64]{0}, f32[256]{0}) all-gather-start(%ard), channel_id=2, replica_groups={{0,1,2,3}}, dimensions={0}
  %agd = f32[256]{0} all-gather-done(%ags)
  %cps = (f32[64]{0}, f32[64]{0}, u32[], u32[]) collective-permute-start(%ard), channel_id=3, source_target_pairs={{0,1},{1,0}}
  %cpd = f32[64]{0} collective-permute-done(%cps)
  %rss = ((f32[64]{0}), f32[16]{0}) async-start(%cpd), calls=%rs_body
  %rsd = f32[16]{0} async-done(%rss), calls=%rs_body
  ROOT %out = f32[64]{0} add(%cpd, %ard)
}
"""


def test_async_pairs_count_once() -> None:
    stats = collective_stats(_SNIPPET_ASYNC)
    kinds = [op.kind for op in stats.ops]
    assert sorted(kinds) == sorted(
        ["all-reduce", "all-gather", "collective-permute", "reduce-scatter"]
    )
    ops = {op.kind: op for op in stats.ops}
    assert ops["all-reduce"].is_async and ops["all-reduce"].bytes_sent == pytest.approx(384)
    assert ops["all-gather"].result_bytes == 1024
    assert ops["all-gather"].bytes_sent == pytest.approx(768)
    assert ops["collective-permute"].result_bytes == 256
    assert ops["collective-permute"].bytes_sent == 256
    assert ops["reduce-scatter"].operand_bytes == 256
    assert ops["reduce-scatter"].bytes_sent == pytest.approx(192)


def _loop_module(cond_body: str, backend_config: str = "", init: str = "s32[] constant(0)") -> str:
    return f"""\
HloModule loop, num_partitions=8

%add (x: f32[], y: f32[]) -> f32[] {{
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %a = f32[] add(%x, %y)
}}

%body (bp: (s32[], f32[16])) -> (s32[], f32[16]) {{
  %bp = (s32[], f32[16]{{0}}) parameter(0)
  %i = s32[] get-tuple-element(%bp), index=0
  %v = f32[16]{{0}} get-tuple-element(%bp), index=1
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  %r = f32[16]{{0}} all-reduce(%v), channel_id=1, replica_groups=[4,2]<=[8], to_apply=%add
  ROOT %t = (s32[], f32[16]{{0}}) tuple(%next, %r)
}}

%cond (cp: (s32[], f32[16])) -> pred[] {{
{cond_body}
}}

ENTRY %main (p: f32[16]) -> f32[16] {{
  %p = f32[16]{{0}} parameter(0)
  %c0 = {init}
  %init = (s32[], f32[16]{{0}}) tuple(%c0, %p)
  %w = (s32[], f32[16]{{0}}) while(%init), condition=%cond, body=%body{backend_config}
  ROOT %o = f32[16]{{0}} get-tuple-element(%w), index=1
}}
"""


_COND_LT = """\
  %cp = (s32[], f32[16]{0}) parameter(0)
  %ci = s32[] get-tuple-element(%cp), index=0
  %lim = s32[] constant(7)
  ROOT %lt = pred[] compare(%ci, %lim), direction=LT"""


def test_loop_trip_count_from_backend_config() -> None:
    text = _loop_module(_COND_LT, ', backend_config={"known_trip_count":{"n":"4"}}')
    (op,) = collective_stats(text, mesh_axes=MESH_AXES).ops
    assert op.trip_count == 4 and op.trip_count_known
    # [4,2]<=[8] pairs {0,1},{2,3},...: halves of "model", on its links.
    assert op.group_size == 2 and op.axes == ("model",)


# libtpu (v5e:2x4, hf_llama's final norm gradient): an all-to-all over halves of y, then a
# collective-permute that puts the shards in the mesh's device order.
_HALF_AXIS_ALL_TO_ALL = """\
HloModule m, num_partitions=8

ENTRY %main (p: f32[1,2,128,2,1024]) -> f32[1,4,128,1024] {
  %copy.242 = f32[1,2,128,2,1024]{4,2,1,0,3:T(8,128)S(1)} parameter(0)
  %all-to-all.4 = f32[1,2,128,2,1024]{4,2,1,0,3:T(8,128)S(1)} all-to-all(%copy.242), channel_id=54, replica_groups=mesh['axis_0'=4,'axis_1'=1,'axis_2'=1,'axis_3'=2] {'axis_3'}, dimensions={3}
  %bitcast.890 = f32[1,4,128,1024]{3,2,1,0:T(8,128)S(1)} bitcast(%all-to-all.4)
  ROOT %cp = f32[1,4,128,1024]{3,2,1,0:T(8,128)S(1)} collective-permute(%bitcast.890), channel_id=55, source_target_pairs={{0,0},{1,4},{2,1},{3,5},{4,2},{5,6},{6,3},{7,7}}
}
"""


def test_all_to_all_over_parts_of_one_axis_counts_for_that_axis() -> None:
    a2a, cp = collective_stats(_HALF_AXIS_ALL_TO_ALL, mesh_axes=(("x", 2), ("y", 4))).ops
    assert a2a.replica_groups == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert a2a.axes == ("y",) and a2a.group_size == 2
    assert a2a.bytes_sent == pytest.approx(2 * 128 * 2 * 1024 * 4 / 2)
    assert cp.axes == ("x", "y")
    # Parts of two axes count for both; groups that leave devices out stay unmapped.
    groups = np.array([[0, 1, 4, 5], [2, 3, 6, 7]])
    assert _axes_of_groups(groups, (("x", 2), ("y", 4))) == ("x", "y")
    assert _axes_of_groups(np.array([[0, 5], [1, 4], [2, 7], [3, 6]]),
                           (("x", 2), ("y", 4))) == ("x", "y")
    assert _axes_of_groups(np.array([[0, 1, 2], [3, 4, 5]]), (("x", 2), ("y", 4))) == ()
    assert _axes_of_groups(np.array([[0, 1]]), (("x", 2), ("y", 4))) == ()
    assert _axes_of_groups(np.array([[0, 1], [2, 3]]), (("x", 2), ("y", 4))) == ()


def test_loop_trip_count_from_condition() -> None:
    stats = collective_stats(_loop_module(_COND_LT))
    (op,) = stats.ops
    assert op.trip_count == 7 and op.trip_count_known
    per_iter = 2 * (1 / 2) * 64
    assert op.bytes_sent == pytest.approx(per_iter)
    assert stats.by_kind() == {"all-reduce": (7, pytest.approx(7 * per_iter))}
    # init 2, `i <= 7` -> 6 iterations; constant on the left flips the direction.
    le = _COND_LT.replace("direction=LT", "direction=LE")
    assert collective_stats(_loop_module(le, init="s32[] constant(2)")).ops[0].trip_count == 6
    gt = _COND_LT.replace("compare(%ci, %lim), direction=LT", "compare(%lim, %ci), direction=GT")
    assert collective_stats(_loop_module(gt)).ops[0].trip_count == 7


def test_loop_trip_count_through_fused_compare() -> None:
    # XLA CPU wraps the compare in a fusion, as in real compiled text.
    text = _loop_module(
        """\
  %cp = (s32[], f32[16]{0}) parameter(0)
  %lim = s32[] constant(5)
  %ci = s32[] get-tuple-element(%cp), index=0
  ROOT %wc = pred[] fusion(%ci, %lim), kind=kLoop, calls=%cmp"""
    )
    text = text.replace(
        "%cond (",
        """%cmp (a: s32[], b: s32[]) -> pred[] {
  %a = s32[] parameter(0)
  %b = s32[] parameter(1)
  ROOT %c = pred[] compare(%a, %b), direction=LT
}

%cond (""",
    )
    (op,) = collective_stats(text).ops
    assert op.trip_count == 5 and op.trip_count_known


def test_loop_trip_count_unknown() -> None:
    cond = """\
  %cp = (s32[], f32[16]{0}) parameter(0)
  %ci = s32[] get-tuple-element(%cp), index=0
  %v = f32[16]{0} get-tuple-element(%cp), index=1
  %s = s32[] bitcast-convert(%ci)
  ROOT %lt = pred[] compare(%ci, %s), direction=LT"""
    stats = collective_stats(_loop_module(cond))
    (op,) = stats.ops
    assert op.trip_count == 1 and not op.trip_count_known
    assert not stats.all_trip_counts_known


_SNIPPET_NESTED = """\
HloModule nested, num_partitions=4

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %a = f32[] add(%x, %y)
}

%inner_body (ib: (s32[], f32[8])) -> (s32[], f32[8]) {
  %ib = (s32[], f32[8]{0}) parameter(0)
  %v = f32[8]{0} get-tuple-element(%ib), index=1
  %i = s32[] get-tuple-element(%ib), index=0
  %r = f32[8]{0} all-reduce(%v), replica_groups={}, to_apply=%add
  ROOT %t = (s32[], f32[8]{0}) tuple(%i, %r)
}

%inner_cond (ic: (s32[], f32[8])) -> pred[] {
  %ic = (s32[], f32[8]{0}) parameter(0)
  ROOT %k = pred[] constant(true)
}

%outer_body (ob: (s32[], f32[8])) -> (s32[], f32[8]) {
  %ob = (s32[], f32[8]{0}) parameter(0)
  %w = (s32[], f32[8]{0}) while(%ob), condition=%inner_cond, body=%inner_body, backend_config={"known_trip_count":{"n":"3"}}
  ROOT %c = (s32[], f32[8]{0}) call(%w), to_apply=%called
}

%called (cc: (s32[], f32[8])) -> (s32[], f32[8]) {
  %cc = (s32[], f32[8]{0}) parameter(0)
  %v2 = f32[8]{0} get-tuple-element(%cc), index=1
  %i2 = s32[] get-tuple-element(%cc), index=0
  %g = f32[32]{0} all-gather(%v2), replica_groups={{0,1,2,3}}, dimensions={0}
  %s = f32[8]{0} slice(%g), slice={[0:8]}
  ROOT %t2 = (s32[], f32[8]{0}) tuple(%i2, %s)
}

%outer_cond (oc: (s32[], f32[8])) -> pred[] {
  %oc = (s32[], f32[8]{0}) parameter(0)
  ROOT %k2 = pred[] constant(true)
}

%branch_a (ba: f32[8]) -> f32[8] {
  %ba = f32[8]{0} parameter(0)
  ROOT %cpa = f32[8]{0} collective-permute(%ba), source_target_pairs={{0,1},{1,2},{2,3},{3,0}}
}

%branch_b (bb: f32[8]) -> f32[8] {
  %bb = f32[8]{0} parameter(0)
  ROOT %nb = f32[8]{0} negate(%bb)
}

%unreachable (u: f32[8]) -> f32[8] {
  %u = f32[8]{0} parameter(0)
  ROOT %ur = f32[8]{0} all-reduce(%u), replica_groups={}, to_apply=%add
}

ENTRY %main (p: f32[8], q: s32[]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  %q = s32[] parameter(1)
  %z = s32[] constant(0)
  %init = (s32[], f32[8]{0}) tuple(%z, %p)
  %w = (s32[], f32[8]{0}) while(%init), condition=%outer_cond, body=%outer_body, backend_config={"known_trip_count":{"n":"2"}}
  %v = f32[8]{0} get-tuple-element(%w), index=1
  ROOT %cond = f32[8]{0} conditional(%q, %v, %v), branch_computations={%branch_a, %branch_b}
}
"""


def test_nested_loops_calls_and_conditionals() -> None:
    stats = collective_stats(_SNIPPET_NESTED)
    ops = {op.name: op for op in stats.ops}
    assert set(ops) == {"r", "g", "cpa"}  # %unreachable is not called
    assert ops["r"].trip_count == 6 and ops["r"].group_size == 4
    assert ops["g"].trip_count == 2
    assert ops["cpa"].trip_count == 1 and ops["cpa"].bytes_sent == 32
    counts = {k: c for k, (c, _) in stats.by_kind().items()}
    assert counts == {"all-reduce": 6, "all-gather": 2, "collective-permute": 1}
    assert stats.count == 9
    assert stats.total_bytes == pytest.approx(6 * 2 * 3 / 4 * 32 + 2 * 3 / 4 * 128 + 32)


def test_inline_operand_shapes_and_no_entry() -> None:
    # Older dumps print operand shapes inline and may lack the ENTRY marker.
    text = """\
main {
  p = f32[8,4]{1,0} parameter(0)
  ROOT ar = f32[8,4]{1,0} all-reduce(f32[8,4]{1,0} p), replica_groups={{0,1}}, to_apply=add
}
"""
    (op,) = collective_stats(text).ops
    assert op.operand_bytes == 128 and op.group_size == 2
    assert op.bytes_sent == pytest.approx(128)


def test_empty_module() -> None:
    stats = collective_stats(
        "HloModule empty\n\nENTRY %m () -> f32[] {\n  ROOT %c = f32[] constant(1)\n}\n"
    )
    assert stats.ops == () and stats.total_bytes == 0 and stats.by_kind() == {}
    assert isinstance(stats, CollectiveStats)


# ---------------------------------------------------------------------------------------------
# memory_stats


def test_memory_stats_robust() -> None:
    full = SimpleNamespace(
        argument_size_in_bytes=100,
        output_size_in_bytes=50,
        temp_size_in_bytes=30,
        alias_size_in_bytes=20,
        generated_code_size_in_bytes=7,
    )
    out = memory_stats(SimpleNamespace(memory_analysis=lambda: full))
    assert out["peak_bytes"] == 160 and out["generated_code_bytes"] == 7
    assert out["xla_peak_bytes"] is None
    partial = memory_stats({"argument_size_in_bytes": 10})
    assert partial["argument_bytes"] == 10 and partial["peak_bytes"] is None

    def boom() -> None:
        raise NotImplementedError

    none = memory_stats(SimpleNamespace(memory_analysis=boom))
    assert set(none.values()) == {None}
    assert memory_stats(SimpleNamespace(memory_analysis=lambda: None))["peak_bytes"] is None


# ---------------------------------------------------------------------------------------------
# Real compiled programs (CPU, 8 forced host devices)


@pytest.fixture(scope="module")
def mesh() -> jax.sharding.Mesh:
    if jax.device_count() < 8:
        why = "jax was imported before XLA_FLAGS was set" if _JAX_PREIMPORTED else "no 8 devices"
        pytest.skip(f"needs 8 devices ({why}); got {jax.device_count()}")
    return jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


def _put(mesh: jax.sharding.Mesh, shape: tuple[int, ...], *spec: object) -> jax.Array:
    return jax.device_put(jnp.ones(shape, jnp.float32), NamedSharding(mesh, P(*spec)))


def _axes_of(spec: tuple, rank: int) -> tuple[tuple[int, ...], ...]:
    """A PartitionSpec's entries over ("data", "model") as CommModel's mesh-axis indices."""
    names = {"data": 0, "model": 1}
    spec = tuple(spec) + (None,) * (rank - len(spec))
    return tuple(() if s is None else tuple(names[a] for a in ((s,) if isinstance(s, str) else s))
                 for s in spec)


def _stats(compiled: object) -> CollectiveStats:
    return collective_stats(compiled.as_text(), mesh_axes=MESH_AXES)  # type: ignore[attr-defined]


@pytest.mark.parametrize(("axes", "n"), [("model", 4), ("data", 2), (("data", "model"), 8)])
def test_real_matmul_contracting_dim_sharded(mesh, axes, n) -> None:
    x = _put(mesh, (16, 32), None, axes)
    w = _put(mesh, (32, 64), axes, None)
    compiled = (
        jax.jit(lambda a, b: a @ b, out_shardings=NamedSharding(mesh, P())).lower(x, w).compile()
    )
    stats = _stats(compiled)
    (op,) = stats.ops
    out_bytes = 16 * 64 * 4
    assert op.kind == "all-reduce" and op.group_size == n and op.num_groups == 8 // n
    assert op.axes == ((axes,) if isinstance(axes, str) else axes)
    assert op.operand_bytes == op.result_bytes == out_bytes
    assert op.bytes_sent == pytest.approx(2 * (n - 1) / n * out_bytes)
    assert op.trip_count == 1
    mem = memory_stats(compiled)
    assert mem["argument_bytes"] == (16 * 32 + 32 * 64) * 4 // n
    assert mem["output_bytes"] == out_bytes
    assert mem["peak_bytes"] == (
        mem["argument_bytes"] + mem["output_bytes"] + mem["temp_bytes"] - mem["alias_bytes"]
    )


def test_real_all_gather_from_resharding(mesh) -> None:
    x = _put(mesh, (16, 32), None, "model")
    compiled = jax.jit(lambda a: a * 2, out_shardings=NamedSharding(mesh, P())).lower(x).compile()
    (op,) = _stats(compiled).ops
    assert op.kind == "all-gather" and op.group_size == 4 and op.axes == ("model",)
    assert op.result_bytes == 16 * 32 * 4 and op.operand_bytes == 16 * 8 * 4
    assert op.bytes_sent == pytest.approx(3 / 4 * 16 * 32 * 4)


def test_real_all_to_all(mesh) -> None:
    x = _put(mesh, (16, 32), None, "model")
    compiled = (
        jax.jit(lambda a: a * 2, out_shardings=NamedSharding(mesh, P("model", None)))
        .lower(x)
        .compile()
    )
    (op,) = _stats(compiled).ops
    assert op.kind == "all-to-all" and op.group_size == 4 and op.axes == ("model",)
    assert op.operand_bytes == 16 * 8 * 4  # XLA CPU splits it into a 4-operand tuple
    assert op.bytes_sent == pytest.approx(3 / 4 * 16 * 8 * 4)


def test_real_loop_multiplies_by_trip_count(mesh) -> None:
    x = _put(mesh, (16, 32), None, "model")
    w = _put(mesh, (32, 32), "model", None)
    col = NamedSharding(mesh, P(None, "model"))

    def f(a, b):
        def body(_, acc):
            acc = jax.lax.with_sharding_constraint(acc, col)
            return jax.lax.with_sharding_constraint(jnp.tanh(acc @ b), col)

        return jax.lax.fori_loop(0, 6, body, a)

    text = jax.jit(f, out_shardings=col).lower(x, w).compile().as_text()
    stats = collective_stats(text, mesh_axes=MESH_AXES, fold_reduce_scatter=False)
    (op,) = stats.ops
    per_iter = 2 * 3 / 4 * 16 * 32 * 4
    assert op.kind == "all-reduce" and op.axes == ("model",) and op.group_size == 4
    assert op.trip_count == 6 and op.trip_count_known
    assert op.bytes_sent == pytest.approx(per_iter)
    assert stats.by_kind() == {"all-reduce": (6, pytest.approx(6 * per_iter))}
    assert stats.total_bytes == pytest.approx(6 * per_iter)
    # The CPU partitioner all-reduces the partial sums and keeps a column slice: GPU/TPU XLA
    # makes that a reduce-scatter, half the bytes, which is how it counts by default.
    (scatter,) = collective_stats(text, mesh_axes=MESH_AXES).ops
    assert scatter.kind == "reduce-scatter" and scatter.group_size == 4
    assert scatter.bytes_sent == pytest.approx(per_iter / 2) and scatter.trip_count == 6
    # Without known_trip_count the loop condition (i < 6, init 0) gives the same count.
    assert "known_trip_count" in text
    stripped = re.sub(r',"known_trip_count":\{"n":"\d+"\}', "", text)
    assert "known_trip_count" not in stripped
    (op2,) = collective_stats(stripped, mesh_axes=MESH_AXES).ops
    assert op2.trip_count == 6 and op2.trip_count_known


def test_real_scan_multiplies_by_length(mesh) -> None:
    x = _put(mesh, (16, 32), None, "model")
    w = _put(mesh, (32, 32), "model", None)
    col = NamedSharding(mesh, P(None, "model"))

    def f(a, b):
        def body(c, _):
            c = jax.lax.with_sharding_constraint(c, col)
            return jax.lax.with_sharding_constraint(jnp.sin(c @ b), col), None

        return jax.lax.scan(body, a, None, length=3)[0]

    stats = _stats(jax.jit(f, out_shardings=col).lower(x, w).compile())
    (op,) = stats.ops
    assert op.kind == "reduce-scatter" and op.trip_count == 3  # all-reduce + slice, as on GPU
    assert stats.by_kind()["reduce-scatter"] == (3, pytest.approx(3 * 3 / 4 * 2048))


def test_real_shard_map_collectives(mesh) -> None:
    from jax import shard_map

    spec = P(None, "model")
    x = _put(mesh, (16, 32), None, "model")

    def body(a):
        a = jax.lax.psum(a, "data")
        a = jax.lax.ppermute(a, "model", [(i, (i + 1) % 4) for i in range(4)])
        return jax.lax.psum_scatter(a, "model", scatter_dimension=1, tiled=True)

    fn = shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec)
    stats = _stats(jax.jit(fn).lower(x).compile())
    ops = {op.kind: op for op in stats.ops}
    assert set(ops) == {"all-reduce", "collective-permute", "reduce-scatter"}
    local = 16 * 8 * 4
    assert ops["all-reduce"].axes == ("data",) and ops["all-reduce"].group_size == 2
    assert ops["all-reduce"].bytes_sent == pytest.approx(local)
    assert ops["collective-permute"].axes == ("model",)
    assert ops["collective-permute"].bytes_sent == local
    rs = ops["reduce-scatter"]
    assert rs.axes == ("model",) and rs.group_size == 4
    assert rs.operand_bytes == local and rs.result_bytes == local // 4
    assert rs.bytes_sent == pytest.approx(3 / 4 * local)


def test_real_device_ids_are_mesh_positions(mesh) -> None:
    # A mesh over a permuted device list compiles to the same partition-id replica groups.
    devs = np.array(jax.devices())[[0, 2, 4, 6, 1, 3, 5, 7]].reshape(2, 4)
    pmesh = jax.sharding.Mesh(devs, ("data", "model"))
    x = _put(pmesh, (16, 32), None, "model")
    w = _put(pmesh, (32, 64), "model", None)
    compiled = (
        jax.jit(lambda a, b: a @ b, out_shardings=NamedSharding(pmesh, P())).lower(x, w).compile()
    )
    (op,) = _stats(compiled).ops
    assert op.axes == ("model",)
    assert op.replica_groups == ((0, 1, 2, 3), (4, 5, 6, 7))


_SNIPPET_SLICED = """\
HloModule m, num_partitions=4

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %a = f32[] add(%x, %y)
}

%fused (param_0: f32[64,16], param_1: u32[]) -> f32[16,16] {
  %param_0 = f32[64,16]{1,0} parameter(0)
  %param_1 = u32[] parameter(1)
  %c = s32[] convert(%param_1)
  %k = s32[] constant(16)
  %off = s32[] multiply(%c, %k)
  %z = s32[] constant(0)
  %ds = f32[16,16]{1,0} dynamic-slice(%param_0, %off, %z), dynamic_slice_sizes={16,16}
  ROOT %t = f32[16,16]{1,0} tanh(%ds)
}

ENTRY %main (p0: f32[64,16], p1: f32[8]) -> (f32[16,16], f32[8]) {
  %p0 = f32[64,16]{1,0} parameter(0)
  %p1 = f32[8]{0} parameter(1)
  %ar = (f32[64,16]{1,0}, f32[8]{0}) all-reduce(%p0, %p1), channel_id=1, replica_groups={{0,1,2,3}}, use_global_device_ids=true, to_apply=%add
  %g0 = f32[64,16]{1,0} get-tuple-element(%ar), index=0
  %g1 = f32[8]{0} get-tuple-element(%ar), index=1
  %pid = u32[] partition-id()
  %f = f32[16,16]{1,0} fusion(%g0, %pid), kind=kLoop, calls=%fused
  ROOT %out = (f32[16,16]{1,0}, f32[8]{0}) tuple(%f, %g1)
}
"""


def test_all_reduce_read_only_as_shards_counts_as_reduce_scatter() -> None:
    # Element 0 is only read through a 1/4 dynamic-slice (inside a fusion): a reduce-scatter on
    # GPU/TPU. Element 1 is used whole: it stays an all-reduce.
    ops = collective_stats(_SNIPPET_SLICED).ops
    assert [op.kind for op in ops] == ["all-reduce", "reduce-scatter"]
    rest, scatter = ops
    assert rest.operand_bytes == 8 * 4 and rest.bytes_sent == pytest.approx(2 * 3 / 4 * 32)
    assert scatter.operand_bytes == 64 * 16 * 4 and scatter.result_bytes == 16 * 16 * 4
    assert scatter.bytes_sent == pytest.approx(3 / 4 * 64 * 16 * 4)
    # As compiled: one all-reduce of both.
    (whole,) = collective_stats(_SNIPPET_SLICED, fold_reduce_scatter=False).ops
    assert whole.kind == "all-reduce" and whole.operand_bytes == 64 * 16 * 4 + 8 * 4


def test_sliced_all_reduce_with_narrower_results_splits_by_its_operands() -> None:
    # libtpu folds the convert of an f32 matmul operand to bf16 into the all-reduce: f32
    # operands, bf16 results. Both elements are read only as 1/4 shards: one reduce-scatter of
    # the operands' bytes (as the whole all-reduce is counted), no all-reduce of the
    # difference between the f32 operands and the bf16 results.
    text = (_SNIPPET_SLICED
            .replace("%ar = (f32[64,16]{1,0}, f32[8]{0}) all-reduce",
                     "%ar = (bf16[64,16]{1,0}, f32[8]{0}) all-reduce")
            .replace("%g0 = f32[64,16]{1,0} get-tuple-element", "%g0 = bf16[64,16]{1,0} get-tuple-element")
            .replace("%fused (param_0: f32[64,16]", "%fused (param_0: bf16[64,16]")
            .replace("%param_0 = f32[64,16]{1,0}", "%param_0 = bf16[64,16]{1,0}")
            .replace("%g1)\n}", "%g1)\n}"))
    ops = collective_stats(text).ops
    assert [op.kind for op in ops] == ["all-reduce", "reduce-scatter"]
    rest, scatter = ops
    assert rest.operand_bytes == 8 * 4  # the f32[8] read whole
    assert scatter.operand_bytes == 64 * 16 * 4  # the f32 operand of the sliced element
    (whole,) = collective_stats(text, fold_reduce_scatter=False).ops
    assert whole.operand_bytes == rest.operand_bytes + scatter.operand_bytes


def test_all_reduce_moved_between_memory_spaces_then_sliced_counts_as_reduce_scatter() -> None:
    # libtpu keeps a value for the backward pass by moving it out of VMEM and back
    # (copy-start / copy-done pairs); every reader still takes a 1/4 slice: a reduce-scatter
    # (HF GPT-2's layer-norm row sums on v5e:2x4). Read whole after the move: an all-reduce.
    moved = _SNIPPET_SLICED.replace(
        "  %pid = u32[] partition-id()\n",
        "  %pid = u32[] partition-id()\n"
        "  %cs = (f32[64,16]{1,0:S(1)}, f32[64,16]{1,0}, u32[]) copy-start(%g0)\n"
        "  %cd = f32[64,16]{1,0:S(1)} copy-done(%cs)\n"
        "  %f2 = f32[16,16]{1,0} fusion(%cd, %pid), kind=kLoop, calls=%fused\n").replace(
        "tuple(%f, %g1)", "tuple(%f2, %g1)").replace(
        "-> (f32[16,16], f32[8])", "-> (f32[16,16], f32[8])")
    assert "copy-start(%g0)" in moved
    ops = collective_stats(moved).ops
    assert [op.kind for op in ops] == ["all-reduce", "reduce-scatter"]
    assert ops[1].operand_bytes == 64 * 16 * 4
    whole = moved.replace("tuple(%f2, %g1)", "tuple(%f, %g1, %cd)").replace(
        "ROOT %out = (f32[16,16]{1,0}, f32[8]{0})",
        "ROOT %out = (f32[16,16]{1,0}, f32[8]{0}, f32[64,16]{1,0:S(1)})")
    assert [op.kind for op in collective_stats(whole).ops] == ["all-reduce"]


# --- per-kernel roofline ----------------------------------------------------------------------

_KERNELS = """HloModule m, num_partitions=1

%fused_dot (p0: f32[8,256], p1: f32[256,512]) -> f32[8,512] {
  %p0 = f32[8,256]{1,0} parameter(0)
  %p1 = f32[256,512]{1,0} parameter(1)
  ROOT %dot = f32[8,512]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_update (q0: f32[256,512], q1: f32[8,512]) -> f32[256,512] {
  %q0 = f32[256,512]{1,0} parameter(0)
  %q1 = f32[8,512]{1,0} parameter(1)
  %neg = f32[256,512]{1,0} negate(%q0)
  ROOT %s = f32[256,512]{1,0} subtract(%q0, %neg)
}

%fused_slice (r0: f32[1024,512], r1: s32[]) -> f32[8,512] {
  %r0 = f32[1024,512]{1,0} parameter(0)
  %r1 = s32[] parameter(1)
  %zero = s32[] constant(0)
  ROOT %ds = f32[8,512]{1,0} dynamic-slice(%r0, %r1, %zero), dynamic_slice_sizes={8,512}
}

ENTRY %main (a: f32[8,256], w: f32[256,512], big: f32[1024,512], i: s32[]) -> f32[256,512] {
  %a = f32[8,256]{1,0} parameter(0)
  %w = f32[256,512]{1,0} parameter(1)
  %big = f32[1024,512]{1,0} parameter(2)
  %i = s32[] parameter(3)
  %mm = f32[8,512]{1,0} fusion(%a, %w), kind=kCustom, calls=%fused_dot
  %rows = f32[8,512]{1,0} fusion(%big, %i), kind=kLoop, calls=%fused_slice
  %ar = f32[8,512]{1,0} all-reduce(%rows), replica_groups={}, to_apply=%fused_dot
  ROOT %up = f32[256,512]{1,0} fusion(%w, %mm), kind=kLoop, calls=%fused_update
}
"""


def test_kernel_roofline_counts_each_kernel_once() -> None:
    stats = kernel_stats(_KERNELS, flop_rate=1e12, hbm_bandwidth=1e11)
    f32 = 4
    dot_flops = 2 * 8 * 512 * 256
    dot_bytes = (8 * 256 + 256 * 512 + 8 * 512) * f32
    # The dynamic-slice fusion reads only its 8 rows (and the s32 index), not the operand.
    slice_bytes = (8 * 512 + 8 * 512) * f32 + 4
    update_bytes = (256 * 512 + 8 * 512 + 256 * 512) * f32
    assert stats.kernels == 3  # parameters, the collective and bookkeeping launch nothing
    assert stats.matmul_flops == dot_flops
    assert stats.hbm_bytes == dot_bytes + slice_bytes + update_bytes
    expected = (max(dot_flops / 1e12, dot_bytes / 1e11) + slice_bytes / 1e11
                + update_bytes / 1e11)
    assert stats.seconds == pytest.approx(expected)


_SLICED_AFTER_COPY = """
HloModule sliced

%fused_part (p: f32[8,1024,2560]) -> f32[8,1024,1,1,320] {
  %p = f32[8,1024,2560]{2,1,0} parameter(0)
  %b = f32[8,1024,8,1,320]{4,2,1,0,3} bitcast(%p)
  %c = f32[8,1024,8,1,320]{4,3,2,1,0} copy(%b)
  ROOT %s = f32[8,1024,1,1,320]{4,3,2,1,0} slice(%c), slice={[0:8], [0:1024], [0:1], [0:1], [0:320]}
}

%fused_whole (q: f32[8,1024,2560]) -> f32[8,1024,2560] {
  %q = f32[8,1024,2560]{2,1,0} parameter(0)
  %n = f32[8,1024,2560]{2,1,0} negate(%q)
  ROOT %c2 = f32[8,1024,2560]{2,1,0} copy(%n)
}

ENTRY %main (x: f32[8,1024,2560]) -> (f32[8,1024,1,1,320], f32[8,1024,2560]) {
  %x = f32[8,1024,2560]{2,1,0} parameter(0)
  %part = f32[8,1024,1,1,320]{4,3,2,1,0} fusion(%x), kind=kLoop, calls=%fused_part
  %whole = f32[8,1024,2560]{2,1,0} fusion(%x), kind=kLoop, calls=%fused_whole
  ROOT %t = (f32[8,1024,1,1,320]{4,3,2,1,0}, f32[8,1024,2560]{2,1,0}) tuple(%part, %whole)
}
"""


def test_kernel_roofline_reads_only_what_a_fusion_slices_after_layout_changes() -> None:
    # XLA's CPU all-to-all cuts its operand into one fused bitcast-copy-slice per peer; each
    # such loop fusion computes only its slice, so reads 1/8 of the operand, not all of it.
    stats = kernel_stats(_SLICED_AFTER_COPY, flop_rate=1e12, hbm_bandwidth=1e11)
    whole = 8 * 1024 * 2560 * 4
    assert stats.kernels == 2
    assert stats.hbm_bytes == (whole // 8) * 2 + whole * 2


def test_kernel_roofline_multiplies_loop_bodies() -> None:
    once = kernel_stats(_loop_module(_COND_LT, ', backend_config={"known_trip_count":{"n":"1"}}'),
                        flop_rate=1e12, hbm_bandwidth=1e11)
    four = kernel_stats(_loop_module(_COND_LT, ', backend_config={"known_trip_count":{"n":"4"}}'),
                        flop_rate=1e12, hbm_bandwidth=1e11)
    assert once.kernels > 0
    # Three more trips: the body's add and the condition's compare, three more times each.
    assert four.kernels - once.kernels == 6
    assert four.hbm_bytes > once.hbm_bytes


def test_kernel_roofline_of_a_real_program() -> None:
    def step(w, x):
        return w - 0.1 * jax.grad(lambda w: jnp.mean(jnp.tanh(x @ w) ** 2))(w)

    w, x = jnp.ones((256, 512)), jnp.ones((64, 256))
    compiled = jax.jit(step).lower(w, x).compile()
    stats = kernel_stats(compiled.as_text(), flop_rate=1e12, hbm_bandwidth=1e11)
    assert stats.matmul_flops == 2 * (2 * 64 * 256 * 512)  # forward and weight-gradient dots
    # Every kernel reads or writes something; fused intermediates are not counted, so the
    # kernels move no more than XLA's own (unfused-counting) bytes-accessed estimate.
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list | tuple) else cost
    assert 0 < stats.hbm_bytes <= cost["bytes accessed"] * 1.01
    assert stats.seconds >= stats.matmul_flops / 1e12


@pytest.mark.parametrize(
    ("src", "dst"),
    [
        (("data", "model"), ()),  # two dims gather: XLA's order is the last dim first
        (("model", "data"), ()),
        ((None, None, "data", "model"), ()),
        ((None, "model", None, "data"), ()),
        (("data", "model"), (None, "model")),
        ((("data", "model"), None), ()),  # one dim over both axes: one all-gather
        # Axes moving into one dim from two: not an all-to-all but all-gathers, then a slice.
        (("data", "model", None), (None, None, ("data", "model"))),
        (("data", "model", None), (None, None, ("model", "data"))),
        (("data", None, "model"), (None, ("data", "model"))),
        # From one dim: an all-to-all.
        ((("data", "model"), None), (None, ("data", "model"))),
        (("data", "model", None), ("data", None, "model")),
        # "model" stays on its dim while "data" joins it in front: an all-to-all, then a
        # collective-permute that puts the shards in the destination's device order.
        (("data", None, "model"), (None, None, ("data", "model"))),
    ],
)
def test_reshard_model_matches_compiled_collectives(mesh, src, dst) -> None:
    """CommModel.reshard predicts the collectives XLA compiles for a reshard: kind, mesh axes,
    bytes sent and their order (the planner's costs are only as good as this)."""
    from hloplan.cost_models import CommModel, load_device_model
    from hloplan.mesh import parse_mesh

    shape = (8, 16, 32, 64)[-len(src):]
    x = _put(mesh, shape, *src)
    compiled = (
        jax.jit(lambda a: a * 2, out_shardings=NamedSharding(mesh, P(*dst))).lower(x).compile()
    )
    realised = [(op.kind, op.axes, op.bytes_sent) for op in _stats(compiled).ops]
    comm = CommModel(load_device_model("h100"), parse_mesh("data=2,model=4"), hosts=2)
    cost = comm.reshard(shape, 4, _axes_of(src, len(shape)), _axes_of(dst, len(shape)))
    predicted = [(kind, tuple(("data", "model")[a] for a in axes), sent)
                 for kind, axes, sent in cost.collectives]
    assert predicted == realised


@pytest.mark.parametrize(
    ("src", "dst"),
    [
        # One axis of a dim split over both moves to another dim while the other is gathered:
        # both gathered, then sliced (not a gather and an all-to-all).
        ((None, None, ("data", "model")), ("data", None, None)),
        ((None, None, ("data", "model")), ("model", None, None)),
        ((("data", "model"), None, None), (None, "model", None)),
        ((None, ("data", "model"), None), (None, None, "model")),
        # The minor axis is all the dim keeps: the shards permuted to put the gathered axis
        # minor-most, then gathered over it (not gathered over both, then sliced).
        ((None, None, ("data", "model")), (None, None, "model")),
        ((None, None, ("model", "data")), (None, None, "data")),
        ((("data", "model"), None), ("model", None)),
        # Two dims exchange their axes: an all-to-all among pairs of "model" (4 / 2 devices),
        # then a collective-permute of the local shard (CommModel._exchange).
        (("data", "model"), ("model", "data")),
        (("model", "data"), ("data", "model")),
        ((None, "data", "model"), (None, "model", "data")),
    ],
)
def test_reshard_model_matches_constrained_collectives(mesh, src, dst) -> None:
    """A reshard as hloplan emits it, a sharding constraint on the value its reader takes, compiles
    to the collectives CommModel.reshard lists (the same forms libtpu compiles on v5e:2x4).
    (As a jitted function's output sharding instead, XLA moves "model" of
    `[-, -, (data, model)]` to dim 0 by an all-to-all before gathering "data".)"""
    from hloplan.cost_models import CommModel, load_device_model
    from hloplan.mesh import parse_mesh

    shape = (16, 32, 64)[-len(src):]
    compiled = jax.jit(lambda a: jax.lax.with_sharding_constraint(
        a, NamedSharding(mesh, P(*dst))) + 1).lower(_put(mesh, shape, *src)).compile()
    realised = [(op.kind, op.axes, op.bytes_sent) for op in _stats(compiled).ops]
    comm = CommModel(load_device_model("h100"), parse_mesh("data=2,model=4"), hosts=2)
    cost = comm.reshard(shape, 4, _axes_of(src, len(shape)), _axes_of(dst, len(shape)))
    predicted = [(kind, tuple(("data", "model")[a] for a in axes), sent)
                 for kind, axes, sent in cost.collectives]
    # hlo_stats names a permute's axes in mesh order, a gather's in its group's order
    assert [(k, tuple(sorted(a)) if k == "collective-permute" else a, b) for k, a, b in realised] \
        == predicted


@pytest.mark.parametrize(("src", "dst"), [((None, "model", "data"), (None, "data", None)),
                                        (("model", "data"), ("data", None))])
def test_reshard_moving_an_axis_into_the_dim_another_leaves(mesh, src, dst) -> None:
    """"data" moving into the dim "model" leaves (as hloplan emits it, a constraint): XLA's CPU
    compiler permutes the shards, then gathers "model" (in two all-gathers; libtpu in one),
    no all-to-all: CommModel.reshard lists the same bytes per kind."""
    from hloplan.cost_models import CommModel, load_device_model
    from hloplan.mesh import parse_mesh

    shape = (16, 32, 64)[-len(src):]
    compiled = jax.jit(lambda a: jax.lax.with_sharding_constraint(
        a, NamedSharding(mesh, P(*dst))) + 1).lower(_put(mesh, shape, *src)).compile()
    realised: dict = {}
    for op in _stats(compiled).ops:
        realised[op.kind] = realised.get(op.kind, 0.0) + op.bytes_sent
    comm = CommModel(load_device_model("h100"), parse_mesh("data=2,model=4"), hosts=2)
    cost = comm.reshard(shape, 4, _axes_of(src, len(shape)), _axes_of(dst, len(shape)))
    predicted: dict = {}
    for kind, _, sent in cost.collectives:
        predicted[kind] = predicted.get(kind, 0.0) + sent
    assert predicted == realised
    assert set(realised) == {"collective-permute", "all-gather"}


def test_reshard_that_renumbers_devices_sends_an_all_to_all_and_a_permute(mesh) -> None:
    """[(data, model), -, -] -> [model, -, data]: XLA exchanges halves among the device pairs
    that hold each new shard's parts (halves of "model"), then permutes the shards into the
    destination's device order; the model prices both, the all-to-all over "model" with
    the moved axis's ("data") group size."""
    from hloplan.cost_models import CommModel, load_device_model
    from hloplan.mesh import parse_mesh

    shape, src, dst = (8, 16, 32), (("data", "model"), None, None), ("model", None, "data")
    compiled = jax.jit(lambda a: a * 2, out_shardings=NamedSharding(mesh, P(*dst))).lower(
        _put(mesh, shape, *src)).compile()
    a2a, cp = _stats(compiled).ops
    assert (a2a.kind, a2a.axes, a2a.group_size) == ("all-to-all", ("model",), 2)
    assert (cp.kind, cp.axes) == ("collective-permute", ("data", "model"))
    comm = CommModel(load_device_model("h100"), parse_mesh("data=2,model=4"), hosts=2)
    cost = comm.reshard(shape, 4, _axes_of(src, 3), _axes_of(dst, 3))
    assert cost.collectives == ((a2a.kind, (1,), a2a.bytes_sent), (cp.kind, (0, 1), cp.bytes_sent))


@pytest.mark.parametrize(
    ("src", "dst"),
    [
        ((("data", "model"), None), ()),  # model, then data
        ((None, ("data", "model")), ()),
        ((None, ("model", "data")), (None, None)),  # data (minor here), then model
        # data leaves for dim 0 while model is gathered: both gathered, then data sliced
        ((None, ("data", "model")), ("data", None)),
    ],
)
def test_staged_gathers_compile_as_priced(mesh, src, dst) -> None:
    """With staged_gathers, CommModel.reshard's `via` layouts, pinned in order before the
    destination (as propagate-sharding pins them), make XLA issue the collectives priced: one
    all-gather per axis, minor-most first, the same bytes as one all-gather over both."""
    from hloplan.cost_models import CommModel, load_device_model
    from hloplan.mesh import parse_mesh

    def spec_of(layout):
        return P(*[tuple(("data", "model")[a] for a in axes) or None for axes in layout])

    shape = (16, 32)
    comm = CommModel(load_device_model("h100"), parse_mesh("data=2,model=4"), hosts=2,
                     staged_gathers=True)
    cost = comm.reshard(shape, 4, _axes_of(src, len(shape)), _axes_of(dst, len(shape)))
    assert cost.via, "each case stages a gather"

    def reshard(a):
        for layout in cost.via:
            a = jax.lax.with_sharding_constraint(a, NamedSharding(mesh, spec_of(layout)))
        return jax.lax.with_sharding_constraint(a, NamedSharding(mesh, P(*dst)))

    # distinct values, so that a shard in the wrong place shows
    x = jax.device_put(jnp.arange(math.prod(shape), dtype=jnp.float32).reshape(shape),
                       NamedSharding(mesh, P(*src)))
    compiled = jax.jit(lambda a: reshard(a * 2)).lower(x).compile()
    realised = [(op.kind, op.axes, op.bytes_sent) for op in _stats(compiled).ops]
    predicted = [(kind, tuple(("data", "model")[a] for a in axes), sent)
                 for kind, axes, sent in cost.collectives]
    assert predicted == realised
    assert all(len(axes) == 1 for _, axes, _ in realised)
    np.testing.assert_array_equal(np.asarray(compiled(x)), 2 * np.asarray(x))  # same values


# ---------------------------------------------------------------------------------------------
# XLA's live-range dump


def test_live_range_peak_reads_the_dumped_peak():
    text = """HloLiveRange (max 3):
  Live ranges at 2 (peak):
    a{}: 512 bytes (cumulative: 512 bytes)
    b{}: 256 bytes (cumulative: 768 bytes)
  Stack trace breakdown for peak usage: 1 468 028 940 bytes
"""
    assert live_range_peak(text) == 1_468_028_940
    assert live_range_peak(text.rpartition("  Stack")[0]) == 768  # no breakdown: the sum
    assert live_range_peak("HloLiveRange (max 0):\n") is None


def test_live_peak_counts_each_buffer_once_ends_included():
    """An op's operand and result are live together (b ends where c starts); two values in one
    slice of the allocation (a loop's carried value and the async op reading it, d and e,
    touching at 5) are one buffer; on-chip (color 1) and thread-local bytes are not counted."""
    assignment = """BufferAssignment:
allocation 0: size 512, thread-local:
 value: <1 tl @0> (size=512,offset=0): f32[]
allocation 1: size 1024, parameter 0, shape |f32[256]| at ShapeIndex {}:
 value: <2 param.0 @0> (size=1024,offset=0): f32[256]
allocation 2: size 7000, preallocated-temp:
 value: <3 b @0> (size=2000,offset=0): f32[500]
 value: <4 c @0> (size=3000,offset=2000): f32[750]
 value: <5 while.1{2} (phi) @0> (size=4000,offset=3000): f32[1000]
 value: <6 e @0> (size=4000,offset=3000): f32[1000]
allocation 3: size 9000, color 1, preallocated-temp:
 value: <7 v @1> (size=9000,offset=0): f32[2250]
"""
    ranges = """HloLiveRange (max 9):
  InstructionSequence:
    0:param.0
  BufferLiveRange:
    tl{}:0-9
    param.0{}:0-9
    b{}:1-3
    c{}:3-4
    while.1{2}:2-5
    e{}:5-8
    v{}:0-9
  Live ranges at 5 (peak):
    while.1{2}: 4000 bytes (cumulative: 4000 bytes)
    e{}: 4000 bytes (cumulative: 8000 bytes)
"""
    peak = live_peak(ranges, assignment)
    assert (peak.bytes, peak.time) == (1024 + 2000 + 3000 + 4000, 3)
    assert [(b.names, b.bytes) for b in peak.buffers] == [
        (("while.1{2}", "e"), 4000), (("c",), 3000), (("b",), 2000), (("param.0",), 1024)]
    assert peak.buffers[0].start == 2 and peak.buffers[0].end == 8
    assert peak.buffers[-1].kind.startswith("parameter 0")
    assert live_peak(ranges, "BufferAssignment:\n") is None


def test_live_at_reads_the_vmem_held_at_a_point():
    """libtpu's on-chip VMEM (color 1): two values placed one after the other in one slice
    (v1, then v2) are live only over their own ranges; color 0 gives the HBM buffers."""
    assignment = """BufferAssignment:
allocation 0: size 4096, preallocated-temp:
 value: <1 h @0> (size=4096,offset=0): f32[1024]
allocation 1: size 12000, color 1, preallocated-temp:
 value: <2 v1 @0> (size=8000,offset=0): f32[2000]
 value: <3 v2 @0> (size=8000,offset=0): f32[2000]
 value: <4 w @0> (size=4000,offset=8000): f32[1000]
"""
    ranges = """HloLiveRange (max 9):
  BufferLiveRange:
    h{}:2-6
    v1{}:0-4
    v2{}:6-9
    w{}:3-7
"""
    assert [(b.names, b.bytes) for b in live_at(ranges, assignment, 3)] == [
        (("v1",), 8000), (("w",), 4000)]
    assert [b.names for b in live_at(ranges, assignment, 5)] == [("w",)]
    assert [b.names for b in live_at(ranges, assignment, 8)] == [("v2",)]
    assert [b.names for b in live_at(ranges, assignment, 5, color=0)] == [("h",)]


def test_preallocated_temp_bytes_by_memory_space():
    """libtpu's buffer assignment: parameters and constants are not temporaries; the default
    memory's temporaries (HBM) and each other color's (1: VMEM) are counted apart."""
    text = """BufferAssignment:
allocation 0: size 512, thread-local:
 value: <11 reduce_sum.40 @0> (size=512,offset=0): f32[]{:T(128)}
allocation 1: size 33554432, parameter 16, shape |f32[1024,8192]| at ShapeIndex {}, maybe-live-out:
 value: <1045 param.9 @0> (size=33554432,offset=0): f32[1024,8192]{1,0:T(8,128)}
allocation 24: size 512, constant:
allocation 75: size 711770624, preallocated-temp:
 value: <538 broadcast_select_fusion.14 @0> (size=33554432,offset=661225472): f32[8192,1024]
allocation 76: size 108, color 2, preallocated-temp:
allocation 79: size 117440512, color 1, preallocated-temp:
 value: <560 fusion.148 @1> (size=67108864,offset=33554432): f32[8192,2,1024]
"""
    assert preallocated_temp_bytes(text) == {0: 711770624, 1: 117440512, 2: 108}
    assert preallocated_temp_bytes("BufferAssignment:\n") == {}


def test_preallocated_temp_bytes_of_a_compiled_program(tmp_path):
    """The CPU compiler's temporaries are one default-memory allocation: memory_analysis's
    temp bytes (TPU differs, see preallocated_temp_bytes)."""

    def f(x):
        a = jnp.sin(x) @ x
        return (jnp.cos(a) @ x).sum() + a.sum()

    x = jnp.ones((512, 512))
    compiled = jax.jit(f, compiler_options={"xla_dump_to": str(tmp_path),
                                            "xla_dump_hlo_as_text": True}).lower(x).compile()
    temps = dumped_temp_bytes(tmp_path)
    assert temps[0] == memory_stats(compiled)["temp_bytes"] >= x.nbytes


def test_live_range_peak_of_a_compiled_program_is_within_its_allocation(tmp_path):
    """Two temporaries of 1 MiB and 2 MiB live at once beside a 1 MiB argument: XLA's live
    peak counts them all, and memory_analysis's allocation holds at least that."""

    def f(x):
        a = jnp.sin(x) @ x  # materialised: read by a matmul and the add below
        b = jnp.concatenate([jnp.cos(a), a], axis=0) @ x
        return b.sum() + a.sum()

    x = jnp.ones((512, 512))
    compiled = jax.jit(f, compiler_options={"xla_dump_to": str(tmp_path),
                                            "xla_dump_hlo_as_text": True}).lower(x).compile()
    (dump,) = tmp_path.glob("*after_optimizations-live-range.txt")
    peak = live_range_peak(dump.read_text())
    allocation = memory_stats(compiled)["peak_bytes"]
    assert x.nbytes + 2 * x.nbytes <= peak <= allocation


def test_live_peak_of_a_compiled_program(tmp_path):
    """The CPU compiler's dump: the argument and the two temporaries a and b, live at once,
    are in live_peak's buffers; its peak is within memory_analysis's allocation."""

    def f(x):
        a = jnp.sin(x) @ x
        b = jnp.concatenate([jnp.cos(a), a], axis=0) @ x
        return b.sum() + a.sum()

    x = jnp.ones((512, 512))
    compiled = jax.jit(f, compiler_options={"xla_dump_to": str(tmp_path),
                                            "xla_dump_hlo_as_text": True}).lower(x).compile()
    peak = dumped_live_peak(tmp_path)
    assert x.nbytes + 3 * x.nbytes <= peak.bytes <= memory_stats(compiled)["peak_bytes"]
    assert {b.bytes for b in peak.buffers} >= {x.nbytes, 2 * x.nbytes}


# XLA's TPU compiler writes dots as convolutions: a weight gradient contracts its tokens as
# a window (no padding: every tap counts), a batch dim is a window padded by size - 1 on both
# sides (only the taps inside the input count). Asynchronous slices into on-chip memory and
# ConcatBitcast custom calls are DMAs and layout, not kernels.
_TPU_KERNELS = """HloModule m, num_partitions=1

%fused_dw (p0: f32[8,64,16], p1: f32[8,64,32]) -> f32[16,32,1] {
  %p0 = f32[8,64,16]{2,1,0} parameter(0)
  %p1 = f32[8,64,32]{2,1,0} parameter(1)
  ROOT %conv = f32[16,32,1]{1,0,2} convolution(%p0, %p1), window={size=8}, dim_labels=0fb_0io->bf0
}

%fused_padded (q0: f32[3,64,16], q1: f32[3,64,32]) -> f32[16,32,5] {
  %q0 = f32[3,64,16]{2,1,0} parameter(0)
  %q1 = f32[3,64,32]{2,1,0} parameter(1)
  ROOT %conv = f32[16,32,5]{2,1,0} convolution(%q0, %q1), window={size=3 pad=2_2 rhs_reversal=1}, dim_labels=0fb_0io->bf0
}

ENTRY %main (a: f32[8,64,16], b: f32[8,64,32], c: f32[3,64,16], d: f32[3,64,32]) -> (f32[16,32,1], f32[16,32,5]) {
  %a = f32[8,64,16]{2,1,0} parameter(0)
  %b = f32[8,64,32]{2,1,0} parameter(1)
  %c = f32[3,64,16]{2,1,0} parameter(2)
  %d = f32[3,64,32]{2,1,0} parameter(3)
  %s = ((f32[8,64,16]{2,1,0}), f32[1,64,16]{2,1,0}, s32[]) slice-start(%a), slice={[0:1], [0:64], [0:16]}
  %sd = f32[1,64,16]{2,1,0} slice-done(%s)
  %cb = f32[8,64,16]{2,1,0} custom-call(%a), custom_call_target="ConcatBitcast"
  %dw = f32[16,32,1]{1,0,2} fusion(%cb, %b), kind=kOutput, calls=%fused_dw
  %pd = f32[16,32,5]{2,1,0} fusion(%c, %d), kind=kOutput, calls=%fused_padded
  ROOT %t = (f32[16,32,1]{1,0,2}, f32[16,32,5]{2,1,0}) tuple(%dw, %pd)
}
"""


def test_kernel_roofline_of_tpu_dot_convolutions() -> None:
    stats = kernel_stats(_TPU_KERNELS, flop_rate=1e12, hbm_bandwidth=1e11)
    assert stats.kernels == 2
    weight_gradient = 2 * (16 * 32) * 64 * 8
    # Output positions 0..4 of a 3-wide window over 3 inputs padded by 2: 1, 2, 3, 2, 1 taps.
    padded = 2 * (16 * 32) * 64 * (1 + 2 + 3 + 2 + 1)
    assert stats.matmul_flops == weight_gradient + padded


def test_loop_trip_count_follows_the_step_of_an_unrolled_loop() -> None:
    # XLA's TPU compiler unrolls its collective-matmul loops by two: `i += 2` while `i < 8`
    # runs 4 times, not 8.
    text = _loop_module(_COND_LT.replace("constant(7)", "constant(8)")).replace(
        "%one = s32[] constant(1)", "%one = s32[] constant(2)")
    (op,) = collective_stats(text).ops
    assert op.trip_count == 4 and op.trip_count_known
    odd = _loop_module(_COND_LT).replace("%one = s32[] constant(1)", "%one = s32[] constant(2)")
    assert collective_stats(odd).ops[0].trip_count == 4  # i = 0, 2, 4, 6


# A chunk of libtpu's reduce-scatter collective matmul: the matmul fusion reads two 256-column
# chunks of the activation (pad + dynamic-slice in a nested fusion) and hosts the continuation
# of an unrelated all-gather (its operand passed through, its result an output of the fusion).
_CONTINUATION = """
HloModule cm, num_partitions=16

%chunk (c0: s32[], act: bf16[2048,1,4096], c1: s32[]) -> bf16[2048,2,256] {
  %act = bf16[2048,1,4096]{2,1,0} parameter(1)
  %ninf = bf16[] constant(-inf)
  %lo = bf16[2048,2,4096]{2,1,0} pad(%act, %ninf), padding=0_0x0_1x0_0
  %c0 = s32[] parameter(0)
  %z = s32[] constant(0)
  %s0 = bf16[2048,2,256]{2,1,0} dynamic-slice(%lo, %z, %z, %c0), dynamic_slice_sizes={2048,2,256}
  %hi = bf16[2048,2,4096]{2,1,0} pad(%act, %ninf), padding=0_0x1_0x0_0
  %c1 = s32[] parameter(2)
  %s1 = bf16[2048,2,256]{2,1,0} dynamic-slice(%hi, %z, %z, %c1), dynamic_slice_sizes={2048,2,256}
  ROOT %m = bf16[2048,2,256]{2,1,0} maximum(%s0, %s1)
}

%fused_cm (w: bf16[4096,896], g: bf16[2048,896], act: bf16[2048,1,4096], i0: s32[], i1: s32[]) -> (f32[2,256,896], bf16[4096,896], bf16[65536,896]) {
  %act = bf16[2048,1,4096]{2,1,0} parameter(2)
  %i0 = s32[] parameter(3)
  %i1 = s32[] parameter(4)
  %lhs = bf16[2048,2,256]{2,1,0} fusion(%i0, %act, %i1), kind=kLoop, calls=%chunk
  %g = bf16[2048,896]{1,0} parameter(1)
  %dot = f32[2,256,896]{2,1,0} dot(%lhs, %g), lhs_contracting_dims={0}, rhs_contracting_dims={0}
  %w = bf16[4096,896]{1,0} parameter(0)
  %ag = bf16[65536,896]{1,0} all-gather(%w), channel_id=7, replica_groups=[1,16]<=[16], dimensions={0}
  ROOT %t = (f32[2,256,896]{2,1,0}, bf16[4096,896]{1,0}, bf16[65536,896]{1,0}) tuple(%dot, %w, %ag)
}

ENTRY %main (w: bf16[4096,896], g: bf16[2048,896], act: bf16[2048,1,4096], i0: s32[], i1: s32[]) -> (f32[2,256,896], bf16[4096,896], bf16[65536,896]) {
  %w = bf16[4096,896]{1,0} parameter(0)
  %g = bf16[2048,896]{1,0} parameter(1)
  %act = bf16[2048,1,4096]{2,1,0} parameter(2)
  %i0 = s32[] parameter(3)
  %i1 = s32[] parameter(4)
  ROOT %f = (f32[2,256,896]{2,1,0}, bf16[4096,896]{1,0}, bf16[65536,896]{1,0}) fusion(%w, %g, %act, %i0, %i1), kind=kOutput, calls=%fused_cm
}
"""


def test_kernel_roofline_of_a_collective_matmul_chunk() -> None:
    # The chunk reads two 256-column slices of the activation through the nested fusion's pads
    # (1/8 of it), the stationary operand whole, and writes its f32 partial sums; the
    # all-gather's buffers move by DMA (collective_stats prices them), not by this kernel.
    (kernel,) = compiled_kernels(_CONTINUATION)
    bf16, f32 = 2, 4
    read = 2048 * 4096 * bf16 // 8 + 2048 * 896 * bf16 + 2 * 4
    assert kernel.bytes == read + 2 * 256 * 896 * f32
    assert kernel.flops == 2 * (2 * 256 * 896) * 2048


@pytest.mark.parametrize(("src", "dst"), [((None, "a", ("b", "c")), (None, None, "a")),
                                        ((None, ("a", "b"), "c"), (None, None, ("a", "b")))])
def test_reshard_moving_axes_into_a_dim_three_axes_leave(mesh, src, dst) -> None:
    """Axes moving into a dim whose axes are gathered, on three mesh axes: one axis arriving is
    permuted there, then the others are gathered (as with two axes above); two arriving
    (gpt's embedding gradient on 16x8x8) are moved by an all-to-all. CommModel.reshard lists
    the kinds XLA's CPU compiler makes."""
    from hloplan.cost_models import CommModel, load_device_model
    from hloplan.mesh import parse_mesh

    cube = jax.make_mesh((2, 2, 2), ("a", "b", "c"), axis_types=(jax.sharding.AxisType.Auto,) * 3)
    shape = (16, 32, 64)
    compiled = jax.jit(lambda x: jax.lax.with_sharding_constraint(
        x, NamedSharding(cube, P(*dst))) + 1).lower(_put(cube, shape, *src)).compile()
    realised = {op.kind for op in collective_stats(compiled.as_text()).ops}
    comm = CommModel(load_device_model("h100"), parse_mesh("a=2,b=2,c=2"))
    names = {"a": 0, "b": 1, "c": 2}

    def axes(spec):
        return tuple(() if s is None else tuple(names[a] for a in ((s,) if isinstance(s, str)
                                                                   else s)) for s in spec)

    predicted = {kind for kind, _, _ in comm.reshard(shape, 4, axes(src), axes(dst)).collectives}
    assert predicted == realised
    assert ("collective-permute" in realised) == isinstance(dst[2], str)
