"""LoRA adapters through peft: wrap with checked target modules, export an adapter dir and a merged model.

    model = add_lora(model, r=8, alpha=16, dropout=0.05, targets="q_proj,k_proj,v_proj,o_proj")
    export_adapter(model, "out/adapter")          # PeftModel.from_pretrained(base, "out/adapter")
    export_merged(model, tokenizer, "out/merged")  # AutoModelForCausalLM.from_pretrained("out/merged"), no torch_xla
    adapter_state_dict(model)                      # the adapter's weights, also under FSDP's wrappers

Target names are the short names of linear layers ("q_proj"); one that the model does not have is an error listing
the linear names it does have (peft's own message lists nothing). "all-linear" takes every linear layer but the
output head. Exports are written to a temporary directory and renamed, so a failed export leaves nothing half-done.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from tpu_helpers.backend.units import plain_name
from tpu_helpers.config import ConfigError
from tpu_helpers.core.extras import require_extra


def linear_names(model: torch.nn.Module) -> list[str]:
    """Short names of the model's linear layers (e.g. q_proj, up_proj, lm_head), sorted."""
    return sorted({name.rsplit(".", 1)[-1] for name, mod in model.named_modules()
                   if isinstance(mod, torch.nn.Linear) and name})


def parse_targets(model: torch.nn.Module, targets: str | list[str]) -> list[str] | str:
    if isinstance(targets, str):
        if targets.strip() == "all-linear":
            return "all-linear"
        targets = [t.strip() for t in targets.split(",") if t.strip()]
    if not targets:
        raise ConfigError(f"LORA_TARGETS is empty; give linear layer names, e.g. {','.join(linear_names(model)[:4])}, "
                          "or 'all-linear'")
    available = linear_names(model)
    missing = [t for t in targets if t not in available]
    if missing:
        raise ConfigError(f"LORA_TARGETS names {missing}, not linear layers of {type(model).__name__}; its linear "
                          f"layers are {available} (or use 'all-linear')")
    return list(targets)


def add_lora(model: torch.nn.Module, *, r: int = 8, alpha: int = 16, dropout: float = 0.0,
             targets: str | list[str] = "q_proj,k_proj,v_proj,o_proj") -> torch.nn.Module:
    """A peft LoRA model: base weights frozen, adapters trainable."""
    require_extra("hf", "LoRA adapters (tpu_helpers.models.lora)", ("peft", "transformers"))
    from peft import LoraConfig, get_peft_model

    if r < 1:
        raise ConfigError(f"LORA_R={r!r} must be >= 1")
    if not 0.0 <= dropout < 1.0:
        raise ConfigError(f"LORA_DROPOUT={dropout!r} must be in [0, 1)")
    # A reward model's head (`score`) trains whole next to the adapters: peft's SEQ_CLS keeps it in the adapter.
    task = "SEQ_CLS" if _classifier(model) else "CAUSAL_LM"
    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=parse_targets(model, targets),
                        task_type=task)
    from tpu_helpers.models import quant4

    if quant4.is_quantized(model):  # a 4-bit base (QLoRA): peft's LoRA forward, a merge that dequantizes
        config._register_custom_module({quant4.Linear4bit: quant4.lora_layer_class()})
    return get_peft_model(model, config)


def _classifier(model: torch.nn.Module) -> bool:
    from tpu_helpers.models.reward_model import is_classifier

    return is_classifier(model)


def is_peft(model: torch.nn.Module) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def adapter_state_dict(model: torch.nn.Module, adapter_name: str = "default", *, weights: dict | None = None) -> dict:
    """The PEFT (LoRA) adapter weights of `model` with peft's own key names, also when FSDP wrapped its layers;
    with `weights` (state-dict entries under the plain names, e.g. a checkpoint's adapters) those values instead.

    peft finds the adapter by the tuner layers' module names; the FSDP wrappers add a level to those names while
    the state dict keeps the plain ones (so checkpoints load under any sharding), and peft then silently returns
    an empty adapter (the missing-adapter-keys failure also seen with the HF Trainer under FSDP). So the state
    dict is handed to peft under the wrapped names and the result renamed back.
    """
    from peft import get_peft_model_state_dict

    plain = model.state_dict()
    unknown = sorted(set(weights or {}) - set(plain))
    if unknown:
        raise ConfigError(f"the weights {unknown[:5]} are not {type(model).__name__}'s: another model's checkpoint?")
    plain.update(weights or {})
    wrapped = {}
    for name in [n for n, _ in model.named_parameters()] + [n for n, _ in model.named_buffers()]:
        key = plain_name(name)
        if key in plain:
            wrapped[name] = plain[key]
    adapter = get_peft_model_state_dict(model, state_dict=wrapped, adapter_name=adapter_name)
    return {plain_name(k): v for k, v in adapter.items()}


