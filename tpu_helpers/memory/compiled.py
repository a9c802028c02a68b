"""Compiled memory estimate: the memory XLA itself reports for the compiled training-step graph.

XLA reads ``XLA_FLAGS`` once, when its runtime starts, so the step runs in a fresh interpreter with
``--xla_dump_to=DIR`` and the largest ``*memory-usage-report.txt`` (the steady-state step) is parsed back here.
``PJRT_DEVICE=CPU`` by default: XLA:CPU compiles the same graph a TPU would get. Run it before this process holds a
TPU, or keep the CPU default::

    from tpu_helpers.memory.compiled import compiled_estimate
    est = compiled_estimate("mini", batch_size=8, seq_len=256)       # GPT preset, name, GPTConfig or dict of sizes
    est = compiled_estimate("mymodels:make_cnn", batch_size=32, batch_fn="mymodels:cnn_batch")   # any module

How the figure differs from the eager one, and what XLA:CPU does with checkpointing, accumulation and bf16:
docs/guides/memory.md. ``python -m tpu_helpers.memory.compiled SPEC_JSON`` is the subprocess entry point.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

from tpu_helpers.backend import runtime_env
from tpu_helpers.core.choices import OPTIMIZERS, check_choice, check_positive
from tpu_helpers.memory.analytic import memory_layout, resolve_config
from tpu_helpers.memory.report import MemoryEstimate

_TOTAL = re.compile(r"Total bytes used:\s*(\d+)")


def _package_parent() -> str:
    # The directory this tpu_helpers was imported from (a checkout, site-packages, a pip --target folder): the
    # subprocess must import the same copy, whatever its working directory.
    import tpu_helpers

    return str(Path(tpu_helpers.__file__).resolve().parent.parent)


def child_env(pjrt_device: str, dump_dir: str) -> dict[str, str]:
    """The environment of the compile subprocess: XLA dumps into `dump_dir` on one `pjrt_device` device, and
    this package importable."""
    env = runtime_env.dump_env(dump_dir, pjrt=pjrt_device, memory_scheduler=True)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_package_parent(), os.environ.get("PYTHONPATH", "")) if p)
    return env


def parse_memory_reports(dump_dir: str | os.PathLike) -> dict[str, int]:
    """``{file name: total bytes}`` for every ``*memory-usage-report.txt`` XLA wrote into ``dump_dir``."""
    out = {}
    for path in sorted(glob.glob(os.path.join(os.fspath(dump_dir), "*memory-usage-report.txt"))):
        m = _TOTAL.search(Path(path).read_text(errors="replace"))
        if m:
            out[os.path.basename(path)] = int(m.group(1))
    return out


def count_hlo_ops(dump_dir: str | os.PathLike, report_name: str, op: str = "opt-barrier") -> int:
    """How many ``op`` instructions the HLO of the program of ``report_name`` has before XLA's optimisations."""
    prefix = report_name.split(".cpu_after_optimizations")[0].split("-memory-usage-report")[0]
    paths = glob.glob(os.path.join(os.fspath(dump_dir), prefix + "*before_optimizations.txt"))
    return sum(Path(p).read_text(errors="replace").count(f" {op}(") for p in paths)


