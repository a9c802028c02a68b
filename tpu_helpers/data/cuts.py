"""What a length limit cut from the data, said once and loudly: the one warning of SFT rows (SEQ_LEN), preference
pairs (SEQ_LEN) and GRPO prompts (MAX_PROMPT_LEN).

    warn_cut(setting="SEQ_LEN", limit=384, cut=244, total=244, longest=447, what="records",
             lost="244 of 488 trained assistant turns lose tokens (244 entirely), 20,496 trained tokens in all")

A `TruncationWarning` names how many were cut of how many, the longest, the limit that keeps every one whole, what
training loses, and that the memory plan (`job.plan()`) says whether that limit fits; the data's stats keep the
same figures. `trained_spans` finds a row's trained stretches (an assistant turn each), so a cut can be counted in
turns as well as tokens.
"""

from __future__ import annotations

import warnings


class TruncationWarning(UserWarning):
    """A length limit cut or dropped part of the data; the message names the limit that keeps it whole."""


def trained_spans(labels: list[int]) -> list[tuple[int, int]]:
    """[start, end) of each run of trained positions (labels other than -100): an assistant turn each in a chat."""
    spans, start = [], None
    for i, label in enumerate([*labels, -100]):
        if label != -100 and start is None:
            start = i
        elif label == -100 and start is not None:
            spans.append((start, i))
            start = None
    return spans


def merged(*stats: dict) -> dict:
    """The counts of several builds' stats summed (their "longest" the longest): one warning for training and
    validation rows together."""
    return {k: max(s[k] for s in stats) if k == "longest" else sum(s[k] for s in stats)
            for k in stats[0] if all(k in s for s in stats) and all(isinstance(s[k], int) for s in stats)}


def warn_cut(*, setting: str, limit: int, cut: int, total: int, longest: int, what: str, verb: str = "cuts",
             lost: str = "") -> None:
    """Warn once that `setting`=`limit` `verb` `cut` of `total` `what`, the longest `longest` tokens; `lost`: what
    training loses by it. Nothing when nothing was cut."""
    if cut < 1:
        return
    warnings.warn(
        f"{setting}={limit} {verb} {cut} of {total} {what} (the longest is {longest} tokens: {setting}={longest} "
        f"keeps every one whole){f'; {lost}' if lost else ''}. Raise {setting} (the memory plan, job.plan(), says "
        f"whether that fits) or shorten the data.", TruncationWarning, stacklevel=3)
