"""`hloplan run --check`: run a plan on the visible devices, compare with the single-device
program, and set what XLA compiled (collectives, memory) beside what the plan predicted."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from hloplan.diagnostics import HloplanError, UsageError

REFERENCE_FILE = "reference.jaxexport"


def random_inputs(avals, seed: int):
    rng = np.random.default_rng(seed)
    leaves = []
    for aval in avals:
        dtype = np.dtype(aval.dtype)
        if dtype == np.bool_:
            leaves.append(rng.random(aval.shape) < 0.5)
        elif np.issubdtype(dtype, np.integer):
            leaves.append(rng.integers(0, 8, size=aval.shape).astype(dtype))
        else:
            leaves.append(rng.standard_normal(aval.shape).astype(dtype))
    return leaves


def load_inputs(path: str, count: int):
    data = np.load(path)
    try:
        return [data[f"arg{i}"] for i in range(count)]
    except KeyError as exc:
        raise UsageError(f"{path}: expected arrays arg0..arg{count - 1}: missing {exc}") from None


def check_plan(plan_dir: str, *, inputs: str | None = None, seed: int = 0, rtol: float = 1e-4,
               atol: float = 1e-5, compare: bool = True) -> dict:
    import jax
    from jax import export

    from hloplan.emit.loader import PlanLoadError, Runner
    from hloplan.hlo_stats import collective_stats, memory_stats

    try:
        runner = Runner(plan_dir)
    except PlanLoadError as exc:
        raise UsageError(str(exc)) from None
    exported = runner.exported
    leaves = (load_inputs(inputs, len(exported.in_avals)) if inputs
              else random_inputs(exported.in_avals, seed))
    args, kwargs = jax.tree.unflatten(exported.in_tree, leaves)
    outputs = runner(*args, **kwargs)
    report: dict = {"plan": str(plan_dir), "devices": runner.mesh.size,
                    "mesh": dict(zip(runner.mesh.axis_names, runner.mesh.devices.shape))}
    if compare:
        reference = export.deserialize(bytearray((Path(plan_dir) / REFERENCE_FILE).read_bytes()))
        with jax.default_device(jax.devices()[0]):
            expected = jax.jit(reference.call)(*args, **kwargs)
        errors = []
        match = True
        for got, want in zip(jax.tree.leaves(outputs), jax.tree.leaves(expected)):
            got, want = np.asarray(got), np.asarray(want)
            if got.shape != want.shape:
                raise HloplanError(f"result shape {got.shape} differs from the reference {want.shape}")
            if got.size == 0:
                continue
            if np.issubdtype(got.dtype, np.inexact):
                errors.append(float(np.max(np.abs(got.astype(np.float64) - want.astype(np.float64)))))
                match &= bool(np.allclose(got, want, rtol=rtol, atol=atol, equal_nan=True))
            else:
                errors.append(float(np.max(np.abs(got.astype(np.int64) - want.astype(np.int64)))))
                match &= bool(np.array_equal(got, want))
        report["max_abs_error"] = max(errors, default=0.0)
        report["match"] = match
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


def format_report(report: dict) -> str:
    from hloplan.units import format_bytes

    lines = [f"ran {report['plan']} on {report['devices']} devices, mesh {report['mesh']}"]
    if "match" in report:
        verdict = "matches" if report["match"] else "DIFFERS FROM"
        lines.append(f"result {verdict} the single-device program "
                     f"(max abs error {report['max_abs_error']:.3g})")
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
    lines.append(f"peak memory per device: predicted {format_bytes(report['predicted']['peak_memory_bytes'])}, "
                 f"compiled {format_bytes(peak) if peak is not None else 'unknown'}")
    return "\n".join(lines)
