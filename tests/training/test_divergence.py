"""A run that diverges (problem 6): nan/inf values are refused by TrainConfig, a nan loss at a log read stops the
run with a clear error, and a non-finite state is never saved over the good checkpoints. A loss that blows up but
stays finite stops the run too (on_divergence), naming the best checkpoint; a healthy noisy run is not stopped."""

from __future__ import annotations

import re
import statistics
import warnings

import pytest
import torch

from tests.support import XLA_BACKEND, StopAt, tiny_config
from tpu_helpers.checkpoint import CheckpointManager
from tpu_helpers.config import ConfigError, TrainConfig
from tpu_helpers.core.callbacks import Callback
from tpu_helpers.models.gpt import GPT, gpt_config
from tpu_helpers.training.guard.divergence import SpikeRule
from tpu_helpers.training.guard.finite import DivergenceWarning, TrainingDiverged
from tpu_helpers.training.history import History
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


# ---- a blow-up that stays finite (training/guard/divergence.py) -----------------------------------------------------------
LR50 = ["--preset", "tiny", "--seq_len", "32", "--batch_size", "8", "--steps", "30", "--save_every", "10",
        "--eval_every", "10", "--lr", "50"]


def _gpt(data, cfg, callbacks=()) -> Trainer:
    train, val, tok = data
    torch.manual_seed(cfg.seed)
    model = GPT(gpt_config("tiny", vocab_size=tok.vocab_size, block_size=cfg.seq_len))
    return Trainer(model, train, val, config=cfg, progress=False, callbacks=list(callbacks))


@pytest.mark.parametrize("device", ["cpu", pytest.param("xla", marks=pytest.mark.xla)])
def test_the_lr50_command_stops_at_the_first_blow_up_and_saves_nothing_diverged(tmp_path, capsys, device) -> None:
    """The command from the report: validation loss 5.5 -> 185 at step 10. It used to finish with exit 0 and only
    diverged checkpoints; now it stops at step 10, before that step's save, with the values in the error."""
    from tpu_helpers.launch.cli import main

    if device == "xla" and XLA_BACKEND is None:
        pytest.skip("torch_xla is not installed")
    assert main([*LR50, "--device", device, "--out_dir", str(tmp_path / "run")]) == 1
    out, err = capsys.readouterr()
    assert re.search(r"error: training diverged: the validation loss rose to \d+\.?\d* at step 10, \d+\.\d x its "
                     r"lowest so far, at step 0 \(5\.5\d*; the limit is divergence_factor=3 x that\) \(lr=50\)", err), err
    assert "no checkpoint was saved before it" in err
    assert "stopped early diverged: the validation loss rose" in out  # the partial run's report is printed
    assert not list((tmp_path / "run" / "checkpoints").glob("ckpt-*")), "a diverged state was saved"


@pytest.mark.parametrize("device", ["cpu", pytest.param("xla", marks=pytest.mark.xla)])
def test_a_blow_up_after_a_healthy_start_names_the_best_checkpoint_which_loads(tiny_data, tmp_path, device) -> None:
    """Healthy to step 20 (a checkpoint and an evaluation every 10 steps), then resumed with lr=3 (lr=50 goes to
    nan/inf at once from there): the training loss jumps from 3.4 to over 100 and the run stops at step 30, when
    two log intervals are above the limit, before that step's save; the error names step 20 as the best
    checkpoint, which verifies and loads into a fresh model with the weights training had at step 20."""
    if device == "xla" and XLA_BACKEND is None:
        pytest.skip("torch_xla is not installed")
    cfg = tiny_config(tmp_path, device=device, steps=20, save_every=10, eval_every=10, log_every=5,
                      eval_batches=1)
    healthy = _gpt(tiny_data, cfg)
    healthy.fit()
    at_20 = {k: v.detach().cpu().clone() for k, v in healthy.raw_model.state_dict().items()}
    evals = {e["step"]: e["val_loss"] for e in healthy.history.eval}
    assert evals[20] < evals[10] < evals[0]

    with pytest.raises(TrainingDiverged) as info:
        _gpt(tiny_data, cfg.replace(steps=40, lr=3.0)).fit()
    message = str(info.value)
    assert re.search(r"training diverged: the training loss stayed at [\d.]+, [\d.]+ in the last 2 log intervals up "
                     r"to step 30, at least [\d.]+ x the median of the 4 log intervals before step 25", message), message
    best = info.value.report.best_checkpoint
    assert best["step"] == 20 and best["metric"] == "val_loss" and best["value"] == pytest.approx(evals[20])
    assert f"the best checkpoint is step 20 (val_loss {evals[20]:.4g}" in message
    assert info.value.report.steps == 30 and info.value.report.stop_reason.startswith("diverged: ")

    mgr = CheckpointManager(tmp_path / "run" / "checkpoints")
    assert [(i.step, i.valid) for i in mgr.list()] == [(10, True), (20, True)]  # nothing saved at step 30
    assert mgr.read_run_info()["best"]["step"] == 20
    fresh = GPT(gpt_config("tiny", vocab_size=tiny_data[2].vocab_size, block_size=cfg.seq_len))
    fresh.load_state_dict(mgr.load(best["step"])["model"])
    for name, value in fresh.state_dict().items():
        assert torch.equal(value, at_20[name]), name


