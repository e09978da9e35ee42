"""Pipeline parallelism and microbatching: cut the program into stages on submeshes, plan each
task's sharding with the intra-operator ILP, pick stages, submeshes and microbatches by the cost
model, and describe the schedule the loader runs.

The search is Alpa's inter-operator pass (inter_op.py): the per-microbatch forward ops are
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

Modules, in the order a plan is made:
- options.py: PipelineOptions (--stages, --microbatches, --schedule, ...).
- analysis.py: the batch inputs and what can be cut (the label-batch and cut-pipeline passes'
  analyses), the (microbatches, stages) pairs to try, the candidate layers.
- inter_op.py: Alpa's inter-operator DP on plain numbers, and the submesh shapes.
- tasks.py: TaskPlanner: a task's ILP on a submesh, its boundary layouts priced, cached.
- estimate.py: a stage's and the pipeline's time and memory from its tasks' figures.
- search.py: the lazy stage search and plan_pipeline, its entry point.
- emit.py: the plan.json "pipeline" section and the task programs' files.
"""

from hloplan.pipeline_parallel.emit import describe, task_files
from hloplan.pipeline_parallel.options import PipelineOptions
from hloplan.pipeline_parallel.search import NoPipeline, PipelinePlan, plan_pipeline

__all__ = ["NoPipeline", "PipelineOptions", "PipelinePlan", "describe", "plan_pipeline",
           "task_files"]
