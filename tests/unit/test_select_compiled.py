"""`hloplan compile --select compiled`: the model's plan, the canonical plans (data parallel,
FSDP; restricted solves of the same ILP) and, for a device model with collective-matmul loops,
the plan counting the loops' sends in full, compiled by the target compiler, the lowest
compiled score kept and recorded in plan.json and `hloplan explain`."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from hloplan.cli import main
from hloplan.mesh import parse_mesh


def _select(tmp_path, device, platforms, helpers):
    """The MLP train step planned with `--select compiled`; its plan.json."""
    source = tmp_path / "step.jaxexport"
    source.write_bytes(bytes(helpers.mlp_train_step_export(256, 1024, 512, platforms).serialize()))
    out = CliRunner().invoke(main, ["compile", str(source), "--mesh", "2x2", "--device", device,
                                    "--mesh-views", "off", "--select", "compiled",
                                    "-o", str(tmp_path / "plan")])
    assert out.exit_code == 0, out.output
    return json.loads((tmp_path / "plan" / "plan.json").read_text())


def _check_selection(plan, platform):
    sel = plan["selection"]
    assert sel["platform"] == platform
    names = [c["name"] for c in sel["candidates"]]
    loops = plan["device_model"]["name"].startswith("tpu")
    assert names == ["model", "dp", "fsdp"] + (["serial-loops"] if loops else [])
    compiled = [c for c in sel["candidates"] if "compiled_step_s" in c]
    serial = [c for c in sel["candidates"] if "same_plan_as" in c]
    assert len(compiled) + len(serial) == len(names)
    # A candidate whose module is one compiled already is not compiled again.
    assert all(c["name"] == "serial-loops" and c["same_plan_as"] in names for c in serial)
    for c in compiled:
        assert c["compiled_step_s"] > 0 and c["estimated_step_s"] > 0
        assert c["compiled_peak_bytes"] > 0
    best = min((c for c in compiled if c["fits"]), key=lambda c: c["compiled_step_s"])
    assert sel["chosen"] == best["name"]
    assert sel["why"].startswith("lowest compiled score")
    # The canonical plans are what they say: data parallel replicates the weights, FSDP
    # splits every weight over both axes.
    by_name = {c["name"]: c for c in sel["candidates"]}
    assert by_name["dp"]["unrestricted_nodes"] == 0
    if sel["chosen"] in ("dp", "fsdp"):
        specs = {a["name"]: a["spec"] for a in plan["arguments"]}
        weights = [specs[n] for n in specs if "w1" in n or "w2" in n]
        if sel["chosen"] == "dp":
            assert all(not any(s) for s in weights)
        else:
            assert all(sorted(a for s in w for a in s) == ["x", "y"] for w in weights)


def test_select_compiled_cpu(tmp_path, helpers):
    """A GPU device model: the candidates are compiled by XLA's CPU compiler (simulated
    devices) and scored with the device model's figures."""
    plan = _select(tmp_path, "h100", ("cpu",), helpers)
    _check_selection(plan, "cpu")
    assert "collective_matmul_overlap" not in plan["device_model"]  # h100 runs no such loop
    out = CliRunner().invoke(main, ["explain", str(tmp_path / "plan")])
    assert out.exit_code == 0, out.output
    assert "candidates compiled by XLA (cpu" in out.output
    assert f"kept {plan['selection']['chosen']}:" in out.output


@pytest.mark.libtpu
def test_select_compiled_libtpu(tmp_path, helpers):
    """A TPU device model: libtpu compiles every candidate for v5e:2x2."""
    plan = _select(tmp_path, "tpu-v5e", ("tpu",), helpers)
    _check_selection(plan, "tpu")
    assert plan["selection"]["topology"] == "v5e:2x2"
    # No matmul of this step loops on libtpu: counting loop sends in full plans the same
    # program, which is not compiled twice.
    by_name = {c["name"]: c for c in plan["selection"]["candidates"]}
    assert by_name["serial-loops"]["same_plan_as"] == "model"
    out = CliRunner().invoke(main, ["explain", str(tmp_path / "plan")])
    assert out.exit_code == 0, out.output
    assert "serial-loops: estimated" in out.output and "the same plan as model" in out.output
    # plan.json says how the kept plan priced the loops' sends.
    kept_serial = plan["selection"]["chosen"] == "serial-loops"
    assert plan["device_model"]["collective_matmul_overlap"] == (0.0 if kept_serial else 1.0)


