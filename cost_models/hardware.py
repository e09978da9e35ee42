"""Device models: what one accelerator can do, read from TOML files.

A device model gives the per-device numbers the analytic cost model needs: memory, HBM bandwidth,
peak FLOP/s by dtype, and the interconnect as a list of levels, innermost first. Shipped models
live next to this file (h100.toml, h100-slow-ib.toml, tpu-v5e.toml, cpu.toml); any other TOML file
with the same schema can be passed by path.

Schema (all fields required unless marked optional)::

    name = "h100"                # short name used to select the model
    aliases = ["h100-sxm"]       # optional: other names for it
    description = "..."          # optional: one line for humans
    platform = "cuda"            # jax platform name: cpu, cuda, rocm, tpu
    memory = "80GiB"             # per device: a byte count or a string such as "80GiB", "16GB"
    hbm_bandwidth = 3.35e12      # bytes/s, per device
    collective_overhead = 1e-6   # optional: seconds per collective call on top of its steps
    program_overhead = 5e-4      # optional: seconds per program call (dispatch), e.g. measured
    tpu_topology = "v5e"         # optional, TPU models: the libtpu topology kind (v5e, v6e, v5p,
                                 # v4) plans are compiled for by `hloplan verify` (tpu.py)

    [flops]                      # peak dense FLOP/s per device, by dtype
    f32 = 494.7e12               # keys are HLO-style dtype names: f64, f32, bf16, f16, f8, ...
    bf16 = 989.4e12
    default = 66.9e12            # required: used for integer dtypes and any dtype not listed

    [[interconnect]]             # one table per level, innermost (fastest) first
    name = "nvlink"
    devices = 8                  # devices reachable at this level (e.g. GPUs in a node); 0 = unbounded
    bandwidth = 450e9            # bytes/s per device per direction, as the ring algorithm sees it
    latency = 3e-6               # seconds per collective step

    [[interconnect]]
    name = "infiniband"
    devices = 0
    bandwidth = 50e9
    latency = 10e-6

    [matmul]                     # optional: FLOP/s of an (m, k) x (k, n) matmul by shape
    sizes = [128, 512, 4096]     # the grid of each dim (increasing)
    f32 = [[[...], ...], ...]    # per dtype: [m][k][n] rates, len(sizes) each (calibrate writes it)

    [conv]                       # optional: FLOP/s of convolutions wider than one tap, as
    f32 = [[m, k, n, rate], ...] # measured points of their implicit matmul (batch x output
                                 # pixels, in features x taps, out features; calibrate writes it)
    buffer_overhead = 3.7e-6     # optional: seconds each argument or result buffer adds to a
                                 # program call (host-side handling at dispatch)
    partial_slice_devices = 16   # optional, TPU models: the largest slice (chips) on which the
                                 # compiler builds programs for parts of it (pipeline stages'
                                 # submeshes); unset: every slice
    matmul_row_tile = 768        # optional: the widest output tile (elements, whole 128s) of
                                 # the compiler's matmul kernels; a kernel recomputing a softmax
                                 # reads it once per tile of the other operand's rows
                                 # (strategies.restream_passes); unset: once
    [calibration]                # optional, free-form: what `hloplan calibrate` measured
    matmul_f32_large = 1.5e14    # (recorded for people and benchmarks; the planner ignores it)

    [buffers]                    # optional: how the platform's XLA compiler keeps values in memory
    fused_reductions = true      # reductions fuse the elementwise work they read (TPU): such
                                 # values are never written out, nor those of hloplan.tpu_buffers
                                 # (default false: the CPU compiler writes out what a reduction
                                 # reads)
    matmul_operands = "bf16"     # f32 values read only by matmuls are written in this dtype
                                 # (TPU: f32 dots at default precision run in bf16)
    tiled_layouts = true         # buffers take their bytes in TPU tiles (hloplan.tpu_buffers
                                 # .tiled_elements: minor dim to 128, second-minor to 8)

    [combiner]                   # optional: how XLA on this platform merges independent collectives
    all-reduce = "30MiB"         # bytes per merged collective; "unbounded": all merged into one;
    reduce-scatter = "30MiB"     # 0: never merged (each pays its full latency)
    all-gather = 0
    [combiner.reduce-scatter-apart]  # optional, TPU models: slices (of tpu_topology, chosen by
    "4x8" = "all"                # the mesh's device count) where libtpu merges no reduce-scatter
    "4x4" = "partial"            # ("all") or none over part of the slice ("partial": one over
                                 # every chip is merged)

    [collectives]                # optional: how the platform's compiler lays out collectives
    gathers = "per-dim"          # "per-dim": a reshard all-gathers each tensor dim on its own
                                 # (XLA's partitioner), staged one axis at a time where cheaper;
                                 # "one": one all-gather over all the axes it removes (libtpu)
    matmul-input-dtype = "bf16"  # optional: f32 matmul operands at default precision are
                                 # converted to this dtype before they are resharded
    reassociate = false          # true: add(all-reduce(a), all-reduce(b)) compiles as
                                 # all-reduce(a + b) (so do reduce-scatters): one collective
    collective-matmul = false    # true: a reduce-scattered matmul runs as a loop of chunk
                                 # matmuls and collective-permutes (libtpu's windowed einsum)
    merge-identical = false      # true: the compiler merges identical ops (same operands and
                                 # attributes) before partitioning, whatever their shardings:
                                 # the copy's readers reshard from the first's layout
    scatter-tiles = [8, 128]     # optional: a reduce-scatter runs on the (rows, lanes) tiles
                                 # of the partial sums' layout (libtpu: padded shards and a
                                 # collective-permute; collectives.CommModel.tiled_scatter)
    scatter-chunk = {tiles = 1071, exponent = 0.635, max-devices = 32, max-lane-tiles = 3}
                                 # optional: each padded shard is split in pieces of at most
                                 # tiles x n^-exponent tiles over n devices (ScatterChunk)
    vector-gather-lanes = 128    # optional: an all-gather of a vector (one dim longer than 1)
                                 # whose shard is not a multiple of this many elements runs as
                                 # an all-reduce of the zero-padded whole (libtpu)
    collective-matmul-intensity = 4224  # optional: a dot loops where its FLOPs per device reach
                                 # this per byte of one chunk (1/n) of its partial sums
                                 # (libtpu's check); absent: the estimated loop's time decides
    collective-matmul-side = true  # optional: a loop whose dot is replicated over the mesh axes
                                 # it does not reduce spans the whole slice or at most the
                                 # slice's shorter side (4 at least) of tpu_topology's slice
    collective-matmul-overlap = 1.0  # optional, 0 to 1: the share of the loop's sends that run
                                 # under its chunk kernels the planner counts as hidden

Without a [combiner] table: all-reduces and reduce-scatters merge into 30 MiB buffers (XLA's
default GPU threshold) and all-gathers are not merged (`DEFAULT_COMBINER`). The planner amortises
each merged collective's latency over the buffer (`collectives.CommModel`).

Levels must have strictly increasing `devices`, with 0 (unbounded) allowed only on the last one.
Unknown fields are errors, to catch typos.

`axis_links` maps each mesh axis to the level it communicates over; see its docstring.
"""

