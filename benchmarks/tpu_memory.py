"""Memory on TPU: hloplan's estimated peak per device against what libtpu compiles.

    .venv/bin/python benchmarks/tpu_memory.py                         # every case, ~15 min
    .venv/bin/python benchmarks/tpu_memory.py --cases gpt:v5e:2x4     # one case
    .venv/bin/python benchmarks/tpu_memory.py --llama8b 32            # the Llama-8B-class step
    .venv/bin/python benchmarks/tpu_memory.py --llama8b 2 --hand '' --dump DIR  # hloplan's only

Needs libtpu (`pip install -e ".[tpu]"`). Each case is a train step at a size where its state
and activations are a meaningful part of a v5e chip's 16 GiB (hundreds of MB to GB per
device), exported for the tpu platform, planned by hloplan with `--device tpu-v5e` on the
topology's mesh, and compiled by libtpu for the topology with the plan's own loader. Per case:

- predicted: plan.json's estimated peak per device (`estimate.peak_memory_bytes`);
- compiled: libtpu's figures, arguments + results + temporaries - aliased (`peak_bytes`,
  from `memory_analysis`), what its runtime reserves (`reserved_bytes`: the same with the HBM
  temporaries of the buffer assignment libtpu dumps, which `temp_size_in_bytes` can exceed)
  and `peak_memory_in_bytes` (`xla_peak_bytes`), with where libtpu's peak is and its largest
  buffers (`memory.live_peak`, hlo_stats.live_peak);
- the ratios predicted / compiled of the three (`ratio`, `ratio_reserved`, `ratio_xla`);
- `collectives`: the plan's predicted collective bytes per kind and mesh axes beside libtpu's
  (benchmarks/tpu.py's formula), their ratios and the ratio of all bytes;
- `without_buffers`: the same program planned with tpu-v5e less its `[buffers]` table (the
  rules XLA's CPU compiler follows), and whether that picks the same plan.

`--llama8b LAYERS` plans a Llama-8B-class train step (models.llama8b_config: d_model 4096, ffn
14336, 32 / 8 heads, vocab 128256, 256 sequences of 2048 tokens, optax AdamW, each block
rematerialised) for v5e:16x16, compiles hloplan's plan and the hand plans FSDP and FSDP + TP
with libtpu, and scores each with benchmarks/tpu.py's `formula`.

Writes benchmarks/tpu_memory_results.json (docs/tpu.md, "Memory on TPU", shows the figures).
"""

from __future__ import annotations

import os

from hloplan.tpu import child_env

os.environ.update(child_env())  # compiles for TPU topologies, deviceless: before jax loads

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "examples" / "third_party"))

RESULTS = HERE / "tpu_memory_results.json"
DEVICE = "tpu-v5e"
LARGEST = 12  # buffers listed from libtpu's peak
# model:topology, or corpus program:topology (examples/third_party/corpus.py)
DEFAULT_CASES = ["gpt:v5e:2x4", "llama:v5e:2x4", "bert:v5e:2x4", "mlp:v5e:2x4", "moe:v5e:2x4",
                 "gpt:v5e:4x8", "llama:v5e:4x8", "gpt:v5e:16x16", "llama:v5e:16x16",
                 "hf_gpt2:v5e:2x4", "hf_llama:v5e:2x4", "hf_gpt2:v5e:4x8", "hf_llama:v5e:4x8"]


def config(model: str, devices: int) -> dict:
    """Realistic widths (models.py's "realistic" sizes, 8 sequences of 1,024 tokens per device)
    with the layer counts that keep a libtpu compile within about a minute on 2 cores."""
    import models

    cfg = models.MODELS[model].config("realistic", devices)
    if devices > 32:  # 256 chips: 2 sequences per device keep the compile short
        cfg["batch"] = 2 * devices
    return cfg


def _export_model(name: str, devices: int) -> tuple[bytes, dict]:
    import jax
    import models
    from jax import export

    entry = models.MODELS[name]
    cfg = config(name, devices)
    exported = export.export(jax.jit(entry.make_step(cfg), donate_argnums=(0,)),
                             platforms=("tpu",))(models.abstract(entry.state_spec(cfg)),
                                                 models.abstract(entry.batch_spec(cfg)))
    return bytes(exported.serialize()), cfg


