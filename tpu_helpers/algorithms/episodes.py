"""Agent episodes for GRPO: a batch of multi-turn rollouts with tools, in fixed shapes, ready for the loss.

    runner = EpisodeRunner(agent, ChatFormat(tokenizer), TurnShape(turn_tokens=32, tool_tokens=24, max_turns=2),
                           prompt_tokens=256, stop_ids=eos_ids(tokenizer, model), pad_token_id=tokenizer.pad_token_id)
    batch = runner.run(model, rows, backend=b, sampling=s, seed=key)     # one episode per row
    batch.ids, batch.mask             # (rows, P + width): prompt, the model's turns, tool text; the slots in use
                                      # (P: prompt_tokens on XLA and CUDA, the batch's longest prompt on the CPU)
    batch.own, batch.logprobs         # (rows, width): the model's own tokens (the loss mask) and their log-probs
    rewards, figures = runner.score(batch.episodes)   # TRL-style reward functions; a failing one is counted, NaN

Each turn the device generates every row's answer (models/turns.py), the host reads it once, parses the tool calls
in the model's own format (agents.chat), runs them (agents.tools: timeouts, errors as tool text; the episodes at
once), and sends back each row's tool text; the cache goes on from there. An episode ends with an answer that calls
no tool; it is cut (`truncated`, and its loss masked when `mask_truncated`) when a turn runs out of tokens before its
end of turn, when the last turn still calls a tool, or when its tool text would not fit in `tool_tokens`. What it
cost is in the figures: turns, tool calls and their success rate, cut episodes, the host's seconds per turn.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import math
import random
import sys
import time
import warnings
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from tpu_helpers.agents import Agent, ChatFormat, Episode, call_reward, load_environments, load_tools
from tpu_helpers.agents.tools import ToolStats
from tpu_helpers.algorithms.rewards import BUILTIN, Reward, resolve_reward, reward_names, summed_rewards
from tpu_helpers.config import ConfigError
from tpu_helpers.core.choices import check_positive
from tpu_helpers.data.cuts import warn_cut
from tpu_helpers.models.generation import Sampling, left_pad
from tpu_helpers.models.turns import Turns, TurnShape

CUT_REASONS = ("turn_tokens", "max_turns", "tool_tokens")  # what cut an episode short, as counted


_PARSED = dict(init=False, repr=False, compare=False)


@dataclass(frozen=True)
class AgentSettings:
    """Agent mode's settings, apart from the model, the data and GRPO's own: each field is also a notebook parameter
    of the GRPO recipe (`recipes.grpo.GRPOConfig` takes these fields as its own). Checked, and ENVIRONMENT and TOOLS
    loaded and probed (one instance of each environment, as TRL probes), here, once: `agent(rewards)` builds the
    `Agent` from what was loaded. With neither ENVIRONMENT nor TOOLS the rows are single answers (`enabled`)."""

    environment: str | dict | type | None = None  # module:Class or path/to/file.py:Class, or {name: that} by row
    tools: str | None = None  # comma-separated module:function or path/to/file.py:function tools
    max_turns: int = 2  # rounds of tool calls per episode (TRL's max_tool_calling_iterations)
    tool_tokens: int = 48  # tokens of tool text between two turns; more ends the episode (cut)
    mask_truncated: bool = False  # an episode cut by its budget adds no loss (TRL's mask_truncated_completions)
    tool_timeout: float = 30.0  # seconds a tool call may take before it becomes an error message

    tool_functions: list = field(**_PARSED)  # TOOLS loaded
    environments: dict = field(**_PARSED)  # {None or a row's environment name: its probed EnvironmentSpec}

    def __post_init__(self) -> None:
        for name in ("max_turns", "tool_tokens"):
            check_positive(name, getattr(self, name))
        if not isinstance(self.mask_truncated, bool):
            raise ConfigError(f"mask_truncated={self.mask_truncated!r} must be True or False")
        t = self.tool_timeout
        if isinstance(t, bool) or not (isinstance(t, (int, float)) and math.isfinite(t) and t > 0):
            raise ConfigError(f"tool_timeout={t!r} must be a number of seconds > 0")
        object.__setattr__(self, "tool_functions", load_tools(self.tools) if self.tools else [])
        object.__setattr__(self, "environments", load_environments(self.environment))

    @property
    def enabled(self) -> bool:
        """Whether rows are agent episodes (ENVIRONMENT or TOOLS given)."""
        return bool(self.environment or self.tools)

    def shape(self, turn_tokens: int) -> TurnShape:
        """An episode's token budget: turns of `turn_tokens` (MAX_NEW_TOKENS), MAX_TURNS rounds, TOOL_TOKENS."""
        return TurnShape(turn_tokens, self.tool_tokens, self.max_turns)

    def agent(self, rewards: dict) -> Agent:
        """The `Agent` of the loaded tools and environments (probed once, when these settings were built)."""
        return Agent(tools=self.tool_functions, environments=self.environments, reward_funcs=rewards,
                     timeout_s=self.tool_timeout)


