"""Reduce-scatters as libtpu (0.0.42, v5e, v6e and v5p) merges them: with the step's others on
most slices, but none on 4x8 (v5e, v6e) or v5p:2x2x1, nor those over part of v5e:4x4
([combiner] reduce-scatter-apart).
The device model's rule, the planner's pricing of it, and libtpu itself where it is installed."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hloplan.cost_models import CommModel, DeviceModelError, load_device_model
from hloplan.cost_models.hardware import _load_text
from hloplan.mesh import parse_mesh


def test_slices_where_libtpu_merges_no_reduce_scatter() -> None:
    v5e = load_device_model("tpu-v5e")
    # v5e:4x8 merges none; v5e:4x4 none over part of the slice; the others all.
    assert v5e.reduce_scatter_apart(32, 32) and v5e.reduce_scatter_apart(32, 4)
    assert v5e.reduce_scatter_apart(16, 4) and not v5e.reduce_scatter_apart(16, 16)
    for devices, group in ((8, 8), (8, 4), (64, 8), (64, 64), (256, 16), (512, 8)):
        assert not v5e.reduce_scatter_apart(devices, group)
    v6e = load_device_model("tpu-v6e")
    assert v6e.reduce_scatter_apart(32, 32) and not v6e.reduce_scatter_apart(8, 8)
    assert not v6e.reduce_scatter_apart(64, 64)
    v5p = load_device_model("tpu-v5p")
    assert v5p.reduce_scatter_apart(4, 4) and not v5p.reduce_scatter_apart(8, 8)
    assert not v5p.reduce_scatter_apart(32, 8)
    for name in ("h100", "cpu"):
        model = load_device_model(name)
        assert not model.reduce_scatter_apart(32, 32)


def test_reduce_scatter_apart_table_errors() -> None:
    base = load_device_model("toy")
    assert base.unmerged_reduce_scatters == {}
    text = ('name = "t"\nplatform = "tpu"\nmemory = "1GiB"\nhbm_bandwidth = 1e10\n'
            'tpu_topology = "v5e"\n[flops]\ndefault = 1e9\n[[interconnect]]\nname = "ici"\n'
            'devices = 0\nbandwidth = 1e10\nlatency = 1e-6\n[combiner]\n')
    ok = _load_text(text + 'reduce-scatter-apart = { "4X8" = "all" }\n', "ok.toml")
    assert ok.unmerged_reduce_scatters == {"4x8": "all"}
    with pytest.raises(DeviceModelError, match="must be \"all\" or \"partial\""):
        _load_text(text + 'reduce-scatter-apart = { "4x8" = "some" }\n', "bad.toml")


def test_unmerged_reduce_scatters_pay_their_whole_latency() -> None:
    v5e = load_device_model("tpu-v5e")
    nbytes = 1 << 20
    for mesh_text, apart in (("4x8", True), ("2x4", False), ("8x8", False)):
        mesh = parse_mesh(mesh_text)
        merged = CommModel(v5e, mesh, combine=v5e.combiner)
        full = CommModel(v5e, mesh).reduce_scatter(nbytes, (0, 1))
        cost = merged.reduce_scatter(nbytes, (0, 1))
        launch = merged.launch_latency("reduce-scatter", (0, 1))
        if apart:
            assert cost == pytest.approx(full) and launch == 0.0
        else:
            assert cost < full and launch > 0
        # All-reduces merge on every slice.
        assert merged.all_reduce(nbytes, (0, 1)) < CommModel(v5e, mesh).all_reduce(nbytes, (0, 1))
    # On v5e:4x4 only a reduce-scatter over every chip merges.
    mesh = parse_mesh("4x4")
    merged, full = CommModel(v5e, mesh, combine=v5e.combiner), CommModel(v5e, mesh)
    assert merged.reduce_scatter(nbytes, (0, 1)) < full.reduce_scatter(nbytes, (0, 1))
    assert merged.reduce_scatter(nbytes, (1,)) == pytest.approx(full.reduce_scatter(nbytes, (1,)))


def _shipped(name: str) -> str:
    from importlib import resources

    return resources.files("hloplan.cost_models").joinpath(name).read_text()


_LIBTPU_SCATTERS = """
import json, re, sys
import numpy as np, jax, jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from hloplan.tpu import parse_topology, topology_devices
out = []
for topology, rows, count in json.loads(sys.argv[1]):
    top = parse_topology(topology)
    devices = np.array(topology_devices(top))
    lead = int(np.prod(top.shape[:-1]))  # v5p's three dims as two mesh axes
    mesh = Mesh(devices.reshape(lead, devices.size // lead), ("x", "y"))
    batch = NamedSharding(mesh, P(("x", "y")))
    scattered = NamedSharding(mesh, P(("x", "y")))
    args = ([jax.ShapeDtypeStruct((64 * top.chips, rows), jnp.float32)] * count,
            [jax.ShapeDtypeStruct((64 * top.chips, 256), jnp.float32)] * count)
    text = jax.jit(lambda a, b: [u.T @ v for u, v in zip(a, b)],
                   in_shardings=([batch] * count, [batch] * count),
                   out_shardings=[scattered] * count).lower(*args).compile().as_text()
    kernels = [line for line in text.splitlines() if "calls=%all-reduce-scatter" in line]
    out.append({"kernels": len(kernels),
                "merged": sum("= (" in line.split(" fusion(")[0] for line in kernels)})
print(json.dumps(out))
"""


@pytest.mark.libtpu
def test_reduce_scatters_as_libtpu_compiles_them():
    from hloplan.tpu import child_env

    cases = [("v5e:2x4", 256, 3), ("v5e:4x8", 256, 3), ("v5e:4x4", 256, 3),
             ("v6e:2x4", 256, 3), ("v6e:4x8", 256, 3), ("v5p:2x2x1", 256, 3),
             ("v5p:2x2x2", 256, 3)]
    done = subprocess.run([sys.executable, "-c", _LIBTPU_SCATTERS, json.dumps(cases)],
                          env=child_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    merged_2x4, apart_4x8, whole_4x4, v6e_2x4, v6e_4x8, v5p_4, v5p_8 = json.loads(
        done.stdout.strip().splitlines()[-1])
    v5e, v6e = load_device_model("tpu-v5e"), load_device_model("tpu-v6e")
    # Three all-reduce-scatters over every chip: one merged kernel on v5e:2x4, three on 4x8,
    # and on the square 4x4 all-reduces (merged, each read through a slice).
    assert merged_2x4 == {"kernels": 1, "merged": 1} and not v5e.reduce_scatter_apart(8, 8)
    assert apart_4x8 == {"kernels": 3, "merged": 0} and v5e.reduce_scatter_apart(32, 32)
    assert whole_4x4["kernels"] == 0 and not v5e.reduce_scatter_apart(16, 16)
    # v6e the same on 2x4 and 4x8.
    assert v6e_2x4 == {"kernels": 1, "merged": 1} and not v6e.reduce_scatter_apart(8, 8)
    assert v6e_4x8 == {"kernels": 3, "merged": 0} and v6e.reduce_scatter_apart(32, 32)
    # v5p: three apart on the 4-chip 2x2x1, one merged all-reduce on 2x2x2.
    v5p = load_device_model("tpu-v5p")
    assert v5p_4 == {"kernels": 3, "merged": 0} and v5p.reduce_scatter_apart(4, 4)
    assert v5p_8["kernels"] == 0 and not v5p.reduce_scatter_apart(8, 8)


def test_calibrate_keeps_the_reduce_scatter_rules(tmp_path) -> None:
    """`hloplan calibrate` copies [combiner] (with its inline reduce-scatter-apart table) and
    [collectives] from the base model into the model it writes."""
    import tomllib

    from hloplan.calibrate import render

    base = tomllib.loads(_shipped("tpu-v5e.toml"))
    measured = {"devices": 1, "device_kind": "TPU v5 lite", "platform": "tpu", "jax": "x",
                "quick": False, "hbm_bandwidth": 6e11, "program_overhead": 5e-4,
                "matmul_f32_large": 1.8e14, "matmul_bf16_large": 1.8e14}
    path = tmp_path / "cal.toml"
    path.write_text(render(measured, base, "cal"))
    model = load_device_model(path)
    assert model.unmerged_reduce_scatters == {"4x8": "all", "4x4": "partial"}
    assert model.reduce_scatter_apart(32, 8)
