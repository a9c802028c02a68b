"""The traced estimate of Hugging Face models: LoRA (frozen base) and checkpointing through the model's own hook.
Dict batches with labels: the trainer's step takes the model's own loss."""

from tpu_helpers.memory.example_models import TINY_LM_VOCAB, lm_batch, tiny_causal_lm_lora
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
