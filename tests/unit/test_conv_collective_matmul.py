"""libtpu loops a convolution's kernel gradient reduce-scattered over the devices its images are
split on (a collective matmul, strategies.collective_matmul_time) where its FLOPs per device
reach tpu-v5e's collective-matmul-intensity per byte of one chunk of its partial sums, its
FLOPs counted without the window taps that land in the padding (OpRule.tap_fraction)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import hloplan
from hloplan.cost_models import CommModel, load_device_model
from hloplan.mesh import parse_mesh
from hloplan.op_rules import rule_for, window_taps
from hloplan.strategies import enumerate_strategies


def test_window_taps_leave_out_the_padding():
    # 3x3 "SAME" over 8 positions: the first and last output lose one tap each
    assert window_taps(8, 8, 3, 1, 1) == 22
    assert window_taps(8, 8, 1, 1, 0) == 8
    # stride 2 over 16 positions, padded (0, 1): the last output's third tap is padding
    assert window_taps(16, 8, 3, 2, 0) == 23
    # an input dilated by 2 (a strided convolution's input gradient): taps between elements
    assert window_taps(4, 8, 3, 1, 1, lhs_dilate=2) == 11


def _kernel_gradient(images: int, size: int, channels: int):
    """hloplan's graph and rule of the kernel gradient of a 3x3 "SAME" convolution over
    `images` images of size x size x channels, planned for tpu-v5e on 2x4."""
    import jax
    from jax import lax

    def grad(x, g):
        def conv(w):
            return lax.conv_general_dilated(x, w, (1, 1), "SAME",
                                            dimension_numbers=("NHWC", "HWIO", "NHWC"))
        return jax.vjp(conv, jax.numpy.zeros((3, 3, channels, channels), x.dtype))[1](g)[0]

    shape = jax.ShapeDtypeStruct((images, size, size, channels), "float32")
    exported = jax.export.export(jax.jit(grad), platforms=("tpu",))(shape, shape)
    result = hloplan.compile(bytes(exported.serialize()), "2x4", device="tpu-v5e",
                             mesh_views="off")
    graph = result.state.graph
    (op,) = [op for op in graph.ops if op.name == "stablehlo.convolution"]
    return graph, op, rule_for(graph, op)


@pytest.mark.parametrize("per_device, loops", [(8, False), (9, True)])
def test_a_kernel_gradient_loops_from_the_intensity_of_its_taps_on_the_input(per_device,
                                                                              loops):
    """12 x 12 images, 3x3 "SAME": (34/36)^2 of the taps land on the input. libtpu keeps one
    reduce-scatter at 8 images per device (4,608 FLOPs per byte of a chunk counting every tap,
    4,110 without the padding) and loops at 9 (5,184; 4,624): compiled for v5e:2x4
    (test_libtpu_loops_kernel_gradients below)."""
    graph, op, rule = _kernel_gradient(8 * per_device, 12, 128)
    assert rule.tap_fraction == pytest.approx((34 / 36) ** 2)
    comm = CommModel(load_device_model("tpu-v5e"), parse_mesh("2x4"))
    every = (0, 1)
    operands = [graph.type_of(v) for v in op.operands]
    results = [graph.type_of(v) for v in op.results]
    scattered = [s for s in enumerate_strategies(rule, operands, results, comm.mesh, comm)
                 if s.reduced_axes == every and any(axes == every for axes in s.results[0])]
    assert scattered
    for strategy in scattered:
        kinds = {kind for kind, _, _ in strategy.collectives}
        assert kinds == ({"collective-permute"} if loops else {"reduce-scatter"}), strategy.name
        assert bool(strategy.accumulators) is loops


# The kernel gradient compiled by libtpu for v5e:2x4, the images split over both axes and the
# gradient reduce-scattered over them on its output features: the kinds of its collectives.
_LIBTPU_KERNEL_GRADIENTS = """
import json, sys
import jax, numpy as np
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P
from hloplan.hlo_stats import collective_stats
from hloplan.tpu import parse_topology, topology_devices
devices = topology_devices(parse_topology("v5e:2x4"))
mesh = Mesh(np.array(devices).reshape(2, 4), ("x", "y"), axis_types=(AxisType.Auto,) * 2)
images = NamedSharding(mesh, P(("x", "y"), None, None, None))
kernel = NamedSharding(mesh, P(None, None, None, ("x", "y")))
out = []
for per_device, size, channels in json.loads(sys.argv[1]):
    def grad(x, g):
        conv = lambda w: lax.conv_general_dilated(x, w, (1, 1), "SAME",
                                                  dimension_numbers=("NHWC", "HWIO", "NHWC"))
        return jax.vjp(conv, jax.numpy.zeros((3, 3, channels, channels), x.dtype))[1](g)[0]
    shape = jax.ShapeDtypeStruct((8 * per_device, size, size, channels), "float32")
    compiled = jax.jit(grad, in_shardings=(images, images), out_shardings=kernel).lower(
        shape, shape).compile()
    stats = collective_stats(compiled.as_text(), mesh_axes=[("x", 2), ("y", 4)])
    out.append(sorted({op.kind for op in stats.ops}))
print(json.dumps(out))
"""


@pytest.mark.libtpu
def test_libtpu_loops_kernel_gradients():
    from hloplan.tpu import child_env

    cases = [(8, 12, 128), (9, 12, 128)]
    done = subprocess.run([sys.executable, "-c", _LIBTPU_KERNEL_GRADIENTS, json.dumps(cases)],
                          env=child_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    kinds = json.loads(done.stdout.strip().splitlines()[-1])
    assert kinds == [["reduce-scatter"], ["collective-permute"]]
