"""The same on-policy distillation job through this package (`recipes.finetune.Finetune`, METHOD "distill" with
DISTILL_LAMBDA 1) and through TRL's `GKDTrainer` (`trl.experimental.gkd`, lmbda 1), each in its own process: seconds
per step (the student's answers, the teacher's and the student's passes, the update) and the loss side by side.

    PYTHONPATH=. python benchmarks/onpolicy_distill_vs_trl.py --steps 30          # CPU, both sides
    PYTHONPATH=. python benchmarks/onpolicy_distill_vs_trl.py --smoke             # CI: 3 steps of 2 prompts
    PYTHONPATH=. python benchmarks/onpolicy_distill_vs_trl.py --device xla --sides package   # graphs on XLA:CPU

TRL is not a dependency of the package: `--trl-python` names an interpreter that can import trl (the dev venv does);
when this interpreter cannot import it and none is given, the TRL side is skipped and the report says so.

The job, on both sides: the offline tiny Qwen2 (`hf.TINY`) as the student under LoRA r=16, alpha 32 on every linear
layer, the tiny Qwen2 of another seed (the same tokenizer, other weights) as the frozen teacher, the generated
instruction task as chat messages, 8 prompts per step, each answered by the student with 8 new tokens sampled at
temperature 1 (TRL: top_k 0, top_p 1), the generalized JSD with beta 0.5 at temperature 1 on the answer's tokens,
AdamW at lr 5e-4 with 2 warm-up steps, fp32, eager attention. The package's rows are SEQ_LEN 48 wide (prompt and
answer in fixed shapes), TRL's each batch's own length. On the CPU the TRL process runs with USE_TORCH_XLA=0
(accelerate takes any process that can import torch_xla for an XLA one).

Printed per side: seconds per step after two warm-up steps (median), the mean loss over the first and the last 5
steps, on XLA the graphs compiled; then the loss of every 5th step side by side.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
JOB = dict(batch_size=8, seq_len=48, max_new_tokens=8, beta=0.5, lr=5e-4, warmup_steps=2, lora_r=16, lora_alpha=32,
           seed=0)
SMOKE_JOB = dict(batch_size=2, max_new_tokens=4, warmup_steps=1)  # --smoke (CI): every part, toy-sized


def _teacher() -> str:
    from tpu_helpers.models.hf_tiny import tiny_model_dir

    return str(tiny_model_dir(seed=1))  # the student's tokenizer, other weights


def run_package(args) -> dict:
    from tpu_helpers.core.callbacks import Callback
    from tpu_helpers.recipes.finetune import Finetune, FinetuneConfig

    stamps: list[float] = []

    class Clock(Callback):
        def on_step_end(self, trainer):
            trainer.backend.sync()
            stamps.append(time.perf_counter())

    cfg = FinetuneConfig(dataset="instructions", method="distill", teacher=_teacher(), distill_lambda=1.0,
                         distill_beta=JOB["beta"], distill_alpha=0.0, distill_temperature=1.0,
                         max_new_tokens=JOB["max_new_tokens"], steps=args.steps, log_every=1,
                         save_every=args.steps, eval_every=args.steps, eval_batches=1, device=args.device,
                         precision="fp32", out_dir=str(Path(args.out) / f"package-{args.device}"),
                         resume="force_new", xla_checks="off", compile_cache_dir=None, export_merged=False,
                         lora_targets="all-linear", attn_implementation="eager", max_records=400,
                         replay_steps=args.replay, batch_size=JOB["batch_size"], seq_len=JOB["seq_len"],
                         lr=JOB["lr"], warmup_steps=JOB["warmup_steps"], lora_r=JOB["lora_r"],
                         lora_alpha=JOB["lora_alpha"], seed=JOB["seed"])
    job = Finetune(cfg, progress=False, callbacks=[Clock()])
    report = job.train()
    return _summary(stamps, [r["loss"] for r in job.history.train],
                    report.xla.get("compilations") if report.xla else None)


def run_trl(args) -> dict:
    import datasets
    import torch
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl.experimental.gkd import GKDConfig, GKDTrainer

    from tpu_helpers.data.sft import instruction_records
    from tpu_helpers.models import hf

    stamps: list[float] = []
    losses: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, targs, state, control, **kw):
            stamps.append(time.perf_counter())

        def on_log(self, targs, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                losses.append(logs["loss"])

    source = hf.resolve_model_source(hf.TINY)
    tok = AutoTokenizer.from_pretrained(source)
    data = datasets.Dataset.from_list(instruction_records(400))
    model = AutoModelForCausalLM.from_pretrained(source, attn_implementation="eager", dtype=torch.float32)
    teacher = AutoModelForCausalLM.from_pretrained(_teacher(), attn_implementation="eager", dtype=torch.float32)
    targs = GKDConfig(output_dir=str(Path(args.out) / f"trl-{args.device}"), max_steps=args.steps,
                      per_device_train_batch_size=JOB["batch_size"], gradient_accumulation_steps=1,
                      lmbda=1.0, beta=JOB["beta"], temperature=1.0, max_new_tokens=JOB["max_new_tokens"],
                      max_length=JOB["seq_len"], learning_rate=JOB["lr"], warmup_steps=JOB["warmup_steps"],
                      logging_steps=1, save_strategy="no", report_to=[], seed=JOB["seed"],
                      use_cpu=args.device == "cpu", bf16=False, fp16=False, dataloader_num_workers=0,
                      disable_tqdm=True, gradient_checkpointing=False,
                      optim="adamw_torch" if args.device == "xla" else "adamw_torch_fused")
    lora = LoraConfig(r=JOB["lora_r"], lora_alpha=JOB["lora_alpha"], lora_dropout=0.0, target_modules="all-linear",
                      task_type="CAUSAL_LM")
    trainer = GKDTrainer(model=model, teacher_model=teacher, args=targs, train_dataset=data, processing_class=tok,
                         peft_config=lora, callbacks=[Clock()])
    trainer.train()
    return _summary(stamps, losses, None, device=str(trainer.accelerator.device))


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def _summary(stamps, losses, compilations, device=None) -> dict:
    # The steps after two warm-up ones (on XLA the first compiles the step and the second once more), their median.
    steady = [b - a for a, b in zip(stamps[1:], stamps[2:], strict=False)]
    return {"steps": len(stamps), "step_s": statistics.median(steady) if steady else None, "losses": losses,
            "loss_first5": _mean(losses[:5]), "loss_last5": _mean(losses[-5:]), "compilations": compilations,
            "device": device}


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--device", choices=["cpu", "xla"], default="cpu")
    parser.add_argument("--sides", default="package,trl")
    parser.add_argument("--replay", action="store_true", help="the package's REPLAY_STEPS (XLA)")
    parser.add_argument("--trl-python", default=sys.executable, help="an interpreter that can import trl")
    parser.add_argument("--out", default=None, help="output directory (default: a temporary one)")
    parser.add_argument("--child", choices=["package", "trl"], help=argparse.SUPPRESS)
    parser.add_argument("--smoke", action="store_true", help="3 steps of 2 prompts (CI)")
    args = parser.parse_args()
    if args.smoke:
        args.steps = 3
        JOB.update(SMOKE_JOB)
    if args.child:
        threads = os.environ.get("BENCH_THREADS")
        if threads:
            import torch

            torch.set_num_threads(int(threads))
        print(json.dumps((run_package if args.child == "package" else run_trl)(args)))
        return
    args.out = args.out or tempfile.mkdtemp(prefix="onpolicy_distill_vs_trl_")
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; {args.steps} on-policy distillation "
          f"steps of {JOB['batch_size']} prompts x {JOB['max_new_tokens']} new tokens on {args.device}, the tiny "
          f"Qwen2 under LoRA; output in {args.out}", flush=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if args.device == "xla":
        env.setdefault("PJRT_DEVICE", "CPU")
    curves = {}
    for side in args.sides.split(","):
        python = args.trl_python if side == "trl" else sys.executable
        if side == "trl" and python == sys.executable and importlib.util.find_spec("trl") is None:
            print("trl: skipped (trl is not installed in this interpreter: pass --trl-python, see above)", flush=True)
            continue
        side_env = {**env, "USE_TORCH_XLA": "0"} if side == "trl" and args.device == "cpu" else env
        cmd = [python, __file__, "--child", side, "--steps", str(args.steps), "--device", args.device, "--out",
               args.out] + (["--smoke"] if args.smoke else []) + (["--replay"] if args.replay else [])
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, env=side_env, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            print(f"{side}: failed (exit {proc.returncode}) after {wall:.0f} s\n{proc.stderr[-3000:]}", flush=True)
            continue
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        curves[side] = r["losses"]
        print(f"{side:8} {_fmt(r['step_s'])} s/step after 2 warm-up steps (median), loss {_fmt(r['loss_first5'])} "
              f"(first 5 steps) -> {_fmt(r['loss_last5'])} (last 5), graphs {r['compilations']}, process {wall:.0f} s"
              + (f", device {r['device']}" if r["device"] else ""), flush=True)
    if curves:
        sides = sorted(curves)
        print("loss by step: step " + " ".join(f"{s:>8}" for s in sides))
        for step in range(1, args.steps + 1):
            if step % 5 == 0 or step == 1 or step == args.steps:
                print(f"  {step:4d} " + " ".join(f"{_fmt(curves[s][step - 1]) if step <= len(curves[s]) else '-':>8}"
                                             for s in sides))


if __name__ == "__main__":
    main()
