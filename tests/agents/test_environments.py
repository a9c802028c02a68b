"""Environments and rewards in TRL's form (agents/environments.py) against TRL 1.16's own objects: TRL's example
environment (IncrementEnv, from TRL's demo_grpo_environment.py) runs unchanged, its schemas are what transformers
renders for the callables TRL passes, and a reward function receives the keywords TRL's own `_calculate_rewards`
passes it (that method is called here on a stand-in trainer)."""

from __future__ import annotations

import math
import types

import pytest

from tpu_helpers.agents import Agent, call_reward
from tpu_helpers.core.choices import ConfigError

trl = pytest.importorskip("trl")


class IncrementEnv:  # as TRL's demo_grpo_environment.py writes it, but reset(**kwargs): TRL 1.16 passes the row
    def __init__(self):
        self._counter = 0

    def reset(self, **kwargs) -> None:
        self._counter = 0

    def increment(self, a: int) -> int:
        """
        Increment the integer by a specified value

        Args:
            a: The value to increment by

        Returns:
            The incremented integer.
        """
        self._counter += a
        return self._counter


class GuessEnv:  # owns its reward; reset takes the row and says something
    def reset(self, secret: int, **_) -> str:
        self.secret, self.solved = secret, False
        return " Guess my number."

    def guess(self, n: int) -> str:
        """Guess the number.

        Args:
            n: The guess.
        """
        self.solved = n == self.secret
        return "right" if self.solved else ("higher" if n < self.secret else "lower")

    def get_reward(self) -> float:
        return 1.0 if self.solved else 0.0


def reward_func(completions, **kwargs):  # TRL's demo reward
    return [0.0 for _ in completions]


