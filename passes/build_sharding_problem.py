"""build-sharding-problem: enumerate strategies per op and build the plain-data ShardingProblem.

- Each planned op becomes a node whose strategies come from its factor rule (op_rules) over the
  mesh, priced by the cost model (compute roofline, all-reduce of partial sums).
- Pointwise ops follow their first planned operand: they take its layout and share its decision
  variable (a tie), so the ILP grows with the number of layout decisions, not of ops.
- Edges carry the cost of resharding a producer's output into what the consumer's strategy needs.
- Constants and iotas are free: any layout costs nothing, so they get no node.
- Memory is checked at the program points whose live sets are maximal; each node is listed once,
  with the run of checked points where it is live (a live range), not at every point.
"""

from __future__ import annotations

import bisect
import functools
import math
import re
from dataclasses import dataclass, replace

from hloplan.cost_models import CommModel
from hloplan.cost_models.collectives import ReshardCost
from hloplan.graph import Graph, Op, TensorType, dtype_bytes
from hloplan.op_rules import (
    ELEMENTWISE,
    FREE_IF_INPUTS_FREE,
    OpRule,
    feeding_matmuls,
    folded_transposes,
    free_values,
    fused_values,
    fuses_matmuls,
    hbm_traffic,
    matmul_kernels,
    matmul_rereads,
    normalized_rereads,
    output_fused_values,
    restreamed_reads,
    rule_for,
    serial_reads,
    shared_reads,
    softmax_reads,
    unmaterialized_values,
)
from hloplan.passes.label_batch import state_like_args
from hloplan.solver.liveness import accumulator_spans
from hloplan.solver.problem import (
    Edge,
    Launch,
    LivePoint,
    LiveRange,
    Node,
    ShardingProblem,
    Strategy,
    copy_spans,
    first_live_points,
)
from hloplan.state import CompileState, PlanSpace
from hloplan.strategies import (
    OpStrategy,
    axis_roles,
    enumerate_strategies,
    local_bytes,
    local_matmul_dims,
    local_shape,
    mxu_itemsize,
    replicated,
    shards,
)
from hloplan.tpu_buffers import (
    biased_activations,
    broadcast_operands,
    combined_values,
    conv_loop_operand_dims,
    conv_loop_operand_elements,
    fused_selects,
    gated_values,
    gathers_rows,
    in_place_sums,
    matmul_recomputed_sources,
    minor_dims,
    normalized_values,
    operand_fused_values,
    output_fused_matmuls,
    pad_operands,
    recomputed_sources,
    reduced_fused_values,
    reduced_matmul_sums,
    relaid_rows,
    row_major_results,
    scatter_updates_shape,
    sliced_matmuls,
    tiled_elements,
)

UNPLANNED = {"stablehlo.while", "stablehlo.case", "stablehlo.if"}
MATMULS = ("stablehlo.dot_general", "stablehlo.convolution")


def _foldable(strategy: OpStrategy) -> bool:
    """Whether the strategy's price is one all-reduce or reduce-scatter of its result."""
    return (len(strategy.collectives) == 1 and strategy.communication > 0
            and strategy.collectives[0][0] in ("all-reduce", "reduce-scatter"))


def resharded_type(type_: TensorType, consumer: Op, model, graph: Graph | None = None
                   ) -> TensorType:
    """The type a value is resharded in for `consumer`: an f32 matmul operand at default
    precision goes in the device model's matmul_input_dtype ([collectives]; XLA's TPU compiler
    converts it for the MXU before the collective), also where only transposes and reshapes
    (given `graph`) stand between the value and its matmuls; any other value as it is."""
    narrow = model.matmul_input_dtype
    if narrow is None or type_.dtype != "f32" or not _feeds_matmuls(consumer, graph):
        return type_
    return TensorType(type_.shape, narrow)


def _feeds_matmuls(op: Op, graph: Graph | None, depth: int = 0) -> bool:
    """Whether `op` is a matmul at default precision, or (with `graph`) a transpose or reshape
    all of whose readers are (a few levels deep). A dot_general one of whose operands has only
    batch and contracting dims, or which contracts nothing (given `graph`), is not: libtpu
    computes it as a multiply (and a reduction) in a loop fusion, reading its operands as they
    are (keras_moe's combine of its experts' outputs, `bsed,bse->bsd`, exchanges them by
    all-to-all in f32)."""
    if op.name in MATMULS:
        return (all(p == "DEFAULT" for p in _precisions(op))
                and not (graph is not None and _vector_product(op, graph)))
    if graph is None or depth > 3 or op.name not in ("stablehlo.transpose", "stablehlo.reshape"):
        return False
    users = [graph.ops[u] for r in op.results for u in graph.values[r].users]
    return bool(users) and all(_feeds_matmuls(u, graph, depth + 1) for u in users)


def _vector_product(op: Op, graph: Graph) -> bool:
    """Whether `op` is a dot_general an operand of which has only batch and contracting dims,
    or one that contracts nothing (an outer product over its batch dims: keras_moe's gradient
    of its experts' outputs, `[b, s, d] x [b, s, e] -> [b, s, d, e]`, whose `[b, s, d]` libtpu
    gathers in f32 on v5e:16x16)."""
    if op.name != "stablehlo.dot_general":
        return False
    if "lhs_contracting" in op.attrs and not op.attrs["lhs_contracting"] \
            and not op.attrs.get("rhs_contracting"):
        return True
    for side, operand in (("lhs", op.operands[0]), ("rhs", op.operands[1])):
        type_ = graph.type_of(operand)
        if type_ is not None and type_.rank == (len(op.attrs.get(f"{side}_batch", ()))
                                                + len(op.attrs.get(f"{side}_contracting", ()))):
            return True
    return False


def _precisions(op: Op) -> list[str]:
    return re.findall(r"precision\s+(\w+)", op.attrs.get("precision", ""))


@dataclass(frozen=True)
class BuildShardingProblem:
    name: str = "build-sharding-problem"
    # Pointwise ops share their producer's decision (XLA's "followers").
    follow_pointwise: bool = True
    # A merged collective's first launch becomes an ILP term only when it costs at least this
    # (seconds; None: 0.1 ms on a TPU device model, else 1 ms). Over a 1,024-GPU mesh one
    # all-reduce launch is 20 ms of ring latency, which the per-collective shares (bytes /
    # 30 MiB of it) hide. On <= 32 GPUs (4 nodes) launches are under 1 ms; priced there they
    # would move the Flax transformer on 4x8 from 0.834 to 2.32 of the best hand plan, whose
    # compiled program has no such all-reduce. On 8x8 (1.26 ms) they are priced, and make the
    # 2-layer GPT's LP relaxation fractional (its solve takes about 9 times longer). libtpu
    # merges a step's all-reduces and reduce-scatters into buffers that each pay their ring
    # steps: over v5e:16x16's 256 chips an all-reduce launch is 0.51 ms, a tenth of
    # linen_resnet's step, and a plan that reduce-scatters some gradients and all-reduces the
    # rest pays two.
    min_launch_s: float | None = None
    # Price (and have propagate-sharding pin) a multi-axis all-gather as one all-gather per
    # axis, minor-most first, where that is cheaper: XLA gathers [(x, y)] -> [-] over all
    # devices at once, in n_x * n_y - 1 ring steps rather than (n_x - 1) + (n_y - 1).
    # (Not on a device model whose compiler gathers in one: [collectives] gathers = "one".)
    staged_gathers: bool = True

    def apply(self, state: CompileState) -> None:
        graph = state.graph
        options = state.options
        comm = CommModel(options.device, options.mesh, hosts=options.hosts,
                         combine=options.device.combiner, staged_gathers=self.staged_gathers)
        state.comm = comm
        min_launch_s = self.min_launch_s
        if min_launch_s is None:
            min_launch_s = 1e-4 if options.device.platform == "tpu" else 1e-3
        builder = _ProblemBuilder(graph, comm, self.follow_pointwise, state, min_launch_s)
        state.space, state.problem = builder.build(options.plan_budget)
        state.facts["nodes"] = len(state.problem.nodes)
        state.facts["edges"] = len(state.problem.edges)
        state.facts["live_points"] = len(state.problem.live_points)


