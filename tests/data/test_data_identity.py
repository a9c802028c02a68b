"""Data identity and reading a data directory (problem 5): what is read, what is skipped, and the run's data
recorded by resolved path and content fingerprint, so a changed dataset is refused on resume."""

from __future__ import annotations

import pytest
import torch

from tests.support import tiny_config
from tpu_helpers.config import ConfigError
from tpu_helpers.data import load_text
from tpu_helpers.data.text import data_identity
from tpu_helpers.models.gpt import GPT, gpt_config
from tpu_helpers.training.trainer import Trainer


@pytest.fixture
def hf_datasets(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path.parent / f"{tmp_path.name}-hf_cache"))
    datasets.disable_progress_bars()
    return datasets


def test_hidden_and_checkpoint_folders_are_not_read_as_data(tmp_path, hf_datasets):
    data = tmp_path / "data"
    (data / ".ipynb_checkpoints").mkdir(parents=True)
    (data / "a.txt").write_text("alpha\n")
    (data / ".ipynb_checkpoints" / "a-checkpoint.txt").write_text("alpha copy\n")  # Jupyter's autosave copy
    (data / ".hidden.txt").write_text("hidden\n")
    (data / "run" / "checkpoints").mkdir(parents=True)  # a run's out_dir inside the data folder
    (data / "run" / "checkpoints" / "run.json").write_text('{"seed": 0}')
    (data / "run" / "results.json").write_text('{"text": "results"}')
    (data / "run" / ".run.lock").write_text("")
    assert load_text(str(data)) == "alpha"


def test_empty_jsonl_is_a_clear_error(tmp_path, hf_datasets):
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match=r"empty\.jsonl: empty file \(a \.jsonl file needs one JSON object"):
        load_text(str(tmp_path / "empty.jsonl"))


def test_every_unreadable_file_in_a_directory_is_named_with_its_problem(tmp_path, hf_datasets):
    (tmp_path / "good.jsonl").write_text('{"text": "fine"}\n')
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"text": oops}\n')
    (tmp_path / "list.jsonl").write_text('[1, 2]\n')
    with pytest.raises(ValueError, match=r"(?s)2 of the 3 data file\(s\).*bad\.jsonl: line 2 is not valid JSON.*"
                                         r"list\.jsonl: line 1 holds a list, not a JSON object"):
        load_text(str(tmp_path))


def test_data_identity_is_the_resolved_path_and_the_content(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data.txt").write_text("one two three\n" * 100)
    rel, absolute = data_identity("data.txt"), data_identity(str(tmp_path / "data.txt"))
    assert rel == absolute and rel["dataset"] == str(tmp_path / "data.txt")
    (tmp_path / "data.txt").write_text("one two three\n" * 99 + "one two thre3\n")  # same size, new content
    assert data_identity("data.txt")["data_fingerprint"] != rel["data_fingerprint"]
    assert data_identity("embedded") == {"dataset": "embedded"}


def _fit(data, cfg):
    train, val, tok = data
    torch.manual_seed(0)
    model = GPT(gpt_config("tiny", vocab_size=tok.vocab_size, block_size=cfg.seq_len))
    return Trainer(model, train, val, config=cfg, progress=False).fit()


def test_resume_refuses_changed_data_and_accepts_the_same_file_by_another_path(tiny_data, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data.txt").write_text("the same words again\n" * 50)
    cfg = tiny_config(tmp_path, steps=2, save_every=2, eval_every=100, dataset="data.txt")
    _fit(tiny_data, cfg)
    # An absolute path to the same file is the same run: it resumes.
    assert _fit(tiny_data, cfg.replace(steps=4, dataset=str(tmp_path / "data.txt"))).resumed_from == 2
    (tmp_path / "data.txt").write_text("other words entirely\n" * 50)
    with pytest.raises(ConfigError, match=r"data_fingerprint: '1 file\(s\), 1,050 bytes, sha256 \w+' there vs "
                                          r"'1 file\(s\), 1,050 bytes, sha256 \w+' now"):
        _fit(tiny_data, cfg.replace(steps=6))
