"""propagate-sharding: the module does the reshards the plan priced."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest
from jax import export

from hloplan import ir
from hloplan.compiler import make_options
from hloplan.passes.build_sharding_problem import BuildShardingProblem
from hloplan.passes.extract_graph import ExtractGraph
from hloplan.passes.inline_calls import InlineCalls
from hloplan.passes.propagate_sharding import PropagateSharding
from hloplan.passmanager import run_passes
from hloplan.solver.problem import Solution

X, Y = (0,), (1,)


def _two_readers(w, a, b):
    return jnp.sum(a @ w) + jnp.sum(b @ w)


def _state():
    s = jax.ShapeDtypeStruct
    exported = export.export(jax.jit(_two_readers), platforms=("cpu",))(
        s((64, 64), jnp.float32), s((32, 64), jnp.float32), s((32, 64), jnp.float32))
    program = ir.load_program(bytes(exported.serialize()), "two_readers.jaxexport")
    return run_passes(program, make_options("2x4", device="toy"),
                        [InlineCalls(), ExtractGraph(), BuildShardingProblem()])


def _pick(state, op_index: int, want) -> int:
    """The index of a strategy of `op_index` for which want(strategy) holds."""
    return next(i for i, s in enumerate(state.space.strategies[op_index]) if want(s))


def _propagate(state, picks) -> str:
    """Solve by hand (op index -> a test picking its strategy: the first that passes; every
    other op its first strategy), run propagate-sharding, return the module's text."""
    choice = [0] * len(state.problem.nodes)
    for op_index, want in picks.items():
        choice[state.space.node_of[op_index]] = _pick(state, op_index, want)
    state.solution = Solution(tuple(choice))
    PropagateSharding().apply(state)
    return str(state.program.module)


def test_a_read_priced_from_an_earlier_readers_layout_is_emitted_as_a_chain():
    """w stored [x, y]; the first matmul gathers it over x, the second needs it whole. The plan
    prices the second read as a gather over y of the first one's layout; XLA would gather
    [x, y] whole again unless the constraint reads the first constraint's result."""
    state = _state()
    graph = state.graph
    w = graph.arguments[0]
    first, second = [u for u in dict.fromkeys(graph.values[w].users)
                     if graph.ops[u].name == "stablehlo.dot_general"]
    assert state.space.reads_via[second, 1] == (first, 1)
    picks = {graph.values[w].producer: lambda s: s.results[0] == (X, Y),
             first: lambda s: s.operands[1] == ((), Y),
             second: lambda s: s.operands[1] == ((), ())}
    text = _propagate(state, picks)
    gathered_x = re.search(r'(%\S+) = sdy.sharding_constraint %arg0 <@mesh, \[\{\}, \{"y"\}\]>',
                           text)
    assert gathered_x, text
    # The whole weight comes from the x-gathered one, not from %arg0.
    assert re.search(rf'sdy.sharding_constraint {re.escape(gathered_x.group(1))} '
                     r'<@mesh, \[\{\}, \{\}\]>', text), text
    assert not re.search(r'sdy.sharding_constraint %arg0 <@mesh, \[\{\}, \{\}\]>', text)


def test_a_read_cheaper_from_the_values_own_layout_is_not_chained():
    """w stored [x, -]; the first matmul reads it [-, x] (an all-to-all), the second [x, y]: a
    slice of the stored layout, free, where going on from [-, x] would be another all-to-all."""
    state = _state()
    graph = state.graph
    w = graph.arguments[0]
    first, second = [u for u in dict.fromkeys(graph.values[w].users)
                     if graph.ops[u].name == "stablehlo.dot_general"]
    picks = {graph.values[w].producer: lambda s: s.results[0] == (X, ()),
             first: lambda s: s.operands[1] == ((), X),
             second: lambda s: s.operands[1] == (X, Y)}
    text = _propagate(state, picks)
    assert re.search(r'sdy.sharding_constraint %arg0 <@mesh, \[\{\}, \{"x"\}\]>', text), text
    assert re.search(r'sdy.sharding_constraint %arg0 <@mesh, \[\{"x"\}, \{"y"\}\]>', text), text


def _scaled(x):
    return x * 0.5


def _donated_state():
    s = jax.ShapeDtypeStruct
    exported = export.export(jax.jit(_scaled, donate_argnums=(0,)), platforms=("cpu",))(
        s((64, 64), jnp.float32))
    program = ir.load_program(bytes(exported.serialize()), "scaled.jaxexport")
    return run_passes(program, make_options("2x4", device="toy"),
                        [InlineCalls(), ExtractGraph(), BuildShardingProblem()])


def _plan_layouts(state, stored, computed):
    """Store x as `stored`, compute its new value as `computed`; run propagate-sharding."""
    graph = state.graph
    x = graph.arguments[0]
    scale = graph.values[graph.outputs[0]].producer
    choice = [0] * len(state.problem.nodes)
    for op_index, spec in ((graph.values[x].producer, stored), (scale, computed)):
        choice[state.space.node_of[op_index]] = _pick(state, op_index,
                                                      lambda s, spec=spec: s.results[0] == spec)
    state.solution = Solution(tuple(choice))
    PropagateSharding().apply(state)
    main = str(state.program.module).split("func.func public @main", 1)[1].split("{\n", 1)[0]
    return main, state


def test_a_donated_arguments_result_keeps_the_arguments_layout():
    """x * 0.5 is written into donated x's buffer, which XLA does only when the two have one
    layout (and the next step passes the result back as x): a plan that lays the result out
    otherwise gets the argument's layout at the end, with a warning."""
    main, state = _plan_layouts(_donated_state(), stored=(X, Y), computed=(Y, X))
    assert 'tf.aliasing_output = 0' in main
    result = main.split("->", 1)[1]
    assert '[{"x"}, {"y"}]' in result and '[{"y"}, {"x"}]' not in result, main
    assert state.facts["donation"] == {"arguments": [0], "aliases": [[0, 0]],
                                       "resharded_results": [0]}
    (warning,) = state.log.warnings
    assert "donated argument x" in warning.message and "resharded" in warning.message


