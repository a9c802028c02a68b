"""KTO and SimPO on the real model (`make test-real`): SmolLM2-135M-Instruct under LoRA on the generated preference
pairs (the instruction task's right answer chosen, a wrong one rejected; KTO on them split into desirable and
undesirable completions), a few steps each. On the held-out prompts, which never train, the chosen answer's summed
log-probability margin over the rejected one rises on most pairs, and the model prefers the chosen answer on no
fewer of them. Each test prints its figures and its seconds (wall and this process's CPU)."""

from __future__ import annotations

import time

import pytest
import torch

from tpu_helpers.models import smollm2

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]  # one_thread: tests/conftest.py

# Each method's settings and the fewest steps that show the margin. KTO's held-out pairs are the first 48 of the 69:
# its reference scores them once more than SimPO's (no reference) and each step runs the reference's forward too.
SETTINGS = {"kto": dict(beta=0.1, steps=5), "simpo": dict(beta=2.0, simpo_gamma=0.5, cpo_alpha=0.0, steps=8)}
HELD_PAIRS = {"kto": 48, "simpo": None}


@pytest.mark.parametrize("algorithm", sorted(SETTINGS))
def test_kto_and_simpo_raise_the_real_models_held_out_log_prob_margin(smollm2_dir, tmp_path, algorithm):
    from tpu_helpers.recipes.preference import Preference, PreferenceConfig

    job = Preference(PreferenceConfig(
        model=smollm2.SMOLLM2, algorithm=algorithm, method="lora", lora_targets="all-linear", lora_r=8, lora_alpha=16,
        lr=2e-3, warmup_steps=1, batch_size=8, seq_len=40, log_every=1, save_every=100, eval_every=100,
        val_fraction=0.05, max_records=400, device="cpu", export_merged=False, out_dir=str(tmp_path / algorithm),
        **SETTINGS[algorithm]), progress=False)
    t0, cpu0 = time.time(), time.process_time()
    if HELD_PAIRS[algorithm]:  # the recipe's held-out rows (what the reference's table is made of), the first ones
        job.held_rows = job.held_rows.select(range(HELD_PAIRS[algorithm]))
    before = job.trainer.score_pairs(job.held_rows)["logps"]
    job.train()
    after = job.trainer.score_pairs(job.held_rows)["logps"]
    margin_before, margin_after = before[:, 0] - before[:, 1], after[:, 0] - after[:, 1]
    raised = float((margin_after > margin_before).float().mean())
    acc_before, acc_after = (float((m > 0).float().mean()) for m in (margin_before, margin_after))
    items = "completions" if algorithm == "kto" else "pairs"
    print(f"\n{algorithm.upper()}, {job.config.steps} steps of 8 {items} under LoRA: the log-prob margin rose on "
          f"{raised:.2f} of {len(after)} held-out pairs (mean {float(margin_before.mean()):.2f} -> "
          f"{float(margin_after.mean()):.2f}), chosen preferred on {acc_before:.2f} -> {acc_after:.2f} "
          f"({time.time() - t0:.0f} s, {time.process_time() - cpu0:.0f} s CPU); losses "
          f"{[round(r['loss'], 3) for r in job.history.train]}")
    assert len(after) >= 48 and torch.isfinite(after).all()
    assert raised > 0.5 and float(margin_after.mean()) > float(margin_before.mean())
    assert acc_after >= acc_before  # the chosen answer preferred on no fewer pairs
