"""Fixed-shape text generation with a key/value cache: one prefill graph and one decode graph, on any device.

    prompt = left_pad(token_lists, width=64, pad=tokenizer.pad_token_id)              # (B, 64) ids and mask
    out = generate_ids(model, prompt.ids.to(dev), prompt.mask.to(dev), max_new_tokens=128,
                       eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                       sampling=Sampling(temperature=0.8, top_p=0.95), seed=key)
    out.ids, out.logprobs, out.mask                                                     # (B, 128) each

On XLA and CUDA the backend that owns the model's device syncs, replays the prompt pass and runs the decode steps as
one device loop (`tpu_helpers.backend.generation_hooks`); `sync=`, `replay=` and `loop=` override it, False turns
one off. Decoder-only models whose layers all attend through a key/value cache are served (`SERVED`); anything
else is a ConfigError (`check_generation_support`). How the shapes stay fixed, the cache and the masks:
docs/guides/generation.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from tpu_helpers.config import ConfigError
from tpu_helpers.core.choices import check_positive
from tpu_helpers.models.decode import (  # noqa: F401  (Generated re-exported: what generate_ids returns)
    Generated,
    autocast_dtype,
    choose_hooks,
    decode_steps,
    eos_tensor,
    hybrid_masks,
    make_cache,
    prefill,
    sliding_window,
    text_config,
)
from tpu_helpers.models.lm_head import mask_positions
from tpu_helpers.models.replay import kept_cache, release_caches, replayed_prefill  # noqa: F401  (re-exported)
from tpu_helpers.models.sampling import GREEDY, Sampling, exponentials, pick  # noqa: F401  (re-exported)


@dataclass
class Prompts:
    """Left-padded prompt ids and their attention mask, (batch, width) int64 each, on the CPU."""

    ids: torch.Tensor
    mask: torch.Tensor


def left_pad(token_lists: Sequence[Sequence[int]], width: int, pad: int) -> Prompts:
    """Each prompt's last `width` tokens, right-aligned in a row of `width` (padding on the left)."""
    ids = torch.full((len(token_lists), width), pad, dtype=torch.long)
    mask = torch.zeros((len(token_lists), width), dtype=torch.long)
    for i, tokens in enumerate(token_lists):
        tokens = list(tokens)[-width:]
        if tokens:
            ids[i, width - len(tokens):] = torch.tensor(tokens, dtype=torch.long)
            mask[i, width - len(tokens):] = 1
    return Prompts(ids, mask)

# What the cache and the masks here serve: every layer attends over a key/value cache, to everything before it or
# to the last `sliding_window` positions (docs/guides/generation.md); a few families of each kind, each checked
# against transformers' own `generate` (tests/models/test_families.py).
ATTENTION_TYPES = ("full_attention", "sliding_attention")
SERVED = "llama, qwen2, qwen3, gemma2, gemma3_text, mistral, phi3"


