"""The chunked loss (models/lm_head.py) against the whole batch's logits: XLA's compiled memory of a LoRA SFT step
and its steady step time on XLA:CPU, and the memory plan next to the compiled figure.

    PYTHONPATH=. python benchmarks/chunked_loss.py                   # Qwen2.5-style vocabulary (151,936), scaled
    PYTHONPATH=. python benchmarks/chunked_loss.py --smoke           # CI: toy sizes
    PYTHONPATH=. python benchmarks/chunked_loss.py --plan            # also the Qwen3-0.6B int4 QAT + top-128 job,
                                                                     # layer-scaled, compiled only (slow)

Part 1: a Qwen2Config with Qwen2.5's vocabulary of 151,936 tokens, scaled to compile and run here (hidden 64, 2
layers, LoRA r=8 on q/k/v/o, fp32, batch 4 x 256 tokens): `CausalLMTrainer` with LOSS_CHUNK=0 (the whole
batch's logits) and with chunks of 256 tokens ("auto" at this vocabulary), each in a fresh process whose XLA dumps
give each compiled program's memory (the largest is the step's); steady step time over a few steps after warm-up.

Part 2 (`--plan`): the guide's job (Qwen3-0.6B sizes, int4 QAT, recovery LoRA r=16 on every linear layer, a
top-128 cache, batch 4 and 8 x 1024) with 1 and 2 layers, compiled (not run: the first step's graph, through
torch_xla's `_xla_warm_up_cache`) chunked and unchunked; the per-layer difference extrapolates to 28 layers and is
printed next to `hf_finetune_estimate`'s plan at the same precision (and, for reference, the plan at bf16: the
TPU's figure). `--plan-precision bf16` compiles the bf16 job instead; `--plan-batches 4` one batch size only.

Why fp32 is the yardstick on XLA:CPU: XLA:CPU has no bf16 arithmetic. Its float normalization rewrites every bf16
dot into an f32 one (all 58 dots of the L=1 step: bf16 before optimization, f32 after), so the operands are
converted to f32 and the f32 copies are what the backward keeps: in the bf16 step's peak live set (the buffer
assignment's "Live ranges at ... (peak)") every activation is f32, bf16 weights get f32 copies (the 151,936 x 1,024
embedding/head: 593.5 MiB next to its 296.8 MiB bf16 parameter) and the f32 softmax gets a second, rounded, f32
copy where a TPU keeps bf16 (`--xla_allow_excess_precision=false` does not change that). So XLA:CPU's bf16 step
holds the fp32 step's activations and more (per layer at batch 1 x 1024: 380 MiB bf16, 346 MiB fp32), where a
TPU holds most of them in bf16, and the plan at bf16 is compared with the guide's v6e-1 measurement instead (22-28 GB at
batch 4 x 1024; plan 23.1 GB).

Measured here (2 shared cores, load average 5.6-8):
- part 1: compiled 1,831.5 MiB with the whole logits, 499.2 MiB in chunks of 256 (3.67x less; the fp32 logits alone
  are 593.5 MiB); steady step 3,972 ms vs 4,018 ms (x1.01).
Part 2 (load average 3.3-6.6; 171 s for batch 4, 234 s for batch 8), fp32, plan/compiled at 28 layers:
- batch 4: whole logits L=1 11,093 / L=2 12,100 MiB, 40.16 GB extrapolated against a plan of 38.52 (0.96);
  chunked 4,649 / 5,657 MiB, 33.40 GB against 31.51 (0.94); the chunked loss saves 6.76 GB compiled, 7.01 planned.
- batch 8: whole 21,482 / 23,373 MiB, 76.04 GB against 72.78 (0.96); chunked 8,663 / 10,553, 62.60 against 58.30
  (0.93); saved 13.44 compiled, 14.49 planned. All within 10%.
- Where they differ (the peak live sets): outside the layers, the top-k term's backward scatters its gradient into
  a dense logits-sized buffer, so 4 logits-sized f32 buffers are live (16*s*b*V) where the plan counts 12*s*b*V:
  2.3 GB more than planned at L=1, batch 4 (a TPU's compiler may fold the scatter into the gradient's sum; not
  checked). Chunked, XLA:CPU runs the chunks' forwards before their backwards, so at batch 4 19 chunk-sized f32
  logits buffers (and 19 4,096 x 1,024 hidden-sized ones) are live where the plan counts one chunk's 12*c*V: 2.6 GB
  more at L=1, as with micro-batches (memory/compiled.py). Per layer the plan is 1,036 MiB at batch 4, compiled
  1,007 (weights included), but by compensation: the layer keeps 39 values per token and width unit (156.6 bytes
  at fp32, the same at 512 and 1,024 tokens) where the paper's factor counts 17 (68 bytes), and one f32 a*s^2*b
  softmax (4 bytes per score) where the plan counts 10; the two cancel near s*a/h = 15 (1,024 tokens here; at
  512 the plan counts 0.78x the layer). QAT's term is exact: compiled with and without QAT, the layer differs by
  60 MiB at fp32, the fake-quantized copy of every linear weight, which the plan counts.
- What a bf16 layer keeps, dtype for dtype, is not settled here: the eager step's saved tensors (torch's
  saved-tensor hooks, batch 1 x 1024, parameters left out) are 112.9 MiB bf16 + 84.1 MiB f32 per layer (the f32
  softmax, 64 MiB, and RMSNorm's f32 upcasts) against the plan's 144 MiB (QAT's copy included); counted so, the plan
  would be ~29 GB at batch 4, above the 22-28 GB the guide measured on a v6e-1, whose compiler need not keep what
  eager autograd saves. Compiling L=1 and L=2 on a TPU would settle the per-layer term.
- bf16 on XLA:CPU (`--plan-precision bf16`, the earlier run): batch 4 47.2 / 40.4 GB, batch 8 90.6 / 77.1, against a
  plan of 23.1 / 16.1 and 43.9 / 29.5: the f32 artefact above, not a TPU's figure.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QWEN25_STYLE = dict(vocab_size=151936, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                    tie_word_embeddings=True)
SMOKE = dict(QWEN25_STYLE, vocab_size=4096, hidden_size=32, intermediate_size=64)
QWEN3_06B = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                 tie_word_embeddings=True)


def child(spec: dict) -> dict:
    """In a fresh process (XLA dumps on): the step of `spec`, run or compiled; its timings."""
    import torch
    import transformers

    from tpu_helpers.algorithms.distill import CachedDistillTrainer, DistillSettings
    from tpu_helpers.algorithms.sft import CausalLMTrainer
    from tpu_helpers.backend import get_backend
    from tpu_helpers.config import TrainConfig
    from tpu_helpers.models import lora, qat

    torch.manual_seed(0)
    backend = get_backend("xla", spmd=False, precision=spec["precision"])
    make = transformers.Qwen3Config if spec.get("qwen3") else transformers.Qwen2Config
    model = transformers.AutoModelForCausalLM.from_config(make(**spec["config"], use_cache=False),
                                                          attn_implementation="eager")
    if spec.get("qat"):
        model = qat.add_fake_quant(model, spec["qat"], 32)
    if spec["precision"] == "bf16":
        model = model.to(torch.bfloat16)  # the frozen base in bf16, as the recipe loads it under LoRA
    model = lora.add_lora(model, r=spec["lora_r"], targets=spec["targets"])
    cfg = TrainConfig(device="xla", precision=spec["precision"], xla_checks="off", seq_len=spec["seq"],
                      batch_size=spec["batch"], lr=1e-3)
    common = dict(config=cfg, backend=backend, progress=False, loss_chunk=spec["chunk"])
    b, s, v = spec["batch"], spec["seq"], spec["config"]["vocab_size"]
    ids = torch.randint(0, v, (b, s))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    if spec.get("top_k"):
        k = spec["top_k"]  # a cache's shapes and dtypes (its values do not move the memory)
        t_logp = torch.log_softmax(torch.randn(b, s, k + 1), -1)[..., :k].sort(-1, descending=True).values
        batch.update(teacher_ids=torch.randint(0, v, (b, s, k), dtype=torch.int32), teacher_logp=t_logp,
                     teacher_tail=torch.full((b, s), -3.0))
        trainer = CachedDistillTrainer(model, None, settings=DistillSettings(1.0, 0.5), **common)
    else:
        trainer = CausalLMTrainer(model, None, **common)
    batch = backend.to_device(batch)

    def batches():
        while True:
            yield batch

    if spec.get("compile_only"):
        import torch_xla

        loss, _ = trainer.train_step(batches())
        # The updated adapters and the optimizer's state: the forward, the backward and the update in one graph.
        state = [t for st in trainer.optimizer.state.values() for t in st.values() if isinstance(t, torch.Tensor)]
        trained = [p for p in trainer.model.parameters() if p.requires_grad]
        torch_xla._XLAC._xla_warm_up_cache([loss, *trained, *state], [])
        return {"steady_ms": None}
    times = []
    for _ in range(spec["steps"]):
        t0 = time.perf_counter()
        trainer.train_step(batches())
        backend.sync()
        backend.to_cpu(torch.zeros(1, device=backend.device))  # wait for the step
        times.append(time.perf_counter() - t0)
    steady = times[2:] or times[-1:]
    return {"steady_ms": 1000 * min(steady), "compilations": backend.metrics().get("compilations", 0)}


def measure(spec: dict) -> dict:
    """`child(spec)` in a fresh process with XLA dumps: its result and the largest compiled program's bytes."""
    from tpu_helpers.memory.compiled import child_env, parse_memory_reports

    with tempfile.TemporaryDirectory() as dump:
        proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], env=child_env("CPU", dump),
                              capture_output=True, text=True, cwd=ROOT)
        if proc.returncode:
            raise SystemExit(proc.stdout[-2000:] + proc.stderr[-4000:])
        out = json.loads(proc.stdout.strip().splitlines()[-1])
        out["compiled_bytes"] = max(parse_memory_reports(dump).values())
    return out


