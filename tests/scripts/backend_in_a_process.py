"""What the backend says in a fresh process (tests/backend/test_backend.py), one of:

    python tests/scripts/backend_in_a_process.py '{"case": "spmd"}'        # status of get_backend("xla")
    python tests/scripts/backend_in_a_process.py '{"case": "no_torch_xla"}'   # torch_xla's metadata hidden
    python tests/scripts/backend_in_a_process.py '{"case": "mismatch"}'     # torch claims 2.8.0, torch_xla fails

The last two install a fault before the package is imported (hence a process of their own) and print the
BackendUnavailable message. And, with a stand-in `torch_tpu` on PYTHONPATH (or none):

    python tests/scripts/backend_in_a_process.py '{"case": "torch_tpu", "sysfs": "/tmp/v6e", "torch": "2.11.0",
                                                   "calls": [["tpu", false], ["tpu", true], ["auto", false]]}'

hides torch_xla (its import and its metadata; with `"torch_xla": "broken"` its import only), makes the recorded sysfs tree the host's PCI bus and torch claim
`torch`, then prints what each get_backend(device, fallback=...) did (the error, or the backend's name, with the
warnings) and whether anything imported torch_tpu.
"""

from __future__ import annotations

import importlib.metadata as md
import sys

from tests.support import print_result, script_args


def hide_torch_xla() -> None:
    real = md.version

    def fake(name: str) -> str:
        if name.replace("-", "_").lower() == "torch_xla":
            raise md.PackageNotFoundError(name)
        return real(name)

    md.version = fake
    sys.modules["torch_xla"] = None  # an import of it fails as if absent


def torch_tpu_case(args: dict) -> None:
    import warnings

    import torch

    if args.get("torch_xla") == "broken":  # installed (its metadata stays), but its import fails
        sys.modules["torch_xla"] = None
    else:
        hide_torch_xla()
    torch.__version__ = args.get("torch", torch.__version__)
    from tpu_helpers.backend import BackendUnavailable, get_backend, tpu_host

    if args.get("sysfs"):
        real_chips = tpu_host.tpu_chips
        tpu_host.tpu_chips = lambda sysfs_root="/sys": real_chips(args["sysfs"] if sysfs_root == "/sys" else sysfs_root)
    results = []
    for device, fallback in args["calls"]:
        out: dict = {}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                out["backend"] = get_backend(device, fallback=fallback).name
            except BackendUnavailable as err:
                out["error"] = str(err)
        out["warnings"] = [str(w.message) for w in caught]
        results.append(out)
    print_result({"calls": results, "imported_torch_tpu": "torch_tpu" in sys.modules})


def main() -> None:
    case = script_args()["case"]
    if case == "torch_tpu":
        torch_tpu_case(script_args())
        return
    if case == "no_torch_xla":
        hide_torch_xla()
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
