"""Pod slices: the same training command on every host, one host writing the results.

    from tpu_helpers.launch.pods import pod_command
    print(pod_command(config, tpu="my-v5e-32", zone="us-west4-a"))
    # gcloud compute tpus tpu-vm ssh my-v5e-32 --zone=us-west4-a --worker=all --command='cd ~/tpu_helpers && ...'

Under SPMD each host's process drives its own chips as part of one program: each loads its share of every global
batch and host 0 alone writes checkpoints and `results.json`, so the command is the single-host one, started on all
workers at once. SHARDING on a pod: "data", or a "DxF" mesh with F at most one host's chips
(`tpu_helpers.core.sharding.check_hosts`). Every host writes its shards of a checkpoint, so out_dir must be storage all
hosts mount. How the hosts share the work, and an out_dir that is not shared: docs/guides/devices.md.
"""

from __future__ import annotations

import shlex

from tpu_helpers.config import ConfigError, TrainConfig
from tpu_helpers.launch.cli import train_flags

__all__ = ["host_writes", "pod_command", "pod_mesh"]


def pod_command(config: TrainConfig, *, tpu: str, zone: str, workdir: str = "~/tpu_helpers",
                venv: str | None = "~/venv", project: str | None = None) -> str:
    """The gcloud command that starts `python -m tpu_helpers.train` with `config` on every host of slice `tpu`,
    from the clone in `workdir` with the virtual environment `venv` (the setup on docs/platforms/tpu-vm.md; None: none).

    `config.out_dir` should be storage every host mounts (an absolute path on Filestore or a gcsfuse bucket):
    every host reads the checkpoints to resume, and a sharded model's hosts each write their shards there."""
    for name, value in (("tpu", tpu), ("zone", zone), ("workdir", workdir), ("venv", venv or "-")):
        if not isinstance(value, str) or not value.strip():
            raise ConfigError(f"{name}={value!r} must be a non-empty string")
    activate = f" && . {_shell_path(venv)}/bin/activate" if venv else ""
    remote = f"cd {_shell_path(workdir)}{activate} && python -m tpu_helpers.train {' '.join(train_flags(config))}"
    parts = ["gcloud", "compute", "tpus", "tpu-vm", "ssh", tpu, f"--zone={zone}"]
    if project:
        parts.append(f"--project={project}")
    parts += ["--worker=all", f"--command={shlex.quote(remote.rstrip())}"]
    return " ".join(parts)


def _shell_path(path: str) -> str:
    # Quoted for the remote shell, except a leading "~/", which only expands unquoted.
    return "~/" + shlex.quote(path[2:]) if path.startswith("~/") else shlex.quote(path)


def pod_mesh(sharding: str, chips_per_host: int, hosts: int) -> tuple[int, int]:
    """The (data, fsdp) mesh `sharding` means on `hosts` x `chips_per_host` chips, checked for a pod."""
    from tpu_helpers.core.sharding import ShardingError, check_hosts, mesh_shape

    devices = chips_per_host * hosts
    try:
        data, fsdp = mesh_shape(sharding, devices)
        check_hosts(fsdp, devices, hosts)
    except ShardingError as err:
        raise ConfigError(str(err)) from None
    return data, fsdp


def host_writes(backend) -> bool:
    """Whether this host writes checkpoints and results (host 0 of the slice; the only host elsewhere)."""
    return bool(backend.is_main)
