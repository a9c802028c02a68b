"""GRPO's loss variants (algorithms/grpo_loss.py) against TRL 1.16's own code on the same tensors: its
`GRPOTrainer._compute_loss` (each LOSS_TYPE x IMPORTANCE, with and without clip-higher, with and without the KL term;
split over micro-batches and over processes) and the advantages of its `_generate_and_score_completions` (each
SCALE_REWARDS, on one process and on the second of two). TRL's methods run bound to a plain namespace that holds the
attributes they read; the model's forward is replaced by the log-probabilities under test. No model is built here."""

from __future__ import annotations

import collections
import types

import pytest
import torch
from trl.trainer import grpo_trainer  # the dev set's TRL 1.16: the reference (the package never imports it)

from tpu_helpers.algorithms.grpo_loss import (
    IMPORTANCE_LEVELS,
    LOSS_TYPES,
    SCALE_REWARDS,
    group_advantages,
    micro_batch_loss,
    policy_terms,
    step_divisor,
)

TRL = grpo_trainer.GRPOTrainer
EPS = 0.2


class _Accelerator:
    """What TRL's methods ask of accelerate, for process `index` of `processes` (gathers hand back the input: the
    test passes what every process would have gathered)."""

    device = torch.device("cpu")

    def __init__(self, processes: int = 1, index: int = 0) -> None:
        self.num_processes, self.process_index = processes, index

    def gather(self, x):
        return x

    def reduce(self, x, reduction="sum"):
        return x


def _trl_loss(logp, old, ref, adv, mask, *, loss_type, importance, epsilon_high, beta, accum=1, items=None,
              processes=1):
    """TRL's `_compute_loss` on these tensors: one micro-batch of `accum` (its loss already divided for the
    accumulation), `items` its num_items_in_batch (the generation batch's tokens over every process)."""
    t = types.SimpleNamespace(
        args=types.SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=accum),
        accelerator=_Accelerator(processes), model=types.SimpleNamespace(training=True), top_entropy_quantile=1.0,
        off_policy_mask_threshold=None, importance_sampling_level=importance, beta=beta, loss_type=loss_type,
        epsilon_low=EPS, epsilon_high=EPS if epsilon_high is None else epsilon_high, use_vllm=False,
        vllm_importance_sampling_correction=False, current_gradient_accumulation_steps=accum,
        max_completion_length=mask.shape[1], _entropy_bonus_enabled=False, aux_loss_enabled=False,
        _metrics={"train": collections.defaultdict(list)})
    t._get_per_token_logps_and_entropies = lambda *a, **k: (logp, torch.zeros_like(logp), None)
    rows = mask.shape[0]
    inputs = {"prompt_ids": torch.zeros(rows, 2, dtype=torch.long), "prompt_mask": torch.ones(rows, 2, dtype=torch.long),
              "completion_ids": torch.zeros_like(mask), "completion_mask": mask, "advantages": adv,
              "old_per_token_logps": old, "num_items_in_batch": mask.sum() if items is None else items}
    if beta:
        inputs["ref_per_token_logps"] = ref
    loss = TRL._compute_loss(t, None, inputs)
    return loss, t._metrics["train"]


def _batch():
    """Six answers of up to 5 tokens, right-padded (lengths 5, 2, 4, 1, 3, 5: 11 and 9 tokens
    in each half), advantages of both signs, and
    ratios that clip on both sides, some only without clip-higher, per token and per sequence."""
    g = torch.Generator().manual_seed(0)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 1, 0], [1, 0, 0, 0, 0], [1, 1, 1, 0, 0],
                         [1, 1, 1, 1, 1]])
    logp = -3 * torch.rand(6, 5, generator=g)
    noise = 0.6 * (torch.rand(6, 5, generator=g) - 0.5)
    noise = noise - (noise * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True)
    # log(ratio) per row: 1.25 (clipped only at 1.2), 0.74 (A < 0: clipped), 1.35 (clipped at 1.2 and 1.28), ...
    offsets = torch.tensor([0.22, -0.3, 0.3, 0.0, 0.1, -0.1]).unsqueeze(-1)
    old = logp - offsets - noise
    ref = logp + 0.5 * (torch.rand(6, 5, generator=g) - 0.5)
    adv = torch.tensor([1.2, -0.7, 0.3, -1.1, 0.9, -0.2])
    return logp, old, ref, adv, mask


def _ours(logp, old, ref, adv, mask, *, loss_type, importance, epsilon_high, beta, reduce=None):
    per_token, kl, clipped = policy_terms(logp, old, ref if beta else None, adv, mask, clip_eps=EPS,
                                          epsilon_high=epsilon_high, kl_beta=beta,
                                          importance=IMPORTANCE_LEVELS[importance])
    chosen = LOSS_TYPES[loss_type]
    loss = micro_batch_loss(chosen, per_token, mask, step_divisor(chosen, mask, mask.shape[1], reduce))
    return loss, kl, clipped


