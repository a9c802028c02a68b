"""Generation with the decode steps as one device loop (`generate_ids(..., loop=backend.compile_loop)`,
models/replay.py's `looped_steps` over backend/xla_loop.py) on XLA:CPU: the same tokens and log-probabilities as the
lazily traced loop on every model family; two graph runs per call (the prefill, the loop) whatever the number of new
tokens; later calls with other prompts, another sampling stream and other lengths compile nothing new; weights
updated in place (a tied head's too) and the adapter switched off are followed; a QAT model's fake quantizers
(which keep tensors on their modules) loop too; a step that cannot be looped falls back with one warning."""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.models.families import FAMILIES, lora_model, random_lora, random_model
from tests.support import XLA_BACKEND
from tpu_helpers.models import generation
from tpu_helpers.models.generation import Sampling, generate_ids, left_pad

pytestmark = [pytest.mark.xla, pytest.mark.skipif(XLA_BACKEND is None, reason="torch_xla not installed")]
VOCAB = 97


def _rows(seed: int, lengths=(12, 7, 3, 10), width: int = 12, vocab: int = VOCAB):
    torch.manual_seed(seed)
    return left_pad([torch.randint(3, vocab, (n,)).tolist() for n in lengths], width, 0)


def _gen(model, p, device, **kw):
    # The lazily traced loop unless a test passes `replay` or `loop` (test_generation_default.py checks the default).
    kw = {"max_new_tokens": 6, "eos_token_id": None, "pad_token_id": 0, "replay": False, "loop": False, **kw}
    out = generate_ids(model, p.ids.to(device), p.mask.to(device), **kw)
    return generation.Generated(out.ids.cpu(), out.logprobs.cpu(), out.mask.cpu())


def _runs(b) -> int:
    return b.step_metrics()["executions"]


def test_the_loop_gives_each_familys_tokens_in_two_graph_runs(one_thread):
    """Greedy, every family (full and sliding-window attention, Gemma's mask dicts): the looped decode answers as the
    lazily traced loop does (which test_generation.py holds to the uncached loop and test_families.py to
    transformers' generate), and a call runs two graphs (prefill, loop), not one per token."""
    b = XLA_BACKEND
    p = _rows(0)
    for family in sorted(FAMILIES):
        model = random_model(FAMILIES[family].config(VOCAB, pad=0), seed=1)
        want = _gen(model, p, "cpu", max_new_tokens=9)
        model = b.move_model(model)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no fallback
            _gen(model, p, b.device, sync=b.sync, loop=b.compile_loop, max_new_tokens=9)  # builds and compiles
            runs = _runs(b)
            got = _gen(model, p, b.device, sync=b.sync, loop=b.compile_loop, max_new_tokens=9)
        assert _runs(b) - runs == 2, family  # prefill and loop, not 8 decode graphs
        assert torch.equal(got.ids, want.ids), (family, got.ids, want.ids)
        assert torch.equal(got.mask, want.mask), family
        torch.testing.assert_close(got.logprobs, want.logprobs, atol=1e-4, rtol=1e-4)
        # The embedding updated in place (tied to the head in most of these families): the kept loop reads it
        # afresh, through the head as well, as the lazy loop does.
        with torch.no_grad():
            model.get_input_embeddings().weight.mul_(-1.0)
        b.sync()
        lazy = _gen(model, p, b.device, sync=b.sync, max_new_tokens=9)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            again = _gen(model, p, b.device, sync=b.sync, loop=b.compile_loop, max_new_tokens=9)
        assert torch.equal(again.ids, lazy.ids), (family, again.ids, lazy.ids)
        generation.release_caches(model)


