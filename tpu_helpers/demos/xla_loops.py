"""A deliberately bad XLA training loop and its fixed twin, for notebooks/xla_debugging.ipynb and the tests.

    from tpu_helpers.demos.xla_loops import compare_loops
    table = compare_loops(config)      # trains both, returns their figures and the detector's findings

`BadLoopTrainer` switches on, one by one or together, the patterns that hurt most on a TPU:
- "shapes": dynamic padding, each batch padded to its own longest sequence (lengths vary batch to batch);
- "value": a Python number that changes every step used as an exponent (recompiles each step);
- "item": `loss.item()` every step (a host read that stalls the chip);
- "fallback": class weights counted with `torch.bincount`, an op with no XLA kernel (runs on the CPU).
The fixed loop is the package's own `Trainer` on fixed-shape batches.
"""

from __future__ import annotations

import shutil
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from tpu_helpers.backend import Backend
from tpu_helpers.config import ConfigError, TrainConfig
from tpu_helpers.data import build_datasets
from tpu_helpers.diagnostics import XlaDetector, XlaPerformanceWarning, detector_for
from tpu_helpers.models.gpt import GPT, gpt_config
from tpu_helpers.training.results import write_results
from tpu_helpers.training.trainer import Trainer

PATTERNS = ("shapes", "value", "item", "fallback")


class RaggedBatches(Dataset):
    """Batches of sequences cut to a length that changes batch to batch, as dynamic padding produces."""

    def __init__(self, blocks: Dataset, batch_size: int, lengths: Iterable[int]) -> None:
        self.blocks, self.batch_size, self.lengths = blocks, batch_size, list(lengths)

    def __len__(self) -> int:
        return len(self.blocks) // self.batch_size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = [self.blocks[i * self.batch_size + j] for j in range(self.batch_size)]
        n = self.lengths[i % len(self.lengths)]
        return torch.stack([x[:n] for x, _ in rows]), torch.stack([y[:n] for _, y in rows])


class BadLoopTrainer(Trainer):
    """The package's Trainer with the bad patterns of the module docstring switched on."""

    def __init__(self, *args: Any, patterns: Iterable[str] = PATTERNS, **kwargs: Any) -> None:
        self.patterns = set(patterns)
        unknown = self.patterns - set(PATTERNS)
        if unknown:
            raise ConfigError(f"unknown bad-loop pattern(s) {sorted(unknown)}; choose from {PATTERNS}")
        super().__init__(*args, **kwargs)

    def compute_loss(self, batch: Any) -> torch.Tensor:
        inputs, targets = batch
        out = self.model(inputs)
        logits = out[0] if isinstance(out, tuple) else out  # the package's GPT returns (logits, loss)
        logits = logits.reshape(-1, logits.size(-1)).float()
        weight = None
        if "fallback" in self.patterns:
            # Inverse-frequency class weights from a per-batch count: bincount falls back to the CPU on XLA.
            counts = torch.bincount(targets.reshape(-1), minlength=logits.size(-1)).float()
            weight = 1.0 / (counts + 1.0)
        loss = F.cross_entropy(logits, targets.reshape(-1), weight=weight)
        if "value" in self.patterns:
            # A "sharpening" schedule as a Python float exponent: a new constant, so a new graph, every step.
            loss = loss ** (1.0 + self.step / 1000.0)
        return loss

    def train_step(self, batches):
        loss, norm = super().train_step(batches)
        if "item" in self.patterns:
            self.last_loss = loss.item()  # the host read this demo is about
        return loss, norm


def _logits_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))


