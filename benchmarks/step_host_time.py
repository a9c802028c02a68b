"""Where the host's time goes in each training step: the package's Trainer against the hand-written loop, by part.

    PYTHONPATH=. python benchmarks/step_host_time.py --device both --runs 3 --steps 120
    PYTHONPATH=. python benchmarks/step_host_time.py --device xla --baseline /path/to/older/checkout   # before/after

The same model, data, optimizer and log cadence as `loop_vs_peers.py` (its `_setup`: a 2-layer GPT d128, batch 16 x
seq 64, AdamW lr 1e-3 constant, no clipping, no evaluation or checkpoints, the loss read every 10 steps). Each part of
a step is timed where it is called (the trainer's methods, the backend's, the callbacks', the progress bar's), with
nested parts counted once (a part's time excludes the parts it calls), in two clocks:

- host CPU: `time.thread_time()` of the main thread, i.e. the Python and tracing work the host does for the step;
  it leaves out XLA's execution threads and other programs, so it is the figure that limits a TPU run (the host
  traces step N+1 while the chip runs step N);
- wall: `time.perf_counter()`, which on XLA:CPU also holds the waits for the "device" (the same cores).

Per part it prints the mean microseconds per step over steps 21..N (after compiles; `--warm` changes the 20), median
over the runs; "loop"
is the step's time outside every named part (the loop's own statements). Each run is its own process pinned to one
core (as in loop_vs_peers.py). `--progress` turns the trainer's tqdm bar on (a notebook's default; the peers have
none). `--baseline DIR` runs the Trainer of another checkout too, for before/after figures.

`--replay` adds the package's Trainer with `TrainConfig.replay_steps=True` (the loss captured once and replayed, the
optimizer traced lazily) beside the lazily traced one. `--model smollm2-135m` times the real model instead (the
offline SmolLM2-135M-Instruct, models/smollm2.py) with LoRA (r 8, q/k/v/o, as the finetune recipe) under the SFT
trainer (CausalLMTrainer, the package's AdamW), random tokens at `--batch` x `--seq` (default 32 x 72), the first
`--layers` of its 30 layers; there is no hand-written runner then. The issue's figure (issue 32):

    PYTHONPATH=. python benchmarks/step_host_time.py --device xla --model smollm2-135m --replay --runs 1 --steps 6 \
        --warm 3

`--device cuda --model DIR` times the same trainer on a CUDA GPU (bf16 autocast, the package's default there; any
saved model, e.g. SmolLM2's shape with random weights where the real weights cannot reach the GPU machine): host
CPU is then the Python that launches the step's kernels; nothing syncs before the log step, so wall time is the
host's too unless the GPU falls behind.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from loop_vs_peers import BATCH, LOG_EVERY, LR, SEQ, _setup  # noqa: E402

WARM = 20  # steps left out: compiles, the optimizer state's first step


class Parts:
    """Exclusive time per named part, both clocks; `wrap(obj, attr, part)` times a method of an object in place."""

    def __init__(self) -> None:
        self.cpu: dict[str, float] = defaultdict(float)
        self.wall: dict[str, float] = defaultdict(float)
        self.stack: list[list[float]] = []  # per open part: [child cpu, child wall]
        self.on = False

    def wrap(self, obj, attr: str, part: str) -> None:
        fn = getattr(obj, attr)
        parts = self

        def timed(*args, **kwargs):
            if not parts.on:
                return fn(*args, **kwargs)
            c0, w0 = time.thread_time(), time.perf_counter()
            parts.stack.append([0.0, 0.0])
            try:
                return fn(*args, **kwargs)
            finally:
                dc, dw = time.thread_time() - c0, time.perf_counter() - w0
                child = parts.stack.pop()
                parts.cpu[part] += dc - child[0]
                parts.wall[part] += dw - child[1]
                if parts.stack:
                    parts.stack[-1][0] += dc
                    parts.stack[-1][1] += dw

        setattr(obj, attr, timed)

    def wrap_iter(self, it, part: str):
        """An iterator whose next() is timed as `part`."""
        parts = self

        class Timed:
            def __iter__(self):
                return self

            def __next__(self):
                return it.__next__()

        timed = Timed()
        parts.wrap(timed, "__next__", part)
        return _NextCaller(timed)


class _NextCaller:
    # next(x) looks __next__ up on the type; route it to the instance's (timed) attribute.
    def __init__(self, inner) -> None:
        self.inner = inner

    def __iter__(self):
        return self

    def __next__(self):
        return self.inner.__next__()


class Steps:
    """Marks each step's boundary: totals of both clocks between the first and last marked step after warm-up."""

    def __init__(self, parts: Parts) -> None:
        self.parts, self.step = parts, 0
        self.start: tuple[float, float] | None = None
        self.end: tuple[float, float] | None = None

    def mark(self) -> None:
        self.step += 1
        if self.step == WARM:
            self.start = (time.thread_time(), time.perf_counter())
            self.parts.cpu.clear()
            self.parts.wall.clear()
            self.parts.on = True
        self.end = (time.thread_time(), time.perf_counter())


