"""What `--print-after PASS` prints: the module after a pass that rewrites it, and what an
analysis pass produced, in words, after one that leaves the module as it was: the graph
(extract-graph), the sharding problem (build-sharding-problem), the tied decisions
(tie-repeated-layers) and the solution (solve-sharding)."""

from __future__ import annotations

from collections.abc import Callable

from hloplan import ir
from hloplan.state import CompileState
from hloplan.units import format_bytes, format_seconds


def after_pass(name: str, state: CompileState) -> str:
    """The dump of `state` after pass `name`, with a header line naming what it shows."""
    what, render = ANALYSES.get(name, ("IR Dump", _module))
    return f"// -----// {what} After {name} //----- //\n{render(state)}"


def _module(state: CompileState) -> str:
    return ir.module_text(state.program.module)


def _facts(state: CompileState, keys: tuple[str, ...] | None = None) -> str:
    items = [(k, v) for k, v in state.facts.items()
             if (keys is None or k in keys) and isinstance(v, (int, float, str, bool))]
    return ", ".join(f"{k} {v}" for k, v in items)


def _graph(state: CompileState) -> str:
    graph = state.graph

    def value(v: int) -> str:
        return f"%{v}"

    lines = [f"// {len(graph.ops)} ops, {len(graph.values)} values"]
    for name, v in zip(graph.argument_names, graph.arguments):
        donated = " donated" if graph.arguments.index(v) in graph.donated else ""
        lines.append(f"{value(v)} = argument {name!r} : {graph.type_of(v)}{donated}")
    for op in graph.ops:
        if op.name == "arg":
            continue
        results = ", ".join(value(v) for v in op.results)
        types = ", ".join(str(graph.type_of(v)) for v in op.results)
        line = (f"{results} = " if results else "") + f"{op.name}("
        line += ", ".join(value(v) for v in op.operands) + f") : {types}"
        if op.multiplier != 1:
            line += f"  x{op.multiplier:g} per step"
        if op.parent is not None:
            line += f"  in op {op.parent}"
        if op.location is not None:
            line += f"  // {op.location}"
        lines.append(line)
    lines.append("return " + ", ".join(f"{value(v)} ({name})" for v, name in
                                       zip(graph.outputs, graph.output_names)))
    return "\n".join(lines)


def _strategy(strategy) -> str:
    return (f"{strategy.name}: compute {format_seconds(strategy.compute_cost)}, communication "
            f"{format_seconds(strategy.communication_cost)}, "
            f"{format_bytes(strategy.memory)} per device")


def _problem(state: CompileState) -> str:
    problem = state.problem
    lines = [f"// {len(problem.nodes)} decisions, {len(problem.edges)} resharding edges, "
             f"{len(problem.live_points)} memory checks; budget "
             f"{format_bytes(state.options.plan_budget)} per device on mesh {state.options.mesh}"]
    for index, node in enumerate(problem.nodes):
        tie = f" (tie {node.tie})" if node.tie is not None else ""
        lines.append(f"decision {index}: {node.name}{tie}")
        lines.extend(f"  [{k}] {_strategy(s)}" for k, s in enumerate(node.strategies))
    return "\n".join(lines)


def _tied(state: CompileState) -> str:
    groups: dict[int, list[int]] = {}
    for index, node in enumerate(state.problem.nodes):
        if node.tie is not None:
            groups.setdefault(node.tie, []).append(index)
    lines = [f"// {_facts(state, _TIE_FACTS) or 'nothing tied'}"]
    lines.extend(f"tie {tie}: decisions {', '.join(map(str, members))}"
                 for tie, members in sorted(groups.items()))
    return "\n".join(lines)


_TIE_FACTS = ("tied_groups", "tied_nodes", "decisions_before_tying", "decisions_after_tying",
              "live_points_before_pruning", "live_points_after_pruning", "tied_gap")


def _solution(state: CompileState) -> str:
    from hloplan.solver.evaluate import evaluate

    problem, solution, stats = state.problem, state.solution, state.stats
    evaluation = evaluate(problem, solution)
    lines = [f"// {stats.solver}: {stats.status}, gap {stats.gap:.2%}; estimated step "
             f"{format_seconds(evaluation.total)} (compute {format_seconds(evaluation.compute)}, "
             f"communication {format_seconds(evaluation.communication)}, resharding "
             f"{format_seconds(evaluation.resharding)}), peak "
             f"{format_bytes(evaluation.peak_memory)} per device"]
    for index, (node, choice) in enumerate(zip(problem.nodes, solution.choice)):
        lines.append(f"decision {index}: {node.name} -> {_strategy(node.strategies[choice])}")
    return "\n".join(lines)


# Passes that leave the module as it was: what each produced, and how it is printed.
ANALYSES: dict[str, tuple[str, Callable[[CompileState], str]]] = {
    "extract-graph": ("Graph", _graph),
    "build-sharding-problem": ("Sharding Problem", _problem),
    "tie-repeated-layers": ("Tied Decisions", _tied),
    "solve-sharding": ("Solution", _solution),
}
