"""inline-calls: inline every private function reached by func.call into @main.

jax emits a private function per nested jit (jnp.where, relu, a scan body...); inlining gives
each call site its own ops, so each can be sharded on its own.

A stablehlo.composite (jax.lax.top_k -> "chlo.top_k") stays one op and its decomposition
function stays in the module: XLA may run the composite as one kernel, and the planner has a
rule for it. `composites=True` replaces each composite by its decomposition's ops instead: the
microbatch and pipeline cut rebuilds ops with a smaller batch, which a composite's separately
typed decomposition function would not match.
"""

from __future__ import annotations

from dataclasses import dataclass

from hloplan import ir
from hloplan.state import CompileState


@dataclass(frozen=True)
class InlineCalls:
    name: str = "inline-calls"
    composites: bool = False

    def apply(self, state: CompileState) -> None:
        state.facts["inlined_calls"] = ir.inline_calls(state.program.module, state.filename,
                                                       composites=self.composites)
        # Loop regions get their own copies of the constants they read.
        state.facts["sunk_constants"] = ir.sink_constants(state.program.module, state.filename)
