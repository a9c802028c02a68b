"""The preflight doctor on recorded hosts (a busy Kaggle-like v5e-8, a clean v6e-1, this CPU machine), the
`python -m tpu_helpers doctor` command, and the runner refusing to start a kernel while the TPU is held."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.backend.test_torch_tpu import GOOGLE_METADATA, SOPHGO_METADATA, fake_torch_tpu
from tests.backend.test_tpu_host import fake_proc, gce_gpu_vm, v5e_8, v6e_1
from tests.support import NOTEBOOKS, ROOT
from tpu_helpers.backend import torch_tpu
from tpu_helpers.launch import runner
from tpu_helpers.launch.doctor import FAIL, INFO, OK, SKIP, WARN, Host, doctor

VERSIONS = {"torch": "2.9.0", "torch_xla": "2.9.0", "libtpu": "0.0.21.1", "ipywidgets": "7.7.1",
            "jupyterlab_widgets": "1.1.11"}


def _host(tmp_path, sysfs, *, processes=None, thp="always madvise [never]", env=None, versions=None, **kw) -> Host:
    thp_file = sysfs / "kernel" / "mm" / "transparent_hugepage" / "enabled"
    thp_file.parent.mkdir(parents=True, exist_ok=True)
    thp_file.write_text(thp + "\n")
    proc = fake_proc(tmp_path / "proc", processes or {})
    known = {**VERSIONS, **(versions or {})}
    return Host(sysfs_root=str(sysfs), proc_root=str(proc), lockfile=str(tmp_path / "libtpu_lockfile"),
                env={"HOME": str(tmp_path), **(env or {})}, version=known.get, python=kw.pop("python", (3, 13, 5)),
                **kw)


def _by_name(report):
    return {c.name: c for c in report.checks}


def test_a_busy_tpu_host_gets_every_problem_with_its_fix(tmp_path):
    host = _host(tmp_path, v5e_8(tmp_path / "sys"), processes={4242: ["/dev/accel3"]}, env={"PJRT_DEVICE": "CPU"},
                 versions={"torch_xla": "2.8.0", "libtpu": None}, platform="kaggle")
    report = doctor(host)
    checks = _by_name(report)
    assert not report.ok
    assert checks["TPU chips"].status == OK and checks["TPU chips"].detail == "8 x TPU v5e (PCI device 0x0063)"
    assert checks["torch/torch_xla"].status == FAIL
    assert checks["torch/torch_xla"].fix == "pip install 'torch==2.9.0' 'torch_xla[tpu]==2.9.0'"
    assert checks["libtpu"].status == FAIL and "torch_xla[tpu]" in checks["libtpu"].fix
    assert checks["TPU lock"].status == FAIL and "pid 4242" in checks["TPU lock"].detail
    assert checks["TPU lock"].fix.startswith("kill 4242")
    assert checks["hugepages"].status == WARN and "echo always >" in checks["hugepages"].fix
    assert checks["PJRT variables"].status == FAIL and "PJRT_DEVICE=CPU" in checks["PJRT variables"].detail
    assert checks["HBM free"].status == SKIP and "never starts one" in checks["HBM free"].detail
    # No transformers, peft, tokenizers or safetensors on this host: the fine-tuning notebook's extra, with its line.
    assert checks["fine-tuning"].status == WARN
    assert checks["fine-tuning"].fix == ("pip install 'transformers<6,>=5.0' 'peft>=0.17' 'tokenizers>=0.21' "
                                         "'safetensors>=0.4'")
    text = str(report)
    assert text.startswith("tpu_helpers doctor (platform: kaggle)")
    assert text.count("fix: ") == 6 and "check(s) failed" in text


def test_a_ready_tpu_host_passes_and_reports_hbm_when_its_runtime_runs(tmp_path):
    host = _host(tmp_path, v6e_1(tmp_path / "sys"), thp="[always] madvise never", env={"PJRT_DEVICE": "TPU"},
                 hbm=lambda: (30 * 2**30, 31 * 2**30), platform="colab")
    checks = _by_name(doctor(host))
    assert all(c.status != FAIL for c in checks.values()), [c for c in checks.values() if c.status == FAIL]
    assert checks["TPU chips"].detail == "1 x TPU v6e (PCI device 0x006f)"
    assert checks["TPU lock"].detail == "free" and checks["hugepages"].status == OK
    assert checks["HBM free"].detail == "30.0 GiB of 31.0 GiB (chip 0)"
    assert "Colab draws widgets" in checks["ipywidgets"].detail


def test_a_gpu_vm_in_google_cloud_is_not_taken_for_a_tpu_and_widgets_are_checked(tmp_path):
    host = _host(tmp_path, gce_gpu_vm(tmp_path / "sys"), versions={"torch_xla": None, "libtpu": None,
                                                                   "ipywidgets": "8.1.5"}, platform="local")
    checks = _by_name(doctor(host))
    assert checks["TPU chips"].detail.startswith("none") and checks["TPU lock"].status == SKIP
    assert checks["torch/torch_xla"].status != FAIL and checks["libtpu"].status != FAIL
    # ipywidgets 8 with the JupyterLab front-end of ipywidgets 7: widgets would not render
    assert checks["ipywidgets"].status == WARN and "ipywidgets==8.1.5" in checks["ipywidgets"].fix


def test_an_unwritable_compile_cache_is_reported_with_the_way_out(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    host = _host(tmp_path, v6e_1(tmp_path / "sys"), env={"TPU_HELPERS_XLA_CACHE": str(blocker / "cache")})
    check = _by_name(doctor(host))["compile cache"]
    assert check.status == FAIL and "is not a directory" in check.detail
    assert "TPU_HELPERS_XLA_CACHE=" in check.fix


def test_doctor_command_runs_here_and_prints_a_report(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "tpu_helpers", "doctor"], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode in (0, 1), proc.stderr[-2000:]
    for name in ("python", "torch/torch_xla", "TPU chips", "TPU lock", "compile cache", "PJRT variables"):
        assert name in proc.stdout
    assert proc.stdout.strip().splitlines()[-1] in ("all checks passed",) or "failed" in proc.stdout


def test_torchtpu_is_named_with_what_runs_on_it_and_sophgos_torch_tpu_as_sophgos(tmp_path):
    # A TPU VM where TorchTPU was installed (torch 2.11) and torch_xla was not.
    site = fake_torch_tpu(tmp_path / "google", GOOGLE_METADATA)
    host = _host(tmp_path, v6e_1(tmp_path / "sys"), versions={"torch": "2.11.0", "torch_xla": None, "libtpu": "0.0.50"},
                 platform="local", find_torch_tpu=lambda: torch_tpu.installed([str(site)]))
    checks = _by_name(doctor(host))
    assert checks["TorchTPU"].status == INFO
    assert checks["TorchTPU"].detail == (
        "TorchTPU 0.2.0 (Google's torch-tpu, github.com/google-pytorch/torch_tpu): tpu_helpers runs nothing on "
        "TorchTPU yet (it drives TPUs through torch_xla; torch-tpu needs torch>=2.11.0,<=2.15.0); TPUs run on the "
        "torch 2.9.0 + torch_xla 2.9.0 pair, in an environment of its own")
    # The pair's fix installs a torch_xla that exists (there is no torch_xla 2.11), apart from TorchTPU's torch.
    assert checks["torch/torch_xla"].status == FAIL
    assert checks["torch/torch_xla"].fix == ("pip install 'torch==2.9.0' 'torch_xla[tpu]==2.9.0'  (in an environment "
                                             "of its own: no torch_xla release matches torch 2.11.0)")

    (tmp_path / "s").mkdir()
    site = fake_torch_tpu(tmp_path / "sophgo", SOPHGO_METADATA)
    host = _host(tmp_path / "s", gce_gpu_vm(tmp_path / "sys2"), versions={"torch_xla": None, "libtpu": None},
                 platform="local", find_torch_tpu=lambda: torch_tpu.installed([str(site)]))
    check = _by_name(doctor(host))["TorchTPU"]
    assert check.status == INFO and check.detail == (
        "Sophgo's torch_tpu 2.1.0.post1 (PyTorch on Sophgo's chips, https://github.com/sophgo/torch-tpu), not "
        "Google's TorchTPU: tpu_helpers does not use it (Google's TPUs run through torch_xla)")

    (tmp_path / "n").mkdir()
    host = _host(tmp_path / "n", gce_gpu_vm(tmp_path / "sys3"), platform="local",
                 find_torch_tpu=lambda: torch_tpu.installed([str(tmp_path / "n")]))
    check = _by_name(doctor(host))["TorchTPU"]
    assert (check.status, check.detail) == (SKIP, "not installed")


def test_doctor_command_finds_torchtpu_on_the_path_without_importing_it(tmp_path):
    site = fake_torch_tpu(tmp_path / "site", GOOGLE_METADATA)  # its import raises: the report would not print
    proc = subprocess.run([sys.executable, "-m", "tpu_helpers", "doctor"], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path, env={**os.environ, "PYTHONPATH": f"{ROOT}:{site}"})
    assert proc.returncode in (0, 1), proc.stderr[-2000:]
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.split()[1:2] == ["TorchTPU"]]
    assert line.split()[0] == INFO and "TorchTPU 0.2.0 (Google's torch-tpu" in line, proc.stdout


def test_runner_refuses_to_start_a_tpu_kernel_while_the_tpu_is_held(tmp_path, monkeypatch):
    roots = {"sysfs_root": v5e_8(tmp_path / "sys"), "lockfile": tmp_path / "lockfile",
             "proc_root": fake_proc(tmp_path / "proc", {4242: ["/dev/accel0"]})}
    with pytest.raises(runner.RunError, match=r"cannot start the notebook's kernel: .*pid 4242.*kill 4242"):
        runner.tpu_preflight("tpu", {}, **roots)
    runner.tpu_preflight("cpu", {}, **roots)  # a CPU run does not need the TPU
    runner.tpu_preflight("xla", {"PJRT_DEVICE": "CPU"}, **roots)  # nor does XLA:CPU
    # run_notebook asks before it makes the run directory or starts papermill
    real = runner.tpu_preflight
    monkeypatch.setattr(runner, "tpu_preflight", lambda device, env: real(device, env, **roots))
    with pytest.raises(runner.RunError, match="pid 4242"):
        runner.run_notebook(NOTEBOOKS["colab_tpu"], target="colab-v6e-1", runs_dir=tmp_path / "runs")
    assert not (tmp_path / "runs").exists()


HF = {"transformers": "5.15.0", "peft": "0.21.2", "tokenizers": "0.22.2", "safetensors": "0.7.0"}


def test_kaggle_stack_with_its_2_8_pair_is_a_tested_stack(tmp_path):
    host = _host(tmp_path, v5e_8(tmp_path / "sys"), thp="[always] madvise never", env={"PJRT_DEVICE": "TPU"},
                 versions={"torch": "2.8.0+cu128", "torch_xla": "2.8.0", "libtpu": "0.0.17", **HF},
                 python=(3, 12, 11), platform="kaggle")
    checks = _by_name(doctor(host))
    assert checks["torch/torch_xla"].status == OK and "(a tested pair)" in checks["torch/torch_xla"].detail
    assert checks["stack"].status == OK and checks["stack"].detail.startswith("Kaggle: Python 3.12.11")
    assert checks["stack"].detail.endswith("the tested kaggle stack")
    assert checks["fine-tuning"].status == OK


def test_an_untested_pair_is_flagged_with_the_line_that_installs_a_tested_one(tmp_path):
    host = _host(tmp_path, v6e_1(tmp_path / "sys"), versions={"torch": "2.7.0", "torch_xla": "2.7.0", **HF},
                 platform="local")
    check = _by_name(doctor(host))["torch/torch_xla"]
    assert check.status == WARN and "they match, but CI tests only 2.8.0 and 2.9.0" in check.detail
    assert check.fix == "pip install 'torch==2.9.0' 'torch_xla[tpu]==2.9.0'"
    stack = _by_name(doctor(host))["stack"]
    assert stack.status == INFO and stack.detail.startswith("TPU VM: Python 3.13.5, torch 2.7.0, torch_xla 2.7.0")


def test_a_colab_runtime_that_moved_on_is_named_with_what_differs(tmp_path):
    host = _host(tmp_path, v6e_1(tmp_path / "sys"), env={"PJRT_DEVICE": "TPU"}, platform="colab",
                 versions={**HF, "transformers": "5.16.0", "accelerate": "1.14.0", "datasets": "4.8.5"})
    stack = _by_name(doctor(host))["stack"]
    assert stack.status == INFO and stack.detail.startswith("Colab: Python 3.13.5, torch 2.9.0, torch_xla 2.9.0")
    assert "differs from the tested colab stack" in stack.detail
    assert "transformers 5.16.0 (tested: 5.15.0)" in stack.detail and "accelerate" not in stack.detail.split("in:")[1]


def test_a_colab_gpu_runtime_without_torch_xla_is_held_to_the_latest_stack(tmp_path):
    """Colab's CPU/GPU runtimes ship a newer torch than its TPU runtime and no torch_xla: the tested stack for them
    is `latest` (the newest torch without torch_xla, stacks/latest.txt), not the TPU runtime's."""
    from tpu_helpers.platform import stacks

    latest = stacks.PROFILES["latest"]
    assert latest.torch not in stacks.TESTED_PAIRS  # no torch_xla of that version is tested
    host = _host(tmp_path, gce_gpu_vm(tmp_path / "sys"), platform="colab", python=(3, 12, 12),
                 versions={**HF, "torch": "2.11.0+cu128", "torch_xla": None, "libtpu": None})
    checks = _by_name(doctor(host))
    assert checks["torch/torch_xla"].status == INFO and "torch_xla not installed" in checks["torch/torch_xla"].detail
    stack = checks["stack"]
    assert stack.status == INFO and stack.detail.startswith("Colab: Python 3.12.12, torch 2.11.0+cu128, torch_xla -")
    assert "differs from the tested latest stack" in stack.detail and "without torch_xla" in stack.detail
    assert stack.detail.endswith(f"in: torch 2.11.0+cu128 (tested: {latest.torch})"), stack.detail
    (tmp_path / "second").mkdir()
    newest = _host(tmp_path / "second", gce_gpu_vm(tmp_path / "sys2"), platform="colab", python=(3, 12, 12),
                   versions={**HF, "torch": f"{latest.torch}+cu130", "torch_xla": None, "libtpu": None})
    stack = _by_name(doctor(newest))["stack"]
    assert stack.status == OK and stack.detail.endswith("the tested latest stack"), stack.detail


