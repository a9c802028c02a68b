"""Tests for the data pipeline: corpus, tokenizers, text loading, packing, splitting, sampler and loaders.

Nothing here touches the network: local files are written to tmp_path and the hub is monkeypatched.
"""

from __future__ import annotations

import json
import re
import sys
import types

import pytest
import torch

from tpu_helpers.data import (
    ResumableSampler,
    TokenBlocks,
    build_datasets,
    load_text,
    make_loader,
    pack_tokens,
    split_train_val,
)
from tpu_helpers.data.corpus import generate_corpus
from tpu_helpers.data.tokenizer import ByteTokenizer, HFTokenizer, get_tokenizer


@pytest.fixture
def hf_datasets(tmp_path, monkeypatch):
    """The real ``datasets`` module, with its cache redirected so tests leave nothing in the home dir."""
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    yield datasets
    if bars:
        datasets.enable_progress_bars()


# ---------------------------------------------------------------- corpus


def test_corpus_is_deterministic_and_seed_dependent():
    a = generate_corpus(50_000, seed=0)
    assert len(a) == 50_000
    assert a == generate_corpus(50_000, seed=0)
    assert a != generate_corpus(50_000, seed=1)
    # A shorter request is a prefix of a longer one: max_chars truncation never changes the text.
    assert generate_corpus(1_000, seed=0) == a[:1_000]
    assert a.isascii()  # one char == one byte for the byte tokenizer


def test_corpus_states_consistent_facts():
    text = generate_corpus(300_000, seed=3)
    # Every mention of a fixed fact agrees with it, whatever story it is in.
    homes = set(re.findall(r"Mia went home to ([^.]*)\.", text))
    assert homes == {"a yellow house by the river"}
    colors = set(re.findall(r"Leo could not find his (\w+) ", text))
    assert colors == {"blue"}
    foods = set(re.findall(r"because Sam loved ([^.]*)\.", text))
    assert foods == {"soup"}
    assert text.count("\n\n") > 200  # many separate stories


def test_corpus_has_the_exact_size_asked_for_and_depends_only_on_the_seed():
    # (Its speed is a benchmark matter, not a test's.)
    text = generate_corpus(2_000_000)
    assert len(text) == 2_000_000 and generate_corpus(2_000_000) == text
    assert [len(generate_corpus(n, seed=1)) for n in (1, 999, 123_457)] == [1, 999, 123_457]
    assert generate_corpus(5000, seed=2) != generate_corpus(5000, seed=3)


@pytest.mark.parametrize("bad", [0, -5])
def test_corpus_rejects_non_positive_size(bad):
    with pytest.raises(ValueError, match=rf"num_chars.*{bad}"):
        generate_corpus(bad)


# ---------------------------------------------------------------- tokenizer


def test_byte_tokenizer_round_trips_non_ascii():
    tok = get_tokenizer()
    assert isinstance(tok, ByteTokenizer) and tok.vocab_size == 256 and tok.name == "byte"
    s = "héllo wörld ✓ 日本語 🙂\n"
    ids = tok.encode(s)
    assert ids == list(s.encode("utf-8")) and all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == s
    assert tok.decode(torch.tensor(ids)) == s  # tensors of ids work too
    # A sample cut inside a multi-byte character decodes with a replacement char instead of raising.
    assert tok.decode(ids[:2]) == "h\ufffd"


@pytest.mark.parametrize("bad", ["", "  ", None, 3])
def test_get_tokenizer_rejects_bad_names(bad):
    with pytest.raises(ValueError, match=rf"tokenizer name.*{bad!r}"):
        get_tokenizer(bad)


def test_get_tokenizer_without_transformers_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # makes `import transformers` fail
    with pytest.raises(ImportError, match=r"pip install transformers.*'byte' needs nothing"):
        get_tokenizer("gpt2")


def test_get_tokenizer_wraps_transformers(monkeypatch):
    calls = []

    class FakeHF:
        def __len__(self):
            return 1000

        def encode(self, text, add_special_tokens=True, verbose=True):
            assert add_special_tokens is False
            return [ord(c) for c in text]

        def decode(self, ids):
            return "".join(chr(i) for i in ids)

    def from_pretrained(name):
        calls.append(name)
        return FakeHF()

    fake = types.SimpleNamespace(AutoTokenizer=types.SimpleNamespace(from_pretrained=from_pretrained))
    monkeypatch.setitem(sys.modules, "transformers", fake)
    tok = get_tokenizer("some/model")
    assert calls == ["some/model"]
    assert isinstance(tok, HFTokenizer) and tok.name == "some/model" and tok.vocab_size == 1000
    assert tok.decode(tok.encode("abc")) == "abc"


