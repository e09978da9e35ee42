"""extract-graph: read @main into the plain-data Graph (shapes, dtypes, attributes, locations,
loop trip counts) that the planner works on."""

from __future__ import annotations

from dataclasses import dataclass

from hloplan import ir
from hloplan.state import CompileState


@dataclass(frozen=True)
class ExtractGraph:
    name: str = "extract-graph"

    def apply(self, state: CompileState) -> None:
        state.graph, state.handles = ir.extract_graph(state.program.module, state.filename)
        for op in state.graph.ops:
            if op.name == "stablehlo.while" and op.attrs.get("trip_count") is None:
                state.log.warn("loop trip count not recognised: its body is costed as running once",
                               op.location, op.name)
        state.facts["ops"] = len(state.graph.ops)
