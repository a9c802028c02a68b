"""Generation with the KV cache (models/generation.py): the same tokens as the uncached loop (CPU and XLA:CPU, with
and without LoRA, left-padded prompts of different lengths, the model families transformers ships, sliding
windows), two graphs on XLA and none for a second call or more tokens, reproducible sampling, EOS masking."""

from __future__ import annotations

import contextlib

import pytest
import torch

from tests.models.families import FAMILIES, random_lora, random_model
from tests.support import XLA_BACKEND
from tpu_helpers.config import ConfigError
from tpu_helpers.models import decode, generation, hf
from tpu_helpers.models.generation import (
    Sampling,
    exponentials,
    generate_ids,
    generate_ids_uncached,
    left_pad,
    pick,
)


def _model(tiny_lm_dir, *, with_lora: bool):
    """The tiny Qwen2 with weights that say something (random init repeats one token): a LoRA adapter with
    random B, kept as an adapter or merged into the base."""
    model, tok = random_lora(tiny_lm_dir)
    return (model if with_lora else model.merge_and_unload()).eval(), tok


def _prompts(tok, width=24):
    from tpu_helpers.data.sft import instruction_records, prompts_and_answers

    prompts, _ = prompts_and_answers(instruction_records(split="test")[:6])
    enc = [tok(t, add_special_tokens=False)["input_ids"] for t in hf.prompt_texts(tok, prompts)]
    enc[1] = enc[1][-5:]  # lengths 17, 5, 14, ...: different amounts of left padding
    return left_pad(enc, width, tok.pad_token_id)


def _until_eos(ids, eos, pad):
    """The uncached loop's rows cut after their first EOS (padding after it), and the completion mask."""
    seen = (ids == eos).long().cumsum(1)
    mask = ((seen == 0) | ((seen == 1) & (ids == eos))).long()
    return torch.where(mask.bool(), ids, torch.full_like(ids, pad)), mask


def _gen(model, tok, p, device="cpu", **kw):
    # The lazily traced loop unless a test asks otherwise (test_generation_default.py checks the default).
    return generate_ids(model, p.ids.to(device), p.mask.to(device), eos_token_id=tok.eos_token_id,
                        pad_token_id=tok.pad_token_id, **{"max_new_tokens": 10, "replay": False, "loop": False, **kw})


