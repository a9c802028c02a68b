"""The teacher cache (data/teacher_cache.py): built on XLA:CPU with one graph and equal to a CPU build, resumed after
a kill without rewriting finished shards, damaged shards named, readers splitting the shards, identities refused."""

from __future__ import annotations

import hashlib

import pytest
import torch
from torch.utils.data import Subset

from tests.support import XLA_BACKEND
from tpu_helpers.algorithms.distill import TeacherTopK, teacher_topk
from tpu_helpers.backend import get_backend
from tpu_helpers.config import ConfigError
from tpu_helpers.data.teacher_cache import (
    TeacherCacheError,
    build_teacher_cache,
    cache_identity,
    cache_status,
    open_teacher_cache,
)

VOCAB, K = 64, 8


class FakeTeacher:
    """A deterministic teacher of a 64-token vocabulary (logits a fixed function of each token): fast, no model."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.table = torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(3)) * 3
        self.calls, self.fail_at = 0, fail_at

    def __call__(self, batch: dict):
        self.calls += 1
        if self.fail_at is not None and self.calls == self.fail_at:
            raise KeyboardInterrupt  # as a kill would stop it, mid-shard
        return teacher_topk(self.table[batch["input_ids"] % VOCAB], K, 2.0)


class Rows(torch.utils.data.Dataset):
    def __init__(self, n: int, seq: int = 12, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (n, seq), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Tok:
    def __init__(self, extra: str = "") -> None:
        self.vocab = {f"t{i}{extra if i == 5 else ''}": i for i in range(VOCAB)}

    def get_vocab(self) -> dict:
        return self.vocab


def _ident(rows, **over):
    return cache_identity(**{"teacher": "fake", "teacher_hash": "abc", "tokenizer": Tok(), "vocab_size": VOCAB,
                             "k": K, "temperature": 2.0, "rows": rows, **over})


def _sha(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.xla
def test_built_on_xla_with_one_graph_it_equals_a_cpu_build(tmp_path, tiny_sft):
    from tpu_helpers.models.hf import load_causal_lm

    tok, train, _ = tiny_sft
    rows = Subset(train, range(44))  # 5 batches of 8 and a last one of 4, padded to 8: still the same graph
    built = {}
    for name, backend in (("xla", XLA_BACKEND), ("cpu", get_backend("cpu"))):
        teacher, _ = load_causal_lm("tiny")
        ident = _ident(rows, tokenizer=tok, vocab_size=teacher.config.vocab_size, k=16)
        topk = TeacherTopK(teacher, backend, k=16, temperature=2.0)
        before = backend.metrics().get("compilations", 0)
        built[name] = build_teacher_cache(tmp_path / name, rows, topk, identity=ident, batch_size=8, rows_per_shard=16)
        if name == "xla":
            assert backend.metrics()["compilations"] - before == 1, backend.metrics()
            assert backend.metrics()["cpu_fallback_ops"] == {}
    xla, cpu = built["xla"], built["cpu"]
    assert len(xla) == len(cpu) == 44 and xla.shard_count == 3 and xla.identity == cpu.identity
    for i in range(44):
        a, b = xla.row(i), cpu.row(i)
        assert torch.equal(a["teacher_ids"], b["teacher_ids"]), i
        torch.testing.assert_close(a["teacher_logp"], b["teacher_logp"], rtol=0, atol=1e-5)
        torch.testing.assert_close(a["teacher_tail"], b["teacher_tail"], rtol=0, atol=1e-5)
    # The tail is the rest of the distribution: top-k and tail together hold all the probability.
    row = xla.row(3)
    total = torch.logsumexp(torch.cat([row["teacher_logp"], row["teacher_tail"][:, None]], -1), -1)
    torch.testing.assert_close(total, torch.zeros_like(total), rtol=0, atol=1e-5)


def test_a_killed_build_resumes_keeping_its_finished_shards_and_equals_an_uninterrupted_one(tmp_path):
    rows = Rows(40)
    whole = build_teacher_cache(tmp_path / "whole", rows, FakeTeacher(), identity=_ident(rows), batch_size=4,
                                rows_per_shard=8)
    path = tmp_path / "killed"
    with pytest.raises(KeyboardInterrupt):  # killed in the first batch of shard 3 (2 batches per shard)
        build_teacher_cache(path, rows, FakeTeacher(fail_at=7), identity=_ident(rows), batch_size=4, rows_per_shard=8)
    assert cache_status(path) == "partial"
    with pytest.raises(TeacherCacheError, match=r"incomplete \(3 of 5 shards\); run the build again"):
        open_teacher_cache(path)
    (path / ".shard-00003.safetensors.dead.tmp").write_bytes(b"half")  # what a SIGKILL mid-write leaves
    finished = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in path.glob("shard-*")}
    assert sorted(finished) == ["shard-00000.safetensors", "shard-00001.safetensors", "shard-00002.safetensors"]
    again = FakeTeacher()
    resumed = build_teacher_cache(path, rows, again, identity=_ident(rows), batch_size=4, rows_per_shard=8)
    assert again.calls == 4  # shards 3 and 4 only
    assert {n: (path / n).stat().st_ino for n in finished} == {n: v[0] for n, v in finished.items()}
    assert {n: (path / n).stat().st_mtime_ns for n in finished} == {n: v[1] for n, v in finished.items()}
    assert not list(path.glob(".*.tmp"))
    assert resumed.manifest["shards"] == whole.manifest["shards"]
    assert [_sha(p) for p in sorted(path.glob("shard-*"))] == [_sha(p) for p in sorted((tmp_path / "whole").glob("shard-*"))]


def test_a_damaged_shard_is_named(tmp_path):
    rows = Rows(24)
    build_teacher_cache(tmp_path, rows, FakeTeacher(), identity=_ident(rows), batch_size=4, rows_per_shard=8)
    shard = tmp_path / "shard-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(TeacherCacheError, match=r"shard-00001.safetensors: checksum mismatch"):
        open_teacher_cache(tmp_path)
    shard.write_bytes(bytes(data[:100]))
    with pytest.raises(TeacherCacheError, match=r"shard-00001.safetensors: size 100 bytes, the manifest says \d+"):
        open_teacher_cache(tmp_path)
    # A build over it rebuilds that shard only, and says so.
    counter = FakeTeacher()
    with pytest.warns(UserWarning, match=r"shard-00001.safetensors: size 100 bytes.*building this shard again"):
        build_teacher_cache(tmp_path, rows, counter, identity=_ident(rows), batch_size=4, rows_per_shard=8)
    assert counter.calls == 2 and open_teacher_cache(tmp_path).shard_count == 3


def test_two_readers_split_the_shards_without_overlap(tmp_path):
    rows = Rows(40)
    cache = build_teacher_cache(tmp_path, rows, FakeTeacher(), identity=_ident(rows), batch_size=4, rows_per_shard=8)
    readers = [open_teacher_cache(tmp_path, expect=_ident(rows)) for _ in range(2)]
    parts = [r.attach(rows, process_index=i, process_count=2) for i, r in enumerate(readers)]
    assert readers[0].shards_for(0, 2) == [0, 2, 4] and readers[1].shards_for(1, 2) == [1, 3]
    seen = [[int(p[i]["input_ids"].sum()) for i in range(len(p))] for p in parts]
    assert len(parts[0]) + len(parts[1]) == 40 and not set(parts[0].indices) & set(parts[1].indices)
    assert sorted(parts[0].indices + parts[1].indices) == list(range(40))
    assert seen[1][0] == int(rows[8]["input_ids"].sum())  # process 1 starts at shard 1's first row
    # Each row's top-k is the teacher's for that row.
    want = FakeTeacher()({"input_ids": rows.ids[9:10]})
    got = parts[1][1]
    assert torch.equal(got["teacher_ids"], want[0][0]) and torch.equal(got["teacher_logp"], want[1][0])
    assert cache.bytes == sum(p.stat().st_size for p in tmp_path.glob("shard-*"))


def test_a_cache_of_other_data_or_settings_is_refused_naming_the_difference(tmp_path):
    rows = Rows(16)
    build_teacher_cache(tmp_path, rows, FakeTeacher(), identity=_ident(rows), batch_size=4)
    with pytest.raises(ConfigError, match=r"seq_len: 12 in the cache, 20 here"):
        open_teacher_cache(tmp_path, expect=_ident(Rows(16, seq=20)))
    with pytest.raises(ConfigError, match=r"data \(fingerprint of the tokenized rows\): '\w+' in the cache, '\w+' here"):
        open_teacher_cache(tmp_path, expect=_ident(Rows(16, seed=1)))
    with pytest.raises(ConfigError, match=r"TEACHER_CACHE=.* made for other data or settings: tokenizer: "):
        open_teacher_cache(tmp_path, expect=_ident(rows, tokenizer=Tok(extra="x")))
    with pytest.raises(ConfigError, match=r"top-k: 8 in the cache, 4 here"):
        open_teacher_cache(tmp_path, expect=_ident(rows, k=4))
    with pytest.raises(ConfigError, match=r"holds a teacher cache of something else \(temperature: 2.0 in the cache, "
                                          r"1.0 here\); give another directory"):
        build_teacher_cache(tmp_path, rows, FakeTeacher(), identity=_ident(rows, temperature=1.0), batch_size=4)
    with pytest.raises(ConfigError, match=r"TOP_K=65 is larger than the vocabulary \(64 tokens\)"):
        _ident(rows, k=65)
    with pytest.raises(TeacherCacheError, match=r"holds no teacher cache \(no manifest.json\)"):
        open_teacher_cache(tmp_path / "nothing")
