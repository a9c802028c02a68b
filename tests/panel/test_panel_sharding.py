"""The tuning panel knows the sharding: per-chip bytes under SHARDING, the sharding plan's line, the fsdp suggestion,
and the control in the ipywidgets view (real widgets, no browser).

The model that needs it: GPT-2 XL's sizes (1.6B) and Qwen2-1.5B from a config dict (built on the meta device, no
download), trained in bf16 with AdamW: neither fits one 16 GB v5e chip data parallel, both do under fsdp on 8.
"""

from __future__ import annotations

import pytest

from tpu_helpers.core.hardware import format_bytes, lookup
from tpu_helpers.memory import analytic_estimate, largest_fitting_batch
from tpu_helpers.memory.analytic import block_params, param_counts, resolve_config
from tpu_helpers.memory.per_chip import sharding_plan
from tpu_helpers.panel.options import keep_sharding, sharding_options
from tpu_helpers.panel.tuning import TuningPanel

XL = dict(preset="medium", n_layer=48, n_head=25, n_embd=1600)  # GPT-2 XL's sizes on the medium preset's vocab
QWEN2_15B = dict(model_type="qwen2", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                 num_attention_heads=12, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
                 max_position_embeddings=32768)


def xl_panel(**kw) -> TuningPanel:
    return TuningPanel(**{**XL, "seq_len": 1024, "batch_size": 1, "hardware": "v5e", "chips": 8, **kw})


def xl_plan():
    """The sharding plan of the XL step, computed here from the estimate, not by the panel."""
    cfg = resolve_config("medium", n_layer=48, n_head=25, n_embd=1600)
    return cfg, sharding_plan(lambda b: analytic_estimate(cfg, b, 1024, precision="bf16", attention="math"), 1,
                              chips=8, hardware="v5e", block_params=block_params(cfg),
                              params=param_counts(cfg)[0], what="training")


def test_fsdp_makes_a_model_too_big_for_one_chip_fit_and_the_line_says_so():
    cfg, plan = xl_plan()
    panel = xl_panel()
    v = panel.verdict()
    assert v["headline"] == "DOES NOT FIT" and v["max_batch_size"] == 0
    # The line: the chosen sharding's bytes, then the plan's own advice with the plan's numbers.
    line = panel.sharding_text()
    data = format_bytes(plan.per_chip["data"].peak_bytes)
    assert line == "T" + plan.advice()[1:] and f"data parallel needs {data} per chip" in line
    assert plan.min_fsdp_chips() == 4 and "needs fsdp over at least 4 chips" in line
    assert "1.6B model" in line and format_bytes(plan.per_chip["fsdp x4"].peak_bytes) in line
    assert panel.result()["per_chip_bytes_by_sharding"] == {k: e.peak_bytes for k, e in plan.per_chip.items()}
    assert line in panel.summary().splitlines()
    # Not even batch 1 fits data parallel: the suggestion is fsdp over the slice, applied by the button.
    s = panel.suggestion()
    sharded = largest_fitting_batch(lambda b: xl_plan_estimate(cfg, b), plan.budget_bytes)
    assert sharded >= 1
    assert s.text.startswith(f"not even batch 1/chip fits: use sharding='fsdp' (fits at {sharded}/chip)"), s.text
    panel.apply_suggestion()
    assert panel.state.sharding == "fsdp" and panel.verdict()["fits"]
    assert panel.result()["peak_bytes"] == plan.per_chip["fsdp x8"].peak_bytes
    assert panel.verdict()["max_batch_size"] == sharded
    assert "with fsdp over 8 chips" in panel.verdict()["text"]
    assert panel.sharding_text() == (f"sharding='fsdp' (fsdp over 8 chips): "
                                     f"{format_bytes(plan.per_chip['fsdp x8'].peak_bytes)} per chip at batch 1/chip. "
                                     f"T{plan.advice()[1:]}")
    assert "fsdp x8" in panel.figure().axes[0].get_title(loc="left")
    # A 2-D mesh: fsdp within groups of 4, the per-chip bytes of fsdp over 4.
    panel.set(sharding="2X4")
    assert panel.state.sharding == "2x4" and panel.result()["fsdp_chips"] == 4
    assert panel.result()["peak_bytes"] == plan.per_chip["fsdp x4"].peak_bytes and panel.verdict()["fits"]
    assert panel.set(sharding="4x2")["peak_bytes"] == plan.per_chip["fsdp x2"].peak_bytes
    assert not panel.verdict()["fits"]


