"""Fixed-shape text generation with a key/value cache: one prefill graph and one decode graph, on any device.

    prompt = left_pad(token_lists, width=64, pad=tokenizer.pad_token_id)              # (B, 64) ids and mask
    out = generate_ids(model, prompt.ids.to(dev), prompt.mask.to(dev), max_new_tokens=128,
                       eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                       sampling=Sampling(temperature=0.8, top_p=0.95), seed=key, sync=backend.sync)
    out.ids, out.logprobs, out.mask                                                     # (B, 128) each

What stays fixed, so that XLA compiles two graphs whatever the prompts, the number of new tokens or the step:
- shapes: prompts left-padded to one width P, a cache of P + N slots per sequence, outputs of N columns; a row
  that produced EOS keeps running on padding with its mask at 0 (stop by masking, never by shrinking);
- the position is device data: the decode step's slot, its column in the outputs and the sampling counter are
  tensors advanced on the device, never Python ints baked into the graph (`sync` cuts each step, so every decode
  step is the same graph: the first call compiles prefill and decode, later calls and longer outputs compile
  nothing);
- the attention mask is built here (additive, (B, 1, q, P + N)) and handed to the model as a 4D mask, which
  transformers uses as given: its own mask code would read the padding mask on the host (SDPA's is_causal
  check) and size masks from Python ints.

The cache is transformers' own `StaticLayer` (the layer of `StaticCache`): per layer, keys and values of shape
(batch, kv_heads, P + N, head_dim), i.e. (batch, layers, P + N, kv_heads, head_dim) for the model, preallocated at
the prefill and written in place with `index_copy_` at a position that is a device tensor (`cumulative_length`).
That runs with one decode graph on XLA. `StaticCache` itself is not used as a whole: for sliding-window layers
(Gemma 2/3, Qwen2 with use_sliding_window, Mistral) it builds `StaticSlidingWindowLayer`, a rolling buffer driven by a
Python int (`cumulative_length_int`) that takes another code path once the window is full (a new graph) and whose
slots do not line up with a left-padded batch. Here every layer gets a full-length `StaticLayer` and a sliding
window is a mask (the same attention, more cache memory for those layers): per layer type where the config lists
`layer_types`, on every layer where it only sets `sliding_window` (Mistral), none where `use_sliding_window` is
False.

What this serves: decoder-only models whose every layer attends through a key/value cache, to everything before it
or within a sliding window (Llama 3, Qwen2/2.5, Qwen3, Gemma 2/3, Mistral, Phi-3: tests/models/test_families.py
checks each against transformers' own `generate`). Anything else, an encoder-decoder, a recurrent state (Mamba,
RWKV), Llama 4's chunked attention, LFM2's convolutions, is a ConfigError naming its model_type
(`check_generation_support`), not a failure deep in transformers or, worse, other tokens than transformers gives.

Sampling: temperature, top-k and top-p, by an exponential race (Gumbel-max): the token with the largest p / E,
E ~ Exp(1) one per token, drawn from a counter-based hash of (seed, step, row, token id) computed on the device in
int64 arithmetic. Each token wins with its own probability, exact to float32 rounding however large the vocabulary
(an inverse CDF over a float32 cumulative sum of 150k probabilities cannot draw tokens below ~3e-8 once the sum
nears 1). It neither syncs nor recompiles, hashes the same bits on the CPU, CUDA and XLA (the same tokens but
for float32 ties), and needs no generator state: the stream is a function of the `seed` tensor, so a resumed run that passes the same seed samples the same
answers. (torch 2.9 + torch_xla 2.9 have no `torch.Generator` on the XLA device: "XLA device type not an
accelerator"; the device's global RNG does not recompile but is shared with dropout and advanced by every other
random op.)
`logprobs` are the log-probabilities of the chosen tokens under softmax(logits / temperature) (temperature 1 when
greedy), before top-k/top-p truncation: what a training forward pass over the same tokens computes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tpu_helpers.config import ConfigError

_M32 = 0xFFFFFFFF
# Multipliers below 2**31: a 32-bit value times one stays below 2**63, so int64 arithmetic never overflows and the
# hash is the same on every device.
_MUL = (0x7FEB352D, 0x5BD1E995, 0x2C1B3C6D, 0x297A2D39)


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen: temperature 0 is greedy (argmax); top_k 0 and top_p 1.0 turn those off."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not (isinstance(self.temperature, (int, float)) and self.temperature >= 0):
            raise ConfigError(f"TEMPERATURE={self.temperature!r} must be >= 0 (0 is greedy)")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ConfigError(f"TOP_K={self.top_k!r} must be an integer >= 0 (0 keeps every token)")
        if not (isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0):
            raise ConfigError(f"TOP_P={self.top_p!r} must be in (0, 1] (1.0 keeps every token)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


GREEDY = Sampling()


@dataclass
class Generated:
    """Completions of a batch: token ids (padding after EOS), their log-probabilities (0 where masked) and the
    completion mask (1 up to and including the EOS token), each (batch, max_new_tokens) (or (batch, cache_len - P)
    with a longer `cache_len`), on the model's device."""

    ids: torch.Tensor
    logprobs: torch.Tensor
    mask: torch.Tensor


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


