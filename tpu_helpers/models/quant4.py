"""QLoRA's frozen 4-bit base: linear weights stored in 4 bits (two codes per byte) with a scale per group of input
columns, dequantized in the forward pass; LoRA (peft) trains on top.

    model = load_quantized_lm(source, "nf4", group_size=64, dtype=torch.bfloat16)  # quantized as the shards stream in
    model = lora.add_lora(model, r=8)               # peft LoRA on the Linear4bit layers (merge/unmerge work too)
    state = dequantized_state(model)                # the base as the forward computes it (a merged bf16 export)

Formats (`FORMATS`): "nf4" (QLoRA's NormalFloat table, codes and scales equal to torchao's `to_nf4`) and "int4"
(symmetric, the scheme QAT trains for), with an fp32 scale per `group_size` input columns: 0.5625 bytes per weight
at group 64. The output head, embeddings and norms stay as loaded. `load_quantized_lm` quantizes each linear weight
as the safetensors shards stream in, so the full-precision model never sits whole in host memory. The formats,
the forward and backward, and why not torchao's `NF4Tensor`: docs/guides/models.md.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from tpu_helpers.backend.units import plain_name
from tpu_helpers.config import ConfigError
from tpu_helpers.core.choices import choose

DEFAULT_GROUP_SIZE = 64

# The NormalFloat-4 table as torchao's NF4Tensor holds it (4 decimals of the paper's values, which bitsandbytes
# keeps to float32 precision; they differ by < 5e-5).
NF4_TABLE = (-1.0, -0.6962, -0.5251, -0.3949, -0.2844, -0.1848, -0.0911, 0.0,
             0.0796, 0.1609, 0.2461, 0.3379, 0.4407, 0.5626, 0.7230, 1.0)
INT4_TABLE = tuple(float(q) for q in range(-8, 8))  # code c means q = c - 8
_CHUNK = 1 << 20  # elements quantized at a time: the nearest-entry search holds 16 floats per element


def _nearest_codes(w: torch.Tensor, absmax: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """nf4: each weight / its group's absmax as the nearest table entry (torchao's search, in chunks of 16 floats
    per element); the scale is the absmax."""
    table = torch.tensor(NF4_TABLE, dtype=w.dtype, device=w.device)
    normed = (w / absmax).reshape(-1)
    for start in range(0, normed.numel(), _CHUNK):
        part = normed[start:start + _CHUNK]
        codes[start:start + part.numel()] = (part.unsqueeze(-1) - table).abs().min(-1).indices.to(torch.uint8)
    return absmax


def _rounded_codes(w: torch.Tensor, absmax: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """int4: symmetric, q = round(w / scale) in [-8, 7] with scale = absmax / 7.5, stored as the code q + 8."""
    scales = (absmax / 7.5).clamp(min=torch.finfo(w.dtype).eps)
    q = torch.clamp(torch.round(w * (1.0 / scales)), -8, 7)
    codes.copy_((q + 8).reshape(-1).to(torch.uint8))
    return scales


class QuantFormat(NamedTuple):
    """A QUANTIZE_BASE format: its name, the 16 values its codes stand for (times a group's scale), and how a
    group's weights become codes (`encode(grouped weights, group absmax, flat uint8 codes out) -> scales`)."""

    name: str
    table: tuple[float, ...]
    encode: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


FORMATS: dict[str, QuantFormat] = {"nf4": QuantFormat("nf4", NF4_TABLE, _nearest_codes),
                                   "int4": QuantFormat("int4", INT4_TABLE, _rounded_codes)}


def as_format(fmt: str | QuantFormat) -> QuantFormat:
    """A QUANTIZE_BASE value as its format: a name is looked up once (a ConfigError naming it and the formats),
    a format passes as it is."""
    return fmt if isinstance(fmt, QuantFormat) else choose("quantize_base", fmt, FORMATS)


def code_table(fmt: QuantFormat, dtype: torch.dtype = torch.float32, device: Any = None) -> torch.Tensor:
    return torch.tensor(fmt.table, dtype=dtype, device=device)


def bytes_per_weight(group_size: int = DEFAULT_GROUP_SIZE) -> float:
    """Stored bytes per quantized weight: half a byte of code plus its share of an fp32 scale."""
    return 0.5 + 4 / group_size


# ---- the numerics ----------------------------------------------------------------------------------------------
def quantize(weight: torch.Tensor, fmt: QuantFormat,
             group_size: int = DEFAULT_GROUP_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed codes, uint8 [out, in/2]: column 2j in the high nibble, 2j+1 in the low one, as torchao packs;
    scales, fp32 [out, in/group_size]) of a 2-D weight, computed in the weight's own dtype (as torchao does)."""
    out, width = weight.shape
    if width % group_size or group_size % 2:
        raise ConfigError(f"group_size={group_size} must be even and divide the input width {width}")
    w = weight.detach().reshape(out, width // group_size, group_size)
    absmax = w.abs().amax(-1, keepdim=True)
    flat_codes = torch.empty(out * width, dtype=torch.uint8, device=weight.device)
    scales = fmt.encode(w, absmax, flat_codes)
    packed = flat_codes[::2] << 4 | flat_codes[1::2]
    return packed.reshape(out, width // 2), scales.reshape(out, width // group_size).float()


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """The 4-bit codes (int64, [out, in]) of packed bytes ([out, in/2]): a shift and a mask (XLA lowers both)."""
    pairs = torch.stack([torch.bitwise_right_shift(packed, 4), torch.bitwise_and(packed, 15)], dim=-1)
    return pairs.reshape(packed.shape[0], -1).long()


def dequantize(packed: torch.Tensor, scales: torch.Tensor, table: torch.Tensor,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight [out, in] the codes stand for: table[code] * scale, in fp32, then cast to `dtype`."""
    out, groups = scales.shape
    values = table.float()[unpack_codes(packed)]
    return (values.reshape(out, groups, -1) * scales.unsqueeze(-1)).reshape(out, -1).to(dtype)


class _Linear4bitFn(torch.autograd.Function):
    """x @ dequantize(codes).T + bias, keeping only the codes for the backward (the input's gradient)."""

    @staticmethod
    def forward(ctx, x, packed, scales, table, bias, dtype):
        ctx.save_for_backward(packed, scales, table)
        return F.linear(x, dequantize(packed, scales, table, dtype), bias)

    @staticmethod
    def backward(ctx, grad):
        packed, scales, table = ctx.saved_tensors
        grad_x = grad @ dequantize(packed, scales, table, grad.dtype) if ctx.needs_input_grad[0] else None
        return grad_x, None, None, None, None, None


class Linear4bit(torch.nn.Linear):
    """A frozen linear layer stored in 4 bits (see the module docstring). An `nn.Linear` to the code that looks for
    linear layers (LoRA targets, "all-linear", the planners); `weight` is the packed codes (uint8 [out, in/2]) and
    `weight_scale` the fp32 scales, both frozen parameters (so moves, fingerprints and memory counts see them);
    `compute_dtype` is the dtype the weight is dequantized to (peft reads it for the adapters' dtype)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 fmt: QuantFormat = FORMATS["nf4"], group_size: int = DEFAULT_GROUP_SIZE, compute_dtype: torch.dtype = torch.float32,
                 device: Any = None) -> None:
        torch.nn.Module.__init__(self)  # not nn.Linear's: no float weight is ever made
        self.in_features, self.out_features = in_features, out_features
        self.fmt, self.group_size, self.compute_dtype = fmt, group_size, compute_dtype
        frozen = dict(requires_grad=False)
        self.weight = torch.nn.Parameter(torch.empty(out_features, in_features // 2, dtype=torch.uint8,
                                                     device=device), **frozen)
        self.weight_scale = torch.nn.Parameter(torch.empty(out_features, in_features // group_size, device=device),
                                               **frozen)
        self.bias = torch.nn.Parameter(torch.empty(out_features, dtype=compute_dtype, device=device), **frozen) \
            if bias else None
        # Not in the state dict (a format's constant); a buffer so it moves with the model (no per-step upload).
        self.register_buffer("code_table", code_table(fmt, device=device if device != "meta" else "cpu"),
                             persistent=False)

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, fmt: QuantFormat, group_size: int = DEFAULT_GROUP_SIZE,
                    compute_dtype: torch.dtype | None = None) -> Linear4bit:
        """A quantized copy of a loaded `nn.Linear` (its bias kept in the compute dtype)."""
        dtype = compute_dtype or linear.weight.dtype
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, fmt=fmt, group_size=group_size,
                    compute_dtype=dtype, device=linear.weight.device)
        layer.set_weight(linear.weight)
        if linear.bias is not None:
            layer.bias = torch.nn.Parameter(linear.bias.detach().to(dtype), requires_grad=False)
        return layer

    @torch.no_grad()
    def set_weight(self, weight: torch.Tensor) -> None:
        """Quantize a full-precision weight [out, in] into this layer."""
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ConfigError(f"a weight of shape {tuple(weight.shape)} for a {self.out_features} x "
                              f"{self.in_features} linear layer")
        packed, scales = quantize(weight, self.fmt, self.group_size)
        self.weight = torch.nn.Parameter(packed, requires_grad=False)
        self.weight_scale = torch.nn.Parameter(scales, requires_grad=False)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return dequantize(self.weight, self.weight_scale, self.code_table, dtype or self.compute_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Linear4bitFn.apply(x, self.weight, self.weight_scale, self.code_table, self.bias, self.compute_dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"{self.fmt.name}, group_size={self.group_size}, compute_dtype={self.compute_dtype}")


def is_quantized(model: torch.nn.Module) -> bool:
    return any(isinstance(m, Linear4bit) for m in model.modules())


def quantized_linears(model: torch.nn.Module) -> dict[str, torch.nn.Linear]:
    """The linear layers a 4-bit base quantizes: every nn.Linear but the output head (and LoRA's own), as QAT's
    (models/qat.py, which imports LoRA: this module must not import it back)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return {name: mod for name, mod in model.named_modules()
            if isinstance(mod, torch.nn.Linear) and mod is not head and "lora_" not in name and name}


def _plain(name: str) -> str:
    """The original model's name of a parameter of a (peft-wrapped, FSDP-wrapped) model."""
    name = plain_name(name).removeprefix("base_model.model.")
    return name.replace(".base_layer.", ".").replace(".base_layer", "")


def check_group_size(linears: dict[str, torch.nn.Linear], group_size: int) -> None:
    """Every quantized layer's input width must be a multiple of the (even) group size; the error names them."""
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 2 or group_size % 2:
        raise ConfigError(f"QUANTIZE_GROUP_SIZE={group_size!r} must be an even integer >= 2 (e.g. 32, 64, 128)")
    bad: dict[int, list[str]] = {}
    for name, m in linears.items():
        short = name.rsplit(".", 1)[-1]
        if m.in_features % group_size and short not in bad.setdefault(m.in_features, []):
            bad[m.in_features].append(short)
    bad = {w: names for w, names in bad.items() if names}
    if bad:
        common = math.gcd(*{m.in_features for m in linears.values()})
        fits = [d for d in range(2, min(common, group_size) + 1, 2) if common % d == 0]
        hint = f" (e.g. {fits[-1]})" if fits else ""
        raise ConfigError(f"QUANTIZE_GROUP_SIZE={group_size} does not divide the input width of "
                          f"{'; '.join(', '.join(names) + f' ({w})' for w, names in sorted(bad.items()))}; use an "
                          f"even divisor of {common}, the widths' greatest common divisor{hint}")


def quantize_model(model: torch.nn.Module, fmt: str | QuantFormat, group_size: int = DEFAULT_GROUP_SIZE,
                   compute_dtype: torch.dtype | None = None) -> torch.nn.Module:
    """Replace the loaded model's linear layers (but the head) by `Linear4bit` in place; returns the model."""
    fmt = as_format(fmt)
    linears = quantized_linears(model)
    check_group_size(linears, group_size)
    for name, linear in linears.items():
        _set_module(model, name, Linear4bit.from_linear(linear, fmt, group_size, compute_dtype))
    return model


def _set_module(model: torch.nn.Module, name: str, module: torch.nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def dequantized_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The base model's weights on the CPU under the original model's names (LoRA left out), each 4-bit weight as
    the forward computes it (fp32 before the cast to the compute dtype): a plain model with these weights is the
    base the adapters were trained on."""
    out: dict[str, torch.Tensor] = {}
    layers = {_plain(n): m for n, m in model.named_modules() if isinstance(m, Linear4bit)}
    for key, value in model.state_dict().items():
        if "lora_" in key:
            continue
        name = _plain(key)
        owner, _, leaf = name.rpartition(".")
        if owner in layers and leaf == "weight_scale":
            continue
        if owner in layers and leaf == "weight":
            value = layers[owner].dequantize(torch.float32)
        out[name] = value.detach().cpu()
    return out


# ---- peft --------------------------------------------------------------------------------------------------------
@cache
def lora_layer_class() -> type:
    """peft's LoRA linear for a `Linear4bit` base (registered by `lora.add_lora` through LoraConfig's custom
    modules): its forward is peft's; merging dequantizes the base, adds the adapter's delta and quantizes the sum
    again (lossy, as peft's bitsandbytes 4-bit layer does; unmerge subtracts it the same way)."""
    from peft.tuners.lora.layer import Linear as LoraLinear
    from peft.tuners.tuners_utils import check_adapters_to_merge

    class Linear4bitLora(LoraLinear):
        def _requantize(self, adapter_names: list[str], sign: float, safe_merge: bool = False) -> None:
            base = self.get_base_layer()
            weight = base.dequantize(torch.float32)
            for name in adapter_names:
                if name in self.lora_A:
                    weight = weight + sign * self.get_delta_weight(name).float()
            if safe_merge and not torch.isfinite(weight).all():
                raise ValueError(f"NaNs in the merged weights of adapters {adapter_names}; not merged")
            base.set_weight(weight)

        def merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None) -> None:
            names = check_adapters_to_merge(self, adapter_names)
            if names:
                self._requantize(names, 1.0, safe_merge)
                self.merged_adapters.extend(n for n in names if n in self.lora_A)

        def unmerge(self) -> None:
            if self.merged:
                names = [n for n in self.merged_adapters if n in self.lora_A]
                self._requantize(names, -1.0)
                self.merged_adapters.clear()

    return Linear4bitLora


# ---- loading, layer by layer ---------------------------------------------------------------------------------------
@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Parameters made inside land on the meta device (no memory); buffers stay real (rotary frequencies are
    computed in the constructors and never saved)."""
    register = torch.nn.Module.register_parameter

    def on_meta(module, name, param):
        register(module, name, param)
        if param is not None:
            kind = type(module._parameters[name])
            module._parameters[name] = kind(module._parameters[name].to("meta"), requires_grad=param.requires_grad)

    torch.nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def checkpoint_files(source: str) -> list[Path]:
    """The safetensors files of a local model directory or a hub name (fetched into huggingface_hub's cache: the
    config, safetensors and generation config only)."""
    path = Path(source)
    if not path.is_dir():
        from huggingface_hub import snapshot_download

        path = Path(snapshot_download(source, allow_patterns=["*.json", "*.safetensors"]))
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / n for n in names]
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    raise ConfigError(f"MODEL={source!r} has no safetensors weights ({path}); a 4-bit base loads from safetensors "
                      "only (model.safetensors or its sharded index)")


def load_quantized_lm(source: str, fmt: str | QuantFormat, group_size: int = DEFAULT_GROUP_SIZE, *,
                      dtype: torch.dtype | None = None, attn_implementation: str | None = None) -> torch.nn.Module:
    """The causal LM of `source` (a local save_pretrained directory or a hub name) with its linear layers (but the
    head) in 4 bits, quantized tensor by tensor as the safetensors shards are read; the other weights in `dtype`
    (fp32 by default), as is the dequantized weight in the forward."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    fmt = as_format(fmt)
    dtype = dtype or torch.float32
    config = AutoConfig.from_pretrained(source)
    kwargs = {"attn_implementation": attn_implementation} if attn_implementation else {}
    with _parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, **kwargs)
    linears = quantized_linears(model)
    check_group_size(linears, group_size)
    for name, linear in linears.items():
        _set_module(model, name, Linear4bit(linear.in_features, linear.out_features, linear.bias is not None,
                                            fmt=fmt, group_size=group_size, compute_dtype=dtype, device="meta"))
    layers = {n: m for n, m in model.named_modules() if isinstance(m, Linear4bit)}
    expected = {n for n, p in model.named_parameters(remove_duplicate=False)} - {f"{n}.weight_scale" for n in layers}
    seen: set[str] = set()
    for file in checkpoint_files(source):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                owner, _, leaf = key.rpartition(".")
                if owner in layers and leaf == "weight":
                    layers[owner].set_weight(f.get_tensor(key))
                elif key in expected:
                    mod = model.get_submodule(owner)
                    old = mod._parameters[leaf]
                    mod._parameters[leaf] = torch.nn.Parameter(f.get_tensor(key).to(dtype),
                                                              requires_grad=old.requires_grad and owner not in layers)
                else:
                    continue  # a key this architecture does not use (transformers ignores them too)
                seen.add(key)
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()
        seen |= {n for n, p in model.named_parameters(remove_duplicate=False) if p.device.type != "meta"}
    missing = sorted(expected - seen)
    if missing:
        raise ConfigError(f"MODEL={source!r}: its safetensors hold no {missing[:5]} ({len(missing)} missing); is it "
                          f"a {type(model).__name__} checkpoint?")
    with contextlib.suppress(OSError, ValueError):
        model.generation_config = GenerationConfig.from_pretrained(source)
    model.eval()
    return model
