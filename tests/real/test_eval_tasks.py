"""EVAL_TASKS on the real model (`make test-real`): lm-evaluation-harness scores SmolLM2-135M-Instruct on the
package's offline task `sums` (the generated sums' test split, phrasings training never uses) before and after a
short LoRA fine-tune on the sums' training split, through the tokenizer's chat template, as the notebooks run it:
the score rises by a margin, and results.json holds both runs."""

from __future__ import annotations

import json
import time

import pytest

from tpu_helpers.data.rl import sum_records
from tpu_helpers.models import smollm2

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]  # one_thread: tests/conftest.py

METRIC = "exact_match,last_number"


def test_eval_tasks_scores_the_real_model_on_sums_before_and_after_fine_tuning(smollm2_dir, tmp_path):
    from tpu_helpers.recipes.finetune import Finetune, FinetuneConfig

    data = tmp_path / "sums.jsonl"
    data.write_text("".join(json.dumps({"prompt": r["prompt"], "response": r["answer"]}) + "\n"
                            for r in sum_records(400)))
    job = Finetune(FinetuneConfig(
        model=smollm2.SMOLLM2, dataset=str(data), method="lora", lora_targets="all-linear", lora_r=8, lora_alpha=16,
        steps=10, lr=1e-3, warmup_steps=1, batch_size=8, seq_len=40, eval_every=10, save_every=10, eval_batches=1,
        export="last", device="cpu", eval_tasks="sums", eval_limit=32, eval_chat_template=True,
        out_dir=str(tmp_path / "sft")))
    t0 = time.time()
    before = job.run_eval_tasks("before")
    job.train()
    paths = job.export()
    after = job.run_eval_tasks("after")
    results = json.loads(job.save_results(paths=paths).read_text())["eval_tasks"]
    a, b = before["scores"]["sums"][METRIC], after["scores"]["sums"][METRIC]
    print(f"\nEVAL_TASKS sums (32 documents, chat template), LoRA SFT 10 steps of 8 x 40 tokens: {a:.2f} -> {b:.2f} "
          f"(harness {before['seconds']:.0f} s + {after['seconds']:.0f} s, {time.time() - t0:.0f} s in all)")
    print(job.eval_tasks_summary())
    assert before["documents"]["sums"] == after["documents"]["sums"] == 32
    assert after["model"] == paths["merged"] and before["model"] == job.source
    assert results["before"]["scores"] == before["scores"] and results["after"]["scores"] == after["scores"]
    assert b >= a + 0.15  # measured 0.34 -> 0.62
