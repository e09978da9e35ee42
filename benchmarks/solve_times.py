"""How the sharding ILP solves on the TPU benchmark programs: status, seconds and plan cost.

    .venv/bin/python benchmarks/solve_times.py                          # every case, ~5 min
    .venv/bin/python benchmarks/solve_times.py --cases corpus:hf_llama:2x4

Each case is exported for the tpu platform (no libtpu compile) and planned as the TPU
benchmarks plan it (`--device tpu-v5e`, the topology's mesh, mesh views off):

- `corpus:NAME:MESH`: a third-party corpus program at benchmarks/tpu.py --corpus's size;
- `corpus-real:NAME:MESH`: at benchmarks/tpu_memory.py's (corpus.py's realistic size);
- `model:NAME:MESH`: a benchmarks/models.py program at benchmarks/tpu.py's size;
- `model-real:NAME:MESH`: at benchmarks/tpu_memory.py's.

Per case: plan.json's solver status, whether the plan is deterministic (no time limit cut the
solve), objective, bound and gap, branch-and-bound nodes, the estimate's step time, and the
seconds of each solve (wall and CPU: on a shared machine CPU seconds say what the solve costs,
wall seconds what the 60 s time limit sees). Writes benchmarks/solve_times_results.json.
"""

from __future__ import annotations

import os

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "examples" / "third_party"))

RESULTS = HERE / "solve_times_results.json"
CORPUS = ["hf_gpt2", "hf_bert", "hf_llama", "hf_bart", "haiku_transformer", "linen_resnet",
          "keras_gemma", "keras_moe"]
DEFAULT_CASES = (
    [f"corpus:{name}:2x4" for name in CORPUS]
    + ["corpus-real:hf_llama:2x4", "corpus-real:hf_gpt2:2x4"]
    + [f"model:{name}:2x4" for name in ("mlp", "gpt", "llama", "bert", "moe", "resnet")]
    + ["model:mlp:4x8", "model:gpt:4x8"]
    + [f"model-real:{name}:2x4" for name in ("gpt", "llama", "bert", "mlp", "moe")]
    + ["model-real:gpt:4x8", "model-real:llama:4x8"])


def export_case(kind: str, name: str, devices: int) -> bytes:
    import jax

    if kind.startswith("corpus"):
        import tpu

        kwargs = (tpu.corpus_sizes(name, devices) if kind == "corpus"
                  else {"size": "real", "batch": 8 * devices, "seq": 512, "layers": 4})
        return tpu.corpus_export(name, kwargs)[0]
    import models
    import tpu
    import tpu_memory

    entry = models.MODELS[name]
    cfg = tpu.config(name, devices) if kind == "model" else tpu_memory.config(name, devices)
    exported = jax.export.export(jax.jit(entry.make_step(cfg), donate_argnums=(0,)),
                                 platforms=("tpu",))(models.abstract(entry.state_spec(cfg)),
                                                     models.abstract(entry.batch_spec(cfg)))
    return bytes(exported.serialize())


def run_case(case: str) -> dict:
    import hloplan.passes.solve_sharding as solve_sharding
    from hloplan.compiler import compile_bytes, make_options

    kind, name, mesh = case.split(":")
    devices = 1
    for size in mesh.split("x"):
        devices *= int(size)
    data = export_case(kind, name, devices)
    solves = []
    solve = solve_sharding.axes.solve

    def timed(problem, **kwargs):  # each solve's wall and CPU seconds
        wall, cpu = time.perf_counter(), time.process_time()
        out = solve(problem, **kwargs)
        solves.append({"wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu,
                       "status": out[1].status})
        return out

    solve_sharding.axes.solve = timed
    try:
        result = compile_bytes(data, f"{name}.jaxexport",
                               make_options(mesh, device="tpu-v5e", mesh_views="off"))
    finally:
        solve_sharding.axes.solve = solve
    plan = result.plan
    solver = plan["solver"]
    keys = ("status", "deterministic", "objective_s", "bound_s", "gap", "variables",
            "branch_and_bound_nodes")
    return {"case": case, **{k: solver.get(k) for k in keys},
            "step_time_s": plan["estimate"]["step_time_s"], "solves": solves,
            "solve_wall_s": sum(s["wall_s"] for s in solves),
            "solve_cpu_s": sum(s["cpu_s"] for s in solves)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(DEFAULT_CASES),
                        help="comma-separated kind:name:mesh (default: all)")
    parser.add_argument("--output", default=str(RESULTS))
    args = parser.parse_args()
    results = {"command": "JAX_PLATFORMS=cpu .venv/bin/python benchmarks/solve_times.py",
               "cases": {}}
    for case in args.cases.split(","):
        try:
            row = run_case(case)
        except Exception:  # reported; the others still run
            row = {"case": case, "error": traceback.format_exc().strip().splitlines()[-1]}
        results["cases"][case] = row
        if "error" in row:
            print(f"{case}: ERROR {row['error']}", flush=True)
        else:
            print(f"{case}: {row['status']}{'' if row['deterministic'] else ' (not deterministic)'}"
                  f", objective {row['objective_s']:.6g} s, gap {row['gap']:.2%}, "
                  f"solve {row['solve_cpu_s']:.1f} s CPU / {row['solve_wall_s']:.1f} s wall "
                  f"({len(row['solves'])} solves)", flush=True)
        Path(args.output).write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
