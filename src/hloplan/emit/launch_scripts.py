"""Launch scripts written into every plan directory (beside loader.py; jax + numpy only).

`run_distributed.py` runs the plan as one jax.distributed job: started once per process under
SLURM, Open MPI, Cloud TPU, a Kubernetes Job, or by hand with JAX_COORDINATOR_ADDRESS,
JAX_NUM_PROCESSES and JAX_PROCESS_ID (docs/multihost.md).  The file is copied verbatim from
hloplan/emit/run_distributed.py, so the same bytes come out for every plan.
"""

from __future__ import annotations

from importlib import resources

RUN_DISTRIBUTED_FILE = "run_distributed.py"


def launch_scripts() -> dict[str, bytes]:
    """{file name in the plan directory: contents}."""
    source = resources.files("hloplan.emit").joinpath(RUN_DISTRIBUTED_FILE).read_bytes()
    return {RUN_DISTRIBUTED_FILE: source}