# ---------------------------------------------------------------- packing and splitting


def test_pack_tokens_shapes_and_shift():
    ids = list(range(100))
    blocks = pack_tokens(ids, block_size=8)
    assert blocks.shape == (12, 9) and blocks.dtype == torch.long  # (100 - 1) // 8 = 12
    # Consecutive windows share one boundary token; every token but the first is a target exactly once.
    assert torch.equal(blocks[:, -1][:-1], blocks[1:, 0])
    assert torch.equal(blocks[:, 1:].reshape(-1), torch.arange(1, 97))
    ds = TokenBlocks(blocks)
    assert len(ds) == 12 and ds.block_size == 8
    x, y = ds[3]
    assert x.shape == y.shape == (8,) and x.dtype == y.dtype == torch.long
    assert torch.equal(y[:-1], x[1:]) and torch.equal(x, torch.arange(24, 32))


def test_pack_tokens_accepts_bytes_and_tensors_alike():
    data = b"a small text to pack"
    expected = pack_tokens(list(data), 4)
    assert torch.equal(pack_tokens(data, 4), expected)
    assert torch.equal(pack_tokens(torch.tensor(list(data), dtype=torch.int32), 4), expected)


def test_pack_tokens_errors():
    with pytest.raises(ValueError, match=r"text too short: 3 tokens, need at least 5"):
        pack_tokens([1, 2, 3], block_size=4)
    with pytest.raises(ValueError, match=r"block_size must be a positive int, got 0"):
        pack_tokens(list(range(10)), block_size=0)
    with pytest.raises(ValueError, match=r"one-dimensional"):
        pack_tokens(torch.zeros(2, 10, dtype=torch.long), block_size=4)


def test_split_train_val_sizes_determinism_disjointness():
    blocks = torch.arange(100 * 5).view(100, 5)  # row i is identified by its first element 5 * i
    train, val = split_train_val(blocks, val_fraction=0.1, seed=0)
    assert train.shape == (90, 5) and val.shape == (10, 5)
    t_ids, v_ids = set(train[:, 0].tolist()), set(val[:, 0].tolist())
    assert not t_ids & v_ids and len(t_ids | v_ids) == 100
    train2, val2 = split_train_val(blocks, val_fraction=0.1, seed=0)
    assert torch.equal(train, train2) and torch.equal(val, val2)
    _, val3 = split_train_val(blocks, val_fraction=0.1, seed=1)
    assert not torch.equal(val, val3)
    # Tiny fractions still leave one block on each side.
    train, val = split_train_val(blocks[:3], val_fraction=0.001)
    assert len(val) == 1 and len(train) == 2
    train, val = split_train_val(blocks[:3], val_fraction=0.999)
    assert len(val) == 2 and len(train) == 1


@pytest.mark.parametrize("frac", [0.0, 1.0, -0.1, 1.5])
def test_split_train_val_rejects_fractions_outside_unit_interval(frac):
    with pytest.raises(ValueError, match=rf"val_fraction must be strictly between 0 and 1, got {frac}"):
        split_train_val(torch.zeros(10, 5), val_fraction=frac)


def test_split_train_val_needs_two_blocks():
    with pytest.raises(ValueError, match=r"at least 2 blocks.*got 1"):
        split_train_val(torch.zeros(1, 5))


# ---------------------------------------------------------------- sampler


def _run(sampler: ResumableSampler, epochs: range) -> list[tuple[int, int]]:
    out = []
    for e in epochs:
        sampler.set_epoch(e)
        out += [(e, i) for i in sampler]
    return out


def test_sampler_order_follows_seed_plus_epoch():
    s = ResumableSampler(10, seed=7)
    s.set_epoch(2)
    assert list(s) == torch.randperm(10, generator=torch.Generator().manual_seed(9)).tolist()
    assert list(ResumableSampler(5, shuffle=False)) == [0, 1, 2, 3, 4]


