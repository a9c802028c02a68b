"""TorchTPU (Google's `torch-tpu`) and Sophgo's same-named `torch_tpu`, from stand-in installs: told apart by their
metadata without importing them; device selection says why neither gives this package a TPU (no TPU here, so a
recorded sysfs tree stands for the chips, and torch_xla is hidden in a fresh process)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.backend.test_tpu_host import gce_gpu_vm, v6e_1
from tests.support import script_result
from tpu_helpers.backend import pair_version, torch_tpu

# What the wheels' METADATA say (Google's: the registry's torch-tpu 0.2.0; Sophgo's: the wheel its README installs).
GOOGLE_METADATA = """Metadata-Version: 2.1
Name: torch-tpu
Version: 0.2.0
Summary: PyTorch on Google TPUs
Home-page: https://github.com/google-pytorch/torch_tpu
License: Apache-2.0
Requires-Python: >=3.11
Requires-Dist: torch>=2.11.0,<=2.15.0
Requires-Dist: libtpu>=0.0.50
"""
SOPHGO_METADATA = """Metadata-Version: 2.1
Name: torch_tpu
Version: 2.1.0.post1
Summary: Torch TPU plugin
Home-page: https://github.com/sophgo/torch-tpu
Author: sophgo
Requires-Dist: torch==2.1.0
"""
UNKNOWN_METADATA = """Metadata-Version: 2.1
Name: torch-tpu
Version: 0.2.0
Summary: a package that happens to use the name
"""
IMPORT_TRAP = 'raise RuntimeError("the stand-in torch_tpu was imported")\n'


def fake_torch_tpu(root: Path, metadata: str | None) -> Path:
    """A site directory holding a `torch_tpu` package that fails if imported, and (unless `metadata` is None) its
    dist-info with `metadata`, as pip installs a wheel."""
    (root / "torch_tpu").mkdir(parents=True)
    (root / "torch_tpu" / "__init__.py").write_text(IMPORT_TRAP)
    if metadata is not None:
        version = next(line.split(": ", 1)[1] for line in metadata.splitlines() if line.startswith("Version:"))
        info = root / f"torch_tpu-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(metadata)
    return root


def test_google_sophgo_and_unknown_torch_tpu_are_told_apart_by_their_metadata_without_an_import(tmp_path):
    google = torch_tpu.installed([str(fake_torch_tpu(tmp_path / "g", GOOGLE_METADATA))])
    assert (google.vendor, google.version, google.torch_requirement) == ("google", "0.2.0", "torch>=2.11.0,<=2.15.0")
    assert google.describe() == "TorchTPU 0.2.0 (Google's torch-tpu, github.com/google-pytorch/torch_tpu)"
    assert "runs nothing on TorchTPU yet" in google.support()

    sophgo = torch_tpu.installed([str(fake_torch_tpu(tmp_path / "s", SOPHGO_METADATA))])
    assert (sophgo.vendor, sophgo.version) == ("sophgo", "2.1.0.post1") and not sophgo.is_google
    assert sophgo.describe().startswith("Sophgo's torch_tpu 2.1.0.post1 (PyTorch on Sophgo's chips")
    assert "not Google's TorchTPU" in sophgo.describe() and "TorchTPU 2.1" not in sophgo.describe()

    # The same name and version as Google's, but no google-pytorch URL: not taken for Google's.
    unknown = torch_tpu.installed([str(fake_torch_tpu(tmp_path / "u", UNKNOWN_METADATA))])
    assert (unknown.vendor, unknown.version) == ("unknown", "0.2.0")
    assert "not known to be Google's TorchTPU" in unknown.describe()
    bare = torch_tpu.installed([str(fake_torch_tpu(tmp_path / "b", None))])  # importable, no metadata
    assert (bare.vendor, bare.version) == ("unknown", None)

    assert torch_tpu.installed([str(tmp_path / "empty")]) is None
    assert "torch_tpu" not in sys.modules


def test_the_default_path_is_sys_path(tmp_path, monkeypatch):
    assert torch_tpu.installed() is None  # the dev venv has none
    monkeypatch.syspath_prepend(str(fake_torch_tpu(tmp_path, GOOGLE_METADATA)))
    assert torch_tpu.installed().is_google and "torch_tpu" not in sys.modules


def test_the_pair_to_install_is_the_newest_torch_xla_for_a_newer_torch():
    assert pair_version("2.8.0+cu128") == "2.8.0" and pair_version("2.9.0") == "2.9.0"
    assert pair_version("2.11.0") == "2.9.0" and pair_version("2.10.0.dev20251101") == "2.9.0"
    assert pair_version(None) == "2.9.0"


def _calls(tmp_path: Path, metadata: str | None, sysfs: Path, calls: list, torch: str = "2.11.0",
           torch_xla: str = "absent") -> list[dict]:
    """What get_backend did for each of `calls` in a process without torch_xla (or, "broken", with one that fails
    to import), on the host `sysfs` records, with a stand-in torch_tpu of `metadata` on the path (None: no torch_tpu
    at all) and torch claiming `torch`."""
    site = fake_torch_tpu(tmp_path / "site", metadata) if metadata is not None else tmp_path / "site"
    site.mkdir(parents=True, exist_ok=True)
    out = script_result("backend_in_a_process", {"case": "torch_tpu", "sysfs": str(sysfs), "torch": torch,
                                                 "calls": calls, "torch_xla": torch_xla},
                        env={"PYTHONPATH": f"{Path(__file__).resolve().parents[2]}:{site}"})
    assert out["imported_torch_tpu"] is False
    return out["calls"]


PAIR_LINE = "pip install 'torch==2.9.0' 'torch_xla[tpu]==2.9.0'"


@pytest.mark.slow
def test_a_tpu_host_with_torchtpu_and_no_torch_xla_says_so_for_tpu_and_auto(tmp_path):
    tpu, tpu_fallback, auto = _calls(tmp_path, GOOGLE_METADATA, v6e_1(tmp_path / "sys"),
                                     [["tpu", False], ["tpu", True], ["auto", False]])
    err = tpu["error"]
    assert err.startswith("device='tpu' cannot be used: torch_xla is not installed; TorchTPU 0.2.0 (Google's "
                          "torch-tpu, github.com/google-pytorch/torch_tpu) is installed, but tpu_helpers runs nothing "
                          "on TorchTPU yet (it drives TPUs through torch_xla; torch-tpu needs torch>=2.11.0,<=2.15.0)")
    assert f"environment of its own (a new virtualenv or runtime): {PAIR_LINE}" in err
    assert "torch_xla[tpu]==2.11" not in err and err.endswith("or device='auto'.")
    # fallback=True: a warning with the same reason, then the next device
    assert tpu_fallback["backend"] == "cpu" and len(tpu_fallback["warnings"]) == 1
    assert tpu_fallback["warnings"][0].startswith("device='tpu' is not available (torch_xla is not installed; "
                                                  "TorchTPU 0.2.0")
    assert tpu_fallback["warnings"][0].endswith("falling back to 'cpu'")
    # auto: the CPU, but not without a word
    assert auto["backend"] == "cpu" and len(auto["warnings"]) == 1
    warning = auto["warnings"][0]
    assert warning.startswith("device='auto': 1 TPU chip(s) are attached but cannot be used: torch_xla is not "
                              "installed; TorchTPU 0.2.0")
    assert PAIR_LINE in warning and warning.endswith("Running on 'cpu' instead.")


@pytest.mark.slow
def test_sophgos_torch_tpu_is_named_as_sophgos_and_without_chips_auto_stays_quiet(tmp_path):
    (tpu,) = _calls(tmp_path / "sophgo", SOPHGO_METADATA, v6e_1(tmp_path / "sys"), [["tpu", False]])
    assert tpu["error"].startswith("device='tpu' cannot be used: torch_xla is not installed; the torch_tpu installed "
                                   "is Sophgo's torch_tpu 2.1.0.post1 (PyTorch on Sophgo's chips, "
                                   "https://github.com/sophgo/torch-tpu), not Google's TorchTPU: tpu_helpers does not "
                                   "use it")
    assert "TorchTPU 2.1" not in tpu["error"] and PAIR_LINE in tpu["error"]
    # No TPU chips (a GPU VM's gVNIC card is no TPU): auto runs on the CPU quietly, as without TorchTPU.
    auto, tpu = _calls(tmp_path / "google", GOOGLE_METADATA, gce_gpu_vm(tmp_path / "gce"),
                       [["auto", False], ["tpu", False]])
    assert auto == {"backend": "cpu", "warnings": []}
    assert tpu["error"].startswith("device='tpu' cannot be used: no TPU chips are attached")


@pytest.mark.slow
def test_a_tpu_host_with_neither_torch_xla_nor_torch_tpu_warns_on_auto_and_a_host_without_chips_does_not(tmp_path):
    # The chips are there, nothing can drive them: "auto" says so before it trains on the CPU.
    auto, tpu = _calls(tmp_path / "chips", None, v6e_1(tmp_path / "sys"), [["auto", False], ["tpu", False]],
                       torch="2.9.0")
    assert auto["backend"] == "cpu" and len(auto["warnings"]) == 1
    assert auto["warnings"][0] == (
        "device='auto': 1 TPU chip(s) are attached but cannot be used: torch_xla is not installed; install the "
        f"torch_xla that matches torch 2.9.0: {PAIR_LINE} (see requirements-tpuvm.txt / requirements-colab.txt). "
        "Running on 'cpu' instead.")
    assert tpu["error"].startswith("device='tpu' cannot be used: torch_xla is not installed; install the torch_xla")
    # A newer torch: the same warning, with the pair that exists, in an environment of its own.
    (auto,) = _calls(tmp_path / "newer", None, v6e_1(tmp_path / "sys2"), [["auto", False]])
    assert len(auto["warnings"]) == 1 and "no torch_xla release matches torch 2.11.0" in auto["warnings"][0]
    assert PAIR_LINE in auto["warnings"][0] and auto["warnings"][0].endswith("Running on 'cpu' instead.")
    # No chips (a GPU VM): "auto" runs on the CPU without a word, as it always did.
    (auto,) = _calls(tmp_path / "gce", None, gce_gpu_vm(tmp_path / "gce_sys"), [["auto", False]], torch="2.9.0")
    assert auto == {"backend": "cpu", "warnings": []}


@pytest.mark.slow
def test_a_tpu_host_whose_torch_xla_fails_to_import_warns_on_auto(tmp_path):
    (auto,) = _calls(tmp_path, None, v6e_1(tmp_path / "sys"), [["auto", False]], torch="2.9.0", torch_xla="broken")
    assert auto["backend"] == "cpu" and len(auto["warnings"]) == 1, auto
    assert auto["warnings"][0].startswith("device='auto': 1 TPU chip(s) are attached but cannot be used: torch_xla "
                                          "2.9.0 failed to import"), auto
