"""Pipeline parallelism and microbatching: cut the program into stages on submeshes, plan each
task's sharding with the intra-operator ILP, pick stages, submeshes and microbatches by the cost
model, and describe the schedule the loader runs.

The search is Alpa's inter-operator pass (hloplan.inter_op): the per-microbatch forward ops are
grouped into L candidate layers (balanced cost, cut at narrow points: passes/cut_pipeline.py);
a stage is a contiguous range of layers (its backward ops follow their residuals, its optimizer
updates follow its parameters) on one submesh shape of Alpa's set ((1, 2^k) within a row of the
mesh, (n, width) for n rows); a DP over (range, shape) costs picks the stages minimising
sum t + (M - 1) max t + the slowest stage's once-per-step part, under the memory budget, for
each microbatch count M.

A (range, shape, M) cost is the intra-operator ILP's estimate of the stage's tasks on that
submesh, plus receiving its inputs from the other stages. Solving the ILP for every pair would
take hundreds of solves, so pairs are priced lazily: every pair starts at a roofline lower
bound (its ops' FLOPs and bytes spread perfectly over the submesh, plus its transfers); the DP
runs on the bounds; one pair of the best solution that is not planned yet is planned with the
ILP (each distinct task program and submesh once: identical layers share one solve) and its
exact cost replaces the bound; repeat until the best solution is made only of planned pairs.
That solution is optimal for the cost model (within `gap`: the search stops when no solution's
bounds beat the best planned one by more than that): a pair whose lower bound cannot beat it is
never planned. A solve budget (`max_solves`) caps the work; when it runs out, the best solution
made of planned pairs is taken.

Microbatches: with `--microbatches auto`, S stages are tried with S <= M <= 4S microbatches
(M dividing the batch): fewer leave most of the pipeline idle, more repeat each stage's fixed
per-microbatch costs (the gradient reductions) for a bubble that is already small.

Part A (per microbatch) runs M times per step on microbatches of the batch; its frontier values
(partial sums over the batch) are accumulated; part B (once per step) runs on the accumulated
values. See passes/label_batch.py and passes/cut_pipeline.py.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections import OrderedDict
from dataclasses import dataclass, field

from hloplan import inter_op, ir
from hloplan.cost_models import CommModel
from hloplan.cost_models.collectives import local_bytes
from hloplan.diagnostics import NoPlanFits, UsageError
from hloplan.inter_op import StageCost, SubmeshShape
from hloplan.mesh import MeshSpec
from hloplan.op_rules import folded_transposes, fused_values, hbm_traffic, rule_for
from hloplan.passes.build_sharding_problem import BuildShardingProblem
from hloplan.passes.cut_pipeline import (
    PART_ORDER,
    CutContext,
    PipelineCut,
    cut_at,
    layer_starts,
    prepare,
    schedule,
)
from hloplan.passes.extract_graph import ExtractGraph
from hloplan.passes.label_batch import UNPLANNED, BatchAnalysis, analyse_program, state_outputs
from hloplan.passes.propagate_sharding import PropagateSharding
from hloplan.passes.solve_sharding import SolveSharding
from hloplan.passes.tie_repeated_layers import TieRepeatedLayers
from hloplan.pipeline import run_pipeline
from hloplan.plan import value_spec
from hloplan.solver.evaluate import evaluate
from hloplan.state import CompileOptions, CompileState

SCHEDULES = ("gpipe", "1f1b")
MAX_AUTO_STAGES = 8
DEFAULT_LAYERS = 8
DEFAULT_MAX_SOLVES = 48
DEFAULT_GAP = 0.01
KEPT_STATES = 8  # solved task states kept besides the best solution's (the rest: costs only)
# Each task ILP of the stage search gets this share of --time-limit. The search solves dozens of
# them; one whose LP bound stays a few percent below its best plan otherwise spends the whole
# limit in branch and bound proving it (GPT 4 layers, hidden 8192, 4x8: about 50 s of the
# search's 108, for no better plan), and a stage's cost within a few percent is all the DP needs.
STAGE_TIME_FRACTION = 0.25


@dataclass(frozen=True)
class PipelineOptions:
    stages: int | None = None  # None: auto
    microbatches: int | None = None  # None: auto
    schedule: str = "1f1b"
    batch_args: tuple[str, ...] = ()
    layers: int | None = None  # candidate layers for the stage DP (None: DEFAULT_LAYERS)
    max_solves: int = DEFAULT_MAX_SOLVES  # ILP solves the stage search may spend
    gap: float = DEFAULT_GAP  # stop when no lower bound beats the best plan by more than this
    # Gradient accumulation where no single-program plan fits: one stage, any number of
    # microbatches M >= 2 dividing the batch, the fastest that fits (nothing if none does).
    accumulate: bool = False


@dataclass(frozen=True)
class TaskFigure:
    """What the stage estimate needs of a planned task."""

    seconds: float
    peak: float
    in_specs: tuple  # per input: the sharding the task takes it in (mesh axis indices per dim)
    out_specs: tuple  # per output: the sharding it makes it in


def _figure(task_state: CompileState) -> TaskFigure:
    evaluation = evaluate(task_state.problem, task_state.solution)
    graph = task_state.graph
    return TaskFigure(evaluation.total, evaluation.peak_memory,
                      tuple(value_spec(task_state, v) for v in graph.arguments),
                      tuple(value_spec(task_state, v) for v in graph.outputs))


@dataclass
class TaskPlan:
    task: object  # cut_pipeline.Task
    state: CompileState
    exported: object  # sharded jax.export.Exported
    seconds: float
    peak_bytes: float
    figure: TaskFigure | None = None


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
    stage_info: list[dict] = field(default_factory=list)
    search: dict = field(default_factory=dict)


def _sub_hosts(options: CompileOptions, sub: MeshSpec) -> int | None:
    """A submesh keeps its share of hosts: a stage on 2 of 4 nodes spans 2 hosts."""
    if options.hosts is None:
        return None
    hosts = max(1, options.hosts * sub.size // options.mesh.size)
    while sub.size % hosts:
        hosts -= 1
    return hosts


@dataclass(frozen=True)
class PriceBoundaryLayouts:
    """Between build-sharding-problem and solve-sharding for a task: a layout at the task's
    boundary that another task of its stage has fixed costs what converting it costs, under
    each strategy of the node deciding it (times a weight: 1/M for what happens once per step
    in a task that runs M times). So the ILP picks the task's boundary layouts knowing what
    they cost, and the task's estimate includes the resharding between tasks and between steps
    (the loader does it), as the whole-program plan prices it inside one program.

    `incoming`: ((input position, sharding, weight), ...): inputs that arrive in that sharding.
    `outgoing`: ((output position, sharding, weight), ...): outputs wanted in that sharding."""

    incoming: tuple = ()
    outgoing: tuple = ()
    name: str = "price-boundary-layouts"

    def apply(self, state: CompileState) -> None:
        graph, space = state.graph, state.space
        nodes = list(state.problem.nodes)
        wanted = [(graph.arguments[p], spec, weight, False) for p, spec, weight in self.incoming]
        wanted += [(graph.outputs[p], spec, weight, True) for p, spec, weight in self.outgoing]
        for value, spec, weight, out in wanted:
            op_index = graph.values[value].producer
            index = graph.values[value].result_index
            node = space.node_of.get(op_index)
            strategies = space.strategies.get(op_index)
            if node is None or not strategies or len(nodes[node].strategies) != len(strategies):
                continue
            type_ = graph.type_of(value)

            def cost(own, type_=type_, spec=spec, out=out, index=index) -> float:
                # The loader moves values between tasks with jax.device_put: XLA's reshard,
                # not staged (nothing pins the layouts in between).
                src, dst = (own.results[index], spec) if out else (spec, own.results[index])
                return state.comm.reshard(type_.shape, type_.itemsize, src, dst,
                                          staged=False).seconds

            priced = tuple(dataclasses.replace(st, communication_cost=st.communication_cost
                                               + weight * cost(own))
                           for st, own in zip(nodes[node].strategies, strategies))
            nodes[node] = dataclasses.replace(nodes[node], strategies=priced)
        state.problem = dataclasses.replace(state.problem, nodes=tuple(nodes))


def _plan_order(tasks: list) -> list:
    """A stage's tasks in the order they are planned: as the data flows (its per-microbatch
    tasks in phase order, then its once-per-step tasks), each adapting to the layouts fixed
    before it."""
    return sorted(tasks, key=lambda t: (PART_ORDER[t.part], t.index))


def _boundary(graph, analysis: BatchAnalysis, task, earlier: list, next_of: dict[int, int],
              microbatches: int) -> tuple[tuple, tuple]:
    """(incoming, outgoing) of `task` for PriceBoundaryLayouts, from the tasks of its stage
    planned before it (`earlier`: (task, TaskFigure) pairs, in _plan_order). `next_of`: program
    output value -> the argument it replaces next step.

    A task takes what earlier tasks of its stage make as they make it (a part-A task every
    microbatch; a part-B task the accumulated partial sums once per step), and a parameter as
    the first task reading it holds it (once per step: the loader keeps each argument's copies
    for the step); a part-B task hands a parameter's next value back in that layout."""
    once = 1.0 / microbatches if task.part == "A" else 1.0
    made = {v: figure.out_specs[k] for t, figure in earlier for k, v in enumerate(t.outputs)}
    # What the prologue makes arrives once per step, like a parameter.
    per_step = {v for t, _ in earlier if t.part == "P" for v in t.outputs}
    batch_args = {graph.arguments[p] for p in analysis.batch_args}
    args = set(graph.arguments) - batch_args
    home: dict[int, tuple] = {}
    for t, figure in earlier:
        for k, v in enumerate(t.inputs):
            if v in args:
                home.setdefault(v, figure.in_specs[k])
    incoming = []
    for k, v in enumerate(task.inputs):
        if v in made:
            incoming.append((k, made[v], once if v in per_step else 1.0))
        elif v in home:
            incoming.append((k, home[v], once))
    outgoing = [(k, home[next_of[v]], 1.0) for k, v in enumerate(task.outputs)
                if task.part == "B" and next_of.get(v) in home]
    return tuple(incoming), tuple(outgoing)


