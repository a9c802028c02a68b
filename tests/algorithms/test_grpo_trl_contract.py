"""TRL 1.16's environment contract, each case as a user writes it for `GRPOTrainer(environment_factory=...)`, run
through the GRPO recipe's agent mode on the tiny offline model: REWARDS as a file path, no DATASET (reset returns
the task), reset returning content blocks, a dict of environments chosen per row, and START_FROM "sft" on the user's
own tool conversations. The turns are scripted as in test_grpo_episodes (which tokens end a turn, what a turn
parses to); the environments, their resets, the tools, the rewards and the training are the package's own."""

from __future__ import annotations

import json
import textwrap

import pytest

from tests.algorithms.test_grpo_episodes import _job, script_turns, tool_tiny_copy
from tpu_helpers.config import ConfigError, config_from_parameters
from tpu_helpers.recipes.grpo import GRPO, GRPOConfig

# Written as TRL's docs write environments: reset(**kwargs) returns the task, public methods are the tools, the
# reward function reads the environments. `multiply` is the name the scripted turns call.
ENVIRONMENTS = textwrap.dedent('''
    import random


    class Times:
        def reset(self, **kwargs) -> str:
            self.a, self.b = random.randint(2, 9), random.randint(2, 9)
            return f"What is {self.a} times {self.b}?"

        def multiply(self, a: int, b: int) -> int:
            """Multiply two integers.

            Args:
                a: The first integer.
                b: The second integer.

            Returns:
                The product.
            """
            return a * b


    class Blocks(Times):
        def reset(self, **kwargs) -> list:
            super().reset()
            return [{"type": "text", "text": f"What is {self.a} "}, {"type": "text", "text": f"times {self.b}?"}]


    class Other(Times):
        def reset(self, **kwargs) -> str:
            super().reset()
            return f"Compute {self.a} * {self.b}."


    def solved(completions, environments, **kwargs):
        out = []
        for c, env in zip(completions, environments):
            text = c[-1].get("content") or "" if c else ""
            out.append(1.0 if str(env.a * env.b) in text else 0.0)
        return out


    def brevity(completions, **kwargs):
        return [None if len(c) > 2 else -0.1 * len(c) for c in completions]
''')


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory, tiny_lm_dir):
    return tool_tiny_copy(tiny_lm_dir, tmp_path_factory.mktemp("tiny_tools") / "model")


@pytest.fixture
def scripted(monkeypatch):
    script_turns(monkeypatch)


@pytest.fixture
def user_code(tmp_path, monkeypatch):
    """The user's file, named by path as a notebook parameter would name it (relative to the working directory)."""
    (tmp_path / "envs").mkdir()
    (tmp_path / "envs" / "my_envs.py").write_text(ENVIRONMENTS)
    monkeypatch.chdir(tmp_path)
    return "envs/my_envs.py"


def _agent_job(tmp_path, model_dir, path, **overrides):
    base = dict(dataset=None, tools=None, environment=f"{path}:Times", rewards=f"{path}:solved, {path}:brevity",
                steps=2, save_every=2)
    return _job(tmp_path, model_dir, **{**base, **overrides})


def test_no_dataset_the_environment_makes_each_task_and_held_out_resets_are_seeded_apart(tmp_path, tool_model,
                                                                                          scripted, user_code):
    job = _agent_job(tmp_path, tool_model, user_code)
    before = job.samples(4)
    again = job.samples(4)
    prompts = [r["prompt"] for r in before["rows"]]
    assert all("times" in p for p in prompts) and len(set(prompts)) > 1  # each reset drew its own task
    assert prompts == [r["prompt"] for r in again["rows"]]  # seeded: the same held-out tasks before and after
    job.train()
    rows = job.history.train
    assert len(rows) == 2 and all("reward/envs/my_envs.py:solved" in r for r in rows)
    after = job.samples(4)
    pairs = GRPO.compare(before, after)
    assert [p["prompt"] for p in pairs] == prompts  # each held-out episode beside its own prompt


def test_rewards_from_a_file_none_for_not_applicable(tmp_path, tool_model, scripted, user_code):
    job = _agent_job(tmp_path, tool_model, user_code, dataset="multiply")
    assert list(job.config.reward_funcs) == [f"{user_code}:solved", f"{user_code}:brevity"]
    job.train()
    for row in job.history.train:  # brevity returns None for long episodes: left out of the mean, never a crash
        assert row[f"reward/{user_code}:brevity"] <= 0


def test_reset_returning_content_blocks_joins_their_text(tmp_path, tool_model, scripted, user_code):
    job = _agent_job(tmp_path, tool_model, user_code, environment=f"{user_code}:Blocks")
    episode = job.rollouts.runner.agent.start({"prompt": [{"role": "user", "content": "Q: "}]})
    assert episode.prompt[-1]["content"].startswith("Q: What is ") and episode.prompt[-1]["content"].endswith("?")
    job.train()
    assert len(job.history.train) == 2


