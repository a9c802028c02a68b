"""In-process checks of the signal guard and of exact resume, on the CPU and on XLA:CPU.

Real signals (os.kill on this process) are sent from a callback in the middle of `fit`. Exact resume: a run
stopped after several steps and continued by fresh Trainer objects (new model, new optimizer, as a rerun of a
notebook makes them) must end where an uninterrupted run ends, bit for bit, on the CPU and on XLA:CPU (measured:
max |diff| 0 there as well; see `test_exact_resume_xla`).
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import pytest
import torch

from tests.support import XLA_BACKEND, StopAt, tiny_config
from tpu_helpers.checkpoint import CheckpointManager
from tpu_helpers.core.callbacks import Callback
from tpu_helpers.models.gpt import GPT, gpt_config
from tpu_helpers.training.signals import is_signal_stop, stop_on_signals
from tpu_helpers.training.trainer import Trainer

STEPS = 16


class SendSignals(Callback):
    """Sends `count` real signals to this process at the end of step `at`."""

    def __init__(self, sig: int, at: int, count: int = 1) -> None:
        self.sig, self.at, self.count = sig, at, count
        self.handler_during_fit = None

    def on_step_end(self, trainer: Trainer) -> None:
        self.handler_during_fit = signal.getsignal(self.sig)
        if trainer.step == self.at:
            for _ in range(self.count):
                os.kill(os.getpid(), self.sig)  # Python runs the handler before the next bytecode


def _trainer(data, cfg, callbacks=()) -> Trainer:
    train, val, tok = data
    torch.manual_seed(cfg.seed)  # the same initial weights in every segment, as a rerun would build them
    model = GPT(gpt_config("tiny", vocab_size=tok.vocab_size, block_size=cfg.seq_len, dropout=0.1))
    return Trainer(model, train, val, config=cfg, progress=False, callbacks=list(callbacks))


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_first_signal_finishes_the_step_saves_and_restores_handlers(tiny_data, tmp_path: Path, sig, capsys) -> None:
    before = signal.getsignal(sig)
    sender = SendSignals(sig, at=3)
    trainer = _trainer(tiny_data, tiny_config(tmp_path, steps=20, save_every=10), [sender])
    report = trainer.fit()
    assert report.steps == 3 and report.stop_reason == f"signal {sig.name} at step 3"
    assert is_signal_stop(report.stop_reason) and "stopped early" in str(report)
    assert CheckpointManager(tmp_path / "run" / "checkpoints").latest().step == 3
    assert sender.handler_during_fit not in (before, signal.SIG_DFL)  # ours while fitting...
    assert signal.getsignal(sig) is before  # ...and the previous one afterwards
    err = capsys.readouterr().err
    assert f"received {sig.name} at step 3" in err and "stopped at step 3 of 20" in err and "resume=True" in err
    # The same trainer can fit again: the old signal does not stop the new fit.
    trainer.callbacks.clear()
    assert trainer.fit().steps == 20 and trainer.stop_reason is None


@pytest.mark.parametrize("sig, exc", [(signal.SIGINT, KeyboardInterrupt), (signal.SIGTERM, SystemExit)],
                         ids=["SIGINT", "SIGTERM"])
def test_second_signal_stops_at_once(tiny_data, tmp_path: Path, sig, exc) -> None:
    before = signal.getsignal(sig)
    trainer = _trainer(tiny_data, tiny_config(tmp_path, steps=20, save_every=2), [SendSignals(sig, at=5, count=2)])
    with pytest.raises(exc) as info:
        trainer.fit()
    if exc is SystemExit:
        assert info.value.code == 128 + signal.SIGTERM
    assert signal.getsignal(sig) is before
    infos = CheckpointManager(tmp_path / "run" / "checkpoints").list()
    assert [i.step for i in infos] == [2, 4] and all(i.valid for i in infos)  # no save for step 5


def test_guard_outside_the_main_thread_leaves_handlers_alone(tiny_data, tmp_path: Path) -> None:
    trainer = _trainer(tiny_data, tiny_config(tmp_path, steps=2))
    seen = []

    def run() -> None:
        with stop_on_signals(trainer.outcome, lambda: trainer.step):
            seen.append(signal.getsignal(signal.SIGTERM))

    before = signal.getsignal(signal.SIGTERM)
    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert seen == [before]


def _final_weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in trainer.raw_model.state_dict().items()}


def _interrupted_and_uninterrupted(data, tmp_path: Path, stops: list[int], steps: int = STEPS, **overrides):
    cfg_full = tiny_config(tmp_path / "full", steps=steps, save_every=100, eval_every=7, log_every=5, **overrides)
    full = _trainer(data, cfg_full)
    full.fit()
    cfg = tiny_config(tmp_path / "parts", steps=steps, save_every=100, eval_every=7, log_every=5, **overrides)
    resumed_from = []
    for _ in range(len(stops) + 1):
        part = _trainer(data, cfg, [StopAt(stops)])
        report = part.fit()
        resumed_from.append(report.resumed_from)
    assert report.steps == steps and resumed_from == [None, *stops]
    # Same data order and schedule: the logged learning rates and validation losses agree too.
    assert [r["lr"] for r in part.history.train] == [r["lr"] for r in full.history.train]
    return _final_weights(full), _final_weights(part), full, part


def test_exact_resume_cpu_is_bitwise(tiny_data, tmp_path: Path) -> None:
    # 40 training samples = 5 batches per epoch: 16 steps cross three epoch boundaries, and the stop at step 10
    # falls exactly on one. The other stops are off the save/log/eval grid on purpose.
    train, val, tok = tiny_data
    data = (torch.utils.data.Subset(train, range(40)), val, tok)
    full, part, t_full, t_part = _interrupted_and_uninterrupted(data, tmp_path, [3, 8, 10, 11])
    assert t_part.epoch == t_full.epoch == 3
    for name in full:
        assert torch.equal(full[name], part[name]), name
    assert t_full.history.eval == t_part.history.eval


@pytest.mark.xla
@pytest.mark.skipif(XLA_BACKEND is None, reason="torch_xla is not installed")
def test_exact_resume_xla(tiny_data, tmp_path: Path) -> None:
    full, part, _, _ = _interrupted_and_uninterrupted(tiny_data, tmp_path, [3, 7], steps=10, device="xla",
                                                  eval_batches=1)
    worst = max(float((full[n] - part[n]).abs().max()) for n in full)
    print(f"XLA:CPU interrupted vs uninterrupted: max |diff| = {worst:.3g}")
    # Measured: bit for bit here too. The resumed process runs the same compiled step graph on the same inputs
    # (weights, optimizer state and the XLA RNG seed restored exactly), and XLA:CPU is deterministic. Were a
    # compiler change to fuse the first resumed step differently, differences would stay at float rounding.
    assert worst == 0.0


@pytest.mark.parametrize("damage", ["truncate", "bitflip"])
def test_rerun_over_a_damaged_newest_checkpoint_resumes_from_the_one_before(tiny_data, tmp_path: Path,
                                                                          damage: str) -> None:
    cfg = tiny_config(tmp_path, steps=6, save_every=2, keep_last=3)
    _trainer(tiny_data, cfg).fit()
    newest = tmp_path / "run" / "checkpoints" / "ckpt-00000006.pt"
    data = newest.read_bytes()
    newest.write_bytes(data[: len(data) // 3] if damage == "truncate" else
                       data[:100] + bytes([data[100] ^ 0x10]) + data[101:])
    reason = "truncated" if damage == "truncate" else "checksum mismatch"
    with pytest.warns(UserWarning, match=rf"ckpt-00000006\.pt is damaged \({reason}.*falling back"):
        report = _trainer(tiny_data, cfg.replace(steps=8)).fit()
    assert report.resumed_from == 4 and report.steps == 8
    infos = CheckpointManager(tmp_path / "run" / "checkpoints").list()
    assert [(i.step, i.valid) for i in infos] == [(4, True), (6, True), (8, True)]  # step 6 re-done and replaced
