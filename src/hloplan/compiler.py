"""The Python API behind `hloplan compile`: bytes in, a plan (files in memory) out.

The compile path, top to bottom in this file:

    compile(path | bytes)  ->  compile_bytes(data, filename, options)
        plan_on_views          the mesh as given, and its views (mesh.mesh_views)
          plan_at_mesh         one mesh: the ways below, one of them chosen
            plan_single        the program as it stands, under the budget
            plan_recomputed    with its cheap activations recomputed (passes/rematerialize.py)
            plan_pipelined     stages and microbatches as asked (--stages, --microbatches),
                               or gradient accumulation against a recomputing plan
            plan_accumulated   gradient accumulation (or the user's pipeline) where no
                               single-program plan fits
        select_compiled        (--select compiled) the model's plan, the canonical plans
                               (data parallel, FSDP) and the plan with collective-matmul loops'
                               sends counted in full, compiled by the target compiler; the
                               lowest compiled score kept
        verify                 (--verify-memory) XLA compiles the plan; plan again with a reserve
        emit                   the files of the plan kept, rendered once

Each way returns a Candidate (its state, its estimate and why it was planned) or NotApplicable
(why not, as notes for the error when no way applies). `choose` is the one rule by which a plan
is kept among candidates, at one mesh, among views and among verified plans.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import hashlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from hloplan import ir
from hloplan.cost_models import DeviceModelError, load_device_model
from hloplan.diagnostics import Diagnostic, HloplanError, NoPlanFits, UsageError
from hloplan.emit.artifact import MODULE_FILE, PLAN_FILE, REFERENCE_FILE, render, write_plan_dir
from hloplan.mesh import MESH_VIEW_CHOICES, MeshError, MeshSpec, idle_axes, mesh_views, parse_mesh
from hloplan.passes.extract_graph import ExtractGraph
from hloplan.passes.inline_calls import InlineCalls
from hloplan.passes.rematerialize import Rematerialize
from hloplan.passmanager import pass_pipeline, run_passes
from hloplan.pipeline_parallel import NoPipeline, PipelineOptions, PipelinePlan, plan_pipeline
from hloplan.plan import dumps
from hloplan.solver import clock
from hloplan.solver.evaluate import evaluate
from hloplan.state import CompileOptions, CompileState
from hloplan.units import format_bytes, format_seconds, parse_bytes

# The largest mesh hloplan plans for (a sanity bound on typos such as 1024x1024x1024).
MAX_DEVICES = 1 << 20

# A view of the mesh replaces the mesh as given only when its plan's estimated step is this
# much faster: the view renames the axes the plan's shardings and loader use.
VIEW_GAIN = 0.005

# Plans compiled by XLA (verify_memory) at most, the first one included.
VERIFY_PLANS = 4

# An estimated peak above this fraction of the budget gets a remark pointing at
# --verify-memory: XLA's allocation was 1.00-1.24 times its peak of live bytes over the
# tight-budget benchmark's plans (median 1.05), which the estimate does not model.
NEAR_BUDGET = 0.9

# How a plan is kept among candidates (CompileOptions.select).
SELECT_CHOICES = ("estimate", "compiled")

# Gradient accumulation as a way to fit the budget: one stage, any number of microbatches.
ACCUMULATE = PipelineOptions(stages=1, accumulate=True)


# ------------------------------------------------------------------------------ public API


@dataclass
class CompileResult:
    state: CompileState
    files: dict[str, bytes]
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def plan(self) -> dict:
        import json

        return json.loads(self.files["plan.json"])

    def write(self, output) -> Path:
        return write_plan_dir(output, self.files, self.timings)


def make_options(mesh: str | MeshSpec, device: str = "h100", memory_budget: str | int | None = None,
                 time_limit: float = 60.0, solver: str = "auto", hosts: int | None = None,
                 decompose: str = "auto", gap: float = 0.01, verify_memory: bool = False,
                 mesh_views: str = "auto", select: str = "estimate") -> CompileOptions:
    try:
        mesh_spec = parse_mesh(mesh) if isinstance(mesh, str) else mesh
    except MeshError as exc:
        raise UsageError(str(exc)) from None
    if mesh_spec.size > MAX_DEVICES:
        raise UsageError(f"mesh {mesh_spec} has {mesh_spec.size:,} devices; hloplan plans meshes of "
                         f"up to {MAX_DEVICES:,}")
    try:
        model = load_device_model(device)
    except DeviceModelError as exc:
        raise UsageError(str(exc)) from None
    budget = None
    if memory_budget is not None:
        try:
            budget = parse_bytes(memory_budget)
        except ValueError as exc:
            raise UsageError(f"--memory-budget: {exc}") from None
    if solver not in ("auto", "cbc", "highs"):
        raise UsageError(f"unknown solver {solver!r} (auto, cbc, highs)")
    if not 0 < time_limit < float("inf"):  # also refuses nan
        raise UsageError(f"--time-limit {time_limit}: expected a positive number of seconds")
    if not 0 <= gap < 1:
        raise UsageError(f"--gap {gap}: expected a fraction in [0, 1), e.g. 0.01 for 1%")
    if decompose not in ("auto", "always", "never"):
        raise UsageError(f"unknown decompose {decompose!r} (auto, always, never)")
    if mesh_views not in MESH_VIEW_CHOICES:
        raise UsageError(f"unknown mesh views {mesh_views!r} ({', '.join(MESH_VIEW_CHOICES)})")
    if select not in SELECT_CHOICES:
        raise UsageError(f"unknown --select {select!r} ({', '.join(SELECT_CHOICES)})")
    if hosts is not None and (hosts < 1 or mesh_spec.size % hosts):
        raise UsageError(f"--hosts {hosts} does not divide the {mesh_spec.size} devices of the mesh")
    return CompileOptions(mesh=mesh_spec, device=model, memory_budget=budget,
                          time_limit=time_limit, solver=solver, hosts=hosts, decompose=decompose,
                          gap=gap, verify_memory=verify_memory, mesh_views=mesh_views,
                          select=select)


def compile(path_or_bytes, mesh: str | MeshSpec, output: str | None = None, **kwargs) -> CompileResult:
    """Plan an exported JAX program for a mesh; write the plan directory when `output` is given."""
    if isinstance(path_or_bytes, (bytes, bytearray)):
        data, filename = bytes(path_or_bytes), "<input>"
    else:
        filename = str(path_or_bytes)
        try:
            data = Path(filename).read_bytes()
        except OSError as exc:
            raise UsageError(f"cannot read {filename}: {exc.strerror}") from None
    pipeline = kwargs.pop("pipeline", None)
    donate = kwargs.pop("donate", "export")  # extract-graph.donate: export, state or none
    passes = None
    if donate != "export":
        passes = [dataclasses.replace(step, donate=donate) if isinstance(step, ExtractGraph)
                  else step for step in pass_pipeline()]
    result = compile_bytes(data, filename, make_options(mesh, **kwargs), pipeline=pipeline,
                           passes=passes)
    if output is not None:
        result.write(output)
    return result


def compile_bytes(data: bytes, filename: str, options: CompileOptions, after_pass=None,
                  pipeline: PipelineOptions | None = None, passes: list | None = None
                  ) -> CompileResult:
    """Plan `data`; with `pipeline` options, also consider (or force) pipeline stages and
    microbatches, keeping whichever plan the cost model prefers. `passes`: the pass pipeline
    with some passes' options changed (default: passmanager.pass_pipeline()). `after_pass`:
    called with (pass name, state) after each pass of the single-program plans."""
    job = Job(Source(data, filename), pipeline, passes, after_pass)
    # Every solve of the compile is watched: one the clock cut may have decided which plan is
    # kept (a candidate, view or stage plan dropped; tying's comparison) though the kept plan's
    # own solve was not cut.
    with _cyclic_gc_paused(), clock.watch() as cuts:
        chosen, views = plan_on_views(job, options)
        selected = None
        if options.select == "compiled":
            selected = select_compiled(job, dataclasses.replace(options, mesh=chosen.mesh), chosen)
            chosen = selected.rendered.candidate
        checked = None
        if options.verify_memory:
            checked = verify(job, chosen, dataclasses.replace(options, mesh=chosen.mesh))
        return emit(job, chosen, views, checked, selected, cuts)


# ------------------------------------------------------------------------------ what is planned


class Source:
    """The program as given. Every plan starts from a fresh parse (passes change the module);
    the first parse also gives the text the reference program is rebuilt from (None when the
    input is a serialized Exported: that one is its own reference)."""

    def __init__(self, data: bytes, filename: str):
        self.data, self.filename = data, filename
        self.original_text: str | None = None
        self._parsed = False

    def load(self) -> tuple[ir.Program, float]:
        """A fresh parse, and the seconds it took."""
        started = time.perf_counter()
        program = ir.load_program(self.data, self.filename)
        seconds = time.perf_counter() - started
        if not self._parsed:
            self._parsed = True
            if program.exported is None:
                self.original_text = ir.module_text(program.module)
        return program, seconds


@dataclass(frozen=True)
class Job:
    """What compile_bytes was asked, beside the options (which the ways vary: the mesh, the
    memory reserve)."""

    source: Source
    pipeline: PipelineOptions | None  # the user's --stages/--microbatches/..., if any
    passes: list | None  # the pass pipeline (None: pass_pipeline())
    after_pass: Callable[[str, CompileState], None] | None


@dataclass(frozen=True)
class Estimate:
    step_seconds: float  # of the plan the loader runs
    peak_bytes: float  # per device (a pipeline's: its largest stage's)


@dataclass(frozen=True)
class Candidate:
    """A plan of the program, not rendered yet. `state` is the single-program plan that
    module.mlir and sharded.jaxexport hold; with a pipeline, plan.json's pipeline section is
    what the loader runs (PipelinePlan) or the pipeline search that lost to it (NoPipeline)."""

    way: str  # "single", "recomputed", "pipelined" or "accumulated"
    state: CompileState
    estimate: Estimate
    why: str  # how it was planned, in words (the diagnostics that report the choice)
    pipeline: PipelinePlan | NoPipeline | None = None
    pipeline_state: CompileState | None = None  # the program the pipeline was cut from
    forced: bool = False  # the user's --stages/--microbatches: kept over any other plan
    notes: tuple[Diagnostic, ...] = ()  # what plan.json and the CLI say of the choice
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def mesh(self) -> MeshSpec:
        return self.state.options.mesh


@dataclass(frozen=True)
class NotApplicable:
    """A way that gives no plan: why not, as notes for the error when no way applies. `record`:
    a pipeline search that found one stage best (plan.json reports it with the plan kept)."""

    way: str
    notes: tuple[Diagnostic, ...] = ()
    error: HloplanError | None = None  # what the way raised (NoPlanFits: nothing fits)
    record: NoPipeline | None = None
    record_state: CompileState | None = None


def choose(candidates: Sequence[Candidate]) -> Candidate:
    """The one rule by which a plan is kept among candidates that fit: a plan the user forced
    (--stages/--microbatches) over any other, then the fastest estimated step; the first of
    equals."""
    return min(candidates, key=lambda c: (not c.forced, c.estimate.step_seconds))


# ------------------------------------------------------------------------------ mesh views


def plan_on_views(job: Job, options: CompileOptions) -> tuple[Candidate, dict | None]:
    """Plan the mesh as given and then each of its views (mesh.mesh_views), keeping the
    fastest estimate; a view must beat the mesh as given by VIEW_GAIN. Returns the plan and
    what was tried (None when no view was planned). Views are planned only after a
    single-program plan on the mesh as given that is not within VIEW_GAIN of view_floor:
    not when it accumulates gradients, recomputes activations, is pipelined (or pipeline
    options are given) or fails; those searches (microbatches, stages and submeshes) are made
    on the mesh as given. A view is planned as one program, as the mesh as given was."""
    views = mesh_views(options.mesh, options.mesh_views)
    if len(views) == 1 or job.pipeline is not None:
        return plan_at_mesh(job, options), None
    started = time.perf_counter()
    given = plan_at_mesh(job, options)
    given_seconds = time.perf_counter() - started
    step = given.estimate.step_seconds
    recomputes = given.state.facts.get("rematerialized", {}).get("values")
    if given.way != "single" or recomputes or view_floor(given.state) >= (1 - VIEW_GAIN) * step:
        # No view's plan can be VIEW_GAIN faster, or the plan accumulates gradients or
        # recomputes to fit (a search of its own, not repeated per view).
        return given, None
    tried = [_view_entry(options.mesh, given)]
    seconds = [given_seconds]
    faster: list[tuple[Candidate, int]] = []  # the views' plans VIEW_GAIN faster, by index
    for view in views[1:]:
        started = time.perf_counter()
        way = plan_single(job, dataclasses.replace(options, mesh=view))
        seconds.append(time.perf_counter() - started)
        if isinstance(way, NotApplicable):
            tried.append({**_view_entry(view), "no_plan": way.error.diagnostics[0].message})
            continue
        tried.append(_view_entry(view, way))
        if way.estimate.step_seconds < (1 - VIEW_GAIN) * step:
            faster.append((way, len(tried) - 1))
    chosen = choose([given, *(c for c, _ in faster)])
    index = next((i for c, i in faster if c is chosen), 0)
    timings = {**chosen.timings, "mesh_views": sum(seconds) - seconds[index]}
    return (dataclasses.replace(chosen, timings=timings),
            {"tried": tried, "chosen": index, "given": tried[0]})


def _view_entry(mesh: MeshSpec, candidate: Candidate | None = None) -> dict:
    entry = {"mesh": str(mesh), "axis_names": list(mesh.axis_names),
             "axis_sizes": list(mesh.axis_sizes)}
    if candidate is not None:
        entry["step_time_s"] = _round(candidate.estimate.step_seconds)
        entry["peak_bytes"] = int(candidate.estimate.peak_bytes)
    return entry


def view_floor(state: CompileState) -> float:
    """A lower bound on the estimated step of any single-program plan of the program on the
    same number of devices, on whatever mesh: per op, its cheapest strategy here (compute and
    communication) or its replicated work split over every device, whichever is less;
    resharding none."""
    devices = state.options.mesh.size
    return sum(min(min(s.compute_cost + s.communication_cost for s in node.strategies),
                   max(s.compute_cost for s in node.strategies) / devices)
               for node in state.problem.nodes)


# ------------------------------------------------------------------------------ one mesh


def plan_at_mesh(job: Job, options: CompileOptions) -> Candidate:
    """The plan kept on one mesh. The program as it stands, if a plan fits the budget; else
    with its activations recomputed; with the user's pipeline options, the pipelined plan
    against that; without them, when recomputing was needed, gradient accumulation against
    it; when neither fits, gradient accumulation (or the user's pipeline) alone. Raises
    NoPlanFits, with a note per way tried, when nothing fits."""
    single = plan_single(job, options)
    if isinstance(single, Candidate) and job.pipeline is None:
        return single
    base = single if isinstance(single, Candidate) else plan_recomputed(job, options)
    started = time.perf_counter()
    if isinstance(base, NotApplicable):  # no single-program plan fits
        way = plan_accumulated(job, options, job.pipeline or ACCUMULATE)
        if isinstance(way, NotApplicable):
            raise NoPlanFits(list(single.error.diagnostics) + list(base.notes) + list(way.notes))
        return _with_pipeline_time(way, started)
    if job.pipeline is not None:
        way = plan_pipelined(job, options, base, job.pipeline)
    else:  # recomputing fits: accumulating gradients on the program as it stands may be faster
        try:
            way = plan_pipelined(job, options, base, ACCUMULATE)
        except HloplanError as error:  # e.g. a batch that cannot be split
            way = NotApplicable("accumulated", error=error)
    if isinstance(way, Candidate):
        chosen = choose([base, way])
    else:
        chosen = dataclasses.replace(base, pipeline=way.record, pipeline_state=way.record_state)
    if job.pipeline is None:
        chosen = _report_recomputing(chosen, base, way)
    return _with_pipeline_time(chosen, started)


def _with_pipeline_time(candidate: Candidate, started: float) -> Candidate:
    return dataclasses.replace(candidate, timings={
        **candidate.timings, "pipeline": time.perf_counter() - started})


def plan_single(job: Job, options: CompileOptions) -> Candidate | NotApplicable:
    """The program as it stands, planned under the budget by the pass pipeline."""
    program, parse_seconds = job.source.load()
    try:
        state = run_passes(program, options, job.passes, after_pass=job.after_pass)
    except NoPlanFits as error:
        return NotApplicable("single", error=error)
    return _single_candidate("single", state, parse_seconds, "the program as it stands")


def plan_recomputed(job: Job, options: CompileOptions) -> Candidate | NotApplicable:
    """The program with its cheap activations recomputed in the backward pass
    (passes/rematerialize.py: all that pay, unless the pass's free_fraction asks for fewer),
    planned under the budget. Not applicable when nothing is recomputed or no plan fits even
    so (with a note saying how far recomputing got).

    Recomputing only what the budget needs was measured (free 1.5 times the shortfall, as a
    fraction of the unsharded peak, then 3 times that): 26 of the 30 tight-budget cases fit
    against 28, the plans left with little headroom meeting the estimate's known gaps on CPU
    (llama 4x8 compiled 9.74 GiB against 9.19; ResNet 16x8x8 17.9 against 8.34)."""
    steps = [dataclasses.replace(step, enabled=True) if isinstance(step, Rematerialize) else step
             for step in (job.passes if job.passes is not None else pass_pipeline())]
    program, parse_seconds = job.source.load()
    facts: dict = {}

    def keep_facts(name: str, state: CompileState) -> None:
        facts.update(state.facts)
        if job.after_pass is not None:
            job.after_pass(name, state)

    try:
        state = run_passes(program, options, steps, after_pass=keep_facts)
    except NoPlanFits as error:
        done = facts.get("rematerialized", {})
        if not done.get("values"):
            return NotApplicable("recomputed")
        smallest = error.min_peak
        return NotApplicable("recomputed", notes=(Diagnostic(
            "note", f"nor with {done['values']} activations recomputed after the forward pass"
            + (f" (smallest peak {format_bytes(smallest)} before resharded copies)"
               if smallest else ""), None),))
    done = state.facts.get("rematerialized", {})
    if not done.get("values"):
        return NotApplicable("recomputed")
    why = (f"{done['values']} activations are recomputed after the forward pass "
           f"({done['ops']} cheap ops cloned; {format_bytes(done['freed_bytes'])} fewer "
           "live at the unsharded peak)")
    return _single_candidate("recomputed", state, parse_seconds, why)


def _single_candidate(way: str, state: CompileState, parse_seconds: float, why: str
                      ) -> Candidate:
    evaluation = evaluate(state.problem, state.solution)
    return Candidate(way, state, Estimate(evaluation.total, evaluation.peak_memory), why,
                     timings={"parse": parse_seconds, **state.timings})


def plan_pipelined(job: Job, options: CompileOptions, single: Candidate | None,
                   popts: PipelineOptions) -> Candidate | NotApplicable:
    """Stages and microbatches (popts: the user's, or ACCUMULATE), planned on a fresh copy of
    the program (the single-program state's module already carries its own shardings) and
    bounded by `single`'s step unless the user gave the counts. Not applicable when one stage
    wins (the search's record goes with the plan kept) or nothing was planned."""
    program, _ = job.source.load()
    # Composites decomposed: the cut rebuilds ops with the microbatch's smaller batch.
    state = run_passes(program, options, [InlineCalls(composites=True), ExtractGraph()])
    single_seconds = None if single is None else single.estimate.step_seconds
    plan_ = plan_pipeline(state, options, popts, single_seconds)
    if not isinstance(plan_, PipelinePlan):
        return NotApplicable("pipelined", record=plan_,
                             record_state=state if plan_ is not None else None)
    estimate = plan_.estimate
    what = (f"{'accumulating gradients over' if plan_.stages == 1 else 'pipelined with'} "
            f"{plan_.microbatches} microbatches"
            + (f" in {plan_.stages} stages" if plan_.stages > 1 else "")
            + f" (peak {format_bytes(max(estimate['memory_per_stage_bytes']))} per device, "
            f"step {format_seconds(estimate['step_time_s'])})")
    explicit = (popts.stages is not None or popts.microbatches is not None) and not popts.accumulate
    return Candidate(
        "accumulated" if popts.accumulate else "pipelined",
        single.state if single is not None else state,
        Estimate(estimate["step_time_s"], max(estimate["memory_per_stage_bytes"])), what,
        pipeline=plan_, pipeline_state=state, forced=explicit,
        timings=dict(single.timings) if single is not None else {})


def plan_accumulated(job: Job, options: CompileOptions, popts: PipelineOptions
                     ) -> Candidate | NotApplicable:
    """No single-program plan fits the memory budget: the user's pipeline options if given,
    else gradient accumulation (ACCUMULATE: one stage, the fastest number of microbatches that
    fits: each microbatch's activations are 1/M of the batch's). module.mlir and
    sharded.jaxexport then hold the fastest single-program plan without a budget, which does
    not fit; plan.json's pipeline section is the plan the loader runs."""
    filename = job.source.filename
    try:
        way = plan_pipelined(job, options, None, popts)
    except HloplanError as why:
        return NotApplicable("accumulated", notes=(Diagnostic(
            "note", "nor can it accumulate gradients over microbatches: "
            + why.diagnostics[0].format(filename), None),))
    if isinstance(way, Candidate):
        if way.estimate.peak_bytes > options.plan_budget:
            return NotApplicable("accumulated", notes=(Diagnostic(
                "note", "no plan fits with the given --stages/--microbatches either (estimated "
                f"peak {format_bytes(way.estimate.peak_bytes)})", None),))
        # The single-program files: the fastest plan without a budget. plan.json reports
        # the user's budget, against which the accumulated plan was made.
        program, parse_seconds = job.source.load()
        unbounded = run_passes(program, dataclasses.replace(
            options, memory_budget=float("inf")), job.passes)
        state = dataclasses.replace(unbounded, options=options)
        return dataclasses.replace(way, state=state, notes=(Diagnostic(
            "warning", f"no single-program plan fits the memory budget of "
            f"{format_bytes(options.budget)} per device; {way.why}", None,
            ("the fastest single-program plan, which does not fit, is in module.mlir and "
             "sharded.jaxexport; hloplan.load runs the accumulated plan",)),),
            timings={"parse": parse_seconds, **unbounded.timings})
    plan_ = way.record
    if job.pipeline is not None:
        what = "with the given --stages/--microbatches either"
    elif plan_ is None:
        what = "by accumulating gradients either: no batch input to split"
    else:
        tried = sorted(int(m) for m in plan_.search["microbatches_stages"])
        what = f"by accumulating gradients over {tried[0]} to {tried[-1]} microbatches either"
        if plan_.candidates:
            best = min(plan_.candidates, key=lambda c: c["peak_bytes"])
            what += (f" (smallest estimated peak {format_bytes(best['peak_bytes'])}, with "
                     f"{best['microbatches']} microbatches)")
        elif plan_.search.get("unfit_task_peaks"):
            unfit = plan_.search["unfit_task_peaks"]
            least = min(unfit, key=lambda t: (t["part"] != "A", t["bytes"] + t["held"]))
            what += (f": the {'per-microbatch' if least['part'] == 'A' else 'once-per-step'}"
                     f" task needs at least {format_bytes(least['bytes'])} (with "
                     f"{least['microbatches']} microbatches) beside at least "
                     f"{format_bytes(least['held'])} the loader holds for the step "
                     "(optimizer state, gradient sums, the batch)")
    return NotApplicable("accumulated", notes=(Diagnostic("note", f"no plan fits {what}", None),))


def _report_recomputing(chosen: Candidate, recomputed: Candidate,
                        accumulated: Candidate | NotApplicable) -> Candidate:
    """The warning that says why the plan kept on a mesh is not the program as it stands:
    its activations are recomputed (and why gradient accumulation, the other way to fit, was
    not planned, where it was refused), or gradients accumulated where recomputing fits too."""
    budget = format_bytes(recomputed.state.options.budget)
    if chosen.way == "recomputed":
        refused = ()
        if isinstance(accumulated, NotApplicable) and accumulated.error is not None:
            why = accumulated.error.diagnostics[0]
            where = f"{why.location}: " if why.location else ""
            refused = (f"gradients are not accumulated instead: {where}{why.message}",)
        note = Diagnostic(
            "warning", f"no plan fits the memory budget of {budget} per device as the program "
            f"stands: {recomputed.why}", None,
            ("module.mlir and sharded.jaxexport hold the recomputing program", *refused))
    else:
        note = Diagnostic(
            "warning", f"no plan fits the memory budget of {budget} per device as the program "
            f"stands; {chosen.why}", None,
            (f"faster than the single program in which {recomputed.why}, which fits too (step "
             f"{format_seconds(recomputed.estimate.step_seconds)}; in module.mlir and "
             "sharded.jaxexport); hloplan.load runs the accumulated plan",))
    return dataclasses.replace(chosen, notes=(*chosen.notes, note))


# ------------------------------------------------------------------------------ verification


@dataclass(frozen=True)
class Rendered:
    """A candidate's files, plan.json still a dict (the driver adds what it decided)."""

    candidate: Candidate
    plan: dict
    files: dict[str, bytes]
    seconds: float


@dataclass(frozen=True)
class Verified:
    rendered: Rendered  # the plan kept: the fastest whose compiled allocation fits
    memory_check: dict  # plan.json "memory_check": every try
    seconds: float  # all tries' XLA compiles


def verify(job: Job, first: Candidate, options: CompileOptions) -> Verified:
    """Compile the plan's programs with XLA (verify.py). While no plan's allocation is within
    the budget, plan again keeping free (CompileOptions.memory_reserve) what the last one
    needed beyond its estimate plus 1% of the budget; once one fits, halve the gap between the
    largest reserve found too small and the smallest that fits (a plan of another kind, found
    under a smaller reserve, may fit and be faster), up to VERIFY_PLANS plans in all. The
    fastest plan that fits is kept; plan.json "memory_check" records every try."""
    from hloplan.verify import checked_peak, measure_files, resolve_target

    target = resolve_target(options.device, options.mesh.size)  # libtpu for a TPU model
    notes = [target.note] if target.note else []
    budget = options.budget
    tries: list[dict] = []
    fitting: list[tuple[Candidate, Rendered, int]] = []  # (plan, its files, its try)
    seen: dict[str, tuple] = {}  # hash of a plan's programs -> (first try, their allocations)
    verify_seconds = 0.0
    too_small = 0.0  # the largest reserve whose plan compiled over the budget
    fits_at = None  # the smallest reserve whose plan fit, or under which none could be planned
    reserve = 0.0
    candidate = first
    for attempt in range(VERIFY_PLANS):
        if attempt:
            try:
                candidate = plan_at_mesh(job, dataclasses.replace(options, memory_reserve=reserve))
            except NoPlanFits:  # a reserve too large to plan under bounds the search too
                tries.append({"reserve_bytes": reserve, "no_plan": True})
                fits_at = reserve
                reserve = (too_small + reserve) / 2
                continue
        rendered = render_candidate(job, candidate)
        started = time.perf_counter()
        # The programs XLA compiles (the single program, or the pipeline's tasks); the same
        # programs again are not compiled again.
        key = hashlib.sha256(b"".join(
            name.encode() + b"\0" + body for name, body in sorted(rendered.files.items())
            if name.endswith(".jaxexport") and name != REFERENCE_FILE)).hexdigest()
        if key not in seen:
            files = {**rendered.files, PLAN_FILE: dumps(rendered.plan).encode()}
            seen[key] = (len(tries), measure_files(files, options.mesh.size, target=target,
                                                   notes=notes))
        first_try, measured = seen[key]
        check = checked_peak(rendered.plan, measured)
        check["step_time_s"] = _round(candidate.estimate.step_seconds)
        if first_try != len(tries):
            check["same_as"] = first_try
        check["reserve_bytes"] = reserve
        tries.append(check)
        verify_seconds += time.perf_counter() - started
        if check["peak_bytes"] <= budget:
            fitting.append((candidate, rendered, len(tries) - 1))
            fits_at = reserve
        else:
            too_small = max(too_small, reserve)
        if fits_at is None:
            # Nothing fits yet: keep free what XLA needed beyond this plan's estimate, so that
            # a plan estimated within the rest compiles within the budget if the excess stays.
            # (What the plan was over by is less: a plan estimated under the budget had that
            # free already, and the same plan could come back.)
            reserve = (max(reserve, check["peak_bytes"] - check["estimated_bytes"])
                       + 0.01 * budget)
        else:
            if fits_at - too_small < 0.02 * budget:
                break
            reserve = (too_small + fits_at) / 2
    if not fitting:
        raise _unverified(tries, budget)
    kept = choose([c for c, _, _ in fitting])
    _, rendered, index = next(f for f in fitting if f[0] is kept)
    for note in notes:
        kept.state.log.remark(f"--verify-memory: {note}")
    return Verified(rendered, {**target.describe(), "notes": notes, "tries": tries,
                               "kept": index}, verify_seconds)


def _unverified(tries: list[dict], budget: float) -> NoPlanFits:
    """No plan whose compiled allocation is within the budget: what each try compiled to."""
    notes = tuple(
        f"plan {i + 1}, with {format_bytes(t['reserve_bytes'])} kept free: "
        + ("no plan fits" if t.get("no_plan") else
           f"estimated {format_bytes(t['estimated_bytes'])}, XLA compiles it to "
           f"{format_bytes(t['peak_bytes'])}")
        for i, t in enumerate(tries))
    return NoPlanFits([Diagnostic(
        "error", f"no plan that XLA compiles within the memory budget of {format_bytes(budget)} "
        "per device (--verify-memory)", None,
        notes + ("raise --memory-budget or use a larger mesh",))],
        min(t["peak_bytes"] for t in tries if "peak_bytes" in t))


# ------------------------------------------------------------------------------ --select compiled


@dataclass(frozen=True)
class Selected:
    rendered: Rendered  # the candidate kept, rendered
    record: dict  # plan.json "selection"
    seconds: float  # planning the canonical plans and compiling every candidate


def plan_canonical(job: Job, options: CompileOptions, kind: str) -> Candidate | NotApplicable:
    """A canonical plan (canonical.py: "dp" or "fsdp"), solved as a restriction of the same ILP
    under the budget. The data-parallel plan leaves its replicated values unconstrained
    (PropagateSharding.constrain_replicated)."""
    from hloplan.passes.propagate_sharding import PropagateSharding
    from hloplan.passes.solve_sharding import SolveSharding

    steps = []
    for step in (job.passes if job.passes is not None else pass_pipeline()):
        if isinstance(step, SolveSharding):
            step = dataclasses.replace(step, canonical=kind)
        elif isinstance(step, PropagateSharding) and kind == "dp":
            step = dataclasses.replace(step, constrain_replicated=False)
        steps.append(step)
    program, parse_seconds = job.source.load()
    try:
        state = run_passes(program, options, steps)
    except NoPlanFits as error:
        return NotApplicable(kind, error=error)
    why = {"dp": "data parallel: the batch over every mesh axis, the rest replicated",
           "fsdp": "FSDP: the batch over every mesh axis, parameters, gradients and optimizer "
                   "state split over every mesh axis"}[kind]
    return _single_candidate(kind, state, parse_seconds, why)


def _priced_alike_serial(state: CompileState) -> bool:
    """Whether the plan in `state` is also a plan of the same problem with the loops' sends
    counted in full: it counts none of them as hidden, so it costs the same, and no strategy
    of the problem counts a negative share (a loop whose last two chunks' sends outlast the
    reduce-scatter it replaces), so counting them in full lowers no other plan's cost."""
    space = state.space
    if space is None or state.solution is None:
        return False
    if any(state.chosen(index).hidden for index in space.strategies):
        return False
    return all(s.hidden >= 0.0 for strategies in space.strategies.values() for s in strategies)


def plan_serial_loops(job: Job, options: CompileOptions,
                      chosen: Candidate | None = None) -> Candidate | NotApplicable | None:
    """The program planned with the device model's collective-matmul loops' sends counted in
    full (DeviceModel.collective_matmul_overlap = 0), as the compiled score counts them; None
    where the device model runs no such loop or counts their sends so already on the plan's
    slice. `chosen` (the model's single-program plan) is returned where it is such a plan
    already (_priced_alike_serial): planning again could only find one of equal cost."""
    device = options.device
    if not device.collective_matmul or device.collective_matmul_overlap_on(
            options.mesh.size) == 0.0:
        return None
    if chosen is not None and chosen.way == "single" and _priced_alike_serial(chosen.state):
        return chosen
    serial = dataclasses.replace(
        options, device=dataclasses.replace(device, collective_matmul_overlap=0.0))
    program, parse_seconds = job.source.load()
    try:
        state = run_passes(program, serial, job.passes)
    except NoPlanFits as error:
        return NotApplicable("serial-loops", error=error)
    return _single_candidate("single", state, parse_seconds,
                             "the program as it stands, the loops' sends counted in full")


def select_compiled(job: Job, options: CompileOptions, chosen: Candidate) -> Selected:
    """--select compiled: the model's plan, the canonical plans (a single program each) and the
    plan that counts collective-matmul loops' sends in full (plan_serial_loops; where it differs
    from the model's) compiled by the target compiler (verify.resolve_target: libtpu for a TPU
    device model when installed, else XLA's CPU compiler on simulated devices), each scored on
    its compiled HLO (score.compiled_score, with the device model's figures); the lowest score
    among those whose compiled peak is within the budget is kept (the model's plan when none
    is)."""
    from hloplan.canonical import CANONICAL
    from hloplan.verify import TIMEOUT_S, VerifyError, _run_child, resolve_target

    started = time.perf_counter()
    target = resolve_target(options.device, options.mesh.size)
    if isinstance(chosen.pipeline, PipelinePlan):  # stages or microbatches: not one program
        return Selected(render_candidate(job, chosen), {
            **target.describe(), "score_device": options.device.name, "notes": [],
            "candidates": [{"name": "model", "way": chosen.way}], "chosen": "model",
            "why": "a pipelined or accumulating plan: kept without comparing compiled plans"},
            time.perf_counter() - started)
    device = options.device.source
    if not device or device.startswith(("package:", "<")):
        device = options.device.name
    candidates: list[Candidate] = [chosen]
    entries: list[dict] = [{"name": "model", "way": chosen.way}]
    if chosen.way == "single":  # the canonical plans do not recompute
        for kind in CANONICAL:
            way = plan_canonical(job, options, kind)
            if isinstance(way, Candidate):
                candidates.append(way)
                unrestricted = way.state.facts.get("canonical", {}).get("unrestricted_nodes", 0)
                entries.append({"name": kind, "way": kind, "unrestricted_nodes": unrestricted})
            else:
                entries.append(_no_plan_entry(kind, way))
        serial = plan_serial_loops(job, options, chosen)
        if isinstance(serial, Candidate):
            candidates.append(serial)
            entries.append({"name": "serial-loops", "way": "single"})
        elif serial is not None:
            entries.append(_no_plan_entry("serial-loops", serial))
    notes = [target.note] if target.note else []
    scored: list[tuple[float, Candidate, Rendered, dict]] = []
    budget = options.budget
    plans = iter(candidates)
    modules: dict[bytes, str] = {}  # module.mlir of each candidate rendered -> its name
    for entry in entries:
        if "no_plan" in entry:
            continue
        candidate = next(plans)
        entry["estimated_step_s"] = _round(candidate.estimate.step_seconds)
        entry["estimated_peak_bytes"] = int(candidate.estimate.peak_bytes)
        if entry["name"] == "serial-loops":
            # Its module.mlir, compared before rendering (which exports the sharded program).
            same = modules.get(ir.module_text(candidate.state.program.module).encode())
            if same is not None:
                entry["same_plan_as"] = same  # not rendered nor compiled again
                continue
        rendered = render_candidate(job, candidate)
        modules.setdefault(rendered.files[MODULE_FILE], entry["name"])
        files = {**rendered.files, PLAN_FILE: dumps(rendered.plan).encode()}
        try:
            result = _compile_files(files, target, device, TIMEOUT_S, _run_child)
        except VerifyError as exc:
            entry["compile_error"] = exc.diagnostics[0].message
            continue
        notes.extend(n for n in result["notes"] if n not in notes)
        score = result["details"]["program"]["score"]
        peak = int(result["programs"]["program"])
        entry.update(compiled_step_s=_round(score["step_s"]),
                     compiled_kernels_s=_round(score["kernels_s"]),
                     compiled_communication_s=_round(score["communication_s"]),
                     compiled_peak_bytes=peak, fits=peak <= budget)
        if peak <= budget:
            scored.append((score["step_s"], candidate, rendered, entry))
    if scored:
        best = min(scored, key=lambda s: s[0])
        kept, rendered, entry = best[1], best[2], best[3]
        others = [s for s in scored if s[1] is not kept]
        why = (f"lowest compiled score ({format_seconds(best[0])})" + (
            "; " + ", ".join(f"{s[3]['name']} {format_seconds(s[0])}" for s in others)
            if others else ""))
    else:  # nothing compiled within the budget: the model's choice stands
        kept, entry = chosen, entries[0]
        rendered = render_candidate(job, chosen)
        why = "no candidate compiled within the budget: the cost model's plan"
    record = {**target.describe(), "score_device": options.device.name, "notes": notes,
              "candidates": entries, "chosen": entry["name"], "why": why}
    return Selected(rendered, record, time.perf_counter() - started)


def _no_plan_entry(name: str, way: NotApplicable) -> dict:
    """plan.json's selection entry of a candidate that gave no plan: why not."""
    return {"name": name,
            "no_plan": way.error.diagnostics[0].message if way.error else "not planned"}


def _compile_files(files: dict[str, bytes], target, device: str, timeout: float, run) -> dict:
    import tempfile

    with tempfile.TemporaryDirectory(prefix="hloplan-select-") as tmp:
        for name, data in files.items():
            path = Path(tmp) / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
        return run(tmp, target, timeout, details=True, score_device=device)


def _selection_remark(state: CompileState, record: dict) -> Diagnostic:
    """Logged: which candidate --select compiled kept, and why."""
    compiled = [c for c in record["candidates"] if "compiled_step_s" in c]
    if not compiled:
        state.log.remark(f"--select compiled: {record['why']}")
        return state.log.entries[-1]
    state.log.remark(
        f"--select compiled: kept the {record['chosen']} plan of {len(compiled)} compiled by "
        f"XLA's {record['platform'].upper()} compiler"
        + (f" ({record['topology']})" if record.get("topology") else "") + f": {record['why']}")
    return state.log.entries[-1]


# ------------------------------------------------------------------------------ emission


def render_candidate(job: Job, candidate: Candidate) -> Rendered:
    """The candidate's files, with what the driver says of it in its diagnostics: why it was
    chosen, and (without --verify-memory) a remark when its peak is near the budget."""
    state = candidate.state
    _warn_idle_axes(state)
    for note in candidate.notes:
        state.log.entries.append(note)
    if not state.options.verify_memory:
        _remark_near_budget(state, candidate.estimate.peak_bytes)
    started = time.perf_counter()
    pipelined = None
    if candidate.pipeline is not None or candidate.pipeline_state is not None:
        pipelined = (candidate.pipeline, candidate.pipeline_state)
    plan, files = render(state, job.source.data, job.source.original_text, pipelined)
    return Rendered(candidate, plan, files, time.perf_counter() - started)


def _warn_idle_axes(state: CompileState) -> None:
    mesh = state.options.mesh
    idle = idle_axes(mesh, [v.type.shape for v in state.graph.values if v.type is not None])
    if idle:
        sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
        axes = ", ".join(f"{a}={sizes[a]}" for a in idle)
        state.log.warn(f"mesh {'axis' if len(idle) == 1 else 'axes'} {axes} "
                       f"{'divides' if len(idle) == 1 else 'divide'} no dimension of any tensor "
                       "of the program: the plan replicates over "
                       f"{'it' if len(idle) == 1 else 'them'}",
                       notes=("choose axis sizes that divide the batch or hidden dimensions",))


def _remark_near_budget(state: CompileState, peak: float) -> None:
    budget = state.options.budget
    if NEAR_BUDGET * budget < peak <= budget:
        state.log.remark(
            f"the estimated peak, {format_bytes(peak)} per device, is {peak / budget:.0%} of the "
            "memory budget, and XLA's allocation can exceed the estimate (it packs "
            "temporaries into one allocation, with gaps): --verify-memory compiles the plan "
            "and checks it")


def emit(job: Job, chosen: Candidate, views: dict | None, checked: Verified | None,
         selected: Selected | None = None, cuts: Sequence[str] = ()) -> CompileResult:
    """The plan kept, rendered once (--verify-memory or --select compiled rendered it to
    compile it), with the views tried, the candidates compiled and the memory check in
    plan.json; plan.json dumped last. `cuts`: the solves of the compile that the time limit
    cut (clock.watch); plan.json says the plan is not deterministic when there is one."""
    if checked is not None:
        rendered = checked.rendered
    elif selected is not None:
        rendered = selected.rendered
    else:
        rendered = render_candidate(job, chosen)
    candidate, plan, files = rendered.candidate, rendered.plan, dict(rendered.files)
    state = candidate.state
    timings = {**candidate.timings, "emit": rendered.seconds}
    if state.stats is not None:
        timings["solver_seconds"] = state.stats.seconds
    if views is not None:
        timings["mesh_views"] = chosen.timings["mesh_views"]
        plan["mesh_views"] = {"tried": views["tried"], "chosen": views["chosen"]}
        if views["chosen"]:
            plan["mesh"]["view_of"] = {"axis_names": views["given"]["axis_names"],
                                       "axis_sizes": views["given"]["axis_sizes"]}
            plan["diagnostics"].append(_view_remark(state, views).to_json())
    if selected is not None:
        timings["select"] = selected.seconds
        plan["selection"] = dict(selected.record)
        if checked is not None and checked.rendered.candidate is not selected.rendered.candidate:
            plan["selection"]["superseded"] = ("the plan kept compiled over the memory budget: "
                                               "--verify-memory planned again (memory_check)")
        if checked is None:
            plan["diagnostics"].append(_selection_remark(state, selected.record).to_json())
    if checked is not None:
        timings["verify"] = checked.seconds
        plan["memory_check"] = checked.memory_check
    solver = plan.get("solver")
    if cuts and solver is not None and solver.get("deterministic", True):
        # The kept plan's own solves were not cut (solve-sharding says so when they were).
        solver["deterministic"] = False
        if state.stats is not None:
            state.stats.extra["deterministic"] = False
        warning = Diagnostic(
            "warning", f"the time limit ({state.options.time_limit:g} s) cut "
            f"{len(cuts)} solve{'s' if len(cuts) > 1 else ''} made while choosing the plan "
            f"({cuts[0]}): another machine may keep another plan", None,
            ("raise --time-limit for the same plan on any machine",))
        state.log.entries.append(warning)
        plan["diagnostics"].append(warning.to_json())
    files[PLAN_FILE] = dumps(plan).encode()
    return CompileResult(state, files, timings)


def _view_remark(state: CompileState, views: dict) -> Diagnostic:
    """Logged: the plan is on a view of the mesh asked for."""
    chosen, given = views["tried"][views["chosen"]], views["given"]
    state.log.remark(
        f"planned on mesh {chosen['mesh']}, a view of the mesh {given['mesh']} (the same "
        f"devices in the same order): estimated step {format_seconds(chosen['step_time_s'])} "
        f"against {format_seconds(given['step_time_s'])} as given; the plan's shardings and "
        "loader use the view's axes (--mesh-views off plans the mesh as given)")
    return state.log.entries[-1]


def _round(x: float) -> float:
    """As plan.json writes estimates."""
    return float(f"{x:.6g}")


@contextlib.contextmanager
def _cyclic_gc_paused():
    """Python's cyclic garbage collector off for the duration (reference counting still frees
    what is not in a cycle). Planning allocates millions of small tuples and keeps most of
    them, so the collector's full passes over the growing heap find little to free and take
    a fifth of the compile time (Llama3-8B on 8x4 plans in 4.1 s without them and 5.0 s with
    them, at the same peak memory)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


__all__ = ["CompileResult", "HloplanError", "PipelineOptions", "compile", "compile_bytes",
           "make_options"]
