"""The leaves every other part stands on: torch-free at import, importing nothing else of the package.

- `atomic_io`: files that are never half-written (temp file, fsync, rename);
- `hardware`: the accelerator catalog (memory, peak FLOP/s, bandwidth, price per chip);
- `choices`: the allowed value of every choice, `check_choice` and `ConfigError`;
- `sharding`: the SHARDING value and the (data, fsdp) mesh it means;
- `callbacks`: the hooks a run calls (`Callback`);
- `extras`: the pip extras and `MissingExtra`, the error that names a missing one;
- `lazy`: a package's names imported from their modules on first use (`lazy_exports`).

    from tpu_helpers.core.choices import ConfigError, check_choice
    from tpu_helpers.core.hardware import lookup
"""
