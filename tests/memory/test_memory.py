"""Memory estimators (analytic, traced, compiled), the live-bytes limit and the OOM-safe probe. The traced and
compiled estimates and the probe run the trainer's own step (`Trainer.train_step`, `memory.step_trainer`), and so
do the real measurements they are checked against."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from tests.example_models import SmallCNN, cnn_batch
from tests.support import script_result
from tpu_helpers.backend import get_backend
from tpu_helpers.memory import (
    LiveBytes,
    MetaBuildError,
    analytic_estimate,
    gpt_batch,
    largest_fitting_batch,
    memory_report,
    probe_batch_size,
    step_trainer,
    traced_estimate,
)
from tpu_helpers.models.gpt import GPT, GPTConfig, gpt_config

TINY = gpt_config("tiny")


def cpu_trainer(model, precision: str = "fp32", **kw):
    """The trainer's step over `model` on the CPU (no data), as the estimates and the probe run it."""
    return step_trainer(model, get_backend("cpu", precision=precision), precision=precision, **kw)


def step(trainer, batch) -> torch.Tensor:
    loss, _ = trainer.train_step(itertools.repeat(batch))
    return loss


def measured_peak(trainer, batch) -> int:
    """Peak live bytes of the second of two real steps (the first creates the optimizer state)."""
    step(trainer, batch)
    with LiveBytes(trainer.model, trainer.optimizer, batch) as live:
        step(trainer, batch)
    return live.peak_bytes


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_traced_matches_a_real_cpu_step_within_2_percent(precision):
    real = measured_peak(cpu_trainer(GPT(TINY), precision), gpt_batch(64, 256)(16))
    est = traced_estimate(lambda: GPT(TINY), gpt_batch(64, 256), 16, precision=precision)
    assert abs(est.peak_bytes / real - 1) < 0.02, (est.peak_bytes, real)
    # AdamW: two states per weight (plus a 4-byte step count each); the tied embedding counted once.
    assert est.breakdown["optimizer"] == pytest.approx(2 * est.breakdown["params"], rel=1e-3)


def test_traced_describes_a_cnn_the_analytic_estimate_cannot():
    real = measured_peak(cpu_trainer(SmallCNN(), optimizer="sgd", loss_fn=F.cross_entropy), cnn_batch(32))
    est = traced_estimate(SmallCNN, cnn_batch, 32, optimizer="sgd", loss_fn=F.cross_entropy)
    assert abs(est.peak_bytes / real - 1) < 0.02, (est.peak_bytes, real)
    with pytest.raises(TypeError, match="preset name"):
        analytic_estimate(SmallCNN(), 32)


def test_traced_allocates_nothing_for_a_model_far_larger_than_this_machine():
    # 4 x 40000 x 40000 fp32 = 25.6 GB of weights (more than this machine's RAM), plus gradients and AdamW state.
    def huge():
        return torch.nn.Sequential(*[torch.nn.Linear(40_000, 40_000, bias=False) for _ in range(4)])

    est = traced_estimate(huge, lambda b: (torch.randn(b, 40_000), torch.randint(0, 40_000, (b,))), 2,
                          loss_fn=F.cross_entropy)
    assert est.breakdown["params"] == 4 * 40_000**2 * 4
    assert est.peak_bytes > 4 * est.breakdown["params"]


