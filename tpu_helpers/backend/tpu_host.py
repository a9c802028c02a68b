"""What the host says about its TPUs, read from sysfs and /proc without starting an XLA runtime.

    from tpu_helpers.backend.tpu_host import tpu_chips, tpu_lock, check_tpu_free
    tpu_chips()              # [TpuChip("0000:00:04.0", "0x0063", "v5e"), ...]; [] on a GPU VM with a gVNIC card
    lock = tpu_lock()        # who holds the TPU: pids with /dev/accel* or /dev/vfio/* open, and libtpu's lock file
    check_tpu_free()         # raises TpuBusy naming the holder and how to free it

Only one process can hold a TPU. libtpu opens the chips (/dev/accel* on v4/v5e/v6e hosts, /dev/vfio/* where they
are passed through with VFIO) and keeps /tmp/libtpu_lockfile; a second process then fails deep in libtpu with an
obscure message. Every entry point asks `check_tpu_free` first and says plainly which process to stop.

Every function takes its roots (`sysfs_root`, `proc_root`, `lockfile`) as parameters, so tests run them on
recorded trees.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from tpu_helpers.backend.base import BackendUnavailable

GOOGLE_PCI_VENDOR = "0x1ae0"
# torch_xla/_internal/tpu.py `_TPU_PCI_DEVICE_IDS` (torch_xla 2.9), with the generation each id is; Google's gVNIC
# network card has the same vendor id and must not count as a TPU. A test checks this list against torch_xla's.
TPU_PCI_DEVICE_IDS: dict[str, str] = {
    "0x0027": "v2/v3",
    "0x005e": "v4",
    "0x0063": "v5e",
    "0x006f": "v6e",
    "0x0056": "test id 0x0056",
    "0x0062": "test id 0x0062",
    "0x0076": "v7x",
}
LIBTPU_LOCKFILE = "/tmp/libtpu_lockfile"
_DEVICE_NODE = re.compile(r"^/dev/(accel\d+|vfio/\d+)$")


@dataclass(frozen=True)
class TpuChip:
    address: str  # PCI address, e.g. 0000:00:04.0
    device_id: str  # e.g. 0x0063
    generation: str  # e.g. v5e (see TPU_PCI_DEVICE_IDS)


def _read(path: Path) -> str:
    try:
        return path.read_text().strip().lower()
    except OSError:
        return ""


def tpu_chips(sysfs_root: str | os.PathLike = "/sys") -> list[TpuChip]:
    """TPU chips on the PCI bus: Google's vendor id AND a TPU device id."""
    chips = []
    devices = Path(sysfs_root) / "bus" / "pci" / "devices"
    for dev in sorted(devices.glob("*")) if devices.is_dir() else []:
        if _read(dev / "vendor") != GOOGLE_PCI_VENDOR:
            continue
        device_id = _read(dev / "device")
        if device_id in TPU_PCI_DEVICE_IDS:
            chips.append(TpuChip(dev.name, device_id, TPU_PCI_DEVICE_IDS[device_id]))
    return chips


def tpu_chip_count(sysfs_root: str | os.PathLike = "/sys") -> int:
    """How many TPU chips are attached (0 on a machine without TPUs, a GCE VM with a gVNIC card included)."""
    return len(tpu_chips(sysfs_root))


def describe_chips(chips: list[TpuChip]) -> str:
    """e.g. "8 x TPU v5e (PCI device 0x0063)"; "none" for no chips."""
    if not chips:
        return "none"
    groups: dict[tuple[str, str], int] = {}
    for c in chips:
        groups[(c.generation, c.device_id)] = groups.get((c.generation, c.device_id), 0) + 1
    return ", ".join(f"{n} x TPU {gen} (PCI device {dev})" for (gen, dev), n in groups.items())


# ---- pod slices: how many hosts run the program ---------------------------------------------------------------
WORKER_HOSTNAMES = "TPU_WORKER_HOSTNAMES"  # "host-0,host-1,...": set on GKE, where the metadata server is not asked
METADATA_URL = "http://metadata.google.internal/computeMetadata/v1/instance/attributes/worker-network-endpoints"


def parse_worker_endpoints(text: str) -> list[str]:
    """The hosts of a slice from the TPU VM metadata value worker-network-endpoints ("name:uid:ip,name:uid:ip")."""
    return [part.split(":")[-1].strip() for part in text.split(",") if part.strip()]