def tool_call(name, **arguments):
    return {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": name, "arguments": arguments}}]}


def test_trls_example_environment_runs_unchanged_with_trls_schemas():
    from transformers.utils import get_json_schema

    agent = Agent(environment_factory=IncrementEnv, reward_funcs=[reward_func])
    episode = agent.start({"prompt": [{"role": "user", "content": "Increment by two."}]})
    # transformers turns each callable TRL passes in tools= into get_json_schema(callable): the bound method's here
    assert episode.schemas == [get_json_schema(IncrementEnv().increment)] == agent.schemas()
    assert episode.answer(tool_call("increment", a=2)) == [{"role": "tool", "name": "increment", "content": "2"}]
    assert episode.answer(tool_call("increment", a=3))[0]["content"] == "5"  # the instance keeps its state
    assert episode.stats.converted == 2  # an int result becomes its str(), as TRL does
    other = agent.start({"prompt": [{"role": "user", "content": "Increment by one."}]})
    assert other.environment is not episode.environment and other.answer(tool_call("increment", a=1))[0][
        "content"] == "1"
    assert agent.rewards([episode, other]) == {"reward_func": [0.0, 0.0]}


def test_reset_appends_its_string_and_get_reward_is_the_reward_source():
    agent = Agent(environment_factory=GuessEnv)  # no reward functions: the environment owns the reward
    rows = [{"prompt": [{"role": "user", "content": "Play."}], "secret": 7}] * 2
    a, b = agent.start(rows[0]), agent.start(rows[1])
    assert a.prompt == [{"role": "user", "content": "Play. Guess my number."}]
    assert a.answer(tool_call("guess", n=3))[0]["content"] == "higher"
    a.answer(tool_call("guess", n=7))
    b.answer(tool_call("guess", n=9))
    assert agent.rewards([a, b]) == {"GuessEnv": [1.0, 0.0]}


def test_a_dict_of_factories_picks_by_the_rows_environment_field():
    agent = Agent(environment_factory={"inc": IncrementEnv, "guess": GuessEnv}, reward_funcs=[reward_func])
    inc = agent.start({"environment": "inc"})
    guess = agent.start({"environment": "guess", "secret": 2})  # reset gets the row without 'environment'
    assert [s["function"]["name"] for s in inc.schemas] == ["increment"]
    assert [s["function"]["name"] for s in guess.schemas] == ["guess"]
    assert inc.prompt == [{"role": "user", "content": ""}]  # a data-free row: TRL's default prompt
    rewards = agent.rewards([inc, guess])
    assert rewards["reward_func"] == [0.0, 0.0] and math.isnan(rewards["GuessEnv"][0]) and rewards["GuessEnv"][1] == 0
    with pytest.raises(ConfigError, match=r"environment='chess', which is not among the environments given "
                                          r"\(\['guess', 'inc'\]\)"):
        agent.start({"environment": "chess"})


def _trl_keywords(rows, prompts, completions, environments):
    """The keywords TRL 1.16's GRPOTrainer._calculate_rewards passes a reward function (run on a stand-in self)."""
    from trl import GRPOTrainer

    got = {}

    def spy(**kwargs):
        got.update(kwargs)
        return [0.0] * len(kwargs["completions"])

    fn = getattr(GRPOTrainer._calculate_rewards, "__wrapped__", GRPOTrainer._calculate_rewards)
    stand_in = types.SimpleNamespace(
        accelerator=types.SimpleNamespace(device="cpu", is_main_process=True), reward_funcs=[spy],
        reward_processing_classes=[None], reward_func_names=["spy"], state=types.SimpleNamespace(global_step=0),
        _log_completion_extra=lambda *a: None, _log_metric=lambda *a: None, environments=environments,
        args=types.SimpleNamespace(report_to=[]))
    fn(stand_in, rows, prompts, completions, [[1]] * len(rows))
    return got


def test_a_reward_function_gets_trls_keywords_with_the_whole_episode_and_environments():
    agent = Agent(environment_factory=GuessEnv, reward_funcs=[reward_func])
    rows = [{"prompt": [{"role": "user", "content": "Play."}], "secret": s} for s in (4, 5)]
    episodes = [agent.start(r) for r in rows]
    for e in episodes:
        e.answer(tool_call("guess", n=4))
        e.answer({"role": "assistant", "content": "Done."})
    ours = {}

    def spy(**kwargs):
        ours.update(kwargs)
        return [None, 2]

    values = call_reward(spy, name="spy", prompts=[e.prompt for e in episodes],
                         completions=[e.completion for e in episodes], rows=rows,
                         environments=[e.environment for e in episodes], completion_ids=[[1], [1]])
    theirs = _trl_keywords(rows, [e.prompt for e in episodes], [e.completion for e in episodes],
                           [e.environment for e in episodes])
    assert sorted(ours) == sorted(theirs) == ["completion_ids", "completions", "environments", "log_extra",
                                              "log_metric", "prompts", "secret", "trainer_state"]
    assert ours["completions"][0] == [tool_call("guess", n=4), {"role": "tool", "name": "guess", "content": "right"},
                                      {"role": "assistant", "content": "Done."}]
    assert ours["environments"][1].secret == 5 and ours["secret"] == [4, 5] == theirs["secret"]
    assert math.isnan(values[0]) and values[1] == 2.0  # None: not applicable, NaN as in TRL


def test_a_function_without_kwargs_gets_what_it_names_and_bad_values_are_named():
    def short(completions, secret):
        return [float(s) for s in secret]

    assert call_reward(short, name="short", prompts=[[]], completions=[[]], rows=[{"secret": 3}]) == [3.0]
    with pytest.raises(ConfigError, match=r"reward 'r' returned 1 values for 2 completions"):
        call_reward(lambda **k: [1.0], name="r", prompts=[[], []], completions=[[], []], rows=[{}, {}])
    with pytest.raises(ConfigError, match=r"reward 'r' returned 'x' for completion 0"):
        call_reward(lambda **k: ["x"], name="r", prompts=[[]], completions=[[]], rows=[{}])

    async def later(completions, **_):
        return [0.5] * len(completions)

    assert call_reward(later, name="later", prompts=[[]], completions=[[]], rows=[{}]) == [0.5]


def test_bad_environments_and_missing_rewards_are_clear_errors():
    class NoReset:
        def act(self, x: int) -> int:
            """Act.

            Args:
                x: X.
            """

    class Undocumented:
        def reset(self):
            pass

        def act(self, x: int) -> int:
            return x

    class Clash(IncrementEnv):
        pass

    def increment(a: int) -> int:
        """Clash with the environment's method.

        Args:
            a: A.
        """

    with pytest.raises(ConfigError, match=r"the environment .*NoReset has no reset method; an environment needs "
                                          r"reset\(\*\*row\) -> str \| None"):
        Agent(environment_factory=NoReset, reward_funcs=[reward_func])
    with pytest.raises(ConfigError, match=r"Undocumented method '.*Undocumented.act' has no JSON schema "
                                          r"\(DocstringParsingException"):
        Agent(environment_factory=Undocumented, reward_funcs=[reward_func])
    with pytest.raises(ConfigError, match=r"no reward source: give reward functions \(REWARDS\), or an environment "
                                          r"whose class defines get_reward\(\)"):
        Agent(environment_factory=IncrementEnv)
    with pytest.raises(ConfigError, match=r"two tools named 'increment'"):
        Agent(tools=[increment], environment_factory=Clash, reward_funcs=[reward_func])
    class Strict(IncrementEnv):  # the demo's own reset(self): TRL 1.16 calls it with the row, and fails there too
        def reset(self) -> None:
            pass

    with pytest.raises(ConfigError, match=r"Strict.reset cannot take the row's fields \['prompt'\] .*TRL calls "
                                          r"reset\(\*\*row\) with every field of the row"):
        Agent(environment_factory=Strict, reward_funcs=[reward_func]).start({"prompt": "hi"})
    with pytest.raises(ConfigError, match=r"factory .* raised ZeroDivisionError when called with no arguments"):
        Agent(environment_factory=lambda: 1 / 0, reward_funcs=[reward_func])


class BlockEnv:
    def reset(self, **kwargs) -> list:
        return [{"type": "text", "text": " Guess "}, {"type": "text", "text": "a number."}]

    def guess(self, n: int) -> str:
        """Guess.

        Args:
            n: The guess.
        """
        return "right"


class ImageEnv(BlockEnv):
    def reset(self, **kwargs) -> list:
        return [{"type": "image", "image": None}, {"type": "text", "text": "What is this?"}]


def test_reset_may_return_trls_content_blocks_text_joined_and_an_image_refused():
    agent = Agent(environment_factory=BlockEnv, reward_funcs=[reward_func])
    episode = agent.start({"prompt": [{"role": "user", "content": [{"type": "text", "text": "Play."}]}]})
    assert episode.prompt[-1]["content"] == "Play. Guess a number."
    images = Agent(environment_factory=ImageEnv, reward_funcs=[reward_func])
    with pytest.raises(ConfigError, match=r"ImageEnv.reset returned a content block of type 'image'; the package "
                                          r"trains text-only models"):
        images.start({"prompt": "Look."})
