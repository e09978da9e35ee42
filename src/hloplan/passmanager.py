"""The pass pipeline: the passes `hloplan compile` runs, top to bottom, and the loop running them.
Each pass's name labels --print-after and --time-passes."""

from __future__ import annotations

import time
from collections.abc import Callable

from hloplan import ir
from hloplan.diagnostics import UsageError
from hloplan.passes.build_sharding_problem import BuildShardingProblem
from hloplan.passes.extract_graph import ExtractGraph
from hloplan.passes.inline_calls import InlineCalls
from hloplan.passes.propagate_sharding import PropagateSharding
from hloplan.passes.rematerialize import Rematerialize
from hloplan.passes.solve_sharding import SolveSharding
from hloplan.passes.tie_repeated_layers import TieRepeatedLayers
from hloplan.state import CompileOptions, CompileState, Pass


def pass_pipeline(pass_options: tuple[str, ...] = ()) -> list[Pass]:
    """The pass pipeline, top to bottom; `pass_options`: PASS.FIELD=VALUE settings
    (`--pass-option`) applied to it."""
    passes = [
        InlineCalls(),            # private functions -> main, one copy per call site
        Rematerialize(),          # (when nothing fits) recompute cheap activations after the peak
        ExtractGraph(),           # MLIR -> plain-data graph (shapes, attrs, locations, trip counts)
        BuildShardingProblem(),   # strategies per op, resharding edges, memory points
        TieRepeatedLayers(),      # one decision per repeated layer (ILP grows with width, not depth)
        SolveSharding(),          # ILP: one strategy per op under the memory budget
        PropagateSharding(),      # write sdy shardings and constraints into the module
    ]
    if not pass_options:
        return passes
    return list(with_pass_options({p.name: p for p in passes}, pass_options).values())


PASS_NAMES = [p.name for p in pass_pipeline()]


# What each pass needs to have run before it.
PREREQUISITES = {
    "build-sharding-problem": "extract-graph",
    "tie-repeated-layers": "build-sharding-problem",
    "solve-sharding": "build-sharding-problem",
    "propagate-sharding": "solve-sharding",
}


def run_passes(program: ir.Program, options: CompileOptions, passes: list[Pass] | None = None,
                 after_pass: Callable[[str, CompileState], None] | None = None) -> CompileState:
    state = CompileState(program=program, options=options)
    steps = passes if passes is not None else pass_pipeline()
    names = [step.name for step in steps]
    for position, name in enumerate(names):
        needed = PREREQUISITES.get(name)
        if needed and needed not in names[:position]:
            raise UsageError(f"pass '{name}' needs '{needed}' to run before it",
                             notes=("passes in order: " + ", ".join(PASS_NAMES),))
    for step in steps:
        start = time.perf_counter()
        step.apply(state)
        state.timings[step.name] = time.perf_counter() - start
        if after_pass is not None:
            after_pass(step.name, state)
    return state


def with_pass_options(by_name: dict, settings: tuple[str, ...]) -> dict:
    """Passes (name -> pass) with fields replaced from PASS.FIELD=VALUE settings (options are
    frozen-dataclass fields), as `--pass-option` gives them."""
    import dataclasses

    by_name = dict(by_name)
    for setting in settings:
        key, _, text = setting.partition("=")
        pass_name, _, field_name = key.rpartition(".")
        step = by_name.get(pass_name)
        fields = {f.name: f for f in dataclasses.fields(step)} if step is not None else {}
        if not text or field_name not in fields or field_name == "name":
            raise UsageError(f"--pass-option {setting!r}: expected PASS.FIELD=VALUE with a field "
                             f"of a pass in the pipeline")
        current = getattr(step, field_name)
        try:
            annotation = str(fields[field_name].type)
            optional = "None" in annotation  # "auto": the pass decides
            kind = type(current) if current is not None else next(
                (t for t in (bool, int, float, str) if t.__name__ in annotation), str)
            if optional and text.lower() == "auto":
                value = None
            elif kind is bool:
                value = {"true": True, "false": False, "1": True, "0": False}[text.lower()]
            else:
                value = kind(text)
        except (KeyError, ValueError):
            raise UsageError(f"--pass-option {setting!r}: {text!r} is not a "
                             f"{kind.__name__}") from None
        by_name[pass_name] = dataclasses.replace(step, **{field_name: value})
    return by_name
