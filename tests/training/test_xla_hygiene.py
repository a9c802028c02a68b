"""The loop is XLA-clean on a real XLA device (XLA:CPU): no recompilation after warm-up, host reads only at logs."""

from __future__ import annotations

import pytest

from tests.support import tiny_config
from tpu_helpers.backend import get_backend
from tpu_helpers.diagnostics import XlaPerformanceWarning
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
    # A batch shape no other test of the session uses: XLA caches compiled graphs per process, so a graph another
    # test already compiled (the divergence test's XLA twin runs this GPT at batch 8) would count no compilation.
    cfg = tiny_config(tmp_path, device="xla", steps=30, log_every=10, eval_every=1000, save_every=1000, batch_size=7)
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


def _compiles_after_warmup(samples) -> list[int]:
    """Compilations counted before each step after the two warm-up steps (flat = no recompilation)."""
    return [m["compilations"] for _, m in samples[3:]]


def test_evaluation_and_gradient_accumulation_compile_in_warmup_only(tmp_path, tiny_data):
    # Gradients are dropped after each step (zero_grad(set_to_none=True), the measured default): the first
    # micro-batch creates them, the second adds into them, inside one graph that is the same every step.
    train, val, tok = tiny_data
    cfg = tiny_config(tmp_path, device="xla", steps=8, grad_accum=2, log_every=4, eval_every=4, save_every=1000)
    model = GPT(gpt_config("tiny", vocab_size=tok.vocab_size, block_size=32))
    trainer = MetricsProbe(model, train, val, config=cfg, backend=get_backend("xla", spmd=False), progress=False)
    trainer.samples = []
    report = trainer.fit()
    assert trainer.backend.zero_grad_set_to_none is True
    after = _compiles_after_warmup(trainer.samples)
    assert after == [after[0]] * len(after), f"recompiled after warm-up: {after}"
    assert report.xla["problems"] == []
    # One graph run per optimizer step (both micro-batches in it) plus one per evaluation batch at steps 4 and 8;
    # MpDeviceLoader's own per-batch sync used to cut each step in two (20 runs here).
    assert report.xla["executions"] <= cfg.steps + 2 * cfg.eval_batches + 1, report.xla["executions"]


class ChangingScalar(MetricsProbe):
    """A real recompile: a Python float that changes every step reaches the graph as a constant (an exponent)."""

    def compute_loss(self, batch):
        return super().compute_loss(batch) ** (1.0 + self.step / 1000.0)


def test_the_hygiene_check_and_the_detector_catch_a_real_recompile(tmp_path, tiny_data):
    train, val, tok = tiny_data
    cfg = tiny_config(tmp_path, device="xla", steps=6, log_every=3, eval_every=1000, save_every=1000)
    model = GPT(gpt_config("tiny", vocab_size=tok.vocab_size, block_size=32))
    trainer = ChangingScalar(model, train, None, config=cfg, backend=get_backend("xla", spmd=False), progress=False)
    trainer.samples = []
    with pytest.warns(XlaPerformanceWarning, match="recompiled with unchanged input shapes"):
        report = trainer.fit()
    after = _compiles_after_warmup(trainer.samples)
    assert after == sorted(after) and after[-1] > after[0], f"the recompiles went unseen: {after}"
    assert [p["cause"] for p in report.xla["problems"]] == ["changing_value"]


@pytest.mark.parametrize("optimizer", ["sgd", "adafactor"])
def test_every_optimizer_of_the_vocabulary_trains_strictly_on_xla(tmp_path, tiny_data, optimizer):
    # choices.OPTIMIZERS is one list for the trainer, the estimates and the panel: each trains here, with no
    # recompilation or host read after warm-up (the detector raises under "strict"), and its loss falls.
    train, val, tok = tiny_data
    cfg = tiny_config(tmp_path, device="xla", steps=12, log_every=4, eval_every=12, save_every=12, lr=3e-3,
                      optimizer=optimizer, xla_checks="strict")
    model = GPT(gpt_config("tiny", vocab_size=tok.vocab_size, block_size=32))
    trainer = Trainer(model, train, val, config=cfg, backend=get_backend("xla", spmd=False), progress=False)
    report = trainer.fit()
    assert report.final_val_loss < report.first_val_loss and report.xla["cpu_fallback_ops"] == {}
    assert report.xla["compilations"] <= 4, report.xla
    state = next(iter(trainer.optimizer.state.values()))
    assert ("row" in state or "v" in state) if optimizer == "adafactor" else "momentum_buffer" in state


def test_a_finished_run_leaves_no_loader_thread_or_worker_process_behind(tmp_path, tiny_data):
    # MpDeviceLoader's feeder threads blocked on a full queue once the loop stopped reading mid-epoch, holding the
    # DataLoader and its persistent worker processes for the rest of the process; and the workers of a finished
    # run lived as long as its trainer (until the garbage collector reached it). A test session piled up over 100
    # threads and dozens of forked copies of itself.
    import multiprocessing
    import threading
    import time

    train, val, tok = tiny_data
    threads, children = set(threading.enumerate()), set(multiprocessing.active_children())
    cfg = tiny_config(tmp_path, device="xla", steps=3, log_every=3, eval_every=3, save_every=1000)
    model = GPT(gpt_config("tiny", vocab_size=tok.vocab_size, block_size=32))
    backend = get_backend("xla", spmd=False)
    assert backend.loader_options["num_workers"] >= 1  # the case that leaked processes
    trainer = Trainer(model, train, val, config=cfg, backend=backend, progress=False)
    trainer.fit()  # the trainer stays alive: its loaders' workers must have stopped anyway
    def threads_left():  # tqdm's monitor is one thread per process, started by the first progress bar
        return [t.name for t in threading.enumerate() if t not in threads and t.is_alive() and t.name != "tqdm_monitor"]

    def processes_left():
        return [p.pid for p in multiprocessing.active_children() if p not in children]

    # Told to stop, the workers and their queues' feeder threads take a moment to exit: wait for them, not forever
    # (before the fix they never did).
    deadline = time.monotonic() + 20
    while (threads_left() or processes_left()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert threads_left() == [], f"threads left running after fit: {threads_left()}"
    assert processes_left() == [], f"loader worker processes left after fit: {processes_left()}"
    assert trainer.evaluate() is not None  # a loader whose workers were released starts new ones


def test_adamw_on_xla_is_the_foreach_update_and_gives_the_single_tensor_weights():
    # make_optimizer picks the multi-tensor AdamW for XLA parameters (half the host tracing of torch's default
    # single-tensor loop there): the same weights bit for bit over a few steps, as measured before choosing it.
    import torch

    from tpu_helpers.training.optimizers import make_optimizer

    backend = get_backend("xla", spmd=False)
    device = backend.device
    torch.manual_seed(0)
    init = [torch.randn(4, 8), torch.randn(8, 4), torch.randn(8)]
    grads = [[torch.randn_like(t) for t in init] for _ in range(4)]

    def weights(foreach):
        params = [torch.nn.Parameter(t.clone().to(device)) for t in init]
        opt = make_optimizer("adamw", params, lr=1e-2, weight_decay=0.1)
        if foreach is not None:
            assert opt.defaults["foreach"] is True  # the package's choice on XLA
            for group in opt.param_groups:
                group["foreach"] = foreach
        for step_grads in grads:
            for p, g in zip(params, step_grads, strict=True):
                p.grad = g.to(device)
            opt.step()
            backend.sync()
        return [p.detach().cpu() for p in params]

    foreach, single = weights(None), weights(False)
    for a, b in zip(foreach, single, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
