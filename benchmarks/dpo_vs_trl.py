"""The same preference job through this package (`recipes.preference.Preference`) and through TRL's trainer, each
in its own process: seconds per step and the loss and preference-accuracy curves side by side. `--methods`: DPO
against `DPOTrainer`, KTO against `KTOTrainer`, SimPO against `trl.experimental.cpo`'s `CPOTrainer` (loss_type
"simpo"), a reward model (ALGORITHM "reward": the tiny model as a one-label sequence classifier, LoRA plus the
trained head, the Bradley-Terry loss) against `RewardTrainer`, one after the other.

    PYTHONPATH=. python benchmarks/dpo_vs_trl.py --steps 60               # CPU, both sides, DPO
    PYTHONPATH=. python benchmarks/dpo_vs_trl.py --methods kto,simpo --steps 60
    PYTHONPATH=. python benchmarks/dpo_vs_trl.py --methods reward --steps 60    # reward models
    PYTHONPATH=. python benchmarks/dpo_vs_trl.py --smoke --methods dpo,kto,simpo,reward   # CI: 3 steps of 2 pairs each
    PYTHONPATH=. python benchmarks/dpo_vs_trl.py --device xla --sides trl --trl-timeout 600   # TRL on XLA:CPU

TRL is not a dependency of the package: `--trl-python` names an interpreter that can import trl (the dev venv does);
when this interpreter cannot import it and none is given, the TRL side is skipped and the report says so.

The job, on both sides: the offline tiny Qwen2 (`hf.TINY`, built locally), LoRA r=16, alpha 32 on every linear
layer (the reference: the model with the adapter off), the generated preference pairs (`data.preference`: the
instruction task's right answer chosen, a wrong one rejected) as chat messages through the chat template, rows of
24 tokens (the longest pair's rows are 22: the package pads every row to SEQ_LEN, TRL each batch to its longest
row, so a SEQ_LEN far above the data costs the package time on the CPU), 8 pairs per step, DPO's sigmoid loss with
beta 0.1 (KTO: beta 0.1, weights 1, 8 completions per step of the pairs split into desirable and undesirable ones,
shuffled once for TRL, whose sampler keeps their order; SimPO: beta 2, gamma 0.5, cpo_alpha 0), AdamW (weight decay
0.1, clipping 1.0), lr 5e-3 with 10 warm-up steps and a cosine decay to 0.1 x, fp32, eager attention, dropout
off, the same seed (the data order differs: each side shuffles its own way). On the CPU the TRL process runs with
USE_TORCH_XLA=0: accelerate takes any process that can import torch_xla for an XLA one, even with use_cpu=True. Each
side is one process running the methods one after the other.

Printed per method and side: seconds per step after two warm-up steps (median), the mean loss and reward accuracy over the first and the
last 10 steps, on XLA the graphs compiled; then the loss of every 5th step, side by side. `--device xla` runs on
XLA:CPU (PJRT_DEVICE=CPU); `--trl-timeout` bounds the TRL side and the report says how far it got. With TRL 1.16,
accelerate 1.15 and transformers 5.24 on XLA:CPU: with its default gradient checkpointing TRL fails in its first
forward (torch.utils.checkpoint looks up `torch.xla` for the device type "xla": AttributeError); without it, at its
first optimizer step (transformers' default fused AdamW refuses XLA tensors); with plain AdamW (what this script
asks for on XLA) it trains, compiling 46 graphs in 10 steps (each batch padded to its own longest row, and the
metrics read with .item() in every step): 134 s for 10 steps, a median step of 0.618 s, against the package's 56 s
with 2 graphs and 0.462 s (load average 6.4 on 2 shared cores).
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
JOB = dict(batch_size=8, seq_len=24, lr=5e-3, warmup_steps=10, lora_r=16, lora_alpha=32, seed=0)
SMOKE_JOB = dict(batch_size=2, warmup_steps=1)  # --smoke (CI): every part, toy-sized
# Each method's settings, by the package's names (TRL's configs take the same names).
METHODS = {"dpo": dict(beta=0.1), "kto": dict(beta=0.1, desirable_weight=1.0, undesirable_weight=1.0),
           "simpo": dict(beta=2.0, simpo_gamma=0.5, cpo_alpha=0.0), "reward": {}}


def run_package(args, method: str) -> dict:
    from tpu_helpers.core.callbacks import Callback
    from tpu_helpers.recipes.preference import Preference, PreferenceConfig

    stamps: list[float] = []

    class Clock(Callback):
        def on_step_end(self, trainer):
            trainer.backend.sync()
            stamps.append(time.perf_counter())

    cfg = PreferenceConfig(dataset="instructions", algorithm=method, loss_type="sigmoid", steps=args.steps,
                           log_every=1, save_every=args.steps, eval_every=args.steps, device=args.device,
                           precision="fp32", out_dir=str(Path(args.out) / f"package-{method}-{args.device}"),
                           resume="force_new", xla_checks="off", compile_cache_dir=None, export_merged=False,
                           lora_targets="all-linear", attn_implementation="eager", max_records=4000, **JOB,
                           **METHODS[method])
    job = Preference(cfg, progress=False, callbacks=[Clock()])
    report = job.train()
    rows = job.history.train
    return _summary(stamps, [r["loss"] for r in rows], [r["rewards/accuracy"] for r in rows],
                    report.xla.get("compilations") if report.xla else None)


def run_trl(args, method: str) -> dict:
    import datasets
    import torch
    from peft import LoraConfig
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        AutoTokenizer,
        TrainerCallback,
    )

    from tpu_helpers.data.preference import preference_records
    from tpu_helpers.models import hf

    stamps: list[float] = []
    losses: list[float] = []
    accuracy: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, targs, state, control, **kw):
            stamps.append(time.perf_counter())

        def on_log(self, targs, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                losses.append(logs["loss"])
                accuracy.append(logs.get("rewards/accuracies", logs.get("accuracy")))

    source = hf.resolve_model_source(hf.TINY)
    tok = AutoTokenizer.from_pretrained(source)
    data = datasets.Dataset.from_list([
        {"prompt": [{"role": "user", "content": r["prompt"]}],
         "chosen": [{"role": "assistant", "content": r["chosen"]}],
         "rejected": [{"role": "assistant", "content": r["rejected"]}]} for r in preference_records(4000)])
    if method == "reward":  # a one-label sequence classifier: a new head on the same model
        model = AutoModelForSequenceClassification.from_pretrained(source, num_labels=1, attn_implementation="eager",
                                                                   dtype=torch.float32)
        model.config.pad_token_id = tok.pad_token_id
    else:
        model = AutoModelForCausalLM.from_pretrained(source, attn_implementation="eager", dtype=torch.float32)
    settings = METHODS[method]
    common = dict(output_dir=str(Path(args.out) / f"trl-{method}-{args.device}"), max_steps=args.steps,
                  per_device_train_batch_size=JOB["batch_size"], gradient_accumulation_steps=1,
                  max_length=JOB["seq_len"], learning_rate=JOB["lr"], warmup_steps=JOB["warmup_steps"],
                  lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr_rate": 0.1},
                  weight_decay=0.1, max_grad_norm=1.0, logging_steps=1, save_strategy="no", report_to=[],
                  seed=JOB["seed"], use_cpu=args.device == "cpu", bf16=False, fp16=False, dataloader_num_workers=0,
                  disable_tqdm=True, disable_dropout=True, gradient_checkpointing=args.trl_checkpointing,
                  # transformers' default AdamW is the fused one, which refuses XLA tensors
                  optim="adamw_torch" if args.device == "xla" else "adamw_torch_fused", **settings)
    if method == "dpo":
        from trl import DPOConfig as Config
        from trl import DPOTrainer as Trainer

        common["loss_type"] = ["sigmoid"]
    elif method == "kto":
        from trl import KTOConfig as Config
        from trl import KTOTrainer as Trainer
        from trl.data_utils import unpair_preference_dataset

        # TRL's sampler keeps the data's order (its KL completions rotate within each batch): unpaired, the
        # desirable completions come first, so they are shuffled once, as a user would.
        data = unpair_preference_dataset(data).shuffle(seed=JOB["seed"])
    elif method == "reward":
        from trl import RewardConfig as Config
        from trl import RewardTrainer as Trainer
    else:
        from trl.experimental.cpo import CPOConfig as Config
        from trl.experimental.cpo import CPOTrainer as Trainer

        common["loss_type"] = "simpo"
    lora = LoraConfig(r=JOB["lora_r"], lora_alpha=JOB["lora_alpha"], lora_dropout=0.0, target_modules="all-linear",
                      task_type="SEQ_CLS" if method == "reward" else "CAUSAL_LM")
    trainer = Trainer(model=model, args=Config(**common), train_dataset=data, processing_class=tok, peft_config=lora,
                      callbacks=[Clock()])
    backend = None
    if args.device == "xla":
        from tpu_helpers.backend import get_backend

        backend = get_backend("xla", spmd=False, compile_cache_dir=None)
        before = backend.metrics().get("compilations", 0)  # the process's earlier methods compiled theirs
    trainer.train()
    compilations = backend.metrics().get("compilations", 0) - before if backend is not None else None
    return _summary(stamps, losses, accuracy, compilations, device=str(trainer.accelerator.device))


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def _summary(stamps, losses, accuracy, compilations, device=None) -> dict:
    # The steps after two warm-up ones (on XLA the first compiles the step and the second once more, when AdamW's
    # state appears: their 10-40 s would swamp a mean of a few steps), their median.
    steady = [b - a for a, b in zip(stamps[1:], stamps[2:], strict=False)]
    return {"steps": len(stamps), "step_s": statistics.median(steady) if steady else None, "losses": losses,
            "loss_first10": _mean(losses[:10]), "loss_last10": _mean(losses[-10:]),
            "acc_first10": _mean(accuracy[:10]), "acc_last10": _mean(accuracy[-10:]),
            "compilations": compilations, "device": device}


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--methods", default="dpo", help="comma separated: dpo, kto, simpo, reward (one run of each)")
    parser.add_argument("--device", choices=["cpu", "xla"], default="cpu")
    parser.add_argument("--sides", default="package,trl")
    parser.add_argument("--trl-python", default=sys.executable, help="an interpreter that can import trl")
    parser.add_argument("--trl-timeout", type=float, default=None, help="seconds before the TRL side is stopped")
    parser.add_argument("--trl-checkpointing", action="store_true",
                        help="TRL's default gradient checkpointing (off here: the package's job recomputes nothing)")
    parser.add_argument("--out", default=None, help="output directory (default: a temporary one)")
    parser.add_argument("--child", choices=["package", "trl"], help=argparse.SUPPRESS)
    parser.add_argument("--smoke", action="store_true", help="3 steps of 2 pairs (CI)")
    args = parser.parse_args()
    if args.smoke:
        args.steps = 3
        JOB.update(SMOKE_JOB)
    methods = args.methods.split(",")
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        parser.error(f"--methods {args.methods!r}: {unknown} not among {sorted(METHODS)}")
    if args.child:
        threads = os.environ.get("BENCH_THREADS")
        if threads:
            import torch

            torch.set_num_threads(int(threads))
        run = run_package if args.child == "package" else run_trl
        print(json.dumps({method: run(args, method) for method in methods}))
        return
    args.out = args.out or tempfile.mkdtemp(prefix="dpo_vs_trl_")
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; {args.steps} steps of each of "
          f"{', '.join(m.upper() for m in methods)}, {JOB['batch_size']} pairs (KTO: completions) x {JOB['seq_len']} "
          f"tokens on {args.device}, the tiny Qwen2 under LoRA; output in {args.out}", flush=True)
    results = {side: run_side(args, side) for side in args.sides.split(",")}
    for method in methods:
        curves = {}
        for side, by_method in results.items():
            if by_method is None:
                continue
            r = by_method[method]
            curves[side] = r["losses"]
            print(f"{method:5} {side:8} {_fmt(r['step_s'])} s/step after 2 warm-up steps (median), loss "
                  f"{_fmt(r['loss_first10'])} (first 10 steps) -> {_fmt(r['loss_last10'])} (last 10), reward accuracy "
                  f"{_fmt(r['acc_first10'])} -> {_fmt(r['acc_last10'])}, graphs {r['compilations']}"
                  + (f", device {r['device']}" if r["device"] else ""), flush=True)
        if curves:
            sides = sorted(curves)
            print(f"{method} loss by step: step " + " ".join(f"{s:>8}" for s in sides))
            for step in range(1, args.steps + 1):
                if step % 5 == 0 or step == 1 or step == args.steps:
                    print(f"  {step:4d} " + " ".join(
                        f"{_fmt(curves[s][step - 1]) if step <= len(curves[s]) else '-':>8}" for s in sides))


def run_side(args, side: str) -> dict | None:
    """One side's process, every method of --methods in it one after the other: {method: figures}, or None (said)."""
    python = args.trl_python if side == "trl" else sys.executable
    if side == "trl" and python == sys.executable and importlib.util.find_spec("trl") is None:
        print("trl: skipped (trl is not installed in this interpreter: pass --trl-python, see above)", flush=True)
        return None
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if args.device == "xla":
        env.setdefault("PJRT_DEVICE", "CPU")
    elif side == "trl":  # accelerate takes any process that can import torch_xla for an XLA one (even with use_cpu)
        env["USE_TORCH_XLA"] = "0"
    cmd = [python, __file__, "--child", side, "--methods", args.methods, "--steps", str(args.steps), "--device",
           args.device, "--out", args.out] + (["--smoke"] if args.smoke else []) + (
        ["--trl-checkpointing"] if args.trl_checkpointing else [])
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                              timeout=args.trl_timeout if side == "trl" else None)
    except subprocess.TimeoutExpired as err:
        tail = err.stderr or b""
        tail = tail.decode(errors="replace") if isinstance(tail, bytes) else tail
        print(f"{side}: stopped after {args.trl_timeout:.0f} s without finishing {args.steps} steps of each method\n"
              f"{tail[-1500:]}", flush=True)
        return None
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        print(f"{side}: failed (exit {proc.returncode}) after {wall:.0f} s\n{proc.stderr[-3000:]}", flush=True)
        return None
    print(f"{side}: process {wall:.0f} s", flush=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