def xl_plan_estimate(cfg, b):
    from tpu_helpers.memory.per_chip import shard_estimate

    return shard_estimate(analytic_estimate(cfg, b, 1024, precision="bf16", attention="math"), 8,
                          block_params=block_params(cfg))


def test_a_hugging_face_config_counts_its_own_parameters_and_decoder_layer():
    panel = TuningPanel(hardware="v5e", chips=8)
    panel.load_hf_model(QWEN2_15B, seq_len=512, batch_size=1)
    h, inter, kv = 1536, 8960, 2 * 128  # two key/value heads of 128
    layer = (h * h + h) + 2 * (h * kv + kv) + h * h + 3 * h * inter + 2 * h  # q, k, v (biases), o, SwiGLU, norms
    assert panel.state.block_params == layer
    assert panel.state.model_params == 28 * layer + 151936 * h + h  # tied embedding, final norm
    line = panel.sharding_text()
    # The trainer drops the gradients between steps: at the backward's start the activations, at its end the
    # gradients are alive, not both (12.4 GiB per chip over 2 chips).
    assert line.startswith("Training of this 1.5B model needs fsdp over at least 2 chips of TPU v5e"), line
    assert not panel.verdict()["fits"] and panel.plan.per_chip["data"].peak_bytes > 25e9  # about 27 GB
    panel.apply_suggestion()
    assert panel.state.sharding == "fsdp" and panel.verdict()["fits"]
    # Its model state, not the GPT formula's at the same sizes, is what fsdp divides.
    gpt = TuningPanel(preset="small", n_layer=28, n_head=12, n_embd=1536, vocab_size=151936, seq_len=512,
                      batch_size=1, hardware="v5e", chips=8, sharding="fsdp")
    ratio = panel.result()["breakdown"]["params"] / gpt.result()["breakdown"]["params"]
    assert ratio == pytest.approx(panel.state.model_params / param_counts(gpt.model_config())[0], rel=1e-3)
    with pytest.raises(ValueError, match="model_type"):
        panel.load_hf_model({"hidden_size": 64})


@pytest.mark.parametrize("settings, value, message", [
    ({}, "3x3", "sharding='3x3' needs 3 x 3 = 9 chips but this run has 8"),
    ({}, "zero", "sharding='zero' is not one of"),
    ({"hardware": "h100"}, "2x4", "sharding='2x4': a DxF mesh needs an XLA SPMD run"),
    ({"chips": 16}, "fsdp", "fsdp over 16 chips spans several of the 2 hosts"),
])
def test_a_bad_sharding_is_refused_naming_it_and_the_figures_go_stale(settings, value, message):
    panel = xl_panel(**settings)
    before = panel.result()
    assert panel.update(sharding=value) and message in panel.error, panel.error
    assert panel.result() == before and panel.summary().startswith("STALE")
    with pytest.raises(ValueError, match=message.replace("(", r"\(")[:30]):
        panel.set(sharding=value)


