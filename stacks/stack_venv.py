"""The locked environments: `make lock` writes the lock files, `make setup` / `make test-stacks` build venvs from them.

    python3 stacks/stack_venv.py lock              # re-resolve every lock file at the newest versions allowed
    python3 stacks/stack_venv.py build colab       # the colab stack's venv (cached; prints its path)
    python3 stacks/stack_venv.py paths colab kaggle core latest   # NAME=VENV,... for the stack tests (builds missing)
    python3 stacks/stack_venv.py lock docs         # re-resolve one stack's locks only

Lock files (plain pip requirements files: exact pins of the whole closure, nothing else, so `pip install --no-deps
-r LOCK` then `pip check` rebuilds the set): `requirements-dev.lock` (the dev/CI venv of `make test`: the ranges of
pyproject.toml's extras and requirements-dev.txt, Python 3.11) and one per stack profile under `stacks/`:

- `colab`: what Colab's TPU runtime ships (stacks/colab.txt), Python 3.13; its wheelhouse holds what the notebooks'
  setup cell installs there (requirements-colab.txt resolved *under the colab pins*: if that list ever needed a pin to
  move, `lock` fails, which is the check that it never upgrades what Colab ships);
- `kaggle`: Kaggle's TPU image (stacks/kaggle.txt), Python 3.12, torch/torch_xla 2.8.0 and the newest of the rest;
- `core`: torch and the package's core dependencies only (pyproject's `dependencies` at the dev lock's versions),
  Python 3.11; its wheelhouse holds the `hf` and `notebooks` extras, so the tests install `.[hf,notebooks]` offline;
- `latest`: the newest torch the registry serves, pinned (stacks/latest.txt), without torch_xla, and the newest
  transformers, peft, torchao and the rest, Python 3.12: Colab's CPU/GPU runtimes, where the package's GPU/CPU
  fallback runs on a newer torch than any TPU stack. Its venv holds pytest: the package's CPU tests run in it;
- `docs`: the documentation site's tools (stacks/docs.txt: mkdocs-material, mkdocstrings), Python 3.11, for `make
  docs`; no torch and not the package (the API reference is read from the source statically).

The resolver is uv (`uv pip compile`): it resolves for a named Python version and platform without that interpreter
or a venv, so one command rewrites every lock in seconds, and its output is a pip requirements file, so every
install here is plain pip. uv itself is installed once, at a pinned version, into its own small venv.

Each venv lives in $TPU_HELPERS_VENV_ROOT (default ~/.cache/tpu_helpers) as `stack-NAME-<hash>`, the hash of its lock
files and Python version, and is complete only once its `.complete` stamp exists (an interrupted build is redone).
Standard library only: this runs before any venv exists.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
UV_VERSION = "0.13.9"
# Every venv gets this pip first (a Python's bundled one varies: 3.11's pip 23.2 cannot build the package without the
# `wheel` package, which nothing else needs).
PIP_VERSION = "26.3"
# Linux x86_64 with glibc 2.31 or newer: torch_xla's wheels are manylinux_2_28, Colab's libtpu 0.0.21.1 is 2_31.
PLATFORM = "x86_64-manylinux_2_31"
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?==(\S+)")


@dataclass(frozen=True)
class Lock:
    path: str  # relative to the repository root
    inputs: tuple[str, ...]
    python: str
    extras: tuple[str, ...] = ()
    constraints: tuple[str, ...] = ()


@dataclass(frozen=True)
class Stack:
    python: str
    lock: Lock
    adds: Lock | None = None  # resolved under `lock`; what it adds goes to the venv's wheelhouse, not into the venv
    about: str = ""
    also: tuple[str, ...] = field(default=("setuptools",))  # into the wheelhouse too: builds the package offline
    data: str | None = None  # a pins file installed --no-deps after `pip check`: packages used as data only


DEV = Lock("requirements-dev.lock", ("pyproject.toml", "requirements-dev.txt"), "3.11",
           ("hf", "notebooks", "dev", "qat", "tracking", "smollm2", "eval"))
STACKS = {
    "colab": Stack("3.13", Lock("stacks/colab.lock", ("stacks/colab.txt",), "3.13"),
                   Lock("stacks/colab-adds.lock", ("tpu_helpers/platform/requirements-colab.txt",), "3.13",
                        constraints=("stacks/colab.lock",)),
                   "Colab's TPU runtime as shipped (no peft, no tpu_helpers)"),
    "kaggle": Stack("3.12", Lock("stacks/kaggle.lock", ("stacks/kaggle.txt",), "3.12"),
                    about="Kaggle's TPU v5e-8 image: torch/torch_xla 2.8.0, the newest of the rest"),
    "dev": Stack("3.11", DEV, also=(), data="stacks/dev-data.txt", about="the dev/CI set of make test"),
    "core": Stack("3.11", Lock("stacks/core.lock", ("pyproject.toml",), "3.11", constraints=(DEV.path,)),
                  Lock("stacks/core-adds.lock", ("pyproject.toml",), "3.11", ("hf", "notebooks"),
                       constraints=(DEV.path,)),
                  "torch and the core dependencies only (pip install tpu_helpers)"),
    "latest": Stack("3.12", Lock("stacks/latest.lock", ("stacks/latest.txt",), "3.12"), also=(),
                    about="the newest torch (no torch_xla) and the newest of the rest: Colab's CPU/GPU runtimes"),
    "docs": Stack("3.11", Lock("stacks/docs.lock", ("stacks/docs.txt",), "3.11"), also=(),
                  about="the documentation site's tools: mkdocs-material, mkdocstrings"),
}


class StackError(RuntimeError):
    pass


def venv_root() -> Path:
    return Path(os.environ.get("TPU_HELPERS_VENV_ROOT") or Path.home() / ".cache" / "tpu_helpers")


# ---- lock ------------------------------------------------------------------------------------------------------------
def uv() -> Path:
    """uv at UV_VERSION, in a venv of its own (created on first use with pip)."""
    env = venv_root() / f"uv-{UV_VERSION}"
    exe = env / "bin" / "uv"
    if not exe.exists():
        shutil.rmtree(env, ignore_errors=True)
        _run([sys.executable, "-m", "venv", str(env)])
        _run([str(env / "bin" / "python"), "-m", "pip", "install", "-q", f"uv=={UV_VERSION}"])
    return exe


def compile_lock(lock: Lock, upgrade: bool = True) -> None:
    cmd = [str(uv()), "pip", "compile", *lock.inputs, "--python-version", lock.python, "--python-platform", PLATFORM,
           "--custom-compile-command", "make lock", "--no-progress", "-q", "-o", lock.path]
    cmd += [a for e in lock.extras for a in ("--extra", e)]
    cmd += [a for c in lock.constraints for a in ("-c", c)]
    if upgrade:
        cmd.append("--upgrade")
    # Python builds never come from the network: the resolution is for a version, not an interpreter.
    env = {**os.environ, "UV_PYTHON_DOWNLOADS": "never"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise StackError(f"resolving {lock.path} failed:\n{proc.stderr.strip()}")
    print(f"  {lock.path}: {len(pins(ROOT / lock.path))} pins")


def lock_all(upgrade: bool = True, names: list[str] | None = None) -> None:
    """Every lock, in dependency order (core's are constrained by the dev lock, colab-adds by colab's); `names`: only
    those stacks' locks (the dev lock is then resolved only when "dev" is named)."""
    for name in names or ():
        _stack(name)
    if not names or "dev" in names:
        compile_lock(DEV, upgrade)
    for name, stack in STACKS.items():
        if stack.lock is DEV or (names and name not in names):
            continue
        compile_lock(stack.lock, upgrade)
        if stack.adds:
            compile_lock(stack.adds, upgrade)


