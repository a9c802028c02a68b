"""`Backend.compile_loop` on one CUDA GPU (backend/cuda_loop.py): a step run N times as replays of one captured CUDA
graph equals the Python loop, later calls with other values and other numbers of steps capture nothing, the caller's
state tensors (`outside`) are read and written where they are, and a step a graph cannot hold (a host read) is
run eagerly with one warning and leaves the GPU usable. Skipped without a GPU (CI has none): run on a GPU machine."""

from __future__ import annotations

import warnings

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def cuda():
    from tpu_helpers.backend import get_backend

    return get_backend("cuda", precision="fp32")


def _step(carry):
    x, n, seen, w = carry
    x = torch.tanh(x @ w) + torch.ones(4, device=x.device)
    return [x, n + 1, seen | (x.sum() > 2), w]


def _python_loop(carry, steps):
    for _ in range(steps):
        carry = _step(carry)
    return carry


@pytest.mark.parametrize("steps", [0, 1, 2, 7])
def test_the_graph_loop_gives_the_python_loops_values_and_captures_once(cuda, steps):
    loop = cuda.compile_loop()
    torch.manual_seed(0)
    w = (torch.randn(4, 4) * 0.7).cuda()
    carry = [torch.randn(4).cuda(), torch.zeros((), dtype=torch.long).cuda(),
             torch.zeros((), dtype=torch.bool).cuda(), w]
    out = loop(_step, carry, steps, key="toy", outside=[w])
    want = _python_loop(carry, steps)
    torch.testing.assert_close(out[0], want[0])
    assert out[1].item() == steps and out[1].dtype == torch.long
    assert bool(out[2]) == bool(want[2]) and out[3] is w
    assert loop.captures == (1 if steps >= 1 else 0)
    # Other values, more steps, the weight updated in place: replayed, not captured again, the weight read afresh.
    with torch.no_grad():
        w.mul_(0.5)
    second = [carry[0] * 2, *carry[1:]]
    again = loop(_step, second, steps + 3, key="toy", outside=[w])
    torch.testing.assert_close(again[0], _python_loop(second, steps + 3)[0])
    assert again[1].item() == steps + 3
    assert loop.captures == 1
    # The first call's results are the caller's: the second call did not overwrite them.
    torch.testing.assert_close(out[0], want[0])


def test_resident_state_is_written_in_place_and_another_object_captures_anew(cuda):
    """A cache-like tensor in `outside`, written in place by the step at a position the carry holds: the writes land
    in the caller's own tensor (no copy in or out), as in the Python loop."""
    loop = cuda.compile_loop()

    def step(carry):
        pos, buf = carry
        buf.index_copy_(0, pos, (pos * 10).to(buf.dtype))
        return [pos + 1, buf]

    buf = torch.zeros(8).cuda()
    out = loop(step, [torch.zeros(1, dtype=torch.long).cuda(), buf], 5, key="cache", outside=[buf])
    assert out[1] is buf and out[0].item() == 5
    assert buf.tolist() == [0, 10, 20, 30, 40, 0, 0, 0]
    other = torch.zeros(8).cuda()
    loop(step, [torch.full((1,), 2, dtype=torch.long).cuda(), other], 3, key="cache", outside=[other])
    assert other.tolist() == [0, 0, 20, 30, 40, 0, 0, 0] and buf.tolist() == [0, 10, 20, 30, 40, 0, 0, 0]
    assert loop.captures == 2  # the resident slot held another tensor: a graph of its own


