"""TrainConfig.replay_steps on XLA:CPU: the step's forward and loss captured once by dynamo (openxla) and replayed
instead of traced every step; the same losses as the lazily traced loop, and no compile after warm-up (strict)."""

from __future__ import annotations

import pytest
import torch

from tests.support import XLA_BACKEND, tiny_config
from tpu_helpers.training.trainer import Trainer

pytestmark = [pytest.mark.xla, pytest.mark.skipif(XLA_BACKEND is None, reason="torch_xla not installed")]


def _losses(tmp_path, tiny_data, replay: bool) -> list[float]:
    from tpu_helpers.models.gpt import GPT, gpt_config

    train, _, tok = tiny_data
    torch.manual_seed(0)
    model = GPT(gpt_config("tiny", vocab_size=tok.vocab_size, block_size=32))
    cfg = tiny_config(tmp_path / str(replay), device="xla", steps=5, log_every=1, eval_every=100, save_every=100,
                      xla_checks="strict", batch_size=4, grad_accum=2, replay_steps=replay)
    trainer = Trainer(model, train, config=cfg, backend=XLA_BACKEND, progress=False)
    trainer.fit()
    return [r["loss"] for r in trainer.history.train]


def test_replayed_steps_give_the_lazy_losses_and_compile_nothing_after_warm_up(tmp_path, tiny_data, one_thread):
    import torch._dynamo

    captures = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    lazy = _losses(tmp_path, tiny_data, False)
    replayed = _losses(tmp_path, tiny_data, True)  # strict: a compile after warm-up raises
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > captures  # the step was captured
    assert len(lazy) == 5
    torch.testing.assert_close(replayed, lazy, rtol=0, atol=1e-6)
