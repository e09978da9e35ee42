"""Run a pipelined hloplan plan: needs only jax and numpy (copied into the plan directory).

The plan's "pipeline" section lists tasks (each a sharded Exported on its stage's submesh), the
dispatch order of (task, microbatch) pairs (GPipe or 1F1B), which inputs carry the batch, which
values are summed over microbatches, and where each result comes from. Tasks are dispatched in
that order with JAX's asynchronous dispatch, so stages on different devices overlap; values move
between submeshes with jax.device_put (resharding on the way when the two sides differ).
"""

from __future__ import annotations

import json
from pathlib import Path


class PipelineRunner:
    def __init__(self, plan_dir, devices=None):
        import jax
        import numpy as np
        from jax import export
        from jax.sharding import AxisType, Mesh

        self.plan_dir = Path(plan_dir)
        self.plan = json.loads((self.plan_dir / "plan.json").read_text())
        self.pipe = self.plan["pipeline"]
        self.reference = export.deserialize(
            bytearray((self.plan_dir / "sharded.jaxexport").read_bytes()))
        devices = list(jax.devices() if devices is None else devices)
        needed = self.plan["mesh"]["devices"]
        if len(devices) < needed:
            raise RuntimeError(f"the plan needs {needed} devices but only {len(devices)} are "
                               "visible")
        self.meshes = []
        for sub in self.pipe["submeshes"]:
            grid = np.array([devices[i] for i in sub["devices"]], dtype=object)
            grid = grid.reshape(tuple(sub["axis_sizes"]))
            self.meshes.append(Mesh(grid, tuple(sub["axis_names"]),
                                    axis_types=(AxisType.Auto,) * len(sub["axis_names"])))
        self.tasks = []
        for task in self.pipe["tasks"]:
            exported = export.deserialize(bytearray((self.plan_dir / task["file"]).read_bytes()))
            mesh = self.meshes[task["stage"]]
            self.tasks.append({
                **task,
                "exported": exported,
                "in_shardings": exported.in_shardings_jax(mesh),
                # out_shardings name the submesh even for a task with no inputs.
                "call": jax.jit(exported.call, out_shardings=exported.out_shardings_jax(mesh)),
            })
        self.microbatches = self.pipe["microbatches"]
        self.batch_dims = {int(k): v for k, v in self.pipe["argument_batch_dims"].items()}
        self.frontier = set(self.pipe["frontier"])
        self._add = jax.jit(lambda a, b: a + b)

    def _flat_args(self, args, kwargs) -> dict[int, object]:
        import jax

        leaves, tree = jax.tree.flatten((args, kwargs))
        if tree != self.reference.in_tree:
            raise ValueError(f"arguments have structure {tree}, the plan expects "
                             f"{self.reference.in_tree}")
        kept = list(self.reference.module_kept_var_idx)
        values = self.pipe["arguments"]
        offset = len(values) - len(kept)
        return {values[offset + i]: leaves[k] for i, k in enumerate(kept)}

    def _microbatch(self, value_id: int, array, m: int):
        dim = self.batch_dims.get(value_id)
        if dim is None:
            return array
        size = array.shape[dim] // self.microbatches
        index = [slice(None)] * array.ndim
        index[dim] = slice(m * size, (m + 1) * size)
        return array[tuple(index)]

    def _run_task(self, task, env_lookup):
        import jax

        inputs = [jax.device_put(env_lookup(v), s)
                  for v, s in zip(task["inputs"], task["in_shardings"])]
        outputs = task["call"](*inputs)
        if not isinstance(outputs, (list, tuple)):
            outputs = (outputs,)
        return dict(zip(task["outputs"], outputs))

    def __call__(self, *args, **kwargs):
        import jax
        import jax.numpy as jnp

        arguments = self._flat_args(args, kwargs)
        per_micro: list[dict] = [{} for _ in range(self.microbatches)]
        sums: dict[int, object] = {}
        concat: dict[int, list] = {}
        concat_values = {o["value"] for o in self.pipe["outputs"] if o["from"] == "concat"}
        for task_index, m in self.pipe["order"]:
            task = self.tasks[task_index]
            env = per_micro[m]

            def lookup(v, env=env, m=m):
                if v in env:
                    return env[v]
                return self._microbatch(v, arguments[v], m)

            produced = self._run_task(task, lookup)
            env.update(produced)
            for v, array in produced.items():
                if v in self.frontier:
                    sums[v] = array if v not in sums else self._add(sums[v], array)
                if v in concat_values:
                    concat.setdefault(v, [None] * self.microbatches)[m] = array
        once: dict[int, object] = {}
        for task in self.tasks:
            if task["part"] != "B":
                continue

            def lookup_b(v):
                if v in once:
                    return once[v]
                if v in sums:
                    return sums[v]
                if v in arguments:
                    return arguments[v]
                # A per-microbatch value that does not depend on the batch (a loop carrying
                # parameters through unchanged): every microbatch computed the same.
                return per_micro[-1][v]

            once.update(self._run_task(task, lookup_b))
        results = []
        for entry in self.pipe["outputs"]:
            v = entry["value"]
            if entry["from"] == "argument":
                results.append(arguments[v])
            elif entry["from"] == "sum":
                results.append(sums[v])
            elif entry["from"] == "concat":
                parts = [jax.device_put(p, jax.devices()[0]) for p in concat[v]]
                results.append(jnp.concatenate(parts, axis=entry["dim"]))
            else:
                results.append(once[v] if v in once else per_micro[-1][v])
        return jax.tree.unflatten(self.reference.out_tree, results)


def load(plan_dir, devices=None) -> PipelineRunner:
    return PipelineRunner(plan_dir, devices)