def part1(config: dict, batch: int, seq: int, chunk: int, steps: int) -> None:
    spec = dict(config=config, batch=batch, seq=seq, precision="fp32", lora_r=8, targets="q_proj,k_proj,v_proj,o_proj",
                steps=steps)
    print(f"1. LoRA SFT step, vocab {config['vocab_size']:,}, hidden {config['hidden_size']}, "
          f"{config['num_hidden_layers']} layers, batch {batch} x {seq}, fp32, XLA:CPU")
    print(f"{'':22}{'compiled MiB':>14}{'steady ms/step':>16}")
    rows = {}
    for name, c in (("whole logits", 0), (f"chunks of {chunk}", chunk)):
        rows[name] = r = measure({**spec, "chunk": c})
        print(f"{name:22}{r['compiled_bytes'] / 2**20:14.1f}{r['steady_ms']:16.1f}")
    whole, chunked = rows.values()
    logits = batch * seq * config["vocab_size"] * 4
    print(f"saved {(whole['compiled_bytes'] - chunked['compiled_bytes']) / 2**20:.1f} MiB "
          f"({whole['compiled_bytes'] / chunked['compiled_bytes']:.2f}x less); the fp32 logits alone are "
          f"{logits / 2**20:.1f} MiB; step time x{chunked['steady_ms'] / whole['steady_ms']:.2f}")


