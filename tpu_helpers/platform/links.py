"""The repository's URL and the "Open in Colab" / "Open in Kaggle" links of its notebooks, from one place.

The URL is `[project.urls] Repository` in pyproject.toml: read from the source tree when the package runs from a
clone (an editable install included), else from the installed distribution's metadata (`Project-URL`). The README,
the documentation pages, the notebooks' `REPO_URL` default and the README's `pip install` lines name the same URL
(tests/test_docs.py checks that they agree).

    from tpu_helpers.platform.links import REPO_URL, colab_url, kaggle_url
    colab_url("grpo_llm")     # https://colab.research.google.com/github/OWNER/tpu_helpers/blob/main/notebooks/grpo_llm.ipynb
    kaggle_url("grpo_llm")    # https://kaggle.com/kernels/welcome?src=https://github.com/OWNER/tpu_helpers/blob/main/...

Standard library only, nothing of the package imported: safe before any runtime starts.
"""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

BRANCH = "main"
PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"
COLAB_BADGE = "https://colab.research.google.com/assets/colab-badge.svg"
KAGGLE_BADGE = "https://kaggle.com/static/images/open-in-kaggle.svg"


def repository_url(pyproject: Path = PYPROJECT) -> str:
    """`[project.urls] Repository` of pyproject.toml (read with a regex: tomllib is Python 3.11+), else the installed
    metadata's `Project-URL: Repository, ...`."""
    if pyproject.is_file():
        text = pyproject.read_text()
        section = re.search(r"^\[project\.urls\]\s*$(.*?)(?=^\[|\Z)", text, re.M | re.S)
        found = section and re.search(r'^\s*Repository\s*=\s*"([^"]+)"', section.group(1), re.M)
        if found:
            return found.group(1).rstrip("/")
    try:
        for entry in importlib.metadata.metadata("tpu_helpers").get_all("Project-URL") or []:
            label, _, url = entry.partition(",")
            if label.strip().lower() == "repository":
                return url.strip().rstrip("/")
    except importlib.metadata.PackageNotFoundError:
        pass
    raise LookupError("no repository URL: neither pyproject.toml's [project.urls] Repository nor the installed "
                      "tpu_helpers metadata's Project-URL names one")


REPO_URL = repository_url()


def _github_path(repo_url: str) -> str:
    """"OWNER/NAME" of a github.com URL."""
    found = re.match(r"^https://github\.com/([^/]+/[^/]+?)(?:\.git)?$", repo_url)
    if not found:
        raise ValueError(f"not a github.com repository URL: {repo_url!r} (the Colab and Kaggle links need one)")
    return found.group(1)


def notebook_file(name: str) -> str:
    """notebooks/NAME.ipynb for "NAME" or "NAME.ipynb"."""
    return f"notebooks/{name.removesuffix('.ipynb')}.ipynb"


def github_url(name: str, repo_url: str = REPO_URL, branch: str = BRANCH) -> str:
    """The notebook's page on GitHub."""
    return f"https://github.com/{_github_path(repo_url)}/blob/{branch}/{notebook_file(name)}"


def colab_url(name: str, repo_url: str = REPO_URL, branch: str = BRANCH) -> str:
    """Opens the notebook in Colab, straight from GitHub."""
    return f"https://colab.research.google.com/github/{_github_path(repo_url)}/blob/{branch}/{notebook_file(name)}"


def kaggle_url(name: str, repo_url: str = REPO_URL, branch: str = BRANCH) -> str:
    """Imports the notebook into a new Kaggle notebook, from GitHub."""
    return f"https://kaggle.com/kernels/welcome?src={github_url(name, repo_url, branch)}"


def badges(name: str, colab: bool = True, kaggle: bool = True) -> tuple[str, str]:
    """The Markdown of the notebook's "Open in Colab" and "Open in Kaggle" badges ("" for one left out)."""
    return (f"[![Open In Colab]({COLAB_BADGE})]({colab_url(name)})" if colab else "",
            f"[![Open in Kaggle]({KAGGLE_BADGE})]({kaggle_url(name)})" if kaggle else "")


def pip_line(extras: str = "") -> str:
    """`pip install "tpu_helpers[EXTRAS] @ git+REPO_URL"`: the install line of the README and the docs."""
    return f'pip install "tpu_helpers{f"[{extras}]" if extras else ""} @ git+{REPO_URL}"'
