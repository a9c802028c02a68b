"""The persistent compile cache seen from a fresh process (tests/backend/test_compile_cache.py), one of:

    python tests/scripts/compile_cache_runs.py '{"case": "train", "cache": DIR, "out": OUT}'
    python tests/scripts/compile_cache_runs.py '{"case": "notebook_sequence", "cache": DIR}'
    python tests/scripts/compile_cache_runs.py '{"case": "setup_pjrt", "cache": DIR}'

"train" trains a tiny model for 3 steps with compile_cache_dir=DIR and prints the report's XLA figures and text.
"notebook_sequence" does what the Colab and v5e-8 notebooks do (the cache given to setup_pjrt, then get_backend
with its default) and prints which cache each step resolved to. "setup_pjrt" turns the cache on through
`platform.setup_pjrt` with no PJRT_DEVICE set and prints the device it chose and the cache in use.
"""

from __future__ import annotations

import os
import warnings

import torch

from tests.support import print_result, script_args


def train(cache: str, out: str) -> None:
    from tpu_helpers.config import TrainConfig
    from tpu_helpers.data import build_datasets
    from tpu_helpers.training.trainer import Trainer

    cfg = TrainConfig(device="xla", preset="tiny", steps=3, batch_size=8, seq_len=32, warmup_steps=1, log_every=3,
                      eval_every=100, save_every=100, compile_cache_dir=cache, out_dir=out)
    train_data, _, tok = build_datasets("embedded", "byte", block_size=32, max_chars=50_000)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(tok.vocab_size, 16), torch.nn.Linear(16, tok.vocab_size))

    def loss(logits, y):
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))

    report = Trainer(model, train_data, None, config=cfg, loss_fn=loss, progress=False).fit()
    print_result({"xla": report.xla, "text": str(report)})


def notebook_sequence(cache: str) -> None:
    os.environ.pop("TPU_HELPERS_XLA_CACHE", None)
    from tpu_helpers import platform
    from tpu_helpers.backend import active_compile_cache, get_backend, resolve_compile_cache, xla_module

    platform.setup_pjrt("xla", compile_cache=cache)  # colab_tpu / tpuvm_v5e8: the cache goes to setup_pjrt first
    # ... then get_backend(...) with its default compile_cache_dir="default". On a TPU that resolves here:
    on_tpu = resolve_compile_cache("default", "TPU", active_compile_cache())
    xla_module().initialize_compile_cache(on_tpu)  # what get_backend does with it: "cannot move" if it differs
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "compile_cache_dir is ignored" either
        backend = get_backend("xla", spmd=False)
    print_result({"on_tpu": on_tpu, "backend": backend.compile_cache_dir})


def setup_pjrt(cache: str) -> None:
    os.environ.pop("PJRT_DEVICE", None)
    from tpu_helpers import platform
    from tpu_helpers.backend import active_compile_cache

    env = platform.setup_pjrt("xla", compile_cache=cache)
    print_result({"device": env["PJRT_DEVICE"], "cache": active_compile_cache()})


def main() -> None:
    args = script_args()
    {"train": lambda: train(args["cache"], args["out"]), "notebook_sequence": lambda: notebook_sequence(args["cache"]),
     "setup_pjrt": lambda: setup_pjrt(args["cache"])}[args["case"]]()


if __name__ == "__main__":
    main()
