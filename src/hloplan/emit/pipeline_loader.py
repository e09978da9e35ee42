"""Run a pipelined hloplan plan: needs only jax and numpy (copied into the plan directory).

The plan's "pipeline" section lists tasks (each a sharded Exported on its stage's submesh), the
dispatch order of (task, microbatch) pairs (GPipe or 1F1B), which inputs carry the batch, which
values are summed over microbatches, and where each result comes from. Tasks are dispatched in
that order with JAX's asynchronous dispatch, so stages on different devices overlap; values move
between submeshes with jax.device_put (resharding on the way when the two sides differ). A
state argument the export donates is donated to the once-per-step task that reads it last
(`_last_state_reads`), which writes the new state into its buffer.

In a multi-process `jax.distributed` job (jax.devices() ordered by process, so the stages of the
leading mesh axis fall on different processes) every process runs the same schedule: it
dispatches every task, sum and transfer in the plan's order, and decides every step that
involves other processes from the plan and the arrays' shardings, never from which shards it
holds. A task on a submesh with no
device of this process does nothing here (it is not a collective: the owners run it whether or
not the others call it) and yields an array with no addressable shards, which keeps the value's
shape and sharding known for later transfers. jax.device_put cannot move an array between
processes (on CPU: "Cannot reshard an input that is not fully addressable"), so a value
crossing processes moves in one program over both submeshes, which every process runs: a mesh
("stage", "dev") of the source and destination devices, the source shards stacked on slice 0
and zeros on slice 1, `lax.ppermute` along "stage" inside `shard_map`; the destination shards
then form the array on the destination submesh (same PartitionSpec), resharded there to the
consumer's sharding. Stages may have submeshes of different sizes (the stage DP gives a heavy
stage more devices): between those, the value is replicated on the source and each destination
device receives a whole copy (a 1-D mesh of both submeshes, ppermute rounds). Results are global arrays on the stage submeshes: `fetch` gathers them
into numpy in every process (a collective as well).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path


class PipelineRunner:
    def __init__(self, plan_dir, devices=None, donate=True, plan=None):
        import jax
        import numpy as np
        from jax import export
        from jax.sharding import AxisType, Mesh

        self.plan_dir = Path(plan_dir)
        # `plan`: plan.json as the loader read and checked it (file names, digests).
        self.plan = json.loads((self.plan_dir / "plan.json").read_text()) if plan is None else plan
        self.pipe = self.plan["pipeline"]
        self.reference = export.deserialize(
            bytearray((self.plan_dir / "sharded.jaxexport").read_bytes()))
        self.multi_process = jax.process_count() > 1
        if devices is None:
            devices = list(jax.devices())
            if self.multi_process:  # the same order in every process (as loader.build_mesh)
                devices.sort(key=lambda d: (d.process_index, d.id))
        devices = list(devices)
        needed = self.plan["mesh"]["devices"]
        if len(devices) < needed:
            raise RuntimeError(f"the plan needs {needed} devices but only {len(devices)} are "
                               "visible")
        # The whole plan's mesh (what loader.Runner.mesh is), for scripts that report on it.
        names, sizes = tuple(self.plan["mesh"]["axis_names"]), tuple(self.plan["mesh"]["axis_sizes"])
        grid = np.array(devices[:int(np.prod(sizes))], dtype=object).reshape(sizes)
        self.mesh = Mesh(grid, names, axis_types=(AxisType.Auto,) * len(names))
        self.exported = self.reference  # in_avals, in_tree, out_tree of the whole step
        self.meshes = []
        for sub in self.pipe["submeshes"]:
            grid = np.array([devices[i] for i in sub["devices"]], dtype=object)
            grid = grid.reshape(tuple(sub["axis_sizes"]))
            self.meshes.append(Mesh(grid, tuple(sub["axis_names"]),
                                    axis_types=(AxisType.Auto,) * len(sub["axis_names"])))
        self._stage_of_devices = {frozenset(mesh.devices.flat): s
                                  for s, mesh in enumerate(self.meshes)}
        self.tasks = []
        for task in self.pipe["tasks"]:
            name = Path(task["file"])
            if name.is_absolute() or ".." in name.parts:  # plan.json not checked by the loader
                raise RuntimeError(f"plan.json: task file {task['file']!r} leaves the plan "
                                   "directory")
            exported = export.deserialize(bytearray((self.plan_dir / name).read_bytes()))
            mesh = self.meshes[task["stage"]]
            self.tasks.append({
                **task,
                "exported": exported,
                "in_shardings": exported.in_shardings_jax(mesh),
                "out_shardings": exported.out_shardings_jax(mesh),
                # out_shardings name the submesh even for a task with no inputs.
                "call": jax.jit(exported.call, out_shardings=exported.out_shardings_jax(mesh)),
            })
        self.microbatches = self.pipe["microbatches"]
        self.blocks = self.pipe.get("microbatch_blocks", 1)
        self.batch_dims = {int(k): v for k, v in self.pipe["argument_batch_dims"].items()}
        self.frontier = set(self.pipe["frontier"])
        self._add = jax.jit(lambda a, b: a + b)
        self._transfers: dict = {}  # (source stage, destination stage) -> (mesh, jitted program)
        self._reshards: dict = {}  # sharding -> jitted identity resharding to it
        self._whole_args: set = set()  # argument value ids not split into microbatches
        self._donating_calls: dict = {}  # (task index, donated inputs) -> jitted task
        self._donatable = self._last_state_reads() if donate else {}

    def _last_state_reads(self) -> dict[int, tuple[int, ...]]:
        """Per once-per-step task, the inputs it may donate: arguments the export donates
        (plan.json "donation") that it reads last in the step (the update tasks run after
        every microbatch, in order; a result passed through from an argument keeps it), each
        with a result of its shape, dtype and sharding to be written into."""
        leaf_value = self.leaf_values()
        donated = {leaf_value[k] for k in self.plan.get("donation", {}).get("arguments", ())
                   if k in leaf_value} - set(self.batch_dims)
        donated -= {o["value"] for o in self.pipe["outputs"] if o["from"] == "argument"}
        last: dict[int, int] = {}  # value -> index of the last once-per-step task reading it
        for t, task in enumerate(self.tasks):
            if task["part"] == "B":
                for v in task["inputs"]:
                    if v in donated:
                        last[v] = t
        found: dict[int, tuple[int, ...]] = {}
        for t, task in enumerate(self.tasks):
            outputs = list(zip(task["exported"].out_avals, task["out_shardings"]))
            picks = []
            for k, (v, sharding, aval) in enumerate(zip(task["inputs"], task["in_shardings"],
                                                        task["exported"].in_avals)):
                if last.get(v) != t:
                    continue
                match = next((o for o, (out, out_sharding) in enumerate(outputs)
                              if out is not None and out.shape == aval.shape
                              and out.dtype == aval.dtype
                              and out_sharding.is_equivalent_to(sharding, len(aval.shape))), None)
                if match is not None:
                    outputs[match] = (None, None)
                    picks.append(k)
            if picks:
                found[t] = tuple(picks)
        return found

    def _flat_args(self, args, kwargs) -> dict[int, object]:
        import jax

        leaves, tree = jax.tree.flatten((args, kwargs))
        if tree != self.reference.in_tree:
            raise ValueError(f"arguments have structure {tree}, the plan expects "
                             f"{self.reference.in_tree}")
        return {v: leaves[k] for k, v in self.leaf_values().items()}

    def leaf_values(self) -> dict[int, int]:
        """Flat argument leaf index -> the value id it is in the plan (the leaves the program
        keeps; a multi-platform export's platform index comes first among the values)."""
        kept = list(self.reference.module_kept_var_idx)
        values = self.pipe["arguments"]
        offset = len(values) - len(kept)
        return {k: values[offset + i] for i, k in enumerate(kept)}

    def _microbatch(self, value_id: int, array, m: int):
        dim = self.batch_dims.get(value_id)
        if dim is None:
            return array
        return microbatch(array, dim, m, self.microbatches, self.blocks)

    # ------------------------------------------------------------------ moving values

    def _move(self, value, sharding, aval=None):
        """`value` in `sharding` (one stage's submesh). Single process: jax.device_put. Across
        processes: see the module docstring; every process calls this in the same order."""
        import jax
        import numpy as np

        if not self.multi_process:
            # An array already laid out so is used as is (device_put would copy it: a second
            # copy of every parameter for the whole step).
            if isinstance(value, jax.Array) and value.sharding.is_equivalent_to(sharding,
                                                                                 value.ndim):
                return value
            return jax.device_put(value, sharding)
        stage = None
        if isinstance(value, jax.Array):
            stage = self._stage_of_devices.get(frozenset(value.sharding.device_set))
        if stage is None:
            if isinstance(value, jax.Array) and not value.is_fully_addressable:
                raise ValueError("in a multi-process job, pass the full arguments as host "
                                 "arrays (the same in every process) or arrays on the plan's "
                                 f"stage submeshes; got an array sharded as {value.sharding}")
            # A host value (or a process-local array), the same in every process: each process
            # builds only the shards its own devices hold.
            dtype = None if aval is None else aval.dtype
            host = np.asarray(value, dtype=dtype)
            return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index],
                                                dtype=host.dtype)
        if value.sharding == sharding:
            return value
        source, target = value.sharding.device_set, sharding.device_set
        if source == target:  # the same submesh: a reshard within it
            return self._reshard(value, sharding)
        processes = {d.process_index for d in source} | {d.process_index for d in target}
        if len(processes) == 1:  # both submeshes in one process: that process copies
            if jax.process_index() in processes:
                return jax.device_put(value, sharding)
            return jax.make_array_from_single_device_arrays(value.shape, sharding, [],
                                                            dtype=value.dtype)
        destination = self._stage_of_devices.get(frozenset(target))
        if destination is None:
            raise ValueError(f"cannot move a value to {sharding}: not a stage submesh")
        moved = self._transfer(value, stage, destination)
        return self._reshard(moved, sharding)

    def _reshard(self, value, sharding):
        """A reshard within one submesh: device_put where this process holds all of the array,
        else a jitted identity (every process of the submesh takes part)."""
        import jax

        if value.sharding == sharding:
            return value
        if value.is_fully_addressable:
            return jax.device_put(value, sharding)
        call = self._reshards.get(sharding)
        if call is None:
            call = self._reshards[sharding] = jax.jit(lambda x: x, out_shardings=sharding)
        return call(value)

    def _transfer(self, value, source: int, destination: int):
        """`value` (on stage `source`'s submesh) on stage `destination`'s submesh, in the same
        PartitionSpec, by one ppermute program over both submeshes' devices (submeshes of the
        same shape; otherwise replicated, see _transfer_replicated)."""
        import jax
        import numpy as np
        from jax.sharding import NamedSharding, PartitionSpec

        src_mesh, dst_mesh = self.meshes[source], self.meshes[destination]
        if src_mesh.shape != dst_mesh.shape:
            return self._transfer_replicated(value, source, destination)
        sharding = value.sharding
        shape = tuple(value.shape)
        if (not isinstance(sharding, NamedSharding) or sharding.mesh != src_mesh
                or len(_shard_shapes(sharding, shape)) > 1):
            # Uneven shards (or a sharding that is not by name): replicate on the source first.
            sharding = NamedSharding(src_mesh, PartitionSpec())
            value = self._reshard(value, sharding)
        block = _shard_shapes(sharding, shape).pop()
        mesh, call = self._transfer_program(source, destination)
        n = src_mesh.size
        stacked = NamedSharding(mesh, PartitionSpec("stage", "dev"))
        mine = {shard.device: shard.data for shard in value.addressable_shards}
        buffers = []
        for device in mesh.local_devices:
            if device in mine:
                buffers.append(mine[device].reshape((1, 1, *block)))
            else:  # a destination device: its slice-1 block is overwritten by the ppermute
                buffers.append(jax.device_put(np.zeros((1, 1, *block), value.dtype), device))
        stacked_value = jax.make_array_from_single_device_arrays(
            (2, n, *block), stacked, buffers, dtype=value.dtype)
        received = {shard.device: shard.data for shard in call(stacked_value).addressable_shards}
        target = NamedSharding(dst_mesh, sharding.spec)
        pieces = [received[d].reshape(block) for d in dst_mesh.devices.flat if d in received]
        return jax.make_array_from_single_device_arrays(shape, target, pieces, dtype=value.dtype)

    def _transfer_replicated(self, value, source: int, destination: int):
        """`value` replicated on stage `destination`'s submesh, for submeshes of different
        shapes: replicated on the source first, then every destination device receives a whole
        copy from one source device (ceil(n_dst / n_src) rounds of ppermute in one program over
        both submeshes' devices, a 1-D mesh "d": sources first)."""
        import jax
        import numpy as np
        from jax.sharding import NamedSharding, PartitionSpec

        src_mesh, dst_mesh = self.meshes[source], self.meshes[destination]
        value = self._reshard(value, NamedSharding(src_mesh, PartitionSpec()))
        shape = tuple(value.shape)
        mesh, call = self._replicated_program(source, destination)
        mine = {shard.device: shard.data for shard in value.addressable_shards}
        buffers = []
        for device in mesh.local_devices:
            if device in mine:
                buffers.append(mine[device].reshape((1, *shape)))
            else:  # a destination device: overwritten by what it receives
                buffers.append(jax.device_put(np.zeros((1, *shape), value.dtype), device))
        stacked = jax.make_array_from_single_device_arrays(
            (mesh.size, *shape), NamedSharding(mesh, PartitionSpec("d")), buffers,
            dtype=value.dtype)
        received = {shard.device: shard.data for shard in call(stacked).addressable_shards}
        target = NamedSharding(dst_mesh, PartitionSpec())
        pieces = [received[d].reshape(shape) for d in dst_mesh.devices.flat if d in received]
        return jax.make_array_from_single_device_arrays(shape, target, pieces, dtype=value.dtype)

    def _replicated_program(self, source: int, destination: int):
        import jax
        import numpy as np
        from jax import lax
        from jax.sharding import AxisType, Mesh, PartitionSpec

        key = ("replicated", source, destination)
        if key not in self._transfers:
            senders = list(self.meshes[source].devices.flat)
            receivers = list(self.meshes[destination].devices.flat)
            mesh = Mesh(np.array(senders + receivers, dtype=object), ("d",),
                        axis_types=(AxisType.Auto,))
            n_src, n_dst = len(senders), len(receivers)
            rounds = [[(k % n_src, n_src + k) for k in range(start, min(start + n_src, n_dst))]
                      for start in range(0, n_dst, n_src)]

            def send(block):
                # A device receives in one round only; ppermute gives zeros elsewhere.
                out = lax.ppermute(block, "d", rounds[0])
                for pairs in rounds[1:]:
                    out = out + lax.ppermute(block, "d", pairs)
                return out

            spec = PartitionSpec("d")
            call = jax.jit(jax.shard_map(send, mesh=mesh, in_specs=spec, out_specs=spec))
            self._transfers[key] = (mesh, call)
        return self._transfers[key]

    def _transfer_program(self, source: int, destination: int):
        import jax
        import numpy as np
        from jax import lax
        from jax.sharding import AxisType, Mesh, PartitionSpec

        key = (source, destination)
        if key not in self._transfers:
            grid = np.array([list(self.meshes[source].devices.flat),
                             list(self.meshes[destination].devices.flat)], dtype=object)
            mesh = Mesh(grid, ("stage", "dev"), axis_types=(AxisType.Auto,) * 2)
            spec = PartitionSpec("stage", "dev")

            def send(block):
                return lax.ppermute(block, "stage", [(0, 1)])

            call = jax.jit(jax.shard_map(send, mesh=mesh, in_specs=spec, out_specs=spec))
            self._transfers[key] = (mesh, call)
        return self._transfers[key]

    # ------------------------------------------------------------------ running

    def _run_task(self, task, env_lookup, held=None, index=None, arguments=None):
        """Run one task; `held` keeps the step's copies of whole arguments (parameters) in each
        sharding a task takes them in, so each is moved once per step, not per microbatch.
        With `index` and the step's `arguments`: the task donates the state it reads last."""
        avals = task["exported"].in_avals
        inputs = []
        for v, s, a in zip(task["inputs"], task["in_shardings"], avals):
            if held is not None and v in self._whole_args:
                if (v, s) not in held:
                    held[(v, s)] = self._move(env_lookup(v), s, a)
                inputs.append(held[(v, s)])
            else:
                inputs.append(self._move(env_lookup(v), s, a))
        call = task["call"]
        if index in self._donatable:
            call = self._donating_call(index, self._owned(index, inputs, arguments))
        outputs = call(*inputs)
        if not isinstance(outputs, (list, tuple)):
            outputs = (outputs,)
        return dict(zip(task["outputs"], outputs))

    def _owned(self, index: int, inputs: list, arguments: dict) -> tuple[int, ...]:
        """Of the inputs task `index` may donate, those whose buffers the step may consume:
        the caller's own array, already laid out as the task takes it (donated by the export,
        as jax.jit's donate_argnums consumes it), or one built from host memory. A copy moved
        from a caller's jax.Array is not donated: jax.device_put may have reused the caller's
        buffer for one of its shards."""
        import jax

        task = self.tasks[index]
        picks = []
        for k in self._donatable[index]:
            given = arguments[task["inputs"][k]]
            if inputs[k] is given or not isinstance(given, jax.Array):
                picks.append(k)
        return tuple(picks)

    def _donating_call(self, index: int, donated: tuple[int, ...]):
        import jax

        if not donated:
            return self.tasks[index]["call"]
        key = (index, donated)
        if key not in self._donating_calls:
            task = self.tasks[index]
            self._donating_calls[key] = jax.jit(task["exported"].call,
                                                out_shardings=task["out_shardings"],
                                                donate_argnums=donated)
        return self._donating_calls[key]

    def __call__(self, *args, **kwargs):
        import jax
        import jax.numpy as jnp

        arguments = self._flat_args(args, kwargs)
        self._whole_args = set(arguments) - set(self.batch_dims)
        held: dict = {}
        per_micro: list[dict] = [{} for _ in range(self.microbatches)]
        sums: dict[int, object] = {}
        concat: dict[int, list] = {}
        concat_values = {o["value"] for o in self.pipe["outputs"] if o["from"] == "concat"}
        # A microbatch's values are dropped after their last reader (gradient accumulation
        # holds one microbatch's activations, not M); the last microbatch keeps what the
        # once-per-step tasks and the results read of it.
        readers: dict[int, int] = {}
        for task in self.tasks:
            if task["part"] == "A":
                for v in task["inputs"]:
                    readers[v] = readers.get(v, 0) + 1
        late = {v for task in self.tasks if task["part"] == "B" for v in task["inputs"]}
        late |= {o["value"] for o in self.pipe["outputs"] if o["from"] == "task"}
        left = [dict(readers) for _ in range(self.microbatches)]
        last = self.microbatches - 1
        # The prologue first: statistics of the whole batch (a masked mean's count) that every
        # microbatch reads as a constant.
        pre: dict[int, object] = {}
        for task in self.tasks:
            if task["part"] == "P":
                pre.update(self._run_task(task, lambda v: pre[v] if v in pre else arguments[v],
                                          held))
        for task_index, m in self.pipe["order"]:
            task = self.tasks[task_index]
            env = per_micro[m]

            def lookup(v, env=env, m=m):
                if v in env:
                    return env[v]
                if v in pre:
                    return pre[v]
                return self._microbatch(v, arguments[v], m)

            produced = self._run_task(task, lookup, held)
            for v in task["inputs"]:
                if v in env:
                    left[m][v] -= 1
                    if left[m][v] == 0 and not (m == last and v in late):
                        del env[v]
            for v, array in produced.items():
                if v in self.frontier:
                    sums[v] = array if v not in sums else self._add(sums[v], array)
                if v in concat_values:
                    concat.setdefault(v, [None] * self.microbatches)[m] = array
                if readers.get(v) or (m == last and v in late):
                    env[v] = array
            produced = array = None  # no reference outlives its microbatch here
        once: dict[int, object] = {}
        for index, task in enumerate(self.tasks):
            if task["part"] != "B":
                continue

            def lookup_b(v):
                if v in once:
                    return once[v]
                if v in sums:
                    return sums[v]
                if v in pre:
                    return pre[v]
                if v in arguments:
                    return arguments[v]
                # A per-microbatch value that does not depend on the batch (a loop carrying
                # parameters through unchanged): every microbatch computed the same.
                return per_micro[-1][v]

            once.update(self._run_task(task, lookup_b, held, index, arguments))
        results = []
        for entry in self.pipe["outputs"]:
            v = entry["value"]
            if entry["from"] == "argument":
                results.append(arguments[v])
            elif entry["from"] == "sum":
                results.append(sums[v])
            elif entry["from"] == "concat":
                if self.multi_process:
                    # One task made every part, on one submesh: concatenate there.
                    first = concat[v][0].sharding
                    parts = [self._move(p, first) for p in concat[v]]
                else:
                    parts = [jax.device_put(p, jax.devices()[0]) for p in concat[v]]
                results.append(unmicrobatch(jnp.concatenate(parts, axis=entry["dim"]),
                                            entry["dim"], self.microbatches, self.blocks))
            else:
                results.append(once[v] if v in once else pre[v] if v in pre
                               else per_micro[-1][v])
        return jax.tree.unflatten(self.reference.out_tree, results)

    def fetch(self, outputs):
        """The results as numpy arrays in every process. In a multi-process job each result is
        first copied, replicated, onto every stage's submesh (so every process holds it): a
        collective, so every process must call it, in the same order."""
        import jax
        import numpy as np
        from jax.sharding import NamedSharding, PartitionSpec

        if not self.multi_process:
            return jax.tree.map(np.asarray, outputs)
        replicated = [NamedSharding(mesh, PartitionSpec()) for mesh in self.meshes]

        def gather(value):
            # Decided the same way in every process (never by what this process holds), so
            # that every process runs the same transfers in the same order.
            if (not isinstance(value, jax.Array)
                    or frozenset(value.sharding.device_set) not in self._stage_of_devices):
                return np.asarray(value)
            copies = [self._move(value, sharding) for sharding in replicated]
            for copy in copies:
                if copy.addressable_shards:
                    return np.asarray(copy.addressable_shards[0].data)
            raise RuntimeError("this process holds no device of the plan's stages")

        return jax.tree.map(gather, outputs)


