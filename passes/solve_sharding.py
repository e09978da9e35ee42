"""solve-sharding: pick one strategy per node with the ILP, under the memory budget."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from hloplan.canonical import allowed_strategies, restrict, widen
from hloplan.diagnostics import Diagnostic, HloplanError, NoPlanFits
from hloplan.solver import axes, clock
from hloplan.solver.backends import MIP_NODE_LIMIT as NODE_LIMIT
from hloplan.solver.evaluate import copy_bytes, evaluate, memory_fits
from hloplan.solver.ilp import InfeasibleError, SolverError
from hloplan.solver.liveness import Liveness
from hloplan.solver.problem import LiveRange, Node, ShardingProblem, Solution, Strategy
from hloplan.state import CompileState
from hloplan.units import format_bytes

# The relative gap at which planning stops is CompileOptions.gap (default 1%): a plan proven
# within 1% of the optimum is as good as the cost model's own accuracy, and proving the last
# fraction of a percent took a Llama3-8B step 7 of its 10 s of solving. The plan's gap to the
# best bound is reported in plan.json ("solver": "gap"; status "within_gap" when above 1e-6).


@dataclass(frozen=True)
class SolveSharding:
    name: str = "solve-sharding"

    # The ILP does not see the resharded copies an op reads (an all-gathered operand, made
    # before the op and held until the last matmul reading it): they depend on two decisions
    # at once. When the plan's peak with them is over the budget, the ILP is solved again with
    # each reader holding, over the copy's span, the copies it would read given its sources'
    # strategies in the plans so far (exact while the sources keep them), from the third solve
    # on also under a budget lowered by the excess; at most this many times.
    max_tightening: int = 3
    # A held copy is charged to every strategy of its reader as if the reader's sources kept
    # the strategies of the plans so far, so the problem holding them can have no solution
    # while a plan fits (its sources change, and with them its copies). It is then solved
    # under these multiples of its budget, and the first plan whose peak with the copies it
    # does read fits the budget is kept.
    loosen: tuple[float, ...] = (1.05, 1.1, 1.2, 1.4)
    # "" (the planner's own plan), or a canonical plan solved as a restriction of the same ILP:
    # "dp" or "fsdp" (hloplan/canonical.py; `--select compiled` plans both).
    canonical: str = ""

    def apply(self, state: CompileState) -> None:
        options = state.options
        links = tuple(link.name for link in state.comm.links) if state.comm is not None else None
        original = state.problem
        allowed = None
        if self.canonical:
            allowed, unrestricted = allowed_strategies(state, self.canonical)
            original = restrict(original, allowed)
            state.facts["canonical"] = {"plan": self.canonical, "unrestricted_nodes": unrestricted}
        with clock.watch() as cuts:
            attempt = self._solve(state, original, links)
        # An earlier attempt the clock cut shaped the problem of the later ones (`seen`, the
        # lowered budget): the plan then depends on the machine even if the last is not cut.
        earlier_cut = bool(cuts) and state.stats.extra.get("deterministic", True)
        if cuts:
            state.stats.extra["deterministic"] = False
        state.facts["memory_tightened"] = attempt
        if allowed is not None:
            state.solution = widen(state.solution, allowed)
        if state.stats.status == "decomposed":
            steps = state.stats.extra.get("steps", [])
            state.log.remark(
                f"solve-sharding: {state.stats.extra.get('full_variables', 0):,}-variable ILP "
                f"planned on two-axis views in {len(steps)} steps (not proven optimal)")
        elif state.stats.status == "within_gap":
            state.log.remark(
                f"solve-sharding: plan within {state.stats.gap:.2%} of the optimum (stopped "
                f"inside the {options.gap:.2%} relative gap)")
        elif state.stats.status == "node_limit":
            state.log.warn(
                f"branch and bound stopped at its node limit ({NODE_LIMIT} nodes per solve) with "
                f"a feasible plan; gap to the best bound {_gap_text(state.stats.gap)}",
                notes=("a limit on work, not time: the same plan on any machine",))
        elif state.stats.status != "optimal":
            state.log.warn(
                f"solver stopped at its time limit ({options.time_limit:g} s) with a feasible plan; "
                f"gap to the best bound {_gap_text(state.stats.gap)}; the plan depends on this "
                "machine's speed", notes=("raise --time-limit for a proven optimum",))
        if (not state.stats.extra.get("deterministic", True)
                and state.stats.status in ("optimal", "within_gap")):
            state.log.warn(
                f"the time limit ({options.time_limit:g} s) cut the solver's search short: the "
                "plan is proven within the gap, but another machine may find another one",
                notes=("raise --time-limit for the same plan on any machine",))
        if earlier_cut:
            state.log.warn(
                f"the time limit ({options.time_limit:g} s) cut the search of an earlier solve "
                f"({cuts[0]}): the plan solved again after it depends on this machine's speed",
                notes=("raise --time-limit for the same plan on any machine",))

    def _loosened(self, state: CompileState, original: ShardingProblem,
                  problem: ShardingProblem, links) -> bool:
        """Solve `problem` (copies held) under looser budgets, keeping the first plan whose
        peak with the copies it reads fits `original`'s budget; whether one did."""
        budget = original.memory_budget
        for factor in self.loosen:
            nominal = problem.memory_budget * factor
            try:
                solution, stats = _solve_problem(
                    state, dataclasses.replace(problem, memory_budget=nominal), links)
            except InfeasibleError:
                continue
            choice = Solution(solution.choice[:len(original.nodes)])
            if memory_fits(evaluate(original, choice).peak_memory, budget):
                state.solution, state.stats = choice, stats
                state.facts["memory_loosened"] = factor
                state.log.remark(
                    f"solve-sharding: the resharded copies charged as the earlier plans read "
                    f"them left no plan under {format_bytes(problem.memory_budget)}; solved with "
                    f"them under {format_bytes(nominal)}, the plan fits "
                    f"{format_bytes(budget)} with the copies it reads")
                return True
        return False

    def _solve(self, state: CompileState, original: ShardingProblem, links) -> int:
        """Plan `original` into state.solution and state.stats, solving again with the copies
        read held while the plan is over the budget; how many times it was solved again."""
        options = state.options
        budget = original.memory_budget
        problem = original
        seen: dict[int, np.ndarray] = {}  # edge -> largest copy bytes per reader strategy yet
        for attempt in range(self.max_tightening + 1):
            try:
                solution, state.stats = _solve_problem(state, problem, links)
                # Without the nodes standing for held copies (_with_copies_held).
                state.solution = Solution(solution.choice[:len(original.nodes)])
            except InfeasibleError as exc:
                if attempt and self._loosened(state, original, problem, links):
                    break
                # Callers that plan parts of a program (pipeline stages) report the smallest
                # peak: known only for the problem as given (the held copies overcharge plans
                # whose sources move).
                details = getattr(exc, "details", None)
                raise NoPlanFits(_infeasible_diagnostic(state, exc, attempt, self.loosen),
                                 None if attempt else getattr(details, "min_peak", None)
                                 ) from None
            except SolverError as exc:  # e.g. no plan found within the time limit
                raise HloplanError(Diagnostic(
                    "error", f"no plan found for mesh {options.mesh}", None,
                    (str(exc),) + ((f"planned {attempt + 1} times: the earlier plans were over "
                                    "the budget once the resharded copies they read were "
                                    "counted",) if attempt else ()))) from None
            peak = evaluate(original, state.solution).peak_memory
            if memory_fits(peak, budget):
                break
            lowered = problem.memory_budget - (peak - budget) if attempt >= 1 else budget
            problem = dataclasses.replace(_with_copies_held(original, state.solution, seen),
                                          memory_budget=lowered)
        else:
            raise NoPlanFits(Diagnostic(
                "error", f"no plan fits the memory budget of {format_bytes(budget)} per device "
                f"on mesh {options.mesh}", None,
                (f"the plans under it need resharded copies of their operands on top (planned "
                 f"{self.max_tightening + 1} times, counting the copies the previous plans "
                 f"read; last peak {format_bytes(peak)})",
                 "raise --memory-budget, use a larger mesh, or shrink the program")), None)
        return attempt


