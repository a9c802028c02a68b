"""Steady-state speed of the package's loop against a best-practice hand-written loop and HF accelerate.

    PYTHONPATH=. python benchmarks/loop_vs_peers.py --device both --runs 5 --steps 120
    PYTHONPATH=. python benchmarks/loop_vs_peers.py --device xla --baseline /path/to/older/checkout   # before/after

Every runner trains the same model (a 2-layer decoder LM: the package's GPT, d_model 128, 4 heads, seq 64) from the
same seeded initial weights, on the same seeded DataLoader (batch 16), with AdamW lr 1e-3 constant, no clipping, no
evaluation, the loss read on the host every 10 steps:

- package: `Trainer` given that loader and optimizer (warmup 0, min_lr_ratio 1: the lr stays 1e-3), with its
  defaults otherwise (the XLA detector on, the step timer, the loss window); checkpoints off;
- hand: what a careful user writes: MpDeviceLoader on XLA, `zero_grad(set_to_none=True)`, one `torch_xla.sync()`
  per step, the loss of a log step read in a step closure;
- accelerate (when installed): `Accelerator.prepare`, `accelerator.backward`, the same logging.

Each run is its own process (XLA's counters and caches start empty) and runs are interleaved (A B C A B C ...) so
a busy machine slows all runners alike. Per runner it prints: compilations, device-to-host transfers (in all and
between log reads, i.e. not counting the one read per log), steady seconds = wall time of the loop minus XLA compile
time (median and range over the runs), the seconds of steps 21..N (timed between log reads: no compile in them),
XLA's memory-usage report of the largest compiled program (the steady step) and the ratio of the steady median to
the fastest peer's. On XLA:CPU the "device" is the host's cores, so compare runners with each other, not with a TPU.

Each run is pinned to one CPU core (--cpus; eager torch and XLA then do the same single-threaded work, and the CPU
seconds of steps 21+ measure that work even when other programs share the machine). --baseline DIR adds the
package's Trainer imported from another checkout as one more interleaved runner, for before/after figures.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNNERS = ("package", "hand", "accelerate")
BASELINE = "baseline"  # the package's Trainer imported from another checkout (--baseline), e.g. before a change
BATCH, SEQ, LOG_EVERY, LR = 16, 64, 10, 1e-3


# ---- the child: one runner, one device, one process ------------------------------------------------------------------
def _setup(device: str):
    import torch
    from torch.utils.data import DataLoader

    from tpu_helpers.data import build_datasets
    from tpu_helpers.models.gpt import GPT, gpt_config

    train, _, tok = build_datasets("embedded", "byte", block_size=SEQ, max_chars=300_000)
    torch.manual_seed(0)
    model = GPT(gpt_config("tiny", vocab_size=tok.vocab_size, block_size=SEQ, n_layer=2, n_head=4, n_embd=128))
    loader = DataLoader(train, batch_size=BATCH, shuffle=True, drop_last=True,
                        generator=torch.Generator().manual_seed(0))
    return model, loader


class _Clock:
    """Counters read at each log read (inside the step closure, right after the read): cheap, runner-neutral."""

    def __init__(self, xla: bool) -> None:
        self.marks: list[tuple[float, int, float]] = []
        if xla:
            import torch_xla.debug.metrics as met

            self._met = met
        else:
            self._met = None

    def transfers(self) -> int:
        if self._met is None:
            return 0
        data = self._met.metric_data("TransferFromDeviceTime")
        return int(data[0]) if data else 0

    def mark(self) -> None:
        self.marks.append((time.perf_counter(), self.transfers(), time.process_time()))

    def reset(self) -> None:
        if self._met is not None:
            self._met.clear_all()

    def compile_stats(self) -> tuple[int, float]:
        if self._met is None:
            return 0, 0.0
        data = self._met.metric_data("CompileTime")
        return (int(data[0]), data[1] / 1e9) if data else (0, 0.0)


def _run_package(device: str, steps: int, clock: _Clock) -> list[float]:
    import torch

    from tpu_helpers.backend import get_backend
    from tpu_helpers.config import TrainConfig
    from tpu_helpers.core.callbacks import Callback
    from tpu_helpers.training.trainer import Trainer

    model, loader = _setup(device)
    losses: list[float] = []

    class Given(Trainer):
        def configure_optimizer(self):
            return torch.optim.AdamW(self.model.parameters(), lr=LR)

    class Mark(Callback):
        def on_log(self, trainer, record):
            clock.mark()
            losses.append(record["loss"])

    cfg = TrainConfig(device=device, steps=steps, batch_size=BATCH, seq_len=SEQ, lr=LR, warmup_steps=0,
                      min_lr_ratio=1.0, grad_clip=None, eval_every=10**9, save_every=10**9, log_every=LOG_EVERY,
                      out_dir=tempfile.mkdtemp(prefix="loop_vs_peers_"), compile_cache_dir=None)
    backend = get_backend(device, spmd=False, compile_cache_dir=None)
    trainer = Given(model, loader, None, config=cfg, backend=backend, progress=False, callbacks=[Mark()])
    trainer.state.save = lambda: None  # the peers write no checkpoints either
    clock.reset()
    t0, c0 = time.perf_counter(), time.process_time()
    trainer.fit()
    clock.marks.insert(0, (t0, 0, c0))
    shutil.rmtree(cfg.out_dir, ignore_errors=True)
    return losses


def _run_hand(device: str, steps: int, clock: _Clock) -> list[float]:
    import torch

    model, loader = _setup(device)
    losses: list[float] = []

    def log(loss):
        losses.append(loss.item())
        clock.mark()

    if device == "xla":
        import torch_xla
        import torch_xla.core.xla_model as xm
        import torch_xla.distributed.parallel_loader as pl

        dev = torch_xla.device()
        model.to(dev)
        model.lm_head.weight = model.transformer.wte.weight  # .to() on XLA unties shared parameters
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        clock.reset()
        t0, c0 = time.perf_counter(), time.process_time()
        batches = iter(pl.MpDeviceLoader(loader, dev))
        model.train()
        for step in range(1, steps + 1):
            x, y = next(batches)
            _, loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if step % LOG_EVERY == 0:
                xm.add_step_closure(log, (loss,))
            torch_xla.sync()
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        t0, c0 = time.perf_counter(), time.process_time()
        batches = iter(loader)
        model.train()
        for step in range(1, steps + 1):
            x, y = next(batches)
            _, loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if step % LOG_EVERY == 0:
                log(loss)
    clock.marks.insert(0, (t0, 0, c0))
    return losses


def _run_accelerate(device: str, steps: int, clock: _Clock) -> list[float]:
    import torch
    from accelerate import Accelerator

    model, loader = _setup(device)
    losses: list[float] = []

    def log(loss):
        losses.append(loss.item())
        clock.mark()

    accelerator = Accelerator(cpu=device == "cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    if device == "xla":
        import torch_xla.core.xla_model as xm

        closure = xm.add_step_closure
        model.lm_head.weight = model.transformer.wte.weight  # as in the hand-written loop
    else:
        def closure(fn, args):
            fn(*args)
    clock.reset()
    t0, c0 = time.perf_counter(), time.process_time()
    batches = iter(loader)
    model.train()
    for step in range(1, steps + 1):
        x, y = next(batches)
        _, loss = model(x, y)
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
        if step % LOG_EVERY == 0:
            closure(log, (loss,))
    if device == "xla":
        xm.mark_step()  # the last step's graph (MpDeviceLoader marks a step only when the next batch is taken)
    clock.marks.insert(0, (t0, 0, c0))
    return losses


def child(runner: str, device: str, steps: int, threads: int) -> dict:
    if threads:
        import torch

        torch.set_num_threads(threads)
    clock = _Clock(device == "xla")
    run = {"package": _run_package, BASELINE: _run_package, "hand": _run_hand, "accelerate": _run_accelerate}[runner]
    losses = run(device, steps, clock)
    t_end = clock.marks[-1][0]
    compilations, compile_s = clock.compile_stats()
    marks = clock.marks
    # Each log read is one transfer; anything more between two reads is a host read the step did not need.
    between = sum(max(0, (b[1] - a[1]) - 1) for a, b in zip(marks, marks[1:], strict=False))
    wall = t_end - marks[0][0]
    tail = marks[-1][0] - marks[2][0] if len(marks) > 3 else float("nan")
    tail_cpu = marks[-1][2] - marks[2][2] if len(marks) > 3 else float("nan")
    return {"runner": runner, "device": device, "wall_s": wall, "compile_s": compile_s, "steady_s": wall - compile_s,
            "tail_s": tail, "tail_cpu_s": tail_cpu, "tail_steps": (len(marks) - 3) * LOG_EVERY, "compilations": compilations,
            "transfers": clock.transfers(), "transfers_between_logs": between, "logs": len(marks) - 1,
            "last_loss": losses[-1] if losses else None}


# ---- the parent: interleaved runs, summary --------------------------------------------------------------------------
def _spawn(runner: str, device: str, steps: int, threads: int, cpus: str, dump: str | None,
           baseline: str | None) -> dict:
    from tpu_helpers.backend import runtime_env
    from tpu_helpers.memory.compiled import parse_memory_reports

    # One XLA:CPU device; the compiler's dumps (memory reports) into `dump` when asked.
    env = runtime_env.dump_env(dump) if dump else {**runtime_env.without_device_count(os.environ),
                                                   **runtime_env.xla_cpu_env(1)}
    tree = baseline if runner == BASELINE else str(ROOT)
    env.update(PYTHONPATH=os.pathsep.join(p for p in (tree, env.get("PYTHONPATH")) if p),
               TOKENIZERS_PARALLELISM="false")
    if device == "cpu":
        env["USE_TORCH_XLA"] = "0"  # accelerate picks XLA whenever torch_xla imports, even with cpu=True
    proc = subprocess.run([sys.executable, __file__, "--child", runner, "--device", device, "--steps", str(steps),
                           "--threads", str(threads), "--cpus", cpus],
                          env=env, capture_output=True, text=True, timeout=1200)
    if proc.returncode != 0:
        raise RuntimeError(f"{runner} on {device} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if dump:
        totals = parse_memory_reports(dump)
        result["programs"] = len(totals)
        result["memory_bytes"] = max(totals.values()) if totals else None
    return result


def _fmt_range(xs: list[float]) -> str:
    return f"{statistics.median(xs):6.3f} [{min(xs):.3f}-{max(xs):.3f}]"


def summarise(device: str, results: dict[str, list[dict]]) -> None:
    print(f"\n== {device}: {len(next(iter(results.values())))} runs per runner, interleaved; seconds are median "
          "[min-max]; ratio = this runner's median / the fastest other runner's median")
    figures = (("steady s", "steady_s"), ("steps 21+ s", "tail_s"), ("steps 21+ CPU s", "tail_cpu_s"))
    medians = {key: {r: statistics.median(x[key] for x in rs) for r, rs in results.items()} for _, key in figures}
    head = "".join(f" {name:>22} {'ratio':>6}" for name, _ in figures)
    print(f"{'runner':<11} {'compiles':>8} {'transfers':>9} {'between':>7}{head} {'memory MiB':>10}  last loss")
    for runner, rs in results.items():
        cells = ""
        for _, key in figures:
            peers = [m for r, m in medians[key].items() if r != runner]
            ratio = medians[key][runner] / min(peers) if peers else float("nan")
            cells += f" {_fmt_range([x[key] for x in rs]):>22} {ratio:6.3f}"
        mem = [x.get("memory_bytes") for x in rs if x.get("memory_bytes")]
        mem_s = f"{max(mem) / 2**20:10.2f}" if mem else f"{'-':>10}"
        comp = sorted({x["compilations"] for x in rs})
        print(f"{runner:<11} {'/'.join(map(str, comp)):>8} {max(x['transfers'] for x in rs):>9} "
              f"{max(x['transfers_between_logs'] for x in rs):>7}{cells} {mem_s}  {rs[-1]['last_loss']:.4f}")
    print("steady = wall time of the loop minus XLA compile time; steps 21+ = from the 2nd log read to the last (no "
          "compiles), in wall and in this process's CPU seconds (less sensitive to a busy machine)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cpu", "xla", "both"), default="both")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--runners", default=",".join(RUNNERS), help="comma-separated subset of " + ",".join(RUNNERS))
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads for eager CPU work (0: torch's default); 1 keeps a shared machine's "
                         "noise down")
    ap.add_argument("--cpus", default="auto",
                    help="CPU cores each run is pinned to, e.g. '1' or '0,1'; 'auto': the last core; 'all': no pinning. "
                         "One core makes the CPU-seconds figure the work done, whatever else the machine runs")
    ap.add_argument("--baseline", metavar="DIR",
                    help="also run the package's Trainer imported from DIR (another checkout), interleaved with the rest")
    ap.add_argument("--child", choices=(*RUNNERS, BASELINE), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        if args.cpus != "all":
            os.sched_setaffinity(0, {int(c) for c in args.cpus.split(",")})
        print(json.dumps(child(args.child, args.device, args.steps, args.threads)))
        return
    if args.steps < 4 * LOG_EVERY or args.steps % LOG_EVERY:
        ap.error(f"--steps={args.steps} must be a multiple of {LOG_EVERY} and at least {4 * LOG_EVERY}")
    if args.runs < 1:
        ap.error(f"--runs={args.runs} must be >= 1")
    runners = [r for r in args.runners.split(",") if r]
    if args.cpus == "auto":
        args.cpus = str(max(os.sched_getaffinity(0)))
    unknown = sorted(set(runners) - set(RUNNERS))
    if unknown:
        ap.error(f"--runners: unknown {unknown}; choose from {RUNNERS}")
    if "accelerate" in runners:
        try:
            import accelerate  # noqa: F401
        except ImportError:
            print("accelerate is not installed: comparing the package with the hand-written loop only")
            runners.remove("accelerate")
    if args.baseline:
        if not (Path(args.baseline) / "tpu_helpers").is_dir():
            ap.error(f"--baseline={args.baseline!r} holds no tpu_helpers package")
        runners.insert(1, BASELINE)
    devices = ("cpu", "xla") if args.device == "both" else (args.device,)
    print(f"2-layer GPT d128 h4, batch {BATCH} x seq {SEQ}, AdamW lr {LR} constant, {args.steps} steps, log every "
          f"{LOG_EVERY}; runners {runners}; torch threads {args.threads or 'default'}; pinned to CPU {args.cpus}; the machine may be shared, so read medians and ranges, not single runs")
    for device in devices:
        results: dict[str, list[dict]] = {r: [] for r in runners}
        for i in range(args.runs):
            for runner in runners if i % 2 == 0 else runners[::-1]:
                dump = tempfile.mkdtemp(prefix="loop_vs_peers_dump_") if device == "xla" else None
                try:
                    r = _spawn(runner, device, args.steps, args.threads, args.cpus, dump, args.baseline)
                finally:
                    if dump:
                        shutil.rmtree(dump, ignore_errors=True)
                results[runner].append(r)
                print(f"  run {i} {runner:<10} {device}: steady {r['steady_s']:.3f} s (wall {r['wall_s']:.3f}, "
                      f"compile {r['compile_s']:.3f}), steps 21+ {r['tail_s']:.3f} s, {r['compilations']} "
                      f"compilations, {r['transfers']} transfers", flush=True)
        summarise(device, results)


if __name__ == "__main__":
    main()
