"""TorchTPU, torch_xla's successor (`pip install torch-tpu`, import name `torch_tpu`): found here, not run.

    from tpu_helpers.backend import torch_tpu
    found = torch_tpu.installed()      # None, or TorchTpu(version="0.2.0", vendor="google", ...)
    found.describe()                   # "TorchTPU 0.2.0 (Google's torch-tpu, github.com/google-pytorch/torch_tpu)"
    found.support()                    # what tpu_helpers does with it (today: nothing; TPUs run through torch_xla)

TPUs run through torch_xla (backend/xla.py); TorchTPU needs a newer torch, so nothing here runs on it yet. Device
selection and the doctor ask this module whether it is installed, so that a TPU host with TorchTPU but no torch_xla
is told so. Every TorchTPU name and message of the package is here. The answer comes from distribution metadata,
never an import (Google's may take the TPU; Sophgo's unrelated `torch_tpu` has the same import name):
docs/design/torchtpu.md, which also says what a TorchTPU backend would change.
"""

from __future__ import annotations

import importlib.machinery
import importlib.metadata
import importlib.util
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass

NAME = "TorchTPU"  # the doctor's name for its check
MODULE = "torch_tpu"  # the import name (Google's and Sophgo's alike)
DISTRIBUTION = "torch-tpu"  # Google's distribution on the package registry
GOOGLE_REPOSITORY = "github.com/google-pytorch/torch_tpu"  # in the home page / project URLs of Google's metadata
GOOGLE, SOPHGO, UNKNOWN = "google", "sophgo", "unknown"
_GOOGLE_URL = re.compile(r"github\.com/google-pytorch/torch[_-]tpu\b", re.IGNORECASE)
_SOPHGO = re.compile(r"sophgo|sophon", re.IGNORECASE)


@dataclass(frozen=True)
class TorchTpu:
    """A `torch_tpu` found on the path (never imported)."""

    vendor: str  # google | sophgo | unknown (importable, but the metadata names neither, or there is none)
    version: str | None  # the distribution's version; None when the module has no distribution metadata
    home_page: str | None = None  # the metadata's home page (or first project URL)
    torch_requirement: str | None = None  # e.g. "torch<=2.15.0,>=2.11.0", from the metadata's Requires-Dist

    @property
    def is_google(self) -> bool:
        return self.vendor == GOOGLE

    def describe(self) -> str:
        """What is installed, e.g. "TorchTPU 0.2.0 (Google's torch-tpu, github.com/google-pytorch/torch_tpu)"."""
        if self.vendor == GOOGLE:
            return f"TorchTPU {self.version} (Google's {DISTRIBUTION}, {GOOGLE_REPOSITORY})"
        home = f", {self.home_page}" if self.home_page else ""
        if self.vendor == SOPHGO:
            return (f"Sophgo's torch_tpu {self.version or '(version unknown)'} (PyTorch on Sophgo's chips{home}), "
                    "not Google's TorchTPU")
        if self.version is None:
            return f"a {MODULE} module without package metadata, not known to be Google's TorchTPU"
        return (f"{MODULE} {self.version}{' (' + self.home_page + ')' if self.home_page else ''}, not known to be "
                f"Google's TorchTPU (its metadata does not name {GOOGLE_REPOSITORY})")

    def support(self) -> str:
        """What tpu_helpers does with it today."""
        if self.vendor != GOOGLE:
            return "tpu_helpers does not use it (Google's TPUs run through torch_xla)"
        needs = f"; {DISTRIBUTION} needs {self.torch_requirement}" if self.torch_requirement else ""
        return f"tpu_helpers runs nothing on TorchTPU yet (it drives TPUs through torch_xla{needs})"

    def problem(self) -> str:
        """Why it does not give this package a TPU: what is installed and what tpu_helpers does with it."""
        if self.is_google:
            return f"{self.describe()} is installed, but {self.support()}"
        return f"the {MODULE} installed is {self.describe()}: {self.support()}"


def _vendor(meta: importlib.metadata.PackageMetadata) -> str:
    urls = [meta.get("Home-page") or "", meta.get("Download-URL") or "", *(meta.get_all("Project-URL") or [])]
    if any(_GOOGLE_URL.search(u) for u in urls):
        return GOOGLE
    said = " ".join([*urls, *(meta.get(k) or "" for k in ("Name", "Summary", "Author", "Author-email", "Maintainer",
                                                          "Maintainer-email"))])
    return SOPHGO if _SOPHGO.search(said) else UNKNOWN


def _home_page(meta: importlib.metadata.PackageMetadata) -> str | None:
    home = meta.get("Home-page")
    if home and home.strip().upper() != "UNKNOWN":
        return home.strip()
    urls = meta.get_all("Project-URL") or []
    return urls[0].split(",", 1)[-1].strip() if urls else None


def _torch_requirement(requires: list[str] | None) -> str | None:
    for line in requires or []:
        match = re.match(r"\s*torch\s*([<>=!~(][^;]*)?(;.*)?$", line)
        if match and "extra" not in (match.group(2) or ""):
            return "torch" + (match.group(1) or "").strip().strip("()").replace(" ", "")
    return None


def _module_found(path: Sequence[str] | None) -> bool:
    try:
        if path is None:
            return importlib.util.find_spec(MODULE) is not None  # a top-level name: finds, never imports
        return importlib.machinery.PathFinder.find_spec(MODULE, list(path)) is not None
    except (ImportError, ValueError):  # sys.modules[MODULE] is None, or a module without a spec
        return False


def installed(path: Sequence[str] | None = None) -> TorchTpu | None:
    """The `torch_tpu` on `path` (default: sys.path), or None: from its distribution metadata and the import
    system's finders, never importing it. The first distribution on the path that names it wins, as an import would
    pick the first module."""
    dist = next(iter(importlib.metadata.distributions(name=MODULE, path=list(sys.path if path is None else path))),
                None)
    if dist is None:
        return TorchTpu(UNKNOWN, None) if _module_found(path) else None
    meta = dist.metadata
    return TorchTpu(_vendor(meta), dist.version, _home_page(meta), _torch_requirement(dist.requires))
