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

import json
import os
from pathlib import Path

PLAN_FILE = "plan.json"
EXPORTED_FILE = "sharded.jaxexport"


class PlanLoadError(RuntimeError):
    pass


def compiler_options(plan: dict, platform: str) -> dict:
    """XLA options the plan's program needs on `platform`. A plan that recomputes activations
    (plan.json "rematerialized") orders each recomputation after the forward pass with an
    optimization barrier. XLA's GPU compiler removes barriers after scheduling; its CPU
    compiler removes them before, and then schedules the recomputation early, where it saves
    nothing: on CPU the barriers are kept to the end (they compile to nothing)."""
    if plan.get("rematerialized") and platform == "cpu":
        return {"xla_disable_hlo_passes": "cse_barrier_expander"}
    return {}


def read_plan(plan_dir: str | os.PathLike) -> dict:
    path = Path(plan_dir) / PLAN_FILE
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise PlanLoadError(f"{path}: no such file; is {plan_dir} an hloplan plan directory?") from None


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

    def __init__(self, plan_dir: str | os.PathLike, devices=None, donate: bool = True):
        import jax
        from jax import export

        self.plan_dir = Path(plan_dir)
        self.plan = read_plan(plan_dir)
        self.exported = export.deserialize(bytearray((self.plan_dir / EXPORTED_FILE).read_bytes()))
        self.mesh = build_mesh(self.plan, devices)
        self.in_shardings = self.exported.in_shardings_jax(self.mesh)
        self.out_shardings = self.exported.out_shardings_jax(self.mesh)
        platform = self.mesh.devices.flat[0].platform
        # The arguments the export donates (jax.jit's donate_argnums, kept by jax.export): their
        # buffers are handed to the program, which writes results into them, as in the
        # original jax.jit. The program is called on the flat argument list so that single
        # leaves of a pytree can be donated.
        self.donated = tuple(self.plan.get("donation", {}).get("arguments", ())) if donate else ()
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
            return _pipeline_loader(plan_dir).load(plan_dir, devices, donate=donate)
        return Runner(plan_dir, devices, donate=donate)
    except Exception as exc:
        note = jax_version_note(plan)
        if note is None or isinstance(exc, PlanLoadError):
            raise
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


def _pipeline_loader(plan_dir):
    """hloplan's pipeline runner, or the copy in the plan directory on a deployment host."""
    try:
        from hloplan.emit import pipeline_loader
    except ImportError:
        import importlib.util

        path = Path(plan_dir) / "pipeline_loader.py"
        spec = importlib.util.spec_from_file_location("hloplan_pipeline_loader", path)
        pipeline_loader = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(pipeline_loader)
    return pipeline_loader
