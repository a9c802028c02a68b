"""The package's shape: backend/ alone knows torch_xla and the XLA/PJRT environment, the light modules stay light,
and no modules import each other in a cycle. Static checks on the source plus two fresh interpreters."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "tpu_helpers"
ROOT = PACKAGE.parent

# Names torch_xla / PJRT / XLA read from the environment, and the compiler's flags.
RUNTIME_NAME = re.compile(r"\b(PJRT_[A-Z_]+|PT_XLA_[A-Z_]+|XLA_[A-Z_]+|[A-Z]+_NUM_DEVICES|TPU_ACCELERATOR_TYPE)\b"
                          r"|--xla_\w+")


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                ids.add(id(first.value))
    return ids


def runtime_knowledge(source: str) -> list[str]:
    """What in `source` imports torch_xla or names an XLA/PJRT variable or flag (docstrings and comments aside)."""
    tree = ast.parse(source)
    docs = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module or ""]
        if isinstance(node, ast.Call) and ast.unparse(node.func).endswith(("import_module", "__import__")) \
                and node.args and isinstance(node.args[0], ast.Constant):
            names = [str(node.args[0].value)]
        found += [f"line {node.lineno}: import {n}" for n in names if n.split(".")[0] == "torch_xla"]
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            found += [f"line {node.lineno}: {m.group(0)!r}" for m in RUNTIME_NAME.finditer(node.value)]
    return found


def test_the_checker_sees_what_it_must():
    bad = 'import torch_xla.core.xla_model as xm\nimport os\nos.environ["PJRT_DEVICE"] = "CPU"\n' \
          'flags = f"--xla_dump_to={d}"\nimportlib.import_module("torch_xla")\n'
    assert len(runtime_knowledge(bad)) == 4
    fine = '"""Docstrings may explain PJRT_DEVICE and torch_xla."""\n# so may comments: XLA_FLAGS\nx = "xla"\n'
    assert runtime_knowledge(fine) == []


def test_only_backend_knows_torch_xla_and_the_xla_environment():
    offenders = {}
    for name, path in _modules().items():
        if name == "tpu_helpers.backend" or name.startswith("tpu_helpers.backend."):
            continue
        found = runtime_knowledge(path.read_text())
        if found:
            offenders[name] = found
    assert not offenders, ("only tpu_helpers/backend/ may import torch_xla or name XLA/PJRT variables and flags; "
                           f"ask tpu_helpers.backend.runtime_env instead: {offenders}")


def _top_level_imports(tree: ast.Module, module: str, is_package: bool) -> set[str]:
    """tpu_helpers modules imported when `module` is imported (not those imported inside functions)."""
    out: set[str] = set()
    package = module if is_package else module.rpartition(".")[0]

    def visit(body):
        for node in body:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            if isinstance(node, (ast.If, ast.Try)):
                visit(node.body)
                visit(getattr(node, "orelse", []))
                for h in getattr(node, "handlers", []):
                    visit(h.body)
            elif isinstance(node, ast.Import):
                out.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + [base]).strip(".")
                out.add(base)
                out.update(f"{base}.{a.name}" for a in node.names)

    visit(tree.body)
    return out


def test_no_import_cycles():
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        imported = _top_level_imports(ast.parse(path.read_text()), name, path.name == "__init__.py")
        deps = set()
        for target in imported:
            if target in modules:
                deps.add(target)
        # Importing a.b.c runs a/__init__ and a/b/__init__ first.
        for target in list(deps):
            parts = target.split(".")
            deps.update(".".join(parts[:i]) for i in range(1, len(parts)) if ".".join(parts[:i]) in modules)
        deps.discard(name)
        # A package's own __init__ runs before its submodules: that edge is no cycle.
        graph[name] = {d for d in deps if not name.startswith(d + ".")}
    state: dict[str, int] = {}
    stack: list[str] = []

    def dfs(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                pytest.fail("import cycle: " + " -> ".join(stack[stack.index(dep):] + [dep]))
            if dep not in state:
                dfs(dep)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            dfs(node)


LIGHT_PROBE = """
import json, sys
import {module}
print(json.dumps(sorted(m for m in ("torch", "torch_xla", "tpu_helpers.training.trainer", "tpu_helpers.backend")
                        if m in sys.modules)))
"""


@pytest.mark.parametrize("module", ["tpu_helpers.hardware", "tpu_helpers.config", "tpu_helpers.choices"])
def test_light_modules_import_without_torch_xla_or_the_trainer(module):
    proc = subprocess.run([sys.executable, "-c", LIGHT_PROBE.format(module=module)], capture_output=True, text=True,
                          cwd=ROOT, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}, timeout=120)
    assert proc.returncode == 0, proc.stderr
    loaded = json.loads(proc.stdout.strip().splitlines()[-1])
    assert loaded == [], f"import {module} also loaded {loaded}"


def test_the_lazy_package_still_has_its_names():
    import tpu_helpers as th

    for name in th.__all__:
        assert getattr(th, name) is not None
    assert th.TrainConfig.__module__ == "tpu_helpers.config" and callable(th.train_gpt)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        th.nope  # noqa: B018


def test_preset_names_match_the_presets():
    from tpu_helpers.choices import PRESET_NAMES
    from tpu_helpers.models.gpt import PRESETS

    assert tuple(PRESETS) == PRESET_NAMES
