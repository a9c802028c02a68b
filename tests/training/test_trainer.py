"""The training loop on CPU and XLA:CPU: it learns, accumulates correctly, resumes the same run, refuses mix-ups."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from tests.support import XLA_BACKEND, StopAt, tiny_config
from tpu_helpers.backend import get_backend
from tpu_helpers.config import ConfigError
from tpu_helpers.models.gpt import GPT, gpt_config
from tpu_helpers.recipes.pretrain import Pretrain
from tpu_helpers.training.optimizers import warmup_cosine
from tpu_helpers.training.trainer import Trainer, fit


def tiny_gpt(vocab: int = 256) -> GPT:
    torch.manual_seed(0)
    return GPT(gpt_config("tiny", vocab_size=vocab, block_size=32))


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def test_schedule_warms_up_from_above_zero_and_decays_to_the_floor():
    ratios = [warmup_cosine(s, warmup=10, total=100, min_ratio=0.1) for s in range(101)]
    assert 0 < ratios[0] < ratios[5] < ratios[9] < 1.0
    assert max(ratios) == pytest.approx(1.0)
    assert ratios[100] == pytest.approx(0.1)
    assert min(warmup_cosine(s, warmup=0, total=10, min_ratio=0.0) for s in range(11)) > 0  # never exactly 0


def test_gpt_learns_on_cpu(tmp_path, tiny_data):
    train, val, _ = tiny_data
    trainer, report = fit(tiny_gpt(), train, val, config=tiny_config(tmp_path, steps=40), progress=False)
    assert report.final_val_loss < report.first_val_loss - 1.0
    assert report.steps == 40 and report.tokens_per_step == 8 * 32
    assert [r["step"] for r in trainer.history.train] == [5, 10, 15, 20, 25, 30, 35, 40]
    assert (tmp_path / "run" / "checkpoints" / "ckpt-00000040.pt").exists()
    assert report.xla == {}


def test_gradient_accumulation_matches_one_big_batch(tmp_path, tiny_data):
    train, _, _ = tiny_data
    # The sampler's order is the same for both, so a batch of 16 is two consecutive batches of 8.
    _, _ = fit(big := tiny_gpt(), train, config=tiny_config(tmp_path / "a", batch_size=16, steps=6), progress=False)
    _, _ = fit(acc := tiny_gpt(), train, config=tiny_config(tmp_path / "b", batch_size=8, grad_accum=2, steps=6),
               progress=False)
    for name, w in weights(big).items():
        torch.testing.assert_close(weights(acc)[name], w, rtol=1e-4, atol=1e-5)


def test_a_stopped_and_resumed_run_equals_an_uninterrupted_one_bit_for_bit(tmp_path, tiny_data):
    train, val, _ = tiny_data
    cfg = tiny_config(tmp_path, steps=20, save_every=100)
    ref_trainer, _ = fit(ref := tiny_gpt(), train, val, config=cfg.replace(out_dir=str(tmp_path / "ref")),
                         progress=False)

    first, _ = fit(tiny_gpt(), train, val, config=cfg, callbacks=[StopAt(7)], progress=False)
    assert first.step == 7  # stopped mid-run (and saved at step 7)
    resumed, report = fit(tiny_gpt(), train, val, config=cfg, progress=False)
    assert report.resumed_from == 7 and report.steps_this_run == 13
    for name, w in weights(ref).items():
        assert torch.equal(weights(resumed.model)[name], w), name
    # The history continues too: the resumed run's curve has every log step of the uninterrupted one.
    assert [r["step"] for r in resumed.history.train] == [r["step"] for r in ref_trainer.history.train]
    assert [e["step"] for e in resumed.history.eval] == [e["step"] for e in ref_trainer.history.eval]


def test_resume_refuses_another_runs_checkpoints_and_resume_false(tmp_path, tiny_data):
    train, _, _ = tiny_data
    cfg = tiny_config(tmp_path, steps=2)
    fit(tiny_gpt(), train, config=cfg, progress=False)
    with pytest.raises(ConfigError, match=r"holds checkpoints of a different run \(global_batch: 8 there vs 4 now"):
        fit(tiny_gpt(), train, config=cfg.replace(batch_size=4), progress=False)
    with pytest.raises(ConfigError, match=r"already holds checkpoints \(newest: step 2\) and resume=False"):
        fit(tiny_gpt(), train, config=cfg.replace(resume=False), progress=False)


def test_any_module_with_a_loss_function(tmp_path):
    torch.manual_seed(0)
    x = torch.randn(256, 4)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
    data = TensorDataset(x, y)
    model = torch.nn.Linear(4, 1)
    cfg = tiny_config(tmp_path, steps=120, lr=0.2, warmup_steps=0, weight_decay=0.0, eval_every=120)
    trainer, report = fit(model, data, data, config=cfg, loss_fn=F.mse_loss, progress=False)
    assert report.final_val_loss < 0.1 * report.first_val_loss


class _FourHooks:
    """A callback that does not subclass Callback and has the hooks validation used to list, not all the loop calls."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def on_fit_start(self, trainer) -> None:
        self.calls.append("fit_start")

    def on_step_end(self, trainer) -> None:
        self.calls.append("step_end")

    def on_log(self, trainer, record) -> None:
        self.calls.append(f"log {record['step']}")

    def on_fit_end(self, trainer, report) -> None:
        self.calls.append("fit_end")