def test_a_step_a_graph_cannot_hold_runs_eagerly_with_one_warning_and_the_gpu_stays_usable(cuda):
    """A host read: the capture fails after the first step ran (its warm-up), so the loop finishes eagerly with the
    Python loop's values, warns once, and runs that key eagerly from then on; a shape or dtype change likewise."""
    loop = cuda.compile_loop()
    x = torch.ones(4).cuda()

    def host(c):
        return [c[0] + 1 if c[0].sum().item() > 0 else c[0]]

    with pytest.warns(UserWarning, match="cannot be captured in a CUDA graph.*run one by one instead"):
        out = loop(host, [x], 3, key="host")
    assert out[0].tolist() == [4.0] * 4 and loop.captures == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one warning per loop; the refused key is not captured again
        assert loop(host, [x], 5, key="host")[0].tolist() == [6.0] * 4
        count = torch.ones(3, dtype=torch.long).cuda()
        assert loop(lambda c: [c[0] * 1.5], [count], 2, key="dtype")[0].tolist() == [2.25] * 3
    assert loop.captures == 0
    # The GPU runs on, and another loop captures.
    out = loop(lambda c: [c[0] * 2], [x], 3, key="fine")
    assert out[0].tolist() == [8.0] * 4 and x.tolist() == [1.0] * 4 and loop.captures == 1


def test_outputs_that_alias_the_carry_advance_as_the_python_loop_does(cuda):
    """A step returning one carry tensor in another's place (`[a + 1, a]`): written back in order, the second slot
    would read the first's new value."""
    loop = cuda.compile_loop()

    def step(c):
        return [c[0] + 1, c[0]]

    carry = [torch.zeros(2).cuda(), torch.full((2,), -1.0).cuda()]
    want = carry
    for _ in range(4):
        want = step(want)
    out = loop(step, carry, 4, key="alias")
    assert loop.captures == 1 and out[0].tolist() == want[0].tolist() and out[1].tolist() == want[1].tolist()


def test_resident_state_is_advanced_in_place_even_when_the_step_returns_a_new_tensor(cuda):
    """A resident slot the step returns as a new tensor: the caller's own tensor takes each step's value (the graph
    copies it back), through the graph and through the eager fallback alike."""
    loop = cuda.compile_loop()
    w = torch.ones(3).cuda()
    out = loop(lambda c: [c[0] * 2], [w], 3, key="double", outside=[w])
    assert out[0] is w and w.tolist() == [8.0] * 3
    v = torch.ones(3).cuda()
    with pytest.warns(UserWarning, match="run one by one instead"):
        out = loop(lambda c: [c[0] * 2 if c[0].sum().item() else c[0]], [v], 3, key="host", outside=[v])
    assert out[0] is v and v.tolist() == [8.0] * 3


def test_a_failed_capture_gives_the_callers_stream_back(cuda):
    loop = cuda.compile_loop()
    before = torch.cuda.current_stream()
    with pytest.warns(UserWarning, match="run one by one instead"):
        loop(lambda c: [c[0] + c[0].sum().item()], [torch.ones(2).cuda()], 2, key="host")
    assert torch.cuda.current_stream() == before


def test_resident_memory_moved_under_the_same_object_captures_anew(cuda):
    """`model.to(...)` and back gives a parameter new memory under the same object: the graph's old addresses would
    be freed memory; a new capture reads the new ones."""
    loop = cuda.compile_loop()
    w = torch.full((4,), 2.0).cuda()

    def step(c):
        return [c[0] * c[1], c[1]]

    x = torch.ones(4).cuda()
    assert loop(step, [x, w], 3, key="w", outside=[w])[0].tolist() == [8.0] * 4
    w.data = torch.full((4,), 3.0).cuda()  # the same object, other memory
    assert loop(step, [x, w], 2, key="w", outside=[w])[0].tolist() == [9.0] * 4
    assert loop.captures == 2


def test_graphs_past_the_limit_are_dropped_oldest_first(cuda, monkeypatch):
    from tpu_helpers.backend import cuda_loop

    monkeypatch.setattr(cuda_loop, "MAX_GRAPHS", 2)
    loop = cuda.compile_loop()
    x = torch.ones(2).cuda()
    for key in ("a", "b", "a", "c"):  # "a" used again after "b": "b" is the oldest when "c" comes
        loop(lambda c: [c[0] + 1], [x], 2, key=key)
    assert [k[0] for k in loop._graphs] == ["a", "c"] and loop.captures == 3
