"""Write a plan directory atomically: everything is built in a sibling temp dir, then renamed.

Files: plan.json, module.mlir (annotated StableHLO with sdy shardings), sharded.jaxexport (the
runnable artifact), reference.jaxexport (the original single-device program, for `run --check`),
loader.py (jax + numpy only) and timings.json (wall times: the one file that is not
deterministic).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from importlib import resources
from pathlib import Path

from hloplan import ir
from hloplan.diagnostics import UsageError
from hloplan.emit.launch_scripts import launch_scripts
from hloplan.emit.loader import EXPORTED_FILE, PLAN_FILE
from hloplan.plan import build_plan, value_spec
from hloplan.state import CompileState

MODULE_FILE = "module.mlir"
REFERENCE_FILE = "reference.jaxexport"
LOADER_FILE = "loader.py"
PIPELINE_LOADER_FILE = "pipeline_loader.py"
TIMINGS_FILE = "timings.json"


def reference_exported(state: CompileState, original_module_text: str | None):
    """The single-device Exported of the input (the input itself when it was one)."""
    program = state.program
    if program.exported is not None:
        return program.exported
    base = ir.exported_from_module(state.graph, (_platform(state),), "main")
    import dataclasses

    reparsed = ir.load_program(original_module_text.encode(), program.filename)
    return dataclasses.replace(base, mlir_module_serialized=ir.portable_artifact(reparsed.module))


def _reference_bytes(state: CompileState, reference, input_bytes: bytes) -> bytes:
    """The serialized reference: the input itself when it was a serialized Exported (the
    same program, byte for byte, without serializing it again), else `reference` serialized."""
    program = state.program
    if (program.input_kind == "jax-exported" and reference is program.exported
            and input_bytes):
        return bytes(input_bytes)
    return bytes(reference.serialize())


def _platform(state: CompileState) -> str:
    import jax

    return jax.default_backend()


def sharded_exported(state: CompileState, reference):
    graph = state.graph
    mesh = state.options.mesh
    kept = list(reference.module_kept_var_idx)
    offset = len(graph.arguments) - len(kept)  # a multi-platform export adds a platform index
    module_specs = [value_spec(state, v) for v in graph.arguments]
    in_specs = []
    for i, aval in enumerate(reference.in_avals):
        if i in kept:
            spec = module_specs[offset + kept.index(i)]
        else:
            spec = tuple(() for _ in aval.shape)
        in_specs.append(tuple(tuple(mesh.axis_names[a] for a in axes) for axes in spec))
    out_specs = [tuple(tuple(mesh.axis_names[a] for a in axes) for axes in value_spec(state, v))
                 for v in graph.outputs]
    return ir.sharded_exported(
        reference, serialized=ir.portable_artifact(state.program.module),
        axis_names=mesh.axis_names, axis_sizes=mesh.axis_sizes, in_specs=in_specs,
        out_specs=out_specs)


def render(state: CompileState, input_bytes: bytes, original_module_text: str | None,
           pipelined=None) -> tuple[dict, dict[str, bytes]]:
    """plan.json's content, as a dict (the compiler adds what it decided beyond this plan and
    writes it, PLAN_FILE), and every other file of the plan directory. `pipelined` is
    (PipelinePlan | NoPipeline | None, the state the pipeline was cut from) when pipelining
    was considered."""
    reference = reference_exported(state, original_module_text)
    sharded = sharded_exported(state, reference)
    package = resources.files("hloplan.emit")
    files = {
        MODULE_FILE: ir.module_text(state.program.module).encode(),
        EXPORTED_FILE: bytes(sharded.serialize()),
        REFERENCE_FILE: _reference_bytes(state, reference, input_bytes),
        LOADER_FILE: package.joinpath("loader.py").read_bytes(),
        **launch_scripts(),
    }
    pipeline_section = None
    if pipelined is not None:
        from hloplan.pipeline_parallel import PipelinePlan, describe, task_files

        plan_, pipe_state = pipelined
        if isinstance(plan_, PipelinePlan):
            files.update(task_files(plan_))
            files[PIPELINE_LOADER_FILE] = package.joinpath("pipeline_loader.py").read_bytes()
            pipeline_section = describe(plan_, pipe_state)
        elif plan_ is not None:
            pipeline_section = plan_.describe()
    plan = build_plan(state, input_bytes, {name: name for name in sorted(files)})
    if pipeline_section is not None:
        plan["pipeline"] = pipeline_section
        if pipeline_section.get("tasks"):
            # The pipeline loader hands the donated state to the once-per-step tasks that
            # read it last; the tasks' estimates count their results in buffers of their own.
            plan["donation"] = {**plan["donation"], "aliases": [], "resharded_results": [],
                                "loader": "pipelined: to the update tasks that read it last"}
    return plan, files


def write_plan_dir(output: str | os.PathLike, files: dict[str, bytes], timings: dict) -> Path:
    """Atomically replace `output` with the given files. Refuses to overwrite a directory that
    is not an hloplan plan (has files but no plan.json)."""
    target = Path(output)
    if target.exists():
        if not target.is_dir():
            raise UsageError(f"output {target} exists and is not a directory")
        if any(target.iterdir()) and not (target / PLAN_FILE).exists():
            raise UsageError(f"output directory {target} is not empty and holds no plan.json; "
                             "refusing to overwrite it", notes=("choose another -o directory",))
    parent = target.resolve().parent
    parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=parent))
    try:
        for name, data in files.items():
            (staging / name).parent.mkdir(parents=True, exist_ok=True)
            (staging / name).write_bytes(data)
        (staging / TIMINGS_FILE).write_text(json.dumps(timings, indent=1, sort_keys=True) + "\n")
        if target.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old.", dir=parent))
            os.rename(target, old / "plan")
            os.rename(staging, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target