def _solve_problem(state: CompileState, problem: ShardingProblem, links):
    """axes.solve of `problem` with the compile's solver options: (solution, stats)."""
    options = state.options
    return axes.solve(problem, time_limit=options.time_limit, solver=options.solver,
                      decompose=options.decompose, links=links, gap=options.gap)


def _gap_text(gap: float) -> str:
    return f"{gap:.2%}" if math.isfinite(gap) else "unknown (no bound found in time)"


def _with_copies_held(problem: ShardingProblem, solution: Solution,
                      seen: dict[int, np.ndarray]) -> ShardingProblem:
    """`problem` with each reader's strategies also holding the resharded copies it would read
    given its sources' strategies in `solution` (and in the solutions `seen` so far: the
    largest per edge), in bytes the ILP can see: a copy held only at the reader's first live
    point as transient bytes there, one held longer as a node tied to the reader (its
    decision) and live over the copy's span. The added nodes come after the problem's own."""
    liveness = Liveness(problem)
    firsts = liveness.made
    spans = liveness.span_of
    for e in spans:
        edge = problem.edges[e]
        i = solution.choice[edge.src]
        row = np.array([copy_bytes(edge, i, j) for j in range(len(edge.copies))])
        seen[e] = row if e not in seen else np.maximum(seen[e], row)
    transient: dict[int, np.ndarray] = {}
    held: list[tuple[int, tuple[int, int], np.ndarray]] = []
    for e, row in seen.items():
        dst, span = problem.edges[e].dst, spans[e]
        if not row.any():
            continue
        if span == (firsts.get(dst), firsts.get(dst)):
            transient[dst] = row if dst not in transient else transient[dst] + row
        else:
            held.append((dst, span, row))
    nodes = list(problem.nodes)
    for index, row in transient.items():
        nodes[index] = dataclasses.replace(nodes[index], strategies=tuple(
            s.plus_transient(float(extra))
            for s, extra in zip(nodes[index].strategies, row, strict=True)))
    ranges = list(problem.live_ranges)
    fresh = max((n.tie for n in nodes if n.tie is not None), default=-1) + 1
    for dst, (start, end), row in held:
        if nodes[dst].tie is None:
            nodes[dst] = dataclasses.replace(nodes[dst], tie=fresh)
            fresh += 1
        ranges.append(LiveRange(len(nodes), start, end))
        nodes.append(Node(f"copy read by {nodes[dst].name}", tuple(
            Strategy(s.name, memory=float(extra), axes=s.axes)
            for s, extra in zip(nodes[dst].strategies, row, strict=True)), tie=nodes[dst].tie))
    return dataclasses.replace(problem, nodes=tuple(nodes), live_ranges=tuple(ranges))


