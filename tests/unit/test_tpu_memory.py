"""The memory estimate's TPU rules (a device model's [buffers] table): reductions fuse the
elementwise values they read, and f32 values read only by matmuls are written as bf16.
Each program is planned with tpu-v5e and with the same model less its [buffers] table (the
rules XLA's CPU compiler follows); one is also compiled by libtpu (deviceless, on CPU)."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from click.testing import CliRunner
from jax import export

import hloplan
from hloplan.cli import main
from hloplan.cost_models import DeviceModelError, load_device_model

TPU_TOML = Path(hloplan.__file__).resolve().parents[2] / "cost_models" / "tpu-v5e.toml"


def _plain_tpu(tmp_path: Path) -> Path:
    """tpu-v5e without its [buffers] table."""
    lines = TPU_TOML.read_text().split("\n[buffers]\n")[0]
    path = tmp_path / "tpu-plain.toml"
    path.write_text(lines.replace('name = "tpu-v5e"', 'name = "tpu-plain"')
                    .replace('aliases = ["v5e", "tpu-v5-lite", "v5litepod"]', "aliases = []"))
    return path


def test_buffers_table() -> None:
    tpu, cpu = load_device_model("tpu-v5e"), load_device_model("cpu")
    assert tpu.fused_reductions and tpu.matmul_operands == "bf16"
    assert not cpu.fused_reductions and cpu.matmul_operands is None
    assert not load_device_model("h100").fused_reductions


@pytest.mark.parametrize(("table", "message"), [
    ("fused_reductions = 1", "'buffers.fused_reductions' must be true or false"),
    ("matmul_operands = 'int8'", "'buffers.matmul_operands' must be bf16, f16 or f32"),
    ("fusion = true", "unknown field(s) buffers.fusion"),
])
def test_bad_buffers_table(tmp_path: Path, table: str, message: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(_plain_tpu(tmp_path).read_text() + f"\n[buffers]\n{table}\n")
    with pytest.raises(DeviceModelError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_device_model(path)


def _plan(step, args, device):
    """(compile state, estimated peak) of `step` planned for 8 devices of `device`."""
    data = export.export(jax.jit(step))(*args).serialize()
    result = hloplan.compile(data, "8", device=str(device), mesh_views="off")
    return result.state, result.plan["estimate"]["peak_memory_bytes"]


def _live_nodes(problem) -> set[int]:
    return {r.node for r in problem.live_ranges} | {
        n for point in problem.live_points for n in point.nodes}


def _nodes_of(state, name: str) -> list[int]:
    return [state.space.node_of[op.index] for op in state.graph.ops
            if op.name == name and op.index in state.space.node_of]


def _softmax_loss(w, x):
    logits = x @ w
    return -jnp.mean(jax.nn.log_softmax(logits, axis=-1)[:, 0])


def test_reductions_fuse_the_exponentials_they_read(tmp_path: Path) -> None:
    """log_softmax's exp(x - max) is read by the sum only: on TPU it is computed inside the
    reduction (never written out, however large); XLA's CPU compiler writes it out."""
    s = jax.ShapeDtypeStruct
    args = (s((256, 4096), jnp.float32), s((1024, 256), jnp.float32))
    tpu, tpu_peak = _plan(jax.grad(_softmax_loss), args, "tpu-v5e")
    plain, plain_peak = _plan(jax.grad(_softmax_loss), args, _plain_tpu(tmp_path))
    exps = _nodes_of(plain, "stablehlo.exponential")
    assert exps and set(exps) & _live_nodes(plain.problem)
    assert not set(_nodes_of(tpu, "stablehlo.exponential")) & _live_nodes(tpu.problem)
    assert tpu_peak < plain_peak


def _two_matmuls(ws, x):
    def loss(ws):
        return jnp.sum((x @ ws[0]) @ ws[1])

    return jax.grad(loss)(ws)