def test_ipywidgets_7_under_ipykernel_7_is_flagged_with_its_fix(tmp_path):
    host = _host(tmp_path, gce_gpu_vm(tmp_path / "sys"), platform="colab",
                 versions={"torch_xla": None, "libtpu": None, "ipykernel": "7.4.0"})
    check = _by_name(doctor(host))["ipywidgets"]
    assert check.status == WARN and "do not render from ipykernel 7" in check.detail
    assert check.fix.startswith("pip install 'ipykernel<7'")
    (tmp_path / "second").mkdir()
    ok = _host(tmp_path / "second", gce_gpu_vm(tmp_path / "sys2"), platform="colab",
               versions={"torch_xla": None, "libtpu": None, "ipykernel": "6.31.0"})
    assert _by_name(doctor(ok))["ipywidgets"].status == INFO


def test_a_missing_libtpu_beside_a_torch_newer_than_any_torch_xla_gets_a_torch_xla_that_exists(tmp_path):
    host = _host(tmp_path, v6e_1(tmp_path / "sys"), versions={"torch": "2.11.0", "torch_xla": None, "libtpu": None},
                 platform="local", find_torch_tpu=lambda: None)
    check = _by_name(doctor(host))["libtpu"]
    assert check.status == FAIL and check.fix == "pip install 'torch_xla[tpu]==2.9.0'"  # no torch_xla 2.11 exists