def test_a_callback_object_with_some_hooks_runs_and_the_rest_are_skipped(tmp_path):
    x = torch.randn(64, 4)
    data = TensorDataset(x, x.sum(1, keepdim=True))
    cb = _FourHooks()
    cfg = tiny_config(tmp_path, steps=4, log_every=2, eval_every=2, save_every=4)  # evaluations call on_eval_*
    fit(torch.nn.Linear(4, 1), data, data, config=cfg, loss_fn=F.mse_loss, progress=False, callbacks=[cb])
    assert cb.calls == ["fit_start", "step_end", "log 2", "step_end", "step_end", "log 4", "step_end", "fit_end"]


def test_every_hook_the_loop_calls_is_a_callback_hook():
    import inspect
    import re

    from tpu_helpers.core.callbacks import HOOKS
    from tpu_helpers.training import evaluation, loop, trainer

    source = "".join(inspect.getsource(module) for module in (trainer, loop, evaluation))  # where the loop runs
    called = set(re.findall(r"\bcb\.(on_\w+)\(", source))
    assert called and called <= set(HOOKS), called - set(HOOKS)


def test_precision_that_conflicts_with_the_given_backend_is_refused(tmp_path, tiny_data):
    with pytest.raises(ConfigError, match=r"precision='bf16' conflicts with the backend passed in, which runs 'fp32'"):
        Trainer(tiny_gpt(), tiny_data[0], config=tiny_config(tmp_path, precision="bf16"), backend=get_backend("cpu"))


def test_gradient_checkpointing_is_wired_or_refused(tmp_path, tiny_data):
    train, _, _ = tiny_data
    model = tiny_gpt()
    Trainer(model, train, config=tiny_config(tmp_path, gradient_checkpointing=True), progress=False)
    assert model.gradient_checkpointing
    with pytest.raises(ConfigError, match="Linear has no set_gradient_checkpointing"):
        Trainer(torch.nn.Linear(2, 2), train, config=tiny_config(tmp_path, gradient_checkpointing=True))


def test_sequence_longer_than_the_context_is_refused_before_any_work(tmp_path):
    cfg = tiny_config(tmp_path, seq_len=65)
    with pytest.raises(ConfigError, match=r"seq_len=65 exceeds the context of preset 'tiny' \(block_size 64\)"):
        Pretrain(cfg, backend=get_backend("cpu"))
    assert not (tmp_path / "run").exists()


def test_missing_dataset_path_is_named_and_nothing_is_written(tmp_path):
    cfg = tiny_config(tmp_path, dataset=str(tmp_path / "nope.txt"))
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        Pretrain(cfg, backend=get_backend("cpu")).train()
    assert not (tmp_path / "run").exists()


@pytest.mark.xla
def test_xla_training_with_bf16_and_xla_gradient_checkpointing(tmp_path, tiny_data):
    train, val, _ = tiny_data
    backend = get_backend("xla", spmd=False, precision="bf16")  # a bf16 view of the session's XLA backend
    assert backend.device == XLA_BACKEND.device and backend.precision == "bf16"
    model = tiny_gpt()
    calls = []
    cfg = tiny_config(tmp_path, device="xla", steps=12, precision="bf16", gradient_checkpointing=True,
                      eval_every=12, log_every=4)
    trainer = Trainer(model, train, val, config=cfg, backend=backend, progress=False)
    fn = model._checkpoint_fn
    assert fn.__module__ == "torch_xla.utils.checkpoint"  # torch's own would save nothing on XLA
    model.set_gradient_checkpointing(lambda *a, **k: calls.append(1) or fn(*a, **k))  # count the calls
    report = trainer.fit()
    assert XLA_BACKEND.precision == "fp32"  # the shared backend other trainers hold kept its precision
    assert report.precision == "bf16"
    assert report.final_val_loss < report.first_val_loss
    assert len(calls) >= 12 * 2  # two blocks per step, every step


def test_saving_results_leaves_no_figure_open(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    from tpu_helpers.recipes.pretrain import train_gpt
    from tpu_helpers.training.results import RUN_DIR_ENV

    monkeypatch.setenv(RUN_DIR_ENV, str(tmp_path / "runner_dir"))  # two directories, one loss.png each
    job = train_gpt(tiny_config(tmp_path, steps=2, eval_every=2, log_every=1, save_every=2, max_chars=20_000),
                    progress=False)
    before = plt.get_fignums()
    for _ in range(3):  # a long notebook session saving again and again
        job.save_results()
    assert plt.get_fignums() == before
    assert (tmp_path / "run" / "loss.png").stat().st_size > 0 and (tmp_path / "runner_dir" / "loss.png").exists()
