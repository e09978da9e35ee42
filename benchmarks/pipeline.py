"""Pipelining pays where links between nodes are slow: hloplan's `--stages auto` against the best
single-stage plan, for a GPT-style train step on a 4x8 mesh (4 nodes of 8 GPUs).

    .venv/bin/python benchmarks/pipeline.py [--layers 8 --hidden 1024]

Two cost models: h100-slow-ib (NVLink in a node, 25 GB/s between nodes) and an all-NVLink
domain. For each: the single-stage plan's estimated step, every pipelined candidate hloplan
planned (stages x microbatches), what `--stages auto` chose, and each candidate's bubble
against (S-1)/(M+S-1). Everything is planned from an abstract export (no memory needed).
Writes benchmarks/pipeline_results.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def export_gpt(layers: int, hidden: int, batch: int, seq: int, vocab: int) -> bytes:
    import jax
    from jax import export

    from fixtures import models

    key = jax.random.key(0)
    params = jax.eval_shape(lambda k: models.gpt_params(k, vocab=vocab, seq=seq, d_model=hidden,
                                                        n_layers=layers), key)
    opt = {"m": params, "v": params, "step": jax.ShapeDtypeStruct((), jax.numpy.int32)}
    tokens = jax.ShapeDtypeStruct((batch, seq), jax.numpy.int32)
    exported = export.export(jax.jit(models.gpt_train_step))(params, opt, tokens, tokens)
    return exported.serialize()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--mesh", default="4x8")
    args = parser.parse_args()

    from hloplan.compiler import PipelineOptions, compile_bytes, make_options

    data = export_gpt(args.layers, args.hidden, args.batch, args.seq, args.vocab)
    results = {"model": vars(args), "cases": []}
    for device in ("h100-slow-ib", str(ROOT / "benchmarks" / "h100-nvlink-all.toml")):
        options = make_options(args.mesh, device=device, hosts=4 if "slow" in device else None)
        started = time.perf_counter()
        result = compile_bytes(data, "gpt.jaxexport", options,
                               pipeline=PipelineOptions(None, None, "1f1b"))
        seconds = time.perf_counter() - started
        plan = result.plan
        pipe = plan.get("pipeline", {})
        single = plan["estimate"]["step_time_s"]
        candidates = pipe.get("candidates", [])
        chosen = (pipe.get("stages", 1), pipe.get("microbatches", 1))
        best_pipelined = min((c for c in candidates if c["stages"] > 1),
                             key=lambda c: c["step_time_s"], default=None)
        case = {
            "device": Path(device).stem,
            "single_stage_s": single,
            "chosen": {"stages": chosen[0], "microbatches": chosen[1]},
            "best_pipelined": best_pipelined,
            "speedup_of_best_pipelined": (single / best_pipelined["step_time_s"]
                                          if best_pipelined else None),
            "candidates": [{**c, "bubble": (c["stages"] - 1) / (c["microbatches"] + c["stages"] - 1)}
                           for c in candidates],
            "plan_seconds": seconds,
        }
        if pipe.get("tasks"):
            case["estimate"] = pipe["estimate"]
            print(f"  chosen pipeline: stage times per microbatch "
                  f"{[round(t * 1e3, 3) for t in pipe['estimate']['stage_time_s']]} ms, transfers "
                  f"{[round(t * 1e3, 3) for t in pipe['estimate']['transfer_s']]} ms, once per step "
                  f"{pipe['estimate']['per_step_s'] * 1e3:.3f} ms")
        results["cases"].append(case)
        print(f"\n{case['device']}: single stage {single * 1e3:.2f} ms; --stages auto chose "
              f"{chosen[0]} stages x {chosen[1]} microbatches (planned in {seconds:.0f} s)")
        print("  stages  microbatches  est. step (ms)  bubble (S-1)/(M+S-1)  fits")
        for c in case["candidates"]:
            print(f"  {c['stages']:>6}  {c['microbatches']:>12}  {c['step_time_s'] * 1e3:>14.2f}  "
                  f"{c['bubble']:>20.0%}  {c.get('fits', True)}")
    out = ROOT / "benchmarks" / "pipeline_results.json"
    out.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
