// propagate-sharding writes the solved plan into the module in Shardy form: `sdy.mesh @mesh`,
// `sdy.sharding` on @main's arguments and results, an `sdy.sharding_constraint` right after every
// planned op (XLA keeps constraints but re-propagates `sdy.sharding` attributes on ops), and a
// second constraint where an op needs an operand in another layout than its producer gives. The
// ops themselves are unchanged. Output that fails to verify would print in MLIR's generic form
// ("stablehlo.add"(...)), so the pretty-form lines below also check validity.
// Chunks are separated by `// -----` (see lit.cfg.py).

// RUN: %split-input %s 0 | hloplan-opt - -p inline-calls,extract-graph,build-sharding-problem,solve-sharding,propagate-sharding --mesh 2x4 --device toy | filecheck %s
// RUN: %split-input %s 1 | hloplan-opt - -p inline-calls,extract-graph,build-sharding-problem,solve-sharding,propagate-sharding --mesh 2x4 --device toy | filecheck %s --check-prefix=LOOP
// RUN: %split-input %s 2 | hloplan-opt - -p inline-calls,extract-graph,build-sharding-problem,solve-sharding,propagate-sharding --mesh 2x4 --device toy | filecheck %s --check-prefix=STAGED
// RUN: %split-input %s 2 | hloplan-opt - -p inline-calls,extract-graph,build-sharding-problem,solve-sharding,propagate-sharding --mesh 2x4 --device toy --pass-option build-sharding-problem.staged_gathers=false | filecheck %s --check-prefix=ONESTEP
// RUN: %split-input %s 3 | hloplan-opt - -p inline-calls,extract-graph,build-sharding-problem,solve-sharding,propagate-sharding --mesh 2x4 --device tpu-v5e | filecheck %s --check-prefix=TPU
// RUN: %split-input %s 3 | hloplan-opt - -p inline-calls,extract-graph,build-sharding-problem,solve-sharding,propagate-sharding --mesh 2x4 --device tpu-v5e --pass-option propagate-sharding.constrain_implied=true | filecheck %s --check-prefix=EVERY

// A batch-64 matmul that is large for the toy device, its relu in a private function and an
// optimization barrier that also carries a scalar constant. The batch dim is split over all 8
// devices (999 does not divide by 8; splitting the 256 output columns would need all of x on
// every device). The weight may be stored in any layout; free ops (constants and their
// broadcasts) get no constraint; the barrier's scalar result is left alone.
// CHECK-LABEL: module @jit_mlp attributes {mhlo.num_partitions = 8 : i32, mhlo.num_replicas = 1 : i32} {
// CHECK-NEXT:    sdy.mesh @mesh = <["x"=2, "y"=4]>
// CHECK-NEXT:    func.func public @main(
// CHECK-SAME:      %arg0: tensor<64x999x256xf32> {sdy.sharding = #sdy.sharding<@mesh, [{"x", "y"}, {}, {}]>},
// CHECK-SAME:      %arg1: tensor<256x256xf32> {sdy.sharding = #sdy.sharding<@mesh, [{{[^\]]*}}]>})
// CHECK-SAME:      -> (tensor<64x999x256xf32> {jax.result_info = "result", sdy.sharding = #sdy.sharding<@mesh, [{"x", "y"}, {}, {}]>}) {{[{]$}}
// The weight reaches the matmul replicated: a constraint gathers it unless it is stored so.
// CHECK:           [[D:%.*]] = stablehlo.dot_general %arg0, {{%[^,]+}}, contracting_dims = [2] x [0]
// CHECK-SAME:        : (tensor<64x999x256xf32>, tensor<256x256xf32>) -> tensor<64x999x256xf32>{{$}}
// CHECK-NEXT:      [[DC:%.*]] = sdy.sharding_constraint [[D]] <@mesh, [{"x", "y"}, {}, {}]> : tensor<64x999x256xf32>{{$}}
// CHECK-NEXT:      [[ZERO:%.*]] = stablehlo.constant dense<0.000000e+00> : tensor<f32>{{$}}
// CHECK-NEXT:      [[ZEROS:%.*]] = stablehlo.broadcast_in_dim [[ZERO]], dims = [] : (tensor<f32>) -> tensor<64x999x256xf32>{{$}}
// CHECK-NEXT:      [[R:%.*]] = stablehlo.maximum [[DC]], [[ZEROS]] : tensor<64x999x256xf32>{{$}}
// CHECK-NEXT:      [[RC:%.*]] = sdy.sharding_constraint [[R]] <@mesh, [{"x", "y"}, {}, {}]> : tensor<64x999x256xf32>{{$}}
// CHECK-NEXT:      [[HALF:%.*]] = stablehlo.constant dense<5.000000e-01> : tensor<f32>{{$}}
// CHECK-NEXT:      [[B:%.*]]:2 = stablehlo.optimization_barrier [[RC]], [[HALF]] : tensor<64x999x256xf32>, tensor<f32>{{$}}
// CHECK-NEXT:      [[BC:%.*]] = sdy.sharding_constraint [[B]]#0 <@mesh, [{"x", "y"}, {}, {}]> : tensor<64x999x256xf32>{{$}}
// CHECK-NEXT:      [[HALVES:%.*]] = stablehlo.broadcast_in_dim [[B]]#1, dims = [] : (tensor<f32>) -> tensor<64x999x256xf32>{{$}}
// CHECK-NEXT:      [[OUT:%.*]] = stablehlo.multiply [[BC]], [[HALVES]] : tensor<64x999x256xf32>{{$}}
// CHECK-NEXT:      [[OC:%.*]] = sdy.sharding_constraint [[OUT]] <@mesh, [{"x", "y"}, {}, {}]> : tensor<64x999x256xf32>{{$}}
// CHECK-NEXT:      return [[OC]] : tensor<64x999x256xf32>
// CHECK-NEXT:    }
// CHECK-NEXT:  }
// CHECK-NOT:   {{.}}

