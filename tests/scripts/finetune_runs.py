"""Fine-tune each run of the JSON argument's "runs" with the Finetune recipe on XLA, in this process (SPMD or not,
as "spmd" says), and print per-step losses, the keys of the checkpoint it saved and, for runs with "export", the
export paths (the trained weights also go to <export>/trained.pt). For tests/training/test_finetune_sharding.py and
test_finetune_spmd.py.

    python tests/scripts/finetune_runs.py '{"spmd": true, "runs": [{"sharding": "fsdp", "batch_size": 2, ...}]}'

Per run: "stop_at" interrupts it after that step (it saves and returns, as on a SIGTERM); "copy_from" first copies
another run's out_dir into this run's; "export" a directory for the exports; the other keys are FinetuneConfig's.
"""

from __future__ import annotations

import shutil

import torch

from tests.support import StopAt, print_result, script_args
from tpu_helpers.backend import get_backend
from tpu_helpers.backend.units import plain_name
from tpu_helpers.checkpoint import CheckpointManager
from tpu_helpers.recipes.finetune import Finetune, FinetuneConfig


def main() -> None:
    args = script_args()
    backend = get_backend("xla", spmd=args["spmd"])
    out = []
    for run in args["runs"]:
        stop, export = run.pop("stop_at", None), run.pop("export", None)
        if "copy_from" in run:  # resume another run's checkpoint in a directory of its own
            shutil.copytree(run.pop("copy_from"), run["out_dir"])
        settings = dict(device="xla", seq_len=32, lr=3e-3, warmup_steps=1, eval_every=1000, eval_batches=1,
                        log_every=1, save_every=1000, max_records=400, lora_targets="q_proj,v_proj")
        cfg = FinetuneConfig(**{**settings, **run})
        job = Finetune(cfg, backend=backend, progress=False, callbacks=[StopAt(stop)] if stop else [])
        report = job.train()
        saved = CheckpointManager(cfg.out_dir).load(report.checkpoint)
        model_state = saved["sharded"].read_whole()["model"] if "sharded" in saved else saved["model"]
        history = job.history.train
        result = {"losses": [r["loss"] for r in history], "steps": [r["step"] for r in history],
                  "evals": {e["step"]: e["val_loss"] for e in job.history.eval},
                  "best": report.best_checkpoint,
                  "resumed_from": report.resumed_from, "mesh": list(backend.mesh_shape),
                  "model_keys": sorted(model_state), "checkpoint": report.checkpoint,
                  "problems": report.xla.get("problems"), "compilations": report.xla.get("compilations"),
                  "replicas": backend.num_replicas}
        if export:
            result["paths"] = job.export(export)
            result["exported"] = job.exported
            trained = {plain_name(n): p.detach().cpu() for n, p in job.trainer.model.named_parameters()
                       if p.requires_grad}
            torch.save(trained, export + "/trained.pt")
        out.append(result)
    print_result(out)


if __name__ == "__main__":
    main()
