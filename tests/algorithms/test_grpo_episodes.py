"""GRPO on agent episodes (algorithms/episodes.py, the recipe's agent mode): each episode's slots hold its
conversation (prompt, the model's turns, the tool text) and the loss mask only the model's tokens; every loss type
trains on them; a strict XLA:CPU run compiles nothing after its first step; a reward failing on one episode is
counted and the others scored.

The tiny offline model answers at random, so two things are scripted here and nothing else: which tokens end a turn
(a third of the vocabulary, so turns end after a few tokens or run out of them) and what a turn's text parses to
(a call to the real `multiply` tool when the turn's first token is even, else a final answer). The turns, the cache,
the tool runs, the template's tool text, the rewards and the loss are the package's own."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from tests.support import StepCounters, StopAt, assert_same_trainable_weights
from tpu_helpers.agents import ChatFormat, Parsed
from tpu_helpers.algorithms import episodes
from tpu_helpers.algorithms.episodes import EpisodeRunner
from tpu_helpers.recipes.grpo import GRPO, GRPOConfig

TOOLS = "tpu_helpers.agents.examples:multiply"


# A compact native tool template for the tiny model (ChatML with the tools' names only, calls as <tool_call> blocks,
# results as tool messages): the fallback's schemas take ~580 of its tokens, more than its context of 256.
TOOL_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\ntools: {% for t in tools %}{{ t.function.name }} {% endfor %}<|im_end|>\n"
    "{% endif %}{%- for m in messages %}{%- if m.role == 'tool' %}<|im_start|>tool\n{{ m.content }}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}{% for c in m.tool_calls or [] %}<tool_call>"
    "{{ c.function | tojson }}</tool_call>{% endfor %}<|im_end|>\n{% endif %}{%- endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def tool_tiny_dir(tmp_path_factory, tiny_lm_dir):
    """The tiny Qwen2 whose tokenizer renders tools natively and briefly (TOOL_TEMPLATE)."""
    return tool_tiny_copy(tiny_lm_dir, tmp_path_factory.mktemp("tiny_tools") / "model")


def tool_tiny_copy(source, target) -> str:
    shutil.copytree(source, target)
    config = json.loads((target / "tokenizer_config.json").read_text())
    config["chat_template"] = TOOL_TEMPLATE
    (target / "tokenizer_config.json").write_text(json.dumps(config))
    (target / "chat_template.jinja").unlink(missing_ok=True)
    return str(target)


def _scripted_parse(self, ids, *, prefix=None, tools=None):
    ids = list(ids)
    if ids and ids[0] % 2 == 0:
        return Parsed({"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "multiply", "arguments": {"a": 3, "b": ids[0] % 7}}}]})
    return Parsed({"role": "assistant", "content": "12"})


@pytest.fixture
def scripted(monkeypatch):
    script_turns(monkeypatch)


def script_turns(monkeypatch) -> None:
    """Turns end at a third of the vocabulary and parse as `_scripted_parse` says (see the module docstring)."""
    monkeypatch.setattr(ChatFormat, "parse", _scripted_parse)
    real_init = EpisodeRunner.__init__

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        vocab = len(self.chat.tokenizer)
        self.stop_ids = [t for t in range(vocab) if t % 3 == 0]

    monkeypatch.setattr(EpisodeRunner, "__init__", init)


def _job(tmp_path, model_dir, device="cpu", callbacks=None, **overrides):
    base = dict(device=device, model=model_dir, start_from=None, steps=3, batch_size=2, num_generations=2,
                max_prompt_len=96, max_new_tokens=6, tool_tokens=24, max_turns=2, lr=1e-2, warmup_steps=1,
                log_every=1, save_every=3, out_dir=str(tmp_path / "run"), max_records=16, lora_r=4, dataset="multiply",
                tools=TOOLS, rewards="answer,tests.algorithms.test_grpo_episodes:odd_turns",
                xla_checks="strict" if device == "xla" else "off")
    return GRPO(GRPOConfig(**{**base, **overrides}), progress=False, callbacks=callbacks)


def test_the_sft_warm_start_trains_on_rows_as_long_as_the_longest_demonstration(tmp_path, tool_tiny_dir):
    """START_FROM "sft" in agent mode fine-tunes on the example environment's demonstrations first, each row as long
    as the longest one (to a multiple of 8), not the whole episode budget, then starts GRPO from the merged export."""
    job = _job(tmp_path, tool_tiny_dir, start_from="sft", sft_steps=1, dataset="lockers", tools="",
               environment="tpu_helpers.agents.examples:Lockers", rewards="tpu_helpers.agents.examples:locker_reward",
               max_prompt_len=160, max_new_tokens=24, tool_tokens=24, max_turns=1)
    assert job.start_source == str(tmp_path / "run" / "sft" / "merged")
    from transformers import AutoTokenizer

    from tpu_helpers.data.sft import encode_tool_conversation

    tok = AutoTokenizer.from_pretrained(tool_tiny_dir)
    demos = [json.loads(line) for line in (tmp_path / "run" / "sft" / "demonstrations.jsonl").read_text().splitlines()]
    longest = max(len(encode_tool_conversation(tok, d["messages"], d["tools"])[0]) for d in demos)
    seq_len = json.loads((tmp_path / "run" / "sft" / "finetune.json").read_text())["seq_len"]
    assert seq_len == -(-longest // 8) * 8 < job.config.max_prompt_len + job.config.completion_tokens


def odd_turns(completions, **kwargs):
    """A TRL-style reward that varies with the random turns: 1 for an odd number of the model's turns."""
    return [float(sum(m["role"] == "assistant" for m in c) % 2) for c in completions]


