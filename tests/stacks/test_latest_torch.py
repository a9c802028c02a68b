"""The `latest` stack: the newest torch the registry serves, without torch_xla, and the newest transformers, peft and
torchao (stacks/latest.txt): what the package's GPU/CPU fallback meets on Colab's CPU and GPU runtimes. The venv
holds pytest, so the package's own CPU tests run in its interpreter, with this checkout on PYTHONPATH (SELECTION
below). XLA, GPU and browser tests are deselected by marker; a test that needs torch_xla and is not marked skips,
and says so, rather than passing. The doctor, on a Colab runtime of this stack, names it as the tested one."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest

from tests.stacks.venvs import StackVenv

pytestmark = [pytest.mark.stacks, pytest.mark.slow]

# The CPU paths on the new torch/transformers/peft/torchao (3.5 to 7 minutes on 2 cores, by the machine's load):
# SFT and its chunked loss, GRPO and DPO/ORPO with their losses against TRL's, QLoRA's 4-bit base and QAT against
# torchao, the traced memory estimates of LoRA and QLoRA models (FakeTensorMode), generation against Hugging Face's,
# and the notebooks on the CPU (fine-tuning with LoRA and with distillation + int4 QAT, GRPO, DPO, the GPT quickstart).
SELECTION = [
    "tests/algorithms",
    "tests/training/test_finetune.py",
    "tests/models/test_generation.py",
    "tests/models/test_hf.py",
    "tests/models/test_quant4.py",
    "tests/models/test_qat.py",
    "tests/memory/test_hf_memory.py",
    "tests/memory/test_qlora_plan.py",
    "tests/notebooks/test_finetune_notebook.py",
    "tests/notebooks/test_grpo_notebook.py",
    "tests/notebooks/test_preference_notebook.py",
    "tests/notebooks/test_quickstart_notebook.py",
]
# slow: the 150k-vocabulary sampling test alone (80 s here; `make test` runs it on the dev set).
MARKERS = "not xla and not gpu and not browser and not stacks and not slow"
ALL_VERSIONS = ("import importlib.metadata as m, json; "
                "print(json.dumps({d.metadata['Name'].lower(): d.version for d in m.distributions()}))")


def test_the_venv_is_the_newest_torch_without_torch_xla(latest_venv: StackVenv):
    from tpu_helpers.platform import stacks

    profile = stacks.PROFILES["latest"]
    got = latest_venv.versions("torch", "torch_xla", "transformers", "peft", "torch-tpu")
    assert got["python"].rsplit(".", 1)[0] == profile.python and got["torch"].split("+")[0] == profile.torch, got
    assert got["torch_xla"] is None and got["torch-tpu"] is None, got
    print("latest: " + ", ".join(f"{k} {v}" for k, v in got.items() if v))


def test_doctor_on_a_colab_cpu_runtime_names_the_tested_latest_stack(latest_venv: StackVenv):
    proc = latest_venv.run(["-m", "tpu_helpers", "doctor"], env={"COLAB_RELEASE_TAG": "release-colab-stack-test"},
                           check=False)
    out = proc.stdout
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    lines = {line.split()[1]: line for line in out.splitlines() if line.startswith("  ") and len(line.split()) > 2}
    assert lines["stack"].split()[0] == "ok" and "the tested latest stack" in lines["stack"], out
    assert lines["torch/torch_xla"].split()[0] == "info" and "torch_xla not installed" in lines["torch/torch_xla"], out
    assert lines["fine-tuning"].split()[0] == "ok", out


def test_the_cpu_suite_passes_on_the_newest_torch(latest_venv: StackVenv, tmp_path):
    before = json.loads(latest_venv.run(["-c", ALL_VERSIONS], checkout=False).stdout.strip().splitlines()[-1])
    report = tmp_path / "junit.xml"
    proc = latest_venv.run(["-m", "pytest", *SELECTION, "-m", MARKERS, "-p", "no:cacheprovider", "-q",
                            "--timeout", "600", f"--junitxml={report}", "--basetemp", str(tmp_path / "t")],
                           check=False, timeout=1800)
    tail = f"{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"
    print(proc.stdout[-3000:])
    assert report.is_file(), tail
    suite = ET.parse(report).getroot().find("testsuite")
    counts = {k: int(suite.get(k)) for k in ("tests", "failures", "errors", "skipped")}
    assert proc.returncode == 0 and counts["failures"] == counts["errors"] == 0, tail
    assert counts["tests"] - counts["skipped"] >= 150, (counts, tail)
    # A test that needs torch_xla is deselected by its marker, or skips saying why: none passes without it.
    for case in suite.iter("testcase"):
        skipped = case.find("skipped")
        assert skipped is None or skipped.get("message"), case.attrib
    # Nothing was installed into the cached venv (a notebook's setup cell finds everything it needs there).
    after = json.loads(latest_venv.run(["-c", ALL_VERSIONS], checkout=False).stdout.strip().splitlines()[-1])
    assert after == before, {k: (before.get(k), after.get(k)) for k in before.keys() | after.keys()
                             if before.get(k) != after.get(k)}
