"""Which reduce-scattered dots libtpu loops (collective matmul): tpu-v5e's
`collective-matmul-intensity` (the dot's FLOPs per byte of one ring step's chunk of partial sums)
and `collective-matmul-side` (a dot replicated over the axes it does not reduce loops over the
whole slice or at most its shorter side), checked against libtpu where it is installed."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hloplan.cost_models import CommModel, load_device_model
from hloplan.cost_models.hardware import _load_text
from hloplan.graph import TensorType
from hloplan.mesh import parse_mesh
from hloplan.op_rules import Factor, OpRule
from hloplan.strategies import enumerate_strategies

D, F = 1024, 4096  # dW[D, F] = X[t, D]^T G[t, F], f32


def _loops(mesh_text: str, reduced: int, other: int | None, tokens_per_device: int,
           model=None) -> bool:
    """Whether the planner's strategy for dW, t sharded over mesh axis `reduced` (and D over
    `other`, None: replicated there) and dW reduce-scattered over `reduced` onto F, loops."""
    mesh = parse_mesh(mesh_text)
    comm = CommModel(model or load_device_model("tpu-v5e"), mesh)
    tokens = tokens_per_device * mesh.axis_sizes[reduced]
    rule = OpRule(factors=(Factor(tokens, "reduce"), Factor(D), Factor(F)),
                  operands=(((0,), (1,)), ((0,), (2,))), results=(((1,), (2,)),),
                  flops=2.0 * tokens * D * F, matmul=(((1,), 1), ((0,), 1), ((2,), 1)))
    d_axes = (other,) if other is not None else ()
    (strategy,) = [
        s for s in enumerate_strategies(
            rule, [TensorType((tokens, D), "f32"), TensorType((tokens, F), "f32")],
            [TensorType((D, F), "f32")], mesh, comm)
        if s.reduced_axes == (reduced,) and s.results == ((d_axes, (reduced,)),)
        and s.operands == (((reduced,), d_axes), ((reduced,), ()))]
    return any(kind == "collective-permute" for kind, _, _ in strategy.collectives)


# (mesh, reduced axis, other axis, tokens per device): (a v5e slice, the planner's mesh of it).
CASES = [
    ("4x8", 1, 0, 1024),  # t n = 8192: 4,096 FLOP per chunk byte, one matmul
    ("4x8", 1, 0, 1152),  # 4,608: looped
    ("4x8", 0, 1, 2048),  # over x (4 devices): 4,096
    ("4x8", 0, 1, 2304),  # 4,608
    ("8", 0, None, 1024),  # v5e:2x4, every chip
    ("8", 0, None, 1088),
    ("4x8", 1, None, 8192),  # replicated over x: 8 devices of 4x8 never loop
    ("4x8", 0, None, 8192),  # but 4 do
]


def test_intensity_decides_where_a_dot_loops():
    looped = [_loops(*case) for case in CASES]
    assert looped == [False, True, False, True, False, True, False, True]
    # The same dot's partial sums, 4 MiB over 8 devices of v5e:4x8 at 1,024 tokens per device
    # (haiku's and hf_bart's MLP weight gradients): the estimated loop's time alone loops it.
    without = _load_text(_shipped_without("collective-matmul-intensity",
                                          "collective-matmul-side"), "v5e.toml")
    assert _loops("4x8", 1, 0, 1024, without) and _loops("4x8", 1, None, 8192, without)


def _shipped_without(*fields: str) -> str:
    from importlib.resources import files

    lines = files("hloplan.cost_models").joinpath("tpu-v5e.toml").read_text().splitlines()
    return "\n".join(line for line in lines if not line.startswith(fields)) + "\n"


def test_slices_where_a_replicated_dot_loops():
    v5e = load_device_model("tpu-v5e")
    for devices, group, loops in ((32, 4, True), (32, 8, False), (32, 16, False),
                                  (32, 32, True), (16, 8, False), (16, 16, True),
                                  (8, 4, True), (8, 8, True), (64, 8, True), (64, 16, False),
                                  (128, 8, True), (128, 16, False), (256, 16, True),
                                  (256, 32, False)):
        assert v5e.collective_matmul_spans(devices, group, replicated=True) is loops
        assert v5e.collective_matmul_spans(devices, group, replicated=False)
    for name in ("tpu-v6e", "tpu-v5p"):
        assert load_device_model(name).collective_matmul_spans(32, 8, replicated=True)


def test_collective_matmul_fields_parse():
    base = ('name = "t"\nplatform = "tpu"\nmemory = "1GiB"\nhbm_bandwidth = 1e10\n'
            '[flops]\ndefault = 1e12\n[[interconnect]]\nname = "ici"\ndevices = 0\n'
            'bandwidth = 1e10\nlatency = 1e-6\n[collectives]\n')
    model = _load_text(base + "collective-matmul-intensity = 100\n"
                       "collective-matmul-side = true\n", "t.toml")
    assert model.collective_matmul_intensity == 100.0 and model.collective_matmul_side
    plain = _load_text(base, "t.toml")
    assert plain.collective_matmul_intensity is None and not plain.collective_matmul_side
    with pytest.raises(Exception, match="must be a number"):
        _load_text(base + 'collective-matmul-intensity = "high"\n', "t.toml")
    with pytest.raises(Exception, match="must be true or false"):
        _load_text(base + 'collective-matmul-side = "yes"\n', "t.toml")


_LIBTPU_LOOPS = r"""
import json, sys
import numpy as np, jax, jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from hloplan.tpu import parse_topology, topology_devices

