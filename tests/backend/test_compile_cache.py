"""The persistent XLA compile cache: on by default on TPU, and a second process finds the first one's programs.

Each run is a fresh interpreter: the cache is set when a process first starts XLA, and this test session's own
XLA runtime is already running (conftest)."""

from __future__ import annotations

import json
import os

import pytest

from tests.support import XLA_BACKEND, run_python
from tpu_helpers.backend import DEFAULT_COMPILE_CACHE, resolve_compile_cache
from tpu_helpers.config import ConfigError, TrainConfig

TRAIN = """
import json, torch
from tpu_helpers.config import TrainConfig
from tpu_helpers.data import build_datasets
from tpu_helpers.training.trainer import Trainer
cfg = TrainConfig(device="xla", preset="tiny", steps=3, batch_size=8, seq_len=32, warmup_steps=1, log_every=3,
                  eval_every=100, save_every=100, compile_cache_dir={cache!r}, out_dir={out!r})
train, val, tok = build_datasets("embedded", "byte", block_size=32, max_chars=50_000)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Embedding(tok.vocab_size, 16), torch.nn.Linear(16, tok.vocab_size))
loss = lambda logits, y: torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
report = Trainer(model, train, None, config=cfg, loss_fn=loss, progress=False).fit()
print(json.dumps(report.xla))
print(json.dumps(str(report)))
"""


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
        code = TRAIN.format(cache=cache, out=str(tmp_path / f"run{i}"))
        lines = run_python(code, env={"PJRT_DEVICE": "CPU"}).stdout.strip().splitlines()
        runs.append((json.loads(lines[-2]), json.loads(lines[-1])))
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


NOTEBOOK_SEQUENCE = """
import json, os, warnings
os.environ.pop("TPU_HELPERS_XLA_CACHE", None)
from tpu_helpers.backend import active_compile_cache, get_backend, resolve_compile_cache, xla_module
from tpu_helpers.launch import platform
platform.setup_pjrt("xla", compile_cache={cache!r})    # colab_tpu / tpuvm_v5e8: the cache goes to setup_pjrt first
# ... then get_backend(...) with its default compile_cache_dir="default". On a TPU that resolves here:
on_tpu = resolve_compile_cache("default", "TPU", active_compile_cache())
xla_module().initialize_compile_cache(on_tpu)          # what get_backend does with it: "cannot move" if it differs
with warnings.catch_warnings():
    warnings.simplefilter("error")                     # no "compile_cache_dir is ignored" either
    backend = get_backend("xla", spmd=False)
print(json.dumps({{"on_tpu": on_tpu, "backend": backend.compile_cache_dir}}))
"""


@pytest.mark.xla
@pytest.mark.skipif(XLA_BACKEND is None, reason="torch_xla is not installed")
def test_cache_given_to_setup_pjrt_is_the_one_get_backend_uses_on_a_tpu(tmp_path):
    cache = str(tmp_path / "drive_cache")
    out = run_python(NOTEBOOK_SEQUENCE.format(cache=cache), env={"PJRT_DEVICE": "CPU"}).stdout
    got = json.loads(out.strip().splitlines()[-1])
    assert got == {"on_tpu": cache, "backend": cache}


def test_default_means_the_cache_this_process_already_uses(tmp_path):
    active = str(tmp_path / "active")
    assert resolve_compile_cache("default", "TPU", active) == active
    assert resolve_compile_cache("default", "CPU", active) == active
    assert resolve_compile_cache(None, "TPU", active) is None
    assert resolve_compile_cache("default", "TPU", None, env={"TPU_HELPERS_XLA_CACHE": active}) == active