from __future__ import annotations

import math
import os
import tomllib
from dataclasses import dataclass, field, replace
from functools import cache, lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

from hloplan.mesh import MeshError, MeshSpec
from hloplan.units import parse_bytes

__all__ = [
    "PLATFORMS",
    "DEFAULT_COMBINER",
    "DeviceModel",
    "DeviceModelError",
    "Interconnect",
    "available_device_models",
    "axis_links",
    "load_device_model",
    "normalize_dtype",
]

PLATFORMS = ("cpu", "cuda", "rocm", "tpu")

_TOP_FIELDS = {
    "name",
    "aliases",
    "description",
    "platform",
    "memory",
    "hbm_bandwidth",
    "collective_overhead",
    "flops",
    "interconnect",
    "combiner",
    "collectives",
    "program_overhead",
    "tpu_topology",
    "calibration",
    "buffers",
    "matmul",
    "conv",
    "buffer_overhead",
    "matmul_row_tile",
    "partial_slice_devices",
}
_COMBINER_KINDS = ("all-reduce", "reduce-scatter", "all-gather")
# XLA's GPU pipeline merges all-reduces and reduce-scatters up to 30 MiB
# (kDefaultAllReduceCombineThreshold); all-gathers feed the next op and are planned as unmerged.
DEFAULT_COMBINER: dict[str, float] = {
    "all-reduce": 30.0 * 1024 * 1024, "reduce-scatter": 30.0 * 1024 * 1024, "all-gather": 0.0,
}
_APART = "reduce-scatter-apart"  # [combiner] sub-table: slices where libtpu merges none
_LEVEL_FIELDS = {"name", "devices", "bandwidth", "latency"}
_COLLECTIVES_FIELDS = ("gathers", "matmul-input-dtype", "reassociate", "collective-matmul",
                       "collective-matmul-intensity", "collective-matmul-side",
                       "collective-matmul-overlap", "collective-matmul-async-devices",
                       "merge-identical", "scatter-tiles", "scatter-chunk", "vector-gather-lanes")
_GATHERS = ("per-dim", "one")


class DeviceModelError(ValueError):
    """A device model that cannot be found or read."""


@dataclass(frozen=True)
class Interconnect:
    """One level of the interconnect hierarchy."""

    name: str
    devices: int  # devices reachable at this level; 0 = unbounded
    bandwidth: float  # bytes/s per device per direction, as the ring algorithm sees it
    latency: float  # seconds per collective step

    def __post_init__(self) -> None:
        if isinstance(self.devices, bool) or not isinstance(self.devices, int) or self.devices < 0:
            raise DeviceModelError(
                f"interconnect {self.name!r}: devices must be a non-negative integer"
            )
        if not (self.bandwidth > 0 and math.isfinite(self.bandwidth)):
            raise DeviceModelError(f"interconnect {self.name!r}: bandwidth must be positive")
        if not (self.latency >= 0 and math.isfinite(self.latency)):
            raise DeviceModelError(f"interconnect {self.name!r}: latency must be non-negative")


_NUMPY_DTYPES = {
    "float64": "f64",
    "double": "f64",
    "float32": "f32",
    "float": "f32",
    "float16": "f16",
    "half": "f16",
    "bfloat16": "bf16",
    "int8": "s8",
    "int16": "s16",
    "int32": "s32",
    "int64": "s64",
    "uint8": "u8",
    "uint16": "u16",
    "uint32": "u32",
    "uint64": "u64",
    "bool": "pred",
    "i1": "pred",
}


def normalize_dtype(dtype: object) -> str:
    """HLO-style lower-case dtype name: 'float32' -> 'f32', 'bfloat16' -> 'bf16', 'i32' -> 's32'.

    Accepts HLO names (f32, bf16, s32, u8, pred, f8E4M3FN), MLIR names (i32, i8) and NumPy names
    (float32, int32, float8_e4m3fn) or anything whose str() is one of these.
    """
    name = str(dtype).strip().lower()
    if name.startswith("float8") or name.startswith("f8"):
        return "f8"
    if name in _NUMPY_DTYPES:
        return _NUMPY_DTYPES[name]
    if len(name) > 1 and name[0] == "i" and name[1:].isdigit():
        return "s" + name[1:]
    if len(name) > 2 and name[:2] == "ui" and name[2:].isdigit():
        return "u" + name[2:]
    return name


