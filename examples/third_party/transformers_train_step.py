"""Hugging Face transformers Flax models (GPT-2, BERT, Llama, BART, ViT) with optax AdamW, and
two inference functions (GPT-2 greedy generation, BERT classification), exported for hloplan.

    pip install "transformers>=4.50,<5" flax optax     # Flax models; no torch needed
    python examples/third_party/transformers_train_step.py -o exports/ --check
    hloplan compile exports/hf_gpt2.jaxexport --mesh 2x4 -o plan/ && hloplan run plan/ --check

Each train step is the one of transformers' Flax example scripts (run_clm_flax.py,
run_mlm_flax.py, run_summarization_flax.py, run_image_classification.py): the model called with
`params=params, train=True`, a cross-entropy loss, `jax.value_and_grad`, optax's update.  The
models are built from small configurations with random weights (nothing is downloaded);
dropout is off so that the step is deterministic.  Parameters are the models' own nested
dicts; the optax state crosses the step boundary as the flat list of its leaves
(`Exported.serialize()` cannot serialize optax's NamedTuples).

`size="real"` builds the published configuration's shapes (GPT-2 small, BERT base, a
Llama-style 1B, BART large, ViT base) for compile-only benchmarks (benchmarks/corpus.py).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common  # noqa: E402  (sets XLA_FLAGS before jax is imported)

BATCH, SEQ = 16, 16
NO_DROPOUT = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}


def _model(cls, config, size: str, layers: int | None = None):
    """(model, params): random weights when tiny; at the real size only their shapes
    (jax.ShapeDtypeStruct leaves: the benchmark compiles, it never runs them). `layers`
    replaces the configuration's depth (each stack's, for an encoder-decoder)."""
    import functools

    import jax

    for depth in ("n_layer", "num_hidden_layers", "encoder_layers", "decoder_layers"):
        if layers is not None and hasattr(config, depth):
            setattr(config, depth, layers)
    # transformers' recipe for initialising outside the constructor (`_do_init=False`): jitted
    # (the constructor's eager init is slow on CPU), or only abstractly at the real size.
    model = cls(config, seed=0, _do_init=False)
    if size == "real":
        init = functools.partial(model.init_weights, input_shape=model.input_shape)
        return model, jax.eval_shape(init, jax.random.key(0))
    init = jax.jit(model.init_weights, static_argnums=1)
    return model, init(jax.random.key(0), model.input_shape)


def _adamw_step(model, params, loss_of_logits, inputs_of):
    """The Flax example scripts' train step around `model`: `loss_of_logits(logits, batch)`,
    `inputs_of(batch)` the model's keyword arguments."""
    import jax
    import optax

    tx = optax.adamw(1e-3, weight_decay=1e-2)
    opt_leaves, opt_tree = jax.tree.flatten(jax.eval_shape(tx.init, params) if isinstance(
        jax.tree.leaves(params)[0], jax.ShapeDtypeStruct) else tx.init(params))

    def step(params, opt_leaves, batch, labels):
        def loss_fn(params):
            logits = model(**inputs_of(batch), params=params, train=True)[0]
            return loss_of_logits(logits, labels)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, jax.tree.unflatten(opt_tree, opt_leaves), params)
        return optax.apply_updates(params, updates), jax.tree.leaves(opt_state), loss

    return step, params, opt_leaves


def _token_cross_entropy(logits, labels):
    import optax

    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def _tokens(batch, seq, vocab, seed=1):
    import numpy as np

    rng = np.random.default_rng(seed)
    return rng.integers(0, vocab, (batch, seq)).astype("int32")


