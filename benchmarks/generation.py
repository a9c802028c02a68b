"""Greedy generation speed: the package's KV-cache generation vs its uncached loop vs Hugging Face `generate`.

    PYTHONPATH=. python benchmarks/generation.py --tokens 16,128,512 --devices cpu,xla
    PYTHONPATH=. python benchmarks/generation.py --model smollm2-135m --tokens 64,256 --sides cached,hf
    PYTHONPATH=. python benchmarks/generation.py --model DIR --random-init --bf16 --devices cuda   # a GPU machine
    PYTHONPATH=. python benchmarks/generation.py --arch llama30x64 --devices xla --sides cached,replay,loop --tokens 24,72

The model is a randomly initialised Qwen2 (4 layers, width 256, 4 heads, 2 KV heads, the tiny model's BPE
vocabulary, eager attention as `models.hf.load_causal_lm` loads it), or `--model` (a name or directory, e.g. the
offline real model smollm2-135m; `--random-init`: its config and tokenizer with random weights, the same speed where
the weights cannot travel; a random model's greedy tokens are no less deterministic); a batch of 8 random prompts of 8 to 32 tokens,
left-padded to 32. For each number of new tokens and each side:
- `cached`: `models.generation.generate_ids` with the cache slots bucketed as `hf.generate` does (`cache_bucket`),
  nothing captured nor looped (`replay=False, loop=False`: the lazily traced path);
- `uncached`: `models.generation.generate_ids_uncached`, the loop `hf.generate` ran before the cache (every token
  runs the whole (B, P + N) buffer through the model again);
- `replay`: `cached` with `replay=backend.compile_step` (still `loop=False`): on XLA the prompt pass and the decode step captured once
  (dynamo, openxla) and replayed, no per-token tracing; on the CPU the same as `cached`;
- `loop`: `replay` with `loop=backend.compile_loop` (what a plain `generate_ids` call gets): on XLA the decode steps run as one While op, built once and
  called again, so a call costs the host the same whatever the number of tokens; on the CPU the same as `cached`;
- `hf`: `model.generate(do_sample=False, min_new_tokens=N)` with transformers' default (dynamic) cache; on XLA every
  token has a new shape, so it compiles about one graph per token (`--hf-xla-tokens` limits which lengths it runs;
  `--uncached-tokens` likewise the uncached loop, whose time grows with the square of the new tokens).
Each device runs in its own process (PJRT_DEVICE=CPU for XLA:CPU, so the XLA metrics are the side's own); `xla8` is
XLA over an 8-device data-parallel SPMD mesh (8 simulated devices on XLA:CPU; a v5e-8's chips on a TPU VM), the
model's weights replicated and the batch's rows split over the chips, as a v5e-8 run places them. Printed
per case: tokens/s of the first call (compilation included) and the best of `--repeats` identical calls after it
(the best, as the machine may be shared; the uncached loop past 16 tokens: one call on the CPU, two on XLA), the graphs compiled by the first call and by any later one (XLA only),
whether the other sides' tokens equal the cached ones, and for the best call per token: host (the call until it
returns, before the wait for the outputs), python (host less the time blocked in the call that runs a replayed graph,
which on XLA:CPU returns only once the graph ran: the host's own work, what a TPU would wait for), thread CPU (the
calling thread's CPU time: its own work again, measured another way, which also leaves out a sync's wait for the
graph before it; XLA:CPU runs graphs on threads of its own) and device (XLA's
execution time, `backend.device_seconds`: launch to outputs ready, so it also counts the time a graph queued behind
the previous one when the host runs ahead). `--arch llama30x64`: a 30-layer Llama of width 64 (4 heads, 2 KV heads), so narrow that
the arithmetic is negligible and the host's time per token is what shows (the issue's "host ms per token" figure).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARCH = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=2048)
NARROW = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=30, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=2048)


def _setup(args, device):
    import torch

    from tpu_helpers.models import hf_tiny
    from tpu_helpers.models.generation import left_pad
    from tpu_helpers.models.hf import DEFAULT_ATTN, load_causal_lm

    if args.model and args.random_init:
        # The model's shape with random weights, from its config and tokenizer alone: the speed of the real model
        # where its weights cannot go (a device machine reached without them).
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        torch.manual_seed(0)
        tok = AutoTokenizer.from_pretrained(args.model)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.model),
                                                 attn_implementation=DEFAULT_ATTN)
    elif args.model:
        model, tok = load_causal_lm(args.model)
    elif args.arch == "llama30x64":
        from transformers import LlamaConfig, LlamaForCausalLM

        _, tok = load_causal_lm("tiny")
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), pad_token_id=tok.pad_token_id, **NARROW))
        model.config._attn_implementation = DEFAULT_ATTN
    else:
        _, tok = load_causal_lm("tiny")
        model = hf_tiny.build_tiny_model(tok, seed=0, **ARCH)
        model.config._attn_implementation = DEFAULT_ATTN
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(8, args.prompt + 1, (args.batch,), generator=g).tolist()
    lengths[0] = args.prompt
    prompts = [torch.randint(3, len(tok), (n,), generator=g).tolist() for n in lengths]
    batch = left_pad(prompts, args.prompt, tok.pad_token_id)
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    return model.eval().to(device, dtype), tok, batch.ids.to(device), batch.mask.to(device)


def _time_replay_runs() -> list[float]:
    """Seconds spent inside torch_xla's call that runs a replayed graph (dynamo's openxla bridge), summed into the
    returned list's one entry: on XLA:CPU that call returns when the graph has run (the device is the host's own
    cores), so the host's own work per token is the call's time less this."""
    import torch_xla

    total = [0.0]
    run = torch_xla._XLAC._run_cached_graph

    def timed(*a, **k):
        t0 = time.perf_counter()
        try:
            return run(*a, **k)
        finally:
            total[0] += time.perf_counter() - t0

    torch_xla._XLAC._run_cached_graph = timed
    return total


def child(args) -> None:
    import torch

    from tpu_helpers.backend import get_backend
    from tpu_helpers.models.generation import generate_ids, generate_ids_uncached
    from tpu_helpers.models.hf import cache_bucket

    mesh = args.child == "xla8"
    backend = get_backend("xla" if mesh else args.child, precision="bf16" if args.bf16 else "fp32", spmd=mesh,
                          compile_cache_dir=None)
    blocked = _time_replay_runs() if backend.compiles_graphs else [0.0]
    torch.set_num_threads(args.threads)
    model, tok, ids, mask = _setup(args, backend.device)
    if mesh:  # placed as a v5e-8 run places them: weights replicated, the batch's rows split over the chips
        model = backend.prepare_model(model, "data")
        ids, mask = backend.shard_rows(ids), backend.shard_rows(mask)
    xla = backend.compiles_graphs

    def cached(n):
        return generate_ids(model, ids, mask, max_new_tokens=n, eos_token_id=None, pad_token_id=tok.pad_token_id,
                            sync=backend.sync, cache_len=cache_bucket(args.prompt + n), replay=False, loop=False).ids

    def replay(n):
        return generate_ids(model, ids, mask, max_new_tokens=n, eos_token_id=None, pad_token_id=tok.pad_token_id,
                            sync=backend.sync, cache_len=cache_bucket(args.prompt + n), replay=backend.compile_step,
                            loop=False).ids

    def loop(n):
        return generate_ids(model, ids, mask, max_new_tokens=n, eos_token_id=None, pad_token_id=tok.pad_token_id,
                            sync=backend.sync, cache_len=cache_bucket(args.prompt + n), replay=backend.compile_step,
                            loop=backend.compile_loop).ids

    def uncached(n):
        return generate_ids_uncached(model, ids, mask, max_new_tokens=n, sync=backend.sync)

    def hf(n):
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                              do_sample=False, pad_token_id=tok.pad_token_id)[:, args.prompt:]

    sides = {"cached": cached, "replay": replay, "loop": loop, "uncached": uncached, "hf": hf}
    for n in args.tokens:
        outputs = {}
        for side in args.sides:
            why = "one graph per token on XLA" if side == "hf" and xla and n > args.hf_xla_tokens else \
                "each token costs the whole buffer" if side == "uncached" and n > args.uncached_tokens else None
            if why:
                print(json.dumps({"device": args.child, "tokens": n, "side": side, "skipped": why}), flush=True)
                continue
            row = {"device": args.child, "tokens": n, "side": side}
            times, graphs, host, python, device, cpu = [], [], [], [], [], []
            # The uncached loop beyond 16 tokens is slow (minutes): one call on the CPU, where the first call
            # compiles nothing, and the compiling call plus one on XLA.
            calls = 1 + args.repeats if side != "uncached" or n <= 16 else 2 if xla else 1
            for _ in range(calls):
                before = backend.metrics().get("compilations", 0)
                busy, inside = backend.device_seconds(), blocked[0]
                t0, c0 = time.perf_counter(), time.thread_time()
                with torch.no_grad():
                    result = sides[side](n)
                    host.append(time.perf_counter() - t0)  # the call returned: what remains is the device's
                    cpu.append(time.thread_time() - c0)
                    python.append(host[-1] - (blocked[0] - inside))
                    out = backend.to_cpu(result)[:, :n]
                times.append(time.perf_counter() - t0)
                device.append(backend.device_seconds() - busy if busy is not None else None)
                graphs.append(backend.metrics().get("compilations", 0) - before if xla else None)
            later = times[1:] or times  # on the CPU a single call is a steady one (nothing to compile)
            best = times.index(min(later), len(times) - len(later))
            row.update(host_ms_per_tok=host[best] / n * 1e3, python_ms_per_tok=python[best] / n * 1e3,
                       thread_cpu_ms_per_tok=cpu[best] / n * 1e3,
                       device_ms_per_tok=device[best] / n * 1e3 if device[best] is not None else None)
            row.update(first_tok_s=args.batch * n / times[0], first_graphs=graphs[0],
                       second_tok_s=args.batch * n / min(later), second_graphs=max(graphs[1:]) if graphs[1:] and xla
                       else None)
            outputs[side] = out
            if side != "cached" and "cached" in outputs:
                row["same_tokens_as_cached"] = bool(torch.equal(outputs["cached"], out))
            print(json.dumps(row), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="16,128,512")
    parser.add_argument("--sides", default="cached,uncached,hf")
    parser.add_argument("--devices", default="cpu,xla", help="of cpu, xla, xla8 (an 8-device SPMD mesh), cuda")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1, help="calls after the first; the fastest is reported")
    parser.add_argument("--hf-xla-tokens", type=int, default=16,
                        help="on XLA, run HF generate only up to this many new tokens (a graph per token)")
    parser.add_argument("--uncached-tokens", type=int, default=128,
                        help="run the uncached loop only up to this many new tokens (its cost grows as N squared)")
    parser.add_argument("--model", default="", help="a model name or directory (e.g. smollm2-135m; default: the "
                        "random 4-layer Qwen2 above)")
    parser.add_argument("--random-init", action="store_true",
                        help="with --model: its config and tokenizer, random weights (same speed, no weights needed)")
    parser.add_argument("--arch", choices=["qwen4x256", "llama30x64"], default="qwen4x256",
                        help="the random model without --model: a 4-layer Qwen2 of width 256, or a 30-layer Llama of "
                        "width 64 (the host's time per token shows)")
    parser.add_argument("--bf16", action="store_true", help="weights and compute in bf16 (default fp32)")
    parser.add_argument("--child", choices=["cpu", "xla", "xla8", "cuda"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.tokens = [int(t) for t in str(args.tokens).split(",")]
    args.sides = args.sides.split(",")
    if args.child:
        return child(args)
    arch = NARROW if args.arch == "llama30x64" else ARCH
    what = (f"{args.model}{' (random weights)' if args.random_init else ''}" if args.model else
            f"{'Llama' if arch is NARROW else 'Qwen2'} {arch['num_hidden_layers']} layers x {arch['hidden_size']}")
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; batch {args.batch}, prompt "
          f"{args.prompt}, {what}, {'bf16' if args.bf16 else 'fp32'}", flush=True)
    print(f"{'device':8}{'new':>5}  {'side':9}{'tok/s 1st':>10}{'tok/s best':>11}{'graphs 1st':>11}"
          f"{'graphs then':>12}{'host ms/tok':>12}{'python ms/tok':>14}{'cpu ms/tok':>11}{'device ms/tok':>14}"
          "  same as cached",
          flush=True)
    sys.path.insert(0, str(ROOT))
    from tpu_helpers.backend import runtime_env

    for device in args.devices.split(","):
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        if device.startswith("xla"):
            env.setdefault("PJRT_DEVICE", "CPU")
        if device == "xla8" and env["PJRT_DEVICE"] == "CPU":
            env.update(runtime_env.xla_cpu_env(8))
        cmd = [sys.executable, __file__, "--child", device, "--tokens", ",".join(map(str, args.tokens)),
               "--sides", ",".join(args.sides), "--batch", str(args.batch), "--prompt", str(args.prompt),
               "--threads", str(args.threads), "--repeats", str(args.repeats), "--hf-xla-tokens", str(args.hf_xla_tokens),
               "--uncached-tokens", str(args.uncached_tokens), "--model", args.model, "--arch", args.arch]
        cmd += ["--random-init"] * args.random_init + ["--bf16"] * args.bf16
        with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True) as proc:
            for line in proc.stdout:
                if not line.startswith("{"):
                    continue
                r = json.loads(line)
                name = {"xla": "XLA:CPU", "xla8": "XLA x8", "cuda": "CUDA"}.get(device, "CPU")
                if r.get("skipped"):
                    print(f"{name:8}{r['tokens']:>5}  {r['side']:9}  skipped ({r['skipped']})", flush=True)
                    continue
                graphs = [str(r[k]) if r[k] is not None else "-" for k in ("first_graphs", "second_graphs")]
                same = r.get("same_tokens_as_cached", "")
                dev = f"{r['device_ms_per_tok']:.2f}" if r["device_ms_per_tok"] is not None else "-"
                print(f"{name:8}{r['tokens']:>5}  {r['side']:9}{r['first_tok_s']:>10.0f}{r['second_tok_s']:>11.0f}"
                      f"{graphs[0]:>11}{graphs[1]:>12}{r['host_ms_per_tok']:>12.2f}"
                      f"{r['python_ms_per_tok']:>14.2f}{r['thread_cpu_ms_per_tok']:>11.2f}{dev:>14}"
                      f"  {same}", flush=True)
        if proc.returncode:
            sys.exit(f"the {device} run failed (exit {proc.returncode})")


if __name__ == "__main__":
    main()
