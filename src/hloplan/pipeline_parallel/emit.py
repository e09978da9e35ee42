"""What a pipelined plan puts in the plan directory: plan.json's "pipeline" section (the
schedule the loader runs, the estimate, the search) and each task's program."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from hloplan import ir
from hloplan.passes.cut_pipeline import CutContext, PipelineCut
from hloplan.plan import listed_collectives
from hloplan.state import CompileState

if TYPE_CHECKING:
    from hloplan.pipeline_parallel.search import PipelinePlan, StageSearch


def stage_info(state, ctx: CutContext, search: StageSearch, solution, cut_: PipelineCut,
               estimate: dict, submeshes: list[dict]) -> list[dict]:
    """Per stage: its submesh, layers, forward ops and source lines, time and memory."""
    graph = state.graph
    out = []
    for s, st in enumerate(solution.stages):
        lo, hi = search.bounds[st.start], search.bounds[st.end]
        ops = ctx.forward[lo:hi]
        lines = [str(graph.ops[u].location).rsplit(":", 1)[0] for u in ops
                 if graph.ops[u].location]
        out.append({
            "stage": s,
            "submesh": submeshes[s],
            "layers": [st.start, st.end],
            "forward_ops": [f"%{ops[0]}", f"%{ops[-1]}"] if ops else [],
            "source_lines": [lines[0], lines[-1]] if lines else [],
            "time_per_microbatch_s": estimate["stage_time_s"][s],
            "transfer_s": estimate["transfer_s"][s],
            "per_step_s": estimate["per_step_stage_s"][s],
            "accumulate_s": estimate["accumulate_s"][s],
            "memory_bytes": estimate["memory_per_stage_bytes"][s],
            "in_flight_microbatches": estimate["in_flight_microbatches"][s],
        })
    return out


def microbatch_blocks(plan: PipelinePlan, graph) -> int:
    """How many blocks the loader takes each microbatch from (pipeline_loader.microbatch): the
    least common multiple of the shards the per-microbatch tasks split the batch inputs'
    batch dim into, so that every device's shard of every batch input holds whole blocks and
    a batch passed in those layouts is cut into microbatches without moving a row (every
    input must use the same blocks: a microbatch is the same examples in all of them); the
    largest divisor of it that splits the batch evenly."""
    batch_args = {graph.arguments[p] for p in plan.analysis.batch_args}
    blocks = 1
    for tp in plan.tasks:
        if tp.task.part != "A" or tp.figure is None:
            continue
        sizes = plan.submeshes[tp.task.stage]["axis_sizes"]
        for k, v in enumerate(tp.task.inputs):
            if v in batch_args:
                spec = tp.figure.in_specs[k]
                blocks = math.lcm(blocks, math.prod(sizes[a] for a in spec[0]) if spec else 1)
    batch = plan.analysis.batch_size
    return max(d for d in range(1, blocks + 1)
               if blocks % d == 0 and batch % (d * plan.microbatches) == 0)


def describe(plan: PipelinePlan, state: CompileState) -> dict:
    """The plan.json section the loader runs and explain shows."""
    graph = state.graph
    analysis = plan.analysis
    tasks = []
    for tp in plan.tasks:
        task = tp.task
        locations = sorted({str(graph.ops[u].location).rsplit(":", 1)[0] for u in task.units
                            if graph.ops[u].location})
        tasks.append({
            "index": task.index, "name": task.name, "part": task.part, "stage": task.stage,
            "phase": task.phase, "file": f"tasks/{task.name}.jaxexport",
            "inputs": task.inputs, "outputs": task.outputs, "ops": len(task.units),
            "estimated_s": float(f"{tp.seconds:.6g}"),
            "peak_memory_bytes": int(tp.peak_bytes),
            # per execution of the task, on its stage's submesh (what `hloplan verify` sets
            # beside the compiled task's)
            "collectives": listed_collectives(tp.state),
            "source_lines": locations[:8],
        })
    program_outputs = []
    producer = {v: tp.task.index for tp in plan.tasks for v in tp.task.outputs}
    for v in graph.outputs:
        if v in graph.arguments:
            program_outputs.append({"value": v, "from": "argument"})
        elif v in analysis.frontier and producer.get(v) is not None and \
                plan.tasks[producer[v]].task.part == "A":
            program_outputs.append({"value": v, "from": "sum"})
        elif v in analysis.label and producer.get(v) is not None and \
                plan.tasks[producer[v]].task.part == "A":
            program_outputs.append({"value": v, "from": "concat", "dim": analysis.label[v]})
        else:
            program_outputs.append({"value": v, "from": "task"})
    return {
        "stages": plan.stages,
        "microbatches": plan.microbatches,
        "microbatch_blocks": microbatch_blocks(plan, graph),
        "schedule": plan.schedule_kind,
        "batch_arguments": [graph.argument_names[p] for p in analysis.batch_args],
        "batch_size": analysis.batch_size,
        "arguments": list(graph.arguments),
        "argument_batch_dims": {str(graph.arguments[p]): 0 for p in analysis.batch_args},
        "frontier": sorted(analysis.frontier),
        "submeshes": plan.submeshes,
        "tasks": tasks,
        "order": [list(item) for item in plan.order],
        "outputs": program_outputs,
        "estimate": rounded(plan.estimate),
        "per_stage": rounded(plan.stage_info),
        "search": rounded(plan.search),
        "candidates": [rounded(c) for c in plan.candidates],
    }


def rounded(value):
    if isinstance(value, float):
        return float(f"{value:.6g}")
    if isinstance(value, list):
        return [rounded(v) for v in value]
    if isinstance(value, dict):
        return {k: rounded(v) for k, v in value.items()}
    return value


def task_files(plan: PipelinePlan) -> dict[str, bytes]:
    files = {}
    for tp in plan.tasks:
        files[f"tasks/{tp.task.name}.jaxexport"] = bytes(tp.exported.serialize())
        files[f"tasks/{tp.task.name}.mlir"] = ir.module_text(tp.state.program.module).encode()
    return files
