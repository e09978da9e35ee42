"""TPU section of the benchmarks: plans compiled by XLA's TPU compiler (libtpu, deviceless).

    .venv/bin/python benchmarks/tpu.py                      # ~11 min on 2 CPU cores
    .venv/bin/python benchmarks/tpu.py --cases gpt:v5e:2x4  # one case

Needs libtpu (`pip install -e ".[tpu]"`). For each case (a benchmark program of models.py at a
modest size, exported for the tpu platform, on a TPU v5e topology):

- hloplan plans it (`--device tpu-v5e`: the device model of the topology's kind; the
  topology's mesh) and the plan's own loader compiles it for the topology
  (`loader.load(plan, devices=topology devices).compile_abstract()`);
- the hand plans of hand_plans.py (DP, FSDP, Megatron TP + DP, FSDP + TP, expert parallel for
  the MoE) are compiled by jax.jit for the same devices;
- every compiled program is scored by one formula on its TPU-compiled per-device HLO, with
  the constants measured on a v5e chip (benchmarks/tpu-v5e-calibrated.toml):

      step = max(kernel roofline, FLOPs per device / f32 matmul rate)
             + sum over collectives (per step) of latency_steps * latency + bytes / bandwidth

  the kernel roofline summing, over the compiled kernels (fusions), each one's FLOPs at the
  matmul rate or its HBM bytes at the chip's measured HBM bandwidth, whichever takes longer
  (hlo_stats.kernel_stats: it counts memory-bound work such as optimizer updates); tpu-v5e's
  ICI figures for the mesh axes a collective spans (latency_steps 2(n-1) for all-reduce, n-1
  for the other kinds, 1 for a collective-permute); a plan fits when libtpu's peak per device
  is within the chip's 16 GiB;
- hloplan's predictions are set beside what libtpu compiled of its plan: peak per device and
  collective bytes per kind and mesh axes;
- hloplan also plans with `--select compiled` (its own plan, data parallel, FSDP and the plan
  counting collective-matmul loops' sends in full, compiled by libtpu, the lowest compiled
  score kept), scored the same way.

Writes benchmarks/tpu_results.json (docs/tpu.md shows the figures).

    .venv/bin/python benchmarks/tpu.py --corpus     # third-party programs, 30 to 120 s each
    .venv/bin/python benchmarks/tpu.py --corpus --topology v5e:4x8   # 30 to 190 s each

plans programs of the third-party corpus (examples/third_party/corpus.py at realistic widths,
2 layers, 2 sequences of 128 tokens per device, resnet and vit 8 images per device: the batch grows
with the topology; exported for tpu) for the topology's kind (tpu-v5e, tpu-v6e, tpu-v5p) on
its mesh (v5e:2x4 unless `--topology` says) and sets the plan's predicted collectives beside
what libtpu compiled of it (hloplan.verify.verify_plan, as `hloplan verify PLAN --compiler tpu`):
benchmarks/tpu_corpus_results.json, the rows of v5e:2x4 under "programs" and those of other
topologies under "topologies"; a run replaces only the rows it measures. `--keep-plans DIR`
keeps each plan in DIR/PROGRAM (`hloplan verify DIR/PROGRAM` compiles it again).

    .venv/bin/python benchmarks/tpu.py --corpus --corpus-size realistic --topology v5e:4x8

does the same at the sizes users train at (CORPUS_REALISTIC_SIZES: 8 sequences of 512 tokens
per device, 4 layers, resnet and vit 32 images per device; a batch that does not fit a v5e device is
halved, down to 2 sequences, and the row says which did not fit): rows under
"realistic" -> topology of tpu_corpus_results.json.
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
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import NamedTuple  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

RESULTS = HERE / "tpu_results.json"
FORMULA_DEVICE = HERE / "tpu-v5e-calibrated.toml"  # the f32 rate measured on the chip
CORPUS_RESULTS = HERE / "tpu_corpus_results.json"
CORPUS_PROGRAMS = ["hf_gpt2", "hf_bert", "hf_llama", "hf_bart", "haiku_transformer",
                   "linen_resnet", "keras_gemma", "keras_moe", "hf_vit", "nnx_transformer"]
# Realistic widths (the corpus's size="real"), shallow and a few sequences per device, like
# config(): libtpu compiles each in seconds on v5e:2x4; the tiny sizes plan pure data
# parallelism. `batch` is per device: the program grows with the topology.
CORPUS_SIZES = {"*": dict(size="real", batch=2, seq=128, layers=2),
                "linen_resnet": dict(size="real", batch=8),
                "hf_vit": dict(size="real", batch=8, layers=2)}
# The sizes users train at (those of benchmarks/corpus.py --bench, which cannot be imported
# here: it sets XLA_FLAGS for simulated devices): 8 sequences of 512 tokens per device,
# 4 layers, resnet and vit 32 images per device. Where that does not fit a device's memory, the batch
# per device is halved, at most CORPUS_HALVINGS times (8, 4, 2 sequences).
CORPUS_REALISTIC_SIZES = {"*": dict(size="real", batch=8, seq=512, layers=4),
                          "linen_resnet": dict(size="real", batch=32),
                          "hf_vit": dict(size="real", batch=32, layers=4)}
CORPUS_SIZE_TABLES = {"small": CORPUS_SIZES, "realistic": CORPUS_REALISTIC_SIZES}
CORPUS_HALVINGS = {"small": 0, "realistic": 2}
CORPUS_TOPOLOGY = "v5e:2x4"  # the rows under "programs" of tpu_corpus_results.json
DEFAULT_CASES = ["mlp:v5e:2x4", "gpt:v5e:2x4", "llama:v5e:2x4", "bert:v5e:2x4", "moe:v5e:2x4",
                 "resnet:v5e:2x4", "mlp:v5e:4x8", "gpt:v5e:4x8"]


def config(model: str, devices: int) -> dict:
    """Modest sizes (the realistic benchmarks at 1/4 to 1/8 of their width and a few sequences
    per device): libtpu compiles each plan in seconds to tens of seconds on a shared 2-core
    machine; the realistic sizes take minutes each."""
    return {
        "gpt": dict(vocab=2048, seq=128, d=256, heads=8, layers=2, batch=2 * devices),
        "llama": dict(vocab=2048, seq=128, d=256, heads=8, kv_heads=4, ffn=704, layers=2,
                      batch=2 * devices),
        "bert": dict(vocab=2048, seq=128, d=256, heads=8, layers=2, batch=2 * devices),
        "moe": dict(d=256, ffn=1024, experts=8, layers=2, batch=2 * devices, seq=128,
                    capacity_factor=1.25),
        "resnet": dict(image=16, channels=(32, 64), blocks=1, classes=64, batch=4 * devices),
        "mlp": dict(sizes=(512, 2048, 2048, 512), batch=64 * devices),
    }[model]


def formula(compiled, mesh_axes, comm) -> dict:
    """The score of one compiled program (module docstring): hloplan.score.compiled_score, the
    one implementation `hloplan compile --select compiled` ranks plans by."""
    from hloplan.score import compiled_score

    return compiled_score(compiled, mesh_axes, comm)


class TopologyMesh(NamedTuple):
    """A TPU topology's compile-only devices as the benchmarks use them: a jax Mesh with axes
    x, y(, z), hloplan's mesh text, the (name, size) axes and the formula's CommModel."""

    topology: object
    devices: list
    mesh: object
    mesh_text: str
    mesh_axes: tuple
    comm: object


def topology_mesh(topology_name: str) -> TopologyMesh:
    import numpy as np
    from jax.sharding import AxisType, Mesh

    from hloplan.cost_models import CommModel, load_device_model
    from hloplan.mesh import parse_mesh
    from hloplan.tpu import parse_topology, topology_devices

    topology = parse_topology(topology_name)
    shape = topology.shape
    devices = topology_devices(topology)
    mesh_text = "x".join(map(str, shape))
    names = ("x", "y", "z")[: len(shape)]
    mesh = Mesh(np.array(devices).reshape(shape), names, axis_types=(AxisType.Auto,) * len(shape))
    comm = CommModel(load_device_model(FORMULA_DEVICE), parse_mesh(mesh_text))
    return TopologyMesh(topology, devices, mesh, mesh_text, tuple(zip(names, shape)), comm)


def predicted_collectives(estimate: dict) -> dict:
    """plan.json's estimate as `formula` reports a compiled program: peak, step, and the
    collectives summed per kind and mesh axes."""
    predicted: dict[str, dict] = {}
    for c in estimate["collectives"]:
        slot = predicted.setdefault(f"{c['kind']}({c.get('axes') or '?'})",
                                    {"count": 0, "bytes": 0.0})
        slot["count"] += c["count"]
        slot["bytes"] += c["bytes"]
    return {"peak_bytes": estimate["peak_memory_bytes"], "step_s": estimate["step_time_s"],
            "collectives": predicted,
            "collective_bytes": sum(v["bytes"] for v in predicted.values())}


def collective_ratios(predicted: dict, compiled: dict) -> dict:
    """Predicted / compiled collective bytes per kind and mesh axes (None where libtpu compiled
    none of a kind) and in all: `predicted` is predicted_collectives' result, `compiled` the
    formula's `collectives`."""
    kinds = predicted["collectives"]
    compiled_bytes = sum(v["bytes"] for v in compiled.values())
    return {
        "collective_ratios": {
            k: (kinds.get(k, {}).get("bytes", 0.0) / compiled[k]["bytes"]
                if compiled.get(k, {}).get("bytes") else None)
            for k in sorted(set(kinds) | set(compiled))},
        "collective_bytes_ratio": (predicted["collective_bytes"] / compiled_bytes
                                   if compiled_bytes else None)}


