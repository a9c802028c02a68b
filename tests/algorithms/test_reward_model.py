"""Reward models (algorithms/reward_model.py, models/reward_model.py, ALGORITHM "reward" of recipes/preference.py):
the loss equals TRL 1.16 RewardTrainer's (margin column, center_rewards_coefficient); the tiny model learns the
offline pairs and its export loads with plain transformers as a sequence classifier giving the same scores;
REWARDS "model:PATH" scores completions with the reward model's chat template through the one reward call, next
to rule rewards, in GRPO; strict on XLA:CPU within DPO's compile count; bad input named."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from tests.support import StepCounters
from tpu_helpers.algorithms.reward_model import ModelReward, bradley_terry_loss
from tpu_helpers.algorithms.rewards import resolve_rewards
from tpu_helpers.config import ConfigError
from tpu_helpers.data.preference import build_preference_dataset, preference_records
from tpu_helpers.recipes.preference import Preference, PreferenceConfig


def _config(tmp_path, device="cpu", **overrides):
    base = dict(algorithm="reward", device=device, steps=4, batch_size=4, seq_len=32, lr=3e-3, warmup_steps=1,
                log_every=2, save_every=100, eval_every=100, out_dir=str(tmp_path / "rm"), max_records=48,
                val_fraction=0.2, xla_checks="strict" if device == "xla" else "off", lora_r=4)
    return PreferenceConfig(**{**base, **overrides})


def _trl_loss(chosen, rejected, margin=None, coefficient=None) -> torch.Tensor:
    """TRL 1.16 RewardTrainer.compute_loss itself, on a 'model' whose logits are the given rewards."""
    from trl import RewardTrainer

    gather = SimpleNamespace(gather_for_metrics=lambda t: t, gather=lambda t: t)
    trainer = SimpleNamespace(model=SimpleNamespace(training=False), args=SimpleNamespace(
        center_rewards_coefficient=coefficient), accelerator=gather, _total_train_tokens=0, _tp_size=1,
        _metrics={"eval": {k: [] for k in ("min_reward", "mean_reward", "max_reward", "accuracy", "margin")}})
    logits = torch.cat([chosen, rejected])[:, None]
    inputs = {"input_ids": torch.zeros(2 * len(chosen), 3, dtype=torch.long)}
    if margin is not None:
        inputs["margin"] = margin
    return RewardTrainer.compute_loss(trainer, lambda **kw: SimpleNamespace(logits=logits), inputs)


@pytest.mark.parametrize("with_margin, coefficient", [(False, None), (True, None), (False, 0.01), (True, 0.3)])
def test_the_loss_equals_trl_reward_trainers_on_the_same_rewards(with_margin, coefficient):
    g = torch.Generator().manual_seed(1)
    chosen, rejected = torch.randn(7, generator=g) * 3, torch.randn(7, generator=g) * 3
    margin = torch.rand(7, generator=g) * 2 if with_margin else None
    ours = bradley_terry_loss(chosen, rejected, margin=margin, center_rewards_coefficient=coefficient)
    torch.testing.assert_close(ours.losses.mean(), _trl_loss(chosen, rejected, margin, coefficient))
    torch.testing.assert_close(ours.chosen_rewards, chosen)
    if with_margin or coefficient:  # the terms count: dropping them changes the loss
        assert not torch.allclose(ours.losses.mean(), _trl_loss(chosen, rejected))


def test_the_margin_column_reaches_the_step(tmp_path):
    job = Preference(_config(tmp_path), progress=False)
    records = [{**r, "margin": float(k % 3)} for k, r in enumerate(preference_records(8))]
    data, _ = build_preference_dataset(job.tokenizer, records, seq_len=32)
    assert data[2]["margin"].item() == 2.0 and data.select([1, 2]).margin.tolist() == [1.0, 2.0]
    batch = {k: torch.stack([data[i][k] for i in range(4)]) for k in data[0]}
    losses, _, _ = job.trainer.pair_loss(batch)
    with torch.no_grad():
        scores = job.trainer.model(input_ids=torch.cat([batch["input_ids"][:, 0], batch["input_ids"][:, 1]]),
                                   attention_mask=torch.cat([batch["attention_mask"][:, 0],
                                                             batch["attention_mask"][:, 1]])).logits[:, 0]
    c, r = scores.chunk(2)
    torch.testing.assert_close(losses.detach(), bradley_terry_loss(c, r, margin=batch["margin"]).losses,
                               rtol=1e-4, atol=1e-5)
    with pytest.raises(ConfigError, match=r"record 1: margin='big'"):
        build_preference_dataset(job.tokenizer, [records[0], {**records[1], "margin": "big"}], seq_len=32)


def test_the_reward_model_learns_and_exports_a_plain_transformers_classifier(tmp_path):
    """The tiny model (every weight, and the head) over the generated pairs: held-out pair accuracy rises; the
    merged export loads with AutoModelForSequenceClassification and scores as the trained model; `model:PATH`
    scores with it. On the CPU: 0.58 -> 0.83 over 150 steps (the LoRA export: the GRPO test below)."""
    from transformers import AutoTokenizer

    job = Preference(_config(tmp_path, method="full", steps=150, batch_size=16, max_records=2000, lr=1e-3,
                             warmup_steps=5, log_every=10), progress=False)
    before = job.preference_accuracy()
    assert before["logp_accuracy"] is None
    job.train()
    after = job.preference_accuracy()
    print(f"held-out pair accuracy {before['accuracy']:.2f} -> {after['accuracy']:.2f} over {after['pairs']} pairs")
    assert after["accuracy"] >= 0.7 and after["accuracy"] > before["accuracy"] + 0.15, (before, after)
    paths = job.export()
    path = job.save_results(before=before, after=after, paths=paths)
    assert json.loads(open(path).read())["accuracy"]["after"]["accuracy"] == pytest.approx(after["accuracy"])
    model = _scores_as_exported(job, paths["merged"])
    tok = AutoTokenizer.from_pretrained(paths["merged"])
    # REWARDS "model:PATH": the prompt and completion through the reward model's own chat template, scored as
    # plain transformers scores that text.
    reward = resolve_rewards(f"answer,model:{paths['merged']}")[f"model:{paths['merged']}"]
    prompts, completions = ["What is 3 + 4?", "Letter after c:", "What is 3 + 4?"], ["7", "d", "q"]
    got = reward(prompts=prompts, completions=completions)
    texts = [tok.apply_chat_template([{"role": "user", "content": p}, {"role": "assistant", "content": c}],
                                     tokenize=False) for p, c in zip(prompts, completions, strict=True)]
    with torch.no_grad():
        want = [model(**tok(t, return_tensors="pt", add_special_tokens=False)).logits[0, 0].item() for t in texts]
    assert got == pytest.approx(want, abs=1e-4)
    assert got[0] > got[2]  # the right sum above a letter
    # Agent episodes (REWARDS of the agents notebook): the prompt's and the episode's messages, as they are.
    from tpu_helpers.algorithms.episodes import episode_rewards

    episodic = episode_rewards(f"model:{paths['merged']}", "")[f"model:{paths['merged']}"]
    messages = episodic(prompts=[[{"role": "user", "content": "What is 3 + 4?"}]],
                        completions=[[{"role": "assistant", "content": "7"}]])
    assert messages == pytest.approx(got[:1], abs=1e-4)


def _scores_as_exported(job, path):
    """The export at `path`, loaded by plain transformers, after checking it scores held-out rows as the job's."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    assert type(model).__name__ == "Qwen2ForSequenceClassification" and model.config.num_labels == 1
    held = job.held_rows.select(range(6))
    live = job.trainer.score_pairs(held)["rewards"]
    with torch.no_grad():
        plain = model(input_ids=held.input_ids[:, 0], attention_mask=held.attention_mask[:, 0]).logits[:, 0]
    torch.testing.assert_close(plain, live[:, 0], rtol=1e-4, atol=1e-4)
    return model


