"""The memory plan knows the sharding: FSDP divides parameters, gradients and optimizer state by the chips."""

from __future__ import annotations

import pytest

from tpu_helpers.memory import analytic_estimate
from tpu_helpers.memory.sharded import gpt_sharding_plan, shard_estimate, sharding_plan

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
    assert "data parallel needs 24." in plan.advice()
    small = gpt_sharding_plan("small", 8, 1024, chips=8)
    assert small.recommended() == "data" and "fits data parallel" in small.advice()
    # Too big even for fsdp over all chips: the message says what else to do.
    huge = sharding_plan(lambda b: analytic_estimate(XL, b, 1024), 64, chips=2, hardware="v5e",
                         block_params=12 * 1600**2)
    assert huge.min_fsdp_chips() is None and "does not fit on 2 chips" in huge.advice()
    with pytest.raises(ValueError, match="chips=0 must be an integer >= 1"):
        sharding_plan(lambda b: analytic_estimate("tiny", b), 1, chips=0)
