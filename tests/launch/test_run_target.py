"""`make run`'s entry: the command line the Makefile runs (its RUN_ARGS: grpo_llm.ipynb headlessly on the offline
real model), here with tiny settings on top (the tiny model, 2 steps): what it prints and leaves, not how long it
takes (about 3 minutes on a 2-core CPU with the real model; see the Makefile)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import ROOT

TINY = ["-p", "MODEL", "tiny", "-p", "STEPS", "2", "-p", "BATCH_SIZE", "2", "-p", "NUM_GENERATIONS", "2",
        "-p", "SAVE_EVERY", "2", "-p", "LORA_R", "4", "-p", "MAX_PROMPT_LEN", "48"]  # the tiny tokenizer: longer prompts


def run_args() -> list[str]:
    """The Makefile's RUN_ARGS, as the shell splits them (continuation lines joined)."""
    text = (ROOT / "Makefile").read_text().replace("\\\n", " ")
    line = next(x for x in text.splitlines() if x.startswith("RUN_ARGS := "))
    return shlex.split(line.removeprefix("RUN_ARGS := "))


def test_make_run_runs_grpo_on_the_offline_real_model_through_the_notebook():
    args = run_args()
    assert args[:4] == ["run", "notebooks/grpo_llm.ipynb", "--target", "cpu"]
    params = dict(zip(args[5::3], args[6::3], strict=True))
    assert params["MODEL"] == "smollm2-135m" and params["START_FROM"] == "None" and params["STEPS"] == "8"
    assert all(flag == "-p" for flag in args[4::3])
    run = next(x for x in (ROOT / "Makefile").read_text().split("\n\n") if x.startswith("# The package is installed"))
    assert "OMP_NUM_THREADS=$(RUN_THREADS) $(PY) -m tpu_helpers $(RUN_ARGS)" in run


@pytest.mark.slow
@pytest.mark.notebooks
def test_make_runs_entry_prints_the_held_out_figure_answers_and_the_figure(tmp_path):
    out = tmp_path / "out"
    argv = [sys.executable, "-m", "tpu_helpers", *run_args(), *TINY, "-p", "OUT_DIR", str(out),
            "--runs-dir", str(tmp_path / "runs")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get(
        "PYTHONPATH", "")]).rstrip(os.pathsep)}
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    figure = [x for x in lines if re.fullmatch(r"   held-out reward: \d\.\d\d -> \d\.\d\d \(the test split of 'sums', "
                                               r"100 records\)", x)]
    assert len(figure) == 1, proc.stdout
    answers = lines.index("   held-out answers, before -> after:")
    assert all(re.fullmatch(r"     '.+' \(\d+\): '.*' -> '.*'", x, re.S) for x in lines[answers + 1:answers + 5]), lines
    pngs = [Path(x.split("figure: ", 1)[1]) for x in lines if x.startswith("   figure: ")]
    assert [p.name for p in pngs] == ["grpo.png", "loss.png"] and all(p.is_file() for p in pngs), proc.stdout
    assert (pngs[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n") and (out / "grpo.png").is_file()


def test_the_runner_shows_each_hf_jobs_held_out_figure(tmp_path):
    """The figure line for each HF notebook's results.json: GRPO's reward, fine-tuning's exact match, DPO's
    preference accuracy; answers before -> after; nothing for a results.json without them (the quickstart's)."""
    from tpu_helpers.launch.runner import RunResult, highlights

    def shown(results):
        return highlights(RunResult("x.ipynb", tmp_path, True, 1.0, results=results))

    rows = [{"prompt": "2 + 3 =", "answer": "5", "prediction": "The sum"}], [{"prompt": "2 + 3 =", "answer": "5",
                                                                              "prediction": "5"}]
    sft = {"samples_before": {"exact_match": 0.0, "rows": rows[0]}, "samples_after": {"exact_match": 0.41,
                                                                                      "rows": rows[1]}}
    assert shown(sft) == ["held-out exact match: 0.00 -> 0.41", "held-out answers, before -> after:",
                          "  '2 + 3 =' (5): 'The sum' -> '5'"]
    dpo = {"accuracy": {"before": {"accuracy": 0.5, "logp_accuracy": 0.4}, "after": {"accuracy": 0.875}}}
    assert shown(dpo) == ["held-out preference accuracy: 0.50 -> 0.88"]
    assert shown({"report": {"final_val_loss": 1.8}}) == [] and shown(None) == []
    (tmp_path / "loss.png").write_bytes(b"")
    assert shown({"reward": {"before": 0.05, "after": None}}) == ["held-out reward: 0.05 -> -",
                                                                  f"figure: {tmp_path / 'loss.png'}"]
