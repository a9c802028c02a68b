"""Memory plan for GRPO on a Hugging Face causal LM, from its config alone: the generation and the optimizer step.

    est = grpo_estimate(config, prompts=8, num_generations=8, max_prompt_len=256, max_new_tokens=512,
                        method="lora", precision="bf16")
    rep = memory_report(lambda b: grpo_estimate(config, b, ...), batch_size=8, hardware="v6e")

Per chip, for B prompts x G samples: the policy as for fine-tuning (`hf_plan.hf_finetune_estimate`), a reference
(none under LoRA, a frozen bf16 copy under full fine-tuning with KL_BETA > 0), the KV cache and the decode step's
logits while generating, and the fine-tuning step's activations with the completion positions' logits only. The
peak is the larger of the generation and the optimizer step; the cache is freed before the step. The formula term
by term: docs/guides/memory.md.
"""

from __future__ import annotations

from typing import Any

import torch

from tpu_helpers.memory.hf_plan import (  # noqa: F401  (kv_cache_bytes re-exported)
    decode_temporaries,
    hf_finetune_estimate,
    kv_cache_bytes,
    meta_model,
)
from tpu_helpers.memory.report import MemoryEstimate
from tpu_helpers.models.lm_head import planned_chunk
from tpu_helpers.models.quant4 import QuantFormat


def grpo_estimate(config: Any, prompts: int, *, num_generations: int, max_prompt_len: int, max_new_tokens: int,
                  method: str = "lora", lora_r: int = 8,
                  lora_targets: list[str] | str = ("q_proj", "k_proj", "v_proj", "o_proj"), precision: str = "bf16",
                  gradient_checkpointing: bool = False, grad_accum: int = 1, kl_beta: float = 0.04,
                  model: torch.nn.Module | None = None, quantize_base: str | QuantFormat | None = None,
                  quantize_group_size: int = 64, loss_chunk: int | str = "auto") -> MemoryEstimate:
    """Per-chip peak bytes of GRPO with `prompts` prompts per chip (see the module docstring)."""
    model = model if model is not None else meta_model(config)
    rows = prompts * num_generations
    micro = max(1, rows // grad_accum)
    seq = max_prompt_len + max_new_tokens
    step = hf_finetune_estimate(config, micro, seq, method=method, lora_r=lora_r, lora_targets=lora_targets,
                                precision=precision, gradient_checkpointing=gradient_checkpointing,
                                grad_accum=grad_accum, model=model, quantize_base=quantize_base,
                                quantize_group_size=quantize_group_size, loss_chunk=0)
    params = sum(p.numel() for p in model.parameters())
    V, h, heads = config.vocab_size, config.hidden_size, config.num_attention_heads
    half = precision in ("bf16", "fp16")
    width = 2 if half else 4
    # hf_finetune_estimate (unchunked) counts 12 bytes of logits per token of every position; the step keeps N + 1
    # of them, or one chunk of them with the chunked loss (models.lm_head: the completion's N tokens per row).
    kept = planned_chunk(loss_chunk, micro * max_new_tokens, V) or micro * (max_new_tokens + 1)
    saved_logits = 12 * V * (micro * seq - kept)
    reference = params * 2 if method == "full" and kl_beta > 0 else 0
    cache = kv_cache_bytes(config, rows, seq, bytes_per_value=width)
    decode = decode_temporaries(config, rows, seq)
    prefill = prompts * max_prompt_len * (8 * h * width + heads * max_prompt_len * 4)  # once per group
    phases = {}
    for name, parts in step.phases.items():
        parts = dict(parts)
        parts["params"] += reference
        if name == "the start of the backward":
            parts["activations"] = max(0, parts["activations"] - saved_logits)
        phases[name] = parts
    held = step.phases["the start of the backward"]
    phases["the generation"] = {"params": held["params"] + reference, "optimizer": held["optimizer"], "grads": 0,
                                "activations": cache, "temporaries": max(decode, prefill)}
    notes = [f"{prompts} prompts x {num_generations} samples = {rows} rows of {max_prompt_len} + {max_new_tokens} "
             f"tokens per chip, {micro} rows per micro-batch",
             f"KV cache {cache / 2**20:,.0f} MiB; reference "
             + ("the adapter-disabled model (no copy)" if method != "full" else f"{reference / 2**20:,.0f} MiB"),
             *[n for n in step.notes if not n.startswith("peak: ")]]
    return MemoryEstimate.from_phases("plan", prompts, phases, notes=notes)
