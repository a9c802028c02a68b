"""Eager vs SDPA attention for the tiny HF model on XLA:CPU: compilations, steady step time, compiled memory.

    PYTHONPATH=. python benchmarks/attention_impl.py
    PYTHONPATH=. python benchmarks/attention_impl.py --smoke   # CI's toy run (tests/test_benchmarks.py)

For each implementation: the package's LoRA SFT job of benchmarks/finetune_vs_hf_trainer.py (its own process,
PJRT_DEVICE=CPU) for compilations and steady ms/step, and `compiled_estimate` of one full fine-tuning step (batch 8 x
128) for XLA's memory figure. The default of `models.hf.load_causal_lm` is set from these figures.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from tpu_helpers.memory.compiled import compiled_estimate

ROOT = Path(__file__).resolve().parents[1]
M = "tests.example_models"


# --smoke: SDPA alone (eager goes through the same code with another name), one round of a 30-step job at batch
# 2 x 32 and a batch-2 compiled step, so CI runs every part in a minute or two (the figures then say nothing).
SMOKE_JOB = ["--steps", "30", "--window-start", "10", "--window-end", "20", "--batch-size", "2", "--seq-len", "32",
             "--records", "64"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="a toy-sized run of every part (CI)")
    args = ap.parse_args()
    rounds, job, batch = (1, SMOKE_JOB, 2) if args.smoke else (2, [], 8)
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    runs: dict[str, list] = {"sdpa": []} if args.smoke else {"eager": [], "sdpa": []}
    for _ in range(rounds):  # interleaved, so a change in the machine's load hits both alike
        for attn in runs:
            proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "finetune_vs_hf_trainer.py"),
                                   "--sides", "package", "--attn", attn, *job], capture_output=True, text=True)
            if proc.returncode != 0:
                sys.exit(proc.stdout[-2000:] + proc.stderr[-2000:])
            runs[attn].append(json.loads(proc.stdout.strip().splitlines()[-1])["package"])
    print(f"{'':8}{'compiles':>10}{'ms/step (runs)':>22}{'compiled MiB':>14}")
    for attn, rs in runs.items():
        factory = f"{M}:tiny_causal_lm" + ("_sdpa" if attn == "sdpa" else "")
        est = compiled_estimate(factory, batch, batch_fn=f"{M}:tiny_lm_batch")
        ms = " / ".join(f"{r['step_ms']:.1f}" for r in rs)
        print(f"{attn:8}{rs[0]['compilations']:>10}{ms:>22}{est.peak_bytes / 2**20:>14.1f}")


if __name__ == "__main__":
    main()