@pytest.mark.parametrize("with_lora", [False, True], ids=["plain", "lora"])
def test_cached_greedy_equals_the_uncached_loop_on_cpu(tiny_lm_dir, with_lora):
    model, tok = _model(tiny_lm_dir, with_lora=with_lora)
    p = _prompts(tok)
    got = _gen(model, tok, p)
    raw = generate_ids_uncached(model, p.ids, p.mask, max_new_tokens=10)
    want, want_mask = _until_eos(raw, tok.eos_token_id, tok.pad_token_id)
    assert len(set(want.flatten().tolist())) > 5  # varied output, not one repeated token
    assert torch.equal(got.ids, want) and torch.equal(got.mask, want_mask)
    assert 0 < want_mask.sum() < want_mask.numel()  # some rows end with EOS, some run to the end
    # The log-probabilities are those of a forward pass over prompt + completion (what training computes).
    full = torch.cat([p.ids, raw], 1)
    mask = torch.cat([p.mask, torch.ones_like(raw)], 1)
    with torch.no_grad():
        logits = model(input_ids=full, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
    ref = torch.log_softmax(logits[:, 23:-1].float(), -1).gather(-1, raw.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(got.logprobs, ref * want_mask, atol=1e-4, rtol=1e-4)


# The family matrix (tests/models/families.py: Llama 3, Qwen2.5, Qwen2 with sliding layers, Qwen3, Gemma 2, Gemma 3,
# Mistral, Phi-3), at a vocabulary of 97 and random prompts; the sliding windows (6) are shorter than prompt +
# completion here (up to 21 tokens). tests/models/test_families.py compares the same families with transformers'
# own generate, with their tokenizers and stop tokens.
VOCAB = 97


def _prompt_rows():
    return left_pad([torch.randint(3, VOCAB, (n,)).tolist() for n in (12, 7, 3, 10)], 12, 0)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_cached_greedy_equals_the_uncached_loop_across_model_families(family, monkeypatch):
    model = random_model(FAMILIES[family].config(VOCAB, pad=0), seed=1)
    p = _prompt_rows()
    want = generate_ids_uncached(model, p.ids, p.mask, max_new_tokens=9)
    got = generate_ids(model, p.ids, p.mask, max_new_tokens=9, eos_token_id=None, pad_token_id=0)
    assert torch.equal(got.ids, want), (got.ids, want)
    if decode.sliding_window(model) is not None:
        # The window is enforced by the mask: without it the answers differ.
        monkeypatch.setattr(generation, "sliding_window", lambda model: None)
        unwindowed = generate_ids(model, p.ids, p.mask, max_new_tokens=9, eos_token_id=None, pad_token_id=0)
        assert not torch.equal(unwindowed.ids, want)


def _prefill_rows(model):
    """The batch sizes of the model's forward calls over more than one position (the prompt passes)."""
    rows = []
    model.register_forward_pre_hook(lambda m, args, kwargs: rows.append(kwargs["input_ids"].shape[0])
                                    if kwargs["input_ids"].shape[1] > 1 else None, with_kwargs=True)
    return rows


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_prompt_shared_by_its_samples_runs_once_and_gives_the_repeated_prompts_tokens(family):
    model = random_model(FAMILIES[family].config(VOCAB, pad=0), seed=1)
    p = _prompt_rows()
    hot = Sampling(temperature=1.5, top_k=20)
    kw = dict(max_new_tokens=9, eos_token_id=3, pad_token_id=0, sampling=hot, seed=torch.tensor([4, 2]))
    want = generate_ids(model, p.ids.repeat_interleave(3, 0), p.mask.repeat_interleave(3, 0), **kw)
    rows = _prefill_rows(model)
    got = generate_ids(model, p.ids, p.mask, num_return_sequences=3, **kw)
    assert rows == [4]  # one pass over the 4 prompts for the 12 rows
    assert torch.equal(got.ids, want.ids) and torch.equal(got.mask, want.mask)
    torch.testing.assert_close(got.logprobs, want.logprobs, atol=1e-5, rtol=1e-5)
    assert not torch.equal(got.ids[0], got.ids[1]) or not torch.equal(got.ids[3], got.ids[4])  # samples differ


def test_the_cpus_live_rows_give_the_whole_batchs_tokens_and_share_a_kept_cache(monkeypatch):
    """On the CPU the decode runs the live rows only once half are done, with or without an eager backend's
    `replay` (what every recipe passes: `backend.compile_step`, on the CPU the step itself): the same tokens as the
    whole batch stepped to the end. A call with a shared prompt pass and one without, of the same decode shapes,
    keep one cache between them (GRPO's rollouts and held-out samples)."""
    from tpu_helpers.backend.base import Backend
    from tpu_helpers.models.replay import _KEPT, lazy_steps

    model = random_model(FAMILIES["qwen2"].config(VOCAB, pad=0), seed=1)
    p = _prompt_rows()
    hot = Sampling(temperature=1.5)
    kw = dict(max_new_tokens=12, eos_token_id=list(range(3, VOCAB, 4)), pad_token_id=0, sampling=hot,
              seed=torch.tensor([5, 1]), num_return_sequences=3)
    decoded = []
    hook = model.register_forward_pre_hook(lambda m, a, k: decoded.append(k["input_ids"].shape[0])
                                           if k["input_ids"].shape[1] == 1 else None, with_kwargs=True)
    live = generate_ids(model, p.ids, p.mask, **kw)
    first, narrowed = list(decoded), [n for n in decoded if n < 12]
    decoded.clear()
    replayed = generate_ids(model, p.ids, p.mask, replay=Backend().compile_step, loop=False, **kw)
    assert decoded == first  # the recipes' eager replay runs the same live rows
    decoded.clear()
    with monkeypatch.context() as m:  # the reference: every row stepped to the end
        m.setattr(decode, "_live_steps", lambda model, cache, st, fixed, steps, args:
                  lazy_steps(decode.decode_step, model, cache, st, fixed, steps, lambda: None, args))
        whole = generate_ids(model, p.ids, p.mask, replay=lambda step: step, loop=False, **kw)
        rows = left_pad([r for r in p.ids.tolist() for _ in range(3)], p.ids.shape[1], 0)
        rows.mask = p.mask.repeat_interleave(3, 0)
        each = generate_ids(model, rows.ids, rows.mask, replay=lambda step: step, loop=False,
                            **{**kw, "num_return_sequences": 1})
    hook.remove()
    assert narrowed and set(decoded) == {12} and len(decoded) == 2 * 11  # the references stepped every row
    assert (live.mask.sum(1) < 12).sum() > 6  # most rows ended early
    for got in (live, replayed):
        assert torch.equal(got.ids, whole.ids) and torch.equal(got.mask, whole.mask)
        torch.testing.assert_close(got.logprobs, whole.logprobs, atol=1e-5, rtol=1e-5)
    assert torch.equal(each.ids, whole.ids)
    assert len([k for k in _KEPT[model] if isinstance(k, tuple)]) == 1
    generation.release_caches(model)


def test_a_sliding_window_without_layer_types_is_applied_as_hf_does(monkeypatch):
    # Mistral-style configs set sliding_window for every layer and list no layer_types: HF's forward applies the
    # window (6 here, prompts + completions up to 21 tokens), so the cached generator must too.
    config = FAMILIES["mistral"].config(VOCAB, pad=0)
    assert getattr(config, "layer_types", None) is None and config.sliding_window == 6
    model = random_model(config, seed=2)
    p = _prompt_rows()
    want = generate_ids_uncached(model, p.ids, p.mask, max_new_tokens=9)  # HF's own masks, no cache
    got = generate_ids(model, p.ids, p.mask, max_new_tokens=9, eos_token_id=None, pad_token_id=0)
    assert torch.equal(got.ids, want), (got.ids, want)
    full = torch.cat([p.ids, want], 1)
    mask = torch.cat([p.mask, torch.ones_like(want)], 1)
    with torch.no_grad():  # the training forward (HF's sliding mask from the 2D mask)
        logits = model(input_ids=full, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
    ref = torch.log_softmax(logits[:, 11:-1].float(), -1).gather(-1, want.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(got.logprobs, ref, atol=1e-4, rtol=1e-4)
    monkeypatch.setattr(generation, "sliding_window", lambda model: None)
    assert not torch.equal(generate_ids(model, p.ids, p.mask, max_new_tokens=9, eos_token_id=None,
                                        pad_token_id=0).ids, want)  # the window matters here


def test_use_sliding_window_false_means_no_window():
    # A guard for the fix above: Qwen2 configs may keep sliding_window while use_sliding_window turns it off.
    model = random_model(FAMILIES["qwen2"].config(VOCAB, pad=0))
    assert model.config.use_sliding_window is False
    model.config.sliding_window, model.config.layer_types = 4, None  # as an older config.json would hold it
    assert decode.sliding_window(model) is None


def test_sampling_is_reproducible_and_top_k_1_is_greedy(tiny_lm_dir):
    model, tok = _model(tiny_lm_dir, with_lora=False)
    p = _prompts(tok)
    hot = Sampling(temperature=1.5, top_k=50, top_p=0.9)
    a = _gen(model, tok, p, sampling=hot, seed=torch.tensor([7, 3]))
    b = _gen(model, tok, p, sampling=hot, seed=torch.tensor([7, 3]))
    c = _gen(model, tok, p, sampling=hot, seed=torch.tensor([7, 4]))
    assert torch.equal(a.ids, b.ids) and torch.equal(a.logprobs, b.logprobs)
    assert not torch.equal(a.ids, c.ids)
    greedy = _gen(model, tok, p)
    assert not torch.equal(a.ids, greedy.ids)
    for narrow in (Sampling(temperature=1.0, top_k=1), Sampling(temperature=1.0, top_p=1e-6)):
        assert torch.equal(_gen(model, tok, p, sampling=narrow, seed=5).ids, greedy.ids)


def test_the_sampler_draws_from_the_truncated_softmax():
    torch.manual_seed(0)
    rows, vocab = 20000, 6
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]]).expand(rows, vocab)
    key = (torch.tensor([1, 2]), torch.tensor([0]))
    e = exponentials(*key, torch.arange(vocab).expand(rows, vocab), vocab)
    assert 0 < e.min() and e.max() < 17 and abs(e.mean().item() - 1.0) < 0.01 and abs(e.var().item() - 1.0) < 0.03

    def freq(sampling):
        token, logp = pick(logits, sampling, key)
        return torch.bincount(token, minlength=vocab).float() / rows, token, logp

    f, token, logp = freq(Sampling(temperature=2.0))
    want = torch.softmax(logits[0] / 2.0, -1)
    torch.testing.assert_close(f, want, atol=0.015, rtol=0)
    torch.testing.assert_close(logp, torch.log(want)[token])  # under softmax(logits / T), before truncation
    f, _, _ = freq(Sampling(temperature=1.0, top_k=2))
    torch.testing.assert_close(f[:2], torch.softmax(logits[0, :2], -1), atol=0.015, rtol=0)
    assert f[2:].sum() == 0
    f, _, _ = freq(Sampling(temperature=1.0, top_p=0.7))  # cumulative 0.56, 0.77: the first two reach 0.7
    torch.testing.assert_close(f[:2], torch.softmax(logits[0, :2], -1), atol=0.015, rtol=0)
    assert f[2:].sum() == 0


def test_the_race_noise_keeps_its_resolution_far_below_a_24_bit_uniform():
    # A token of probability p wins the race when its draw is below ~p times the winner's ratio: draws must be
    # exponential in law near 0 (P(E < x) = x), here counted under 1e-4 and 1e-5 over 4M draws.
    n = 4_000_000
    e = exponentials(torch.tensor([5]), torch.tensor([0]), torch.arange(n).reshape(1, n), n)
    for x in (1e-4, 1e-5):
        count = int((e < x).sum())
        assert abs(count - n * x) < 4 * (n * x) ** 0.5 + 1, (x, count)
    assert e.max() <= 16.7 and e.dtype == torch.float32


@pytest.mark.slow
def test_sampling_over_a_150k_vocabulary_draws_tokens_an_inverse_cdf_cannot(one_thread):
    # 10 likely tokens, then ~150k tokens of 2.5e-8 each (0.37% of the mass), after them in the order a cumulative
    # sum runs. In float32 that sum near 1 has a spacing of 6e-8: more than half of those tokens end where their
    # predecessor ends (a zero-width interval), so an inverse CDF never draws them. The race
    # draws each at its own probability: their share of 10000 draws is binomial around their mass.
    # Cost: the race hashes every (row, token), 1.5e9 in all, and the zero-width tokens can hold at most ~0.22% of
    # the mass (a quarter of the spacing each), so fewer draws would lose the margin between 0 and ~22 hits. They go
    # 2 rows per call on one thread: each of the hash's ~40 int64 passes then touches 2.4 MB, which stays in cache,
    # where hundreds of rows per call would fault every page of each pass in anew (minutes of system time).
    vocab, head, rows, chunk = 150_000, 10, 10_000, 2
    p = torch.full((vocab,), 2.5e-8, dtype=torch.float64)
    p[:head] = torch.linspace(2.0, 1.0, head, dtype=torch.float64)
    p[:head] *= (1 - p[head:].sum()) / p[:head].sum()
    logits = p.log().float()
    cum = torch.log_softmax(logits, -1).exp().cumsum(-1)
    flat = torch.cat([torch.zeros(1, dtype=torch.bool), cum[1:] == cum[:-1]])  # undrawable by an inverse CDF
    mass = float(p[flat].sum())
    assert 1e-3 < mass and flat[head:].float().mean() > 0.5
    # One 16 MB buffer, freed at once: glibc's malloc then raises its mmap threshold above the race's 2.4 MB
    # temporaries and serves them from its heap (otherwise each is mmapped and faulted in anew: 4x the time).
    torch.empty(2 << 20, dtype=torch.long)
    hits, tail = 0, 0
    for call in range(rows // chunk):
        token, _ = pick(logits.expand(chunk, vocab), Sampling(temperature=1.0),
                        (torch.tensor([11, call]), torch.zeros(1, dtype=torch.long)))
        hits += int(flat[token].sum())
        tail += int((token >= head).sum())
    sigma = (rows * mass * (1 - mass)) ** 0.5
    assert abs(hits - rows * mass) < 4 * sigma, (hits, rows * mass, sigma)  # ~21.9 expected, 0 before
    want_tail = float(p[head:].sum())
    assert abs(tail - rows * want_tail) < 4 * (rows * want_tail) ** 0.5, (tail, rows * want_tail)


def test_rows_that_produce_eos_stop_growing(tiny_lm_dir):
    model, tok = _model(tiny_lm_dir, with_lora=False)
    p = _prompts(tok)
    free = generate_ids(model, p.ids, p.mask, max_new_tokens=10, eos_token_id=None, pad_token_id=tok.pad_token_id)
    eos = free.ids[0, 2].item()  # what row 0 says third: taken as EOS
    got = generate_ids(model, p.ids, p.mask, max_new_tokens=10, eos_token_id=[eos], pad_token_id=tok.pad_token_id)
    for row in range(p.ids.shape[0]):
        hits = (free.ids[row] == eos).nonzero().flatten().tolist()
        end = hits[0] + 1 if hits else 10
        assert got.mask[row].tolist() == [1] * end + [0] * (10 - end), row
        assert torch.equal(got.ids[row, :end], free.ids[row, :end])
        assert (got.ids[row, end:] == tok.pad_token_id).all() and (got.logprobs[row, end:] == 0).all()
    assert got.mask[0].sum() <= 3 and got.mask.sum(1).max() == 10  # row 0 stopped, another ran to the end


def test_an_eager_backends_replay_runs_the_prompt_pass_once_and_keeps_the_tokens():
    """`replay=backend.compile_step` on an eager backend (CPU, CUDA: it returns the function itself) keeps the cache
    between calls but runs each call's prompt pass once: the allocation pass a capture needs first (traced and
    dropped on XLA) would be a whole second prefill there, at the first call of each shape."""
    from tpu_helpers.backend.base import Backend

    model = random_model(FAMILIES["llama3"].config(97, pad=0), seed=1)
    torch.manual_seed(0)
    p = left_pad([torch.randint(3, 97, (n,)).tolist() for n in (12, 7, 3, 10)], 12, 0)
    want = generate_ids(model, p.ids, p.mask, max_new_tokens=5, eos_token_id=None, pad_token_id=0).ids
    widths = []
    model.register_forward_pre_hook(lambda m, args, kwargs: widths.append(kwargs["input_ids"].shape[1]),
                                    with_kwargs=True)
    for _ in range(2):  # the first call allocates the kept cache, the second reuses it
        widths.clear()
        got = generate_ids(model, p.ids, p.mask, max_new_tokens=5, eos_token_id=None, pad_token_id=0,
                           replay=Backend().compile_step).ids
        assert torch.equal(got, want)
        assert widths == [12, 1, 1, 1, 1], widths  # one prompt pass, four decode steps
    generation.release_caches(model)


def test_bad_generation_arguments_name_the_value(tiny_lm_dir):
    model, tok = _model(tiny_lm_dir, with_lora=False)
    p = _prompts(tok)
    with pytest.raises(ConfigError, match=r"max_new_tokens=0 must be an integer >= 1"):
        _gen(model, tok, p, max_new_tokens=0)
    with pytest.raises(ConfigError, match=r"cache_len=30 is less than the prompt width 24 \+ max_new_tokens 10"):
        _gen(model, tok, p, cache_len=30)
    with pytest.raises(ConfigError, match=r"num_return_sequences=0 must be an integer >= 1"):
        _gen(model, tok, p, num_return_sequences=0)
    with pytest.raises(ConfigError, match=r"TEMPERATURE=-1 must be >= 0"):
        Sampling(temperature=-1)
    with pytest.raises(ConfigError, match=r"TOP_P=0 must be in \(0, 1\]"):
        Sampling(top_p=0)


@pytest.mark.xla
@pytest.mark.skipif(XLA_BACKEND is None, reason="torch_xla not installed")
@pytest.mark.parametrize("with_lora", [False, True], ids=["plain", "lora"])
def test_on_xla_two_graphs_then_none_for_a_second_call_or_more_tokens(tiny_lm_dir, with_lora):
    b = XLA_BACKEND
    model, tok = _model(tiny_lm_dir, with_lora=with_lora)
    p = _prompts(tok)
    want = generate_ids_uncached(model, p.ids, p.mask, max_new_tokens=12)
    hot = Sampling(temperature=1.5, top_k=50, top_p=0.9)
    sampled_cpu = _gen(model, tok, p, sampling=hot, seed=torch.tensor([7, 3]), cache_len=64)
    want, _ = _until_eos(want, tok.eos_token_id, tok.pad_token_id)
    model = b.move_model(model)
    compiles = []
    for new_tokens in (4, 4, 12):
        start = b.metrics()["compilations"]
        got = _gen(model, tok, p, b.device, max_new_tokens=new_tokens, sync=b.sync, cache_len=64)
        ids = got.ids.cpu()
        compiles.append(b.metrics()["compilations"] - start)
        assert torch.equal(ids[:, :new_tokens], want[:, :new_tokens])
    assert compiles[0] <= 2 and compiles[1:] == [0, 0], compiles
    # Sampling: another stream (seed) and the same shapes compile nothing new either; the exponential draws equal
    # the CPU's (the same hashed bits; the logs to float32 rounding), and so do the tokens here.
    start = b.metrics()
    sampled = _gen(model, tok, p, b.device, sampling=hot, seed=torch.tensor([7, 3]), sync=b.sync, cache_len=64)
    again = _gen(model, tok, p, b.device, sampling=hot, seed=torch.tensor([7, 9]), sync=b.sync, cache_len=64)
    ids, other = sampled.ids.cpu(), again.ids.cpu()
    end = b.metrics()
    assert end["compilations"] - start["compilations"] <= 2 and end["cpu_fallback_ops"] == {}
    assert torch.equal(ids, sampled_cpu.ids) and not torch.equal(ids, other)
    dev = b.device
    ids = torch.arange(1000).reshape(8, 125)
    torch.testing.assert_close(exponentials(torch.tensor([3, 4]).to(dev), torch.tensor([5]).to(dev), ids.to(dev),
                                            1000).cpu(), exponentials(torch.tensor([3, 4]), torch.tensor([5]), ids, 1000),
                               rtol=1e-6, atol=0)


@pytest.mark.xla
@pytest.mark.skipif(XLA_BACKEND is None, reason="torch_xla not installed")
def test_hf_generate_keeps_its_signature_and_compiles_nothing_for_more_tokens(tiny_lm_dir):
    from tpu_helpers.data.sft import instruction_records, prompts_and_answers

    b = XLA_BACKEND
    model, tok = _model(tiny_lm_dir, with_lora=True)
    prompts, _ = prompts_and_answers(instruction_records(split="test")[:5])
    cpu = hf.generate(model, tok, prompts, device="cpu", max_new_tokens=9, prompt_len=24, batch_size=4)
    model = b.move_model(model)
    counts = []
    for new_tokens in (3, 9):
        start = b.metrics()["compilations"]
        # The backend's sync, replay and loop by default (test_generation_default.py).
        out = hf.generate(model, tok, prompts, device=b.device, max_new_tokens=new_tokens, prompt_len=24,
                          batch_size=4)
        counts.append(b.metrics()["compilations"] - start)
    assert counts[0] <= 3 and counts[1] == 0, counts  # the cache's reset, the captured prompt pass, the loop
    assert out == cpu and len(out) == 5 and any(out)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_cpus_grouped_decode_attention_reads_the_cache_as_it_is_and_gives_eagers_numbers(family, monkeypatch):
    """The CPU's decode steps attend with the query heads grouped by their key/value head (decode.grouped_attention):
    no copy of the cache per step (eager's repeat_kv), the same tokens and log-probabilities on every family."""
    model = random_model(FAMILIES[family].config(VOCAB, pad=0), seed=1)
    p = _prompt_rows()
    kw = dict(max_new_tokens=9, eos_token_id=3, pad_token_id=0, sampling=Sampling(temperature=1.5, top_k=20),
              seed=torch.tensor([4, 2]))
    calls = []
    real = decode.grouped_attention

    def counted(module, query, *args, **kwargs):
        calls.append(query.shape[2])
        return real(module, query, *args, **kwargs)

    monkeypatch.setattr(decode, "grouped_attention", counted)
    decode._registered.cache_clear()
    got = generate_ids(model, p.ids, p.mask, **kw)
    grouped = any(getattr(m, "num_key_value_groups", 1) > 1 for m in model.modules())
    assert (1 in calls) == grouped  # the decode steps' one query position, where the heads are grouped
    assert model.config.get_text_config()._attn_implementation == "eager"  # set back after the steps
    monkeypatch.setattr(decode, "grouped_decode_attention", lambda model: contextlib.nullcontext())
    want = generate_ids(model, p.ids, p.mask, **kw)
    assert torch.equal(got.ids, want.ids) and torch.equal(got.mask, want.mask)
    torch.testing.assert_close(got.logprobs, want.logprobs, rtol=1e-5, atol=1e-5)
    decode._registered.cache_clear()
