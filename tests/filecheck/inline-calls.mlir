// RUN: hloplan-opt %s -p inline-calls --mesh 2x4 --device toy | filecheck %s

// inline-calls clones every private function into @main at each call site and then drops the
// private functions. Covered: a function called twice (two copies, each on its own operands),
// several results (one of them a callee argument returned as is), a call inside a
// stablehlo.while body, a call inside a function that is itself inlined, a function that
// is never called.

// The whole of @main, line by line: the first @scale copy works on %arg0, the second on %arg1;
// @swap's first result is the negated second copy, its second result is the first copy itself;
// the loop's body holds a third @scale copy (inlined from @step) and still reads the loop's
// operand from outside. Constants the loop uses are cloned into its regions (the originals
// stay behind, unused).
// CHECK-LABEL: module @jit_inline {
// CHECK-NEXT:  func.func public @main(%arg0: tensor<8xf32>, %arg1: tensor<8xf32>) -> (tensor<8xf32>, tensor<8xf32>, tensor<8xf32>) {
// CHECK-NEXT:    [[C0:%.*]] = stablehlo.constant dense<2.000000e+00> : tensor<f32>
// CHECK-NEXT:    [[B0:%.*]] = stablehlo.broadcast_in_dim [[C0]], dims = [] : (tensor<f32>) -> tensor<8xf32>
// CHECK-NEXT:    [[S0:%.*]] = stablehlo.multiply %arg0, [[B0]] : tensor<8xf32>
// CHECK-NEXT:    [[C1:%.*]] = stablehlo.constant dense<2.000000e+00> : tensor<f32>
// CHECK-NEXT:    [[B1:%.*]] = stablehlo.broadcast_in_dim [[C1]], dims = [] : (tensor<f32>) -> tensor<8xf32>
// CHECK-NEXT:    [[S1:%.*]] = stablehlo.multiply %arg1, [[B1]] : tensor<8xf32>
// CHECK-NEXT:    [[NEG:%.*]] = stablehlo.negate [[S1]] : tensor<8xf32>
// CHECK-NEXT:    [[ZERO:%.*]] = stablehlo.constant dense<0> : tensor<i32>
// CHECK-NEXT:    {{%.*}} = stablehlo.constant dense<3> : tensor<i32>
// CHECK-NEXT:    {{%.*}} = stablehlo.constant dense<1> : tensor<i32>
// CHECK-NEXT:    [[W:%.*]]:2 = stablehlo.while([[I:%.*]] = [[ZERO]], [[ACC:%.*]] = [[NEG]]) : tensor<i32>, tensor<8xf32>
// CHECK-NEXT:    cond {
// CHECK-NEXT:      [[THREE:%.*]] = stablehlo.constant dense<3> : tensor<i32>
// CHECK-NEXT:      [[LT:%.*]] = stablehlo.compare LT, [[I]], [[THREE]], SIGNED : (tensor<i32>, tensor<i32>) -> tensor<i1>
// CHECK-NEXT:      stablehlo.return [[LT]] : tensor<i1>
// CHECK-NEXT:    } do {
// CHECK-NEXT:      [[ONE:%.*]] = stablehlo.constant dense<1> : tensor<i32>
// CHECK-NEXT:      [[NEXT:%.*]] = stablehlo.add [[I]], [[ONE]] : tensor<i32>
// CHECK-NEXT:      [[C2:%.*]] = stablehlo.constant dense<2.000000e+00> : tensor<f32>
// CHECK-NEXT:      [[B2:%.*]] = stablehlo.broadcast_in_dim [[C2]], dims = [] : (tensor<f32>) -> tensor<8xf32>
// CHECK-NEXT:      [[S2:%.*]] = stablehlo.multiply [[ACC]], [[B2]] : tensor<8xf32>
// CHECK-NEXT:      [[SUM:%.*]] = stablehlo.add [[S2]], [[NEG]] : tensor<8xf32>
// CHECK-NEXT:      stablehlo.return [[NEXT]], [[SUM]] : tensor<i32>, tensor<8xf32>
// CHECK-NEXT:    }
// CHECK-NEXT:    return [[S0]], [[W]]#1, [[S0]] : tensor<8xf32>, tensor<8xf32>, tensor<8xf32>
// CHECK-NEXT:  }
// No private function (nor any call) is left.
// CHECK-NEXT:  }{{$}}
// CHECK-NOT:   {{.}}

module @jit_inline {
  func.func public @main(%arg0: tensor<8xf32>, %arg1: tensor<8xf32>) -> (tensor<8xf32>, tensor<8xf32>, tensor<8xf32>) {
    %0 = call @scale(%arg0) : (tensor<8xf32>) -> tensor<8xf32>
    %1 = call @scale(%arg1) : (tensor<8xf32>) -> tensor<8xf32>
    %2:2 = call @swap(%0, %1) : (tensor<8xf32>, tensor<8xf32>) -> (tensor<8xf32>, tensor<8xf32>)
    %3 = call @loop(%2#0) : (tensor<8xf32>) -> tensor<8xf32>
    return %2#1, %3, %0 : tensor<8xf32>, tensor<8xf32>, tensor<8xf32>
  }
  func.func private @scale(%arg0: tensor<8xf32>) -> tensor<8xf32> {
    %cst = stablehlo.constant dense<2.000000e+00> : tensor<f32>
    %0 = stablehlo.broadcast_in_dim %cst, dims = [] : (tensor<f32>) -> tensor<8xf32>
    %1 = stablehlo.multiply %arg0, %0 : tensor<8xf32>
    return %1 : tensor<8xf32>
  }
  func.func private @swap(%arg0: tensor<8xf32>, %arg1: tensor<8xf32>) -> (tensor<8xf32>, tensor<8xf32>) {
    %0 = stablehlo.negate %arg1 : tensor<8xf32>
    return %0, %arg0 : tensor<8xf32>, tensor<8xf32>
  }
  func.func private @loop(%arg0: tensor<8xf32>) -> tensor<8xf32> {
    %c = stablehlo.constant dense<0> : tensor<i32>
    %c_0 = stablehlo.constant dense<3> : tensor<i32>
    %c_1 = stablehlo.constant dense<1> : tensor<i32>
    %0:2 = stablehlo.while(%iterArg = %c, %iterArg_2 = %arg0) : tensor<i32>, tensor<8xf32>
    cond {
      %1 = stablehlo.compare LT, %iterArg, %c_0, SIGNED : (tensor<i32>, tensor<i32>) -> tensor<i1>
      stablehlo.return %1 : tensor<i1>
    } do {
      %1 = stablehlo.add %iterArg, %c_1 : tensor<i32>
      %2 = func.call @step(%iterArg_2, %arg0) : (tensor<8xf32>, tensor<8xf32>) -> tensor<8xf32>
      stablehlo.return %1, %2 : tensor<i32>, tensor<8xf32>
    }
    return %0#1 : tensor<8xf32>
  }
  func.func private @step(%arg0: tensor<8xf32>, %arg1: tensor<8xf32>) -> tensor<8xf32> {
    %0 = call @scale(%arg0) : (tensor<8xf32>) -> tensor<8xf32>
    %1 = stablehlo.add %0, %arg1 : tensor<8xf32>
    return %1 : tensor<8xf32>
  }
  func.func private @unused(%arg0: tensor<8xf32>) -> tensor<8xf32> {
    return %arg0 : tensor<8xf32>
  }
}
