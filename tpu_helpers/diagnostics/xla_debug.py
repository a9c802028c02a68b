"""torch_xla's own debug output (PT_XLA_DEBUG_LEVEL) for one run, collected to a file and summarised.

torch_xla reads these settings when its runtime starts, i.e. when the first XLA device or tensor is made in the
process. So the switch must be thrown before that:

- in a notebook: `enable_xla_debug("runs/debug.txt")` in the first cells, before `get_backend` (or restart the
  kernel); `enable_xla_debug` refuses once the runtime has started rather than silently doing nothing;
- for a script or notebook run: `python -m tpu_helpers.diagnostics.xla_debug -- python train.py` (or
  `run_with_xla_debug([...])`) runs the command in a fresh process with the settings and prints the summary.

`summarize_xla_debug(path)` reads what torch_xla wrote: how many compilations and executions, how many distinct
graphs, each compilation's cause in XLA's words and the line of user code that triggered it (most useful when the
detector in `tpu_helpers.diagnostics` reports a recompilation).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from tpu_helpers.backend import runtime_env

LEVELS = runtime_env.DEBUG_LEVELS  # 1: compilation analysis and graph sizes; 2: also why each graph executed


def enable_xla_debug(log_file: str | Path, level: int = 2) -> Path:
    """Set the debug variables in this process; only possible before its XLA runtime has started."""
    if runtime_env.runtime_started():
        raise RuntimeError(
            f"the XLA runtime of this process has already started, so torch_xla will not read "
            f"{runtime_env.DEBUG_LEVEL} now: restart the kernel and call enable_xla_debug() before get_backend(), "
            "or run the script with `python -m tpu_helpers.diagnostics.xla_debug -- python script.py`"
        )
    path = Path(log_file)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("")  # torch_xla appends: start from an empty file so the summary is this run's
    os.environ.update(runtime_env.debug_env(path, level))
    return path


@dataclass
class DebugSummary:
    compilations: int = 0
    executions: int = 0
    graphs: int = 0  # distinct graph hashes compiled
    causes: Counter = field(default_factory=Counter)  # compilation cause -> count
    triggers: Counter = field(default_factory=Counter)  # "file:line (function)" of user code -> compilations

    def __str__(self) -> str:
        lines = [f"{self.compilations} compilations of {self.graphs} distinct graphs, {self.executions} executions"]
        lines += [f"  cause: {cause} x{n}" for cause, n in self.causes.most_common()]
        lines += [f"  compiled from {where} x{n}" for where, n in self.triggers.most_common(5)]
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"compilations": self.compilations, "executions": self.executions, "graphs": self.graphs,
                "causes": dict(self.causes), "triggers": dict(self.triggers)}


_FRAME = re.compile(r"^\s+(\S+) \((.+):(\d+)\)$")


def summarize_xla_debug(log_file: str | Path) -> DebugSummary:
    """Parse torch_xla's debug output (see the module docstring)."""
    summary = DebugSummary()
    hashes: set[str] = set()
    kind, mode, frames = None, None, []
    for raw in Path(log_file).read_text(errors="replace").splitlines():
        prefix, _, text = raw.partition(": ")
        if prefix not in ("Compilation Analysis", "Execution Analysis"):
            continue
        if text in ("Compilation Cause", "Execution Cause"):
            kind, mode, frames = text.split()[0], "cause", []
            if kind == "Compilation":
                summary.compilations += 1
            else:
                summary.executions += 1
        elif mode == "cause" and text.startswith("  "):
            if kind == "Compilation":
                summary.causes[text.strip()] += 1
            mode = None
        elif kind == "Compilation" and text.strip().startswith("Graph Hash:"):
            hashes.add(text.split(":", 1)[1].strip())
        elif text.startswith("Python Frame Triggered"):
            mode = "frames"
        elif mode == "frames" and (m := _FRAME.match(text)):
            frames.append(m.groups())
        elif text.startswith("----"):
            if kind == "Compilation" and frames:
                summary.triggers[_user_frame(frames)] += 1
            kind, mode, frames = None, None, []
    summary.graphs = len(hashes)
    return summary


def _user_frame(frames: list[tuple[str, str, str]]) -> str:
    """The innermost frame outside torch, torch_xla and this package's plumbing: the user's line."""
    for func, path, line in frames:
        plumbing = ("site-packages", "dist-packages", "/torch/", "torch_xla", "tpu_helpers/backend/")
        if not any(part in path for part in plumbing):
            return f"{os.path.basename(path)}:{line} ({func})"
    func, path, line = frames[0]
    return f"{os.path.basename(path)}:{line} ({func})"


def run_with_xla_debug(command: list[str], log_file: str | Path, level: int = 2,
                       env: dict | None = None) -> tuple[int, DebugSummary]:
    """Run `command` in a fresh process with the debug output on; returns its exit code and the summary."""
    path = Path(log_file)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("")
    proc = subprocess.run(command, env={**os.environ, **(env or {}), **runtime_env.debug_env(path, level)})
    return proc.returncode, summarize_xla_debug(path)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv or argv.index("--") == len(argv) - 1:
        print("usage: python -m tpu_helpers.diagnostics.xla_debug [--log FILE] [--level 1|2] -- COMMAND ...", file=sys.stderr)
        return 2
    split = argv.index("--")
    opts, command = argv[:split], argv[split + 1:]
    log = opts[opts.index("--log") + 1] if "--log" in opts else "xla_debug.txt"
    level = int(opts[opts.index("--level") + 1]) if "--level" in opts else 2
    code, summary = run_with_xla_debug(command, log, level)
    print(f"\nXLA debug summary ({log}):\n{summary}")
    return code


if __name__ == "__main__":
    raise SystemExit(main())
