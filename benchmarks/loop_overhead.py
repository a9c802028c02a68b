"""Loop overhead: the package's Trainer against a best-practice hand-written loop, same model, data and steps.

    PJRT_DEVICE=CPU python benchmarks/loop_overhead.py --device cpu --steps 40 --repeats 5
    PJRT_DEVICE=CPU python benchmarks/loop_overhead.py --device xla --steps 40 --repeats 5

Both loops train the tiny GPT with AdamW, the same warmup-cosine schedule, gradient clipping, loss read only at log
steps, and (on XLA) MpDeviceLoader and one sync per step. Evaluation and checkpoints are off in both. Each repeat
runs the two loops back to back in this process (order alternating) after one untimed warm-up each (so graphs are
compiled); the figure is the median over repeats of package time / hand-written time. Target: at most 1.02.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from tpu_helpers.backend import backend_for
from tpu_helpers.config import TrainConfig
from tpu_helpers.data import build_datasets, make_loader
from tpu_helpers.models.gpt import GPT, gpt_config
from tpu_helpers.training.cadence import Cadence
from tpu_helpers.training.optimizers import warmup_cosine
from tpu_helpers.training.trainer import Trainer


def package_loop(cfg, backend, train, vocab) -> float:
    torch.manual_seed(0)
    model = GPT(gpt_config("tiny", vocab_size=vocab, block_size=cfg.seq_len))
    trainer = Trainer(model, train, None, config=cfg.replace(out_dir=tempfile.mkdtemp()), backend=backend,
                      progress=False)
    trainer.state.save = lambda: None  # no checkpoints in either loop
    t0 = time.perf_counter()
    trainer.fit()
    return time.perf_counter() - t0


def hand_loop(cfg, backend, train, vocab) -> float:
    torch.manual_seed(0)
    model = GPT(gpt_config("tiny", vocab_size=vocab, block_size=cfg.seq_len)).to(backend.device)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: warmup_cosine(s, warmup=cfg.warmup_steps, total=cfg.steps, min_ratio=cfg.min_lr_ratio))
    loader = make_loader(train, cfg.batch_size, shuffle=True, seed=cfg.seed, **backend.loader_options)
    cadence = Cadence.from_config(cfg)
    logged = []
    t0 = time.perf_counter()
    batches = iter(backend.wrap_loader(loader))
    running = torch.zeros((), device=backend.device)
    for step in range(1, cfg.steps + 1):
        x, y = next(batches)
        _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        running = running + loss.detach()
        if cadence.is_log_step(step):
            backend.add_step_closure(lambda r: logged.append(r.item()), running)
            backend.sync()
            running = torch.zeros((), device=backend.device)
        else:
            backend.sync()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cpu", "xla"), default="cpu")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    cfg = TrainConfig(device=args.device, preset="tiny", steps=args.steps, batch_size=16, seq_len=64,
                      warmup_steps=5, log_every=10, eval_every=10**6, save_every=10**6, xla_checks="off")
    backend = backend_for(cfg, spmd=False)
    train, _, tok = build_datasets("embedded", "byte", block_size=cfg.seq_len, max_chars=300_000)
    warm = cfg.replace(steps=3, log_every=3)
    package_loop(warm, backend, train, tok.vocab_size)
    hand_loop(warm, backend, train, tok.vocab_size)
    ratios, pk, hd = [], [], []
    for r in range(args.repeats):
        if r % 2:
            h = hand_loop(cfg, backend, train, tok.vocab_size)
            p = package_loop(cfg, backend, train, tok.vocab_size)
        else:
            p = package_loop(cfg, backend, train, tok.vocab_size)
            h = hand_loop(cfg, backend, train, tok.vocab_size)
        pk.append(p)
        hd.append(h)
        ratios.append(p / h)
        print(f"repeat {r}: package {p:.3f} s, hand-written {h:.3f} s, ratio {p / h:.3f}")
    print(f"\n{backend.status()}, {args.steps} steps x {args.repeats} repeats: median package {statistics.median(pk):.3f}"
          f" s, hand-written {statistics.median(hd):.3f} s, median ratio {statistics.median(ratios):.3f} "
          f"(target <= 1.02)")


if __name__ == "__main__":
    main()