def _sub_comm(options: CompileOptions, sub: MeshSpec) -> CommModel:
    return CommModel(options.device, sub, hosts=_sub_hosts(options, sub),
                     combine=options.device.combiner)


class TaskPlanner:
    """Plans tasks on submeshes with the intra-operator ILP. Each distinct task program (its
    text without locations: identical layers are one program) on each submesh is solved once;
    the costs are kept for all, the solved states for the most recent (the final plan reuses
    them)."""

    def __init__(self, state: CompileState, analysis: BatchAnalysis, options: CompileOptions):
        self.state = state
        self.analysis = analysis
        self.options = options
        self.modules: dict[tuple, tuple] = {}  # task identity -> (module, full key, struct key)
        self.costs: dict[tuple, TaskFigure | None] = {}  # (struct key, submesh) -> figure
        self.solved: OrderedDict[tuple, CompileState] = OrderedDict()  # full key -> state
        self.pinned: dict[tuple, CompileState] = {}  # the states of the best solution's tasks
        self.plans: dict[tuple, TaskPlan] = {}  # full key -> final TaskPlan
        self.solves = 0
        self.min_peaks: list[tuple] = []  # (bytes, part, M, reserve) of tasks nothing fits

    def pin(self, keys: list[tuple]) -> None:
        """Keep the solved states of these tasks (the best solution so far: likely the final
        plan, whose big tasks take longest to solve again); the rest stay in a short LRU."""
        for key in list(self.pinned):
            if key not in keys:
                self.solved[key] = self.pinned.pop(key)
        for key in keys:
            if key in self.solved:
                self.pinned[key] = self.solved.pop(key)
        while len(self.solved) > KEPT_STATES:
            self.solved.popitem(last=False)

    def key(self, task, microbatches: int, sub: MeshSpec, boundary: tuple = ((), ()),
            reserve: int = 0) -> tuple:
        return (self._module(task, microbatches)[1], sub, boundary, reserve)

    def _module(self, task, microbatches: int):
        identity = (task.part, tuple(task.units), tuple(task.inputs), tuple(task.outputs),
                    microbatches if task.part == "A" else 1)
        if identity not in self.modules:
            graph = self.state.graph
            batch_dims = self.analysis.label if task.part == "A" else None
            module = ir.build_function(self.state.program.module, self.state.handles, graph,
                                       task.units, task.inputs, task.outputs, batch_dims,
                                       identity[-1], name="main")
            full = hashlib.sha256(ir.module_text(module).encode()).hexdigest()
            struct = hashlib.sha256(ir.module_text(module, debug_info=False).encode()).hexdigest()
            self.modules[identity] = (module, full, struct)
        return self.modules[identity]

    def _solve(self, task, module, sub: MeshSpec, boundary: tuple,
               reserve: int = 0) -> CompileState:
        """The task's ILP on `sub`, its budget less `reserve` bytes (what the loader holds
        beside it whatever the plan: _reserve)."""
        program = ir.load_program(ir.module_text(module).encode(),
                                  f"{self.state.filename}#{task.name}")
        sub_options = dataclasses.replace(self.options, mesh=sub,
                                          hosts=_sub_hosts(self.options, sub),
                                          time_limit=self.options.time_limit * STAGE_TIME_FRACTION,
                                          memory_budget=self.options.plan_budget - reserve,
                                          memory_reserve=0.0)
        self.solves += 1
        return run_pipeline(program, sub_options, [
            ExtractGraph(), BuildShardingProblem(), PriceBoundaryLayouts(*boundary),
            TieRepeatedLayers(), SolveSharding()])

    def cost(self, task, microbatches: int, sub: MeshSpec,
             boundary: tuple = ((), ()), reserve: int = 0) -> TaskFigure | None:
        """Seconds, peak bytes per device and boundary shardings of the task on `sub`, its
        boundary priced as `boundary` (PriceBoundaryLayouts) says; None if no plan fits."""
        module, full, struct = self._module(task, microbatches)
        key = (struct, sub, boundary, reserve)
        if key not in self.costs:
            try:
                task_state = self._solve(task, module, sub, boundary, reserve)
            except NoPlanFits as error:
                self.costs[key] = None
                smallest = error.min_peak
                if smallest is not None:  # the least any plan of a task needs, for the error
                    self.min_peaks.append((smallest, task.part, microbatches, reserve))
                return None
            self.costs[key] = _figure(task_state)
            self.solved[(full, sub, boundary, reserve)] = task_state
            while len(self.solved) > KEPT_STATES:
                self.solved.popitem(last=False)
        return self.costs[key]

    def plan(self, task, microbatches: int, sub: MeshSpec,
             boundary: tuple = ((), ()), reserve: int = 0) -> TaskPlan:
        """The task planned, propagated and exported on `sub`."""
        module, full, _ = self._module(task, microbatches)
        key = (full, sub, boundary, reserve)
        if key in self.plans:
            cached = self.plans[key]
            return dataclasses.replace(cached, task=task)
        task_state = (self.pinned.pop(key, None) or self.solved.pop(key, None)
                      or self._solve(task, module, sub, boundary, reserve))
        PropagateSharding().apply(task_state)
        figure = _figure(task_state)
        platforms = (tuple(self.state.program.exported.platforms) if self.state.program.exported
                     else ("cpu",))
        reference = ir.exported_from_module(task_state.graph, platforms, task.name)
        mesh = sub
        in_specs = [tuple(tuple(mesh.axis_names[a] for a in axes)
                          for axes in value_spec(task_state, v))
                    for v in task_state.graph.arguments]
        out_specs = [tuple(tuple(mesh.axis_names[a] for a in axes)
                           for axes in value_spec(task_state, v))
                     for v in task_state.graph.outputs]
        exported = ir.sharded_exported(
            reference, serialized=ir.portable_artifact(task_state.program.module),
            axis_names=mesh.axis_names, axis_sizes=mesh.axis_sizes, in_specs=in_specs,
            out_specs=out_specs)
        plan = TaskPlan(task, task_state, exported, figure.seconds, figure.peak, figure)
        self.plans[key] = plan
        return plan


