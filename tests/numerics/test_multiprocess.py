"""Multi-process runs: the plan as one jax.distributed job of local CPU processes on loopback.

`hloplan run --processes 2` starts 2 workers with 4 simulated CPU devices each (their own
XLA_FLAGS; this test process keeps its 8 devices); each places its own shards, runs, and compares
its shards of the results with the single-device program.  A worker that dies makes the run fail
fast with a message naming it; the plan's `run_distributed.py` runs from per-process parts of
the inputs (`Runner.place_local`) and gathers the results.  About 30 s in all, most of it in the
three 2-process runs (jax start-up and compilation in each worker).
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import hloplan
from hloplan.cli import main
from hloplan.emit.launch_scripts import launch_scripts
from hloplan.emit.loader import Runner
from hloplan.multiprocess import KILL_ENV, JobFailure, cpu_worker_env, free_port, launch

FIXTURES_DIR = Path(__file__).resolve().parents[2] / "fixtures"
FIXTURE = FIXTURES_DIR / "mlp_train_step.jaxexport"
INPUTS = FIXTURES_DIR / "mlp_train_step.inputs.npz"


@pytest.fixture(scope="module")
def plan_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("mp") / "plan"
    hloplan.compile(str(FIXTURE), mesh="2x4", output=str(out), device="toy")
    for name, data in launch_scripts().items():  # until render() writes them itself
        if not (out / name).exists():
            (out / name).write_bytes(data)
    return out


def _run(*args: str):
    started = time.monotonic()
    result = CliRunner().invoke(main, ["run", *args], catch_exceptions=False)
    return result, time.monotonic() - started


def test_two_processes_match_single_device(plan_dir):
    result, seconds = _run(str(plan_dir), "--check", "--processes", "2", "--inputs", str(INPUTS),
                           "--format", "json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["match"] is True
    assert report["processes"] == 2 and report["devices"] == 8
    assert report["mesh"] == {"x": 2, "y": 4}
    assert [p["local_devices"] for p in report["per_process"]] == [4, 4]
    assert all(p["match"] for p in report["per_process"])
    # row-major over devices ordered by process: the major axis is the one across processes
    assert report["cross_process_axes"] == ["x"]
    assert report["realised"]["collectives"], "a sharded plan communicates"
    assert seconds < 60

    from hloplan.check import format_report

    text = format_report(report)
    assert "on 8 devices in 2 processes" in text
    assert "result matches the single-device program" in text
    assert "process 1 (4 devices): matches" in text


def test_dead_process_fails_fast_with_its_name(plan_dir, monkeypatch, tmp_path):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the logs a failure keeps
    monkeypatch.setenv(KILL_ENV, "1")  # process 1 exits(3) right after jax.distributed.initialize
    result, seconds = _run(str(plan_dir), "--check", "--processes", "2", "--timeout", "120")
    assert result.exit_code == 1, result.output
    assert seconds < 60, f"took {seconds:.1f} s"
    assert "process 1 of 2 exited with status 3" in result.output
    assert "stopped the other processes" in result.output
    assert f"{KILL_ENV}=1" in result.output  # the end of its stderr is quoted
    assert f"logs of every process: {tmp_path}" in result.output


def test_timeout_stops_every_process(plan_dir, monkeypatch, tmp_path):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    result, seconds = _run(str(plan_dir), "--check", "--processes", "2", "--timeout", "1")
    assert result.exit_code == 1, result.output
    assert "did not finish within 1 s" in result.output
    assert seconds < 15


def test_processes_must_divide_the_mesh(plan_dir):
    result, _ = _run(str(plan_dir), "--check", "--processes", "3")
    assert result.exit_code == 2
    assert "--processes 3 does not divide the 8 devices" in result.output


def test_launch_reports_the_first_failure(tmp_path):
    code = "import sys; sys.stderr.write('boom\\n'); sys.exit(5)"
    commands = [[sys.executable, "-c", "import time; time.sleep(30)"],
                [sys.executable, "-c", code]]
    started = time.monotonic()
    with pytest.raises(JobFailure) as info:
        launch(commands, [cpu_worker_env(1)] * 2, timeout=20, log_dir=tmp_path)
    assert time.monotonic() - started < 10
    failure = info.value
    assert failure.reason == "died" and failure.failed.index == 1
    assert failure.failed.returncode == 5 and failure.failed.stderr_tail() == ["boom"]
    assert failure.outcomes[0].returncode is None  # still running, then stopped by us


def test_loader_local_part_single_process(plan_dir, devices8, helpers):
    import jax

    runner = Runner(plan_dir, devices8)
    exported, args, kwargs = helpers.fixture_arguments("mlp_train_step")
    assert not runner.multi_process
    local_args, local_kwargs = runner.local_part(*args, **kwargs)  # one process holds it all
    for full, local in zip(jax.tree.leaves((args, kwargs)),
                           jax.tree.leaves((local_args, local_kwargs))):
        np.testing.assert_array_equal(np.asarray(full), local)
    got = runner.fetch(runner.call_local(*local_args, **local_kwargs))
    want = runner.fetch(runner(*args, **kwargs))
    helpers.assert_trees_close(got, want, rtol=0, atol=0, context="call_local")


def test_run_distributed_script_from_per_process_parts(plan_dir, tmp_path, devices8, helpers):
    import jax

    exported, args, kwargs = helpers.fixture_arguments("mlp_train_step")
    leaves = jax.tree.leaves((args, kwargs))
    runner = Runner(plan_dir, devices8)
    mesh_devices = list(runner.mesh.devices.flat)  # process p holds mesh devices 4p..4p+3
    for p in range(2):
        parts = runner.local_leaves(leaves, mesh_devices[4 * p:4 * p + 4])
        np.savez(tmp_path / f"part{p}.npz", **{f"arg{i}": part for i, part in enumerate(parts)})
    assert any(part.shape != leaf.shape for part, leaf in zip(parts, leaves)), \
        "some argument must be split across the processes"
    port = free_port()
    commands, envs = [], []
    for p in range(2):
        env = cpu_worker_env(4)
        env.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES="2",
                   JAX_PROCESS_ID=str(p))
        commands.append([sys.executable, str(plan_dir / "run_distributed.py"),
                         "--inputs", str(tmp_path / "part{process_id}.npz"),
                         "--output", str(tmp_path / "results.npz"), "--heartbeat-timeout", "10"])
        envs.append(env)
    try:
        outcomes, seconds = launch(commands, envs, timeout=90, log_dir=tmp_path / "logs")
    except JobFailure as exc:
        from hloplan.multiprocess import failure_message

        pytest.fail(failure_message(exc, 2, 90))
    assert seconds < 60
    assert "[process 1/2] 4 of 8 devices" in outcomes[1].stdout.read_text()
    want = jax.tree.leaves(helpers.single_device_call(exported, args, kwargs))
    with np.load(tmp_path / "results.npz") as data:
        got = [data[f"res{i}"] for i in range(len(want))]
    helpers.assert_trees_close(got, want, context="run_distributed.py, 2 processes")


def test_hosts_put_the_major_axis_on_the_slow_link(tmp_path):
    from hloplan.cost_models import load_device_model

    out = tmp_path / "plan"
    result = CliRunner().invoke(main, ["compile", str(FIXTURE), "--mesh", "2x4", "--hosts", "2",
                                       "--device", "h100", "-o", str(out), "-q"])
    assert result.exit_code == 0, result.output
    mesh = json.loads((out / "plan.json").read_text())["mesh"]
    assert mesh["hosts"] == 2
    assert mesh["axis_names"] == ["x", "y"] and mesh["axis_sizes"] == [2, 4]
    interconnect = load_device_model("h100").interconnect
    levels = {level.name: level for level in interconnect}
    slow, fast = (levels[name] for name in mesh["links"])
    assert slow.bandwidth < fast.bandwidth, mesh["links"]
    assert fast.name == interconnect[0].name  # the innermost level: within a host
    # without --hosts the 8 devices fit one h100 node: no axis on the slow link
    single = hloplan.compile(str(FIXTURE), mesh="2x4", device="h100").plan["mesh"]
    assert single["hosts"] is None
    assert single["links"] == [fast.name, fast.name]
