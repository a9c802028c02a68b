"""The fine-tuning notebook under papermill with the offline default (tiny Qwen2, generated task), CPU (with a GGUF
export) and XLA:CPU, with SHARDING="fsdp" on 8 simulated XLA:CPU devices, and distilling from a teacher cache with
int4 QAT."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from tests.support import tensorboard_run, tensorboard_scalars, tensorboard_texts
from tpu_helpers.launch.runner import run_notebook

pytestmark = pytest.mark.notebooks

# The GGUF export where the gguf package is installed (the dev venv); a stack without it (latest) would have the setup
# cell install it into its cached venv, which the stack test forbids.
GGUF = importlib.util.find_spec("gguf") is not None
# EVAL_TASKS where lm-eval is installed (the dev venv), for the same reason: the package's offline task, 4 documents.
LM_EVAL = {"EVAL_TASKS": "sums", "EVAL_LIMIT": 4} if importlib.util.find_spec("lm_eval") is not None else {}

TINY = {"STEPS": 40, "BATCH_SIZE": 16, "SEQ_LEN": 32, "EVAL_EVERY": 20, "WARMUP_STEPS": 5, "LR": 3e-3}


def _run(notebooks, tmp_path, target, **params):
    out_dir = tmp_path / "out"
    result = run_notebook(notebooks["finetune_llm"], target=target, runs_dir=tmp_path / "runs",
                          params={**TINY, "OUT_DIR": str(out_dir), **params})
    assert result.ok, result.error
    return json.loads((out_dir / "results.json").read_text()), out_dir


def _check(results, out_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    report = results["report"]
    assert report["steps"] == 40 and report["final_val_loss"] < report["first_val_loss"] - 0.5, report
    assert results["plan"]["fits"] and results["parameters"]["trainable_share"] < 0.1
    assert results["samples_before"]["exact_match"] is not None and len(results["samples_after"]["rows"]) > 40
    # EXPORT="best": the checkpoint with the lowest validation loss, here the only one (SAVE_EVERY 100 > STEPS).
    assert results["export_weights"]["weights"] == "best" and results["export_weights"]["step"] == 40
    merged = AutoModelForCausalLM.from_pretrained(results["exports"]["merged"]).eval()
    base = AutoModelForCausalLM.from_pretrained(results["config"]["model"] if results["config"]["model"] != "tiny"
                                                else json.loads((out_dir / "merged" / "tpu_helpers.json")
                                                                .read_text())["base_model"])
    adapted = PeftModel.from_pretrained(base, results["exports"]["adapter"]).eval()
    ids = torch.tensor([[1, 87, 85, 269, 201, 400]])
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, adapted(input_ids=ids).logits, atol=1e-4, rtol=1e-4)
    return report


def test_finetune_notebook_on_cpu_watched_in_tensorboard(notebooks, tmp_path):
    results, out_dir = _run(notebooks, tmp_path, "cpu", TRACKERS="tensorboard", **({"EXPORT_GGUF": "q8_0"} if GGUF else {}),
                            **LM_EVAL)
    report = _check(results, out_dir)
    assert report["device"].startswith("CPU")
    if GGUF:  # EXPORT_GGUF: the merged model once more, as a GGUF file beside it (test_gguf_export.py: its answers)
        assert results["exports"]["gguf"] == str(out_dir / "model-q8_0.gguf")
        assert (out_dir / "model-q8_0.gguf").read_bytes()[:4] == b"GGUF"
    # TRACKERS: the curves, the config with the memory plan, and the samples before and after as text tables.
    log_dir = tensorboard_run(out_dir)
    scalars = tensorboard_scalars(log_dir)
    history = results["history"]
    assert scalars["train/loss"] == [(r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in history["train"]]
    assert scalars["eval/loss"] == [(r["step"], pytest.approx(r["val_loss"], rel=1e-6)) for r in history["eval"]]
    texts = tensorboard_texts(log_dir)
    config = json.loads(texts["config"][0][1])
    assert config["method"] == "lora" and config["memory_plan"]["fits"] is True
    for when in ("before", "after"):
        (step, table), = texts[f"samples/{when}"]
        assert step == 40 and table.startswith("| prompt | answer | prediction |")
        first = results[f"samples_{when}"]["rows"][0]
        prediction = json.dumps(first["prediction"])[1:-1]  # newlines shown as \n
        assert f"| {first['prompt']} | {first['answer']} | {prediction} |" in table
    assert f"samples/exact_match_after: {results['samples_after']['exact_match']}" in texts["summary"][-1][1]
    if LM_EVAL:  # EVAL_TASKS: lm-eval on the model before and the merged export after, in results.json and the tracker
        runs = results["eval_tasks"]
        assert runs["after"]["model"] == results["exports"]["merged"] and runs["before"]["documents"] == {"sums": 4}
        after = runs["after"]["scores"]["sums"]["exact_match,last_number"]
        assert f"eval_tasks/sums/exact_match,last_number_after: {after}" in texts["summary"][-1][1]


@pytest.mark.xla
def test_finetune_notebook_on_xla_cpu(notebooks, tmp_path):
    results, out_dir = _run(notebooks, tmp_path, "xla-cpu")
    report = _check(results, out_dir)
    assert report["device"].startswith("XLA:CPU")
    assert report["xla"]["compilations"] <= 4 and report["xla"]["cpu_fallback_ops"] == {}
    # Generation after training reuses its graphs: no compile per token.
    assert results["samples_after"]["compilations"] <= 3


@pytest.mark.xla
def test_finetune_notebook_with_fsdp_on_eight_xla_cpu_devices(notebooks, tmp_path):
    # 2 rows per chip x 8 chips: the 16-row global batch of the one-device runs above.
    results, out_dir = _run(notebooks, tmp_path, "xla-cpu-8", SHARDING="fsdp", BATCH_SIZE=2)
    report = _check(results, out_dir)
    assert report["device"].startswith("XLA:CPU x8 (SPMD)"), report["device"]
    # Training compiles its graphs once. (The CompileTime count also holds a small program per sharded tensor that
    # a checkpoint save gathers to the host: 72 per save here, 24 adapters + 48 Adam moments.)
    assert results["config"]["sharding"] == "fsdp" and report["xla"]["uncached_compiles"] <= 4, report["xla"]
    assert results["sharding"] == {"sharding": "fsdp", "chips": 8, "mesh": [1, 8]}, results["sharding"]
    assert results["plan"]["estimate"]["method"].endswith("fsdp x8"), results["plan"]
    text = next((tmp_path / "runs").iterdir()).joinpath("finetune_llm.ipynb").read_text()
    assert "SHARDING='fsdp': about " in text and "fsdp x8" in text
    print(f"finetune_llm with SHARDING=fsdp on 8 XLA:CPU devices: {report['seconds']:.1f} s of training, "
          f"{report['xla']['uncached_compiles']} graphs compiled ({report['xla']['compilations']} compilations), "
          f"generation {results['samples_before']['compilations']} + {results['samples_after']['compilations']}, val loss {report['first_val_loss']:.3f} -> "
          f"{report['final_val_loss']:.3f}")


def test_finetune_notebook_distils_from_a_teacher_cache_with_int4_qat(notebooks, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    cache = tmp_path / "cache"
    results, out_dir = _run(notebooks, tmp_path, "cpu", METHOD="distill", TEACHER="tiny", TEACHER_CACHE=str(cache),
                            TEACHER_TOP_K=32, QAT="int4")
    report = results["report"]
    assert report["steps"] == 40 and report["final_val_loss"] < report["first_val_loss"] - 0.5, report
    assert results["teacher_cache"]["k"] == 32 and results["teacher_cache"]["bytes"] > 0
    assert json.loads((cache / "manifest.json").read_text())["complete"]
    assert results["plan"]["fits"] and any("top-32" in n for n in results["plan"]["estimate"]["notes"])
    text = next((tmp_path / "runs").iterdir()).joinpath("finetune_llm.ipynb").read_text()
    assert "teacher cache " in text and "top-32 of 512" in text
    exports = results["exports"]
    quantized = AutoModelForCausalLM.from_pretrained(exports["quantized"])
    assert type(quantized.model.layers[0].self_attn.q_proj.weight).__name__ == "IntxUnpackedToInt8Tensor"
    adapted = PeftModel.from_pretrained(quantized, exports["adapter"]).eval()
    merged = AutoModelForCausalLM.from_pretrained(exports["merged"]).eval()
    assert merged.dtype == torch.bfloat16
    ids = torch.tensor([[1, 87, 85, 269, 201, 400]])
    with torch.no_grad():  # the int4 base + adapter and the bf16 merged model compute the same, to bf16's precision
        torch.testing.assert_close(merged(input_ids=ids).logits.float(), adapted(input_ids=ids).logits,
                                   atol=0.05, rtol=0.05)
