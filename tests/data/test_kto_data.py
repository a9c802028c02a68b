"""KTO's rows (data/preference.py): TRL's unpaired form and pairs split as TRL's `unpair_preference_dataset` does;
each completion's mismatched row is its prompt with the previous completion's answer (TRL's rotation by one); held-out
labelled records pair up per prompt; bad labels named."""

from __future__ import annotations

import pytest

from tpu_helpers.config import ConfigError
from tpu_helpers.data.preference import build_kto_dataset, build_preference_dataset, pair_up, split_example
from tpu_helpers.models import hf

PAIRS = [{"prompt": f"What letter comes after {c}?", "chosen": chr(ord(c) + 1), "rejected": "7"} for c in "abc"]


@pytest.fixture(scope="module")
def tokenizer():
    return hf.load_causal_lm(hf.resolve_model_source(hf.TINY))[1]


def _answer(tokenizer, row):
    return tokenizer.decode([t for t in row.tolist() if t != -100])


def test_pairs_split_as_trls_unpair_and_the_unpaired_form_gives_the_same_rows(tokenizer):
    datasets = pytest.importorskip("datasets")
    data_utils = pytest.importorskip("trl.data_utils")
    theirs = data_utils.unpair_preference_dataset(datasets.Dataset.from_list(PAIRS)).to_list()
    paired, stats = build_kto_dataset(tokenizer, PAIRS, seq_len=40)
    unpaired, _ = build_kto_dataset(tokenizer, theirs, seq_len=40)
    assert (paired.input_ids == unpaired.input_ids).all() and (paired.labels == unpaired.labels).all()
    assert paired.desirable.tolist() == [r["label"] for r in theirs] == [True] * 3 + [False] * 3
    assert stats["examples"] == 6 and stats["desirable"] == stats["undesirable"] == 3
    # Row 0 of each item is its completion as the pair's rows have it.
    pair_rows, _ = build_preference_dataset(tokenizer, PAIRS, seq_len=40)
    assert (paired.input_ids[:3, 0] == pair_rows.input_ids[:, 0]).all()
    assert (paired.labels[3:, 0] == pair_rows.labels[:, 1]).all()


def test_the_kl_row_is_the_prompt_with_the_previous_completions_answer(tokenizer):
    data, _ = build_kto_dataset(tokenizer, PAIRS, seq_len=40)
    answers = [_answer(tokenizer, data.labels[i, 0]) for i in range(6)]
    assert [a[:1] for a in answers] == ["b", "c", "d", "7", "7", "7"]
    for i in range(6):
        assert _answer(tokenizer, data.labels[i, 1]) == answers[i - 1]
        # The prompt part of the mismatched row is the item's own prompt.
        prompt = data.labels[i, 0] == -100
        n = int(data.attention_mask[i, 0].sum()) - int((~prompt).sum())
        assert (data.input_ids[i, 1, :n] == data.input_ids[i, 0, :n]).all()
    assert data[4]["desirable"].item() is False and data.select([0, 4]).desirable.tolist() == [True, False]


@pytest.mark.parametrize("record, message", [
    ({"prompt": "What is 1 plus 1?", "completion": "2"},
     r"record 5 has no label \(its fields: \['completion', 'prompt'\]\); KTO takes 'prompt', 'completion' and "
     r"'label'"),
    ({"prompt": "What is 1 plus 1?", "completion": "2", "label": "yes"},
     r"record 5: label='yes' is not a boolean; KTO's label is True \(a desirable completion\) or False"),
    ({"prompt": "What is 1 plus 1?", "completion": "2", "label": 1}, r"record 5: label=1 is not a boolean"),
    ({"prompt": "What is 1 plus 1?", "label": True}, r"record 5 has no completion"),
    ({"completion": "2", "label": True}, r"record 5 has no prompt"),
    ("2", r"record 5 is a str, not a dict; KTO takes"),
])
def test_bad_kto_records_name_the_record_and_value(record, message):
    with pytest.raises(ConfigError, match=message):
        split_example(record, "record 5")


def test_held_out_labelled_records_pair_up_per_prompt():
    records = [{"prompt": "p1", "completion": "a", "label": True}, {"prompt": "p2", "completion": "x", "label": False},
               {"prompt": "p1", "completion": "b", "label": False}, {"prompt": "p3", "completion": "c", "label": True},
               {"prompt": "p1", "completion": "d", "label": True}, PAIRS[0]]
    pairs, numbers, alone = pair_up(records)
    assert numbers == [0, 5] and alone == 3
    assert pairs[0]["chosen"][0]["content"] == "a" and pairs[0]["rejected"][0]["content"] == "b"
    assert pairs[1] is PAIRS[0]
