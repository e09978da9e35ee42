"""A top_k-routed (Mixtral-style) MoE train step at a realistic size, planned for 8 H100s
from abstract arguments: the plan shards the expert dim (expert parallelism: each device holds
its experts' weights, tokens reach them by all-to-all), and that is cheaper, by the solver's
own evaluator, than the best plan with every expert-dim tensor unsplit.
"""

from __future__ import annotations

import dataclasses

import jax
from jax import export

import hloplan
from fixtures import moe_topk
from hloplan.solver.evaluate import evaluate
from hloplan.solver.ilp import solve

EXPERTS = 8  # no other dim of the program has this size (d 512, ffn 2048, batch 32, ...)


def _planned():
    params = moe_topk.params_spec(d=512, f=2048, experts=EXPERTS, layers=2)
    exported = export.export(jax.jit(moe_topk.train_step))(
        params, *moe_topk.batch_spec(batch=32, seq=256, d=512))
    return hloplan.compile(exported.serialize(), "8", device="h100", mesh_views="off")


def _splits_experts(op, strategy, graph) -> bool:
    for value, spec in zip(op.results, strategy.results):
        shape = graph.type_of(value).shape if graph.type_of(value) else ()
        if any(size == EXPERTS and axes for size, axes in zip(shape, spec)):
            return True
    return False


def test_top_k_moe_plan_is_expert_parallel_where_it_pays():
    result = _planned()
    plan, state = result.plan, result.state
    spec = {a["name"]: a["spec"] for a in plan["arguments"]}
    for layer in range(2):
        for name in ("w_gate", "w_up", "w_down"):
            assert spec[f"params.layers[{layer}].{name}"][0] == ["x"], spec
    # Tokens reach their experts by all-to-all (batch-split -> expert-split and back).
    assert any(c["kind"] == "all-to-all" for c in plan["estimate"]["collectives"])

    # The same problem with every expert-dim split priced out of reach: no expert parallelism.
    graph, space, problem = state.graph, state.space, state.problem
    penalised = list(problem.nodes)
    forced_out = 0
    for op_index, node in space.node_of.items():
        op = graph.ops[op_index]
        strategies = list(penalised[node].strategies)
        for j, strategy in enumerate(space.strategies[op_index]):
            if _splits_experts(op, strategy, graph):
                strategies[j] = dataclasses.replace(strategies[j],
                                                    compute_cost=strategies[j].compute_cost + 1e3)
                forced_out += 1
        penalised[node] = dataclasses.replace(penalised[node], strategies=tuple(strategies))
    assert forced_out
    replicated, _ = solve(dataclasses.replace(problem, nodes=tuple(penalised)), time_limit=60)
    chosen = evaluate(problem, state.solution)
    no_experts = evaluate(problem, replicated)
    assert not any(_splits_experts(graph.ops[i], space.strategies[i][replicated.choice[n]], graph)
                   for i, n in space.node_of.items())
    assert chosen.feasible and no_experts.feasible
    assert chosen.total < 0.9 * no_experts.total, (chosen.total, no_experts.total)