class _ProblemBuilder:
    def __init__(self, graph: Graph, comm: CommModel, follow: bool, state: CompileState,
                 min_launch_s: float = 0.0):
        self.graph = graph
        self.comm = comm
        self.mesh = comm.mesh
        self.follow = follow
        self.state = state
        self.min_launch_s = min_launch_s
        self.space = PlanSpace()
        self.rules: dict[int, OpRule] = {}
        self.tie_root: dict[int, int] = {}  # op index -> op index of its leader
        self.identical: dict[tuple, int] = {}  # identical_key -> the first such op's index
        # Repeated layers repeat (rule, types) signatures: strategies, follower lists and
        # resharding matrices are computed once per signature and shared.
        self.own_ids: dict = {}  # signature -> small int
        self.own_lists: list[list[OpStrategy]] = []  # by signature id: its strategies
        self.follow_cache: dict = {}  # (own id, producer list id, result) -> list | None
        self.list_ids: dict = {}  # own id or follower key -> small int
        self.list_of: dict[int, int] = {}  # op index -> id of its strategy list's signature
        self.specs_ids: dict = {}  # a tuple of layouts -> small int
        self.specs_by_source: dict = {}  # (strategy list, result or operand position) -> its id
        self.specs_of: dict[int, tuple] = {}
        self.edge_cache: dict = {}  # (type, layouts id, layouts id, multiplier) -> matrix
        self.reshard_cache: dict = {}  # type -> (src layout, dst layout) -> seconds
        self.copies_cache: dict = {}  # (type, layouts id) -> bytes of a copy in each layout
        self.relayout_cache: dict = {}  # _relayout's answers
        self.read_edges: dict[tuple[int, int], int] = {}  # (op, operand) -> its edge's index
        self.point_ops: list[int] = []  # live point -> the op after which it is checked
        self.plain_of: dict[int, Strategy] = {}  # id(OpStrategy) -> Strategy (cached ones live)
        self.folded = folded_transposes(graph)  # transposes a GEMM reads through: no kernel
        matmul_fusion = fuses_matmuls(comm.model.platform)
        # Kept inside a fused kernel: no HBM traffic.
        self.fused = fused_values(graph, self.folded, matmul_fusion)
        # Returned values that their readers take inside the kernel making them (multi-output
        # fusion): written out, never read back.
        self.kept = (output_fused_values(graph, self.folded, matmul_fusion) if matmul_fusion
                     else set())
        # A fused kernel reads a value once.
        self.shared = shared_reads(graph, self.fused | self.kept)
        # Matmuls recompute the fused operands they share.
        self.rereads = matmul_rereads(graph, self.fused) if matmul_fusion else set()
        # Of those, the ones read apart from the FLOPs (op_rules.serial_reads).
        self.serial = normalized_rereads(graph, self.fused, self.rereads)
        # Softmaxes any matmul recomputes: read again per output tile where the kernel tiles
        # the other operand's rows (strategies.restream_passes).
        self.softmaxes = softmax_reads(graph, self.fused) if matmul_fusion else set()
        # Memory counts the values fused among elementwise ops and reductions only: those fused
        # into a matmul's kernel keep their buffers in libtpu's buffer assignment (the matmul
        # fusion is priced as HBM traffic only).
        device = comm.model
        kept_fused = (fused_values(graph, self.folded, outer_products=device.fused_reductions)
                      if matmul_fusion else self.fused)
        # Of those, the values XLA never writes out: no memory either. A compiler whose
        # reductions fuse the elementwise work they read (TPU) writes no fused value out (a
        # softmax's exponentials, a cross entropy's one-hot products); otherwise only those it
        # recomputes in each consumer.
        self.unmaterialized, self.reader_fused, self.normalized, self.gated = (
            tpu_fusion(graph, kept_fused) if device.fused_reductions
            else (unmaterialized_values(graph, kept_fused), set(), set(), set()))
        # Sums written into the buffer of a value their kernel reads last: sum id -> that value.
        self.in_place = (in_place_sums(graph, self.unmaterialized)
                         if device.fused_reductions else {})
        # Written-out values that a reshard makes again from their fused chain's source
        # (tpu_buffers.recomputed_sources): value id -> that source.
        self.recomputed = (recomputed_sources(graph, self.unmaterialized, free_values(graph))
                           if device.fused_reductions else {})
        # Values every reader recomputes that only matmuls read -> their source: written once
        # where a reader takes them resharded (_written_for_reshard).
        self.matmul_recomputed = (
            matmul_recomputed_sources(graph, self.reader_fused, self.unmaterialized,
                                      free_values(graph)) if device.fused_reductions else {})
        # Ops whose results are written in a narrower dtype than their type (f32 values read
        # only by matmuls, which run on the narrower type): op index -> bytes kept per byte.
        self.narrowed = (matmul_narrowed(graph, self.folded, device.matmul_operands)
                         if device.matmul_operands else {})
        # Collectives of ops that feed a matmul are never merged with others: each pays its
        # whole latency (XLA's combiners only merge independent collectives).
        self.chained = feeding_matmuls(graph)
        self.unmerged = CommModel(comm.model, comm.mesh, hosts=comm.hosts,
                                  staged_gathers=comm.staged_gathers)
        # Inputs that arrive every step (not state updated in place): their layout decides
        # what each device receives, so their bytes are priced.
        state = state_like_args(graph)
        self.streamed = frozenset(v for p, v in enumerate(graph.arguments) if p not in state)
        self.overlapped = self._overlapped_matmuls()

    # -- strategies ---------------------------------------------------------------------------

    def _overlapped_matmuls(self) -> set[int]:
        """Matmuls whose kernel is HBM-bound: the HBM traffic of the matmul and of the
        elementwise ops fused into its kernel (op_rules.matmul_kernels: an optimizer update
        fused into a weight-gradient matmul, an activation recomputed in its prologue) takes
        longer than its FLOPs at the [matmul] rate of its whole shape. The chip streams that
        traffic while the MXU computes, so the kernel takes its traffic's time: such a matmul
        is priced at its own traffic, the fused ops at theirs (_price's `overlap`). In a
        compute-bound kernel the fused ops' traffic adds to the FLOPs, as priced op by op (on
        a v5e chip the weight-gradient kernels of the dense transformers and MLPs come near
        that sum; the MoE's expert weight gradients, HBM-bound, take their traffic's time)."""
        if not fuses_matmuls(self.comm.model.platform) or not self.comm.model.matmul:
            return set()
        graph, model = self.graph, self.comm.model

        def traffic(op: Op) -> float:
            """HBM bytes the op moves alongside its kernel's FLOPs: a recomputed operand's read
            that comes before them (serial_reads) is left out."""
            reads, writes = hbm_traffic(graph, op, self.fused, self.streamed, self.folded,
                                        self.shared, self.rereads, self.kept)
            late = serial_reads(op, self.serial) or (False,) * len(op.operands)
            reads = tuple(read and not apart for read, apart in zip(reads, late))
            return sum(graph.type_of(v).nbytes for v, moved in
                       zip((*op.operands, *op.results), (*reads, *writes))
                       if moved and graph.type_of(v) is not None)

        out = set()
        for index, neighbours in matmul_kernels(graph, self.fused | self.kept).items():
            op = graph.ops[index]
            rule = rule_for(graph, op)
            if rule.matmul is None or not neighbours:
                continue
            dims = [size for _, size in local_matmul_dims(rule, [[]] * len(rule.factors),
                                                           self.mesh)]
            flop_s = rule.flops / model.matmul_flops_for(graph.type_of(op.results[0]).dtype,
                                                         *dims)
            moved = traffic(op) + sum(traffic(graph.ops[u]) for u in neighbours
                                      if graph.ops[u].name not in UNPLANNED)
            if moved / model.hbm_bandwidth >= flop_s:
                out.add(index)
        return out

    def build(self, budget: float) -> tuple[PlanSpace, ShardingProblem]:
        for op in self.graph.ops:
            if op.name in UNPLANNED:
                continue
            rule = rule_for(self.graph, op)
            self.rules[op.index] = rule
            if self._is_free(op, rule):
                self.space.free_values.update(op.results)
                continue
            if rule.fallback:
                self.space.fallbacks[op.index] = rule.fallback
                self.state.log.warn(f"{rule.fallback}; planned as replicated", op.location, op.name,
                                    notes=("its operands are gathered onto every device",))
            self.space.strategies[op.index] = self._strategies(op, rule)
            if self.comm.model.merge_identical:
                self._merge_identical(op)
        folds = self._reassociations()
        self._scatter_first_gathers(folds)
        self._sliced_all_reduces(folds)
        nodes = self._nodes()
        edges = self._edges() + self._fold_edges(folds) + self._sliced_edges(folds)
        points, ranges, made_only = self._live_points(nodes, edges)
        problem = ShardingProblem(tuple(nodes), tuple(edges), tuple(points), budget,
                                  name=self.graph.name, live_ranges=tuple(ranges),
                                  launches=self._launches(nodes), made_only=made_only)
        problem = self._hold_shared_copies(problem)
        problem = hold_copies_across_loops(problem)
        if self.comm.model.fused_reductions:  # TPU device models (see the method)
            problem = self._hold_weight_copies(problem)
            problem = self._hold_carried_copies(problem)
            problem = self._hold_relaid_loop_copies(problem)
        problem.validate()
        return self.space, problem

    def _reassociations(self) -> list[tuple[int, int, tuple]]:
        """The adds XLA reassociates on this device model ([collectives] reassociate): an add
        that alone reads two values made by planned ops, following the first (so it reads both
        in the first's layout). Where both end in the same all-reduce or reduce-scatter and
        make the same layout, XLA runs one collective of their sum: the second producer's
        strategies drop that collective's price here, and an edge from the first
        (_fold_edges) charges it back for every pair of strategies that does not fold.
        Returns (first, second, the second's strategies as they were)."""
        if not self.comm.model.reassociate:
            return []
        folds, taken = [], set()
        for op_index in self.space.strategies:
            op = self.graph.ops[op_index]
            if op.name != "stablehlo.add" or len(set(op.operands)) != 2:
                continue
            producers = []
            for value_id in op.operands:
                value = self.graph.values[value_id]
                if (value.producer not in self.space.strategies
                        or set(value.users) != {op_index}
                        or len(self.graph.ops[value.producer].results) != 1):
                    break
                producers.append(value.producer)
            else:
                first, second = producers
                root = self.tie_root.get(first, first)
                if (second in taken or first in taken or self.tie_root.get(op_index) != root
                        or self.tie_root.get(second, second) == root):
                    continue
                before = self.space.strategies[second]
                if not any(_foldable(s) for s in before):
                    continue
                taken.update((first, second))
                self.space.strategies[second] = [replace(s, communication=0.0)
                                                 if _foldable(s) else s for s in before]
                self.list_of[second] = self._list_id(("reassociated", second))
                folds.append((first, second, tuple(before)))
        return folds

    def _scatter_first_gathers(self, folds) -> None:
        """Masked lookups (a gather whose partial rows are all-reduced) whose readers take the
        rows in a layout split over the summed axes. libtpu rewrites the all-reduce and the
        slice of its result as a reduce-scatter (XLA's reduce-scatter creator), then reshards
        the scattered rows (hf_bert, haiku_transformer and llama on v5e:2x4: the embedding's
        partial rows reduce-scattered over x). The plan keeps the all-reduced result, which
        XLA's partitioner partitions as a masked lookup (given a result layout that
        reduce-scatters the partial rows, it all-gathers the table instead): its strategies
        are priced with the reduce-scatter here, and each of the n reading edges
        (_scatter_first_edge) charges 1/n of the all-reduce's price beyond it back where its
        reader's layout does not take the slice (all of it where none does; where only some
        do, XLA keeps the all-reduce, and the charge falls short of it)."""
        if self.comm.model.platform != "tpu":
            return
        taken = {second for _, second, _ in folds}
        for op_index, strategies in self.space.strategies.items():
            op = self.graph.ops[op_index]
            if (self.rules[op_index].indexed != "gather" or op_index in taken
                    or len(op.results) != 1):
                continue
            value = self.graph.values[op.results[0]]
            if (not value.users or value.id in self.fused or value.id in self.unmaterialized
                    or value.type is None):
                continue
            reads = self._planned_reads(value)
            if reads is None:
                continue
            # Matmuls that share one reshard of the value (_shared_reshards) are left out.
            readers = {reader for reader, _ in reads}
            if len(readers) > 1 and any(self.graph.ops[r].name in MATMULS for r in readers):
                continue
            comm = self.unmerged if op_index in self.chained else self.comm
            priced = []
            for s in strategies:
                kinds = {kind for kind, _, _ in s.collectives}
                if not s.reduced_axes or kinds != {"all-reduce"}:
                    priced.append(s)
                    continue
                nbytes, permuted = scatter_first_bytes(comm, value.type, s.results[0],
                                                       s.reduced_axes)
                scattered = (comm.collective("reduce-scatter", nbytes, s.reduced_axes)
                             + comm.collective_permute(permuted, s.reduced_axes))
                priced.append(replace(s, communication=min(s.communication,
                                                           scattered * op.multiplier)))
            self.space.strategies[op_index] = priced
            self.list_of[op_index] = self._list_id(("scatter-first", op_index))
            self.space.scatter_first[op_index] = (reads, tuple(strategies))

    def _scatter_first_edge(self, value, consumer: Op, position: int, multiplier: float
                            ) -> Edge | None:
        """An edge from a scatter-first gather (_scatter_first_gathers) to a reader: where the
        reader's layout takes every summed axis, the reduce-scatter's layout resharded into
        it; elsewhere the reshard from the all-reduced layout and 1/n of the all-reduce's
        price beyond the reduce-scatter's (n reading edges)."""
        producer = value.producer
        reads, before = self.space.scatter_first[producer]
        after = self.space.strategies[producer]
        type_ = resharded_type(value.type, consumer, self.comm.model, self.graph)
        costs = []
        for s_before, s_after in zip(before, after):
            src, row = s_before.results[0], []
            beyond = (s_before.communication - s_after.communication) / len(reads)
            for c in self.space.strategies[consumer.index]:
                dst = c.operands[position] if position < len(c.operands) else None
                if dst is None:
                    row.append(0.0)
                    continue
                mid = scatter_first_layout(src, dst, s_before.reduced_axes, type_.shape,
                                           self.mesh.axis_sizes)
                if not beyond or mid is None:
                    seconds = (0.0 if src == dst else self.comm.reshard(
                        type_.shape, type_.itemsize, src, dst).seconds) * multiplier
                    row.append(seconds + beyond)
                else:
                    row.append(scatter_first_reshard(self.comm, type_, s_before.reduced_axes,
                                                     mid, dst).seconds * multiplier)
            costs.append(tuple(row))
        if not any(any(row) for row in costs):
            return None
        return Edge(self.space.node_of[producer], self.space.node_of[consumer.index],
                    tuple(costs), label=f"%{value.id} -> %{consumer.index} scatter-first")

    def _sliced_all_reduces(self, folds) -> None:
        """All-reduces whose readers may take one slice of the result over the summed axes
        (sliced_read): libtpu's reduce-scatter creator compiles the all-reduce and the slice
        as one reduce-scatter (hf_bert's and hf_gpt2's layer-norm row sums on v5e:4x8, `[y, -]`
        summed over x and read `[y, x]`). On v5e:4x8 that reduce-scatter pays its whole
        latency ([combiner] reduce-scatter-apart), where the all-reduce pays its share of the
        merged all-reduces' (3 us against 0.1 us for a 4 KiB row sum): each of the n reading
        edges (_sliced_edges) charges 1/n of the difference where the reader's layout slices,
        exact where every reader takes one slice (with readers that differ XLA keeps the
        all-reduce, and the charge falls short of the reduce-scatter). Where the reduce-scatter
        costs less, the slice keeps the all-reduce's price: the op's own reduce-scatter
        strategies (strategies._scatter_variants) price those collectives, and the forms they
        leave out cost what theirs do: priced lower, the slice only adds ties with them that
        move plans for nothing (hf_bert's and hf_gpt2's weights to `[(x, y), -]` on v5e:4x8,
        at no lower estimate). Left out: gathers (_scatter_first_gathers), the second of a
        reassociated pair (its price is the fold's: listed where the plan does not fold it, not
        charged here), outputs and values a loop carries."""
        if self.comm.model.platform != "tpu":
            return
        outputs = set(self.graph.outputs)
        for op_index, strategies in self.space.strategies.items():
            op = self.graph.ops[op_index]
            if op_index in self.space.scatter_first or len(op.results) != 1:
                continue
            value = self.graph.values[op.results[0]]
            if not value.users or value.id in outputs or value.type is None:
                continue
            reads = self._planned_reads(value)
            if reads is None:
                continue
            dsts = {c.operands[k] for r, k in reads for c in self.space.strategies[r]
                    if k < len(c.operands)}
            # Permuted slices too, for the listing (sliced_all_reduces); their price is the
            # all-reduce's and the reshard's (sliced_charge: 0).
            if any(sliced_read(s, dst, value.type, self.mesh, permuted=True)
                   for s in strategies for dst in dsts):
                self.space.sliced[op_index] = reads

    def _planned_reads(self, value) -> tuple | None:
        """(reader op index, operand position) of each read of `value`; None where a reader
        is not planned (no strategies) or a loop carries the value (yields it)."""
        readers = [self.graph.ops[u] for u in dict.fromkeys(value.users)]
        if any(r.index not in self.space.strategies or r.attrs.get("yield") == value.id
               for r in readers):
            return None
        return tuple((r.index, k) for r in readers
                     for k, v in enumerate(r.operands) if v == value.id)

    def _sliced_edges(self, folds) -> list[Edge]:
        """Per read of a sliced all-reduce (_sliced_all_reduces) by a layout that slices it:
        1/n of what the reduce-scatter costs beyond the all-reduce (sliced_charge); none for
        the second of a reassociated pair (the fold prices it)."""
        taken = {second for _, second, _ in folds}
        edges = []
        for producer, reads in self.space.sliced.items():
            if producer in taken:
                continue
            op = self.graph.ops[producer]
            type_ = self.graph.values[op.results[0]].type
            comm = self.unmerged if producer in self.chained else self.comm
            for reader, position in reads:
                costs = []
                for s in self.space.strategies[producer]:
                    charges: dict = {}
                    row = []
                    for c in self.space.strategies[reader]:
                        dst = c.operands[position] if position < len(c.operands) else None
                        if dst not in charges:
                            charges[dst] = sliced_charge(comm, type_, s, dst, self.mesh,
                                                         op.multiplier) / len(reads)
                        row.append(charges[dst])
                    costs.append(tuple(row))
                if any(any(row) for row in costs):
                    edges.append(Edge(self.space.node_of[producer], self.space.node_of[reader],
                                      tuple(costs), label=f"%{op.results[0]} -> %{reader} "
                                      "sliced all-reduce"))
        return edges

    def _fold_edges(self, folds) -> list[Edge]:
        edges = []
        for first, second, before in folds:
            costs = tuple(
                tuple(s2.communication if _foldable(s2) and not (
                    s1.results[0] == s2.results[0]
                    and {c[:2] for c in s1.collectives} & {c[:2] for c in s2.collectives})
                      else 0.0 for s2 in before)
                for s1 in self.space.strategies[first])
            if any(any(row) for row in costs):
                edges.append(Edge(self.space.node_of[first], self.space.node_of[second], costs,
                                  label=f"%{first} + %{second} reassociated"))
        return edges

    def _is_free(self, op: Op, rule: OpRule) -> bool:
        if rule.free:
            return True
        if op.name in FREE_IF_INPUTS_FREE and all(v in self.space.free_values for v in op.operands):
            return True
        # Scalar arithmetic on free scalars (1/N, step counts of constants) is free too.
        if (not rule.fallback and op.name not in ("arg", "while.carry", "case.result")
                and all(self.graph.type_of(v) is not None and self.graph.type_of(v).rank == 0
                        for v in op.results)
                and all(v in self.space.free_values for v in op.operands)):
            return True
        return False

    def _strategies(self, op: Op, rule: OpRule) -> list[OpStrategy]:
        operand_types = tuple(self.graph.type_of(v) for v in op.operands)
        result_types = tuple(self.graph.type_of(v) for v in op.results)
        dtype = result_types[0].dtype if result_types and result_types[0] else "f32"
        hbm = hbm_traffic(self.graph, op, self.fused, self.streamed, self.folded, self.shared,
                          self.rereads, self.kept)
        serial = serial_reads(op, self.serial)  # recomputed operands: read apart from FLOPs
        restreamed = restreamed_reads(op, self.softmaxes)
        # The signature (rule, types, ...) is hashed once, here; the follower cache and the
        # list ids key on its small id (hashing an OpRule walks all its factors).
        chained = op.index in self.chained
        overlap = op.index in self.overlapped
        own_key = (rule, operand_types, result_types, op.multiplier, dtype, hbm, serial, chained,
                   overlap, restreamed)
        own_id = self.own_ids.get(own_key)
        if own_id is None:
            own_id = self.own_ids[own_key] = len(self.own_ids)
            self.own_lists.append(enumerate_strategies(
                rule, list(operand_types), list(result_types), self.mesh,
                self.unmerged if chained else self.comm, op.multiplier, dtype, hbm=hbm,
                serial=serial, overlap=overlap, restreamed=restreamed))
        own = self.own_lists[own_id]
        leader = self._leader_operand(op, rule) if self.follow else None
        if leader is None:
            self.list_of[op.index] = self._list_id(own_id)
            return list(own)
        producer, result_index = leader
        follow_key = (own_id, self.list_of[producer.index], result_index)
        followed = self.follow_cache.get(follow_key, False)
        if followed is False:
            by_result = {s.results[0]: s for s in own}
            followed = []
            for strategy in self.space.strategies[producer.index]:
                match = by_result.get(strategy.results[result_index])
                if match is None:
                    followed = None  # some producer layout has no matching strategy
                    break
                followed.append(match)
            self.follow_cache[follow_key] = followed
        if followed is None:
            self.list_of[op.index] = self._list_id(own_id)
            return list(own)
        self.list_of[op.index] = self._list_id(follow_key)
        self.tie_root[op.index] = self.tie_root.get(producer.index, producer.index)
        return list(followed)

    def _merge_identical(self, op: Op) -> None:
        """Tie `op` to an earlier identical op (device model [collectives] merge-identical):
        libtpu merges ops of the same name, operands and attributes in one computation before
        it partitions the program, whatever shardings they were given, so the copy is made in
        the first's layout and its readers reshard from there (a layer norm's scale broadcast in
        the forward pass and again, for another layout, in the backward pass: an all-to-all).
        Pointwise copies already follow the same producer; this ties the others."""
        key = identical_key(self.graph, op)
        if key is None:
            return
        first = self.identical.setdefault(key, op.index)
        if first == op.index or op.index in self.tie_root:
            return
        mine, theirs = self.space.strategies[op.index], self.space.strategies[first]
        if [(s.operands, s.results) for s in mine] != [(s.operands, s.results) for s in theirs]:
            return  # one decision needs one list of layouts
        self.tie_root[op.index] = self.tie_root.get(first, first)

    def _list_id(self, key) -> int:
        """A small int per distinct strategy list: an own signature's id, or a follower's
        (own id, producer's list id, result index)."""
        return self.list_ids.setdefault(key, len(self.list_ids))

    def _leader_operand(self, op: Op, rule: OpRule) -> tuple[Op, int] | None:
        if not rule.pointwise or len(op.results) != 1:
            return None
        rank = self.graph.type_of(op.results[0]).rank
        if rank == 0:
            return None
        for value_id, dims in zip(op.operands, rule.operands):
            value = self.graph.values[value_id]
            producer = self.graph.ops[value.producer]
            if value_id in self.space.free_values or producer.index not in self.space.strategies:
                continue
            if dims is None or self.graph.type_of(value_id).rank != rank:
                continue
            rule_of = self.rules.get(producer.index)
            if rule_of is not None and rule_of.indexed == "gather":
                # A lookup's cheapest forms (rows sharded on their width, or on the
                # vocabulary and summed) make layouts the values it feeds need not keep; a
                # follower would make the two one decision with no reshard between them (a
                # residual stream split over both axes left the Llama-8B step's lookup one
                # form: the whole table on every device).
                return None
            return producer, value.result_index
        return None

    # -- nodes and edges ----------------------------------------------------------------------

    def _nodes(self) -> list[Node]:
        nodes = []
        leaders = set(self.tie_root.values())
        converted: dict[int, tuple[Strategy, ...]] = {}  # strategy list id -> Strategy tuple
        for op_index, strategies in self.space.strategies.items():
            op = self.graph.ops[op_index]
            self.space.node_of[op_index] = len(nodes)
            self.space.op_of.append(op_index)
            root = self.tie_root.get(op_index)
            tie = None
            if root is not None or op_index in leaders:
                tie = root if root is not None else op_index
            where = f" at {op.location}" if op.location else ""
            key = self.list_of[op_index]
            plain = converted.get(key)
            if plain is None:
                plain = tuple(self._plain(s) for s in strategies)
                converted[key] = plain
            if self.comm.model.tiled_layouts:  # results held in TPU tiles
                row_major = row_major_results(op.name)
                key = ("tiled", key, row_major, op.name == "stablehlo.gather")
                tiled = converted.get(key)
                if tiled is None:
                    types = [self.graph.type_of(v) for v in op.results]
                    tiled = converted[key] = tuple(
                        self._tiled(op, types, p, s, row_major)
                        for p, s in zip(plain, strategies))
                plain = tiled
            scale = self.narrowed.get(op_index)
            if scale is not None:  # written in a narrower dtype: fewer bytes held
                narrow = converted.get(("narrowed", key, scale))
                if narrow is None:
                    narrow = converted[("narrowed", key, scale)] = tuple(
                        replace(s, memory=s.memory * scale) for s in plain)
                plain = narrow
            nodes.append(Node(
                name=f"%{op_index} {op.name}",
                strategies=plain,
                members=(f"{op.label or op.name}{where}",),
                tie=tie))
        return nodes

    def _launches(self, nodes: list[Node]) -> tuple[Launch, ...]:
        """The merged collectives' first launches. The strategies of an op whose collective
        XLA merges with others' (not on a matmul's dependency chain) price only its share of
        the merged buffers' latency; a plan that issues the kind at all pays one buffer's
        launch in full: an all-reduce of the loss and a few bias gradients over 1,024 GPUs costs
        20 ms of ring steps, which the shares alone (bytes / 30 MiB of it) hid. Only launches of
        at least `min_launch_s` become terms. Per kind, mesh axes
        and loop trip count (collectives merge within one iteration). A chained collective of
        the kind (priced unmerged) does not absorb the launch: the gradients a step computes
        last are reduced after every chained collective of the backward pass."""
        members: dict[tuple, dict[int, list[int]]] = {}
        for op_index, node_index in self.space.node_of.items():
            if op_index in self.chained:
                continue
            multiplier = self.graph.ops[op_index].multiplier
            for pick, strategy in enumerate(nodes[node_index].strategies):
                for kind, axes, _ in strategy.collectives:
                    if kind in self.comm.combine:
                        picks = members.setdefault((kind, axes, multiplier), {})
                        picks.setdefault(node_index, []).append(pick)
        launches = []
        for (kind, axes, multiplier), picks in sorted(members.items()):
            cost = self.comm.launch_latency(kind, axes.split(",")) * multiplier
            if cost > 0 and cost >= self.min_launch_s:
                label = f"{kind}({axes})" + (f" x{multiplier:g}" if multiplier != 1 else "")
                launches.append(Launch(label, cost, tuple(
                    (node, tuple(dict.fromkeys(p))) for node, p in sorted(picks.items()))))
        return tuple(launches)

    def _plain(self, strategy: OpStrategy) -> Strategy:
        """The problem's view of a strategy (one per strategy object: lists share them)."""
        plain = self.plain_of.get(id(strategy))
        if plain is None:
            plain = Strategy(strategy.name, strategy.compute, strategy.communication,
                             strategy.memory, strategy.collectives,
                             axis_roles(strategy, self.mesh.ndim), strategy.transient,
                             strategy.accumulators)
            self.plain_of[id(strategy)] = plain
        return plain

    def _specs_id(self, key, specs) -> int:
        """A small int per distinct list of layouts (the rows or columns of an edge matrix)."""
        found = self.specs_by_source.get(key)
        if found is None:
            layouts = tuple(specs())
            found = self.specs_ids.setdefault(layouts, len(self.specs_ids))
            self.specs_by_source[key] = found
            self.specs_of[found] = layouts
        return found

    def _operand_specs_id(self, op_index: int, position: int) -> int:
        """The id of the layouts op `op_index`'s strategies need for operand `position`."""
        strategies = self.space.strategies[op_index]
        return self._specs_id(("operand", self.list_of[op_index], position),
                              lambda: (s.operands[position] if position < len(s.operands)
                                       else None for s in strategies))

    def _matrix(self, type_, src_id: int, dst_id: int, multiplier: float, fused: bool = False,
                unmaterialized: bool = False):
        """Resharding costs between two lists of layouts, or None when all are zero. `fused`:
        the value would stay inside a fused kernel; a reshard makes XLA write it to HBM and
        read it back, so that traffic is priced with it. `unmaterialized`: the value is never
        written out in its own layout; a local slice of it into a smaller layout is not free
        either: XLA's partitioner makes the whole value (a broadcast of a norm's scale to a
        replicated [batch, seq, d]: 4 GiB per device on 256 chips) and slices it."""
        key = (type_, src_id, dst_id, multiplier, fused, unmaterialized)
        if key in self.edge_cache:
            return self.edge_cache[key]
        src_specs, dst_specs = self.specs_of[src_id], self.specs_of[dst_id]
        # Priced once per distinct (src, dst) layout pair; strategy lists repeat layouts.
        unique_dst = list(dict.fromkeys(dst_specs))
        reshards = self.reshard_cache.setdefault(type_, {})  # (src, dst) -> seconds
        mesh, hbm = self.mesh, self.comm.model.hbm_bandwidth
        dst_bytes = ([local_bytes(type_, dst, mesh) if dst is not None else 0
                      for dst in unique_dst] if fused or unmaterialized else None)
        row_of: dict = {}  # distinct src -> its costs over unique_dst
        nonzero = False
        for src in dict.fromkeys(src_specs):
            src_bytes = (local_bytes(type_, src, mesh) if (fused or unmaterialized)
                         and src is not None else 0)
            row = []
            for k, dst in enumerate(unique_dst):
                if src == dst or dst is None:
                    row.append(0.0)
                    continue
                seconds = reshards.get((src, dst))
                if seconds is None:
                    seconds = self.comm.reshard(type_.shape, type_.itemsize, src, dst).seconds
                    reshards[src, dst] = seconds
                if fused and seconds > 0:  # a collective, not a local slice
                    seconds += (src_bytes + dst_bytes[k]) / hbm
                elif unmaterialized and seconds == 0:
                    if src_bytes > dst_bytes[k]:
                        seconds = src_bytes / hbm  # written out whole
                cost = seconds * multiplier
                nonzero = nonzero or cost != 0
                row.append(cost)
            row_of[src] = row
        if not nonzero:
            matrix = None
        else:
            position = {dst: k for k, dst in enumerate(unique_dst)}
            columns = [position[dst] for dst in dst_specs]
            rows = {src: tuple(row[k] for k in columns) for src, row in row_of.items()}
            matrix = tuple(rows[src] for src in src_specs)
        self.edge_cache[key] = matrix
        return matrix

    def _edge(self, value_id: int, consumer: Op, position: int, multiplier: float) -> Edge | None:
        value = self.graph.values[value_id]
        if value_id in self.space.free_values or value.type is None:
            return None
        producer = value.producer
        if producer not in self.space.strategies:
            return None
        if (consumer.index, position) in self.space.scatter_first.get(producer, ((),))[0]:
            return self._scatter_first_edge(value, consumer, position, multiplier)
        consumer_strategies = self.space.strategies[consumer.index]
        producer_strategies = self.space.strategies[producer]
        src_id = self._specs_id(("result", self.list_of[producer], value.result_index),
                                lambda: (s.results[value.result_index] for s in producer_strategies))
        if position < 0:  # a loop-carried value: the carry's own layout
            dst_id = self._specs_id(("operand", self.list_of[consumer.index], position),
                                    lambda: (s.results[0] for s in consumer_strategies))
        else:
            dst_id = self._operand_specs_id(consumer.index, position)
        type_ = value.type if position < 0 else resharded_type(value.type, consumer,
                                                               self.comm.model, self.graph)
        costs = self._matrix(type_, src_id, dst_id, multiplier, value_id in self.fused,
                             value_id in self.unmaterialized)
        if costs is None:
            return None
        costs, relayout = self._relayout(consumer, position, type_, src_id, dst_id, costs,
                                         multiplier)
        relayout = self._recomputed_source(value_id, consumer, src_id, dst_id, costs, relayout)
        relayout = self._written_for_reshard(value_id, consumer, src_id, dst_id, costs, relayout)
        return Edge(self.space.node_of[producer], self.space.node_of[consumer.index], costs,
                    label=f"%{value_id} -> %{consumer.index}",
                    copies=(self._copies(type_, dst_id)
                            if position >= 0 and not self._resharded_in_place(consumer) else ()),
                    relayout=relayout)

    def _resharded_in_place(self, consumer: Op) -> bool:
        """Whether a reshard into `consumer` is its result's own buffer: a transpose folded
        into the matmuls that read it (a layout, no kernel) whose result is held. XLA's
        collective writes the value in the transposed layout and the matmuls read that buffer,
        so the resharded copy and the transpose's result are one buffer, held as the result
        (libtpu 0.0.42, hf_gpt2 on v5e:2x4: the tied embedding all-gathered for the output
        head is one `bf16[50257,768]{0,1}` buffer, read by the forward and backward head
        matmuls). On TPU device models (`[buffers] fused_reductions`): XLA's CPU compiler keeps
        arrays row-major, so a transpose is a copy there."""
        if (not self.comm.model.fused_reductions or consumer.index not in self.folded
                or len(consumer.results) != 1):
            return False
        result = consumer.results[0]
        return result not in self.unmaterialized and result not in self.space.free_values

    def _shared_reshards(self) -> dict[tuple[int, int], tuple[int, int]]:
        """(matmul, operand position) -> (the previous matmul reading the same value, its
        position), for the second and later matmuls of one region reading a value.

        XLA reshards a value once per layout (the forward and backward matmuls share one
        all-gather of an FSDP-stored weight; the weight- and input-gradient matmuls share one
        all-gather of the output gradient), so such a matmul takes the value from the previous
        one's layout: free when both need the same, a reshard between the two layouts when
        not. Pricing each read from the value's own layout instead charges a second collective
        that XLA does not issue. A matmul reading the value through reverses of dims of size 1
        reads the value itself (_unreversed)."""
        shared = {}
        readers: dict[int, list[tuple[int, int]]] = {}
        for value in self.graph.values:
            value_id = value.id
            if value_id in self.space.free_values:
                continue
            for user in dict.fromkeys(value.users):
                op = self.graph.ops[user]
                if (op.name in MATMULS and user in self.space.strategies
                        and op.operands.count(value_id) == 1):
                    readers.setdefault(self._unreversed(value_id), []).append(
                        (user, op.operands.index(value_id)))
        for reads in readers.values():
            previous: dict[tuple, tuple[int, int]] = {}
            for user, position in sorted(reads):
                op = self.graph.ops[user]
                where = (op.parent, op.region, op.multiplier)
                if where in previous:
                    shared[user, position] = previous[where]
                previous[where] = (user, position)
        return shared

    def _unreversed(self, value_id: int) -> int:
        """The value `value_id` is made from by reverses of dims of size 1 only (the identity,
        which XLA's simplifier removes: the input gradient of a 1x1 convolution reads its
        kernel through one of its two spatial dims), else `value_id` itself. libtpu gathers
        an FSDP-stored 1x1 kernel once for the forward convolution and its input gradient
        (linen_resnet on v5e:2x4, `[1, 1, 256, 512]`)."""
        while True:
            op = self.graph.producer(value_id)
            if op.name != "stablehlo.reverse":
                return value_id
            shape = self.graph.type_of(op.operands[0]).shape
            if any(shape[d] != 1 for d in op.attrs.get("dimensions", [])):
                return value_id
            value_id = op.operands[0]

    def _shared_edge(self, value_id: int, previous: tuple[int, int], consumer: Op,
                     position: int) -> Edge | None:
        """The edge from the previous matmul's layout of `value_id` to `consumer`'s."""
        source, source_position = previous
        src_id = self._operand_specs_id(source, source_position)
        dst_id = self._operand_specs_id(consumer.index, position)
        type_ = resharded_type(self.graph.type_of(value_id), consumer, self.comm.model,
                               self.graph)
        costs = self._matrix(type_, src_id, dst_id, consumer.multiplier)
        if costs is None:
            return None
        costs, relayout = self._relayout(consumer, position, type_, src_id, dst_id, costs,
                                         consumer.multiplier)
        relayout = self._recomputed_source(value_id, consumer, src_id, dst_id, costs, relayout)
        relayout = self._written_for_reshard(value_id, consumer, src_id, dst_id, costs, relayout)
        return Edge(self.space.node_of[source], self.space.node_of[consumer.index], costs,
                    label=f"%{value_id} (as %{source} reads it) -> %{consumer.index}",
                    copies=self._copies(type_, dst_id), relayout=relayout)

    def _recomputed_source(self, value_id: int, consumer: Op, src_id: int, dst_id: int, costs,
                           relayout):
        """`relayout` with the bytes of the source a reshard of `value_id` is made from
        (tpu_buffers.recomputed_sources) held with the resharded copy, where the reshard
        splits a dim down to one element per device and the source is dead by the time
        `consumer` reads it (last read earlier: otherwise it is held anyway).

        XLA's partitioner moves a dim's shards with a reshape to [devices, rest] before the
        all-to-all; where one element per device is left the reshape only inserts size-1
        dims, a bitcast, and libtpu fuses the value's elementwise chain into it: the value is
        made again, from its source, in the all-to-all's layout, and the source stays live
        until then (libtpu 0.0.42, v5e:16x16: the logits' gradient `[b, s, vocab]` stored
        `[x, -, y]` and all-to-all'd to `[(x, y), -, -]` for the head's input gradient is made
        twice from the f32 logits with b = 256, once per device; with b = 512, two per
        device, the reshape splits the dim and the gradient is made once and bitcast). The
        source is held in the layout the reshard starts from (the chain is elementwise, so
        the source is laid out as the value)."""
        source = self.recomputed.get(value_id)
        if source is None or self.last_uses[source] >= consumer.index:
            return relayout
        return self._source_relayout(source, src_id, dst_id, costs, relayout, 1.0, True)

    def _written_for_reshard(self, value_id: int, consumer: Op, src_id: int, dst_id: int,
                             costs, relayout):
        """`relayout` less the bytes of the source of a value that only matmuls read and each
        recomputes (tpu_buffers.matmul_recomputed_sources), where the last of them reads it
        resharded: libtpu then writes the value once, for the collective (the resharded
        copy), and the source dies as it is made, rather than living until that reader as
        the estimate holds it for the recomputing readers (llama on v5e:16x16: the logits'
        gradient all-to-all'd for the head's input gradient, made once, the f32 logits dead
        after it). Credited over the copy's span, where the source would otherwise be held
        beside the copy."""
        source = self.matmul_recomputed.get(value_id)
        if source is None or consumer.index != max(self.graph.values[value_id].users):
            return relayout
        # An all-to-all down to one element per device makes the value again from its source
        # instead (_recomputed_source): the source lives until then, no credit.
        return self._source_relayout(source, src_id, dst_id, costs, relayout, -1.0, False)

    def _source_relayout(self, source: int, src_id: int, dst_id: int, costs, relayout,
                         sign: float, split_to_one: bool):
        """`relayout` plus `sign` x the bytes of `source` in the layout each reshard starts
        from, on the reshards (cells of nonzero cost) that do (`split_to_one`) or do not
        split a dim down to one element per device (_split_to_one)."""
        type_ = self.graph.type_of(source)
        src_specs, dst_specs = self.specs_of[src_id], self.specs_of[dst_id]
        rows = []
        for i, (src, row) in enumerate(zip(src_specs, costs)):
            held = 0.0 if src is None else self._held_bytes(type_, src)
            cells = []
            for j, (dst, seconds) in enumerate(zip(dst_specs, row)):
                cell = relayout[i][j] if relayout else 0.0
                if (seconds > 0 and held and dst is not None
                        and self._split_to_one(type_, src, dst) == split_to_one):
                    cell += sign * held
                cells.append(cell)
            rows.append(tuple(cells))
        return tuple(rows)

    def _split_to_one(self, type_: TensorType, src, dst) -> bool:
        """Whether resharding from layout `src` to `dst` is an all-to-all (axes leaving one dim
        for another) that leaves a dim it splits further one element per device."""
        after = local_shape(type_, dst, self.mesh)
        for d, (a, b, size) in enumerate(zip(src, dst, after)):
            moved = set(b) - set(a)
            if size == 1 and moved and any(moved & set(src[k]) for k in range(len(src))
                                           if k != d):
                return True
        return False

    def _held_bytes(self, type_: TensorType, spec, row_major: bool = False) -> float:
        """Bytes per device a value in layout `spec` holds: its local shard, in TPU tiles on a
        device model with `[buffers] tiled_layouts` (`row_major`: in the program's order of
        dims, see tpu_buffers.tiled_elements)."""
        if not self.comm.model.tiled_layouts:
            return local_bytes(type_, spec, self.mesh)
        shape = local_shape(type_, spec, self.mesh)
        return float(tiled_elements(shape, type_.itemsize, row_major) * type_.itemsize)

    def _tiled(self, op: Op, types, plain: Strategy, strategy: OpStrategy,
               row_major: bool) -> Strategy:
        """`plain` with its results held in TPU tiles. A scatter works in the program's order
        of dims (tpu_buffers.scatter_buffers): held while it is made, its result in that
        layout and a copy of its updates; its result is then copied into the default layout,
        which is what stays live."""
        memory = sum(self._held_bytes(t, spec) for t, spec in zip(types, strategy.results))
        if not row_major:
            relaid = self._relaid_operand(op, strategy.operands[0] if strategy.operands else None)
            if relaid:  # its table arrives rows-minor: copied row-major while it runs
                return replace(plain, memory=memory, transient=plain.transient + relaid,
                               compute_cost=plain.compute_cost
                               + 2 * relaid / self.comm.model.hbm_bandwidth)
            return replace(plain, memory=memory,
                           transient=self._loop_copy(op, strategy)
                           + self._loop_written(op, strategy),
                           accumulators=2 * memory if plain.accumulators else 0.0,
                           compute_cost=plain.compute_cost
                           + self._conv_loop_seconds(op, strategy))
        made = sum(self._held_bytes(t, spec, True) for t, spec in zip(types, strategy.results))
        n = len(op.results)
        window = tuple(op.attrs.get("update_window_dims", ()))
        for value_id, spec in zip(op.operands[n + 1:], strategy.operands[n + 1:]):
            type_ = self.graph.type_of(value_id)
            if type_ is not None and spec is not None:
                shape = scatter_updates_shape(local_shape(type_, spec, self.mesh), window)
                made += tiled_elements(shape, type_.itemsize, True) * type_.itemsize
        return replace(plain, memory=memory, transient=plain.transient + made - memory)

    def _loop_copy(self, op: Op, strategy: OpStrategy) -> float:
        """`strategy.transient`, where it is the copy of a convolution's input that its
        collective-matmul loop carries: in the MXU's input dtype and, with `[buffers]
        tiled_layouts`, the loop's tiled layout (tpu_buffers.conv_loop_operand_elements: a
        kernel gradient's loop can carry the activation with its images in the lanes)."""
        if (strategy.copied >= 0 and not self._stays_loop(strategy)
                and op.operands[strategy.copied] in self.reader_fused):
            return 0.0  # its chunk kernels recompute the operand, as any kernel would
        if (strategy.copied != 0 or op.name != "stablehlo.convolution"
                or not self.comm.model.tiled_layouts):
            return strategy.transient
        type_ = self.graph.type_of(op.operands[0])
        result = self.graph.type_of(op.results[0])
        spec = strategy.operands[0]
        itemsize = mxu_itemsize(type_, self.comm.model)
        chunk = local_shape(result, strategy.results[0], self.mesh)[op.attrs["output_batch"]]
        return float(itemsize * conv_loop_operand_elements(
            local_shape(type_, spec, self.mesh), op.attrs["input_feature"],
            op.attrs["input_batch"], chunk))

    def _relaid_loop_copy(self, op: Op, strategy: OpStrategy) -> float:
        """Bytes of `strategy`'s loop copy of a convolution's input (_loop_copy) where the
        loop stays a loop (_stays_loop) and carries the input with another dim in the lanes
        than the input's own layout (tpu_buffers.conv_loop_operand_dims against minor_dims:
        the images minor, the activation written channels-minor); 0 otherwise."""
        if (op.name != "stablehlo.convolution" or strategy.copied != 0
                or not self._stays_loop(strategy) or not self.comm.model.tiled_layouts):
            return 0.0
        if op.operands[0] in self.reader_fused:
            return 0.0  # written for the loop where it runs (_loop_written); no early copy seen
        shape = local_shape(self.graph.type_of(op.operands[0]), strategy.operands[0], self.mesh)
        chunk = local_shape(self.graph.type_of(op.results[0]), strategy.results[0],
                            self.mesh)[op.attrs["output_batch"]]
        carried = conv_loop_operand_dims(shape, op.attrs["input_feature"],
                                         op.attrs["input_batch"], chunk)
        return self._loop_copy(op, strategy) if carried[0] != minor_dims(shape)[0] else 0.0

    def _conv_loop_seconds(self, op: Op, strategy: OpStrategy) -> float:
        """HBM time of the kernels a convolution's collective-matmul loop that stays a loop
        (_stays_loop) runs besides its chunk convolutions and accumulators
        (strategies.collective_matmul_time):
        - a padded window: in each of the loop's n / 4 trips, one kernel slices and pads that
          trip's two chunks, reading the moving operand (the one holding the scattered dim)
          whole;
        - a loop that relays its input (_relaid_loop_copy): the input written in the MXU's
          input dtype (the one convolution would have read it from its producers) and copied
          into the loop's layout (read and written), three passes.
        linen_resnet's kernel gradients on v5e:2x4 (32 images per device, libtpu 0.0.42):
        `maximum` fusions writing `bf16[32,64,64,64]`, a `copy` into `{0,3,2,1}`, and a
        `dynamic-slice, pad` fusion in each trip of `windowed_dot_general_body_rs`. Counted
        in the operands' own elements, as the loop's other reads are."""
        if (op.name != "stablehlo.convolution" or not self._stays_loop(strategy)
                or not self.comm.model.tiled_layouts):
            return 0.0
        reduced = tuple(strategy.reduced_axes)
        scattered = [d for d, axes in enumerate(strategy.results[0]) if tuple(axes) == reduced]
        moving = {op.attrs["output_batch"]: 0, op.attrs["output_feature"]: 1}.get(
            scattered[0] if len(scattered) == 1 else -1)

        def mxu_bytes(k: int) -> float:
            type_ = self.graph.type_of(op.operands[k])
            return (mxu_itemsize(type_, self.comm.model)
                    * math.prod(local_shape(type_, strategy.operands[k], self.mesh)))

        moved = 0.0
        if moving is not None and any(op.attrs.get("padding") or ()):
            trips = math.prod(self.mesh.axis_sizes[a] for a in reduced) // 4
            moved += trips * mxu_bytes(moving)
        if self._relaid_loop_copy(op, strategy):
            moved += 3 * mxu_bytes(0)
        return moved / self.comm.model.hbm_bandwidth

    def _stays_loop(self, strategy: OpStrategy) -> bool:
        """Whether `strategy`'s collective-matmul loop stays a loop in libtpu's program: over
        n devices it runs n / 2 chunk steps in a body unrolled twice, n / 4 trips, and a loop
        of one trip (n = 4: the head's weight gradient reduce-scattered over y on v5e:2x4)
        is inlined, its two chunk kernels in the program (hf_bert, libtpu 0.0.42; over 8 and
        32 devices a `while` of `windowed_dot_general_body_rs`)."""
        n = math.prod(self.mesh.axis_sizes[a] for a in strategy.reduced_axes)
        return strategy.accumulators > 0 and n > 4

    def _loop_written(self, op: Op, strategy: OpStrategy) -> float:
        """Bytes a collective-matmul loop that stays a loop (_stays_loop) makes libtpu write of
        the operands it would otherwise recompute (reader_fused, tpu_buffers.reduced_fused_values):
        a loop carries its operands as buffers, so the value is written out, in the MXU's
        input dtype for the loop. Where the loop carries it in the layout libtpu gives the
        value itself (_loop_keeps_layout), one kernel writes it in bf16 for the loop and in
        its own type for the other readers, which read that instead of recomputing it, from
        its source, the three live together (hf_bert's logit gradient, 8 x 512 tokens per
        device on v5e:4x8: `(bf16[8,512,30522], f32[8,512,30522])` from the f32 logits):
        held with the loop, where the estimate keeps the source live. Where the loop wants
        another layout, the bias gradient's reduction fuses into the kernel writing the
        value in bf16, which the loop's copy is made from: that copy, already the strategy's
        transient, is all it adds (haiku_transformer on v5e:2x4, `(f32[32000],
        bf16[8,512,32000])` and a `copy` into the loop's layout; libtpu 0.0.42)."""
        if not self._stays_loop(strategy):
            return 0.0
        extra = 0.0
        for k, (value_id, spec) in enumerate(zip(op.operands, strategy.operands)):
            type_ = self.graph.type_of(value_id)
            if value_id not in self.reader_fused or spec is None or type_ is None:
                continue
            held = self._held_bytes(type_, spec)
            if k != strategy.copied:
                extra += held * mxu_itemsize(type_, self.comm.model) / type_.itemsize
            if (any(self.graph.ops[u].name not in MATMULS
                    for u in self.graph.values[value_id].users)
                    and self._loop_keeps_layout(op, strategy, k)):
                extra += held
        return extra

    def _carried_positions(self, op: Op) -> tuple[int, ...]:
        """The operand positions of `op` holding a norm output (tpu_buffers.normalized_values)
        that `op` is the last matmul to read: where a loop would carry it (_hold_carried_copies)."""
        positions = []
        for k, value_id in enumerate(op.operands):
            if value_id in self.normalized and op.index == max(
                    u for u in self.graph.values[value_id].users
                    if self.graph.ops[u].name in ("stablehlo.dot_general",
                                                  "stablehlo.convolution")):
                positions.append(k)
        return tuple(positions)

    def _loop_keeps_layout(self, op: Op, strategy: OpStrategy, position: int) -> bool:
        """Whether a collective-matmul loop carries dot operand `position` in the tiled layout
        libtpu gives the value on its own (tpu_buffers.minor_dims: the dims that pad least).
        The loop keeps the operand's last free dim minor where the result holds whole
        128-lane tiles of it (per device, per chunk where the loop chunks that dim), else its
        last contracted dim (the tokens a weight gradient sums over). Deviceless v5e:2x4 and
        4x8 compiles of biased heads' weight gradients (libtpu 0.0.42): vocabularies of 32,000
        (chunks of 4,000) carried tokens-minor, copied from the vocabulary-minor value;
        30,720 (chunks of 3,840) and 4,096 (512) vocabulary-minor, 30,528 and 4,000
        tokens-minor, hf_bert's 30,522 (the loop chunking the other operand) tokens-minor,
        as the value is: no copy."""
        if op.name != "stablehlo.dot_general" or position > 1:
            return True
        a = op.attrs
        side = ("lhs", "rhs")[position]
        type_ = self.graph.type_of(op.operands[position])
        batch, contracting = a[f"{side}_batch"], a[f"{side}_contracting"]
        free = [d for d in range(type_.rank) if d not in batch and d not in contracting]
        if not free or not contracting:
            return True
        lhs_rank = self.graph.type_of(op.operands[0]).rank
        lhs_free = lhs_rank - len(a["lhs_batch"]) - len(a["lhs_contracting"])
        result_dim = len(batch) + (0 if position == 0 else lhs_free) + len(free) - 1
        result = local_shape(self.graph.type_of(op.results[0]), strategy.results[0], self.mesh)
        loop_minor = free[-1] if result[result_dim] % 128 == 0 else contracting[-1]
        own = local_shape(type_, strategy.operands[position], self.mesh)
        return minor_dims(own)[0] == loop_minor

    def _relaid_operand(self, op: Op, spec) -> float:
        """Bytes of the row-major copy a rows-reading gather (tpu_buffers.gathers_rows) makes
        of its operand in layout `spec`, kept rows-minor in that layout (tpu_buffers.relaid_rows)."""
        if op.name != "stablehlo.gather" or spec is None:
            return 0.0
        type_ = self.graph.type_of(op.operands[0])
        if type_ is None or not gathers_rows(op.name, op.attrs, type_.rank):
            return 0.0
        return float(relaid_rows(local_shape(type_, spec, self.mesh), type_.itemsize))

    def _relayout(self, consumer: Op, position: int, type_, src_id: int, dst_id: int,
                  costs, multiplier: float):
        """Second copies of a resharded value that libtpu makes while resharding it, in bytes
        per (src, dst) layout pair, with their HBM traffic added to `costs`; (costs, ()) where
        none is made. Device models with `[buffers] tiled_layouts` only:
        - an all-gather of two or more dims at once (`[y, x]` to replicated): XLA gathers the
          shards on a new leading dim over all the axes and transposes them into place, a
          copy of the whole gathered value made from it (two chained copies on libtpu 0.0.42:
          the Llama-8B-class step's `f32[128256, 4096]` embedding table, 2.10 GB each);
        - a rows-reading gather's table (tpu_buffers.gathers_rows) resharded from a layout
          libtpu keeps rows-minor into one it keeps row-major: the collective keeps the
          rows-minor order and the gather copies the result row-major (tpu_buffers.relaid_rows;
          where the indexed dims are resharded too, libtpu relays the shard before the
          collective instead)."""
        if position < 0 or not self.comm.model.tiled_layouts:
            return costs, ()
        gather = position == 0 and gathers_rows(consumer.name, consumer.attrs, type_.rank)
        indexed = tuple(consumer.attrs.get("collapsed", ())) if gather else ()
        key = (type_, src_id, dst_id, multiplier, gather, indexed, id(costs))  # costs: cached
        found = self.relayout_cache.get(key)
        if found is not None:
            return found
        src_specs, dst_specs = self.specs_of[src_id], self.specs_of[dst_id]
        hbm = self.comm.model.hbm_bandwidth
        held = self._copies(type_, dst_id)
        relayout, priced = [], []
        for src, row in zip(src_specs, costs):
            cells, times = [], []
            for j, (dst, seconds) in enumerate(zip(dst_specs, row)):
                copy = 0.0
                if seconds > 0 and src is not None and dst is not None:
                    gathered = sum(1 for a, b in zip(src, dst) if a and set(a) - set(b))
                    if gathered >= 2:
                        copy = held[j]
                        seconds += 4 * copy / hbm * multiplier  # two copies, each read + write
                    elif (gather and all(src[d] == dst[d] for d in indexed)
                          and relaid_rows(local_shape(type_, src, self.mesh), type_.itemsize)
                          and not relaid_rows(local_shape(type_, dst, self.mesh), type_.itemsize)):
                        copy = held[j]
                        seconds += 2 * copy / hbm * multiplier
                cells.append(copy)
                times.append(seconds)
            relayout.append(tuple(cells))
            priced.append(tuple(times))
        found = (tuple(priced), tuple(relayout)) if any(map(any, relayout)) else (costs, ())
        self.relayout_cache[key] = found
        return found

    def _copies(self, type_, dst_id: int) -> tuple[float, ...]:
        """Bytes per device of a value resharded into each of the layouts `dst_id` lists."""
        key = (type_, dst_id)
        found = self.copies_cache.get(key)
        if found is None:
            found = tuple(0.0 if dst is None else self._held_bytes(type_, dst)
                          for dst in self.specs_of[dst_id])
            self.copies_cache[key] = found
        return found

    def _edges(self) -> list[Edge]:
        edges = []
        shared = self._shared_reshards()
        self.space.reads_via = shared
        for op_index in self.space.strategies:
            op = self.graph.ops[op_index]
            for k, value_id in enumerate(op.operands):
                previous = shared.get((op_index, k))
                if previous is not None:
                    edge = self._shared_edge(value_id, previous, op, k)
                else:
                    edge = self._edge(value_id, op, k, op.multiplier)
                if edge is not None:
                    edge = self._with_loop_copy(edge, op_index, k, previous)
                    self.read_edges[op_index, k] = len(edges)
                    edges.append(edge)
            if op.name == "while.carry" and "yield" in op.attrs:
                edge = self._edge(op.attrs["yield"], op, -1, op.attrs["yield_multiplier"])
                if edge is not None:
                    edges.append(edge)
        return edges

    def _with_loop_copy(self, edge: Edge, op_index: int, position: int,
                        previous: tuple[int, int] | None) -> Edge:
        """`edge` (the read of operand `position` by op `op_index`) with the bytes of the
        reader's collective-matmul loop copies of that operand (Edge.loop_copy) and, for a
        read sharing the previous matmul's reshard, that matmul's read edge (Edge.via).

        libtpu's loop reads a resharded operand where the reshard leaves it: llama on
        v5e:16x16's output-head weight-gradient loop reads the activation all-gathered for
        the forward head matmul (`all-gather.282` in the loop's tuple, no copy of it; 128 MiB
        per device), where an operand read in its producer's layout is copied into the loop's
        (the MLP on v5e:2x4: `copy` of each weight gradient's operand before its loop)."""
        # Every shared read names the read it shares, whether or not its own reader loops: a
        # later loop finds the copy through a chain of such reads.
        via = self.read_edges.get(previous) if previous is not None else None
        strategies = self.space.strategies[op_index]
        if not any(s.copied == position for s in strategies):
            return replace(edge, via=via) if via is not None else edge
        op = self.graph.ops[op_index]
        loop_copy = tuple(self._loop_copy(op, s) if s.copied == position else 0.0
                          for s in strategies)
        return replace(edge, loop_copy=loop_copy, via=via)

    def _hold_shared_copies(self, problem: ShardingProblem) -> ShardingProblem:
        """Edge.held on every read whose copy later matmuls read too (_shared_reshards): from
        the reader's first live point to the last of theirs among those that write a result.
        A later reader that writes none (ShardingProblem.made_only: a weight's input-gradient
        matmul fused into its reader) does not extend the span: a weight's copy is held on
        to its last matmul by _hold_weight_copies, less the weight-gradient points, as for
        any weight."""
        following = {previous: key for key, previous in self.space.reads_via.items()}
        if not following:
            return problem
        firsts = first_live_points(problem)
        unwritten = dict(problem.made_only)
        node_of = self.space.node_of
        edges = list(problem.edges)
        for key, e in self.read_edges.items():
            edge = edges[e]
            if not edge.copies or key not in following or edge.dst not in firsts:
                continue
            start = last = firsts[edge.dst]
            reader = key
            while reader in following:
                reader = following[reader]
                if node_of[reader[0]] not in unwritten:
                    last = max(last, firsts.get(node_of[reader[0]], last))
            if last > start:
                edges[e] = replace(edge, held=(start, last))
        return replace(problem, edges=tuple(edges))

    def _hold_carried_copies(self, problem: ShardingProblem) -> ShardingProblem:
        """Edge.carried on the reads of norm outputs (tpu_buffers.normalized_values) and
        gated products (tpu_buffers.gated_values) by the last matmul reading each: under a
        strategy whose collective-matmul loop stays a loop (_stays_loop), the value's bytes in the MXU's input dtype, held from the value's first
        reader to that loop (Edge.held). libtpu's kernels recompute such a value
        from its source, but a loop carries its operands as buffers: libtpu writes the value
        in bf16 where the forward pass recomputes it and keeps that buffer until the loop
        (hf_bart on v5e:2x4, libtpu 0.0.42, 8 x 512 tokens per device, its weight gradients
        `while` loops: `bf16[8,512,1024]` copies of the norm outputs live from the forward
        pass to the backward pass's loops; on v5e:16x16, no loops, none). An edge of its own
        beside the read's, costing nothing."""
        if not self.normalized:
            return problem
        edges = list(problem.edges)
        for (op_index, k), e in self.read_edges.items():
            op = self.graph.ops[op_index]
            if k not in self._carried_positions(op):
                continue
            value_id = op.operands[k]
            type_ = self.graph.type_of(value_id)
            carried = []
            for strategy in self.space.strategies[op_index]:
                spec = strategy.operands[k]
                # A loop copying a norm output holds that copy already (Strategy.transient);
                # a gated product is written for it in the forward pass all the same (hf_llama
                # on v5e:2x4: `bf16[8,512,8192]` live from the up matmul to the loop).
                carried.append(self._held_bytes(type_, spec)
                               * mxu_itemsize(type_, self.comm.model) / type_.itemsize
                               if self._stays_loop(strategy) and spec is not None
                               and (strategy.copied != k or value_id in self.gated) else 0.0)
            # From the first point checked after the value's first reader to the last
            # checked at or before the loop.
            start = bisect.bisect_left(self.point_ops, min(self.graph.values[value_id].users))
            end = bisect.bisect_right(self.point_ops, op_index) - 1
            if not any(carried) or end < start:
                continue
            # An edge of its own, costing nothing: the read's reshard keeps its own span.
            edge = edges[e]
            zeros = tuple((0.0,) * len(row) for row in edge.costs)
            edges.append(Edge(edge.src, edge.dst, zeros, label=f"{edge.label} (carried)",
                              carried=tuple(carried), held=(start, end)))
        return replace(problem, edges=tuple(edges))

    def _hold_relaid_loop_copies(self, problem: ShardingProblem) -> ShardingProblem:
        """Edge.carried on each convolution's read of its input, under the strategies whose
        loop copies that input into another layout (_relaid_loop_copy): the copy's bytes, from
        the point where the loops' accumulators are allocated (accumulator_spans: the first
        node that can loop), or the first after the input is made if later, to the last point
        before the loop, whose own point holds the copy as its transient.

        libtpu makes these copies with the accumulators, before the backward pass, and holds
        them until their loops, which it runs after the rest of the backward pass:
        linen_resnet on v5e:2x4 (32 images per device, libtpu 0.0.42) copies the inputs of
        its three images-minor kernel-gradient loops (`bf16[32,64,64,64]{0,3,2,1}`, 64 MiB,
        and 32 and 16 MiB) right after the forward pass, beside the accumulators'
        `AllocateBuffer` calls, all three live at its peak in the backward pass of the third
        block. A loop carrying the input in its own layout reads it with no copy. An edge of
        its own beside the read's, costing nothing."""
        made = first_live_points(problem)
        spans = accumulator_spans(problem, made)
        if not spans:
            return problem
        allocated = spans[0][1]
        edges = list(problem.edges)
        for (op_index, k), e in self.read_edges.items():
            op = self.graph.ops[op_index]
            if k != 0 or op.name != "stablehlo.convolution":
                continue
            node = self.space.node_of.get(op_index)
            if node not in made:
                continue
            carried = tuple(self._relaid_loop_copy(op, s)
                            for s in self.space.strategies[op_index])
            made_at = bisect.bisect_left(self.point_ops, self.graph.values[op.operands[0]].producer)
            start = max(allocated, made_at)
            end = made[node] - 1
            if not any(carried) or end < start:
                continue
            edge = edges[e]
            zeros = tuple((0.0,) * len(row) for row in edge.costs)
            edges.append(Edge(edge.src, edge.dst, zeros,
                              label=f"{edge.label} (relaid for its loop)", carried=carried,
                              held=(start, end)))
        return replace(problem, edges=tuple(edges))

    def _hold_weight_copies(self, problem: ShardingProblem) -> ShardingProblem:
        """Edge.held on every resharded copy of a program argument (a weight) that a matmul
        reads, to the last matmul of its region reading that argument, less the points where
        a matmul that reads no argument and can hold partial sums (a weight gradient) is made
        (Edge.released).

        libtpu gathers each weight once, for its forward matmul, and holds that copy until
        the backward input-gradient matmul reads it: every weight of haiku_transformer,
        hf_llama and hf_bart in their v5e:16x16 dumps. It runs the weight-gradient matmuls
        after the whole input-gradient chain, when the copies are gone (hf_bart on
        v5e:16x16), so their partial sums are not held beside them. A matmul whose result is
        never written out (fused into its reader, or sliced through: an output head read as
        `logits[:, :-1]`, tpu_buffers.sliced_matmuls) reads its copy where it is made
        (ShardingProblem.made_only), from where it is held alike (hf_llama on v5e:4x8, 8 x
        512 tokens per device: the head weight all-gathered, 125 MiB in bf16, live from the
        head's forward matmul to its input gradient; haiku_transformer's attention
        projections, fused into their reshapes, on v5e:16x16: their 2 MiB copies live from
        the forward pass to the backward pass)."""
        graph, space = self.graph, self.space
        arguments = set(graph.arguments)
        made = first_live_points(problem)
        late = set()
        for op_index, node in space.node_of.items():
            op = graph.ops[op_index]
            if (op.name in MATMULS and node in made
                    and not any(v in arguments for v in op.operands)
                    and any(s.transient for s in problem.nodes[node].strategies)):
                late.add(made[node])
        spans = {e: (start, end) for e, start, end in copy_spans(problem, made)}
        edges = list(problem.edges)
        for (op_index, position), e in self.read_edges.items():
            op = graph.ops[op_index]
            value_id = op.operands[position]
            if not edges[e].copies or op.name not in MATMULS or value_id not in arguments:
                continue
            if e not in spans:
                continue
            where = (op.parent, op.region)
            last_reader = max(u for u in graph.values[value_id].users
                              if graph.ops[u].name in MATMULS
                              and (graph.ops[u].parent, graph.ops[u].region) == where)
            # The last point checked at or before that reader: the copy is live there.
            last = bisect.bisect_right(self.point_ops, last_reader) - 1
            start, end = spans[e]
            if last <= end:
                continue
            released = tuple(sorted(p for p in late if end < p <= last))
            edges[e] = replace(edges[e], held=(start, last),
                               released=edges[e].released + released)
        return replace(problem, edges=tuple(edges))

    # -- memory -------------------------------------------------------------------------------

    @functools.cached_property
    def last_uses(self) -> dict[int, int]:
        """Value id -> the last program point where it is live."""
        graph = self.graph
        end = len(graph.ops)
        last_use = {}
        region_end: dict[int, int] = {}
        for op in graph.ops:
            if op.parent is not None:
                region_end[op.parent] = max(region_end.get(op.parent, 0), op.index)
        for value in graph.values:
            last_use[value.id] = max((u for u in value.users if u >= value.producer),
                                     default=value.producer)
        # A loop-carried value lives until the end of its loop's body.
        loop_of = {c: o.index for o in graph.ops if o.name == "stablehlo.while"
                   for c in o.attrs.get("carries", [])}
        for op in graph.ops:
            if op.name == "while.carry" and "yield" in op.attrs:
                loop_end = region_end.get(loop_of[op.index], op.index)
                for value_id in (op.attrs["yield"], op.results[0]):
                    last_use[value_id] = max(last_use[value_id], loop_end)
        # An optimization barrier's result is its operand's buffer: an operand whose last
        # use is the barrier dies as the result is born, not beside it.
        for op in graph.ops:
            if op.name == "barrier.result" and last_use[op.operands[0]] == op.index:
                operand = op.operands[0]
                last_use[operand] = max(graph.values[operand].producer, op.index - 1)
        for value_id in graph.arguments + graph.outputs:
            last_use[value_id] = end
        # A value fused into its consumers is computed there: its operands live until then
        # (in reverse program order, so that chains of fused values carry through).
        for op in reversed(graph.ops):
            until = max((last_use[v] for v in op.results if v in self.unmaterialized), default=None)
            if until is not None:
                for value_id in op.operands:
                    last_use[value_id] = max(last_use[value_id], until)
        # A convolution sum written into the buffer of a value its kernel adds in last
        # (tpu_buffers.in_place_sums): that value dies as the sum is born, as at a barrier.
        for written, operand in self.in_place.items():
            made = graph.values[written].producer
            if last_use[operand] == made:
                last_use[operand] = max(graph.values[operand].producer, made - 1)
        return last_use

    def _lifetimes(self) -> tuple[dict[int, list[int]], dict[int, list[int]]]:
        """Values born (first live) and dying (last live) at each program point."""
        graph = self.graph
        last_use = self.last_uses
        arguments = set(graph.arguments)
        births: dict[int, list[int]] = {}
        for value in graph.values:
            births.setdefault(0 if value.id in arguments else value.producer, []).append(value.id)
        deaths: dict[int, list[int]] = {}
        for value_id, last in last_use.items():
            deaths.setdefault(last, []).append(value_id)
        return births, deaths

    def _live_points(self, nodes: list[Node], edges: list[Edge]
                     ) -> tuple[list[LivePoint], list[LiveRange], tuple[tuple[int, int], ...]]:
        """Memory checks at the program points whose live sets are maximal, the run of
        checks where each node is live, and the check where each node that holds no results
        is made (ShardingProblem.made_only).

        Point t holds the values born at or before t that die at or after t. Values are born
        once and die once, so point t's live set is contained in point t-1's exactly when no
        value is born at t and some value died at t-1, and in point t+1's exactly when none
        dies at t and some value is born at t+1: those points can never bind and are skipped,
        as is a point where no node or fixed bytes came since the previous check. The
        nodes and fixed bytes are kept up to date from these birth and death events, and a
        node (all of whose values are born together) is live over one run of consecutive
        checks: work and output are linear in the program, never a live set per point.
        """
        graph, space = self.graph, self.space
        births, deaths = self._lifetimes()
        end = len(graph.ops)
        arguments = set(graph.arguments)
        aliases = graph.output_aliases()
        # An output written into a donated argument's buffer takes no memory of its own (XLA
        # copies the argument if it is still read after the output is made: not modelled;
        # an update reads it last). Any other output has its own buffer, which XLA allocates
        # for the whole program: it is held from the start, though made later (where it holds
        # its transient bytes).
        in_donated = {v for k, v in enumerate(graph.outputs)
                      if k in aliases and v not in arguments}
        whole_program = {v for v in graph.outputs if v not in arguments and v not in in_donated}
        # What a live value costs: its producer's node, or bytes no decision changes.
        owner: dict[int, int] = {}
        fixed_of: dict[int, float] = {}
        node_of = space.node_of
        for value in graph.values:
            if value.type is None or value.id in self.unmaterialized or value.id in in_donated:
                continue
            if value.producer in space.strategies:
                owner[value.id] = node_of[value.producer]
            elif value.id not in space.free_values:
                # Free values (constants, splats) are fused into their consumers by XLA: no bytes.
                fixed_of[value.id] = self._held_bytes(value.type, replicated(value.type.rank))
        # A matmul whose result its reader's kernel takes (an output fusion: no buffer) holds
        # no value, yet, as a collective-matmul loop that stays a loop, it holds a buffer of an
        # operand its readers would recompute (its copy, or _loop_written's): checked at its
        # own point, where those bytes are held, with its result live there alone.
        for op in graph.ops:
            if (op.index in space.strategies and op.results
                    and all(v in self.unmaterialized for v in op.results)
                    and any(v in self.reader_fused for v in op.operands)
                    and any(self._loop_copy(op, s) + self._loop_written(op, s)
                            for s in space.strategies[op.index] if self._stays_loop(s))):
                value_id = op.results[0]
                owner[value_id] = node_of[op.index]
                deaths[self.last_uses[value_id]].remove(value_id)
                deaths.setdefault(op.index, []).append(value_id)
        # A node none of whose values is written out (fused into its readers, or written into
        # a donated argument's buffer) still runs its kernel where they are made: there it
        # holds its transient bytes (partial sums before their reduce-scatter) and the copies
        # it reads (an operand all-gathered for it), at the first check from that point on,
        # as a node whose values are written would. Only nodes that can hold such bytes.
        holding = {n for n, node in enumerate(nodes) if any(s.transient for s in node.strategies)}
        holding.update(e.dst for e in edges if any(e.copies) or any(e.carried))
        unwritten = {node_of[op.index] for op in graph.ops
                     if op.index in space.strategies and op.results
                     and node_of[op.index] in holding
                     and not any(v in owner for v in op.results)}
        made_only: dict[int, int] = {}  # such a node -> the check where it is made
        unmade_only: list[int] = []  # such nodes made since the last check
        count: dict[int, int] = {}  # node -> its live values
        first: dict[int, int] = {}  # live node -> its first check (absent: none yet)
        waiting: list[int] = []  # nodes born since the last check
        ranges: list[LiveRange] = []
        fixed = 0.0
        # Whether a node or fixed bytes came since the last check: if none did, this point's
        # nodes and bytes are at most the last check's (for any choice), so it cannot bind.
        grew = False
        points: list[LivePoint] = []
        made: dict[int, int] = {}  # node of a whole-program output -> the check where it is made
        unmade: set[int] = set()  # such nodes not made yet
        making: list[int] = []  # of those, the ones made since the last check
        for value_id in whole_program:
            node = owner.get(value_id)
            if node is not None:
                count[node] = count.get(node, 0) + 1
                if node not in unmade:
                    waiting.append(node)
                    unmade.add(node)
            elif value_id in fixed_of:
                fixed += fixed_of[value_id]
            grew = True
        for t in range(end + 1):
            born = births.get(t, ())
            if t < end and node_of.get(t) in unwritten and node_of[t] not in made_only:
                unmade_only.append(node_of[t])
                grew = True
            for value_id in born:
                node = owner.get(value_id)
                if value_id in whole_program:
                    grew = True  # made here: a check where its transient bytes are held
                    if node in unmade:
                        unmade.discard(node)
                        making.append(node)
                elif node is not None:
                    if node not in count:
                        count[node] = 0
                        waiting.append(node)
                        grew = True
                    count[node] += 1
                elif value_id in fixed_of:
                    fixed += fixed_of[value_id]
                    grew = True
            dying = deaths.get(t, ())
            contained = ((t > 0 and not born and deaths.get(t - 1))
                         or (t < end and not dying and births.get(t + 1)))
            if grew and not contained:
                grew = False
                for node in waiting:
                    if node in count:
                        first[node] = len(points)
                waiting.clear()
                for node in making:
                    made[node] = len(points)
                making.clear()
                for node in unmade_only:
                    made_only[node] = len(points)
                unmade_only.clear()
                label = graph.ops[t].label if t < end else "end"
                points.append(LivePoint((), fixed, label=f"after %{t} {label}"))
                self.point_ops.append(t)
            for value_id in dying:
                node = owner.get(value_id)
                if node is not None:
                    count[node] -= 1
                    if count[node] == 0:
                        del count[node]
                        if node in first:
                            ranges.append(_live_range(node, first.pop(node), len(points) - 1,
                                                      made.get(node)))
                elif value_id in fixed_of:
                    fixed -= fixed_of[value_id]
        for node, start in first.items():  # live to the end (arguments)
            ranges.append(_live_range(node, start, len(points) - 1, made.get(node)))
        ranges.sort(key=lambda r: r.node)
        return points, ranges, tuple(sorted(made_only.items()))


