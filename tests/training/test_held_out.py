"""Held out means held out: for a user's DATASET the records the held-out figures are measured on never reach a
training batch, in every Hugging Face recipe (fine-tuning, GRPO on prompts and on agent episodes, DPO). Proved by
data identity: each record carries a code of its own, every training batch the loop takes (and every row training
could draw from) is decoded, and no held-out record's code is in it; nor a validation record's. EVAL_DATASET (a
local jsonl here) is the held-out set whole, and all of DATASET trains; results.json and the runner say where the
held-out records come from."""

from __future__ import annotations

import json
import re
import warnings

import pytest

from tpu_helpers.config import ConfigError
from tpu_helpers.core.callbacks import Callback
from tpu_helpers.recipes.finetune import Finetune, FinetuneConfig
from tpu_helpers.recipes.grpo import GRPO, GRPOConfig
from tpu_helpers.recipes.preference import Preference, PreferenceConfig

CODE = re.compile(r"q\d{3}x")
COMMON = dict(device="cpu", steps=4, log_every=2, save_every=4, eval_every=4, eval_batches=1, xla_checks="off",
              warmup_steps=1, seed=0, val_fraction=0.2)


def code(k: int) -> str:
    return f"q{k:03d}x"


def sft_records(n: int, start: int = 0) -> list[dict]:
    return [{"prompt": f"Say {code(k)}.", "response": code(k)} for k in range(start, start + n)]


def prompt_records(n: int, start: int = 0) -> list[dict]:
    return [{"prompt": f"Say {code(k)}.", "answer": code(k)} for k in range(start, start + n)]


def pair_records(n: int, start: int = 0) -> list[dict]:
    return [{"prompt": f"Say {code(k)}.", "chosen": "yes", "rejected": "no"} for k in range(start, start + n)]


