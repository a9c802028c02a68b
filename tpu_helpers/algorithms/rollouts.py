"""What a GRPO step trains on: a rollout source samples completions for a batch of prompts and scores them.

    rollouts = AnswerRollouts(tokenizer, rewards, settings, stop_ids=eos_ids(tok, model), backend=b,
                              max_prompt_len=32)                        # one answer per row
    rollouts = EpisodeRollouts(runner, settings, backend=b)            # one agent episode per row (episodes.py)
    dataset, stats = rollouts.prompts(records)                         # the training prompts: indices into records
    rollout, rewards, figures = rollouts.sample(model, prompts, index)  # draw `index`: tensors, rewards, figures
    samples = rollouts.held_out(model, held_records, rows=16)          # the held-out figures and table

`GRPOTrainer` takes either and never asks which: both sample `settings.num_generations` rows per prompt of the
batch (`prompts["index"]` points into `records`) and return the same rollout dict ("ids", "mask", "completion_mask",
"old_logp", "group": the runs of rows that share a prompt pass) and the same figures (`batch_figures`). `held_out`
answers records in the training step's shapes with a fixed sampling stream (`sampling_key`), so the before and
after figures compare the same draws and, on XLA, use the graphs training compiled.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from functools import cached_property
from typing import Any

import torch

from tpu_helpers.algorithms.episodes import EpisodeRunner, episode_prompts, final_text, transcript
from tpu_helpers.algorithms.rewards import Reward, score, summed_rewards
from tpu_helpers.config import ConfigError
from tpu_helpers.data.loaders import fixed_batches
from tpu_helpers.data.rl import build_prompt_dataset, prompt_and_answer
from tpu_helpers.models.generation import generate_ids
from tpu_helpers.models.hf import completion_lengths, completion_texts, eos_ids

_RESERVED = ("prompts", "completions", "completion_tokens", "max_new_tokens")


def sampling_key(seed: int, index: int, backend: Any) -> torch.Tensor:
    """The sampling stream of draw `index` (a step's rollout: its generation's index; held-out batches: negative):
    a function of the seed, the index and the process (the backend's rank: under data parallelism every process
    samples its own rows, which must not share one stream), sent as data (no recompile); the same on a resumed run."""
    return torch.tensor([seed, index, backend.rank], dtype=torch.long).to(backend.device)


def nanmean(values: Sequence[float]) -> float:
    """The mean of the values that are not NaN (NaN when none is)."""
    kept = [v for v in values if not math.isnan(v)]
    return sum(kept) / len(kept) if kept else math.nan


def batch_figures(rewards: Sequence[float], group: int, lengths: Sequence[int],
                  values: dict[str, Sequence[float]]) -> dict[str, float]:
    """A rollout's logged figures: the mean reward, its std within each group (averaged), the mean completion
    tokens and each reward source's mean (NaN values, TRL's "not applicable", left out)."""
    groups = torch.tensor(list(rewards)).reshape(-1, group)
    return {"reward": sum(rewards) / len(rewards), "reward_std": float(groups.std(1).mean()),
            "completion_tokens": sum(lengths) / len(lengths), **{f"reward/{k}": nanmean(v) for k, v in values.items()}}


def score_completions(tokenizer: Any, rewards: dict[str, Reward], records: Sequence[dict], rows: list[list[int]],
                      settings: Any, stop_ids: list[int] | None = None) -> dict:
    """Decode completion token rows (one per record) and score them with every reward: {"total", "rewards"
    ({name: values}), "prompts", "completions", "completion_tokens"}; each record's fields go to the rewards.
    `settings`: the GRPO settings (fields, max_new_tokens). `stop_ids`: where completions end (default the
    tokenizer's EOS; give `eos_ids(tokenizer, model)`)."""
    stop_ids = eos_ids(tokenizer) if stop_ids is None else stop_ids
    texts = completion_texts(tokenizer, rows, stop_ids)
    lengths = completion_lengths(rows, stop_ids)
    pairs = [prompt_and_answer(r, prompt_field=settings.prompt_field, answer_field=settings.answer_field)
             for r in records]
    fields: dict[str, Any] = {k: [r.get(k) for r in records] for k in sorted({k for r in records for k in r})
                              if k not in _RESERVED}
    fields.update(answer=[a for _, a in pairs], completion_tokens=lengths, max_new_tokens=settings.max_new_tokens)
    prompts = [p for p, _ in pairs]
    scores = score(rewards, prompts, texts, fields)
    total = summed_rewards(scores, settings.weights)
    return {"total": total, "rewards": scores, "prompts": prompts, "completions": texts, "completion_tokens": lengths}


class AnswerRollouts:
    """One answer per row, G rows per prompt: the KV-cached generation (one prefill and one decode graph; the
    prompt's pass once per group), scored on the host after the step's one read."""

    def __init__(self, tokenizer: Any, rewards: dict[str, Reward], settings: Any, *,
                 stop_ids: Sequence[int] | Callable[[], Sequence[int]], backend: Any, max_prompt_len: int,
                 system_prompt: str | None = None, seed: int = 0) -> None:
        if not rewards:
            raise ConfigError("REWARDS is empty: GRPO needs at least one reward function")
        self.tokenizer, self.rewards, self.settings, self.backend = tokenizer, dict(rewards), settings, backend
        self.seed = seed  # the run's: every draw's sampling stream is made of it (`sampling_key`)
        self._stops = stop_ids  # a callable: asked on first use (the model's end of turn, once it is loaded)
        self.max_prompt_len, self.system_prompt = max_prompt_len, system_prompt
        self.width = settings.max_new_tokens  # the completion's columns
        self.prompt_width = max_prompt_len  # the prompt's columns
        self.records: list[dict] = []  # what the prompts' indices point into (`prompts`)

    @cached_property
    def stop_ids(self) -> list[int]:
        """Where answers end: the tokenizer's EOS and the model's end of turn."""
        return list(self._stops() if callable(self._stops) else self._stops)

    def _prompts(self, records: Sequence[dict]) -> tuple[Any, dict]:
        s = self.settings
        return build_prompt_dataset(self.tokenizer, records, max_prompt_len=self.max_prompt_len,
                                    prompt_field=s.prompt_field, answer_field=s.answer_field,
                                    system_prompt=self.system_prompt)

    def prompts(self, records: Sequence[dict]) -> tuple[Any, dict]:
        """The training prompts of `records`, left-padded to MAX_PROMPT_LEN (a `data.rl.PromptDataset` whose indices
        point into `records`, kept for `sample`) and their stats (kept, too long)."""
        self.records = list(records)
        return self._prompts(self.records)

    def _generate(self, model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, key: torch.Tensor,
                  group: int) -> Any:
        b, s = self.backend, self.settings
        with b.autocast():
            return generate_ids(model, ids, mask, max_new_tokens=s.max_new_tokens, eos_token_id=self.stop_ids,
                                pad_token_id=self.tokenizer.pad_token_id, sampling=s.sampling, seed=key,
                                sync=b.sync, replay=b.compile_step, loop=b.compile_loop, num_return_sequences=group)

    def _score(self, records: Sequence[dict], rows: list[list[int]]) -> dict:
        return score_completions(self.tokenizer, self.rewards, records, rows, self.settings, self.stop_ids)

    def sample(self, model: torch.nn.Module, prompts: dict, index: int) -> tuple[dict, list[float], dict]:
        """G answers to each prompt of the batch, draw `index` of the run: the rollout's tensors, the summed rewards
        and the figures."""
        b, g = self.backend, self.settings.num_generations
        gen = self._generate(model, prompts["input_ids"], prompts["attention_mask"], sampling_key(self.seed, index, b),
                             g)
        ids = prompts["input_ids"].repeat_interleave(g, 0)
        mask = prompts["attention_mask"].repeat_interleave(g, 0)
        host = b.to_cpu({"ids": gen.ids, "index": prompts["index"]})  # the step's one read
        records = [self.records[i] for i in host["index"].tolist() for _ in range(g)]
        scored = self._score(records, host["ids"].tolist())
        rollout = {"ids": torch.cat([ids, gen.ids], 1), "mask": torch.cat([mask, gen.mask], 1),
                   "completion_mask": gen.mask, "old_logp": gen.logprobs, "group": g}
        figures = batch_figures(scored["total"], g, scored["completion_tokens"], scored["rewards"])
        return rollout, scored["total"], figures

    def held_out(self, model: torch.nn.Module, records: Sequence[dict], *, rows: int) -> dict:
        """Each record's prompt answered once, `rows` at a time: mean reward, mean completion tokens, each reward's
        mean and the rows (prompt, answer, completion, reward). A prompt longer than MAX_PROMPT_LEN is left out."""
        b, s = self.backend, self.settings
        data, _ = self._prompts(records)
        tokens: list[list[int]] = []
        for idx, real in fixed_batches(len(data), rows):
            gen = self._generate(model, data.input_ids[idx].to(b.device), data.attention_mask[idx].to(b.device),
                                 sampling_key(self.seed, -1 - idx[0], b), 1)
            tokens += b.to_cpu(gen.ids).tolist()[:real]
        kept = [records[i] for i in data.index.tolist()]
        scored = self._score(kept, tokens)
        total, lengths = scored["total"], scored["completion_tokens"]
        table = [{"prompt": p if isinstance(p, str) else p[-1]["content"], "answer": r.get(s.answer_field),
                  "completion": c, "reward": t}
                 for p, r, c, t in zip(scored["prompts"], kept, scored["completions"], total, strict=True)]
        return {"reward": sum(total) / len(total), "completion_tokens": sum(lengths) / len(lengths),
                "rewards": {k: nanmean(v) for k, v in scored["rewards"].items()}, "rows": table}


class EpisodeRollouts:
    """One agent episode per row, G rows per prompt (`episodes.EpisodeRunner`: a read per turn), scored by the
    agent's reward sources; the completion mask is the model's own tokens."""

    def __init__(self, runner: EpisodeRunner, settings: Any, *, backend: Any, seed: int = 0) -> None:
        self.runner, self.settings, self.backend, self.seed = runner, settings, backend, seed
        self.width, self.prompt_width = runner.shape.width, runner.prompt_tokens
        self.records: list[dict] = []  # what the prompts' indices point into (`prompts`)

    def prompts(self, records: Sequence[dict]) -> tuple[Any, dict]:
        """The rows of `records` whose episode prompt (a fresh environment's reset, the tool schemas, the model's
        template) fits MAX_PROMPT_LEN (`episodes.episode_prompts`; indices into `records`, kept for `sample`), and
        their stats."""
        self.records = list(records)
        return episode_prompts(self.runner, self.records, max_prompt_len=self.runner.prompt_tokens)

    def sample(self, model: torch.nn.Module, prompts: dict, index: int) -> tuple[dict, list[float], dict]:
        """G episodes of each prompt's row, draw `index` of the run: the rollout's tensors, the summed rewards and the
        figures (turns, tool calls and their success, cut episodes, host seconds per turn besides the rewards)."""
        b, g = self.backend, self.settings.num_generations
        rows = [self.records[i] for i in b.to_cpu(prompts["index"]).tolist() for _ in range(g)]
        with b.autocast():
            batch = self.runner.run(model, rows, backend=b, sampling=self.settings.sampling,
                                    seed=sampling_key(self.seed, index, b), group=g,
                                    reset_seed=f"{self.seed}:{index}:{b.rank}")
        rewards, values = self.runner.score(batch.episodes, weights=self.settings.weights)
        rollout = {"ids": batch.ids, "mask": batch.mask, "completion_mask": batch.own, "old_logp": batch.logprobs,
                   "group": batch.shared}
        return rollout, rewards, {**batch_figures(rewards, g, batch.tokens, values), **batch.figures}

    def held_out(self, model: torch.nn.Module, records: Sequence[dict], *, rows: int) -> dict:
        """One episode per record, `rows` at a time: mean reward, turns, tool calls and their success, each reward's
        mean, the rows (the episode's own prompt, transcript, final answer, reward) and the episodes' messages after
        the prompt ("completions", as reward functions and metrics such as `note_following` take them)."""
        b, runner = self.backend, self.runner
        episodes, figures = [], []
        for idx, real in fixed_batches(len(records), rows):
            with b.autocast():  # the environments' resets seeded apart from training's (negative draws)
                batch = runner.run(model, [records[i] for i in idx], backend=b, sampling=self.settings.sampling,
                                   seed=sampling_key(self.seed, -1 - idx[0], b),
                                   reset_seed=f"{self.seed}:{-1 - idx[0]}:{b.rank}")
            episodes += batch.episodes[:real]
            figures.append((real, batch.figures))
        total, values = runner.score(episodes, weights=self.settings.weights)
        table = [{"prompt": e.prompt[-1]["content"], "answer": e.row.get(self.settings.answer_field),
                  "completion": final_text(e.completion), "transcript": transcript(e.completion), "reward": t}
                 for e, t in zip(episodes, total, strict=True)]
        mean = {k: sum(r * f[k] for r, f in figures) / len(records) for k in ("turns", "tool_calls", "truncated")}
        calls = sum(e.stats.calls for e in episodes)
        success = 1.0 - sum(e.stats.failed for e in episodes) / calls if calls else float("nan")
        return {"reward": sum(total) / len(total), **mean, "tool_success": success,
                "rewards": {k: nanmean(v) for k, v in values.items()}, "rows": table,
                "completions": [e.completion for e in episodes]}
