// inline-calls inlines @main's calls and drops the private functions no public function
// reaches any more; one that another public function still calls stays.
// RUN: hloplan-opt %s -p inline-calls | filecheck %s

// CHECK-LABEL: func.func public @main(%arg0: tensor<8xf32>) -> tensor<8xf32> {
// CHECK-NEXT:    [[A:%.*]] = stablehlo.add %arg0, %arg0 : tensor<8xf32>
// CHECK-NEXT:    return [[A]] : tensor<8xf32>
// CHECK-LABEL: func.func public @helper(%arg0: tensor<8xf32>) -> tensor<8xf32> {
// CHECK-NEXT:    [[C:%.*]] = call @scale(%arg0) : (tensor<8xf32>) -> tensor<8xf32>
// CHECK-NEXT:    return [[C]] : tensor<8xf32>
// CHECK-LABEL: func.func private @scale(%arg0: tensor<8xf32>) -> tensor<8xf32> {

module @jit_two_entries {
  func.func public @main(%arg0: tensor<8xf32>) -> tensor<8xf32> {
    %0 = call @scale(%arg0) : (tensor<8xf32>) -> tensor<8xf32>
    return %0 : tensor<8xf32>
  }
  func.func public @helper(%arg0: tensor<8xf32>) -> tensor<8xf32> {
    %0 = call @scale(%arg0) : (tensor<8xf32>) -> tensor<8xf32>
    return %0 : tensor<8xf32>
  }
  func.func private @scale(%arg0: tensor<8xf32>) -> tensor<8xf32> {
    %0 = stablehlo.add %arg0, %arg0 : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
}
