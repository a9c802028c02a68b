"""TPU host facts read without an XLA runtime: chips by PCI device id (not Google's vendor id alone), the TPU lock
(which process holds it), hugepages and PJRT variables, on recorded sysfs and /proc trees."""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

import pytest

from tpu_helpers.backend import runtime_env, tpu_host
from tpu_helpers.backend.tpu_host import TpuBusy, check_tpu_free, tpu_chip_count, tpu_chips, tpu_lock

GVNIC = "0x0042"  # Google's virtual NIC: vendor 0x1ae0 like a TPU, on every GCE VM that uses gVNIC


def fake_sysfs(root: Path, devices: list[tuple[str, str]]) -> Path:
    """sys/bus/pci/devices/<address>/{vendor,device} as the kernel lays them out."""
    for i, (vendor, device) in enumerate(devices):
        d = root / "bus" / "pci" / "devices" / f"0000:00:{i + 4:02x}.0"
        d.mkdir(parents=True)
        (d / "vendor").write_text(vendor + "\n")
        (d / "device").write_text(device + "\n")
    return root


def gce_gpu_vm(root: Path) -> Path:
    # A GPU VM in Google Cloud: an NVIDIA GPU, an Intel bridge and the gVNIC card.
    return fake_sysfs(root, [("0x10de", "0x20b0"), ("0x8086", "0x7192"), ("0x1ae0", GVNIC)])


def v5e_8(root: Path) -> Path:
    return fake_sysfs(root, [("0x1ae0", GVNIC)] + [("0x1ae0", "0x0063")] * 8)


def v6e_1(root: Path) -> Path:
    return fake_sysfs(root, [("0x8086", "0x1237"), ("0x1ae0", "0x006f")])


def test_gvnic_is_not_a_tpu_and_chips_are_counted_by_device_id(tmp_path):
    assert tpu_chip_count(gce_gpu_vm(tmp_path / "gce")) == 0
    chips = tpu_chips(v5e_8(tmp_path / "v5e"))
    assert len(chips) == 8 and {c.generation for c in chips} == {"v5e"} and chips[0].device_id == "0x0063"
    assert tpu_host.describe_chips(chips) == "8 x TPU v5e (PCI device 0x0063)"
    (chip,) = tpu_chips(v6e_1(tmp_path / "v6e"))
    assert (chip.generation, chip.device_id, chip.address) == ("v6e", "0x006f", "0000:00:05.0")
    assert tpu_chip_count(tmp_path / "no-such-root") == 0


@pytest.mark.skipif(importlib.util.find_spec("torch_xla") is None, reason="torch_xla is not installed")
def test_device_ids_are_torch_xlas_list():
    # Read torch_xla's source rather than import it (its import pulls in the runtime's dependencies).
    path = Path(importlib.util.find_spec("torch_xla").submodule_search_locations[0]) / "_internal" / "tpu.py"
    block = re.search(r"_TPU_PCI_DEVICE_IDS = \[(.*?)\]", path.read_text(), re.S).group(1)
    assert set(tpu_host.TPU_PCI_DEVICE_IDS) == set(re.findall(r"'(0x[0-9a-f]+)'", block))


def fake_proc(root: Path, processes: dict[int, list[str]], locks: str = "") -> Path:
    """proc/<pid>/fd/<n> links (to anything: only the link text is read) and proc/<pid>/cmdline."""
    for pid, targets in processes.items():
        fd = root / str(pid) / "fd"
        fd.mkdir(parents=True)
        (root / str(pid) / "cmdline").write_bytes(b"python\0-m\0ipykernel_launcher\0-f\0k.json\0")
        for n, target in enumerate(targets):
            os.symlink(target, fd / str(n))
    (root / "self").mkdir(parents=True, exist_ok=True)
    (root / "locks").write_text(locks)
    return root


