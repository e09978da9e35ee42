"""`hloplan compile --verify-memory`: the plan's programs compiled by XLA, their allocation
per device set against the budget.

hloplan's memory estimate is its own model of what XLA will allocate; XLA decides the schedule,
fusion and the packing of temporaries into one allocation. Where the estimate is low the plan
runs out of memory on the device, so with this option every program the plan emits is compiled
(not run) and its allocation per device (arguments + results + temporaries, from
`memory_analysis`, less the donated arguments' buffers that results are written into, as the
loader runs it) read back:

- a single program: its allocation;
- an accumulated or pipelined plan: each stage's estimate plus the largest amount by which a
  task of the stage compiles above its own estimate (the loader's held arrays are the
  estimate's; the compiled task replaces the task's estimated peak).

The compile runs in a child process on simulated CPU devices (XLA_FLAGS
--xla_force_host_platform_device_count), so any machine can check a plan for any mesh, and the
caller's jax (devices, backend) is left alone. For a GPU target that makes the check a proxy,
on the safe side where the two compilers differ in what we have measured: XLA's CPU pipeline
keeps a reduce-scatter as an all-reduce whose whole result is allocated, and its packing of
temporaries is its own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from hloplan.diagnostics import HloplanError
from hloplan.multiprocess import isolated_python

# A compile of the largest benchmark programs on 1,024 simulated devices takes a minute.
TIMEOUT_S = 1800.0


class VerifyError(HloplanError):
    pass


def _abstract_call(exported, shardings):
    import jax

    return [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
            for a, s in zip(exported.in_avals, shardings, strict=True)]


def measure_plan_dir(plan_dir: str | os.PathLike) -> dict:
    """In this process: the compiled allocation per device of the plan's programs, by name
    ("program", or each task's name). jax must see the plan's devices."""

    from hloplan.emit.loader import Runner, load, read_plan
    from hloplan.hlo_stats import memory_stats

    def _allocation(compiled) -> int:  # arguments + results + temporaries - aliased
        return memory_stats(compiled)["peak_bytes"]

    plan = read_plan(plan_dir)
    measured = {}
    if plan.get("pipeline", {}).get("tasks"):
        runner = load(plan_dir)
        for task in runner.tasks:
            args = _abstract_call(task["exported"], task["in_shardings"])
            measured[task["name"]] = _allocation(task["call"].lower(*args).compile())
    else:
        # Donating what the export donates, as the loader runs it.
        measured["program"] = _allocation(Runner(plan_dir).compile_abstract())
    return measured


def measure_files(files: dict[str, bytes], devices: int, timeout: float = TIMEOUT_S) -> dict:
    """The plan's files (as compile renders them), measured by measure_plan_dir in a child
    process with `devices` simulated CPU devices."""
    with tempfile.TemporaryDirectory(prefix="hloplan-verify-") as tmp:
        for name, data in files.items():
            path = Path(tmp) / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
        env = dict(os.environ)
        env["XLA_FLAGS"] = " ".join(
            [f for f in env.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
            + [f"--xla_force_host_platform_device_count={devices}"])
        env["JAX_PLATFORMS"] = "cpu"
        try:
            done = subprocess.run([*isolated_python("hloplan.verify"), tmp], env=env, cwd=tmp,
                                  capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise VerifyError(f"--verify-memory: XLA did not compile the plan within "
                              f"{timeout:.0f} s") from None
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            raise VerifyError("--verify-memory: XLA could not compile the plan: "
                              + " | ".join(tail))
        return json.loads(done.stdout.strip().splitlines()[-1])


def checked_peak(plan: dict, measured: dict) -> dict:
    """What the compiled programs say of the plan's peak per device: {"peak_bytes",
    "estimated_bytes", "programs": measured}. For a pipelined plan, each stage's estimate
    corrected by its tasks' compiled allocations (module docstring)."""
    pipeline = plan.get("pipeline", {})
    if pipeline.get("tasks"):
        stages = pipeline["estimate"]["memory_per_stage_bytes"]
        excess = [0.0] * len(stages)  # a task under its estimate lowers nothing
        for task in pipeline["tasks"]:
            over = measured[task["name"]] - task["peak_memory_bytes"]
            excess[task["stage"]] = max(excess[task["stage"]], over)
        peaks = [est + extra for est, extra in zip(stages, excess)]
        return {"peak_bytes": max(peaks), "estimated_bytes": max(stages), "programs": measured}
    return {"peak_bytes": measured["program"],
            "estimated_bytes": plan["estimate"]["peak_memory_bytes"], "programs": measured}


def main(argv: list[str]) -> int:
    print(json.dumps(measure_plan_dir(argv[0]), sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
