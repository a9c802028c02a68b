"""Prose names only what exists: a docstring, comment or Markdown page that names a module, one of its attributes or a
file of the repository names one that is there. Pure ast and regex (no package import): a few seconds.

What is checked, in the package's, tests' and benchmarks' docstrings and comments, README.md, docs/**/*.md and the
notebooks' Markdown cells and code comments:
- dotted names whose first part is `tpu_helpers` or one of its subpackages (`training.trainer.Trainer.fit`,
  `models.lm_head`): the longest module prefix, then attributes found statically (a top-level def, class, assignment
  or import, a package's `_EXPORTS` key, a class's methods, fields and `self.` attributes, its package bases'), and
  past a function, a value or an outside class anything goes;
- `Class.member` for a class the package defines (`Trainer.fit`);
- paths under tpu_helpers/, tests/, benchmarks/, notebooks/, docs/ and stacks/, and `.py`/`.md` paths under a
  subpackage's name (`training/trainer.py`, found under tpu_helpers/ or tests/);
- sections cited by name, here and in the Makefile's comments: `*Watching a run* in the README`, `README, "Title"`,
  `the README's speed section`, `*Title* in docs/guides/x.md`, and links to a heading (`page.md#anchor`, `#anchor`):
  the page has that heading (an anchor as mkdocs makes it from the heading's text).
Exempt, and why:
- `pkg.member` in short form where `member` belongs to a class that subpackage defines: prose names a variable
  (`backend.compile_step` is a method of the Backend a caller holds, `panel.state` the panel's);
- names rooted at a top-level module (`config.lr`, `hardware.x`): these are variables far more often than modules;
  spelled `tpu_helpers.config.X` they are checked;
- bare file names (`trainer.py`) and paths with a wildcard: no single file to look for; placeholders (`backend.x`,
  benchmarks/NAME.py); a name right after "new " (a design page's proposed new `backend/tpu.py`);
- CHANGELOG.md: it records what existed; this file's examples of cited sections.
"""

from __future__ import annotations

import ast
import functools
import io
import json
import re
import tokenize
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "tpu_helpers"

# Offenders in files another change owns: (file, name) -> why it stays for now. Empty once those changes land.
CONCURRENT = "owned by the concurrent refactor; fixed at merge"
ALLOWED: dict[tuple[str, str], str] = {
}

FILE_SUFFIXES = {"py", "md", "ipynb", "txt", "json", "jsonl", "toml", "yaml", "yml", "sh", "cfg", "csv", "log",
                 "html", "png", "pt", "bin", "lock", "safetensors", "npz", "npy", "gz", "zip", "tar"}
TOP_DIRS = ("tpu_helpers", "tests", "benchmarks", "notebooks", "docs", "stacks")
PLACEHOLDER = re.compile(r"^(?:[A-Za-z]|NAME)$")  # `backend.x`, `tpu_helpers.config.X`, benchmarks/NAME.py
# Class names the package shares with TRL's trainers: prose compares with TRL's (`GRPOTrainer._compute_loss`), so
# `Class.member` with these is checked only when spelled with its module path.
SHARED_CLASS_NAMES = {"GRPOTrainer", "DPOTrainer", "ORPOTrainer", "SFTTrainer"}


# --- what the package defines, read statically ---------------------------------------------------------------------

@dataclass
class ClassInfo:
    module: str
    members: set[str]
    bases: list[str]  # as written in the class statement


@dataclass
class ModuleInfo:
    attrs: dict[str, tuple] = field(default_factory=dict)  # name -> ("class", ClassInfo) | ("from", mod, name) |
    #                                                         ("module", mod) | ("other",)


def _class_info(node: ast.ClassDef, module: str) -> ClassInfo:
    members = set()
    for stmt in node.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            members.add(stmt.name)
        elif isinstance(stmt, (ast.Assign, ast.AnnAssign)):
            for target in stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]:
                members |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
    for sub in ast.walk(node):  # self.x = ... in any method
        if isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store) and isinstance(sub.value, ast.Name) \
                and sub.value.id == "self":
            members.add(sub.attr)
    return ClassInfo(module, members, [ast.unparse(b) for b in node.bases])


