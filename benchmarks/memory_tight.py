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

With --verify-memory hloplan compiles each plan with XLA before handing it over and plans again
while the compiled allocation is over the budget (`hloplan compile --verify-memory`); results in
benchmarks/memory_tight_verify_results.json, each case with the plans tried.

    .venv/bin/python benchmarks/memory_tight.py [--models gpt,moe] [--meshes 8,4x8] [--workers 2]
                                                [--verify-memory]
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
OUT_VERIFIED = HERE / "memory_tight_verify_results.json"  # with --verify-memory


def hand_peaks(case: dict) -> dict[str, float]:
    return {name: entry["peak_bytes"] for name, entry in case.get("hand", {}).items()
            if entry.get("peak_bytes")}


def _shard_bytes(sharding, aval) -> int:
    return math.prod(sharding.shard_shape(tuple(aval.shape))) * aval.dtype.itemsize


def _state_layouts(runner) -> dict[int, object]:
    """Argument value id -> the sharding the step hands its next value back in: for a step
    `(state, batch) -> (loss, new_state)` (run.py's models; the small check's `(params, ...)
    -> (loss, params)` too), each new-state leaf as the task that makes it makes it (its
    running sum's layout for an accumulated one), which is how the user passes it next step."""
    import jax

    ref = runner.reference
    ins = jax.tree.unflatten(ref.in_tree, list(range(ref.in_tree.num_leaves)))
    outs = jax.tree.unflatten(ref.out_tree, list(range(ref.out_tree.num_leaves)))
    state_in, state_out = jax.tree.leaves(ins[0][0]), jax.tree.leaves(outs[1])
    value_of = runner.leaf_values()
    made = {}
    for task in runner.tasks:
        made.update(zip(task["outputs"], task["exported"].out_shardings_jax(
            runner.meshes[task["stage"]])))
    layouts = {}
    for leaf_in, leaf_out in zip(state_in, state_out, strict=True):
        entry = runner.pipe["outputs"][leaf_out]
        if leaf_in in value_of and entry["from"] in ("task", "sum"):
            layouts[value_of[leaf_in]] = made[entry["value"]]
    return layouts


