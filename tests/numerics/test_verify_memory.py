"""`hloplan compile --verify-memory`: the plan's programs compiled by XLA (on simulated CPU
devices, in a child process) and planned again while their allocation is over the budget. The
convnet fixture on 8 devices at 1.5 MiB per device: hloplan's estimate fits, XLA's compiled
program does not; with the option the plan emitted is one XLA compiles within the budget, and
it still computes the single-device answer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

import hloplan
from hloplan.check import check_plan
from hloplan.cli import main
from hloplan.units import parse_bytes
from hloplan.verify import checked_peak, measure_files

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "convnet_train_step.mlir"
MESH = "8"
BUDGET = "1.5MiB"


def test_pipelined_peak_adds_each_stages_worst_task_excess():
    plan = {"pipeline": {
        "tasks": [{"name": "a0", "stage": 0, "peak_memory_bytes": 100},
                  {"name": "b0", "stage": 0, "peak_memory_bytes": 50},
                  {"name": "a1", "stage": 1, "peak_memory_bytes": 100}],
        "estimate": {"memory_per_stage_bytes": [130, 120]}}}
    check = checked_peak(plan, {"a0": 90, "b0": 70, "a1": 95})
    # Stage 0: b0 compiles 20 above its estimate; stage 1: a task under its estimate adds 0.
    assert check["peak_bytes"] == 150
    assert check["estimated_bytes"] == 130


def test_unverified_plan_compiles_over_the_budget():
    """The premise: at this budget the estimate's plan does not fit once XLA compiles it."""
    result = hloplan.compile(str(FIXTURE), MESH, memory_budget=BUDGET)
    check = checked_peak(result.plan, measure_files(result.files, 8))
    assert check["estimated_bytes"] <= parse_bytes(BUDGET)
    assert check["peak_bytes"] > parse_bytes(BUDGET)


def test_estimate_near_the_budget_points_at_verify_memory():
    result = hloplan.compile(str(FIXTURE), MESH, memory_budget="1MiB")
    remarks = [d.message for d in result.state.log.entries if d.severity == "remark"]
    assert any("of the memory budget" in m and "--verify-memory" in m for m in remarks), remarks
    roomy = hloplan.compile(str(FIXTURE), MESH, memory_budget="4MiB")
    assert not any("--verify-memory" in d.message for d in roomy.state.log.entries)


@pytest.mark.usefixtures("devices8")
def test_verified_plan_fits_and_equals_single_device(tmp_path):
    out = tmp_path / "plan"
    run = CliRunner().invoke(main, ["compile", str(FIXTURE), "--mesh", MESH, "-o", str(out),
                                    "--memory-budget", BUDGET, "--verify-memory"])
    assert run.exit_code == 0, run.output
    assert "memory checked with XLA (cpu): compiles to" in run.output
    plan = json.loads((out / "plan.json").read_text())
    check = plan["memory_check"]
    kept = check["tries"][check["kept"]]
    assert check["tries"][0]["peak_bytes"] > parse_bytes(BUDGET)  # the first plan did not fit
    assert kept["peak_bytes"] <= parse_bytes(BUDGET) and kept["reserve_bytes"] > 0
    assert plan["memory_budget_bytes"] == parse_bytes(BUDGET)  # the user's, not the reserve's
    # Planned on a view of the 8 devices (2x4: within this budget, a quarter of the step
    # estimated on the one axis of 8), and verified there.
    assert plan["mesh"]["view_of"] == {"axis_names": ["x"], "axis_sizes": [8]}
    # What the plan directory holds is what was measured.
    files = {str(p.relative_to(out)): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert checked_peak(plan, measure_files(files, 8))["peak_bytes"] == kept["peak_bytes"]
    explained = CliRunner().invoke(main, ["explain", str(out)])
    assert explained.exit_code == 0, explained.output
    assert f"  * plan {check['kept'] + 1} (" in explained.output
    report = check_plan(str(out))
    assert report["match"], report


def test_no_verified_plan_is_an_error_and_writes_nothing(tmp_path):
    out = tmp_path / "plan"
    run = CliRunner().invoke(main, ["compile", str(FIXTURE), "--mesh", MESH, "-o", str(out),
                                    "--memory-budget", "300KiB", "--verify-memory",
                                    "--mesh-views", "off"])
    assert run.exit_code != 0
    assert "error: no plan that XLA compiles within the memory budget of 300 KiB" in run.output
    assert "XLA compiles it to" in run.output
    assert not out.exists()
