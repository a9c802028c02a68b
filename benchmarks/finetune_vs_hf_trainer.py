"""The same LoRA SFT job through this package and through the Hugging Face Trainer with peft, on XLA:CPU.

    PYTHONPATH=. python benchmarks/finetune_vs_hf_trainer.py --steps 60 --batch-size 8 --seq-len 128

Both sides train the offline tiny Qwen2 (`load_causal_lm("tiny")`, same attention implementation) with peft LoRA
(r=8, alpha=16, q/k/v/o), on the same tokenized instruction records (`build_sft_datasets`, labels -100 on prompt
and padding), AdamW with the same learning rate, warm-up, cosine decay, weight decay and clipping, and log the loss
every 10 steps; each side runs in its own process (PJRT_DEVICE=CPU) so their XLA metrics are separate. Printed per
side: compilations and device-to-host transfers during the first `--window-end` training steps (the package's
evaluation before step 1 is not counted; the HF side evaluates nothing), and steady tokens/s (padded tokens) between
the log steps `--window-start` and `--window-end`, where both sides read the loss on the host and so wait for the
device. Targets: the package compiles and transfers no more than the HF Trainer, and its steady
throughput is at least equal (ratio >= 1).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


def _data(tokenizer, args):
    from tpu_helpers.data.sft import build_sft_datasets, load_records

    records = load_records("instructions", max_records=args.records)
    train, _, _ = build_sft_datasets(tokenizer, records, seq_len=args.seq_len, seed=0)
    return train


def _probe(window: dict, step: int, args, metrics) -> None:
    if step in (args.window_start, args.window_end):
        window[step] = (time.perf_counter(), metrics())


def run_package(args) -> dict:
    from functools import cached_property

    from tpu_helpers.core.callbacks import Callback
    from tpu_helpers.recipes.finetune import Finetune, FinetuneConfig

    window: dict = {}

    class Clock(Callback):
        def on_step_end(self, trainer):
            _probe(window, trainer.step, args, trainer.backend.metrics)

    class SameData(Finetune):  # the rows both sides train on, instead of the recipe's own
        @cached_property
        def _data(self):
            rows = _data(self.tokenizer, args)
            return rows, rows, {}, []

    with tempfile.TemporaryDirectory() as out:
        cfg = FinetuneConfig(device="xla", steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len,
                             lr=args.lr, warmup_steps=5, weight_decay=0.1, grad_clip=1.0, eval_every=args.steps,
                             eval_batches=1, log_every=10, save_every=args.steps, out_dir=out, resume=False,
                             compile_cache_dir=None, xla_checks="off", method="lora", lora_r=8, lora_alpha=16,
                             lora_targets=",".join(TARGETS), max_records=args.records, export_merged=False,
                             attn_implementation=args.attn)
        job = SameData(cfg, progress=False, callbacks=[Clock()])
        report = job.train()
        losses = [r["loss"] for r in job.history.train]
    return _summary(window, args, losses, report.xla.get("cpu_fallback_ops", {}))


def run_hf(args) -> dict:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import Trainer, TrainerCallback, TrainingArguments, default_data_collator

    from tpu_helpers.backend.xla import xla_metrics
    from tpu_helpers.models import hf

    model, tokenizer = hf.load_causal_lm("tiny", attn_implementation=args.attn)
    torch.manual_seed(0)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=TARGETS,
                                             task_type="CAUSAL_LM"))
    train = _data(tokenizer, args)
    window: dict = {}
    losses: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, targs, state, control, **kw):
            _probe(window, state.global_step, args, xla_metrics)

        def on_log(self, targs, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))

    with tempfile.TemporaryDirectory() as out:
        targs = TrainingArguments(output_dir=out, per_device_train_batch_size=args.batch_size, max_steps=args.steps,
                                  learning_rate=args.lr, warmup_steps=5, lr_scheduler_type="cosine",
                                  weight_decay=0.1, max_grad_norm=1.0, logging_steps=10, save_strategy="no",
                                  eval_strategy="no", report_to=[], disable_tqdm=True, dataloader_drop_last=True,
                                  optim="adamw_torch", seed=0)
        trainer = Trainer(model=model, args=targs, train_dataset=train, data_collator=default_data_collator,
                          callbacks=[Clock()])
        trainer.train()
    return _summary(window, args, losses, {})


def _summary(window: dict, args, losses: list[float], fallbacks: dict) -> dict:
    (t0, m0), (t1, m1) = window[args.window_start], window[args.window_end]
    tokens = (args.window_end - args.window_start) * args.batch_size * args.seq_len
    return {"compilations": m1["compilations"], "transfers": m1["device_to_host_transfers"],
            "steady_compilations": m1["compilations"] - m0["compilations"],
            "steady_transfers": m1["device_to_host_transfers"] - m0["device_to_host_transfers"],
            "tokens_per_s": tokens / (t1 - t0), "step_ms": 1000 * (t1 - t0) / (args.window_end - args.window_start),
            "first_loss": losses[0] if losses else None, "last_loss": losses[-1] if losses else None,
            "cpu_fallback_ops": fallbacks}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--side", choices=["package", "hf"], help="run one side here (the parent runs both)")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--records", type=int, default=2000)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--attn", default="eager", choices=["eager", "sdpa"], help="attention implementation")
    ap.add_argument("--sides", default="package,hf", help="which sides to run (comma-separated)")
    ap.add_argument("--window-start", type=int, default=20)
    ap.add_argument("--window-end", type=int, default=50)
    args = ap.parse_args()
    if not (10 <= args.window_start < args.window_end < args.steps and args.window_start % 10 == 0
            and args.window_end % 10 == 0):
        ap.error("need 10 <= --window-start < --window-end < --steps, both multiples of the log interval (10)")
    if args.side:
        out = run_package(args) if args.side == "package" else run_hf(args)
        print("RESULT " + json.dumps(out))
        return
    env = {**os.environ, "PJRT_DEVICE": "CPU",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    env.pop("CPU_NUM_DEVICES", None)
    results = {}
    for side in args.sides.split(","):
        t = time.perf_counter()
        proc = subprocess.run([sys.executable, __file__, "--side", side, *sys.argv[1:]], env=env,
                              capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"{side} side failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1]
        results[side] = {**json.loads(line[len("RESULT "):]), "wall_s": time.perf_counter() - t}
    print(f"LoRA SFT, tiny Qwen2 ({args.attn} attention), batch {args.batch_size} x {args.seq_len} tokens, {args.steps} steps, XLA:CPU "
          f"(load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")
    print(f"{'':10}{'compiles':>10}{'transfers':>11}{'steady c/t':>12}{'tokens/s':>10}{'ms/step':>9}"
          f"{'loss first->last':>20}{'wall s':>8}")
    for side, r in results.items():
        print(f"{side:10}{r['compilations']:>10}{r['transfers']:>11}"
              f"{str(r['steady_compilations']) + '/' + str(r['steady_transfers']):>12}{r['tokens_per_s']:>10.0f}"
              f"{r['step_ms']:>9.1f}{r['first_loss']:>10.3f}->{r['last_loss']:<8.3f}{r['wall_s']:>8.0f}")
    if {"package", "hf"} <= results.keys():
        ratio = results["package"]["tokens_per_s"] / results["hf"]["tokens_per_s"]
        print(f"steady throughput ratio package / HF Trainer: {ratio:.2f}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
