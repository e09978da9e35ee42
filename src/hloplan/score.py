"""One score of a compiled program, from its per-device HLO: what `--select compiled` ranks
candidate plans by and what benchmarks/tpu.py scores every plan with.

    step = max(kernel roofline, FLOPs / f32 matmul rate)
           + sum over collectives (per step) of latency_steps * latency + bytes / bandwidth

The kernel roofline sums, over the compiled kernels (hlo_stats.kernel_stats), each one's FLOPs
at the device model's f32 matmul rate or its HBM bytes at its HBM bandwidth, whichever takes
longer; a collective spanning mesh axes takes those axes' bandwidth and latency (CommModel),
with 2(n-1) latency steps for an all-reduce, 1 for a collective-permute and n-1 otherwise.

Beside the step, `hidden_s`: of those collectives' seconds, what the kernels libtpu schedules
between an asynchronous collective's start and its done cover (hlo_stats.scheduled_overlap);
the step does not subtract it.
"""

from __future__ import annotations


def compiled_score(compiled, mesh_axes, comm) -> dict:
    """The score of one compiled program (`jax.stages.Compiled`) on a mesh of `mesh_axes`
    ((name, size) pairs) priced by `comm` (a CommModel), and what it is made of."""
    from hloplan.hlo_stats import (
        collective_stats,
        compiled_kernels,
        memory_stats,
        scheduled_overlap,
    )

    text = compiled.as_text()
    stats = collective_stats(text, mesh_axes=mesh_axes)
    cost = compiled.cost_analysis()
    cost = (cost[0] if cost else {}) if isinstance(cost, list | tuple) else cost
    flops = float((cost or {}).get("flops", 0.0))
    compute = flops / comm.model.flops_for("f32")
    communication = 0.0
    per_execution: dict[str, float] = {}
    by_axes: dict[str, dict] = {}
    slots = []
    for op in stats.ops:
        n = op.group_size
        if op.axes:
            group = comm.group(op.axes)
            bandwidth, latency = group.bandwidth, group.latency
        else:
            bandwidth = min(link.bandwidth for link in comm.links)
            latency = max(link.latency for link in comm.links)
        steps = (2 * (n - 1) if op.kind == "all-reduce" else
                 1 if op.kind in ("collective-permute", "collective-broadcast") else n - 1)
        per_execution[op.name] = steps * latency + op.bytes_sent / bandwidth
        seconds = op.trip_count * per_execution[op.name]
        communication += seconds
        axes = ",".join(a for a, _ in mesh_axes if a in op.axes) or "?"  # mesh order
        slot = by_axes.setdefault(f"{op.kind}({axes})",
                                  {"count": 0, "bytes": 0.0, "seconds": 0.0,
                                   "hidden_seconds": 0.0})
        slots.append(slot)
        slot["count"] += op.trip_count
        slot["bytes"] += op.total_bytes_sent
        slot["seconds"] += seconds
    memory = memory_stats(compiled)
    peak = max(memory["xla_peak_bytes"] or 0, memory["peak_bytes"] or 0)
    rate, bandwidth = comm.model.flops_for("f32"), comm.model.hbm_bandwidth
    launched = compiled_kernels(text)
    kernels = sum(k.seconds(rate, bandwidth) for k in launched)
    hidden = scheduled_overlap(
        text, {k.name: k.seconds(rate, bandwidth) / k.multiplier
               for k in launched if k.multiplier},
        per_execution)
    for op, slot in zip(stats.ops, slots):
        slot["hidden_seconds"] += hidden.get(op.name, 0.0) * op.trip_count
    hidden_s = sum(slot["hidden_seconds"] for slot in by_axes.values())
    return {"step_s": max(kernels, compute) + communication, "kernels_s": kernels,
            "compute_s": compute, "communication_s": communication, "hidden_s": hidden_s,
            "flops": flops,
            "peak_bytes": peak, "fits": peak <= comm.model.memory_bytes,
            "collectives": by_axes, "memory": memory}
