"""The chunked losses (models/lm_head.py) equal the unchunked ones, values and gradients, in fp32 on every family
of tests/models/families.py (Gemma's final-logit soft-capping and the tied heads included): the causal-LM loss, the
cached top-k and live-teacher distillation losses, and the per-token log-probabilities GRPO and DPO take; with
padding, -100 labels and a chunk that does not divide the tokens. Under LoRA (on the head too), QAT and gradient
checkpointing likewise; a head it does not know falls back with a warning; a strict SFT run on XLA:CPU with the
chunked loss compiles nothing after warm-up."""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.models.families import FAMILIES, random_model
from tests.support import XLA_BACKEND
from tpu_helpers.algorithms.distill import teacher_topk, topk_kd_sum
from tpu_helpers.algorithms.grpo import completion_logps
from tpu_helpers.algorithms.sft import lm_logits
from tpu_helpers.config import ConfigError
from tpu_helpers.models import lm_head
from tpu_helpers.training.batches import causal_lm_loss_sum

VOCAB, B, S, CHUNK, K, T = 61, 2, 9, 5, 7, 1.7  # 18 tokens in chunks of 5: the last chunk is 3


def _batch(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (B, S), generator=g)
    mask = torch.ones(B, S, dtype=torch.long)
    mask[1, -3:] = 0  # right padding on the second row
    labels = ids.clone()
    labels[:, :3] = -100  # a prompt
    labels[mask == 0] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _cached(batch: dict, seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids, logp, tail = teacher_topk(torch.randn(B, S, VOCAB, generator=g) * 3, K, T)
    return {**batch, "teacher_ids": ids, "teacher_logp": logp, "teacher_tail": tail}


def _grads(loss: torch.Tensor, model: torch.nn.Module) -> list[torch.Tensor]:
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.autograd.grad(loss, params, allow_unused=True)


def _same(chunked: torch.Tensor, whole: torch.Tensor, model: torch.nn.Module, what: str) -> None:
    torch.testing.assert_close(chunked, whole, atol=1e-5, rtol=1e-5, msg=lambda m: f"{what}: {m}")
    weights = torch.linspace(0.5, 1.5, whole.numel()).reshape(whole.shape)  # a gradient per token, not one
    for a, b in zip(_grads((chunked * weights).sum(), model), _grads((whole * weights).sum(), model), strict=True):
        assert (a is None) == (b is None), what
        if a is not None:  # 1e-5 of the tensor's scale: the random wide layers give embedding gradients of ~500,
            # where summing the chunks' contributions in another order moves an entry by ~1e-4
            scale = float(b.abs().max()) or 1.0
            torch.testing.assert_close(a, b, atol=1e-5 * scale, rtol=1e-5, msg=lambda m: f"{what} gradient: {m}")


def _live_kd_whole(model, teacher, batch) -> torch.Tensor:
    """The unchunked live-teacher loss as DistillTrainer computed it before chunking."""
    s_logp = torch.log_softmax(lm_logits(model, batch)[:, :-1].float() / T, dim=-1)
    with torch.no_grad():
        t_logp = torch.log_softmax(lm_logits(teacher, batch)[:, :-1].float() / T, dim=-1)
    kl = (torch.exp(t_logp) * (t_logp - s_logp)).sum(-1)
    return (kl * (batch["labels"][:, 1:] != -100)).sum() * T * T


def _check_all(model: torch.nn.Module, teacher: torch.nn.Module) -> None:
    batch = _batch()
    labels = batch["labels"]
    # causal-LM loss
    whole = causal_lm_loss_sum(lm_logits(model, batch), labels)
    _same(lm_head.lm_loss_sum(model, batch, chunk=CHUNK), whole, model, "CE")
    # cached top-k KD: one pass of the head gives the hard and the soft sums
    cb = _cached(batch)
    hard, soft = lm_head.cached_kd_sums(model, cb, T, chunk=CHUNK)
    logits = lm_logits(model, cb)
    _same(torch.stack([hard, soft]), torch.stack([causal_lm_loss_sum(logits, labels), topk_kd_sum(
        logits, cb["teacher_ids"], cb["teacher_logp"], cb["teacher_tail"], labels, T)]), model, "cached KD")
    # live KD, the teacher's logits chunked too
    hard, soft = lm_head.live_kd_sums(model, teacher, batch, T, chunk=CHUNK)
    _same(torch.stack([hard, soft]), torch.stack([causal_lm_loss_sum(lm_logits(model, batch), labels),
                                                           _live_kd_whole(model, teacher, batch)]), model, "live KD")
    # per-token log-probs (DPO): the full-logit reference
    logp = lm_head.token_logps(model, batch["input_ids"], labels, T, attention_mask=batch["attention_mask"],
                               chunk=CHUNK)
    z = lm_logits(model, batch)[:, :-1].float() / T
    ref = torch.log_softmax(z, -1).gather(-1, labels[:, 1:].clamp(min=0).unsqueeze(-1)).squeeze(-1)
    _same(logp, ref * (labels[:, 1:] != -100), model, "token log-probs")
    # GRPO's completion log-probs: chunked against its own unchunked path (logits_to_keep), left padding
    ids, mask = batch["input_ids"], torch.ones(B, S, dtype=torch.long)
    mask[0, :2] = 0
    lm_head.set_loss_chunk(model, CHUNK)
    chunked = completion_logps(model, ids, mask, 6, T)  # 12 completion tokens in chunks of 5
    lm_head.set_loss_chunk(model, 0)
    _same(chunked, completion_logps(model, ids, mask, 6, T), model, "GRPO log-probs")
    # a group's shared prompt pass (2 rows of one prompt, the first with left padding), chunked and not
    ids = torch.cat([ids[:1, :3].repeat(2, 1), ids[:, 3:]], 1)
    mask = torch.cat([mask[:1, :3].repeat(2, 1), mask[:, 3:]], 1)
    for chunk in (CHUNK, 0):
        lm_head.set_loss_chunk(model, chunk)
        _same(completion_logps(model, ids, mask, 6, T, group=2), completion_logps(model, ids, mask, 6, T), model,
              f"GRPO shared prompt, chunk {chunk}")


def _model(name: str, seed: int = 0) -> torch.nn.Module:
    model = random_model(FAMILIES[name].config(VOCAB, bos=1, eos=2, pad=0), seed=seed)
    return model.train().requires_grad_(True)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_chunked_losses_equal_the_unchunked_ones_with_their_gradients(name, one_thread):
    model, teacher = _model(name), _model(name, seed=1).requires_grad_(False)
    if name.startswith("gemma"):  # Gemma 2 ships a cap of 30, Gemma 3 none (its forward has the same code)
        assert bool(model.config.final_logit_softcapping) == (name == "gemma2")
        model.config.final_logit_softcapping = 3.0  # random logits reach it: tanh's bend shows in every value
    _check_all(model, teacher)


def test_hidden_state_gradients_equal_per_chunk_and_whole(one_thread):
    split = lm_head.split_head(_model("gemma2"))
    h = torch.randn(13, 32, requires_grad=True)
    t = torch.randint(0, VOCAB, (13,))
    t[4] = -100
    chunked = torch.stack(lm_head.map_chunks(
        lambda x, y: torch.nn.functional.cross_entropy(split.logits(x), y, reduction="sum"), 4, h, t)).sum()
    whole = torch.nn.functional.cross_entropy(split.logits(h), t, reduction="sum")
    torch.testing.assert_close(chunked, whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(*(torch.autograd.grad(x, h)[0] for x in (chunked, whole)), atol=1e-5, rtol=1e-5)


def test_lora_on_the_head_qat_and_gradient_checkpointing_keep_the_chunked_losses_exact(one_thread):
    from tpu_helpers.models import lora, qat
    from tpu_helpers.training.recompute import set_gradient_checkpointing

    model = qat.add_fake_quant(_model("mistral"), "int4", group_size=16)  # untied head: LoRA can wrap it
    model = lora.add_lora(model, r=2, alpha=4, targets="q_proj,down_proj,lm_head")
    for n, p in model.named_parameters():  # non-zero B matrices: the adapters change the logits
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.5)
    set_gradient_checkpointing(model, lm_head.checkpoint_for(torch.zeros(1)))
    assert type(lm_head.split_head(model).head).__name__ == "Linear" and lora.is_peft(model)
    assert "lora" in type(lm_head.split_head(model).head).__module__  # peft's wrapped head
    _check_all(model, _model("mistral", seed=1).requires_grad_(False))


def test_an_unknown_head_falls_back_to_the_whole_logits_with_a_warning(one_thread):
    import transformers

    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=1, n_head=2)
    model = transformers.AutoModelForCausalLM.from_config(config)
    batch = _batch()
    lm_head._WARNED.discard("gpt2")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a batch that would not be chunked anyway ("auto" at 61 tokens): no warning
        assert lm_head.lm_loss_sum(model, batch) is None
    with pytest.warns(UserWarning, match=r"GPT2LMHeadModel \(model_type 'gpt2'\) is not a head the chunked loss"):
        assert lm_head.lm_loss_sum(model, batch, chunk=CHUNK) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per model type
        assert lm_head.lm_loss_sum(model, batch, chunk=CHUNK) is None


