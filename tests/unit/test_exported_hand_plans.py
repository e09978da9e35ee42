"""benchmarks/hand_plans.py's plans for a program known only by its single-device export
(the corpus's hand baselines on TPU: data parallel, FSDP, and the tensor- and expert-parallel
plans of an expert's partition rules): the shardings they give, and the sharded program's
result on 8 CPU devices against the single-device one."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import hand_plans  # noqa: E402


def _step(state, batch):
    """A keras-style step: (state, batch) -> (loss, new state), the state a dict and a list."""
    params, moments = state
    x, y = batch

    def loss_fn(p):
        h = jnp.tanh(x @ p["w1"] + p["b1"])
        return jnp.mean((h @ p["w2"] - y) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    moments = [0.9 * m + g for m, g in zip(moments, jax.tree.leaves(grads))]
    params = jax.tree.map(lambda p, m: p - 0.1 * m, params, jax.tree.unflatten(
        jax.tree.structure(params), moments))
    return loss, (params, moments)


def _example():
    rng = np.random.default_rng(0)
    params = {"b1": rng.standard_normal(24, dtype=np.float32),
              "w1": rng.standard_normal((16, 24), dtype=np.float32),
              "w2": rng.standard_normal((24, 4), dtype=np.float32)}
    moments = [np.zeros_like(v) for v in jax.tree.leaves(params)]
    batch = (rng.standard_normal((32, 16), dtype=np.float32),
             rng.standard_normal((32, 4), dtype=np.float32))
    return (params, moments), batch


def test_dp_and_fsdp_shardings_and_results(devices8):
    state, batch = _example()
    exported = jax.export.export(jax.jit(_step, donate_argnums=(0,)))(state, batch)
    mesh = jax.make_mesh((2, 4), ("x", "y"), devices=devices8)
    plans = hand_plans.exported_plans(exported, (0,), mesh)
    assert set(plans) == {"dp", "fsdp"}

    dp_in, dp_out = plans["dp"]
    assert all(s.spec == P() for s in jax.tree.leaves(dp_in[0]))
    assert [s.spec for s in jax.tree.leaves(dp_in[1])] == [P(("x", "y"))] * 2
    fsdp_in, fsdp_out = plans["fsdp"]
    # b1 (24) and w1's 24 columns divide by 8, w2's 24 rows too; each on its largest such dim
    assert [s.spec for s in jax.tree.leaves(fsdp_in[0][0])] == [
        P(("x", "y")), P(None, ("x", "y")), P(("x", "y"), None)]
    # the loss comes first and is replicated; the new state keeps the state's shardings
    assert fsdp_out[0].spec == P()
    assert [s.spec for s in jax.tree.leaves(fsdp_out[1])] == \
        [s.spec for s in jax.tree.leaves(fsdp_in[0])]

    expected = _step(state, batch)
    for name, shardings in plans.items():
        compiled = hand_plans.compile_exported_plan(exported, (0,), shardings)
        placed = jax.device_put((state, batch), shardings[0])
        got = compiled(*placed)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5,
                                       err_msg=name)


def test_tensor_and_expert_parallel_shardings_and_results(devices8):
    """The rules an expert gives (the Megatron dim of each state tensor, by its path) place
    the model over the last mesh axis and the batch over the first; the optimizer moments,
    matched by shape here as keras's are, follow their parameters."""
    state, batch = _example()
    exported = jax.export.export(jax.jit(_step, donate_argnums=(0,)))(state, batch)
    mesh = jax.make_mesh((2, 4), ("x", "y"), devices=devices8)
    by_shape = {(24,): 0, (16, 24): 1, (24, 4): 0}  # column-split w1 and b1, row-split w2

    def tensor_dim(path, shape):
        return by_shape.get(shape)

    def expert_dim(path, shape):
        return 0 if "w1" in path else None

    plans = hand_plans.exported_plans(exported, (0,), mesh, tensor_dim, expert_dim)
    assert set(plans) == {"dp", "fsdp", "tp_dp", "fsdp_tp", "ep_dp"}
    specs = {name: [s.spec for s in jax.tree.leaves(ins[0])] for name, (ins, _) in plans.items()}
    # params b1, w1, w2, then their moments in the same order
    assert specs["tp_dp"] == [P("y"), P(None, "y"), P("y", None)] * 2
    # fsdp_tp also splits each tensor's largest free dim the first axis divides
    assert specs["fsdp_tp"] == [P("y"), P("x", "y"), P("y", "x")] * 2
    # w1's 16 rows divide by 4; the key names w1 in the params, not in the moments' list
    assert specs["ep_dp"] == [P(), P("y", None), P()] + [P()] * 3
    for name in ("tp_dp", "fsdp_tp", "ep_dp"):
        assert [s.spec for s in jax.tree.leaves(plans[name][0][1])] == [P("x")] * 2

    expected = _step(state, batch)
    for name in ("tp_dp", "fsdp_tp", "ep_dp"):
        shardings = plans[name]
        compiled = hand_plans.compile_exported_plan(exported, (0,), shardings)
        got = compiled(*jax.device_put((state, batch), shardings[0]))
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5,
                                       err_msg=name)