def test_a_dict_of_environments_from_the_notebook_picks_one_per_row(tmp_path, tool_model, scripted, user_code):
    rows = [{"prompt": [{"role": "user", "content": ""}], "environment": name} for name in ("times", "other") * 8]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    params = dict(MODEL=tool_model, DATASET="rows.jsonl", ENVIRONMENT={"times": f"{user_code}:Times",
                                                                          "other": f"{user_code}:Other"},
                  TOOLS=None, REWARDS=f"{user_code}:solved", START_FROM=None, DEVICE="cpu", STEPS=2, BATCH_SIZE=2,
                  NUM_GENERATIONS=2, MAX_PROMPT_LEN=96, MAX_NEW_TOKENS=6, TOOL_TOKENS=24, SAVE_EVERY=2, LORA_R=4,
                  OUT_DIR=str(tmp_path / "run"), LOG_EVERY=1)
    config = config_from_parameters(params, base=GRPOConfig())
    assert sorted(config.agent.environments) == ["other", "times"]
    job = GRPO(config, progress=False)
    starts = [job.rollouts.runner.agent.start(r).prompt[-1]["content"] for r in rows[:2]]
    assert starts[0].startswith("What is") and starts[1].startswith("Compute")
    job.train()
    assert len(job.history.train) == 2
    with pytest.raises(ConfigError, match=r"DATASET=None with a dict of environments"):
        config_from_parameters({**params, "DATASET": None}, base=GRPOConfig())
    with pytest.raises(ConfigError, match=r"ENVIRONMENT\['times'\]='envs/my_envs.py:Nope': envs/my_envs.py has no"):
        config_from_parameters({**params, "ENVIRONMENT": {"times": f"{user_code}:Nope"}}, base=GRPOConfig())


def test_the_environment_is_probed_once_per_config(tmp_path, tool_model, user_code):
    (tmp_path / "envs" / "counted.py").write_text(ENVIRONMENTS + textwrap.dedent('''
        BUILT = []


        class Counted(Times):
            def __init__(self):
                BUILT.append(1)
    '''))
    job = _agent_job(tmp_path, tool_model, user_code, environment="envs/counted.py:Counted")
    import sys

    module = next(m for n, m in sys.modules.items() if n.startswith("tpu_helpers_user_counted"))
    assert len(module.BUILT) == 1  # the config's probe
    job.rollouts  # noqa: B018 (the agent: built from the probed spec, not probed again)
    assert len(module.BUILT) == 1


def test_start_from_sft_on_your_own_tool_conversations(tmp_path, tool_model, user_code):
    from tpu_helpers.agents.examples import multiply_demonstrations

    demos = tmp_path / "my_demos.jsonl"
    demos.write_text("".join(json.dumps(d) + "\n" for d in multiply_demonstrations(256, seed=3)))
    with pytest.raises(ConfigError, match=r"START_FROM='sft' with an environment fine-tunes on tool conversations"):
        _agent_job(tmp_path, tool_model, user_code, start_from="sft")
    with pytest.raises(ConfigError, match=r"SFT_DATASET='nope.jsonl' is no file"):
        _agent_job(tmp_path, tool_model, user_code, start_from="sft", sft_dataset="nope.jsonl")
    job = _agent_job(tmp_path, tool_model, user_code, start_from="sft", sft_dataset=str(demos), sft_steps=1)
    assert job.start_source == str(tmp_path / "run" / "sft" / "merged")
    assert json.loads((tmp_path / "run" / "sft" / "finetune.json").read_text())["dataset"] == str(demos)


def test_a_cut_episode_says_why_once_with_the_size_that_would_have_fit(tmp_path, tool_model, scripted, user_code):
    # Before, a TOOL_TOKENS too small for a tool's result ended the episode silently: only "cut" in the figures.
    job = _agent_job(tmp_path, tool_model, user_code, tool_tokens=4, max_turns=1)
    with pytest.warns(UserWarning, match=r"an episode was cut: a tool result took (\d+) tokens of tool text .*, more "
                                         r"than TOOL_TOKENS=4: TOOL_TOKENS=\1 would have fit it") as said:
        out = job.samples(8)
    assert out["truncated"] > 0
    assert sum("TOOL_TOKENS=4" in str(w.message) for w in said) == 1  # once per cause, then only counted
    runner = job.rollouts.runner
    assert runner.warnings["tool_tokens"] >= 1 and runner.needed["tool_tokens"] > 4


def test_an_example_dataset_brings_its_environment_and_rewards_unless_given():
    cfg = GRPOConfig(dataset="lockers", start_from=None)
    assert (cfg.environment, cfg.tools, cfg.rewards) == ("tpu_helpers.agents.examples:Lockers", None,
                                                         "tpu_helpers.agents.examples:locker_reward")
    assert cfg.agentic and list(cfg.agent.environments) == [None]
    mine = GRPOConfig(dataset="lockers", start_from=None, environment="tpu_helpers.agents.examples:Lockers",
                      rewards="answer")
    assert mine.rewards == "answer"  # given: kept
    assert GRPOConfig(dataset="mul3", start_from=None).tools == "tpu_helpers.agents.sandbox:python"
    assert not GRPOConfig(start_from=None).agentic  # the sums: single answers
