"""Pick the device and return the backend object a training loop talks to.

    from tpu_helpers.backend import get_backend
    backend = get_backend("auto")       # TPU, then CUDA, then CPU
    print(backend.status())             # e.g. "TPU v6e x1, 31.3 GiB HBM/chip, bf16"
    backend = backend_for(config)       # what a TrainConfig asks for (device, fallback, precision, spmd, cache)

Device names: "auto" (a TPU, else a CUDA GPU, else the CPU, with a warning where TPU chips are attached without
torch_xla), "tpu" (through torch_xla, or an error saying what is missing; fallback=True warns and takes the next
best), "cuda", "cpu", and "xla" (whatever PJRT device is configured: PJRT_DEVICE=CPU runs the TPU path on the CPU).
Only `tpu_helpers.backend.xla` imports torch_xla, and only when an XLA device is asked for, so the package imports
fine without it. Each name in full: docs/guides/devices.md.
"""

from __future__ import annotations

import copy
import importlib
import importlib.metadata
import os
import sys
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from packaging.version import Version

from tpu_helpers.backend import runtime_env, torch_tpu, tpu_host
from tpu_helpers.backend.base import Backend, BackendUnavailable, GenerationHooks, warn_fallback
from tpu_helpers.core.choices import DEVICES

__all__ = ["DEFAULT_COMPILE_CACHE", "DEVICES", "NEWEST_TORCH_XLA", "NEWEST_TORCH_XLA_LIBTPU", "Backend",
           "BackendUnavailable", "GenerationHooks", "active_compile_cache", "backend_for", "generation_hooks",
           "get_backend", "pair_version", "resolve_compile_cache", "started_xla_backend", "tpu_chip_count",
           "xla_module"]

_XLA_BACKEND = None  # the XLA runtime is per process: build its backend once and hand the same one out

# ---- persistent compile cache ----------------------------------------------------------------------------------------
DEFAULT_COMPILE_CACHE = "~/.cache/tpu_helpers/xla_cache"  # $TPU_HELPERS_XLA_CACHE moves it (e.g. to Drive)


def resolve_compile_cache(setting: str | None, pjrt_device: str, active: str | None = None,
                          env: Mapping[str, str] | None = None) -> str | None:
    """The directory the persistent XLA compile cache of this run uses, or None for no cache: the one place that
    decides it (`platform.setup_pjrt` and `get_backend` both ask here).

    `active` is the cache this process already turned on (XLA reads the setting once per process): "default" then
    means that one, so a notebook that passed its cache to `setup_pjrt` and then calls `get_backend(...)` with the
    default gets the same directory, not a second one. Otherwise "default" is on for TPUs only: torch_xla 2.9 cannot
    deserialise executables on XLA:CPU ("Deserializing serialized executable not supported"), so a cache there
    costs a write and never saves a compile. A path turns it on on any XLA device (tests do so to check the
    mechanism).
    """
    if setting is None:
        return None
    if setting == "default":
        if active is not None:
            return active
        if pjrt_device == "CPU":
            return None
        setting = (os.environ if env is None else env).get("TPU_HELPERS_XLA_CACHE") or DEFAULT_COMPILE_CACHE
    return os.path.abspath(os.path.expanduser(setting))


def active_compile_cache() -> str | None:
    """The compile cache directory this process turned on (as asked for, before any per-process subdirectory), or
    None; never imports torch_xla (no XLA module loaded means no cache yet)."""
    module = sys.modules.get("tpu_helpers.backend.xla")
    return module.active_compile_cache() if module is not None else None


def started_xla_backend() -> Backend | None:
    """The XLA backend this process already runs, or None; never starts one (the doctor reads HBM through it)."""
    return _XLA_BACKEND


def generation_hooks(device: torch.device | str, weights: Iterable[torch.Tensor] = ()) -> GenerationHooks | None:
    """The sync, step replay and decode loop of the backend that owns `device` (where a model's tensors are), for
    `models.generation.generate_ids`; None on the CPU and any device no backend here runs, where generation's
    Python loop is the compute itself. `weights`: the model's parameters (read only under an XLA SPMD mesh, to tell
    whether they are split over the chips).

    Nothing is started, made or changed: no backend object is built (that would set a precision, a mesh, the
    current CUDA device or a process group), and an XLA device means its runtime already runs."""
    device = torch.device(device)
    if device.type == "xla":  # once imported, not checked again: every generation call asks
        return (sys.modules.get("tpu_helpers.backend.xla") or xla_module()).generation_hooks(device, weights)
    if device.type == "cuda":
        from tpu_helpers.backend.cuda import generation_hooks as cuda_hooks

        return cuda_hooks(device)
    return None


