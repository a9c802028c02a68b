"""GGUF export: a merged Hugging Face model directory as one `.gguf` file for llama.cpp, Ollama and LM Studio.

    from tpu_helpers.models import gguf_export
    gguf_export.check_exportable(model_config)                  # before training: a family it cannot write is an error
    gguf_export.write_gguf("out/merged", "out/model-f16.gguf", "f16")   # f16 | bf16 | q8_0 (core.choices.GGUF_TYPES)

The `gguf` package (llama.cpp's own Python library) does the work: its `GGUFWriter` writes the file, its tensor-name
maps (`get_tensor_name_map`) name every tensor as llama.cpp does, its `SpecialVocab` takes the merges, special tokens
and chat template from the tokenizer files, and `gguf.quants.quantize` makes Q8_0 and BF16. What is left here is the
glue llama.cpp's converter (convert_hf_to_gguf.py) has per family: the metadata keys, Llama's q/k row order, Gemma's
norm weights stored as 1 + w, and the vocabulary (byte-level BPE as "gpt2", byte-fallback BPE as "llama"). `FAMILIES`
says what is written; a `model_type` outside it, or a rope scaling it does not write, is a ConfigError from the
model's config alone. The file is written to a temporary name and renamed. Needs `gguf` (the `gguf` extra); taking
the file to llama.cpp, Ollama and LM Studio: docs/guides/models.md.
"""

from __future__ import annotations

import json
import math
import os
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tpu_helpers.config import ConfigError
from tpu_helpers.core.choices import GGUF_TYPES, check_choice
from tpu_helpers.core.extras import require_extra


@dataclass(frozen=True)
class Family:
    """How one Hugging Face `model_type` becomes llama.cpp's architecture `arch` (a gguf.MODEL_ARCH name)."""

    arch: str
    permute_qk: bool = False  # llama.cpp's LLAMA rotates interleaved pairs: q and k rows reordered (its converter's)
    norm_shift: float = 0.0  # Gemma computes x * (1 + w): llama.cpp stores 1 + w
    extra: Callable[[Any, Any], None] | None = None  # (writer, config): the family's own metadata


def _gemma2(writer: Any, config: Any) -> None:
    if config.attn_logit_softcapping is not None:
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
    if config.final_logit_softcapping is not None:
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    if config.sliding_window is not None:
        writer.add_sliding_window(config.sliding_window)


def _gemma3(writer: Any, config: Any) -> None:
    if config.sliding_window is not None:
        writer.add_sliding_window(config.sliding_window)
    if getattr(config, "final_logit_softcapping", None) is not None:
        writer.add_final_logit_softcapping(config.final_logit_softcapping)


