"""Device selection, errors for devices that are missing, and the backends' behaviour on CPU and XLA:CPU."""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.support import XLA_BACKEND, script_result
from tpu_helpers.backend import BackendUnavailable, get_backend, tpu_chip_count
from tpu_helpers.backend.base import Backend


def test_unknown_device_names_the_value_and_allowed_ones():
    with pytest.raises(ValueError, match=r"device='gpu' is not one of \('auto', 'tpu', 'cuda', 'cpu', 'xla'\)"):
        get_backend("gpu")


def test_unknown_precision_and_spmd_values_are_refused():
    with pytest.raises(ValueError, match="precision='int8' is not one of"):
        get_backend("cpu", precision="int8")
    with pytest.raises(ValueError, match="spmd='yes' must be True, False or 'auto'"):
        get_backend("cpu", spmd="yes")


@pytest.mark.skipif(tpu_chip_count() > 0, reason="a TPU is attached")
def test_tpu_without_a_tpu_raises_with_the_reason_and_the_way_out():
    with pytest.raises(BackendUnavailable, match="no TPU chips are attached.*fallback=True"):
        get_backend("tpu")


@pytest.mark.skipif(tpu_chip_count() > 0 or torch.cuda.is_available(), reason="accelerator present")
def test_tpu_with_fallback_warns_and_uses_the_cpu():
    with pytest.warns(UserWarning, match="device='tpu' is not available .*falling back to 'cpu'"):
        backend = get_backend("tpu", fallback=True)
    assert backend.name == "cpu" and backend.device == torch.device("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")
def test_cuda_without_a_gpu_raises_and_fallback_warns():
    with pytest.raises(BackendUnavailable, match="needs a CUDA GPU"):
        get_backend("cuda")
    with pytest.warns(UserWarning, match="falling back to 'cpu'"):
        assert get_backend("cuda", fallback=True).name == "cpu"


@pytest.mark.skipif(tpu_chip_count() > 0 or torch.cuda.is_available(), reason="accelerator present")
def test_auto_picks_the_cpu_here_silently():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        backend = get_backend("auto")
    assert type(backend) is Backend
    assert backend.status().startswith("CPU (") and backend.status().endswith("fp32")
    assert backend.precision == "fp32" and backend.is_main and backend.world_size == 1


def test_cpu_backend_refuses_fp16():
    with pytest.raises(ValueError, match="fp16.*needs a CUDA GPU"):
        get_backend("cpu", precision="fp16")


def test_cpu_optimizer_step_clips_and_returns_the_norm():
    backend = get_backend("cpu")
    p = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.SGD([p], lr=1.0)
    (p * 10).sum().backward()  # gradient 10 per element, norm 20
    norm = backend.optimizer_step(opt, clip_norm=1.0)
    assert norm.item() == pytest.approx(20.0)
    assert torch.allclose(p.detach(), torch.ones(4) - 0.5, atol=1e-5)  # clipped gradient has norm 1
    backend.zero_grad(opt)
    assert p.grad is None  # eager backends drop the gradients


@pytest.mark.xla
def test_xla_backend_on_xla_cpu_keeps_gradients_and_reports_metrics():
    backend = XLA_BACKEND
    assert backend is not None and backend.is_xla and backend.device.type == "xla"
    assert backend.status() == "XLA:CPU x1, fp32"
    assert backend.checkpoint_fn().__module__ == "torch_xla.utils.checkpoint"
    p = torch.nn.Parameter(torch.ones(4, device=backend.device))
    opt = torch.optim.SGD([p], lr=0.1)
    (p * 2).sum().backward()
    backend.optimizer_step(opt)
    backend.zero_grad(opt)
    backend.sync()
    assert p.grad is None  # set_to_none=True on XLA too: fewer graphs, less memory (benchmarks/zero_grad.py)
    assert backend.metrics()["compilations"] >= 1
    assert backend.memory_info() is None  # not available on XLA:CPU
    assert get_backend("xla", spmd=False) is backend  # one XLA runtime per process


@pytest.mark.xla
def test_xla_step_closure_runs_after_the_step():
    backend = XLA_BACKEND
    seen = []
    t = torch.ones(3, device=backend.device) * 2
    backend.add_step_closure(lambda x: seen.append(x.sum().item()), t)
    assert seen == []  # deferred until the graph ran
    backend.sync()
    assert seen == [6.0]