def tpu_chip_count() -> int:
    """TPU chips attached over PCI (read from sysfs by TPU device id, so no XLA runtime is started)."""
    return tpu_host.tpu_chip_count()


# The newest torch_xla release. torch_xla is released for the torch of its own version only, so a newer torch (what
# TorchTPU needs, or Colab's GPU runtime ships) has no torch_xla to pair with.
NEWEST_TORCH_XLA = "2.9.0"
NEWEST_TORCH_XLA_LIBTPU = "0.0.21"  # the libtpu its `tpu` extra requires (TorchTPU brings a newer one of its own)


def pair_version(torch_version: str | None) -> str:
    """The torch/torch_xla version to install for a TPU, given the torch installed: the same one, or the newest
    torch_xla's where torch is newer than every torch_xla release (or absent)."""
    base = (torch_version or "").split("+")[0]
    if not base or Version(base).release > Version(NEWEST_TORCH_XLA).release:
        return NEWEST_TORCH_XLA
    return base


def _install_hint() -> str:
    v = torch.__version__.split("+")[0]
    pair = pair_version(v)
    if pair != v:
        return (
            f"no torch_xla release matches torch {v}: install the torch {pair} + torch_xla {pair} pair in an "
            f"environment of its own (a new virtualenv or runtime): pip install 'torch=={pair}' "
            f"'torch_xla[tpu]=={pair}' (see requirements-tpuvm.txt / requirements-colab.txt)"
        )
    return (
        f"install the torch_xla that matches torch {v}: pip install 'torch=={v}' 'torch_xla[tpu]=={v}' "
        "(see requirements-tpuvm.txt / requirements-colab.txt)"
    )


def torch_xla_version() -> str | None:
    """The installed torch_xla's version from its metadata, or None: the package's one question "is torch_xla
    installed?" (nothing imported)."""
    try:
        return importlib.metadata.version("torch_xla")
    except importlib.metadata.PackageNotFoundError:
        return None


def xla_module():
    """Import the XLA backend module, turning the usual install problems into an actionable message."""
    xla_version = torch_xla_version()
    if xla_version is None:
        found = torch_tpu.installed()  # a torch_tpu instead (TorchTPU, or Sophgo's): say so, it is why no TPU runs
        also = f"; {found.problem()}" if found is not None else ""
        raise BackendUnavailable(f"torch_xla is not installed{also}; {_install_hint()}")
    torch_version = torch.__version__.split("+")[0]
    try:
        return importlib.import_module("tpu_helpers.backend.xla")
    except ImportError as err:
        if "undefined symbol" in str(err) or xla_version.split("+")[0] != torch_version:
            raise BackendUnavailable(
                f"torch_xla {xla_version} does not match torch {torch_version} (they must be the same version; "
                f"the import failed with: {str(err)[:160]}); {_install_hint()}"
            ) from err
        raise BackendUnavailable(f"torch_xla {xla_version} failed to import: {err}") from err


def _spmd_default(local_devices: int) -> bool:
    # Inside an xmp.spawn child each process owns one device: SPMD is for a single process that drives them all.
    return local_devices > 1 and not runtime_env.spawned_process()


def _with_precision(backend: Backend, precision: str) -> Backend:
    # The XLA backend is shared by every trainer of the process: a different precision gets its own view (a shallow
    # copy sharing the device, mesh and runtime) instead of changing the precision under the trainers that hold it.
    resolved = backend._resolve_precision(precision)
    if resolved == backend.precision:
        return backend
    view = copy.copy(backend)
    view.precision = resolved
    return view


def _xla_backend(precision: str, spmd: bool | str, pjrt_device: str, compile_cache_dir: str | None) -> Backend:
    global _XLA_BACKEND
    os.environ.setdefault("PJRT_DEVICE", pjrt_device)
    runtime_env.cap_xla_cpu_cache()  # before torch_xla starts: it reads the size once
    module = xla_module()
    active = active_compile_cache()
    cache = resolve_compile_cache(compile_cache_dir, os.environ["PJRT_DEVICE"], active)
    if spmd == "auto":
        n = tpu_chip_count() if os.environ["PJRT_DEVICE"] == "TPU" else int(os.environ.get("CPU_NUM_DEVICES", "1"))
        spmd = _spmd_default(n)
    started = _XLA_BACKEND is not None or active is not None  # XLA has read its cache setting: it cannot change
    if started and cache is not None and cache != active:
        warnings.warn(f"compile_cache_dir={compile_cache_dir!r} is ignored: XLA already runs in this process with "
                      f"the compile cache {'off' if active is None else 'at ' + repr(active)}; restart the kernel "
                      "to change it", stacklevel=3)
        cache = active
    if _XLA_BACKEND is not None:
        if _XLA_BACKEND.spmd != spmd:
            raise BackendUnavailable(
                f"this process already runs XLA with spmd={_XLA_BACKEND.spmd}; spmd={spmd} needs a fresh process "
                "(restart the kernel)"
            )
        return _with_precision(_XLA_BACKEND, precision)
    if os.environ["PJRT_DEVICE"] == "TPU" and not module.runtime_started():
        tpu_host.check_tpu_free()  # another kernel holding the TPU: say who, instead of libtpu's obscure error
    # The cache must be set before the runtime runs its first computation, so before the backend exists.
    dir_used = module.initialize_compile_cache(cache) if cache is not None else None
    _XLA_BACKEND = module.XlaBackend(precision, spmd=bool(spmd))
    _XLA_BACKEND.compile_cache_dir = dir_used
    return _XLA_BACKEND


