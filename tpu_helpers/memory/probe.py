"""Find the largest per-chip batch that really runs on this device, in a few tries, without harming the run.

    from tpu_helpers.memory.probe import probe_batch_size
    from tpu_helpers.memory.traced import gpt_batch
    result = probe_batch_size(trainer, gpt_batch(256, vocab), start=est.max_batch_size)   # trainer.train_step
    print(result.summary())

Each try runs ``steps_per_try`` of the trainer's own steps at one batch size and reads the loss on the host, where an
allocation failure surfaces; sizes grow by ``growth`` from ``start``, then bisect, for at most ``max_tries``: exact
when the two bounds are neighbours, otherwise a lower bound. Out-of-memory is ``backend.is_out_of_memory``, and the
state is restored after every try, so training continues. With no run yet, a trainer made for its step alone
(`memory.traced.step_trainer`) serves. The search and ``memory_limit_bytes`` in full: docs/guides/memory.md.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from dataclasses import dataclass, field

from tpu_helpers.backend.base import tree_map_tensors
from tpu_helpers.core.choices import check_positive
from tpu_helpers.core.hardware import format_bytes
from tpu_helpers.memory.live import LiveBytes
from tpu_helpers.memory.traced import BatchFn
from tpu_helpers.training.trainer import Trainer


@dataclass
class ProbeResult:
    """``max_batch_size`` is 0 when even the smallest size tried did not fit; ``first_failed`` is the smallest size
    that ran out of memory (None if none did), ``cap`` the probe's ``max_batch_size``."""

    max_batch_size: int
    tries: list[dict] = field(default_factory=list)
    compilations: int = 0
    seconds: float = 0.0
    first_failed: int | None = None
    cap: int | None = None
    device: str = ""
    precision: str = ""
    memory_limit_bytes: int | None = None

    @property
    def exact(self) -> bool:
        """The limit is known exactly: the next size failed (or the largest, 1, failed)."""
        return self.first_failed is not None and self.first_failed - self.max_batch_size == 1

    def answer(self) -> str:
        """``"exactly 14/chip"``, ``"at least 14/chip"`` (the budget ran out), or "not even 1/chip"."""
        n = self.max_batch_size
        if self.exact:
            return "not even 1/chip" if n == 0 else f"exactly {n}/chip ({n + 1} ran out of memory)"
        if self.first_failed is None:
            return f"at least {n}/chip (the probe's cap; nothing it tried ran out of memory)" if n == self.cap \
                else f"at least {n}/chip (nothing it tried ran out of memory)"
        return f"at least {n}/chip ({self.first_failed} ran out of memory; not narrowed within {len(self.tries)} tries)"

    def conditions(self) -> str:
        """Where and how it ran: device, precision and any imposed memory cap."""
        cap = "" if self.memory_limit_bytes is None else \
            f", under an imposed memory cap of {format_bytes(self.memory_limit_bytes)}"
        device = self.device or "this device"
        precision = "" if self.precision and self.precision in device else f", {self.precision or '?'}"
        return f"on {device}{precision}{cap}"

    def summary(self) -> str:
        tried = ", ".join(f"{t['batch_size']}{'' if t['ok'] else ' (OOM)'}" for t in self.tries)
        return (f"largest batch that ran: {self.answer()} {self.conditions()}; {len(self.tries)} tries [{tried}] in "
                f"{self.seconds:.1f} s, {self.compilations} compilations")

    def to_dict(self) -> dict:
        return {"max_batch_size": self.max_batch_size, "exact": self.exact, "first_failed": self.first_failed,
                "tries": self.tries, "compilations": self.compilations, "seconds": self.seconds,
                "device": self.device, "precision": self.precision, "memory_limit_bytes": self.memory_limit_bytes}


