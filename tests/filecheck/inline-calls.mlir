// RUN: %split-input %s 0 | hloplan-opt - -p inline-calls --mesh 2x4 --device toy | filecheck %s
// RUN: %split-input %s 1 | hloplan-opt - -p inline-calls --mesh 2x4 --device toy | filecheck %s --check-prefix=KEEP
// RUN: %split-input %s 1 | hloplan-opt - -p inline-calls --mesh 2x4 --device toy --pass-option inline-calls.composites=true | filecheck %s --check-prefix=DECOMPOSE

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

// -----

// Composites and custom_calls keep the functions they refer to. jax.lax.top_k inside a nested
// jit: the call is inlined, the composite stays one op and its decomposition function
// @chlo.top_k.impl stays (the module re-parses); a custom_call's called computation stays with
// the function it calls in turn; the function nothing refers to goes.
// KEEP-LABEL: func.func public @main(%arg0: tensor<4x8xf32>) -> (tensor<4x2xf32>, tensor<4x2xi32>, tensor<4x8xf32>) {
// KEEP-NEXT:    [[T:%.*]]:2 = stablehlo.composite "chlo.top_k" %arg0 {composite_attributes = {k = 2 : i64}, decomposition = @chlo.top_k.impl, version = 1 : i32} : (tensor<4x8xf32>) -> (tensor<4x2xf32>, tensor<4x2xi32>)
// KEEP-NEXT:    [[CC:%.*]] = stablehlo.custom_call @my_op(%arg0) {called_computations = [@body]} : (tensor<4x8xf32>) -> tensor<4x8xf32>
// KEEP-NEXT:    return [[T]]#0, [[T]]#1, [[CC]] : tensor<4x2xf32>, tensor<4x2xi32>, tensor<4x8xf32>
// KEEP-NEXT:  }
// KEEP-DAG:   func.func private @chlo.top_k.impl(%arg0: tensor<4x8xf32>) -> (tensor<4x2xf32>, tensor<4x2xi32>) {
// KEEP-DAG:   func.func private @body(%arg0: tensor<4x8xf32>) -> tensor<4x8xf32> {
// KEEP-DAG:   func.func private @negate(%arg0: tensor<4x8xf32>) -> tensor<4x8xf32> {
// KEEP-NOT:   @unused
// KEEP-NOT:   func.func private @topk_wrapper

// With composites=true (the microbatch and pipeline cut), the composite becomes its
// decomposition's ops and the decomposition function goes; the custom_call's stay.
// DECOMPOSE-LABEL: func.func public @main(%arg0: tensor<4x8xf32>) -> (tensor<4x2xf32>, tensor<4x2xi32>, tensor<4x8xf32>) {
// DECOMPOSE-NEXT:    [[IOTA:%.*]] = stablehlo.iota dim = 1 : tensor<4x8xi32>
// DECOMPOSE-NEXT:    [[S:%.*]]:2 = "stablehlo.sort"(%arg0, [[IOTA]]) <{dimension = 1 : i64, is_stable = true}> ({
// DECOMPOSE:         [[V:%.*]] = stablehlo.slice [[S]]#0 [0:4, 0:2] : (tensor<4x8xf32>) -> tensor<4x2xf32>
// DECOMPOSE-NEXT:    [[I:%.*]] = stablehlo.slice [[S]]#1 [0:4, 0:2] : (tensor<4x8xi32>) -> tensor<4x2xi32>
// DECOMPOSE-NEXT:    [[CC:%.*]] = stablehlo.custom_call @my_op(%arg0) {called_computations = [@body]}
// DECOMPOSE-NEXT:    return [[V]], [[I]], [[CC]] : tensor<4x2xf32>, tensor<4x2xi32>, tensor<4x8xf32>
// DECOMPOSE-NOT:   stablehlo.composite
// DECOMPOSE-NOT:   @chlo.top_k.impl
// DECOMPOSE:       func.func private @body(
// DECOMPOSE:       func.func private @negate(

module @jit_topk {
  func.func public @main(%arg0: tensor<4x8xf32>) -> (tensor<4x2xf32>, tensor<4x2xi32>, tensor<4x8xf32>) {
    %0:2 = call @topk_wrapper(%arg0) : (tensor<4x8xf32>) -> (tensor<4x2xf32>, tensor<4x2xi32>)
    %1 = stablehlo.custom_call @my_op(%arg0) {called_computations = [@body]} : (tensor<4x8xf32>) -> tensor<4x8xf32>
    return %0#0, %0#1, %1 : tensor<4x2xf32>, tensor<4x2xi32>, tensor<4x8xf32>
  }
  func.func private @topk_wrapper(%arg0: tensor<4x8xf32>) -> (tensor<4x2xf32>, tensor<4x2xi32>) {
    %0:2 = stablehlo.composite "chlo.top_k" %arg0 {composite_attributes = {k = 2 : i64}, decomposition = @chlo.top_k.impl, version = 1 : i32} : (tensor<4x8xf32>) -> (tensor<4x2xf32>, tensor<4x2xi32>)
    return %0#0, %0#1 : tensor<4x2xf32>, tensor<4x2xi32>
  }
  func.func private @chlo.top_k.impl(%arg0: tensor<4x8xf32>) -> (tensor<4x2xf32>, tensor<4x2xi32>) {
    %0 = stablehlo.iota dim = 1 : tensor<4x8xi32>
    %1:2 = "stablehlo.sort"(%arg0, %0) <{dimension = 1 : i64, is_stable = true}> ({
    ^bb0(%arg1: tensor<f32>, %arg2: tensor<f32>, %arg3: tensor<i32>, %arg4: tensor<i32>):
      %4 = stablehlo.compare GT, %arg1, %arg2, TOTALORDER : (tensor<f32>, tensor<f32>) -> tensor<i1>
      stablehlo.return %4 : tensor<i1>
    }) : (tensor<4x8xf32>, tensor<4x8xi32>) -> (tensor<4x8xf32>, tensor<4x8xi32>)
    %2 = stablehlo.slice %1#0 [0:4, 0:2] : (tensor<4x8xf32>) -> tensor<4x2xf32>
    %3 = stablehlo.slice %1#1 [0:4, 0:2] : (tensor<4x8xi32>) -> tensor<4x2xi32>
    return %2, %3 : tensor<4x2xf32>, tensor<4x2xi32>
  }
  func.func private @body(%arg0: tensor<4x8xf32>) -> tensor<4x8xf32> {
    %0 = call @negate(%arg0) : (tensor<4x8xf32>) -> tensor<4x8xf32>
    return %0 : tensor<4x8xf32>
  }
  func.func private @negate(%arg0: tensor<4x8xf32>) -> tensor<4x8xf32> {
    %0 = stablehlo.negate %arg0 : tensor<4x8xf32>
    return %0 : tensor<4x8xf32>
  }
  func.func private @unused(%arg0: tensor<4x8xf32>) -> tensor<4x8xf32> {
    return %arg0 : tensor<4x8xf32>
  }
}
