"""AdamW's step captured once and replayed (`TrainConfig.replay_steps` on XLA), for the trainer's `apply_gradients`.

Traced lazily, an optimizer step is Python over every parameter, every step, often more host time than the
replayed forward and backward. Here the same update (torch's own `adam` with decoupled weight decay, on the
optimizer's own state tensors) and the gradient clipping are captured by `backend.compile_step` once per shape
and replayed; the optimizer stays a `torch.optim.AdamW` (made `capturable`), so its state dict is torch's own.

    if can_replay(optimizer, backend):
        grad_norm = replayed_step(optimizer, backend, clip_norm=config.grad_clip)

Only torch's AdamW, in one process (one device or an SPMD mesh), without a gradient scaler. What differs from
the lazy step, and why: docs/guides/speed.md.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim.adam import adam


def can_replay(optimizer: torch.optim.Optimizer, backend: Any) -> bool:
    """Whether `replayed_step` can take this step: torch's AdamW (no amsgrad, maximize or differentiable, no step
    hooks), one process (one device or an SPMD mesh), no gradient scaler."""
    if type(optimizer) is not torch.optim.AdamW or getattr(backend, "scaler", None) is not None:
        return False
    if not backend.compiles_graphs or backend.world_size > 1:
        return False
    if getattr(optimizer, "_optimizer_step_pre_hooks", None) or getattr(optimizer, "_optimizer_step_post_hooks", None):
        return False  # hooks on optimizer.step(), which the replay does not call
    return not any(g["amsgrad"] or g["maximize"] or g["differentiable"] for g in optimizer.param_groups)


def prepare(optimizer: torch.optim.AdamW) -> None:
    """`capturable` set and the step counts on the parameters' device, as torch keeps them for a captured step (and
    as `load_state_dict` restores them from a checkpoint saved so); the state of a parameter's first step made as
    torch's `_init_group` makes it (zero moments, step 0), so that the first step is replayed too."""
    for group in optimizer.param_groups:
        group["capturable"] = True
        for p in group["params"]:
            state = optimizer.state[p]
            if p.grad is not None and len(state) == 0:
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            elif "step" in state and state["step"].device != p.device:
                state["step"] = state["step"].to(p.device)


def replayed_step(optimizer: torch.optim.AdamW, backend: Any, *, clip_norm: float | None) -> torch.Tensor | None:
    """Clip and step `optimizer` through one captured graph; returns the gradient norm (a device tensor) when
    clipping, else None. The parameters, moments and step counts are updated in place, as `optimizer.step()` would."""
    prepare(optimizer)
    groups = []
    for group in optimizer.param_groups:
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            continue
        states = [optimizer.state[p] for p in params]
        lr = torch.tensor(float(group["lr"]), dtype=torch.float32).to(params[0].device)
        beta1, beta2 = group["betas"]
        groups.append((params, [p.grad for p in params], [s["exp_avg"] for s in states],
                       [s["exp_avg_sq"] for s in states], [s["step"] for s in states], lr,
                       (float(beta1), float(beta2), float(group["eps"]), float(group["weight_decay"]))))
    if not groups:
        return None
    norm, new = backend.compile_step(adamw_update, over_mesh=True)(groups, clip_norm)
    # Into the optimizer's own tensors (see the module docstring), in `adamw_update`'s order: per group, its params,
    # exp_avgs, exp_avg_sqs, steps.
    backend.assign([t for params, _, exp_avgs, exp_avg_sqs, steps, *_ in groups
                    for part in (params, exp_avgs, exp_avg_sqs, steps) for t in part], new)
    optimizer._opt_called = True  # what the LR scheduler's wrapper of `optimizer.step` marks: a step was taken
    return norm


def adamw_update(groups: list, clip_norm: float | None) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
    """The captured step: `groups` holds, per parameter group, (params, grads, exp_avgs, exp_avg_sqs, steps,
    lr tensor, (beta1, beta2, eps, weight_decay)). Clipping as `torch.nn.utils.clip_grad_norm_` computes it.
    Returns the gradient norm (None without clipping) and the updated params, exp_avgs, exp_avg_sqs and steps, group
    by group, as new tensors: the inputs are left as they were."""
    norm = None
    if clip_norm is not None:
        # torch.nn.utils.get_total_norm's arithmetic (its grouping by device and dtype is not traceable)
        norms = torch._foreach_norm([g for group in groups for g in group[1]], 2.0)
        norm = torch.linalg.vector_norm(torch.stack(norms), 2.0)
        coef = torch.clamp(clip_norm / (norm + 1e-6), max=1.0)
        groups = [(g[0], torch._foreach_mul(g[1], coef), *g[2:]) for g in groups]
    new: list[torch.Tensor] = []
    with torch.no_grad():
        for params, grads, exp_avgs, exp_avg_sqs, steps, lr, (beta1, beta2, eps, weight_decay) in groups:
            params, exp_avgs, exp_avg_sqs, steps = ([t.detach().clone() for t in part]
                                                    for part in (params, exp_avgs, exp_avg_sqs, steps))
            adam(params, grads, exp_avgs, exp_avg_sqs, [], steps, foreach=True, capturable=True,
                 decoupled_weight_decay=True, amsgrad=False, beta1=beta1, beta2=beta2, lr=lr,
                 weight_decay=weight_decay, eps=eps, maximize=False)
            new += [*params, *exp_avgs, *exp_avg_sqs, *steps]
    return norm, new
