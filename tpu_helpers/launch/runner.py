"""Run notebooks headlessly with papermill: `python -m tpu_helpers run NOTEBOOK [...] --target T -p NAME VALUE`.

Each run executes into `<OUT_DIR>/<name>-<timestamp>.running/` (the notebook's OUT_DIR, where its checkpoints and
exports go: one folder per run; `runs/` for a notebook without one, or `--runs-dir`), renamed when it ends to
`<name>-<timestamp>/` (finished), `...failed/` or `...stopped/` (a signal stopped it); it holds the executed
notebook, `params.json` and the results the notebook saved. The runner passes a first SIGTERM or Ctrl-C on to the
kernel process, where `Trainer.fit` saves and returns and the rest of the notebook runs; a second stops everything
at once. A target (`--target`) is a named preset of parameters and environment variables for a platform; `-p`
overrides win over it, and unknown `-p` names are refused before anything runs, naming the nearest. Signals and the
run directories in full: docs/guides/headless.md.
"""

from __future__ import annotations

import ast
import json
import os
import re
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tpu_helpers.core.atomic_io import atomic_write_text
from tpu_helpers.core.choices import misspelt
from tpu_helpers.platform import auto_target
from tpu_helpers.platform.targets import TARGETS
from tpu_helpers.training.results import RUN_DIR_ENV


class RunError(RuntimeError):
    """A batch run could not start or a notebook failed; the message names the cause."""


def parse_value(text: str) -> Any:
    """Command-line value to Python: numbers, True/False/None, lists as Python literals; anything else a string."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def declared_parameters(path: Path) -> dict[str, Any]:
    """Names and default values of the notebook's `parameters` cell (error if it has none or several)."""
    import nbformat

    _check_notebook_path(path)
    try:
        nb = nbformat.read(path, as_version=4)
    except Exception as err:  # not JSON, not a notebook, unreadable
        raise RunError(f"notebook {str(path)!r} cannot be read as a Jupyter notebook: {type(err).__name__}: "
                       f"{str(err).strip().splitlines()[0] if str(err).strip() else ''}") from None
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


def tpu_preflight(device: Any, env: dict[str, str], **roots: Any) -> None:
    """Refuse to start a child kernel that needs the TPU while a process (this one included) holds it: the child
    would fail deep inside libtpu. `roots` (sysfs_root, proc_root, lockfile) are for tests."""
    from tpu_helpers.backend.tpu_host import TpuBusy, check_tpu_free, may_use_tpu

    if not may_use_tpu(device, env):
        return
    try:
        check_tpu_free(include_self=True, **roots)
    except TpuBusy as err:
        raise RunError(f"cannot start the notebook's kernel: {err}") from None