@dataclass(frozen=True)
class ScatterChunk:
    """The pieces libtpu's all-reduce-scatter kernel splits each padded shard into: at most
    `tiles_at_one` x n^-`exponent` tiles a piece over a group of n devices (deviceless v5e
    compiles of scatter-adds over 2 to 32 devices: 690, 444, 286, 184 and 119 tiles over 2, 4,
    8, 16 and 32, each within the range the probes bound), and no padding over more than
    `max_devices` (256 of v5e:16x16 measured). Rows of more than `max_lane_tiles` lane tiles
    are one piece (two for an odd number): measured for rows of 1 to 3 lane tiles; wider rows
    follow no rule found."""

    tiles_at_one: float
    exponent: float
    max_devices: int
    max_lane_tiles: int

    def tiles(self, n: int) -> float:
        return self.tiles_at_one * n ** -self.exponent


@dataclass(frozen=True)
class DeviceModel:
    """Per-device performance figures and the interconnect hierarchy (innermost level first)."""

    name: str
    description: str
    platform: str
    memory_bytes: int
    hbm_bandwidth: float
    flops: dict[str, float] = field(hash=False)
    interconnect: tuple[Interconnect, ...]
    source: str = "<memory>"  # where it was loaded from: a path, or package:<file>
    # Seconds each collective call costs besides its ring steps (launch, synchronisation).
    collective_overhead: float = 0.0
    # Collective kind -> bytes per merged collective (inf: all merged; 0: none); see [combiner].
    combiner: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_COMBINER),
                                       hash=False)
    # [combiner.reduce-scatter-apart]: TPU slice shape ("4x8") -> which reduce-scatters libtpu
    # leaves unmerged there: "all", or "partial" (those over part of the slice); see
    # reduce_scatter_apart.
    unmerged_reduce_scatters: dict[str, str] = field(default_factory=dict, hash=False)
    # Seconds of fixed cost per program call (dispatch and launch), measured by calibrate.
    program_overhead: float = 0.0
    # TPU models: the libtpu topology kind ("v5e", "v6e", "v5p", "v4"); see hloplan.tpu.
    tpu_topology: str | None = None
    # What `hloplan calibrate` measured, as written in the file (informational).
    calibration: dict[str, Any] = field(default_factory=dict, hash=False)
    # [collectives]: "per-dim" (one all-gather per tensor dim, maybe staged per axis) or "one"
    # (one all-gather over every axis a reshard removes, as XLA's TPU compiler does).
    gathers: str = "per-dim"
    # [collectives]: the dtype f32 matmul operands at default precision are resharded in
    # (XLA's TPU compiler rounds them to bf16 for the MXU before the collective); None: f32.
    matmul_input_dtype: str | None = None
    # [collectives]: whether the compiler sums the partial results of two all-reduces (or
    # reduce-scatters) over the same axes that only an add reads before one collective.
    reassociate: bool = False
    # [collectives]: whether the compiler runs a reduce-scattered matmul as a loop of chunk
    # matmuls and collective-permutes (libtpu's windowed einsum; strategies.collective_matmul_time).
    collective_matmul: bool = False
    # [collectives]: a dot's FLOPs per device per byte of one chunk (1/n) of its partial sums
    # from which the compiler loops it (libtpu's windowed-einsum cost check, measured); None:
    # strategies.collective_matmul_time's own cost check decides.
    collective_matmul_intensity: float | None = None
    # [collectives]: a loop whose dot is replicated over the mesh axes it does not reduce spans
    # the whole slice or at most max(4, the slice's shorter side) devices (collective_matmul_spans).
    collective_matmul_side: bool = False
    # [collectives]: the share of a loop's sends that its chunk kernels could hide which the
    # planner counts as hidden (strategies._price): 1, all but the last two chunks' sends and
    # what outlasts the compute; 0, every send in full, as every other collective is counted.
    collective_matmul_overlap: float = 1.0
    # [collectives]: the most devices of a slice on which the compiler runs a loop's
    # collective-permutes asynchronously, beside its chunk kernels; on a larger slice they run
    # between the kernels and the loop's sends are counted in full (collective_matmul_overlap_on;
    # None: asynchronous on every slice).
    collective_matmul_async_devices: int | None = None
    # [collectives]: whether the compiler merges identical ops (same operands and attributes)
    # before it partitions the program, whatever shardings they were given (libtpu's CSE): one
    # op in one layout, the copy's readers resharding from it.
    merge_identical: bool = False
    # [collectives]: the (rows, lanes) tiles of the layout a reduce-scatter's partial sums are
    # kept in, which it scatters whole (libtpu's all-reduce-scatter kernel: padded shards and a
    # collective-permute of the rows one holds too many; CommModel.tiled_scatter); None: it
    # moves the partial sums' own bytes.
    scatter_tiles: tuple[int, int] | None = None
    # [collectives]: how many of those tiles one piece of a padded reduce-scatter holds at most
    # (ScatterChunk); None: every shard is one piece (two for rows of an odd number of lanes).
    scatter_chunk: ScatterChunk | None = None
    # [collectives]: an all-gather of a vector (one dim longer than 1) whose shard is not a
    # whole number of this many elements runs as an all-reduce of the zero-padded whole
    # (libtpu: a dynamic-update-slice into zeros, then an all-reduce); None: as an all-gather.
    vector_gather_lanes: int | None = None
    # [buffers]: reductions fuse the elementwise values they read, so those are never written
    # out; and the dtype f32 values read only by matmuls are written in (None: f32).
    fused_reductions: bool = False
    matmul_operands: str | None = None
    # [buffers]: buffers are sized in XLA's TPU tiled layouts (hloplan.tpu_buffers).
    tiled_layouts: bool = False
    # [matmul]: "sizes" -> grid of each dim; dtype -> [m][k][n] FLOP/s (see matmul_flops_for).
    matmul: dict[str, Any] = field(default_factory=dict, hash=False)
    # [conv]: dtype -> ((m, k, n, FLOP/s), ...) measured convolutions (see conv_flops_for).
    conv: dict[str, Any] = field(default_factory=dict, hash=False)
    # Seconds each argument or result buffer of a program call adds to it (dispatch).
    buffer_overhead: float = 0.0
    # The widest output tile of the compiler's matmul kernels (strategies.restream_passes);
    # None: a recomputed operand is read once.
    matmul_row_tile: int | None = None
    # TPU models: the most devices a slice may have for the compiler to build programs on
    # parts of it (pipeline stages on submeshes, the first stage's holding the slice's first
    # chips); None: any.
    partial_slice_devices: int | None = None

    def runs_partial_programs(self, devices: int) -> bool:
        """Whether a program may run on part of a mesh of `devices` devices, where the mesh
        is one slice (the innermost interconnect level reaches them all); a mesh of several
        slices is not judged here."""
        slice_devices = self.interconnect[0].devices if self.interconnect else 0
        return (self.partial_slice_devices is None or devices <= self.partial_slice_devices
                or 0 < slice_devices < devices)

    def unmerged_reduce_scatters_on(self, devices: int) -> str | None:
        """Which reduce-scatters libtpu leaves unmerged on the slice a mesh of `devices`
        devices is planned for (hloplan.tpu.topology_for): "all", "partial" (those over part
        of the slice) or None, per [combiner] reduce-scatter-apart."""
        if not self.unmerged_reduce_scatters or self.tpu_topology is None:
            return None
        from hloplan.diagnostics import UsageError
        from hloplan.tpu import topology_for

        try:
            shape = topology_for(self.tpu_topology, devices).name.split(":", 1)[1]
        except UsageError:  # no slice has that many devices (multislice): no rule
            return None
        return self.unmerged_reduce_scatters.get(shape)

    def collective_matmul_overlap_on(self, devices: int) -> float:
        """The share of collective-matmul loops' sends counted as hidden on a slice of
        `devices` devices: collective_matmul_overlap, or 0 on a slice larger than
        collective_matmul_async_devices."""
        limit = self.collective_matmul_async_devices
        return self.collective_matmul_overlap if limit is None or devices <= limit else 0.0

    def reduce_scatter_apart(self, devices: int, group: int) -> bool:
        """Whether libtpu leaves a reduce-scatter over `group` of a mesh of `devices` devices
        unmerged (each pays its whole latency; unmerged_reduce_scatters_on)."""
        which = self.unmerged_reduce_scatters_on(devices)
        return which == "all" or (which == "partial" and group < devices)

    def collective_matmul_spans(self, devices: int, group: int, replicated: bool) -> bool:
        """Whether libtpu can loop a reduce-scattered dot over `group` of the slice of `devices`
        devices: per collective_matmul_side, a dot replicated over the other mesh axes loops
        over the whole slice or over at most max(4, the slice's shorter side) devices."""
        if not (self.collective_matmul_side and replicated) or group >= devices \
                or self.tpu_topology is None:
            return True
        from hloplan.diagnostics import UsageError
        from hloplan.tpu import topology_for

        try:
            shape = topology_for(self.tpu_topology, devices).shape
        except UsageError:  # no slice has that many devices (multislice): no rule
            return True
        return group <= max(4, min(shape))

    def call_overhead(self, buffers: int) -> float:
        """Seconds a program call with `buffers` argument and result buffers spends outside
        its kernels: program_overhead plus buffer_overhead per buffer."""
        return self.program_overhead + self.buffer_overhead * buffers

    def conv_flops_for(self, dtype_name: object, m: float, k: float, n: float) -> float:
        """FLOP/s of a convolution whose implicit matmul is (m, k) x (k, n): the [conv] points
        of the dtype (f32's where the dtype has none: the MXU runs f32 convolutions at default
        precision in bf16) weighted by inverse squared distance in log2 of each dim, the
        nearest four; flops_for(dtype) without a [conv] table."""
        points = self.conv.get(normalize_dtype(dtype_name)) or self.conv.get("f32")
        if not points:
            return self.flops_for(dtype_name)
        at = [math.log2(max(v, 1.0)) for v in (m, k, n)]
        near = sorted((sum((math.log2(p[i]) - at[i]) ** 2 for i in range(3)), p[3])
                      for p in points)[:4]
        if near[0][0] < 1e-12:
            return near[0][1]
        weights = [1.0 / d for d, _ in near]
        return sum(w * rate for w, (_, rate) in zip(weights, near)) / sum(weights)

    def matmul_flops_for(self, dtype_name: object, m: float, k: float, n: float) -> float:
        """FLOP/s of an (m, k) x (k, n) matmul in `dtype_name`: the [matmul] table interpolated
        linearly in log2 of each dim (clamped to the grid); flops_for(dtype) where the table has
        no entry for the dtype."""
        table = self.matmul.get(normalize_dtype(dtype_name))
        if table is None:
            return self.flops_for(dtype_name)
        logs = [math.log2(s) for s in self.matmul["sizes"]]
        corners = []
        for size in (m, k, n):
            x = math.log2(max(size, 1.0))
            if x <= logs[0] or len(logs) == 1:
                corners.append(((0, 1.0),))
            elif x >= logs[-1]:
                corners.append(((len(logs) - 1, 1.0),))
            else:
                i = next(j for j in range(1, len(logs)) if logs[j] >= x) - 1
                w = (x - logs[i]) / (logs[i + 1] - logs[i])
                corners.append(((i, 1.0 - w), (i + 1, w)))
        return sum(wm * wk * wn * table[i][j][q] for i, wm in corners[0]
                   for j, wk in corners[1] for q, wn in corners[2])

    def flops_for(self, dtype_name: object) -> float:
        """Peak FLOP/s for arithmetic in `dtype_name`.

        Exact entries win ('f32', 'bf16', or e.g. 's8' if the table has it); any fp8 variant
        ('f8E4M3FN', 'float8_e5m2', ...) uses 'f8'; everything else, integers included, uses
        'default'.
        """
        name = normalize_dtype(dtype_name)
        if name in self.flops:
            return self.flops[name]
        raw = str(dtype_name).strip().lower()
        if raw in self.flops:
            return self.flops[raw]
        return self.flops["default"]

    def level(self, name: str) -> Interconnect:
        """The interconnect level called `name`."""
        for level in self.interconnect:
            if level.name == name:
                return level
        known = ", ".join(level.name for level in self.interconnect)
        raise DeviceModelError(f"device model {self.name!r} has no interconnect {name!r} ({known})")

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "<dict>") -> DeviceModel:
        """Build a model from parsed TOML (the schema in this module's docstring)."""
        return _parse_model(data, source)