def _tpu_problem() -> str | None:
    """Why a TPU cannot be used here, or None when it can."""
    if tpu_chip_count() == 0 and os.environ.get("PJRT_DEVICE") != "TPU":
        return "no TPU chips are attached to this machine (none found on the PCI bus)"
    try:
        xla_module()
    except BackendUnavailable as err:
        return str(err)
    return None


def get_backend(
    device: str = "auto", *, fallback: bool = False, precision: str = "auto", spmd: bool | str = "auto",
    compile_cache_dir: str | None = "default",
) -> Backend:
    """Return the backend for `device` (see the module docstring for the names).

    spmd: on XLA with several local devices (a v5e-8, or CPU_NUM_DEVICES=8), "auto" drives them all from this
    process as one SPMD program with the batch sharded over a "data" mesh axis; False uses one device per process.
    compile_cache_dir: XLA's persistent compile cache, set when this process first creates its XLA backend:
    "default" (TPU only, see `resolve_compile_cache`), a directory (one subdirectory per process when several
    run), or None for none. Ignored on CPU and CUDA.
    """
    if device not in DEVICES:
        raise ValueError(f"device={device!r} is not one of {DEVICES}")
    if spmd not in (True, False, "auto"):
        raise ValueError(f"spmd={spmd!r} must be True, False or 'auto'")
    if device == "xla":
        return _xla_backend(precision, spmd, "TPU" if tpu_chip_count() else "CPU", compile_cache_dir)
    if device in ("auto", "tpu"):
        problem = _tpu_problem()
        if problem is None:
            return _xla_backend(precision, spmd, "TPU", compile_cache_dir)
        if device == "tpu" and not fallback:
            raise BackendUnavailable(f"device='tpu' cannot be used: {problem}. Pass fallback=True to use the next "
                                     "best device instead, or device='auto'.")
        if device == "tpu":
            warn_fallback("tpu", problem, "cuda" if torch.cuda.is_available() else "cpu")
        elif chips := tpu_chip_count():
            # A TPU host whose TPU cannot run (no torch_xla, TorchTPU or another torch_tpu instead, a torch_xla that
            # does not match torch): the user meant the TPU, so the CPU/GPU is not chosen without a word. Without
            # chips "auto" stays quiet.
            warnings.warn(f"device='auto': {chips} TPU chip(s) are attached but cannot be used: {problem}. "
                          f"Running on {'cuda' if torch.cuda.is_available() else 'cpu'!r} instead.", stacklevel=2)
    if device in ("auto", "tpu", "cuda"):
        if torch.cuda.is_available():
            from tpu_helpers.backend.cuda import CudaBackend

            return CudaBackend(precision)
        if device == "cuda":
            if not fallback:
                from tpu_helpers.backend.cuda import CudaBackend

                return CudaBackend(precision)  # raises BackendUnavailable with the reason
            warn_fallback("cuda", "torch.cuda.is_available() is False", "cpu")
    if precision == "bf16" and device != "cpu":
        warnings.warn("bf16 autocast on the CPU is slow; consider precision='fp32' there", stacklevel=2)
    return Backend(precision)


def backend_for(config: Any, **overrides: Any) -> Backend:
    """The backend a `TrainConfig` asks for: its device, fallback, precision, spmd and compile_cache_dir.

    `overrides` take `get_backend`'s keyword names (and `device`) and win over the config's values, e.g.
    `backend_for(config, spmd=False)` in a spawned process. Every entry point builds its backend here, so a
    config setting cannot be forgotten by one of them.
    """
    settings = {"device": config.device, "fallback": config.fallback, "precision": config.precision,
                "spmd": config.spmd, "compile_cache_dir": config.compile_cache_dir}
    unknown = sorted(set(overrides) - set(settings))
    if unknown:
        raise TypeError(f"backend_for() got unknown setting(s) {unknown}; known: {sorted(settings)}")
    settings.update(overrides)
    return get_backend(settings.pop("device"), **settings)