def test_sampler_shards_are_disjoint_and_cover_the_epoch():
    n, world = 23, 4  # 23 -> 20 usable, 5 per rank
    shards = [list(ResumableSampler(n, seed=1, rank=r, world_size=world)) for r in range(world)]
    assert all(len(s) == 5 for s in shards)
    flat = [i for s in shards for i in s]
    assert len(set(flat)) == 20
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(1)).tolist()
    assert set(flat) == set(perm[:20])
    # Without drop_last every rank gets the same count by wrapping around, and all samples are seen.
    padded = [list(ResumableSampler(n, rank=r, world_size=world, drop_last=False)) for r in range(world)]
    assert all(len(s) == 6 for s in padded) and set().union(*padded) == set(range(n))


def test_sampler_epochs_differ_and_auto_advance():
    s = ResumableSampler(50)
    first, second = list(s), list(s)  # a finished pass moves on to the next epoch by itself
    assert sorted(first) == sorted(second) == list(range(50))
    assert first != second and s.epoch == 1


@pytest.mark.parametrize("stop_at", [0, 7, 12, 13, 20])
def test_sampler_resume_matches_uninterrupted_run(stop_at):
    kw = dict(seed=3, rank=1, world_size=2)  # 27 samples -> 13 per rank per epoch
    full = _run(ResumableSampler(27, **kw), range(3))
    # Interrupted run: stop after `stop_at` samples (possibly at or past the epoch boundary), save, resume.
    s = ResumableSampler(27, **kw)
    seen: list[tuple[int, int]] = []
    for e in range(3):
        s.set_epoch(e)
        if len(seen) == stop_at:
            break
        for i in s:
            seen.append((e, i))
            if len(seen) == stop_at:
                break
        if len(seen) == stop_at:
            break
    state = s.state_dict()
    assert state["index"] == stop_at - 13 * state["epoch"]
    resumed = ResumableSampler(27, **kw)
    resumed.load_state_dict(state)
    resumed.set_epoch(state["epoch"])  # what the resumed training loop does first: must not rewind
    assert len(resumed) == 13 - state["index"]
    seen += _run(resumed, range(state["epoch"], 3))
    assert seen == full


def test_sampler_set_epoch_keeps_position_of_same_epoch():
    s = ResumableSampler(10, seed=0)
    it = iter(s)
    head = [next(it) for _ in range(4)]
    s.set_epoch(0)  # what a resumed loop does first: must not rewind
    assert head + list(s) == list(ResumableSampler(10, seed=0))
    s.set_epoch(5)
    assert len(s) == 10 and s.state_dict() == {"epoch": 5, "index": 0}


def test_sampler_state_errors_and_consumed_override():
    s = ResumableSampler(10)
    assert s.state_dict(consumed=4) == {"epoch": 0, "index": 4}
    with pytest.raises(ValueError, match=r"consumed must be in \[0, 10\], got 11"):
        s.state_dict(consumed=11)
    with pytest.raises(ValueError, match=r"index 11 is outside \[0, 10\]"):
        s.load_state_dict({"epoch": 0, "index": 11})
    with pytest.raises(ValueError, match=r"missing \['index'\]"):
        s.load_state_dict({"epoch": 0})
    with pytest.raises(ValueError, match=r"rank=2, world_size=2"):
        ResumableSampler(10, rank=2, world_size=2)
    with pytest.raises(ValueError, match=r"positive int, got 0"):
        ResumableSampler(0)


# ---------------------------------------------------------------- loaders


def _blocks(n: int, block_size: int = 6) -> TokenBlocks:
    return TokenBlocks(pack_tokens(list(range(n * block_size + 1)), block_size))


def test_loader_batches_have_fixed_shape_and_drop_last():
    ds = _blocks(50)
    loader = make_loader(ds, batch_size=8)
    batches = list(loader)
    assert len(batches) == len(loader) == 6  # 50 // 8, the last 2 samples dropped
    for x, y in batches:
        assert x.shape == y.shape == (8, 6) and x.dtype == torch.long
        assert torch.equal(x[:, 1:], y[:, :-1])
    # Two ranks see disjoint halves.
    r0 = torch.cat([x for x, _ in make_loader(ds, 5, rank=0, world_size=2)])
    r1 = torch.cat([x for x, _ in make_loader(ds, 5, rank=1, world_size=2)])
    assert r0.shape == r1.shape == (25, 6)
    assert not set(r0[:, 0].tolist()) & set(r1[:, 0].tolist())


