"""Reward functions for GRPO: the built-in ones, lookup by name or import path, and the checks on what they return.

    rewards = resolve_rewards("answer,format")                     # built-ins by name
    rewards = resolve_rewards(["answer", "my_pkg.rewards:brevity"])  # any callable by import path
    rewards = resolve_rewards("answer,model:runs/rm/merged")          # and reward models
    scores = score(rewards, prompts, completions, {"answer": answers})  # {name: [float, ...]}, checked

A reward is any callable `reward(prompts, completions, **fields) -> list[float]` with one number per completion,
run on the host on the decoded text, called as TRL calls it (`agents.call_reward`, the one call for answers and
agent episodes alike): it receives the records' other columns that its signature names. None for a completion
means "not applicable" (NaN, left out of the sum, as in TRL); a wrong count or a value that is not a finite number
is an error naming the reward and the completion; a completion it raises on gets NaN and a warning naming both, and
a reward that raises on every completion is an error. Import paths are `module:fn`, `path/to/file.py:fn` or
`module.fn` (`agents.loading`, as ENVIRONMENT and TOOLS); `model:PATH` is a reward model's directory, scored on the
device (`algorithms.reward_model.ModelReward`, as TRL takes a model for a reward function). The built-ins (`BUILTIN`: answer, format, number, length,
overlong) never raise on a completion: one they cannot score gets 0. In full: docs/algorithms/grpo.md.
"""

from __future__ import annotations

import math
import re
import unicodedata
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from tpu_helpers.agents.environments import call_rewards
from tpu_helpers.agents.loading import FORMS, load_object
from tpu_helpers.algorithms.reward_model import PREFIX, ModelReward
from tpu_helpers.config import ConfigError

Reward = Callable[..., Sequence[float]]

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
DEFAULT_FORMAT = r"(?s).*<answer>.+?</answer>.*"


class RewardWarning(UserWarning):
    """A built-in reward could not score some completions (they got 0); said once per call, with the count."""


def _each(name: str, one: Callable[..., float], items: Sequence[tuple]) -> list[float]:
    """one(*item) per item; an item it raises on gets 0 (a completion's text must never end a run), and the
    failures are counted into one warning naming the reward, not one per completion."""
    values, failed, first = [], 0, None
    for item in items:
        try:
            values.append(float(one(*item)))
        except Exception as err:  # noqa: BLE001 (any text may break a heuristic; the run goes on)
            values.append(0.0)
            failed += 1
            first = first or err
    if failed:
        warnings.warn(f"reward {name!r} could not score {failed} of {len(values)} completions (first: "
                      f"{type(first).__name__}: {str(first)[:120]}); they get 0", RewardWarning, stacklevel=3)
    return values


def _canonical_number(number: str) -> str:
    """The canonical decimal of a matched number, exact on its digits ("-001,000.50" -> "-1000.5"): no float (a
    number above ~1e308 would be inf, and int(inf) raises) nor int (str() of one over 4300 digits raises)."""
    digits = "".join(c if c.isascii() else str(unicodedata.decimal(c)) for c in number.replace(",", ""))
    negative = digits.startswith("-")
    whole, _, frac = digits.lstrip("-").partition(".")
    out = (whole.lstrip("0") or "0") + ("." + frac.rstrip("0") if frac.rstrip("0") else "")
    return "-" + out if negative and out != "0" else out


def normalize_answer(text: Any) -> str:
    """A comparable form of an answer: a number as its canonical decimal ("1,000.0" -> "1000"), else lower-case
    text with spaces collapsed; a GSM8K-style reference ("... #### 72") is read after its last "####"."""
    text = str(text)
    if "####" in text:
        text = text.rsplit("####", 1)[1]
    text = text.strip()
    m = _NUMBER.fullmatch(text.replace(" ", "").rstrip("."))
    if m:
        return _canonical_number(m.group(0))
    return " ".join(text.lower().split())


def extract_answer(completion: str) -> str:
    """The answer a completion gives: inside its last <answer> tag, else its last number, else the whole text."""
    tags = _ANSWER_TAG.findall(completion)
    if tags:
        return tags[-1]
    numbers = _NUMBER.findall(completion)
    return numbers[-1] if numbers else completion


def answer_reward(prompts: Sequence, completions: Sequence[str], answer: Sequence[Any], **_: Any) -> list[float]:
    """1.0 where the completion's answer equals the reference (numbers normalised), else 0.0."""
    return _each("answer", lambda c, a: a is not None and normalize_answer(extract_answer(c)) == normalize_answer(a),
                 list(zip(completions, answer, strict=True)))


def format_reward(pattern: str = DEFAULT_FORMAT) -> Reward:
    """A reward of 1.0 where the whole completion (stripped) matches `pattern`, else 0.0."""
    try:
        compiled = re.compile(pattern)
    except re.error as err:
        raise ConfigError(f"FORMAT_PATTERN={pattern!r} is not a regular expression: {err}") from None

    def reward(prompts: Sequence, completions: Sequence[str], **_: Any) -> list[float]:
        return _each("format", lambda c: compiled.fullmatch(c.strip()) is not None, [(c,) for c in completions])

    reward.__name__ = "format"
    return reward


def length_penalty(scale: float = 0.1) -> Reward:
    """-(completion tokens / max_new_tokens) * scale."""

    def reward(prompts: Sequence, completions: Sequence[str], completion_tokens: Sequence[int],
               max_new_tokens: int, **_: Any) -> list[float]:
        return _each("length", lambda n: -scale * n / max_new_tokens, [(n,) for n in completion_tokens])

    reward.__name__ = "length"
    return reward