class KernelSignals:
    """While a notebook runs: pass SIGTERM/SIGINT on to its kernel (see the module docstring)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.km: Any = None  # the kernel manager, set when nbclient creates it
        self.received: list[int] = []
        self._previous: dict = {}

    def manager_class(self) -> type:
        """A kernel manager class that reports each instance back here (nbclient creates it itself), talks to the
        kernel encrypted where the kernel can, and shuts it down without interrupting it first."""
        import zmq
        from jupyter_client.manager import AsyncKernelManager

        tracker = self
        # Where jupyter_client and the kernelspec know CurveZMQ (jupyter_client >= 8.10, ipykernel >= 7), the
        # manager provisions the keys: no "running over TCP without encryption" warning from the kernel.
        encrypt = "transport_encryption" in AsyncKernelManager.class_traits() and zmq.has("curve")

        class TrackedKernelManager(AsyncKernelManager):
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                if encrypt:
                    kwargs.setdefault("transport_encryption", "auto")
                super().__init__(*args, **kwargs)
                tracker.km = self

            async def _async_interrupt_kernel(self) -> None:
                # jupyter_client interrupts a kernel before every shutdown. nbclient shuts down a kernel whose
                # cells are done, so that SIGINT only lands in the kernel's own last steps, which log it as
                # "ERROR | KeyboardInterrupt caught in kernel" after a run that succeeded. A kernel that does not
                # go on the shutdown request still gets SIGTERM, then SIGKILL (finish_shutdown).
                if self.shutting_down:
                    return
                await super()._async_interrupt_kernel()

        return TrackedKernelManager

    def kernel_pid(self) -> int | None:
        process = getattr(getattr(self.km, "provisioner", None), "process", None)
        return getattr(process, "pid", None)

    def _forward(self, signum: int) -> int | None:
        pid = self.kernel_pid()
        if pid is not None:
            try:
                os.kill(pid, signum)
            except OSError:
                return None
        return pid

    def handle(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        self.received.append(signum)
        pid = self._forward(signum)
        where = f"the notebook's kernel (pid {pid})" if pid else "no kernel (none is running yet)"
        if pid is None:  # nothing is training yet, so there is nothing to save: stop before a kernel starts
            _say(f"received {name} before the notebook's kernel started: stopping now")
        elif len(self.received) == 1:
            _say(f"received {name}: passed it to {where}; a training run finishes its step, saves a checkpoint "
                 "and stops (send it again to stop at once)")
            return
        else:
            _say(f"received {name} again: passed it to {where} and stopping now")
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(128 + signum)

    def __enter__(self) -> KernelSignals:
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.getsignal(s) for s in self.SIGNALS}
            for s in self.SIGNALS:
                signal.signal(s, self.handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)

    def stop_kernel(self, grace: float = 3.0) -> None:
        """After a second signal: give the kernel `grace` seconds to go, then SIGKILL it (never leave it training)."""
        pid = self.kernel_pid()
        process = getattr(getattr(self.km, "provisioner", None), "process", None)
        if pid is None or process is None:
            return
        deadline = time.monotonic() + grace
        while process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if process.poll() is None:
            try:
                os.kill(pid, signal.SIGKILL)
                process.wait(5)
            except (OSError, Exception):
                pass


def _say(message: str) -> None:
    print(f"[tpu_helpers] {message}", file=sys.stderr, flush=True)


def _check_notebook_path(path: Path) -> None:
    if not path.exists():
        raise RunError(f"notebook {str(path)!r} does not exist")
    if path.is_dir():
        raise RunError(f"notebook {str(path)!r} is a directory; give a .ipynb file inside it")
    if path.suffix != ".ipynb":
        raise RunError(f"notebook {str(path)!r} is not a Jupyter notebook (expected a .ipynb file)")


@dataclass
class RunResult:
    notebook: str
    directory: Path
    ok: bool
    seconds: float
    error: str | None = None
    results: dict | None = None
    stopped_by: str | None = None  # the signal that stopped the run ("SIGTERM"), if one did


def run_home(parameters: dict[str, Any]) -> Path:
    """Where a run's directory goes: the notebook's OUT_DIR (its checkpoints, exports and results), so that one run
    is one folder; `runs/` for a notebook without an OUT_DIR."""
    out_dir = parameters.get("OUT_DIR")
    return Path(out_dir) if isinstance(out_dir, str) and out_dir.strip() else Path("runs")


def run_notebook(notebook: str | Path, *, target: str = "local", params: dict[str, Any] | None = None,
                 runs_dir: str | Path | None = None, name: str | None = None, kernel: str | None = None) -> RunResult:
    """Execute `notebook` with `params` over the target's presets into a run directory under `runs_dir` (default:
    `run_home`, the notebook's OUT_DIR) and read back its results."""
    import papermill as pm

    path = Path(notebook)
    _check_notebook_path(path)
    if target == "auto":
        target = auto_target()
    if target not in TARGETS:
        raise RunError(f"unknown target {target!r}; known targets: {', '.join(['auto', *TARGETS])}")
    declared = declared_parameters(path)
    params = dict(params or {})
    unknown = sorted(set(params) - set(declared))
    if unknown:
        raise RunError(f"unknown parameter(s) {unknown} for {path.name}; it declares: {', '.join(declared)}."
                       f"{misspelt(unknown, declared)}")
    # Target presets are generic: apply the names this notebook declares, then the explicit -p values on top.
    merged = TARGETS[target].params_for(path.stem, declared) | params
    tpu_preflight(merged.get("DEVICE", declared.get("DEVICE")), TARGETS[target].env)

    stem = name or path.stem
    home = Path(runs_dir) if runs_dir is not None else run_home(merged)
    final = home / f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}"
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
    signals = KernelSignals()
    try:
        with signals:
            pm.execute_notebook(str(path), str(work / path.name), parameters=merged, cwd=os.getcwd(),
                                kernel_name=kernel, progress_bar=False, log_output=False,
                                kernel_manager_class=signals.manager_class())
    except pm.PapermillExecutionError as err:
        first_line = (err.source or "").strip().splitlines()[0] if err.source else ""
        error = (f"cell {err.cell_index} (execution count {err.exec_count}) failed: {err.ename}: "
                 f"{err.evalue}" + (f"\n  cell starts with: {first_line}" if first_line else ""))
    except Exception as err:  # a dead kernel, a missing kernelspec...: still a failed run, not a running one
        error = f"the notebook did not run to the end: {type(err).__name__}: {err}"
    except BaseException:  # a second signal: leave a failed directory behind, never one that looks running
        os.replace(work, final.with_name(final.name + ".failed"))
        signals.stop_kernel()
        raise
    finally:
        for k, v in env_before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    seconds = time.perf_counter() - started
    stopped_by = signal.Signals(signals.received[0]).name if signals.received else None
    if error is None and stopped_by is not None:
        error = f"stopped by {stopped_by}: the notebook's training saved a checkpoint and the notebook ran to its end"
        done = final.with_name(final.name + ".stopped")
    else:
        done = final if error is None else final.with_name(final.name + ".failed")
    os.replace(work, done)
    results_file = done / "results.json"
    results = json.loads(results_file.read_text()) if results_file.exists() else None
    return RunResult(str(path), done, error is None, seconds, error, results, stopped_by)