module @jit_mlp attributes {mhlo.num_partitions = 1 : i32, mhlo.num_replicas = 1 : i32} {
  func.func public @main(%arg0: tensor<64x999x256xf32> loc("x"), %arg1: tensor<256x256xf32> loc("w")) -> (tensor<64x999x256xf32> {jax.result_info = "result"}) {
    %0 = stablehlo.dot_general %arg0, %arg1, contracting_dims = [2] x [0] : (tensor<64x999x256xf32>, tensor<256x256xf32>) -> tensor<64x999x256xf32>
    %1 = call @relu(%0) : (tensor<64x999x256xf32>) -> tensor<64x999x256xf32>
    %cst = stablehlo.constant dense<5.000000e-01> : tensor<f32>
    %2:2 = stablehlo.optimization_barrier %1, %cst : tensor<64x999x256xf32>, tensor<f32>
    %3 = stablehlo.broadcast_in_dim %2#1, dims = [] : (tensor<f32>) -> tensor<64x999x256xf32>
    %4 = stablehlo.multiply %2#0, %3 : tensor<64x999x256xf32>
    return %4 : tensor<64x999x256xf32>
  }
  func.func private @relu(%arg0: tensor<64x999x256xf32>) -> tensor<64x999x256xf32> {
    %cst = stablehlo.constant dense<0.000000e+00> : tensor<f32>
    %0 = stablehlo.broadcast_in_dim %cst, dims = [] : (tensor<f32>) -> tensor<64x999x256xf32>
    %1 = stablehlo.maximum %arg0, %0 : tensor<64x999x256xf32>
    return %1 : tensor<64x999x256xf32>
  }
}


// -----

