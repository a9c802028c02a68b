"""Memory estimation for a training step, per chip, and the probe that confirms it on the real device.

- :func:`analytic_estimate` (analytic.py): instant, for the package GPT or any decoder given by its sizes;
- :func:`traced_estimate` (traced.py): any ``nn.Module``, the trainer's real step on fake tensors, nothing allocated;
- :func:`compiled_estimate` (compiled.py): what XLA reports for the trainer's compiled step graph (fresh subprocess);
- :func:`memory_report` (report.py): an estimate against a chip's HBM, and the largest batch that fits;
- :func:`probe_batch_size` (probe.py): the largest batch that really runs the trainer's step here, OOM-safe.

The traced and compiled estimates and the probe all run one step, the trainer's own (`Trainer.train_step`, made
for the step alone by :func:`step_trainer`), so they measure what training runs. Precisions and optimizers are
`tpu_helpers.core.choices`' lists; ``pure_bf16=True`` stores weights, gradients and optimizer state in bf16 too.

``benchmarks/memory_accuracy.py`` compares the estimates with real measurements.
"""

from tpu_helpers.memory.analytic import analytic_estimate
from tpu_helpers.memory.compiled import compiled_estimate
from tpu_helpers.memory.live import LiveBytes
from tpu_helpers.memory.probe import ProbeResult, probe_batch_size
from tpu_helpers.memory.report import MemoryEstimate, MemoryReport, largest_fitting_batch, memory_report
from tpu_helpers.memory.traced import MetaBuildError, gpt_batch, step_trainer, traced_estimate

__all__ = [
    "LiveBytes", "MemoryEstimate", "MemoryReport", "MetaBuildError", "ProbeResult", "analytic_estimate",
    "compiled_estimate", "gpt_batch", "largest_fitting_batch", "memory_report", "probe_batch_size", "step_trainer",
    "traced_estimate",
]
