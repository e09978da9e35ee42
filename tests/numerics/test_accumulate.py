"""Gradient accumulation where no single-program plan fits the memory budget, run on 8
simulated CPU devices: hloplan compile falls back to one stage over M microbatches (the fastest
M that fits), the loader holds one microbatch's values at a time, and the step equals the
single-device one."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from click.testing import CliRunner
from jax import export

import hloplan
from fixtures import models
from hloplan import ir
from hloplan.cli import main
from hloplan.compiler import PipelineOptions, make_options
from hloplan.diagnostics import HloplanError
from hloplan.emit.pipeline_loader import live_bytes_on
from hloplan.units import parse_bytes

pytestmark = pytest.mark.usefixtures("devices8")


@pytest.fixture(scope="module")
def wide_vocab_gpt(tmp_path_factory):
    """A GPT step whose logits (64 x 32 tokens x 512 vocabulary) outweigh its parameters, as
    in language models at realistic batch sizes: microbatches shrink its peak."""
    params, _, tokens, targets = models.gpt_train_step_args(seed=0, batch=64, seq=32, vocab=512,
                                                            d_model=32, n_layers=2)
    exported = export.export(jax.jit(models.gpt_sgd_step))(params, tokens, targets)
    path = tmp_path_factory.mktemp("accumulate") / "gpt.jaxexport"
    path.write_bytes(exported.serialize())
    return path, (params, tokens, targets), jax.jit(models.gpt_sgd_step)(params, tokens, targets)


def _smallest_single_peak(path, recomputing: bool = False) -> float:
    """The smallest estimated peak of a single-program plan of the program as it stands (or,
    `recomputing`, with its activations recomputed after the forward pass)."""
    with pytest.raises(HloplanError) as info:
        hloplan.compile(path, "8", device="toy", memory_budget=1)
    text = str(info.value)
    assert "by accumulating gradients over 2 to 64 microbatches either" in text
    recomputed = (r"recomputed after the forward pass \(smallest peak ([\d.]+ \w+) before "
                  r"resharded copies\)")
    as_it_stands = r"smallest achievable peak is (?:at least )?([\d.]+ \w+)"
    pattern = recomputed if recomputing else as_it_stands
    found = re.search(pattern, text)
    return parse_bytes(found.group(1).replace(" ", ""))


def test_accumulates_gradients_where_no_single_program_plan_fits(wide_vocab_gpt, tmp_path):
    path, args, expected = wide_vocab_gpt
    budget = int(0.9 * _smallest_single_peak(path, recomputing=True))
    result = hloplan.compile(path, "8", output=tmp_path / "plan", device="toy",
                             memory_budget=budget)
    pipe = result.plan["pipeline"]
    assert pipe["stages"] == 1 and pipe["microbatches"] > 1
    assert max(pipe["estimate"]["memory_per_stage_bytes"]) <= budget
    assert result.plan["memory_budget_bytes"] == budget
    warnings = [d.message for d in result.state.log.warnings]
    assert any("accumulating gradients over" in w for w in warnings)
    got = hloplan.load(tmp_path / "plan")(*args)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5)


def _live_bytes_per_call(plan_dir, args) -> list[int]:
    """Bytes of live arrays on device 0 as each task starts (its inputs included)."""
    runner = hloplan.load(plan_dir)
    device = runner.meshes[0].devices.flat[0]
    seen = []
    for task in runner.tasks:
        call = task["call"]

        def counted(*inputs, call=call):
            seen.append(live_bytes_on(device))
            return call(*inputs)

        task["call"] = counted
    runner(*args)
    return seen


def test_loader_holds_one_microbatch_at_a_time(wide_vocab_gpt, tmp_path):
    """With 8 microbatches the loader must not hold more than with 2: each microbatch's
    gradients are added into the running sums and dropped, not kept until the step ends."""
    path, args, _ = wide_vocab_gpt
    peaks = {}
    for m in (2, 8):
        hloplan.compile(path, "8", output=tmp_path / f"m{m}", device="toy",
                        pipeline=PipelineOptions(stages=1, microbatches=m))
        peaks[m] = max(_live_bytes_per_call(tmp_path / f"m{m}", args))
    assert peaks[8] <= peaks[2]


def test_accumulating_beats_recomputing_where_both_fit(wide_vocab_gpt, tmp_path, helpers):
    """Under 0.8 of the smallest single-program peak both fit: the single program with its
    activations recomputed, and accumulation over microbatches. The estimate prefers
    accumulating here; the plan directory's single program is the recomputing one, which
    fits too."""
    path, args, expected = wide_vocab_gpt
    budget = int(0.8 * _smallest_single_peak(path))
    result = hloplan.compile(path, "8", output=tmp_path / "plan", device="toy",
                             memory_budget=budget)
    plan = result.plan
    assert plan["rematerialized"]["values"] > 0
    assert plan["estimate"]["peak_memory_bytes"] <= budget  # module.mlir's program fits
    pipe = plan["pipeline"]
    assert max(pipe["estimate"]["memory_per_stage_bytes"]) <= budget
    assert pipe["estimate"]["step_time_s"] < plan["estimate"]["step_time_s"]
    warnings = [(d.message, d.notes) for d in result.state.log.warnings]
    assert any("accumulating gradients over" in w and "recomputed after the forward pass"
               in notes[0] for w, notes in warnings)
    got = hloplan.load(tmp_path / "plan")(*args)
    helpers.assert_trees_close(got, expected)


def test_cli_says_it_accumulates_and_the_plan_runs(wide_vocab_gpt, tmp_path):
    path, _, _ = wide_vocab_gpt
    budget = int(0.9 * _smallest_single_peak(path, recomputing=True))
    result = CliRunner().invoke(main, ["compile", str(path), "--mesh", "8", "--device", "toy",
                                       "--memory-budget", str(budget), "-o",
                                       str(tmp_path / "plan")], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "warning: no single-program plan fits the memory budget" in result.output
    assert "over the budget of" in result.output  # the single-program plan's line
    assert "pipeline: 1 stage x" in result.output
    check = CliRunner().invoke(main, ["run", str(tmp_path / "plan"), "--check"],
                               catch_exceptions=False)
    assert check.exit_code == 0, check.output


@pytest.mark.parametrize("blocks", [1, 2, 4])
def test_blocked_microbatches_put_back_in_order(blocks):
    from hloplan.emit.pipeline_loader import microbatch, unmicrobatch

    x = np.arange(2 * 16 * 3).reshape(2, 16, 3)
    parts = [np.asarray(microbatch(x, 1, m, 4, blocks)) for m in range(4)]
    # Microbatch m holds rows m*b..(m+1)*b-1 of each of the blocks (b = 16 / (blocks * 4)).
    inner = 16 // (blocks * 4)
    want = [r for k in range(blocks) for r in range(k * 16 // blocks + 1 * inner,
                                                     k * 16 // blocks + 2 * inner)]
    np.testing.assert_array_equal(parts[1], x[:, want])
    # A device array is cut by a jitted program, a host array on the host: the same rows.
    np.testing.assert_array_equal(np.asarray(microbatch(jnp.asarray(x), 1, 1, 4, blocks)),
                                  parts[1])
    joined = np.concatenate(parts, axis=1)
    np.testing.assert_array_equal(np.asarray(unmicrobatch(joined, 1, 4, blocks)), x)


def test_microbatches_are_cut_where_the_batch_lies(wide_vocab_gpt, tmp_path):
    """Planned for the H100 the microbatch task splits the batch 8 ways: each microbatch is
    taken from the 8 blocks of a batch laid out so, and the step still equals the
    single-device one."""
    path, args, expected = wide_vocab_gpt
    result = hloplan.compile(path, "8", output=tmp_path / "plan", device="h100",
                             pipeline=PipelineOptions(stages=1, microbatches=4))
    assert result.plan["pipeline"]["microbatch_blocks"] == 8
    got = hloplan.load(tmp_path / "plan")(*args)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5)


def masked_mean_step(params, x, targets, weights):
    """A loss normalised by a sum over the batch of the data alone (the masked token count):
    exact with microbatches only if every microbatch divides by the whole batch's count."""
    def loss(params):
        h = jnp.tanh(x @ params["w1"]) @ params["w2"]
        nll = jnp.sum((h - targets) ** 2, axis=-1)
        return jnp.sum(nll * weights) / jnp.maximum(jnp.sum(weights), 1.0)

    value, grads = jax.value_and_grad(loss)(params)
    return value, jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)