// A loop (jax's scan) whose body calls a private function. The while op gets no sharding of its
// own: each carried value is pinned by a constraint on the loop's operand and on the body's
// yield (the counter replicated, the activations split on the batch); a yielded value whose
// producer's constraint already has that layout gets no second one. The weight's layout is
// the planner's choice.
// LOOP-LABEL: module @jit_scan attributes {mhlo.num_partitions = 8 : i32} {
// LOOP-NEXT:    sdy.mesh @mesh = <["x"=2, "y"=4]>
// LOOP-NEXT:    func.func public @main(
// LOOP-SAME:      %arg0: tensor<64x999x64xf32> {sdy.sharding = #sdy.sharding<@mesh, [{"x", "y"}, {}, {}]>},
// LOOP-SAME:      %arg1: tensor<64x64xf32> {sdy.sharding = #sdy.sharding<@mesh, [{{[^\]]*}}]>})
// LOOP-SAME:      -> (tensor<64x999x64xf32> {jax.result_info = "result", sdy.sharding = #sdy.sharding<@mesh, [{"x", "y"}, {}, {}]>}) {{[{]$}}
// LOOP-NEXT:     {{%.*}} = stablehlo.constant dense<1> : tensor<i32>
// LOOP-NEXT:     {{%.*}} = stablehlo.constant dense<4> : tensor<i32>
// LOOP-NEXT:     [[ZERO:%.*]] = stablehlo.constant dense<0> : tensor<i32>
// LOOP-NEXT:     [[W0:%.*]] = sdy.sharding_constraint %arg1 <@mesh, [{{[^\]]*}}]> : tensor<64x64xf32>
// LOOP-NEXT:     [[I0:%.*]] = sdy.sharding_constraint [[ZERO]] <@mesh, []> : tensor<i32>
// LOOP-NEXT:     [[X0:%.*]] = sdy.sharding_constraint %arg0 <@mesh, [{"x", "y"}, {}, {}]> : tensor<64x999x64xf32>
// LOOP-NEXT:     [[L:%.*]]:3 = stablehlo.while([[WI:%.*]] = [[W0]], [[II:%.*]] = [[I0]], [[XI:%.*]] = [[X0]]) : tensor<64x64xf32>, tensor<i32>, tensor<64x999x64xf32>{{$}}
// LOOP-NEXT:     cond {
// LOOP-NEXT:       [[N:%.*]] = stablehlo.constant dense<4> : tensor<i32>
// LOOP-NEXT:       [[LT:%.*]] = stablehlo.compare LT, [[II]], [[N]], SIGNED : (tensor<i32>, tensor<i32>) -> tensor<i1>
// LOOP-NEXT:       [[LTC:%.*]] = sdy.sharding_constraint [[LT]] <@mesh, []> : tensor<i1>
// LOOP-NEXT:       stablehlo.return [[LTC]] : tensor<i1>
// LOOP-NEXT:     } do {
// LOOP-NEXT:       [[ONE:%.*]] = stablehlo.constant dense<1> : tensor<i32>
// LOOP:            [[D:%.*]] = stablehlo.dot_general [[XI]], {{%[^,]+}}, contracting_dims = [2] x [0]
// LOOP-NEXT:       [[DC:%.*]] = sdy.sharding_constraint [[D]] <@mesh, [{"x", "y"}, {}, {}]> : tensor<64x999x64xf32>
// LOOP-NEXT:       [[T:%.*]] = stablehlo.tanh [[DC]] : tensor<64x999x64xf32>{{$}}
// LOOP-NEXT:       [[TC:%.*]] = sdy.sharding_constraint [[T]] <@mesh, [{"x", "y"}, {}, {}]> : tensor<64x999x64xf32>
// LOOP-NEXT:       [[I1:%.*]] = stablehlo.add [[II]], [[ONE]] : tensor<i32>{{$}}
// LOOP-NEXT:       [[IC:%.*]] = sdy.sharding_constraint [[I1]] <@mesh, []> : tensor<i32>
// LOOP-NEXT:       [[WY:%.*]] = sdy.sharding_constraint [[WI]] <@mesh, [{{[^\]]*}}]> : tensor<64x64xf32>
// LOOP-NEXT:       stablehlo.return [[WY]], [[IC]], [[TC]] : tensor<64x64xf32>, tensor<i32>, tensor<64x999x64xf32>
// LOOP-NEXT:     }
// LOOP-NEXT:     return [[L]]#2 : tensor<64x999x64xf32>
// LOOP-NEXT:   }
// LOOP-NEXT: }
// LOOP-NOT:  {{.}}