# Ops XLA moves a narrowing convert through (to their operand): a pad read only by matmuls
# pads the bf16 value (libtpu: `bf16[8,512,50257] pad(bf16[8,511,50257])`).
_CONVERT_MOVERS = ("stablehlo.pad",)


def tpu_unmaterialized(graph: Graph, kept_fused: set[int]) -> set[int]:
    """The values XLA's TPU compiler writes no buffer for: every fused value (reductions
    fuse the elementwise work they read) but the sums it writes once for several kernels
    (tpu_buffers.combined_values), the one-element scatters into splats it rewrites as
    fused selects (tpu_buffers.fused_selects), matmul results it slices through
    (tpu_buffers.sliced_matmuls), matmul operands computed inside the matmuls
    (tpu_buffers.operand_fused_values), values read by reductions and matmuls that each of
    them recomputes (tpu_buffers.reduced_fused_values), the matmul results of residual sums
    written in their place (tpu_buffers.reduced_matmul_sums) and the norm outputs, gated
    products and biased activations every reader recomputes (tpu_buffers.normalized_values,
    gated_values, biased_activations), less the operands of written-out pads."""
    return tpu_fusion(graph, kept_fused)[0]


def tpu_fusion(graph: Graph, kept_fused: set[int]
               ) -> tuple[set[int], set[int], set[int], set[int]]:
    """(tpu_unmaterialized, the values of it that every reader recomputes beside reductions:
    tpu_buffers.reduced_fused_values, the norm outputs, gated products and biased activations
    of it that every reader recomputes and a loop carries: tpu_buffers.normalized_values,
    gated_values and biased_activations, the last two alone). A residual sum that a matmul's kernel writes in place of
    the matmul result (tpu_buffers.reduced_matmul_sums) is written, the matmul result not."""
    free = free_values(graph)
    combined = combined_values(graph, kept_fused, free)
    out = set(kept_fused) - combined
    out |= fused_selects(graph, free) | sliced_matmuls(graph)
    for written, chain in reduced_matmul_sums(graph, out).items():
        out = (out - {written}) | chain
    # A matmul whose kernel writes a combined value (a residual sum) keeps its result's
    # buffer until that value is made, its last reader: the node holds the matmul's copies
    # and transient bytes there (a node with no value written out holds them where it is
    # made: ShardingProblem.made_only).
    out |= output_fused_matmuls(graph, out | combined)
    out |= operand_fused_values(graph, out, free)
    reduced = reduced_fused_values(graph, out, free)
    out |= reduced
    normalized = normalized_values(graph, out, free)
    out |= normalized
    # Gated products and biased activations are recomputed alike, and carried by loops alike
    # (_hold_carried_copies).
    gated = gated_values(graph, out, free)
    gated |= biased_activations(graph, out | gated, free)
    out |= gated
    normalized = normalized | gated
    repeated = broadcast_operands(graph, out)
    out |= set(repeated)
    out -= set(repeated.values())  # the repeated value itself is written out
    out -= pad_operands(graph, out)
    return out, reduced & out, normalized & out, gated & out


