"""The batch-size tuning panel's logic, in plain Python (the ipywidgets view is ``tpu_helpers.panel.widgets``).

    panel = TuningPanel(preset="small", seq_len=1024, batch_size=36, hardware="v5e", chips=8)
    panel.verdict()["headline"]           # "DOES NOT FIT"
    panel.suggestion().text               # "largest batch 9/chip: use batch 9/chip x accumulation 4 for ..."
    panel.set(sharding="fsdp")            # parameters, gradients and optimizer state split over the 8 chips
    panel.probe(backend)                  # the largest batch that really runs on this device (panel_probe.py)

On every change :class:`TuningPanel` recomputes the analytic memory estimate per chip against the target's HBM, a
verdict, the sharding line, a suggestion that keeps the global batch, warnings and an *estimated* step time and
cost; a bad value is refused by name, and the last good figures stay, marked stale. ``panel.show_static()`` prints
them (papermill runs). The choices it holds and a longer session: docs/guides/panel.md.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from tpu_helpers.core.choices import OPTIMIZERS, PRECISIONS, check_choice
from tpu_helpers.core.hardware import HardwareSpec, format_bytes
from tpu_helpers.memory.analytic import (
    analytic_estimate,
    block_params,
    bytes_per_weight,
    memory_layout,
    param_counts,
    resolve_config,
)
from tpu_helpers.memory.per_chip import ShardingPlan, shard_estimate, sharding_plan
from tpu_helpers.memory.report import MemoryEstimate, MemoryReport, memory_report, resolve_hardware
from tpu_helpers.models.gpt import PRESETS, flops_per_token
from tpu_helpers.panel.background import ProbeMixin
from tpu_helpers.panel.figure import figure_png, memory_figure
from tpu_helpers.panel.options import (
    check_chips,
    check_panel_sharding,
    chips_text,
    cost_text,
    duration_text,
    hf_model_settings,
    max_fsdp,
    precision_warning,
    preset_settings,
)
from tpu_helpers.panel.suggest import Suggestion, suggest


@dataclass
class TuningState:
    preset: str = "mini"
    n_layer: int | None = None      # None: the preset's value
    n_head: int | None = None
    n_embd: int | None = None
    vocab_size: int | None = None
    seq_len: int = 256
    batch_size: int = 32            # per chip, per micro-batch
    grad_accum: int = 1             # micro-batches per optimizer step; derived from global_batch when that is set
    global_batch: int | None = None  # None: per-chip mode (batch x chips x grad_accum); else fixed global batch
    precision: str = "bf16"         # choices.PRECISIONS; auto is the chip's own (bf16 on TPUs)
    pure_bf16: bool = False         # with bf16: weights, gradients and optimizer state stored in bf16 too
    gradient_checkpointing: bool = False
    optimizer: str = "adamw"
    hardware: str = "v5e"
    chips: int = 8
    sharding: str = "data"          # data | fsdp | DxF mesh (e.g. 2x4), as the trainer's SHARDING
    mfu: float = 0.4                # assumed model FLOP utilisation (an estimate, editable)
    steps: int = 10_000             # optimizer steps in the run, for the cost
    safety_margin: float = 0.1
    model_params: int | None = None  # None: the GPT's own count; a Hugging Face model's (hf_model_settings)
    block_params: int | None = None  # None: one GPT Block; one Hugging Face decoder layer (the FSDP unit)


def _positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def step_precision(precision: str, spec: HardwareSpec) -> str:
    """What `precision` computes in on the chip `spec`: "auto" is bf16 where the chip has it (TPUs, recent GPUs),
    else fp16 on GPUs and fp32 on the CPU, as the backends resolve it."""
    if precision != "auto":
        return precision
    if spec.kind == "cpu":
        return "fp32"
    return "bf16" if spec.bf16_supported else "fp16"


def _mesh_text(fsdp: int, chips: int) -> str:
    if fsdp == 1:
        return "data parallel"
    groups = chips // fsdp
    return f"fsdp over {fsdp} chips" + (f", {groups} data-parallel groups" if groups > 1 else "")


class TuningPanel(ProbeMixin):
    """``set(**changes)`` validates and recomputes (raises on a bad value); ``update`` records the error instead."""

    def __init__(self, **values: Any) -> None:
        self.state = TuningState()
        self._result: dict = {}
        self.report: MemoryReport | None = None
        self.plan: ShardingPlan | None = None
        self.error: str | None = None
        self._init_probe()
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

    def load_hf_model(self, model: Any, **settings) -> dict:
        """Model sizes from a Hugging Face config by hub name or local path (no weights downloaded), or a config
        object or dict, plus any other panel settings, e.g. ``panel.load_hf_model("Qwen/Qwen2.5-0.5B-Instruct",
        seq_len=512)``."""
        return self.set(**hf_model_settings(model), **settings)

    def result(self) -> dict:
        return dict(self._result)

    def model_config(self, state: TuningState | None = None):
        st = state or self.state
        if st.preset not in PRESETS:
            raise ValueError(f"unknown preset {st.preset!r}; choose one of {sorted(PRESETS)}")
        sizes = {k: getattr(st, k) for k in ("n_layer", "n_head", "n_embd", "vocab_size") if getattr(st, k)}
        return resolve_config(st.preset, block_size=max(st.seq_len, PRESETS[st.preset].block_size), **sizes)

    def _sizes(self, st: TuningState) -> tuple[int, int, int]:
        """(the model's parameters, one sharding unit's parameters, the GPT formula's parameters)."""
        cfg = self.model_config(st)
        gpt = param_counts(cfg)[0]
        return st.model_params or gpt, st.block_params or block_params(cfg), gpt

    def _estimator(self, st: TuningState, precision: str | None = None, pure_bf16: bool | None = None,
                   attention: str | None = None, fsdp: int | None = None):
        """Per-chip estimate of batch ``b`` under ``fsdp`` chips (default: the state's sharding)."""
        cfg = self.model_config(st)
        spec = resolve_hardware(st.hardware)
        precision = step_precision(precision or st.precision, spec)
        pure_bf16 = st.pure_bf16 if pure_bf16 is None else pure_bf16
        # XLA lowers scaled_dot_product_attention to matmul-softmax-matmul: the attention matrix is materialised.
        attention = attention or ("math" if spec.kind == "tpu" else "flash")
        fsdp = check_panel_sharding(st.sharding, st.chips, spec)[1] if fsdp is None else fsdp
        params, block, gpt = self._sizes(st)
        scale = params / gpt
        width = bytes_per_weight(precision, pure_bf16)

        def estimate(b: int) -> MemoryEstimate:
            est = analytic_estimate(cfg, b, st.seq_len, precision=precision, pure_bf16=pure_bf16,
                                    optimizer=st.optimizer, gradient_checkpointing=st.gradient_checkpointing,
                                    attention=attention, grad_accum=st.grad_accum)
            if scale != 1:  # a Hugging Face model: its real parameter count for the model state, at each moment
                phases = {name: {k: int(v * scale) if k in ("params", "grads", "optimizer") else v
                                 for k, v in parts.items()} for name, parts in est.phases.items()}
                notes = [n for n in est.notes if not n.startswith("peak: ")]
                est = MemoryEstimate.from_phases(est.method, b, phases, notes=[
                    *notes, f"{params:,} parameters (the Hugging Face model's)"])
            return shard_estimate(est, fsdp, block_params=block, bytes_per_param=width)

        return estimate

    def _compute(self, st: TuningState) -> TuningState:
        for name in ("seq_len", "batch_size", "grad_accum", "chips", "steps"):
            _positive_int(name, getattr(st, name))
        if not isinstance(st.mfu, (int, float)) or not 0.0 < st.mfu <= 1.0:
            raise ValueError(f"mfu must be in (0, 1], got {st.mfu!r}")
        check_choice("precision", st.precision, PRECISIONS)
        check_choice("optimizer", st.optimizer, OPTIMIZERS)
        if not isinstance(st.pure_bf16, bool):
            raise ValueError(f"pure_bf16 must be True or False, got {st.pure_bf16!r}")
        for name in ("model_params", "block_params"):
            if getattr(st, name) is not None:
                _positive_int(name, getattr(st, name))
        spec = resolve_hardware(st.hardware)
        memory_layout(step_precision(st.precision, spec), st.pure_bf16)  # pure_bf16 needs bf16
        check_chips(st.chips, spec)
        sharding, fsdp = check_panel_sharding(st.sharding, st.chips, spec)
        st = dataclasses.replace(st, sharding=sharding)
        if st.global_batch is not None:
            _positive_int("global_batch", st.global_batch)
            per_step = st.batch_size * st.chips
            if st.global_batch % per_step:
                raise ValueError(f"global batch {st.global_batch} is not a multiple of batch/chip x chips = "
                                 f"{st.batch_size} x {st.chips} = {per_step}")
            st = dataclasses.replace(st, grad_accum=st.global_batch // per_step)
        cfg = self.model_config(st)
        report = memory_report(self._estimator(st, fsdp=fsdp), st.batch_size, spec, safety_margin=st.safety_margin)
        params, block, _ = self._sizes(st)
        plan = sharding_plan(self._estimator(st, fsdp=1), st.batch_size, chips=max_fsdp(spec, st.chips),
                             hardware=spec, block_params=block, params=params, safety_margin=st.safety_margin,
                             bytes_per_param=bytes_per_weight(step_precision(st.precision, spec), st.pure_bf16),
                             what="training")
        global_batch = st.batch_size * st.chips * st.grad_accum
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
        self.report, self.plan = report, plan
        self._result = {
            "peak_bytes": report.estimate.peak_bytes, "breakdown": dict(report.estimate.breakdown),
            "hbm_bytes": report.hbm_bytes, "budget_bytes": report.budget_bytes, "fits": report.fits,
            "max_batch_size": report.max_batch_size, "global_batch": global_batch, "tokens_per_step": tokens,
            "step_seconds_estimate": step_s, "run_hours_estimate": None if step_s is None else step_s * st.steps / 3600,
            "run_cost_usd_estimate": cost, "hardware": spec.name, "attention": "math" if spec.kind == "tpu" else "flash",
            "sharding": st.sharding, "fsdp_chips": fsdp, "sharding_text": self._sharding_text(st, fsdp, report, plan),
            "per_chip_bytes_by_sharding": {k: v.peak_bytes for k, v in plan.per_chip.items()},
            "settings": dataclasses.asdict(st),
        }
        return st

    # ---- what the panel says ------------------------------------------------------------------------------------
    def verdict(self) -> dict:
        rep, st = self.report, self.state
        assert rep is not None
        pct = 100 * rep.utilization
        fsdp = self._result["fsdp_chips"]
        under = f" with {_mesh_text(fsdp, st.chips)}" if fsdp > 1 else ""
        text = (f"{format_bytes(rep.estimate.peak_bytes)} of {format_bytes(rep.hbm_bytes)} per "
                f"chip on {rep.hardware.name} at batch {st.batch_size}/chip{under} (budget "
                f"{100 * (1 - rep.safety_margin):.0f}%). Largest batch that fits: {rep.max_batch_size}/chip.")
        shown = f"{pct:.0f}%" if pct >= 10 else f"{pct:.2g}%"
        return {"fits": rep.fits, "headline": "FITS" if rep.fits else "DOES NOT FIT", "percent": pct,
                "percent_text": f"{shown} of HBM", "max_batch_size": rep.max_batch_size, "text": text}

    def suggestion(self) -> Suggestion | None:
        """What to change so the step fits (or runs with less accumulation), keeping the global batch."""
        return suggest(self)

    def sharding_text(self) -> str:
        """Per-chip bytes under the chosen SHARDING, then the plan's advice over data parallel and fsdp."""
        return self._result["sharding_text"]

    @staticmethod
    def _sharding_text(st: TuningState, fsdp: int, report: MemoryReport, plan: ShardingPlan) -> str:
        advice = plan.advice()  # says the data-parallel figure: the chosen one is added when it is sharded
        advice = advice[0].upper() + advice[1:]
        if fsdp == 1:
            return advice
        return (f"sharding={st.sharding!r} ({_mesh_text(fsdp, st.chips)}): {format_bytes(report.estimate.peak_bytes)}"
                f" per chip at batch {st.batch_size}/chip. {advice}")

    def apply_suggestion(self) -> dict:
        s = self.suggestion()
        if s is None or s.changes is None:
            raise ValueError("there is no suggestion to apply" if s is None else f"nothing to apply: {s.text}")
        return self.set(**s.changes)

    def warnings(self) -> list[str]:
        st = self.state
        spec = resolve_hardware(st.hardware)
        out = [w for w in [precision_warning(step_precision(st.precision, spec), spec)] if w]
        if spec.kind == "cpu":
            out.append("the CPU entry is nominal (16 GiB, 1 TFLOP/s): its times are not a forecast")
        return out

    def details(self) -> list[str]:
        r, st = self._result, self.state
        spec = resolve_hardware(st.hardware)
        steps = "step" if st.grad_accum == 1 else "steps"
        lines = [f"global batch {r['global_batch']} = {st.batch_size}/chip x {chips_text(st.chips)} x "
                 f"{st.grad_accum} accumulation {steps} ({r['tokens_per_step']:,} tokens/step)"]
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
        lines = [f"{v['headline']} ({v['percent_text']}): {v['text']}", self.sharding_text()]
        lines += [f"suggestion: {s.text}"] if s else []
        lines += [f"warning: {w}" for w in self.warnings()] + self.details()
        if self.error:
            lines.insert(0, f"STALE (last valid values shown): {self.error}")
        return "\n".join(lines)

    def figure(self):
        assert self.report is not None
        fsdp = self._result["fsdp_chips"]
        shard = f", fsdp x{fsdp}" if fsdp > 1 else ""
        plan = f"x {chips_text(self.state.chips)}{shard}, global batch {self._result['global_batch']}"
        return memory_figure(self.report, stale=self.error, plan=plan)

    def show_static(self) -> dict:
        """Print the figures and display the chart (what a papermill run records); returns ``result()``."""
        from IPython.display import Image, display

        print(self.summary())
        display(Image(figure_png(self.figure())))
        return self.result()
