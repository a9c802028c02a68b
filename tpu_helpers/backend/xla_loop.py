"""A step function run N times as one XLA `While` op: traced once per shape, the built program kept and called again
with each call's tensors, so a loop of N steps costs the host one call, not N traces (what generation's decode
loop needs on a TPU: `Backend.compile_loop`, used by models/replay.py's `looped_steps`).

    loop = backend.compile_loop()                      # a DeviceLoop on XLA (one device), None elsewhere
    carry = loop(step, carry, steps=255, key=("decode", width))

`step(carry) -> carry` takes and returns a list of tensors of the same shapes and dtypes; whatever else it reads on
the device is baked into the kept program as it was at the trace, so a model's weights go in the carry and `key`
names every Python value the trace depends on. A step that reads a value on the host, torch's RNG, an `outside`
tensor or too much from outside its carry is refused with `ReplayUnsupported` before anything runs. The contract in
full and how the `While` is built: docs/design/device_loops.md.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import torch
import torch_xla
import torch_xla.core.xla_builder as xb

from tpu_helpers.backend.base import ReplayUnsupported, first_line

# More than this of device tensors read from outside the carry is taken for state the caller forgot to pass (a
# weight), which the kept program would keep reading as it was at the trace.
MAX_BAKED_BYTES = 1 << 20


@dataclass
class _Built:
    computation: object  # the While program
    baked: list[torch.Tensor]  # device tensors the step made or read besides its carry, passed on every call


class DeviceLoop:
    """Runs `step` `steps` times on the device as one While op (see the module docstring); one per owner (a model),
    so its programs and the tensors they keep go with it."""

    def __init__(self, device: torch.device):
        self.device = device
        self._built: dict[Hashable, _Built] = {}
        self._refused: dict[Hashable, str] = {}  # keys whose step could not be looped, and why (not tried again)

    def __call__(self, step: Callable[[list[torch.Tensor]], Sequence[torch.Tensor]], carry: Sequence[torch.Tensor],
                 steps: int, key: Hashable, outside: Sequence[torch.Tensor] = ()) -> list[torch.Tensor]:
        """`carry` after `steps` runs of `step` (see the module docstring). `outside`: the caller's own state
        tensors in the carry, which the step must read only through its carry (a model's weights and its kept
        cache, swapped for carry tensors while it is traced): a step whose program would read one of them as it was
        at the trace is refused."""
        carry = list(carry)
        # Booleans travel as int8: XLA's lowering may hand a predicate back as another integer type, and the While
        # needs the body's outputs typed exactly as its inputs.
        kinds = tuple(t.dtype for t in carry)
        loop_carry = [t.to(torch.int8) if t.dtype == torch.bool else t for t in carry]
        full_key = (key, tuple((tuple(t.shape), t.dtype) for t in carry))
        if full_key in self._refused:
            raise ReplayUnsupported(self._refused[full_key])
        built = self._built.get(full_key)
        if built is None:
            try:
                built = _build(_typed(step, kinds), loop_carry, outside)
            except ReplayUnsupported as err:
                self._refused[full_key] = str(err)
                raise
            except (AttributeError, RuntimeError, TypeError, ValueError) as err:
                # torch_xla's lowering API is not a public one (another release may differ): a loop it cannot
                # build is stepped otherwise, not a failed run (a fault of the step's own code shows there).
                first = first_line(err)
                self._refused[full_key] = f"torch_xla could not build the loop ({type(err).__name__}: {first})"
                raise ReplayUnsupported(self._refused[full_key]) from err
            self._built[full_key] = built
        counter = torch.zeros((), dtype=torch.long).to(self.device)
        # Shape (1,), not a scalar: torch_xla bakes a scalar 0 or 1 into the graph as a constant (a new graph).
        limit = torch.tensor([int(steps)], dtype=torch.long).to(self.device)
        out = torch_xla._XLAC._xla_user_computation("xla::tpu_helpers_loop", [counter, limit, *loop_carry,
                                                                              *built.baked], built.computation)
        result = list(out[2:2 + len(carry)])
        return [t.to(torch.bool) if kind == torch.bool else t for t, kind in zip(result, kinds, strict=True)]


def _typed(step: Callable, kinds: tuple) -> Callable:
    """`step` on the loop's carry: booleans come in as int8 and go back out as int8; any other output must keep its
    input's shape and dtype (a cast back would make the loop's values differ from the step's)."""
    def body(carry: list[torch.Tensor]) -> list[torch.Tensor]:
        inputs = [t.to(torch.bool) if kind == torch.bool else t for t, kind in zip(carry, kinds, strict=True)]
        outputs = list(step(inputs))
        if len(outputs) != len(carry):
            raise ReplayUnsupported(f"the loop's step returned {len(outputs)} tensors for a carry of {len(carry)}")
        for i, (o, c, kind) in enumerate(zip(outputs, carry, kinds, strict=True)):
            if tuple(o.shape) != tuple(c.shape):
                raise ReplayUnsupported(f"the loop's step changed carry[{i}]'s shape {tuple(c.shape)} to "
                                        f"{tuple(o.shape)}")
            if o.dtype != kind:
                raise ReplayUnsupported(f"the loop's step changed carry[{i}]'s dtype {kind} to {o.dtype}")
        return [o.to(c.dtype) for o, c in zip(outputs, carry, strict=True)]

    return body


