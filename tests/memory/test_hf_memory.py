"""The traced estimate of Hugging Face models: LoRA (frozen base) and checkpointing through the model's own hook.
Dict batches with labels: the trainer's step takes the model's own loss."""

from tests.example_models import TINY_LM_VOCAB, lm_batch, tiny_causal_lm_lora
from tpu_helpers.memory.traced import traced_estimate


def test_traced_estimate_of_a_lora_model_counts_adapter_gradients_and_checkpointing():
    plain = traced_estimate(tiny_causal_lm_lora, lm_batch(64, TINY_LM_VOCAB), 4)
    ckpt = traced_estimate(tiny_causal_lm_lora, lm_batch(64, TINY_LM_VOCAB), 4, gradient_checkpointing=True)
    model = tiny_causal_lm_lora()
    trainable = sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)
    # Only the adapters get gradients and AdamW moments (the frozen base would be 30x more). The trainer's step
    # drops the gradients between steps (set_to_none), so at the step's peak (the start of the backward, the
    # activations all alive) the adapters' gradients are not even allocated yet.
    assert plain.breakdown["grads"] <= trainable and 2 * trainable <= plain.breakdown["optimizer"] < 3 * trainable
    assert ckpt.breakdown["activations"] < 0.7 * plain.breakdown["activations"]


def test_the_plan_of_cached_distillation_holds_no_teacher_and_qat_adds_the_fake_quantized_weights():
    from transformers import Qwen3Config

    from tpu_helpers.memory.hf_plan import hf_finetune_estimate, meta_model
    from tpu_helpers.models.qat import quantized_linears

    # Qwen3-0.6B's sizes, on the meta device; the teacher of the live run is the same model.
    cfg = Qwen3Config(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                      num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True)
    model = meta_model(cfg)
    kw = dict(method="distill", lora_r=8, precision="bf16", model=model, loss_chunk=0)  # the whole logits
    live = hf_finetune_estimate(cfg, 4, 1024, teacher_config=cfg, **kw)
    cached = hf_finetune_estimate(cfg, 4, 1024, teacher_topk=128, **kw)
    params, tokens = sum(p.numel() for p in model.parameters()), 4 * 1024
    # The teacher's bf16 weights and its logits' share of the logits term go; the top-128 tensors come in.
    assert live.peak_bytes - cached.peak_bytes == params * 2 + 12 * tokens * 151936 - 24 * tokens * 128
    linear = sum(m.weight.numel() for m in quantized_linears(model).values())
    int4 = hf_finetune_estimate(cfg, 4, 1024, teacher_topk=128, qat="int4", **kw)
    assert int4.peak_bytes - cached.peak_bytes == linear * 2  # a bf16 fake-quantized copy of each linear weight
    assert any("QAT int4" in n for n in int4.notes) and any("top-128" in n for n in cached.notes)
    # The chunked loss ("auto": 256 tokens of 151,936 per chunk) keeps one chunk's logits and top-k transients.
    chunked = hf_finetune_estimate(cfg, 4, 1024, teacher_topk=128, qat="int4", **{**kw, "loss_chunk": "auto"})
    assert int4.peak_bytes - chunked.peak_bytes == 12 * (tokens - 256) * 151936 + 16 * (tokens - 256) * 128
    assert any("256 tokens at a time" in n for n in chunked.notes)
