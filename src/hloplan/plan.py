"""plan.json: what was decided, what it is estimated to cost, and how it was found.

Deterministic by construction: no wall-clock times (those go to timings.json), sorted keys,
floats rounded to a fixed number of significant digits.
"""

from __future__ import annotations

import hashlib
import json
from importlib import metadata

from hloplan import decisions
from hloplan.solver.evaluate import evaluate, point_contents
from hloplan.state import CompileState
from hloplan.strategies import local_bytes, replicated, spec_names

PLAN_FORMAT = 1


def _round(x: float) -> float:
    return float(f"{x:.6g}")


def _versions() -> dict:
    out = {}
    for package in ("hloplan", "jax", "jaxlib"):
        try:
            out[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            out[package] = "unknown"
    return out


def _tensor_entry(state: CompileState, name: str, value_id: int, spec) -> dict:
    type_ = state.graph.type_of(value_id)
    mesh = state.options.mesh
    return {
        "name": name,
        "shape": list(type_.shape),
        "dtype": type_.dtype,
        "spec": [list(axes) for axes in spec_names(spec, mesh)],
        "bytes": type_.nbytes,
        "bytes_per_device": int(local_bytes(type_, spec, mesh)),
    }


def value_spec(state: CompileState, value_id: int):
    value = state.graph.values[value_id]
    if value.producer in state.space.strategies and value_id not in state.space.free_values:
        return state.chosen(value.producer).results[value.result_index]
    return replicated(value.type.rank if value.type else 0)


def build_plan(state: CompileState, input_bytes: bytes, files: dict[str, str]) -> dict:
    graph, options = state.graph, state.options
    evaluation = evaluate(state.problem, state.solution)
    arguments = [_tensor_entry(state, name, v, value_spec(state, v))
                 for name, v in zip(graph.argument_names, graph.arguments)]
    results = [_tensor_entry(state, name, v, value_spec(state, v))
               for name, v in zip(graph.output_names, graph.outputs)]
    ops = []
    hidden = 0.0
    for op_index in sorted(state.space.strategies):
        op = graph.ops[op_index]
        chosen = state.chosen(op_index)
        node = state.space.node_of[op_index]
        compute, communication, resharding = evaluation.per_node[node]
        if op.name == "arg":
            continue
        hidden += chosen.hidden
        ops.append({
            "id": f"%{op_index}",
            "op": op.name,
            "label": op.label,
            "location": str(op.location) if op.location else None,
            "strategy": chosen.name,
            "results": [[list(a) for a in spec_names(s, options.mesh)] for s in chosen.results],
            "compute_s": _round(compute),
            "communication_s": _round(communication),
            "resharding_in_s": _round(resharding),
            **({"hidden_s": _round(chosen.hidden)} if chosen.hidden else {}),
            "times_per_step": op.multiplier,
            "replicated_fallback": state.space.fallbacks.get(op_index),
        })
    collectives = listed_collectives(state)
    stats = state.stats
    return {
        "format": PLAN_FORMAT,
        "versions": _versions(),
        "input": {"file": state.filename.rsplit("/", 1)[-1], "kind": state.program.input_kind,
                  "sha256": hashlib.sha256(input_bytes).hexdigest()},
        "mesh": {"axis_names": list(options.mesh.axis_names),
                 "axis_sizes": list(options.mesh.axis_sizes), "devices": options.mesh.size,
                 "hosts": options.hosts,
                 "links": [link.name for link in state.comm.links]},
        "device_model": {"name": options.device.name, "platform": options.device.platform,
                         "memory_bytes": options.device.memory_bytes,
                         # bytes per merged collective the plan was priced with (see [combiner])
                         "combiner": {kind: "unbounded" if size == float("inf") else int(size)
                                      for kind, size in sorted(options.device.combiner.items())},
                         # reduce-scatters the compiler leaves unmerged on this mesh's slice
                         # ("all", "partial" or null; [combiner] reduce-scatter-apart)
                         "unmerged_reduce_scatters":
                             options.device.unmerged_reduce_scatters_on(options.mesh.size),
                         # the share of collective-matmul loops' sends priced as hidden on
                         # this slice (--select compiled's serial-loops candidate: 0)
                         **({"collective_matmul_overlap":
                             options.device.collective_matmul_overlap_on(options.mesh.size)}
                            if options.device.collective_matmul else {})},
        "memory_budget_bytes": int(options.budget) if options.budget != float("inf") else None,
        "arguments": arguments,
        "results": results,
        # Arguments the export donates, and (argument, result) pairs written in place: the
        # loader donates these buffers, and the estimate counts such a result in its argument.
        "donation": state.facts.get("donation", {"arguments": sorted(graph.donated),
                                                 "aliases": [], "resharded_results": []}),
        "estimate": {
            "step_time_s": _round(evaluation.total),
            "compute_s": _round(evaluation.compute),
            "communication_s": _round(evaluation.communication),
            "resharding_s": _round(evaluation.resharding),
            # Collective seconds counted as hidden behind the kernels of the ops that send
            # them (collective-matmul loops), not in communication_s
            "hidden_s": _round(hidden),
            # The first launch of each kind of merged collective the plan issues (included in
            # communication_s; the ops' own communication prices their share of the rest).
            "launches": [{"collective": label, "seconds": _round(seconds)}
                         for label, seconds in evaluation.launches],
            "peak_memory_bytes": int(evaluation.peak_memory),
            "peak": _peak_contents(state, evaluation.peak_point),
            "collectives": collectives,
        },
        "solver": {
            "name": stats.solver, "status": stats.status, "objective_s": _round(stats.objective),
            "bound_s": _round(stats.bound), "gap": _round(stats.gap),
            "variables": stats.variables, "constraints": stats.constraints,
            "nodes": len(state.problem.nodes), "edges": len(state.problem.edges),
            "memory_points": len(state.problem.live_points),
            "time_limit_s": options.time_limit,
            # False when the time limit cut the solve short: the plan then depends on the
            # machine's speed (every other limit of the search is a count of work).
            "deterministic": bool(stats.extra.get("deterministic", True)),
            "branch_and_bound_nodes": int(stats.extra.get("nodes", 0)),
            "tying": _tying(state.facts),
        },
        "ops": ops,
        "decisions": decisions.top_decisions(state, count=10),
        "diagnostics": [d.to_json() for d in state.log.entries],
        "files": files,
        # What rematerialize recomputed after the forward pass (only when nothing fit without)
        **({"rematerialized": state.facts["rematerialized"]}
           if state.facts.get("rematerialized", {}).get("values") else {}),
    }


# How many of the largest things held at the estimated peak plan.json lists.
PEAK_ENTRIES = 10


def task_executions(task: dict, pipeline: dict) -> int:
    """How many times a step runs a task of plan.json's pipeline section: a part-A task (one
    microbatch's work) once per microbatch, the others once."""
    return pipeline["microbatches"] if task["part"] == "A" else 1


def listed_collectives(state: CompileState) -> list[dict]:
    """The collectives the plan in `state` issues per step, per kind and mesh axes ({"kind",
    "axes", "count", "bytes"}: per-device bytes sent), as plan.json's estimate lists them:
    each op's own (a masked lookup's all-reduce read through one slice listed as the
    reduce-scatter it compiles to; partial sums added before one collective listed once) and
    one reshard per value, layout and region."""
    from hloplan.passes.build_sharding_problem import (
        chosen_reshards,
        reassociated,
        resharded_type,
        scatter_first_bytes,
        scatter_first_reads,
        scatter_first_reshard,
        sliced_all_reduces,
    )

    graph, options = state.graph, state.options
    collectives: dict[str, dict] = {}
    folded = reassociated(state)
    # A masked lookup's all-reduce and its reader's slice, compiled as a reduce-scatter and a
    # reshard from the scattered layout (build_sharding_problem._scatter_first_gathers).
    scattered = scatter_first_reads(state)
    # Likewise any all-reduce read only through one slice over its summed axes (not one
    # summed into another's, which the fold lists).
    folded_ops = {index for index, _, _ in folded}
    scattered.update({index: entry for index, entry in sliced_all_reduces(state).items()
                      if index not in folded_ops})
    for op_index in sorted(state.space.strategies):
        op = graph.ops[op_index]
        chosen = state.chosen(op_index)
        listed = chosen.collectives
        if op_index in scattered:
            value = graph.values[op.results[0]]
            mid, _, direct = scattered[op_index]
            nbytes, permuted = scatter_first_bytes(state.comm, value.type, chosen.results[0],
                                                   chosen.reduced_axes, mid if direct else None)
            listed = [("reduce-scatter", axes, state.comm.bytes_sent(
                "reduce-scatter", nbytes, chosen.reduced_axes) * op.multiplier)
                      for _, axes, _ in chosen.collectives]
            listed += [("collective-permute", axes, permuted * op.multiplier)
                       for _, axes, _ in chosen.collectives if permuted]
        for kind, axes, sent in listed:
            if (op_index, kind, axes) in folded:
                continue  # summed into another's before one collective
            entry = collectives.setdefault(f"{kind}({axes})", {"kind": kind, "axes": axes,
                                                               "count": 0, "bytes": 0.0})
            entry["count"] += 1
            entry["bytes"] += sent
    # One reshard per value, layout and region: XLA computes the layout once (CSE) however
    # many consumers in a computation need it (the ILP charges each consuming edge; see
    # README, fidelity), but once in each branch or loop body that reads it.
    seen_reshards: set = set()
    for op, value_id, src, dst, multiplier in chosen_reshards(state):
        producer = graph.values[value_id].producer
        mid, direct = None, False
        if producer in scattered and op.index in scattered[producer][1]:
            mid, _, direct = scattered[producer]
        key = (value_id, src, dst, multiplier, op.parent, op.region)
        if key in seen_reshards:
            continue
        seen_reshards.add(key)
        type_ = resharded_type(graph.type_of(value_id), op, options.device, graph)
        if mid is None:
            reshard = state.comm.reshard(type_.shape, type_.itemsize, src, dst)
        elif direct:
            # scattered onto `mid`'s own dims: the rest goes from there (nothing where the
            # reader takes `mid`, a collective-permute where it orders the axes otherwise)
            reshard = state.comm.reshard(type_.shape, type_.itemsize, mid, dst)
        else:
            reshard = scatter_first_reshard(state.comm, type_,
                                            state.chosen(producer).reduced_axes, mid, dst)
        for kind, axes, sent in reshard.collectives:
            label = state.comm.axes_label(axes)
            entry = collectives.setdefault(f"{kind}({label})", {"kind": kind, "axes": label,
                                                                "count": 0, "bytes": 0.0})
            entry["count"] += 1
            entry["bytes"] += sent * multiplier
    return [{**c, "bytes": _round(c["bytes"])} for _, c in sorted(collectives.items())]


def _peak_contents(state: CompileState, point: int | None) -> dict | None:
    """Where the estimated peak is (the program point after which it is checked) and the
    largest values, copies and partial sums held there (solver.evaluate.point_contents)."""
    if point is None:
        return None
    problem, graph = state.problem, state.graph
    names = dict(zip(graph.arguments, graph.argument_names))
    held = point_contents(problem, state.solution, point)
    largest = []
    for item in held[:PEAK_ENTRIES]:
        node = problem.edges[item.index].dst if item.kind == "copy" else item.index
        op = graph.ops[state.space.op_of[node]]
        entry = {"id": f"%{op.index}", "op": op.name, "label": op.label,
                 "location": str(op.location) if op.location else None,
                 "bytes": int(item.bytes),
                 # "result": the op's result; "made": its partial sum while it is made;
                 # "copy": the resharded copy of an operand it reads ("copy_of")
                 "held": item.kind}
        if item.kind == "copy":
            entry["copy_of"] = _copied_value(state, item.index, op, names)
        if op.name == "arg":
            entry["name"] = names.get(op.results[0])
        largest.append(entry)
    return {"after": problem.live_points[point].label,
            "fixed_bytes": int(problem.live_points[point].fixed_bytes),
            "others_bytes": int(sum(item.bytes for item in held[PEAK_ENTRIES:])),
            "largest": largest}


def _copied_value(state: CompileState, edge_index: int, reader, names: dict) -> str:
    """The operand of `reader` that edge `edge_index` reshards: an argument's name, else the
    id of the op that makes it. The edge comes from its producer, or from an earlier reader
    of the same value whose layout it is read in (a shared copy)."""
    graph = state.graph
    source = graph.ops[state.space.op_of[state.problem.edges[edge_index].src]]
    operands = set(reader.operands)
    found = [v for v in source.results if v in operands] or [
        v for v in source.operands if v in operands]
    if not found:
        return f"%{source.index}"
    value = found[0]
    return names.get(value) or f"%{graph.values[value].producer}"


_TYING_FACTS = {
    "tied_groups": "groups", "tied_nodes": "tied_ops", "decisions_before_tying": "decisions_before",
    "decisions_after_tying": "decisions_after", "live_points_before_pruning": "memory_points_before",
    "live_points_after_pruning": "memory_points_after",
    # with tie-repeated-layers.compare_untied: the price of tying
    "untied_status": "untied_status", "untied_objective": "untied_objective_s",
    "untied_bound": "untied_bound_s",
    "tied_gap": "gap_to_untied", "tied_gap_bound": "gap_to_untied_bound",
    "tied_gap_exact": "gap_to_untied_exact",
}


def _tying(facts: dict) -> dict:
    """What tie-repeated-layers did (groups 0: the problem was small enough to solve untied)."""
    return {name: _round(facts[key]) if isinstance(facts[key], float) else facts[key]
            for key, name in _TYING_FACTS.items() if key in facts}


def dumps(plan: dict) -> str:
    """plan.json's text: sorted keys, indented, except that each entry of a long list (ops,
    arguments, collectives) takes one line. Same data as json.dumps(plan, indent=1,
    sort_keys=True), in a fifth of the time on 60k ops (the C encoder does each line; with
    `indent` the whole document would go through the pure-Python encoder)."""
    return _dumps(plan, 0) + "\n"


def _dumps(value, depth: int) -> str:
    pad, inner = " " * depth, " " * (depth + 1)
    if isinstance(value, dict) and value:
        items = [f"{inner}{json.dumps(str(k))}: {_dumps(v, depth + 1)}"
                 for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))]
        return "{\n" + ",\n".join(items) + "\n" + pad + "}"
    if isinstance(value, list | tuple) and len(value) > 16:
        rows = [inner + json.dumps(v, sort_keys=True) for v in value]
        return "[\n" + ",\n".join(rows) + "\n" + pad + "]"
    if isinstance(value, list | tuple) and any(isinstance(v, dict | list | tuple) for v in value):
        rows = [inner + _dumps(v, depth + 1) for v in value]
        return "[\n" + ",\n".join(rows) + "\n" + pad + "]"
    return json.dumps(value, sort_keys=True)
