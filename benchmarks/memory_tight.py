"""Memory-tight plans: where no hand plan fits, does hloplan find a plan that does?

Issue 3 asks for a feasible plan wherever no hand plan fits the memory budget. At 80 GiB every
case of `run.py` has hand plans that fit, so this benchmark lowers the budget per case to just
under the smallest compiled peak of any hand plan (`--fraction` of it, default 0.98: no hand
plan fits) and plans each case with `hloplan compile --memory-budget` under it. hloplan's
artifact is compiled (never run) and its compiled peak compared with the budget:

- fits: compiled peak <= budget; its step time (run.py's formula) / the best hand plan's at
  80 GiB is the price of fitting;
- no plan fits: hloplan's diagnostic, with the smallest peak it could estimate;
- OVER: a plan hloplan believed fits compiles above the budget (its memory estimate was low:
  the failure that would be an out-of-memory crash on a real device).

Hand-plan peaks come from `benchmarks/results.json` (run `run.py` first); the programs are the
same realistic-size exports. Writes benchmarks/memory_tight_results.json and prints a table.

    .venv/bin/python benchmarks/memory_tight.py [--models gpt,moe] [--meshes 8,4x8] [--workers 2]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
import time
import traceback
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import run  # sets XLA_FLAGS (32 simulated CPU devices) before jax is imported

HERE = Path(__file__).resolve().parent
OUT = HERE / "memory_tight_results.json"


def hand_peaks(case: dict) -> dict[str, float]:
    return {name: entry["peak_bytes"] for name, entry in case.get("hand", {}).items()
            if entry.get("peak_bytes")}


def tight_case(model_name: str, mesh: str, budget: float, best_hand_step_s: float,
               workdir: str) -> dict:
    import models

    import hloplan
    from hloplan.diagnostics import HloplanError
    from hloplan.units import parse_bytes

    devices = math.prod(run.mesh_shape(mesh))
    cfg, state_spec, batch_spec, step = models.MODELS[model_name].build("realistic", devices)
    path = Path(workdir) / f"{model_name}_{devices}.jaxexport"
    if not path.exists():  # workers share exports: write whole files only
        partial = path.with_suffix(f".{os.getpid()}.part")
        partial.write_bytes(models.export_step(step, state_spec, batch_spec).serialize())
        os.replace(partial, path)
    plan_dir = Path(workdir) / f"plan_{model_name}_{mesh}"
    out: dict = {"model": model_name, "mesh": mesh, "budget_bytes": budget}
    t0 = time.perf_counter()
    try:
        hloplan.compile(str(path), mesh, output=str(plan_dir), device=run.DEVICE,
                        hosts=run.hosts_for(devices), memory_budget=int(budget))
    except HloplanError as exc:
        text = str(exc)
        out["outcome"] = "no plan fits"
        found = run.smallest_peak(text)
        if found:
            out["smallest_estimate_bytes"] = parse_bytes(found[0].replace(" ", ""))
            out["smallest_estimate_proven"] = found[1]
        out["message"] = text.splitlines()[0][:300]
        out["plan_s"] = time.perf_counter() - t0
        return out
    out["plan_s"] = time.perf_counter() - t0
    plan_json, jmesh, compiled, _ = run.compile_hloplan_artifact(plan_dir)
    measured = run.measure(compiled, tuple(zip(jmesh.axis_names, jmesh.devices.shape)),
                           run.comm_model(mesh))
    out["estimated_peak_bytes"] = plan_json["estimate"]["peak_memory_bytes"]
    out["compiled_peak_bytes"] = measured["peak_bytes"]
    out["step_s"] = measured["step_s"]
    out["ratio_to_best_hand"] = measured["step_s"] / best_hand_step_s
    out["outcome"] = "fits" if measured["peak_bytes"] <= budget else "OVER"
    out["specs"] = run.argument_summary(plan_json, limit=4)
    return out


def tight_case_safe(*args) -> dict:
    try:
        return tight_case(*args)
    except Exception as exc:  # a crash is a result too
        return {"model": args[0], "mesh": args[1], "outcome": "error",
                "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-2000:]}


def table(rows: list[dict]) -> list[str]:
    lines = ["| model | mesh | budget GiB (no hand plan fits) | smallest hand plan peak GiB "
             "| hloplan | estimated peak GiB | compiled peak GiB | step / best hand plan's at 80 GiB |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        est = r.get("estimated_peak_bytes")
        comp = r.get("compiled_peak_bytes")
        ratio = r.get("ratio_to_best_hand")
        outcome = r["outcome"]
        smallest = r.get("smallest_estimate_bytes")
        if smallest is not None:
            bound = "" if r.get("smallest_estimate_proven") else ">= "
            outcome += (f" (smallest estimate {bound}{run._gb(smallest)} GiB, "
                        f"{smallest / r['smallest_hand_peak_bytes']:.2f} x the leanest hand plan)")
        if outcome == "error":
            outcome += f": {r.get('error', '')[:80]}"
        lines.append(
            f"| {r['model']} | {r['mesh']} | {run._gb(r['budget_bytes'])} | "
            f"{run._gb(r['smallest_hand_peak_bytes'])} ({r['smallest_hand_plan']}) | {outcome} | "
            f"{run._gb(est)} | {run._gb(comp)} | "
            f"{'-' if ratio is None else f'{ratio:.3f}'} |")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(run.MODELS))
    parser.add_argument("--meshes", default=",".join(run.MESHES))
    parser.add_argument("--fraction", type=float, default=0.98,
                        help="budget = this fraction of the smallest hand-plan peak")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--results", default=str(HERE / "results.json"),
                        help="run.py's results (hand-plan peaks and steps)")
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args(argv)

    quality = json.loads(Path(args.results).read_text())["plan_quality"]
    wanted = [(m, s) for m in args.models.split(",") for s in args.meshes.split(",")]
    cases = {(c["model"], c["mesh"]): c for c in quality}
    jobs = []
    for key in wanted:
        case = cases.get(key)
        if case is None or not hand_peaks(case) or case.get("best_hand") is None:
            continue
        peaks = hand_peaks(case)
        smallest = min(peaks, key=peaks.get)
        best_step = case["hand"][case["best_hand"]]["step_s"]
        jobs.append((key, peaks[smallest] * args.fraction, best_step, smallest, peaks[smallest]))

    started = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory(prefix="hloplan-tight-") as workdir, \
            ProcessPoolExecutor(max_workers=args.workers) as pool:
        futures = [(job, pool.submit(tight_case_safe, *job[0], job[1], job[2], workdir))
                   for job in jobs]
        for (key, _, _, smallest, smallest_peak), future in futures:
            row = future.result()
            row["smallest_hand_plan"] = smallest
            row["smallest_hand_peak_bytes"] = smallest_peak
            rows.append(row)
            print(f"{key[0]} {key[1]}: {row['outcome']}", flush=True)
    counts = {k: sum(r["outcome"] == k for r in rows)
              for k in ("fits", "no plan fits", "OVER", "error")}
    result = {"fraction": args.fraction, "counts": counts, "cases": rows,
              "wall_s": time.perf_counter() - started, "git": run.git_state()}
    Path(args.out).write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    print("\n".join(table(rows)))
    print(f"\n{counts} in {result['wall_s'] / 60:.1f} min")
    return 1 if counts["OVER"] or counts["error"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
