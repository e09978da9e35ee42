// RUN: hloplan-opt %s -p inline-calls,rematerialize --pass-option rematerialize.enabled=true --mesh 8 --device toy | filecheck %s
// RUN: hloplan-opt %s -p inline-calls,rematerialize --mesh 8 --device toy | filecheck %s --check-prefix=OFF

// rematerialize, on a two-layer train step (forward: y = x w, t = tanh y, e = exp t per layer;
// backward: the gradients, layer 2 then layer 1). Unsharded live bytes peak as layer 1's
// backward starts; layer 1's t1 and e1 are live across it and read only after it (besides
// e1's read by the layer-2 weight gradient, before the peak). Both are elementwise in y1,
// which was dead there: keeping y1 instead of t1 and e1 frees one of three tensors.
// The recomputation goes right before e1's first use after the peak (d1), reading y1 through
// an optimization barrier that also waits for the incoming gradient g1; d1 and dy1 read the
// clones. Layer 2's t2 and e2 die before the peak: left alone.

// CHECK-LABEL: func.func public @main
// CHECK:      [[Y1:%.*]] = stablehlo.dot_general %arg0, %arg1
// CHECK-NEXT: [[T1:%.*]] = stablehlo.tanh [[Y1]]
// CHECK-NEXT: [[E1:%.*]] = stablehlo.exponential [[T1]]
// CHECK:      [[GW2:%.*]] = stablehlo.dot_general [[E1]], [[DY2:%.*]], contracting_dims = [0] x [0]
// CHECK-NEXT: [[G1:%.*]] = stablehlo.dot_general [[DY2]], %arg2
// CHECK-NEXT: [[B:%.*]]:2 = stablehlo.optimization_barrier [[Y1]], [[G1]] : tensor<8x64xf32>, tensor<8x64xf32>
// CHECK-NEXT: [[T1R:%.*]] = stablehlo.tanh [[B]]#0
// CHECK-NEXT: [[E1R:%.*]] = stablehlo.exponential [[T1R]]
// CHECK-NEXT: [[D1:%.*]] = stablehlo.multiply [[G1]], [[E1R]]
// CHECK-NEXT: [[DY1:%.*]] = stablehlo.multiply [[D1]], [[T1R]]
// CHECK-NEXT: [[GW1:%.*]] = stablehlo.dot_general %arg0, [[DY1]]
// CHECK-NEXT: return [[GW1]], [[GW2]]

// Off (the compile pipeline's default): the module is unchanged.
// OFF-NOT: optimization_barrier
// OFF:     [[D1:%.*]] = stablehlo.multiply %{{.*}}, %2 : tensor<8x64xf32>
// OFF-NEXT: {{%.*}} = stablehlo.multiply [[D1]], %1 : tensor<8x64xf32>

module @jit_step {
  func.func public @main(%x: tensor<8x16xf32>, %w1: tensor<16x64xf32>, %w2: tensor<64x64xf32>) -> (tensor<16x64xf32>, tensor<64x64xf32>) {
    %zero = stablehlo.constant dense<0.000000e+00> : tensor<f32>
    %y1 = stablehlo.dot_general %x, %w1, contracting_dims = [1] x [0] : (tensor<8x16xf32>, tensor<16x64xf32>) -> tensor<8x64xf32> loc("y1")
    %t1 = stablehlo.tanh %y1 : tensor<8x64xf32> loc("t1")
    %e1 = stablehlo.exponential %t1 : tensor<8x64xf32> loc("e1")
    %y2 = stablehlo.dot_general %e1, %w2, contracting_dims = [1] x [0] : (tensor<8x64xf32>, tensor<64x64xf32>) -> tensor<8x64xf32> loc("y2")
    %t2 = stablehlo.tanh %y2 : tensor<8x64xf32> loc("t2")
    %e2 = stablehlo.exponential %t2 : tensor<8x64xf32> loc("e2")
    %s = stablehlo.reduce(%e2 init: %zero) applies stablehlo.add across dimensions = [1] : (tensor<8x64xf32>, tensor<f32>) -> tensor<8xf32> loc("loss")
    %g2 = stablehlo.broadcast_in_dim %s, dims = [0] : (tensor<8xf32>) -> tensor<8x64xf32> loc("g2")
    %d2 = stablehlo.multiply %g2, %e2 : tensor<8x64xf32> loc("d2")
    %dy2 = stablehlo.multiply %d2, %t2 : tensor<8x64xf32> loc("dy2")
    %gw2 = stablehlo.dot_general %e1, %dy2, contracting_dims = [0] x [0] : (tensor<8x64xf32>, tensor<8x64xf32>) -> tensor<64x64xf32> loc("gw2")
    %g1 = stablehlo.dot_general %dy2, %w2, contracting_dims = [1] x [1] : (tensor<8x64xf32>, tensor<64x64xf32>) -> tensor<8x64xf32> loc("g1")
    %d1 = stablehlo.multiply %g1, %e1 : tensor<8x64xf32> loc("d1")
    %dy1 = stablehlo.multiply %d1, %t1 : tensor<8x64xf32> loc("dy1")
    %gw1 = stablehlo.dot_general %x, %dy1, contracting_dims = [0] x [0] : (tensor<8x16xf32>, tensor<8x64xf32>) -> tensor<16x64xf32> loc("gw1")
    return %gw1, %gw2 : tensor<16x64xf32>, tensor<64x64xf32>
  }
}
