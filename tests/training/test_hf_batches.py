"""The Trainer takes Hugging Face dict batches; CausalLMTrainer averages over the target tokens of a whole step."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import Dataset
from transformers import AutoModelForCausalLM

from tests.support import tiny_config
from tpu_helpers.algorithms.sft import CausalLMTrainer
from tpu_helpers.training.batches import batch_loss
from tpu_helpers.training.trainer import Trainer


def test_batch_forms(tiny_lm_dir, tiny_sft):
    _, train, _ = tiny_sft
    model = AutoModelForCausalLM.from_pretrained(tiny_lm_dir)
    batch = {k: v[:4] for k, v in {"input_ids": train.input_ids, "attention_mask": train.attention_mask,
                                   "labels": train.labels}.items()}
    loss = batch_loss(model, batch)
    assert loss.ndim == 0 and loss.item() > 0
    with pytest.raises(TypeError, match=r"a dict with keys \['ids'\] without 'input_ids'; accepted batches: a pair"):
        batch_loss(model, {"ids": batch["input_ids"]})
    with pytest.raises(TypeError, match=r"returned no loss .*include 'labels'"):
        batch_loss(model, {"input_ids": batch["input_ids"]})
    with pytest.raises(TypeError, match=r"got a list of 3 \(str, str, str\); accepted batches"):
        batch_loss(model, ["a", "b", "c"])


class _Rows(Dataset):
    def __init__(self, ds):
        self.ds = ds

    def __len__(self):
        return len(self.ds)

    def __getitem__(self, i):
        return self.ds[i]


def test_the_base_trainer_fits_an_hf_model_on_dict_batches(tmp_path, tiny_lm_dir, tiny_sft):
    _, train, val = tiny_sft
    model = AutoModelForCausalLM.from_pretrained(tiny_lm_dir)
    cfg = tiny_config(tmp_path, steps=6, log_every=3, eval_every=6, save_every=6, batch_size=8, seq_len=32)
    trainer = Trainer(model, _Rows(train), _Rows(val), config=cfg, progress=False)
    report = trainer.fit()
    assert report.final_val_loss < report.first_val_loss


def _peaky(tiny_lm_dir):
    # A random model's token losses are all close to log(vocab); sharper logits make them differ between rows.
    model = AutoModelForCausalLM.from_pretrained(tiny_lm_dir)
    with torch.no_grad():
        model.lm_head.weight.mul_(20)
    return model


def _step(tiny_lm_dir, tmp_path, batches, accum):
    model = _peaky(tiny_lm_dir)
    cfg = tiny_config(tmp_path / f"a{accum}", grad_accum=accum, optimizer="sgd", lr=0.01, grad_clip=None,
                      warmup_steps=0, batch_size=len(batches[0]["input_ids"]))
    trainer = CausalLMTrainer(model, [0] * 64, None, config=cfg, progress=False)
    loss, _ = trainer.train_step(iter(batches))
    return loss, model


def test_gradient_accumulation_weighs_every_target_token_like_one_big_batch(tmp_path, tiny_lm_dir, tiny_sft):
    _, train, _ = tiny_sft
    rows = {"input_ids": train.input_ids[:8], "attention_mask": train.attention_mask[:8],
            "labels": train.labels[:8].clone()}
    # The first micro-batch trains only the answers (a few tokens a row), the second every real token.
    rows["labels"][4:] = train.input_ids[4:8].masked_fill(train.attention_mask[4:8] == 0, -100)
    halves = [{k: v[:4] for k, v in rows.items()}, {k: v[4:] for k, v in rows.items()}]
    loss_one, one = _step(tiny_lm_dir, tmp_path, [rows], 1)
    loss_two, two = _step(tiny_lm_dir, tmp_path, halves, 2)
    torch.testing.assert_close(loss_two, loss_one, rtol=1e-5, atol=1e-6)
    for (name, a), (_, b) in zip(one.named_parameters(), two.named_parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=name)
    # The mean of the micro-batch means (what dividing each micro-batch's mean loss by grad_accum gives) differs.
    model = _peaky(tiny_lm_dir)
    with torch.no_grad():
        means = [model(**h).loss for h in halves]
    assert abs(sum(means) / 2 - loss_one) > 0.05
