"""Run a compiled hloplan artifact: needs only jax and numpy.

This file is copied verbatim into every plan directory as `loader.py`, so a deployment host can
run the plan without hloplan, PuLP or the solver:

    import loader
    step = loader.load("plan/")
    loss, params = step(params, batch)          # same pytrees as the original function

Arguments the export donates (`jax.jit(step, donate_argnums=...)` before `jax.export`) are
donated here too: the program writes its new state into their buffers, as the original does.

`hloplan.load` is this same function.

Multi-process (multi-host) jobs: call `jax.distributed.initialize()` first, then load the plan in
every process of the job.  The mesh is laid row-major over `jax.devices()`, which lists the
devices of process 0 first, then those of process 1, ...: the leading mesh axes are the ones
that cross processes (hosts).  Then either

    outputs = step(params, batch)                       # full arrays, the same on every process
    outputs = step.call_local(local_params, local_batch)  # each process's own part only

`step(...)` builds only this process's shards from the full arrays (`Runner.place`);
`step.local_part(...)` says which part of each full array a process needs, and
`step.place_local(...)` / `step.call_local(...)` take those parts (per-process data loading).
The results are global `jax.Array`s; `step.fetch(outputs)` gathers them into numpy on every
process.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from pathlib import Path, PurePosixPath

PLAN_FILE = "plan.json"
EXPORTED_FILE = "sharded.jaxexport"
PLAN_FORMATS = (1,)
_AXIS_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_SHA256 = re.compile(r"[0-9a-f]{64}\Z")


class PlanLoadError(RuntimeError):
    """A plan directory that cannot be loaded. `file`: the file at fault (a path), `field`: the
    plan.json field (e.g. "mesh.axis_sizes[1]"), when known."""

    def __init__(self, message: str, file: str | os.PathLike | None = None,
                 field: str | None = None):
        self.message = message
        self.file = None if file is None else str(file)
        self.field = field
        where = ": ".join(part for part in (self.file, field) if part)
        super().__init__(f"{where}: {message}" if where else message)


def _fail(path, field, message):
    raise PlanLoadError(message, path, field)


def safe_name(name, path, field) -> str:
    """A file name from plan.json: relative, inside the plan directory (no '..', no absolute
    path, no drive or backslash), so that a crafted plan cannot make a loader open other
    files."""
    if not isinstance(name, str) or not name:
        _fail(path, field, f"expected a file name, got {name!r}")
    pure = PurePosixPath(name)
    if (pure.is_absolute() or ".." in pure.parts or "\\" in name or ":" in name
            or name.startswith("~") or "\x00" in name):
        _fail(path, field, f"file name {name!r} leaves the plan directory")
    return name


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _is_int(value, minimum=None) -> bool:
    return (isinstance(value, int) and not isinstance(value, bool)
            and (minimum is None or value >= minimum))


def _is_number(value) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and not (isinstance(value, float) and math.isnan(value)))


def _check_mesh_fields(mesh, path, field) -> tuple[tuple, tuple]:
    if not isinstance(mesh, dict):
        _fail(path, field, "expected an object with axis_names and axis_sizes")
    names, sizes = mesh.get("axis_names"), mesh.get("axis_sizes")
    if not isinstance(names, list) or not names:
        _fail(path, f"{field}.axis_names", "expected a non-empty list of axis names")
    if not isinstance(sizes, list) or len(sizes) != len(names):
        _fail(path, f"{field}.axis_sizes", f"expected a list of {len(names)} axis sizes")
    for i, name in enumerate(names):
        if not isinstance(name, str) or not _AXIS_NAME.match(name) or names.index(name) != i:
            _fail(path, f"{field}.axis_names[{i}]",
                  f"{name!r} is not a distinct ASCII identifier")
    for i, size in enumerate(sizes):
        if not _is_int(size, 1) or size > 1 << 20:
            _fail(path, f"{field}.axis_sizes[{i}]", f"{size!r} is not a positive device count")
    return tuple(names), tuple(sizes)


def _check_specs(entries, axes, path, field) -> None:
    if not isinstance(entries, list):
        _fail(path, field, "expected a list")
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict):
            _fail(path, f"{field}[{i}]", "expected an object")
        spec = entry.get("spec", [])
        if not isinstance(spec, list):
            _fail(path, f"{field}[{i}].spec", "expected a list (mesh axes per dimension)")
        for d, dim in enumerate(spec):
            if not isinstance(dim, list):
                _fail(path, f"{field}[{i}].spec[{d}]", "expected a list of mesh axes")
            for axis in dim:
                if axis not in axes:
                    _fail(path, f"{field}[{i}].spec[{d}]",
                          f"names mesh axis {axis!r}, which the mesh {list(axes)} does not have")


def check_plan_fields(plan, path) -> None:
    """Raise PlanLoadError (with the field) unless `plan` has the fields the loaders, `run` and
    `explain` read, of the right types."""
    if not isinstance(plan, dict):
        _fail(path, None, f"expected a JSON object, got {type(plan).__name__}")
    for key in ("format", "mesh", "files", "digests", "arguments", "results", "estimate"):
        if key not in plan:
            _fail(path, key, "missing")
    if plan["format"] not in PLAN_FORMATS or not _is_int(plan["format"]):
        _fail(path, "format", f"unsupported plan format {plan['format']!r} (this loader reads "
                              f"{', '.join(map(str, PLAN_FORMATS))})")
    axes, sizes = _check_mesh_fields(plan["mesh"], path, "mesh")
    devices = math.prod(sizes)
    if "devices" in plan["mesh"] and plan["mesh"]["devices"] != devices:
        _fail(path, "mesh.devices", f"{plan['mesh']['devices']!r} is not the product of the "
                                    f"axis sizes ({devices})")
    files, digests = plan["files"], plan["digests"]
    if not isinstance(files, dict):
        _fail(path, "files", "expected an object")
    if not isinstance(digests, dict):
        _fail(path, "digests", "expected an object of file name -> sha256")
    for key, name in files.items():
        safe_name(name, path, f"files.{key}")
        if name not in digests:
            _fail(path, "digests", f"no digest for {name}")
    for name, value in digests.items():
        safe_name(name, path, f"digests.{name}")
        if not isinstance(value, str) or not _SHA256.match(value):
            _fail(path, f"digests.{name}", f"{value!r} is not a sha256 hex digest")
    if EXPORTED_FILE not in digests:
        _fail(path, "digests", f"no digest for {EXPORTED_FILE}")
    _check_specs(plan["arguments"], axes, path, "arguments")
    _check_specs(plan["results"], axes, path, "results")
    estimate = plan["estimate"]
    if not isinstance(estimate, dict):
        _fail(path, "estimate", "expected an object")
    for key in ("step_time_s", "peak_memory_bytes"):
        if not _is_number(estimate.get(key)):
            _fail(path, f"estimate.{key}", f"expected a number, got {estimate.get(key)!r}")
    collectives = estimate.get("collectives", [])
    if not isinstance(collectives, list):
        _fail(path, "estimate.collectives", "expected a list")
    for i, entry in enumerate(collectives):
        if (not isinstance(entry, dict) or not isinstance(entry.get("kind"), str)
                or not _is_int(entry.get("count"), 0) or not _is_number(entry.get("bytes"))):
            _fail(path, f"estimate.collectives[{i}]", "expected {kind, count, bytes}")
    donation = plan.get("donation", {})
    donated = donation.get("arguments", []) if isinstance(donation, dict) else None
    if not isinstance(donated, list) or not all(_is_int(i, 0) for i in donated):
        _fail(path, "donation.arguments", "expected a list of argument indices")
    remat = plan.get("rematerialized")
    if remat is not None and not (isinstance(remat, dict)
                                  and all(_is_int(remat.get(k), 0) for k in ("values", "ops"))):
        _fail(path, "rematerialized", "expected an object with counts 'values' and 'ops'")
    pipeline = plan.get("pipeline")
    if pipeline is not None:
        _check_pipeline(pipeline, devices, digests, path)


def _check_pipeline(pipeline, devices, digests, path) -> None:
    if not isinstance(pipeline, dict):
        _fail(path, "pipeline", "expected an object")
    tasks = pipeline.get("tasks")
    if not tasks:
        return
    if not isinstance(tasks, list):
        _fail(path, "pipeline.tasks", "expected a list")
    submeshes = pipeline.get("submeshes")
    if not isinstance(submeshes, list) or not submeshes:
        _fail(path, "pipeline.submeshes", "expected a non-empty list")
    for s, sub in enumerate(submeshes):
        _, sizes = _check_mesh_fields(sub, path, f"pipeline.submeshes[{s}]")
        ids = sub.get("devices")
        if (not isinstance(ids, list) or len(ids) != math.prod(sizes)
                or not all(_is_int(i, 0) and i < devices for i in ids)):
            _fail(path, f"pipeline.submeshes[{s}].devices",
                  f"expected {math.prod(sizes)} device indices below {devices}")
    for t, task in enumerate(tasks):
        if not isinstance(task, dict):
            _fail(path, f"pipeline.tasks[{t}]", "expected an object")
        name = safe_name(task.get("file"), path, f"pipeline.tasks[{t}].file")
        if name not in digests:
            _fail(path, f"pipeline.tasks[{t}].file", f"{name} has no digest in plan.json")
        if not _is_int(task.get("stage"), 0) or task["stage"] >= len(submeshes):
            _fail(path, f"pipeline.tasks[{t}].stage", f"{task.get('stage')!r} is not a stage")


def verify_files(plan: dict, plan_dir: str | os.PathLike) -> None:
    """Raise PlanLoadError naming the first artifact whose sha256 is not the one plan.json
    records (a missing, truncated, edited or swapped file)."""
    directory = Path(plan_dir)
    for name, expected in sorted(plan["digests"].items()):
        path = directory / name
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise PlanLoadError(f"cannot read: {exc.strerror or exc}", path) from None
        if digest(data) != expected:
            raise PlanLoadError(
                f"does not match plan.json (sha256 {digest(data)[:12]}..., plan.json records "
                f"{expected[:12]}...): the file was changed, truncated or taken from another "
                "plan; compile the plan again", path, f"digests.{name}")


def compiler_options(plan: dict, platform: str) -> dict:
    """XLA options the plan's program needs on `platform`. A plan that recomputes activations
    (plan.json "rematerialized") orders each recomputation after the forward pass with an
    optimization barrier. XLA's GPU compiler removes barriers after scheduling; its CPU
    compiler removes them before, and then schedules the recomputation early, where it saves
    nothing: on CPU the barriers are kept to the end (they compile to nothing)."""
    if plan.get("rematerialized") and platform == "cpu":
        return {"xla_disable_hlo_passes": "cse_barrier_expander"}
    return {}


def read_plan(plan_dir: str | os.PathLike, verify: bool = True) -> dict:
    """plan.json, its fields checked, and (with `verify`) every artifact it lists checked
    against its sha256. Raises PlanLoadError naming the file and the field."""
    path = Path(plan_dir) / PLAN_FILE
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise PlanLoadError(f"no such file; is {plan_dir} an hloplan plan directory?",
                            path) from None
    except OSError as exc:
        raise PlanLoadError(f"cannot read: {exc.strerror or exc}", path) from None
    try:
        plan = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise PlanLoadError(f"not UTF-8 text (byte {exc.start})", path) from None
    except ValueError as exc:  # JSONDecodeError; also an empty or truncated file
        raise PlanLoadError(f"not valid JSON: {exc}", path) from None
    except RecursionError:
        raise PlanLoadError("not valid JSON: nested too deeply", path) from None
    check_plan_fields(plan, path)
    if verify:
        verify_files(plan, plan_dir)
    return plan


def deserialize(path: Path):
    """The jax.export.Exported in `path` (an artifact already checked against its digest)."""
    from jax import export

    try:
        return export.deserialize(bytearray(path.read_bytes()))
    except OSError as exc:
        raise PlanLoadError(f"cannot read: {exc.strerror or exc}", path) from None
    except Exception as exc:  # a file plan.json vouches for, but jax cannot read
        raise PlanLoadError(f"not a serialized jax.export.Exported: {type(exc).__name__}: {exc}",
                            path) from None


def build_mesh(plan: dict, devices=None):
    """The plan's mesh over `devices` (default: jax.devices(), in order), row-major.

    In a multi-process job the default is every device of the job ordered by process (then by
    id), the same list in every process; the mesh must use all of them."""
    import jax
    import numpy as np
    from jax.sharding import AxisType, Mesh

    names = tuple(plan["mesh"]["axis_names"])
    sizes = tuple(plan["mesh"]["axis_sizes"])
    count = int(np.prod(sizes))
    if devices is None:
        devices = list(jax.devices())
        if jax.process_count() > 1:
            devices.sort(key=lambda d: (d.process_index, d.id))
            if len(devices) != count:
                raise PlanLoadError(
                    f"the plan's mesh {dict(zip(names, sizes))} has {count} devices but the "
                    f"{jax.process_count()} processes of this job have {len(devices)}; start "
                    f"processes so that they hold {count} devices in all (on CPU: "
                    f"XLA_FLAGS=--xla_force_host_platform_device_count="
                    f"{max(count // jax.process_count(), 1)} in each)")
    devices = list(devices)
    if len(devices) < count:
        raise PlanLoadError(
            f"the plan needs {count} devices (mesh {dict(zip(names, sizes))}) but only "
            f"{len(devices)} are visible; on CPU set XLA_FLAGS=--xla_force_host_platform_device_count="
            f"{count} before importing jax")
    grid = np.array(devices[:count], dtype=object).reshape(sizes)
    return Mesh(grid, names, axis_types=(AxisType.Auto,) * len(names))


def _local_index(sharding, shape, devices) -> tuple:
    """Per dimension, the sorted indices of the global array that `devices` hold (None: the
    whole dimension).  This is how `jax.make_array_from_process_local_data` packs a process's
    shards into its local array.  Where the held shards do not form a grid (a "non-uniform"
    sharding) the local part is the whole array."""
    import numpy as np

    wanted = set(devices)
    held = {tuple(index[dim].indices(size) for dim, size in enumerate(shape))
            for device, index in sharding.devices_indices_map(tuple(shape)).items()
            if device in wanted}
    per_dim = [sorted({box[dim] for box in held}) for dim in range(len(shape))]
    if int(np.prod([len(ranges) for ranges in per_dim])) != len(held):
        return (None,) * len(shape)
    picks = []
    for size, ranges in zip(shape, per_dim):
        rows = sorted({row for start_stop_step in ranges for row in range(*start_stop_step)})
        picks.append(None if len(rows) == size else np.array(rows, dtype=np.int64))
    return tuple(picks)


def _take(array, picks):
    import numpy as np

    array = np.asarray(array)
    for dim, pick in enumerate(picks):
        if pick is not None:
            array = np.take(array, pick, axis=dim)
    return array


class Runner:
    """Calls the sharded program with the original function's pytrees of arguments."""

    def __init__(self, plan_dir: str | os.PathLike, devices=None, donate: bool = True,
                 plan: dict | None = None):
        import jax

        self.plan_dir = Path(plan_dir)
        self.plan = read_plan(plan_dir) if plan is None else plan
        self.exported = deserialize(self.plan_dir / EXPORTED_FILE)
        self.mesh = build_mesh(self.plan, devices)
        if self.exported.nr_devices != self.mesh.size:
            raise PlanLoadError(f"the program is compiled for {self.exported.nr_devices} devices, "
                                f"the mesh has {self.mesh.size}", self.plan_dir / PLAN_FILE,
                                "mesh.axis_sizes")
        try:
            self.in_shardings = self.exported.in_shardings_jax(self.mesh)
            self.out_shardings = self.exported.out_shardings_jax(self.mesh)
        except Exception as exc:  # axis names of plan.json that the program does not use
            raise PlanLoadError(f"the program's shardings do not fit the mesh: {exc}",
                                self.plan_dir / PLAN_FILE, "mesh") from None
        platform = self.mesh.devices.flat[0].platform
        # The arguments the export donates (jax.jit's donate_argnums, kept by jax.export): their
        # buffers are handed to the program, which writes results into them, as in the
        # original jax.jit. The program is called on the flat argument list so that single
        # leaves of a pytree can be donated.
        self.donated = tuple(self.plan.get("donation", {}).get("arguments", ())) if donate else ()
        if any(i >= len(self.exported.in_avals) for i in self.donated):
            raise PlanLoadError("names an argument the program does not take",
                                self.plan_dir / PLAN_FILE, "donation.arguments")
        exported = self.exported

        def flat_call(*leaves):
            args, kwargs = jax.tree.unflatten(exported.in_tree, leaves)
            return exported.call(*args, **kwargs)

        self._copy = None
        self._flat_call = jax.jit(flat_call, donate_argnums=self.donated,
                                  compiler_options=compiler_options(self.plan, platform) or None)

    @property
    def multi_process(self) -> bool:
        """The mesh has devices this process cannot address (a multi-process job)."""
        return self.mesh.is_multi_process

    def _flatten(self, args, kwargs) -> tuple[list, object]:
        import jax

        leaves, tree = jax.tree.flatten((args, kwargs))
        if tree != self.exported.in_tree:
            raise PlanLoadError(f"arguments have structure {tree}, the plan expects "
                                f"{self.exported.in_tree}")
        return leaves, tree

    def _place_global(self, i: int, leaf, sharding):
        """Argument `i` (the full array, the same in every process) as a global jax.Array; only
        the shards this process addresses are materialised."""
        import jax
        import numpy as np

        aval = self.exported.in_avals[i]
        if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
            return leaf if leaf.sharding == sharding else jax.device_put(leaf, sharding)
        if isinstance(leaf, (np.ndarray, np.generic, jax.Array)):
            array = np.asarray(leaf)
        else:  # a Python scalar or list: the plan's dtype, as jit would make it
            array = np.asarray(leaf, dtype=aval.dtype)
        if array.shape != tuple(aval.shape):
            raise PlanLoadError(f"argument {i} has shape {array.shape}, the plan expects "
                                f"{tuple(aval.shape)}")
        return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])

    def place(self, *args, **kwargs):
        """The arguments, each put on the mesh in the plan's sharding.

        In a multi-process job every process passes the full arrays (the same values in every
        process) and builds only the shards its own devices hold."""
        import jax

        leaves, tree = self._flatten(args, kwargs)
        place = self._place_global if self.multi_process else self._place_local_leaf
        placed = [self._own(i, leaf, place(i, leaf, sharding), sharding)
                  for i, (leaf, sharding) in enumerate(zip(leaves, self.in_shardings))]
        return jax.tree.unflatten(tree, placed)

    @staticmethod
    def _place_local_leaf(i: int, leaf, sharding):
        import jax

        return jax.device_put(leaf, sharding)

    def _own(self, i: int, leaf, placed, sharding):
        """A donated jax.Array that was not on the mesh in its sharding is copied once placed:
        jax.device_put reuses the caller's buffer for a shard on the same device (even with
        may_alias=False, from one device to a replicated sharding), and the donation would
        free it under the caller. One already placed so is handed over, as jax.jit's
        donate_argnums does."""
        import jax

        if i not in self.donated or not isinstance(leaf, jax.Array) or leaf.sharding == sharding:
            return placed
        if self.multi_process and leaf.is_fully_addressable:
            return placed  # built from host memory (_place_global): its own buffers
        if self._copy is None:
            self._copy = jax.jit(lambda x: x)  # an output never aliases an undonated input
        return self._copy(placed)

    def local_leaves(self, leaves, devices=None) -> list:
        """For each flat argument (full arrays), the part the given devices hold (default: this
        process's devices in the mesh), packed the way `place_local` expects it."""
        devices = list(self.mesh.local_devices if devices is None else devices)
        return [_take(leaf, _local_index(sharding, aval.shape, devices))
                for leaf, sharding, aval in zip(leaves, self.in_shardings, self.exported.in_avals)]

    def local_part(self, *args, **kwargs):
        """The part of each full argument this process needs: what `place_local` takes."""
        import jax

        leaves, tree = self._flatten(args, kwargs)
        return jax.tree.unflatten(tree, self.local_leaves(leaves))

    def place_local(self, *args, **kwargs):
        """Like `place`, from each process's own part of every argument (see `local_part`:
        along a dimension the mesh splits across processes, the rows this process's devices
        hold, in order; replicated dimensions whole)."""
        import jax
        import numpy as np

        leaves, tree = self._flatten(args, kwargs)
        placed = []
        for i, (leaf, sharding) in enumerate(zip(leaves, self.in_shardings)):
            aval = self.exported.in_avals[i]
            local = np.asarray(leaf) if hasattr(leaf, "shape") else np.asarray(leaf, dtype=aval.dtype)
            try:
                placed.append(jax.make_array_from_process_local_data(sharding, local, tuple(aval.shape)))
            except (ValueError, TypeError) as exc:
                raise PlanLoadError(f"argument {i}: local part of shape {local.shape} does not fit "
                                    f"global shape {tuple(aval.shape)} in sharding "
                                    f"{sharding.spec}: {exc}") from None
        return jax.tree.unflatten(tree, placed)

    def _call(self, *args, **kwargs):
        import jax

        return self._flat_call(*jax.tree.leaves((args, kwargs)))

    def __call__(self, *args, **kwargs):
        """Run the plan. A donated argument's array is consumed when it is already on the mesh
        in the plan's sharding (as a training loop passes back the last step's state); an
        argument that had to be placed is copied first and the caller's array is kept."""
        placed_args, placed_kwargs = self.place(*args, **kwargs)
        return self._call(*placed_args, **placed_kwargs)

    def call_local(self, *args, **kwargs):
        """Run from each process's own part of the arguments (see `place_local`)."""
        placed_args, placed_kwargs = self.place_local(*args, **kwargs)
        return self._call(*placed_args, **placed_kwargs)

    def lower(self, *args, **kwargs):
        """The program lowered for these arguments (placed as `place` does), for jax's AOT
        API: `.compile().memory_analysis()` and so on."""
        import jax

        placed_args, placed_kwargs = self.place(*args, **kwargs)
        return self._flat_call.lower(*jax.tree.leaves((placed_args, placed_kwargs)))

    def compile_abstract(self, compiler_options: dict | None = None):
        """The program compiled for arguments of the plan's shapes and shardings, with no data
        (donating as a call does): for `memory_analysis()` and `as_text()`."""
        import jax

        args = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
                for a, s in zip(self.exported.in_avals, self.in_shardings)]
        lowered = self._flat_call.lower(*args)
        return lowered.compile(compiler_options) if compiler_options else lowered.compile()

    def fetch(self, outputs):
        """The results as numpy arrays in every process (gathered across processes when the
        mesh spans several: a collective, so every process must call it)."""
        import jax
        import numpy as np

        if not self.multi_process:
            return jax.tree.map(np.asarray, outputs)
        from jax.experimental import multihost_utils

        return jax.tree.map(np.asarray, multihost_utils.process_allgather(outputs, tiled=True))


