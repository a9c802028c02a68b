"""The XLA/PJRT environment of a process: every variable and flag name torch_xla reads lives here.

torch_xla and its PJRT runtime read their settings from environment variables once, when the runtime starts (the
first XLA device or tensor of the process). Code elsewhere in the package asks this module for the variables it
needs instead of spelling their names, so the knowledge of what torch_xla reads (and when) is in one place:

    from tpu_helpers.backend import runtime_env
    env = runtime_env.xla_cpu_env(devices=8)          # run the TPU code path on 8 simulated XLA:CPU devices
    env = runtime_env.debug_env("runs/debug.txt")      # torch_xla's debug output, into a file
    env = runtime_env.dump_env("/tmp/dump")            # the compiler's dumps (memory reports) into a directory
    runtime_env.local_device_count("tpu")              # devices this host will have, without starting XLA
    runtime_env.runtime_started()                      # too late for any of the above in this process?

Nothing here imports torch_xla: these run before the runtime exists and where torch_xla is absent.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path

PJRT_DEVICE = "PJRT_DEVICE"  # "TPU", "CPU" or "CUDA": which PJRT plugin the runtime loads
CPU_DEVICES = "CPU_NUM_DEVICES"  # XLA:CPU devices to simulate (8 stands in for a v5e-8)
TPU_DEVICES = "TPU_NUM_DEVICES"  # TPU chips a process may use
ACCELERATOR_TYPE = "TPU_ACCELERATOR_TYPE"  # e.g. "v5litepod-8", set on TPU VMs
XLA_FLAGS = "XLA_FLAGS"  # the compiler's own flags
DEBUG_LEVEL = "PT_XLA_DEBUG_LEVEL"  # 1: compilation analysis; 2: also why each graph executed
DEBUG_FILE = "PT_XLA_DEBUG_FILE"
HLO_DEBUG = "XLA_HLO_DEBUG"  # Python frames in the HLO metadata
COMPILATION_CACHE_SIZE = "XLA_COMPILATION_CACHE_SIZE"  # compiled graphs kept in memory (an LRU; 2048 by default)
LOCAL_PROCESS_COUNT = "PJRT_LOCAL_PROCESS_COUNT"  # set in each xmp.spawn child
LOCAL_PROCESS_RANK = "PJRT_LOCAL_PROCESS_RANK"

RUNTIME_VARS = (PJRT_DEVICE, CPU_DEVICES, TPU_DEVICES, ACCELERATOR_TYPE, "TPU_VISIBLE_CHIPS", "TPU_PROCESS_BOUNDS",
                "TPU_CHIPS_PER_PROCESS_BOUNDS", XLA_FLAGS, "LIBTPU_INIT_ARGS", DEBUG_LEVEL, DEBUG_FILE, HLO_DEBUG,
                "XLA_USE_SPMD", "TPU_HELPERS_XLA_CACHE", COMPILATION_CACHE_SIZE)
DEBUG_LEVELS = (1, 2)


def runtime_vars(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The XLA/PJRT variables set in `environ` (this process's environment by default), for a status print."""
    environ = os.environ if environ is None else environ
    return {k: environ[k] for k in RUNTIME_VARS if k in environ}


def pjrt_device(environ: Mapping[str, str] | None = None) -> str | None:
    """The PJRT device this process's runtime will use ("TPU", "CPU", ...), or None when not chosen yet."""
    return (os.environ if environ is None else environ).get(PJRT_DEVICE) or None


def choose_pjrt_device(device: str, *, tpu_attached: bool) -> str | None:
    """Set the PJRT device for `device` ("auto", "tpu", "xla", ...) unless the user exported one; returns it.

    A TPU host gets TPU for any XLA-capable choice; elsewhere only an explicit "xla" gets XLA:CPU."""
    if device in ("auto", "tpu", "xla") and tpu_attached:
        os.environ.setdefault(PJRT_DEVICE, "TPU")
    elif device == "xla":
        os.environ.setdefault(PJRT_DEVICE, "CPU")
    return pjrt_device()


def xla_cpu_env(devices: int = 1) -> dict[str, str]:
    """Variables that run the XLA code path on `devices` simulated XLA:CPU devices (set before Python starts XLA)."""
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise ValueError(f"devices={devices!r} must be a positive int")
    return {PJRT_DEVICE: "CPU", CPU_DEVICES: str(devices)}


def without_device_count(environ: Mapping[str, str]) -> dict[str, str]:
    """`environ` less the simulated device count, for a child process that must run on a single device."""
    return {k: v for k, v in environ.items() if k != CPU_DEVICES}


def local_device_count(device: str = "tpu", *, tpu_chips: int | None = None) -> int:
    """XLA devices this host will have, read without starting the XLA runtime (1 for "cpu"/"cuda").

    `tpu_chips` is the number of chips attached (read from sysfs by `tpu_helpers.backend.tpu_chip_count` when
    not given)."""
    if device not in ("tpu", "xla", "auto"):
        return 1
    if tpu_chips is None:
        from tpu_helpers.backend import tpu_chip_count

        tpu_chips = tpu_chip_count()
    pjrt = pjrt_device() or ("TPU" if tpu_chips else "CPU")
    if device == "auto" and pjrt != "TPU":
        return 1
    if pjrt == "CPU":
        return int(os.environ.get(CPU_DEVICES, "1"))
    return int(os.environ.get(TPU_DEVICES) or tpu_chips or 1)


