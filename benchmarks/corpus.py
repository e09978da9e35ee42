"""The third-party corpus (examples/third_party/corpus.py): what hloplan does with each program,
and plan quality at realistic sizes.

    .venv/bin/python benchmarks/corpus.py --report   # tiny programs on 8 simulated CPU devices
    .venv/bin/python benchmarks/corpus.py --bench    # realistic sizes, compile-only
    .venv/bin/python benchmarks/corpus.py --docs     # docs/third-party.md from the two JSONs

--report exports each program at its tiny size and, on meshes 8, 2x4 and 2x2x2, plans it
(hloplan.compile), runs the plan (hloplan.load) and compares with the single-device program;
where the batch splits, also 2 stages x 4 microbatches (GPipe and 1F1B) and the memory-budget
fallback to gradient accumulation. Writes benchmarks/corpus_report.json.

--bench exports the train steps at realistic sizes (parameters as jax.ShapeDtypeStruct where
the library allows) and, on a 2x4 mesh of simulated devices, scores hloplan's plan and the hand
plans of benchmarks/third_party.py (DP, FSDP, TP+DP, FSDP+TP; tensor parallel by parameter
name, Megatron-style) under
benchmarks/run.py's formula (H100 device model, compiled per-device HLO). Writes
benchmarks/corpus_results.json.

--docs renders both into docs/third-party.md.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import tempfile
import time
import traceback
from pathlib import Path

import run  # sets XLA_FLAGS (simulated devices, LLVM -O0) before jax is imported
import third_party

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "examples" / "third_party"))

import corpus  # noqa: E402

REPORT_JSON = HERE / "corpus_report.json"
BENCH_JSON = HERE / "corpus_results.json"
DOC = ROOT / "docs" / "third-party.md"
MESHES = ("8", "2x4", "2x2x2")
SCHEDULES = ("gpipe", "1f1b")
TIME_LIMIT = 5.0
BENCH_MESH = "2x4"
# Realistic sizes: 8 sequences of 512 tokens per device (64 images per device for vision).
SEQUENCES_PER_DEVICE, SEQ, IMAGES_PER_DEVICE = 8, 512, 32
# Depth of the transformers at realistic widths: per-layer plans repeat, and four layers keep
# the XLA compiles of hloplan's plan and the hand plans within minutes on a shared machine.
BENCH_LAYERS = 4
# The hand plans of benchmarks/third_party.py without its `_gather` variants (same layouts).
BENCH_HAND_PLANS = ("dp", "fsdp", "tp_dp", "fsdp_tp")
BENCH_PROGRAMS = ("hf_gpt2", "hf_bert", "hf_llama", "hf_bart", "hf_vit", "haiku_transformer",
                  "linen_resnet", "keras_gemma")


# --------------------------------------------------------------------------- --report

def parameter_count(program, args) -> int:
    """Trainable parameters: the first argument of a (params, optimizer, inputs, targets) step
    or an inference function, the first state entry of a (state, data) step."""
    import jax

    params = args[0][0] if len(args) == 2 and program.kind == "train" else args[0]
    return sum(math.prod(x.shape) for x in jax.tree.leaves(params))


def _first_line(exc: Exception) -> str:
    """The first line of an error, file paths shown from site-packages or the repository."""
    text = str(exc).strip().splitlines()
    line = text[0] if text else type(exc).__name__
    line = re.sub(r"/\S*/site-packages/", "", line).replace(f"{ROOT}/", "")
    return line[:300]


def _checked(data, args, want, mesh, **options) -> dict:
    """Compile, run and compare one configuration; its compile seconds and verdict."""
    import jax
    import numpy as np

    import hloplan

    out: dict = {}
    with tempfile.TemporaryDirectory() as plan_dir:
        started = time.perf_counter()
        try:
            result = hloplan.compile(data, mesh, output=plan_dir, device="toy",
                                     time_limit=TIME_LIMIT, **options)
        except Exception as exc:  # a refusal or a crash is the result
            out.update(ok=False, compile_s=time.perf_counter() - started, error=_first_line(exc))
            return out
        out["compile_s"] = time.perf_counter() - started
        pipe = result.plan.get("pipeline") or {}
        if pipe:
            out["stages"], out["microbatches"] = pipe.get("stages"), pipe.get("microbatches")
        try:
            got = jax.device_get(hloplan.load(plan_dir)(*args))
            errors = [float(np.max(np.abs(np.asarray(g, np.float64) - np.asarray(w, np.float64))
                                   / (1e-5 + 2e-4 * np.abs(np.asarray(w, np.float64)))))
                      for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want))
                      if np.asarray(w).size]
            out["ok"] = max(errors, default=0.0) <= 1.0
            if not out["ok"]:
                out["error"] = "results differ from the single-device program"
        except Exception as exc:
            out.update(ok=False, error=_first_line(exc))
    return out


def _single_device(data: bytes, args):
    """The exported program run unsharded on one CPU device."""
    import jax
    import numpy as np

    exported = jax.export.deserialize(bytearray(data))
    device = jax.devices("cpu")[0]
    with jax.default_device(device):
        out = jax.jit(exported.call)(*jax.device_put(args, device))
    return jax.tree.map(np.asarray, out)


def report_program(program) -> dict:
    row: dict = {"program": program.name, "library": program.library, "kind": program.kind,
                 "no_split": program.no_split, "xfail": program.xfail}
    started = time.perf_counter()
    try:
        data, args = program.export()
    except Exception as exc:
        row["error"] = f"export: {_first_line(exc)}"
        return row
    row["export_s"] = time.perf_counter() - started
    row["parameters"] = parameter_count(program, args)
    want = _single_device(data, args)
    row["meshes"] = {mesh: _checked(data, args, want, mesh) for mesh in MESHES}
    from hloplan.compiler import PipelineOptions

    if program.no_split in (None, corpus.BATCH_STATISTICS) or program.kind == "inference":
        row["pipeline"] = {s: _checked(data, args, want, "8",
                                       pipeline=PipelineOptions(2, 4, s)) for s in SCHEDULES}
    if program.no_split is None and program.kind == "train":
        row["accumulation"] = _accumulation(program, data, args, want)
    print(json.dumps({k: v for k, v in row.items() if k != "library"}), flush=True)
    return row


def _accumulation(program, data, args, want) -> dict:
    try:
        budget = corpus.accumulation_budget(data, TIME_LIMIT)
    except Exception as exc:
        return {"ok": False, "error": _first_line(exc)}
    out = _checked(data, args, want, "8", memory_budget=budget)
    out["budget_bytes"] = budget
    if program.no_accumulation and not out["ok"]:
        out["error"] = f"{program.no_accumulation} ({out['error']})"
    return out


def run_report(names) -> dict:
    started = time.perf_counter()
    rows = [report_program(corpus.BY_NAME[n]) for n in names]
    return {"rows": rows, "meshes": list(MESHES), "wall_s": time.perf_counter() - started,
            "command": "benchmarks/corpus.py --report", "git": run.git_state()}


# --------------------------------------------------------------------------- --bench

# Tensor parallel by parameter name (Megatron): column-parallel projections split their output
# features, row-parallel ones their input features, embeddings their vocabulary rows.
COLUMN = ("query", "key", "value", "q_proj", "k_proj", "v_proj", "gate_proj", "up_proj",
          "fc1", "['intermediate']", "c_attn", "c_fc", "linear_0", "gate", "up", "w_gate",
          "w_up")
ROW = ("o_proj", "down_proj", "out_proj", "fc2", "['attention']['output']",
       "['output']['dense']", "c_proj", "linear_1", "down", "w_down", "linear'")
EMBEDDING = ("wte", "word_embeddings", "embed_tokens", "shared", "embeddings']['embedding",
             "embed'", "reversible_embedding")


def name_tp(names: list[tuple[str, tuple[int, ...]]]) -> dict[str, int]:
    """The dim each 2-D (or expert 3-D) weight splits over the model axis, by its path:
    Flax/haiku/keras kernels are (in, out); transformers' GPT-2 Conv1D kernels (out, in)."""
    out: dict[str, int] = {}
    for name, shape in names:
        lower = name.lower()
        if len(shape) not in (2, 3) or "norm" in lower or "ln_" in lower:
            continue
        gpt2_conv = "c_attn" in lower or "c_fc" in lower or "c_proj" in lower
        if any(f in lower for f in EMBEDDING) or "position" in lower or "wpe" in lower:
            if "position" not in lower and "wpe" not in lower:
                out[name] = 0
        elif any(f in lower for f in COLUMN):
            out[name] = len(shape) - (2 if gpt2_conv else 1)
        elif any(f in lower for f in ROW):
            out[name] = len(shape) - (1 if gpt2_conv else 2)
        elif "lm_head" in lower or "classifier" in lower:
            out[name] = len(shape) - 1
    return out


