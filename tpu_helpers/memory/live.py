"""Count the bytes of live tensor storage while real code runs, and optionally fail past a limit.

:class:`LiveBytes` is a ``TorchDispatchMode``: every op's outputs are seen, each distinct storage is counted once
(views share their base's), and a weak-reference callback subtracts it when it is freed. It is the "measured"
side of ``benchmarks/memory_accuracy.py`` on the CPU (which has no allocator statistics) and, with ``limit_bytes``,
a real memory limit for the CPU: past the limit it raises ``torch.OutOfMemoryError`` exactly where a GPU would,
which is how the probe is tested without a GPU::

    with LiveBytes(model, optimizer, limit_bytes=200 * 2**20) as live:
        training_step(model, optimizer, batch)
    print(live.peak_bytes)

Tensors that exist before the mode is entered are invisible to it unless passed in (modules, optimizers,
tensors). Freed memory returns to the count at once, as with a caching allocator's ``memory_allocated``.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveBytes(TorchDispatchMode):
    """Live and peak bytes of tensor storage, counted per storage (``limit_bytes``: raise OOM past it)."""

    def __init__(self, *external: Any, limit_bytes: int | None = None) -> None:
        super().__init__()
        if limit_bytes is not None and limit_bytes < 0:
            raise ValueError(f"limit_bytes must be >= 0 or None, got {limit_bytes!r}")
        self.limit_bytes = limit_bytes
        self.live_bytes = 0
        self.peak_bytes = 0
        self._live: dict[int, int] = {}  # StorageImpl address -> bytes
        self.track(*external)

    def track(self, *external: Any) -> None:
        """Count tensors created outside the mode: modules (parameters, buffers, gradients), optimizers, tensors."""
        for obj in tree_flatten(external)[0]:
            if isinstance(obj, torch.nn.Module):
                for t in [*obj.parameters(), *obj.buffers()]:
                    self._add(t)
                    if t.grad is not None:
                        self._add(t.grad)
            elif isinstance(obj, torch.optim.Optimizer):
                for state in obj.state.values():
                    for t in tree_flatten(state)[0]:
                        if isinstance(t, torch.Tensor):
                            self._add(t)
            elif isinstance(obj, torch.Tensor):
                self._add(obj)
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def _add(self, t: torch.Tensor) -> None:
        if t.device.type == "meta":
            return
        st = t.untyped_storage()
        key = st._cdata
        if key in self._live:
            return
        nbytes = st.nbytes()
        self._live[key] = nbytes
        self.live_bytes += nbytes
        weakref.finalize(st, self._free, key)

    def _free(self, key: int) -> None:
        self.live_bytes -= self._live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._add(t)
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes = self.live_bytes
            if self.limit_bytes is not None and self.live_bytes > self.limit_bytes:
                over = self.live_bytes
                del out, t
                raise torch.OutOfMemoryError(
                    f"Out of memory: {over} bytes live after {func} exceed the forced limit of "
                    f"{self.limit_bytes} bytes (tpu_helpers.memory.live.LiveBytes)"
                )
        return out