def bytes_ratios(table: dict[str, dict]) -> float | None:
    """Sets each slot's predicted / compiled bytes ("ratio"; None where nothing was compiled)
    of a {kind(axes): {"predicted", "compiled"}} table; returns the ratio of all bytes."""
    for slot in table.values():
        slot["ratio"] = slot["predicted"] / slot["compiled"] if slot["compiled"] else None
    compiled = sum(v["compiled"] for v in table.values())
    return sum(v["predicted"] for v in table.values()) / compiled if compiled else None


def best_hand(hand: dict) -> tuple[str | None, float | None]:
    """(name, step) of the fastest hand plan whose compiled peak fits the device, or (None,
    None) where none does; `hand` maps names to formula() results."""
    fitting = {k: v["step_s"] for k, v in hand.items() if v["fits"]}
    best = min(fitting, key=fitting.get) if fitting else None
    return best, fitting.get(best)


def run_case(case: str) -> dict:
    import hand_plans
    import jax
    import models
    from jax import export

    from hloplan.compiler import compile_bytes, make_options
    from hloplan.emit.loader import load

    name, kind, shape_text = case.split(":")
    topology, devices, mesh, mesh_text, mesh_axes, comm = topology_mesh(f"{kind}:{shape_text}")
    shape = topology.shape
    entry = models.MODELS[name]
    cfg = config(name, topology.devices)
    state_spec, batch_spec, step = entry.state_spec(cfg), entry.batch_spec(cfg), entry.make_step(cfg)
    out: dict = {"case": case, "model": name, "topology": topology.name, "config": cfg,
                 "hand": {}}
    for plan in hand_plans.plans_for(name, shape):
        if plan.name == "replicated":
            continue
        started = time.perf_counter()
        compiled = hand_plans.compile_plan(plan, mesh, step, state_spec, batch_spec)
        out["hand"][plan.name] = formula(compiled, mesh_axes, comm)
        out["hand"][plan.name]["compile_s"] = time.perf_counter() - started
    exported = export.export(jax.jit(step, donate_argnums=(0,)), platforms=("tpu",))(
        models.abstract(state_spec), models.abstract(batch_spec))
    data = bytes(exported.serialize())
    started = time.perf_counter()
    result = compile_bytes(data, f"{name}.jaxexport",
                           make_options(mesh_text, device=device_model_for(topology),
                                        mesh_views="off"))
    plan_s = time.perf_counter() - started
    plan = result.plan
    with tempfile.TemporaryDirectory() as tmp:
        result.write(Path(tmp) / "plan")
        started = time.perf_counter()
        compiled = load(Path(tmp) / "plan", devices=devices).compile_abstract()
        compile_s = time.perf_counter() - started
    ours = formula(compiled, mesh_axes, comm)
    ours.update(plan_s=plan_s, compile_s=compile_s)
    est = plan["estimate"]
    ours["predicted"] = predicted_collectives(est)
    ours["peak_ratio"] = est["peak_memory_bytes"] / ours["peak_bytes"]
    ours.update(collective_ratios(ours["predicted"], ours["collectives"]))
    out["hloplan"] = ours
    # `--select compiled`: the model's plan, data parallel, FSDP and the plan counting loop
    # sends in full, compiled by libtpu, the lowest compiled score kept; scored here as every
    # other plan.
    started = time.perf_counter()
    selected = compile_bytes(data, f"{name}.jaxexport",
                             make_options(mesh_text, device=device_model_for(topology),
                                          mesh_views="off", select="compiled"))
    select_s = time.perf_counter() - started
    with tempfile.TemporaryDirectory() as tmp:
        selected.write(Path(tmp) / "plan")
        compiled = load(Path(tmp) / "plan", devices=devices).compile_abstract()
    chosen = formula(compiled, mesh_axes, comm)
    chosen.pop("memory")
    chosen.update(plan_s=select_s, selection=selected.plan["selection"])
    out["hloplan_selected"] = chosen
    best, best_s = best_hand(out["hand"])
    out["best_hand"] = best
    out["vs_best_hand"] = ours["step_s"] / best_s if best else None
    out["selected_vs_best_hand"] = chosen["step_s"] / best_s if best else None
    return out


