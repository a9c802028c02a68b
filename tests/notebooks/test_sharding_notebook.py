"""The v5e-8 notebook with SHARDING="fsdp" trains on 8 simulated XLA:CPU devices under papermill, the model
sharded over them, and prints what each sharding choice needs per chip."""

from __future__ import annotations

import pytest

from tests.notebooks.test_target_notebooks import TINY, _fell, _finished
from tests.support import NOTEBOOKS
from tpu_helpers.launch.runner import run_notebook

pytestmark = [pytest.mark.notebooks, pytest.mark.xla]


def test_tpuvm_notebook_trains_with_fsdp_on_eight_xla_cpu_devices(tmp_path):
    runs = tmp_path / "runs"
    params = {**TINY, "STEPS": 20, "GLOBAL_BATCH": 16, "SHARDING": "fsdp", "OUT_DIR": str(tmp_path / "fsdp")}
    results = _finished(run_notebook(NOTEBOOKS["tpuvm_v5e8"], target="xla-cpu-8", params=params, runs_dir=runs),
                        runs)
    report = _fell(results)
    assert report["device"].startswith("XLA:CPU x8 (SPMD)"), report["device"]
    assert results["config"]["sharding"] == "fsdp" and results["global_batch"] == 16
    # The sharded model was saved shard by shard (a .dcp directory) and reads back whole into a plain GPT.
    assert report["checkpoint"].endswith("ckpt-00000020.dcp"), report["checkpoint"]
    from pathlib import Path

    from tpu_helpers.checkpoint import CheckpointManager
    from tpu_helpers.models.gpt import GPT, gpt_config

    step, state = CheckpointManager(Path(report["checkpoint"]).parent).load_latest()
    whole = state["sharded"].read_whole()
    assert step == 20 and state["step"] == 20
    vocab, block = whole["model"]["transformer.wte.weight"].shape[0], whole["model"]["transformer.wpe.weight"].shape[0]
    model = GPT(gpt_config(results["config"]["preset"], vocab_size=vocab, block_size=block))
    model.load_state_dict(whole["model"])
    text = (next(runs.iterdir()) / "tpuvm_v5e8.ipynb").read_text()
    assert "SHARDING='fsdp': about " in text and "per chip" in text
    print(f"tpuvm_v5e8 with SHARDING=fsdp on 8 XLA:CPU devices: {report['tokens_per_s']:,.0f} tokens/s, "
          f"{report['xla'].get('compilations')} compilations")
