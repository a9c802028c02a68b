"""EVAL_TASKS (recipes/harness.py): lm-evaluation-harness scores the model before training and the merged export after,
offline. The package's `sums` task and a task YAML over a local jsonl run on the tiny model, and the YAML task's
accuracy equals the one computed here from each model's own log-probabilities (so each run scored the model it names);
the scores reach results.json, the trackers' values and the "task metric A -> B" lines. A task that needs the network
fails at config time where the hub cannot be reached, as do a YAML path that does not exist and an unknown name; the
notebooks import nothing of lm-eval without EVAL_TASKS, and with it but without the package say to install the extra.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys

import pytest
import torch

from tests.support import ROOT
from tpu_helpers.config import ConfigError
from tpu_helpers.recipes import harness
from tpu_helpers.recipes.finetune import Finetune, FinetuneConfig

pytestmark = pytest.mark.skipif(importlib.util.find_spec("lm_eval") is None,
                                reason="lm_eval (the eval extra) is not installed")

COLOURS = ["red", "green", "blue", "black"]
QUIZ = """\
task: colours
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: {choices}
doc_to_target: "{{{{gold}}}}"
metric_list:
  - metric: acc
"""


def quiz(tmp_path, n: int = 12) -> str:
    """A multiple-choice task YAML over a local jsonl: which colour (gold cycles over the four)."""
    data = tmp_path / "colours.jsonl"
    data.write_text("".join(json.dumps({"question": f"Item {k} is coloured", "gold": k % 4}) + "\n" for k in range(n)))
    path = tmp_path / "colours.yaml"
    path.write_text(QUIZ.format(data=json.dumps(str(data)), choices=json.dumps(COLOURS)))
    return str(path)


def accuracy(model_dir: str, n: int = 12) -> float:
    """The colours task's accuracy computed here: each choice's summed log-probability after the question (the
    harness's encoding: context and " choice" tokenized together, the context's tokens cut off), argmax vs gold."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    right = 0
    for k in range(n):
        context = f"Item {k} is coloured"
        ctx = tok(context, add_special_tokens=False)["input_ids"]
        scores = []
        for choice in COLOURS:
            whole = tok(context + " " + choice, add_special_tokens=False)["input_ids"]
            with torch.no_grad():
                logp = model(torch.tensor([whole])).logits[0, :-1].log_softmax(-1)
            scores.append(sum(logp[i - 1, whole[i]].item() for i in range(len(ctx), len(whole))))
        right += max(range(4), key=scores.__getitem__) == k % 4
    return right / n


def test_eval_tasks_score_the_model_before_and_the_merged_export_after(tmp_path):
    yaml = quiz(tmp_path)
    job = Finetune(FinetuneConfig(device="cpu", steps=4, batch_size=8, seq_len=32, lr=3e-2, warmup_steps=1,
                                  eval_every=4, save_every=4, eval_batches=1, export="last", trackers="",
                                  eval_tasks=f"sums, {yaml}", eval_limit=12, out_dir=str(tmp_path / "run")),
                   progress=False)
    assert job.config.harness.specs == ("sums", yaml) and job.eval_tasks_summary().startswith("EVAL_TASKS: not run")
    before = job.run_eval_tasks("before")
    job.train()
    paths = job.export()
    after = job.run_eval_tasks("after")
    assert before["model"] == job.source and after["model"] == paths["merged"]
    for run in (before, after):
        assert run["documents"] == {"sums": 12, "colours": 12}
        assert 0 <= run["scores"]["sums"]["exact_match,last_number"] <= 1
        assert run["scores"]["colours"]["acc"] == pytest.approx(accuracy(run["model"]))
    lines = job.eval_tasks_summary().splitlines()
    b, a = before["scores"]["colours"]["acc"], after["scores"]["colours"]["acc"]
    assert lines[-1] == f"colours acc {b:.3f} -> {a:.3f} (12 documents)", lines
    assert re.fullmatch(r"sums exact_match,last_number \d\.\d{3} -> \d\.\d{3} \(12 documents\)", lines[0]), lines
    results = json.loads(job.save_results(paths=paths).read_text())
    assert results["eval_tasks"]["tasks"] == ["sums", yaml] and results["eval_tasks"]["limit"] == 12
    assert results["eval_tasks"]["after"]["scores"] == after["scores"]
    values = job.tracked_results(results)["values"]
    assert values["eval_tasks/colours/acc_before"] == b and values["eval_tasks/colours/acc_after"] == a


