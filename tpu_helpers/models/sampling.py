"""How the next token is chosen from logits: greedy, or sampled with temperature, top-k and top-p by an exponential
race whose noise is a counter-based hash computed on the device.

    token, logp = pick(logits, Sampling(temperature=0.8, top_p=0.95), (seed, step))   # (rows,) each

The race (Gumbel-max) draws each token with its own probability however large the vocabulary, neither syncs nor
recompiles, hashes the same bits on the CPU, CUDA and XLA, and needs no generator state: a resumed run that passes
the same seed samples the same answers. `logprobs` are the chosen tokens' log-probabilities under
softmax(logits / temperature) before top-k/top-p truncation, what a training forward pass computes. Why a race
rather than an inverse CDF, and why no torch generator: docs/guides/models.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tpu_helpers.config import ConfigError

_M32 = 0xFFFFFFFF
# Multipliers below 2**31: a 32-bit value times one stays below 2**63, so int64 arithmetic never overflows and the
# hash is the same on every device.
_MUL = (0x7FEB352D, 0x5BD1E995, 0x2C1B3C6D, 0x297A2D39)


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen: temperature 0 is greedy (argmax); top_k 0 and top_p 1.0 turn those off."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not (isinstance(self.temperature, (int, float)) and self.temperature >= 0):
            raise ConfigError(f"TEMPERATURE={self.temperature!r} must be >= 0 (0 is greedy)")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ConfigError(f"TOP_K={self.top_k!r} must be an integer >= 0 (0 keeps every token)")
        if not (isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0):
            raise ConfigError(f"TOP_P={self.top_p!r} must be in (0, 1] (1.0 keeps every token)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


GREEDY = Sampling()


# ---- random numbers from a counter (no generator state) ------------------------------------------------------------
def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (xor-shift-multiply) on int64 tensors holding values in [0, 2**32); in place (`x`
    is the result): the noise is a few passes over (rows, vocabulary) int64 tensors, where eager backends spend more
    on allocating and paging in a new tensor per operation than on the arithmetic."""
    x.bitwise_xor_(x >> 16).mul_(_MUL[0]).bitwise_and_(_M32)
    x.bitwise_xor_(x >> 15).mul_(_MUL[1]).bitwise_and_(_M32)
    return x.bitwise_xor_(x >> 16)


def _key_hash(seed: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """One 32-bit value (an int64 scalar) from `seed` (int64, any shape: its entries are all mixed in) and `step`."""
    h = torch.zeros((), dtype=torch.long, device=seed.device)
    for k, part in enumerate([*seed.reshape(-1).unbind(0), step.reshape(())]):
        h = _mix((h * _MUL[2 + k % 2] + (part & _M32) + k) & _M32)  # a new tensor each time: nothing aliased
    return h


def exponentials(seed: torch.Tensor, step: torch.Tensor, tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    """Exp(1) draws (float32) shaped like `tokens` ((rows, n) token ids), one per (seed, step, row, token id): the
    noise of the exponential race in `pick`. Each is -log(1 - v) of a v in (0, 1) with float32's relative
    precision down to 2**-56 (32 hashed bits, then 24 more from a second mix below the lowest): a token of
    probability p wins when its draw is below ~p times the winner's ratio, so tiny draws must keep their
    resolution (a 24-bit uniform stops at 6e-8). The largest draw is 16.6 (v <= 1 - 2**-24): a cut that changes a
    winner with a chance below 6e-8. Integer arithmetic up to the float conversion: the same bits on every device."""
    h = _key_hash(seed, step)
    row = torch.arange(tokens.shape[0], device=tokens.device, dtype=torch.long).unsqueeze(-1)
    cell = (row * vocab + tokens.long()).bitwise_and_(_M32)
    hi = _mix(_mix((cell * _MUL[3]).add_(h).bitwise_and_(_M32)).bitwise_xor_(cell.add_(1).bitwise_and_(_M32)))
    lo = _mix(hi ^ _MUL[2]).bitwise_right_shift_(8)  # below hi's last bit (a function of hi: the marginal stays uniform)
    v = hi.float().mul_(2.0 ** -32).add_(lo.float().add_(0.5).mul_(2.0 ** -56))
    return v.clamp_(max=1.0 - 2.0 ** -24).neg_().log1p_().neg_()  # -log1p(-v)


def _race(logp: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The exponential race (Gumbel-max): the argmax of p / E, E ~ Exp(1) per entry, is entry i with probability
    p_i / sum(p), each entry on its own: no cumulative sum, whose float32 rounding near 1 (spacing 6e-8) could
    leave tokens below ~3e-8 of a 150k vocabulary undrawable. Entries with logp -inf never win."""
    return noise.log_().neg_().add_(logp).argmax(-1)  # logp - log(noise), in `noise` (a fresh tensor)


def pick(logits: torch.Tensor, sampling: Sampling, key: tuple[torch.Tensor, torch.Tensor] | None
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """(token, log-probability) per row from (rows, vocab) logits; `key`: (seed, step) device tensors when
    sampling (the noise is a function of them, the row and the token id: see `exponentials`)."""
    logits = logits.float()
    if sampling.greedy:
        token = logits.argmax(-1)
        return token, torch.log_softmax(logits, -1).gather(-1, token.unsqueeze(-1)).squeeze(-1)
    if key is None:
        raise ValueError(f"sampling {sampling} needs a key (seed, step); only greedy picks without one")
    seed, step = key
    vocab = logits.shape[-1]
    scaled = logits / sampling.temperature
    logp = torch.log_softmax(scaled, -1)
    if sampling.top_k or sampling.top_p < 1.0:
        k = min(sampling.top_k or vocab, vocab)
        # topk returns the k best sorted (all of them when only top_p is set): truncate, then race among those.
        vals, idx = scaled.topk(k, dim=-1)
        kept = torch.log_softmax(vals, -1)
        if sampling.top_p < 1.0:
            # Keep the smallest prefix whose mass reaches top_p (the best token always stays); the rest get -inf.
            probs = kept.exp()
            before = probs.cumsum(-1) - probs
            kept = torch.where(before < sampling.top_p, kept, torch.full_like(kept, float("-inf")))
        choice = _race(kept, exponentials(seed, step, idx, vocab))  # each token's noise keyed on its id
        token = idx.gather(-1, choice.unsqueeze(-1)).squeeze(-1)
    else:
        ids = torch.arange(vocab, device=logits.device).expand(logits.shape[0], vocab)
        token = _race(logp, exponentials(seed, step, ids, vocab))
    return token, logp.gather(-1, token.unsqueeze(-1)).squeeze(-1)
