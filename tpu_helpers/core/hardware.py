"""Catalog of accelerators: memory, peak bf16 FLOP/s, bandwidth and price per chip.

The memory estimator, the widgets, and MFU / cost reports read it::

    from tpu_helpers.core.hardware import lookup, detect_tpu, detect_gpu, format_bytes
    spec = lookup("v5e")                       # names and aliases, case-insensitive
    spec = detect_tpu("TPU v5 lite")           # a torch_xla / PJRT device kind
    spec = detect_gpu(torch.cuda.get_device_name(), torch.cuda.get_device_properties(0).total_memory)
    print(spec.describe(), format_bytes(spec.hbm_bytes))

Figures are per chip and dense bf16, memory in bytes exactly as the vendor lists it; prices are estimates that users
may override. Unknown hardware never fails detection: ``bf16_tflops`` / ``hbm_gbps`` are then ``None``, which code
computing MFU must check. Where the figures come from, and measured memory: docs/guides/devices.md.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from typing import Literal

GiB = 2**30
GB = 10**9

Kind = Literal["tpu", "gpu", "cpu"]


@dataclass(frozen=True)
class HardwareSpec:
    """One accelerator chip.

    ``bf16_tflops`` and ``hbm_gbps`` are ``None`` for hardware not in the catalog. ``hbm_bytes`` is 0 when
    unknown. ``devices_per_chip`` is how many torch_xla devices one chip shows up as (2 on TPU v2/v3).
    ``chips_per_host`` is the usual maximum per host / VM. ``price_per_chip_hour`` is an estimate or None.
    """

    name: str
    kind: Kind
    hbm_bytes: int
    bf16_tflops: float | None
    hbm_gbps: float | None
    chips_per_host: int
    devices_per_chip: int
    price_per_chip_hour: float | None
    bf16_supported: bool
    aliases: tuple[str, ...] = ()

    @property
    def known(self) -> bool:
        """True for catalog entries (peak FLOP/s known, so MFU can be computed)."""
        return self.bf16_tflops is not None

    def describe(self) -> str:
        """One line, e.g. ``TPU v5e (tpu): 14.9 GiB HBM, 197 bf16 TFLOP/s, 819 GB/s, ~$1.20/chip-h``."""
        mem = format_bytes(self.hbm_bytes) if self.hbm_bytes else "?"
        mem += " RAM" if self.kind == "cpu" else " HBM"
        tflops = f"{self.bf16_tflops:g}" if self.bf16_tflops is not None else "?"
        gbps = f"{self.hbm_gbps:g}" if self.hbm_gbps is not None else "?"
        price = "price n/a"
        if self.price_per_chip_hour is not None:
            price = f"~${self.price_per_chip_hour:.2f}/chip-h"
        extra = "" if self.bf16_supported else ", no bf16 (use fp16)"
        return f"{self.name} ({self.kind}): {mem}, {tflops} bf16 TFLOP/s, {gbps} GB/s, {price}{extra}"


def _tpu(name: str, hbm: int, tflops: float, gbps: float, chips: int, devs: int, price: float | None,
         *aliases: str) -> HardwareSpec:
    return HardwareSpec(name, "tpu", hbm, tflops, gbps, chips, devs, price, True, aliases)


def _gpu(name: str, hbm: int, tflops: float, gbps: float, chips: int, price: float | None,
         *aliases: str, bf16: bool = True) -> HardwareSpec:
    return HardwareSpec(name, "gpu", hbm, tflops, gbps, chips, 1, price, bf16, aliases)


CATALOG: dict[str, HardwareSpec] = {
    "v2": _tpu("TPU v2", 16 * GiB, 45.0, 600.0, 4, 2, None, "tpu v2", "tpuv2"),
    "v3": _tpu("TPU v3", 32 * GiB, 123.0, 900.0, 4, 2, None, "tpu v3", "tpuv3"),
    "v4": _tpu("TPU v4", 32 * GiB, 275.0, 1200.0, 4, 1, 3.22, "tpu v4", "tpuv4"),
    "v5e": _tpu("TPU v5e", 16 * GB, 197.0, 819.0, 8, 1, 1.20,
                "tpu v5e", "v5litepod", "v5 lite", "tpu v5 lite", "tpu v5 litepod", "v5lite"),
    "v5p": _tpu("TPU v5p", 95 * GiB, 459.0, 2765.0, 4, 1, 4.20, "tpu v5p", "tpu v5", "v5"),
    "v6e": _tpu("TPU v6e", 32 * GB, 918.0, 1638.0, 8, 1, 2.70,
                "tpu v6e", "trillium", "tpu v6 lite", "v6 lite", "v6", "tpu v6"),
    "v7x": _tpu("TPU7x", 192 * GiB, 2307.0, 7200.0, 4, 1, None,
                "tpu7x", "tpu v7x", "tpu v7", "v7", "ironwood", "tpu7"),
    # T4 has no bf16 tensor cores; its figure is the fp16 tensor-core peak, the dtype to train in there.
    "t4": _gpu("NVIDIA T4", 16 * GB, 65.0, 320.0, 4, None, "tesla t4", "nvidia t4", bf16=False),
    "l4": _gpu("NVIDIA L4", 24 * GB, 121.0, 300.0, 8, None, "nvidia l4"),
    "a100-40gb": _gpu("NVIDIA A100 40GB", 40 * GB, 312.0, 1555.0, 8, 2.74,
                      "a100", "a100 40gb", "nvidia a100 40gb", "a100-sxm4-40gb", "a100-pcie-40gb",
                      "nvidia a100-sxm4-40gb", "nvidia a100-pcie-40gb"),
    "a100-80gb": _gpu("NVIDIA A100 80GB", 80 * GB, 312.0, 2039.0, 8, 3.43,
                      "a100 80gb", "nvidia a100 80gb", "a100-sxm4-80gb", "nvidia a100-sxm4-80gb",
                      "a100 80gb pcie", "nvidia a100 80gb pcie"),
    "h100": _gpu("NVIDIA H100", 80 * GB, 989.0, 3350.0, 8, 6.88,
                 "h100 sxm", "nvidia h100", "nvidia h100 80gb hbm3", "h100 80gb hbm3"),
    "h200": _gpu("NVIDIA H200", 141 * GB, 989.0, 4800.0, 8, None, "nvidia h200"),
    # A nominal CPU so that code paths needing a spec work on a laptop; only its kind is meaningful.
    "cpu": HardwareSpec("CPU", "cpu", 16 * GiB, 1.0, 50.0, 1, 1, None, True, ("host", "generic cpu")),
}


def _norm(name: str) -> str:
    # Case, spaces, dashes and underscores vary between torch, PJRT, gcloud and people; ignore them.
    return re.sub(r"[\s_\-]+", " ", name.strip().lower())


_ALIASES: dict[str, str] = {}
for _key, _spec in CATALOG.items():
    for _alias in (_key, _spec.name, *_spec.aliases):
        _ALIASES[_norm(_alias)] = _key


def known_names() -> list[str]:
    """Catalog keys, the names :func:`lookup` lists in its errors."""
    return list(CATALOG)


def _match_gpu(name: str, total_memory_bytes: int | None) -> str | None:
    """Catalog key for a GPU name such as ``NVIDIA A100-SXM4-80GB`` or ``NVIDIA H100 PCIe``."""
    n = _norm(name)
    for key, pattern in (("h200", r"\bh200\b"), ("h100", r"\bh100\b"), ("l4", r"\bl4\b"), ("t4", r"\bt4\b")):
        if re.search(pattern, n):
            return key
    if re.search(r"\ba100\b", n):
        if re.search(r"\b80 ?gb\b", n):
            return "a100-80gb"
        if re.search(r"\b40 ?gb\b", n):
            return "a100-40gb"
        # Drivers report a bit less than the label (an 80GB card shows ~79 GiB), so split in the middle.
        if total_memory_bytes is not None and total_memory_bytes > 60 * GB:
            return "a100-80gb"
        return "a100-40gb"
    return None


def lookup(name: str) -> HardwareSpec:
    """Catalog entry for a name or alias (case-insensitive); also accepts slice names like ``v5e-8``."""
    n = _norm(name)
    if n in _ALIASES:
        return CATALOG[_ALIASES[n]]
    # A slice name ("v5litepod-8", "v3-8") means the chip it is made of.
    base = re.sub(r" \d+$", "", n)
    if base != n and base in _ALIASES and CATALOG[_ALIASES[base]].kind == "tpu":
        return CATALOG[_ALIASES[base]]
    gpu = _match_gpu(name, None)
    if gpu is not None:
        return CATALOG[gpu]
    raise ValueError(f"unknown hardware {name!r}; known names: {', '.join(known_names())}")


# PJRT device kinds. "TPU v5" is v5p, "TPU v5 lite" is v5e, "TPU v6 lite" is v6e.
_TPU_KINDS: dict[str, str] = {
    "tpu v2": "v2", "tpu v3": "v3", "tpu v4": "v4",
    "tpu v5 lite": "v5e", "tpu v5e": "v5e", "tpu v5litepod": "v5e",
    "tpu v5": "v5p", "tpu v5p": "v5p",
    "tpu v6 lite": "v6e", "tpu v6e": "v6e", "tpu v6": "v6e",
    "tpu7x": "v7x", "tpu v7x": "v7x", "tpu7": "v7x", "tpu v7": "v7x",
}


def _with_memory(spec: HardwareSpec, hbm_bytes: int | None) -> HardwareSpec:
    # A measured figure beats the label: drivers report what is really usable (an "80GB" H100 shows
    # ~79.6 GiB, more than 80e9 bytes; a TPU's bytes_limit is less than its HBM).
    return spec if not hbm_bytes else dataclasses.replace(spec, hbm_bytes=hbm_bytes)


def _unknown(name: str, kind: Kind, hbm_bytes: int | None) -> HardwareSpec:
    return HardwareSpec(name, kind, hbm_bytes or 0, None, None, 1, 1, None, True, ())


def detect_tpu(device_kind: str, hbm_bytes: int | None = None) -> HardwareSpec:
    """Spec for a torch_xla / PJRT device kind (``"TPU v5 lite"``, ``"TPU v6e"``, ``"TPU7x"``, ...).

    ``hbm_bytes`` (e.g. ``bytes_limit`` from ``xm.get_memory_info``), when given, replaces the catalog's
    memory figure. An unknown kind (e.g. ``"TPU v4 lite"``) gives a spec with that name, ``hbm_bytes`` (0
    if not given) and ``None`` peak figures, rather than an error.
    """
    n = _norm(device_kind)
    key = _TPU_KINDS.get(n) or _TPU_KINDS.get(re.sub(r"^v", "tpu v", n))
    if key is not None:
        return _with_memory(CATALOG[key], hbm_bytes)
    return _unknown(device_kind.strip() or "unknown TPU", "tpu", hbm_bytes)


def detect_gpu(device_name: str, total_memory_bytes: int | None = None) -> HardwareSpec:
    """Spec for a ``torch.cuda.get_device_name()`` string.

    ``total_memory_bytes`` (``torch.cuda.get_device_properties(i).total_memory``) tells an A100 40GB from
    an 80GB when the name does not say and, when given, replaces the catalog's memory figure (also for an
    unknown GPU, whose spec otherwise has ``None`` peak figures).
    """
    key = _match_gpu(device_name, total_memory_bytes)
    if key is not None:
        return _with_memory(CATALOG[key], total_memory_bytes)
    return _unknown(device_name.strip() or "unknown GPU", "gpu", total_memory_bytes)


def detect_cpu() -> HardwareSpec:
    """The generic CPU entry with this host's physical memory, when the OS reports it."""
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return CATALOG["cpu"]
    return dataclasses.replace(CATALOG["cpu"], hbm_bytes=mem)


def format_bytes(n: float) -> str:
    """Binary units with one decimal: ``format_bytes(33_600_000_000) == "31.3 GiB"``; bytes stay whole."""
    sign = "-" if n < 0 else ""
    value = float(abs(n))
    if value < 1024:
        return f"{sign}{int(value)} B"
    units = ("KiB", "MiB", "GiB", "TiB")
    i = 0
    value /= 1024
    # Compare the rounded figure so 1048575 bytes reads "1.0 MiB", not "1024.0 KiB".
    while round(value, 1) >= 1024 and i < len(units) - 1:
        value /= 1024
        i += 1
    return f"{sign}{value:.1f} {units[i]}"