def _export_corpus(name: str, devices: int) -> tuple[bytes, dict]:
    """A corpus program at benchmarks/corpus.py's realistic size (4 layers, 8 sequences of 512
    tokens per device), exported for the tpu platform."""
    from tpu import corpus_export

    kwargs = {"size": "real", "batch": 8 * devices, "seq": 512, "layers": 4}
    return corpus_export(name, kwargs)[0], kwargs


def _plan(data: bytes, mesh_text: str, buffers: bool = True):
    from hloplan.compiler import compile_bytes, make_options

    options = make_options(mesh_text, device=DEVICE, mesh_views="off")
    if not buffers:  # the CPU compiler's rules: no [buffers] table
        options = dataclasses.replace(options, device=dataclasses.replace(
            options.device, fused_reductions=False, matmul_operands=None,
            tiled_layouts=False))
    started = time.perf_counter()
    result = compile_bytes(data, "step.jaxexport", options)
    return result, time.perf_counter() - started


def _layouts(plan: dict) -> list:
    return [(a["name"], a["spec"]) for a in plan["arguments"]] + [
        (op["id"], op["results"]) for op in plan["ops"]]


def _compile_plan(result, devices, dump: Path | None = None):
    """libtpu's compile of the plan; with `dump`, its optimized HLO and buffer assignment are
    written there (`xla_dump_to`)."""
    from hloplan.emit.loader import load

    options = {"xla_dump_to": str(dump), "xla_dump_hlo_as_text": True} if dump else None
    with tempfile.TemporaryDirectory() as tmp:
        result.write(Path(tmp) / "plan")
        started = time.perf_counter()
        compiled = load(Path(tmp) / "plan", devices=devices).compile_abstract(options)
        return compiled, time.perf_counter() - started


def _reserved(memory: dict, dump: Path) -> dict:
    """What libtpu's runtime reserves for the program: arguments + results - aliased + the
    HBM temporaries of its buffer assignment (hlo_stats.preallocated_temp_bytes, color 0),
    and the largest buffers live at libtpu's peak (hlo_stats.live_peak).
    `memory_analysis`'s temp bytes can exceed that allocation (by 141 MB on the MLP on
    v5e:2x4) with no allocation of the dump holding the difference; on a v5e chip the
    runtime's `bytes_reserved` after a run is the allocation, not the temp bytes."""
    from hloplan.hlo_stats import dumped_live_peak, dumped_temp_bytes

    temps = dumped_temp_bytes(dump)  # one compile per dump
    hbm_temp = temps.get(0, 0)
    peak = dumped_live_peak(dump)  # what peak_memory_in_bytes counts, buffer by buffer
    return {"hbm_temp_bytes": hbm_temp, "vmem_temp_bytes": temps.get(1, 0),
            "reserved_bytes": (memory["argument_bytes"] + memory["output_bytes"] + hbm_temp
                               - (memory["alias_bytes"] or 0)),
            "live_peak": peak and {"bytes": peak.bytes, "time": peak.time, "largest": [
                [b.names[0], b.bytes, b.kind.split(",")[0].rstrip(":")]
                for b in peak.buffers[:LARGEST]]}}