def corpus_sizes(name: str, devices: int, size: str = "small") -> dict:
    """corpus.py's build arguments of a program for `devices` devices (CORPUS_SIZE_TABLES)."""
    table = CORPUS_SIZE_TABLES[size]
    sizes = dict(table.get(name, table["*"]))
    sizes["batch"] *= devices
    return sizes


def corpus_size_candidates(name: str, devices: int, size: str = "small") -> list[dict]:
    """The build arguments to try, largest first: the size's, then its batch per device halved
    (CORPUS_HALVINGS) for programs that do not fit a device at the full batch."""
    sizes = corpus_sizes(name, devices, size)
    return [dict(sizes, batch=sizes["batch"] >> k) for k in range(CORPUS_HALVINGS[size] + 1)
            if sizes["batch"] >> k >= devices]


def does_not_fit(error: Exception) -> bool:
    """Whether planning or libtpu failed for want of device memory (hloplan found no plan
    within the budget, or libtpu ran out of HBM), rather than for another reason."""
    from hloplan.diagnostics import NoPlanFits

    text = str(error)
    return isinstance(error, NoPlanFits) or "RESOURCE_EXHAUSTED" in text or \
        "ran out of memory" in text.lower()


def device_model_for(topology) -> str:
    """The shipped device model of the topology's TPU kind (tpu-v5e, tpu-v6e, tpu-v5p)."""
    return f"tpu-{topology.kind.name}"


