"""Tasks planned on submeshes: each task's intra-operator ILP, with the layouts at its boundary
that other tasks of its stage have fixed priced in (price_boundary_layouts), cached per task
program and submesh (TaskPlanner)."""

from __future__ import annotations

import dataclasses
import hashlib
from collections import OrderedDict
from dataclasses import dataclass

from hloplan import ir
from hloplan.cost_models import CommModel
from hloplan.diagnostics import NoPlanFits
from hloplan.mesh import MeshSpec
from hloplan.passes.build_sharding_problem import BuildShardingProblem
from hloplan.passes.cut_pipeline import PART_ORDER
from hloplan.passes.extract_graph import ExtractGraph
from hloplan.passes.label_batch import BatchAnalysis
from hloplan.passes.propagate_sharding import PropagateSharding
from hloplan.passes.solve_sharding import SolveSharding
from hloplan.passes.tie_repeated_layers import TieRepeatedLayers
from hloplan.passmanager import run_passes
from hloplan.plan import value_spec
from hloplan.solver.evaluate import evaluate
from hloplan.state import CompileOptions, CompileState

KEPT_STATES = 8  # solved task states kept besides the best solution's (the rest: costs only)
# Each task ILP of the stage search gets this share of --time-limit. The search solves dozens of
# them; one whose LP bound stays a few percent below its best plan otherwise spends the whole
# limit in branch and bound proving it (GPT 4 layers, hidden 8192, 4x8: about 50 s of the
# search's 108, for no better plan), and a stage's cost within a few percent is all the DP needs.
STAGE_TIME_FRACTION = 0.25

@dataclass(frozen=True)
class TaskFigure:
    """What the stage estimate needs of a planned task."""

    seconds: float
    peak: float
    in_specs: tuple  # per input: the sharding the task takes it in (mesh axis indices per dim)
    out_specs: tuple  # per output: the sharding it makes it in


def figure_of(task_state: CompileState) -> TaskFigure:
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


def sub_hosts(options: CompileOptions, sub: MeshSpec) -> int | None:
    """A submesh keeps its share of hosts: a stage on 2 of 4 nodes spans 2 hosts."""
    if options.hosts is None:
        return None
    hosts = max(1, options.hosts * sub.size // options.mesh.size)
    while sub.size % hosts:
        hosts -= 1
    return hosts


def price_boundary_layouts(state: CompileState, incoming: tuple = (), outgoing: tuple = ()
                           ) -> None:
    """Between build-sharding-problem and solve-sharding for a task: a layout at the task's
    boundary that another task of its stage has fixed costs what converting it costs, under
    each strategy of the node deciding it (times a weight: 1/M for what happens once per step
    in a task that runs M times). So the ILP picks the task's boundary layouts knowing what
    they cost, and the task's estimate includes the resharding between tasks and between steps
    (the loader does it), as the whole-program plan prices it inside one program.

    `incoming`: ((input position, sharding, weight), ...): inputs that arrive in that sharding.
    `outgoing`: ((output position, sharding, weight), ...): outputs wanted in that sharding."""
    graph, space = state.graph, state.space
    nodes = list(state.problem.nodes)
    wanted = [(graph.arguments[p], spec, weight, False) for p, spec, weight in incoming]
    wanted += [(graph.outputs[p], spec, weight, True) for p, spec, weight in outgoing]
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


def plan_order(tasks: list) -> list:
    """A stage's tasks in the order they are planned: as the data flows (its per-microbatch
    tasks in phase order, then its once-per-step tasks), each adapting to the layouts fixed
    before it."""
    return sorted(tasks, key=lambda t: (PART_ORDER[t.part], t.index))


def boundary_layouts(graph, analysis: BatchAnalysis, task, earlier: list,
                     next_of: dict[int, int], microbatches: int) -> tuple[tuple, tuple]:
    """(incoming, outgoing) of `task` for price_boundary_layouts, from the tasks of its stage
    planned before it (`earlier`: (task, TaskFigure) pairs, in plan_order). `next_of`: program
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


def sub_comm(options: CompileOptions, sub: MeshSpec) -> CommModel:
    return CommModel(options.device, sub, hosts=sub_hosts(options, sub),
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
        beside it whatever the plan: estimate.reserve_bytes)."""
        program = ir.load_program(ir.module_text(module).encode(),
                                  f"{self.state.filename}#{task.name}")
        sub_options = dataclasses.replace(self.options, mesh=sub,
                                          hosts=sub_hosts(self.options, sub),
                                          time_limit=self.options.time_limit * STAGE_TIME_FRACTION,
                                          memory_budget=self.options.plan_budget - reserve,
                                          memory_reserve=0.0)
        self.solves += 1
        task_state = run_passes(program, sub_options, [ExtractGraph(), BuildShardingProblem()])
        price_boundary_layouts(task_state, *boundary)
        for step in (TieRepeatedLayers(), SolveSharding()):
            step.apply(task_state)
        return task_state

    def cost(self, task, microbatches: int, sub: MeshSpec,
             boundary: tuple = ((), ()), reserve: int = 0) -> TaskFigure | None:
        """Seconds, peak bytes per device and boundary shardings of the task on `sub`, its
        boundary priced as `boundary` (price_boundary_layouts) says; None if no plan fits."""
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
            self.costs[key] = figure_of(task_state)
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
        figure = figure_of(task_state)
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
