"""The decode primitives that fixed-shape generation is built of: the key/value cache, the masks, one prompt pass
and one decode step, each reading nothing but its arguments so that it replays (XLA) or loops (a device loop).

    cache = make_cache(model, length=P + N, rows=B)                      # full-length static layers
    st, fixed = prefill(model, cache, (ids, mask, eos_tensor(stops, dev), seed), N, args...)   # the first token
    st = decode_steps(model, cache, st, fixed, N - 1, args, sync, replay, loop)                # the rest

`generation.generate_ids` (one answer per prompt) and `turns.Turns` (an episode's turns in one cache) both build on
these; neither reaches into the other. `st` is the decode's state, advanced by each step (the last token, the
outputs' column, the outputs, which rows are done); `fixed` the tensors every step of a call shares (the slots, which
hold a token, their positions, the outputs' columns, the stop tokens, the seed). `hooks` picks the sync, replay and
loop of the backend that owns the device. How the shapes stay fixed, the cache and the masks:
docs/guides/generation.md.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tpu_helpers.backend import generation_hooks
from tpu_helpers.backend.base import no_sync
from tpu_helpers.config import ConfigError
from tpu_helpers.models.lm_head import cache_argument, mask_positions
from tpu_helpers.models.replay import lazy_steps, looped_steps, replayed_steps
from tpu_helpers.models.sampling import Sampling, pick


@dataclass
class Generated:
    """Completions of a batch: token ids (padding after EOS), their log-probabilities (0 where masked) and the
    completion mask (1 up to and including the EOS token), each (batch, max_new_tokens) (or (batch, cache_len - P)
    with a longer `cache_len`), on the model's device."""

    ids: torch.Tensor
    logprobs: torch.Tensor
    mask: torch.Tensor


# ---- the cache and the masks --------------------------------------------------------------------------------------
def num_layers(model: torch.nn.Module) -> int:
    config = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    return int(config.num_hidden_layers)


def make_cache(model: torch.nn.Module, length: int, rows: int | None = None) -> Any:
    """A transformers `Cache` of full-length `StaticLayer`s, allocated on first write: a sliding window is a mask
    here, never a rolling buffer (docs/guides/generation.md says why). With `rows` (the decode's batch) a first
    write (the prompt pass) of fewer rows, one per prompt, fills `rows // its rows` rows with each (see
    `_static_layer`); without, the first write's rows are the cache's."""
    from transformers.cache_utils import Cache

    layer = _static_layer()
    return Cache(layers=[layer(max_cache_len=length, rows=rows) for _ in range(num_layers(model))])


@functools.cache
def _static_layer() -> type:
    """transformers' `StaticLayer` with its values kept in their own dtype. Under bf16 autocast an fp32 model's
    keys come out of the rotary embedding in fp32 (its cos and sin are fp32) and its values in bf16; transformers
    up to 5.17 (Colab ships 5.15) allocates both in the keys' dtype, and the first write of the values fails
    ("index_copy_(): self and source expected to have the same dtype"). Later releases do what this does."""
    from transformers.cache_utils import StaticLayer

    class Layer(StaticLayer):
        """`rows` rows, which a write of fewer fills in equal runs: a prompt shared by a group (GRPO's samples of
        one prompt) runs its pass once, and the cache gives each of the group's rows its own copy of the prompt's
        keys and values, which the decode steps then extend row by row. That write returns only the keys and
        values it was given, all there is before it, so the pass attends over the prompt's slots alone."""

        def __init__(self, max_cache_len: int, rows: int | None = None, **kwargs):
            super().__init__(max_cache_len=max_cache_len, **kwargs)
            self.rows = rows

        def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
            rows = self.rows or key_states.shape[0]  # the shapes are all it reads: views, nothing copied
            super().lazy_initialization(key_states[:1].expand(rows, -1, -1, -1),
                                        value_states[:1].expand(rows, -1, -1, -1))
            if self.values.dtype != value_states.dtype:
                self.values = torch.zeros_like(self.values, dtype=value_states.dtype)
                if not torch.compiler.is_compiling():
                    torch._dynamo.mark_static_address(self.values)  # as transformers marks its own

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> tuple:
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            if key_states.shape[0] == self.keys.shape[0]:
                return super().update(key_states, value_states, *args, **kwargs)
            repeats = rows_per_prompt(self.keys.shape[0], key_states.shape[0])
            written = torch.arange(key_states.shape[-2], device=self.keys.device) + self.cumulative_length
            self.cumulative_length.add_(key_states.shape[-2])
            self.keys.index_copy_(2, written, key_states.repeat_interleave(repeats, 0))
            self.values.index_copy_(2, written, value_states.repeat_interleave(repeats, 0))
            return key_states, value_states

    return Layer


