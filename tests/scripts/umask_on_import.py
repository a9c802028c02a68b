"""Record every umask change while tpu_helpers.checkpoint is imported and a file is written atomically
(tests/test_checkpoint.py). It imports nothing of the package before its hook is in place, so that import counts.

    python tests/scripts/umask_on_import.py FILE
"""

from __future__ import annotations

import json
import os
import sys

calls: list[int] = []
real = os.umask
os.umask = lambda mask: calls.append(mask) or real(mask)  # record every change, at import and per write
real(0o027)
import tpu_helpers.checkpoint  # noqa: E402,F401
from tpu_helpers.core.atomic_io import atomic_write_text  # noqa: E402

atomic_write_text(sys.argv[1], "{}")
print("RESULT " + json.dumps({"calls": calls, "umask": oct(real(0o027)), "mode": oct(os.stat(sys.argv[1]).st_mode & 0o777)}))
