"""The backend interface and its CPU implementation.

A `Backend` gives a training loop everything that differs between TPU, GPU and CPU: the device, rank and world
size, mixed precision, placing the model for a SHARDING (`prepare_model`, from `torch_distributed`), the optimizer
step (with gradient all-reduce and clipping), the per-step sync, loader settings and wrapping, gradient
checkpointing, memory figures, run counters and the hardware description. The loop in
`tpu_helpers.training.trainer` only talks to this interface, so the same code runs everywhere: code outside
`backend/` asks these methods and properties instead of comparing device names, and every attribute a caller reads
is declared here (a test checks). `CudaBackend` and `XlaBackend` override the parts that differ; this class is also
the CPU backend (optionally multi-process through torchrun and gloo).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import io
import os
import random
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.utils.checkpoint

from tpu_helpers.backend.torch_distributed import TorchSharding
from tpu_helpers.core.choices import PRECISIONS
from tpu_helpers.core.hardware import HardwareSpec, lookup


class BackendUnavailable(RuntimeError):
    """The requested device cannot be used here; the message says what is missing and how to fix it."""


class ReplayUnsupported(RuntimeError):
    """`compile_step`'s function could not be captured whole (a graph break); nothing of it ran. The caller runs
    the step as plain Python instead (lazily traced on XLA)."""


def first_line(err: BaseException) -> str:
    """An error's first line, for a message that names it (its type's name when it says nothing)."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


@dataclass(frozen=True)
class GenerationHooks:
    """What generation asks of the backend that owns a model's device (`tpu_helpers.backend.generation_hooks`):
    the backend's `sync`, `compile_step` and `compile_loop`, as a backend object gives them."""

    sync: Callable[[], None]
    compile_step: Callable[[Callable], Callable]
    compile_loop: Callable[[], Callable | None]


def as_is(fn: Callable, **_: Any) -> Callable:
    """`fn` itself: the step replay of a backend that captures nothing (its Python is the compute, or launches it)."""
    return fn


def no_sync() -> None:
    """The sync of an eager backend: its ops have run already."""