def test_loader_resume_continues_the_same_batches():
    ds = _blocks(40)
    full = [x for e in range(2) for x, _ in _epoch(make_loader(ds, 4, seed=5), e)]
    loader = make_loader(ds, 4, seed=5)
    got = []
    for e in range(2):
        for x in (b for b, _ in _epoch(loader, e)):
            got.append(x)
            if len(got) == 13:  # mid epoch 1
                break
        if len(got) == 13:
            break
    state = loader.sampler.state_dict()
    assert state == {"epoch": 1, "index": 12}
    resumed = make_loader(ds, 4, seed=5)
    resumed.sampler.load_state_dict(state)
    assert len(resumed) == 7
    got += [x for x, _ in _epoch(resumed, 1)]
    assert len(got) == len(full) and all(torch.equal(a, b) for a, b in zip(got, full, strict=True))


def _epoch(loader, epoch):
    loader.sampler.set_epoch(epoch)
    return iter(loader)


@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")
def test_loader_with_workers_resumes_from_consumed_count():
    ds = _blocks(40)
    full = [x for x, _ in make_loader(ds, 4, seed=2)]
    loader = make_loader(ds, 4, num_workers=2, seed=2)
    assert loader.num_workers == 2 and loader.persistent_workers
    got = []
    for x, _ in loader:
        assert x.shape == (4, 6)
        got.append(x)
        if len(got) == 3:
            break
    # Workers prefetch, so the sampler has handed out more than the loop used; consumed= fixes that.
    assert loader.sampler.state_dict()["index"] > 12
    state = loader.sampler.state_dict(consumed=len(got) * 4)
    resumed = make_loader(ds, 4, seed=2)
    resumed.sampler.load_state_dict(state)
    got += [x for x, _ in resumed]
    assert len(got) == len(full) and all(torch.equal(a, b) for a, b in zip(got, full, strict=True))


@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")
def test_loader_settings_come_from_the_backend(monkeypatch):
    from tpu_helpers.backend import get_backend
    from tpu_helpers.backend.cuda import CudaBackend
    from tpu_helpers.backend.xla import XlaBackend

    monkeypatch.setattr("os.cpu_count", lambda: 8)
    ds = _blocks(20)
    cpu = make_loader(ds, 4, **get_backend("cpu").loader_options)
    assert cpu.num_workers == 0 and not cpu.pin_memory and not cpu.persistent_workers and cpu.drop_last
    # Asked of the backend classes themselves (no GPU or TPU here): CUDA pins and uses workers, XLA only workers.
    cuda = make_loader(ds, 4, **CudaBackend.loader_options.fget(None))
    assert cuda.num_workers == 4 and cuda.pin_memory and cuda.persistent_workers
    xla = make_loader(ds, 4, **XlaBackend.loader_options.fget(None))
    assert xla.num_workers == 4 and not xla.pin_memory and xla.persistent_workers
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    assert CudaBackend.loader_options.fget(None)["num_workers"] == 2


def test_loader_errors():
    ds = _blocks(20)
    with pytest.raises(ValueError, match=r"batch_size must be a positive int, got 0"):
        make_loader(ds, 0)
    with pytest.raises(ValueError, match=r"20 samples over world_size=4 gives 5 per rank.*batch_size=8"):
        make_loader(ds, 8, world_size=4, rank=0)
    with pytest.raises(ValueError, match=r"num_workers must be an int >= 0, got -1"):
        make_loader(ds, 4, num_workers=-1)
    with pytest.raises(ValueError, match=r"num_workers must be an int >= 0, got 'xla'"):
        make_loader(ds, 4, num_workers="xla")


# ---------------------------------------------------------------- load_text and build_datasets


def test_load_text_embedded_and_max_chars():
    assert load_text("embedded", max_chars=5_000) == generate_corpus(5_000)
    with pytest.raises(ValueError, match=r"source must be 'embedded'.*got ''"):
        load_text("")
    with pytest.raises(ValueError, match=r"max_chars must be a positive int or None, got 0"):
        load_text("embedded", max_chars=0)


def test_load_text_local_txt(tmp_path, hf_datasets):
    f = tmp_path / "story.txt"
    f.write_text("first line\nsecond line\n\nafter a blank\n")
    assert load_text(str(f)) == "first line\nsecond line\n\nafter a blank"
    assert load_text(str(f), max_chars=10) == "first line"


