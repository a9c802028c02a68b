"""Memory plan for fine-tuning a Hugging Face causal LM, from its config alone (built on the meta device).

    est = hf_finetune_estimate(config, batch_size=8, seq_len=512, method="lora", lora_r=8,
                               lora_targets=["q_proj", "v_proj"], precision="bf16")
    rep = memory_report(lambda b: hf_finetune_estimate(config, b, 512, ...), batch_size=8, hardware="v6e")
    plan = hf_sharding_plan(config, 8, 512, chips=8, method="full", hardware="v5e")  # data vs fsdp per chip
    print(plan.advice())  # "full fine-tuning of this 1.5B model needs fsdp over at least 2 chips ..."

Per chip, data parallel (everything replicated), batch b, sequence s, L layers of width h, a heads, vocab V:

    weights      P * 2 bytes (bf16 base under LoRA/distill on TPU) or P * 4 (fp32 master weights, full)
    gradients    trainable parameters * 4 (LoRA: only the adapters)
    optimizer    AdamW: trainable * 8 (two fp32 moments)
    activations  L * s*b*h*(34 + 5*a*s/h) bytes (Korthikanti et al. 2022, 16-bit, unfused attention),
                 with checkpointing L * 2*s*b*h plus one layer recomputed; plus the logits: fp32 logits, their
                 log-softmax and gradient, 12 * s*b*V (x2 with a teacher for the teacher's logits); with the
                 chunked loss (`loss_chunk`, LOSS_CHUNK: "auto" by default, `models.lm_head`) those of one chunk
                 of c tokens, 12 * c*V (x2 with a live teacher, whose hidden states, 2 * s*b*h, stay whole)
    teacher      its weights in bf16 (distill)
    cached       distill from a teacher cache (`teacher_topk=k`): no teacher weights and no teacher logits; the
                 batch's top-k instead, 24 * s*b*k (int32 ids and their int64 copy, fp32 log-probabilities, their
                 exp and the student's gathered log-probabilities); chunked, the batch's 8 * s*b*k and one
                 chunk's 16 * c*k
    4-bit base   (`quantize_base="nf4"`/"int4", QLoRA) the quantized linear weights (all but the head) at 0.5 byte
                 each plus an fp32 scale per `quantize_group_size` of them (`models.quant4`), the rest of the base as
                 above; and, as a temporary, the largest layer's weight dequantized (fp32, then the compute dtype):
                 the forward and the backward dequantize one layer at a time and keep only the codes
    QAT          (`qat="int4"`/"int8") the fake-quantized copy of every quantized linear weight, in the weights'
                 dtype, which the matmul keeps for the backward: all of them at the start of the backward (one
                 layer's with checkpointing, the rest are recomputed); scales (1/group of that) are left out

As for the trainer's step (`Trainer.train_step`, which drops the gradients between steps): the peak is the larger of
the start of the backward (every activation; gradients only those kept by `grad_accum` > 1) and its end (every
gradient, one layer's activations), weights, optimizer state and teacher at both.

The per-layer factor is the paper's; the eager attention XLA compiles keeps the a*s^2 scores, which the 5*a*s/h
term covers. benchmarks/finetune_memory.py compares this plan with the traced figure (the trainer's step on fake
tensors) and XLA's compiled one:
- Qwen2.5-0.5B sizes with 4 layers, bf16, batch 8 x 512: plan/traced 0.96 (LoRA) and 0.90 (full) without
  checkpointing, 1.03 and 0.99 with; the peak is at the start of the backward in all four. Without checkpointing the
  plan under-counts a Qwen2 layer: the paper's 34*s*b*h is for a 4h GELU MLP, Qwen2's SwiGLU MLP is 5.4h wide and
  saves gate, up and their product, and HF attention keeps its softmax in fp32. With checkpointing the logits term
  (12*s*b*V, about 7 GiB here) dominates and matches.
- tiny model, fp32, batch 8 x 128: plan 1.09-1.36x traced (at fp32 the 16-bit factors are doubled; under LoRA a
  frozen linear needs no saved input, which the plan does not subtract); XLA's compiled figure is 0.9-1.1x traced,
  and 2.1x with checkpointing for the full model (XLA:CPU's scheduling of the recomputed blocks).
- Qwen3-0.6B sizes, int4 QAT, LoRA r=16 on every linear, top-128 cache, batch 4 and 8 x 1024
  (benchmarks/chunked_loss.py --plan): plan/compiled 0.93-0.96 at fp32 (XLA:CPU, 1 and 2 layers extrapolated to
  28), whole logits and chunked. At fp32 the layer's total agrees by compensation: a Qwen3 layer keeps ~39 values
  per token and width unit (the paper counts 17) and one fp32 a*s^2*b softmax (the plan counts 5 bytes per score
  in 16-bit), which cancel near 1,024 tokens. The bf16 step on XLA:CPU is no yardstick (it keeps its activations
  in f32, memory/compiled.py); the guide measured 22-28 GB for this job at batch 4 on a v6e-1, the plan 23.1 GB.
"""

