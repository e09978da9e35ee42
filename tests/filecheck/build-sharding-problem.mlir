// build-sharding-problem gives each op its sharding strategies; an op it has no rule for is
// planned as replicated, with one warning at the op's source line (from its jax location). The
// IR is not changed.
// RUN: hloplan-opt %s -p inline-calls,extract-graph,build-sharding-problem --mesh 2x4 --device toy 2>&1 | filecheck %s

// CHECK:      model.py:12:7: warning: custom_call @my_kernel is not understood by the planner; planned as replicated{{$}}
// CHECK-NEXT: model.py:12:7: note: in op 'stablehlo.custom_call'{{$}}
// CHECK-NEXT: model.py:12:7: note: its operands are gathered onto every device{{$}}
// CHECK-NEXT: model.py:13:9: warning: op 'stablehlo.cholesky' is not known to the planner; planned as replicated{{$}}
// CHECK-NEXT: model.py:13:9: note: in op 'stablehlo.cholesky'{{$}}
// CHECK-NEXT: model.py:13:9: note: its operands are gathered onto every device{{$}}
// CHECK-NEXT: module @jit_kernels {
// CHECK-NEXT:   func.func public @main(%arg0: tensor<64x64xf32>) -> (tensor<64x64xf32> {jax.result_info = "result"}) {
// CHECK-NEXT:     [[T:%.*]] = stablehlo.tanh %arg0 : tensor<64x64xf32>
// CHECK-NEXT:     [[K:%.*]] = stablehlo.custom_call @my_kernel([[T]]) : (tensor<64x64xf32>) -> tensor<64x64xf32>
// CHECK-NEXT:     [[L:%.*]] = stablehlo.cholesky [[K]], lower = true : tensor<64x64xf32>
// CHECK-NEXT:     [[S:%.*]] = stablehlo.add [[L]], [[T]] : tensor<64x64xf32>
// CHECK-NEXT:     return [[S]] : tensor<64x64xf32>
// CHECK-NEXT:   }
// CHECK-NEXT: }
// CHECK-NOT:  {{.}}

module @jit_kernels {
  func.func public @main(%arg0: tensor<64x64xf32> loc("x")) -> (tensor<64x64xf32> {jax.result_info = "result"}) {
    %0 = stablehlo.tanh %arg0 : tensor<64x64xf32>
    %1 = stablehlo.custom_call @my_kernel(%0) : (tensor<64x64xf32>) -> tensor<64x64xf32> loc(#loc_kernel)
    %2 = stablehlo.cholesky %1, lower = true : tensor<64x64xf32> loc(#loc_cholesky)
    %3 = stablehlo.add %2, %0 : tensor<64x64xf32>
    return %3 : tensor<64x64xf32>
  }
}
#loc_kernel_src = loc("model.py":12:7)
#loc_cholesky_src = loc("model.py":13:9)
#loc_kernel = loc("jit(f)/my_kernel"(#loc_kernel_src))
#loc_cholesky = loc("jit(f)/cholesky"(#loc_cholesky_src))
