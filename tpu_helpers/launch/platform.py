"""What a notebook does before training on its platform: Colab/Kaggle detection, the torch/torch_xla pair,
installing what the runtime lacks, Google Drive, Kaggle's paths, and the PJRT environment.

    from tpu_helpers.launch import platform
    print(platform.check_torch_xla())                 # the pair, and the fix when it is missing or mismatched
    platform.install_missing()                        # pip-installs only what is absent; never torch/torch_xla
    out_dir, cache = platform.storage(config.out_dir, drive=True)   # Colab: checkpoints on Drive
    platform.setup_pjrt(config.device, compile_cache=cache)

Kaggle (a TPU v5e-8 notebook, `platform.in_kaggle()`): this module is the one place that knows what differs there.
`storage` puts a relative out_dir and the compile cache under /kaggle/working (the only directory kept as the
notebook's output; /kaggle/input, where datasets are attached, is read-only), and `setup_pjrt` sets the
accelerator variable the runtime needs (PJRT_DEVICE) from the chips it finds, as on any TPU host.

Nothing here imports torch_xla (its version is read from the installed metadata), so these checks run before the
XLA runtime starts and work where torch_xla is absent or broken.
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement

# A lone reinstall of either breaks the pair (torch_xla then fails at import with an undefined _XLAC symbol).
PROTECTED = ("torch", "torch_xla", "torch-xla", "libtpu")
DRIVE_MOUNT = "/content/drive"
KAGGLE_WORKING = "/kaggle/working"


class PlatformError(RuntimeError):
    """The platform cannot do what was asked (e.g. a Drive mount outside Colab); the message says what to do."""


def in_colab() -> bool:
    """True inside a Google Colab runtime."""
    return "google.colab" in sys.modules or "COLAB_RELEASE_TAG" in os.environ


def in_kaggle(env: dict | None = None, working: str = KAGGLE_WORKING) -> bool:
    """True inside a Kaggle notebook (Kaggle sets KAGGLE_KERNEL_RUN_TYPE; /kaggle/working is its output folder)."""
    env = os.environ if env is None else env
    return "KAGGLE_KERNEL_RUN_TYPE" in env or os.path.isdir(working)


def platform_name() -> str:
    """"colab", "kaggle" or "local" (a TPU VM, a workstation, CI)."""
    return "colab" if in_colab() else "kaggle" if in_kaggle() else "local"


def auto_target() -> str:
    """The platform target (`tpu_helpers.targets`) for this machine, found without starting an XLA runtime."""
    from tpu_helpers.backend import tpu_chip_count

    chips = tpu_chip_count()
    if chips:
        if chips >= 8:
            return "kaggle-v5e-8" if in_kaggle() else "tpuvm-v5e-8"
        return "colab-v6e-1"
    import torch

    return "gpu" if torch.cuda.is_available() else "cpu"


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


def colab_requirements() -> Path:
    """The requirements a Colab or Kaggle runtime may lack, shipped inside the package (so a wheel install has it)."""
    return Path(str(resources.files("tpu_helpers.launch").joinpath("requirements-colab.txt")))


def pip_install(requirements: Sequence[str]) -> None:
    """`python -m pip install -q REQ...` in this interpreter; PlatformError with pip's message when it fails."""
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", *requirements], capture_output=True,
                          text=True)
    if proc.returncode != 0:
        raise PlatformError(f"pip install {' '.join(requirements)} failed ({proc.returncode}): "
                            f"{proc.stderr.strip()[-1500:]}")


def install_missing(path: str | Path | None = None, *, dry_run: bool = False,
                    installer: Callable[[Sequence[str]], None] = pip_install) -> list[str]:
    """Install what `path` lists and this runtime lacks; a no-op when everything is there (as in CI).

    `path` defaults to the package's own requirements-colab.txt (`colab_requirements()`). `installer` receives
    the missing requirements (tests pass a recorder, so they never run pip). Returns the requirements installed
    (or, with dry_run, that would be). Never touches torch or torch_xla.
    """
    missing = missing_requirements(colab_requirements() if path is None else path)
    if missing and not dry_run:
        installer(missing)
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
            compile_cache: str = "", kaggle: bool | None = None,
            kaggle_working: str = KAGGLE_WORKING) -> tuple[str, str | None]:
    """Where checkpoints and the XLA compile cache go: local paths, under Drive when `drive`, under /kaggle/working
    on Kaggle (`kaggle` None: detected).

    On Drive a Colab session that ends (or is preempted) keeps its checkpoints, and rerunning the notebook in a
    new session resumes from them; the compile cache there saves the first steps' compilation next time. On Kaggle
    only /kaggle/working is saved with the notebook's output, so a relative out_dir goes there (an absolute one is
    kept). Returns (out_dir, compile_cache or None).
    """
    cache = compile_cache or None
    if drive:
        root = mount_drive() / drive_dir
        out_dir = str(root / Path(out_dir).name)
        cache = str(root / "xla_cache") if not compile_cache else compile_cache
    elif in_kaggle() if kaggle is None else kaggle:
        if not os.path.isabs(out_dir):
            out_dir = str(Path(kaggle_working) / out_dir)
        if cache and not os.path.isabs(cache):
            cache = str(Path(kaggle_working) / cache)
    return out_dir, cache


def setup_pjrt(device: str = "auto", *, compile_cache: str | None = None) -> dict[str, str]:
    """Set the PJRT environment for an XLA device before its runtime starts; returns the variables that matter.

    A TPU host (chips found by PCI device id) gets PJRT_DEVICE=TPU: Colab's TPU runtimes, Kaggle's v5e-8 and TPU
    VMs all need it; elsewhere an explicit device="xla" runs the same code on XLA:CPU. A value the user exported is kept. With `compile_cache`, XLA's
    persistent compilation cache is turned on there (it must precede the first XLA computation); a later
    `get_backend(...)` with its default compile_cache_dir uses the same directory.
    """
    from tpu_helpers.backend import (
        active_compile_cache,
        resolve_compile_cache,
        runtime_env,
        tpu_host,
        xla_module,
    )

    device_kind = runtime_env.choose_pjrt_device(device, tpu_attached=bool(tpu_host.tpu_chips()))
    if compile_cache and device_kind:
        xla_module().initialize_compile_cache(resolve_compile_cache(compile_cache, device_kind, active_compile_cache()))
    return runtime_env.runtime_vars()