def _transfer_link(comm: CommModel):
    """Values move between stages over the link of the mesh's first axis (between hosts when
    the mesh spans several)."""
    return comm.links[0]


def _stage_cost(graph, analysis: BatchAnalysis, cut_: PipelineCut, stage: int,
                figures: dict[int, TaskFigure], microbatches: int, comm: CommModel,
                link) -> tuple[StageCost, dict]:
    """A stage's cost from its tasks' figures, on its submesh (`comm`):
    - per microbatch: its part-A tasks (with the resharding at their boundaries, priced in them:
      PriceBoundaryLayouts); receiving what they read from other stages (each device its own
      share, over `link`);
    - once per step: its part-B tasks and its prologue (part P); adding up the partial sums
      of the M microbatches;
    - memory: its largest task peak with what the loader holds beside that task (_held_bytes),
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
    held = _held_bytes(graph, analysis, tasks, figures, microbatches, comm.mesh)
    peak = max((figures[t.index].peak + held[t.index] for t in tasks), default=0.0)
    residual = 0.0
    for t in a_tasks:
        later = [o for o in a_tasks if o.phase > t.phase]
        kept = {v for o in later for v in o.inputs} & set(t.outputs)
        residual += sum(graph.type_of(v).nbytes / microbatches / devices for v in kept)
    parts = {"compute_s": compute, "transfer_s": transfer, "per_step_s": b_time,
             "accumulate_s": accumulate}
    return StageCost(compute + transfer, b_time + accumulate, peak, residual), parts


def _reserve(graph, analysis: BatchAnalysis, tasks: list, task, microbatches: int,
             devices: int) -> int:
    """A lower bound on _held_bytes for `task` whatever the stage's plans: what the loader
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


