"""Tests for tpu_helpers.core.hardware: catalog figures, name lookup, device detection, byte formatting."""

from __future__ import annotations

import dataclasses
import math

import pytest

from tpu_helpers.core.hardware import (
    CATALOG,
    GB,
    GiB,
    HardwareSpec,
    detect_cpu,
    detect_gpu,
    detect_tpu,
    format_bytes,
    lookup,
)

EXPECTED_KEYS = {"v2", "v3", "v4", "v5e", "v5p", "v6e", "v7x", "t4", "l4", "a100-40gb", "a100-80gb", "h100",
                 "h200", "cpu"}


def test_catalog_has_every_chip():
    assert set(CATALOG) == EXPECTED_KEYS


@pytest.mark.parametrize("key", sorted(EXPECTED_KEYS))
def test_catalog_figures_are_positive(key):
    spec = CATALOG[key]
    assert spec.kind in ("tpu", "gpu", "cpu")
    assert spec.hbm_bytes > 0 and isinstance(spec.hbm_bytes, int)
    assert spec.bf16_tflops is not None and spec.bf16_tflops > 0 and math.isfinite(spec.bf16_tflops)
    assert spec.hbm_gbps is not None and spec.hbm_gbps > 0
    assert spec.chips_per_host >= 1
    assert spec.devices_per_chip == (2 if key in ("v2", "v3") else 1)
    assert spec.price_per_chip_hour is None or spec.price_per_chip_hour > 0
    assert spec.known
    line = spec.describe()
    assert spec.name in line and "\n" not in line


# Transcribed by hand from shared/reference/hardware.md (not computed from the catalog): chip -> (HBM bytes as the
# table writes it, dense bf16 TFLOP/s, HBM GB/s, price per chip-hour or None). "~" figures of the table are kept
# as written; a catalog edit that drifts from the reference fails here.
REFERENCE = {
    "v2": (16 * 2**30, 45, 600, None),
    "v3": (32 * 2**30, 123, 900, None),
    "v4": (32 * 2**30, 275, 1200, 3.22),
    "v5e": (16 * 10**9, 197, 819, 1.20),
    "v5p": (95 * 2**30, 459, 2765, 4.20),
    "v6e": (32 * 10**9, 918, 1638, 2.70),
    "v7x": (192 * 2**30, 2307, 7200, None),
    "t4": (16 * 10**9, 65, 320, None),
    "l4": (24 * 10**9, 121, 300, None),
    "a100-40gb": (40 * 10**9, 312, 1555, 2.74),
    "a100-80gb": (80 * 10**9, 312, 2039, 3.43),
    "h100": (80 * 10**9, 989, 3350, 6.88),
    "h200": (141 * 10**9, 989, 4800, None),
}


@pytest.mark.parametrize("key", sorted(REFERENCE))
def test_catalog_figures_match_the_reference_notes(key):
    spec = CATALOG[key]
    assert (spec.hbm_bytes, spec.bf16_tflops, spec.hbm_gbps, spec.price_per_chip_hour) == REFERENCE[key]


def test_hosts_and_dtypes_match_the_reference_notes():
    # "v5e and v6e: ... up to 8 chips per host"; "v2 and v3: 2 cores per chip"; "T4 ... no bf16 tensor cores".
    assert (CATALOG["v5e"].chips_per_host, CATALOG["v6e"].chips_per_host) == (8, 8)
    assert [CATALOG[k].devices_per_chip for k in ("v2", "v3", "v4", "v5e", "v5p", "v6e")] == [2, 2, 1, 1, 1, 1]
    assert not CATALOG["t4"].bf16_supported and CATALOG["l4"].bf16_supported


def test_spec_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        CATALOG["v5e"].hbm_bytes = 1  # type: ignore[misc]


@pytest.mark.parametrize(
    ("name", "key"),
    [
        ("v5e", "v5e"), ("V5E", "v5e"), ("v5litepod", "v5e"), ("TPU v5 lite", "v5e"), ("tpu_v5e", "v5e"),
        ("v5litepod-8", "v5e"), ("v5e-1", "v5e"), ("v3-8", "v3"), ("v2", "v2"), ("TPU v4", "v4"),
        ("v5p", "v5p"), ("v6e", "v6e"), ("Trillium", "v6e"), ("ironwood", "v7x"), ("TPU7x", "v7x"),
        ("h100", "h100"), ("NVIDIA H100 80GB HBM3", "h100"), ("A100-SXM4-80GB", "a100-80gb"),
        ("a100-40gb", "a100-40gb"), ("NVIDIA A100-PCIE-40GB", "a100-40gb"), ("Tesla T4", "t4"),
        ("t4", "t4"), ("L4", "l4"), ("H200", "h200"), ("cpu", "cpu"), ("  NVIDIA L4  ", "l4"),
    ],
)
def test_lookup_aliases(name, key):
    assert lookup(name) is CATALOG[key]


