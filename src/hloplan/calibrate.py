"""`hloplan calibrate -o my-device.toml`: measure the accelerator jax sees and write a device
model (cost_models/hardware.py's schema) for `--device my-device.toml`.

Measured, on the first device (and on all of them for collectives):

- matmul FLOP/s per dtype (f32 at jax's default precision, bf16) and size class (square
  matmuls of a small, medium and large size); [flops] takes the large size's rate;
- the same rates over a grid of (m, k, n) shapes, each dim from MATMUL_GRID: written as the
  [matmul] table, which the cost model reads for the dots and convolutions of that shape
  (a chip's matmul kernels reach a fraction of the square rate when one dim is small or the
  contracted dim is long);
- HBM bandwidth: an elementwise pass over a large array, bytes read + bytes written per second
  (the convention of the cost model's memory-bound terms);
  both on the device alone: differences of two timed calls (chains of 1 and k matmuls, passes
  over a quarter of the array and the whole), so the per-call overhead below is not in them;
- convolution FLOP/s per dtype over a grid of 3x3 convolutions (forward and both gradients,
  CONV_CHANNELS x CONV_IMAGES): written as the [conv] table, each point the pass's compute
  rate (its time less its own HBM traffic; conv_compute_rate);
- per-program overhead: the wall time of a trivial jitted call, and the time each argument or
  result buffer adds to a call (`buffer_overhead`);
- with several devices: all-reduce over all of them (a one-axis mesh), bandwidth as the ring
  algorithm sees it (2(n-1)/n S per device per second) from a large buffer, latency per ring
  step from a small one; written as the innermost [[interconnect]] level.

What is not measured (memory size where the backend does not say, slower interconnect levels,
the combiner, how the platform's compiler tiles and forms collectives) comes from a base model
(`--base`, default: the shipped model of the platform). Every figure goes into the file's
[calibration] table as well, so `--from-file` writes the model again from them against the
current base, without measuring (after an hloplan upgrade adds fields to the base).

This module needs only jax, numpy and the standard library, so that it runs where hloplan is
not installed: `python calibrate.py -o dev.toml --base-file tpu-v5e.toml`.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
import tomllib
from pathlib import Path

# Square matmul sizes per size class; quick mode (tests, CPU) uses tiny ones.
SIZES = {"small": 1024, "medium": 4096, "large": 8192}
QUICK_SIZES = {"small": 64, "medium": 128, "large": 256}
# Each dim of the [matmul] grid: covers attention heads (64-128), model widths (512-1024),
# hidden and token counts (4096) and vocabularies / long contractions (16384 and beyond).
MATMUL_GRID = (128, 512, 1024, 4096, 16384)
QUICK_MATMUL_GRID = (16, 64)
HBM_BYTES = 1 << 30
QUICK_HBM_BYTES = 1 << 22
ALLREDUCE_BYTES = 1 << 26
QUICK_ALLREDUCE_BYTES = 1 << 16


def _time(fn, *args, repeats: int, warmup: int = 2) -> float:
    """Median wall seconds of fn(*args) (blocking on the result), after warmup calls."""
    import jax

    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# Matmuls chained in one call per size class: enough device work that the difference of two
# chain lengths is well above the jitter of a call.
CHAIN = {"small": 64, "medium": 8, "large": 4}


def measure_matmul(dtype: str, n: int, repeats: int, chain: int = 4) -> float:
    """FLOP/s of an n x n x n matmul in `dtype` (jax's default precision), on the device alone:
    one call running `chain` dependent matmuls against one running a single one, so that the
    call's own cost (dispatch, launch, sync: `program_overhead`) cancels out."""
    import jax
    import jax.numpy as jnp

    key = jax.random.PRNGKey(0)
    a = jax.random.normal(key, (n, n), dtype=jnp.dtype(dtype))
    # Scaled so that the chained products keep their magnitude.
    b = (jax.random.normal(jax.random.fold_in(key, 1), (n, n)) / math.sqrt(n)).astype(a.dtype)

    def chained(k: int):
        def run(x, w):
            for _ in range(k):  # unrolled: a loop would add a copy of its carry per step
                x = x @ w
            return x
        return jax.jit(run)

    one = _time(chained(1), a, b, repeats=repeats)
    many = _time(chained(chain), a, b, repeats=repeats)
    return 2.0 * n**3 * (chain - 1) / max(many - one, 1e-9)


def measure_matmul_shape(dtype: str, m: int, k: int, n: int, repeats: int,
                         target_flops: float = 1e12, max_bytes: int = 3 << 30,
                         max_count: int = 64) -> float:
    """FLOP/s of an (m, k) x (k, n) matmul in `dtype`, on the device alone: one call running
    `count` independent matmuls (separate operands, so that XLA neither merges nor reuses them)
    against one running a single one; `count` gives the difference about `target_flops` of
    work, within `max_bytes` of operands and results."""
    import jax
    import jax.numpy as jnp

    flops = 2.0 * m * k * n
    per = (m * k + k * n + m * n) * jnp.dtype(dtype).itemsize
    count = int(max(2, min(max_count, math.ceil(target_flops / flops), max_bytes // per)))
    key = jax.random.PRNGKey(m * 7 + k * 13 + n)
    lhs = [jax.random.normal(jax.random.fold_in(key, i), (m, k), dtype=jnp.dtype(dtype))
           for i in range(count)]
    rhs = [jax.random.normal(jax.random.fold_in(key, count + i), (k, n), dtype=jnp.dtype(dtype))
           for i in range(count)]
    run = jax.jit(lambda xs, ws: [x @ w for x, w in zip(xs, ws)])
    one = _time(run, lhs[:1], rhs[:1], repeats=repeats)
    many = _time(run, lhs, rhs, repeats=repeats)
    del lhs, rhs
    return flops * (count - 1) / max(many - one, 1e-9)


def measure_matmul_grid(dtype: str, sizes: tuple[int, ...], repeats: int,
                        cap: float) -> list[list[list[float]]]:
    """FLOP/s of every (m, k, n) matmul with each dim from `sizes` ([m][k][n]); each at most
    `cap` (a timing too short to resolve would read as an absurd rate)."""
    return [[[min(measure_matmul_shape(dtype, m, k, n, repeats), cap) for n in sizes]
             for k in sizes] for m in sizes]


# The [conv] table: 3x3 convolutions (NHWC, stride 1, SAME) of these channel pairs and batch x
# image sizes, each as the forward pass and its two gradients (input, kernel); a 1x1
# convolution is a matmul of its (batch x pixels, in, out) shape (the [matmul] grid prices it).
CONV_CHANNELS = ((64, 64), (128, 128), (256, 256), (512, 512), (128, 256), (256, 512))
CONV_IMAGES = ((32, 16), (32, 64), (32, 128))  # (batch, height = width)
QUICK_CONV_CHANNELS = ((8, 16),)
QUICK_CONV_IMAGES = ((2, 8),)
CONV_KINDS = ("forward", "input_grad", "kernel_grad")


def conv_gemm_shape(kind: str, batch: int, image: int, cin: int, cout: int,
                    taps: int = 9) -> tuple[int, int, int]:
    """The (m, k, n) a convolution op of this pass runs as an implicit matmul, as the cost model
    reads it off the op (op_rules: batch x output pixels, input features x kernel taps, output
    features): the input gradient convolves the output gradient with the flipped kernel, the
    kernel gradient convolves the input (features as batch) with the output gradient."""
    pixels = batch * image * image
    if kind == "forward":
        return pixels, cin * taps, cout
    if kind == "input_grad":
        return pixels, cout * taps, cin
    return cin * taps, pixels, cout


def measure_conv_shape(dtype: str, kind: str, batch: int, image: int, cin: int, cout: int,
                       repeats: int, target_flops: float = 2e11, max_count: int = 16) -> float:
    """FLOP/s of one pass of a 3x3 convolution (module docstring), on the device alone: `count`
    independent ones in one call against one."""
    import jax
    import jax.numpy as jnp

    m, k, n = conv_gemm_shape(kind, batch, image, cin, cout)
    flops = 2.0 * m * k * n
    count = int(max(2, min(max_count, math.ceil(target_flops / flops))))
    key = jax.random.PRNGKey(batch + image * 3 + cin * 5 + cout * 7)
    dt = jnp.dtype(dtype)

    def conv(x, w):
        return jax.lax.conv_general_dilated(x, w, (1, 1), "SAME",
                                            dimension_numbers=("NHWC", "HWIO", "NHWC"))

    xs = [jax.random.normal(jax.random.fold_in(key, i), (batch, image, image, cin), dt)
          for i in range(count)]
    ws = [jax.random.normal(jax.random.fold_in(key, 100 + i), (3, 3, cin, cout), dt)
          for i in range(count)]
    if kind == "forward":
        run = jax.jit(lambda xs, ws, gs: [conv(x, w) for x, w in zip(xs, ws)])
        gs = [None] * count
    else:
        gs = [jax.random.normal(jax.random.fold_in(key, 200 + i), (batch, image, image, cout), dt)
              for i in range(count)]
        position = 0 if kind == "input_grad" else 1

        def grad(x, w, g):
            return jax.vjp(conv, x, w)[1](g)[position]
        run = jax.jit(lambda xs, ws, gs: [grad(x, w, g) for x, w, g in zip(xs, ws, gs)])
    one = _time(run, xs[:1], ws[:1], gs[:1], repeats=repeats)
    many = _time(run, xs, ws, gs, repeats=repeats)
    del xs, ws, gs
    return flops * (count - 1) / max(many - one, 1e-9)


def conv_compute_rate(kind: str, batch: int, image: int, cin: int, cout: int, rate: float,
                      itemsize: int, hbm_bandwidth: float, peak: float) -> float:
    """The compute rate of a measured convolution pass: its time less the HBM time of what it
    reads and writes (image-sized operands and result, the kernel), at most `peak`. The cost
    model adds a kernel's traffic on its own (the larger of the two), and inside a program a
    convolution's operands are made by other kernels in the layout it wants, so the standalone
    pass's traffic (and relayout of its arguments) is not part of its compute."""
    pixels = batch * image * image
    moved = (pixels * (cin + cout) + 9 * cin * cout) * itemsize
    m, k, n = conv_gemm_shape(kind, batch, image, cin, cout)
    flops = 2.0 * m * k * n
    seconds = flops / rate - moved / hbm_bandwidth
    return peak if seconds <= flops / peak else flops / seconds


def measure_conv_table(dtype: str, quick: bool, repeats: int, hbm_bandwidth: float,
                       peak: float) -> list[list[float]]:
    """[m, k, n, FLOP/s] of every convolution pass of the grid (CONV_CHANNELS x CONV_IMAGES x
    CONV_KINDS): the compute rate (conv_compute_rate) of each measured pass."""
    import jax.numpy as jnp

    rows = []
    for batch, image in QUICK_CONV_IMAGES if quick else CONV_IMAGES:
        for cin, cout in QUICK_CONV_CHANNELS if quick else CONV_CHANNELS:
            for kind in CONV_KINDS:
                rate = measure_conv_shape(dtype, kind, batch, image, cin, cout, repeats)
                rows.append([*conv_gemm_shape(kind, batch, image, cin, cout), conv_compute_rate(
                    kind, batch, image, cin, cout, rate, jnp.dtype(dtype).itemsize,
                    hbm_bandwidth, peak)])
    return rows


def measure_buffer_overhead(repeats: int, buffers: int = 256) -> float:
    """Wall seconds each argument or result buffer adds to a jitted call (the host handles every
    buffer at dispatch): a call taking and returning `buffers` small arrays against one taking
    and returning one, per buffer."""
    import jax
    import jax.numpy as jnp

    run = jax.jit(lambda *xs: [x + 1 for x in xs])
    xs = [jnp.full((128,), float(i), jnp.float32) for i in range(buffers)]
    one = _time(run, *xs[:1], repeats=repeats, warmup=5)
    many = _time(run, *xs, repeats=repeats, warmup=5)
    return max(many - one, 0.0) / (2 * (buffers - 1))


def measure_hbm(nbytes: int, repeats: int) -> float:
    """Bytes read + written per second by an elementwise pass over an f32 array, on the device
    alone: the difference between passes over `nbytes` and over a quarter of it (the call's
    own cost cancels out)."""
    import jax
    import jax.numpy as jnp

    pass_ = jax.jit(lambda v: v * 2.0 + 1.0)
    seconds = [_time(pass_, jnp.ones((size // 4,), jnp.float32), repeats=repeats)
               for size in (nbytes // 4, nbytes)]
    return 2.0 * (nbytes - nbytes // 4) / max(seconds[1] - seconds[0], 1e-12)


def measure_overhead(repeats: int) -> float:
    """Wall seconds of a trivial jitted call (dispatch, launch and sync)."""
    import jax
    import jax.numpy as jnp

    return _time(jax.jit(lambda v: v + 1), jnp.float32(1.0), repeats=repeats, warmup=5)


def measure_allreduce(nbytes: int, repeats: int) -> dict | None:
    """All-reduce over all devices (one mesh axis): {"devices", "bandwidth", "latency"}; None
    with one device."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    devices = jax.devices()
    n = len(devices)
    if n < 2:
        return None
    mesh = Mesh(np.array(devices), ("d",))

    def timed(size: int) -> float:
        per_device = max(size // 4, 1)
        x = jax.device_put(jnp.ones((n * per_device,), jnp.float32),
                           NamedSharding(mesh, PartitionSpec("d")))

        def body(v):
            return jax.lax.psum(v, "d")

        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=PartitionSpec("d"),
                                  out_specs=PartitionSpec("d")))
        return _time(f, x, repeats=repeats)

    small = timed(4)
    large = timed(nbytes)
    steps = 2 * (n - 1)
    latency = small / steps
    moved = 2 * (n - 1) / n * nbytes
    bandwidth = moved / max(large - small, 1e-9)
    return {"devices": n, "bandwidth": bandwidth, "latency": latency,
            "small_seconds": small, "large_seconds": large, "large_bytes": nbytes}


def measure(quick: bool = False) -> dict:
    """Every measurement, as a flat dict of figures (the [calibration] table)."""
    import jax

    device = jax.devices()[0]
    sizes = QUICK_SIZES if quick else SIZES
    repeats = 3 if quick else 10
    out: dict = {"platform": device.platform, "device_kind": device.device_kind,
                 "devices": len(jax.devices()), "quick": quick, "jax": jax.__version__}
    for dtype in ("float32", "bfloat16"):
        short = {"float32": "f32", "bfloat16": "bf16"}[dtype]
        for size_class, n in sizes.items():
            out[f"matmul_{short}_{size_class}"] = measure_matmul(dtype, n, repeats,
                                                                 CHAIN[size_class])
            out[f"matmul_{size_class}_n"] = n
    grid = QUICK_MATMUL_GRID if quick else MATMUL_GRID
    out["matmul_grid"] = {"sizes": list(grid)}
    for dtype, short in (("float32", "f32"), ("bfloat16", "bf16")):
        cap = 1.25 * max(out[f"matmul_{short}_{c}"] for c in sizes)
        out["matmul_grid"][short] = measure_matmul_grid(dtype, grid, 3 if quick else 5, cap)
    out["hbm_bandwidth"] = measure_hbm(QUICK_HBM_BYTES if quick else HBM_BYTES, repeats)
    out["conv"] = {}
    for dtype, short in (("float32", "f32"), ("bfloat16", "bf16")):
        peak = max(out[f"matmul_{short}_{c}"] for c in sizes)
        out["conv"][short] = measure_conv_table(dtype, quick, 3 if quick else 5,
                                                out["hbm_bandwidth"], peak)
    out["program_overhead"] = measure_overhead(20 if quick else 200)
    out["buffer_overhead"] = measure_buffer_overhead(20 if quick else 50, 16 if quick else 256)
    try:
        stats = device.memory_stats() or {}
    except Exception:  # some backends do not report memory
        stats = {}
    if stats.get("bytes_limit"):
        out["memory_bytes"] = int(stats["bytes_limit"])
    collective = measure_allreduce(QUICK_ALLREDUCE_BYTES if quick else ALLREDUCE_BYTES, repeats)
    if collective is not None:
        out.update({f"allreduce_{k}": v for k, v in collective.items()})
    return out


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return f"{value:.6g}" if math.isfinite(value) else "0.0"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):  # an inline table ([combiner]'s reduce-scatter-apart)
        return "{ " + ", ".join(f"{json.dumps(k)} = {_toml_value(v)}"
                                for k, v in value.items()) + " }"
    raise TypeError(f"cannot write {value!r} to TOML")


# Top-level fields render writes itself (or leaves out: the base's aliases name the base).
_WRITTEN = {"name", "aliases", "description", "platform", "tpu_topology", "memory",
            "hbm_bandwidth", "program_overhead", "buffer_overhead"}


def render(measured: dict, base: dict, name: str) -> str:
    """The device TOML: measured figures where there are some, the base model's elsewhere."""
    lines = [f"# Measured by `hloplan calibrate` on {measured['devices']} x "
             f"{measured['device_kind']} ({measured['platform']}, jax {measured['jax']})"
             + (" in quick mode (tiny sizes: not representative)" if measured["quick"] else "")
             + f"; unmeasured fields from {base.get('name', 'the base model')}.",
             f"name = {_toml_value(name)}",
             f"description = {_toml_value('calibrated ' + str(measured['device_kind']))}",
             f"platform = {_toml_value(base['platform'])}"]
    if base.get("tpu_topology"):
        lines.append(f"tpu_topology = {_toml_value(base['tpu_topology'])}")
    memory = measured.get("memory_bytes", base["memory"])
    lines += [f"memory = {_toml_value(memory)}",
              f"hbm_bandwidth = {_toml_value(measured['hbm_bandwidth'])}",
              f"program_overhead = {_toml_value(measured['program_overhead'])}",
              f"buffer_overhead = {_toml_value(measured.get('buffer_overhead', 0.0))}"]
    # The base's other figures (collective_overhead, matmul_row_tile, ...): not measured, and
    # the cost model prices with them, so they carry over.
    lines += [f"{key} = {_toml_value(value)}" for key, value in base.items()
              if key not in _WRITTEN and not isinstance(value, (dict, list))]
    flops = dict(base["flops"])
    flops["f32"] = measured["matmul_f32_large"]
    flops["bf16"] = measured["matmul_bf16_large"]
    lines += ["", "[flops]  # the large matmuls' rates; [calibration] has every size class"]
    lines += [f"{k} = {_toml_value(float(v))}" for k, v in flops.items()]
    levels = [dict(level) for level in base["interconnect"]]
    if "allreduce_bandwidth" in measured:
        inner = {"name": "measured", "devices": int(measured["allreduce_devices"]),
                 "bandwidth": measured["allreduce_bandwidth"],
                 "latency": measured["allreduce_latency"]}
        # The measured level replaces the base's levels that reach no further than it.
        outer = [lv for lv in levels if lv["devices"] == 0 or lv["devices"] > inner["devices"]]
        if len(outer) < len(levels):
            inner["name"] = levels[0]["name"]
        levels = [inner] + outer
    for level in levels:
        lines += ["", "[[interconnect]]"]
        lines += [f"{k} = {_toml_value(level[k])}" for k in ("name", "devices", "bandwidth",
                                                              "latency")]
    # How the platform's compiler merges and forms collectives and keeps values: not measured.
    for table in ("combiner", "collectives", "buffers"):
        if base.get(table):
            lines += ["", f"[{table}]"]
            lines += [f"{json.dumps(k)} = {_toml_value(v)}" for k, v in base[table].items()]
    grid = measured.get("matmul_grid")
    if grid:
        lines += ["", "[matmul]  # FLOP/s of an (m, k) x (k, n) matmul: [dtype][m][k][n], each "
                  "dim from sizes"]
        lines.append(f"sizes = {_toml_value(grid['sizes'])}")
        for dtype in (k for k in grid if k != "sizes"):
            lines.append(f"{dtype} = [")
            for m, plane in zip(grid["sizes"], grid[dtype]):
                lines.append(f"  [  # m = {m}; rows k, columns n")
                lines += [f"    {_toml_value([float(v) for v in row])}," for row in plane]
                lines.append("  ],")
            lines.append("]")
    if measured.get("conv"):
        lines += ["", "[conv]  # compute FLOP/s of 3x3 convolutions: [m, k, n, FLOP/s] of each "
                  "one's implicit matmul"]
        for dtype, points in measured["conv"].items():
            lines.append(f"{dtype} = [")
            lines += [f"  {_toml_value([float(v) for v in p])}," for p in points]
            lines.append("]")
    lines += ["", "[calibration]"]
    lines += [f"{k} = {_toml_value(v)}" for k, v in sorted(measured.items())
              if k not in ("matmul_grid", "conv")]
    return "\n".join(lines) + "\n"


def measurements_of(text: str) -> dict:
    """The measurements a device TOML written by render records ([calibration], with the
    [matmul] and [conv] tables), as measure returns them: for writing the model again against
    a newer base without measuring again."""
    data = tomllib.loads(text)
    if "calibration" not in data:
        raise ValueError("no [calibration] table: not a device model written by calibrate")
    measured = dict(data["calibration"])
    if data.get("matmul"):
        measured["matmul_grid"] = dict(data["matmul"])
    if data.get("conv"):
        measured["conv"] = dict(data["conv"])
    return measured


def base_for(measured: dict) -> str:
    """The shipped model whose unmeasured figures a calibration of this device starts from."""
    kind = str(measured["device_kind"]).lower()
    if measured["platform"] == "tpu":
        for key, model in (("v5 lite", "tpu-v5e"), ("v5e", "tpu-v5e"), ("v6", "tpu-v6e"),
                           ("v5p", "tpu-v5p"), ("v5", "tpu-v5p")):
            if key in kind:
                return model
        return "tpu-v5e"
    return "h100" if measured["platform"] in ("cuda", "rocm") else "cpu"


def calibrate(output: str | Path, base_file: str | Path | None = None, name: str | None = None,
              quick: bool = False, measurements: dict | None = None) -> dict:
    """Measure (or take `measurements`, measurements_of an earlier output), write the device
    TOML to `output`, return the measurements."""
    measured = measurements if measurements is not None else measure(quick=quick)
    if base_file is None:
        from importlib import resources

        base_text = resources.files("hloplan.cost_models").joinpath(
            base_for(measured) + ".toml").read_text()
    else:
        base_text = Path(base_file).read_text()
    base = tomllib.loads(base_text)
    Path(output).write_text(render(measured, base, name or f"calibrated-{base['name']}"))
    return measured


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-o", "--output", required=True)
    parser.add_argument("--base-file", default=None)
    parser.add_argument("--name", default=None)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--from-file", default=None,
                        help="write the model again from this calibrated model's measurements")
    args = parser.parse_args(argv)
    recorded = measurements_of(Path(args.from_file).read_text()) if args.from_file else None
    measured = calibrate(args.output, args.base_file, args.name, args.quick, recorded)
    print(json.dumps(measured, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