class _Snapshot:
    """Host copies of the model's, optimizer's and schedule's state and of the gradients, to put back after each
    try."""

    def __init__(self, trainer: Trainer) -> None:
        model, optimizer, backend = trainer.model, trainer.optimizer, trainer.backend
        self.model, self.optimizer, self.backend, self.scheduler = model, optimizer, backend, trainer.scheduler
        # to_cpu of a CPU tensor is the tensor itself: clone, or the "copy" would change with the model.
        copy = (lambda obj: tree_map_tensors(lambda t: t.detach().clone(), obj)) if backend.runs_on_host \
            else backend.to_cpu
        self.model_state = copy(model.state_dict())
        self.opt_state = copy(optimizer.state_dict())
        self.scheduler_state = trainer.scheduler.state_dict()
        self.grads = [None if p.grad is None else p.grad.detach().to("cpu", copy=True) for p in model.parameters()]
        self.training = model.training

    def restore(self) -> None:
        # copy_ into every parameter also replaces an XLA tensor's pending (failed) graph with fresh device data.
        self.model.load_state_dict(self.model_state)
        # load_state_dict may adopt the given tensors as the live state (same device): hand it a fresh copy.
        self.optimizer.load_state_dict(tree_map_tensors(lambda t: t.clone(), self.opt_state))
        self.scheduler.load_state_dict(self.scheduler_state)
        for p, g in zip(self.model.parameters(), self.grads, strict=True):
            p.grad = None if g is None else g.to(p.device)
        self.model.train(self.training)
        self.backend.sync()


def probe_batch_size(
    trainer: Trainer,
    batch_fn: BatchFn,
    *,
    start: int = 8,
    max_batch_size: int = 1 << 16,
    max_tries: int = 8,
    steps_per_try: int = 2,
    memory_limit_bytes: int | None = None,
    growth: float = 2.0,
) -> ProbeResult:
    """Largest batch in ``[1, max_batch_size]`` that runs ``steps_per_try`` of `trainer`'s steps (see the module
    docstring)."""
    if not isinstance(trainer, Trainer):
        raise TypeError(f"probe_batch_size measures a Trainer's step; got {type(trainer).__name__} (make one for the "
                        "step alone with tpu_helpers.memory.traced.step_trainer(model, backend, precision=...))")
    model, optimizer, backend = trainer.model, trainer.optimizer, trainer.backend
    for name, value in (("start", start), ("max_batch_size", max_batch_size), ("max_tries", max_tries),
                        ("steps_per_try", steps_per_try)):
        check_positive(name, value)
    if not growth > 1.0:
        raise ValueError(f"growth must be > 1 (the factor between sizes before bisecting), got {growth!r}")
    if memory_limit_bytes is not None and not backend.runs_on_host:
        raise ValueError(f"memory_limit_bytes works on the CPU backend only (this is {backend.name}); on XLA:CPU "
                         "limit the address space with resource.setrlimit(RLIMIT_AS, ...)")
    t0 = time.perf_counter()
    compiles0 = backend.metrics().get("compilations", 0)
    snap = _Snapshot(trainer)
    result = ProbeResult(0, cap=max_batch_size, device=backend.status(), precision=backend.precision,
                         memory_limit_bytes=memory_limit_bytes)

    def attempt(bs: int) -> bool:
        batch = backend.to_device(batch_fn(bs))
        limit = (LiveBytes(model, optimizer, batch, limit_bytes=memory_limit_bytes)
                 if memory_limit_bytes is not None else contextlib.nullcontext())
        ok, error = True, None
        try:
            with limit:
                for _ in range(steps_per_try):
                    loss, _ = trainer.train_step(itertools.repeat(batch))
                    backend.sync()
                # XLA runs the graph asynchronously after sync(): only a host read waits for it, and is where an
                # allocation failure surfaces.
                loss.float().cpu()
        except Exception as err:  # noqa: BLE001 - filtered just below
            if not backend.is_out_of_memory(err):
                snap.restore()
                raise
            ok, error = False, f"{type(err).__name__}: {str(err)[:200]}"
        del batch
        snap.restore()
        backend.free_memory()
        result.tries.append({"batch_size": bs, "ok": ok, "error": error})
        return ok

    good, bad = 0, max_batch_size + 1
    bs = min(start, max_batch_size)
    while len(result.tries) < max_tries:
        if attempt(bs):
            good = bs
            if bad - good <= 1:
                break
            bs = min(max(bs + 1, int(bs * growth)), max_batch_size) if bad > max_batch_size else (good + bad) // 2
        else:
            bad = bs
            if bs == 1 or bad - good <= 1:
                break
            bs = max(1, min(bs - 1, int(bs / growth))) if good == 0 else (good + bad) // 2
        if bs == good or bs == bad:
            break
    result.max_batch_size = good
    result.first_failed = bad if bad <= max_batch_size else None
    result.compilations = backend.metrics().get("compilations", 0) - compiles0
    result.seconds = time.perf_counter() - t0
    return result