@pytest.mark.xla
@pytest.mark.slow
def test_spmd_backend_drives_eight_virtual_devices_in_one_process():
    out = script_result("backend_in_a_process", {"case": "spmd"}, env={"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "8"})
    assert out == {"status": "XLA:CPU x8 (SPMD), fp32", "replicas": 8, "world_size": 1, "loader": [0, 1]}


@pytest.mark.slow
def test_missing_torch_xla_gives_an_install_hint():
    err = script_result("backend_in_a_process", {"case": "no_torch_xla"})["error"]
    assert err.startswith("torch_xla is not installed") and "torch_xla[tpu]==2.9.0" in err


@pytest.mark.slow
def test_mismatched_torch_and_torch_xla_are_reported_with_the_fix():
    err = script_result("backend_in_a_process", {"case": "mismatch"})["error"]
    assert err.startswith("torch_xla 2.9.0 does not match torch 2.8.0")
    assert "pip install 'torch==2.8.0' 'torch_xla[tpu]==2.8.0'" in err


@pytest.mark.xla
def test_save_moves_xla_tensors_to_the_cpu_and_writes_atomically(tmp_path):
    backend = XLA_BACKEND
    state = {"w": torch.arange(4.0, device=backend.device), "step": 3}
    backend.save(state, tmp_path / "s.pt")
    loaded = torch.load(tmp_path / "s.pt")
    assert loaded["step"] == 3 and loaded["w"].device.type == "cpu" and loaded["w"].tolist() == [0, 1, 2, 3]
    assert [p.name for p in tmp_path.iterdir()] == ["s.pt"]  # no temporary file left behind


@pytest.mark.xla
@pytest.mark.skipif(XLA_BACKEND is None, reason="torch_xla is not installed")
def test_precision_of_one_call_leaves_the_backend_other_trainers_hold_alone():
    held = get_backend("xla", spmd=False)
    bf16 = get_backend("xla", spmd=False, precision="bf16")
    assert held.precision == "fp32" and bf16.precision == "bf16"
    assert bf16.device == held.device and bf16.mesh is held.mesh and bf16.spmd == held.spmd  # one runtime
    assert get_backend("xla", spmd=False) is held and held is XLA_BACKEND


def test_dump_flags_add_the_dump_dir_to_existing_xla_flags_without_touching_the_caller_env():
    from tpu_helpers.backend import runtime_env

    base = {"XLA_FLAGS": "--xla_cpu_use_thunk_runtime=true", "OTHER": "1"}
    env = runtime_env.dump_env("/tmp/dump", environ=base)
    assert env["XLA_FLAGS"] == "--xla_cpu_use_thunk_runtime=true --xla_dump_to=/tmp/dump"
    assert env["OTHER"] == "1" and base["XLA_FLAGS"] == "--xla_cpu_use_thunk_runtime=true"
    assert runtime_env.dump_env("d", environ={})["XLA_FLAGS"] == "--xla_dump_to=d"
    with pytest.raises(ValueError, match="'/tmp/my dump'.*no spaces"):
        runtime_env.dump_env("/tmp/my dump", environ={})


@pytest.mark.parametrize("xla", [False, pytest.param(True, marks=pytest.mark.xla)])
def test_assign_gives_each_target_its_value_in_place_and_names_a_mismatch(xla):
    """`Backend.assign` (the replayed AdamW's write-back): each target object keeps its identity and autograd flags
    and takes its value (XLA: replaced, no copy traced); a pair of another shape or dtype is an error naming
    its index, before any target changed."""
    if xla and XLA_BACKEND is None:
        pytest.skip("torch_xla not installed")
    b = XLA_BACKEND if xla else Backend()
    dev = b.device if xla else torch.device("cpu")
    targets = [torch.nn.Parameter(torch.zeros(3).to(dev)), torch.zeros(2, 2).to(dev)]
    values = [torch.arange(3.0).to(dev), torch.full((2, 2), 7.0).to(dev)]
    ids = [id(t) for t in targets]
    b.assign(targets, values)
    assert [id(t) for t in targets] == ids and targets[0].requires_grad
    assert targets[0].detach().cpu().tolist() == [0.0, 1.0, 2.0] and targets[1].cpu().tolist() == [[7.0, 7.0]] * 2
    with pytest.raises(ValueError, match=r"targets\[1\] is \(2, 2\) torch.float32, its value \(4,\) torch.float32"):
        b.assign(targets, [values[0] * 2, torch.ones(4).to(dev)])
    assert targets[0].detach().cpu().tolist() == [0.0, 1.0, 2.0]  # checked before anything was assigned
    with pytest.raises(ValueError, match="2 targets for 1 values"):
        b.assign(targets, values[:1])


@pytest.mark.parametrize("xla", [False, pytest.param(True, marks=pytest.mark.xla)])
def test_assign_reaches_a_module_whose_weight_was_written_in_place_before(xla):
    """A weight written in place (a checkpoint's `load_state_dict`, an init) and then assigned: the module's forward,
    which reads it through a view (`linear`'s transpose), and its state dict see the assigned value, step after step.
    XLA's data swap (`_replace_xla_tensor`) left both on the loaded value: a resumed run whose forward was traced
    lazily (under a mesh, or a forward that could not be captured) never saw its replayed AdamW's updates."""
    if xla and XLA_BACKEND is None:
        pytest.skip("torch_xla not installed")
    b = XLA_BACKEND if xla else Backend()
    dev = b.device if xla else torch.device("cpu")
    layer = torch.nn.Linear(4, 1, bias=False).to(dev)
    with torch.no_grad():
        layer.weight.copy_(torch.ones(1, 4))  # what load_state_dict does
    x = torch.ones(2, 4).to(dev)
    for k in (10.0, 20.0):
        b.assign([layer.weight], [torch.arange(4.0).mul(k)[None].to(dev)])
        assert layer(x).detach().cpu().tolist() == [[6 * k]] * 2
        assert layer.state_dict()["weight"].cpu().tolist() == [[0.0, k, 2 * k, 3 * k]]
        assert layer.weight.requires_grad


@pytest.mark.xla
def test_reading_sharded_tensors_on_a_mesh_compiles_once_not_every_read():
    """On 8 devices (SPMD), data and fsdp meshes: `to_cpu` of row-sharded outputs (int64 and bool), four times with
    new values: the values come back whole and in their dtypes, and only the first read compiles (torch_xla compiled a
    gather for every read of a sharded tensor: a GRPO rollout on a mesh recompiled each step). Past the gather budget
    (0 here) reads are torch_xla's again: a compile every read. The graphs run are counted and timed (over a mesh
    torch_xla times them under another name: the device time of a v5e-8's steps read 0)."""
    from tests.support import script_result
    from tpu_helpers.backend import runtime_env

    env = runtime_env.xla_cpu_env(8)
    for mesh in ([8, 1], [1, 8], [2, 4]):
        out = script_result("sharded_reads", {"mesh": mesh}, env=env)
        assert out["spec"].startswith("{devices=["), (mesh, out)  # the tensors read really were sharded
        assert all(out["same"]), (mesh, out)
        assert out["compiles"][0] > 0 and out["compiles"][1:] == [0, 0, 0], (mesh, out)
        # Each round's sync and read ran graphs, timed: over a mesh torch_xla times them apart from one device's.
        assert out["executions"] == out["executions_in_metrics"] >= 8 and out["device_seconds"] > 0, (mesh, out)
    out = script_result("sharded_reads", {"mesh": [8, 1], "budget": 0}, env=env)
    assert all(out["same"]) and all(c > 0 for c in out["compiles"]), out


@pytest.mark.xla
def test_a_replayed_step_whose_graph_left_the_compile_cache_is_captured_anew():
    # torch_xla's LRU cache of compiled graphs evicts a capture's graph after enough others (2048 by default, which a
    # test session reaches); a replay of an evicted capture must capture anew, not fail "kicked out of the LRU cache".
    from tests.support import script_result

    out = script_result("evicted_capture", env={"XLA_COMPILATION_CACHE_SIZE": "4"})
    assert out["again"] == out["first"] == pytest.approx(out["lazy"], rel=1e-6)
