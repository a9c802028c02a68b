"""A step function run N times on a CUDA GPU as one captured CUDA graph replayed N times, so a loop of small steps
(generation's decode) costs the host one graph launch per step instead of the step's Python and its kernel launches
(`Backend.compile_loop` on one GPU, used by models/replay.py's `looped_steps`; the XLA counterpart is
backend/xla_loop.py, with the same contract).

    loop = backend.compile_loop()                      # a GraphLoop on one CUDA GPU
    carry = loop(step, carry, steps=255, key=("decode", width), outside=weights_and_cache)

`step(carry) -> carry` takes and returns a list of tensors of unchanged shapes and dtypes; `outside` are the
caller's own tensors in the carry (weights, a kept cache), read and written where they are. A step that cannot be
captured runs eagerly, with one warning. The contract in full and how the capture works: docs/design/device_loops.md.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import torch

from tpu_helpers.backend.base import ReplayUnsupported, first_line

# Graphs kept per loop (one loop per model): each holds a private memory pool for one step's intermediates; the
# oldest is dropped past this (a caller cycling through many prompt widths).
MAX_GRAPHS = 16


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    buffers: list[torch.Tensor]  # the carry the graph reads and advances: the caller's own where resident
    resident: list[bool]
    addresses: list[int]  # each resident tensor's data_ptr at the capture (0 elsewhere)


class GraphLoop:
    """Runs `step` `steps` times as replays of one CUDA graph (see the module docstring); one per owner (a model),
    so its graphs and their memory go with it."""

    def __init__(self, device: torch.device):
        self.device = device
        self.captures = 0  # graphs captured so far (tests and benchmarks read it)
        self._graphs: dict[Hashable, _Graph] = {}  # oldest first
        self._refused: dict[Hashable, str] = {}  # keys whose step cannot be captured, and why (run eagerly)
        self._warned = False

    def __call__(self, step: Callable[[list[torch.Tensor]], Sequence[torch.Tensor]], carry: Sequence[torch.Tensor],
                 steps: int, key: Hashable, outside: Sequence[torch.Tensor] = ()) -> list[torch.Tensor]:
        """`carry` after `steps` runs of `step` (see the module docstring)."""
        carry = list(carry)
        full_key = (key, tuple((tuple(t.shape), t.dtype) for t in carry))
        resident_ids = {id(t) for t in outside}
        resident = [id(t) in resident_ids for t in carry]
        if full_key in self._refused:
            return _eager(step, carry, steps, resident)
        kept = self._graphs.pop(full_key, None)
        if kept is not None and _moved(kept, carry):
            kept = None  # a resident slot holds another tensor, or its memory moved (`model.to`): capture anew
        if kept is None:
            if steps < 1:
                return carry
            first = list(step(carry))  # the first step, eagerly: also the capture's warm-up
            try:
                kept = self._capture(step, carry, _checked(first, carry), resident)
            except ReplayUnsupported as err:
                # The first step ran (its in-place writes to the caller's state too): the others run as it did.
                self._refused[full_key] = str(err)
                if not self._warned:
                    self._warned = True
                    warnings.warn(f"{err}; the loop's steps run one by one instead (more host time per step, the "
                                  "same results)", stacklevel=2)
                return _eager(step, first, steps - 1, resident, carry)
            while len(self._graphs) >= MAX_GRAPHS:
                self._graphs.pop(next(iter(self._graphs)))
            steps -= 1
        else:
            for buffer, tensor, r in zip(kept.buffers, carry, kept.resident, strict=True):
                if not r:
                    buffer.copy_(tensor)
        self._graphs[full_key] = kept  # the most recently used last
        for _ in range(steps):
            kept.graph.replay()
        # The buffers are the graph's, overwritten by the next call: the caller gets copies of those, its own
        # state tensors as they are.
        return [b if r else b.clone() for b, r in zip(kept.buffers, kept.resident, strict=True)]

    def _capture(self, step: Callable, carry: list[torch.Tensor], first: list[torch.Tensor],
                 resident: list[bool]) -> _Graph:
        """The graph of one step on buffers that hold the state after `first` (the eager step's outputs)."""
        _advance([c for c, r in zip(carry, resident, strict=True) if r],
                 [f for f, r in zip(first, resident, strict=True) if r])  # the caller's state, where it is
        buffers = [c if r else f.clone() for c, f, r in zip(carry, first, resident, strict=True)]
        graph = torch.cuda.CUDAGraph()
        # Autocast's cache of cast weights must not live in the graph's memory (torch's CUDA graph notes).
        cache = torch.is_autocast_cache_enabled()
        torch.set_autocast_cache_enabled(False)
        stream = torch.cuda.current_stream(self.device)
        try:
            # Thread-local: another thread's CUDA calls meanwhile (a loader's pinned-memory thread) neither fail the
            # capture nor fail themselves.
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                # One replay is one step: the next replay reads what this one made.
                _advance(buffers, _checked(step(list(buffers)), buffers))
        except ReplayUnsupported:
            raise
        except RuntimeError as err:
            raise ReplayUnsupported(f"the loop's step cannot be captured in a CUDA graph (a host read or a copy "
                                    f"from the host?): {first_line(err)}") from err
        finally:
            torch.set_autocast_cache_enabled(cache)
            # A failed capture raises before torch's context puts the caller's stream back.
            torch.cuda.set_stream(stream)
        self.captures += 1
        return _Graph(graph, buffers, resident, [c.data_ptr() if r else 0 for c, r in zip(carry, resident,
                                                                                          strict=True)])


def _moved(kept: _Graph, carry: list[torch.Tensor]) -> bool:
    """Whether a resident slot of `carry` is another tensor than at the capture, or the same whose memory moved:
    the graph would read and write the old addresses."""
    return any(r and (c is not b or c.data_ptr() != address)
               for b, c, r, address in zip(kept.buffers, carry, kept.resident, kept.addresses, strict=True))


def _advance(targets: list[torch.Tensor], outputs: list[torch.Tensor]) -> None:
    """Each target takes its output's value, in place, where the output is another tensor. An output that shares
    memory with a target (a step returning one carry tensor in another's place) is copied first: written in order,
    it could be overwritten before it is read."""
    storages = {t.untyped_storage().data_ptr() for t in targets}
    values = [o.clone() if o is not t and o.untyped_storage().data_ptr() in storages else o
              for t, o in zip(targets, outputs, strict=True)]
    for t, v in zip(targets, values, strict=True):
        if v is not t:
            t.copy_(v)


def _eager(step: Callable, carry: list[torch.Tensor], steps: int, resident: list[bool],
           state: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """`steps` steps in Python; the resident slots' values then written into the caller's own tensors (`state`,
    default `carry`) and returned as those, as the graph would have."""
    state = carry if state is None else state
    for _ in range(steps):
        carry = list(step(carry))
    mine = [s for s, r in zip(state, resident, strict=True) if r]
    _advance(mine, [c for c, r in zip(carry, resident, strict=True) if r])
    it = iter(mine)
    return [next(it) if r else c for c, r in zip(carry, resident, strict=True)]


def _checked(outputs: Sequence[torch.Tensor], carry: list[torch.Tensor]) -> list[torch.Tensor]:
    """`outputs` as a list, refused unless each keeps its carry tensor's shape and dtype."""
    outputs = list(outputs)
    if len(outputs) != len(carry):
        raise ReplayUnsupported(f"the loop's step returned {len(outputs)} tensors for a carry of {len(carry)}")
    for i, (o, c) in enumerate(zip(outputs, carry, strict=True)):
        if tuple(o.shape) != tuple(c.shape):
            raise ReplayUnsupported(f"the loop's step changed carry[{i}]'s shape {tuple(c.shape)} to {tuple(o.shape)}")
        if o.dtype != c.dtype:
            raise ReplayUnsupported(f"the loop's step changed carry[{i}]'s dtype {c.dtype} to {o.dtype}")
    return outputs
