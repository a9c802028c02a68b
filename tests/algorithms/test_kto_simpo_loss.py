"""KTO's and SimPO's losses (algorithms/preference_loss.py) against TRL 1.16's own code on the same inputs: KTO through
`KTOTrainer._compute_loss` (the precomputed-reference path, its KL estimate from the mismatched completions
included), SimPO through `trl.experimental.cpo`'s `cpo_loss` with loss_type "simpo" and its whole loss with the NLL
term (`get_batch_loss_metrics`). TRL is called, not re-typed: a trainer object is stood in for by the few
attributes its loss reads, and the model by the per-token log-probabilities it returns."""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from tpu_helpers.algorithms.preference_loss import PreferenceSettings, kto_loss, simpo_loss
from tpu_helpers.config import ConfigError

trl_kto = pytest.importorskip("trl.trainer.kto_trainer")


def _accelerator():
    return SimpleNamespace(device=torch.device("cpu"), gather=lambda x: x, gather_for_metrics=lambda x: x,
                           unwrap_model=lambda m: m)


def _rows(n, length, g):
    """Per-token log-probabilities (n, length - 1) with completion masks (n, length) that leave the prompt out."""
    mask = torch.zeros(n, length, dtype=torch.long)
    for i in range(n):
        start = int(torch.randint(1, 3, (1,), generator=g))
        mask[i, start:int(torch.randint(start + 1, length + 1, (1,), generator=g))] = 1
    return -torch.rand(n, length - 1, generator=g) * 3 * mask[:, 1:], mask


def _trl_kto(per_token, kl_per_token, mask, kl_mask, labels, ref, ref_kl, *, beta, desirable_weight,
             undesirable_weight):
    ids, kl_ids = torch.ones_like(mask), torch.full_like(kl_mask, 2)

    def model(**kwargs):
        out = kl_per_token if kwargs["input_ids"] is kl_ids else per_token
        return SimpleNamespace(log_probs=out, entropy=torch.zeros_like(out), mean_logits=torch.zeros_like(out))

    fake = SimpleNamespace(model=SimpleNamespace(training=True), accelerator=_accelerator(), aux_loss_enabled=False,
                           calculate_KL=True, precompute_ref_logps=True, loss_type="kto", beta=beta,
                           desirable_weight=desirable_weight, undesirable_weight=undesirable_weight,
                           _metrics={"train": defaultdict(list)}, _total_train_tokens=0, _tp_size=1)
    fake._compute_kl_logps = lambda m, batch: trl_kto.KTOTrainer._compute_kl_logps(fake, m, batch)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(mask), "completion_mask": mask,
              "KL_input_ids": kl_ids, "KL_attention_mask": torch.ones_like(kl_mask), "KL_completion_mask": kl_mask,
              "label": labels, "ref_logps": ref, "ref_KL_logps": ref_kl}
    loss = trl_kto.KTOTrainer._compute_loss(fake, model, inputs, return_outputs=False)
    return float(loss), {k: v[-1] for k, v in fake._metrics["train"].items()}


@pytest.mark.parametrize("beta, weights, kl_sign", [(0.1, (1.0, 1.0), 1), (0.5, (1.0, 1.33), 1),
                                                    (0.3, (0.7, 1.0), -1)])
def test_kto_loss_rewards_and_kl_equal_trls(beta, weights, kl_sign):
    g = torch.Generator().manual_seed(int(beta * 10))
    n, length = 8, 9
    per_token, mask = _rows(n, length, g)
    kl_per_token, kl_mask = _rows(n, length, g)
    labels = torch.tensor([True, False, True, True, False, False, True, False])
    ref = per_token.sum(1) + torch.randn(n, generator=g)  # the policy has moved from the reference either way
    # kl_sign -1: the mismatched completions are likelier under the reference, so the estimate is clamped to 0.
    ref_kl = kl_per_token.sum(1) - kl_sign * torch.rand(n, generator=g) * 2
    want, metrics = _trl_kto(per_token, kl_per_token, mask, kl_mask, labels, ref, ref_kl, beta=beta,
                             desirable_weight=weights[0], undesirable_weight=weights[1])
    settings = PreferenceSettings(algorithm="kto", beta=beta, desirable_weight=weights[0],
                                  undesirable_weight=weights[1])
    out = kto_loss(per_token.sum(1), ref, kl_per_token.sum(1), ref_kl, labels, settings=settings)
    assert float(out.losses.mean()) == pytest.approx(want, rel=1e-5, abs=1e-7)
    assert float(out.kl) == pytest.approx(metrics["kl"], rel=1e-5, abs=1e-7)
    assert (float(out.kl) == 0) == (kl_sign < 0)
    assert float(out.rewards[labels].mean()) == pytest.approx(metrics["rewards/chosen"], rel=1e-5)
    assert float(out.rewards[~labels].mean()) == pytest.approx(metrics["rewards/rejected"], rel=1e-5)
    # The weights and the KL term change the loss (the comparison above could not miss them).
    plain = kto_loss(per_token.sum(1), ref, kl_per_token.sum(1), kl_per_token.sum(1), labels,
                     settings=PreferenceSettings(algorithm="kto", beta=beta))
    assert kl_sign < 0 and weights == (1.0, 1.0) or not torch.allclose(plain.losses, out.losses)


def _means(g, n=8):
    return -torch.rand(n, generator=g) * 3, -torch.rand(n, generator=g) * 3


