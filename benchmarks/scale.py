"""Scale benchmark: how long hloplan takes to plan big transformer train steps.

GPT-style decoder train steps (token embedding, L pre-LN blocks of attention + MLP, LM head,
cross-entropy, AdamW written by hand), exported abstractly from `jax.ShapeDtypeStruct`s (no
memory is allocated, so 175B parameters are fine), then planned with
`hloplan.compiler.compile_bytes(..., make_options(mesh, device="h100"))` for meshes up to
16x8x8 (1,024 devices). The compile pipeline runs with tie-repeated-layers always on (its
size thresholds set to 0, so small and large cases are planned alike) or, for the "-untied"
cases, without it.

Each case runs in its own subprocess with a timeout and a heap limit; a case that runs out of
time or memory is recorded as such. Exports are cached under $HLOPLAN_SCALE_CACHE (default
/tmp/hloplan-scale-cache) and are not timed. Results go to benchmarks/scale_results.json and a
markdown table on stdout.

    .venv/bin/python benchmarks/scale.py                 # the default suite
    .venv/bin/python benchmarks/scale.py --quick         # a few small cases
    .venv/bin/python benchmarks/scale.py --only llama3-8b --timeout 600
    .venv/bin/python benchmarks/scale.py --case NAME     # one case in this process (JSON out)

Measured per case: wall time of the whole compile and of every step (CompileResult-style
timings: parse, each pass, emit, solver), ILP size (plan.json "solver"), decisions before and
after tying repeated layers, the tied plan's objective against the untied optimum where the
untied problem is solved too (small depths), and the compiler's peak RSS.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import resource
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "scale_results.json"

# ---------------------------------------------------------------------------------------------
# The model


@dataclass(frozen=True)
class Config:
    layers: int
    d: int
    heads: int
    kv_heads: int | None = None  # None: as many as heads (multi-head attention)
    ffn: int | None = None  # None: 4 * d
    gated: bool = False  # SwiGLU MLP (Llama) instead of GELU with biases (GPT)
    vocab: int = 50304
    seq: int = 2048
    batch: int = 32
    learned_positions: bool = True

    @property
    def kv(self) -> int:
        return self.kv_heads or self.heads

    @property
    def hidden(self) -> int:
        return self.ffn or 4 * self.d

    def parameters(self) -> int:
        d, hd = self.d, self.d // self.heads
        attn = d * self.heads * hd + 2 * d * self.kv * hd + self.heads * hd * d
        mlp = (3 if self.gated else 2) * d * self.hidden + (0 if self.gated else self.hidden + d)
        per_layer = attn + mlp + 4 * d + (0 if self.gated else d)
        embed = self.vocab * d + (self.seq * d if self.learned_positions else 0)
        return self.layers * per_layer + embed + 2 * d + d * self.vocab


def param_shapes(c: Config) -> dict:
    """The parameter pytree as (shape) tuples."""
    d, hd = c.d, c.d // c.heads
    layer = {
        "ln1": {"scale": (d,), "bias": (d,)},
        "wq": (d, c.heads, hd),
        "wk": (d, c.kv, hd),
        "wv": (d, c.kv, hd),
        "wo": (c.heads, hd, d),
        "ln2": {"scale": (d,), "bias": (d,)},
    }
    if c.gated:
        layer.update(w_gate=(d, c.hidden), w_up=(d, c.hidden), w_down=(c.hidden, d))
    else:
        layer.update(b_o=(d,), w_fc=(d, c.hidden), b_fc=(c.hidden,), w_out=(c.hidden, d),
                     b_out=(d,))
    params = {"wte": (c.vocab, d), "layers": [layer] * c.layers,
              "ln_f": {"scale": (d,), "bias": (d,)}, "w_head": (d, c.vocab)}
    if c.learned_positions:
        params["wpe"] = (c.seq, d)
    return params


def make_step(c: Config):
    import jax
    import jax.numpy as jnp
    import models  # benchmarks/models.py, beside this script
    from jax import lax

    def layer_norm(x, p, eps=1e-5):
        mean = jnp.mean(x, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
        return (x - mean) * lax.rsqrt(var + eps) * p["scale"] + p["bias"]

    def attention(h, p):
        b, t, _ = h.shape
        hd = c.d // c.heads
        q = jnp.einsum("btd,dhk->bthk", h, p["wq"])
        k = jnp.einsum("btd,dhk->bthk", h, p["wk"])
        v = jnp.einsum("btd,dhk->bthk", h, p["wv"])
        mask = jnp.tril(jnp.ones((t, t), dtype=bool))
        if c.kv == c.heads:
            s = jnp.einsum("bqhk,bthk->bhqt", q, k) / math.sqrt(hd)
            s = jnp.where(mask, s, jnp.finfo(s.dtype).min)
            o = jnp.einsum("bhqt,bthk->bqhk", jax.nn.softmax(s, axis=-1), v)
        else:  # grouped-query attention: heads = kv groups x repeats
            q = q.reshape(b, t, c.kv, c.heads // c.kv, hd)
            s = jnp.einsum("bqgrk,btgk->bgrqt", q, k) / math.sqrt(hd)
            s = jnp.where(mask, s, jnp.finfo(s.dtype).min)
            o = jnp.einsum("bgrqt,btgk->bqgrk", jax.nn.softmax(s, axis=-1), v)
            o = o.reshape(b, t, c.heads, hd)
        return jnp.einsum("bthk,hkd->btd", o, p["wo"])

    def mlp(h, p):
        if c.gated:
            return (jax.nn.silu(h @ p["w_gate"]) * (h @ p["w_up"])) @ p["w_down"]
        return jax.nn.gelu(h @ p["w_fc"] + p["b_fc"]) @ p["w_out"] + p["b_out"]

    def block(x, p):
        a = attention(layer_norm(x, p["ln1"]), p)
        x = x + (a if c.gated else a + p["b_o"])
        return x + mlp(layer_norm(x, p["ln2"]), p)

    def loss_fn(params, tokens, targets):
        x = params["wte"][tokens]
        if c.learned_positions:
            x = x + params["wpe"][None]
        for p in params["layers"]:  # unrolled: one copy of the block per layer
            x = block(x, p)
        logits = layer_norm(x, params["ln_f"]) @ params["w_head"]
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))

    def adamw(params, grads, opt):
        # The benchmark models' AdamW (benchmarks/models.py), with large-model settings.
        return models.adamw(params, grads, opt, lr=1e-4, wd=0.1)

    def step(state, tokens, targets):
        loss, grads = jax.value_and_grad(loss_fn)(state["params"], tokens, targets)
        params, opt = adamw(state["params"], grads, state["opt"])
        return loss, {"params": params, "opt": opt}

    return step


def export_bytes(c: Config) -> bytes:
    """The serialized jax.export.Exported of the train step, traced on ShapeDtypeStructs."""
    import jax
    import jax.numpy as jnp
    from jax import export

    def leaf(shape):
        return jax.ShapeDtypeStruct(shape, jnp.float32)

    params = jax.tree.map(leaf, param_shapes(c), is_leaf=lambda x: isinstance(x, tuple))
    state = {"params": params,
             "opt": {"m": params, "v": params, "count": jax.ShapeDtypeStruct((), jnp.int32)}}
    tokens = jax.ShapeDtypeStruct((c.batch, c.seq), jnp.int32)
    exported = export.export(jax.jit(make_step(c)), platforms=("cpu",))(state, tokens, tokens)
    return bytes(exported.serialize())


# ---------------------------------------------------------------------------------------------
# Cases


def gpt(layers: int, d: int, heads: int, **kw) -> Config:
    return Config(layers=layers, d=d, heads=heads, **kw)


def llama3_8b(layers: int = 32, **kw) -> Config:
    return Config(layers=layers, d=4096, heads=32, kv_heads=8, ffn=14336, gated=True,
                  vocab=128256, seq=2048, learned_positions=False, **kw)


def gpt3_175b(layers: int = 96, **kw) -> Config:
    return Config(layers=layers, d=12288, heads=96, vocab=50304, seq=2048, **kw)


@dataclass(frozen=True)
class Case:
    name: str
    config: Config
    mesh: str
    compare_untied: bool = False  # also solve the untied problem (small depths only)
    tie: bool = True  # plan with tie-repeated-layers (False: the untied pipeline)
    period: int = 1  # TieRepeatedLayers.period
    target_s: float | None = None
    tags: tuple[str, ...] = ()
    solver: str = "auto"  # CompileOptions.solver: auto (HiGHS), highs, cbc
    decompose: str = "auto"  # CompileOptions.decompose: auto, always, never (the whole ILP)
    time_limit: float = 60.0  # CompileOptions.time_limit (seconds for the solver)


def _suite() -> list[Case]:
    cases = []
    # Depth: a GPT with hidden 1024 on 32 devices; the untied problem is solved where small.
    for layers in (2, 8, 24, 48, 96):
        cases.append(Case(f"gpt-d1024-L{layers}-8x4", gpt(layers, 1024, 16, seq=1024, batch=32),
                          "8x4", compare_untied=layers <= 8, tags=("depth",)))
    cases.append(Case("gpt-d1024-L8-8x4-untied", gpt(8, 1024, 16, seq=1024, batch=32), "8x4",
                      tie=False, tags=("depth",)))
    cases.append(Case("gpt-d1024-L8-8x4-period2", gpt(8, 1024, 16, seq=1024, batch=32), "8x4",
                      compare_untied=True, period=2, tags=("depth",)))
    # The same plans with CBC (through PuLP) instead of HiGHS.
    cases.append(Case("gpt-d1024-L8-8x4-cbc", gpt(8, 1024, 16, seq=1024, batch=32), "8x4",
                      solver="cbc", tags=("depth", "cbc")))
    # Width: 8 layers, hidden 1024..12288, on 64 devices.
    for d, heads in ((1024, 16), (2048, 16), (4096, 32), (8192, 64), (12288, 96)):
        cases.append(Case(f"gpt-d{d}-L8-8x8", gpt(8, d, heads, batch=64), "8x8",
                          compare_untied=d == 1024, tags=("width",)))
    # Named shapes.
    cases.append(Case("llama3-8b-L2-8x4", llama3_8b(2, batch=32), "8x4", compare_untied=True,
                      tags=("llama3",)))
    cases.append(Case("llama3-8b-L32-8x4", llama3_8b(batch=32), "8x4", target_s=5.0,
                      tags=("llama3",)))
    cases.append(Case("llama3-8b-L32-8x4-period2", llama3_8b(batch=32), "8x4", period=2,
                      target_s=5.0, tags=("llama3",)))
    cases.append(Case("llama3-8b-L32-8x4-cbc", llama3_8b(batch=32), "8x4", solver="cbc",
                      time_limit=600.0, tags=("llama3", "cbc")))
    cases.append(Case("llama3-8b-L32-8x8", llama3_8b(batch=64), "8x8", target_s=5.0,
                      tags=("llama3",)))
    cases.append(Case("gpt3-175b-L2-16x8x8", gpt3_175b(2, batch=64), "16x8x8", tags=("gpt3",)))
    # The whole 3-axis ILP (no two-axis views), for the objective the views give up.
    cases.append(Case("gpt3-175b-L2-16x8x8-full", gpt3_175b(2, batch=64), "16x8x8",
                      decompose="never", time_limit=900.0, tags=("gpt3", "full")))
    cases.append(Case("gpt3-175b-L2-16x8x8-untied", gpt3_175b(2, batch=64), "16x8x8", tie=False,
                      tags=("gpt3",)))
    cases.append(Case("gpt3-175b-L96-8x8", gpt3_175b(batch=64), "8x8", tags=("gpt3",)))
    cases.append(Case("gpt3-175b-L96-16x8x8", gpt3_175b(batch=64), "16x8x8", target_s=60.0,
                      tags=("gpt3",)))
    cases.append(Case("gpt3-175b-L96-16x8x8-full", gpt3_175b(batch=64), "16x8x8",
                      decompose="never", time_limit=1800.0, tags=("gpt3", "full")))
    return cases


QUICK = ("gpt-d1024-L2-8x4", "gpt-d1024-L8-8x4", "llama3-8b-L2-8x4")


# ---------------------------------------------------------------------------------------------
# One case (in a subprocess)


def _cache_dir() -> Path:
    path = Path(os.environ.get("HLOPLAN_SCALE_CACHE", "/tmp/hloplan-scale-cache"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def _export_cached(c: Config) -> tuple[bytes, float]:
    key = "-".join(f"{k}{v}" for k, v in asdict(c).items())
    path = _cache_dir() / f"{key}.jaxexport"
    if path.exists():
        return path.read_bytes(), 0.0
    started = time.perf_counter()
    data = export_bytes(c)
    seconds = time.perf_counter() - started
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(data)
    tmp.replace(path)
    return data, seconds


def _patch_pipeline(case: Case) -> None:
    """Make compile_bytes run the pipeline with tie-repeated-layers as the case says (always
    tying, whatever the size thresholds of the shipped pass), or without it."""
    import hloplan.passmanager as passmanager
    from hloplan.passes.tie_repeated_layers import TieRepeatedLayers

    original = passmanager.pass_pipeline

    def patched():
        passes = [p for p in original() if p.name != "tie-repeated-layers"]
        if case.tie:
            at = [p.name for p in passes].index("build-sharding-problem") + 1
            passes.insert(at, TieRepeatedLayers(compare_untied=case.compare_untied,
                                                period=case.period, min_decisions=0,
                                                min_edge_cells=0))
        return passes

    passmanager.pass_pipeline = patched


_COMPARE_CLOCK = [0.0, 0.0]  # wall and CPU seconds of the untied/tied comparison solves


def _clock_comparison() -> None:
    from hloplan.passes import tie_repeated_layers

    original = tie_repeated_layers.compare_tied

    def timed(*args, **kwargs):
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            return original(*args, **kwargs)
        finally:
            _COMPARE_CLOCK[0] += time.perf_counter() - wall
            _COMPARE_CLOCK[1] += time.process_time() - cpu

    tie_repeated_layers.compare_tied = timed


def run_case(case: Case, profile: str | None = None) -> dict:
    """Export (cached) and plan one case in this process; the measurements as a dict."""
    data, export_s = _export_cached(case.config)
    from hloplan.compiler import compile_bytes, make_options

    _patch_pipeline(case)
    _clock_comparison()
    options = dataclasses.replace(
        make_options(case.mesh, device="h100", solver=case.solver, time_limit=case.time_limit),
        decompose=case.decompose,
        # The whole-ILP reference cases prove their optimum; the others stop at the default gap.
        gap=1e-6 if "full" in case.tags else 0.01)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started, cpu_started = time.perf_counter(), time.process_time()
    if profile:
        import cProfile

        profiler = cProfile.Profile()
        result = profiler.runcall(compile_bytes, data, f"{case.name}.jaxexport", options)
        profiler.dump_stats(profile)
    else:
        result = compile_bytes(data, f"{case.name}.jaxexport", options)
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    plan = result.plan
    facts = result.state.facts
    # The untied/tied comparison solves (benchmark only) are not part of planning.
    compare, compare_cpu = _COMPARE_CLOCK
    keep = ("ops", "nodes", "tie_seconds", "edges", "live_points", "tied_groups", "tied_nodes",
            "decisions_before_tying", "decisions_after_tying", "live_points_before_pruning",
            "live_points_after_pruning", "untied_status", "untied_how",
            "untied_objective", "untied_solve_seconds", "untied_variables", "tied_status",
            "tied_how", "tied_objective", "tied_solve_seconds", "tied_variables", "tied_gap",
            "untied_bound", "tied_gap_bound", "tied_gap_exact")
    return {
        "case": case.name,
        "status": "ok",
        "mesh": case.mesh,
        "devices": math.prod(int(s) for s in case.mesh.split("x")),
        "tie": case.tie,
        "period": case.period,
        "config": asdict(case.config),
        "parameters": case.config.parameters(),
        "input_bytes": len(data),
        "export_s": export_s,
        "compile_s": wall - compare,
        "compare_s": compare,
        # CPU seconds of the compile (this process, all threads): robust to a loaded machine.
        "compile_cpu_s": cpu - compare_cpu,
        "loadavg": os.getloadavg(),
        "timings": result.timings,
        "solver": plan["solver"],
        "step_time_s": plan["estimate"]["step_time_s"],
        "peak_memory_bytes": plan["estimate"]["peak_memory_bytes"],
        "facts": {k: facts[k] for k in keep if k in facts},
        "maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "maxrss_before_compile_mib": rss_before / 1024,
        "target_s": case.target_s,
        # Where no single program fits, hloplan accumulates gradients: the plan it runs.
        "accumulated": ({key: plan["pipeline"][key] for key in ("stages", "microbatches")}
                        | {"step_time_s": plan["pipeline"]["estimate"]["step_time_s"],
                           "peak_memory_bytes": max(
                               plan["pipeline"]["estimate"]["memory_per_stage_bytes"])}
                        if plan.get("pipeline", {}).get("tasks") else None),
    }


# ---------------------------------------------------------------------------------------------
# The suite (one subprocess per case)


def run_in_subprocess(case: Case, timeout: float, memory_limit: float | None = None) -> dict:
    """Run one case in a child process with a timeout and (optionally) a heap limit in bytes:
    a case that needs more fails with MemoryError instead of waking the machine's OOM killer."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--case", case.name]

    def limit() -> None:
        if memory_limit:
            resource.setrlimit(resource.RLIMIT_DATA, (int(memory_limit), int(memory_limit)))

    started = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                              preexec_fn=limit)
    except subprocess.TimeoutExpired:
        return {"case": case.name, "status": "timeout", "timeout_s": timeout, "mesh": case.mesh,
                "tie": case.tie, "config": asdict(case.config), "target_s": case.target_s,
                "parameters": case.config.parameters()}
    elapsed = time.perf_counter() - started
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        out_of_memory = "MemoryError" in proc.stderr or proc.returncode == -9
        status = "out of memory" if out_of_memory else "error"
        if "no plan fits the memory budget" in proc.stderr:
            peak = re.search(r"smallest achievable peak is ((?:at least )?[0-9.]+ [KMGT]?i?B)",
                             proc.stderr)
            status = "no plan fits" + (f" (smallest peak {peak.group(1)})" if peak else "")
        return {"case": case.name, "status": status,
                "memory_limit_gib": memory_limit / 2**30 if memory_limit else None, "returncode": proc.returncode,
                "mesh": case.mesh, "tie": case.tie, "config": asdict(case.config),
                "target_s": case.target_s, "parameters": case.config.parameters(),
                "error": (proc.stderr or proc.stdout)[-2000:], "elapsed_s": elapsed}
    result = json.loads(lines[-1])
    result["timeout_s"] = timeout
    return result