def test_without_eval_tasks_nothing_runs_and_results_hold_no_scores(tmp_path):
    job = Finetune(FinetuneConfig(device="cpu", out_dir=str(tmp_path)), progress=False)
    assert job.run_eval_tasks("before") is None and job.eval_tasks_summary().startswith("EVAL_TASKS: none")
    with pytest.raises(ConfigError, match=r"when='later' is not one of"):
        job.run_eval_tasks("later")
    assert job._eval_tasks_results() == {}


def test_after_needs_the_export_first(tmp_path):
    job = Finetune(FinetuneConfig(device="cpu", eval_tasks="sums", out_dir=str(tmp_path)), progress=False)
    with pytest.raises(RuntimeError, match=r"run_eval_tasks\('after'\) scores the merged export: call export\(\) first"):
        job.run_eval_tasks("after")


@pytest.mark.parametrize("settings, message", [
    (dict(eval_tasks="no/such/task.yaml"), r"^eval_tasks: the task YAML '.*no/such/task.yaml' does not exist\. An "
     r"EVAL_TASKS entry with '/' or a \.yaml ending is a file"),
    (dict(eval_tasks="sums,sums"), r"^eval_tasks='sums,sums' names \['sums'\] twice"),
    (dict(eval_tasks=3), r"^eval_tasks=3 has type int; expected str \| None$"),
    (dict(eval_tasks="sums", eval_limit=0), r"^eval_limit=0 must be an integer >= 1, or None$"),
    (dict(eval_tasks="sums", eval_fewshot=-1), r"^eval_fewshot=-1 must be an integer >= 0, or None$"),
    (dict(eval_tasks="sums", eval_chat_template="yes"), r"^eval_chat_template='yes' has type str; expected bool$"),
    (dict(eval_tasks="sums", export_merged=False), r"^eval_tasks='sums' scores the merged export after training: it "
     r"needs export_merged=True$"),
])
def test_bad_eval_settings_fail_at_config_time(settings, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=message):
        FinetuneConfig(**settings)


def test_a_yaml_that_is_no_task_fails_at_config_time(tmp_path):
    path = tmp_path / "notes.yaml"
    path.write_text("title: not a task\n")
    with pytest.raises(ConfigError, match=r"the YAML '.*notes.yaml' has no 'task' \(or 'group'\) key, so it is no "
                       r"lm-eval task"):
        FinetuneConfig(eval_tasks=str(path))


def test_the_setup_cell_installs_lm_eval_for_eval_tasks():
    from tpu_helpers import platform

    assert [str(r) for r in platform.parameter_requirements(eval_tasks="sums")] == ["lm_eval<0.5,>=0.4.13"]
    assert platform.parameter_requirements(eval_tasks=None) == platform.parameter_requirements(eval_tasks="") == []


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    harness.hub_reachable.cache_clear()
    yield
    harness.hub_reachable.cache_clear()


def hub_task(tmp_path, dataset: str = "Rowan/hellaswag") -> str:
    path = tmp_path / "hub_task.yaml"
    path.write_text(f"task: my_hellaswag\ndataset_path: {dataset}\noutput_type: multiple_choice\n")
    return str(path)


