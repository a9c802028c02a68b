"""Data parallel against FSDP on 8 simulated chips: what fits per chip, by the plan and by what XLA compiles, and
the step time of each.

    PYTHONPATH=. python benchmarks/sharding.py                        # all three parts (about 10 minutes here)
    PYTHONPATH=. python benchmarks/sharding.py --no-plan --widths 128,256 --time-width 128   # a quick look
    PYTHONPATH=. python benchmarks/sharding.py --widths 64 --seq-len 32 --batch 1 --time-width 64 --time-steps 4 \
        --layers 1                                                     # CI's toy run (figures say nothing)

1. By the memory plan (`tpu_helpers.memory.per_chip`, analytic GPT estimate, bf16, AdamW, 8 sequences of 1024 per
   chip with gradient checkpointing): the largest GPT that trains per v5e chip under `data` and under `fsdp` x8.
2. On 8 XLA:CPU devices (CPU_NUM_DEVICES=8, SPMD), a ladder of GPTs (6 layers, widths 128..768, fp32, AdamW, a few
   steps each) trained under `data` and under `fsdp`: the compiled step's memory per device (XLA's memory-usage
   report of the partitioned program, which is per device, compiled with XLA:CPU's memory-minimising scheduler as
   the compiled estimates are: a TPU's scheduler is memory-aware too) next to the plan's per-chip figure (fp32,
   unfused attention as XLA lowers it), and the largest width that fits a per-device budget by each.
3. The steady-state step time of `fsdp` against `data` on one model of the ladder (default scheduler, as training
   runs), median of the steps after warm-up.

What XLA:CPU can and cannot say about the all-gathers: the 8 "devices" are threads of one process sharing one
memory, so an all-gather or reduce-scatter is a memory copy, not a transfer over ICI; the time ratio measures the
extra copies, the partitioner's reshapes and 8 threads competing for this machine's cores, not the interconnect.
On a v5e, FSDP's per-block all-gathers overlap with compute when the blocks are large enough. The compiled memory
per device, by contrast, is the same partitioned program's buffer assignment and carries over to the TPU in shape
(the TPU compiler's fusion and layout details differ).

Measured here (2 cores, torch_xla 2.9, 2 x 128 tokens per device; MiB per device, plan / compiled):
    width 128: data 33.5 / 47.9, fsdp 18.4 / 38.8        width 512: data 351.7 / 353.1, fsdp 117.0 / 165.2
    width 384: data 209.0 / 227.4, fsdp 76.5 / 120.7     width 768: data 746.5 / 697.7, fsdp 220.5 / 267.3
    largest width within 256 MiB: data 384 by both; fsdp 768 by the plan, 640 by the compiled program
    step time at width 384: fsdp / data 1.20 (2081 vs 1730 ms)
The data-parallel plan is within -7%..+43% of the compiled step. Under fsdp the compiled step holds a roughly
constant 42-49 MiB more than the plan at these sizes: XLA's SPMD partitioner, given FSDPv2's annotations
(parameters sharded on their largest dimension, each block's output on the batch), computes some products on the
whole global batch instead of gathering only the block's weights (the step all-gathers [global tokens, width]
activations and all-reduces their gradients: 18 all-gathers and 24 all-reduces of f32[2048,384] at width 384). At
8 x 256 tokens per device (width 256) that makes fsdp's compiled step larger than data parallel's (720 vs 632 MiB)
although its parameters, gradients and optimizer state are 1/8; with gradient checkpointing 657 vs 394 MiB (the
plan: 75 vs 135). Those gathers are resharding (the whole tensor gathered, then each device slices its part);
marking every Linear's output batch-sharded brings in FSDP's per-block weight all-gathers but leaves them (690 MiB).
For models whose weights and AdamW state dominate (a 1.5B model: 24 GiB against tens of MB per gathered
[8 x 1024, 1536] activation) fsdp still cuts the per-chip figure by about the chip count; for small models with
large batches data parallel needs less. Whether the TPU compiler makes the same choices cannot be seen on XLA:CPU;
the per-device parameter and optimizer bytes (1/8, tested) carry over.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from tpu_helpers.backend import runtime_env
from tpu_helpers.core.hardware import format_bytes
from tpu_helpers.memory.analytic import analytic_estimate, block_params, param_counts
from tpu_helpers.memory.compiled import parse_memory_reports
from tpu_helpers.memory.per_chip import gpt_sharding_plan, shard_estimate
from tpu_helpers.models.gpt import GPTConfig

ROOT = Path(__file__).resolve().parents[1]
MIB = 1 << 20

_CHILD = r"""
import json, sys, time
import torch
from tpu_helpers.backend import get_backend
from tpu_helpers.config import TrainConfig
from tpu_helpers.models.gpt import GPT, GPTConfig
from tpu_helpers.core.callbacks import Callback
from tpu_helpers.training.trainer import Trainer