def run_case(case: str) -> dict:
    import corpus
    from tpu import collective_ratios, formula, predicted_collectives, topology_mesh

    from hloplan.hlo_stats import memory_stats
    from hloplan.tpu import parse_topology, topology_devices

    name, kind, shape_text = case.split(":")
    topology = parse_topology(f"{kind}:{shape_text}")
    devices = topology_devices(topology)
    mesh_text = "x".join(map(str, topology.shape))
    export = _export_corpus if name in corpus.BY_NAME else _export_model
    data, cfg = export(name, topology.devices)
    result, plan_s = _plan(data, mesh_text)
    plain, _ = _plan(data, mesh_text, buffers=False)
    with tempfile.TemporaryDirectory() as dump:
        compiled, compile_s = _compile_plan(result, devices, Path(dump))
        memory = memory_stats(compiled)
        memory.update(_reserved(memory, Path(dump)))
    # the plan's predicted collectives beside libtpu's, per kind and mesh axes
    *_, mesh_axes, comm = topology_mesh(f"{kind}:{shape_text}")
    listed = predicted_collectives(result.plan["estimate"])
    collectives = {"predicted": listed["collectives"],
                   "compiled": formula(compiled, mesh_axes, comm)["collectives"]}
    collectives.update(collective_ratios(listed, collectives["compiled"]))
    predicted = result.plan["estimate"]["peak_memory_bytes"]
    without = plain.plan["estimate"]["peak_memory_bytes"]
    return {
        "case": case, "config": cfg, "plan_s": plan_s, "compile_s": compile_s,
        "predicted_bytes": predicted, "peak_bytes": memory["peak_bytes"],
        "xla_peak_bytes": memory["xla_peak_bytes"], "memory": memory,
        "reserved_bytes": memory["reserved_bytes"],
        "ratio": predicted / memory["peak_bytes"],
        "ratio_xla": predicted / memory["xla_peak_bytes"],
        "ratio_reserved": predicted / memory["reserved_bytes"],
        "predicted_peak_after": result.plan["estimate"]["peak"]["after"],
        "collectives": collectives,
        "without_buffers": {"predicted_bytes": without, "ratio": without / memory["peak_bytes"],
                            "same_plan": _layouts(plain.plan) == _layouts(result.plan)},
    }