def _four_arguments(program, step, args):
    """A (state, data) step as (params, optimizer leaves, inputs, targets), the convention of
    benchmarks/third_party.py's hand plans."""
    if len(args) == 4:
        return step, args, None
    state, data = args
    step, args = third_party._keras_step(step, state, data)
    return step, args, third_party.keras_owners


def bench_program(name: str, mesh: str, workdir: str) -> dict:
    import hand_plans
    import jax

    program = corpus.BY_NAME[name]
    shape = run.mesh_shape(mesh)
    devices = math.prod(shape)
    comm = run.comm_model(mesh)
    started = time.perf_counter()
    case: dict = {"program": name, "library": program.library, "mesh": mesh}
    try:
        kwargs = {"size": "real"}
        if name == "linen_resnet":
            kwargs["batch"] = IMAGES_PER_DEVICE * devices
        elif name == "hf_vit":
            kwargs.update(batch=IMAGES_PER_DEVICE * devices, layers=BENCH_LAYERS)
        else:
            kwargs.update(batch=SEQUENCES_PER_DEVICE * devices, seq=SEQ, layers=BENCH_LAYERS)
        step, args = program.build(**kwargs)
        step, args, owners = _four_arguments(program, step, args)
        path = Path(workdir) / f"{name}.jaxexport"
        path.write_bytes(third_party._example("_common").export_step(step, args))
    except Exception as exc:
        case["error"] = f"export: {_first_line(exc)}"
        case["traceback"] = traceback.format_exc()[-2000:]
        return case
    case["export_s"] = time.perf_counter() - started
    case["parameters"] = sum(math.prod(s) for _, s in third_party.param_names(args[0]))
    leaves = jax.tree.leaves(args[2])
    case["batch"] = int(leaves[0].shape[0])
    hl, _ = run.plan_and_measure(path, mesh, Path(workdir) / f"plan_{name}", run.DEVICE, comm)
    case["hloplan"] = {k: hl[k] for k in ("step_s", "peak_bytes", "fits", "compile_s", "error")
                       if k in hl}
    jmesh = hand_plans.make_mesh(shape)
    mesh_axes = tuple(jmesh.shape.items())
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), args)
    hand = {}
    for plan in [p for p in third_party.plans_for(dict(jmesh.shape), name_tp)
                 if p in BENCH_HAND_PLANS]:
        try:
            compiled = third_party.compile_hand_plan(plan, jmesh, step, abstract, name_tp,
                                                     owners)
            measured = run.measure(compiled, mesh_axes, comm)
            hand[plan] = {k: measured[k] for k in ("step_s", "peak_bytes", "fits",
                                                   "step_hbm_s", "step_kernels_s")}
        except Exception as exc:  # a plan XLA cannot compile is a result too
            hand[plan] = {"error": _first_line(exc)}
    case["hand"] = hand
    if "error" not in hl:
        case.update(run.hand_ratios(hl, hand))
    case["wall_s"] = time.perf_counter() - started
    print(json.dumps({k: case.get(k) for k in ("program", "mesh", "parameters", "ratio",
                                                "best_hand", "wall_s")}), flush=True)
    return case