@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("epsilon_high", [None, 0.28])
@pytest.mark.parametrize("importance", IMPORTANCE_LEVELS)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_each_loss_type_is_trls_loss_gradient_kl_and_clip_share(loss_type, importance, epsilon_high, beta):
    logp, old, ref, adv, mask = _batch()
    opts = dict(loss_type=loss_type, importance=importance, epsilon_high=epsilon_high, beta=beta)
    theirs_logp, ours_logp = logp.clone().requires_grad_(), logp.clone().requires_grad_()
    theirs, metrics = _trl_loss(theirs_logp, old, ref, adv, mask, **opts)
    ours, kl, clipped = _ours(ours_logp, old, ref, adv, mask, **opts)
    theirs.backward()
    ours.backward()
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours_logp.grad, theirs_logp.grad, rtol=1e-5, atol=1e-7)
    m = mask.float()
    if beta:  # the logged KL: TRL's mean over the completion tokens
        assert (kl * m).sum().item() / m.sum().item() == pytest.approx(metrics["kl"][0], rel=1e-5)
    # The clipped share: TRL's per token, or per row with the sequence ratio (one value per row, on all its tokens).
    share = (clipped * m).sum() / m.sum() if importance == "token" else clipped[:, 0].mean()
    assert share.item() == pytest.approx(metrics["clip_ratio/region_mean"][0], rel=1e-6)
    # The batch exercises clip-higher: 1.2 < ratio <= 1.28 with A > 0 is clipped only without it.
    assert metrics["clip_ratio/high_mean"][0] > 0
    without = policy_terms(logp, old, None, adv, mask, clip_eps=EPS, kl_beta=0.0,
                           importance=IMPORTANCE_LEVELS[importance])[2]
    assert (clipped * m).sum() < (without * m).sum() if epsilon_high else torch.equal(clipped, without)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_micro_batches_and_processes_add_up_as_trls(loss_type):
    """TRL over 2 accumulated micro-batches (steps_per_generation 2, its default) adds up to the whole step's loss
    here for grpo, dr_grpo and dapo; its bnpo divides each micro-batch by its own token count, which these lengths
    tell apart (this bnpo is TRL's with one micro-batch). Over 2 processes, whose gradients are averaged, each
    process's loss is TRL's on that process: bnpo's divisor the local count, dapo's the mean count (the
    all-reduce, stood in for here by the mean of both processes' counts)."""
    logp, old, ref, adv, mask = _batch()
    opts = dict(loss_type=loss_type, importance="token", epsilon_high=0.28, beta=0.04)
    whole = _ours(logp, old, ref, adv, mask, **opts)[0]
    halves = (slice(0, 3), slice(3, 6))
    accumulated = sum(_trl_loss(logp[h], old[h], ref[h], adv[h], mask[h], accum=2, items=mask.sum(), **opts)[0]
                      for h in halves)
    if loss_type == "bnpo":
        assert abs(accumulated.item() - whole.item()) > 1e-3  # TRL's per-micro-batch count: another loss
    else:
        torch.testing.assert_close(accumulated, whole, rtol=1e-5, atol=1e-6)
    counts = [mask[h].sum().float() for h in halves]
    for h in halves:
        theirs = _trl_loss(logp[h], old[h], ref[h], adv[h], mask[h], items=mask.sum(), processes=2, **opts)[0]
        ours = _ours(logp[h], old[h], ref[h], adv[h], mask[h], reduce=lambda _: (counts[0] + counts[1]) / 2,
                     **opts)[0]
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


def _trl_advantages(rewards: list[float], group: int, scale: str, *, processes: int = 1, index: int = 0):
    """TRL's `_generate_and_score_completions` for prompts whose completions got `rewards` (every process's, as
    TRL gathers them): generation and the reward functions replaced by those values; this process's advantages."""
    n = len(rewards) // processes
    t = types.SimpleNamespace(
        accelerator=_Accelerator(processes, index),
        model=types.SimpleNamespace(training=True, is_gradient_checkpointing=False), environment_factories=None,
        tools=None, environments=[], _tokenizer=types.SimpleNamespace(pad_token_id=0), pad_to_multiple_of=None,
        mask_truncated_completions=False,
        args=types.SimpleNamespace(per_device_train_batch_size=n, steps_per_generation=1,
                                   gradient_accumulation_steps=1, gradient_checkpointing_kwargs=None),
        num_iterations=1, use_vllm=False, vllm_importance_sampling_correction=False, beta=0.0,
        multi_objective_aggregation="sum_then_normalize", reward_weights=torch.ones(1), num_generations=group,
        scale_rewards=scale, reward_func_names=["r"], _metrics={"train": collections.defaultdict(list)},
        _logs={"prompt": [], "completion": [], "rewards": collections.defaultdict(list), "advantages": [],
               "extra": collections.defaultdict(list)},
        _pending_extra_logs={}, _pending_metrics={}, log_multimodal=False)
    t._generate = lambda prompts: ([[1, 2]] * n, [[3, 4]] * n, None, ["c"] * n, None, {}, None, None)
    t._calculate_rewards = lambda *a: torch.tensor(rewards).unsqueeze(1)
    return TRL._generate_and_score_completions(t, [{"prompt": "p"}] * n)["advantages"]


@pytest.mark.parametrize("processes", [1, 2])
@pytest.mark.parametrize("scale", SCALE_REWARDS)
def test_advantages_are_trls(monkeypatch, scale, processes):
    # Groups of 4: varied, one all alike (std 0: advantages 0), uneven; two processes hold two groups each.
    rewards = [1.0, 0.0, 0.5, 0.5, 1.0, 1.0, 1.0, 1.0, 0.25, 3.0, 0.0, 0.0, 2.0, 0.0, 1.0, 0.0]
    monkeypatch.setattr(grpo_trainer, "gather_object", lambda x: x)  # accelerate's, for its logs: one process here
    local = slice(8, 16) if processes == 2 else slice(None)
    theirs = _trl_advantages(rewards, 4, scale, processes=processes, index=processes - 1)
    ours = group_advantages(torch.tensor(rewards[local]), 4, scale=SCALE_REWARDS[scale], batch=torch.tensor(rewards))
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
    if scale == "batch" and processes == 2:  # the batch std spans both processes: the local one is another
        assert not torch.allclose(group_advantages(torch.tensor(rewards[local]), 4, scale=SCALE_REWARDS[scale]), theirs)
