"""The best checkpoint (by validation loss, or a metric an eval callback records) is kept whatever keep_last says:
through pruning, a full disk's early deletions, a SIGKILL and a resume; it is recorded in run.json and the run
report, and the fine-tuning exports take its weights when asked (EXPORT="best")."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from tests.support import tiny_config
from tpu_helpers.checkpoint import CheckpointManager, dcp
from tpu_helpers.config import ConfigError, TrainConfig
from tpu_helpers.core.callbacks import Callback
from tpu_helpers.models.gpt import GPT, gpt_config
from tpu_helpers.training.trainer import Trainer

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "scripts" / "train_tiny.py"


def _save_all(mgr: CheckpointManager, values: dict[int, float | None], sharded_form: bool = False) -> None:
    for step, value in values.items():
        state = {"model": {"w": torch.full((4,), float(step))}, "step": step}
        meta = {"epoch": 0, "metrics": {} if value is None else {"val_loss": value, "acc": -value}}
        if sharded_form:
            def write(directory: Path, tensors: dict = state["model"]) -> list[str]:
                return dcp.write(directory, {"model": tensors}, dcp.finite_checking(DefaultSavePlanner)())

            mgr.save_sharded(step, {"step": step}, write, writer="test", size=1 << 10, meta=meta)
        else:
            mgr.save(step, state, meta=meta)


@pytest.mark.parametrize("form", ["pt", "dcp"])
def test_pruning_keeps_the_best_whatever_keep_last_says(tmp_path: Path, form: str) -> None:
    mgr = CheckpointManager(tmp_path, keep_last=2, best_metric="val_loss")
    _save_all(mgr, {1: 5.0, 2: 3.0, 3: 1.0, 4: 2.0, 5: None, 6: 4.0}, sharded_form=form == "dcp")
    assert [i.step for i in mgr.list()] == [3, 5, 6]  # the newest two and the best
    best = mgr.best()
    assert best.step == 3 and best.metric("val_loss") == 1.0 and best.path.suffix == f".{form}"
    if form == "dcp":  # an export reads the model's tensors alone
        whole = dcp.ShardedCheckpoint(best.path, "test").read_whole(parts=("model",))
        assert set(whole) == {"model"} and torch.equal(whole["model"]["w"], torch.full((4,), 3.0))
    # Higher is better for a metric that is not a loss (the Hugging Face rule), or with "max:".
    for spec in ("acc", "max:acc"):
        assert CheckpointManager(tmp_path, best_metric=spec).best().step == 3
    assert CheckpointManager(tmp_path, best_metric="min:acc").best().step == 6
    assert CheckpointManager(tmp_path, best_metric=None).best() is None
    # A damaged best is not the best: the next one that verifies is.
    data = best.path / ".metadata" if form == "dcp" else best.path
    data.write_bytes(b"damaged")
    assert CheckpointManager(tmp_path, keep_last=2, best_metric="val_loss").best().step == 6


def test_a_full_disk_deletes_older_checkpoints_first_but_never_the_best(tmp_path: Path, monkeypatch) -> None:
    import shutil

    mgr = CheckpointManager(tmp_path, keep_last=2, best_metric="val_loss")
    _save_all(mgr, {1: 1.0, 2: 3.0, 3: 2.0})
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage._replace(free=10))  # no room for another one
    deleted = []
    delete = mgr._delete
    monkeypatch.setattr(mgr, "_delete", lambda step: (deleted.append(step), delete(step)))
    monkeypatch.setattr(mgr, "_prune", lambda **_: None)  # only the deletions before the save
    _save_all(mgr, {4: 2.5})
    # Before the save, "make room" kept keep_last - 1 = 1 checkpoint (step 3) and the best (step 1).
    assert deleted == [2] and [i.step for i in mgr.list()] == [1, 3, 4]


def test_best_metric_values_are_checked() -> None:
    for bad in ("", "max:", "top:acc", 3):
        with pytest.raises(ConfigError, match="best_metric"):
            TrainConfig(best_metric=bad)
    assert TrainConfig(best_metric=None).best_metric is None


def _events(proc: subprocess.Popen, until: str) -> None:
    for line in proc.stdout:
        if line.strip() == until:
            return
    raise AssertionError(f"the run ended before {until!r}: {proc.stderr.read()[-2000:]}")


def _tiny(out: Path, steps: int, lr: float, **flags: str) -> subprocess.Popen:
    args = [sys.executable, str(SCRIPT), str(out), "--steps", str(steps), "--save-every", "5", "--eval-every", "10",
            "--keep-last", "2", "--lr", str(lr), "--on-divergence", "off"]
    for name, value in flags.items():
        args += [f"--{name.replace('_', '-')}", value]
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_the_best_checkpoint_survives_pruning_a_kill_and_a_resume(tmp_path: Path) -> None:
    """Healthy to step 20 (validation every 10 steps, a checkpoint every 5, keep_last=2), then resumed with lr=1,
    which the validation loss does not survive (on_divergence="off" so that the run goes on): step 20 stays the
    best and stays on disk through pruning, a SIGKILL at step 42 and the resume that finishes the run."""
    out = tmp_path / "run"
    first = _tiny(out, 20, 3e-3)
    stdout, stderr = first.communicate(timeout=300)
    assert first.returncode == 0 and stdout.strip().endswith("done 20 None"), stderr[-2000:]
    mgr = CheckpointManager(out / "checkpoints", best_metric="val_loss")
    assert mgr.best().step == 20

    worse = _tiny(out, 60, 1.0)
    _events(worse, "step 42")  # saved 40 (and pruned to 35, 40 and the best) before this
    worse.send_signal(signal.SIGKILL)
    worse.communicate(timeout=60)
    assert [i.step for i in mgr.list() if i.valid] == [20, 35, 40]
    assert mgr.best().step == 20 and json.loads((out / "checkpoints" / "run.json").read_text())["best"]["step"] == 20

    last = _tiny(out, 60, 1.0)
    stdout, stderr = last.communicate(timeout=300)
    assert last.returncode == 0 and "ready 40" in stdout and stdout.strip().endswith("done 60 None"), stderr[-2000:]
    assert [i.step for i in mgr.list()] == [20, 55, 60]
    state = mgr.load(mgr.best().step)
    evals = {e["step"]: e["val_loss"] for e in state["history"]["eval"]}
    assert state["step"] == 20 and max(evals) == 20  # the history it holds ends there
    final = {e["step"]: e["val_loss"] for e in mgr.load(60)["history"]["eval"]}
    assert all(final[s] > final[20] for s in (30, 40, 50, 60)), final  # it did get worse after step 20
    info = json.loads((out / "checkpoints" / "run.json").read_text())
    assert info["best"] == {"step": 20, "path": str(mgr.path_for(20)), "metric": "val_loss", "value": final[20]}


class Accuracy(Callback):
    """An eval callback's metric: a made-up accuracy that peaks at step 10, recorded in trainer.eval_metrics."""

    def on_eval_end(self, trainer) -> None:
        trainer.eval_metrics["accuracy"] = {0: 0.1, 10: 0.9, 20: 0.5}.get(trainer.step, 0.0)


def test_a_metric_from_an_eval_callback_picks_the_best_and_the_report_names_it(tiny_data, tmp_path: Path) -> None:
    train, val, tok = tiny_data
    cfg = tiny_config(tmp_path, steps=20, save_every=10, eval_every=10, keep_last=1, best_metric="accuracy")
    torch.manual_seed(0)
    model = GPT(gpt_config("tiny", vocab_size=tok.vocab_size, block_size=cfg.seq_len))
    trainer = Trainer(model, train, val, config=cfg, progress=False, callbacks=[Accuracy()])
    report = trainer.fit()
    assert trainer.history.eval[1] == {"step": 10, "val_loss": trainer.history.eval[1]["val_loss"], "accuracy": 0.9}
    assert report.best_checkpoint["step"] == 10 and report.best_checkpoint["metric"] == "accuracy"
    assert "best          step 10, accuracy 0.9000" in str(report)
    assert [i.step for i in CheckpointManager(tmp_path / "run" / "checkpoints").list()] == [10, 20]
