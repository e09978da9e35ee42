"""`hloplan run --check`: run a plan on the visible devices, compare with the single-device
program, and set what XLA compiled (collectives, memory) beside what the plan predicted."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from hloplan.diagnostics import HloplanError, UsageError
from hloplan.emit.loader import random_inputs

REFERENCE_FILE = "reference.jaxexport"
DIFFERING_SHOWN = 8  # results that differ, named in the text report


def load_inputs(path: str, count: int, avals=()):
    """Arrays arg0..arg{count-1} of an .npz (never unpickled: an .npz of object arrays is
    refused), each of the shape the program takes."""
    try:
        with np.load(path, allow_pickle=False) as data:
            leaves = [data[f"arg{i}"] for i in range(count)]
    except KeyError as exc:
        raise UsageError(f"{path}: expected arrays arg0..arg{count - 1}: missing {exc}") from None
    except (OSError, ValueError, EOFError) as exc:  # not an npz, truncated, or object arrays
        raise UsageError(f"{path}: cannot read the inputs: {exc}") from None
    except Exception as exc:  # zipfile.BadZipFile and the like
        raise UsageError(f"{path}: not an .npz file: {type(exc).__name__}: {exc}") from None
    for i, (leaf, aval) in enumerate(zip(leaves, avals)):
        if tuple(leaf.shape) != tuple(aval.shape):
            raise UsageError(f"{path}: arg{i} has shape {tuple(leaf.shape)}, the program takes "
                             f"{tuple(aval.shape)}")
    return leaves


def _compare(got, want: np.ndarray, rtol: float, atol: float) -> tuple[float, bool] | None:
    """(max abs error, allclose) of one result against the reference; None when empty.  A
    result spread over several processes is compared shard by shard, on this process's own."""
    if tuple(got.shape) != want.shape:
        raise HloplanError(f"result shape {tuple(got.shape)} differs from the reference {want.shape}")
    if want.size == 0:
        return None
    if getattr(got, "is_fully_addressable", True):
        pairs = [(np.asarray(got), want)]
    else:
        seen, pairs = set(), []
        for shard in got.addressable_shards:
            key = tuple(s.indices(n) for s, n in zip(shard.index, want.shape))
            if key not in seen:
                seen.add(key)
                pairs.append((np.asarray(shard.data), want[shard.index]))
    error, match = 0.0, True
    for g, w in pairs:
        if g.size == 0:
            continue
        if np.issubdtype(g.dtype, np.inexact) or np.issubdtype(w.dtype, np.inexact):
            g64, w64 = _as_float64(g), _as_float64(w)
            # Equal non-finite values (the same inf, or nan on both sides) are no error; a
            # non-finite value on one side only, or inf against -inf, is an infinite one.
            same = (g64 == w64) | (np.isnan(g64) & np.isnan(w64))
            finite = np.isfinite(g64) & np.isfinite(w64)
            with np.errstate(invalid="ignore", over="ignore"):
                diff = np.where(finite, np.abs(g64 - w64), np.inf)
                close = same | (finite & (diff <= atol + rtol * np.abs(w64)))
            diff = np.where(same, 0.0, diff)
            error = max(error, float(np.max(diff)))
            match &= bool(np.all(close))
        else:
            error = max(error, float(np.max(np.abs(g.astype(np.int64) - w.astype(np.int64)))))
            match &= bool(np.array_equal(g, w))
    return error, match


def _as_float64(array: np.ndarray) -> np.ndarray:
    if np.issubdtype(array.dtype, np.complexfloating):
        return np.abs(array).astype(np.float64)  # magnitudes: enough to flag a difference
    return array.astype(np.float64)


