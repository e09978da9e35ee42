"""The [conv] table of a device model (compute FLOP/s of convolutions by the shape of their
implicit matmul, written by `hloplan calibrate`): parsed, looked up, used by the compute
pricing of convolutions wider than one tap; 1x1 convolutions priced as matmuls; the call
overhead per argument and result buffer."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax import export

import hloplan
from hloplan.calibrate import conv_compute_rate, conv_gemm_shape, render
from hloplan.cost_models import DeviceModelError, load_device_model
from hloplan.cost_models.hardware import DeviceModel

SQUARE = 1e14


def _model_dict(conv=None, matmul=None, **extra):
    data = {"name": "t", "platform": "tpu", "memory": "16GiB", "hbm_bandwidth": 1e15,
            "flops": {"f32": SQUARE, "default": SQUARE},
            "interconnect": [{"name": "ici", "devices": 0, "bandwidth": 1e11, "latency": 1e-6}],
            **extra}
    if conv is not None:
        data["conv"] = conv
    if matmul is not None:
        data["matmul"] = matmul
    return data


def test_lookup_weights_the_nearest_points_by_log_distance():
    points = [[1024, 1152, 128, 1e12], [4096, 1152, 128, 3e12]]
    model = DeviceModel.from_dict(_model_dict({"f32": points}))
    assert model.conv_flops_for("f32", 1024, 1152, 128) == 1e12  # on a point
    assert model.conv_flops_for("f32", 2048, 1152, 128) == pytest.approx(2e12)  # midway in log2
    assert model.conv_flops_for("f32", 1024, 1152, 120) < 1.1e12  # nearer the first
    assert model.conv_flops_for("bf16", 1024, 1152, 128) == 1e12  # no bf16 points: f32's
    assert DeviceModel.from_dict(_model_dict()).conv_flops_for("f32", 8, 8, 8) == SQUARE


def test_bad_conv_table_is_a_located_error():
    with pytest.raises(DeviceModelError, match="conv.f32"):
        DeviceModel.from_dict(_model_dict({"f32": [[1, 2, 3]]}))
    with pytest.raises(DeviceModelError, match="conv.f32"):
        DeviceModel.from_dict(_model_dict({"f32": [[1, 2, 3, -4.0]]}))
    with pytest.raises(DeviceModelError, match="buffer_overhead"):
        DeviceModel.from_dict(_model_dict(buffer_overhead=-1.0))


def test_call_overhead_is_per_program_and_per_buffer():
    model = DeviceModel.from_dict(_model_dict(program_overhead=5e-4, buffer_overhead=2e-6))
    assert model.call_overhead(0) == 5e-4
    assert model.call_overhead(250) == pytest.approx(1e-3)


def test_compute_rate_removes_the_pass_own_traffic():
    """A pass whose measured time is its compute at 1e14 plus its HBM traffic at 1e12 B/s gives
    back 1e14; one faster than its traffic allows is capped at the peak."""
    batch, image, cin, cout = 2, 8, 16, 32
    m, k, n = conv_gemm_shape("forward", batch, image, cin, cout)
    assert (m, k, n) == (128, 144, 32)
    assert conv_gemm_shape("kernel_grad", batch, image, cin, cout) == (144, 128, 32)
    flops = 2.0 * m * k * n
    moved = (batch * image * image * (cin + cout) + 9 * cin * cout) * 4
    seconds = flops / 1e14 + moved / 1e12
    assert conv_compute_rate("forward", batch, image, cin, cout, flops / seconds, 4, 1e12,
                             2e14) == pytest.approx(1e14)
    assert conv_compute_rate("forward", batch, image, cin, cout, 1e20, 4, 1e12, 2e14) == 2e14


def test_calibrate_writes_the_conv_table_and_it_reads_back(tmp_path):
    measured = {"devices": 1, "device_kind": "TPU v5 lite", "platform": "tpu", "jax": "x",
                "quick": False, "hbm_bandwidth": 1e15, "program_overhead": 5e-4,
                "buffer_overhead": 3e-6, "matmul_f32_large": SQUARE, "matmul_bf16_large": SQUARE,
                "conv": {"f32": [[128, 72, 8, 5e12]], "bf16": [[128, 72, 8, 7e12]]}}
    path = tmp_path / "cal.toml"
    path.write_text(render(measured, _model_dict(), "cal"))
    model = load_device_model(path)
    assert model.conv["f32"] == ((128.0, 72.0, 8.0, 5e12),)
    assert model.conv_flops_for("bf16", 128, 72, 8) == 7e12
    assert model.buffer_overhead == 3e-6
    assert "conv" not in model.calibration


def _conv_compute_s(device, kernel: int) -> float:
    s = jax.ShapeDtypeStruct

    def conv(x, w):
        return jax.lax.conv_general_dilated(x, w, (1, 1), "SAME",
                                            dimension_numbers=("NHWC", "HWIO", "NHWC"))

    data = export.export(jax.jit(conv))(s((4, 16, 16, 32), jnp.float32),
                                        s((kernel, kernel, 32, 64), jnp.float32)).serialize()
    return hloplan.compile(data, "1", device=str(device),
                           mesh_views="off").plan["estimate"]["compute_s"]


def test_convolutions_are_priced_at_the_rate_of_their_implicit_matmul(tmp_path):
    """A 3x3 convolution of 4 images of 16 x 16 pixels, 32 -> 64 channels runs as a (1024, 288)
    x (288, 64) implicit matmul: priced at the [conv] rate of that shape; a 1x1 one is the
    matmul (1024, 32) x (32, 64), priced at the [matmul] grid's rate (HBM is fast enough here
    that the FLOPs bound the time)."""
    slow, other = 1e11, 1e13
    conv = {"f32": [[1024, 288, 64, slow], [64, 64, 64, other], [1 << 20, 4096, 512, other]]}
    sizes = [32, 64, 1024]
    grid = {"sizes": sizes, "f32": [[[slow if (m, k, n) == (1024, 32, 64) else other
                                      for n in sizes] for k in sizes] for m in sizes]}
    flops3 = 2.0 * 1024 * 288 * 64
    assert _conv_compute_s(_written(tmp_path, conv, grid), 3) == pytest.approx(flops3 / slow,
                                                                              rel=0.05)
    flops1 = 2.0 * 1024 * 32 * 64
    assert _conv_compute_s(_written(tmp_path, conv, grid), 1) == pytest.approx(flops1 / slow,
                                                                              rel=0.05)
    assert _conv_compute_s(_written(tmp_path, None, None), 3) == pytest.approx(flops3 / SQUARE,
                                                                              rel=0.05)


def _written(tmp_path, conv, grid):
    """A device TOML with these tables (as calibrate writes them), its path."""
    measured = {"devices": 1, "device_kind": "x", "platform": "tpu", "jax": "x", "quick": False,
                "hbm_bandwidth": 1e15, "program_overhead": 0.0, "matmul_f32_large": SQUARE,
                "matmul_bf16_large": SQUARE}
    if conv:
        measured["conv"] = conv
    if grid:
        measured["matmul_grid"] = grid
    path = tmp_path / f"dev{len(list(tmp_path.iterdir()))}.toml"
    path.write_text(render(measured, _model_dict(), "dev"))
    return path
