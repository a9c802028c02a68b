"""The agents notebook under papermill on the CPU with its default environment (Lockers, scored by locker_reward)
and tiny sizes: its results (reward, turns and tool-call success before -> after), curves, transcripts, checkpoints,
exports and the runner's highlights; and every target preset is a valid agent configuration.

The tiny offline Qwen2 stands in for SmolLM2 with a context of 1024 positions (a copy of it): the tool schemas the
prompt carries take about 580 of its tokens, past its own 256. It answers at random, so its episodes rarely call a
tool; what the test holds is the notebook's plumbing and what it leaves behind, not learning."""

from __future__ import annotations

import json
import shutil

import pytest

from tpu_helpers.agents.examples import EXAMPLES
from tpu_helpers.algorithms.episodes import transcript
from tpu_helpers.config import config_from_parameters
from tpu_helpers.launch.runner import declared_parameters, highlights, run_notebook
from tpu_helpers.platform.targets import TARGETS
from tpu_helpers.recipes.grpo import GRPOConfig, curves_figure
from tpu_helpers.training.results import render_png

pytestmark = pytest.mark.notebooks

NAME = "agents_llm"
TINY = {"START_FROM": None, "STEPS": 2, "BATCH_SIZE": 2, "NUM_GENERATIONS": 2, "MAX_NEW_TOKENS": 6,
        "TOOL_TOKENS": 48, "MAX_TURNS": 2, "MAX_PROMPT_LEN": 640, "LOG_EVERY": 1, "SAVE_EVERY": 2, "WARMUP_STEPS": 1,
        "NUM_SAMPLES": 4, "LORA_R": 4, "LR": 1e-2}


@pytest.fixture(scope="module")
def long_tiny_dir(tmp_path_factory, tiny_lm_dir):
    """The tiny Qwen2 with a context of 1024 positions (as tests/algorithms/test_grpo_episodes.py makes it)."""
    target = tmp_path_factory.mktemp("tiny_long") / "model"
    shutil.copytree(tiny_lm_dir, target)
    config = json.loads((target / "config.json").read_text())
    config["max_position_embeddings"] = 1024
    (target / "config.json").write_text(json.dumps(config))
    return str(target)


def test_agents_notebook_on_cpu_shows_episodes_curves_and_exports(notebooks, tmp_path, long_tiny_dir):
    out_dir = tmp_path / "out"
    result = run_notebook(notebooks[NAME], target="cpu", runs_dir=tmp_path / "runs",
                          params={**TINY, "MODEL": long_tiny_dir, "OUT_DIR": str(out_dir)})
    assert result.ok, result.error
    results = json.loads((out_dir / "results.json").read_text())
    config = results["config"]
    assert (config["environment"], config["rewards"], config["dataset"]) == (
        "tpu_helpers.agents.examples:Lockers", "tpu_helpers.agents.examples:locker_reward", "lockers")
    assert results["report"]["steps"] == 2 and results["plan"]["fits"]
    # The held-out figures before -> after, each episode's turns in [1, MAX_TURNS + 1]; the success rate is None
    # when no episode called a tool (a random model's usual case), else a rate.
    for when in ("before", "after"):
        assert 0 <= results["reward"][when] <= 1
        assert 1 <= results["turns"][when] <= 3
        assert results["tool_success"][when] is None or 0 <= results["tool_success"][when] <= 1
        samples = results[f"samples_{when}"]
        assert len(samples["rows"]) == 4 and all(isinstance(r["transcript"], str) for r in samples["rows"])
        # each episode's messages after its prompt, as reward functions and metrics take them
        completions = samples["completions"]
        assert len(completions) == 4 and all(c and c[0]["role"] == "assistant" for c in completions)
        assert [transcript(c) for c in completions] == [r["transcript"] for r in samples["rows"]]
    # The curves carry the agent's turns and tool-call success, drawn into grpo.png beside loss.png.
    curves = results["curves"]
    assert curves["step"] == [1, 2] and {"turns", "tool_success"} <= set(curves)
    assert all(1 <= t <= 3 for t in curves["turns"])
    assert (out_dir / "grpo.png").read_bytes() == render_png(curves_figure(curves))
    assert (out_dir / "loss.png").is_file()
    # Checkpoints and exports.
    assert (out_dir / "checkpoints" / "ckpt-00000002.pt").is_file()
    assert (out_dir / "adapter" / "adapter_config.json").is_file()
    assert (out_dir / "merged" / "config.json").is_file()
    # What the executed notebook printed: the figures before, a few transcripts, reward A -> B, the checkpoints.
    text = "".join("".join(o.get("text", "")) for c in json.loads((result.directory / f"{NAME}.ipynb").read_text())
                   ["cells"] for o in c.get("outputs", ()))
    first = results["samples_before"]["rows"][0]
    assert f"--- {first['prompt']}  (reward {first['reward']:g})\n{first['transcript']}" in text
    assert "Lockers:" in first["prompt"]  # the environment's reset, appended to the question
    before, after = results["reward"]["before"], results["reward"]["after"]
    assert f"mean reward {round(before, 3)} -> {round(after, 3)}" in text
    assert "| tool-call success" in text and "checkpoints: ckpt-00000002.pt" in text
    # The runner's highlights: the reward, turns and tool-call success before -> after, the episodes' answers.
    shown = highlights(result)
    # Where the held-out episodes come from, and how many were played: the example's own test split, NUM_SAMPLES.
    assert results["held_out"]["source"] == "the test split of 'lockers'" and results["held_out"]["records"] == 64
    assert "held-out (the test split of 'lockers', 4 records) | mean reward" in text
    assert shown[0] == f"held-out reward: {before:.2f} -> {after:.2f} (the test split of 'lockers', 4 records)"
    assert shown[1] == "held-out turns per episode: {:.2f} -> {:.2f} (the test split of 'lockers', 4 records)".format(
        *results["turns"].values())
    assert shown[2].startswith("held-out tool-call success: ") and shown[3] == "held-out answers, before -> after:"
    assert shown[4].startswith(f"  {first['prompt']!r}: ")