def matmul_narrowed(graph: Graph, folded: set[int], dtype: str) -> dict[int, float]:
    """Ops whose f32 results are read only by matmuls (directly or through transposes folded
    into them), on a compiler that runs f32 matmuls on `dtype` operands: XLA's TPU compiler
    converts such a value to bf16 inside the kernel that makes it and writes it out in bf16
    (a cross entropy's logit gradients, an MLP's activations kept for the weight gradient);
    not for a dot_general it computes as a multiply and a reduction (_vector_product). An
    elementwise value read by reductions as well as by matmuls is narrowed too: the kernel
    that makes it computes the reductions from the f32 values (a multi-output fusion) and
    writes the value for the matmuls only, in bf16 (libtpu 0.0.42: Flax BERT's output-head
    logit gradient, read by the bias gradient's reduce_sum and two matmuls, is one fusion
    writing `f32[vocab]` and the `bf16[b,s,vocab]` gradient; hf_bert on v5e:2x4, its f32
    logits in HBM; with logits small enough for VMEM it recomputes the gradient in each
    reader instead and writes none, which the bf16 bytes bound). A transpose folded into
    matmuls holds bf16 too where it holds a buffer of its own (a reshard into it): libtpu
    converts before the collective (Flax GPT-2's tied embedding, all-gathered for the output
    head as `bf16[50257,768]`, 77 MB, not 154 in f32).
    Op index -> the bytes written per byte of the result type."""
    matmuls = ("stablehlo.dot_general", "stablehlo.convolution")

    def read_by_matmuls(value_id: int) -> bool:
        users = graph.values[value_id].users
        return bool(users) and all(
            (graph.ops[u].name in matmuls and not _vector_product(graph.ops[u], graph))
            or ((u in folded or graph.ops[u].name in _CONVERT_MOVERS)
                and read_by_matmuls(graph.ops[u].results[0])) for u in users)

    def reduced_beside(op: Op, value_id: int) -> bool:
        """An elementwise op's value read by matmuls (as read_by_matmuls) and by reductions
        of its region: they fuse into the kernel making it, which writes it for the matmuls."""
        users = [graph.ops[u] for u in graph.values[value_id].users]
        reduces = [u for u in users if u.name == "stablehlo.reduce"
                   and (u.parent, u.region) == (op.parent, op.region)]
        if (not reduces or len(reduces) == len(users)
                or op.name.removeprefix("stablehlo.") not in ELEMENTWISE):
            return False
        return all(u in reduces
                   or (u.name in matmuls and not _vector_product(u, graph))
                   or ((u.index in folded or u.name in _CONVERT_MOVERS)
                       and read_by_matmuls(u.results[0])) for u in users)

    outputs = set(graph.outputs)
    narrow = dtype_bytes(dtype)
    out = {}
    for op in graph.ops:
        if op.name == "arg" or not op.results:
            continue
        types = [graph.type_of(v) for v in op.results]
        if all(t is not None and t.dtype == "f32" and v not in outputs
               and (read_by_matmuls(v) or reduced_beside(op, v))
               for t, v in zip(types, op.results)):
            out[op.index] = narrow / 4
    return out