def _real_setup(model_name: str, layers: int, batch: int, seq: int):
    """The real model with LoRA (the finetune recipe's defaults) and a loader of random-token LM batches."""
    import torch
    from torch.utils.data import DataLoader

    from tpu_helpers.models import hf, lora

    torch.manual_seed(0)
    model, _ = hf.load_causal_lm(model_name)
    if layers:
        model.model.layers = model.model.layers[:layers]
        model.config.num_hidden_layers = layers
    model = lora.add_lora(model, r=8, alpha=16)
    ids = torch.randint(0, model.config.vocab_size, (batch * 64, seq))

    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return len(ids)

        def __getitem__(self, i):
            return {"input_ids": ids[i], "attention_mask": torch.ones_like(ids[i]), "labels": ids[i]}

    return model, DataLoader(Rows(), batch_size=batch, shuffle=True, drop_last=True,
                             generator=torch.Generator().manual_seed(0))


def _package(device: str, steps: int, progress: bool, replay: bool = False, real: dict | None = None) -> dict:
    import torch

    from tpu_helpers.algorithms.sft import CausalLMTrainer
    from tpu_helpers.backend import get_backend
    from tpu_helpers.config import TrainConfig
    from tpu_helpers.core.callbacks import Callback
    from tpu_helpers.training.trainer import Trainer

    if real:
        model, loader = _real_setup(real["model"], real["layers"], real["batch"], real["seq"])
        base, batch, seq = CausalLMTrainer, real["batch"], real["seq"]
    else:
        model, loader = _setup(device)
        base, batch, seq = Trainer, BATCH, SEQ
    parts = Parts()
    marks = Steps(parts)

    class Given(base):
        def configure_optimizer(self):
            if real:  # the package's own optimizer, as the finetune recipe builds it
                return super().configure_optimizer()
            return torch.optim.AdamW(self.model.parameters(), lr=LR)

    class Mark(Callback):  # first of the callbacks: its on_step_end marks the step's end (its own cost: "callbacks")
        def on_step_end(self, trainer):
            marks.mark()

    cfg = TrainConfig(device=device, steps=steps, batch_size=batch, seq_len=seq, lr=LR, warmup_steps=0,
                      min_lr_ratio=1.0, grad_clip=None, eval_every=10**9, save_every=10**9,
                      log_every=steps if real else LOG_EVERY, out_dir=tempfile.mkdtemp(prefix="step_host_time_"),
                      compile_cache_dir=None,
                      replay_steps=replay)
    backend = get_backend(device, spmd=False, compile_cache_dir=None)
    trainer = Given(model, loader, None, config=cfg, backend=backend, progress=progress, callbacks=[Mark()])
    trainer.state.save = lambda: None  # the peers write no checkpoints either
    b = trainer.backend
    for attr, part in (("compute_loss", "forward"), ("_loss_sum", "forward"), ("apply_gradients", "optimizer step")):
        if not hasattr(trainer, attr):
            continue
        parts.wrap(trainer, attr, part)
    parts.wrap(trainer.window, "add", "loss window")  # the log read itself runs in the log step's closure
    for attr, part in (("backward", "backward"), ("optimizer_step", "optimizer step"), ("zero_grad", "zero_grad"),
                       ("sync", "sync"), ("add_step_closure", "log closure")):
        parts.wrap(b, attr, part)
    parts.wrap(trainer.scheduler, "step", "lr schedule")
    for attr in ("begin", "end", "sync"):
        parts.wrap(trainer.timer, attr, "step timer")
    for cb in trainer.callbacks:
        for hook in ("on_step_end", "on_batch"):
            parts.wrap(cb, hook, "callbacks")
    timer_wrap = trainer.timer.wrap
    trainer.timer.wrap = lambda batches: parts.wrap_iter(timer_wrap(batches), "data")
    import tqdm.std

    for attr in ("update", "set_postfix_str"):
        parts.wrap(tqdm.std.tqdm, attr, "progress bar")
    trainer.fit()
    return _result(parts, marks, steps)