module @jit_scan {
  func.func public @main(%arg0: tensor<64x999x64xf32> loc("x"), %arg1: tensor<64x64xf32> loc("w")) -> (tensor<64x999x64xf32> {jax.result_info = "result"}) {
    %c = stablehlo.constant dense<1> : tensor<i32>
    %c_0 = stablehlo.constant dense<4> : tensor<i32>
    %c_1 = stablehlo.constant dense<0> : tensor<i32>
    %0:3 = stablehlo.while(%iterArg = %arg1, %iterArg_2 = %c_1, %iterArg_3 = %arg0) : tensor<64x64xf32>, tensor<i32>, tensor<64x999x64xf32>
    cond {
      %1 = stablehlo.compare LT, %iterArg_2, %c_0, SIGNED : (tensor<i32>, tensor<i32>) -> tensor<i1>
      stablehlo.return %1 : tensor<i1>
    } do {
      %1 = func.call @layer(%iterArg_3, %iterArg) : (tensor<64x999x64xf32>, tensor<64x64xf32>) -> tensor<64x999x64xf32>
      %2 = stablehlo.add %iterArg_2, %c : tensor<i32>
      stablehlo.return %iterArg, %2, %1 : tensor<64x64xf32>, tensor<i32>, tensor<64x999x64xf32>
    }
    return %0#2 : tensor<64x999x64xf32>
  }
  func.func private @layer(%arg0: tensor<64x999x64xf32>, %arg1: tensor<64x64xf32>) -> tensor<64x999x64xf32> {
    %0 = stablehlo.dot_general %arg0, %arg1, contracting_dims = [2] x [0] : (tensor<64x999x64xf32>, tensor<64x64xf32>) -> tensor<64x999x64xf32>
    %1 = stablehlo.tanh %0 : tensor<64x999x64xf32>
    return %1 : tensor<64x999x64xf32>
  }
}

// -----

// Batch-norm-like statistics between two matmuls, everything split over the batch on (x, y).
// The sum over the batch is reduce-scattered over (x, y) and gathered back for the broadcast.
// Gathering (x, y) as y, then x, takes 3 + 1 ring steps instead of 7 for the same bytes, so
// the plan pins the layout in between, [x], and XLA's partitioner issues two all-gathers. The
// weight is stored split over the 8 devices and gathered whole before the first matmul, in
// two all-gathers of the same steps and bytes whichever way it is stored ([(x, y), -] pinned
// through [x, -], or [y, x]). With the option off, each value goes from (x, y) to replicated
// in one constraint.
// STAGED-LABEL: module @jit_norm
// STAGED:         [[W:%.*]] = sdy.sharding_constraint {{.*}} <@mesh, [{}, {}]> : tensor<256x256xf32>
// STAGED-NEXT:    stablehlo.dot_general %arg0, [[W]]
// STAGED:         [[S:%.*]] = stablehlo.reduce
// STAGED-NEXT:    [[SC:%.*]] = sdy.sharding_constraint [[S]] <@mesh, [{"x", "y"}]> : tensor<256xf32>
// STAGED-NEXT:    [[R:%.*]] = stablehlo.rsqrt [[SC]] : tensor<256xf32>
// STAGED-NEXT:    [[RC:%.*]] = sdy.sharding_constraint [[R]] <@mesh, [{"x", "y"}]> : tensor<256xf32>
// STAGED-NEXT:    [[R1:%.*]] = sdy.sharding_constraint [[RC]] <@mesh, [{"x"}]> : tensor<256xf32>
// STAGED-NEXT:    [[R2:%.*]] = sdy.sharding_constraint [[R1]] <@mesh, [{}]> : tensor<256xf32>
// STAGED-NEXT:    stablehlo.broadcast_in_dim [[R2]], dims = [1]
// ONESTEP-LABEL: module @jit_norm
// ONESTEP:         [[W:%.*]] = sdy.sharding_constraint %arg1 <@mesh, [{}, {}]> : tensor<256x256xf32>
// ONESTEP-NEXT:    stablehlo.dot_general %arg0, [[W]]
// ONESTEP:         [[R0:%[0-9]+]] = stablehlo.rsqrt
// ONESTEP-NEXT:    [[RC:%.*]] = sdy.sharding_constraint [[R0]] <@mesh, [{"x", "y"}]> : tensor<256xf32>
// ONESTEP-NEXT:    [[R:%.*]] = sdy.sharding_constraint [[RC]] <@mesh, [{}]> : tensor<256xf32>
// ONESTEP-NEXT:    stablehlo.broadcast_in_dim [[R]], dims = [1]

