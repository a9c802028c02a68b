"""A cache of a teacher's top-k log-probabilities per position, so distillation runs without the teacher.

    cache = build_teacher_cache("caches/instr_L48_K128", rows, topk_fn, identity=ident, batch_size=16)
    cache = open_teacher_cache("caches/instr_L48_K128", expect=ident)   # refuses another tokenizer/seq_len/data
    data = cache.attach(rows)                      # each row + teacher_ids (S, k), teacher_logp (S, k), teacher_tail (S,)
    mine = cache.attach(rows, process_index=i, process_count=n)   # the rows of shards i, i + n, ... only

`topk_fn(batch)` runs the teacher on `batch_size` rows and returns the k most likely next tokens, their
log-probabilities and the log of the mass left over; the recipe wires it (algorithms/distill.py `TeacherTopK`).
`identity` (`cache_identity`) says what the cache is for, and a reader expecting another gets an error naming each
difference. On disk: safetensors shards and a manifest with their sha256, each written atomically, so a killed build
resumes and a damaged shard is named. The files, resuming and reading from several hosts: docs/guides/data.md.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from tpu_helpers.config import ConfigError
from tpu_helpers.core.atomic_io import atomic_write_bytes, atomic_write_text, sha256_file
from tpu_helpers.data.loaders import fixed_batches

FORMAT = 1
MANIFEST = "manifest.json"
LOGP_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# What each identity entry means, for the message that names a difference.
IDENTITY_NAMES = {"teacher": "teacher", "teacher_hash": "teacher weights (hash)", "tokenizer": "tokenizer",
                  "vocab_size": "vocabulary size", "seq_len": "seq_len", "k": "top-k", "temperature": "temperature",
                  "data": "data (fingerprint of the tokenized rows)", "rows": "rows"}
TopKFn = Callable[[dict], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


class TeacherCacheError(RuntimeError):
    """A teacher cache on disk is missing, incomplete or damaged; the message names the file."""


def shard_name(i: int) -> str:
    return f"shard-{i:05d}.safetensors"


def data_fingerprint(rows: Dataset) -> str:
    """A hash of every row's tensors (names, shapes, values) in order: another data set, seq_len or order differs."""
    h = hashlib.sha256()
    for i in range(len(rows)):
        row = rows[i]
        for key in sorted(row):
            t = torch.as_tensor(row[key]).contiguous()
            h.update(f"{key}{tuple(t.shape)}{t.dtype}".encode())
            h.update(t.numpy().tobytes())
    return h.hexdigest()[:16]


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A hash of the vocabulary (token -> id), the special tokens and the chat template."""
    vocab = sorted(tokenizer.get_vocab().items())
    special = sorted(map(str, getattr(tokenizer, "all_special_tokens", [])))
    blob = json.dumps([vocab, special, getattr(tokenizer, "chat_template", None) or ""], ensure_ascii=False)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def cache_identity(*, teacher: str, teacher_hash: str, tokenizer: Any, vocab_size: int, k: int, temperature: float,
                   rows: Dataset) -> dict:
    """What a cache is for; two caches with equal identities hold the same numbers (up to the device's rounding).
    seq_len is the rows' width."""
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ConfigError(f"TEACHER_TOP_K={k!r} must be an integer >= 1")
    if k > vocab_size:
        raise ConfigError(f"TEACHER_TOP_K={k} is larger than the vocabulary ({vocab_size} tokens); use at most {vocab_size} "
                          "(the whole vocabulary: an exact copy of the teacher's distribution)")
    if not temperature > 0:
        raise ConfigError(f"temperature={temperature!r} must be > 0")
    return {"teacher": str(teacher), "teacher_hash": str(teacher_hash), "tokenizer": tokenizer_fingerprint(tokenizer),
            "vocab_size": int(vocab_size), "seq_len": int(rows[0]["input_ids"].shape[-1]) if len(rows) else 0,
            "k": int(k), "temperature": float(temperature), "data": data_fingerprint(rows), "rows": len(rows)}


def identity_differences(found: dict, expected: dict, *, ignore: Sequence[str] = ()) -> list[str]:
    """'seq_len 32 (the cache) vs 48 (this run)' for each entry that differs."""
    out = []
    for key in sorted(set(found) | set(expected)):
        if key in ignore or found.get(key) == expected.get(key):
            continue
        out.append(f"{IDENTITY_NAMES.get(key, key)}: {found.get(key)!r} in the cache, {expected.get(key)!r} here")
    return out


def _read_manifest(path: Path) -> dict | None:
    file = path / MANIFEST
    if not file.exists():
        return None
    try:
        manifest = json.loads(file.read_text(encoding="utf-8"))
        if manifest.get("format") != FORMAT:
            raise ValueError(f"unsupported format {manifest.get('format')!r}")
        if not isinstance(manifest.get("identity"), dict) or not isinstance(manifest.get("shards"), list):
            raise KeyError("identity or shards")
        return manifest
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise TeacherCacheError(f"{file}: unreadable manifest ({type(e).__name__}: {e}); move the directory aside "
                                "and build the cache again") from None


def _shard_problem(path: Path, entry: dict) -> str | None:
    """Why shard `entry` does not match the manifest (missing, size, checksum), or None."""
    file = path / entry["file"]
    try:
        if not file.is_file():
            return "missing"
        size = file.stat().st_size
        if size != entry["bytes"]:
            return f"size {size} bytes, the manifest says {entry['bytes']}"
        if sha256_file(file) != entry["sha256"]:
            return "checksum mismatch (damaged or changed since it was written)"
    except OSError as e:
        return f"unreadable: {e}"
    return None


def _write_manifest(path: Path, manifest: dict) -> None:
    atomic_write_text(path / MANIFEST, json.dumps(manifest, indent=1) + "\n")


def _batches(rows: Dataset, start: int, stop: int, batch_size: int):
    """Dict batches of exactly `batch_size` rows over [start, stop): the last one padded with its last row."""
    for idx, real in fixed_batches(stop, batch_size, start):
        items = [rows[i] for i in idx]
        yield {key: torch.stack([torch.as_tensor(item[key]) for item in items]) for key in items[0]}, real


def build_teacher_cache(path: str | os.PathLike, rows: Dataset, topk_fn: TopKFn, *, identity: dict,
                        batch_size: int, rows_per_shard: int = 256, logp_dtype: str = "float32",
                        progress: Callable[[int, int], None] | None = None) -> TeacherCache:
    """Run `topk_fn` over `rows` shard by shard into `path`; resumes an interrupted build of the same identity.

    A directory holding a cache of another identity is refused (naming the differences): give another path.
    `rows_per_shard` is rounded up to a multiple of `batch_size`, so only a cache's very last batch is padded.
    """
    if logp_dtype not in LOGP_DTYPES:
        raise ConfigError(f"logp_dtype={logp_dtype!r} is not one of {tuple(LOGP_DTYPES)}")
    if batch_size < 1 or rows_per_shard < 1:
        raise ConfigError(f"batch_size={batch_size!r} and rows_per_shard={rows_per_shard!r} must be >= 1")
    if len(rows) == 0:
        raise ConfigError("the teacher cache needs at least one row of data")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    per_shard = -(-rows_per_shard // batch_size) * batch_size
    n_rows = len(rows)
    n_shards = -(-n_rows // per_shard)
    layout = {"rows_per_shard": per_shard, "logp_dtype": logp_dtype, "shard_count": n_shards}
    manifest = _read_manifest(path)
    if manifest is not None:
        diffs = identity_differences(manifest["identity"], identity)
        diffs += [f"{k}: {manifest.get(k)!r} in the cache, {v!r} here" for k, v in layout.items()
                  if manifest.get(k) != v]
        if diffs:
            raise ConfigError(f"{path} holds a teacher cache of something else ({'; '.join(diffs)}); give another "
                              "directory, or move this one aside to build it anew")
        done = {}
        for entry in manifest["shards"]:
            problem = _shard_problem(path, entry)
            if problem is None:
                done[entry["index"]] = entry
            else:
                warnings.warn(f"teacher cache {path / entry['file']}: {problem}; building this shard again",
                              stacklevel=2)
    else:
        done = {}
    for stale in path.glob(".shard-*.tmp"):  # a temporary file of a build that was killed mid-write
        stale.unlink(missing_ok=True)
    manifest = {"format": FORMAT, "identity": identity, **layout, "rows": n_rows,
                "shards": [done[i] for i in sorted(done)], "complete": len(done) == n_shards}
    _write_manifest(path, manifest)
    for i in range(n_shards):
        if i in done:
            continue
        start, stop = i * per_shard, min((i + 1) * per_shard, n_rows)
        done[i] = _write_shard(path, i, rows, topk_fn, start, stop, batch_size, identity, LOGP_DTYPES[logp_dtype])
        manifest["shards"] = [done[j] for j in sorted(done)]
        manifest["complete"] = len(done) == n_shards
        _write_manifest(path, manifest)
        if progress is not None:
            progress(len(done), n_shards)
    return TeacherCache(path)


def _write_shard(path: Path, i: int, rows: Dataset, topk_fn: TopKFn, start: int, stop: int, batch_size: int,
                 identity: dict, logp_dtype: torch.dtype) -> dict:
    from safetensors.torch import save

    parts: list[tuple[torch.Tensor, ...]] = []
    for batch, real in _batches(rows, start, stop, batch_size):
        ids, logp, tail = topk_fn(batch)
        k, seq = identity["k"], identity["seq_len"]
        if tuple(ids.shape) != (batch_size, seq, k) or tuple(logp.shape) != tuple(ids.shape) \
                or tuple(tail.shape) != (batch_size, seq):
            raise ValueError(f"topk_fn returned shapes {tuple(ids.shape)}, {tuple(logp.shape)}, {tuple(tail.shape)} "
                             f"for a batch of {batch_size} rows of {seq} tokens; expected ({batch_size}, {seq}, {k}) "
                             f"twice and ({batch_size}, {seq})")
        parts.append((ids[:real].to(torch.int32), logp[:real].to(logp_dtype), tail[:real].float()))
    tensors = {"ids": torch.cat([p[0] for p in parts]).contiguous(),
               "logp": torch.cat([p[1] for p in parts]).contiguous(),
               "tail": torch.cat([p[2] for p in parts]).contiguous(),
               "row_index": torch.arange(start, stop, dtype=torch.int64)}
    data = save(tensors, metadata={"first_row": str(start)})  # one key: the header of several is in no fixed order
    target = path / shard_name(i)
    writer = atomic_write_bytes(target, data)
    return {"index": i, "file": target.name, "first_row": start, "rows": stop - start, "bytes": writer.size,
            "sha256": writer.sha.hexdigest()}


class TeacherCache:
    """A finished cache on disk: its manifest, checks, and rows read on demand (memory-mapped shards)."""

    def __init__(self, path: str | os.PathLike, *, verify: bool = True) -> None:
        self.path = Path(path)
        manifest = _read_manifest(self.path)
        if manifest is None:
            raise TeacherCacheError(f"{self.path} holds no teacher cache (no {MANIFEST}); build one first "
                                    "(data/teacher_cache.build_teacher_cache, or METHOD='distill' with TEACHER)")
        if not manifest.get("complete") or len(manifest["shards"]) != manifest["shard_count"]:
            raise TeacherCacheError(f"{self.path}: the teacher cache is incomplete ({len(manifest['shards'])} of "
                                    f"{manifest['shard_count']} shards); run the build again to finish it")
        self.manifest = manifest
        self.identity: dict = manifest["identity"]
        self.rows_per_shard: int = manifest["rows_per_shard"]
        self._files: dict[int, Any] = {}
        if verify:
            self.verify()

    def __len__(self) -> int:
        return int(self.manifest["rows"])

    @property
    def k(self) -> int:
        return int(self.identity["k"])

    @property
    def shard_count(self) -> int:
        return int(self.manifest["shard_count"])

    @property
    def bytes(self) -> int:
        return sum(int(e["bytes"]) for e in self.manifest["shards"])

    def verify(self) -> None:
        """Every shard's size and sha256 against the manifest; the first damaged one is named."""
        for entry in self.manifest["shards"]:
            problem = _shard_problem(self.path, entry)
            if problem is not None:
                raise TeacherCacheError(f"teacher cache {self.path / entry['file']}: {problem}; delete that file and "
                                        "run the build again (the good shards are kept)")

    def check(self, expected: dict, *, name: str = "TEACHER_CACHE", ignore: Sequence[str] = ()) -> None:
        """ConfigError naming each difference between this cache's identity and `expected`."""
        diffs = identity_differences(self.identity, expected, ignore=ignore)
        if diffs:
            raise ConfigError(f"{name}={str(self.path)!r} was made for other data or settings: {'; '.join(diffs)}. "
                              "Build a new cache into another directory (or point to the matching one)")

    def shards_for(self, process_index: int, process_count: int) -> list[int]:
        """The shards process `process_index` of `process_count` reads: i, i + n, i + 2n, ..."""
        if not 0 <= process_index < process_count:
            raise ConfigError(f"process_index={process_index} must be in [0, process_count={process_count})")
        return list(range(process_index, self.shard_count, process_count))

    def rows_of(self, shards: Sequence[int]) -> list[int]:
        entries = {e["index"]: e for e in self.manifest["shards"]}
        return [r for s in shards for r in range(entries[s]["first_row"], entries[s]["first_row"] + entries[s]["rows"])]

    def _file(self, shard: int) -> Any:
        f = self._files.get(shard)
        if f is None:
            from safetensors import safe_open

            f = self._files[shard] = safe_open(str(self.path / shard_name(shard)), framework="pt")
        return f

    def row(self, i: int) -> dict[str, torch.Tensor]:
        """The teacher's top-k of data row `i`: teacher_ids (S, k) int32 (half the bytes of int64 to the device; the
        loss widens them there), teacher_logp (S, k) float32, teacher_tail (S,) float32."""
        if not 0 <= i < len(self):
            raise IndexError(f"row {i} is outside the cache's {len(self)} rows")
        f, j = self._file(i // self.rows_per_shard), i % self.rows_per_shard
        return {"teacher_ids": f.get_slice("ids")[j], "teacher_logp": f.get_slice("logp")[j].float(),
                "teacher_tail": f.get_slice("tail")[j].float()}

    def attach(self, rows: Dataset, *, process_index: int = 0, process_count: int = 1) -> CachedRows:
        """`rows` with the teacher's top-k added to each; with process_count > 1 only this process's shards' rows."""
        if len(rows) != len(self):
            raise ConfigError(f"{self.path}: the cache has {len(self)} rows, the data {len(rows)}; it was made for "
                              "other data")
        return CachedRows(rows, self, self.rows_of(self.shards_for(process_index, process_count)))

    def __getstate__(self) -> dict:  # DataLoader workers reopen the memory maps themselves
        return {**self.__dict__, "_files": {}}

    def summary(self) -> str:
        ident = self.identity
        return (f"teacher cache {self.path}: {len(self)} rows x {ident['seq_len']} tokens, top-{ident['k']} of "
                f"{ident['vocab_size']} from {ident['teacher']} at temperature {ident['temperature']}, "
                f"{self.shard_count} shards, {self.bytes / 2**20:.1f} MiB")


class CachedRows(Dataset):
    """Data rows with the teacher's top-k of each (a Dataset of dicts, for the cached distillation trainer)."""

    def __init__(self, rows: Dataset, cache: TeacherCache, indices: list[int]) -> None:
        self.rows, self.cache, self.indices = rows, cache, indices

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        j = self.indices[i]
        return {**self.rows[j], **self.cache.row(j)}


def open_teacher_cache(path: str | os.PathLike, *, expect: dict | None = None, verify: bool = True,
                       name: str = "TEACHER_CACHE") -> TeacherCache:
    """A finished cache, verified against its manifest and, with `expect`, checked against this run's identity."""
    cache = TeacherCache(path, verify=verify)
    if expect is not None:
        cache.check(expect, name=name)
    return cache


def cache_status(path: str | os.PathLike) -> str:
    """'missing', 'partial' or 'complete' (from the manifest alone)."""
    manifest = _read_manifest(Path(path))
    if manifest is None:
        return "missing"
    return "complete" if manifest.get("complete") else "partial"
