"""Helpers of the stack tests: run a stack venv's interpreter, read its installed versions, layer a fresh venv over
it (what a runtime is before anything is installed into it), and make a git repository of this checkout for a
notebook's setup cell to fetch the package from.

    venv = StackVenv("colab", "/root/.cache/tpu_helpers/stack-colab-...")
    venv.run(["-m", "tpu_helpers", "doctor"])              # with this checkout on PYTHONPATH
    runtime = overlay(venv, tmp_path / "runtime")            # sees the stack's packages; installs land in it only
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# The stack tests run their children without the dev venv's own settings leaking in.
_DROP = ("PYTHONPATH", "VIRTUAL_ENV", "PJRT_DEVICE", "CPU_NUM_DEVICES", "XLA_FLAGS", "PIP_FIND_LINKS")


@dataclass(frozen=True)
class StackVenv:
    name: str
    path: str

    @property
    def python(self) -> str:
        return str(Path(self.path) / "bin" / "python")

    @property
    def wheelhouse(self) -> Path:
        return Path(self.path) / "wheelhouse"

    def env(self, checkout: bool = True, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in _DROP}
        env.update(TOKENIZERS_PARALLELISM="false", MPLBACKEND="agg")
        if checkout:
            env["PYTHONPATH"] = str(ROOT)
        env.update(extra)
        return env

    def run(self, args: list[str], *, checkout: bool = True, env: dict[str, str] | None = None, cwd: Path | None = None,
            timeout: int = 900, check: bool = True) -> subprocess.CompletedProcess:
        proc = subprocess.run([self.python, *args], env=self.env(checkout, **(env or {})), cwd=cwd or ROOT,
                              capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise AssertionError(f"{self.name}: python {' '.join(args)} failed ({proc.returncode}):\n"
                                 f"{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")
        return proc

    def versions(self, *dists: str, checkout: bool = False) -> dict[str, str | None]:
        """Installed versions (None when absent) as this interpreter sees them, plus "python"."""
        code = ("import importlib.metadata as m, json, sys\n"
                "def v(d):\n    try:\n        return m.version(d)\n    except m.PackageNotFoundError:\n        return None\n"
                f"print(json.dumps({{'python': '%d.%d.%d' % sys.version_info[:3], **{{d: v(d) for d in {list(dists)!r}}}}}))")
        return json.loads(self.run(["-c", code], checkout=checkout).stdout.strip().splitlines()[-1])


def parse_venvs(text: str) -> dict[str, StackVenv]:
    out = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        name, _, path = item.partition("=")
        out[name] = StackVenv(name, path)
    return out


class NotAsked(Exception):
    """A stack the run did not ask for (`make test-stacks STACKS=...` named others): its tests skip, saying so."""


class Unbuilt(Exception):
    """A stack asked for whose venv is not complete: its tests fail."""


def select(name: str, venvs: dict[str, StackVenv]) -> StackVenv:
    """The venv of stack `name` among `venvs`, the stacks this run asked for (TPU_HELPERS_STACK_VENVS, which `make
    test-stacks` fills with the STACKS it built); NotAsked when they are others, Unbuilt when its venv is not
    complete."""
    if name not in venvs:
        raise NotAsked(f"the {name} stack was not asked for (this run's stacks: {' '.join(sorted(venvs))}); "
                       f"make test-stacks STACKS={name} runs it")
    venv = venvs[name]
    if not (Path(venv.path) / ".complete").exists():
        raise Unbuilt(f"the {name} venv at {venv.path} is not complete: run make test-stacks (it rebuilds it)")
    return venv


def overlay(base: StackVenv, dest: Path) -> StackVenv:
    """A new venv that sees `base`'s packages (a .pth file runs site.addsitedir on base's site-packages) and installs
    into its own: the runtime as shipped, which a test may change without touching the cached stack venv."""
    subprocess.run([base.python, "-m", "venv", "--without-pip", str(dest)], check=True, capture_output=True)
    code = "import site, sysconfig; print(sysconfig.get_paths()['purelib'])"
    base_site = subprocess.run([base.python, "-c", code], check=True, capture_output=True, text=True).stdout.strip()
    own_site = subprocess.run([str(dest / "bin" / "python"), "-c", code], check=True, capture_output=True,
                              text=True).stdout.strip()
    Path(own_site, "_stack_base.pth").write_text(f"import site; site.addsitedir({base_site!r})\n")
    return StackVenv(f"{base.name}-runtime", str(dest))


def site_packages(venv: StackVenv) -> Path:
    code = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    return Path(venv.run(["-c", code], checkout=False).stdout.strip())


def distributions_in(path: Path) -> set[str]:
    """Names of the distributions installed in one site-packages directory (not those it sees through .pth)."""
    return {p.name.split("-")[0].lower().replace("_", "-") for p in path.glob("*.dist-info")}


def offline_pip(wheelhouse: Path) -> dict[str, str]:
    """Environment that makes pip install from `wheelhouse` only (the stack's pinned wheels), never the network."""
    return {"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(wheelhouse), "PIP_DISABLE_PIP_VERSION_CHECK": "1"}


def repository_copy(dest: Path) -> Path:
    """A git repository holding this checkout's files as they are now (committed or not, ignored files left out),
    one commit: what a notebook's setup cell fetches with pip install git+file://..."""
    listed = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            check=True, capture_output=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    git = ["git", "-C", str(dest), "-c", "user.name=stack-test", "-c", "user.email=stack-test@localhost"]
    subprocess.run(["git", "init", "-q", str(dest)], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "the checkout under test"], check=True)
    return dest