def write(path, records: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


class Batches(Callback):
    """Every training batch the loop takes, as the step takes it (on the CPU: its values can be read)."""

    def __init__(self) -> None:
        self.batches: list[dict] = []

    def on_batch(self, trainer, batch) -> None:
        self.batches.append({k: v.clone() for k, v in batch.items()})


def codes(tokenizer, input_ids) -> set[str]:
    """The record codes in token rows (any leading shape), by decoding each row."""
    rows = input_ids.reshape(-1, input_ids.shape[-1]).tolist()
    return {c for row in rows for c in CODE.findall(tokenizer.decode(row))}


def record_codes(records: list[dict]) -> set[str]:
    return {c for r in records for c in CODE.findall(json.dumps(r))}


def job_of(kind: str, tmp_path, model: str = "tiny", callbacks=(), **overrides):
    out = str(tmp_path / f"run-{kind}")
    if kind == "finetune":
        config = FinetuneConfig(**{**COMMON, **dict(model=model, batch_size=8, seq_len=32, lr=1e-3, out_dir=out),
                                   **overrides})
        return Finetune(config, progress=False, callbacks=list(callbacks))
    if kind == "grpo":
        config = GRPOConfig(**{**COMMON, **dict(model=model, start_from=None, batch_size=4, num_generations=2,
                                                max_prompt_len=24, max_new_tokens=3, lr=1e-3, lora_r=4, out_dir=out),
                               **overrides})
        return GRPO(config, progress=False, callbacks=list(callbacks))
    config = PreferenceConfig(**{**COMMON, **dict(model=model, batch_size=4, seq_len=32, lr=1e-3, out_dir=out),
                                 **overrides})
    return Preference(config, progress=False, callbacks=list(callbacks))


MAKE = {"finetune": sft_records, "grpo": prompt_records, "preference": pair_records}


@pytest.mark.parametrize("kind", ["finetune", "grpo", "preference"])
def test_no_held_out_record_reaches_a_training_batch(tmp_path, tiny_lm_dir, kind):
    """EVAL_SHARE of DATASET is held out (seeded by SEED, reported with its size), and neither it nor the
    validation records are in any training batch, nor in any training row."""
    records = MAKE[kind](80)
    seen = Batches()
    job = job_of(kind, tmp_path, "tiny", [seen], dataset=write(tmp_path / "data.jsonl", records))
    held = record_codes(job.held_out)
    assert len(held) == len(job.held_out) == 8 and job.held_out_label() == "held-out (10% of DATASET, 8 records)"
    assert job.held_out != records[:8]  # drawn with SEED, not DATASET's first records
    job.train()
    assert seen.batches, "the loop took no batch"
    trained = set().union(*(codes(job.tokenizer, b["input_ids"]) for b in seen.batches))
    rows = codes(job.tokenizer, job.train_data.input_ids)
    assert trained and trained <= rows, (trained, rows)
    assert not trained & held and not rows & held, (sorted(trained & held), sorted(rows & held))
    if kind == "grpo":  # the rows' record indices: what the rewards read
        indices = {int(i) for b in seen.batches for i in b["index"]}
        assert not record_codes([job.records[i] for i in indices]) & held
    else:  # the validation rows are apart from both
        val = codes(job.tokenizer, job.val_data.input_ids)
        assert val and not val & held and not val & rows
    # Every record is used once: training, validation or held out.
    everything = rows | held | (codes(job.tokenizer, job.val_data.input_ids) if job.val_data is not None else set())
    assert everything == record_codes(records)
    results = job.results()
    assert results["held_out"] == {"source": "10% of DATASET", "records": 8,
                                   "label": "held-out (10% of DATASET, 8 records)"}


def test_the_agent_episodes_held_out_rows_never_train(tmp_path, tiny_lm_dir):
    """GRPO in agent mode on a file of rows: the held-out rows' episodes are never a training batch's prompt."""
    from tests.algorithms.test_grpo_episodes import tool_tiny_copy
    from tpu_helpers.agents.examples import multiply_rows

    rows = multiply_rows(80, seed=3)
    for k, row in enumerate(rows):  # the question carries the row's code
        row["prompt"] = [*row["prompt"][:-1], {"role": "user", "content": f"{code(k)}: {row['prompt'][-1]['content']}"}]
    seen = Batches()
    model = tool_tiny_copy(tiny_lm_dir, tmp_path / "tool_model")
    job = job_of("grpo", tmp_path, model, [seen], dataset=write(tmp_path / "rows.jsonl", rows), steps=3,
                 tools="tpu_helpers.agents.examples:multiply", rewards="answer", max_prompt_len=96,
                 max_new_tokens=4, tool_tokens=16, max_turns=1)
    held = record_codes(job.held_out)
    assert len(held) == 8 and job.held_out_label(2) == "held-out (10% of DATASET, 2 records)"
    job.train()
    # The training rows are record indices (each episode renders its own prompt at its reset).
    trained = record_codes([job.records[int(i)] for b in seen.batches for i in b["index"]])
    everything = record_codes([job.records[int(i)] for i in job.train_data.index])
    assert trained and not trained & held and not everything & held


@pytest.mark.parametrize("kind", ["finetune", "grpo", "preference"])
def test_eval_dataset_is_the_held_out_set_and_all_of_dataset_trains(tmp_path, tiny_lm_dir, kind):
    records, evals = MAKE[kind](50), MAKE[kind](70, start=100)
    job = job_of(kind, tmp_path, "tiny", dataset=write(tmp_path / "data.jsonl", records),
                 eval_dataset=write(tmp_path / "eval.jsonl", evals))
    with pytest.warns(UserWarning, match=r"EVAL_DATASET='.*eval\.jsonl' holds more than EVAL_RECORDS=64 records: "
                                         r"its first 64 are the held-out set; raise EVAL_RECORDS"):
        held = list(job.held_out)
    assert held == evals[:64] and job.held_out_label() == "held-out (EVAL_DATASET, 64 records)"
    trains = codes(job.tokenizer, job.train_data.input_ids)
    val = codes(job.tokenizer, job.val_data.input_ids) if job.val_data is not None else set()
    assert trains | val == record_codes(records) and not trains & val  # every DATASET record trains or validates
    job = job_of(kind, tmp_path, "tiny", dataset=str(tmp_path / "data.jsonl"),
                 eval_dataset=str(tmp_path / "eval.jsonl"), eval_records=70)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert list(job.held_out) == evals
    assert not [w for w in caught if "EVAL_RECORDS" in str(w.message)]


def test_a_dataset_record_equal_to_a_held_out_one_does_not_train_either(tmp_path, tiny_lm_dir):
    records = sft_records(50)
    evals = [records[5], *sft_records(3, start=100)]  # record 5 is also in EVAL_DATASET
    job = job_of("finetune", tmp_path, "tiny", dataset=write(tmp_path / "data.jsonl", records + [records[7]]),
                 eval_dataset=write(tmp_path / "eval.jsonl", evals))
    with pytest.warns(UserWarning, match=r"1 of DATASET's records equal a held-out record \(EVAL_DATASET\) and are "
                                         r"left out of training too"):
        trains = codes(job.tokenizer, job.train_data.input_ids) | codes(job.tokenizer, job.val_data.input_ids)
    assert trains == record_codes(records) - {code(5)}
    # Without EVAL_DATASET: a held-out record's twin in DATASET (record 7 twice) stays out with it.
    twins = records + records  # every record twice
    job = job_of("finetune", tmp_path, "tiny", dataset=write(tmp_path / "twins.jsonl", twins))
    with pytest.warns(UserWarning, match=r"\d+ of DATASET's records equal a held-out record \(10% of DATASET\)"):
        held = record_codes(job.held_out)
    trains = codes(job.tokenizer, job.train_data.input_ids) | codes(job.tokenizer, job.val_data.input_ids)
    assert len(held) >= 5 and not trains & held and trains | held == record_codes(records)


def test_the_generated_sets_keep_their_own_test_split(tmp_path, tiny_lm_dir):
    from tpu_helpers.data.rl import sum_records

    job = job_of("grpo", tmp_path, "tiny", dataset="sums", max_records=32)
    assert list(job.held_out) == sum_records(split="test") and len(job.train_data) == 32
    assert job.held_out_label() == "held-out (the test split of 'sums', 100 records)"
    job = job_of("finetune", tmp_path, "tiny", max_records=50)
    assert job.held_out.source == "the test split of 'instructions'" and len(job.train_data) + len(job.val_data) == 50


def test_eval_share_zero_holds_nothing_out_and_a_held_out_figure_is_then_a_clear_error(tmp_path, tiny_lm_dir):
    job = job_of("preference", tmp_path, "tiny", dataset=write(tmp_path / "data.jsonl", pair_records(40)),
                 eval_share=0)
    assert job.held_out_label() == "held-out (none: EVAL_SHARE=0, 0 records)"
    assert len(job.train_data) + len(job.val_data) == 40
    with pytest.raises(ConfigError, match=r"no held-out records to measure: EVAL_SHARE=0 holds none of DATASET="
                                          r"'.*data\.jsonl' out; set EVAL_SHARE \(e\.g\. 0\.1\) or give EVAL_DATASET"):
        job.preference_accuracy()


def test_bad_held_out_settings_are_clear_errors(tmp_path):
    data = write(tmp_path / "data.jsonl", sft_records(4))
    with pytest.raises(ConfigError, match=r"eval_share=1.0 must be at least 0 and below 1 \(the share of DATASET held out"):
        FinetuneConfig(eval_share=1)
    with pytest.raises(ConfigError, match=r"eval_records=0 must be an integer >= 1"):
        GRPOConfig(eval_records=0)
    with pytest.raises(ConfigError, match=r"eval_dataset=.*data\.jsonl' is DATASET itself, whose records train"):
        PreferenceConfig(dataset=data, eval_dataset=str(tmp_path / "." / "data.jsonl"))
    with pytest.raises(ConfigError, match=r"eval_dataset='  ': give a local"):
        FinetuneConfig(eval_dataset="  ")


def test_the_runner_says_where_the_held_out_records_come_from(tmp_path):
    from tpu_helpers.launch.runner import RunResult, highlights

    rows = [{"prompt": "Say q001x.", "answer": "q001x", "prediction": p} for p in ("no", "q001x")]
    results = {"samples_before": {"exact_match": 0.0, "rows": rows[:1]},
               "samples_after": {"exact_match": 1.0, "rows": rows[1:]},
               "held_out": {"source": "10% of DATASET", "records": 4}}
    assert highlights(RunResult("x.ipynb", tmp_path, True, 1.0, results=results))[0] == \
        "held-out exact match: 0.00 -> 1.00 (10% of DATASET, 1 record)"
    dpo = {"accuracy": {"before": {"accuracy": 0.5, "pairs": 41}, "after": {"accuracy": 0.75, "pairs": 41}},
           "held_out": {"source": "EVAL_DATASET", "records": 41}}
    assert highlights(RunResult("x.ipynb", tmp_path, True, 1.0, results=dpo)) == [
        "held-out preference accuracy: 0.50 -> 0.75 (EVAL_DATASET, 41 records)"]


def test_a_run_resumed_with_another_held_out_split_is_refused(tmp_path):
    """The held-out split decides which records train: it is part of the run's identity."""
    data = write(tmp_path / "data.jsonl", sft_records(80))
    job_of("finetune", tmp_path, dataset=data, steps=2, save_every=2, eval_every=2).train()
    with pytest.raises(ConfigError, match=r"held_out: '10% of DATASET' there vs '20% of DATASET' now"):
        job_of("finetune", tmp_path, dataset=data, steps=4, save_every=2, eval_every=2, eval_share=0.2).train()


@pytest.mark.parametrize("name, config", [("finetune_llm", FinetuneConfig), ("grpo_llm", GRPOConfig),
                                          ("agents_llm", GRPOConfig), ("preference_llm", PreferenceConfig)])
def test_every_notebook_with_a_held_out_figure_takes_the_held_out_parameters(notebooks, tmp_path, name, config):
    from tpu_helpers.config import config_from_parameters
    from tpu_helpers.launch.runner import declared_parameters

    declared = declared_parameters(notebooks[name])
    assert {k: declared[k] for k in ("EVAL_DATASET", "EVAL_SHARE", "EVAL_RECORDS")} == {
        "EVAL_DATASET": None, "EVAL_SHARE": 0.1, "EVAL_RECORDS": 64}
    evals = write(tmp_path / "eval.jsonl", sft_records(3))
    cfg = config_from_parameters({**declared, "EVAL_DATASET": evals, "EVAL_SHARE": 0.2, "EVAL_RECORDS": 3},
                                 base=config(), extra={"INSTALL": bool, "REPO_URL": str})
    assert (cfg.eval_dataset, cfg.eval_share, cfg.eval_records) == (evals, 0.2, 3)
