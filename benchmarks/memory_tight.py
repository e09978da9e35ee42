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


def _shard_bytes(sharding, aval) -> int:
    return math.prod(sharding.shard_shape(tuple(aval.shape))) * aval.dtype.itemsize


def measure_accumulated(plan_dir: Path, mesh: str) -> dict:
    """An accumulated (one-stage, M-microbatch) plan, compiled task by task (never run): each
    task's formula step time (run.measure) and compiled peak, and the step's peak per device
    as the loader (hloplan/emit/pipeline_loader.py) holds its arrays: the whole arguments in
    the layout their first task takes them in (as passed by the user) and a copy per further
    layout, the whole batch, the running sums of the accumulated partial sums, a microbatch's
    values until their last reader, the microbatch slices a task reads, and the task's own
    compiled results and temporaries (`memory_analysis`). The step time is M x the
    per-microbatch tasks + the once-per-step tasks (one stage: nothing overlaps)."""
    import jax

    import hloplan

    runner = hloplan.load(plan_dir)
    pipe = runner.pipe
    if pipe["stages"] != 1:
        raise ValueError("measure_accumulated: one stage only")
    M = pipe["microbatches"]
    comm = run.comm_model(mesh)
    axes = tuple(zip(runner.meshes[0].axis_names, runner.meshes[0].devices.shape))
    batch = {int(k) for k in pipe["argument_batch_dims"]}
    frontier = set(pipe["frontier"])
    tasks = []
    for task in runner.tasks:
        exported = task["exported"]
        args = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
                for a, s in zip(exported.in_avals, task["in_shardings"])]
        compiled = task["call"].lower(*args).compile()
        measured = run.measure(compiled, axes, comm)
        outs = exported.out_shardings_jax(runner.meshes[0])
        tasks.append({
            "task": task, "measured": measured,
            "in_bytes": [_shard_bytes(s, a) for s, a in zip(task["in_shardings"], exported.in_avals)],
            "out_bytes": [_shard_bytes(s, a) for s, a in zip(outs, exported.out_avals)],
            "in_keys": [(v, s) for v, s in zip(task["inputs"], task["in_shardings"])],
            "temp": measured["memory"]["temp_bytes"] or 0,
        })
    # What the user passes: each argument as its first reader takes it (the whole batch: M
    # microbatches in that layout).
    user: dict[int, int] = {}
    first_layout: dict[int, object] = {}
    for t in tasks:
        for (v, s), b in zip(t["in_keys"], t["in_bytes"]):
            if v not in user and v in set(pipe["arguments"]):
                user[v], first_layout[v] = (M * b if v in batch else b), s
    copies: dict[tuple, int] = {}  # the loader's copies of whole arguments in other layouts
    readers: dict[int, int] = {}
    for t in tasks:
        if t["task"]["part"] == "A":
            for v in t["task"]["inputs"]:
                readers[v] = readers.get(v, 0) + 1
    late = {v for t in tasks if t["task"]["part"] == "B" for v in t["task"]["inputs"]}
    late |= {o["value"] for o in pipe["outputs"] if o["from"] == "task"}
    env: list[dict[int, int]] = [{} for _ in range(M)]
    left = [dict(readers) for _ in range(M)]
    sums: dict[int, int] = {}
    once: dict[int, int] = {}
    peak = 0
    peak_at = None

    def live() -> int:
        return (sum(user.values()) + sum(copies.values()) + sum(sum(e.values()) for e in env)
                + sum(sums.values()) + sum(once.values()))

    def run_task(t, m):
        nonlocal peak, peak_at
        task = t["task"]
        slices = 0
        for (v, s), b in zip(t["in_keys"], t["in_bytes"]):
            if v in batch:
                slices += b  # the microbatch slice, made for this call
            elif v in user and s != first_layout[v]:
                copies.setdefault((v, s), b)
        now = live() + slices + t["temp"] + sum(t["out_bytes"])
        if now > peak:
            peak, peak_at = now, f"{task['name']} microbatch {m}"
        return dict(zip(task["outputs"], t["out_bytes"]))

    by_index = {t["task"]["index"]: t for t in tasks}
    for index, m in pipe["order"]:
        t = by_index[index]
        produced = run_task(t, m)
        for v in t["task"]["inputs"]:
            if v in env[m]:
                left[m][v] -= 1
                if left[m][v] == 0 and not (m == M - 1 and v in late):
                    del env[m][v]
        for v, b in produced.items():
            if v in frontier:
                if v in sums:  # the add's result beside the old sum and this microbatch's
                    transient = live() + b + sums[v]
                    if transient > peak:
                        peak, peak_at = transient, f"adding {v} microbatch {m}"
                sums[v] = b
            if readers.get(v) or (m == M - 1 and v in late):
                env[m][v] = b
    for t in tasks:
        if t["task"]["part"] == "B":
            once.update(run_task(t, 0))
    step = sum(t["measured"]["step_s"] * (M if t["task"]["part"] == "A" else 1) for t in tasks)
    return {"peak_bytes": peak, "peak_at": peak_at, "step_s": step, "microbatches": M,
            "task_peaks": {t["task"]["name"]: t["measured"]["peak_bytes"] for t in tasks}}


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
    plan_json = json.loads((plan_dir / "plan.json").read_text())
    if plan_json.get("pipeline", {}).get("tasks"):  # no single program fits: accumulated
        measured = measure_accumulated(plan_dir, mesh)
        out["microbatches"] = measured["microbatches"]
        out["peak_at"] = measured["peak_at"]
        out["estimated_peak_bytes"] = max(plan_json["pipeline"]["estimate"]
                                          ["memory_per_stage_bytes"])
    else:
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
        if r.get("microbatches"):
            outcome += f" ({r['microbatches']} microbatches)"
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
