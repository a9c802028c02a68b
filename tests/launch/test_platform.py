"""Platform helpers: the torch/torch_xla pair check, installing only what is missing (never running pip here),
Drive outside Colab, Kaggle's paths, and the PJRT environment setup_pjrt leaves for the runtime."""

from __future__ import annotations

import os

import pytest
from packaging.requirements import Requirement

from tests.support import XLA_BACKEND, script_result
from tpu_helpers import platform
from tpu_helpers.backend import tpu_host
from tpu_helpers.platform import PlatformError, TorchXlaPair


class RecordingInstaller:
    """Stands in for pip: records what it was asked to install."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []

    def __call__(self, requirements) -> None:
        self.calls.append(list(requirements))


def test_pair_check_reports_this_environment_and_the_fix_for_broken_pairs():
    pair = platform.check_torch_xla()
    assert pair.ok and pair.fix is None and str(pair).endswith(": ok")  # CI installs torch 2.9.0 + torch_xla 2.9.0
    missing = TorchXlaPair("2.9.0+cu128", None)
    assert not missing.ok
    assert "torch_xla is not installed" in missing.fix and "pip install 'torch==2.9.0' 'torch_xla[tpu]==2.9.0'" in missing.fix
    mismatch = TorchXlaPair("2.8.0", "2.9.0")
    assert "torch 2.8.0 and torch_xla 2.9.0 differ" in mismatch.fix and "'torch==2.8.0'" in mismatch.fix


def test_the_pairs_fix_for_a_torch_newer_than_any_torch_xla_installs_the_newest_pair_apart():
    # TorchTPU's torch 2.11 (or Colab's GPU runtime's): there is no torch_xla 2.11, so the fix names the pair that
    # exists, in an environment of its own, as the backend and the doctor do (backend.pair_version decides).
    newer = TorchXlaPair("2.11.0+cu128", None)
    assert "pip install 'torch==2.9.0' 'torch_xla[tpu]==2.9.0'" in newer.fix and "2.11.0'" not in newer.fix
    assert "No torch_xla release matches torch 2.11.0:" in newer.fix and "environment of its own" in newer.fix
    assert "pip install 'torch==2.9.0' 'torch_xla[tpu]==2.9.0'" in TorchXlaPair(None, None).fix
    same = TorchXlaPair("2.8.0", None)  # a torch that has its torch_xla: the same version, in place
    assert "pip install 'torch==2.8.0' 'torch_xla[tpu]==2.8.0'" in same.fix and "of its own" not in same.fix


def test_installed_version_reads_metadata_and_is_the_doctors_default():
    from tpu_helpers.launch.doctor import Host

    assert platform.installed_version("torch") == platform.check_torch_xla().torch
    assert platform.installed_version("no-such-distribution-tpu-helpers") is None
    # One helper: the doctor looks versions up through the platform module's, not a copy of its own.
    assert Host().version is platform.installed_version


def test_install_missing_installs_only_what_is_absent_through_the_installer_and_never_torch(tmp_path):
    pip = RecordingInstaller()
    assert platform.install_missing(installer=pip) == [] and pip.calls == []  # the package's list, all present
    assert platform.colab_requirements().is_file()  # shipped inside the package, not read from a checkout
    reqs = tmp_path / "requirements.txt"
    reqs.write_text("# comment\npytest>=1\ntorch==0.0.1\ntorch_xla[tpu]==0.0.1\n-f https://example.invalid\n"
                    "surely-absent-package-th3>=1\npytest<1\n")
    assert platform.missing_requirements(reqs) == ["surely-absent-package-th3>=1", "pytest<1"]
    assert platform.install_missing(reqs, dry_run=True, installer=pip) == ["surely-absent-package-th3>=1", "pytest<1"]
    assert pip.calls == []  # dry run
    assert platform.install_missing(reqs, installer=pip) == ["surely-absent-package-th3>=1", "pytest<1"]
    assert pip.calls == [["surely-absent-package-th3>=1", "pytest<1"]]
    (tmp_path / "bad.txt").write_text("ok-name\nnot a requirement !!\n")
    with pytest.raises(ValueError, match=r"bad.txt:2: cannot parse requirement 'not a requirement !!'"):
        platform.missing_requirements(tmp_path / "bad.txt")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        platform.install_missing(tmp_path / "nope.txt", installer=pip)


def test_drive_outside_colab_is_a_clear_error_and_local_storage_is_unchanged(monkeypatch):
    monkeypatch.delenv("COLAB_RELEASE_TAG", raising=False)
    assert not platform.in_colab()
    with pytest.raises(PlatformError, match="MOUNT_DRIVE=True needs Google Colab"):
        platform.mount_drive()
    with pytest.raises(PlatformError, match="needs Google Colab"):
        platform.storage("runs/x", drive=True)
    assert platform.storage("runs/x") == ("runs/x", None)
    assert platform.storage("runs/x", compile_cache="/tmp/cache") == ("runs/x", "/tmp/cache")


def test_kaggle_is_detected_and_runs_land_in_its_working_directory(tmp_path, monkeypatch):
    assert platform.in_kaggle({"KAGGLE_KERNEL_RUN_TYPE": "Interactive"}, working=str(tmp_path / "absent"))
    assert platform.in_kaggle({}, working=str(tmp_path))  # /kaggle/working exists
    assert not platform.in_kaggle({}, working=str(tmp_path / "absent"))
    work = str(tmp_path / "working")
    assert platform.storage("runs/v5e8", kaggle=True, kaggle_working=work) == (f"{work}/runs/v5e8", None)
    assert platform.storage("/data/runs", compile_cache="xla_cache", kaggle=True, kaggle_working=work) == \
        ("/data/runs", f"{work}/xla_cache")
    assert platform.storage("runs/v5e8", kaggle=False) == ("runs/v5e8", None)
    monkeypatch.setenv("KAGGLE_KERNEL_RUN_TYPE", "Batch")
    monkeypatch.delenv("COLAB_RELEASE_TAG", raising=False)
    assert platform.platform_name() == "kaggle"
    assert platform.storage("runs/x")[0] == "/kaggle/working/runs/x"


def test_setup_pjrt_selects_the_tpu_on_a_tpu_host_and_nothing_elsewhere(monkeypatch):
    chips = [tpu_host.TpuChip(f"0000:00:{i:02x}.0", "0x0063", "v5e") for i in range(8)]
    monkeypatch.setattr(tpu_host, "tpu_chips", lambda sysfs_root="/sys": chips)  # a recorded v5e-8 bus
    monkeypatch.delenv("PJRT_DEVICE")
    assert platform.setup_pjrt("auto")["PJRT_DEVICE"] == os.environ["PJRT_DEVICE"] == "TPU"
    monkeypatch.delenv("PJRT_DEVICE")
    assert "PJRT_DEVICE" not in platform.setup_pjrt("cpu") and "PJRT_DEVICE" not in os.environ
    monkeypatch.setenv("PJRT_DEVICE", "CPU")  # exported by the user: kept
    assert platform.setup_pjrt("tpu")["PJRT_DEVICE"] == "CPU"
    monkeypatch.setattr(tpu_host, "tpu_chips", lambda sysfs_root="/sys": [])
    monkeypatch.delenv("PJRT_DEVICE")
    assert "PJRT_DEVICE" not in platform.setup_pjrt("auto")  # no TPU: auto picks a GPU or the CPU later
    assert platform.setup_pjrt("xla")["PJRT_DEVICE"] == "CPU"


@pytest.mark.xla
@pytest.mark.skipif(XLA_BACKEND is None, reason="torch_xla is not installed")
def test_setup_pjrt_turns_the_compile_cache_on_before_the_runtime_starts(tmp_path):
    got = script_result("compile_cache_runs", {"case": "setup_pjrt", "cache": str(tmp_path / "cache")})
    assert got == {"device": "CPU", "cache": str(tmp_path / "cache")}
    assert (tmp_path / "cache").is_dir()


def test_setup_notebook_installs_only_what_that_notebook_lacks_and_says_so(tmp_path, monkeypatch):
    pip = RecordingInstaller()
    report = platform.setup_notebook("finetune_llm", installer=pip)  # this venv has everything: nothing to do
    assert pip.calls == [] and report.installed == {} and report.missing == []
    assert [*report.present] == ["transformers", "peft", "tokenizers", "safetensors", "datasets", "tqdm"]
    text = str(report)
    assert text.startswith("setup for finetune_llm on ") and "torch 2.9.0, torch_xla 2.9.0: ok" in text
    assert text.endswith("installed: nothing (all present)")
    # A runtime without peft (Colab's): only peft is asked for, with its range; install=False only says so.
    real = platform.installed_version
    monkeypatch.setattr(platform, "installed_version", lambda dist: None if dist == "peft" else real(dist))
    dry = platform.setup_notebook("finetune_llm", install=False, installer=pip)
    assert pip.calls == [] and dry.missing == ["peft>=0.17"]
    assert str(dry).splitlines()[-1] == "missing: peft>=0.17; install with: pip install 'peft>=0.17'"
    report = platform.setup_notebook("finetune_llm", installer=pip)
    assert pip.calls == [["peft>=0.17"]] and set(report.installed) == {"peft"}
    assert platform.setup_notebook("quickstart", installer=pip).present == {"tqdm": real("tqdm")}
    with pytest.raises(ValueError, match=r"notebook='finetune' is not one of \['agents_llm', 'batch_size_tuning', "):
        platform.setup_notebook("finetune")
    reqs = tmp_path / "reqs.txt"
    reqs.write_text("tqdm>=1\n")
    with pytest.raises(ValueError, match=r"finetune_llm needs \['transformers', .*which .*reqs.txt does not list"):
        platform.notebook_requirements("finetune_llm", reqs)


def test_setup_notebook_installs_what_qat_and_trackers_ask_for_and_only_where_absent(monkeypatch):
    from tpu_helpers.config import ConfigError

    pip = RecordingInstaller()
    # This venv has torchao and every tracker (the dev lock holds the qat and tracking extras): nothing to install.
    report = platform.setup_notebook("finetune_llm", qat="int4", trackers="tensorboard,wandb", installer=pip)
    assert pip.calls == [] and report.installed == {} and {"torchao", "tensorboard", "wandb"} <= set(report.present)
    # A runtime that has none of them (versions looked up from a fake): what each parameter asks for, at the extra's
    # range, and nothing for the parameters' defaults.
    real = platform.installed_version
    absent = {"torchao", "tensorboard", "wandb", "trackio", "gguf"}
    monkeypatch.setattr(platform, "installed_version", lambda dist: None if dist in absent else real(dist))

    def missing(notebook, **params):
        return platform.setup_notebook(notebook, install=False, installer=pip, **params).missing

    assert missing("finetune_llm") == missing("finetune_llm", qat=None, trackers="") == []
    assert missing("finetune_llm", qat="int4") == missing("finetune_llm", qat="int8") == ["torchao==0.16.0"]
    assert missing("finetune_llm", qat="int4", trackers="wandb") == ["torchao==0.16.0", "wandb>=0.19.10"]
    assert missing("grpo_llm", trackers="TensorBoard, trackio") == ["tensorboard>=2.16", "trackio>=0.43"]
    assert missing("quickstart", trackers="none") == [] and missing("colab_tpu", trackers="wandb") == ["wandb>=0.19.10"]
    assert missing("preference_llm", export_gguf="q8_0") == ["gguf>=0.17"]  # EXPORT_GGUF
    assert pip.calls == []  # install=False only reports
    report = platform.setup_notebook("finetune_llm", qat="int4", trackers="tensorboard", installer=pip)
    assert pip.calls == [["torchao==0.16.0", "tensorboard>=2.16"]] and set(report.installed) == {"torchao", "tensorboard"}
    # A wrong value is the same error the config would give, before anything is installed.
    with pytest.raises(ConfigError, match=r"qat='int3' is not one of \('int4', 'int8'\)"):
        platform.setup_notebook("finetune_llm", qat="int3", installer=pip)
    with pytest.raises(ConfigError, match=r"unknown tracker\(s\) 'mlflow'"):
        platform.setup_notebook("quickstart", trackers="mlflow", installer=pip)
    with pytest.raises(ConfigError, match=r"export_gguf='q4_k' is not one of \('f16', 'bf16', 'q8_0'\)"):
        platform.setup_notebook("grpo_llm", export_gguf="q4_k", installer=pip)
    assert len(pip.calls) == 1


@pytest.mark.parametrize("have, installs", [("0.18.0", False), ("0.16.0", False), ("0.15.0", True), (None, True)])
def test_a_later_torchao_than_the_qat_pin_is_kept_not_downgraded(monkeypatch, have, installs):
    """The qat extra pins torchao 0.16.0, which the setup cell installs where torchao is absent or older; a runtime
    with a newer one (the latest stack: newest torch, newest torchao) keeps it: the setup cell of a QAT run on the
    latest stack had put 0.16.0 over its 0.18.0. Requirements files keep their exact meaning."""
    pip = RecordingInstaller()
    real = platform.installed_version
    monkeypatch.setattr(platform, "installed_version", lambda dist: have if dist == "torchao" else real(dist))
    report = platform.setup_notebook("finetune_llm", qat="int4", installer=pip)
    assert pip.calls == ([["torchao==0.16.0"]] if installs else []), pip.calls
    assert ("torchao" in report.present) is not installs
    assert platform.missing_requirements_of([Requirement("torchao==0.16.0")]) == \
        ([] if have == "0.16.0" else [Requirement("torchao==0.16.0")])


def test_pip_install_is_one_well_formed_pip_command_that_keeps_every_other_package(monkeypatch):
    import subprocess
    import sys

    from packaging.requirements import Requirement

    seen = {}

    def fake_run(argv, **kwargs):  # stands in for pip: records the command and the constraints it was given
        seen["argv"] = argv
        seen["constraints"] = open(argv[argv.index("-c") + 1]).read().splitlines()
        return subprocess.CompletedProcess(argv, 0, "", "")

    monkeypatch.setattr(platform.subprocess, "run", fake_run)
    wanted = [str(r) for r in platform.parameter_requirements(qat="int4", trackers="wandb")]
    platform.pip_install(wanted)
    argv = seen["argv"]
    assert argv[:4] == [sys.executable, "-m", "pip", "install"] and argv[4:6] == ["-q", "-c"]
    assert argv[7:] == ["torchao==0.16.0", "wandb>=0.19.10"] and all(Requirement(a) for a in argv[7:])
    pinned = {Requirement(line).name.lower() for line in seen["constraints"]}
    assert "torch" in pinned and "torchao" not in pinned and "wandb" not in pinned


def test_every_notebook_has_its_needs_listed_with_ranges():
    from tests.support import NOTEBOOKS

    assert set(platform.NOTEBOOK_NEEDS) == set(NOTEBOOKS)
    for name in NOTEBOOKS:
        assert all(r.specifier for r in platform.notebook_requirements(name)), name


def test_installs_pin_everything_the_runtime_has_except_what_is_asked_for():
    pins = platform.installed_pins(exclude=["peft", "Transformers"])
    names = {p.split("==")[0].lower().replace("_", "-") for p in pins}
    assert "torch==2.9.0" in pins and any(p.lower().startswith("torch-xla==2.9.0") or
                                          p.lower().startswith("torch_xla==2.9.0") for p in pins), pins[:20]
    assert "peft" not in names and "transformers" not in names and "numpy" in names
    assert len(names) == len(pins)  # one pin per distribution
