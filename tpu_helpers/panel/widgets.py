"""The batch-size tuning panel as ipywidgets: a thin view over :class:`tpu_helpers.panel.tuning.TuningPanel`.

    panel = TuningPanel(preset="small", seq_len=1024, hardware="v5e", chips=8)
    view = PanelView(panel, backend).show()

Layout: the verdict first (FITS / DOES NOT FIT on a coloured band), the suggestion with an "apply suggestion"
button, then the controls as fixed-width items (label 150 px, item 275 px) in rows that wrap, so every control stays visible at
a laptop's 1280 px and spreads out at 1920 px; warnings, the figures, the chart, and the probe with its busy state.

Works with ipywidgets 7.7.1 (what Colab's runtime ships) and 8.x: only APIs both have are used (no Output widget
either: the chart is an Image of a ``matplotlib.figure.Figure``, the text HTML, both set from any thread). Callbacks
are serialised by one lock (ipykernel 7 may run them on another thread). On Colab with ipywidgets 8, ``show``
enables Colab's custom widget manager first, without which Colab does not render ipywidgets 8 controls.
"""

from __future__ import annotations

import html
import os
import sys
import threading
from typing import Any

from tpu_helpers.core.choices import OPTIMIZERS, PRECISIONS
from tpu_helpers.core.hardware import CATALOG
from tpu_helpers.memory.report import resolve_hardware
from tpu_helpers.models.gpt import PRESETS
from tpu_helpers.panel.figure import figure_png
from tpu_helpers.panel.options import (
    GPT_SIZES,
    NOTEBOOK_PRESETS,
    chips_text,
    keep_sharding,
    nearest_slice,
    preset_settings,
    sharding_options,
    slice_sizes,
)
from tpu_helpers.panel.saving import panel_from_config, save_tuning_results
from tpu_helpers.panel.tuning import TuningPanel

__all__ = ["PanelView", "TuningPanel", "enable_colab_widgets", "panel_from_config", "save_tuning_results"]

LABEL_WIDTH, ITEM_WIDTH = "150px", "275px"
CUSTOM = "custom"


def enable_colab_widgets() -> str:
    """Make the panel render in Colab: ``"not colab"``, ``"builtin"`` (ipywidgets 7, which Colab's runtime ships
    and renders natively) or ``"custom manager"`` (ipywidgets 8: Colab's own renderer shows a "third-party widgets"
    notice instead of the controls; its CDN widget manager, switched on here, renders them).

    The manager is tagged onto display messages by a display hook (google/colab/output/_widgets.py), so the panel
    is shown with ``display`` (``show``), not as a cell's result.
    """
    if "google.colab" not in sys.modules and not os.environ.get("COLAB_RELEASE_TAG"):
        return "not colab"
    import ipywidgets

    if int(ipywidgets.__version__.split(".")[0]) < 8:
        return "builtin"
    try:
        from google.colab import output  # type: ignore[import-not-found]
    except ImportError:  # a Colab-like environment variable without Colab's package
        return "not colab"
    output.enable_custom_widget_manager()
    return "custom manager"


