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

from tpu_helpers.memory.choices import (
    check_panel_sharding,
    chips_text,
    max_fsdp,
    slice_sizes,
    split_batch,
    widest_sharding,
)
from tpu_helpers.memory.report import largest_fitting_batch, resolve_hardware


@dataclass(frozen=True)
class Suggestion:
    text: str
    changes: dict | None  # None: advice only, nothing the panel can apply


_WORDS = {"gradient_checkpointing": lambda v: "turn on gradient checkpointing",
          "precision": lambda v: "store weights in bf16 (pure-bf16)",
          "sharding": lambda v: f"use sharding={v!r}"}


def max_batch_with(panel, **changes: Any) -> int:
    """The largest batch per chip that fits with ``changes`` to the panel's state (0: not even 1)."""
    st = dataclasses.replace(panel.state, **changes)
    spec = resolve_hardware(st.hardware)
    return largest_fitting_batch(panel._estimator(st), spec.hbm_bytes * (1 - st.safety_margin))


def suggest(panel) -> Suggestion | None:
    st, rep = panel.state, panel.report
    assert rep is not None
    g, per_chip, m = panel.result()["global_batch"], st.batch_size * st.accumulation, rep.max_batch_size
    keep = f"for global batch {g}"
    if rep.fits:
        if st.accumulation > 1 and m > st.batch_size:
            b, a = split_batch(per_chip, m)
            if b > st.batch_size:
                return Suggestion(f"a larger micro-batch fits: batch {b}/chip x accumulation {a} {keep}",
                                  {"batch_size": b, "accumulation": a})
        return None
    if m >= 1:
        b, a = split_batch(per_chip, m)
        text = f"largest batch {m}/chip: use batch {b}/chip x accumulation {a} {keep}"
        if not st.gradient_checkpointing:
            ck = max_batch_with(panel, gradient_checkpointing=True)
            if ck > m:
                text += f" (or turn on gradient checkpointing: up to {ck}/chip, about 1/3 more compute)"
        return Suggestion(text, {"batch_size": b, "accumulation": a})
    spec = resolve_hardware(st.hardware)
    shard = []
    if max_fsdp(spec, st.chips) > check_panel_sharding(st.sharding, st.chips, spec)[1]:
        shard = [{"sharding": widest_sharding(spec, st.chips)}]
    ck = {"gradient_checkpointing": True}
    options = [ck, *shard, *({**s, **ck} for s in shard)]
    if spec.bf16_supported:
        bf = {"precision": "pure-bf16"}
        options += [bf, {**ck, **bf}, *({**s, **ck, **bf} for s in shard)]
    for extra in options:
        if all(getattr(st, k) == v for k, v in extra.items()):
            continue
        m2 = max_batch_with(panel, **extra)
        if m2 >= 1:
            b, a = split_batch(per_chip, m2)
            what = " and ".join(_WORDS[k](v) for k, v in extra.items())
            return Suggestion(f"not even batch 1/chip fits: {what} (fits at {m2}/chip), then batch {b}/chip x "
                              f"accumulation {a} {keep}", {**extra, "batch_size": b, "accumulation": a})
    return Suggestion(_needs_more_chips(panel), None)


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
