"""Lazy package exports: a package's public names, each imported from its module on first use, so that importing
the package (or a light module of it) does not import torch, the trainer or the recipes.

    _EXPORTS = {"Trainer": "tpu_helpers.training.trainer", ...}
    __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, exports: Mapping[str, str],
                 namespace: dict[str, Any]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module-level `__getattr__` and `__dir__` of `package`: a name of `exports` ({name: module}) is imported
    from its module when first asked for, then kept in `namespace` (the package's globals) so later lookups skip
    `__getattr__`; any other name is an AttributeError naming the package."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted([*namespace, *exports])

    return __getattr__, __dir__
