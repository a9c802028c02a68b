"""TrainConfig.replay_steps on XLA:CPU: the step's loss (forward, and so its backward) and AdamW's step captured once
by dynamo (openxla) and replayed instead of traced every step; the same losses as the lazily traced loop to 1e-6 over
5 steps with gradient accumulation, and no compile after warm-up (strict). The package's GPT under the base Trainer,
a tiny Hugging Face model with LoRA under the SFT trainer and under live distillation, GRPO's update, DPO and ORPO,
the fine-tune recipe's QLoRA and QAT from the notebook's REPLAY_STEPS;
the replayed AdamW step against torch's; a replayed run killed and resumed; trainers without a replay say so."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

from tests.support import XLA_BACKEND, tiny_config
from tpu_helpers.config import TrainConfig
from tpu_helpers.training.step import replays_steps
from tpu_helpers.training.trainer import Trainer

pytestmark = [pytest.mark.xla, pytest.mark.skipif(XLA_BACKEND is None, reason="torch_xla not installed")]


def _unique_graphs() -> int:
    import torch._dynamo

    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def _fit(make, replay: bool) -> list[float]:
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no fallback to lazy tracing: a warning would fail here
        trainer = make(replay)
        trainer.fit()  # strict: a compile after warm-up raises
    if replay:  # AdamW's step was replayed too (replayed_optimizer.py): the optimizer was made capturable for it
        assert all(g["capturable"] for g in trainer.optimizer.param_groups)
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


@pytest.mark.parametrize("algorithm, method", [("dpo", "lora"), ("orpo", "full"), ("kto", "lora"),
                                               ("simpo", "full")])
def test_preference_tuning_replays_its_policy_forward_with_the_lazy_losses(tmp_path, one_thread, algorithm, method):
    from tpu_helpers.recipes.preference import Preference, PreferenceConfig

    def make(replay):
        torch.manual_seed(0)
        # KTO's and SimPO's policy forward is DPO's and ORPO's: rows of another length make their captures new.
        cfg = PreferenceConfig(device="xla", steps=5, batch_size=2, grad_accum=2,
                               seq_len=48 if algorithm in ("kto", "simpo") else 40, lr=3e-3, beta=0.5,
                               warmup_steps=1, log_every=1, save_every=100, eval_every=100, max_records=24,
                               val_fraction=0.2, lora_r=4, algorithm=algorithm, method=method, xla_checks="strict",
                               out_dir=str(tmp_path / f"pref-{replay}"), replay_steps=replay)
        return Preference(cfg, backend=XLA_BACKEND, progress=False).trainer

    _same_losses(make)


@pytest.mark.parametrize("frozen", [{"QUANTIZE_BASE": "nf4", "QUANTIZE_GROUP_SIZE": 32}, {"QAT": "int4"}],
                         ids=["qlora-nf4", "qat-int4"])
def test_the_finetune_notebooks_replay_steps_switch_replays_a_4bit_base_with_the_lazy_losses(tmp_path, one_thread,
                                                                                           frozen):
    # The notebook's parameters cell (REPLAY_STEPS among them, off), then what papermill would inject; the recipe's
    # LoRA over a 4-bit frozen base (QLoRA: the dequantizing linear in the capture) or fake-quantized weights (QAT).
    import json
    from pathlib import Path

    from tpu_helpers.config import config_from_parameters
    from tpu_helpers.recipes.finetune import Finetune, FinetuneConfig

    cells = json.loads((Path(__file__).parents[2] / "notebooks" / "finetune_llm.ipynb").read_text())["cells"]
    cell = next(c for c in cells if "parameters" in c["metadata"].get("tags", []))
    notebook: dict = {}
    exec("".join(cell["source"]), notebook)
    assert notebook["REPLAY_STEPS"] is False

    def make(replay):
        torch.manual_seed(0)
        params = {**notebook, "REPLAY_STEPS": replay, "DEVICE": "xla", "STEPS": 5, "BATCH_SIZE": 2, "GRAD_ACCUM": 2,
                  "SEQ_LEN": 32, "LR": 3e-3, "WARMUP_STEPS": 1, "EVAL_EVERY": 100, "SAVE_EVERY": 100,
                  "LORA_TARGETS": "q_proj,v_proj", "INSTALL": False, "OUT_DIR": str(tmp_path / f"ft-{replay}"),
                  **frozen}
        cfg = config_from_parameters(params, base=FinetuneConfig(log_every=1, max_records=64, xla_checks="strict"))
        assert cfg.replay_steps is replay
        return Finetune(cfg, backend=XLA_BACKEND, progress=False).trainer

    _same_losses(make)


def test_trainers_without_a_replay_are_named_in_a_warning_and_traced_lazily(tmp_path, tiny_data):
    from tpu_helpers.algorithms.distill import CachedDistillTrainer
    from tpu_helpers.algorithms.grpo import GRPOTrainer
    from tpu_helpers.algorithms.preference import PreferenceTrainer
    from tpu_helpers.algorithms.sft import CausalLMTrainer
    from tpu_helpers.models.gpt import GPT, gpt_config

    for cls in (Trainer, CausalLMTrainer, CachedDistillTrainer, GRPOTrainer, PreferenceTrainer):
        assert replays_steps(cls), cls

    class OwnLoss(Trainer):  # overrides the method the replay lives in: not replayed, and said so
        def compute_loss(self, batch):
            return super().compute_loss(batch)

    train, _, tok = tiny_data
    model = GPT(gpt_config("tiny", vocab_size=tok.vocab_size, block_size=32))
    cfg = tiny_config(tmp_path, device="xla", steps=1, replay_steps=True)
    with pytest.warns(UserWarning, match=r"replay_steps: OwnLoss does not replay its steps"):
        trainer = OwnLoss(model, train, config=cfg, backend=XLA_BACKEND, progress=False)
    assert not trainer.replay.enabled


def test_the_replayed_adamw_step_is_torchs_adamw_with_clipping():
    # Against torch's own AdamW stepped lazily after clip_grad_norm_: the learning rate changing every step (a
    # device scalar to the capture), weight decay on one group only, clipping active on some steps; one capture.
    from tpu_helpers.training import replayed_optimizer
    from tpu_helpers.training.optimizers import make_optimizer

    device = XLA_BACKEND.device
    torch.manual_seed(0)
    init = [torch.randn(6, 4), torch.randn(4), torch.randn(3, 6)]
    grads = [[torch.randn_like(t) * (0.2 + k) for t in init] for k in range(4)]
    lrs = [1e-2, 3e-2, 2e-2, 5e-3]

    def run(replay):
        params = [torch.nn.Parameter(t.clone().to(device)) for t in init]
        opt = make_optimizer("adamw", params, lr=lrs[0], weight_decay=0.1)
        norms = []
        for lr, step_grads in zip(lrs, grads, strict=True):
            for group in opt.param_groups:
                group["lr"] = lr
            for p, g in zip(params, step_grads, strict=True):
                p.grad = g.to(device)
            if replay:
                assert replayed_optimizer.can_replay(opt, XLA_BACKEND)
                norms.append(replayed_optimizer.replayed_step(opt, XLA_BACKEND, clip_norm=2.0))
            else:
                norms.append(torch.nn.utils.clip_grad_norm_(params, 2.0))
                opt.step()
            XLA_BACKEND.sync()
        return [p.detach().cpu() for p in params], [float(n) for n in norms], opt

    captures = _unique_graphs()
    (replayed, replayed_norms, opt), (lazy, lazy_norms, _) = run(True), run(False)
    assert _unique_graphs() == captures + 1  # one capture for the four steps
    assert min(lazy_norms) < 2.0 < max(lazy_norms)  # clipping acted on some steps only
    torch.testing.assert_close(replayed_norms, lazy_norms, rtol=1e-6, atol=0)
    for a, b in zip(replayed, lazy, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    state = opt.state[opt.param_groups[0]["params"][0]]
    assert state["step"].device.type == "xla" and float(state["step"]) == 4.0


def test_a_replayed_run_killed_and_resumed_gives_the_whole_runs_weights(tmp_path, tiny_sft, one_thread):
    # The checkpoint holds the capturable optimizer (its step counts on the device); the resumed run loads it and
    # replays on, bit for bit the run left whole.
    from tests.support import StopAt, assert_same_trainable_weights
    from tpu_helpers.algorithms.sft import CausalLMTrainer

    _, train, _ = tiny_sft

    def make(out, callbacks=None):
        cfg = dataclasses.replace(_lm_config(tmp_path, True), steps=6, save_every=3, out_dir=str(tmp_path / out))
        return CausalLMTrainer(_lora_lm(), train, None, config=cfg, backend=XLA_BACKEND, progress=False,
                               callbacks=callbacks)

    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        whole = make("whole")
        whole.fit()
        make("killed", [StopAt(3)]).fit()
        resumed = make("killed")
        report = resumed.fit()
    assert report.resumed_from == 3
    assert all(g["capturable"] for g in resumed.optimizer.param_groups)
    assert_same_trainable_weights(whole.model, resumed.model)
    assert [r["loss"] for r in whole.history.train] == [r["loss"] for r in resumed.history.train]
