"""Persistent compile cache: compile time of a second process against the first, same program and cache dir.

    PJRT_DEVICE=CPU python benchmarks/compile_cache.py --preset tiny      # XLA:CPU (see the note below)
    python benchmarks/compile_cache.py --preset small                    # on a TPU VM

Runs the same short training twice, each in a fresh process with one cache directory, and prints each run's
compile time (torch_xla's CompileTime metric, which includes loading from the cache) and cache counters.
Target: second / first <= 10%. On XLA:CPU with torch_xla 2.9 the second run finds every program but cannot load
it ("Deserializing serialized executable not supported"), so the target can only be checked on a TPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = """
import json
from tpu_helpers.recipes.pretrain import Pretrain
from tpu_helpers.config import TrainConfig
cfg = TrainConfig(device="xla", preset={preset!r}, steps=3, batch_size=8, seq_len={seq_len}, warmup_steps=1,
                  log_every=3, eval_every=10**6, save_every=10**6, out_dir={out!r}, compile_cache_dir={cache!r},
                  max_chars=100_000)
report = Pretrain(cfg, progress=False).train()
print("RESULT " + json.dumps(report.xla))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--cache-dir", default=None, help="default: a new temporary directory")
    args = ap.parse_args()
    cache = args.cache_dir or tempfile.mkdtemp(prefix="xla_cache_")
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    results = []
    for i in range(2):
        code = CHILD.format(preset=args.preset, seq_len=args.seq_len, out=tempfile.mkdtemp(), cache=cache)
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
        xla = json.loads(line[len("RESULT "):])
        results.append(xla)
        print(f"process {i + 1}: {xla['compilations']} compilations, {xla['compile_seconds']:.2f} s compiling; "
              f"cache hits {xla['persistent_cache_hits']}, misses {xla['persistent_cache_misses']}, failed loads "
              f"{xla['persistent_cache_deserialize_failures']}")
    first, second = results
    ratio = second["compile_seconds"] / first["compile_seconds"] if first["compile_seconds"] else float("nan")
    print(f"\npreset {args.preset}, cache {cache}: second/first compile time = {ratio:.1%} (target <= 10%)")
    if second["persistent_cache_deserialize_failures"]:
        print("the second process found the programs but could not load them: this torch_xla/PJRT plugin cannot "
              "deserialise executables, so the cache saves nothing here")


if __name__ == "__main__":
    main()
