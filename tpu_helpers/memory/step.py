"""The training step every memory estimate and the probe measure, and the names they share.

One step is: forward under the chosen precision, loss, backward, optimizer step, ``zero_grad``. Keeping it in one
place means the traced estimate, the real measurement of ``benchmarks/memory_accuracy.py`` and the probe measure
the same thing. ``OPTIMIZERS`` and ``PRECISIONS`` are the names the analytic estimate and the widgets accept::

    from tpu_helpers.memory.step import make_optimizer, training_step
    opt = make_optimizer("adamw", model.parameters())
    training_step(model, opt, batch, precision="bf16")
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch.nn import functional as F

# fp32: everything fp32. bf16: bf16 autocast over fp32 weights (the TPU default). pure-bf16: weights, gradients and
# optimizer states stored in bf16 (no fp32 master copy; cheaper, less precise).
PRECISIONS = ("fp32", "bf16", "pure-bf16")
OPTIMIZERS = ("adamw", "sgd", "adafactor")

LossFn = Callable[[torch.nn.Module, Any], torch.Tensor]


def check_choice(name: str, value: object, allowed: Sequence[object]) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not one of {tuple(allowed)}")


def check_positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def make_optimizer(name: str, params: Iterable[torch.nn.Parameter], lr: float = 1e-3) -> torch.optim.Optimizer:
    """AdamW (2 states per parameter), SGD with momentum (1), or Adafactor (factored second moment, ~0)."""
    check_choice("optimizer", name, OPTIMIZERS)
    params = list(params)
    # foreach=False: the for-loop implementations are what CPU and XLA run by default; the foreach ones allocate
    # a temporary copy of every state at once, which would make the estimate depend on the device type.
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, foreach=False)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9, foreach=False)
    return FactoredAdafactor(params, lr=lr)


class FactoredAdafactor(torch.optim.Optimizer):
    """Adafactor's memory layout without its host reads: a factored second moment (a row and a column vector per
    matrix, a full one for vectors), no first moment, fixed learning rate.

    ``torch.optim.Adafactor`` calls ``.item()`` in every step (a host sync on XLA, impossible under the fake mode of
    the traced estimate); this keeps its memory footprint, which is what the estimates are about.
    """

    def __init__(self, params: Iterable[torch.nn.Parameter], lr: float = 1e-3, beta2: float = 0.999,
                 eps: float = 1e-30) -> None:
        super().__init__(params, {"lr": lr, "beta2": beta2, "eps": eps})

    @torch.no_grad()
    def step(self, closure: Callable | None = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            lr, beta2, eps = group["lr"], group["beta2"], group["eps"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g, state = p.grad, self.state[p]
                if not state:
                    if p.dim() >= 2:
                        state["row"] = torch.zeros(p.shape[:-1], dtype=p.dtype, device=p.device)
                        state["col"] = torch.zeros(p.shape[:-2] + p.shape[-1:], dtype=p.dtype, device=p.device)
                    else:
                        state["v"] = torch.zeros_like(p)
                    # A tensor step count keeps the bias correction inside one compiled graph on XLA.
                    state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                state["step"].add_(1)
                correction = 1 - torch.pow(beta2, state["step"])
                sq = g * g + eps
                if p.dim() >= 2:
                    state["row"].lerp_(sq.mean(-1), 1 - beta2)
                    state["col"].lerp_(sq.mean(-2), 1 - beta2)
                    row, col = state["row"], state["col"]
                    v = row.unsqueeze(-1) * col.unsqueeze(-2) / row.mean(-1, keepdim=True).unsqueeze(-1)
                else:
                    v = state["v"].lerp_(sq, 1 - beta2)
                p.add_(g / (v / correction).sqrt().clamp_min(1e-8), alpha=-lr)


def default_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    """``(inputs, targets)``: a model returning ``(logits, loss)`` (the package GPT) gives its loss; one returning
    logits gets cross-entropy against ``targets``."""
    inputs, targets = batch
    out = model(inputs, targets) if _takes_targets(model) else model(inputs)
    if isinstance(out, tuple):
        return out[1]
    return F.cross_entropy(out.float().flatten(0, -2) if out.dim() > 2 else out.float(), targets.flatten())


def _takes_targets(model: torch.nn.Module) -> bool:
    import inspect

    try:
        return len(inspect.signature(model.forward).parameters) >= 2
    except (TypeError, ValueError):
        return False


def autocast_for(precision: str, device_type: str) -> contextlib.AbstractContextManager:
    check_choice("precision", precision, PRECISIONS)
    if precision == "bf16":
        return torch.autocast(device_type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def training_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Any,
    *,
    precision: str = "fp32",
    loss_fn: LossFn | None = None,
    accumulation: int = 1,
    device_type: str | None = None,
    sync: Callable[[], None] | None = None,
) -> torch.Tensor:
    """One optimizer step over ``accumulation`` micro-batches (the same batch each time); returns the loss.

    ``sync`` (``backend.sync``) ends the step on XLA, where a graph only runs, and fails for lack of memory, then.
    """
    check_positive("accumulation", accumulation)
    loss_fn = loss_fn or default_loss
    if device_type is None:
        device_type = next(model.parameters()).device.type
    loss = None
    for _ in range(accumulation):
        with autocast_for(precision, device_type):
            loss = loss_fn(model, batch) / accumulation
        loss.backward()
    optimizer.step()
    # Keep the gradient buffers (set_to_none=False): their memory then counts at every step's peak, an upper bound
    # for the package's loop, which drops them between steps (Backend.zero_grad_set_to_none).
    optimizer.zero_grad(set_to_none=False)
    if sync is not None:
        sync()
    assert loss is not None
    return loss.detach()
