"""The fine-tuning recipe under SHARDING="fsdp" on 8 simulated XLA:CPU devices: a LoRA checkpoint holds the adapter
(plain names), resumes under data parallel on 1 device and continues the run; the exports (adapter, merged model)
come out whole and reload without torch_xla.

SPMD and the device count are fixed per process, hence one subprocess per device count (tests.support.run_python).
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.support import run_python
from tpu_helpers.config import ConfigError
from tpu_helpers.training.finetune import finetune_from_parameters

# Fine-tunes each run of ARGS["runs"] with the Finetune recipe and prints, as JSON, per-step losses, the keys of
# the checkpoint it saved and, for runs with "export", the export paths (the trained weights go to trained.pt).
_RUN = r"""
import json
import shutil
import torch
from tpu_helpers.backend import get_backend
from tpu_helpers.checkpoint import CheckpointManager
from tpu_helpers.config import TrainConfig
from tpu_helpers.training.finetune import Finetune, FinetuneConfig
from tpu_helpers.training.sharding import plain_name
from tpu_helpers.training.trainer import Callback

class StopAt(Callback):  # an interruption: the trainer saves and returns after this step
    def __init__(self, step):
        self.at = step
    def on_step_end(self, trainer):
        if trainer.step == self.at:
            trainer.stop_reason = "interrupted by the test"

backend = get_backend("xla", spmd=ARGS["spmd"])
out = []
for run in ARGS["runs"]:
    stop, export, method = run.pop("stop_at", None), run.pop("export", None), run.pop("method", "lora")
    if "copy_from" in run:  # resume another run's checkpoint in a directory of its own
        shutil.copytree(run.pop("copy_from"), run["out_dir"])
    cfg = TrainConfig(device="xla", preset="tiny", seq_len=32, lr=3e-3, warmup_steps=1, eval_every=1000,
                      eval_batches=1, log_every=1, save_every=1000, **run)
    job = Finetune(FinetuneConfig(method=method, max_records=400, lora_targets="q_proj,v_proj"), cfg,
                   backend=backend)
    job.load(); job.prepare_data()
    report = job.train(progress=False, callbacks=[StopAt(stop)] if stop else [])
    saved = CheckpointManager(cfg.out_dir).load(report.checkpoint)
    model_state = saved["sharded"].read_whole()["model"] if "sharded" in saved else saved["model"]
    result = {"losses": [r["loss"] for r in job.trainer.history.train],
              "steps": [r["step"] for r in job.trainer.history.train], "resumed_from": report.resumed_from,
              "mesh": list(backend.mesh_shape), "model_keys": sorted(model_state), "checkpoint": report.checkpoint,
              "problems": report.xla.get("problems"), "compilations": report.xla.get("compilations")}
    if export:
        result["paths"] = job.export(export)
        trained = {plain_name(n): p.detach().cpu() for n, p in job.trainer.model.named_parameters()
                   if p.requires_grad}
        torch.save(trained, export + "/trained.pt")
    out.append(result)
