"""The optimizers `TrainConfig.optimizer` names (`choices.OPTIMIZERS`) and the learning-rate schedule, built the
way the trainer uses them.

    optimizer = make_optimizer("adamw", model.parameters(), lr=6e-4, weight_decay=0.1)
    scheduler = make_scheduler(optimizer, config)              # or at a resumed step: step=1200

"adamw" (betas 0.9, 0.95), "sgd" (momentum 0.9) and "adafactor" (`FactoredAdafactor`, the least optimizer memory);
weight decay applies to matrices only. The trainer (`Trainer.configure_optimizer`), the batch-size probe and the
memory estimates build their optimizer here. The schedule, linear warm-up then cosine decay to `min_lr_ratio` x lr,
is a pure function of the config and the step, so a resumed run rebuilds it at its step. Each choice in full:
docs/guides/training.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

from tpu_helpers.core.choices import OPTIMIZERS, check_choice


def make_optimizer(name: str, params: Iterable[torch.nn.Parameter], *, lr: float,
                   weight_decay: float = 0.0) -> torch.optim.Optimizer:
    """The optimizer `name` over `params` (only those that require gradients are given to it)."""
    check_choice("optimizer", name, OPTIMIZERS)
    params = [p for p in params if p.requires_grad]
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=weight_decay)
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if name == "adafactor":
        return FactoredAdafactor(groups, lr=lr)
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, foreach=_foreach(params))


def _foreach(params: list[torch.nn.Parameter]) -> bool | None:
    """AdamW's multi-tensor (foreach) update on XLA; torch's own default elsewhere (None: foreach on CUDA, the
    single-tensor loop on CPU). torch picks the single-tensor loop for XLA tensors, whose per-parameter Python is
    traced into the lazy graph every step: measured on XLA:CPU, 240 LoRA-adapter-sized tensors (4x64) cost about
    0.45 s of host time per step single-tensor against 0.23 s foreach (load 5 on 2 cores), with bit-identical
    weights after 6 steps and no more graphs (2 against 3). The same update, half the tracing."""
    return True if params and params[0].device.type == "xla" else None


def warmup_cosine(step: int, *, warmup: int, total: int, min_ratio: float) -> float:
    """LR multiplier: linear warmup from 1/warmup (never 0), then cosine down to `min_ratio` (kept above 0).

    Never exactly 0 or 1: XLA bakes those scalars into the graph as constants, so a step with lr 0 would compile a
    graph of its own."""
    if warmup and step < warmup:
        return (step + 1) / (warmup + 1)
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    ratio = min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return max(ratio, 1e-6)


def make_scheduler(optimizer: torch.optim.Optimizer, config: Any, *, step: int = 0) -> torch.optim.lr_scheduler.LambdaLR:
    """The warm-up + cosine schedule of `config` (lr, warmup_steps, steps, min_lr_ratio) positioned at `step`
    optimizer steps done: the learning rates in `optimizer` become those of that step."""
    for group in optimizer.param_groups:
        group["initial_lr"] = config.lr

    def factor(s: int) -> float:
        return warmup_cosine(s, warmup=config.warmup_steps, total=config.steps, min_ratio=config.min_lr_ratio)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor, last_epoch=step - 1)


class FactoredAdafactor(torch.optim.Optimizer):
    """Adafactor's memory layout without its host reads: a factored second moment (a row and a column vector per
    matrix, a full one for vectors), no first moment, the learning rate of the schedule, decoupled weight decay.

    ``torch.optim.Adafactor`` calls ``.item()`` in every step (a host sync on XLA, and impossible under the fake
    tensors of the traced memory estimate); here the bias correction uses a step count kept as a device tensor, so
    the whole update stays inside the step's compiled graph.
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, beta2: float = 0.999, eps: float = 1e-30,
                 weight_decay: float = 0.0) -> None:
        super().__init__(params, {"lr": lr, "beta2": beta2, "eps": eps, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Callable | None = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            lr, beta2, eps, decay = group["lr"], group["beta2"], group["eps"], group["weight_decay"]
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
                if decay:
                    p.mul_(1 - lr * decay)
                p.add_(g / (v / correction).sqrt().clamp_min(1e-8), alpha=-lr)
