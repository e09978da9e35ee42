"""The copy of a convolution's input that libtpu's collective-matmul loop carries: a kernel
gradient reduce-scattered onto its input channels carries the activation in bf16 with the
images or the channels in the lanes, whichever pads less (hloplan.tpu_buffers
conv_loop_operand_dims), and build-sharding-problem holds that copy's tiled bytes where the
loop runs. The layouts are libtpu's (0.0.42, v5e:2x4), checked against libtpu where it is
installed; planning runs on abstract shapes, no libtpu needed."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from jax import export, lax

from hloplan.compiler import compile_bytes, make_options
from hloplan.solver.evaluate import point_contents
from hloplan.solver.liveness import accumulator_spans, first_live_points
from hloplan.solver.problem import Solution
from hloplan.strategies import local_shape
from hloplan.tpu_buffers import conv_loop_operand_dims, conv_loop_operand_elements, minor_dims

# (images per device, image side, input channels, output channels, stride) of a 3x3 kernel
# gradient, images sharded over the 8 chips of v5e:2x4 and the gradient reduce-scattered onto
# its input channels (chunks of channels / 8): the dim libtpu's loop carries minor (0: the
# images, 3: the channels), from its compiled HLO (the while loop's first tuple element).
CASES = [
    ((8, 64, 64, 128, 2), 0),    # linen_resnet's second block: 8 images, chunks of 8 channels
    ((8, 64, 128, 128, 1), 3),   # chunks of 16: the channels pad less
    ((16, 32, 64, 128, 2), 0),
    ((8, 16, 256, 256, 1), 3),
    ((32, 16, 256, 512, 2), 0),  # 32 images, chunks of 32: a tie, the images minor
    ((4, 32, 64, 128, 1), 3),    # 4 images pad more than chunks of 8
    ((32, 16, 512, 128, 1), 3),
]


@pytest.mark.parametrize(("case", "minor"), CASES)
def test_loop_copy_layouts(case, minor) -> None:
    images, side, channels, _, _ = case
    shape = (images, side, side, channels)
    assert conv_loop_operand_dims(shape, 0, 3, channels // 8)[0] == minor


def test_loop_copy_bytes() -> None:
    # bf16[8,64,64,64]{0,3,2,1:T(8,128)(2,1)}: the 8 images padded to 128 lanes, 64 MiB.
    assert 2 * conv_loop_operand_elements((8, 64, 64, 64), 0, 3, 8) == 64 << 20
    # bf16[32,16,16,256]{0,3,2,1}: 32 images padded to 128, 16 MiB (v5e:4x8, 32-channel chunks).
    assert 2 * conv_loop_operand_elements((32, 16, 16, 256), 0, 3, 32) == 16 << 20
    # Channels minor, no padding.
    assert conv_loop_operand_elements((8, 32, 32, 128), 0, 3, 16) == 8 * 32 * 32 * 128


def _kernel_gradient(images: int, side: int, channels: int, out: int, stride: int):
    def step(w, x, g):
        def conv(kernel):
            return lax.conv_general_dilated(jax.nn.relu(x), kernel, (stride, stride), "SAME",
                                            dimension_numbers=("NHWC", "HWIO", "NHWC"))

        _, vjp = jax.vjp(conv, w)
        return w - 0.1 * vjp(g)[0]

    f32 = jnp.float32
    args = (jax.ShapeDtypeStruct((3, 3, channels, out), f32),
            jax.ShapeDtypeStruct((images, side, side, channels), f32),
            jax.ShapeDtypeStruct((images, side // stride, side // stride, out), f32))
    return step, args


def _planned_kernel_gradient():
    """linen_resnet's second block's kernel gradient planned for tpu-v5e on 8 devices: the
    compile state, the convolution and its problem node."""
    step, args = _kernel_gradient(64, 64, 64, 128, 2)
    data = export.export(jax.jit(step))(*args).serialize()
    state = compile_bytes(data, "step.jaxexport",
                          make_options("8", device="tpu-v5e", mesh_views="off")).state
    conv = next(op for op in state.graph.ops if op.name == "stablehlo.convolution")
    return state, conv, state.problem.nodes[state.space.node_of[conv.index]]


def test_planner_holds_the_loops_copy_in_its_layout() -> None:
    """linen_resnet's second block on v5e:2x4 (8 images per device, 64 channels, chunks of 8):
    each looped strategy reading the activation sharded over its 8 images holds its loop's
    bf16 copy with the images in the lanes, 64 MiB (4 MiB unpadded)."""
    state, conv, node = _planned_kernel_gradient()
    mesh = state.options.mesh
    checked = 0
    for strategy, held in zip(state.space.strategies[conv.index], node.strategies, strict=True):
        if strategy.copied != 0 or not strategy.accumulators:
            continue
        lhs = local_shape(state.graph.type_of(conv.operands[0]), strategy.operands[0], mesh)
        chunk = local_shape(state.graph.type_of(conv.results[0]), strategy.results[0],
                            mesh)[conv.attrs["output_batch"]]
        assert held.transient == 2 * conv_loop_operand_elements(
            lhs, conv.attrs["input_feature"], conv.attrs["input_batch"], chunk)
        if lhs == (8, 64, 64, 64) and chunk == 8:
            assert held.transient == 64 << 20
            checked += 1
    assert checked


def test_a_padded_relaid_loop_pays_for_its_extra_kernels() -> None:
    """A 3x3 kernel gradient (SAME padding) reduce-scattered over 8 devices: each looped
    strategy costs its kernels beyond the chunk convolutions: per trip (8 / 4) one pass over
    the operand it chunks (the input for a scatter onto input channels, the output gradient
    for one onto output channels) in bf16, and, where the loop relays the input into the
    images-minor layout, three more passes over the input (written in bf16, copied). A
    strategy that does not loop pays nothing more."""
    state, conv, node = _planned_kernel_gradient()
    mesh, model = state.options.mesh, state.options.device
    checked = {"relaid": 0, "moving output gradient": 0, "no loop": 0}
    for strategy, held in zip(state.space.strategies[conv.index], node.strategies, strict=True):
        extra = (held.compute_cost - strategy.compute) * model.hbm_bandwidth
        if not strategy.accumulators:
            assert extra == 0
            checked["no loop"] += 1
            continue
        lhs = local_shape(state.graph.type_of(conv.operands[0]), strategy.operands[0], mesh)
        rhs = local_shape(state.graph.type_of(conv.operands[1]), strategy.operands[1], mesh)
        scattered = [d for d, axes in enumerate(strategy.results[0]) if axes]
        if scattered == [conv.attrs["output_batch"]]:
            chunk = local_shape(state.graph.type_of(conv.results[0]), strategy.results[0],
                                mesh)[conv.attrs["output_batch"]]
            carried = conv_loop_operand_dims(lhs, conv.attrs["input_feature"],
                                             conv.attrs["input_batch"], chunk)
            relaid = carried[0] != minor_dims(lhs)[0]
            assert extra == pytest.approx(2 * math.prod(lhs) * (2 + 3 * relaid))
            checked["relaid"] += relaid
        elif scattered == [conv.attrs["output_feature"]]:
            assert extra == pytest.approx(2 * 2 * math.prod(rhs))
            checked["moving output gradient"] += 1
    assert all(checked.values()), checked


def _three_convolutions(images: int = 64):
    """A step of three 3x3 convolutions (64 channels, 64^2 pixels) with relus between them,
    trained by SGD: its kernel gradients read the relus (and the input) in the backward pass."""
    def conv(x, kernel):
        return lax.conv_general_dilated(x, kernel, (1, 1), "SAME",
                                        dimension_numbers=("NHWC", "HWIO", "NHWC"))

    def step(w1, w2, w3, x):
        def loss(ws):
            h = jax.nn.relu(conv(x, ws[0]))
            h = jax.nn.relu(conv(h, ws[1]))
            return jnp.sum(conv(h, ws[2]) ** 2)

        grads = jax.grad(loss)((w1, w2, w3))
        return tuple(w - 0.1 * g for w, g in zip((w1, w2, w3), grads, strict=True))

    f32 = jnp.float32
    kernel = jax.ShapeDtypeStruct((3, 3, 64, 64), f32)
    return step, (kernel, kernel, kernel, jax.ShapeDtypeStruct((images, 64, 64, 64), f32))


def test_planner_holds_a_relaid_loop_copy_from_the_accumulators() -> None:
    """A kernel-gradient loop carrying its input with the images in the lanes (8 images per
    device on 8 devices, chunks of 8 channels: `bf16[8,64,64,64]{0,3,2,1}`, 64 MiB) reads a
    copy libtpu makes where it allocates the loops' accumulators: the estimate holds that
    copy from the first point that can loop to its own loop, where the loop's transient holds
    it. A loop carrying the channels minor (reduce-scattered onto its output channels) reads
    the activation as it is written: nothing held before it."""
    step, args = _three_convolutions()
    data = export.export(jax.jit(step))(*args).serialize()
    state = compile_bytes(data, "step.jaxexport",
                          make_options("8", device="tpu-v5e", mesh_views="off")).state
    problem, graph, mesh = state.problem, state.graph, state.options.mesh
    made = first_live_points(problem)
    allocated = accumulator_spans(problem, made)[0][1]
    checked = {"relaid": 0, "own layout": 0}
    for conv in (op for op in graph.ops if op.name == "stablehlo.convolution"):
        node = state.space.node_of[conv.index]
        if made[node] <= allocated + 1:
            continue  # no point between the accumulators and this loop
        for k, (strategy, held) in enumerate(zip(state.space.strategies[conv.index],
                                                 problem.nodes[node].strategies, strict=True)):
            if strategy.copied != 0 or not strategy.accumulators:
                continue
            lhs = local_shape(graph.type_of(conv.operands[0]), strategy.operands[0], mesh)
            chunk = local_shape(graph.type_of(conv.results[0]), strategy.results[0],
                                mesh)[conv.attrs["output_batch"]]
            carried = conv_loop_operand_dims(lhs, conv.attrs["input_feature"],
                                             conv.attrs["input_batch"], chunk)
            relaid = carried[0] != minor_dims(lhs)[0]
            choice = list(state.solution.choice)
            choice[node] = k
            before = point_contents(problem, Solution(tuple(choice)), made[node] - 1)
            copies = [h.bytes for h in before
                      if h.kind == "copy" and problem.edges[h.index].dst == node]
            if relaid:
                assert lhs == (8, 64, 64, 64) and held.transient == 64 << 20
                assert copies == [held.transient]
                at_start = point_contents(problem, Solution(tuple(choice)), allocated)
                assert any(h.kind == "copy" and problem.edges[h.index].dst == node
                           for h in at_start)
                checked["relaid"] += 1
            else:
                assert not copies
                checked["own layout"] += 1
    assert checked["relaid"] and checked["own layout"]


_LIBTPU_LOOPS = r"""
import json, re, sys
import numpy as np, jax, jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from hloplan.hlo_stats import compiled_kernels
from hloplan.tpu import parse_topology, topology_devices