def load(plan_dir: str | os.PathLike, devices=None, donate: bool = True):
    """A callable running the plan: the pipelined schedule when the plan has pipeline stages or
    microbatches, else the single sharded program. `donate=False` keeps every argument the
    caller passes alive (by default the arguments the export donates are handed to the
    program; in a pipelined plan, to the once-per-step tasks that read them last)."""
    plan = read_plan(plan_dir)
    try:
        if plan.get("pipeline", {}).get("tasks"):
            return pipeline_runner(plan_dir, plan, devices, donate)
        return Runner(plan_dir, devices, donate=donate, plan=plan)
    except Exception as exc:
        note = jax_version_note(plan)
        if note is None:
            raise
        if isinstance(exc, PlanLoadError):
            raise PlanLoadError(f"{note}: {exc.message}", exc.file, exc.field) from exc
        raise PlanLoadError(f"{note}; loading it failed with {type(exc).__name__}: {exc}") from exc


def jax_version_note(plan: dict) -> str | None:
    """When the running jax is not the one that made the plan (plan.json "versions"): a
    sentence saying so, for the error of a plan this jax cannot load."""
    import jax

    made = (plan.get("versions") or {}).get("jax")
    if not made or made == jax.__version__:
        return None
    return (f"this plan was made with jax {made} and the running jax is {jax.__version__}, "
            f"which cannot load its programs: load it with jax {made}, or compile the plan "
            f"again with this jax (hloplan supports jax>=0.9,<0.11)")


