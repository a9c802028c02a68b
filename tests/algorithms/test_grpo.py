"""GRPO (algorithms/grpo.py, recipes/grpo.py): the loss against a hand computation, a strict XLA:CPU run (no
recompilation after warm-up, host reads only for the rewards and at log and save steps, KL 0 at step 1 against the
adapter-disabled model), kill and resume with the same sampling stream, and bad input."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from tests.support import StepCounters, StopAt, assert_same_trainable_weights
from tpu_helpers.algorithms.grpo import GRPOSettings, completion_logps
from tpu_helpers.algorithms.grpo_loss import SCALE_REWARDS, group_advantages
from tpu_helpers.config import ConfigError, config_from_parameters
from tpu_helpers.recipes.grpo import GRPO, GRPOConfig


def _config(tmp_path, device="cpu", **overrides):
    base = dict(device=device, start_from=None, steps=4, batch_size=2, num_generations=2, max_prompt_len=24,
                max_new_tokens=3, lr=1e-2, warmup_steps=1, log_every=2, save_every=2, out_dir=str(tmp_path / "run"),
                xla_checks="strict" if device == "xla" else "off", max_records=32, lora_r=4)
    return GRPOConfig(**{**base, **overrides})


def _job(tmp_path, device="cpu", *, backend=None, callbacks=None, **overrides):
    return GRPO(_config(tmp_path, device, **overrides), backend=backend, progress=False, callbacks=callbacks)


def test_the_loss_of_two_prompts_by_two_samples_matches_a_hand_computation(tmp_path):
    eps, beta, temp = 0.2, 0.1, 0.7
    job = _job(tmp_path, num_iterations=2, clip_eps=eps, kl_beta=beta, temperature=temp)
    trainer, tok = job.trainer, job.tokenizer
    prompts = job.train_data.input_ids[:2].repeat_interleave(2, 0)
    pmask = job.train_data.attention_mask[:2].repeat_interleave(2, 0)
    completion = torch.tensor([[5, 6, 7], [8, tok.eos_token_id, 0], [9, 10, 11], [12, 13, 14]])
    cmask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 0, 0]])
    ids, mask = torch.cat([prompts, completion], 1), torch.cat([pmask, cmask], 1)
    model = job.model.eval()  # no dropout here anyway (LORA_DROPOUT 0)
    with torch.no_grad():  # the policy's log-probabilities, from a plain forward pass
        logits = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
    width = prompts.shape[1]
    logp = [[torch.log_softmax(logits[i, width - 1 + t] / temp, -1)[completion[i, t]].item() for t in range(3)]
            for i in range(4)]
    ratios = [[1.5, 0.5, 1.1], [0.7, 1.3, 1.0], [1.0, 1.0, 1.0], [0.9, 1.0, 1.0]]
    old = torch.tensor([[logp[i][t] - math.log(ratios[i][t]) for t in range(3)] for i in range(4)])
    ref = torch.tensor([[logp[i][t] + 0.1 * (i - t) for t in range(3)] for i in range(4)])
    rewards = [1.0, 0.0, 0.5, 0.5]
    # Group-relative advantages: (r - mean) / (std + 1e-4), std with Bessel's correction.
    adv = [0.5 / (math.sqrt(0.5) + 1e-4), -0.5 / (math.sqrt(0.5) + 1e-4), 0.0, 0.0]
    torch.testing.assert_close(group_advantages(torch.tensor(rewards), 2), torch.tensor(adv))
    total, count = 0.0, 0
    for i in range(4):
        for t in range(3):
            if not cmask[i, t]:
                continue
            r = ratios[i][t]
            pg = -min(r * adv[i], min(max(r, 1 - eps), 1 + eps) * adv[i])
            d = ref[i, t].item() - logp[i][t]
            total += pg + beta * (math.exp(d) - d - 1)
            count += 1
    rollout = {"ids": ids, "mask": mask, "completion_mask": cmask, "old_logp": old, "ref_logp": ref,
               "advantages": torch.tensor(adv)}
    loss, kl, clipped = trainer.policy_loss(rollout, slice(0, 4), cmask.sum().float())
    assert clipped.item() == 2  # row 0 token 0 (ratio 1.5, A > 0) and row 1 token 0 (0.7, A < 0)
    assert loss.item() == pytest.approx(total / count, rel=1e-5, abs=1e-6)
    # The reference's log-probabilities are the model's with the adapter disabled: here (B = 0) the policy's own.
    ref_now = trainer.reference_logps(ids, mask)
    torch.testing.assert_close(ref_now, torch.tensor(logp), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("importance", ["token", "sequence"])
def test_grad_accum_1_and_2_give_the_same_gradients_for_every_loss_type(tmp_path, importance):
    """Each type's divisor spans the whole step (grpo_loss's docstring): the gradients of one step over 4 answers
    of different lengths (11 and 3 completion tokens in the two halves) are the same in one micro-batch or two.
    TRL's own bnpo divides each micro-batch by its own count; tests/algorithms/test_grpo_loss.py shows that differs."""
    job = _job(tmp_path, num_iterations=2, kl_beta=0.1, epsilon_high=0.28)
    trainer, tok = job.trainer, job.tokenizer
    prompts = job.train_data.input_ids[:2].repeat_interleave(2, 0)
    pmask = job.train_data.attention_mask[:2].repeat_interleave(2, 0)
    completion = torch.tensor([[5, 6, 7], [8, 9, 10], [11, tok.eos_token_id, 0], [12, 13, 14]])
    cmask = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 1, 0], [1, 0, 0]])
    g = torch.Generator().manual_seed(0)
    rollout = {"ids": torch.cat([prompts, completion], 1), "mask": torch.cat([pmask, cmask], 1),
               "completion_mask": cmask, "old_logp": -3 * torch.rand(4, 3, generator=g),
               "ref_logp": -3 * torch.rand(4, 3, generator=g), "advantages": torch.tensor([0.7, -0.7, 1.1, -1.1])}
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    for loss_type in ("grpo", "bnpo", "dr_grpo", "dapo"):
        trainer.settings = dataclasses.replace(trainer.settings, loss_type=loss_type, importance=importance)
        grads, losses = [], []
        for micro_batches in (1, 2):
            trainer.model.zero_grad(set_to_none=True)
            loss, _, _ = trainer.accumulate(rollout, micro_batches)
            losses.append(loss.item())
            grads.append(torch.cat([p.grad.flatten() for p in params]))
        assert grads[0].abs().max() > 0, loss_type
        assert losses[1] == pytest.approx(losses[0], rel=1e-5), loss_type
        torch.testing.assert_close(grads[1], grads[0], rtol=1e-4, atol=1e-7, msg=loss_type)


