"""Tiny random models of the families users fine-tune, for the tests' one family matrix.

    FAMILIES["gemma3"].config(vocab_size=97)      # a tiny Gemma3TextConfig (2 layers, hidden 32, window 6)
    path = build_family("gemma3", tmp_dir)         # model + tokenizer + generation_config, written by save_pretrained

Families: Llama 3 (llama3 rope scaling), Qwen2.5 (Qwen2 without and, as a variant, with sliding-window layers), Qwen3,
Gemma 2, Gemma 3 (text), Mistral (`sliding_window` and no `layer_types`) and Phi-3 (fused qkv_proj / gate_up_proj,
`sliding_window` and no `layer_types`). Every sliding window is 6 tokens, shorter than the tests' prompts.

`build_family` writes what a hub checkpoint of the family holds, at toy size: the config, random weights, a
generation_config whose eos_token_id lists the family's stop tokens, and a tokenizer with the family's special
tokens and a chat template in its style. The tokenizer is the package's offline tiny BPE tokenizer
(models/hf_tiny.py, trained on local text, nothing downloaded) with those special tokens added; the model's
vocabulary is sized to it. The weight matrices are drawn wider than the configs' init (`random_model`): the default
init answers one token over and over, which would make the token-for-token comparisons vacuous.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers

WINDOW = 6  # every sliding window here: shorter than prompt + completion in the tests
SIZES = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=128)
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")

LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
CHATML_TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
QWEN3_TEMPLATE = (  # as Qwen3's: the last answer opens with its (here empty) think block, the prompt does not
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' and loop.last %}<think>\n\n</think>\n\n{% endif %}{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
    "<start_of_turn>{{ role }}\n{{ m['content'] | trim }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
    "{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}")
PHI3_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% else %}{{ eos_token }}{% endif %}")


@dataclass(frozen=True)
class Family:
    """One family: its config at toy size, and its tokenizer's special tokens, template and stop tokens."""

    make: Callable[..., Any]  # (vocab_size, bos, eos, pad) -> the transformers config
    specials: tuple[str, ...]  # special tokens added to the tiny tokenizer
    template: str
    bos: str | None
    eos: str  # the tokenizer's EOS
    pad: str | None  # None: the family ships no pad token (load_causal_lm then pads with EOS)
    stops: tuple[str, ...]  # generation_config.eos_token_id, as tokens
    trained: str  # an answer as the template writes it ("{}": the answer): what SFT trains on
    lora: tuple[str, ...] = ATTENTION + MLP  # the linear layers "all-linear" wraps (every one but the head)
    fine_tuned: bool = True  # in the fine-tuning matrix on XLA (a variant of another family is not)

    def config(self, vocab_size: int, bos: int | None = None, eos: int | None = None, pad: int | None = None):
        return self.make(vocab_size=vocab_size, bos_token_id=bos, eos_token_id=eos, pad_token_id=pad)


def _llama3(**ids):
    return transformers.LlamaConfig(rope_theta=500000.0, tie_word_embeddings=True, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32}, **SIZES, **ids)


