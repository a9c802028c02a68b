"""GPU throughput: tokens/s and MFU of the ~124M-parameter GPT ("small") in bf16, with and without torch.compile.

    python benchmarks/gpu_throughput.py                      # both modes, batch 16 x 1024 tokens
    python benchmarks/gpu_throughput.py --batch-size 32 --modes compile
    python benchmarks/gpu_throughput.py --smoke   # CI: tiny GPT, a few steps; without a GPU, eager on the CPU

Needs a CUDA GPU (prints a message and exits otherwise; `--smoke` then runs the eager step of the tiny GPT on the
CPU, so CI still runs the code, and says what it skipped). Each mode runs `--warmup` untimed steps (compilation,
autotuning), then `--steps` timed steps between two torch.cuda.synchronize() calls. MFU = tokens/s x model FLOPs
per token (6N + 12*L*H*Q*T: forward and backward, causal attention not halved) / the catalog's dense bf16 peak of
the detected GPU. Target on an H100 or H200: MFU >= 45%.
"""

from __future__ import annotations

import argparse
import time

import torch

from tpu_helpers.core.hardware import detect_gpu
from tpu_helpers.models.gpt import GPT, flops_per_token, gpt_config


def run(mode: str, args: argparse.Namespace, device: str = "cuda") -> tuple[float, float]:
    torch.manual_seed(0)
    cfg = gpt_config(args.preset, block_size=args.seq_len)
    model = GPT(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), fused=device == "cuda")
    step_model = torch.compile(model) if mode == "compile" else model
    x = torch.randint(0, cfg.vocab_size, (args.batch_size, args.seq_len), device=device)
    y = torch.randint(0, cfg.vocab_size, (args.batch_size, args.seq_len), device=device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def step() -> None:
        with torch.autocast(device, dtype=torch.bfloat16):
            _, loss = step_model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(args.warmup):
        step()
    sync()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    sync()
    tokens_per_s = args.steps * args.batch_size * args.seq_len / (time.perf_counter() - t0)
    fpt = flops_per_token(cfg, args.seq_len)
    if device == "cuda":
        spec = detect_gpu(torch.cuda.get_device_name(), torch.cuda.get_device_properties(0).total_memory)
        name, peak = spec.name, spec.bf16_tflops
    else:  # --smoke without a GPU: the same step on the host, whose peak the catalog does not know
        name, peak = "CPU (no GPU)", None
    mfu = tokens_per_s * fpt / (peak * 1e12) if peak else float("nan")
    print(f"{name}, {model.num_params() / 1e6:.1f}M params, bf16, {mode:>7}: {tokens_per_s:,.0f} tokens/s, "
          f"MFU {mfu:.1%} ({fpt / 1e9:.3f} GFLOP/token, peak {f'{peak} TFLOP/s' if peak else 'unknown'})")
    return tokens_per_s, mfu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--modes", nargs="+", choices=("eager", "compile"), default=["eager", "compile"])
    ap.add_argument("--preset", default="small", help="GPT preset")
    ap.add_argument("--smoke", action="store_true", help="tiny GPT, batch 2 x 64, 2 steps (CI)")
    args = ap.parse_args()
    if args.smoke:
        args.preset, args.batch_size, args.seq_len, args.steps, args.warmup = "tiny", 2, 64, 2, 1
    if not torch.cuda.is_available():
        print("no CUDA GPU here: this benchmark needs one (run it on an H100/H200)")
        if args.smoke:
            # torch.compile on the CPU builds C++ kernels for minutes: only the eager step runs here.
            print("smoke: skipped the GPU figures and compile mode (no CUDA GPU); the eager step on the CPU instead")
            run("eager", args, "cpu")
        return
    torch.backends.cuda.matmul.allow_tf32 = True
    for mode in args.modes:
        run(mode, args)


if __name__ == "__main__":
    main()