@pytest.mark.parametrize("beta, gamma, eps", [(0.1, 0.5, 0.0), (2.0, 1.0, 0.0), (2.5, 0.3, 0.2)])
def test_simpo_loss_and_rewards_equal_cpos_simpo(beta, gamma, eps):
    cpo = pytest.importorskip("trl.experimental.cpo.cpo_trainer")
    chosen, rejected = _means(torch.Generator().manual_seed(int(beta * 10)))
    fake = SimpleNamespace(beta=beta, simpo_gamma=gamma, label_smoothing=eps, loss_type="simpo", alpha=0.0,
                           accelerator=_accelerator())
    losses, c_rew, r_rew = cpo.CPOTrainer.cpo_loss(fake, chosen, rejected)
    out = simpo_loss(chosen, rejected, settings=PreferenceSettings(algorithm="simpo", beta=beta, simpo_gamma=gamma,
                                                                   label_smoothing=eps))
    torch.testing.assert_close(out.losses, losses, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.chosen_rewards, c_rew, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.rejected_rewards, r_rew, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cpo_alpha", [0.0, 1.0, 0.05])
def test_simpo_whole_loss_with_cpos_nll_term_equals_trls(cpo_alpha):
    """CPO's whole loss: the mean SimPO term plus cpo_alpha x the chosen answers' token-mean NLL, from the same logits
    and labels through TRL's `concatenated_forward` (its mean log-probabilities, its NLL) and ours."""
    cpo = pytest.importorskip("trl.experimental.cpo.cpo_trainer")
    g = torch.Generator().manual_seed(7)
    n, length, vocab = 4, 10, 11
    logits = torch.randn(2 * n, length, vocab, generator=g)
    labels = torch.randint(0, vocab, (2 * n, length), generator=g)
    for i in range(2 * n):  # the prompt's tokens and the padding are not labelled
        labels[i, :int(torch.randint(1, 4, (1,), generator=g))] = -100
        labels[i, int(torch.randint(6, length + 1, (1,), generator=g)):] = -100
    settings = PreferenceSettings(algorithm="simpo", beta=2.0, simpo_gamma=0.8, cpo_alpha=cpo_alpha)
    fake = SimpleNamespace(beta=2.0, simpo_gamma=0.8, label_smoothing=0.0, loss_type="simpo", alpha=0.0,
                           cpo_alpha=cpo_alpha, accelerator=_accelerator(), is_encoder_decoder=False,
                           aux_loss_enabled=False, pad_token_id=0, get_batch_logps=cpo.CPOTrainer.get_batch_logps,
                           concatenated_inputs=cpo.CPOTrainer.concatenated_inputs)
    fake.concatenated_forward = lambda model, batch: cpo.CPOTrainer.concatenated_forward(fake, model, batch)
    fake.cpo_loss = lambda c, r: cpo.CPOTrainer.cpo_loss(fake, c, r)
    batch = {"chosen_input_ids": torch.zeros(n, length, dtype=torch.long), "chosen_labels": labels[:n],
             "chosen_attention_mask": torch.ones(n, length, dtype=torch.long),
             "rejected_input_ids": torch.zeros(n, length, dtype=torch.long), "rejected_labels": labels[n:],
             "rejected_attention_mask": torch.ones(n, length, dtype=torch.long)}
    want, metrics = cpo.CPOTrainer.get_batch_loss_metrics(fake, lambda *a, **k: SimpleNamespace(logits=logits),
                                                          batch)
    # Ours: the per-token log-probabilities of the labelled tokens, as `algorithms.preference.pair_logps` gives them.
    mask = labels[:, 1:] != -100
    per_token = torch.log_softmax(logits[:, :-1], -1).gather(-1, labels[:, 1:].clamp(min=0)[..., None])[..., 0]
    sums, counts = (per_token * mask).sum(-1), mask.sum(-1)
    out = simpo_loss(*(sums / counts).chunk(2), settings=settings)
    nll = -sums[:n].sum() / counts[:n].sum()
    assert float(out.losses.mean() + settings.nll_weight * nll) == pytest.approx(float(want), rel=1e-5)
    assert float(nll) == pytest.approx(metrics["nll_loss"], rel=1e-5) or cpo_alpha == 0
    assert float((out.chosen_rewards > out.rejected_rewards).float().mean()) == \
        pytest.approx(metrics["rewards/accuracies"])


@pytest.mark.parametrize("fields, message", [
    ({"algorithm": "ktoo"}, r"algorithm='ktoo' is not one of \('dpo', 'orpo', 'kto', 'simpo', 'reward'\)"),
    ({"algorithm": "kto", "desirable_weight": -1.0}, r"desirable_weight=-1.0 must be a finite number >= 0"),
    ({"algorithm": "kto", "desirable_weight": 0, "undesirable_weight": 0}, r"KTO would learn nothing"),
    ({"algorithm": "simpo", "simpo_gamma": float("nan")}, r"simpo_gamma=nan must be a finite number >= 0"),
    ({"algorithm": "simpo", "cpo_alpha": True}, r"cpo_alpha=True must be a finite number >= 0"),
    ({"algorithm": "simpo", "precompute_ref": True}, r"SIMPO has no reference model"),
    ({"algorithm": "kto", "label_smoothing": 0.1}, r"label_smoothing=0.1 applies to algorithm 'dpo'"),
])
def test_bad_kto_and_simpo_settings_name_the_value(fields, message):
    with pytest.raises(ConfigError, match=message):
        PreferenceSettings(**fields)


def test_the_choices_are_parsed_once():
    kto, simpo = PreferenceSettings(algorithm="kto"), PreferenceSettings(algorithm="simpo", cpo_alpha=0.3)
    assert kto.uses_reference and kto.unpaired and kto.nll_weight == 0
    assert not simpo.uses_reference and not simpo.unpaired and simpo.nll_weight == 0.3
    assert PreferenceSettings(algorithm="orpo").nll_weight == 1.0
