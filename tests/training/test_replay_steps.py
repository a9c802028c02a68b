"""TrainConfig.replay_steps on XLA:CPU: the step's loss (forward, and so its backward) captured once by dynamo
(openxla) and replayed instead of traced every step; the same losses as the lazily traced loop to 1e-6 over 5 steps
with gradient accumulation, and no compile after warm-up (strict). The package's GPT under the base Trainer, a tiny
Hugging Face model with LoRA under the SFT trainer and under live distillation; trainers without a replay say so."""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.support import XLA_BACKEND, tiny_config
from tpu_helpers.config import TrainConfig
from tpu_helpers.training.trainer import Trainer, _replays_steps

pytestmark = [pytest.mark.xla, pytest.mark.skipif(XLA_BACKEND is None, reason="torch_xla not installed")]


def _unique_graphs() -> int:
    import torch._dynamo

    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def _fit(make, replay: bool) -> list[float]:
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no fallback to lazy tracing: a warning would fail here
        trainer = make(replay)
        trainer.fit()  # strict: a compile after warm-up raises
    return [r["loss"] for r in trainer.history.train]


def _same_losses(make) -> None:
    captures = _unique_graphs()
    lazy = _fit(make, False)
    replayed = _fit(make, True)
    assert _unique_graphs() > captures  # the loss was captured
    assert len(lazy) == 5
    torch.testing.assert_close(replayed, lazy, rtol=0, atol=1e-6)


def test_replayed_steps_give_the_lazy_losses_and_compile_nothing_after_warm_up(tmp_path, tiny_data, one_thread):
    from tpu_helpers.models.gpt import GPT, gpt_config

    train, _, tok = tiny_data

    def make(replay):
        torch.manual_seed(0)
        model = GPT(gpt_config("tiny", vocab_size=tok.vocab_size, block_size=32))
        cfg = tiny_config(tmp_path / str(replay), device="xla", steps=5, log_every=1, eval_every=100,
                          save_every=100, xla_checks="strict", batch_size=4, grad_accum=2, replay_steps=replay)
        return Trainer(model, train, config=cfg, backend=XLA_BACKEND, progress=False)

    _same_losses(make)


def _lm_config(tmp_path, replay: bool) -> TrainConfig:
    return TrainConfig(device="xla", steps=5, batch_size=4, grad_accum=2, seq_len=32, lr=3e-3, warmup_steps=1,
                       eval_every=100, log_every=1, save_every=100, out_dir=str(tmp_path / f"run-{replay}"),
                       xla_checks="strict", replay_steps=replay)


def _lora_lm():
    from tpu_helpers.models import hf, lora

    torch.manual_seed(0)
    model, _ = hf.load_causal_lm("tiny")
    return lora.add_lora(model, r=2)


@pytest.mark.parametrize("loss_chunk", [0, 48])
def test_the_sft_trainer_replays_its_token_averaged_loss(tmp_path, tiny_sft, one_thread, loss_chunk):
    # loss_chunk 48: the head's loss in chunks, each recomputed in the backward (torch_xla's checkpoint when lazy,
    # torch's inside the capture, which dynamo cannot trace through torch_xla's).
    from tpu_helpers.algorithms.sft import CausalLMTrainer

    _, train, _ = tiny_sft
    _same_losses(lambda replay: CausalLMTrainer(_lora_lm(), train, None, config=_lm_config(tmp_path, replay),
                                                backend=XLA_BACKEND, progress=False, loss_chunk=loss_chunk))


def test_live_distillation_replays_its_loss_with_the_teacher(tmp_path, tiny_sft, one_thread):
    from tpu_helpers.algorithms.distill import DistillSettings, DistillTrainer
    from tpu_helpers.models import hf

    _, train, _ = tiny_sft

    def make(replay):
        torch.manual_seed(1)
        teacher, _ = hf.load_causal_lm("tiny")
        return DistillTrainer(_lora_lm(), train, None, config=_lm_config(tmp_path, replay), backend=XLA_BACKEND,
                              progress=False, teacher=teacher, settings=DistillSettings(alpha=0.5, temperature=2.0))

    _same_losses(make)


@pytest.mark.parametrize("loss_type, kl_beta", [("bnpo", 0.0), ("dr_grpo", 0.1)])
def test_grpo_replays_its_policy_forward_with_the_lazy_losses(tmp_path, one_thread, loss_type, kl_beta):
    # The same rollouts both ways (the generator's decode step is replayed in both), then the update: the policy's
    # forward and backward captured, the surrogate on top; with a KL term the reference is the adapter-off model.
    from tpu_helpers.recipes.grpo import GRPO, GRPOConfig

    def make(replay):
        torch.manual_seed(0)
        cfg = GRPOConfig(device="xla", start_from=None, steps=5, batch_size=2, num_generations=2, max_prompt_len=24,
                         max_new_tokens=3, lr=1e-2, warmup_steps=1, log_every=1, save_every=100, max_records=32,
                         lora_r=4, grad_accum=2, loss_type=loss_type, kl_beta=kl_beta, xla_checks="strict",
                         out_dir=str(tmp_path / f"grpo-{replay}"), replay_steps=replay)
        return GRPO(cfg, backend=XLA_BACKEND, progress=False).trainer

    _same_losses(make)


@pytest.mark.parametrize("algorithm, method", [("dpo", "lora"), ("orpo", "full")])
def test_preference_tuning_replays_its_policy_forward_with_the_lazy_losses(tmp_path, one_thread, algorithm, method):
    from tpu_helpers.recipes.preference import Preference, PreferenceConfig

    def make(replay):
        torch.manual_seed(0)
        cfg = PreferenceConfig(device="xla", steps=5, batch_size=2, grad_accum=2, seq_len=40, lr=3e-3, beta=0.5,
                               warmup_steps=1, log_every=1, save_every=100, eval_every=100, max_records=24,
                               val_fraction=0.2, lora_r=4, algorithm=algorithm, method=method, xla_checks="strict",
                               out_dir=str(tmp_path / f"pref-{replay}"), replay_steps=replay)
        return Preference(cfg, backend=XLA_BACKEND, progress=False).trainer

    _same_losses(make)


def test_trainers_without_a_replay_are_named_in_a_warning_and_traced_lazily(tmp_path, tiny_data):
    from tpu_helpers.algorithms.distill import CachedDistillTrainer
    from tpu_helpers.algorithms.grpo import GRPOTrainer
    from tpu_helpers.algorithms.preference import PreferenceTrainer
    from tpu_helpers.algorithms.sft import CausalLMTrainer
    from tpu_helpers.models.gpt import GPT, gpt_config

    for cls in (Trainer, CausalLMTrainer, CachedDistillTrainer, GRPOTrainer, PreferenceTrainer):
        assert _replays_steps(cls), cls

    class OwnLoss(Trainer):  # overrides the method the replay lives in: not replayed, and said so
        def compute_loss(self, batch):
            return super().compute_loss(batch)

    train, _, tok = tiny_data
    model = GPT(gpt_config("tiny", vocab_size=tok.vocab_size, block_size=32))
    cfg = tiny_config(tmp_path, device="xla", steps=1, replay_steps=True)
    with pytest.warns(UserWarning, match=r"replay_steps: OwnLoss does not replay its steps"):
        trainer = OwnLoss(model, train, config=cfg, backend=XLA_BACKEND, progress=False)
    assert not trainer._replay
