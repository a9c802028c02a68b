"""The GGUF export of the real model (`make test-real`): a short LoRA fine-tuning of SmolLM2-135M-Instruct exported
with EXPORT_GGUF="f16" loads back through transformers' GGUF reader and answers chat prompts with the merged export's
greedy tokens, token for token; its q8_0 file (about half the size) agrees on most of them. It prints the figures.
llama.cpp itself is not run here: llama-cpp-python is a source distribution that takes long to build on 2 cores."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from tpu_helpers.models import gguf_export, smollm2

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]  # one_thread: tests/conftest.py

CHATS = ["What is the capital of France?", "Write a haiku about the sea.", "What is 12 plus 30?",
         "Name three colours of the rainbow.", "Say hello in Spanish.", "What do bees make?"]


def _greedy(model, tok, n: int = 16) -> list[list[int]]:
    out = []
    for text in CHATS:
        prompt = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                         add_generation_prompt=True)
        ids = tok(prompt, return_tensors="pt", add_special_tokens=False).input_ids
        with torch.no_grad():
            new = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                                 pad_token_id=tok.pad_token_id)
        out.append(new[0, ids.shape[1]:].tolist())
    return out


def test_the_real_models_f16_gguf_answers_with_the_merged_exports_greedy_tokens(smollm2_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tpu_helpers.recipes.finetune import Finetune, FinetuneConfig

    t0 = time.time()
    job = Finetune(FinetuneConfig(model=smollm2.SMOLLM2, method="lora", lora_targets="all-linear", lora_r=8,
                                  steps=4, lr=1e-3, warmup_steps=1, batch_size=4, seq_len=48, eval_every=4,
                                  save_every=4, eval_batches=1, max_records=100, export="last", device="cpu",
                                  export_gguf="f16", out_dir=str(tmp_path / "run")), progress=False)
    job.train()
    paths = job.export()
    seconds = time.time() - t0
    path = Path(paths["gguf"])
    tok = AutoTokenizer.from_pretrained(paths["merged"])
    merged = AutoModelForCausalLM.from_pretrained(paths["merged"], dtype=torch.float32).eval()
    want = _greedy(merged, tok)
    f16 = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    got = _greedy(f16, tok)
    q8 = gguf_export.write_gguf(paths["merged"], tmp_path / "model-q8_0.gguf", "q8_0")
    q8_model = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=q8.name, dtype=torch.float32).eval()
    q8_same = sum(a == b for a, b in zip(_greedy(q8_model, tok), want, strict=True))
    mb = lambda p: Path(p).stat().st_size / 2**20  # noqa: E731
    print(f"\nGGUF export of SmolLM2-135M after 4 LoRA steps ({seconds:.0f} s with the merged export): f16 "
          f"{mb(path):.0f} MB, greedy equal on {sum(a == b for a, b in zip(got, want, strict=True))}/{len(CHATS)}; "
          f"q8_0 {mb(q8):.0f} MB, equal on {q8_same}/{len(CHATS)} ({time.time() - t0:.0f} s in all)")
    print(f"  {CHATS[0]!r}: {tok.decode(want[0])!r}")
    assert got == want
    assert q8_same >= len(CHATS) // 2
    assert mb(q8) < 0.6 * mb(path)
