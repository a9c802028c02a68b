"""Supervised fine-tuning data: records -> fixed-shape token rows with -100 labels on prompt and padding.

    records = load_records("instructions")                 # or a local .jsonl/.json/.csv/.parquet, or a hub name
    train, val = build_sft_datasets(tokenizer, records, seq_len=64)
    train[0]  # {"input_ids": (64,), "attention_mask": (64,), "labels": (64,)}

Three record forms are recognised: chat (`messages`: a list of {role, content}), prompt/response pairs (`prompt` +
`response`, `instruction` + `output`, `question` + `answer`) and plain text (`text`). Chat and pairs are rendered
with the tokenizer's chat template; only assistant tokens (and the end-of-turn token that closes them, plus what
the template closes a chat with after the last answer, e.g. Phi-3's EOS) are trained.

A chat record about tools, TRL's SFT form `{"messages": [...], "tools": [JSON schemas]}` (assistant `tool_calls`,
`tool` messages; `tools` may be a JSON string, as TRL's data sets hold it), is rendered by
`agents.ChatFormat(tokenizer).render(messages, tools=tools)`, the ids an RL episode gathers: labels on the
assistant's own tokens (its text and calls up to its end-of-turn token), -100 on system, user and tool text.
Every row is padded to `seq_len`, so every batch has one shape and nothing recompiles on XLA.

`instruction_records` generates the offline default task set (next/previous letter, adding small numbers) whose
held-out exact-match accuracy (`exact_match`) a tiny model visibly improves in a few hundred CPU steps.
"""

from __future__ import annotations

import hashlib
import json
import random
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from tpu_helpers.config import ConfigError
from tpu_helpers.data.cuts import merged, trained_spans, warn_cut

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
        return [{"role": m["role"], "content": m["content"]} for m in record["messages"]]  # a plain chat record
    for p, r in PAIR_FIELDS:
        if p in record and r in record:
            return [{"role": "user", "content": str(record[p])}, {"role": "assistant", "content": str(record[r])}]
    raise AssertionError("record_form accepted a record _as_messages cannot read")


# ---- tool conversations (TRL's SFT form) ---------------------------------------------------------------------------
TOOL_FORM = ('{"messages": [...], "tools": [JSON schemas]}: assistant messages may carry "tool_calls" (a list of '
             '{"type": "function", "function": {"name": str, "arguments": object or JSON string}}), "tool" messages '
             'carry "content" (and "name" / "tool_call_id"); "tools" is a list of {"type": "function", "function": '
             '{...}} schemas or that list as a JSON string')
_MESSAGE_KEYS = ("role", "content", "tool_calls", "name", "tool_call_id")


def _drop_none(value: Any) -> Any:
    """`value` without None-valued keys at any depth: what an Arrow table fills in for keys other rows have."""
    if isinstance(value, dict):
        return {k: _drop_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_none(v) for v in value]
    return value


def _tool_schemas(record: dict, where: str) -> list[dict] | None:
    tools = record.get("tools")
    if isinstance(tools, str):
        try:
            tools = json.loads(tools) if tools.strip() else None
        except json.JSONDecodeError as err:
            raise ConfigError(f"{where} field 'tools' is a string that is not JSON ({err}); give a list of tool "
                              f"schemas or that list as a JSON string. Accepted: {TOOL_FORM}") from None
    if tools is None:
        return None
    ok = isinstance(tools, list) and all(
        isinstance(t, dict) and isinstance(t.get("function", t), dict) and isinstance(t.get("function", t).get("name"), str)
        for t in tools)
    if not ok:
        raise ConfigError(f"{where} field 'tools' is {str(tools)[:200]!r}, not a list of tool schemas (each a dict "
                          f"with a function name). Accepted: {TOOL_FORM}")
    return [_drop_none(t) for t in tools] or None


