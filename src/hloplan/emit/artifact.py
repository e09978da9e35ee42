"""Write a plan directory atomically: everything is built in a hidden sibling directory, then
swapped in whole.

Files: plan.json, module.mlir (annotated StableHLO with sdy shardings), sharded.jaxexport (the
runnable artifact), reference.jaxexport (the original single-device program, for `run --check`),
loader.py (jax + numpy only) and timings.json (wall times: the one file that is not
deterministic). plan.json records the sha256 of every other file ("digests"); the loaders check
them.

Replacing a plan: the new one is written in full to `.NAME.hloplan-PID-XXXX` beside `-o NAME`,
then on Linux exchanged with the old one in one renameat2(RENAME_EXCHANGE) call, so that `NAME`
holds one complete plan or the other at every moment, whatever is killed when. The old plan,
now under the hidden name, is deleted after. A writer holds an flock on its hidden directory
while it works: hidden directories of NAME that nobody holds are what a killed compile left,
and the next compile to NAME deletes them. Where RENAME_EXCHANGE is missing (other systems,
some file systems) the old plan is renamed away and the new one renamed in: a kill between the
two renames leaves the old plan under its hidden name, and the next compile puts it back before
it starts.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import shutil
import sys
import time
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

from hloplan.diagnostics import UsageError
from hloplan.emit.launch_scripts import launch_scripts
from hloplan.emit.loader import EXPORTED_FILE, PLAN_FILE, digest

if TYPE_CHECKING:
    from hloplan.state import CompileState

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: stale hidden directories are left alone
    fcntl = None

MODULE_FILE = "module.mlir"
REFERENCE_FILE = "reference.jaxexport"
LOADER_FILE = "loader.py"
PIPELINE_LOADER_FILE = "pipeline_loader.py"
TIMINGS_FILE = "timings.json"


def reference_exported(state: CompileState, original_module_text: str | None):
    """The single-device Exported of the input (the input itself when it was one)."""
    from hloplan import ir

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
    from hloplan import ir
    from hloplan.plan import value_spec

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
    from hloplan import ir
    from hloplan.plan import build_plan

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
    plan["digests"] = {name: digest(data) for name, data in sorted(files.items())}
    if pipeline_section is not None:
        plan["pipeline"] = pipeline_section
        if pipeline_section.get("tasks"):
            # The pipeline loader hands the donated state to the once-per-step tasks that
            # read it last; the tasks' estimates count their results in buffers of their own.
            plan["donation"] = {**plan["donation"], "aliases": [], "resharded_results": [],
                                "loader": "pipelined: to the update tasks that read it last"}
    return plan, files


STAGING_TAG = ".hloplan-"
OLD_SUFFIX = "-old"
# An unlocked hidden directory this recent, of a running process, may be a write just begun.
FRESH_S = 60.0


def _staging_prefix(target: Path) -> str:
    return f".{target.name}{STAGING_TAG}"


def _is_plan_dir(path: Path) -> bool:
    """A directory hloplan wrote: its plan.json is a JSON object with hloplan's keys."""
    try:
        plan = json.loads((path / PLAN_FILE).read_bytes())
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(plan, dict) and "format" in plan and "files" in plan


def _foreign_files(path: Path) -> list[str]:
    """Entries of plan directory `path` that its plan.json does not list (put there by a user):
    replacing the plan would delete them."""
    plan = json.loads((path / PLAN_FILE).read_bytes())
    files = plan.get("files")
    ours = {PLAN_FILE, TIMINGS_FILE}
    if isinstance(files, dict):
        ours.update(str(name).split("/", 1)[0] for name in files.values())
    return sorted(entry.name for entry in path.iterdir() if entry.name not in ours)


def _check_target(target: Path) -> None:
    """UsageError unless `target` is absent, empty, or a plan directory with nothing else."""
    if not target.exists() and not target.is_symlink():
        return
    if target.is_symlink() or not target.is_dir():
        raise UsageError(f"output {target} exists and is not a directory",
                         notes=("choose another -o directory",))
    try:
        entries = list(target.iterdir())
    except OSError as exc:
        raise UsageError(f"cannot read output directory {target}: {exc.strerror}") from None
    if not entries:
        return
    if not _is_plan_dir(target):
        raise UsageError(f"output directory {target} is not empty and holds no hloplan "
                         "plan.json; refusing to overwrite it",
                         notes=("choose another -o directory",))
    foreign = _foreign_files(target)
    if foreign:
        raise UsageError(f"output directory {target} holds files that are not part of its "
                         f"plan ({', '.join(foreign[:5])}); refusing to delete them",
                         notes=("move them away, or choose another -o directory",))


def _lock(directory: Path):
    """An open descriptor holding an exclusive flock on `directory` (None where flock is
    missing): the mark of a writer still at work."""
    if fcntl is None:
        return None
    fd = os.open(directory, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def _unlock(fd) -> None:
    if fd is not None:
        os.close(fd)


def _writer_alive(directory: Path) -> bool:
    """The process whose id the hidden directory's name carries still runs (it may be between
    creating the directory and locking it)."""
    try:
        pid = int(directory.name.rsplit(STAGING_TAG, 1)[1].split("-", 1)[0])
    except (IndexError, ValueError):
        return False
    if pid == os.getpid():
        return False  # this process holds no write to this target now
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # alive, someone else's
        return True
    return True


def _held(directory: Path) -> bool:
    """A live writer works in `directory`: it holds its flock, or it has just created it (not
    locked yet, or the old plan it swapped out, about to be deleted): its process runs and the
    directory is recent. An old unlocked directory is stale even if its process id was reused."""
    if fcntl is None:
        return True
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)
    try:
        age = time.time() - directory.stat().st_mtime
    except OSError:
        return True
    return _writer_alive(directory) and age < FRESH_S


