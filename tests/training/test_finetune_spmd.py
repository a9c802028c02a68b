"""LoRA SFT over 8 simulated XLA:CPU devices (SPMD data parallel) follows a 1-device run of the same global batch.

SPMD and the device count are fixed per process, hence one process per device count (tests/scripts/finetune_runs.py).
"""

from __future__ import annotations

import pytest

from tests.support import script_result

pytestmark = pytest.mark.xla


def _run(tmp_path, devices: int, spmd: bool, batch: int) -> dict:
    run = {"steps": 4, "batch_size": batch, "out_dir": str(tmp_path / f"run{devices}"), "xla_checks": "strict",
           "lora_targets": "q_proj,k_proj,v_proj,o_proj"}
    (result,) = script_result("finetune_runs", {"spmd": spmd, "runs": [run]},
                              env={"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": str(devices)})
    return result


def test_eight_devices_match_one_device_on_the_same_global_batch(tmp_path):
    one = _run(tmp_path, 1, False, 16)
    eight = _run(tmp_path, 8, True, 2)  # 2 rows per device x 8 = the same 16-row global batch
    assert eight["replicas"] == 8 and one["replicas"] == 1
    assert len(one["losses"]) == len(eight["losses"]) == 4
    for a, b in zip(one["losses"], eight["losses"], strict=True):
        assert abs(a - b) < 1e-4 * max(1.0, abs(a)), (one["losses"], eight["losses"])
