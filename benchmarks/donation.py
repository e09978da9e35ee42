"""Donation and the memory estimate: each program exported twice, with its state donated
(`jax.jit(step, donate_argnums=(0,))`, as a training loop jits it) and without, planned by
`hloplan compile --mesh-views off`, and compiled as the loader runs it (donating what the
export donates).
Per export: hloplan's estimated peak per device, XLA's allocation (arguments + results +
temporaries - donated buffers) and its live peak, and what is aliased.

The estimate writes a donated argument's new value into the argument's buffer and holds every
other result for the whole program (XLA allocates it so; it may also put a smaller temporary
that dies earlier into it, so the rule is an upper bound when nothing is donated).

    .venv/bin/python benchmarks/donation.py [--models mlp,resnet] [--meshes 8]

Writes benchmarks/donation_results.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import run  # sets XLA_FLAGS (simulated CPU devices) before jax is imported

HERE = Path(__file__).resolve().parent
GIB = 2**30


def measure(model: str, mesh: str, donate: bool, workdir: Path) -> dict:
    import jax
    import models
    from jax import export

    import hloplan
    from hloplan.emit.loader import Runner
    from hloplan.hlo_stats import memory_stats

    shape = run.mesh_shape(mesh)
    devices = 1
    for size in shape:
        devices *= size
    _, state_spec, batch_spec, step = models.MODELS[model].build("realistic", devices)
    jitted = jax.jit(step, donate_argnums=(0,) if donate else ())
    exported = export.export(jitted)(models.abstract(state_spec), models.abstract(batch_spec))
    name = f"{model}_{mesh}_{'donated' if donate else 'kept'}"
    path = workdir / f"{name}.jaxexport"
    path.write_bytes(exported.serialize())
    plan_dir = workdir / name
    # On the mesh as given (no views): a view's plan may hold what the CPU compiler does
    # differently from a GPU's (a reduce-scatter kept as an all-reduce), which is not what
    # this measures.
    plan = hloplan.compile(str(path), mesh, output=str(plan_dir), device=run.DEVICE,
                           hosts=run.hosts_for(devices), mesh_views="off").plan
    dump = workdir / f"{name}.dump"
    runner = Runner(plan_dir)
    compiled = runner.compile_abstract(run.dump_options(dump))
    stats = compiled.memory_analysis()
    return {
        "model": model, "mesh": mesh, "donated": donate,
        "estimated_bytes": plan["estimate"]["peak_memory_bytes"],
        "allocation_bytes": memory_stats(compiled)["peak_bytes"],
        "live_peak_bytes": run.live_peak(dump),
        "aliased_bytes": stats.alias_size_in_bytes,
        "results_bytes": stats.output_size_in_bytes,
        "aliases": len(plan["donation"]["aliases"]),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp,resnet")
    parser.add_argument("--meshes", default="8")
    parser.add_argument("--out", default=str(HERE / "donation_results.json"))
    args = parser.parse_args(argv)
    started = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory(prefix="hloplan-donation-") as tmp:
        for model in args.models.split(","):
            for mesh in args.meshes.split(","):
                for donate in (True, False):
                    rows.append(measure(model, mesh, donate, Path(tmp)))
    print("| model | mesh | state | estimated | XLA allocation | XLA live peak | estimate / "
          "allocation | aliased |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['mesh']} | {'donated' if r['donated'] else 'kept'} | "
              f"{r['estimated_bytes'] / GIB:.3f} GiB | {r['allocation_bytes'] / GIB:.3f} | "
              f"{(r['live_peak_bytes'] or 0) / GIB:.3f} | "
              f"{r['estimated_bytes'] / r['allocation_bytes']:.3f} | "
              f"{r['aliased_bytes'] / GIB:.3f} |")
    wall = time.perf_counter() - started
    Path(args.out).write_text(json.dumps({"cases": rows, "wall_s": wall, "git": run.git_state()},
                                         indent=1, sort_keys=True) + "\n")
    print(f"wrote {args.out} in {wall / 60:.1f} min")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