def check_plan(plan_dir: str, *, inputs: str | None = None, seed: int = 0, rtol: float = 1e-4,
               atol: float = 1e-5, compare: bool = True, placement: str = "global") -> dict:
    """Run the plan on the mesh and (with `compare`) check it against the single-device program.

    Works in every process of a `jax.distributed` job as well: each process builds the same
    inputs, places its own shards (`placement="global"`: from the full arrays; `"local"`: from
    this process's part of them, the per-process data-loading path), and compares the shards of
    the results it holds with the reference run on one of its own devices."""
    import jax

    from hloplan.emit.loader import PlanLoadError, Runner, deserialize
    from hloplan.hlo_stats import collective_stats, memory_stats

    if placement not in ("global", "local"):
        raise UsageError(f"unknown placement {placement!r} (global, local)")
    try:
        runner = Runner(plan_dir)
    except PlanLoadError as exc:
        raise UsageError(str(exc)) from None
    exported = runner.exported
    leaves = (load_inputs(inputs, len(exported.in_avals), exported.in_avals) if inputs
              else random_inputs(exported.in_avals, seed))
    args, kwargs = jax.tree.unflatten(exported.in_tree, leaves)
    try:
        if placement == "local":
            local_args, local_kwargs = runner.local_part(*args, **kwargs)
            outputs = runner.call_local(*local_args, **local_kwargs)
        else:
            outputs = runner(*args, **kwargs)
    except PlanLoadError as exc:
        raise UsageError(str(exc)) from None
    pipeline = runner.plan.get("pipeline", {})
    pipelined = None
    if pipeline.get("tasks"):
        from hloplan.emit.loader import pipeline_runner

        try:
            pipelined = pipeline_runner(plan_dir, runner.plan)
            outputs = pipelined(*args, **kwargs)
        except PlanLoadError as exc:
            raise UsageError(str(exc)) from None
        except (KeyError, IndexError, TypeError) as exc:  # a hand-edited pipeline section
            raise UsageError(_bad_pipeline(plan_dir, exc)) from None
        if jax.process_count() > 1:
            # The results live on the stage submeshes, each on some of the processes: gather
            # them (a collective) so that every process checks all of them.
            outputs = pipelined.fetch(outputs)
    report: dict = {"plan": str(plan_dir), "devices": runner.mesh.size,
                    "mesh": dict(zip(runner.mesh.axis_names, runner.mesh.devices.shape))}
    if jax.process_count() > 1:
        owners = np.vectorize(lambda d: d.process_index)(runner.mesh.devices)
        crossing = [name for axis, name in enumerate(runner.mesh.axis_names)
                    if np.any(owners != np.take(owners, [0], axis=axis))]
        report.update(process=jax.process_index(), processes=jax.process_count(),
                      local_devices=len(runner.mesh.local_devices), cross_process_axes=crossing)
    if compare:
        try:
            reference = deserialize(Path(plan_dir) / REFERENCE_FILE)
        except PlanLoadError as exc:
            raise UsageError(str(exc)) from None
        device = jax.local_devices()[0]
        with jax.default_device(device):
            expected = jax.jit(reference.call)(*args, **kwargs)
        errors = []
        match = True
        differing = []
        got_leaves = jax.tree_util.tree_flatten_with_path(outputs)[0]
        want_leaves = jax.tree.leaves(expected)
        if len(got_leaves) != len(want_leaves):
            raise HloplanError(f"the plan returns {len(got_leaves)} results, the single-device "
                               f"program {len(want_leaves)}")
        for (path, got), want in zip(got_leaves, want_leaves):
            result = _compare(got, np.asarray(want), rtol, atol)
            if result is not None:
                errors.append(result[0])
                match &= result[1]
                if not result[1]:
                    differing.append({"leaf": jax.tree_util.keystr(path) or "result",
                                      "max_abs_error": result[0]})
        report["max_abs_error"] = max(errors, default=0.0)
        report["match"] = match
        report["differing"] = differing
    if pipelined is not None:
        try:
            return _pipeline_report(report, pipelined, pipeline)
        except (KeyError, IndexError, TypeError) as exc:
            raise UsageError(_bad_pipeline(plan_dir, exc)) from None
    compiled = runner.lower(*args, **kwargs).compile()
    mesh_axes = tuple(zip(runner.mesh.axis_names, runner.mesh.devices.shape))
    stats = collective_stats(compiled.as_text(), num_devices=runner.mesh.size, mesh_axes=mesh_axes)
    report["realised"] = {
        "collectives": {kind: {"count": count, "bytes": nbytes}
                        for kind, (count, nbytes) in sorted(stats.by_kind().items())},
        "bytes_sent_per_device": stats.total_bytes,
        "memory": memory_stats(compiled),
    }
    estimate = runner.plan["estimate"]
    predicted: dict[str, dict] = {}
    for entry in estimate["collectives"]:
        slot = predicted.setdefault(entry["kind"], {"count": 0, "bytes": 0.0})
        slot["count"] += entry["count"]
        slot["bytes"] += entry["bytes"]
    report["predicted"] = {"collectives": predicted,
                           "peak_memory_bytes": estimate["peak_memory_bytes"],
                           "step_time_s": estimate["step_time_s"]}
    return report


def _bad_pipeline(plan_dir, exc: Exception) -> str:
    # The programs match their digests: what does not fit them is plan.json's own text.
    return (f"{Path(plan_dir) / 'plan.json'}: pipeline: the section does not fit the plan's "
            f"programs ({type(exc).__name__}: {exc}); compile the plan again")


