"""extract-graph: read @main into the plain-data Graph (shapes, dtypes, attributes, locations,
loop trip counts) that the planner works on.

`donate` says which arguments the caller hands over, their buffers reused for results: "export"
those the export donates (jax.jit's donate_argnums, kept by jax.export); "state" also every
argument the step updates in place (a parameter's or optimizer moment's next value is
computed from it by elementwise ops of its type: label_batch.state_outputs), for a program
exported without donation whose caller passes each step's state back; "none" no argument."""

from __future__ import annotations

from dataclasses import dataclass

from hloplan import ir
from hloplan.diagnostics import UsageError
from hloplan.graph import DONATE_CHOICES
from hloplan.op_rules import OpRule, rule_for
from hloplan.state import CompileState


@dataclass(frozen=True)
class ExtractGraph:
    name: str = "extract-graph"
    donate: str = "export"
    # Remark each op's sharding rule (op_rules.rule_for: its factors, and the factors of each
    # operand and result dim): what the planner may shard, for golden tests and debugging.
    print_op_rules: bool = False

    def apply(self, state: CompileState) -> None:
        if self.donate not in DONATE_CHOICES:
            raise UsageError(f"donate={self.donate!r}: expected one of {', '.join(DONATE_CHOICES)}")
        state.graph, state.handles = ir.extract_graph(state.program.module, state.filename)
        graph = state.graph
        if self.donate == "none":
            graph.donated = {}
        elif self.donate == "state":
            from hloplan.passes.label_batch import state_outputs

            index_of = {v: k for k, v in reversed(list(enumerate(graph.outputs)))}
            taken = {out for out in graph.donated.values() if out is not None}
            for position, value in sorted(state_outputs(graph).items()):
                if position not in graph.donated and index_of[value] not in taken:
                    graph.donated[position] = index_of[value]
                    taken.add(index_of[value])
        for op in state.graph.ops:
            if op.name == "stablehlo.while" and op.attrs.get("trip_count") is None:
                state.log.warn("loop trip count not recognised: its body is costed as running once",
                               op.location, op.name)
        state.facts["ops"] = len(state.graph.ops)
        if self.print_op_rules:
            for op in graph.ops:
                state.log.remark(f"{op.name}: {describe_rule(rule_for(graph, op))}", op.location)


def describe_rule(rule: OpRule) -> str:
    """One line: the factors (f<i>=size, with their kind unless "pass"), then each operand's and
    result's dims as the factors they map to, major to minor ("-": none, "none": not planned)."""
    def dims(tensor) -> str:
        if tensor is None:
            return "none"
        return "[" + ", ".join("*".join(f"f{i}" for i in dim) or "-" for dim in tensor) + "]"

    factors = ", ".join(f"f{i}={f.size}" + ("" if f.kind == "pass" else f" {f.kind}")
                        for i, f in enumerate(rule.factors))
    text = (f"factors {{{factors}}} operands {' '.join(dims(t) for t in rule.operands) or '-'}"
            f" results {' '.join(dims(t) for t in rule.results) or '-'}")
    if any(f.kind == "reduce" for f in rule.factors) and rule.reduction != "sum":
        text += f" reduction {rule.reduction}"
    for flag in ("free", "pointwise"):
        if getattr(rule, flag):
            text += f" {flag}"
    if rule.fallback is not None:
        text += f" replicated ({rule.fallback})"
    return text
