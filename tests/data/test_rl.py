"""Prompt records for GRPO (data/rl.py): the generated sums task, left-padded prompt rows, fields and errors."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from tpu_helpers.config import ConfigError
from tpu_helpers.data.cuts import TruncationWarning
from tpu_helpers.data.rl import build_prompt_dataset, load_prompt_records, prompt_and_answer, sum_records


def test_the_sums_task_has_checkable_answers_and_a_test_split_training_never_draws():
    train = sum_records(500, seed=3)
    assert train == sum_records(500, seed=3) and len(train) == 500
    for r in train[:50]:
        a, b = (int(x) for x in __import__("re").findall(r"\d", r["prompt"]))
        assert r["answer"] == str(a + b)
    test = load_prompt_records("sums", split="test")
    assert len(test) == 100 and len({r["prompt"] for r in test}) == 100
    trained = {r["prompt"] for r in load_prompt_records("sums")}
    assert not trained & {r["prompt"] for r in test}  # held out: no test prompt is ever a training prompt


def test_prompts_are_left_padded_with_their_record_index(tiny_lm_dir):
    tok = AutoTokenizer.from_pretrained(tiny_lm_dir)
    records = [{"prompt": "What is 1 plus 2?", "answer": "3"}, {"prompt": "x " * 40, "answer": "?"},
               {"messages": [{"role": "user", "content": "Add 4 and 5."}, {"role": "assistant", "content": "9"}]}]
    with pytest.warns(TruncationWarning) as said:
        data, stats = build_prompt_dataset(tok, records, max_prompt_len=24)
    assert stats["too_long"] == 1 and stats["prompts"] == 2 and len(data) == 2
    assert [str(w.message) for w in said] == [  # the dropped prompt is said, with the limit that keeps it
        f"MAX_PROMPT_LEN=24 drops 1 of 3 prompts (the longest is {stats['longest_prompt']} tokens: "
        f"MAX_PROMPT_LEN={stats['longest_prompt']} keeps every one whole). Raise MAX_PROMPT_LEN (the memory plan, "
        "job.plan(), says whether that fits) or shorten the data."]
    row = data[1]
    assert row["index"].item() == 2 and row["input_ids"].shape == (24,)
    n = int(row["attention_mask"].sum())
    assert row["attention_mask"].tolist() == [0] * (24 - n) + [1] * n  # padding on the left
    text = tok.decode(row["input_ids"][24 - n:])
    assert text.endswith("Add 4 and 5.<|im_end|>\n<|im_start|>assistant\n") and "9" not in text
    assert prompt_and_answer(records[2]) == ([{"role": "user", "content": "Add 4 and 5."}], "9")
    with_system, _ = build_prompt_dataset(tok, records[:1], max_prompt_len=40, system_prompt="Answer briefly.")
    assert "<|im_start|>system\nAnswer briefly." in tok.decode(with_system[0]["input_ids"])


def test_a_missing_prompt_field_or_no_prompt_that_fits_is_an_error(tiny_lm_dir):
    tok = AutoTokenizer.from_pretrained(tiny_lm_dir)
    with pytest.raises(ConfigError, match=r"record 0 has no prompt field 'prompt' \(PROMPT_FIELD\); its fields are "
                                          r"\['q'\]"):
        build_prompt_dataset(tok, [{"q": "hi"}], max_prompt_len=16)
    with pytest.raises(ConfigError, match=r"no prompt fits MAX_PROMPT_LEN=4 tokens \(1 records, the longest \d+"):
        build_prompt_dataset(tok, [{"prompt": "What is 1 plus 2?"}], max_prompt_len=4)