def _fmt_s(x) -> str:
    return "-" if x is None else f"{x:.1f}" if x >= 10 else f"{x:.2f}"


def table(results: list[dict]) -> str:
    head = ("| case | params | devices | ops | decisions (untied -> tied) | memory checks | ILP vars / cons | "
            "solver | plan step time | build | tie | solve | compile wall (CPU) | peak RSS | "
            "tied vs untied | target |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in results:
        params = f"{r['parameters'] / 1e9:.2f}B"
        target = r.get("target_s")
        if r["status"] != "ok":
            why = r["status"]
            if r["status"] == "timeout":
                why += f" ({r['timeout_s']:.0f} s)"
            elif r["status"] == "out of memory" and r.get("memory_limit_gib"):
                why += f" ({r['memory_limit_gib']:.0f} GiB heap)"
            lines.append(f"| {r['case']} | {params} | {r['mesh']} | - | - | - | - | - | - | - | - | - "
                         f"| {why} | - | - | {'> ' + _fmt_s(target) + ' s: missed' if target else '-'} |")
            continue
        t, f, s = r["timings"], r["facts"], r["solver"]
        decisions = (f"{f['decisions_before_tying']} -> {f['decisions_after_tying']}"
                     if "decisions_after_tying" in f else "untied")
        checks = (f"{f['live_points_before_pruning']} -> {f['live_points_after_pruning']}"
                  if "live_points_after_pruning" in f else str(f.get("live_points", "-")))
        gap = "-"
        if "tied_gap" in f and f.get("tied_gap_exact", True):
            gap = f"{100 * f['tied_gap']:+.3f}%"
        elif "tied_gap" in f:
            gap = (f"{100 * f['tied_gap']:+.1f}% vs untied incumbent ({f['untied_status']}, "
                   f"{f['untied_solve_seconds']:.0f} s)")
        elif f.get("untied_status", "").startswith("failed"):
            gap = "untied: " + f["untied_status"]
        met = "-"
        if target:
            met = f"<= {target:g} s: " + ("met" if r["compile_s"] <= target else "missed")
        lines.append(
            f"| {r['case']} | {params} | {r['mesh']} ({r['devices']}) | {f.get('ops', '-')} | "
            f"{decisions} | {checks} | {s['variables']} / {s['constraints']} | "
            f"{s['name']} ({s['status']}) | {1000 * r['step_time_s']:.1f} ms | "
            f"{_fmt_s(t.get('build-sharding-problem'))} | {_fmt_s(f.get('tie_seconds'))} | "
            f"{_fmt_s(t.get('solve-sharding'))} | {_fmt_s(r['compile_s'])} ({_fmt_s(r['compile_cpu_s'])}) | "
            f"{r['maxrss_mib']:.0f} MiB | {gap} | {met} |")
    return "\n".join(lines)


def growth(results: list[dict]) -> str:
    """Least-squares slope of log(compile time) against log(ops) over the depth sweep."""
    points = [(r["facts"]["ops"], r["compile_s"]) for r in results
              if r["status"] == "ok" and r["case"].startswith("gpt-d1024-L") and r["tie"]
              and r["case"].endswith("-8x4")]
    if len(points) < 2:
        return "growth: not enough depth points"
    xs = [math.log(o) for o, _ in points]
    ys = [math.log(t) for _, t in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    per_kop = ", ".join(f"{o} ops: {1000 * t / o:.2f} s/kop" for o, t in points)
    memory = [(r["facts"]["ops"], r["maxrss_mib"]) for r in results
              if r["status"] == "ok" and r["case"].startswith("gpt-d1024-L") and r["tie"]
              and r["case"].endswith("-8x4")]
    ms = [math.log(m) for _, m in memory]
    mm = sum(ms) / len(ms)
    memory_slope = sum((x - mx) * (y - mm) for x, y in zip(xs, ms)) / sum((x - mx) ** 2 for x in xs)
    return (f"growth: compile time ~ ops^{slope:.2f}, peak RSS ~ ops^{memory_slope:.2f} over the "
            f"depth sweep ({per_kop})")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--case", help="run one case in this process and print its JSON")
    parser.add_argument("--profile", help="with --case: write cProfile stats to this file")
    parser.add_argument("--only", action="append", default=[],
                        help="run the cases whose name contains this, or equals it when it "
                             "ends with '$' (repeatable)")
    parser.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per case")
    parser.add_argument("--memory-limit-gib", type=float, default=12.0,
                        help="heap limit per case (0: none)")
    parser.add_argument("--output", default=str(RESULTS))
    parser.add_argument("--list", action="store_true")
    args = parser.parse_args(argv)
    cases = {c.name: c for c in _suite()}
    if args.list:
        print("\n".join(cases))
        return 0
    if args.case:
        print(json.dumps(run_case(cases[args.case], args.profile)))
        return 0
    selected = [c for c in cases.values()
                if (not args.quick or c.name in QUICK)
                and (not args.only or any(c.name == o[:-1] if o.endswith("$") else o in c.name
                                          for o in args.only))]
    results = []
    previous = {}
    out = Path(args.output)
    if out.exists():
        previous = {r["case"]: r for r in json.loads(out.read_text()).get("results", [])}
    for case in selected:
        print(f"{case.name} ...", file=sys.stderr, flush=True)
        # Export outside the timed subprocess (and cached): tracing is not the planner's time.
        subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]); "
                        "import scale; c = {c.name: c for c in scale._suite()}[sys.argv[2]]; "
                        "scale._export_cached(c.config)", str(HERE), case.name], check=True)
        result = run_in_subprocess(case, args.timeout, args.memory_limit_gib * 2**30 or None)
        print(f"  {result['status']} {_fmt_s(result.get('compile_s'))} s", file=sys.stderr,
              flush=True)
        results.append(result)
        previous[case.name] = result
    merged = [previous[name] for name in cases if name in previous]
    from calibration import machine_speed

    out.write_text(json.dumps({"results": merged, "cpu_count": os.cpu_count(),
                               "loadavg_at_end": os.getloadavg(),
                               "machine_speed_at_end": machine_speed()}, indent=1) + "\n")
    print(table(merged))
    print()
    print(growth(merged))
    return 0


if __name__ == "__main__":
    sys.exit(main())