def corpus_case(name: str, topology_name: str = CORPUS_TOPOLOGY,
                keep: Path | None = None, size: str = "small", hand: bool = False) -> dict:
    """A corpus program planned for the topology's TPU kind (device_model_for) on its mesh and
    verified by libtpu:
    predicted and compiled collectives per kind and mesh axes (bytes per device per step) and
    peak per device. With `keep`, the plan is written there (and kept). A batch that does not
    fit the device (does_not_fit, or libtpu's peak over its memory) is retried halved where
    the size allows (corpus_size_candidates); the row says which batches did not fit. With
    `hand`, the plan quality as well (corpus_plan_quality)."""
    from hloplan.cost_models import load_device_model
    from hloplan.tpu import parse_topology

    topology = parse_topology(topology_name)
    capacity = load_device_model(device_model_for(topology)).memory_bytes
    candidates = corpus_size_candidates(name, topology.devices, size)
    too_big: list[dict] = []
    for i, sizes in enumerate(candidates):
        last = i == len(candidates) - 1
        try:
            row = _corpus_case_at(name, topology, sizes, keep, hand)
        except Exception as error:
            if last or not does_not_fit(error):
                raise
            too_big.append({"sizes": sizes, "why": str(error).strip().splitlines()[-1][:300]})
            continue
        if row["peak_bytes"]["compiled"] > capacity and not last:
            too_big.append({"sizes": sizes, "why": f"libtpu's peak per device "
                            f"{row['peak_bytes']['compiled']:.0f} B is over {capacity:.0f} B"})
            continue
        if too_big:
            row["did_not_fit"] = too_big
        return row
    raise AssertionError("unreachable: the last candidate returns or raises")


def corpus_export(name: str, sizes: dict) -> tuple[bytes, tuple[int, ...], str]:
    """(serialized jax.export for the tpu platform, donated argument numbers, library) of the
    corpus program `name` built at `sizes`."""
    sys.path.insert(0, str(HERE.parent / "examples" / "third_party"))
    import _common
    import corpus

    program = corpus.BY_NAME[name]
    step, args = program.build(**sizes)
    return (_common.export_step(step, args, platforms=("tpu",)),
            _common.donated_argnums(step, args), program.library)


def _corpus_case_at(name: str, topology, sizes: dict, keep: Path | None,
                    hand: bool = False) -> dict:
    data, donated, library = corpus_export(name, sizes)
    return corpus_row(name, library, topology, sizes, data, donated, keep, hand)


