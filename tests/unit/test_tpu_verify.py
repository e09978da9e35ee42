"""The TPU compiler in the loop: topologies, the compiler choice, TPU HLO collectives, a plan
checked by libtpu for v5e:2x4 (deviceless, on CPU), and `hloplan calibrate`."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from hloplan.cli import main
from hloplan.cost_models import load_device_model
from hloplan.diagnostics import UsageError
from hloplan.hlo_stats import collective_stats
from hloplan.tpu import libtpu_available, parse_topology, topology_for
from hloplan.verify import NO_LIBTPU, format_verify_report, resolve_target


def test_topology_by_device_count():
    assert [topology_for("v5e", n).name for n in (1, 2, 4, 8, 32, 256)] == [
        "v5e:1x1", "v5e:1x2", "v5e:2x2", "v5e:2x4", "v5e:4x8", "v5e:16x16"]
    assert [topology_for("v5p", n).name for n in (4, 8, 16, 64)] == [
        "v5p:2x2x1", "v5p:2x2x2", "v5p:2x2x4", "v5p:4x4x4"]
    assert topology_for("v4", 8).name == "v4:2x2x1"  # two devices (TensorCores) per chip
    assert topology_for("v5e", 1).host_bounds == [1, 1, 1]
    assert topology_for("v5e", 8).host_bounds is None
    with pytest.raises(UsageError, match="no TPU v5e topology has 12 devices"):
        topology_for("v5e", 12)
    with pytest.raises(UsageError, match="no TPU v5e topology has 512 devices"):
        topology_for("v5e", 512)
    with pytest.raises(UsageError, match="unknown TPU topology"):
        parse_topology("v5litepod-8")
    assert parse_topology("V5E:4x8").devices == 32


def test_compiler_choice(monkeypatch):
    v5e, h100 = load_device_model("tpu-v5e"), load_device_model("h100")
    assert resolve_target(h100, 8).compiler == "cpu"
    assert resolve_target(v5e, 8, compiler="cpu").compiler == "cpu"
    monkeypatch.setattr("hloplan.tpu.libtpu_available", lambda: False)
    target = resolve_target(v5e, 8)
    assert (target.compiler, target.note) == ("cpu", NO_LIBTPU)
    with pytest.raises(UsageError, match="needs libtpu"):
        resolve_target(v5e, 8, compiler="tpu")
    monkeypatch.setattr("hloplan.tpu.libtpu_available", lambda: True)
    assert resolve_target(v5e, 8).topology == "v5e:2x4"
    assert resolve_target(h100, 8, topology="v6e:2x4").topology == "v6e:2x4"
    with pytest.raises(UsageError, match="has 16 devices; the plan's mesh has 8"):
        resolve_target(v5e, 8, topology="v5e:4x4")
    with pytest.raises(UsageError, match="no TPU v5e topology has 6 devices"):
        resolve_target(v5e, 6)


# An async all-gather as libtpu prints it: the start fusion holds the collective, the done
# fusion a copy of it (same channel); a combined all-reduce in the entry.
TPU_HLO = """\
HloModule m, num_partitions=8

%start_comp (p0: bf16[32,64]) -> (bf16[32,64], bf16[64,64], u32[]) {
  %p0 = bf16[32,64]{1,0:T(8,128)(2,1)S(1)} parameter(0)
  %all-gather.1 = bf16[64,64]{1,0:T(8,128)(2,1)} all-gather(%p0), channel_id=3, replica_groups=[4,2]<=[2,4]T(1,0), dimensions={0}, use_global_device_ids=true
  ROOT %cc.1 = (bf16[32,64]{1,0}, bf16[64,64]{1,0}, u32[]{:S(2)}) custom-call(%all-gather.1), custom_call_target="AsyncCollectiveStart"
}

%done_comp (q0: bf16[32,64], q1: bf16[64,64], q2: u32[]) -> bf16[64,64] {
  %q0 = bf16[32,64]{1,0} parameter(0)
  %q1 = bf16[64,64]{1,0} parameter(1)
  %q2 = u32[]{:S(2)} parameter(2)
  %all-gather.2 = bf16[64,64]{1,0:T(8,128)(2,1)} all-gather(%q0), channel_id=3, replica_groups=[4,2]<=[2,4]T(1,0), dimensions={0}, use_global_device_ids=true
  ROOT %cc.2 = bf16[64,64]{1,0} custom-call(%q0, %q1, %all-gather.2, %q2), custom_call_target="AsyncCollectiveDone"
}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

