"""Pipeline parallelism and microbatching, run on 8 simulated CPU devices.

A pipelined plan (stages on submeshes of the first mesh axis, microbatches, GPipe or 1F1B)
must give the single-device step; the stage cut must be the balanced one; programs whose batch
cannot be split (batch statistics) are refused at the op that reads them.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import hloplan
from fixtures import models
from hloplan import ir
from hloplan.compiler import PipelineOptions, make_options
from hloplan.diagnostics import HloplanError
from hloplan.passes.cut_pipeline import balanced_cut, cut, schedule
from hloplan.passes.extract_graph import ExtractGraph
from hloplan.passes.inline_calls import InlineCalls
from hloplan.passes.label_batch import analyse
from hloplan.passmanager import run_passes

pytestmark = pytest.mark.usefixtures("devices8")


@pytest.fixture(scope="module")
def gpt4(tmp_path_factory):
    """A 4-layer GPT-style train step (SGD) and its inputs."""
    params, _, tokens, targets = models.gpt_train_step_args(seed=0, batch=16, n_layers=4)
    exported = export.export(jax.jit(models.gpt_sgd_step))(params, tokens, targets)
    path = tmp_path_factory.mktemp("gpt4") / "gpt4.jaxexport"
    path.write_bytes(exported.serialize())
    expected = jax.jit(models.gpt_sgd_step)(params, tokens, targets)
    return path, (params, tokens, targets), expected


def _assert_close(got, want):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("stages,microbatches,schedule_kind", [
    (2, 4, "gpipe"),
    (4, 8, "1f1b"),
])
def test_pipelined_train_step_equals_single_device(gpt4, tmp_path, stages, microbatches,
                                                   schedule_kind):
    path, args, expected = gpt4
    result = hloplan.compile(path, "8", output=tmp_path / "plan", device="toy",
                             pipeline=PipelineOptions(stages, microbatches, schedule_kind))
    pipe = result.plan["pipeline"]
    assert (pipe["stages"], pipe["microbatches"], pipe["schedule"]) == (
        stages, microbatches, schedule_kind)
    assert {t["stage"] for t in pipe["tasks"]} == set(range(stages))
    # Every (part-A task, microbatch) pair is dispatched exactly once.
    a_tasks = [t["index"] for t in pipe["tasks"] if t["part"] == "A"]
    assert sorted(map(tuple, pipe["order"])) == sorted(
        (t, m) for t in a_tasks for m in range(microbatches))
    assert pipe["batch_arguments"] == ["tokens", "targets"]
    _assert_close(hloplan.load(tmp_path / "plan")(*args), expected)


def test_pipelined_forward_only(tmp_path, helpers, fixtures_dir):
    exported, args, kwargs = helpers.fixture_arguments("mlp_forward")
    expected = helpers.single_device_call(exported, args, kwargs)
    hloplan.compile(fixtures_dir / "mlp_forward.jaxexport", "8", output=tmp_path / "plan",
                    device="toy", pipeline=PipelineOptions(2, 4, "1f1b"))
    plan = json.loads((tmp_path / "plan" / "plan.json").read_text())
    assert plan["pipeline"]["stages"] == 2
    assert not [t for t in plan["pipeline"]["tasks"] if t["part"] == "B"]  # nothing to accumulate
    _assert_close(hloplan.load(tmp_path / "plan")(*args, **kwargs), expected)


def test_balanced_cut_arithmetic():
    # costs 4 | 1 1 1 1: two stages of 4 each beats any other split (e.g. 5 | 3).
    assert balanced_cut([4, 1, 1, 1, 1], 2) == [0, 1]
    # 1 1 | 1 1 for equal layers.
    assert balanced_cut([1, 1, 1, 1], 2) == [0, 2]
    # Every stage gets something even when one op dominates.
    assert len(balanced_cut([10, 1, 1], 3)) == 3


def unequal_mlp(params, x):
    """Layer 0 is 4x wider than the others: it costs as much as the other three together."""
    h = x
    for w in params:
        h = jnp.tanh(h @ w)
    return h


def test_unequal_layers_get_the_balanced_cut():
    widths = [(64, 256), (256, 64), (64, 64), (64, 64), (64, 64), (64, 64), (64, 64)]
    params = [jax.ShapeDtypeStruct(s, jnp.float32) for s in widths]
    x = jax.ShapeDtypeStruct((32, 64), jnp.float32)
    exported = export.export(jax.jit(unequal_mlp))(params, x)
    program = ir.load_program(exported.serialize(), "unequal.jaxexport")
    state = run_passes(program, make_options("8", device="toy"), [InlineCalls(), ExtractGraph()])
    graph = state.graph
    pieces = cut(graph, analyse(graph), 2)
    # FLOPs per layer: 32*64*256*2 for each of the first two, 32*64*64*2 for the other five:
    # 4 + 4 | 1+1+1+1+1 is the balanced cut (max 8 vs 5); [4 | 4+5] would give 9.
    stage_of_dot = [t.stage for t in pieces.tasks for u in t.units
                    if graph.ops[u].name == "stablehlo.dot_general"]
    assert stage_of_dot == [0, 0, 1, 1, 1, 1, 1]
    assert pieces.stage_cost[0] == pytest.approx(pieces.stage_cost[1] * 8 / 5, rel=0.05)


def test_one_f_one_b_keeps_at_most_stages_microbatches_in_flight():
    params = [jax.ShapeDtypeStruct((64, 64), jnp.float32) for _ in range(4)]
    x = jax.ShapeDtypeStruct((32, 64), jnp.float32)

    def step(params, x):
        loss, grads = jax.value_and_grad(lambda p: jnp.sum(unequal_mlp(p, x) ** 2))(params)
        return loss, grads

    exported = export.export(jax.jit(step))(params, x)
    program = ir.load_program(exported.serialize(), "mlp.jaxexport")
    state = run_passes(program, make_options("8", device="toy"), [InlineCalls(), ExtractGraph()])
    pieces = cut(state.graph, analyse(state.graph), 2)
    order = schedule(pieces, 8, "1f1b")
    first = {t.stage: t.index for t in sorted(pieces.tasks, key=lambda t: t.phase)
             if t.part == "A" and t.phase == min(o.phase for o in pieces.tasks
                                                if o.part == "A" and o.stage == t.stage)}
    last = {t.stage: t.index for t in sorted(pieces.tasks, key=lambda t: t.phase) if t.part == "A"}
    # A microbatch is in flight on a stage from its first task there to its last; the last
    # stage runs forward and backward as one task, so nothing waits there.
    assert first[1] == last[1]
    in_flight = peak = 0
    for task, _ in order:
        if task == first[0]:
            in_flight += 1
        elif task == last[0]:
            in_flight -= 1
        peak = max(peak, in_flight)
    assert peak <= 2  # at most S microbatches held on stage 0 (GPipe would hold all 8)
    gpipe = schedule(pieces, 8, "gpipe")
    assert sorted(gpipe) == sorted(order)


def test_batch_statistics_are_refused_at_the_op(fixtures_dir):
    path = fixtures_dir / "convnet_train_step.jaxexport"
    with pytest.raises(HloplanError) as info:
        hloplan.compile(path, "8", device="toy", pipeline=PipelineOptions(None, 2, "1f1b"))
    diagnostic = info.value.diagnostics[0]
    assert "microbatches" in diagnostic.message
    assert diagnostic.location is not None
    assert diagnostic.location.file.endswith(os.path.join("fixtures", "models.py"))
