"""The preference-tuning notebook under papermill with the offline default (the tiny Qwen2 on generated pairs), on
the CPU (DPO under LoRA) and on XLA:CPU (ORPO, full fine-tuning), with tiny parameters; its results read back:
the held-out preference accuracy rose, the curves and figure, the exports exist and reload."""

from __future__ import annotations

import json

import pytest
import torch

from tpu_helpers.config import config_from_parameters
from tpu_helpers.launch.runner import declared_parameters, run_notebook
from tpu_helpers.platform.targets import TARGETS
from tpu_helpers.recipes.preference import PreferenceConfig, curves_figure
from tpu_helpers.training.results import render_png

pytestmark = pytest.mark.notebooks

TINY = {"STEPS": 20, "BATCH_SIZE": 8, "LOG_EVERY": 5, "SAVE_EVERY": 10, "EVAL_EVERY": 10, "WARMUP_STEPS": 2,
        "NUM_SAMPLES": 4, "LORA_R": 4, "MAX_RECORDS": 400, "LR": 1e-2, "BETA": 0.5}


def _run(notebooks, tmp_path, target, **params):
    out_dir = tmp_path / "out"
    result = run_notebook(notebooks["preference_llm"], target=target, runs_dir=tmp_path / "runs",
                          params={**TINY, "OUT_DIR": str(out_dir), **params})
    assert result.ok, result.error
    return json.loads((out_dir / "results.json").read_text()), out_dir, result


def _check(results, out_dir, steps):
    from transformers import AutoModelForCausalLM

    report = results["report"]
    assert report["steps"] == steps and results["plan"]["fits"], report
    acc = results["accuracy"]
    assert acc["after"]["pairs"] == acc["before"]["pairs"] > 50
    assert acc["after"]["accuracy"] > acc["before"]["accuracy"], acc  # on unseen held-out prompts
    curves = results["curves"]
    assert curves["step"] == list(range(5, steps + 1, 5))
    assert all(0 <= a <= 1 for a in curves["rewards/accuracy"])
    assert (out_dir / "preference.png").read_bytes() == render_png(curves_figure(curves))
    assert len(results["samples_after"]["rows"]) == 4
    merged = AutoModelForCausalLM.from_pretrained(results["exports"]["merged"]).eval()
    with torch.no_grad():
        assert torch.isfinite(merged(input_ids=torch.tensor([[1, 87, 85, 269]])).logits).all()
    return report, acc


def test_dpo_notebook_on_cpu_held_out_accuracy_rises_and_the_adapter_reloads(notebooks, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    results, out_dir, _ = _run(notebooks, tmp_path, "cpu")
    report, acc = _check(results, out_dir, 20)
    assert report["device"].startswith("CPU")
    assert acc["after"]["logp_accuracy"] > acc["before"]["logp_accuracy"], acc
    # The merged export is the base with the adapter: the same logits either way.
    base = json.loads((out_dir / "merged" / "tpu_helpers.json").read_text())["base_model"]
    merged = AutoModelForCausalLM.from_pretrained(results["exports"]["merged"]).eval()
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base),
                                        results["exports"]["adapter"]).eval()
    ids = torch.tensor([[1, 87, 85, 269, 201, 400]])
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, adapted(input_ids=ids).logits, atol=1e-4, rtol=1e-4)


@pytest.mark.xla
def test_orpo_notebook_on_xla_cpu(notebooks, tmp_path):
    results, out_dir, run = _run(notebooks, tmp_path, "xla-cpu", ALGORITHM="orpo", METHOD="full", STEPS=10,
                                 LR=3e-3, ORPO_LAMBDA=1.0)
    report, acc = _check(results, out_dir, 10)
    assert report["device"].startswith("XLA:CPU") and report["xla"]["problems"] == []
    text = (run.directory / "preference_llm.ipynb").read_text()
    assert "no reference (ORPO, SimPO)" in text and "preference accuracy" in text
    print(f"preference_llm (ORPO) on XLA:CPU: {report['seconds']:.1f} s of training, "
          f"{report['xla']['compilations']} compilations, accuracy {acc['before']['accuracy']:.2f} -> "
          f"{acc['after']['accuracy']:.2f}")


@pytest.mark.parametrize("target", sorted(t for t in TARGETS if "preference_llm" in TARGETS[t].notebooks))
def test_every_target_preset_is_a_valid_preference_configuration(notebooks, target):
    declared = declared_parameters(notebooks["preference_llm"])
    assert set(TARGETS[target].notebooks["preference_llm"]) <= set(declared), target
    config = config_from_parameters(TARGETS[target].params_for("preference_llm", declared), base=PreferenceConfig())
    assert config.preference.algorithm in ("dpo", "orpo")


def test_reward_model_notebook_prints_the_held_out_pair_accuracy_and_exports_a_classifier(notebooks, tmp_path):
    """ALGORITHM "reward": the printed and saved held-out pair accuracy, and exports that load with plain
    transformers as a sequence classifier (merged) and as its adapter with the head (PEFT)."""
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification

    results, out_dir, run = _run(notebooks, tmp_path, "cpu", ALGORITHM="reward", METHOD="lora", STEPS=10, LR=1e-2,
                                 CENTER_REWARDS_COEFFICIENT=0.01)
    acc = results["accuracy"]
    assert acc["after"]["pairs"] == acc["before"]["pairs"] > 50 and acc["after"]["logp_accuracy"] is None
    text = (run.directory / "preference_llm.ipynb").read_text()
    printed = f"preference accuracy {round(acc['before']['accuracy'], 3)} -> {round(acc['after']['accuracy'], 3)}"
    assert printed in text, printed  # the held-out pair accuracy, A -> B
    ids = torch.tensor([[1, 87, 85, 269, 201, 400]])
    merged = AutoModelForSequenceClassification.from_pretrained(results["exports"]["merged"]).eval()
    base = json.loads((out_dir / "merged" / "tpu_helpers.json").read_text())["base_model"]
    adapted = PeftModel.from_pretrained(AutoModelForSequenceClassification.from_pretrained(base, num_labels=1),
                                        results["exports"]["adapter"]).eval()
    adapted.config.pad_token_id = merged.config.pad_token_id
    with torch.no_grad():
        score = merged(input_ids=ids).logits
        torch.testing.assert_close(score, adapted(input_ids=ids).logits, atol=1e-4, rtol=1e-4)
    assert score.shape == (1, 1)