def slice_device_count(device: str = "tpu", *, tpu_chips: int | None = None, hosts: int | None = None) -> int:
    """Devices one SPMD program spans, read without starting the XLA runtime: this host's
    (`local_device_count`) times the hosts of a TPU pod slice (`tpu_host.slice_hosts`, asked only on a host with
    TPU chips; 1 elsewhere). On a v5e-32 every host gets 32, so each plans the same global batch split."""
    from tpu_helpers.backend import tpu_host

    tpu_path = device in ("tpu", "xla", "auto") and (pjrt_device() or "TPU") == "TPU"
    if tpu_chips is None and tpu_path:
        tpu_chips = tpu_host.tpu_chip_count()
    if hosts is None:
        hosts = tpu_host.slice_hosts() if tpu_path and tpu_chips else 1
    return local_device_count(device, tpu_chips=tpu_chips) * hosts


def spawned_process() -> bool:
    """Whether this process is one of several that `xmp.spawn` started on this host."""
    return int(os.environ.get(LOCAL_PROCESS_COUNT, "1")) > 1


def debug_env(log_file: str | Path, level: int = 2) -> dict[str, str]:
    """The variables that turn torch_xla's debug output on and send it to `log_file` (read at runtime start)."""
    if level not in DEBUG_LEVELS:
        raise ValueError(f"level={level!r} is not one of {DEBUG_LEVELS} (1: compilations only, 2: also executions)")
    return {DEBUG_LEVEL: str(level), DEBUG_FILE: str(Path(log_file).resolve())}


def dump_dir_flags(path: str | Path, flags: str = "") -> str:
    """`flags` (an XLA_FLAGS value) plus the flag that makes the compiler write its dumps (HLO, memory-usage
    reports) into `path`. XLA_FLAGS is split on whitespace, so a path with spaces is refused."""
    text = os.fspath(path)
    if not text or any(c.isspace() for c in text):
        raise ValueError(f"dump_dir={text!r}: XLA_FLAGS is split on whitespace, so the path must be non-empty and "
                         "contain no spaces")
    return f"{flags} --xla_dump_to={text}".strip()


# XLA:CPU's default scheduler favours concurrency: it runs a checkpointed block's recomputation as early as it can,
# so the recomputed activations live as long as saved ones would and the compiled figure ignores gradient
# checkpointing. The memory-aware scheduler, as a TPU's is, shows the saving: compiled-memory estimates on the CPU
# use it (memory/compiled.py; tests/memory/test_compiled_checkpointing.py checks the saving shows).
CPU_MEMORY_SCHEDULER_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler=false"


def dump_env(path: str | Path, *, pjrt: str = "CPU", environ: Mapping[str, str] | None = None,
             memory_scheduler: bool = False) -> dict[str, str]:
    """A child process's environment (`environ`, by default this one's) with the compiler's dumps going to `path`
    and the runtime on `pjrt`; on a single device (XLA reads the flags once, so only a new process honours them).
    `memory_scheduler` makes XLA:CPU schedule for memory (see CPU_MEMORY_SCHEDULER_FLAG), for memory estimates."""
    base = without_device_count(os.environ if environ is None else environ)
    flags = dump_dir_flags(path, base.get(XLA_FLAGS, ""))
    if memory_scheduler and pjrt == "CPU":
        flags = f"{flags} {CPU_MEMORY_SCHEDULER_FLAG}"
    return {**base, PJRT_DEVICE: pjrt, XLA_FLAGS: flags}


# XLA:CPU JIT-compiles each kernel of a graph with LLVM into three memory mappings (code, constants, data), freed
# when torch_xla's LRU of compiled graphs evicts the graph. The process's mappings are capped by the kernel
# (vm.max_map_count, 65530 by default), and a long process of real models' graphs reaches it before the LRU's 2048
# graphs: LLVM then fails ("LLVM compilation error: Cannot allocate memory", whatever RAM is free) and the next
# graph's run segfaults. Budgeted at 64 mappings a graph (a 1-layer MLP's training step takes 4) after 4096 for the
# process itself (torch_xla's own take ~760), the cache bounds what evicted graphs give back; a model's graph of many
# kernels takes more than 64, so a process that compiles thousands of such graphs needs a higher limit.
MAPPINGS_PER_GRAPH = 64
PROCESS_MAPPINGS = 4096
DEFAULT_CACHE_SIZE = 2048


def xla_cpu_cache_size(max_map_count: int | None = None) -> int:
    """How many compiled graphs XLA:CPU may keep so that their mappings fit the kernel's limit (see above)."""
    if max_map_count is None:
        try:
            max_map_count = int(Path("/proc/sys/vm/max_map_count").read_text())
        except (OSError, ValueError):
            return DEFAULT_CACHE_SIZE  # not Linux, or unreadable: torch_xla's own default
    return max(64, min(DEFAULT_CACHE_SIZE, (max_map_count - PROCESS_MAPPINGS) // MAPPINGS_PER_GRAPH))


def cap_xla_cpu_cache(environ: dict | None = None) -> str | None:
    """On XLA:CPU (PJRT_DEVICE=CPU), set the compiled-graph cache's size to `xla_cpu_cache_size()` unless the user
    set one. Call it before the runtime starts: it reads the variable once, so a later call changes nothing in this
    process (only in the processes it starts). Returns the variable's value, None off XLA:CPU."""
    environ = os.environ if environ is None else environ
    if environ.get(PJRT_DEVICE) != "CPU":
        return None
    return environ.setdefault(COMPILATION_CACHE_SIZE, str(xla_cpu_cache_size()))


def runtime_started() -> bool:
    """Whether this process's XLA runtime has started, after which the variables above are no longer read."""
    import tpu_helpers.backend as backend

    if backend._XLA_BACKEND is not None:
        return True
    if "torch_xla" not in sys.modules:
        return False
    return backend.xla_module().runtime_started()
