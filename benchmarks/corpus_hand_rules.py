"""Tensor- and expert-parallel rules for the third-party corpus's programs, as an expert who
knows each model writes them (the regex-over-parameter-path partition rules of t5x, EasyLM
and MaxText): for every training-state tensor (a parameter or an optimizer moment of one),
the dim split over the tensor-parallel mesh axis, or None (replicated over that axis).

Megatron's layout: the attention's query/key/value and the MLP's first matmuls split their
output features (heads, hidden units), the attention output and the MLP's last matmul split
their input features, embeddings and output heads split the vocabulary; norms and the biases
of row-split matmuls stay whole. A dim the axis does not divide stays whole (hand_plans
checks): GPT-2's, BERT's and BART's vocabularies (50,257, 30,522, 50,265) divide by none of
the slices' axes, and their embeddings stay replicated.

The flax and haiku programs' state is a tree of named parameters (optax moments repeat the
parameter's path under `mu` / `nu`); keras's is a list, so its rules match shapes, which the
models' configurations fix (keras_train_step.py: width 1,024, vocabulary 32,000)."""

from __future__ import annotations

import re


def _by_path(rules: list[tuple[str, int]]):
    patterns = [(re.compile(pattern), dim) for pattern, dim in rules]

    def tensor_dim(path: str, shape: tuple[int, ...]) -> int | None:
        for pattern, dim in patterns:
            if pattern.search(path):
                return dim if dim < len(shape) else None
        return None

    return tensor_dim


def _by_shape(rules: dict[tuple[int, ...], int]):
    def tensor_dim(path: str, shape: tuple[int, ...]) -> int | None:
        return rules.get(tuple(shape))

    return tensor_dim


