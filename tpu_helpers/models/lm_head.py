"""Losses over a causal LM's output head in chunks of positions: the logits of the whole batch never exist at once.

    loss = lm_loss_sum(model, batch)                                   # SFT: next-token CE summed over targets
    hard, soft = cached_kd_sums(model, batch, temperature=2.0)         # CE and top-k KD from a teacher cache
    hard, soft = live_kd_sums(model, teacher, batch, temperature=2.0)  # CE and full-vocabulary KD, live teacher
    hard, soft = live_kd_sums(model, teacher, batch, 1.0, beta=0.5)    # the soft term a generalized JSD (GKD)
    logp = token_logps(model, ids, labels, temperature=1.0)            # per-token log-probs (DPO, ORPO)
    logp = completion_token_logps(model, ids, mask, n, temperature)    # the last n tokens' (GRPO)
    logp = completion_token_logps(model, ids, mask, n, T, group=G)     # runs of G rows of one prompt: it runs once
    set_loss_chunk(model, 0)                                           # off for this model: the full logits

Why: with Qwen's 151,936-token vocabulary the fp32 logits of 8 x 1024 tokens are 5 GB, and their log-softmax and
gradient as much again. Each chunk of tokens goes through the head and its loss in a checkpoint of its own, so at
most one chunk's logits, log-softmax and gradient are alive at a time. Why a checkpoint per chunk, which families
are chunked (`CHUNKABLE`) and when (LOSS_CHUNK, "auto" by default): docs/guides/models.md.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable
from typing import Any

import torch

from tpu_helpers.config import ConfigError
from tpu_helpers.diagnostics.safe_ops import xla_safe_kl_div

# Model types whose logits are lm_head(final hidden states) [+ final_logit_softcapping]: checked against each
# family's forward in transformers 5 (tests/models/families.py has a tiny model of each).
CHUNKABLE = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma", "gemma2", "gemma3_text", "smollm3", "olmo2")
AUTO = "auto"
CHUNK_BYTES = 256 * 2**20  # one chunk's fp32 logits under "auto"
_ATTR = "_tpu_helpers_loss_chunk"
_WARNED: set[str] = set()


def check_loss_chunk(value: Any) -> int | str:
    """LOSS_CHUNK: "auto", 0 (off) or tokens per chunk (>= 1)."""
    if value == AUTO:
        return AUTO
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"LOSS_CHUNK={value!r} must be 'auto' (chunk the logits when they are large), 0 (never: "
                          "the full logits) or a number of tokens per chunk >= 1")
    return value


def auto_chunk(vocab: int) -> int:
    """Tokens per chunk under "auto": one chunk's fp32 logits at most CHUNK_BYTES, a power of two in 128..4096."""
    tokens = max(1, CHUNK_BYTES // (4 * vocab))
    return max(128, min(4096, 1 << (tokens.bit_length() - 1)))


def set_loss_chunk(model: torch.nn.Module, value: int | str) -> None:
    """Make `value` (see `check_loss_chunk`) the chunking of every loss of `model` computed here (the recipes set
    LOSS_CHUNK so; trainers and GRPO's log-probs read it). Kept on the underlying model, which peft forwards to."""
    setattr(_base(model), _ATTR, check_loss_chunk(value))


def planned_chunk(setting: int | str, tokens: int, vocab: int) -> int:
    """Tokens per chunk of a LOSS_CHUNK `setting` for `tokens` tokens of a `vocab`-token head; 0: unchunked."""
    setting = check_loss_chunk(setting)
    size = auto_chunk(vocab) if setting == AUTO else setting
    return size if 0 < size < tokens else 0


def chunk_size(model: torch.nn.Module, tokens: int, vocab: int, chunk: int | str | None = None) -> int:
    """`planned_chunk` of `chunk`, or of `model`'s own setting (`set_loss_chunk`; "auto" when none)."""
    return planned_chunk(getattr(_base(model), _ATTR, AUTO) if chunk is None else chunk, tokens, vocab)


def _base(model: torch.nn.Module) -> torch.nn.Module:
    return model.get_base_model() if hasattr(model, "get_base_model") else model


class LMHead:
    """A causal LM split into its backbone (input ids -> final hidden states) and its head (hidden -> logits)."""

    def __init__(self, backbone: torch.nn.Module, head: torch.nn.Module, softcap: float | None) -> None:
        self.backbone, self.head, self.softcap = backbone, head, softcap
        self.vocab = head.weight.shape[0]

    def hidden(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
               position_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.backbone(input_ids=input_ids, attention_mask=attention_mask,
                             position_ids=position_ids).last_hidden_state

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """The family's logits of hidden states `h`, in float32 (what the unchunked losses take)."""
        z = self.head(h)
        if self.softcap is not None:  # Gemma 2/3, in the head's dtype as transformers does
            z = torch.tanh(z / self.softcap) * self.softcap
        return z.float()


def split_head(model: torch.nn.Module, *, warn: bool = True) -> LMHead | None:
    """`model`'s backbone and head, or None (after a warning, once per model type, with `warn`) when this module
    does not know its head (see the module docstring)."""
    base = _base(model)
    config = getattr(base, "config", None)
    kind = getattr(config, "model_type", type(base).__name__)
    backbone = getattr(base, getattr(base, "base_model_prefix", "model"), None)
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    if kind not in CHUNKABLE or not isinstance(backbone, torch.nn.Module) or head is None \
            or getattr(config, "logit_scale", None) or getattr(config, "logits_scaling", None):
        if warn and kind not in _WARNED:
            _WARNED.add(kind)
            warnings.warn(f"LOSS_CHUNK: {type(base).__name__} (model_type {kind!r}) is not a head the chunked loss "
                          f"knows ({', '.join(CHUNKABLE)}): its loss is computed from the whole batch's logits "
                          "(more memory; LOSS_CHUNK=0 silences this)", stacklevel=3)
        return None
    return LMHead(backbone, head, getattr(config, "final_logit_softcapping", None))


def checkpoint_for(t: torch.Tensor) -> Callable:
    """The checkpoint function of `t`'s device: torch_xla's on XLA (see the module docstring), torch's elsewhere and
    inside a dynamo capture (a replayed step, `backend.compile_step`: dynamo skips torch_xla's and captures torch's
    as a recomputed region)."""
    if t.device.type == "xla" and not torch.compiler.is_compiling():
        from tpu_helpers.backend import started_xla_backend

        return started_xla_backend().checkpoint_fn()
    return functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)


def map_chunks(fn: Callable[..., torch.Tensor], chunk: int, h: torch.Tensor, *others: torch.Tensor
               ) -> list[torch.Tensor]:
    """[fn(h[i:i+chunk], *(t[i:i+chunk] for t in others)) for each chunk], each recomputed in the backward."""
    recompute = torch.is_grad_enabled() and h.requires_grad
    ckpt = checkpoint_for(h) if recompute else None
    out = []
    for start in range(0, h.shape[0], chunk):
        parts = [t[start:start + chunk] for t in (h, *others)]
        out.append(ckpt(fn, *parts) if ckpt is not None else fn(*parts))
    return out


# ---- per-token math, on logits (N, V) of one chunk or of everything --------------------------------------------------
def token_logp(z: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log softmax(z)[target] per row (targets of -100 give a value to be masked by the caller)."""
    return z.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1) - z.logsumexp(-1)


def topk_kl(z: torch.Tensor, ids: torch.Tensor, t_logp: torch.Tensor, t_tail: torch.Tensor) -> torch.Tensor:
    """Per row KL(teacher's top-k + tail || student's), z the student's logits / T (`algorithms.distill`'s
    docstring says why each term is as it is)."""
    ids, t_logp, t_tail = ids.long(), t_logp.float(), t_tail.float()
    s_logp = torch.log_softmax(z, dim=-1)
    kl = (torch.exp(t_logp) * (t_logp - s_logp.gather(-1, ids))).sum(-1)
    if ids.shape[-1] < z.shape[-1]:
        # The student's tail: a logsumexp over its other entries, not log(1 - sum) (float32 rounds it to log 0).
        s_tail = s_logp.scatter(-1, ids, float("-inf")).logsumexp(-1)
        # A teacher tail of -inf weighs exactly 0 (0 * -inf would be nan, in the value and the gradient).
        has_tail = torch.isfinite(t_tail)
        safe = torch.where(has_tail, t_tail, torch.zeros_like(t_tail))
        kl = kl + torch.where(has_tail, torch.exp(safe) * (safe - s_tail), torch.zeros_like(safe))
    return kl


def full_kl(z: torch.Tensor, t_z: torch.Tensor) -> torch.Tensor:
    """Per row KL(softmax(t_z) || softmax(z)) over the whole vocabulary (XLA has no kl_div kernel)."""
    return xla_safe_kl_div(torch.log_softmax(z, -1), torch.log_softmax(t_z, -1), reduction="none",
                           log_target=True).sum(-1)


def full_jsd(z: torch.Tensor, t_z: torch.Tensor, beta: float = 0.0) -> torch.Tensor:
    """Per row generalized Jensen-Shannon divergence of the student's softmax(z) and the teacher's softmax(t_z),
    TRL GKD's `generalized_jsd_loss` summed over the vocabulary: beta 0 is KL(teacher || student) (`full_kl`),
    1 KL(student || teacher), between them beta KL(teacher || m) + (1 - beta) KL(student || m) with the mixture
    m = beta teacher + (1 - beta) student. Elementwise ops only (XLA has no kl_div kernel)."""
    if beta == 0:
        return full_kl(z, t_z)
    s_logp, t_logp = torch.log_softmax(z, -1), torch.log_softmax(t_z, -1)
    if beta == 1:
        return (torch.exp(s_logp) * (s_logp - t_logp)).sum(-1)
    m = torch.logsumexp(torch.stack([s_logp + math.log1p(-beta), t_logp + math.log(beta)]), 0)
    return beta * (torch.exp(t_logp) * (t_logp - m)).sum(-1) + (1 - beta) * (torch.exp(s_logp) * (s_logp - m)).sum(-1)


# ---- the losses, from a model and a batch ----------------------------------------------------------------------------
def _shifted(labels: torch.Tensor) -> torch.Tensor:
    """Each position's next-token target, flattened: labels[:, 1:] and -100 at every row's last position."""
    pad = torch.full_like(labels[:, :1], -100)
    return torch.cat([labels[:, 1:], pad], 1).reshape(-1)


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(t.shape[0] * t.shape[1], *t.shape[2:])


def _plan(model: torch.nn.Module, batch: dict, chunk: int | str | None) -> tuple[LMHead, int] | None:
    """(the split model, tokens per chunk), or None for the unchunked path; the warning of an unknown head only
    where chunking would have applied (a small vocabulary's batch is not chunked anyway)."""
    tokens = batch["input_ids"].numel()
    split = split_head(model, warn=False)
    if split is None:
        vocab = getattr(getattr(_base(model), "config", None), "vocab_size", None) or 2**20
        if chunk_size(model, tokens, vocab, chunk):
            split_head(model)  # says why, once
        return None
    size = chunk_size(model, tokens, split.vocab, chunk)
    return (split, size) if size else None


def _hidden(split: LMHead, batch: dict) -> torch.Tensor:
    return _flat(split.hidden(batch["input_ids"], batch.get("attention_mask"), batch.get("position_ids")))


def lm_loss_sum(model: torch.nn.Module, batch: dict, *, chunk: int | str | None = None) -> torch.Tensor | None:
    """The summed next-token CE over target tokens (labels != -100) of a dict batch, chunked; None where the
    unchunked path applies (`chunk_size` 0, or a head this does not know): the caller then takes the logits."""
    plan = _plan(model, batch, chunk)
    if plan is None:
        return None
    split, size = plan

    def ce(h: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(split.logits(h), t, ignore_index=-100, reduction="sum")

    return torch.stack(map_chunks(ce, size, _hidden(split, batch), _shifted(batch["labels"]))).sum()


def cached_kd_sums(model: torch.nn.Module, batch: dict, temperature: float, *, chunk: int | str | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(hard CE sum, T^2 * top-k KL sum) over target tokens of a batch carrying the teacher cache's
    `teacher_ids`, `teacher_logp`, `teacher_tail`, from one pass of the head per chunk; None: unchunked path."""
    plan = _plan(model, batch, chunk)
    if plan is None:
        return None
    split, size = plan
    t = float(temperature)

    def both(h: torch.Tensor, tgt: torch.Tensor, ids: torch.Tensor, lp: torch.Tensor, tail: torch.Tensor):
        z = split.logits(h)
        hard = torch.nn.functional.cross_entropy(z, tgt, ignore_index=-100, reduction="sum")
        soft = (topk_kl(z / t, ids, lp, tail) * (tgt != -100)).sum()
        return torch.stack([hard, soft])

    sums = torch.stack(map_chunks(both, size, _hidden(split, batch), _shifted(batch["labels"]),
                                  _flat(batch["teacher_ids"]), _flat(batch["teacher_logp"]),
                                  _flat(batch["teacher_tail"]))).sum(0)
    return sums[0], sums[1] * (t * t)


def live_kd_sums(model: torch.nn.Module, teacher: torch.nn.Module, batch: dict, temperature: float, *,
                 beta: float = 0.0, chunk: int | str | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(hard CE sum, T^2 * full divergence sum: `full_jsd` of `beta`, 0 the KL) against a live teacher, whose
    logits are chunked too (its hidden states come whole, without gradient); None: unchunked path (the student's
    or the teacher's head unknown)."""
    plan = _plan(model, batch, chunk)
    t_split = split_head(teacher) if plan is not None else None
    if plan is None or t_split is None:
        return None
    split, size = plan
    t = float(temperature)
    with torch.no_grad():
        t_hidden = _hidden(t_split, batch)

    def both(h: torch.Tensor, th: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        z = split.logits(h)
        with torch.no_grad():
            t_z = t_split.logits(th)
        hard = torch.nn.functional.cross_entropy(z, tgt, ignore_index=-100, reduction="sum")
        soft = (full_jsd(z / t, t_z / t, beta) * (tgt != -100)).sum()
        return torch.stack([hard, soft])

    sums = torch.stack(map_chunks(both, size, _hidden(split, batch), t_hidden, _shifted(batch["labels"]))).sum(0)
    return sums[0], sums[1] * (t * t)


def token_logps(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0, *,
                attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                chunk: int | str | None = None) -> torch.Tensor:
    """Per-token log-probabilities (B, S - 1) of labels[:, 1:] under softmax(logits[:, :-1] / T), 0 where the
    label is -100 (a DPO/ORPO sequence's log-prob is their sum). Chunked where `chunk_size` says so."""
    batch = {"input_ids": ids, "attention_mask": attention_mask, "position_ids": position_ids}
    t = float(temperature)
    targets = _shifted(labels)
    plan = _plan(model, batch, chunk)
    if plan is None:
        logits = model(input_ids=ids, attention_mask=attention_mask, position_ids=position_ids).logits
        logp = token_logp(_flat(logits).float() / t, targets)
    else:
        split, size = plan
        logp = torch.cat(map_chunks(lambda h, y: token_logp(split.logits(h) / t, y), size,
                                    _hidden(split, batch), targets))
    logp = logp.reshape(labels.shape)[:, :-1]
    return torch.where(labels[:, 1:] != -100, logp, torch.zeros_like(logp))


def cache_argument(model: torch.nn.Module) -> str:
    """The name `model`'s forward takes a KV cache by: transformers renamed `past_key_values` to `cache` (5.2x;
    Colab ships 5.15), and a forward given a name it does not know builds a cache of its own."""
    import inspect

    base = _base(model)  # a PEFT wrapper passes kwargs on
    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"


def mask_positions(mask: torch.Tensor) -> torch.Tensor:
    """Each column's position among its row's real tokens (mask 1), 0 on left padding: the position_ids of
    left-padded rows. The cumulative sum's dtype is named: torch_xla hashes a mask sent from the host (its dtype
    recorded) apart from one a graph made (none recorded), so rows of both kinds would otherwise trace two graphs."""
    return (mask.cumsum(-1, dtype=torch.long) - 1).clamp(min=0)


def completion_hidden(split: LMHead, ids: torch.Tensor, mask: torch.Tensor, completion: int,
                      group: int = 1) -> torch.Tensor:
    """The final hidden states (rows, completion, d) that predict the last `completion` tokens of left-padded `ids`.
    `group` > 1: the rows come in runs of `group` whose columns before the completion (the prompt) are the same
    tokens; the prompt's pass runs once per run and its keys and values, repeated, serve the run's completions (a
    second pass through the model's own cache; the gradient flows back through both). The same values, computed
    over rows / group + rows x completion tokens instead of rows x all. The caller keeps it out of checkpointed
    blocks: a recomputed layer would append to the cache twice."""
    positions = mask_positions(mask)
    if group > 1:
        p = ids.shape[1] - completion
        first = split.backbone(input_ids=ids[::group, :p], attention_mask=mask[::group, :p],
                               position_ids=positions[::group, :p], use_cache=True)
        cache = first.cache if "cache" in first else first.past_key_values  # the name of transformers 5.2x, of 5.15
        if cache is not None:  # None from gradient-checkpointed layers (transformers drops it): each row's own pass
            cache.batch_repeat_interleave(group)
            rest = split.backbone(input_ids=ids[:, p:-1], attention_mask=mask[:, :-1], position_ids=positions[:, p:-1],
                                  use_cache=True, **{cache_argument(split.backbone): cache}).last_hidden_state
            return torch.cat([first.last_hidden_state[:, -1:].repeat_interleave(group, 0), rest], 1)
    return split.hidden(ids, mask, positions)[:, -completion - 1:-1]


def completion_token_logps(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, completion: int,
                           temperature: float, *, chunk: int | str | None = None, group: int = 1
                           ) -> torch.Tensor | None:
    """Log-probabilities (rows, completion) of the last `completion` tokens of left-padded `ids` under
    softmax(logits / T), chunked; None: unchunked path (GRPO's `completion_logps` then takes `logits_to_keep`).
    `group` > 1: runs of `group` rows share their prompt's pass (`completion_hidden`), chunked or not, wherever
    the model's head is known."""
    plan = _plan(model, {"input_ids": ids[:, -completion:]}, chunk)  # only the completion's logits count
    if plan is None and group > 1 and (split := split_head(model, warn=False)) is not None:
        plan = (split, ids.shape[0] * completion)  # the completion's logits at once, as the unchunked path does
    if plan is None:
        return None
    split, size = plan
    t = float(temperature)
    h = completion_hidden(split, ids, mask, completion, group)
    targets = ids[:, -completion:].reshape(-1)
    logp = torch.cat(map_chunks(lambda x, y: token_logp(split.logits(x) / t, y), size, _flat(h), targets))
    return logp.reshape(ids.shape[0], completion)


class LossOfBatch(torch.nn.Module):
    """`model` whose forward(**batch) returns `.loss`, the token-averaged next-token loss computed as
    `algorithms.sft.CausalLMTrainer` does (chunked per `chunk`): what the traced and compiled memory estimates
    (`memory.traced`, `memory.compiled`, which take a model's own `.loss`) measure of the chunked step."""

    def __init__(self, model: torch.nn.Module, chunk: int | str = AUTO) -> None:
        super().__init__()
        self.model, self.chunk = model, check_loss_chunk(chunk)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, **batch: Any) -> Any:
        from types import SimpleNamespace

        batch = {"input_ids": input_ids, "labels": labels, **batch}
        total = lm_loss_sum(self.model, batch, chunk=self.chunk)
        if total is None:
            logits = self.model(**{k: v for k, v in batch.items() if k != "labels"}).logits[:, :-1].float()
            total = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels[:, 1:].flatten(),
                                                      ignore_index=-100, reduction="sum")
        return SimpleNamespace(loss=total / (labels[:, 1:] != -100).sum().clamp(min=1))
