"""Quantization-aware training (QAT): fake-quantized linear weights in the forward pass, through torchao.

    model = add_fake_quant(model, "int4", group_size=32)   # before add_lora: recovery LoRA on a fake-quantized base
    fq = fake_quantized_state(model)                       # the weights the forward used (for a merged bf16 export)
    export_quantized(model, tokenizer, "out/quantized", "int4", 32)   # int weights + scales, transformers loads it

Every linear layer but the output head becomes torchao's `FakeQuantizedLinear`: its weight is quantized and
dequantized again in the forward (symmetric, per group of `group_size` input columns), with straight-through
gradients, so full QAT trains the weights for their quantized values and recovery LoRA trains adapters on the
quantized base. Parameter names do not change. `export_quantized` writes int weights with their scales that
`AutoModelForCausalLM.from_pretrained` loads. The scheme, torchao on XLA and its pin: docs/guides/models.md.
"""

from __future__ import annotations

import math
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from tpu_helpers.backend.units import plain_name
from tpu_helpers.config import ConfigError
from tpu_helpers.core.choices import QAT_SCHEMES, check_choice

BITS = {"int4": 4, "int8": 8}


def _torchao() -> Any:
    try:
        import torchao.quantization as ao
    except ImportError:
        raise ConfigError("QAT needs torchao: pip install torchao==0.16.0 (pure Python, no other torch)") from None
    return ao


def base_config(scheme: str, group_size: int) -> Any:
    """torchao's post-training config QAT prepares for and converts to: int4/int8 weights, per group, symmetric."""
    check_choice("QAT", scheme, QAT_SCHEMES)
    ao = _torchao()
    from torchao.quantization.granularity import PerGroup

    dtype = torch.int4 if scheme == "int4" else torch.int8
    return ao.IntxWeightOnlyConfig(weight_dtype=dtype, granularity=PerGroup(group_size))


def quantized_linears(model: torch.nn.Module) -> dict[str, torch.nn.Linear]:
    """The linear layers QAT quantizes: every nn.Linear but the output head (and LoRA's own adapters)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return {name: mod for name, mod in model.named_modules()
            if isinstance(mod, torch.nn.Linear) and mod is not head and "lora_" not in name and name}


def check_group_size(model: torch.nn.Module, group_size: int) -> None:
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 2:
        raise ConfigError(f"QAT_GROUP_SIZE={group_size!r} must be an integer >= 2")
    linears = quantized_linears(model)
    bad = sorted({(name.rsplit(".", 1)[-1], m.in_features) for name, m in linears.items() if m.in_features % group_size})
    if bad:
        common = math.gcd(*{m.in_features for m in linears.values()})
        fits = [d for d in range(2, common + 1) if common % d == 0 and d <= group_size] or [common]
        raise ConfigError(f"QAT_GROUP_SIZE={group_size} does not divide the input width of "
                          f"{', '.join(f'{n} ({w})' for n, w in bad)}; use a divisor of {common}, the widths' greatest "
                          f"common divisor (e.g. {fits[-1]})")


def add_fake_quant(model: torch.nn.Module, scheme: str, group_size: int = 32) -> torch.nn.Module:
    """Fake-quantize the model's linear weights in place (torchao's QAT prepare step); returns the model."""
    check_choice("QAT", scheme, QAT_SCHEMES)
    check_group_size(model, group_size)
    ao = _torchao()
    from torchao.quantization.qat import QATConfig

    chosen = set(map(id, quantized_linears(model).values()))
    ao.quantize_(model, QATConfig(base_config(scheme, group_size), step="prepare"),
                 filter_fn=lambda mod, fqn: id(mod) in chosen)
    return model


def is_fake_quantized(model: torch.nn.Module) -> bool:
    return any(type(m).__name__ == "FakeQuantizedLinear" for m in model.modules())


def _plain(name: str) -> str:
    """The original model's name of a parameter of a (peft-wrapped, FSDP-wrapped) model."""
    name = plain_name(name)
    for prefix in ("base_model.model.",):
        name = name.removeprefix(prefix)
    return name.replace(".base_layer.", ".").replace(".base_layer", "")


def base_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The base model's weights (LoRA adapters left out) on the CPU under the original model's names, raw."""
    return {_plain(k): v.detach().cpu() for k, v in model.state_dict().items() if "lora_" not in k}


def fake_quantized_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """`base_state` with each quantized linear weight replaced by its fake-quantized value (by the layer's own
    fake quantizer, on the CPU): a plain model with these weights computes what the QAT model's base computed."""
    quantizers = {_plain(n) + ".weight": m.weight_fake_quantizer for n, m in model.named_modules()
                  if type(m).__name__ == "FakeQuantizedLinear"}
    with torch.no_grad():
        return {k: quantizers[k](v) if k in quantizers else v for k, v in base_state(model).items()}


def export_quantized(model: torch.nn.Module, tokenizer: Any, out_dir: str | Path, scheme: str, group_size: int,
                     *, state: dict[str, torch.Tensor] | None = None) -> Path:
    """The base model's weights quantized (int values + scales, torchao's safetensors form) into `out_dir`,
    atomically (a temporary directory renamed); `AutoModelForCausalLM.from_pretrained(out_dir)` loads it."""
    from transformers import AutoModelForCausalLM, TorchAoConfig

    from tpu_helpers.models.lora import atomic_dir

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    state = base_state(model) if state is None else state
    head = [_plain(n) for n, m in base.named_modules() if m is base.get_output_embeddings()]
    dtype = next(iter(state.values())).dtype if state else torch.float32

    def write(tmp: Path) -> None:
        raw = Path(tempfile.mkdtemp(dir=tmp.parent))
        try:
            plain = AutoModelForCausalLM.from_config(base.config, dtype=dtype)
            plain.load_state_dict(state)
            plain.tie_weights()
            plain.save_pretrained(raw, safe_serialization=True)
            quant = TorchAoConfig(quant_type=base_config(scheme, group_size), modules_to_not_convert=head)
            q = AutoModelForCausalLM.from_pretrained(raw, dtype=dtype, quantization_config=quant)
        finally:
            shutil.rmtree(raw, ignore_errors=True)
        q.save_pretrained(tmp, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)

    return atomic_dir(out_dir, write)
