"""Steps/s of the tiny GPT on the CPU and on XLA:CPU, and the XLA compile count of a 30-step run.

    PYTHONPATH=. python benchmarks/throughput.py [--steps 30] [--batch 8] [--seq 64]

Prints figures; asserts nothing (timings belong in benchmark output, not in tests). Each device runs in its own
process so neither sees the other's runtime. On XLA:CPU the "device" is the host's own cores, so judge the XLA
path by its counts (compilations, host transfers) more than by its speed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, sys, time, tempfile
from tpu_helpers import Pretrain, TrainConfig, backend_for
device, steps, batch, seq = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
cfg = TrainConfig(device=device, preset="tiny", steps=steps, batch_size=batch, seq_len=seq, log_every=10,
                  eval_every=10**6, save_every=10**6, warmup_steps=5, max_chars=300_000,
                  out_dir=tempfile.mkdtemp())
backend = backend_for(cfg, spmd=False)
job = Pretrain(cfg, backend=backend, progress=False)
t0 = time.perf_counter()
report = job.train()
# Steady state: time the last 10 log window's throughput, which excludes the first compiles.
last = job.history.train[-1]
print(json.dumps({"device": report.device, "steps_per_s_overall": report.steps_per_s,
                  "steps_per_s_steady": last["tokens_per_s"] / report.tokens_per_step,
                  "tokens_per_s_steady": last["tokens_per_s"], "xla": report.xla}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    args = ap.parse_args()
    from tpu_helpers.backend import runtime_env

    env = {**os.environ, "PYTHONPATH": str(ROOT), **runtime_env.xla_cpu_env(devices=1)}
    print(f"tiny GPT, {args.steps} steps, batch {args.batch} x {args.seq} tokens")
    for device in ("cpu", "xla"):
        with tempfile.TemporaryDirectory() as tmp:
            out = subprocess.run([sys.executable, "-c", CHILD, device, str(args.steps), str(args.batch),
                                  str(args.seq)], env=env, cwd=tmp, capture_output=True, text=True, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        line = (f"{r['device']:<22} steady {r['steps_per_s_steady']:7.1f} steps/s "
                f"({r['tokens_per_s_steady']:,.0f} tok/s), overall incl. compile {r['steps_per_s_overall']:6.1f}")
        if r["xla"]:
            x = r["xla"]
            line += (f" | compilations {x['compilations']}, host transfers {x['device_to_host_transfers']}, "
                     f"cpu fallbacks {x['cpu_fallback_ops'] or 'none'}")
        print(line)


if __name__ == "__main__":
    main()
