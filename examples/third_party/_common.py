"""Shared plumbing for the third-party examples: export a train step, save it, and (with
--check) plan and verify it with the hloplan command line on simulated CPU devices.

Each example module defines ``MODELS = {name: build}``; ``build()`` returns ``(step, args)``
where ``step`` is a pure function and ``args`` a tuple of pytrees made only of dicts, lists,
tuples and arrays.  That restriction is jax.export's, not hloplan's: ``Exported.serialize()``
refuses pytrees holding unregistered classes (flax ``nnx.State``/``nnx.Param``, equinox modules,
optax's NamedTuple states, ...), so the examples hand those to ``step`` as plain dicts or flat
lists of leaves and rebuild the library objects inside the step.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

DEFAULT_MESHES = ("8", "2x4", "4x2")


def str_keys(tree):
    """Nested dicts with every key made a string: `Exported.serialize()` accepts only string
    dict keys, while `nnx.to_pure_dict` keys list/sequence children (`nnx.List`) by int."""
    if isinstance(tree, dict):
        return {str(k): str_keys(v) for k, v in tree.items()}
    return tree


def int_keys(tree):
    """Undo `str_keys` for the keys that were ints."""
    if isinstance(tree, dict):
        return {(int(k) if isinstance(k, str) and k.isdigit() else k): int_keys(v)
                for k, v in tree.items()}
    return tree


def donated_argnums(step, args) -> tuple[int, ...]:
    """The arguments a training loop donates to `step`, so that the new state is written into
    the old one's buffers: the parameters and optimizer state of a `step(params, opt, x, y)`,
    the state of a `step(state, data)`; an inference function (marked by a `donate_argnums`
    attribute, usually `()`) donates what that says."""
    return tuple(getattr(step, "donate_argnums", (0, 1) if len(args) == 4 else (0,)))


def export_step(step, args, platforms: tuple[str, ...] | None = None) -> bytes:
    """`jax.export` the step for `args`, jitted as a training loop jits it (donated_argnums),
    for `platforms` (default: jax's default backend); the serialized bytes `hloplan compile`
    reads."""
    import jax

    jitted = jax.jit(step, donate_argnums=donated_argnums(step, args))
    exported = jax.export.export(jitted, platforms=platforms)(*args)
    return bytes(exported.serialize())


def save(name: str, step, args, out_dir) -> Path:
    """Write NAME.jaxexport and NAME.inputs.npz (the leaves of `args`, keys arg0..argN)."""
    import jax
    import numpy as np

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.jaxexport"
    path.write_bytes(export_step(step, args))
    leaves = jax.tree.leaves(args)
    np.savez(out / f"{name}.inputs.npz", **{f"arg{i}": np.asarray(x) for i, x in enumerate(leaves)})
    return path


def _hloplan() -> list[str]:
    exe = Path(sys.executable).with_name("hloplan")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "hloplan.cli"]


def _warnings(stderr: str) -> list[str]:
    keep = ("warning", "replicated", "unsupported", "error")
    return [line for line in stderr.splitlines()
            if any(k in line.lower() for k in keep) and "spmd_partitioner" not in line]


def check_with_cli(path: Path, meshes=DEFAULT_MESHES, device: str = "toy") -> bool:
    """`hloplan compile PATH --mesh M --device toy -o DIR` then `hloplan run DIR --check`,
    on random inputs and on the saved example inputs.  Prints one line per step."""
    ok = True
    inputs = path.with_name(path.name.replace(".jaxexport", ".inputs.npz"))
    for mesh in meshes:
        plan = path.with_name(f"{path.stem}.plan-{mesh}")
        started = time.perf_counter()
        proc = subprocess.run([*_hloplan(), "compile", str(path), "--mesh", mesh, "--device", device,
                               "-o", str(plan)], capture_output=True, text=True)
        seconds = time.perf_counter() - started
        print(f"[{path.stem} mesh={mesh}] compile rc={proc.returncode} {seconds:.1f}s")
        for line in _warnings(proc.stderr):
            print(f"    {line}")
        if proc.returncode:
            print(proc.stderr[-2000:])
            ok = False
            continue
        for extra in ([], ["--inputs", str(inputs)]):
            proc = subprocess.run([*_hloplan(), "run", str(plan), "--check", *extra],
                                  capture_output=True, text=True)
            label = "example inputs" if extra else "random inputs"
            verdict = [ln for ln in proc.stdout.splitlines() if ln.startswith("result")]
            print(f"    run --check ({label}) rc={proc.returncode}: "
                  f"{verdict[0] if verdict else proc.stderr.strip()[-500:]}")
            ok &= proc.returncode == 0
    return ok


def main(models: dict, argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", help=f"which to export (default: all of {list(models)})")
    parser.add_argument("-o", "--out", default="third_party_exports", help="output directory")
    parser.add_argument("--check", action="store_true",
                        help="also run hloplan compile + run --check for each mesh")
    parser.add_argument("--mesh", action="append", help="mesh for --check (repeatable; "
                        f"default {' '.join(DEFAULT_MESHES)})")
    args = parser.parse_args(argv)
    ok = True
    for name in args.models or list(models):
        step, step_args = models[name]()
        started = time.perf_counter()
        path = save(name, step, step_args, args.out)
        print(f"exported {path} ({time.perf_counter() - started:.1f}s)")
        if args.check:
            ok &= check_with_cli(path, tuple(args.mesh or DEFAULT_MESHES))
        else:
            print(f"  next: hloplan compile {path} --mesh 2x4 -o {path.stem}.plan && "
                  f"hloplan run {path.stem}.plan --check")
    return 0 if ok else 1
