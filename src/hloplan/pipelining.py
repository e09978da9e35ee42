"""Pipeline parallelism and microbatching: cut the program into tasks on submeshes, plan each
task's sharding with the intra-operator ILP, pick the number of stages and microbatches by the
cost model, and describe the schedule the loader runs.

The mesh's first axis is the stage axis: S stages split it into S submeshes (all other axes stay
inside each stage). Part A (per microbatch) runs M times per step on microbatches of the batch;
its frontier values (partial sums over the batch) are accumulated; part B (once per step) runs
on the accumulated values. See passes/label_batch.py and passes/cut_pipeline.py.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field

from hloplan import ir
from hloplan.cost_models import CommModel
from hloplan.diagnostics import UsageError
from hloplan.mesh import MeshSpec
from hloplan.passes.build_sharding_problem import BuildShardingProblem
from hloplan.passes.cut_pipeline import PipelineCut, cut, schedule
from hloplan.passes.extract_graph import ExtractGraph
from hloplan.passes.label_batch import BatchAnalysis, analyse_program
from hloplan.passes.propagate_sharding import PropagateSharding
from hloplan.passes.solve_sharding import SolveSharding
from hloplan.pipeline import run_pipeline
from hloplan.plan import value_spec
from hloplan.solver.evaluate import evaluate
from hloplan.state import COMBINE_BYTES, CompileOptions, CompileState

SCHEDULES = ("gpipe", "1f1b")


@dataclass(frozen=True)
class PipelineOptions:
    stages: int | None = None  # None: auto
    microbatches: int | None = None  # None: auto
    schedule: str = "1f1b"
    batch_args: tuple[str, ...] = ()


@dataclass
class TaskPlan:
    task: object  # cut_pipeline.Task
    state: CompileState
    exported: object  # sharded jax.export.Exported
    seconds: float
    peak_bytes: float


@dataclass
class PipelinePlan:
    stages: int
    microbatches: int
    schedule_kind: str
    cut: PipelineCut
    analysis: BatchAnalysis
    submeshes: list[dict]
    tasks: list[TaskPlan]
    order: list[tuple[int, int]]
    estimate: dict
    candidates: list[dict] = field(default_factory=list)


def submesh(mesh: MeshSpec, stages: int, stage: int) -> tuple[MeshSpec, list[int]]:
    """The stage's mesh (the first axis divided by `stages`; axes of size 1 dropped) and the
    positions of its devices in the full mesh's row-major device list."""
    first = mesh.axis_sizes[0]
    per = first // stages
    rest = 1
    for size in mesh.axis_sizes[1:]:
        rest *= size
    devices = list(range(stage * per * rest, (stage + 1) * per * rest))
    names, sizes = [], []
    for name, size in zip(mesh.axis_names, (per, *mesh.axis_sizes[1:])):
        if size > 1:
            names.append(name)
            sizes.append(size)
    if not names:
        names, sizes = [mesh.axis_names[-1]], [1]
    return MeshSpec(tuple(names), tuple(sizes)), devices