def test_warn_mode_finishes_with_one_warning(tiny_data, tmp_path) -> None:
    # 20 steps: the blow-up comes at step 10 and is warned about; by step 27 the loss can reach nan on one torch
    # thread (not on two), and a nan stops the run (on_nonfinite="stop", the default).
    cfg = tiny_config(tmp_path, steps=20, batch_size=8, save_every=10, eval_every=10, log_every=1, lr=50.0,
                      warmup_steps=100, eval_batches=2, on_divergence="warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = _gpt(tiny_data, cfg).fit()
    said = [w for w in caught if issubclass(w.category, DivergenceWarning)]
    assert len(said) == 1, [str(w.message) for w in said]
    assert "training goes on (on_divergence='warn': said once)" in str(said[0].message)
    assert report.steps == 20 and report.stop_reason is None
    infos = CheckpointManager(tmp_path / "run" / "checkpoints").list()
    assert [i.step for i in infos] == [10, 20]


def test_a_healthy_run_with_a_noisy_loss_is_not_stopped_and_the_margin(tiny_data, tmp_path) -> None:
    """The package's tiny GPT with the loss read every step (the noisiest reading): at step 28 one batch's loss is
    2.8 x the median of the steps before it and is back at the next step. The run is healthy and must not stop.
    Margin: divergence_factor over the largest ratio the rule computed (printed; measured 2.49). A 150-step run
    (its schedule) interrupted after step 40, past the noise: the rest of it is tamer (benchmarks/spike_margin.py)."""
    cfg = tiny_config(tmp_path, steps=150, batch_size=8, eval_every=10, eval_batches=2, log_every=1, save_every=1000)
    trainer = _gpt(tiny_data, cfg, [StopAt(40)])
    report = trainer.fit()  # on_divergence="stop" by default: a spike would raise
    assert report.steps == 40 and trainer.diverged is None
    losses = [r["loss"] for r in trainer.history.train]
    one_step = max(losses[i] / statistics.median(losses[max(0, i - 10):i]) for i in range(4, len(losses)))
    assert one_step > 2.5, f"the run's noise changed: largest single-step ratio {one_step:.2f}"
    rule, replay, ratios = SpikeRule(cfg.divergence_factor), History(), []
    for record in trainer.history.train:
        replay.train.append(record)
        reading = rule.train_reading(replay, record["step"])
        ratios += [reading.ratio] if reading else []
    for record in trainer.history.eval:
        replay.eval.append(record)
        reading = rule.val_reading(replay, record["step"])
        ratios += [reading.ratio] if reading else []
    margin = cfg.divergence_factor / max(ratios)
    print(f"largest single-step ratio {one_step:.2f}; largest ratio the rule computed {max(ratios):.2f}; "
          f"margin to divergence_factor={cfg.divergence_factor:g}: {margin:.2f}")
    assert margin > 1.5


def test_the_spike_rule_needs_a_reference_persists_and_ignores_noise_near_zero() -> None:
    rule = SpikeRule(3.0)
    history = History()
    for step, loss in enumerate([5.0, 4.0, 3.0, 3.0], start=1):
        history.log_train(step, loss=loss)
    history.log_train(5, loss=20.0)
    assert rule.check_train(history, 5) is None  # one interval: it may come back (and 4 records is warm-up)
    history.log_train(6, loss=3.1)
    assert rule.check_train(history, 6) is None  # it did
    history.log_train(7, loss=3.0)
    history.log_train(8, loss=12.0)
    assert rule.check_train(history, 8) is None  # one interval above the limit so far
    history.log_train(9, loss=13.0)
    spike = rule.check_train(history, 9)
    assert spike and "stayed at 12, 13 in the last 2 log intervals up to step 9, at least 3.9 x" in spike
    assert "the median of the 7 log intervals before step 8 (3.1;" in spike

    history.log_eval(0, 5.5)
    history.log_eval(10, 0.02)
    history.log_eval(20, 0.07)  # 3.5 x the lowest, but a fine-tuning loss near 0: noise, not a divergence
    assert rule.check_val(history, 20) is None
    history.log_eval(30, 1.7)  # above 3 x a tenth of the first value (0.55)
    assert "a tenth of the first value (its lowest so far, at step 10 is 0.02" in rule.check_val(history, 30)
    with pytest.raises(ConfigError, match="divergence_factor=1.0 must be > 1"):
        TrainConfig(divergence_factor=1.0)
    with pytest.raises(ConfigError, match=r"on_divergence='never' is not one of \('stop', 'warn', 'off'\)"):
        TrainConfig(on_divergence="never")