D, F = 1024, 4096
out = []
for topology, mesh_text, reduced, other, tokens in json.loads(sys.argv[1]):
    shape = tuple(int(s) for s in mesh_text.split("x"))
    names = ("x", "y")[:len(shape)]
    mesh = Mesh(np.array(topology_devices(parse_topology(topology))).reshape(shape), names)
    red, oth = names[reduced], (names[other] if other is not None else None)
    t = tokens * shape[reduced]
    x = jax.ShapeDtypeStruct((t, D), jnp.float32, sharding=NamedSharding(mesh, P(red, oth)))
    g = jax.ShapeDtypeStruct((t, F), jnp.float32, sharding=NamedSharding(mesh, P(red, None)))
    text = jax.jit(lambda a, b: jnp.einsum("td,tf->df", a, b),
                   out_shardings=NamedSharding(mesh, P(oth, red))).lower(x, g).compile().as_text()
    out.append("collective-permute" in text)
print(json.dumps(out))
"""


@pytest.mark.libtpu
def test_libtpu_loops_where_the_planner_does():
    from hloplan.tpu import child_env

    topologies = {"4x8": "v5e:4x8", "8": "v5e:2x4"}
    cases = [(topologies[mesh], mesh, reduced, other, tokens)
             for mesh, reduced, other, tokens in CASES]
    done = subprocess.run([sys.executable, "-c", _LIBTPU_LOOPS, json.dumps(cases)],
                          env=child_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    compiled = json.loads(done.stdout.strip().splitlines()[-1])
    assert compiled == [_loops(*case) for case in CASES]


_LIBTPU_ASYNC = r"""
import json, sys
import numpy as np, jax, jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from hloplan.tpu import parse_topology, topology_devices

out = []
for topology, shape in json.loads(sys.argv[1]):
    mesh = Mesh(np.array(topology_devices(parse_topology(topology))).reshape(shape), ("x", "y"))
    t = 4096 * shape[1]  # a weight gradient reduce-scattered over y: looped
    x = jax.ShapeDtypeStruct((t, 1024), jnp.float32, sharding=NamedSharding(mesh, P("y", "x")))
    g = jax.ShapeDtypeStruct((t, 4096), jnp.float32, sharding=NamedSharding(mesh, P("y", None)))
    text = jax.jit(lambda a, b: jnp.einsum("td,tf->df", a, b),
                   out_shardings=NamedSharding(mesh, P("x", "y"))).lower(x, g).compile().as_text()
    out.append(["collective-permute-start(" in text, " collective-permute(" in text])
print(json.dumps(out))
"""


@pytest.mark.libtpu
def test_libtpu_runs_loop_sends_asynchronously_where_the_model_hides_them():
    """libtpu's loop sends a collective-permute-start / done pair per chunk (kernels between:
    hideable) on v5e slices of up to 16 chips, and plain collective-permutes on larger ones,
    as tpu-v5e's `collective-matmul-async-devices = 16` says."""
    from hloplan.tpu import child_env

    slices = [("v5e:2x4", [2, 4]), ("v5e:4x4", [4, 4]), ("v5e:4x8", [4, 8])]
    done = subprocess.run([sys.executable, "-c", _LIBTPU_ASYNC, json.dumps(slices)],
                          env=child_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    compiled = json.loads(done.stdout.strip().splitlines()[-1])
    v5e = load_device_model("tpu-v5e")
    for (_, shape), (asynchronous, synchronous) in zip(slices, compiled, strict=True):
        hidden = v5e.collective_matmul_overlap_on(shape[0] * shape[1]) > 0
        assert (asynchronous, synchronous) == (hidden, not hidden), shape


_LIBTPU_DEVICE_ORDER = r"""
import json, sys
import numpy as np, jax, jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from hloplan.tpu import parse_topology, topology_devices

devices = topology_devices(parse_topology("v5e:2x4"))
out = []
for ids in json.loads(sys.argv[1]):
    mesh = Mesh(np.array([devices[i] for i in ids]), ("y",))
    g = jax.ShapeDtypeStruct((4, 128, 32000), jnp.bfloat16,
                             sharding=NamedSharding(mesh, P(None, None, "y")))
    w = jax.ShapeDtypeStruct((1024, 32000), jnp.float32, sharding=NamedSharding(mesh, P(None, "y")))
    text = jax.jit(lambda a, b: jnp.einsum("bsv,dv->bsd", a, b),
                   out_shardings=NamedSharding(mesh, P("y"))).lower(g, w).compile().as_text()
    out.append("collective-permute" in text)
print(json.dumps(out))
"""


@pytest.mark.libtpu
def test_libtpu_loops_a_four_device_dot_by_the_order_of_its_devices():
    """A program on 4 of v5e:2x4's 8 chips (a pipeline stage's submesh): the same
    reduce-scattered dot loops on devices 0-3 and on 4-7 ordered 5, 4, 7, 6, but compiles to
    one reduce-scatter on 4-7 in ascending order (docs/tpu.md, pipelined plans of the corpus:
    the second stage's tasks do not loop where the plan lists loops)."""
    from hloplan.tpu import child_env

    orders = [[0, 1, 2, 3], [5, 4, 7, 6], [4, 5, 6, 7], [2, 3, 4, 5]]
    done = subprocess.run([sys.executable, "-c", _LIBTPU_DEVICE_ORDER, json.dumps(orders)],
                          env=child_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [True, True, False, False]