def rows_per_prompt(rows: int, prompts: int) -> int:
    """How many of a cache's `rows` each of `prompts` prompt rows fills (rows i * n to i * n + n - 1)."""
    if rows % prompts:
        raise ValueError(f"a cache of {rows} rows cannot hold {prompts} prompts' rows in equal runs")
    return rows // prompts


def text_config(model: torch.nn.Module) -> Any:
    return model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config


def sliding_window(model: torch.nn.Module) -> int | None:
    """The window of the model's sliding-attention layers, when it has any, whatever the config's style: with
    `layer_types` (Gemma 2/3, Qwen2/3) those listed "sliding_attention"; without (Mistral) every layer when
    `sliding_window` is set, as HF's forward applies it. `use_sliding_window` False (Qwen2's switch) means none."""
    config = text_config(model)
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return None
    types = getattr(config, "layer_types", None)
    return None if types is not None and "sliding_attention" not in types else int(window)


def hybrid_masks(model: torch.nn.Module) -> bool:
    """Whether the model takes one mask per attention type ({"full_attention", "sliding_attention"}): it lists
    `layer_types`. Without them every layer is windowed and takes the one (windowed) mask."""
    return getattr(text_config(model), "layer_types", None) is not None


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    zero = torch.zeros((), dtype=dtype, device=allowed.device)
    return torch.where(allowed, zero, torch.full_like(zero, torch.finfo(dtype).min)).unsqueeze(1)


def masks(allowed: torch.Tensor, distance: torch.Tensor, window: int | None, dtype: torch.dtype,
          hybrid: bool = True) -> Any:
    """The 4D mask(s) the model takes: one tensor (windowed when every layer slides, e.g. Mistral), or
    {"full_attention", "sliding_attention"} for models with layer_types."""
    if window is None:
        return _additive(allowed, dtype)
    sliding = _additive(allowed & (distance < window), dtype)
    return {"full_attention": _additive(allowed, dtype), "sliding_attention": sliding} if hybrid else sliding


def forward(model, ids, mask, positions, cache, keep_last: bool):
    kwargs: dict[str, Any] = {"logits_to_keep": 1} if keep_last else {}
    kwargs[cache_argument(model)] = cache
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, **kwargs)
    return out.logits[:, -1]


