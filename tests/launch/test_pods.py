"""Pod slices: the launch logic of running one command on every host (several hosts cannot be simulated here:
torch_xla 2.9's XLA:CPU client is single-process, so two processes of 4 CPU devices each are two separate 4-device
programs, not one 8-device one; what is tested is the command, the mesh rules, the host split and host-0-writes)."""

from __future__ import annotations

import shlex
from types import SimpleNamespace

import pytest

from tpu_helpers.backend.base import Backend
from tpu_helpers.backend.runtime_env import pod_host
from tpu_helpers.checkpoint import CheckpointManager
from tpu_helpers.config import ConfigError, TrainConfig
from tpu_helpers.launch.pods import host_writes, pod_command, pod_mesh
from tpu_helpers.launch.train import config_from_args
from tpu_helpers.training.trainer import Trainer


def test_pod_command_starts_the_same_training_on_every_worker():
    cfg = TrainConfig(device="tpu", preset="medium", sharding="4x8", steps=100, out_dir="runs/pod a")
    cmd = pod_command(cfg, tpu="my-v5e-32", zone="us-west4-a", project="proj")
    parts = shlex.split(cmd)
    assert parts[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "my-v5e-32"]
    assert "--worker=all" in parts and "--zone=us-west4-a" in parts and "--project=proj" in parts
    remote = shlex.split(parts[-1][len("--command="):])
    assert remote[:5] == ["cd", "~/tpu_helpers", "&&", "python", "-m"] and remote[5] == "tpu_helpers.train"
    assert config_from_args(remote[6:]) == cfg
    with pytest.raises(ConfigError, match="tpu='' must be a non-empty string"):
        pod_command(cfg, tpu="", zone="z")


def test_fsdp_stays_within_a_host_on_a_pod():
    assert pod_mesh("data", 8, 4) == (32, 1)
    assert pod_mesh("4x8", 8, 4) == (4, 8) and pod_mesh("8x4", 8, 4) == (8, 4)
    with pytest.raises(ConfigError, match=r"fsdp over 32 chips spans several of the 4 hosts \(8 chips each\); .*"
                                          r"sharding='4x8'"):
        pod_mesh("fsdp", 8, 4)
    with pytest.raises(ConfigError, match=r"needs 3 x 8 = 24 chips but this run has 32"):
        pod_mesh("3x8", 8, 4)


def test_host_index_from_the_tpu_vm_environment():
    assert pod_host({}) == (0, 1)
    assert pod_host({"TPU_WORKER_ID": "2", "TPU_WORKER_HOSTNAMES": "h0,h1,h2,h3"}) == (2, 4)
    with pytest.raises(ValueError, match=r"TPU_WORKER_ID=5 is outside the 2 hosts"):
        pod_host({"TPU_WORKER_ID": "5", "TPU_WORKER_HOSTNAMES": "h0,h1"})


def test_each_host_loads_its_share_and_only_host_0_writes(tmp_path):
    # 4 hosts x 8 chips, 2 sequences per chip: each host's loader yields 16 rows, 64 over the slice per step.
    loader_rows = Trainer.loader_batch_size.fget(
        SimpleNamespace(config=TrainConfig(batch_size=2), backend=SimpleNamespace(num_replicas=32, world_size=4)))
    assert loader_rows == 16
    one_host = Trainer.loader_batch_size.fget(
        SimpleNamespace(config=TrainConfig(batch_size=2), backend=SimpleNamespace(num_replicas=8, world_size=1)))
    ddp = Trainer.loader_batch_size.fget(
        SimpleNamespace(config=TrainConfig(batch_size=2), backend=SimpleNamespace(num_replicas=2, world_size=2)))
    assert (one_host, ddp) == (16, 2)
    host1 = Backend("fp32")
    host1.rank = 1  # what the XLA backend reads from torch_xla's process index on the second host
    assert not host_writes(host1) and host_writes(Backend("fp32"))
    host1.save({"x": 1}, tmp_path / "results.pt")
    assert not (tmp_path / "results.pt").exists()
    CheckpointManager(tmp_path / "ckpt", is_main=False).save(1, {"model": {}})
    assert not list((tmp_path / "ckpt").glob("ckpt-*"))
