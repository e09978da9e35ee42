"""Collectives as XLA's TPU compiler lays them out: the device model's [collectives] table
(one all-gather over all the axes a reshard removes, f32 matmul operands resharded in bf16),
checked against libtpu where it is installed, and hlo_stats
counting an async collective that libtpu spreads over several fusions once."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hloplan.cost_models import CommModel, DeviceModelError, load_device_model
from hloplan.cost_models.hardware import _load_text
from hloplan.graph import Graph, Op, TensorType, Value
from hloplan.hlo_stats import collective_stats
from hloplan.mesh import parse_mesh
from hloplan.passes.build_sharding_problem import _ProblemBuilder, reassociated, resharded_type
from hloplan.strategies import OpStrategy

MODEL = """\
name = "toy"
platform = "tpu"
memory = "1GiB"
hbm_bandwidth = 1e10

[flops]
default = 1e9

[[interconnect]]
name = "net"
devices = 0
bandwidth = 100e9
latency = 1e-6
"""


def test_collectives_table_defaults_and_tpu_models():
    toy = _load_text(MODEL, "toy.toml")
    assert (toy.gathers, toy.matmul_input_dtype, toy.reassociate) == ("per-dim", None, False)
    for name in ("tpu-v5e", "tpu-v6e", "tpu-v5p"):
        tpu = load_device_model(name)
        assert (tpu.gathers, tpu.matmul_input_dtype, tpu.reassociate) == ("one", "bf16", True)
    for name in ("cpu", "h100", "toy"):
        other = load_device_model(name)
        assert (other.gathers, other.matmul_input_dtype, other.reassociate) == (
            "per-dim", None, False)
    custom = _load_text(MODEL + '[collectives]\ngathers = "one"\n'
                        'matmul_input_dtype = "bfloat16"\n', "custom.toml")
    assert (custom.gathers, custom.matmul_input_dtype) == ("one", "bf16")


@pytest.mark.parametrize("table, message", [
    ('[collectives]\nstaged = "one"\n', "unknown field 'collectives.staged'"),
    ('[collectives]\ngathers = "staged"\n', "must be one of 'per-dim', 'one'"),
    ("[collectives]\ngathers = true\n", "must be a non-empty string"),
    ('[collectives]\nreassociate = "yes"\n', "must be true or false"),
    ("collectives = 3\n", "must be a table"),
])
def test_collectives_table_errors(table, message):
    with pytest.raises(DeviceModelError, match=message):
        _load_text(table + MODEL if not table.startswith("[") else MODEL + table, "bad.toml")


# (source, destination) layouts of a (512, 2048) f32 tensor on mesh x=2, y=4, and the one
# all-gather libtpu compiles for each (tested against libtpu below).
ONE_GATHER = [
    (((0,), (1,)), ((), ())),  # [x, y] -> replicated: one all-gather over (x, y)
    (((1,), (0,)), ((), ())),  # [y, x]
    (((0, 1), ()), ((), ())),  # [(x, y), -]
    (((1, 0), ()), ((), ())),  # [(y, x), -]
    (((), (0, 1)), ((), ())),  # [-, (x, y)]
]


@pytest.mark.parametrize("src, dst", ONE_GATHER)
def test_one_gather_over_all_removed_axes(src, dst):
    mesh = parse_mesh("x=2,y=4")
    one = CommModel(load_device_model("tpu-v5e"), mesh, staged_gathers=True).reshard(
        (512, 2048), 4, src, dst)
    assert [(kind, axes) for kind, axes, _ in one.collectives] == [("all-gather", (0, 1))]
    assert one.bytes_sent == pytest.approx(7 / 8 * 4 * 512 * 2048)
    assert one.via == ()
    # The partitioner's way (other device models): one all-gather per dim, or staged.
    per_dim = CommModel(load_device_model("h100"), mesh, staged_gathers=True).reshard(
        (512, 2048), 4, src, dst)
    assert len(per_dim.collectives) == 2


# Compiled by libtpu in a child process (as hloplan verify does): the TPU plugin is loaded
# there only, with the environment hloplan.tpu.child_env gives it.
_LIBTPU_GATHERS = """
import json, sys
import jax, numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec
from hloplan.hlo_stats import collective_stats
from hloplan.tpu import parse_topology, topology_devices
devices = topology_devices(parse_topology("v5e:2x4"))
mesh = Mesh(np.array(devices).reshape(2, 4), ("x", "y"), axis_types=(AxisType.Auto,) * 2)
out = []
for src in json.loads(sys.argv[1]):
    spec = PartitionSpec(*(tuple("xy"[a] for a in axes) or None for axes in src))
    compiled = jax.jit(lambda w: w * 2, in_shardings=NamedSharding(mesh, spec),
                       out_shardings=NamedSharding(mesh, PartitionSpec())).lower(
        jax.ShapeDtypeStruct((512, 2048), np.float32)).compile()
    stats = collective_stats(compiled.as_text(), mesh_axes=[("x", 2), ("y", 4)])
    out.append([[op.kind, sorted(op.axes), op.total_bytes_sent] for op in stats.ops])
