"""hloplan: automatic sharding of exported JAX programs.

    import hloplan
    result = hloplan.compile("step.jaxexport", mesh="2x4", output="plan/")
    step = hloplan.load("plan/")

    planned = hloplan.shard(train_step, state, batch, mesh=jax_mesh)   # in-process
    step = planned.jit()
"""

from __future__ import annotations

from hloplan.emit.loader import PlanLoadError

__version__ = "0.1.0"


def compile(path_or_bytes, mesh, output=None, **options):
    """Plan `path_or_bytes` (StableHLO text, bytecode, portable artifact or serialized Exported)
    for `mesh` ("8", "2x4", "data=2,model=4"); see hloplan.compiler.compile."""
    from hloplan.compiler import compile as _compile

    return _compile(path_or_bytes, mesh, output, **options)


def load(plan_dir, devices=None, donate=True):
    """A callable running the plan in `plan_dir` on the mesh; takes the original pytrees. It
    donates the arguments the export donates, unless `donate=False`. Raises PlanLoadError
    (naming the file and the plan.json field) for a plan directory that is malformed or whose
    artifacts do not match the digests plan.json records."""
    from hloplan.emit.loader import load as _load

    return _load(plan_dir, devices, donate=donate)


def shard(fn, *example_args, mesh, device="cpu", **options):
    """Export `fn` in this process, plan it for the jax Mesh `mesh`, and return a
    hloplan.shard_api.Planned: `.in_shardings`/`.out_shardings` (NamedSharding pytrees for
    jax.jit), `.jit(**jit_kwargs)`, `__call__`, `.plan`, `.explain()`."""
    from hloplan.shard_api import shard as _shard

    return _shard(fn, *example_args, mesh=mesh, device=device, **options)


__all__ = ["PlanLoadError", "__version__", "compile", "load", "shard"]
