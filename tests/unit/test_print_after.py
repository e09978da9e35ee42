"""`hloplan compile --print-after PASS`: the module after a pass that rewrites it; what an
analysis pass produced (the graph, the sharding problem, the tied decisions, the solution) after
one that leaves the module as it was."""

from __future__ import annotations

import json
import re
from pathlib import Path

from click.testing import CliRunner

from hloplan.cli import main

MLP = Path(__file__).resolve().parents[2] / "fixtures" / "mlp_train_step.mlir"


def _compile(tmp_path, *passes):
    args = ["compile", str(MLP), "--mesh", "2x2", "-o", str(tmp_path / "plan"), "-q"]
    for name in passes:
        args += ["--print-after", name]
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    plan = json.loads((tmp_path / "plan" / "plan.json").read_text())
    return result.stderr, plan


def _section(text: str, header: str) -> str:
    start = text.index(header)
    end = text.find("// -----//", start + len(header))
    return text[start:end if end >= 0 else len(text)]


def test_analyses_print_what_they_produced(tmp_path):
    err, plan = _compile(tmp_path, "extract-graph", "build-sharding-problem", "solve-sharding")
    assert "IR Dump" not in err  # none of these rewrites the module
    graph = _section(err, "// -----// Graph After extract-graph //----- //")
    assert re.search(r"%\d+ = stablehlo\.dot_general\(%\d+, %\d+\) : tensor<", graph)
    assert graph.count("= argument ") == len(plan["arguments"])
    problem = _section(err, "// -----// Sharding Problem After build-sharding-problem //----- //")
    decisions = re.findall(r"^decision \d+: ", problem, re.M)
    assert len(decisions) == plan["solver"]["nodes"]
    assert re.search(r"^  \[1\] .*: compute .*, communication .* per device$", problem, re.M)
    solution = _section(err, "// -----// Solution After solve-sharding //----- //")
    chosen = re.findall(r"^decision \d+: .* -> .*: compute ", solution, re.M)
    assert len(chosen) == plan["solver"]["nodes"]
    assert plan["solver"]["status"] in solution.splitlines()[1]


def test_a_rewriting_pass_prints_the_module(tmp_path):
    err, _ = _compile(tmp_path, "inline-calls", "tie-repeated-layers")
    module = _section(err, "// -----// IR Dump After inline-calls //----- //")
    assert "func.func public @main" in module
    assert "// -----// Tied Decisions After tie-repeated-layers //----- //" in err
