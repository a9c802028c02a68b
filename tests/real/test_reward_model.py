"""A reward model of the real model, and GRPO rewarded by it (`make test-real`): SmolLM2-135M-Instruct with a scalar
head and LoRA (the preference recipe's ALGORITHM "reward") trained on pairs over the generated sums, the right sum
chosen and a wrong one rejected; then GRPO on the sums with REWARDS "answer,model:PATH". On held-out data only: the
reward model's pairs are sums asked in phrasings training never uses (`data.rl.sum_records`' test split), and so are
GRPO's held-out prompts. The reward model is trained once for both tests (the module fixture `reward_model`, one
unit in tests/runner_hooks.py's SHARED). Each test prints its figures (docs/benchmarks/index.md quotes them).
"""

from __future__ import annotations

import json
import random
import re
import time

import pytest

from tpu_helpers.data.rl import sum_records
from tpu_helpers.models import smollm2

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]  # one_thread: tests/conftest.py

SMOLLM2 = smollm2.SMOLLM2
SYSTEM = "Answer with the number only."  # as test_real_model's GRPO: the untrained model talks past 8 tokens otherwise
RM_STEPS = 20


def _sum_pairs(path, split: str, n: int, seed: int) -> str:
    """Pairs over the generated sums written to `path`: the right sum chosen; rejected, what the untrained model's
    wrong answers look like within 8 tokens: in 3 pairs of 4 prose that never reaches a number of its own ("The sum
    of 3 and 4 is"), in every 4th a wrong sum (another of 0..18). Each record says which ("kind")."""
    r = random.Random(seed)
    with open(path, "w") as f:
        for k, record in enumerate(sum_records(n, split=split)):
            right = int(record["answer"])
            a, b = re.findall(r"\d+", record["prompt"])
            if k % 4:
                kind, rejected = "prose", r.choice([f"The sum of {a} and {b} is", "Sure! Let me work this out step by",
                                                    f"To add {a} and {b}, we"])
            else:
                kind, rejected = "wrong sum", str(r.choice([x for x in range(19) if x != right]))
            f.write(json.dumps({"prompt": record["prompt"], "chosen": str(right), "rejected": rejected,
                                "kind": kind}) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def reward_model(smollm2_dir, tmp_path_factory) -> dict:
    """A LoRA reward model of the real model: its held-out pair accuracy before and after, its merged export."""
    from tpu_helpers.recipes.preference import Preference, PreferenceConfig

    out = tmp_path_factory.mktemp("reward_model")
    job = Preference(PreferenceConfig(
        model=SMOLLM2, algorithm="reward", dataset=_sum_pairs(out / "train.jsonl", "train", 1000, 1),
        eval_dataset=_sum_pairs(out / "test.jsonl", "test", 100, 2), eval_records=64, method="lora",
        lora_targets="all-linear", lora_r=16, lora_alpha=32, steps=RM_STEPS, lr=2e-3, warmup_steps=2, batch_size=8,
        seq_len=48, log_every=5, save_every=RM_STEPS, eval_every=RM_STEPS, export="last", device="cpu",
        out_dir=str(out / "run")), progress=False)
    t0 = time.time()
    before = job.preference_accuracy()
    job.train()
    after = job.preference_accuracy()
    seconds = time.time() - t0
    scores = job.trainer.score_pairs(job.held_rows)["rewards"]
    kinds = [record["kind"] for record in job.held_out]
    by_kind = {kind: sum(bool(s[0] > s[1]) for s, k in zip(scores, kinds, strict=True) if k == kind) / kinds.count(kind)
               for kind in sorted(set(kinds))}
    return {"before": before, "after": after, "seconds": seconds, "path": job.export()["merged"], "by_kind": by_kind,
            "curve": [round(r["rewards/accuracy"], 2) for r in job.history.train]}


def test_the_reward_model_reaches_08_held_out_pair_accuracy(reward_model, smollm2_dir):
    from transformers import AutoTokenizer

    before, after = reward_model["before"], reward_model["after"]
    # The export carries the model's own chat template: what REWARDS "model:PATH" renders completions with.
    assert AutoTokenizer.from_pretrained(reward_model["path"]).chat_template == \
        AutoTokenizer.from_pretrained(smollm2_dir).chat_template
    print(f"\nreward model, LoRA r=16 + head, {RM_STEPS} steps of 8 pairs: held-out pair accuracy "
          f"{before['accuracy']:.2f} -> {after['accuracy']:.2f} over {after['pairs']} pairs "
          f"({reward_model['seconds']:.0f} s); by the rejected answer's kind {reward_model['by_kind']}; training "
          f"accuracy by 5 steps {reward_model['curve']}")
    # The untrained head ranks by chance, and its chance depends on the init (0.36 with another one): the claim is
    # the trained model's accuracy. Measured 0.77 -> 0.94 (prose 1.00, wrong sums 0.75).
    assert after["accuracy"] >= 0.8 and after["accuracy"] > before["accuracy"]


# The reward model ranks the form of an answer (a bare number over prose) far better than its arithmetic (0.62 on
# wrong sums), and its scores span several units against the rule's 1: summed with weight 1 each, GRPO learns bare
# numbers, right or wrong (its score rises, the answer reward does not). REWARD_WEIGHTS "1,0.1" (TRL's reward_weights)
# puts the two on one scale: the rule leads and the reward model breaks its ties.
def test_grpo_with_the_reward_model_raises_its_score_and_the_rule_reward(reward_model, tmp_path):
    from tpu_helpers.recipes.grpo import GRPO, GRPOConfig

    rm = f"model:{reward_model['path']}"
    job = GRPO(GRPOConfig(model=SMOLLM2, start_from=None, method="lora", lora_targets="all-linear", lora_r=16,
                          lora_alpha=32, steps=8, lr=1e-3, warmup_steps=1, batch_size=4, num_generations=8,
                          max_new_tokens=8, max_prompt_len=32, system_prompt=SYSTEM, log_every=1, save_every=8,
                          device="cpu", rewards=f"answer,{rm}", reward_weights="1,0.1",
                          out_dir=str(tmp_path / "grpo")), progress=False)
    t0 = time.time()
    before = job.samples(32)
    job.train()
    after = job.samples(32)
    b, a = before["rewards"], after["rewards"]
    print(f"\nGRPO with REWARDS 'answer,model:PATH' weighted 1 and 0.1, 8 steps of 4 prompts x 8 answers: held-out "
          f"reward model score "
          f"{b[rm]:.2f} -> {a[rm]:.2f}, answer reward {b['answer']:.2f} -> {a['answer']:.2f} "
          f"({time.time() - t0:.0f} s)")
    for row in job.compare(before, after, 4):
        print(f"  {row['prompt']!r} ({row['answer']}): {row['before']!r} -> {row['after']!r}")
    assert a[rm] > b[rm] and a["answer"] >= b["answer"] + 0.2