def test_values_read_only_by_matmuls_are_written_as_bf16(tmp_path: Path) -> None:
    """The hidden activation x @ w0 is read by two matmuls only (the forward one and the
    gradient of w1): on TPU it is written in bf16, half its f32 bytes."""
    s = jax.ShapeDtypeStruct
    args = ((s((512, 512), jnp.float32), s((512, 512), jnp.float32)),
            s((1024, 512), jnp.float32))
    tpu, _ = _plan(_two_matmuls, args, "tpu-v5e")
    plain, _ = _plan(_two_matmuls, args, _plain_tpu(tmp_path))
    graph = tpu.graph
    hidden = next(op for op in graph.ops if op.name == "stablehlo.dot_general"
                  and graph.ops[graph.values[op.operands[0]].producer].name == "arg"
                  and graph.values[op.operands[0]].id == graph.arguments[-1])
    node = tpu.space.node_of[hidden.index]
    assert plain.space.node_of[hidden.index] == node
    for narrow, full in zip(tpu.problem.nodes[node].strategies,
                            plain.problem.nodes[node].strategies, strict=True):
        assert narrow.memory == full.memory / 2
    # Results (the gradients) keep their type's bytes.
    for op in graph.ops:
        if op.name == "stablehlo.dot_general" and set(op.results) & set(graph.outputs):
            n = tpu.space.node_of[op.index]
            assert [s.memory for s in tpu.problem.nodes[n].strategies] == [
                s.memory for s in plain.problem.nodes[n].strategies]


def _vocab_step(params, x, y):
    """A softmax classifier over a 32,768-word vocabulary (SGD): its cross entropy's
    vocabulary-sized values are most of the step's peak."""
    def loss(params):
        logits = jnp.tanh(x @ params["w1"]) @ params["w2"]
        return -jnp.mean(jnp.sum(jax.nn.one_hot(y, logits.shape[-1])
                                 * jax.nn.log_softmax(logits, axis=-1), axis=-1))

    value, grads = jax.value_and_grad(loss)(params)
    return value, jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)


@pytest.mark.libtpu
def test_estimate_against_libtpu(tmp_path: Path) -> None:
    """Planned for v5e:2x4 and compiled by libtpu (hloplan verify; 128 MiB of logits per
    device): the estimate with the TPU rules is within 15% of libtpu's peak (1.02 measured);
    without them it counts the vocabulary-sized values XLA fuses (2.4 times libtpu's)."""
    from hloplan.compiler import compile_bytes, make_options

    s, f32 = jax.ShapeDtypeStruct, jnp.float32
    params = {"w1": s((512, 512), f32), "w2": s((512, 32768), f32)}
    args = (params, s((8192, 512), f32), s((8192,), jnp.int32))
    data = bytes(export.export(jax.jit(_vocab_step, donate_argnums=(0,)),
                               platforms=("tpu",))(*args).serialize())
    ratios = {}
    for device in ("tpu-v5e", str(_plain_tpu(tmp_path))):
        result = compile_bytes(data, "step.jaxexport",
                               make_options("2x4", device=device, mesh_views="off"))
        plan_dir = tmp_path / Path(device).stem
        result.write(plan_dir)
        out = CliRunner().invoke(main, ["verify", str(plan_dir), "--topology", "v5e:2x4",
                                        "--format", "json"])
        assert out.exit_code == 0, out.output
        report = json.loads(out.output[out.output.index("{"):])
        ratios[device] = report["programs"]["program"]["peak_ratio"]
    tpu, plain = ratios.values()
    assert 0.85 < tpu < 1.15, ratios
    assert plain > 1.5, ratios


def _scaled(scale, x):
    return jnp.sum(jnp.tanh(x * scale) @ jnp.ones((x.shape[1], 8)))