# --- parsing ---------------------------------------------------------------------------------


def _fail(source: str, message: str) -> DeviceModelError:
    return DeviceModelError(f"{source}: {message}")


def _require(data: dict[str, Any], key: str, source: str, where: str = "") -> Any:
    if key not in data:
        raise _fail(source, f"missing field '{where}{key}'")
    return data[key]


def _string(value: Any, source: str, field_name: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise _fail(source, f"field '{field_name}' must be a non-empty string, got {value!r}")
    return value


def _number(value: Any, source: str, field_name: str, *, positive: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise _fail(source, f"field '{field_name}' must be a number, got {value!r}")
    if positive and value <= 0:
        raise _fail(source, f"field '{field_name}' must be positive, got {value!r}")
    if not positive and value < 0:
        raise _fail(source, f"field '{field_name}' must not be negative, got {value!r}")
    if value and not 1e-30 <= abs(value) <= 1e30:  # estimates in such units overflow
        raise _fail(source, f"field '{field_name}' is {value!r}, outside 1e-30 to 1e30")
    return float(value)


def _parse_model(data: dict[str, Any], source: str) -> DeviceModel:
    if not isinstance(data, dict):
        raise _fail(source, "expected a table at the top level")
    unknown = sorted(set(data) - _TOP_FIELDS)
    if unknown:
        raise _fail(
            source,
            f"unknown field(s) {', '.join(map(repr, unknown))} "
            f"(known: {', '.join(sorted(_TOP_FIELDS))})",
        )
    name = _string(_require(data, "name", source), source, "name")
    aliases = data.get("aliases", [])
    if not isinstance(aliases, list) or not all(isinstance(a, str) and a for a in aliases):
        raise _fail(source, f"field 'aliases' must be a list of strings, got {aliases!r}")
    description = data.get("description", "")
    if not isinstance(description, str):
        raise _fail(source, f"field 'description' must be a string, got {description!r}")
    platform = _string(_require(data, "platform", source), source, "platform")
    if platform not in PLATFORMS:
        raise _fail(
            source, f"field 'platform' must be one of {', '.join(PLATFORMS)}, got {platform!r}"
        )
    memory = _require(data, "memory", source)
    try:
        memory_bytes = parse_bytes(memory)
    except ValueError as exc:
        raise _fail(source, f"field 'memory': {exc}") from None
    if memory_bytes <= 0:
        raise _fail(source, "field 'memory' must be positive")
    hbm = _number(_require(data, "hbm_bandwidth", source), source, "hbm_bandwidth")
    overhead = _number(data.get("collective_overhead", 0.0), source, "collective_overhead",
                       positive=False)
    program_overhead = _number(data.get("program_overhead", 0.0), source, "program_overhead",
                               positive=False)
    tpu_topology = data.get("tpu_topology")
    if tpu_topology is not None:
        tpu_topology = _string(tpu_topology, source, "tpu_topology")
        if platform != "tpu":
            raise _fail(source, "field 'tpu_topology' needs platform = \"tpu\"")
    calibration = data.get("calibration", {})
    if not isinstance(calibration, dict):
        raise _fail(source, "field 'calibration' must be a table ([calibration])")

    flops_table = _require(data, "flops", source)
    if not isinstance(flops_table, dict):
        raise _fail(source, "field 'flops' must be a table ([flops])")
    flops: dict[str, float] = {}
    for key, value in flops_table.items():
        flops[normalize_dtype(key)] = _number(value, source, f"flops.{key}")
    if "default" not in flops:
        raise _fail(source, "missing field 'flops.default'")

    matmul = _parse_matmul(data.get("matmul"), source)
    conv = _parse_conv(data.get("conv"), source)
    buffer_overhead = _number(data.get("buffer_overhead", 0.0), source, "buffer_overhead",
                              positive=False)
    row_tile = data.get("matmul_row_tile")
    if row_tile is not None and (isinstance(row_tile, bool) or not isinstance(row_tile, int)
                                 or row_tile < 128 or row_tile % 128):
        raise _fail(source, "field 'matmul_row_tile' must be a positive multiple of 128")
    partial = data.get("partial_slice_devices")
    if partial is not None and (isinstance(partial, bool) or not isinstance(partial, int)
                                or partial < 1):
        raise _fail(source, "field 'partial_slice_devices' must be a positive integer")

    levels_data = _require(data, "interconnect", source)
    if not isinstance(levels_data, list) or not levels_data:
        raise _fail(
            source, "field 'interconnect' must be a non-empty array of tables ([[interconnect]])"
        )
    levels: list[Interconnect] = []
    for i, level in enumerate(levels_data):
        where = f"interconnect[{i}]."
        if not isinstance(level, dict):
            raise _fail(source, f"field 'interconnect[{i}]' must be a table")
        unknown = sorted(set(level) - _LEVEL_FIELDS)
        if unknown:
            raise _fail(source, f"unknown field(s) {', '.join(where + k for k in unknown)}")
        level_name = _string(_require(level, "name", source, where), source, where + "name")
        devices = _require(level, "devices", source, where)
        if isinstance(devices, bool) or not isinstance(devices, int) or devices < 0:
            raise _fail(
                source,
                f"field '{where}devices' must be a non-negative integer "
                f"(0 = unbounded), got {devices!r}",
            )
        bandwidth = _number(
            _require(level, "bandwidth", source, where), source, where + "bandwidth"
        )
        latency = _number(
            _require(level, "latency", source, where), source, where + "latency", positive=False
        )
        levels.append(Interconnect(level_name, devices, bandwidth, latency))
    for i, level in enumerate(levels):
        if level.devices == 0 and i != len(levels) - 1:
            raise _fail(
                source,
                f"field 'interconnect[{i}].devices': only the last level may be unbounded (0)",
            )
        if i and level.devices and level.devices <= levels[i - 1].devices:
            raise _fail(
                source,
                f"field 'interconnect[{i}].devices': levels must reach strictly "
                f"more devices than the level inside them ({level.devices} <= "
                f"{levels[i - 1].devices})",
            )
    return DeviceModel(
        name=name,
        description=description,
        platform=platform,
        memory_bytes=memory_bytes,
        hbm_bandwidth=hbm,
        flops=flops,
        interconnect=tuple(levels),
        source=source,
        collective_overhead=overhead,
        combiner=_parse_combiner(data.get("combiner", {}), source),
        unmerged_reduce_scatters=_parse_apart(data.get("combiner", {}), source),
        program_overhead=program_overhead,
        tpu_topology=tpu_topology,
        calibration=dict(calibration),
        **_parse_collectives(data.get("collectives", {}), source),
        **_parse_buffers(data.get("buffers", {}), source),
        matmul=matmul,
        conv=conv,
        buffer_overhead=buffer_overhead,
        matmul_row_tile=row_tile,
        partial_slice_devices=partial,
    )


def _parse_collectives(table: Any, source: str) -> dict[str, Any]:
    if not isinstance(table, dict):
        raise _fail(source, "field 'collectives' must be a table ([collectives])")
    found = {}
    for key, value in table.items():
        name = key.strip().lower().replace("_", "-")
        if name not in _COLLECTIVES_FIELDS:
            raise _fail(source, f"unknown field 'collectives.{key}' (known: "
                                f"{', '.join(_COLLECTIVES_FIELDS)})")
        if name == "collective-matmul-intensity":
            found["collective_matmul_intensity"] = _number(value, source, f"collectives.{key}")
            continue
        if name == "collective-matmul-overlap":
            share = _number(value, source, f"collectives.{key}", positive=False)
            if not 0.0 <= share <= 1.0:
                raise _fail(source, f"field 'collectives.{key}' must be between 0 and 1, "
                                    f"got {value!r}")
            found["collective_matmul_overlap"] = share
            continue
        if name in ("reassociate", "collective-matmul", "merge-identical",
                    "collective-matmul-side"):
            if not isinstance(value, bool):
                raise _fail(source, f"field 'collectives.{key}' must be true or false, "
                                    f"got {value!r}")
            found[name.replace("-", "_")] = value
            continue
        if name == "scatter-tiles":
            if (not isinstance(value, list) or len(value) != 2
                    or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0
                               for v in value)):
                raise _fail(source, f"field 'collectives.{key}' must be two positive integers "
                                    f"[rows, lanes], got {value!r}")
            found["scatter_tiles"] = (value[0], value[1])
            continue
        if name == "scatter-chunk":
            found["scatter_chunk"] = _scatter_chunk(value, source, f"collectives.{key}")
            continue
        if name in ("vector-gather-lanes", "collective-matmul-async-devices"):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise _fail(source, f"field 'collectives.{key}' must be a positive integer, "
                                    f"got {value!r}")
            found[name.replace("-", "_")] = value
            continue
        value = _string(value, source, f"collectives.{key}")
        if name == "matmul-input-dtype":
            value = normalize_dtype(value)
        elif value not in _GATHERS:
            raise _fail(source, f"field 'collectives.{key}' must be one of "
                                f"{', '.join(map(repr, _GATHERS))}, got {value!r}")
        found[name.replace("-", "_")] = value
    return found


def _scatter_chunk(value: Any, source: str, where: str) -> ScatterChunk:
    fields = {"tiles", "exponent", "max-devices", "max-lane-tiles"}
    if not isinstance(value, dict) or set(value) != fields:
        raise _fail(source, f"field '{where}' must be a table of {', '.join(sorted(fields))}, "
                            f"got {value!r}")
    tiles = _number(value["tiles"], source, f"{where}.tiles")
    exponent = _number(value["exponent"], source, f"{where}.exponent", positive=False)
    counts = []
    for name, least in (("max-devices", 2), ("max-lane-tiles", 1)):
        count = value[name]
        if not isinstance(count, int) or isinstance(count, bool) or count < least:
            raise _fail(source, f"field '{where}.{name}' must be an integer of at least {least},"
                                f" got {count!r}")
        counts.append(count)
    return ScatterChunk(float(tiles), float(exponent), *counts)


_BUFFERS_FIELDS = {"fused_reductions", "matmul_operands", "tiled_layouts"}


def _parse_buffers(table: Any, source: str) -> dict[str, Any]:
    if not isinstance(table, dict):
        raise _fail(source, "field 'buffers' must be a table ([buffers])")
    unknown = sorted(set(table) - _BUFFERS_FIELDS)
    if unknown:
        raise _fail(source, f"unknown field(s) {', '.join('buffers.' + k for k in unknown)} "
                            f"(known: {', '.join(sorted(_BUFFERS_FIELDS))})")
    out: dict[str, Any] = {}
    if "fused_reductions" in table:
        if not isinstance(table["fused_reductions"], bool):
            raise _fail(source, "field 'buffers.fused_reductions' must be true or false")
        out["fused_reductions"] = table["fused_reductions"]
    if "tiled_layouts" in table:
        if not isinstance(table["tiled_layouts"], bool):
            raise _fail(source, "field 'buffers.tiled_layouts' must be true or false")
        out["tiled_layouts"] = table["tiled_layouts"]
    if "matmul_operands" in table:
        dtype = normalize_dtype(_string(table["matmul_operands"], source,
                                        "buffers.matmul_operands"))
        if dtype not in ("bf16", "f16", "f32"):
            raise _fail(source, f"field 'buffers.matmul_operands' must be bf16, f16 or f32, "
                                f"got {table['matmul_operands']!r}")
        out["matmul_operands"] = None if dtype == "f32" else dtype
    return out


def _parse_matmul(table: Any, source: str) -> dict[str, Any]:
    """[matmul]: sizes (increasing positive ints) and per dtype a [m][k][n] grid of rates."""
    if table is None:
        return {}
    if not isinstance(table, dict):
        raise _fail(source, "field 'matmul' must be a table ([matmul])")
    sizes = table.get("sizes")
    if (not isinstance(sizes, list) or not sizes
            or not all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in sizes)
            or any(b <= a for a, b in zip(sizes, sizes[1:]))):
        raise _fail(source, "field 'matmul.sizes' must be a list of increasing positive integers")
    out: dict[str, Any] = {"sizes": tuple(sizes)}
    count = len(sizes)
    for key, grid in table.items():
        if key == "sizes":
            continue
        if not (isinstance(grid, list) and len(grid) == count
                and all(isinstance(p, list) and len(p) == count
                        and all(isinstance(r, list) and len(r) == count for r in p)
                        for p in grid)):
            raise _fail(source, f"field 'matmul.{key}' must be a {count} x {count} x {count} "
                                "array ([m][k][n], one entry per size)")
        out[normalize_dtype(key)] = tuple(
            tuple(tuple(_number(v, source, f"matmul.{key}") for v in row) for row in plane)
            for plane in grid)
    return out


