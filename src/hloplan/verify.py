"""`hloplan compile --verify-memory`: the plan's programs compiled by XLA, their allocation
per device set against the budget.

hloplan's memory estimate is its own model of what XLA will allocate; XLA decides the schedule,
fusion and the packing of temporaries into one allocation. Where the estimate is low the plan
runs out of memory on the device, so with this option every program the plan emits is compiled
(not run) and its allocation per device (arguments + results + temporaries, from
`memory_analysis`, less the donated arguments' buffers that results are written into, as the
loader runs it) read back:

- a single program: its allocation;
- an accumulated or pipelined plan: each stage's estimate plus the largest amount by which a
  task of the stage compiles above its own estimate (the loader's held arrays are the
  estimate's; the compiled task replaces the task's estimated peak).

The compile runs in a child process, so the caller's jax (devices, backend) is left alone:

- for a TPU device model, with libtpu installed (`pip install "hloplan[tpu]"`), by XLA's TPU
  compiler for the matching TPU topology, deviceless (tpu.py); the allocation is what libtpu's
  runtime reserves (arguments + results - aliased + the temporaries of the buffer assignment
  the compile dumps; compiled_peak);
- otherwise on simulated CPU devices (XLA_FLAGS --xla_force_host_platform_device_count), so any
  machine can check a plan for any mesh. For a GPU or TPU target that makes the check a proxy,
  on the safe side where the two compilers differ in what we have measured: XLA's CPU pipeline
  keeps a reduce-scatter as an all-reduce whose whole result is allocated, and its packing of
  temporaries is its own. A TPU plan checked this way (no libtpu) says so in a note.

`hloplan verify PLAN_DIR` (`verify_plan`) compiles a written plan the same way and sets the
compiled collectives (per kind and mesh axes) and peak beside the plan's predictions.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from hloplan.diagnostics import HloplanError, UsageError
from hloplan.multiprocess import cpu_worker_env, isolated_python

# A compile of the largest benchmark programs on 1,024 simulated devices takes a minute.
TIMEOUT_S = 1800.0


class VerifyError(HloplanError):
    pass


@dataclass(frozen=True)
class Target:
    """Which XLA compiles a plan for checking: "cpu" (simulated devices) or "tpu" (libtpu, for
    `topology`); `note` says why a TPU plan is checked with the CPU compiler, or how."""

    compiler: str
    devices: int
    topology: str | None = None
    note: str | None = None

    def describe(self) -> dict:
        out: dict = {"platform": self.compiler}
        if self.topology:
            out["topology"] = self.topology
        return out


NO_LIBTPU = ("libtpu is not installed (pip install \"hloplan[tpu]\"): checked with XLA's CPU "
             "compiler on simulated devices instead of the TPU compiler")


def resolve_target(model, devices: int, compiler: str = "auto",
                   topology: str | None = None) -> Target:
    """The compiler a plan for device model `model` on `devices` devices is checked with.
    `compiler`: auto (tpu for a TPU model when libtpu is installed, else cpu), cpu or tpu;
    `topology`: a TPU topology name instead of the one the model and device count give."""
    from hloplan.tpu import libtpu_available, parse_topology, topology_for

    if compiler not in ("auto", "cpu", "tpu"):
        raise UsageError(f"unknown compiler {compiler!r} (auto, cpu, tpu)")
    is_tpu = model is not None and model.platform == "tpu"
    if compiler == "cpu" or (compiler == "auto" and not is_tpu and topology is None):
        return Target("cpu", devices)
    if not libtpu_available():
        if compiler == "tpu" or topology is not None:
            raise UsageError("the TPU compiler needs libtpu: pip install \"hloplan[tpu]\" "
                             "(or libtpu==0.0.42.*)")
        return Target("cpu", devices, note=NO_LIBTPU)
    if topology is not None:
        topo = parse_topology(topology)
    else:
        kind = getattr(model, "tpu_topology", None) if is_tpu else None
        if kind is None:
            raise UsageError("which TPU? the device model names no TPU topology: pass "
                             "--topology (e.g. v5e:2x4) or plan with a TPU device model")
        topo = topology_for(kind, devices)
    if topo.devices != devices:
        raise UsageError(f"TPU topology {topo.name} has {topo.devices} devices; the plan's mesh "
                         f"has {devices}")
    return Target("tpu", devices, topo.name)


def compiled_peak(memory: dict, compiler: str) -> int:
    """A compiled program's allocation per device: arguments + results + temporaries - aliased
    (memory_stats). On TPU, what libtpu's runtime reserves (`reserved_bytes`, with_reserved)
    where the compile's buffer assignment was read, else the larger of the first figure and
    libtpu's own peak (`peak_memory_in_bytes`)."""
    if compiler == "tpu" and memory.get("reserved_bytes"):
        return int(memory["reserved_bytes"])
    if compiler == "tpu" and memory.get("xla_peak_bytes"):
        return int(max(memory["xla_peak_bytes"], memory["peak_bytes"] or 0))
    return int(memory["peak_bytes"])