def test_an_episodes_slots_hold_its_conversation_and_the_loss_mask_only_the_models_tokens(tmp_path, tool_tiny_dir,
                                                                                           scripted):
    job = _job(tmp_path, tool_tiny_dir)
    runner, b = job.rollouts.runner, job.backend
    rows = job.records[:8]
    batch = runner.run(job.model, rows, backend=b, sampling=job.config.grpo.sampling,
                       seed=torch.tensor([0, 0, 0]))
    assert max(batch.turns) == 3 and min(batch.turns) == 1, batch.turns  # answered at once, and after two calls
    assert batch.figures["tool_calls"] > 0 and batch.figures["tool_success"] == 1.0
    # On the CPU the prompts take the batch's longest width, not MAX_PROMPT_LEN's (XLA keeps it: the strict test).
    width = max(len(runner.chat.prompt_ids(e.prompt, tools=e.schemas)) for e in batch.episodes)
    assert width < job.config.max_prompt_len and batch.ids.shape[1] == width + runner.shape.width
    for i, e in enumerate(batch.episodes):
        used = batch.mask[i].bool()
        ids = batch.ids[i][used].tolist()
        prompt = runner.chat.prompt_ids(e.prompt, tools=e.schemas)
        assert ids[:len(prompt)] == prompt
        own = batch.own[i].bool()
        assert used[width:][own].all()  # the model's tokens are all in use...
        model_tokens = batch.ids[i, width:][own].tolist()
        # ... and the slots in use after the prompt are the model's turns and, between them, the template's text
        # for the tool results: exactly continuation_ids of the conversation at that point.
        rest = ids[len(prompt):]
        calls = [m for m in e.completion if m["role"] == "assistant" and m.get("tool_calls")]
        tool_text = sum(len(runner.chat.continuation_ids(e.messages[:e.messages.index(c) + 2], tools=e.schemas))
                        for c in calls if e.messages.index(c) + 1 < len(e.messages))
        assert len(rest) == len(model_tokens) + tool_text
        assert torch.equal(batch.logprobs[i][~own], torch.zeros_like(batch.logprobs[i][~own]))
    cut = [t for t in batch.truncated]
    assert any(cut) and not all(cut)