mesh = Mesh(np.array(topology_devices(parse_topology("v5e:2x4"))), ("d",))
out = []
for images, side, channels, co, stride in json.loads(sys.argv[1]):
    def step(w, x, g):
        conv = lambda k: lax.conv_general_dilated(jax.nn.relu(x), k, (stride, stride), "SAME",
                                                  dimension_numbers=("NHWC", "HWIO", "NHWC"))
        return w - 0.1 * jax.vjp(conv, w)[1](g)[0]
    ws = NamedSharding(mesh, P(None, None, "d", None))
    batch = NamedSharding(mesh, P("d"))
    n, h = 8 * images, side // stride
    args = (jax.ShapeDtypeStruct((3, 3, channels, co), jnp.float32, sharding=ws),
            jax.ShapeDtypeStruct((n, side, side, channels), jnp.float32, sharding=batch),
            jax.ShapeDtypeStruct((n, h, h, co), jnp.float32, sharding=batch))
    text = jax.jit(step, out_shardings=ws).lower(*args).compile().as_text()
    found = re.search(r"= \(bf16\[[\d,]+\]\{(\d+),", text.partition(" while(")[0].rpartition("\n")[2])
    # The kernels run in each trip that slice and pad the trip's chunks (no convolution).
    pads = sum(k.multiplier for k in compiled_kernels(text) if k.multiplier > 1
               and {"dynamic-slice", "pad"} <= k.opcodes and "convolution" not in k.opcodes)
    out.append([int(found.group(1)) if found else None, pads])