@pytest.mark.parametrize("key", sorted(EXPECTED_KEYS))
def test_every_alias_resolves_to_its_entry(key):
    spec = CATALOG[key]
    for alias in (key, spec.name, *spec.aliases):
        assert lookup(alias) is spec, alias
        assert lookup(alias.upper()) is spec, alias


@pytest.mark.parametrize("name", ["v9", "rtx 4090", "", "h1000"])
def test_lookup_unknown_lists_known_names(name):
    with pytest.raises(ValueError, match=r"unknown hardware .*known names: .*v5e.*v6e.*h100.*cpu"):
        lookup(name)


@pytest.mark.parametrize(
    ("kind", "key"),
    [
        ("TPU v5 lite", "v5e"), ("TPU v5e", "v5e"), ("TPU v6 lite", "v6e"), ("TPU v6e", "v6e"),
        ("TPU v4", "v4"), ("TPU v5", "v5p"), ("TPU v5p", "v5p"), ("TPU v3", "v3"), ("TPU v2", "v2"),
        ("TPU7x", "v7x"), ("tpu v5 lite ", "v5e"),
    ],
)
def test_detect_tpu(kind, key):
    assert detect_tpu(kind) is CATALOG[key]


def test_detect_tpu_measured_memory_and_unknown():
    measured = detect_tpu("TPU v5 lite", hbm_bytes=15 * GiB)
    assert measured.hbm_bytes == 15 * GiB and measured.bf16_tflops == 197 and measured.name == "TPU v5e"
    unknown = detect_tpu("TPU v4 lite", hbm_bytes=8 * GiB)
    assert (unknown.name, unknown.kind, unknown.hbm_bytes) == ("TPU v4 lite", "tpu", 8 * GiB)
    assert unknown.bf16_tflops is None and unknown.hbm_gbps is None and not unknown.known
    assert detect_tpu("TPU v99").hbm_bytes == 0


@pytest.mark.parametrize(
    ("name", "memory", "key"),
    [
        ("Tesla T4", None, "t4"),
        ("NVIDIA L4", None, "l4"),
        ("NVIDIA A100-SXM4-40GB", None, "a100-40gb"),
        ("NVIDIA A100-PCIE-40GB", None, "a100-40gb"),
        ("NVIDIA A100-SXM4-80GB", None, "a100-80gb"),
        ("NVIDIA A100 80GB PCIe", None, "a100-80gb"),
        ("NVIDIA A100", None, "a100-40gb"),
        ("NVIDIA H100 80GB HBM3", None, "h100"),
        ("NVIDIA H100 PCIe", None, "h100"),
        ("NVIDIA H200", None, "h200"),
    ],
)
def test_detect_gpu(name, memory, key):
    assert detect_gpu(name, memory) is CATALOG[key]


def test_detect_gpu_ambiguous_a100_by_memory():
    # What torch.cuda.get_device_properties reports (a bit under the label, in binary units).
    big = detect_gpu("NVIDIA A100-SXM4", 85_100_000_000)
    small = detect_gpu("NVIDIA A100-SXM4", 42_300_000_000)
    assert big.name == "NVIDIA A100 80GB" and big.hbm_gbps == 2039 and big.hbm_bytes == 85_100_000_000
    assert small.name == "NVIDIA A100 40GB" and small.hbm_gbps == 1555


def test_detect_gpu_unknown_keeps_what_is_known():
    spec = detect_gpu("NVIDIA GeForce RTX 4090", 24 * GB)
    assert (spec.name, spec.kind, spec.hbm_bytes) == ("NVIDIA GeForce RTX 4090", "gpu", 24 * GB)
    assert spec.bf16_tflops is None and spec.hbm_gbps is None and spec.price_per_chip_hour is None
    assert "?" in spec.describe()
    assert detect_gpu("NVIDIA L40S").bf16_tflops is None, "L40S is not an L4"


def test_detect_cpu():
    spec = detect_cpu()
    assert spec.kind == "cpu" and spec.hbm_bytes > 0 and isinstance(spec, HardwareSpec)


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0 B"), (512, "512 B"), (1023, "1023 B"), (1024, "1.0 KiB"), (1536, "1.5 KiB"),
        (1048575, "1.0 MiB"), (33_600_000_000, "31.3 GiB"), (16 * GiB, "16.0 GiB"), (16 * GB, "14.9 GiB"),
        (3 * 2**40, "3.0 TiB"), (5 * 2**50, "5120.0 TiB"), (-2 * GiB, "-2.0 GiB"), (2.5 * 2**20, "2.5 MiB"),
    ],
)
def test_format_bytes(n, text):
    assert format_bytes(n) == text
