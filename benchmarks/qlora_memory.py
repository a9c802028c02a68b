"""QLoRA on XLA:CPU: the compiled LoRA step's memory with a bf16 base vs a 4-bit base, and the steady step time of each
(what dequantizing every linear weight in every step costs).

    PYTHONPATH=. python benchmarks/qlora_memory.py            # Qwen2.5-style sizes scaled to compile here
    PYTHONPATH=. python benchmarks/qlora_memory.py --smoke    # CI: toy sizes

The model is a Qwen2 of Qwen2.5's shape (SwiGLU MLP 5.5x wide, 4 query heads per key/value head) scaled down
(`--hidden`, `--layers`, `--vocab`), with LoRA r=8 on q/k/v/o, bf16 autocast as on a TPU; the base in bf16, or its
linear layers in NF4 (`models.quant4`, group 64). Memory: `memory.compiled.compiled_estimate` (XLA's own figure for
the trainer's compiled step, fresh process, memory-minimising scheduler), with and without gradient checkpointing,
next to the plan (`memory.hf_plan`). Time: the trainer's step on XLA:CPU, the mean of the steps after two warm-up
ones (each synced); on XLA:CPU the "device" is this machine's cores, so the ratio, not the milliseconds, is the
figure to carry to a TPU, and even it only roughly (the TPU's matmuls are far faster, its gathers not).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

ENV = "TPU_HELPERS_QLORA_BENCH"  # the sizes and base the compile subprocess builds (it imports this file)
TARGETS = "q_proj,k_proj,v_proj,o_proj"


def _config(spec: dict):
    from transformers import Qwen2Config

    h = spec["hidden"]
    return Qwen2Config(vocab_size=spec["vocab"], hidden_size=h, intermediate_size=int(h * 5.5) // 64 * 64,
                       num_hidden_layers=spec["layers"], num_attention_heads=h // 64, num_key_value_heads=h // 256 or 1,
                       max_position_embeddings=4096, tie_word_embeddings=False, use_cache=False,
                       attn_implementation="eager")


def build(spec: dict | None = None) -> torch.nn.Module:
    """The LoRA model of the spec (from ENV in the compile subprocess): a bf16 base or an NF4 one."""
    from transformers import Qwen2ForCausalLM

    from tpu_helpers.models.lora import add_lora
    from tpu_helpers.models.quant4 import quantize_model

    spec = spec or json.loads(os.environ[ENV])
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(_config(spec)).to(torch.bfloat16)
    if spec["base"] != "bf16":
        quantize_model(model, spec["base"], 64, compute_dtype=torch.bfloat16)
    return add_lora(model, r=8, targets=TARGETS)


def batch(batch_size: int, spec: dict | None = None) -> dict[str, torch.Tensor]:
    spec = spec or json.loads(os.environ[ENV])
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, spec["vocab"], (batch_size, spec["seq"]), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def _mib(x: float) -> str:
    return f"{x / 2**20:9.1f}"


def memory(spec: dict, args) -> None:
    from tpu_helpers.memory.compiled import compiled_estimate
    from tpu_helpers.memory.hf_plan import hf_finetune_estimate

    # The compile subprocess imports this file as a module: its directory goes on its path.
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(Path(__file__).parent),
                                                           os.environ.get("PYTHONPATH", "")) if p)
    print(f"\ncompiled LoRA step on XLA:CPU, bf16 autocast, batch {args.batch} x {spec['seq']}; MiB")
    print(f"{'base':6}{'checkpointing':>15}{'stored base':>13}{'compiled':>10}{'plan':>10}")
    for ckpt in (False, True) if not args.smoke else (False,):
        for base in ("bf16", "nf4"):
            s = {**spec, "base": base}
            os.environ[ENV] = json.dumps(s)
            stored = sum(p.numel() * p.element_size() for n, p in build(s).named_parameters() if "lora_" not in n)
            est = compiled_estimate(f"{Path(__file__).stem}:build", args.batch, batch_fn=f"{Path(__file__).stem}:batch",
                                    precision="bf16", gradient_checkpointing=ckpt)
            plan = hf_finetune_estimate(_config(spec), args.batch, spec["seq"], method="lora", lora_r=8,
                                        lora_targets=TARGETS.split(","), precision="bf16", gradient_checkpointing=ckpt,
                                        quantize_base=None if base == "bf16" else base)
            print(f"{base:6}{'yes' if ckpt else 'no':>15}{_mib(stored):>13}{_mib(est.peak_bytes):>10}"
                  f"{_mib(plan.peak_bytes):>10}")


def step_time(spec: dict, args) -> None:
    from tpu_helpers.backend import get_backend
    from tpu_helpers.memory.traced import step_trainer

    backend = get_backend("xla", spmd=False, precision="bf16")
    print(f"\nsteady step time on XLA:CPU ({args.steps} steps after 2 warm-up, each synced), batch {args.batch} x "
          f"{spec['seq']}")
    times = {}
    for base in ("bf16", "nf4"):
        s = {**spec, "base": base}
        trainer = step_trainer(backend.move_model(build(s)), backend, precision="bf16")
        data = backend.to_device(batch(args.batch, s))
        for i in range(2 + args.steps):
            if i == 2:
                t0 = time.perf_counter()
            trainer.train_step(iter([data]))
            backend.sync()
        times[base] = (time.perf_counter() - t0) / args.steps
        print(f"{base:6}{times[base] * 1e3:10.1f} ms/step   compilations so far {backend.metrics()['compilations']}")
    print(f"nf4 / bf16 step time = {times['nf4'] / times['bf16']:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=512, help="width (a multiple of 256; Qwen2.5-7B: 3584)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--no-memory", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="CI: width 256, 1 layer, vocab 512, 1 x 32, no checkpointing row, 2 timed steps")
    args = ap.parse_args()
    if args.smoke:
        args.hidden, args.layers, args.vocab, args.seq, args.batch, args.steps = 256, 1, 512, 32, 1, 2
    spec = {"hidden": args.hidden, "layers": args.layers, "vocab": args.vocab, "seq": args.seq}
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; Qwen2-style width {args.hidden}, "
          f"{args.layers} layers, vocab {args.vocab}")
    if not args.no_memory:
        memory(spec, args)
    step_time(spec, args)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    main()
