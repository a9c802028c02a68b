"""Which heavy modules importing one module of the package loads (tests/test_structure.py). Imports nothing else
of the package or the tests first, so the answer is that module's alone.

    python tests/scripts/light_import.py tpu_helpers.config
"""

from __future__ import annotations

import importlib
import json
import sys

importlib.import_module(sys.argv[1])
print(json.dumps(sorted(m for m in ("torch", "torch_xla", "tpu_helpers.training.trainer", "tpu_helpers.backend")
                        if m in sys.modules)))
