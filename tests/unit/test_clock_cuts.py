"""plan.json's "deterministic" covers every solve of a compile: a solve the time limit cut
makes it false (and the CLI warns) even when the plan kept comes from a later solve that the
clock did not cut. The clock is faked: no test here depends on the machine's speed."""

from __future__ import annotations

import json
import time
from pathlib import Path

from click.testing import CliRunner

from hloplan.cli import main
from hloplan.compiler import make_options
from hloplan.passes import solve_sharding as solve_sharding_pass
from hloplan.passes import tie_repeated_layers
from hloplan.passes.solve_sharding import SolveSharding
from hloplan.solver import clock, ilp
from hloplan.solver.evaluate import evaluate
from hloplan.solver.problem import Edge, LivePoint, Node, ShardingProblem, Strategy
from hloplan.state import CompileState

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"


class _SlowClock:
    """Stands for the `time` module: every perf_counter read is an hour after the last (a
    machine so slow that any solve runs past its time limit)."""

    def __init__(self) -> None:
        self.reads = 0

    def perf_counter(self) -> float:
        self.reads += 1
        return time.perf_counter() + 3600.0 * self.reads


def _copy_problem() -> ShardingProblem:
    """A feeds B; the cheapest plan reshards A's layout for B, whose 40-byte gathered copy
    breaks the 30-byte budget: solve-sharding plans twice (tests/unit/test_solver.py)."""
    a = Node("A", (Strategy("x", 0.0, memory=10.0), Strategy("y", 1.0, memory=10.0)))
    b = Node("B", (Strategy("reads y", 0.0, memory=10.0), Strategy("reads x", 0.6, memory=10.0)))
    edge = Edge(0, 1, ((0.5, 0.0), (0.0, 0.5)), copies=(40.0, 40.0))
    return ShardingProblem((a, b), (edge,), (LivePoint((0,)), LivePoint((0, 1))), 30.0)


def test_a_cut_earlier_solve_makes_the_re_solved_plan_not_deterministic(monkeypatch):
    real_solve = solve_sharding_pass.axes.solve
    calls = []

    def first_solve_on_a_slow_clock(problem, **kwargs):
        calls.append(problem)
        if len(calls) == 1:
            monkeypatch.setattr(ilp, "time", _SlowClock())
        else:
            monkeypatch.setattr(ilp, "time", time)
        return real_solve(problem, **kwargs)

    monkeypatch.setattr(solve_sharding_pass.axes, "solve", first_solve_on_a_slow_clock)
    problem = _copy_problem()
    state = CompileState(program=None, options=make_options("8", device="toy"), problem=problem)
    with clock.watch() as cuts:
        SolveSharding().apply(state)
    assert len(calls) == 2 and state.facts["memory_tightened"] == 1
    assert state.solution.choice == (0, 1) and evaluate(problem, state.solution).feasible
    # The last solve itself was not cut: only the first, which shaped its problem.
    assert state.stats.status == "optimal"
    assert state.stats.extra["deterministic"] is False
    assert len(cuts) == 1
    warnings = [d.message for d in state.log.warnings]
    assert any("an earlier solve" in m for m in warnings), warnings


def test_unwatched_solves_report_nothing_and_quiet_solves_stay_deterministic():
    state = CompileState(program=None, options=make_options("8", device="toy"),
                         problem=_copy_problem())
    with clock.watch() as cuts:
        SolveSharding().apply(state)
    assert cuts == [] and state.stats.extra["deterministic"] is True
    assert not state.log.warnings


def test_a_watch_nested_in_another_leaves_the_outer_one_watching():
    """A cut inside a nested watch, then one after it: the outer watch receives both and ends
    cleanly (the inner one's list equals the outer's when it ends; it is removed, not the
    outer's)."""
    with clock.watch() as outer:
        with clock.watch() as inner:
            clock.cut("inner solve")
        clock.cut("outer solve")
    assert outer == ["inner solve", "outer solve"]
    assert inner == ["inner solve"]
    assert not clock._watchers


def test_a_cut_solve_of_a_plan_not_kept_makes_plan_json_not_deterministic(tmp_path,
                                                                          monkeypatch):
    """tie-repeated-layers' comparison solves the program twice more on a slow clock; the
    plan kept is solve-sharding's, on the real clock: plan.json still says the compile
    depended on the clock, and the CLI warns."""
    real_compare = tie_repeated_layers.compare_tied

    def compare_on_a_slow_clock(untied, tied, options):
        monkeypatch.setattr(ilp, "time", _SlowClock())
        try:
            return real_compare(untied, tied, options)
        finally:
            monkeypatch.setattr(ilp, "time", time)

    args = ["compile", str(FIXTURES / "mlp_forward.mlir"), "--mesh", "2", "--device", "toy",
            "--pass-option", "tie-repeated-layers.min_decisions=0",
            "--pass-option", "tie-repeated-layers.compare_untied=true"]
    quiet = CliRunner().invoke(main, [*args, "-o", str(tmp_path / "quiet")])
    assert quiet.exit_code == 0, quiet.output
    assert json.loads((tmp_path / "quiet" / "plan.json").read_text())["solver"]["deterministic"]
    monkeypatch.setattr(tie_repeated_layers, "compare_tied", compare_on_a_slow_clock)
    slow = CliRunner().invoke(main, [*args, "-o", str(tmp_path / "slow")])
    assert slow.exit_code == 0, slow.output
    plan = json.loads((tmp_path / "slow" / "plan.json").read_text())
    assert plan["solver"]["status"] == "optimal"
    assert plan["solver"]["deterministic"] is False
    warnings = [d["message"] for d in plan["diagnostics"] if d["severity"] == "warning"]
    assert any("made while choosing the plan" in m for m in warnings), warnings
    assert "made while choosing the plan" in slow.output


class _FastClock:
    """Stands for the `time` module: a minute passes between perf_counter reads."""

    def __init__(self) -> None:
        self.now = time.perf_counter()

    def perf_counter(self) -> float:
        self.now += 60.0
        return self.now


def test_the_clock_changes_nothing_but_whether_the_limit_is_reached(monkeypatch):
    """The same plan, bound and status on a clock running far ahead, as long as the time
    limit is not reached: elapsed time is compared with the deadline and nothing else."""
    from test_solver import random_problem

    from hloplan.solver import axes, backends, heuristics

    # Fractional LP, heuristics and branch and bound stopped at the root by a count.
    problem = random_problem(11, n=60, k=4, m=150)
    kwargs = dict(time_limit=1e9, node_limit=0)
    first, stats = ilp.solve(problem, **kwargs)
    for module in (ilp, axes, backends, heuristics):
        monkeypatch.setattr(module, "time", _FastClock())
    again, fast = ilp.solve(problem, **kwargs)
    assert again == first
    assert (fast.status, fast.objective, fast.bound) == (stats.status, stats.objective,
                                                         stats.bound)
    assert fast.extra["deterministic"] is stats.extra["deterministic"] is True
