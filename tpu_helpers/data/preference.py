"""Preference data: records of a prompt with a chosen and a rejected answer -> fixed-shape pairs of token rows.

    records = load_preference_records("instructions")       # generated, offline; or a .jsonl/.json file or hub name
    data, stats = build_preference_dataset(tokenizer, records, seq_len=48)
    data[0]  # {"input_ids": (2, 48), "attention_mask": (2, 48), "labels": (2, 48), "index": ()}: chosen, rejected

A record takes one of the forms of TRL's and the hub's preference sets (prompt, chosen and rejected strings; chat
messages; or whole conversations sharing their first turns). Each pair goes through the tokenizer's chat template,
only the answers' tokens are labelled, and both rows are right-padded to SEQ_LEN, so a batch of B pairs is 2B rows
of one shape. Bad records are errors naming their index. `preference_records` makes the offline default from the
generated instruction task (`data.sft`). The record forms and the rendering: docs/guides/data.md.

KTO takes labelled completions instead (TRL's unpaired form: prompt, completion, label True for desirable, False
for undesirable; a pair is split into its chosen and rejected completions, as TRL's `unpair_preference_dataset`):
`build_kto_dataset` gives each its row and a mismatched row beside it (its prompt with the previous completion's
answer, TRL's rotation by one), which KTO's KL estimate scores; `pair_up` makes held-out pairs of labelled records.
"""

from __future__ import annotations

import json
import random
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.data import Dataset

from tpu_helpers.config import ConfigError
from tpu_helpers.core.choices import is_finite_number
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
    rejected, and each pair's index (what a precomputed reference is looked up by). KTO's (`desirable` given, (N,)
    bool): row 0 a labelled completion, row 1 its mismatched row for the KL estimate. With TRL's margin column, each
    pair's margin (N,) float (a reward model's)."""

    def __init__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor,
                 desirable: torch.Tensor | None = None, margin: torch.Tensor | None = None) -> None:
        self.input_ids, self.attention_mask, self.labels = input_ids, attention_mask, labels
        self.desirable, self.margin = desirable, margin

    @property
    def seq_len(self) -> int:
        return self.input_ids.shape[-1]

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.gather(i) | {"index": torch.tensor(i)}

    def gather(self, idx: Any) -> dict[str, torch.Tensor]:
        """Rows `idx` (an index or a tensor of them) of every field, as a batch of them is collated."""
        out = {"input_ids": self.input_ids[idx], "attention_mask": self.attention_mask[idx], "labels": self.labels[idx]}
        extra = {k: v[idx] for k, v in (("desirable", self.desirable), ("margin", self.margin)) if v is not None}
        return out | extra

    def select(self, indices: Sequence[int]) -> PreferenceDataset:
        idx = torch.as_tensor(list(indices), dtype=torch.long)
        return PreferenceDataset(**self.gather(idx))


def _render(tokenizer: Any, messages: list[dict], prompt: bool) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _prompt_ids(tokenizer: Any, prompt: list[dict], seq_len: int, at: str) -> list[int]:
    head = _render(tokenizer, prompt, True)
    if len(head) >= seq_len:
        raise ConfigError(f"{at}: its prompt is {len(head)} tokens, which leaves no room for an answer in "
                          f"SEQ_LEN={seq_len} ({prompt[-1]['content'][:80]!r}); raise SEQ_LEN or drop the record")
    return head


def _answer_ids(tokenizer: Any, prompt: list[dict], head: list[int], answer: list[dict], at: str) -> list[int]:
    full = _render(tokenizer, prompt + answer, False)
    if full[:len(head)] != head:
        raise ConfigError(f"{at}: the chat template renders the prompt differently once an answer follows, "
                          "so the answer's tokens cannot be told apart")
    return full[len(head):]


class _Rows:
    """Fixed-length rows of a prompt's tokens and an answer's, only the answer labelled, cut at SEQ_LEN and
    right-padded, with the counts a build's stats report."""

    def __init__(self, seq_len: int, pad: int) -> None:
        self.seq_len, self.pad = seq_len, pad
        self.ids: list[list[int]] = []
        self.masks: list[list[int]] = []
        self.labels: list[list[int]] = []
        self.stats = {"truncated": 0, "tokens_trained": 0, "longest": 0, "tokens_cut": 0}

    def add(self, head: list[int], answer: list[int], *, trained: bool = True) -> None:
        full, seq_len, stats = head + answer, self.seq_len, self.stats
        stats["longest"] = max(stats["longest"], len(full))
        if len(full) > seq_len:
            stats["truncated"] += 1
            stats["tokens_cut"] += len(full) - seq_len
            full = full[:seq_len]
        n = len(full)
        self.ids.append(full + [self.pad] * (seq_len - n))
        self.masks.append([1] * n + [0] * (seq_len - n))
        self.labels.append([-100] * len(head) + full[len(head):] + [-100] * (seq_len - n))
        stats["tokens_trained"] += (n - len(head)) if trained else 0

    def dataset(self, rows: int, desirable: list[bool] | None = None,
                margin: torch.Tensor | None = None) -> PreferenceDataset:
        shape = (rows, 2, self.seq_len)
        return PreferenceDataset(torch.tensor(self.ids).view(shape), torch.tensor(self.masks).view(shape),
                                 torch.tensor(self.labels).view(shape),
                                 None if desirable is None else torch.tensor(desirable, dtype=torch.bool), margin)