def _phi3(writer: Any, config: Any) -> None:
    rotary = getattr(config, "partial_rotary_factor", 1.0) or 1.0
    writer.add_rope_dimension_count(int(rotary * config.hidden_size) // config.num_attention_heads)
    if getattr(config, "sliding_window", None) is not None:
        writer.add_sliding_window(config.sliding_window)


def _head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _llama(writer: Any, config: Any) -> None:
    writer.add_rope_dimension_count(_head_dim(config))


# The families the package fine-tunes that llama.cpp runs and transformers' GGUF reader reads back. Mistral is
# llama.cpp's LLAMA architecture (as its converter writes it); Gemma 3 is its text model (`gemma3_text`).
FAMILIES: dict[str, Family] = {
    "llama": Family("LLAMA", permute_qk=True, extra=_llama),
    "mistral": Family("LLAMA", permute_qk=True, extra=_llama),
    "qwen2": Family("QWEN2"),
    "qwen3": Family("QWEN3"),
    "gemma2": Family("GEMMA2", norm_shift=1.0, extra=_gemma2),
    "gemma3_text": Family("GEMMA3", norm_shift=1.0, extra=_gemma3),
    "phi3": Family("PHI3", extra=_phi3),
}
# llama.cpp's pre-tokenizer names for the byte-level BPE splits it knows, by the split each tokenizer.json states:
# llama.cpp picks its split regex by this name (an unknown one makes it refuse the file).
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def require_gguf() -> Any:
    """The `gguf` module, or MissingExtra naming the `gguf` extra that brings it."""
    require_extra("gguf", "EXPORT_GGUF (the GGUF export, tpu_helpers.models.gguf_export)")
    import gguf

    return gguf


def _rope(config: Any) -> dict:
    """The rope parameters of the model's full-attention layers (transformers 5's `rope_parameters`, possibly one
    entry per layer type; older configs' rope_theta and rope_scaling)."""
    params = getattr(config, "rope_parameters", None) or {}
    if "full_attention" in params:
        params = params["full_attention"]
    params = dict(params)
    scaling = getattr(config, "rope_scaling", None)
    if isinstance(scaling, dict) and "rope_type" not in params:
        params.update(scaling)
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params.setdefault("rope_type", params.pop("type", "default") or "default")
    return params


ROPE_TYPES = ("default", "linear", "llama3")


def check_exportable(config: Any) -> Family:
    """The family of a Hugging Face model config, or a ConfigError naming its model_type (or rope scaling) and the
    ones the GGUF export writes: called when a job is built, before training."""
    kind = getattr(config, "model_type", None)
    if kind not in FAMILIES:
        raise ConfigError(f"EXPORT_GGUF: a {kind!r} model is not one the GGUF export writes; it writes "
                          f"{', '.join(sorted(FAMILIES))} (Llama, Mistral, Qwen 2/2.5/3, Gemma 2/3 text, Phi-3). "
                          "Set EXPORT_GGUF = None, or convert the merged export with llama.cpp's convert_hf_to_gguf.py")
    rope = _rope(config)["rope_type"]
    if rope not in ROPE_TYPES:
        raise ConfigError(f"EXPORT_GGUF: {kind} with rope scaling {rope!r} is not written by the GGUF export "
                          f"(it writes {', '.join(ROPE_TYPES)}). Set EXPORT_GGUF = None, or convert the merged export "
                          "with llama.cpp's convert_hf_to_gguf.py")
    return FAMILIES[kind]


def file_name(gguf_type: str) -> str:
    """The file the export writes beside `merged/`: model-f16.gguf, model-q8_0.gguf."""
    check_choice("export_gguf", gguf_type, GGUF_TYPES)
    return f"model-{gguf_type}.gguf"


def write_gguf(model_dir: str | os.PathLike, path: str | os.PathLike, gguf_type: str = "f16", *,
               name: str | None = None) -> Path:
    """Write the model saved in `model_dir` (save_pretrained: config, safetensors, tokenizer) as a GGUF file at
    `path`, its matrices in `gguf_type` (f16 | bf16 | q8_0; vectors such as norms stay f32, as llama.cpp wants);
    `name` is the file's general.name (the directory's name by default)."""
    from transformers import AutoConfig, AutoTokenizer

    check_choice("export_gguf", gguf_type, GGUF_TYPES)
    gguf = require_gguf()
    model_dir, path = Path(model_dir), Path(path)
    config = AutoConfig.from_pretrained(model_dir)
    family = check_exportable(config)
    arch = getattr(gguf.MODEL_ARCH, family.arch)
    tmp = path.with_name(path.name + ".tmp")
    # use_temp_file: each tensor goes to a spooled temporary file as it is converted, not held until the end (a 7B
    # model in f16 would otherwise hold 14 GB of host memory).
    writer = gguf.GGUFWriter(tmp, gguf.MODEL_ARCH_NAMES[arch], use_temp_file=True)
    try:
        _write_parameters(gguf, writer, config, family, name or model_dir.name, gguf_type)
        _write_vocab(gguf, writer, model_dir, AutoTokenizer.from_pretrained(model_dir), config.vocab_size)
        _write_tensors(gguf, writer, model_dir, config, family, arch, gguf_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, path)
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
    return path


FILE_TYPES = {"f16": "MOSTLY_F16", "bf16": "MOSTLY_BF16", "q8_0": "MOSTLY_Q8_0"}


def _write_parameters(gguf: Any, writer: Any, config: Any, family: Family, name: str, gguf_type: str) -> None:
    rope = _rope(config)
    writer.add_name(name)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_key_length(_head_dim(config))  # not always hidden / heads: Qwen3-0.6B's is 128 of 1024 / 16
    writer.add_value_length(_head_dim(config))
    if rope["rope_type"] == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope["factor"]))
    if family.extra is not None:
        family.extra(writer, config)
    writer.add_file_type(getattr(gguf.LlamaFileType, FILE_TYPES[gguf_type]))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def _write_vocab(gguf: Any, writer: Any, model_dir: Path, tokenizer: Any, vocab_size: int) -> None:
    """The tokens in id order (padded to the model's vocab_size with unused [PADn] tokens, as llama.cpp's converter
    does), their types, and for byte-fallback BPE scores from the merge order; then gguf's SpecialVocab: merges,
    special token ids, add_bos/add_eos and the chat template."""
    spec = json.loads((model_dir / "tokenizer.json").read_text(encoding="utf-8"))
    model = spec.get("model", {})
    if model.get("type") != "BPE":
        raise ConfigError(f"EXPORT_GGUF: the tokenizer of {model_dir} is a {model.get('type')!r} model; the GGUF "
                          "export writes BPE tokenizers (byte-level, as Llama 3, Qwen and SmolLM2 have, or with byte "
                          "fallback, as Llama 2, Mistral, Gemma and Phi-3 have)")
    byte_fallback = bool(model.get("byte_fallback"))
    reverse = {i: t for t, i in tokenizer.get_vocab().items()}
    added = tokenizer.added_tokens_decoder
    count = max(vocab_size, max(reverse) + 1)
    tokens, types = [], []
    for i in range(count):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif i in added:
            tokens.append(reverse[i])
            types.append(gguf.TokenType.CONTROL if added[i].special else gguf.TokenType.USER_DEFINED)
        elif byte_fallback and re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", reverse[i]):
            tokens.append(reverse[i])
            types.append(gguf.TokenType.BYTE)
        else:
            tokens.append(reverse[i])
            types.append(gguf.TokenType.UNKNOWN if reverse[i] == tokenizer.unk_token else gguf.TokenType.NORMAL)
    if byte_fallback:
        # llama.cpp's "llama" tokenizer merges the pair whose result scores highest: the merge order as scores.
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        rank = {"".join(m.split(" ") if isinstance(m, str) else m): -float(r) for r, m in enumerate(model["merges"])}
        writer.add_token_scores([rank.get(t, 0.0) for t in tokens])
        writer.add_add_space_prefix(_adds_space_prefix(spec))
    else:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(_pre_tokenizer(spec, model_dir))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    special = gguf.SpecialVocab(model_dir, load_merges=not byte_fallback, n_vocab=len(tokens))
    # Whether to add BOS and EOS as the tokenizer does, where its files do not say (llama.cpp guesses otherwise).
    ids, plain = tokenizer("a").input_ids, tokenizer("a", add_special_tokens=False).input_ids
    special.add_special_token.setdefault("bos", ids[:1] != plain[:1] and ids[:1] == [tokenizer.bos_token_id])
    special.add_special_token.setdefault("eos", ids[-1:] != plain[-1:] and ids[-1:] == [tokenizer.eos_token_id])
    special.add_to_gguf(writer, quiet=True)


