"""A step captured by `backend.compile_step`, then more graphs than torch_xla's compile cache holds (the caller sets
XLA_COMPILATION_CACHE_SIZE small), then the step again: its graph was evicted; prints the two results."""

import torch

from tests.support import print_result
from tpu_helpers.backend import get_backend

backend = get_backend("xla", spmd=False, compile_cache_dir=None)
device = backend.device


def step(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ x) + 1


replayed = backend.compile_step(step)
x = torch.arange(64, dtype=torch.float32, device=device).reshape(8, 8) / 64
first = replayed(x).sum().item()
for i in range(12):  # other graphs, each of a shape of its own
    (torch.full((1, i + 1), 2.0, device=device) * 3).sum().item()
again = replayed(x).sum().item()
print_result({"first": first, "again": again, "lazy": step(x).sum().item()})