def test_libtpu_beside_torchtpu_and_no_torch_xla_is_named_as_torchtpus_not_ok(tmp_path):
    # TorchTPU brings its own libtpu (0.0.50): nothing here runs on it, so it is no "ok" for this package's TPU.
    site = fake_torch_tpu(tmp_path / "google", GOOGLE_METADATA)
    host = _host(tmp_path, v6e_1(tmp_path / "sys"), versions={"torch": "2.11.0", "torch_xla": None, "libtpu": "0.0.50"},
                 platform="local", find_torch_tpu=lambda: torch_tpu.installed([str(site)]))
    check = _by_name(doctor(host))["libtpu"]
    assert (check.status, check.detail) == (INFO, "0.0.50, TorchTPU's (torch_xla 2.9.0 pairs with libtpu 0.0.21)")
    # With torch_xla beside it, the libtpu is torch_xla's and judged as before.
    (tmp_path / "x").mkdir()
    host = _host(tmp_path / "x", v6e_1(tmp_path / "sys2"), platform="local",
                 find_torch_tpu=lambda: torch_tpu.installed([str(site)]))
    assert _by_name(doctor(host))["libtpu"].status == OK


def test_the_libtpu_of_the_newest_torch_xla_is_what_its_tpu_extra_requires():
    import importlib.metadata

    from tpu_helpers.backend import NEWEST_TORCH_XLA, NEWEST_TORCH_XLA_LIBTPU

    assert importlib.metadata.version("torch_xla").split("+")[0] == NEWEST_TORCH_XLA  # the dev venv's
    wanted = [r for r in importlib.metadata.requires("torch_xla") if r.startswith("libtpu") and 'extra == "tpu"' in r]
    assert wanted == [f'libtpu=={NEWEST_TORCH_XLA_LIBTPU}; extra == "tpu"']
