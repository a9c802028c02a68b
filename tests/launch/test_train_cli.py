"""The module entry point `python -m tpu_helpers.train`: flags map to TrainConfig fields, bad values fail clearly,
and torchrun runs it data parallel (2 CPU processes over gloo)."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys

import pytest

from tests.support import ROOT
from tpu_helpers.config import ConfigError, TrainConfig
from tpu_helpers.launch.cli import config_from_args, torchrun_command


def test_flags_map_to_config_fields_and_bad_values_name_the_field():
    cfg = config_from_args(["--preset", "tiny", "--batch-size", "4", "--max_chars", "None", "--resume", "False",
                            "--lr", "1e-3", "--out_dir", "runs/x"])
    assert (cfg.preset, cfg.batch_size, cfg.max_chars, cfg.resume, cfg.lr, cfg.out_dir) == \
        ("tiny", 4, None, False, 1e-3, "runs/x")
    with pytest.raises(ConfigError, match=r"batch_size=0 must be >= 1"):
        config_from_args(["--batch_size", "0"])
    with pytest.raises(ConfigError, match=r"steps='many' has type str; expected int"):
        config_from_args(["--steps", "many"])
    with pytest.raises(SystemExit):
        config_from_args(["--no-such-field", "1"])


def test_torchrun_command_round_trips_to_the_same_config():
    cfg = TrainConfig(device="cuda", preset="tiny", steps=50, max_chars=None, lr=1e-3, out_dir="runs/a b")
    cmd = torchrun_command(cfg, 4)
    assert cmd.startswith("torchrun --nproc_per_node=4 -m tpu_helpers.train --device cuda --preset tiny")
    args = shlex.split(cmd)[4:]
    assert config_from_args(args) == cfg
    with pytest.raises(ConfigError, match="nproc_per_node=0"):
        torchrun_command(cfg, 0)


def test_torchrun_trains_with_two_cpu_processes(tmp_path):
    out = tmp_path / "ddp"
    # --standalone: a free rendezvous port, so a torchrun elsewhere on the machine (port 29500) cannot collide.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "tpu_helpers.train",
           "--device", "cpu", "--preset", "tiny", "--steps", "10", "--batch_size", "4", "--seq_len", "32",
           "--max_chars", "100000", "--eval_every", "5", "--eval_batches", "2", "--log_every", "5",
           "--warmup_steps", "2", "--out_dir", str(out)]
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert results["world_size"] == 2 and results["report"]["steps"] == 10
    assert results["report"]["device"].startswith("CPU") and "x2 processes" in results["report"]["device"]
    assert results["report"]["tokens_per_step"] == 2 * 4 * 32
    assert results["report"]["final_val_loss"] < results["report"]["first_val_loss"]
    assert sorted(p.name for p in (out / "checkpoints").glob("ckpt-*.pt")) == ["ckpt-00000010.pt"]


@pytest.mark.xla
def test_compile_cache_dir_flag_reaches_the_backend(tmp_path):
    cache, out = tmp_path / "cache", tmp_path / "run"
    cmd = [sys.executable, "-m", "tpu_helpers.train", "--device", "xla", "--spmd", "False", "--preset", "tiny",
           "--steps", "2", "--batch_size", "2", "--seq_len", "16", "--max_chars", "20000", "--eval_every", "100",
           "--save_every", "100", "--log_every", "2", "--warmup_steps", "1", "--compile_cache_dir", str(cache),
           "--out_dir", str(out)]
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "PJRT_DEVICE": "CPU", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads((out / "results.json").read_text())["report"]
    assert report["xla"]["compile_cache_dir"] == str(cache) and any(cache.iterdir())


def test_a_device_that_cannot_be_used_is_one_error_line_not_a_traceback(capsys):
    import torch

    from tpu_helpers.backend import tpu_chip_count
    from tpu_helpers.launch.cli import main

    if tpu_chip_count() or torch.cuda.is_available():
        pytest.skip("an accelerator is attached")
    assert main(["--device", "tpu", "--preset", "tiny"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: device='tpu' cannot be used: no TPU chips") and "Traceback" not in err


def test_a_sharding_this_run_cannot_take_is_one_error_line(capsys, tmp_path):
    from tpu_helpers.launch.cli import main

    # A 2-D mesh needs XLA SPMD; on the CPU (or under torchrun) only "data" and "fsdp" exist.
    args = ["--device", "cpu", "--preset", "tiny", "--dataset", "embedded", "--max_chars", "20000", "--seq_len", "32", "--batch_size", "2",
            "--steps", "1", "--sharding", "2x4", "--out_dir", str(tmp_path / "run")]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: sharding='2x4': a 2-D mesh needs an XLA SPMD run") and "Traceback" not in err