def _pad_id(tokenizer: Any) -> int:
    check_chat_template(tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise ConfigError("the tokenizer has neither a pad nor an eos token; set tokenizer.pad_token")
    return pad


def build_preference_dataset(tokenizer: Any, records: Sequence[dict], *, seq_len: int, where: str = "record",
                             numbers: Sequence[int] | None = None, warn: bool = True) -> tuple[PreferenceDataset, dict]:
    """Every record as a pair of rows (see the module docstring); stats: pairs, cut answers, answer tokens, the
    longest pair's tokens and the answer tokens cut (`warn`: said in one `data.cuts.TruncationWarning`).
    `numbers`: each record's index in the data as read (what an error names), default its position here."""
    rows = _Rows(seq_len, _pad_id(tokenizer))
    for k, record in enumerate(records):
        at = f"{where} {numbers[k] if numbers is not None else k}"
        prompt, chosen, rejected = split_pair(record, at)
        head = _prompt_ids(tokenizer, prompt, seq_len, at)
        for answer in (chosen, rejected):
            rows.add(head, _answer_ids(tokenizer, prompt, head, answer, at))
    if not rows.ids:
        raise ConfigError("no preference records to build rows from")
    stats = {"pairs": len(records), **rows.stats}
    if warn:
        warn_truncated(stats, seq_len)
    return rows.dataset(len(records), margin=_margins(records, where, numbers)), stats


# ---- KTO: labelled completions ----------------------------------------------------------------------------------
KTO_FORMS = ("'prompt', 'completion' and 'label' (True: desirable, False: undesirable; TRL's unpaired form), or "
             "'chosen' and 'rejected' (a pair, split into a desirable and an undesirable completion)")


def split_example(record: Any, where: str = "record") -> list[tuple[list[dict], list[dict], bool]]:
    """KTO's labelled completions (prompt messages, completion messages, desirable) of one record: an unpaired
    record's one, a pair's two (chosen True, then rejected False)."""
    if isinstance(record, dict) and "completion" not in record and "label" not in record and (
            "chosen" in record or "rejected" in record):
        prompt, chosen, rejected = split_pair(record, where)
        return [(prompt, chosen, True), (prompt, rejected, False)]
    if not isinstance(record, dict):
        raise ConfigError(f"{where} is a {type(record).__name__}, not a dict; KTO takes {KTO_FORMS}")
    present = sorted(k for k, v in record.items() if v is not None)
    missing = [k for k in ("completion", "label") if record.get(k) in (None, "", [])]
    if missing:
        raise ConfigError(f"{where} has no {' or '.join(missing)} (its fields: {present}); KTO takes {KTO_FORMS}")
    label = record["label"]
    if not isinstance(label, bool):
        raise ConfigError(f"{where}: label={label!r} is not a boolean; KTO's label is True (a desirable completion) "
                          "or False (an undesirable one)")
    prompt = record.get("prompt")
    if isinstance(prompt, str) and prompt:
        prompt = [{"role": "user", "content": prompt}]
    elif not (isinstance(prompt, (list, tuple)) and prompt):
        raise ConfigError(f"{where} has no prompt: an unpaired record needs 'prompt' (a string or messages); its "
                          f"fields: {present}")
    return [(_messages(prompt, "user", where, "prompt"),
             _messages(record["completion"], "assistant", where, "completion"), label)]


def build_kto_dataset(tokenizer: Any, records: Sequence[dict], *, seq_len: int, where: str = "record",
                      numbers: Sequence[int] | None = None, warn: bool = True) -> tuple[PreferenceDataset, dict]:
    """Every record's labelled completions (`split_example`), the pairs' chosen ones and the unpaired records first,
    then the pairs' rejected ones (as TRL unpairs), each as row 0 of an item and its mismatched row as row 1: its
    prompt with the previous completion's answer (the first with the last's). stats: examples, desirable,
    undesirable, and the cuts and tokens of `build_preference_dataset` (over both rows)."""
    rows = _Rows(seq_len, _pad_id(tokenizer))
    firsts, seconds = [], []
    for k, record in enumerate(records):
        at = f"{where} {numbers[k] if numbers is not None else k}"
        for j, (prompt, completion, label) in enumerate(split_example(record, at)):
            head = _prompt_ids(tokenizer, prompt, seq_len, at)
            (seconds if j else firsts).append((head, _answer_ids(tokenizer, prompt, head, completion, at), label))
    examples = firsts + seconds
    if len(examples) < 2:
        raise ConfigError(f"{len(examples)} KTO completion(s): the KL estimate pairs each prompt with another "
                          "completion, so KTO needs at least 2")
    for i, (head, answer, _) in enumerate(examples):
        rows.add(head, answer)
        rows.add(head, examples[i - 1][1], trained=False)
    desirable = [label for _, _, label in examples]
    stats = {"examples": len(examples), "desirable": sum(desirable), "undesirable": len(desirable) - sum(desirable),
             **rows.stats}
    if warn:
        warn_truncated(stats, seq_len)
    return rows.dataset(len(examples), desirable), stats


def warn_kto_balance(stats: dict, desirable_weight: float, undesirable_weight: float) -> None:
    """TRL's KTOTrainer's warning when desirable and undesirable completions differ in number and neither weight is
    in the range the KTO paper's Eq. (8) suggests for that ratio (desirable x weight over undesirable x weight in
    [1, 4/3])."""
    d, u = max(stats["desirable"], 1), max(stats["undesirable"], 1)
    if d == u:
        return
    des = (round(u * undesirable_weight / d, 2), round(u * undesirable_weight / d * 1.33, 2))
    und = (round(d * desirable_weight / u / 1.33, 2), round(d * desirable_weight / u, 2))
    if not (des[0] <= desirable_weight <= des[1] or und[0] <= undesirable_weight <= und[1]):
        warnings.warn(f"{d} desirable and {u} undesirable completions with DESIRABLE_WEIGHT={desirable_weight} and "
                      f"UNDESIRABLE_WEIGHT={undesirable_weight}: set EITHER DESIRABLE_WEIGHT in [{des[0]}, {des[1]}] "
                      f"or UNDESIRABLE_WEIGHT in [{und[0]}, {und[1]}] (not both) to balance them (the KTO paper's "
                      "Eq. 8)", stacklevel=2)


def pair_up(records: Sequence[dict], where: str = "record") -> tuple[list[dict], list[int], int]:
    """Pairs {"prompt", "chosen", "rejected"} of labelled records (what held-out pairs are scored on): each pair as it
    is, and per prompt its first desirable completion with its first undesirable one. Returns the pairs, each one's
    record number, and how many records found no partner."""
    pairs, numbers, open_, used = [], [], {}, 0
    for k, record in enumerate(records):
        examples = split_example(record, f"{where} {k}")
        if len(examples) == 2:
            pairs.append(record)
            numbers.append(k)
            used += 1
            continue
        prompt, completion, label = examples[0]
        slot = open_.setdefault(json.dumps(prompt, sort_keys=True), {})
        if label not in slot:
            slot[label] = (k, completion)
        if True in slot and False in slot and "paired" not in slot:
            slot["paired"] = True
            pairs.append({"prompt": prompt, "chosen": slot[True][1], "rejected": slot[False][1]})
            numbers.append(slot[True][0])
            used += 2
    return pairs, numbers, len(records) - used


def _margins(records: Sequence[dict], where: str, numbers: Sequence[int] | None) -> torch.Tensor | None:
    """TRL RewardTrainer's margin column (pairs,), or None when no record has one; every record then needs one."""
    if not any("margin" in r for r in records):
        return None
    out = []
    for k, record in enumerate(records):
        value = record.get("margin")
        if not is_finite_number(value):
            raise ConfigError(f"{where} {numbers[k] if numbers is not None else k}: margin={value!r}; with a "
                              "'margin' column every record needs a finite number there (TRL's RewardTrainer)")
        out.append(float(value))
    return torch.tensor(out)


def warn_truncated(stats: dict, seq_len: int) -> None:
    """The one warning of `build_preference_dataset`'s (or `build_kto_dataset`'s) stats when SEQ_LEN cut answers:
    how many, the longest row, the SEQ_LEN that keeps them whole, the answer tokens lost."""
    kto = "examples" in stats
    warn_cut(setting="SEQ_LEN", limit=seq_len, cut=stats["truncated"],
             total=2 * stats["examples" if kto else "pairs"], longest=stats["longest"],
             what="completions and the KL estimate's mismatched rows" if kto else "chosen and rejected answers",
             lost=f"{stats['tokens_cut']:,} {'' if kto else 'trained '}answer tokens in all")