def _tool_call(call: Any, where: str) -> dict:
    """One tool call in the form an episode's parsed answer holds: {"type": "function", "function": {"name",
    "arguments": dict}} (and its "id" when it has one); arguments given as a JSON string are decoded."""
    function = call.get("function", call) if isinstance(call, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    arguments = function.get("arguments", {}) if isinstance(function, dict) else None
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            arguments = None
    if not isinstance(name, str) or not name or not isinstance(arguments, dict):
        raise ConfigError(f"{where} is {str(call)[:200]!r}, not a tool call: each needs a function name and "
                          f"arguments that are a JSON object (a dict or its JSON string). Accepted: {TOOL_FORM}")
    out: dict[str, Any] = {"type": "function", "function": {"name": name, "arguments": arguments}}
    if isinstance(call, dict) and call.get("id") is not None:
        out["id"] = call["id"]
    return out


def _tool_message(m: Any, where: str) -> dict:
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise ConfigError(f"{where} is {str(m)[:200]!r}, not a message with a role. Accepted: {TOOL_FORM}")
    out = {k: m[k] for k in _MESSAGE_KEYS if m.get(k) is not None}
    role = out["role"]
    if role == "tool":
        if "content" not in out:
            raise ConfigError(f"{where} (tool) has no content: a tool message carries the tool's result as "
                              f"'content' (a string). Accepted: {TOOL_FORM}")
        if not isinstance(out["content"], str):  # a result written as JSON data
            out["content"] = json.dumps(out["content"], ensure_ascii=False)
    calls = out.pop("tool_calls", None)
    if calls is not None:
        if role != "assistant" or not isinstance(calls, list):
            raise ConfigError(f"{where} ({role}) has tool_calls={str(calls)[:200]!r}: only an assistant message "
                              f"carries tool calls, as a list. Accepted: {TOOL_FORM}")
        if calls:
            out["tool_calls"] = [_tool_call(c, f"{where} tool_calls[{j}]") for j, c in enumerate(calls)]
    if role != "tool" and not isinstance(out.get("content", ""), str):
        raise ConfigError(f"{where} ({role}) has content {str(out['content'])[:200]!r}, not a string")
    if role == "assistant" or "content" not in out:
        out["content"] = out.get("content", "")  # a turn of calls alone: "" as an episode's parsed answer has
    return out


def tool_conversation(record: dict, *, where: str = "record") -> tuple[list[dict], list[dict] | None] | None:
    """(messages, tool schemas) of a chat record about tools, normalised (see TOOL_FORM); None for a plain chat
    record (no tool calls, no tool messages and no tools), which keeps the plain encoding."""
    if not isinstance(record, dict) or not isinstance(record.get("messages"), list):
        return None
    tools = _tool_schemas(record, where)
    raw = record["messages"]
    if tools is None and not any(isinstance(m, dict) and (m.get("tool_calls") or m.get("role") == "tool")
                                 for m in raw):
        return None
    messages = [_tool_message(m, f"{where} messages[{i}]") for i, m in enumerate(raw)]
    return messages, tools


_FORMATS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def chat_format(tokenizer: Any) -> Any:
    """The tokenizer's `agents.ChatFormat`, made once per tokenizer and chat template (it probes the template)."""
    from tpu_helpers.agents.chat import ChatFormat

    template = getattr(tokenizer, "chat_template", None)
    try:
        cached = _FORMATS.get(tokenizer)
    except TypeError:  # not weakly referenceable: no cache
        return ChatFormat(tokenizer)
    if cached is not None and cached[0] == template:
        return cached[1]
    fmt = ChatFormat(tokenizer)
    _FORMATS[tokenizer] = (template, fmt)
    return fmt


def encode_tool_conversation(tokenizer: Any, messages: list[dict],
                             tools: list[dict] | None) -> tuple[list[int], list[int]]:
    """Ids and labels of a tool conversation: `ChatFormat.render`'s ids, labels where its mask is 1."""
    rendered = chat_format(tokenizer).render(messages, tools)
    return list(rendered.ids), [t if k else -100 for t, k in zip(rendered.ids, rendered.mask, strict=True)]


def check_chat_template(tokenizer: Any, name: str = "tokenizer") -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(f"{name} ({type(tokenizer).__name__}, {getattr(tokenizer, 'name_or_path', '?')!r}) has "
                          "no chat template, needed for chat and prompt/response data; use an instruct model's "
                          "tokenizer, set tokenizer.chat_template, or give plain 'text' records")


def _ids(tokenizer: Any, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def encode_record(tokenizer: Any, record: dict, *, where: str = "record") -> tuple[list[int], list[int]]:
    """Token ids and labels of one record (labels -100 where nothing is trained), not yet padded."""
    form = record_form(record, where=where)
    if form == "text":
        ids = _ids(tokenizer, str(record["text"]))
        if tokenizer.eos_token_id is not None:
            ids = ids + [tokenizer.eos_token_id]
        return ids, list(ids)
    check_chat_template(tokenizer)
    tooled = tool_conversation(record, where=where) if form == "chat" else None
    if tooled is not None:
        try:
            return encode_tool_conversation(tokenizer, *tooled)
        except ConfigError as err:  # the template's (not prefix-preserving, no end-of-turn token): name the record
            raise ConfigError(f"{where}: {err}") from None
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
                     pack: bool = False, warn: bool = True) -> tuple[SFTDataset, dict]:
    """Pad (right) or truncate every record to `seq_len`; records with no trained token left are dropped.

    ``pack=True`` puts several records in each row instead (see `pack_examples`): fewer rows, no padding waste.
    Stats: records, truncated (cut to seq_len), dropped, tokens_trained, and what a cut costs: the longest record's
    tokens (`longest`), the chat records' trained assistant turns (`turns`), those that lose tokens (`turns_cut`) or
    all of them (`turns_lost`), and the trained tokens lost (`tokens_cut`); `warn`: said in one
    `data.cuts.TruncationWarning`.
    """
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise ConfigError("the tokenizer has neither a pad nor an eos token; set tokenizer.pad_token")
    rows, masks, labels = [], [], []
    examples: list[tuple[list[int], list[int]]] = []
    stats = {"records": len(records), "truncated": 0, "dropped": 0, "longest": 0, "turns": 0, "turns_cut": 0,
             "turns_lost": 0, "tokens_cut": 0}
    for k, record in enumerate(records):
        ids, lab = encode_record(tokenizer, record, where=f"record {k}")
        stats["longest"] = max(stats["longest"], len(ids))
        spans = trained_spans(lab) if record_form(record) != "text" else []
        stats["turns"] += len(spans)
        if len(ids) > seq_len:
            stats["truncated"] += 1
            stats["turns_cut"] += sum(end > seq_len for _, end in spans)
            stats["turns_lost"] += sum(start >= seq_len for start, _ in spans)
            stats["tokens_cut"] += sum(x != -100 for x in lab[seq_len:])
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
    if warn:
        warn_truncated(stats, seq_len)
    if not rows and not examples:
        raise ConfigError(f"no record has a trained token within seq_len={seq_len} ({stats['records']} records, "
                          f"the longest {stats['longest']} tokens); raise SEQ_LEN or check the data")
    if pack:
        data = pack_examples(examples, seq_len, pad)
        stats["rows"] = len(data)
        stats["tokens_trained"] = int((data.labels[:, 1:] != -100).sum())
        return data, stats
    stats["tokens_trained"] = sum(sum(x != -100 for x in r[1:]) for r in labels)  # what the loss counts
    return SFTDataset(torch.tensor(rows), torch.tensor(masks), torch.tensor(labels)), stats


def check_records(records: Sequence[dict], where: str = "record") -> None:
    """Every record's form (and a tool conversation's messages) checked; an error names the record's index."""
    for k, record in enumerate(records):
        if record_form(record, where=f"{where} {k}") == "chat":
            tool_conversation(record, where=f"{where} {k}")


def split_indices(n: int, share: float, seed: int, *, at_most: int | None = None) -> tuple[list[int], list[int]]:
    """(kept, split off) indices of `n` records shuffled with `seed`: `share` of them split off, at least one and at
    most `at_most` (the validation split, the held-out split)."""
    order = list(range(n))
    random.Random(seed).shuffle(order)
    k = max(1, int(n * share))
    k = k if at_most is None else min(k, at_most)
    return order[k:], order[:k]


def record_key(record: Any) -> str:
    """A record's identity, its content as canonical JSON: two records with the same key are the same data."""
    return json.dumps(record, sort_keys=True, default=str)


def build_sft_datasets(tokenizer: Any, records: Sequence[dict], *, seq_len: int, val_fraction: float = 0.05,
                       seed: int = 0, pack: bool = False) -> tuple[SFTDataset, SFTDataset, dict]:
    """Check every record (errors name its index in `records`), shuffle (seeded), split and tokenize; returns
    (train, val, stats)."""
    check_records(records)
    train_idx, val_idx = split_indices(len(records), val_fraction, seed)
    val_rec = [records[i] for i in val_idx]
    train_rec = [records[i] for i in train_idx]
    train, stats = tokenize_records(tokenizer, train_rec, seq_len, pack=pack, warn=False)
    val, val_stats = tokenize_records(tokenizer, val_rec, seq_len, pack=pack, warn=False)
    warn_truncated(merged(stats, val_stats), seq_len)  # once, for the training and validation rows
    return train, val, stats


def warn_truncated(stats: dict, seq_len: int) -> None:
    """The one warning of `tokenize_records`' stats when SEQ_LEN cut records: how many, the longest, the SEQ_LEN
    that keeps them whole, and the trained assistant turns and tokens lost."""
    turns = (f"{stats['turns_cut']} of {stats['turns']} trained assistant turns lose tokens "
             f"({stats['turns_lost']} entirely), " if stats["turns"] else "")
    warn_cut(setting="SEQ_LEN", limit=seq_len, cut=stats["truncated"], total=stats["records"],
             longest=stats["longest"], what="records", lost=f"{turns}{stats['tokens_cut']:,} trained tokens in all")


def prompts_and_answers(records: Sequence[dict], tokenizer: Any = None) -> tuple[list[list[dict] | str], list[str]]:
    """Split chat/pair records into (messages up to the last assistant turn, that turn's text).

    A tool conversation (given `tokenizer`) gives its prompt as text, the conversation up to its last assistant turn
    rendered by `ChatFormat` with the generation prompt, and its answer as that turn's text as the model writes it
    (calls included) without the end-of-turn token; without `tokenizer` it is an error."""
    prompts: list[list[dict] | str] = []
    answers = []
    for k, record in enumerate(records):
        tooled = tool_conversation(record, where=f"record {k}")
        if tooled is not None:
            if tokenizer is None:
                raise ConfigError(f"record {k} is a tool conversation: its prompt is rendered through the "
                                  "tokenizer's ChatFormat; pass tokenizer=")
            messages, tools = tooled
            fmt = chat_format(tokenizer)
            last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
            prompts.append("".join(text for text, _ in fmt.pieces(messages[:last], tools, generation_prompt=True)))
            own = [text for text, mine in fmt.pieces(messages[:last + 1], tools) if mine][-1]
            answers.append(own.removesuffix(fmt.end))
            continue
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