def _infeasible_diagnostic(state: CompileState, exc: InfeasibleError, tightened: int = 0,
                           loosen: tuple[float, ...] = ()) -> Diagnostic:
    options = state.options
    budget = options.plan_budget
    # After the first solve the problem holds the copies the earlier plans read, charging
    # plans whose sources change copies they do not make: its smallest peak binds only it.
    notes = [("with the resharded copies held as the earlier plans read them (exact only for "
              "readers whose sources keep those plans' layouts): " if tightened else "")
             + str(exc)]
    if options.memory_reserve:
        notes.insert(0, f"planned under {format_bytes(budget)}: the budget less "
                     f"{format_bytes(options.memory_reserve)} that XLA's compiled program "
                     "needed beyond the estimate (--verify-memory)")
    if tightened:
        notes.insert(0, f"planned under the budget less the resharded copies the first plans "
                     f"read (an all-gathered operand is held while its op runs; {tightened} "
                     "times)")
    details = exc.details
    at_least = "" if details.proven else "at least "
    if tightened:
        notes.append(f"plans fit the budget without the resharded copies their operands need; "
                     f"none found fits with them, also planned under up to "
                     f"{max((1.0, *loosen)):g} x the budget")
    else:
        notes.append(f"the smallest peak any plan reaches is {at_least}"
                     f"{format_bytes(details.min_peak)}, {at_least}"
                     f"{format_bytes(max(details.shortfall, 0))} over the "
                     f"{format_bytes(details.budget)} it was planned under")
    dominant = _largest_values(state)
    if dominant:
        notes.append("largest tensors: " + ", ".join(dominant))
    notes.append("raise --memory-budget, use a larger mesh, or shrink the program")
    return Diagnostic("error", f"no plan fits the memory budget of {format_bytes(options.budget)} "
                      f"per device on mesh {options.mesh}", None, tuple(notes))


def _largest_values(state: CompileState, count: int = 3) -> list[str]:
    graph = state.graph
    if graph is None:  # a problem given as plain data
        return []
    sized = sorted(((graph.type_of(v).nbytes, name) for v, name in
                    zip(graph.arguments, graph.argument_names) if graph.type_of(v) is not None),
                   reverse=True)[:count]
    return [f"{name} ({format_bytes(size)} unsharded)" for size, name in sized]