ENTRY %main (x: bf16[32,64], g: f32[256], h: f32[64]) -> (bf16[64,64], f32[256], f32[64]) {
  %x = bf16[32,64]{1,0} parameter(0)
  %g = f32[256]{0} parameter(1)
  %h = f32[64]{0} parameter(2)
  %start = (bf16[32,64]{1,0}, bf16[64,64]{1,0}, u32[]{:S(2)}) fusion(%x), kind=kCustom, calls=%start_comp
  %gte0 = bf16[32,64]{1,0} get-tuple-element(%start), index=0
  %gte1 = bf16[64,64]{1,0} get-tuple-element(%start), index=1
  %gte2 = u32[]{:S(2)} get-tuple-element(%start), index=2
  %done = bf16[64,64]{1,0} fusion(%gte0, %gte1, %gte2), kind=kCustom, calls=%done_comp
  %ar = (f32[256]{0}, f32[64]{0}) all-reduce(%g, %h), channel_id=4, replica_groups=mesh['axis_0'=8] {'axis_0'}, use_global_device_ids=true, to_apply=%add
  %r0 = f32[256]{0} get-tuple-element(%ar), index=0
  %r1 = f32[64]{0} get-tuple-element(%ar), index=1
  ROOT %out = (bf16[64,64]{1,0}, f32[256]{0}, f32[64]{0}) tuple(%done, %r0, %r1)
}
"""


def test_tpu_hlo_collectives():
    stats = collective_stats(TPU_HLO, mesh_axes=[("x", 2), ("y", 4)])
    kinds = {(op.kind, op.axes): op for op in stats.ops}
    assert set(kinds) == {("all-gather", ("x",)), ("all-reduce", ("x", "y"))}
    gather = kinds[("all-gather", ("x",))]
    assert gather.group_size == 2 and gather.result_bytes == 64 * 64 * 2
    assert gather.bytes_sent == pytest.approx(0.5 * 64 * 64 * 2)
    reduce = kinds[("all-reduce", ("x", "y"))]
    assert reduce.operand_bytes == (256 + 64) * 4
    assert reduce.bytes_sent == pytest.approx(2 * 7 / 8 * (256 + 64) * 4)


@pytest.fixture(scope="module")
def tpu_plan(tmp_path_factory, helpers):
    """The train step planned for tpu-v5e on 2x4 with --verify-memory (libtpu when present)."""
    from hloplan.compiler import compile_bytes, make_options

    # Large enough that the plan shards: one device would spend longer than the collectives.
    data = bytes(helpers.mlp_train_step_export(512, 2048, 2048, ("cpu", "tpu")).serialize())
    options = make_options("2x4", device="tpu-v5e", verify_memory=True, mesh_views="off",
                           time_limit=30)
    result = compile_bytes(data, "step.jaxexport", options)
    out = tmp_path_factory.mktemp("tpu") / "plan"
    result.write(out)
    return out, result.plan


@pytest.mark.libtpu
def test_verify_memory_uses_libtpu(tpu_plan):
    _, plan = tpu_plan
    check = plan["memory_check"]
    assert (check["platform"], check["topology"]) == ("tpu", "v5e:2x4")
    assert check["notes"] == []  # exported for tpu: nothing assumed
    compiled = check["tries"][check["kept"]]["peak_bytes"]
    # The arguments alone (a shard of each weight at least) are a floor.
    assert compiled >= (512 * 2048 * 2 * 4) // 8


@pytest.mark.libtpu
def test_verify_command_tpu_predicted_vs_compiled(tpu_plan):
    plan_dir, plan = tpu_plan
    out = CliRunner().invoke(main, ["verify", str(plan_dir), "--format", "json"])
    assert out.exit_code == 0, out.output
    report = json.loads(out.output[out.output.index("{"):])
    assert (report["platform"], report["topology"]) == ("tpu", "v5e:2x4")
    entry = report["programs"]["program"]
    predicted = {(c["kind"], c["axes"]): c for c in entry["predicted"]["collectives"]}
    compiled = {(c["kind"], c["axes"]): c for c in entry["compiled"]["collectives"]}
    # A plan that shards anything communicates, and libtpu compiles collectives for it over
    # named mesh axes; the bytes it sends per device, per kind and mesh axes, are the
    # predicted ones within 5%.
    assert predicted and compiled
    assert all(axes != "?" for _, axes in compiled)
    assert set(predicted) == set(compiled), (predicted, compiled)
    for key, c in compiled.items():
        assert predicted[key]["bytes"] == pytest.approx(c["bytes"], rel=0.05), key
    # The compiled peak is what libtpu's runtime reserves (its dumped buffer assignment's
    # temporaries), which memory_analysis's temporaries never undercount.
    memory = entry["compiled"]["memory"]
    assert entry["compiled"]["peak_bytes"] == memory["reserved_bytes"]
    assert memory["argument_bytes"] < memory["reserved_bytes"] <= memory["peak_bytes"]
    assert 0.3 < entry["peak_ratio"] < 3.0
    # Scored under the plan's device model: of the compiled collectives' seconds, what the
    # kernels libtpu schedules between an asynchronous collective's start and done hide,
    # beside the seconds the plan counts as hidden.
    score = entry["compiled"]["score"]
    assert 0.0 <= score["hidden_s"] <= score["communication_s"]
    assert entry["predicted"]["hidden_s"] == plan["estimate"]["hidden_s"]
    text = format_verify_report(report)
    assert "compiled by XLA for TPU v5e:2x4" in text
    assert "collective seconds hidden: predicted" in text
    print(text)


def test_verify_command_cpu(tpu_plan):
    plan_dir, _ = tpu_plan
    out = CliRunner().invoke(main, ["verify", str(plan_dir), "--compiler", "cpu",
                                    "--format", "json"])
    assert out.exit_code == 0, out.output
    report = json.loads(out.output[out.output.index("{"):])
    assert report["platform"] == "cpu" and "topology" not in report
    assert report["programs"]["program"]["compiled"]["peak_bytes"] > 0


def test_verify_command_bad_topology(tpu_plan):
    plan_dir, _ = tpu_plan
    out = CliRunner().invoke(main, ["verify", str(plan_dir), "--topology", "v5e:3x3"])
    if not libtpu_available():
        assert out.exit_code == 2 and "needs libtpu" in out.output
    else:
        assert out.exit_code == 2 and "has 9 devices; the plan's mesh has 8" in out.output


def test_calibrate_quick(tmp_path):
    path = tmp_path / "dev.toml"
    out = CliRunner().invoke(main, ["calibrate", "-o", str(path), "--quick", "--format", "json"])
    assert out.exit_code == 0, out.output
    measured = json.loads(out.output[out.output.index("{"):])["measured"]
    model = load_device_model(path)
    assert model.hbm_bandwidth == pytest.approx(measured["hbm_bandwidth"], rel=1e-5)
    assert model.flops["f32"] == pytest.approx(measured["matmul_f32_large"], rel=1e-5)
    assert 0 < model.program_overhead < 1.0
    assert model.calibration["matmul_small_n"] == 64
    assert model.matmul["sizes"] == (16, 64)  # the quick [matmul] grid, read back
    assert model.matmul["f32"][1][0][1] == pytest.approx(
        measured["matmul_grid"]["f32"][1][0][1], rel=1e-5)
    assert model.buffer_overhead == pytest.approx(measured["buffer_overhead"], rel=1e-5)
    assert len(model.conv["f32"]) == len(measured["conv"]["f32"]) == 3  # quick [conv] points
    assert model.conv["bf16"][0][:3] == (128, 72, 16)  # 2 images of 8 x 8, 8 -> 16 channels
    if measured["devices"] > 1:  # the simulated devices of tests/conftest.py
        inner = model.interconnect[0]
        assert inner.devices == measured["devices"]
        assert inner.bandwidth == pytest.approx(measured["allreduce_bandwidth"], rel=1e-5)


def test_calibrate_keeps_the_base_models_unmeasured_figures(tmp_path):
    """What calibrate does not measure comes from the base model: its top-level figures
    (tpu-v5e's matmul_row_tile) and its tables ([collectives]), not its name and aliases; and
    --from-file writes the model again from a calibrated file's recorded measurements."""
    path = tmp_path / "dev.toml"
    out = CliRunner().invoke(main, ["calibrate", "-o", str(path), "--quick", "--base",
                                    "tpu-v5e"])
    assert out.exit_code == 0, out.output
    base = load_device_model("tpu-v5e")
    model = load_device_model(path)
    assert model.matmul_row_tile == base.matmul_row_tile == 768
    assert model.collective_matmul_intensity == base.collective_matmul_intensity
    assert model.name == "calibrated-tpu-v5e" and "aliases" not in path.read_text()
    again = tmp_path / "again.toml"
    out = CliRunner().invoke(main, ["calibrate", "-o", str(again), "--from-file", str(path),
                                    "--base", "tpu-v5e"])
    assert out.exit_code == 0, out.output
    assert again.read_text() == path.read_text()
    out = CliRunner().invoke(main, ["calibrate", "-o", str(tmp_path / "x.toml"),
                                    "--from-file", str(tmp_path / "again.toml"), "--base",
                                    "tpu-v5e", "--name", "renamed"])
    assert out.exit_code == 0 and load_device_model(tmp_path / "x.toml").name == "renamed"
    bad = tmp_path / "plain.toml"
    bad.write_text('name = "t"\n')
    out = CliRunner().invoke(main, ["calibrate", "-o", str(tmp_path / "y.toml"),
                                    "--from-file", str(bad)])
    assert out.exit_code == 2 and "no [calibration] table" in out.output
    assert not (tmp_path / "y.toml").exists()


@pytest.mark.libtpu
def test_verify_tpu_relabels_a_cpu_export(tmp_path):
    """A program exported for cpu only is compiled for the TPU topology as if exported for it
    (with a note), the relabelled program passing the loader's integrity check."""
    from pathlib import Path

    fixture = Path(__file__).parents[2] / "fixtures" / "mlp_train_step.jaxexport"
    plan_dir = tmp_path / "plan"
    out = CliRunner().invoke(main, ["compile", str(fixture), "--mesh", "2x2", "--device",
                                    "tpu-v5e", "--mesh-views", "off", "-q",
                                    "-o", str(plan_dir)])
    assert out.exit_code == 0, out.output
    out = CliRunner().invoke(main, ["verify", str(plan_dir), "--format", "json"])
    assert out.exit_code == 0, out.output
    report = json.loads(out.output[out.output.index("{"):])
    assert (report["platform"], report["topology"]) == ("tpu", "v5e:2x2")
    assert any("exported for cpu only" in note for note in report["notes"])
    assert report["programs"]["program"]["compiled"]["peak_bytes"] > 0
    # The user's plan directory is left as it was written.
    assert json.loads((plan_dir / "plan.json").read_text())["digests"]


_LIBTPU_PART_OF_SLICE = r"""
import json, sys
import numpy as np, jax, jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from hloplan.tpu import parse_topology, topology_devices

out = []
for name in json.loads(sys.argv[1]):
    devices = topology_devices(parse_topology(name))
    half = len(devices) // 2
    compiled = []
    for part in (devices[:half], devices[half:]):  # a two-stage pipeline's submeshes
        mesh = Mesh(np.array(part), ("y",))
        x = jax.ShapeDtypeStruct((half * 8, 128), jnp.float32,
                                 sharding=NamedSharding(mesh, P("y")))
        try:
            jax.jit(lambda a: a.sum(0)).lower(x).compile()
            compiled.append(True)
        except Exception as error:
            if "include all slice devices" not in str(error):
                raise
            compiled.append(False)
    out.append(compiled)
print(json.dumps(out))
"""


@pytest.mark.libtpu
def test_tpu_v5e_runs_programs_on_part_of_a_slice_as_libtpu_does():
    """tpu-v5e's `partial_slice_devices`: libtpu compiles a program on either half of a v5e
    slice of 8 or 16 chips (a two-stage pipeline's submeshes), and on v5e:4x8 and 8x8 refuses
    one on the half that holds the slice's first chips (the second half compiles): a
    pipeline's first stage cannot be built there."""
    import subprocess
    import sys

    from hloplan.tpu import child_env

    slices = ["v5e:2x4", "v5e:4x4", "v5e:4x8", "v5e:8x8"]
    done = subprocess.run([sys.executable, "-c", _LIBTPU_PART_OF_SLICE, json.dumps(slices)],
                          env=child_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    compiled = json.loads(done.stdout.strip().splitlines()[-1])
    assert compiled == [[True, True], [True, True], [False, True], [False, True]]
    model = load_device_model("tpu-v5e")
    assert [model.runs_partial_programs(parse_topology(s).devices) for s in slices] == [
        first for first, _ in compiled]