def test_slicing_a_value_never_written_out_prices_making_it_whole() -> None:
    """`x * scale` reads a broadcast of `scale` that XLA never writes out; read in a smaller
    layout than its own (replicated -> sharded), the partitioner makes the whole broadcast and
    slices it: the edge costs writing it out, where a collective-free slice costs nothing."""
    s = jax.ShapeDtypeStruct
    state, _ = _plan(_scaled, (s((4096,), jnp.float32), s((8192, 4096), jnp.float32)), "h100")
    graph, space, problem = state.graph, state.space, state.problem
    broadcast = next(op for op in graph.ops if op.name == "stablehlo.broadcast_in_dim"
                     and graph.type_of(op.results[0]).shape == (8192, 4096))
    src = space.node_of[broadcast.index]
    edges = [e for e in problem.edges if e.src == src]
    assert edges
    full = 8192 * 4096 * 4 / state.options.device.hbm_bandwidth
    sliced = 0
    for edge in edges:
        dst_op = space.op_of[edge.dst]
        position = graph.ops[dst_op].operands.index(broadcast.results[0])
        for i, a in enumerate(space.strategies[broadcast.index]):
            for j, b in enumerate(space.strategies[dst_op]):
                if not any(a.results[0]) and any(b.operands[position]):
                    assert edge.costs[i][j] == pytest.approx(full)  # replicated, sliced
                    sliced += 1
                elif a.results[0] == b.operands[position]:
                    assert edge.costs[i][j] == 0
    assert sliced


_LIBTPU_PEAK = """
import json, sys, tempfile
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from hloplan.hlo_stats import dumped_live_peak, memory_stats
from hloplan.tpu import parse_topology, topology_devices

mesh = Mesh(np.array(topology_devices(parse_topology("v5e:2x4"))).reshape(2, 4), ("x", "y"))

def step(w, x):  # a matmul, a softmax over 32,768 columns and its gradient
    def loss(w):
        return jax.nn.log_softmax(jnp.tanh(x) @ w).mean()
    return w - 0.1 * jax.grad(loss)(w)

s = jax.ShapeDtypeStruct
w = s((512, 32768), jnp.float32, sharding=NamedSharding(mesh, P(None, "y")))
x = s((8192, 512), jnp.float32, sharding=NamedSharding(mesh, P("x", None)))
with tempfile.TemporaryDirectory() as dump:
    compiled = jax.jit(step, donate_argnums=(0,)).lower(w, x).compile(
        {"xla_dump_to": dump, "xla_dump_hlo_as_text": True})
    peak = dumped_live_peak(dump)
    print(json.dumps([peak.bytes, memory_stats(compiled)["xla_peak_bytes"]]))
"""


