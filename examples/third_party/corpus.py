"""The corpus of programs from libraries hloplan did not write: which example builds each one,
the library it comes from, and what hloplan is expected to do with its batch.

    python examples/third_party/corpus.py            # list the corpus

Used by tests/third_party/ (tiny configurations, compiled, run and checked on 8 simulated CPU
devices) and benchmarks/corpus.py (the same programs at realistic sizes, compile-only).
"""

from __future__ import annotations

import importlib
import os
import sys
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


@dataclass(frozen=True)
class Program:
    name: str
    library: str  # the library the model comes from (optax is the optimizer of most)
    script: str  # the example module defining MODELS[name]
    kind: str = "train"  # "train" step or "inference" function
    # Why the batch does not split into microbatches (None: it does, and pipelines and
    # gradient accumulation must compile, run and match).
    no_split: str | None = None
    # Why the memory-budget fallback to gradient accumulation cannot help (None: it can):
    # accumulating shrinks activations, not parameters and optimizer state.
    no_accumulation: str | None = None
    # A known hloplan limitation the corpus keeps visible: its cases are expected to fail.
    xfail: str | None = None
    requires: tuple[str, ...] = ()  # importable modules the program needs

    def build(self, **kwargs):
        """(function, example arguments) of the program, tiny unless kwargs say otherwise."""
        if self.script.startswith("keras"):
            os.environ["KERAS_BACKEND"] = "jax"  # keras picks its backend once, at import
        module = importlib.import_module(self.script)
        return module.MODELS[self.name](**kwargs)

    def export(self, **kwargs) -> tuple[bytes, tuple]:
        """(serialized jax.export of the jitted program, its example arguments)."""
        import _common

        function, args = self.build(**kwargs)
        return _common.export_step(function, args), args


BATCH_STATISTICS = "BatchNorm normalises with statistics of the whole batch"
HF = ("transformers", "flax", "optax")
STATE_BOUND = ("its parameters and optimizer state, which accumulating gradients does not "
               "shrink, make up most of its peak at this tiny size")

PROGRAMS = [
    Program("hf_gpt2", "transformers (Flax GPT-2)", "transformers_train_step", requires=HF),
    Program("hf_bert", "transformers (Flax BERT)", "transformers_train_step", requires=HF),
    Program("hf_llama", "transformers (Flax Llama)", "transformers_train_step", requires=HF),
    Program("hf_bart", "transformers (Flax BART)", "transformers_train_step", requires=HF),
    Program("hf_vit", "transformers (Flax ViT)", "transformers_train_step", requires=HF),
    Program("hf_gpt2_generate", "transformers (Flax GPT-2)", "transformers_train_step",
            kind="inference", no_split="generation (a while loop writing a KV cache) is not "
            "split into microbatches", requires=HF),
    Program("hf_bert_classify", "transformers (Flax BERT)", "transformers_train_step",
            kind="inference", requires=HF),
    Program("nnx_transformer", "flax.nnx + optax", "flax_train_step", requires=("flax", "optax")),
    Program("linen_mlp", "flax.linen + optax", "flax_train_step", no_accumulation=STATE_BOUND,
            requires=("flax", "optax")),
    Program("linen_resnet", "flax.linen + optax", "flax_train_step", requires=("flax", "optax")),
    Program("eqx_mlp", "equinox + optax", "equinox_train_step", no_accumulation=STATE_BOUND,
            requires=("equinox", "optax")),
    Program("eqx_cnn", "equinox + optax", "equinox_train_step", no_accumulation=STATE_BOUND,
            requires=("equinox", "optax")),
    Program("haiku_transformer", "haiku + optax", "haiku_train_step", requires=("haiku", "optax")),
    Program("haiku_resnet", "haiku + optax", "haiku_train_step", no_split=BATCH_STATISTICS,
            requires=("haiku", "optax")),
    Program("keras_mlp", "keras 3", "keras_train_step", no_accumulation=STATE_BOUND,
            requires=("keras",)),
    Program("keras_cnn", "keras 3", "keras_train_step", no_split=BATCH_STATISTICS,
            requires=("keras",)),
    Program("keras_gemma", "keras 3", "keras_train_step", requires=("keras",)),
    Program("keras_moe", "keras 3", "keras_train_step", requires=("keras",)),
]

BY_NAME = {p.name: p for p in PROGRAMS}


def accumulation_budget(data: bytes, time_limit: float = 5.0) -> int:
    """A memory budget for 8 devices 5% below the smallest peak of any single-program plan
    (activations recomputed or not), read from hloplan's diagnostic for a budget nothing
    fits: only accumulating gradients can meet it, if anything can."""
    import re

    import hloplan
    from hloplan.diagnostics import HloplanError
    from hloplan.units import parse_bytes

    try:
        hloplan.compile(data, "8", device="toy", time_limit=time_limit, memory_budget=1)
        raise AssertionError("a 1-byte memory budget was met")
    except HloplanError as exc:
        text = str(exc)
    single = [parse_bytes(p.replace(" ", "")) for p in re.findall(
        r"smallest (?:achievable )?peak (?:is )?(?:at least )?([\d.]+ \w+)", text)]
    if not single:
        raise AssertionError(f"no smallest peak in: {text}")
    return int(0.95 * min(single))


if __name__ == "__main__":
    for p in PROGRAMS:
        print(f"{p.name:20} {p.kind:9} {p.library:28} "
              f"{'batch splits' if p.no_split is None else p.no_split}")
