"""Agent episodes for GRPO: a batch of multi-turn rollouts with tools, in fixed shapes, ready for the loss.

    runner = EpisodeRunner(agent, ChatFormat(tokenizer), TurnShape(turn_tokens=32, tool_tokens=24, max_turns=2),
                           prompt_tokens=256, stop_ids=eos_ids(tokenizer, model), pad_token_id=tokenizer.pad_token_id)
    batch = runner.run(model, rows, backend=b, sampling=s, seed=key)     # one episode per row
    batch.ids, batch.mask             # (rows, P + width): prompt, the model's turns, tool text; the slots in use
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

import math
import time
import warnings
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from tpu_helpers.agents import Agent, ChatFormat, Episode
from tpu_helpers.agents.tools import ToolStats
from tpu_helpers.algorithms.rewards import Reward, score
from tpu_helpers.config import ConfigError
from tpu_helpers.models.generation import Sampling, left_pad
from tpu_helpers.models.turns import Turns, TurnShape

CUT_REASONS = ("turn_tokens", "max_turns", "tool_tokens")  # what cut an episode short, as counted


def answer_all(episodes: Sequence[Episode], calls: Sequence[tuple[int, Any]]) -> None:
    """Run the turn's tool calls, the episodes at once (each episode's own calls in order): a group of episodes
    calling a slow tool (a sandboxed snippet near its time limit) waits for the slowest, not for the sum. A tool
    shared by the episodes is called from several threads; the sandbox bounds its own to the cores."""
    if len(calls) <= 1:
        for i, parsed in calls:
            episodes[i].answer(parsed.message, parsed.errors)
        return
    with ThreadPoolExecutor(len(calls), thread_name_prefix="tpu_helpers-tools") as pool:
        for future in [pool.submit(episodes[i].answer, parsed.message, parsed.errors) for i, parsed in calls]:
            future.result()


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
        self.warmed = False  # whether a batch ran every turn (see `run`)

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
            seed: torch.Tensor | int = 0, group: int = 1) -> EpisodeBatch:
        """One episode per row, to the end or the budget. `group`: the rows come in runs of `group` copies of a
        row (GRPO's group); where each run's prompts are the same tokens, the prompt's pass runs once per run."""
        b, s = backend, self.shape
        episodes = [self.agent.start(row) for row in rows]
        prompts = []
        for e in episodes:
            ids = self.chat.prompt_ids(e.prompt, tools=e.schemas)
            if len(ids) > self.prompt_tokens:
                self._warn("prompt_cut", f"a prompt of {len(ids)} tokens is longer than MAX_PROMPT_LEN="
                                         f"{self.prompt_tokens}: its first tokens are cut")
            prompts.append(ids[-self.prompt_tokens:])
        shared = self._shared(prompts, group)
        p = left_pad(prompts[::shared], self.prompt_tokens, self.pad)
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
                    self.warnings["turn_tokens"] += 1
                    continue
                parsed = self.chat.parse(own, prefix=prompts[i], tools=e.schemas)
                if not (parsed.message.get("tool_calls") or parsed.errors):
                    e.completion.append(parsed.message)
                    active[i] = False  # the final answer
                    continue
                if k == s.max_turns:  # still calling tools with no turn left: the calls are not run
                    e.completion.append(parsed.message)
                    active[i], truncated[i] = False, True
                    self.warnings["max_turns"] += 1
                    continue
                calls.append((i, parsed))
            answer_all(episodes, calls)
            for i, _ in calls:
                e = episodes[i]
                more = self.chat.continuation_ids(e.messages, tools=e.schemas)
                if len(more) > s.tool_tokens:
                    active[i], truncated[i] = False, True
                    self.warnings["tool_tokens"] += 1
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

    def score(self, episodes: Sequence[Episode], **keywords: Any) -> tuple[list[float], dict[str, list[float]]]:
        """Each episode's summed reward (NaN terms left out, as TRL sums) and each source's values. A reward function
        that raises on the batch is called episode by episode: where it still raises, that episode's value is NaN,
        and the failure is counted and warned about once, naming the function and the error."""
        values: dict[str, list[float]] = {}
        for name in self.agent.rewards_funcs:
            try:
                values[name] = self.agent.rewards(episodes, **keywords, only=name)[name]
                continue
            except Exception:  # noqa: BLE001 (a user's reward failed on some episode: find which, keep the others)
                pass
            values[name] = []
            for e in episodes:
                try:
                    values[name] += self.agent.rewards([e], **keywords, only=name)[name]
                except Exception as err:  # noqa: BLE001
                    self._warn("reward_failed", f"reward {name!r} raised {type(err).__name__} on an episode "
                                                f"({str(err)[:200]}); its value there is NaN")
                    values[name].append(math.nan)
        total = [sum(v for v in vals if not math.isnan(v)) for vals in zip(*values.values(), strict=True)]
        return total, values


def final_text(completion: Sequence[dict]) -> str:
    """An episode's final answer as text: the content of its last assistant message ("" without one)."""
    last = next((m for m in reversed(completion) if m.get("role") == "assistant"), None)
    return str(last.get("content") or "") if last is not None else ""


def answer_rewards(rewards: dict[str, Reward]) -> dict[str, Any]:
    """The package's text rewards (algorithms.rewards: answer, format, ...) as TRL-style reward functions of
    episodes: each scores the episode's final answer text, with the rows' fields."""

    def wrap(name: str, fn: Reward) -> Any:
        def reward(prompts: list, completions: list, **fields: Any) -> list[float]:
            texts = [final_text(c) for c in completions]
            return score({name: fn}, prompts, texts, fields)[name]

        reward.__name__ = name
        return reward

    return {name: wrap(name, fn) for name, fn in rewards.items()}


def episode_prompts(runner: EpisodeRunner, records: Sequence[dict], *, max_prompt_len: int) -> tuple[Any, dict]:
    """Each record's episode prompt as the rollout renders it (a fresh environment's reset, the tool schemas, the
    model's template), left-padded: a `data.rl.PromptDataset` and its stats. A record whose prompt is longer than
    `max_prompt_len` is left out and counted; a record reset cannot take fails here, naming it."""
    from tpu_helpers.data.rl import PromptDataset

    pad = runner.pad
    ids, masks, index = [], [], []
    stats = {"records": len(records), "too_long": 0, "longest_prompt": 0}
    for k, record in enumerate(records):
        try:
            episode = runner.agent.start(record)
        except ConfigError as err:
            raise ConfigError(f"record {k}: {err}") from None
        tokens = runner.chat.prompt_ids(episode.prompt, tools=episode.schemas)
        stats["longest_prompt"] = max(stats["longest_prompt"], len(tokens))
        if len(tokens) > max_prompt_len:
            stats["too_long"] += 1
            continue
        ids.append([pad] * (max_prompt_len - len(tokens)) + tokens)
        masks.append([0] * (max_prompt_len - len(tokens)) + [1] * len(tokens))
        index.append(k)
    if not ids:
        raise ConfigError(f"no episode prompt fits MAX_PROMPT_LEN={max_prompt_len} tokens ({stats['records']} "
                          f"records, the longest {stats['longest_prompt']} tokens with the tool schemas); raise "
                          "MAX_PROMPT_LEN")
    stats["prompts"] = len(ids)
    return PromptDataset(torch.tensor(ids), torch.tensor(masks), torch.tensor(index)), stats
