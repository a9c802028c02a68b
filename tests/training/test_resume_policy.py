"""Resume that a user can predict: unverifiable checkpoints are never overwritten silently (problem 1), changed
settings are either refused or applied and reported (problem 4), another run's checkpoint gives a clear error."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch

from tests.support import tiny_config
from tpu_helpers.checkpoint import CheckpointCorrupt, CheckpointManager
from tpu_helpers.config import ConfigError
from tpu_helpers.models.gpt import GPT, gpt_config
from tpu_helpers.training.trainer import Trainer


def _trainer(data, cfg, preset: str = "tiny") -> Trainer:
    train, val, tok = data
    torch.manual_seed(cfg.seed)
    model = GPT(gpt_config(preset, vocab_size=tok.vocab_size, block_size=cfg.seq_len))
    return Trainer(model, train, val, config=cfg, progress=False)


def _ckpt_dir(cfg) -> Path:
    return Path(cfg.out_dir) / "checkpoints"


@pytest.mark.parametrize("damage", ["manifests lost", "manifests damaged"])
def test_checkpoints_without_readable_manifests_are_refused_then_set_aside_never_deleted(tiny_data, tmp_path,
                                                                                       damage) -> None:
    cfg = tiny_config(tmp_path, steps=4, save_every=2, eval_every=100)
    _trainer(tiny_data, cfg).fit()
    ckpts = _ckpt_dir(cfg)
    for manifest in ckpts.glob("ckpt-*.json"):  # copied without them, or a sync dropped/garbled them
        if damage == "manifests lost":
            manifest.unlink()
        else:
            manifest.write_text("{not json")
    data = {p.name: p.read_bytes() for p in ckpts.glob("ckpt-*.pt")}
    assert sorted(data) == ["ckpt-00000002.pt", "ckpt-00000004.pt"]

    with pytest.raises(ConfigError, match=r"(?s)cannot be verified.*\n  ckpt-00000002\.pt: .*\n  ckpt-00000004\.pt: "
                                          r"(no manifest|unreadable manifest).*resume='force_new'") as info:
        _trainer(tiny_data, cfg.replace(steps=6)).fit()
    assert "overwrite or delete" in str(info.value)
    assert {p.name: p.read_bytes() for p in ckpts.glob("ckpt-*.pt")} == data  # untouched

    report = _trainer(tiny_data, cfg.replace(steps=6, resume="force_new")).fit()
    assert report.resumed_from is None and report.steps == 6
    aside = list(ckpts.glob("set-aside-*"))
    assert len(aside) == 1
    assert {p.name: p.read_bytes() for p in aside[0].glob("ckpt-*.pt")} == data  # moved, byte for byte
    assert (aside[0] / "run.json").exists()


def test_changed_lr_and_steps_are_applied_on_resume_and_reported(tiny_data, tmp_path) -> None:
    cfg = tiny_config(tmp_path, steps=10, save_every=10, eval_every=100, warmup_steps=2, lr=3e-3)
    first = _trainer(tiny_data, cfg)
    first.fit()
    lr_at_10 = first.optimizer.param_groups[0]["lr"]

    resumed = _trainer(tiny_data, cfg.replace(steps=20, lr=3e-5, weight_decay=0.01))
    report = resumed.fit()
    assert report.resumed_from == 10
    assert "lr 0.003 -> 3e-05 from step 10" in report.resume_changes
    assert "steps 10 -> 20 from step 10" in report.resume_changes
    assert "weight_decay 0.1 -> 0.01 from step 10" in report.resume_changes
    assert any(c.startswith("learning rate at step 10: ") for c in report.resume_changes)
    assert "changed       lr 0.003 -> 3e-05 from step 10" in str(report)
    # The new values are what the optimizer used: the lr after step 10 comes from lr=3e-5, not the old 3e-3.
    logged = [r["lr"] for r in resumed.history.train if r["step"] > 10]
    assert logged and max(logged) <= 3e-5 and lr_at_10 > 3e-5
    assert resumed.optimizer.param_groups[0]["weight_decay"] == 0.01
    assert resumed.optimizer.param_groups[1]["weight_decay"] == 0.0  # no-decay group untouched


def test_identity_change_is_refused_naming_old_and_new(tiny_data, tmp_path) -> None:
    cfg = tiny_config(tmp_path, steps=2, save_every=2, eval_every=100)
    _trainer(tiny_data, cfg).fit()
    with pytest.raises(ConfigError, match=r"seed: 0 there vs 1 now"):
        _trainer(tiny_data, cfg.replace(steps=4, seed=1)).fit()


def test_another_runs_checkpoint_copied_in_gives_a_clear_error(tiny_data, tmp_path) -> None:
    other = tiny_config(tmp_path / "other", steps=2, save_every=2, eval_every=100, preset="mini")
    _trainer(tiny_data, other, preset="mini").fit()
    mine = tiny_config(tmp_path / "mine", steps=2, save_every=2, eval_every=100)
    _trainer(tiny_data, mine).fit()
    for name in ("ckpt-00000002.pt", "ckpt-00000002.json"):  # the other run's step 2 over mine, manifest and all
        shutil.copy(_ckpt_dir(other) / name, _ckpt_dir(mine) / name)
    with pytest.raises(ConfigError, match=r"ckpt-00000002\.pt does not belong to this run .*preset 'mini' there "
                                          r"vs 'tiny' now.*another run"):
        _trainer(tiny_data, mine.replace(steps=4)).fit()


def test_damaged_run_json_is_a_clear_error(tmp_path) -> None:
    mgr = CheckpointManager(tmp_path)
    for text, kind in (("[1, 2]", "list"), ("null", "NoneType"), ("42", "int")):
        mgr.run_info_path.write_text(text)
        with pytest.raises(CheckpointCorrupt, match=re.escape(f"run.json holds {text} ({kind}), not the JSON object")):
            mgr.read_run_info()


def test_every_setting_is_in_one_resume_group_and_in_the_readme_table() -> None:
    """A new TrainConfig field must say what it does on resume: one group of resume_policy, one row of the
    resume table on docs/guides/preemption.md (refused, applied from the resume step, or simply takes effect)."""
    from dataclasses import fields

    from tpu_helpers.config import TrainConfig
    from tpu_helpers.training.resume_policy import APPLIED_ON_RESUME, IDENTITY_FIELDS, TAKES_EFFECT

    groups = (IDENTITY_FIELDS, APPLIED_ON_RESUME, TAKES_EFFECT)
    names = [f.name for f in fields(TrainConfig)]
    placed = [name for group in groups for name in group]
    assert sorted(placed) == sorted(names), (sorted(set(names) - set(placed)), sorted(set(placed) - set(names)))
    readme = (Path(__file__).resolve().parents[2] / "docs" / "guides" / "preemption.md").read_text()
    table = readme[readme.index("**What a changed setting does on resume**"):]
    rows = [line for line in table.splitlines() if line.startswith("| `")][:3]
    assert len(rows) == 3 and "refused" in rows[0] and "applied" in rows[1] and "take effect" in rows[2], rows
    for group, row in zip(groups, rows, strict=True):
        missing = [name for name in group if f"`{name}`" not in row]
        assert not missing, f"docs/guides/preemption.md's resume table lacks {missing} in the row: {row[:80]}..."
