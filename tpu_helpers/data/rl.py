"""Prompts with reference answers for reinforcement learning (GRPO): records -> left-padded prompt rows.

    records = load_prompt_records("sums")                          # generated, offline; or a file / hub data set
    data, stats = build_prompt_dataset(tokenizer, records, max_prompt_len=32)
    data[0]  # {"input_ids": (32,), "attention_mask": (32,), "index": ()}: left-padded, index into `records`

A record holds a prompt (a string or a chat) and, for rewards that check answers, a reference answer. Prompts go
through the tokenizer's chat template with the generation prompt and are left-padded to `max_prompt_len`, so every
batch has one shape and generation appends to the right; a longer prompt is dropped and counted. The rows carry the
record's index, so the trainer hands the record's fields to the rewards. `sum_records` is the offline default task
(adding two numbers). The record forms and the default task: docs/guides/data.md.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from tpu_helpers.config import ConfigError
from tpu_helpers.data.cuts import warn_cut
from tpu_helpers.data.sft import _TEMPLATES, check_chat_template, load_records

SUMS = "sums"


# The test split's phrasings: none is a training template (`data.sft._TEMPLATES["add"]`), so no test prompt is ever
# a training prompt; the sums themselves are the training range's.
_HELD_OUT_ADD = ("Compute {a} + {b}.", "Sum {a} and {b}.", "{a} plus {b} is?")


def sum_records(n: int = 2000, *, seed: int = 0, split: str = "train", high: int = 9) -> list[dict]:
    """`n` records {"prompt", "answer"} asking for a + b with 0 <= a, b <= `high`. "test": every pair once, each in
    a phrasing training never uses, so no test prompt is a training prompt (the same sums, asked in other words)."""
    if split not in ("train", "test"):
        raise ConfigError(f"split={split!r} is not one of ('train', 'test')")
    r = random.Random(seed if split == "train" else seed + 1)
    if split == "test":
        pairs = [(a, b) for a in range(high + 1) for b in range(high + 1)]
        return [{"prompt": r.choice(_HELD_OUT_ADD).format(a=a, b=b), "answer": str(a + b)} for a, b in pairs]
    out = []
    for _ in range(n):
        a, b = r.randint(0, high), r.randint(0, high)
        out.append({"prompt": r.choice(_TEMPLATES["add"]).format(a=a, b=b), "answer": str(a + b)})
    return out


def load_prompt_records(source: str, *, split: str = "train", max_records: int | None = None) -> list[dict]:
    """Records from the generated sums task ("sums"), a hub data set with a configuration ("openai/gsm8k:main"),
    or anything `data.sft.load_records` reads."""
    if source == SUMS:
        return sum_records(max_records or 2000, split=split)
    name, _, subset = source.partition(":")
    if subset and "/" in name and not Path(source).exists():
        import datasets

        ds = datasets.load_dataset(name, subset, split=split)
        rows = ds.select(range(min(len(ds), max_records))) if max_records else ds
        return [dict(r) for r in rows]
    return load_records(source, split=split, max_records=max_records)


def prompt_and_answer(record: Any, *, prompt_field: str = "prompt", answer_field: str = "answer",
                      where: str = "record") -> tuple[Any, str | None]:
    """(prompt, reference answer or None) of one record; an error naming the field and the record's fields."""
    if not isinstance(record, dict):
        raise ConfigError(f"{where} is a {type(record).__name__}, not a dict with a {prompt_field!r} field")
    if prompt_field not in record and "messages" in record:
        messages = list(record["messages"])
        last = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=None)
        if last is None:
            return messages, None
        return messages[:last], str(messages[last]["content"])
    if prompt_field not in record:
        raise ConfigError(f"{where} has no prompt field {prompt_field!r} (PROMPT_FIELD); its fields are "
                          f"{sorted(record)}; set PROMPT_FIELD to the one holding the prompt, e.g. 'question'")
    answer = record.get(answer_field)
    return record[prompt_field], None if answer is None else str(answer)