def _absolute(module: str, is_package: bool, level: int, target: str | None) -> str:
    if not level:
        return target or ""
    parts = module.split(".") if is_package else module.split(".")[:-1]
    parts = parts[:len(parts) - (level - 1)]
    return ".".join(parts + ([target] if target else []))


def _module_info(tree: ast.Module, module: str, is_package: bool) -> ModuleInfo:
    info = ModuleInfo()

    def visit(body):
        for stmt in body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
                info.attrs[stmt.name] = ("other",)
            elif isinstance(stmt, ast.ClassDef):
                info.attrs[stmt.name] = ("class", _class_info(stmt, module))
            elif isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                for target in targets:
                    for n in ast.walk(target):
                        if isinstance(n, ast.Name):
                            info.attrs[n.id] = ("other",)
                            if n.id == "_EXPORTS" and isinstance(stmt.value, ast.Dict):
                                for k, v in zip(stmt.value.keys, stmt.value.values, strict=True):
                                    if isinstance(k, ast.Constant) and isinstance(v, ast.Constant):
                                        info.attrs.setdefault(k.value, ("from", v.value, k.value))
            elif isinstance(stmt, ast.Import):
                for alias in stmt.names:
                    if alias.asname:
                        info.attrs[alias.asname] = ("module", alias.name)
                    else:
                        info.attrs[alias.name.split(".")[0]] = ("module", alias.name.split(".")[0])
            elif isinstance(stmt, ast.ImportFrom):
                source = _absolute(module, is_package, stmt.level, stmt.module)
                for alias in stmt.names:
                    info.attrs[alias.asname or alias.name] = ("from", source, alias.name)
            elif isinstance(stmt, (ast.If, ast.Try, ast.With, ast.For, ast.While)):
                for part in ("body", "orelse", "finalbody"):
                    visit(getattr(stmt, part, []))
                for handler in getattr(stmt, "handlers", []):
                    visit(handler.body)

    visit(tree.body)
    return info


class Index:
    """The package's modules, their top-level names and their classes' members."""

    def __init__(self, package: Path = PACKAGE):
        self.package = package
        self.modules: dict[str, ModuleInfo] = {}
        for path in sorted(package.rglob("*.py")):
            parts = path.relative_to(package.parent).with_suffix("").parts
            is_package = parts[-1] == "__init__"
            name = ".".join(parts[:-1] if is_package else parts)
            self.modules[name] = _module_info(ast.parse(path.read_text()), name, is_package)
        root = package.name
        self.subpackages = {n.split(".")[1] for n in self.modules if n.count(".") >= 2}
        self.classes: dict[str, list[ClassInfo]] = {}
        for info in self.modules.values():
            for name, kind in info.attrs.items():
                if kind[0] == "class":
                    self.classes.setdefault(name, []).append(kind[1])
        self.root = root

    # symbols: ("module", name) | ("class", ClassInfo) | ("other",) | None (not there)
    def attribute(self, module: str, name: str, seen: frozenset = frozenset()) -> tuple | None:
        if f"{module}.{name}" in self.modules:
            return ("module", f"{module}.{name}")
        kind = self.modules[module].attrs.get(name)
        if kind is None or (module, name) in seen:
            return None
        if kind[0] == "from":
            source, target = kind[1], kind[2]
            if f"{source}.{target}" in self.modules:
                return ("module", f"{source}.{target}")
            if source in self.modules:
                return self.attribute(source, target, seen | {(module, name)})
            return ("other",)  # from outside the package
        if kind[0] == "module":
            return ("module", kind[1]) if kind[1] in self.modules else ("other",)
        return kind

    def members(self, cls: ClassInfo, seen: frozenset = frozenset()) -> set[str] | None:
        """A class's members with its package bases'; None when a base is outside the package (anything goes)."""
        out = set(cls.members)
        for base in cls.bases:
            head, *rest = base.split(".")
            symbol = self.attribute(cls.module, head) if not rest else None
            if base in ("object", "Generic") or base.startswith(("Generic[", "Protocol")):
                continue
            if symbol is None or symbol[0] != "class" or id(symbol[1]) in seen:
                return None
            inherited = self.members(symbol[1], seen | {id(cls)})
            if inherited is None:
                return None
            out |= inherited
        return out

    def resolves(self, parts: list[str]) -> bool:
        """Whether the dotted name `parts` (starting at the package's name) names something that exists."""
        for cut in range(len(parts), 0, -1):
            if ".".join(parts[:cut]) in self.modules:
                break
        else:
            return False
        symbol: tuple | None = ("module", ".".join(parts[:cut]))
        for part in parts[cut:]:
            if symbol[0] == "module" and symbol[1] in self.modules:
                symbol = self.attribute(symbol[1], part)
            elif symbol[0] == "class":
                members = self.members(symbol[1])
                if members is not None and part not in members:
                    return False
                symbol = ("other",)
            else:
                return True
            if symbol is None:
                return False
        return True

    def class_member_in(self, subpackage: str, member: str) -> bool:
        prefix = f"{self.root}.{subpackage}"
        return any(member in c.members for cs in self.classes.values() for c in cs
                   if c.module == prefix or c.module.startswith(prefix + "."))


