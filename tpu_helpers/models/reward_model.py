"""Reward models in transformers' sequence-classification form: a causal LM's body with a scalar head (`score`), what
`AutoModelForSequenceClassification` loads with `num_labels=1`, and what TRL's RewardTrainer trains and its GRPO
takes as a reward function.

    model, tokenizer = load_reward_model("smollm2-135m")     # a causal LM's weights + a fresh head (num_labels=1)
    check_reward_model("runs/rm/merged", setting="REWARDS")  # config time: a ConfigError unless it is a classifier
    scores = sequence_scores(model, input_ids, attention_mask)   # (rows,) float: the head at each row's last token

The head reads the last token that is not padding (transformers' own pooling, by `config.pad_token_id`, which is set
here to the tokenizer's), so a score computed here and one from plain transformers on the exported model agree.
`is_classifier` tells the two kinds apart (the adapters' task type and the merged export follow it: `models.lora`).
Training: `algorithms.reward_model`; the recipe: ALGORITHM "reward" of the preference notebook.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from tpu_helpers.config import ConfigError
from tpu_helpers.core.extras import require_extra
from tpu_helpers.models.hf import DEFAULT_ATTN, resolve_model_source

CLASSIFIER = "ForSequenceClassification"  # how transformers names the sequence-classification architectures


def is_classifier(model: torch.nn.Module) -> bool:
    """Whether `model` (or the base under its LoRA adapters) is a sequence classifier."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return type(base).__name__.endswith(CLASSIFIER)


def check_reward_model(path: str, *, setting: str = "REWARDS") -> Path:
    """The directory of a reward model (config.json naming a ...ForSequenceClassification with one label, as the
    preference recipe's ALGORITHM "reward" exports it); anything else is a ConfigError naming the path."""
    allowed = ("a directory that save_pretrained wrote for a sequence classifier with one label (config.json's "
               "architectures ending in ForSequenceClassification, num_labels 1), such as the merged/ export of "
               "the preference notebook with ALGORITHM 'reward'")
    where = Path(str(path)).expanduser()
    config = where / "config.json"
    if not config.is_file():
        what = "has no config.json" if where.is_dir() else "is not a directory"
        raise ConfigError(f"{setting}: the reward model {str(path)!r} {what}; give {allowed}")
    try:
        meta = json.loads(config.read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(f"{setting}: the reward model {str(path)!r}: {config} does not read as JSON ({err})") from None
    kinds = "/".join(map(str, meta.get("architectures") or [])) or "model of no named architecture"
    if not kinds.endswith(CLASSIFIER):
        raise ConfigError(f"{setting}: {str(path)!r} is a {kinds}, not a reward model; give {allowed}")
    labels = len(meta.get("id2label") or {}) or meta.get("num_labels", 2)
    if labels != 1:
        raise ConfigError(f"{setting}: {str(path)!r} is a {kinds} with {labels} labels, not a reward model (one "
                          f"score); give {allowed}")
    return where


def load_reward_model(model: str, *, dtype: torch.dtype | None = None,
                      attn_implementation: str | None = DEFAULT_ATTN) -> tuple[torch.nn.Module, Any]:
    """(sequence classifier with one label, tokenizer) of `model`: a causal LM's source (its body, a new head drawn
    by transformers' init) or a reward model's directory (its trained head). The tokenizer gets a pad token (eos)
    when it has none, and the model's config that pad token (the head reads the last token before it)."""
    require_extra("hf", "reward models (tpu_helpers.models.reward_model)", ("transformers", "tokenizers"))
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    source = resolve_model_source(model)
    tokenizer = AutoTokenizer.from_pretrained(source)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    kwargs: dict[str, Any] = {"num_labels": 1}
    if dtype is not None:
        kwargs["dtype"] = dtype
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    rm = AutoModelForSequenceClassification.from_pretrained(source, **kwargs)
    rm.config.pad_token_id = tokenizer.pad_token_id
    rm.config.use_cache = False
    rm.name_or_path = source
    return rm, tokenizer


def sequence_scores(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The scalar head's value at each right-padded row's last token (rows,), as float32."""
    return model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits[:, 0].float()
