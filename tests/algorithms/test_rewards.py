"""Built-in rewards, lookup by name or import path, and the checks on what a reward returns."""

from __future__ import annotations

import pytest

from tpu_helpers.algorithms.rewards import (
    BUILTIN,
    extract_answer,
    normalize_answer,
    resolve_rewards,
    score,
)
from tpu_helpers.config import ConfigError


def test_answers_compare_as_numbers_and_gsm8k_references_are_read_after_the_hashes():
    assert normalize_answer("1,000.0") == normalize_answer("1000") == "1000"
    assert normalize_answer(" 7. ") == "7" and normalize_answer("-3") == "-3" and normalize_answer("0.50") == "0.5"
    assert normalize_answer("Natalia sold 48/2 = 24 clips ... #### 72") == "72"
    assert normalize_answer("  Paris ") == "paris"
    assert extract_answer("so <answer>12</answer> or <answer> 13 </answer>") == " 13 "
    assert extract_answer("first 3 then 4 apples") == "4" and extract_answer("no number") == "no number"


def test_builtin_rewards_by_name():
    r = resolve_rewards("answer,format,number,length,overlong")
    assert list(r) == ["answer", "format", "number", "length", "overlong"] == list(BUILTIN)
    completions = ["<answer>1,000</answer>", "it is 7", "7", "x" * 10]
    fields = {"answer": ["1000", "7", "8", None], "completion_tokens": [4, 3, 1, 8], "max_new_tokens": 8}
    got = score(r, ["p"] * 4, completions, fields)
    assert got["answer"] == [1.0, 1.0, 0.0, 0.0]
    assert got["format"] == [1.0, 0.0, 0.0, 0.0] and got["number"] == [0.0, 0.0, 1.0, 0.0]
    assert got["length"] == pytest.approx([-0.05, -0.0375, -0.0125, -0.1])
    assert got["overlong"] == [0.0, 0.0, 0.0, -1.0]  # no penalty until the last quarter, -1 at the limit
    custom = resolve_rewards("format", format_pattern=r"\d+")
    assert score(custom, ["p"] * 2, ["12", "a1"], {})["format"] == [1.0, 0.0]


def by_path(prompts, completions, answer):
    """Named by import path in the test below: receives only the fields its signature names."""
    return [float(len(c) == len(a)) for c, a in zip(completions, answer, strict=True)]


def test_any_callable_by_import_path_gets_the_fields_it_names():
    r = resolve_rewards(["tests.algorithms.test_rewards:by_path", "tests.algorithms.test_rewards.by_path"][:1])
    got = score(r, ["p", "q"], ["12", "3"], {"answer": ["10", "10"], "completion_tokens": [2, 1], "other": [1, 2]})
    assert got == {"tests.algorithms.test_rewards:by_path": [1.0, 0.0]}
    assert list(resolve_rewards("tests.algorithms.test_rewards.by_path")) == ["tests.algorithms.test_rewards.by_path"]


def test_bad_rewards_are_errors_naming_them():
    with pytest.raises(ConfigError, match=r"REWARDS names 'acuracy', which is no built-in reward \(answer, format"):
        resolve_rewards("answer,acuracy")
    with pytest.raises(ConfigError, match=r"REWARDS='' is empty"):
        resolve_rewards("")
    with pytest.raises(ConfigError, match=r"REWARDS names 'answer' twice"):
        resolve_rewards("answer, answer")
    with pytest.raises(ConfigError, match=r"FORMAT_PATTERN='\(' is not a regular expression"):
        resolve_rewards("format", format_pattern="(")
    with pytest.raises(ConfigError, match=r"returned 1 values for 2 completions"):
        score({"short": lambda p, c: [1.0]}, ["p", "q"], ["a", "b"], {})
    with pytest.raises(ConfigError, match=r"reward 'inf' returned inf for completion 0 \('a'\)"):
        score({"inf": lambda p, c: [float("inf"), 0.0]}, ["p", "q"], ["a", "b"], {})
    with pytest.raises(ConfigError, match=r"reward 'text' returned '1' for completion 1"):
        score({"text": lambda p, c: [1, "1"]}, ["p", "q"], ["a", "b"], {})
    assert score({"flags": lambda p, c: [True, False]}, ["p", "q"], ["a", "b"], {}) == {"flags": [1.0, 0.0]}
