"""The same GRPO job through this package (`recipes.grpo.GRPO`) and through TRL's `GRPOTrainer`, each in its own process.

    PYTHONPATH=. python benchmarks/grpo_vs_trl.py --steps 60 --trl-python /path/to/venv-with-trl/bin/python
    PYTHONPATH=. python benchmarks/grpo_vs_trl.py --smoke    # CI: 3 steps of 2 prompts x 2 samples, 5 SFT steps
    PYTHONPATH=. python benchmarks/grpo_vs_trl.py --model smollm2-135m --batch 4 --generations 8 --new-tokens 8 \
        --prompt-len 48 --lr 1e-3 --steps 6 --trl-python ...   # the offline real model, no warm start

TRL is not a dependency of the package: `--trl-python` names an interpreter that can import trl and the package's
dependencies (e.g. a throwaway venv with a .pth file pointing at the dev venv's site-packages and `pip install trl`).
Without it, when this interpreter cannot import trl, the TRL side is skipped and the report says so.

The job, on both sides: the offline tiny Qwen2 briefly fine-tuned on the generated instruction task (the package's
START_FROM="sft" warm start, made once in the output directory and then loaded by both sides), LoRA r=16, alpha 32
on every linear layer, the generated sums (`data.rl.sum_records`, prompts through the chat template), the
package's `answer` reward (`algorithms.rewards.answer_reward`), 8 prompts x 8 samples per step, 4 new tokens,
temperature 1, beta 0.04, epsilon 0.2, one update per generation, the loss averaged over the step's completion
tokens ("dapo" in TRL), rewards scaled by the group's std, AdamW (weight decay 0.1, clipping 1.0), lr 5e-3 with
10 warm-up steps and a cosine decay to 0.1 x, fp32, eager attention, the same seed. On the CPU the TRL process
runs with USE_TORCH_XLA=0: accelerate takes any process that can import torch_xla for an XLA one, even with
use_cpu=True, and then fails in `gather_object`.

`--device cuda` runs the package side on a CUDA GPU (its rollouts' decode replayed as a CUDA graph; TRL needs
`--trl-python` there too); `--model DIR` may be any saved model, e.g. SmolLM2's shape with random weights where the
real weights cannot reach the GPU machine. `--sides package-replay` runs the package side with `replay_steps=True` (on XLA the policy's forward and backward
and AdamW's step replayed instead of traced every step; the same as `package` elsewhere).

Printed per side: seconds per step after the first (mean), the main thread's CPU time per step (host CPU: on XLA
the tracing and dispatch a TPU would wait for, where the wall time of XLA:CPU is its own arithmetic), the share of
the step's wall time spent in generation (the package's rollouts' `generate_ids`, TRL's `model.generate`) and of
its host CPU (on the CPU device the arithmetic of one thread: the share a busy machine does not skew), the mean reward over the first and the last 10 steps, and on XLA the graphs
compiled. `--device xla` runs both sides on XLA:CPU (PJRT_DEVICE=CPU); TRL then goes through accelerate's XLA
support and `model.generate` with a dynamic cache, whose shapes grow with every token (a graph per token and
per prompt length): `--trl-timeout` bounds it and the report says how far it got. With TRL 1.16 and accelerate
1.15 it gets no further than its first step: after generating and scoring it gathers the prompts for its logs
with `accelerate.utils.gather_object`, which raises "gather objects in TPU is not supported" on XLA.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
JOB = dict(batch_size=8, num_generations=8, max_prompt_len=32, max_new_tokens=4, temperature=1.0, kl_beta=0.04,
           clip_eps=0.2, lr=5e-3, warmup_steps=10, lora_r=16, lora_alpha=32, seed=0)
# The job's settings a flag may change: (argument name, JOB key).
OVERRIDES = (("batch", "batch_size"), ("generations", "num_generations"), ("prompt_len", "max_prompt_len"),
             ("new_tokens", "max_new_tokens"), ("lr", "lr"))
SMOKE_JOB = dict(batch_size=2, num_generations=2, warmup_steps=1)  # --smoke (CI): every part, toy-sized


def _timed(fn, seconds: list):
    """`fn`, appending (wall seconds, the calling thread's CPU seconds) of each call to `seconds`."""
    def wrapper(*args, **kwargs):
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            seconds.append((time.perf_counter() - t0, time.thread_time() - c0))
    return wrapper


def start_model(args) -> str:
    """`--model` as it is (resolved to its directory), else the SFT'd tiny model (the package's warm start), made
    once under the output directory."""
    from tpu_helpers.models.hf import resolve_model_source
    from tpu_helpers.recipes.grpo import GRPO, GRPOConfig

    if args.model:
        return resolve_model_source(args.model)

    cfg = GRPOConfig(out_dir=str(Path(args.out) / "warm"), device="cpu", sft_steps=args.sft_steps)
    return GRPO(cfg, progress=False).start_source


def run_package(args) -> dict:
    from tpu_helpers.algorithms import rollouts
    from tpu_helpers.core.callbacks import Callback
    from tpu_helpers.recipes.grpo import GRPO, GRPOConfig

    stamps: list[tuple[float, float]] = []
    gen: list[float] = []
    rollouts.generate_ids = _timed(rollouts.generate_ids, gen)  # the rollouts generate (algorithms/rollouts.py)

    class Clock(Callback):
        def on_step_end(self, trainer):
            trainer.backend.sync()
            stamps.append((time.perf_counter(), time.thread_time()))

    cfg = GRPOConfig(model=args.start, start_from=None, dataset="sums", rewards="answer", steps=args.steps,
                     log_every=1, save_every=args.steps, eval_every=args.steps, device=args.device,
                     precision="fp32", out_dir=str(Path(args.out) / f"{args.child}-{args.device}"), resume="force_new",
                     xla_checks="off", compile_cache_dir=None, export_merged=False,
                     replay_steps=args.child == "package-replay", **JOB)
    job = GRPO(cfg, progress=False, callbacks=[Clock()])
    report = job.train()
    rewards = [r["reward"] for r in job.history.train]
    return _summary(stamps, gen, rewards, report.xla.get("compilations") if report.xla else None)


def run_trl(args) -> dict:
    import datasets
    import torch
    import transformers
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from tpu_helpers.algorithms.rewards import answer_reward
    from tpu_helpers.data.rl import prompt_text, sum_records

    gen: list[float] = []
    transformers.GenerationMixin.generate = _timed(transformers.GenerationMixin.generate, gen)
    stamps: list[tuple[float, float]] = []
    rewards: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, targs, state, control, **kw):
            stamps.append((time.perf_counter(), time.thread_time()))

        def on_log(self, targs, state, control, logs=None, **kw):
            if logs and "reward" in logs:
                rewards.append(logs["reward"])

    tok = AutoTokenizer.from_pretrained(args.start)
    records = sum_records(2000)
    data = datasets.Dataset.from_list([{"prompt": prompt_text(tok, r["prompt"]), "answer": r["answer"]}
                                       for r in records])
    model = AutoModelForCausalLM.from_pretrained(args.start, attn_implementation="eager", dtype=torch.float32)
    rows = JOB["batch_size"] * JOB["num_generations"]
    targs = GRPOConfig(output_dir=str(Path(args.out) / f"trl-{args.device}"), max_steps=args.steps,
                       per_device_train_batch_size=rows, gradient_accumulation_steps=1,
                       num_generations=JOB["num_generations"], max_completion_length=JOB["max_new_tokens"],
                       temperature=JOB["temperature"], top_k=0, top_p=1.0, beta=JOB["kl_beta"],
                       epsilon=JOB["clip_eps"], num_iterations=1, loss_type="dapo", scale_rewards="group",
                       learning_rate=JOB["lr"], warmup_steps=JOB["warmup_steps"],
                       lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr_rate": 0.1},
                       weight_decay=0.1, max_grad_norm=1.0, logging_steps=1, save_strategy="no", report_to=[],
                       seed=JOB["seed"], use_cpu=args.device == "cpu", bf16=False, fp16=False,
                       dataloader_num_workers=0, disable_tqdm=True)
    lora = LoraConfig(r=JOB["lora_r"], lora_alpha=JOB["lora_alpha"], lora_dropout=0.0, target_modules="all-linear",
                      task_type="CAUSAL_LM")
    trainer = GRPOTrainer(model=model, reward_funcs=[answer_reward], args=targs, train_dataset=data,
                          processing_class=tok, peft_config=lora, callbacks=[Clock()])
    trainer.train()
    compilations = None
    if args.device == "xla":
        from tpu_helpers.backend import get_backend

        compilations = get_backend("xla", spmd=False, compile_cache_dir=None).metrics().get("compilations")
    return _summary(stamps, gen, rewards, compilations, device=str(trainer.accelerator.device))


