"""Launching runs: notebooks under papermill, the command line, platform setup, multi-chip plans and preflight.

    python -m tpu_helpers run notebooks/quickstart.ipynb --target cpu -p STEPS 200
    python -m tpu_helpers.train --preset tiny --steps 100 --device cpu

Modules: `runner` (papermill runs with a platform target of `tpu_helpers.platform.targets`), `cli` (the command
line and torchrun entry point behind `python -m tpu_helpers.train`), `multichip` (SPMD and spawn plans), `pods` (one
command on every host of a slice), `doctor` (preflight checks). Platform setup is `tpu_helpers.platform`. The top layer: it runs the recipes (`tpu_helpers.recipes`)
and nothing below imports it.
"""
