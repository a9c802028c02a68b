"""Host time against device time per step (training/step_timing.py, backend.device_seconds) and the host-bound
diagnosis (diagnostics/detector.py's `host_bound`): it fires on a deep narrow model on XLA:CPU, whose step traces
far longer than it runs, and not on a wide shallow one, whose step runs longer than it traces."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.support import XLA_BACKEND, tiny_config
from tpu_helpers.demos.xla_loops import _logits_loss
from tpu_helpers.diagnostics.detector import host_bound
from tpu_helpers.training import step_timing
from tpu_helpers.training.step_timing import StepTimer, format_timing
from tpu_helpers.training.trainer import Trainer


def _wall_clock(monkeypatch, tick: float) -> None:
    """The timer's wall clock, `tick` seconds further at each reading."""
    now = [0.0]

    def perf_counter() -> float:
        now[0] += tick
        return now[0]

    monkeypatch.setattr(step_timing, "time", SimpleNamespace(perf_counter=perf_counter))


def _five_steps(monkeypatch, tick: float, device_readings: list[float]) -> tuple[dict, dict]:
    """A tracker window and the summary of 5 steps (1 of warm-up) timed by a wall clock of `tick` seconds a reading
    and a device clock read when the steady steps begin, at the window and at the end."""
    _wall_clock(monkeypatch, tick)
    clock = iter(device_readings)
    timer = StepTimer(warmup_steps=1, device_clock=lambda: next(clock))
    for _ in range(5):
        timer.begin()
        timer.end()
    window = timer.window(1)
    return window, timer.summary(tokens_per_step=10, flops_per_token=None, peak_tflops=None, chips=1)


def test_the_timer_gives_device_time_per_steady_step_from_the_device_clock(monkeypatch):
    # Far more wall time than the device's seconds: no cap.
    window, summary = _five_steps(monkeypatch, 1.0, [10.0, 10.6, 11.0])
    assert window["device"] == pytest.approx(150.0)  # 0.6 s over the 4 steady steps
    assert summary["device_ms"] == pytest.approx(250.0)  # 1.0 s over the same 4
    assert "device 250.0 ms per step" in format_timing(summary)
    # Eager backends cannot tell: no device figure, no diagnosis.
    blind = StepTimer(warmup_steps=1)
    blind.begin()
    blind.end()
    assert blind.summary(tokens_per_step=10, flops_per_token=None, peak_tflops=None, chips=1)["device_ms"] is None


def test_device_time_is_at_most_the_wall_time_that_passed(monkeypatch):
    # The runtime times each graph from its launch: graphs launched back to back (a replayed step's forward,
    # backward and optimizer) each count the others' runs as their wait. XLA:CPU read 16 s of device per 4.2 s step.
    window, summary = _five_steps(monkeypatch, 0.1, [0.0, 100.0, 200.0])
    # A few 0.1 s readings of the wall clock per step, not the device clock's 25 s per step.
    assert 0 < window["device"] < 500 and 0 < summary["device_ms"] < 500, (window, summary)
    assert summary["device_ms"] > window["device"]  # the wall clock went on between the two readings


def test_the_diagnosis_compares_host_and_device_time():
    def timing(host_ms, device_ms):
        return {"median_ms": {"data_wait": 0.0, "host": host_ms, "sync": 0.5, "other": 0.0}, "device_ms": device_ms}

    line = host_bound(timing(420.0, 50.0))
    assert line.startswith("host-bound: 0.42 s of host per step vs 0.05 s on the device") and "batch_size" in line
    assert host_bound(timing(40.0, 50.0)) is None
    assert host_bound(timing(0.5, 0.1)) is None  # below the floor: nothing to gain
    assert host_bound(timing(420.0, None)) is None  # device time unknown (CPU, CUDA)


def _deep_narrow(vocab: int) -> torch.nn.Module:
    layers = [torch.nn.Embedding(vocab, 8)]
    for _ in range(40):
        layers += [torch.nn.Linear(8, 8), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(8, vocab))


def _wide_shallow(vocab: int) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Embedding(vocab, 512), torch.nn.Linear(512, 2048), torch.nn.GELU(),
                               torch.nn.Linear(2048, vocab))


@pytest.mark.xla
@pytest.mark.skipif(XLA_BACKEND is None, reason="torch_xla not installed")
@pytest.mark.parametrize("make, bound", [(_deep_narrow, True), (_wide_shallow, False)], ids=["deep", "wide"])
def test_host_bound_fires_on_a_deep_narrow_model_and_not_on_a_wide_shallow_one(tmp_path, tiny_data, make, bound,
                                                                                one_thread):
    train, _, tok = tiny_data
    torch.manual_seed(0)
    cfg = tiny_config(tmp_path, device="xla", steps=4, log_every=4, eval_every=100, save_every=100,
                      xla_checks="strict", batch_size=8)
    report = Trainer(make(tok.vocab_size), train, config=cfg, backend=XLA_BACKEND, progress=False,
                     loss_fn=_logits_loss).fit()
    timing = report.timing
    assert timing["device_ms"] > 0 and timing["median_ms"]["host"] > 0
    line = report.xla["host_bound"]
    assert (line is not None) == bound, (timing, line)
    assert (timing["median_ms"]["host"] > timing["device_ms"]) == bound
    if bound:
        assert line.startswith("host-bound: ") and "XLA advice    host-bound" in str(report)
