"""Where a training step's time goes (data wait, host work, sync), tokens/s and MFU, for the run report.

`Trainer.fit` drives a `StepTimer` with host clocks only (no device read is added to the loop): data wait (blocked
in `next(batches)`), host (building the step: tracing on XLA, compute on CPU eager, launches on CUDA), sync (in
`backend.sync()`), other (evaluation, checkpoints, callbacks) and, on XLA, the device's busy time per steady step
(`backend.device_seconds()`, read at the tracker windows, never per step). Beside host, it tells who bounds the
step (`diagnostics.detector.host_bound(timing)`).

The steady-state step time (data wait + host + sync, the first `warmup_steps` steps excluded) is the honest
training step time; tokens/s and MFU (model FLOPs per token over the catalog's dense bf16 peak per chip times the
chips, TPUs and GPUs only) come from it. Each part, and the MFU convention in full: docs/guides/speed.md.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from statistics import median
from typing import Any

PARTS = ("data_wait", "host", "sync", "other")


def model_flops_per_token(model: Any, seq_len: int) -> float | None:
    """Training FLOPs per token of `model` at `seq_len`, or None if the model does not say."""
    fn = getattr(model, "flops_per_token", None)
    if callable(fn):
        return float(fn(seq_len))
    from tpu_helpers.models.gpt import GPT, flops_per_token

    if isinstance(model, GPT):
        return flops_per_token(model.config, seq_len)
    return None


class StepTimer:
    """Host-side split of each step; see the module docstring for what each part means."""

    def __init__(self, warmup_steps: int = 2, device_clock: Callable[[], float | None] | None = None) -> None:
        self.warmup_steps = warmup_steps
        self.steps: list[tuple[float, float, float, float]] = []  # (data_wait, host, sync, other) per step
        self._wait = 0.0
        self._begin = self._synced = 0.0
        self._sync = 0.0
        # The device's busy seconds so far (`backend.device_seconds`), read when the steady steps begin, at each
        # tracker window and at the end only: (steps timed, device seconds, wall clock) at the steady start and at
        # the last window.
        self._device_clock = device_clock
        self._steady_mark: tuple[int, float, float] | None = None
        self._window_mark: tuple[int, float, float] | None = None

    def wrap(self, batches: Iterator) -> Iterator:
        """Yield from `batches`, adding the time spent waiting for each batch to the current step."""
        while True:
            t0 = time.perf_counter()
            try:
                batch = next(batches)
            except StopIteration:
                return
            self._wait += time.perf_counter() - t0
            yield batch

    def _device_now(self) -> float | None:
        return self._device_clock() if self._device_clock is not None else None

    def begin(self) -> None:
        if self._steady_mark is None and len(self.steps) == self.warmup_steps:
            now = self._device_now()
            if now is not None:
                self._steady_mark = self._window_mark = (len(self.steps), now, time.perf_counter())
        self._begin, self._wait, self._sync = time.perf_counter(), 0.0, 0.0
        self._synced = self._begin

    def sync(self, fn: Callable[[], None]) -> None:
        t0 = time.perf_counter()
        fn()
        self._synced = time.perf_counter()
        self._sync += self._synced - t0

    def end(self) -> None:
        now = time.perf_counter()
        host = max(0.0, self._synced - self._begin - self._wait - self._sync)
        self.steps.append((self._wait, host, self._sync, now - self._synced))

    # ---- summary ------------------------------------------------------------------------------------------------
    def summary(self, *, tokens_per_step: int, flops_per_token: float | None, peak_tflops: float | None,
                chips: int) -> dict:
        steady = self.steps[self.warmup_steps:] or self.steps
        if not steady:
            return {}
        per_part = {p: median(s[i] for s in steady) * 1e3 for i, p in enumerate(PARTS)}
        train_s = sum(s[0] + s[1] + s[2] for s in steady) / len(steady)
        tokens_per_s = tokens_per_step / train_s if train_s > 0 else 0.0
        mfu = None
        if flops_per_token and peak_tflops and tokens_per_s:
            mfu = tokens_per_s * flops_per_token / (peak_tflops * 1e12 * chips)
        device_ms, _ = self._device_ms_since(self._steady_mark)
        return {
            "device_ms": device_ms,  # the device's busy time per steady step (XLA), None where not known
            "steps_timed": len(self.steps),
            "warmup_steps": min(self.warmup_steps, len(self.steps)),
            "warmup_s": sum(sum(s) for s in self.steps[: self.warmup_steps]),
            "median_ms": per_part,
            "steady_step_ms": train_s * 1e3,
            "steady_tokens_per_s": tokens_per_s,
            "flops_per_token": flops_per_token,
            "peak_tflops_per_chip": peak_tflops,
            "mfu": mfu,
        }

    def window(self, since: int) -> dict:
        """The split of the steps timed from index `since` on (median ms per part) and their mean training step
        time (data wait + host + sync, ms): what a tracker logs at each log step. Empty when none was timed."""
        steps = self.steps[since:]
        if not steps:
            return {}
        split = {p: median(s[i] for s in steps) * 1e3 for i, p in enumerate(PARTS)}
        out = {**split, "step": sum(s[0] + s[1] + s[2] for s in steps) / len(steps) * 1e3}
        # The device's busy time per step since the last window (steady steps only: warm-up compiles).
        device_ms, now = self._device_ms_since(self._window_mark)
        if device_ms is not None:
            out["device"] = device_ms
            self._window_mark = (len(self.steps), now, time.perf_counter())
        return out

    def _device_ms_since(self, mark: tuple[int, float, float] | None) -> tuple[float | None, float | None]:
        """(The device's busy ms per step timed since `mark`, the device clock read): at most the wall time that
        passed, as the runtime times each graph from its launch, so graphs queued behind each other (a replayed
        step's) count their waits too."""
        now = self._device_now() if mark is not None else None
        if now is None or len(self.steps) <= mark[0]:
            return None, now
        busy = min(now - mark[1], time.perf_counter() - mark[2])
        return busy / (len(self.steps) - mark[0]) * 1e3, now

    def fill_report(self, report: Any, *, tokens_per_step: int, mfu: tuple[float | None, float | None, int]) -> None:
        """Put the summary into `report.timing` and `report.mfu`; `mfu` is what `mfu_inputs` returns."""
        fpt, peak, chips = mfu
        report.timing = self.summary(tokens_per_step=tokens_per_step, flops_per_token=fpt, peak_tflops=peak,
                                     chips=chips)
        report.mfu = report.timing.get("mfu")


def mfu_inputs(backend: Any, model: Any, seq_len: int) -> tuple[float | None, float | None, int]:
    """(model FLOPs per token at `seq_len`, the chip's dense bf16 peak in TFLOP/s or None, chips) of a run of
    `model` (as made, not wrapped) on `backend`."""
    per_chip = max(1, backend.hardware.devices_per_chip) if backend.hardware is not None else 1
    return (model_flops_per_token(model, seq_len), backend.peak_tflops, max(1, backend.num_replicas // per_chip))


def format_timing(timing: dict) -> str:
    """One line for `RunReport.__str__`."""
    if not timing:
        return ""
    ms = timing["median_ms"]
    mfu = f", MFU {timing['mfu']:.1%}" if timing.get("mfu") is not None else ""
    device = f"; device {timing['device_ms']:.1f} ms per step" if timing.get("device_ms") is not None else ""
    return (f"step time     {timing['steady_step_ms']:.1f} ms steady (median: data wait {ms['data_wait']:.1f}, "
            f"host {ms['host']:.1f}, sync {ms['sync']:.1f}, eval/save {ms['other']:.1f} ms{device}); "
            f"{timing['steady_tokens_per_s']:,.0f} tokens/s{mfu}")

