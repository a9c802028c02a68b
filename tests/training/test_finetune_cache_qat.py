"""The fine-tuning recipe with a teacher cache and QAT: a strict XLA:CPU run, recovery LoRA from the cache narrowing
the int4 gap (the offline default of the guide's job), the compiled step's memory against live distillation, and
bad settings."""

from __future__ import annotations

import json

import pytest
import torch

from tests.support import script_result
from tpu_helpers.config import ConfigError, config_from_parameters
from tpu_helpers.recipes.finetune import Finetune, FinetuneConfig


def _job(tmp_path, device, backend=None, **overrides):
    base = dict(device=device, steps=8, batch_size=8, seq_len=32, lr=3e-3, warmup_steps=2, eval_every=4,
                eval_batches=2, log_every=4, save_every=4, out_dir=str(tmp_path / "run"), xla_checks="strict",
                method="distill", teacher="tiny", teacher_cache=str(tmp_path / "cache"), teacher_top_k=32, max_records=400)
    return Finetune(FinetuneConfig(**{**base, **overrides}), backend=backend, progress=False)


@pytest.mark.xla
def test_strict_xla_distillation_from_a_cache_with_int4_qat_compiles_once_and_learns(tmp_path):
    from tests.support import XLA_BACKEND

    job = _job(tmp_path, "xla", XLA_BACKEND, qat="int4", grad_accum=2)
    report = job.train()  # xla_checks="strict": a recompile, a host read or a CPU fallback after warm-up raises
    losses = [r["loss"] for r in job.history.train]
    assert losses[-1] < losses[0] and report.final_val_loss < report.first_val_loss
    assert report.xla["compilations"] <= 3 and report.xla["cpu_fallback_ops"] == {}, report.xla
    manifest = json.loads((tmp_path / "cache" / "manifest.json").read_text())
    assert manifest["complete"] and manifest["identity"]["k"] == 32 and manifest["rows"] == len(job.train_data)
    assert "teacher" not in job.__dict__  # dropped once the cache was written: the step never held it
    assert type(job.model.base_model.model.model.layers[0].self_attn.q_proj.base_layer).__name__ == \
        "FakeQuantizedLinear"


def _plant_outlier_channels(model: torch.nn.Module, factor: float = 64.0, every: int = 32) -> None:
    """Scale one input channel per group of `every` up by `factor` in every linear after a norm and the norm's weight
    down by as much: the same function (powers of two: exactly), with the outlier channels LLMs have, which are
    what makes per-group int4 lose accuracy (a group's scale follows its outlier, its other weights round to 0)."""
    with torch.no_grad():
        for layer in model.model.layers:
            for norm, linears in ((layer.input_layernorm, ("q_proj", "k_proj", "v_proj")),
                                  (layer.post_attention_layernorm, ("gate_proj", "up_proj"))):
                idx = torch.arange(0, norm.weight.shape[0], every)
                norm.weight[idx] /= factor
                for name in linears:
                    getattr(layer.self_attn if name.endswith(("q_proj", "k_proj", "v_proj")) else layer.mlp,
                            name).weight[:, idx] *= factor


def test_recovery_lora_from_the_cache_narrows_the_int4_gap(tmp_path, one_thread):
    # one_thread: 40 s with two threads on a loaded 2-core machine, 9 s with one (the same losses, printed below)
    common = dict(device="cpu", batch_size=16, seq_len=48, lr=3e-3, warmup_steps=5, eval_every=1000, eval_batches=4,
                  log_every=10, save_every=1000, xla_checks="off", max_records=600, val_fraction=0.1)
    teacher = Finetune(FinetuneConfig(method="full", steps=60, out_dir=str(tmp_path / "teacher"), **common),
                       progress=False)
    teacher.train()
    trained = teacher.trainer.evaluate()
    _plant_outlier_channels(teacher.model)
    assert teacher.trainer.evaluate() == pytest.approx(trained, abs=1e-5)  # the same function
    source = teacher.export(merged=True)["merged"]

    unquantized = Finetune(FinetuneConfig(method="lora", model=source, out_dir=str(tmp_path / "fp"), **common),
                           progress=False).trainer.evaluate()
    recovery = Finetune(FinetuneConfig(
        method="distill", model=source, teacher=source, teacher_cache=str(tmp_path / "cache"), teacher_top_k=32, qat="int4",
        lora_r=8, lora_targets="all-linear", distill_alpha=0.0, distill_temperature=1.0, steps=30,
        out_dir=str(tmp_path / "recovery"), **{**common, "eval_every": 30, "lr": 1e-2}), progress=False)
    report = recovery.train()
    quantized, recovered = report.first_val_loss, report.final_val_loss  # step 0: the adapters start at zero
    print(f"held-out loss: unquantized {unquantized:.4f}, int4 {quantized:.4f}, int4 + recovery LoRA from the "
          f"top-32 cache {recovered:.4f} (gap {quantized - unquantized:.4f} -> {recovered - unquantized:.4f})")
    assert quantized > unquantized + 0.05
    assert recovered < quantized - 0.5 * (quantized - unquantized)