def test_model_that_cannot_be_built_on_meta_gets_a_clear_error():
    class ReadsValues(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = float(torch.ones(1).sum().item())  # a host read: impossible on meta
            self.lin = torch.nn.Linear(4, 4)

    with pytest.raises(MetaBuildError, match="meta device"):
        traced_estimate(ReadsValues, lambda b: (torch.randn(b, 4), torch.randint(0, 4, (b,))), 2)


@pytest.mark.parametrize("kw", [{}, {"gradient_checkpointing": True}, {"precision": "bf16"},
                                {"precision": "bf16", "pure_bf16": True}, {"optimizer": "sgd"},
                                {"optimizer": "adafactor"}, {"grad_accum": 2}])
@pytest.mark.parametrize("batch, seq", [(8, 128), (1, 8)])  # activations dominate | the weights' update does
def test_analytic_within_10_percent_of_traced_for_mini(kw, batch, seq):
    cfg = gpt_config("mini")
    traced = traced_estimate(lambda: GPT(cfg), gpt_batch(seq, cfg.vocab_size), batch, **kw)
    analytic = analytic_estimate(cfg, batch, seq, **kw)
    assert abs(analytic.peak_bytes / traced.peak_bytes - 1) < 0.10, (analytic, traced)
    # (At a peak in the optimizer update, MemTracker counts the update's temporaries as optimizer state too.)
    for part in ("params", "optimizer") if batch > 1 else ("params",):
        assert abs(analytic.breakdown[part] - traced.breakdown[part]) <= 0.01 * traced.breakdown[part] + 64
    # The trainer drops the gradients between steps: at a peak at the start of the backward only those kept by
    # gradient accumulation are alive, at one at its end all of them. The analytic figure bounds what is alive.
    assert traced.breakdown["grads"] <= analytic.breakdown["grads"] + 0.01 * traced.breakdown["params"] + 64
    if kw.get("grad_accum", 1) > 1 or batch == 1:
        assert traced.breakdown["grads"] == pytest.approx(analytic.breakdown["grads"], rel=0.01)


def test_analytic_responds_to_every_choice():
    base = analytic_estimate("small", 8, 1024)
    assert analytic_estimate("small", 16, 1024).breakdown["activations"] > 1.9 * base.breakdown["activations"]
    assert analytic_estimate("small", 8, 1024, gradient_checkpointing=True).peak_bytes < 0.7 * base.peak_bytes
    assert analytic_estimate("small", 8, 1024, precision="bf16", pure_bf16=True).breakdown["params"] * 2 == \
        base.breakdown["params"]
    opts = [analytic_estimate("small", 8, 1024, optimizer=o).breakdown["optimizer"] for o in
            ("adamw", "sgd", "adafactor")]
    assert opts[0] == 2 * opts[1] and opts[2] < opts[1] / 100
    math = analytic_estimate("small", 8, 1024, attention="math")
    assert math.breakdown["activations"] - base.breakdown["activations"] == 12 * 12 * 1024**2 * 8 * 4
    # Data parallel: the per-chip figure does not depend on the chips. With grad_accum the gradients of the earlier
    # micro-batches stay alive while the next one runs (the trainer drops them only between steps).
    assert analytic_estimate("small", 8, 1024, grad_accum=4).peak_bytes == base.peak_bytes + base.breakdown["params"]
    assert analytic_estimate("small", 8, 1024, precision="fp16").peak_bytes == \
        analytic_estimate("small", 8, 1024, precision="bf16").peak_bytes  # fp16 autocast: bf16's bytes


@pytest.mark.parametrize("call, message", [
    (lambda: analytic_estimate({"n_embd": 65, "n_head": 2}, 1, 8), "65"),
    (lambda: analytic_estimate("tiny", 0, 8), "batch_size"),
    (lambda: analytic_estimate("tiny", 2, -1), "seq_len"),
    (lambda: analytic_estimate("tiny", 2, 65), "block_size"),
    (lambda: analytic_estimate("tiny", 2, 8, precision="fp8"), "fp8"),
    (lambda: analytic_estimate("tiny", 2, 8, precision="auto"), "precision='auto' depends on the device"),
    (lambda: analytic_estimate("tiny", 2, 8, precision="fp32", pure_bf16=True), "needs precision='bf16'"),
    (lambda: traced_estimate(lambda: GPT(TINY), gpt_batch(8, 256), 2, optimizer="adam"), "optimizer='adam'"),
    (lambda: traced_estimate(lambda: GPT(TINY), gpt_batch(8, 256), 0), "batch_size"),
    (lambda: gpt_batch(0, 256), "seq_len"),
    (lambda: memory_report(lambda b: analytic_estimate("tiny", b, 8), 2, "tpu v9z"), "tpu v9z"),
    (lambda: memory_report(lambda b: analytic_estimate("tiny", b, 8), 2, "v5e", safety_margin=1.5), "1.5"),
])
def test_bad_input_names_the_value(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_report_largest_batch_fits_and_one_more_does_not():
    def est(b):
        return analytic_estimate("small", b, 1024, precision="bf16")

    rep = memory_report(est, 8, "v5e")
    assert rep.hardware.name == "TPU v5e" and rep.budget_bytes == pytest.approx(0.9 * 16e9)
    assert est(rep.max_batch_size).peak_bytes <= rep.budget_bytes < est(rep.max_batch_size + 1).peak_bytes
    assert memory_report(est, 8, "h100").max_batch_size > rep.max_batch_size
    assert rep.fits == (rep.estimate.peak_bytes <= rep.budget_bytes) and "TPU v5e" in rep.summary()


def test_live_bytes_limit_raises_oom_and_the_process_carries_on():
    trainer = cpu_trainer(GPT(TINY))
    batch = gpt_batch(64, 256)(64)
    with pytest.raises(torch.OutOfMemoryError, match="forced limit"):
        with LiveBytes(trainer.model, trainer.optimizer, batch, limit_bytes=4 * 2**20):
            step(trainer, batch)
    assert get_backend("cpu").is_out_of_memory(torch.OutOfMemoryError("x"))
    trainer.optimizer.zero_grad()
    assert torch.isfinite(step(trainer, gpt_batch(64, 256)(4)))


def test_probe_on_cpu_with_a_forced_limit_finds_the_traced_answer_and_leaves_state_untouched():
    trainer = cpu_trainer(GPT(TINY))
    model, opt = trainer.model, trainer.optimizer
    step(trainer, gpt_batch(64, 256)(4))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt_before = [s["exp_avg"].clone() for s in opt.state.values()]
    schedule_before = trainer.scheduler.state_dict()
    limit = 30 * 2**20
    expected = largest_fitting_batch(lambda b: traced_estimate(lambda: GPT(TINY), gpt_batch(64, 256), b), limit)
    result = probe_batch_size(trainer, gpt_batch(64, 256), start=8, max_tries=8, memory_limit_bytes=limit)
    assert abs(result.max_batch_size - expected) <= 1, (result.summary(), expected)
    assert any(not t["ok"] for t in result.tries) and len(result.tries) <= 8
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(torch.equal(a, s["exp_avg"]) for a, s in zip(opt_before, opt.state.values(), strict=True))
    assert trainer.scheduler.state_dict() == schedule_before  # the learning-rate schedule did not move either
    assert torch.isfinite(step(trainer, gpt_batch(64, 256)(4)))
    with pytest.raises(TypeError, match=r"probe_batch_size measures a Trainer's step; got GPT"):
        probe_batch_size(model, gpt_batch(64, 256))


def test_the_probe_measures_the_trainers_own_step_a_subclasss_included():
    from tpu_helpers.training.trainer import Trainer

    class Counted(Trainer):  # a variant's step (as CausalLMTrainer's): the probe must run this one
        calls = 0

        def train_step(self, batches):
            Counted.calls += 1
            return super().train_step(batches)

    trainer = Counted(GPT(TINY), None, config=cpu_trainer(GPT(TINY)).config, backend=get_backend("cpu"),
                      progress=False)
    result = probe_batch_size(trainer, gpt_batch(16, 256), start=2, max_batch_size=4, max_tries=2, steps_per_try=2)
    assert result.max_batch_size == 4 and Counted.calls == 2 * len(result.tries)
    assert isinstance(trainer.optimizer, torch.optim.AdamW) and trainer.optimizer.param_groups[0]["betas"] == (0.9,
                                                                                                               0.95)


@pytest.mark.xla
def test_xla_backend_recognises_tpu_and_xla_cpu_out_of_memory():
    backend = get_backend("xla", spmd=False)
    assert backend.is_out_of_memory(ValueError("RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm. Used"))
    assert backend.is_out_of_memory(RuntimeError("Error preparing computation: Out of memory allocating 44 bytes."))
    assert not backend.is_out_of_memory(ValueError("shape mismatch"))


@pytest.mark.xla
def test_probe_on_xla_cpu_under_a_real_memory_limit_recovers_and_counts_compilations():
    out = script_result("probe_under_rlimit", timeout=600)
    oom = [t for t in out["tries"] if not t["ok"]]
    assert oom and all("Out of memory" in t["error"] for t in oom), out
    assert out["max_batch_size"] > 0 and out["tries"][0]["batch_size"] == 4096
    assert out["compilations"] >= 1
    assert out["same"] and out["loss"] == out["loss"]  # untouched state, and a later step still runs (not NaN)


@pytest.mark.xla
def test_compiled_estimate_reads_xla_memory_report():
    from tpu_helpers.memory import compiled_estimate

    est = compiled_estimate("tiny", 8, 64)
    eager = traced_estimate(lambda: GPT(TINY), gpt_batch(64, 256), 8)
    assert est.method == "compiled" and est.breakdown["params"] == eager.breakdown["params"]
    # The compiled graph holds inputs and outputs of the update separately: more than the eager peak, same order.
    assert eager.peak_bytes < est.peak_bytes < 5 * eager.peak_bytes
    assert any("compilations" in n for n in est.notes)


@pytest.mark.xla
@pytest.mark.slow
def test_compiled_estimate_compiles_every_micro_batch_of_grad_accum():
    from concurrent.futures import ThreadPoolExecutor

    from tpu_helpers.memory import compiled_estimate

    with ThreadPoolExecutor(2) as pool:  # two compile subprocesses side by side
        one, two = pool.map(lambda accum: compiled_estimate("tiny", 8, 64, grad_accum=accum), (1, 2))
    state = ("params", "grads", "optimizer")
    assert [two.breakdown[k] for k in state] == [one.breakdown[k] for k in state]
    assert "grad_accum: 2" in two.notes and "grad_accum: 1" in one.notes
    # The step's graph holds the second micro-batch's forward and backward too: more than the first micro-batch's
    # figure plus its kept gradients, which is all a step that ignored grad_accum, or whose two identical passes XLA
    # computed once, would add (10.1 -> 17.4 MB measured; the eager step adds only the gradients).
    assert two.peak_bytes > one.peak_bytes + two.breakdown["grads"]
    eager = [traced_estimate(lambda: GPT(TINY), gpt_batch(64, 256), 8, grad_accum=a) for a in (1, 2)]
    assert abs(eager[1].peak_bytes - eager[0].peak_bytes - two.breakdown["grads"]) < 64  # (and a 4-byte scalar)


def test_gpt_config_rejects_heads_that_do_not_divide_width():
    with pytest.raises(ValueError, match="65"):
        GPTConfig(n_embd=65, n_head=2)


@pytest.mark.xla
def test_xla_prepare_model_keeps_tied_weights_tied():
    model = get_backend("xla", spmd=False).prepare_model(GPT(TINY))
    assert model.lm_head.weight is model.transformer.wte.weight
    assert model.lm_head.weight.device.type == "xla"
