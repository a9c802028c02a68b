"""The training loop of `Trainer.fit`: resume, then step after step with its cadence, then the run's report.

    report = run(trainer)        # Trainer.fit runs it under the signal handlers and the run lock

Each step: the trainer's `train_step` (its figures go to the log window, `training.log_window`), one
`backend.sync()`, then what the cadence says (`training.cadence`): at a log step one step closure reads the window
and logs it (`log_step`), at an eval step the validation loss, at a save step a checkpoint. XLA hygiene: exactly one
sync per optimizer step (accumulation stays in one graph), fixed shapes (loaders drop the last partial batch), no
host read of a device tensor between log steps (the progress bar counts on the host), gradients dropped after each
step (`backend.zero_grad`). The data position counts samples of the global order (`data_batches`), so a checkpoint
resumes at the same sample on any number of chips. The functions take the trainer and use its public parts.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from tqdm.auto import tqdm

from tpu_helpers.data import release_workers
from tpu_helpers.training.guard import divergence
from tpu_helpers.training.history import RunReport
from tpu_helpers.training.log_window import TakenWindow
from tpu_helpers.training.step import StepFigures
from tpu_helpers.training.step_timing import mfu_inputs


def run(trainer: Any) -> RunReport:
    """Resume (or start), evaluate at step 0, train to config.steps (or a stop), and report."""
    cfg, b = trainer.config, trainer.backend
    trainer.state.resume_or_start()
    start_step, t_start = trainer.step, time.perf_counter()
    if trainer.step == 0 and trainer.val_loader is not None:
        evaluate_and_check(trainer)
    b.reset_metrics()
    bar = tqdm(total=cfg.steps, initial=trainer.step, disable=not (trainer.progress and b.is_main),
               desc="train", unit="step", dynamic_ncols=True)
    trainer.window.reset(trainer.step)
    source = data_batches(trainer)
    batches = trainer.timer.wrap(source)  # step timing: data wait is the time spent in next()
    trainer.model.train()
    for cb in trainer.callbacks:
        cb.on_fit_start(trainer)
    try:
        while trainer.step < cfg.steps and trainer.stop_reason is None:
            one_step(trainer, batches, bar)
    finally:
        # The loader's pass is left mid-epoch: close it now (on XLA its feeder threads and the DataLoader's
        # worker processes stop with it) rather than whenever the generator is collected.
        source.close()
        for loader in (trainer.train_loader, trainer.val_loader):
            release_workers(loader)  # the persistent worker processes, which would outlive the run
    bar.close()
    return report(trainer, start_step, time.perf_counter() - t_start)


def one_step(trainer: Any, batches: Iterator, bar: Any) -> None:
    """The trainer's step and what the cadence asks after it; exactly one sync."""
    b, cadence, window = trainer.backend, trainer.cadence, trainer.window
    trainer.timer.begin()
    window.add(StepFigures.of(trainer.train_step(batches)))
    trainer.step += 1
    if cadence.is_log_step(trainer.step):
        lr = trainer.optimizer.param_groups[0]["lr"]
        b.add_step_closure(log_step, trainer, window.take(), trainer.step, lr, bar)
        trainer.timer.sync(b.sync)
        window.reset(trainer.step)
    else:
        trainer.timer.sync(b.sync)
    bar.update(1)
    if cadence.is_eval_step(trainer.step):
        val = evaluate_and_check(trainer)
        if val is not None:
            bar.set_postfix_str(f"val {val:.3f}", refresh=False)
    for cb in trainer.callbacks:
        cb.on_step_end(trainer)
    if cadence.is_save_step(trainer.step) or trainer.stop_reason is not None:
        trainer.state.save()
    trainer.timer.end()


def log_step(trainer: Any, taken: TakenWindow, step: int, lr: float, bar: Any) -> None:
    """The step closure of a log step, run once its graph executed: the only place the step's figures are read
    on the host. Logs the window's means (a variant's device sums as `trainer.log_figures` turns them into
    values), checks the loss, and tells the callbacks."""
    steps = taken.steps(step)
    seconds = max(time.perf_counter() - taken.started, 1e-9)
    loss, norm, sums, host = taken.read(step, clipped=trainer.config.grad_clip is not None)
    tok_s = steps * trainer.tokens_per_step / seconds
    trainer.history.log_train(step, loss=loss, lr=lr, tokens_per_s=tok_s, grad_norm=norm,
                              **trainer.log_figures(sums, steps), **host)
    check_loss(trainer, step, loss, first_step=taken.first_step)  # nan/inf or a spike: the outcome's policy
    for cb in trainer.callbacks:
        cb.on_log(trainer, trainer.history.train[-1])
    bar.set_postfix_str(f"loss {loss:.3f} | {tok_s:,.0f} tok/s", refresh=False)


def evaluate_and_check(trainer: Any) -> float | None:
    """Evaluate, record the loss and the eval callbacks' metrics, and check the loss for a divergence."""
    trainer.eval_metrics = {}
    val = trainer.evaluate()
    trainer.history.log_eval(trainer.step, val, **trainer.eval_metrics)
    if val is not None:
        check_loss(trainer, trainer.step, val, validation=True)
    return val


def check_loss(trainer: Any, step: int, loss: float, **where: Any) -> None:
    """A loss just recorded in the history: a nan/inf or a spike found in it goes to the run's outcome. Once a
    spike would change nothing (a stop, a warning given, policy "off") the rule is not run."""
    rule = trainer.spike_rule if trainer.outcome.watching("spike") else None
    found = divergence.check_loss(trainer.history, step, loss, spike_rule=rule, **where)
    if found is not None:
        trainer.on_divergence(found.what, kind=found.kind)


def data_batches(trainer: Any) -> Iterator:
    """Endless device batches across epochs; counts what the loop consumed (prefetching runs ahead)."""
    world = trainer.backend.loader_rank_and_world[1]
    while True:
        sampler = getattr(trainer.train_loader, "sampler", None)
        # Position first, then set_epoch: resumed exactly at the end of an epoch, set_epoch(current) makes the
        # sampler yield the (empty) rest of it, so the loop moves to the next epoch with its own counters in step.
        if trainer.samples_in_epoch and hasattr(sampler, "load_state_dict"):
            # Each process's sampler takes every world-th sample of the global order (ResumableSampler).
            sampler.load_state_dict({"epoch": trainer.epoch, "index": trainer.samples_in_epoch // world})
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(trainer.epoch)
        for batch in trainer.backend.wrap_loader(trainer.train_loader):
            trainer.samples_in_epoch += trainer.samples_per_batch
            for cb in trainer.callbacks:
                cb.on_batch(trainer, batch)
            yield batch
        trainer.epoch += 1
        trainer.samples_in_epoch = 0


def report(trainer: Any, start_step: int, seconds: float) -> RunReport:
    """The run's report (run_state.py), with the step timing and MFU; the callbacks' `on_fit_end` see it."""
    report = trainer.state.report(start_step, seconds, step=trainer.step, history=trainer.history,
                                  tokens_per_step=trainer.tokens_per_step)
    trainer.timer.fill_report(report, tokens_per_step=trainer.tokens_per_step,
                              mfu=mfu_inputs(trainer.backend, trainer.raw_model, trainer.config.seq_len))
    for cb in trainer.callbacks:
        cb.on_fit_end(trainer, report)
    return report
