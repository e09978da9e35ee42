"""Mesh views on two-axis meshes: what `--mesh-views all` gains over the default.

The default (`--mesh-views auto`) also plans a one-axis mesh as its two-axis views; `all` also
splits an axis of a two-axis mesh (4x8 as 2x2x8, 4x2x4 and 4x4x2: the same 32 devices in the
same order, each part over the links its axis ran over). For each benchmark model on each mesh,
hloplan's plan with `--mesh-views all` is compiled and scored by run.py's formula, and its
ratio is formed against the best hand plan that fits, read from benchmarks/results.json (the
hand plans do not depend on hloplan; run.py compiled and scored them on the same mesh). Also
hloplan's compile wall time both ways.

    .venv/bin/python benchmarks/mesh_views.py [--models gpt,mlp] [--meshes 4x8]

Writes benchmarks/mesh_views_results.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path

import run  # sets XLA_FLAGS (simulated CPU devices) before jax is imported

HERE = Path(__file__).resolve().parent


def measure(model: str, mesh: str, views: str, workdir: Path) -> dict:
    import models

    import hloplan

    devices = math.prod(run.mesh_shape(mesh))
    _, state_spec, batch_spec, step = models.MODELS[model].build("realistic", devices)
    path = workdir / f"{model}_{devices}.jaxexport"
    if not path.exists():
        path.write_bytes(models.export_step(step, state_spec, batch_spec).serialize())
    plan_dir = workdir / f"plan_{model}_{mesh}_{views}"
    started = time.perf_counter()
    result = hloplan.compile(str(path), mesh, output=str(plan_dir), device=run.DEVICE,
                             hosts=run.hosts_for(devices), mesh_views=views)
    compile_s = time.perf_counter() - started
    plan, _, compiled, _ = run.compile_hloplan_artifact(plan_dir)
    jmesh_axes = tuple(zip(plan["mesh"]["axis_names"], plan["mesh"]["axis_sizes"]))
    scored = run.measure(compiled, jmesh_axes, run.comm_model(run.plan_mesh(plan)))
    tried = (plan.get("mesh_views") or {}).get("tried", [])
    return {"views": views, "mesh_planned": run.plan_mesh(plan), "compile_s": compile_s,
            "estimate_s": plan["estimate"]["step_time_s"], "step_s": scored["step_s"],
            "step_kernels_s": scored["step_kernels_s"], "peak_bytes": scored["peak_bytes"],
            "tried": [{"mesh": t["mesh"], "estimate_s": t.get("step_time_s")} for t in tried],
            "timings": result.timings}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt,llama,bert,moe,resnet,mlp")
    parser.add_argument("--meshes", default="4x8")
    args = parser.parse_args()
    quality = {(c["model"], c["mesh"]): c
               for c in json.loads((HERE / "results.json").read_text())["plan_quality"]}
    rows = []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for mesh in args.meshes.split(","):
            for model in args.models.split(","):
                case = quality[(model, mesh)]
                best = case["best_hand_step_s"]
                row = {"model": model, "mesh": mesh, "best_hand": case["best_hand"],
                       "best_hand_step_s": best}
                for views in ("auto", "all"):
                    got = measure(model, mesh, views, Path(tmp))
                    got["ratio"] = got["step_s"] / best
                    row[views] = got
                rows.append(row)
                print(f"{model:>7} {mesh}: auto {row['auto']['ratio']:.3f} "
                      f"({row['auto']['compile_s']:.1f} s), all {row['all']['ratio']:.3f} on "
                      f"{row['all']['mesh_planned']} ({row['all']['compile_s']:.1f} s)", flush=True)
    out = {"wall_s": time.perf_counter() - started, "device_model": run.DEVICE, "cases": rows}
    (HERE / "mesh_views_results.json").write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    print("\n| model | mesh | best hand plan | --mesh-views auto: ratio | compile s | "
          "all: planned on | estimated step (ms) auto -> all | ratio | compile s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        a, b = r["auto"], r["all"]
        print(f"| {r['model']} | {r['mesh']} | {r['best_hand']} | {a['ratio']:.3f} | "
              f"{a['compile_s']:.1f} | {b['mesh_planned']} | {a['estimate_s'] * 1e3:.2f} -> "
              f"{b['estimate_s'] * 1e3:.2f} | {b['ratio']:.3f} | {b['compile_s']:.1f} |")


if __name__ == "__main__":
    main()