def run_bench(names, mesh: str) -> dict:
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="hloplan-corpus-") as workdir:
        cases = [bench_program(n, mesh, workdir) for n in names]
    return {"cases": cases, "mesh": mesh, "device_model": run.DEVICE,
            "formula": "as benchmarks/run.py", "wall_s": time.perf_counter() - started,
            "command": f"benchmarks/corpus.py --bench --mesh {mesh}", "git": run.git_state()}


# --------------------------------------------------------------------------- --docs

def _cell(entry: dict | None) -> str:
    if entry is None:
        return "-"
    if entry.get("ok"):
        return "yes"
    return "no: " + entry.get("error", "?").replace("|", "\\|")[:140]


def _millions(n) -> str:
    return "?" if n is None else f"{n / 1e6:.2f}M" if n >= 1e5 else f"{n / 1e3:.1f}k"


def report_table(report: dict) -> list[str]:
    lines = ["| program | library | kind | params | compiled, ran and matched on | "
             "pipeline 2 stages x 4 microbatches (GPipe, 1F1B) | accumulation fallback | "
             "compile s (8, 2x4, 2x2x2) |", "|---|---|---|---|---|---|---|---|"]
    for row in report["rows"]:
        if "error" in row:
            lines.append(f"| {row['program']} | {row['library']} | {row['kind']} | | "
                         f"{row['error']} | | | |")
            continue
        meshes = row["meshes"]
        passed = [m for m in MESHES if meshes[m].get("ok")]
        failed = [f"{m} ({meshes[m].get('error', '?')[:100]})" for m in MESHES
                  if not meshes[m].get("ok")]
        compiled = ", ".join(passed) or "none"
        compiled += "; failed: " + "; ".join(failed) if failed else ""
        pipe = row.get("pipeline")
        if pipe is None:
            pipe_cell = f"not applicable: {row['no_split']}"
        elif all(p.get("ok") for p in pipe.values()):
            pipe_cell = "yes, both"
        elif row["kind"] == "inference":
            pipe_cell = "no: " + pipe["1f1b"].get("error", "")[:160]
        elif row.get("no_split"):
            pipe_cell = f"refused ({row['no_split']}): " + pipe["1f1b"].get("error", "")[:160]
        else:
            pipe_cell = "; ".join(f"{s}: {_cell(p)}" for s, p in pipe.items())
        acc = row.get("accumulation")
        if acc is None:
            acc_cell = "not applicable: " + (row["no_split"] or "inference (no gradients)")
        else:
            acc_cell = _cell(acc) + (f" ({acc['microbatches']} microbatches)"
                                     if acc.get("ok") else "")
        seconds = ", ".join(f"{meshes[m]['compile_s']:.1f}" for m in MESHES)
        if row.get("xfail"):
            compiled += f" (known: {row['xfail']})"
        lines.append(f"| {row['program']} | {row['library']} | {row['kind']} | "
                     f"{_millions(row['parameters'])} | {compiled} | {pipe_cell} | {acc_cell} | "
                     f"{seconds} |")
    return lines