# ---- random numbers from a counter (no generator state) ------------------------------------------------------------
def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (xor-shift-multiply) on int64 tensors holding values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = (x * _MUL[0]) & _M32
    x = x ^ (x >> 15)
    x = (x * _MUL[1]) & _M32
    return x ^ (x >> 16)


def _key_hash(seed: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """One 32-bit value (an int64 scalar) from `seed` (int64, any shape: its entries are all mixed in) and `step`."""
    h = torch.zeros((), dtype=torch.long, device=seed.device)
    for k, part in enumerate([*seed.reshape(-1).unbind(0), step.reshape(())]):
        h = _mix((h * _MUL[2 + k % 2] + (part & _M32) + k) & _M32)
    return h


def exponentials(seed: torch.Tensor, step: torch.Tensor, tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    """Exp(1) draws (float32) shaped like `tokens` ((rows, n) token ids), one per (seed, step, row, token id): the
    noise of the exponential race in `pick`. Each is -log(1 - v) of a v in (0, 1) with float32's relative
    precision down to 2**-56 (32 hashed bits, then 24 more from a second mix below the lowest): a token of
    probability p wins when its draw is below ~p times the winner's ratio, so tiny draws must keep their
    resolution (a 24-bit uniform stops at 6e-8). The largest draw is 16.6 (v <= 1 - 2**-24): a cut that changes a
    winner with a chance below 6e-8. Integer arithmetic up to the float conversion: the same bits on every device."""
    h = _key_hash(seed, step)
    row = torch.arange(tokens.shape[0], device=tokens.device, dtype=torch.long).unsqueeze(-1)
    cell = (row * vocab + tokens.long()) & _M32
    hi = _mix(_mix((h + cell * _MUL[3]) & _M32) ^ ((cell + 1) & _M32))
    lo = _mix(hi ^ _MUL[2]) >> 8  # fills in below hi's last bit (a function of hi: the marginal stays uniform)
    v = hi.float() * (2.0 ** -32) + (lo.float() + 0.5) * (2.0 ** -56)
    return -torch.log1p(-v.clamp(max=1.0 - 2.0 ** -24))


def _race(logp: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The exponential race (Gumbel-max): the argmax of p / E, E ~ Exp(1) per entry, is entry i with probability
    p_i / sum(p), each entry on its own: no cumulative sum, whose float32 rounding near 1 (spacing 6e-8) could
    leave tokens below ~3e-8 of a 150k vocabulary undrawable. Entries with logp -inf never win."""
    return (logp - noise.log()).argmax(-1)


def pick(logits: torch.Tensor, sampling: Sampling, key: tuple[torch.Tensor, torch.Tensor] | None
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """(token, log-probability) per row from (rows, vocab) logits; `key`: (seed, step) device tensors when
    sampling (the noise is a function of them, the row and the token id: see `exponentials`)."""
    logits = logits.float()
    if sampling.greedy:
        token = logits.argmax(-1)
        return token, torch.log_softmax(logits, -1).gather(-1, token.unsqueeze(-1)).squeeze(-1)
    if key is None:
        raise ValueError(f"sampling {sampling} needs a key (seed, step); only greedy picks without one")
    seed, step = key
    vocab = logits.shape[-1]
    scaled = logits / sampling.temperature
    logp = torch.log_softmax(scaled, -1)
    if sampling.top_k or sampling.top_p < 1.0:
        k = min(sampling.top_k or vocab, vocab)
        # topk returns the k best sorted (all of them when only top_p is set): truncate, then race among those.
        vals, idx = scaled.topk(k, dim=-1)
        kept = torch.log_softmax(vals, -1)
        if sampling.top_p < 1.0:
            # Keep the smallest prefix whose mass reaches top_p (the best token always stays); the rest get -inf.
            probs = kept.exp()
            before = probs.cumsum(-1) - probs
            kept = torch.where(before < sampling.top_p, kept, torch.full_like(kept, float("-inf")))
        choice = _race(kept, exponentials(seed, step, idx, vocab))  # each token's noise keyed on its id
        token = idx.gather(-1, choice.unsqueeze(-1)).squeeze(-1)
    else:
        ids = torch.arange(vocab, device=logits.device).expand(logits.shape[0], vocab)
        token = _race(logp, exponentials(seed, step, ids, vocab))
    return token, logp.gather(-1, token.unsqueeze(-1)).squeeze(-1)


# ---- the cache and the masks --------------------------------------------------------------------------------------
def _num_layers(model: torch.nn.Module) -> int:
    config = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    return int(config.num_hidden_layers)


def make_cache(model: torch.nn.Module, length: int) -> Any:
    """A transformers `Cache` of full-length `StaticLayer`s (see the module docstring), allocated on first write."""
    from transformers.cache_utils import Cache, StaticLayer

    return Cache(layers=[StaticLayer(max_cache_len=length) for _ in range(_num_layers(model))])


def _text_config(model: torch.nn.Module) -> Any:
    return model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config


def _sliding_window(model: torch.nn.Module) -> int | None:
    """The window of the model's sliding-attention layers, when it has any, whatever the config's style: with
    `layer_types` (Gemma 2/3, Qwen2/3) those listed "sliding_attention"; without (Mistral) every layer when
    `sliding_window` is set, as HF's forward applies it. `use_sliding_window` False (Qwen2's switch) means none."""
    config = _text_config(model)
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return None
    types = getattr(config, "layer_types", None)
    return None if types is not None and "sliding_attention" not in types else int(window)


# What the cache and the masks here serve: every layer attends over a key/value cache, to everything before it or
# to the last `sliding_window` positions (models/generation.py's docstring); a few families of each kind.
ATTENTION_TYPES = ("full_attention", "sliding_attention")
SERVED = "llama, qwen2, qwen3, gemma2, gemma3_text, mistral, phi3"


def unserved_reason(model: torch.nn.Module) -> str | None:
    """Why the cached generation cannot serve `model` (see `check_generation_support`), or None when it can."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # a PEFT wrapper: its model
    if getattr(model.config, "is_encoder_decoder", False):
        return "is an encoder-decoder"
    if getattr(base, "_is_stateful", False):  # transformers' mark of Mamba, RWKV, Jamba, Qwen3-Next, ...
        return "keeps a recurrent state, not a key/value cache"
    other = sorted({t for t in getattr(_text_config(model), "layer_types", None) or () if t not in ATTENTION_TYPES})
    if other:
        return f"has layers of type {other}"
    return None


def check_generation_support(model: torch.nn.Module) -> None:
    """A ConfigError naming the model's class and model_type when the cached generation cannot serve it: an
    encoder-decoder, a recurrent state (Mamba, RWKV), layers that are not full or sliding-window attention
    (Llama 4's chunked attention, LFM2's convolutions). Such models used to fail deep
    inside transformers (the StaticLayer cache here has no convolution state) or, worse, answer with other tokens
    than transformers does (a chunked or recurrent layer run as plain causal attention)."""
    why = unserved_reason(model)
    if why is not None:
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        model_type = getattr(model.config, "model_type", None) or "?"
        raise ConfigError(f"{type(base).__name__} (model_type {model_type!r}) {why}: the cached generation "
                          "(models/generation.py) serves decoder-only models whose layers all attend through a "
                          f"key/value cache, full or sliding-window (e.g. {SERVED})")


def _hybrid(model: torch.nn.Module) -> bool:
    """Whether the model takes one mask per attention type ({"full_attention", "sliding_attention"}): it lists
    `layer_types`. Without them every layer is windowed and takes the one (windowed) mask."""
    return getattr(_text_config(model), "layer_types", None) is not None


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    zero = torch.zeros((), dtype=dtype, device=allowed.device)
    return torch.where(allowed, zero, torch.full_like(zero, torch.finfo(dtype).min)).unsqueeze(1)


def _masks(allowed: torch.Tensor, distance: torch.Tensor, window: int | None, dtype: torch.dtype,
           hybrid: bool = True) -> Any:
    """The 4D mask(s) the model takes: one tensor (windowed when every layer slides, e.g. Mistral), or
    {"full_attention", "sliding_attention"} for models with layer_types."""
    if window is None:
        return _additive(allowed, dtype)
    sliding = _additive(allowed & (distance < window), dtype)
    return {"full_attention": _additive(allowed, dtype), "sliding_attention": sliding} if hybrid else sliding


# ---- generation -----------------------------------------------------------------------------------------------------
def _cache_argument(model: torch.nn.Module) -> str:
    """The name the model's forward takes the cache by: transformers renamed `past_key_values` to `cache` (5.2x;
    Colab ships 5.15), and a forward given a name it does not know builds a cache of its own, which the masks
    built here (one column per cache slot) do not fit."""
    import inspect

    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # a PEFT wrapper passes kwargs on
    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"


def _forward(model, ids, mask, positions, cache, keep_last: bool):
    kwargs: dict[str, Any] = {"logits_to_keep": 1} if keep_last else {}
    kwargs[_cache_argument(model)] = cache
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, **kwargs)
    return out.logits[:, -1]


def _eos_tensor(eos_token_id: int | Sequence[int] | None, device: Any) -> torch.Tensor:
    ids = [] if eos_token_id is None else [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    return torch.tensor(ids or [-1], dtype=torch.long).to(device)


@torch.no_grad()
def generate_ids(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, *,
                 max_new_tokens: int, eos_token_id: int | Sequence[int] | None, pad_token_id: int,
                 sampling: Sampling = GREEDY, seed: int | torch.Tensor = 0, sync: Callable[[], None] | None = None,
                 cache_len: int | None = None, mask_dtype: torch.dtype | None = None) -> Generated:
    """Complete left-padded prompts (`input_ids`, `attention_mask`: (B, P) on the model's device) by
    `max_new_tokens` tokens with a KV cache (see the module docstring).

    `seed`: an int, or an int64 device tensor (e.g. [run seed, step]) so that a new stream per call compiles
    nothing new. `sync` cuts the graph after the prefill and after each decode step (the backend's sync on XLA).
    `cache_len` (default P + max_new_tokens) sets the cache's slots and the outputs' width, cache_len - P: a
    larger one lets calls with other `max_new_tokens` reuse the same two graphs (the columns past
    `max_new_tokens` stay padding with mask 0)."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens={max_new_tokens!r} must be an integer >= 1")
    check_generation_support(model)
    if input_ids.shape != attention_mask.shape or input_ids.dim() != 2:
        raise ValueError(f"input_ids {tuple(input_ids.shape)} and attention_mask {tuple(attention_mask.shape)} "
                         "must be the same (batch, width)")
    sync = sync or (lambda: None)
    device = input_ids.device
    batch, width = input_ids.shape
    total = width + max_new_tokens if cache_len is None else cache_len
    if total < width + max_new_tokens:
        raise ConfigError(f"cache_len={cache_len!r} is less than the prompt width {width} + max_new_tokens "
                          f"{max_new_tokens}")
    room = total - width  # the outputs' columns
    dtype = mask_dtype or next(model.parameters()).dtype
    if not dtype.is_floating_point:
        dtype = torch.float32
    window, hybrid = _sliding_window(model), _hybrid(model)
    seed_t = seed.to(device=device, dtype=torch.long) if isinstance(seed, torch.Tensor) else \
        torch.tensor([int(seed)], dtype=torch.long).to(device)
    eos = _eos_tensor(eos_token_id, device)
    was_training = model.training
    model.eval()
    try:
        cache = make_cache(model, total)
        prompt_mask = attention_mask.to(torch.long)
        # Slots: the prompt's P, then one per new token; a slot holds a token when its prompt mask is 1 or it is
        # a generated slot already written (the causal condition below).
        valid = torch.cat([prompt_mask.bool(), torch.ones((batch, room), dtype=torch.bool, device=device)], 1)
        slot_pos = torch.cat([(prompt_mask.cumsum(-1) - 1).clamp(min=0),
                              prompt_mask.sum(-1, keepdim=True) + torch.arange(room, device=device)], 1)
        slots = torch.arange(total, device=device)
        q = torch.arange(width, device=device)
        # Prefill: query i sees slots j <= i that hold a token (a padding query sees itself, so no row is empty).
        allowed = ((slots[None, :] <= q[:, None]) & valid[:, None, :]) | (slots[None, :] == q[:, None])
        distance = slot_pos[:, :width, None] - slot_pos[:, None, :]
        logits = _forward(model, input_ids, _masks(allowed, distance, window, dtype, hybrid), slot_pos[:, :width], cache,
                          keep_last=True)
        step = torch.zeros((1,), dtype=torch.long).to(device)  # device data: the same decode graph every step
        cols = torch.arange(room, device=device)
        out_ids = torch.full((batch, room), pad_token_id, dtype=torch.long, device=device)
        out_logp = torch.zeros((batch, room), dtype=torch.float32, device=device)
        out_mask = torch.zeros((batch, room), dtype=torch.long, device=device)
        done = torch.zeros((batch,), dtype=torch.bool, device=device)
        token: torch.Tensor | None = None
        for _ in range(max_new_tokens):
            if token is not None:  # a decode step: the previous token goes in at its slot
                slot = width + step - 1  # the previous token's slot
                allowed = ((slots <= slot) & valid).unsqueeze(1)
                pos = slot_pos.gather(1, slot.expand(batch, 1))
                distance = pos.unsqueeze(-1) - slot_pos.unsqueeze(1)
                logits = _forward(model, token.unsqueeze(1), _masks(allowed, distance, window, dtype, hybrid), pos, cache,
                                  keep_last=False)
            token, logp = pick(logits, sampling, None if sampling.greedy else (seed_t, step))
            live = ~done
            token = torch.where(live, token, torch.full_like(token, pad_token_id))
            here = (cols == step).unsqueeze(0)
            out_ids = torch.where(here, token.unsqueeze(1), out_ids)
            out_logp = torch.where(here & live.unsqueeze(1), logp.unsqueeze(1), out_logp)
            out_mask = torch.where(here, live.long().unsqueeze(1), out_mask)
            done = done | (token.unsqueeze(1) == eos.unsqueeze(0)).any(-1)
            step = step + 1
            sync()
    finally:
        model.train(was_training)
    return Generated(out_ids, out_logp, out_mask)


@torch.no_grad()
def generate_ids_uncached(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, *,
                          max_new_tokens: int, sync: Callable[[], None] | None = None) -> torch.Tensor:
    """The reference greedy loop without a cache (what `hf.generate` ran before the cache): every token runs the
    whole (B, P + N) buffer through the model again. Fixed shapes too (one graph on XLA), but each token costs the
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
            position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
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