def answer_all(episodes: Sequence[Episode], calls: Sequence[tuple[int, Any]]) -> None:
    """Run the turn's tool calls (each episode's own in order). Calls whose tools are all independent of the other
    episodes' run at once: methods of each episode's own environment instance, and standalone tools marked
    `concurrent = True` (the sandbox's `python`, which bounds its own work to the cores), so a group calling a slow
    tool waits for the slowest, not for the sum. Any other standalone tool is shared by the episodes and runs one
    call at a time, as TRL runs a sync tool."""
    apart, shared = [], []
    for i, parsed in calls:
        (apart if _independent(episodes[i], parsed.message) else shared).append((i, parsed))
    for i, parsed in shared:
        episodes[i].answer(parsed.message, parsed.errors)
    if len(apart) <= 1:
        for i, parsed in apart:
            episodes[i].answer(parsed.message, parsed.errors)
        return
    with ThreadPoolExecutor(len(apart), thread_name_prefix="tpu_helpers-tools") as pool:
        for future in [pool.submit(episodes[i].answer, parsed.message, parsed.errors) for i, parsed in apart]:
            future.result()


def _independent(episode: Episode, message: dict) -> bool:
    """Whether every tool the message calls is the episode's own (a bound method of its environment instance) or
    marked `concurrent = True`."""
    for call in message.get("tool_calls") or ():
        function = call.get("function", call) if isinstance(call, dict) else {}
        fn = episode.toolbox.tools.get(function.get("name")) if isinstance(function, dict) else None
        if fn is not None and not (inspect.ismethod(fn) or getattr(fn, "concurrent", False)):
            return False
    return True


@dataclass
class EpisodeBatch:
    """A batch of finished episodes: device tensors for the loss and the host's record of each episode."""

    ids: torch.Tensor
    mask: torch.Tensor
    own: torch.Tensor
    logprobs: torch.Tensor
    episodes: list[Episode]
    truncated: list[bool]
    turns: list[int]
    tokens: list[int]  # the model's own tokens of each episode, counted on the host
    figures: dict[str, float] = field(default_factory=dict)
    shared: int = 1  # runs of this many rows start from the same prompt tokens


