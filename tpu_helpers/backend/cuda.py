"""CUDA backend: one GPU per process, DDP under torchrun, bf16 autocast or fp16 with a GradScaler."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

import torch
import torch.distributed as dist

from tpu_helpers.backend.base import Backend, BackendUnavailable, GenerationHooks, as_is, no_sync
from tpu_helpers.core.hardware import detect_gpu, format_bytes


class CudaBackend(Backend):
    name = "cuda"
    autocast_device_type = "cuda"

    def __init__(self, precision: str = "auto") -> None:
        if not torch.cuda.is_available():
            raise BackendUnavailable(
                "device='cuda' needs a CUDA GPU and a CUDA build of torch; torch.cuda.is_available() is False "
                f"(torch {torch.__version__}). Use device='auto' or 'cpu', or install a CUDA torch wheel."
            )
        self._init_distributed()
        self.device = torch.device("cuda", self.local_rank)
        torch.cuda.set_device(self.device)
        props = torch.cuda.get_device_properties(self.device)
        self.hardware = detect_gpu(props.name, props.total_memory)
        self.precision = self._resolve_precision(precision)
        # fp16 overflows without loss scaling; bf16 has fp32's range and needs none.
        self.scaler = torch.amp.GradScaler("cuda") if self.precision == "fp16" else None
        # TF32 matmuls: free speed on Ampere and later for the fp32 parts of the step.
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    def compile_loop(self):
        return graph_loop(self.device, self.world_size)

    def _dist_backend(self) -> str:
        return "nccl"

    @property
    def loader_options(self) -> dict:
        # Pinned host memory makes the copies to the GPU asynchronous; workers prepare batches while it computes.
        return {"num_workers": min(4, os.cpu_count() or 1), "pin_memory": True}

    def _resolve_precision(self, precision: str) -> str:
        if precision == "auto":
            return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
        if precision == "fp16":
            return "fp16"
        if precision == "bf16" and not torch.cuda.is_bf16_supported():
            raise ValueError(f"precision='bf16' is not supported on {self.hardware.name}; use 'fp16' or 'fp32'")
        return super()._resolve_precision(precision)

    def rng_state(self) -> dict:
        return {**super().rng_state(), "cuda": torch.cuda.get_rng_state(self.device)}

    def set_rng_state(self, state: dict) -> None:
        super().set_rng_state(state)
        if "cuda" in state:
            torch.cuda.set_rng_state(state["cuda"], self.device)

    def manual_seed(self, seed: int) -> None:
        super().manual_seed(seed)
        torch.cuda.manual_seed_all(seed)

    def free_memory(self) -> None:
        super().free_memory()
        torch.cuda.empty_cache()  # hand cached blocks back, so the next try sees the whole GPU

    def memory_info(self) -> dict | None:
        free, total = torch.cuda.mem_get_info(self.device)
        return {
            "bytes_used": total - free,
            "bytes_limit": total,
            "peak_bytes_used": torch.cuda.max_memory_allocated(self.device),
        }

    def status(self) -> str:
        world = f" x{self.world_size}" if self.world_size > 1 else " x1"
        return f"{self.hardware.name}{world}, {format_bytes(self.hardware.hbm_bytes)} HBM/GPU, {self.precision}"


def graph_loop(device: torch.device, world_size: int) -> Callable | None:
    """The decode loop of one CUDA GPU (a `GraphLoop`), or None where the process is one of several: a sharded
    model's forward (FSDP2) all-gathers its weights through collectives that a graph replayed on one process cannot
    take part in."""
    if world_size > 1:
        return None
    from tpu_helpers.backend.cuda_loop import GraphLoop

    return GraphLoop(device)


def generation_hooks(device: torch.device) -> GenerationHooks:
    """`CudaBackend`'s sync, step replay and decode loop for a model on `device`, without a backend object (whose
    construction sets the current device, TF32 and maybe a process group): the world size is the process group's,
    as the backend reads it."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    return GenerationHooks(no_sync, as_is, functools.partial(graph_loop, device, world))