@pytest.fixture(scope="module")
def tiny_rm(tmp_path_factory) -> str:
    """A LoRA reward model of the tiny model (2 steps), exported: its merged directory, checked against the job."""
    rm = Preference(_config(tmp_path_factory.mktemp("rm"), steps=2), progress=False)  # the adapters and the head
    rm.train()
    path = rm.export()["merged"]
    _scores_as_exported(rm, path)
    return path


def _grpo(tmp_path, path, device="cpu", **overrides):
    from tpu_helpers.recipes.grpo import GRPO, GRPOConfig

    cfg = dict(device=device, start_from=None, steps=2, batch_size=2, num_generations=2, max_prompt_len=24,
               max_new_tokens=3, warmup_steps=1, log_every=1, save_every=100, out_dir=str(tmp_path / "grpo"),
               max_records=16, lora_r=4, rewards=f"answer,model:{path}",
               xla_checks="strict" if device == "xla" else "off")
    return GRPO(GRPOConfig(**{**cfg, **overrides}), progress=False, **({"backend": _xla()} if device == "xla" else {}))


def _xla():
    from tests.support import XLA_BACKEND

    return XLA_BACKEND


def test_a_reward_model_rewards_grpo_next_to_a_rule_reward(tmp_path, tiny_rm):
    """GRPO with REWARDS "answer,model:PATH": both rewards are logged, the model's through the one reward call."""
    path = tiny_rm
    job = _grpo(tmp_path, path)
    job.train()
    row = job.history.train[-1]
    assert {"reward/answer", f"reward/model:{path}"} <= set(row), row
    samples = job.samples(4)
    assert set(samples["rewards"]) == {"answer", f"model:{path}"}
    assert samples["reward"] == pytest.approx(sum(samples["rewards"].values()), abs=1e-5)


