"""Standard evaluation with lm-evaluation-harness (lm-eval): EVAL_TASKS scored on the model before training and on
the merged export after, through lm-eval's Hugging Face backend (HFLM).

    job = Finetune(FinetuneConfig(eval_tasks="sums", eval_limit=32))   # names and YAML paths checked here
    job.run_eval_tasks("before"); job.train(); job.export(); job.run_eval_tasks("after")
    print(job.eval_tasks_summary())            # sums exact_match,last_number 0.344 -> 0.625 (32 documents)

EVAL_TASKS holds lm-eval task, group or tag names and paths to task YAML files, comma separated; EVAL_LIMIT caps the
documents per task for quick runs. The package's own task `sums` (the test split of the generated sums, `data.rl`)
runs offline: its YAML and jsonl are written at run time. A task whose data lives on the Hugging Face hub needs the
network: where the hub cannot be reached that is an error at config time, naming the task and the way out (a task
YAML over a local file, `dataset_path: json`). The harness runs on the host CPU (on the GPU under CUDA): its batches
change shape from call to call, which XLA would compile again each time. Guide: docs/guides/evaluation.md.
"""

from __future__ import annotations

import json
import os
import random
import socket
import tempfile
import time
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from urllib.parse import urlparse

from tpu_helpers.config import ConfigError
from tpu_helpers.core.choices import did_you_mean
from tpu_helpers.core.extras import require_extra
from tpu_helpers.data.rl import sum_records
from tpu_helpers.models.hf import hub_offline

GUIDE = "docs/guides/evaluation.md"
# datasets' builders that read local files (dataset_kwargs.data_files): no network unless a file is a URL.
LOCAL_BUILDERS = ("json", "csv", "parquet", "text", "arrow", "pandas")
# The sums task: the prompt as it is, then "Answer:"; the score is the last number of the answer's first line.
SUMS_YAML = """\
task: sums
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
  cache_dir: {cache}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}\\nAnswer:"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 16
  do_sample: false
filter_list:
  - name: last_number
    filter:
      - function: regex
        regex_pattern: "(-?[0-9]+)"
        group_select: -1
      - function: take_first
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""
PACKAGE_TASKS = ("sums",)
HUB_TIMEOUT_S = 3.0


@dataclass
class HarnessSettings:
    """EVAL_TASKS and its options, fields of every Hugging Face recipe's config with the prefix `eval_`; the task
    names and files are checked as the settings are built (config time), the harness imported only then."""

    tasks: str | None = None  # lm-eval task names or task YAML paths, comma separated; None: no harness run
    limit: int | None = None  # documents per task at most (quick runs); None: every document
    fewshot: int | None = None  # examples in each prompt; None: each task's own number
    chat_template: bool = False  # prompts through the tokenizer's chat template (instruct models)

    specs: tuple[str, ...] = field(init=False, default=())  # the tasks, parsed: names and absolute YAML paths
    registry: bool = field(init=False, default=False)  # whether a spec needs lm-eval's own task index

    def __post_init__(self) -> None:
        for name in ("limit", "fewshot"):
            value, low = getattr(self, name), 1 if name == "limit" else 0
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < low):
                raise ConfigError(f"eval_{name}={value!r} must be an integer >= {low}, or None")
        self.specs = parse_tasks(self.tasks)
        if self.specs:
            self.registry = check_tasks(self.specs)


def parse_tasks(tasks: str | None) -> tuple[str, ...]:
    """EVAL_TASKS as a tuple of task names and absolute YAML paths ("sums, my_task.yaml")."""
    if tasks is None:
        return ()
    if not isinstance(tasks, str):
        raise ConfigError(f"eval_tasks={tasks!r}: give lm-eval task names or task YAML paths, comma separated "
                          "(e.g. 'sums' or 'hellaswag,my_task.yaml'), or None")
    specs = [t.strip() for t in tasks.split(",") if t.strip()]
    specs = [str(Path(t).expanduser().resolve()) if is_path(t) else t for t in specs]
    twice = sorted({t for t in specs if specs.count(t) > 1})
    if twice:
        raise ConfigError(f"eval_tasks={tasks!r} names {twice} twice; name each task once")
    return tuple(specs)


def is_path(spec: str) -> bool:
    """Whether an EVAL_TASKS entry is a task YAML file rather than a task name."""
    return spec.endswith((".yaml", ".yml")) or "/" in spec or os.sep in spec


# ---- config time: every task known, every task's data reachable --------------------------------------------------------
def check_tasks(specs: tuple[str, ...]) -> bool:
    """ConfigError for an EVAL_TASKS entry that is no task, a YAML file that does not exist or is no task, or a task
    whose data needs a network this machine lacks; returns whether lm-eval's own task index is needed."""
    require_extra("eval", "EVAL_TASKS (lm-evaluation-harness)")
    registry = False
    for spec in specs:
        if spec in PACKAGE_TASKS:
            continue
        if is_path(spec):
            cfg = _yaml_task(spec)
            if "group" in cfg:
                registry = True
            leaves = _leaves_of_config(cfg, spec)
        else:
            registry = True
            leaves = _leaves(spec)
        for name, cfg in leaves:
            _check_data(spec, name, cfg)
    return registry