def base_fingerprint(model: torch.nn.Module, name_or_path: str) -> dict[str, Any]:
    """Identifies the frozen base a LoRA checkpoint belongs to: its name/path, parameter count and a weight hash.

    The hash covers a few deterministic slices of every frozen tensor (cheap even for billions of parameters).
    """
    h = hashlib.sha256()
    count = 0
    for name, p in sorted(model.named_parameters()):
        count += p.numel()
        if not p.requires_grad:
            flat = p.detach().reshape(-1)
            h.update(name.encode())
            h.update(flat[:64].float().cpu().numpy().tobytes())
    return {"base_model": str(name_or_path), "base_parameters": count, "base_hash": h.hexdigest()[:16]}


def atomic_dir(target: str | os.PathLike, write: Callable[[Path], None]) -> Path:
    """Run `write(tmp)` on a temporary directory next to `target`, then rename it to `target` (replacing it)."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".tmp", dir=target.parent))
    try:
        write(tmp)
        if target.exists():
            shutil.rmtree(target)
        os.rename(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def export_state(model: torch.nn.Module, weights: dict | None = None) -> dict[str, torch.Tensor]:
    """The weights an export writes, copied to the CPU one tensor at a time: the LoRA adapter's (peft's key names,
    also under FSDP) or, without LoRA, the whole model's. Under SPMD on a pod slice reading a sharded tensor to
    the host runs a program on every host, so every process calls this; only the main one writes. `weights`: the
    model's weights to take instead of its live ones (a checkpoint's: the adapters under LoRA, else the whole
    model, under the plain names)."""
    if weights is not None and not is_peft(model):
        return {k: v.detach().cpu().float() for k, v in weights.items()}
    if is_peft(model):
        state = {k: v.detach().cpu().contiguous() for k, v in adapter_state_dict(model, weights=weights).items()}
        if not state:
            raise ConfigError(f"{type(model).__name__} has no weights for its LoRA adapter 'default': nothing to "
                              "export")
        return state
    return {k: v.detach().cpu().float() for k, v in model.state_dict().items()}


def export_adapter(model: torch.nn.Module, out_dir: str | os.PathLike, *, state: dict | None = None) -> Path:
    """The peft adapter dir (adapter_config.json, adapter_model.safetensors, README.md), also of an FSDP-wrapped model.

    peft's `save_pretrained` writes the config and model card; the weights come from `adapter_state_dict` (through
    `export_state`, or `state` when already taken), since under FSDPv2 peft's own selection finds no adapter (the
    wrapped layers' names carry "_orig_module.") and would write an empty file.
    """
    from safetensors.torch import save_file

    if not is_peft(model):
        raise ConfigError("export_adapter needs a LoRA (peft) model; with METHOD='full' export the merged model only")
    state = export_state(model) if state is None else state

    def write(tmp: Path) -> None:
        config = model.peft_config["default"]
        if config.modules_to_save:  # a reward model's head: peft would look its weights up in the empty state dict
            replace(config, inference_mode=True).save_pretrained(tmp)
        else:
            model.save_pretrained(tmp, state_dict={}, safe_serialization=True)  # config and card; weights next
        save_file(state, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})

    return atomic_dir(out_dir, write)


def export_merged(model: torch.nn.Module, tokenizer: Any, out_dir: str | os.PathLike, *, base_source: str,
                  dtype: torch.dtype = torch.float32, state: dict | None = None, base_state: dict | None = None) -> Path:
    """A standalone model in safetensors: LoRA merged into a fresh CPU copy of the base (the live model is
    untouched). `state`: the model's `export_state`, when already taken; `base_state`: the base's weights to merge
    into instead of `base_source`'s own (e.g. the fake-quantized values a QAT run trained its adapters on). A
    reward model (`models.reward_model`) exports as a sequence classifier with its trained head."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    state = export_state(model) if state is None else state
    classifier = _classifier(model)
    auto, labels = (AutoModelForSequenceClassification, {"num_labels": 1}) if classifier else (AutoModelForCausalLM, {})

    def write(tmp: Path) -> None:
        if is_peft(model):
            from peft import PeftModel

            adapter = Path(tempfile.mkdtemp(dir=tmp.parent))
            try:
                export_adapter(model, adapter / "a", state=state)
                base = auto.from_pretrained(base_source, dtype=torch.float32, **labels)
                if base_state is not None:
                    base.load_state_dict({k: v.float() for k, v in base_state.items()})
                merged = PeftModel.from_pretrained(base, adapter / "a").merge_and_unload()
            finally:
                shutil.rmtree(adapter, ignore_errors=True)
        else:
            merged = auto.from_config(model.config, dtype=torch.float32)
            merged.load_state_dict(state)
            merged.tie_weights()
        if classifier:
            merged.config.pad_token_id = model.config.pad_token_id  # where the head reads each row
        merged.to(dtype).save_pretrained(tmp, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        (tmp / "tpu_helpers.json").write_text(json.dumps({"base_model": base_source}, indent=1))

    return atomic_dir(out_dir, write)
