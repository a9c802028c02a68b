"""Drop-in replacements for ops that have no XLA kernel (they would run on the CPU, a host round trip each call).

    from tpu_helpers.diagnostics import xla_safe_kl_div
    loss = xla_safe_kl_div(student_logp, teacher_p, reduction="batchmean")   # instead of F.kl_div

The detector (`diagnostics.detector.FALLBACK_HINTS`) points to these when it sees the op fall back.
"""

from __future__ import annotations

import torch


def xla_safe_kl_div(input: torch.Tensor, target: torch.Tensor, *, reduction: str = "batchmean",
                    log_target: bool = False) -> torch.Tensor:
    """`torch.nn.functional.kl_div` written with elementwise ops only, so it lowers to XLA everywhere.

    `input` holds log-probabilities; `target` probabilities (or log-probabilities with `log_target=True`).
    Pointwise: target * (log(target) - input), with 0 * log(0) = 0 as in torch (xlogy).
    """
    if reduction not in ("batchmean", "sum", "mean", "none"):
        raise ValueError(f"reduction={reduction!r} is not one of ('batchmean', 'sum', 'mean', 'none')")
    if log_target:
        pointwise = torch.exp(target) * (target - input)
    else:
        pointwise = torch.xlogy(target, target) - target * input
    if reduction == "none":
        return pointwise
    if reduction == "sum":
        return pointwise.sum()
    if reduction == "mean":
        return pointwise.mean()
    return pointwise.sum() / input.size(0)