def test_load_text_local_jsonl_and_missing_field(tmp_path, hf_datasets):
    f = tmp_path / "data.jsonl"
    f.write_text("".join(json.dumps({"story": s, "id": i}) + "\n" for i, s in enumerate(["one", "two", "three"])))
    assert load_text(str(f), text_field="story") == "one\ntwo\nthree"
    with pytest.raises(KeyError, match=r"no column 'text'.*\['story', 'id'\]"):
        load_text(str(f))


def test_load_text_directory(tmp_path, hf_datasets):
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.txt").write_text("alpha\n")
    (tmp_path / "sub" / "b.md").write_text("beta\n")
    (tmp_path / "c.jsonl").write_text('{"text": "gamma"}\n')
    (tmp_path / "ignored.csv").write_text("x,y\n")
    assert load_text(str(tmp_path)) == "alpha\nbeta\ngamma"


def test_load_text_rejects_unsupported_local_files(tmp_path):
    (tmp_path / "table.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match=r"table\.csv.*supported file types are \.txt"):
        load_text(str(tmp_path / "table.csv"))
    with pytest.raises(ValueError, match=r"directory .* has no \.txt/"):
        load_text(str(tmp_path))


def test_load_text_missing_path_names_it():
    for missing in ("./no_such_corpus.txt", "/definitely/not/here", "data/missing.jsonl", "~/nope"):
        with pytest.raises(FileNotFoundError, match=r"(?s)" + missing.replace(".", r"\.") + r".*embedded.*TinyStories"):
            load_text(missing)


def test_load_text_routes_hub_names_to_load_dataset(monkeypatch, hf_datasets):
    calls = []

    def fake_load_dataset(name, **kwargs):
        calls.append((name, kwargs))
        return hf_datasets.Dataset.from_dict({"text": ["Once upon a time.", "The end."], "id": [0, 1]})

    monkeypatch.setattr(hf_datasets, "load_dataset", fake_load_dataset)
    assert load_text("roneneldan/TinyStories") == "Once upon a time.\nThe end."
    assert calls == [("roneneldan/TinyStories", {"split": "train"})]
    # A dotted version in a hub name is not mistaken for a file suffix.
    assert load_text("someone/corpus-v1.2", split="validation[:10]", max_chars=4) == "Once"
    assert calls[-1] == ("someone/corpus-v1.2", {"split": "validation[:10]"})
    with pytest.raises(KeyError, match=r"no column 'story'.*\['text', 'id'\]"):
        load_text("roneneldan/TinyStories", text_field="story")


def test_build_datasets_embedded():
    train, val, tok = build_datasets(block_size=32, val_fraction=0.1, max_chars=20_000)
    assert isinstance(tok, ByteTokenizer)
    total = (20_000 - 1) // 32
    assert len(train) + len(val) == total and len(val) == round(total * 0.1)
    x, y = train[0]
    assert x.shape == (32,) and torch.equal(x[1:], y[:-1])
    assert tok.decode(x.tolist()) in generate_corpus(20_000)


def test_build_datasets_passes_text_field_to_local_json(tmp_path, hf_datasets):
    f = tmp_path / "stories.jsonl"
    f.write_text("".join(json.dumps({"story": generate_corpus(300, seed=i)}) + "\n" for i in range(4)))
    train, val, _ = build_datasets(str(f), block_size=16, val_fraction=0.25, text_field="story")
    assert len(train) + len(val) == (4 * 300 + 3 - 1) // 16  # 4 records joined by 3 newlines


def test_build_datasets_with_a_tokenizer_object_matches_byte_path():
    class CharTokenizer:  # any object with the Tokenizer members works
        name, vocab_size = "char", 128

        def encode(self, text):
            return [ord(c) for c in text]

        def decode(self, ids):
            return "".join(chr(i) for i in ids)

    a_train, a_val, _ = build_datasets(tokenizer="byte", block_size=16, max_chars=4_000)
    b_train, b_val, tok = build_datasets(tokenizer=CharTokenizer(), block_size=16, max_chars=4_000)
    assert tok.name == "char"  # the corpus is ASCII, so characters and bytes give the same blocks
    assert torch.equal(a_train.blocks, b_train.blocks) and torch.equal(a_val.blocks, b_val.blocks)
