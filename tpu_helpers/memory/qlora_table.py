"""What one chip needs for LoRA on a 7-8B model with a bf16 base and with a 4-bit base (QLoRA): the plan's table.

    from tpu_helpers.memory.qlora_table import qlora_table, markdown
    rows = qlora_table()                      # Qwen2.5-7B and Llama-3.1-8B, 1 x 1024 and 1 x 2048, v5e-1 and v6e-1
    print(markdown(rows))                     # the table on docs/jobs/finetune.md

The configs are built from the models' published sizes (their config.json on the hub: nothing downloaded), on the
meta device. Each row is `memory.hf_plan.hf_finetune_estimate` for LoRA (the HF job's defaults: r 8 on
q_proj, k_proj, v_proj, o_proj), bf16 autocast as on a TPU, gradient checkpointing, batch 1 per chip; the base in
bf16, or with its linear layers in 4 bits (`models.quant4`, group 64: 0.5625 bytes per weight; the embeddings and
the head stay bf16). The verdict is `memory.report.memory_report`'s: the peak within the chip's HBM less a 10%
margin. The loss is chunked as the recipes do by default (LOSS_CHUNK "auto", `models.lm_head`): the logits term is
one chunk's (fp32 logits, log-softmax and gradient of 256-512 positions) instead of 12 bytes per position and
vocabulary entry of the whole row (1.8-3.7 GB at these lengths).
"""

from __future__ import annotations

from typing import Any

from tpu_helpers.memory.hf_plan import hf_finetune_estimate, meta_model
from tpu_helpers.memory.report import memory_report

# Published sizes (config.json of Qwen/Qwen2.5-7B and meta-llama/Llama-3.1-8B) and parameter counts (their model
# cards: 7.61B and 8.03B).
PUBLISHED: dict[str, tuple[str, dict[str, Any], float]] = {
    "Qwen2.5-7B": ("qwen2", dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                                 num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=131072,
                                 tie_word_embeddings=False, rope_theta=1e6), 7.61e9),
    "Llama-3.1-8B": ("llama", dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                   num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                                   tie_word_embeddings=False, rope_theta=5e5), 8.03e9),
}
BASES = (None, "nf4")  # a bf16 base, a 4-bit one (int4 stores the same bytes)
SEQ_LENS = (1024, 2048)
HARDWARE = ("v5e", "v6e")


def published_config(name: str) -> Any:
    """The transformers config of a model in PUBLISHED, from its sizes."""
    from transformers import AutoConfig

    kind, sizes, _ = PUBLISHED[name]
    return AutoConfig.for_model(kind, **sizes)


def qlora_table(models=tuple(PUBLISHED), seq_lens=SEQ_LENS, hardware=HARDWARE, *, lora_r: int = 8,
                group_size: int = 64) -> list[dict[str, Any]]:
    """One row per model, sequence length and base: the peak bytes, the breakdown, and per chip whether it fits."""
    rows = []
    for name in models:
        config = published_config(name)
        model = meta_model(config)
        params = sum(p.numel() for p in model.parameters())
        for seq in seq_lens:
            for base in BASES:
                def estimate(b, seq=seq, base=base, config=config, model=model):
                    return hf_finetune_estimate(config, b, seq, method="lora", lora_r=lora_r, precision="bf16",
                                                gradient_checkpointing=True, model=model, quantize_base=base,
                                                quantize_group_size=group_size)

                est = estimate(1)
                fits = {hw: memory_report(estimate, 1, hw).fits for hw in hardware}
                rows.append({"model": name, "parameters": params, "seq_len": seq, "base": base or "bf16",
                             "peak_bytes": est.peak_bytes, "breakdown": est.breakdown, "fits": fits})
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    """The rows as a markdown table (GB = 1e9 bytes, as the chips' HBM is sold)."""
    hardware = list(rows[0]["fits"]) if rows else []
    names = {"v5e": "v5e-1 (16 GB)", "v6e": "v6e-1 (32 GB)"}
    head = ["model", "tokens", "base", "peak", "weights", "activations + logits", *(names.get(h, h) for h in hardware)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        b = r["breakdown"]
        lines.append("| " + " | ".join([
            r["model"], f"1 x {r['seq_len']}", r["base"], f"{r['peak_bytes'] / 1e9:.1f} GB",
            f"{b['params'] / 1e9:.1f} GB", f"{b['activations'] / 1e9:.1f} GB",
            *("fits" if r["fits"][h] else "no" for h in hardware)]) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown(qlora_table()))
