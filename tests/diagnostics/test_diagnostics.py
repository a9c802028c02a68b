"""The XLA problem detector on XLA:CPU: it names each bad pattern, stays quiet on the package's loop, and strict
mode raises. Also the XLA-safe kl_div, the PT_XLA_DEBUG switch and the step-time split in the report."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from tests.support import XLA_BACKEND, script_result, tiny_config
from tpu_helpers.demos.xla_loops import run_loop
from tpu_helpers.diagnostics import XlaPerformanceError, XlaPerformanceWarning, xla_safe_kl_div
from tpu_helpers.diagnostics.xla_debug import enable_xla_debug
from tpu_helpers.training.step_timing import StepTimer

xla = pytest.mark.skipif(XLA_BACKEND is None, reason="torch_xla is not installed")


def _token_model(vocab: int) -> torch.nn.Module:
    # Token ids -> logits; far quicker to compile on XLA:CPU than the GPT, and enough to show each pattern.
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(vocab, 16), torch.nn.Linear(16, vocab))


def _run(tmp_path, tiny_data, patterns, **overrides):
    cfg = tiny_config(tmp_path, **{"device": "xla", "steps": 5, "log_every": 5, "eval_every": 100,
                                   "save_every": 100, **overrides})
    return run_loop(cfg, backend=XLA_BACKEND, patterns=patterns, data=tiny_data,
                    model=_token_model(tiny_data[2].vocab_size))


@xla
@pytest.mark.xla
@pytest.mark.parametrize("pattern, cause", [("shapes", "shape_change"), ("value", "changing_value"),
                                            ("item", "host_read"), ("fallback", "cpu_fallback")])
def test_detector_names_each_bad_pattern_and_only_that_one(tmp_path, tiny_data, pattern, cause):
    result = _run(tmp_path, tiny_data, [pattern])
    assert result["causes"] == [cause], result["problems"]
    assert "step " in result["problems"][0]


@xla
@pytest.mark.xla
def test_detector_is_silent_on_the_package_loop_with_logs_evals_and_checkpoints(tmp_path, tiny_data):
    with warnings.catch_warnings():
        warnings.simplefilter("error", XlaPerformanceWarning)
        result = _run(tmp_path, tiny_data, [], steps=8, log_every=2, eval_every=3, save_every=4)
    assert result["trainer"] == "Trainer"  # the package's own loop, not the bad-loop trainer with no patterns
    assert result["problems"] == []
    assert result["compilations"] <= 3
    assert result["cpu_fallback_ops"] == 0


@xla
@pytest.mark.xla
def test_strict_mode_raises_at_the_first_problem(tmp_path, tiny_data):
    with pytest.raises(XlaPerformanceError, match=r"step 1: .*device-to-host.*strict"):
        _run(tmp_path, tiny_data, ["item"], xla_checks="strict")


@pytest.mark.filterwarnings("ignore:reduction. 'mean'")
@pytest.mark.parametrize("reduction", ["batchmean", "sum", "mean", "none"])
@pytest.mark.parametrize("log_target", [False, True])
def test_xla_safe_kl_div_matches_torch(reduction, log_target):
    logits = torch.randn(6, 10)
    target = torch.softmax(torch.randn(6, 10), -1)
    if log_target:
        target = target.log()
    else:
        target[0, 0] = 0.0  # 0 * log 0 must count as 0, as in torch
    inp = F.log_softmax(logits, -1)
    expected = F.kl_div(inp, target, reduction=reduction, log_target=log_target)
    torch.testing.assert_close(xla_safe_kl_div(inp, target, reduction=reduction, log_target=log_target), expected)
    with pytest.raises(ValueError, match="reduction='avg'"):
        xla_safe_kl_div(inp, target, reduction="avg")


@xla
@pytest.mark.xla
def test_debug_switch_refuses_once_the_runtime_runs_and_summarises_a_fresh_process(tmp_path):
    with pytest.raises(RuntimeError, match="already started"):
        enable_xla_debug(tmp_path / "late.txt")
    summary = script_result("xla_debug_run", {"log": str(tmp_path / "debug.txt")}, env={"PJRT_DEVICE": "CPU"})
    assert summary["graphs"] == summary["compilations"] >= 3
    assert summary["executions"] >= summary["compilations"] + 1
    assert any("xla_debug_run.py" in k for k in summary["triggers"]), summary["triggers"]


def test_step_timer_splits_steps_and_computes_mfu_against_the_peak():
    timer = StepTimer(warmup_steps=1)
    timer.steps = [(0.0, 5.0, 5.0, 0.0)] + [(0.001, 0.003, 0.006, 0.002)] * 4  # a slow compiling first step
    s = timer.summary(tokens_per_step=1000, flops_per_token=1e9, peak_tflops=100.0, chips=2)
    assert s["warmup_s"] == pytest.approx(10.0)
    assert s["median_ms"] == pytest.approx({"data_wait": 1.0, "host": 3.0, "sync": 6.0, "other": 2.0})
    assert s["steady_tokens_per_s"] == pytest.approx(1000 / 0.010)  # eval/save time is not training time
    assert s["mfu"] == pytest.approx(1e5 * 1e9 / (2 * 100e12))
    assert timer.summary(tokens_per_step=1000, flops_per_token=None, peak_tflops=100.0, chips=1)["mfu"] is None


@pytest.mark.xla
@xla
def test_step_metrics_are_the_counters_of_metrics_read_cheaply() -> None:
    """What the detector reads after every step (and the trackers log from it) equals the full metrics' counters."""
    b = XLA_BACKEND
    x = torch.ones(3).to(b.device)
    for _ in range(3):
        x = x * 2 + 1
        b.sync()
    x.cpu()
    # Both read counters of the whole process, whose executions run asynchronously: one still finishing (a fresh
    # clone's full run once read 5 executions, then 6) is waited for, and the two read again, a few times at most.
    import torch_xla.core.xla_model as xm

    for _ in range(5):
        xm.wait_device_ops()
        cheap, full = b.step_metrics(), b.metrics()
        if cheap == {k: full[k] for k in cheap}:
            break
    assert set(cheap) == {"compilations", "device_to_host_transfers", "executions", "cpu_fallback_ops"}
    assert cheap == {k: full[k] for k in cheap}
    assert cheap["executions"] >= 3 and cheap["device_to_host_transfers"] >= 1
