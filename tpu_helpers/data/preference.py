"""Preference data: records of a prompt with a chosen and a rejected answer -> fixed-shape pairs of token rows.

    records = load_preference_records("instructions")       # generated, offline; or a .jsonl/.json file or hub name
    data, stats = build_preference_dataset(tokenizer, records, seq_len=48)
    data[0]  # {"input_ids": (2, 48), "attention_mask": (2, 48), "labels": (2, 48), "index": ()}: chosen, rejected

A record takes one of the forms of TRL's and the hub's preference sets (prompt, chosen and rejected strings; chat
messages; or whole conversations sharing their first turns). Each pair goes through the tokenizer's chat template,
only the answers' tokens are labelled, and both rows are right-padded to SEQ_LEN, so a batch of B pairs is 2B rows
of one shape. Bad records are errors naming their index. `preference_records` makes the offline default from the
generated instruction task (`data.sft`). The record forms and the rendering: docs/guides/data.md.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.data import Dataset

from tpu_helpers.config import ConfigError
from tpu_helpers.data.cuts import warn_cut
from tpu_helpers.data.sft import DEFAULT_DATASET, check_chat_template, instruction_records, load_records

_ANSWERS = [*"abcdefghijklmnopqrstuvwxyz", *(str(n) for n in range(19))]


def _wrong_answer(answer: str, r: random.Random) -> str:
    # Any of the task's answers but the right one: most often of the other kind (a letter for a sum), which a tiny
    # model learns to disprefer on unseen prompts within a few dozen steps; otherwise a wrong value of the right kind.
    return r.choice([x for x in _ANSWERS if x != answer])


def preference_records(n: int = 4000, *, seed: int = 0, split: str = "train") -> list[dict]:
    """Pairs {"prompt", "chosen", "rejected"} of the generated instruction task: the right answer chosen, a wrong
    one of the same kind rejected (`split` "test": every held-out prompt once)."""
    r = random.Random(seed + (split == "test"))
    out = []
    for record in instruction_records(n, seed=seed, split=split):
        question, answer = record["messages"][0]["content"], record["messages"][1]["content"]
        out.append({"prompt": question, "chosen": answer, "rejected": _wrong_answer(answer, r)})
    return out


def load_preference_records(source: str, *, split: str = "train", max_records: int | None = None) -> list[dict]:
    """Records of the generated pairs ("instructions"), a local .jsonl/.json/.csv/.parquet file, or a hub data set
    (`split`, e.g. "train_prefs" for HuggingFaceH4/ultrafeedback_binarized)."""
    if source == DEFAULT_DATASET:
        return preference_records(max_records or 4000, split=split)
    return load_records(source, split=split, max_records=max_records)


def _messages(value: Any, role: str, where: str, field: str) -> list[dict]:
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, (list, tuple)) and value and all(isinstance(m, dict) and "role" in m and "content" in m
                                                          for m in value):
        return [{"role": m["role"], "content": m["content"]} for m in value]
    raise ConfigError(f"{where}: {field}={value!r} is neither a string nor a list of {{role, content}} messages")


def split_pair(record: Any, where: str = "record") -> tuple[list[dict], list[dict], list[dict]]:
    """(prompt messages, chosen messages, rejected messages) of one record in any accepted form."""
    if not isinstance(record, dict):
        raise ConfigError(f"{where} is a {type(record).__name__}, not a dict with prompt, chosen and rejected")
    missing = [k for k in ("chosen", "rejected") if record.get(k) in (None, "", [])]
    if missing:
        present = sorted(k for k, v in record.items() if v is not None)  # a file's missing field reads as None
        raise ConfigError(f"{where} has no {' or '.join(missing)} (its fields: {present}); a preference "
                          "record needs 'chosen' and 'rejected' (and a 'prompt' unless they are whole conversations)")
    chosen = _messages(record["chosen"], "assistant", where, "chosen")
    rejected = _messages(record["rejected"], "assistant", where, "rejected")
    if chosen == rejected:
        raise ConfigError(f"{where}: chosen is identical to rejected ({record['chosen']!r}): the pair prefers nothing")
    prompt = record.get("prompt")
    if isinstance(prompt, (list, tuple)):
        return _messages(prompt, "user", where, "prompt"), chosen, rejected
    shared = 0
    while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
        shared += 1
    if shared and chosen[0]["role"] != "assistant":  # whole conversations: the prompt is what they share
        return chosen[:shared], chosen[shared:], rejected[shared:]
    if not isinstance(prompt, str) or not prompt:
        raise ConfigError(f"{where} has no prompt: give 'prompt' (a string or messages), or chosen and rejected "
                          f"as whole conversations sharing their first turns (its fields: {sorted(record)})")
    return [{"role": "user", "content": prompt}], chosen, rejected


class PreferenceDataset(Dataset):
    """Pairs of fixed-length rows: input_ids, attention_mask, labels (N, 2, L) int64, row 0 chosen and row 1
    rejected, and each pair's index (what a precomputed reference is looked up by)."""

    def __init__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor) -> None:
        self.input_ids, self.attention_mask, self.labels = input_ids, attention_mask, labels

    @property
    def seq_len(self) -> int:
        return self.input_ids.shape[-1]

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.input_ids[i], "attention_mask": self.attention_mask[i], "labels": self.labels[i],
                "index": torch.tensor(i)}

    def select(self, indices: Sequence[int]) -> PreferenceDataset:
        idx = torch.as_tensor(list(indices), dtype=torch.long)
        return PreferenceDataset(self.input_ids[idx], self.attention_mask[idx], self.labels[idx])


