"""The Hugging Face recipes after their restructuring into siblings on one job (recipes/hf_job.py): the same jobs
train the same way, to the bit, and each recipe's config refuses the others' fields by name."""

from __future__ import annotations

import warnings

import pytest
import torch

from tpu_helpers.config import ConfigError, config_from_parameters
from tpu_helpers.recipes.finetune import Finetune, FinetuneConfig
from tpu_helpers.recipes.grpo import GRPO, GRPOConfig

REWARD = "tests.algorithms.test_grpo:odd_first_character"  # a reward an untrained model's answers vary on

# The first 3 training losses of each job below on the CPU (fp32). Recorded with the code before the restructuring
# (commit 8a2b209: GRPOConfig a subclass of FinetuneConfig, the algorithms under training/), and equal to the bit
# after it (commit 1fb5343). Three were then re-recorded for fixes that change them by design: the cached
# distillation's student tail is an exact logsumexp (was log(1 - sum), step 3 was 3.015127658843994), and GRPO
# samples by Gumbel-max with the process index in its key (grpo was [0.0, 9.934107758624577e-09,
# 0.0002988527121488005], grpo_full [0.0, 0.0, 0.0004716805706266314]); the CPU's rollouts decode their live rows
# with grouped-query attention, summed in another order (grpo_full was [2.98e-08, -0.12587374448776245,
# 0.0005628947401419282]). Exact but for float32 rounding: a refactor
# must run the same arithmetic in the same order, and the CPU's kernels round differently from one machine to another
# (on an AMD EPYC lora's third loss is one ulp lower, 6.029869556427002), so a value may differ by a few ulps
# (relative 1e-6, or 1e-7 absolute). A GRPO loss recorded below 1e-6 is zero in exact arithmetic: the first step is
# on-policy and its advantages sum to zero, so it is what is left of terms of order 1 cancelling, a few of their ulps
# (1.2e-7 each) that the CPU decides: grpo_full's first moves by 6e-8 on an AMD EPYC and by 1.3e-7 on an Intel Xeon.
RECORDED = {
    "lora": [6.460493564605713, 6.2754292488098145, 6.02987003326416],
    "full": [6.437000274658203, 5.831274032592773, 5.2695112228393555],
    "distill": [3.2302467823028564, 3.138580083847046, 3.020907163619995],
    "distill_cache": [3.2302467823028564, 3.137737274169922, 3.0151278972625732],
    "grpo": [-9.934107758624577e-09, 0.00016230881738010794, 0.001048227190040052],
    "grpo_full": [-1.9868215517249155e-08, -0.12587368488311768, 0.0005630239029414952],
}

COMMON = dict(device="cpu", steps=3, log_every=1, save_every=3, eval_every=3, eval_batches=1, xla_checks="off", seed=0)
FT = dict(batch_size=4, seq_len=32, lr=3e-3, warmup_steps=1, max_records=200, **COMMON)
GR = dict(start_from=None, batch_size=2, num_generations=2, max_prompt_len=24, max_new_tokens=3, warmup_steps=1,
          max_records=32, rewards=REWARD, **COMMON)


def _job(name: str, out: str):
    if name == "lora":
        return Finetune(FinetuneConfig(method="lora", out_dir=out, **FT), progress=False)
    if name == "full":
        return Finetune(FinetuneConfig(method="full", grad_accum=2, out_dir=out, **FT), progress=False)
    if name == "distill":
        return Finetune(FinetuneConfig(method="distill", teacher="tiny", out_dir=out, **FT), progress=False)
    if name == "distill_cache":
        return Finetune(FinetuneConfig(method="distill", teacher="tiny", teacher_cache=out + "/cache", teacher_top_k=8,
                                       out_dir=out, **FT), progress=False)
    if name == "grpo":
        return GRPO(GRPOConfig(lr=1e-2, lora_r=4, out_dir=out, **GR), progress=False)
    return GRPO(GRPOConfig(method="full", lr=1e-3, num_iterations=2, out_dir=out, **GR), progress=False)


@pytest.mark.parametrize("name", list(RECORDED))
def test_the_same_jobs_train_to_the_bit_as_before_the_restructuring(tmp_path, name):
    job = _job(name, str(tmp_path / name))
    job.train()
    got = [r["loss"] for r in job.history.train]
    assert len(got) == len(RECORDED[name])
    want = torch.tensor(RECORDED[name], dtype=torch.float64)
    atol = torch.where(want.abs() < 1e-6, 5e-7, 1e-7)  # cancellations to zero: a few ulps of order-1 terms (above)
    err = (torch.tensor(got, dtype=torch.float64) - want).abs()
    assert (err <= 1e-6 * want.abs() + atol).all(), (got, RECORDED[name], err.tolist())


@pytest.mark.parametrize("config, field, owner", [
    (GRPOConfig, "teacher", "FinetuneConfig"), (GRPOConfig, "qat", "FinetuneConfig"),
    (GRPOConfig, "distill_alpha", "FinetuneConfig"), (GRPOConfig, "pack", "FinetuneConfig"),
    (FinetuneConfig, "num_generations", "GRPOConfig"), (FinetuneConfig, "kl_beta", "GRPOConfig"),
    (FinetuneConfig, "start_from", "GRPOConfig"), (FinetuneConfig, "top_p", "GRPOConfig"),
])
def test_each_recipe_config_refuses_the_other_recipes_fields_by_name(config, field, owner):
    message = rf"'{field}' is a setting of {owner}, not of {config.__name__}"
    with pytest.raises(ConfigError, match=message):
        config(**{field: None})
    with pytest.raises(ConfigError, match=message):
        config().replace(**{field: None})
    with pytest.raises(ConfigError, match=rf"unknown notebook parameter\(s\) \['{field.upper()}'\]; allowed: .*"
                                          rf"{field.upper()} is a setting of {owner}, not of {config.__name__}"):
        config_from_parameters({field.upper(): None}, base=config())


def test_sampling_and_distillation_names_mean_one_thing_each():
    # TEMPERATURE / TOP_K are the sampling's (GRPO); fine-tuning's distillation settings have their own names, and
    # an older notebook's TEMPERATURE / TOP_K still reach them, with a warning.
    assert {"temperature", "top_k"} <= set(GRPOConfig.__dataclass_fields__)
    assert not {"temperature", "top_k"} & set(FinetuneConfig.__dataclass_fields__)
    with pytest.warns(FutureWarning, match="TOP_K is now TEACHER_TOP_K"):
        cfg = config_from_parameters({"TOP_K": 16, "TEMPERATURE": 1.5}, base=FinetuneConfig())
    assert (cfg.teacher_top_k, cfg.distill_temperature) == (16, 1.5)
    with pytest.raises(ConfigError, match=r"'top_k' is now 'teacher_top_k'"):
        FinetuneConfig(top_k=16)
    with pytest.raises(ConfigError, match=r"TOP_K and TEACHER_TOP_K are both set"), warnings.catch_warnings():
        config_from_parameters({"TOP_K": 16, "TEACHER_TOP_K": 8}, base=FinetuneConfig())
    assert GRPOConfig(temperature=0.7, top_k=5).grpo.sampling.top_k == 5
