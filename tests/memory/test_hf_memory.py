"""The traced estimate of Hugging Face models: LoRA (frozen base) and checkpointing through the model's own hook."""

from tpu_helpers.memory.example_models import TINY_LM_VOCAB, causal_lm_loss, lm_batch, tiny_causal_lm_lora
from tpu_helpers.memory.traced import traced_estimate


def test_traced_estimate_of_a_lora_model_counts_adapter_gradients_and_checkpointing():
    plain = traced_estimate(tiny_causal_lm_lora, lm_batch(64, TINY_LM_VOCAB), 4, loss_fn=causal_lm_loss)
    ckpt = traced_estimate(tiny_causal_lm_lora, lm_batch(64, TINY_LM_VOCAB), 4, loss_fn=causal_lm_loss,
                           gradient_checkpointing=True)
    model = tiny_causal_lm_lora()
    trainable = sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)
    # Only the adapters get gradients and AdamW moments (the frozen base would be 30x more).
    assert plain.breakdown["grads"] == trainable and plain.breakdown["optimizer"] >= 2 * trainable
    assert ckpt.breakdown["activations"] < 0.7 * plain.breakdown["activations"]
