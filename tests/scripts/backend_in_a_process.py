"""What the backend says in a fresh process (tests/backend/test_backend.py), one of:

    python tests/scripts/backend_in_a_process.py '{"case": "spmd"}'        # status of get_backend("xla")
    python tests/scripts/backend_in_a_process.py '{"case": "no_torch_xla"}'   # torch_xla's metadata hidden
    python tests/scripts/backend_in_a_process.py '{"case": "mismatch"}'     # torch claims 2.8.0, torch_xla fails

The last two install a fault before the package is imported (hence a process of their own) and print the
BackendUnavailable message.
"""

from __future__ import annotations

import importlib.metadata as md
import sys

from tests.support import print_result, script_args


def main() -> None:
    case = script_args()["case"]
    if case == "no_torch_xla":
        real = md.version

        def fake(name: str) -> str:
            if name == "torch_xla":
                raise md.PackageNotFoundError(name)
            return real(name)

        md.version = fake
    elif case == "mismatch":  # another torch version, and the torch_xla import failing as a mismatched build does
        import torch

        torch.__version__ = "2.8.0"
        sys.modules["torch_xla"] = None
    from tpu_helpers.backend import BackendUnavailable, get_backend

    try:
        b = get_backend("xla")
    except BackendUnavailable as err:
        print_result({"error": str(err)})
        return
    print_result({"status": b.status(), "replicas": b.num_replicas, "world_size": b.world_size,
                  "loader": list(b.loader_rank_and_world)})


if __name__ == "__main__":
    main()
