"""Diagnostics: find what makes an XLA run slow and say what to change.

    from tpu_helpers.diagnostics import XlaDetector, xla_safe_kl_div

Modules: `detector` (the recompilation / host-read / CPU-fallback detector the trainer adds on XLA), `safe_ops`
(XLA-friendly replacements such as `xla_safe_kl_div`), `xla_debug` (run a command under torch_xla's debug output and
summarise each compilation). They watch and fix a run from below the trainer (the detector implements the hooks of
`tpu_helpers.core.callbacks`), so the trainer uses them without diagnostics importing it; the debugging notebook's bad
loop, which drives a whole run, is a recipe (`tpu_helpers.demos.xla_loops`).
"""

from tpu_helpers.diagnostics.detector import (
    CAUSES,
    FALLBACK_HINTS,
    Finding,
    XlaDetector,
    XlaPerformanceError,
    XlaPerformanceWarning,
    detector_for,
)
from tpu_helpers.diagnostics.safe_ops import xla_safe_kl_div

__all__ = ["CAUSES", "FALLBACK_HINTS", "Finding", "XlaDetector", "XlaPerformanceError", "XlaPerformanceWarning",
           "detector_for", "xla_safe_kl_div"]