# --- the prose -----------------------------------------------------------------------------------------------------

def python_prose(source: str) -> list[tuple[int, str]]:
    """(line, text) of each docstring line and comment in a Python source."""
    out = []
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                out += [(first.lineno + i, line) for i, line in enumerate(first.value.value.splitlines())]
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            out.append((token.start[0], token.string))
    return out


def notebook_prose(raw: str) -> list[tuple[int, str]]:
    """(line in the .ipynb file, text) of Markdown cells' lines and code cells' comment lines."""
    lines = raw.splitlines()
    out, cursor = [], 0
    for cell in json.loads(raw)["cells"]:
        source = cell["source"] if isinstance(cell["source"], list) else cell["source"].splitlines(True)
        for text in source:
            text = text.rstrip("\n")
            if cell["cell_type"] != "markdown" and not text.lstrip().startswith("#"):
                continue
            quoted = json.dumps(text)[1:-1]
            for i in range(cursor, len(lines)):
                if quoted and quoted in lines[i]:
                    cursor = i
                    break
            out.append((cursor + 1, text))
    return out


DOTTED = r"(?<![\w./\\-])((?:{roots})(?:\.[A-Za-z_]\w*)+)"
PATH = r"(?<![\w./\\-])((?:{roots})/[\w./-]*\w)(?![\w*{{<])"
CLASS_MEMBER = re.compile(r"(?<![\w./\\-])([A-Z]\w*)\.([a-z_]\w*)\b")


def _proposed(text: str, start: int) -> bool:
    return re.search(r"\bnew [`']*$", text[:start]) is not None


class Checker:
    def __init__(self, index: Index, root: Path = ROOT):
        self.index, self.root = index, root
        pkg = index.root
        self.dotted = re.compile(DOTTED.format(roots="|".join([pkg, *sorted(index.subpackages)])))
        self.path = re.compile(PATH.format(roots="|".join([*TOP_DIRS, *sorted(index.subpackages)])))

    def stale(self, text: str, where: Path | None = None) -> list[str]:
        """The names in `text` that name nothing in the repository."""
        out = []
        for match in self.dotted.finditer(text):
            if _proposed(text, match.start()):
                continue
            parts = match.group(1).split(".")
            while len(parts) > 1 and parts[-1] in FILE_SUFFIXES:  # a file name: see the paths
                parts = parts[:-2] if len(parts) > 2 else parts[:1]
            if len(parts) < 2 or any(PLACEHOLDER.match(p) for p in parts):
                continue
            short = parts[0] != self.index.root
            full = [self.index.root, *parts] if short else parts
            if self.index.resolves(full):
                continue
            if short and self.index.class_member_in(parts[0], parts[1]):
                continue  # a variable holding that package's object
            out.append(".".join(parts))
        for match in self.path.finditer(text):
            if _proposed(text, match.start()):
                continue
            path = match.group(1).rstrip(".")
            head = path.split("/")[0]
            if any(PLACEHOLDER.match(Path(p).stem) for p in path.split("/")):
                continue
            if head in TOP_DIRS:
                places = [self.root / path]
            elif path.endswith((".py", ".md")):
                places = [self.root / self.index.root / path, self.root / "tests" / path]
                if where is not None:
                    places.append(where.parent / path)
            else:
                continue
            if not any(p.exists() for p in places):
                out.append(path)
        for match in CLASS_MEMBER.finditer(text):
            owners = self.index.classes.get(match.group(1))
            if not owners or match.group(1) in SHARED_CLASS_NAMES:
                continue
            if any((m := self.index.members(c)) is None or match.group(2) in m for c in owners):
                continue
            out.append(match.group(0))
        return out


