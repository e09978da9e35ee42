// extract-graph.print_op_rules remarks each op's sharding rule (op_rules.py): its factors (size,
// and kind unless "pass": "reduce" leaves partial sums, "replicate" must not be sharded), then
// each operand's and result's dims as the factors they map to, major to minor ("-": no factor,
// that dim stays whole; "f1*f2": a dim two factors make up, as a reshape merges them). One op of
// every kind the planner has a rule for, and two it has none for (planned replicated).
// A reshape that both splits and merges dims (8x32 -> 4x64) gets no factor: planned replicated.
// RUN: hloplan-opt %s -p inline-calls,extract-graph --mesh 8 --device toy --pass-option extract-graph.print_op_rules=true 2>&1 | filecheck %s

module @jit_ops {
  func.func public @main(
      // CHECK:      {{.*}}op-rules.mlir:[[# @LINE + 1]]:7: remark: arg: factors {f0=8, f1=16} operands - results [f0, f1]{{$}}
      %arg0: tensor<8x16xf32>,
      // CHECK-NEXT: {{.*}}op-rules.mlir:[[# @LINE + 1]]:7: remark: arg: factors {f0=16, f1=32} operands - results [f0, f1]{{$}}
      %arg1: tensor<16x32xf32>,
      // CHECK-NEXT: {{.*}}op-rules.mlir:[[# @LINE + 1]]:7: remark: arg: factors {f0=2, f1=8, f2=8, f3=3} operands - results [f0, f1, f2, f3]{{$}}
      %arg2: tensor<2x8x8x3xf32>,
      // CHECK-NEXT: {{.*}}op-rules.mlir:[[# @LINE + 1]]:7: remark: arg: factors {f0=3, f1=3, f2=3, f3=4} operands - results [f0, f1, f2, f3]{{$}}
      %arg3: tensor<3x3x3x4xf32>,
      // CHECK-NEXT: {{.*}}op-rules.mlir:[[# @LINE + 1]]:7: remark: arg: factors {} operands - results []{{$}}
      %arg4: tensor<i32>,
      // CHECK-NEXT: {{.*}}op-rules.mlir:[[# @LINE + 1]]:7: remark: arg: factors {f0=2, f1=32} operands - results [f0, f1]{{$}}
      %arg5: tensor<2x32xf32>,
      // CHECK-NEXT: {{.*}}op-rules.mlir:[[# @LINE + 1]]:7: remark: arg: factors {f0=10, f1=4} operands - results [f0, f1]{{$}}
      %arg6: tensor<10x4xf32>,
      // CHECK-NEXT: {{.*}}op-rules.mlir:[[# @LINE + 1]]:7: remark: arg: factors {f0=2, f1=4, f2=16} operands - results [f0, f1, f2]{{$}}
      %arg7: tensor<2x4x16xf32>,
      // CHECK-NEXT: {{.*}}op-rules.mlir:[[# @LINE + 1]]:7: remark: arg: factors {f0=2, f1=16, f2=8} operands - results [f0, f1, f2]{{$}}
      %arg8: tensor<2x16x8xf32>)
      -> (tensor<8x32xf32>, tensor<2x4x8xf32>, tensor<8x32xf32>, tensor<2x8x8x4xf32>, tensor<8xf32>, tensor<8xf32>, tensor<8x32xf32>, tensor<32x8xf32>, tensor<4x64xf32>, tensor<8x64xf32>, tensor<8x8xf32>, tensor<8x34xf32>, tensor<2x32xf32>, tensor<8x32xf32>, tensor<8x32xf32>, tensor<8x32xf32>, tensor<2x4x4x3xf32>, tensor<2x8x8x3xf32>, tensor<2x4xf32>, tensor<10x4xf32>, tensor<8x32xf32>, tensor<8x32xi32>, tensor<8x32xf32>, tensor<8x32xf32>, tensor<8x4x8xf32>, tensor<8x16xf32>, tensor<16x16xf32>) {
    // CHECK-NEXT: {{.*}}op-rules.mlir:[[# @LINE + 1]]:10: remark: stablehlo.dot_general: factors {f0=16 reduce, f1=8, f2=32} operands [f1, f0] [f0, f2] results [f1, f2]{{$}}
    %0 = stablehlo.dot_general %arg0, %arg1, contracting_dims = [1] x [0] : (tensor<8x16xf32>, tensor<16x32xf32>) -> tensor<8x32xf32>
    // CHECK-NEXT: {{.*}}op-rules.mlir:[[# @LINE + 1]]:10: remark: stablehlo.dot_general: factors {f0=2, f1=16 reduce, f2=4, f3=8} operands [f0, f2, f1] [f0, f1, f3] results [f0, f2, f3]{{$}}
    %1 = stablehlo.dot_general %arg7, %arg8, batching_dims = [0] x [0], contracting_dims = [2] x [1] : (tensor<2x4x16xf32>, tensor<2x16x8xf32>) -> tensor<2x4x8xf32>
    // CHECK-NEXT: {{.*}}op-rules.mlir:[[# @LINE + 1]]:10: remark: stablehlo.dot: factors {f0=8, f1=16 reduce, f2=32} operands [f0, f1] [f1, f2] results [f0, f2]{{$}}
    %2 = stablehlo.dot %arg0, %arg1 : (tensor<8x16xf32>, tensor<16x32xf32>) -> tensor<8x32xf32>
    // CHECK-NEXT: {{.*}}op-rules.mlir:[[# @LINE + 1]]:10: remark: stablehlo.convolution: factors {f0=2, f1=3 reduce, f2=4} operands [f0, -, -, f1] [-, -, f1, f2] results [f0, -, -, f2]{{$}}
    %3 = stablehlo.convolution(%arg2, %arg3) dim_numbers = [b, 0, 1, f]x[0, 1, i, o]->[b, 0, 1, f], window = {stride = [1, 1], pad = [[1, 1], [1, 1]], lhs_dilate = [1, 1], rhs_dilate = [1, 1], reverse = [false, false]} {batch_group_count = 1 : i64, feature_group_count = 1 : i64} : (tensor<2x8x8x3xf32>, tensor<3x3x3x4xf32>) -> tensor<2x8x8x4xf32>
    // CHECK-NEXT: {{.*}}op-rules.mlir:[[# @LINE + 1]]:12: remark: stablehlo.constant: factors {} operands - results [] free{{$}}
    %cst = stablehlo.constant dense<0.000000e+00> : tensor<f32>
    // CHECK-NEXT: {{.*}}op-rules.mlir:[[# @LINE + 1]]:26: remark: stablehlo.reduce: factors {f0=8, f1=32 reduce} operands [f0, f1] [] results [f0]{{$}}
    %4 = stablehlo.reduce(%0 init: %cst) applies stablehlo.add across dimensions = [1] : (tensor<8x32xf32>, tensor<f32>) -> tensor<8xf32>
    // CHECK-NEXT: {{.*}}op-rules.mlir:[[# @LINE + 1]]:26: remark: stablehlo.reduce: factors {f0=8, f1=32 reduce} operands [f0, f1] [] results [f0] reduction max{{$}}
    %5 = stablehlo.reduce(%0 init: %cst) applies stablehlo.maximum across dimensions = [1] : (tensor<8x32xf32>, tensor<f32>) -> tensor<8xf32>
    // CHECK-NEXT: {{.*}}op-rules.mlir:[[# @LINE + 1]]:10: remark: stablehlo.broadcast_in_dim: factors {f0=8, f1=32} operands [f0] results [f0, f1]{{$}}
    %6 = stablehlo.broadcast_in_dim %4, dims = [0] : (tensor<8xf32>) -> tensor<8x32xf32>
    // CHECK-NEXT: {{.*}}op-rules.mlir:[[# @LINE + 1]]:10: remark: stablehlo.transpose: factors {f0=8, f1=32} operands [f0, f1] results [f1, f0]{{$}}
    %7 = stablehlo.transpose %0, dims = [1, 0] : (tensor<8x32xf32>) -> tensor<32x8xf32>
    // CHECK-NEXT: {{.*}}op-rules.mlir:[[# @LINE + 1]]:10: remark: stablehlo.reshape: factors {} operands [-, -] results [-, -]{{$}}
    %8 = stablehlo.reshape %0 : (tensor<8x32xf32>) -> tensor<4x64xf32>
    // CHECK-NEXT: {{.*}}op-rules.mlir:[[# @LINE + 1]]:11: remark: stablehlo.reshape: factors {f0=8, f1=4, f2=8} operands [f0, f1*f2] results [f0, f1, f2]{{$}}
    %r1 = stablehlo.reshape %0 : (tensor<8x32xf32>) -> tensor<8x4x8xf32>
    // CHECK-NEXT: {{.*}}op-rules.mlir:[[# @LINE + 1]]:11: remark: stablehlo.reshape: factors {f0=2, f1=4, f2=16} operands [f0, f1, f2] results [f0*f1, f2]{{$}}
    %r2 = stablehlo.reshape %arg7 : (tensor<2x4x16xf32>) -> tensor<8x16xf32>
    // CHECK-NEXT: {{.*}}op-rules.mlir:[[# @LINE + 1]]:13: remark: stablehlo.dot_general: factors {f0=8 reduce, f1=16, f2=16} operands [f0, f1] [f0, f2] results [f1, f2]{{$}}
    %gram = stablehlo.dot_general %arg0, %arg0, contracting_dims = [0] x [0] : (tensor<8x16xf32>, tensor<8x16xf32>) -> tensor<16x16xf32>
    // CHECK-NEXT: {{.*}}op-rules.mlir:[[# @LINE + 1]]:13: remark: stablehlo.cholesky: factors {} operands [-, -] results [-, -] replicated (op 'stablehlo.cholesky' is not known to the planner){{$}}
    %chol = stablehlo.cholesky %gram, lower = true : tensor<16x16xf32>
    // CHECK-NEXT: {{.*}}op-rules.mlir:[[# @LINE + 1]]:10: remark: stablehlo.concatenate: factors {f0=8} operands [f0, -] [f0, -] results [f0, -]{{$}}
    %9 = stablehlo.concatenate %0, %6, dim = 1 : (tensor<8x32xf32>, tensor<8x32xf32>) -> tensor<8x64xf32>
    // CHECK-NEXT: {{.*}}op-rules.mlir:[[# @LINE + 1]]:11: remark: stablehlo.slice: factors {f0=8} operands [f0, -] results [f0, -]{{$}}
    %10 = stablehlo.slice %0 [0:8, 2:10] : (tensor<8x32xf32>) -> tensor<8x8xf32>
    // CHECK-NEXT: {{.*}}op-rules.mlir:[[# @LINE + 1]]:11: remark: stablehlo.pad: factors {f0=8} operands [f0, -] [] results [f0, -]{{$}}
    %11 = stablehlo.pad %0, %cst, low = [0, 1], high = [0, 1], interior = [0, 0] : (tensor<8x32xf32>, tensor<f32>) -> tensor<8x34xf32>
    // CHECK-NEXT: {{.*}}op-rules.mlir:[[# @LINE + 1]]:10: remark: stablehlo.constant: factors {} operands - results [] free{{$}}
    %c = stablehlo.constant dense<0> : tensor<i32>
    // CHECK-NEXT: {{.*}}op-rules.mlir:[[# @LINE + 1]]:11: remark: stablehlo.dynamic_slice: factors {f0=32} operands [-, f0] [] [] results [-, f0]{{$}}
    %12 = stablehlo.dynamic_slice %0, %arg4, %c, sizes = [2, 32] : (tensor<8x32xf32>, tensor<i32>, tensor<i32>) -> tensor<2x32xf32>
    // CHECK-NEXT: {{.*}}op-rules.mlir:[[# @LINE + 1]]:11: remark: stablehlo.dynamic_update_slice: factors {f0=32} operands [-, f0] [-, f0] [] [] results [-, f0]{{$}}
    %13 = stablehlo.dynamic_update_slice %0, %arg5, %arg4, %c : (tensor<8x32xf32>, tensor<2x32xf32>, tensor<i32>, tensor<i32>) -> tensor<8x32xf32>
    // CHECK-NEXT: {{.*}}op-rules.mlir:[[# @LINE + 1]]:11: remark: stablehlo.reverse: factors {f0=8} operands [f0, -] results [f0, -]{{$}}
    %14 = stablehlo.reverse %0, dims = [1] : tensor<8x32xf32>
    // CHECK-NEXT: {{.*}}op-rules.mlir:[[# @LINE + 1]]:11: remark: stablehlo.sort: factors {f0=8} operands [f0, -] results [f0, -]{{$}}
    %15 = "stablehlo.sort"(%0) <{dimension = 1 : i64, is_stable = true}> ({
    ^bb0(%a: tensor<f32>, %b: tensor<f32>):
      %lt = stablehlo.compare LT, %a, %b, FLOAT : (tensor<f32>, tensor<f32>) -> tensor<i1>
      stablehlo.return %lt : tensor<i1>
    }) : (tensor<8x32xf32>) -> tensor<8x32xf32>
    // CHECK-NEXT: {{.*}}op-rules.mlir:[[# @LINE + 1]]:13: remark: stablehlo.constant: factors {} operands - results [] free{{$}}
    %ninf = stablehlo.constant dense<0xFF800000> : tensor<f32>
    // CHECK-NEXT: {{.*}}op-rules.mlir:[[# @LINE + 1]]:11: remark: stablehlo.reduce_window: factors {f0=2, f1=3} operands [f0, -, -, f1] [] results [f0, -, -, f1]{{$}}
    %16 = "stablehlo.reduce_window"(%arg2, %ninf) <{padding = dense<0> : tensor<4x2xi64>, window_dimensions = array<i64: 1, 2, 2, 1>, window_strides = array<i64: 1, 2, 2, 1>}> ({
    ^bb0(%a: tensor<f32>, %b: tensor<f32>):
      %m = stablehlo.maximum %a, %b : tensor<f32>
      stablehlo.return %m : tensor<f32>
    }) : (tensor<2x8x8x3xf32>, tensor<f32>) -> tensor<2x4x4x3xf32>
    // CHECK-NEXT: {{.*}}op-rules.mlir:[[# @LINE + 1]]:11: remark: stablehlo.select_and_scatter: factors {f0=2, f1=3} operands [f0, -, -, f1] [f0, -, -, f1] [] results [f0, -, -, f1]{{$}}
    %17 = "stablehlo.select_and_scatter"(%arg2, %16, %cst) <{padding = dense<0> : tensor<4x2xi64>, window_dimensions = array<i64: 1, 2, 2, 1>, window_strides = array<i64: 1, 2, 2, 1>}> ({
    ^bb0(%a: tensor<f32>, %b: tensor<f32>):
      %ge = stablehlo.compare GE, %a, %b, FLOAT : (tensor<f32>, tensor<f32>) -> tensor<i1>
      stablehlo.return %ge : tensor<i1>
    }, {
    ^bb0(%a: tensor<f32>, %b: tensor<f32>):
      %s = stablehlo.add %a, %b : tensor<f32>
      stablehlo.return %s : tensor<f32>
    }) : (tensor<2x8x8x3xf32>, tensor<2x4x4x3xf32>, tensor<f32>) -> tensor<2x8x8x3xf32>
    // CHECK-NEXT: {{.*}}op-rules.mlir:[[# @LINE + 1]]:12: remark: stablehlo.constant: factors {f0=2} operands - results [f0, -] free{{$}}
    %idx = stablehlo.constant dense<[[1], [3]]> : tensor<2x1xi32>
    // CHECK-NEXT: {{.*}}op-rules.mlir:[[# @LINE + 1]]:11: remark: stablehlo.gather: factors {f0=2, f1=4, f2=10 reduce} operands [f2, f1] [f0, -] results [f0, f1]{{$}}
    %18 = "stablehlo.gather"(%arg6, %idx) <{dimension_numbers = #stablehlo.gather<offset_dims = [1], collapsed_slice_dims = [0], start_index_map = [0], index_vector_dim = 1>, indices_are_sorted = false, slice_sizes = array<i64: 1, 4>}> : (tensor<10x4xf32>, tensor<2x1xi32>) -> tensor<2x4xf32>
    // CHECK-NEXT: {{.*}}op-rules.mlir:[[# @LINE + 1]]:11: remark: stablehlo.scatter: factors {f0=4, f1=10, f2=2 reduce} operands [f1, f0] [f2, -] [f2, f0] results [f1, f0]{{$}}
    %19 = "stablehlo.scatter"(%arg6, %idx, %18) <{indices_are_sorted = false, scatter_dimension_numbers = #stablehlo.scatter<update_window_dims = [1], inserted_window_dims = [0], scatter_dims_to_operand_dims = [0], index_vector_dim = 1>, unique_indices = false}> ({
    ^bb0(%a: tensor<f32>, %b: tensor<f32>):
      %s = stablehlo.add %a, %b : tensor<f32>
      stablehlo.return %s : tensor<f32>
    }) : (tensor<10x4xf32>, tensor<2x1xi32>, tensor<2x4xf32>) -> tensor<10x4xf32>
    // CHECK-NEXT: {{.*}}op-rules.mlir:[[# @LINE + 1]]:11: remark: stablehlo.tanh: factors {f0=8, f1=32} operands [f0, f1] results [f0, f1] pointwise{{$}}
    %20 = stablehlo.tanh %0 : tensor<8x32xf32>
    // CHECK-NEXT: {{.*}}op-rules.mlir:[[# @LINE + 1]]:11: remark: stablehlo.iota: factors {f0=8, f1=32} operands - results [f0, f1] free{{$}}
    %21 = stablehlo.iota dim = 1 : tensor<8x32xi32>
    // CHECK-NEXT: {{.*}}op-rules.mlir:[[# @LINE + 1]]:11: remark: stablehlo.custom_call: factors {} operands [-, -] results [-, -] replicated (custom_call @my_kernel is not understood by the planner){{$}}
    %22 = stablehlo.custom_call @my_kernel(%0) : (tensor<8x32xf32>) -> tensor<8x32xf32>
    // CHECK-NEXT: {{.*}}op-rules.mlir:[[# @LINE + 1]]:11: remark: stablehlo.cbrt: factors {f0=8, f1=32} operands [f0, f1] results [f0, f1] pointwise{{$}}
    %23 = stablehlo.cbrt %0 : tensor<8x32xf32>
    return %0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %r1, %r2, %chol : tensor<8x32xf32>, tensor<2x4x8xf32>, tensor<8x32xf32>, tensor<2x8x8x4xf32>, tensor<8xf32>, tensor<8xf32>, tensor<8x32xf32>, tensor<32x8xf32>, tensor<4x64xf32>, tensor<8x64xf32>, tensor<8x8xf32>, tensor<8x34xf32>, tensor<2x32xf32>, tensor<8x32xf32>, tensor<8x32xf32>, tensor<8x32xf32>, tensor<2x4x4x3xf32>, tensor<2x8x8x3xf32>, tensor<2x4xf32>, tensor<10x4xf32>, tensor<8x32xf32>, tensor<8x32xi32>, tensor<8x32xf32>, tensor<8x32xf32>, tensor<8x4x8xf32>, tensor<8x16xf32>, tensor<16x16xf32>
  }
}
// CHECK-NEXT: module @jit_ops {
