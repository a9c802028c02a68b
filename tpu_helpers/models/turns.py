"""Multi-turn generation with fixed shapes: an episode's turns (the model's answers and the tool text between them)
in one key/value cache of a fixed width, continued turn after turn without a new prefill of what came before.

    shape = TurnShape(turn_tokens=48, tool_tokens=32, max_turns=2)   # 3 answers at most
    run = Turns(model, prompt.ids, prompt.mask, shape, eos_token_id=stops, pad_token_id=pad, sampling=s, seed=key)
    run.first()                                   # the prompt pass, then turn 0's decode steps
    outputs = backend.to_cpu(run.outputs())      # the episode's columns so far: the host parses turn 0's
    run.next(1, outputs, tool_ids, active)        # each row's tool text (<= tool_tokens ids); turn 1
    out = run.result()                            # Generated over the episode's columns, and run.valid

Layout (docs/guides/agents.md): the cache holds the P prompt slots, then per turn `turn_tokens` slots of the model's
tokens and, between turns, `tool_tokens` slots of tool text, right-aligned so that the next turn's first token
follows it. A slot a row leaves unused (after its end of turn, before its tool text, every slot of a finished
episode) is masked, and positions count only the slots used: each row reads as its contiguous conversation, so one
forward over the episode's (P + width) ids with `valid` as the attention mask gives the log-probabilities the turns
were sampled with. Every turn runs the same two graphs (its tool text's pass and the decode step; where they are
replayed, captured once), whatever the turn or the row's state: nothing compiles after the first episode of a shape.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tpu_helpers.backend.base import ReplayUnsupported
from tpu_helpers.core.choices import check_positive
from tpu_helpers.models.decode import (
    Generated,
    autocast_dtype,
    choose_hooks,
    decode_steps,
    eos_tensor,
    every_row,
    forward,
    hybrid_masks,
    make_cache,
    masks,
    prefill,
    put_rows,
    record,
    rows_of,
    sliding_window,
)
from tpu_helpers.models.generation import check_generation_support
from tpu_helpers.models.lm_head import mask_positions
from tpu_helpers.models.replay import kept_cache, replayed_prefill
from tpu_helpers.models.sampling import GREEDY, Sampling


@dataclass(frozen=True)
class TurnShape:
    """An episode's budget: up to `max_turns` rounds of tool calls (TRL's max_tool_calling_iterations), so
    max_turns + 1 answers of at most `turn_tokens` tokens each, and between two answers at most `tool_tokens` tokens
    of the template's tool text (the tool results and the next answer's header)."""

    turn_tokens: int
    tool_tokens: int
    max_turns: int

    @property
    def answers(self) -> int:
        """The most turns of the model's in an episode: one per round of tool calls, and the final answer."""
        return self.max_turns + 1

    def __post_init__(self) -> None:
        for name in ("turn_tokens", "tool_tokens", "max_turns"):
            check_positive(name, getattr(self, name))

    def start(self, turn: int) -> int:
        """The episode column of turn `turn`'s first token."""
        return turn * (self.turn_tokens + self.tool_tokens)

    @property
    def width(self) -> int:
        """The episode's columns after the prompt: every turn's tokens and the tool text between them."""
        return self.answers * self.turn_tokens + self.max_turns * self.tool_tokens


def _continue(model: torch.nn.Module, cache: Any, chunk: torch.Tensor, start: torch.Tensor, st: tuple,
              fixed: tuple, width: int, window: int | None, hybrid: bool, dtype: torch.dtype, sampling: Sampling,
              pad: int, rows: torch.Tensor | None = None) -> tuple:
    """The pass over a turn's new slots (the last answer's final token, then the tool text), written into the cache
    from slot `start` on, and the next answer's first token recorded at column `st[1]`. Everything it reads is an
    argument, so it replays like the decode step. `rows` (the CPU's): only those rows' pass, `cache` holding
    theirs (models/decode.py's `rows_of`)."""
    slots, valid, slot_pos = fixed[:3]
    if rows is not None:
        chunk, valid, slot_pos = chunk[rows], valid[rows], slot_pos[rows]
    for layer in cache.layers:  # the decode steps may have stopped early (the CPU): the writes start at `start`
        layer.cumulative_length.copy_(start)
    q = start + torch.arange(chunk.shape[1], device=chunk.device)
    allowed = ((slots[None, :] <= q[:, None]) & valid[:, None, :]) | (slots[None, :] == q[:, None])
    pos = slot_pos.gather(1, q.expand(chunk.shape[0], -1))
    distance = pos[:, :, None] - slot_pos[:, None, :]
    logits = forward(model, chunk, masks(allowed, distance, window, dtype, hybrid), pos, cache, keep_last=True)
    return record(every_row(logits, rows, st[0].shape[0]), st, fixed, sampling, pad)