args = json.loads(sys.argv[1])
class Times(Callback):
    def __init__(self):
        self.t = []
    def on_step_end(self, trainer):
        self.t.append(time.perf_counter())
backend = get_backend("xla", spmd=True)
model_cfg = GPTConfig(**args["model"])
torch.manual_seed(0)
data = torch.randint(0, model_cfg.vocab_size, (4096, model_cfg.block_size + 1))
train = torch.utils.data.TensorDataset(data[:, :-1], data[:, 1:])
cfg = TrainConfig(device="xla", preset="mini", seq_len=model_cfg.block_size, batch_size=args["batch"],
                  steps=args["steps"], warmup_steps=1, log_every=args["steps"], eval_every=10_000,
                  save_every=10_000, out_dir=args["out"], sharding=args["sharding"], xla_checks="off",
                  gradient_checkpointing=args.get("checkpointing", False))
times = Times()
t = Trainer(GPT(model_cfg), train, None, config=cfg, backend=backend, progress=False, callbacks=[times])
t.fit()
steady = sorted(b - a for a, b in zip(times.t[2:], times.t[3:]))
print("RESULT" + json.dumps({"step_s": steady[len(steady) // 2] if steady else None,
                             "compilations": backend.metrics()["compilations"]}))
"""


def plan_table(chips: int = 8) -> None:
    sizes = {"small": (12, 768), "medium": (24, 1024), "large": (36, 1280), "xl (1.6B)": (48, 1600),
             "2.7B": (32, 2560), "6.7B": (32, 4096), "13B": (40, 5120)}
    print(f"1. By the plan: bf16 AdamW, 8 x 1024 tokens per chip, gradient checkpointing, v5e ({chips} chips)")
    print(f"{'model':<12}{'data / chip':>14}{'fsdp x8 / chip':>16}  fits data  fits fsdp")
    for name, (layers, width) in sizes.items():
        cfg = dict(vocab_size=50304, block_size=1024, n_layer=layers, n_head=width // 64, n_embd=width)
        plan = gpt_sharding_plan(cfg, 8, 1024, chips=chips, gradient_checkpointing=True)
        data, fsdp = plan.per_chip["data"], plan.per_chip[f"fsdp x{chips}"]
        print(f"{name:<12}{format_bytes(data.peak_bytes):>14}{format_bytes(fsdp.peak_bytes):>16}  "
              f"{'yes' if plan.fits('data') else 'no':>9}  {'yes' if plan.fits(f'fsdp x{chips}') else 'no':>9}")


def run_xla(model: GPTConfig, batch: int, steps: int, sharding: str, *, memory_scheduler: bool) -> dict:
    """Train `model` a few steps on 8 XLA:CPU devices in a fresh process; its step time and the compiled
    programs' largest memory per device."""
    dump, out = tempfile.mkdtemp(prefix="th_shard_dump_"), tempfile.mkdtemp(prefix="th_shard_out_")
    try:
        env = {**runtime_env.dump_env(dump, pjrt="CPU", memory_scheduler=memory_scheduler),
               **runtime_env.xla_cpu_env(8), "PYTHONPATH": str(ROOT)}
        spec = {"model": vars(model), "batch": batch, "steps": steps, "sharding": sharding, "out": out}
        proc = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(spec)], env=env, capture_output=True,
                              text=True, cwd=ROOT, timeout=3600)
        if proc.returncode:
            raise RuntimeError(proc.stderr[-3000:])
        line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")][-1]
        return {**json.loads(line[6:]), "compiled": max(parse_memory_reports(dump).values())}
    finally:
        shutil.rmtree(dump, ignore_errors=True)
        shutil.rmtree(out, ignore_errors=True)


