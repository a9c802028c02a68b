"""Replaying generation's decode step instead of tracing it per token: the caches kept between calls, the replayed
loop and its fallback (models/generation.py's `generate_ids(..., replay=backend.compile_step)` uses them).

Why: on XLA every decode step was traced in Python into a lazy graph, hashed and looked up, about 40 ms of host time
per token for a 30-layer model on XLA:CPU whatever the chip; a replayed step costs about 1 ms. What makes a replay
hold call after call (no capture, no compile after the first call of a shape):
- the step reads nothing but its arguments (models/generation.py's `_decode`), and the Python values among them
  (the prompt width, the sampling settings, the pad id) are the same for every call of a shape;
- the key/value cache of each shape is kept with the model (`kept_cache`) and reset in place, so its layers are
  the objects the capture's guards checked; `release_caches(model)` frees them;
- transformers' `enable_input_require_grads` hook (gradient checkpointing under LoRA) is lifted around the steps:
  its `requires_grad_` is a graph break and means nothing without grad;
- a step that cannot be captured whole (`ReplayUnsupported`) runs lazily instead, with one warning per model.
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
    """Free the key/value caches that `generate_ids(..., replay=...)` keeps for `model` between calls."""
    _KEPT.pop(model, None)


def kept_cache(model: torch.nn.Module, key: tuple, make: Callable[[], Any]) -> Any:
    """The cache kept for `model` and `key` (the decode step's shapes), reset for a new prefill; `make()` builds
    it on first use."""
    kept = _KEPT.setdefault(model, {})
    cache = kept.get(key)
    if cache is None:
        cache = kept[key] = make()
    elif cache.layers[0].is_initialized:
        # Back to the state a fresh cache's prefill finds, so the prefill is the first call's graph again (no
        # compile): keys and values zeros built in the graph, the write position a device value 0.
        zero = torch.zeros((), dtype=cache.layers[0].cumulative_length.dtype).to(cache.layers[0].keys.device)
        for layer in cache.layers:
            layer.keys.zero_()
            layer.values.zero_()
            layer.cumulative_length.copy_(zero)
    return cache


def replayed_steps(replay: Callable, decode: Callable, model: torch.nn.Module, cache: Any, st: tuple, fixed: tuple,
                   steps: int, sync: Callable[[], None], args: tuple) -> tuple:
    """`steps` calls of `decode` (models/generation.py's step) through `replay(decode)`, each replay a graph of its
    own (no sync). A model whose step cannot be captured whole (`ReplayUnsupported`: nothing ran) is warned about
    once and traced lazily from then on."""
    kept = _KEPT.setdefault(model, {})
    if kept.get("lazy"):
        return lazy_steps(decode, model, cache, st, fixed, steps, sync, args)
    step_fn = replay(decode)
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


def lazy_steps(decode: Callable, model: torch.nn.Module, cache: Any, st: tuple, fixed: tuple, steps: int,
               sync: Callable[[], None], args: tuple) -> tuple:
    """`steps` calls of `decode` traced lazily, `sync` cutting each into the same graph (today's loop)."""
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