def live_bytes_on(device) -> int:
    """Bytes of the live jax arrays on `device`, each buffer once (a shard's `.data` is an
    array of its own on the same buffer): what the loader holds there at a moment."""
    import jax

    buffers = {}
    for array in jax.live_arrays():
        for shard in array.addressable_shards:
            if shard.device == device:
                buffers[shard.data.unsafe_buffer_pointer()] = shard.data.nbytes
    return sum(buffers.values())


def microbatch(array, dim: int, m: int, microbatches: int, blocks: int = 1):
    """Microbatch m of M of `array`'s batch dim `dim`, taken from each of `blocks` equal blocks
    of the batch: with the batch split over `blocks` devices (block k on device k), each
    device's share of every microbatch is already its own, and no row moves. The sum over
    microbatches is the same whichever rows a microbatch holds; `unmicrobatch` puts results
    that keep the batch back in order."""
    import jax

    shape = tuple(array.shape)
    if not isinstance(array, jax.Array):  # a host array is cut on the host (a view)
        import numpy as np

        split, index, out = _cut(shape, dim, m, microbatches, blocks)
        return np.asarray(array).reshape(split)[index].reshape(out)
    return _taker(shape, dim, m, microbatches, blocks)(array)


def _cut(shape: tuple, dim: int, m: int, microbatches: int, blocks: int):
    """(the batch dim split into (blocks, microbatches, rest), the index of microbatch m
    there, the microbatch's shape)."""
    inner = shape[dim] // (blocks * microbatches)
    split = shape[:dim] + (blocks, microbatches, inner) + shape[dim + 1:]
    index = (slice(None),) * (dim + 1) + (m,)
    return split, index, shape[:dim] + (blocks * inner,) + shape[dim + 1:]


