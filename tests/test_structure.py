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

import tpu_helpers

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


def _knowledge(source: str, module: str, names: re.Pattern) -> list[str]:
    """What in `source` imports `module` or spells a match of `names` in a string (docstrings and comments aside)."""
    tree = ast.parse(source)
    docs = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        imported = []
        if isinstance(node, ast.Import):
            imported = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            imported = [node.module or ""]
        if isinstance(node, ast.Call) and ast.unparse(node.func).endswith(("import_module", "__import__")) \
                and node.args and isinstance(node.args[0], ast.Constant):
            imported = [str(node.args[0].value)]
        found += [f"line {node.lineno}: import {n}" for n in imported if n.split(".")[0] == module]
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            found += [f"line {node.lineno}: {m.group(0)!r}" for m in names.finditer(node.value)]
    return found


def runtime_knowledge(source: str) -> list[str]:
    """What in `source` imports torch_xla or names an XLA/PJRT variable or flag (docstrings and comments aside)."""
    return _knowledge(source, "torch_xla", RUNTIME_NAME)


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


TORCH_TPU_NAME = re.compile(r"torch[_-]tpu|TorchTPU", re.IGNORECASE)


def torch_tpu_knowledge(source: str) -> list[str]:
    """What in `source` imports torch_tpu or spells a TorchTPU name in a string (docstrings and comments aside)."""
    return _knowledge(source, "torch_tpu", TORCH_TPU_NAME)


def test_the_torch_tpu_checker_sees_what_it_must():
    bad = 'import torch_tpu\nx = "torch-tpu"\ny = f"{v} TorchTPU"\nimportlib.import_module("torch_tpu.ops")\n'
    assert len(torch_tpu_knowledge(bad)) == 5  # the last: its import and its string
    fine = '"""TorchTPU may be explained."""\n# torch_tpu too\nfrom tpu_helpers.backend import torch_tpu\n' \
           'name = torch_tpu.NAME\n'
    assert torch_tpu_knowledge(fine) == []


def test_torchtpu_is_known_in_one_backend_module_and_never_imported():
    # The future TorchTPU port starts in one place: tpu_helpers/backend/torch_tpu.py, which reads package metadata
    # only (importing torch_tpu may take the TPU, and Sophgo's unrelated package has the same import name).
    offenders = {name: found for name, path in _modules().items()
                 if (found := torch_tpu_knowledge(path.read_text())) and name != "tpu_helpers.backend.torch_tpu"}
    assert not offenders, f"TorchTPU names belong in tpu_helpers.backend.torch_tpu only: {offenders}"
    own = torch_tpu_knowledge((PACKAGE / "backend" / "torch_tpu.py").read_text())
    assert not [f for f in own if ": import " in f], own


# The layer order of the package's parts (tpu_helpers/__init__.py says what each is for). A part may import only
# parts of lower layers, at module level or inside a function; parts of one layer do not import each other.
# The entry points sit above the package's layers: `python -m tpu_helpers`, the CLI shim, the lazy names.
LAYERS = (*tpu_helpers.LAYERS, ("__main__", "train", "__init__"))
LAYER_OF = {part: i for i, parts in enumerate(LAYERS) for part in parts}


def part_of(module: str) -> str:
    """The part a module belongs to: the first name under tpu_helpers ("training" for tpu_helpers.training.x)."""
    parts = module.split(".")
    return "__init__" if len(parts) == 1 else parts[1]


def imports_of(source: str, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, tpu_helpers module) for every import in `source`: module level, inside functions and classes, and
    `importlib.import_module("...")` with a constant name; those under `if TYPE_CHECKING:` are left out."""
    tree = ast.parse(source)
    package = module if is_package else module.rpartition(".")[0]
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in
                   ast.unparse(node.test) for n in ast.walk(node)}
    found = []
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + [base]).strip(".")
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Call) and ast.unparse(node.func).endswith(("import_module", "__import__")) \
                and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
            names = [node.args[0].value]
        found += [(node.lineno, n) for n in names if n == "tpu_helpers" or n.startswith("tpu_helpers.")]
    return found


def layer_violations(source: str, module: str, is_package: bool = False) -> list[str]:
    """Each import of `source` that goes to its own layer's other parts or to a higher layer."""
    here = part_of(module)
    out, seen = [], set()
    for line, target in imports_of(source, module, is_package):
        there = part_of(target)
        if target == "tpu_helpers" or there == here or (line, there) in seen:
            continue
        seen.add((line, there))
        if there not in LAYER_OF or here not in LAYER_OF:
            out.append(f"{module}:{line} imports {target}: part {there if there not in LAYER_OF else here!r} is in "
                       "no layer of LAYERS")
        elif LAYER_OF[there] >= LAYER_OF[here]:
            out.append(f"{module}:{line} imports {target} ({there!r} is not below {here!r})")
    return out