def test_a_task_on_the_hub_fails_at_config_time_without_the_network(tmp_path, offline, monkeypatch):
    yaml = hub_task(tmp_path)
    with pytest.raises(ConfigError, match=r"^eval_tasks: task 'my_hellaswag' \(of '.*hub_task.yaml'\) reads its data "
                       r"from the Hugging Face hub \(dataset_path 'Rowan/hellaswag'\), and this machine cannot reach "
                       r"the hub \(HF_HUB_OFFLINE.* is set\)\. Run it where the internet is available, or give a task "
                       r"YAML over a local file \(dataset_path: json.*docs/guides/evaluation.md$"):
        FinetuneConfig(eval_tasks=yaml)
    # In the datasets cache: said, and read from there under HF_DATASETS_OFFLINE.
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    (tmp_path / "cache" / "Rowan___hellaswag").mkdir(parents=True)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    harness.hub_reachable.cache_clear()
    assert FinetuneConfig(eval_tasks=yaml).harness.specs == (yaml,)
    monkeypatch.delenv("HF_DATASETS_OFFLINE")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    harness.hub_reachable.cache_clear()
    with pytest.raises(ConfigError, match=r"The datasets cache holds 'Rowan/hellaswag': set HF_DATASETS_OFFLINE=1"):
        FinetuneConfig(eval_tasks=yaml)


def test_a_local_task_whose_data_file_is_missing_or_a_url_fails_at_config_time(tmp_path, offline):
    path = tmp_path / "t.yaml"
    path.write_text("task: t\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: nowhere.jsonl\n")
    with pytest.raises(ConfigError, match=r"task 't' \(of '.*t.yaml'\) reads the data file 'nowhere.jsonl', which does "
                       r"not exist \(a relative path is read from the working directory"):
        FinetuneConfig(eval_tasks=str(path))
    path.write_text("task: t\ndataset_path: json\ndataset_kwargs:\n  data_files: https://example.com/t.jsonl\n")
    with pytest.raises(ConfigError, match=r"reads 'https://example.com/t.jsonl', and this machine cannot reach"):
        FinetuneConfig(eval_tasks=str(path))


@pytest.mark.slow  # lm-eval's own task index: every task YAML it ships is read once (tens of seconds)
def test_lm_evals_own_names_unknown_and_on_the_hub_fail_at_config_time(offline):
    with pytest.raises(ConfigError, match=r"^eval_tasks: 'hellaswagg' is no lm-eval task, group or tag \(did you mean "
                       r"'hellaswag'\?\) and no package task \(sums\)"):
        FinetuneConfig(eval_tasks="hellaswagg")
    for name, task, dataset in (("hellaswag", "hellaswag", "Rowan/hellaswag"),
                                ("mmlu", "mmlu_abstract_algebra", "cais/mmlu")):
        with pytest.raises(ConfigError, match=rf"^eval_tasks: task '{task}'.* reads its data from the Hugging Face hub "
                           rf"\(dataset_path '{dataset}'\), and this machine cannot reach the hub"):
            FinetuneConfig(eval_tasks=name)


def test_the_notebooks_import_no_lm_eval_without_eval_tasks_and_name_the_extra_with_it():
    code = """
import importlib.abc, importlib.util, sys
class Absent(importlib.abc.MetaPathFinder):  # as on a runtime without the eval extra
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "lm_eval":
            raise ModuleNotFoundError(name)
real = importlib.util.find_spec
importlib.util.find_spec = lambda name, *a: None if name == "lm_eval" else real(name, *a)
sys.meta_path.insert(0, Absent())
import tpu_helpers as th
th.FinetuneConfig(); th.GRPOConfig(); th.PreferenceConfig()
assert "lm_eval" not in sys.modules
try:
    th.FinetuneConfig(eval_tasks="sums")
except ImportError as err:
    print(err)
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("EVAL_TASKS (lm-evaluation-harness) needs the 'eval' extra (lm_eval); not installed "
                                 "here: lm_eval. Install it with: pip install \"tpu_helpers[eval]\""), out.stdout
