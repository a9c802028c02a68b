"""How a run ends, in one place: why it stops early (a signal, a callback, a divergence) and what diverged.

    outcome = RunOutcome(config)
    outcome.stop("early stopping: val loss flat")          # a callback (through `Trainer.stop_reason = ...`)
    outcome.stop("signal SIGTERM at step 41", by_signal=True)   # signals.py
    outcome.diverge("the training loss became nan in steps 3-4")             # kind "nonfinite": on_nonfinite
    outcome.diverge("the validation loss rose to ...", kind="spike")        # divergence.py: on_divergence
    outcome.stop_reason, outcome.diverged, outcome.warned                   # what the loop and fit read

The trainer owns one `RunOutcome`; the loss checks, the save, the signal handler and callbacks report into it.
The loop reads `stop_reason` (end after this step), the save reads `diverged` (save nothing more) and `fit` raises
`finite.TrainingDiverged` when `diverged` is set. Who reports what, and the policies: docs/guides/preemption.md.
"""

from __future__ import annotations

from typing import Any

from tpu_helpers.training.guard import divergence

KINDS = ("nonfinite", "spike")


class RunOutcome:
    """Why a run stops early and what diverged (see the module docstring). Kept across `fit` calls of a trainer:
    a divergence or a callback's stop still holds at the next `fit`; a signal's stop does not (`new_fit`)."""

    def __init__(self, config: Any) -> None:
        self.config = config  # read at each divergence: its on_nonfinite and on_divergence policies
        self.stop_reason: str | None = None  # set to end the run after the current step
        self.stopped_by_signal = False  # whether stop_reason came from a signal (signals.py), not a callback
        self.diverged: str | None = None  # the divergence the run stops on, in words
        self.warned: set[str] = set()  # kinds already warned about ("warn" says it once per kind)

    def stop(self, reason: str | None, *, by_signal: bool = False) -> None:
        """End the run after the current step, for `reason` (None: carry on after all)."""
        self.stop_reason = reason
        self.stopped_by_signal = by_signal and reason is not None

    def new_fit(self) -> None:
        """At the start of `fit`: a signal that stopped an earlier fit must not stop this one."""
        if self.stopped_by_signal:
            self.stop(None)

    def watching(self, kind: str) -> bool:
        """Whether a divergence of `kind` would still change anything: none stopped the run yet, this kind was not
        warned about, and its policy is not "off". Lets a check skip work whose finding would be ignored."""
        return self.diverged is None and kind not in self.warned and divergence.policy(self.config, kind) != "off"

    def diverge(self, what: str, *, kind: str = "nonfinite") -> None:
        """A divergence, `what` in words: "nonfinite" (a nan/inf loss or weights) or "spike" (a finite loss far
        above its reference). Applies the kind's policy: see the module docstring."""
        if kind not in KINDS:
            raise ValueError(f"kind={kind!r}: expected one of {KINDS}")
        if not self.watching(kind):
            return
        if divergence.policy(self.config, kind) == "stop":
            self.diverged = what
            self.stop(f"diverged: {what}")
            return
        self.warned.add(kind)
        divergence.warn(what, kind)