class Turns:
    """One batch of episodes in a cache of P + shape.width slots (see the module docstring). The host calls
    `first()`, reads `outputs()`, then for each later turn `next(turn, outputs, tool_ids, active)` with what it
    parsed and ran, and `finish(last_turn, outputs)`; `episode()` gives the ids and mask, `valid` its slots in use.
    `num_return_sequences` n: n episodes per prompt row (rows i * n to i * n + n - 1), the prompt's pass run once
    per prompt (models/generation.py's `generate_ids` does the same)."""

    @torch.no_grad()
    def __init__(self, model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 shape: TurnShape, *, eos_token_id: int | Sequence[int] | None, pad_token_id: int,
                 sampling: Sampling = GREEDY, seed: int | torch.Tensor = 0, sync: Callable | bool | None = None,
                 replay: Callable | bool | None = None, loop: Callable | bool | None = None,
                 mask_dtype: torch.dtype | None = None, num_return_sequences: int = 1):
        check_generation_support(model)
        check_positive("num_return_sequences", num_return_sequences)
        n = num_return_sequences
        self.model, self.shape = model, shape
        self.device = device = input_ids.device
        self.sync, self.replay, self.loop = choose_hooks(model, device, sync, replay, loop)
        self.width = input_ids.shape[1]
        self.batch = input_ids.shape[0] * n
        self.total = self.width + shape.width
        dtype = mask_dtype or next(model.parameters()).dtype
        dtype = dtype if dtype.is_floating_point else torch.float32
        self.args = (self.width, sliding_window(model), hybrid_masks(model), dtype, sampling, pad_token_id)
        self.pad = pad_token_id
        self.seed = seed.to(device=device, dtype=torch.long) if isinstance(seed, torch.Tensor) else \
            torch.tensor([int(seed)], dtype=torch.long).to(device)
        self.eos = eos_tensor(eos_token_id, device)
        self.input_ids, self.attention_mask = input_ids, attention_mask
        kept = self.replay is not None or self.loop is not None
        make = lambda: make_cache(model, self.total, self.batch)  # noqa: E731
        self.cache = kept_cache(model, ("turns", self.batch, self.total, dtype, autocast_dtype(device)), make) if kept \
            else make()
        # The host's copy of which slots hold a token: the prompt's, then each turn's as the host learns them.
        self.valid = torch.cat([attention_mask.detach().to("cpu", torch.bool).repeat_interleave(n, 0),
                                torch.ones((self.batch, shape.width), dtype=torch.bool)], 1)
        self.tool_ids = torch.full((self.batch, shape.width), pad_token_id, dtype=torch.long)  # the host's text
        self.tool_mask = torch.zeros((self.batch, shape.width), dtype=torch.bool)
        self.st: tuple | None = None
        self.fixed: tuple | None = None

    def _eval(self, fn: Callable[[], Any]) -> Any:
        was_training = self.model.training
        self.model.eval()
        try:
            return fn()
        finally:
            self.model.train(was_training)

    @torch.no_grad()
    def first(self) -> None:
        """Turn 0: the prompt's pass and `turn_tokens - 1` decode steps."""
        def run() -> None:
            st, self.fixed = replayed_prefill(self.replay, prefill, self.model, self.cache,
                                              (self.input_ids, self.attention_mask, self.eos, self.seed),
                                              self.shape.width, self.args, self.sync)
            self.sync()
            self.st = decode_steps(self.model, self.cache, st, self.fixed, self.shape.turn_tokens - 1, self.args,
                                   self.sync, self.replay, self.loop)
        self._eval(run)

    def outputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The episode's columns so far: the model's tokens and their mask, (B, shape.width) on the device. The host
        reads them whole after each turn: a slice per turn would be a graph per turn on XLA."""
        return self.st[2], self.st[4]

    def columns(self, turn: int, outputs: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Turn `turn`'s tokens and their mask (1 up to and with the end of turn), (B, turn_tokens), sliced from
        `outputs` (as read by the host) or from the device's."""
        ids, mask = outputs if outputs is not None else self.outputs()
        a = self.shape.start(turn)
        return ids[:, a:a + self.shape.turn_tokens], mask[:, a:a + self.shape.turn_tokens]

    @torch.no_grad()
    def next(self, turn: int, outputs: tuple[torch.Tensor, torch.Tensor], tool_ids: Sequence[Sequence[int]],
             active: Sequence[bool]) -> None:
        """Turn `turn` (>= 1): `outputs()` as the host read them after the previous turn (its unused slots are
        masked from here on), each row's tool text (at most tool_tokens ids; ignored where `active` is False), and
        which rows go on; those that do not produce padding with mask 0 from here on."""
        last_ids, last_mask = self.columns(turn - 1, outputs)
        s = self.shape
        if not 1 <= turn <= s.max_turns:
            raise ValueError(f"turn={turn} must be between 1 and max_turns = {s.max_turns}")
        C = s.tool_tokens
        prev = self.width + s.start(turn - 1)
        self.valid[:, prev:prev + s.turn_tokens] = last_mask.to("cpu", torch.bool)
        chunk = torch.full((self.batch, C + 1), self.pad, dtype=torch.long)
        tool_valid = torch.zeros((self.batch, C), dtype=torch.bool)
        chunk[:, 0] = last_ids[:, -1].to("cpu")
        for i, (ids, on) in enumerate(zip(tool_ids, active, strict=True)):
            ids = list(ids) if on else []
            if len(ids) > C:
                raise ValueError(f"row {i}: {len(ids)} tool-text ids, more than tool_tokens={C}")
            if ids:
                chunk[i, C + 1 - len(ids):] = torch.tensor(ids, dtype=torch.long)
                tool_valid[i, C - len(ids):] = True
        self.valid[:, prev + s.turn_tokens:prev + s.turn_tokens + C] = tool_valid
        a = s.start(turn - 1) + s.turn_tokens
        self.tool_ids[:, a:a + C] = torch.where(tool_valid, chunk[:, 1:], self.pad)
        self.tool_mask[:, a:a + C] = tool_valid
        slot_pos = mask_positions(self.valid)
        done = ~torch.tensor(list(active), dtype=torch.bool)
        start = torch.tensor(prev + s.turn_tokens - 1, dtype=torch.long)  # 0-d, as the cache's
        step = torch.tensor([s.start(turn)], dtype=torch.long)
        chunk, start, step, valid, slot_pos, done = (t.to(self.device) for t in
                                                     (chunk, start, step, self.valid, slot_pos, done))
        slots, _, _, cols, eos, seed = self.fixed
        self.fixed = (slots, valid, slot_pos, cols, eos, seed)
        st = (self.st[0], step, self.st[2], self.st[3], self.st[4], done)

        live = [i for i, on in enumerate(active) if on]

        def run() -> None:
            if self.device.type == "cpu" and len(live) < self.batch:
                # The CPU passes the live rows only (where none is, one finished row: its outputs stay padding).
                rows = torch.tensor(live or [0], dtype=torch.long)
                part = rows_of(self.cache, rows)
                first = _continue(self.model, part, chunk, start, st, self.fixed, *self.args, rows=rows)
                put_rows(self.cache, part, rows)
            else:
                fn = self.replay(_continue) if self.replay is not None else _continue
                try:
                    first = fn(self.model, self.cache, chunk, start, st, self.fixed, *self.args)
                except ReplayUnsupported:
                    first = _continue(self.model, self.cache, chunk, start, st, self.fixed, *self.args)
            self.sync()
            self.st = decode_steps(self.model, self.cache, first, self.fixed, s.turn_tokens - 1, self.args,
                                   self.sync, self.replay, self.loop)
        self._eval(run)

    def finish(self, last_turn: int, outputs: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Mark the slots of the turns not run (after `last_turn`) and the unused ones of `last_turn` as masked
        (`outputs` as the host read them after `last_turn`)."""
        s = self.shape
        _, last_mask = self.columns(last_turn, outputs)
        prev = self.width + s.start(last_turn)
        self.valid[:, prev:prev + s.turn_tokens] = last_mask.to("cpu", torch.bool)
        self.valid[:, prev + s.turn_tokens:] = False

    def episode(self) -> tuple[torch.Tensor, torch.Tensor, Generated]:
        """After `finish`: the episodes' ids and attention mask, (B, P + shape.width) on the device (the prompt, the
        model's tokens and the tool text in their slots; `valid` as the mask), and `result()`."""
        out = self.result()
        tools = self.tool_mask.to(self.device)
        prompts = self.input_ids.repeat_interleave(self.batch // self.input_ids.shape[0], 0)
        ids = torch.cat([prompts, torch.where(tools, self.tool_ids.to(self.device), out.ids)], 1)
        self.sync()  # the ids in a graph of their own, the same every batch, not in whatever reads them first
        return ids, self.valid.to(device=self.device, dtype=torch.long), out

    def result(self) -> Generated:
        """The episode's columns: the model's tokens (padding elsewhere; the tool text is the host's), their
        log-probabilities and the mask of the model's own tokens, (B, shape.width) each, on the device."""
        return Generated(self.st[2], self.st[3], self.st[4])
