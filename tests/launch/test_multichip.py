"""Data parallel over 8 chips is real: SPMD on 8 XLA:CPU devices shards the batch 8 ways and follows a 1-device run
of the same global batch step for step; a checkpoint of the 8-device run resumes on 1 device at the same sample.

Each device count needs its own process (XLA fixes SPMD and CPU_NUM_DEVICES per process): tests/scripts/multichip_runs.py.
"""

from __future__ import annotations

import pytest

from tests.support import script_result, tiny_config
from tpu_helpers.config import ConfigError
from tpu_helpers.launch.multichip import plan_multichip, split_global_batch

pytestmark = pytest.mark.xla

def _train(args: dict, env: dict) -> list[dict]:
    return script_result("multichip_runs", {"case": "train", **args}, env={"PJRT_DEVICE": "CPU", **env}, timeout=300)


def test_eight_device_spmd_matches_one_device_and_resumes_there(tmp_path):
    steps = 6
    full8, half8 = _train({"spmd": True, "runs": [
        {"batch_size": 2, "steps": steps, "save_every": 100, "out_dir": str(tmp_path / "a8")},
        {"batch_size": 2, "steps": steps, "stop_at": 3, "save_every": 100, "out_dir": str(tmp_path / "shared")},
    ]}, {"CPU_NUM_DEVICES": "8"})
    # The 1-device side: the same global batch 16 at once, then the 8-device checkpoint resumed as 4 x 4
    # accumulation steps (a loader batch of 4, so a position counted in loader batches would land at sample 12).
    full1, resumed1 = _train({"spmd": False, "runs": [
        {"batch_size": 16, "steps": steps, "save_every": 100, "out_dir": str(tmp_path / "a1")},
        {"batch_size": 4, "grad_accum": 4, "steps": steps, "save_every": 100, "out_dir": str(tmp_path / "shared")},
    ]}, {"CPU_NUM_DEVICES": "1"})

    assert full8["replicas"] == 8 and full1["replicas"] == 1
    assert full8["spec"] == "{devices=[8,1]0,1,2,3,4,5,6,7}", full8["spec"]
    assert full1["spec"] in ("", None) or "devices=" not in full1["spec"]
    assert full8["steps"] == full1["steps"] == list(range(1, steps + 1))
    diff = max(abs(a - b) for a, b in zip(full8["losses"], full1["losses"], strict=True))
    print(f"max |loss 8-device - loss 1-device| over {steps} steps: {diff:.3g}")
    assert diff < 2e-5, (full8["losses"], full1["losses"])
    assert full8["losses"][-1] < full8["losses"][0]  # it trained

    assert half8["samples_in_epoch"] == 3 * 16
    assert resumed1["resumed_from"] == 3 and resumed1["steps"] == list(range(1, steps + 1))
    resume_diff = max(abs(a - b) for a, b in zip(resumed1["losses"][3:], full8["losses"][3:], strict=True))
    print(f"max |loss resumed on 1 device - loss 8-device| steps 4-{steps}: {resume_diff:.3g}")
    assert resume_diff < 2e-5, (resumed1["losses"], full8["losses"])
    assert resumed1["samples_in_epoch"] == steps * 16


def test_resume_with_another_global_batch_is_refused(tmp_path, tiny_data):
    from tpu_helpers.models.gpt import GPT, gpt_config
    from tpu_helpers.training.trainer import Trainer

    train, val, tok = tiny_data
    cfg = tiny_config(tmp_path, steps=2, save_every=2, eval_every=100)
    Trainer(GPT(gpt_config("tiny", vocab_size=tok.vocab_size, block_size=32)), train, val, config=cfg,
            progress=False).fit()
    other = cfg.replace(batch_size=4, steps=4)
    trainer = Trainer(GPT(gpt_config("tiny", vocab_size=tok.vocab_size, block_size=32)), train, val, config=other,
                      progress=False)
    with pytest.raises(ConfigError, match=r"global_batch: 8 there vs 4 now.*keep it to resume"):
        trainer.fit()


def test_global_batch_that_the_chips_do_not_divide_fails_clearly(tmp_path):
    assert split_global_batch(64, 8, 2) == 4
    with pytest.raises(ConfigError, match=r"GLOBAL_BATCH=12 cannot be split over 8 chips x GRAD_ACCUM=1: it must "
                                          r"be a multiple of 8 \(e.g. 16 or 8\)"):
        split_global_batch(12, 8)
    with pytest.raises(ConfigError, match="GLOBAL_BATCH=0 must be a positive int"):
        split_global_batch(0, 8)
    cfg = tiny_config(tmp_path, device="xla")
    plan = plan_multichip(cfg, global_batch=32, chips=8)
    assert plan.config.batch_size == 4 and plan.config.spmd is True
    assert plan.describe().startswith("global batch 32 = 4 per chip x 8 chips x 1 accumulation step(s)")
    with pytest.raises(ConfigError, match="MODE='threads' is not one of"):
        plan_multichip(cfg, global_batch=32, mode="threads", chips=8)
    with pytest.raises(ConfigError, match="SPAWN_PROCS=4 must be 0"):
        plan_multichip(cfg, global_batch=32, mode="spawn", spawn_procs=4, chips=8)


def test_spawn_refuses_once_the_runtime_runs_here_and_rejects_other_counts():
    from tpu_helpers.backend import xla_module

    xla = xla_module()
    assert xla.runtime_started()  # conftest started XLA:CPU in this process
    with pytest.raises(RuntimeError, match="already running in this process"):
        xla.spawn(print, nprocs=None)
    with pytest.raises(ValueError, match="nprocs=4"):
        xla.spawn(print, nprocs=4)


def test_spawned_training_function_runs_from_the_package(tmp_path):
    # One process only: multi-process collectives on XLA:CPU can hang (see the torch_xla notes).
    got = script_result("multichip_runs", {"case": "spawn", "out_dir": str(tmp_path / "sp")},
                        env={"PJRT_DEVICE": "CPU"}, timeout=300)
    assert (got["steps"], got["mode"], got["world_size"]) == (6, "spawn", 1)
    assert got["checkpoint"].endswith("ckpt-00000006.pt")
    assert (tmp_path / "sp" / "results.json").exists()