def _parse_conv(table: Any, source: str) -> dict[str, Any]:
    """[conv]: per dtype a list of [m, k, n, FLOP/s] points (positive numbers)."""
    if table is None:
        return {}
    if not isinstance(table, dict):
        raise _fail(source, "field 'conv' must be a table ([conv])")
    out: dict[str, Any] = {}
    for key, points in table.items():
        if not (isinstance(points, list) and points
                and all(isinstance(p, list) and len(p) == 4 for p in points)):
            raise _fail(source, f"field 'conv.{key}' must be a non-empty list of "
                                "[m, k, n, FLOP/s] points")
        out[normalize_dtype(key)] = tuple(
            tuple(_number(v, source, f"conv.{key}") for v in p) for p in points)
    return out


def _parse_combiner(table: Any, source: str) -> dict[str, float]:
    if not isinstance(table, dict):
        raise _fail(source, "field 'combiner' must be a table ([combiner])")
    combiner = dict(DEFAULT_COMBINER)
    for key, value in table.items():
        if key == _APART:
            continue
        kind = key.strip().lower().replace("_", "-")
        if kind not in _COMBINER_KINDS:
            raise _fail(source, f"unknown field 'combiner.{key}' (known: "
                                f"{', '.join(_COMBINER_KINDS)})")
        if isinstance(value, str) and value.strip().lower() == "unbounded":
            combiner[kind] = math.inf
            continue
        try:
            size = parse_bytes(value) if isinstance(value, str) else value
        except ValueError as exc:
            raise _fail(source, f"field 'combiner.{key}': {exc}") from None
        combiner[kind] = _number(size, source, f"combiner.{key}", positive=False)
    return combiner