def test_the_agents_training_rows_are_record_indices_the_episodes_render_their_own_prompts(tmp_path, tool_tiny_dir):
    job = _job(tmp_path, tool_tiny_dir)
    data = job.train_data
    assert data.input_ids is None and data.attention_mask is None  # nothing rendered for a step that never reads it
    assert len(data) == job.data_stats["prompts"] > 0
    assert set(data[0]) == {"index"}
    assert job.rollouts.prompt_width == job.config.max_prompt_len


def test_a_groups_episodes_share_their_prompt_pass_and_a_group_whose_prompts_differ_runs_its_own(
        tmp_path, tool_tiny_dir, scripted):
    job = _job(tmp_path, tool_tiny_dir)
    runner, b = job.rollouts.runner, job.backend
    rows = [r for r in job.records[:3] for _ in range(2)]
    run = lambda rows, group: runner.run(job.model, rows, backend=b, sampling=job.config.grpo.sampling,  # noqa: E731
                                         seed=torch.tensor([0, 1, 0]), group=group)
    want = run(rows, 1)
    passes = []
    hook = job.model.register_forward_pre_hook(lambda m, a, kw: passes.append(tuple(kw["input_ids"].shape)),
                                               with_kwargs=True)
    got = run(rows, 2)
    hook.remove()
    longest = max(len(runner.chat.prompt_ids(e.prompt, tools=e.schemas)) for e in got.episodes)
    assert passes[0] == (3, longest)  # one prompt pass per group of 2 (on the CPU, as wide as the longest prompt)
    for a, c in ((got.ids, want.ids), (got.mask, want.mask), (got.own, want.own)):
        assert torch.equal(a, c)
    torch.testing.assert_close(got.logprobs, want.logprobs, atol=1e-5, rtol=1e-5)
    assert [e.completion for e in got.episodes] == [e.completion for e in want.episodes]
    assert runner.warnings["prompt_differs"] == 0
    mixed = [rows[0], rows[0], rows[2], rows[4]]  # the second "group" holds two rows' prompts
    with pytest.warns(UserWarning, match="start from different prompts"):
        alone = run(mixed, 2)
    assert runner.warnings["prompt_differs"] == 1 and len(alone.episodes) == 4


@pytest.mark.parametrize("loss_type,importance", [("grpo", "token"), ("bnpo", "sequence"), ("dr_grpo", "token"),
                                                  ("dapo", "token")])
def test_every_loss_type_trains_on_episodes_on_policy_at_its_first_step(tmp_path, tool_tiny_dir, scripted,
                                                                        loss_type, importance):
    job = _job(tmp_path, tool_tiny_dir, loss_type=loss_type, importance=importance, kl_beta=0.1,
               mask_truncated=True)
    start = {k: v.detach().clone() for k, v in job.model.named_parameters() if v.requires_grad}
    job.train()
    first = job.history.train[0]
    assert first["kl"] == 0.0 and first["clip_fraction"] == 0.0  # the episode's forward gives the sampled log-probs
    assert all(math.isfinite(r["loss"]) for r in job.history.train)
    assert any(r["turns"] > 1 for r in job.history.train) and "tool_success" in first and "host_s_per_turn" in first
    moved = [k for k, v in job.model.named_parameters() if v.requires_grad and not torch.equal(v, start[k])]
    assert moved


@pytest.mark.xla
def test_strict_xla_agent_grpo_compiles_nothing_after_warm_up(tmp_path, tool_tiny_dir, scripted, monkeypatch):
    from tests.support import XLA_BACKEND

    counters, widths = StepCounters(), []
    left_pad = episodes.left_pad
    monkeypatch.setattr(episodes, "left_pad", lambda rows, width, pad: widths.append(width) or left_pad(rows, width, pad))
    job = GRPO(_job(tmp_path, tool_tiny_dir, "xla", steps=4).config, backend=XLA_BACKEND, progress=False,
               callbacks=[counters])
    report = job.train()  # strict: a recompilation after warm-up raises
    assert set(widths) == {job.config.max_prompt_len}  # on XLA every batch's prompts are MAX_PROMPT_LEN wide
    steps = counters.steps
    # Step 2 compiles the optimizer's steady-state update, as in single-turn GRPO (tests/algorithms/test_grpo.py);
    # the turns, whatever each episode's length, compile nothing after the first step's episodes.
    assert job.history.train[0]["turns"] > 1
    assert all(s["compilations"] == 0 for k, s in steps.items() if k > 2), steps
    assert report.xla["cpu_fallback_ops"] == {}
    print(f"agent GRPO strict on XLA:CPU: compilations per step {[steps[k]['compilations'] for k in sorted(steps)]}, "
          f"turns {[r['turns'] for r in job.history.train]}")