def corpus_row(name: str, library: str, topology, sizes: dict, data: bytes,
               donated: tuple[int, ...], keep: Path | None, hand: bool = False) -> dict:
    """The row of one exported corpus program (corpus_export) on the topology: planned,
    verified by libtpu and, with `hand`, set beside the hand plans."""
    from hloplan.compiler import compile_bytes, make_options
    from hloplan.verify import verify_plan

    mesh_text = "x".join(map(str, topology.shape))
    started = time.perf_counter()
    result = compile_bytes(data, f"{name}.jaxexport",
                           make_options(mesh_text, device=device_model_for(topology),
                                        mesh_views="off"))
    planning_s = time.perf_counter() - started
    with tempfile.TemporaryDirectory() as tmp:
        plan_dir = keep if keep is not None else Path(tmp) / "plan"
        result.write(plan_dir)
        report = verify_plan(plan_dir, compiler="tpu", topology=topology.name,
                             score_device=str(FORMULA_DEVICE))
    entry = report["programs"]["program"]
    table: dict[str, dict] = {}
    for side in ("predicted", "compiled"):
        for c in entry[side]["collectives"]:
            slot = table.setdefault(f"{c['kind']}({c['axes']})",
                                    {"predicted": 0.0, "compiled": 0.0})
            slot[side] += c["bytes"]
    total_ratio = bytes_ratios(table)
    solver = result.plan["solver"]
    score = entry["compiled"]["score"]
    quality = corpus_plan_quality(data, donated, topology.name, score, name) if hand \
        else {"hloplan_score": score}
    return {**quality, "program": name, "library": library, "topology": report["topology"],
            "sizes": sizes, "planning_s": planning_s,
            # A plan the time limit cut (a loaded machine) differs from the quiet one's.
            "solver": {"status": solver["status"], "deterministic": solver["deterministic"],
                       "step_s": result.plan["estimate"]["step_time_s"]},
            "collectives": table, "collective_bytes_ratio": total_ratio,
            "peak_ratio": entry["peak_ratio"],
            "peak_bytes": {"predicted": entry["predicted"]["peak_bytes"],
                           "compiled": entry["compiled"]["peak_bytes"]},
            "notes": report["notes"]}


def corpus_plan_quality(data: bytes, donated: tuple[int, ...], topology_name: str,
                        ours: dict, name: str) -> dict:
    """hloplan's plan (`ours`: its compiled score) against the hand plans
    (hand_plans.exported_plans): data parallel and FSDP, which a user writes for a program
    known only by its export, and Megatron TP + DP, FSDP + TP and expert parallel, which an
    expert writes for the model `name` (corpus_hand_rules.py); each compiled by libtpu for the
    topology and scored by the same formula."""
    import corpus_hand_rules
    import hand_plans
    import jax

    tm = topology_mesh(topology_name)
    exported = jax.export.deserialize(bytearray(data))
    donated = tuple(donated)
    hand: dict[str, dict] = {}
    plans = hand_plans.exported_plans(exported, donated, tm.mesh,
                                      corpus_hand_rules.TENSOR_DIMS.get(name),
                                      corpus_hand_rules.EXPERT_DIMS.get(name))
    for plan, shardings in plans.items():
        started = time.perf_counter()
        try:
            compiled = hand_plans.compile_exported_plan(exported, donated, shardings)
        except Exception as error:
            if not does_not_fit(error):
                raise
            hand[plan] = {"fits": False, "why": str(error).strip().splitlines()[-1][:300]}
            continue
        hand[plan] = formula(compiled, tm.mesh_axes, tm.comm)
        hand[plan].pop("memory")
        hand[plan]["compile_s"] = time.perf_counter() - started
    best, best_s = best_hand(hand)
    return {"hand": hand, "hloplan_score": ours, "best_hand": best,
            "vs_best_hand": ours["step_s"] / best_s if best else None}


