"""The preference memory plan (memory/preference_plan.py): two rows per pair, the reference's copy and forward
unless precomputed, none for ORPO; and the recipe's plan from its config."""

from __future__ import annotations

from tests.memory.test_grpo_plan import QWEN_05B
from tpu_helpers.memory.hf_plan import hf_finetune_estimate, meta_model
from tpu_helpers.memory.preference_plan import preference_estimate


def test_pairs_are_two_rows_and_the_reference_costs_a_copy_and_a_forward_unless_precomputed():
    kw = dict(precision="bf16", gradient_checkpointing=True, grad_accum=2, loss_chunk=0)  # the whole logits
    params = sum(p.numel() for p in meta_model(QWEN_05B).parameters())
    # 8 pairs over 2 micro-batches: 8 rows of 512 tokens each in the step, as fine-tuning counts them.
    for method in ("lora", "full"):
        orpo = preference_estimate(QWEN_05B, 8, 512, method=method, reference=False, **kw)
        sft = hf_finetune_estimate(QWEN_05B, 8, 512, method=method, **kw)
        assert orpo.phases == sft.phases and orpo.peak_bytes == sft.peak_bytes
    live = preference_estimate(QWEN_05B, 8, 512, method="full", reference=True, **kw)
    pre = preference_estimate(QWEN_05B, 8, 512, method="full", reference=False, precomputed_pairs=20000, **kw)
    sft = hf_finetune_estimate(QWEN_05B, 8, 512, method="full", **kw)
    end = "the end of the backward"
    assert live.phases[end]["params"] == sft.phases[end]["params"] + 2 * params  # the frozen bf16 copy
    assert pre.phases[end]["params"] == sft.phases[end]["params"] + 20000 * 2 * 4  # two floats per pair
    forward = live.phases["the reference's forward"]
    assert forward["temporaries"] == 8 * 8 * 512 * 151936 and forward["grads"] > 0  # fp32 logits + log-softmax
    chunked = preference_estimate(QWEN_05B, 8, 512, method="full", reference=True, **{**kw, "loss_chunk": 256})
    assert chunked.phases["the reference's forward"]["temporaries"] == 8 * 256 * 151936  # one chunk's, as the step's
    assert chunked.peak_bytes < live.peak_bytes
    lora = preference_estimate(QWEN_05B, 8, 512, method="lora", reference=True, **kw)
    assert lora.phases[end]["params"] == hf_finetune_estimate(QWEN_05B, 8, 512, method="lora",
                                                              **kw).phases[end]["params"]  # adapter off: no copy
    assert live.peak_bytes > pre.peak_bytes and "adapter-disabled" in " ".join(lora.notes)


def test_the_recipes_plan_follows_algorithm_and_precompute_ref(tmp_path):
    from tpu_helpers.recipes.preference import Preference, PreferenceConfig

    def peak(**kw):
        cfg = PreferenceConfig(device="cpu", out_dir=str(tmp_path), method="full", **kw)
        return Preference(cfg, progress=False).plan().estimate

    dpo, orpo, pre = peak(), peak(algorithm="orpo"), peak(precompute_ref=True)
    assert dpo.peak_bytes > pre.peak_bytes > orpo.peak_bytes
    assert any("reference: precomputed" in n for n in pre.notes) and any("no reference (ORPO, SimPO)" in n
                                                                           for n in orpo.notes)
    # KTO's completions are two rows each with DPO's reference; SimPO has none, as ORPO.
    assert peak(algorithm="kto").peak_bytes == dpo.peak_bytes and peak(algorithm="simpo").peak_bytes == orpo.peak_bytes
