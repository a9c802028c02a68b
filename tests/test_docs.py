"""The documentation site and the README: what their code names exists, the nav holds every page, and every link to
the repository names the one URL of pyproject.toml. Pure ast, regex and YAML (no mkdocs, no torch): a few seconds.

The strict build itself (`mkdocs build --strict`: broken links, unresolved API references) is `make docs`, which CI
runs after `make test` (.ci/run), in the docs venv of stacks/docs.lock; these tests need neither.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest
import yaml

from tests.test_prose import ROOT, Index
from tpu_helpers.platform import links

DOCS = ROOT / "docs"
README = ROOT / "README.md"
PAGES = sorted(DOCS.rglob("*.md"))
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
FENCE = re.compile(r"^```python[^\n]*\n(.*?)^```", re.M | re.S)


def python_blocks(text: str) -> list[str]:
    return FENCE.findall(text)


def unresolved(source: str, index: Index) -> list[str]:
    """The names a Python block takes from the package that do not exist: `from tpu_helpers.x import a`, `import
    tpu_helpers.x`, and attribute chains off a name bound to the package or one of its modules (`th.Finetune`)."""
    tree = ast.parse(source)
    bound: dict[str, list[str]] = {}  # local name -> dotted path in the package
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] != index.root:
                    continue
                if not index.resolves(alias.name.split(".")):
                    bad.append(alias.name)
                bound[alias.asname or index.root] = (alias.name if alias.asname else index.root).split(".")
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == index.root:
            for alias in node.names:
                parts = [*node.module.split("."), alias.name]
                if not index.resolves(parts):
                    bad.append(".".join(parts))
                else:
                    bound[alias.asname or alias.name] = parts
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            chain, base = [], node
            while isinstance(base, ast.Attribute):
                chain.insert(0, base.attr)
                base = base.value
            if isinstance(base, ast.Name) and base.id in bound:
                parts = [*bound[base.id], *chain]
                if not index.resolves(parts):
                    bad.append(".".join(parts))
    return sorted(set(bad))


@pytest.fixture(scope="module")
def index() -> Index:
    return Index()


def test_the_checker_finds_a_missing_module_and_attribute(index):
    good = "import tpu_helpers as th\nfrom tpu_helpers.platform.links import colab_url\nth.TrainConfig(); colab_url('x')\n"
    assert unresolved(good, index) == []
    bad = "import tpu_helpers as th\nfrom tpu_helpers.nothing import x\nfrom tpu_helpers.platform.links import nope\nth.Nope()\n"
    assert unresolved(bad, index) == ["tpu_helpers.Nope", "tpu_helpers.nothing.x", "tpu_helpers.platform.links.nope"]


@pytest.mark.parametrize("path", [README, *PAGES], ids=lambda p: p.relative_to(ROOT).as_posix())
def test_python_blocks_name_what_the_package_has(path, index):
    for block in python_blocks(path.read_text()):
        if "tpu_helpers" not in block:
            continue
        try:
            missing = unresolved(block, index)
        except SyntaxError as err:
            pytest.fail(f"{path.relative_to(ROOT)}: a ```python block that is not Python ({err}):\n{block}")
        assert not missing, f"{path.relative_to(ROOT)}: a ```python block names what does not exist: {missing}"


def _nav_files(nav) -> list[str]:
    out = []
    for entry in nav:
        if isinstance(entry, str):
            out.append(entry)
        elif isinstance(entry, dict):
            for value in entry.values():
                out += _nav_files(value) if isinstance(value, list) else [value]
    return out


def test_the_nav_lists_every_page_and_only_pages_that_exist():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    listed = _nav_files(config["nav"])
    pages = [p.relative_to(DOCS).as_posix() for p in PAGES]
    assert len(listed) == len(set(listed)), "a page is in mkdocs.yml's nav twice"
    assert not sorted(set(pages) - set(listed)), f"pages missing from mkdocs.yml's nav: {sorted(set(pages) - set(listed))}"
    assert not sorted(set(listed) - set(pages)), f"nav entries with no page: {sorted(set(listed) - set(pages))}"
    assert config["repo_url"] == links.REPO_URL


def test_the_api_pages_name_modules_that_exist(index):
    for page in sorted((DOCS / "api").glob("*.md")):
        for name in re.findall(r"^::: (\S+)", page.read_text(), re.M):
            assert name in index.modules, f"{page.relative_to(ROOT)}: ::: {name} is not a module of the package"


def test_the_readmes_documentation_list_links_every_job_platform_guide_and_method_page():
    listed = README.read_text().split("\n## Documentation\n", 1)[1].split("\n## ", 1)[0]
    linked = set(re.findall(r"\]\((docs/[^)#\s]+\.md)", listed))
    pages = {p.relative_to(ROOT).as_posix() for d in ("jobs", "platforms", "guides", "algorithms")
             for p in (DOCS / d).glob("*.md")}
    assert not sorted(pages - linked), f"pages missing from the README's Documentation list: {sorted(pages - linked)}"


def test_the_readme_fits_a_screen_and_keeps_the_two_commands():
    text = README.read_text()
    assert len(text.splitlines()) <= 150
    assert re.search(r"^make run +# set up, then ", text, re.M) and re.search(r"^make test +# set up, then run", text,
                                                                                 re.M)


# --- one repository URL --------------------------------------------------------------------------------------------

def _notebook_repo_url(path: Path) -> str:
    for cell in json.loads(path.read_text())["cells"]:
        source = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
        found = re.search(r'^REPO_URL\s*=\s*"([^"]*)"', source, re.M)
        if found:
            return found.group(1)
    raise AssertionError(f"{path.name} has no REPO_URL parameter")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_each_notebooks_repo_url_is_the_repository(path):
    assert _notebook_repo_url(path) == links.REPO_URL, (
        f"{path.name}'s REPO_URL default differs from pyproject.toml's [project.urls] Repository")


def test_the_links_and_install_lines_name_the_repository():
    owner_name = links.REPO_URL.removeprefix("https://github.com/")
    for path in [README, *PAGES]:
        text, rel = path.read_text(), path.relative_to(ROOT)
        for url in re.findall(r"https://colab\.research\.google\.com/github/[^)\s|]+", text):
            name = url.rsplit("/", 1)[-1]
            assert url == links.colab_url(name), (rel, url)
            assert (ROOT / links.notebook_file(name)).is_file(), (rel, url)
        for url in re.findall(r"https://kaggle\.com/kernels/welcome\?src=[^)\s|]+", text):
            name = url.rsplit("/", 1)[-1]
            assert url == links.kaggle_url(name), (rel, url)
            assert (ROOT / links.notebook_file(name)).is_file(), (rel, url)
        # Every mention of a tpu_helpers repository on GitHub is this one (a clone, a pip line, a REPO_URL).
        for found in re.findall(r"github\.com/([\w.-]+/tpu_helpers)\b", text):
            assert found == owner_name, (rel, found)
    installs = re.findall(r'pip install "tpu_helpers(?:\[[^\]]*\])? @ git\+([^"]+)"', README.read_text())
    assert installs and set(installs) == {links.REPO_URL}, installs


@pytest.mark.parametrize("where", [README, DOCS / "index.md"], ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_notebook_opens_in_colab_or_kaggle_from_the_readme_and_the_docs(where):
    text = where.read_text()
    missing = [p.name for p in NOTEBOOKS
               if links.colab_url(p.stem) not in text and links.kaggle_url(p.stem) not in text]
    assert not missing, f"{where.relative_to(ROOT)} has no Colab or Kaggle link for {missing}"


def test_the_links_module_reads_pyproject_and_builds_the_urls(tmp_path):
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text('[project]\nname = "x"\n\n[project.urls]\nHomepage = "https://a"\n'
                         'Repository = "https://github.com/me/tpu_helpers/"\n\n[tool.x]\nRepository = "no"\n')
    url = links.repository_url(pyproject)
    assert url == "https://github.com/me/tpu_helpers"
    assert links.colab_url("grpo_llm.ipynb", url) == \
        "https://colab.research.google.com/github/me/tpu_helpers/blob/main/notebooks/grpo_llm.ipynb"
    assert links.kaggle_url("grpo_llm", url) == \
        "https://kaggle.com/kernels/welcome?src=https://github.com/me/tpu_helpers/blob/main/notebooks/grpo_llm.ipynb"
    with pytest.raises(ValueError, match="not a github.com repository URL"):
        links.colab_url("x", "https://gitlab.com/me/tpu_helpers")
