"""Find the XLA problems that cost the most time, while `fit` runs, and say what to change.

    trainer = Trainer(model, train, val, config=TrainConfig(device="xla", xla_checks="warn"))  # the default
    report = trainer.fit()          # warns once per problem, e.g. "step 7: recompiled: the input shapes changed..."
    print(report)                   # the problems are listed in the report (report.xla["problems"])

`XlaDetector` is a `Trainer` callback that the trainer adds by itself on XLA (`xla_checks="off"` drops it,
`"strict"` raises `XlaPerformanceError` at the first problem, for tests and CI). After warm-up it reads only
torch_xla's host-side counters, after each step's sync, and tells apart `shape_change`, `changing_value`,
`host_read` and `cpu_fallback`; at the end of `fit` it says whether the host bounds the step (`host_bound`).
What each problem means and what to change: docs/guides/speed.md.
"""

from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass
from typing import Any

import torch

from tpu_helpers.core.callbacks import Callback

CAUSES = {
    "shape_change": "the input shapes changed ({detail}); every new shape compiles a new graph. Pad or bucket "
                    "batches to a few fixed shapes (drop_last=True, pad to a fixed length).",
    "changing_value": "recompiled with unchanged input shapes ({detail}); a Python value that changes each step "
                      "is baked into the graph (an exponent, arange(n), a slice length, or the special values 0 and "
                      "1), or the step takes a different code path. Pass it as a device tensor or keep it fixed; "
                      "tpu_helpers.diagnostics.xla_debug.run_with_xla_debug shows the line that triggered each compile.",
    "host_read": "{detail} device-to-host transfer(s) in a step that should read nothing; a host read (.item(), "
                 ".tolist(), print(tensor), `if tensor:`) stalls the chip until the step finishes. Accumulate on "
                 "the device and read at log steps (backend.add_step_closure).",
    "cpu_fallback": "{detail} has no XLA kernel and ran on the CPU (a round trip to the host each call). {hint}",
}

# Replacements for ops that fall back to the CPU (seen as aten::NAME counters).
FALLBACK_HINTS = {
    "aten::kl_div": "Use tpu_helpers.diagnostics.xla_safe_kl_div(input, target), the same formula in plain ops.",
    "aten::bincount": "Count with torch.nn.functional.one_hot(x, n).sum(0) or zeros(n).index_add_(0, x, ones).",
    "aten::nonzero": "nonzero has a data-dependent shape; keep shapes fixed with torch.where(mask, x, 0) or a "
                     "masked sum.",
    "aten::_unique2": "unique has a data-dependent shape; use a one_hot/histogram over a known range instead.",
    "aten::median": "Use x.sort(dim).values at index n // 2, or torch.quantile.",
    "aten::histc": "Build the histogram with one_hot(bucketize(x, edges), bins).sum(0).",
    "aten::searchsorted.Tensor": "Compare against the boundaries: (x[..., None] >= edges).sum(-1).",
}


class XlaPerformanceWarning(UserWarning):
    """A pattern that makes an XLA run slow (recompilation, host read, CPU fallback)."""


class XlaPerformanceError(RuntimeError):
    """Raised instead of the warning when the detector runs with strict=True."""


@dataclass
class Finding:
    cause: str  # shape_change | changing_value | host_read | cpu_fallback
    step: int
    message: str

    def __str__(self) -> str:
        return f"step {self.step}: {self.message}"

    def to_dict(self) -> dict:
        return asdict(self)


def _shapes(batch: Any) -> tuple:
    """Shapes of the tensors in a batch (metadata only: reading a lazy tensor's shape runs nothing)."""
    if isinstance(batch, torch.Tensor):
        return (tuple(batch.shape),)
    if isinstance(batch, dict):
        return tuple(s for k in sorted(batch) for s in _shapes(batch[k]))
    if isinstance(batch, (list, tuple)):
        return tuple(s for item in batch for s in _shapes(item))
    return ()