# --- sections cited by name or anchor ---------------------------------------------------------------------------------

FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^ {0,3}#{1,6}\s+(.+?)\s*#*\s*$")
PAGE = r"README(?:\.md)?|docs/[\w/.-]+\.md"
# `*Title* in the README`, `the *Title* section of docs/x.md`, `README, "Title"`, `the README's *Title*`
TITLE_CITES = [re.compile(rf"(?:the )?\*(?P<title>[^*\n]+)\*(?: section)?,? (?:in|of) (?:the )?(?P<page>{PAGE})\b"),
               re.compile(rf"(?P<page>{PAGE})(?:'s|,) [\"*](?P<title>[^\"*\n]+)[\"*]")]
WORD_CITE = re.compile(rf"(?P<page>{PAGE})'s (?P<word>[\w-]+(?: [\w-]+)?) section\b")  # the README's speed section
LINK_ANCHOR = re.compile(r"\]\((?P<page>[^)\s#]*\.md)?#(?P<anchor>[\w-]+)\)")  # [text](page.md#anchor), [text](#anchor)
BARE_ANCHOR = re.compile(r"(?<![\w/.(-])(?P<page>docs/[\w/.-]+\.md)#(?P<anchor>[\w-]+)")  # docs/x.md#anchor in prose


def _plain(text: str) -> str:
    """A heading or title as it reads: links as their text, no code or emphasis marks, an attr_list id dropped."""
    text = re.sub(r"\{#[\w-]+\}\s*$", "", text)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    return " ".join(text.replace("`", "").replace("*", "").split())


def slug(heading: str) -> str:
    """The anchor mkdocs (Python-Markdown's toc) gives a heading: ASCII, lower case, no punctuation, spaces as '-'."""
    import unicodedata

    text = unicodedata.normalize("NFKD", _plain(heading)).encode("ascii", "ignore").decode("ascii")
    return re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", text).strip().lower())


@functools.cache
def headings(path: Path) -> list[str]:
    """The headings of a Markdown file (outside code fences), as they read; an attr_list `{#id}` adds `#id`."""
    out, fenced = [], False
    for line in path.read_text().splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced and (m := HEADING.match(line)):
            out.append(_plain(m.group(1)))
            out += [f"#{i}" for i in re.findall(r"\{#([\w-]+)\}\s*$", m.group(1))]
    return out


def stale_sections(text: str, where: Path, root: Path = ROOT) -> list[str]:
    """The sections `text` (prose of the file `where`) cites that its page does not have."""
    def page(name: str | None, relative: bool) -> Path:
        if not name:
            return where
        if name.startswith("README"):
            return root / "README.md"
        return (where.parent / name) if relative and not name.startswith("docs/") else root / name

    out = []
    for pattern in TITLE_CITES:
        for m in pattern.finditer(text):
            target = page(m.group("page"), False)
            found = target.is_file() and _plain(m.group("title")).casefold() in \
                {h.casefold() for h in headings(target)}
            if not found:
                out.append(f"{m.group('page')}: {m.group('title')!r}")
    for m in WORD_CITE.finditer(text):
        target = page(m.group("page"), False)
        if not (target.is_file() and any(m.group("word").casefold() in h.casefold() for h in headings(target))):
            out.append(f"{m.group('page')}: the {m.group('word')} section")
    for pattern, relative in ((LINK_ANCHOR, True), (BARE_ANCHOR, False)):
        for m in pattern.finditer(text):
            target = page(m.group("page"), relative)
            if target.suffix != ".md":
                continue
            anchors = {slug(h) for h in headings(target) if not h.startswith("#")} | \
                {h[1:] for h in headings(target) if h.startswith("#")} if target.is_file() else set()
            if m.group("anchor") not in anchors:
                out.append(f"{m.group('page') or where.name}#{m.group('anchor')}")
    return out


