"""The package's optional parts and the pip extra that brings each, so a missing one is a clear error, not a bare
ImportError deep inside a call.

    from tpu_helpers.core.extras import require_extra
    require_extra("hf", "fine-tuning (tpu_helpers.recipes.finetune)")   # raises MissingExtra naming the extra

`pip install tpu_helpers` brings the core (torch, numpy, tqdm, matplotlib, packaging): the GPT recipes, the doctor, the
memory estimates. The extras (pyproject.toml's optional-dependencies; a test keeps these names equal to them):

- `hf`: transformers, peft, tokenizers, safetensors: fine-tuning Hugging Face models (`recipes.finetune`,
  `models.lora`, `models.hf_tiny`, `models.hf.load_causal_lm`);
- `notebooks`: papermill, ipywidgets, nbformat, ipykernel, datasets: headless notebook runs, the tuning panel's
  widgets, hub datasets;
- `gguf`: llama.cpp's gguf library: the GGUF export (EXPORT_GGUF, `models.gguf_export`);
- `eval`: lm-evaluation-harness: standard evaluation (EVAL_TASKS, `recipes.harness`).

Light on purpose (no third-party import): modules call it at import time, before they need what it checks.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence

EXTRAS: dict[str, tuple[str, ...]] = {
    "hf": ("transformers", "peft", "tokenizers", "safetensors"),
    "notebooks": ("papermill", "ipywidgets", "nbformat", "ipykernel", "datasets"),
    "gguf": ("gguf",),
    "eval": ("lm_eval",),
}


class MissingExtra(ImportError):
    """A part of the package was used without the extra that brings its dependencies; the message names the extra
    and the install line."""


def missing(extra: str, names: Sequence[str] | None = None) -> list[str]:
    """The distributions of `extra` (or just `names` of it) that cannot be imported here."""
    if extra not in EXTRAS:
        raise ValueError(f"extra={extra!r} is not one of {sorted(EXTRAS)}")
    return [n for n in (names or EXTRAS[extra]) if importlib.util.find_spec(n) is None]


def install_line(extra: str) -> str:
    return f"pip install \"tpu_helpers[{extra}]\" (in a clone: pip install -e \".[{extra}]\")"


def require_extra(extra: str, feature: str, names: Sequence[str] | None = None) -> None:
    """Raise MissingExtra when any distribution `feature` needs from `extra` is absent."""
    absent = missing(extra, names)
    if absent:
        raise MissingExtra(
            f"{feature} needs the '{extra}' extra ({', '.join(EXTRAS[extra])}); not installed here: "
            f"{', '.join(absent)}. Install it with: {install_line(extra)}; in a notebook its setup cell "
            "(platform.setup_notebook) installs what is missing.")
