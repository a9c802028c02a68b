"""Memory plan for preference tuning (DPO, ORPO, SimPO, KTO) of a Hugging Face causal LM, from its config alone.

    est = preference_estimate(config, pairs=8, seq_len=512, method="lora", precision="bf16", reference=True)
    rep = memory_report(lambda b: preference_estimate(config, b, 512, ...), batch_size=8, hardware="v6e")

Per chip, for B pairs per step: the fine-tuning step's (`hf_plan.hf_finetune_estimate`) at 2B / GRAD_ACCUM rows
(chosen and rejected both go through the model; KTO's B completions with their mismatched rows are 2B rows too),
plus the reference: for DPO and KTO without PRECOMPUTE_REF the adapter-disabled model (LoRA) or a frozen bf16 copy
(full), whose logits peak in its forward; precomputed, two float32 numbers per pair; none for ORPO and SimPO. The
peak is the largest of the step's moments and the reference's forward.
The terms in full: docs/guides/memory.md.
"""

from __future__ import annotations

from typing import Any

import torch

from tpu_helpers.memory.hf_plan import hf_finetune_estimate, meta_model
from tpu_helpers.memory.report import MemoryEstimate
from tpu_helpers.models.lm_head import planned_chunk
from tpu_helpers.models.quant4 import DEFAULT_GROUP_SIZE


def preference_estimate(config: Any, pairs: int, seq_len: int, *, method: str = "lora", lora_r: int = 8,
                        lora_targets: list[str] | str = ("q_proj", "k_proj", "v_proj", "o_proj"),
                        precision: str = "bf16", gradient_checkpointing: bool = False, grad_accum: int = 1,
                        reference: bool = True, precomputed_pairs: int = 0, loss_chunk: int | str = "auto",
                        quantize_base: str | None = None, quantize_group_size: int = DEFAULT_GROUP_SIZE,
                        model: torch.nn.Module | None = None) -> MemoryEstimate:
    """Per-chip peak bytes of a preference step over `pairs` pairs per chip (see the module docstring);
    `reference`: DPO with a reference forward in the step; `precomputed_pairs`: the pairs whose reference
    log-probabilities are kept instead; `loss_chunk`: LOSS_CHUNK (the policy's and the reference's logits one chunk
    at a time; 0: the whole batch's); `quantize_base`: a 4-bit frozen base (QLoRA; the reference is that base
    with the adapter off, no copy)."""
    model = model if model is not None else meta_model(config)
    rows = max(1, 2 * pairs // grad_accum)
    step = hf_finetune_estimate(config, rows, seq_len, method=method, lora_r=lora_r, lora_targets=lora_targets,
                                precision=precision, gradient_checkpointing=gradient_checkpointing,
                                grad_accum=grad_accum, loss_chunk=loss_chunk, quantize_base=quantize_base,
                                quantize_group_size=quantize_group_size, model=model)
    params = sum(p.numel() for p in model.parameters())
    copy = params * 2 if reference and method == "full" else 0
    table = precomputed_pairs * 2 * 4
    phases = {}
    for name, parts in step.phases.items():
        phases[name] = {**parts, "params": parts["params"] + copy + table}
    if reference:
        held = step.phases["the start of the backward"]
        # Its logits in fp32 and their log-softmax (one chunk's when chunked); the earlier micro-batches' gradients
        # are held meanwhile.
        chunk = planned_chunk(loss_chunk, rows * seq_len, config.vocab_size) or rows * seq_len
        phases["the reference's forward"] = {"params": held["params"] + copy + table, "optimizer": held["optimizer"],
                                             "grads": held["grads"], "activations": 0,
                                             "temporaries": 8 * chunk * config.vocab_size}
    where = ("a frozen bf16 copy, " + f"{copy / 2**20:,.0f} MiB" if copy else "the adapter-disabled model (no copy)")
    notes = [f"{pairs} pairs = {2 * pairs} rows of {seq_len} tokens per chip, {rows} rows per micro-batch",
             f"reference: {where}, its forward in every step" if reference else
             (f"reference: precomputed, {table / 2**20:,.2f} MiB for {precomputed_pairs} pairs" if precomputed_pairs
              else "no reference (ORPO, SimPO)"),
             *[n for n in step.notes if not n.startswith("peak: ")]]
    return MemoryEstimate.from_phases("plan", pairs, phases, notes=notes)