def with_reserved(memory: dict, dump_dir) -> dict:
    """memory_stats plus `reserved_bytes`: arguments + results - aliased + the HBM
    temporaries of the buffer assignment libtpu dumped into `dump_dir`
    (hlo_stats.dumped_temp_bytes). That is what the runtime reserves for a step on a v5e chip
    (benchmarks/tpu_reserved.py); `temp_size_in_bytes` counts 11 to 237 MB more on the
    benchmark programs (docs/tpu.md, Memory on TPU)."""
    from hloplan.hlo_stats import dumped_temp_bytes

    parts = [memory.get("argument_bytes"), memory.get("output_bytes")]
    try:
        temps = dumped_temp_bytes(dump_dir).get(0, 0)
    except ValueError:  # no buffer assignment dumped, or several
        return memory
    if any(p is None for p in parts):
        return memory
    return {**memory, "reserved_bytes": sum(parts) - (memory.get("alias_bytes") or 0) + temps}


def _dump_options(dump_dir) -> dict:
    """compiler_options dumping one compile's optimized HLO and buffer assignment."""
    return {"xla_dump_to": str(dump_dir), "xla_dump_hlo_as_text": True}


def _abstract_call(exported, shardings):
    import jax

    return [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
            for a, s in zip(exported.in_avals, shardings, strict=True)]


def _collectives_by_axes(hlo_text: str, mesh) -> list[dict]:
    """The compiled program's collectives per (kind, mesh axes): executions and per-device
    bytes per step (hlo_stats.collective_stats)."""
    from hloplan.hlo_stats import collective_stats

    stats = collective_stats(hlo_text, num_devices=mesh.size,
                             mesh_axes=tuple(zip(mesh.axis_names, mesh.devices.shape)))
    order = {name: i for i, name in enumerate(mesh.axis_names)}
    table: dict[tuple[str, str], dict] = {}
    for op in stats.ops:
        # Axes in mesh order, as the plan lists them (a group's own order moves no bytes).
        axes = ",".join(sorted(op.axes, key=order.__getitem__)) or "?"
        slot = table.setdefault((op.kind, axes),
                                {"count": 0, "bytes": 0.0, "async": 0})
        slot["count"] += op.trip_count
        slot["bytes"] += op.total_bytes_sent
        slot["async"] += op.trip_count if op.is_async else 0
    return [{"kind": kind, "axes": axes, **slot} for (kind, axes), slot in sorted(table.items())]