def bench_table(bench: dict) -> list[str]:
    plans = BENCH_HAND_PLANS
    lines = ["| program | params | batch | hloplan step (ms) | " + " | ".join(plans)
             + " | ratio (best hand plan) | hloplan compile s |",
             "|---|---|---|---|" + "---|" * len(plans) + "---|---|"]
    for c in bench["cases"]:
        if "error" in c:
            lines.append(f"| {c['program']} | | | error: {c['error'][:120]} |"
                         + " |" * (len(plans) + 2))
            continue
        hl = c["hloplan"]
        cells = [third_party.hand_cell(c["hand"].get(plan), digits=1) for plan in plans]
        step = ("error: " + " ".join(hl["error"].split())[:100]) if "error" in hl else \
            f"{hl['step_s'] * 1e3:.1f}" + ("" if hl.get("fits", True) else " (OOM)")
        ratio = "-" if c.get("ratio") is None else f"{c['ratio']:.3f} ({c.get('best_hand')})"
        compile_s = f"{hl['compile_s']:.1f}" if "compile_s" in hl else "-"
        lines.append(f"| {c['program']} | {_millions(c['parameters'])} | {c['batch']} | {step} | "
                     + " | ".join(cells) + f" | {ratio} | {compile_s} |")
    return lines


def write_docs() -> None:
    report = json.loads(REPORT_JSON.read_text()) if REPORT_JSON.exists() else None
    bench = json.loads(BENCH_JSON.read_text()) if BENCH_JSON.exists() else None
    text = [
        "# Programs from other libraries",
        "",
        "hloplan plans programs as their users write them. The corpus "
        "(`examples/third_party/corpus.py`) holds train steps and inference functions written "
        "with Hugging Face transformers (Flax), Flax (NNX and Linen), Equinox, Haiku and "
        "Keras 3 (JAX backend), with optax, each exported with `jax.export` the way its "
        "library's own examples train it. `tests/third_party/test_corpus.py` checks them at "
        "the tiny sizes below, each plan run and compared with the single-device program: "
        "every program on meshes 8, 2x4 and 2x2x2; pipelines (GPipe, 1F1B) and the "
        "gradient-accumulation fallback; recomputation under a tight budget (haiku_resnet, "
        "whose BatchNorm rules accumulation out); `hloplan explain` (its decisions' costs "
        "checked against the independent evaluator, its `--format jax` shardings run); "
        "`--select compiled --verify-memory`; two-process jobs (`hloplan run --processes "
        "2`). CI runs a subset of each; `--runslow` runs all.",
        "",
        "This page is written by `benchmarks/corpus.py --docs` from "
        "`benchmarks/corpus_report.json` and `benchmarks/corpus_results.json`; do not edit "
        "it by hand.",
        "",
        "## What hloplan does with each program (tiny sizes, 8 simulated CPU devices)",
        "",
    ]
    if report:
        text += [f"`{report['command']}` ({report['wall_s'] / 60:.1f} min). Compiled, ran and "
                 "matched: planned with `hloplan.compile(..., device=\"toy\")`, run with "
                 "`hloplan.load`, every output within rtol 2e-4 / atol 2e-5 of the "
                 "single-device program. The accumulation fallback is asked for with a memory "
                 "budget 5% below the smallest peak of any single-program plan.", ""]
        text += report_table(report)
    text += ["", "### Splitting the batch of a program one did not write", "",
             "Pipelines and gradient accumulation run the per-example part of the step once per "
             "microbatch, so hloplan must know which values slice like the batch. It labels the "
             "batch inputs (or the `--batch-arg`s) and follows the batch dimension through each "
             "op's factor rule. Libraries also make batch-shaped values without batch data: "
             "`jnp.ones_like(input_ids)` attention masks, position ids broadcast from an iota "
             "over the sequence, the position embeddings gathered with them, biases broadcast "
             "to every example. Such a value is labelled as the batch when it is the same at "
             "every position along its batch dimension: a splat constant, an iota over another "
             "dimension, a broadcast that adds the dimension, or any op whose rule passes the "
             "dimension through from operands that are themselves the same along it; made at "
             "the microbatch's size by the same ops, it is then every microbatch's slice. A "
             "value that differs from example to example without coming from the batch (an "
             "iota over the batch, rows sliced from a parameter, random bits) is refused at "
             "its op, as are batch statistics (BatchNorm in training mode): microbatching "
             "would change the result.", ""]
    text += ["keras-hub (the library's Gemma and Mixtral models) needs tensorflow-text and "
             "so tensorflow, even on the JAX backend; the Keras programs here are written with "
             "`keras.layers` and `keras.ops` instead. T5 in transformers 4.57 calls "
             "`jnp.clip(a_max=...)`, which jax 0.10 removed, so the encoder-decoder is BART.",
             "", "## Plan quality at realistic sizes (compile-only)", "",
             "On TPU v5e, the same programs at the same sizes planned for tpu-v5e and compiled "
             "by libtpu\nfor v5e:2x4, 4x8 and 16x16 beside data parallel, FSDP and the Megatron "
             "and expert-parallel\nplans an expert writes for each model: "
             "[docs/tpu.md](tpu.md#third-party-programs-plan-quality).", ""]
    if bench:
        text += [f"`{bench['command']}` ({bench['wall_s'] / 60:.1f} min): the train steps at "
                 f"realistic widths ({BENCH_LAYERS} layers of each transformer; "
                 f"{SEQUENCES_PER_DEVICE} sequences of {SEQ} tokens or {IMAGES_PER_DEVICE} "
                 f"images per device) on a {bench['mesh']} mesh of simulated devices, every "
                 "plan compiled by "
                 "XLA and scored by benchmarks/run.py's formula (H100 device model: compute "
                 "and HBM roofline of the per-device HLO plus its collectives). Hand plans are "
                 "those of benchmarks/third_party.py; tensor parallel splits projections by "
                 "parameter name (Megatron: query/key/value/up/gate by output features, "
                 "output/down by input features, embeddings by vocabulary rows). Ratio: "
                 "hloplan's step over the best hand plan that fits (below 1: hloplan is "
                 "faster). The MoE's hand plans split each expert's hidden units for tensor "
                 "parallel; there is no expert-parallel hand plan yet. The inference "
                 "functions are not benchmarked (the hand plans are written for train "
                 "steps).", ""]
        text += bench_table(bench)
    DOC.write_text("\n".join(text) + "\n")