@pytest.mark.xla
def test_compiled_step_of_cached_distillation_is_smaller_than_live_distillation(tmp_path):
    from tpu_helpers.backend.runtime_env import dump_env

    # A fresh process: XLA reads its dump flags when it starts (each program's memory report).
    dump = tmp_path / "dump"
    result = script_result("distill_memory", {"steps": 3, "dump": str(dump), "out": str(tmp_path)},
                           env=dump_env(dump, memory_scheduler=True), timeout=900)
    live, cached = result["live"], result["cached"]
    print(f"compiled training step on XLA:CPU: live teacher {live / 2**20:.2f} MiB, teacher cache "
          f"{cached / 2**20:.2f} MiB")
    assert cached < live


def test_bad_cache_and_qat_settings_are_clear_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"QAT='int3' is not one of \('int4', 'int8'\)"):
        config_from_parameters({"QAT": "int3"}, base=FinetuneConfig())
    with pytest.raises(ConfigError, match=r"QAT_GROUP_SIZE=1 must be an integer >= 2"):
        config_from_parameters({"QAT": "int4", "QAT_GROUP_SIZE": 1}, base=FinetuneConfig())
    with pytest.raises(ConfigError, match=r"TEACHER_CACHE='c' is a directory for METHOD='distill'.*METHOD='lora'"):
        config_from_parameters({"TEACHER_CACHE": "c"}, base=FinetuneConfig())
    with pytest.raises(ConfigError, match=r"TEACHER_TOP_K=0 must be an integer >= 1"):
        config_from_parameters({"METHOD": "distill", "TEACHER": "tiny", "TEACHER_TOP_K": 0}, base=FinetuneConfig())
    with pytest.raises(ConfigError, match=r"QAT_GROUP_SIZE=64 does not divide the input width of gate_proj \(96\)"):
        _ = _job(tmp_path, "cpu", qat="int4", qat_group_size=64).model
    with pytest.raises(ConfigError, match=r"TOP_K=1000 is larger than the vocabulary \(512 tokens\)"):
        _ = _job(tmp_path, "cpu", teacher_top_k=1000).teacher_cache
    assert not (tmp_path / "cache").exists()  # refused before any teacher ran
    with pytest.raises(ConfigError, match=r"holds no finished cache and TEACHER=None"):
        _ = _job(tmp_path, "cpu", teacher=None).teacher_cache
    _job(tmp_path, "cpu", teacher_top_k=8).teacher_cache  # noqa: B018 (built)
    with pytest.raises(ConfigError, match=r"TEACHER_CACHE=.* made for other data or settings: .*seq_len: 32 in the "
                                          r"cache, 48 here"):
        _ = _job(tmp_path, "cpu", teacher_top_k=8, seq_len=48).teacher_cache
    with pytest.raises(ConfigError, match=r"data \(fingerprint of the tokenized rows\): '\w+' in the cache"):
        _ = _job(tmp_path, "cpu", teacher_top_k=8, max_records=300).teacher_cache
    with pytest.raises(ConfigError, match=r"top-k: 8 in the cache, 16 here"):
        _ = _job(tmp_path, "cpu", teacher_top_k=16).teacher_cache
