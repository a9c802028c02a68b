"""Launching runs: notebooks under papermill, the command line, platform setup and multi-chip plans.

    python -m tpu_helpers run notebooks/quickstart.ipynb --target cpu -p STEPS 200
    python -m tpu_helpers.train --preset tiny --steps 100 --device cpu

Modules: `runner` (papermill runs and platform targets), `train` (the CLI / torchrun entry point), `platform`
(Colab and TPU VM setup), `multichip` (SPMD and spawn plans).
"""
