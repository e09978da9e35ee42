"""The canonical plans as restrictions of the planner's own ILP.

    dp    data parallelism: every value that carries the batch (passes/label_batch.py) is split
          on its batch dim over all mesh axes, every other value (parameters, their gradients,
          the optimizer state and update) is replicated;
    fsdp  fully sharded data parallelism (ZeRO-3): the batch as in dp, and every other value
          split over all mesh axes on one of its dims (replicated where no dim divides).

Each is solved by the same ILP as the planner's own plan, restricted per node to the strategies
whose results are laid out so (solve-sharding's `canonical` option): the same cost model prices
it, so its estimate can be set beside the model's plan, and `--select compiled` can compile it
(compiler.select_compiled). A node that has no such strategy (a batch dim no mesh size divides, an
op the rules replicate) keeps all of its strategies; plan.json counts them.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from hloplan.solver.problem import Launch, ShardingProblem, Solution

CANONICAL = ("dp", "fsdp")


def allowed_strategies(state, kind: str) -> tuple[list[np.ndarray], int]:
    """Per problem node, the indices of its strategies `kind` allows (all of them where none
    is), and how many nodes (tie groups counted per node) kept all for want of one."""
    from hloplan.passes.label_batch import BatchError, analyse

    if kind not in CANONICAL:
        raise ValueError(f"unknown canonical plan {kind!r} ({', '.join(CANONICAL)})")
    graph, space, problem = state.graph, state.space, state.problem
    ndim = state.options.mesh.ndim
    everything = frozenset(range(ndim))
    try:
        label = analyse(graph).label
    except BatchError:
        label = {}
    sizes = state.options.mesh.axis_sizes
    devices = int(np.prod(sizes)) if sizes else 1

    def spec_ok(value_id: int, spec) -> bool:
        batch_dim = label.get(value_id)
        used = [frozenset(axes) for axes in spec]
        if batch_dim is not None:
            return all(axes == (everything if d == batch_dim else frozenset())
                       for d, axes in enumerate(used))
        if kind == "dp":
            return not any(used)
        shape = graph.type_of(value_id).shape
        if not any(size % devices == 0 for size in shape):
            return not any(used)
        return sorted(used, key=len)[-1] == everything and sum(map(bool, used)) == 1

    allowed: list[np.ndarray] = [None] * len(problem.nodes)
    for op_index, node in space.node_of.items():
        op = graph.ops[op_index]
        keep = [i for i, s in enumerate(space.strategies[op_index])
                if all(spec_ok(v, spec) for v, spec in zip(op.results, s.results, strict=False)
                       if graph.type_of(v) is not None)]
        allowed[node] = np.array(keep, dtype=int)
    # Tied nodes choose one index: what all of them allow.
    groups: dict[int, list[int]] = {}
    for n, node in enumerate(problem.nodes):
        if node.tie is not None:
            groups.setdefault(node.tie, []).append(n)
    for members in groups.values():
        common = set(range(len(problem.nodes[members[0]].strategies)))
        for n in members:
            if allowed[n] is not None:
                common &= set(allowed[n].tolist())
        for n in members:
            allowed[n] = np.array(sorted(common), dtype=int)
    unrestricted = 0
    for n, node in enumerate(problem.nodes):
        if allowed[n] is None or not len(allowed[n]):
            unrestricted += allowed[n] is not None
            allowed[n] = np.arange(len(node.strategies))
    return allowed, unrestricted


def restrict(problem: ShardingProblem, allowed: list[np.ndarray]) -> ShardingProblem:
    """`problem` with node n's strategies cut to `allowed[n]` (edges and launches with them)."""
    position = [{int(k): i for i, k in enumerate(keep)} for keep in allowed]
    nodes = tuple(dataclasses.replace(node, strategies=tuple(node.strategies[int(k)]
                                                             for k in allowed[n]))
                  for n, node in enumerate(problem.nodes))
    edges = []
    for edge in problem.edges:
        rows, cols = allowed[edge.src], allowed[edge.dst]
        costs = tuple(tuple(edge.costs[int(i)][int(j)] for j in cols) for i in rows)
        copies = tuple(edge.copies[int(j)] for j in cols) if edge.copies else ()
        relayout = (tuple(tuple(edge.relayout[int(i)][int(j)] for j in cols) for i in rows)
                    if edge.relayout else ())
        loop_copy = tuple(edge.loop_copy[int(j)] for j in cols) if edge.loop_copy else ()
        carried = tuple(edge.carried[int(j)] for j in cols) if edge.carried else ()
        edges.append(dataclasses.replace(edge, costs=costs, copies=copies, relayout=relayout,
                                         loop_copy=loop_copy, carried=carried))
    launches = []
    for launch in problem.launches:
        members = tuple((n, kept) for n, picks in launch.members
                        if (kept := tuple(position[n][p] for p in picks if p in position[n])))
        if members:
            launches.append(Launch(launch.label, launch.cost, members))
    return dataclasses.replace(problem, nodes=nodes, edges=tuple(edges), launches=tuple(launches))


def widen(solution: Solution, allowed: list[np.ndarray]) -> Solution:
    """A solution of the restricted problem as indices of the full one."""
    return Solution(tuple(int(allowed[n][c]) for n, c in enumerate(solution.choice)))
