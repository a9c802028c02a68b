"""Where an installed tpu_helpers reads its files from (tests/launch/test_wheel_install.py): run with PYTHONPATH set
to a `pip install --target` folder and from another directory, so nothing can come from the source checkout. It
imports nothing from the checkout (not even tests.support).

    PYTHONPATH=SITE python tests/scripts/installed_probe.py
"""

from __future__ import annotations

import json
import os

import tpu_helpers
from tpu_helpers import platform
from tpu_helpers.memory.compiled import child_env

print(json.dumps({"package": tpu_helpers.__file__, "requirements": str(platform.colab_requirements()),
                  "missing": platform.install_missing(dry_run=True),  # what the Colab notebook calls
                  "child_path": child_env("CPU", "/tmp/dump")["PYTHONPATH"].split(os.pathsep)[0]}))