def _parse_apart(table: Any, source: str) -> dict[str, str]:
    apart = table.get(_APART, {}) if isinstance(table, dict) else {}
    if not isinstance(apart, dict):
        raise _fail(source, f"field 'combiner.{_APART}' must be a table of slice shapes")
    out = {}
    for shape, which in apart.items():
        if which not in ("all", "partial"):
            raise _fail(source, f"field 'combiner.{_APART}.{shape}' must be \"all\" or "
                                f"\"partial\", not {which!r}")
        out[shape.strip().lower()] = which
    return out


def _load_text(text: str, source: str) -> DeviceModel:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise _fail(source, f"invalid TOML: {exc}") from None
    return _parse_model(data, source)


def _key(name: str) -> str:
    return name.strip().lower().replace("_", "-")


@lru_cache(maxsize=1)
def _package_index() -> dict[str, tuple[str, tuple[str, ...]]]:
    """Shipped model files: file name -> (model name, aliases), read once."""
    index: dict[str, tuple[str, tuple[str, ...]]] = {}
    root = resources.files(__package__ or "hloplan.cost_models")
    for entry in sorted(root.iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".toml"):
            try:
                data = tomllib.loads(entry.read_text(encoding="utf-8"))
            except tomllib.TOMLDecodeError as exc:
                raise _fail(f"package:{entry.name}", f"invalid TOML: {exc}") from None
            name = data.get("name", entry.name[: -len(".toml")])
            aliases = data.get("aliases", [])
            index[entry.name] = (str(name), tuple(str(a) for a in aliases))
    return index


