"""The persistent XLA compile cache: on by default on TPU, and a second process finds the first one's programs.

Each run is a fresh interpreter: the cache is set when a process first starts XLA, and this test session's own
XLA runtime is already running (conftest)."""

from __future__ import annotations

import os

import pytest

from tests.support import XLA_BACKEND, script_result
from tpu_helpers.backend import DEFAULT_COMPILE_CACHE, resolve_compile_cache
from tpu_helpers.config import ConfigError, TrainConfig


def test_default_cache_is_on_for_tpu_only_and_can_move_or_be_turned_off(monkeypatch, tmp_path):
    monkeypatch.delenv("TPU_HELPERS_XLA_CACHE", raising=False)
    assert resolve_compile_cache("default", "TPU") == os.path.expanduser(DEFAULT_COMPILE_CACHE)
    assert resolve_compile_cache("default", "CPU") is None  # XLA:CPU cannot load cached programs in 2.9
    monkeypatch.setenv("TPU_HELPERS_XLA_CACHE", str(tmp_path / "drive"))
    assert resolve_compile_cache("default", "TPU") == str(tmp_path / "drive")
    assert resolve_compile_cache(str(tmp_path / "x"), "CPU") == str(tmp_path / "x")
    assert resolve_compile_cache(None, "TPU") is None
    with pytest.raises(ConfigError, match="compile_cache_dir=''"):
        TrainConfig(compile_cache_dir="")


@pytest.mark.xla
@pytest.mark.skipif(XLA_BACKEND is None, reason="torch_xla is not installed")
def test_second_process_finds_the_first_ones_programs_in_the_cache(tmp_path):
    cache = str(tmp_path / "cache")
    runs = []
    for i in range(2):
        got = script_result("compile_cache_runs", {"case": "train", "cache": cache, "out": str(tmp_path / f"run{i}")},
                            env={"PJRT_DEVICE": "CPU"})
        runs.append((got["xla"], got["text"]))
    (first, _), (second, text) = runs
    assert first["compile_cache_dir"] == second["compile_cache_dir"] == cache
    assert first["persistent_cache_misses"] >= 2 and first["persistent_cache_hits"] == 0
    assert any(os.scandir(cache)), "the first process wrote nothing to the cache"
    # The second process looks every program up and finds it: no misses. Whether it can then load it depends on
    # the PJRT plugin (TPU: hits; XLA:CPU in 2.9: "Deserializing serialized executable not supported", counted as
    # a failed load), and the report must say which.
    found = second["persistent_cache_hits"] + second["persistent_cache_deserialize_failures"]
    assert second["persistent_cache_misses"] == 0
    assert found == first["persistent_cache_misses"]
    assert f"{second['persistent_cache_hits']} hits, 0 misses" in text
    if second["persistent_cache_deserialize_failures"]:
        assert "saved no compile time" in text


@pytest.mark.xla
@pytest.mark.skipif(XLA_BACKEND is None, reason="torch_xla is not installed")
def test_cache_given_to_setup_pjrt_is_the_one_get_backend_uses_on_a_tpu(tmp_path):
    cache = str(tmp_path / "drive_cache")
    got = script_result("compile_cache_runs", {"case": "notebook_sequence", "cache": cache}, env={"PJRT_DEVICE": "CPU"})
    assert got == {"on_tpu": cache, "backend": cache}


def test_default_means_the_cache_this_process_already_uses(tmp_path):
    active = str(tmp_path / "active")
    assert resolve_compile_cache("default", "TPU", active) == active
    assert resolve_compile_cache("default", "CPU", active) == active
    assert resolve_compile_cache(None, "TPU", active) is None
    assert resolve_compile_cache("default", "TPU", None, env={"TPU_HELPERS_XLA_CACHE": active}) == active