def corpus_main(names: list[str], output: str, topology_name: str = CORPUS_TOPOLOGY,
                keep: Path | None = None, size: str = "small", hand: bool = False) -> None:
    """Measures `names` on the topology and writes their rows into `output`, keeping the rows
    it does not measure (those of other programs, topologies and sizes): the small size's
    under "programs" (v5e:2x4) and "topologies", the realistic size's under "realistic"."""
    command = "JAX_PLATFORMS=cpu .venv/bin/python benchmarks/tpu.py --corpus" + (
        f" --corpus-size {size}" if size != "small" else "") + (
        f" --topology {topology_name}" if topology_name != CORPUS_TOPOLOGY or size != "small"
        else "") + (" --corpus-hand" if hand else "")
    path = Path(output)
    results = json.loads(path.read_text()) if path.exists() else {}
    if size != "small":
        section = results.setdefault(size, {}).setdefault(topology_name, {})
    elif topology_name == CORPUS_TOPOLOGY:
        section = results
    else:
        section = results.setdefault("topologies", {}).setdefault(topology_name, {})
    section["command"] = command
    section.setdefault("programs", {})
    for name in names:
        started = time.perf_counter()
        try:
            row = corpus_case(name, topology_name, keep / name if keep else None, size, hand)
        except Exception:  # reported; the others still run
            row = {"program": name, "error": traceback.format_exc().strip().splitlines()[-1]}
        row["seconds"] = time.perf_counter() - started
        section["programs"][name] = row
        if "error" in row:
            print(f"{name}: ERROR {row['error']}", flush=True)
        else:
            off = {k: round(v["ratio"], 3) if v["ratio"] is not None else None
                   for k, v in row["collectives"].items()
                   if v["ratio"] is None or abs(v["ratio"] - 1) > 0.05}
            print(f"{name} on {topology_name}: collective bytes predicted / compiled "
                  f"{row['collective_bytes_ratio'] or 0:.3f}; off by more than 5%: {off}; "
                  f"peak predicted / compiled {row['peak_ratio'] or 0:.3f}; batch "
                  f"{row['sizes']['batch']}; {row['seconds']:.0f} s" + (
                      f"; hloplan / best hand ({row['best_hand']}) {row['vs_best_hand']:.3f}"
                      if row.get("vs_best_hand") else ""), flush=True)
        path.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default=",".join(DEFAULT_CASES))
    parser.add_argument("--output", default=None)
    parser.add_argument("--corpus", nargs="?", const=",".join(CORPUS_PROGRAMS), default=None,
                        help="third-party corpus programs (comma-separated; default: all)")
    parser.add_argument("--topology", default=CORPUS_TOPOLOGY,
                        help="--corpus: the TPU topology (KIND:SHAPE) to plan and compile for")
    parser.add_argument("--corpus-size", choices=sorted(CORPUS_SIZE_TABLES), default="small",
                        help="--corpus: small (2 sequences of 128 tokens per device, 2 layers) "
                        "or realistic (8 sequences of 512 tokens per device, 4 layers; the "
                        "batch halved, down to 2, where it does not fit)")
    parser.add_argument("--keep-plans", metavar="DIR",
                        help="--corpus: write each program's plan to DIR/PROGRAM and keep it")
    parser.add_argument("--corpus-hand", action="store_true",
                        help="--corpus: also compile the hand plans (data parallel and FSDP; "
                        "Megatron TP + DP, FSDP + TP and expert parallel by "
                        "corpus_hand_rules.py) and score every plan by the formula")
    args = parser.parse_args()
    if args.corpus is not None:
        corpus_main(args.corpus.split(","), args.output or str(CORPUS_RESULTS), args.topology,
                    Path(args.keep_plans) if args.keep_plans else None, args.corpus_size,
                    args.corpus_hand)
        return
    args.output = args.output or str(RESULTS)
    results = {"command": "JAX_PLATFORMS=cpu .venv/bin/python benchmarks/tpu.py"
               + (f" --cases {args.cases}" if args.cases != ",".join(DEFAULT_CASES) else ""),
               "formula_device": FORMULA_DEVICE.name, "cases": {}}
    for case in args.cases.split(","):
        started = time.perf_counter()
        try:
            row = run_case(case)
        except Exception:  # a case that fails is reported, the others still run
            row = {"case": case, "error": traceback.format_exc().strip().splitlines()[-1]}
        row["seconds"] = time.perf_counter() - started
        results["cases"][case] = row
        if "error" in row:
            print(f"{case}: ERROR {row['error']}", flush=True)
        else:
            h = row["hloplan"]
            print(f"{case}: hloplan / best hand ({row['best_hand']}) {row['vs_best_hand']:.3f}"
                  f" (--select compiled: {row['hloplan_selected']['selection']['chosen']}, "
                  f"{row['selected_vs_best_hand']:.3f}); "
                  f"peak predicted / compiled {h['peak_ratio']:.2f}; collective bytes "
                  f"predicted / compiled {h['collective_bytes_ratio'] or 0:.2f}; "
                  f"{row['seconds']:.0f} s", flush=True)
        Path(args.output).write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
