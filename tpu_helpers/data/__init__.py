"""Data: the embedded corpus, tokenizers, text loading and fixed-shape resumable loaders.

    from tpu_helpers.data import build_datasets, make_loader
    train, val, tok = build_datasets("embedded", tokenizer="byte", block_size=128)
    loader = make_loader(train, batch_size=32, **backend.loader_options)

Modules: `corpus` (generated offline text), `tokenizer` (bytes or a Hugging Face tokenizer), `text` (load text
and pack it into blocks), `loaders` (the resumable sharded sampler and DataLoader).
"""

from tpu_helpers.data.corpus import generate_corpus
from tpu_helpers.data.loaders import ResumableSampler, make_loader, release_workers
from tpu_helpers.data.text import TokenBlocks, build_datasets, load_text, pack_tokens, split_train_val
from tpu_helpers.data.tokenizer import ByteTokenizer, Tokenizer, get_tokenizer

__all__ = ["ByteTokenizer", "ResumableSampler", "TokenBlocks", "Tokenizer", "build_datasets", "generate_corpus",
           "get_tokenizer", "load_text", "make_loader", "pack_tokens", "release_workers", "split_train_val"]
