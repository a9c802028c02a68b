"""The tuning panel's probe: the largest batch that really runs on the device the notebook runs on.

A mixin of :class:`tpu_helpers.panel.tuning.TuningPanel` (kept apart from the panel's figures)::

    panel.probe_start(backend)        # where the probe starts: the estimate for this device
    panel.probe(backend)              # build the configured GPT here and find the largest batch that runs
    panel.probe_changes()             # the settings that use that batch ("use this batch")

The probe runs the model unsharded on this one device, whatever the panel's SHARDING: its answer is the batch one
chip holds with the whole model, which under fsdp on the target slice is a lower bound.
"""

from __future__ import annotations

import threading
from typing import Any

from tpu_helpers.memory.report import largest_fitting_batch
from tpu_helpers.panel.options import split_batch


class ProbeMixin:
    """Needs ``state``, ``model_config(state)`` and ``_estimator(state, precision, attention, fsdp)``."""

    probe_result = None

    def _init_probe(self) -> None:
        self.probe_result = None
        self._probe_key: tuple | None = None
        self._probe_lock = threading.Lock()

    def probe_start(self, backend, cpu_limit_bytes: int | None = None, max_batch_size: int = 1024,
                    state=None) -> dict:
        """Where the probe starts: the estimate's largest batch for the device it runs on (its memory, or the cap
        imposed on the CPU, and the precision it runs in), with the whole model on that one device."""
        st = state or self.state
        precision = backend.precision
        pure_bf16 = st.pure_bf16 and precision == "bf16"  # bf16 weights where this device computes in bf16
        cap = cpu_limit_bytes if backend.runs_on_host else None
        budget = cap if cap is not None else backend.hardware.hbm_bytes * (1 - st.safety_margin)
        est = self._estimator(st, precision=precision, pure_bf16=pure_bf16, attention=backend.attention_kind, fsdp=1)
        start = largest_fitting_batch(est, budget, upper=max_batch_size) if budget else st.batch_size
        return {"start": max(1, min(start, max_batch_size)), "precision": precision, "pure_bf16": pure_bf16,
                "memory_limit_bytes": cap}

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
        from tpu_helpers.memory.traced import gpt_batch, step_trainer
        from tpu_helpers.models.gpt import GPT

        st = self.state  # one snapshot: a control may change while the probe runs
        plan = self.probe_start(backend, cpu_limit_bytes, max_batch_size, state=st)
        cfg = self.model_config(st)
        model = GPT(cfg)
        if plan["pure_bf16"]:
            model = model.to(torch.bfloat16)
        # The trainer's own step, optimizer and zero_grad policy, on this one device (whatever the panel's SHARDING).
        # Accumulating keeps the gradients between micro-batches (any count > 1 holds the same memory).
        trainer = step_trainer(model, backend, precision=backend.precision, optimizer=st.optimizer,
                               gradient_checkpointing=st.gradient_checkpointing, grad_accum=min(st.grad_accum, 2))
        if plan["memory_limit_bytes"] is not None:
            kwargs.setdefault("memory_limit_bytes", plan["memory_limit_bytes"])
        result = probe_batch_size(trainer, gpt_batch(st.seq_len, cfg.vocab_size), start=plan["start"],
                                  max_tries=max_tries, max_batch_size=max_batch_size, growth=growth, **kwargs)
        if plan["pure_bf16"]:
            result.precision += " (pure_bf16)"
        self.probe_result, self._probe_key = result, self._model_key(st)
        return result

    @staticmethod
    def _model_key(st) -> tuple:
        return (st.preset, st.n_layer, st.n_head, st.n_embd, st.vocab_size, st.seq_len, st.precision, st.pure_bf16,
                st.gradient_checkpointing, st.optimizer, st.grad_accum > 1)

    def probe_changes(self) -> dict | None:
        """Settings that use the probe's batch: that batch per chip (with a global batch set, the largest
        micro-batch up to it that divides it). None before a useful probe or once the model settings changed."""
        p = self.probe_result
        if p is None or p.max_batch_size < 1 or self._probe_key != self._model_key(self.state):
            return None
        if self.state.global_batch is None:
            return {"batch_size": p.max_batch_size}
        b, a = split_batch(self.state.global_batch // self.state.chips, p.max_batch_size)
        return {"batch_size": b, "grad_accum": a}
