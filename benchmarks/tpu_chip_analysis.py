"""Where the single-chip time goes, by op category: the chip's own device time per kernel (a
profiler trace of `tpu_chip.py measure --profile`), the per-kernel roofline of the same
compiled HLO at the chip's measured rates (hlo_stats.kernel_stats' formula), and hloplan's
per-op compute estimate for `--mesh 1`.

    .venv/bin/python benchmarks/tpu_chip_analysis.py --chip CHIP.json --hlo DIR [--device FILE]

CHIP.json: `tpu_chip.py measure --profile DIR` output (benchmark or corpus programs); DIR holds
the compiled HLO text of each program (NAME.hlo.txt[.gz]) as the chip ran it.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

CATEGORIES = ("matmul", "elementwise", "reduction", "gather/scatter", "other")


def _category_of_ops(opcodes: set[str]) -> str:
    if opcodes & {"convolution", "dot"}:
        return "matmul"
    if opcodes & {"gather", "scatter", "dynamic-slice", "dynamic-update-slice"}:
        return "gather/scatter"
    if opcodes & {"reduce", "reduce-window", "select-and-scatter"}:
        return "reduction"
    if opcodes & {"sort", "custom-call", "rng", "rng-bit-generator"}:
        return "other"
    return "elementwise"


def compiled_kernels(hlo_text: str, flop_rate: float, hbm_bandwidth: float) -> dict[str, dict]:
    """Per kernel of the entry (and control-flow bodies) of a compiled HLO module: its
    category, FLOPs, HBM bytes and roofline seconds (hlo_stats.kernel_stats, kernel by kernel)."""
    from hloplan.hlo_stats import compiled_kernels as kernels_of

    return {k.name: {"category": "gather/scatter" if k.indexed else _category_of_ops(k.opcodes),
                     "flops": k.flops, "bytes": k.bytes,
                     "roofline_s": k.seconds(flop_rate, hbm_bandwidth)}
            for k in kernels_of(hlo_text)}


def _profile_name(event: str) -> str:
    """The instruction name of a profiler event: either the name or the instruction's text."""
    m = re.match(r"\s*%?([\w.\-]+)", event)
    return m.group(1) if m else event


def hloplan_ops(name: str, device: str, corpus_dir: Path | None) -> list[dict]:
    """hloplan's per-op estimate of one program for --mesh 1 (the plan's ops)."""
    from hloplan.compiler import compile_bytes, make_options

    if corpus_dir is not None and (corpus_dir / f"{name}.jaxexport").exists():
        data = (corpus_dir / f"{name}.jaxexport").read_bytes()
    else:
        import models

        _, state_spec, batch_spec, step = models.MODELS[name].build("realistic", 1)
        data = bytes(models.export_step(step, state_spec, batch_spec).serialize())
    with tempfile.TemporaryDirectory():
        result = compile_bytes(data, f"{name}.jaxexport",
                               make_options("1", device=device, mesh_views="off"))
    return result.plan["ops"]


def _hloplan_category(op: str) -> str:
    short = op.split(".", 1)[-1]
    if short in ("dot_general", "dot", "convolution"):
        return "matmul"
    if short in ("gather", "scatter", "dynamic_slice", "dynamic_update_slice"):
        return "gather/scatter"
    if short in ("reduce", "reduce_window", "select_and_scatter"):
        return "reduction"
    if short in ("sort", "custom_call"):
        return "other"
    return "elementwise"


def analyze(chip: str, hlo_dir: str, device: str, corpus_dir: str | None,
            names: list[str] | None) -> dict:
    from hloplan.cost_models import load_device_model

    model = load_device_model(device)
    rate, bandwidth = model.flops_for("f32"), model.hbm_bandwidth
    measured = json.loads(Path(chip).read_text())
    rows = {}
    for name, entry in measured["programs"].items():
        if names and name not in names:
            continue
        path = Path(hlo_dir) / f"{name}.hlo.txt.gz"
        text = gzip.decompress(path.read_bytes()).decode() if path.exists() else \
            (Path(hlo_dir) / f"{name}.hlo.txt").read_text()
        kernels = compiled_kernels(text, rate, bandwidth)
        chip_ops = {}
        for event, seconds in entry.get("device", {}).get("ops", {}).items():
            key = _profile_name(event)
            chip_ops[key] = chip_ops.get(key, 0.0) + seconds
        row = {c: {"chip_s": 0.0, "roofline_s": 0.0, "hloplan_s": 0.0} for c in CATEGORIES}
        for key, seconds in chip_ops.items():
            category = kernels.get(key, {}).get("category", "other")
            row[category]["chip_s"] += seconds
        for kernel in kernels.values():
            row[kernel["category"]]["roofline_s"] += kernel["roofline_s"]
        ops = hloplan_ops(name, device, Path(corpus_dir) if corpus_dir else None)
        for op in ops:
            row[_hloplan_category(op["op"])]["hloplan_s"] += op["compute_s"] or 0.0
        total = {k: sum(row[c][k] for c in CATEGORIES) for k in ("chip_s", "roofline_s",
                                                                 "hloplan_s")}
        rows[name] = {"step_s": entry["step_s"], "by_category": row, "total": total}
        print(f"{name}: step {entry['step_s'] * 1e3:.2f} ms; device / roofline / hloplan ms")
        for c in CATEGORIES:
            r = row[c]
            print(f"   {c:15} {r['chip_s'] * 1e3:8.2f} {r['roofline_s'] * 1e3:8.2f} "
                  f"{r['hloplan_s'] * 1e3:8.2f}")
        print(f"   {'total':15} {total['chip_s'] * 1e3:8.2f} {total['roofline_s'] * 1e3:8.2f} "
              f"{total['hloplan_s'] * 1e3:8.2f}", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--chip", required=True)
    parser.add_argument("--hlo", required=True)
    parser.add_argument("--device", default=str(HERE / "tpu-v5e-calibrated.toml"))
    parser.add_argument("--corpus", default=None, help="directory of exported corpus steps")
    parser.add_argument("--programs", default=None)
    parser.add_argument("-o", "--output", default=None)
    args = parser.parse_args()
    rows = analyze(args.chip, args.hlo, args.device, args.corpus,
                   args.programs.split(",") if args.programs else None)
    if args.output:
        Path(args.output).write_text(json.dumps(rows, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
