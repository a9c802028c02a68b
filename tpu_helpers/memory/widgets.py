"""Interactive batch-size tuning: the logic as a plain class, and a thin ipywidgets panel over it.

:class:`TuningPanel` holds the choices (model preset or sizes, sequence length, per-chip batch, accumulation,
precision, gradient checkpointing, optimizer, target hardware, chips, assumed MFU, run length) and computes, on every
change, the analytic memory report against the target's HBM, the global batch, and an *estimated* step time and
cost per run from the catalog's peak bf16 FLOP/s and price at the assumed MFU. Tests drive it directly::

    panel = TuningPanel(preset="mini", hardware="v5e")
    panel.set(batch_size=64, precision="bf16")
    panel.result()["max_batch_size"]

In a notebook, ``panel.widget()`` shows the controls, a bar chart of the breakdown against HBM, the figures, and a
"probe this device" button that runs :func:`tpu_helpers.memory.probe.probe_batch_size` here. ``panel.show_static()``
renders the same figures without widgets (papermill runs).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from tpu_helpers.hardware import CATALOG
from tpu_helpers.memory.analytic import analytic_estimate, resolve_config
from tpu_helpers.memory.report import MemoryReport, memory_report, resolve_hardware
from tpu_helpers.memory.step import OPTIMIZERS, PRECISIONS
from tpu_helpers.models.gpt import PRESETS, flops_per_token

HARDWARE_CHOICES = tuple(CATALOG)


@dataclasses.dataclass
class TuningState:
    preset: str = "mini"
    n_layer: int | None = None      # None: the preset's value
    n_head: int | None = None
    n_embd: int | None = None
    vocab_size: int | None = None
    seq_len: int = 256
    batch_size: int = 32            # per chip
    accumulation: int = 1
    precision: str = "bf16"
    gradient_checkpointing: bool = False
    optimizer: str = "adamw"
    hardware: str = "v5e"
    chips: int = 8
    mfu: float = 0.4                # assumed model FLOP utilisation (an estimate, editable)
    steps: int = 10_000             # optimizer steps in the run, for the cost
    safety_margin: float = 0.1


class TuningPanel:
    """The panel's logic: ``set(**changes)`` validates and recomputes; ``result()`` returns the figures."""

    def __init__(self, **values: Any) -> None:
        self.state = TuningState()
        self._result: dict = {}
        self.report: MemoryReport | None = None
        self.probe_result = None
        self.set(**values)

    def set(self, **changes: Any) -> dict:
        known = {f.name for f in dataclasses.fields(TuningState)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise ValueError(f"unknown panel setting(s) {unknown}; known: {sorted(known)}")
        new = dataclasses.replace(self.state, **changes)
        self._compute(new)  # raises on a bad value, leaving the previous state in place
        self.state = new
        return self._result

    def result(self) -> dict:
        return dict(self._result)

    def model_config(self, state: TuningState | None = None):
        st = state or self.state
        if st.preset not in PRESETS:
            raise ValueError(f"unknown preset {st.preset!r}; choose one of {sorted(PRESETS)}")
        sizes = {k: getattr(st, k) for k in ("n_layer", "n_head", "n_embd", "vocab_size") if getattr(st, k)}
        return resolve_config(st.preset, block_size=max(st.seq_len, PRESETS[st.preset].block_size), **sizes)

    def _compute(self, st: TuningState) -> None:
        for name in ("seq_len", "batch_size", "accumulation", "chips", "steps"):
            value = getattr(st, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not 0.0 < st.mfu <= 1.0:
            raise ValueError(f"mfu must be in (0, 1], got {st.mfu!r}")
        if st.precision not in PRECISIONS:
            raise ValueError(f"precision={st.precision!r} is not one of {PRECISIONS}")
        if st.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer={st.optimizer!r} is not one of {OPTIMIZERS}")
        spec = resolve_hardware(st.hardware)
        cfg = self.model_config(st)
        # XLA lowers scaled_dot_product_attention to matmul-softmax-matmul: the attention matrix is materialised.
        attention = "math" if spec.kind == "tpu" else "flash"

        def estimator(b: int):
            return analytic_estimate(cfg, b, st.seq_len, precision=st.precision, optimizer=st.optimizer,
                                     gradient_checkpointing=st.gradient_checkpointing, attention=attention)

        report = memory_report(estimator, st.batch_size, spec, safety_margin=st.safety_margin)
        global_batch = st.batch_size * st.chips * st.accumulation
        tokens = global_batch * st.seq_len
        flops = flops_per_token(cfg, st.seq_len) * tokens
        # Recomputing the blocks' forward in the backward costs about one more forward (2N of the 6N).
        if st.gradient_checkpointing:
            flops *= 8 / 6
        step_s = cost = None
        if spec.bf16_tflops:
            step_s = flops / (st.chips * spec.bf16_tflops * 1e12 * st.mfu)
            if spec.price_per_chip_hour is not None:
                cost = step_s * st.steps / 3600 * st.chips * spec.price_per_chip_hour
        self.report = report
        self._result = {
            "peak_bytes": report.estimate.peak_bytes, "breakdown": dict(report.estimate.breakdown),
            "hbm_bytes": report.hbm_bytes, "budget_bytes": report.budget_bytes, "fits": report.fits,
            "max_batch_size": report.max_batch_size, "global_batch": global_batch, "tokens_per_step": tokens,
            "step_seconds_estimate": step_s, "run_hours_estimate": None if step_s is None else step_s * st.steps / 3600,
            "run_cost_usd_estimate": cost, "hardware": spec.name, "attention": attention,
            "settings": dataclasses.asdict(st),
        }

    def summary(self) -> str:
        r, st = self._result, self.state
        lines = [self.report.summary() if self.report else "",
                 f"global batch {r['global_batch']} = {st.batch_size}/chip x {st.chips} chips x {st.accumulation} "
                 f"accumulation ({r['tokens_per_step']:,} tokens/step)"]
        if r["step_seconds_estimate"] is not None:
            lines.append(f"ESTIMATE at an assumed {100 * st.mfu:.0f}% MFU: {r['step_seconds_estimate'] * 1e3:.1f} ms/step, "
                         f"{r['run_hours_estimate']:.2f} h for {st.steps:,} steps")
        if r["run_cost_usd_estimate"] is not None:
            lines.append(f"ESTIMATED cost: ${r['run_cost_usd_estimate']:,.2f} for the run "
                         f"({st.chips} chips, catalog price, on demand)")
        return "\n".join(lines)

    def figure(self):
        assert self.report is not None
        return self.report.plot()

    def show_static(self) -> dict:
        """Print the figures and draw the chart (what a papermill run records); returns ``result()``."""
        print(self.summary())
        self.figure()
        return self.result()

    def probe(self, backend, *, max_tries: int = 6, max_batch_size: int = 1024,
              cpu_limit_bytes: int | None = 1 << 30, **kwargs: Any):
        """Build the configured GPT on ``backend`` and probe the largest batch that runs there.

        On the CPU, where running out of memory means the OS kills the process rather than an error, the tries run
        under a :class:`~tpu_helpers.memory.live.LiveBytes` limit of ``cpu_limit_bytes`` (None: no limit).
        """
        import torch

        from tpu_helpers.memory.probe import probe_batch_size
        from tpu_helpers.memory.step import make_optimizer
        from tpu_helpers.memory.traced import gpt_batch
        from tpu_helpers.models.gpt import GPT

        cfg = self.model_config()
        model = backend.prepare_model(GPT(cfg))
        if self.state.precision == "pure-bf16":
            model = model.to(torch.bfloat16)
        if self.state.gradient_checkpointing:
            model.set_gradient_checkpointing(backend.checkpoint_fn())
        opt = make_optimizer(self.state.optimizer, model.parameters())
        start = max(1, min(self._result["max_batch_size"] or self.state.batch_size, max_batch_size))
        if backend.runs_on_host and cpu_limit_bytes is not None:
            kwargs.setdefault("memory_limit_bytes", cpu_limit_bytes)
        self.probe_result = probe_batch_size(model, opt, gpt_batch(self.state.seq_len, cfg.vocab_size), backend,
                                             start=start, max_tries=max_tries, max_batch_size=max_batch_size,
                                             **kwargs)
        return self.probe_result

    def widget(self, backend=None):
        """The ipywidgets panel (controls -> chart and figures; a probe button when ``backend`` is given)."""
        import ipywidgets as w
        import matplotlib.pyplot as plt

        st = self.state
        controls = {
            "preset": w.Dropdown(options=sorted(PRESETS), value=st.preset, description="model"),
            "seq_len": w.IntText(value=st.seq_len, description="seq len"),
            "batch_size": w.IntText(value=st.batch_size, description="batch/chip"),
            "accumulation": w.IntText(value=st.accumulation, description="accumulation"),
            "precision": w.Dropdown(options=PRECISIONS, value=st.precision, description="precision"),
            "gradient_checkpointing": w.Checkbox(value=st.gradient_checkpointing, description="checkpointing"),
            "optimizer": w.Dropdown(options=OPTIMIZERS, value=st.optimizer, description="optimizer"),
            "hardware": w.Dropdown(options=HARDWARE_CHOICES, value=st.hardware, description="hardware"),
            "chips": w.IntText(value=st.chips, description="chips"),
            "mfu": w.FloatText(value=st.mfu, description="MFU (assumed)"),
            "steps": w.IntText(value=st.steps, description="run steps"),
        }
        out, message = w.Output(), w.HTML()

        def redraw(*_: Any) -> None:
            try:
                self.set(**{k: c.value for k, c in controls.items()})
                message.value = ""
            except (ValueError, TypeError) as err:
                message.value = f"<b style='color:red'>{err}</b>"
                return
            with out:
                out.clear_output(wait=True)
                print(self.summary())
                fig = self.figure()
                plt.show()
                plt.close(fig)

        for c in controls.values():
            c.observe(redraw, names="value")
        items = [w.HBox(list(controls.values())[:6]), w.HBox(list(controls.values())[6:]), message, out]
        if backend is not None:
            button, probe_out = w.Button(description="probe this device"), w.Output()

            def on_probe(_: Any) -> None:
                with probe_out:
                    probe_out.clear_output()
                    print(f"probing on {backend.status()} ...")
                    print(self.probe(backend).summary())

            button.on_click(on_probe)
            items += [button, probe_out]
        redraw()
        return w.VBox(items)


def panel_from_config(config) -> TuningPanel:
    """A panel from a notebook's validated TrainConfig (``config.extra`` holds the tuning-only parameters)."""
    ex = config.extra
    precision = {"auto": "bf16", "fp16": "bf16"}.get(config.precision, config.precision)
    if precision == "bf16" and ex.get("pure_bf16", False):
        precision = "pure-bf16"
    return TuningPanel(preset=config.preset, seq_len=config.seq_len, batch_size=config.batch_size,
                       accumulation=config.grad_accum, precision=precision,
                       gradient_checkpointing=config.gradient_checkpointing, optimizer=config.optimizer,
                       hardware=ex.get("hardware", "v5e"), chips=ex.get("chips", 8), mfu=ex.get("mfu", 0.4),
                       steps=config.steps, safety_margin=ex.get("safety_margin", 0.1))


def save_tuning_results(panel: TuningPanel, out_dir: str, **extra: Any) -> Path:
    """Write ``results.json`` (the panel's figures, the probe's if run, ``extra``) and ``memory.png``, atomically,
    into ``out_dir`` and, under ``python -m tpu_helpers run``, the run's directory."""
    from tpu_helpers.training.results import write_results

    results = {**panel.result(), "probe": panel.probe_result.to_dict() if panel.probe_result else None, **extra}
    return write_results(out_dir, results, figure=panel.figure(), figure_name="memory.png")

