"""Analytic memory estimate for the package GPT (or any decoder given by its sizes): instant, no model built.

    from tpu_helpers.memory.analytic import analytic_estimate
    est = analytic_estimate("mini", batch_size=32, seq_len=256, precision="bf16", optimizer="adamw")
    est = analytic_estimate("mini", 32, 256, precision="bf16", pure_bf16=True)   # weights stored in bf16 too

Per chip, for one step of the trainer, with data parallelism (the figure does not depend on the number of chips):
weights, gradients, optimizer state, activations (Korthikanti et al. 2022's per-layer form, its coefficients fitted
to this model's traced step) and the largest gradient temporary, at the larger of the backward's start and end.
The formula and its table of coefficients: docs/guides/memory.md.
"""

from __future__ import annotations

import dataclasses

from tpu_helpers.core.choices import OPTIMIZERS, PRECISIONS, ConfigError, check_choice, check_positive
from tpu_helpers.memory.report import MemoryEstimate
from tpu_helpers.models.gpt import PRESETS, GPTConfig, gpt_config

# memory layout -> (alpha, alpha_ckpt, lam, c1, c2, c2_ckpt); see the module docstring.
_COEF = {
    "fp32": (64.0, 4.0, 12.0, 8.4, 20.3, 80.3),
    "bf16": (42.0, 4.0, 12.5, 6.4, 16.0, 50.3),
    "pure-bf16": (32.0, 2.0, 12.0, 4.2, 12.0, 40.3),
}
ATTENTION = ("flash", "math")


def memory_layout(precision: str, pure_bf16: bool = False) -> str:
    """How a step stores its tensors: "fp32", "bf16" (bf16 or fp16 autocast over fp32 weights) or "pure-bf16"
    (weights, gradients and optimizer state in bf16 too). `precision` is one of `choices.PRECISIONS`, resolved:
    "auto" depends on the device, so its caller passes what the backend (or the chip) resolves it to."""
    check_choice("precision", precision, PRECISIONS)
    if precision == "auto":
        raise ConfigError("precision='auto' depends on the device: pass what it resolves to there (backend.precision;"
                          " bf16 on TPUs)")
    if pure_bf16 and precision != "bf16":
        raise ConfigError(f"pure_bf16=True stores the weights in bf16 and needs precision='bf16', not {precision!r}")
    if precision == "fp32":
        return "fp32"
    return "pure-bf16" if pure_bf16 else "bf16"


def bytes_per_weight(precision: str, pure_bf16: bool = False) -> int:
    """Bytes of one stored parameter: 2 with pure_bf16, else 4 (fp32 master weights)."""
    return 2 if memory_layout(precision, pure_bf16) == "pure-bf16" else 4


def resolve_config(model: str | GPTConfig | dict, **overrides: object) -> GPTConfig:
    """A GPTConfig from a preset name, a GPTConfig, or a dict of sizes (validated by GPTConfig)."""
    if isinstance(model, str):
        return gpt_config(model, **overrides)
    if isinstance(model, GPTConfig):
        return dataclasses.replace(model, **overrides)  # type: ignore[arg-type]
    if isinstance(model, dict):
        return GPTConfig(**{**model, **overrides})
    raise TypeError(f"model must be a preset name ({sorted(PRESETS)}), a GPTConfig or a dict of sizes, "
                    f"got {type(model).__name__}")


def param_counts(cfg: GPTConfig) -> tuple[int, int, int]:
    """(all parameters, matmul weights, factored-state elements for an Adafactor-like optimizer)."""
    d, bias, V = cfg.n_embd, int(cfg.bias), cfg.vocab_size
    ln = d * (1 + bias)
    matmul = 12 * d * d
    per_layer = block_params(cfg)
    embed = V * d + cfg.block_size * d + (0 if cfg.tie_weights else V * d)
    total = cfg.n_layer * per_layer + ln + embed
    matmul_total = cfg.n_layer * matmul + V * d
    # rows + columns for each matrix (+1 step counter), the full size for vectors.
    mats = [(d, 3 * d), (d, d), (4 * d, d), (d, 4 * d)] * cfg.n_layer + [(V, d), (cfg.block_size, d)]
    if not cfg.tie_weights:
        mats.append((V, d))
    vectors = total - sum(r * c for r, c in mats)
    factored = sum(r + c + 1 for r, c in mats) + vectors
    return total, matmul_total, factored


