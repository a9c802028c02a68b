"""The batch-size probe on XLA:CPU under a real memory limit (RLIMIT_AS): the XLA allocator fails past it ("Out of
memory allocating N bytes") and the probe recovers (tests/memory/test_memory.py). In its own process: the limit
holds for the whole process.

    python tests/scripts/probe_under_rlimit.py
"""

from __future__ import annotations

import itertools
import resource

import torch

from tests.support import print_result
from tpu_helpers.backend import get_backend
from tpu_helpers.memory import gpt_batch, probe_batch_size, step_trainer
from tpu_helpers.models.gpt import GPT, gpt_config


def main() -> None:
    backend = get_backend("xla", spmd=False)
    trainer = step_trainer(GPT(gpt_config("tiny")), backend, precision=backend.precision)
    batches = gpt_batch(64, 256)
    trainer.train_step(itertools.repeat(backend.to_device(batches(4))))
    backend.sync()
    before = {k: v.cpu().clone() for k, v in trainer.model.state_dict().items()}
    vm = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmSize"))
    # A real limit: the XLA:CPU allocator fails ("Out of memory allocating N bytes") past 1 GiB more address space.
    # Batch 512 is at that edge (it fits alone, and failed once in CI beside other work): 6 tries reach down to 128.
    resource.setrlimit(resource.RLIMIT_AS, (vm + 2**30, resource.RLIM_INFINITY))
    result = probe_batch_size(trainer, batches, start=4096, max_tries=6)
    same = all(torch.equal(before[k], v.cpu()) for k, v in trainer.model.state_dict().items())
    loss, _ = trainer.train_step(itertools.repeat(backend.to_device(batches(4))))
    backend.sync()
    print_result({**result.to_dict(), "same": same, "loss": loss.cpu().item()})


if __name__ == "__main__":
    main()
