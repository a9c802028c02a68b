"""Generation without per-token tracing on XLA, used by models/generation.py's `generate_ids` with the hooks of the
device's backend (`replay=backend.compile_step, loop=backend.compile_loop`, its default on XLA and CUDA):
- `replayed_prefill`: the prompt pass captured once per shape (dynamo) and replayed;
- `replayed_steps`: the decode step captured once per shape and replayed, token by token;
- `looped_steps`: all of a call's decode steps as one device loop (a While op on XLA, backend/xla_loop.py; a CUDA
  graph replayed per token on one GPU, backend/cuda_loop.py), so the host's work per call does not grow with the
  number of tokens; where the loop cannot be built, the replayed steps.
The key/value cache of each shape is kept with the model (`kept_cache`) and reset in place, so a capture's guards
find the same objects call after call; `release_caches(model)` frees the caches and the loop's programs. A pass that
cannot be captured whole runs lazily instead, and a step that cannot be looped steps one by one, each with one
warning per model. What keeps a replay valid from call to call: docs/guides/generation.md.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from tpu_helpers.backend.base import ReplayUnsupported

# Caches kept for `replay` (model -> {(batch, slots, dtype): cache}): the captured step reads the cache's layers as
# the same Python objects call after call (its guards check them), so each shape keeps one cache, overwritten by
# every call's prefill. Weak keys: a model's caches go with it; `release_caches(model)` frees them sooner.
_KEPT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def release_caches(model: torch.nn.Module) -> None:
    """Free the key/value caches and the decode loop's programs that `generate_ids(..., replay=..., loop=...)`
    keeps for `model` between calls."""
    _KEPT.pop(model, None)


def kept_cache(model: torch.nn.Module, key: tuple, make: Callable[[], Any]) -> Any:
    """The cache kept for `model` and `key` (the decode step's shapes); `make()` builds it on first use."""
    kept = _KEPT.setdefault(model, {})
    cache = kept.get(key)
    if cache is None:
        cache = kept[key] = make()
    return cache


def _reset(cache: Any) -> None:
    """Back to the state a fresh cache's first write finds: keys and values zeros, the write position 0 (a device
    value: a constant would make another graph)."""
    zero = torch.zeros((), dtype=cache.layers[0].cumulative_length.dtype).to(cache.layers[0].keys.device)
    for layer in cache.layers:
        layer.keys.zero_()
        layer.values.zero_()
        layer.cumulative_length.copy_(zero)


def replayed_prefill(replay: Callable | None, prefill: Callable, model: torch.nn.Module, cache: Any,
                     tensors: tuple, room: int, args: tuple, sync: Callable[[], None]) -> tuple:
    """`prefill` (models/generation.py's) through `replay` where given, so a call's prompt pass is not traced again
    either (~45 ms of host time for a 30-layer model on XLA:CPU); lazily where `replay` is None or the pass cannot
    be captured whole (warned about once per model; the decode steps are then not replayed either, though still
    looped where `loop` is given)."""
    kept = _KEPT.setdefault(model, {})
    if replay is not None and replay(prefill) is prefill:
        replay = None  # an eager backend's (CUDA's): nothing to capture, so no allocation pass to run first
    if replay is not None and not kept.get("lazy"):
        # What the capture reads as device data, each in a graph that is the same from the first call on: dynamo's
        # bridge syncs pending inputs in one graph when it captures and in another when it replays (the second
        # call would compile a graph the first did not), and a graph's tensors go in the order they were made (the
        # cache's, made by the first call's prompt pass after its inputs, are older than the inputs later).
        sync()  # the inputs
        if not cache.layers[0].is_initialized:
            # The capture must find the cache as every later call finds it, allocated (else the second call
            # captures anew: a second compile of the prompt pass, ~15 s for 30 layers on XLA:CPU). The pass is
            # traced lazily once for the allocation only and dropped before anything ran.
            prefill(model, cache, tensors, room, *args)
        _reset(cache)
        sync()  # the cache's reset
        try:
            with _no_input_grad_hook(model):
                return replay(prefill)(model, cache, tensors, room, *args)
        except ReplayUnsupported as err:
            # What breaks the prompt's pass breaks the decode step too (the same forward): neither is replayed.
            kept["lazy"] = True
            warnings.warn(f"{err}; {type(model).__name__}'s prompt pass and decode steps are traced per token "
                          "instead (slower on the host, the same tokens)", stacklevel=3)
    elif cache.layers[0].is_initialized:
        _reset(cache)  # a kept cache holds the last call's keys; reset in the prompt pass's graph
    return prefill(model, cache, tensors, room, *args)


def replayed_steps(replay: Callable, decode: Callable, model: torch.nn.Module, cache: Any, st: tuple, fixed: tuple,
                   steps: int, sync: Callable[[], None], args: tuple) -> tuple:
    """`steps` calls of `decode` (models/generation.py's step) through `replay(decode)`, each replay a graph of its
    own (no sync). A model whose step cannot be captured whole (`ReplayUnsupported`: nothing ran) is warned about
    once and traced lazily from then on. Where `replay` captures nothing and gives `decode` back (an eager
    backend; XLA over an SPMD mesh, `XlaBackend.compile_step`), the steps are `lazy_steps`, each cut by `sync`:
    unsynced, a lazy backend traced all of a call's steps into one graph, as long as the call (an fsdp rollout's
    decode, unrolled, compiled anew for each length and run twice: once for the tokens read, again for the rest)."""
    kept = _KEPT.setdefault(model, {})
    step_fn = replay(decode)
    if kept.get("lazy") or step_fn is decode:
        return lazy_steps(decode, model, cache, st, fixed, steps, sync, args)
    try:
        with _no_input_grad_hook(model):
            st = step_fn(model, cache, st, fixed, *args)
            # The first step checked the capture's guards (shapes, dtypes, the Python values, the model's and the
            # cache's objects); the others pass the same objects and shapes, so checking them again per token (a
            # few ms of host time for a 30-layer model on XLA:CPU) is skipped.
            with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
                for _ in range(steps - 1):
                    st = step_fn(model, cache, st, fixed, *args)
    except ReplayUnsupported as err:
        kept["lazy"] = True
        warnings.warn(f"{err}; {type(model).__name__}'s decode steps are traced per token instead (slower on the "
                      "host, the same tokens)", stacklevel=3)
        return lazy_steps(decode, model, cache, st, fixed, steps, sync, args)
    return st


def looped_steps(make_loop: Callable[[], Callable | None], decode: Callable, model: torch.nn.Module, cache: Any,
                 st: tuple, fixed: tuple, steps: int, args: tuple) -> tuple | None:
    """`steps` calls of `decode` as one device loop (`make_loop`: the backend's `compile_loop`, whose runner is kept
    with the model): traced once per shape, the built program then called with this call's tensors, so the host's
    work per call does not grow with `steps`.
    The loop's carry holds everything the step reads that can change between calls: the model's weights and
    buffers (swapped in for the trace with torch's reparametrization, tied weights tied, so the program reads each
    call's weights, updated in place or not; one read another way is refused), the cache's tensors, `st` and
    `fixed`; the weights and the cache are the loop's `outside` (the model's own state: a CUDA graph reads and
    writes them where they are). The modules' other tensor attributes are put back after the trace (torchao's fake
    quantizers set theirs in each forward; kept, they would hold the trace's placeholders). None when the step cannot be looped
    (`ReplayUnsupported`, nothing ran; that shape is not tried again, and one warning per model): the caller steps
    it otherwise."""
    kept = _KEPT.setdefault(model, {})
    loop = kept.get("loop") or kept.setdefault("loop", make_loop())
    if loop is None:
        return None
    named = dict(model.named_parameters())
    named.update(model.named_buffers())
    names = tuple(named)
    layers = cache.layers
    n_w, n_l, n_st = len(names), len(layers), len(st)

    def step(carry: list[torch.Tensor]) -> list[torch.Tensor]:
        weights, cache_part, state, fixed_part = (carry[:n_w], carry[n_w:n_w + 3 * n_l],
                                                  carry[n_w + 3 * n_l:n_w + 3 * n_l + n_st],
                                                  carry[n_w + 3 * n_l + n_st:])
        _set_cache_tensors(layers, cache_part)
        attributes = _tensor_attributes(model)
        try:
            with torch.nn.utils.stateless._reparametrize_module(model, dict(zip(names, weights, strict=True)),
                                                                tie_weights=True):
                new = decode(model, cache, tuple(state), tuple(fixed_part), *args)
        finally:
            _restore_tensor_attributes(model, attributes)
        return [*weights, *_cache_tensors(layers), *new, *fixed_part]

    before = _cache_tensors(layers)
    carry = [*named.values(), *before, *st, *fixed]
    try:
        with _no_input_grad_hook(model):
            # The weights and the cache are the model's own state: read only through the carry (XLA), and where
            # they are (a CUDA graph).
            out = loop(step, carry, steps, key=(decode, names, args, _trace_state(model, st[1].device)),
                       outside=carry[:n_w + 3 * n_l])
    except BaseException as err:
        # A trace that stopped midway left the layers holding its placeholders: back to the real tensors.
        _set_cache_tensors(layers, before)
        if not isinstance(err, ReplayUnsupported):
            raise
        if not kept.get("loop_warned"):
            kept["loop_warned"] = True
            warnings.warn(f"{err}; {type(model).__name__}'s decode steps run one by one instead (more host time "
                          "per token, the same tokens)", stacklevel=3)
        return None
    # Back into the cache's own tensors, in place: a replayed prefill's capture guards those objects (transformers
    # marks them static), so new ones would make the next call capture its prompt pass anew.
    _set_cache_tensors(layers, before)
    for mine, new in zip(before, out[n_w:n_w + 3 * n_l], strict=True):
        if new is not mine:  # a CUDA graph wrote them in place already
            mine.copy_(new)
    return tuple(out[n_w + 3 * n_l:n_w + 3 * n_l + n_st])


def _tensor_attributes(model: torch.nn.Module) -> dict[tuple[int, str], torch.Tensor]:
    """Every module's plain tensor attributes (neither parameters nor buffers), to put back after a trace."""
    return {(id(m), name): value for m in model.modules() for name, value in vars(m).items()
            if isinstance(value, torch.Tensor)}


def _restore_tensor_attributes(model: torch.nn.Module, attributes: dict[tuple[int, str], torch.Tensor]) -> None:
    """Back to `attributes`; a tensor attribute the trace added is removed (it would hold a placeholder)."""
    for m in model.modules():
        for name, value in list(vars(m).items()):
            if isinstance(value, torch.Tensor):
                if (id(m), name) in attributes:
                    setattr(m, name, attributes[(id(m), name)])
                else:
                    delattr(m, name)


def _trace_state(model: torch.nn.Module, device: torch.device) -> tuple:
    """What besides the tensors' shapes changes the traced step and can change between calls on one model: autocast,
    and peft's adapter switches (`disable_adapter()`, merged or other active adapters)."""
    kind = device.type
    autocast = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None
    adapters = tuple((bool(m.disable_adapters), tuple(m.merged_adapters), tuple(m.active_adapters))
                     for m in model.modules() if hasattr(m, "merged_adapters") and hasattr(m, "disable_adapters"))
    return autocast, adapters


def _cache_tensors(layers: list) -> list[torch.Tensor]:
    """Every layer's keys, then every layer's values, then every layer's write position."""
    return [*(layer.keys for layer in layers), *(layer.values for layer in layers),
            *(layer.cumulative_length for layer in layers)]


def _set_cache_tensors(layers: list, tensors: list[torch.Tensor]) -> None:
    n = len(layers)
    for i, layer in enumerate(layers):
        layer.keys, layer.values, layer.cumulative_length = tensors[i], tensors[n + i], tensors[2 * n + i]


def lazy_steps(decode: Callable, model: torch.nn.Module, cache: Any, st: tuple, fixed: tuple, steps: int,
               sync: Callable[[], None], args: tuple) -> tuple:
    """`steps` calls of `decode` traced lazily, `sync` cutting each into the same graph."""
    for _ in range(steps):
        st = decode(model, cache, st, fixed, *args)
        sync()
    return st


@contextlib.contextmanager
def _no_input_grad_hook(model: torch.nn.Module) -> Iterator[None]:
    """Without transformers' `enable_input_require_grads` hook (gradient checkpointing under LoRA turns it on):
    its `requires_grad_` on the embedding's output is a graph break for dynamo and means nothing without grad."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    hooked = bool(getattr(base, "_require_grads_hooks", None)) and hasattr(base, "disable_input_require_grads")
    if hooked:
        base.disable_input_require_grads()
    try:
        yield
    finally:
        if hooked:
            base.enable_input_require_grads()
