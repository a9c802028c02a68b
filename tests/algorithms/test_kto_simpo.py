"""KTO and SimPO in the preference trainer and recipe (algorithms/preference.py, recipes/preference.py): strict on
XLA:CPU with at most DPO's compilations and none after warm-up; the held-out log-probability margin rises on the
offline task; KTO's precomputed reference trains as the live one; bad KTO data named through the recipe."""

from __future__ import annotations

import json

import pytest
import torch

from tests.support import StepCounters
from tpu_helpers.config import ConfigError
from tpu_helpers.recipes.preference import Preference, PreferenceConfig


def _job(tmp_path, device="cpu", *, backend=None, callbacks=None, **overrides):
    base = dict(device=device, steps=4, batch_size=4, seq_len=40, lr=1e-2, beta=0.5, warmup_steps=1, log_every=2,
                save_every=2, eval_every=100, out_dir=str(tmp_path / "run"), max_records=48, val_fraction=0.2,
                xla_checks="strict" if device == "xla" else "off", lora_r=4)
    return Preference(PreferenceConfig(**{**base, **overrides}), backend=backend, progress=False, callbacks=callbacks)


@pytest.mark.xla
def test_strict_xla_kto_and_simpo_compile_at_most_dpos_graphs_and_none_after_warm_up(tmp_path):
    from tests.support import XLA_BACKEND

    compiled = {}
    for algorithm in ("dpo", "kto", "simpo"):
        counters = StepCounters()
        job = _job(tmp_path / algorithm, "xla", backend=XLA_BACKEND, callbacks=[counters], algorithm=algorithm,
                   steps=5, log_every=2, save_every=100, grad_accum=2, lr=3e-3)
        report = job.train()  # xla_checks="strict": a recompilation or an undeclared host read after warm-up raises
        steps = counters.steps
        assert all(s["compilations"] == 0 for k, s in steps.items() if k > 3), (algorithm, steps)
        assert report.xla["problems"] == [] and report.xla["cpu_fallback_ops"] == {}
        compiled[algorithm] = [steps[k]["compilations"] for k in sorted(steps)]
        for r in job.history.train:
            assert 0 <= r["rewards/accuracy"] <= 1
            assert r["rewards/margin"] == pytest.approx(r["rewards/chosen"] - r["rewards/rejected"], abs=1e-5)
        assert ("kl" in job.history.train[-1]) == (algorithm == "kto")
    for algorithm in ("kto", "simpo"):
        assert sum(compiled[algorithm]) <= sum(compiled["dpo"]), compiled
    print(f"graphs compiled per step on XLA:CPU (grad_accum 2, LoRA): {compiled}")


@pytest.mark.parametrize("algorithm, overrides, rise", [
    ("kto", dict(beta=0.1, steps=60, batch_size=16, lr=5e-3), 0.12),
    ("simpo", dict(beta=2.0, simpo_gamma=0.5, cpo_alpha=0.0, steps=30, batch_size=8, lr=3e-3), 0.25),
])
def test_held_out_log_prob_margin_rises_on_the_offline_task(tmp_path, algorithm, overrides, rise):
    """Full fine-tuning of the tiny model on the generated pairs (KTO on them split into labelled completions): on
    the unseen held-out prompts the chosen answer's log-probability beats the rejected one's more often. On the CPU:
    KTO 0.36 -> 0.57 over 60 steps of 16 completions, SimPO 0.36 -> 0.72 over 30 steps of 8 pairs. KTO is the slower
    here: a wrong answer to one prompt is the right answer to another, which unpaired labels cannot tell apart as a
    pair does (150 steps of 16 reach 0.72)."""
    job = _job(tmp_path, method="full", log_every=5, save_every=100, max_records=400, val_fraction=0.05,
               algorithm=algorithm, **overrides)
    before = job.preference_accuracy()
    job.train()
    after = job.preference_accuracy()
    assert after["pairs"] == before["pairs"] > 50
    assert after["logp_accuracy"] > before["logp_accuracy"] + rise, (before, after)
    assert after["accuracy"] > 0.5 and after["margin"] > before["margin"], (before, after)
    print(f"{algorithm}: held-out log-prob accuracy {before['logp_accuracy']:.2f} -> {after['logp_accuracy']:.2f}, "
          f"reward accuracy {before['accuracy']:.2f} -> {after['accuracy']:.2f}")


