"""Single-chip step times on a real TPU against hloplan's estimate for one device.

Here (libraries of the corpus installed):

    .venv/bin/python benchmarks/tpu_chip.py export      # corpus steps -> build/tpu_chip/

exports the corpus train steps (CORPUS, THIRD_PARTY) at their realistic one-device size for the
tpu platform, so that the chip needs jax alone to run them.

On the chip (needs only jax and numpy, plus flatbuffers for the exports; repository root):

    python3 benchmarks/tpu_chip.py measure -o chip.json [--profile DIR]
    python3 benchmarks/tpu_chip.py measure --exports build/tpu_chip -o corpus.json [--profile DIR]

times each benchmark program's jitted train step (models.py, "realistic" size for one device,
state donated), or each exported corpus step (random inputs from its abstract arguments, the
same every step), on the first device: median wall seconds of 10 steps after 2 warm-up steps.
--profile also traces 3 steps: device time per XLA op into the JSON, and the compiled HLO into
DIR (NAME.hlo.txt.gz).

Here, with libtpu (no chip needed):

    .venv/bin/python benchmarks/tpu_chip.py hlo         # -> build/tpu_chip/hlo/

compiles each program for the compile-only v5e:1x1 topology: the HLO the chip runs, kernel
names and all (what `measure --profile` writes there), for --hlo below.

Here (hloplan installed):

    .venv/bin/python benchmarks/tpu_chip.py estimate --chip chip.json [--chip corpus.json]
        [--device FILE] [--hlo DIR]

plans each program for one device (`--mesh 1`, default device tpu-v5e) and writes, per program,
hloplan's estimated step (compute + the device's call overhead: DeviceModel.call_overhead of
the step's argument and result buffers) and measured / estimated,
and with --hlo the per-kernel roofline of the chip's compiled HLO, into
benchmarks/tpu_chip_results.json (under "by_device_model", one entry per --device).
benchmarks/tpu_chip_analysis.py splits the same figures by kernel category.
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
EXPORTS = HERE.parent / "build" / "tpu_chip"  # git-ignored: the exported corpus steps
# The corpus programs at realistic size for one device (benchmarks/corpus.py --bench per device:
# 8 sequences of 512 tokens, 4 transformer layers, 32 images), and benchmarks/third_party.py's
# realistic builds (the NNX transformer, the Equinox and Keras MLPs, the Keras CNN).
CORPUS = ["hf_gpt2", "hf_bert", "hf_llama", "hf_bart", "hf_vit", "haiku_transformer",
          "linen_resnet", "keras_gemma"]
THIRD_PARTY = {"nnx_transformer": "build_transformer", "eqx_mlp": "build_mlp",
               "keras_mlp": "build_keras_mlp", "keras_cnn": "build_keras_cnn"}


def build_corpus(name: str):
    """(step, args) of a corpus program at its realistic one-device size."""
    if name in THIRD_PARTY:
        import third_party

        return getattr(third_party, THIRD_PARTY[name])(1)
    sys.path.insert(0, str(HERE.parent / "examples" / "third_party"))
    import corpus

    kwargs: dict = {"size": "real"}
    if name == "linen_resnet":
        kwargs["batch"] = 32
    elif name == "hf_vit":
        kwargs.update(batch=32, layers=4)
    else:
        kwargs.update(batch=8, seq=512, layers=4)
    return corpus.BY_NAME[name].build(**kwargs)


def export_corpus(out: Path, names: list[str]) -> None:
    """Serialized jax.export of each corpus step for the tpu platform (the chip has jax only)."""
    import jax

    out.mkdir(parents=True, exist_ok=True)
    for name in names:
        step, args = build_corpus(name)
        donated = getattr(step, "donate_argnums", (0, 1) if len(args) == 4 else (0,))
        exported = jax.export.export(jax.jit(step, donate_argnums=donated),
                                     platforms=("tpu",))(*args)
        (out / f"{name}.jaxexport").write_bytes(bytes(exported.serialize()))
        print(name, len(exported.mlir_module_serialized), flush=True)


def compile_hlo(out: Path, exports: Path, names: list[str]) -> None:
    """Each program's compiled HLO as the chip runs it, compiled here by libtpu for the
    compile-only v5e:1x1 topology (the same kernels and kernel names as `measure --profile`
    writes on the chip): NAME.hlo.txt.gz into `out`, for `estimate --hlo` and
    tpu_chip_analysis.py."""
    import gzip
    import os

    os.environ.update(JAX_PLATFORMS="cpu", TPU_SKIP_MDS_QUERY="1",
                      ALLOW_MULTIPLE_LIBTPU_LOAD="1")
    import jax
    import models
    from jax.sharding import SingleDeviceSharding

    from hloplan.tpu import parse_topology, topology_devices

    sharding = SingleDeviceSharding(topology_devices(parse_topology("v5e:1x1"))[0])

    def placed(tree):
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding),
                            tree)

    out.mkdir(parents=True, exist_ok=True)
    for name in names:
        path = exports / f"{name}.jaxexport"
        if path.exists():
            exported = jax.export.deserialize(bytearray(path.read_bytes()))
            args, kwargs = jax.tree.unflatten(exported.in_tree, placed(list(exported.in_avals)))
            compiled = jax.jit(exported.call).lower(*args, **kwargs).compile()
        else:
            _, state_spec, batch_spec, step = models.MODELS[name].build("realistic", 1)
            compiled = jax.jit(step, donate_argnums=(0,)).lower(
                placed(models.abstract(state_spec)), placed(models.abstract(batch_spec))).compile()
        (out / f"{name}.hlo.txt.gz").write_bytes(gzip.compress(compiled.as_text().encode()))
        print(name, flush=True)


def _device_kernels(trace_dir: str, steps: int) -> dict:
    """Device time per step of each XLA op the TPU ran (the profiler's "XLA Ops" line), and
    per line of the device plane, from a jax.profiler trace of `steps` steps."""
    import glob

    from jax.profiler import ProfileData

    files = sorted(glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True))
    if not files:
        return {}
    data = ProfileData.from_file(files[-1])
    ops: dict[str, float] = {}
    lines: dict[str, float] = {}
    for plane in data.planes:
        if not plane.name.startswith("/device:"):
            continue
        for line in plane.lines:
            for event in line.events:
                lines[line.name] = lines.get(line.name, 0.0) + event.duration_ns * 1e-9 / steps
                if line.name == "XLA Ops":
                    ops[event.name] = ops.get(event.name, 0.0) + event.duration_ns * 1e-9 / steps
    return {"lines": lines, "ops": ops}


def _time_compiled(compiled, args, feed_back) -> tuple[list[float], object]:
    import jax

    times = []
    for i in range(12):
        t0 = time.perf_counter()
        out = compiled(*args)
        jax.block_until_ready(out)
        args = feed_back(args, out)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return times, args


def _profile(compiled, args, feed_back, out_dir: Path | None, name: str) -> dict:
    import tempfile

    import jax

    steps = 3
    with tempfile.TemporaryDirectory() as trace:
        with jax.profiler.trace(trace):
            for _ in range(steps):
                out = compiled(*args)
                jax.block_until_ready(out)
                args = feed_back(args, out)
        kernels = _device_kernels(trace, steps)
    if out_dir is not None:
        import gzip

        (out_dir / f"{name}.hlo.txt.gz").write_bytes(gzip.compress(compiled.as_text().encode()))
    return kernels


def measure_exported(out: str, exports: Path, names: list[str], profile_dir: str | None) -> None:
    """Times each exported corpus step (module docstring) on the first device: random inputs
    from its abstract arguments, the same inputs every step (nothing donated)."""
    import jax
    import numpy as np

    results = {"device_kind": jax.devices()[0].device_kind, "jax": jax.__version__,
               "programs": {}}
    hlo_dir = Path(profile_dir) if profile_dir else None
    if hlo_dir:
        hlo_dir.mkdir(parents=True, exist_ok=True)
    for name in names:
        exported = jax.export.deserialize(bytearray((exports / f"{name}.jaxexport").read_bytes()))
        rng = np.random.default_rng(0)
        leaves = []
        for aval in exported.in_avals:
            if np.issubdtype(aval.dtype, np.floating):
                leaves.append(jax.device_put(
                    (rng.random(aval.shape, np.float32) * 0.01).astype(aval.dtype)))
            else:  # token ids, labels, masks, counters: 1 is valid for all of them
                leaves.append(jax.device_put(np.ones(aval.shape, aval.dtype)))
        args, kwargs = jax.tree.unflatten(exported.in_tree, leaves)
        started = time.perf_counter()
        compiled = jax.jit(exported.call).lower(*args, **kwargs).compile()
        compile_s = time.perf_counter() - started
        times, _ = _time_compiled(compiled, args, lambda a, o: a)
        entry = {"step_s": statistics.median(times), "min_step_s": min(times),
                 "compile_s": compile_s}
        entry["device"] = _profile(compiled, args, lambda a, o: a, hlo_dir, name)
        results["programs"][name] = entry
        print(name, entry["step_s"], flush=True)
        Path(out).write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")


def measure(out: str, programs: list[str], size: str = "realistic",
            profile_dir: str | None = None) -> None:
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
        feed = lambda a, o: (o[1], a[1])  # noqa: E731  (the new state, the same batch)
        times, (state, batch) = _time_compiled(compiled, (state, batch), feed)
        hlo_dir = Path(profile_dir) if profile_dir else None
        if hlo_dir:
            hlo_dir.mkdir(parents=True, exist_ok=True)
        device = _profile(compiled, (state, batch), feed, hlo_dir, name) if profile_dir else {}
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, list | tuple) else cost
        results["programs"][name] = {"config": cfg, "step_s": statistics.median(times),
                                     "min_step_s": min(times), "compile_s": compile_s,
                                     "flops": float(cost.get("flops", 0.0)),
                                     "bytes_accessed": float(cost.get("bytes accessed", 0.0)),
                                     "device": device}
        print(name, results["programs"][name]["step_s"], flush=True)
        Path(out).write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")


def _compiled_hlo(hlo_dir: Path | None, name: str) -> str | None:
    import gzip

    if hlo_dir is None:
        return None
    path = hlo_dir / f"{name}.hlo.txt.gz"
    return gzip.decompress(path.read_bytes()).decode() if path.exists() else None


def estimate(chips: list[str], device: str, exports: Path, hlo_dir: Path | None) -> None:
    """hloplan's one-device estimate of each measured program against its measured step; with
    `hlo_dir` (the chip's compiled HLO, `measure --profile`), also the per-kernel roofline of
    that HLO (hlo_stats.kernel_stats at the device model's f32 rate and HBM bandwidth, the
    benchmark formula of benchmarks/tpu.py) plus the call overhead."""
    import tempfile

    import jax
    import models

    from hloplan.compiler import compile_bytes, make_options
    from hloplan.cost_models import load_device_model
    from hloplan.hlo_stats import kernel_stats

    model = load_device_model(device)
    rows = {}
    kind = None
    for chip in chips:
        measured = json.loads(Path(chip).read_text())
        kind = measured["device_kind"]
        for name, entry in measured["programs"].items():
            exported = exports / f"{name}.jaxexport"
            if exported.exists():
                data = exported.read_bytes()
            else:
                _, state_spec, batch_spec, step = models.MODELS[name].build(measured["size"], 1)
                data = bytes(models.export_step(step, state_spec, batch_spec).serialize())
            with tempfile.TemporaryDirectory():
                result = compile_bytes(data, f"{name}.jaxexport",
                                       make_options("1", device=device, mesh_views="off"))
            est = result.plan["estimate"]
            # The call's own cost: per program, and per argument and result buffer.
            program = jax.export.deserialize(bytearray(data))
            overhead = model.call_overhead(len(program.in_avals) + len(program.out_avals))
            estimated = est["compute_s"] + est["communication_s"] + overhead
            row = {"measured_s": entry["step_s"], "estimated_s": estimated,
                   "estimated_compute_s": est["compute_s"], "estimated_overhead_s": overhead,
                   "measured_over_estimated": entry["step_s"] / estimated}
            line = (f"{name:<18} measured {entry['step_s'] * 1e3:8.2f} ms  estimated "
                    f"{estimated * 1e3:8.2f} ms  ratio {row['measured_over_estimated']:.2f}")
            text = _compiled_hlo(hlo_dir, name)
            if text is not None:
                kernels = kernel_stats(text, model.flops_for("f32"), model.hbm_bandwidth)
                row["roofline_s"] = kernels.seconds + overhead
                row["measured_over_roofline"] = entry["step_s"] / row["roofline_s"]
                line += (f"  roofline {row['roofline_s'] * 1e3:8.2f} ms  ratio "
                         f"{row['measured_over_roofline']:.2f}")
            rows[name] = row
            print(line, flush=True)
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    results.setdefault("by_device_model", {})[model.name] = {
        "chip": kind, "device_model": model.name,
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
    m.add_argument("--exports", default=None, help="time the exported corpus steps of this "
                   "directory (`export`) instead of the benchmark programs")
    m.add_argument("--profile", default=None, help="also trace 3 steps: device time per XLA "
                   "op into the JSON, compiled HLO into this directory")
    x = sub.add_parser("export")
    x.add_argument("-o", "--output", default=str(EXPORTS))
    x.add_argument("--programs", default=",".join(CORPUS + list(THIRD_PARTY)))
    h = sub.add_parser("hlo", help="compile each program for v5e:1x1 here (libtpu, no chip)")
    h.add_argument("-o", "--output", default=str(EXPORTS / "hlo"))
    h.add_argument("--exports", default=str(EXPORTS))
    h.add_argument("--programs", default=",".join(PROGRAMS + CORPUS + list(THIRD_PARTY)))
    e = sub.add_parser("estimate")
    e.add_argument("--chip", action="append", required=True, help="measure output (repeatable)")
    e.add_argument("--device", default="tpu-v5e")
    e.add_argument("--exports", default=str(EXPORTS), help="the exported corpus steps")
    e.add_argument("--hlo", default=None, help="the chip's compiled HLO (measure --profile)")
    args = parser.parse_args()
    if args.mode == "export":
        export_corpus(Path(args.output), args.programs.split(","))
    elif args.mode == "hlo":
        compile_hlo(Path(args.output), Path(args.exports), args.programs.split(","))
    elif args.mode == "measure" and args.exports:
        names = ([p.stem for p in sorted(Path(args.exports).glob("*.jaxexport"))]
                 if args.programs == ",".join(PROGRAMS) else args.programs.split(","))
        measure_exported(args.output, Path(args.exports), names, args.profile)
    elif args.mode == "measure":
        measure(args.output, args.programs.split(","), args.size, args.profile)
    else:
        estimate(args.chip, args.device, Path(args.exports), Path(args.hlo) if args.hlo else None)


if __name__ == "__main__":
    main()
