"""A small GPT-style decoder (nanoGPT style) meant to be read top to bottom.

Usage::

    from tpu_helpers.models.gpt import GPT, gpt_config
    cfg = gpt_config("mini", vocab_size=tokenizer_vocab_size)
    model = GPT(cfg)
    logits, loss = model(idx, targets)          # idx, targets: (batch, seq) int64
    model.set_gradient_checkpointing(default_checkpoint_fn())   # optional, trades compute for memory

Every shape depends only on the input's shape and the loss needs no host read, so it stays XLA-friendly; nothing
here imports torch_xla. :func:`generate` and :func:`sample_text` are for looking at what the model has learned.
Why the backend passes its own checkpoint function on TPUs: docs/guides/models.md.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.utils.checkpoint
from torch.nn import functional as F

from tpu_helpers.data.tokenizer import Tokenizer

CheckpointFn = Callable[..., torch.Tensor]


@dataclass
class GPTConfig:
    """Shape of a :class:`GPT`. ``vocab_size`` is normally set from the tokenizer."""

    vocab_size: int = 256
    block_size: int = 256
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = False
    tie_weights: bool = True

    def __post_init__(self) -> None:
        for field in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{field} must be an integer >= 1, got {value!r}")
        if self.n_embd % self.n_head != 0:
            raise ValueError(
                f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout!r}")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


# The vocab of the larger presets is GPT-2's 50257 rounded up to a multiple of 64 (faster matmuls); the
# caller normally overrides it with the tokenizer's size.
PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=2, n_embd=64),
    "mini": GPTConfig(vocab_size=256, block_size=256, n_layer=6, n_head=6, n_embd=384),
    "small": GPTConfig(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768),
    "medium": GPTConfig(vocab_size=50304, block_size=1024, n_layer=24, n_head=16, n_embd=1024),
}


def gpt_config(preset: str, **overrides: object) -> GPTConfig:
    """Return a copy of the named preset with ``overrides`` applied (validated again)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    known = {f.name for f in dataclasses.fields(GPTConfig)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(
            f"unknown GPTConfig field(s) {unknown} for preset {preset!r}; valid fields: {sorted(known)}"
        )
    return dataclasses.replace(PRESETS[preset], **overrides)  # type: ignore[arg-type]


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        # (B, T, C) -> (B, n_head, T, head_dim), the layout scaled_dot_product_attention expects.
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        # SDPA rather than softmax(q k^T) v written out: CUDA runs it as a fused kernel. What the written-out form
        # saves on XLA:CPU is a few percent of a step's CPU time, too little to give up the fused kernels for without
        # a measurement on a TPU.
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """GPT-2 style decoder: token + learned position embeddings, pre-LN blocks, tied lm head."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.config = cfg
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(cfg.vocab_size, cfg.n_embd),
                "wpe": nn.Embedding(cfg.block_size, cfg.n_embd),
                "drop": nn.Dropout(cfg.dropout),
                "h": nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer)),
                "ln_f": nn.LayerNorm(cfg.n_embd, bias=cfg.bias),
            }
        )
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_weights:
            # One matrix serves as input embedding and output projection: fewer parameters, and it is
            # what GPT-2 does. The tie must exist before init so both names see the same tensor.
            self.lm_head.weight = self.transformer.wte.weight
        self._checkpoint_fn: CheckpointFn | None = None
        self.apply(self._init_weights)
        # GPT-2: residual projections are scaled so the residual stream's variance does not grow with depth.
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def set_gradient_checkpointing(self, checkpoint_fn: CheckpointFn | None) -> None:
        """Recompute each block's activations in the backward pass instead of storing them.

        ``checkpoint_fn(block, x)`` must behave like ``torch.utils.checkpoint.checkpoint``; pass
        :func:`default_checkpoint_fn` on CPU/CUDA and ``torch_xla.utils.checkpoint.checkpoint`` on XLA.
        ``None`` turns checkpointing off. Once set it is used on every forward in training mode with
        grad enabled; it is skipped only where there is no backward to save memory for (eval, no_grad).
        """
        if checkpoint_fn is not None and not callable(checkpoint_fn):
            raise TypeError(f"checkpoint_fn must be callable or None, got {type(checkpoint_fn).__name__}")
        self._checkpoint_fn = checkpoint_fn

    @property
    def gradient_checkpointing(self) -> bool:
        return self._checkpoint_fn is not None

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Return ``(logits, loss)``; logits are (B, T, vocab), loss is None without ``targets``."""
        _, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(
                f"sequence length {T} exceeds block_size {self.config.block_size}; crop or chunk the input"
            )
        pos = torch.arange(T, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        use_ckpt = self._checkpoint_fn is not None and self.training and torch.is_grad_enabled()
        for block in self.transformer.h:
            x = self._checkpoint_fn(block, x) if use_ckpt else block(x)  # type: ignore[misc]
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = None
        if targets is not None:
            # fp32 logits keep the softmax stable under bf16 autocast; a plain mean over all positions
            # keeps the graph's shapes independent of the data.
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))
        return logits, loss

    def num_params(self, exclude_embeddings: bool = True) -> int:
        """Count parameters once each (tied weights count once).

        With ``exclude_embeddings`` the lookup tables are left out: the position embedding always, and the
        token embedding only when it is not tied (a tied token embedding is also the lm head, a matmul).
        This is the ``N`` of :func:`flops_per_token` and nanoGPT's convention for tied models.
        """
        n = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            n -= self.transformer.wpe.weight.numel()
            if not self.config.tie_weights:
                n -= self.transformer.wte.weight.numel()
        return n


