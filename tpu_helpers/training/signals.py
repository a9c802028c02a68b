"""Stop a training run cleanly on SIGTERM or Ctrl-C / the notebook's stop button, losing no finished step.

`Trainer.fit` runs inside `stop_on_signals(trainer.outcome, step=lambda: trainer.step, hint=...)`:

- first signal: the run's stop reason is set on its `outcome.RunOutcome` (e.g. "signal SIGTERM at step 41"); the
  loop finishes the step it is in, saves a checkpoint and returns normally, then says how to resume (`resume_hint`);
- second signal: stop at once (SIGINT raises KeyboardInterrupt, SIGTERM SystemExit(143)); checkpoints are
  written atomically, so the previous one is intact and the rerun resumes from it.

Handlers are installed only for the duration of `fit`, only from the main thread, and the previous ones are put
back afterwards. Exit statuses, notebooks and several processes: docs/guides/preemption.md.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

SIGNALS = tuple(s for s in (getattr(signal, "SIGTERM", None), signal.SIGINT) if s is not None)
_PREFIX = "signal "


def _say(message: str) -> None:
    # stderr, flushed: the line must be out before a supervisor's SIGKILL follows the SIGTERM.
    print(f"[tpu_helpers] {message}", file=sys.stderr, flush=True)


class _Guard:
    def __init__(self, outcome: Any, step: Callable[[], int]) -> None:
        self.outcome, self.step = outcome, step
        self.received: list[int] = []

    def handle(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        self.received.append(signum)
        if len(self.received) == 1:
            step = self.step()
            self.outcome.stop(f"{_PREFIX}{name} at step {step}", by_signal=True)
            _say(f"received {name} at step {step}: finishing this step, saving a checkpoint and stopping "
                 f"(send it again to stop at once)")
            return
        _say(f"received {name} again: stopping now (the last saved checkpoint is intact)")
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(128 + signum)


def resume_hint(stop_reason: str | None, *, step: int, steps: int, out_dir: Any, last_path: Path | None) -> str:
    """The message printed after a signal-stopped run: where it stopped (`step` of `steps`) and how to continue it
    (`last_path`: the checkpoint this run saved last, if any)."""
    if step >= steps:
        return f"{stop_reason} came after the last step: the run is complete ({steps} steps)"
    saved = f"checkpoint {last_path}" if last_path is not None else "no new checkpoint (no step finished)"
    return (
        f"stopped at step {step} of {steps} ({stop_reason}); {saved}. "
        f"To continue, run the same notebook or command again with out_dir={str(out_dir)!r} and "
        f"resume=True: it resumes from the newest good checkpoint."
    )


@contextlib.contextmanager
def stop_on_signals(outcome: Any, step: Callable[[], int], hint: Callable[[], str] | None = None) -> Iterator[None]:
    """Route SIGTERM/SIGINT to `outcome.stop(...)` (an `outcome.RunOutcome`) while the block runs; `step()` is the
    run's current step, named in the stop reason; `hint()`, said after a signal stopped the run, how to resume
    (`resume_hint`). See the module docstring."""
    outcome.new_fit()  # a signal that stopped an earlier fit must not stop this one
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    guard = _Guard(outcome, step)
    previous = {s: signal.getsignal(s) for s in SIGNALS}
    for s in SIGNALS:
        signal.signal(s, guard.handle)
    try:
        yield
    finally:
        for s, handler in previous.items():
            # None means the handler was not installed from Python; the default action is the closest match.
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)
    if guard.received and hint is not None:
        _say(hint())


def is_signal_stop(reason: str | None) -> bool:
    """Whether a `stop_reason` came from a signal (rather than a callback)."""
    return isinstance(reason, str) and reason.startswith(_PREFIX)