class XlaDetector(Callback):
    """Watches the XLA counters during `fit` and reports each problem once (see the module docstring)."""

    def __init__(self, *, strict: bool = False, warmup_steps: int = 2, warn: bool = True) -> None:
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps={warmup_steps!r} must be >= 0")
        self.strict, self.warmup_steps, self.warn = strict, warmup_steps, warn
        self.findings: list[Finding] = []
        self.active = False

    # ---- Callback hooks --------------------------------------------------------------------------------------
    def on_fit_start(self, trainer) -> None:
        self.active = bool(trainer.backend.compiles_graphs)
        if not self.active:
            return
        self._reported: set = set()
        self._seen_shapes: set = set()  # batch shapes of steady-state steps
        self._all_shapes: set = set()
        self._step_shapes: list = []
        self._first_step = trainer.step  # a resumed run warms up again
        self._evals, self._eval_compiled = 0, 0
        self._saved_before = False
        self._last = trainer.backend.step_metrics()

    # Evaluation runs between the step's sync and on_step_end: count its compilations apart from the step's.
    def on_eval_start(self, trainer) -> None:
        if self.active:
            self._eval_before = trainer.backend.step_metrics()["compilations"]

    def on_eval_end(self, trainer) -> None:
        if self.active:
            self._evals += 1
            self._eval_compiled += trainer.backend.step_metrics()["compilations"] - self._eval_before

    def on_batch(self, trainer, batch: Any) -> None:
        if self.active:
            self._step_shapes.append(_shapes(batch))
            self._all_shapes.add(self._step_shapes[-1])

    def on_step_end(self, trainer) -> None:
        if not self.active:
            return
        cadence, step = trainer.cadence, trainer.step
        now = trainer.backend.step_metrics()
        last, self._last = self._last, now
        shapes, self._step_shapes = self._step_shapes, []
        in_warmup = step - self._first_step <= self.warmup_steps
        # Shapes are compared with those of steady-state steps: a warm-up step's graph differs anyway (no
        # optimizer state yet), so a shape first seen in warm-up still compiles once more afterwards.
        new_shapes = [s for s in dict.fromkeys(shapes) if s not in self._seen_shapes]
        if not in_warmup:
            self._seen_shapes.update(shapes)
        # The checkpoint is written after on_step_end, so its transfers show up in the next step.
        saved_before, self._saved_before = self._saved_before, cadence.is_save_step(step)

        fallback_calls = 0
        for name, count in now["cpu_fallback_ops"].items():
            grew = count - last["cpu_fallback_ops"].get(name, 0)
            if grew > 0:
                fallback_calls += grew
                hint = FALLBACK_HINTS.get(name, "Find an equivalent made of ops XLA supports (elementwise, "
                                                "matmul, reductions with static shapes).")
                self._report("cpu_fallback", name, step, CAUSES["cpu_fallback"].format(detail=name, hint=hint))

        compiled = now["compilations"] - last["compilations"]
        # The first evaluation of a fit may compile its graph; compilations inside later ones count as problems.
        eval_compiled, self._eval_compiled = self._eval_compiled, 0
        if self._evals > 1 or not eval_compiled:
            eval_compiled = 0
        compiled -= eval_compiled
        if compiled > 0 and not in_warmup:
            seen = sorted(self._seen_shapes - set(new_shapes))[:3]
            if new_shapes and (seen or self._all_shapes - set(new_shapes)):
                detail = f"new {', '.join(map(str, new_shapes))}; earlier {seen or sorted(self._all_shapes)[:3]}"
                self._report("shape_change", None, step, CAUSES["shape_change"].format(detail=detail))
            else:
                detail = f"{compiled} new graph(s) at step {step}"
                self._report("changing_value", None, step, CAUSES["changing_value"].format(detail=detail))

        reads = now["device_to_host_transfers"] - last["device_to_host_transfers"] - fallback_calls
        # A read the trainer's step makes by design (GRPO's rewards) is declared by its cadence.
        if reads > 0 and not (cadence.is_log_step(step) or cadence.is_eval_step(step) or saved_before
                              or cadence.is_read_step(step)):
            self._report("host_read", None, step, CAUSES["host_read"].format(detail=reads))

    def on_fit_end(self, trainer, report) -> None:
        if self.active:
            report.xla["problems"] = [f.to_dict() for f in self.findings]
            # Who bounds the step: advice, never a strict error (a small model on XLA:CPU is host-bound by nature).
            line = host_bound(report.timing)
            report.xla["host_bound"] = line
            if line and self.warn and trainer.backend.on_tpu:
                warnings.warn(line, XlaPerformanceWarning, stacklevel=2)

    # ---- reporting ---------------------------------------------------------------------------------------------
    def _report(self, cause: str, key: Any, step: int, message: str) -> None:
        if (cause, key) in self._reported:
            return
        self._reported.add((cause, key))
        finding = Finding(cause, step, message)
        self.findings.append(finding)
        if self.strict:
            raise XlaPerformanceError(f"{finding} (xla_checks='strict' turns this into an error)")
        if self.warn:
            warnings.warn(str(finding), XlaPerformanceWarning, stacklevel=3)

    def causes(self) -> list[str]:
        return [f.cause for f in self.findings]

    @property
    def counters(self) -> dict | None:
        """The XLA counters as read after the latest step (`backend.step_metrics()`), None before the first one: what
        else reports them per step (experiment trackers) reads them here instead of again."""
        return getattr(self, "_last", None) if self.active else None


# Below this much host time per step the question does not arise (a step of a millisecond traces as fast as any).
HOST_BOUND_FLOOR_MS = 1.0


def host_bound(timing: dict) -> str | None:
    """The diagnosis "host-bound: X s of host per step vs Y s on the device", with what to do, when the steady
    steps' host time (tracing the step: the `host` part, sync and data wait aside) exceeds the device's busy time
    per step: the chip then idles while Python traces. None when it does not, or where device time is unknown."""
    device_ms = timing.get("device_ms") if timing else None
    if device_ms is None:
        return None
    host_ms = timing["median_ms"]["host"]
    if host_ms < HOST_BOUND_FLOOR_MS or host_ms <= device_ms:
        return None
    return (f"host-bound: {host_ms / 1e3:.3g} s of host per step vs {device_ms / 1e3:.3g} s on the device; the "
            f"chip idles {1 - device_ms / host_ms:.0%} of each step while Python traces it. Tracing costs per op, "
            "not per FLOP (a deep narrow model is the worst case): give each trace more work, a larger batch_size or "
            "seq_len (the same trace, more device time), or replay_steps=True (REPLAY_STEPS in the notebooks: "
            "each step traced once and replayed); generation replays its prompt pass and loops its decode steps on "
            "the device unless replay=False or loop=False is passed to generate_ids.")



def detector_for(trainer) -> XlaDetector | None:
    """The detector among a trainer's callbacks, if any."""
    return next((c for c in trainer.callbacks if isinstance(c, XlaDetector)), None)