def clean_stale(target: Path) -> list[Path]:
    """Delete the hidden directories that killed writes to `target` left behind (those no live
    writer holds). If `target` itself is missing and one of them is a complete plan (the old
    plan of a write killed between its two renames, where RENAME_EXCHANGE is missing), it is put
    back at `target` first. Returns what was deleted."""
    parent = target.parent
    prefix = _staging_prefix(target)
    try:
        stale = [p for p in parent.iterdir() if p.name.startswith(prefix) and p.is_dir()
                 and not p.is_symlink() and not _held(p)]
    except OSError:
        return []
    if not target.exists():
        for candidate in stale:
            if (candidate.name.endswith(OLD_SUFFIX) and not _writer_alive(candidate)
                    and _is_plan_dir(candidate)):
                with contextlib.suppress(OSError):
                    os.rename(candidate, target)
                    stale.remove(candidate)
                    break
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return stale


def _renameat2_exchange():
    """renameat2(AT_FDCWD, a, AT_FDCWD, b, RENAME_EXCHANGE) from libc, or None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        function = libc.renameat2
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                         ctypes.c_uint]
    function.restype = ctypes.c_int
    at_fdcwd, rename_exchange = -100, 2

    def exchange(a: Path, b: Path) -> None:
        if function(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) != 0:
            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code), str(a), None, str(b))

    return exchange


_EXCHANGE = _renameat2_exchange()
# Not supported here (kernel, file system): use the two renames.
_NO_EXCHANGE = {errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP}


def _swap_in(staging: Path, target: Path) -> Path | None:
    """Put `staging` at `target`; returns where the old plan went (to delete), if any."""
    for _ in range(8):  # another compile may create or replace `target` in between
        if not target.exists() and not target.is_symlink():
            try:
                os.rename(staging, target)
                return None
            except OSError as exc:
                if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                    raise
                continue  # a concurrent compile put a plan there first: replace it
        _check_target(target)
        if _EXCHANGE is not None:
            try:
                _EXCHANGE(staging, target)
                return staging  # the old plan now lives under the hidden name
            except OSError as exc:
                if exc.errno == errno.ENOENT:
                    continue
                if exc.errno not in _NO_EXCHANGE:
                    raise
        # Two renames; the old plan's hidden name says to put it back after a kill between.
        old = staging.with_name(staging.name + OLD_SUFFIX)
        try:
            os.rename(target, old)
        except FileNotFoundError:
            continue
        os.rename(staging, target)
        return old
    raise UsageError(f"output {target} keeps changing (another compile writing to it?); "
                     "try again")


def check_output(output: str | os.PathLike) -> Path:
    """The absolute path of `output`; UsageError (exit code 2) now, before any planning, for an
    output that write_plan_dir would refuse: an empty name, the working directory or one
    holding it, a file, a directory that is not a plan or holds files of the user's, a parent
    that is a file."""
    if not str(output).strip():
        raise UsageError("-o: the output directory name is empty")
    target = Path(os.path.abspath(output))
    try:
        cwd = Path(os.getcwd())
    except OSError:
        cwd = None
    if cwd is not None and (target == cwd or target in cwd.parents):
        raise UsageError(f"output {output} is the working directory or holds it; hloplan "
                         "replaces the whole output directory",
                         notes=("run from outside it, or choose another -o directory",))
    _check_target(target)
    for parent in target.parents:
        if parent.exists() or parent.is_symlink():
            if not parent.is_dir():
                raise UsageError(f"output {target}: {parent} is not a directory")
            break
    return target


def write_plan_dir(output: str | os.PathLike, files: dict[str, bytes], timings: dict) -> Path:
    """Replace `output` with the given files, all or nothing (module docstring). Refuses (exit
    code 2) what check_output refuses, and places that cannot be written."""
    target = check_output(output)
    try:
        return _write(target, files, timings)
    except OSError as exc:
        where = exc.filename or target
        raise UsageError(f"cannot write the plan to {output}: {exc.strerror or exc} ({where})",
                         notes=("choose a writable -o directory",)) from None


def _write(target: Path, files: dict[str, bytes], timings: dict) -> Path:
    parent = target.parent
    parent.mkdir(parents=True, exist_ok=True)
    clean_stale(target)
    import tempfile

    staging = Path(tempfile.mkdtemp(prefix=f"{_staging_prefix(target)}{os.getpid()}-",
                                    dir=parent))
    lock = None
    old = None
    try:
        lock = _lock(staging)
        for name, data in files.items():
            (staging / name).parent.mkdir(parents=True, exist_ok=True)
            (staging / name).write_bytes(data)
        (staging / TIMINGS_FILE).write_text(json.dumps(timings, indent=1, sort_keys=True) + "\n")
        old = _swap_in(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    finally:
        _unlock(lock)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return target