def pipeline_runner(plan_dir, plan: dict, devices=None, donate: bool = True):
    """The pipelined plan's runner, from its plan.json already checked by read_plan."""
    runner_class = _pipeline_loader().PipelineRunner
    try:
        return runner_class(plan_dir, devices, donate=donate, plan=plan)
    except PlanLoadError:
        raise
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise PlanLoadError(f"the pipeline section does not fit the plan's programs: "
                            f"{type(exc).__name__}: {exc}", Path(plan_dir) / PLAN_FILE,
                            "pipeline") from None


def _pipeline_loader():
    """hloplan's pipeline runner, or on a deployment host the copy beside this loader.py: never
    the plan directory's own copy, which would run code from whichever plan is loaded."""
    try:
        from hloplan.emit import pipeline_loader
    except ImportError:
        import importlib.util

        path = Path(__file__).resolve().with_name("pipeline_loader.py")
        if not path.is_file():
            raise PlanLoadError("the plan is pipelined and this loader has no pipeline_loader.py "
                                "beside it; use the plan's own loader.py or install hloplan",
                                path) from None
        spec = importlib.util.spec_from_file_location("hloplan_pipeline_loader", path)
        pipeline_loader = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(pipeline_loader)
    return pipeline_loader


def random_inputs(avals, seed: int) -> list:
    """Seeded arrays for the program's flat inputs (`hloplan run --check`, run_distributed.py
    without --inputs): the same arrays for the same seed in every process. Floats are small and
    non-negative, so that optimizer second moments stay valid (sqrt(v)) and long float32 sums
    do not cancel catastrophically in the single-device reference."""
    import numpy as np

    rng = np.random.default_rng(seed)
    leaves = []
    for aval in avals:
        dtype = np.dtype(aval.dtype)
        if dtype == np.bool_:
            leaves.append(rng.random(aval.shape) < 0.5)
        elif np.issubdtype(dtype, np.integer):
            leaves.append(rng.integers(0, 8, size=aval.shape).astype(dtype))
        else:
            leaves.append(rng.uniform(0.0, 0.1, size=aval.shape).astype(dtype))
    return leaves