def run_llama8b(layers: int, topology_name: str = "v5e:16x16",
                hand: tuple[str, ...] = ("fsdp", "fsdp_tp"), dump: Path | None = None) -> dict:
    """The Llama-8B-class step (module docstring): hloplan's plan and the hand plans, each
    compiled by libtpu and scored by benchmarks/tpu.py's formula. hloplan's compile is dumped
    (into `dump` if given, kept there) for what libtpu reserves (`_reserved`)."""
    import hand_plans
    import jax
    import models
    from jax import export
    from tpu import formula, predicted_collectives, topology_mesh

    topology, devices, mesh, mesh_text, mesh_axes, comm = topology_mesh(topology_name)
    shape = topology.shape
    cfg = models.llama8b_config(layers=layers)
    step = functools.partial(models.llama8b_step, c=cfg)
    state_spec, batch_spec = models.llama8b_state_spec(cfg), models.lm_batch_spec(cfg)
    out: dict = {"case": f"llama8b:{topology_name}", "config": cfg, "hand": {}}
    started = time.perf_counter()
    exported = export.export(jax.jit(step, donate_argnums=(0,)), platforms=("tpu",))(
        models.abstract(state_spec), models.abstract(batch_spec))
    out["export_s"] = time.perf_counter() - started
    result, out["plan_s"] = _plan(bytes(exported.serialize()), mesh_text)
    est = result.plan["estimate"]
    print(f"llama8b ({layers} layers): planned in {out['plan_s']:.1f} s, predicted peak "
          f"{est['peak_memory_bytes'] / 2**30:.2f} GiB", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        dump_dir = dump or Path(tmp)
        compiled, compile_s = _compile_plan(result, devices, dump_dir)
        ours = formula(compiled, mesh_axes, comm)
        ours["memory"].update(_reserved(ours["memory"], dump_dir))
    ours["compile_s"] = compile_s
    ours["predicted"] = predicted_collectives(est)
    ours["peak_ratio"] = est["peak_memory_bytes"] / ours["memory"]["peak_bytes"]
    ours["peak_ratio_xla"] = est["peak_memory_bytes"] / ours["memory"]["xla_peak_bytes"]
    ours["peak_ratio_reserved"] = est["peak_memory_bytes"] / ours["memory"]["reserved_bytes"]
    ours["peak_after"] = est["peak"]["after"]
    out["hloplan"] = ours
    print(f"  hloplan: compiled in {compile_s:.0f} s, libtpu peak "
          f"{ours['peak_bytes'] / 2**30:.2f} GiB (reserved "
          f"{ours['memory']['reserved_bytes'] / 2**30:.2f}; peak_memory_in_bytes "
          f"{ours['memory']['xla_peak_bytes'] / 2**30:.2f}), step {ours['step_s'] * 1e3:.1f} ms", flush=True)
    for plan in hand_plans.plans_for("llama", shape):
        if plan.name not in hand:
            continue
        started = time.perf_counter()
        try:
            compiled = hand_plans.compile_plan(plan, mesh, step, state_spec, batch_spec)
        except Exception as exc:  # a plan libtpu cannot compile is a result too
            out["hand"][plan.name] = {"error": str(exc).splitlines()[0][:300]}
            continue
        out["hand"][plan.name] = formula(compiled, mesh_axes, comm)
        out["hand"][plan.name]["compile_s"] = time.perf_counter() - started
        row = out["hand"][plan.name]
        print(f"  {plan.name}: compiled in {row['compile_s']:.0f} s, libtpu peak "
              f"{row['peak_bytes'] / 2**30:.2f} GiB, step {row['step_s'] * 1e3:.1f} ms",
              flush=True)
    fitting = {k: v["step_s"] for k, v in out["hand"].items() if v.get("fits")}
    best = min(fitting, key=fitting.get) if fitting else None
    out["best_hand"] = best
    out["vs_best_hand"] = ours["step_s"] / fitting[best] if best else None
    return out


def _load(path: Path) -> dict:
    if path.exists():
        return json.loads(path.read_text())
    return {"cases": {}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default=",".join(DEFAULT_CASES))
    parser.add_argument("--llama8b", type=int, metavar="LAYERS",
                        help="run the Llama-8B-class case with this many layers instead")
    parser.add_argument("--hand", default="fsdp,fsdp_tp",
                        help="--llama8b: the hand plans to compile too (comma-separated; '' none)")
    parser.add_argument("--dump", metavar="DIR",
                        help="--llama8b: keep libtpu's dump of hloplan's compile in DIR")
    parser.add_argument("--output", default=str(RESULTS))
    args = parser.parse_args()
    path = Path(args.output)
    results = _load(path)  # cases run separately add up in one file
    if args.llama8b:
        started = time.perf_counter()
        try:
            row = run_llama8b(args.llama8b, hand=tuple(filter(None, args.hand.split(","))),
                              dump=Path(args.dump) if args.dump else None)
        except Exception:
            row = {"error": traceback.format_exc().strip().splitlines()[-1]}
            print(f"llama8b: ERROR {row['error']}", flush=True)
        row["seconds"] = time.perf_counter() - started
        row["command"] = f"JAX_PLATFORMS=cpu .venv/bin/python benchmarks/tpu_memory.py --llama8b {args.llama8b}"
        results.setdefault("llama8b", {})[str(args.llama8b)] = row
        path.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
        return
    for case in args.cases.split(","):
        started = time.perf_counter()
        try:
            row = run_case(case)
        except Exception:  # a case that fails is reported, the others still run
            row = {"case": case, "error": traceback.format_exc().strip().splitlines()[-1]}
        row["seconds"] = time.perf_counter() - started
        row["command"] = f"JAX_PLATFORMS=cpu .venv/bin/python benchmarks/tpu_memory.py --cases {case}"
        results["cases"][case] = row
        if "error" in row:
            print(f"{case}: ERROR {row['error']}", flush=True)
        else:
            print(f"{case}: predicted {row['predicted_bytes'] / 2**30:.2f} GiB, libtpu "
                  f"{row['peak_bytes'] / 2**30:.2f} GiB (arg + out + temp - alias; "
                  f"reserved {row['reserved_bytes'] / 2**30:.2f}; "
                  f"peak_memory_in_bytes {row['xla_peak_bytes'] / 2**30:.2f}): "
                  f"{row['ratio']:.3f} / {row['ratio_reserved']:.3f} / {row['ratio_xla']:.3f}; "
                  f"without [buffers] "
                  f"{row['without_buffers']['ratio']:.3f}; {row['seconds']:.0f} s", flush=True)
            ratios = row["collectives"]["collective_ratios"]
            off = {k: v and round(v, 3) for k, v in ratios.items() if v is None or abs(v - 1) > 0.05}
            print(f"  collectives predicted / compiled: "
                  f"{row['collectives']['collective_bytes_ratio'] or 0:.3f} in all, "
                  f"{len(ratios) - len(off)} of {len(ratios)} kinds within 5%; off: {off}",
                  flush=True)
        path.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