def _import(ref: str):
    module, _, name = ref.partition(":")
    if not module or not name:
        raise ValueError(f"expected 'module:function', got {ref!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


def compiled_estimate(
    model: str | object,
    batch_size: int,
    seq_len: int | None = None,
    *,
    batch_fn: str | None = None,
    loss_fn: str | None = None,
    precision: str = "fp32",
    pure_bf16: bool = False,
    optimizer: str = "adamw",
    grad_accum: int = 1,
    gradient_checkpointing: bool = False,
    pjrt_device: str = "CPU",
    timeout: int = 600,
) -> MemoryEstimate:
    """Compile two of the trainer's training steps in a fresh process and return XLA's figure for the larger
    program.

    ``model``: a GPT preset name, GPTConfig or dict of sizes (``seq_len`` then applies), or ``"module:function"``
    building any ``nn.Module`` with ``batch_fn="module:function"`` returning the batch for a batch size, and
    optionally ``loss_fn="module:function"`` (the trainer's ``loss_fn(output, targets)``; without one, the model's
    own loss, as the trainer does). The step is `Trainer.train_step` (`traced.step_trainer`); gradient
    checkpointing goes through the trainer too (the GPT's setter, or a Hugging Face model's own hook).
    ``grad_accum``: micro-batches of ``batch_size`` per optimizer step, as ``TrainConfig.grad_accum`` (the trainer's
    step runs them all in one graph, so the figure holds the earlier micro-batches' gradients while the next one
    runs, as the traced and analytic estimates count them).
    """
    check_positive("batch_size", batch_size)
    check_positive("grad_accum", grad_accum)
    check_choice("optimizer", optimizer, OPTIMIZERS)
    # fp16 autocast keeps the bytes of bf16 autocast, and XLA has only the latter.
    run_precision = "fp32" if memory_layout(precision, pure_bf16) == "fp32" else "bf16"
    spec: dict = {"batch_size": batch_size, "precision": run_precision, "pure_bf16": pure_bf16,
                  "optimizer": optimizer, "grad_accum": grad_accum, "gradient_checkpointing": gradient_checkpointing}
    if isinstance(model, str) and ":" in model:
        if batch_fn is None:
            raise ValueError(f"model={model!r} is a factory; pass batch_fn='module:function' too")
        spec.update(factory=model, batch_fn=batch_fn, loss_fn=loss_fn)
    else:
        cfg = resolve_config(model)  # type: ignore[arg-type]
        s = cfg.block_size if seq_len is None else seq_len
        check_positive("seq_len", s)
        spec.update(gpt=asdict(cfg), seq_len=s)
    dump = tempfile.mkdtemp(prefix="tpu_helpers_xla_dump_")
    try:
        env = child_env(pjrt_device, dump)
        proc = subprocess.run([sys.executable, "-m", "tpu_helpers.memory.compiled", json.dumps(spec)], env=env,
                              capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"the compile subprocess failed ({proc.returncode}): {proc.stderr[-2000:]}")
        child = json.loads(proc.stdout.strip().splitlines()[-1])
        totals = parse_memory_reports(dump)
        largest = max(totals, key=totals.get) if totals else None
        barriers = count_hlo_ops(dump, largest) if largest else 0
    finally:
        shutil.rmtree(dump, ignore_errors=True)
    if not totals:
        raise RuntimeError(f"XLA wrote no memory-usage report into {dump} (does this torch_xla's XLA honour "
                           f"{runtime_env.XLA_FLAGS}={runtime_env.dump_dir_flags(dump)!r}?)")
    peak = max(totals.values())
    state = {k: child[k] for k in ("params", "grads", "optimizer")}
    return MemoryEstimate.from_categories(
        "compiled", batch_size, total=peak, temporaries=max(0, peak - sum(state.values())), **state,
        notes=[f"{len(totals)} XLA programs; largest {peak} bytes", f"compilations: {child['compilations']}",
               f"opt-barriers: {barriers}", f"grad_accum: {grad_accum}"])


def _child(spec: dict) -> dict:
    import itertools

    import torch

    from tpu_helpers.backend import get_backend
    from tpu_helpers.memory.traced import step_trainer

    backend = get_backend("xla", spmd=False, precision=spec["precision"])
    if "gpt" in spec:
        from tpu_helpers.memory.traced import gpt_batch
        from tpu_helpers.models.gpt import GPT, GPTConfig

        cfg = GPTConfig(**spec["gpt"])
        model = GPT(cfg)
        make_batch = gpt_batch(spec["seq_len"], cfg.vocab_size)
    else:
        model = _import(spec["factory"])()
        make_batch = _import(spec["batch_fn"])
    loss_fn = _import(spec["loss_fn"]) if spec.get("loss_fn") else None
    if spec["pure_bf16"]:
        model = model.to(torch.bfloat16)
    accum = spec.get("grad_accum", 1)
    trainer = step_trainer(model, backend, precision=spec["precision"], optimizer=spec["optimizer"],
                           grad_accum=accum, gradient_checkpointing=spec["gradient_checkpointing"], loss_fn=loss_fn)
    # One device batch per micro-batch, as training feeds: given the same device tensors twice, XLA would see two
    # identical forward and backward passes in the step's graph and compute them once (common subexpressions), and
    # the figure would be grad_accum=1's.
    micro = [backend.to_device(make_batch(spec["batch_size"])) for _ in range(accum)]
    for _ in range(2):  # train_step takes grad_accum micro-batches from the iterator
        trainer.train_step(itertools.cycle(micro))
        backend.sync()
    params = list(trainer.model.parameters())
    sizes = {"params": sum(p.numel() * p.element_size() for p in params),
             "grads": sum(p.numel() * p.element_size() for p in params if p.requires_grad)}
    sizes["optimizer"] = sum(t.numel() * t.element_size() for st in trainer.optimizer.state.values()
                             for t in st.values() if isinstance(t, torch.Tensor))
    return {**sizes, "compilations": backend.metrics().get("compilations", 0)}


if __name__ == "__main__":
    print(json.dumps(_child(json.loads(sys.argv[1]))))