def _render(tokenizer: Any, messages: list[dict], prompt: bool) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def build_preference_dataset(tokenizer: Any, records: Sequence[dict], *, seq_len: int, where: str = "record",
                             numbers: Sequence[int] | None = None, warn: bool = True) -> tuple[PreferenceDataset, dict]:
    """Every record as a pair of rows (see the module docstring); stats: pairs, cut answers, answer tokens, the
    longest pair's tokens and the answer tokens cut (`warn`: said in one `data.cuts.TruncationWarning`).
    `numbers`: each record's index in the data as read (what an error names), default its position here."""
    check_chat_template(tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise ConfigError("the tokenizer has neither a pad nor an eos token; set tokenizer.pad_token")
    ids, masks, labels = [], [], []
    stats = {"pairs": len(records), "truncated": 0, "tokens_trained": 0, "longest": 0, "tokens_cut": 0}
    for k, record in enumerate(records):
        at = f"{where} {numbers[k] if numbers is not None else k}"
        prompt, chosen, rejected = split_pair(record, at)
        head = _render(tokenizer, prompt, True)
        if len(head) >= seq_len:
            raise ConfigError(f"{at}: its prompt is {len(head)} tokens, which leaves no room for an answer in "
                              f"SEQ_LEN={seq_len} ({prompt[-1]['content'][:80]!r}); raise SEQ_LEN or drop the record")
        for answer in (chosen, rejected):
            full = _render(tokenizer, prompt + answer, False)
            if full[:len(head)] != head:
                raise ConfigError(f"{at}: the chat template renders the prompt differently once an answer follows, "
                                  "so the answer's tokens cannot be told apart")
            stats["longest"] = max(stats["longest"], len(full))
            if len(full) > seq_len:
                stats["truncated"] += 1
                stats["tokens_cut"] += len(full) - seq_len
                full = full[:seq_len]
            n = len(full)
            ids.append(full + [pad] * (seq_len - n))
            masks.append([1] * n + [0] * (seq_len - n))
            labels.append([-100] * len(head) + full[len(head):] + [-100] * (seq_len - n))
            stats["tokens_trained"] += n - len(head)
    if not ids:
        raise ConfigError("no preference records to build rows from")
    if warn:
        warn_truncated(stats, seq_len)
    shape = (len(records), 2, seq_len)
    data = PreferenceDataset(torch.tensor(ids).view(shape), torch.tensor(masks).view(shape),
                             torch.tensor(labels).view(shape))
    return data, stats


def warn_truncated(stats: dict, seq_len: int) -> None:
    """The one warning of `build_preference_dataset`'s stats when SEQ_LEN cut answers: how many, the longest pair,
    the SEQ_LEN that keeps them whole, the answer tokens lost."""
    warn_cut(setting="SEQ_LEN", limit=seq_len, cut=stats["truncated"], total=2 * stats["pairs"],
             longest=stats["longest"], what="chosen and rejected answers",
             lost=f"{stats['tokens_cut']:,} trained answer tokens in all")

