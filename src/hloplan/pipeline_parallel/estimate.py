"""The cost model of a pipeline, from its tasks' figures (tasks.TaskFigure): a stage's time per
microbatch and per step and its memory (what the loader holds beside each task included), and
the whole pipeline's step under a schedule."""

from __future__ import annotations

from hloplan.cost_models import CommModel
from hloplan.cost_models.collectives import local_bytes
from hloplan.mesh import MeshSpec
from hloplan.passes.cut_pipeline import PipelineCut
from hloplan.passes.label_batch import BatchAnalysis
from hloplan.pipeline_parallel import inter_op
from hloplan.pipeline_parallel.inter_op import StageCost
from hloplan.pipeline_parallel.tasks import TaskFigure, TaskPlan


def transfer_link(comm: CommModel):
    """Values move between stages over the link of the mesh's first axis (between hosts when
    the mesh spans several)."""
    return comm.links[0]


def stage_cost(graph, analysis: BatchAnalysis, cut_: PipelineCut, stage: int,
                figures: dict[int, TaskFigure], microbatches: int, comm: CommModel,
                link) -> tuple[StageCost, dict]:
    """A stage's cost from its tasks' figures, on its submesh (`comm`):
    - per microbatch: its part-A tasks (with the resharding at their boundaries, priced in them:
      tasks.price_boundary_layouts); receiving what they read from other stages (each device its own
      share, over `link`);
    - once per step: its part-B tasks and its prologue (part P); adding up the partial sums
      of the M microbatches;
    - memory: its largest task peak with what the loader holds beside that task (held_bytes),
      and the activations it keeps between its forward and backward per microbatch in flight.
    Returns the cost and its parts (seconds)."""
    owner = {v: t.stage for t in cut_.tasks for v in t.outputs}
    tasks = [t for t in cut_.tasks if t.stage == stage]
    a_tasks = [t for t in tasks if t.part == "A"]
    devices = comm.mesh.size
    compute = sum(figures[t.index].seconds for t in a_tasks)
    transfer = 0.0
    for t in a_tasks:
        for v in t.inputs:
            src = owner.get(v)
            if src is not None and src != stage:
                nbytes = graph.type_of(v).nbytes / (microbatches if v in analysis.label else 1)
                transfer += link.latency + nbytes / devices / link.bandwidth
    accumulate = 0.0
    if microbatches > 1:
        hbm = comm.model.hbm_bandwidth
        for t in a_tasks:
            for k, v in enumerate(t.outputs):
                if v in analysis.frontier:
                    type_ = graph.type_of(v)
                    local = local_bytes(type_.shape, type_.itemsize, figures[t.index].out_specs[k],
                                        comm.mesh)
                    accumulate += (microbatches - 1) * 3 * local / hbm  # read 2, write 1
    b_time = sum(figures[t.index].seconds for t in tasks if t.part != "A")
    held = held_bytes(graph, analysis, tasks, figures, microbatches, comm.mesh)
    peak = max((figures[t.index].peak + held[t.index] for t in tasks), default=0.0)
    residual = 0.0
    for t in a_tasks:
        later = [o for o in a_tasks if o.phase > t.phase]
        kept = {v for o in later for v in o.inputs} & set(t.outputs)
        residual += sum(graph.type_of(v).nbytes / microbatches / devices for v in kept)
    parts = {"compute_s": compute, "transfer_s": transfer, "per_step_s": b_time,
             "accumulate_s": accumulate}
    return StageCost(compute + transfer, b_time + accumulate, peak, residual), parts


