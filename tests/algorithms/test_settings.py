"""Each algorithm's settings are declared once, on its settings dataclass: the recipe's config takes those fields as
its own (the notebook parameters), builds the settings from them once, and the choices are parsed there into what
the step calls; a bad choice is a ConfigError naming the value and the allowed ones."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from tpu_helpers.algorithms import grpo_loss, preference_loss
from tpu_helpers.algorithms.distill import DistillSettings
from tpu_helpers.algorithms.grpo import GRPOSettings
from tpu_helpers.algorithms.preference_loss import PreferenceSettings
from tpu_helpers.config import ConfigError, config_from_parameters, settings_field_name, settings_fields
from tpu_helpers.recipes.finetune import FinetuneConfig
from tpu_helpers.recipes.grpo import GRPOConfig
from tpu_helpers.recipes.preference import PreferenceConfig

CASES = [(GRPOConfig, GRPOSettings, "grpo", ""), (PreferenceConfig, PreferenceSettings, "preference", ""),
         (FinetuneConfig, DistillSettings, "distill", "distill_")]


@pytest.mark.parametrize("config, settings, attr, prefix", CASES)
def test_the_config_takes_the_settings_fields_with_their_types_and_defaults(config, settings, attr, prefix):
    theirs = {f.name: f for f in dataclasses.fields(settings) if f.init}
    ours = {f.name: f for f in dataclasses.fields(config)}
    hints, config_hints = typing.get_type_hints(settings), typing.get_type_hints(config)
    for name, f in theirs.items():
        mine = settings_field_name(prefix, name)  # the field lambda_ of DistillSettings: distill_lambda here
        assert mine in ours, name
        assert ours[mine].default == f.default and config_hints[mine] == hints[name], name
    built = getattr(config(), attr)
    assert isinstance(built, settings) and built == settings()


def test_a_settings_field_declared_again_in_a_config_is_refused():
    with pytest.raises(TypeError, match=r"Mine.kl_beta is a field of GRPOSettings: declare it there only"):
        @settings_fields(GRPOSettings)
        class Mine:
            kl_beta: float = 0.1


def test_choices_are_parsed_once_into_what_the_step_calls():
    s = GRPOConfig(loss_type="dapo", importance="sequence", scale_rewards="none").grpo
    assert s.loss is grpo_loss.LOSS_TYPES["dapo"] and s.log_ratio is grpo_loss.IMPORTANCE_LEVELS["sequence"]
    assert s.scale is grpo_loss.SCALE_REWARDS["none"]
    p = PreferenceConfig(algorithm="orpo", loss_type="ipo").preference
    assert p.pair_losses is preference_loss.DPO_LOSSES["ipo"] and not p.uses_reference
    # Replacing a choice parses it again; the settings compare by their declared fields only.
    assert dataclasses.replace(s, loss_type="grpo").loss is grpo_loss.LOSS_TYPES["grpo"]
    assert GRPOSettings(loss_type="dapo") != GRPOSettings(loss_type="grpo")


def test_the_notebook_names_reach_the_settings_and_bad_ones_are_named():
    cfg = config_from_parameters({"LOSS_TYPE": "dr_grpo", "KL_BETA": 0.0, "NUM_GENERATIONS": 4}, base=GRPOConfig())
    assert (cfg.grpo.loss_type, cfg.grpo.kl_beta, cfg.grpo.num_generations) == ("dr_grpo", 0.0, 4)
    with pytest.raises(ConfigError, match=r"unknown notebook parameter\(s\) \['LOSS_TYP'\]; allowed: .*LOSS_TYPE"):
        config_from_parameters({"LOSS_TYP": "grpo"}, base=GRPOConfig())
    with pytest.raises(ConfigError, match=r"QUANTIZE_BASE='fp4' is not one of \('nf4', 'int4'\)"):
        config_from_parameters({"QUANTIZE_BASE": "fp4"}, base=GRPOConfig())
    assert GRPOConfig(quantize_base="int4").base_format.name == "int4"