# flax Dense kernels are (in, out); GPT-2's Conv1D kernels as hf's flax port stores them
# (out, in); haiku Linear weights (in, out).
TENSOR_DIMS = {
    "hf_gpt2": _by_path([
        (r"\['c_attn'\]", 0),                 # fused q, k, v: output features (and bias)
        (r"\['attn'\]\['c_proj'\]\['kernel'\]", 1),
        (r"\['c_fc'\]", 0),
        (r"\['mlp'\]\['c_proj'\]\['kernel'\]", 1),
        (r"\['wte'\]", 0),
    ]),
    "hf_bert": _by_path([
        (r"\['self'\]\['(query|key|value)'\]\['kernel'\]", 1),
        (r"\['self'\]\['(query|key|value)'\]\['bias'\]", 0),
        (r"\['attention'\]\['output'\]\['dense'\]\['kernel'\]", 0),
        (r"\['intermediate'\]\['dense'\]\['kernel'\]", 1),
        (r"\['intermediate'\]\['dense'\]\['bias'\]", 0),
        (r"\['layer'\]\['\d+'\]\['output'\]\['dense'\]\['kernel'\]", 0),
        (r"\['word_embeddings'\]", 0),
        (r"\['predictions'\]\['bias'\]", 0),
    ]),
    "hf_bart": _by_path([
        (r"\['[qkv]_proj'\]\['kernel'\]", 1),
        (r"\['[qkv]_proj'\]\['bias'\]", 0),
        (r"\['out_proj'\]\['kernel'\]", 0),
        (r"\['fc1'\]\['kernel'\]", 1),
        (r"\['fc1'\]\['bias'\]", 0),
        (r"\['fc2'\]\['kernel'\]", 0),
        (r"\['shared'\]", 0),
        (r"\['final_logits_bias'\]", 1),
    ]),
    "hf_llama": _by_path([
        (r"\['[qkv]_proj'\]\['kernel'\]", 1),
        (r"\['o_proj'\]\['kernel'\]", 0),
        (r"\['(gate|up)_proj'\]\['kernel'\]", 1),
        (r"\['down_proj'\]\['kernel'\]", 0),
        (r"\['embed_tokens'\]", 0),
        (r"\['lm_head'\]\['kernel'\]", 1),
    ]),
    "hf_vit": _by_path([
        (r"\['attention'\]\['attention'\]\['(query|key|value)'\]\['kernel'\]", 1),
        (r"\['attention'\]\['attention'\]\['(query|key|value)'\]\['bias'\]", 0),
        (r"\['attention'\]\['output'\]\['dense'\]\['kernel'\]", 0),
        (r"\['intermediate'\]\['dense'\]\['kernel'\]", 1),
        (r"\['intermediate'\]\['dense'\]\['bias'\]", 0),
        (r"\['layer'\]\['\d+'\]\['output'\]\['dense'\]\['kernel'\]", 0),
        (r"\['classifier'\]\['kernel'\]", 1),
        (r"\['classifier'\]\['bias'\]", 0),
    ]),
    # flax.nnx MultiHeadAttention kernels: query/key/value (in, heads, head_dim), out
    # (heads, head_dim, out).
    "nnx_transformer": _by_path([
        (r"\['attn'\]\['(query|key|value)'\]\['kernel'\]", 1),
        (r"\['attn'\]\['out'\]\['kernel'\]", 0),
        (r"\['up'\]\['kernel'\]", 1),
        (r"\['up'\]\['bias'\]", 0),
        (r"\['down'\]\['kernel'\]", 0),
        (r"\['embed'\]\['embedding'\]", 0),
        (r"\['head'\]\['kernel'\]", 1),
        (r"\['head'\]\['bias'\]", 0),
    ]),
    "haiku_transformer": _by_path([
        (r"multi_head_attention(_\d+)?/(query|key|value)'\]\['w'\]", 1),
        (r"multi_head_attention(_\d+)?/linear'\]\['w'\]", 0),
        (r"mlp(_\d+)?/~/linear_0'\]\['w'\]", 1),
        (r"mlp(_\d+)?/~/linear_0'\]\['b'\]", 0),
        (r"mlp(_\d+)?/~/linear_1'\]\['w'\]", 0),
        (r"\['embed'\]", 0),
        (r"\['linear'\]\['w'\]", 1),
        (r"\['linear'\]\['b'\]", 0),
    ]),
    "keras_gemma": _by_shape({
        (32000, 1024): 0,        # tied embedding: vocabulary
        (1024, 4096): 1,         # gate and up projections: hidden units
        (4096, 1024): 0,         # down projection
        (1024, 8, 128): 1,       # query: heads (the one key/value head stays whole)
        (8, 128, 1024): 0,       # attention output
    }),
    "keras_moe": _by_shape({
        (32000, 1024): 0,
        (8, 1024, 2048): 2,      # each expert's gate and up: hidden units
        (8, 2048, 1024): 1,      # each expert's down
        (1024, 16, 64): 1,       # query heads
        (1024, 4, 64): 1,        # key/value heads
        (16, 64, 1024): 0,
    }),
    # Megatron for convolutions: a block's first 3x3 convolution splits its output channels
    # (and the norm after it its channels), the second its input channels (one partial-sum
    # reduction per block); the classifier its classes. The 1x1 shortcut projections (Conv_0
    # of Blocks 1 to 3) stay whole.
    "linen_resnet": _by_path([
        (r"\['Block_0'\]\['Conv_0'\]", 3),
        (r"\['Block_0'\]\['Conv_1'\]", 2),
        (r"\['Block_\d+'\]\['Conv_1'\]", 3),
        (r"\['Block_\d+'\]\['Conv_2'\]", 2),
        (r"\['Block_\d+'\]\['GroupNorm_1'\]", 0),
        (r"\['Dense_0'\]\['kernel'\]", 1),
        (r"\['Dense_0'\]\['bias'\]", 0),
    ]),
}

# Expert parallel: the experts' dim of every expert weight.
EXPERT_DIMS = {
    "keras_moe": _by_shape({(8, 1024, 2048): 0, (8, 2048, 1024): 0}),
}
