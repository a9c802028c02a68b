"""On-policy distillation (TRL's GKD) in the fine-tuning recipe: the generalized JSD against TRL's own
`generalized_jsd_loss` (values and gradients, chunked and whole), the student's answers as training rows, a strict
XLA:CPU run in plain distillation's graphs whatever the mix of micro-batches (nothing compiled after warm-up), a
4-bit teacher and the memory plan's generation phase, and bad input (a teacher of another vocabulary or tokenizer,
settings out of range)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.algorithms.test_distill_loss import _batch, _lm  # the tiny student and teacher, a batch of them
from tests.support import StepCounters
from tpu_helpers.algorithms.distill import (
    DistillSettings,
    DistillTrainer,
    left_padded_prompts,
    prompt_lengths,
)
from tpu_helpers.config import ConfigError, config_from_parameters
from tpu_helpers.models import lm_head
from tpu_helpers.recipes.finetune import Finetune, FinetuneConfig

gkd = pytest.importorskip("trl.experimental.gkd")
TRL_JSD = gkd.GKDTrainer.generalized_jsd_loss


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("t", [0.7, 2.0])
def test_the_per_token_divergence_is_trls_generalized_jsd(beta, t):
    torch.manual_seed(0)
    z, t_z = torch.randn(4, 7, 64) * 3, torch.randn(4, 7, 64) * 3
    want = TRL_JSD(z, t_z, beta=beta, temperature=t, reduction="none").sum(-1)
    got = lm_head.full_jsd(z / t, t_z / t, beta)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert float(want.abs().max()) > 1e-2  # the two distributions do differ


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("chunk", [0, 8])
def test_the_trainers_soft_loss_is_trls_on_the_same_logits_values_and_gradients(beta, chunk):
    t = 1.5
    student, teacher = _lm(0), _lm(1).eval()
    batch = _batch()
    fake = SimpleNamespace(model=student, teacher=teacher, settings=DistillSettings(t, 0.0, beta=beta),
                           loss_chunk=chunk)
    got = DistillTrainer.loss_sum(fake, batch)
    got_grads = torch.autograd.grad(got, list(student.parameters()))
    s_logits = student(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    with torch.no_grad():
        t_logits = teacher(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    # TRL's compute_loss: logits shifted, labels[:, 1:], the sum over target tokens (the package divides by the
    # step's target tokens afterwards, as TRL's num_items_in_batch); T^2 is the package's usual scale of the soft term.
    want = TRL_JSD(s_logits[:, :-1], t_logits[:, :-1], batch["labels"][:, 1:], beta=beta, temperature=t,
                   reduction="sum") * t * t
    want_grads = torch.autograd.grad(want, list(student.parameters()))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for a, b in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_the_student_answers_weigh_the_soft_term_alone_and_left_padded_rows_keep_their_positions():
    student, teacher = _lm(0), _lm(1).eval()
    batch = _batch()
    settings = DistillSettings(2.0, 0.3, lambda_=1.0, beta=0.5)
    fake = SimpleNamespace(model=student, teacher=teacher, settings=settings, loss_chunk=0)
    mixed = DistillTrainer.loss_sum(fake, {**batch, "distill_weights": torch.tensor([0.3, 0.7])})
    plain = DistillTrainer.loss_sum(SimpleNamespace(model=student, teacher=teacher, settings=settings), batch)
    torch.testing.assert_close(mixed, plain)  # right-padded rows: the positions from the mask are arange's
    soft = DistillTrainer.loss_sum(fake, {**batch, "distill_weights": torch.tensor([0.0, 1.0])})
    only = DistillTrainer.loss_sum(SimpleNamespace(model=student, teacher=teacher,
                                                   settings=DistillSettings(2.0, 0.0, beta=0.5)), batch)
    torch.testing.assert_close(soft, only)
    # Left-padded: the same tokens shifted right by 3 give the same loss (positions count the mask).
    shifted = {k: torch.cat([torch.full_like(v[:, :3], 0 if k != "labels" else -100), v], 1)
               for k, v in batch.items()}
    moved = DistillTrainer.loss_sum(fake, {**shifted, "distill_weights": torch.tensor([0.0, 1.0])})
    torch.testing.assert_close(moved, soft, rtol=1e-4, atol=1e-4)


def test_left_padded_prompts_take_each_rows_tokens_before_its_first_trained_one():
    ids = torch.tensor([[5, 6, 7, 8, 9, 0], [1, 2, 3, 4, 5, 6]])
    labels = torch.tensor([[-100, -100, 7, 8, -100, -100], [-100, -100, -100, -100, -100, 6]])
    assert prompt_lengths(labels).tolist() == [2, 5]
    got, mask = left_padded_prompts({"input_ids": ids, "labels": labels}, 4, pad=99)
    assert got.tolist() == [[99, 99, 5, 6], [2, 3, 4, 5]]  # the second prompt keeps its last 4 tokens
    assert mask.tolist() == [[0, 0, 1, 1], [1, 1, 1, 1]]


def _config(tmp_path, device="cpu", **overrides):
    base = dict(device=device, steps=4, batch_size=4, seq_len=32, lr=3e-3, warmup_steps=1, eval_every=1000,
                eval_batches=1, log_every=1, save_every=1000, out_dir=str(tmp_path / "run"),
                xla_checks="strict" if device == "xla" else "off", method="distill", teacher="tiny",
                max_records=128, max_new_tokens=6, distill_lambda=1.0, distill_beta=0.5, distill_alpha=0.0,
                distill_temperature=1.0)
    return FinetuneConfig(**{**base, **overrides})


def _job(tmp_path, device="cpu", *, backend=None, callbacks=None, **overrides):
    return Finetune(_config(tmp_path, device, **overrides), backend=backend, progress=False, callbacks=callbacks)


def test_the_student_answers_its_prompts_and_learns_the_teacher_on_them(tmp_path):
    job = _job(tmp_path, distill_lambda=0.5, grad_accum=2, steps=3)
    trainer = job.trainer
    assert trainer.prompt_width == 32 - 6
    draws = [trainer.answers_itself(k) for k in range(2)]
    micro = trainer.micro_batches(iter(trainer.train_loader))
    for own, batch in zip(draws, micro, strict=True):
        assert set(batch) == {"input_ids", "attention_mask", "labels", "distill_weights"}
        assert batch["input_ids"].shape == (4, 32)
        if own:  # the answer's columns are the last 6, trained up to the stop token; the prompt's never
            assert (batch["labels"][:, :26] == -100).all() and (batch["labels"][:, 26] != -100).all()
            trained = batch["labels"][:, 26:] != -100
            assert torch.equal(trained, batch["attention_mask"][:, 26:].bool())
            assert batch["distill_weights"].tolist() == [0.0, 1.0]
        else:
            assert batch["distill_weights"].tolist() == [0.0, 1.0]  # alpha 0: the soft term alone here too
    # Over many steps the share of student micro-batches is lambda; the same draws again (a resumed run's).
    trainer.step, share = 0, []
    for step in range(200):
        trainer.step = step
        share += [trainer.answers_itself(k) for k in range(2)]
    assert 0.4 < sum(share) / len(share) < 0.6
    trainer.step = 0
    assert [trainer.answers_itself(k) for k in range(2)] == draws


def test_fully_on_policy_distillation_lowers_the_divergence_on_the_students_answers(tmp_path):
    from tpu_helpers.models.hf_tiny import tiny_model_dir

    # A teacher of the student's tokenizer and other weights (the tiny model of another seed).
    job = _job(tmp_path, teacher=str(tiny_model_dir(seed=1)), steps=8, lr=3e-3, lora_r=0)
    job.train()
    losses = [r["loss"] for r in job.history.train]
    print(f"fully on-policy, beta 0.5: the loss per answer token by step {[round(x, 3) for x in losses]}")
    assert sum(losses[-2:]) < 0.7 * sum(losses[:2]), losses


@pytest.mark.xla
def test_strict_xla_on_policy_distillation_trains_in_the_graphs_of_plain_distillation_whatever_the_mix(tmp_path):
    from tests.support import XLA_BACKEND

    def run(name, lambda_, draws=None):
        counters = StepCounters()
        job = _job(tmp_path / name, "xla", backend=XLA_BACKEND, callbacks=[counters], steps=len(kinds), grad_accum=2,
                   seed=3, distill_lambda=lambda_, distill_alpha=0.5, gradient_checkpointing=True, log_every=3)
        trainer, generating = job.trainer, [0]
        if draws is not None:  # which micro-batches the student answers, step by step
            trainer.answers_itself = lambda k: draws[trainer.step][k]
            answers = trainer.student_answers

            def counted(*args):  # the compilations of the generation, apart from the training step's
                before = trainer.backend.metrics()["compilations"]
                out = answers(*args)
                generating[0] += trainer.backend.metrics()["compilations"] - before
                return out
            trainer.student_answers = counted
        report = job.train()  # xla_checks="strict": a recompilation or an undeclared host read after warm-up raises
        assert report.xla["problems"] == [] and report.xla["cpu_fallback_ops"] == {}
        steps = [counters.steps[k]["compilations"] for k in sorted(counters.steps)]
        assert all(c == 0 for c in steps[2:]), (name, steps)
        return steps, generating[0]

    # The first step draws no student answers (the generation still compiles there, not when it first runs), then
    # every mix of the two kinds: one graph per step whichever micro-batches the student answers.
    kinds = [[False, False], [False, False], [True, True], [True, False], [False, True], [True, True]]
    on_policy, generation = run("on", 0.5, kinds)
    plain, none = run("plain", 0.0)
    assert none == 0 and generation > 0
    assert sum(on_policy) - generation == sum(plain), (on_policy, generation, plain)
    print(f"on-policy distillation strict on XLA:CPU: compilations per step {on_policy} ({generation} of them the "
          f"generation's), plain distillation {plain}; student micro-batches {kinds}")


def test_a_4bit_teacher_runs_and_the_plan_counts_it_with_the_students_kv_cache(tmp_path):
    job = _job(tmp_path, teacher_quantize="nf4", quantize_group_size=32, steps=2)
    job.train()
    from tpu_helpers.models.quant4 import is_quantized

    assert is_quantized(job.trainer.teacher)
    plain = _job(tmp_path / "plain", distill_lambda=0.0).plan().estimate
    four = job.plan().estimate
    assert "the student's answers" in four.phases and "the student's answers" not in plain.phases
    params = {name: parts["params"] for name, parts in four.phases.items()}
    assert params["the start of the backward"] < plain.phases["the start of the backward"]["params"]
    assert any("KV cache" in n for n in four.notes) and any("teacher in 4 bits (nf4)" in n for n in four.notes)


def test_a_teacher_of_another_vocabulary_or_tokenizer_is_refused_naming_both(tmp_path):
    from tpu_helpers.models.hf_tiny import tiny_model_dir

    other = tiny_model_dir(tmp_path / "cache", vocab_size=384)
    job = _job(tmp_path, teacher=str(other))
    with pytest.raises(ConfigError, match=r"TEACHER='.*' has a vocabulary of 384 tokens and MODEL='tiny' 512; "
                                          r"distillation compares logits token by token"):
        job.trainer  # noqa: B018
    # The same size, other tokens: two of the tokenizer's ids swapped.
    import json

    from transformers import AutoModelForCausalLM, AutoTokenizer

    same = tiny_model_dir(tmp_path / "cache2")
    out = tmp_path / "swapped"
    AutoModelForCausalLM.from_pretrained(same).save_pretrained(out)
    AutoTokenizer.from_pretrained(same).save_pretrained(out)
    spec = json.loads((out / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (out / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(ConfigError, match=r"TEACHER='.*swapped' and MODEL='tiny' have different tokenizers"):
        _job(tmp_path / "t", teacher=str(out)).trainer  # noqa: B018


@pytest.mark.parametrize("params,message", [
    ({"DISTILL_LAMBDA": 1.5}, r"DISTILL_LAMBDA=1.5 must be a number between 0 and 1"),
    ({"DISTILL_BETA": -0.1}, r"DISTILL_BETA=-0.1 must be a number between 0 and 1"),
    ({"DISTILL_LAMBDA": 0.5, "TEACHER_CACHE": "/tmp/c"}, r"scored by a teacher run live"),
    ({"DISTILL_LAMBDA": 0.5, "METHOD": "lora"}, r"scored by a teacher run live"),
    ({"TEACHER_QUANTIZE": "int3"}, r"int3"),
])
def test_bad_on_policy_settings_are_refused_by_name(params, message):
    base = {"METHOD": "distill", "TEACHER": "tiny", **params}
    with pytest.raises(ConfigError, match=message):
        config_from_parameters(base, base=FinetuneConfig())


def test_packed_rows_and_answers_as_long_as_a_row_are_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"distill_lambda=1.0 with pack=True"):
        _job(tmp_path / "a", pack=True).trainer  # noqa: B018
    with pytest.raises(ConfigError, match=r"max_new_tokens=32 must be an integer >= 1 and below seq_len=32"):
        _job(tmp_path / "b", max_new_tokens=32).trainer  # noqa: B018