def failing_on_long(completions, **kwargs):
    """Raises on episodes of more than one message: one bad episode must not sink the batch."""
    out = []
    for c in completions:
        if len(c) > 1:
            raise ValueError("cannot score a long episode")
        out.append(1.0)
    return out


def test_a_reward_that_fails_on_some_episodes_is_counted_and_the_others_scored(tmp_path, tool_tiny_dir, scripted):
    job = _job(tmp_path, tool_tiny_dir, rewards="tests.algorithms.test_grpo_episodes:failing_on_long")
    runner = job.rollouts.runner
    batch = runner.run(job.model, job.records[:8], backend=job.backend, sampling=job.config.grpo.sampling,
                       seed=torch.tensor([1, 0, 0]))
    with pytest.warns(UserWarning, match="reward 'tests.algorithms.test_grpo_episodes:failing_on_long' raised "
                                         "ValueError on completion"):
        total, values = runner.score(batch.episodes)
    name = "tests.algorithms.test_grpo_episodes:failing_on_long"
    long = [len(e.completion) > 1 for e in batch.episodes]
    assert any(long) and not all(long)
    assert [math.isnan(v) for v in values[name]] == long
    assert total == [0.0 if lg else 1.0 for lg in long]
    assert runner.warnings["reward_failed"] == sum(long)


@pytest.mark.parametrize("method", ["full", "qlora"])
def test_full_fine_tuning_and_qlora_train_on_episodes(tmp_path, tool_tiny_dir, scripted, method):
    # full: the reference is a frozen copy (kl_beta > 0); qlora: LoRA on an NF4 base, the reference the base.
    extra = dict(method="full", lr=1e-3) if method == "full" else dict(quantize_base="nf4", quantize_group_size=32)
    job = _job(tmp_path, tool_tiny_dir, kl_beta=0.1, steps=2, **extra)
    start = {k: v.detach().clone() for k, v in job.model.named_parameters() if v.requires_grad}
    job.train()
    first = job.history.train[0]
    assert first["kl"] == 0.0 and first["clip_fraction"] == 0.0 and job.history.train[-1]["kl"] > 0
    assert (job.reference is not None) == (method == "full")
    moved = [k for k, v in job.model.named_parameters() if v.requires_grad and not torch.equal(v, start[k])]
    assert moved


def test_a_killed_agent_run_resumes_the_same_episodes_bit_for_bit(tmp_path, tool_tiny_dir, scripted):
    # Stopped after step 3, the first of a rollout's two updates: the episodes' rollout is saved with the checkpoint,
    # and the environments are made anew from the rows; the resumed run ends on the uninterrupted run's weights.
    opts = dict(steps=4, save_every=3, num_iterations=2)
    whole = _job(tmp_path / "a", tool_tiny_dir, **opts)
    whole.train()
    first = _job(tmp_path / "b", tool_tiny_dir, callbacks=[StopAt(3)], **opts)
    first.train()
    assert first.trainer.step == 3 and first.trainer.rollout is not None
    resumed = _job(tmp_path / "b", tool_tiny_dir, **opts)
    assert resumed.train().resumed_from == 3
    assert_same_trainable_weights(whole.model, resumed.model)
    keys = ("step", "reward", "turns", "tool_calls", "truncated", "loss")
    assert [{k: r.get(k) for k in keys} for r in whole.history.train] == \
           [{k: r.get(k) for k in keys} for r in resumed.history.train]
    assert any(r["turns"] > 1 for r in whole.history.train)