def test_the_layer_checker_sees_what_it_must():
    planted = (
        "from tpu_helpers.training.trainer import Trainer\n"                  # upward at module level
        "def f():\n    import tpu_helpers.launch.runner\n"                  # upward inside a function
        "class C:\n    def g(self):\n        from ..recipes import base\n"  # upward, relative
        "importlib.import_module('tpu_helpers.panel.tuning')\n"             # upward, by name
        "from tpu_helpers.data import corpus\n"                             # sideways: same layer
    )
    found = layer_violations(planted, "tpu_helpers.checkpoint.manager")
    assert len(found) == 5 and all("checkpoint" in f for f in found), found
    fine = ("from typing import TYPE_CHECKING\nfrom tpu_helpers.backend import units\n"
            "from tpu_helpers.checkpoint import layout\nfrom . import layout as again\n"
            "if TYPE_CHECKING:\n    from tpu_helpers.training.trainer import Trainer\n"
            "def f():\n    from tpu_helpers.config import ConfigError\n")
    assert layer_violations(fine, "tpu_helpers.checkpoint.manager") == []


def test_every_part_is_in_a_layer_and_imports_only_lower_layers():
    modules = _modules()
    parts = {part_of(m) for m in modules}
    assert parts <= set(LAYER_OF), f"parts missing from LAYERS: {sorted(parts - set(LAYER_OF))}"
    found = []
    for name, path in modules.items():
        found += layer_violations(path.read_text(), name, path.name == "__init__.py")
    assert not found, "imports against the layer order (tpu_helpers/__init__.py):\n" + "\n".join(found)


def test_no_import_cycles():
    # Implied by the layers between parts; within a part, modules must not import each other in a cycle either.
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        deps = {t for _, t in imports_of(path.read_text(), name, path.name == "__init__.py") if t in modules}
        for target in list(deps):  # importing a.b.c runs a/__init__ and a/b/__init__ first
            pieces = target.split(".")
            deps.update(".".join(pieces[:i]) for i in range(1, len(pieces)) if ".".join(pieces[:i]) in modules)
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


def test_the_layers_page_shows_the_layer_order():
    readme = (ROOT / "docs" / "contributing" / "layers.md").read_text()
    rows = [line for line in readme.splitlines() if line.startswith("| ") and "layer" in line.lower()]
    shown = " ".join(rows)
    for parts in LAYERS[:-1]:
        for part in parts:
            assert f"`{part}" in shown, f"docs/contributing/layers.md's table does not place {part!r} in the layer order"


def backend_reads(source: str) -> set[str]:
    """Attributes read off a backend object: `backend.x`, `self.backend.x`, `trainer.backend.x`, `b.x` (the
    package's short name for a backend)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute):
            owner = node.value
            name = owner.id if isinstance(owner, ast.Name) else owner.attr if isinstance(owner, ast.Attribute) else ""
            if name in ("backend", "b") and not node.attr.startswith("__"):
                found.add(node.attr)
    return found


def test_the_backend_checker_sees_what_it_must():
    assert backend_reads("x = self.backend.mesh_shape\nbackend.sync()\nb.is_main\nfoo.bar") == {
        "mesh_shape", "sync", "is_main"}


def test_callers_read_only_what_the_backend_interface_declares_and_never_branch_on_is_xla():
    from tpu_helpers.backend import Backend

    declared = Backend("fp32")  # the interface every backend implements (the CPU one: all of it is there)
    undeclared, branching = {}, {}
    for name, path in _modules().items():
        if name.startswith("tpu_helpers.backend"):
            continue
        reads = backend_reads(path.read_text())
        missing = sorted(a for a in reads if not hasattr(declared, a))
        if missing:
            undeclared[name] = missing
        if "is_xla" in reads:
            branching[name] = "is_xla"
    assert not undeclared, f"attributes read off a backend that the Backend interface does not declare: {undeclared}"
    assert not branching, f"ask the backend for the capability instead of branching on is_xla: {branching}"


@pytest.mark.parametrize("module", ["tpu_helpers.core.hardware", "tpu_helpers.config", "tpu_helpers.core.choices",
                                    "tpu_helpers.core.sharding", "tpu_helpers.core.callbacks", "tpu_helpers.core.atomic_io"])
def test_light_modules_import_without_torch_xla_or_the_trainer(module):
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "scripts" / "light_import.py"), module],
                          capture_output=True, text=True,
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
    from tpu_helpers.core.choices import PRESET_NAMES
    from tpu_helpers.models.gpt import PRESETS

    assert tuple(PRESETS) == PRESET_NAMES