def hf_gpt2(size: str = "tiny", batch: int = BATCH, seq: int = SEQ, layers: int | None = None):
    """FlaxGPT2LMHeadModel, causal LM loss on shifted tokens (run_clm_flax.py)."""
    import jax.numpy as jnp
    from transformers import FlaxGPT2LMHeadModel, GPT2Config

    if size == "real":
        config = GPT2Config(n_positions=max(seq, 1024), **NO_DROPOUT)  # GPT-2 small, 124M
    else:
        config = GPT2Config(vocab_size=128, n_positions=seq, n_embd=32, n_layer=2, n_head=4,
                            **NO_DROPOUT)
    model, params = _model(FlaxGPT2LMHeadModel, config, size, layers)

    def loss(logits, tokens):  # predict token t+1 from tokens up to t
        return _token_cross_entropy(logits[:, :-1], tokens[:, 1:])

    step, params, opt = _adamw_step(model, params, loss, lambda b: b)
    tokens = _tokens(batch, seq, config.vocab_size)
    data = {"input_ids": tokens, "attention_mask": jnp.ones_like(tokens)}
    return step, (params, opt, data, tokens)


def hf_bert(size: str = "tiny", batch: int = BATCH, seq: int = SEQ, layers: int | None = None):
    """FlaxBertForMaskedLM, masked-LM loss on the masked positions (run_mlm_flax.py)."""
    import numpy as np
    import optax
    from transformers import BertConfig, FlaxBertForMaskedLM

    if size == "real":
        config = BertConfig(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)  # base
    else:
        config = BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2,
                            num_attention_heads=4, intermediate_size=64,
                            max_position_embeddings=max(seq, 32), hidden_dropout_prob=0.0,
                            attention_probs_dropout_prob=0.0)
    model, params = _model(FlaxBertForMaskedLM, config, size, layers)

    def loss(logits, labels):  # run_mlm_flax: labels -100 outside the masked positions
        weights = (labels > 0).astype(logits.dtype)
        per_token = optax.softmax_cross_entropy_with_integer_labels(logits, labels.clip(0))
        return (per_token * weights).sum() / weights.sum()

    step, params, opt = _adamw_step(model, params, loss, lambda b: b)
    tokens = _tokens(batch, seq, config.vocab_size)
    rng = np.random.default_rng(2)
    masked = rng.random(tokens.shape) < 0.15
    masked[:, 0] = True  # every example has a masked token
    labels = np.where(masked, tokens, -100).astype("int32")
    data = {"input_ids": np.where(masked, 3, tokens).astype("int32"),
            "attention_mask": np.ones_like(tokens), "token_type_ids": np.zeros_like(tokens)}
    return step, (params, opt, data, labels)


def hf_llama(size: str = "tiny", batch: int = BATCH, seq: int = SEQ, layers: int | None = None):
    """FlaxLlamaForCausalLM (rotary positions, RMSNorm, SwiGLU, grouped-query attention)."""
    import jax.numpy as jnp
    from transformers import FlaxLlamaForCausalLM, LlamaConfig

    if size == "real":  # a Llama-3.2-1B-shaped model
        config = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=8192,
                             num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                             max_position_embeddings=max(seq, 2048))
    else:
        config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=max(seq, 32))
    model, params = _model(FlaxLlamaForCausalLM, config, size, layers)

    def loss(logits, tokens):
        return _token_cross_entropy(logits[:, :-1], tokens[:, 1:])

    step, params, opt = _adamw_step(model, params, loss, lambda b: b)
    tokens = _tokens(batch, seq, config.vocab_size)
    data = {"input_ids": tokens, "attention_mask": jnp.ones_like(tokens)}
    return step, (params, opt, data, tokens)


def hf_bart(size: str = "tiny", batch: int = BATCH, seq: int = SEQ, layers: int | None = None):
    """FlaxBartForConditionalGeneration (encoder-decoder); the decoder inputs are the labels
    shifted right, made by the data pipeline as in run_summarization_flax.py."""
    import numpy as np
    from transformers import BartConfig, FlaxBartForConditionalGeneration

    no_dropout = {"dropout": 0.0, "attention_dropout": 0.0, "activation_dropout": 0.0}
    if size == "real":
        config = BartConfig(**no_dropout)  # bart-large's shapes, 400M
    else:
        config = BartConfig(vocab_size=128, d_model=32, encoder_layers=2, decoder_layers=2,
                            encoder_attention_heads=4, decoder_attention_heads=4,
                            encoder_ffn_dim=64, decoder_ffn_dim=64,
                            max_position_embeddings=max(seq, 32), **no_dropout)
    model, params = _model(FlaxBartForConditionalGeneration, config, size, layers)
    step, params, opt = _adamw_step(model, params, _token_cross_entropy, lambda b: b)
    source = _tokens(batch, seq, config.vocab_size, seed=1)
    labels = _tokens(batch, seq, config.vocab_size, seed=2)
    start = np.full((batch, 1), config.decoder_start_token_id, "int32")
    decoder_inputs = np.concatenate([start, labels[:, :-1]], axis=1)
    data = {"input_ids": source, "attention_mask": np.ones_like(source),
            "decoder_input_ids": decoder_inputs,
            "decoder_attention_mask": np.ones_like(decoder_inputs)}
    return step, (params, opt, data, labels)