@pytest.mark.xla
@pytest.mark.parametrize("sharding", ["data", "fsdp"])
def test_strict_xla_agent_grpo_on_an_eight_device_mesh_compiles_nothing_after_warm_up(tool_tiny_dir, sharding):
    # A v5e-8, simulated (strict: a recompilation after warm-up raises). data: each turn's decode runs as one device
    # loop, and the turns' reads of batch-sharded tokens compile nothing per step. fsdp: the decode steps one token
    # a graph, as single-turn GRPO's does there (tests/algorithms/test_grpo.py).
    from tests.support import optimized_xla, script_result
    from tpu_helpers.backend import runtime_env

    # At -O1: the job's time goes to running its decode on 8 devices, not to compiling it.
    out = script_result("grpo_on_mesh", {"sharding": sharding, "agent": tool_tiny_dir},
                        env={**runtime_env.xla_cpu_env(8), **optimized_xla()}, timeout=900)
    print(f"agent GRPO strict on 8 simulated devices ({sharding}): {out['compilations']} compilations in "
          f"{len(out['losses'])} steps, turns {out['turns']}")
    assert out["replicas"] == 8 and out["problems"] == [], out
    assert len(out["losses"]) == 4 and all(math.isfinite(x) for x in out["losses"]), out  # steps 3-4: strict
    assert out["looped"] == (["DeviceLoop"] if sharding == "data" else ["NoneType"]), out
    assert max(out["turns"]) > 1, out


def test_a_turns_tool_calls_run_the_episodes_at_once_each_episodes_in_order():
    import threading

    from tpu_helpers.agents import Agent
    from tpu_helpers.algorithms.episodes import answer_all

    meet = threading.Barrier(4, timeout=10)  # broken (an error text) unless the four episodes' calls overlap
    order: list[tuple[str, int]] = []

    def wait_for_all(tag: str, k: int) -> str:
        """Waits until four calls are running.

        Args:
            tag: The episode's tag.
            k: The call's number in its message.
        """
        if k == 0:
            meet.wait()
        order.append((tag, k))
        return f"{tag}{k}"

    wait_for_all.concurrent = True  # marked: the episodes may call it at once (as the sandbox's python is)
    agent = Agent(tools=[wait_for_all], reward_funcs=[lambda completions, **_: [0.0] * len(completions)])
    episodes = [agent.start({"prompt": "go"}) for _ in range(4)]
    calls = [(i, Parsed({"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "wait_for_all", "arguments": {"tag": "abcd"[i], "k": k}}}
        for k in range(2)]}, [])) for i in range(4)]
    answer_all(episodes, calls)
    for i, e in enumerate(episodes):
        assert [m["content"] for m in e.completion[1:]] == ["abcd"[i] + "0", "abcd"[i] + "1"]
    for tag in "abcd":
        assert [k for t, k in order if t == tag] == [0, 1]


def test_a_shared_tool_not_marked_concurrent_runs_one_call_at_a_time_as_trl_runs_a_sync_tool():
    import threading
    import time

    from tpu_helpers.agents import Agent
    from tpu_helpers.algorithms.episodes import answer_all

    running, most, lock = [0], [0], threading.Lock()

    def shared(n: int) -> int:
        """A tool with state shared by every episode, not safe to call from several threads.

        Args:
            n: A number.
        """
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.05)
        with lock:
            running[0] -= 1
        return n

    agent = Agent(tools=[shared], reward_funcs=[lambda completions, **_: [0.0] * len(completions)])
    episodes = [agent.start({"prompt": "go"}) for _ in range(4)]
    calls = [(i, Parsed({"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "shared", "arguments": {"n": i}}}]}, [])) for i in range(4)]
    answer_all(episodes, calls)
    assert most[0] == 1 and [e.completion[-1]["content"] for e in episodes] == ["0", "1", "2", "3"]
