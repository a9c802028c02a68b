"""Load a Hugging Face causal LM and its tokenizer for fine-tuning, and generate from it without recompiling.

    model, tokenizer = load_causal_lm("Qwen/Qwen2.5-0.5B-Instruct")   # or a local dir, or "tiny" (offline default)
    texts = generate(model, tokenizer, prompts, backend=backend, max_new_tokens=8)

`load_causal_lm` goes through `AutoModelForCausalLM.from_pretrained` / `AutoTokenizer.from_pretrained` for every
source; "tiny" first builds the offline tiny Qwen2 (models/hf_tiny.py) in the cache. A local directory without a
config.json is an error naming the path (from_pretrained would otherwise try the hub with it).

`generate` runs a fixed-length greedy loop over one buffer of fixed shape (prompts left-padded to a fixed length,
new tokens written in place with a mask, positions as device tensors): every token runs the same graph, so on XLA
the whole generation compiles once, where `model.generate` with a dynamic cache compiles per token.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from tpu_helpers.config import ConfigError
from tpu_helpers.extras import require_extra

TINY = "tiny"
# The attention implementation models load with: eager, by the numbers of benchmarks/attention_impl.py (tiny
# Qwen2, LoRA SFT, batch 8 x 128, XLA:CPU on a loaded 2-core machine, step times best of 2-3 runs). Both compile
# 2 training graphs; compiled step: eager 44.6 MiB, sdpa 50.6 MiB (+13%); generation: eager <= 3 graphs, sdpa 4;
# ms/step eager 203.5, sdpa 110.3 on XLA:CPU, BUT sdpa reads the device from the host in every step (4
# device-to-host transfers per step with 3 layers, 8 with a teacher; seen by the strict runs of test_finetune.py,
# transformers.masking_utils._ignore_causal_mask_sdpa calls fast_all(padding_mask) to pick is_causal): a stall per
# step on a TPU.
DEFAULT_ATTN = "eager"


def resolve_model_source(model: str, cache_dir: str | os.PathLike | None = None) -> str:
    """The path or hub name that `from_pretrained` gets: "tiny" -> the built tiny model's directory."""
    if not isinstance(model, str) or not model.strip():
        raise ConfigError(f"MODEL={model!r} must be a hub name (e.g. 'Qwen/Qwen2.5-0.5B-Instruct'), a local "
                          f"directory with config.json, or {TINY!r}")
    if model == TINY:
        from tpu_helpers.models.hf_tiny import tiny_model_dir

        return str(tiny_model_dir(cache_dir))
    path = Path(model).expanduser()
    if path.exists() or model.startswith((".", "/", "~")):
        if not path.is_dir() or not (path / "config.json").is_file():
            raise ConfigError(f"MODEL={model!r} is a local path without a config.json; give a directory written "
                              "by save_pretrained (config.json + weights), a hub name, or 'tiny'")
    return str(path) if path.exists() else model


def load_causal_lm(model: str, *, dtype: torch.dtype | None = None, attn_implementation: str | None = DEFAULT_ATTN,
                   cache_dir: str | os.PathLike | None = None) -> tuple[torch.nn.Module, Any]:
    """(model, tokenizer) through the Auto classes; the tokenizer gets a pad token (eos) when it has none."""
    require_extra("hf", "loading a Hugging Face model (tpu_helpers.models.hf)", ("transformers", "tokenizers"))
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = resolve_model_source(model, cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(source)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    kwargs: dict[str, Any] = {}
    if dtype is not None:
        kwargs["dtype"] = dtype
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    lm = AutoModelForCausalLM.from_pretrained(source, **kwargs)
    lm.config.use_cache = False  # training: no KV cache (it changes shapes per step)
    lm.name_or_path = source
    return lm, tokenizer


def max_context(model: torch.nn.Module) -> int | None:
    return getattr(model.config, "max_position_embeddings", None)


def check_seq_len(model: torch.nn.Module, seq_len: int) -> None:
    limit = max_context(model)
    if limit is not None and seq_len > limit:
        raise ConfigError(f"SEQ_LEN={seq_len} exceeds the model's context of {limit} tokens "
                          f"(config.max_position_embeddings); use SEQ_LEN <= {limit}")


def set_gradient_checkpointing(model: torch.nn.Module, checkpoint_fn: Any) -> None:
    """Turn on checkpointing with the backend's function (torch_xla's on XLA) through the model's own hook."""
    if hasattr(model, "set_gradient_checkpointing"):  # the package's GPT
        model.set_gradient_checkpointing(checkpoint_fn)
        return
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not hasattr(base, "_set_gradient_checkpointing"):
        raise ConfigError(f"gradient_checkpointing=True but {type(base).__name__} has no set_gradient_checkpointing(fn) "
                          "nor a Hugging Face gradient-checkpointing hook; add one (see tpu_helpers.models.gpt.GPT) "
                          "or turn it off")
    base._set_gradient_checkpointing(True, checkpoint_fn)
    base.config.use_cache = False
    # Reentrant checkpoints (torch_xla's) give no gradient to weights inside a block whose inputs need none, as
    # under LoRA with frozen embeddings: make the embedding output require grad (what HF does for peft).
    if hasattr(base, "enable_input_require_grads"):
        base.enable_input_require_grads()


@torch.no_grad()
def generate(model: torch.nn.Module, tokenizer: Any, prompts: list, *, device: Any, sync: Any = None,
             max_new_tokens: int = 8, prompt_len: int | None = None, batch_size: int = 16) -> list[str]:
    """Greedy answers for chat prompts (lists of messages) or strings, in fixed-shape batches.

    `sync` is called once per token (the backend's sync on XLA: one graph per token, the same graph every time).
    """
    texts = [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True)
             if isinstance(p, list) else p for p in prompts]
    enc = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    width = prompt_len or max(len(e) for e in enc)
    pad = tokenizer.pad_token_id
    eos = tokenizer.eos_token_id
    total = width + max_new_tokens
    was_training = model.training
    model.eval()
    out: list[str] = []
    for start in range(0, len(enc), batch_size):
        chunk = enc[start:start + batch_size]
        n = len(chunk)
        chunk = chunk + [chunk[-1]] * (batch_size - n)  # a fixed batch: a short last chunk would be a new graph
        ids = torch.full((batch_size, total), pad, dtype=torch.long)
        mask = torch.zeros((batch_size, total), dtype=torch.long)
        for i, e in enumerate(chunk):
            e = e[-width:]
            ids[i, width - len(e):width] = torch.tensor(e)
            mask[i, width - len(e):width] = 1
        ids, mask = ids.to(device), mask.to(device)
        cols = torch.arange(total, device=device)
        pos = torch.full((1,), width, dtype=torch.long).to(device)  # data, not a constant: one graph for all steps
        for _ in range(max_new_tokens):
            position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
            logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids).logits
            last = logits.index_select(1, pos - 1).squeeze(1)
            nxt = last.argmax(-1)
            here = (cols == pos).unsqueeze(0)
            ids = torch.where(here, nxt.unsqueeze(1), ids)
            mask = torch.where(here, torch.ones_like(mask), mask)
            pos = pos + 1
            if sync is not None:
                sync()
        new = ids[:n, width:].cpu().tolist()
        for row in new:
            if eos in row:
                row = row[:row.index(eos)]
            out.append(tokenizer.decode(row, skip_special_tokens=True))
    model.train(was_training)
    return out