def summary_table(results: list[RunResult]) -> str:
    rows = [("notebook", "status", "seconds", "val loss", "tokens/s", "directory")]
    for r in results:
        rep = (r.results or {}).get("report", {})
        val = rep.get("final_val_loss")
        tok = rep.get("tokens_per_s")
        status = "ok" if r.ok else "STOPPED" if r.stopped_by else "FAILED"
        rows.append((Path(r.notebook).name, status, f"{r.seconds:.0f}",
                     f"{val:.3f}" if isinstance(val, float) else "-",
                     f"{tok:,.0f}" if isinstance(tok, (int, float)) else "-", str(r.directory)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in rows)


def _figure(value: Any) -> str:
    return f"{value:.2f}" if isinstance(value, (int, float)) else "-"


def _held_out(res: dict, measured: Any) -> str:
    """' (10% of DATASET, 41 records)': where the held-out records of results.json came from and how many a figure
    was measured on (`measured`, else all of them); empty for results that do not say."""
    held = res.get("held_out")
    if not isinstance(held, dict) or "source" not in held:
        return ""
    n = measured if isinstance(measured, int) else held.get("records")
    return f" ({held['source']}, {n} record{'' if n == 1 else 's'})"


def highlights(result: RunResult, *, answers: int = 4) -> list[str]:
    """What a finished run of a Hugging Face notebook shows on the terminal (`python -m tpu_helpers run`): its
    held-out figure before and after training, as "held-out reward: 0.09 -> 0.84 (10% of DATASET, 41 records)"
    (GRPO's mean reward; fine-tuning's exact match; DPO's preference accuracy; where the held-out records come from
    and how many), for agents also the turns per episode and the tool-call success rate, `answers` held-out answers
    before -> after (an episode's final answer), and the figures it saved (`*.png` in the run directory). Nothing
    for a notebook whose results hold none of these."""
    res = result.results or {}
    before, after = res.get("samples_before") or {}, res.get("samples_after") or {}
    held = _held_out(res, len(after["rows"]) if after.get("rows") else None)  # the samples' figures: every row
    lines = []
    for key, name in (("reward", "held-out reward"), ("accuracy", "held-out preference accuracy")):
        pair = res.get(key)
        if isinstance(pair, dict) and {"before", "after"} <= set(pair):
            was, now = (v.get("accuracy") if isinstance(v, dict) else v for v in (pair["before"], pair["after"]))
            where = _held_out(res, pair["after"].get("pairs")) if isinstance(pair["after"], dict) else held
            lines.append(f"{name}: {_figure(was)} -> {_figure(now)}{where}")
    for key, name in (("turns", "held-out turns per episode"), ("tool_success", "held-out tool-call success")):
        pair = res.get(key)  # the agents notebook's (GRPO on episodes); a rate of None: no tool call made
        if isinstance(pair, dict) and {"before", "after"} <= set(pair):
            lines.append(f"{name}: {_figure(pair['before'])} -> {_figure(pair['after'])}{held}")
    if "exact_match" in before and "exact_match" in after:
        lines.append(f"held-out exact match: {_figure(before['exact_match'])} -> {_figure(after['exact_match'])}"
                     f"{held}")
    rows = list(zip(before.get("rows") or [], after.get("rows") or [], strict=False))[:answers]
    if rows:
        lines.append("held-out answers, before -> after:")
    for was, now in rows:
        said = [r.get("completion", r.get("prediction")) for r in (was, now)]
        answer = was.get("answer", was.get("chosen"))  # None for an episode whose answer only its environment knows
        lines.append(f"  {was.get('prompt')!r}{'' if answer is None else f' ({answer})'}: {said[0]!r} -> {said[1]!r}")
    lines += [f"figure: {path}" for path in sorted(Path(result.directory).glob("*.png"))]
    return lines


_PARAM_NAME = re.compile(r"^[A-Z][A-Z0-9_]*$")


def parse_params(pairs: list[list[str]]) -> dict[str, Any]:
    params = {}
    for name, value in pairs:
        if not _PARAM_NAME.match(name):
            raise RunError(f"parameter name {name!r} must be UPPER_CASE like the notebook's parameters cell")
        params[name] = parse_value(value)
    return params
