"""A run that diverges (problem 6): nan/inf values are refused by TrainConfig, a nan loss at a log read stops the
run with a clear error, and a non-finite state is never saved over the good checkpoints."""

from __future__ import annotations

import pytest
import torch

from tests.support import tiny_config
from tpu_helpers.callbacks import Callback
from tpu_helpers.checkpoint import CheckpointManager
from tpu_helpers.config import ConfigError, TrainConfig
from tpu_helpers.models.gpt import GPT, gpt_config
from tpu_helpers.training.finite import TrainingDiverged
from tpu_helpers.training.trainer import Trainer


class PoisonAt(Callback):
    """Turns the weights into nan at the end of step `at`, as an exploding update would."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_step_end(self, trainer: Trainer) -> None:
        if trainer.step == self.at:
            with torch.no_grad():
                for p in trainer.raw_model.parameters():
                    p.fill_(float("nan"))


def _trainer(data, cfg, at: int) -> Trainer:
    train, val, tok = data
    torch.manual_seed(0)
    model = GPT(gpt_config("tiny", vocab_size=tok.vocab_size, block_size=cfg.seq_len))
    return Trainer(model, train, val, config=cfg, progress=False, callbacks=[PoisonAt(at)])


@pytest.mark.parametrize("value", [1e999, float("nan"), float("-inf")])
def test_non_finite_settings_are_refused(value) -> None:
    for name in ("lr", "weight_decay", "grad_clip", "min_lr_ratio"):
        with pytest.raises(ConfigError, match=rf"{name}=(nan|inf|-inf) is not a finite number|{name}=.*must be"):
            TrainConfig(**{name: value})


@pytest.mark.parametrize("log_every, caught_by", [(2, "the training loss became nan in steps 3-4"),
                                                  (5, "the weights hold nan/inf at step 4")],
                         ids=["at the log read", "at a save between log reads"])
def test_nan_stops_the_run_and_keeps_the_good_checkpoints(tiny_data, tmp_path, log_every, caught_by) -> None:
    cfg = tiny_config(tmp_path, steps=12, save_every=2, keep_last=2, log_every=log_every, eval_every=100)
    with pytest.raises(TrainingDiverged, match=rf"training diverged: {caught_by}.*newest good checkpoint is step 2"):
        _trainer(tiny_data, cfg, at=3).fit()
    infos = CheckpointManager(tmp_path / "run" / "checkpoints").list()
    assert [(i.step, i.valid) for i in infos] == [(2, True)]  # nothing saved after the nan, nothing pruned


def test_warn_mode_trains_on_but_never_saves_non_finite_weights(tiny_data, tmp_path) -> None:
    cfg = tiny_config(tmp_path, steps=6, save_every=2, keep_last=2, log_every=2, eval_every=100,
                      on_nonfinite="warn")
    with pytest.warns(UserWarning, match="training goes on"):
        report = _trainer(tiny_data, cfg, at=3).fit()
    assert report.steps == 6
    infos = CheckpointManager(tmp_path / "run" / "checkpoints").list()
    assert [(i.step, i.valid) for i in infos] == [(2, True)]