print("RESULT" + json.dumps(out))
"""


def _finetune(args: dict, devices: int) -> list[dict]:
    code = f"ARGS = {json.dumps(args)!s}\n".replace("true", "True").replace("false", "False") + _RUN
    proc = run_python(code, env={"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": str(devices)}, timeout=900)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")][-1]
    return json.loads(line[len("RESULT"):])


@pytest.mark.xla
def test_finetuning_under_fsdp_checkpoints_resumes_on_one_device_and_exports(tmp_path, tiny_lm_dir):
    from peft import PeftModel, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    steps, shared, export, export_full = 4, tmp_path / "shared", tmp_path / "export", tmp_path / "export_full"
    full8, half8, fsdp8, method_full8 = _finetune({"spmd": True, "runs": [
        {"sharding": "fsdp", "batch_size": 2, "steps": steps, "out_dir": str(tmp_path / "full"), "export": str(export)},
        {"sharding": "fsdp", "batch_size": 2, "steps": steps, "stop_at": 2, "out_dir": str(shared)},
        {"sharding": "fsdp", "batch_size": 2, "steps": steps, "copy_from": str(shared), "out_dir": str(tmp_path / "on8")},
        {"method": "full", "sharding": "fsdp", "batch_size": 2, "steps": 2, "out_dir": str(tmp_path / "method_full"),
         "export": str(export_full)},
    ]}, 8)
    (data1,) = _finetune({"spmd": False, "runs": [
        {"sharding": "data", "batch_size": 16, "steps": steps, "out_dir": str(shared)}]}, 1)
    assert full8["mesh"] == [1, 8] and half8["steps"] == [1, 2]
    # Saved shard by shard (no gather: a gathered save compiled a program per tensor, every save, which the
    # recompilation detector then reported as a changing value).
    assert all(r["checkpoint"].endswith(".dcp") for r in (full8, half8, fsdp8, method_full8)), full8["checkpoint"]
    print("XLA problems reported:", [r["problems"] for r in (full8, half8, fsdp8)],
          "compilations:", [r["compilations"] for r in (full8, half8, fsdp8)])
    assert not any(r["problems"] for r in (full8, half8, fsdp8)), [r["problems"] for r in (full8, half8, fsdp8)]

    # A LoRA checkpoint holds exactly the LoRA weights under the unwrapped model's names: q and v of 3 layers, A, B.
    for saved in (full8["model_keys"], half8["model_keys"]):
        assert len(saved) == 3 * 2 * 2 and all("lora_" in k and "_orig_module" not in k for k in saved), saved
    assert data1["model_keys"] == full8["model_keys"]

    # ... and resumes under data parallel on one device and under fsdp on 8, continuing the same run.
    for name, resumed in (("data on 1", data1), ("fsdp on 8", fsdp8)):
        assert resumed["resumed_from"] == 2 and resumed["steps"] == list(range(1, steps + 1)), name
        diff = max(abs(a - b) for a, b in zip(resumed["losses"][2:], full8["losses"][2:], strict=True))
        print(f"LoRA saved under fsdp on 8, resumed under {name}: max |loss - uninterrupted| steps 3-{steps}: "
              f"{diff:.3g}")
        assert diff < 5e-5, (name, resumed["losses"], full8["losses"])
    assert full8["losses"][-1] < full8["losses"][0]

    # The exported adapter reloads with peft onto the base and holds the trained weights; merged = base + adapter.
    trained = torch.load(export / "trained.pt")
    base = AutoModelForCausalLM.from_pretrained(tiny_lm_dir)
    adapted = PeftModel.from_pretrained(base, full8["paths"]["adapter"]).eval()
    loaded = {k: v for k, v in adapted.named_parameters() if "lora_" in k}
    assert sorted(loaded) == sorted(trained) and len(loaded) == 12, (sorted(loaded), sorted(trained))
    for name, value in trained.items():
        torch.testing.assert_close(loaded[name], value, rtol=0, atol=0)
    assert len(get_peft_model_state_dict(adapted)) == 12
    assert any(v.abs().sum() > 0 for k, v in trained.items() if "lora_B" in k)  # B starts at 0: it trained
    merged = AutoModelForCausalLM.from_pretrained(full8["paths"]["merged"]).eval()
    ids = torch.tensor([[1, 87, 85, 269, 201, 400]])
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, adapted(input_ids=ids).logits, atol=1e-4, rtol=1e-4)

    # Full fine-tuning under fsdp: the merged export is the whole trained model (gathered, plain names).
    assert "adapter" not in method_full8["paths"]
    assert method_full8["model_keys"] and not any("_orig_module" in k for k in method_full8["model_keys"])
    trained = torch.load(export_full / "trained.pt")
    merged = dict(AutoModelForCausalLM.from_pretrained(method_full8["paths"]["merged"]).named_parameters())
    assert sorted(trained) == sorted(merged), (sorted(trained)[:4], sorted(merged)[:4])
    for name, value in trained.items():
        torch.testing.assert_close(merged[name], value, rtol=0, atol=0)


def test_the_notebook_parameter_sharding_reaches_the_trainer_config():
    ft, cfg = finetune_from_parameters({"SHARDING": "fsdp", "METHOD": "full", "STEPS": 3})
    assert cfg.sharding == "fsdp" and ft.method == "full" and cfg.steps == 3
    assert finetune_from_parameters({"SHARDING": "2X4"})[1].sharding == "2x4"
    with pytest.raises(ConfigError, match=r"SHARDING='zero3' is not one of \('data', 'fsdp', 'DxF"):
        finetune_from_parameters({"SHARDING": "zero3"})


def test_train_still_takes_progress_and_callbacks_when_the_trainer_exists(tmp_path):
    # Under a sharded SHARDING, samples() before training makes the trainer (to sample from the sharded model).
    from tpu_helpers.config import TrainConfig
    from tpu_helpers.training.finetune import Finetune, FinetuneConfig
    from tpu_helpers.training.trainer import Callback

    class Steps(Callback):
        def __init__(self):
            self.seen = []

        def on_step_end(self, trainer):
            self.seen.append(trainer.step)

    cfg = TrainConfig(device="cpu", steps=2, batch_size=4, seq_len=32, warmup_steps=1, eval_every=1000,
                      eval_batches=1, log_every=1, save_every=1000, out_dir=str(tmp_path / "run"))
    job = Finetune(FinetuneConfig(max_records=400), cfg)
    job.load()
    job.prepare_data()
    job.make_trainer()
    with pytest.raises(ConfigError, match=r"Finetune.train\(loss_fn=...\): the trainer already exists"):
        job.train(loss_fn=None)
    steps = Steps()
    job.train(progress=False, callbacks=[steps])
    assert steps.seen == [1, 2] and job.trainer.progress is False