def test_the_chunk_setting_and_its_auto_rule():
    assert lm_head.auto_chunk(151_936) == 256 and lm_head.auto_chunk(32_000) == 2048 and lm_head.auto_chunk(97) == 4096
    model = _model("qwen3")
    assert lm_head.chunk_size(model, 8192, 151_936) == 256  # "auto" by default
    assert lm_head.chunk_size(model, 200, 151_936) == 0  # fewer tokens than a chunk: no chunking
    lm_head.set_loss_chunk(model, 0)
    assert lm_head.chunk_size(model, 8192, 151_936) == 0
    for bad in (-1, "big", 2.5, True):
        with pytest.raises(ConfigError, match=r"LOSS_CHUNK=.* must be 'auto'"):
            lm_head.check_loss_chunk(bad)


def test_the_recipes_loss_chunk_is_checked_and_set_on_the_model(tmp_path, tiny_lm_dir):
    from tpu_helpers.recipes.finetune import Finetune, FinetuneConfig
    from tpu_helpers.recipes.grpo import GRPOConfig

    with pytest.raises(ConfigError, match=r"LOSS_CHUNK='big' must be 'auto'"):
        FinetuneConfig(device="cpu", loss_chunk="big")
    with pytest.raises(ConfigError, match=r"LOSS_CHUNK=-1 must be 'auto'"):
        GRPOConfig(device="cpu", loss_chunk=-1)
    job = Finetune(FinetuneConfig(device="cpu", loss_chunk=64, out_dir=str(tmp_path)), progress=False)
    assert lm_head.chunk_size(job.model, 1000, 512) == 64  # the LoRA-wrapped model carries LOSS_CHUNK
    assert any("64 tokens at a time" in n for n in job.plan().estimate.notes)


