"""The fine-tuning recipe: LoRA, full and distillation runs (XLA:CPU strict), exact LoRA resume, bad parameters."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.support import StopAt, assert_same_trainable_weights
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
    a = assert_same_trainable_weights(whole.model, resumed.model)
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


@pytest.mark.parametrize("method", ["lora", "full"])
def test_export_best_takes_the_best_checkpoints_weights_and_last_the_live_ones(tmp_path, method):
    """Validation every 5 steps, keep_last=1; healthy to step 10, then resumed with lr=0.3, after which the
    validation loss rises (the run goes on: on_divergence='off'). EXPORT="best" writes step 10's weights, read
    from its checkpoint (the adapters alone under LoRA); "last" the weights training ended with."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import load_file

    settings = dict(steps=10, save_every=5, eval_every=5, log_every=5, keep_last=1, xla_checks="off")
    first = _job(tmp_path, "cpu", method=method, **settings)
    first.train()

    def exported_form(job) -> dict:  # the tensors an export writes, taken from the live model
        if method == "lora":
            return {k: v.detach().clone() for k, v in get_peft_model_state_dict(job.model).items()}
        return {k: v.detach().float().clone() for k, v in job.model.state_dict().items()}

    at_10 = exported_form(first)
    worse = _job(tmp_path, "cpu", method=method, **{**settings, "steps": 20, "lr": 0.3, "on_divergence": "off"})
    report = worse.train()
    evals = {e["step"]: e["val_loss"] for e in worse.history.eval}
    assert evals[15] > evals[10] and evals[20] > evals[10], evals
    assert report.best_checkpoint["step"] == 10
    assert [p.name for p in sorted((tmp_path / "run" / "checkpoints").glob("ckpt-*.pt"))] == [
        "ckpt-00000010.pt", "ckpt-00000020.pt"]  # the best and the newest (keep_last=1)

    def written(paths: dict) -> dict:
        if method == "lora":
            return load_file(Path(paths["adapter"]) / "adapter_model.safetensors")
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(paths["merged"]).state_dict()

    best = written(worse.export(tmp_path / "best"))  # EXPORT's default
    assert worse.exported == {"weights": "best", **report.best_checkpoint}
    assert json.loads((tmp_path / "best" / "finetune.json").read_text())["weights"]["step"] == 10
    last = written(worse.export(tmp_path / "last", weights="last"))
    assert worse.exported == {"weights": "last", "step": 20}
    live = exported_form(worse)
    assert sorted(best) == sorted(last) == sorted(at_10), (sorted(best)[:3], sorted(at_10)[:3])
    for name in at_10:
        assert torch.equal(best[name], at_10[name]), name
        assert torch.equal(last[name], live[name]), name
    assert any(not torch.equal(at_10[n], live[n]) for n in at_10)  # the two exports do differ
    with pytest.raises(ConfigError, match=r"export='final' is not one of \('best', 'last'\)"):
        worse.export(tmp_path / "x", weights="final")