def overlong_penalty(buffer_fraction: float = 0.25) -> Reward:
    """DAPO's soft overlong punishment: 0 up to max_new_tokens * (1 - buffer_fraction) tokens, then linearly
    down to -1 at max_new_tokens."""

    def reward(prompts: Sequence, completions: Sequence[str], completion_tokens: Sequence[int],
               max_new_tokens: int, **_: Any) -> list[float]:
        buffer = max(1.0, max_new_tokens * buffer_fraction)
        start = max_new_tokens - buffer
        return _each("overlong", lambda n: -min(1.0, max(0.0, (n - start) / buffer)), [(n,) for n in completion_tokens])

    reward.__name__ = "overlong"
    return reward


BUILTIN: dict[str, Callable[[], Reward]] = {
    "answer": lambda: answer_reward,
    "format": format_reward,
    "number": lambda: format_reward(r"-?\d[\d,]*(?:\.\d+)?"),
    "length": length_penalty,
    "overlong": overlong_penalty,
}


def reward_names(rewards: str | Sequence[str | Reward]) -> list[str | Reward]:
    items = [r.strip() for r in rewards.split(",")] if isinstance(rewards, str) else list(rewards)
    items = [r for r in items if not (isinstance(r, str) and not r)]
    if not items:
        raise ConfigError(f"REWARDS={rewards!r} is empty; give names of {sorted(BUILTIN)} or import paths such as "
                          "'my_module:my_reward'")
    return items


def resolve_reward(name: str | Reward, *, format_pattern: str = DEFAULT_FORMAT) -> tuple[str, Reward]:
    """(name, callable) for a built-in name, an import path (`agents.loading`: "pkg.mod:fn", "path/to/file.py:fn"
    or "pkg.mod.fn") or a callable."""
    if callable(name):
        return getattr(name, "__name__", type(name).__name__), name
    if not isinstance(name, str):
        raise ConfigError(f"REWARDS entry {name!r} is neither a name nor a callable")
    if name == "format":
        return name, format_reward(format_pattern)
    if name in BUILTIN:
        return name, BUILTIN[name]()
    if name.startswith(PREFIX):  # a reward model's directory, scored on the device (algorithms.reward_model)
        return name, ModelReward(name[len(PREFIX):].strip())
    if ":" not in name and "." not in name:
        raise ConfigError(f"REWARDS names {name!r}, which is no built-in reward ({', '.join(sorted(BUILTIN))}), "
                          f"import path ({FORMS}, e.g. 'my_module:my_reward') nor reward model ('{PREFIX}PATH')")
    return name, load_object(name, parameter="REWARDS")


def resolve_rewards(rewards: str | Sequence[str | Reward], *, format_pattern: str = DEFAULT_FORMAT) -> dict[str, Reward]:
    """{name: callable} of every reward named; names must be unique."""
    out: dict[str, Reward] = {}
    for item in reward_names(rewards):
        name, fn = resolve_reward(item, format_pattern=format_pattern)
        if name in out:
            raise ConfigError(f"REWARDS names {name!r} twice")
        out[name] = fn
    return out


def score(rewards: dict[str, Reward], prompts: Sequence, completions: Sequence[str], fields: dict[str, Any], *,
          warn: Callable[[str], None] | None = None) -> dict[str, list[float]]:
    """Every reward's values for the completions, checked (`agents.call_rewards`, the one reward call): one finite
    number per completion, or None for "not applicable" (NaN, as in TRL); a completion a reward raises on gets NaN
    and a warning naming both, a reward that raises on every completion is a ConfigError. `fields`: the other
    keyword arguments (per-completion lists such as `answer`, or plain values such as `max_new_tokens`)."""
    return call_rewards(rewards, prompts=prompts, completions=completions, warn=warn or _warn, **fields)


def parse_reward_weights(weights: str | Sequence[float] | None) -> tuple[float, ...] | None:
    """REWARD_WEIGHTS as numbers: "1,0.1" or [1, 0.1] (TRL's reward_weights), one per REWARDS entry in its order;
    None: each reward counts once."""
    if weights is None:
        return None
    items = [w.strip() for w in weights.split(",")] if isinstance(weights, str) else list(weights)
    try:
        out = tuple(float(w) for w in items if not isinstance(w, bool))
    except (TypeError, ValueError):
        out = ()
    if not out or len(out) < len(items) or not all(math.isfinite(w) for w in out):
        raise ConfigError(f"reward_weights={weights!r} must be finite numbers, one per REWARDS entry (\"1,0.1\" or "
                          "[1, 0.1], as TRL's reward_weights), or None for 1 each")
    return out


def summed_rewards(values: dict[str, Sequence[float]], weights: Sequence[float] | None = None) -> list[float]:
    """Each completion's reward: the sum over the reward functions of value x weight, NaN values (None: not
    applicable) left out, as TRL's GRPOTrainer sums (`nansum` of rewards x reward_weights)."""
    if weights is not None and len(weights) != len(values):
        raise ConfigError(f"reward_weights has {len(weights)} weights ({list(weights)}) for {len(values)} rewards "
                          f"({', '.join(values)}): give one weight per REWARDS entry, in its order")
    weights = weights if weights is not None else (1.0,) * len(values)
    return [sum(w * v for w, v in zip(weights, row, strict=True) if not math.isnan(v))
            for row in zip(*values.values(), strict=True)]


def _warn(message: str) -> None:
    warnings.warn(message, RewardWarning, stacklevel=4)
