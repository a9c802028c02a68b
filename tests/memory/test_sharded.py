"""The memory plan knows the sharding: FSDP divides parameters, gradients and optimizer state by the chips."""

from __future__ import annotations

import pytest

from tpu_helpers.memory import analytic_estimate
from tpu_helpers.memory.per_chip import gpt_sharding_plan, shard_estimate, sharding_plan

XL = dict(vocab_size=50304, block_size=1024, n_layer=48, n_head=25, n_embd=1600)  # GPT-2 XL size, 1.6B


def test_fsdp_divides_the_model_state_and_keeps_the_activations():
    base = analytic_estimate("small", 4, 256, precision="bf16")
    sharded = shard_estimate(base, 8, block_params=12 * 768**2)
    for key in ("params", "grads", "optimizer"):
        assert sharded.breakdown[key] == -(-base.breakdown[key] // 8)
    assert sharded.breakdown["activations"] == base.breakdown["activations"]
    assert sharded.breakdown["temporaries"] >= 2 * 12 * 768**2 * 4
    assert shard_estimate(base, 1) is base
    with pytest.raises(ValueError, match="fsdp=0 must be an integer >= 1"):
        shard_estimate(base, 0)


def test_the_plan_says_how_many_chips_fsdp_needs():
    plan = gpt_sharding_plan(XL, 1, 1024, chips=8, hardware="v5e", gradient_checkpointing=True)
    assert list(plan.per_chip) == ["data", "fsdp x2", "fsdp x4", "fsdp x8"]
    assert not plan.fits("data") and plan.fits("fsdp x8") and plan.recommended() == "fsdp"
    assert plan.min_fsdp_chips() == 2
    assert plan.advice().startswith("full fine-tuning of this 1.6B model needs fsdp over at least 2 chips of "
                                    "TPU v5e"), plan.advice()
    assert "data parallel needs 23.6 GiB" in plan.advice()
    small = gpt_sharding_plan("small", 8, 1024, chips=8)
    assert small.recommended() == "data" and "fits data parallel" in small.advice()
    # Too big even for fsdp over all chips: the message says what else to do.
    huge = sharding_plan(lambda b: analytic_estimate(XL, b, 1024), 64, chips=2, hardware="v5e",
                         block_params=12 * 1600**2)
    assert huge.min_fsdp_chips() is None and "does not fit on 2 chips" in huge.advice()
    with pytest.raises(ValueError, match="chips=0 must be an integer >= 1"):
        sharding_plan(lambda b: analytic_estimate("tiny", b), 1, chips=0)


def _qwen(**sizes):
    from transformers import Qwen2Config

    return Qwen2Config(**{"num_hidden_layers": 28, "tie_word_embeddings": True, **sizes})


def test_the_fine_tuning_plan_says_when_a_hf_model_needs_fsdp():
    from tpu_helpers.memory.hf_plan import hf_sharding_plan

    qwen_1_5b = _qwen(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_attention_heads=12,
                      num_key_value_heads=2)
    # The whole logits (LOSS_CHUNK=0): the moment they weigh most is what is checked below.
    full = hf_sharding_plan(qwen_1_5b, 1, 1024, chips=8, method="full", gradient_checkpointing=True, loss_chunk=0)
    assert full.advice().startswith("full fine-tuning of this 1.5B model needs fsdp over at least 2 chips of TPU v5e"), \
        full.advice()
    assert "data parallel needs 23.1 GiB" in full.advice() and full.recommended() == "fsdp"
    # The peak is at the end of the backward (every gradient, the optimizer state), not with the logits too...
    data, fsdp8 = full.per_chip["data"], full.per_chip["fsdp x8"]
    assert data.breakdown["grads"] == data.breakdown["params"] and data.notes[-1] == "peak: the end of the backward"
    # ... but sharding shrinks the gradients, not the activations: over 8 chips the start of the backward (the
    # logits alive, no gradient yet) is the larger moment, and the plan weighs both again.
    assert fsdp8.breakdown["grads"] == 0 and fsdp8.notes[-1] == "peak: the start of the backward"
    assert fsdp8.breakdown["activations"] > 12 * 1024 * 151936
    qwen_7b = _qwen(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_attention_heads=28,
                    num_key_value_heads=4, tie_word_embeddings=False)
    lora = hf_sharding_plan(qwen_7b, 1, 1024, chips=8, method="lora", gradient_checkpointing=True)
    assert lora.advice().startswith("LoRA fine-tuning of this 7.6B model needs fsdp over at least 2 chips"), \
        lora.advice()


def test_the_finetune_recipe_plans_per_chip_under_its_sharding(tiny_lm_dir):
    from tpu_helpers.recipes.finetune import Finetune, FinetuneConfig

    def job(sharding):
        return Finetune(FinetuneConfig(method="full", device="cpu", sharding=sharding, batch_size=4, seq_len=32))

    data, fsdp = job("data").plan(chips=8), job("fsdp").plan(chips=8)
    assert fsdp.estimate.method.endswith("fsdp x8") and not data.estimate.method.endswith("fsdp x8")
    for key in ("params", "grads", "optimizer"):
        assert fsdp.estimate.breakdown[key] == -(-data.estimate.breakdown[key] // 8)
    assert fsdp.estimate.breakdown["activations"] == data.estimate.breakdown["activations"]
    advice = job("fsdp").sharding_advice(chips=8)
    assert advice.startswith("SHARDING='fsdp': about ") and "fsdp x8" in advice, advice
    assert job("fsdp").sharding_advice() == ""  # one chip here: nothing to compare
    with pytest.raises(ValueError, match=r"sharding='2x4' needs 2 x 4 = 8 chips but this run has 1"):
        job("2x4").plan()
