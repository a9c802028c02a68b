"""`python -m tpu_helpers.train ...` (and `torchrun ... -m tpu_helpers.train`): the command-line entry point.

The code lives in `tpu_helpers.launch.cli`; this module keeps the short, documented command working.
"""

import sys

from tpu_helpers.launch.cli import main

if __name__ == "__main__":
    sys.exit(main())
