"""A behaviour check for refactors of the compiler: plan a fixed set of programs every way
hloplan plans (one program; on views of a one-axis mesh; recomputing activations and
accumulating gradients under a tight --memory-budget; pipelined stages and microbatches;
--verify-memory) and print a sha256 of each plan's files. Two runs of the same compiler print
the same digests; a change that keeps plans byte-identical keeps them.

    .venv/bin/python scripts/plan_digest.py --out before.json      # on the code before
    .venv/bin/python scripts/plan_digest.py --compare before.json  # after: what differs

What is digested: every file `hloplan.compile` renders (plan.json, module.mlir, the
.jaxexport programs, the loader, tasks/*), i.e. CompileResult.files. Left out: timings.json
(wall times; CompileResult.timings), the one file of a plan directory that varies between runs.

The programs this script exports itself (the benchmark models, the recomputing and
accumulating cases) carry its own source lines in their locations (JAX records the call
stack), so compare digests made by the same version of this script: to check a change, run
this version on the code before it too (e.g. from a `git worktree add --detach` checkout put
first on PYTHONPATH).
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

FIXTURES = ["mlp_forward", "mlp_train_step", "gpt_train_step", "convnet_train_step",
            "misc_ops", "scan_forward", "scan_train_step"]
MESHES = ["8", "2x4", "2x2x2"]
BENCHMARK_MODELS = ["gpt", "llama", "bert", "moe", "resnet", "mlp"]


def _fixture(name: str) -> bytes:
    return (ROOT / "fixtures" / f"{name}.jaxexport").read_bytes()


def _benchmark(name: str) -> bytes:
    from benchmarks import models

    _, state, batch, step = models.MODELS[name].build("small", 8)
    return models.export_step(step, state, batch).serialize()


def _normalized_mlp() -> bytes:
    """Six batch-normalised layers of 64 units over a batch of 2048: activations outweigh
    parameters, and the batch cannot be split (no accumulation): recomputation fits."""
    import jax
    import jax.numpy as jnp
    from jax import export

    def loss(params, x, y):
        for w, scale, shift in params:
            h = x @ w
            mean = h.mean(0)
            var = ((h - mean) ** 2).mean(0)
            x = jnp.tanh((h - mean) / jnp.sqrt(var + 1e-5) * scale + shift)
        return jnp.mean((x - y) ** 2)

    def step(params, x, y):
        value, grads = jax.value_and_grad(loss)(params, x, y)
        return value, jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

    f32 = jnp.float32
    params = [(jax.ShapeDtypeStruct((64, 64), f32), jax.ShapeDtypeStruct((64,), f32),
               jax.ShapeDtypeStruct((64,), f32)) for _ in range(6)]
    batch = jax.ShapeDtypeStruct((2048, 64), f32)
    return export.export(jax.jit(step))(params, batch, batch).serialize()


def _wide_vocab_gpt() -> bytes:
    """A GPT step whose logits outweigh its parameters: microbatches shrink its peak."""
    import jax
    from jax import export

    from fixtures import models

    params, _, tokens, targets = models.gpt_train_step_args(seed=0, batch=64, seq=32, vocab=512,
                                                            d_model=32, n_layers=2)
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                            (params, tokens, targets))
    return export.export(jax.jit(models.gpt_sgd_step))(*abstract).serialize()


def cases():
    """(name, program thunk, mesh, compile keyword arguments)."""
    from hloplan.compiler import PipelineOptions

    out = []
    for fixture in FIXTURES:
        for mesh in MESHES:
            out.append((f"fixture/{fixture}@{mesh}", lambda f=fixture: _fixture(f), mesh, {}))
    for model in BENCHMARK_MODELS:
        out.append((f"benchmark/{model}@2x4", lambda m=model: _benchmark(m), "2x4", {}))
    out.append(("benchmark/gpt@8", lambda: _benchmark("gpt"), "8", {}))
    out.append(("benchmark/gpt@2x2x2", lambda: _benchmark("gpt"), "2x2x2", {}))
    # A one-axis mesh with every view planned (the default plans the views of one-axis meshes).
    out.append(("views-all/convnet_train_step@8", lambda: _fixture("convnet_train_step"), "8",
                {"device": "cpu", "mesh_views": "all"}))
    out.append(("views-off/gpt_train_step@8", lambda: _fixture("gpt_train_step"), "8",
                {"mesh_views": "off"}))
    # Tight budgets (bytes per device, toy device): recomputation, accumulation, both weighed.
    out.append(("recompute/normalized_mlp@8", _normalized_mlp, "8",
                {"device": "toy", "memory_budget": RECOMPUTE_BUDGET}))
    out.append(("accumulate/wide_vocab_gpt@8", _wide_vocab_gpt, "8",
                {"device": "toy", "memory_budget": ACCUMULATE_BUDGET}))
    out.append(("recompute-or-accumulate/wide_vocab_gpt@8", _wide_vocab_gpt, "8",
                {"device": "toy", "memory_budget": WEIGH_BUDGET}))
    # Recomputing fits, with the user's pipeline options on top.
    out.append(("recompute+pipeline/wide_vocab_gpt@8", _wide_vocab_gpt, "8",
                {"device": "toy", "memory_budget": WEIGH_BUDGET,
                 "pipeline": PipelineOptions(2, 4, "1f1b")}))
    # Nothing fits: the error and its notes (one per way tried).
    out.append(("no-plan/wide_vocab_gpt@8", _wide_vocab_gpt, "8",
                {"device": "toy", "memory_budget": 1}))
    out.append(("no-plan/normalized_mlp@8", _normalized_mlp, "8",
                {"device": "toy", "memory_budget": 1}))
    out.append(("no-plan-pipeline/wide_vocab_gpt@8", _wide_vocab_gpt, "8",
                {"device": "toy", "memory_budget": 1, "pipeline": PipelineOptions(2, 4)}))
    # Pipelines: given stages and microbatches; automatic stages; accumulation as asked.
    out.append(("pipeline-2x4/gpt_train_step@8", lambda: _fixture("gpt_train_step"), "8",
                {"device": "toy", "pipeline": PipelineOptions(2, 4, "1f1b")}))
    out.append(("pipeline-2x4-gpipe/mlp_train_step@2x4", lambda: _fixture("mlp_train_step"),
                "2x4", {"device": "toy", "pipeline": PipelineOptions(2, 4, "gpipe")}))
    out.append(("pipeline-auto/mlp_forward@8", lambda: _fixture("mlp_forward"), "8",
                {"device": "toy", "pipeline": PipelineOptions(None, 2, "1f1b")}))
    out.append(("pipeline-2x4/benchmark-gpt@2x4", lambda: _benchmark("gpt"), "2x4",
                {"pipeline": PipelineOptions(2, 4, "1f1b")}))
    out.append(("accumulate-asked/wide_vocab_gpt@8", _wide_vocab_gpt, "8",
                {"device": "toy", "pipeline": PipelineOptions(1, 4, "1f1b")}))
    # XLA-checked memory (a child process compiles the plan's programs).
    out.append(("verify-memory/convnet_train_step@8", lambda: _fixture("convnet_train_step"),
                "8", {"memory_budget": "1.5MiB", "verify_memory": True}))
    return out


# Budgets per device for the tight cases (toy device): below the smallest plan of the program
# as it stands, so that the fallbacks run.
RECOMPUTE_BUDGET = 1_750_000
ACCUMULATE_BUDGET = 2_300_000
WEIGH_BUDGET = 3_300_000


def _kind(plan: dict) -> str:
    pipe = plan.get("pipeline", {})
    if pipe.get("tasks"):
        return f"pipelined S={pipe['stages']} M={pipe['microbatches']}"
    kind = "recomputed" if plan.get("rematerialized") else "single"
    if plan.get("pipeline"):
        kind += " (pipeline search recorded)"
    return f"{kind} on {plan['mesh'].get('axis_sizes')}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write {case: {file: sha256}} here as JSON")
    parser.add_argument("--only", help="only cases whose name contains this")
    parser.add_argument("--compare", help="a JSON written by --out: list the files that differ")
    args = parser.parse_args(argv)

    import hloplan
    from hloplan.diagnostics import HloplanError

    digests: dict[str, dict] = {}
    programs: dict = {}
    started = time.perf_counter()
    for name, program, mesh, kwargs in cases():
        if args.only and args.only not in name:
            continue
        key = program
        if key not in programs:
            programs[key] = program()
        t0 = time.perf_counter()
        try:
            result = hloplan.compile(programs[key], mesh, **kwargs)
        except HloplanError as error:
            text = str(error)
            digests[name] = {"error": hashlib.sha256(text.encode()).hexdigest()}
            print(f"{name:48s} error {digests[name]['error'][:16]}  "
                  f"({time.perf_counter() - t0:.1f}s) {text.splitlines()[0][:80]}", flush=True)
            continue
        files = {f: hashlib.sha256(body).hexdigest() for f, body in sorted(result.files.items())}
        whole = hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()
        digests[name] = {"all": whole, **files}
        warned = [d.message[:60] for d in result.state.log.warnings]
        print(f"{name:48s} {whole[:16]}  ({time.perf_counter() - t0:.1f}s, {len(files)} files, "
              f"{_kind(result.plan)}) {warned[-1] if warned else ''}", flush=True)
    total = hashlib.sha256(json.dumps(digests, sort_keys=True).encode()).hexdigest()
    print(f"{'TOTAL':48s} {total[:16]}  ({time.perf_counter() - started:.0f}s)")
    if args.out:
        Path(args.out).write_text(json.dumps(digests, indent=1, sort_keys=True) + "\n")
    if args.compare:
        return _compare(json.loads(Path(args.compare).read_text()), digests)
    return 0


def _compare(before: dict, after: dict) -> int:
    """Print each case whose files differ (by name); 1 if any does."""
    differing = 0
    for case in sorted(set(before) | set(after)):
        old, new = before.get(case, {}), after.get(case, {})
        files = sorted(f for f in set(old) | set(new) if f != "all" and old.get(f) != new.get(f))
        if files:
            differing += 1
            print(f"differs: {case}: {', '.join(files)}")
    print(f"{differing} of {len(after)} cases differ from the comparison file")
    return 1 if differing else 0


if __name__ == "__main__":
    sys.exit(main())
