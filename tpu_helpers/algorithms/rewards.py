"""Reward functions for GRPO: the built-in ones, lookup by name or import path, and the checks on what they return.

    rewards = resolve_rewards("answer,format")                     # built-ins by name
    rewards = resolve_rewards(["answer", "my_pkg.rewards:brevity"])  # any callable by import path
    scores = score(rewards, prompts, completions, {"answer": answers})  # {name: [float, ...]}, checked

A reward is any callable `reward(prompts, completions, **fields) -> list[float]` with one number per completion,
run on the host on the decoded text (the trainer's one host read per generation brings the tokens there).
`fields` holds the records' other columns (e.g. `answer`, one per completion) and `completion_tokens` (the token
count of each completion); a function receives the ones its signature names, or all of them with `**kwargs`
(TRL's reward functions take the same arguments). A reward that returns the wrong number of values, or a value
that is not a finite number, is an error naming the reward, the completion and the value.

Built-ins (`BUILTIN`):
- `answer`: 1.0 when the completion's answer equals the reference `answer`, else 0.0. The answer is the text inside
  the last <answer>...</answer> when there is one, else the last number in the completion; numbers compare as
  numbers ("1,000" == "1000.0"), and a reference written GSM8K-style ("... #### 72") is read after "####";
- `format`: 1.0 when the whole completion matches a regex (`format_reward(pattern)`; the default asks for
  `<answer>...</answer>` somewhere), else 0.0; `number`: the completion is one number and nothing else;
- `length`: a length penalty, -(completion tokens / max_new_tokens) * 0.1 (prefer short answers, gently);
- `overlong`: DAPO's soft overlong penalty, 0 until the last quarter of max_new_tokens, then down to -1.
"""

from __future__ import annotations

import importlib
import inspect
import math
import numbers
import re
from collections.abc import Callable, Sequence
from typing import Any

from tpu_helpers.config import ConfigError

Reward = Callable[..., Sequence[float]]

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
DEFAULT_FORMAT = r"(?s).*<answer>.+?</answer>.*"


def normalize_answer(text: Any) -> str:
    """A comparable form of an answer: a number as its canonical decimal ("1,000.0" -> "1000"), else lower-case
    text with spaces collapsed; a GSM8K-style reference ("... #### 72") is read after its last "####"."""
    text = str(text)
    if "####" in text:
        text = text.rsplit("####", 1)[1]
    text = text.strip()
    m = _NUMBER.fullmatch(text.replace(" ", "").rstrip("."))
    if m:
        value = float(m.group(0).replace(",", ""))
        return str(int(value)) if value == int(value) else repr(value)
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
    return [float(a is not None and normalize_answer(extract_answer(c)) == normalize_answer(a))
            for c, a in zip(completions, answer, strict=True)]


def format_reward(pattern: str = DEFAULT_FORMAT) -> Reward:
    """A reward of 1.0 where the whole completion (stripped) matches `pattern`, else 0.0."""
    try:
        compiled = re.compile(pattern)
    except re.error as err:
        raise ConfigError(f"FORMAT_PATTERN={pattern!r} is not a regular expression: {err}") from None

    def reward(prompts: Sequence, completions: Sequence[str], **_: Any) -> list[float]:
        return [float(compiled.fullmatch(c.strip()) is not None) for c in completions]

    reward.__name__ = "format"
    return reward


def length_penalty(scale: float = 0.1) -> Reward:
    """-(completion tokens / max_new_tokens) * scale."""

    def reward(prompts: Sequence, completions: Sequence[str], completion_tokens: Sequence[int],
               max_new_tokens: int, **_: Any) -> list[float]:
        return [-scale * n / max_new_tokens for n in completion_tokens]

    reward.__name__ = "length"
    return reward


def overlong_penalty(buffer_fraction: float = 0.25) -> Reward:
    """DAPO's soft overlong punishment: 0 up to max_new_tokens * (1 - buffer_fraction) tokens, then linearly
    down to -1 at max_new_tokens."""

    def reward(prompts: Sequence, completions: Sequence[str], completion_tokens: Sequence[int],
               max_new_tokens: int, **_: Any) -> list[float]:
        buffer = max(1.0, max_new_tokens * buffer_fraction)
        start = max_new_tokens - buffer
        return [-min(1.0, max(0.0, (n - start) / buffer)) for n in completion_tokens]

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


def score(rewards: dict[str, Reward], prompts: Sequence, completions: Sequence[str],
          fields: dict[str, Any]) -> dict[str, list[float]]:
    """Every reward's values for the completions, checked: one finite number per completion."""
    n = len(completions)
    out = {}
    for name, fn in rewards.items():
        values = _call(fn, prompts, completions, fields)
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