def _hand(device: str, steps: int, progress: bool) -> dict:
    import torch

    model, loader = _setup(device)
    parts = Parts()
    marks = Steps(parts)
    logged = []
    if device == "xla":
        import torch_xla
        import torch_xla.core.xla_model as xm
        import torch_xla.distributed.parallel_loader as pl

        dev = torch_xla.device()
        model.to(dev)
        model.lm_head.weight = model.transformer.wte.weight
        batches = iter(pl.MpDeviceLoader(loader, dev))
        ops = type("Ops", (), {"sync": staticmethod(torch_xla.sync),
                               "closure": staticmethod(lambda fn, args: xm.add_step_closure(fn, args))})()
    else:
        batches = iter(loader)
        ops = type("Ops", (), {"sync": staticmethod(lambda: None), "closure": staticmethod(lambda fn, args: fn(*args))})()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    fwd = type("Fwd", (), {"run": staticmethod(lambda x, y: model(x, y)[1])})()
    bwd = type("Bwd", (), {"run": staticmethod(lambda loss: loss.backward())})()
    parts.wrap(fwd, "run", "forward")
    parts.wrap(bwd, "run", "backward")
    parts.wrap(opt, "step", "optimizer step")
    parts.wrap(opt, "zero_grad", "zero_grad")
    parts.wrap(ops, "sync", "sync")
    parts.wrap(ops, "closure", "log closure")
    batches = parts.wrap_iter(batches, "data")
    model.train()
    for step in range(1, steps + 1):
        x, y = next(batches)
        loss = fwd.run(x, y)
        bwd.run(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % LOG_EVERY == 0:
            ops.closure(lambda t: logged.append(t.item()), (loss,))
        ops.sync()
        marks.mark()
    return _result(parts, marks, steps)


def _result(parts: Parts, marks: Steps, steps: int) -> dict:
    n = steps - WARM
    total_cpu = marks.end[0] - marks.start[0]
    total_wall = marks.end[1] - marks.start[1]
    cpu = {k: v / n * 1e6 for k, v in parts.cpu.items()}
    wall = {k: v / n * 1e6 for k, v in parts.wall.items()}
    cpu["loop"] = total_cpu / n * 1e6 - sum(cpu.values())
    wall["loop"] = total_wall / n * 1e6 - sum(wall.values())
    cpu["total"], wall["total"] = total_cpu / n * 1e6, total_wall / n * 1e6
    return {"cpu_us": cpu, "wall_us": wall}


def _spawn(runner: str, device: str, steps: int, cpus: str, progress: bool, baseline: str | None,
           extra: list[str]) -> dict:
    from tpu_helpers.backend import runtime_env

    env = {**runtime_env.without_device_count(os.environ), **runtime_env.xla_cpu_env(1)}
    tree = baseline if runner == "baseline" else str(ROOT)
    env.update(PYTHONPATH=os.pathsep.join(p for p in (tree, env.get("PYTHONPATH")) if p),
               TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run([sys.executable, __file__, "--child", runner, "--device", device, "--steps", str(steps),
                           "--cpus", cpus] + (["--progress"] if progress else []) + extra,
                          env=env, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"{runner} on {device} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


ORDER = ("data", "forward", "backward", "optimizer step", "lr schedule", "zero_grad", "loss window", "log closure",
         "sync", "log read", "step timer", "callbacks", "progress bar", "loop", "total")


def _set_warm(n: int) -> None:
    global WARM
    WARM = n


def summarise(device: str, results: dict[str, list[dict]]) -> None:
    runners = list(results)
    print(f"\n== {device}: microseconds per step over steps {WARM + 1}+, median of {len(results[runners[0]])} runs "
          "(host CPU = main thread's CPU time; wall includes waits)")
    print(f"{'part':<15}" + "".join(f" {r + ' cpu':>14} {r + ' wall':>14}" for r in runners))
    for part in ORDER:
        cells = ""
        for r in runners:
            for clock in ("cpu_us", "wall_us"):
                values = [x[clock].get(part) for x in results[r] if x[clock].get(part) is not None]
                cells += f" {statistics.median(values):14.0f}" if values else f" {'-':>14}"
        print(f"{part:<15}{cells}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cpu", "xla", "cuda", "both"), default="both")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--cpus", default="auto", help="the core each run is pinned to ('auto': the last; 'all': none)")
    ap.add_argument("--progress", action="store_true", help="the trainer's tqdm bar on, as in a notebook")
    ap.add_argument("--baseline", metavar="DIR", help="also time the Trainer of another checkout")
    ap.add_argument("--replay", action="store_true", help="also the Trainer with replay_steps=True")
    ap.add_argument("--model", default="gpt", help="'gpt' (the 2-layer GPT) or a Hugging Face model (smollm2-135m)")
    ap.add_argument("--layers", type=int, default=0, help="the model's first N layers only (0: all)")
    ap.add_argument("--batch", type=int, default=32, help="rows per step (--model other than gpt)")
    ap.add_argument("--seq", type=int, default=72, help="tokens per row (--model other than gpt)")
    ap.add_argument("--warm", type=int, default=WARM, help="steps left out of the means (compiles, captures)")
    ap.add_argument("--child", choices=("package", "baseline", "hand", "replay"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    _set_warm(args.warm)
    real = None if args.model == "gpt" else {"model": args.model, "layers": args.layers, "batch": args.batch,
                                             "seq": args.seq}
    if args.child:
        if args.cpus != "all":
            os.sched_setaffinity(0, {int(c) for c in args.cpus.split(",")})
        import torch

        torch.set_num_threads(1)
        if args.child == "hand":
            result = _hand(args.device, args.steps, args.progress)
        else:
            result = _package(args.device, args.steps, args.progress, replay=args.child == "replay", real=real)
        print(json.dumps(result))
        return
    if args.device == "cuda" and not real:
        ap.error("--device cuda times a Hugging Face model (--model), not the GPT's hand-written runner")
    log_every = args.steps if real else LOG_EVERY
    if args.steps <= args.warm + (1 if real else LOG_EVERY):
        ap.error(f"--steps={args.steps} must be more than {args.warm + (1 if real else LOG_EVERY)}")
    if args.cpus == "auto":
        args.cpus = str(max(os.sched_getaffinity(0)))
    extra = ["--warm", str(args.warm), "--model", args.model, "--layers", str(args.layers), "--batch",
             str(args.batch), "--seq", str(args.seq)]
    runners = ["package"] + (["replay"] if args.replay else []) + ([] if real else ["hand"])
    if args.baseline:
        if not (Path(args.baseline) / "tpu_helpers").is_dir():
            ap.error(f"--baseline={args.baseline!r} holds no tpu_helpers package")
        runners.insert(1, "baseline")
    devices = ("cpu", "xla") if args.device == "both" else (args.device,)
    what = (f"{args.model} ({args.layers or 'all'} layers) with LoRA r8, batch {args.batch} x seq {args.seq}" if real
            else f"2-layer GPT d128 h4, batch {BATCH} x seq {SEQ}")
    print(f"{what}, {args.steps} steps, log every {log_every}, progress bar "
          f"{'on' if args.progress else 'off'}; pinned to CPU {args.cpus}; runners {runners}")
    for device in devices:
        results: dict[str, list[dict]] = {r: [] for r in runners}
        for i in range(args.runs):
            for runner in runners if i % 2 == 0 else runners[::-1]:
                r = _spawn(runner, device, args.steps, args.cpus, args.progress, args.baseline, extra)
                results[runner].append(r)
                print(f"  run {i} {runner:<9} {device}: host CPU {r['cpu_us']['total']:.0f} us/step, wall "
                      f"{r['wall_us']['total']:.0f} us/step", flush=True)
        summarise(device, results)


if __name__ == "__main__":
    main()
