"""Data parallel runs of the tiny GPT for tests/launch/test_multichip.py, in a fresh process (SPMD and the device
count are fixed per process), one of:

    python tests/scripts/multichip_runs.py '{"case": "train", "spmd": true, "runs": [{"batch_size": 2, ...}]}'
    python tests/scripts/multichip_runs.py '{"case": "spawn", "out_dir": DIR}'

"train": each run with the package's Trainer; prints per-step losses, the first input batch's sharding spec and
the number of devices the batch was split over ("stop_at": interrupt after that step; the rest is TrainConfig's).
"spawn": the v5e-8 notebook's MODE="spawn" path with a single process (multi-process collectives on XLA:CPU can
hang; see the torch_xla notes), through `multichip.train_spawn`.
"""

from __future__ import annotations

import torch

from tests.support import StopAt, print_result, script_args
from tpu_helpers.config import TrainConfig


def train(args: dict) -> None:
    from tpu_helpers.backend import get_backend
    from tpu_helpers.data import build_datasets
    from tpu_helpers.models.gpt import GPT, gpt_config
    from tpu_helpers.training.trainer import Trainer

    class Probe(Trainer):  # notes how the first input batch arrives
        def compute_loss(self, batch):
            if not hasattr(self, "spec"):
                self.spec = self.backend.sharding_spec(batch[0])
            return super().compute_loss(batch)

    out = []
    backend = get_backend("xla", spmd=args["spmd"])
    train_data, val, tok = build_datasets("embedded", "byte", block_size=32, max_chars=200_000)
    for run in args["runs"]:
        stop = [StopAt(run.pop("stop_at"))] if "stop_at" in run else []
        cfg = TrainConfig(device="xla", preset="tiny", seq_len=32, lr=3e-3, warmup_steps=2, eval_every=1000,
                          eval_batches=2, log_every=1, max_chars=200_000, **run)
        torch.manual_seed(cfg.seed)
        model = GPT(gpt_config("tiny", vocab_size=tok.vocab_size, block_size=32))
        t = Probe(model, train_data, val, config=cfg, backend=backend, progress=False, callbacks=stop)
        report = t.fit()
        out.append({"losses": [r["loss"] for r in t.history.train], "steps": [r["step"] for r in t.history.train],
                    "spec": getattr(t, "spec", None), "replicas": backend.num_replicas,
                    "resumed_from": report.resumed_from, "samples_in_epoch": t.samples_in_epoch})
    print_result(out)


def spawn(out_dir: str) -> None:
    from tpu_helpers.launch.multichip import plan_multichip, train_spawn

    cfg = TrainConfig(device="xla", preset="tiny", steps=6, seq_len=32, lr=3e-3, warmup_steps=2, eval_every=3,
                      eval_batches=2, log_every=3, save_every=3, max_chars=200_000, out_dir=out_dir)
    plan = plan_multichip(cfg, global_batch=8, mode="spawn", spawn_procs=1)
    results = train_spawn(plan)
    print_result({"steps": results["report"]["steps"], "mode": results["mode"], "world_size": results["world_size"],
                  "checkpoint": results["report"]["checkpoint"]})


def main() -> None:
    args = script_args()
    if args["case"] == "train":
        train(args)
    else:
        spawn(args["out_dir"])


if __name__ == "__main__":
    main()