class EpisodeRunner:
    """Runs `Agent` episodes on a model in a `TurnShape` (see the module docstring)."""

    def __init__(self, agent: Agent, chat: ChatFormat, shape: TurnShape, *, prompt_tokens: int,
                 stop_ids: Sequence[int], pad_token_id: int, mask_truncated: bool = False):
        self.agent, self.chat, self.shape = agent, chat, shape
        self.prompt_tokens = prompt_tokens
        end = chat.tokenizer.convert_tokens_to_ids(chat.end)
        self.stop_ids = sorted({*stop_ids, *([end] if isinstance(end, int) else [])})
        self.pad = pad_token_id
        self.mask_truncated = mask_truncated
        self.warnings: Counter = Counter()  # what went wrong in episodes, counted over the run
        self.needed: Counter = Counter()  # the largest tool text a cut episode needed ("tool_tokens")
        self.warmed = False  # whether a batch ran every turn (see `run`)

    def _cut(self, cause: str, message: str) -> None:
        """An episode cut short by its budget (CUT_REASONS): said once per cause with the size that would have fit,
        then counted."""
        self._warn(cause, f"an episode was cut: {message}")

    def _warn(self, kind: str, message: str) -> None:
        if not self.warnings[kind]:
            warnings.warn(f"{message} (counted as {kind!r}; each later one only counted)", stacklevel=3)
        self.warnings[kind] += 1

    def _shared(self, prompts: list[list[int]], group: int) -> int:
        """How many consecutive rows share each prompt pass: `group` when every run of `group` prompts is the same
        tokens, else 1 (an environment whose `reset` text differs between the copies of a row; counted, and on XLA
        the prompt pass of that shape, and the training forward's, compile once)."""
        if group <= 1 or len(prompts) % group:
            return 1
        if all(prompts[i] == prompts[i - i % group] for i in range(len(prompts))):
            return group
        self._warn("prompt_differs", f"the {group} episodes of a row start from different prompts (its environment's "
                                     "reset returns different text for the same row): each runs its own prompt pass")
        return 1

    def run(self, model: torch.nn.Module, rows: Sequence[dict], *, backend: Any, sampling: Sampling,
            seed: torch.Tensor | int = 0, group: int = 1, reset_seed: str | int | None = None) -> EpisodeBatch:
        """One episode per row, to the end or the budget. `group`: the rows come in runs of `group` copies of a
        row (GRPO's group); where each run's prompts are the same tokens, the prompt's pass runs once per run.
        `reset_seed`: Python's `random` (and NumPy's, where imported) seeded with it before the environments'
        resets, so an environment that draws its own task from them draws the same one on a resumed run, and the
        held-out draws apart from training's."""
        b, s = backend, self.shape
        if reset_seed is not None:
            seed_python_random(reset_seed)
        episodes = [self.agent.start(row) for row in rows]
        prompts = []
        for e in episodes:
            ids = self.chat.prompt_ids(e.prompt, tools=e.schemas)
            if len(ids) > self.prompt_tokens:
                self._warn("prompt_cut", f"a prompt of {len(ids)} tokens is longer than MAX_PROMPT_LEN="
                                         f"{self.prompt_tokens}: its first tokens are cut")
            prompts.append(ids[-self.prompt_tokens:])
        shared = self._shared(prompts, group)
        # Graphs (XLA) and captured decode loops (CUDA) keep MAX_PROMPT_LEN's width: one shape for every batch. The
        # CPU runs whatever shape comes, so there the prompts take the batch's longest: no pass over padding.
        fixed = b.compiles_graphs or b.compile_loop() is not None
        p = left_pad(prompts[::shared], self.prompt_tokens if fixed else max(map(len, prompts)), self.pad)
        turns = Turns(model, p.ids.to(b.device), p.mask.to(b.device), s, eos_token_id=self.stop_ids,
                      pad_token_id=self.pad, sampling=sampling, seed=seed, sync=b.sync, replay=b.compile_step,
                      loop=b.compile_loop, num_return_sequences=shared)
        n = len(rows)
        active, truncated, used, tokens = [True] * n, [False] * n, [0] * n, [0] * n
        stop = set(self.stop_ids)
        host_s = 0.0
        turns.first()
        for k in range(s.answers):
            outputs = b.to_cpu(turns.outputs())  # the turn's one read
            ids_k, mask_k = turns.columns(k, outputs)
            tokens = [t + int(m) for t, m in zip(tokens, mask_k.sum(1).tolist(), strict=True)]
            t0 = time.perf_counter()
            tool_ids: list[list[int]] = [[] for _ in range(n)]
            calls: list[tuple[int, Any]] = []
            for i, e in enumerate(episodes):
                if not active[i]:
                    continue
                used[i] += 1
                own = ids_k[i, :int(mask_k[i].sum())].tolist()
                if not own or own[-1] not in stop:  # the turn ran out of tokens before its end of turn
                    e.completion.append({"role": "assistant", "content": self.chat.tokenizer.decode(own)})
                    active[i], truncated[i] = False, True
                    self._cut("turn_tokens", f"a turn used all MAX_NEW_TOKENS={s.turn_tokens} tokens before its end "
                                             "of turn: raise MAX_NEW_TOKENS for longer turns")
                    continue
                parsed = self.chat.parse(own, prefix=prompts[i], tools=e.schemas)
                if not (parsed.message.get("tool_calls") or parsed.errors):
                    e.completion.append(parsed.message)
                    active[i] = False  # the final answer
                    continue
                if k == s.max_turns:  # still calling tools with no turn left: the calls are not run
                    e.completion.append(parsed.message)
                    active[i], truncated[i] = False, True
                    self._cut("max_turns", f"an episode still called a tool after MAX_TURNS={s.max_turns} rounds of "
                                           f"calls: MAX_TURNS={s.max_turns + 1} would have run it")
                    continue
                calls.append((i, parsed))
            answer_all(episodes, calls)
            for i, _ in calls:
                e = episodes[i]
                more = self.chat.continuation_ids(e.messages, tools=e.schemas)
                if len(more) > s.tool_tokens:
                    active[i], truncated[i] = False, True
                    self.needed["tool_tokens"] = max(self.needed["tool_tokens"], len(more))
                    self._cut("tool_tokens", f"a tool result took {len(more)} tokens of tool text (with the next "
                                             f"turn's header), more than TOOL_TOKENS={s.tool_tokens}: TOOL_TOKENS="
                                             f"{len(more)} would have fit it")
                    continue
                tool_ids[i] = more
            host_s += time.perf_counter() - t0
            # The first batch runs every turn even when its episodes all ended sooner (the later turns then produce
            # nothing): each turn's graphs compile in the warm-up step, not in whichever later step first needs them.
            if k == s.max_turns or not (any(active) or not self.warmed):
                turns.finish(k, outputs)
                break
            turns.next(k + 1, outputs, tool_ids, active)
        self.warmed = True
        ids, mask, out = turns.episode()
        own = out.mask
        if self.mask_truncated and any(truncated):
            keep = torch.tensor([not t for t in truncated], dtype=own.dtype).to(own.device)
            own = own * keep.unsqueeze(1)
        stats = ToolStats()
        for e in episodes:
            stats.add(e.stats)
        figures = {"turns": sum(used) / n, "tool_calls": stats.calls / n,
                   "tool_success": 1.0 - stats.failed / stats.calls if stats.calls else math.nan,
                   "truncated": sum(truncated) / n, "host_s_per_turn": host_s / max(1, max(used))}
        return EpisodeBatch(ids, mask, own, out.logprobs, episodes, truncated, used, tokens, figures, shared)

    def score(self, episodes: Sequence[Episode], weights: Sequence[float] | None = None,
              **keywords: Any) -> tuple[list[float], dict[str, list[float]]]:
        """Each episode's reward (`rewards.summed_rewards`: weighted by REWARD_WEIGHTS, NaN terms left out, as TRL
        sums) and each source's values (`agents.call_rewards`: an episode a reward raises on gets NaN, counted and
        warned about once)."""
        values = self.agent.rewards(episodes, warn=lambda m: self._warn("reward_failed", m), **keywords)
        return summed_rewards(values, weights), values


