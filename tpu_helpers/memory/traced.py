"""Traced memory estimate: run the trainer's real training step of any ``nn.Module`` on fake tensors and count the
bytes.

    from tpu_helpers.memory.traced import traced_estimate, gpt_batch
    est = traced_estimate(lambda: GPT(cfg), gpt_batch(seq_len=256, vocab_size=cfg.vocab_size), batch_size=8)
    print(est.peak_bytes, est.breakdown)

Two steps of a `Trainer` around a model of fake tensors run under torch's ``MemTracker``; the second step's peak is
the estimate, so it works for models far too big for this machine. ``batch_fn(batch_size)`` must build the batch
with ordinary tensor factories (it runs under the fake mode). The figure is what an eager run allocates; XLA's
compiled graph differs (see compiled.py). How the fake step is made: docs/guides/memory.md.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from tpu_helpers.backend import get_backend
from tpu_helpers.config import TrainConfig
from tpu_helpers.core.choices import OPTIMIZERS, check_choice, check_positive
from tpu_helpers.memory.analytic import memory_layout
from tpu_helpers.memory.report import MemoryEstimate
from tpu_helpers.training.trainer import LossFn, Trainer

ModelSpec = Callable[[], torch.nn.Module] | torch.nn.Module
BatchFn = Callable[[int], Any]


class MetaBuildError(ValueError):
    """The model cannot be built on the meta device (it reads tensor values or loads data while constructing)."""


def gpt_batch(seq_len: int, vocab_size: int) -> BatchFn:
    """Batch factory for the package GPT: ``(inputs, targets)`` of shape (batch, seq_len), int64."""
    check_positive("seq_len", seq_len)

    def make(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.randint(0, vocab_size, (batch_size, seq_len)), torch.randint(0, vocab_size, (batch_size, seq_len)))

    return make


def build_on_meta(model: ModelSpec) -> torch.nn.Module:
    """A meta-device copy of ``model`` (a module, used without copying its data) or of what ``model()`` builds."""
    if isinstance(model, torch.nn.Module):
        # deepcopy with every tensor pre-mapped to a meta twin: the structure is copied, the data never is.
        memo: dict[int, Any] = {}
        for t in [*model.parameters(), *model.buffers()]:
            twin = torch.empty_like(t, device="meta")
            memo[id(t)] = torch.nn.Parameter(twin, t.requires_grad) if isinstance(t, torch.nn.Parameter) else twin
        return copy.deepcopy(model, memo)
    if not callable(model):
        raise TypeError(f"model must be an nn.Module or a function returning one, got {type(model).__name__}")
    try:
        with torch.device("meta"):
            built = model()
    except Exception as err:
        raise MetaBuildError(
            f"the model cannot be built on the meta device ({type(err).__name__}: {err}). The traced estimate needs "
            "a constructor that only creates tensors (no .item(), .tolist(), data-dependent shapes or file loads "
            "in __init__); build those parts lazily, or use the analytic estimate."
        ) from err
    if not isinstance(built, torch.nn.Module):
        raise TypeError(f"the model function returned {type(built).__name__}, not an nn.Module")
    return built


def _materialize_fake(module: torch.nn.Module, dtype: torch.dtype | None = None) -> torch.nn.Module:
    """Give every meta parameter and buffer a fake CPU twin, keeping shared (tied) tensors shared; `dtype`: the
    floating-point ones in that dtype (what ``Module.to(dtype)`` does).

    ``Module.to_empty`` would give the second name of a tied weight a storage of its own and count it twice. And no
    ``Module.to`` runs on the fake module: torch 2.15 (not 2.9) swaps each fake parameter for a new one there, which
    FakeTensorMode refuses ("Cannot swap t1 because it has weakref associated with it").
    """
    twins: dict[int, torch.Tensor] = {}
    for mod in module.modules():
        for table in (mod._parameters, mod._buffers):
            for name, t in list(table.items()):
                if t is None:
                    continue
                if id(t) not in twins:
                    cast = dtype if dtype is not None and t.is_floating_point() else t.dtype
                    new = torch.empty_like(t, device="cpu", dtype=cast)
                    twins[id(t)] = torch.nn.Parameter(new, t.requires_grad) if isinstance(t, torch.nn.Parameter) else new
                table[name] = twins[id(t)]
    return module


class _NoHook:
    def remove(self) -> None:
        pass


def _skip_grad_hooks_of_frozen(module: torch.nn.Module) -> None:
    """MemTracker (torch 2.9) puts a gradient hook on every parameter, which torch refuses for frozen ones (the
    base of a LoRA model): they never get a gradient, so a no-op hook counts them exactly."""
    for p in module.parameters():
        if not p.requires_grad:
            p.register_hook = p.register_post_accumulate_grad_hook = lambda *a, **k: _NoHook()  # type: ignore


def _micro_batches(batch: Any, tracker: Any):
    """`batch` for each micro-batch of a step. MemTracker takes a second call of the model in one step for the next
    iteration and refuses it, so its per-module statistics (unused here; the device totals are what counts) are
    cleared before each later micro-batch."""
    yield batch
    while True:
        tracker.reset_mod_stats()
        yield batch


def step_trainer(model: torch.nn.Module, backend: Any, *, precision: str, optimizer: str = "adamw",
                 grad_accum: int = 1, gradient_checkpointing: bool = False, loss_fn: LossFn | None = None,
                 **config: Any) -> Trainer:
    """A `Trainer` over `model` made for its step alone (no data, nothing written): what the estimates and the
    probe run, so they measure the step, optimizer and zero_grad policy that training runs."""
    cfg = TrainConfig(device="cpu" if backend.runs_on_host else "auto", precision=precision, optimizer=optimizer,
                      grad_accum=grad_accum, gradient_checkpointing=gradient_checkpointing, xla_checks="off",
                      **config)
    return Trainer(model, None, config=cfg, backend=backend, loss_fn=loss_fn, progress=False)


def traced_estimate(
    model: ModelSpec,
    batch_fn: BatchFn,
    batch_size: int,
    *,
    optimizer: str = "adamw",
    precision: str = "fp32",
    pure_bf16: bool = False,
    grad_accum: int = 1,
    loss_fn: LossFn | None = None,
    gradient_checkpointing: bool = False,
) -> MemoryEstimate:
    """Peak bytes of the second of two training steps, with its breakdown (see the module docstring)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    check_positive("batch_size", batch_size)
    check_choice("optimizer", optimizer, OPTIMIZERS)
    # fp16 autocast keeps the bytes of bf16 autocast; the CPU, where the trace runs, has only the latter.
    precision = "fp32" if memory_layout(precision, pure_bf16) == "fp32" else "bf16"
    meta = build_on_meta(model)
    if gradient_checkpointing:
        base = meta.get_base_model() if hasattr(meta, "get_base_model") else meta  # peft wraps HF models
        if not hasattr(meta, "set_gradient_checkpointing") and not hasattr(base, "_set_gradient_checkpointing"):
            raise ValueError(f"gradient_checkpointing=True needs a model with set_gradient_checkpointing() or a "
                             f"Hugging Face model; {type(meta).__name__} is neither")
    backend = get_backend("cpu", precision=precision)
    with FakeTensorMode(allow_non_fake_inputs=True):
        module = _materialize_fake(meta, torch.bfloat16 if pure_bf16 else None)
        trainer = step_trainer(module, backend, precision=precision, optimizer=optimizer, grad_accum=grad_accum,
                               gradient_checkpointing=gradient_checkpointing, loss_fn=loss_fn)
        trainer.model.train()
        try:
            batch = batch_fn(batch_size)
        except Exception as err:
            raise ValueError(f"batch_fn({batch_size}) failed under the fake mode: {err}") from err
        _skip_grad_hooks_of_frozen(module)
        tracker = MemTracker()
        tracker.track_external(module, trainer.optimizer)
        with tracker:
            for i in range(2):
                trainer.train_step(_micro_batches(batch, tracker))
                if i == 0:
                    tracker.reset_mod_stats()
                    # Second step's peak only: restart the peak from the current (steady-state) snapshot. MemTracker
                    # has no public reset for it (torch 2.9); these two attributes are what __enter__ sets.
                    tracker._peak_mem_snap = tracker.get_tracker_snapshot("current")
                    tracker._peak_mem = {dev: s["Total"] for dev, s in tracker._peak_mem_snap.items()}
        snap = tracker.get_tracker_snapshot("peak")
    dev_snap = next(iter(snap.values()))
    return MemoryEstimate.from_categories(
        "traced",
        batch_size,
        params=dev_snap.get("Parameter", 0) + dev_snap.get("Buffer", 0),
        grads=dev_snap.get("Gradient", 0),
        optimizer=dev_snap.get("Optstate", 0),
        activations=dev_snap.get("Activation", 0),
        temporaries=dev_snap.get("Temp", 0) + dev_snap.get("Other", 0),
        total=dev_snap["Total"],
    )