print(json.dumps(out))
"""


@pytest.mark.libtpu
def test_libtpu_carries_the_layout_the_planner_holds() -> None:
    from hloplan.tpu import child_env

    done = subprocess.run([sys.executable, "-c", _LIBTPU_LOOPS,
                           json.dumps([case for case, _ in CASES])],
                          env=child_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert [minor for minor, _ in found] == [minor for _, minor in CASES]
    # Over 8 devices the loop runs 2 trips, each padding its chunks in a kernel of its own
    # (build-sharding-problem _conv_loop_seconds).
    assert [pads for _, pads in found] == [2] * len(CASES)


_LIBTPU_EARLY_COPY = r"""
import glob, json, re, tempfile
import numpy as np, jax, jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from hloplan.tpu import parse_topology, topology_devices

mesh = Mesh(np.array(topology_devices(parse_topology("v5e:2x4"))), ("d",))
conv = lambda x, k: lax.conv_general_dilated(x, k, (1, 1), "SAME",
                                             dimension_numbers=("NHWC", "HWIO", "NHWC"))
def step(w1, w2, w3, x):
    def loss(ws):
        h = jax.nn.relu(conv(x, ws[0]))
        h = jax.nn.relu(conv(h, ws[1]))
        return jnp.sum(conv(h, ws[2]) ** 2)
    grads = jax.grad(loss)((w1, w2, w3))
    return tuple(w - 0.1 * g for w, g in zip((w1, w2, w3), grads))
