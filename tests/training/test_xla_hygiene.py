"""The loop is XLA-clean on a real XLA device (XLA:CPU): no recompilation after warm-up, host reads only at logs."""

from __future__ import annotations

import pytest

from tests.support import tiny_config
from tpu_helpers.backend import get_backend
from tpu_helpers.models.gpt import GPT, gpt_config
from tpu_helpers.training.trainer import Trainer

pytestmark = pytest.mark.xla


class MetricsProbe(Trainer):
    """Records the XLA counters before every step, i.e. right after the previous step's sync."""

    def train_step(self, batches):
        self.samples.append((self.step, self.backend.metrics()))
        return super().train_step(batches)


def test_thirty_steps_compile_during_warmup_only_and_read_host_only_at_log_steps(tmp_path, tiny_data):
    train, val, tok = tiny_data
    backend = get_backend("xla", spmd=False)
    cfg = tiny_config(tmp_path, device="xla", steps=30, log_every=10, eval_every=1000, save_every=1000)
    model = GPT(gpt_config("tiny", vocab_size=tok.vocab_size, block_size=32))
    trainer = MetricsProbe(model, train, val, config=cfg, backend=backend, progress=False)
    trainer.samples = []
    report = trainer.fit()

    steps = [s for s, _ in trainer.samples]
    compiles = [m["compilations"] for _, m in trainer.samples]
    transfers = [m["device_to_host_transfers"] for _, m in trainer.samples]
    assert steps == list(range(30))
    # Warm-up: step 1 (no optimizer state, no gradients yet) and step 2 (steady state) compile; then nothing.
    assert compiles[3] >= 1
    assert compiles[3:] == [compiles[3]] * 27, f"recompiled after warm-up: {compiles}"
    # samples[k] holds the counters after step k's sync (k steps done); a host read may happen only after a log step.
    for k in range(1, 30):
        grew = transfers[k] - transfers[k - 1]
        if k % 10 == 0:
            assert grew == 1, f"expected exactly one host read after log step {k}, got {grew}"
        else:
            assert grew == 0, f"host read after step {k} (not a log step): {transfers}"
    # The whole run: a handful of graphs, and the losses that were logged fell.
    assert report.xla["compilations"] <= 4
    assert report.xla["cpu_fallback_ops"] == {}
    losses = [r["loss"] for r in trainer.history.train]
    assert [r["step"] for r in trainer.history.train] == [10, 20, 30]
    assert losses[-1] < losses[0]
    assert report.final_val_loss < report.first_val_loss
