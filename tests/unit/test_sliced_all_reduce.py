"""An all-reduce whose readers all take one slice of it over the summed axes: libtpu's
reduce-scatter creator compiles the two as one reduce-scatter (hf_bert's and hf_gpt2's
layer-norm row sums on v5e:4x8, `[y, -]` summed over x and read `[y, x]`), so plan.json lists
a reduce-scatter there on TPU device models (build_sharding_problem.sliced_all_reduces), and
an all-reduce elsewhere."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from jax import export

import hloplan
from hloplan.plan import build_plan
from hloplan.solver.evaluate import evaluate

SHAPE = (64, 128, 256)  # f32, summed over the last dim; mesh 2x4 as x=2, y=4


def _row_sum(a):
    return jnp.tanh(jnp.sum(a, axis=-1))


def _forced(device: str, read: str, mesh: str = "2x4"):
    """The compile state of the row sum with the plan made `[y, -]` summed over x and read by
    the strategy `read`."""
    data = export.export(jax.jit(_row_sum))(jax.ShapeDtypeStruct(SHAPE, jnp.float32))
    state = hloplan.compile(data.serialize(), mesh, device=device, mesh_views="off").state
    ops = {op.name: op.index for op in state.graph.ops if op.index in state.space.strategies}
    wanted = {ops["arg"]: "[y, -, x]",
              ops["stablehlo.reduce"]: "[y, -] + all-reduce(x) <- [y, -, x] []",
              ops["stablehlo.tanh"]: read}
    choice = list(state.solution.choice)
    for op_index, name in wanted.items():
        names = [s.name for s in state.space.strategies[op_index]]
        choice[state.space.node_of[op_index]] = names.index(name)
    state.solution = dataclasses.replace(state.solution, choice=tuple(choice))
    return state, ops


def _listed(device: str, read: str) -> dict:
    """plan.json's collectives for the row sum made `[y, -]` summed over x and read by the
    strategy `read`."""
    plan = build_plan(_forced(device, read)[0], b"", {})
    return {f"{c['kind']}({c['axes']})": c["bytes"] for c in plan["estimate"]["collectives"]}


def test_an_all_reduce_read_through_a_slice_is_listed_as_a_reduce_scatter():
    shard = 64 * 128 * 4 / 4  # [y, -] on y=4
    # Read [y, x]: the slice over x of the all-reduced rows, one reduce-scatter over x.
    assert _listed("tpu-v5e", "[y, x] <- [y, x]") == {"reduce-scatter(x)": pytest.approx(shard / 2)}
    # Read whole: the all-reduce stays one.
    assert _listed("tpu-v5e", "[y, -] <- [y, -]") == {"all-reduce(x)": pytest.approx(shard)}
    # Read in a layout without the summed axis: the all-reduce, then the reshard.
    assert _listed("tpu-v5e", "[-, -]") == {"all-reduce(x)": pytest.approx(shard),
                                            "all-gather(y)": pytest.approx(shard * 3)}


def test_a_slice_permuted_into_the_readers_order_is_listed_as_a_reduce_scatter():
    # Read [(x, y), -]: libtpu slices the all-reduced rows [(y, x), -] (a reduce-scatter over
    # x to hlo_stats) and permutes the shards into the reader's order (hf_bert's
    # word-embedding gradient on v5e:16x16).
    shard = 64 * 128 * 4 / 4
    assert _listed("tpu-v5e", "[(x, y), -] <- [(x, y), -]") == {
        "reduce-scatter(x)": pytest.approx(shard / 2),
        "collective-permute(x,y)": pytest.approx(shard / 2)}
    assert _listed("cpu", "[(x, y), -] <- [(x, y), -]")["all-reduce(x)"] == pytest.approx(shard)


def test_only_where_libtpu_compiles():
    assert _listed("cpu", "[y, x] <- [y, x]") == {"all-reduce(x)": pytest.approx(64 * 128 * 4 / 4)}


def _priced(read: str) -> tuple[float, float]:
    """On v5e:4x8 (x=4, y=8): (what the plan's row sum and its reader cost in the evaluated
    problem beyond their compute, what the reduce's own reduce-scatter strategy into `[y, x]`
    costs)."""
    state, ops = _forced("tpu-v5e", read, "4x8")
    per_node = evaluate(state.problem, state.solution).per_node
    reduce_, tanh = (state.space.node_of[ops[name]] for name in ("stablehlo.reduce",
                                                                  "stablehlo.tanh"))
    own = next(s for s in state.space.strategies[ops["stablehlo.reduce"]]
               if s.name == "[y, x] + reduce-scatter(x) <- [y, -, x] []")
    return per_node[reduce_][1] + per_node[tanh][2], own.communication


def test_the_ilp_prices_a_sliced_all_reduce_as_its_reduce_scatter():
    # On v5e:4x8 the reduce-scatter pays its whole latency ([combiner] reduce-scatter-apart),
    # the all-reduce its share of the merged ones': read through the slice, the row sum costs
    # what the reduce-scatter libtpu makes of it costs.
    sliced, scattered = _priced("[y, x] <- [y, x]")
    whole, _ = _priced("[y, -] <- [y, -]")
    assert whole < scattered / 10
    assert sliced == pytest.approx(scattered)


_LIBTPU_ROW_SUM = """
import json, sys
import jax, numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P
from hloplan.hlo_stats import collective_stats
from hloplan.tpu import parse_topology, topology_devices
devices = topology_devices(parse_topology("v5e:2x4"))
mesh = Mesh(np.array(devices).reshape(2, 4), ("x", "y"), axis_types=(AxisType.Auto,) * 2)
READ = P(*json.loads(sys.argv[1]))
def step(a):
    rows = jax.lax.with_sharding_constraint(a.sum(-1), NamedSharding(mesh, P("y", None)))
    return jax.numpy.tanh(jax.lax.with_sharding_constraint(rows, NamedSharding(mesh, READ)))
compiled = jax.jit(step, in_shardings=NamedSharding(mesh, P("y", None, "x"))).lower(
    jax.ShapeDtypeStruct((64, 128, 256), np.float32)).compile()
stats = collective_stats(compiled.as_text(), mesh_axes=[("x", 2), ("y", 4)])
print(json.dumps([[op.kind, sorted(op.axes), op.total_bytes_sent] for op in stats.ops]))
"""


def _libtpu_row_sum(read: list) -> list:
    """[kind, axes, bytes] of each collective libtpu compiles of the row sum read in `read`."""
    from hloplan.tpu import child_env

    done = subprocess.run([sys.executable, "-c", _LIBTPU_ROW_SUM, json.dumps(read)],
                          env=child_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.libtpu
def test_libtpu_compiles_the_sliced_all_reduce_as_a_reduce_scatter():
    ops = _libtpu_row_sum(["y", "x"])
    assert ops == [["reduce-scatter", ["x"], _listed("tpu-v5e", "[y, x] <- [y, x]")["reduce-scatter(x)"]]]


@pytest.mark.libtpu
def test_libtpu_compiles_the_permuted_slice_as_listed():
    listed = _listed("tpu-v5e", "[(x, y), -] <- [(x, y), -]")
    compiled = {}
    for kind, axes, sent in _libtpu_row_sum([["x", "y"], None]):
        key = f"{kind}({','.join(sorted(axes))})"
        compiled[key] = compiled.get(key, 0) + sent
    assert compiled == {key: pytest.approx(sent) for key, sent in listed.items()}
