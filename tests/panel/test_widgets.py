"""The tuning panel's logic (no browser), its ipywidgets view, and the tuning notebook under papermill.

The browser view of the same panel is tests/panel/test_panel_browser.py.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.support import NOTEBOOKS
from tpu_helpers.backend import get_backend
from tpu_helpers.core.hardware import lookup
from tpu_helpers.memory import analytic_estimate, largest_fitting_batch
from tpu_helpers.memory.probe import probe_batch_size
from tpu_helpers.memory.traced import gpt_batch, step_trainer
from tpu_helpers.models.gpt import GPT, gpt_config
from tpu_helpers.panel.options import (
    NOTEBOOK_PRESETS,
    chips_text,
    cost_text,
    duration_text,
    nearest_slice,
    slice_sizes,
)
from tpu_helpers.panel.tuning import TuningPanel
from tpu_helpers.platform.targets import TARGETS


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
    acc = panel.set(grad_accum=4)
    # Accumulating keeps every gradient alive while the next micro-batch runs (the trainer drops them only
    # between steps): the peak grows by at most the gradients.
    assert acc["global_batch"] == 4 * 16 * 8 and acc["breakdown"]["grads"] == acc["breakdown"]["params"]
    assert ck["peak_bytes"] < acc["peak_bytes"] <= ck["peak_bytes"] + acc["breakdown"]["grads"]


def test_step_time_and_cost_follow_mfu_run_length_and_price():
    panel = TuningPanel(preset="mini", hardware="v6e", chips=4, mfu=0.5, steps=1000)
    r = panel.result()
    slower = panel.set(mfu=0.25)
    assert slower["step_seconds_estimate"] == pytest.approx(2 * r["step_seconds_estimate"])
    longer = panel.set(steps=2000)
    assert longer["run_cost_usd_estimate"] == pytest.approx(2 * slower["run_cost_usd_estimate"])
    assert "ESTIMATE" in panel.summary() and "assumed 25% MFU" in panel.summary()
    assert "ESTIMATED cost: $" in panel.summary()
    assert panel.set(hardware="h200")["run_cost_usd_estimate"] is None  # no catalog price: no guess...
    assert "cost: no catalog price for NVIDIA H200" in panel.summary()  # ...but the line says so


@pytest.mark.parametrize("change, message", [
    ({"batch_size": 0}, "batch_size"), ({"seq_len": -3}, "seq_len"), ({"hardware": "tpu v9z"}, "tpu v9z"),
    ({"n_head": 5}, "divisible"), ({"mfu": 1.5}, "1.5"), ({"precision": "fp8"}, "fp8"), ({"colour": 1}, "colour"),
    ({"chips": 3}, "chips=3 is not a size TPU v5e comes in"), ({"global_batch": 100}, "not a multiple"),
])
def test_bad_value_is_refused_and_the_previous_state_kept(change, message):
    panel = TuningPanel(preset="mini")
    before = panel.result()
    with pytest.raises(ValueError, match=message):
        panel.set(**change)
    assert panel.result() == before


def test_verdict_first_and_a_suggestion_that_keeps_the_global_batch():
    panel = TuningPanel(preset="small", seq_len=1024, batch_size=36, hardware="v5e", chips=8)
    v = panel.verdict()
    assert v["headline"] == "DOES NOT FIT" and v["max_batch_size"] == 9 and v["percent"] > 100
    assert panel.summary().startswith("DOES NOT FIT (314% of HBM)")
    s = panel.suggestion()
    assert s.text.startswith("largest batch 9/chip: use batch 9/chip x accumulation 4 for global batch 288")
    assert "gradient checkpointing" in s.text  # the alternative, said too
    panel.apply_suggestion()
    assert (panel.state.batch_size, panel.state.grad_accum) == (9, 4)
    assert panel.verdict()["headline"] == "FITS" and panel.result()["global_batch"] == 288
    assert panel.suggestion() is None  # nothing left to do
    with pytest.raises(ValueError, match="no suggestion"):
        panel.apply_suggestion()
    # Fits with accumulation, and a larger micro-batch would too: fewer micro-batches, same global batch.
    panel.set(batch_size=2, grad_accum=18)
    s = panel.suggestion()
    assert s.changes == {"batch_size": 9, "grad_accum": 4} and "global batch 288" in s.text


def test_suggestion_turns_on_checkpointing_or_says_the_model_needs_sharding():
    panel = TuningPanel(preset="medium", n_layer=46, seq_len=1024, batch_size=4, hardware="v5e", chips=8,
                        precision="fp32")
    assert panel.result()["max_batch_size"] == 0
    s = panel.suggestion()
    assert s.text.startswith("not even batch 1/chip fits: turn on gradient checkpointing")
    panel.apply_suggestion()
    assert panel.state.gradient_checkpointing and panel.verdict()["fits"]
    # Too big for the slice even with fsdp over all its chips: advice (how many chips), nothing to apply.
    huge = TuningPanel(preset="medium", n_layer=400, seq_len=1024, batch_size=1, hardware="v5e", chips=1)
    s = huge.suggestion()
    assert s.changes is None and "it needs fsdp over 8 chips (sharding='fsdp' on a slice of 8" in s.text, s.text
    with pytest.raises(ValueError, match="nothing to apply"):
        huge.apply_suggestion()


def test_chip_counts_are_slices_that_exist():
    assert slice_sizes(lookup("v5e")) == (1, 4, 8, 16, 32, 64, 128, 256)
    assert slice_sizes(lookup("v4"))[:3] == (4, 8, 16)  # a v4-8 is 4 chips: no single-chip v4
    assert slice_sizes(lookup("h100"))[:6] == (1, 2, 4, 8, 16, 32)
    assert slice_sizes(lookup("cpu")) == (1,)
    assert nearest_slice(3, lookup("v5e")) == 4 and nearest_slice(6, lookup("v5e")) == 4
    TuningPanel(hardware="h100", chips=2)
    with pytest.raises(ValueError, match="choose one of 4, 8, 16"):
        TuningPanel(hardware="v4", chips=1)


def test_wording_one_chip_hours_prices_and_precision_warnings():
    assert chips_text(1) == "1 chip" and chips_text(8) == "8 chips"
    assert duration_text(5.12e-6) == "5.12 µs" and duration_text(0.0889) == "88.9 ms"
    assert duration_text(2.345) == "2.35 s" and duration_text(4000) == "67 min"
    assert duration_text(5.2 * 3600) == "5.2 h" and duration_text(3 * 86400) == "3.0 days"
    assert cost_text(None, lookup("t4"), 1) == "cost: no catalog price for NVIDIA T4"
    assert cost_text(0.001, lookup("v5e"), 1).startswith("ESTIMATED cost: under $0.01")
    panel = TuningPanel(preset="mini", hardware="t4", chips=1, precision="bf16")
    assert any("NVIDIA T4 has no bf16" in w for w in panel.warnings())
    assert "1 chip x" in panel.summary() and "1 chips" not in panel.summary()
    assert not any("bf16" in w for w in panel.set(precision="fp32") and panel.warnings())
    assert "0.00 h" not in TuningPanel(preset="tiny", seq_len=64, hardware="h100", chips=1).summary()


def test_the_panel_speaks_the_trainers_vocabulary():
    # One list of precisions (choices.PRECISIONS) and of optimizers, and the trainer's own setting names.
    from tpu_helpers.core.choices import OPTIMIZERS, PRECISIONS

    panel = TuningPanel(preset="mini", seq_len=256, batch_size=8, hardware="v5e", chips=1, precision="auto")
    auto = panel.result()["peak_bytes"]
    assert auto == panel.set(precision="bf16")["peak_bytes"]  # auto on a TPU is bf16, as the backend resolves it
    assert TuningPanel(preset="mini", hardware="t4", chips=1, precision="auto").warnings() == []  # t4: fp16
    weights = panel.set(precision="bf16", pure_bf16=True)["breakdown"]["params"]
    assert 2 * weights == panel.set(pure_bf16=False)["breakdown"]["params"]
    with pytest.raises(ValueError, match=r"pure_bf16=True stores the weights in bf16 and needs precision='bf16'"):
        panel.set(precision="fp32", pure_bf16=True)
    for optimizer in OPTIMIZERS:
        panel.set(optimizer=optimizer)
    for precision in PRECISIONS:
        panel.set(precision=precision)
    assert {"grad_accum", "gradient_checkpointing", "precision", "pure_bf16", "optimizer"} <= set(
        panel.result()["settings"])


def test_presets_load_the_notebooks_configurations():
    panel = TuningPanel()
    for name, (target, hardware, chips, precision) in NOTEBOOK_PRESETS.items():
        if name.startswith("fine-tune"):
            continue  # a Hugging Face model's sizes: test_the_fine_tuning_preset_reads_the_hf_config
        panel.load_preset(name)
        p, st = TARGETS[target].params, panel.state
        assert (st.preset, st.seq_len, st.batch_size, st.steps) == (p["PRESET"], p["SEQ_LEN"], p["BATCH_SIZE"],
                                                                     p["STEPS"])
        assert (st.hardware, st.chips, st.precision) == (hardware, chips, precision)
        assert st.sharding == ("fsdp" if "fsdp" in name else p.get("SHARDING", "data"))
    panel.load_preset("TPU VM v5e-8")
    assert panel.state.global_batch == 64 == panel.result()["global_batch"] and panel.state.grad_accum == 1
    panel.load_preset("Colab TPU v6e-1")
    assert panel.state.global_batch is None and panel.verdict()["fits"]
    with pytest.raises(ValueError, match="unknown notebook preset"):
        panel.load_preset("v9-1")


def test_the_fine_tuning_preset_reads_the_hf_config(tiny_lm_dir):
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(tiny_lm_dir)
    ft = TARGETS["cpu"].notebooks["finetune_llm"]
    panel = TuningPanel()
    panel.load_preset("fine-tune tiny Qwen2 (CPU)")
    st = panel.state
    assert (st.n_layer, st.n_head, st.n_embd, st.vocab_size) == (cfg.num_hidden_layers, cfg.num_attention_heads,
                                                                 cfg.hidden_size, cfg.vocab_size)
    assert (st.seq_len, st.batch_size, st.steps) == (ft["SEQ_LEN"], ft["BATCH_SIZE"], ft["STEPS"])
    panel.load_hf_model(str(tiny_lm_dir), seq_len=96)
    assert panel.state.seq_len == 96 and panel.state.n_embd == cfg.hidden_size and panel.verdict()["fits"]


def test_global_batch_mode_derives_the_accumulation():
    panel = TuningPanel(preset="mini", global_batch=256, batch_size=8, chips=8)
    assert panel.state.grad_accum == 4 and panel.result()["global_batch"] == 256
    assert panel.set(batch_size=16).get("global_batch") == 256 and panel.state.grad_accum == 2
    with pytest.raises(ValueError, match="global batch 256 is not a multiple of batch/chip x chips = 3 x 8"):
        panel.set(batch_size=3)


def test_an_invalid_value_marks_the_figures_stale_until_fixed():
    panel = TuningPanel(preset="mini")
    before = panel.result()
    assert panel.update(seq_len=0) and "seq_len" in panel.error
    assert panel.result() == before and panel.summary().startswith("STALE")
    assert any("STALE" in t.get_text() for t in panel.figure().texts)
    assert panel.update(seq_len=128) is None and panel.error is None
    assert not any("STALE" in t.get_text() for t in panel.figure().texts)


def test_a_tiny_estimate_is_still_visible_on_a_large_chip():
    fig = TuningPanel(preset="tiny", seq_len=64, batch_size=1, hardware="h200", chips=1).figure()
    left = fig.axes[0]
    assert any(line.get_marker() == "<" for line in left.lines)  # a marker where the invisible bar ends
    assert any("%" in t.get_text() for t in left.texts)


def _fake_oom_above(limit: int):
    """A loss (the trainer's form) that runs the real step but raises the CPU's OOM error above ``limit``
    sequences."""
    def loss_fn(output, targets):
        logits, _ = output
        if logits.shape[0] > limit:
            raise torch.OutOfMemoryError(f"fake: {logits.shape[0]} > {limit}")
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
    return loss_fn


def test_probe_bisects_to_the_exact_limit_within_its_budget_or_says_at_least():
    trainer = step_trainer(GPT(gpt_config("tiny")), get_backend("cpu"), precision="fp32",
                           loss_fn=_fake_oom_above(37))

    def probe(**kw):
        return probe_batch_size(trainer, gpt_batch(16, 256), steps_per_try=1, **kw)

    near = probe(start=30, growth=1.25, max_tries=8)  # from a good estimate: small steps, then bisect
    assert [t["batch_size"] for t in near.tries] == [30, 37, 46, 41, 39, 38]
    assert near.max_batch_size == 37 and near.exact and "exactly 37/chip (38 ran out" in near.summary()
    far = probe(start=1, max_tries=20)  # from far away, doubling
    assert far.max_batch_size == 37 and far.exact
    short = probe(start=30, growth=1.25, max_tries=3)
    assert short.max_batch_size == 37 and not short.exact and short.answer().startswith("at least 37/chip (46 ran")
    capped = probe(start=8, max_batch_size=16, max_tries=4)
    assert capped.max_batch_size == 16 and "the probe's cap" in capped.answer()
    assert "on CPU" in near.conditions() and "fp32" in near.conditions() and "cap" not in near.conditions()
    with pytest.raises(ValueError, match="growth"):
        probe(growth=1.0)


def test_panel_probe_starts_from_the_estimate_for_the_device_it_runs_on():
    backend = get_backend("cpu")
    panel = TuningPanel(preset="tiny", seq_len=64, batch_size=8, hardware="v5e", chips=8, precision="bf16")
    plan = panel.probe_start(backend, cpu_limit_bytes=16 * 2**20, max_batch_size=256)
    expected = largest_fitting_batch(lambda b: analytic_estimate("tiny", b, 64, precision="fp32"), 16 * 2**20)
    assert plan == {"start": expected, "precision": "fp32", "pure_bf16": False, "memory_limit_bytes": 16 * 2**20}
    assert plan["start"] != panel.result()["max_batch_size"]  # not the target chip's answer
    result = panel.probe(backend, max_tries=2, max_batch_size=256, cpu_limit_bytes=16 * 2**20)
    assert result.tries[0]["batch_size"] == plan["start"] and result.memory_limit_bytes == 16 * 2**20
    assert panel.probe_changes() == {"batch_size": result.max_batch_size}  # "use this batch"
    panel.set(hardware="v6e", chips=4)  # another target: the probe still applies
    assert panel.probe_changes() == {"batch_size": result.max_batch_size}
    panel.set(seq_len=32)  # another model shape: it does not
    assert panel.probe_changes() is None
    panel._probe_lock.acquire()
    try:
        with pytest.raises(RuntimeError, match="already running"):
            panel.probe(backend)
    finally:
        panel._probe_lock.release()


def test_widget_controls_drive_the_panel():
    from tpu_helpers.panel.widgets import PanelView

    panel = TuningPanel(preset="small", seq_len=1024, batch_size=8, hardware="v5e", chips=8)
    view = PanelView(panel)
    c = view.controls
    assert [label for label, _ in c["chips"].options][:3] == ["1 chip", "4 chips", "8 chips"]
    renders = view.renders
    c["batch_size"].value = 36
    assert panel.state.batch_size == 36 and view.renders == renders + 1
    assert view.verdict.value.count("DOES NOT FIT") == 1 and "accumulation 4" in view.suggestion.value
    assert not view.apply.disabled
    view._on_apply(None)
    assert (c["batch_size"].value, c["grad_accum"].value, c["global_batch"].value) == (9, 4, 288)
    c["hardware"].value = "v4"  # 8 chips exist for a v4 too; 1 does not
    assert c["chips"].value == 8 and [n for _, n in c["chips"].options][0] == 4
    c["seq_len"].value = 0  # refused: said in red, figures stale, state unchanged
    assert panel.state.seq_len == 1024 and "seq_len" in view.error.value and "STALE" in view.verdict.value
    c["seq_len"].value = 512
    assert panel.error is None and view.error.value == ""
    c["config"].value = "TPU VM v5e-8"
    assert c["mode"].value == "global" and c["global_batch"].value == 64 and c["grad_accum"].disabled
    c["batch_size"].value = 4
    assert c["grad_accum"].value == 2 and c["config"].value == "custom"


def test_colab_gets_its_custom_widget_manager_only_with_ipywidgets_8(monkeypatch):
    import sys
    import types

    import ipywidgets

    from tpu_helpers.panel.widgets import enable_colab_widgets

    monkeypatch.delenv("COLAB_RELEASE_TAG", raising=False)
    assert enable_colab_widgets() == "not colab"
    calls = []
    output = types.SimpleNamespace(enable_custom_widget_manager=lambda: calls.append("enabled"))
    colab = types.ModuleType("google.colab")
    colab.output = output
    monkeypatch.setitem(sys.modules, "google.colab", colab)
    monkeypatch.setitem(sys.modules, "google.colab.output", output)
    monkeypatch.setattr(ipywidgets, "__version__", "7.7.1")
    assert enable_colab_widgets() == "builtin" and calls == []  # what Colab ships renders as it is
    monkeypatch.setattr(ipywidgets, "__version__", "8.1.7")
    assert enable_colab_widgets() == "custom manager" and calls == ["enabled"]


@pytest.mark.notebooks
def test_tuning_notebook_records_its_numbers(tmp_path):
    import papermill as pm

    out_dir = tmp_path / "tuning"
    pm.execute_notebook(str(NOTEBOOKS["batch_size_tuning"]), str(tmp_path / "out.ipynb"), kernel_name="python3",
                        parameters={"DEVICE": "cpu", "PRESET": "tiny", "SEQ_LEN": 64, "BATCH_SIZE": 8,
                                    "HARDWARE": "t4", "CHIPS": 2, "SHARDING": "fsdp", "PROBE": True, "PROBE_MAX_TRIES": 4,
                                    "PROBE_MAX_BATCH": 256, "PROBE_CPU_LIMIT_MB": 64,
                                    "OUT_DIR": str(out_dir)}, progress_bar=False)
    results = json.loads((out_dir / "results.json").read_text())
    assert (out_dir / "memory.png").stat().st_size > 1000
    assert results["hardware"] == "NVIDIA T4" and results["global_batch"] == 16 and results["fits"]
    assert results["max_batch_size"] >= 8 and results["step_seconds_estimate"] > 0
    assert results["verdict"]["headline"] == "FITS" and any("no bf16" in w for w in results["warnings"])
    assert (results["sharding"], results["fsdp_chips"]) == ("fsdp", 2)
    assert results["sharding_text"].startswith("sharding='fsdp' (fsdp over 2 chips)")
    probe = results["probe"]
    assert 0 < probe["max_batch_size"] < 256 and any(not t["ok"] for t in probe["tries"])
    assert len(probe["tries"]) <= 4 and probe["device"].startswith("CPU") and probe["memory_limit_bytes"] == 64 << 20