def _fetch_metadata(url: str = METADATA_URL, timeout: float = 2.0) -> str | None:
    import urllib.request

    request = urllib.request.Request(url, headers={"Metadata-Flavor": "Google"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.read().decode()
    except (OSError, ValueError):  # not a GCE VM, no such key (a TPU VM of one host), or no answer in time
        return None


def slice_hosts(environ: dict | None = None, fetch=_fetch_metadata) -> int:
    """Hosts in this TPU slice, read before any runtime starts from where torch_xla reads them (its
    `_internal/tpu.get_worker_ips`): TPU_WORKER_HOSTNAMES when set, else the VM's metadata. 1 when neither
    answers: a single-host TPU VM (v5e-8), Colab, Kaggle. Call it only on a host with TPU chips attached."""
    env = os.environ if environ is None else environ
    text = env.get(WORKER_HOSTNAMES) or fetch() or ""
    hosts = parse_worker_endpoints(text) if ":" in text else [h for h in text.split(",") if h.strip()]
    return max(1, len(hosts))


# ---- the TPU lock ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TpuLock:
    holders: dict[int, str] = field(default_factory=dict)  # pid -> its command line
    lockfile: str | None = None  # libtpu's lock file, when it exists
    lockfile_holders: tuple[int, ...] = ()  # pids /proc/locks shows holding a lock on it

    @property
    def held(self) -> bool:
        return bool(self.holders or self.lockfile_holders)

    def message(self) -> str:
        """What to tell a user, with the way out; "" when the TPU is free."""
        if not self.held:
            if self.lockfile:
                return (f"libtpu's lock file {self.lockfile} is left from an earlier process but no process holds "
                        "the TPU; if starting the TPU fails, remove it: rm -f " + self.lockfile)
            return ""
        pids = sorted(set(self.holders) | set(self.lockfile_holders))
        me = os.getpid()
        who = "; ".join(f"pid {p} ({'this process' if p == me else self.holders.get(p) or 'holds the lock file'})"
                        for p in pids)
        kill = " ".join(str(p) for p in pids)
        return (f"the TPU is already in use by another process: {who}. Only one process can hold a TPU. Free it by "
                f"stopping that process (a notebook kernel: Kernel > Shut Down, or Runtime > Restart session on "
                f"Colab; otherwise: kill {kill}), then run this again")


def _cmdline(proc: Path) -> str:
    try:
        raw = (proc / "cmdline").read_bytes()
    except OSError:
        return ""
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()[:120]


def _lock_pids(proc_root: Path, lockfile: Path) -> tuple[int, ...]:
    # /proc/locks lines: "1: FLOCK  ADVISORY  WRITE 1234 fd:01:5678 0 EOF" (pid, then major:minor:inode).
    try:
        inode = lockfile.stat().st_ino
        text = (proc_root / "locks").read_text()
    except OSError:
        return ()
    pids = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 6 and parts[1] != "->":
            with_inode = parts[5].rsplit(":", 1)
            if len(with_inode) == 2 and with_inode[1].isdigit() and int(with_inode[1]) == inode and parts[4].isdigit():
                pids.append(int(parts[4]))
    return tuple(sorted(set(pids)))


def tpu_lock(proc_root: str | os.PathLike = "/proc", lockfile: str | os.PathLike = LIBTPU_LOCKFILE,
             exclude_pid: int | None = None) -> TpuLock:
    """Which processes hold the TPU: open /dev/accel* or /dev/vfio/<n> file descriptors, and locks on libtpu's lock
    file. `exclude_pid` (default: this process; 0 leaves nobody out) is left out. Processes we may not inspect
    are skipped (run as root to see every one)."""
    exclude = os.getpid() if exclude_pid is None else exclude_pid
    proc, lock = Path(proc_root), Path(lockfile)
    holders: dict[int, str] = {}
    for entry in proc.glob("[0-9]*"):
        pid = int(entry.name) if entry.name.isdigit() else None
        if pid is None or pid == exclude:
            continue
        try:
            fds = list((entry / "fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if _DEVICE_NODE.match(target):
                holders[pid] = _cmdline(entry)
                break
    lock_pids = tuple(p for p in _lock_pids(proc, lock) if p != exclude)
    return TpuLock(holders, str(lock) if lock.exists() else None, lock_pids)


class TpuBusy(BackendUnavailable):
    """Another process holds the TPU; the message names it and how to free it."""


def check_tpu_free(*, sysfs_root: str | os.PathLike = "/sys", proc_root: str | os.PathLike = "/proc",
                   lockfile: str | os.PathLike = LIBTPU_LOCKFILE, include_self: bool = False) -> None:
    """Raise TpuBusy when the host has TPU chips and another process holds them. Call it before starting the TPU
    runtime here (`get_backend`), or, with include_self=True, before starting a child that needs the TPU (the
    notebook runner: a parent that holds the TPU blocks its child kernel too)."""
    if not tpu_chip_count(sysfs_root):
        return
    lock = tpu_lock(proc_root, lockfile, exclude_pid=0 if include_self else None)
    if lock.held:
        raise TpuBusy(lock.message())


# ---- environment and host settings ----------------------------------------------------------------------------
# The variables that decide what the XLA runtime does when it starts (the doctor prints them).
def may_use_tpu(device: object, env: dict) -> bool:
    """Whether a run with this DEVICE and these extra environment variables would start the TPU runtime on a TPU
    host (cpu/cuda never do; "xla" with PJRT_DEVICE=CPU runs on XLA:CPU)."""
    return device not in ("cpu", "cuda") and env.get("PJRT_DEVICE", "TPU") == "TPU"


def pjrt_problem(env: dict, chips: int) -> tuple[str, str] | None:
    """(what is wrong, the fix) when the PJRT variables contradict the chips seen, else None."""
    device = env.get("PJRT_DEVICE")
    if chips and device not in (None, "TPU"):
        return (f"PJRT_DEVICE={device} but {chips} TPU chip(s) are attached: XLA will not use them",
                "unset PJRT_DEVICE (or export PJRT_DEVICE=TPU) before Python starts")
    if not chips and device == "TPU":
        return ("PJRT_DEVICE=TPU but no TPU chip is attached: the XLA runtime will fail to start",
                "unset PJRT_DEVICE (or export PJRT_DEVICE=CPU to run the TPU code path on the CPU)")
    return None


# ---- host settings ----------------------------------------------------------------------------------------------
THP_ENABLED = "kernel/mm/transparent_hugepage/enabled"


def transparent_hugepages(sysfs_root: str | os.PathLike = "/sys") -> str | None:
    """The selected transparent-hugepage mode ("always", "madvise", "never"), or None when the kernel has none."""
    text = _read(Path(sysfs_root) / THP_ENABLED)
    m = re.search(r"\[(\w+)\]", text)
    return m.group(1) if m else (text or None)
