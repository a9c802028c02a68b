"""Multi-turn generation (models/turns.py): each turn's tokens are what a fresh generation over the row's conversation
so far (compacted, no gaps) produces, rows that stop early and rows that end leave masked slots, and one forward over
the episode gives the log-probabilities the turns were sampled with."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.models.families import random_lora
from tests.support import XLA_BACKEND
from tpu_helpers.algorithms.grpo import completion_logps, used_columns
from tpu_helpers.config import ConfigError
from tpu_helpers.models.generation import Sampling, generate_ids, left_pad
from tpu_helpers.models.turns import Turns, TurnShape

SHAPE = TurnShape(turn_tokens=6, tool_tokens=5, max_turns=2)  # 3 answers


@pytest.fixture(scope="module")
def model_and_tok(tiny_lm_dir):
    model, tok = random_lora(tiny_lm_dir)
    return model.merge_and_unload().eval(), tok


def _prompts(tok):
    texts = ["The cat sat on the mat and", "One two", "A long prompt about the weather in the hills today", "Hi"]
    return [tok(t, add_special_tokens=False)["input_ids"] for t in texts]


def _fresh(model, tok, contexts, eos, n):
    """Greedy answers of n tokens to each compacted context: the reference for a turn."""
    width = max(len(c) for c in contexts)
    p = left_pad(contexts, width, tok.pad_token_id)
    out = generate_ids(model, p.ids, p.mask, max_new_tokens=n, eos_token_id=eos, pad_token_id=tok.pad_token_id,
                       replay=False, loop=False)
    return [row[:int(m.sum())] for row, m in zip(out.ids.tolist(), out.mask, strict=True)]


def _turn_tokens(turns, k):
    outputs = tuple(t.cpu() for t in turns.outputs())
    ids, mask = turns.columns(k, outputs)
    return [row[:int(m.sum())] for row, m in zip(ids.tolist(), mask, strict=True)], outputs


def test_each_turn_continues_the_conversation_as_a_fresh_generation_would(model_and_tok):
    model, tok = model_and_tok
    prompts = _prompts(tok)
    # A token the greedy answers produce early for some rows plays EOS, so that some turns end before their budget.
    probe = _fresh(model, tok, prompts, None, SHAPE.turn_tokens)
    eos = probe[0][2]
    p = left_pad(prompts, max(map(len, prompts)), tok.pad_token_id)
    turns = Turns(model, p.ids, p.mask, SHAPE, eos_token_id=eos, pad_token_id=tok.pad_token_id, replay=False,
                  loop=False)
    turns.first()
    contexts = [list(x) for x in prompts]
    got, outputs = _turn_tokens(turns, 0)
    assert got == _fresh(model, tok, contexts, eos, SHAPE.turn_tokens)
    assert any(len(g) < SHAPE.turn_tokens for g in got) and any(len(g) == SHAPE.turn_tokens for g in got)
    tools = [[5, 6, 7], [8], [9, 10, 11, 12, 13], []]  # the last row's episode ends here
    active = [True, True, True, False]
    for c, g, t in zip(contexts, got, tools, strict=True):
        c += g + t
    turns.next(1, outputs, tools, active)
    got1, outputs1 = _turn_tokens(turns, 1)
    want = _fresh(model, tok, contexts[:3], eos, SHAPE.turn_tokens)
    assert got1[:3] == want and got1[3] == []
    for c, g in zip(contexts, got1, strict=True):
        c += g
    turns.finish(1, outputs1)
    ids, valid, out = turns.episode()
    # The slots in use, in order, are each row's conversation, compacted.
    for row, m, c in zip(ids.tolist(), valid.tolist(), contexts, strict=True):
        assert [t for t, v in zip(row, m, strict=True) if v] == c
    # One forward over the episode gives the log-probabilities of the model's own tokens the turns recorded.
    logp = completion_logps(model, ids, valid, SHAPE.width, 1.0)
    own = out.mask.bool()
    assert own.sum() == sum(len(g) for g in got) + sum(len(g) for g in got1)
    torch.testing.assert_close(logp[own], out.logprobs[own], atol=2e-5, rtol=1e-4)
    # Without the columns no row uses (GRPO's rollout on the CPU), the same log-probabilities.
    used = used_columns({"ids": ids, "mask": valid, "completion_mask": out.mask, "old_logp": out.logprobs})
    assert used["ids"].shape[1] < ids.shape[1] and used["completion_mask"].sum() == own.sum()
    logp = completion_logps(model, used["ids"], used["mask"], used["completion_mask"].shape[1], 1.0)
    torch.testing.assert_close(logp[used["completion_mask"].bool()], out.logprobs[own], atol=2e-5, rtol=1e-4)


def test_a_turn_after_every_row_ended_early_attends_to_each_rows_end_of_turn(model_and_tok):
    """On the CPU the decode steps stop once no row needs one: a row's EOS is written into the cache by the step
    after it, which must still run when that EOS ended the last live row (else the next turn reads an empty slot)."""
    model, tok = model_and_tok
    prompts = _prompts(tok)
    p = left_pad(prompts, max(map(len, prompts)), tok.pad_token_id)
    shape = TurnShape(turn_tokens=12, tool_tokens=5, max_turns=1)
    probe = _fresh(model, tok, prompts, None, 3)
    stops = sorted({row[2] for row in probe})  # every row ends by its third token, long before the turn's 12
    turns = Turns(model, p.ids, p.mask, shape, eos_token_id=stops, pad_token_id=tok.pad_token_id, replay=False,
                  loop=False)
    turns.first()
    outputs = tuple(t.cpu() for t in turns.outputs())
    assert outputs[1][:, :shape.turn_tokens].sum(1).max() <= 3
    turns.next(1, outputs, [[5, 6], [7], [8, 9, 10], [4]], [True] * 4)
    turns.finish(1, tuple(t.cpu() for t in turns.outputs()))
    ids, valid, out = turns.episode()
    own = out.mask.bool()
    logp = completion_logps(model, ids, valid, shape.width, 1.0)
    torch.testing.assert_close(logp[own], out.logprobs[own], atol=2e-5, rtol=1e-4)


def test_a_turn_shape_is_checked():
    with pytest.raises(ConfigError, match="max_turns=0 must be an integer >= 1"):
        TurnShape(turn_tokens=4, tool_tokens=4, max_turns=0)
    assert TurnShape(4, 3, 2).width == 4 * 3 + 3 * 2


def _episode(model, tok, p, device, tools, eos, **hooks):
    turns = Turns(model, p.ids.to(device), p.mask.to(device), SHAPE, eos_token_id=eos, pad_token_id=tok.pad_token_id,
                  **hooks)
    turns.first()
    turns.next(1, tuple(t.cpu() for t in turns.outputs()), tools, [bool(t) for t in tools])
    turns.next(2, tuple(t.cpu() for t in turns.outputs()), tools, [bool(t) for t in tools])
    turns.finish(2, tuple(t.cpu() for t in turns.outputs()))
    ids, valid, out = turns.episode()
    return ids.cpu(), valid.cpu(), out.logprobs.cpu()


def test_episodes_sharing_a_prompt_pass_are_those_of_the_repeated_prompts(model_and_tok):
    model, tok = model_and_tok
    prompts = _prompts(tok)[:2]
    eos = _fresh(model, tok, prompts, None, SHAPE.turn_tokens)[0][2]
    tools = [[5, 6, 7], [8], [9, 10, 11, 12, 13], []]
    hot = dict(sampling=Sampling(temperature=1.5, top_k=20), seed=torch.tensor([3, 1]), replay=False, loop=False)
    p = left_pad(prompts, max(map(len, prompts)), tok.pad_token_id)
    twice = left_pad([x for x in prompts for _ in range(2)], p.ids.shape[1], tok.pad_token_id)
    want = _episode(model, tok, twice, "cpu", tools, eos, **hot)
    rows = []
    hook = model.register_forward_pre_hook(lambda m, a, kw: rows.append(tuple(kw["input_ids"].shape)),
                                           with_kwargs=True)
    got = _episode(model, tok, p, "cpu", tools, eos, num_return_sequences=2, **hot)
    hook.remove()
    assert rows[0] == tuple(p.ids.shape)  # the prompt's pass: 2 rows for the 4 episodes
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    torch.testing.assert_close(got[2], want[2], atol=1e-5, rtol=1e-5)
    assert not torch.equal(got[0][0], got[0][1])  # the two samples of a prompt went their own ways


@pytest.mark.xla
@pytest.mark.skipif(XLA_BACKEND is None, reason="torch_xla not installed")
@pytest.mark.parametrize("hooks", ["lazy", "replayed", "looped", "looped-shared"])
def test_on_xla_the_turns_give_the_cpus_tokens_and_a_second_episode_compiles_nothing(model_and_tok, hooks):
    b = XLA_BACKEND
    model, tok = model_and_tok
    prompts = _prompts(tok)
    shared = dict(num_return_sequences=2) if hooks.endswith("shared") else {}
    prompts = prompts[:2] if shared else prompts  # 2 prompts x 2 episodes: the prompt's pass once per prompt
    p = left_pad(prompts, max(map(len, prompts)), tok.pad_token_id)
    eos = _fresh(model, tok, prompts, None, SHAPE.turn_tokens)[0][2]
    tools = [[5, 6, 7], [8], [9, 10, 11, 12, 13], []]
    want_ids, want_valid, want_logp = _episode(model, tok, p, "cpu", tools, eos, replay=False, loop=False, **shared)
    chosen = {"lazy": dict(replay=False, loop=False), "replayed": dict(replay=b.compile_step, loop=False),
              "looped": dict(replay=b.compile_step, loop=b.compile_loop),
              "looped-shared": dict(replay=b.compile_step, loop=b.compile_loop, **shared)}[hooks]
    xmodel = b.move_model(copy.deepcopy(model))
    compiles = []
    for other in (tools, [[4], [], [7, 8, 9], [3, 3]]):
        start = b.metrics()["compilations"]
        ids, valid, logp = _episode(xmodel, tok, p, b.device, other, eos, sync=b.sync, **chosen)
        compiles.append(b.metrics()["compilations"] - start)
        if other is tools:
            assert torch.equal(ids, want_ids) and torch.equal(valid, want_valid)
            torch.testing.assert_close(logp, want_logp, atol=1e-4, rtol=1e-4)
    assert compiles[1] == 0, compiles