def section_offenders(root: Path = ROOT) -> list[tuple[str, int, str]]:
    """(file, line, citation) of each cited section that does not exist, in the prose files and the Makefile's
    comments; a citation wrapped over two lines of prose is read whole (reported at its first line)."""
    out = []
    for path in [*prose_files(root), root / "Makefile"]:
        if path == root / "tests" / "test_prose.py":  # this file: its examples cite sections that are nowhere
            continue
        raw, rel = path.read_text(), path.relative_to(root).as_posix()
        if path.suffix == ".py":
            lines = sorted(python_prose(raw))
        elif path.suffix == ".ipynb":
            lines = notebook_prose(raw)
        elif path.suffix == ".md":
            lines = list(enumerate(raw.splitlines(), 1))
        else:  # the Makefile: its comments
            lines = [(i, t) for i, t in enumerate(raw.splitlines(), 1) if t.lstrip().startswith("#")]
        texts = [t if path.suffix == ".md" else t.strip().lstrip("#").strip() for _, t in lines]
        found = [set(stale_sections(t, path, root)) for t in texts]
        for k, (line, _) in enumerate(lines):
            out += [(rel, line, c) for c in sorted(found[k])]
            if k + 1 < len(lines):
                both = stale_sections(f"{texts[k]} {texts[k + 1]}", path, root)
                out += [(rel, line, c) for c in both if c not in found[k] | found[k + 1]]
    return out


def prose_files(root: Path = ROOT) -> list[Path]:
    files = [*root.glob("tpu_helpers/**/*.py"), *root.glob("tests/**/*.py"), *root.glob("benchmarks/**/*.py"),
             root / "README.md", *root.glob("docs/**/*.md"), *root.glob("notebooks/*.ipynb")]
    return sorted(p for p in files if p.is_file())


def offenders(root: Path = ROOT) -> list[tuple[str, int, str]]:
    checker = Checker(Index(root / "tpu_helpers"), root)
    out = []
    for path in prose_files(root):
        raw = path.read_text()
        if path.suffix == ".py":
            lines = python_prose(raw)
        elif path.suffix == ".ipynb":
            lines = notebook_prose(raw)
        else:
            lines = list(enumerate(raw.splitlines(), 1))
        rel = path.relative_to(root).as_posix()
        out += [(rel, line, name) for line, text in lines for name in checker.stale(text, path)]
    return out


# --- the tests -----------------------------------------------------------------------------------------------------

def test_the_checker_catches_a_stale_name_and_passes_a_good_one(tmp_path):
    package = tmp_path / "tpu_helpers"
    (package / "training").mkdir(parents=True)
    (package / "__init__.py").write_text('_EXPORTS = {"Trainer": "tpu_helpers.training.trainer"}\n')
    (package / "training" / "__init__.py").write_text("from tpu_helpers.training.trainer import Trainer\n")
    (package / "training" / "trainer.py").write_text(
        "import torch\nclass Base:\n    def fit(self): ...\n"
        "class Trainer(Base):\n    steps: int = 1\n    def __init__(self):\n        self.backend = None\n"
        "    def replayed(self): ...\nclass Module(torch.nn.Module):\n    pass\n")
    checker = Checker(Index(package), tmp_path)
    good = ("tpu_helpers.training.trainer.Trainer.fit, training.Trainer.steps, tpu_helpers.Trainer.replayed, "
            "Trainer.backend, `training/trainer.py`, tpu_helpers/training/, Module.anything, trainer.py, "
            "tests/*.py, config.lr, backend.x, benchmarks/NAME.py, a new `backend/tpu.py`")
    assert checker.stale(good) == []
    bad = ("training.causal_lm, tpu_helpers.training.trainer.Trainer.fitted, Trainer.replay, "
           "tpu_helpers/training/grpo.py, training/grpo.py, tests/training/test_x.py, tpu_helpers.nothing")
    assert checker.stale(bad) == [
        "training.causal_lm", "tpu_helpers.training.trainer.Trainer.fitted", "tpu_helpers.nothing",
        "tpu_helpers/training/grpo.py", "training/grpo.py", "tests/training/test_x.py", "Trainer.replay"]
    # a member of a class the subpackage defines: a variable holding one (`training.backend`), not a module
    assert checker.stale("training.backend and training.replayed") == []


