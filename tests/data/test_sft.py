"""SFT data: record forms, prompt masking, fixed shapes, the generated task set and its errors."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from transformers import AutoTokenizer

from tpu_helpers.config import ConfigError
from tpu_helpers.data.cuts import TruncationWarning, trained_spans
from tpu_helpers.data.sft import (
    build_sft_datasets,
    encode_record,
    exact_match,
    instruction_records,
    load_records,
    tokenize_records,
)


@pytest.fixture(scope="module")
def tok(tiny_lm_dir):
    return AutoTokenizer.from_pretrained(tiny_lm_dir)


def test_only_the_assistant_turn_is_trained(tok):
    record = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 3 ="},
                           {"role": "assistant", "content": "5"}]}
    ids, labels = encode_record(tok, record)
    trained = [i for i, lab in zip(ids, labels, strict=True) if lab != -100]
    assert tok.decode(trained).startswith("5<|im_end|>")
    assert labels[: len(ids) - len(trained)] == [-100] * (len(ids) - len(trained))
    # The same pair written as prompt/response gives the same tokens (both go through the chat template).
    assert encode_record(tok, {"prompt": "2 + 3 =", "response": "5"})[1][-len(trained):] == labels[-len(trained):]


def test_every_answer_is_trained_also_when_the_template_closes_the_chat_with_eos(tok, tiny_lm_dir):
    # Phi-3's template ends a chat rendered without the generation prompt with EOS, so a chat cut after a user turn
    # is no prefix of the longer one: every label was -100 ("a template that rewrites earlier turns") and all
    # Phi-3 records were dropped. An answer's tokens end where the chat ending there stops agreeing with the whole.
    from tests.models.families import family_tokenizer

    two_turns = {"messages": [{"role": "user", "content": "2 + 3 ="}, {"role": "assistant", "content": "5"},
                              {"role": "user", "content": "4 + 4 ="}, {"role": "assistant", "content": "8"}]}
    for tokenizer, trained in ((family_tokenizer("phi3", tiny_lm_dir), "5<|end|>\n8<|end|>\n<|endoftext|>"),
                               (tok, "5<|im_end|>\n8<|im_end|>\n")):
        ids, labels = encode_record(tokenizer, two_turns)
        assert tokenizer.decode(ids) == tokenizer.apply_chat_template(two_turns["messages"], tokenize=False)
        assert tokenizer.decode([i for i, lab in zip(ids, labels, strict=True) if lab != -100]) == trained


def test_rows_have_one_shape_with_padding_masked(tok):
    ds, stats = tokenize_records(tok, [{"text": "Mia found a red ball."}, {"question": "1 + 1 =", "answer": "2"}],
                                 seq_len=40)
    assert ds.input_ids.shape == ds.labels.shape == ds.attention_mask.shape == (2, 40)
    pad = ds.attention_mask == 0
    assert pad.any() and (ds.labels[pad] == -100).all() and (ds.input_ids[pad] == tok.pad_token_id).all()
    assert (ds.labels[0][ds.attention_mask[0] == 1] != -100).all()  # plain text: every real token is trained
    assert stats["truncated"] == 0 and stats["dropped"] == 0


def test_long_records_are_truncated_and_empty_ones_dropped(tok):
    long = {"prompt": "What letter comes after k? " * 10, "response": "l"}
    with pytest.warns(TruncationWarning, match=r"^SEQ_LEN=16 cuts 2 of 2 records"):
        ds, stats = tokenize_records(tok, [long, {"text": "A long story about Mia and her dog. " * 10}], seq_len=16)
    assert len(ds) == 1 and {k: stats[k] for k in ("records", "truncated", "dropped", "tokens_trained")} == \
        {"records": 2, "truncated": 2, "dropped": 1, "tokens_trained": 15}


def test_records_cut_by_seq_len_are_said_once_with_the_seq_len_that_keeps_them_whole(tok):
    """The newcomer's tool conversations: SEQ_LEN cut every record's second answer, and the stats alone said only
    'truncated'. One warning says how many records, the longest, the SEQ_LEN that keeps them whole, and the
    assistant turns and tokens lost; no warning when nothing is cut."""
    two = {"messages": [{"role": "user", "content": "2 + 3 ="}, {"role": "assistant", "content": "5"},
                        {"role": "user", "content": "4 + 4 ="}, {"role": "assistant", "content": "8"}]}
    ids, labels = encode_record(tok, two)
    first, second = trained_spans(labels)
    seq_len = second[0]  # the second answer starts here: it is lost, the first one kept
    with pytest.warns(TruncationWarning) as said:
        _, _, stats = build_sft_datasets(tok, [two] * 20, seq_len=seq_len, val_fraction=0.1)
    assert [str(w.message) for w in said] == [  # once, for the 18 training and 2 validation records
        f"SEQ_LEN={seq_len} cuts 20 of 20 records (the longest is {len(ids)} tokens: SEQ_LEN={len(ids)} keeps every "
        f"one whole); 20 of 40 trained assistant turns lose tokens (20 entirely), {20 * (second[1] - second[0])} "
        "trained tokens in all. Raise SEQ_LEN (the memory plan, job.plan(), says whether that fits) or shorten the "
        "data."]
    assert stats["truncated"] == 18 and stats["turns_lost"] == 18 and stats["longest"] == len(ids)
    assert stats["tokens_trained"] == 18 * (first[1] - first[0] - (first[0] == 0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, _, stats = build_sft_datasets(tok, [two] * 20, seq_len=len(ids), val_fraction=0.1)
    assert stats["truncated"] == stats["turns_cut"] == 0


def test_generated_task_set_is_deterministic_with_disjoint_held_out_prompts():
    assert instruction_records(50, seed=3) == instruction_records(50, seed=3)
    train = {r["messages"][0]["content"] for r in instruction_records(3000)}
    test = instruction_records(split="test")
    assert 40 <= len(test) <= 100
    assert not train & {r["messages"][0]["content"] for r in test}
    answers = {r["messages"][0]["content"]: r["messages"][1]["content"] for r in test}
    assert all(answers[p] == {"What is 2 plus 3?": "5"}.get(p, answers[p]) for p in answers)
    assert exact_match([" 5", "x"], ["5", "y"]) == 0.5


def test_local_jsonl_records_and_a_split(tmp_path, tok):
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(json.dumps({"instruction": f"Say {i}", "output": str(i)}) for i in range(20)))
    records = load_records(str(path))
    train, val, stats = build_sft_datasets(tok, records, seq_len=24, val_fraction=0.2)
    assert (len(train), len(val)) == (16, 4) and stats["records"] == 16


def test_bad_data_inputs_name_the_value(tmp_path, tok):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"input": "a", "target": "b"}) + "\n")
    with pytest.raises(ConfigError, match=r"record 0 has fields \['input', 'target'\].*accepted: messages"):
        tokenize_records(tok, load_records(str(path)), seq_len=16)
    with pytest.raises(ConfigError, match=r"dataset='.*missing.jsonl' does not exist"):
        load_records(str(tmp_path / "missing.jsonl"))
    bare = AutoTokenizer.from_pretrained(tok.name_or_path)
    bare.chat_template = None
    with pytest.raises(ConfigError, match=r"has no chat template"):
        encode_record(bare, {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})
    with pytest.raises(ConfigError, match=r"no record has a trained token within seq_len=4"):
        tokenize_records(tok, [{"prompt": "What letter comes after k?", "response": "l"}], seq_len=4)


def test_packed_rows_restart_positions_and_train_no_token_across_examples():
    from tpu_helpers.data.sft import pack_examples

    ex = [([5, 6, 7], [-100, 6, 7]), ([8, 9, 10, 11], [8, 9, 10, 11]), ([12, 13], [-100, 13]), ([1] * 6, [1] * 6)]
    data = pack_examples(ex, seq_len=8, pad=0)
    assert len(data) == 2 and data.attention_mask is None
    row = data[0]
    assert set(row) == {"input_ids", "position_ids", "labels"}
    assert row["input_ids"].tolist() == [5, 6, 7, 8, 9, 10, 11, 0]  # first fit: ex 3 (2 tokens) goes to row 2
    assert row["position_ids"].tolist() == [0, 1, 2, 0, 1, 2, 3, 0]
    assert row["labels"].tolist() == [-100, 6, 7, -100, 9, 10, 11, -100]
    assert data[1]["input_ids"].tolist() == [12, 13, 1, 1, 1, 1, 1, 1]
    assert data[1]["position_ids"].tolist() == [0, 1, 0, 1, 2, 3, 4, 5]


def test_packed_loss_equals_the_examples_one_per_row():
    from types import SimpleNamespace

    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tpu_helpers.algorithms.sft import CausalLMTrainer
    from tpu_helpers.data.sft import pack_examples

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1, use_cache=False,
                                         attn_implementation="eager"))
    g = torch.Generator().manual_seed(1)
    ex = []
    for n in (5, 7, 4):
        ids = torch.randint(1, 32, (n,), generator=g).tolist()
        ex.append((ids, [-100, -100] + ids[2:]))
    packed = pack_examples(ex, seq_len=16, pad=0)
    assert len(packed) == 1
    fake = SimpleNamespace(model=model)
    got = CausalLMTrainer.loss_sum(fake, {k: v.unsqueeze(0) for k, v in packed[0].items()})
    want = sum(CausalLMTrainer.loss_sum(fake, {"input_ids": torch.tensor([ids]), "labels": torch.tensor([lab])})
               for ids, lab in ex)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
