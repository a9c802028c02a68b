"""A post-training chain on the tiny model (docs/jobs/chain.md): SFT -> GRPO -> SimPO -> on-policy distillation,
each job starting from the last one's OUT_DIR as the notebooks take it (GRPO's START_FROM; MODEL and TEACHER of the
preference and fine-tuning jobs), and each starting from exactly the weights the last one exported. A folder that
holds only an adapter is refused as MODEL, saying what would work."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tpu_helpers.config import ConfigError
from tpu_helpers.recipes.finetune import Finetune, FinetuneConfig
from tpu_helpers.recipes.grpo import GRPO, GRPOConfig
from tpu_helpers.recipes.preference import Preference, PreferenceConfig

SHARED = dict(device="cpu", steps=2, lr=1e-2, warmup_steps=1, log_every=1, save_every=100, lora_r=4)


def _exported(out_dir: Path) -> dict[str, torch.Tensor]:
    merged = out_dir / "merged"
    return {k: v for f in sorted(merged.glob("*.safetensors")) for k, v in load_file(f).items()}


def _starts_from(model: torch.nn.Module, exported: dict[str, torch.Tensor]) -> None:
    """The job's model before training holds the exported weights (LoRA's base layers under peft's names)."""
    own = {k.replace("base_model.model.", "").replace(".base_layer", ""): v.detach()
           for k, v in model.state_dict().items() if "lora_" not in k}
    shared = sorted(set(own) & set(exported))
    assert len(shared) >= len(exported) - 1, (sorted(exported)[:4], sorted(own)[:4])  # a tied head may be one name
    for name in shared:
        torch.testing.assert_close(own[name].float(), exported[name].float(), msg=name)


def test_sft_grpo_simpo_and_on_policy_distillation_each_start_from_the_last_runs_out_dir(tmp_path):
    sft_dir, grpo_dir, simpo_dir, distill_dir = (tmp_path / n for n in ("sft", "grpo", "simpo", "distill"))
    sft = Finetune(FinetuneConfig(**SHARED, batch_size=4, seq_len=32, max_records=128, eval_every=100,
                                  eval_batches=1, export="last", out_dir=str(sft_dir)), progress=False)
    sft.train()
    sft.export()

    grpo = GRPO(GRPOConfig(**SHARED, start_from=str(sft_dir), batch_size=2, num_generations=2, max_prompt_len=24,
                           max_new_tokens=3, max_records=32, out_dir=str(grpo_dir)), progress=False)
    assert grpo.start_source == str(sft_dir / "merged")
    _starts_from(grpo.model, _exported(sft_dir))
    grpo.train()
    grpo.export()

    simpo = Preference(PreferenceConfig(**SHARED, model=str(grpo_dir), algorithm="simpo", beta=2.0, batch_size=4,
                                        seq_len=40, max_records=48, val_fraction=0.2, eval_every=100,
                                        out_dir=str(simpo_dir)), progress=False)
    assert simpo.source == str(grpo_dir / "merged")
    _starts_from(simpo.model, _exported(grpo_dir))
    simpo.train()
    simpo.export()

    student = Finetune(FinetuneConfig(**SHARED, model=str(simpo_dir), method="distill", teacher=str(sft_dir),
                                      distill_lambda=1.0, distill_beta=0.5, distill_alpha=0.0, max_new_tokens=4,
                                      batch_size=4, seq_len=32, max_records=128, eval_every=100, eval_batches=1,
                                      out_dir=str(distill_dir)), progress=False)
    assert student.source == str(simpo_dir / "merged")
    _starts_from(student.model, _exported(simpo_dir))
    report = student.train()
    assert report.steps == 2 and all(torch.isfinite(torch.tensor(r["loss"])) for r in student.history.train)
    paths = student.export()
    assert Path(paths["merged"]).is_dir()


def test_a_run_folder_with_only_an_adapter_is_refused_as_model_saying_what_works(tmp_path):
    run = tmp_path / "run"
    (run / "adapter").mkdir(parents=True)
    (run / "adapter" / "adapter_config.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"MODEL=.*run.*no merged model.*EXPORT_MERGED=True.*START_FROM"):
        PreferenceConfig(model=str(run))