from __future__ import annotations

from typing import Any

import torch

from tpu_helpers.backend.units import block_params
from tpu_helpers.choices import FINETUNE_METHODS, QAT_SCHEMES, check_choice
from tpu_helpers.config import ConfigError
from tpu_helpers.memory.report import MemoryEstimate
from tpu_helpers.memory.sharded import ShardingPlan, sharding_plan
from tpu_helpers.models.lm_head import planned_chunk
from tpu_helpers.models.qat import quantized_linears
from tpu_helpers.models.quant4 import DEFAULT_GROUP_SIZE, QuantFormat, as_format, bytes_per_weight


def meta_model(config: Any) -> torch.nn.Module:
    """The model of a config with no memory behind it (parameters on the meta device)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def lora_parameter_count(model: torch.nn.Module, r: int, targets: list[str] | str) -> int:
    total = 0
    for name, mod in model.named_modules():
        if not isinstance(mod, torch.nn.Linear) or not name:
            continue
        short = name.rsplit(".", 1)[-1]
        if (targets == "all-linear" and short != "lm_head") or (targets != "all-linear" and short in targets):
            total += r * (mod.in_features + mod.out_features)
    return total


def hf_finetune_estimate(config: Any, batch_size: int, seq_len: int, *, method: str = "lora", lora_r: int = 8,
                         lora_targets: list[str] | str = ("q_proj", "k_proj", "v_proj", "o_proj"),
                         precision: str = "bf16", gradient_checkpointing: bool = False, grad_accum: int = 1,
                         teacher_config: Any = None, model: torch.nn.Module | None = None,
                         teacher_topk: int = 0, qat: str | None = None, loss_chunk: int | str = "auto",
                         quantize_base: str | QuantFormat | None = None,
                         quantize_group_size: int = DEFAULT_GROUP_SIZE) -> MemoryEstimate:
    """Per-chip peak bytes of one fine-tuning step (see the module docstring); `teacher_topk` > 0: distillation
    from a cache of that many tokens per position (no teacher in the step); `qat`: fake-quantized linear weights;
    `loss_chunk`: the chunked loss's setting (LOSS_CHUNK; 0: the whole batch's logits); `quantize_base`: a 4-bit
    frozen base (LoRA)."""
    check_choice("method", method, FINETUNE_METHODS)
    if qat is not None:
        check_choice("qat", qat, QAT_SCHEMES)
    model = model if model is not None else meta_model(config)
    params = sum(p.numel() for p in model.parameters())
    lora = method in ("lora", "distill")
    trainable = lora_parameter_count(model, lora_r, list(lora_targets) if not isinstance(lora_targets, str)
                                     else lora_targets) if lora else params
    half = precision in ("bf16", "fp16")  # 16-bit autocast (fp16 keeps the bytes of bf16)
    weights = params * gathered_bytes_per_param(method, precision) + (trainable * 4 if lora else 0)
    fmt = None if quantize_base is None else as_format(quantize_base)
    weights, dequantized = _four_bit_base(model, weights, method, precision, fmt, quantize_group_size)
    grads = trainable * 4
    optimizer = trainable * 8
    b, s = batch_size, seq_len
    h, a, L = config.hidden_size, config.num_attention_heads, config.num_hidden_layers
    V = config.vocab_size
    act_bytes = 1.0 if half else 2.0  # the paper's factors are for 16-bit activations
    per_layer = s * b * h * (34 + 5 * a * s / h) * act_bytes
    if gradient_checkpointing:
        layers = L * 2 * s * b * h * act_bytes + per_layer
    else:
        layers = L * per_layer
    cached = method == "distill" and teacher_topk > 0
    live = method == "distill" and not cached
    chunk = planned_chunk(loss_chunk, s * b, V)
    if chunk:
        logits = 12 * chunk * V * (2 if live else 1) + (8 * s * b * teacher_topk + 16 * chunk * teacher_topk if cached
                                                        else 0) + (2 * s * b * h if live else 0)
    else:
        logits = 12 * s * b * V * (2 if live else 1) + (24 * s * b * teacher_topk if cached else 0)
    teacher = 0
    if method == "distill" and teacher_config is not None and not cached:
        teacher = sum(p.numel() for p in meta_model(teacher_config).parameters()) * 2
    notes = [f"{L} layers x {h} wide, {a} heads, vocab {V}, {s} tokens x {b} sequences per chip",
             f"{params:,} parameters, {trainable:,} trainable ({method})"]
    fake_quant = 0
    if qat is not None:
        lin = sum(m.weight.numel() for m in quantized_linears(model).values())
        fake_quant = lin * gathered_bytes_per_param("full" if not lora else method, precision)
        if gradient_checkpointing:
            fake_quant //= L
        notes.append(f"QAT {qat}: {lin:,} linear weights fake-quantized")
    if chunk:
        notes.append(f"chunked loss: the logits of {chunk} tokens at a time (LOSS_CHUNK={loss_chunk!r})")
    if fmt is not None:
        notes.append(f"4-bit base ({fmt.name}, group {quantize_group_size}): "
                     f"{bytes_per_weight(quantize_group_size):g} bytes per quantized linear weight")
    if cached:
        notes.append(f"teacher from a cache: top-{teacher_topk} per position, no teacher in the step")
    kept = grads if grad_accum > 1 else 0  # the earlier micro-batches' gradients, while the next one runs
    held = {"params": weights + teacher, "optimizer": optimizer, "temporaries": dequantized}
    return MemoryEstimate.from_phases("plan", b, {
        "the start of the backward": {**held, "grads": kept, "activations": int(layers + logits + fake_quant)},
        "the end of the backward": {**held, "grads": grads, "activations": int(per_layer)}}, notes=notes)


def _four_bit_base(model: torch.nn.Module, weights: int, method: str, precision: str, fmt: QuantFormat | None,
                   group_size: int) -> tuple[int, int]:
    """(the weights' bytes with the quantized linears at 4 bits, the one dequantized weight alive at a time)."""
    if fmt is None:
        return weights, 0
    if method != "lora":
        raise ConfigError(f"quantize_base={fmt.name!r} is a frozen 4-bit base under LoRA; method={method!r}")
    sizes = [m.in_features * m.out_features for m in quantized_linears(model).values()]
    stored = sum(sizes) * gathered_bytes_per_param(method, precision)
    compute = 2 if precision in ("bf16", "fp16") else 4
    return weights - stored + int(sum(sizes) * bytes_per_weight(group_size)), max(sizes, default=0) * (4 + compute)


_WHAT = {"lora": "LoRA fine-tuning", "full": "full fine-tuning", "distill": "distillation"}


def gathered_bytes_per_param(method: str, precision: str = "bf16") -> int:
    """Bytes per stored parameter (and of a gathered block): the bf16 frozen base under LoRA where the step
    computes in bf16 (TPUs; `recipes.finetune` loads it so), else fp32 master weights (fp16 keeps them too)."""
    return 2 if (precision == "bf16" and method in ("lora", "distill")) else 4


def hf_sharding_plan(config: Any, batch_size: int, seq_len: int, *, chips: int, hardware: Any = "v5e",
                     method: str = "lora", precision: str = "bf16", safety_margin: float = 0.1,
                     **estimate_kwargs: Any) -> ShardingPlan:
    """Per-chip memory of one fine-tuning step under data parallel and FSDP over 2, 4, ... `chips`
    (`tpu_helpers.memory.sharded`), from the config alone; `estimate_kwargs` go to `hf_finetune_estimate`."""
    model = meta_model(config)
    return sharding_plan(
        lambda b: hf_finetune_estimate(config, b, seq_len, method=method, precision=precision, model=model,
                                       **estimate_kwargs),
        batch_size, chips=chips, hardware=hardware, block_params=block_params(model),
        params=sum(p.numel() for p in model.parameters()),
        bytes_per_param=gathered_bytes_per_param(method, precision), safety_margin=safety_margin,
        what=_WHAT.get(method, method))
