"""Generation with the decode step replayed (`generate_ids(..., replay=backend.compile_step)`, models/generation.py)
on XLA:CPU: the same tokens as today's lazily traced loop on every model family, with LoRA, sampling streams and
weights updated in place between calls, and nothing captured or compiled again after the first call of a shape."""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.models.families import FAMILIES, lora_model, random_model
from tests.support import XLA_BACKEND
from tpu_helpers.backend.base import Backend
from tpu_helpers.models import decode, generation
from tpu_helpers.models.generation import Sampling, generate_ids, left_pad

pytestmark = [pytest.mark.xla, pytest.mark.skipif(XLA_BACKEND is None, reason="torch_xla not installed")]
VOCAB = 97


def _rows(seed: int, lengths=(12, 7, 3, 10), width: int = 12):
    torch.manual_seed(seed)
    return left_pad([torch.randint(3, VOCAB, (n,)).tolist() for n in lengths], width, 0)


def _captures() -> int:
    """Frames dynamo has captured so far (a recapture of the decode step after a guard failed counts too)."""
    import torch._dynamo

    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def _gen(model, p, device, **kw):
    # The lazily traced loop unless a test passes `replay` (test_generation_default.py checks the default).
    kw = {"max_new_tokens": 6, "eos_token_id": None, "pad_token_id": 0, "replay": False, "loop": False, **kw}
    out = generate_ids(model, p.ids.to(device), p.mask.to(device), **kw)
    return generation.Generated(out.ids.cpu(), out.logprobs.cpu(), out.mask.cpu())


def test_eager_backends_replay_the_step_as_it_is():
    fn = decode.decode_step
    assert Backend().compile_step(fn) is fn


def test_replay_gives_each_familys_tokens_of_the_lazy_loop(one_thread):
    """Greedy: the replayed decode step answers every family's rows as the lazily traced loop does today (which
    test_generation.py holds to the uncached loop and test_families.py to transformers' generate)."""
    b = XLA_BACKEND
    p = _rows(0)
    for family in sorted(FAMILIES):
        model = random_model(FAMILIES[family].config(VOCAB, pad=0), seed=1)
        want = _gen(model, p, "cpu")
        model = b.move_model(model)
        captures = _captures()
        got = _gen(model, p, b.device, sync=b.sync, replay=b.compile_step)
        assert _captures() > captures  # the step was captured (not run as plain Python)
        assert torch.equal(got.ids, want.ids), (family, got.ids, want.ids)
        torch.testing.assert_close(got.logprobs, want.logprobs, atol=1e-4, rtol=1e-4)
        generation.release_caches(model)


def test_later_calls_capture_and_compile_nothing_and_read_updated_weights(tiny_lm_dir, one_thread):
    """A LoRA model (what GRPO trains) on XLA: the first call captures the decode step once; later calls with other
    prompts, another sampling stream, and after an in-place update of the adapter's weights (a training step between
    rollouts) capture nothing, compile no XLA graph, and answer as the lazy loop does with the same weights."""
    b = XLA_BACKEND
    model = lora_model(tiny_lm_dir, b)
    hot = Sampling(temperature=1.5, top_k=20, top_p=0.9)
    vocab = model.config.vocab_size

    def both(seed, **kw):
        p = _rows(seed, lengths=(12, 5, 9, 1))
        p.ids.clamp_(max=vocab - 1)
        kw = {"sampling": hot, "seed": torch.tensor([seed, 3]).to(b.device), "sync": b.sync, **kw}
        return _gen(model, p, b.device, **kw), _gen(model, p, b.device, replay=b.compile_step, **kw)

    lazy, replayed = both(1)  # the first call: the lazy graphs, then the capture
    assert torch.equal(replayed.ids, lazy.ids) and torch.equal(replayed.mask, lazy.mask)
    captures, compiles = _captures(), b.metrics()["compilations"]
    before = {}
    for seed in (2, 3):
        before[seed] = _gen(model, _rows(seed, lengths=(12, 5, 9, 1)), b.device, sampling=hot, sync=b.sync,
                        seed=torch.tensor([seed, 3]).to(b.device), replay=b.compile_step)
    assert (_captures(), b.metrics()["compilations"]) == (captures, compiles)
    with torch.no_grad():  # an optimizer step on the adapter, in place
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.mul_(-1.0)
    b.sync()
    lazy_after, replayed_after = both(2)
    assert torch.equal(replayed_after.ids, lazy_after.ids), (replayed_after.ids, lazy_after.ids)
    assert not torch.equal(replayed_after.ids, before[2].ids)  # the update changed the answers
    assert _captures() == captures
    generation.release_caches(model)


def test_a_step_that_cannot_be_captured_whole_runs_lazily_with_one_warning(one_thread):
    """A forward hook that reads a value on the host (a graph break): the capture is refused before anything ran,
    the steps are traced lazily instead (the same tokens), one warning says why, and later calls do not try again."""
    b = XLA_BACKEND
    model = random_model(FAMILIES["llama3"].config(VOCAB, pad=0), seed=1)
    p = _rows(0)
    want = _gen(model, p, "cpu")
    model = b.move_model(model)
    model.get_input_embeddings().register_forward_hook(lambda module, args, out: None if out.sum().item() else None)
    with pytest.warns(UserWarning, match="cannot be captured whole.*traced per token instead") as caught:
        got = _gen(model, p, b.device, sync=b.sync, replay=b.compile_step)
    assert torch.equal(got.ids, want.ids)
    assert sum("cannot be captured" in str(w.message) for w in caught) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second call goes lazily at once: no new attempt, no warning
        again = _gen(model, p, b.device, sync=b.sync, replay=b.compile_step)
    assert torch.equal(again.ids, want.ids)
    generation.release_caches(model)
