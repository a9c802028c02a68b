"""DistillTrainer's loss against torch's own kl_div and soft cross-entropy on CPU (values and gradients)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen2Config, Qwen2ForCausalLM

from tpu_helpers.training.causal_lm import DistillTrainer


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
    fake_self = SimpleNamespace(model=student, teacher=teacher, temperature=t, alpha=alpha)
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