@pytest.mark.parametrize("target", sorted(t for t in TARGETS if NAME in TARGETS[t].notebooks))
def test_every_target_preset_is_a_valid_agent_configuration(notebooks, target):
    declared = declared_parameters(notebooks[NAME])
    assert set(TARGETS[target].notebooks[NAME]) <= set(declared), target
    config = config_from_parameters(TARGETS[target].params_for(NAME, declared), base=GRPOConfig())
    assert config.agentic and config.num_generations >= 2
    assert config.seq_len == config.max_prompt_len + config.turn_shape.width


@pytest.mark.parametrize("dataset", sorted(EXAMPLES))
def test_one_parameter_picks_an_example_with_its_environment_or_tools_and_reward(notebooks, dataset):
    """`-p DATASET mul3` (or any example's name) over the notebook's defaults and any target's preset: the example
    brings its environment or tools and its reward, so the Python tool needs no second parameter."""
    declared = declared_parameters(notebooks[NAME])
    example = EXAMPLES[dataset]
    for target in sorted(t for t in TARGETS if NAME in TARGETS[t].notebooks):
        params = {**declared, **TARGETS[target].params_for(NAME, declared), "DATASET": dataset}
        config = config_from_parameters(params, base=GRPOConfig())
        assert (config.environment, config.tools, config.rewards) == (
            example.environment, example.tools, example.rewards), target
    if dataset == "mul3":
        assert config.tools == "tpu_helpers.agents.sandbox:python"


def test_the_runner_shows_the_agent_figures_and_answers_without_a_reference(tmp_path):
    """An agent run's highlights: reward, turns and tool-call success before -> after ("-" where no tool call was
    made), and an episode whose answer only its environment knows shows no reference in parentheses."""
    from tpu_helpers.launch.runner import RunResult

    rows = [{"prompt": "Code of the red locker? Lockers: red, blue.", "answer": None, "completion": c}
            for c in ("4", "7312")]
    results = {"reward": {"before": 0.0, "after": 0.5}, "turns": {"before": 1.0, "after": 1.75},
               "tool_success": {"before": None, "after": 0.875},
               "samples_before": {"rows": rows[:1]}, "samples_after": {"rows": rows[1:]}}
    assert highlights(RunResult("x.ipynb", tmp_path, True, 1.0, results=results)) == [
        "held-out reward: 0.00 -> 0.50", "held-out turns per episode: 1.00 -> 1.75",
        "held-out tool-call success: - -> 0.88", "held-out answers, before -> after:",
        "  'Code of the red locker? Lockers: red, blue.': '4' -> '7312'"]
