"""Run a compiled hloplan artifact: needs only jax and numpy.

This file is copied verbatim into every plan directory as `loader.py`, so a deployment host can
run the plan without hloplan, PuLP or the solver:

    import loader
    step = loader.load("plan/")
    loss, params = step(params, batch)          # same pytrees as the original function

`hloplan.load` is this same function.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

PLAN_FILE = "plan.json"
EXPORTED_FILE = "sharded.jaxexport"


class PlanLoadError(RuntimeError):
    pass


def read_plan(plan_dir: str | os.PathLike) -> dict:
    path = Path(plan_dir) / PLAN_FILE
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise PlanLoadError(f"{path}: no such file; is {plan_dir} an hloplan plan directory?") from None


def build_mesh(plan: dict, devices=None):
    """The plan's mesh over `devices` (default: jax.devices(), in order), row-major."""
    import jax
    import numpy as np
    from jax.sharding import AxisType, Mesh

    names = tuple(plan["mesh"]["axis_names"])
    sizes = tuple(plan["mesh"]["axis_sizes"])
    count = int(np.prod(sizes))
    devices = list(jax.devices() if devices is None else devices)
    if len(devices) < count:
        raise PlanLoadError(
            f"the plan needs {count} devices (mesh {dict(zip(names, sizes))}) but only "
            f"{len(devices)} are visible; on CPU set XLA_FLAGS=--xla_force_host_platform_device_count="
            f"{count} before importing jax")
    grid = np.array(devices[:count], dtype=object).reshape(sizes)
    return Mesh(grid, names, axis_types=(AxisType.Auto,) * len(names))


class Runner:
    """Calls the sharded program with the original function's pytrees of arguments."""

    def __init__(self, plan_dir: str | os.PathLike, devices=None):
        import jax
        from jax import export

        self.plan_dir = Path(plan_dir)
        self.plan = read_plan(plan_dir)
        self.exported = export.deserialize(bytearray((self.plan_dir / EXPORTED_FILE).read_bytes()))
        self.mesh = build_mesh(self.plan, devices)
        self.in_shardings = self.exported.in_shardings_jax(self.mesh)
        self.out_shardings = self.exported.out_shardings_jax(self.mesh)
        self._call = jax.jit(self.exported.call)

    def place(self, *args, **kwargs):
        """Flat list of the arguments, each put on the mesh in the plan's sharding."""
        import jax

        leaves, tree = jax.tree.flatten((args, kwargs))
        if tree != self.exported.in_tree:
            raise PlanLoadError(f"arguments have structure {tree}, the plan expects "
                                f"{self.exported.in_tree}")
        placed = [jax.device_put(leaf, sharding) for leaf, sharding in zip(leaves, self.in_shardings)]
        return jax.tree.unflatten(tree, placed)

    def __call__(self, *args, **kwargs):
        placed_args, placed_kwargs = self.place(*args, **kwargs)
        return self._call(*placed_args, **placed_kwargs)

    def lower(self, *args, **kwargs):
        placed_args, placed_kwargs = self.place(*args, **kwargs)
        return self._call.lower(*placed_args, **placed_kwargs)


def load(plan_dir: str | os.PathLike, devices=None) -> Runner:
    return Runner(plan_dir, devices)