FAMILIES: dict[str, Family] = {
    "llama3": Family(
        _llama3, ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                  "<|eom_id|>"),
        LLAMA3_TEMPLATE, bos="<|begin_of_text|>", eos="<|eot_id|>", pad=None,
        stops=("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"), trained="{}<|eot_id|>"),
    "qwen2": Family(  # Qwen2.5: no sliding window in any release, tied head on the small ones
        lambda **kw: transformers.Qwen2Config(tie_word_embeddings=True, **SIZES, **kw),
        (), CHATML_TEMPLATE, bos=None, eos="<|im_end|>", pad="<|endoftext|>", stops=("<|im_end|>", "<|endoftext|>"),
        trained="{}<|im_end|>\n"),
    "qwen2-sliding": Family(  # Qwen2 with use_sliding_window: the layers from max_window_layers on slide
        lambda **kw: transformers.Qwen2Config(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1,
                                              **SIZES, **kw),
        (), CHATML_TEMPLATE, bos=None, eos="<|im_end|>", pad="<|endoftext|>", stops=("<|im_end|>", "<|endoftext|>"),
        trained="{}<|im_end|>\n", fine_tuned=False),
    "qwen3": Family(
        lambda **kw: transformers.Qwen3Config(head_dim=8, tie_word_embeddings=True, **SIZES, **kw),
        ("<think>", "</think>"), QWEN3_TEMPLATE, bos=None, eos="<|im_end|>", pad="<|endoftext|>",
        stops=("<|im_end|>", "<|endoftext|>"), trained="<think>\n\n</think>\n\n{}<|im_end|>\n"),
    "gemma2": Family(  # layer_types alternate sliding / full; logit soft-capping (attention 50, final 30)
        lambda **kw: transformers.Gemma2Config(head_dim=8, query_pre_attn_scalar=8, sliding_window=WINDOW, **SIZES,
                                               **kw),
        ("<bos>", "<eos>", "<pad>", "<start_of_turn>", "<end_of_turn>"), GEMMA_TEMPLATE, bos="<bos>", eos="<eos>",
        pad="<pad>", stops=("<eos>", "<end_of_turn>"), trained="{}<end_of_turn>\n"),
    "gemma3": Family(
        lambda **kw: transformers.Gemma3TextConfig(head_dim=8, query_pre_attn_scalar=8, sliding_window=WINDOW,
                                                   layer_types=["sliding_attention", "full_attention"], **SIZES,
                                                   **kw),
        ("<bos>", "<eos>", "<pad>", "<start_of_turn>", "<end_of_turn>"), GEMMA_TEMPLATE, bos="<bos>", eos="<eos>",
        pad="<pad>", stops=("<eos>", "<end_of_turn>"), trained="{}<end_of_turn>\n"),
    "mistral": Family(
        lambda **kw: transformers.MistralConfig(sliding_window=WINDOW, **SIZES, **kw),
        ("<s>", "</s>", "[INST]", "[/INST]"), MISTRAL_TEMPLATE, bos="<s>", eos="</s>", pad=None, stops=("</s>",),
        trained="{}</s>"),
    "phi3": Family(
        lambda **kw: transformers.Phi3Config(sliding_window=WINDOW, **SIZES, **kw),
        ("<|endoftext|>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"), PHI3_TEMPLATE, bos=None,
        eos="<|endoftext|>", pad="<|endoftext|>", stops=("<|endoftext|>", "<|assistant|>", "<|end|>"),
        trained="{}<|end|>\n<|endoftext|>", lora=("qkv_proj", "o_proj", "gate_up_proj", "down_proj")),
}
FINE_TUNED = sorted(name for name, f in FAMILIES.items() if f.fine_tuned)


def random_model(config: Any, *, seed: int = 0) -> torch.nn.Module:
    """A causal LM of `config` (eager attention, as the package loads models) whose answers vary: its weight
    matrices drawn N(0, 0.5), the embedding N(0, 0.02), norms and biases as initialised. With the configs' own
    init every family repeats one token; with wide embeddings too the tied-head families (Gemma, Qwen, Llama 3.2)
    do, as the residual stream then holds mostly the input token's embedding."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    embedding = model.get_input_embeddings().weight
    with torch.no_grad():
        for p in model.parameters():
            if p is embedding:
                p.normal_(0, 0.02)
            elif p.dim() >= 2:
                p.normal_(0, 0.5)
    return model.eval()


def random_lora(tiny_lm_dir: str | Path) -> tuple[torch.nn.Module, Any]:
    """(model, tokenizer): the offline tiny Qwen2 with a rank-4 LoRA whose B matrices are random (so the adapter
    changes the answers; the tiny model's own init repeats one token), on the CPU."""
    from tpu_helpers.models import hf, lora

    model, tok = hf.load_causal_lm(str(tiny_lm_dir))
    torch.manual_seed(0)
    model = lora.add_lora(model, r=4)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.3)
    return model, tok


def lora_model(tiny_lm_dir: str | Path, backend: Any) -> torch.nn.Module:
    """`random_lora`'s model in eval mode on `backend`'s device: what GRPO's rollouts generate with."""
    return backend.move_model(random_lora(tiny_lm_dir)[0].eval())


def family_tokenizer(name: str, base_dir: str | Path) -> Any:
    """The tiny tokenizer of `base_dir` (models/hf_tiny.py's) with the family's special tokens and template."""
    fam = FAMILIES[name]
    tok = transformers.AutoTokenizer.from_pretrained(base_dir)
    tok.add_special_tokens({"additional_special_tokens": list(fam.specials)})
    tok.bos_token, tok.eos_token, tok.pad_token = fam.bos, fam.eos, fam.pad
    tok.chat_template = fam.template
    return tok


def build_family(name: str, out_dir: str | Path, base_dir: str | Path, *, seed: int = 0) -> Path:
    """Write the family's tiny model, tokenizer and generation_config to `out_dir` (see the module docstring)."""
    fam = FAMILIES[name]
    tok = family_tokenizer(name, base_dir)
    config = fam.config(len(tok), bos=tok.bos_token_id, eos=tok.eos_token_id, pad=tok.pad_token_id)
    model = random_model(config, seed=seed)
    model.generation_config.eos_token_id = tok.convert_tokens_to_ids(list(fam.stops))
    out = Path(out_dir)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out
