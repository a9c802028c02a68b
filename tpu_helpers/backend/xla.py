"""XLA backend: TPUs through torch_xla (and XLA:CPU, which runs the same code path without a TPU).

This is the only module in the package that imports torch_xla (with its helpers xla_loop.py and xla_fsdp.py), so a
new torch_xla API changes these files and nothing else (docs/design/torchtpu.md). It does what a hand-written TPU
loop must remember: one `torch_xla.sync()` per optimizer step (one compiled graph, reused), host reads only through
step closures, `MpDeviceLoader` copying the next batches on a background thread, bf16 autocast without a
GradScaler, torch_xla's own gradient checkpointing, and the gradient all-reduce before clipping. The list with
the reasons: docs/guides/speed.md.
"""

from __future__ import annotations

import contextlib
import functools
import os
import pickle
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.debug.metrics as met
import torch_xla.distributed.parallel_loader as pl
import torch_xla.runtime as xr
import torch_xla.utils.checkpoint as xla_checkpoint

from tpu_helpers.backend import runtime_env
from tpu_helpers.backend.base import (
    Backend,
    GenerationHooks,
    ReplayUnsupported,
    as_is,
    first_line,
    tree_map_tensors,
)
from tpu_helpers.backend.xla_fsdp import SpmdSharding, replicated_copy, weights_split
from tpu_helpers.core.hardware import detect_tpu, format_bytes, lookup

# The most of sharded tensors a `to_cpu` gathers in a graph before reading (all of them at once on every chip):
# a step's outputs (a rollout's tokens) fit many times over; a checkpoint's weights do not.
READ_GATHER_BYTES = 64 << 20
_CACHE_INITIALISED: str | None = None  # the directory in use (with its per-process subdirectory)
_CACHE_REQUESTED: str | None = None  # the directory asked for


def active_compile_cache() -> str | None:
    """The directory `initialize_compile_cache` was given in this process, or None when the cache is off."""
    return _CACHE_REQUESTED


def initialize_compile_cache(path: str, *, per_process: bool | None = None, readonly: bool = False) -> str:
    """Turn on the persistent compilation cache; must run before the first XLA computation of the process.

    With several processes on one host (`per_process`, by default detected from the launcher's environment) each
    gets its own subdirectory named by its local rank, stable from run to run (they would otherwise race on the
    same files). Returns the directory used. Calling it again with the same path is a no-op; another path is an
    error, because XLA reads the setting once.
    """
    global _CACHE_INITIALISED, _CACHE_REQUESTED
    requested = os.path.abspath(path)
    if per_process is None:
        per_process = runtime_env.spawned_process() or int(os.environ.get("LOCAL_WORLD_SIZE", "1")) > 1
    if per_process:
        rank = os.environ.get("PJRT_LOCAL_PROCESS_RANK") or os.environ.get("LOCAL_RANK") or f"pid{os.getpid()}"
        path = os.path.join(path, f"process-{rank}")
    if _CACHE_INITIALISED is not None:
        if os.path.abspath(_CACHE_INITIALISED) != os.path.abspath(path):
            raise RuntimeError(
                f"the XLA compile cache is already at {_CACHE_INITIALISED!r} in this process; it cannot move to "
                f"{path!r} (restart the kernel to change it)"
            )
        return path
    os.makedirs(path, exist_ok=True)
    xr.initialize_cache(path, readonly=readonly)
    _CACHE_INITIALISED, _CACHE_REQUESTED = path, requested
    return path


def runtime_started() -> bool:
    """Whether this process's XLA runtime already exists: debug variables and the compile cache are read before
    that, and a process whose runtime runs can no longer spawn one XLA process per chip."""
    try:
        return bool(torch_xla._XLAC._xla_runtime_is_initialized())
    except AttributeError:  # older/newer names: assume started, the safe answer for callers that must refuse
        return True


