"""`run --check` never says "matches" when a result differs, is non-finite on one side only,
or is inf against -inf; it names the results that differ."""

from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner

from hloplan.check import _compare, format_report
from hloplan.cli import main

INF, NAN = np.inf, np.nan


@pytest.mark.parametrize("got,want,match,error", [
    ([1.0, INF], [1.0, INF], True, 0.0),
    ([NAN, 2.0], [NAN, 2.0], True, 0.0),
    ([INF, 1.0], [1.0, 1.0], False, INF),
    ([NAN, 1.0], [1.0, 1.0], False, INF),
    ([1.0, 1.0], [NAN, 1.0], False, INF),
    ([-INF], [INF], False, INF),
    ([1.0], [1.0 + 1e-7], True, None),
    ([1.0], [1.5], False, 0.5),
])
def test_compare_non_finite(got, want, match, error):
    result = _compare(np.array(got, np.float32), np.array(want, np.float32), 1e-4, 1e-5)
    assert result[1] is match
    if error is not None:
        assert result[0] == error


def test_report_names_the_differing_results():
    report = {"plan": "p", "devices": 2, "mesh": {"x": 2}, "match": False,
              "max_abs_error": float("inf"),
              "differing": [{"leaf": "[0]['loss']", "max_abs_error": float("inf")}],
              "predicted": {"collectives": {}, "peak_memory_bytes": None},
              "realised": {"collectives": {}, "memory": {}}}
    text = format_report(report)
    assert "DIFFERS FROM" in text and "differs: [0]['loss'] (max abs error inf)" in text


def test_check_with_infinite_inputs_matches_without_an_infinite_error(tmp_path):
    from hloplan.check import check_plan

    plan = tmp_path / "plan"
    result = CliRunner().invoke(main, ["compile", "fixtures/mlp_forward.mlir", "--mesh", "2",
                                       "--device", "toy", "-o", str(plan)])
    assert result.exit_code == 0, result.output
    from hloplan.emit.loader import Runner

    avals = Runner(plan).exported.in_avals
    leaves = {f"arg{i}": np.full(a.shape, INF if i == 0 else 0.5, a.dtype)
              for i, a in enumerate(avals)}
    np.savez(tmp_path / "inputs.npz", **leaves)
    report = check_plan(str(plan), inputs=str(tmp_path / "inputs.npz"))
    assert report["match"] and report["max_abs_error"] == 0.0 and report["differing"] == []