def _plan_task(state: CompileState, task, analysis: BatchAnalysis, microbatches: int,
               options: CompileOptions, stages: int, cache: dict) -> TaskPlan:
    graph = state.graph
    batch_dims = analysis.label if task.part == "A" else None
    module = ir.build_function(state.program.module, state.handles, graph, task.units,
                               task.inputs, task.outputs, batch_dims,
                               microbatches if task.part == "A" else 1, name="main")
    text = ir.module_text(module)
    sub, _ = submesh(options.mesh, stages, task.stage)
    key = (hashlib.sha256(text.encode()).hexdigest(), sub)
    if key in cache:
        cached = cache[key]
        return TaskPlan(task, cached.state, cached.exported, cached.seconds, cached.peak_bytes)
    program = ir.load_program(text.encode(), f"{state.filename}#{task.name}")
    # The submesh keeps its share of hosts: a stage on 2 of 4 nodes spans 2 hosts.
    hosts = None if options.hosts is None else max(1, options.hosts * sub.size // options.mesh.size)
    sub_options = dataclasses.replace(options, mesh=sub, hosts=hosts)
    task_state = run_pipeline(program, sub_options, [ExtractGraph(), BuildShardingProblem(),
                                                     SolveSharding(), PropagateSharding()])
    evaluation = evaluate(task_state.problem, task_state.solution)
    platforms = tuple(state.program.exported.platforms) if state.program.exported else ("cpu",)
    reference = ir.exported_from_module(task_state.graph, platforms, task.name)
    mesh = sub_options.mesh
    in_specs = [tuple(tuple(mesh.axis_names[a] for a in axes) for axes in value_spec(task_state, v))
                for v in task_state.graph.arguments]
    out_specs = [tuple(tuple(mesh.axis_names[a] for a in axes) for axes in value_spec(task_state, v))
                 for v in task_state.graph.outputs]
    exported = ir.sharded_exported(
        reference, serialized=ir.portable_artifact(task_state.program.module),
        axis_names=mesh.axis_names, axis_sizes=mesh.axis_sizes, in_specs=in_specs,
        out_specs=out_specs)
    plan = TaskPlan(task, task_state, exported, evaluation.total, evaluation.peak_memory)
    cache[key] = plan
    return plan


def _transfer_seconds(state: CompileState, plan_tasks: list[TaskPlan], analysis, microbatches,
                      options: CompileOptions, comm) -> list[float]:
    """Per stage, seconds per microbatch spent receiving activations/gradients from other
    stages (bytes over the stage axis's link)."""
    graph = state.graph
    stage_of_value = {v: tp.task.stage for tp in plan_tasks for v in tp.task.outputs}
    per_stage = [0.0] * (max(tp.task.stage for tp in plan_tasks) + 1)
    link = comm.links[0]
    for tp in plan_tasks:
        if tp.task.part != "A":
            continue
        for v in tp.task.inputs:
            src = stage_of_value.get(v)
            if src is None or src == tp.task.stage:
                continue
            type_ = graph.type_of(v)
            nbytes = type_.nbytes / (microbatches if v in analysis.label else 1)
            # Each device of the receiving stage gets its own shard over its own link.
            devices = submesh(options.mesh, len(per_stage), tp.task.stage)[0].size
            per_stage[tp.task.stage] += link.latency + nbytes / devices / link.bandwidth
    return per_stage


def _estimate(state, cut_: PipelineCut, plan_tasks: list[TaskPlan], analysis, microbatches,
              options, comm, schedule_kind: str) -> dict:
    stages = cut_.stages
    stage_time = [0.0] * stages
    for tp in plan_tasks:
        if tp.task.part == "A":
            stage_time[tp.task.stage] += tp.seconds
    transfers = _transfer_seconds(state, plan_tasks, analysis, microbatches, options, comm)
    for s in range(stages):
        stage_time[s] += transfers[s] if s < len(transfers) else 0.0
    slowest = max(stage_time) if stage_time else 0.0
    pipeline = sum(stage_time) + (microbatches - 1) * slowest
    by_phase: dict[int, list[float]] = {}
    for tp in plan_tasks:
        if tp.task.part == "B":
            by_phase.setdefault(tp.task.phase, [0.0] * stages)[tp.task.stage] += tp.seconds
    once = sum(max(times) for times in by_phase.values())
    # Memory per stage: the stage's largest task peak, plus the activations kept between its
    # forward and backward for each microbatch in flight (GPipe: all M; 1F1B: S - s).
    residual = [0.0] * stages
    peaks = [0.0] * stages
    for tp in plan_tasks:
        peaks[tp.task.stage] = max(peaks[tp.task.stage], tp.peak_bytes)
    graph = state.graph
    a_tasks = [tp for tp in plan_tasks if tp.task.part == "A"]
    for tp in a_tasks:
        later = [o for o in a_tasks if o.task.stage == tp.task.stage and o.task.phase > tp.task.phase]
        kept = {v for o in later for v in o.task.inputs} & set(tp.task.outputs)
        sub, _ = submesh(options.mesh, stages, tp.task.stage)
        residual[tp.task.stage] += sum(graph.type_of(v).nbytes / microbatches / sub.size
                                       for v in kept)
    in_flight = [microbatches if schedule_kind == "gpipe" else min(microbatches, stages - s)
                 for s in range(stages)]
    memory = [peaks[s] + residual[s] * max(in_flight[s] - 1, 0) for s in range(stages)]
    bubble = (stages - 1) / (microbatches + stages - 1) if stages > 1 else 0.0
    return {"step_time_s": pipeline + once, "pipeline_s": pipeline, "per_step_s": once,
            "stage_time_s": stage_time, "transfer_s": transfers[:stages],
            "bubble_fraction": bubble, "memory_per_stage_bytes": memory,
            "in_flight_microbatches": in_flight}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def plan_pipeline(state: CompileState, options: CompileOptions, popts: PipelineOptions,
                  single_stage_seconds: float | None) -> PipelinePlan | None:
    """Choose stages and microbatches (where 'auto') and plan every task. Returns None when the
    best choice is one stage and one microbatch (the plain plan), NoPipeline when pipelining
    was considered and lost."""
    if popts.schedule not in SCHEDULES:
        raise UsageError(f"unknown schedule {popts.schedule!r} ({', '.join(SCHEDULES)})")
    graph = state.graph
    analysis = analyse_program(graph, popts.batch_args)
    first = options.mesh.axis_sizes[0]
    stage_choices = [popts.stages] if popts.stages else [d for d in _divisors(first) if d <= 8]
    for s in stage_choices:
        if first % s:
            raise UsageError(f"--stages {s} does not divide the first mesh axis "
                             f"({options.mesh.axis_names[0]}={first})")
    batch = analysis.batch_size
    candidates = []
    cache: dict = {}
    best = None
    comm = CommModel(options.device, options.mesh, hosts=options.hosts,
                     combine_bytes=COMBINE_BYTES)
    for stages in stage_choices:
        if popts.microbatches:
            micro_choices = [popts.microbatches]
        else:
            micro_choices = sorted({m for m in (stages, 2 * stages, 4 * stages) if batch % m == 0}
                                   or {1})
        for microbatches in micro_choices:
            if batch % microbatches:
                raise UsageError(f"--microbatches {microbatches} does not divide the batch of "
                                 f"{batch}")
            if stages == 1 and microbatches == 1:
                continue
            dtype = graph.type_of(graph.outputs[0]).dtype if graph.outputs else "f32"
            cut_ = cut(graph, analysis, stages, flop_rate=options.device.flops_for(dtype),
                       link_bandwidth=comm.links[0].bandwidth,
                       memory_bandwidth=options.device.hbm_bandwidth)
            plan_tasks = [_plan_task(state, task, analysis, microbatches, options, stages, cache)
                          for task in cut_.tasks]
            estimate = _estimate(state, cut_, plan_tasks, analysis, microbatches, options, comm,
                                 popts.schedule)
            entry = {"stages": stages, "microbatches": microbatches,
                     "step_time_s": estimate["step_time_s"],
                     "memory_per_stage_bytes": estimate["memory_per_stage_bytes"]}
            fits = all(m <= options.budget for m in estimate["memory_per_stage_bytes"])
            entry["fits"] = fits
            candidates.append(entry)
            key = (not fits, estimate["step_time_s"])
            if best is None or key < best[0]:
                best = (key, stages, microbatches, cut_, plan_tasks, estimate)
    if single_stage_seconds is not None:
        candidates.insert(0, {"stages": 1, "microbatches": 1, "step_time_s": single_stage_seconds,
                              "fits": True})
        explicit = popts.stages is not None or popts.microbatches is not None
        if best is None or (not explicit and single_stage_seconds <= best[0][1]):
            return None if best is None else NoPipeline(candidates)
    if best is None:
        return None
    _, stages, microbatches, cut_, plan_tasks, estimate = best
    order = schedule(cut_, microbatches, popts.schedule)
    submeshes = []
    for s in range(stages):
        sub, devices = submesh(options.mesh, stages, s)
        submeshes.append({"axis_names": list(sub.axis_names), "axis_sizes": list(sub.axis_sizes),
                          "devices": devices})
    return PipelinePlan(stages, microbatches, popts.schedule, cut_, analysis, submeshes,
                        plan_tasks, order, estimate, candidates)


@dataclass
class NoPipeline:
    """Pipelining was considered and one stage won; the candidates go into plan.json."""

    candidates: list[dict]


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
        "estimate": _rounded(plan.estimate),
        "candidates": [_rounded(c) for c in plan.candidates],
    }


def _rounded(value):
    if isinstance(value, float):
        return float(f"{value:.6g}")
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    return value


def task_files(plan: PipelinePlan) -> dict[str, bytes]:
    files = {}
    for tp in plan.tasks:
        files[f"tasks/{tp.task.name}.jaxexport"] = bytes(tp.exported.serialize())
        files[f"tasks/{tp.task.name}.mlir"] = ir.module_text(tp.state.program.module).encode()
    return files


__all__ = ["PipelineOptions", "PipelinePlan", "describe", "plan_pipeline", "task_files",
           "submesh"]