def _held_bytes(graph, analysis: BatchAnalysis, tasks: list, figures: dict[int, TaskFigure],
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


def _estimate(state, cut_: PipelineCut, plan_tasks: list[TaskPlan], analysis, microbatches,
              comm, schedule_kind: str, stage_comms: list[CommModel]) -> dict:
    stages = cut_.stages
    figures = {tp.task.index: tp.figure for tp in plan_tasks}
    link = _transfer_link(comm)
    costs, parts = [], []
    for s in range(stages):
        cost, detail = _stage_cost(state.graph, analysis, cut_, s, figures, microbatches,
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


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# ------------------------------------------------------------------------------ stage search


class StageSearch:
    """Costs of (layer range, submesh shape, microbatches) for the inter-op DP: roofline lower
    bounds for all, the ILP's estimate for those the DP's best solutions use (see the module
    docstring)."""

    def __init__(self, state: CompileState, ctx: CutContext, planner: TaskPlanner,
                 options: CompileOptions, comm: CommModel, starts: list[int],
                 shapes: list[SubmeshShape]):
        self.state, self.ctx, self.planner = state, ctx, planner
        self.options, self.comm = options, comm
        self.graph = state.graph
        self.analysis = ctx.analysis
        self.starts = starts  # forward position of each layer
        self.bounds = starts + [len(ctx.forward)]
        self.layers = len(starts)
        self.shapes = shapes
        self.subs = [inter_op.submesh_spec(options.mesh, s) for s in shapes]
        self.comms = [_sub_comm(options, sub) for sub in self.subs]
        self.next_of = {out: self.graph.arguments[p]
                        for p, out in state_outputs(self.graph).items()}
        self.link = _transfer_link(comm)
        self.exact: dict[tuple[int, int, int, int], StageCost | None] = {}
        self.task_keys: dict[tuple[int, int, int, int], list[tuple]] = {}
        self.lower: dict[int, list] = {}  # M -> table of lower bounds
        self._op_figures: dict[int, tuple] = {}
        # Fusion in the whole program: a task's own module fuses no more, so this stays a
        # lower bound.
        self._folded = folded_transposes(self.graph)
        self._fused = fused_values(self.graph, self._folded)
        self._prefix: dict[tuple[int, int], tuple[list[float], list[float]]] = {}
        self._crossers = self._crossing_values()
        self.cuts: dict[tuple[int, int], PipelineCut] = {}

    # -- lower bounds

    def _op_figure(self, op) -> tuple | None:
        """(FLOPs, FLOP/s of its dtype, [(HBM bytes, batch-labelled)], [(dim size, is the batch
        dim)], whether it touches the batch) of an op, or None if it is free."""
        if op.index not in self._op_figures:
            figure = None
            if op.name not in UNPLANNED and op.name != "arg":
                rule = rule_for(self.graph, op)
                if not rule.free:
                    label = self.analysis.label
                    types = [self.graph.type_of(v) for v in op.results]
                    dtype = types[0].dtype if types and types[0] is not None else "f32"
                    moved, dims, scaled = [], set(), False
                    reads, writes = hbm_traffic(self.graph, op, self._fused, folded=self._folded)
                    for v, traffic in zip((*op.operands, *op.results), (*reads, *writes)):
                        type_ = self.graph.type_of(v)
                        if type_ is None:
                            continue
                        scaled = scaled or v in label
                        if traffic:
                            moved.append((type_.nbytes * op.multiplier, v in label))
                        dims.update((size, label.get(v) == d) for d, size in enumerate(type_.shape))
                    figure = (rule.flops * op.multiplier, self.options.device.flops_for(dtype),
                              moved, sorted(dims), scaled)
            self._op_figures[op.index] = figure
        return self._op_figures[op.index]

    def _op_seconds(self, figure, microbatches: int, axis_sizes: tuple[int, ...]) -> float:
        """A lower bound on the op's seconds on a submesh with these axes: its roofline with
        the batch split `microbatches` ways, divided by the most any strategy can split it (a
        mesh axis can only split a dimension its size divides)."""
        flops, rate, moved, dims, scaled = figure
        nbytes = sum(b / microbatches if lab else b for b, lab in moved)
        sizes = {size // microbatches if batch else size for size, batch in dims}
        split = 1
        for axis in axis_sizes:
            if any(size >= axis and size % axis == 0 for size in sizes):
                split *= axis
        seconds = max(flops / (microbatches if scaled else 1) / rate,
                      nbytes / self.options.device.hbm_bandwidth)
        return seconds / split

    def _prefix_sums(self, microbatches: int, h: int) -> tuple[list[float], list[float]]:
        """Prefix sums over forward positions of the lower bounds of part A (per microbatch)
        and part B (per step) on submesh shape h."""
        key = (microbatches, h)
        if key not in self._prefix:
            axes = self.subs[h].axis_sizes
            n = len(self.ctx.forward)
            a_at, b_at = [0.0] * (n + 1), [0.0] * (n + 1)
            for part, at, m in ((self.ctx.part_a, a_at, microbatches), (self.ctx.part_b, b_at, 1)):
                for u in part:
                    for op in self.ctx.all_units[u]:
                        figure = self._op_figure(op)
                        if figure is not None:
                            at[self.ctx.key[u]] += self._op_seconds(figure, m, axes)
            pa, pb = [0.0], [0.0]
            for k in range(n):
                pa.append(pa[-1] + a_at[k])
                pb.append(pb[-1] + b_at[k])
            self._prefix[key] = (pa, pb)
        return self._prefix[key]

    def _crossing_values(self) -> list[tuple[int, list[int], int, bool]]:
        """Part-A values read at another forward position than where they are made:
        (producer key, reader keys, bytes, batch-labelled)."""
        ctx = self.ctx
        a_units = set(ctx.part_a)
        readers: dict[int, set[int]] = {}
        for u in ctx.part_a:
            for v in ctx.io[u][0]:
                src = ctx.producer_unit.get(v)
                if src in a_units and ctx.key[src] != ctx.key[u]:
                    readers.setdefault(v, set()).add(ctx.key[u])
        out = []
        for v, keys in sorted(readers.items()):
            type_ = self.graph.type_of(v)
            if type_ is None:
                continue
            out.append((ctx.key[ctx.producer_unit[v]], sorted(keys), type_.nbytes,
                        v in self.analysis.label))
        return out

    def lower_bound(self, i: int, j: int, h: int, microbatches: int) -> StageCost:
        pa, pb = self._prefix_sums(microbatches, h)
        lo, hi = self.bounds[i], self.bounds[j]
        n = self.shapes[h].size
        transfer = 0.0
        for made, keys, nbytes, labelled in self._crossers:
            if lo <= made < hi or not any(lo <= k < hi for k in keys):
                continue
            share = nbytes / (microbatches if labelled else 1)
            transfer += self.link.latency + share / n / self.link.bandwidth
        return StageCost(pa[hi] - pa[lo] + transfer, pb[hi] - pb[lo], exact=False)

    def table(self, microbatches: int) -> list:
        """[i][j][h]: the cost the DP uses now (exact where planned, else the lower bound)."""
        if microbatches not in self.lower:
            self.lower[microbatches] = [
                [[self.lower_bound(i, j, h, microbatches) if j > i else None
                  for h in range(len(self.shapes))] for j in range(self.layers + 1)]
                for i in range(self.layers)]
        return self.lower[microbatches]

    # -- exact costs

    def stage_cut(self, i: int, j: int) -> tuple[PipelineCut, int]:
        """A cut with layers [i, j) as one stage (the rest before and after it), and that
        stage's index: its tasks are the ones it has in any cut with that stage."""
        if (i, j) not in self.cuts:
            starts = [0] + ([self.starts[i]] if i > 0 else []) + (
                [self.starts[j]] if j < self.layers else [])
            self.cuts[(i, j)] = cut_at(self.ctx, starts)
        return self.cuts[(i, j)], (1 if i > 0 else 0)

    def evaluate(self, i: int, j: int, h: int, microbatches: int) -> StageCost | None:
        key = (i, j, h, microbatches)
        if key not in self.exact:
            cut_, stage = self.stage_cut(i, j)
            figures = {}
            cost = None
            earlier: list = []
            keys = []
            tasks = [t for t in cut_.tasks if t.stage == stage]
            for task in _plan_order(tasks):
                boundary = _boundary(self.graph, self.analysis, task, earlier, self.next_of,
                                     microbatches)
                reserve = _reserve(self.graph, self.analysis, tasks, task, microbatches,
                                   self.subs[h].size)
                figure = self.planner.cost(task, microbatches, self.subs[h], boundary, reserve)
                if figure is None:
                    break
                figures[task.index] = figure
                earlier.append((task, figure))
                keys.append(self.planner.key(task, microbatches, self.subs[h], boundary,
                                             reserve))
            else:
                cost, _ = _stage_cost(self.graph, self.analysis, cut_, stage, figures,
                                      microbatches, self.comms[h], self.link)
            self.exact[key] = cost
            self.task_keys[key] = keys
            self.table(microbatches)[i][j][h] = cost
        return self.exact[key]

    def exact_table(self, microbatches: int) -> list:
        return [[[self.exact.get((i, j, h, microbatches)) if j > i else None
                  for h in range(len(self.shapes))] for j in range(self.layers + 1)]
                for i in range(self.layers)]


def _solve_on(table, layers, sizes, devices, m, counts, schedule_kind, budget, limit):
    return inter_op.solve(layers, sizes, devices, lambda i, j, h: table[i][j][h], m, counts,
                          schedule_kind, budget, limit)


def _search(search: StageSearch, pairs: dict[int, list[int]], schedule_kind: str,
            budget: float, bound: float, max_solves: int, gap: float):
    """The lazy DP loop over microbatch counts M (`pairs`: M -> the stage counts tried with
    it). Returns (best (objective, M, solution) or None, the fully planned solutions seen
    {(M, stages): objective}, whether the best is proven within `gap` of the optimum)."""
    sizes = [s.size for s in search.shapes]
    devices = search.options.mesh.size

    def run(m: int, table, limit: float):
        return _solve_on(table, search.layers, sizes, devices, m, pairs[m], schedule_kind,
                         budget, limit * (1 - gap))

    def record(m: int, sol) -> float | None:
        """The solution's objective if all its pairs are planned and fit, else None."""
        exact = [search.exact.get((st.start, st.end, st.shape, m)) for st in sol.stages]
        if any(c is None for c in exact):
            return None
        flights = [inter_op.in_flight(schedule_kind, m, len(exact) - k) for k in range(len(exact))]
        if any(c.memory(f) > budget for c, f in zip(exact, flights)):
            return None
        value = inter_op.objective([c.time for c in exact], [c.once for c in exact], m)
        seen[(m, sol.stages)] = value
        return value

    seen: dict[tuple, float] = {}
    incumbent = None  # (objective, M, solution): the best fully planned solution
    limit = bound
    best_of = {m: run(m, search.table(m), limit) for m in pairs}
    optimal = True
    while True:
        live = [(sol.objective, m, sol) for m, sol in best_of.items() if sol is not None]
        if not live:
            break  # nothing beats the incumbent (or the bound) by more than the gap
        value, m, sol = min(live, key=lambda x: (x[0], x[1]))
        pending = [st for st in sol.stages if (st.start, st.end, st.shape, m) not in search.exact]
        if not pending:  # made of planned pairs, and no lower bound beats it: optimal
            record(m, sol)
            incumbent, limit = (value, m, sol), value
            search.planner.pin([key for st in sol.stages
                                for key in search.task_keys[(st.start, st.end, st.shape, m)]])
            break
        # The cap counts once some solution is planned (hard stop at twice the cap).
        solves = search.planner.solves
        if solves >= 2 * max_solves or (solves >= max_solves and incumbent is not None):
            optimal = False
            break
        # Plan its pairs, largest bound first (the likeliest to change the answer), until
        # it is planned whole or can no longer beat the incumbent.
        table = search.table(m)
        for st in sorted(pending, key=lambda st: -table[st.start][st.end][st.shape].time):
            search.evaluate(st.start, st.end, st.shape, m)
            now = [table[x.start][x.end][x.shape] for x in sol.stages]
            if any(c is None for c in now) or inter_op.objective(
                    [c.time for c in now], [c.once for c in now], m) >= limit * (1 - gap):
                break
        value = record(m, sol)
        if value is not None and value < limit:
            incumbent, limit = (value, m, sol), value
            search.planner.pin([key for st in sol.stages
                                for key in search.task_keys[(st.start, st.end, st.shape, m)]])
        for k, other in best_of.items():
            if k == m:
                best_of[k] = run(m, search.table(m), limit)  # its costs changed
            elif other is not None and other.objective >= limit * (1 - gap):
                best_of[k] = None  # cannot beat the incumbent
    if not optimal:
        # Out of solves: the best solution made of planned pairs only.
        for m in pairs:
            sol = _solve_on(search.exact_table(m), search.layers, sizes, devices, m, pairs[m],
                            schedule_kind, budget, limit)
            if sol is not None:
                incumbent, limit = (sol.objective, m, sol), sol.objective
                seen[(m, sol.stages)] = sol.objective
        if incumbent is not None:
            _, m, sol = incumbent
            search.planner.pin([key for st in sol.stages
                                for key in search.task_keys[(st.start, st.end, st.shape, m)]])
    return incumbent, seen, optimal


def plan_pipeline(state: CompileState, options: CompileOptions, popts: PipelineOptions,
                  single_stage_seconds: float | None) -> PipelinePlan | None:
    """Choose stages, their submeshes and microbatches (where 'auto') and plan every task.
    Returns None when nothing was planned, NoPipeline when pipelining was considered and one
    stage won."""
    if popts.schedule not in SCHEDULES:
        raise UsageError(f"unknown schedule {popts.schedule!r} ({', '.join(SCHEDULES)})")
    graph = state.graph
    analysis = analyse_program(graph, popts.batch_args)
    ctx = prepare(graph, analysis)
    mesh = options.mesh
    forward = len(ctx.forward)
    if popts.stages is not None and popts.stages > min(mesh.size, max(forward, 1)):
        raise UsageError(f"--stages {popts.stages}: the mesh has {mesh.size} devices and the "
                         f"program {forward} forward ops to cut")
    batch = analysis.batch_size
    if popts.microbatches is not None and batch % popts.microbatches:
        raise UsageError(f"--microbatches {popts.microbatches} does not divide the batch of "
                         f"{batch}")
    max_stages = popts.stages or min(MAX_AUTO_STAGES, mesh.size, max(forward, 1))
    stage_counts = [popts.stages] if popts.stages else list(range(1, max_stages + 1))
    # Microbatches M per stage count S: as given, or S <= M <= 4 S (dividing the batch), as
    # with one stage and gradient accumulation; 1 x 1 is the plain plan, planned already.
    pairs: dict[int, list[int]] = {}
    if popts.accumulate:
        stage_counts = [1]
        pairs = {m: [1] for m in _divisors(batch) if m > 1}
        if not pairs:
            return None
    for m in ([] if popts.accumulate else
              [popts.microbatches] if popts.microbatches else _divisors(batch)):
        counts = [s for s in stage_counts if (popts.microbatches or s <= m <= 4 * s)
                  and (m > 1 or s > 1)]
        if counts:
            pairs[m] = counts
    if not pairs and popts.stages:  # a small batch: as many microbatches as it splits into
        m = max(d for d in _divisors(batch) if d <= 4 * popts.stages)
        if m > 1 or popts.stages > 1:
            pairs[m] = [popts.stages]
    if not pairs:
        return None
    comm = CommModel(options.device, mesh, hosts=options.hosts, combine=options.device.combiner)
    dtype = graph.type_of(graph.outputs[0]).dtype if graph.outputs else "f32"
    layers = max(popts.layers or DEFAULT_LAYERS, max_stages)
    starts = layer_starts(ctx, min(layers, max(forward, 1)),
                          flop_rate=options.device.flops_for(dtype),
                          link_bandwidth=_transfer_link(comm).bandwidth,
                          memory_bandwidth=options.device.hbm_bandwidth)
    shapes = inter_op.submesh_shapes(mesh)
    planner = TaskPlanner(state, analysis, options)
    search = StageSearch(state, ctx, planner, options, comm, starts, shapes)
    explicit = (popts.stages is not None or popts.microbatches is not None) and not popts.accumulate
    bound = single_stage_seconds if (single_stage_seconds is not None and not explicit) \
        else float("inf")
    budget = options.plan_budget
    found, seen, optimal = _search(search, pairs, popts.schedule, budget, bound,
                                   popts.max_solves, popts.gap)
    if found is None and explicit:
        # Nothing fits the memory budget: the fastest anyway (the estimate says it does not fit).
        found, more, optimal = _search(search, pairs, popts.schedule, float("inf"), float("inf"),
                                       popts.max_solves, popts.gap)
        seen.update(more)
    candidates = [_candidate(search, m, stages, value, popts.schedule, budget)
                  for (m, stages), value in sorted(seen.items(),
                                                   key=lambda item: (item[1], item[0][0]))]
    stats = {"layers": search.layers, "layer_starts": list(starts),
             "unfit_task_peaks": [{"bytes": b, "part": part, "microbatches": m, "held": held}
                                  for b, part, m, held in sorted(planner.min_peaks,
                                                                 key=lambda x: (x[2], x[1]))],
             "submesh_shapes": [str(s) for s in shapes],
             "microbatches_stages": {str(m): counts for m, counts in pairs.items()},
             "pairs": search.layers * (search.layers + 1) // 2 * len(shapes) * len(pairs),
             "pairs_planned": len(search.exact), "ilp_solves": planner.solves,
             "max_solves": popts.max_solves, "gap": popts.gap, "optimal": optimal}
    if single_stage_seconds is not None:
        candidates.insert(0, {"stages": 1, "microbatches": 1, "submeshes": [str(shapes[-1])],
                              "step_time_s": single_stage_seconds, "fits": True})
    if found is None:
        return NoPipeline(candidates, stats) if (single_stage_seconds is not None
                                                 or popts.accumulate) else None
    _, microbatches, solution = found
    stage_shapes = [shapes[st.shape] for st in solution.stages]
    cut_ = cut_at(ctx, [search.starts[st.start] for st in solution.stages])
    stages = cut_.stages
    subs = [search.subs[st.shape] for st in solution.stages]
    planned: dict[int, TaskPlan] = {}
    for s in range(cut_.stages):
        done: list = []
        tasks = [t for t in cut_.tasks if t.stage == s]
        for task in _plan_order(tasks):
            tp = planner.plan(task, microbatches, subs[s],
                              _boundary(graph, analysis, task, done, search.next_of,
                                        microbatches),
                              _reserve(graph, analysis, tasks, task, microbatches, subs[s].size))
            done.append((task, tp.figure))
            planned[task.index] = tp
    plan_tasks = [planned[task.index] for task in cut_.tasks]
    stats["ilp_solves"] = planner.solves
    estimate = _estimate(state, cut_, plan_tasks, analysis, microbatches, comm, popts.schedule,
                         [search.comms[st.shape] for st in solution.stages])
    if single_stage_seconds is not None and not explicit and \
            single_stage_seconds <= estimate["step_time_s"]:
        return NoPipeline(candidates, stats)
    order = schedule(cut_, microbatches, popts.schedule)
    placed = inter_op.place(mesh, stage_shapes)
    submeshes = [{"axis_names": list(sub.axis_names), "axis_sizes": list(sub.axis_sizes),
                  "devices": devices, "shape": [shape.rows, shape.cols]}
                 for sub, devices, shape in zip(subs, placed, stage_shapes)]
    stage_info = _stage_info(state, ctx, search, solution, cut_, estimate, submeshes)
    return PipelinePlan(stages, microbatches, popts.schedule, cut_, analysis, submeshes,
                        plan_tasks, order, estimate, candidates, stage_info, stats)


def _candidate(search: StageSearch, microbatches: int, stages, value: float,
               schedule_kind: str, budget: float) -> dict:
    costs = [search.exact[(st.start, st.end, st.shape, microbatches)] for st in stages]
    peaks = [c.memory(inter_op.in_flight(schedule_kind, microbatches, len(costs) - k))
             for k, c in enumerate(costs)]
    return {"stages": len(stages), "microbatches": microbatches,
            "submeshes": [str(search.shapes[st.shape]) for st in stages],
            "layers": [[st.start, st.end] for st in stages],
            "step_time_s": value, "peak_bytes": max(peaks), "fits": max(peaks) <= budget}


def _stage_info(state, ctx: CutContext, search: StageSearch, solution, cut_: PipelineCut,
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


@dataclass
class NoPipeline:
    """Pipelining was considered and one stage won; the candidates go into plan.json."""

    candidates: list[dict]
    search: dict = field(default_factory=dict)

    def describe(self) -> dict:
        return {"stages": 1, "microbatches": 1, "candidates": [_rounded(c) for c in self.candidates],
                "search": _rounded(self.search),
                "chosen": "single stage: no pipeline beats it under the cost model"}


def _microbatch_blocks(plan: PipelinePlan, graph) -> int:
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
        "microbatch_blocks": _microbatch_blocks(plan, graph),
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
        "per_stage": _rounded(plan.stage_info),
        "search": _rounded(plan.search),
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


__all__ = ["NoPipeline", "PipelineOptions", "PipelinePlan", "describe", "plan_pipeline",
           "task_files"]