def measure_accumulated(plan_dir: Path, mesh: str) -> dict:
    """An accumulated (one-stage, M-microbatch) plan, compiled (never run) program by program:
    its tasks, and every move the loader (hloplan/emit/pipeline_loader.py) makes with
    jax.device_put between them, compiled as the jitted identity (or slice) XLA runs for it.

    - step time: run.measure's formula on each: M x the per-microbatch tasks + the
      once-per-step tasks (one stage: nothing overlaps) + the moves: each argument into each
      layout a task takes it in other than the one the user holds it in (once per step), each
      microbatch sliced out of the whole batch into its task's layout (M times), each running
      sum into the layout of the task that reads it;
    - peak per device, as the loader holds its arrays: the state as the step hands it back
      (each new-state value's layout; other arguments as their first task takes them; the
      whole batch as its task takes a microbatch), the copies of arguments in further layouts
      (kept for the step), the running sums, a microbatch's values until their last reader,
      each call's inputs, compiled results and temporaries (`memory_analysis`).
    check_simulation compares the live bytes at each task call with the loader's, run."""
    import jax

    import hloplan
    from hloplan.emit.pipeline_loader import microbatch

    runner = hloplan.load(plan_dir)
    pipe = runner.pipe
    if pipe["stages"] != 1:
        raise ValueError("measure_accumulated: one stage only")
    M = pipe["microbatches"]
    blocks = pipe.get("microbatch_blocks", 1)
    comm = run.comm_model(run.plan_mesh(runner.plan))  # the plan's mesh: maybe a view of `mesh`
    sub = runner.meshes[0]
    axes = tuple(zip(sub.axis_names, sub.devices.shape))
    batch = {int(k): d for k, d in pipe["argument_batch_dims"].items()}
    frontier = set(pipe["frontier"])
    arguments = set(pipe["arguments"])
    moves: dict[tuple, dict] = {}  # compiled moves, by what they move

    def move(key, fn, aval, source, target) -> dict:
        """Formula seconds and bytes of a compiled move of `aval` from `source` to `target`."""
        if key not in moves:
            compiled = jax.jit(fn, out_shardings=target).lower(
                jax.ShapeDtypeStruct(aval.shape, aval.dtype, sharding=source)).compile()
            measured = run.measure(compiled, axes, comm)
            moves[key] = {"step_s": measured["step_s"], "temp": measured["memory"]["temp_bytes"] or 0,
                          "collectives": measured["collectives"], "count": 0}
        return moves[key]

    tasks = []
    whole_aval: dict[int, object] = {}
    for task in runner.tasks:
        exported = task["exported"]
        args = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
                for a, s in zip(exported.in_avals, task["in_shardings"])]
        dump = plan_dir / "xla_dump" / task["name"]
        compiled = task["call"].lower(*args).compile(compiler_options=run.dump_options(dump))
        measured = run.measure(compiled, axes, comm)
        measured["live_peak_bytes"] = run.live_peak(dump)
        outs = exported.out_shardings_jax(sub)
        tasks.append({
            "task": task, "measured": measured,
            "in_bytes": [_shard_bytes(s, a) for s, a in zip(task["in_shardings"], exported.in_avals)],
            "in_avals": list(exported.in_avals),
            "out_bytes": [_shard_bytes(s, a) for s, a in zip(outs, exported.out_avals)],
            "out_avals": list(exported.out_avals),
            "in_keys": [(v, s) for v, s in zip(task["inputs"], task["in_shardings"])],
            "out_layouts": list(outs),
            "temp": measured["memory"]["temp_bytes"] or 0,
        })
    # What the user holds: the state as the step hands it back, other arguments as their first
    # task takes them, the whole batch in its first per-microbatch task's layout.
    user_layout: dict[int, object] = dict(_state_layouts(runner))
    user: dict[int, int] = {}
    for t in sorted(tasks, key=lambda t: t["task"]["part"] != "A"):
        for (v, s), aval in zip(t["in_keys"], t["in_avals"]):
            if v in arguments and v not in user:
                if v in batch and t["task"]["part"] == "A":  # a microbatch's shape
                    shape = list(aval.shape)
                    shape[batch[v]] *= M
                    whole_aval[v] = jax.ShapeDtypeStruct(tuple(shape), aval.dtype)
                else:
                    whole_aval[v] = aval
                layout = user_layout.setdefault(v, s)
                user[v] = _shard_bytes(layout, whole_aval[v])
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
    layout: dict[int, object] = {}  # value -> the sharding its task made it in
    peak = 0
    peak_at = None
    calls = []  # (task, microbatch, bytes live as it starts, its inputs included)
    move_s = 0.0

    def live() -> int:
        return (sum(user.values()) + sum(copies.values()) + sum(sum(e.values()) for e in env)
                + sum(sums.values()) + sum(once.values()))

    def note(now: int, where: str) -> None:
        nonlocal peak, peak_at
        if now > peak:
            peak, peak_at = now, where

    def run_task(t, m):
        nonlocal move_s
        task = t["task"]
        made = 0  # inputs made for this call: microbatch slices, resharded values
        for (v, s), b, aval in zip(t["in_keys"], t["in_bytes"], t["in_avals"]):
            ndim = len(aval.shape)
            if v in batch and task["part"] == "P":  # the prologue reads the whole batch
                if user_layout[v].is_equivalent_to(s, ndim):
                    continue
                moved = move(("whole", v, s), lambda x: x, whole_aval[v], user_layout[v], s)
                note(live() + made + b + moved["temp"], f"moving the batch for {task['name']}")
                made += b
            elif v in batch:
                def cut(x, dim=batch[v], m=m):  # as the loader cuts it
                    return microbatch(x, dim, m, M, blocks)

                moved = move(("slice", v, m, s), cut, whole_aval[v], user_layout[v], s)
                note(live() + made + b + moved["temp"], f"slicing microbatch {m}")
                made += b
            elif v in user:
                if user_layout[v].is_equivalent_to(s, ndim) or (v, s) in copies:
                    continue
                moved = move(("copy", v, s), lambda x: x, aval, user_layout[v], s)
                note(live() + made + b + moved["temp"], f"moving an argument for {task['name']}")
                copies[(v, s)] = b
            elif not layout[v].is_equivalent_to(s, ndim):
                moved = move(("reshard", v, s), lambda x: x, aval, layout[v], s)
                note(live() + made + b + moved["temp"], f"resharding for {task['name']}")
                made += b
            else:
                continue
            moved["count"] += 1
            move_s += moved["step_s"]
        calls.append((task["name"], m, live() + made))
        note(calls[-1][2] + t["temp"] + sum(t["out_bytes"]), f"{task['name']} microbatch {m}")
        layout.update(zip(task["outputs"], t["out_layouts"]))
        return dict(zip(task["outputs"], t["out_bytes"]))

    by_index = {t["task"]["index"]: t for t in tasks}
    for t in tasks:  # the prologue: statistics of the whole batch, kept for the step
        if t["task"]["part"] == "P":
            once.update(run_task(t, 0))
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
                    note(live() + b + sums[v], f"adding microbatch {m}")
                sums[v] = b
            if readers.get(v) or (m == M - 1 and v in late):
                env[m][v] = b
    for t in tasks:
        if t["task"]["part"] == "B":
            once.update(run_task(t, 0))
    task_s = sum(t["measured"]["step_s"] * (M if t["task"]["part"] == "A" else 1) for t in tasks)
    by_kind: dict[str, dict] = {}
    for (kind, *_), moved in moves.items():
        slot = by_kind.setdefault(kind, {"count": 0, "step_s": 0.0})
        slot["count"] += moved["count"]
        slot["step_s"] += moved["step_s"] * moved["count"]
    return {"peak_bytes": peak, "peak_at": peak_at, "step_s": task_s + move_s,
            "tasks_s": task_s, "moves_s": move_s, "moves": by_kind, "microbatches": M,
            "tasks": {t["task"]["name"]: {k: t["measured"][k] for k in (
                "flops", "compute_s", "communication_s", "step_s", "peak_bytes",
                "live_peak_bytes", "collectives")} for t in tasks},
            "live_at_calls": calls}


