"""The GRPO notebook under papermill with the offline default (the tiny Qwen2 briefly fine-tuned here, then GRPO on
generated sums), on the CPU and on XLA:CPU, with tiny parameters; its results, curves and exports."""

from __future__ import annotations

import json

import pytest
import torch

from tests.support import tensorboard_run, tensorboard_scalars, tensorboard_texts
from tpu_helpers.config import config_from_parameters
from tpu_helpers.launch.runner import declared_parameters, run_notebook
from tpu_helpers.platform.targets import TARGETS
from tpu_helpers.recipes.grpo import GRPOConfig, curves_figure
from tpu_helpers.training.results import render_png

pytestmark = pytest.mark.notebooks

TINY = {"SFT_STEPS": 30, "STEPS": 6, "BATCH_SIZE": 4, "NUM_GENERATIONS": 4, "LOG_EVERY": 2, "SAVE_EVERY": 3,
        "WARMUP_STEPS": 1, "NUM_SAMPLES": 4, "LORA_R": 4}


def _run(notebooks, tmp_path, target, **params):
    out_dir = tmp_path / "out"
    result = run_notebook(notebooks["grpo_llm"], target=target, runs_dir=tmp_path / "runs",
                          params={**TINY, "OUT_DIR": str(out_dir), **params})
    assert result.ok, result.error
    return json.loads((out_dir / "results.json").read_text()), out_dir, result


def _check(results, out_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    report = results["report"]
    assert report["steps"] == 6 and results["plan"]["fits"], report
    assert results["config"]["start_from"] == "sft" and (out_dir / "sft" / "merged" / "config.json").is_file()
    curves = results["curves"]
    assert curves["step"] == [2, 4, 6] and all(0 <= r <= 1 for r in curves["reward"]) and curves["kl"][0] >= 0
    reward = results["reward"]
    assert 0 <= reward["before"] <= 1 and 0 <= reward["after"] <= 1
    # What a headless run leaves besides results.json: the notebook's reward / length / KL / loss figure, drawn from
    # the run's curves (re-drawn from results.json: the same PNG), and the generic loss.png.
    assert (out_dir / "grpo.png").read_bytes() == render_png(curves_figure(curves))
    assert (out_dir / "loss.png").is_file()
    assert len(results["samples_after"]["rows"]) == 100  # every held-out sum
    # The adapter goes on the start model (the SFT'd one), and the merged export equals the two together.
    start = json.loads((out_dir / "merged" / "tpu_helpers.json").read_text())["base_model"]
    assert start.endswith("sft/merged")
    merged = AutoModelForCausalLM.from_pretrained(results["exports"]["merged"]).eval()
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(start),
                                        results["exports"]["adapter"]).eval()
    ids = torch.tensor([[1, 87, 85, 269, 201, 400]])
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, adapted(input_ids=ids).logits, atol=1e-4, rtol=1e-4)
    return report


def test_grpo_notebook_on_cpu_watched_in_tensorboard(notebooks, tmp_path):
    results, out_dir, _ = _run(notebooks, tmp_path, "cpu", TRACKERS="tensorboard")
    report = _check(results, out_dir)
    assert report["device"].startswith("CPU")
    # TRACKERS: the reward and KL curves, and the held-out completions before and after as tables.
    log_dir = tensorboard_run(out_dir)
    scalars = tensorboard_scalars(log_dir)
    curves = results["curves"]
    assert scalars["train/reward"] == [(s, pytest.approx(r, rel=1e-6)) for s, r in zip(curves["step"],
                                                                                     curves["reward"], strict=True)]
    assert [s for s, _ in scalars["train/kl"]] == curves["step"]
    texts = tensorboard_texts(log_dir)
    for when in ("before", "after"):
        (step, table), = texts[f"samples/{when}"]
        assert step == 6 and table.startswith("| prompt | answer | completion | reward |")
    assert f"samples/reward_after: {results['reward']['after']}" in texts["summary"][-1][1]


@pytest.mark.xla
def test_grpo_notebook_on_xla_cpu(notebooks, tmp_path):
    results, out_dir, run = _run(notebooks, tmp_path, "xla-cpu")
    report = _check(results, out_dir)
    assert report["device"].startswith("XLA:CPU") and report["xla"]["problems"] == []
    # Held-out samples use the training generation's shapes and sampling: after training no new graph at all.
    assert results["samples_after"]["compilations"] == 0
    text = (run.directory / "grpo_llm.ipynb").read_text()
    assert "KV cache" in text and "mean reward" in text
    print(f"grpo_llm on XLA:CPU: {report['seconds']:.1f} s of GRPO, {report['xla']['compilations']} compilations, "
          f"reward {results['reward']['before']:.2f} -> {results['reward']['after']:.2f}")


@pytest.mark.parametrize("target", sorted(t for t in TARGETS if "grpo_llm" in TARGETS[t].notebooks))
def test_every_target_preset_is_a_valid_grpo_configuration(notebooks, target):
    declared = declared_parameters(notebooks["grpo_llm"])
    assert set(TARGETS[target].notebooks["grpo_llm"]) <= set(declared), target
    config = config_from_parameters(TARGETS[target].params_for("grpo_llm", declared), base=GRPOConfig())
    assert config.num_generations >= 2 and config.seq_len == config.max_prompt_len + config.max_new_tokens
