"""`hloplan.shard`: plan a JAX function in-process and hand back jax.jit shardings.

    planned = hloplan.shard(train_step, state, opt_state, batch, mesh=mesh)
    step = planned.jit(donate_argnums=(0, 1))      # jax.jit(train_step, in_shardings=..., ...)
    state, opt_state, loss = step(state, opt_state, batch)

The function is exported with jax.export in this process and its StableHLO planned as
`hloplan.compile` plans a file; nothing is serialized but the module itself, so any pytree
jax.jit accepts (Flax NNX state, optax states, dataclasses) works as it is. The plan's
shardings come back as pytrees of `NamedSharding` on the caller's mesh, shaped like the
arguments and results.
"""

from __future__ import annotations

import io

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from hloplan.compiler import CompileResult, compile_bytes, make_options
from hloplan.diagnostics import UsageError
from hloplan.mesh import MeshError, parse_mesh


class Planned:
    """A planned function: its shardings for jax.jit, the plan and its explanation."""

    def __init__(self, fn, mesh: Mesh, exported, result: CompileResult, donate_argnums=()):
        self.fn = fn
        self.mesh = mesh
        self.exported = exported
        self.result = result
        self.plan: dict = result.plan
        self._donate_argnums = donate_argnums
        self._jitted = None
        args_shardings, _ = jax.tree.unflatten(exported.in_tree, _in_leaf_shardings(
            self.plan, exported, mesh))
        self.in_shardings = tuple(args_shardings)
        self.out_shardings = jax.tree.unflatten(exported.out_tree, [
            NamedSharding(mesh, _partition_spec(entry["spec"])) for entry in self.plan["results"]])

    def jit(self, **jit_kwargs):
        """jax.jit(fn) with the planned shardings; other jax.jit arguments pass through."""
        jit_kwargs.setdefault("donate_argnums", self._donate_argnums)
        return jax.jit(self.fn, in_shardings=self.in_shardings,
                       out_shardings=self.out_shardings, **jit_kwargs)

    def __call__(self, *args):
        if self._jitted is None:
            self._jitted = self.jit()
        return self._jitted(*args)

    def explain(self, top: int = 10) -> str:
        """The plan explained, as `hloplan explain` prints it."""
        from rich.console import Console

        from hloplan.explain_report import render_text

        console = Console(file=io.StringIO(), width=120, highlight=False, soft_wrap=False,
                          record=True)
        render_text(self.plan, console, top=top)
        return console.export_text()

    def __repr__(self) -> str:
        estimate = self.plan["estimate"]
        return (f"<hloplan.Planned {getattr(self.fn, '__name__', 'fn')} on "
                f"{dict(self.mesh.shape)}: step {estimate['step_time_s']:.3g} s, peak "
                f"{estimate['peak_memory_bytes'] / 2**20:.1f} MiB per device>")


def _partition_spec(spec: list[list[str]]) -> PartitionSpec:
    return PartitionSpec(*(None if not axes else axes[0] if len(axes) == 1 else tuple(axes)
                           for axes in spec))


def _in_leaf_shardings(plan: dict, exported, mesh: Mesh) -> list[NamedSharding]:
    """One sharding per flat argument leaf; leaves the program never reads (dropped from the
    module by jax.export) are replicated."""
    kept = list(exported.module_kept_var_idx)
    arguments = plan["arguments"]
    if len(arguments) != len(kept):
        raise UsageError(f"the plan has {len(arguments)} arguments for the {len(kept)} the "
                         "exported module keeps")
    out = [NamedSharding(mesh, PartitionSpec()) for _ in exported.in_avals]
    for leaf, entry in zip(kept, arguments):
        out[leaf] = NamedSharding(mesh, _partition_spec(entry["spec"]))
    return out


def _abstract(leaf):
    if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype)
    return leaf


def mesh_text(mesh: Mesh) -> str:
    """The planning mesh of a jax Mesh: its axis names and sizes ("data=2,model=4")."""
    return ",".join(f"{name}={size}" for name, size in mesh.shape.items())


def shard(fn, *example_args, mesh: Mesh, device: str = "cpu", donate_argnums=(),
          **compile_options) -> Planned:
    """Plan `fn` for `mesh` (a jax.sharding.Mesh; its axis names and sizes are the planning
    mesh) from `example_args` (arrays or jax.ShapeDtypeStructs, any pytrees). `device`: the
    cost model (cpu, h100, tpu-v5e, ... or a TOML file); `donate_argnums`: the arguments the
    step hands over (its state), as for jax.jit; `compile_options`: those of hloplan.compile
    (memory_budget, time_limit, solver, hosts, gap, verify_memory, ...)."""
    if not isinstance(mesh, Mesh):
        raise UsageError(f"mesh: expected a jax.sharding.Mesh, got {type(mesh).__name__}")
    for unsupported in ("pipeline", "stages", "microbatches", "output"):
        if unsupported in compile_options:
            raise UsageError(f"hloplan.shard plans one jax.jit program; {unsupported!r} needs "
                             "hloplan.compile and hloplan.load")
    if compile_options.setdefault("mesh_views", "off") != "off":
        raise UsageError("hloplan.shard plans the mesh as given (its axis names are the "
                         "shardings'); mesh_views must be 'off'")
    try:
        mesh_spec = parse_mesh(mesh_text(mesh))
    except MeshError as exc:
        raise UsageError(str(exc)) from None
    donate = compile_options.pop("donate", "export")
    options = make_options(mesh_spec, device=device, **compile_options)
    platform = mesh.devices.flat[0].platform
    exported = jax.export.export(jax.jit(fn, donate_argnums=donate_argnums),
                                 platforms=[platform])(*jax.tree.map(_abstract, example_args))
    name = getattr(fn, "__name__", "fn")
    passes = None
    if donate != "export":
        import dataclasses

        from hloplan.passes.extract_graph import ExtractGraph
        from hloplan.passmanager import pass_pipeline

        passes = [dataclasses.replace(step, donate=donate) if isinstance(step, ExtractGraph)
                  else step for step in pass_pipeline()]
    # The module alone, as a portable artifact: no pytree definition is serialized.
    result = compile_bytes(bytes(exported.mlir_module_serialized), f"<{name}>", options,
                           passes=passes)
    if "pipeline" in result.plan:
        raise UsageError("no single-program plan fits the memory budget; the plan found "
                         "accumulates gradients over microbatches, which jax.jit shardings cannot "
                         "express: use hloplan.compile and hloplan.load")
    return Planned(fn, mesh, exported, result, donate_argnums)


__all__ = ["Planned", "mesh_text", "shard"]
