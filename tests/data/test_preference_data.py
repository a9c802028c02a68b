"""Preference rows (data/preference.py): the string, prompt-as-messages and whole-conversation forms of a pair give
the same rows; labels cover the answers only; the generated pairs prefer the right answer."""

from __future__ import annotations

import pytest

from tpu_helpers.config import ConfigError
from tpu_helpers.data.cuts import TruncationWarning
from tpu_helpers.data.preference import build_preference_dataset, preference_records, split_pair
from tpu_helpers.data.sft import instruction_records
from tpu_helpers.models import hf


@pytest.fixture(scope="module")
def tokenizer():
    return hf.load_causal_lm(hf.resolve_model_source(hf.TINY))[1]


def test_the_three_record_forms_give_the_same_rows(tokenizer):
    user = {"role": "user", "content": "What letter comes after c?"}
    good, bad = {"role": "assistant", "content": "d"}, {"role": "assistant", "content": "q"}
    forms = [{"prompt": user["content"], "chosen": "d", "rejected": "q"},
             {"prompt": [user], "chosen": [good], "rejected": [bad]},
             {"chosen": [user, good], "rejected": [user, bad]},
             {"prompt": user["content"], "chosen": [user, good], "rejected": [user, bad]}]  # ultrafeedback_binarized
    data = [build_preference_dataset(tokenizer, [r], seq_len=40)[0] for r in forms]
    for other in data[1:]:
        assert (other.input_ids == data[0].input_ids).all() and (other.labels == data[0].labels).all()
    row = data[0][0]
    assert row["input_ids"].shape == (2, 40) and int(row["index"]) == 0
    chosen_labels = [t for t in row["labels"][0].tolist() if t != -100]
    # The answer and what closes its turn; the prompt and the padding carry no label.
    assert tokenizer.decode(chosen_labels).startswith("d")
    n = int(row["attention_mask"][0].sum())
    assert row["labels"][0, n:].eq(-100).all() and row["labels"][0, :n - len(chosen_labels)].eq(-100).all()


def test_generated_pairs_prefer_the_right_answer_and_hold_out_a_split():
    train, test = preference_records(200), preference_records(split="test")
    assert all(r["chosen"] != r["rejected"] for r in train + test)
    assert {r["prompt"] for r in train}.isdisjoint({r["prompt"] for r in test}) and len(test) > 50
    # The chosen answer is the instruction task's own answer to the same prompt.
    sft = instruction_records(200)
    assert [(r["prompt"], r["chosen"]) for r in train] == [(m["messages"][0]["content"], m["messages"][1]["content"])
                                                            for m in sft]


def test_a_record_without_a_prompt_or_with_a_bad_field_is_named():
    with pytest.raises(ConfigError, match=r"record 7 has no prompt"):
        split_pair({"chosen": "a", "rejected": "b"}, "record 7")
    with pytest.raises(ConfigError, match=r"record 2: chosen=5 is neither a string nor a list"):
        split_pair({"prompt": "x", "chosen": 5, "rejected": "b"}, "record 2")


def test_answers_cut_by_seq_len_are_said_once(tokenizer):
    record = {"prompt": "What letter comes after c?", "chosen": "d " * 20, "rejected": "q"}
    full, _ = build_preference_dataset(tokenizer, [record], seq_len=200, warn=False)
    longest = int(full.attention_mask.sum(-1).max())
    with pytest.warns(TruncationWarning) as said:
        _, stats = build_preference_dataset(tokenizer, [record], seq_len=longest - 5)
    assert stats["truncated"] == 1 and stats["longest"] == longest and stats["tokens_cut"] == 5
    assert [str(w.message) for w in said] == [
        f"SEQ_LEN={longest - 5} cuts 1 of 2 chosen and rejected answers (the longest is "
        f"{longest} tokens: SEQ_LEN={longest} keeps every one whole); 5 trained answer tokens in all. Raise SEQ_LEN "
        "(the memory plan, job.plan(), says whether that fits) or shorten the data."]