def final_text(completion: Sequence[dict]) -> str:
    """An episode's final answer as text: the content of its last assistant message ("" without one)."""
    last = next((m for m in reversed(completion) if m.get("role") == "assistant"), None)
    return str(last.get("content") or "") if last is not None else ""


def seed_python_random(seed: str | int) -> None:
    """Seed Python's `random` (and NumPy's global generator, where NumPy is imported) from `seed`, whatever
    PYTHONHASHSEED: an environment that draws its own task from them draws it again on a resumed run."""
    random.seed(str(seed))
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(int.from_bytes(hashlib.sha256(str(seed).encode()).digest()[:4], "little"))


def transcript(completion: Sequence[dict]) -> str:
    """An episode's messages after the prompt as readable lines: the model's text and tool calls, the tool results."""
    lines = []
    for m in completion:
        if m.get("role") == "assistant":
            text = str(m.get("content") or "").strip()
            calls = [c.get("function", c) for c in m.get("tool_calls") or ()]
            lines += [f"assistant: {text}"] if text else []
            lines += [f"call {c.get('name')}({json.dumps(c.get('arguments'))})" for c in calls]
        else:
            lines.append(f"{m.get('role')} {m.get('name') or ''}: {m.get('content')}".replace("  ", " "))
    return "\n".join(lines)


