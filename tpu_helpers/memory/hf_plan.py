"""Memory plan for fine-tuning a Hugging Face causal LM, from its config alone (built on the meta device).

    est = hf_finetune_estimate(config, batch_size=8, seq_len=512, method="lora", lora_r=8,
                               lora_targets=["q_proj", "v_proj"], precision="bf16")
    rep = memory_report(lambda b: hf_finetune_estimate(config, b, 512, ...), batch_size=8, hardware="v6e")
    plan = hf_sharding_plan(config, 8, 512, chips=8, method="full", hardware="v5e")  # data vs fsdp per chip
    print(plan.advice())  # "full fine-tuning of this 1.5B model needs fsdp over at least 2 chips ..."

Per chip, data parallel: weights, gradients, AdamW state, activations (Korthikanti et al. 2022's per-layer formula
plus the loss's logits, whole or one chunk's), a teacher or its top-k cache, a 4-bit base or QAT's fake-quantized
copies; the peak is the larger of the backward's start and end, as in the trainer's step. The formula term by term,
and how it compares with the traced and compiled figures: docs/guides/memory.md.
"""

from __future__ import annotations

from typing import Any

import torch

from tpu_helpers.backend.units import block_params
from tpu_helpers.config import ConfigError
from tpu_helpers.core.choices import FINETUNE_METHODS, QAT_SCHEMES, check_choice
from tpu_helpers.memory.per_chip import ShardingPlan, sharding_plan
from tpu_helpers.memory.report import MemoryEstimate
from tpu_helpers.models.lm_head import planned_chunk
from tpu_helpers.models.qat import quantized_linears
from tpu_helpers.models.quant4 import DEFAULT_GROUP_SIZE, QuantFormat, as_format, bytes_per_weight


def meta_model(config: Any) -> torch.nn.Module:
    """The model of a config with no memory behind it (parameters on the meta device)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def kv_cache_bytes(config: Any, rows: int, length: int, *, bytes_per_value: int = 2) -> int:
    """Keys and values of every layer for `rows` sequences of `length` slots."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 2 * config.num_hidden_layers * rows * length * kv_heads * head_dim * bytes_per_value


def decode_temporaries(config: Any, rows: int, length: int) -> int:
    """A decode step's float32 temporaries for `rows` sequences of `length` slots: its logits and their sampling
    (three vocabulary-wide rows) and one layer's attention scores."""
    return 3 * rows * config.vocab_size * 4 + 2 * rows * config.num_attention_heads * length * 4


def frozen_bytes(config: Any, precision: str, fmt: QuantFormat | None = None,
                 group_size: int = DEFAULT_GROUP_SIZE) -> int:
    """A frozen model's weights (a teacher): 2 bytes each, or with `fmt` its linear layers but the head in 4 bits
    (`models.quant4`, fp32 scales per `group_size`) and the rest in the compute dtype."""
    model = meta_model(config)
    params = sum(p.numel() for p in model.parameters())
    if fmt is None:
        return params * 2
    linear = sum(m.in_features * m.out_features for m in quantized_linears(model).values())
    compute = 2 if precision in ("bf16", "fp16") else 4
    return (params - linear) * compute + int(linear * bytes_per_weight(group_size))


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
                         quantize_group_size: int = DEFAULT_GROUP_SIZE,
                         teacher_quantize: str | QuantFormat | None = None,
                         teacher_group_size: int = DEFAULT_GROUP_SIZE, answer_tokens: int = 0) -> MemoryEstimate:
    """Per-chip peak bytes of one fine-tuning step (see the module docstring); `teacher_topk` > 0: distillation
    from a cache of that many tokens per position (no teacher in the step); `qat`: fake-quantized linear weights;
    `loss_chunk`: the chunked loss's setting (LOSS_CHUNK; 0: the whole batch's logits); `quantize_base`: a 4-bit
    frozen base (LoRA); `teacher_quantize`: a live teacher in 4 bits; `answer_tokens` > 0: on-policy distillation,
    the student answering a micro-batch's prompts with that many tokens (its KV cache and a decode step's
    temporaries, a phase of its own before the step)."""
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
        t_fmt = None if teacher_quantize is None else as_format(teacher_quantize)
        teacher = frozen_bytes(teacher_config, precision, t_fmt, teacher_group_size)
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
    phases = {
        "the start of the backward": {**held, "grads": kept, "activations": int(layers + logits + fake_quant)},
        "the end of the backward": {**held, "grads": grads, "activations": int(per_layer)}}
    if answer_tokens > 0:  # the student's answers, before the micro-batch's forward (their cache freed by then)
        cache = kv_cache_bytes(config, b, s, bytes_per_value=2 if half else 4)
        phases["the student's answers"] = {**held, "grads": kept, "activations": cache,
                                           "temporaries": max(dequantized, decode_temporaries(config, b, s))}
        notes.append(f"on-policy: the student answers {b} prompts with {answer_tokens} tokens, a KV cache of "
                     f"{cache / 2**20:,.0f} MiB")
    if teacher and teacher_quantize is not None:
        notes.append(f"teacher in 4 bits ({as_format(teacher_quantize).name}): {teacher / 2**20:,.0f} MiB")
    return MemoryEstimate.from_phases("plan", b, phases, notes=notes)


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
    (`tpu_helpers.memory.per_chip`), from the config alone; `estimate_kwargs` go to `hf_finetune_estimate`."""
    model = meta_model(config)
    return sharding_plan(
        lambda b: hf_finetune_estimate(config, b, seq_len, method=method, precision=precision, model=model,
                                       **estimate_kwargs),
        batch_size, chips=chips, hardware=hardware, block_params=block_params(model),
        params=sum(p.numel() for p in model.parameters()),
        bytes_per_param=gathered_bytes_per_param(method, precision), safety_margin=safety_margin,
        what=_WHAT.get(method, method))
