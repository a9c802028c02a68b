"""The GRPO memory plan (memory/grpo_plan.py): the KV cache, the reference, the completion-only logits."""

from __future__ import annotations

from transformers import Qwen2Config

from tpu_helpers.memory.grpo_plan import grpo_estimate, kv_cache_bytes
from tpu_helpers.memory.hf_plan import hf_finetune_estimate, meta_model

# Qwen2.5-0.5B-Instruct's sizes (config.json of the hub model), built on the meta device: nothing downloaded.
QWEN_05B = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                       num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                       tie_word_embeddings=True)


def test_the_plan_counts_the_cache_the_reference_and_only_the_completion_logits():
    kw = dict(num_generations=8, max_prompt_len=256, max_new_tokens=512, precision="bf16",
              gradient_checkpointing=True, loss_chunk=0)  # the completion's logits whole
    lora = grpo_estimate(QWEN_05B, 4, method="lora", **kw)
    full = grpo_estimate(QWEN_05B, 4, method="full", **kw)
    # 32 rows x 768 slots x 24 layers x 2 kv heads x 64 dims, keys and values, bf16: 288 MiB.
    assert kv_cache_bytes(QWEN_05B, 32, 768) == 2 * 24 * 32 * 768 * 2 * 64 * 2 == 288 * 2**20
    assert lora.phases["the generation"]["activations"] == 288 * 2**20
    params = sum(p.numel() for p in meta_model(QWEN_05B).parameters())
    # Full fine-tuning holds a frozen bf16 reference as well; LoRA's reference is the model with the adapter off.
    sft_full = hf_finetune_estimate(QWEN_05B, 32, 768, method="full", precision="bf16", gradient_checkpointing=True)
    assert full.phases["the end of the backward"]["params"] == sft_full.phases["the end of the backward"]["params"] \
        + 2 * params
    sft_lora = hf_finetune_estimate(QWEN_05B, 32, 768, method="lora", precision="bf16", gradient_checkpointing=True,
                                    loss_chunk=0)
    assert lora.phases["the end of the backward"]["params"] == sft_lora.phases["the end of the backward"]["params"]
    # Logits for the 513 completion positions only, not all 768.
    saved = 12 * 32 * 151936 * (768 - 513)
    assert lora.phases["the start of the backward"]["activations"] == \
        sft_lora.phases["the start of the backward"]["activations"] - saved
    # With the chunked loss ("auto": 256 tokens per chunk) one chunk of the 32 x 512 completion tokens' logits.
    chunked = grpo_estimate(QWEN_05B, 4, method="lora", **{**kw, "loss_chunk": "auto"})
    assert chunked.phases["the start of the backward"]["activations"] == \
        sft_lora.phases["the start of the backward"]["activations"] - 12 * 151936 * (32 * 768 - 256)
    assert full.peak_bytes > lora.peak_bytes and "KV cache 288 MiB" in " ".join(lora.notes)
    # Without KL there is no reference under full fine-tuning either.
    no_kl = grpo_estimate(QWEN_05B, 4, method="full", kl_beta=0.0, **kw)
    assert no_kl.phases["the generation"]["params"] == full.phases["the generation"]["params"] - 2 * params


def test_the_recipe_plans_from_the_config_alone(tmp_path):
    from tpu_helpers.recipes.grpo import GRPO, GRPOConfig

    job = GRPO(GRPOConfig(device="cpu", start_from="sft", out_dir=str(tmp_path)), progress=False)
    plan = job.plan()
    assert plan.fits and plan.estimate.batch_size == 8 and "_loaded" not in job.__dict__
    assert not (tmp_path / "sft").exists()  # planning ran no warm-start fine-tuning