def hold_copies_across_loops(problem: ShardingProblem) -> ShardingProblem:
    """`problem` with the resharded copies an op reads held from the previous live point too
    when a node that can run as a collective-matmul loop (Strategy.accumulators) is made
    there. libtpu's scheduler makes the reshards of the op after such a loop before the loop,
    to overlap them with it: on the Llama-8B-class step on v5e:16x16 the output head's input
    gradient reads the head weight all-gathered (started before the weight-gradient loop,
    continued inside it) and the logits' gradient all-to-all'd (run before the loop), both
    live across it; the loops of its MLP weight gradients carry the next ops' all-gathers
    too. The span does not depend on the plan: a plan whose matmul there does not loop holds
    the copies there as well."""
    made = first_live_points(problem)
    loops = {point for _, _, point in accumulator_spans(problem, made)}
    if not loops:
        return problem
    edges = list(problem.edges)
    for e, start, end in copy_spans(problem, made):
        if start - 1 in loops and made.get(edges[e].dst) != start - 1:
            edges[e] = replace(edges[e], held=(start - 1, end))
    return replace(problem, edges=tuple(edges))


def _live_range(node: int, first: int, last: int, made: int | None) -> LiveRange:
    """`made`: the check where the node's values are made, if not its first (an output)."""
    return LiveRange(node, first, last, made_at=made if made is not None and made != first
                     else None)