def _adds_space_prefix(spec: dict) -> bool:
    text = json.dumps([spec.get("normalizer"), spec.get("pre_tokenizer")])
    return '"Prepend"' in text or ('"Metaspace"' in text and '"never"' not in text)


def _pre_tokenizer(spec: dict, model_dir: Path) -> str:
    """llama.cpp's name for the tokenizer's split: GPT-2's with single digits (SmolLM2, the tiny model), Qwen 2's,
    Llama 3's, or GPT-2's own; another split gets "default" with a warning (llama.cpp then splits its own way)."""
    pre = spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre])
    kinds = [s.get("type") for s in steps]
    splits = [s.get("pattern", {}).get("Regex") for s in steps if s.get("type") == "Split"]
    if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits"):
        return "smollm"
    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True):
        return "gpt-2"
    if splits == [QWEN2_SPLIT]:
        return "qwen2"
    if splits == [LLAMA3_SPLIT]:
        return "llama-bpe"
    warnings.warn(f"EXPORT_GGUF: the tokenizer of {model_dir} splits text in a way this export does not name for "
                  f"llama.cpp ({kinds}); the file says 'default' and llama.cpp splits text its own way, which may "
                  "tokenize differently. Convert the merged export with llama.cpp's convert_hf_to_gguf.py to keep "
                  "its tokenization exact", stacklevel=3)
    return "default"