def test_later_calls_trace_and_compile_nothing_and_follow_the_weights_and_the_adapter(tiny_lm_dir, one_thread):
    """A LoRA model sampling (GRPO's rollouts) with EOS stops, the prompt pass replayed and the decode looped (what
    the recipes pass): after the first call, calls with other prompts, another stream and fewer new tokens in the
    same cache compile nothing new, and weights updated in place (a training step between rollouts) are read
    afresh; the adapter switched off (`disable_adapter()`, the reference's weights) gets a program of its own, not
    the adapter's; each call answers as the lazy loop does in the same state."""
    b = XLA_BACKEND
    model = lora_model(tiny_lm_dir, b)
    hot = Sampling(temperature=1.5, top_k=20, top_p=0.9)
    vocab = model.config.vocab_size
    eos = [5, 9, 17]

    def both(seed, n=8, **kw):
        p = _rows(seed, lengths=(12, 5, 9, 1), vocab=vocab)
        kw = {"sampling": hot, "seed": torch.tensor([seed, 3]).to(b.device), "sync": b.sync, "eos_token_id": eos,
              "max_new_tokens": n, "cache_len": 12 + 8, **kw}
        lazy = _gen(model, p, b.device, **kw)
        runs = _runs(b)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # looped, not stepped one by one after a refusal
            # What the recipes pass: the prompt pass replayed, the decode looped.
            looped = _gen(model, p, b.device, replay=b.compile_step, loop=b.compile_loop, **kw)
        assert _runs(b) - runs <= 4  # the inputs' and the cache's syncs, the prompt pass, the loop: not n graphs
        return lazy, looped

    lazy, looped = both(1)  # the first call builds and compiles the loop
    assert torch.equal(looped.ids, lazy.ids) and torch.equal(looped.mask, lazy.mask)
    torch.testing.assert_close(looped.logprobs, lazy.logprobs, atol=1e-5, rtol=1e-5)
    assert (lazy.mask == 0).any()  # some rows stopped at an EOS: the stop masking ran inside the loop
    compiles = b.metrics()["compilations"]
    before = {}
    for seed, n in ((2, 8), (3, 5)):
        before[seed] = _gen(model, _rows(seed, lengths=(12, 5, 9, 1), vocab=vocab), b.device, sampling=hot,
                            sync=b.sync, seed=torch.tensor([seed, 3]).to(b.device), replay=b.compile_step,
                            loop=b.compile_loop, eos_token_id=eos, max_new_tokens=n, cache_len=20)
    assert b.metrics()["compilations"] == compiles
    assert (before[3].mask[:, 5:] == 0).all()  # 5 new tokens in a cache of 8: the columns past them stay empty
    with torch.no_grad():  # an optimizer step on the adapter, in place
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.mul_(-1.0)
    b.sync()
    lazy_after, looped_after = both(2)
    assert torch.equal(looped_after.ids, lazy_after.ids), (looped_after.ids, lazy_after.ids)
    assert not torch.equal(looped_after.ids, before[2].ids)  # the update changed the answers
    with model.disable_adapter():
        lazy_base, looped_base = both(2)
    assert torch.equal(looped_base.ids, lazy_base.ids)
    assert not torch.equal(looped_base.ids, looped_after.ids)  # the adapter's switch was not baked in
    generation.release_caches(model)


def test_a_shared_prompt_pass_replayed_and_looped_gives_the_cpus_tokens_and_compiles_once(tiny_lm_dir, one_thread):
    """GRPO's rollouts on XLA: 4 prompts x 3 samples, the prompt's pass once per prompt (4 rows), replayed, then
    the decode looped over the 12 rows: the CPU's tokens, and a second call with other prompts compiles nothing."""
    b = XLA_BACKEND
    model = lora_model(tiny_lm_dir, b)
    hot = Sampling(temperature=1.5, top_k=20, top_p=0.9)
    vocab = model.config.vocab_size
    cpu_model = random_lora(tiny_lm_dir)[0].eval()
    kw = {"sampling": hot, "eos_token_id": [5, 9, 17], "max_new_tokens": 8, "num_return_sequences": 3}
    compiles = []
    for seed in (1, 2):
        p = _rows(seed, lengths=(12, 5, 9, 1), vocab=vocab)
        want = _gen(cpu_model, p, "cpu", seed=torch.tensor([seed, 3]), **kw)
        start = b.metrics()["compilations"]
        got = _gen(model, p, b.device, seed=torch.tensor([seed, 3]).to(b.device), sync=b.sync,
                   replay=b.compile_step, loop=b.compile_loop, **kw)
        compiles.append(b.metrics()["compilations"] - start)
        assert got.ids.shape == (12, 8)
        assert torch.equal(got.ids, want.ids) and torch.equal(got.mask, want.mask)
        torch.testing.assert_close(got.logprobs, want.logprobs, atol=1e-5, rtol=1e-5)
    assert compiles[0] > 0 and compiles[1] == 0, compiles
    generation.release_caches(model)