def unserved_reason(model: torch.nn.Module) -> str | None:
    """Why the cached generation cannot serve `model` (see `check_generation_support`), or None when it can."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # a PEFT wrapper: its model
    if getattr(model.config, "is_encoder_decoder", False):
        return "is an encoder-decoder"
    if getattr(base, "_is_stateful", False):  # transformers' mark of Mamba, RWKV, Jamba, Qwen3-Next, ...
        return "keeps a recurrent state, not a key/value cache"
    other = sorted({t for t in getattr(text_config(model), "layer_types", None) or () if t not in ATTENTION_TYPES})
    if other:
        return f"has layers of type {other}"
    return None


def check_generation_support(model: torch.nn.Module) -> None:
    """A ConfigError naming the model's class and model_type when the cached generation cannot serve it: an
    encoder-decoder, a recurrent state (Mamba, RWKV), layers that are not full or sliding-window attention
    (Llama 4's chunked attention, LFM2's convolutions). Run anyway, such a model fails deep inside transformers
    (the StaticLayer cache here has no convolution state) or, worse, answers with other tokens than transformers
    does (a chunked or recurrent layer run as plain causal attention)."""
    why = unserved_reason(model)
    if why is not None:
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        model_type = getattr(model.config, "model_type", None) or "?"
        raise ConfigError(f"{type(base).__name__} (model_type {model_type!r}) {why}: the cached generation "
                          "(models/generation.py) serves decoder-only models whose layers all attend through a "
                          f"key/value cache, full or sliding-window (e.g. {SERVED})")


# ---- generation -----------------------------------------------------------------------------------------------------
@torch.no_grad()
def generate_ids(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, *,
                 max_new_tokens: int, eos_token_id: int | Sequence[int] | None, pad_token_id: int,
                 sampling: Sampling = GREEDY, seed: int | torch.Tensor = 0,
                 sync: Callable[[], None] | bool | None = None, cache_len: int | None = None,
                 mask_dtype: torch.dtype | None = None, replay: Callable[[Callable], Callable] | bool | None = None,
                 loop: Callable | bool | None = None, num_return_sequences: int = 1) -> Generated:
    """Complete left-padded prompts (`input_ids`, `attention_mask`: (B, P) on the model's device) by
    `max_new_tokens` tokens with a KV cache (docs/guides/generation.md).

    `num_return_sequences`: completions per prompt, as in transformers' `generate` (rows i * n to i * n + n - 1 of
    the outputs complete prompt i), but the prompt's pass runs once per prompt, not once per completion: a GRPO
    group's prompt costs the prefill of one row. The tokens are those of the prompts repeated n times.

    `seed`: an int, or an int64 device tensor (e.g. [run seed, step]) so that a new stream per call compiles
    nothing new. `cache_len` (default P + max_new_tokens) sets the cache's slots and the outputs' width, cache_len - P:
    a larger one lets calls with other `max_new_tokens` reuse the same two graphs (the columns past
    `max_new_tokens` stay padding with mask 0).

    `sync`, `replay` and `loop` default (None) to those of the backend that owns the device
    (`tpu_helpers.backend.generation_hooks`: a backend's `sync`, `compile_step` and `compile_loop`); a callable
    given wins, False turns one off (the CPU has none). `sync` cuts the graph after the prefill and after each
    stepped decode step (XLA). `replay` captures the prompt pass and the decode step once per shape and sampling
    and replays them instead of re-running the model's Python (XLA; eager backends capture nothing). `loop` runs the
    decode steps as one device program built once per shape, so the host's work per call is the same for 8 tokens
    or 512: a `While` op on XLA, a CUDA graph replayed once per token on one GPU; a step that cannot be looped is
    replayed (or traced) step by step, with one warning. The same ops, so the same tokens. With `replay` or `loop`
    the cache of each shape is kept with the model between calls (`release_caches`), so later calls capture
    nothing; weights updated in place between calls (a training step) are read afresh by each call."""
    check_positive("max_new_tokens", max_new_tokens)
    check_positive("num_return_sequences", num_return_sequences)
    check_generation_support(model)
    if input_ids.shape != attention_mask.shape or input_ids.dim() != 2:
        raise ValueError(f"input_ids {tuple(input_ids.shape)} and attention_mask {tuple(attention_mask.shape)} "
                         "must be the same (batch, width)")
    sync, replay, loop = choose_hooks(model, input_ids.device, sync, replay, loop)
    device = input_ids.device
    width = input_ids.shape[1]
    batch = input_ids.shape[0] * num_return_sequences
    total = width + max_new_tokens if cache_len is None else cache_len
    if total < width + max_new_tokens:
        raise ConfigError(f"cache_len={cache_len!r} is less than the prompt width {width} + max_new_tokens "
                          f"{max_new_tokens}")
    room = total - width  # the outputs' columns
    dtype = mask_dtype or next(model.parameters()).dtype
    if not dtype.is_floating_point:
        dtype = torch.float32
    window, hybrid = sliding_window(model), hybrid_masks(model)
    seed_t = seed.to(device=device, dtype=torch.long) if isinstance(seed, torch.Tensor) else \
        torch.tensor([int(seed)], dtype=torch.long).to(device)
    eos = eos_tensor(eos_token_id, device)
    was_training = model.training
    model.eval()
    try:
        # Kept between calls where replayed or looped (a capture's guards check its objects, a CUDA graph its
        # addresses), by the decode's shapes alone: calls with and without a shared prompt pass use one cache.
        cache = make_cache(model, total, batch) if replay is None and loop is None else \
            kept_cache(model, (batch, total, dtype, autocast_dtype(device)), lambda: make_cache(model, total, batch))
        args = (width, window, hybrid, dtype, sampling, pad_token_id)
        st, fixed = replayed_prefill(replay, prefill, model, cache, (input_ids, attention_mask, eos, seed_t), room,
                                     args, sync)
        sync()
        st = decode_steps(model, cache, st, fixed, max_new_tokens - 1, args, sync, replay, loop)
    finally:
        model.train(was_training)
    return Generated(st[2], st[3], st[4])


@torch.no_grad()
def generate_ids_uncached(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, *,
                          max_new_tokens: int, sync: Callable[[], None] | None = None) -> torch.Tensor:
    """The reference greedy loop without a cache: every token runs the whole (B, P + N) buffer through the model
    again. Fixed shapes too (one graph on XLA), but each token costs the
    whole prefix; kept for tests (the cached output must equal it) and benchmarks/generation.py."""
    device = input_ids.device
    batch, width = input_ids.shape
    total = width + max_new_tokens
    was_training = model.training
    model.eval()
    try:
        ids = torch.cat([input_ids, torch.zeros((batch, max_new_tokens), dtype=torch.long, device=device)], 1)
        mask = torch.cat([attention_mask.long(), torch.zeros((batch, max_new_tokens), dtype=torch.long,
                                                             device=device)], 1)
        cols = torch.arange(total, device=device)
        pos = torch.full((1,), width, dtype=torch.long).to(device)  # data, not a constant: one graph for all steps
        for _ in range(max_new_tokens):
            position_ids = mask_positions(mask)
            logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids).logits
            nxt = logits.index_select(1, pos - 1).squeeze(1).argmax(-1)
            here = (cols == pos).unsqueeze(0)
            ids = torch.where(here, nxt.unsqueeze(1), ids)
            mask = torch.where(here, torch.ones_like(mask), mask)
            pos = pos + 1
            if sync is not None:
                sync()
    finally:
        model.train(was_training)
    return ids[:, width:]
