"""Pod slices: the launch logic of running one command on every host (several hosts cannot be simulated here:
torch_xla 2.9's XLA:CPU client is single-process, so two processes of 4 CPU devices each are two separate 4-device
programs, not one 8-device one; what is tested is the command, the mesh rules, the host split and host-0-writes)."""

from __future__ import annotations

import shlex
from types import SimpleNamespace

import pytest

from tpu_helpers.backend import runtime_env, tpu_host
from tpu_helpers.backend.base import Backend
from tpu_helpers.checkpoint import CheckpointManager
from tpu_helpers.config import ConfigError, TrainConfig
from tpu_helpers.launch import multichip
from tpu_helpers.launch.cli import config_from_args
from tpu_helpers.launch.pods import host_writes, pod_command, pod_mesh
from tpu_helpers.training.trainer import Trainer


def test_pod_command_starts_the_same_training_on_every_worker():
    cfg = TrainConfig(device="tpu", preset="medium", sharding="4x8", steps=100, out_dir="/mnt/shared/pod a")
    cmd = pod_command(cfg, tpu="my-v5e-32", zone="us-west4-a", project="proj", workdir="~/my clone")
    parts = shlex.split(cmd)
    assert parts[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "my-v5e-32"]
    assert "--worker=all" in parts and "--zone=us-west4-a" in parts and "--project=proj" in parts
    remote = parts[-1][len("--command="):]
    # "~/" stays unquoted so the remote shell expands it; the rest of a path with a space is quoted.
    assert remote.startswith("cd ~/'my clone' && . ~/venv/bin/activate && python -m tpu_helpers.train "), remote
    words = shlex.split(remote)
    assert config_from_args(words[words.index("tpu_helpers.train") + 1:]) == cfg
    assert "activate" not in pod_command(cfg, tpu="t", zone="z", venv=None)
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


def test_hosts_of_the_slice_from_where_torch_xla_reads_them(monkeypatch):
    # Recorded value of the TPU VM metadata key worker-network-endpoints on a 4-host slice ("name:uid:ip").
    endpoints = "t1v-n-0:abc:10.130.0.2,t1v-n-1:abd:10.130.0.3,t1v-n-2:abe:10.130.0.4,t1v-n-3:abf:10.130.0.5"
    assert tpu_host.parse_worker_endpoints(endpoints) == ["10.130.0.2", "10.130.0.3", "10.130.0.4", "10.130.0.5"]
    assert tpu_host.slice_hosts({}, fetch=lambda: endpoints) == 4
    assert tpu_host.slice_hosts({"TPU_WORKER_HOSTNAMES": "h0,h1"}, fetch=lambda: endpoints) == 2  # GKE sets it
    assert tpu_host.slice_hosts({}, fetch=lambda: None) == 1  # no metadata server: one host
    assert tpu_host.slice_hosts({}, fetch=lambda: "t1v-n-0:abc:10.130.0.2") == 1  # a v5e-8 VM
    # The whole program spans every host's chips, so each host splits the global batch over all of them.
    monkeypatch.delenv(runtime_env.PJRT_DEVICE, raising=False)  # as on a TPU VM
    assert runtime_env.slice_device_count("tpu", tpu_chips=8, hosts=4) == 32
    assert runtime_env.slice_device_count("cpu", tpu_chips=8, hosts=1) == 1


def test_the_notebook_plans_the_global_batch_over_every_host(monkeypatch):
    monkeypatch.setattr(multichip, "slice_device_count", lambda device: 32)  # 4 hosts x 8 chips, as on a v5e-32
    plan = multichip.plan_multichip(TrainConfig(device="tpu", sharding="4x8"), global_batch=64)
    assert (plan.chips, plan.config.batch_size) == (32, 2)
    pod = SimpleNamespace(num_replicas=32, status=lambda: "TPU v5e x32 (SPMD)")
    multichip.check_backend(plan, pod)
    with pytest.raises(ConfigError, match=r"backend drives 8 devices but the batch was planned for 32 chips"):
        multichip.check_backend(plan, SimpleNamespace(num_replicas=8, status=lambda: "TPU v5e x8"))


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
    # results.json too: the notebooks' save_results writes on host 0 only.
    from tpu_helpers.recipes.pretrain import Pretrain
    from tpu_helpers.training.history import History

    for backend, name in ((host1, "host1"), (Backend("fp32"), "host0")):
        job = Pretrain(TrainConfig(out_dir=str(tmp_path / name)), backend=backend)
        job._trainer, job.report = SimpleNamespace(history=History(), tracking=None), SimpleNamespace(to_dict=dict)
        job.save_results()
    assert not (tmp_path / "host1").exists() and (tmp_path / "host0" / "results.json").exists()
