"""Agents: tools and environments in TRL's form, and tool calls in each model's own format.

    agent = Agent(tools=[lookup], environment_factory=Wordle, reward_funcs=[solved])   # environments.py
    fmt = ChatFormat(tokenizer)                                                         # chat.py
    episode = agent.start(row)
    ids = fmt.prompt_ids(episode.prompt, tools=episode.schemas)
    parsed = fmt.parse(generated_ids, prefix=ids, tools=episode.schemas)
    replies = episode.answer(parsed.message, parsed.errors)   # tools run (timeout, errors as text, counted)
    rewards = agent.rewards([episode])                       # TRL's reward keywords, environments= included

`tools` (tools.py: schemas through transformers' get_json_schema, the runner and its counts), `environments`
(probing factories, episodes, reward functions called as TRL calls them), `loading` (the ENVIRONMENT and TOOLS
parameters: 'module:Name' or 'path/to/file.py:Name'), `sandbox` (the `python` tool and PythonSession: model-written
code in an isolated, limited process; imported by name, not here), `chat` (render a tool conversation to ids and a
loss mask the same way for SFT and RL; parse an answer natively or by the one Hermes fallback). No torch here: the
multi-turn rollout with fixed shapes and the training on episodes build on these (docs/guides/agents.md).
"""

from tpu_helpers.agents.chat import ChatFormat, Parsed, Rendered
from tpu_helpers.agents.environments import Agent, Episode, call_reward, call_rewards
from tpu_helpers.agents.loading import load_environment, load_environments, load_tools
from tpu_helpers.agents.tools import Toolbox, ToolStats, tool_schema

__all__ = ["Agent", "ChatFormat", "Episode", "Parsed", "Rendered", "ToolStats", "Toolbox", "call_reward", "call_rewards",
           "load_environment", "load_environments", "load_tools", "tool_schema"]