def test_lock_names_the_process_holding_the_chips_and_how_to_free_it(tmp_path):
    proc = fake_proc(tmp_path / "proc", {
        100: ["/dev/null", "pipe:[123]"],
        4242: ["/dev/null", "/dev/accel0", "/dev/accel1"],
        4343: ["socket:[9]", "/dev/vfio/0"],
        4444: ["/dev/accelerometer"],  # not a TPU node
    })
    lock = tpu_lock(proc, tmp_path / "libtpu_lockfile", exclude_pid=100)
    assert lock.held and sorted(lock.holders) == [4242, 4343] and lock.lockfile is None
    message = lock.message()
    assert "pid 4242 (python -m ipykernel_launcher -f k.json)" in message and "pid 4343" in message
    assert "kill 4242 4343" in message and "Only one process can hold a TPU" in message
    # This process is left out by default (it may use the TPU it holds) ...
    assert not tpu_lock(proc, tmp_path / "x", exclude_pid=4242).holders.keys() - {4343}


def test_lockfile_holder_from_proc_locks_and_a_stale_lockfile(tmp_path):
    lockfile = tmp_path / "libtpu_lockfile"
    lockfile.write_text("")
    inode = lockfile.stat().st_ino
    locks = f"1: POSIX  ADVISORY  WRITE 777 00:2e:999 0 EOF\n2: FLOCK  ADVISORY  WRITE 5150 fd:01:{inode} 0 EOF\n"
    lock = tpu_lock(fake_proc(tmp_path / "proc", {}, locks), lockfile, exclude_pid=1)
    assert lock.held and lock.lockfile_holders == (5150,) and "kill 5150" in lock.message()
    stale = tpu_lock(fake_proc(tmp_path / "proc2", {}), lockfile, exclude_pid=1)
    assert not stale.held and f"rm -f {lockfile}" in stale.message()
    assert tpu_lock(fake_proc(tmp_path / "proc3", {}), tmp_path / "absent").message() == ""


def test_check_tpu_free_raises_only_on_a_tpu_host_that_another_process_holds(tmp_path):
    proc = fake_proc(tmp_path / "proc", {4242: ["/dev/accel0"]})
    lock = tmp_path / "lockfile"
    with pytest.raises(TpuBusy, match=r"already in use by another process: pid 4242 .*kill 4242"):
        check_tpu_free(sysfs_root=v6e_1(tmp_path / "sys"), proc_root=proc, lockfile=lock)
    check_tpu_free(sysfs_root=gce_gpu_vm(tmp_path / "gce"), proc_root=proc, lockfile=lock)  # no TPU: nothing to hold
    check_tpu_free(sysfs_root=tmp_path / "sys", proc_root=fake_proc(tmp_path / "p2", {}), lockfile=lock)
    # The runner counts its own process too: a parent holding the TPU blocks the child kernel it would start.
    me = fake_proc(tmp_path / "p3", {os.getpid(): ["/dev/accel0"]})
    check_tpu_free(sysfs_root=tmp_path / "sys", proc_root=me, lockfile=lock)
    with pytest.raises(TpuBusy, match=rf"pid {os.getpid()} \(this process\)"):
        check_tpu_free(sysfs_root=tmp_path / "sys", proc_root=me, lockfile=lock, include_self=True)


def test_hugepages_and_pjrt_variables(tmp_path):
    thp = tmp_path / tpu_host.THP_ENABLED
    thp.parent.mkdir(parents=True)
    thp.write_text("always [madvise] never\n")
    assert tpu_host.transparent_hugepages(tmp_path) == "madvise"
    thp.write_text("[always] madvise never\n")
    assert tpu_host.transparent_hugepages(tmp_path) == "always"
    assert tpu_host.transparent_hugepages(tmp_path / "none") is None
    assert runtime_env.runtime_vars({"PJRT_DEVICE": "TPU", "HOME": "/root"}) == {"PJRT_DEVICE": "TPU"}
    assert "XLA will not use them" in tpu_host.pjrt_problem({"PJRT_DEVICE": "CPU"}, 8)[0]
    assert "fail to start" in tpu_host.pjrt_problem({"PJRT_DEVICE": "TPU"}, 0)[0]
    assert tpu_host.pjrt_problem({}, 8) is None and tpu_host.pjrt_problem({"PJRT_DEVICE": "CPU"}, 0) is None
