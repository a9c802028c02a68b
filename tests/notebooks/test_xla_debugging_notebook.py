"""notebooks/xla_debugging.ipynb under papermill on XLA:CPU: the detector names every mistake of the bad loop,
none of the fixed one, and torch_xla's debug output is summarised."""

from __future__ import annotations

import json

import pytest

from tests.support import NOTEBOOKS, XLA_BACKEND

pytestmark = [pytest.mark.notebooks, pytest.mark.xla,
              pytest.mark.skipif(XLA_BACKEND is None, reason="torch_xla is not installed")]


def test_xla_debugging_notebook_names_each_problem_then_runs_clean(tmp_path):
    papermill = pytest.importorskip("papermill")
    out_dir = tmp_path / "run"
    papermill.execute_notebook(
        str(NOTEBOOKS["xla_debugging"]), str(tmp_path / "out.ipynb"), kernel_name="python3", cwd=str(tmp_path),
        parameters={"STEPS": 5, "SEQ_LEN": 32, "LOG_EVERY": 5, "OUT_DIR": str(out_dir), "XLA_DEBUG": True},
    )
    results = json.loads((out_dir / "results.json").read_text())
    bad, fixed = results["loops"]
    assert sorted(bad["causes"]) == ["changing_value", "cpu_fallback", "host_read", "shape_change"], bad["problems"]
    assert fixed["problems"] == []
    assert bad["compilations"] > fixed["compilations"]
    assert bad["device_to_host_transfers"] > fixed["device_to_host_transfers"]
    assert bad["cpu_fallback_ops"] > 0 == fixed["cpu_fallback_ops"]
    # torch_xla's own account (PT_XLA_DEBUG_LEVEL=2) saw at least every compilation the counters saw.
    debug = results["xla_debug"]
    assert debug["compilations"] >= bad["compilations"] + fixed["compilations"]
    assert debug["graphs"] >= 2 and debug["causes"]
    assert (out_dir / "xla_debug.txt").stat().st_size > 0
