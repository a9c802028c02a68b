"""Memory estimation for a training step, per chip, and the probe that confirms it on the real device.

- :func:`analytic_estimate` (analytic.py): instant, for the package GPT or any decoder given by its sizes;
- :func:`traced_estimate` (traced.py): any ``nn.Module``, one real step on fake tensors, nothing allocated;
- :func:`compiled_estimate` (compiled.py): what XLA reports for the compiled step graph (fresh subprocess);
- :func:`memory_report` (report.py): an estimate against a chip's HBM, and the largest batch that fits;
- :func:`probe_batch_size` (probe.py): the largest batch that really runs here, OOM-safe.

``benchmarks/memory_accuracy.py`` compares the estimates with real measurements.
"""

from tpu_helpers.memory.analytic import analytic_estimate
from tpu_helpers.memory.compiled import compiled_estimate
from tpu_helpers.memory.live import LiveBytes
from tpu_helpers.memory.probe import ProbeResult, probe_batch_size
from tpu_helpers.memory.report import MemoryEstimate, MemoryReport, largest_fitting_batch, memory_report
from tpu_helpers.memory.step import OPTIMIZERS, PRECISIONS, make_optimizer, training_step
from tpu_helpers.memory.traced import MetaBuildError, gpt_batch, traced_estimate

__all__ = [
    "OPTIMIZERS", "PRECISIONS", "LiveBytes", "MemoryEstimate", "MemoryReport", "MetaBuildError", "ProbeResult",
    "analytic_estimate", "compiled_estimate", "gpt_batch", "largest_fitting_batch", "make_optimizer",
    "memory_report", "probe_batch_size", "traced_estimate", "training_step",
]
