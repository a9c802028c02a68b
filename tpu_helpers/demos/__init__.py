"""Teaching code for a notebook, not a job: `xla_loops` runs a deliberately slow training loop (recompiles, host
reads) next to the fixed one for notebooks/xla_debugging.ipynb, and compares what each compiled and cost.

    from tpu_helpers.demos import xla_loops
    rows = xla_loops.compare_loops(config, backend=backend, patterns=["shapes", "item"])
"""
