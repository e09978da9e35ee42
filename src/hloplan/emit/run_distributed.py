#!/usr/bin/env python3
"""Run this hloplan plan as one jax.distributed job: start this script once in every process.

Written by hloplan into every plan directory, beside loader.py; needs only jax and numpy.

    srun python plan/run_distributed.py --inputs batch.npz --output results.npz      # SLURM
    JAX_COORDINATOR_ADDRESS=10.0.0.1:1234 JAX_NUM_PROCESSES=2 JAX_PROCESS_ID=0 \\
        python plan/run_distributed.py --check                                    # by hand

`jax.distributed.initialize()` finds the coordinator, the number of processes and this process's
id by itself under SLURM, Open MPI, Cloud TPU and (with `pip install jax[k8s]`) Kubernetes Jobs.
JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID set them explicitly (in a
Kubernetes indexed Job JOB_COMPLETION_INDEX stands in for JAX_PROCESS_ID).  See docs/multihost.md
in hloplan.

Inputs: `--inputs FILE.npz` holds the flat leaves arg0..argN of the original function's
arguments, the full arrays, read by every process (each builds only its own shards); a name
with `{process_id}` in it (`--inputs part{process_id}.npz`) is read per process and holds that
process's part of every argument (`loader.Runner.local_part`).  Without --inputs the script runs
on seeded random inputs (a smoke test).  `--check` compares this process's shards of the
results with the single-device program (reference.jaxexport) run on one of its devices;
`--output FILE.npz` gathers the results and process 0 writes them as res0..resK.
Exit status: 0 ok, 1 the results differ from the reference, 2 setup error.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import signal
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plan", default=str(HERE), help="plan directory (default: this script's)")
    parser.add_argument("--inputs", default=None,
                        help="npz of arg0..argN: full arrays, or per process with {process_id}")
    parser.add_argument("--seed", type=int, default=0, help="random inputs when no --inputs")
    parser.add_argument("--output", default=None, help="npz the results are gathered into (process 0)")
    parser.add_argument("--check", action="store_true",
                        help="compare with the single-device program (reference.jaxexport)")
    parser.add_argument("--rtol", type=float, default=1e-4)
    parser.add_argument("--atol", type=float, default=1e-5)
    parser.add_argument("--local", action="store_true",
                        help="one process, no jax.distributed (all devices local)")
    parser.add_argument("--init-timeout", type=int, default=300,
                        help="seconds to wait for every process to join")
    parser.add_argument("--heartbeat-timeout", type=int, default=100,
                        help="seconds of silence after which a process counts as dead")
    return parser.parse_args(argv)


def initialize(args) -> None:
    import jax

    kwargs = {"initialization_timeout": args.init_timeout,
              "heartbeat_timeout_seconds": args.heartbeat_timeout}
    env = os.environ
    if env.get("JAX_COORDINATOR_ADDRESS"):
        kwargs["coordinator_address"] = env["JAX_COORDINATOR_ADDRESS"]
    if env.get("JAX_NUM_PROCESSES"):
        kwargs["num_processes"] = int(env["JAX_NUM_PROCESSES"])
        process_id = env.get("JAX_PROCESS_ID", env.get("JOB_COMPLETION_INDEX"))
        if process_id is not None:
            kwargs["process_id"] = int(process_id)
    try:
        jax.distributed.initialize(**kwargs)
    except ValueError as exc:
        raise SystemExit(
            f"run_distributed.py: jax.distributed.initialize: {exc}\n"
            "no cluster was detected: run under SLURM (srun), Open MPI, Cloud TPU or a "
            "Kubernetes Job, or set JAX_COORDINATOR_ADDRESS=host:port, JAX_NUM_PROCESSES and "
            "JAX_PROCESS_ID in every process (or pass --local for one process)") from None


def read_npz(path: str, count: int):
    import numpy as np

    with np.load(path) as data:
        missing = [f"arg{i}" for i in range(count) if f"arg{i}" not in data]
        if missing:
            raise SystemExit(f"run_distributed.py: {path}: missing {', '.join(missing)} "
                             f"(expected arg0..arg{count - 1})")
        return [data[f"arg{i}"] for i in range(count)]


def compare(outputs, expected, rtol: float, atol: float) -> tuple[bool, float]:
    """This process's shards of the results against the full reference results."""
    import jax
    import numpy as np

    match, error = True, 0.0
    for got, want in zip(jax.tree.leaves(outputs), jax.tree.leaves(expected)):
        want = np.asarray(want)
        if tuple(got.shape) != want.shape:
            return False, float("inf")
        for shard in got.addressable_shards:
            g, w = np.asarray(shard.data), want[shard.index]
            if g.size == 0:
                continue
            if np.issubdtype(g.dtype, np.inexact):
                error = max(error, float(np.max(np.abs(g.astype(np.float64) - w.astype(np.float64)))))
                match &= bool(np.allclose(g, w, rtol=rtol, atol=atol, equal_nan=True))
            else:
                error = max(error, float(np.max(np.abs(g.astype(np.int64) - w.astype(np.int64)))))
                match &= bool(np.array_equal(g, w))
    return match, error


