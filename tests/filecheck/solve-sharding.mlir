// solve-sharding picks one strategy per op with the ILP, under the memory budget. It does not
// change the IR; with a budget no plan can meet it fails with a diagnostic that says by how much.

// A budget that fits: no diagnostics, and stdout is the module alone (no solver log on it).
// RUN: hloplan-opt %s -p extract-graph,build-sharding-problem,solve-sharding --mesh 2x4 --device toy --memory-budget 32MiB 2>&1 | filecheck %s --check-prefix=FIT
// x (64 MiB) sharded 8 ways, the matmul's and tanh's results (64 MiB each) too: 24 MiB at the peak,
// at least: the ILP's model leaves out the resharded copy of w (256 KiB) the matmul reads.
// RUN: not hloplan-opt %s -p extract-graph,build-sharding-problem,solve-sharding --mesh 2x4 --device toy --memory-budget 1MiB 2>&1 | filecheck %s --check-prefix=OOM

// FIT-NOT:   {{HiGHS|warning|error|note}}
// FIT:       module @jit_batch {
// FIT-NEXT:    func.func public @main(%arg0: tensor<64x1024x256xf32>, %arg1: tensor<256x256xf32>) -> (tensor<64x1024x256xf32> {jax.result_info = "result"}) {
// FIT-NEXT:      [[D:%.*]] = stablehlo.dot_general %arg0, %arg1, contracting_dims = [2] x [0] : (tensor<64x1024x256xf32>, tensor<256x256xf32>) -> tensor<64x1024x256xf32>{{$}}
// FIT-NEXT:      [[T:%.*]] = stablehlo.tanh [[D]] : tensor<64x1024x256xf32>{{$}}
// FIT-NEXT:      return [[T]] : tensor<64x1024x256xf32>
// FIT-NEXT:    }
// FIT-NEXT:  }
// FIT-NOT:   {{.}}

// OOM:      solve-sharding.mlir: error: no plan fits the memory budget of 1.00 MiB per device on mesh x=2,y=4{{$}}
// OOM-NEXT: solve-sharding.mlir: note: {{.*}}the smallest achievable peak is at least 24.0 MiB{{.*}}; the plan reaching it peaks at 24.3 MiB with the resharded copies its operands need{{$}}
// OOM-NEXT: solve-sharding.mlir: note: the smallest peak any plan reaches is at least 24.0 MiB, at least 23.0 MiB over the 1.00 MiB it was planned under{{$}}
// OOM-NEXT: solve-sharding.mlir: note: largest tensors: x (64.0 MiB unsharded), w (256 KiB unsharded){{$}}
// OOM-NEXT: solve-sharding.mlir: note: raise --memory-budget, use a larger mesh, or shrink the program{{$}}
// OOM-NOT:  {{.}}

module @jit_batch {
  func.func public @main(%arg0: tensor<64x1024x256xf32> loc("x"), %arg1: tensor<256x256xf32> loc("w")) -> (tensor<64x1024x256xf32> {jax.result_info = "result"}) {
    %0 = stablehlo.dot_general %arg0, %arg1, contracting_dims = [2] x [0] : (tensor<64x1024x256xf32>, tensor<256x256xf32>) -> tensor<64x1024x256xf32>
    %1 = stablehlo.tanh %0 : tensor<64x1024x256xf32>
    return %1 : tensor<64x1024x256xf32>
  }
}
