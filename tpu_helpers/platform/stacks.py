"""The software stacks the package is tested on, for the doctor and the notebooks' setup cell.

    from tpu_helpers.platform import stacks
    stacks.TESTED_PAIRS                          # ("2.8.0", "2.9.0"): the torch/torch_xla versions CI runs
    profile = stacks.profile_for("colab")        # what Colab's TPU runtime ships (the `colab` profile)
    profile.differences(version)                 # ["transformers 5.16.0 (tested: 5.15.0)", ...]

CI tests four stacks: the dev venv of `make test` (Python 3.11, requirements-dev.lock) and, in `make test-stacks`,
the `colab` and `kaggle` TPU profiles (stacks/colab.txt, stacks/kaggle.txt: a test keeps the pins here equal to
those) and the `latest` one (stacks/latest.txt): the newest torch without torch_xla, the GPU/CPU paths that Colab's
and Kaggle's CPU and GPU runtimes run. Each profile names the platform it stands for, so the doctor can say which
stack a machine runs and how it differs from the tested one. Installed versions come from package metadata
(torch_xla is never imported); the recommended pair is the backend's `NEWEST_TORCH_XLA`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from tpu_helpers.backend import NEWEST_TORCH_XLA


@dataclass(frozen=True)
class StackProfile:
    name: str
    platform: str  # what it stands for, in words
    python: str  # major.minor
    torch: str  # torch and torch_xla, the same version
    packages: dict[str, str] = field(default_factory=dict)  # pinned versions (a prefix: "4.8" matches 4.8.5)
    xla: bool = True  # False: torch alone, no torch_xla (the GPU/CPU paths)

    def differences(self, version: Callable[[str], str | None], python: tuple[int, ...] | None = None) -> list[str]:
        """How the installed stack (`version(dist)`, `python`) differs from this profile; [] when it is the same."""
        out = []
        if python is not None and ".".join(map(str, python[:2])) != self.python:
            out.append(f"Python {'.'.join(map(str, python[:3]))} (tested: {self.python})")
        for dist, want in {"torch": self.torch, **({"torch_xla": self.torch} if self.xla else {}),
                           **self.packages}.items():
            have = version(dist)
            if have is None or not _matches(have, want):
                out.append(f"{dist} {have or 'missing'} (tested: {want})")
        if not self.xla and version("torch_xla"):
            out.append(f"torch_xla {version('torch_xla')} (tested: none)")
        return out

    def describe(self) -> str:
        pinned = ", ".join(f"{k} {v}" for k, v in self.packages.items())
        torch = f"torch/torch_xla {self.torch}" if self.xla else f"torch {self.torch} without torch_xla"
        return f"{self.platform}: Python {self.python}, {torch}" + (f", {pinned}" if pinned else "")


def _matches(have: str, want: str) -> bool:
    base = have.split("+")[0]
    return base == want or base.startswith(want + ".")


PROFILES: dict[str, StackProfile] = {
    "colab": StackProfile("colab", "Colab TPU runtime (its pip freeze, August 2026)", "3.13", "2.9.0",
                          {"libtpu": "0.0.21.1", "transformers": "5.15.0", "accelerate": "1.14.0", "datasets": "4.8",
                           "ipywidgets": "7.7.1"}),
    "kaggle": StackProfile("kaggle", "Kaggle TPU v5e-8 image (its TPU build files, March 2026)", "3.12", "2.8.0"),
    "dev": StackProfile("dev", "make test (requirements-dev.lock)", "3.11", "2.9.0"),
    # Colab's and Kaggle's CPU/GPU runtimes ship a newer torch than any TPU stack (Colab: 2.11 in 2026) and no
    # torch_xla; CI runs the GPU/CPU paths on the newest torch the registry serves (its CPU tests, notebooks included).
    "latest": StackProfile("latest", "the newest torch without torch_xla (Colab's CPU/GPU runtimes)", "3.12",
                           "2.15.0", xla=False),
}
# torch/torch_xla versions CI runs the package on; RECOMMENDED is what a fix installs: the newest torch_xla release,
# as the backend layer knows it (backend.pair_version decides which pair a given torch gets).
TESTED_PAIRS = tuple(sorted({p.torch for p in PROFILES.values() if p.xla}))
RECOMMENDED = NEWEST_TORCH_XLA
# The platforms' names as the doctor prints them (platform.platform_name(), plus "tpuvm" for a local TPU host).
PLATFORM_NAMES = {"colab": "Colab", "kaggle": "Kaggle", "tpuvm": "TPU VM", "local": "this machine (no TPU)"}


def profile_for(where: str, tpu: bool = True) -> StackProfile | None:
    """The tested profile for a platform ("colab", "kaggle"), or None (a TPU VM or workstation installs its own).
    tpu=False: a CPU/GPU runtime there (no TPU chips, no torch_xla): the `latest` profile."""
    if where not in ("colab", "kaggle"):
        return None
    return PROFILES[where] if tpu else PROFILES["latest"]
# The install line that puts the recommended pair in place (then restart the runtime or kernel).
PAIR_FIX = f"pip install 'torch=={RECOMMENDED}' 'torch_xla[tpu]=={RECOMMENDED}'"
