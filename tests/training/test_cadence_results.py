"""The one log/eval/save cadence, and the one results writer."""

from __future__ import annotations

import json

import pytest

from tests.support import tiny_config
from tpu_helpers.models.gpt import GPT, gpt_config
from tpu_helpers.training.cadence import Cadence
from tpu_helpers.training.results import RUN_DIR_ENV, write_results
from tpu_helpers.training.trainer import Trainer


def test_cadence_every_n_steps_and_at_the_last():
    s = Cadence(steps=25, log_every=10, eval_every=20, save_every=7)
    steps = range(1, 26)
    assert [t for t in steps if s.is_log_step(t)] == [10, 20, 25]
    assert [t for t in steps if s.is_eval_step(t)] == [20, 25]
    assert [t for t in steps if s.is_save_step(t)] == [7, 14, 21, 25]
    assert s.is_last_step(25) and not s.is_last_step(24)
    with pytest.raises(ValueError, match="log_every=0 must be an int >= 1"):
        Cadence(steps=5, log_every=0, eval_every=1, save_every=1)


def test_the_trainer_takes_its_cadence_from_the_config_once(tmp_path, tiny_data):
    cfg = tiny_config(tmp_path, steps=30, log_every=4, eval_every=15, save_every=10)
    trainer = Trainer(GPT(gpt_config("tiny", vocab_size=256, block_size=32)), tiny_data[0], config=cfg, progress=False)
    assert trainer.cadence == Cadence(30, 4, 15, 10)
    assert not hasattr(cfg, "schedule")  # not rebuilt (and validated again) from the config at every use


class EveryThird(Trainer):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.cadence = Cadence(self.config.steps, 3, 1000, 1000)


def test_the_trainer_asks_its_cadence(tmp_path, tiny_data):
    train, val, tok = tiny_data
    cfg = tiny_config(tmp_path, steps=7, log_every=1, eval_every=1, save_every=1)
    trainer = EveryThird(GPT(gpt_config("tiny", vocab_size=tok.vocab_size, block_size=32)), train, val, config=cfg,
                         progress=False)
    trainer.fit()
    assert [r["step"] for r in trainer.history.train] == [3, 6, 7]
    assert [r["step"] for r in trainer.history.eval] == [0, 7]  # before step 1, then the last step
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("ckpt-*.pt")) == ["ckpt-00000007.pt"]


def test_write_results_writes_both_files_into_both_directories_and_closes_the_figure(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    monkeypatch.setenv(RUN_DIR_ENV, str(tmp_path / "runner"))
    fig, ax = plt.subplots()
    ax.plot([1, 2], [3, 4])
    path = write_results(tmp_path / "out", {"loss": 1.5, "where": tmp_path}, figure=fig, figure_name="m.png")
    assert path == tmp_path / "out" / "results.json"
    assert not plt.fignum_exists(fig.number)
    for d in (tmp_path / "out", tmp_path / "runner"):
        assert json.loads((d / "results.json").read_text()) == {"loss": 1.5, "where": str(tmp_path)}
        assert (d / "m.png").read_bytes().startswith(b"\x89PNG")
        assert sorted(p.name for p in d.iterdir()) == ["m.png", "results.json"]  # no temporary files left
    monkeypatch.delenv(RUN_DIR_ENV)
    write_results(tmp_path / "plain", {"a": 1}, name="other")
    assert [p.name for p in (tmp_path / "plain").iterdir()] == ["other.json"]
