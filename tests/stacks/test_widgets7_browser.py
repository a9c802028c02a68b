"""The tuning panel under ipywidgets 7.7.1 (what Colab's runtime ships), as a person sees it in a browser.

The colab stack venv serves a parameterised copy of notebooks/batch_size_tuning.ipynb with the classic Notebook 6
front-end (nbclassic on the runtime's jupyter_server) and ipywidgets 7's own front-end, widgetsnbextension 3.6: the
pair that renders 7.7.1 (JupyterLab 3, the other one, cannot install on Python 3.13). Debian's chromium, driven by
Playwright from the dev venv, runs all cells at 1280x900, checks that every control lies inside the visible panel
with its label uncut, and that changing the batch size, the target chip and the checkpointing box each updates the
chart and the figures. Screenshots go to $TPU_HELPERS_ARTIFACTS (default runs/browser-test/), named widgets7-*.
"""

from __future__ import annotations

import json
import os
import time

import pytest

from tests.panel.test_panel_browser import PARAMS, _artifacts, _changed, _chromium, _state, serve_jupyter
from tests.stacks.conftest import stack
from tests.stacks.venvs import ROOT

pytestmark = [pytest.mark.stacks, pytest.mark.browser, pytest.mark.slow]

LAYOUT_JS = """() => {
  const panel = document.querySelector('.tpu-tuning-panel').getBoundingClientRect();
  const area = document.querySelector('#notebook-container').getBoundingClientRect();
  const right = Math.min(panel.right, area.right, window.innerWidth);
  const out = [];
  for (const el of document.querySelectorAll('.tpu-tuning-panel [class*="tpu-ctl-"], .tpu-apply, .tpu-probe')) {
    const r = el.getBoundingClientRect();
    const name = [...el.classList].find(c => c.startsWith('tpu-')) || el.className;
    const cut = [...el.querySelectorAll('label, .widget-label')]
      .filter(l => l.scrollWidth > l.clientWidth + 1).map(l => l.textContent);
    out.push({name, left: r.left, right: r.right, width: r.width, height: r.height, cut,
              inside: r.width > 0 && r.height > 0 && r.left >= panel.left - 1 && r.right <= right + 1});
  }
  return {panel: [panel.left, panel.right], visibleRight: right, controls: out};
}"""


def _fill(page, control: str, value: str) -> None:
    """Type into a text control and leave it: ipywidgets 7 sends a text box's value on its change event (blur)."""
    box = page.locator(f".tpu-ctl-{control} input").first
    box.fill(value)
    box.press("Tab")


@pytest.fixture(scope="module")
def classic(tmp_path_factory):
    """nbclassic from the colab venv over the parameterised tuning notebook: (base url, token, name, chromium)."""
    chromium = _chromium()
    colab = stack("colab")
    import nbformat
    from papermill.iorw import load_notebook_node
    from papermill.parameterize import parameterize_notebook

    root = tmp_path_factory.mktemp("classic")
    nb = parameterize_notebook(load_notebook_node(str(ROOT / "notebooks" / "batch_size_tuning.ipynb")),
                               {**PARAMS, "OUT_DIR": str(root / "out")})
    nbformat.write(nb, root / "tuning.ipynb")
    home = root / "jupyter"
    env = colab.env(JUPYTER_CONFIG_DIR=str(home / "config"), JUPYTER_RUNTIME_DIR=str(home / "runtime"),
                    JUPYTER_DATA_DIR=str(home / "data"))
    for base, token in serve_jupyter([colab.python, "-m", "nbclassic"], root, env, "nbclassic", "--ServerApp.token"):
        yield base, token, "tuning.ipynb", chromium


def test_panel_renders_with_ipywidgets_7_in_the_classic_notebook(classic):
    from playwright.sync_api import sync_playwright

    base, token, name, chromium = classic
    shots = _artifacts()
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, headless=True,
                                     args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            console: list[str] = []
            page.on("console", lambda m: console.append(f"{m.type}: {m.text}"))
            page.goto(f"{base}/notebooks/{name}?token={token}")
            # Run only once ipywidgets 7's front-end has its widget manager on the kernel: widgets opened before
            # that are "not found in registry" and never render.
            page.wait_for_function("() => window.Jupyter && Jupyter.notebook && Jupyter.notebook.kernel && "
                                   "Jupyter.notebook.kernel.is_connected() && "
                                   "Jupyter.notebook.kernel.widget_manager !== undefined", timeout=60_000)
            # ... and has finished asking the kernel for the widgets it already has (ipywidgets 7.7.1's kernel has
            # no control comm, so the front-end says so and falls back): widgets opened during that ask may never
            # show.
            deadline = time.time() + 20
            while not any("jupyter.widget.control" in m for m in console) and time.time() < deadline:
                page.wait_for_timeout(200)
            page.wait_for_timeout(1000)
            page.evaluate("() => Jupyter.notebook.execute_all_cells()")
            try:
                page.wait_for_selector(".tpu-tuning-panel .tpu-verdict", timeout=180_000)
            except Exception:
                page.screenshot(path=str(shots / "widgets7-no-panel.png"))
                raise AssertionError("the panel did not render; the browser said:\n" + "\n".join(console[-40:])) \
                    from None
            page.get_by_text("results:", exact=False).last.wait_for(timeout=120_000)
            versions = page.evaluate("() => [...document.querySelectorAll('.output_text')].map(e => e.innerText)"
                                     ".join('\\n')")
            assert "ipywidgets 7.7.1" in versions, versions[-2000:]  # the setup cell's report
            verdict = page.locator(".tpu-verdict").inner_text()
            assert verdict.startswith("FITS") and "% of HBM" in verdict, verdict

            page.locator(".tpu-controls").scroll_into_view_if_needed()
            layout = page.evaluate(LAYOUT_JS)
            bad = [c for c in layout["controls"] if not c["inside"] or c["cut"]]
            assert len(layout["controls"]) >= 14, layout
            assert not bad, f"at 1280 px these controls are outside the visible panel or have cut labels: {bad}"
            page.locator(".tpu-tuning-panel").scroll_into_view_if_needed()
            page.screenshot(path=str(shots / "widgets7-panel-1280x900.png"))

            for control, action in (("batch_size", lambda: _fill(page, "batch_size", "24")),
                                    ("hardware", lambda: page.locator(".tpu-ctl-hardware select")
                                     .select_option(label="NVIDIA H100")),
                                    ("gradient_checkpointing", lambda: page.locator(
                                        ".tpu-ctl-gradient_checkpointing input").click())):
                before = _state(page)
                action()
                _changed(page, before, control)
            assert "H100" in page.locator(".tpu-details").inner_text() or "H100" in _state(page)[2]
            page.screenshot(path=str(shots / "widgets7-changed-1280x900.png"))
            (shots / "widgets7-layout.json").write_text(json.dumps(layout, indent=1))
        finally:
            browser.close()
    assert os.path.exists(shots / "widgets7-panel-1280x900.png")
