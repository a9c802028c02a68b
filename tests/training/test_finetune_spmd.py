"""LoRA SFT over 8 simulated XLA:CPU devices (SPMD data parallel) follows a 1-device run of the same global batch.

SPMD and the device count are fixed per process, hence one subprocess per device count (tests.support.run_python).
"""

from __future__ import annotations

import json

import pytest

from tests.support import run_python

pytestmark = pytest.mark.xla

_RUN = r"""
import json
from tpu_helpers.backend import get_backend
from tpu_helpers.config import TrainConfig
from tpu_helpers.training.finetune import Finetune, FinetuneConfig
backend = get_backend("xla", spmd=SPMD)
cfg = TrainConfig(device="xla", preset="tiny", steps=4, batch_size=BATCH, seq_len=32, lr=3e-3, warmup_steps=1,
                  eval_every=1000, eval_batches=1, log_every=1, save_every=1000, out_dir=OUT, xla_checks="strict")
job = Finetune(FinetuneConfig(max_records=400), cfg, backend=backend)
job.load(); job.prepare_data()
report = job.train(progress=False)
print("RESULT" + json.dumps({"losses": [r["loss"] for r in job.trainer.history.train],
                             "replicas": backend.num_replicas, "compilations": report.xla["compilations"]}))
"""


def _run(tmp_path, devices: int, spmd: bool, batch: int) -> dict:
    code = (_RUN.replace("SPMD", repr(spmd)).replace("BATCH", str(batch))
            .replace("OUT", repr(str(tmp_path / f"run{devices}"))))
    proc = run_python(code, env={"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": str(devices)})
    return json.loads(proc.stdout.split("RESULT", 1)[1].strip().splitlines()[0])


def test_eight_devices_match_one_device_on_the_same_global_batch(tmp_path):
    one = _run(tmp_path, 1, False, 16)
    eight = _run(tmp_path, 8, True, 2)  # 2 rows per device x 8 = the same 16-row global batch
    assert eight["replicas"] == 8 and one["replicas"] == 1
    assert len(one["losses"]) == len(eight["losses"]) == 4
    for a, b in zip(one["losses"], eight["losses"], strict=True):
        assert abs(a - b) < 1e-4 * max(1.0, abs(a)), (one["losses"], eight["losses"])
