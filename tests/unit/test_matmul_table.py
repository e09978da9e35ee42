"""The [matmul] table of a device model (FLOP/s by matmul shape, written by `hloplan calibrate`):
parsed, interpolated, and used by the compute pricing of dots."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax import export

import hloplan
from hloplan.calibrate import render
from hloplan.cost_models import DeviceModelError, load_device_model
from hloplan.cost_models.hardware import DeviceModel

SQUARE = 1e14  # [flops] f32: the square-matmul rate


def _model_dict(grid=None):
    data = {"name": "t", "platform": "tpu", "memory": "16GiB", "hbm_bandwidth": 1e15,
            "flops": {"f32": SQUARE, "default": SQUARE},
            "interconnect": [{"name": "ici", "devices": 0, "bandwidth": 1e11, "latency": 1e-6}]}
    if grid is not None:
        data["matmul"] = grid
    return data


def _grid(rate):
    """A 2-point grid (sizes 64 and 1024) with rate(m, k, n) at each corner."""
    sizes = [64, 1024]
    return {"sizes": sizes,
            "f32": [[[rate(m, k, n) for n in sizes] for k in sizes] for m in sizes]}


def test_table_lookup_interpolates_in_log_size_and_clamps():
    model = DeviceModel.from_dict(_model_dict(_grid(lambda m, k, n: 1e12 * (1 + (n == 1024)))))
    assert model.matmul_flops_for("f32", 64, 64, 64) == pytest.approx(1e12)
    assert model.matmul_flops_for("f32", 64, 64, 1024) == pytest.approx(2e12)
    assert model.matmul_flops_for("float32", 64, 64, 256) == pytest.approx(1.5e12)  # log2 midway
    assert model.matmul_flops_for("f32", 8, 1 << 20, 1 << 20) == pytest.approx(2e12)  # clamped
    assert model.matmul_flops_for("bf16", 64, 64, 64) == SQUARE  # no bf16 rows: [flops]
    assert DeviceModel.from_dict(_model_dict()).matmul_flops_for("f32", 64, 64, 64) == SQUARE


def test_bad_table_is_a_located_error():
    with pytest.raises(DeviceModelError, match="matmul.f32"):
        DeviceModel.from_dict(_model_dict({"sizes": [64, 1024], "f32": [[[1.0]]]}))
    with pytest.raises(DeviceModelError, match="matmul.sizes"):
        DeviceModel.from_dict(_model_dict({"sizes": [1024, 64]}))


def _calibrated(tmp_path, rate) -> DeviceModel:
    """`hloplan calibrate`'s output for these measurements, loaded back."""
    measured = {"devices": 1, "device_kind": "TPU v5 lite", "platform": "tpu", "jax": "x",
                "quick": False, "hbm_bandwidth": 1e15, "program_overhead": 5e-4,
                "matmul_f32_large": SQUARE, "matmul_bf16_large": SQUARE,
                **({"matmul_grid": _grid(rate)} if rate else {})}
    if rate:
        measured["matmul_grid"]["bf16"] = measured["matmul_grid"]["f32"]
    path = tmp_path / f"cal{len(list(tmp_path.iterdir()))}.toml"
    path.write_text(render(measured, _model_dict(), "cal"))
    return load_device_model(path)


def test_calibrate_writes_the_table_and_it_reads_back(tmp_path):
    model = _calibrated(tmp_path, lambda m, k, n: 1e11 * m + 1e9 * k + 1e7 * n)
    assert model.matmul["sizes"] == (64, 1024)
    assert model.matmul_flops_for("f32", 1024, 64, 1024) == pytest.approx(
        1e11 * 1024 + 1e9 * 64 + 1e7 * 1024, rel=1e-5)
    assert model.matmul_flops_for("bf16", 64, 1024, 64) == pytest.approx(
        1e11 * 64 + 1e9 * 1024 + 1e7 * 64, rel=1e-5)
    assert "matmul_grid" not in model.calibration


def _compute_s(device) -> float:
    s = jax.ShapeDtypeStruct
    data = export.export(jax.jit(lambda x, w: x @ w))(
        s((1024, 64), jnp.float32), s((64, 1024), jnp.float32)).serialize()
    return hloplan.compile(data, "1", device=str(device),
                           mesh_views="off").plan["estimate"]["compute_s"]


def test_dots_are_priced_at_the_rate_of_their_shape(tmp_path):
    """A (1024, 64) x (64, 1024) dot costs its FLOPs at the table's rate for that shape, not at
    the square rate of [flops] (HBM is fast enough here that the FLOPs bound the time)."""
    slow = 1e12  # the (1024, 64, 1024) class; every other class runs at the square rate
    model = _calibrated(tmp_path, lambda m, k, n: slow if (m, k, n) == (1024, 64, 1024)
                        else SQUARE)
    flops = 2.0 * 1024 * 64 * 1024
    assert _compute_s(model.source) == pytest.approx(flops / slow, rel=0.05)
    assert _compute_s(_calibrated(tmp_path, None).source) == pytest.approx(flops / SQUARE,
                                                                           rel=0.05)


def test_shipped_v5e_overhead_is_the_least_time_a_measured_step_spends_outside_its_kernels():
    """tpu-v5e's program_overhead is a train step's time outside its kernels on the chip: the
    least, over the programs measured there, of the step less its kernels' device time (and
    no per-buffer term on top)."""
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "benchmarks"
    gaps = []
    for name in ("tpu_chip_measured.json", "tpu_chip_corpus_measured.json"):
        for entry in json.loads((root / name).read_text())["programs"].values():
            gaps.append(entry["step_s"] - sum(entry["device"]["ops"].values()))
    assert len(gaps) == 18 and min(gaps) > 0
    model = load_device_model("tpu-v5e")
    assert model.program_overhead == pytest.approx(min(gaps), rel=0.02)
    assert model.call_overhead(100) == model.program_overhead


def test_calibrated_v5e_call_overhead_is_the_chip_measurement():
    """benchmarks/tpu-v5e-calibrated.toml's buffer_overhead is calibrate's measurement on the
    chip (benchmarks/tpu_chip_kernels_measured.json: a call taking and returning 256 buffers
    against one)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "benchmarks"
    import json

    measured = json.loads((root / "tpu_chip_kernels_measured.json").read_text())
    model = load_device_model(root / "tpu-v5e-calibrated.toml")
    assert model.buffer_overhead == pytest.approx(
        sorted(measured["buffer_overhead"])[1], rel=0.02)
    assert model.call_overhead(100) == pytest.approx(
        model.program_overhead + 100 * model.buffer_overhead)
