"""build-sharding-problem: enumerate strategies per op and build the plain-data ShardingProblem.

- Each planned op becomes a node whose strategies come from its factor rule (op_rules) over the
  mesh, priced by the cost model (compute roofline, all-reduce of partial sums).
- Pointwise ops follow their first planned operand: they take its layout and share its decision
  variable (a tie), so the ILP grows with the number of layout decisions, not of ops.
- Edges carry the cost of resharding a producer's output into what the consumer's strategy needs.
- Constants and iotas are free: any layout costs nothing, so they get no node.
- Memory is checked at the program points whose live sets are maximal.
"""

from __future__ import annotations

from dataclasses import dataclass

from hloplan.cost_models import CommModel
from hloplan.graph import Graph, Op
from hloplan.op_rules import OpRule, rule_for
from hloplan.solver.problem import Edge, LivePoint, Node, ShardingProblem, Strategy
from hloplan.state import COMBINE_BYTES, CompileState, PlanSpace
from hloplan.strategies import OpStrategy, enumerate_strategies, local_bytes, replicated

UNPLANNED = {"stablehlo.while", "stablehlo.case", "stablehlo.if"}
# Cheap layout ops that stay free when all their operands are free (scalar splats, ...).
FREE_IF_INPUTS_FREE = {"stablehlo.broadcast_in_dim", "stablehlo.reshape", "stablehlo.convert",
                       "stablehlo.transpose"}


@dataclass(frozen=True)
class BuildShardingProblem:
    name: str = "build-sharding-problem"
    # Pointwise ops share their producer's decision (XLA's "followers").
    follow_pointwise: bool = True

    def apply(self, state: CompileState) -> None:
        graph = state.graph
        options = state.options
        comm = CommModel(options.device, options.mesh, hosts=options.hosts,
                     combine_bytes=COMBINE_BYTES)
        state.comm = comm
        builder = _ProblemBuilder(graph, comm, self.follow_pointwise, state)
        state.space, state.problem = builder.build(options.budget)
        state.facts["nodes"] = len(state.problem.nodes)
        state.facts["edges"] = len(state.problem.edges)
        state.facts["live_points"] = len(state.problem.live_points)


