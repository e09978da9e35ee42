"""Stages on submeshes of different sizes (the inter-op DP, hloplan.pipeline_parallel.inter_op), run on 8
simulated CPU devices: a train step with one heavy part and two light parts gets more devices
for the heavy stage, and the pipelined step (GPipe and 1F1B) equals the single-device step.
The same plan on a 2x4 mesh runs as a 2-process jax.distributed job (values cross between
submeshes of different sizes and processes)."""

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
from hloplan.compiler import PipelineOptions

WIDE = 512


def heavy_light_step(params, x, y):
    """Block 0 (64 -> 512 -> 64) costs 16x block 1 or block 2 (64 -> 64 each)."""

    def loss(p):
        h = jnp.tanh(x @ p["w0"])
        h = jnp.tanh(h @ p["w1"])
        h = jnp.tanh(h @ p["w2"])
        h = jnp.tanh(h @ p["w3"])
        return jnp.mean((h - y) ** 2)

    value, grads = jax.value_and_grad(loss)(params)
    return value, jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)


@pytest.fixture(scope="module")
def heavy_light(tmp_path_factory):
    keys = jax.random.split(jax.random.key(0), 6)
    shapes = {"w0": (64, WIDE), "w1": (WIDE, 64), "w2": (64, 64), "w3": (64, 64)}
    params = {name: jax.random.normal(k, shape, jnp.float32) / np.sqrt(shape[0])
              for (name, shape), k in zip(sorted(shapes.items()), keys)}
    x = jax.random.normal(keys[4], (32, 64), jnp.float32)
    y = jax.random.normal(keys[5], (32, 64), jnp.float32)
    exported = export.export(jax.jit(heavy_light_step))(params, x, y)
    path = tmp_path_factory.mktemp("heavy_light") / "heavy_light.jaxexport"
    path.write_bytes(exported.serialize())
    inputs = path.with_suffix(".npz")
    np.savez(inputs, **{f"arg{i}": np.asarray(leaf)
                        for i, leaf in enumerate(jax.tree.leaves((params, x, y)))})
    expected = jax.jit(heavy_light_step)(params, x, y)
    return path, (params, x, y), expected, inputs


@pytest.mark.usefixtures("devices8")
@pytest.mark.parametrize("schedule_kind", ["gpipe", "1f1b"])
def test_heavy_stage_gets_more_devices_and_matches(heavy_light, tmp_path, schedule_kind):
    path, args, expected = heavy_light[:3]
    result = hloplan.compile(path, "8", output=tmp_path / "plan", device="toy",
                             pipeline=PipelineOptions(3, 4, schedule_kind))
    pipe = result.plan["pipeline"]
    sizes = [len(s["devices"]) for s in pipe["submeshes"]]
    assert pipe["stages"] == 3 and sum(sizes) == 8
    assert len(set(sizes)) > 1, sizes  # unequal submeshes
    # The stage with the most work (device-seconds per microbatch) has the most devices.
    work = [info["time_per_microbatch_s"] * size for info, size in zip(pipe["per_stage"], sizes)]
    assert sizes[work.index(max(work))] == max(sizes), (sizes, work)
    assert sorted(d for s in pipe["submeshes"] for d in s["devices"]) == list(range(8))
    # plan.json per stage: submesh, devices, layers, source lines, time, memory.
    for stage, info in enumerate(pipe["per_stage"]):
        assert info["submesh"]["devices"] == pipe["submeshes"][stage]["devices"]
        assert info["layers"][0] < info["layers"][1]
        assert info["time_per_microbatch_s"] > 0 and info["memory_bytes"] > 0
        assert info["source_lines"]
    assert pipe["search"]["pairs_planned"] <= pipe["search"]["pairs"]
    got = hloplan.load(tmp_path / "plan")(*args)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5)


def test_unequal_submeshes_across_two_processes(heavy_light, tmp_path):
    """2x4 mesh over 2 processes of 4 CPU devices: the heavy stage takes one process's row,
    the two light stages share the other's (1x4 + 1x2 + 1x2)."""
    path, _, _, inputs = heavy_light
    out = tmp_path / "plan"
    hloplan.compile(path, "2x4", output=out, device="toy",
                    pipeline=PipelineOptions(3, 4, "1f1b"))
    pipe = json.loads((out / "plan.json").read_text())["pipeline"]
    assert sorted(len(s["devices"]) for s in pipe["submeshes"]) == [2, 2, 4]
    result = CliRunner().invoke(main, ["run", str(out), "--check", "--processes", "2",
                                       "--inputs", str(inputs), "--format", "json",
                                       "--timeout", "120"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["match"] is True, report
    assert all(p["match"] for p in report["per_process"])


@pytest.mark.usefixtures("devices8")
def test_check_totals_the_tasks_listed_collectives(heavy_light, tmp_path):
    """`hloplan run --check` of a pipelined plan sets the collectives plan.json lists for its
    tasks (part-A tasks once per microbatch) beside those compiled into them: the same
    kinds, counts and bytes on this step."""
    path, _, _, inputs = heavy_light
    hloplan.compile(path, "8", output=tmp_path / "plan", device="toy",
                    pipeline=PipelineOptions(3, 4, "1f1b"))
    tasks = json.loads((tmp_path / "plan" / "plan.json").read_text())["pipeline"]["tasks"]
    assert any(task["collectives"] for task in tasks)
    result = CliRunner().invoke(main, ["run", str(tmp_path / "plan"), "--check", "--inputs",
                                       str(inputs), "--format", "json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    report = json.loads(result.output[result.output.index("{"):])
    assert report["match"] is True
    realised = report["realised"]["collectives"]
    assert realised and report["predicted"]["collectives"] == realised


def test_no_stages_on_part_of_a_v5e_slice_of_more_than_16_chips(heavy_light, tmp_path):
    """libtpu builds no program for part of a v5e slice of more than 16 chips (tpu-v5e's
    `partial_slice_devices`): on v5e:4x8 explicit stages are refused with the reason and
    nothing is written, `--stages auto` keeps one stage and says why, and gradient
    accumulation (one stage on every device) is still planned; on v5e:2x4 the step pipelines."""
    from hloplan.diagnostics import UsageError

    path = heavy_light[0]
    with pytest.raises(UsageError, match="runs no program on part of a slice of more than 16"):
        hloplan.compile(path, "4x8", output=tmp_path / "refused", device="tpu-v5e",
                        pipeline=PipelineOptions(2, 4, "1f1b"))
    assert not (tmp_path / "refused").exists()
    auto = hloplan.compile(path, "4x8", device="tpu-v5e", pipeline=PipelineOptions())
    pipe = auto.plan["pipeline"]
    assert pipe["stages"] == 1 and "runs no program on part of a slice" in pipe["chosen"]
    assert all(c["stages"] == 1 for c in pipe["candidates"])
    accumulated = hloplan.compile(path, "4x8", device="tpu-v5e",
                                  pipeline=PipelineOptions(1, 4, "1f1b"))
    assert (accumulated.plan["pipeline"]["stages"],
            accumulated.plan["pipeline"]["microbatches"]) == (1, 4)
    staged = hloplan.compile(path, "2x4", device="tpu-v5e", pipeline=PipelineOptions(2, 4, "1f1b"))
    assert staged.plan["pipeline"]["stages"] == 2
