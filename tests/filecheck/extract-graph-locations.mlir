// Ops and arguments without a jax location (hand-written or stripped programs) carry the
// parser's own file:line:col, whose file MLIR's Python parser calls "-": diagnostics name the
// input file instead.
// RUN: not hloplan-opt %s -p extract-graph --mesh 2x4 --device toy 2>&1 | filecheck %s

// CHECK:      extract-graph-locations.mlir:[[# @LINE + 5]]:{{[0-9]+}}: error: argument 0 (unnamed) has a dynamic shape tensor<?x16xf32>; hloplan plans static shapes only{{$}}
// CHECK-NEXT: extract-graph-locations.mlir:[[# @LINE + 4]]:{{[0-9]+}}: note: export with concrete shapes

module @jit_poly {
  // The function's arguments have no loc(...): the parser gives them this line.
  func.func public @main(%arg0: tensor<?x16xf32>) -> tensor<?x16xf32> {
    return %arg0 : tensor<?x16xf32>
  }
}