def block_params(cfg: GPTConfig) -> int:
    """Parameters of one transformer Block (attention, MLP, two LayerNorms): the FSDP unit gathered at a time."""
    d, bias = cfg.n_embd, int(cfg.bias)
    return 2 * d * (1 + bias) + 12 * d * d + bias * (3 * d + d + 4 * d + d)


def analytic_estimate(
    model: str | GPTConfig | dict,
    batch_size: int,
    seq_len: int | None = None,
    *,
    precision: str = "fp32",
    pure_bf16: bool = False,
    optimizer: str = "adamw",
    gradient_checkpointing: bool = False,
    attention: str = "flash",
    grad_accum: int = 1,
) -> MemoryEstimate:
    """Per-chip peak bytes of one training step (see the module docstring for the formula).

    ``attention="math"`` adds the ``a*s^2*b`` attention probabilities that an unfused attention (XLA's default
    lowering of ``scaled_dot_product_attention``) keeps per layer. ``grad_accum`` > 1 keeps the gradients alive
    while each later micro-batch runs (each micro-batch's activations are freed by its backward).
    """
    cfg = resolve_config(model)
    check_positive("batch_size", batch_size)
    check_positive("grad_accum", grad_accum)
    s = cfg.block_size if seq_len is None else seq_len
    check_positive("seq_len", s)
    if s > cfg.block_size:
        raise ValueError(f"seq_len={s} exceeds the model's block_size={cfg.block_size}")
    layout = memory_layout(precision, pure_bf16)
    check_choice("optimizer", optimizer, OPTIMIZERS)
    check_choice("attention", attention, ATTENTION)
    b, h, a, L, V = batch_size, cfg.n_embd, cfg.n_head, cfg.n_layer, cfg.vocab_size
    w = bytes_per_weight(precision, pure_bf16)
    total, _, factored = param_counts(cfg)
    params = total * w
    grads = total * w
    opt_elems = {"adamw": 2 * total, "sgd": total, "adafactor": factored}[optimizer]
    opt = opt_elems * w
    alpha, alpha_ck, lam, c1, c2, c2_ck = _COEF[layout]
    sbh, sbV = s * b * h, s * b * V
    act_dtype = 4 if layout == "fp32" else 2
    per_layer = (alpha_ck * sbh) if gradient_checkpointing else (alpha * sbh + 4 * a * s * b)
    if attention == "math" and not gradient_checkpointing:
        per_layer += a * s * s * b * act_dtype
    transient_layer = c2_ck * sbh + (a * s * s * b * act_dtype if attention == "math" else 0)
    transient = max(lam * sbV + c1 * sbh, (transient_layer if gradient_checkpointing else c2 * sbh))
    activations = int(L * per_layer + transient)
    largest = max(V * h, 4 * h * h) * w
    # bf16 autocast also keeps bf16 copies of the matmul weights for the backward; alpha's calibration absorbed
    # them (adding 2 bytes per weight over-estimated by ~8%).
    temporaries = largest
    notes = [f"{L} layers x {h} wide, {a} heads, vocab {V}, {s} tokens x {b} sequences per chip",
             f"{total:,} parameters"]
    kept = grads if grad_accum > 1 else 0  # the earlier micro-batches' gradients, while the next one runs
    # The end of the backward: (nearly) every gradient formed, the first layer's activations and its backward (or
    # recomputation) transient still alive. The optimizer update after it holds less (no activations).
    tail = transient_layer if gradient_checkpointing else int(per_layer + c2 * sbh)
    held = {"params": params, "optimizer": opt, "temporaries": temporaries}
    return MemoryEstimate.from_phases("analytic", b, {
        "the start of the backward": {**held, "grads": kept, "activations": activations},
        "the end of the backward": {**held, "grads": grads, "activations": int(tail)}}, notes=notes)
