"""solve-sharding: pick one strategy per node with the ILP, under the memory budget."""

from __future__ import annotations

import math
from dataclasses import dataclass

from hloplan.diagnostics import Diagnostic, HloplanError
from hloplan.solver import axes
from hloplan.solver.ilp import InfeasibleError
from hloplan.state import CompileState
from hloplan.units import format_bytes

# The relative gap at which planning stops is CompileOptions.gap (default 1%): a plan proven
# within 1% of the optimum is as good as the cost model's own accuracy, and proving the last
# fraction of a percent took a Llama3-8B step 7 of its 10 s of solving. The plan's gap to the
# best bound is reported in plan.json ("solver": "gap"; status "within_gap" when above 1e-6).


@dataclass(frozen=True)
class SolveSharding:
    name: str = "solve-sharding"

    def apply(self, state: CompileState) -> None:
        options = state.options
        links = tuple(link.name for link in state.comm.links) if state.comm is not None else None
        try:
            state.solution, state.stats = axes.solve(
                state.problem, time_limit=options.time_limit, solver=options.solver,
                decompose=options.decompose, links=links,
                gap=options.gap)
        except InfeasibleError as exc:
            error = HloplanError(_infeasible_diagnostic(state, exc))
            details = getattr(exc, "details", None)
            # Callers that plan parts of a program (pipeline stages) report the smallest peak.
            error.min_peak = getattr(details, "min_peak", None)
            raise error from None
        if state.stats.status == "decomposed":
            steps = state.stats.extra.get("steps", [])
            state.log.remark(
                f"solve-sharding: {state.stats.extra.get('full_variables', 0):,}-variable ILP "
                f"planned on two-axis views in {len(steps)} steps (not proven optimal)")
        elif state.stats.status == "within_gap":
            state.log.remark(
                f"solve-sharding: plan within {state.stats.gap:.2%} of the optimum (stopped "
                f"inside the {options.gap:.2%} relative gap)")
        elif state.stats.status != "optimal":
            gap = state.stats.gap
            gap_text = f"{gap:.2%}" if math.isfinite(gap) else "unknown (no bound found in time)"
            state.log.warn(
                f"solver stopped at its time limit ({options.time_limit:g} s) with a feasible plan; "
                f"gap to the best bound {gap_text}",
                notes=("raise --time-limit for a proven optimum",))


def _infeasible_diagnostic(state: CompileState, exc: InfeasibleError) -> Diagnostic:
    budget = state.options.budget
    notes = [str(exc)]
    details = getattr(exc, "details", None) or {}
    minimum = details.get("min_peak") if isinstance(details, dict) else None
    if minimum is not None:
        notes.append(f"the smallest peak any plan reaches is {format_bytes(minimum)}, "
                     f"{format_bytes(max(minimum - budget, 0))} over the budget")
    dominant = _largest_values(state)
    if dominant:
        notes.append("largest tensors: " + ", ".join(dominant))
    notes.append("raise --memory-budget, use a larger mesh, or shrink the program")
    return Diagnostic("error", f"no plan fits the memory budget of {format_bytes(budget)} per device "
                      f"on mesh {state.options.mesh}", None, tuple(notes))


def _largest_values(state: CompileState, count: int = 3) -> list[str]:
    graph = state.graph
    sized = sorted(((graph.type_of(v).nbytes, name) for v, name in
                    zip(graph.arguments, graph.argument_names) if graph.type_of(v) is not None),
                   reverse=True)[:count]
    return [f"{name} ({format_bytes(size)} unsharded)" for size, name in sized]