def test_a_donated_arguments_result_in_its_layout_is_left_alone():
    main, state = _plan_layouts(_donated_state(), stored=(X, Y), computed=(X, Y))
    assert '[{"x"}, {"y"}]' in main.split("->", 1)[1]
    assert state.facts["donation"]["resharded_results"] == []
    assert not state.log.warnings


def test_boundary_layouts_are_priced_as_the_loader_moves_them():
    """A task's input that another task made [(x, y), -] reaches it through jax.device_put,
    which XLA reshards in one all-gather over (x, y): price_boundary_layouts prices that, not the
    cheaper staged gathers that only pinned layouts inside a program get."""
    from hloplan.pipeline_parallel.tasks import price_boundary_layouts

    state = _state()
    assert state.comm.staged_gathers
    w = state.graph.arguments[0]
    node = state.space.node_of[state.graph.values[w].producer]
    before = [s.communication_cost for s in state.problem.nodes[node].strategies]
    made = ((0, 1), ())
    price_boundary_layouts(state, incoming=((0, made, 1.0),))
    after = [s.communication_cost for s in state.problem.nodes[node].strategies]
    layouts = [s.results[0] for s in state.space.strategies[state.graph.values[w].producer]]
    replicated = layouts.index(((), ()))
    one_step = state.comm.reshard((64, 64), 4, made, ((), ()), staged=False)
    staged = state.comm.reshard((64, 64), 4, made, ((), ()))
    assert staged.seconds < one_step.seconds and staged.via and not one_step.via
    assert after[replicated] - before[replicated] == pytest.approx(one_step.seconds)
    assert after[layouts.index(made)] == before[layouts.index(made)]


def _looped(w, x):
    return jax.lax.fori_loop(0, 3, lambda i, c: (c[0], jnp.tanh(c[1] @ c[0])), (w, x))[1]


def test_a_loop_carry_entered_by_a_staged_gather_is_pinned_stage_by_stage():
    """w stored [(x, y), -] and carried through a loop replicated: the entry edge is priced as a
    gather over y, then x; the pins before the while go [x, -], then [-, -], as priced."""
    s = jax.ShapeDtypeStruct
    exported = export.export(jax.jit(_looped), platforms=("cpu",))(
        s((64, 64), jnp.float32), s((32, 64), jnp.float32))
    program = ir.load_program(bytes(exported.serialize()), "looped.jaxexport")
    state = run_passes(program, make_options("2x4", device="toy"),
                         [InlineCalls(), ExtractGraph(), BuildShardingProblem()])
    graph = state.graph
    w = graph.arguments[0]
    (carry,) = [u for u in graph.values[w].users if graph.ops[u].name == "while.carry"]
    picks = {graph.values[w].producer: lambda s: s.results[0] == ((0, 1), ()),
             carry: lambda s: s.results[0] == ((), ())}
    text = _propagate(state, picks)
    first = re.search(r'(%\S+) = sdy.sharding_constraint %arg0 <@mesh, \[\{"x"\}, \{\}\]>', text)
    assert first, text
    second = re.search(rf'(%\S+) = sdy.sharding_constraint {re.escape(first.group(1))} '
                       r'<@mesh, \[\{\}, \{\}\]>', text)
    assert second, text
    assert re.search(rf'stablehlo.while\(%\S+ = {re.escape(second.group(1))}', text), text
    assert not re.search(r'sdy.sharding_constraint %arg0 <@mesh, \[\{\}, \{\}\]>', text)


def _conv_state(taps: int):
    """A convolution with a `taps` x `taps` kernel and its input gradient (jax reads the kernel
    there through a reverse of its two spatial dims)."""
    def step(k, x, g):
        conv = lambda x: jax.lax.conv_general_dilated(  # noqa: E731
            x, k, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
        y, vjp = jax.vjp(conv, x)
        return jnp.sum(y) + jnp.sum(vjp(g)[0])

    s = jax.ShapeDtypeStruct
    exported = export.export(jax.jit(step), platforms=("cpu",))(
        s((taps, taps, 64, 128), jnp.float32), s((8, 16, 16, 64), jnp.float32),
        s((8, 16, 16, 128), jnp.float32))
    program = ir.load_program(bytes(exported.serialize()), "conv.jaxexport")
    return run_passes(program, make_options("2x4", device="toy"),
                      [InlineCalls(), ExtractGraph(), BuildShardingProblem()])


@pytest.mark.parametrize("taps", [1, 3])
def test_a_kernel_read_through_a_reverse_of_size_one_dims_shares_the_earlier_read(taps):
    """The input gradient of a 1x1 convolution reads the kernel through a reverse of its two
    dims of size 1, which XLA removes: it shares the forward convolution's reshard of the
    kernel (libtpu gathers an FSDP-stored 1x1 kernel once for both). A 3x3 kernel's reverse
    is a value of its own."""
    state = _conv_state(taps)
    graph = state.graph
    kernel = graph.arguments[0]
    (forward,) = [u for u in graph.values[kernel].users
                  if graph.ops[u].name == "stablehlo.convolution"]
    (reverse,) = [u for u in graph.values[kernel].users if graph.ops[u].name == "stablehlo.reverse"]
    (backward,) = graph.values[graph.ops[reverse].results[0]].users
    assert graph.ops[backward].name == "stablehlo.convolution"
    assert state.space.reads_via.get((backward, 1)) == ((forward, 1) if taps == 1 else None)
