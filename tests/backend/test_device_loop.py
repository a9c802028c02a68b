"""`Backend.compile_loop` (backend/xla_loop.py): a step run N times as one XLA While op on XLA:CPU, traced once per
shape and key, what it refuses (host reads, torch's RNG, weights read from outside the carry), and eager backends
having none."""

from __future__ import annotations

import pytest
import torch

from tests.support import XLA_BACKEND
from tpu_helpers.backend.base import Backend, ReplayUnsupported


def test_eager_backends_have_no_device_loop():
    assert Backend().compile_loop() is None
    assert XLA_BACKEND is None or XLA_BACKEND.compile_loop() is not None


def _step(carry):
    x, n, seen, w = carry
    x = torch.tanh(x @ w) + torch.ones(4, device=x.device)  # a tensor the step makes itself may stay baked in
    return [x, n + 1, seen | (x.sum() > 2), w]


def _python_loop(carry, steps):
    for _ in range(steps):
        carry = _step(carry)
    return carry


@pytest.mark.xla
@pytest.mark.skipif(XLA_BACKEND is None, reason="torch_xla not installed")
@pytest.mark.parametrize("steps", [0, 1, 7])
@pytest.mark.usefixtures("one_thread")
def test_the_loop_gives_the_python_loops_values_and_reuses_its_program(steps):
    """Floats, an int64 counter and a boolean through the While equal the same steps run in Python; another call with
    other values and another number of steps traces nothing and compiles nothing new (the trip count is an input)."""
    b = XLA_BACKEND
    loop = b.compile_loop()
    torch.manual_seed(0)
    w = torch.randn(4, 4) * 0.7
    carry = [torch.randn(4), torch.zeros((), dtype=torch.long), torch.zeros((), dtype=torch.bool), w]
    out = [t.cpu() for t in loop(_step, [t.to(b.device) for t in carry], steps, key="toy")]
    want = _python_loop(carry, steps)
    torch.testing.assert_close(out[0], want[0])
    assert out[1].item() == steps and out[1].dtype == torch.long
    assert out[2].dtype == torch.bool and bool(out[2]) == bool(want[2])
    b.sync()
    compiles = b.metrics()["compilations"]
    traced = []
    again = loop(lambda c: traced.append(1) or _step(c), [t.to(b.device) for t in [carry[0] * 2, *carry[1:]]],
                 steps + 3, key="toy")
    torch.testing.assert_close(again[0].cpu(), _python_loop([carry[0] * 2, *carry[1:]], steps + 3)[0])
    assert traced == [] and b.metrics()["compilations"] == compiles


@pytest.mark.xla
@pytest.mark.skipif(XLA_BACKEND is None, reason="torch_xla not installed")
@pytest.mark.usefixtures("one_thread")
def test_a_step_reading_the_host_or_the_rng_or_outside_weights_is_refused_before_it_ran():
    b = XLA_BACKEND
    loop = b.compile_loop()
    x = torch.ones(4).to(b.device)

    def reads_host(c):
        return [c[0] + 1 if c[0].sum().item() > 0 else c[0]]

    def draws(c):
        return [c[0] + torch.rand(4, device=c[0].device)]

    big = torch.ones(1024, 1024).to(b.device)  # 4 MB read from outside the carry: a weight the caller did not pass

    def outside(c):
        return [c[0] + big[0, :4]]

    with pytest.raises(ReplayUnsupported, match="reads a value on the host"):
        loop(reads_host, [x], 3, key="host")
    with pytest.raises(ReplayUnsupported, match="random generator"):
        loop(draws, [x], 3, key="rng")
    with pytest.raises(ReplayUnsupported, match="bytes of device tensors outside its carry"):
        loop(outside, [x], 3, key="outside")
    with pytest.raises(ReplayUnsupported, match="changed carry\\[0\\]'s shape"):
        loop(lambda c: [c[0][:2]], [x], 3, key="shape")
    count = torch.ones(3, dtype=torch.long).to(b.device)
    with pytest.raises(ReplayUnsupported, match="changed carry\\[0\\]'s dtype torch.int64 to torch.float32"):
        loop(lambda c: [c[0] * 1.5], [count], 3, key="dtype")  # cast back, it would differ from the step's values
    weight = torch.ones(4).to(b.device)
    with pytest.raises(ReplayUnsupported, match="reads one of the model's weights .or its cache. besides its carry"):
        loop(lambda c: [c[0] + weight], [x], 3, key="weight", outside=[weight])  # a weight kept aside: baked stale
    with pytest.raises(ReplayUnsupported, match="random generator"):  # a refused key is not traced again
        loop(lambda c: pytest.fail("traced again"), [x], 3, key="rng")