class _ProblemBuilder:
    def __init__(self, graph: Graph, comm: CommModel, follow: bool, state: CompileState):
        self.graph = graph
        self.comm = comm
        self.mesh = comm.mesh
        self.follow = follow
        self.state = state
        self.space = PlanSpace()
        self.rules: dict[int, OpRule] = {}
        self.tie_root: dict[int, int] = {}  # op index -> op index of its leader
        self.reshard_cache: dict = {}

    # -- strategies ---------------------------------------------------------------------------

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
        nodes = self._nodes()
        edges = self._edges()
        live = self._live_points(budget)
        problem = ShardingProblem(tuple(nodes), tuple(edges), tuple(live), budget,
                                  name=self.graph.name)
        problem.validate()
        return self.space, problem

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
        operand_types = [self.graph.type_of(v) for v in op.operands]
        result_types = [self.graph.type_of(v) for v in op.results]
        dtype = result_types[0].dtype if result_types and result_types[0] else "f32"
        own = enumerate_strategies(rule, operand_types, result_types, self.mesh, self.comm,
                                   op.multiplier, dtype)
        leader = self._leader_operand(op, rule) if self.follow else None
        if leader is None:
            return own
        producer, result_index = leader
        by_result = {s.results[0]: s for s in own}
        followed = []
        for strategy in self.space.strategies[producer.index]:
            match = by_result.get(strategy.results[result_index])
            if match is None:
                return own
            followed.append(match)
        self.tie_root[op.index] = self.tie_root.get(producer.index, producer.index)
        return followed

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
            return producer, value.result_index
        return None

    # -- nodes and edges ----------------------------------------------------------------------

    def _nodes(self) -> list[Node]:
        nodes = []
        for op_index, strategies in self.space.strategies.items():
            op = self.graph.ops[op_index]
            self.space.node_of[op_index] = len(nodes)
            self.space.op_of.append(op_index)
            root = self.tie_root.get(op_index)
            tie = None
            if root is not None or op_index in self.tie_root.values():
                tie = root if root is not None else op_index
            where = f" at {op.location}" if op.location else ""
            nodes.append(Node(
                name=f"%{op_index} {op.name}",
                strategies=tuple(Strategy(s.name, s.compute, s.communication, s.memory,
                                          s.collectives) for s in strategies),
                members=(f"{op.label or op.name}{where}",),
                tie=tie))
        return nodes

    def _reshard(self, value_id: int, src, dst, multiplier: float) -> float:
        if src == dst or dst is None:
            return 0.0
        type_ = self.graph.type_of(value_id)
        key = (type_.shape, type_.itemsize, src, dst)
        cost = self.reshard_cache.get(key)
        if cost is None:
            cost = self.comm.reshard(type_.shape, type_.itemsize, src, dst).seconds
            self.reshard_cache[key] = cost
        return cost * multiplier

    def _edge(self, value_id: int, consumer: Op, consumer_specs, multiplier: float) -> Edge | None:
        value = self.graph.values[value_id]
        if value_id in self.space.free_values or value.type is None:
            return None
        producer = value.producer
        if producer not in self.space.strategies:
            return None
        src_specs = [s.results[value.result_index] for s in self.space.strategies[producer]]
        costs = tuple(tuple(self._reshard(value_id, src, dst, multiplier) for dst in consumer_specs)
                      for src in src_specs)
        if not any(any(row) for row in costs):
            return None
        return Edge(self.space.node_of[producer], self.space.node_of[consumer.index], costs,
                    label=f"%{value_id} -> %{consumer.index}")

    def _edges(self) -> list[Edge]:
        edges = []
        for op_index, strategies in self.space.strategies.items():
            op = self.graph.ops[op_index]
            for k, value_id in enumerate(op.operands):
                specs = [s.operands[k] if k < len(s.operands) else None for s in strategies]
                edge = self._edge(value_id, op, specs, op.multiplier)
                if edge is not None:
                    edges.append(edge)
            if op.name == "while.carry" and "yield" in op.attrs:
                specs = [s.results[0] for s in strategies]
                edge = self._edge(op.attrs["yield"], op, specs, op.attrs["yield_multiplier"])
                if edge is not None:
                    edges.append(edge)
        return edges

    # -- memory -------------------------------------------------------------------------------

    def _live_points(self, budget: float) -> list[LivePoint]:
        graph = self.graph
        end = len(graph.ops)
        last_use = {}
        region_end: dict[int, int] = {}
        for op in graph.ops:
            if op.parent is not None:
                region_end[op.parent] = max(region_end.get(op.parent, 0), op.index)
        for value in graph.values:
            uses = [u for u in value.users if u >= value.producer]
            last = max(uses, default=value.producer)
            last_use[value.id] = last
        # A loop-carried value lives until the end of its loop's body.
        loop_of = {c: o.index for o in graph.ops if o.name == "stablehlo.while"
                   for c in o.attrs.get("carries", [])}
        for op in graph.ops:
            if op.name == "while.carry" and "yield" in op.attrs:
                loop_end = region_end.get(loop_of[op.index], op.index)
                for value_id in (op.attrs["yield"], op.results[0]):
                    last_use[value_id] = max(last_use[value_id], loop_end)
        for value_id in graph.arguments + graph.outputs:
            last_use[value_id] = end
        starts: dict[int, list[int]] = {}
        for value in graph.values:
            start = 0 if value.id in graph.arguments else value.producer
            starts.setdefault(start, []).append(value.id)
        ends: dict[int, list[int]] = {}
        for value_id, last in last_use.items():
            ends.setdefault(last, []).append(value_id)
        live: set[int] = set()
        points = []
        for t in range(end + 1):
            live.update(starts.get(t, []))
            points.append(frozenset(live))
            live.difference_update(ends.get(t, []))
        return self._memory_constraints(points, budget)

    def _value_memory_owner(self, value_id: int) -> int | None:
        producer = self.graph.values[value_id].producer
        if producer in self.space.strategies:
            return self.space.node_of[producer]
        return None

    def _memory_constraints(self, points: list[frozenset], budget: float) -> list[LivePoint]:
        # Drop points whose live set is contained in a neighbour's: they can never bind.
        kept = []
        for t, live in enumerate(points):
            if (t > 0 and live <= points[t - 1] and live != points[t - 1]) or (
                    t + 1 < len(points) and live < points[t + 1]):
                continue
            if kept and kept[-1][1] == live:
                continue
            kept.append((t, live))
        out = []
        seen = set()
        for t, live in kept:
            nodes = set()
            fixed = 0.0
            for value_id in live:
                type_ = self.graph.type_of(value_id)
                if type_ is None:
                    continue
                owner = self._value_memory_owner(value_id)
                if owner is not None:
                    nodes.add(owner)
                elif value_id not in self.space.free_values:
                    fixed += local_bytes(type_, replicated(type_.rank), self.mesh)
                # Free values (constants, splats) are fused into their consumers by XLA: no bytes.
            key = (tuple(sorted(nodes)), fixed)
            if key in seen:
                continue
            seen.add(key)
            label = self.graph.ops[t].label if t < len(self.graph.ops) else "end"
            out.append(LivePoint(tuple(sorted(nodes)), fixed, label=f"after %{t} {label}"))
        return out


def chosen_reshards(state: CompileState):
    """The resharding the chosen plan does: (consumer op, value id, src spec, dst spec, multiplier)
    for every operand (and loop-carried value) whose producer's layout differs from the one its
    consumer's strategy needs."""
    graph, space = state.graph, state.space
    for op_index in space.strategies:
        op = graph.ops[op_index]
        chosen = state.chosen(op_index)
        pairs = [(v, chosen.operands[k] if k < len(chosen.operands) else None, op.multiplier)
                 for k, v in enumerate(op.operands)]
        if op.name == "while.carry" and "yield" in op.attrs:
            pairs.append((op.attrs["yield"], chosen.results[0], op.attrs["yield_multiplier"]))
        for value_id, required, multiplier in pairs:
            value = graph.values[value_id]
            if (required is None or value.type is None or value_id in space.free_values
                    or value.producer not in space.strategies):
                continue
            given = state.chosen(value.producer).results[value.result_index]
            if given != required:
                yield op, value_id, given, required, multiplier
