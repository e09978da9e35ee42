// Known bug: `hloplan opt -p build-sharding-problem` without extract-graph before it dies with a
// Python traceback (AttributeError: 'NoneType' object has no attribute 'ops', exit 1), outside
// the CLI's exit-code contract (2 for usage errors; 101 and a reproducer for internal errors).
// solve-sharding and propagate-sharding run without their prerequisites fail the same way. It
// should be a usage error that names the pass to run first.
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
