"""Donation: an export of `jax.jit(step, donate_argnums=(0,))` records which arguments the
caller hands over (`tf.aliasing_output`). The plan writes each new state leaf into its old
buffer, the loader donates those arguments as the original jax.jit does, and the step still
computes the single-device answer, step after step."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from click.testing import CliRunner
from jax import export

import hloplan
from hloplan.cli import main


def _step(state, x, y):
    def loss(params):
        h = jnp.tanh(x @ params["w1"] + params["b1"])
        return jnp.mean((h @ params["w2"] - y) ** 2)

    value, grads = jax.value_and_grad(loss)(state["params"])
    momentum = jax.tree.map(lambda m, g: 0.9 * m + g, state["momentum"], grads)
    params = jax.tree.map(lambda p, m: p - 0.01 * m, state["params"], momentum)
    return value, {"params": params, "momentum": momentum, "count": state["count"] + 1}


def _state(rng):
    params = {"w1": rng.standard_normal((64, 256), np.float32) * 0.1,
              "b1": np.zeros((256,), np.float32),
              "w2": rng.standard_normal((256, 32), np.float32) * 0.1}
    return {"params": params, "momentum": jax.tree.map(np.zeros_like, params),
            "count": np.zeros((), np.int32)}


def _plan(tmp_path, donate, extra=()):
    rng = np.random.default_rng(0)
    state = _state(rng)
    x = rng.standard_normal((128, 64), np.float32)
    y = rng.standard_normal((128, 32), np.float32)
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), (state, x, y))
    jitted = jax.jit(_step, donate_argnums=(0,) if donate else ())
    path = tmp_path / "step.jaxexport"
    path.write_bytes(export.export(jitted, platforms=("cpu",))(*abstract).serialize())
    out = tmp_path / "plan"
    run = CliRunner().invoke(main, ["compile", str(path), "--mesh", "2x4", "--device", "toy",
                                    "-o", str(out), "-q", *extra])
    assert run.exit_code == 0, run.output
    return out, state, x, y


@pytest.mark.usefixtures("devices8")
def test_donated_state_is_updated_in_place_and_equals_single_device(tmp_path):
    out, state, x, y = _plan(tmp_path, donate=True)
    plan = json.loads((out / "plan.json").read_text())
    leaves = len(jax.tree.leaves(state))
    assert plan["donation"]["arguments"] == list(range(leaves))
    assert len(plan["donation"]["aliases"]) == leaves
    # The plan shards the state (so aliasing is per device, layouts matter).
    assert any(any(axes) for a in plan["arguments"][:leaves] for axes in a["spec"])
    step = hloplan.load(out)
    placed, _ = step.place(state, x, y)
    # The state arrays are on the mesh in the plan's layout: the program takes their buffers.
    compiled = step.lower(*placed).compile()
    state_bytes = sum(int(np.prod(s.shard_shape(a.shape))) * a.dtype.itemsize
                      for a, s in zip(jax.tree.leaves(placed[0]),
                                      jax.tree.leaves(step.in_shardings[:leaves])))
    assert compiled.memory_analysis().alias_size_in_bytes == state_bytes
    reference = jax.jit(_step)
    want_state = state
    got_state, placed_x, placed_y = placed
    for _ in range(3):  # a training loop passes each step's state back in
        want_loss, want_state = reference(want_state, x, y)
        given = jax.tree.leaves(got_state)
        got_loss, got_state = step(got_state, placed_x, placed_y)
        assert all(a.is_deleted() for a in given)
        np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
        for got, want in zip(jax.tree.leaves(got_state), jax.tree.leaves(want_state)):
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-6)


@pytest.mark.usefixtures("devices8")
def test_arrays_the_loader_places_or_is_told_to_keep_are_not_consumed(tmp_path):
    out, state, x, y = _plan(tmp_path, donate=True)
    kept = hloplan.load(out, donate=False)
    placed, _ = kept.place(state, x, y)
    kept(*placed)
    assert not any(a.is_deleted() for a in jax.tree.leaves(placed))
    # Arrays that need placing are copied onto the mesh first: the caller's stay usable (a
    # replicated scalar among them, whose buffer jax.device_put would reuse for one shard).
    on_one_device = jax.tree.map(jnp.asarray, state)
    hloplan.load(out)(on_one_device, x, y)
    assert not any(a.is_deleted() for a in jax.tree.leaves(on_one_device))


@pytest.mark.usefixtures("devices8")
def test_without_donation_nothing_is_aliased_and_results_have_their_own_buffers(tmp_path):
    out, state, x, y = _plan(tmp_path, donate=False)
    plan = json.loads((out / "plan.json").read_text())
    assert plan["donation"] == {"arguments": [], "aliases": [], "resharded_results": []}
    step = hloplan.load(out)
    placed, _ = step.place(state, x, y)
    assert step.lower(*placed).compile().memory_analysis().alias_size_in_bytes == 0
    step(*placed)
    assert not any(a.is_deleted() for a in jax.tree.leaves(placed))


@pytest.mark.usefixtures("devices8")
def test_an_accumulated_plan_hands_the_state_to_the_update_task(tmp_path):
    """The pipeline loader runs the microbatches' tasks, then the once-per-step update, which
    reads the state last: the state the caller passes back on the mesh is donated to it, and
    arrays the loader had to move are not (their buffers may be the caller's). The tasks'
    estimates count their results in buffers of their own."""
    out, state, x, y = _plan(tmp_path, donate=True, extra=("--stages", "1", "--microbatches", "2"))
    plan = json.loads((out / "plan.json").read_text())
    assert plan["pipeline"]["tasks"]
    assert plan["donation"]["aliases"] == [] and plan["donation"]["arguments"]
    assert plan["donation"]["loader"] == "pipelined: to the update tasks that read it last"
    explained = CliRunner().invoke(main, ["explain", str(out)]).stdout
    assert "hands them to the once-per-step tasks that read them last" in explained
    step = hloplan.load(out)
    donating = {step.tasks[t]["name"]: picks for t, picks in step._donatable.items()}
    assert donating and all(step.tasks[t]["part"] == "B" for t in step._donatable)
    given = jax.tree.map(jnp.asarray, state)
    reference = jax.jit(_step)
    want_state, got_state = state, given
    for turn in range(3):
        want_loss, want_state = reference(want_state, x, y)
        passed = jax.tree.leaves(got_state)
        got_loss, got_state = step(got_state, x, y)
        np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
        for got, want in zip(jax.tree.leaves(got_state), jax.tree.leaves(want_state)):
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-6)
        deleted = sum(a.is_deleted() for a in passed)
        if turn == 0:
            assert deleted == 0  # the caller's single-device arrays were moved, not donated
        else:
            # The last step's state, on the mesh as the update task takes it: handed over.
            assert deleted >= sum(len(p) for p in donating.values()) > 0
    kept = hloplan.load(out, donate=False)
    passed = jax.tree.leaves(got_state)
    kept(got_state, x, y)
    assert not any(a.is_deleted() for a in passed)


def test_a_donated_step_runs_as_a_two_process_job(tmp_path):
    """Each process places its shards of the state and hands them to the program."""
    out, *_ = _plan(tmp_path, donate=True)
    run = CliRunner().invoke(main, ["run", str(out), "--check", "--processes", "2",
                                    "--format", "json"], catch_exceptions=False)
    assert run.exit_code == 0, run.output
    report = json.loads(run.output)
    assert report["match"] is True and report["processes"] == 2


@pytest.mark.usefixtures("devices8")
def test_donate_state_for_an_export_without_donation(tmp_path):
    """`--donate state` hands over what the step updates in place (parameters, moments, the
    step count: each result computed from its argument by elementwise ops of its type) of a
    program exported without donation; `--donate none` ignores the export's donation."""
    out, state, x, y = _plan(tmp_path, donate=False, extra=("--donate", "state"))
    plan = json.loads((out / "plan.json").read_text())
    leaves = len(jax.tree.leaves(state))
    assert plan["donation"]["arguments"] == list(range(leaves))
    # Results: the loss, then the state's leaves in the same order as the arguments.
    assert plan["donation"]["aliases"] == [[k, k + 1] for k in range(leaves)]
    step = hloplan.load(out)
    placed, _ = step.place(state, x, y)
    got_loss, got_state = step(*placed)
    assert all(a.is_deleted() for a in jax.tree.leaves(placed[0]))
    want_loss, want_state = jax.jit(_step)(state, x, y)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
    for got, want in zip(jax.tree.leaves(got_state), jax.tree.leaves(want_state)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-6)
    (tmp_path / "none").mkdir()
    ignored, *_ = _plan(tmp_path / "none", donate=True, extra=("--donate", "none"))
    assert json.loads((ignored / "plan.json").read_text())["donation"]["arguments"] == []


def test_donate_rejects_an_unknown_choice():
    import hloplan.diagnostics

    with pytest.raises(hloplan.diagnostics.UsageError, match="donate='all'"):
        hloplan.compile(_MODULE, "8", donate="all")


_MODULE = b"""
func.func public @main(%arg0: tensor<8xf32>) -> tensor<8xf32> {
  %0 = stablehlo.add %arg0, %arg0 : tensor<8xf32>
  return %0 : tensor<8xf32>
}
"""
