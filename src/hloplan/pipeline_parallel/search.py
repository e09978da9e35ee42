"""The stage search: (layer range, submesh shape, microbatches) costs for the inter-op DP,
roofline lower bounds for all and the task ILPs' estimates for those the DP's best solutions
use, searched lazily (the package docstring); plan_pipeline, the entry point, plans the
winner's tasks."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from hloplan.cost_models import CommModel
from hloplan.diagnostics import UsageError
from hloplan.op_rules import (
    folded_transposes,
    fused_values,
    fuses_matmuls,
    hbm_traffic,
    matmul_kernels,
    output_fused_values,
    rule_for,
    shared_reads,
)
from hloplan.passes.cut_pipeline import CutContext, PipelineCut, cut_at, schedule
from hloplan.passes.label_batch import UNPLANNED, BatchAnalysis, state_outputs
from hloplan.pipeline_parallel import inter_op
from hloplan.pipeline_parallel.analysis import analyse, candidate_layers
from hloplan.pipeline_parallel.emit import rounded, stage_info
from hloplan.pipeline_parallel.estimate import (
    pipeline_estimate,
    reserve_bytes,
    stage_cost,
    transfer_link,
)
from hloplan.pipeline_parallel.inter_op import StageCost, SubmeshShape
from hloplan.pipeline_parallel.options import PipelineOptions
from hloplan.pipeline_parallel.tasks import (
    TaskPlan,
    TaskPlanner,
    boundary_layouts,
    plan_order,
    sub_comm,
)
from hloplan.state import CompileOptions, CompileState


@dataclass
class PipelinePlan:
    """Stages on submeshes, microbatches and every task planned: what the loader runs."""

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


@dataclass
class NoPipeline:
    """Pipelining was considered and one stage won; the candidates go into plan.json."""

    candidates: list[dict]
    search: dict = field(default_factory=dict)

    def describe(self) -> dict:
        return {"stages": 1, "microbatches": 1,
                "candidates": [rounded(c) for c in self.candidates],
                "search": rounded(self.search),
                "chosen": "single stage: no pipeline beats it under the cost model" + (
                    f" ({self.search['single_stage_only']})"
                    if self.search.get("single_stage_only") else "")}


class StageSearch:
    """Costs of (layer range, submesh shape, microbatches) for the inter-op DP: roofline lower
    bounds for all, the ILP's estimate for those the DP's best solutions use (see the package
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
        self.comms = [sub_comm(options, sub) for sub in self.subs]
        self.next_of = {out: self.graph.arguments[p]
                        for p, out in state_outputs(self.graph).items()}
        self.link = transfer_link(comm)
        self.exact: dict[tuple[int, int, int, int], StageCost | None] = {}
        self.task_keys: dict[tuple[int, int, int, int], list[tuple]] = {}
        self.lower: dict[int, list] = {}  # M -> table of lower bounds
        self._op_figures: dict[int, tuple] = {}
        # Fusion in the whole program: a task's own module fuses no more, so this stays a
        # lower bound.
        self._folded = folded_transposes(self.graph)
        matmul_fusion = fuses_matmuls(comm.model.platform)
        self._fused = fused_values(self.graph, self._folded, matmul_fusion)
        self._kept = (output_fused_values(self.graph, self._folded, matmul_fusion)
                      if matmul_fusion else set())
        self._shared = shared_reads(self.graph, self._fused | self._kept)
        # Per matmul, the elementwise ops of its kernel: the planner prices an HBM-bound
        # kernel at its traffic, its FLOPs hidden under it (build_sharding_problem's
        # _overlapped_matmuls), so the bound takes the kernel's FLOPs against all its traffic.
        self._kernel_ops = (matmul_kernels(self.graph, self._fused | self._kept)
                            if matmul_fusion else {})
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
                    moved, dims, scaled = self._moved(op), set(), False
                    for v in (*op.operands, *op.results):
                        type_ = self.graph.type_of(v)
                        if type_ is None:
                            continue
                        scaled = scaled or v in label
                        dims.update((size, label.get(v) == d) for d, size in enumerate(type_.shape))
                    # The traffic of the elementwise ops in a matmul's kernel, which may hide
                    # its FLOPs: taken off them (those ops count it themselves).
                    hidden = [moved_bytes for u in self._kernel_ops.get(op.index, ())
                              for moved_bytes in self._moved(self.graph.ops[u])]
                    figure = (rule.flops * op.multiplier, self.options.device.flops_for(dtype),
                              moved, sorted(dims), scaled, hidden)
            self._op_figures[op.index] = figure
        return self._op_figures[op.index]

    def _moved(self, op) -> list[tuple[float, bool]]:
        """(HBM bytes per step, batch-labelled) of each value the op reads or writes."""
        label = self.analysis.label
        reads, writes = hbm_traffic(self.graph, op, self._fused, folded=self._folded,
                                    shared=self._shared, kept=self._kept)
        return [(self.graph.type_of(v).nbytes * op.multiplier, v in label)
                for v, traffic in zip((*op.operands, *op.results), (*reads, *writes))
                if traffic and self.graph.type_of(v) is not None]

    def _op_seconds(self, figure, microbatches: int, axis_sizes: tuple[int, ...]) -> float:
        """A lower bound on the op's seconds on a submesh with these axes: its roofline with
        the batch split `microbatches` ways, divided by the most any strategy can split it (a
        mesh axis can only split a dimension its size divides)."""
        flops, rate, moved, dims, scaled, hidden = figure
        nbytes = sum(b / microbatches if lab else b for b, lab in moved)
        hidden_s = sum(b / microbatches if lab else b
                       for b, lab in hidden) / self.options.device.hbm_bandwidth
        sizes = {size // microbatches if batch else size for size, batch in dims}
        split = 1
        for axis in axis_sizes:
            if any(size >= axis and size % axis == 0 for size in sizes):
                split *= axis
        seconds = max(flops / (microbatches if scaled else 1) / rate - hidden_s,
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
            for task in plan_order(tasks):
                boundary = boundary_layouts(self.graph, self.analysis, task, earlier,
                                            self.next_of, microbatches)
                reserve = reserve_bytes(self.graph, self.analysis, tasks, task, microbatches,
                                   self.subs[h].size)
                figure = self.planner.cost(task, microbatches, self.subs[h], boundary, reserve)
                if figure is None:
                    break
                figures[task.index] = figure
                earlier.append((task, figure))
                keys.append(self.planner.key(task, microbatches, self.subs[h], boundary,
                                             reserve))
            else:
                cost, _ = stage_cost(self.graph, self.analysis, cut_, stage, figures,
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


def search_stages(search: StageSearch, pairs: dict[int, list[int]], schedule_kind: str,
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
    graph = state.graph
    mesh = options.mesh
    program = analyse(graph, mesh, popts)
    if program is None:
        return None
    single_only = None
    if not options.device.runs_partial_programs(mesh.size):
        single_only = (f"{options.device.name} runs no program on part of a slice of more "
                       f"than {options.device.partial_slice_devices} devices (this mesh: "
                       f"{mesh.size}): no stages on submeshes")
        if popts.stages is not None and popts.stages > 1:
            raise UsageError(f"--stages {popts.stages}: {single_only}; gradient accumulation "
                             "(--stages 1 --microbatches M) runs on every device")
        # One stage on every device, its microbatches' gradients accumulated.
        pairs = {m: [s for s in counts if s == 1] for m, counts in program.pairs.items()}
        pairs = {m: counts for m, counts in pairs.items() if counts}
        if not pairs:
            return None
        program = replace(program, pairs=pairs)
    analysis, ctx, pairs = program.analysis, program.ctx, program.pairs
    comm = CommModel(options.device, mesh, hosts=options.hosts, combine=options.device.combiner)
    starts = candidate_layers(graph, program, popts, options, comm)
    shapes = inter_op.submesh_shapes(mesh)
    planner = TaskPlanner(state, analysis, options)
    search = StageSearch(state, ctx, planner, options, comm, starts, shapes)
    explicit = (popts.stages is not None or popts.microbatches is not None) and not popts.accumulate
    bound = single_stage_seconds if (single_stage_seconds is not None and not explicit) \
        else float("inf")
    budget = options.plan_budget
    found, seen, optimal = search_stages(search, pairs, popts.schedule, budget, bound,
                                         popts.max_solves, popts.gap)
    if found is None and explicit:
        # Nothing fits the memory budget: the fastest anyway (the estimate says it does not fit).
        found, more, optimal = search_stages(search, pairs, popts.schedule, float("inf"),
                                             float("inf"), popts.max_solves, popts.gap)
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
    if single_only:
        stats["single_stage_only"] = single_only
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
        for task in plan_order(tasks):
            tp = planner.plan(task, microbatches, subs[s],
                              boundary_layouts(graph, analysis, task, done, search.next_of,
                                               microbatches),
                              reserve_bytes(graph, analysis, tasks, task, microbatches,
                                            subs[s].size))
            done.append((task, tp.figure))
            planned[task.index] = tp
    plan_tasks = [planned[task.index] for task in cut_.tasks]
    stats["ilp_solves"] = planner.solves
    estimate = pipeline_estimate(state, cut_, plan_tasks, analysis, microbatches, comm,
                                 popts.schedule, [search.comms[st.shape] for st in solution.stages])
    if single_stage_seconds is not None and not explicit and \
            single_stage_seconds <= estimate["step_time_s"]:
        return NoPipeline(candidates, stats)
    order = schedule(cut_, microbatches, popts.schedule)
    placed = inter_op.place(mesh, stage_shapes)
    submeshes = [{"axis_names": list(sub.axis_names), "axis_sizes": list(sub.axis_sizes),
                  "devices": devices, "shape": [shape.rows, shape.cols]}
                 for sub, devices, shape in zip(subs, placed, stage_shapes)]
    per_stage = stage_info(state, ctx, search, solution, cut_, estimate, submeshes)
    return PipelinePlan(stages, microbatches, popts.schedule, cut_, analysis, submeshes,
                        plan_tasks, order, estimate, candidates, per_stage, stats)


def _candidate(search: StageSearch, microbatches: int, stages, value: float,
               schedule_kind: str, budget: float) -> dict:
    costs = [search.exact[(st.start, st.end, st.shape, microbatches)] for st in stages]
    peaks = [c.memory(inter_op.in_flight(schedule_kind, microbatches, len(costs) - k))
             for k, c in enumerate(costs)]
    return {"stages": len(stages), "microbatches": microbatches,
            "submeshes": [str(search.shapes[st.shape]) for st in stages],
            "layers": [[st.start, st.end] for st in stages],
            "step_time_s": value, "peak_bytes": max(peaks), "fits": max(peaks) <= budget}
