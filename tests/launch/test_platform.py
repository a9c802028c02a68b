"""Platform helpers: the torch/torch_xla pair check, installing only what is missing, Drive outside Colab, PJRT."""

from __future__ import annotations

import os

import pytest

from tpu_helpers.launch import platform
from tpu_helpers.launch.platform import PlatformError, TorchXlaPair


def test_pair_check_reports_this_environment_and_the_fix_for_broken_pairs():
    pair = platform.check_torch_xla()
    assert pair.ok and pair.fix is None and str(pair).endswith(": ok")  # CI installs torch 2.9.0 + torch_xla 2.9.0
    missing = TorchXlaPair("2.9.0+cu128", None)
    assert not missing.ok
    assert "torch_xla is not installed" in missing.fix and "pip install 'torch==2.9.0' 'torch_xla[tpu]==2.9.0'" in missing.fix
    mismatch = TorchXlaPair("2.8.0", "2.9.0")
    assert "torch 2.8.0 and torch_xla 2.9.0 differ" in mismatch.fix and "'torch==2.8.0'" in mismatch.fix


def test_install_missing_is_a_no_op_when_everything_is_there_and_never_touches_torch(tmp_path):
    assert platform.install_missing() == []  # the package's requirements-colab.txt, all present in CI
    reqs = tmp_path / "requirements.txt"
    reqs.write_text("# comment\npytest>=1\ntorch==0.0.1\ntorch_xla[tpu]==0.0.1\n-f https://example.invalid\n"
                    "surely-absent-package-th3>=1\npytest<1\n")
    assert platform.missing_requirements(reqs) == ["surely-absent-package-th3>=1", "pytest<1"]
    assert platform.install_missing(reqs, dry_run=True) == ["surely-absent-package-th3>=1", "pytest<1"]
    (tmp_path / "bad.txt").write_text("ok-name\nnot a requirement !!\n")
    with pytest.raises(ValueError, match=r"bad.txt:2: cannot parse requirement 'not a requirement !!'"):
        platform.missing_requirements(tmp_path / "bad.txt")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        platform.install_missing(tmp_path / "nope.txt")


def test_drive_outside_colab_is_a_clear_error_and_local_storage_is_unchanged(monkeypatch):
    monkeypatch.delenv("COLAB_RELEASE_TAG", raising=False)
    assert not platform.in_colab()
    with pytest.raises(PlatformError, match="MOUNT_DRIVE=True needs Google Colab"):
        platform.mount_drive()
    with pytest.raises(PlatformError, match="needs Google Colab"):
        platform.storage("runs/x", drive=True)
    assert platform.storage("runs/x") == ("runs/x", None)
    assert platform.storage("runs/x", compile_cache="/tmp/cache") == ("runs/x", "/tmp/cache")


def test_setup_pjrt_keeps_an_exported_device():
    env = platform.setup_pjrt("xla")
    assert env["PJRT_DEVICE"] == os.environ["PJRT_DEVICE"] == "CPU"
    assert "PJRT_DEVICE" in platform.setup_pjrt("cpu")
