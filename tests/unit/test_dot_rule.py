"""stablehlo.dot (the rank-1/rank-2 matmul JAX no longer emits, but other producers do) has a
sharding rule: its contracted dim is a reduce factor, and a plan that shards it runs to the
single-device answer."""

from __future__ import annotations

import hloplan
from hloplan.check import check_plan
from hloplan.op_rules import rule_for

_MODULE = b"""
module @jit_dot {
  func.func public @main(%arg0: tensor<256x512xf32>, %arg1: tensor<512x1024xf32>,
                         %arg2: tensor<1024xf32>) -> (tensor<256xf32>) {
    %0 = stablehlo.dot %arg0, %arg1
        : (tensor<256x512xf32>, tensor<512x1024xf32>) -> tensor<256x1024xf32>
    %1 = stablehlo.tanh %0 : tensor<256x1024xf32>
    %2 = stablehlo.dot %1, %arg2 : (tensor<256x1024xf32>, tensor<1024xf32>) -> tensor<256xf32>
    return %2 : tensor<256xf32>
  }
}
"""


def test_dot_contracts_the_lhs_last_dim_with_the_rhs_first(tmp_path):
    result = hloplan.compile(_MODULE, "8", device="h100", mesh_views="off")
    graph = result.state.graph
    dots = [op for op in graph.ops if op.name == "stablehlo.dot"]
    assert len(dots) == 2
    matrix, vector = (rule_for(graph, op) for op in dots)
    assert matrix.fallback is None and vector.fallback is None
    # [256, 512] x [512, 1024]: factors m, k (reduce), n.
    assert [(f.size, f.kind) for f in matrix.factors] == [(256, "pass"), (512, "reduce"),
                                                          (1024, "pass")]
    assert matrix.operands == (((0,), (1,)), ((1,), (2,)))
    assert matrix.results == (((0,), (2,)),)
    assert matrix.flops == 2.0 * 256 * 1024 * 512
    # [256, 1024] x [1024]: m, k (reduce); the result keeps m.
    assert [(f.size, f.kind) for f in vector.factors] == [(256, "pass"), (1024, "reduce")]
    assert vector.operands == (((0,), (1,)), ((1,),))
    assert vector.results == (((0,),),)
    assert not result.state.log.warnings
    # The plan shards the contraction (partial sums reduced: impossible for a replicated op),
    # and the sharded program gives the single-device answer.
    kinds = {c["kind"] for c in result.plan["estimate"]["collectives"]}
    assert kinds & {"all-reduce", "reduce-scatter"}
    result.write(tmp_path / "plan")
    report = check_plan(str(tmp_path / "plan"))
    assert report["match"], report