ws = NamedSharding(mesh, P(None, None, "d", None))
kernel = jax.ShapeDtypeStruct((3, 3, 64, 64), jnp.float32, sharding=ws)
x = jax.ShapeDtypeStruct((64, 64, 64, 64), jnp.float32, sharding=NamedSharding(mesh, P("d")))
with tempfile.TemporaryDirectory() as dump:
    jax.jit(step, out_shardings=(ws, ws, ws)).lower(kernel, kernel, kernel, x).compile(
        {"xla_dump_to": dump, "xla_dump_hlo_as_text": True})
    text = open(glob.glob(dump + "/*after_optimizations.txt")[0]).read()
    ranges = open(glob.glob(dump + "/*after_optimizations-live-range.txt")[0]).read()
position = {name: int(t) for t, name in re.findall(r"^\s+(\d+):(\S+)$", ranges, re.M)}
ends = {name: int(end) for name, end in re.findall(r"^\s+(\S+)\{\}:\d+-(\d+)$", ranges, re.M)}
entry = text[text.index("\nENTRY"):]
allocations = [position[n] for n in re.findall(
    r"%(\S+) = \S+ custom-call\(\), custom_call_target=\"AllocateBuffer\"", entry)]
whiles = sorted(position[n] for n in re.findall(r"%(\S+) = \(.* while\(", entry))
# The copy of the input x (f32; its parameter or that moved on chip) into the images-minor
# bf16 layout of the first kernel gradient's loop.
(copy,) = [n for n, source in re.findall(
    r"%(copy\.\d+) = bf16\[8,64,64,64\]\{0,3,2,1:\S+ copy\(%(\S+)\)", entry)
    if re.search("%" + re.escape(source) + r" = f32\[8,64,64,64\]\S* (parameter|copy-done)\(",
                 entry)]
print(json.dumps([position[copy], ends[copy], allocations, whiles]))
"""


@pytest.mark.libtpu
def test_libtpu_makes_the_relaid_copy_with_the_accumulators() -> None:
    """libtpu (deviceless v5e:2x4) copies the input of a kernel-gradient loop that carries
    the images minor when it allocates the loops' accumulators (its `AllocateBuffer` calls,
    before the first loop) and holds the copy across five other loops (the three forward
    convolutions' and two kernel gradients') until its own: what
    test_planner_holds_a_relaid_loop_copy_from_the_accumulators holds."""
    from hloplan.tpu import child_env

    done = subprocess.run([sys.executable, "-c", _LIBTPU_EARLY_COPY], env=child_env(),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    made, end, allocations, whiles = json.loads(done.stdout.strip().splitlines()[-1])
    assert allocations and whiles
    assert min(allocations) <= made <= max(allocations) < whiles[0]
    # Its last reader moves it on chip for its own loop, the next one.
    assert sum(made < w < end for w in whiles) == 5
