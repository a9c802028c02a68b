"""Example models for the estimates, the benchmark and the tests: a small CNN (not a transformer) and the offline
tiny Qwen2 of the fine-tuning path, with their batch factories.

    from tests.example_models import SmallCNN, cnn_batch
    est = traced_estimate(SmallCNN, cnn_batch, batch_size=32, loss_fn=torch.nn.functional.cross_entropy)
    est = traced_estimate(tiny_causal_lm_lora, lm_batch(64, TINY_LM_VOCAB), 4)   # dict batches: the model's loss
    est = traced_estimate(tiny_causal_lm_qlora, lm_batch(64, TINY_LM_VOCAB), 4)  # a 4-bit base (QLoRA)
"""

from __future__ import annotations

import torch
import torch.nn as nn


class SmallCNN(nn.Module):
    """Conv-BN-ReLU stages with pooling and a linear classifier over 32x32 RGB images (CIFAR-sized)."""

    def __init__(self, width: int = 32, classes: int = 10) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        c_in = 3
        for c_out in (width, 2 * width, 4 * width):
            layers += [nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU(),
                       nn.MaxPool2d(2)]
            c_in = c_out
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(c_in * 4 * 4, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


def cnn_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random images and labels for :class:`SmallCNN`."""
    return torch.randn(batch_size, 3, 32, 32), torch.randint(0, 10, (batch_size,))


# The offline tiny Qwen2 of the fine-tuning path (models/hf_tiny.py), built from its config alone (no tokenizer,
# nothing on disk), with a fixed-length token batch: what the compiled estimate and benchmarks/finetune_memory.py
# measure for a Hugging Face model.
TINY_LM_SEQ = 128
TINY_LM_VOCAB = 512


def tiny_causal_lm(attn_implementation: str = "eager") -> nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tpu_helpers.models.hf_tiny import TINY_ARCH

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=TINY_LM_VOCAB, use_cache=False, attn_implementation=attn_implementation,
                         **TINY_ARCH)
    return Qwen2ForCausalLM(config)


def tiny_causal_lm_sdpa() -> nn.Module:
    return tiny_causal_lm("sdpa")


def tiny_lm_batch(batch_size: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, TINY_LM_VOCAB, (batch_size, TINY_LM_SEQ), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def tiny_causal_lm_lora() -> nn.Module:
    """The tiny model with peft LoRA adapters (r=8) on q/k/v/o: only the adapters train."""
    from tpu_helpers.models.lora import add_lora

    return add_lora(tiny_causal_lm(), r=8, targets="q_proj,k_proj,v_proj,o_proj")


def lm_batch(seq_len: int, vocab_size: int):
    """Batch factory (plain tensor factories, so it also runs under the traced estimate's fake mode)."""

    def make(batch_size: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, vocab_size, (batch_size, seq_len))
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}

    return make


# A Qwen2 of the tiny model's depth with a wide vocabulary (8192 tokens, 64 wide): the logits dominate its step, as
# in a real Qwen (151,936 tokens), so the chunked loss (`models.lm_head`) shows in every estimate.
WIDE_VOCAB = 8192


def wide_vocab_lm_lora(chunk: int | str = 0) -> nn.Module:
    """LoRA (r=8, q/k/v/o) on a tiny wide-vocabulary Qwen2, its loss computed as the trainer does (`chunk`: the
    chunked loss's tokens per chunk, 0 for the whole logits)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tpu_helpers.models.lm_head import LossOfBatch
    from tpu_helpers.models.lora import add_lora

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=WIDE_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, use_cache=False, attn_implementation="eager",
                         tie_word_embeddings=True)
    return LossOfBatch(add_lora(Qwen2ForCausalLM(config), r=8, targets="q_proj,k_proj,v_proj,o_proj"), chunk)


def wide_vocab_lm_lora_chunked() -> nn.Module:
    return wide_vocab_lm_lora(64)


def wide_vocab_batch(batch_size: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, WIDE_VOCAB, (batch_size, TINY_LM_SEQ))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def tiny_causal_lm_qlora() -> nn.Module:
    """The tiny model with its linear layers (but the head) in NF4 (group 32, `models.quant4`) and LoRA (r=8) on
    q/k/v/o: QLoRA."""
    from tpu_helpers.models.lora import add_lora
    from tpu_helpers.models.quant4 import quantize_model

    return add_lora(quantize_model(tiny_causal_lm(), "nf4", 32), r=8, targets="q_proj,k_proj,v_proj,o_proj")
