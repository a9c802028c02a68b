"""Text from anywhere (embedded corpus, local files, the hub) -> token ids -> fixed-size blocks.

    train, val, tok = build_datasets("embedded", tokenizer="byte", block_size=128)

Every block has the same length, because XLA compiles one graph per input shape. Loaders: `data.loaders`.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from tpu_helpers.data.corpus import generate_corpus
from tpu_helpers.data.tokenizer import ByteTokenizer, Tokenizer, get_tokenizer

__all__ = ["TokenBlocks", "build_datasets", "data_identity", "load_text", "pack_tokens", "split_train_val"]

_TEXT_SUFFIXES = (".txt", ".md", ".text")
_JSON_SUFFIXES = (".json", ".jsonl")
# A hub name like "user/data-v1.2" must not be mistaken for a file, so a "suffix" has to start with a letter.
_WHOLE, _SAMPLE = 1 << 20, 1 << 18  # files up to 1 MiB are hashed whole, larger ones in three 256 KiB samples
_FILE_SUFFIX = re.compile(r"\.[A-Za-z][A-Za-z0-9]{0,7}$")


def _import_datasets() -> Any:
    try:
        import datasets
    except ImportError as e:
        raise ImportError("loading files or hub datasets needs Hugging Face datasets: pip install datasets "
                          "(source='embedded' needs nothing)") from e
    return datasets


def _looks_like_path(source: str) -> bool:
    return source.startswith(("/", "./", "../", "~")) or bool(_FILE_SUFFIX.search(source))


def _join_column(ds: Any, text_field: str, max_chars: int | None, what: str) -> str:
    columns = list(ds.column_names)
    if text_field not in columns:
        raise KeyError(f"{what} has no column {text_field!r}; available columns: {columns} (pass text_field=...)")
    parts: list[str] = []
    total = 0
    # Batched iteration over one column: reading a whole hub dataset's column at once can copy gigabytes,
    # and with max_chars we stop as soon as we have enough.
    for batch in ds.select_columns([text_field]).iter(batch_size=1000):
        for t in batch[text_field]:
            s = "" if t is None else str(t)
            parts.append(s)
            total += len(s) + 1
        if max_chars is not None and total >= max_chars:
            break
    text = "\n".join(parts)
    return text if max_chars is None else text[:max_chars]


def _skipped_dir(directory: Path) -> bool:
    """Folders that are not training data: hidden ones (.ipynb_checkpoints, .git), caches, and run folders
    (checkpoints/, anything holding a run.json or a run lock), whose results.json would read as text."""
    name = directory.name
    return (name.startswith(".") or name in ("__pycache__", "checkpoints")
            or (directory / "run.json").exists() or (directory / ".run.lock").exists())


def _local_files(path: Path) -> list[Path]:
    allowed = _TEXT_SUFFIXES + _JSON_SUFFIXES
    if path.is_dir():
        files: list[Path] = []
        for root, dirs, names in os.walk(path):
            dirs[:] = sorted(d for d in dirs if not _skipped_dir(Path(root) / d))
            files += [Path(root) / n for n in names if not n.startswith(".") and Path(n).suffix.lower() in allowed]
        files = sorted(f for f in files if f.is_file())
        if not files:
            raise ValueError(f"directory {str(path)!r} has no {'/'.join(allowed)} files (hidden files and folders, "
                             "checkpoints/ and run folders are skipped)")
        return files
    if path.suffix.lower() not in allowed:
        raise ValueError(f"cannot read {str(path)!r}: supported file types are {', '.join(allowed)}")
    return [path]


def _file_problem(path: Path) -> str | None:
    """What keeps `path` from being read as training data, or None (used to name the culprit of a failed load)."""
    try:
        if path.suffix.lower() in _JSON_SUFFIXES:
            if path.stat().st_size == 0 or not path.read_bytes().strip():
                return "empty file (a .jsonl file needs one JSON object per line)"
            if path.suffix.lower() == ".json":
                try:
                    json.loads(path.read_text(encoding="utf-8"))
                except ValueError as err:  # maybe JSON lines under a .json name: datasets reads those too
                    first = path.read_text(encoding="utf-8").lstrip().splitlines()[0]
                    try:
                        json.loads(first)
                    except ValueError:
                        return f"not valid JSON: {err}"
                    return _jsonl_problem(path)
                return None
            return _jsonl_problem(path)
        with open(path, "rb") as f:
            decoder = codecs.getincrementaldecoder("utf-8")()
            while chunk := f.read(1 << 20):
                decoder.decode(chunk)
            decoder.decode(b"", final=True)
    except UnicodeDecodeError as err:
        return f"not UTF-8 text ({err.reason} at byte {err.start} of a chunk)"
    except OSError as err:
        return f"cannot be read: {err.strerror or err}"
    return None


def _jsonl_problem(path: Path) -> str | None:
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                try:
                    record = json.loads(line)
                except ValueError as err:
                    return f"line {number} is not valid JSON: {err}"
                if not isinstance(record, dict):
                    return f"line {number} holds a {type(record).__name__}, not a JSON object"
    return None


def _check_readable(files: list[Path], source: str, cause: BaseException | None = None) -> None:
    problems = [(f, p) for f in files if (p := _file_problem(f)) is not None]
    if problems:
        listed = "\n".join(f"  {f}: {p}" for f, p in problems)
        raise ValueError(f"{len(problems)} of the {len(files)} data file(s) under {source!r} cannot be read:\n"
                         f"{listed}\nfix or remove them") from cause
    if cause is not None:
        raise ValueError(f"reading the data files under {source!r} failed ({type(cause).__name__}: {cause}); "
                         f"none of the {len(files)} file(s) shows a problem on its own") from cause


def data_identity(source: str) -> dict[str, str]:
    """What identifies a run's data: `{"dataset": ...}` plus, for local files, `"data_fingerprint"`.

    A local path is recorded resolved (a relative and an absolute path to one file are the same data), and the
    files are fingerprinted by content: name, size and a SHA-256 of each file (of its first, middle and last
    256 KiB when it is larger than 1 MiB, so that a terabyte of data costs milliseconds). Replacing a file's
    contents changes the fingerprint; an edit of equal size in the unsampled middle of a large file does not.
    """
    if source == "embedded" or not isinstance(source, str):
        return {"dataset": source}
    path = Path(source).expanduser()
    if not path.exists():
        return {"dataset": source}  # a hub name: the name (and split) is what there is to record
    root = path.resolve()
    try:
        files = _local_files(path)
    except (ValueError, OSError):  # not data this module reads (the caller brought its own Dataset): the path
        return {"dataset": str(root)}
    sha, total = hashlib.sha256(), 0
    for f in files:
        size = f.stat().st_size
        total += size
        sha.update(f"{f.relative_to(path) if path.is_dir() else f.name}\0{size}\0".encode())
        with open(f, "rb") as fh:
            if size <= _WHOLE:
                sha.update(fh.read())
            else:
                for offset in (0, size // 2 - _SAMPLE // 2, size - _SAMPLE):
                    fh.seek(offset)
                    sha.update(fh.read(_SAMPLE))
    return {"dataset": str(root),
            "data_fingerprint": f"{len(files)} file(s), {total:,} bytes, sha256 {sha.hexdigest()[:16]}"}


def _check_empty_json(files: list[Path], source: str) -> None:
    empty = [f for f in files if f.stat().st_size == 0]
    if empty:
        _check_readable(empty, source)


def load_text(
    source: str = "embedded",
    *,
    text_field: str = "text",
    split: str = "train",
    max_chars: int | None = None,
) -> str:
    """Return the training text named by ``source`` as one string.

    ``source`` is one of:

    - ``"embedded"``: the built-in corpus (:func:`tpu_helpers.data.corpus.generate_corpus`); no network, no deps.
    - a local ``.txt``/``.md`` file (read line by line), a ``.json``/``.jsonl`` file (its ``text_field``),
      or a directory of such files (read recursively: text files, then JSON files, each in sorted order).
      An existing path always wins over a hub name of the same spelling.
    - a Hugging Face hub dataset name such as ``"roneneldan/TinyStories"``, loaded with
      ``datasets.load_dataset(source, split=split)``. ``split`` accepts slices like ``"train[:10%]"``, which
      is the way to avoid loading all of a huge dataset; ``split`` is ignored for local files.

    Records are joined with newlines. ``max_chars`` keeps only the first ``max_chars`` characters, which
    bounds memory and tokenization time on big datasets (it does not reduce what a hub download fetches).
    """
    if not isinstance(source, str) or not source:
        raise ValueError(f"source must be 'embedded', a local path or a hub dataset name, got {source!r}")
    if max_chars is not None and (isinstance(max_chars, bool) or not isinstance(max_chars, int) or max_chars < 1):
        raise ValueError(f"max_chars must be a positive int or None, got {max_chars!r}")
    if source == "embedded":
        return generate_corpus(max_chars) if max_chars is not None else generate_corpus()

    path = Path(source).expanduser()
    if path.exists():
        files = _local_files(path)
        datasets = _import_datasets()
        # One load_dataset call per builder: "text" and "json" files cannot share a call.
        texts = []
        for builder, suffixes in (("text", _TEXT_SUFFIXES), ("json", _JSON_SUFFIXES)):
            chosen = [f for f in files if f.suffix.lower() in suffixes]
            if not chosen:
                continue
            if builder == "json":
                _check_empty_json(chosen, source)  # datasets fails on them with a bare StopIteration
            try:
                ds = datasets.load_dataset(builder, data_files=[str(f) for f in chosen], split="train")
            except (Exception, StopIteration) as err:  # e.g. DatasetGenerationError, which names no file
                _check_readable(chosen, source, err)
                raise
            texts.append(_join_column(ds, text_field, max_chars, f"{builder} files under {source!r}"))
        text = "\n".join(texts)
        return text if max_chars is None else text[:max_chars]
    if _looks_like_path(source):
        raise FileNotFoundError(
            f"no such file or directory: {source!r}. source must be 'embedded', an existing local "
            f"file ({', '.join(_TEXT_SUFFIXES + _JSON_SUFFIXES)}) or directory of such files, or a Hugging Face "
            "hub dataset name like 'roneneldan/TinyStories'"
        )
    datasets = _import_datasets()
    ds = datasets.load_dataset(source, split=split)
    return _join_column(ds, text_field, max_chars, f"hub dataset {source!r} (split {split!r})")


def pack_tokens(ids: Sequence[int] | torch.Tensor, block_size: int) -> torch.Tensor:
    """Cut a token stream into a ``[n_blocks, block_size + 1]`` long tensor of consecutive windows.

    Neighbouring windows share one token (the last of one is the first of the next), so every token is a
    target exactly once: ``x, y = b[:-1], b[1:]``. The tail that does not fill a window is dropped.
    ``bytes`` are accepted as a fast path for byte-level ids.
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    if isinstance(ids, (bytes, bytearray)):
        t = torch.frombuffer(bytearray(ids), dtype=torch.uint8).long() if ids else torch.empty(0, dtype=torch.long)
    else:
        t = torch.as_tensor(ids, dtype=torch.long)
    if t.dim() != 1:
        raise ValueError(f"ids must be one-dimensional, got shape {tuple(t.shape)}")
    n_blocks = (t.numel() - 1) // block_size
    if n_blocks < 1:
        raise ValueError(f"text too short: {t.numel()} tokens, need at least {block_size + 1} "
                         f"for one block of block_size={block_size}")
    # unfold makes overlapping-by-one views; clone so the result does not pin the whole source tensor.
    return t[: n_blocks * block_size + 1].unfold(0, block_size + 1, block_size).clone()