def reserve_bytes(graph, analysis: BatchAnalysis, tasks: list, task, microbatches: int,
             devices: int) -> int:
    """A lower bound on held_bytes for `task` whatever the stage's plans: what the loader
    holds beside it, as if split over all `devices` of its submesh (the optimizer state its
    stage's other tasks read, the rest of the batch, the running sums). Its ILP plans under the
    budget less this, so that a plan it finds is not one that cannot fit once they are added."""
    batch_args = {graph.arguments[p] for p in analysis.batch_args}
    own = set(task.inputs)
    read = {v for t in tasks for v in t.inputs}
    held = 0.0
    for v in read & set(graph.arguments):
        nbytes = graph.type_of(v).nbytes
        if v not in batch_args:
            held += 0 if v in own else nbytes
        elif v not in own:
            held += nbytes
        elif task.part == "A":  # the task reads one microbatch of it
            held += nbytes * (1 - 1 / microbatches)
    if task.part == "A" and microbatches > 1:
        held += sum(graph.type_of(v).nbytes for t in tasks if t.part == "A"
                    for v in t.outputs if v in analysis.frontier)
    return int(held // devices)


def held_bytes(graph, analysis: BatchAnalysis, tasks: list, figures: dict[int, TaskFigure],
                microbatches: int, mesh: MeshSpec) -> dict[int, float]:
    """Per task of a stage: bytes per device the loader holds while the task runs that the
    task's own peak (its arguments, results and temporaries) does not count:
    - every whole argument the stage's tasks read (parameters, optimizer state), once per
      layout a task takes it in (the loader keeps each copy for the step), except the task's own;
    - the whole batch arguments the stage slices its microbatches from (all M of them);
    - while a per-microbatch task runs, the running sums of the stage's partial sums over the
      batch (its own result is a second copy, counted in its peak).
    Without these, a stage that accumulates gradients was estimated to fit where its optimizer
    state and accumulators did not."""
    arguments = set(graph.arguments)
    whole = arguments - {graph.arguments[p] for p in analysis.batch_args}

    def local(v, spec) -> float:
        type_ = graph.type_of(v)
        return local_bytes(type_.shape, type_.itemsize, spec, mesh)

    # (argument, layout) -> bytes per device; a batch argument has the program's type, the
    # whole batch, split as the task splits its microbatch.
    copies = {(v, figures[t.index].in_specs[k]): local(v, figures[t.index].in_specs[k])
              for t in tasks for k, v in enumerate(t.inputs) if v in arguments}
    sums = sum(local(v, figures[t.index].out_specs[k]) for t in tasks if t.part == "A"
               for k, v in enumerate(t.outputs)
               if v in analysis.frontier) if microbatches > 1 else 0.0
    # What the prologue hands the microbatches, kept for the step.
    kept = sum(local(v, figures[t.index].out_specs[k]) for t in tasks if t.part == "P"
               for k, v in enumerate(t.outputs))
    held = {}
    for t in tasks:
        own = {(v, figures[t.index].in_specs[k]) for k, v in enumerate(t.inputs)
               if v in whole}
        held[t.index] = sum(b for key, b in copies.items() if key not in own) + (
            sums if t.part == "A" else 0.0) + (kept if t.part != "P" else 0.0)
    return held


def pipeline_estimate(state, cut_: PipelineCut, plan_tasks: list[TaskPlan], analysis,
                      microbatches, comm, schedule_kind: str, stage_comms: list[CommModel]) -> dict:
    stages = cut_.stages
    figures = {tp.task.index: tp.figure for tp in plan_tasks}
    link = transfer_link(comm)
    costs, parts = [], []
    for s in range(stages):
        cost, detail = stage_cost(state.graph, analysis, cut_, s, figures, microbatches,
                                   stage_comms[s], link)
        costs.append(cost)
        parts.append(detail)
    stage_time = [c.time for c in costs]
    slowest = max(stage_time) if stage_time else 0.0
    pipeline = sum(stage_time) + (microbatches - 1) * slowest
    # Once per step: the part-B phases one after another, each as slow as its slowest stage;
    # each stage's accumulation and resharding ahead of its first phase.
    by_phase: dict[int, list[float]] = {}
    for tp in plan_tasks:
        if tp.task.part == "B":
            by_phase.setdefault(tp.task.phase, [0.0] * stages)[tp.task.stage] += tp.seconds
    # The prologue's tasks before the microbatches, one after another.
    prologue = sum(tp.seconds for tp in plan_tasks if tp.task.part == "P")
    phases = sorted(by_phase)
    for s in range(stages):
        extra = parts[s]["accumulate_s"]
        if phases:
            by_phase[phases[0]][s] += extra
        else:
            by_phase.setdefault(-1, [0.0] * stages)[s] += extra
    once = sum(max(times) for times in by_phase.values()) + prologue
    in_flight = [inter_op.in_flight(schedule_kind, microbatches, stages - s)
                 for s in range(stages)]
    memory = [costs[s].memory(in_flight[s]) for s in range(stages)]
    bubble = (stages - 1) / (microbatches + stages - 1) if stages > 1 else 0.0
    return {"step_time_s": pipeline + once, "pipeline_s": pipeline, "per_step_s": once,
            "stage_time_s": stage_time,
            "transfer_s": [p["transfer_s"] for p in parts],
            "per_step_stage_s": [c.once for c in costs],
            "accumulate_s": [p["accumulate_s"] for p in parts],
            "bubble_fraction": bubble, "memory_per_stage_bytes": memory,
            "in_flight_microbatches": in_flight}
