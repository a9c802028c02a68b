"""Preference tuning (algorithms/preference.py, recipes/preference.py): DPO and ORPO strict on XLA:CPU (no
recompilation after warm-up, host reads only at log steps and saves) with grad_accum 2 and gradient checkpointing;
the held-out preference accuracy rises on the offline task; a precomputed reference trains as the live one does;
kill and resume bit-identical with a precomputed reference; bad input named."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tests.support import StepCounters, StopAt, assert_same_trainable_weights
from tpu_helpers.config import ConfigError, config_from_parameters
from tpu_helpers.models import lm_head
from tpu_helpers.recipes.preference import Preference, PreferenceConfig


def _config(tmp_path, device="cpu", **overrides):
    base = dict(device=device, steps=4, batch_size=4, seq_len=40, lr=1e-2, beta=0.5, warmup_steps=1, log_every=2,
                save_every=2, eval_every=100, out_dir=str(tmp_path / "run"), max_records=48, val_fraction=0.2,
                xla_checks="strict" if device == "xla" else "off", lora_r=4)
    return PreferenceConfig(**{**base, **overrides})


def _job(tmp_path, device="cpu", *, backend=None, callbacks=None, **overrides):
    return Preference(_config(tmp_path, device, **overrides), backend=backend, progress=False, callbacks=callbacks)


@pytest.mark.xla
@pytest.mark.parametrize("algorithm, method", [("dpo", "lora"), ("orpo", "full")])
def test_strict_xla_with_accumulation_and_checkpointing_reads_only_at_logs_and_saves(tmp_path, algorithm, method):
    from tests.support import XLA_BACKEND

    counters = StepCounters()
    job = _job(tmp_path, "xla", backend=XLA_BACKEND, callbacks=[counters], algorithm=algorithm, method=method,
               steps=6, log_every=2, save_every=4, grad_accum=2, gradient_checkpointing=True, lr=3e-3)
    report = job.train()  # xla_checks="strict": a recompilation or an undeclared host read after warm-up raises
    steps = counters.steps
    assert all(s["compilations"] == 0 for k, s in steps.items() if k > 3), steps
    for k, s in steps.items():
        # A log step reads the step's figures (one window: loss, gradient norm, the reward sums); the last step
        # also evaluates (one read); the step after the save at 4 reads the checkpoint's tensors.
        if k != 5:
            assert s["device_to_host_transfers"] == (1 if k % 2 == 0 else 0) + (k == 6), (k, steps)
    assert report.xla["problems"] == [] and report.xla["cpu_fallback_ops"] == {}
    records = job.history.train
    assert [r["step"] for r in records] == [2, 4, 6]
    for r in records:
        assert 0 <= r["rewards/accuracy"] <= 1
        assert r["rewards/margin"] == pytest.approx(r["rewards/chosen"] - r["rewards/rejected"], abs=1e-5)
    if algorithm == "dpo":  # under LoRA the reference is the adapter-disabled model: at step 0 the policy itself
        assert abs(records[0]["rewards/margin"]) < 1.0
    print(f"{algorithm} strict on XLA:CPU: compilations {report.xla['compilations']} (steps 1-3: "
          f"{[steps[k]['compilations'] for k in (1, 2, 3)]}), transfers per step "
          f"{[steps[k]['device_to_host_transfers'] for k in sorted(steps)]}")


def test_held_out_preference_accuracy_rises_on_the_offline_task(tmp_path):
    """Full DPO of the tiny model on the generated pairs: on the unseen held-out prompts the chosen answer wins more
    often (the rejected answers are mostly of the wrong kind, a letter for a sum). On the CPU: reward accuracy 0 ->
    0.78 and log-probability accuracy 0.36 -> 0.71 over 40 steps."""
    job = _job(tmp_path, method="full", lr=3e-3, beta=0.1, steps=40, batch_size=8, log_every=5, save_every=100,
               max_records=400, val_fraction=0.05)
    before = job.preference_accuracy()
    assert before["accuracy"] == 0.0 and before["margin"] == 0.0  # the policy is the reference: every pair a tie
    job.train()
    after = job.preference_accuracy()
    assert after["pairs"] == before["pairs"] > 50
    assert after["accuracy"] > 0.6 and after["margin"] > 0, after
    assert after["logp_accuracy"] > before["logp_accuracy"] + 0.15, (before, after)
    train_acc = [r["rewards/accuracy"] for r in job.history.train]
    assert sum(train_acc[-3:]) / 3 > sum(train_acc[:2]) / 2, train_acc
    print(f"held-out preference accuracy {before['accuracy']:.2f} -> {after['accuracy']:.2f}, log-prob accuracy "
          f"{before['logp_accuracy']:.2f} -> {after['logp_accuracy']:.2f}")


def test_a_precomputed_reference_trains_as_the_live_one(tmp_path):
    live = _job(tmp_path / "live", method="full", steps=4, log_every=1)
    live.train()
    pre = _job(tmp_path / "pre", method="full", steps=4, log_every=1, precompute_ref=True)
    pre.train()
    assert pre.trainer.ref_model is None and pre.trainer.ref_tables["train"].shape == (len(pre.train_data), 2)
    for a, b in zip(live.history.train, pre.history.train, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5) and a["rewards/margin"] == pytest.approx(
            b["rewards/margin"], rel=1e-4, abs=1e-6)
    # The table is the reference's (the start model's) summed answer log-probabilities.
    from transformers import AutoModelForCausalLM

    from tpu_helpers.algorithms.preference import pair_logps, stack_pairs

    base = AutoModelForCausalLM.from_pretrained(pre.source, attn_implementation="eager").eval()
    rows = stack_pairs({k: getattr(pre.train_data, k)[:3] for k in ("input_ids", "attention_mask", "labels")})
    with torch.no_grad():
        want = torch.stack(pair_logps(base, rows)[0].chunk(2), 1)
    torch.testing.assert_close(pre.trainer.ref_tables["train"][:3], want, atol=1e-4, rtol=1e-4)


def test_the_chunked_log_probabilities_train_as_the_whole_logits(tmp_path):
    # LOSS_CHUNK 16 splits each micro-batch's 2 x 4 x 40 positions into 20 chunks (models/lm_head.py), policy and
    # reference alike; the losses and margins follow the whole-logits run to float32 rounding.
    whole = _job(tmp_path / "whole", steps=3, log_every=1, loss_chunk=0)
    whole.train()
    chunked = _job(tmp_path / "chunked", steps=3, log_every=1, loss_chunk=16)
    chunked.train()
    assert lm_head.chunk_size(chunked.model, 2 * 4 * 40, chunked.model.config.vocab_size) == 16
    for a, b in zip(whole.history.train, chunked.history.train, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5) and a["rewards/margin"] == pytest.approx(
            b["rewards/margin"], rel=1e-3, abs=1e-5)


def test_dpo_on_a_4bit_base_takes_the_adapter_off_base_as_its_reference(tmp_path):
    # QLoRA: the policy's base and the reference are the same NF4 layers (the adapter off), so the first step's
    # loss is log 2 exactly as with a full-precision base; the plan counts the 4-bit base.
    from tpu_helpers.models.quant4 import Linear4bit

    job = _job(tmp_path, steps=2, log_every=1, quantize_base="nf4", quantize_group_size=32)
    assert any("4-bit base (nf4" in n for n in job.plan().estimate.notes)
    job.train()
    assert any(isinstance(m, Linear4bit) for m in job.model.modules())
    losses = [r["loss"] for r in job.history.train]
    assert losses[0] == pytest.approx(math.log(2), abs=1e-5) and all(math.isfinite(x) for x in losses)
    assert losses[1] < losses[0]  # one update on the 4-bit base moved the next pairs the right way


def test_kill_and_resume_with_a_precomputed_reference_is_bit_identical(tmp_path):
    opts = dict(steps=6, save_every=3, log_every=1, precompute_ref=True)
    whole = _job(tmp_path / "a", **opts)
    whole.train()
    first = _job(tmp_path / "b", callbacks=[StopAt(3)], **opts)
    first.train()
    assert first.trainer.step == 3
    resumed = _job(tmp_path / "b", **opts)  # a new process's job: the reference's table is computed again
    report = resumed.train()
    assert report.resumed_from == 3
    assert_same_trainable_weights(whole.model, resumed.model)
    keys = ("step", "loss", "rewards/chosen", "rewards/rejected", "rewards/accuracy")
    assert [{k: r.get(k) for k in keys} for r in whole.history.train] == \
           [{k: r.get(k) for k in keys} for r in resumed.history.train]


def _write(tmp_path, records):
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_bad_preference_input_names_the_record_and_value(tmp_path):
    with pytest.raises(ConfigError, match=r"LOSS_TYPE='hinge' is not one of \('sigmoid', 'ipo'\)"):
        config_from_parameters({"LOSS_TYPE": "hinge"}, base=PreferenceConfig())
    with pytest.raises(ConfigError, match=r"ALGORITHM='ppo' is not one of \('dpo', 'orpo', 'kto', 'simpo', 'reward'\)"):
        config_from_parameters({"ALGORITHM": "ppo"}, base=PreferenceConfig())
    with pytest.raises(ConfigError, match=r"METHOD='distill' is not one of \('lora', 'full'\) for preference"):
        config_from_parameters({"METHOD": "distill"}, base=PreferenceConfig())
    good = [{"prompt": f"What is {a} plus 1?", "chosen": str(a + 1), "rejected": "x"} for a in range(8)]
    cases = [
        ({"prompt": "What is 3 plus 1?", "chosen": "4"}, r"record 3 has no rejected \(its fields: \['chosen', "
                                                         r"'prompt'\]\)"),
        ({"prompt": "What is 3 plus 1?", "rejected": "5"}, r"record 3 has no chosen"),
        ({"prompt": "What is 3 plus 1?", "chosen": "4", "rejected": "4"},
         r"record 3: chosen is identical to rejected \('4'\)"),
        ({"prompt": "long " * 60, "chosen": "4", "rejected": "5"},
         r"record 3: its prompt is \d+ tokens, which leaves no room for an answer in SEQ_LEN=40 \('long long"),
    ]
    for bad, message in cases:
        records = good[:3] + [bad] + good[3:]
        job = _job(tmp_path, dataset=_write(tmp_path, records))
        with pytest.raises(ConfigError, match=message):
            _ = job.train_data


def test_sibling_recipes_refuse_each_others_fields_by_name():
    from tpu_helpers.recipes.finetune import FinetuneConfig
    from tpu_helpers.recipes.grpo import GRPOConfig

    for config, field, owner in ((PreferenceConfig, "num_generations", "GRPOConfig"),
                                 (PreferenceConfig, "teacher", "FinetuneConfig"),
                                 (GRPOConfig, "orpo_lambda", "PreferenceConfig"),
                                 (FinetuneConfig, "precompute_ref", "PreferenceConfig")):
        with pytest.raises(ConfigError, match=rf"'{field}' is a setting of {owner}, not of {config.__name__}"):
            config(**{field: None})
