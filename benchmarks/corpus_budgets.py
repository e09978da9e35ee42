"""Tight memory budgets on the third-party corpus: each train program (examples/third_party,
tiny size, toy device, mesh 8) planned under 0.95, 0.90, ..., 0.50 of its unbudgeted peak
with no flag but --memory-budget; what hloplan runs at each budget (the program as it
stands, recomputing activations, or accumulating gradients over microbatches), its estimated
peak and step.

    .venv/bin/python benchmarks/corpus_budgets.py                # corpus_budgets_results.json
    .venv/bin/python benchmarks/corpus_budgets.py --no-loosen    # solve-sharding loosen=()
    .venv/bin/python benchmarks/corpus_budgets.py --markdown     # the table docs/memory.md shows

`--no-loosen` plans the single program (as it stands, or recomputing) without solve-sharding's
loosened re-solves (docs/solver.md, "Memory rules"); the per-microbatch tasks of an
accumulated plan keep them.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("KERAS_BACKEND", "jax")

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "examples" / "third_party"))

RESULTS = HERE / "corpus_budgets_results.json"
FRACTIONS = [round(0.95 - 0.05 * k, 2) for k in range(10)]
MESH = "8"
DEVICE = "toy"
TIME_LIMIT = 60.0


def _passes(loosen: bool):
    from hloplan.passes.solve_sharding import SolveSharding
    from hloplan.passmanager import pass_pipeline

    if loosen:
        return None
    return [SolveSharding(loosen=()) if p.name == "solve-sharding" else p
            for p in pass_pipeline()]


def plan_under(data: bytes, budget: float | None, loosen: bool) -> dict:
    """What hloplan runs under `budget`: way, microbatches, estimated peak and step."""
    from hloplan.compiler import compile_bytes, make_options
    from hloplan.diagnostics import NoPlanFits

    options = make_options(MESH, device=DEVICE, time_limit=TIME_LIMIT,
                           memory_budget=None if budget is None else int(budget))
    try:
        plan = compile_bytes(data, "step.jaxexport", options, passes=_passes(loosen)).plan
    except NoPlanFits:
        return {"way": "none"}
    pipeline = plan.get("pipeline") or {}
    if pipeline.get("tasks"):  # the loader runs the accumulated plan
        estimate = pipeline["estimate"]
        return {"way": "accumulated", "microbatches": pipeline.get("microbatches"),
                "peak_bytes": max(estimate["memory_per_stage_bytes"]),
                "step_s": estimate["step_time_s"],
                "single_recomputes": bool(plan.get("rematerialized"))}
    return {"way": "recomputing" if plan.get("rematerialized") else "as it stands",
            "peak_bytes": plan["estimate"]["peak_memory_bytes"],
            "step_s": plan["estimate"]["step_time_s"]}


def run(loosen: bool, names: list[str] | None) -> dict:
    import corpus

    programs = {}
    started = time.perf_counter()
    for program in corpus.PROGRAMS:
        if program.kind != "train" or (names and program.name not in names):
            continue
        data, _ = program.export()
        unbudgeted = plan_under(data, None, loosen)
        rows = [{"fraction": f, **plan_under(data, f * unbudgeted["peak_bytes"], loosen)}
                for f in FRACTIONS]
        programs[program.name] = {"peak_bytes": unbudgeted["peak_bytes"],
                                  "step_s": unbudgeted["step_s"], "budgets": rows}
        print(program.name, " ".join(_cell(r) for r in rows),
              f"({time.perf_counter() - started:.0f} s)", flush=True)
    return {"mesh": MESH, "device": DEVICE, "loosen": loosen, "fractions": FRACTIONS,
            "programs": programs, "wall_s": time.perf_counter() - started}


def _cell(row: dict) -> str:
    way = row["way"]
    if way == "as it stands":
        return "S"
    if way == "recomputing":
        return "R"
    if way == "accumulated":
        return f"A{row.get('microbatches') or ''}"
    return "-"


def markdown(result: dict) -> str:
    head = " | ".join(f"{f:.2f}" for f in result["fractions"])
    lines = [f"| program | {head} |", "|---|" + "---|" * len(result["fractions"])]
    for name, entry in result["programs"].items():
        lines.append(f"| {name} | " + " | ".join(_cell(r) for r in entry["budgets"]) + " |")
    counts: dict[str, int] = {}
    for entry in result["programs"].values():
        for row in entry["budgets"]:
            counts[row["way"]] = counts.get(row["way"], 0) + 1
    lines.append("")
    lines.append(", ".join(f"{way}: {n}" for way, n in sorted(counts.items())))
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-loosen", action="store_true")
    parser.add_argument("--programs", default=None, help="comma-separated corpus names")
    parser.add_argument("--out", default=None, help=f"default {RESULTS.name}")
    parser.add_argument("--markdown", action="store_true",
                        help="print the stored results as a table")
    args = parser.parse_args(argv)
    if args.markdown:
        print(markdown(json.loads(Path(args.out or RESULTS).read_text())))
        return 0
    names = args.programs.split(",") if args.programs else None
    result = run(not args.no_loosen, names)
    Path(args.out or RESULTS).write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
