// A pass run without the pass it needs before it (build-sharding-problem without extract-graph)
// is a usage error that names the missing pass, not a Python traceback.
// RUN: not hloplan-opt %s -p build-sharding-problem --mesh 2x4 --device toy 2>&1 | filecheck %s

// CHECK-NOT: Traceback
// CHECK:     error: {{.*}}extract-graph
// CHECK-NOT: Traceback

module @jit_f {
  func.func public @main(%arg0: tensor<8x16xf32>) -> tensor<8x16xf32> {
    %0 = stablehlo.tanh %arg0 : tensor<8x16xf32>
    return %0 : tensor<8x16xf32>
  }
}