def check_simulation(workdir: str, microbatches: int = 4) -> dict:
    """measure_accumulated's live bytes against the loader's own, on a small GPT step run for
    real on 8 devices: at every task call, the bytes of live arrays on one device (each buffer
    once), with the arguments passed as measure_accumulated assumes."""
    import sys

    import jax
    from jax import export

    import hloplan
    from hloplan.compiler import PipelineOptions
    from hloplan.emit.pipeline_loader import live_bytes_on

    sys.path.insert(0, str(HERE.parent))
    from fixtures import models as small

    plan_dir = Path(workdir) / "check_simulation"
    made = small.gpt_train_step_args(seed=0, batch=64, seq=32, vocab=512, d_model=32,
                                     n_layers=2)
    args = (made[0], made[2], made[3])
    hloplan.compile(export.export(jax.jit(small.gpt_sgd_step))(*args).serialize(), "8", output=str(plan_dir),
                    device="toy", pipeline=PipelineOptions(stages=1, microbatches=microbatches))
    simulated = [live for _, _, live in measure_accumulated(plan_dir, "8")["live_at_calls"]]
    runner = hloplan.load(plan_dir)
    leaves, tree = jax.tree.flatten((args, {}))
    value_of = runner.leaf_values()
    first: dict = dict(_state_layouts(runner))
    for task in runner.tasks:
        for v, sharding in zip(task["inputs"], task["in_shardings"]):
            first.setdefault(v, sharding)
    placed = [jax.device_put(x, first[value_of[k]]) if k in value_of else x
              for k, x in enumerate(leaves)]
    call_args, call_kwargs = jax.tree.unflatten(tree, placed)
    del made, args, leaves, placed
    device = runner.meshes[0].devices.flat[0]
    measured = []
    for task in runner.tasks:
        def counted(*inputs, call=task["call"]):
            measured.append(live_bytes_on(device))
            return call(*inputs)
        task["call"] = counted
    runner(*call_args, **call_kwargs)
    return {"microbatches": microbatches, "simulated": simulated, "measured": measured,
            "equal": simulated == measured}


