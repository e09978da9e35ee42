"""Mesh views: a one-axis mesh such as "8" is also planned as 2x4 and 4x2 over the same devices
(compiler.plan_on_views), and the fastest estimate is kept. A plan on a view runs on the devices the
user gave, in the same order, and computes the single-device answer."""

from __future__ import annotations

import json

import jax
import pytest
from click.testing import CliRunner

import hloplan
from hloplan.cli import main
from hloplan.compiler import VIEW_GAIN, view_floor
from hloplan.diagnostics import HloplanError


def _compile(fixtures_dir, tmp_path, name, *extra):
    out = tmp_path / name
    run = CliRunner().invoke(main, ["compile", str(fixtures_dir / f"{name}.jaxexport"), "--mesh",
                                    "8", "--device", "cpu", "-o", str(out), *extra])
    assert run.exit_code == 0, run.output
    return out, json.loads((out / "plan.json").read_text()), run.output


@pytest.mark.usefixtures("devices8")
def test_a_view_kept_for_its_estimate_runs_and_equals_single_device(fixtures_dir, tmp_path,
                                                                    helpers):
    # The conv net's train step on the CPU model: on a view, the second convolution splits its
    # weight over both axes (input channels over one, output channels over the other), which
    # one axis of 8 cannot; the estimate drops by a quarter.
    out, plan, output = _compile(fixtures_dir, tmp_path, "convnet_train_step")
    tried = plan["mesh_views"]["tried"]
    assert [t["mesh"] for t in tried] == ["x=8", "x0=2,x1=4", "x0=4,x1=2"]
    chosen = plan["mesh_views"]["chosen"]
    assert chosen != 0
    assert tried[chosen]["step_time_s"] < (1 - VIEW_GAIN) * tried[0]["step_time_s"]
    assert tried[chosen]["step_time_s"] == min(t["step_time_s"] for t in tried)
    assert plan["estimate"]["step_time_s"] == tried[chosen]["step_time_s"]
    assert plan["mesh"]["axis_sizes"] == tried[chosen]["axis_sizes"]
    assert plan["mesh"]["view_of"] == {"axis_names": ["x"], "axis_sizes": [8]}
    # Both axes of the view carry some sharding: the view is used, not just renamed.
    used = {axis for a in plan["arguments"] for dim in a["spec"] for axis in dim}
    assert used == {"x0", "x1"}
    assert "a view of the mesh x=8" in output
    assert "(a view of x=8)" in output
    remarks = [d["message"] for d in plan["diagnostics"] if d["severity"] == "remark"]
    assert any(m.startswith(f"planned on mesh {tried[chosen]['mesh']}") for m in remarks)

    exported, args, kwargs = helpers.fixture_arguments("convnet_train_step")
    want = helpers.single_device_call(exported, args, kwargs)
    step = hloplan.load(out)
    assert step.mesh.devices.shape == tuple(tried[chosen]["axis_sizes"])
    # The same devices in the same order as the mesh as given.
    assert list(step.mesh.devices.flat) == jax.devices("cpu")[:8]
    helpers.assert_trees_close(jax.tree.map(lambda a: a, step(*args, **kwargs)), want,
                               context="plan on a mesh view")


def test_compile_json_names_the_mesh_planned(fixtures_dir, tmp_path):
    _, plan, output = _compile(fixtures_dir, tmp_path, "convnet_train_step", "--format", "json")
    reply = json.loads(output)
    assert reply["mesh"] == plan["mesh"] and reply["mesh"]["view_of"]["axis_sizes"] == [8]
    assert reply["mesh_views"] == plan["mesh_views"]


def test_off_plans_the_mesh_as_given(fixtures_dir, tmp_path):
    _, plan, output = _compile(fixtures_dir, tmp_path, "convnet_train_step",
                               "--mesh-views", "off")
    assert plan["mesh"]["axis_names"] == ["x"] and "view_of" not in plan["mesh"]
    assert "mesh_views" not in plan
    assert "view" not in output


def test_ties_keep_the_mesh_as_given(fixtures_dir):
    plan = hloplan.compile(fixtures_dir / "gpt_train_step.jaxexport", "8", device="cpu").plan
    tried = plan["mesh_views"]["tried"]
    assert len(tried) == 3 and len({t["step_time_s"] for t in tried}) == 1
    assert plan["mesh_views"]["chosen"] == 0 and plan["mesh"]["axis_names"] == ["x"]
    assert "view_of" not in plan["mesh"]


def test_a_view_must_beat_the_mesh_as_given_by_the_margin(fixtures_dir, monkeypatch):
    import hloplan.compiler

    monkeypatch.setattr(hloplan.compiler, "VIEW_GAIN", 0.5)
    plan = hloplan.compile(fixtures_dir / "convnet_train_step.jaxexport", "8", device="cpu").plan
    tried = plan["mesh_views"]["tried"]
    assert min(t["step_time_s"] for t in tried) < 0.9 * tried[0]["step_time_s"]
    assert plan["mesh_views"]["chosen"] == 0 and plan["mesh"]["axis_names"] == ["x"]


def test_views_are_skipped_when_none_can_beat_the_margin(fixtures_dir):
    # On the toy model the GPT fixture's plan on 8 is within 0.02% of the bound no plan on 8
    # devices can go below (each op's cheapest strategy, or its work split 8 ways).
    result = hloplan.compile(fixtures_dir / "gpt_train_step.jaxexport", "8", device="toy")
    assert "mesh_views" not in result.plan and "mesh_views" not in result.timings
    floor = view_floor(result.state)
    assert (1 - VIEW_GAIN) * result.plan["estimate"]["step_time_s"] <= floor


