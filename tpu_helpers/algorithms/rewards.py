"""Reward functions for GRPO: the built-in ones, lookup by name or import path, and the checks on what they return.

    rewards = resolve_rewards("answer,format")                     # built-ins by name
    rewards = resolve_rewards(["answer", "my_pkg.rewards:brevity"])  # any callable by import path
    scores = score(rewards, prompts, completions, {"answer": answers})  # {name: [float, ...]}, checked

A reward is any callable `reward(prompts, completions, **fields) -> list[float]` with one number per completion,
run on the host on the decoded text; it receives the records' other columns that its signature names (as TRL's
do). A wrong count, a value that is not a finite number, or an exception is an error naming the reward and the
completion. The built-ins (`BUILTIN`: answer, format, number, length, overlong) never raise on a completion: one
they cannot score gets 0. The arguments, the checks and each built-in in full: docs/algorithms/grpo.md.
"""

from __future__ import annotations

import importlib
import inspect
import math
import numbers
import re
import unicodedata
import warnings
from collections.abc import Callable, Sequence
from typing import Any

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
    """(name, callable) for a built-in name, an import path ("pkg.mod:fn" or "pkg.mod.fn") or a callable."""
    if callable(name):
        return getattr(name, "__name__", type(name).__name__), name
    if not isinstance(name, str):
        raise ConfigError(f"REWARDS entry {name!r} is neither a name nor a callable")
    if name == "format":
        return name, format_reward(format_pattern)
    if name in BUILTIN:
        return name, BUILTIN[name]()
    module_name, sep, attr = name.partition(":") if ":" in name else name.rpartition(".")
    if not sep or not module_name or not attr:
        raise ConfigError(f"REWARDS names {name!r}, which is no built-in reward ({', '.join(sorted(BUILTIN))}) nor "
                          "an import path such as 'my_module:my_reward'")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise ConfigError(f"REWARDS names {name!r}, which cannot be imported ({type(err).__name__}: {err}); "
                          f"built-in rewards: {', '.join(sorted(BUILTIN))}") from None
    if not callable(fn):
        raise ConfigError(f"REWARDS names {name!r}, a {type(fn).__name__}, not a callable")
    return name, fn


def resolve_rewards(rewards: str | Sequence[str | Reward], *, format_pattern: str = DEFAULT_FORMAT) -> dict[str, Reward]:
    """{name: callable} of every reward named; names must be unique."""
    out: dict[str, Reward] = {}
    for item in reward_names(rewards):
        name, fn = resolve_reward(item, format_pattern=format_pattern)
        if name in out:
            raise ConfigError(f"REWARDS names {name!r} twice")
        out[name] = fn
    return out


def _call(fn: Reward, prompts: Sequence, completions: Sequence[str], fields: dict[str, Any]) -> Any:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return fn(prompts, completions, **fields)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return fn(prompts, completions, **fields)
    return fn(prompts, completions, **{k: v for k, v in fields.items() if k in params})


def _culprit(fn: Reward, prompts: Sequence, completions: Sequence[str], fields: dict[str, Any]) -> int | None:
    """The first completion a reward raises on when given it alone (per-completion fields sliced with it)."""
    n = len(completions)
    for i in range(n):
        one = {k: v[i:i + 1] if isinstance(v, (list, tuple)) and len(v) == n else v for k, v in fields.items()}
        try:
            _call(fn, list(prompts)[i:i + 1], list(completions)[i:i + 1], one)
        except Exception:  # noqa: BLE001 (looking for the one it raises on)
            return i
    return None


def score(rewards: dict[str, Reward], prompts: Sequence, completions: Sequence[str],
          fields: dict[str, Any]) -> dict[str, list[float]]:
    """Every reward's values for the completions, checked: one finite number per completion."""
    n = len(completions)
    out = {}
    for name, fn in rewards.items():
        try:
            values = _call(fn, prompts, completions, fields)
        except Exception as err:
            i = _culprit(fn, prompts, completions, fields)
            where = f"on completion {i} ({completions[i][:80]!r})" if i is not None else \
                f"on the batch of {n} completions (on none of them alone)"
            raise ConfigError(f"reward {name!r} raised {type(err).__name__} {where}: {err}; a reward must return a "
                              "number for any completion text") from err
        try:
            values = list(values)
        except TypeError:
            raise ConfigError(f"reward {name!r} returned a {type(values).__name__}, not a list of {n} numbers") from None
        if len(values) != n:
            raise ConfigError(f"reward {name!r} returned {len(values)} values for {n} completions; it must return "
                              "one number per completion")
        for i, v in enumerate(values):
            if not isinstance(v, numbers.Real) or not math.isfinite(v):
                raise ConfigError(f"reward {name!r} returned {v!r} for completion {i} ({completions[i][:80]!r}); "
                                  "rewards must be finite numbers")
        out[name] = [float(v) for v in values]
    return out
