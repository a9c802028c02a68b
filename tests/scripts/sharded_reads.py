"""Read row-sharded tensors to the host through `backend.to_cpu` four times, each with new values, on an SPMD mesh
(CPU_NUM_DEVICES=8, the caller's) of the JSON argument's "mesh" shape [data, fsdp], with `READ_GATHER_BYTES` set to
its "budget" when given; prints the compilations of each read and whether the values came back whole, and the
graphs run and device seconds the backend counted meanwhile (`step_metrics`, `metrics`, `device_seconds`). For
tests/backend/test_backend.py."""

import torch
import torch_xla.core.xla_model as xm

import tpu_helpers.backend.xla as xla_backend
from tests.support import print_result, script_args
from tpu_helpers.backend import get_backend

args = script_args()
b = get_backend("xla", spmd=True, compile_cache_dir=None)
b.set_mesh(*args["mesh"])
if args.get("budget") is not None:
    xla_backend.READ_GATHER_BYTES = args["budget"]
compiles, same = [], []
counted = (b.step_metrics()["executions"], b.metrics()["executions"], b.device_seconds())
for i in range(4):
    host = {"ids": torch.arange(16 * 5).reshape(16, 5) * (i + 1), "done": torch.arange(16) % (i + 2) == 0}
    dev = {k: b.shard_rows(v.to(b.device)) for k, v in host.items()}
    dev = {k: v * 1 if v.dtype != torch.bool else ~~v for k, v in dev.items()}  # a step's outputs, still sharded
    b.sync()
    before = b.metrics()["compilations"]
    read = b.to_cpu(dev)
    compiles.append(b.metrics()["compilations"] - before)
    same.append(all(torch.equal(read[k], host[k]) and read[k].dtype == host[k].dtype for k in host))
xm.wait_device_ops()  # runs are counted and timed as they finish, asynchronously
runs = (b.step_metrics()["executions"], b.metrics()["executions"], b.device_seconds())
print_result({"compiles": compiles, "same": same, "spec": b.sharding_spec(dev["ids"]),
              "executions": runs[0] - counted[0], "executions_in_metrics": runs[1] - counted[1],
              "device_seconds": runs[2] - counted[2]})