@pytest.mark.parametrize("name", ["convnet_train_step", "mlp_forward", "scan_train_step"])
def test_the_floor_bounds_every_view(fixtures_dir, name):
    result = hloplan.compile(fixtures_dir / f"{name}.jaxexport", "8", device="cpu")
    given = hloplan.compile(fixtures_dir / f"{name}.jaxexport", "8", device="cpu",
                            mesh_views="off")
    floor = view_floor(given.state)
    tried = result.plan["mesh_views"]["tried"]
    assert tried[0]["step_time_s"] == given.plan["estimate"]["step_time_s"]
    assert all(floor <= t["step_time_s"] for t in tried)


def test_a_multi_axis_mesh_is_split_only_when_asked(fixtures_dir):
    plan = hloplan.compile(fixtures_dir / "mlp_forward.jaxexport", "2x4", device="cpu").plan
    assert "mesh_views" not in plan
    plan = hloplan.compile(fixtures_dir / "mlp_forward.jaxexport", "2x4", device="cpu",
                           mesh_views="all").plan
    assert [t["mesh"] for t in plan["mesh_views"]["tried"]] == [
        "x=2,y=4", "x=2,y0=2,y1=2"]


def test_explain_lists_the_meshes_planned(fixtures_dir, tmp_path):
    out, plan, _ = _compile(fixtures_dir, tmp_path, "convnet_train_step")
    run = CliRunner().invoke(main, ["explain", str(out)])
    assert run.exit_code == 0, run.output
    assert "(a view of x=8)" in run.output
    assert "x=8 (as given): estimated step" in run.output
    kept = plan["mesh_views"]["tried"][plan["mesh_views"]["chosen"]]["mesh"]
    assert f"{kept} (a view, kept)" in run.output
    run = CliRunner().invoke(main, ["explain", str(out), "--format", "json"])
    assert json.loads(run.output)["mesh_views"] == plan["mesh_views"]
    # The jax.jit code lays the view over jax.devices() as the mesh asked for is laid: every
    # device in its place.
    run = CliRunner().invoke(main, ["explain", str(out), "--format", "jax"])
    sizes = ", ".join(map(str, plan["mesh"]["axis_sizes"]))
    assert "# a view of the mesh x=8" in run.output
    assert f"devices = np.array(jax.devices()[:8]).reshape({sizes})" in run.output
    assert "mesh = Mesh(devices, ('x0', 'x1')," in run.output


def test_explain_plans_an_input_with_or_without_views(fixtures_dir):
    source = str(fixtures_dir / "convnet_train_step.jaxexport")
    run = CliRunner().invoke(main, ["explain", source, "--mesh", "8", "--device", "cpu",
                                    "--format", "json"])
    assert json.loads(run.output)["mesh"]["view_of"] == {"axis_names": ["x"], "axis_sizes": [8]}
    run = CliRunner().invoke(main, ["explain", source, "--mesh", "8", "--device", "cpu",
                                    "--format", "json", "--mesh-views", "off"])
    reply = json.loads(run.output)
    assert reply["mesh"]["axis_names"] == ["x"] and reply["mesh_views"] is None


def test_an_unknown_choice_is_a_usage_error(fixtures_dir):
    run = CliRunner().invoke(main, ["compile", str(fixtures_dir / "mlp_forward.jaxexport"),
                                    "--mesh", "8", "--mesh-views", "some"])
    assert run.exit_code == 2
    with pytest.raises(HloplanError, match="unknown mesh views"):
        hloplan.compile(fixtures_dir / "mlp_forward.jaxexport", "8", mesh_views="some")


def test_views_of_a_mesh_across_hosts_keep_its_links(fixtures_dir):
    # 16 devices on 2 hosts: a view's major part crosses the hosts, its minor part stays in
    # one (hardware.axis_links on the view, devices in the same order).
    plan = hloplan.compile(fixtures_dir / "mlp_forward.jaxexport", "16", device="h100",
                           hosts=2).plan
    assert [t["mesh"] for t in plan["mesh_views"]["tried"]] == [
        "x=16", "x0=2,x1=8", "x0=4,x1=4", "x0=8,x1=2"]
    assert plan["mesh"]["view_of"]["axis_sizes"] == [16] and plan["mesh"]["hosts"] == 2
    assert plan["mesh"]["links"] == ["infiniband", "nvlink"]


def test_pipeline_options_plan_the_mesh_as_given(fixtures_dir):
    from hloplan.pipeline_parallel import PipelineOptions

    plan = hloplan.compile(fixtures_dir / "mlp_train_step.jaxexport", "8", device="cpu",
                           pipeline=PipelineOptions(stages=1, microbatches=2)).plan
    assert "mesh_views" not in plan and plan["mesh"]["axis_names"] == ["x"]


def test_a_plan_on_a_view_runs_as_a_two_process_job(fixtures_dir, tmp_path):
    """The view's major part crosses the processes, as the one axis it splits did."""
    out, plan, _ = _compile(fixtures_dir, tmp_path, "convnet_train_step")
    run = CliRunner().invoke(main, ["run", str(out), "--check", "--processes", "2", "--inputs",
                                    str(fixtures_dir / "convnet_train_step.inputs.npz"),
                                    "--format", "json"], catch_exceptions=False)
    assert run.exit_code == 0, run.output
    report = json.loads(run.output)
    assert report["match"] is True and report["processes"] == 2
    assert report["mesh"] == dict(zip(plan["mesh"]["axis_names"], plan["mesh"]["axis_sizes"]))
    assert all(p["match"] for p in report["per_process"])
    assert report["cross_process_axes"] == ["x0"]
