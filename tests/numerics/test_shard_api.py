"""hloplan.shard on a Flax NNX model trained with optax, in-process (nothing serialized but
the module): the planned shardings are NamedSharding pytrees shaped like the user's own
arguments and results; 3 training steps with them equal plain jax.jit; plan.json and explain
name the arguments by readable pytree paths and point at this file, not into flax or optax."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding

import hloplan
from hloplan.diagnostics import UsageError

pytestmark = pytest.mark.usefixtures("devices8")


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(32, 64, rngs=rngs)
        self.l2 = nnx.Linear(64, 64, rngs=rngs)
        self.l3 = nnx.Linear(64, 8, rngs=rngs)

    def __call__(self, x):
        return self.l3(jax.nn.relu(self.l2(jax.nn.relu(self.l1(x)))))


def _setup():
    model = MLP(nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2))
    opt_state = tx.init(params)

    def train_step(params, opt_state, batch):
        def loss_fn(p):
            return jnp.mean((nnx.merge(graphdef, p)(batch["x"]) - batch["y"]) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    keys = jax.random.split(jax.random.PRNGKey(1), 3)
    batches = [{"x": jax.random.normal(k, (64, 32)), "y": jax.random.normal(k, (64, 8))}
               for k in keys]
    return train_step, params, opt_state, batches


def _mesh(shape, names):
    devices = np.array(jax.devices("cpu")[:8]).reshape(shape)
    return Mesh(devices, names, axis_types=(AxisType.Auto,) * len(names))


def _train(step, params, opt_state, batches):
    losses = []
    for batch in batches:
        params, opt_state, loss = step(params, opt_state, batch)
        losses.append(loss)
    return params, opt_state, losses


@pytest.mark.parametrize("shape,names", [((8,), ("data",)), ((2, 4), ("data", "model"))])
def test_nnx_optax_three_steps_equal_plain_jit(shape, names, helpers):
    train_step, params, opt_state, batches = _setup()
    mesh = _mesh(shape, names)
    # Arrays for some arguments, ShapeDtypeStructs for others.
    abstract_batch = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), batches[0])
    planned = hloplan.shard(train_step, params, opt_state, abstract_batch, mesh=mesh)

    # Shardings are the user's pytrees: the NNX State and optax's chain state as they are.
    in_params, in_opt, in_batch = planned.in_shardings
    assert jax.tree.structure(in_params) == jax.tree.structure(params)
    assert jax.tree.structure(in_opt) == jax.tree.structure(opt_state)
    assert set(in_batch) == {"x", "y"}
    out_params, out_opt, out_loss = planned.out_shardings
    assert jax.tree.structure(out_opt) == jax.tree.structure(opt_state)
    shardings = jax.tree.leaves((planned.in_shardings, planned.out_shardings))
    assert shardings and all(isinstance(s, NamedSharding) and s.mesh == mesh for s in shardings)
    assert any(s.spec != jax.sharding.PartitionSpec() for s in shardings)

    want = _train(jax.jit(train_step), params, opt_state, batches)
    got = _train(planned.jit(), params, opt_state, batches)
    helpers.assert_trees_close(jax.tree.map(np.asarray, got), jax.tree.map(np.asarray, want))
    # The planned callable is the same jitted function.
    once = planned(params, opt_state, batches[0])
    helpers.assert_trees_close(jax.tree.map(np.asarray, once),
                               jax.tree.map(np.asarray, jax.jit(train_step)(
                                   params, opt_state, batches[0])))
    # Results placed as planned.
    for array, sharding in zip(jax.tree.leaves(got[0]), jax.tree.leaves(out_params)):
        assert array.sharding.is_equivalent_to(sharding, array.ndim)


def test_names_are_pytree_paths_and_locations_the_users():
    train_step, params, opt_state, batches = _setup()
    planned = hloplan.shard(train_step, params, opt_state, batches[0],
                            mesh=_mesh((2, 4), ("data", "model")))
    names = [a["name"] for a in planned.plan["arguments"]]
    assert "params.l1.kernel" in names and "opt_state.mu.l2.kernel" in names, names
    assert "batch.x" in names
    text = planned.explain()
    assert "opt_state.mu.l2.kernel" in text and "batch.x" in text
    files = {op["location"].split(":")[0] for op in planned.plan["ops"] if op.get("location")}
    assert files and all(f.endswith("test_shard_api.py") for f in files), files


def test_mesh_must_be_a_jax_mesh():
    train_step, params, opt_state, batches = _setup()
    with pytest.raises(UsageError, match="jax.sharding.Mesh"):
        hloplan.shard(train_step, params, opt_state, batches[0], mesh="2x4")
