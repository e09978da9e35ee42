// extract-graph reads @main into the planner's graph; it does not change the IR, and it reports
// what the planner cannot follow. Chunks are separated by `// -----` (see lit.cfg.py).

// A loop whose bound is an argument: extract-graph warns (at the loop's source line) that it
// costs the body as running once, and prints the module unchanged (as inline-calls left it).
// RUN: %split-input %s 0 | hloplan-opt - -p inline-calls,extract-graph --mesh 2x4 --device toy 2> %t.err | filecheck %s
// RUN: filecheck %s --check-prefix=WARN < %t.err
// Without inline-calls first, the func.call in the loop body is an error at the call's line.
// RUN: %split-input %s 0 | not hloplan-opt - -p extract-graph --mesh 2x4 --device toy 2>&1 | filecheck %s --check-prefix=CALL

// WARN:      model.py:20:11: warning: loop trip count not recognised: its body is costed as running once{{$}}
// WARN-NEXT: model.py:20:11: note: in op 'stablehlo.while'{{$}}
// WARN-NOT:  {{.}}

// CHECK-LABEL: module @jit_loop {
// CHECK-NEXT:   func.func public @main(%arg0: tensor<8x16xf32>, %arg1: tensor<i32>) -> (tensor<8x16xf32> {jax.result_info = "result"}) {
// CHECK-NEXT:     [[ZERO:%.*]] = stablehlo.constant dense<0> : tensor<i32>
// CHECK-NEXT:     {{%.*}} = stablehlo.constant dense<1> : tensor<i32>
// CHECK-NEXT:     [[W:%.*]]:2 = stablehlo.while([[I:%.*]] = [[ZERO]], [[X:%.*]] = %arg0) : tensor<i32>, tensor<8x16xf32>{{$}}
// CHECK-NEXT:     cond {
// CHECK-NEXT:       [[LT:%.*]] = stablehlo.compare LT, [[I]], %arg1, SIGNED : (tensor<i32>, tensor<i32>) -> tensor<i1>{{$}}
// CHECK-NEXT:       stablehlo.return [[LT]] : tensor<i1>
// CHECK-NEXT:     } do {
// CHECK-NEXT:       [[ONE:%.*]] = stablehlo.constant dense<1> : tensor<i32>
// CHECK-NEXT:       [[T:%.*]] = stablehlo.tanh [[X]] : tensor<8x16xf32>{{$}}
// CHECK-NEXT:       [[NEXT:%.*]] = stablehlo.add [[I]], [[ONE]] : tensor<i32>{{$}}
// CHECK-NEXT:       stablehlo.return [[NEXT]], [[T]] : tensor<i32>, tensor<8x16xf32>
// CHECK-NEXT:     }
// CHECK-NEXT:     return [[W]]#1 : tensor<8x16xf32>
// CHECK-NEXT:   }
// CHECK-NEXT: }
// CHECK-NOT:  {{.}}

// CALL:      model.py:21:15: error: func.call remains after inlining{{$}}
// CALL-NEXT: model.py:21:15: note: in op 'func.call'{{$}}
// CALL-NOT:  {{.}}

module @jit_loop {
  func.func public @main(%arg0: tensor<8x16xf32> loc("x"), %arg1: tensor<i32> loc("n")) -> (tensor<8x16xf32> {jax.result_info = "result"}) {
    %c = stablehlo.constant dense<0> : tensor<i32>
    %c_0 = stablehlo.constant dense<1> : tensor<i32>
    %0:2 = stablehlo.while(%iterArg = %c, %iterArg_1 = %arg0) : tensor<i32>, tensor<8x16xf32>
    cond {
      %1 = stablehlo.compare LT, %iterArg, %arg1, SIGNED : (tensor<i32>, tensor<i32>) -> tensor<i1>
      stablehlo.return %1 : tensor<i1>
    } do {
      %1 = func.call @body(%iterArg_1) : (tensor<8x16xf32>) -> tensor<8x16xf32> loc(#loc_call)
      %2 = stablehlo.add %iterArg, %c_0 : tensor<i32>
      stablehlo.return %2, %1 : tensor<i32>, tensor<8x16xf32>
    } loc(#loc_while)
    return %0#1 : tensor<8x16xf32>
  }
  func.func private @body(%arg0: tensor<8x16xf32>) -> tensor<8x16xf32> {
    %0 = stablehlo.tanh %arg0 : tensor<8x16xf32>
    return %0 : tensor<8x16xf32>
  }
}
#loc_while_src = loc("model.py":20:11)
#loc_call_src = loc("model.py":21:15)
#loc_while = loc("jit(f)/while"(#loc_while_src))
#loc_call = loc("jit(f)/jit(body)"(#loc_call_src))

// -----

// A dynamic-shape argument (a shape-polymorphic export) is an error: hloplan plans static
// shapes only. The argument's name comes from its location, as jax.export writes it.
// RUN: %split-input %s 1 | not hloplan-opt - -p extract-graph --mesh 2x4 --device toy 2>&1 | filecheck %s --check-prefix=DYN

// DYN:      error: argument 1 (lengths) has a dynamic shape tensor<?xi32>; hloplan plans static shapes only{{$}}
// DYN-NEXT: note: export with concrete shapes (no jax.export.symbolic_shape){{$}}
// DYN-NOT:  {{.}}

module @jit_poly {
  func.func public @main(%arg0: tensor<8x16xf32> loc("x"), %arg1: tensor<?xi32> loc("lengths")) -> (tensor<8x16xf32> {jax.result_info = "result"}) {
    return %arg0 : tensor<8x16xf32>
  }
}
