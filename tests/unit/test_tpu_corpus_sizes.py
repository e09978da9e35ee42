"""benchmarks/tpu.py --corpus-size: the batches tried per program and the fall-back to a halved
batch per device where the realistic size does not fit a TPU v5e device (no libtpu needed)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from hloplan.diagnostics import NoPlanFits, UsageError

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tpu_bench():
    saved = dict(os.environ)  # the script sets JAX_PLATFORMS and libtpu's variables at import
    spec = importlib.util.spec_from_file_location("tpu_bench", REPO_ROOT / "benchmarks" / "tpu.py")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return module


def test_candidates(tpu_bench):
    assert [c["batch"] for c in tpu_bench.corpus_size_candidates("hf_gpt2", 8)] == [16]
    realistic = tpu_bench.corpus_size_candidates("hf_gpt2", 8, "realistic")
    assert [c["batch"] for c in realistic] == [64, 32, 16]
    assert all(c["seq"] == 512 and c["layers"] == 4 for c in realistic)
    resnet = tpu_bench.corpus_size_candidates("linen_resnet", 32, "realistic")
    assert [c["batch"] for c in resnet] == [1024, 512, 256]
    vit = tpu_bench.corpus_size_candidates("hf_vit", 8, "realistic")
    assert [c["batch"] for c in vit] == [256, 128, 64]
    assert all(c["layers"] == 4 and "seq" not in c for c in vit)


def test_nnx_transformer_at_the_real_size_is_built_as_shapes():
    """The Flax NNX decoder's realistic widths, its parameters and optimizer state only as
    shapes (nnx.eval_shape): no weights are made."""
    pytest.importorskip("flax")
    pytest.importorskip("optax")
    import sys

    import jax

    sys.path.insert(0, str(REPO_ROOT / "examples" / "third_party"))
    import flax_train_step

    step, (params, opt, tokens, labels) = flax_train_step.nnx_transformer(
        layers=1, size="real", batch=2, seq=16)
    leaves = jax.tree.leaves((params, opt))
    assert leaves and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
    assert params["embed"]["embedding"].shape == (32768, 1024)
    assert params["blocks"]["0"]["attn"]["query"]["kernel"].shape == (1024, 16, 64)
    assert params["pos"].shape == (16, 1024) and tokens.shape == labels.shape == (2, 16)
    out = jax.eval_shape(step, params, opt, tokens, labels)
    assert out[0]["head"]["kernel"].shape == (1024, 32768)


def _fake_case(capacity, outcomes, calls):
    """A stand-in for _corpus_case_at: per batch, raise the outcome or report that peak."""
    def case(name, topology, sizes, keep, hand=False):
        calls.append(sizes["batch"])
        outcome = outcomes[sizes["batch"]]
        if isinstance(outcome, Exception):
            raise outcome
        return {"program": name, "sizes": sizes, "peak_ratio": 1.0,
                "peak_bytes": {"predicted": outcome, "compiled": outcome}}
    return case


def test_halves_the_batch_until_it_fits(tpu_bench, monkeypatch):
    from hloplan.cost_models import load_device_model

    capacity = load_device_model("tpu-v5e").memory_bytes
    calls: list[int] = []
    monkeypatch.setattr(tpu_bench, "_corpus_case_at", _fake_case(capacity, {
        64: NoPlanFits("no plan fits the memory budget"), 32: 2 * capacity, 16: capacity / 2},
        calls))
    row = tpu_bench.corpus_case("hf_gpt2", "v5e:2x4", size="realistic")
    assert calls == [64, 32, 16]
    assert row["sizes"]["batch"] == 16
    assert [t["sizes"]["batch"] for t in row["did_not_fit"]] == [64, 32]


def test_other_errors_and_the_small_size_do_not_retry(tpu_bench, monkeypatch):
    from hloplan.cost_models import load_device_model

    capacity = load_device_model("tpu-v5e").memory_bytes
    calls: list[int] = []
    monkeypatch.setattr(tpu_bench, "_corpus_case_at", _fake_case(capacity, {
        64: UsageError("unsupported op"), 16: NoPlanFits("no plan fits")}, calls))
    with pytest.raises(UsageError):
        tpu_bench.corpus_case("hf_gpt2", "v5e:2x4", size="realistic")
    with pytest.raises(NoPlanFits):
        tpu_bench.corpus_case("hf_gpt2", "v5e:2x4")
    assert calls == [64, 16]
    # the smallest realistic batch is reported even over the capacity: nothing smaller is tried
    monkeypatch.setattr(tpu_bench, "_corpus_case_at", _fake_case(capacity, {
        64: NoPlanFits("x"), 32: NoPlanFits("x"), 16: 2 * capacity}, calls))
    row = tpu_bench.corpus_case("hf_gpt2", "v5e:2x4", size="realistic")
    assert row["sizes"]["batch"] == 16 and len(row["did_not_fit"]) == 2