def main(argv=None) -> int:
    args = parse_args(argv)
    # `kill -USR1 PID` prints every thread's stack: where a stuck process waits.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    if not args.local:
        initialize(args)

    import jax
    import numpy as np

    sys.path.insert(0, str(HERE))
    import loader

    rank, size = jax.process_index(), jax.process_count()
    tag = f"[process {rank}/{size}]"
    try:
        runner = loader.load(args.plan)
    except loader.PlanLoadError as exc:
        print(f"{tag} error: {exc}", file=sys.stderr)
        return 2
    exported = runner.exported
    count = len(exported.in_avals)
    per_process = bool(args.inputs) and "{process_id}" in args.inputs
    if per_process:
        leaves = read_npz(args.inputs.format(process_id=rank), count)
    elif args.inputs:
        leaves = read_npz(args.inputs, count)
    else:
        leaves = loader.random_inputs(exported.in_avals, args.seed)
    tree_args, tree_kwargs = jax.tree.unflatten(exported.in_tree, leaves)
    print(f"{tag} {len(runner.mesh.local_devices)} of {runner.mesh.size} devices, mesh "
          f"{dict(zip(runner.mesh.axis_names, runner.mesh.devices.shape))}", flush=True)
    started = time.perf_counter()
    try:
        outputs = (runner.call_local if per_process else runner)(*tree_args, **tree_kwargs)
    except loader.PlanLoadError as exc:
        print(f"{tag} error: {exc}", file=sys.stderr)
        return 2
    outputs = jax.block_until_ready(outputs)
    print(f"{tag} ran in {time.perf_counter() - started:.3f} s (first call: includes compilation)",
          flush=True)
    status = 0
    if args.check:
        if per_process:
            print(f"{tag} error: --check needs the full inputs (not per-process parts)", file=sys.stderr)
            return 2
        from jax import export

        reference = export.deserialize(bytearray((Path(args.plan) / "reference.jaxexport").read_bytes()))
        device = jax.local_devices()[0]
        local_args, local_kwargs = jax.device_put((tree_args, tree_kwargs), device)
        with jax.default_device(device):
            expected = jax.jit(reference.call)(*local_args, **local_kwargs)
        match, error = compare(outputs, expected, args.rtol, args.atol)
        verdict = "match" if match else "DIFFER FROM"
        print(f"{tag} this process's shards of the results {verdict} the single-device program "
              f"(max abs error {error:.3g})", flush=True)
        status = 0 if match else 1
    if args.output:
        gathered = runner.fetch(outputs)  # a collective: every process takes part
        if rank == 0:
            flat = jax.tree.leaves(gathered)
            np.savez(args.output, **{f"res{i}": leaf for i, leaf in enumerate(flat)})
            print(f"{tag} wrote {len(flat)} results to {args.output}", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
