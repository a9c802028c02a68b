"""The run's outcome (training/guard/outcome.py): the policy of each kind of divergence, and who stopped the run."""

from __future__ import annotations

import warnings

import pytest

from tpu_helpers.config import TrainConfig
from tpu_helpers.training.guard.finite import DivergenceWarning
from tpu_helpers.training.guard.outcome import RunOutcome
from tpu_helpers.training.signals import stop_on_signals


def test_stop_records_the_first_divergence_and_ends_the_run() -> None:
    outcome = RunOutcome(TrainConfig(on_nonfinite="stop", on_divergence="stop"))
    assert outcome.watching("nonfinite") and outcome.watching("spike")
    outcome.diverge("the training loss became nan in steps 3-4")
    assert outcome.diverged == "the training loss became nan in steps 3-4"
    assert outcome.stop_reason == "diverged: the training loss became nan in steps 3-4"
    assert not outcome.stopped_by_signal and not outcome.watching("spike")
    outcome.diverge("the weights hold nan/inf at step 4")  # the same blow-up seen again: the first one stays
    outcome.diverge("the validation loss rose", kind="spike")
    assert outcome.diverged == "the training loss became nan in steps 3-4" and not outcome.warned


def test_warn_says_it_once_per_kind_and_the_run_goes_on() -> None:
    outcome = RunOutcome(TrainConfig(on_nonfinite="warn", on_divergence="warn"))
    with pytest.warns(DivergenceWarning, match="the validation loss rose"):
        outcome.diverge("the validation loss rose", kind="spike")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second spike says nothing
        outcome.diverge("the validation loss rose again", kind="spike")
    with pytest.warns(UserWarning, match="on_nonfinite='warn'"):  # another kind: its own warning
        outcome.diverge("the training loss became inf in steps 1-2")
    assert outcome.warned == {"spike", "nonfinite"}
    assert outcome.diverged is None and outcome.stop_reason is None
    assert not outcome.watching("spike") and not outcome.watching("nonfinite")


def test_off_does_nothing_and_kinds_have_their_own_policy() -> None:
    outcome = RunOutcome(TrainConfig(on_nonfinite="stop", on_divergence="off"))
    assert not outcome.watching("spike") and outcome.watching("nonfinite")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        outcome.diverge("the training loss stayed high", kind="spike")
    assert outcome.diverged is None and outcome.stop_reason is None and not outcome.warned
    outcome.diverge("the validation loss became nan at step 10")
    assert outcome.diverged == "the validation loss became nan at step 10"
    with pytest.raises(ValueError, match="kind='typo'"):
        outcome.diverge("x", kind="typo")


def test_a_signal_stop_is_forgotten_at_the_next_fit_a_callback_stop_is_not() -> None:
    outcome = RunOutcome(TrainConfig())
    outcome.stop("signal SIGTERM at step 41", by_signal=True)
    assert outcome.stopped_by_signal and outcome.stop_reason == "signal SIGTERM at step 41"
    with stop_on_signals(outcome, lambda: 41):
        assert outcome.stop_reason is None and not outcome.stopped_by_signal
    outcome.stop("early stopping: the validation loss is flat")  # a callback, through trainer.stop_reason
    outcome.new_fit()
    assert outcome.stop_reason == "early stopping: the validation loss is flat" and not outcome.stopped_by_signal
    outcome.stop(None)
    assert outcome.stop_reason is None