@pytest.mark.xla
def test_strict_xla_grpo_scores_with_the_reward_model_on_the_device_without_recompiling(tmp_path, tiny_rm):
    """The reward model placed on the run's XLA device scores every rollout in the same shapes: nothing compiles
    after warm-up (xla_checks strict), its values logged beside the rule reward's."""
    counters = StepCounters()
    job = _grpo(tmp_path, tiny_rm, "xla", steps=5, log_every=5, save_every=5)
    job.callbacks.append(counters)
    report = job.train()
    reward = job.config.reward_funcs[f"model:{tiny_rm}"]
    assert reward.backend is job.backend and str(next(reward._loaded[0].parameters()).device).startswith("xla")
    assert all(s["compilations"] == 0 for k, s in counters.steps.items() if k > 2), counters.steps
    assert report.xla["problems"] == [] and f"reward/model:{tiny_rm}" in job.history.train[-1]
    print(f"GRPO with a reward model, strict on XLA:CPU: {report.xla['compilations']} graphs, by step "
          f"{[counters.steps[k]['compilations'] for k in sorted(counters.steps)]}")


def test_bad_reward_model_input_names_the_value(tmp_path):
    from tpu_helpers.models import hf
    from tpu_helpers.recipes.grpo import GRPOConfig

    causal = hf.resolve_model_source(hf.TINY)  # a causal LM, not a classifier
    with pytest.raises(ConfigError, match=rf"REWARDS: '{causal}' is a Qwen2ForCausalLM, not a reward model; give a"):
        ModelReward(causal)
    two = tmp_path / "two_labels"
    two.mkdir()
    (two / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForSequenceClassification"],
                                                 "id2label": {"0": "bad", "1": "good"}}))
    with pytest.raises(ConfigError, match=r"is a Qwen2ForSequenceClassification with 2 labels, not a reward model"):
        resolve_rewards(f"model:{two}")
    with pytest.raises(ConfigError, match=r"'/no/such/rm' is not a directory"):
        GRPOConfig(rewards="answer,model:/no/such/rm", start_from=None)
    with pytest.raises(ConfigError, match=r"center_rewards_coefficient=-1"):
        _config(tmp_path, center_rewards_coefficient=-1)
    with pytest.raises(ConfigError, match=r"center_rewards_coefficient=0.01 applies to algorithm='reward' only"):
        _config(tmp_path, algorithm="dpo", center_rewards_coefficient=0.01)
    with pytest.raises(ConfigError, match=r"quantize_base='nf4' with algorithm='reward'"):
        _config(tmp_path, quantize_base="nf4")


@pytest.mark.xla
def test_strict_xla_compiles_no_more_than_dpo_and_nothing_after_warm_up(tmp_path):
    from tests.support import XLA_BACKEND

    compiled = {}
    for algorithm in ("dpo", "reward"):
        counters = StepCounters()
        job = Preference(_config(tmp_path / algorithm, "xla", algorithm=algorithm, steps=5, grad_accum=2,
                                 lr=3e-3), backend=XLA_BACKEND, progress=False, callbacks=[counters])
        report = job.train()  # xla_checks="strict": a recompilation or an undeclared host read after warm-up raises
        assert all(s["compilations"] == 0 for k, s in counters.steps.items() if k > 3), counters.steps
        compiled[algorithm] = sum(s["compilations"] for s in counters.steps.values())
        assert report.xla["problems"] == []
    print(f"graphs compiled by 5 strict steps on XLA:CPU: {compiled}")
    assert 0 < compiled["reward"] <= compiled["dpo"], compiled


def test_the_new_heads_initial_values_depend_on_the_seed_only(tmp_path):
    def head(name):
        model = Preference(_config(tmp_path / name), progress=False).model
        return model.base_model.model.score.modules_to_save["default"].weight.detach().clone()

    torch.manual_seed(1)
    first = head("a")
    torch.manual_seed(2)  # whatever the global stream holds before the job loads
    assert torch.equal(first, head("b"))
