"""Notebook paths the runner cannot run are refused with a clear message (no raw traceback)."""

from __future__ import annotations

import pytest

from tpu_helpers.__main__ import main
from tpu_helpers.launch.runner import RunError, declared_parameters, run_notebook


@pytest.mark.parametrize("kind", ["directory", "readme", "broken"])
def test_a_path_that_is_not_a_notebook_is_refused(tmp_path, kind, capsys) -> None:
    if kind == "directory":
        path, message = tmp_path / "notebooks", r"is a directory; give a \.ipynb file inside it"
        path.mkdir()
    elif kind == "readme":
        path, message = tmp_path / "README.md", r"is not a Jupyter notebook \(expected a \.ipynb file\)"
        path.write_text("# hello\n")
    else:
        path, message = tmp_path / "half.ipynb", r"cannot be read as a Jupyter notebook"
        path.write_text('{"cells": [')
    with pytest.raises(RunError, match=message):
        run_notebook(path, runs_dir=tmp_path / "runs")
    with pytest.raises(RunError, match=message):
        declared_parameters(path)
    assert not (tmp_path / "runs").exists()
    assert main(["run", str(path), "--runs-dir", str(tmp_path / "runs")]) == 2
    assert "error: notebook" in capsys.readouterr().err