@pytest.mark.xla
@pytest.mark.skipif(XLA_BACKEND is None, reason="torch_xla not installed")
def test_a_strict_xla_sft_run_with_the_chunked_loss_compiles_nothing_after_warm_up(tmp_path, tiny_sft):
    from tpu_helpers.algorithms.sft import CausalLMTrainer
    from tpu_helpers.config import TrainConfig
    from tpu_helpers.models import hf, lora

    tok, train, val = tiny_sft
    model, _ = hf.load_causal_lm("tiny")
    model = lora.add_lora(model, r=2)
    calls = []
    real = lm_head.map_chunks
    cfg = TrainConfig(device="xla", steps=3, batch_size=4, seq_len=32, lr=3e-3, warmup_steps=1, eval_every=3,
                      eval_batches=1, log_every=3, save_every=3, out_dir=str(tmp_path / "run"), xla_checks="strict")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(lm_head, "map_chunks", lambda *a: calls.append(a[1]) or real(*a))
        trainer = CausalLMTrainer(model, train, val, config=cfg, backend=XLA_BACKEND, progress=False, loss_chunk=48)
        report = trainer.fit()  # strict: a compilation or a host read after warm-up raises
    assert calls and set(calls) == {48}  # 4 x 32 = 128 tokens in chunks of 48: the chunked loss ran
    assert report.xla["compilations"] <= 3 and report.xla["cpu_fallback_ops"] == {}, report.xla


def test_the_traced_step_and_the_plan_drop_the_same_logits_with_the_chunked_loss(one_thread):
    from transformers import Qwen2Config

    from tests import example_models as ex
    from tpu_helpers.memory.hf_plan import hf_finetune_estimate
    from tpu_helpers.memory.traced import traced_estimate

    whole = traced_estimate(ex.wide_vocab_lm_lora, ex.wide_vocab_batch, 4)
    chunked = traced_estimate(ex.wide_vocab_lm_lora_chunked, ex.wide_vocab_batch, 4)
    config = Qwen2Config(vocab_size=ex.WIDE_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    plan = {c: hf_finetune_estimate(config, 4, ex.TINY_LM_SEQ, precision="fp32", loss_chunk=c).peak_bytes
            for c in (0, 64)}
    # 4 x 128 tokens x 8192 entries: 16 MiB of fp32 logits; the eager step kept ~42 MiB for them (logits, their
    # log-softmax, its gradient), and one chunk of 64 tokens an eighth of it.
    saved, planned = whole.peak_bytes - chunked.peak_bytes, plan[0] - plan[64]
    assert planned == 12 * (4 * ex.TINY_LM_SEQ - 64) * ex.WIDE_VOCAB
    assert abs(saved / planned - 1) < 0.1 and chunked.peak_bytes < 0.3 * whole.peak_bytes, (saved, planned)
