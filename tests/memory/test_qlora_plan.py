"""The memory plan of a 4-bit base (QLoRA): the plan, the traced and the compiled estimates count its linear weights
at 4 bits plus their scales, and docs/jobs/finetune.md's table of 7-8B models on v5e-1 and v6e-1 is what the plan
computes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from tests.example_models import (
    TINY_LM_VOCAB,
    lm_batch,
    tiny_causal_lm_lora,
    tiny_causal_lm_qlora,
)
from tpu_helpers.memory import qlora_table
from tpu_helpers.memory.hf_plan import hf_finetune_estimate, lora_parameter_count, meta_model
from tpu_helpers.memory.traced import traced_estimate
from tpu_helpers.models.hf_tiny import TINY_ARCH

PAGE = Path(__file__).resolve().parents[2] / "docs" / "jobs" / "finetune.md"


def _linear_weights(c) -> int:
    """The decoder's linear weights (attention and MLP; not the head), from the sizes alone."""
    h, i, heads, kv = c.hidden_size, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads
    d = h // heads
    return c.num_hidden_layers * (h * heads * d + 2 * h * kv * d + heads * d * h + 3 * h * i)


def test_the_table_recomputes_from_the_published_sizes_and_is_the_readmes():
    rows = qlora_table.qlora_table()
    assert len(rows) == 8
    for r in rows:
        config = qlora_table.published_config(r["model"])
        published = qlora_table.PUBLISHED[r["model"]][2]
        assert r["parameters"] == pytest.approx(published, rel=0.005)  # the sizes are the published model's
        lin = _linear_weights(config)
        adapters = lora_parameter_count(meta_model(config), 8, ["q_proj", "k_proj", "v_proj", "o_proj"])
        if r["base"] == "bf16":
            weights = r["parameters"] * 2
        else:  # 4 bits and an fp32 scale per 64 weights for the linears, bf16 for the embeddings and head
            weights = (r["parameters"] - lin) * 2 + lin * (0.5 + 4 / 64)
        assert r["breakdown"]["params"] == int(weights + adapters * 4)
        for hw, hbm in (("v5e", 16e9), ("v6e", 32e9)):
            assert r["fits"][hw] == (r["peak_bytes"] <= 0.9 * hbm)
    # The verdicts the page states: a bf16 base needs a v6e-1, a 4-bit one fits a v5e-1, at both lengths.
    assert all(r["fits"] == {"v5e": r["base"] != "bf16", "v6e": True} for r in rows)
    table = qlora_table.markdown(rows)
    assert table in PAGE.read_text(), "docs/jobs/finetune.md's QLoRA table differs from qlora_table.markdown(); paste it again"


def test_the_plan_and_the_trace_count_the_4bit_base_alike():
    from transformers import Qwen2Config

    config = Qwen2Config(vocab_size=TINY_LM_VOCAB, use_cache=False, attn_implementation="eager", **TINY_ARCH)
    lin = _linear_weights(config)
    kwargs = dict(method="lora", lora_r=8, precision="fp32", lora_targets=["q_proj", "k_proj", "v_proj", "o_proj"])
    plain = hf_finetune_estimate(config, 2, 64, **kwargs)
    four = hf_finetune_estimate(config, 2, 64, quantize_base="nf4", quantize_group_size=32, **kwargs)
    assert plain.breakdown["params"] - four.breakdown["params"] == lin * 4 - int(lin * (0.5 + 4 / 32))
    # The same LoRA (r 8 on q/k/v/o), over an fp32 base and over the 4-bit one: two real steps on fake tensors.
    traced_plain = traced_estimate(tiny_causal_lm_lora, lm_batch(64, TINY_LM_VOCAB), 2)
    traced_four = traced_estimate(tiny_causal_lm_qlora, lm_batch(64, TINY_LM_VOCAB), 2)
    # The trace also holds the 16-entry code tables (buffers, one per quantized layer), which the plan leaves out.
    tables = 7 * TINY_ARCH["num_hidden_layers"] * 16 * 4
    assert traced_plain.breakdown["params"] - traced_four.breakdown["params"] == \
        lin * 4 - int(lin * (0.5 + 4 / 32)) - tables
    assert traced_four.peak_bytes < traced_plain.peak_bytes


@pytest.mark.xla
def test_the_compiled_estimate_counts_the_4bit_base():
    from tpu_helpers.memory.compiled import compiled_estimate

    model = tiny_causal_lm_qlora()
    stored = sum(p.numel() * p.element_size() for p in model.parameters())
    packed = sum(p.numel() for n, p in model.named_parameters() if p.dtype == torch.uint8)
    assert packed == _linear_weights(model.config) // 2
    est = compiled_estimate("tests.example_models:tiny_causal_lm_qlora", 2,
                            batch_fn="tests.example_models:tiny_lm_batch")
    assert est.breakdown["params"] == stored
    assert re.search(r"compilations: [1-3]$", "\n".join(est.notes), re.MULTILINE), est.notes
    print(f"compiled QLoRA step of the tiny model: {est.peak_bytes / 2**20:.2f} MiB ({est.notes})")