def _yaml_task(path: str) -> dict:
    from lm_eval.tasks._yaml_loader import load_yaml

    if not Path(path).is_file():
        raise ConfigError(f"eval_tasks: the task YAML {path!r} does not exist. An EVAL_TASKS entry with '/' or a "
                          f".yaml ending is a file (relative paths from the working directory, {os.getcwd()}); a "
                          f"name without them is an lm-eval task. See {GUIDE}")
    try:
        cfg = load_yaml(path, resolve_func=False)
    except Exception as err:
        raise ConfigError(f"eval_tasks: the task YAML {path!r} does not read as one: {err}") from None
    if not isinstance(cfg, dict) or not ({"task", "group"} & set(cfg)):
        raise ConfigError(f"eval_tasks: the YAML {path!r} has no 'task' (or 'group') key, so it is no lm-eval task; "
                          f"see {GUIDE} for one over a local jsonl file")
    return cfg


@lru_cache(maxsize=1)
def _index() -> dict:
    """lm-eval's own tasks, groups and tags: name -> index entry (reading every task YAML: seconds, once)."""
    from lm_eval.tasks import TaskManager

    return TaskManager().task_index


def _leaves(name: str, seen: frozenset = frozenset()) -> list[tuple[str, dict]]:
    """(task name, config) of every task that the lm-eval name `name` (a task, group or tag) runs."""
    from lm_eval.tasks._index import Kind

    index = _index()
    entry = index.get(name)
    if entry is None:
        raise ConfigError(f"eval_tasks: {name!r} is no lm-eval task, group or tag{did_you_mean(name, index)} and "
                          f"no package task ({', '.join(PACKAGE_TASKS)}); lm-eval lists its tasks with `lm-eval "
                          f"ls tasks`. A task of your own is a YAML file: give its path (see {GUIDE})")
    if name in seen:
        return []
    if entry.kind is Kind.TAG:
        return [leaf for task in sorted(entry.tags) for leaf in _leaves(task, seen | {name})]
    return _leaves_of_config(entry.cfg or {}, name, seen | {name})


def _leaves_of_config(cfg: dict, name: str, seen: frozenset = frozenset()) -> list[tuple[str, dict]]:
    if "group" not in cfg:
        return [(str(cfg.get("task", name)), cfg)]
    children = cfg.get("task") or []
    out = []
    for child in children if isinstance(children, list) else [children]:
        if isinstance(child, str):
            out += _leaves(child, seen)
        elif isinstance(child, dict):
            out += _leaves_of_config(child, name, seen) if "group" in child else \
                [(str(child.get("task", name)), child)]
    return out


def _check_data(spec: str, task: str, cfg: dict) -> None:
    where = f"task {task!r}" + (f" (of {spec!r})" if spec != task else "")
    path = cfg.get("dataset_path")
    if path in LOCAL_BUILDERS:
        for file in _data_files(cfg):
            if "://" in file:
                _need_network(where, f"reads {file!r}", None)
            elif not Path(file).expanduser().exists():
                raise ConfigError(f"eval_tasks: {where} reads the data file {file!r}, which does not exist (a "
                                  f"relative path is read from the working directory, {os.getcwd()})")
        return
    if isinstance(path, str) and Path(path).expanduser().exists():
        return
    what = f"reads its data from the Hugging Face hub (dataset_path {path!r})" if path else \
        "loads its data in lm-eval's Python code (a Python task)"
    _need_network(where, what, path)


def _data_files(cfg: dict) -> list[str]:
    files = (cfg.get("dataset_kwargs") or {}).get("data_files") or []
    items = list(files.values()) if isinstance(files, dict) else [files]
    return [str(f) for item in items for f in (item if isinstance(item, list) else [item])]


def _need_network(where: str, what: str, dataset: str | None) -> None:
    reachable, why = hub_reachable()
    if reachable:
        return
    if dataset and _offline_datasets() and dataset_cached(dataset):
        return  # datasets reads it from its cache (HF_DATASETS_OFFLINE)
    cached = (f" The datasets cache holds {dataset!r}: set HF_DATASETS_OFFLINE=1 to read it from there."
              if dataset and dataset_cached(dataset) else "")
    raise ConfigError(f"eval_tasks: {where} {what}, and this machine cannot reach the hub ({why}).{cached} Run it "
                      f"where the internet is available, or give a task YAML over a local file (dataset_path: json, "
                      f"dataset_kwargs.data_files) in EVAL_TASKS, or the package's offline task 'sums': {GUIDE}")


def _offline_datasets() -> bool:
    return os.environ.get("HF_DATASETS_OFFLINE", "").strip().lower() in {"1", "on", "yes", "true"}


