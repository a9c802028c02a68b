"""DistillTrainer's loss against torch's own kl_div and soft cross-entropy on CPU (values and gradients); the top-k
loss of distillation from a cache against it (k = the vocabulary) and against the k + 1 bucket KL."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen2Config, Qwen2ForCausalLM

from tpu_helpers.algorithms.distill import (
    CachedDistillTrainer,
    DistillSettings,
    DistillTrainer,
    teacher_topk,
    topk_kd_sum,
)


def _lm(seed: int) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1, use_cache=False))


def _reference(s_logits, t_logits, labels, t, alpha):
    hard = F.cross_entropy(s_logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100,
                           reduction="sum")
    keep = labels[:, 1:] != -100
    s, te = s_logits[:, :-1][keep] / t, t_logits[:, :-1][keep] / t
    kl = F.kl_div(F.log_softmax(s, -1), F.log_softmax(te, -1), reduction="sum", log_target=True)
    # The same soft term as a cross-entropy against the teacher's probabilities minus the teacher's entropy.
    p = F.softmax(te, -1)
    soft_ce = -(p * F.log_softmax(s, -1)).sum() + (p * F.log_softmax(te, -1)).sum()
    torch.testing.assert_close(kl, soft_ce, rtol=1e-5, atol=1e-5)
    return alpha * hard + (1 - alpha) * t * t * kl


@pytest.mark.parametrize("t,alpha", [(2.0, 0.5), (1.0, 0.0), (4.0, 0.9)])
def test_distill_loss_matches_torch_kl_div_and_soft_cross_entropy(t, alpha):
    student, teacher = _lm(0), _lm(1).eval()
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 64, (3, 12), generator=g)
    mask = torch.ones_like(ids)
    labels = ids.clone()
    labels[:, :5] = -100  # prompt tokens
    labels[2, 9:] = -100  # padding
    mask[2, 9:] = 0
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    fake_self = SimpleNamespace(model=student, teacher=teacher, settings=DistillSettings(t, alpha))
    got = DistillTrainer.loss_sum(fake_self, batch)
    got_grads = torch.autograd.grad(got, list(student.parameters()))
    s_logits = student(input_ids=ids, attention_mask=mask).logits
    with torch.no_grad():
        t_logits = teacher(input_ids=ids, attention_mask=mask).logits
    want = _reference(s_logits.float(), t_logits.float(), labels, t, alpha)
    want_grads = torch.autograd.grad(want, list(student.parameters()))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for a, b in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def _batch(seed: int = 2):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 64, (3, 12), generator=g)
    mask = torch.ones_like(ids)
    labels = ids.clone()
    labels[:, :5] = -100
    labels[2, 9:] = -100
    mask[2, 9:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _with_cache(batch, teacher, k, t):
    with torch.no_grad():
        t_logits = teacher(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    ids, logp, tail = teacher_topk(t_logits, k, t)
    return {**batch, "teacher_ids": ids, "teacher_logp": logp, "teacher_tail": tail}


@pytest.mark.parametrize("t,alpha", [(2.0, 0.5), (1.0, 0.0)])
def test_topk_kd_with_the_whole_vocabulary_equals_live_distillation_values_and_gradients(t, alpha):
    student, teacher = _lm(0), _lm(1).eval()
    batch = _batch()
    live = DistillTrainer.loss_sum(SimpleNamespace(model=student, teacher=teacher, settings=DistillSettings(t, alpha)), batch)
    live_grads = torch.autograd.grad(live, list(student.parameters()))
    cached = CachedDistillTrainer.loss_sum(SimpleNamespace(model=student, settings=DistillSettings(t, alpha)),
                                           _with_cache(batch, teacher, 64, t))
    grads = torch.autograd.grad(cached, list(student.parameters()))
    torch.testing.assert_close(cached, live, rtol=1e-5, atol=1e-5)
    for a, b in zip(grads, live_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_topk_kd_is_the_kl_over_the_top_k_and_one_tail_bucket():
    student, teacher = _lm(0), _lm(1).eval()
    batch = _batch(5)
    t, k = 1.5, 6
    cached = _with_cache(batch, teacher, k, t)
    got = topk_kd_sum(student(input_ids=batch["input_ids"]).logits, cached["teacher_ids"], cached["teacher_logp"],
                      cached["teacher_tail"], batch["labels"], t)
    # Reference, one position at a time: k + 1 buckets of the two full distributions.
    with torch.no_grad():
        p_all = F.softmax(teacher(input_ids=batch["input_ids"]).logits / t, -1)
    q_all = F.softmax(student(input_ids=batch["input_ids"]).logits / t, -1)
    want = 0.0
    for b in range(3):
        for s in range(11):
            if batch["labels"][b, s + 1] == -100:
                continue
            top = p_all[b, s].topk(k).indices
            p = torch.cat([p_all[b, s, top], (1 - p_all[b, s, top].sum())[None]])
            q = torch.cat([q_all[b, s, top], (1 - q_all[b, s, top].sum())[None]])
            want = want + (p * (p.log() - q.log())).sum()
    torch.testing.assert_close(got, want * t * t, rtol=1e-5, atol=1e-5)
    # Validation batches carry no teacher: the hard-label loss alone.
    hard = CachedDistillTrainer.loss_sum(SimpleNamespace(model=student, settings=DistillSettings(t, 0.3)), batch)
    torch.testing.assert_close(hard, F.cross_entropy(student(**batch).logits[:, :-1].flatten(0, 1),
                                                     batch["labels"][:, 1:].flatten(), reduction="sum"))


def _bucket_kl64(s_logits, ids, t_logp, t_tail, labels, t):
    """The k + 1 bucket KL in float64 from the full student softmax (exact tail: a logsumexp of the other tokens)."""
    s = torch.log_softmax(s_logits[:, :-1].double() / t, -1)
    ids, t_logp, t_tail = ids[:, :-1].long(), t_logp[:, :-1].double(), t_tail[:, :-1].double()
    s_top = s.gather(-1, ids)
    s_tail = s.scatter(-1, ids, float("-inf")).logsumexp(-1)
    kl = (t_logp.exp() * (t_logp - s_top)).sum(-1) + t_tail.exp() * (t_tail - s_tail)
    return (kl * (labels[:, 1:] != -100)).sum() * t * t


def test_topk_kd_with_a_near_zero_student_tail_is_the_exact_kl_and_its_gradient():
    # The student puts ~56 * e^-25 ~ 8e-10 outside the teacher's top 8, below float32's 1 - sum resolution: the
    # old log(1 - sum) floored at 1e-30 inflated the loss and its gradient towards the tail was ~0.
    torch.manual_seed(0)
    vocab, k, t = 64, 8, 1.0
    t_logits = torch.randn(2, 5, vocab)
    ids, t_logp, t_tail = teacher_topk(t_logits, k, t)
    base = torch.zeros(2, 5, vocab).scatter(-1, ids.long(), 25.0) + 0.1 * torch.randn(2, 5, vocab)
    labels = torch.ones(2, 5, dtype=torch.long)
    s32 = base.clone().requires_grad_(True)
    got = topk_kd_sum(s32, ids, t_logp, t_tail, labels, t)
    (g32,) = torch.autograd.grad(got, s32)
    s64 = base.double().requires_grad_(True)
    want = _bucket_kl64(s64, ids, t_logp, t_tail, labels, t)
    (g64,) = torch.autograd.grad(want, s64)
    torch.testing.assert_close(got.double(), want.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(g32.double(), g64, rtol=1e-4, atol=1e-6)
    assert g64[:, :-1].scatter(-1, ids[:, :-1].long(), 0.0).min() < -1e-3  # the tail's pull is real, and kept


def test_topk_kd_with_k_the_teacher_vocabulary_below_the_students_is_finite():
    # A teacher of 60 tokens cached whole (tail -inf) for a student of 64: 0 * -inf was nan.
    torch.manual_seed(1)
    ids, t_logp, t_tail = teacher_topk(torch.randn(2, 5, 60), 60, 2.0)
    assert torch.isinf(t_tail).all()
    s = torch.randn(2, 5, 64, requires_grad=True)
    labels = torch.ones(2, 5, dtype=torch.long)
    got = topk_kd_sum(s, ids, t_logp, t_tail, labels, 2.0)
    (g,) = torch.autograd.grad(got, s)
    assert torch.isfinite(got) and torch.isfinite(g).all()
    s64 = s.detach().double().requires_grad_(True)
    want = (lambda x: (torch.exp(t_logp[:, :-1].double()) * (t_logp[:, :-1].double() - torch.log_softmax(
        x[:, :-1] / 2.0, -1).gather(-1, ids[:, :-1].long()))).sum() * 4.0)(s64)
    (g64,) = torch.autograd.grad(want, s64)
    torch.testing.assert_close(got.double(), want.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(g.double(), g64, rtol=1e-4, atol=1e-6)
