"""The held-out records of a job: what its held-out figures are measured on, none of which ever trains.

    held = hold_out(records, load_records, dataset="mine.jsonl", eval_dataset=None, eval_share=0.1,
                    eval_records=64, seed=0)
    held                      # the held-out records (a list), with reference answers
    held.training             # the indices of `records` that may train (a held-out record's twins left out too)
    held.label()              # 'held-out (10% of DATASET, 41 records)': where they come from, as runs print it
    data, stats = held.training_rows(prompts, stats)   # prompt rows of the records that may train

The records are EVAL_DATASET's first EVAL_RECORDS (it never trains), else a generated set's own test split, else a
share of DATASET drawn with the seed before anything trains (at most EVAL_RECORDS). Recipes call it through
`recipes.hf_job.HFJob.hold_out`, which passes their settings.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from tpu_helpers.config import ConfigError
from tpu_helpers.data.sft import record_key, split_indices


class HeldOut(list):
    """The held-out records (a list of them, with reference answers for `samples`), which never train, and where
    they come from (`hold_out`)."""

    def __init__(self, records: list[dict], source: str, training: list[int], *, where: str = "held-out record",
                 numbers: list[int] | None = None) -> None:
        super().__init__(records)
        self.source = source  # "EVAL_DATASET", "10% of DATASET", "the test split of 'sums'", "none: ..."
        self.training = training  # the indices of DATASET's records that may train
        self.where, self.numbers = where, numbers  # how an error names a held-out record: where + its number

    def label(self, n: int | None = None) -> str:
        """'held-out (10% of DATASET, 41 records)': where the records come from and how many (`n` of them)."""
        n = len(self) if n is None else min(n, len(self))
        return f"held-out ({self.source}, {n} record{'' if n == 1 else 's'})"

    def training_rows(self, data: Any, stats: dict) -> tuple[Any, dict]:
        """Prompt rows (`data.rl.PromptDataset`) less those of records that may not train, and their stats."""
        kept = data.of_records(set(self.training))
        return kept, {**stats, "prompts": len(kept)}



def hold_out(records: list[dict], load: Callable[..., list[dict]], *, dataset: str | None, eval_dataset: str | None,
             eval_share: float, eval_records: int, seed: int, split: str = "test",
             generated: Callable[[], list[dict]] | None = None,
         usable: Callable[[dict, str], bool] | None = None) -> HeldOut:
    """The held-out records, none of which trains, and which of DATASET's `records` may train:

    - EVAL_DATASET given: its first EVAL_RECORDS records, read by `load(source, split=, max_records=)`;
    - else a generated DATASET's own test split, `generated()`;
    - else EVAL_SHARE of DATASET's records (at least one, at most EVAL_RECORDS), drawn with SEED.

    `usable(record, where)`: whether a record can be measured (has an answer); only those are held out. A
    DATASET record equal to a held-out one (the same content) does not train either, and a warning counts them."""
    everything = list(range(len(records)))
    if eval_dataset is None and generated is not None:
        return HeldOut(generated(), f"the test split of {dataset!r}", everything)
    if eval_dataset is not None:
        where = f"EVAL_DATASET={eval_dataset!r} record"
        held = load(eval_dataset, split=split, max_records=eval_records + 1)
        if len(held) > eval_records:
            warnings.warn(f"EVAL_DATASET={eval_dataset!r} holds more than EVAL_RECORDS={eval_records} "
                          f"records: its first {eval_records} are the held-out set; raise EVAL_RECORDS to "
                          "measure more", stacklevel=2)
            held = held[:eval_records]
        numbers = [k for k, r in enumerate(held) if usable is None or usable(r, f"{where} {k}")]
        if not numbers:
            raise ConfigError(f"EVAL_DATASET={eval_dataset!r} has no record to measure ({len(held)} read, "
                              "none with an answer)")
        source, taken = "EVAL_DATASET", [held[k] for k in numbers]
    else:
        where = f"DATASET={dataset!r} record"
        candidates = [i for i in everything if usable is None or usable(records[i], f"{where} {i}")]
        if eval_share == 0 or not candidates:
            why = "EVAL_SHARE=0" if eval_share == 0 else "no record of DATASET has an answer to measure"
            return HeldOut([], f"none: {why}", everything)
        if len(records) < 2:
            raise ConfigError(f"DATASET={dataset!r} has {len(records)} record: none would be left to train "
                              f"once EVAL_SHARE={eval_share} is held out; give more records, EVAL_DATASET, "
                              "or EVAL_SHARE=0")
        numbers = sorted(candidates[k] for k in split_indices(len(candidates), eval_share, seed,
                                                              at_most=eval_records)[1])
        taken = [records[i] for i in numbers]
        source = f"{100 * len(taken) / len(records):.2g}% of DATASET"
    keys = {record_key(r) for r in taken}
    training = [i for i in everything if record_key(records[i]) not in keys]
    twins = len(records) - len(training) - (0 if eval_dataset is not None else len(taken))
    if twins:
        warnings.warn(f"{twins} of DATASET's records equal a held-out record ({source}) and are left out of "
                      "training too, so that no held-out record trains; remove the repeats from DATASET (or "
                      "from EVAL_DATASET) to train on them", stacklevel=2)
    if not training:
        raise ConfigError(f"DATASET={dataset!r}: no record is left to train once the held-out records "
                          f"({source}) are kept out")
    return HeldOut(taken, source, training, where=where, numbers=numbers)