def test_a_model_parallel_plan_that_splits_nothing_is_left_out(devices8):
    state, batch = _example()
    exported = jax.export.export(jax.jit(_step, donate_argnums=(0,)))(state, batch)
    mesh = jax.make_mesh((2, 4), ("x", "y"), devices=devices8)
    # rules naming no tensor: no tp_dp, nor fsdp_tp (FSDP over the first axis alone); 6
    # experts do not divide over 4 devices: no ep_dp
    plans = hand_plans.exported_plans(exported, (0,), mesh, lambda path, shape: None,
                                      lambda path, shape: 0 if shape == (6,) else None)
    assert set(plans) == {"dp", "fsdp"}


def test_moments_passed_as_a_flat_list_take_their_parameters_paths(devices8):
    """An optax state flattened into a list (a count, then each moment's tensors in the
    parameters' order) is split as the parameter each tensor repeats, found by its path."""
    (params, moments), batch = _example()

    def step(params, opt, batch):
        count, *moments = opt
        loss, (new_params, new_moments) = _step((params, moments), batch)
        return loss, new_params, [count + 1, *new_moments]

    opt = [np.zeros((), np.int32), *moments]
    exported = jax.export.export(jax.jit(step, donate_argnums=(0, 1)))(params, opt, batch)
    mesh = jax.make_mesh((2, 4), ("x", "y"), devices=devices8)
    by_name = {"['b1']": 0, "['w1']": 1, "['w2']": 0}
    plans = hand_plans.exported_plans(exported, (0, 1), mesh,
                                      lambda path, shape: by_name.get(path))
    ins, outs = plans["tp_dp"]
    assert [s.spec for s in jax.tree.leaves(ins[1])] == \
        [P()] + [P("y"), P(None, "y"), P("y", None)]
    assert [s.spec for s in jax.tree.leaves(outs[2])] == [s.spec for s in jax.tree.leaves(ins[1])]
    expected = step(params, opt, batch)
    compiled = hand_plans.compile_exported_plan(exported, (0, 1), plans["tp_dp"])
    got = compiled(*jax.device_put((params, opt, batch), ins))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("program, path, shape, dim", [
    # paths as the corpus's exports name them (jax.tree_util.keystr of the parameters)
    ("hf_gpt2", "['transformer']['h']['0']['attn']['c_attn']['kernel']", (2304, 768), 0),
    ("hf_gpt2", "['transformer']['h']['0']['attn']['c_attn']['bias']", (2304,), 0),
    ("hf_gpt2", "['transformer']['h']['0']['attn']['c_proj']['kernel']", (768, 768), 1),
    ("hf_gpt2", "['transformer']['h']['0']['attn']['c_proj']['bias']", (768,), None),
    ("hf_gpt2", "['transformer']['h']['0']['mlp']['c_proj']['kernel']", (768, 3072), 1),
    ("hf_gpt2", "['transformer']['wpe']['embedding']", (1024, 768), None),
    ("hf_bert", "['bert']['encoder']['layer']['0']['attention']['output']['dense']['kernel']",
     (768, 768), 0),
    ("hf_bert", "['bert']['encoder']['layer']['0']['output']['dense']['kernel']", (3072, 768), 0),
    ("hf_bert", "['bert']['encoder']['layer']['0']['attention']['self']['query']['kernel']",
     (768, 768), 1),
    ("hf_bert", "['bert']['encoder']['layer']['0']['output']['LayerNorm']['scale']", (768,),
     None),
    ("hf_bert", "['cls']['predictions']['transform']['dense']['kernel']", (768, 768), None),
    ("hf_llama", "['model']['layers']['0']['self_attn']['o_proj']['kernel']", (2048, 2048), 0),
    ("hf_llama", "['model']['layers']['0']['mlp']['gate_proj']['kernel']", (2048, 8192), 1),
    ("hf_llama", "['lm_head']['kernel']", (2048, 32000), 1),
    ("hf_bart", "['model']['encoder']['layers']['0']['self_attn']['out_proj']['kernel']",
     (1024, 1024), 0),
    ("hf_bart", "['model']['decoder']['layers']['0']['encoder_attn']['k_proj']['bias']",
     (1024,), 0),
    ("haiku_transformer", "['multi_head_attention_1/linear']['w']", (1024, 1024), 0),
    ("haiku_transformer", "['mlp_1/~/linear_1']['b']", (1024,), None),
    ("haiku_transformer", "['linear']['w']", (1024, 32000), 1),
    ("keras_gemma", "[0][5]", (1024, 8, 128), 1),
    ("keras_gemma", "[0][6]", (1024, 1, 128), None),
    ("keras_moe", "[0][3]", (8, 2048, 1024), 1),
    ("keras_moe", "[0][4]", (1024, 8), None),
    ("linen_resnet", "['Block_0']['Conv_0']['kernel']", (3, 3, 64, 64), 3),
    ("linen_resnet", "['Block_1']['Conv_0']['kernel']", (1, 1, 64, 128), None),
    ("linen_resnet", "['Block_1']['Conv_2']['kernel']", (3, 3, 128, 128), 2),
    ("linen_resnet", "['Block_1']['GroupNorm_0']['scale']", (64,), None),
    ("hf_vit", "['vit']['encoder']['layer']['0']['attention']['attention']['query']['kernel']",
     (768, 768), 1),
    ("hf_vit", "['vit']['encoder']['layer']['0']['attention']['output']['dense']['kernel']",
     (768, 768), 0),
    ("hf_vit", "['vit']['encoder']['layer']['0']['output']['dense']['kernel']", (3072, 768), 0),
    ("hf_vit", "['vit']['embeddings']['patch_embeddings']['projection']['kernel']",
     (16, 16, 3, 768), None),
    ("hf_vit", "['classifier']['kernel']", (768, 1000), 1),
    ("nnx_transformer", "['blocks']['0']['attn']['key']['kernel']", (1024, 16, 64), 1),
    ("nnx_transformer", "['blocks']['0']['attn']['out']['kernel']", (16, 64, 1024), 0),
    ("nnx_transformer", "['blocks']['0']['down']['kernel']", (4096, 1024), 0),
    ("nnx_transformer", "['blocks']['0']['ln1']['scale']", (1024,), None),
    ("nnx_transformer", "['head']['kernel']", (1024, 32768), 1),
])
def test_corpus_tensor_parallel_rules(program, path, shape, dim):
    """Megatron's split of each kind of tensor (corpus_hand_rules.py): column-split matmuls on
    their outputs, row-split ones on their inputs, whatever the library's kernel layout."""
    import corpus_hand_rules

    assert corpus_hand_rules.TENSOR_DIMS[program](path, shape) == dim
    if program == "keras_moe" and len(shape) == 3 and shape[0] == 8:
        assert corpus_hand_rules.EXPERT_DIMS[program](path, shape) == 0


def test_a_program_without_state_is_all_batch(devices8):
    """Nothing donated (an inference function): every argument is split as a batch."""
    state, batch = _example()
    exported = jax.export.export(jax.jit(_step))(state, batch)
    mesh = jax.make_mesh((2, 4), ("x", "y"), devices=devices8)
    plans = hand_plans.exported_plans(exported, (), mesh, lambda path, shape: 0)
    ins, _ = plans["dp"]
    assert [s.spec for s in jax.tree.leaves(ins[1])] == [P(("x", "y"))] * 2
    assert set(plans) == {"dp", "fsdp"}  # no state: no tensor-parallel split