class XlaBackend(SpmdSharding, Backend):
    name = "xla"
    autocast_device_type = "xla"

    compile_cache_dir: str | None = None  # set by get_backend when it turned the persistent cache on

    # True on every backend, though TPU guides advise False so the first step's graph matches the others: with True
    # the zeroed gradients stay out of every step's graph, which compiles no more graphs, holds less memory and takes
    # less host time per step (benchmarks/zero_grad.py compares the two).
    zero_grad_set_to_none = True

    def __init__(self, precision: str = "auto", *, spmd: bool = False) -> None:
        self.spmd = spmd
        if spmd:
            # Must come before any XLA tensor exists; one process then drives every chip as one virtual device.
            xr.use_spmd()
        self.device = torch_xla.device()
        self.device_type = xr.device_type() or "CPU"
        # Under SPMD a "process" is a host: one on a TPU VM, one per host on a pod slice, each feeding its own
        # chips' share of the batch; host 0 writes checkpoints and results.
        self.world_size = xr.process_count() if spmd else xr.world_size()
        self.rank = xr.process_index() if spmd else xr.global_ordinal()
        self.local_rank = 0 if spmd else xr.local_ordinal()
        self._host_group = False
        self.mesh = None
        self._mesh_captures: set[Callable] = set()  # compile_step's functions replayed over the mesh (after_load)
        if spmd:
            self.set_mesh(xr.global_runtime_device_count(), 1)
        self.hardware = self._detect_hardware()
        self.precision = self._resolve_precision(precision)
        self.scaler = None

    def _detect_hardware(self):
        if self.device_type != "TPU":
            return lookup("cpu")
        kind = os.environ.get("TPU_ACCELERATOR_TYPE", "")
        with contextlib.suppress(Exception):
            kind = xm.xla_device_kind(self.device) or kind
        return detect_tpu(kind)

    @property
    def is_xla(self) -> bool:
        return True

    @property
    def on_tpu(self) -> bool:
        return self.device_type == "TPU"

    @property
    def compiles_graphs(self) -> bool:
        return True

    @property
    def attention_kind(self) -> str:
        # XLA lowers scaled_dot_product_attention to matmul-softmax-matmul: the attention matrix is materialised.
        return "math"

    @property
    def loader_options(self) -> dict:
        # Workers prepare host batches; no pinning: MpDeviceLoader copies them to the device on its own thread.
        return {"num_workers": min(4, os.cpu_count() or 1), "pin_memory": False}

    @property
    def num_replicas(self) -> int:
        return int(self.mesh.size()) if self.mesh is not None else self.world_size

    def _resolve_precision(self, precision: str) -> str:
        if precision == "auto":
            # bf16 is native on the TPU's MXU; XLA:CPU emulates it slowly, so tests default to fp32 there.
            return "bf16" if self.on_tpu else "fp32"
        return super()._resolve_precision(precision)

    # ---- model, data, step (prepare_model, the model's placement for a SHARDING: xla_fsdp) --------------------
    def move_model(self, model: torch.nn.Module) -> torch.nn.Module:
        # Parameters stay replicated under SPMD (pure data parallel); the compiler inserts the all-reduce.
        # Module.to() gives every module slot of a shared (tied) parameter its own new Parameter when moving to XLA
        # (CPU and XLA tensors cannot swap data in place), silently untying e.g. GPT's embedding and lm head: re-tie.
        slots: dict[int, list[tuple[torch.nn.Module, str]]] = {}
        for module in model.modules():
            for name, param in module._parameters.items():
                if param is not None:
                    slots.setdefault(id(param), []).append((module, name))
        model = model.to(self.device)
        for shared in slots.values():
            first = shared[0][0]._parameters[shared[0][1]]
            for module, name in shared[1:]:
                module._parameters[name] = first
        return model

    def wrap_loader(self, loader: Iterable) -> Iterable:
        kwargs = {"input_sharding": self._input_sharding} if self.mesh is not None else {}
        # The loop syncs once per optimizer step itself. MpDeviceLoader would also sync before every batch, cutting a
        # gradient-accumulation step into one graph per micro-batch (an execution and a compile more per step);
        # a batch count it never reaches turns that off.
        return _DeviceLoader(loader, self.device, batches_per_execution=2**62, **kwargs)

    def all_reduce_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        # Under SPMD the compiler already sums gradients over the mesh; across processes we must do it.
        if self.mesh is None and self.world_size > 1:
            xm.reduce_gradients(optimizer)

    def sync(self) -> None:
        torch_xla.sync()

    def compile_step(self, fn: Callable, *, over_mesh: bool = False) -> Callable:
        # Under a mesh only what the caller vouches for (`over_mesh`: the optimizer step, checked against the lazy
        # one over data, fsdp and 2x4 meshes). A forward whose backward is captured gets wrong gradients there:
        # torch_xla 2.9's bridge matches a graph's inputs to the call's tensors by the id their device data records,
        # and over a mesh an input the backward takes straight from the forward (the token ids, an RMSNorm weight)
        # records another tensor's id by then, so it becomes a constant of the capture and later replays reuse the
        # first step's value. Such steps stay lazily traced: correct, slower on the host.
        if self.mesh is None:
            return _compiled(fn)
        if not over_mesh:
            return fn
        self._mesh_captures.add(fn)
        return _compiled(fn)

    def after_load(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        super().after_load(model, optimizer)
        # A checkpoint loaded into a mesh's tensors (and resharded) in a process that already replayed a step over
        # the mesh: the bridge would re-extract that capture over the changed shardings and fail ("buffer ... is
        # deleted"), so each is captured anew, as in a new process.
        for fn in self._mesh_captures:
            torch._dynamo.reset_code(fn.__code__)

    def _assign(self, targets: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        # Each target's value replaced by its value's, no op traced (~3 us a tensor against ~8 for a copy_). XLA
        # tensors are functionalization wrappers: the replacement goes through torch's functionalization (replace,
        # then commit, as AOT autograd writes back a mutated input), so the views a module reads its weight through
        # (`linear`'s transpose, `state_dict`'s detach) follow. torch_xla's `_replace_xla_tensor` swaps the wrapped
        # tensor only: the views of a weight once written in place (a checkpoint's load_state_dict) would keep
        # showing the loaded value. A target or value that is a view, or not a wrapper (functionalization turned off), is copied.
        # The value's own wrapper is taken as it is: `assign`'s values are fresh (a captured step's outputs), never
        # written through a view since (torch._sync would make sure, at ~2.3 us more a tensor, ~2 ms a step).
        for t, v in zip(targets, values, strict=True):
            if not (t._is_view() or v._is_view()) and torch._is_functional_tensor(t) and torch._is_functional_tensor(v):
                torch._functionalize_replace(t, torch._from_functional_tensor(v))
                torch._functionalize_commit_update(t)
            else:
                with torch.no_grad():
                    t.copy_(v)

    def compile_loop(self) -> Callable | None:
        return decode_loop(self.device, split=self.mesh is not None and self.mesh_shape[1] > 1)

    def _hosts_group(self) -> bool:
        """Under SPMD on a pod slice (several hosts): a gloo group over the hosts, found by torch_xla's xla://
        rendezvous, started on first use. False for one process, or one process per chip (xmp.spawn)."""
        if not (self.world_size > 1 and self.spmd):
            return False
        import torch.distributed as dist

        if not self._host_group and not dist.is_initialized():
            import torch_xla.distributed.xla_backend  # noqa: F401  (registers the xla:// init method)

            dist.init_process_group("gloo", init_method="xla://")
        self._host_group = True
        return True

    def barrier(self) -> None:
        if self._hosts_group():
            import torch.distributed as dist

            dist.barrier()
        elif self.world_size > 1:
            xm.rendezvous("tpu_helpers.barrier")

    def gather_objects(self, value: Any) -> list:
        if self._hosts_group():
            return super().gather_objects(value)
        if self.world_size > 1:
            return [pickle.loads(p) for p in xm.rendezvous("tpu_helpers.gather", pickle.dumps(value))]
        return [value]

    def all_reduce_mean(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.mesh is None and self.world_size > 1:
            return xm.all_reduce(xm.REDUCE_SUM, tensor, scale=1.0 / self.world_size)
        return tensor

    def add_step_closure(self, fn: Callable, *args: Any) -> None:
        xm.add_step_closure(fn, args)

    def checkpoint_fn(self) -> Callable:
        return xla_checkpoint.checkpoint

    def to_cpu(self, obj: Any) -> Any:
        # One batched device-to-host transfer for the whole state instead of one per tensor. Over a mesh each sharded
        # tensor is first gathered in a graph (xla_fsdp.replicated_copy: read as it is, it compiles every time),
        # up to READ_GATHER_BYTES a read: a whole checkpoint's sharded weights gathered so in one graph would be the
        # whole model on every chip at once; past the budget torch_xla's own read gathers one tensor at a time.
        if self.mesh is not None:
            left = READ_GATHER_BYTES

            def gathered(t: torch.Tensor) -> torch.Tensor:
                nonlocal left
                size = t.numel() * t.element_size()
                out = replicated_copy(t, self.mesh) if size <= left else t
                if out is not t:  # it was sharded: gathered, and counted against the budget
                    left -= size
                return out

            obj = tree_map_tensors(gathered, obj)
        try:
            return xm._maybe_convert_to_cpu(obj, convert=True)
        except Exception:  # private helper; fall back to per-tensor copies if it moves
            return tree_map_tensors(lambda t: t.detach().cpu(), obj)

    # ---- RNG ----------------------------------------------------------------------------------------------------
    def manual_seed(self, seed: int) -> None:
        super().manual_seed(seed)
        xm.set_rng_state(seed, self.device)

    def rng_state(self) -> dict:
        return {**super().rng_state(), "xla": xm.get_rng_state(self.device)}

    def set_rng_state(self, state: dict) -> None:
        super().set_rng_state(state)
        if "xla" in state:
            xm.set_rng_state(int(state["xla"]), self.device)

    # ---- out of memory ----------------------------------------------------------------------------------------------
    # TPU: "RESOURCE_EXHAUSTED: ... Ran out of memory in memory space hbm" at compile time, a ValueError since 2.8;
    # XLA:CPU: RuntimeError("... Out of memory allocating N bytes."). Both surface at sync() or a host read.
    _OOM_MARKERS = ("RESOURCE_EXHAUSTED", "Out of memory allocating", "Ran out of memory")

    def is_out_of_memory(self, err: BaseException) -> bool:
        if super().is_out_of_memory(err):
            return True
        return isinstance(err, (ValueError, RuntimeError)) and any(m in str(err) for m in self._OOM_MARKERS)

    # ---- reporting ----------------------------------------------------------------------------------------------
    def memory_info(self) -> dict | None:
        try:  # not implemented on XLA:CPU nor on the SPMD virtual device
            info = xm.get_memory_info(self.device)
        except Exception:
            return None
        return {k: info[k] for k in ("bytes_used", "bytes_limit", "peak_bytes_used") if k in info}

    def metrics(self) -> dict:
        return xla_metrics()

    def step_metrics(self) -> dict:
        # Only what the detector compares, read cheaply: executions from the executor's counters, not from the
        # ExecuteTime metric, whose read copies its last 1024 samples (one per step) into Python lists (with the
        # full metrics' other reads, about 0.6 ms of host time per step on XLA:CPU, where a small model's whole step
        # traces in 16 ms).
        return {"compilations": _count("CompileTime"), "device_to_host_transfers": _count("TransferFromDeviceTime"),
                "executions": _executions(), "cpu_fallback_ops": _fallback_ops()}

    def run_metrics(self) -> dict:
        return {**xla_metrics(), "compile_cache_dir": self.compile_cache_dir}

    def reset_metrics(self) -> None:
        met.clear_all()

    def device_seconds(self) -> float | None:
        # The execution time metrics' totals (EXECUTE_METRICS: under SPMD a graph runs through ExecuteReplicated,
        # timed apart; ExecuteTime alone reads 0 there): the time from each graph's launch to its outputs being
        # ready, summed (on XLA:CPU it equals the wait after an asynchronous sync). A graph launched
        # while another still runs counts its time in the queue too: it overstates the device when the device
        # bounds the loop, and when a step is several graphs launched back to back (a replayed step's), which is
        # why StepTimer caps it at the wall time that passed; it is exact for one graph per step when the host
        # bounds it. Its sample lists come with it: read it at log steps and at the end, not every step.
        return sum(float(data[1]) / 1e9 for data in map(met.metric_data, EXECUTE_METRICS) if data)

    def status(self) -> str:
        if not self.on_tpu:
            layout = f" x{self.num_replicas} (SPMD)" if self.mesh is not None else f" x{self.world_size}"
            return f"XLA:{self.device_type}{layout}, {self.precision}"
        mem = self.memory_info()
        hbm = mem["bytes_limit"] if mem and mem.get("bytes_limit") else self.hardware.hbm_bytes
        layout = " (SPMD)" if self.mesh is not None else ""
        return f"{self.hardware.name} x{self.num_replicas}{layout}, {format_bytes(hbm)} HBM/chip, {self.precision}"


def decode_loop(device: torch.device, *, split: bool) -> Callable | None:
    """The device loop for `device` (a `DeviceLoop`), or None where the weights are `split` over the chips. A data
    mesh (replicated weights) loops: the same tokens as the CPU on every family. Over an fsdp axis the partitioner
    gathers every sharded weight whole before the While (a 2-layer Llama on 8 devices: each weight all-gathered in
    the program's entry), so the loop would hold the model whole on each chip, what fsdp is there to avoid: that
    decode stays stepped (tests/models/test_generation_loop.py checks both)."""
    if split:
        return None
    from tpu_helpers.backend.xla_loop import DeviceLoop

    return DeviceLoop(device)


def generation_hooks(device: torch.device, weights: Iterable[torch.Tensor]) -> GenerationHooks:
    """`XlaBackend`'s sync, step replay and decode loop for a model on `device` whose parameters are `weights`, read
    from the running XLA runtime rather than from a backend object: none may exist yet (a model moved to
    `torch_xla.device()` by hand), and a precision view of the backend may hold another mesh than the process's
    backend. Without SPMD they are what every `XlaBackend` gives; under SPMD nothing is captured (as
    `XlaBackend.compile_step` over a mesh) and the decode loops unless the weights themselves are split over the
    chips (`decode_loop`)."""
    if not xr.is_spmd():
        return GenerationHooks(torch_xla.sync, _compiled, functools.partial(decode_loop, device, split=False))
    return GenerationHooks(torch_xla.sync, as_is, functools.partial(decode_loop, device, split=weights_split(weights)))


@functools.cache
def _compiled(fn: Callable) -> Callable:
    """`fn` under dynamo with torch_xla's openxla backend: traced once per guard set (the arguments' shapes, dtypes
    and Python values), its XLA graph then replayed with each call's tensors, no lazy tracing. One wrapper per
    function (dynamo keeps the captures on the function's code; this keeps the recompile limit counting one
    function). dynamic=False: a new shape captures a new static graph, never a symbolic one XLA would compile per
    size anyway. fullgraph=True: a graph break would run the pieces between captures as Python and re-check their
    guards, so a step that cannot be captured whole raises `ReplayUnsupported` (at tracing, before it ran)."""
    import torch._dynamo

    # Each (shape, sampling) of a decode step is one capture: room for a few models and shapes before dynamo falls
    # back to running the Python (its default limit is 8 per function).
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    compiled = torch.compile(fn, backend="openxla", dynamic=False, fullgraph=True)

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return compiled(*args, **kwargs)
        except torch._dynamo.exc.TorchDynamoException as err:
            first = first_line(err)
            raise ReplayUnsupported(f"{getattr(fn, '__qualname__', fn)} cannot be captured whole: {first}") from err
        except RuntimeError as err:
            # torch_xla keeps compiled graphs in an LRU cache (XLA_COMPILATION_CACHE_SIZE, 2048 by default), but a
            # capture replays its graph by hash: once evicted (a long session, thousands of other graphs), every call
            # would fail. It is raised before the graph runs, so capture anew and run.
            if "kicked out of the LRU cache" not in str(err):
                raise
            torch._dynamo.reset_code(fn.__code__)
            return compiled(*args, **kwargs)

    return run


# A graph's run is timed and counted under one name on one device and under another over an SPMD mesh.
EXECUTE_METRICS = ("ExecuteTime", "ExecuteReplicatedTime")
EXECUTE_COUNTERS = ("ExecuteComputation", "ExecuteReplicated")


def _executions() -> int:
    """The graphs torch_xla's graph executor ran (the lazily traced ones), from its counters: the timing metrics
    count more (dynamo's replays and torch_xla's own gathers of sharded reads are timed, not counted) but come
    with their sample lists, too costly to read after every step."""
    return sum(int(met.counter_value(name) or 0) for name in EXECUTE_COUNTERS)


def xla_metrics() -> dict:
    """The counters that tell whether a loop is XLA-clean: compilations, host transfers, CPU fallbacks."""
    compile_data = met.metric_data("CompileTime")
    transfer_data = met.metric_data("TransferFromDeviceTime")
    return {
        "compilations": int(compile_data[0]) if compile_data else 0,
        "compile_seconds": float(compile_data[1]) / 1e9 if compile_data else 0.0,
        "uncached_compiles": int(met.counter_value("UncachedCompile") or 0),
        "cached_compiles": int(met.counter_value("CachedCompile") or 0),
        "device_to_host_transfers": int(transfer_data[0]) if transfer_data else 0,
        "executions": _executions(),  # lazy graphs run (one per step is the goal)
        "cpu_fallback_ops": _fallback_ops(),
        "persistent_cache_hits": int(met.counter_value("PersistentCacheHit") or 0),
        "persistent_cache_misses": int(met.counter_value("PersistentCacheMiss") or 0),
        "persistent_cache_deserialize_failures": int(met.counter_value("PersistentCacheDeserializeFailure") or 0),
    }


def _count(metric: str) -> int:
    """How many samples `metric` has had (CompileTime, TransferFromDeviceTime: few per run, so the sample list that
    comes with the count is short)."""
    data = met.metric_data(metric)
    return int(data[0]) if data else 0


def _fallback_ops() -> dict[str, int]:
    """{op: calls} of ops that ran on the CPU for lack of an XLA kernel (torch_xla's list of executed fallbacks,
    cleared with the counters). aten::_local_scalar_dense is .item() itself (counted as a transfer), not a missing
    kernel."""
    calls = {name: int(met.counter_value(name) or 0) for name in met.executed_fallback_ops()
             if name != "aten::_local_scalar_dense"}
    return {name: n for name, n in calls.items() if n}


def spawn(fn: Callable, args: tuple = (), *, nprocs: int | None = None, start_method: str = "fork") -> None:
    """Run `fn(index, *args)` in one process per chip with `xmp.spawn` (the multi-process alternative to SPMD).

    `fn` must be importable from a module (a notebook's own functions do not pickle into new processes), and the
    calling process must not have touched the XLA device yet. "fork" is the start method that works inside
    Jupyter. torch_xla accepts nprocs 1 (run `fn` here, in this process) or None (every local chip).
    """
    import torch_xla.distributed.xla_multiprocessing as xmp

    if nprocs not in (1, None):
        raise ValueError(f"nprocs={nprocs!r}: torch_xla spawns either 1 process or one per chip (None); to use "
                         "fewer chips set TPU_NUM_DEVICES (CPU_NUM_DEVICES on XLA:CPU) before starting Python")
    if start_method not in ("fork", "spawn", "forkserver"):
        raise ValueError(f"start_method={start_method!r} is not one of 'fork', 'spawn', 'forkserver'")
    if runtime_started() and nprocs != 1:
        raise RuntimeError(
            "the XLA runtime is already running in this process, so torch_xla cannot spawn one process per chip; "
            "restart the kernel and spawn before anything touches the XLA device (or use SPMD in this process)"
        )
    xmp.spawn(fn, args=args, nprocs=nprocs, start_method=start_method)


class _DeviceLoader:
    """`MpDeviceLoader` that stops its threads when its consumer does. MpDeviceLoader closes a pass's
    `ParallelLoader` only when the next pass begins, so the last pass of a run, left mid-epoch when the step budget
    ends, kept its two feeder threads blocked on a full queue for the rest of the process, and with them the
    DataLoader and its persistent worker processes (a test session piled up over 100 threads and dozens of workers).
    Here a pass is a generator that closes its ParallelLoader when it ends, is closed, or is collected."""

    def __init__(self, loader: Iterable, device: torch.device, **kwargs) -> None:
        self.loader, self.device, self.kwargs = loader, device, kwargs

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator:
        parallel = pl.ParallelLoader(self.loader, [self.device], **self.kwargs)
        try:
            yield from parallel.per_device_loader(self.device)
        finally:
            parallel.close()  # wakes both threads (their queues closed) and joins them
