"""Digest of the plans hloplan makes for the fixtures and a few small benchmark programs.

A refactor of the planner that must not change its plans is checked by running this before and
after and comparing the output line by line:

    .venv/bin/python benchmarks/plan_digest.py > before.txt
    ... change the planner ...
    .venv/bin/python benchmarks/plan_digest.py | diff before.txt -

Each line is one case (program, mesh, options) and the sha256 of the plan directory's plan.json
and annotated module.mlir, or of the error the compile reported. Cases: every fixtures/*.jaxexport
and the benchmarks/models.py programs at their "small" size, on the meshes 8, 2x4 and 2x2x2;
then memory budgets under some programs' unconstrained peak (so that the memory constraints,
rematerialisation, accumulation and the infeasibility report take part) and a two-stage
pipeline. The solver's time limit is far above what these problems need, so its answers are
optimal (within the gap) rather than wherever a timer stopped it.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

ROOT = Path(__file__).resolve().parent.parent
MESHES = ("8", "2x4", "2x2x2")
MODELS = ("mlp", "gpt", "llama", "bert", "moe", "resnet")
# Fractions of the unconstrained plan's peak used as budgets (on the 2x4 mesh), for the
# programs whose memory-tight searches take seconds rather than minutes.
BUDGET_FRACTIONS = (0.6, 0.3)
BUDGET_PROGRAMS = ("convnet_train_step", "misc_ops", "mlp_forward", "mlp_train_step",
                   "scan_forward", "scan_train_step", "mlp")
TIME_LIMIT = 60.0


def digest(result) -> str:
    h = hashlib.sha256()
    for name in ("plan.json", "module.mlir"):
        h.update(name.encode() + b"\0" + result.files[name] + b"\0")
    return h.hexdigest()


def programs(only: set[str] | None):
    """(name, serialized Exported) of every fixture and small benchmark program."""
    for path in sorted((ROOT / "fixtures").glob("*.jaxexport")):
        if only is None or path.stem in only:
            yield path.stem, path.read_bytes()
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import jax
    import models

    # Locations name the innermost user frame only: with full tracebacks they would also name
    # this script's lines, and editing it would change every digest.
    jax.config.update("jax_include_full_tracebacks_in_locations", False)

    for name in MODELS:
        if only is not None and name not in only:
            continue
        _, state_spec, batch_spec, step = models.MODELS[name].build("small", 8)
        yield name, models.export_step(step, state_spec, batch_spec).serialize()


def run_case(data: bytes, label: str, mesh: str, **kwargs) -> tuple[str, object]:
    from hloplan.compiler import compile
    from hloplan.diagnostics import HloplanError

    started = time.perf_counter()
    try:
        result = compile(data, mesh, time_limit=TIME_LIMIT, **kwargs)
        line, out = digest(result), result
    except HloplanError as exc:
        line, out = "error " + hashlib.sha256(str(exc).encode()).hexdigest(), None
    print(f"{label:48s} {line}", flush=True)
    print(f"  {label}: {time.perf_counter() - started:.1f}s", file=sys.stderr, flush=True)
    return line, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="program names to digest (default: all)")
    args = parser.parse_args()
    only = set(args.only) if args.only else None
    from hloplan.pipelining import PipelineOptions

    started = time.perf_counter()
    for name, data in programs(only):
        peak = None
        for mesh in MESHES:
            _, result = run_case(data, f"{name} mesh={mesh}", mesh)
            if mesh == "2x4" and result is not None:
                peak = result.plan["estimate"]["peak_memory_bytes"]
        if peak is not None and name in BUDGET_PROGRAMS:
            for fraction in BUDGET_FRACTIONS:
                budget = int(peak * fraction)
                run_case(data, f"{name} mesh=2x4 budget={fraction}", "2x4", memory_budget=budget)
        if name in ("gpt", "mlp_train_step"):
            run_case(data, f"{name} mesh=8 stages=2", "8", pipeline=PipelineOptions(stages=2))
    print(f"  total {time.perf_counter() - started:.1f}s", file=sys.stderr)


if __name__ == "__main__":
    main()
