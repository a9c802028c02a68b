"""Host cost of experiment tracking per training step: TRACKERS off against TensorBoard, W&B (offline) and trackio.

    PYTHONPATH=. python benchmarks/tracking_overhead.py --device xla --steps 120 --log-every 10 --repeats 3
    PYTHONPATH=. python benchmarks/tracking_overhead.py --device cpu --log-every 1

Each repeat trains the tiny GPT once per setting ("none", "tensorboard", "wandb", "trackio"), in an order that
rotates between repeats, each into a fresh out_dir (the first untimed run compiles the graphs). Two figures:

- hooks: the time spent inside the Tracking callback's hooks (on_log in the step closure, on_step_end, which
  writes once per step), per step and per log step: tracking's own host cost, measured directly (wall time, and
  the CPU time of the training thread alone: the rest is waiting for the CPU or the GIL, which the trackers'
  own threads and processes hold for a while after each write);
- step: the median steady step time (data wait + host + sync, the run report's figure) against "none", a check
  that nothing else moved (on a shared CPU its noise is larger than the hook time).

W&B runs with WANDB_MODE=offline and trackio in a temporary TRACKIO_DIR (no network); their run start (wandb.init
starts W&B's service process) and finish are outside the steps and printed apart. Needs the tracking extra
(`pip install "tpu_helpers[tracking]"`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

TEMP = Path(tempfile.mkdtemp(prefix="tracking-bench-"))
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("TRACKIO_DIR", str(TEMP / "trackio"))
os.environ.setdefault("PJRT_DEVICE", "CPU")

SETTINGS = ("none", "tensorboard", "wandb", "trackio")


def timed(obj, name: str, spent: list[float]) -> None:
    """Wrap obj.<name> so the seconds it takes add up in spent[0] (wall) and spent[1] (this thread's CPU)."""
    inner = getattr(obj, name)

    def hook(*args, **kwargs):
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            return inner(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - t0
            spent[1] += time.thread_time() - c0

    setattr(obj, name, hook)


def run(setting: str, args, backend, train, vocab, index: int) -> dict:
    import torch

    from tpu_helpers.config import TrainConfig
    from tpu_helpers.models.gpt import GPT, gpt_config
    from tpu_helpers.training.trainer import Trainer

    cfg = TrainConfig(device=args.device, preset="tiny", steps=args.steps, batch_size=8, seq_len=64, lr=1e-3,
                      warmup_steps=10, log_every=args.log_every, eval_every=10**6, save_every=10**6,
                      out_dir=str(TEMP / f"{setting}-{index}"), trackers="" if setting == "none" else setting,
                      project="tracking-bench")
    torch.manual_seed(0)
    model = GPT(gpt_config("tiny", vocab_size=vocab, block_size=cfg.seq_len))
    trainer = Trainer(model, train, None, config=cfg, backend=backend, progress=False)
    trainer.state.save = lambda: None  # no checkpoints: the steps alone
    spent, opening = [0.0, 0.0], [0.0, 0.0]
    if trainer.tracking is not None:
        for hook in ("on_log", "on_step_end"):
            timed(trainer.tracking, hook, spent)
        timed(trainer.tracking, "on_fit_start", opening)
    report = trainer.fit()
    return {"step_ms": report.timing["steady_step_ms"], "hooks_ms": spent[0] * 1e3, "cpu_ms": spent[1] * 1e3,
            "start_s": opening[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="xla", choices=("cpu", "xla"))
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from tpu_helpers.backend import get_backend
    from tpu_helpers.data import build_datasets

    backend = get_backend(args.device, spmd=False)
    train, _, tok = build_datasets("embedded", "byte", block_size=64, max_chars=300_000)
    run("none", args, backend, train, tok.vocab_size, -1)  # compiles the graphs (XLA), warms the caches
    results: dict[str, list[dict]] = {s: [] for s in SETTINGS}
    for rep in range(args.repeats):
        for i in range(len(SETTINGS)):
            setting = SETTINGS[(i + rep) % len(SETTINGS)]
            results[setting].append(run(setting, args, backend, train, tok.vocab_size, rep))

    logs = args.steps // args.log_every
    base = statistics.median(r["step_ms"] for r in results["none"])
    print(f"\n{backend.status()}, tiny GPT, {args.steps} steps, a log every {args.log_every} ({logs} log steps), "
          f"{args.repeats} repeats (medians)")
    print(f"{'trackers':12s} {'step ms':>9s} {'vs none':>9s} {'hooks us/step':>14s} {'hooks us/log':>13s} "
          f"{'cpu us/log':>11s} {'start s':>8s}")
    for setting in SETTINGS:
        rows = results[setting]
        step = statistics.median(r["step_ms"] for r in rows)
        hooks = statistics.median(r["hooks_ms"] for r in rows)
        cpu = statistics.median(r["cpu_ms"] for r in rows)
        start = statistics.median(r["start_s"] for r in rows)
        print(f"{setting:12s} {step:9.2f} {step - base:+9.2f} {hooks * 1e3 / args.steps:14.1f} "
              f"{hooks * 1e3 / max(1, logs):13.1f} {cpu * 1e3 / max(1, logs):11.1f} {start:8.2f}")


if __name__ == "__main__":
    main()
