"""Pipelining pays where links between nodes are slow: hloplan's `--stages auto` against the best
single-stage plan, for a GPT-style train step on a 4x8 mesh (4 nodes of 8 GPUs).

    .venv/bin/python benchmarks/pipeline.py [--layers 8 --hidden 1024]

Two cost models: h100-slow-ib (NVLink in a node, 25 GB/s between nodes) and an all-NVLink
domain. For each: the single-stage plan's estimated step, what `--stages auto` chose (stages,
their submesh shapes, microbatches: Alpa's inter-op DP over layer ranges x submeshes), its
estimate and bubble against (S-1)/(M+S-1), every fully planned candidate the search met, how
many (range, submesh) pairs it planned with the ILP, and the planning wall time. Everything is
planned from an abstract export (no memory needed).
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
    parser.add_argument("--max-solves", type=int, default=48,
                        help="ILP solves the stage search may spend per cost model")
    parser.add_argument("--device", action="append", default=None,
                        help="cost model(s) (default: h100-slow-ib and the all-NVLink one)")
    args = parser.parse_args()

    from hloplan.compiler import PipelineOptions, compile_bytes, make_options

    data = export_gpt(args.layers, args.hidden, args.batch, args.seq, args.vocab)
    results = {"model": vars(args), "cases": []}
    devices = args.device or ["h100-slow-ib", str(ROOT / "benchmarks" / "h100-nvlink-all.toml")]
    for device in devices:
        options = make_options(args.mesh, device=device, hosts=4 if "slow" in device else None)
        started = time.perf_counter()
        result = compile_bytes(data, "gpt.jaxexport", options,
                               pipeline=PipelineOptions(None, None, "1f1b",
                                                        max_solves=args.max_solves))
        seconds = time.perf_counter() - started
        plan = result.plan
        pipe = plan.get("pipeline", {})
        single = plan["estimate"]["step_time_s"]
        candidates = pipe.get("candidates", [])
        chosen = {"stages": pipe.get("stages", 1), "microbatches": pipe.get("microbatches", 1),
                  "submeshes": [f"{s['shape'][0]}x{s['shape'][1]}"
                                for s in pipe.get("submeshes", [])] or [args.mesh]}
        best_pipelined = min((c for c in candidates if c["stages"] > 1),
                             key=lambda c: c["step_time_s"], default=None)
        case = {
            "device": Path(device).stem,
            "single_stage_s": single,
            "chosen": chosen,
            "best_pipelined": best_pipelined,
            "speedup_of_best_pipelined": (single / best_pipelined["step_time_s"]
                                          if best_pipelined else None),
            "candidates": [{**c, "bubble_formula": _formula(c["stages"], c["microbatches"])}
                           for c in candidates],
            "search": pipe.get("search"),
            "plan_seconds": seconds,
            "pipeline_search_seconds": result.timings.get("pipeline"),
        }
        print(f"\n{case['device']}: single stage {single * 1e3:.2f} ms; --stages auto chose "
              f"{chosen['stages']} stages ({' + '.join(chosen['submeshes'])}) x "
              f"{chosen['microbatches']} microbatches (planned in {seconds:.0f} s, of which the "
              f"stage search {case['pipeline_search_seconds']:.0f} s)")
        if pipe.get("tasks"):
            est = pipe["estimate"]
            stages, micro = pipe["stages"], pipe["microbatches"]
            times = est["stage_time_s"]
            # Idle fraction of the stages during the pipelined part: equal stages give
            # (S-1)/(M+S-1); unequal ones idle more (each waits for the slowest).
            bubble = 1 - micro * sum(times) / (stages * est["pipeline_s"])
            case["estimate"] = est
            case["bubble"] = bubble
            print(f"  estimate {est['step_time_s'] * 1e3:.2f} ms = pipeline "
                  f"{est['pipeline_s'] * 1e3:.2f} + once per step {est['per_step_s'] * 1e3:.2f}; "
                  f"bubble {bubble:.1%} vs (S-1)/(M+S-1) = {_formula(stages, micro):.1%}")
            for info in pipe["per_stage"]:
                print(f"  stage {info['stage']}: layers {info['layers']}, submesh "
                      f"{info['submesh']['shape']} devices {info['submesh']['devices'][0]}-"
                      f"{info['submesh']['devices'][-1]}, {info['time_per_microbatch_s'] * 1e3:.2f}"
                      f" ms per microbatch (transfers {info['transfer_s'] * 1e3:.3f} ms), "
                      f"{info['memory_bytes'] / 2**30:.1f} GiB")
        search = pipe.get("search") or {}
        if search:
            print(f"  search: {search['layers']} layers x {len(search['submesh_shapes'])} shapes "
                  f"x microbatches {sorted(map(int, search['microbatches_stages']))} = {search['pairs']} pairs, "
                  f"{search['pairs_planned']} planned, {search['ilp_solves']} ILP solves, "
                  f"optimal: {search['optimal']}")
        results["cases"].append(case)
        print("  stages  submeshes            microbatches  est. step (ms)  (S-1)/(M+S-1)  fits")
        for c in case["candidates"]:
            print(f"  {c['stages']:>6}  {' + '.join(c.get('submeshes', [])):<20} "
                  f"{c['microbatches']:>12}  {c['step_time_s'] * 1e3:>14.2f}  "
                  f"{c['bubble_formula']:>13.0%}  {c.get('fits', True)}")
    out = ROOT / "benchmarks" / "pipeline_results.json"
    out.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    print(f"\nwrote {out}")


def _formula(stages: int, microbatches: int) -> float:
    return (stages - 1) / (microbatches + stages - 1)


if __name__ == "__main__":
    main()