def available_device_models() -> list[str]:
    """Names of the shipped device models, sorted."""
    return sorted(name for name, _ in _package_index().values())


def _resolve_name(name: str) -> str | None:
    """The shipped file for a model name, alias or file stem, or None."""
    wanted = _key(name)
    for file_name, (model_name, aliases) in _package_index().items():
        keys = {_key(model_name), _key(file_name[: -len(".toml")])} | {_key(a) for a in aliases}
        if wanted in keys:
            return file_name
    return None


def _looks_like_path(text: str) -> bool:
    # Deliberately not "exists on disk": a stray file called "cpu" must not shadow the model.
    return text.endswith(".toml") or os.sep in text or "/" in text


def load_device_model(name_or_path: str | os.PathLike[str]) -> DeviceModel:
    """Load a shipped model by name or alias ("h100", "h100-sxm", "tpu-v5e", "cpu"), or a TOML file.

    A Path, or a string ending in ".toml" or containing a path separator, is read as a file;
    anything else is a model name. Names are case-insensitive and '_' matches '-'. Raises DeviceModelError for an unknown name
    (listing the known ones), an unreadable file, invalid TOML, or a missing or malformed field
    (naming the file and the field).
    """
    if isinstance(name_or_path, os.PathLike) or _looks_like_path(str(name_or_path)):
        path = Path(name_or_path)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise DeviceModelError(
                f"cannot read device model file {str(path)!r}: {exc.strerror or exc}"
            ) from None
        except UnicodeDecodeError as exc:
            raise DeviceModelError(
                f"device model file {str(path)!r} is not UTF-8 text (byte {exc.start})"
            ) from None
        return _load_text(text, str(path))
    file_name = _resolve_name(str(name_or_path))
    if file_name is None:
        known = ", ".join(available_device_models())
        raise DeviceModelError(
            f"unknown device model {str(name_or_path)!r}; known models: {known} "
            "(or pass a path to a TOML file)"
        )
    model = _load_shipped(file_name)
    # A fresh flops dict, so that callers who edit it do not change the cached model.
    return replace(model, flops=dict(model.flops))