module @jit_norm {
  func.func public @main(%x: tensor<4096x256xf32>, %w: tensor<256x256xf32>) -> (tensor<4096x256xf32> {jax.result_info = "result"}) {
    %h = stablehlo.dot_general %x, %w, contracting_dims = [1] x [0] : (tensor<4096x256xf32>, tensor<256x256xf32>) -> tensor<4096x256xf32>
    %sq = stablehlo.multiply %h, %h : tensor<4096x256xf32>
    %zero = stablehlo.constant dense<0.000000e+00> : tensor<f32>
    %s = stablehlo.reduce(%sq init: %zero) applies stablehlo.add across dimensions = [0] : (tensor<4096x256xf32>, tensor<f32>) -> tensor<256xf32>
    %r = stablehlo.rsqrt %s : tensor<256xf32>
    %b = stablehlo.broadcast_in_dim %r, dims = [1] : (tensor<256xf32>) -> tensor<4096x256xf32>
    %y = stablehlo.multiply %h, %b : tensor<4096x256xf32>
    %o = stablehlo.dot_general %y, %w, contracting_dims = [1] x [0] : (tensor<4096x256xf32>, tensor<256x256xf32>) -> tensor<4096x256xf32>
    return %o : tensor<4096x256xf32>
  }
}

// -----

// A weight gradient made as [out, in] and transposed to the weight's [in, out] for its update,
// its 4096 tokens split over x (the matmul's partial sums reduced over x). On a TPU device
// model the transpose's result is pinned, not the matmul's: libtpu folds a transpose into the
// matmul before it only with no constraint between them (with one, the update runs in the
// transposed layout, the weight and its moments copied into it and back).
// TPU-LABEL: module @jit_update
// TPU:         [[G:%.*]] = stablehlo.dot_general %arg2, %arg1, contracting_dims = [0] x [0]
// TPU-NEXT:    [[T:%.*]] = stablehlo.transpose [[G]], dims = [1, 0]
// TPU-NEXT:    [[TC:%.*]] = sdy.sharding_constraint [[T]] <@mesh, [{{.*}}]> : tensor<64x128xf32>{{$}}
// TPU:         stablehlo.multiply [[TC]],
// EVERY-LABEL: module @jit_update
// EVERY:         [[G:%.*]] = stablehlo.dot_general %arg2, %arg1, contracting_dims = [0] x [0]
// EVERY-NEXT:    [[GC:%.*]] = sdy.sharding_constraint [[G]] <@mesh, [{{.*}}]> : tensor<128x64xf32>{{$}}
// EVERY-NEXT:    stablehlo.transpose [[GC]], dims = [1, 0]

module @jit_update {
  func.func public @main(%w: tensor<64x128xf32>, %x: tensor<4096x64xf32>, %dy: tensor<4096x128xf32>) -> (tensor<64x128xf32> {jax.result_info = "result"}) {
    %g = stablehlo.dot_general %dy, %x, contracting_dims = [0] x [0] : (tensor<4096x128xf32>, tensor<4096x64xf32>) -> tensor<128x64xf32>
    %t = stablehlo.transpose %g, dims = [1, 0] : (tensor<128x64xf32>) -> tensor<64x128xf32>
    %c = stablehlo.constant dense<1.000000e-01> : tensor<f32>
    %cb = stablehlo.broadcast_in_dim %c, dims = [] : (tensor<f32>) -> tensor<64x128xf32>
    %s = stablehlo.multiply %t, %cb : tensor<64x128xf32>
    %r = stablehlo.subtract %w, %s : tensor<64x128xf32>
    return %r : tensor<64x128xf32>
  }
}