@functools.lru_cache(maxsize=1024)
def _taker(shape: tuple, dim: int, m: int, microbatches: int, blocks: int):
    import jax

    split, index, out = _cut(shape, dim, m, microbatches, blocks)
    return jax.jit(lambda x: x.reshape(split)[index].reshape(out))


def unmicrobatch(joined, dim: int, microbatches: int, blocks: int = 1):
    """The microbatches' results concatenated along `dim` (microbatch by microbatch) back in
    the batch's order: the inverse of taking them with `microbatch`."""
    if blocks == 1:
        return joined
    import jax.numpy as jnp

    size = joined.shape[dim]
    inner = size // (blocks * microbatches)
    split = joined.reshape(joined.shape[:dim] + (microbatches, blocks, inner)
                           + joined.shape[dim + 1:])
    return jnp.swapaxes(split, dim, dim + 1).reshape(joined.shape)


def _shard_shapes(sharding, shape) -> set:
    """The distinct shapes of the shards of an array of `shape` in `sharding`."""
    return {tuple(len(range(*index.indices(size))) for index, size in zip(indices, shape))
            for indices in sharding.devices_indices_map(tuple(shape)).values()}


def load(plan_dir, devices=None, donate=True, plan=None) -> PipelineRunner:
    return PipelineRunner(plan_dir, devices, donate=donate, plan=plan)
