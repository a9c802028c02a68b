"""Supervised fine-tuning data: records -> fixed-shape token rows with -100 labels on prompt and padding.

    records = load_records("instructions")                 # or a local .jsonl/.json/.csv/.parquet, or a hub name
    train, val = build_sft_datasets(tokenizer, records, seq_len=64)
    train[0]  # {"input_ids": (64,), "attention_mask": (64,), "labels": (64,)}

Three record forms are recognised: chat (`messages`: a list of {role, content}), prompt/response pairs (`prompt` +
`response`, `instruction` + `output`, `question` + `answer`) and plain text (`text`). Chat and pairs are rendered
with the tokenizer's chat template; only assistant tokens (and the end-of-turn token that closes them, plus what
the template closes a chat with after the last answer, e.g. Phi-3's EOS) are trained.
Every row is padded to `seq_len`, so every batch has one shape and nothing recompiles on XLA.

`instruction_records` generates the offline default task set (next/previous letter, adding small numbers) whose
held-out exact-match accuracy (`exact_match`) a tiny model visibly improves in a few hundred CPU steps.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from tpu_helpers.config import ConfigError

PAIR_FIELDS = (("prompt", "response"), ("instruction", "output"), ("question", "answer"))
ACCEPTED_FORMS = ("messages (chat: list of {role, content})", "prompt + response", "instruction + output",
                  "question + answer", "text")
DEFAULT_DATASET = "instructions"
_FILE_KINDS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}

_LETTERS = "abcdefghijklmnopqrstuvwxyz"
_TEMPLATES = {
    "next": ("What letter comes after {x}?", "Which letter follows {x}?", "Next letter after {x}:"),
    "prev": ("What letter comes before {x}?", "Which letter precedes {x}?", "Letter before {x}:"),
    "add": ("What is {a} plus {b}?", "{a} + {b} =", "Add {a} and {b}."),
}


def _all_instances() -> list[tuple[str, str]]:
    out = []
    for i, x in enumerate(_LETTERS):
        for t in _TEMPLATES["next"]:
            if i < 25:
                out.append((t.format(x=x), _LETTERS[i + 1]))
        for t in _TEMPLATES["prev"]:
            if i > 0:
                out.append((t.format(x=x), _LETTERS[i - 1]))
    for a in range(10):
        for b in range(10):
            out.extend((t.format(a=a, b=b), str(a + b)) for t in _TEMPLATES["add"])
    return out


def _held_out(prompt: str) -> bool:
    # A stable 15% of the distinct prompts, chosen by hash (the same on every machine and Python).
    return hashlib.sha256(prompt.encode()).digest()[0] < 38


def instruction_records(n: int = 4000, *, seed: int = 0, split: str = "train") -> list[dict]:
    """`n` chat records of the generated task set (`split` "train"), or every held-out prompt once ("test")."""
    if split not in ("train", "test"):
        raise ConfigError(f"split={split!r} is not one of ('train', 'test')")
    pool = [(p, a) for p, a in _all_instances() if _held_out(p) == (split == "test")]
    if split == "test":
        chosen = pool
    else:
        r = random.Random(seed)
        chosen = [r.choice(pool) for _ in range(n)]
    return [{"messages": [{"role": "user", "content": p}, {"role": "assistant", "content": a}]} for p, a in chosen]


def load_records(source: str, *, split: str = "train", max_records: int | None = None) -> list[dict]:
    """Records from the generated set ("instructions"), a local JSONL/JSON/CSV/Parquet file, or a hub data set."""
    if source == DEFAULT_DATASET:
        return instruction_records(max_records or 4000, split=split)
    import datasets

    path = Path(source)
    if path.suffix.lower() in _FILE_KINDS or path.exists():
        if not path.is_file():
            raise ConfigError(f"dataset={source!r} does not exist or is not a file; give a .jsonl, .json, .csv or "
                              f".parquet file, a hub data set name, or {DEFAULT_DATASET!r}")
        kind = _FILE_KINDS.get(path.suffix.lower())
        if kind is None:
            raise ConfigError(f"dataset={source!r}: unsupported file type {path.suffix!r}; use one of "
                              f"{sorted(_FILE_KINDS)}")
        ds = datasets.load_dataset(kind, data_files=str(path), split="train")
    else:
        ds = datasets.load_dataset(source, split=split)
    rows = ds.select(range(min(len(ds), max_records))) if max_records else ds
    return [dict(r) for r in rows]


def record_form(record: dict, *, where: str = "record") -> str:
    """'chat', 'pair' or 'text'; an error listing the accepted fields for anything else."""
    if not isinstance(record, dict):
        raise ConfigError(f"{where} is a {type(record).__name__}, not a dict; accepted forms: {ACCEPTED_FORMS}")
    if "messages" in record:
        return "chat"
    if any(p in record and r in record for p, r in PAIR_FIELDS):
        return "pair"
    if "text" in record:
        return "text"
    raise ConfigError(f"{where} has fields {sorted(record)}, none of the recognised forms; accepted: "
                      f"{', '.join(ACCEPTED_FORMS)}")


def _as_messages(record: dict) -> list[dict]:
    if "messages" in record:
        return [{"role": m["role"], "content": m["content"]} for m in record["messages"]]
    for p, r in PAIR_FIELDS:
        if p in record and r in record:
            return [{"role": "user", "content": str(record[p])}, {"role": "assistant", "content": str(record[r])}]
    raise AssertionError("record_form accepted a record _as_messages cannot read")


def check_chat_template(tokenizer: Any, name: str = "tokenizer") -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(f"{name} ({type(tokenizer).__name__}, {getattr(tokenizer, 'name_or_path', '?')!r}) has "
                          "no chat template, needed for chat and prompt/response data; use an instruct model's "
                          "tokenizer, set tokenizer.chat_template, or give plain 'text' records")


def _ids(tokenizer: Any, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def encode_record(tokenizer: Any, record: dict) -> tuple[list[int], list[int]]:
    """Token ids and labels of one record (labels -100 where nothing is trained), not yet padded."""
    form = record_form(record)
    if form == "text":
        ids = _ids(tokenizer, str(record["text"]))
        if tokenizer.eos_token_id is not None:
            ids = ids + [tokenizer.eos_token_id]
        return ids, list(ids)
    check_chat_template(tokenizer)
    messages = _as_messages(record)

    def render(chat: list[dict], prompt: bool = False) -> list[int]:
        return _ids(tokenizer, tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=prompt))

    ids = render(messages)
    labels = [-100] * len(ids)
    # An answer's tokens start after the chat before it with the generation prompt (a prefix of the whole chat) and
    # end where the chat ending with that answer stops agreeing with the whole: what a template writes only at a
    # chat's end (Phi-3's EOS) is trained after the last answer alone. Growing prefixes, each extending the last,
    # would see such an ending as a rewrite and train nothing. A turn the template writes otherwise once the chat
    # goes on (Qwen3 drops earlier answers' think blocks) trains nothing.
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = render(messages[:i], prompt=True)
        if ids[:len(prompt)] != prompt:
            continue
        ending = ids if i == len(messages) - 1 else render(messages[:i + 1])
        pairs = zip(ending, ids, strict=False)  # the common prefix: `ending` may be longer (a closing EOS)
        end = next((k for k, (a, b) in enumerate(pairs) if a != b), min(len(ending), len(ids)))
        labels[len(prompt):end] = ids[len(prompt):end]
    return ids, labels


class SFTDataset(Dataset):
    """Fixed-length rows: a dict of input_ids, attention_mask and labels (int64 tensors of length seq_len).

    Packed rows (``position_ids`` given) hold several examples each and carry position_ids instead of an
    attention_mask: positions restart at 0 at every example, and a Hugging Face model given position_ids without
    an attention mask attends only within each run of consecutive positions (transformers' packed-sequence mask).
    """

    def __init__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, labels: torch.Tensor,
                 position_ids: torch.Tensor | None = None) -> None:
        self.input_ids, self.attention_mask, self.labels = input_ids, attention_mask, labels
        self.position_ids = position_ids

    @property
    def seq_len(self) -> int:
        return self.input_ids.shape[1]

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if self.position_ids is not None:
            return {"input_ids": self.input_ids[i], "position_ids": self.position_ids[i], "labels": self.labels[i]}
        return {"input_ids": self.input_ids[i], "attention_mask": self.attention_mask[i], "labels": self.labels[i]}


def pack_examples(examples: Sequence[tuple[list[int], list[int]]], seq_len: int, pad: int) -> SFTDataset:
    """Several (ids, labels) examples per row, first fit in the given order, each whole (none is split).

    Each example's first token is no target (it would be predicted from the previous example's last token), and
    the padding at a row's end is a run of its own (positions from 0, labels -100), so it never sees an example.
    """
    rows: list[list[tuple[list[int], list[int]]]] = []
    room: list[int] = []
    for ids, lab in examples:
        k = next((j for j, free in enumerate(room) if free >= len(ids)), None)
        if k is None:
            rows.append([])
            room.append(seq_len)
            k = len(rows) - 1
        rows[k].append((ids, [-100] + lab[1:]))
        room[k] -= len(ids)
    input_ids, position_ids, labels = [], [], []
    for row, free in zip(rows, room, strict=True):
        input_ids.append([t for ids, _ in row for t in ids] + [pad] * free)
        labels.append([t for _, lab in row for t in lab] + [-100] * free)
        position_ids.append([p for ids, _ in row for p in range(len(ids))] + list(range(free)))
    return SFTDataset(torch.tensor(input_ids), None, torch.tensor(labels), torch.tensor(position_ids))


def tokenize_records(tokenizer: Any, records: Sequence[dict], seq_len: int, *,
                     pack: bool = False) -> tuple[SFTDataset, dict]:
    """Pad (right) or truncate every record to `seq_len`; records with no trained token left are dropped.

    ``pack=True`` puts several records in each row instead (see `pack_examples`): fewer rows, no padding waste.
    """
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise ConfigError("the tokenizer has neither a pad nor an eos token; set tokenizer.pad_token")
    rows, masks, labels = [], [], []
    examples: list[tuple[list[int], list[int]]] = []
    stats = {"records": len(records), "truncated": 0, "dropped": 0}
    for k, record in enumerate(records):
        record_form(record, where=f"record {k}")
        ids, lab = encode_record(tokenizer, record)
        if len(ids) > seq_len:
            stats["truncated"] += 1
            ids, lab = ids[:seq_len], lab[:seq_len]
        if sum(x != -100 for x in lab[1:]) == 0:  # position 0 is never a target (the model shifts labels)
            stats["dropped"] += 1
            continue
        if pack:
            examples.append((ids, lab))
            continue
        n = len(ids)
        rows.append(ids + [pad] * (seq_len - n))
        masks.append([1] * n + [0] * (seq_len - n))
        labels.append(lab + [-100] * (seq_len - n))
    if not rows and not examples:
        raise ConfigError(f"no record has a trained token within seq_len={seq_len} ({stats['records']} records); "
                          "raise SEQ_LEN or check the data")
    if pack:
        data = pack_examples(examples, seq_len, pad)
        stats["rows"] = len(data)
        stats["tokens_trained"] = int((data.labels[:, 1:] != -100).sum())
        return data, stats
    stats["tokens_trained"] = sum(sum(x != -100 for x in r[1:]) for r in labels)  # what the loss counts
    return SFTDataset(torch.tensor(rows), torch.tensor(masks), torch.tensor(labels)), stats


def build_sft_datasets(tokenizer: Any, records: Sequence[dict], *, seq_len: int, val_fraction: float = 0.05,
                       seed: int = 0, pack: bool = False) -> tuple[SFTDataset, SFTDataset, dict]:
    """Shuffle (seeded), split and tokenize; returns (train, val, stats)."""
    order = list(range(len(records)))
    random.Random(seed).shuffle(order)
    n_val = max(1, int(len(order) * val_fraction))
    val_rec = [records[i] for i in order[:n_val]]
    train_rec = [records[i] for i in order[n_val:]]
    train, stats = tokenize_records(tokenizer, train_rec, seq_len, pack=pack)
    val, _ = tokenize_records(tokenizer, val_rec, seq_len, pack=pack)
    return train, val, stats


def prompts_and_answers(records: Sequence[dict]) -> tuple[list[list[dict]], list[str]]:
    """Split chat/pair records into (messages up to the last assistant turn, that turn's text)."""
    prompts, answers = [], []
    for record in records:
        messages = _as_messages(record)
        last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
        prompts.append(messages[:last])
        answers.append(messages[last]["content"])
    return prompts, answers


def exact_match(predictions: Sequence[str], answers: Sequence[str]) -> float:
    """Share of predictions equal to the answer after stripping whitespace."""
    if len(predictions) != len(answers) or not answers:
        raise ValueError(f"need as many predictions as answers (got {len(predictions)} and {len(answers)})")
    return sum(p.strip() == a.strip() for p, a in zip(predictions, answers, strict=True)) / len(answers)
