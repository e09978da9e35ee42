"""Device models (TOML), mesh axes onto links, and the alpha-beta collective cost model.

Expected numbers are worked out by hand in each test, from the formulas in
hloplan.cost_models.collectives.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from hloplan.cost_models import (
    CommModel,
    DeviceModel,
    DeviceModelError,
    Interconnect,
    available_device_models,
    axis_links,
    load_device_model,
    local_bytes,
    normalize_dtype,
)
from hloplan.mesh import MeshError, parse_mesh

MiB = 1024**2
GiB = 1024**3

SHIPPED = ["cpu", "h100", "h100-slow-ib", "tpu-v5e"]

MINIMAL = """\
name = "toy"
platform = "cpu"
memory = "1GiB"
hbm_bandwidth = 1e10

[flops]
f32 = 1e10
default = 1e9

[[interconnect]]
name = "net"
devices = 0
bandwidth = 100e9
latency = 1e-6
"""


def toy_model(**overrides: object) -> DeviceModel:
    """One unbounded level at 100 GB/s and 1 us per step, so hand numbers stay simple."""
    data: dict[str, object] = {
        "name": "toy",
        "platform": "cpu",
        "memory": "1GiB",
        "hbm_bandwidth": 1e10,
        "flops": {"f32": 1e10, "default": 1e9},
        "interconnect": [{"name": "net", "devices": 0, "bandwidth": 100e9, "latency": 1e-6}],
    }
    data.update(overrides)
    return DeviceModel.from_dict(data)


# --- loading ---------------------------------------------------------------------------------


def test_available_device_models() -> None:
    names = available_device_models()
    assert set(SHIPPED) <= set(names)
    assert names == sorted(names)


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_model_loads(name: str) -> None:
    model = load_device_model(name)
    assert model.name == name
    assert model.source == f"package:{name}.toml"
    assert model.description
    assert model.platform in ("cpu", "cuda", "rocm", "tpu")
    assert model.memory_bytes > 0 and model.hbm_bandwidth > 0
    assert "default" in model.flops and all(v > 0 for v in model.flops.values())
    assert model.interconnect and model.interconnect[-1].devices == 0
    hash(model)  # usable as a dict key despite the flops dict


def test_h100_figures() -> None:
    model = load_device_model("h100")
    assert model.platform == "cuda"
    assert model.memory_bytes == 80 * GiB
    assert model.hbm_bandwidth == 3.35e12
    assert model.flops_for("bf16") == 989.4e12
    assert [(lvl.name, lvl.devices, lvl.bandwidth) for lvl in model.interconnect] == [
        ("nvlink", 8, 450e9),
        ("infiniband", 0, 50e9),
    ]
    slow = load_device_model("h100-slow-ib")
    assert slow.interconnect[0] == model.interconnect[0]
    assert slow.interconnect[1].bandwidth == 25e9


def test_tpu_v5e_and_cpu_figures() -> None:
    tpu = load_device_model("tpu-v5e")
    assert (tpu.platform, tpu.memory_bytes, tpu.hbm_bandwidth) == ("tpu", int(15.75 * GiB), 628e9)
    assert tpu.flops_for("bf16") == 185e12
    assert tpu.interconnect[0].devices == 256
    cpu = load_device_model("cpu")
    assert (cpu.platform, cpu.memory_bytes, cpu.hbm_bandwidth) == ("cpu", 8 * GiB, 20e9)
    assert cpu.flops_for("f32") == 100e9
    assert cpu.interconnect == (Interconnect("shared-memory", 0, 10e9, 10e-6),)


@pytest.mark.parametrize(
    ("alias", "name"),
    [
        ("h100-sxm", "h100"),
        ("H100", "h100"),
        ("h100_slow_ib", "h100-slow-ib"),
        ("v5e", "tpu-v5e"),
        (" cpu ", "cpu"),
    ],
)
def test_aliases(alias: str, name: str) -> None:
    assert load_device_model(alias).name == name


def test_loaded_model_is_a_copy() -> None:
    model = load_device_model("cpu")
    model.flops["f32"] = 1.0
    assert load_device_model("cpu").flops["f32"] == 100e9


def test_unknown_name_lists_known_models() -> None:
    with pytest.raises(DeviceModelError) as info:
        load_device_model("a100")
    message = str(info.value)
    assert "unknown device model 'a100'" in message
    for name in SHIPPED:
        assert name in message


def test_load_from_path(tmp_path: Path) -> None:
    path = tmp_path / "toy.toml"
    path.write_text(MINIMAL)
    for arg in (path, str(path)):
        model = load_device_model(arg)
        assert model.name == "toy"
        assert model.source == str(path)
        assert model.memory_bytes == GiB
        assert model.description == ""
        assert model.interconnect == (Interconnect("net", 0, 100e9, 1e-6),)


def test_missing_file() -> None:
    with pytest.raises(
        DeviceModelError, match="cannot read device model file '/nonexistent/x.toml'"
    ):
        load_device_model("/nonexistent/x.toml")


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        ('name = "toy"', 'name = "toy', "invalid TOML"),
        ('name = "toy"\n', "", "missing field 'name'"),
        ("hbm_bandwidth = 1e10\n", "", "missing field 'hbm_bandwidth'"),
        (
            "hbm_bandwidth = 1e10",
            'hbm_bandwidth = "fast"',
            "field 'hbm_bandwidth' must be a number",
        ),
        ("hbm_bandwidth = 1e10", "hbm_bandwidth = 0", "field 'hbm_bandwidth' must be positive"),
        ('memory = "1GiB"', 'memory = "1 GX"', "field 'memory': invalid byte size"),
        ('platform = "cpu"', 'platform = "gpu"', "field 'platform' must be one of cpu, cuda"),
        ("default = 1e9\n", "", "missing field 'flops.default'"),
        ("f32 = 1e10", "f32 = -1", "field 'flops.f32' must be positive"),
        ("bandwidth = 100e9\n", "", "missing field 'interconnect[0].bandwidth'"),
        (
            "latency = 1e-6",
            "latency = -1.0",
            "field 'interconnect[0].latency' must not be negative",
        ),
        ("devices = 0", "devices = 1.5", "field 'interconnect[0].devices' must be a non-negative"),
        ("devices = 0", "devices = 0\nspeed = 3", "unknown field(s) interconnect[0].speed"),
        ('name = "toy"', 'name = "toy"\nhbm_bandwith = 3', "unknown field(s) 'hbm_bandwith'"),
        ("latency = 1e-6\n", "latency = 1e-6\n[combiner]\nall-to-all = 0\n",
         "unknown field 'combiner.all-to-all'"),
        ("latency = 1e-6\n", "latency = 1e-6\n[combiner]\nall-reduce = 'lots'\n",
         "field 'combiner.all-reduce': invalid byte size"),
        ("latency = 1e-6\n", "latency = 1e-6\n[combiner]\nall-reduce = -1\n",
         "field 'combiner.all-reduce' must not be negative"),
        (
            "[[interconnect]]",
            "[[interconnect]]\nname = 'x'\ndevices = 0\nbandwidth = 1.0\n"
            "latency = 0.0\n[[interconnect]]",
            "only the last level may be unbounded",
        ),
        (
            "[[interconnect]]",
            "[[interconnect]]\nname = 'x'\ndevices = 8\nbandwidth = 1.0\n"
            "latency = 0.0\n[[interconnect]]\nname = 'y'\ndevices = 4\nbandwidth = 1.0\n"
            "latency = 0.0\n[[interconnect]]",
            "levels must reach strictly more devices",
        ),
    ],
)
def test_bad_toml(tmp_path: Path, old: str, new: str, message: str) -> None:
    assert old in MINIMAL
    path = tmp_path / "bad.toml"
    path.write_text(MINIMAL.replace(old, new, 1))
    with pytest.raises(DeviceModelError) as info:
        load_device_model(path)
    assert str(info.value).startswith(f"{path}: ")
    assert message in str(info.value)


def test_interconnect_validates() -> None:
    with pytest.raises(DeviceModelError, match="bandwidth must be positive"):
        Interconnect("x", 0, 0.0, 1e-6)
    with pytest.raises(DeviceModelError, match="devices must be a non-negative integer"):
        Interconnect("x", -1, 1.0, 1e-6)


# --- dtypes ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dtype", "expected"),
    [
        ("f32", "f32"),
        ("float32", "f32"),
        ("bfloat16", "bf16"),
        ("BF16", "bf16"),
        ("f8E4M3FN", "f8"),
        ("float8_e5m2", "f8"),
        ("i32", "s32"),
        ("int8", "s8"),
        ("ui8", "u8"),
        ("s32", "s32"),
        ("pred", "pred"),
        ("bool", "pred"),
    ],
)
def test_normalize_dtype(dtype: str, expected: str) -> None:
    assert normalize_dtype(dtype) == expected


def test_flops_for() -> None:
    h100 = load_device_model("h100")
    assert h100.flops_for("f32") == 494.7e12
    assert h100.flops_for("float32") == 494.7e12
    assert h100.flops_for("bf16") == 989.4e12
    assert h100.flops_for("f16") == 989.4e12
    assert h100.flops_for("f8E4M3FN") == 1978.9e12
    assert h100.flops_for("f8E5M2") == 1978.9e12
    assert h100.flops_for("f64") == 66.9e12
    for integer in ("i32", "s32", "s8", "u8", "int64", "pred"):
        assert h100.flops_for(integer) == h100.flops["default"] == 66.9e12
    assert h100.flops_for("c64") == 66.9e12  # unknown: default
    cpu = load_device_model("cpu")
    assert cpu.flops_for("f8E4M3FN") == 100e9  # no f8 entry: default


# --- axis_links ------------------------------------------------------------------------------


def link_names(model: str, mesh: str, hosts: int | None = None) -> tuple[str, ...]:
    return tuple(lvl.name for lvl in axis_links(load_device_model(model), parse_mesh(mesh), hosts))


def test_axis_links_h100() -> None:
    # 8x4: minor axis (4, stride 1) spans 4 devices -> nvlink; major axis (8, stride 4) spans
    # 32 devices -> more than a node of 8 -> infiniband.
    assert link_names("h100", "8x4") == ("infiniband", "nvlink")
    # 4x8: minor axis spans exactly one node -> nvlink; major spans 32 -> infiniband.
    assert link_names("h100", "4x8") == ("infiniband", "nvlink")
    # 2x4: the whole mesh fits a node of 8.
    assert link_names("h100", "2x4") == ("nvlink", "nvlink")
    assert link_names("h100", "2x2x2") == ("nvlink", "nvlink", "nvlink")
    assert link_names("h100", "8") == ("nvlink",)
    assert link_names("h100", "16") == ("infiniband",)
    # 2x8x2: z spans 2, y spans 16 (crosses nodes), x spans 32.
    assert link_names("h100", "2x8x2") == ("infiniband", "infiniband", "nvlink")
    # An axis of 3 does not tile a node of 8: some groups straddle two nodes.
    assert link_names("h100", "3") == ("infiniband",)


def test_axis_links_hosts() -> None:
    # 2x4 on 2 hosts: 4 devices per host, so the axis of 2 (spanning 8) crosses hosts.
    assert link_names("h100", "2x4", hosts=2) == ("infiniband", "nvlink")
    assert link_names("h100", "2x4", hosts=1) == ("nvlink", "nvlink")
    assert link_names("h100", "2x4", hosts=8) == ("infiniband", "infiniband")
    # The link objects are the model's own levels.
    model = load_device_model("h100")
    assert axis_links(model, parse_mesh("2x4"), hosts=2) == model.interconnect[::-1]
    with pytest.raises(MeshError, match="do not split evenly over 3 hosts"):
        axis_links(model, parse_mesh("2x4"), hosts=3)
    with pytest.raises(MeshError, match="hosts must be a positive integer"):
        axis_links(model, parse_mesh("2x4"), hosts=0)


def test_axis_links_tpu_and_cpu() -> None:
    assert link_names("tpu-v5e", "16x16") == ("ici", "ici")
    # 4x16x16 = 1024 chips: the major axis spans 4 pods -> data-center network.
    assert link_names("tpu-v5e", "4x16x16") == ("dcn", "ici", "ici")
    assert link_names("cpu", "2x2x2") == ("shared-memory",) * 3


# --- collectives -----------------------------------------------------------------------------


def test_collective_formulas_one_axis() -> None:
    comm = CommModel(toy_model(), parse_mesh("4"))  # n = 4, 100 GB/s, 1 us per step
    # all-reduce of 1 MiB: 2*3/4 * 1048576 / 1e11 + 2*3 * 1e-6
    assert comm.all_reduce(MiB, (0,)) == pytest.approx(2 * 3 / 4 * 1048576 / 1e11 + 6 * 1e-6)
    assert comm.all_reduce(MiB, (0,)) == pytest.approx(2.172864e-5)
    # all-gather to 4 MiB on each device: 3/4 * 4194304 / 1e11 + 3 * 1e-6
    assert comm.all_gather(4 * MiB, (0,)) == pytest.approx(3 / 4 * 4194304 / 1e11 + 3e-6)
    assert comm.all_gather(4 * MiB, (0,)) == pytest.approx(3.445728e-5)
    # reduce-scatter of a 4 MiB input: same form
    assert comm.reduce_scatter(4 * MiB, (0,)) == pytest.approx(3.445728e-5)
    # all-to-all of 1 MiB: 3/4 * 1048576 / 1e11 + 3 * 1e-6
    assert comm.all_to_all(MiB, (0,)) == pytest.approx(1.086432e-5)
    # names, single ints and kind spellings work too
    assert comm.all_reduce(MiB, "x") == comm.all_reduce(MiB, 0) == comm.all_reduce(MiB, (0,))
    assert comm.collective("all_to_all", MiB, (0,)) == comm.all_to_all(MiB, (0,))


def test_collective_overhead_is_paid_per_call() -> None:
    assert toy_model().collective_overhead == 0
    mesh = parse_mesh("4")
    plain = CommModel(toy_model(), mesh)
    taxed = CommModel(toy_model(collective_overhead=5e-6), mesh)
    assert taxed.all_gather(MiB, 0) == pytest.approx(plain.all_gather(MiB, 0) + 5e-6)
    # An all-reduce costs one call; the reduce-scatter and all-gather it equals cost two.
    split = taxed.reduce_scatter(MiB, 0) + taxed.all_gather(MiB, 0)
    assert taxed.all_reduce(MiB, 0) == pytest.approx(split - 5e-6)
    with pytest.raises(DeviceModelError, match="collective_overhead"):
        toy_model(collective_overhead=-1.0)


def test_combiner_table() -> None:
    toy = toy_model()
    assert toy.combiner == {"all-reduce": 30 * MiB, "reduce-scatter": 30 * MiB, "all-gather": 0}
    merged = toy_model(combiner={"all_reduce": "unbounded", "reduce-scatter": "8MiB",
                                 "all-gather": 1024})
    assert merged.combiner == {"all-reduce": math.inf, "reduce-scatter": 8 * MiB,
                               "all-gather": 1024}
    # The shipped models: XLA's GPU thresholds; the CPU merges every all-reduce of a step.
    assert load_device_model("h100").combiner["all-reduce"] == 30 * MiB
    assert load_device_model("cpu").combiner == {
        "all-reduce": math.inf, "reduce-scatter": math.inf, "all-gather": 0}


def test_combiner_amortises_latency() -> None:
    mesh = parse_mesh("4")  # 1 us per step: an all-reduce pays 6 us, a reduce-scatter 3 us
    plain = CommModel(toy_model(), mesh)
    bytes_term = 2 * 3 / 4 * MiB / 1e11
    assert plain.all_reduce(MiB, 0) == pytest.approx(bytes_term + 6e-6)
    buckets = CommModel(toy_model(), mesh, combine={"all-reduce": 4 * MiB, "all-gather": 0})
    assert buckets.all_reduce(MiB, 0) == pytest.approx(bytes_term + 6e-6 / 4)
    assert buckets.all_reduce(8 * MiB, 0) == pytest.approx(8 * bytes_term + 6e-6)
    assert buckets.all_gather(MiB, 0) == plain.all_gather(MiB, 0)  # 0: never merged
    assert buckets.reduce_scatter(MiB, 0) == plain.reduce_scatter(MiB, 0)  # not listed
    merged = CommModel(toy_model(), mesh, combine={"all-reduce": math.inf})
    assert merged.all_reduce(MiB, 0) == pytest.approx(bytes_term)


def test_collectives_free_cases() -> None:
    comm = CommModel(toy_model(), parse_mesh("4x1"))
    for fn in (comm.all_reduce, comm.all_gather, comm.reduce_scatter, comm.all_to_all):
        assert fn(MiB, ()) == 0.0  # no axes: n = 1
        assert fn(MiB, (1,)) == 0.0  # axis of size 1
        assert fn(0, (0,)) == 0.0  # nothing to move
    assert comm.bytes_sent("all-reduce", MiB, (1,)) == 0.0


def test_bytes_sent() -> None:
    comm = CommModel(toy_model(), parse_mesh("data=2,model=4"))
    assert comm.bytes_sent("all-reduce", MiB, (1,)) == 2 * 3 / 4 * MiB  # 1572864
    assert comm.bytes_sent("all-gather", MiB, (1,)) == 3 / 4 * MiB
    assert comm.bytes_sent("reduce-scatter", MiB, (0,)) == 1 / 2 * MiB
    assert comm.bytes_sent("all-to-all", MiB, (0, 1)) == 7 / 8 * MiB
    with pytest.raises(ValueError, match="unknown collective 'broadcast'"):
        comm.bytes_sent("broadcast", MiB, (0,))


def test_multi_axis_group_uses_slowest_link() -> None:
    comm = CommModel(load_device_model("h100"), parse_mesh("data=8,model=4"))
    group = comm.group((0, 1))
    # n = 32; bandwidth min(450e9 nvlink, 50e9 IB); latency max(3us, 10us)
    assert (group.size, group.bandwidth, group.latency) == (32, 50e9, 10e-6)
    # all-reduce of 1 GiB over both axes: 2*31/32 * 2^30 / 5e10 + 62 * 1e-5, plus the H100's
    # 1 us per collective call
    assert comm.all_reduce(GiB, (0, 1)) == pytest.approx(0.04160749568 + 6.2e-4 + 1e-6)
    # over the model axis only (nvlink, n = 4): 3/4 * 2^30 / 4.5e11 + 3 * 3e-6
    assert comm.all_gather(GiB, "model") == pytest.approx(805306368 / 4.5e11 + 9e-6 + 1e-6)
    # over the data axis only (infiniband, n = 8): 7/8 * 2^30 / 5e10 + 7 * 1e-5
    assert comm.all_gather(GiB, "data") == pytest.approx(939524096 / 5e10 + 7e-5 + 1e-6)
    assert comm.axes_label((0, 1)) == "data,model"
    assert "data:infiniband" in repr(comm) and "model:nvlink" in repr(comm)


def test_slow_ib_doubles_cross_node_bandwidth_term() -> None:
    mesh = parse_mesh("8x4")
    fast = CommModel(load_device_model("h100"), mesh)
    slow = CommModel(load_device_model("h100-slow-ib"), mesh)
    # bandwidth term 7/8 * 2^30 / 5e10 vs / 2.5e10; latency 7 * 1e-5 + 1e-6 per call in both
    assert fast.all_gather(GiB, 0) == pytest.approx(0.01879048192 + 7.1e-5)
    assert slow.all_gather(GiB, 0) == pytest.approx(0.03758096384 + 7.1e-5)
    assert fast.all_gather(GiB, 1) == slow.all_gather(GiB, 1)


def test_bad_axes() -> None:
    comm = CommModel(toy_model(), parse_mesh("2x4"))
    with pytest.raises(ValueError, match="out of range"):
        comm.all_reduce(MiB, (2,))
    with pytest.raises(ValueError, match="appears twice"):
        comm.all_reduce(MiB, (1, 1))
    with pytest.raises(MeshError, match="no axis 'model'"):
        comm.all_reduce(MiB, "model")


def test_compute_time() -> None:
    comm = CommModel(load_device_model("cpu"), parse_mesh("2"))
    # 1 GFLOP f32 at 100 GFLOP/s = 0.01 s; 100 MB at 20 GB/s = 0.005 s -> compute bound
    assert comm.compute_time(1e9, 1e8, "f32") == pytest.approx(0.01)
    # 1 GB at 20 GB/s = 0.05 s -> memory bound
    assert comm.compute_time(1e9, 1e9, "f32") == pytest.approx(0.05)
    # bf16 at 50 GFLOP/s: 0.02 s
    assert comm.compute_time(1e9, 0, "bf16") == pytest.approx(0.02)
    h100 = CommModel(load_device_model("h100"), parse_mesh("8"))
    assert h100.compute_time(1978.9e12, 0, "f8E4M3FN") == pytest.approx(1.0)
    assert h100.compute_time(66.9e12, 0, "s32") == pytest.approx(1.0)


# --- resharding ------------------------------------------------------------------------------

# Mesh data=2 (axis 0), model=4 (axis 1) on the toy model (100 GB/s, 1 us). Tensor f32[1024, 512]:
# 2 MiB = 2097152 bytes in full.
SHAPE = (1024, 512)
FULL = 2097152


@pytest.fixture
def comm() -> CommModel:
    return CommModel(toy_model(), parse_mesh("data=2,model=4"))


def test_local_bytes(comm: CommModel) -> None:
    assert local_bytes(SHAPE, 4, ((), ()), comm.mesh) == FULL
    assert local_bytes(SHAPE, 4, ((0,), (1,)), comm.mesh) == FULL // 8
    assert local_bytes(SHAPE, 4, ((0, 1), ()), comm.mesh) == FULL // 8
    # uneven dims round up: ceil(6/4) * ceil(5/2) * 4 bytes = 2 * 3 * 4
    assert local_bytes((6, 5), 4, ((1,), (0,)), comm.mesh) == 24


def test_reshard_same_and_slice_are_free(comm: CommModel) -> None:
    for src, dst in [
        (((0,), (1,)), ((0,), (1,))),
        (((), ()), ((0,), (1,))),  # R -> S: each device slices its part
        (((0,), ()), ((0, 1), ())),  # add a minor axis to a dim
        (((), ()), ((), ())),
    ]:
        cost = comm.reshard(SHAPE, 4, src, dst)
        assert cost.seconds == 0.0 and cost.collectives == ()


def test_reshard_all_gather(comm: CommModel) -> None:
    # S(0) over model -> replicated: all-gather over model (n = 4) to the full 2 MiB.
    cost = comm.reshard(SHAPE, 4, ((1,), ()), ((), ()))
    assert cost.collectives == (("all-gather", (1,), 3 / 4 * FULL),)  # 1572864 bytes
    assert cost.seconds == pytest.approx(1572864 / 1e11 + 3e-6)
    assert cost.bytes_sent == 1572864
    # Still split over data on dim 0: the gathered tensor is 1 MiB per device.
    cost = comm.reshard(SHAPE, 4, ((0,), (1,)), ((0,), ()))
    assert cost.collectives == (("all-gather", (1,), 786432.0),)
    assert cost.seconds == pytest.approx(786432 / 1e11 + 3e-6)
    # Drop the minor axis of a dim split over both: keep data, gather model.
    cost = comm.reshard(SHAPE, 4, ((0, 1), ()), ((0,), ()))
    assert cost.collectives == (("all-gather", (1,), 786432.0),)


def test_reshard_gathers_two_dims_in_turn(comm: CommModel) -> None:
    # ((data), (model)) -> replicated. The last dim first, as XLA does: gather model (n = 4);
    # the tensor is then split over data only, 2 MiB / 2 = 1048576 bytes: sends 3/4 * 1048576
    # = 786432. Then dim 0: gather data (n = 2) to the full 2 MiB: sends 1/2 * 2097152.
    cost = comm.reshard(SHAPE, 4, ((0,), (1,)), ((), ()))
    assert cost.collectives == (
        ("all-gather", (1,), 786432.0),
        ("all-gather", (0,), 1048576.0),
    )
    assert cost.seconds == pytest.approx(262144 / 1e11 + 1e-6 + 1572864 / 1e11 + 3e-6)


def test_reshard_minor_axis_kept_alone_permutes_then_gathers(comm: CommModel) -> None:
    # (data, model) -> (model,) on dim 0: model, minor to the gathered data, is all the
    # destination keeps. XLA (CPU and libtpu) sends each device's 2 MiB / 8 = 262144-byte
    # shard to the device holding it as (model, data), then gathers data (n = 2) to
    # 2 MiB / 4: sends 1/2 * 524288 (not one all-gather over both axes, 7/8 * 2 MiB).
    cost = comm.reshard(SHAPE, 4, ((0, 1), ()), ((1,), ()))
    assert cost.collectives == (("collective-permute", (0, 1), 262144.0),
                                ("all-gather", (0,), 262144.0))
    permute = comm.group((0, 1))
    assert cost.seconds == pytest.approx(262144 / permute.bandwidth + permute.latency
                                         + comm.collective("all-gather", 524288, (0,)))


def test_reshard_moving_one_axis_while_gathering_another_gathers_both(comm: CommModel) -> None:
    # (data, model) on dim 0 -> model on dim 1 (or data on dim 1): XLA (CPU and libtpu) does
    # not gather data and move model by an all-to-all; it gathers both (7/8 * 2 MiB), then
    # slices.
    for dst in (((), (1,)), ((), (0,))):
        cost = comm.reshard(SHAPE, 4, ((0, 1), ()), dst)
        assert cost.collectives == (("all-gather", (0, 1), 1835008.0),)
        assert cost.seconds == pytest.approx(1835008 / 1e11 + 7e-6)


def test_reshard_all_to_all(comm: CommModel) -> None:
    # S(0) -> S(1) over model: all-to-all of the local 2 MiB / 4 = 524288 bytes.
    cost = comm.reshard(SHAPE, 4, ((1,), ()), ((), (1,)))
    assert cost.collectives == (("all-to-all", (1,), 3 / 4 * 524288),)  # 393216 bytes
    assert cost.seconds == pytest.approx(393216 / 1e11 + 3e-6)
    # Swap the two axes between dims (XLA's partitioner, CommModel._exchange): pairs of model
    # (4 / 2 devices) exchange halves of the 2 MiB / 8 = 262144-byte shard, then the shards
    # are permuted into place over both axes.
    cost = comm.reshard(SHAPE, 4, ((0,), (1,)), ((1,), (0,)))
    assert cost.collectives == (
        ("all-to-all", (1,), 1 / 2 * 262144),
        ("collective-permute", (0, 1), 262144.0),
    )
    both = comm.group((0, 1))
    assert cost.seconds == pytest.approx(131072 / 1e11 + 1e-6
                                         + 262144 / both.bandwidth + both.latency)


def test_reshard_gather_then_all_to_all(comm: CommModel) -> None:
    # ((data), (model)) -> ((model), ()): gather data off dim 0 first (local 524288 bytes after,
    # sends 262144), then move model from dim 1 to dim 0 (local 524288, sends 393216).
    cost = comm.reshard(SHAPE, 4, ((0,), (1,)), ((1,), ()))
    assert cost.collectives == (
        ("all-gather", (0,), 262144.0),
        ("all-to-all", (1,), 393216.0),
    )
    assert cost.seconds == pytest.approx(262144 / 1e11 + 1e-6 + 393216 / 1e11 + 3e-6)


def test_reshard_keeps_an_axis_that_stays_in_order(comm: CommModel) -> None:
    # An axis staying on its dim while another leaves it or joins it as the major one is not
    # gathered: XLA moves the other by one all-to-all, then puts the shards in the
    # destination's device order by a collective-permute (libtpu and CPU on 2x4).
    # The local tensor is 2 MiB / 8 = 262144 bytes; an all-to-all among 2 devices sends half,
    # the permute all of it. The all-to-all's pairs are halves of model where data leaves
    # (data, model): the dim's minor-most factor of data's size.
    def moved(axes):
        return (("all-to-all", axes, 131072.0), ("collective-permute", (0, 1), 262144.0))
    # ((data, model), -) -> ((model), (data)): data leaves dim 0, model stays.
    assert comm.reshard(SHAPE, 4, ((0, 1), ()), ((1,), (0,))).collectives == moved((1,))
    # ((data), (model)) -> (-, (data, model)): data joins dim 1 ahead of model.
    assert comm.reshard(SHAPE, 4, ((0,), (1,)), ((), (0, 1))).collectives == moved((0,))
    # (-, (data, model)) -> ((data), (model)).
    assert comm.reshard(SHAPE, 4, ((), (0, 1)), ((0,), (1,))).collectives == moved((1,))
    # Leaving one dim for two: all-gathered there (libtpu, [-, -, (x, y)] -> [x, y, -]), then
    # sliced: one all-gather over both axes to the full 8 MiB.
    cost = comm.reshard((16, 256, 512), 4, ((), (), (0, 1)), ((0,), (1,), ()))
    assert cost.collectives == (("all-gather", (0, 1), 7 / 8 * 8 * 2**20),)


def test_reshard_reorder_on_a_dim_is_a_collective_permute(comm: CommModel) -> None:
    # Compiled for (512, 2048) f32 on x=2, y=4 by XLA's CPU partitioner and by libtpu for
    # v5e:2x4: each is one collective-permute over (x, y) of the new 512 KiB shard.
    shard = 512 * 2048 * 4 / 8
    permute = (("collective-permute", (0, 1), shard),)
    # Reordered on the dim: each device's shard goes to the device that holds it now.
    assert comm.reshard((512, 2048), 4, ((), (0, 1)), ((), (1, 0))).collectives == permute
    # Sliced in ahead of the kept axis: the block holds the [-, (y, x)] shard, not this one.
    cost = comm.reshard((512, 2048), 4, ((), (1,)), ((), (0, 1)))
    assert cost.collectives == permute
    assert cost.seconds == pytest.approx(shard / 1e11 + 1e-6)  # one step: one latency
    # Sliced in behind it, or the reordered minor axis gathered off: no permute.
    assert comm.reshard((512, 2048), 4, ((), (1,)), ((), (1, 0))).collectives == ()
    assert [kind for kind, _, _ in comm.reshard((512, 2048), 4, ((), (1, 0)), ((), (1,)))
            .collectives] == ["all-gather"]


def test_reshard_over_the_slow_link() -> None:
    comm = CommModel(load_device_model("h100"), parse_mesh("data=8,model=4"))
    # f32[4096, 4096] = 64 MiB, split over data on dim 0 -> replicated: all-gather over IB,
    # 7/8 * 64 MiB / 5e10 + 7 * 1e-5 + 1e-6 for the call.
    cost = comm.reshard((4096, 4096), 4, ((0,), ()), ((), ()))
    assert cost.seconds == pytest.approx(7 / 8 * 64 * MiB / 5e10 + 7.1e-5)


def test_staged_gathers_take_one_axis_at_a_time() -> None:
    mesh = parse_mesh("data=2,model=4")
    one_step = CommModel(toy_model(), mesh)
    staged = CommModel(toy_model(), mesh, staged_gathers=True)
    # [(data, model), -] -> replicated. XLA's one all-gather over 8 devices: 7/8 * 2 MiB in 7
    # ring steps. Staged: model first (n = 4), to the 1 MiB block still split over data (sends
    # 3/4 * 1 MiB), then data (n = 2) to the full 2 MiB (sends 1/2 * 2 MiB): the same bytes in
    # 3 + 1 steps, through the layout [data, -], which the plan pins.
    cost = one_step.reshard(SHAPE, 4, ((0, 1), ()), ((), ()))
    assert cost.collectives == (("all-gather", (0, 1), 1835008.0),) and cost.via == ()
    cost = staged.reshard(SHAPE, 4, ((0, 1), ()), ((), ()))
    assert cost.collectives == (("all-gather", (1,), 786432.0), ("all-gather", (0,), 1048576.0))
    assert cost.seconds == pytest.approx(1835008 / 1e11 + 4e-6)
    assert cost.via == (((0,), ()),)
    # staged=False prices a reshard nobody pins (jax.device_put between programs) as XLA does.
    assert staged.reshard(SHAPE, 4, ((0, 1), ()), ((), ()), staged=False) == one_step.reshard(
        SHAPE, 4, ((0, 1), ()), ((), ()))
    # Gathering down to [data, -] is one axis already: nothing to stage.
    assert staged.reshard(SHAPE, 4, ((0, 1), ()), ((0,), ())).via == ()
    # Three axes: c, then b, then a, through [(a, b), -] and [a, -].
    three = CommModel(toy_model(), parse_mesh("a=2,b=2,c=2"), staged_gathers=True)
    cost = three.reshard(SHAPE, 4, ((0, 1, 2), ()), ((), ()))
    assert [axes for _, axes, _ in cost.collectives] == [(2,), (1,), (0,)]
    assert cost.via == (((0, 1), ()), ((0,), ()))
    # b moving to dim 1 while a and c are gathered: XLA gathers all three (one all-gather over
    # (a, b, c) on the CPU compiler), then slices b; staged like the gather to replicated.
    cost = three.reshard(SHAPE, 4, ((0, 1, 2), ()), ((), (1,)))
    assert [axes for _, axes, _ in cost.collectives] == [(2,), (1,), (0,)]
    assert cost.via == (((0, 1), ()), ((0,), ()), ((), ()))
    # a gathered while b and c, minor to it, stay: the shards permuted to put a minor-most,
    # then one all-gather over a; nothing to stage.
    cost = three.reshard(SHAPE, 4, ((0, 1, 2), ()), ((1, 2), ()))
    assert cost.via == ()
    assert [step[:2] for step in cost.collectives] == [("collective-permute", (0, 1, 2)),
                                                       ("all-gather", (0,))]


def test_staged_gathers_only_where_cheaper() -> None:
    # A 1 ms launch per collective outweighs the 3 ring steps (3 us) staging saves.
    costly_calls = CommModel(toy_model(collective_overhead=1e-3), parse_mesh("data=2,model=4"),
                             staged_gathers=True)
    cost = costly_calls.reshard(SHAPE, 4, ((0, 1), ()), ((), ()))
    assert cost.collectives == (("all-gather", (0, 1), 1835008.0),) and cost.via == ()


def test_staged_gathers_keep_the_fast_link_off_the_slow_one() -> None:
    # 4 hosts of 8 H100s: data (n = 4) crosses InfiniBand, model (n = 8) stays on NVLink. One
    # all-gather of a 64 MiB weight over all 32 GPUs runs at InfiniBand's pace for 31/32 of it
    # and 31 steps; staged, only the last 3/4 of the data part crosses InfiniBand.
    mesh = parse_mesh("data=4,model=8")
    one_step = CommModel(load_device_model("h100"), mesh).reshard(
        (4096, 4096), 4, ((0, 1), ()), ((), ()))
    staged = CommModel(load_device_model("h100"), mesh, staged_gathers=True).reshard(
        (4096, 4096), 4, ((0, 1), ()), ((), ()))
    assert one_step.seconds == pytest.approx(31 / 32 * 64 * MiB / 5e10 + 31 * 1e-5 + 1e-6)
    assert staged.seconds == pytest.approx(7 / 8 * 16 * MiB / 450e9 + 7 * 3e-6 + 1e-6
                                           + 3 / 4 * 64 * MiB / 5e10 + 3 * 1e-5 + 1e-6)
    assert staged.seconds < 0.8 * one_step.seconds


def test_reshard_bad_shardings(comm: CommModel) -> None:
    with pytest.raises(ValueError, match="has 1 entries for a rank-2 tensor"):
        comm.reshard(SHAPE, 4, ((0,),), ((), ()))
    with pytest.raises(ValueError, match="uses mesh axis 0 twice"):
        comm.reshard(SHAPE, 4, ((0,), (0,)), ((), ()))
    with pytest.raises(ValueError, match="out of range"):
        comm.reshard(SHAPE, 4, ((), ()), ((2,), ()))


def test_partial_slice_devices_limits_programs_on_part_of_one_slice():
    """tpu-v5e builds programs on parts of slices of up to 16 chips; a mesh of several
    slices (more devices than the innermost link reaches) is not judged; other models and
    a bad value."""
    v5e = load_device_model("tpu-v5e")
    assert [v5e.runs_partial_programs(n) for n in (8, 16, 32, 256, 512)] == [
        True, True, False, False, True]
    assert load_device_model("h100").runs_partial_programs(4096)


def test_partial_slice_devices_must_be_a_positive_integer(tmp_path: Path) -> None:
    for bad in ("0", "2.5", "true"):
        path = tmp_path / "bad.toml"
        path.write_text(MINIMAL.replace("[flops]", f"partial_slice_devices = {bad}\n[flops]", 1))
        with pytest.raises(DeviceModelError,
                           match="field 'partial_slice_devices' must be a positive integer"):
            load_device_model(path)
    path.write_text(MINIMAL.replace("[flops]", "partial_slice_devices = 4\n[flops]", 1))
    assert load_device_model(path).partial_slice_devices == 4
