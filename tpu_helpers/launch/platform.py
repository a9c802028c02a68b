"""What a notebook does before training on its platform: Colab detection, the torch/torch_xla pair, installing what
the runtime lacks, Google Drive, and the PJRT environment.

    from tpu_helpers.launch import platform
    print(platform.check_torch_xla())                 # the pair, and the fix when it is missing or mismatched
    platform.install_missing("requirements-colab.txt")  # pip-installs only what is absent; never torch/torch_xla
    out_dir, cache = platform.storage(config.out_dir, drive=True)   # Colab: checkpoints on Drive
    platform.setup_pjrt(config.device, compile_cache=cache)

Nothing here imports torch_xla (its version is read from the installed metadata), so these checks run before the
XLA runtime starts and work where torch_xla is absent or broken.
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement

# A lone reinstall of either breaks the pair (torch_xla then fails at import with an undefined _XLAC symbol).
PROTECTED = ("torch", "torch_xla", "torch-xla", "libtpu")
DRIVE_MOUNT = "/content/drive"


class PlatformError(RuntimeError):
    """The platform cannot do what was asked (e.g. a Drive mount outside Colab); the message says what to do."""


def in_colab() -> bool:
    """True inside a Google Colab runtime."""
    return "google.colab" in sys.modules or "COLAB_RELEASE_TAG" in os.environ


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


@dataclass(frozen=True)
class TorchXlaPair:
    torch: str | None
    torch_xla: str | None

    @property
    def ok(self) -> bool:
        return bool(self.torch and self.torch_xla and _base(self.torch) == _base(self.torch_xla))

    @property
    def fix(self) -> str | None:
        if self.ok:
            return None
        v = _base(self.torch) if self.torch else "2.9.0"
        what = ("torch_xla is not installed" if self.torch and not self.torch_xla else
                "torch is not installed" if not self.torch else
                f"torch {self.torch} and torch_xla {self.torch_xla} differ (they must be the same version)")
        restart = " then restart the runtime (Runtime > Restart session)" if in_colab() else ""
        return (f"{what}. Install the pair together: pip install 'torch=={v}' 'torch_xla[tpu]=={v}'{restart}. "
                "Without a TPU the notebook can still run on a GPU or the CPU (DEVICE='auto').")

    def __str__(self) -> str:
        pair = f"torch {self.torch or 'missing'}, torch_xla {self.torch_xla or 'missing'}"
        return f"{pair}: ok" if self.ok else f"{pair}: {self.fix}"


def _base(version: str) -> str:
    return version.split("+")[0]


def check_torch_xla() -> TorchXlaPair:
    """The installed torch/torch_xla versions; `.ok` when they match, `.fix` says what to run otherwise."""
    return TorchXlaPair(_version("torch"), _version("torch_xla"))


def read_requirements(path: str | Path) -> list[Requirement]:
    """Requirements of a pip requirements file (comments, blank lines and pip options skipped)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"requirements file {str(path)!r} does not exist")
    reqs = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line or line.startswith("-"):
            continue
        try:
            reqs.append(Requirement(line))
        except InvalidRequirement as err:
            raise ValueError(f"{path}:{number}: cannot parse requirement {line!r}: {err}") from None
    return reqs


def missing_requirements(path: str | Path) -> list[str]:
    """Requirements of `path` that are absent or at a version outside their specifier (torch/torch_xla excluded:
    the runtime's own pair is kept; `check_torch_xla` reports on it)."""
    missing = []
    for req in read_requirements(path):
        if req.name.lower().replace("-", "_") in {p.replace("-", "_") for p in PROTECTED}:
            continue
        installed = _version(req.name)
        if installed is None or (req.specifier and not req.specifier.contains(installed, prereleases=True)):
            missing.append(str(req))
    return missing


def install_missing(path: str | Path | None = None, *, dry_run: bool = False) -> list[str]:
    """pip-install what `path` lists and this runtime lacks; a no-op when everything is there (as in CI).

    `path` defaults to requirements-colab.txt of the checkout this package was imported from.
    Returns the requirements installed (or, with dry_run, that would be). Never touches torch or torch_xla.
    """
    if path is None:
        path = Path(__file__).resolve().parents[2] / "requirements-colab.txt"
    missing = missing_requirements(path)
    if missing and not dry_run:
        proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", *missing], capture_output=True,
                              text=True)
        if proc.returncode != 0:
            raise PlatformError(f"pip install {' '.join(missing)} failed ({proc.returncode}): "
                                f"{proc.stderr.strip()[-1500:]}")
    return missing


def mount_drive(mount_point: str = DRIVE_MOUNT) -> Path:
    """Mount Google Drive (Colab only) and return the mount point; a clear error anywhere else."""
    if not in_colab():
        raise PlatformError(
            "MOUNT_DRIVE=True needs Google Colab (google.colab is not available here); set MOUNT_DRIVE=False and "
            "keep OUT_DIR on a local disk"
        )
    from google.colab import drive  # only exists on Colab

    drive.mount(mount_point)
    return Path(mount_point)


def storage(out_dir: str, *, drive: bool = False, drive_dir: str = "MyDrive/tpu_helpers",
            compile_cache: str = "") -> tuple[str, str | None]:
    """Where checkpoints and the XLA compile cache go: local paths, or under Drive when `drive`.

    On Drive a Colab session that ends (or is preempted) keeps its checkpoints, and rerunning the notebook in a
    new session resumes from them; the compile cache there saves the first steps' compilation next time.
    Returns (out_dir, compile_cache or None).
    """
    cache = compile_cache or None
    if drive:
        root = mount_drive() / drive_dir
        out_dir = str(root / Path(out_dir).name)
        cache = str(root / "xla_cache") if not compile_cache else compile_cache
    return out_dir, cache


def setup_pjrt(device: str = "auto", *, compile_cache: str | None = None) -> dict[str, str]:
    """Set the PJRT environment for an XLA device before its runtime starts; returns the variables that matter.

    A TPU host gets PJRT_DEVICE=TPU (Colab's TPU runtimes and TPU VMs both need it); elsewhere an explicit
    device="xla" runs the same code on XLA:CPU. A value the user exported is kept. With `compile_cache`, XLA's
    persistent compilation cache is turned on there (it must precede the first XLA computation).
    """
    from tpu_helpers.backend import runtime_env, tpu_chip_count, xla_module

    if runtime_env.choose_pjrt_device(device, tpu_attached=bool(tpu_chip_count())) and compile_cache:
        xla_module().initialize_compile_cache(compile_cache)
    return runtime_env.runtime_vars()
