"""What the tracking tests read in a fresh process (trackio reads TRACKIO_DIR and W&B its settings once each).

    python tests/scripts/tracker_stores.py '{"read": "trackio", "project": "tracking-test"}'  # {run: [log rows]}
    python tests/scripts/tracker_stores.py '{"read": "wandb_login"}'    # check_ready(["wandb"])'s error, or null
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.support import print_result, script_args  # noqa: E402


def main() -> None:
    args = script_args()
    if args["read"] == "trackio":
        from trackio.sqlite_storage import SQLiteStorage  # trackio's own reader of its local store

        project = args["project"]
        logs = {run: SQLiteStorage.get_logs(project, run) for run in SQLiteStorage.get_runs(project)}
        print_result({run: [{k: v for k, v in row.items() if k != "timestamp"} for row in rows]
                      for run, rows in logs.items()})
    elif args["read"] == "wandb_login":
        from tpu_helpers.training.tracking.clients import check_ready

        try:
            check_ready(["wandb"])
        except Exception as err:
            print_result(f"{type(err).__name__}: {err}")
        else:
            print_result(None)


if __name__ == "__main__":
    main()
