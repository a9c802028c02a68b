"""Which batches the Trainer accepts, and the loss of one: `(inputs, targets)` pairs or Hugging Face dict batches.

    loss = batch_loss(model, batch, loss_fn)

- a pair `(inputs, targets)`: `loss_fn(model(inputs), targets)`, or with `loss_fn=None` `model(inputs, targets)`,
  which returns the loss, `(output, loss)` or an output with `.loss`;
- a dict (or `transformers.BatchEncoding`) with `input_ids` (and usually `attention_mask`, `labels`): `model(**batch)`,
  which must return an output with `.loss` (a Hugging Face model does when `labels` are given).

Anything else is a TypeError naming what it got and these forms.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

ACCEPTED_BATCHES = ("a pair (inputs, targets) of tensors",
                    "a dict with 'input_ids' (and 'attention_mask', 'labels') for a model returning .loss")


def _describe(batch: Any) -> str:
    if isinstance(batch, Mapping):
        return f"a dict with keys {sorted(map(str, batch))}"
    if isinstance(batch, (tuple, list)):
        return f"a {type(batch).__name__} of {len(batch)} ({', '.join(type(x).__name__ for x in batch)})"
    return f"a {type(batch).__name__}"


def bad_batch(batch: Any, why: str = "") -> TypeError:
    return TypeError(f"the Trainer got {_describe(batch)}{why}; accepted batches: {'; '.join(ACCEPTED_BATCHES)}")


def output_loss(out: Any) -> torch.Tensor | None:
    """The loss in a model's output: a tensor, `(output, loss)`, or anything with `.loss` / `["loss"]`."""
    if isinstance(out, torch.Tensor):
        return out
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, Mapping):
        loss = out.get("loss")
    if loss is None and isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], torch.Tensor):
        loss = out[1]
    return loss


def batch_loss(model: torch.nn.Module, batch: Any, loss_fn: Callable | None = None) -> torch.Tensor:
    """The (mean) loss of one batch in any accepted form."""
    if isinstance(batch, Mapping):
        if "input_ids" not in batch:
            raise bad_batch(batch, " without 'input_ids'")
        if loss_fn is not None:
            raise bad_batch(batch, " together with a loss_fn (dict batches take the model's own .loss)")
        loss = output_loss(model(**batch))
        if loss is None:
            raise TypeError(f"{type(model).__name__}(**batch) returned no loss for a batch with keys "
                            f"{sorted(batch)}; include 'labels' (a Hugging Face model then returns .loss)")
        return loss
    if isinstance(batch, (tuple, list)) and len(batch) == 2 and all(isinstance(x, torch.Tensor) for x in batch):
        inputs, targets = batch
        if loss_fn is not None:
            return loss_fn(model(inputs), targets)
        loss = output_loss(model(inputs, targets))
        if loss is None:
            raise TypeError(f"{type(model).__name__}(inputs, targets) returned no loss; return the loss, "
                            "(output, loss) or an output with .loss, or pass loss_fn")
        return loss
    raise bad_batch(batch)


def target_tokens(labels: torch.Tensor) -> torch.Tensor:
    """How many positions a causal LM is trained on: labels shifted by one, -100 excluded (a device tensor)."""
    return (labels[:, 1:] != -100).sum()


def causal_lm_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy over the target tokens (float32), for averaging over a whole step."""
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100, reduction="sum")