def default_checkpoint_fn() -> CheckpointFn:
    """The checkpoint function for CPU/CUDA: non-reentrant ``torch.utils.checkpoint.checkpoint``."""
    return functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)


def _matmul_params(cfg: GPTConfig) -> int:
    """Parameter count in :meth:`GPT.num_params` (``exclude_embeddings=True``) convention, from the config."""
    d, b = cfg.n_embd, int(cfg.bias)
    ln = d * (1 + b)
    attn = (3 * d * d + 3 * d * b) + (d * d + d * b)  # qkv, output projection
    mlp = (4 * d * d + 4 * d * b) + (4 * d * d + d * b)  # up, down
    per_layer = 2 * ln + attn + mlp
    return cfg.n_layer * per_layer + ln + cfg.vocab_size * d


def flops_per_token(cfg: GPTConfig, seq_len: int | None = None) -> float:
    """Training FLOPs (forward + backward) per token: ``6*N + 12*L*H*Q*T``.

    ``N`` counts the parameters that take part in a matmul, as :meth:`GPT.num_params` does by default: all
    block and LayerNorm parameters plus the lm head (the token embedding, when tied), but not the position
    embedding (and not an untied token embedding: a lookup costs no FLOPs). ``L`` layers, ``H`` heads,
    ``Q`` head dim, ``T`` = ``seq_len`` (default ``block_size``). The attention term is not halved for
    causal masking (the PaLM / nanoGPT convention), so MFU figures are comparable with those projects.
    """
    t = cfg.block_size if seq_len is None else seq_len
    if t < 1:
        raise ValueError(f"seq_len must be >= 1, got {t}")
    return float(6 * _matmul_params(cfg) + 12 * cfg.n_layer * cfg.n_head * cfg.head_dim * t)


@torch.no_grad()
def generate(
    model: GPT,
    idx: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    *,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Append ``max_new_tokens`` sampled tokens to ``idx`` (B, T) and return (B, T + max_new_tokens).

    The context is cropped to the last ``block_size`` tokens. ``temperature <= 0`` picks the argmax.
    Sampling happens on the CPU with ``generator`` (so a seed gives the same text on every device, and the
    global RNG is untouched). The model always sees a window padded on the right to a power of two: causal
    attention makes the padding invisible to the positions that matter, and an XLA device then compiles a
    handful of graphs instead of one per generated token.
    """
    block_size = model.config.block_size
    device = idx.device
    tokens = idx.detach().to("cpu", torch.long)
    was_training = model.training
    model.eval()
    try:
        for _ in range(max_new_tokens):
            ctx = tokens[:, -block_size:]
            n = ctx.size(1)
            width = min(block_size, max(16, 1 << (n - 1).bit_length()))
            window = F.pad(ctx, (0, width - n)).to(device)
            logits, _ = model(window)
            # index_select with a tensor index (not a Python int) keeps the position out of the graph.
            last = logits.index_select(1, torch.tensor([n - 1], device=device)).squeeze(1)
            last = last.float().cpu()
            if temperature <= 0:
                nxt = last.argmax(dim=-1, keepdim=True)
            else:
                last = last / temperature
                if top_k is not None:
                    kth = torch.topk(last, min(top_k, last.size(-1))).values[:, -1:]
                    last = last.masked_fill(last < kth, float("-inf"))
                nxt = torch.multinomial(F.softmax(last, dim=-1), 1, generator=generator)
            tokens = torch.cat([tokens, nxt], dim=1)
    finally:
        model.train(was_training)
    return tokens.to(device)


def sample_text(
    model: GPT,
    tokenizer: Tokenizer,
    prompt: str = "Once upon a time",
    max_new_tokens: int = 200,
    temperature: float = 0.8,
    top_k: int | None = 40,
    device: torch.device | str | None = None,
    seed: int = 0,
) -> str:
    """Return ``prompt`` followed by a sampled continuation; the same ``seed`` gives the same text."""
    ids = tokenizer.encode(prompt)
    if not ids:
        raise ValueError(f"prompt {prompt!r} encodes to no tokens; give a non-empty prompt")
    if device is None:
        device = next(model.parameters()).device
    idx = torch.tensor([ids], dtype=torch.long, device=device)
    gen = torch.Generator().manual_seed(seed)
    out = generate(model, idx, max_new_tokens, temperature=temperature, top_k=top_k, generator=gen)
    return tokenizer.decode(out[0].tolist())
