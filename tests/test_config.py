"""TrainConfig validation and notebook parameters (the names papermill injects)."""

from __future__ import annotations

import pytest

from tpu_helpers.config import ConfigError, TrainConfig, config_from_parameters


def test_defaults_are_full_size_and_valid():
    cfg = TrainConfig()
    assert cfg.preset == "small" and cfg.steps >= 1000 and cfg.device == "auto"


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"device": "gpu"}, r"device='gpu' is not one of"),
        ({"steps": 0}, r"steps=0 must be >= 1"),
        ({"batch_size": -2}, r"batch_size=-2 must be >= 1"),
        ({"steps": "10"}, r"steps='10' has type str; expected int"),
        ({"steps": True}, r"steps=True has type bool; expected int"),
        ({"lr": 0.0}, r"lr=0.0 must be > 0"),
        ({"val_fraction": 1.0}, r"val_fraction=1.0 must be between 0 and 1"),
        ({"grad_clip": -1.0}, r"grad_clip=-1.0 must be > 0, or None"),
        ({"precision": "fp8"}, r"precision='fp8' is not one of"),
        ({"dataset": ""}, r"dataset='' is empty"),
        ({"device": "cpu", "precision": "fp16"}, r"fp16.*needs a CUDA GPU"),
    ],
)
def test_bad_values_name_the_value_and_what_is_allowed(changes, message):
    with pytest.raises(ConfigError, match=message):
        TrainConfig(**changes)


def test_int_is_accepted_where_a_float_is_expected():
    assert TrainConfig(lr=1).lr == 1.0 and isinstance(TrainConfig(lr=1).lr, float)


def test_replace_refuses_unknown_fields():
    with pytest.raises(ConfigError, match=r"unknown TrainConfig field\(s\) \['stepz'\]"):
        TrainConfig().replace(stepz=3)


def test_notebook_parameters_map_to_fields_and_extras():
    ns = {"STEPS": 30, "DEVICE": "cpu", "MOUNT_DRIVE": False, "In": [], "th": object(), "_x": 1}
    cfg = config_from_parameters(ns, extra={"MOUNT_DRIVE": bool})
    assert cfg.steps == 30 and cfg.device == "cpu" and cfg.extra == {"mount_drive": False}


def test_unknown_notebook_parameter_is_refused_with_the_allowed_names():
    with pytest.raises(ConfigError, match=r"unknown notebook parameter\(s\) \['STEPZ'\]; allowed: .*STEPS"):
        config_from_parameters({"STEPZ": 3})


def test_a_misspelt_name_gets_the_nearest_one():
    with pytest.raises(ConfigError, match=r"\['STPES'\]; allowed: .*\. Did you mean STEPS \(not STPES\)\?$"):
        config_from_parameters({"STPES": 3})
    with pytest.raises(ConfigError, match=r"'stpes' is no setting \(did you mean 'steps'\?\)"):
        TrainConfig(stpes=3)
    with pytest.raises(ConfigError, match=r"\['QWERTY'\]; allowed: [^?]*$"):  # nothing close: no guess
        config_from_parameters({"QWERTY": 3})


def test_wrong_type_notebook_parameter_is_reported_in_the_notebooks_spelling():
    with pytest.raises(ConfigError, match=r"^BATCH_SIZE='8' has type str; expected int"):
        config_from_parameters({"BATCH_SIZE": "8"})
    with pytest.raises(ConfigError, match=r"MOUNT_DRIVE=1 has type int"):
        config_from_parameters({"MOUNT_DRIVE": 1}, extra={"MOUNT_DRIVE": bool})