def _build(body: Callable, carry: list[torch.Tensor], outside: Sequence[torch.Tensor] = ()) -> _Built:
    """Trace `body` once on placeholders and wrap it in a While over (counter, limit, carry, baked tensors)."""
    fake = [xb.create_placeholder_tensor(t.shape, t.dtype) for t in carry]
    # The body gets copies: a step that writes a carry tensor in place (a cache's index_copy_) would otherwise turn
    # the placeholder itself into that write, and it would no longer be the computation's parameter.
    # No execution while tracing: a step that reads a value on the host (`.item()`, a print) would run a graph on
    # the placeholders, which hold no data; refused instead.
    allowed = torch_xla._XLAC._get_allow_execution()
    torch_xla._XLAC._set_allow_execution(False)
    try:
        outputs = body([f * 1 for f in fake])
    except RuntimeError as err:
        if isinstance(err, ReplayUnsupported) or "Unexpected execution" not in str(err):
            raise
        raise ReplayUnsupported("the loop's step reads a value on the host") from err
    finally:
        torch_xla._XLAC._set_allow_execution(allowed)
    ctx = torch_xla._XLAC.lowering.LoweringContext("tpu_helpers_loop_step")
    ctx.build(list(outputs))
    step_computation = xb.computation_from_module_proto("tpu_helpers_loop_step", ctx.hlo())

    ids, _ = torch_xla._XLAC._get_tensors_xla_device_data_node(list(outputs))
    if torch_xla._XLAC._get_seed_info_id() in ids:
        raise ReplayUnsupported("the loop's step draws from torch's random generator (one seed for every "
                                "iteration); pass randomness in the carry")
    # The step computation's parameters: the placeholders it reads, then whatever device data it reads besides.
    to_while: dict[int, int] = {}  # the step's parameter id -> the While's
    for i, f in enumerate(fake):
        pid = ctx.tensor_parameter_id(f)
        if pid != -1:
            to_while[pid] = 2 + i
    baked_map = ctx.device_parameter_id_tensor_mapping()
    for f in fake:
        baked_map.pop(ctx.tensor_parameter_id(f), None)
    baked = []
    for pid, tensor in sorted(baked_map.items()):
        to_while[pid] = 2 + len(carry) + len(baked)
        baked.append(tensor)
    if outside and baked:
        # The step's graph reads one of `outside`'s device buffers itself (a weight reached another way than
        # through the swapped attribute: a tied head, a module kept aside), which the kept program would read stale.
        theirs = set(torch_xla._XLAC._get_tensors_xla_device_data_node(list(outside))[0])
        if theirs & set(ids):
            raise ReplayUnsupported("the loop's step reads one of the model's weights (or its cache) besides its "
                                    "carry (a tied or shared weight?), which a kept program would read stale")
    size = sum(t.numel() * t.element_size() for t in baked)
    if size > MAX_BAKED_BYTES:
        raise ReplayUnsupported(f"the loop's step reads {size} bytes of device tensors outside its carry (more than "
                                f"{MAX_BAKED_BYTES}: weights not passed in?), which a kept program would read stale")

    builder = xb.create_builder("tpu_helpers_loop")
    shapes = [xb.tensor_shape(t) for t in [torch.zeros((), dtype=torch.long), torch.zeros((1,), dtype=torch.long),
                                             *carry, *baked]]
    params = [xb.mkparam(builder, i, shape) for i, shape in enumerate(shapes)]
    n_carry = len(carry)

    def cond_fn(counter, limit, *rest):
        return counter < limit.reshape([])

    def body_fn(counter, limit, *rest):
        everything = (counter, limit, *rest)
        result = xb.Op.call(step_computation, [everything[to_while[pid]] for pid in range(len(to_while))])
        new_carry = [result.get_tuple_element(i) for i in range(n_carry)]
        one = xb.Op.scalar(counter.builder(), 1, dtype=xb.Type.S64)
        return (counter + one, limit, *new_carry, *rest[n_carry:])

    computation = xb.Op.mkwhile(tuple(params), cond_fn, body_fn).build("tpu_helpers_loop")
    return _Built(computation, baked)
