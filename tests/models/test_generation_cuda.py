"""Generation on one CUDA GPU with the decode steps as replays of one CUDA graph (`generate_ids(...,
loop=backend.compile_loop)`, backend/cuda_loop.py): the same tokens and log-probabilities as the eager loop on every
model family; one capture per shape, none for later calls with other prompts, another sampling stream or fewer
tokens; weights updated in place and the adapter switched off are followed; a step a graph cannot hold is stepped
eagerly with one warning. Skipped without a GPU (CI has none): run on a GPU machine."""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.models.families import FAMILIES, lora_model, random_model
from tpu_helpers.models import generation
from tpu_helpers.models import replay as replay_module
from tpu_helpers.models.generation import Sampling, generate_ids, left_pad

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
VOCAB = 97


@pytest.fixture(scope="module")
def cuda():
    from tpu_helpers.backend import get_backend

    return get_backend("cuda", precision="fp32")


def _rows(seed: int, lengths=(12, 7, 3, 10), width: int = 12, vocab: int = VOCAB):
    torch.manual_seed(seed)
    return left_pad([torch.randint(3, vocab, (n,)).tolist() for n in lengths], width, 0)


def _gen(model, p, **kw):
    # The eager loop unless a test passes `loop` (the default is the device's: test_generation_default.py).
    kw = {"max_new_tokens": 6, "eos_token_id": None, "pad_token_id": 0, "replay": False, "loop": False, **kw}
    out = generate_ids(model, p.ids.cuda(), p.mask.cuda(), **kw)
    return generation.Generated(out.ids.cpu(), out.logprobs.cpu(), out.mask.cpu())


def _loop_of(model):
    return replay_module._KEPT[model]["loop"]


def test_the_graph_loop_gives_each_familys_tokens(cuda):
    p = _rows(0)
    for family in sorted(FAMILIES):
        model = random_model(FAMILIES[family].config(VOCAB, pad=0), seed=1).cuda()
        want = _gen(model, p, max_new_tokens=9)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no fallback
            got = _gen(model, p, replay=cuda.compile_step, loop=cuda.compile_loop, max_new_tokens=9)
            again = _gen(model, _rows(1), replay=cuda.compile_step, loop=cuda.compile_loop, max_new_tokens=9)
        assert _loop_of(model).captures == 1, family
        assert torch.equal(got.ids, want.ids), (family, got.ids, want.ids)
        assert torch.equal(got.mask, want.mask), family
        torch.testing.assert_close(got.logprobs, want.logprobs, atol=1e-4, rtol=1e-4)
        assert torch.equal(again.ids, _gen(model, _rows(1), max_new_tokens=9).ids), family
        with torch.no_grad():  # the embedding, tied to the head in most families, updated in place
            model.get_input_embeddings().weight.mul_(-1.0)
        eager = _gen(model, p, max_new_tokens=9)
        looped = _gen(model, p, replay=cuda.compile_step, loop=cuda.compile_loop, max_new_tokens=9)
        assert torch.equal(looped.ids, eager.ids), (family, looped.ids, eager.ids)
        assert _loop_of(model).captures == 1, family
        generation.release_caches(model)


def test_a_plain_call_loops_as_the_backends_call_does():
    """No `replay`, `loop` or `sync`: the device's hooks (`generation_hooks`) capture one graph, as the backend's
    call does, with the eager loop's tokens."""
    p = _rows(0)
    model = random_model(FAMILIES["llama3"].config(VOCAB, pad=0), seed=1).cuda()
    want = _gen(model, p, max_new_tokens=9)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = generate_ids(model, p.ids.cuda(), p.mask.cuda(), max_new_tokens=9, eos_token_id=None, pad_token_id=0)
    assert torch.equal(out.ids.cpu(), want.ids) and _loop_of(model).captures == 1
    generation.release_caches(model)


def test_a_lora_model_sampling_with_eos_follows_the_weights_and_the_adapter(tiny_lm_dir, cuda):
    """GRPO's rollouts: sampling, EOS, the cache bucketed; other prompts, streams and lengths replay the same graph;
    an in-place update of the adapter and the adapter switched off answer as the eager loop does."""
    model = lora_model(tiny_lm_dir, cuda)
    hot = Sampling(temperature=1.5, top_k=20, top_p=0.9)
    vocab = model.config.vocab_size
    eos = [5, 9, 17]

    def both(seed, n=8):
        p = _rows(seed, lengths=(12, 5, 9, 1), vocab=vocab)
        kw = {"sampling": hot, "seed": torch.tensor([seed, 3]).cuda(), "eos_token_id": eos, "max_new_tokens": n,
              "cache_len": 20}
        eager = _gen(model, p, **kw)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            looped = _gen(model, p, replay=cuda.compile_step, loop=cuda.compile_loop, **kw)
        assert torch.equal(looped.ids, eager.ids) and torch.equal(looped.mask, eager.mask), (seed, n)
        torch.testing.assert_close(looped.logprobs, eager.logprobs, atol=1e-5, rtol=1e-5)
        return eager

    first = both(1)
    assert (first.mask == 0).any()  # some rows stopped at an EOS inside the graph
    both(2)
    both(3, n=5)
    assert _loop_of(model).captures == 1
    before = both(2)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.mul_(-1.0)
    after = both(2)
    assert not torch.equal(after.ids, before.ids)  # the update changed the answers
    with model.disable_adapter():
        base = both(2)
    assert not torch.equal(base.ids, after.ids)
    assert _loop_of(model).captures == 2  # the adapter switched off: a graph of its own
    generation.release_caches(model)


def test_a_step_a_graph_cannot_hold_steps_eagerly_with_one_warning(cuda):
    model = random_model(FAMILIES["llama3"].config(VOCAB, pad=0), seed=1).cuda()
    p = _rows(0)
    want = _gen(model, p)
    model.get_input_embeddings().register_forward_hook(lambda module, args, out: None if out.sum().item() else None)
    with pytest.warns(UserWarning, match="cannot be captured in a CUDA graph.*run one by one instead"):
        got = _gen(model, p, replay=cuda.compile_step, loop=cuda.compile_loop)
    assert torch.equal(got.ids, want.ids)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = _gen(model, p, replay=cuda.compile_step, loop=cuda.compile_loop)
    assert torch.equal(again.ids, want.ids)
    generation.release_caches(model)


def test_bf16_autocast_and_a_model_moved_away_and_back(cuda):
    """Under bf16 autocast (the recipes' precision on a GPU) the graph answers as the eager loop does; after
    `model.cpu().cuda()` (the same parameter objects in new memory) the next call captures anew rather than read
    the freed addresses."""
    model = random_model(FAMILIES["llama3"].config(VOCAB, pad=0), seed=1).cuda()
    p = _rows(0)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        want = _gen(model, p, max_new_tokens=9)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            got = _gen(model, p, replay=cuda.compile_step, loop=cuda.compile_loop, max_new_tokens=9)
    assert torch.equal(got.ids, want.ids)
    torch.testing.assert_close(got.logprobs, want.logprobs, atol=1e-3, rtol=1e-3)
    model.cpu().cuda()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        moved = _gen(model, p, replay=cuda.compile_step, loop=cuda.compile_loop, max_new_tokens=9)
    assert torch.equal(moved.ids, _gen(model, p, max_new_tokens=9).ids)
    assert _loop_of(model).captures == 2
    generation.release_caches(model)