def test_the_prose_readers_give_docstrings_comments_and_markdown_with_their_lines():
    source = '"""Module.\n\nSee training.x."""\nx = 1  # see models.y\ndef f():\n    "training.z"\n'
    assert python_prose(source) == [(1, "Module."), (2, ""), (3, "See training.x."), (6, "training.z"),
                                    (4, "# see models.y")]
    notebook = json.dumps({"cells": [{"cell_type": "markdown", "source": ["# Title\n", "see models.a\n"]},
                                     {"cell_type": "code", "source": ["x = 1\n", "# models.b\n"]}]}, indent=1)
    found = dict((text, line) for line, text in notebook_prose(notebook))
    assert set(found) == {"# Title", "see models.a", "# models.b"}
    raw_lines = notebook.splitlines()
    assert all(text in raw_lines[line - 1] for text, line in found.items())


def test_the_section_checker_finds_a_cited_section_that_is_not_there(tmp_path):
    (tmp_path / "README.md").write_text("# Title\n\n## Watching a run\n\n```bash\n# not a heading\n```\n"
                                        "## XLA speed, and `replay` {#speed}\n")
    (tmp_path / "docs" / "guides").mkdir(parents=True)
    page = tmp_path / "docs" / "guides" / "x.md"
    page.write_text("# X\n\n## The real model, offline on a 2-core CPU\n")
    assert slug("The real model, offline on a 2-core CPU") == "the-real-model-offline-on-a-2-core-cpu"
    assert slug("QLoRA: a 4-bit frozen base (`QUANTIZE_BASE`)") == "qlora-a-4-bit-frozen-base-quantize_base"
    good = ("see *Watching a run* in the README; the README's speed section; README, \"XLA speed, and replay\"; "
            "*The real model, offline on a 2-core CPU* in docs/guides/x.md; [a](x.md#the-real-model-offline-on-a-2-core-cpu); "
            "docs/guides/x.md#x; [b](#x); [c](../../README.md#speed); the README's `pip install` lines")
    assert stale_sections(good, page, tmp_path) == []
    bad = ("see *Watching runs* in the README; the README's memory section; README, \"Not a heading\"; "
           "[a](x.md#the-real-model); docs/guides/x.md#nothing; [b](#nope)")
    assert stale_sections(bad, page, tmp_path) == [
        "README: 'Watching runs'", "README: 'Not a heading'", "README: the memory section", "x.md#the-real-model",
        "x.md#nope", "docs/guides/x.md#nothing"]


def test_cited_sections_exist():
    found = section_offenders()
    assert not found, (f"{len(found)} citations of a README or docs section that does not exist (cite the docs "
                       "page that has it):\n" + "\n".join(f"{f}:{line}: {c}" for f, line, c in found))


def test_docstrings_comments_and_pages_name_only_what_exists():
    found = offenders()
    stale = [f"{f}:{line}: {name}" for f, line, name in found if (f, name) not in ALLOWED]
    unused = sorted(set(ALLOWED) - {(f, name) for f, _, name in found})
    assert not stale, f"{len(stale)} names in prose that name nothing in the repository:\n" + "\n".join(stale)
    assert not unused, f"ALLOWED entries no longer needed (remove them): {unused}"