def _job_never_planned():
    """A job whose program, loaded only to plan it again, raises AssertionError("planned")."""
    from hloplan.compiler import Job

    class Source:
        def load(self):
            raise AssertionError("planned")

    return Job(source=Source(), pipeline=None, passes=None, after_pass=None)


def test_serial_loops_candidate_only_where_the_model_hides_loop_sends():
    """plan_serial_loops plans again only for a device model whose collective-matmul loops'
    sends it counts as hidden; the candidate's device model counts them in full."""
    import dataclasses

    from hloplan.compiler import plan_serial_loops
    from hloplan.cost_models import load_device_model

    job = _job_never_planned()
    tpu = load_device_model("tpu-v5e")
    assert tpu.collective_matmul and tpu.collective_matmul_overlap == 1.0
    for device, mesh in ((load_device_model("h100"), "2x2"),
                         (dataclasses.replace(tpu, collective_matmul_overlap=0.0), "2x2"),
                         # sends counted in full on slices past its async limit
                         (tpu, "4x8")):
        assert plan_serial_loops(job, SimpleNamespace(device=device, mesh=parse_mesh(mesh))) is None


def test_serial_loops_candidate_is_the_models_plan_where_it_prices_alike():
    """Where the model's plan counts no loop send as hidden and no strategy of its problem
    counts a negative share, counting the sends in full raises no cost of that plan and
    lowers none of another's: plan_serial_loops returns the model's plan without planning
    again. Otherwise it plans again."""
    from hloplan.compiler import make_options, plan_serial_loops
    from hloplan.strategies import OpStrategy

    def candidate(hidden_chosen, hidden_other):
        strategies = {0: [OpStrategy((), (), hidden=hidden_chosen),
                          OpStrategy((), (), hidden=hidden_other)]}
        state = SimpleNamespace(space=SimpleNamespace(strategies=strategies), solution=object(),
                                chosen=lambda index: strategies[index][0])
        return SimpleNamespace(way="single", state=state)

    job = _job_never_planned()
    options = make_options("2x2", device="tpu-v5e", mesh_views="off")
    alike = candidate(0.0, 2e-6)
    assert plan_serial_loops(job, options, alike) is alike
    for chosen in (candidate(1e-6, 0.0), candidate(0.0, -1e-6)):
        with pytest.raises(AssertionError, match="planned"):
            plan_serial_loops(job, options, chosen)


@pytest.mark.parametrize("kind", ["dp", "fsdp"])
def test_canonical_plans(kind, tmp_path, helpers):
    """solve-sharding.canonical: the same ILP restricted to data parallel or FSDP layouts; the
    batch is split over both axes, the weights replicated (dp) or split over both (fsdp). As
    `--select compiled` emits them (dp: replicated values unconstrained), the sharded program
    gives the single-device answer."""
    from hloplan.check import check_plan
    from hloplan.compiler import compile_bytes, make_options
    from hloplan.passmanager import pass_pipeline

    data = bytes(helpers.mlp_train_step_export(256, 1024, 512).serialize())
    settings = [f"solve-sharding.canonical={kind}"]
    if kind == "dp":
        settings.append("propagate-sharding.constrain_replicated=false")
    result = compile_bytes(data, "step.jaxexport",
                           make_options("2x2", device="h100", mesh_views="off"),
                           passes=pass_pipeline(tuple(settings)))
    result.write(tmp_path / "plan")
    report = check_plan(str(tmp_path / "plan"))
    assert report["match"], report
    assert result.state.facts["canonical"] == {"plan": kind, "unrestricted_nodes": 0}
    specs = {a["name"]: a["spec"] for a in result.plan["arguments"]}
    weights = [s for n, s in specs.items() if "w1" in n or "w2" in n]
    batch = [s for n, s in specs.items() if not ("w1" in n or "w2" in n)]
    assert len(weights) == 2 and len(batch) == 2
    assert all(s[0] in (["x", "y"], ["y", "x"]) and not s[1] for s in batch)
    if kind == "dp":
        assert all(not any(s) for s in weights)
    else:
        assert all(sorted(a for d in s for a in d) == ["x", "y"] for s in weights)
