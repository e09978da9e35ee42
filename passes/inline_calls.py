"""inline-calls: inline every private function reached by func.call into @main.

jax emits a private function per nested jit (jnp.where, relu, a scan body...); inlining gives
each call site its own ops, so each can be sharded on its own.
"""

from __future__ import annotations

from dataclasses import dataclass

from hloplan import ir
from hloplan.state import CompileState


@dataclass(frozen=True)
class InlineCalls:
    name: str = "inline-calls"

    def apply(self, state: CompileState) -> None:
        state.facts["inlined_calls"] = ir.inline_calls(state.program.module, state.filename)
        # Loop regions get their own copies of the constants they read.
        state.facts["sunk_constants"] = ir.sink_constants(state.program.module, state.filename)
