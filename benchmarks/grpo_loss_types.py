"""GRPO's loss types (LOSS_TYPE, IMPORTANCE, EPSILON_HIGH, SCALE_REWARDS: `algorithms.grpo_loss`) on the same job from
the same start and seed: the held-out mean reward and completion length after the same number of steps.

    PYTHONPATH=. python benchmarks/grpo_loss_types.py --steps 60            # the notebook's offline default job
    PYTHONPATH=. python benchmarks/grpo_loss_types.py --variants grpo+sequence,dapo+high=0.28+scale=none
    PYTHONPATH=. python benchmarks/grpo_loss_types.py --model smollm2-135m --steps 4   # the offline real model
    PYTHONPATH=. python benchmarks/grpo_loss_types.py --smoke               # CI: 2 steps of 2 prompts x 2 answers

The job (the notebook's defaults): the tiny Qwen2 fine-tuned for SFT_STEPS on the generated instruction task (the
START_FROM="sft" warm start, made once and shared by every variant), LoRA r=16, 8 prompts x 8 answers of 4 tokens
per step, the `answer` reward on the generated sums, lr 5e-3, beta 0.04, fp32; every variant with the same seed, so
each samples the same first batch (`--seeds`: the figures averaged over several seeds, each seed's held-out reward
printed too). With `--model` (e.g. smollm2-135m) it starts from that model as it is, with the settings
tests/real/test_real_model.py uses for GRPO (4 prompts x 8 answers of 8 tokens, lr 1e-3, "Answer with the number
only."): about 30 s a step on a 2-core CPU.

A variant is a loss type with optional `+sequence` (GSPO's sequence-level ratio), `+high=EPS` (clip-higher) and
`+scale=group|batch|none`. With NUM_ITERATIONS 1 (the default) every update is on-policy: the ratio is exactly 1, so
clip-higher changes nothing, and under grpo the sequence ratio's gradient is the token ratio's (`--iterations 2`
tells them apart). Printed per variant: the held-out mean reward after training (every held-out sum, or --held-out
of them) and the mean completion length of those answers, the training batches' mean reward over the first and the
last 10 generation steps and their completion length over the last 10, and seconds per step. On one process bnpo and
dapo are the same loss (the divisor is the step's token count either way): their figures agree to the bit.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

SMOLLM2_JOB = dict(batch_size=4, num_generations=8, max_new_tokens=8, max_prompt_len=32, lr=1e-3, warmup_steps=1,
                   system_prompt="Answer with the number only.")
TINY_JOB = dict(lr=5e-3, warmup_steps=10)
SMOKE_JOB = dict(batch_size=2, num_generations=2, warmup_steps=1)


def parse_variant(text: str) -> dict:
    """"dapo+sequence+high=0.28+scale=none" -> GRPOConfig fields."""
    name, *mods = text.split("+")
    out: dict = {"loss_type": name}
    for mod in mods:
        key, _, value = mod.partition("=")
        if key == "sequence":
            out["importance"] = "sequence"
        elif key == "high":
            out["epsilon_high"] = float(value)
        elif key == "scale":
            out["scale_rewards"] = value
        else:
            raise SystemExit(f"unknown variant part {mod!r} in {text!r} (sequence, high=EPS, scale=NAME)")
    return out


def start_model(args) -> str:
    from tpu_helpers.models.hf import resolve_model_source
    from tpu_helpers.recipes.grpo import GRPO, GRPOConfig

    if args.model:
        return resolve_model_source(args.model)
    cfg = GRPOConfig(out_dir=str(Path(args.out) / "warm"), device=args.device, sft_steps=args.sft_steps)
    return GRPO(cfg, progress=False).start_source


def run_variant(args, start: str, job: dict, variant: str, seed: int, *, before: bool = False) -> dict:
    from tpu_helpers.recipes.grpo import GRPO, GRPOConfig

    cfg = GRPOConfig(model=start, start_from=None, dataset="sums", rewards="answer", steps=args.steps, log_every=1,
                     save_every=args.steps, device=args.device, precision="fp32", seed=seed,
                     out_dir=str(Path(args.out) / f"{variant.replace('=', '').replace('+', '_')}-{seed}"),
                     resume="force_new",
                     xla_checks="off", compile_cache_dir=None, export_merged=False, **job, **parse_variant(variant))
    grpo = GRPO(cfg, progress=False)
    if before:  # the same for every variant: the same start, held-out prompts and sampling stream
        held = grpo.samples(args.held_out)
        print(f"held-out before training: mean reward {held['reward']:.3f}, {held['completion_tokens']:.2f} "
              "completion tokens", flush=True)
    t0 = time.perf_counter()
    report = grpo.train()
    seconds = time.perf_counter() - t0
    after = grpo.samples(args.held_out)
    train = grpo.history.train
    # Per generation step (a log step without a fresh batch of answers, NUM_ITERATIONS > 1, has no reward).
    rewards = [r["reward"] for r in train if "reward" in r]
    lengths = [r["completion_tokens"] for r in train if "completion_tokens" in r]
    return {"after": after["reward"], "after_tokens": after["completion_tokens"],
            "first10": sum(rewards[:10]) / len(rewards[:10]), "last10": sum(rewards[-10:]) / len(rewards[-10:]),
            "tokens_last10": sum(lengths[-10:]) / len(lengths[-10:]), "step_s": seconds / max(1, report.steps)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default="grpo,bnpo,dr_grpo,dapo")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--sft-steps", type=int, default=150)
    parser.add_argument("--iterations", type=int, default=1, help="NUM_ITERATIONS: updates per batch of answers "
                        "(1: every update on-policy, ratio 1, so the clip and the sequence ratio change nothing)")
    parser.add_argument("--held-out", type=int, default=None, help="held-out prompts scored (default: all)")
    parser.add_argument("--model", default="", help="start from this model as it is (smollm2-135m, a directory)")
    parser.add_argument("--device", choices=["cpu", "xla"], default="cpu")
    parser.add_argument("--seeds", default="0", help="comma-separated seeds: each variant's figures averaged over them")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: a shared 2-core machine)")
    parser.add_argument("--out", default=None, help="output directory (default: a temporary one)")
    parser.add_argument("--smoke", action="store_true", help="2 steps of 2 prompts x 2 answers, 5 SFT steps (CI)")
    args = parser.parse_args()
    job = dict(SMOLLM2_JOB if args.model else TINY_JOB, num_iterations=args.iterations)
    if args.smoke:
        args.steps, args.sft_steps, args.held_out = 2, 5, 4
        job.update(SMOKE_JOB)
    import torch

    torch.set_num_threads(args.threads)
    args.out = args.out or tempfile.mkdtemp(prefix="grpo_loss_types_")
    start = start_model(args)
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; {args.steps} steps of "
          f"{job.get('batch_size', 8)} prompts x {job.get('num_generations', 8)} answers on {args.device}, "
          f"{args.model or 'the SFT tiny model'}, seeds {args.seeds}; output in {args.out}", flush=True)
    header = (f"{'variant':28} {'held-out reward':>15} {'held-out tokens':>15} {'train reward first10':>20} "
          f"{'last10':>7} {'train tokens last10':>19} {'s/step':>7}")
    header_printed = False
    seeds = [int(s) for s in args.seeds.split(",")]
    for i, variant in enumerate(args.variants.split(",")):
        runs = [run_variant(args, start, job, variant, seed, before=i == 0 and k == 0) for k, seed in enumerate(seeds)]
        r = {key: sum(run[key] for run in runs) / len(runs) for key in runs[0]}
        if not header_printed:
            print(header, flush=True)
            header_printed = True
        print(f"{variant:28} {r['after']:15.3f} {r['after_tokens']:15.2f} {r['first10']:20.3f} {r['last10']:7.3f} "
              f"{r['tokens_last10']:19.2f} {r['step_s']:7.2f}" +
              (f"   held-out per seed {[round(run['after'], 3) for run in runs]}" if len(runs) > 1 else ""), flush=True)


if __name__ == "__main__":
    main()