def part2(batch: int, config: dict = QWEN3_06B, seq: int = 1024, top_k: int = 128, chunk: int | str = "auto",
          what: str = "Qwen3-0.6B sizes", depths: tuple[int, ...] = (1, 2), precision: str = "fp32") -> None:
    import transformers

    from tpu_helpers.memory.hf_plan import hf_finetune_estimate

    depth = config["num_hidden_layers"]
    print(f"\n2. guide's job ({what}, int4 QAT, LoRA r=16 all-linear, top-{top_k} cache) at {precision}, batch "
          f"{batch} x {seq}, compiled (first step) on XLA:CPU, layer-scaled to {depth} layers")
    print(f"{'':14}{'L=1 MiB':>10}{'L=2 MiB':>10}{f'L={depth} (ext.) GB':>16}{'plan GB':>10}{'plan/compiled':>15}"
          f"{'plan bf16 GB':>14}")
    rows = {}
    for name, c in (("whole logits", 0), ("chunked", chunk)):
        got = rows[name] = {}
        for layers in depths:
            spec = dict(config={**config, "num_hidden_layers": layers}, qwen3=True, batch=batch, seq=seq,
                        precision=precision, lora_r=16, targets="all-linear", qat="int4", top_k=top_k, chunk=c,
                        compile_only=True)
            got[layers] = measure(spec)["compiled_bytes"]
        got.setdefault(2, got[1])  # one depth only (the smoke): no extrapolation
        got["full"] = full = got[1] + (depth - 1) * (got[2] - got[1])
        plans = {p: hf_finetune_estimate(transformers.Qwen3Config(**config), batch, seq, method="distill",
                                         lora_r=16, lora_targets="all-linear", precision=p, teacher_topk=top_k,
                                         qat="int4", loss_chunk=c).peak_bytes for p in {precision, "bf16"}}
        got["plan"] = plan = plans[precision]
        print(f"{name:14}{got[1] / 2**20:10.0f}{got[2] / 2**20:10.0f}{full / 1e9:16.2f}{plan / 1e9:10.2f}"
              f"{plan / full:15.2f}{plans['bf16'] / 1e9:14.2f}")
    whole, chunked = rows.values()
    saved, planned = whole[1] - chunked[1], whole["plan"] - chunked["plan"]
    print(f"the chunked loss saves {saved / 1e9:.2f} GB compiled (L=1), {planned / 1e9:.2f} GB planned: "
          f"plan/compiled {planned / saved:.2f}")
    ratios = [r["plan"] / r["full"] for r in (whole, chunked)]
    print(f"plan/compiled at {precision}: whole logits {ratios[0]:.2f}, chunked {ratios[1]:.2f} (within 10%: "
          f"{'yes' if all(abs(r - 1) <= 0.1 for r in ratios) else 'no'})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="toy sizes (CI)")
    p.add_argument("--plan", action="store_true", help="also part 2 (slow: compiles Qwen3-0.6B layers)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--plan-precision", choices=("fp32", "bf16"), default="fp32",
                   help="part 2's compiled step (fp32: the yardstick on XLA:CPU, see the docstring)")
    p.add_argument("--plan-batches", default="4,8", help="part 2's batch sizes, comma-separated")
    p.add_argument("--child")
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    if args.smoke:
        part1(SMOKE, 2, 64, 32, 3)
        part2(2, dict(QWEN3_06B, vocab_size=4096, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, num_hidden_layers=1), seq=64, top_k=8, chunk=32,
              what="toy sizes", depths=(1,))
        return
    part1(QWEN25_STYLE, args.batch, args.seq, 256, args.steps)
    if args.plan:
        for batch in map(int, args.plan_batches.split(",")):
            part2(batch, precision=args.plan_precision)


if __name__ == "__main__":
    main()