def tree_map_tensors(fn: Callable[[torch.Tensor], Any], obj: Any) -> Any:
    """Apply `fn` to every tensor in nested dicts/lists/tuples (optimizer states, batches)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: tree_map_tensors(fn, v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        mapped = [tree_map_tensors(fn, v) for v in obj]
        return type(obj)(mapped) if not hasattr(obj, "_fields") else type(obj)(*mapped)
    return obj


class Backend(TorchSharding):
    """CPU backend and the interface every backend implements."""

    name = "cpu"
    autocast_device_type = "cpu"
    spmd = False  # XLA: one process drives every local chip as one program
    mesh: Any = None  # XLA SPMD: the (data, fsdp) device mesh
    compile_cache_dir: str | None = None  # XLA: the persistent compile cache this process uses, if any

    def __init__(self, precision: str = "auto") -> None:
        self.device = torch.device("cpu")
        self._init_distributed()
        self.precision = self._resolve_precision(precision)
        self.hardware: HardwareSpec = lookup("cpu")
        self.scaler: torch.amp.GradScaler | None = None

    # ---- topology -------------------------------------------------------------------------------------------
    def _init_distributed(self) -> None:
        # torchrun sets WORLD_SIZE/RANK; a plain process is a world of one.
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world > 1 and not dist.is_initialized():
            dist.init_process_group(backend=self._dist_backend())
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))

    def _dist_backend(self) -> str:
        return "gloo"

    @property
    def is_xla(self) -> bool:
        """Whether this is torch_xla's backend. Callers outside `backend/` ask the capability they need instead
        (`compiles_graphs`, `loader_options`, `attention_kind`, ...)."""
        return False

    @property
    def on_tpu(self) -> bool:
        """Whether the device is a real TPU chip (not XLA:CPU, a GPU or the CPU)."""
        return False

    @property
    def compiles_graphs(self) -> bool:
        """Whether each step is traced into a graph that is compiled and re-used (XLA): what the recompilation
        and host-read detector watches. False for eager backends."""
        return False

    @property
    def attention_kind(self) -> str:
        """How scaled_dot_product_attention runs here: "flash" (a fused kernel that keeps no s x s matrix: CUDA,
        the CPU) or "math" (matmul-softmax-matmul with the attention matrix materialised: XLA's lowering)."""
        return "flash"

    @property
    def loader_options(self) -> dict:
        """DataLoader settings for this device: `make_loader(..., **backend.loader_options)`. The CPU loads in the
        main process (workers would only compete with the compute)."""
        return {"num_workers": 0, "pin_memory": False}

    @property
    def runs_on_host(self) -> bool:
        """Whether the model's tensors live in this process's own memory (the eager CPU backend, not XLA:CPU)."""
        return self.device.type == "cpu"

    @property
    def peak_tflops(self) -> float | None:
        """The chip's dense bf16 peak from the hardware catalog, for MFU; None on the CPU (no meaningful peak)."""
        hw = self.hardware
        return hw.bf16_tflops if hw is not None and hw.kind in ("tpu", "gpu") else None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def num_replicas(self) -> int:
        """How many ways each optimizer step's global batch is split (processes, or chips under SPMD)."""
        return self.world_size

    @property
    def loader_rank_and_world(self) -> tuple[int, int]:
        """Which shard of the data this process reads; SPMD reads the whole global batch in one process."""
        return self.rank, self.world_size

    # ---- precision ------------------------------------------------------------------------------------------
    def _resolve_precision(self, precision: str) -> str:
        if precision not in PRECISIONS:
            raise ValueError(f"precision={precision!r} is not one of {PRECISIONS}")
        if precision == "auto":
            return "fp32"
        if precision == "fp16":
            raise ValueError("precision='fp16' needs a CUDA GPU (it relies on a GradScaler); use 'bf16' or 'fp32'")
        return precision

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.precision == "fp32":
            return contextlib.nullcontext()
        dtype = torch.bfloat16 if self.precision == "bf16" else torch.float16
        return torch.autocast(self.autocast_device_type, dtype=dtype)

    # ---- data, step (the model's placement: torch_distributed.TorchSharding.prepare_model) ------------------------
    def to_device(self, batch: Any) -> Any:
        return tree_map_tensors(lambda t: t.to(self.device, non_blocking=True), batch)

    def wrap_loader(self, loader: Iterable) -> Iterable:
        """Yield batches already on the device (XLA overlaps the transfer with compute on a thread)."""
        return _DeviceIterable(loader, self.to_device)

    zero_grad_set_to_none = True  # drop the gradient tensors between steps (frees their memory until backward)

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.zero_grad(set_to_none=self.zero_grad_set_to_none)

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def all_reduce_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """Average gradients over processes. DDP already does it during backward, so this is a no-op here."""

    def optimizer_step(
        self, optimizer: torch.optim.Optimizer, *, clip_norm: float | None = None
    ) -> torch.Tensor | None:
        """All-reduce, unscale, clip and step. Returns the gradient norm as a device tensor (never read here)."""
        self.all_reduce_gradients(optimizer)
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)
        norm = None
        if clip_norm is not None:
            params = [p for group in optimizer.param_groups for p in group["params"]]
            norm = torch.nn.utils.clip_grad_norm_(params, clip_norm)
            if hasattr(norm, "full_tensor"):  # FSDP2: a DTensor; the loop stacks it with plain tensors
                norm = norm.full_tensor()
        if self.scaler is not None:
            self.scaler.step(optimizer)
            self.scaler.update()
        else:
            optimizer.step()
        return norm

    def sync(self) -> None:
        """End of an optimizer step: on XLA this cuts and launches the graph; eager backends need nothing."""

    def compile_step(self, fn: Callable, *, over_mesh: bool = False) -> Callable:
        """`fn` captured once per shape and replayed without re-running its Python (XLA: dynamo's openxla
        backend), for a step whose tracing costs more host time than the device spends on it (a decode step). Eager
        backends run `fn` as it is: their Python is the compute itself (CPU) or only launches kernels (CUDA).
        The capture is whole or nothing: what cannot be captured raises `ReplayUnsupported` before anything ran.
        Under an XLA SPMD mesh `fn` runs as it is unless `over_mesh` says its replay over sharded tensors is
        checked against the lazy step (the optimizer's: tests/training/test_sharding.py)."""
        return fn

    def assign(self, targets: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """Each of `targets` takes the value of the tensor at the same place in `values` (same shape and dtype), in
        place: an optimizer's parameters and moments their updated values. `values` are fresh tensors (a captured
        step's outputs), not written through a view of theirs since they were made. Eager backends copy (one foreach
        op); XLA replaces each target's value through torch's functionalization, no op traced, the target's views
        following."""
        if len(targets) != len(values):
            raise ValueError(f"assign: {len(targets)} targets for {len(values)} values")
        if [(t.shape, t.dtype) for t in targets] != [(v.shape, v.dtype) for v in values]:  # one compare: ~1,000 a step
            i, t, v = next((i, t, v) for i, (t, v) in enumerate(zip(targets, values, strict=True))
                           if t.shape != v.shape or t.dtype != v.dtype)
            raise ValueError(f"assign: targets[{i}] is {tuple(t.shape)} {t.dtype}, its value {tuple(v.shape)} "
                             f"{v.dtype}")
        self._assign(targets, values)

    def _assign(self, targets: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        with torch.no_grad():
            torch._foreach_copy_(targets, values)

    def compile_loop(self) -> Callable | None:
        """A runner `loop(step, carry, steps, key, outside)` that runs `carry = step(carry)` `steps` times on the
        device as one program, traced or captured once per shape and `key` and kept (XLA: a `While` op,
        backend/xla_loop.py; one CUDA GPU: a CUDA graph replayed per step, backend/cuda_loop.py), so a long loop of
        small steps (generation's decode) costs the host one call, or one launch per step. None where there is none:
        the CPU, whose Python loop is the compute itself."""
        return None

    def barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier()

    def gather_objects(self, value: Any) -> list:
        """`value` from every process of the run, by process index (also a barrier); [value] alone. For the few
        host-side decisions all processes must share (which checkpoint to resume, whether a save worked): one
        process deciding alone leaves the others waiting at the next collective for ever."""
        if dist.is_initialized() and dist.get_world_size() > 1:
            values: list = [None] * dist.get_world_size()
            dist.all_gather_object(values, value)
            return values
        return [value]

    def all_reduce_mean(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            tensor = tensor.clone()
            dist.all_reduce(tensor)
            tensor /= self.world_size
        return tensor

    def add_step_closure(self, fn: Callable, *args: Any) -> None:
        """Run `fn(*args)` once the step's values exist; eager backends have them already."""
        fn(*args)

    def checkpoint_fn(self) -> Callable:
        """Gradient checkpointing for this backend (torch's, non-reentrant)."""
        return functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)

    def to_cpu(self, obj: Any) -> Any:
        return tree_map_tensors(lambda t: t.detach().cpu(), obj)

    def save(self, obj: Any, path: str | os.PathLike) -> None:
        """Write `obj` once (main process only), tensors moved to the CPU first, atomically; all ranks wait."""
        from tpu_helpers.core.atomic_io import atomic_write_bytes

        cpu_obj = self.to_cpu(obj)  # every rank takes part: on XLA this is a collective-free device read
        if self.is_main:
            buffer = io.BytesIO()
            torch.save(cpu_obj, buffer)
            atomic_write_bytes(path, buffer.getvalue())
        self.barrier()

    # ---- RNG (exact resume) --------------------------------------------------------------------------------
    def manual_seed(self, seed: int) -> None:
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.manual_seed(seed)

    def rng_state(self) -> dict:
        return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}

    def set_rng_state(self, state: dict) -> None:
        # Tuples come back as lists from XLA's batched to_cpu (xm._maybe_convert_to_cpu): restore them.
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
        np.random.set_state(tuple(state["numpy"]))
        torch.set_rng_state(state["torch"])

    # ---- out of memory (the batch-size probe) ---------------------------------------------------------------------
    def is_out_of_memory(self, err: BaseException) -> bool:
        """Whether `err` means the step did not fit in device memory (the probe's signal to try a smaller batch)."""
        return isinstance(err, (torch.OutOfMemoryError, MemoryError))

    def free_memory(self) -> None:
        """Return what a failed or finished attempt left behind, so the next one starts clean."""
        gc.collect()

    # ---- reporting --------------------------------------------------------------------------------------------
    def memory_info(self) -> dict | None:
        """`{"bytes_used", "bytes_limit", "peak_bytes_used"}` where the backend can tell, else None."""
        return None

    def metrics(self) -> dict:
        """Backend counters (XLA: compilations, host transfers, CPU fallbacks); {} where there are none."""
        return {}

    def step_metrics(self) -> dict:
        """The counters read after every step (by the XLA detector, whose reading the trackers log): "compilations",
        "device_to_host_transfers", "executions" and "cpu_fallback_ops", and nothing that costs more to read; {}
        where there are none."""
        return {}

    def run_metrics(self) -> dict:
        """What the run report records of this backend: `metrics()` and the compile cache used ({} on eager
        backends)."""
        return {}

    def reset_metrics(self) -> None:
        pass

    def device_seconds(self) -> float | None:
        """Seconds the device has spent running graphs since `reset_metrics` (XLA: the runtime's execution time,
        read without a sync), for host-versus-device time per step; None where it cannot be told apart from the
        host's time without waiting (the CPU runs the step in the host's own thread; CUDA would need events)."""
        return None

    def status(self) -> str:
        cores = os.cpu_count() or 1
        world = f" x{self.world_size} processes" if self.world_size > 1 else ""
        return f"CPU ({cores} cores){world}, {self.precision}"

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.status()}>"


class _DeviceIterable:
    """Wrap a loader so iteration yields device batches and `len()` still works for progress bars."""

    def __init__(self, loader: Iterable, to_device: Callable) -> None:
        self.loader, self._to_device = loader, to_device

    def __iter__(self) -> Iterator:
        for batch in self.loader:
            yield self._to_device(batch)

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]


def warn_fallback(requested: str, reason: str, chosen: str) -> None:
    warnings.warn(f"device={requested!r} is not available ({reason}); falling back to {chosen!r}", stacklevel=3)
