"""Command line: `python -m tpu_helpers run NOTEBOOK [NOTEBOOK ...] [--target T] [-p NAME VALUE ...]`.

Several notebooks run one after another, then a summary table; the exit status is non-zero if any failed, and
128 + the signal's number (143 for SIGTERM, 130 for SIGINT) when a signal stopped the batch.
`python -m tpu_helpers targets` lists the targets. `python -m tpu_helpers doctor` checks this machine (versions,
TPU chips and lock, hugepages, compile cache, PJRT variables, widgets) and prints the fix for each failing check.
"""

from __future__ import annotations

import argparse
import signal
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tpu_helpers", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="execute notebooks with papermill")
    run.add_argument("notebooks", nargs="+", help="notebook paths")
    run.add_argument("--target", default="local", help="parameter preset for a platform (see `targets`)")
    run.add_argument("-p", "--param", nargs=2, action="append", default=[], metavar=("NAME", "VALUE"),
                     help="override a parameter (values are Python literals; anything else is a string)")
    run.add_argument("--runs-dir", default=None, help="where run directories are created (default: the notebook's "
                     "OUT_DIR, where its checkpoints and exports go; runs/ for a notebook without one)")
    run.add_argument("--kernel", default=None, help="Jupyter kernel name (default: the notebook's)")
    sub.add_parser("targets", help="list the targets")
    sub.add_parser("doctor", help="check this machine before training (prints the fix for each failing check)")
    args = parser.parse_args(argv)

    if args.command == "doctor":
        from tpu_helpers.launch.doctor import main as doctor_main

        return doctor_main()

    from tpu_helpers.launch.runner import RunError, highlights, parse_params, run_notebook, summary_table
    from tpu_helpers.platform.targets import TARGETS

    if args.command == "targets":
        for name, target in TARGETS.items():
            print(f"{name:14s} {target.description}")
        return 0
    try:
        params = parse_params(args.param)
        results = []
        for nb in args.notebooks:
            print(f">> running {nb} (target {args.target})", flush=True)
            result = run_notebook(nb, target=args.target, params=params, runs_dir=args.runs_dir, kernel=args.kernel)
            status = "   ok: " if result.ok else "   STOPPED: " if result.stopped_by else "   FAILED: "
            print(status + (result.error or str(result.directory)), flush=True)
            for line in highlights(result):  # the held-out figure before -> after, a few answers, the figures
                print("   " + line, flush=True)
            results.append(result)
            if result.stopped_by:  # a stop request covers the whole batch, not just this notebook
                break
    except RunError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # a second Ctrl-C: the run directory was renamed .failed, the kernel stopped
        print("stopped (second SIGINT)", file=sys.stderr)
        return 128 + signal.SIGINT
    print()
    print(summary_table(results))
    stopped = next((r.stopped_by for r in results if r.stopped_by), None)
    if stopped is not None:
        return 128 + signal.Signals[stopped].value  # as a process stopped by that signal reports it
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
