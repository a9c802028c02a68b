"""Preflight: is this machine ready to train on its TPU (or GPU/CPU)? `python -m tpu_helpers doctor`, or in a cell:

    from tpu_helpers.launch.doctor import doctor; print(doctor())

Checks Python and package versions, the platform's stack (Colab's TPU runtime, Kaggle's TPU image, a TPU VM)
against the stacks CI tests, the torch/torch_xla pair (matching, and one of the tested pairs), libtpu, the extra the
fine-tuning notebook needs, the TPU chips (by PCI device id) and their generation, whether another process holds the
TPU, transparent hugepages on TPU hosts, free HBM (only when this process already runs the TPU: the doctor never
starts a runtime, which would take the TPU from the notebook), whether the compile-cache directory is writable, the
PJRT variables, the ipywidgets front-end (and ipykernel 7 under ipywidgets 7, which renders nothing) and TorchTPU
(found by its package metadata, never imported: what tpu_helpers supports on it, or that the `torch_tpu` installed is
Sophgo's). Each failing
check prints the command that fixes it. `Host` says where to look, so tests run the checks on recorded trees.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from tpu_helpers import platform
from tpu_helpers.backend import (
    NEWEST_TORCH_XLA,
    NEWEST_TORCH_XLA_LIBTPU,
    pair_version,
    runtime_env,
    torch_tpu,
    tpu_host,
)
from tpu_helpers.core.extras import EXTRAS
from tpu_helpers.platform import stacks

OK, WARN, FAIL, INFO, SKIP = "ok", "warn", "FAIL", "info", "skip"
PACKAGES = ("tpu_helpers", "torch", "torch_xla", "libtpu", "transformers", "peft", "datasets", "safetensors",
            "ipywidgets", "papermill", "matplotlib")
THP_FIX = "sudo sh -c 'echo always > /sys/kernel/mm/transparent_hugepage/enabled'"


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # ok | warn | FAIL | info | skip
    detail: str
    fix: str | None = None  # the command (or action) that fixes a warn/FAIL


@dataclass
class Host:
    """Where the doctor looks; the defaults are this machine (tests pass recorded trees and environments)."""

    sysfs_root: str = "/sys"
    proc_root: str = "/proc"
    lockfile: str = tpu_host.LIBTPU_LOCKFILE
    env: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))
    version: Callable[[str], str | None] = platform.installed_version
    python: tuple[int, int, int] = tuple(sys.version_info[:3])  # type: ignore[assignment]
    platform: str | None = None  # colab | kaggle | local; None: detected
    hbm: Callable[[], tuple[int, int] | None] | None = None  # (free, total) bytes; None: this process's runtime
    find_torch_tpu: Callable[[], torch_tpu.TorchTpu | None] = torch_tpu.installed  # the torch_tpu on the path


@dataclass
class DoctorReport:
    platform: str
    checks: list[Check]

    @property
    def ok(self) -> bool:
        return not any(c.status == FAIL for c in self.checks)

    def __str__(self) -> str:
        width = max(len(c.name) for c in self.checks)
        lines = [f"tpu_helpers doctor (platform: {self.platform})"]
        for c in self.checks:
            lines.append(f"  {c.status:<4}  {c.name:<{width}}  {c.detail}")
            if c.fix and c.status in (WARN, FAIL):
                lines.append(f"  {'':<4}  {'':<{width}}  fix: {c.fix}")
        failed = sum(c.status == FAIL for c in self.checks)
        lines.append("all checks passed" if self.ok else f"{failed} check(s) failed: run the fix lines above")
        return "\n".join(lines)


def _pair(host: Host, chips: int) -> list[Check]:
    pair = platform.TorchXlaPair(host.version("torch"), host.version("torch_xla"))
    if pair.ok and pair.torch.split("+")[0] in stacks.TESTED_PAIRS:
        out = [Check("torch/torch_xla", OK, f"torch {pair.torch}, torch_xla {pair.torch_xla} (a tested pair)")]
    elif pair.ok:
        out = [Check("torch/torch_xla", WARN, f"torch {pair.torch}, torch_xla {pair.torch_xla}: they match, but CI "
                     f"tests only {' and '.join(stacks.TESTED_PAIRS)}; if something fails, install the tested pair "
                     "(then restart the runtime)", stacks.PAIR_FIX)]
    elif pair.torch and not pair.torch_xla and not chips:
        out = [Check("torch/torch_xla", INFO, f"torch {pair.torch}; torch_xla not installed (needed for TPUs only)")]
    else:
        base = pair_version(pair.torch)
        apart = "" if base == (pair.torch or base).split("+")[0] else \
            f"  (in an environment of its own: no torch_xla release matches torch {pair.torch})"
        out = [Check("torch/torch_xla", FAIL, f"torch {pair.torch or 'missing'}, torch_xla {pair.torch_xla or 'missing'}"
                     " (they must be the same version)", f"pip install 'torch=={base}' 'torch_xla[tpu]=={base}'{apart}")]
    libtpu = host.version("libtpu") or host.version("libtpu-nightly")
    if libtpu and not pair.torch_xla and (found := host.find_torch_tpu()) is not None and found.is_google:
        # TorchTPU's own libtpu: nothing of this package runs on it, so no "ok" for the TPU.
        out.append(Check("libtpu", INFO, f"{libtpu}, {torch_tpu.NAME}'s (torch_xla {NEWEST_TORCH_XLA} pairs with "
                                         f"libtpu {NEWEST_TORCH_XLA_LIBTPU})"))
    elif libtpu:
        out.append(Check("libtpu", OK if chips else INFO, libtpu))
    elif chips:
        base = (pair.torch_xla or pair_version(pair.torch)).split("+")[0]
        out.append(Check("libtpu", FAIL, "not installed: torch_xla cannot reach the TPU chips",
                         f"pip install 'torch_xla[tpu]=={base}'"))
    else:
        out.append(Check("libtpu", INFO, "not installed (needed on TPU hosts only)"))
    return out


def _stack(host: Host, where: str, chips: int) -> Check:
    """Which stack this is (the platform's, by name) and how it differs from the one CI tests for that platform."""
    name = "tpuvm" if where == "local" and chips else where
    label = stacks.PLATFORM_NAMES.get(name, name)
    shown = ", ".join(f"{d} {host.version(d) or '-'}" for d in ("torch", "torch_xla", "transformers", "ipywidgets"))
    py = ".".join(map(str, host.python))
    profile = stacks.profile_for(where, tpu=bool(chips) or host.version("torch_xla") is not None)
    if profile is None:
        return Check("stack", INFO, f"{label}: Python {py}, {shown} (CI tests the Colab and Kaggle stacks, the newest "
                     f"torch without torch_xla and the dev set of requirements-dev.lock)")
    diffs = profile.differences(host.version, host.python)
    if not diffs:
        return Check("stack", OK, f"{label}: Python {py}, {shown}: the tested {profile.name} stack")
    return Check("stack", INFO, f"{label}: Python {py}, {shown}; differs from the tested {profile.name} stack "
                 f"({profile.describe()}) in: {'; '.join(diffs)}")


def _extras(host: Host) -> Check:
    missing = [d for d in EXTRAS["hf"] if host.version(d) is None]
    if not missing:
        return Check("fine-tuning", OK, "the hf extra is installed: " + ", ".join(
            f"{d} {host.version(d)}" for d in EXTRAS["hf"]))
    ranges = {r.name: str(r) for r in platform.read_requirements(platform.colab_requirements())}
    return Check("fine-tuning", WARN, f"{', '.join(missing)} not installed: the fine-tuning notebook (the hf extra) "
                 "needs it; its setup cell installs it", "pip install " + " ".join(f"'{ranges.get(d, d)}'"
                                                                                  for d in missing))


def _lock(host: Host, chips: int) -> Check:
    if not chips:
        return Check("TPU lock", SKIP, "no TPU here")
    lock = tpu_host.tpu_lock(host.proc_root, host.lockfile, exclude_pid=0)
    me = os.getpid()
    others = sorted((set(lock.holders) | set(lock.lockfile_holders)) - {me})
    if others:
        return Check("TPU lock", FAIL, lock.message(), f"kill {' '.join(map(str, others))}  (or shut down that "
                     "notebook kernel)")
    if lock.held:
        return Check("TPU lock", OK, f"held by this process (pid {me}): only this kernel can use the TPU")
    if lock.lockfile:
        return Check("TPU lock", WARN, f"free, but libtpu's lock file {lock.lockfile} is left from an earlier "
                     "process", f"rm -f {lock.lockfile}  (only if starting the TPU then fails)")
    return Check("TPU lock", OK, "free")


def _hugepages(host: Host, chips: int) -> Check:
    if not chips:
        return Check("hugepages", SKIP, "no TPU here")
    mode = tpu_host.transparent_hugepages(host.sysfs_root)
    if mode == "always":
        return Check("hugepages", OK, "transparent hugepages: always")
    return Check("hugepages", WARN, f"transparent hugepages: {mode or 'unknown'} (TPU guides enable them: the TPU "
                 "runtime starts faster)", THP_FIX)


def _this_process_hbm() -> tuple[int, int] | None:
    from tpu_helpers.backend import started_xla_backend

    backend = started_xla_backend()  # only a runtime this process already started; never start one
    if backend is None or not backend.on_tpu:
        return None
    info = backend.memory_info() or {}
    if not info.get("bytes_limit"):
        return None
    return info["bytes_limit"] - info.get("bytes_used", 0), info["bytes_limit"]


def _hbm(host: Host, chips: int) -> Check:
    if not chips:
        return Check("HBM free", SKIP, "no TPU here")
    free_total = (host.hbm or _this_process_hbm)()
    if free_total is None:
        return Check("HBM free", SKIP, "this process has not started the TPU runtime (the doctor never starts one: "
                     "run it again after get_backend to see HBM)")
    from tpu_helpers.core.hardware import format_bytes

    free, total = free_total
    status = OK if free > 0.1 * total else WARN
    return Check("HBM free", status, f"{format_bytes(free)} of {format_bytes(total)} (chip 0)",
                 "free tensors you no longer need (del x), or restart the kernel")


def _torch_tpu(host: Host) -> Check:
    """TorchTPU (torch_xla's successor) or Sophgo's torch_tpu, as the backend layer finds it: what tpu_helpers does
    with it. Information only: where it stands in for torch_xla on a TPU host, the torch/torch_xla check fails."""
    found = host.find_torch_tpu()
    if found is None:
        return Check(torch_tpu.NAME, SKIP, "not installed")
    detail = f"{found.describe()}: {found.support()}"
    if found.is_google:
        v = NEWEST_TORCH_XLA
        detail += f"; TPUs run on the torch {v} + torch_xla {v} pair, in an environment of its own"
    return Check(torch_tpu.NAME, INFO, detail)


def _writable_dir(path: str) -> str | None:
    """None when files can be created in `path` (made if absent), else why not."""
    probe = path
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    if not os.path.isdir(probe):
        return f"{probe} is not a directory"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"{probe} is not writable"
    return None


def _cache(host: Host, chips: int) -> Check:
    from tpu_helpers.backend import active_compile_cache, resolve_compile_cache

    active = active_compile_cache()
    cache = resolve_compile_cache("default", "TPU", active, env=host.env)
    where = f"{cache} ({'in use' if active else 'default on TPU' if chips else 'used on TPU only'})"
    problem = _writable_dir(cache)
    if problem is None:
        return Check("compile cache", OK, where)
    return Check("compile cache", FAIL if chips else WARN, f"{where}: {problem}",
                 "export TPU_HELPERS_XLA_CACHE=/a/writable/dir  (or pass compile_cache_dir=None to turn it off)")


def _pjrt(host: Host, chips: int) -> Check:
    variables = runtime_env.runtime_vars(dict(host.env))
    shown = ", ".join(f"{k}={v}" for k, v in variables.items()) or "none set"
    problem = tpu_host.pjrt_problem(dict(host.env), chips)
    if problem:
        return Check("PJRT variables", FAIL, f"{shown}: {problem[0]}", problem[1])
    return Check("PJRT variables", OK, shown)


def _widgets(host: Host, where: str) -> Check:
    kernel = host.version("ipywidgets")
    if kernel is None:
        return Check("ipywidgets", WARN, "not installed: the memory panel falls back to text",
                     "pip install ipywidgets")
    major = kernel.split(".")[0]
    ipykernel = host.version("ipykernel")
    if major == "7" and ipykernel and int(ipykernel.split(".")[0]) >= 7:
        # Seen in the browser test: ipywidgets 7.7's messages never reach the front-end from ipykernel 7.
        return Check("ipywidgets", WARN, f"ipywidgets {kernel} with ipykernel {ipykernel}: ipywidgets 7 widgets do "
                     "not render from ipykernel 7 (the panel stays blank)", "pip install 'ipykernel<7'  (or "
                     "ipywidgets 8 where the front-end has it), then restart the kernel")
    if where in ("colab", "kaggle"):
        return Check("ipywidgets", INFO, f"ipywidgets {kernel}; {where.capitalize()} draws widgets with its own "
                     "front-end")
    lab, classic = host.version("jupyterlab_widgets"), host.version("widgetsnbextension")
    want = {"8": ("3", "4"), "7": ("1", "3")}.get(major)
    shown = f"ipywidgets {kernel}, jupyterlab_widgets {lab or '-'}, widgetsnbextension {classic or '-'}"
    if want is None or not (lab or classic):
        return Check("ipywidgets", INFO, shown + " (no Jupyter front-end package: fine for scripts)")
    if (lab and lab.split(".")[0] != want[0]) or (classic and classic.split(".")[0] != want[1]):
        return Check("ipywidgets", WARN, shown + ": the front-end does not match the kernel's ipywidgets, so "
                     "widgets may not render", f"pip install 'ipywidgets=={kernel}'  (it pins the matching "
                     "front-end packages), then reload the browser tab")
    return Check("ipywidgets", OK, shown)


def doctor(host: Host | None = None) -> DoctorReport:
    """Run every check (quick: reads files and package metadata; starts no XLA runtime and installs nothing)."""
    host = host or Host()
    where = host.platform or platform.platform_name()
    chips = tpu_host.tpu_chips(host.sysfs_root)
    py = ".".join(map(str, host.python))
    checks = [Check("python", OK if host.python >= (3, 10) else FAIL, py, "use Python 3.10 or newer")]
    checks.append(Check("packages", INFO, ", ".join(f"{p} {host.version(p) or '-'}" for p in PACKAGES)))
    checks.append(_stack(host, where, len(chips)))
    checks += _pair(host, len(chips))
    checks.append(_extras(host))
    checks.append(Check("TPU chips", OK if chips else INFO,
                        tpu_host.describe_chips(chips) if chips else "none on the PCI bus (GPU/CPU machine)"))
    checks += [_lock(host, len(chips)), _hugepages(host, len(chips)), _hbm(host, len(chips)),
               _cache(host, len(chips)), _pjrt(host, len(chips)), _widgets(host, where), _torch_tpu(host)]
    return DoctorReport(where, checks)


def main() -> int:
    report = doctor()
    print(report)
    return 0 if report.ok else 1