def _pipeline_report(report: dict, pipelined, pipeline: dict) -> dict:
    """Collectives compiled into each task and those its plan lists (part-A tasks counted once
    per microbatch)."""
    import jax

    from hloplan.hlo_stats import collective_stats
    from hloplan.plan import task_executions

    totals: dict[str, dict] = {}
    predicted: dict[str, dict] = {}
    for task in pipelined.tasks:
        exported = task["exported"]
        mesh = pipelined.meshes[task["stage"]]
        avals = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh)
                 for a, sh in zip(exported.in_avals, task["in_shardings"])]
        compiled = task["call"].lower(*avals).compile()
        stats = collective_stats(compiled.as_text(), num_devices=mesh.size,
                                 mesh_axes=tuple(zip(mesh.axis_names, mesh.devices.shape)))
        times = task_executions(task, pipeline)
        for kind, (count, nbytes) in stats.by_kind().items():
            slot = totals.setdefault(kind, {"count": 0, "bytes": 0.0})
            slot["count"] += count * times
            slot["bytes"] += nbytes * times
        for entry in task.get("collectives", []):  # plan.json's, per execution of the task
            slot = predicted.setdefault(entry["kind"], {"count": 0, "bytes": 0.0})
            slot["count"] += entry["count"] * times
            slot["bytes"] += entry["bytes"] * times
    report["pipeline"] = {key: pipeline[key] for key in ("stages", "microbatches", "schedule")}
    report["pipeline"]["estimate"] = pipeline["estimate"]
    report["realised"] = {"collectives": dict(sorted(totals.items())),
                          "bytes_sent_per_device": sum(t["bytes"] for t in totals.values()),
                          "memory": {}}
    report["predicted"] = {"collectives": dict(sorted(predicted.items())),
                           "peak_memory_bytes": None,
                           "step_time_s": pipeline["estimate"]["step_time_s"]}
    return report


def format_report(report: dict) -> str:
    from hloplan.units import format_bytes, stages_text

    where = f"{report['devices']} devices"
    if report.get("processes", 1) > 1:
        where += f" in {report['processes']} processes"
    lines = [f"ran {report['plan']} on {where}, mesh {report['mesh']}"]
    if "match" in report:
        verdict = "matches" if report["match"] else "DIFFERS FROM"
        lines.append(f"result {verdict} the single-device program "
                     f"(max abs error {report['max_abs_error']:.3g})")
        for entry in report.get("differing", [])[:DIFFERING_SHOWN]:
            lines.append(f"  differs: {entry['leaf']} (max abs error "
                         f"{entry['max_abs_error']:.3g})")
        if len(report.get("differing", [])) > DIFFERING_SHOWN:
            lines.append(f"  ... and {len(report['differing']) - DIFFERING_SHOWN} more")
    if report.get("processes", 1) > 1 and "cross_process_axes" in report:
        line = f"mesh axes across processes: {', '.join(report['cross_process_axes']) or 'none'}"
        if report.get("planned_links"):
            links = ", ".join(f"{axis}={link}" for axis, link in report["planned_links"].items())
            hosts = report.get("planned_hosts")
            line += f" (planned for {f'{hosts} hosts' if hosts else 'one host'}: {links})"
        lines.append(line)
    for entry in report.get("per_process", []) if report.get("processes", 1) > 1 else []:
        verdict = ""
        if "match" in entry:
            verdict = (f": {'matches' if entry['match'] else 'DIFFERS'} "
                       f"(max abs error {entry['max_abs_error']:.3g})")
        lines.append(f"  process {entry['process']} ({entry['local_devices']} devices){verdict}")
    if "pipeline" in report:
        pipe = report["pipeline"]
        lines.append(f"pipeline: {stages_text(pipe['stages'], pipe['microbatches'])} "
                     f"({pipe['schedule']}), bubble {pipe['estimate']['bubble_fraction']:.0%}")
    lines.append("collectives      predicted            realised (compiled HLO)")
    kinds = sorted(set(report["predicted"]["collectives"]) | set(report["realised"]["collectives"]))
    for kind in kinds:
        p = report["predicted"]["collectives"].get(kind, {"count": 0, "bytes": 0})
        r = report["realised"]["collectives"].get(kind, {"count": 0, "bytes": 0})
        lines.append(f"  {kind:<15} {p['count']:>3} x {format_bytes(p['bytes']):>10}   "
                     f"{r['count']:>3} x {format_bytes(r['bytes']):>10}")
    if not kinds:
        lines.append("  (none)")
    memory = report["realised"]["memory"]
    peak = memory.get("peak_bytes")
    if report["predicted"]["peak_memory_bytes"] is not None:
        lines.append(f"peak memory per device: predicted {format_bytes(report['predicted']['peak_memory_bytes'])}, "
                     f"compiled {format_bytes(peak) if peak is not None else 'unknown'}")
    return "\n".join(lines)
