"""Memory of one fine-tuning step of a Hugging Face causal LM: the plan vs the traced vs the compiled figure.

    PYTHONPATH=. python benchmarks/finetune_memory.py                    # tiny model (all three) + Qwen2.5-0.5B sizes
    PYTHONPATH=. python benchmarks/finetune_memory.py --qwen-layers 6    # trace fewer Qwen layers (a slow machine)
    PYTHONPATH=. python benchmarks/finetune_memory.py --smoke            # CI: one row of each part, toy sizes

- plan: `memory.hf_plan.hf_finetune_estimate`, from the config alone (what the notebook shows first), of the whole
  logits (LOSS_CHUNK=0: the traced and compiled steps here take the model's own loss; benchmarks/chunked_loss.py
  has the chunked step);
- traced: `memory.traced.traced_estimate`, two real steps on fake tensors under torch's MemTracker (what an eager
  run allocates: CPU, or CUDA's max_memory_allocated);
- compiled: `memory.compiled.compiled_estimate`, XLA's own figure for the compiled step on XLA:CPU (tiny model only).

The tiny model is the offline Qwen2 of the fine-tuning path (fp32, batch 8 x 128 tokens); the Qwen2.5-0.5B rows use
a `Qwen2Config` with the real sizes built on the meta device (nothing downloaded), bf16 autocast as on a TPU (LoRA:
the frozen base in bf16), batch 8 x 512 tokens per chip.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

from tpu_helpers.memory.compiled import compiled_estimate
from tpu_helpers.memory.hf_plan import hf_finetune_estimate
from tpu_helpers.memory.traced import traced_estimate

# The example models are test fixtures (tests/example_models.py): the checkout's root on the path.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.example_models import TINY_LM_SEQ, TINY_LM_VOCAB, lm_batch  # noqa: E402

M = "tests.example_models"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
QWEN_05B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768, tie_word_embeddings=True)


def _model_fn(config, method: str, bf16_base: bool):
    def build():
        from transformers import Qwen2ForCausalLM

        from tpu_helpers.models.lora import add_lora

        model = Qwen2ForCausalLM(config)
        if method == "lora":
            if bf16_base:
                model = model.to(torch.bfloat16)
            model = add_lora(model, r=8, targets=",".join(TARGETS))
        return model

    return build


def _mb(x) -> str:
    return "-" if x is None else f"{x / 2**20:9.1f}"


def _row(label, plan, traced, compiled=None) -> None:
    ratio = f"{plan.peak_bytes / traced.peak_bytes:6.2f}" if traced else "     -"
    tr = traced.breakdown if traced else {}
    print(f"{label:34}{_mb(plan.peak_bytes)}{_mb(traced.peak_bytes if traced else None):>10}"
          f"{_mb(compiled.peak_bytes if compiled else None):>10}{ratio:>8}   "
          f"plan act {_mb(plan.breakdown['activations']).strip()} / traced act+temp "
          f"{_mb(tr.get('activations', 0) + tr.get('temporaries', 0)).strip() if traced else '-'}")


def _rows(methods: tuple[str, str], args) -> list[tuple[str, bool]]:
    """(method, gradient checkpointing) of each row; --smoke: the last method with checkpointing, the row that goes
    through the most code (LoRA or full, and the checkpointing hook)."""
    if args.smoke:
        return [(methods[-1], True)]
    return [(m, ckpt) for m in methods for ckpt in (False, True)]


def tiny(args) -> None:
    from transformers import Qwen2Config

    from tpu_helpers.models.hf_tiny import TINY_ARCH

    config = Qwen2Config(vocab_size=TINY_LM_VOCAB, use_cache=False, attn_implementation="eager", **TINY_ARCH)
    b, s = args.tiny_batch, TINY_LM_SEQ
    print(f"\ntiny Qwen2 ({TINY_ARCH['num_hidden_layers']} layers x {TINY_ARCH['hidden_size']}, vocab {TINY_LM_VOCAB}),"
          f" fp32, batch {b} x {s}; MiB")
    print(f"{'':34}{'plan':>9}{'traced':>10}{'compiled':>10}{'plan/tr':>8}")
    for method, ckpt in _rows(("full", "lora"), args):
        t = time.perf_counter()
        plan = hf_finetune_estimate(config, b, s, method=method, lora_r=8, lora_targets=TARGETS,
                                    precision="fp32", gradient_checkpointing=ckpt, loss_chunk=0)
        traced = traced_estimate(_model_fn(config, method, False), lm_batch(s, TINY_LM_VOCAB), b,
                                 gradient_checkpointing=ckpt)
        compiled = None
        if not args.no_xla:
            factory = f"{M}:tiny_causal_lm" + ("_lora" if method == "lora" else "")
            compiled = compiled_estimate(factory, b, batch_fn=f"{M}:tiny_lm_batch", gradient_checkpointing=ckpt)
        _row(f"{method}{' + checkpointing' if ckpt else ''} ({time.perf_counter() - t:.0f} s)", plan, traced,
             compiled)


def qwen(args) -> None:
    from transformers import Qwen2Config

    sizes = {**QWEN_05B, "num_hidden_layers": args.qwen_layers}
    config = Qwen2Config(use_cache=False, attn_implementation="eager", **sizes)
    b, s = args.qwen_batch, args.qwen_seq
    print(f"\nQwen2.5-0.5B sizes ({args.qwen_layers} of 24 layers traced), bf16 autocast, batch {b} x {s} per chip; "
          "MiB (no compiled figure: too big for XLA:CPU here)")
    print(f"{'':34}{'plan':>9}{'traced':>10}{'compiled':>10}{'plan/tr':>8}")
    for method, ckpt in _rows(("lora", "full"), args):
        t = time.perf_counter()
        plan = hf_finetune_estimate(config, b, s, method=method, lora_r=8, lora_targets=TARGETS,
                                    precision="bf16", gradient_checkpointing=ckpt, loss_chunk=0)
        traced = traced_estimate(_model_fn(config, method, True), lm_batch(s, config.vocab_size), b,
                                 precision="bf16", gradient_checkpointing=ckpt)
        _row(f"{method}{' + checkpointing' if ckpt else ''} ({time.perf_counter() - t:.0f} s)", plan, traced)
        tr = traced.breakdown
        print(f"{'':34}breakdown plan {[f'{k} {v / 2**20:.0f}' for k, v in plan.breakdown.items() if v]}\n"
              f"{'':34}         traced {[f'{k} {v / 2**20:.0f}' for k, v in tr.items() if v]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--no-xla", action="store_true", help="skip the XLA:CPU compiled figures")
    ap.add_argument("--no-qwen", action="store_true", help="skip the Qwen2.5-0.5B-sized rows")
    ap.add_argument("--no-tiny", action="store_true", help="skip the tiny model's rows")
    ap.add_argument("--qwen-layers", type=int, default=24, help="trace fewer layers on a slow machine")
    ap.add_argument("--qwen-batch", type=int, default=8)
    ap.add_argument("--qwen-seq", type=int, default=512)
    ap.add_argument("--tiny-batch", type=int, default=8)
    ap.add_argument("--smoke", action="store_true",
                    help="CI: one row per part, tiny batch 2, Qwen sizes with 1 layer at batch 1 x 16")
    args = ap.parse_args()
    if args.smoke:
        args.tiny_batch, args.qwen_layers, args.qwen_batch, args.qwen_seq = 2, 1, 1, 16
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    if not args.no_tiny:
        tiny(args)
    if not args.no_qwen:
        qwen(args)


if __name__ == "__main__":
    main()
