"""One score of a compiled program, from its per-device HLO: what `--select compiled` ranks
candidate plans by and what benchmarks/tpu.py scores every plan with.

    step = max(kernel roofline, FLOPs / f32 matmul rate)
           + sum over collectives (per step) of latency_steps * latency + bytes / bandwidth

The kernel roofline sums, over the compiled kernels (hlo_stats.kernel_stats), each one's FLOPs
at the device model's f32 matmul rate or its HBM bytes at its HBM bandwidth, whichever takes
longer; a collective spanning mesh axes takes those axes' bandwidth and latency (CommModel),
with 2(n-1) latency steps for an all-reduce, 1 for a collective-permute and n-1 otherwise.
"""

from __future__ import annotations


def compiled_score(compiled, mesh_axes, comm) -> dict:
    """The score of one compiled program (`jax.stages.Compiled`) on a mesh of `mesh_axes`
    ((name, size) pairs) priced by `comm` (a CommModel), and what it is made of."""
    from hloplan.hlo_stats import collective_stats, kernel_stats, memory_stats

    text = compiled.as_text()
    stats = collective_stats(text, mesh_axes=mesh_axes)
    cost = compiled.cost_analysis()
    cost = (cost[0] if cost else {}) if isinstance(cost, list | tuple) else cost
    flops = float((cost or {}).get("flops", 0.0))
    compute = flops / comm.model.flops_for("f32")
    communication = 0.0
    by_axes: dict[str, dict] = {}
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
        seconds = op.trip_count * (steps * latency + op.bytes_sent / bandwidth)
        communication += seconds
        axes = ",".join(a for a, _ in mesh_axes if a in op.axes) or "?"  # mesh order
        slot = by_axes.setdefault(f"{op.kind}({axes})",
                                  {"count": 0, "bytes": 0.0, "seconds": 0.0})
        slot["count"] += op.trip_count
        slot["bytes"] += op.total_bytes_sent
        slot["seconds"] += seconds
    memory = memory_stats(compiled)
    peak = max(memory["xla_peak_bytes"] or 0, memory["peak_bytes"] or 0)
    kernels = kernel_stats(text, comm.model.flops_for("f32"), comm.model.hbm_bandwidth).seconds
    return {"step_s": max(kernels, compute) + communication, "kernels_s": kernels,
            "compute_s": compute, "communication_s": communication, "flops": flops,
            "peak_bytes": peak, "fits": peak <= comm.model.memory_bytes,
            "collectives": by_axes, "memory": memory}