@pytest.mark.libtpu
def test_live_peak_is_libtpus_peak_memory() -> None:
    """hlo_stats.live_peak on libtpu's dump (deviceless v5e:2x4 compile) gives
    memory_analysis's peak_memory_in_bytes: the bytes of the buffers live at its peak, ends
    included, each slice of an allocation once."""
    import subprocess
    import sys

    from hloplan.tpu import child_env

    done = subprocess.run([sys.executable, "-c", _LIBTPU_PEAK], env=child_env(),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    ours, libtpu = json.loads(done.stdout.strip().splitlines()[-1])
    assert libtpu > 64 * 2**20  # the f32 logits: 8192 / 2 x 32768 / 4 per device
    assert abs(ours - libtpu) <= 0.002 * libtpu, (ours, libtpu)


def _biased_head(params, x, y):
    """An output head with a bias (Flax BERT's, haiku's hk.Linear): the logits' gradient is read
    by the bias gradient's reduction and by the weight and input gradients' matmuls."""
    def loss(params, x):
        logits = x @ params["w"] + params["b"]
        return -jnp.mean(jnp.sum(jax.nn.one_hot(y, logits.shape[-1])
                                 * jax.nn.log_softmax(logits, axis=-1), axis=-1))

    return jax.grad(loss, argnums=(0, 1))(params, x)


def _biased_head_args():
    s, f32 = jax.ShapeDtypeStruct, jnp.float32
    return ({"w": s((256, 4096), f32), "b": s((4096,), f32)}, s((1024, 256), f32),
            s((1024,), jnp.int32))


def test_values_reduced_beside_matmuls_are_written_as_bf16(tmp_path: Path) -> None:
    """The logits' gradient is read by a reduce_sum (the bias gradient) and by matmuls: on TPU
    the reduction fuses into the kernel making it (a multi-output fusion) and the value is
    written for the matmuls, in bf16 (libtpu's `(f32[vocab], bf16[b,s,vocab])` fusion on Flax
    BERT's head): half its f32 bytes."""
    tpu, _ = _plan(_biased_head, _biased_head_args(), "tpu-v5e")
    plain, _ = _plan(_biased_head, _biased_head_args(), _plain_tpu(tmp_path))
    graph = tpu.graph
    found = 0
    for op in graph.ops:
        if (op.index not in tpu.space.node_of or len(op.results) != 1
                or graph.type_of(op.results[0]).shape != (1024, 4096)):
            continue
        readers = {graph.ops[u].name for u in graph.values[op.results[0]].users}
        if readers != {"stablehlo.reduce", "stablehlo.dot_general"}:
            continue
        node = tpu.space.node_of[op.index]
        for narrow, full in zip(tpu.problem.nodes[node].strategies,
                                plain.problem.nodes[plain.space.node_of[op.index]].strategies,
                                strict=True):
            assert narrow.memory == full.memory / 2
        found += 1
    assert found == 1


def _tied_head(emb, x):
    """Logits against a tied embedding (`x @ emb.T`, HF GPT-2's and BERT's output head): the
    transpose is folded into the forward and backward matmuls."""
    def loss(emb, x):
        return jnp.mean(jax.nn.logsumexp(x @ emb.T, axis=-1))

    return jax.grad(loss, argnums=(0, 1))(emb, x)


def test_reshard_into_a_folded_transpose_is_its_result(tmp_path: Path) -> None:
    """A reshard into a transpose the matmuls fold is written in the transposed layout: on
    TPU its copy is the transpose's own buffer, held once (as the transpose's result); XLA's
    CPU compiler keeps arrays row-major, so there the copy and the transposed result are
    two buffers."""
    s = jax.ShapeDtypeStruct
    args = (s((8192, 512), jnp.float32), s((1024, 512), jnp.float32))
    tpu, _ = _plan(_tied_head, args, "tpu-v5e")
    plain, _ = _plan(_tied_head, args, _plain_tpu(tmp_path))
    (transpose,) = [op for op in tpu.graph.ops if op.name == "stablehlo.transpose"
                    and op.operands == (tpu.graph.arguments[0],)]
    for state, held in ((tpu, False), (plain, True)):
        node = state.space.node_of[transpose.index]
        into = [e for e in state.problem.edges if e.dst == node]
        assert into
        assert all(any(e.copies) == held for e in into)


_LIBTPU_BIASED_HEAD = """
import json, re
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from hloplan.tpu import parse_topology, topology_devices

mesh = Mesh(np.array(topology_devices(parse_topology("v5e:2x4"))).reshape(2, 4), ("x", "y"))

def step(params, x, y):  # an output head with a bias over 4,096 words, its gradients
    def loss(params, x):
        logits = x @ params["w"] + params["b"]
        return -jnp.mean(jnp.sum(jax.nn.one_hot(y, 4096) * jax.nn.log_softmax(logits), -1))
    return jax.grad(loss, argnums=(0, 1))(params, x)

s, f32 = jax.ShapeDtypeStruct, jnp.float32
params = {"w": s((256, 4096), f32, sharding=NamedSharding(mesh, P(None, "x"))),
          "b": s((4096,), f32, sharding=NamedSharding(mesh, P("x")))}
x = s((2048, 256), f32, sharding=NamedSharding(mesh, P("y", None)))
y = s((2048,), jnp.int32, sharding=NamedSharding(mesh, P("y")))
text = jax.jit(step).lower(params, x, y).compile().as_text()
entry = text[text.index("ENTRY"):]
entry = entry[:entry.index("\\n}")]
# the dtypes of the logit-sized buffers the entry computation writes (per device [512, 2048];
# a get-tuple-element or a bitcast names a buffer written before)
print(json.dumps([d for line in entry.splitlines()
                  if not re.search(r"get-tuple-element\\(|bitcast\\(", line)
                  for d in re.findall(r"(\\w+)\\[512,2048\\]", line)]))
"""


@pytest.mark.libtpu
def test_libtpu_never_writes_a_gradient_reduced_beside_matmuls_in_f32() -> None:
    """The logits' gradient of a biased head, read by the bias gradient's reduction and two
    matmuls: libtpu (deviceless v5e:2x4) writes one f32 logit-sized buffer, the logits, and
    the gradient at most in bf16 (hf_bert's 119 MiB logits, in HBM: a `(f32[vocab],
    bf16[b,s,vocab])` fusion; this head's 4 MiB logits, in VMEM: recomputed in each reader),
    so matmul_narrowed's bf16 bytes bound what it holds."""
    import subprocess
    import sys

    from hloplan.tpu import child_env

    done = subprocess.run([sys.executable, "-c", _LIBTPU_BIASED_HEAD], env=child_env(),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    dtypes = json.loads(done.stdout.strip().splitlines()[-1])
    assert dtypes.count("f32") == 1, dtypes


_LIBTPU_VMEM = """
import json, re, tempfile
from pathlib import Path
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from hloplan.hlo_stats import dumped_live_peak
from hloplan.tpu import parse_topology, topology_devices

mesh = Mesh(np.array(topology_devices(parse_topology("v5e:2x4"))).reshape(2, 4), ("x", "y"))

def step(w, x):  # a matmul, a softmax over the columns and its gradient
    def loss(w):
        return jax.nn.log_softmax(jnp.tanh(x) @ w).mean()
    return w - 0.1 * jax.grad(loss)(w)

s = jax.ShapeDtypeStruct
out = {}
for cols in (16384, 32768):  # f32 logits per device: 4096 x cols / 4 (64 and 128 MiB)
    w = s((512, cols), jnp.float32, sharding=NamedSharding(mesh, P(None, "y")))
    x = s((8192, 512), jnp.float32, sharding=NamedSharding(mesh, P("x", None)))
    with tempfile.TemporaryDirectory() as dump:
        jax.jit(step, donate_argnums=(0,)).lower(w, x).compile(
            {"xla_dump_to": dump, "xla_dump_hlo_as_text": True})
        (assignment,) = Path(dump).glob("*after_optimizations-buffer-assignment.txt")
        color, spaces = 0, []  # the memory space (color) of each logit-sized value
        for line in assignment.read_text().splitlines():
            m = re.match(r"allocation \\d+: size \\d+,\\s*(?:color (\\d+))?", line)
            if m:
                color = int(m.group(1) or 0)
            m = re.match(r"\\s*value: <.*\\(size=(\\d+),", line)
            if m and int(m.group(1)) == 4096 * cols:
                spaces.append(color)
        out[cols] = [spaces, dumped_live_peak(dump).bytes]
print(json.dumps(out))
"""


@pytest.mark.libtpu
def test_libtpu_keeps_a_logit_sized_temporary_in_vmem_when_it_fits() -> None:
    """libtpu's memory-space assignment (deviceless v5e:2x4) puts a softmax head's f32 logits
    in on-chip VMEM (`color 1`, up to 112 MiB on v5e) when they fit: 64 MiB per device there,
    and the HBM peak holds only the arguments; 128 MiB stay in HBM. The estimate counts them
    either way (docs/tpu.md, Memory on TPU: why it does not take VMEM off)."""
    import subprocess
    import sys

    from hloplan.tpu import child_env

    done = subprocess.run([sys.executable, "-c", _LIBTPU_VMEM], env=child_env(),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    (small, small_peak), (large, large_peak) = found["16384"], found["32768"]
    assert small == [1], small  # in VMEM
    assert large == [0], large  # in HBM
    assert small_peak < 32 * 2**20 < 128 * 2**20 < large_peak, (small_peak, large_peak)