def _write_results(path: Path, results: dict, key: str, partial: bool) -> None:
    """Write `results` to `path`; a run of some programs (`partial`) updates those entries of
    `results[key]` in the full file instead."""
    if partial and path.exists():
        full = json.loads(path.read_text())
        fresh = {entry["program"]: entry for entry in results[key]}
        full[key] = [fresh.pop(entry["program"], entry) for entry in full[key]]
        full[key] += list(fresh.values())
        full["wall_s"] += results["wall_s"]
        results = full
    path.write_text(json.dumps(results, indent=1, default=str) + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--report", action="store_true")
    parser.add_argument("--bench", action="store_true")
    parser.add_argument("--docs", action="store_true")
    parser.add_argument("--programs", help="comma-separated subset")
    parser.add_argument("--mesh", default=BENCH_MESH, help="--bench mesh")
    args = parser.parse_args(argv)
    if args.report:
        names = args.programs.split(",") if args.programs else [p.name for p in corpus.PROGRAMS]
        _write_results(REPORT_JSON, run_report(names), "rows", partial=bool(args.programs))
    if args.bench:
        names = args.programs.split(",") if args.programs else list(BENCH_PROGRAMS)
        _write_results(BENCH_JSON, run_bench(names, args.mesh), "cases",
                       partial=bool(args.programs))
    if args.report or args.bench or args.docs:
        write_docs()
        print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
