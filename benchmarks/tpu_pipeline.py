"""Pipelined plans of the third-party corpus compiled by libtpu: what each task's plan lists
against what libtpu compiles of it.

    .venv/bin/python benchmarks/tpu_pipeline.py             # every program, ~10 min on 2 cores
    .venv/bin/python benchmarks/tpu_pipeline.py --programs hf_gpt2

Needs libtpu (`pip install -e ".[tpu]"`). Each program of the corpus (examples/third_party,
benchmarks/tpu.py's small size: 2 sequences of 128 tokens or 8 images per device, real widths,
2 layers; exported for tpu) is planned with `--device tpu-v5e --mesh 2x4 --stages 2
--microbatches 4` (1F1B) and verified as `hloplan verify PLAN --compiler tpu` does
(hloplan.verify.verify_plan): every task compiled by libtpu for v5e:2x4 on its stage's
submesh. Per program:

- the step's collectives per kind and mesh axes (each task's, part-A tasks once per
  microbatch: the verify report's `step`), predicted and compiled, their bytes' ratio, and
  how many kinds are within 5%;
- per task, the predicted peak per device over what libtpu reserves (the smallest and the
  largest ratio, and the task of each);
- a program the pipeline cannot split (its batch, or no cut between layers) says why.

Writes benchmarks/tpu_pipeline_results.json (docs/tpu.md shows the figures).
"""

from __future__ import annotations

import os

from hloplan.tpu import child_env

os.environ.update(child_env())  # compiles for TPU topologies, deviceless: before jax loads

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

RESULTS = HERE / "tpu_pipeline_results.json"
TOPOLOGY = "v5e:2x4"
STAGES, MICROBATCHES, SCHEDULE = 2, 4, "1f1b"


def measure(name: str) -> dict:
    """The row of one corpus program (module docstring)."""
    import tpu

    from hloplan.compiler import PipelineOptions, compile_bytes, make_options
    from hloplan.diagnostics import HloplanError
    from hloplan.verify import verify_plan

    sizes = tpu.corpus_sizes(name, 8, "small")
    data, _, library = tpu.corpus_export(name, sizes)
    row: dict = {"program": name, "library": library, "sizes": sizes}
    started = time.perf_counter()
    try:
        result = compile_bytes(data, f"{name}.jaxexport",
                               make_options("2x4", device="tpu-v5e", mesh_views="off"),
                               pipeline=PipelineOptions(STAGES, MICROBATCHES, SCHEDULE))
    except HloplanError as error:
        row["not_pipelined"] = str(error).strip().splitlines()[0][:300]
        return row
    row["planning_s"] = time.perf_counter() - started
    pipeline = result.plan["pipeline"]
    row["pipeline"] = {"stages": pipeline["stages"], "microbatches": pipeline["microbatches"],
                       "tasks": len(pipeline["tasks"]),
                       "step_time_s": pipeline["estimate"]["step_time_s"]}
    with tempfile.TemporaryDirectory() as tmp:
        result.write(Path(tmp) / "plan")
        started = time.perf_counter()
        report = verify_plan(Path(tmp) / "plan", compiler="tpu", topology=TOPOLOGY)
        row["verify_s"] = time.perf_counter() - started
    row["collectives"] = {f"{c['kind']}({c['axes']})": {
        "predicted": c["predicted"]["bytes"], "compiled": c["compiled"]["bytes"]}
        for c in report["step"]["collectives"]}
    row["collective_bytes_ratio"] = tpu.bytes_ratios(row["collectives"])
    row["kinds_within_5pct"] = sum(1 for v in row["collectives"].values()
                                   if v["ratio"] is not None and abs(v["ratio"] - 1) <= 0.05)
    peaks = {task: entry["peak_ratio"] for task, entry in report["programs"].items()
             if entry["peak_ratio"] is not None}
    low, high = min(peaks, key=peaks.get), max(peaks, key=peaks.get)
    row["task_peak_ratio"] = {"min": peaks[low], "min_task": low,
                              "max": peaks[high], "max_task": high}
    row["task_peak_bytes"] = {task: {"predicted": entry["predicted"]["peak_bytes"],
                                     "compiled": entry["compiled"]["peak_bytes"]}
                              for task, entry in report["programs"].items()}
    return row


def main() -> None:
    import tpu

    parser = argparse.ArgumentParser()
    parser.add_argument("--programs", default=",".join(tpu.CORPUS_PROGRAMS))
    parser.add_argument("--output", default=str(RESULTS))
    args = parser.parse_args()
    path = Path(args.output)
    results = json.loads(path.read_text()) if path.exists() else {}
    results.update(command="JAX_PLATFORMS=cpu .venv/bin/python benchmarks/tpu_pipeline.py",
                   topology=TOPOLOGY, stages=STAGES, microbatches=MICROBATCHES,
                   schedule=SCHEDULE)
    rows = results.setdefault("programs", {})
    for name in args.programs.split(","):
        started = time.perf_counter()
        row = measure(name)
        row["seconds"] = time.perf_counter() - started
        rows[name] = row
        if "not_pipelined" in row:
            print(f"{name}: not pipelined: {row['not_pipelined']}", flush=True)
        else:
            peak = row["task_peak_ratio"]
            print(f"{name}: {row['pipeline']['tasks']} tasks; step collective bytes predicted / "
                  f"compiled {row['collective_bytes_ratio'] or 0:.3f}, "
                  f"{row['kinds_within_5pct']} of {len(row['collectives'])} kinds within 5%; "
                  f"task peaks {peak['min']:.2f} ({peak['min_task']}) to {peak['max']:.2f} "
                  f"({peak['max_task']}); {row['seconds']:.0f} s", flush=True)
        path.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