@cache
def _load_shipped(file_name: str) -> DeviceModel:
    root = resources.files(__package__ or "hloplan.cost_models")
    text = root.joinpath(file_name).read_text(encoding="utf-8")
    return _load_text(text, f"package:{file_name}")


# --- mesh axes onto links ---------------------------------------------------------------------


def axis_links(
    model: DeviceModel, mesh: MeshSpec, hosts: int | None = None
) -> tuple[Interconnect, ...]:
    """The interconnect level each mesh axis communicates over, one entry per axis.

    Devices are laid out row-major over the mesh (last axis fastest). Mesh axis i with size n and
    stride s (the product of the sizes of the axes after it) groups devices s apart, so each of
    its groups lies within a block of s*n consecutive devices. The axis runs over the innermost
    level that holds such a block whole: `devices` == 0 (unbounded), or `devices` >= s*n and a
    multiple of it, so that blocks do not straddle a level boundary (for power-of-two sizes this
    is just `devices` >= s*n). That is the slowest link the axis crosses. If no level holds the
    block (the mesh is larger than the outermost bounded level), the outermost level is used.

    If `hosts` is given, the innermost level is taken to hold mesh.size // hosts devices (one host
    each), so an axis that crosses hosts runs over the next level out.
    """
    levels = model.interconnect
    # Devices each level holds, for this mesh; 0 = unbounded.
    capacity = [level.devices for level in levels]
    if hosts is not None:
        if isinstance(hosts, bool) or not isinstance(hosts, int) or hosts <= 0:
            raise MeshError(f"hosts must be a positive integer, got {hosts!r}")
        if mesh.size % hosts:
            raise MeshError(
                f"mesh {mesh} has {mesh.size} devices, which do not split evenly over {hosts} hosts"
            )
        capacity[0] = mesh.size // hosts

    def holds(i: int, span: int) -> bool:
        return capacity[i] == 0 or (capacity[i] >= span and capacity[i] % span == 0)

    links: list[Interconnect] = []
    stride = 1
    for size in reversed(mesh.axis_sizes):
        span = stride * size
        index = next((i for i in range(len(levels)) if holds(i, span)), len(levels) - 1)
        links.append(levels[index])
        stride = span
    return tuple(reversed(links))
