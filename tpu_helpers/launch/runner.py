"""Run notebooks headlessly with papermill: `python -m tpu_helpers run NOTEBOOK [...] --target T -p NAME VALUE`.

Each run executes into `runs/<name>-<timestamp>.running/`, which is renamed to `runs/<name>-<timestamp>/` when the
notebook finished, or to `...failed/` when a cell failed, so a directory without a suffix is always a finished run.
It holds the executed notebook, `params.json`, and the `results.json`/`loss.png` the notebook saved. A target
(`--target`) is a named preset of parameters and environment variables for a platform; `-p` overrides win over it.
Unknown `-p` names are refused before anything runs (papermill itself would only warn).
"""

from __future__ import annotations

import ast
import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tpu_helpers.checkpoint import atomic_write_text
from tpu_helpers.launch.targets import TARGETS, auto_target
from tpu_helpers.training.recipes import RUN_DIR_ENV


class RunError(RuntimeError):
    """A batch run could not start or a notebook failed; the message names the cause."""


def parse_value(text: str) -> Any:
    """Command-line value to Python: numbers, True/False/None, lists as Python literals; anything else a string."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def notebook_parameters(path: Path) -> dict[str, Any]:
    """Names and default values of the notebook's `parameters` cell (error if it has none or several)."""
    import nbformat

    nb = nbformat.read(path, as_version=4)
    tagged = [c for c in nb.cells if "parameters" in c.get("metadata", {}).get("tags", [])]
    if len(tagged) != 1:
        raise RunError(f"{path} has {len(tagged)} cells tagged 'parameters'; papermill needs exactly one")
    values: dict[str, Any] = {}
    for node in ast.parse(tagged[0].source).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            try:
                values[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:
                values[node.targets[0].id] = ast.unparse(node.value)
    return values


@dataclass
class RunResult:
    notebook: str
    directory: Path
    ok: bool
    seconds: float
    error: str | None = None
    results: dict | None = None


def run_notebook(notebook: str | Path, *, target: str = "local", params: dict[str, Any] | None = None,
                 runs_dir: str | Path = "runs", name: str | None = None, kernel: str | None = None) -> RunResult:
    import papermill as pm

    path = Path(notebook)
    if not path.exists():
        raise RunError(f"notebook {str(path)!r} does not exist")
    if target == "auto":
        target = auto_target()
    if target not in TARGETS:
        raise RunError(f"unknown target {target!r}; known targets: {', '.join(['auto', *TARGETS])}")
    declared = notebook_parameters(path)
    params = dict(params or {})
    unknown = sorted(set(params) - set(declared))
    if unknown:
        raise RunError(f"unknown parameter(s) {unknown} for {path.name}; it declares: {', '.join(declared)}")
    # Target presets are generic: apply the names this notebook declares, then the explicit -p values on top.
    merged = TARGETS[target].params_for(path.stem, declared) | params

    stem = name or path.stem
    final = Path(runs_dir) / f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    while final.exists() or final.with_name(final.name + ".running").exists():
        final = final.with_name(final.name + "x")
    work = final.with_name(final.name + ".running")
    work.mkdir(parents=True)
    atomic_write_text(work / "params.json", json.dumps({"target": target, "parameters": merged}, indent=2))
    env_before = {k: os.environ.get(k) for k in [*TARGETS[target].env, RUN_DIR_ENV]}
    os.environ.update(TARGETS[target].env)
    os.environ[RUN_DIR_ENV] = str(work.resolve())
    started = time.perf_counter()
    error = None
    try:
        pm.execute_notebook(str(path), str(work / path.name), parameters=merged, cwd=os.getcwd(),
                            kernel_name=kernel, progress_bar=False, log_output=False)
    except pm.PapermillExecutionError as err:
        first_line = (err.source or "").strip().splitlines()[0] if err.source else ""
        error = (f"cell {err.cell_index} (execution count {err.exec_count}) failed: {err.ename}: "
                 f"{err.evalue}" + (f"\n  cell starts with: {first_line}" if first_line else ""))
    except Exception as err:  # a dead kernel, a missing kernelspec...: still a failed run, not a running one
        error = f"the notebook did not run to the end: {type(err).__name__}: {err}"
    except BaseException:  # Ctrl-C: leave a failed directory behind, never one that looks running or finished
        os.replace(work, final.with_name(final.name + ".failed"))
        raise
    finally:
        for k, v in env_before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    seconds = time.perf_counter() - started
    done = final if error is None else final.with_name(final.name + ".failed")
    os.replace(work, done)
    results_file = done / "results.json"
    results = json.loads(results_file.read_text()) if results_file.exists() else None
    return RunResult(str(path), done, error is None, seconds, error, results)


def summary_table(results: list[RunResult]) -> str:
    rows = [("notebook", "status", "seconds", "val loss", "tokens/s", "directory")]
    for r in results:
        rep = (r.results or {}).get("report", {})
        val = rep.get("final_val_loss")
        tok = rep.get("tokens_per_s")
        rows.append((Path(r.notebook).name, "ok" if r.ok else "FAILED", f"{r.seconds:.0f}",
                     f"{val:.3f}" if isinstance(val, float) else "-",
                     f"{tok:,.0f}" if isinstance(tok, (int, float)) else "-", str(r.directory)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in rows)


_PARAM_NAME = re.compile(r"^[A-Z][A-Z0-9_]*$")


def parse_params(pairs: list[list[str]]) -> dict[str, Any]:
    params = {}
    for name, value in pairs:
        if not _PARAM_NAME.match(name):
            raise RunError(f"parameter name {name!r} must be UPPER_CASE like the notebook's parameters cell")
        params[name] = parse_value(value)
    return params