def _tensors(model_dir: Path):
    """(name, float32 torch tensor) of every safetensors file in `model_dir`, one tensor at a time."""
    from safetensors import safe_open

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"EXPORT_GGUF: {model_dir} holds no .safetensors weights (the merged export writes them)")
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():
                yield key, handle.get_tensor(key).float()


def _permute(weights: Any, heads: int) -> Any:
    """llama.cpp's converter's row order for q and k under LLAMA (rotary pairs interleaved, not split in halves)."""
    return weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:]).swapaxes(1, 2) \
        .reshape(weights.shape)


def _llama3_rope_factors(config: Any, rope: dict) -> Any:
    """The per-frequency factors llama.cpp reads from `rope_freqs.weight` for Llama 3.1+'s rope scaling (as its
    converter computes them)."""
    import torch

    dim, factor = _head_dim(config), float(rope.get("factor", 8.0))
    low, high = float(rope.get("low_freq_factor", 1.0)), float(rope.get("high_freq_factor", 4.0))
    context = float(rope.get("original_max_position_embeddings", 8192))
    freqs = 1.0 / (float(rope["rope_theta"]) ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < context / high:
            factors.append(1.0)
        elif wavelen > context / low:
            factors.append(factor)
        else:
            smooth = (context / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(factors, dtype=torch.float32)


def _write_tensors(gguf: Any, writer: Any, model_dir: Path, config: Any, family: Family, arch: Any,
                   gguf_type: str) -> None:
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    rope = _rope(config)
    if rope["rope_type"] == "llama3":
        writer.add_tensor(gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight",
                          _llama3_rope_factors(config, rope).numpy())
    for key, tensor in _tensors(model_dir):
        if tied and key == "lm_head.weight":
            continue  # llama.cpp ties the head to token_embd when output.weight is absent
        target = names.get_name(key, try_suffixes=(".weight", ".bias"))
        if target is None:
            raise ConfigError(f"EXPORT_GGUF: the tensor {key!r} of {model_dir} has no llama.cpp name for "
                              f"{config.model_type}; convert the merged export with llama.cpp's convert_hf_to_gguf.py")
        if family.permute_qk and key.endswith("q_proj.weight"):
            tensor = _permute(tensor, heads)
        elif family.permute_qk and key.endswith("k_proj.weight"):
            tensor = _permute(tensor, kv_heads)
        if family.norm_shift and key.endswith("norm.weight"):
            tensor = tensor + family.norm_shift
        _add(gguf, writer, target, tensor.numpy(), gguf_type)


def _add(gguf: Any, writer: Any, name: str, data: Any, gguf_type: str) -> None:
    """Vectors (norms, biases) in f32 as llama.cpp wants; matrices in `gguf_type`; a matrix Q8_0 cannot block (rows
    not a multiple of 32) in f16, as llama.cpp's converter does."""
    import numpy as np

    if data.ndim <= 1:
        writer.add_tensor(name, data.astype(np.float32))
        return
    qtype = {"f16": None, "bf16": gguf.GGMLQuantizationType.BF16, "q8_0": gguf.GGMLQuantizationType.Q8_0}[gguf_type]
    if qtype is not None:
        try:
            writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
            return
        except gguf.quants.QuantError:
            pass
    writer.add_tensor(name, data.astype(np.float16))
