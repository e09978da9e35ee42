"""A language model's vocabulary weight gradient on a TPU chip: how often its kernel reads the
logits it recomputes (the softmax gradient), against the output tiles libtpu picks.

On the chip (jax and libtpu only; repository root):

    python3 benchmarks/tpu_chip_vocab.py -o vocab.json

For each (tokens, d, vocab) of SHAPES, a step of rms_norm(x) @ w -> softmax cross entropy ->
gradient of w -> AdamW update of w (the tail of benchmarks/models.py's llama, alone) is
compiled, timed (median of 10 steps) and profiled (3 steps): the device time of the weight
gradient's kernel (the kOutput fusion writing the [d, vocab] weight), its FLOP time at
`--flops`, the logits' read time at `--hbm`, the update's traffic time, and libtpu's output
window (row tile, row tiles) from the compiled HLO. `reads` = (kernel time - FLOP time -
update traffic) / logits read time: the logits' reads the kernel's time holds in series with
its FLOPs (strategies.restream_passes prices them as one per row tile; docs/tpu.md).
Here (no chip), `--compile-only` compiles for the v5e:1x1 topology and reports the tiles.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

# (tokens, d, vocab): llama's, gpt's and bert's heads (benchmarks/models.py, realistic), and
# wider and narrower d for the tile count.
SHAPES = [(8192, 2048, 32000), (8192, 1536, 50304), (8192, 1024, 30720), (4096, 768, 50304),
          (8192, 3072, 32000), (8192, 4096, 32000), (4096, 2048, 128256)]


def _step(state, x, targets):
    import jax
    import jax.numpy as jnp

    w, m, v, scale = state

    def loss(w):
        h = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * scale
        logits = h @ w
        lse = jax.nn.logsumexp(logits, axis=-1)
        return jnp.mean(lse - jnp.take_along_axis(logits, targets[..., None], -1)[..., 0])

    g = jax.grad(loss)(w)
    m = 0.9 * m + 0.1 * g
    v = 0.95 * v + 0.05 * g * g
    w = w - 1e-3 * (m / (jnp.sqrt(v) + 1e-8) + 0.01 * w)
    return (w, m, v, scale)


def _window(text: str, d: int, vocab: int) -> dict:
    for line in text.splitlines():
        if (re.search(rf"= \(?f32\[{d},{vocab}\]", line) and "kind=kOutput" in line
                and "window_config" in line):
            name = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = ", line).group(1)
            window = [int(v) for v in re.search(r'"output_window_bounds":\[([^\]]*)\]',
                                                line).group(1).replace('"', '').split(",")]
            rows = window[-2] * 8
            return {"kernel": name, "output_window": window, "row_tile": rows,
                    "row_tiles": -(-d // rows)}
    return {}


def run(out: str, compile_only: bool, flops: float, hbm: float) -> None:
    if compile_only:
        os.environ.update(JAX_PLATFORMS="cpu", TPU_SKIP_MDS_QUERY="1",
                          ALLOW_MULTIPLE_LIBTPU_LOAD="1")
    import jax
    import jax.numpy as jnp
    import numpy as np

    rows = []
    for tokens, d, vocab in SHAPES:
        shapes = ((d, vocab),) * 3 + ((d,),)
        if compile_only:
            from jax.sharding import SingleDeviceSharding

            from hloplan.tpu import parse_topology, topology_devices

            dev = SingleDeviceSharding(topology_devices(parse_topology("v5e:1x1"))[0])
            state = tuple(jax.ShapeDtypeStruct(s, jnp.float32, sharding=dev) for s in shapes)
            x = jax.ShapeDtypeStruct((8, tokens // 8, d), jnp.float32, sharding=dev)
            t = jax.ShapeDtypeStruct((8, tokens // 8), jnp.int32, sharding=dev)
        else:
            rng = np.random.default_rng(0)
            state = tuple(jnp.asarray(rng.random(s, np.float32) * 0.01) for s in shapes)
            x = jnp.asarray(rng.random((8, tokens // 8, d), np.float32))
            t = jnp.asarray(rng.integers(0, vocab, (8, tokens // 8)), jnp.int32)
        compiled = jax.jit(_step, donate_argnums=(0,)).lower(state, x, t).compile()
        row = {"tokens": tokens, "d": d, "vocab": vocab,
               **_window(compiled.as_text(), d, vocab)}
        if not compile_only:
            import tempfile

            import tpu_chip

            times = []
            for i in range(12):
                started = time.perf_counter()
                state = compiled(state, x, t)
                jax.block_until_ready(state)
                if i >= 2:
                    times.append(time.perf_counter() - started)
            with tempfile.TemporaryDirectory() as trace:
                with jax.profiler.trace(trace):
                    for _ in range(3):
                        state = compiled(state, x, t)
                        jax.block_until_ready(state)
                ops = tpu_chip._device_kernels(trace, 3).get("ops", {})
            kernel = sum(s for e, s in ops.items()
                         if re.match(r"\s*%?([\w.\-]+)", e).group(1) == row.get("kernel"))
            flop_s = 2.0 * tokens * d * vocab / flops
            logits_s = 4.0 * tokens * vocab / hbm
            update_s = 4.0 * d * vocab * 6 / hbm  # w, m, v read and written
            row.update(step_s=statistics.median(times), kernel_s=kernel, flop_s=flop_s,
                       logits_read_s=logits_s, update_s=update_s,
                       reads=(kernel - flop_s - update_s) / logits_s)
        rows.append(row)
        print(json.dumps(row), flush=True)
        Path(out).write_text(json.dumps({"jax": jax.__version__, "rows": rows}, indent=1) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("-o", "--output", required=True)
    parser.add_argument("--compile-only", action="store_true",
                        help="compile for v5e:1x1 here (libtpu, no chip): the tiles only")
    parser.add_argument("--flops", type=float, default=177e12,
                        help="the [matmul] rate of these shapes on the chip (FLOP/s)")
    parser.add_argument("--hbm", type=float, default=628e9, help="HBM read + write bytes/s")
    args = parser.parse_args()
    run(args.output, args.compile_only, args.flops, args.hbm)


if __name__ == "__main__":
    main()
