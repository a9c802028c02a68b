"""Turn torch_xla's debug output on in a fresh process, compile three graphs of one tensor op, and print the summary
of the log (tests/diagnostics/test_diagnostics.py).

    python tests/scripts/xla_debug_run.py '{"log": "/tmp/debug.txt"}'
"""

from __future__ import annotations

import torch

from tests.support import print_result, script_args
from tpu_helpers.diagnostics.xla_debug import enable_xla_debug, summarize_xla_debug


def main() -> None:
    log = script_args()["log"]
    enable_xla_debug(log)  # before the runtime starts: torch_xla reads the variables once
    from tpu_helpers.backend import get_backend

    b = get_backend("xla", spmd=False, compile_cache_dir=None)
    x = torch.randn(4, 8, device=b.device)
    kept = []  # a live result makes the sync run its graph
    for n in (3, 4, 5, 5):  # three slice lengths: three graphs, the last one reused
        kept.append(x[:, :n].sum())
        b.sync()
    print_result(summarize_xla_debug(log).to_dict())


if __name__ == "__main__":
    main()