def test_the_sharding_choices_follow_the_slice():
    v5e, h100 = lookup("v5e"), lookup("h100")
    assert sharding_options(v5e, 8) == ["data", "fsdp", "4x2", "2x4"]
    assert sharding_options(v5e, 16) == ["data", "8x2", "4x4", "2x8"]  # fsdp stays within a host of 8
    assert sharding_options(v5e, 1) == ["data", "fsdp"] and sharding_options(h100, 8) == ["data", "fsdp"]
    assert keep_sharding("2x4", 16, v5e) == "4x4"  # the fsdp size kept, the data size adjusted
    assert keep_sharding("2x4", 4, v5e) == "fsdp" and keep_sharding("fsdp", 16, v5e) == "2x8"
    assert keep_sharding("2x4", 8, h100) == "fsdp" and keep_sharding("data", 16, v5e) == "data"
    # The plan on a 2-host slice lists what the trainer allows: fsdp up to one host's 8 chips.
    assert list(xl_panel(chips=16).result()["per_chip_bytes_by_sharding"]) == ["data", "fsdp x2", "fsdp x4",
                                                                             "fsdp x8"]


def test_when_nothing_on_the_slice_fits_the_panel_says_what_it_needs():
    one_chip = TuningPanel(preset="medium", n_layer=400, seq_len=1024, batch_size=1, hardware="v5e", chips=1)
    s = one_chip.suggestion()
    assert s.changes is None and "not even batch 1/chip fits on 1 chip of TPU v5e, with checkpointing" in s.text
    assert "it needs fsdp over 8 chips" in s.text
    assert "does not fit on one chip of TPU v5e" in one_chip.sharding_text()
    huge = TuningPanel(preset="medium", n_layer=4000, seq_len=1024, batch_size=1, hardware="v5e", chips=8)
    s = huge.suggestion()
    assert s.changes is None and "fsdp is limited to 8 chips (one host" in s.text, s.text


def test_the_notebook_preset_of_the_v5e8_with_fsdp():
    panel = TuningPanel()
    panel.load_preset("TPU VM v5e-8, SHARDING fsdp")
    assert (panel.state.sharding, panel.state.chips, panel.result()["fsdp_chips"]) == ("fsdp", 8, 8)
    panel.load_preset("Colab TPU v6e-1")
    assert panel.state.sharding == "data"


def test_the_widget_sharding_control_drives_the_panel():
    from tpu_helpers.panel.widgets import PanelView

    _, plan = xl_plan()
    panel = xl_panel()
    view = PanelView(panel)
    c = view.controls
    assert c["sharding"].value == "data" and list(c["sharding"].options) == ["data", "fsdp", "4x2", "2x4"]
    assert "DOES NOT FIT" in view.verdict.value and "needs fsdp over at least 4 chips" in view.sharding.value
    assert format_bytes(plan.per_chip["data"].peak_bytes) in view.sharding.value
    assert "use sharding=&#x27;fsdp&#x27;" in view.suggestion.value and not view.apply.disabled
    view._on_apply(None)
    assert c["sharding"].value == "fsdp" == panel.state.sharding and "FITS" in view.verdict.value
    c["sharding"].value = "3x3"  # typed: refused in red, naming it; the figures stale
    assert panel.state.sharding == "fsdp" and "3x3" in view.error.value and "STALE" in view.verdict.value
    c["sharding"].value = "2x4"
    assert panel.error is None and panel.result()["fsdp_chips"] == 4 and view.error.value == ""
    c["chips"].value = 16  # the mesh keeps its fsdp size on the larger slice
    assert c["sharding"].value == "4x4" == panel.state.sharding
    assert list(c["sharding"].options) == ["data", "8x2", "4x4", "2x8"]
    c["hardware"].value = "h100"  # no meshes under torchrun: fsdp over the GPUs
    assert panel.state.sharding == "fsdp" and list(c["sharding"].options) == ["data", "fsdp"]
    c["config"].value = "TPU VM v5e-8"
    assert c["sharding"].value == "data" and panel.state.n_layer is None
    panel.load_hf_model({**QWEN2_15B, "num_hidden_layers": 2, "hidden_size": 96, "intermediate_size": 256,
                         "num_attention_heads": 4, "vocab_size": 512})
    view._sync_controls()
    assert panel.state.model_params and panel.state.n_layer == 2
    c["preset"].value = "mini"  # a GPT preset: the Hugging Face sizes no longer apply
    assert panel.state.n_layer is None and panel.state.model_params is None and panel.state.block_params is None
