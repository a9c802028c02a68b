"""The fine-tuning recipe: LoRA, full and distillation runs (XLA:CPU strict), exact LoRA resume, bad parameters."""

from __future__ import annotations

import pytest
import torch

from tests.support import StopAt
from tpu_helpers.config import ConfigError, config_from_parameters
from tpu_helpers.recipes.finetune import Finetune, FinetuneConfig


def _config(tmp_path, device, *, method="lora", **overrides):
    base = dict(device=device, steps=8, batch_size=8, seq_len=32, lr=3e-3, warmup_steps=2, eval_every=4,
                eval_batches=2, log_every=4, save_every=4, out_dir=str(tmp_path / "run"), xla_checks="strict",
                method=method, teacher="tiny" if method == "distill" else None, max_records=400)
    return FinetuneConfig(**{**base, **overrides})


def _job(tmp_path, device, *, method="lora", backend=None, callbacks=None, **overrides):
    return Finetune(_config(tmp_path, device, method=method, **overrides), backend=backend, progress=False,
                    callbacks=callbacks)


@pytest.mark.xla
@pytest.mark.parametrize("method", ["lora", "full", "distill"])
def test_strict_xla_runs_train_without_recompiling_or_stray_reads(tmp_path, method):
    from tests.support import XLA_BACKEND

    job = _job(tmp_path, "xla", method=method, grad_accum=2, backend=XLA_BACKEND)
    report = job.train()  # xla_checks="strict": a recompile or host read after warm-up raises
    losses = [r["loss"] for r in job.history.train]
    assert losses[-1] < losses[0] and report.final_val_loss < report.first_val_loss
    # Step 1 and the steady step, plus the evaluation graph (the first evaluation runs before step 1).
    assert report.xla["compilations"] <= 3, report.xla
    assert report.xla["cpu_fallback_ops"] == {}  # the distillation loss uses no kl_div kernel


def test_lora_resume_is_bit_identical_and_checkpoints_hold_the_adapter_only(tmp_path):
    whole = _job(tmp_path / "a", "cpu", steps=6, save_every=3, xla_checks="off")
    whole.train()
    first = _job(tmp_path / "b", "cpu", steps=6, save_every=3, xla_checks="off", callbacks=[StopAt(3)])
    first.train()  # as a SIGTERM would: finish the step, save, stop
    assert first.trainer.step == 3
    resumed = _job(tmp_path / "b", "cpu", steps=6, save_every=3, xla_checks="off")
    report = resumed.train()
    assert report.resumed_from == 3
    a = {n: p for n, p in whole.model.named_parameters() if p.requires_grad}
    b = {n: p for n, p in resumed.model.named_parameters() if p.requires_grad}
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    ckpt = torch.load(tmp_path / "b" / "run" / "checkpoints" / "ckpt-00000006.pt", weights_only=False)
    assert set(ckpt["model"]) == set(a) and all("lora_" in k for k in ckpt["model"])
    adapter_bytes = sum(t.numel() * t.element_size() for t in ckpt["model"].values())
    full_bytes = sum(p.numel() * p.element_size() for p in whole.model.parameters())
    assert adapter_bytes < 0.1 * full_bytes


def test_resume_refuses_another_base_model(tmp_path):
    _job(tmp_path, "cpu", steps=2, save_every=2, xla_checks="off").train()
    job = _job(tmp_path, "cpu", steps=4, save_every=2, xla_checks="off")
    with torch.no_grad():
        job.model.get_base_model().model.layers[0].mlp.up_proj.weight.add_(1.0)  # another frozen base
    with pytest.raises(ConfigError, match=r"holds checkpoints of a different run \(base_hash"):
        job.train()


def test_notebook_parameters_are_fields_and_checked():
    cfg = config_from_parameters({"MODEL": "tiny", "METHOD": "full", "LORA_R": 4, "SEQ_LEN": 64,
                                  "GRADIENT_CHECKPOINTING": True, "DEVICE": "cpu"}, base=FinetuneConfig())
    assert (cfg.method, cfg.lora_r, cfg.seq_len, cfg.gradient_checkpointing) == ("full", 4, 64, True)
    assert cfg.tokenizer == "tiny" and cfg.extra == {}  # the model's own tokenizer; nothing travels untyped
    with pytest.raises(ConfigError, match=r"unknown notebook parameter\(s\) \['LORA_RANK'\]; allowed: .*LORA_R"):
        config_from_parameters({"LORA_RANK": 4}, base=FinetuneConfig())
    with pytest.raises(ConfigError, match=r"METHOD='qlora' is not one of \('lora', 'full', 'distill'\)"):
        config_from_parameters({"METHOD": "qlora"}, base=FinetuneConfig())
    with pytest.raises(ConfigError, match=r"METHOD='distill' needs a teacher: TEACHER=None"):
        config_from_parameters({"METHOD": "distill"}, base=FinetuneConfig())
    with pytest.raises(ConfigError, match=r"LORA_R='8' has type str; expected int"):
        config_from_parameters({"LORA_R": "8"}, base=FinetuneConfig())
