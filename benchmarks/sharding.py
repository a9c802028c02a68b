"""Data parallel against FSDP on 8 simulated chips: what fits per chip, what XLA compiles, and the step time.

    PYTHONPATH=. python benchmarks/sharding.py                 # plan table + XLA:CPU runs of GPT "mini"
    PYTHONPATH=. python benchmarks/sharding.py --preset tiny --seq-len 32 --no-plan

1. By the memory plan (`tpu_helpers.memory.sharded`, analytic GPT estimate, bf16, AdamW, 8 sequences of 1024 per
   chip with gradient checkpointing): the largest GPT that trains per v5e chip under `data` and under `fsdp` x8.
2. On 8 XLA:CPU devices (CPU_NUM_DEVICES=8, SPMD), the same GPT trained a few steps under `data` and `fsdp`: the
   compiled program's memory per device (XLA's memory-usage report of the partitioned step, which is per device)
   next to the plan's fp32 per-chip figure, and the steady-state step time of each.

What XLA:CPU can and cannot say about the all-gathers: the 8 "devices" are threads of one process sharing one
memory, so an all-gather or reduce-scatter is a memory copy, not a transfer over ICI; the time ratio measures the
extra copies and the partitioner's reshapes (and any "involuntary rematerialization" it warns about), not the
interconnect. On a v5e, FSDP's per-block all-gathers overlap with compute when the blocks are large enough; the
compiled memory per device, by contrast, is the same program's buffer assignment and carries over to the TPU in
shape (the TPU compiler's details differ).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from tpu_helpers.backend import runtime_env
from tpu_helpers.hardware import format_bytes
from tpu_helpers.memory.compiled import parse_memory_reports
from tpu_helpers.memory.sharded import gpt_sharding_plan, shard_estimate

ROOT = Path(__file__).resolve().parents[1]

_CHILD = r"""
import json, sys, time
import torch
from tpu_helpers.backend import get_backend
from tpu_helpers.config import TrainConfig
from tpu_helpers.data import build_datasets
from tpu_helpers.models.gpt import GPT, gpt_config
from tpu_helpers.training.trainer import Callback, Trainer

args = json.loads(sys.argv[1])
class Times(Callback):
    def __init__(self):
        self.t = []
    def on_step_end(self, trainer):
        self.t.append(time.perf_counter())
backend = get_backend("xla", spmd=True)
train, _, tok = build_datasets("embedded", "byte", block_size=args["seq_len"], max_chars=400_000)
cfg = TrainConfig(device="xla", preset=args["preset"], seq_len=args["seq_len"], batch_size=args["batch"],
                  steps=args["steps"], warmup_steps=1, log_every=args["steps"], eval_every=10_000,
                  save_every=10_000, out_dir=args["out"], sharding=args["sharding"], xla_checks="off",
                  max_chars=400_000)
torch.manual_seed(0)
model = GPT(gpt_config(args["preset"], vocab_size=tok.vocab_size, block_size=args["seq_len"]))
times = Times()
t = Trainer(model, train, None, config=cfg, backend=backend, progress=False, callbacks=[times])
t.fit()
steady = [b - a for a, b in zip(times.t[2:], times.t[3:])]
print("RESULT" + json.dumps({"step_s": sorted(steady)[len(steady) // 2], "loss": t.history.train[-1]["loss"]}))
"""


def plan_table(chips: int = 8) -> None:
    sizes = {"small": (12, 768), "medium": (24, 1024), "large": (36, 1280), "xl (1.6B)": (48, 1600),
             "2.7B": (32, 2560), "6.7B": (32, 4096), "13B": (40, 5120)}
    print(f"By the plan: bf16 AdamW, 8 x 1024 tokens per chip, gradient checkpointing, v5e ({chips} chips)")
    print(f"{'model':<12}{'data / chip':>14}{'fsdp x8 / chip':>16}  fits data  fits fsdp")
    for name, (layers, width) in sizes.items():
        cfg = dict(vocab_size=50304, block_size=1024, n_layer=layers, n_head=width // 64, n_embd=width)
        plan = gpt_sharding_plan(cfg, 8, 1024, chips=chips, gradient_checkpointing=True)
        data, fsdp = plan.per_chip["data"], plan.per_chip[f"fsdp x{chips}"]
        print(f"{name:<12}{format_bytes(data.peak_bytes):>14}{format_bytes(fsdp.peak_bytes):>16}  "
              f"{'yes' if plan.fits('data') else 'no':>9}  {'yes' if plan.fits(f'fsdp x{chips}') else 'no':>9}")


def run_xla(preset: str, seq_len: int, batch: int, steps: int, sharding: str) -> tuple[dict, int]:
    dump, out = tempfile.mkdtemp(prefix="th_shard_dump_"), tempfile.mkdtemp(prefix="th_shard_out_")
    try:
        env = {**os.environ, **runtime_env.dump_env(dump, pjrt="CPU"), **runtime_env.xla_cpu_env(8),
               "PYTHONPATH": str(ROOT)}
        spec = {"preset": preset, "seq_len": seq_len, "batch": batch, "steps": steps, "sharding": sharding,
                "out": out}
        proc = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(spec)], env=env, capture_output=True,
                              text=True, cwd=ROOT, timeout=3600)
        if proc.returncode:
            raise RuntimeError(proc.stderr[-3000:])
        line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")][-1]
        return json.loads(line[6:]), max(parse_memory_reports(dump).values())
    finally:
        shutil.rmtree(dump, ignore_errors=True)
        shutil.rmtree(out, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="mini")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2, help="sequences per chip")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--no-plan", action="store_true")
    parser.add_argument("--no-xla", action="store_true")
    a = parser.parse_args()
    if not a.no_plan:
        plan_table()
    if a.no_xla:
        return
    from tpu_helpers.memory import analytic_estimate

    base = analytic_estimate(a.preset, a.batch, a.seq_len, precision="fp32")
    print(f"\nGPT {a.preset!r}, {a.batch} x {a.seq_len} tokens per device, 8 XLA:CPU devices, fp32, AdamW")
    print(f"{'sharding':<10}{'plan / device':>15}{'compiled / device':>19}{'step (s)':>10}")
    results = {}
    for sharding in ("data", "fsdp"):
        result, compiled = run_xla(a.preset, a.seq_len, a.batch, a.steps, sharding)
        d = 7 * 64 * 64 if a.preset == "tiny" else 12 * 384 * 384
        plan = base if sharding == "data" else shard_estimate(base, 8, block_params=d)
        results[sharding] = result["step_s"]
        print(f"{sharding:<10}{format_bytes(plan.peak_bytes):>15}{format_bytes(compiled):>19}"
              f"{result['step_s']:>10.3f}")
    print(f"step time fsdp / data: {results['fsdp'] / results['data']:.2f} (XLA:CPU: copies, not ICI transfers)")


if __name__ == "__main__":
    main()