@pytest.mark.parametrize("stages", [1, 2])
def test_a_loss_normalised_by_the_batch_runs_the_count_once_per_step(tmp_path, stages):
    key = jax.random.split(jax.random.key(0), 4)
    params = {"w1": jax.random.normal(key[0], (16, 32)), "w2": jax.random.normal(key[1], (32, 8))}
    x = jax.random.normal(key[2], (32, 16))
    targets = jax.random.normal(key[3], (32, 8))
    weights = (jnp.arange(32) % 3 != 0).astype(jnp.float32)  # a different count per microbatch
    args = (params, x, targets, weights)
    exported = export.export(jax.jit(masked_mean_step))(*args)
    result = hloplan.compile(exported.serialize(), "8", output=tmp_path / "plan", device="toy",
                             pipeline=PipelineOptions(stages=stages, microbatches=4))
    pipe = result.plan["pipeline"]
    prologue = [t for t in pipe["tasks"] if t["part"] == "P"]
    assert len(prologue) == 1 and prologue[0]["stage"] == 0
    got = hloplan.load(tmp_path / "plan")(*args)
    want = jax.jit(masked_mean_step)(*args)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5)


def test_task_budgets_reserve_no_more_than_the_loader_holds(wide_vocab_gpt):
    """Each task of an accumulated stage is planned under the budget less reserve_bytes (a
    bound, whatever the plans, on what the loader holds beside it); the stage's estimate then
    adds what its plans make the loader hold (held_bytes), which must be at least that."""
    from hloplan.passes.extract_graph import ExtractGraph
    from hloplan.passes.inline_calls import InlineCalls
    from hloplan.passmanager import run_passes
    from hloplan.pipeline_parallel import plan_pipeline
    from hloplan.pipeline_parallel.estimate import held_bytes, reserve_bytes

    path, _, _ = wide_vocab_gpt
    options = make_options("8", device="h100")
    state = run_passes(ir.load_program(path.read_bytes(), str(path)), options,
                       [InlineCalls(), ExtractGraph()])
    plan = plan_pipeline(state, options, PipelineOptions(stages=1, microbatches=4), None)
    tasks = [tp.task for tp in plan.tasks]
    figures = {tp.task.index: tp.figure for tp in plan.tasks}
    held = held_bytes(state.graph, plan.analysis, tasks, figures, 4, options.mesh)
    reserved = {t.index: reserve_bytes(state.graph, plan.analysis, tasks, t, 4, 8) for t in tasks}
    assert any(reserved.values())
    for t in tasks:
        assert reserved[t.index] <= held[t.index]


def test_given_microbatches_that_do_not_fit_are_an_error(wide_vocab_gpt, tmp_path):
    path, _, _ = wide_vocab_gpt
    two = PipelineOptions(stages=1, microbatches=2)
    free = hloplan.compile(path, "8", device="toy", pipeline=two).plan["pipeline"]["estimate"]
    budget = int(0.9 * min(free["memory_per_stage_bytes"][0], _smallest_single_peak(path)))
    with pytest.raises(HloplanError) as info:
        hloplan.compile(path, "8", output=tmp_path / "plan", device="toy", memory_budget=budget,
                        pipeline=two)
    assert "no plan fits with the given --stages/--microbatches either" in str(info.value)
    assert not (tmp_path / "plan").exists()
