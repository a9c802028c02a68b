"""The batch-size tuning panel's logic, in plain Python (the ipywidgets view is ``tpu_helpers.memory.widgets``).

:class:`TuningPanel` holds the choices (model, sequence length, per-chip batch, accumulation or a global batch,
precision, gradient checkpointing, optimizer, target hardware and slice size, assumed MFU, run length) and, on every
change, computes the analytic memory estimate against the target's HBM, a verdict (FITS / DOES NOT FIT, percent of
HBM, the largest batch per chip), a suggestion that keeps the global batch, warnings, and an *estimated* step time
and cost. A bad value is refused with a message naming it; the last good figures stay, marked stale::

    panel = TuningPanel(preset="small", seq_len=1024, batch_size=36, hardware="v5e", chips=8)
    panel.verdict()["headline"]           # "DOES NOT FIT"
    panel.suggestion().text               # "largest batch 9/chip: use batch 9/chip x accumulation 4 for ..."
    panel.apply_suggestion()
    panel.load_preset("TPU VM v5e-8")     # the v5e-8 notebook's configuration (a global batch of 64)
    panel.probe(backend)                  # the largest batch that really runs on this device

``panel.show_static()`` prints the figures and draws the chart (papermill runs).
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass
from typing import Any

from tpu_helpers.hardware import format_bytes
from tpu_helpers.memory.analytic import analytic_estimate, resolve_config
from tpu_helpers.memory.choices import (
    check_chips,
    chips_text,
    cost_text,
    duration_text,
    hf_model_settings,
    precision_warning,
    preset_settings,
)
from tpu_helpers.memory.figure import figure_png, memory_figure
from tpu_helpers.memory.report import MemoryReport, largest_fitting_batch, memory_report, resolve_hardware
from tpu_helpers.memory.step import OPTIMIZERS, PRECISIONS
from tpu_helpers.models.gpt import PRESETS, flops_per_token


@dataclass
class TuningState:
    preset: str = "mini"
    n_layer: int | None = None      # None: the preset's value
    n_head: int | None = None
    n_embd: int | None = None
    vocab_size: int | None = None
    seq_len: int = 256
    batch_size: int = 32            # per chip, per micro-batch
    accumulation: int = 1           # derived from global_batch when that is set
    global_batch: int | None = None  # None: per-chip mode (batch x chips x accumulation); else fixed global batch
    precision: str = "bf16"
    gradient_checkpointing: bool = False
    optimizer: str = "adamw"
    hardware: str = "v5e"
    chips: int = 8
    mfu: float = 0.4                # assumed model FLOP utilisation (an estimate, editable)
    steps: int = 10_000             # optimizer steps in the run, for the cost
    safety_margin: float = 0.1


@dataclass(frozen=True)
class Suggestion:
    text: str
    changes: dict | None  # None: advice only, nothing the panel can apply


def _positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def _split(samples_per_chip: int, limit: int) -> tuple[int, int]:
    """Largest micro-batch <= ``limit`` dividing ``samples_per_chip``, and the accumulation that keeps the total."""
    b = next(b for b in range(min(limit, samples_per_chip), 0, -1) if samples_per_chip % b == 0)
    return b, samples_per_chip // b


class TuningPanel:
    """``set(**changes)`` validates and recomputes (raises on a bad value); ``update`` records the error instead."""

    def __init__(self, **values: Any) -> None:
        self.state = TuningState()
        self._result: dict = {}
        self.report: MemoryReport | None = None
        self.error: str | None = None
        self.probe_result = None
        self._probe_lock = threading.Lock()
        self.set(**values)

    # ---- state --------------------------------------------------------------------------------------------------
    def set(self, **changes: Any) -> dict:
        known = {f.name for f in dataclasses.fields(TuningState)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise ValueError(f"unknown panel setting(s) {unknown}; known: {sorted(known)}")
        new = self._compute(dataclasses.replace(self.state, **changes))  # raises, leaving the state in place
        self.state, self.error = new, None
        return self._result

    def update(self, **changes: Any) -> str | None:
        """Like ``set``, but a bad value is kept as ``error`` (figures then stale) rather than raised."""
        try:
            self.set(**changes)
        except (ValueError, TypeError) as err:
            self.error = str(err)
        return self.error

    def load_preset(self, name: str) -> dict:
        """One of the notebooks' configurations (``choices.NOTEBOOK_PRESETS``)."""
        return self.set(**preset_settings(name))

    def load_hf_model(self, model: str, **settings) -> dict:
        """Model sizes from a Hugging Face config by hub name or local path (no weights downloaded), plus any other
        panel settings, e.g. ``panel.load_hf_model("Qwen/Qwen2.5-0.5B-Instruct", seq_len=512)``."""
        return self.set(**hf_model_settings(model), **settings)

    def result(self) -> dict:
        return dict(self._result)

    def model_config(self, state: TuningState | None = None):
        st = state or self.state
        if st.preset not in PRESETS:
            raise ValueError(f"unknown preset {st.preset!r}; choose one of {sorted(PRESETS)}")
        sizes = {k: getattr(st, k) for k in ("n_layer", "n_head", "n_embd", "vocab_size") if getattr(st, k)}
        return resolve_config(st.preset, block_size=max(st.seq_len, PRESETS[st.preset].block_size), **sizes)

    def _estimator(self, st: TuningState, precision: str | None = None, attention: str | None = None):
        cfg = self.model_config(st)
        spec = resolve_hardware(st.hardware)
        # XLA lowers scaled_dot_product_attention to matmul-softmax-matmul: the attention matrix is materialised.
        attention = attention or ("math" if spec.kind == "tpu" else "flash")
        return lambda b: analytic_estimate(cfg, b, st.seq_len, precision=precision or st.precision,
                                           optimizer=st.optimizer, gradient_checkpointing=st.gradient_checkpointing,
                                           attention=attention)

    def _compute(self, st: TuningState) -> TuningState:
        for name in ("seq_len", "batch_size", "accumulation", "chips", "steps"):
            _positive_int(name, getattr(st, name))
        if not isinstance(st.mfu, (int, float)) or not 0.0 < st.mfu <= 1.0:
            raise ValueError(f"mfu must be in (0, 1], got {st.mfu!r}")
        if st.precision not in PRECISIONS:
            raise ValueError(f"precision={st.precision!r} is not one of {PRECISIONS}")
        if st.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer={st.optimizer!r} is not one of {OPTIMIZERS}")
        spec = resolve_hardware(st.hardware)
        check_chips(st.chips, spec)
        if st.global_batch is not None:
            _positive_int("global_batch", st.global_batch)
            per_step = st.batch_size * st.chips
            if st.global_batch % per_step:
                raise ValueError(f"global batch {st.global_batch} is not a multiple of batch/chip x chips = "
                                 f"{st.batch_size} x {st.chips} = {per_step}")
            st = dataclasses.replace(st, accumulation=st.global_batch // per_step)
        cfg = self.model_config(st)
        report = memory_report(self._estimator(st), st.batch_size, spec, safety_margin=st.safety_margin)
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
            "run_cost_usd_estimate": cost, "hardware": spec.name, "attention": "math" if spec.kind == "tpu" else "flash",
            "settings": dataclasses.asdict(st),
        }
        return st

    # ---- what the panel says ------------------------------------------------------------------------------------
    def verdict(self) -> dict:
        rep, st = self.report, self.state
        assert rep is not None
        pct = 100 * rep.utilization
        text = (f"{format_bytes(rep.estimate.peak_bytes)} of {format_bytes(rep.hbm_bytes)} per "
                f"chip on {rep.hardware.name} at batch {st.batch_size}/chip (budget {100 * (1 - rep.safety_margin):.0f}"
                f"%). Largest batch that fits: {rep.max_batch_size}/chip.")
        shown = f"{pct:.0f}%" if pct >= 10 else f"{pct:.2g}%"
        return {"fits": rep.fits, "headline": "FITS" if rep.fits else "DOES NOT FIT", "percent": pct,
                "percent_text": f"{shown} of HBM", "max_batch_size": rep.max_batch_size, "text": text}

    def _max_batch_with(self, **changes: Any) -> int:
        st = dataclasses.replace(self.state, **changes)
        spec = resolve_hardware(st.hardware)
        return largest_fitting_batch(self._estimator(st), spec.hbm_bytes * (1 - st.safety_margin))

    def suggestion(self) -> Suggestion | None:
        """What to change so the step fits (or runs with less accumulation), keeping the global batch."""
        st, rep = self.state, self.report
        assert rep is not None
        g, per_chip, m = self._result["global_batch"], st.batch_size * st.accumulation, rep.max_batch_size
        keep = f"for global batch {g}"
        if rep.fits:
            if st.accumulation > 1 and m > st.batch_size:
                b, a = _split(per_chip, m)
                if b > st.batch_size:
                    return Suggestion(f"a larger micro-batch fits: batch {b}/chip x accumulation {a} {keep}",
                                      {"batch_size": b, "accumulation": a})
            return None
        if m >= 1:
            b, a = _split(per_chip, m)
            text = f"largest batch {m}/chip: use batch {b}/chip x accumulation {a} {keep}"
            if not st.gradient_checkpointing:
                ck = self._max_batch_with(gradient_checkpointing=True)
                if ck > m:
                    text += f" (or turn on gradient checkpointing: up to {ck}/chip, about 1/3 more compute)"
            return Suggestion(text, {"batch_size": b, "accumulation": a})
        options = [{"gradient_checkpointing": True}]
        if resolve_hardware(st.hardware).bf16_supported:
            options += [{"precision": "pure-bf16"}, {"gradient_checkpointing": True, "precision": "pure-bf16"}]
        for extra in options:
            if all(getattr(st, k) == v for k, v in extra.items()):
                continue
            m2 = self._max_batch_with(**extra)
            if m2 >= 1:
                b, a = _split(per_chip, m2)
                what = " and ".join({"gradient_checkpointing": "turn on gradient checkpointing",
                                     "precision": "store weights in bf16 (pure-bf16)"}[k] for k in extra)
                return Suggestion(f"not even batch 1/chip fits: {what}, then batch {b}/chip x accumulation {a} "
                                  f"{keep}", {**extra, "batch_size": b, "accumulation": a})
        return Suggestion("not even batch 1/chip fits with checkpointing and bf16 weights: the model needs sharding "
                          "over several chips (FSDP) or a chip with more memory", None)

    def apply_suggestion(self) -> dict:
        s = self.suggestion()
        if s is None or s.changes is None:
            raise ValueError("there is no suggestion to apply" if s is None else f"nothing to apply: {s.text}")
        return self.set(**s.changes)

    def warnings(self) -> list[str]:
        st = self.state
        spec = resolve_hardware(st.hardware)
        out = [w for w in [precision_warning(st.precision, spec)] if w]
        if spec.kind == "cpu":
            out.append("the CPU entry is nominal (16 GiB, 1 TFLOP/s): its times are not a forecast")
        return out

    def details(self) -> list[str]:
        r, st = self._result, self.state
        spec = resolve_hardware(st.hardware)
        steps = "step" if st.accumulation == 1 else "steps"
        lines = [f"global batch {r['global_batch']} = {st.batch_size}/chip x {chips_text(st.chips)} x "
                 f"{st.accumulation} accumulation {steps} ({r['tokens_per_step']:,} tokens/step)"]
        if r["step_seconds_estimate"] is None:
            lines.append(f"step time: no catalog peak FLOP/s for {spec.name}")
        else:
            lines.append(f"ESTIMATE at an assumed {100 * st.mfu:.0f}% MFU: "
                         f"{duration_text(r['step_seconds_estimate'])}/step, "
                         f"{duration_text(r['step_seconds_estimate'] * st.steps)} for {st.steps:,} steps")
        lines.append(cost_text(r["run_cost_usd_estimate"], spec, st.chips))
        return lines

    def summary(self) -> str:
        v, s = self.verdict(), self.suggestion()
        lines = [f"{v['headline']} ({v['percent_text']}): {v['text']}"] + ([f"suggestion: {s.text}"] if s else [])
        lines += [f"warning: {w}" for w in self.warnings()] + self.details()
        if self.error:
            lines.insert(0, f"STALE (last valid values shown): {self.error}")
        return "\n".join(lines)

    def figure(self):
        assert self.report is not None
        plan = f"x {chips_text(self.state.chips)}, global batch {self._result['global_batch']}"
        return memory_figure(self.report, stale=self.error, plan=plan)

    def widget(self, backend=None, **probe_kwargs: Any):
        """The ipywidgets panel over this logic (``tpu_helpers.memory.widgets.PanelView``); ``show`` displays it."""
        from tpu_helpers.memory.widgets import PanelView

        return PanelView(self, backend, **probe_kwargs).box

    def show(self, backend=None, **probe_kwargs: Any):
        """Display the panel (enabling Colab's widget manager where ipywidgets 8 needs it); returns the view."""
        from tpu_helpers.memory.widgets import PanelView

        return PanelView(self, backend, **probe_kwargs).show()

    def show_static(self) -> dict:
        """Print the figures and display the chart (what a papermill run records); returns ``result()``."""
        from IPython.display import Image, display

        print(self.summary())
        display(Image(figure_png(self.figure())))
        return self.result()

    # ---- the probe ----------------------------------------------------------------------------------------------
    def probe_start(self, backend, cpu_limit_bytes: int | None = None, max_batch_size: int = 1024,
                    state: TuningState | None = None) -> dict:
        """Where the probe starts: the estimate's largest batch for the device it runs on (its memory, or the cap
        imposed on the CPU, and the precision it runs in)."""
        st = state or self.state
        precision = backend.precision if backend.precision in PRECISIONS else "fp32"
        if st.precision == "pure-bf16" and precision == "bf16":
            precision = "pure-bf16"
        cap = cpu_limit_bytes if backend.runs_on_host else None
        budget = cap if cap is not None else backend.hardware.hbm_bytes * (1 - st.safety_margin)
        est = self._estimator(st, precision=precision, attention="math" if backend.is_xla else "flash")
        start = largest_fitting_batch(est, budget, upper=max_batch_size) if budget else st.batch_size
        return {"start": max(1, min(start, max_batch_size)), "precision": precision, "memory_limit_bytes": cap}

    def probe(self, backend, *, max_tries: int = 8, max_batch_size: int = 1024,
              cpu_limit_bytes: int | None = 1 << 30, growth: float = 1.25, **kwargs: Any):
        """Build the configured GPT on ``backend`` and find the largest batch that runs there, starting from the
        estimate for that device and bisecting to the exact limit within ``max_tries`` (one probe at a time).

        On the CPU, where running out of memory means the OS kills the process rather than an error, the tries run
        under a :class:`~tpu_helpers.memory.live.LiveBytes` limit of ``cpu_limit_bytes`` (None: no limit).
        """
        if not self._probe_lock.acquire(blocking=False):
            raise RuntimeError("a probe is already running on this panel; wait for its result")
        try:
            return self._probe(backend, max_tries, max_batch_size, cpu_limit_bytes, growth, **kwargs)
        finally:
            self._probe_lock.release()

    def _probe(self, backend, max_tries, max_batch_size, cpu_limit_bytes, growth, **kwargs):
        import torch

        from tpu_helpers.memory.probe import probe_batch_size
        from tpu_helpers.memory.step import make_optimizer
        from tpu_helpers.memory.traced import gpt_batch
        from tpu_helpers.models.gpt import GPT

        st = self.state  # one snapshot: a control may change while the probe runs
        plan = self.probe_start(backend, cpu_limit_bytes, max_batch_size, state=st)
        cfg = self.model_config(st)
        model = backend.prepare_model(GPT(cfg))
        if plan["precision"] == "pure-bf16":
            model = model.to(torch.bfloat16)
        if st.gradient_checkpointing:
            model.set_gradient_checkpointing(backend.checkpoint_fn())
        opt = make_optimizer(st.optimizer, model.parameters())
        if plan["memory_limit_bytes"] is not None:
            kwargs.setdefault("memory_limit_bytes", plan["memory_limit_bytes"])
        result = probe_batch_size(model, opt, gpt_batch(st.seq_len, cfg.vocab_size), backend,
                                  start=plan["start"], max_tries=max_tries, max_batch_size=max_batch_size,
                                  growth=growth, **kwargs)
        if plan["precision"] == "pure-bf16":
            result.precision = "pure-bf16"
        self.probe_result, self._probe_key = result, self._model_key(st)
        return result

    @staticmethod
    def _model_key(st: TuningState) -> tuple:
        return (st.preset, st.n_layer, st.n_head, st.n_embd, st.vocab_size, st.seq_len, st.precision,
                st.gradient_checkpointing, st.optimizer)

    def probe_changes(self) -> dict | None:
        """Settings that use the probe's batch: that batch per chip (with a global batch set, the largest
        micro-batch up to it that divides it). None before a useful probe or once the model settings changed."""
        p = self.probe_result
        if p is None or p.max_batch_size < 1 or getattr(self, "_probe_key", None) != self._model_key(self.state):
            return None
        if self.state.global_batch is None:
            return {"batch_size": p.max_batch_size}
        b, a = _split(self.state.global_batch // self.state.chips, p.max_batch_size)
        return {"batch_size": b, "accumulation": a}