def measure_plan_dir(plan_dir: str | os.PathLike, devices=None, compiler: str = "cpu",
                     details: bool = False, score_device: str | None = None) -> dict:
    """In this process: the compiled allocation per device of the plan's programs, by name
    ("program", or each task's name). jax must see the plan's devices, or `devices` are given
    (a TPU topology's). With `details`: {"programs": that, "details": {name: {"memory",
    "collectives", "flops"}}}; with `score_device` (a device model's name or file) as well,
    each program's "score" (hloplan.score.compiled_score with that model's figures)."""

    from hloplan.emit.loader import Runner, load, read_plan
    from hloplan.hlo_stats import memory_stats

    plan = read_plan(plan_dir)
    measured: dict = {}
    info: dict = {}

    def record(name, compile_, mesh):
        # On TPU the compile dumps its buffer assignment: what the runtime reserves.
        if compiler == "tpu":
            with tempfile.TemporaryDirectory(prefix="hloplan-dump-") as dump:
                compiled = compile_(_dump_options(dump))
                memory = with_reserved(memory_stats(compiled), dump)
        else:
            compiled = compile_(None)
            memory = memory_stats(compiled)
        measured[name] = compiled_peak(memory, compiler)
        if details:
            cost = compiled.cost_analysis()
            if isinstance(cost, list | tuple):
                cost = cost[0] if cost else {}
            info[name] = {"memory": memory,
                          "collectives": _collectives_by_axes(compiled.as_text(), mesh),
                          "flops": float((cost or {}).get("flops", 0.0))}
            if score_device is not None:
                from hloplan.cost_models import CommModel, load_device_model
                from hloplan.mesh import MeshSpec
                from hloplan.score import compiled_score

                axes = tuple(zip(mesh.axis_names, mesh.devices.shape))
                comm = CommModel(load_device_model(score_device),
                                 MeshSpec(tuple(mesh.axis_names), tuple(mesh.devices.shape)))
                score = compiled_score(compiled, axes, comm)
                info[name]["score"] = {k: v for k, v in score.items() if k != "memory"}

    if plan.get("pipeline", {}).get("tasks"):
        runner = load(plan_dir, devices=devices)
        for task in runner.tasks:
            args = _abstract_call(task["exported"], task["in_shardings"])
            lowered = task["call"].lower(*args)
            record(task["name"], lambda opts, lowered=lowered: lowered.compile(opts),
                   runner.meshes[task["stage"]])
    else:
        # Donating what the export donates, as the loader runs it.
        runner = Runner(plan_dir, devices=devices)
        record("program", runner.compile_abstract, runner.mesh)
    return {"programs": measured, "details": info} if details else measured