def pins(path: Path) -> dict[str, str]:
    """name (normalised) -> "name==version" line of a lock file."""
    out = {}
    for line in path.read_text().splitlines():
        m = PIN.match(line.strip())
        if m:
            out[re.sub(r"[-_.]+", "-", m.group(1)).lower()] = f"{m.group(1)}=={m.group(3)}"
    return out


# ---- build -----------------------------------------------------------------------------------------------------------
def find_python(version: str) -> str:
    """An interpreter of `version`: $TPU_HELPERS_PYTHON_3_13 (for 3.13), pyenv's, then pythonX.Y on PATH (a pyenv shim
    there may exist without working, so each candidate is asked for its version)."""
    var = f"TPU_HELPERS_PYTHON_{version.replace('.', '_')}"
    pyenv = Path(os.environ.get("PYENV_ROOT") or Path.home() / ".pyenv") / "versions"
    candidates = [os.environ.get(var)]
    candidates += sorted((str(p) for p in pyenv.glob(f"{version}.*/bin/python{version}")), reverse=True)
    candidates.append(shutil.which(f"python{version}"))
    for c in candidates:
        if c and os.access(c, os.X_OK):
            proc = subprocess.run([c, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                                  capture_output=True, text=True)
            if proc.returncode == 0 and proc.stdout.strip() == version:
                return c
    raise StackError(f"Python {version} not found (looked at ${var}, {pyenv}/{version}.* and python{version} on "
                     f"PATH): install it (e.g. pyenv install {version}) or set {var}")


def venv_path(name: str) -> Path:
    stack = _stack(name)
    if name == "dev":  # the Makefile's name: venv-<first 12 hex digits of sha256(requirements-dev.lock + dev-data)>
        text = (ROOT / DEV.path).read_bytes() + (ROOT / stack.data).read_bytes()
        return venv_root() / f"venv-{hashlib.sha256(text).hexdigest()[:12]}"
    digest = hashlib.sha256(f"{stack.python} pip {PIP_VERSION}".encode())
    for lock in (stack.lock, stack.adds):
        if lock:
            digest.update((ROOT / lock.path).read_bytes())
    return venv_root() / f"stack-{name}-{digest.hexdigest()[:12]}"


def build(name: str, python: str | None = None) -> Path:
    """The venv of stack `name`, built from its lock unless a complete one exists; returns its path. `python`: the
    interpreter to build it with (default: one of the stack's version, found by `find_python`)."""
    stack, venv = _stack(name), venv_path(name)
    stamp = venv / ".complete"
    if stamp.exists():
        return venv
    t0 = time.time()
    print(f">> building the {name} stack venv ({stack.about}) in {venv} (first run only: a few minutes)",
          file=sys.stderr, flush=True)
    shutil.rmtree(venv, ignore_errors=True)
    _run([python or find_python(stack.python), "-m", "venv", str(venv)])
    pip = [str(venv / "bin" / "python"), "-m", "pip"]
    _run([*pip, "install", "-q", f"pip=={PIP_VERSION}"])
    base = pins(ROOT / stack.lock.path)
    requirements = venv / "lock.txt"
    requirements.write_text("\n".join(base.values()) + "\n")
    _run([*pip, "install", "-q", "--no-deps", "-r", str(requirements)])
    _run([*pip, "check"])
    if stack.data:
        _run([*pip, "install", "-q", "--no-deps", *pins(ROOT / stack.data).values()])
    adds = pins(ROOT / stack.adds.path) if stack.adds else {}
    wheels = [line for key, line in adds.items() if key not in base]
    known = {**base, **adds, **pins(ROOT / DEV.path)}
    wheels += [known.get(a, a) for a in stack.also]
    if wheels:
        _run([*pip, "download", "-q", "--no-deps", "-d", str(venv / "wheelhouse"), *wheels])
    stamp.write_text(json.dumps({"stack": name, "seconds": round(time.time() - t0, 1), "wheelhouse": wheels}) + "\n")
    print(f">> {name} stack venv built in {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    return venv


def _stack(name: str) -> Stack:
    if name not in STACKS:
        raise StackError(f"unknown stack {name!r}; known: {', '.join(STACKS)}")
    return STACKS[name]


def _run(cmd: list[str]) -> None:
    # A lock is the whole closure at exact pins: a machine-wide pip constraints file (pip.conf's `constraint`, e.g.
    # one capping torch at what a local wheel cache holds) would only make a pin it forbids unresolvable.
    env = {**os.environ, "PIP_CONSTRAINT": os.devnull}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    except OSError as err:
        raise StackError(f"cannot run {cmd[0]}: {err}") from None
    if proc.returncode != 0:
        # pip's warnings about this machine's extra local indexes drown the error: keep the lines that matter.
        lines = [x for x in (proc.stdout + proc.stderr).splitlines() if "is ignored: it is neither" not in x]
        raise StackError(f"{' '.join(cmd[:6])} ... failed ({proc.returncode}):\n" + "\n".join(lines[-40:]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    lock = sub.add_parser("lock", help="re-resolve requirements-dev.lock and stacks/*.lock")
    lock.add_argument("--keep", action="store_true", help="keep current pins where the inputs allow (no upgrade)")
    lock.add_argument("stacks", nargs="*", metavar="STACK",
                      help=f"only these stacks' locks (default: all; {', '.join(STACKS)})")
    for name in ("build", "paths"):
        cmd = sub.add_parser(name, help="build the stack venvs (paths: and print NAME=VENV,...)")
        cmd.add_argument("stacks", nargs="+", choices=sorted(STACKS))
        cmd.add_argument("--python", help="the interpreter to build with (one stack only)")
    args = parser.parse_args(argv)
    try:
        if args.command == "lock":
            lock_all(upgrade=not args.keep, names=args.stacks)
        else:
            if args.python and len(args.stacks) > 1:
                raise StackError("--python names the interpreter of one stack; give one stack with it")
            venvs = {name: build(name, args.python) for name in args.stacks}
            if args.command == "paths":
                print(",".join(f"{k}={v}" for k, v in venvs.items()))
            else:
                for path in venvs.values():
                    print(path)
    except StackError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