def answer_rewards(rewards: dict[str, Reward]) -> dict[str, Any]:
    """The package's text rewards (algorithms.rewards: answer, format, ...) as TRL-style reward functions of
    episodes: each scores the episode's final answer text, with the rows' fields."""

    def wrap(name: str, fn: Reward) -> Any:
        def reward(prompts: list, completions: list, **fields: Any) -> list[float]:
            return call_reward(fn, name=name, prompts=prompts, completions=[final_text(c) for c in completions],
                               **fields)

        reward.__name__ = name
        return reward

    return {name: wrap(name, fn) for name, fn in rewards.items()}


def episode_rewards(rewards: str | None, format_pattern: str) -> dict[str, Any]:
    """REWARDS for episodes: built-in names score the final answer's text (`answer_rewards`), import paths are
    TRL-style reward functions called as they are; empty: none (the environment's get_reward)."""
    if not rewards or not str(rewards).strip():
        return {}
    out: dict[str, Any] = {}
    for item in reward_names(rewards):
        name, fn = resolve_reward(item, format_pattern=format_pattern)
        if name in out:
            raise ConfigError(f"REWARDS names {name!r} twice")
        out.update(answer_rewards({name: fn}) if name in BUILTIN or name == "format" else {name: fn})
    return out


def episode_prompts(runner: EpisodeRunner, records: Sequence[dict], *, max_prompt_len: int) -> tuple[Any, dict]:
    """The records whose episode prompt (a fresh environment's reset, the tool schemas, the model's template) fits
    `max_prompt_len`: a `data.rl.PromptDataset` of their indices alone (each episode renders its own prompt at its
    reset, so nothing here is kept for the step) and the stats. Each record is reset and measured once, here, so
    that a record whose prompt is too long is left out, counted and said once (`data.cuts.warn_cut`) before
    training, and a record reset cannot take fails here, naming it."""
    from tpu_helpers.data.rl import PromptDataset

    index = []
    stats = {"records": len(records), "too_long": 0, "longest_prompt": 0}
    for k, record in enumerate(records):
        try:
            episode = runner.agent.start(record)
        except ConfigError as err:
            raise ConfigError(f"record {k}: {err}") from None
        length = len(runner.chat.prompt_ids(episode.prompt, tools=episode.schemas))
        stats["longest_prompt"] = max(stats["longest_prompt"], length)
        if length > max_prompt_len:
            stats["too_long"] += 1
            continue
        index.append(k)
    if not index:
        raise ConfigError(f"no episode prompt fits MAX_PROMPT_LEN={max_prompt_len} tokens ({stats['records']} "
                          f"records, the longest {stats['longest_prompt']} tokens with the tool schemas); raise "
                          "MAX_PROMPT_LEN")
    stats["prompts"] = len(index)
    warn_cut(setting="MAX_PROMPT_LEN", limit=max_prompt_len, cut=stats["too_long"], total=stats["records"],
             longest=stats["longest_prompt"], what="episode prompts (with the tool schemas)", verb="drops")
    return PromptDataset(None, None, torch.tensor(index, dtype=torch.long)), stats