class TokenBlocks(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Map-style dataset over packed blocks; item ``i`` is ``(x, y)`` with ``y`` = ``x`` shifted by one."""

    def __init__(self, blocks: torch.Tensor) -> None:
        if blocks.dim() != 2 or blocks.size(1) < 2:
            raise ValueError(f"blocks must have shape [n_blocks, block_size + 1], got {tuple(blocks.shape)}")
        self.blocks = blocks.long()

    @property
    def block_size(self) -> int:
        return self.blocks.size(1) - 1

    def __len__(self) -> int:
        return self.blocks.size(0)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        b = self.blocks[i]
        return b[:-1], b[1:]


def split_train_val(
    blocks: torch.Tensor, val_fraction: float = 0.05, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Shuffle blocks deterministically from ``seed`` and split off ``val_fraction`` of them (at least one
    block on each side). Shuffling first keeps validation from being just the corpus's last stories."""
    if not 0.0 < float(val_fraction) < 1.0:
        raise ValueError(f"val_fraction must be strictly between 0 and 1, got {val_fraction!r}")
    n = blocks.size(0)
    if n < 2:
        raise ValueError(f"need at least 2 blocks to split into train and validation, got {n}")
    n_val = min(max(1, round(n * val_fraction)), n - 1)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    return blocks[perm[n_val:]], blocks[perm[:n_val]]


def build_datasets(
    source: str = "embedded",
    tokenizer: str | Tokenizer = "byte",
    block_size: int = 128,
    val_fraction: float = 0.05,
    seed: int = 0,
    max_chars: int | None = None,
    *,
    text_field: str = "text",
    split: str = "train",
) -> tuple[TokenBlocks, TokenBlocks, Tokenizer]:
    """``load_text`` -> tokenize -> ``pack_tokens`` -> ``split_train_val``; returns ``(train, val, tok)``.

    ``tokenizer`` is a name for :func:`get_tokenizer` or an object with ``encode``/``decode``;
    ``text_field``, ``split`` and ``max_chars`` go to :func:`load_text`.
    """
    tok: Tokenizer = get_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
    text = load_text(source, text_field=text_field, split=split, max_chars=max_chars)
    # Bytes straight into a tensor: the same ids as tok.encode, without a Python list of millions of ints.
    ids: Sequence[int] = text.encode("utf-8") if isinstance(tok, ByteTokenizer) else tok.encode(text)
    train, val = split_train_val(pack_tokens(ids, block_size), val_fraction=val_fraction, seed=seed)
    return TokenBlocks(train), TokenBlocks(val), tok
