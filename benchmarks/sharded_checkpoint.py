"""Saving a model sharded by FSDP over 8 simulated chips: gathered into one file against written shard by shard.

    PYTHONPATH=. python benchmarks/sharded_checkpoint.py                  # GPT "small" (124M), 2 saves each way
    PYTHONPATH=. python benchmarks/sharded_checkpoint.py --preset mini --saves 3

Each way runs in its own process (CPU_NUM_DEVICES=8, SPMD, sharding="fsdp"): one training step, then `--saves`
checkpoints through the Trainer's own `RunState.save`. "whole" is the format a non-sharded run writes (every tensor
gathered to the host, one torch.save file: what the package did for fsdp before sharded checkpoints); "sharded" is
the torch.distributed.checkpoint directory. Printed per way: XLA compilations during the saves, the save's wall
time (median), the peak of the process's resident memory above what it held before the first save (VmHWM after
resetting it through /proc/self/clear_refs), and the bytes on disk.

What this can and cannot say: on XLA:CPU the "device" memory is host memory, so the resident figure counts both the
devices' buffers and the host copies; the increase during the save is the host copies (the gathered model for
"whole", a tensor's shards at a time for "sharded"). On a TPU VM the devices' HBM is not host memory, so the host
peak of "whole" is the full model's state (weights + AdamW moments, fp32), and that of "sharded" about one tensor.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from tpu_helpers.backend import runtime_env

ROOT = Path(__file__).resolve().parents[1]

_CHILD = r"""
import json, statistics, sys, time
from pathlib import Path
import torch
from tpu_helpers.backend import get_backend
from tpu_helpers.config import TrainConfig
from tpu_helpers.models.gpt import GPT, gpt_config
from tpu_helpers.training.trainer import Trainer

way, preset, saves, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]

def rss_peak():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024

backend = get_backend("xla", spmd=True)
if way == "whole":
    backend.sharded_writer = lambda model: None  # the pre-DCP path: gather everything, one torch.save file
cfg = TrainConfig(device="xla", preset=preset, seq_len=64, steps=1, batch_size=1, lr=1e-4, warmup_steps=0,
                  eval_every=1000, save_every=1000, log_every=1, sharding="fsdp", out_dir=out, keep_last=saves + 1)
torch.manual_seed(0)
model = GPT(gpt_config(preset, block_size=64))
data = torch.randint(0, model.config.vocab_size, (64, 65))
train = torch.utils.data.TensorDataset(data[:, :-1], data[:, 1:])
t = Trainer(model, train, None, config=cfg, backend=backend, progress=False)
t.fit()  # one step and its final save
compiles0 = backend.metrics()["compilations"]
open("/proc/self/clear_refs", "w").write("5")  # reset VmHWM to the current resident size
base = rss_peak()
times = []
for i in range(saves):
    t.step += 1
    start = time.perf_counter()
    path = t.state.save()
    times.append(time.perf_counter() - start)
size = sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file()) if Path(path).is_dir() else Path(path).stat().st_size
params = sum(p.numel() for p in t.raw_model.parameters())
print("RESULT" + json.dumps({"compiles": backend.metrics()["compilations"] - compiles0, "seconds": statistics.median(times),
                             "peak_rss_increase": rss_peak() - base, "disk_bytes": size, "params": params,
                             "state_bytes": params * 4 * 3, "path": str(path)}))
"""


def _run(way: str, preset: str, saves: int, out: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), **runtime_env.xla_cpu_env(devices=8)}
    proc = subprocess.run([sys.executable, "-c", _CHILD, way, preset, str(saves), str(out)], capture_output=True,
                          text=True, env=env, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"{way} run failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.split("RESULT", 1)[1].strip().splitlines()[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--saves", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = {way: _run(way, args.preset, args.saves, Path(tmp) / way) for way in ("whole", "sharded")}
    mib = 1 << 20
    first = next(iter(results.values()))
    print(f"GPT {args.preset!r}: {first['params'] / 1e6:.1f}M parameters, weights + AdamW moments "
          f"{first['state_bytes'] / mib:.0f} MiB (fp32), fsdp over 8 simulated devices, {args.saves} saves each")
    print(f"{'way':8} {'compiles':>9} {'save s':>7} {'host peak +MiB':>15} {'on disk MiB':>12}")
    for way, r in results.items():
        print(f"{way:8} {r['compiles']:>9} {r['seconds']:>7.2f} {r['peak_rss_increase'] / mib:>15.0f} "
              f"{r['disk_bytes'] / mib:>12.0f}")


if __name__ == "__main__":
    main()