def hf_vit(size: str = "tiny", batch: int = BATCH, layers: int | None = None):
    """FlaxViTForImageClassification (patch embedding convolution, [CLS] token)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from transformers import FlaxViTForImageClassification, ViTConfig

    if size == "real":
        config = ViTConfig(num_labels=1000, hidden_dropout_prob=0.0,
                           attention_probs_dropout_prob=0.0)  # ViT-B/16, 224x224
    else:
        config = ViTConfig(image_size=16, patch_size=4, hidden_size=32, num_hidden_layers=2,
                           num_attention_heads=4, intermediate_size=64, num_labels=10,
                           hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model, params = _model(FlaxViTForImageClassification, config, size, layers)
    step, params, opt = _adamw_step(model, params, _token_cross_entropy,
                                    lambda b: {"pixel_values": b})
    rng = np.random.default_rng(1)
    shape = (batch, 3, config.image_size, config.image_size)
    # At the real size the images too are only a shape (600 KB an image in f32).
    pixels = (jax.ShapeDtypeStruct(shape, jnp.float32) if size == "real"
              else rng.standard_normal(shape).astype("float32"))
    labels = rng.integers(0, config.num_labels, (batch,)).astype("int32")
    return step, (params, opt, pixels, labels)


def hf_gpt2_generate(size: str = "tiny", batch: int = 8, prompt: int = 8, new_tokens: int = 8):
    """Greedy generation with FlaxGPT2LMHeadModel.generate (a KV cache in a while loop), jitted
    the way transformers' docs jit it."""
    from transformers import FlaxGPT2LMHeadModel, GPT2Config

    if size == "real":
        config = GPT2Config(**NO_DROPOUT)
    else:
        config = GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=2, n_head=4,
                            **NO_DROPOUT)
    config.pad_token_id = config.eos_token_id
    model, params = _model(FlaxGPT2LMHeadModel, config, size)

    def generate(params, input_ids):
        return model.generate(input_ids, params=params, max_new_tokens=new_tokens,
                              do_sample=False).sequences

    generate.donate_argnums = ()  # inference: the parameters are kept
    return generate, (params, _tokens(batch, prompt, config.vocab_size))


def hf_bert_classify(size: str = "tiny", batch: int = BATCH, seq: int = SEQ):
    """FlaxBertForSequenceClassification inference: class probabilities."""
    import jax
    import numpy as np
    from transformers import BertConfig, FlaxBertForSequenceClassification

    if size == "real":
        config = BertConfig(num_labels=3)
    else:
        config = BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2,
                            num_attention_heads=4, intermediate_size=64,
                            max_position_embeddings=max(seq, 32), num_labels=3)
    model, params = _model(FlaxBertForSequenceClassification, config, size)

    def classify(params, input_ids, attention_mask):
        return jax.nn.softmax(model(input_ids, attention_mask, params=params, train=False)[0])

    classify.donate_argnums = ()
    tokens = _tokens(batch, seq, config.vocab_size)
    mask = np.ones_like(tokens)
    mask[: batch // 2, seq // 2:] = 0  # padded examples
    return classify, (params, tokens, mask)


MODELS = {"hf_gpt2": hf_gpt2, "hf_bert": hf_bert, "hf_llama": hf_llama, "hf_bart": hf_bart,
          "hf_vit": hf_vit, "hf_gpt2_generate": hf_gpt2_generate,
          "hf_bert_classify": hf_bert_classify}

if __name__ == "__main__":
    sys.exit(_common.main(MODELS))
