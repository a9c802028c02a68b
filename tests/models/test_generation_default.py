"""`generate_ids` without `sync`, `replay` or `loop` (models/generation.py): the backend that owns the device gives
them (`tpu_helpers.backend.generation_hooks`). On XLA:CPU a plain call answers as the call the recipes make
(`sync=b.sync, replay=b.compile_step, loop=b.compile_loop`), replays its prompt pass and loops its decode, compiles
no more than that call and, repeated, nothing; an explicit value wins, False turns one off. The CPU keeps its
Python loop; CUDA's hooks are checked without a GPU where nothing of them needs one."""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.models.families import FAMILIES, random_model
from tests.support import XLA_BACKEND
from tpu_helpers.backend import generation_hooks
from tpu_helpers.config import ConfigError
from tpu_helpers.models import decode, generation, replay
from tpu_helpers.models.generation import generate_ids, left_pad

VOCAB = 97
on_xla = pytest.mark.skipif(XLA_BACKEND is None, reason="torch_xla not installed")


def _rows(seed: int, lengths: tuple, width: int = 11):
    torch.manual_seed(seed)
    return left_pad([torch.randint(3, VOCAB, (n,)).tolist() for n in lengths], width, 0)


def _gen(model, p, device, **kw):
    kw = {"max_new_tokens": 7, "eos_token_id": None, "pad_token_id": 0, **kw}
    out = generate_ids(model, p.ids.to(device), p.mask.to(device), **kw)
    return generation.Generated(out.ids.cpu(), out.logprobs.cpu(), out.mask.cpu())


def _captures() -> int:
    import torch._dynamo

    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def _looped(model) -> bool:
    """Whether `model`'s decode ran as a device loop (the loop kept with it holds a built program)."""
    loop = replay._KEPT.get(model, {}).get("loop")
    return loop is not None and bool(getattr(loop, "_built", None))


def test_the_cpu_keeps_its_python_loop():
    model = random_model(FAMILIES["llama3"].config(VOCAB, pad=0), seed=1)
    p = _rows(0, (11, 6, 2))
    assert generation_hooks(torch.device("cpu")) is None
    plain = _gen(model, p, "cpu")
    assert "loop" not in replay._KEPT.get(model, {})  # no loop asked for, no cache kept
    explicit = _gen(model, p, "cpu", replay=False, loop=False, sync=False)
    assert torch.equal(plain.ids, explicit.ids) and torch.equal(plain.logprobs, explicit.logprobs)


@pytest.mark.parametrize("name", ["sync", "replay", "loop"])
@pytest.mark.parametrize("value", [True, "yes", 0])
def test_a_value_that_is_neither_a_callable_none_nor_false_is_refused(name, value):
    model = random_model(FAMILIES["llama3"].config(VOCAB, pad=0), seed=1)
    with pytest.raises(ConfigError, match=rf"{name}={value!r} must be a callable .*None .*False"):
        _gen(model, _rows(0, (11, 6)), "cpu", **{name: value})


def test_cuda_hooks_are_the_backends_and_touch_no_gpu():
    """What `CudaBackend` gives, read without one (its construction sets the current device): no sync, nothing
    captured (`compile_step` gives the step back), the decode as a CUDA graph loop on the model's GPU in a process
    of its own and none where a process group spans several (FSDP2's collectives). Nothing here needs a GPU; none
    is initialised."""
    from tpu_helpers.backend.cuda import graph_loop
    from tpu_helpers.backend.cuda_loop import GraphLoop

    initialised = torch.cuda.is_initialized()
    hooks = generation_hooks(torch.device("cuda", 1))
    step = decode.decode_step
    assert hooks.compile_step(step) is step and hooks.sync() is None
    loop = hooks.compile_loop()
    assert isinstance(loop, GraphLoop) and loop.device == torch.device("cuda", 1)
    assert graph_loop(torch.device("cuda", 0), 2) is None
    assert torch.cuda.is_initialized() == initialised


@pytest.mark.xla
@on_xla
@pytest.mark.usefixtures("one_thread")
def test_a_plain_call_on_xla_is_the_recipes_call():
    b = XLA_BACKEND
    hooks = generation_hooks(b.device, ())
    assert hooks.compile_step(decode.decode_step) is b.compile_step(decode.decode_step)  # one capture, shared
    family = FAMILIES["llama3"].config(VOCAB, pad=0)
    cpu = random_model(family, seed=1)
    # Shapes no other test compiles (a width of 11, batches of 3 and 2), so the counts are this test's own.
    p_explicit, p_plain = _rows(0, (11, 6, 2)), _rows(0, (11, 6))
    want_explicit = _gen(cpu, p_explicit, "cpu")
    want_plain = _gen(cpu, p_plain, "cpu")
    recipes = {"sync": b.sync, "replay": b.compile_step, "loop": b.compile_loop}

    explicit_model = b.move_model(random_model(family, seed=1))
    start = b.metrics()["compilations"]
    got = _gen(explicit_model, p_explicit, b.device, **recipes)
    explicit_compiles = b.metrics()["compilations"] - start
    assert explicit_compiles > 0 and torch.equal(got.ids, want_explicit.ids)
    runs = b.step_metrics()["executions"]
    _gen(explicit_model, p_explicit, b.device, **recipes)
    explicit_runs = b.step_metrics()["executions"] - runs

    model = b.move_model(random_model(family, seed=1))
    start, captures = b.metrics()["compilations"], _captures()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # neither a capture nor the loop refused
        got = _gen(model, p_plain, b.device)
    plain_compiles = b.metrics()["compilations"] - start
    assert torch.equal(got.ids, want_plain.ids), (got.ids, want_plain.ids)
    torch.testing.assert_close(got.logprobs, want_plain.logprobs, atol=1e-4, rtol=1e-4)
    assert _captures() > captures and _looped(model)  # the prompt pass replayed, the decode looped
    assert plain_compiles <= explicit_compiles, (plain_compiles, explicit_compiles)

    start, runs = b.metrics()["compilations"], b.step_metrics()["executions"]
    again = _gen(model, p_plain, b.device)
    assert b.metrics()["compilations"] == start  # the same shapes: nothing compiled
    assert b.step_metrics()["executions"] - runs == explicit_runs  # the recipes' graphs, not one per token
    assert torch.equal(again.ids, want_plain.ids)
    fewer = _gen(model, p_plain, b.device, max_new_tokens=4, cache_len=11 + 7)
    assert b.metrics()["compilations"] == start and torch.equal(fewer.ids[:, :4], want_plain.ids[:, :4])
    assert torch.equal(_gen(model, p_plain, b.device, **recipes).ids, want_plain.ids)  # shares the plain's caches
    assert b.metrics()["compilations"] == start
    generation.release_caches(model)
    generation.release_caches(explicit_model)


@pytest.mark.xla
@on_xla
@pytest.mark.usefixtures("one_thread")
def test_an_explicit_false_on_xla_turns_the_fast_path_off():
    b = XLA_BACKEND
    family = FAMILIES["llama3"].config(VOCAB, pad=0)
    p = _rows(1, (11, 6))
    want = _gen(random_model(family, seed=1), p, "cpu")
    model = b.move_model(random_model(family, seed=1))
    captures = _captures()
    got = _gen(model, p, b.device, replay=False, loop=False)  # the backend's sync still cuts each token
    assert torch.equal(got.ids, want.ids)
    assert _captures() == captures and "loop" not in replay._KEPT.get(model, {})
    generation.release_caches(model)
