"""The fine-tuning recipe under SHARDING="fsdp" on 8 simulated XLA:CPU devices: a LoRA checkpoint holds the adapter
(plain names), resumes under data parallel on 1 device and continues the run; the exports (adapter, merged model)
come out whole and reload without torch_xla.

SPMD and the device count are fixed per process, hence one process per device count (tests/scripts/finetune_runs.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support import script_result
from tpu_helpers.config import ConfigError, TrainConfig, config_from_parameters
from tpu_helpers.core.callbacks import Callback
from tpu_helpers.recipes.finetune import Finetune, FinetuneConfig


def _finetune(args: dict, devices: int) -> list[dict]:
    return script_result("finetune_runs", args, env={"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": str(devices)},
                         timeout=900)


@pytest.mark.xla
def test_finetuning_under_fsdp_checkpoints_resumes_on_one_device_and_exports(tmp_path, tiny_lm_dir):
    from peft import PeftModel, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    steps, shared, export, export_full = 4, tmp_path / "shared", tmp_path / "export", tmp_path / "export_full"
    best_dir, export_best = tmp_path / "best", tmp_path / "export_best"
    # A LoRA adapter cannot reliably make the tiny random model's validation loss worse (it stays near log(vocab),
    # measured: lr 10..1000 after step 2 gave lower and higher losses alike), while it falls steadily: ranked by the
    # highest validation loss ("max:"), the oldest checkpoint is the best, and the newer ones must not prune it.
    every2 = {"sharding": "fsdp", "batch_size": 2, "eval_every": 2, "save_every": 2, "keep_last": 1,
              "best_metric": "max:val_loss", "out_dir": str(best_dir)}
    full8, half8, fsdp8, method_full8, _, worse8 = _finetune({"spmd": True, "runs": [
        {"sharding": "fsdp", "batch_size": 2, "steps": steps, "out_dir": str(tmp_path / "full"), "export": str(export)},
        {"sharding": "fsdp", "batch_size": 2, "steps": steps, "stop_at": 2, "out_dir": str(shared)},
        {"sharding": "fsdp", "batch_size": 2, "steps": steps, "copy_from": str(shared), "out_dir": str(tmp_path / "on8")},
        {"method": "full", "sharding": "fsdp", "batch_size": 2, "steps": 2, "out_dir": str(tmp_path / "method_full"),
         "export": str(export_full)},
        # To step 2, then on to step 6 (a checkpoint every 2 steps, keep_last=1): the best stays step 2's .dcp.
        {**every2, "steps": 2},
        {**every2, "steps": 6, "lr": 1.0, "on_divergence": "off", "export": str(export_best)},
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

    # The best checkpoint of a sharded run is kept as a .dcp through pruning (keep_last=1) and exported from it.
    from safetensors.torch import load_file

    from tpu_helpers.checkpoint import CheckpointManager

    evals = {int(step): loss for step, loss in worse8["evals"].items()}  # JSON made the keys strings
    assert evals[2] > max(evals[4], evals[6]), evals
    best = worse8["best"]
    assert best["step"] == 2 and best["metric"] == "val_loss" and best["path"].endswith("ckpt-00000002.dcp"), best
    assert worse8["exported"] == {"weights": "best", **worse8["best"]}
    mgr = CheckpointManager(best_dir / "checkpoints")
    assert [(i.step, i.path.suffix) for i in mgr.list()] == [(2, ".dcp"), (6, ".dcp")]
    at_2 = mgr.load(2)["sharded"].read_whole(parts=("model",))["model"]
    exported = load_file(Path(worse8["paths"]["adapter"]) / "adapter_model.safetensors")
    assert sorted(exported) == sorted(k.replace(".default.", ".") for k in at_2) and len(exported) == 12
    for name, value in at_2.items():
        assert torch.equal(exported[name.replace(".default.", ".")], value), name
    last = torch.load(export_best / "trained.pt")
    assert any(not torch.equal(value, last[name]) for name, value in at_2.items())


def _params(values: dict) -> FinetuneConfig:
    return config_from_parameters(values, base=FinetuneConfig())


def test_the_notebook_parameter_sharding_reaches_the_trainer_config():
    cfg = _params({"SHARDING": "fsdp", "METHOD": "full", "STEPS": 3})
    assert cfg.sharding == "fsdp" and cfg.method == "full" and cfg.steps == 3
    assert _params({"SHARDING": "2X4"}).sharding == "2x4"
    with pytest.raises(ConfigError, match=r"SHARDING='zero3' is not one of \('data', 'fsdp', 'DxF"):
        _params({"SHARDING": "zero3"})


def test_a_job_has_no_call_order_traps(tmp_path):
    # Under a sharded SHARDING, samples() before training makes the trainer (to sample from the sharded model);
    # the recipe's parts load on first use and the trainer's arguments are the constructor's, so whatever comes
    # first, the callbacks run and the progress bar is as asked.
    class Steps(Callback):
        def __init__(self):
            self.seen = []

        def on_step_end(self, trainer):
            self.seen.append(trainer.step)

    steps = Steps()
    cfg = FinetuneConfig(device="cpu", steps=2, batch_size=4, seq_len=32, warmup_steps=1, eval_every=1000,
                         eval_batches=1, log_every=1, save_every=1000, out_dir=str(tmp_path / "run"), max_records=400)
    job = Finetune(cfg, progress=False, callbacks=[steps])
    assert job.trainer.progress is False  # made before the data was asked for: it loads what it needs
    job.samples(2)
    job.train()
    assert steps.seen == [1, 2] and job.report.steps == 2
    with pytest.raises(TypeError, match=r"Finetune needs a FinetuneConfig, got TrainConfig; build one from a "
                                        r"notebook's parameters with config_from_parameters"):
        Finetune(TrainConfig(device="cpu"))
