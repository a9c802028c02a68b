"""The values a user may type for the settings that name a choice, and the one check of a chosen value.

    from tpu_helpers.core.choices import DEVICES, PRECISIONS, OPTIMIZERS, ConfigError, check_choice, choose
    check_choice("precision", "bf16", PRECISIONS)     # ConfigError naming the value and the allowed ones otherwise
    loss = choose("loss_type", "dapo", LOSS_TYPES)     # a registry {name: what the code runs}: the chosen entry

The lists here are what `TrainConfig`, the memory estimates, the tuning panel and the command lines check, without
torch (a leaf: it imports nothing). A choice that selects code (GRPO's LOSS_TYPE, IMPORTANCE and SCALE_REWARDS,
DPO's loss, QUANTIZE_BASE) is a registry beside that code instead (`algorithms.grpo_loss`,
`algorithms.preference_loss`, `models.quant4`), its names the registry's keys: the settings parse it once with
`choose`, and the step calls what was chosen.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

T = TypeVar("T")

DEVICES = ("auto", "tpu", "cuda", "cpu", "xla")
# What the step computes in: auto (bf16 on TPU, bf16/fp16 on CUDA, fp32 on CPU) | fp32 | bf16 autocast over fp32
# weights | fp16 autocast with a GradScaler (CUDA only). Storing the weights themselves in bf16 is another setting
# (`pure_bf16` in the memory estimates and the tuning panel).
PRECISIONS = ("auto", "fp32", "bf16", "fp16")
# adamw: two fp32 moments per parameter; sgd: momentum; adafactor: a factored second moment (a row and a column
# per matrix, training/optimizers.py), the optimizer that fits the largest model in the least memory.
OPTIMIZERS = ("adamw", "sgd", "adafactor")
PRESET_NAMES = ("tiny", "mini", "small", "medium")
# Fine-tuning (recipes.finetune): LoRA adapters on a frozen base | every weight | distillation from a teacher.
FINETUNE_METHODS = ("lora", "full", "distill")
# Quantization-aware training (models/qat.py): the base model's linear weights fake-quantized in the forward pass,
# symmetric per group of input columns, to 4 or 8 bits.
QAT_SCHEMES = ("int4", "int8")
XLA_CHECKS = ("warn", "strict", "off")
ON_NONFINITE = ("stop", "warn")
# A loss that spikes but stays finite (training/guard/divergence.py): stop the run | warn once and go on | do not check.
ON_DIVERGENCE = ("stop", "warn", "off")
# Which weights the fine-tuning exports take: the best checkpoint's (by `best_metric`) or the last step's.
EXPORT_WEIGHTS = ("best", "last")
RESUME = (True, False, "force_new")
# EXPORT_GGUF (models/gguf_export.py): the merged model's matrices in the .gguf file for llama.cpp, Ollama and LM
# Studio: 16-bit floats, bfloat16, or llama.cpp's 8-bit blocks (Q8_0: about half of f16, close to it in quality).
GGUF_TYPES = ("f16", "bf16", "q8_0")
# Experiment trackers a run can log to (TrainConfig.trackers, comma separated; none by default), each an optional
# extra of the package: pip install "tpu_helpers[tracking]" for all of them, or "tpu_helpers[wandb]" for one.
TRACKERS = ("tensorboard", "wandb", "trackio")


class ConfigError(ValueError):
    """A configuration or notebook parameter value that cannot be used; the message names it and what is allowed."""


def nearest(value: Any, names: Iterable[Any]) -> str | None:
    """The one of `names` (strings) that `value` most likely misspells, ignoring case (difflib's ratio >= 0.6), or
    None when none is that close: what a "did you mean" says (`STPES` -> `STEPS`, `smollm2-135` -> `smollm2-135m`)."""
    if not isinstance(value, str):
        return None
    by_lower = {n.lower(): n for n in names if isinstance(n, str)}
    found = difflib.get_close_matches(value.lower(), list(by_lower), n=1, cutoff=0.6)
    return by_lower[found[0]] if found else None


def did_you_mean(value: Any, names: Iterable[Any]) -> str:
    """" (did you mean 'X'?)" for the nearest of `names` (see `nearest`), or "" when none is close."""
    match = nearest(value, names)
    return f" (did you mean {match!r}?)" if match is not None else ""


def misspelt(unknown: Iterable[str], names: Iterable[str]) -> str:
    """" Did you mean STEPS (not STPES)?" for those of the `unknown` names close to one of `names` (`nearest`), or
    "" when none is: the sentence that ends an unknown-name error."""
    names = list(names)
    guesses = ", ".join(f"{m} (not {n})" for n in unknown if (m := nearest(n, names)) is not None)
    return f" Did you mean {guesses}?" if guesses else ""


def check_choice(name: str, value: Any, allowed: tuple) -> None:
    """ConfigError unless `value` is one of `allowed` (compared with ==, so True and 1 are told apart by type)."""
    if not any(value == a and type(value) is type(a) for a in allowed):
        raise ConfigError(f"{name}={value!r} is not one of {allowed}")


def choose(name: str, value: Any, registry: Mapping[str, T]) -> T:
    """`registry[value]`: the entry a setting names, or a ConfigError naming the value and the registry's names."""
    check_choice(name, value, tuple(registry))
    return registry[value]


def best_metric_order(spec: str) -> tuple[str, bool]:
    """(metric, higher is better) of a `best_metric` setting: "val_loss", "max:exact_match", "min:perplexity".

    Without a prefix, lower is better for a name ending in "loss" and higher otherwise (the Hugging Face Trainer's
    rule for `metric_for_best_model`); "min:" or "max:" says it outright."""
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError(f"best_metric={spec!r} must name a validation metric, e.g. 'val_loss' or "
                          "'max:exact_match', or be None")
    order, _, name = spec.rpartition(":")
    if order not in ("", "min", "max") or not name.strip():
        raise ConfigError(f"best_metric={spec!r}: write the metric's name ('val_loss'), optionally after 'min:' or "
                          "'max:' (which way is better), e.g. 'max:exact_match'")
    return name.strip(), order == "max" or (not order and not name.strip().endswith("loss"))


def check_trackers(value: str) -> str:
    """The canonical form of a TRACKERS value ("TensorBoard, wandb" -> "tensorboard,wandb"; "" or "none": none), or a
    ConfigError naming each unknown tracker and the known ones."""
    if not isinstance(value, str):
        raise ConfigError(f"trackers={value!r} must be a string of tracker names, comma separated, e.g. "
                          f"'tensorboard,wandb' (known: {', '.join(TRACKERS)})")
    names = [n.strip().lower() for n in value.split(",") if n.strip()]
    if names == ["none"]:
        return ""
    unknown = [n for n in names if n not in TRACKERS]
    if unknown:
        raise ConfigError(f"trackers={value!r}: unknown tracker(s) {', '.join(repr(n) for n in unknown)}; known: "
                          f"{', '.join(TRACKERS)} (comma separated, or '' for none)")
    return ",".join(dict.fromkeys(names))


def is_finite_number(value: Any) -> bool:
    """Whether `value` is an int or float that is finite (a bool is not a number here)."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def check_positive(name: str, value: Any) -> None:
    """ConfigError unless `value` is an int >= 1 (a bool is not an int here)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name}={value!r} must be an integer >= 1")