class PanelView:
    """Controls -> ``panel.update`` -> verdict, suggestion, figures and chart; the probe runs on a thread."""

    def __init__(self, panel: TuningPanel, backend=None, **probe_kwargs: Any) -> None:
        import ipywidgets as w

        self.panel, self.backend, self.probe_kwargs = panel, backend, probe_kwargs
        self._lock = threading.RLock()
        self._syncing = False
        self.renders = 0
        style, item = {"description_width": LABEL_WIDTH}, w.Layout(width=ITEM_WIDTH)

        def ctl(cls, name: str, label: str, **kw: Any):
            c = cls(description=label, style=style, layout=w.Layout(width=ITEM_WIDTH), **kw)
            c.add_class(f"tpu-ctl-{name}")
            return c

        self.controls = {
            "config": ctl(w.Dropdown, "config", "notebook config", options=[CUSTOM, *NOTEBOOK_PRESETS], value=CUSTOM),
            "preset": ctl(w.Dropdown, "preset", "model", options=sorted(PRESETS)),
            "seq_len": ctl(w.IntText, "seq_len", "sequence length"),
            "mode": ctl(w.Dropdown, "mode", "batch given as",
                        options=[("per chip", "per_chip"), ("global batch", "global")]),
            "batch_size": ctl(w.IntText, "batch_size", "batch per chip"),
            "grad_accum": ctl(w.IntText, "grad_accum", "grad accumulation"),
            "global_batch": ctl(w.IntText, "global_batch", "global batch"),
            "precision": ctl(w.Dropdown, "precision", "precision", options=list(PRECISIONS)),
            "pure_bf16": ctl(w.Checkbox, "pure_bf16", "weights in bf16 (pure_bf16)", indent=False),
            "gradient_checkpointing": ctl(w.Checkbox, "gradient_checkpointing", "gradient checkpointing",
                                          indent=False),
            "optimizer": ctl(w.Dropdown, "optimizer", "optimizer", options=list(OPTIMIZERS)),
            "hardware": ctl(w.Dropdown, "hardware", "target chip",
                            options=[(spec.name, key) for key, spec in CATALOG.items()]),
            "chips": ctl(w.Dropdown, "chips", "chips (slice)", options=[("1 chip", 1)]),
            # Typed or picked: "data", "fsdp" or a DxF mesh; applied on Enter (a half-typed "2x" is not an error).
            "sharding": ctl(w.Combobox, "sharding", "sharding", options=["data"], ensure_option=False,
                            continuous_update=False, placeholder="data | fsdp | DxF"),
            "mfu": ctl(w.FloatText, "mfu", "MFU (assumed)", step=0.05),
            "steps": ctl(w.IntText, "steps", "run steps"),
        }
        self.verdict, self.error, self.suggestion, self.sharding = w.HTML(), w.HTML(), w.HTML(), w.HTML()
        self.apply = w.Button(description="apply suggestion", button_style="primary", layout=item)
        self.warnings, self.details = w.HTML(), w.HTML()
        self.chart = w.Image(format="png", layout=w.Layout(width="100%", max_width="900px"))
        for name, widget in (("verdict", self.verdict), ("sharding", self.sharding), ("error", self.error),
                             ("suggestion", self.suggestion),
                             ("apply", self.apply), ("warnings", self.warnings), ("details", self.details),
                             ("chart", self.chart)):
            widget.add_class(f"tpu-{name}")
        grid = w.Box(list(self.controls.values()),
                     layout=w.Layout(display="flex", flex_flow="row wrap", width="100%", align_items="center"))
        grid.add_class("tpu-controls")
        items = [self.verdict, self.sharding,
                 w.HBox([self.apply, self.suggestion], layout=w.Layout(align_items="center")),
                 grid, self.error, self.warnings, self.details, self.chart]
        if backend is not None:
            self.probe_button = w.Button(description="probe this device", icon="search", layout=item)
            self.use_probe = w.Button(description="use this batch", disabled=True, layout=item)
            self.probe_status = w.HTML()
            for name, widget in (("probe", self.probe_button), ("use-probe", self.use_probe),
                                 ("probe-status", self.probe_status)):
                widget.add_class(f"tpu-{name}")
            self.probe_button.on_click(self._on_probe)
            self.use_probe.on_click(self._on_use_probe)
            items.append(w.VBox([w.HBox([self.probe_button, self.use_probe]), self.probe_status]))
        self.box = w.VBox(items, layout=w.Layout(width="100%"))
        self.box.add_class("tpu-tuning-panel")
        self._probing = False
        with self._lock:
            self._sync_controls()
            self._render()
        for name, c in self.controls.items():
            c.observe(lambda change, name=name: self._on_change(name), names="value")
        self.apply.on_click(self._on_apply)

    def show(self) -> PanelView:
        from IPython.display import display

        enable_colab_widgets()  # before display: Colab's hook tags display messages, not cell results
        display(self.box)
        return self

    # ---- controls <-> panel -------------------------------------------------------------------------------------
    def _sync_controls(self) -> None:
        """Put the panel's state into the controls without triggering their callbacks."""
        st, c = self.panel.state, self.controls
        self._syncing = True
        try:
            self._set_chip_options(resolve_hardware(st.hardware), st.chips)
            for name in ("preset", "seq_len", "batch_size", "grad_accum", "precision", "pure_bf16",
                         "gradient_checkpointing", "optimizer", "hardware", "chips", "sharding", "mfu", "steps"):
                c[name].value = getattr(st, name)
            glob = st.global_batch is not None
            c["mode"].value = "global" if glob else "per_chip"
            c["global_batch"].value = st.global_batch if glob else self.panel.result()["global_batch"]
            c["global_batch"].disabled, c["grad_accum"].disabled = not glob, glob
        finally:
            self._syncing = False

    def _set_chip_options(self, spec, chips: int) -> None:
        options = tuple((chips_text(n), n) for n in slice_sizes(spec))
        if tuple(self.controls["chips"].options) != options:  # resetting options resets the value: only on change
            self.controls["chips"].options = options
        if chips in slice_sizes(spec):
            self.controls["sharding"].options = sharding_options(spec, chips)  # a Combobox keeps its value

    def _read_controls(self) -> dict:
        c = {k: v.value for k, v in self.controls.items()}
        changes = {k: c[k] for k in ("preset", "seq_len", "batch_size", "precision", "pure_bf16",
                                     "gradient_checkpointing", "optimizer", "hardware", "chips", "sharding", "mfu",
                                     "steps")}
        if c["mode"] == "global":
            changes["global_batch"] = c["global_batch"]
        else:
            changes.update(global_batch=None, grad_accum=c["grad_accum"])
        return changes

    def _on_change(self, name: str) -> None:
        if self._syncing:
            return
        with self._lock:
            c = self.controls
            if name == "config":
                if c["config"].value != CUSTOM:
                    self.panel.update(**preset_settings(c["config"].value))
                    self._sync_controls()
                self._render()
                return
            if name in ("hardware", "chips"):  # the slice sizes this chip comes in, the nearest count, and a
                spec = resolve_hardware(c["hardware"].value)  # sharding valid on it (a mesh keeps its fsdp size)
                self._syncing = True
                try:
                    chips = nearest_slice(c["chips"].value, spec)
                    self._set_chip_options(spec, chips)
                    c["chips"].value = chips
                    c["sharding"].value = keep_sharding(c["sharding"].value, chips, spec)
                finally:
                    self._syncing = False
            changes = self._read_controls()
            if name == "preset":  # a GPT preset: drop the sizes a Hugging Face model or the config had set
                changes.update(GPT_SIZES)
            if name == "mode" and c["mode"].value == "global":
                changes["global_batch"] = self.panel.result()["global_batch"]  # start from the current one
            self.panel.update(**changes)
            self._syncing = True
            try:
                c["config"].value = CUSTOM  # a hand-made change: no longer a notebook's configuration
            finally:
                self._syncing = False
            if self.panel.error is None:
                self._sync_controls()
            self._render()

    def _on_apply(self, _: Any) -> None:
        with self._lock:
            try:
                self.panel.apply_suggestion()
            except ValueError as err:
                self.panel.error = str(err)
            self._sync_controls()
            self._render()

    # ---- rendering ----------------------------------------------------------------------------------------------
    def _render(self) -> None:
        p = self.panel
        # The chart first: updates reach the browser in order, so new text there means the chart is new too.
        self.chart.value = figure_png(p.figure())
        v = p.verdict()
        colour = "#1b7f3b" if v["fits"] else "#b00020"
        stale = " (STALE: last valid values)" if p.error else ""
        self.verdict.value = (
            f"<div style='background:{colour};color:white;padding:8px 14px;border-radius:4px;line-height:1.4'>"
            f"<span style='font-size:22px;font-weight:bold'>{v['headline']}{stale}</span>"
            f"<span style='font-size:18px;font-weight:bold;margin-left:14px'>{v['percent_text']}</span>"
            f"<br><span style='font-size:14px'>{html.escape(v['text'])}</span></div>")
        self.error.value = "" if not p.error else (
            f"<div style='color:#b00020;font-weight:bold'>Not applied: {html.escape(p.error)}. "
            f"The verdict, figures and chart show the last valid values.</div>")
        self.sharding.value = f"<div style='font-size:14px'><b>Sharding:</b> {html.escape(p.sharding_text())}</div>"
        s = p.suggestion()
        self.suggestion.value = (f"<span style='font-size:14px'><b>Suggestion:</b> {html.escape(s.text)}</span>"
                                 if s else "<span style='color:#555'>No change needed.</span>")
        self.apply.disabled = s is None or s.changes is None or p.error is not None
        self.warnings.value = "".join(f"<div style='color:#a15c00'><b>Warning:</b> {html.escape(x)}</div>"
                                      for x in p.warnings())
        self.details.value = "<br>".join(html.escape(x) for x in p.details())
        if self.backend is not None and not self._probing:  # a probe of other model settings is not offered
            changes = p.probe_changes()
            self.use_probe.disabled = changes is None
            self.use_probe.description = f"use batch {changes['batch_size']}/chip" if changes else "use this batch"
        self.renders += 1

    # ---- the probe ----------------------------------------------------------------------------------------------
    def _on_probe(self, _: Any) -> None:
        with self._lock:
            if self._probing:  # a second click while the first probe runs does nothing
                return
            self._probing = True
            self.probe_button.disabled, self.use_probe.disabled = True, True
            self.probe_button.description, self.probe_button.icon = "probing...", "hourglass-half"
            self.probe_button.button_style = "warning"
            self.probe_button.add_class("tpu-busy")
            kw = self.probe_kwargs
            plan = self.panel.probe_start(self.backend, kw.get("cpu_limit_bytes", 1 << 30),
                                          kw.get("max_batch_size", 1024))
            status = self.backend.status()
            said = [plan["precision"]] if plan["precision"] not in status else []
            if plan["memory_limit_bytes"] is not None:
                said.append(f"memory capped at {plan['memory_limit_bytes'] / 2**20:.0f} MiB")
            self.probe_status.value = (
                f"<b>Probing on {html.escape(status)}</b>{' (' + ', '.join(said) + ')' if said else ''}: starting at "
                f"batch {plan['start']}/chip, the estimate for this device; each try runs two training steps ...")
        threading.Thread(target=self._run_probe, name="tpu-helpers-probe", daemon=True).start()

    def _run_probe(self) -> None:
        try:
            r = self.panel.probe(self.backend, **self.probe_kwargs)
            tries = ", ".join(f"{t['batch_size']}{'' if t['ok'] else ' (OOM)'}" for t in r.tries)
            text = (f"<b>Largest batch that ran: {html.escape(r.answer())}</b> {html.escape(r.conditions())}. "
                    f"Tries: {tries} ({r.seconds:.1f} s).")
        except Exception as err:  # noqa: BLE001 - shown to the user, the panel stays usable
            r, text = None, f"<b style='color:#b00020'>Probe failed: {html.escape(repr(err))}</b>"
        with self._lock:
            self._probing = False
            self.probe_button.remove_class("tpu-busy")
            self.probe_button.description, self.probe_button.icon = "probe this device", "search"
            self.probe_button.button_style = ""
            self.probe_button.disabled = False
            changes = self.panel.probe_changes() if r is not None else None
            self.use_probe.disabled = changes is None
            if changes:
                self.use_probe.description = f"use batch {changes['batch_size']}/chip"
            self.probe_status.value = text

    def _on_use_probe(self, _: Any) -> None:
        with self._lock:
            changes = self.panel.probe_changes()
            if changes:
                self.panel.update(**changes)
                self._sync_controls()
                self._render()
