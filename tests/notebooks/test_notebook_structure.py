"""Every notebook is committed clean and parameterizable: the rules papermill and the project rely on."""

from __future__ import annotations

import ast
import re

import nbformat
import papermill as pm
import pytest

from tests.support import NOTEBOOKS, ROOT

ALL = sorted((ROOT / "notebooks").glob("*.ipynb"))


def test_every_notebook_is_known_to_the_tests():
    assert {p.stem for p in ALL} == set(NOTEBOOKS), "add new notebooks to NOTEBOOKS in tests/support.py"


@pytest.mark.parametrize("path", ALL, ids=lambda p: p.stem)
def test_notebook_is_clean_and_has_one_parameters_cell_near_the_top(path):
    nb = nbformat.read(path, as_version=4)
    tagged = [i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", [])]
    assert len(tagged) == 1, f"{path.name}: {len(tagged)} cells tagged 'parameters'"
    assert tagged[0] <= 2, f"{path.name}: the parameters cell is cell {tagged[0]}, not near the top"
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert not cell.outputs and cell.execution_count is None, f"{path.name}: outputs are committed"


@pytest.mark.parametrize("path", ALL, ids=lambda p: p.stem)
def test_every_parameter_is_upper_case_commented_and_visible_to_papermill(path):
    nb = nbformat.read(path, as_version=4)
    source = next(c.source for c in nb.cells if "parameters" in c.metadata.get("tags", []))
    names = [n.targets[0].id for n in ast.parse(source).body if isinstance(n, ast.Assign)]
    assert names, f"{path.name}: empty parameters cell"
    for line in source.splitlines():
        if re.match(r"^[A-Za-z_]\w*\s*=", line):
            assert re.match(r"^[A-Z][A-Z0-9_]*\s*=", line), f"{path.name}: not UPPER_CASE: {line}"
            assert "#" in line, f"{path.name}: parameter without a comment: {line}"
    # papermill parses the cell itself (e.g. to warn about unknown -p names); a quote in a comment can defeat it.
    seen = set(pm.inspect_notebook(str(path)))
    assert seen == set(names), f"{path.name}: papermill cannot read {sorted(set(names) - seen)}"