def _summary(stamps, gen, rewards, compilations, device=None) -> dict:
    steady = [b[0] - a[0] for a, b in zip(stamps, stamps[1:], strict=False)]  # every step after the first
    host = [b[1] - a[1] for a, b in zip(stamps, stamps[1:], strict=False)]  # the main thread's CPU time
    steps = len(steady)
    gen_steady = sum(g[0] for g in gen[-steps:]) if steps else 0.0
    gen_host = sum(g[1] for g in gen[-steps:]) if steps else 0.0
    return {"steps": len(stamps), "step_s": sum(steady) / steps if steps else None,
            "host_s": sum(host) / steps if steps else None,
            "generation_share": gen_steady / sum(steady) if steady else None,
            "generation_host_share": gen_host / sum(host) if host and sum(host) else None,
            "reward_first10": sum(rewards[:10]) / max(1, len(rewards[:10])),
            "reward_last10": sum(rewards[-10:]) / max(1, len(rewards[-10:])), "compilations": compilations,
            "device": device}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--sft-steps", type=int, default=150)
    parser.add_argument("--device", choices=["cpu", "xla", "cuda"], default="cpu")
    parser.add_argument("--sides", default="package,trl")
    parser.add_argument("--trl-python", default=sys.executable, help="an interpreter that can import trl")
    parser.add_argument("--trl-timeout", type=float, default=None, help="seconds before the TRL side is stopped")
    parser.add_argument("--out", default=None, help="output directory (default: a temporary one)")
    parser.add_argument("--child", choices=["package", "package-replay", "trl"], help=argparse.SUPPRESS)
    parser.add_argument("--start", help=argparse.SUPPRESS)
    parser.add_argument("--smoke", action="store_true", help="3 steps of 2 prompts x 2 samples after 5 SFT steps (CI)")
    parser.add_argument("--model", default="", help="start from this model as it is (a name such as smollm2-135m, "
                        "or a directory) instead of the SFT'd tiny model")
    for flag, key, kind in (("--batch", "batch_size", int), ("--generations", "num_generations", int),
                            ("--prompt-len", "max_prompt_len", int), ("--new-tokens", "max_new_tokens", int),
                            ("--lr", "lr", float)):
        parser.add_argument(flag, type=kind, default=None, help=f"the job's {key} (default {JOB[key]})")
    args = parser.parse_args()
    if args.smoke:
        args.steps, args.sft_steps = 3, 5
        JOB.update(SMOKE_JOB)
    JOB.update({k: getattr(args, a) for a, k in OVERRIDES if getattr(args, a) is not None})
    if args.child:
        torch_threads = os.environ.get("BENCH_THREADS")
        if torch_threads:
            import torch

            torch.set_num_threads(int(torch_threads))
        result = (run_trl if args.child == "trl" else run_package)(args)
        print(json.dumps(result))
        return
    out = args.out or tempfile.mkdtemp(prefix="grpo_vs_trl_")
    args.out = out
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; {args.steps} steps of "
          f"{JOB['batch_size']} prompts x {JOB['num_generations']} answers of {JOB['max_new_tokens']} tokens on "
          f"{args.device}, {args.model or 'the SFT tiny model'}; output in {out}", flush=True)
    start = start_model(args)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if args.device == "xla":
        env.setdefault("PJRT_DEVICE", "CPU")
    for side in args.sides.split(","):
        python = args.trl_python if side == "trl" else sys.executable
        if side == "trl" and python == sys.executable and importlib.util.find_spec("trl") is None:
            print("trl: skipped (trl is not installed in this interpreter: pass --trl-python, see above)", flush=True)
            continue
        # accelerate takes any process that can import torch_xla for an XLA one (even with use_cpu): off on CPU.
        side_env = {**env, "USE_TORCH_XLA": "0"} if side == "trl" and args.device == "cpu" else env
        cmd = [python, __file__, "--child", side, "--start", start, "--steps", str(args.steps), "--device",
               args.device, "--out", out] + (["--smoke"] if args.smoke else [])
        cmd += [f"--{a.replace('_', '-')}={JOB[k]}" for a, k in OVERRIDES]
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, env=side_env, capture_output=True, text=True,
                                  timeout=args.trl_timeout if side == "trl" else None)
        except subprocess.TimeoutExpired as err:
            tail = (err.stderr or b"")[-1500:]
            print(f"{side}: stopped after {args.trl_timeout:.0f} s without finishing {args.steps} steps\n"
                  f"{tail.decode(errors='replace') if isinstance(tail, bytes) else tail}", flush=True)
            continue
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            print(f"{side}: failed (exit {proc.returncode}) after {wall:.0f} s\n{proc.stderr[-3000:]}", flush=True)
            continue
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        share, host = (f"{100 * r[k]:.0f}%" if r[k] is not None else "-"
                       for k in ("generation_share", "generation_host_share"))
        print(f"{side:8} {r['step_s']:.3f} s/step after the first, host CPU {r['host_s']:.3f} s/step, generation "
              f"{share} (of the host CPU {host}), mean reward "
              f"{r['reward_first10']:.3f} (first 10 steps) -> {r['reward_last10']:.3f} (last 10), graphs "
              f"{r['compilations']}, process {wall:.0f} s" + (f", device {r['device']}" if r["device"] else ""),
              flush=True)


if __name__ == "__main__":
    main()
