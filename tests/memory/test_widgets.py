"""The tuning panel's logic (no browser), its ipywidgets view, and the tuning notebook under papermill."""

from __future__ import annotations

import json

import pytest

from tests.support import NOTEBOOKS
from tpu_helpers.memory import analytic_estimate
from tpu_helpers.memory.widgets import TuningPanel


def test_panel_recomputes_on_every_change():
    panel = TuningPanel(preset="small", seq_len=1024, batch_size=8, hardware="v5e", chips=8, precision="bf16")
    r = panel.result()
    assert r["hardware"] == "TPU v5e" and r["attention"] == "math"  # XLA materialises the attention matrix
    assert r["global_batch"] == 64 and r["tokens_per_step"] == 64 * 1024
    big = panel.set(batch_size=16)
    assert big["peak_bytes"] > r["peak_bytes"] and big["max_batch_size"] == r["max_batch_size"]
    # The largest batch fits the budget and one more does not (same estimate the panel uses).
    def est(b):
        return analytic_estimate("small", b, 1024, precision="bf16", attention="math")

    assert est(r["max_batch_size"]).peak_bytes <= r["budget_bytes"] < est(r["max_batch_size"] + 1).peak_bytes
    ck = panel.set(gradient_checkpointing=True)
    assert ck["max_batch_size"] > big["max_batch_size"]
    assert ck["step_seconds_estimate"] > big["step_seconds_estimate"]  # recompute costs time
    acc = panel.set(accumulation=4)
    assert acc["global_batch"] == 4 * 16 * 8 and acc["peak_bytes"] == ck["peak_bytes"]


def test_step_time_and_cost_follow_mfu_run_length_and_price():
    panel = TuningPanel(preset="mini", hardware="v6e", chips=4, mfu=0.5, steps=1000)
    r = panel.result()
    slower = panel.set(mfu=0.25)
    assert slower["step_seconds_estimate"] == pytest.approx(2 * r["step_seconds_estimate"])
    longer = panel.set(steps=2000)
    assert longer["run_cost_usd_estimate"] == pytest.approx(2 * slower["run_cost_usd_estimate"])
    assert "ESTIMATE" in panel.summary() and "assumed 25% MFU" in panel.summary()
    assert panel.set(hardware="h200")["run_cost_usd_estimate"] is None  # no catalog price: no cost, no guess


@pytest.mark.parametrize("change, message", [
    ({"batch_size": 0}, "batch_size"), ({"seq_len": -3}, "seq_len"), ({"hardware": "tpu v9z"}, "tpu v9z"),
    ({"n_head": 5}, "divisible"), ({"mfu": 1.5}, "1.5"), ({"precision": "fp8"}, "fp8"), ({"colour": 1}, "colour"),
])
def test_bad_value_is_refused_and_the_previous_state_kept(change, message):
    panel = TuningPanel(preset="mini")
    before = panel.result()
    with pytest.raises(ValueError, match=message):
        panel.set(**change)
    assert panel.result() == before


def test_widget_controls_drive_the_panel():
    panel = TuningPanel(preset="tiny", seq_len=64, hardware="t4")
    box = panel.widget()
    controls = {c.description: c for row in box.children[:2] for c in row.children}
    controls["batch/chip"].value = 64
    assert panel.state.batch_size == 64 and panel.result()["global_batch"] == 64 * panel.state.chips
    controls["hardware"].value = "h100"
    assert panel.result()["hardware"] == "NVIDIA H100"
    controls["seq len"].value = 0  # refused: shown in red, state unchanged
    assert panel.state.seq_len == 64 and "seq_len" in box.children[2].value


@pytest.mark.notebooks
def test_tuning_notebook_records_its_numbers(tmp_path):
    import papermill as pm

    out_dir = tmp_path / "tuning"
    pm.execute_notebook(str(NOTEBOOKS["batch_size_tuning"]), str(tmp_path / "out.ipynb"), kernel_name="python3",
                        parameters={"DEVICE": "cpu", "PRESET": "tiny", "SEQ_LEN": 64, "BATCH_SIZE": 8,
                                    "HARDWARE": "t4", "CHIPS": 2, "PROBE": True, "PROBE_MAX_TRIES": 4,
                                    "PROBE_MAX_BATCH": 256, "PROBE_CPU_LIMIT_MB": 64,
                                    "OUT_DIR": str(out_dir)}, progress_bar=False)
    results = json.loads((out_dir / "results.json").read_text())
    assert (out_dir / "memory.png").stat().st_size > 1000
    assert results["hardware"] == "NVIDIA T4" and results["global_batch"] == 16 and results["fits"]
    assert results["max_batch_size"] >= 8 and results["step_seconds_estimate"] > 0
    probe = results["probe"]
    assert 0 < probe["max_batch_size"] < 256 and any(not t["ok"] for t in probe["tries"])
    assert len(probe["tries"]) <= 4
