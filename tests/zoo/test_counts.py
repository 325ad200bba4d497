"""Parameter counts of the example specs against Galvatron-BMW Table I, built on the meta device."""

from __future__ import annotations

import resource
from pathlib import Path

import pytest

from services.specs.model import load_model_spec
from services.zoo import build_model, count_parameters

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
# Galvatron-BMW, Table I "Statistics of Models", column "Param. Num".
TABLE_I = {
    "bert-huge-32.yaml": 672e6,
    "bert-huge-48.yaml": 987e6,
    "vit-huge-32.yaml": 632e6,
    "t5-large-32.yaml": 502e6,
    "swin-huge-32.yaml": 701e6,
    "gpt3-15b.yaml": 15.4e9,
}


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


@pytest.mark.parametrize("name", list(TABLE_I))
def test_count_matches_table_i_within_one_percent(name: str) -> None:
    before = peak_rss_bytes()
    count = count_parameters(load_model_spec(EXAMPLES / name))
    assert abs(count - TABLE_I[name]) / TABLE_I[name] < 0.01, f"{name}: {count:,} vs {TABLE_I[name]:,.0f}"
    assert peak_rss_bytes() - before < 512 * 2**20  # fp32 weights alone would be 2.5 GB to 62 GB


@pytest.mark.parametrize("name", ["gpt3-15b.yaml", "swin-huge-32.yaml", "t5-large-32.yaml"])
def test_meta_build_allocates_nothing(name: str) -> None:
    model = build_model(load_model_spec(EXAMPLES / name), device="meta")
    assert all(p.is_meta for p in model.parameters())
    assert all(b.is_meta for b in model.buffers())


def test_gpt_count_is_the_closed_form() -> None:
    spec = load_model_spec(EXAMPLES / "gpt3-15b.yaml")
    t = spec.transformer
    h, layers = t.hidden_size, t.num_layers
    # Per block: qkv + proj + 2-layer MLP (weights, biases) + 2 LayerNorms; tied head adds nothing.
    per_block = 4 * h * h + 4 * h + 2 * h * t.ffn_hidden_size + t.ffn_hidden_size + h + 4 * h
    expected = layers * per_block + (t.vocab_size + t.seq_length) * h + 2 * h
    assert count_parameters(spec) == expected == 15_370_501_120


def test_t5_512_4_example_is_small_and_imbalanced() -> None:
    spec = load_model_spec(EXAMPLES / "t5-512-4.yaml")
    assert (spec.transformer.seq_length, spec.transformer.decoder_seq_length) == (512, 4)
    assert count_parameters(spec) < 100_000
