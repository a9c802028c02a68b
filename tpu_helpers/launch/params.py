"""Notebook parameters -> TrainConfig.

Notebooks keep their parameters as UPPER_CASE globals in the cell tagged `parameters` (papermill overrides them);
`config_from_parameters(globals())` maps each UPPER_CASE name to the field of the same lower-case name and rejects
names it does not know and values of the wrong type.

    config = th.config_from_parameters(globals(), extra={"MOUNT_DRIVE": bool})
"""

from __future__ import annotations

import re
import types
from dataclasses import fields
from typing import Any

from tpu_helpers.config import ConfigError, TrainConfig

_UPPER = re.compile(r"^[A-Z][A-Z0-9_]*$")
# The setup cell's parameters, which every notebook that opens on Colab or Kaggle has (platform.setup_notebook):
# known to every notebook without being declared, stored in config.extra like any notebook-only parameter.
SETUP_PARAMETERS: dict[str, type] = {"INSTALL": bool, "REPO_URL": str}


def notebook_parameters(namespace: dict) -> dict[str, Any]:
    """The UPPER_CASE names of a notebook's namespace (its parameters cell and papermill's injected cell)."""
    return {k: v for k, v in namespace.items() if _UPPER.match(k) and not isinstance(v, types.ModuleType)}


def config_from_parameters(
    namespace: dict, *, base: TrainConfig | None = None, extra: dict[str, type | tuple] | None = None
) -> TrainConfig:
    """Build a TrainConfig from a notebook's UPPER_CASE parameters.

    `extra` declares notebook-only parameters (e.g. {"MOUNT_DRIVE": bool}); they are type-checked and stored in
    `config.extra` under their lower-case names. Any other UPPER_CASE name is an error listing the known ones,
    which catches a misspelt `-p` override that papermill would otherwise inject and ignore.
    """
    if not isinstance(namespace, dict):
        raise TypeError(f"namespace must be a dict such as globals(), got {type(namespace).__name__}")
    if base is not None and not isinstance(base, TrainConfig):
        raise TypeError(f"base must be a TrainConfig or None, got {type(base).__name__}")
    base = base or TrainConfig()
    extra = {**SETUP_PARAMETERS, **(extra or {})}
    for name, expected in extra.items():
        kinds = expected if isinstance(expected, tuple) else (expected,)
        if not _UPPER.match(name) or not all(isinstance(k, type) for k in kinds):
            raise ConfigError(f"extra={{{name!r}: {expected!r}}}: keys must be UPPER_CASE parameter names and "
                              "values a type or a tuple of types, e.g. {'MOUNT_DRIVE': bool}")
    known = {f.name.upper() for f in fields(TrainConfig) if f.name != "extra"}
    params = notebook_parameters(namespace)
    unknown = sorted(set(params) - known - set(extra))
    if unknown:
        allowed = ", ".join(sorted(known | set(extra)))
        raise ConfigError(f"unknown notebook parameter(s) {unknown}; allowed: {allowed}")
    changes: dict[str, Any] = {}
    extras = dict(base.extra)
    for name, value in params.items():
        if name in extra:
            expected = extra[name]
            if not isinstance(value, expected) or (expected in (int, float) and isinstance(value, bool)):
                raise ConfigError(f"{name}={value!r} has type {type(value).__name__}; expected {expected}")
            extras[name.lower()] = value
        else:
            changes[name.lower()] = value
    try:
        return base.replace(extra=extras, **changes)
    except ConfigError as err:
        # Re-word field names as the notebook spells them, so the message matches what the user typed.
        message = re.sub(r"\b([a-z][a-z0-9_]*)=", lambda m: f"{m.group(1).upper()}=" if m.group(1).upper()
                         in known else m.group(0), str(err))
        raise ConfigError(message) from None