def _ragged_loader(train: Dataset, batch_size: int, seq_len: int) -> DataLoader:
    lengths = [max(1, 3 * seq_len // 4), seq_len]  # two lengths, alternating: two graphs where one would do
    return DataLoader(RaggedBatches(train, batch_size, lengths), batch_size=None, shuffle=False)


def run_loop(config: TrainConfig, *, backend: Backend, patterns: Iterable[str] = (), progress: bool = False,
             data: tuple | None = None, model: torch.nn.Module | None = None) -> dict:
    """Train a GPT (or `model`: token ids -> logits) with the given bad patterns (none = the package's loop).

    Returns the run's figures and the detector's findings."""
    patterns = tuple(patterns)
    train, val, tok = data or build_datasets(config.dataset, config.tokenizer, block_size=config.seq_len,
                                             val_fraction=config.val_fraction, seed=config.seed,
                                             max_chars=config.max_chars)
    torch.manual_seed(config.seed)
    model = model or GPT(gpt_config(config.preset, vocab_size=tok.vocab_size, block_size=config.seq_len))
    train_data = _ragged_loader(train, config.batch_size, config.seq_len) if "shapes" in patterns else train
    # No patterns: the package's own Trainer, as a user runs it (a model other than the GPT returns bare logits, so
    # it gets a cross-entropy loss_fn).
    cls = BadLoopTrainer if patterns else Trainer
    kwargs = {"patterns": patterns} if cls is BadLoopTrainer else {}
    if cls is Trainer and not isinstance(model, GPT):
        kwargs["loss_fn"] = _logits_loss
    detector = XlaDetector(strict=config.xla_checks == "strict")
    trainer = cls(model, train_data, val, config=config, backend=backend, progress=progress,
                  callbacks=[detector], **kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", XlaPerformanceWarning)
        report = trainer.fit()
    for w in caught:  # the findings are shown in the table; still show other warnings
        if not issubclass(w.category, XlaPerformanceWarning):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    xla = report.xla
    timing = report.timing or {}
    return {
        "loop": "bad: " + ", ".join(patterns) if patterns else "package loop",
        "trainer": type(trainer).__name__,
        "compilations": xla.get("compilations"),
        "device_to_host_transfers": xla.get("device_to_host_transfers"),
        "cpu_fallback_ops": sum((xla.get("cpu_fallback_ops") or {}).values()),
        "seconds": report.seconds,
        "steady_step_ms": timing.get("steady_step_ms"),
        "final_train_loss": report.final_train_loss,
        "problems": [str(f) for f in detector_for(trainer).findings],
        "causes": detector_for(trainer).causes(),
    }


def compare_loops(config: TrainConfig, *, backend: Backend, patterns: Iterable[str] = PATTERNS) -> list[dict]:
    """The bad loop then the fixed one on the same model, data and steps.

    They run in `<out_dir>/bad` and `<out_dir>/fixed`, emptied first: a demo starts from scratch every time."""
    for sub in ("bad", "fixed"):
        shutil.rmtree(Path(config.out_dir) / sub, ignore_errors=True)
    data = build_datasets(config.dataset, config.tokenizer, block_size=config.seq_len,
                          val_fraction=config.val_fraction, seed=config.seed, max_chars=config.max_chars)
    bad = run_loop(config.replace(out_dir=f"{config.out_dir}/bad"), backend=backend, patterns=patterns, data=data)
    good = run_loop(config.replace(out_dir=f"{config.out_dir}/fixed"), backend=backend, data=data)
    return [bad, good]


def save_comparison(rows: list[dict], out_dir: str | Path, **extra: Any) -> Path:
    """Write `<out_dir>/results.json` (both loops' figures and findings), atomically; also into the runner's
    run directory when run by `python -m tpu_helpers run`."""
    return write_results(out_dir, {"loops": rows, **extra})


def format_comparison(rows: list[dict]) -> str:
    """The two loops' figures side by side, then what the detector said about each."""
    keys = ("compilations", "device_to_host_transfers", "cpu_fallback_ops", "steady_step_ms", "seconds")
    width = max(len(k) for k in keys) + 2
    lines = [" " * width + "".join(f"{r['loop'][:34]:>36}" for r in rows)]
    for k in keys:
        cells = "".join(f"{r[k]:>36.1f}" if isinstance(r[k], float) else f"{r[k]!s:>36}" for r in rows)
        lines.append(f"{k:<{width}}{cells}")
    for r in rows:
        lines.append(f"\n{r['loop']}: " + ("no problems found" if not r["problems"] else ""))
        lines += [f"  - {p}" for p in r["problems"]]
    return "\n".join(lines)