@lru_cache(maxsize=1)
def hub_reachable() -> tuple[bool, str]:
    """(whether the Hugging Face hub answers, why not): no when HF_HUB_OFFLINE, TRANSFORMERS_OFFLINE or
    HF_DATASETS_OFFLINE says so, or when HF_ENDPOINT's host takes no connection within HUB_TIMEOUT_S."""
    if hub_offline() or _offline_datasets():
        return False, "HF_HUB_OFFLINE, TRANSFORMERS_OFFLINE or HF_DATASETS_OFFLINE is set"
    host = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co").hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=HUB_TIMEOUT_S).close()
    except OSError as err:
        return False, f"{host} did not answer within {HUB_TIMEOUT_S:g} s: {err}"
    return True, ""


def dataset_cached(dataset: str) -> bool:
    """Whether the Hugging Face caches hold hub data set `dataset` (datasets' own cache or the hub's)."""
    home = Path(os.environ.get("HF_HOME") or Path.home() / ".cache" / "huggingface")
    datasets_cache = Path(os.environ.get("HF_DATASETS_CACHE") or home / "datasets")
    hub_cache = Path(os.environ.get("HF_HUB_CACHE") or home / "hub")
    return ((datasets_cache / dataset.replace("/", "___")).exists()
            or (hub_cache / f"datasets--{dataset.replace('/', '--')}").exists())


# ---- run time ---------------------------------------------------------------------------------------------------------
def write_package_tasks(folder: Path) -> Path:
    """The package's offline tasks as lm-eval task YAMLs (with their jsonl data) in `folder`; returns it. The sums
    come shuffled (seeded): EVAL_LIMIT takes its documents from the front, which would otherwise all start with 0."""
    records = sum_records(split="test")
    random.Random(0).shuffle(records)
    data = folder / "sums.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    # datasets' Arrow copy of the jsonl goes into `folder` too, not into the user's cache for good.
    (folder / "sums.yaml").write_text(SUMS_YAML.format(data=json.dumps(str(data)),
                                                       cache=json.dumps(str(folder / "datasets"))))
    return folder


def evaluate(model: str, settings: HarnessSettings, *, device: str = "cpu", dtype: str = "float32",
             batch_size: int = 8, seed: int = 0) -> dict:
    """`settings.specs` scored on the Hugging Face model folder (or hub name) `model`: {"scores": {task: {metric:
    value}}, "stderr": ..., "documents": {task: n}, "seconds": s, "model": model}."""
    require_extra("eval", "EVAL_TASKS (lm-evaluation-harness)")
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="tpu_helpers-tasks-") as folder:
        own = [write_package_tasks(Path(folder))] if set(settings.specs) & set(PACKAGE_TASKS) else []
        manager = TaskManager(include_path=own or None, include_defaults=settings.registry)
        lm = HFLM(pretrained=model, device=device, dtype=dtype, batch_size=batch_size)
        out = lm_eval.simple_evaluate(model=lm, tasks=list(settings.specs), task_manager=manager,
                                      limit=settings.limit, num_fewshot=settings.fewshot,
                                      apply_chat_template=settings.chat_template, log_samples=False,
                                      bootstrap_iters=1000, random_seed=seed, numpy_random_seed=seed,
                                      torch_random_seed=seed, fewshot_random_seed=seed)
    return {**scores(out), "seconds": round(time.perf_counter() - t0, 1), "model": model}


def scores(out: dict) -> dict:
    """lm-eval's results as {"scores": {task: {metric: value}}, "stderr": {...}, "documents": {task: n}}: the
    metric keys as lm-eval writes them ("exact_match,last_number"), without the filter when it is "none"."""
    result: dict[str, dict] = {"scores": {}, "stderr": {}, "documents": {}}
    for task, values in (out.get("results") or {}).items():
        for key, value in values.items():
            if "," not in key or not isinstance(value, (int, float)):
                continue
            name = key.removesuffix(",none").replace("_stderr", "")
            result["stderr" if "_stderr," in key else "scores"].setdefault(task, {})[name] = float(value)
    for task, n in (out.get("n-samples") or {}).items():
        result["documents"][task] = n.get("effective", n.get("original"))
    return result


def summary(runs: dict) -> str:
    """One line per task and metric: "task metric A -> B (n documents)" from the runs {"before": ..., "after": ...}
    (`evaluate`'s), or "task metric A" when only one of them ran."""
    before, after = (runs.get(k) or {} for k in ("before", "after"))
    tasks = {**before.get("scores", {}), **after.get("scores", {})}
    lines = []
    for task, metrics in tasks.items():
        n = (after or before).get("documents", {}).get(task)
        for metric in metrics:
            values = [run["scores"][task][metric] for run in (before, after)
                      if metric in run.get("scores", {}).get(task, {})]
            docs = f" ({n} documents)" if n is not None else ""
            lines.append(f"{task} {metric} {' -> '.join(f'{v:.3f}' for v in values)}{docs}")
    return "\n".join(lines)