print(json.dumps(out))
"""


@pytest.mark.libtpu
def test_one_gather_is_what_libtpu_compiles():
    import json
    import subprocess
    import sys

    from hloplan.tpu import child_env

    sources = [src for src, _ in ONE_GATHER]
    done = subprocess.run([sys.executable, "-c", _LIBTPU_GATHERS, json.dumps(sources)],
                          env=child_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    for ops in json.loads(done.stdout.strip().splitlines()[-1]):
        assert [(kind, axes) for kind, axes, _ in ops] == [("all-gather", ["x", "y"])]
        assert ops[0][2] == pytest.approx(7 / 8 * 4 * 512 * 2048)


# Reshards of a (16, 128, 2048) f32 value that move one axis out of a dim split over (x, y)
# while gathering the other, or keep only the minor axis, each constrained as hloplan emits it.
_LIBTPU_RESHARDS = """
import json, sys
import jax, numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec
from hloplan.hlo_stats import collective_stats
from hloplan.tpu import parse_topology, topology_devices
devices = topology_devices(parse_topology("v5e:2x4"))
mesh = Mesh(np.array(devices).reshape(2, 4), ("x", "y"), axis_types=(AxisType.Auto,) * 2)
def spec(layout):
    return NamedSharding(mesh, PartitionSpec(*(tuple("xy"[a] for a in axes) or None
                                               for axes in layout)))
out = []
for src, dst in json.loads(sys.argv[1]):
    compiled = jax.jit(lambda w: jax.lax.with_sharding_constraint(w, spec(dst)) + 1,
                       in_shardings=spec(src)).lower(
        jax.ShapeDtypeStruct((16, 128, 2048), np.float32)).compile()
    stats = collective_stats(compiled.as_text(), mesh_axes=[("x", 2), ("y", 4)])
    out.append([[op.kind, sorted(op.axes), op.total_bytes_sent] for op in stats.ops])
