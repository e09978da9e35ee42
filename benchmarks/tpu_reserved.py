"""What libtpu's runtime reserves for a program's temporaries, against what it reports.

    python benchmarks/tpu_reserved.py gpt       # on a machine with one TPU chip (not in CI)

Compiles models.py's train step (realistic widths, one device's batch) for the local TPU chip
with libtpu's dumps on, runs it once on zeros and prints, in bytes:

- `temp_size_in_bytes` of `memory_analysis()`;
- the HBM temporaries of the buffer assignment libtpu dumps (hlo_stats.preallocated_temp_bytes,
  color 0);
- the device's `bytes_reserved` after the run (`Device.memory_stats()`).

docs/tpu.md ("Memory on TPU") quotes the figures; benchmarks/tpu_memory.py's `reserved_bytes`
takes the buffer assignment's figure for that reason.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "src"))


def main(name: str) -> None:
    import jax
    import jax.numpy as jnp
    import models

    from hloplan.hlo_stats import dumped_temp_bytes

    entry = models.MODELS[name]
    cfg = entry.config("realistic", 1)
    device = jax.devices()[0]
    sharding = jax.sharding.SingleDeviceSharding(device)

    def abstract(tree):
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding),
                            models.abstract(tree))

    state, batch = abstract(entry.state_spec(cfg)), abstract(entry.batch_spec(cfg))
    with tempfile.TemporaryDirectory() as dump:
        compiled = jax.jit(entry.make_step(cfg), donate_argnums=(0,)).trace(state, batch).lower(
        ).compile({"xla_dump_to": dump, "xla_dump_hlo_as_text": True})
        hbm_temp = dumped_temp_bytes(dump).get(0, 0)
    zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype, device=device), (state, batch))
    jax.block_until_ready(compiled(*zeros))
    print(f"{name}: temp_size_in_bytes {compiled.memory_analysis().temp_size_in_bytes}, "
          f"buffer assignment HBM temporaries {hbm_temp}, "
          f"bytes_reserved after a run {device.memory_stats()['bytes_reserved']}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "gpt")
