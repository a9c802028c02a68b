"""backend/runtime_env.py (the XLA/PJRT variables in one place) and backend_for (a backend from a TrainConfig)."""

from __future__ import annotations

import os

import pytest

from tests.support import XLA_BACKEND, tiny_config
from tpu_helpers import backend as backend_mod
from tpu_helpers.backend import backend_for, runtime_env


def test_xla_cpu_env_and_its_bad_counts():
    assert runtime_env.xla_cpu_env(devices=8) == {"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "8"}
    for bad in (0, True, "8"):
        with pytest.raises(ValueError, match="must be a positive int"):
            runtime_env.xla_cpu_env(devices=bad)


def test_debug_env_names_torch_xla_s_variables(tmp_path):
    env = runtime_env.debug_env(tmp_path / "d.txt", level=1)
    assert env == {"PT_XLA_DEBUG_LEVEL": "1", "PT_XLA_DEBUG_FILE": str((tmp_path / "d.txt").resolve())}
    with pytest.raises(ValueError, match="level=3 is not one of"):
        runtime_env.debug_env(tmp_path / "d.txt", level=3)


def test_dump_env_adds_the_dump_flag_on_one_device_and_leaves_this_process_alone(tmp_path):
    before = dict(os.environ)
    env = runtime_env.dump_env(tmp_path, pjrt="CPU", environ={"XLA_FLAGS": "--xla_cpu_foo", "CPU_NUM_DEVICES": "8",
                                                              "HOME": "/h"})
    assert env == {"HOME": "/h", "PJRT_DEVICE": "CPU", "XLA_FLAGS": f"--xla_cpu_foo --xla_dump_to={tmp_path}"}
    assert runtime_env.dump_dir_flags("/d") == "--xla_dump_to=/d"
    assert dict(os.environ) == before


@pytest.mark.parametrize("device, env, chips, expected", [
    ("tpu", {}, 8, 8),                                        # a v5e-8 VM
    ("auto", {}, 1, 1),                                       # a v6e-1 Colab
    ("tpu", {"TPU_NUM_DEVICES": "4"}, 8, 4),                  # the user limited the chips
    ("xla", {"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "8"}, 0, 8),   # the tests' simulated v5e-8
    ("auto", {"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "8"}, 0, 1),  # auto on a CPU host: no XLA devices
    ("cpu", {}, 8, 1),
    ("cuda", {"PJRT_DEVICE": "TPU"}, 8, 1),
])
def test_local_device_count(monkeypatch, device, env, chips, expected):
    for name in ("PJRT_DEVICE", "CPU_NUM_DEVICES", "TPU_NUM_DEVICES"):
        monkeypatch.delenv(name, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert runtime_env.local_device_count(device, tpu_chips=chips) == expected


def test_choose_pjrt_device_keeps_an_exported_choice(monkeypatch):
    monkeypatch.delenv("PJRT_DEVICE", raising=False)
    monkeypatch.delenv("XLA_COMPILATION_CACHE_SIZE", raising=False)  # tests.support sized the session's cache
    assert runtime_env.choose_pjrt_device("cpu", tpu_attached=False) is None
    assert runtime_env.choose_pjrt_device("auto", tpu_attached=True) == "TPU"
    monkeypatch.delenv("PJRT_DEVICE")
    assert runtime_env.choose_pjrt_device("xla", tpu_attached=False) == "CPU"
    assert runtime_env.choose_pjrt_device("tpu", tpu_attached=True) == "CPU"  # exported (here: above) wins
    monkeypatch.setenv("XLA_FLAGS", "--xla_x")
    assert runtime_env.runtime_vars() == {"PJRT_DEVICE": "CPU", "XLA_FLAGS": "--xla_x"}


@pytest.mark.skipif(XLA_BACKEND is None, reason="torch_xla is not installed")
def test_runtime_started_in_this_process():
    assert runtime_env.runtime_started()  # tests.support made the XLA:CPU backend


def test_backend_for_passes_every_setting_of_the_config(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(backend_mod, "get_backend", lambda device, **kw: calls.append((device, kw)) or "backend")
    cfg = tiny_config(tmp_path, device="xla", fallback=True, precision="bf16", spmd=False,
                      compile_cache_dir=str(tmp_path / "cache"))
    assert backend_for(cfg) == "backend"
    assert calls[-1] == ("xla", {"fallback": True, "precision": "bf16", "spmd": False,
                                 "compile_cache_dir": str(tmp_path / "cache")})
    backend_for(cfg, spmd=True, device="tpu")
    assert calls[-1][0] == "tpu" and calls[-1][1]["spmd"] is True
    with pytest.raises(TypeError, match=r"unknown setting\(s\) \['precison'\]"):
        backend_for(cfg, precison="fp32")


def test_backend_for_on_the_cpu(tmp_path):
    backend = backend_for(tiny_config(tmp_path))
    assert backend.name == "cpu" and backend.runs_on_host and backend.peak_tflops is None
    if XLA_BACKEND is not None:
        assert not XLA_BACKEND.runs_on_host and XLA_BACKEND.peak_tflops is None  # XLA:CPU has no catalog peak


def test_xla_cpu_keeps_no_more_compiled_graphs_than_the_kernels_mapping_limit_holds():
    """XLA:CPU's compiled graphs each hold LLVM memory mappings until torch_xla's LRU evicts them; a process past
    vm.max_map_count fails to compile and segfaults (the whole test suite in one process gets there). The cache is
    sized to the limit on XLA:CPU, a user's own setting kept, and nothing is set for other devices."""
    assert runtime_env.xla_cpu_cache_size(65530) == 959  # the kernel's default limit, less the process's own
    assert runtime_env.xla_cpu_cache_size(10**7) == 2048  # a raised limit: torch_xla's own default
    assert runtime_env.xla_cpu_cache_size(100) == 64  # never a uselessly small cache
    env = {"PJRT_DEVICE": "CPU"}
    assert runtime_env.cap_xla_cpu_cache(env) == env["XLA_COMPILATION_CACHE_SIZE"] == \
        str(runtime_env.xla_cpu_cache_size())
    mine = {"PJRT_DEVICE": "CPU", "XLA_COMPILATION_CACHE_SIZE": "300"}
    assert runtime_env.cap_xla_cpu_cache(mine) == "300"
    tpu = {"PJRT_DEVICE": "TPU"}
    assert runtime_env.cap_xla_cpu_cache(tpu) is None and "XLA_COMPILATION_CACHE_SIZE" not in tpu