def test_a_groups_prompt_runs_once_in_the_policy_forward_with_the_same_loss_and_gradients(tmp_path):
    """The G answers of a prompt share its columns: the training forward runs the prompt's pass once per group
    (`lm_head.completion_hidden`; the rollout's "group") and gives the loss and gradients of a pass per row, in one
    micro-batch or two; under gradient checkpointing each row runs its own."""
    def run(job, rollout, micro_batches):
        trainer = job.trainer
        shapes = []
        hook = trainer.raw_model.get_input_embeddings().register_forward_hook(
            lambda m, args, out: shapes.append(tuple(args[0].shape)))
        trainer.model.zero_grad(set_to_none=True)
        loss, _, _ = trainer.accumulate(rollout, micro_batches)
        hook.remove()
        grads = torch.cat([p.grad.flatten() for p in trainer.model.parameters() if p.requires_grad])
        return loss.item(), grads, shapes

    job = _job(tmp_path, kl_beta=0.0)
    prompts = job.train_data.input_ids[:2].repeat_interleave(2, 0)
    pmask = job.train_data.attention_mask[:2].repeat_interleave(2, 0)
    width = prompts.shape[1]
    completion = torch.tensor([[5, 6, 7], [8, 9, 10], [11, job.tokenizer.eos_token_id, 0], [12, 13, 14]])
    cmask = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 1, 0], [1, 0, 0]])
    rollout = {"ids": torch.cat([prompts, completion], 1), "mask": torch.cat([pmask, cmask], 1),
               "completion_mask": cmask, "advantages": torch.tensor([0.7, -0.7, 1.1, -1.1])}
    loss, grads, shapes = run(job, rollout, 1)
    assert shapes == [(4, width + 3)]
    for micro_batches in (1, 2):
        rows = 4 // micro_batches
        shared_loss, shared_grads, shapes = run(job, {**rollout, "group": 2}, micro_batches)
        assert shapes == [(rows // 2, width), (rows, 2)] * micro_batches  # the prompts, then 2 tokens a row
        assert shared_loss == pytest.approx(loss, rel=1e-5)
        torch.testing.assert_close(shared_grads, grads, rtol=1e-4, atol=1e-7)
    checkpointed = _job(tmp_path / "checkpointed", kl_beta=0.0, gradient_checkpointing=True)
    assert run(checkpointed, {**rollout, "group": 2}, 1)[2] == [(4, width + 3)]


def test_the_batch_std_spans_every_process_rows(tmp_path, monkeypatch):
    # SCALE_REWARDS "batch": TRL divides by the std of the rewards it gathered from every process; here a host
    # gather of the reward floats where processes hold different rows (this one the second of two, faked).
    trainer = _job(tmp_path, scale_rewards="batch").trainer
    mine, other = [1.0, 0.0, 1.0, 1.0], [0.0, 0.0, 3.0, 0.0]
    monkeypatch.setattr(type(trainer.backend), "loader_rank_and_world", property(lambda self: (1, 2)))
    monkeypatch.setattr(trainer.backend, "gather_objects", lambda value: [other, value])
    want = group_advantages(torch.tensor(mine), 2, scale=SCALE_REWARDS["batch"], batch=torch.tensor(other + mine))
    torch.testing.assert_close(trainer.advantages(mine), want)
    assert not torch.allclose(want, group_advantages(torch.tensor(mine), 2, scale=SCALE_REWARDS["batch"]))


def odd_first_character(prompts, completions):
    """A reward by import path that varies even for an untrained model's answers (the built-ins give it 0)."""
    return [float(bool(c) and ord(c[0]) % 2 == 1) for c in completions]


@pytest.mark.xla
def test_strict_xla_grpo_with_checkpointing_reads_only_for_rewards_logs_and_saves(tmp_path):
    from tests.support import XLA_BACKEND

    counters = StepCounters()
    job = _job(tmp_path, "xla", backend=XLA_BACKEND, callbacks=[counters], steps=7, log_every=1, save_every=4,
               num_iterations=2, gradient_checkpointing=True, grad_accum=2,
               rewards="answer,tests.algorithms.test_grpo:odd_first_character")
    report = job.train()  # xla_checks="strict": a recompilation or an undeclared host read after warm-up raises
    steps = counters.steps
    assert all(s["compilations"] == 0 for k, s in steps.items() if k > 2), steps
    for k, s in steps.items():
        reads = s["device_to_host_transfers"]
        rollout, saved_before = (k - 1) % 2 == 0, k == 5
        # A log step reads the step's figures (one window: loss, gradient norm, KL, clipped share); a rollout step
        # the sampled tokens (one batched transfer); the step after a save the checkpoint's tensors.
        if not saved_before:
            assert reads == 1 + rollout, (k, steps)
    assert report.xla["problems"] == [] and report.xla["cpu_fallback_ops"] == {}
    records = job.history.train
    assert records[0]["kl"] == 0.0 and records[-1]["kl"] > 0  # policy == reference before the first update
    assert {"reward", "reward/answer", "reward/tests.algorithms.test_grpo:odd_first_character", "completion_tokens",
            "clip_fraction", "generate_s"} <= set(records[0])
    # The reference is the start model itself (the adapter disabled): its log-probabilities of the last rollout.
    from transformers import AutoModelForCausalLM

    rollout = {k: v.cpu() if torch.is_tensor(v) else v for k, v in job.trainer.rollout.items()}
    base = AutoModelForCausalLM.from_pretrained(job.source, attn_implementation="eager").eval()
    with torch.no_grad():
        want = completion_logps(base, rollout["ids"], rollout["mask"], 3, 1.0)
    torch.testing.assert_close(rollout["ref_logp"], want, atol=1e-4, rtol=1e-4)
    print(f"GRPO strict on XLA:CPU: compilations {report.xla['compilations']} (steps 1-2: "
          f"{[steps[k]['compilations'] for k in (1, 2)]}), transfers per step "
          f"{[steps[k]['device_to_host_transfers'] for k in sorted(steps)]}")


@pytest.mark.xla
def test_strict_xla_dapo_with_sequence_ratios_clip_higher_and_batch_std_compiles_nothing_after_warm_up(tmp_path):
    from tests.support import XLA_BACKEND

    counters = StepCounters()
    job = _job(tmp_path, "xla", backend=XLA_BACKEND, callbacks=[counters], steps=4, log_every=1, save_every=100,
               num_iterations=2, grad_accum=2, loss_type="dapo", importance="sequence", epsilon_high=0.28,
               scale_rewards="batch", rewards="tests.algorithms.test_grpo:odd_first_character")
    report = job.train()  # strict: a recompilation or an undeclared host read after warm-up raises
    steps = counters.steps
    assert all(s["compilations"] == 0 for k, s in steps.items() if k > 2), steps
    assert report.xla["problems"] == [] and report.xla["cpu_fallback_ops"] == {}
    records = job.history.train
    assert len(records) == 4 and all(math.isfinite(r["loss"]) and 0 <= r["clip_fraction"] <= 1 for r in records)
    print(f"GRPO dapo + sequence ratios on XLA:CPU: compilations {report.xla['compilations']} (steps 1-2: "
          f"{[steps[k]['compilations'] for k in (1, 2)]})")


@pytest.mark.xla
@pytest.mark.parametrize("sharding", ["data", "fsdp"])
def test_strict_xla_grpo_on_an_eight_device_mesh_compiles_nothing_after_warm_up(sharding):
    # A v5e-8, simulated. data (the default placement): the rollouts' decode runs as one device loop, and reading
    # their batch-sharded tokens must compile nothing per step (a read of a sharded tensor compiles a gather unless
    # the backend gathers it in a graph of its own). fsdp: the decode steps one token a graph (the loop would gather
    # the weights whole), each synced, so no step reads a pending graph that gathers the weights anew.
    from tests.support import script_result
    from tpu_helpers.backend import runtime_env

    out = script_result("grpo_on_mesh", {"sharding": sharding}, env=runtime_env.xla_cpu_env(8), timeout=900)
    print(f"GRPO strict on 8 simulated devices ({sharding}): {out['compilations']} compilations in "
          f"{len(out['losses'])} steps")
    assert out["replicas"] == 8 and out["problems"] == [], out
    assert len(out["losses"]) == 6 and all(math.isfinite(x) for x in out["losses"]), out
    assert out["looped"] == (["DeviceLoop"] if sharding == "data" else ["NoneType"]), out
    assert out["device_ms"] > 0, out  # timed under ExecuteReplicatedTime over a mesh (it read 0)


def test_bad_loss_settings_name_the_value():
    with pytest.raises(ConfigError, match=r"LOSS_TYPE='ppo' is not one of \('grpo', 'bnpo', 'dr_grpo', 'dapo'\)"):
        config_from_parameters({"LOSS_TYPE": "ppo"}, base=GRPOConfig())
    with pytest.raises(ConfigError, match=r"IMPORTANCE='tokens' is not one of \('token', 'sequence'\)"):
        config_from_parameters({"IMPORTANCE": "tokens"}, base=GRPOConfig())
    with pytest.raises(ConfigError, match=r"SCALE_REWARDS='std' is not one of \('group', 'batch', 'none'\)"):
        config_from_parameters({"SCALE_REWARDS": "std"}, base=GRPOConfig())
    with pytest.raises(ConfigError, match=r"EPSILON_HIGH=0.1 must be a finite number >= CLIP_EPS=0.2"):
        config_from_parameters({"EPSILON_HIGH": 0.1}, base=GRPOConfig())
    with pytest.raises(ConfigError, match=r"EPSILON_HIGH=inf must be a finite number"):
        config_from_parameters({"EPSILON_HIGH": float("inf")}, base=GRPOConfig())
    with pytest.raises(ConfigError, match=r"SCALE_REWARDS=False has type bool; expected str"):
        config_from_parameters({"SCALE_REWARDS": False}, base=GRPOConfig())
    with pytest.raises(ConfigError, match=r"loss_type='GRPO' is not one of"):
        GRPOSettings(loss_type="GRPO")
    assert GRPOSettings(clip_eps=0.2, epsilon_high=0.2).epsilon_high == 0.2  # equal to the lower clip: allowed


def test_kill_and_resume_continues_the_same_run_bit_for_bit(tmp_path):
    opts = dict(steps=6, save_every=3, log_every=1, num_iterations=2)
    whole = _job(tmp_path / "a", **opts)
    whole.train()
    first = _job(tmp_path / "b", callbacks=[StopAt(3)], **opts)
    first.train()  # stopped after step 3, the first of a rollout's two updates: the rollout is saved with it
    assert first.trainer.step == 3 and first.trainer.rollout is not None
    resumed = _job(tmp_path / "b", **opts)
    report = resumed.train()
    assert report.resumed_from == 3
    assert_same_trainable_weights(whole.model, resumed.model)
    # The same sampled answers after the resume: the rewards and completion lengths of every step agree.
    keys = ("step", "reward", "completion_tokens", "loss", "kl")
    assert [{k: r.get(k) for k in keys} for r in whole.history.train] == \
           [{k: r.get(k) for k in keys} for r in resumed.history.train]


def test_saved_results_hold_the_reward_length_kl_figure_drawn_from_the_runs_history(tmp_path, monkeypatch):
    """What a headless GRPO run leaves: `grpo.png` (mean reward, completion tokens, KL, loss: the notebook's figure)
    beside results.json and the generic loss.png, in OUT_DIR and in the runner's run directory."""
    from tpu_helpers.recipes.grpo import GRPO_FIGURE, curves_figure
    from tpu_helpers.training.results import RUN_DIR_ENV, render_png

    monkeypatch.setenv(RUN_DIR_ENV, str(tmp_path / "runner"))
    job = _job(tmp_path)
    job.train()
    job.save_results()
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    curves = results["curves"]
    assert GRPO_FIGURE == "grpo.png" and curves["step"] == [2, 4]
    assert curves["reward"] == [r["reward"] for r in results["history"]["train"]]
    # The figure is the one drawn from the run's curves (the history's log records): re-drawn from results.json, the
    # same PNG to the byte (Agg renders deterministically); the generic loss figure stays as loss.png.
    want = render_png(curves_figure(curves))
    for directory in (tmp_path / "run", tmp_path / "runner"):
        assert (directory / "grpo.png").read_bytes() == want
        assert (directory / "loss.png").read_bytes().startswith(b"\x89PNG")
        assert (directory / "loss.png").read_bytes() != want
    titles = [ax.get_title() for ax in curves_figure(curves).axes]
    assert titles == ["mean reward", "completion tokens", "KL to the reference", "loss"]


@pytest.mark.xla
def test_the_reward_rises_and_a_surrogate_loss_near_zero_is_no_divergence(tmp_path):
    """Full GRPO of the tiny model for a reward its untrained answers already vary on, strict on XLA:CPU: the mean
    reward rises (on the CPU 0.62 -> 0.92 over the first and last 5 steps). The surrogate loss is centred near 0 and
    changes sign, so the spike rule (training/guard/divergence.py) does not watch it (nan/inf still stop): under it this
    run's loss, 0.002 -> 0.009 by step 7, would stop the run with TrainingDiverged."""
    from tests.support import XLA_BACKEND

    job = _job(tmp_path, "xla", backend=XLA_BACKEND, method="full", lr=5e-3, steps=40, batch_size=4,
               num_generations=8, max_new_tokens=2, log_every=1, save_every=100, max_records=64,
               rewards="tests.algorithms.test_grpo:odd_first_character")
    assert job.config.on_divergence == "stop"
    report = job.train()
    assert report.steps == 40 and job.trainer.diverged is None
    rewards = [r["reward"] for r in job.history.train]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last > first + 0.15, rewards
    print(f"GRPO reward on XLA:CPU: {first:.3f} over the first 5 steps -> {last:.3f} over the last 5")


def test_bad_grpo_input_names_the_value(tmp_path):
    with pytest.raises(ConfigError, match=r"NUM_GENERATIONS=1 must be >= 2"):
        config_from_parameters({"NUM_GENERATIONS": 1}, base=GRPOConfig())
    with pytest.raises(ConfigError, match=r"REWARDS names 'exactness', which is no built-in reward \(answer, "):
        config_from_parameters({"REWARDS": "answer,exactness"}, base=GRPOConfig())
    with pytest.raises(ConfigError, match=r"REWARDS='no_such_module:fn': module 'no_such_module' cannot be imported"):
        GRPOConfig(rewards="no_such_module:fn")
    with pytest.raises(ConfigError, match=r"TEMPERATURE=0.0 must be > 0"):
        config_from_parameters({"TEMPERATURE": 0}, base=GRPOConfig())
    with pytest.raises(ConfigError, match=r"METHOD='distill' is not one of \('lora', 'full'\) for GRPO"):
        config_from_parameters({"METHOD": "distill"}, base=GRPOConfig())
    with pytest.raises(ConfigError, match=r"START_FROM='/nowhere' is not 'sft', None, nor a directory"):
        config_from_parameters({"START_FROM": "/nowhere"}, base=GRPOConfig())
    job = _job(tmp_path, max_prompt_len=200, max_new_tokens=100)
    with pytest.raises(ConfigError, match=r"MAX_PROMPT_LEN=200 \+ MAX_NEW_TOKENS=100 = 300 exceeds the model's "
                                          r"context of 256 tokens"):
        job.plan()
    with pytest.raises(ConfigError, match=r"MAX_PROMPT_LEN=200 \+ MAX_NEW_TOKENS=100 = 300 exceeds"):
        _ = job.model
    data = tmp_path / "questions.jsonl"
    data.write_text("".join(json.dumps({"question": f"{a} + 1 =", "solution": str(a + 1)}) + "\n" for a in range(4)))
    with pytest.raises(ConfigError, match=r"record 0 has no prompt field 'prompt' \(PROMPT_FIELD\); its fields are "
                                          r"\['question', 'solution'\]"):
        _ = _job(tmp_path, dataset=str(data)).train_data
    # One of the 4 records is held out (EVAL_SHARE, at least one): its row never trains.
    assert len(_job(tmp_path, dataset=str(data), prompt_field="question", answer_field="solution").train_data) == 3


@pytest.mark.parametrize("returns, message", [
    (lambda n: [1.0] * (n - 1), r"reward 'bad' returned 3 values for 4 completions"),
    (lambda n: [1.0, float("nan")] + [0.0] * (n - 2), r"reward 'bad' returned nan for completion 1"),
])
def test_a_reward_returning_the_wrong_values_is_an_error_naming_it(tmp_path, returns, message):
    job = _job(tmp_path)

    def bad(prompts, completions):
        return returns(len(completions))

    job.config.reward_funcs = {**job.config.reward_funcs, "bad": bad}  # the configured ones and one that misbehaves
    with pytest.raises(ConfigError, match=message):
        job.train()


def test_each_process_samples_its_own_stream_and_one_process_the_same_again(tmp_path, monkeypatch):
    # The sampling key holds the process index (the backend's rank), in the rollouts and in the recipe's samples:
    # under torchrun every process draws its own numbers for its rows.
    job = _job(tmp_path, temperature=2.0, max_new_tokens=6)
    trainer = job.trainer
    batch = trainer.backend.to_device(next(iter(trainer.train_loader)))

    def rollout(rank):
        monkeypatch.setattr(trainer.backend, "rank", rank)
        return trainer.make_rollout(batch)[0]["ids"]

    first, other, again = rollout(0), rollout(1), rollout(0)
    assert torch.equal(first, again) and not torch.equal(first, other)

    def samples(rank):
        monkeypatch.setattr(job.backend, "rank", rank)
        return [r["completion"] for r in job.samples(4)["rows"]]

    first, other, again = samples(0), samples(1), samples(0)
    assert first == again and first != other


def test_dropout_is_off_in_the_policy_so_the_first_ratio_is_exactly_1(tmp_path):
    # Generation runs in eval mode and the training forward in train mode: with LORA_DROPOUT 0.5 the two differ, so
    # the ratio of an on-policy step is not 1 unless dropout is off (TRL disables it for this). DISABLE_DROPOUT.
    job = _job(tmp_path, lora_dropout=0.5, num_iterations=2, kl_beta=0.0)
    trainer = job.trainer
    drops = [m for m in trainer.raw_model.modules() if isinstance(m, torch.nn.Dropout)]
    assert drops and all(m.p == 0 for m in drops)
    rollout, _ = trainer.make_rollout(trainer.backend.to_device(next(iter(trainer.train_loader))))
    trainer.model.train()  # as in a step
    logp = completion_logps(trainer.model, rollout["ids"], rollout["mask"], 3, job.config.temperature)
    ratio = torch.exp(logp - rollout["old_logp"]) * rollout["completion_mask"] + (1 - rollout["completion_mask"])
    torch.testing.assert_close(ratio, torch.ones_like(ratio), atol=1e-5, rtol=0)
    kept = _job(tmp_path / "kept", lora_dropout=0.5, disable_dropout=False).trainer
    assert any(m.p == 0.5 for m in kept.raw_model.modules() if isinstance(m, torch.nn.Dropout))
    with pytest.raises(ConfigError, match=r"disable_dropout='yes' has type str; expected bool"):
        _config(tmp_path, disable_dropout="yes")
    with pytest.raises(ConfigError, match=r"disable_dropout='yes' must be True or False"):
        GRPOSettings(disable_dropout="yes")
