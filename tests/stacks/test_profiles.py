"""The Colab and Kaggle stack profiles, each in its own venv: the pinned versions are what is installed, the package
imports, the doctor names the stack, and the chosen subset runs: XLA:CPU training with strict checks, the v5e-8
notebook with SHARDING="fsdp" on 8 simulated devices, the fine-tuning notebook with LoRA on XLA:CPU (Kaggle here;
Colab's, which first installs peft, is tests/stacks/test_colab_runtime.py) and the tuning panel's logic and widget
view under the stack's ipywidgets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.stacks.venvs import StackVenv
from tpu_helpers.platform import stacks

pytestmark = [pytest.mark.stacks, pytest.mark.slow]

# What each platform sets, so the doctor sees the platform it would see there.
PLATFORM_ENV = {"colab": {"COLAB_RELEASE_TAG": "release-colab-stack-test"},
                "kaggle": {"KAGGLE_KERNEL_RUN_TYPE": "Interactive"}}
TINY = ["--preset", "tiny", "--batch_size", "8", "--seq_len", "32", "--eval_every", "10", "--log_every", "5",
        "--save_every", "10", "--max_chars", "200000", "--warmup_steps", "5", "--lr", "3e-3"]


def test_the_venv_holds_the_profile_pins_and_imports_the_package(profile_venv: StackVenv):
    profile = stacks.PROFILES[profile_venv.name]
    got = profile_venv.versions("torch", "torch_xla", *profile.packages)
    assert got["python"].rsplit(".", 1)[0] == profile.python, got
    assert not profile.differences(lambda d: got.get(d)), profile.differences(lambda d: got.get(d))
    # What Colab lacks is absent from the colab venv: the setup cell's test installs it.
    if profile_venv.name == "colab":
        assert profile_venv.versions("peft", "tpu_helpers")["peft"] is None
    out = profile_venv.run(["-c", "import tpu_helpers, torch, torch_xla; print(tpu_helpers.__file__, torch.__version__,"
                                  " torch_xla.__version__)"]).stdout
    assert f"{profile.torch} {profile.torch}" in out.replace("+cu128", "").replace("+cpu", ""), out
    print(f"{profile_venv.name}: " + ", ".join(f"{k} {v}" for k, v in got.items()))


def test_doctor_names_the_platform_stack(profile_venv: StackVenv):
    proc = profile_venv.run(["-m", "tpu_helpers", "doctor"], env=PLATFORM_ENV[profile_venv.name], check=False)
    out = proc.stdout
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    lines = {line.split()[1]: line for line in out.splitlines() if line.startswith("  ") and len(line.split()) > 2}
    assert out.startswith(f"tpu_helpers doctor (platform: {profile_venv.name})"), out
    assert f"the tested {profile_venv.name} stack" in lines["stack"] and lines["stack"].split()[0] == "ok", out
    assert lines["torch/torch_xla"].split()[0] == "ok" and "(a tested pair)" in lines["torch/torch_xla"], out
    if profile_venv.name == "colab":  # Colab ships no peft: said, with the line that installs it
        assert lines["fine-tuning"].split()[0] == "warn" and "peft not installed" in lines["fine-tuning"], out
        assert "fix: pip install 'peft>=0.17'" in out, out
    else:
        assert lines["fine-tuning"].split()[0] == "ok", out
    print(out)


def test_xla_cpu_training_with_strict_checks(profile_venv: StackVenv, tmp_path):
    out = tmp_path / "run"
    profile_venv.run(["-m", "tpu_helpers.train", "--device", "xla", "--steps", "20", "--xla_checks", "strict",
                      *TINY, "--out_dir", str(out)], env={"PJRT_DEVICE": "CPU"})
    report = json.loads((out / "results.json").read_text())["report"]
    assert report["device"].startswith("XLA:CPU x1") and report["steps"] == 20, report
    assert report["final_val_loss"] < report["first_val_loss"], report
    assert report["xla"]["compilations"] <= 3 and report["xla"]["cpu_fallback_ops"] == {}, report["xla"]
    assert report["xla"]["problems"] == [], report["xla"]["problems"]


def test_v5e8_notebook_with_fsdp_on_eight_simulated_devices(profile_venv: StackVenv, tmp_path):
    runs, out = tmp_path / "runs", tmp_path / "fsdp"
    profile_venv.run(["-m", "tpu_helpers", "run", "notebooks/tpuvm_v5e8.ipynb", "--target", "xla-cpu-8",
                      "--runs-dir", str(runs), "-p", "SHARDING", "fsdp", "-p", "STEPS", "20", "-p", "GLOBAL_BATCH",
                      "16", "-p", "PRESET", "tiny", "-p", "SEQ_LEN", "32", "-p", "EVAL_EVERY", "10", "-p", "SAVE_EVERY",
                      "20", "-p", "OUT_DIR", str(out)])
    results = json.loads((out / "results.json").read_text())
    report = results["report"]
    assert report["device"].startswith("XLA:CPU x8 (SPMD)"), report["device"]
    assert results["config"]["sharding"] == "fsdp" and results["global_batch"] == 16, results["config"]
    assert report["final_val_loss"] < report["first_val_loss"] and report["checkpoint"].endswith(".dcp"), report
    executed = next(runs.iterdir()) / "tpuvm_v5e8.ipynb"
    assert "SHARDING='fsdp': about " in executed.read_text()


def test_finetune_notebook_with_lora_on_xla_cpu(tmp_path):
    from tests.stacks.conftest import stack

    venv = stack("kaggle")
    out = tmp_path / "out"
    venv.run(["-m", "tpu_helpers", "run", "notebooks/finetune_llm.ipynb", "--target", "xla-cpu", "--runs-dir",
              str(tmp_path / "runs"), "-p", "STEPS", "40", "-p", "SEQ_LEN", "32", "-p", "EVAL_EVERY", "20",
              "-p", "WARMUP_STEPS", "5", "-p", "OUT_DIR", str(out)],
             env={"TPU_HELPERS_CACHE": str(tmp_path / "cache")})
    check_finetune_results(out, device="XLA:CPU")


def check_finetune_results(out, device: str) -> dict:
    """What the fine-tuning notebook produced: LoRA trained (loss fell), adapters only, exports on disk."""
    results = json.loads((out / "results.json").read_text())
    report = results["report"]
    assert report["device"].startswith(device) and report["steps"] == 40, report
    assert report["final_val_loss"] < report["first_val_loss"] - 0.5, report
    assert results["config"]["method"] == "lora" and results["parameters"]["trainable_share"] < 0.1, results
    if device == "XLA:CPU":
        assert report["xla"]["compilations"] <= 4 and report["xla"]["cpu_fallback_ops"] == {}, report["xla"]
    assert (Path(results["exports"]["adapter"]) / "adapter_config.json").is_file(), results["exports"]
    assert (Path(results["exports"]["merged"]) / "config.json").is_file(), results["exports"]
    return results


def test_tuning_panel_logic_and_widget_view(profile_venv: StackVenv):
    code = """
