"""A pipelined plan as one jax.distributed job: 2 stages on 2 local processes x 4 CPU devices.

The mesh 2x4 is laid over the devices ordered by process, so stage 0 (devices 0-3) is process
0's and stage 1 (devices 4-7) process 1's.  Every process dispatches the same schedule; values
crossing stages cross processes, which jax.device_put cannot do on CPU: PipelineRunner moves
them with a ppermute program over both submeshes.  `hloplan run --check --processes 2` must
match the single-device program; the plan's own `pipeline_loader.py` (jax and numpy only) must
run two training steps (the second fed with the first's results, global arrays on the stage
submeshes) and `fetch` every result to every process.  About 20 s (two 2-process runs).
"""

from __future__ import annotations

import json
import sys
import textwrap
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from click.testing import CliRunner

import hloplan
from hloplan.cli import main
from hloplan.multiprocess import JobFailure, cpu_worker_env, failure_message, free_port, launch

FIXTURES_DIR = Path(__file__).resolve().parents[2] / "fixtures"
FIXTURE = FIXTURES_DIR / "mlp_train_step.jaxexport"
INPUTS = FIXTURES_DIR / "mlp_train_step.inputs.npz"


@pytest.fixture(scope="module")
def plan_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("mpp") / "plan"
    result = CliRunner().invoke(main, ["compile", str(FIXTURE), "--mesh", "2x4", "--device", "toy",
                                       "--stages", "2", "--microbatches", "4", "-o", str(out),
                                       "-q"])
    assert result.exit_code == 0, result.output
    pipe = json.loads((out / "plan.json").read_text())["pipeline"]
    assert pipe["stages"] == 2
    assert [s["devices"] for s in pipe["submeshes"]] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    return out


def test_two_stage_pipeline_on_two_processes_matches(plan_dir):
    started = time.monotonic()
    result = CliRunner().invoke(main, ["run", str(plan_dir), "--check", "--processes", "2",
                                       "--inputs", str(INPUTS), "--format", "json",
                                       "--timeout", "120"], catch_exceptions=False)
    seconds = time.monotonic() - started
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["match"] is True, report
    assert report["processes"] == 2 and report["devices"] == 8
    assert [p["local_devices"] for p in report["per_process"]] == [4, 4]
    assert all(p["match"] for p in report["per_process"])
    assert report["cross_process_axes"] == ["x"]  # the stage axis runs between the processes
    assert report["pipeline"]["stages"] == 2 and report["pipeline"]["microbatches"] == 4
    assert seconds < 60, f"took {seconds:.1f} s"


WORKER = textwrap.dedent("""
    import faulthandler, importlib.util, json, signal, sys
    import jax
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # launch() asks for stacks on timeout
    plan, inputs, port, pid, out = sys.argv[1:6]
    # as hloplan's own worker: no cluster auto-detection, bounded waits
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                               process_id=int(pid), coordinator_bind_address=f"127.0.0.1:{port}",
                               cluster_detection_method="deactivate", initialization_timeout=60,
                               heartbeat_timeout_seconds=10)
    import numpy as np
    from jax import export
    # the plan directory's own copy: it must need nothing but jax and numpy
    spec = importlib.util.spec_from_file_location("plan_pipeline_loader",
                                                  f"{plan}/pipeline_loader.py")
    pipeline_loader = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pipeline_loader)
    assert "hloplan" not in sys.modules, sorted(m for m in sys.modules if "hloplan" in m)
    step = pipeline_loader.load(plan)
    reference = export.deserialize(bytearray(open(f"{plan}/reference.jaxexport", "rb").read()))
    with np.load(inputs) as data:
        leaves = [data[f"arg{i}"] for i in range(len(reference.in_avals))]
    (params, x, y), kwargs = jax.tree.unflatten(reference.in_tree, leaves)
    loss1, params1 = step(params, x, y)
    loss2, params2 = step(params1, x, y)  # the first step's results: arrays on the stages
    held = sum(len(a.addressable_shards) for a in jax.tree.leaves(params2))
    got = step.fetch((loss1, loss2, params2))
    with jax.default_device(jax.local_devices()[0]):
        call = jax.jit(reference.call)
        want_loss1, want_params1 = call(params, x, y)
        want_loss2, want_params2 = call(want_params1, x, y)
    want = (want_loss1, want_loss2, want_params2)
    errors = [float(np.max(np.abs(np.asarray(g, np.float64) - np.asarray(w, np.float64))))
              for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)]
    match = all(np.allclose(g, w, rtol=1e-4, atol=1e-5)
                for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)))
    with open(out, "w") as f:
        json.dump({"match": bool(match), "max_abs_error": max(errors), "shards_held": held,
                   "results": len(errors)}, f)
""")


def test_plan_pipeline_loader_two_steps_and_fetch(plan_dir, tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    port = free_port()
    commands = [[sys.executable, str(script), str(plan_dir), str(INPUTS), str(port), str(p),
                 str(tmp_path / f"result{p}.json")] for p in range(2)]
    env = cpu_worker_env(4)
    try:
        _, seconds = launch(commands, [env, env], timeout=90, log_dir=tmp_path / "logs",
                            cwd=str(tmp_path))
    except JobFailure as exc:
        # A process that wrote its result had finished its work (stuck at jax's shutdown?).
        written = [p for p in range(2) if (tmp_path / f"result{p}.json").exists()]
        pytest.fail(failure_message(exc, 2, 90) + f"\nresults written by processes: {written}")
    results = [json.loads((tmp_path / f"result{p}.json").read_text()) for p in range(2)]
    for p, result in enumerate(results):
        assert result["match"], (p, result)
        assert result["results"] == 8  # 2 losses + 6 parameters, whole, in both processes
    # Each process holds the shards of the parameters updated on its own stage only.
    assert all(0 < result["shards_held"] < 6 * 4 for result in results), results
    assert seconds < 60, f"took {seconds:.1f} s"


def test_single_process_pipeline_fetch(plan_dir, devices8, helpers):
    """fetch() in one process: numpy results, the same as the single-device program."""
    exported, args, kwargs = helpers.fixture_arguments("mlp_train_step")
    step = hloplan.load(plan_dir, devices8)
    got = step.fetch(step(*args, **kwargs))
    assert all(isinstance(leaf, np.ndarray) for leaf in jax.tree.leaves(got))
    helpers.assert_trees_close(got, helpers.single_device_call(exported, args, kwargs),
                               context="pipelined fetch")

