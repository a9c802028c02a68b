"""The preference losses (algorithms/preference_loss.py) against TRL's own code on the same inputs: DPO's sigmoid
and IPO through `DPOTrainer._compute_loss`, cDPO label smoothing through its `aot` loss on single pairs (TRL 1.16's
sigmoid no longer reads label_smoothing; aot on one pair is the cDPO form), ORPO through `ORPOTrainer`'s
`odds_ratio_loss` and `get_batch_loss_metrics`; the rewards TRL logs included. TRL is called, not re-typed: a
trainer object is stood in for by the few attributes its loss reads."""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from tpu_helpers.algorithms.preference_loss import PreferenceSettings, dpo_loss, log1mexp, orpo_loss
from tpu_helpers.config import ConfigError

trl_dpo = pytest.importorskip("trl.trainer.dpo_trainer")


def _accelerator():
    return SimpleNamespace(device=torch.device("cpu"), gather=lambda x: x, gather_for_metrics=lambda x: x)


def _pairs(n=6, length=7, seed=0):
    """Per-token log-probabilities (2n rows: chosen then rejected) with completion masks that leave the prompt out,
    and reference sums."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(2 * n, length, dtype=torch.long)
    for i in range(2 * n):
        start = int(torch.randint(1, 3, (1,), generator=g))
        stop = int(torch.randint(start + 1, length + 1, (1,), generator=g))
        mask[i, start:stop] = 1
    per_token = -torch.rand(2 * n, length - 1, generator=g, dtype=torch.float64).float() * 3 * mask[:, 1:]
    ref = -torch.rand(2 * n, generator=g).float() * 8
    return per_token, mask, ref


def _trl_dpo(per_token, mask, ref, *, loss_type, beta, label_smoothing=0.0):
    n = per_token.shape[0] // 2
    model = SimpleNamespace(training=True)

    def forward(**kwargs):
        rows, width = per_token.shape
        return SimpleNamespace(log_probs=per_token, entropy=torch.zeros(rows, width),
                               mean_logits=torch.zeros(rows, width), is_top1=torch.zeros(rows, width, dtype=torch.bool))

    fake = SimpleNamespace(model=model, accelerator=_accelerator(), aux_loss_enabled=False, ld_alpha=None,
                           precompute_ref_logps=True, f_divergence_type="reverse_kl", loss_types=[loss_type],
                           loss_weights=[1.0], beta=beta, label_smoothing=label_smoothing, use_weighting=False,
                           _metrics={"train": defaultdict(list)}, _total_train_tokens=0, _tp_size=1)
    inputs = {"input_ids": torch.ones_like(mask), "attention_mask": torch.ones_like(mask), "completion_mask": mask,
              "ref_chosen_logps": ref[:n], "ref_rejected_logps": ref[n:]}
    loss = trl_dpo.DPOTrainer._compute_loss(fake, forward, inputs, return_outputs=False)
    return float(loss), {k: v[-1] for k, v in fake._metrics["train"].items()}


def _ours(per_token, mask, ref, settings):
    n = per_token.shape[0] // 2
    sums, tokens = per_token.sum(1), mask.sum(1)
    return dpo_loss(sums[:n], sums[n:], ref[:n], ref[n:], settings=settings, chosen_tokens=tokens[:n],
                    rejected_tokens=tokens[n:])


@pytest.mark.parametrize("loss_type, beta", [("sigmoid", 0.1), ("sigmoid", 0.5), ("ipo", 0.1), ("ipo", 0.7)])
def test_dpo_losses_and_rewards_equal_trls(loss_type, beta):
    per_token, mask, ref = _pairs(seed=int(beta * 10))
    want, metrics = _trl_dpo(per_token, mask, ref, loss_type=loss_type, beta=beta)
    out = _ours(per_token, mask, ref, PreferenceSettings(loss_type=loss_type, beta=beta))
    assert float(out.losses.mean()) == pytest.approx(want, rel=1e-5, abs=1e-6)
    margins = out.chosen_rewards - out.rejected_rewards
    mine = {"rewards/chosen": out.chosen_rewards.mean(), "rewards/rejected": out.rejected_rewards.mean(),
            "rewards/margins": margins.mean(), "rewards/accuracies": (margins > 0).float().mean()}
    for key, value in mine.items():
        assert float(value) == pytest.approx(metrics[key], rel=1e-5, abs=1e-6), key
    assert 0 < metrics["rewards/accuracies"] < 1  # the inputs hold pairs either way round


@pytest.mark.parametrize("eps", [0.1, 0.3])
def test_cdpo_label_smoothing_equals_trls_aot_on_each_pair(eps):
    per_token, mask, ref = _pairs(n=4, seed=3)
    out = _ours(per_token, mask, ref, PreferenceSettings(beta=0.2, label_smoothing=eps))
    plain = _ours(per_token, mask, ref, PreferenceSettings(beta=0.2))
    for i in range(4):
        rows = [i, 4 + i]
        want, _ = _trl_dpo(per_token[rows], mask[rows], ref[rows], loss_type="aot", beta=0.2, label_smoothing=eps)
        assert float(out.losses[i]) == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert not torch.allclose(out.losses, plain.losses)  # the smoothing changes the loss


def test_orpo_loss_and_rewards_equal_trls():
    orpo = pytest.importorskip("trl.experimental.orpo.orpo_trainer")
    g = torch.Generator().manual_seed(1)
    chosen = -torch.rand(8, generator=g) * 3 - 1e-3
    rejected = -torch.rand(8, generator=g) * 3 - 1e-3
    chosen[0] = -1e-4  # near probability 1: the log1mexp branch that avoids cancellation
    nll = torch.tensor(1.7)
    lam = 0.25
    fake = SimpleNamespace(beta=lam, accelerator=_accelerator(), aux_loss_enabled=False)
    losses, c_rew, r_rew, _, _ = orpo.ORPOTrainer.odds_ratio_loss(fake, chosen, rejected)
    out = orpo_loss(chosen, rejected, settings=PreferenceSettings(algorithm="orpo", orpo_lambda=lam))
    torch.testing.assert_close(out.losses, -losses, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.chosen_rewards, c_rew, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.rejected_rewards, r_rew, rtol=1e-5, atol=1e-6)
    # The whole loss as TRL composes it: the chosen NLL minus the mean of its (signed) odds-ratio term.
    fake.odds_ratio_loss = lambda c, r: orpo.ORPOTrainer.odds_ratio_loss(fake, c, r)
    fake.concatenated_forward = lambda model, batch: (chosen, rejected, torch.zeros(8, 2, 3), torch.zeros(8, 2, 3),
                                                      nll)
    loss, metrics = orpo.ORPOTrainer.get_batch_loss_metrics(fake, None, {})
    assert float(nll + out.losses.mean()) == pytest.approx(float(loss), rel=1e-5)
    assert float((out.chosen_rewards > out.rejected_rewards).float().mean()) == \
        pytest.approx(metrics["rewards/accuracies"])
    torch.testing.assert_close(log1mexp(chosen), orpo.log1mexp(chosen), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("fields, message", [
    ({"loss_type": "hinge"}, r"loss_type='hinge' is not one of \('sigmoid', 'ipo'\)"),
    ({"algorithm": "ppo"}, r"algorithm='ppo' is not one of \('dpo', 'orpo', 'kto', 'simpo', 'reward'\)"),
    ({"beta": 0.0}, r"beta=0.0 must be a finite number > 0"),
    ({"label_smoothing": 0.5}, r"label_smoothing=0.5 must be a number in \[0, 0.5\)"),
    ({"loss_type": "ipo", "label_smoothing": 0.1}, r"label_smoothing=0.1 applies to loss_type='sigmoid' only"),
    ({"algorithm": "orpo", "precompute_ref": True}, r"ORPO has no reference model"),
])
def test_bad_settings_name_the_value(fields, message):
    with pytest.raises(ConfigError, match=message):
        PreferenceSettings(**fields)