def scatter_first_layout(src, dst, reduced, shape, axis_sizes):
    """The layout libtpu reduce-scatters a value summed over `reduced` into when its reader
    wants it in `dst` (an all-reduce and a slice over those axes: XLA's reduce-scatter
    creator): `src` with each summed axis on the dim `dst` has it, in `dst`'s order on that
    dim; the rest of the reshard goes from there (hf_bert's embedding lookup, `[-, -, y]`
    summed over x and read `[y, x, -]`: reduce-scattered to `[-, x, y]`, then an all-to-all
    over y). None where `dst` leaves a summed axis out or the layout does not divide."""
    if not reduced:
        return None
    dim_of = {axis: d for d, axes in enumerate(dst) for axis in axes}
    if any(axis not in dim_of for axis in reduced):
        return None
    mid = [list(axes) for axes in src]
    for d, axes in enumerate(dst):
        mid[d].extend(axis for axis in axes if axis in reduced)
    for size, axes in zip(shape, mid):
        split = 1
        for axis in axes:
            split *= axis_sizes[axis]
        if size % split:
            return None
    return tuple(tuple(axes) for axes in mid)


def scatter_first_bytes(comm: CommModel, type_: TensorType, src, reduced, mid=None
                        ) -> tuple[float, float]:
    """(The partial sums, the collective-permute bytes) of a scatter-first gather's
    reduce-scatter from `src` (CommModel.tiled_scatter; a gather's result is kept in the
    program's order of dims): onto the dim `mid` has the summed axes on where its readers take
    `mid` itself, else onto the first dim (scatter_first_reshard)."""
    n = shards((tuple(reduced),), comm.mesh)
    dims = {d for d, axes in enumerate(mid or ()) if any(a in reduced for a in axes)}
    dim = dims.pop() if len(dims) == 1 else 0
    shard = list(local_shape(type_, src, comm.mesh))
    shard[dim] = -(-shard[dim] // n)
    return comm.tiled_scatter(shard, type_.itemsize, dim, n, row_major=True)


def scatter_first_reshard(comm: CommModel, type_: TensorType, reduced, mid, dst) -> ReshardCost:
    """From the reduce-scatter to the reader's layout `dst`. Where `dst` is `mid` (only the
    slice), nothing more. Elsewhere libtpu scatters onto the first dim (the shard one
    contiguous block: its `all-reduce-scatter` kernel), moves the summed axes `mid` has on
    other dims there by an all-to-all of the scattered shard, then reshards from `mid`
    (hf_bert, haiku_transformer and models.py's bert on v5e:2x4: `[-, -, y]` summed over x and
    read `[y, x, -]` compile to a reduce-scatter over x, an all-to-all over x and one over y;
    keras_gemma's `[-, -, x]` summed over y and read `[y, x, -]`, with `mid` `[y, -, x]`, to a
    reduce-scatter over y and an all-to-all over x)."""
    if mid == dst:
        return ReshardCost(0.0)
    nbytes = local_bytes(type_, mid, comm.mesh)
    rest = comm.reshard(type_.shape, type_.itemsize, mid, dst)
    moved = tuple(axis for axis in reduced if axis not in mid[0])
    if not moved:
        return rest
    sent = comm.bytes_sent("all-to-all", nbytes, moved)
    return ReshardCost(rest.seconds + comm.all_to_all(nbytes, moved),
                   (("all-to-all", moved, sent), *rest.collectives))


def scatter_first_reads(state: CompileState) -> dict[int, tuple]:
    """Of the chosen plan, the scatter-first gathers (_scatter_first_gathers) whose readers'
    layouts all take the slice from one reduce-scattered layout: gather op index -> (that
    layout, its readers' op indices)."""
    out = {}
    for op_index, (reads, _) in state.space.scatter_first.items():
        chosen = state.chosen(op_index)
        if {kind for kind, _, _ in chosen.collectives} != {"all-reduce"}:
            continue
        value = state.graph.values[state.graph.ops[op_index].results[0]]
        mids = {scatter_first_layout(chosen.results[0], state.chosen(reader).operands[position],
                                     chosen.reduced_axes, value.type.shape,
                                     state.options.mesh.axis_sizes)
                for reader, position in reads}
        if len(mids) == 1 and None not in mids:
            mid = mids.pop()
            # Whether every reader takes `mid` itself: the scatter lands on its dims.
            direct = all(state.chosen(reader).operands[position] == mid
                         for reader, position in reads)
            out[op_index] = (mid, {reader for reader, _ in reads}, direct)
    return out



def sliced_layout(strategy, dst, type_: TensorType, mesh, permuted: bool = False):
    """The reduce-scattered layout (scatter_first_layout) of the result of `strategy`, an
    all-reduce over its summed axes, where a reader taking layout `dst` takes one slice of it
    over those axes (`dst` itself): libtpu then compiles the all-reduce and the slice as one
    reduce-scatter (_sliced_all_reduces). None elsewhere. Only a slice along one dim: XLA's
    reduce-scatter creator matches no other (MatchReduceScatter's allow_multiple_split_dims
    is false). With `permuted`, also where `dst` has the same axes on each dim in another
    order (permuted_slice)."""
    reduced = strategy.reduced_axes
    if (dst is None or not reduced
            or {kind for kind, _, _ in strategy.collectives} != {"all-reduce"}
            or sum(any(axis in reduced for axis in axes) for axes in dst) != 1):
        return None
    mid = scatter_first_layout(strategy.results[0], dst, reduced, type_.shape, mesh.axis_sizes)
    return mid if mid == dst or (permuted and permuted_slice(mid, dst)) else None


def sliced_read(strategy, dst, type_: TensorType, mesh, permuted: bool = False) -> bool:
    """Whether a reader taking layout `dst` takes one slice of `strategy`'s all-reduce over
    its summed axes (sliced_layout)."""
    return sliced_layout(strategy, dst, type_, mesh, permuted) is not None


def permuted_slice(mid, dst) -> bool:
    """Whether `dst` has `mid`'s axes on each dim in another order: libtpu takes the slice
    `mid` of the all-reduce, which hlo_stats counts as a reduce-scatter, and a
    collective-permute puts the shards in `dst`'s order (hf_bert's word-embedding gradient on
    v5e:16x16, `[-, y]` summed over x and read `[-, (x, y)]`: all-reduced over x, sliced to
    `[-, (y, x)]`, permuted)."""
    return (mid is not None and mid != dst and len(mid) == len(dst)
            and all(sorted(a) == sorted(b) for a, b in zip(mid, dst)))


def sliced_charge(comm: CommModel, type_: TensorType, strategy, dst, mesh,
                  multiplier: float) -> float:
    """Seconds the reduce-scatter libtpu makes of `strategy`'s all-reduce and a reader's slice
    `dst` of it (sliced_read) costs beyond the all-reduce (0 where it costs less, or where
    `dst` does not slice): its partial sums and collective-permute as plan.json lists them
    (scatter_first_bytes)."""
    if not sliced_read(strategy, dst, type_, mesh):
        return 0.0
    reduced = strategy.reduced_axes
    nbytes, permuted = scatter_first_bytes(comm, type_, strategy.results[0], reduced, dst)
    seconds = comm.collective("reduce-scatter", nbytes, reduced)
    if permuted:
        seconds += comm.collective_permute(permuted, reduced)
    return max(0.0, seconds * multiplier - strategy.communication)


def sliced_all_reduces(state: CompileState) -> dict[int, tuple]:
    """Of the chosen plan, the sliced all-reduces (_sliced_all_reduces) whose readers all take
    one slice of the result over the summed axes (sliced_read): compiled as one reduce-scatter
    (and priced so where it costs more than the all-reduce: sliced_charge), and hlo_stats
    counts such an all-reduce so on the compiled side. Op index -> (the reduce-scattered
    layout, its readers' op indices, True), as scatter_first_reads."""
    graph = state.graph
    out = {}
    for op_index, reads in state.space.sliced.items():
        chosen = state.chosen(op_index)
        value = graph.values[graph.ops[op_index].results[0]]
        layouts = {reader: state.chosen(reader).operands for reader, _ in reads}
        dsts = {layouts[reader][position] if position < len(layouts[reader]) else None
                for reader, position in reads}
        if len(dsts) == 1:
            mid = sliced_layout(chosen, dsts.pop(), value.type, state.options.mesh,
                                permuted=True)
            if mid is not None:
                out[op_index] = (mid, {reader for reader, _ in reads}, True)
    return out


# Ops whose every attribute the graph records (ir.op_attributes), so that two with the same
# name, operands, attributes and result types compute the same value.
_MERGEABLE = ({f"stablehlo.{name}" for name in ELEMENTWISE}
              | {"stablehlo.broadcast_in_dim", "stablehlo.reshape", "stablehlo.transpose",
                 "stablehlo.slice", "stablehlo.pad", "stablehlo.concatenate",
                 "stablehlo.dot_general", "stablehlo.reduce"})


def identical_key(graph: Graph, op: Op) -> tuple | None:
    """What XLA's CSE compares: two ops with the same key in one computation are one op after
    it (None: an op it is not known to merge, or whose attributes the graph leaves out)."""
    if op.name not in _MERGEABLE or not op.operands:
        return None
    if op.attrs.get("combiner") == "complex":
        return None  # a reduction body the graph does not record
    types = tuple(graph.type_of(v) for v in op.results)
    return (op.name, op.operands, repr(sorted(op.attrs.items())), types, op.parent, op.region)


def chosen_reshards(state: CompileState):
    """The resharding the chosen plan does: (consumer op, value id, src spec, dst spec, multiplier)
    for every operand (and loop-carried value) whose producer's layout differs from the one its
    consumer's strategy needs. The source is the earlier matmul's layout of the value where
    propagate-sharding reshards it from there (_shared_reshards)."""
    from hloplan.passes.propagate_sharding import PropagateSharding

    graph, space = state.graph, state.space
    for op_index in space.strategies:
        op = graph.ops[op_index]
        chosen = state.chosen(op_index)
        pairs = [(v, chosen.operands[k] if k < len(chosen.operands) else None, op.multiplier, k)
                 for k, v in enumerate(op.operands)]
        if op.name == "while.carry" and "yield" in op.attrs:
            pairs.append((op.attrs["yield"], chosen.results[0], op.attrs["yield_multiplier"],
                          None))
        for value_id, required, multiplier, position in pairs:
            value = graph.values[value_id]
            if (required is None or value.type is None or value_id in space.free_values
                    or value.producer not in space.strategies):
                continue
            given = state.chosen(value.producer).results[value.result_index]
            if given == required:
                continue
            via = space.reads_via.get((op_index, position))
            if via is not None and PropagateSharding._from_earlier(state, value_id, via, given,
                                                                   required):
                given = state.chosen(via[0]).operands[via[1]]
                if given == required:
                    continue  # the earlier reader's copy, as it is
            yield op, value_id, given, required, multiplier


def reassociated(state: CompileState) -> set[tuple[int, str, str]]:
    """(op index, kind, axes) of the result collectives of the chosen plan that the compiler
    folds into another (device model [collectives] reassociate; XLA's AllReduceReassociate and
    ReduceScatterReassociate): where an add is the only reader of two values whose producers
    each end in an all-reduce or reduce-scatter of the same kind and axes, and reads them in
    the layouts they are made in, XLA adds the partial results and runs one collective. Of
    each such pair, the second producer's collective is listed here; a sum of several such
    values (an add of such adds) folds them all."""
    if not state.options.device.reassociate:
        return set()
    graph, space = state.graph, state.space
    folded = set()
    carries: dict[int, set] = {}  # a folding add -> the collectives its sum still ends in
    for op_index in sorted(space.strategies):
        op = graph.ops[op_index]
        if op.name != "stablehlo.add" or len(op.operands) != 2 or op.operands[0] == op.operands[1]:
            continue
        sides = []
        for k, value_id in enumerate(op.operands):
            producer = _collective_source(state, op_index, k, value_id)
            if producer is None:
                break
            sides.append((producer, carries.get(producer) or {
                (kind, axes) for kind, axes, _ in state.chosen(producer).collectives
                if kind in ("all-reduce", "reduce-scatter")}))
        else:
            (_, first), (second, theirs) = sides
            common = first & theirs
            if common:
                carries[op_index] = common
            for kind, axes in sorted(common):
                if second not in carries:  # an add's collective is its first side's
                    folded.add((second, kind, axes))
    return folded


# Ops that only rearrange their operand's elements: XLA folds them into the producing kernel's
# output, so a collective before them still meets the add (as far as reassociation goes).
_REARRANGING = frozenset({"stablehlo.transpose", "stablehlo.reshape", "stablehlo.convert"})


def _collective_source(state: CompileState, reader: int, position: int, value_id: int):
    """The op whose result collective reaches operand `position` of op `reader`, back through
    rearranging ops, each value on the way read by that op alone and in its own layout; None
    if there is none."""
    graph, space = state.graph, state.space
    while True:
        value = graph.values[value_id]
        producer = value.producer
        if (producer not in space.strategies or set(value.users) != {reader}
                or len(graph.ops[producer].results) != 1
                or state.chosen(producer).results[0] != state.chosen(reader).operands[position]):
            return None
        op = graph.ops[producer]
        if op.name not in _REARRANGING or state.chosen(producer).collectives:
            return producer
        reader, position, value_id = producer, 0, op.operands[0]