def _run_child(plan_dir: str, target: Target, timeout: float, details: bool,
               score_device: str | None = None) -> dict:
    """measure_plan_dir in a child process for `target`; the plan directory is the child's to
    change (a TPU check relabels a program exported for another platform)."""
    if target.compiler == "tpu":
        from hloplan.tpu import child_env

        env = child_env()
        argv = ["--compiler", "tpu", "--topology", target.topology]
    else:
        env = cpu_worker_env(target.devices)
        argv = []
    if details:
        argv.append("--details")
    if score_device is not None:
        argv += ["--score", score_device]
    what = f"XLA's {target.compiler.upper()} compiler" + (
        f" ({target.topology})" if target.topology else "")
    try:
        done = subprocess.run([*isolated_python("hloplan.verify"), plan_dir, *argv],
                              env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise VerifyError(f"{what} did not compile the plan within {timeout:.0f} s") from None
    if done.returncode != 0:
        lines = [line for line in (done.stderr or done.stdout).strip().splitlines()
                 if "error" in line.lower()] or (done.stderr or done.stdout).strip().splitlines()
        raise VerifyError(f"{what} could not compile the plan: " + " | ".join(lines[-3:]))
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure_files(files: dict[str, bytes], devices: int, timeout: float = TIMEOUT_S,
                  target: Target | None = None, notes: list[str] | None = None) -> dict:
    """The plan's files (as compile renders them), measured by measure_plan_dir in a child
    process: with `devices` simulated CPU devices, or as `target` says (what the TPU check
    had to assume is appended to `notes`)."""
    target = target or Target("cpu", devices)
    with tempfile.TemporaryDirectory(prefix="hloplan-verify-") as tmp:
        for name, data in files.items():
            path = Path(tmp) / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
        try:
            result = _run_child(tmp, target, timeout, details=False)
        except VerifyError as exc:
            raise VerifyError(f"--verify-memory: {exc.diagnostics[0].message}") from None
    if notes is not None:
        notes.extend(n for n in result["notes"] if n not in notes)
    return result["programs"]


def checked_peak(plan: dict, measured: dict) -> dict:
    """What the compiled programs say of the plan's peak per device: {"peak_bytes",
    "estimated_bytes", "programs": measured}. For a pipelined plan, each stage's estimate
    corrected by its tasks' compiled allocations (module docstring)."""
    pipeline = plan.get("pipeline", {})
    if pipeline.get("tasks"):
        stages = pipeline["estimate"]["memory_per_stage_bytes"]
        excess = [0.0] * len(stages)  # a task under its estimate lowers nothing
        for task in pipeline["tasks"]:
            over = measured[task["name"]] - task["peak_memory_bytes"]
            excess[task["stage"]] = max(excess[task["stage"]], over)
        peaks = [est + extra for est, extra in zip(stages, excess)]
        return {"peak_bytes": max(peaks), "estimated_bytes": max(stages), "programs": measured}
    return {"peak_bytes": measured["program"],
            "estimated_bytes": plan["estimate"]["peak_memory_bytes"], "programs": measured}


def verify_plan(plan_dir: str | os.PathLike, compiler: str = "auto",
                topology: str | None = None, timeout: float = TIMEOUT_S,
                score_device: str | None = None) -> dict:
    """`hloplan verify`: compile the plan in PLAN_DIR (a child process, on a copy) and set what
    the compiler made of it beside the plan's predictions: per program the per-device peak and
    the collectives per kind and mesh axes (executions and per-device bytes per step). With
    `score_device` (a device model's name or file), each compiled program's "score" as well
    (hloplan.score.compiled_score under that model's figures); compiled by libtpu, a plan for
    a device model at hand is scored under that model by default."""
    from hloplan.cost_models import DeviceModelError, load_device_model
    from hloplan.emit.loader import PlanLoadError, read_plan

    try:
        plan = read_plan(plan_dir)
    except PlanLoadError as exc:
        raise UsageError(str(exc)) from None
    try:
        model = load_device_model(plan["device_model"]["name"])
    except DeviceModelError:  # a model from a file that is not at hand: its platform is
        model = None          # still in the plan
        if plan["device_model"].get("platform") == "tpu" and topology is None and \
                compiler != "cpu":
            raise UsageError(f"the plan's device model {plan['device_model']['name']!r} is "
                             "not a shipped one: pass --topology (e.g. v5e:2x4)") from None
    target = resolve_target(model, int(plan["mesh"]["devices"]), compiler, topology)
    if score_device is None and target.compiler == "tpu" and model is not None:
        # libtpu's schedule says which kernels run while each asynchronous collective is in
        # flight: scored under the plan's own device model, beside what the plan hides
        score_device = plan["device_model"]["name"]
    with tempfile.TemporaryDirectory(prefix="hloplan-verify-") as tmp:
        copy = Path(tmp) / "plan"
        shutil.copytree(plan_dir, copy)
        result = _run_child(str(copy), target, timeout, details=True,
                            score_device=score_device)
    notes = ([target.note] if target.note else []) + result["notes"]
    report = {"plan": str(plan_dir), "device_model": plan["device_model"]["name"],
              "mesh": dict(zip(plan["mesh"]["axis_names"], plan["mesh"]["axis_sizes"])),
              **target.describe(), "notes": notes, "programs": {}}
    pipeline = plan.get("pipeline", {})
    for name, info in result["details"].items():
        entry = {"compiled": {"peak_bytes": result["programs"][name],
                              "memory": info["memory"], "flops": info["flops"],
                              "collectives": info["collectives"]}}
        if "score" in info:
            entry["compiled"]["score"] = info["score"]
        if name == "program":
            est = plan["estimate"]
            entry["predicted"] = {"peak_bytes": est["peak_memory_bytes"],
                                  "collectives": _predicted(est["collectives"]),
                                  "hidden_s": est.get("hidden_s", 0.0)}
        else:
            task = next(t for t in pipeline["tasks"] if t["name"] == name)
            entry["predicted"] = {"peak_bytes": task["peak_memory_bytes"],
                                  "collectives": _predicted(task.get("collectives", []))}
        entry["peak_ratio"] = (entry["predicted"]["peak_bytes"] / entry["compiled"]["peak_bytes"]
                               if entry["compiled"]["peak_bytes"] else None)
        report["programs"][name] = entry
    if pipeline.get("tasks"):
        report["step"] = _step_collectives(report["programs"], pipeline)
    return report


def _step_collectives(programs: dict, pipeline: dict) -> dict:
    """A pipelined plan's collectives per step, per kind and mesh axes, predicted and compiled:
    each task's times the executions the schedule gives it (part-A tasks once per
    microbatch), as `hloplan run --check` totals them."""
    from hloplan.plan import task_executions

    table: dict[tuple[str, str], dict] = {}
    for task in pipeline["tasks"]:
        times = task_executions(task, pipeline)
        entry = programs[task["name"]]
        for side in ("predicted", "compiled"):
            for c in entry[side]["collectives"]:
                slot = table.setdefault((c["kind"], c["axes"]), {
                    "predicted": {"count": 0, "bytes": 0.0},
                    "compiled": {"count": 0, "bytes": 0.0}})
                slot[side]["count"] += c["count"] * times
                slot[side]["bytes"] += c["bytes"] * times
    return {"microbatches": pipeline["microbatches"],
            "collectives": [{"kind": k, "axes": a, **v} for (k, a), v in sorted(table.items())]}


def _predicted(entries: list[dict]) -> list[dict]:
    table: dict[tuple[str, str], dict] = {}
    for e in entries:
        slot = table.setdefault((e["kind"], e.get("axes") or "?"), {"count": 0, "bytes": 0.0})
        slot["count"] += e["count"]
        slot["bytes"] += e["bytes"]
    return [{"kind": k, "axes": a, **v} for (k, a), v in sorted(table.items())]


def format_verify_report(report: dict) -> str:
    from hloplan.units import format_bytes

    where = report["platform"].upper() + (f" {report['topology']}" if report.get("topology")
                                          else " (simulated devices)")
    mesh = ",".join(f"{k}={v}" for k, v in report["mesh"].items())
    lines = [f"{report['plan']}: {report['device_model']} plan on mesh {mesh}, compiled by "
             f"XLA for {where}"]
    for name, entry in report["programs"].items():
        pred, comp = entry["predicted"], entry["compiled"]
        ratio = f" (predicted / compiled {entry['peak_ratio']:.2f})" if entry["peak_ratio"] \
            else ""
        lines.append(f"{name}: peak per device predicted {format_bytes(pred['peak_bytes'])}, "
                     f"compiled {format_bytes(comp['peak_bytes'])}{ratio}")
        memory = comp["memory"]
        if memory.get("reserved_bytes"):
            lines.append("  (what libtpu's runtime reserves: arguments + results - aliased + "
                         "the buffer assignment's temporaries)")
        if memory.get("xla_peak_bytes") and memory.get("peak_bytes") is not None and \
                memory["xla_peak_bytes"] != memory["peak_bytes"]:
            lines.append(f"  (XLA's peak_memory_in_bytes {format_bytes(memory['xla_peak_bytes'])}"
                         f", generated code {format_bytes(memory['generated_code_bytes'] or 0)}; "
                         "arguments + results + temporaries - aliased "
                         f"{format_bytes(memory['peak_bytes'])})")
        lines.append(f"  {'collective (mesh axes)':<34} {'predicted':>20}   "
                     f"{'compiled':>20}")
        p_by = {(c["kind"], c["axes"]): c for c in pred["collectives"]}
        c_by = {(c["kind"], c["axes"]): c for c in comp["collectives"]}
        for key in sorted(set(p_by) | set(c_by)):
            p = p_by.get(key, {"count": 0, "bytes": 0})
            c = c_by.get(key, {"count": 0, "bytes": 0})
            label = f"{key[0]} ({key[1]})"
            lines.append(f"  {label:<34} {p['count']:>5} x {format_bytes(p['bytes']):>12}   "
                         f"{c['count']:>5} x {format_bytes(c['bytes']):>12}")
        if not p_by and not c_by:
            lines.append("  (no collectives)")
        if "score" in comp:
            lines.extend(_overlap_lines(pred, comp["score"]))
    if "step" in report:
        lines.append(f"per step (part-A tasks x {report['step']['microbatches']} microbatches): "
                     f"{'predicted':>11}   {'compiled':>20}")
        for c in report["step"]["collectives"]:
            p, q = c["predicted"], c["compiled"]
            label = f"{c['kind']} ({c['axes']})"
            lines.append(f"  {label:<34} {p['count']:>5} x {format_bytes(p['bytes']):>12}   "
                         f"{q['count']:>5} x {format_bytes(q['bytes']):>12}")
    lines.extend(f"note: {n}" for n in report["notes"])
    return "\n".join(lines)


def _overlap_lines(predicted: dict, score: dict) -> list[str]:
    """The collective seconds the plan counts as hidden behind its ops' kernels, beside what
    the compiled schedule hides: per asynchronous collective, the kernels scheduled between
    its start and its done (hloplan.score)."""
    from hloplan.units import format_seconds

    asynchronous = {k: v for k, v in score["collectives"].items() if v.get("hidden_seconds")}
    planned = format_seconds(predicted.get("hidden_s") or 0.0)
    lines = [f"  collective seconds hidden: predicted {planned}, under the kernels scheduled "
             f"between start and done {format_seconds(score['hidden_s'])} of "
             f"{format_seconds(score['communication_s'])}"]
    lines.extend(f"    {label}: {format_seconds(v['hidden_seconds'])} of "
                 f"{format_seconds(v['seconds'])}" for label, v in sorted(asynchronous.items()))
    return lines


def _record_digests(plan_dir: Path, paths: list[Path]) -> None:
    """The child's copy of plan.json records the sha256 of the programs it relabelled, so that
    the loader's integrity check reads them as the plan's own."""
    from hloplan.emit.loader import PLAN_FILE, digest

    plan_json = plan_dir / PLAN_FILE
    if not plan_json.is_file():
        return
    plan = json.loads(plan_json.read_text())
    digests = plan.get("digests", {})
    for path in paths:
        name = path.relative_to(plan_dir).as_posix()
        if name in digests:
            digests[name] = digest(path.read_bytes())
    plan_json.write_text(json.dumps(plan, indent=1, sort_keys=True))


def main(argv: list[str]) -> int:
    """Child process: measure_plan_dir on PLAN_DIR, one JSON line on stdout."""
    parser = argparse.ArgumentParser(prog="python -m hloplan.verify")
    parser.add_argument("plan_dir")
    parser.add_argument("--compiler", choices=("cpu", "tpu"), default="cpu")
    parser.add_argument("--topology", default=None)
    parser.add_argument("--details", action="store_true")
    parser.add_argument("--score", default=None, metavar="DEVICE")
    args = parser.parse_args(argv)
    devices = None
    notes = []
    if args.compiler == "tpu":
        from hloplan.tpu import parse_topology, retarget_exported, topology_devices

        devices = topology_devices(parse_topology(args.topology))
        relabelled = []
        for path in sorted(Path(args.plan_dir).rglob("*.jaxexport")):
            if path.name == "reference.jaxexport":
                continue
            data, note = retarget_exported(path.read_bytes())
            if note is not None:
                path.write_bytes(data)
                relabelled.append(path)
                if note not in notes:
                    notes.append(note)
        if relabelled:
            _record_digests(Path(args.plan_dir), relabelled)
    result = measure_plan_dir(args.plan_dir, devices=devices, compiler=args.compiler,
                              details=args.details or args.score is not None,
                              score_device=args.score)
    if not (args.details or args.score is not None):
        result = {"programs": result}
    result["notes"] = notes
    print(json.dumps(result, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