print(json.dumps(out))
"""
XY = ((), (), (0, 1))  # [-, -, (x, y)]
MOVED_OR_KEPT = [(XY, ((0,), (), ())), (XY, ((1,), (), ())), (XY, ((), (), (1,))),
                 (((0, 1), (), ()), ((1,), (), ())),
                 # x moving into the dim y leaves: a permute, then y gathered (no all-to-all)
                 (((), (1,), (0,)), ((), (0,), ())), (((1,), (0,), ()), ((0,), (), ())),
                 # y moving into the dim x leaves: x gathered, then y moved by an all-to-all
                 (((), (0,), (1,)), ((), (1,), ()))]


@pytest.mark.libtpu
def test_axis_moved_or_kept_while_gathering_the_other_as_libtpu_compiles():
    import json
    import subprocess
    import sys

    from hloplan.tpu import child_env

    done = subprocess.run([sys.executable, "-c", _LIBTPU_RESHARDS, json.dumps(MOVED_OR_KEPT)],
                          env=child_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    comm = CommModel(load_device_model("tpu-v5e"), parse_mesh("x=2,y=4"))
    for (src, dst), ops in zip(MOVED_OR_KEPT, json.loads(done.stdout.strip().splitlines()[-1]),
                               strict=True):
        predicted = comm.reshard((16, 128, 2048), 4, src, dst).collectives
        assert [(kind, ["xy"[a] for a in axes], sent) for kind, axes, sent in predicted] == [
            (kind, axes, pytest.approx(sent)) for kind, axes, sent in ops]


def _dot(precision: str | None = None) -> Op:
    attrs = {"precision": precision} if precision else {}
    return Op(index=3, name="stablehlo.dot_general", operands=(0, 1), results=(2,), attrs=attrs)


def test_matmul_operands_reshard_in_bf16_on_tpu():
    f32 = TensorType((256, 512), "f32")
    tpu, h100 = load_device_model("tpu-v5e"), load_device_model("h100")
    assert resharded_type(f32, _dot(), tpu) == TensorType((256, 512), "bf16")
    default = "[#stablehlo<precision DEFAULT>, #stablehlo<precision DEFAULT>]"
    assert resharded_type(f32, _dot(default), tpu).dtype == "bf16"
    # Multi-pass precision keeps f32 operands; other platforms, other ops, other dtypes as is.
    highest = "[#stablehlo<precision HIGHEST>, #stablehlo<precision DEFAULT>]"
    assert resharded_type(f32, _dot(highest), tpu) == f32
    assert resharded_type(f32, _dot(), h100) == f32
    add = Op(index=3, name="stablehlo.add", operands=(0, 1), results=(2,))
    assert resharded_type(f32, add, tpu) == f32
    s32 = TensorType((256, 512), "s32")
    assert resharded_type(s32, _dot(), tpu) == s32


@pytest.mark.parametrize("reader, narrowed", [("stablehlo.dot_general", True),
                                              ("stablehlo.add", False)])
def test_matmul_operands_through_a_transpose(reader, narrowed):
    """A weight transposed before its matmul (Flax GPT-2's kernel.T) is gathered in bf16 too."""
    f32 = TensorType((256, 512), "f32")
    graph = Graph()
    transpose = Op(index=0, name="stablehlo.transpose", operands=(0,), results=(1,))
    graph.ops += [transpose, Op(index=1, name=reader, operands=(1, 2), results=(3,))]
    graph.values += [Value(id=i, type=f32, producer=0, result_index=0) for i in range(4)]
    graph.values[1].users = [1]
    got = resharded_type(f32, transpose, load_device_model("tpu-v5e"), graph)
    assert got.dtype == ("bf16" if narrowed else "f32")
    assert resharded_type(f32, transpose, load_device_model("tpu-v5e")) == f32  # no graph


def test_vector_product_operands_reshard_as_they_are():
    """A dot_general an operand of which has only batch and contracting dims (keras_moe's
    `bsed,bse->bsd`) is a multiply and a reduction in libtpu's loop fusion: no bf16 operands."""
    outs, combine = TensorType((2, 128, 8, 1024), "f32"), TensorType((2, 128, 8), "f32")
    graph = Graph()
    attrs = {"lhs_batch": (0, 1), "rhs_batch": (0, 1), "lhs_contracting": (2,),
             "rhs_contracting": (2,)}
    dot = Op(index=0, name="stablehlo.dot_general", operands=(0, 1), results=(2,), attrs=attrs)
    graph.ops.append(dot)
    graph.values += [Value(id=i, type=t, producer=0, result_index=0)
                     for i, t in enumerate((outs, combine, TensorType((2, 128, 1024), "f32")))]
    tpu = load_device_model("tpu-v5e")
    assert resharded_type(outs, dot, tpu, graph) == outs
    assert resharded_type(combine, dot, tpu, graph) == combine
    # With a free dim on both sides (the experts' own matmuls) the operands go in bf16.
    graph.values[1].type = TensorType((2, 128, 8, 16), "f32")
    assert resharded_type(outs, dot, tpu, graph).dtype == "bf16"


def test_outer_product_operands_reshard_as_they_are():
    """A dot_general that contracts nothing (keras_moe's gradient of its experts' outputs,
    `[b, s, d] x [b, s, e] -> [b, s, d, e]`) is a multiply in a loop fusion: libtpu gathers
    its `[b, s, d]` in f32 (v5e:16x16)."""
    grad, combine = TensorType((2, 128, 1024), "f32"), TensorType((2, 128, 8), "f32")
    graph = Graph()
    attrs = {"lhs_batch": (0, 1), "rhs_batch": (0, 1), "lhs_contracting": (),
             "rhs_contracting": ()}
    dot = Op(index=0, name="stablehlo.dot_general", operands=(0, 1), results=(2,), attrs=attrs)
    graph.ops.append(dot)
    graph.values += [Value(id=i, type=t, producer=0, result_index=0) for i, t in
                     enumerate((grad, combine, TensorType((2, 128, 1024, 8), "f32")))]
    tpu = load_device_model("tpu-v5e")
    assert resharded_type(grad, dot, tpu, graph) == grad
    assert resharded_type(combine, dot, tpu, graph) == combine
    # A batched matmul (contracting d against a free dim on each side): bf16 operands.
    dot.attrs.update(lhs_contracting=(3,), rhs_contracting=(2,))
    graph.values[0].type = TensorType((2, 128, 8, 1024), "f32")
    graph.values[1].type = TensorType((2, 128, 1024, 16), "f32")
    assert resharded_type(graph.values[0].type, dot, tpu, graph).dtype == "bf16"


# One async all-gather that libtpu overlaps with two compute fusions: the start fusion holds it,
# a continuation fusion a copy (same channel, async_collective_fusion_config); another
# all-gather on its own channel.
CONTINUED = """\
HloModule m, num_partitions=8

%start_comp (p0: bf16[32,64]) -> (bf16[32,64], bf16[64,64]) {
  %p0 = bf16[32,64]{1,0} parameter(0)
  %all-gather.1 = bf16[64,64]{1,0} all-gather(%p0), channel_id=3, replica_groups=[4,2]<=[2,4]T(1,0), dimensions={0}, use_global_device_ids=true, backend_config={"async_collective_fusion_config":{"flag_start":"-1","flag_end":"-1"}}
  ROOT %cc.1 = (bf16[32,64]{1,0}, bf16[64,64]{1,0}) custom-call(%all-gather.1), custom_call_target="AsyncCollectiveStart"
}

%step_comp (q0: bf16[32,64], q1: f32[16]) -> (bf16[64,64], f32[16]) {
  %q0 = bf16[32,64]{1,0} parameter(0)
  %q1 = f32[16]{0} parameter(1)
  %all-gather.2 = bf16[64,64]{1,0} all-gather(%q0), channel_id=3, replica_groups=[4,2]<=[2,4]T(1,0), dimensions={0}, use_global_device_ids=true, backend_config={"async_collective_fusion_config":{"flag_start":"2","flag_end":"8"}}
  %neg = f32[16]{0} negate(%q1)
  ROOT %t = (bf16[64,64]{1,0}, f32[16]{0}) tuple(%all-gather.2, %neg)
}

ENTRY %main (x: bf16[32,64], y: bf16[32,64], z: f32[16]) -> (bf16[64,64], bf16[64,64], f32[16]) {
  %x = bf16[32,64]{1,0} parameter(0)
  %y = bf16[32,64]{1,0} parameter(1)
  %z = f32[16]{0} parameter(2)
  %start = (bf16[32,64]{1,0}, bf16[64,64]{1,0}) fusion(%x), kind=kCustom, calls=%start_comp
  %gte0 = bf16[32,64]{1,0} get-tuple-element(%start), index=0
  %step = (bf16[64,64]{1,0}, f32[16]{0}) fusion(%gte0, %z), kind=kCustom, calls=%step_comp
  %g = bf16[64,64]{1,0} get-tuple-element(%step), index=0
  %n = f32[16]{0} get-tuple-element(%step), index=1
  %other = bf16[64,64]{1,0} all-gather(%y), channel_id=5, replica_groups=[4,2]<=[2,4]T(1,0), dimensions={0}, use_global_device_ids=true
  ROOT %out = (bf16[64,64]{1,0}, bf16[64,64]{1,0}, f32[16]{0}) tuple(%g, %other, %n)
}
"""


def test_async_collective_in_continuation_fusions_counts_once():
    stats = collective_stats(CONTINUED, mesh_axes=[("x", 2), ("y", 4)])
    assert [(op.kind, op.axes) for op in stats.ops] == [("all-gather", ("x",))] * 2
    assert stats.total_bytes == pytest.approx(2 * 0.5 * 64 * 64 * 2)


def test_async_collective_continued_in_a_loop_counts_at_its_start():
    # The continuation sits in a 4-trip loop body (a collective matmul's) that the all-gather,
    # started before the loop, spans: one all-gather per step, not four.
    looped = CONTINUED.replace("ENTRY %main", """%body (b: (s32[], bf16[32,64], f32[16])) -> (s32[], bf16[32,64], f32[16]) {
  %b = (s32[], bf16[32,64]{1,0}, f32[16]{0}) parameter(0)
  %i = s32[] get-tuple-element(%b), index=0
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  %q = bf16[32,64]{1,0} get-tuple-element(%b), index=1
  %v = f32[16]{0} get-tuple-element(%b), index=2
  %step = (bf16[64,64]{1,0}, f32[16]{0}) fusion(%q, %v), kind=kCustom, calls=%step_comp
  %n = f32[16]{0} get-tuple-element(%step), index=1
  ROOT %r = (s32[], bf16[32,64]{1,0}, f32[16]{0}) tuple(%next, %q, %n)
}

%cond (c: (s32[], bf16[32,64], f32[16])) -> pred[] {
  %c = (s32[], bf16[32,64]{1,0}, f32[16]{0}) parameter(0)
  %ci = s32[] get-tuple-element(%c), index=0
  %lim = s32[] constant(4)
  ROOT %lt = pred[] compare(%ci, %lim), direction=LT
}

ENTRY %main""").replace(
        "  %step = (bf16[64,64]{1,0}, f32[16]{0}) fusion(%gte0, %z), kind=kCustom, calls=%step_comp\n"
        "  %g = bf16[64,64]{1,0} get-tuple-element(%step), index=0\n"
        "  %n = f32[16]{0} get-tuple-element(%step), index=1\n",
        "  %c0 = s32[] constant(0)\n"
        "  %init = (s32[], bf16[32,64]{1,0}, f32[16]{0}) tuple(%c0, %gte0, %z)\n"
        "  %w = (s32[], bf16[32,64]{1,0}, f32[16]{0}) while(%init), condition=%cond, body=%body\n"
        "  %g = bf16[64,64]{1,0} get-tuple-element(%start), index=1\n"
        "  %n = f32[16]{0} get-tuple-element(%w), index=2\n")
    assert "while(" in looped
    stats = collective_stats(looped, mesh_axes=[("x", 2), ("y", 4)])
    assert [(op.kind, op.axes, op.trip_count) for op in stats.ops] == [
        ("all-gather", ("x",), 1)] * 2


def _sum_of_two_matmuls(second_layout, second_reader=None):
    """%2 = dot(...) and %3 = dot(...), each ending in a reduce-scatter over x, read by
    %4 = add(%2, %3) (and `second_reader` too, if given)."""
    graph = Graph()
    f32 = TensorType((64, 64), "f32")
    for index in range(5):
        name = {2: "stablehlo.dot_general", 3: "stablehlo.dot_general", 4: "stablehlo.add"}.get(
            index, "arg")
        operands = {2: (0, 1), 3: (0, 1), 4: (2, 3)}.get(index, ())
        graph.ops.append(Op(index=index, name=name, operands=operands, results=(index,)))
        graph.values.append(Value(id=index, type=f32, producer=index, result_index=0))
    graph.values[2].users = [4]
    graph.values[3].users = [4] + ([second_reader] if second_reader is not None else [])
    layout = ((0,), ())
    scatter = (("reduce-scatter", "x", 1024.0),)
    chosen = {
        0: OpStrategy(results=(((), ()),), operands=()),
        1: OpStrategy(results=(((), ()),), operands=()),
        2: OpStrategy(results=(layout,), operands=((), ()), collectives=scatter),
        3: OpStrategy(results=(second_layout,), operands=((), ()), collectives=scatter),
        4: OpStrategy(results=(layout,), operands=(layout, layout)),
    }
    return SimpleNamespace(
        graph=graph, space=SimpleNamespace(strategies=chosen), chosen=chosen.__getitem__,
        options=SimpleNamespace(device=load_device_model("tpu-v5e")))


def test_reassociated_collectives():
    """add(reduce-scatter(a), reduce-scatter(b)) is one reduce-scatter of a + b on TPU models,
    only where the add alone reads both, in the layouts they are made in."""
    state = _sum_of_two_matmuls(((0,), ()))
    assert reassociated(state) == {(3, "reduce-scatter", "x")}
    assert reassociated(_sum_of_two_matmuls(((), (0,)))) == set()  # resharded for the add
    assert reassociated(_sum_of_two_matmuls(((0,), ()), second_reader=1)) == set()
    state.options.device = load_device_model("h100")
    assert reassociated(state) == set()


def test_reassociated_through_a_transpose():
    """dot -> transpose -> add: XLA folds the transpose into the matmul's output layout, so the
    reduce-scatter still meets the add."""
    state = _sum_of_two_matmuls(((0,), ()))
    graph, chosen = state.graph, state.space.strategies
    f32 = TensorType((64, 64), "f32")
    # %5 = transpose(%3); the add reads %5 instead of %3.
    graph.ops.append(Op(index=5, name="stablehlo.transpose", operands=(3,), results=(5,)))
    graph.values.append(Value(id=5, type=f32, producer=5, result_index=0, users=[4]))
    graph.values[3].users = [5]
    graph.ops[4] = Op(index=4, name="stablehlo.add", operands=(2, 5), results=(4,))
    chosen[3] = OpStrategy(results=(((), (0,)),), operands=((), ()),
                           collectives=(("reduce-scatter", "x", 1024.0),))
    chosen[5] = OpStrategy(results=(((0,), ()),), operands=(((), (0,)),))
    assert reassociated(state) == {(3, "reduce-scatter", "x")}
    chosen[5] = OpStrategy(results=(((0,), ()),), operands=(((), ()),))  # resharded on the way
    assert reassociated(state) == set()


def test_solver_prices_a_reassociated_pair_once():
    """_ProblemBuilder on a TPU model: the second producer's strategies drop the collective an
    add folds, and an edge from the first charges it back where the pair does not fold (no
    collective on the first side, or a different layout)."""
    state = _sum_of_two_matmuls(((0,), ()))
    layout, other = ((0,), ()), ((), (0,))
    scatter = (("reduce-scatter", "x", 1024.0),)
    first = [OpStrategy(results=(layout,), operands=((), ()), collectives=scatter,
                        communication=3e-6),
             OpStrategy(results=(layout,), operands=((), ())),
             OpStrategy(results=(other,), operands=((), ()), collectives=scatter,
                        communication=3e-6)]
    second = [OpStrategy(results=(layout,), operands=((), ()), collectives=scatter,
                         communication=2e-6),
              OpStrategy(results=(layout,), operands=((), ()))]
    ids: dict = {}
    builder = SimpleNamespace(
        comm=SimpleNamespace(model=load_device_model("tpu-v5e")), graph=state.graph,
        space=SimpleNamespace(strategies={2: first, 3: second, 4: [OpStrategy((), ())]},
                              node_of={2: 0, 3: 1, 4: 2}),
        tie_root={4: 2}, list_of={}, _list_id=lambda key: ids.setdefault(key, len(ids)))
    folds = _ProblemBuilder._reassociations(builder)
    assert [(a, b) for a, b, _ in folds] == [(2, 3)]
    assert [s.communication for s in builder.space.strategies[3]] == [0.0, 0.0]
    (edge,) = _ProblemBuilder._fold_edges(builder, folds)
    assert (edge.src, edge.dst) == (0, 1)
    assert edge.costs == ((0.0, 0.0), (2e-6, 0.0), (2e-6, 0.0))
    # Not on other device models, nor where the add does not follow the first producer.
    builder.comm.model = load_device_model("h100")
    assert _ProblemBuilder._reassociations(builder) == []
    builder.comm.model, builder.tie_root = load_device_model("tpu-v5e"), {}
    builder.space.strategies[3] = second
    assert _ProblemBuilder._reassociations(builder) == []
