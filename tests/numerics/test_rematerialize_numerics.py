"""Recomputation where no plan fits the memory budget, run on 8 simulated CPU devices: a train
step with batch norm (statistics over the batch: its gradients cannot be accumulated over
microbatches) fits once its elementwise activations are recomputed after the forward pass, the
sharded step equals the single-device one, and XLA's compiled program holds less memory."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest
from click.testing import CliRunner
from jax import export

import hloplan
from hloplan.cli import main
from hloplan.diagnostics import HloplanError, NoPlanFits
from hloplan.units import parse_bytes

pytestmark = pytest.mark.usefixtures("devices8")


def _batch_norm_relu(x, scale, bias):
    mean = jnp.mean(x, axis=0)
    var = jnp.mean(jnp.square(x - mean), axis=0)
    return jax.nn.relu((x - mean) * jax.lax.rsqrt(var + 1e-5) * scale + bias)


def _loss(params, x, y):
    for w, scale, bias in params:
        x = _batch_norm_relu(x @ w, scale, bias)
    return jnp.mean(jnp.square(x - y))


def normalized_mlp_step(params, x, y):
    loss, grads = jax.value_and_grad(_loss)(params, x, y)
    return loss, jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)


@pytest.fixture(scope="module")
def normalized_mlp(tmp_path_factory):
    """Six layers of 64 units over a batch of 2048: activations outweigh parameters."""
    keys = jax.random.split(jax.random.key(0), 8)
    params = [(jax.random.normal(keys[i], (64, 64)) / 8.0, jnp.ones(64), jnp.zeros(64))
              for i in range(6)]
    x = jax.random.normal(keys[6], (2048, 64))
    y = jax.random.normal(keys[7], (2048, 64))
    path = tmp_path_factory.mktemp("remat") / "step.jaxexport"
    path.write_bytes(export.export(jax.jit(normalized_mlp_step))(params, x, y).serialize())
    return path, (params, x, y), jax.jit(normalized_mlp_step)(params, x, y)


def _smallest_peak(path) -> float:
    """The smallest estimated peak of any plan of the program as it stands."""
    with pytest.raises(HloplanError) as info:
        hloplan.compile(path, "8", device="toy", memory_budget=1)
    text = str(info.value)
    assert "activations recomputed after the forward pass" in text
    found = re.search(r"smallest achievable peak is (?:at least )?([\d.]+ \w+)", text)
    return parse_bytes(found.group(1).replace(" ", ""))


def _compiled_peak(plan_dir, args) -> int:
    stats = hloplan.load(plan_dir).lower(*args).compile().memory_analysis()
    return stats.temp_size_in_bytes + stats.argument_size_in_bytes + stats.output_size_in_bytes


def test_recomputes_activations_where_no_plan_fits(normalized_mlp, tmp_path, helpers):
    path, args, expected = normalized_mlp
    budget = int(0.95 * _smallest_peak(path))
    result = hloplan.compile(path, "8", output=tmp_path / "plan", device="toy",
                             memory_budget=budget)
    plan = result.plan
    assert plan["rematerialized"]["values"] > 0
    assert "pipeline" not in plan or not plan["pipeline"].get("tasks")  # batch norm: no split
    assert plan["estimate"]["peak_memory_bytes"] <= budget
    warnings = [d.message for d in result.state.log.warnings]
    assert any("activations are recomputed after the forward pass" in w for w in warnings)
    got = hloplan.load(tmp_path / "plan")(*args)
    helpers.assert_trees_close(got, expected)
    # XLA keeps the recomputation after the forward pass: the compiled step holds less than
    # the plan without recomputation (compiled the same way, on the same mesh).
    plain = hloplan.compile(path, "8", output=tmp_path / "plain", device="toy")
    assert "rematerialized" not in plain.plan
    assert _compiled_peak(tmp_path / "plan", args) < 0.8 * _compiled_peak(tmp_path / "plain",
                                                                            args)


def test_cli_reports_recomputation_and_the_plan_checks(normalized_mlp, tmp_path):
    path, _, _ = normalized_mlp
    budget = int(0.95 * _smallest_peak(path))
    runner = CliRunner()
    out = runner.invoke(main, ["compile", str(path), "--mesh", "8", "--device", "toy",
                               "--memory-budget", str(budget), "-o", str(tmp_path / "plan")])
    assert out.exit_code == 0, out.output
    assert "recomputed after the forward pass" in out.output  # the warning
    assert re.search(r"planned for mesh x=8 .* recomputing \d+ activations", out.output)
    explained = runner.invoke(main, ["explain", str(tmp_path / "plan")])
    assert re.search(r"recomputes \d+ activations after the forward pass", explained.output)
    checked = runner.invoke(main, ["run", str(tmp_path / "plan"), "--check"])
    assert checked.exit_code == 0, checked.output


def test_says_what_recomputation_reached_when_nothing_fits(normalized_mlp):
    path, _, _ = normalized_mlp
    with pytest.raises(NoPlanFits) as info:
        hloplan.compile(path, "8", device="toy", memory_budget=1024)
    text = str(info.value)
    found = re.search(r"nor with (\d+) activations recomputed after the forward pass "
                      r"\(smallest peak ([\d.]+ \w+) before resharded copies\)", text)
    assert found and int(found.group(1)) > 0
    assert parse_bytes(found.group(2).replace(" ", "")) < _smallest_peak(path)


def test_recomputes_fewer_when_asked_to_free_less(normalized_mlp, tmp_path, helpers):
    """rematerialize.free_fraction (a pass option of compile): recomputing only the cheapest
    per byte freed until a fifth of the unsharded peak is freed still fits 5% under the
    smallest peak, with fewer values recomputed than by default (all that pay)."""
    import dataclasses

    from hloplan.compiler import compile_bytes, make_options
    from hloplan.passes.rematerialize import Rematerialize
    from hloplan.passmanager import pass_pipeline

    path, args, expected = normalized_mlp
    budget = int(0.95 * _smallest_peak(path))
    options = make_options("8", device="toy", memory_budget=budget)
    counts = {}
    for fraction in (0.3, 1.0):
        passes = [dataclasses.replace(p, free_fraction=fraction)
                  if isinstance(p, Rematerialize) else p for p in pass_pipeline()]
        result = compile_bytes(path.read_bytes(), str(path), options, passes=passes)
        assert result.plan["estimate"]["peak_memory_bytes"] <= budget
        counts[fraction] = result.plan["rematerialized"]["values"]
        result.write(tmp_path / str(fraction))
        got = hloplan.load(tmp_path / str(fraction))(*args)
        helpers.assert_trees_close(got, expected, context=f"free_fraction {fraction}")
    assert 0 < counts[0.3] < counts[1.0]
