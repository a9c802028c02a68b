"""What the tuning panel suggests so that a step fits, keeping the global batch (used by ``TuningPanel.suggestion``).

In order: a smaller micro-batch with more accumulation; when not even batch 1/chip fits, gradient checkpointing,
then fsdp over the slice's chips (``sharding='fsdp'``, or a DxF mesh with fsdp over one TPU host), each alone and
with checkpointing, then bf16 weights; when nothing on this slice fits, how many chips fsdp needs::

    s = suggest(panel)         # Suggestion(text, changes) or None; changes is None for advice only
    panel.set(**s.changes)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from tpu_helpers.memory.report import largest_fitting_batch, resolve_hardware
from tpu_helpers.panel.options import (
    check_panel_sharding,
    chips_text,
    max_fsdp,
    slice_sizes,
    split_batch,
    widest_sharding,
)


@dataclass(frozen=True)
class Suggestion:
    text: str
    changes: dict | None  # None: advice only, nothing the panel can apply


_WORDS = {"gradient_checkpointing": lambda v: "turn on gradient checkpointing",
          "pure_bf16": lambda v: "store weights in bf16 (pure_bf16)",
          "sharding": lambda v: f"use sharding={v!r}"}


def max_batch_with(panel, **changes: Any) -> int:
    """The largest batch per chip that fits with ``changes`` to the panel's state (0: not even 1)."""
    st = dataclasses.replace(panel.state, **changes)
    spec = resolve_hardware(st.hardware)
    return largest_fitting_batch(panel._estimator(st), spec.hbm_bytes * (1 - st.safety_margin))


def fitting_split(panel, per_chip: int, **changes: Any) -> tuple[int, int, int]:
    """(micro-batch, grad_accum, largest micro-batch) that carry `per_chip` samples per step and fit with
    ``changes``; a micro-batch of 0 when nothing does. Accumulating keeps the gradients alive while the next
    micro-batch runs (the trainer drops them only between steps), so a split has its own, smaller, largest batch."""
    whole = max_batch_with(panel, grad_accum=1, **changes)
    if per_chip <= whole:
        return per_chip, 1, whole
    largest = max_batch_with(panel, grad_accum=2, **changes)
    if largest < 1:
        return 0, 0, 0
    b, a = split_batch(per_chip, largest)
    return b, a, largest


def suggest(panel) -> Suggestion | None:
    st, rep = panel.state, panel.report
    assert rep is not None
    g, per_chip = panel.result()["global_batch"], st.batch_size * st.grad_accum
    keep = f"for global batch {g}"
    b, a, m = fitting_split(panel, per_chip)
    if rep.fits:
        if st.grad_accum > 1 and b > st.batch_size:
            return Suggestion(f"a larger micro-batch fits: batch {b}/chip x accumulation {a} {keep}",
                              {"batch_size": b, "grad_accum": a})
        return None
    if m >= 1:
        text = f"largest batch {m}/chip: use batch {b}/chip x accumulation {a} {keep}"
        if not st.gradient_checkpointing:
            ck = max_batch_with(panel, gradient_checkpointing=True)
            if ck > m:
                text += f" (or turn on gradient checkpointing: up to {ck}/chip, about 1/3 more compute)"
        return Suggestion(text, {"batch_size": b, "grad_accum": a})
    spec = resolve_hardware(st.hardware)
    shard = []
    if max_fsdp(spec, st.chips) > check_panel_sharding(st.sharding, st.chips, spec)[1]:
        shard = [{"sharding": widest_sharding(spec, st.chips)}]
    ck = {"gradient_checkpointing": True}
    options = [ck, *shard, *({**s, **ck} for s in shard)]
    if spec.bf16_supported and st.precision in ("bf16", "auto"):
        bf = {"pure_bf16": True}
        options += [bf, {**ck, **bf}, *({**s, **ck, **bf} for s in shard)]
    for extra in options:
        if all(getattr(st, k) == v for k, v in extra.items()):
            continue
        b, a, m2 = fitting_split(panel, per_chip, **extra)
        if b >= 1:
            what = " and ".join(_WORDS[k](v) for k, v in extra.items())
            return Suggestion(f"{_none_fits(panel)}: {what} (fits at {m2}/chip), then batch {b}/chip x "
                              f"accumulation {a} {keep}", {**extra, "batch_size": b, "grad_accum": a})
    return Suggestion(_needs_more_chips(panel), None)


def _none_fits(panel) -> str:
    if max_batch_with(panel, grad_accum=1) >= 1:  # one micro-batch would, but not the global batch's split
        return "with gradient accumulation (the gradients kept between micro-batches) not even batch 1/chip fits"
    return "not even batch 1/chip fits"


def _needs_more_chips(panel) -> str:
    """Advice when nothing on this slice fits: the smallest slice on which fsdp (with checkpointing) does."""
    st = panel.state
    spec = resolve_hardware(st.hardware)
    widest = max_fsdp(spec, st.chips)
    tried = ("fsdp, " if widest > 1 else "") + "checkpointing" + (" or bf16 weights" if spec.bf16_supported else "")
    here = f"not even batch 1/chip fits on {chips_text(st.chips)} of {spec.name}, with {tried}"
    for n in (n for n in slice_sizes(spec) if n > st.chips):
        if max_fsdp(spec, n) <= widest:
            continue  # a TPU pod: fsdp stays within one host, so more hosts hold no more of the model
        if max_batch_with(panel, chips=n, sharding=widest_sharding(spec, n), gradient_checkpointing=True) >= 1:
            return (f"{here}: it needs fsdp over {n} chips (sharding={widest_sharding(spec, n)!r} on a slice of "
                    f"{n} with gradient checkpointing), or a chip with more memory")
    most = max_fsdp(spec, max(slice_sizes(spec)))
    return (f"{here}; fsdp is limited to {chips_text(most)}"
            + (" (one host: the trainer does not shard across hosts)" if spec.kind == "tpu" else "")
            + ", and even that does not fit: use a chip with more memory, LoRA or a smaller model")
