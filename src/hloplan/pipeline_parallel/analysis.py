"""The program as pipeline parallelism sees it: which inputs carry the batch and which values
are partial sums over it (passes/label_batch.py), what can be cut into stages and layers
(passes/cut_pipeline.py), and which (microbatches, stages) pairs the search tries."""

from __future__ import annotations

from dataclasses import dataclass

from hloplan.cost_models import CommModel
from hloplan.diagnostics import UsageError
from hloplan.graph import Graph
from hloplan.mesh import MeshSpec
from hloplan.passes.cut_pipeline import CutContext, layer_starts, prepare
from hloplan.passes.label_batch import BatchAnalysis, analyse_program
from hloplan.pipeline_parallel.estimate import transfer_link
from hloplan.pipeline_parallel.options import (
    DEFAULT_LAYERS,
    MAX_AUTO_STAGES,
    SCHEDULES,
    PipelineOptions,
)
from hloplan.state import CompileOptions


@dataclass(frozen=True)
class PipelineProgram:
    analysis: BatchAnalysis  # batch inputs, each value's batch dim, the partial sums
    ctx: CutContext  # the forward ops, the per-microbatch and once-per-step units
    max_stages: int
    pairs: dict[int, list[int]]  # microbatches M -> the stage counts tried with it


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def analyse(graph: Graph, mesh: MeshSpec, popts: PipelineOptions) -> PipelineProgram | None:
    """The program's batch and cut, the options checked against them, and the pairs to try;
    None when there is none (one stage, one microbatch: the plain plan, planned already)."""
    if popts.schedule not in SCHEDULES:
        raise UsageError(f"unknown schedule {popts.schedule!r} ({', '.join(SCHEDULES)})")
    analysis = analyse_program(graph, popts.batch_args)
    ctx = prepare(graph, analysis)
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
        pairs = {m: [1] for m in divisors(batch) if m > 1}
        if not pairs:
            return None
    for m in ([] if popts.accumulate else
              [popts.microbatches] if popts.microbatches else divisors(batch)):
        counts = [s for s in stage_counts if (popts.microbatches or s <= m <= 4 * s)
                  and (m > 1 or s > 1)]
        if counts:
            pairs[m] = counts
    if not pairs and popts.stages:  # a small batch: as many microbatches as it splits into
        m = max(d for d in divisors(batch) if d <= 4 * popts.stages)
        if m > 1 or popts.stages > 1:
            pairs[m] = [popts.stages]
    if not pairs:
        return None
    return PipelineProgram(analysis, ctx, max_stages, pairs)


def candidate_layers(graph: Graph, program: PipelineProgram, popts: PipelineOptions,
                     options: CompileOptions, comm: CommModel) -> list[int]:
    """The forward position where each candidate layer of the stage DP starts (balanced cost,
    cut at narrow points: cut_pipeline.layer_starts)."""
    forward = len(program.ctx.forward)
    dtype = graph.type_of(graph.outputs[0]).dtype if graph.outputs else "f32"
    layers = max(popts.layers or DEFAULT_LAYERS, program.max_stages)
    return layer_starts(program.ctx, min(layers, max(forward, 1)),
                        flop_rate=options.device.flops_for(dtype),
                        link_bandwidth=transfer_link(comm).bandwidth,
                        memory_bandwidth=options.device.hbm_bandwidth)