def plan_bytes(model: GPTConfig, batch: int, sharding: str) -> int:
    base = analytic_estimate(model, batch, model.block_size, precision="fp32", attention="math")
    est = base if sharding == "data" else shard_estimate(base, 8, block_params=block_params(model))
    return est.peak_bytes


def ladder(widths: list[int], batch: int, seq_len: int, budget: int, layers: int = 6) -> None:
    print(f"\n2. GPTs of {layers} layers on 8 XLA:CPU devices: {batch} x {seq_len} tokens per device, fp32, AdamW; "
          "MiB per device")
    print(f"{'width':>6}{'params':>9}{'data plan':>11}{'compiled':>10}{'ratio':>7}{'fsdp plan':>11}{'compiled':>10}"
          f"{'ratio':>7}")
    fits: dict[str, dict[str, int]] = {"data": {}, "fsdp": {}}
    for width in widths:
        model = GPTConfig(vocab_size=256, block_size=seq_len, n_layer=layers, n_head=max(1, width // 64),
                          n_embd=width)
        row = f"{width:>6}{param_counts(model)[0] / 1e6:>8.1f}M"
        for sharding in ("data", "fsdp"):
            plan = plan_bytes(model, batch, sharding)
            compiled = run_xla(model, batch, 4, sharding, memory_scheduler=True)["compiled"]
            row += f"{plan / MIB:>11.1f}{compiled / MIB:>10.1f}{compiled / plan:>7.2f}"
            for how, value in (("plan", plan), ("compiled", compiled)):
                if value <= budget:
                    fits[sharding][how] = width
        print(row, flush=True)
    print(f"largest width within {budget / MIB:.0f} MiB per device: " + "; ".join(
        f"{s} by the plan {fits[s].get('plan', 'none')}, by the compiled program {fits[s].get('compiled', 'none')}"
        for s in ("data", "fsdp")))


def step_times(width: int, batch: int, seq_len: int, steps: int, layers: int = 6) -> None:
    model = GPTConfig(vocab_size=256, block_size=seq_len, n_layer=layers, n_head=max(1, width // 64), n_embd=width)
    print(f"\n3. Step time, width {width}, {batch} x {seq_len} tokens per device, median of steps 4..{steps}")
    result = {s: run_xla(model, batch, steps, s, memory_scheduler=False) for s in ("data", "fsdp")}
    for sharding, r in result.items():
        print(f"{sharding:<6}{r['step_s'] * 1000:>9.1f} ms/step  {r['compilations']} compilations")
    print(f"step time fsdp / data: {result['fsdp']['step_s'] / result['data']['step_s']:.2f} "
          "(XLA:CPU: memory copies between threads, not ICI transfers)")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--widths", default="128,256,384,512,640,768", help="model widths of the ladder")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2, help="sequences per device")
    parser.add_argument("--budget-mib", type=float, default=256, help="per-device memory budget for 'fits'")
    parser.add_argument("--time-width", type=int, default=384, help="the ladder model timed in part 3")
    parser.add_argument("--time-steps", type=int, default=16, help="at least 4 (the median of steps 4..N)")
    parser.add_argument("--layers", type=int, default=6, help="layers of every GPT in parts 2 and 3")
    parser.add_argument("--no-plan", action="store_true")
    parser.add_argument("--no-xla", action="store_true")
    a = parser.parse_args()
    if not a.no_plan:
        plan_table()
    if a.no_xla:
        return
    if a.time_steps < 4:
        parser.error(f"--time-steps={a.time_steps}: the median of steps 4..N needs at least 4")
    ladder([int(w) for w in a.widths.split(",")], a.batch, a.seq_len, int(a.budget_mib * MIB), a.layers)
    step_times(a.time_width, a.batch, a.seq_len, a.time_steps, a.layers)


if __name__ == "__main__":
    main()