import json, ipywidgets
from tpu_helpers.panel.tuning import TuningPanel
from tpu_helpers.panel.widgets import PanelView
panel = TuningPanel(preset="small", seq_len=1024, batch_size=36, hardware="v5e", chips=8)
out = {"ipywidgets": ipywidgets.__version__, "before": panel.verdict()["headline"], "suggestion": panel.suggestion().text}
panel.apply_suggestion()
out["after"] = panel.verdict()["headline"]
out["batch"] = panel.state.batch_size
view = PanelView(panel)
chart, renders = view.chart.value, view.renders
view.controls["batch_size"].value = 4
out["view"] = {"batch": panel.state.batch_size, "chart_changed": view.chart.value != chart,
               "rendered": view.renders > renders, "controls": sorted(view.controls)}
view.controls["seq_len"].value = 0
out["error"] = panel.error
print(json.dumps(out))
"""
    got = json.loads(profile_venv.run(["-c", code]).stdout.strip().splitlines()[-1])
    want_widgets = stacks.PROFILES[profile_venv.name].packages.get("ipywidgets")
    if want_widgets:
        assert got["ipywidgets"] == want_widgets, got
    assert got["before"] == "DOES NOT FIT" and "largest batch 9/chip" in got["suggestion"], got
    assert got["after"] == "FITS" and got["batch"] == 9, got
    # Every control the view builds under the dev stack's ipywidgets 8 is built under the stack's too.
    from tpu_helpers.panel.tuning import TuningPanel
    from tpu_helpers.panel.widgets import PanelView

    controls = sorted(PanelView(TuningPanel(preset="small", hardware="v5e", chips=8)).controls)
    assert len(controls) >= 15 and got["view"] == {"batch": 4, "chart_changed": True, "rendered": True,
                                                    "controls": controls}, got
    assert got["error"] and "seq_len" in got["error"], got


AUTOCAST_GENERATION = """
import json, sys
import torch
from tests.models.families import FAMILIES, random_model
from tpu_helpers.backend import get_backend
from tpu_helpers.models import replay
from tpu_helpers.models.generation import generate_ids, left_pad
b = get_backend(sys.argv[1], spmd=False, compile_cache_dir=None)
model = random_model(FAMILIES["llama3"].config(97, pad=0), seed=1)
model = b.move_model(model)
torch.manual_seed(0)
p = left_pad([torch.randint(3, 97, (n,)).tolist() for n in (12, 7, 3, 10)], 12, 0)
with torch.autocast(b.device.type, dtype=torch.bfloat16):
    out = generate_ids(model, p.ids.to(b.device), p.mask.to(b.device), max_new_tokens=5, eos_token_id=None,
                       pad_token_id=0, sync=b.sync, replay=b.compile_step, loop=b.compile_loop)
cache = next(v for k, v in replay._KEPT[model].items() if isinstance(k, tuple))
print(json.dumps({"shape": list(out.ids.shape), "keys": str(cache.layers[0].keys.dtype),
                  "values": str(cache.layers[0].values.dtype)}))
"""


@pytest.mark.parametrize("device", ["cpu", "xla"])
def test_generation_under_bf16_autocast_of_an_fp32_model(profile_venv: StackVenv, device):
    """What GRPO's rollouts do with fp32 weights on a TPU or GPU (full fine-tuning): the rotary embedding gives fp32
    keys and bf16 values. transformers up to 5.17 (Colab's 5.15) allocates a static cache's values in the keys' dtype,
    so its first write fails ("index_copy_(): self and source expected to have the same dtype"); the package's
    cache layer keeps each in its own."""
    out = profile_venv.run(["-c", AUTOCAST_GENERATION, device], env={"PJRT_DEVICE": "CPU"} if device == "xla" else {})
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"shape": [4, 5], "keys": "torch.float32", "values": "torch.bfloat16"}, got