def test_a_step_that_cannot_be_looped_steps_one_by_one_with_one_warning(one_thread):
    """A forward hook that reads a value on the host: the loop is refused before anything ran, the steps run one by
    one (replayed where `replay` is given, else lazily; the same tokens), one warning says why, and later calls do
    not try again."""
    b = XLA_BACKEND
    model = random_model(FAMILIES["llama3"].config(VOCAB, pad=0), seed=1)
    p = _rows(0)
    want = _gen(model, p, "cpu")
    model = b.move_model(model)
    model.get_input_embeddings().register_forward_hook(lambda module, args, out: None if out.sum().item() else None)
    with pytest.warns(UserWarning, match="reads a value on the host.*run one by one instead") as caught:
        got = _gen(model, p, b.device, sync=b.sync, loop=b.compile_loop)
    assert torch.equal(got.ids, want.ids)
    assert sum("one by one" in str(w.message) for w in caught) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second call steps one by one at once: no new attempt, no warning
        again = _gen(model, p, b.device, sync=b.sync, loop=b.compile_loop)
    assert torch.equal(again.ids, want.ids)
    generation.release_caches(model)


def test_a_qat_models_fake_quantizers_loop_and_keep_no_trace_behind(one_thread):
    """torchao's fake quantizers set tensors on their modules in every forward: traced on the loop's placeholders,
    those would outlive the trace and the next sync would read a placeholder (a segfault). The loop restores
    them, answers as the lazy loop does, and the model still runs afterwards."""
    from tpu_helpers.models import qat

    b = XLA_BACKEND
    model = random_model(FAMILIES["llama3"].config(VOCAB, pad=0), seed=1)
    model = b.move_model(qat.add_fake_quant(model, "int8", 32))
    p = _rows(0)
    want = _gen(model, p, b.device, sync=b.sync)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = _gen(model, p, b.device, sync=b.sync, loop=b.compile_loop)
    assert torch.equal(got.ids, want.ids)
    torch.testing.assert_close(got.logprobs, want.logprobs, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        model(input_ids=p.ids.to(b.device)).logits.sum().item()  # no placeholder left on any module
    generation.release_caches(model)


def test_a_data_parallel_mesh_loops_the_decode_and_an_fsdp_one_steps_it():
    """On 8 devices (SPMD): a data mesh (replicated weights) runs the decode as one device loop and answers as the
    CPU does on every family, a third call compiling nothing; an fsdp mesh keeps the stepped decode (the loop's
    program would gather every sharded weight whole before its While: the model whole on each chip), same tokens. On
    both a call with fewer new tokens in the same cache compiles nothing: over fsdp the replayed steps, which capture
    nothing over a mesh, must be synced per step, not traced into one graph per call length. A group's samples
    sharing their prompt's pass answer as the CPU's too."""
    from tests.support import script_result
    from tpu_helpers.backend import runtime_env

    env = runtime_env.xla_cpu_env(8)
    data = script_result("mesh_generation", {"sharding": "data", "families": sorted(FAMILIES)}, env=env, timeout=900)
    fsdp = script_result("mesh_generation", {"sharding": "fsdp", "families": ["llama3"]}, env=env, timeout=900)
    for family, r in {**data, "llama3 fsdp": fsdp["llama3"]}.items():
        assert r["same_ids"] and r["logprob_diff"] < 1e-4, (family, r)
    assert all(r["looped"] and r["third_call_compiles"] == 0 and r["mesh"] == [8, 1] for r in data.values()), data
    assert not fsdp["llama3"]["looped"] and fsdp["llama3"]["mesh"] == [1, 8], fsdp
    for family, r in {**data, "llama3 fsdp": fsdp["llama3"]}.items():
        assert r["shorter_same_ids"] and r["shorter_call_compiles"] == 0, (family, r)
    assert fsdp["llama3"]["third_call_compiles"] == 0, fsdp
    # 2 answers per prompt, the prompt's pass over the 8 prompts split over the chips: the CPU's tokens.
    assert data[sorted(FAMILIES)[0]]["shared_same_ids"] and fsdp["llama3"]["shared_same_ids"], (data, fsdp)