def eos_tensor(eos_token_id: int | Sequence[int] | None, device: Any) -> torch.Tensor:
    ids = [] if eos_token_id is None else [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    return torch.tensor(ids or [-1], dtype=torch.long).to(device)


# The decode step's arguments besides the model and the cache, as tuples (passed, never captured, so that a step
# captured once by `replay` is replayed by every later call of the same shapes):
# st = (token (B,), step (1,) int64: the outputs' column and the sampling counter, out_ids, out_logp, out_mask,
#       done (B,) bool: the row produced EOS), advanced by each step;
# fixed = (slots, valid, slot_pos, cols, eos, seed), the same for every step of a call.
def record(logits: torch.Tensor, st: tuple, fixed: tuple, sampling: Sampling, pad: int) -> tuple:
    """Pick the next token from `logits` and write it into the outputs' column `step`; the new state."""
    _, step, out_ids, out_logp, out_mask, done = st
    _, _, _, cols, eos, seed = fixed
    token, logp = pick(logits, sampling, None if sampling.greedy else (seed, step))
    live = ~done
    token = torch.where(live, token, torch.full_like(token, pad))
    here = (cols == step).unsqueeze(0)
    out_ids = torch.where(here, token.unsqueeze(1), out_ids)
    out_logp = torch.where(here & live.unsqueeze(1), logp.unsqueeze(1), out_logp)
    out_mask = torch.where(here, live.long().unsqueeze(1), out_mask)
    done = done | (token.unsqueeze(1) == eos.unsqueeze(0)).any(-1)
    return token, step + 1, out_ids, out_logp, out_mask, done


def decode_step(model: torch.nn.Module, cache: Any, st: tuple, fixed: tuple, width: int, window: int | None,
            hybrid: bool, dtype: torch.dtype, sampling: Sampling, pad: int,
            rows: torch.Tensor | None = None) -> tuple:
    """One decode step: the previous token goes in at its slot, the next one comes out. Everything it reads is an
    argument (tensors in `st` and `fixed`, Python values that are the same for every step of a call). `rows` (the
    CPU's, `_live_steps`): only those rows go through the model, `cache` holding theirs (`rows_of`)."""
    token, step = st[0], st[1]
    slots, valid, slot_pos = fixed[:3]
    if rows is not None:
        token, valid, slot_pos = token[rows], valid[rows], slot_pos[rows]
    slot = width + step - 1  # the previous token's slot
    allowed = ((slots <= slot) & valid).unsqueeze(1)
    pos = slot_pos.gather(1, slot.expand(token.shape[0], 1))
    distance = pos.unsqueeze(-1) - slot_pos.unsqueeze(1)
    logits = forward(model, token.unsqueeze(1), masks(allowed, distance, window, dtype, hybrid), pos, cache,
                      keep_last=False)
    return record(every_row(logits, rows, st[0].shape[0]), st, fixed, sampling, pad)


def every_row(logits: torch.Tensor, rows: torch.Tensor | None, batch: int) -> torch.Tensor:
    """`rows`' logits in a (batch, vocab) tensor, zeros elsewhere: the other rows are done, so `record` writes
    padding for them, and it draws every row's noise as the whole batch does (the same tokens)."""
    if rows is None:
        return logits
    return logits.new_zeros((batch, logits.shape[-1])).index_copy_(0, rows, logits)


def rows_of(cache: Any, rows: torch.Tensor) -> Any:
    """A cache holding copies of `rows` of `cache` (the CPU's live rows); `put_rows` writes them back."""
    part = copy.copy(cache)
    part.layers = []
    for layer in cache.layers:
        sub = copy.copy(layer)
        sub.keys, sub.values = layer.keys.index_select(0, rows), layer.values.index_select(0, rows)
        sub.cumulative_length = layer.cumulative_length.clone()
        sub.batch_size = rows.numel()
        part.layers.append(sub)
    return part


def put_rows(cache: Any, part: Any, rows: torch.Tensor) -> None:
    """Write `part` (`rows_of(cache, rows)`, advanced since) back into `cache`'s rows."""
    for layer, sub in zip(cache.layers, part.layers, strict=True):
        layer.keys.index_copy_(0, rows, sub.keys)
        layer.values.index_copy_(0, rows, sub.values)
        layer.cumulative_length.copy_(sub.cumulative_length)


def prefill(model: torch.nn.Module, cache: Any, tensors: tuple, room: int, width: int, window: int | None,
             hybrid: bool, dtype: torch.dtype, sampling: Sampling, pad: int) -> tuple:
    """The prompt's pass through the model, filling the cache, and the first new token: the decode's starting
    state `st` and its `fixed` tensors. Like `decode_step`, it reads nothing but its arguments (so it replays too).
    With a cache of several rows per prompt the pass runs once per prompt, and `st` and `fixed` hold every row."""
    input_ids, attention_mask, eos, seed = tensors
    device = input_ids.device
    repeats = rows_per_prompt(cache.layers[0].rows or input_ids.shape[0], input_ids.shape[0])  # rows per prompt
    total = width + room
    prompt_mask = attention_mask.to(torch.long)
    # Slots: the prompt's P, then one per new token; a slot holds a token when its prompt mask is 1 or it is a
    # generated slot already written (the causal condition below).
    valid = torch.cat([prompt_mask.bool(), torch.ones((prompt_mask.shape[0], room), dtype=torch.bool,
                                                      device=device)], 1)
    slot_pos = torch.cat([mask_positions(prompt_mask),
                          prompt_mask.sum(-1, keepdim=True) + torch.arange(room, device=device)], 1)
    seen = width if repeats > 1 else total  # a shared prompt's pass gets back its own keys only (`_static_layer`)
    slots = torch.arange(total, device=device)
    q = torch.arange(width, device=device)
    # Query i sees slots j <= i that hold a token (a padding query sees itself, so no row is empty).
    allowed = ((slots[None, :seen] <= q[:, None]) & valid[:, None, :seen]) | (slots[None, :seen] == q[:, None])
    distance = slot_pos[:, :width, None] - slot_pos[:, None, :seen]
    logits = forward(model, input_ids, masks(allowed, distance, window, dtype, hybrid), slot_pos[:, :width], cache,
                      keep_last=True)
    if repeats > 1:
        logits, valid, slot_pos = (t.repeat_interleave(repeats, 0) for t in (logits, valid, slot_pos))
    batch = valid.shape[0]
    fixed = (slots, valid, slot_pos, torch.arange(room, device=device), eos, seed)
    st = (None, torch.zeros((1,), dtype=torch.long, device=device),  # after the sync, data: one decode graph
          torch.full((batch, room), pad, dtype=torch.long, device=device),
          torch.zeros((batch, room), dtype=torch.float32, device=device),
          torch.zeros((batch, room), dtype=torch.long, device=device),
          torch.zeros((batch,), dtype=torch.bool, device=device))
    return record(logits, st, fixed, sampling, pad), fixed


def choose_hooks(model: torch.nn.Module, device: torch.device, sync: Any, replay: Any, loop: Any) -> tuple:
    """`sync` (never None), `replay` and `loop` (None for none): each as given, False for none, None for the one the
    backend owning `device` gives (`generation_hooks`; asked only where one is left to None)."""
    for name, value in (("sync", sync), ("replay", replay), ("loop", loop)):
        if not (value is None or value is False or callable(value)):
            raise ConfigError(f"{name}={value!r} must be a callable (the backend's {_HOOK_NAMES[name]}), None (the "
                              "one of the backend that owns the model's device) or False (none)")
    given = generation_hooks(device, model.parameters()) if any(v is None for v in (sync, replay, loop)) else None

    def chosen(value: Any, name: str) -> Any:
        if value is None:
            return getattr(given, _HOOK_NAMES[name]) if given is not None else None
        return None if value is False else value

    return chosen(sync, "sync") or no_sync, chosen(replay, "replay"), chosen(loop, "loop")


_HOOK_NAMES = {"sync": "sync", "replay": "compile_step", "loop": "compile_loop"}


def autocast_dtype(device: torch.device) -> torch.dtype | None:
    """The autocast dtype in force on `device` (the cache's keys take it), None without autocast."""
    return torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None


def decode_steps(model: torch.nn.Module, cache: Any, st: tuple, fixed: tuple, steps: int, args: tuple,
                 sync: Callable[[], None], replay: Callable | None, loop: Callable | None) -> tuple:
    """`steps` decode steps after a prompt pass (or a turn's pass, models/turns.py): one device loop where `loop`
    builds one, else replayed or traced step by step. On the CPU the steps run the live rows only and stop once no
    row needs one (`_live_steps`): the columns left keep their padding and mask 0, as the steps would write."""
    if steps < 1:
        return st
    looped = looped_steps(loop, decode_step, model, cache, st, fixed, steps, args) if loop is not None else None
    if looped is not None:
        sync()  # the loop's outputs become device data: each read of them would otherwise run it again
        return looped
    if st[5].device.type == "cpu":  # an eager backend's replay runs the step as it is: the CPU's own steps instead
        return _live_steps(model, cache, st, fixed, steps, args)
    if replay is None:
        return lazy_steps(decode_step, model, cache, st, fixed, steps, sync, args)
    return replayed_steps(replay, decode_step, model, cache, st, fixed, steps, sync, args)


def _live_steps(model: torch.nn.Module, cache: Any, st: tuple, fixed: tuple, steps: int, args: tuple) -> tuple:
    """The CPU's decode steps, where reading a tensor costs no transfer and shapes cost no compile. A step runs the
    rows whose input token is their own (`st[4]`'s mask at the previous column: a row that just produced its EOS
    still writes that token's keys and values, which its next turn attends to); once half the rows a step runs
    need it no longer, the later steps run the others only (their cache rows copied out, written back when the set
    changes and at the end), and once no row needs one the steps stop. Every row's token is drawn as the whole
    batch's would be (`every_row`), so the tokens are the same."""
    batch = st[5].shape[0]
    rows, part = None, cache
    with grouped_decode_attention(model):
        for _ in range(steps):
            live = st[4].index_select(1, st[1] - 1).squeeze(1).nonzero().squeeze(1)
            if live.numel() == 0:
                break
            if live.numel() <= (batch if rows is None else rows.numel()) // 2:
                if rows is not None:
                    put_rows(cache, part, rows)
                rows, part = live, rows_of(cache, live)
            st = decode_step(model, part, st, fixed, *args, rows=rows)
    if rows is not None:
        put_rows(cache, part, rows)
    return st


# ---- grouped-query attention for one query position (the CPU's decode steps) ------------------------------------
GROUPED = "tpu_helpers_grouped_decode"


def grouped_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                      softcap: float | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Eager attention for one query position over a cache with fewer key/value heads than query heads: the query
    heads are grouped by their key/value head, (B, kv heads, group, D), so the cache is read as it is. The eager
    attention of every family copies the whole cache `num_key_value_groups` times at every decode step
    (`repeat_kv`): 3x SmolLM2's keys and values, per layer and token. The same products, sums and soft-capping;
    anything else (a longer query, no groups, dropout in training, attention sinks) runs the family's own eager."""
    groups = getattr(module, "num_key_value_groups", 1)
    if query.shape[2] != 1 or groups == 1 or (dropout and module.training) or \
            any(kwargs.get(k) is not None for k in ("sinks", "s_aux", "position_bias")):
        eager = sys.modules[type(module).__module__].eager_attention_forward
        extra = {"softcap": softcap} if softcap is not None else {}
        return eager(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **extra, **kwargs)
    b, heads, _, dim = query.shape
    grouped = query.reshape(b, key.shape[1], groups, dim)
    scores = torch.matmul(grouped, key.transpose(2, 3)) * (dim ** -0.5 if scaling is None else scaling)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if attention_mask is not None:
        scores = scores + attention_mask[:, :, :, :key.shape[-2]]  # (B, 1, 1, T): the same for every head
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    out = torch.matmul(probs, value)  # (B, kv heads, group, Dv)
    return out.reshape(b, heads, 1, value.shape[-1]).transpose(1, 2).contiguous(), None


@functools.cache
def _registered() -> str:
    from transformers import AttentionInterface

    AttentionInterface.register(GROUPED, grouped_attention)
    return GROUPED


@contextlib.contextmanager
def grouped_decode_attention(model: torch.nn.Module):
    """Within it, the layers of `model` that attend eagerly with grouped key/value heads use `grouped_attention`
    (their configs' attention implementation, set back after). For the CPU's eager decode steps only: a replayed or
    looped step keeps the implementation it was captured with."""
    configs = {id(m.config): m.config for m in model.modules()
               if getattr(m, "num_key_value_groups", 1) > 1 and getattr(getattr(m, "config", None),
                                                                     "_attn_implementation", None) == "eager"}
    name = _registered() if configs else None
    for config in configs.values():
        config._attn_implementation = name
    try:
        yield
    finally:
        for config in configs.values():
            config._attn_implementation = "eager"