def test_kto_with_a_precomputed_reference_trains_as_the_live_one(tmp_path):
    live = _job(tmp_path / "live", method="full", steps=4, log_every=1, algorithm="kto")
    live.train()
    pre = _job(tmp_path / "pre", method="full", steps=4, log_every=1, algorithm="kto", precompute_ref=True)
    pre.train()
    assert pre.trainer.ref_model is None and pre.trainer.ref_tables["train"].shape == (len(pre.train_data), 2)
    # Each training pair is a desirable and an undesirable completion.
    assert pre.data_stats["desirable"] == pre.data_stats["undesirable"] == len(pre.train_data) // 2 > 30
    for a, b in zip(live.history.train, pre.history.train, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["kl"] == pytest.approx(b["kl"], rel=1e-4, abs=1e-6)
    assert any(r["kl"] > 0 for r in live.history.train)  # the estimate moved off 0 (and the test could see it)
    # The table's second column is the reference's log-probability of each completion's mismatched row.
    from transformers import AutoModelForCausalLM

    from tpu_helpers.algorithms.preference import pair_logps, stack_pairs

    base = AutoModelForCausalLM.from_pretrained(pre.source, attn_implementation="eager").eval()
    rows = stack_pairs({k: getattr(pre.train_data, k)[:3] for k in ("input_ids", "attention_mask", "labels")})
    with torch.no_grad():
        want = torch.stack(pair_logps(base, rows)[0].chunk(2), 1)
    torch.testing.assert_close(pre.trainer.ref_tables["train"][:3], want, atol=1e-4, rtol=1e-4)


def test_kto_trains_on_unpaired_records_and_pairs_up_their_held_out_ones(tmp_path):
    def unpaired(numbers):
        return [{"prompt": f"What is {a} plus 1?", "completion": answer, "label": label}
                for a in numbers for answer, label in ((str(a + 1), True), ("x", False))]

    train = _write(tmp_path, unpaired(range(30)), "train.jsonl")
    held = unpaired(range(30, 36)) + [{"prompt": "What is 99 plus 1?", "completion": "100", "label": True}]
    job = _job(tmp_path, algorithm="kto", dataset=train, max_records=None, eval_dataset=_write(tmp_path, held),
               steps=2)
    assert job.train_data.desirable is not None and job.data_stats["examples"] == len(job.train_data)
    with pytest.warns(UserWarning, match=r"1 of the 13 held-out \(EVAL_DATASET, 13 records\) records have no partner"):
        pairs, numbers = job.held_pairs
    assert len(pairs) == 6 and numbers == list(range(0, 12, 2))
    assert job.preference_accuracy()["pairs"] == 6
    job.train()
    # Labelled records held out one by one (EVAL_SHARE) rarely pair up: the error says what to give instead.
    job = _job(tmp_path / "share", algorithm="kto", dataset=train, max_records=None, eval_share=0.2)
    with pytest.raises(ConfigError, match=r"none of the 12 held-out \(20% of DATASET, 12 records\) records pairs up"):
        _ = job.held_pairs


def _write(tmp_path, records, name="kto.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


@pytest.mark.parametrize("bad, message", [
    ({"prompt": "What is 3 plus 1?", "completion": "4"},
     r"DATASET='.*kto.jsonl' record 3 has no label \(its fields: \['completion', 'prompt'\]\)"),
    ({"prompt": "What is 3 plus 1?", "completion": "4", "label": "good"},
     r"record 3: label='good' is not a boolean; KTO's label is True"),
])
def test_bad_kto_data_names_the_record_and_value(tmp_path, bad, message):
    good = [{"prompt": f"What is {a} plus 1?", "completion": str(a + 1), "label": a % 2 == 0} for a in range(8)]
    job = _job(tmp_path, algorithm="kto", dataset=_write(tmp_path, good[:3] + [bad] + good[3:]))
    with pytest.raises(ConfigError, match=message):
        _ = job.train_data
