"""The Makefile's papercuts: `make help` lists every target with its line, and `make test-stacks STACKS=...` runs the
stacks named and skips the others, saying why (the selection in tests/stacks/venvs.py, tested here on folders: the
stack tests themselves build venvs of gigabytes)."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from tests.stacks.venvs import NotAsked, StackVenv, Unbuilt, parse_venvs, select
from tests.support import ROOT


def _phony() -> list[str]:
    text = (ROOT / "Makefile").read_text().replace("\\\n", " ")
    return next(line for line in text.splitlines() if line.startswith(".PHONY:")).split(":", 1)[1].split()


@pytest.mark.skipif(shutil.which("make") is None, reason="no make on this machine")
def test_make_help_lists_every_target_with_one_line():
    out = subprocess.run(["make", "-s", "help"], cwd=ROOT, capture_output=True, text=True, timeout=60, check=True).stdout
    lines = dict(re.match(r"^(\S+)\s+(.+)$", line).groups() for line in out.splitlines())
    assert sorted(lines) == sorted(_phony()), out
    assert all(len(text) > 10 for text in lines.values()), out
    # Not the default target: a plain `make` still builds the venv.
    first = re.search(r"^([a-z-]+):", (ROOT / "Makefile").read_text(), re.M).group(1)
    assert first == "setup"


def test_the_stacks_asked_for_run_and_the_others_skip_saying_why(tmp_path):
    (tmp_path / "latest").mkdir()
    (tmp_path / "latest" / ".complete").write_text("{}")
    (tmp_path / "core").mkdir()  # asked for, but its build never finished
    venvs = parse_venvs(f"latest={tmp_path / 'latest'},core={tmp_path / 'core'}")
    assert select("latest", venvs) == StackVenv("latest", str(tmp_path / "latest"))
    with pytest.raises(NotAsked, match=r"^the colab stack was not asked for \(this run's stacks: core latest\); "
                                       r"make test-stacks STACKS=colab runs it$"):
        select("colab", venvs)
    with pytest.raises(Unbuilt, match=r"the core venv at .* is not complete"):
        select("core", venvs)


def test_make_test_stacks_passes_only_the_stacks_named():
    text = (ROOT / "Makefile").read_text()
    assert "STACK_VENVS = $(PYTHON) stacks/stack_venv.py paths $(STACKS)" in text
    assert text.count("TPU_HELPERS_STACK_VENVS=$$venvs") == 2  # test-stacks and test-real-stacks
