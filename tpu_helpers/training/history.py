"""What a run recorded: the loss history (with matplotlib plots) and the end-of-run report.

`History` is plain Python lists, so it pickles into checkpoints and a resumed run keeps its earlier curve.
`RunReport` is what `Trainer.fit` returns: throughput, losses, and on XLA the compilation count and any ops that
fell back to the CPU; `str(report)` is a short human summary and `report.to_dict()` goes to results.json.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class History:
    train: list[dict] = field(default_factory=list)  # {"step", "loss", "lr", "tokens_per_s", "grad_norm"}
    eval: list[dict] = field(default_factory=list)  # {"step", "val_loss", and what eval callbacks added}

    def log_train(self, step: int, **values: Any) -> None:
        self.train.append({"step": step, **values})

    def log_eval(self, step: int, val_loss: float | None, **metrics: float) -> None:
        """The validation loss at `step` and any metrics an eval callback recorded (`Trainer.eval_metrics`)."""
        if val_loss is not None:
            self.eval = [e for e in self.eval if e["step"] != step] + [{"step": step, "val_loss": val_loss, **metrics}]

    def truncate(self, step: int) -> None:
        """Forget records after `step` (a resumed run repeats them)."""
        self.train = [r for r in self.train if r["step"] <= step]
        self.eval = [r for r in self.eval if r["step"] <= step]

    def to_dict(self) -> dict:
        return {"train": list(self.train), "eval": list(self.eval)}

    @classmethod
    def from_dict(cls, d: dict) -> History:
        return cls(train=list(d.get("train", [])), eval=list(d.get("eval", [])))

    def plot(self, path: str | Path | None = None, *, title: str = "loss"):
        """Train and validation loss against step (and throughput), shown in a notebook; saves a PNG when `path`
        is given. The figure is pyplot's (so Jupyter displays it); files without display use `figure()`."""
        import matplotlib.pyplot as plt

        fig = plt.figure(figsize=(11, 3.8))
        self._draw(fig, title)
        if path is not None:
            fig.savefig(path, dpi=110)
        return fig

    def figure(self, *, title: str = "loss"):
        """The same plot as a standalone matplotlib Figure that pyplot does not track: nothing to close, no
        re-display in a notebook, freed with its last reference (for files written per run)."""
        from matplotlib.figure import Figure

        fig = Figure(figsize=(11, 3.8))
        self._draw(fig, title)
        return fig

    def _draw(self, fig, title: str) -> None:
        ax, ax2 = fig.subplots(1, 2)
        if self.train:
            ax.plot([r["step"] for r in self.train], [r["loss"] for r in self.train], label="train")
            ax2.plot([r["step"] for r in self.train], [r["tokens_per_s"] for r in self.train], color="tab:green")
        if self.eval:
            ax.plot([r["step"] for r in self.eval], [r["val_loss"] for r in self.eval], "o-", label="validation")
        ax.set(xlabel="step", ylabel="loss", title=title)
        ax.legend()
        ax.grid(alpha=0.3)
        ax2.set(xlabel="step", ylabel="tokens/s", title="throughput")
        ax2.grid(alpha=0.3)
        fig.tight_layout()


@dataclass
class RunReport:
    device: str
    steps: int  # optimizer steps completed in total
    steps_this_run: int
    resumed_from: int | None
    seconds: float
    tokens_per_step: int
    tokens_per_s: float
    steps_per_s: float
    first_val_loss: float | None
    final_val_loss: float | None
    final_train_loss: float | None
    checkpoint: str | None
    parameters: int
    precision: str
    xla: dict = field(default_factory=dict)  # compilations, transfers, CPU fallbacks (XLA only)
    memory: dict | None = None
    stop_reason: str | None = None  # why the run ended before `steps` (a signal, a callback), else None
    timing: dict = field(default_factory=dict)  # step time split, steady tokens/s (tpu_helpers.training.step_timing)
    mfu: float | None = None  # model FLOPs utilisation against the catalog's bf16 peak (TPU/GPU only)
    resume_changes: list = field(default_factory=list)  # settings applied on resume ("lr 0.003 -> 3e-05 from step 20")
    best_checkpoint: dict | None = None  # {"step", "path", "metric", "value"}: kept whatever keep_last says

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def save(self, path: str | Path) -> Path:
        from tpu_helpers.core.atomic_io import atomic_write_text

        atomic_write_text(path, json.dumps(self.to_dict(), indent=2, default=str))
        return Path(path)

    def __str__(self) -> str:
        def fmt(x: float | None) -> str:
            return "n/a" if x is None else f"{x:.4f}"

        lines = [
            f"device        {self.device}",
            f"steps         {self.steps} ({self.steps_this_run} this run"
            + (f", resumed from step {self.resumed_from})" if self.resumed_from else ")"),
            f"throughput    {self.tokens_per_s:,.0f} tokens/s, {self.steps_per_s:.2f} steps/s",
            f"val loss      {fmt(self.first_val_loss)} -> {fmt(self.final_val_loss)}",
            f"parameters    {self.parameters:,}",
        ]
        if self.xla:
            fallbacks = self.xla.get("cpu_fallback_ops") or {}
            lines.append(f"compilations  {self.xla.get('compilations')} graphs "
                         f"({self.xla.get('compile_seconds', 0.0):.1f} s compiling)")
            lines.append(f"host reads    {self.xla.get('device_to_host_transfers')} device-to-host transfers")
            lines.append("cpu fallbacks " + (", ".join(f"{k} x{v}" for k, v in fallbacks.items()) or "none"))
            lines += _xla_extra_lines(self.xla)
        if self.timing:
            from tpu_helpers.training.step_timing import format_timing

            lines.append(format_timing(self.timing))
        if self.checkpoint:
            lines.append(f"checkpoint    {self.checkpoint}")
        if self.best_checkpoint:
            b = self.best_checkpoint
            lines.append(f"best          step {b['step']}, {b['metric']} {b['value']:.4f} ({b['path']})")
        for change in self.resume_changes:
            lines.append(f"changed       {change}")
        if self.stop_reason:
            lines.append(f"stopped early {self.stop_reason}")
        return "\n".join(lines)


def _xla_extra_lines(xla: dict) -> list[str]:
    """Compile-cache outcome and detected problems (tpu_helpers.diagnostics), in plain words."""
    lines = []
    if xla.get("compile_cache_dir"):
        hits, misses = xla.get("persistent_cache_hits", 0), xla.get("persistent_cache_misses", 0)
        failures = xla.get("persistent_cache_deserialize_failures", 0)
        line = f"compile cache {hits} hits, {misses} misses, {failures} failed loads ({xla['compile_cache_dir']})"
        if failures:
            line += ("; this torch_xla could not load its cached executables here (known on TPU with 2.9), so the "
                     "cache saved no compile time")
        lines.append(line)
    for problem in xla.get("problems") or []:
        lines.append(f"XLA problem   step {problem['step']}: {problem['message']}")
    if xla.get("host_bound"):
        lines.append(f"XLA advice    {xla['host_bound']}")
    return lines
