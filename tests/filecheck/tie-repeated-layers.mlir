// tie-repeated-layers gives the copies of an unrolled layer one decision. In this stack of six
// identical layers (one Python line emits every layer's matmul and tanh), the four interior
// layers look alike for three dataflow hops in both directions: their matmuls (with the tanh
// that follows each) become one decision and their weights another. The first and the last
// layer, next to the input and the output, keep their own. Memory checks that another one
// dominates once the ties hold are dropped: with the interior layers tied, the points after
// their matmuls hold the same bytes whatever the choice, and one check covers them all. The IR
// is not changed. (In the compile pipeline the pass only ties problems of more than
// min_decisions decisions; this test sets it to 0.)
// RUN: hloplan-opt %s -p extract-graph,build-sharding-problem,tie-repeated-layers --pass-option tie-repeated-layers.min_decisions=0 --mesh 2x4 --device toy 2>&1 | filecheck %s
// With period=2 the interior layers take two decisions in turn (layers 1 and 3, layers 2 and
// 4), so that consecutive layers can alternate column and row splits: 4 groups, 9 decisions.
// RUN: hloplan-opt %s -p extract-graph,build-sharding-problem,tie-repeated-layers --pass-option tie-repeated-layers.min_decisions=0 --pass-option tie-repeated-layers.period=2 --mesh 2x4 --device toy 2>&1 | filecheck %s --check-prefix=PERIOD2

// CHECK:      tie-repeated-layers.mlir: remark: tie-repeated-layers: 12 ops in 2 repeated groups tied; decisions 13 -> 7; memory checks 12 -> 6{{$}}
// CHECK-NEXT: module @jit_stack {
// CHECK-NOT:  sdy.
// CHECK:      return

// PERIOD2:      tie-repeated-layers.mlir: remark: tie-repeated-layers: 12 ops in 4 repeated groups tied; decisions 13 -> 9; memory checks 12 -> 8{{$}}
// PERIOD2-NEXT: module @jit_stack {

module @jit_stack {
  func.func public @main(%arg0: tensor<64x256xf32> loc("x"), %arg1: tensor<256x256xf32> loc("layers[0].w"), %arg2: tensor<256x256xf32> loc("layers[1].w"), %arg3: tensor<256x256xf32> loc("layers[2].w"), %arg4: tensor<256x256xf32> loc("layers[3].w"), %arg5: tensor<256x256xf32> loc("layers[4].w"), %arg6: tensor<256x256xf32> loc("layers[5].w")) -> (tensor<64x256xf32> {jax.result_info = "result"}) {
    %0 = stablehlo.dot_general %arg0, %arg1, contracting_dims = [1] x [0] : (tensor<64x256xf32>, tensor<256x256xf32>) -> tensor<64x256xf32> loc(#loc_dot)
    %1 = stablehlo.tanh %0 : tensor<64x256xf32> loc(#loc_tanh)
    %2 = stablehlo.dot_general %1, %arg2, contracting_dims = [1] x [0] : (tensor<64x256xf32>, tensor<256x256xf32>) -> tensor<64x256xf32> loc(#loc_dot)
    %3 = stablehlo.tanh %2 : tensor<64x256xf32> loc(#loc_tanh)
    %4 = stablehlo.dot_general %3, %arg3, contracting_dims = [1] x [0] : (tensor<64x256xf32>, tensor<256x256xf32>) -> tensor<64x256xf32> loc(#loc_dot)
    %5 = stablehlo.tanh %4 : tensor<64x256xf32> loc(#loc_tanh)
    %6 = stablehlo.dot_general %5, %arg4, contracting_dims = [1] x [0] : (tensor<64x256xf32>, tensor<256x256xf32>) -> tensor<64x256xf32> loc(#loc_dot)
    %7 = stablehlo.tanh %6 : tensor<64x256xf32> loc(#loc_tanh)
    %8 = stablehlo.dot_general %7, %arg5, contracting_dims = [1] x [0] : (tensor<64x256xf32>, tensor<256x256xf32>) -> tensor<64x256xf32> loc(#loc_dot)
    %9 = stablehlo.tanh %8 : tensor<64x256xf32> loc(#loc_tanh)
    %10 = stablehlo.dot_general %9, %arg6, contracting_dims = [1] x [0] : (tensor<64x256xf32>, tensor<256x256xf32>) -> tensor<64x256xf32> loc(#loc_dot)
    %11 = stablehlo.tanh %10 : tensor<64x256xf32> loc(#loc_tanh)
    return %11 : tensor<64x256xf32>
  }
}
#loc_dot_src = loc("model.py":7:12)
#loc_tanh_src = loc("model.py":7:8)
#loc_dot = loc("jit(stack)/dot_general"(#loc_dot_src))
#loc_tanh = loc("jit(stack)/tanh"(#loc_tanh_src))
