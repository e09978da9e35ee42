"""Arguments are named by readable pytree paths; an op's location is the user's line, not
the library frame jax recorded innermost (flax, optax, ... call the primitive)."""

from __future__ import annotations

from hloplan import ir

MODULE = '''
module @jit_step {
  func.func public @main(%arg0: tensor<4xf32> loc("opt_state[0].mu['l2']['kernel'].value"),
                         %arg1: tensor<4xf32> loc("params['l2']['kernel'].value"),
                         %arg2: tensor<4xf32> loc("opt_state[0].count"))
      -> (tensor<4xf32> {jax.result_info = "result[1]['l2']['kernel'].value"}) {
    %0 = stablehlo.add %arg0, %arg1 : tensor<4xf32> loc(#add)
    return %0 : tensor<4xf32>
  }
}
#linear = loc("__call__"("/venv/lib/python3.11/site-packages/flax/nnx/nn/linear.py":312:8))
#model = loc("__call__"("/home/user/model.py":12:16))
#train = loc("step"("/home/user/train.py":30:9))
#add = loc("jit(step)/add"(callsite(#linear at callsite(#model at #train))))
'''


def test_readable_names_and_user_frames():
    program = ir.load_program(MODULE.encode(), "step.mlir")
    graph, _ = ir.extract_graph(program.module, "step.mlir")
    assert graph.argument_names == ["opt_state.mu.l2.kernel", "params.l2.kernel",
                                    "opt_state.count"]
    assert graph.output_names == ["result[1].l2.kernel"]
    add = next(op for op in graph.ops if op.name == "stablehlo.add")
    assert (add.location.file, add.location.line) == ("/home/user/model.py", 12)


def test_readable_names_stay_distinct():
    assert ir.readable_names(["params[0]", "params[1]", "a[0].b", "a[1].b", "x"]) == [
        "params[0]", "params[1]", "a[0].b", "a[1].b", "x"]
    # Dropping ".value" would make these two the same name: both keep their first readable form.
    assert ir.readable_names(["s['k'].value", "s['k']"]) == ["s.k.value", "s.k"]


def test_all_library_frames_keep_the_innermost():
    text = MODULE.replace("/home/user/model.py", "/x/site-packages/optax/m.py").replace(
        "/home/user/train.py", "/x/site-packages/jax/t.py")
    program = ir.load_program(text.encode(), "step.mlir")
    graph, _ = ir.extract_graph(program.module, "step.mlir")
    add = next(op for op in graph.ops if op.name == "stablehlo.add")
    assert add.location.line == 312