def tight_case(model_name: str, mesh: str, budget: float, best_hand_step_s: float,
               workdir: str, verify_memory: bool = False) -> dict:
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
                        hosts=run.hosts_for(devices), memory_budget=int(budget),
                        verify_memory=verify_memory)
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
    if "memory_check" in plan_json:
        out["memory_check"] = plan_json["memory_check"]
    # Activations the single program recomputes after the forward pass (0: none).
    out["recomputed_values"] = plan_json.get("rematerialized", {}).get("values", 0)
    if plan_json.get("pipeline", {}).get("tasks"):  # no single program fits: accumulated
        measured = measure_accumulated(plan_dir, mesh)
        out["microbatches"] = measured["microbatches"]
        out["peak_at"] = measured["peak_at"]
        out["tasks"] = measured["tasks"]
        out["moves"] = measured["moves"]
        out["tasks_s"], out["moves_s"] = measured["tasks_s"], measured["moves_s"]
        out["estimated_peak_bytes"] = max(plan_json["pipeline"]["estimate"]
                                          ["memory_per_stage_bytes"])
        # The walk's peak with its task's allocation replaced by XLA's live bytes.
        task = measured["tasks"].get(measured["peak_at"].split()[0], {})
        if task.get("live_peak_bytes") is not None:
            out["live_peak_bytes"] = (measured["peak_bytes"] - task["peak_bytes"]
                                      + task["live_peak_bytes"])
    else:
        dump = plan_dir / "xla_dump" / "program"
        plan_json, jmesh, compiled, _ = run.compile_hloplan_artifact(plan_dir, dump)
        measured = run.measure(compiled, tuple(zip(jmesh.axis_names, jmesh.devices.shape)),
                               run.comm_model(run.plan_mesh(plan_json)))
        out["estimated_peak_bytes"] = plan_json["estimate"]["peak_memory_bytes"]
        out["live_peak_bytes"] = run.live_peak(dump)
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
             "| hloplan | estimated peak GiB | compiled peak GiB | of which live at XLA's peak GiB "
             "| step / best hand plan's at 80 GiB |",
             "|---|---|---|---|---|---|---|---|---|"]
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
        elif r.get("recomputed_values"):
            outcome += f" (recomputing {r['recomputed_values']} activations)"
        if outcome == "error":
            outcome += f": {r.get('error', '')[:80]}"
        lines.append(
            f"| {r['model']} | {r['mesh']} | {run._gb(r['budget_bytes'])} | "
            f"{run._gb(r['smallest_hand_peak_bytes'])} ({r['smallest_hand_plan']}) | {outcome} | "
            f"{run._gb(est)} | {run._gb(comp)} | {run._gb(r.get('live_peak_bytes'))} | "
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
    parser.add_argument("--out", default=None,
                        help=f"default {OUT.name}, or {OUT_VERIFIED.name} with --verify-memory")
    parser.add_argument("--verify-memory", action="store_true",
                        help="plan with hloplan compile --verify-memory")
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
        check = pool.submit(check_simulation, workdir).result()  # jax in workers only
        print(f"loader simulation vs the loader run on 8 devices: {check}", flush=True)
        futures = [(job, pool.submit(tight_case_safe, *job[0], job[1], job[2], workdir,
                                     args.verify_memory))
                   for job in jobs]
        for (key, _, _, smallest, smallest_peak), future in futures:
            row = future.result()
            row["smallest_hand_plan"] = smallest
            row["smallest_hand_peak_bytes"] = smallest_peak
            rows.append(row)
            print(f"{key[0]} {key[1]}: {row['outcome']}", flush=True)
    counts = {k: sum(r["outcome"] == k for r in rows)
              for k in ("fits", "no plan fits", "OVER", "error")}
    result = {"fraction": args.fraction, "verify_memory": args.verify_memory, "counts": counts,
              "cases": rows, "simulation_check": check,
              "wall_s": time.perf_counter() - started, "git": run.git_state()}
    out = args.out or (OUT_VERIFIED if args.verify_memory else OUT)
    Path(out).write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    print("\n".join(table(rows)))
    print(f"\n{counts} in {result['wall_s'] / 60:.1f} min")
    return 1 if counts["OVER"] or counts["error"] or not check["equal"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
