"""Distillation with a live teacher vs from a teacher cache, and the memory plan of the guide's recovery job.

    PYTHONPATH=. python benchmarks/distill_cache.py               # both parts
    PYTHONPATH=. python benchmarks/distill_cache.py --steps 100   # a longer XLA:CPU run
    PYTHONPATH=. python benchmarks/distill_cache.py --plan-only

1. XLA:CPU: the same student (the offline tiny Qwen2 with LoRA r=8, batch 8 x 32 tokens) distilled from the tiny
   teacher run in every step, then from a top-k cache of it written once (tests/scripts/distill_memory.py in a
   fresh process whose XLA dumps give each compiled program's memory): compiled memory of the training step, steady
   step time, the cache's size on disk per million tokens, final losses.
2. The memory plan (`memory.hf_plan.hf_finetune_estimate`, on the meta device) of the guide's job: Qwen3-0.6B sizes,
   int4 QAT with recovery LoRA (r = 8 and 16, every linear layer) against a top-128 cache, batch 4 and 8 x 1024
   tokens, bf16 (the frozen base in bf16), with and without gradient checkpointing, next to the peaks the guide
   measured on a v6e-1 (22, 24 and 28 GB), and how far apart they are.

Reading part 2: the plan counts what eager PyTorch keeps for the backward (HF attention's fp32 softmax, the MLP's
gate, up and product, fp32 logits with their log-softmax and gradient: 12 bytes per vocabulary entry per token).
XLA on a TPU fuses elementwise chains, and the log-softmax into the loss, so on a TPU the plan is an upper bound on
activations: batch 8 without checkpointing plans above the 32 GB chip the guide ran on, and the guide's peaks grow
by less per added row than the plan's logits term alone. The LoRA rank moves the plan by less than 0.1 GB, so the
guide's 2 GB steps come from the batch, checkpointing or the runtime, not the rank.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QWEN3_06B = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                 tie_word_embeddings=True)
GUIDE_PEAKS_GB = (22, 24, 28)


def live_vs_cached(steps: int, top_k: int) -> None:
    from tpu_helpers.backend.runtime_env import dump_env

    with tempfile.TemporaryDirectory() as tmp:
        dump = Path(tmp) / "dump"
        args = {"dump": str(dump), "steps": steps, "top_k": top_k, "out": tmp, "eval_every": steps,
                "held_out_ce": True}
        proc = subprocess.run([sys.executable, str(ROOT / "tests" / "scripts" / "distill_memory.py"), json.dumps(args)],
                              env={**dump_env(dump, memory_scheduler=True), "PYTHONPATH": str(ROOT)},
                              capture_output=True, text=True, cwd=ROOT)
        if proc.returncode:
            raise SystemExit(proc.stdout[-2000:] + proc.stderr[-4000:])
        runs = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1][7:])["runs"]
    print(f"\n1. live teacher vs teacher cache (top-{top_k} of 512), tiny Qwen2 + LoRA r=8, batch 8 x 32, {steps} steps, "
          "XLA:CPU")
    print(f"{'':10}{'compiled step MiB':>18}{'steady ms/step':>16}{'final train loss':>18}"
          f"{'held-out CE':>13}")
    for name, r in runs.items():
        print(f"{name:10}{r['compiled_bytes'] / 2**20:18.2f}{r['steady_step_ms'] or float('nan'):16.1f}"
              f"{r['final_train_loss']:18.4f}{r['held_out_ce']:13.4f}")
    print(f"(train loss: each run's own objective, alpha * CE + (1 - alpha) * T^2 * KL, full or top-{top_k}; "
          f"held-out CE: the student's next-token loss on the held-out rows after training, "
          f"{runs['cached']['first_val_loss']:.4f} before)")
    c = runs["cached"]
    per_m = c["cache_bytes"] / c["cache_tokens"] * 1e6
    print(f"cache: {c['cache_bytes'] / 2**20:.2f} MiB for {c['cache_tokens']:,} tokens = {per_m / 2**30:.3f} GiB per "
          f"million tokens (int32 ids + float32 log-probabilities: {8 * top_k + 4} bytes per token)")


def guide_plan() -> None:
    from transformers import Qwen3Config

    from tpu_helpers.memory.hf_plan import hf_finetune_estimate, meta_model

    cfg = Qwen3Config(**QWEN3_06B)
    model = meta_model(cfg)
    print("\n2. plan of the guide's job: Qwen3-0.6B sizes, int4 QAT + recovery LoRA (all linear layers), top-128 "
          "cache, bf16, 1024 tokens per row; the guide measured 22, 24 and 28 GB on a v6e-1 (32 GB)")
    print(f"{'LoRA r':>7}{'batch':>6}{'ckpt':>6}{'plan GiB':>10}{'plan GB':>9}   peak at; weights / optimizer / "
          "activations (of which logits) GB")
    plan = {}
    for ckpt in (False, True):
        for r in (8, 16):
            for b in (4, 8):
                # The guide's runs took the whole batch's logits (before LOSS_CHUNK): loss_chunk=0 compares like
                # with like; benchmarks/chunked_loss.py --plan has the chunked step.
                est = hf_finetune_estimate(cfg, b, 1024, method="distill", lora_r=r, lora_targets="all-linear",
                                           precision="bf16", gradient_checkpointing=ckpt, model=model,
                                           teacher_topk=128, qat="int4", loss_chunk=0)
                bd = est.breakdown
                logits = (12 * 1024 * b * cfg.vocab_size + 24 * 1024 * b * 128) / 1e9
                peak = [n for n in est.notes if n.startswith("peak")][0]
                plan[r, b, ckpt] = est.peak_bytes / 1e9
                print(f"{r:7d}{b:6d}{'yes' if ckpt else 'no':>6}{est.peak_bytes / 2**30:10.1f}"
                      f"{est.peak_bytes / 1e9:9.1f}   {peak[6:]}; {bd['params'] / 1e9:.1f} / "
                      f"{bd['optimizer'] / 1e9:.2f} / {bd['activations'] / 1e9:.1f} ({logits:.1f})")
    lo, hi = min(GUIDE_PEAKS_GB), max(GUIDE_PEAKS_GB)
    print(f"\nagainst the guide's {' / '.join(map(str, GUIDE_PEAKS_GB))} GB (which run gave which is not stated; "
          "the plan's figures in GB):")
    for ckpt in (False, True):
        b4, b8 = plan[8, 4, ckpt], plan[8, 8, ckpt]
        print(f"  {'with' if ckpt else 'without'} checkpointing: batch 4 {b4:.1f} ({b4 - lo:+.1f} from {lo}, "
              f"{b4 - hi:+.1f} from {hi}), batch 8 {b8:.1f} ({b8 - hi:+.1f} from {hi}); each added row of 1024 "
              f"tokens {(b8 - b4) / 4:.2f} GB")
    print(f"  LoRA r=16 instead of 8 adds {plan[16, 4, False] - plan[8, 4, False]:.2f} GB in the plan; the guide's "
          f"peaks span {hi - lo} GB, so at most {(hi - lo) / 4:.2f} GB per added row if batch 8 gave the largest; "
          f"the logits alone (12 bytes x vocab per token) are {12 * 1024 * cfg.vocab_size / 1e9:.2f} GB per row")

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--top-k", type=int, default=32)
    parser.add_argument("--plan-only", action="store_true")
    args = parser.parse_args()
    if not args.plan_only:
        live_vs_cached(args.steps, args.top_k)
    guide_plan()


if __name__ == "__main__":
    main()
