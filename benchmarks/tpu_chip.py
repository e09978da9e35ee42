"""Single-chip step times on a real TPU against hloplan's estimate for one device.

On the chip (needs only jax and numpy; run from the repository root):

    python3 benchmarks/tpu_chip.py measure -o chip.json

times each benchmark program's jitted train step (models.py, "realistic" size for one device,
state donated) on the first device: median wall seconds of 10 steps after 2 warm-up steps.

Here (hloplan installed):

    .venv/bin/python benchmarks/tpu_chip.py estimate --chip chip.json [--device FILE]

plans each program for one device (`--mesh 1`, default device tpu-v5e) and writes, per program,
hloplan's estimated step (compute + the device's program overhead) and measured / estimated,
into benchmarks/tpu_chip_results.json (under "by_device_model", one entry per --device).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

PROGRAMS = ["gpt", "llama", "bert", "moe", "resnet", "mlp"]
RESULTS = HERE / "tpu_chip_results.json"


def measure(out: str, programs: list[str], size: str = "realistic") -> None:
    import jax
    import models

    results = {"device_kind": jax.devices()[0].device_kind, "jax": jax.__version__,
               "size": size, "programs": {}}
    for name in programs:
        cfg, state_spec, batch_spec, step = models.MODELS[name].build(size, 1)
        started = time.perf_counter()
        state = models.concrete(state_spec, seed=0)
        batch = models.concrete(batch_spec, seed=1)
        jitted = jax.jit(step, donate_argnums=(0,))
        compiled = jitted.lower(state, batch).compile()
        compile_s = time.perf_counter() - started
        times = []
        for i in range(12):
            t0 = time.perf_counter()
            loss, state = compiled(state, batch)
            jax.block_until_ready((loss, state))
            if i >= 2:
                times.append(time.perf_counter() - t0)
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, list | tuple) else cost
        results["programs"][name] = {"config": cfg, "step_s": statistics.median(times),
                                     "min_step_s": min(times), "compile_s": compile_s,
                                     "flops": float(cost.get("flops", 0.0)),
                                     "bytes_accessed": float(cost.get("bytes accessed", 0.0))}
        print(name, results["programs"][name]["step_s"], flush=True)
    Path(out).write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")


def estimate(chip: str, device: str) -> None:
    import tempfile

    import models

    from hloplan.compiler import compile_bytes, make_options
    from hloplan.cost_models import load_device_model

    measured = json.loads(Path(chip).read_text())
    model = load_device_model(device)
    rows = {}
    for name, entry in measured["programs"].items():
        _, state_spec, batch_spec, step = models.MODELS[name].build(measured["size"], 1)
        exported = models.export_step(step, state_spec, batch_spec)
        with tempfile.TemporaryDirectory():
            result = compile_bytes(bytes(exported.serialize()), f"{name}.jaxexport",
                                   make_options("1", device=device, mesh_views="off"))
        est = result.plan["estimate"]
        estimated = est["compute_s"] + est["communication_s"] + model.program_overhead
        rows[name] = {"measured_s": entry["step_s"], "estimated_s": estimated,
                      "estimated_compute_s": est["compute_s"],
                      "measured_over_estimated": entry["step_s"] / estimated}
        print(f"{name:<8} measured {entry['step_s'] * 1e3:8.2f} ms  estimated "
              f"{estimated * 1e3:8.2f} ms  ratio {rows[name]['measured_over_estimated']:.2f}")
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    results.setdefault("by_device_model", {})[model.name] = {
        "chip": measured["device_kind"], "device_model": model.name,
        "device_model_file": str(model.source), "programs": rows,
        "command": ".venv/bin/python benchmarks/tpu_chip.py " + " ".join(sys.argv[1:])}
    RESULTS.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="mode", required=True)
    m = sub.add_parser("measure")
    m.add_argument("-o", "--output", required=True)
    m.add_argument("--programs", default=",".join(PROGRAMS))
    m.add_argument("--size", default="realistic", choices=("small", "realistic"))
    e = sub.add_parser("estimate")
    e.add_argument("--chip", required=True)
    e.add_argument("--device", default="tpu-v5e")
    args = parser.parse_args()
    if args.mode == "measure":
        measure(args.output, args.programs.split(","), args.size)
    else:
        estimate(args.chip, args.device)


if __name__ == "__main__":
    main()