def prompt_text(tokenizer: Any, prompt: Any, system_prompt: str | None = None) -> str:
    """What the model reads: a chat (or a string as one user turn) through the chat template with the generation
    prompt; a string as it is when the tokenizer has no chat template and no system prompt is asked for."""
    if isinstance(prompt, str) and not getattr(tokenizer, "chat_template", None) and system_prompt is None:
        return prompt
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else \
        [{"role": m["role"], "content": m["content"]} for m in prompt]
    if system_prompt is not None and not (messages and messages[0]["role"] == "system"):
        messages = [{"role": "system", "content": system_prompt}, *messages]
    check_chat_template(tokenizer)
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


class PromptDataset(Dataset):
    """Left-padded prompt rows and each row's record index (int64 tensors). Agent episodes render their own prompts
    at every reset, so their dataset holds the record indices alone (`input_ids` and `attention_mask` None)."""

    def __init__(self, input_ids: torch.Tensor | None, attention_mask: torch.Tensor | None,
                 index: torch.Tensor) -> None:
        self.input_ids, self.attention_mask, self.index = input_ids, attention_mask, index

    def __len__(self) -> int:
        return self.index.shape[0]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if self.input_ids is None:
            return {"index": self.index[i]}
        return {"input_ids": self.input_ids[i], "attention_mask": self.attention_mask[i], "index": self.index[i]}

    def of_records(self, records: Collection[int]) -> PromptDataset:
        """The rows of the records whose index is in `records` (the others', e.g. held-out records', left out)."""
        keep = torch.tensor([int(i) in records for i in self.index.tolist()], dtype=torch.bool)
        if self.input_ids is None:
            return PromptDataset(None, None, self.index[keep])
        return PromptDataset(self.input_ids[keep], self.attention_mask[keep], self.index[keep])


def build_prompt_dataset(tokenizer: Any, records: Sequence[dict], *, max_prompt_len: int,
                         prompt_field: str = "prompt", answer_field: str = "answer",
                         system_prompt: str | None = None, warn: bool = True) -> tuple[PromptDataset, dict]:
    """Tokenize and left-pad every record's prompt; returns (dataset, stats). Records whose prompt is longer than
    `max_prompt_len` tokens are dropped (counted in stats; `warn`: said in one `data.cuts.TruncationWarning`)."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise ConfigError("the tokenizer has neither a pad nor an eos token; set tokenizer.pad_token")
    ids, masks, index = [], [], []
    stats = {"records": len(records), "too_long": 0, "with_answer": 0, "longest_prompt": 0}
    for k, record in enumerate(records):
        prompt, answer = prompt_and_answer(record, prompt_field=prompt_field, answer_field=answer_field,
                                           where=f"record {k}")
        tokens = tokenizer(prompt_text(tokenizer, prompt, system_prompt), add_special_tokens=False)["input_ids"]
        stats["longest_prompt"] = max(stats["longest_prompt"], len(tokens))
        if len(tokens) > max_prompt_len:
            stats["too_long"] += 1
            continue
        stats["with_answer"] += answer is not None
        ids.append([pad] * (max_prompt_len - len(tokens)) + tokens)
        masks.append([0] * (max_prompt_len - len(tokens)) + [1] * len(tokens))
        index.append(k)
    if not ids:
        raise ConfigError(f"no prompt fits MAX_PROMPT_LEN={max_prompt_len} tokens ({stats['records']} records, the "
                          f"longest {stats['longest_prompt']} tokens); raise MAX_PROMPT_LEN")
    stats["prompts"] = len(ids)
    if warn:
        warn_cut(setting="MAX_PROMPT_LEN", limit=max_prompt_len, cut=stats["too_long"], total=stats["records"],
                 longest=stats["longest_prompt"], what="prompts", verb="drops")
    return PromptDataset(torch.tensor(ids), torch.tensor(masks), torch.tensor(index)), stats
