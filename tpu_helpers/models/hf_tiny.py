"""The offline default for fine-tuning: a tiny Qwen2 model and a BPE tokenizer, built locally, saved as HF dirs.

    path = tiny_model_dir()                     # built once (deterministic), then reused from the cache
    model = AutoModelForCausalLM.from_pretrained(path); tok = AutoTokenizer.from_pretrained(path)

Nothing is downloaded: the tokenizer is trained with the `tokenizers` library on the package's embedded corpus plus
the text of the generated instruction data set (tpu_helpers.data.sft), wrapped as a `PreTrainedTokenizerFast` with a
ChatML-style chat template, and the model is a randomly initialised Qwen2 of a few layers. Both are written with
`save_pretrained`, so the fine-tuning recipe loads them through exactly the `from_pretrained` path a hub name takes.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

TINY_MODEL_NAME = "tiny-qwen2"
# Everything that changes the built files: bump it when the recipe changes so stale caches are rebuilt.
RECIPE_VERSION = 1
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TINY_ARCH = dict(hidden_size=96, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True)


def default_cache_dir() -> Path:
    return Path(os.environ.get("TPU_HELPERS_CACHE", Path.home() / ".cache" / "tpu_helpers")) / "hf"


def tiny_model_dir(cache_dir: str | os.PathLike | None = None, *, vocab_size: int = 512, seed: int = 0) -> Path:
    """The directory of the tiny model + tokenizer, building it on first use (atomically: a temp dir renamed)."""
    key = hashlib.sha256(json.dumps([RECIPE_VERSION, vocab_size, seed, TINY_ARCH]).encode()).hexdigest()[:10]
    target = Path(cache_dir or default_cache_dir()) / f"{TINY_MODEL_NAME}-{key}"
    if (target / "config.json").exists() and (target / "tokenizer.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".tmp", dir=target.parent))
    try:
        tokenizer = build_tiny_tokenizer(vocab_size=vocab_size)
        model = build_tiny_model(tokenizer, seed=seed)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            os.rename(tmp, target)
        except OSError:  # another process built it first: theirs is as good as ours (deterministic)
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _training_text() -> list[str]:
    from tpu_helpers.data.corpus import generate_corpus
    from tpu_helpers.data.sft import instruction_records

    texts = generate_corpus(300_000, seed=0).split("\n\n")
    for rec in instruction_records(n=2000, seed=1):
        texts.append("".join(f"{m['role']}\n{m['content']}\n" for m in rec["messages"]))
    return texts


def build_tiny_tokenizer(vocab_size: int = 512):
    """A byte-level BPE tokenizer (digits split one by one) trained on local text, as a PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # Digits one per token, so arithmetic answers are a fixed number of tokens per digit.
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_training_text(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   model_max_length=TINY_ARCH["max_position_embeddings"])
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_model(tokenizer, *, seed: int = 0, **arch):
    """A randomly initialised Qwen2ForCausalLM sized for CPU tests (about 0.4M parameters)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    sizes = {"vocab_size": len(tokenizer), **TINY_ARCH, **arch}
    config = Qwen2Config(bos_token_id=None, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                         **sizes)
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config)
