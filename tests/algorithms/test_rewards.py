"""Built-in rewards, lookup by name or import path, and the checks on what a reward returns."""

from __future__ import annotations

import math

import pytest
import torch

from tpu_helpers.algorithms.rewards import (
    BUILTIN,
    extract_answer,
    normalize_answer,
    parse_reward_weights,
    resolve_rewards,
    score,
    summed_rewards,
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


NASTY = ["9" * 400, "1" + "0" * 5000, "-" + "9" * 400 + ".5", "1e999", "nan", "inf", "", "\x00\ud800", "٣", "1,,,",
         "<answer>" + "9" * 400 + "</answer>", "<answer></answer>", "." * 1000, "-0", "0" * 400 + ".000"]


def test_builtin_rewards_never_raise_on_any_string():
    # A 400-digit number used to be int(float("inf")): OverflowError, and the run died.
    assert normalize_answer("9" * 400) == "9" * 400 and normalize_answer("9" * 400) != normalize_answer("9" * 399 + "8")
    assert normalize_answer("1" + "0" * 5000) == "1" + "0" * 5000  # beyond int()'s 4300-digit str limit
    assert normalize_answer("-0") == "0" == normalize_answer("000.000") and normalize_answer("٣") == "3"
    r = resolve_rewards("answer,format,number,length,overlong")
    n = len(NASTY)
    got = score(r, ["p"] * n, NASTY, {"answer": ["9" * 400] * n, "completion_tokens": [3] * n, "max_new_tokens": 8})
    assert got["answer"][0] == 1.0 and got["answer"][10] == 1.0 and sum(got["answer"]) == 2.0


def test_a_builtin_reward_that_breaks_on_some_completions_gives_them_0_and_one_counted_warning(monkeypatch):
    from tpu_helpers.algorithms import rewards as rw

    def explode(text):
        if "boom" in text:
            raise RuntimeError("no")
        return text.strip()

    monkeypatch.setattr(rw, "extract_answer", explode)
    with pytest.warns(rw.RewardWarning) as caught:
        got = score(resolve_rewards("answer"), ["p"] * 4, ["1", "boom", "boom 1", "2"], {"answer": ["1", "1", "1", "2"]})
    assert got["answer"] == [1.0, 0.0, 0.0, 1.0]
    assert len(caught) == 1 and "reward 'answer' could not score 2 of 4 completions" in str(caught[0].message)


def test_a_user_reward_that_raises_on_some_completions_gives_them_nan_and_a_warning_naming_both():
    def picky(prompts, completions, answer):
        return [1.0 / len(c) for c in completions]  # ZeroDivisionError on the empty completion

    with pytest.warns(UserWarning, match=r"reward 'picky' raised ZeroDivisionError on completion 2 \(''\)"):
        got = score({"picky": picky}, ["p"] * 3, ["a", "bb", ""], {"answer": ["1", "2", "3"], "max_new_tokens": 8})
    assert got["picky"][:2] == [1.0, 0.5] and math.isnan(got["picky"][2])
    with pytest.raises(ConfigError, match=r"reward 'picky' raised ZeroDivisionError on every one of the 2 "):
        score({"picky": picky}, ["p"] * 2, ["", ""], {"answer": ["1", "2"]})


def test_none_means_not_applicable_for_answers_as_for_episodes():
    # TRL's rule, one policy for every reward call: None is NaN, and NaN terms are left out of the sum.
    got = score({"some": lambda prompts, completions: [None, 1]}, ["p", "q"], ["a", "b"], {})
    assert math.isnan(got["some"][0]) and got["some"][1] == 1.0


def test_rewards_load_from_a_file_path_as_environment_and_tools_do(tmp_path):
    (tmp_path / "my_rewards.py").write_text("def brevity(completions, **kwargs):\n"
                                            "    return [-len(c) for c in completions]\n")
    r = resolve_rewards(f"answer, {tmp_path}/my_rewards.py:brevity")
    got = score(r, ["p", "q"], ["1", "22"], {"answer": ["1", "2"]})
    assert got == {"answer": [1.0, 0.0], f"{tmp_path}/my_rewards.py:brevity": [-1.0, -2.0]}


def test_rewards_sum_weighted_as_trls_nansum_none_left_out():
    values = {"answer": [1.0, math.nan, 0.0, math.nan], "model:rm": [2.5, -1.0, math.nan, math.nan]}
    trl = (torch.tensor(list(values.values())).T * torch.tensor([1.0, 0.1])).nansum(1)  # GRPOTrainer's sum
    assert summed_rewards(values, (1.0, 0.1)) == pytest.approx(trl.tolist())
    assert summed_rewards(values) == pytest.approx([3.5, -1.0, 0.0, 0.0])
    assert parse_reward_weights("1, 0.1") == parse_reward_weights([1, 0.1]) == (1.0, 0.1)
    assert parse_reward_weights(None) is None
    for bad in ("1,x", "", [float("inf")], [True]):
        with pytest.raises(ConfigError, match=r"reward_weights=.* must be finite numbers, one per REWARDS entry"):
            parse_reward_weights(bad)
    with pytest.raises(ConfigError, match=r"2 weights .* for 1 rewards \(answer\)"):
        summed_rewards({"answer": [1.0]}, (1.0, 2.0))


def test_the_rollouts_total_leaves_a_none_out_and_weighs_each_reward(tmp_path):
    from tpu_helpers.recipes.grpo import GRPO, GRPOConfig

    (tmp_path / "my_rewards.py").write_text("def sometimes(completions, **kwargs):\n"
                                            "    return [None if i % 2 else 1.0 for i in range(len(completions))]\n")
    some_path = f"{tmp_path}/my_rewards.py:sometimes"
    job = GRPO(GRPOConfig(start_from=None, rewards=f"number,{some_path}", reward_weights="0.5,3", max_records=16,
                          max_prompt_len=24, max_new_tokens=3, out_dir=str(tmp_path / "run")), progress=False)
    got = job.samples(4)
    number, some = got["rewards"]["number"], got["rewards"][some_path]
    assert math.isfinite(got["reward"]) and some == 1.0  # the mean of the values that apply
    assert got["reward"] == pytest.approx(0.5 * number + 3 * 1.0 * 2 / 4)
    with pytest.raises(ConfigError, match=r"REWARD_WEIGHTS='1' gives 1 weights for the rewards answer, format: one"):
        GRPOConfig(start_from=None, rewards="answer,format", reward_weights="1")
