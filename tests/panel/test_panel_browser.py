"""The tuning panel as a person sees it: JupyterLab in headless Chromium, at a laptop's and a desktop's width.

JupyterLab runs on 127.0.0.1 (a free port, a random token, its settings in a temporary directory) over a copy of
``notebooks/batch_size_tuning.ipynb`` with small parameters; Chromium is Debian's ``chromium`` driven by Playwright
through ``executable_path`` (Playwright's own browser download is not used). The test runs all cells, then at
1280x900 and 1920x1080 checks that every control lies inside the visible panel with its label uncut, that each
change updates the figures and the chart, that a bad value marks them stale, that "apply suggestion" changes the
controls, that the sharding control applies a typed value, and that the probe shows a busy state and then its
result. Screenshots go to ``$TPU_HELPERS_ARTIFACTS`` (default ``runs/browser-test/``).

Without a chromium the test is skipped, except in CI (``CI=true``), where it fails: CI must run it.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.support import NOTEBOOKS, ROOT

pytestmark = [pytest.mark.browser, pytest.mark.slow]

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
PARAMS = {"DEVICE": "cpu", "PRESET": "tiny", "SEQ_LEN": 64, "BATCH_SIZE": 2, "HARDWARE": "v5e", "CHIPS": 8,
          "PROBE": False, "PROBE_MAX_TRIES": 6, "PROBE_MAX_BATCH": 256, "PROBE_CPU_LIMIT_MB": 8}


def _need(what: str, why: str):
    if IN_CI:
        pytest.fail(f"{what} is missing in CI ({why}); the browser test must run there")
    pytest.skip(f"{what} not found ({why})")


def _chromium() -> str:
    for candidate in (os.environ.get("TPU_HELPERS_CHROMIUM"), "chromium", "chromium-browser", "google-chrome"):
        path = candidate and shutil.which(candidate)
        if path:
            return path
    _need("chromium", "install it with: apt-get install -y chromium, or set TPU_HELPERS_CHROMIUM")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_jupyter(argv: list[str], root: Path, env: dict, what: str, token_flag: str):
    """Start a Jupyter server (`argv` + port, token, root options) in `root`, wait until its API answers, and yield
    (base url, token); terminate it afterwards. Its log is `root/server.log`, quoted when it does not start."""
    port, token = _free_port(), secrets.token_hex(16)
    log = open(root / "server.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([*argv, "--no-browser", "--ip=127.0.0.1", f"--port={port}", f"{token_flag}={token}",
                             f"--ServerApp.root_dir={root}", "--allow-root"],
                            env=env, stdout=log, stderr=subprocess.STDOUT, cwd=root)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2):
                    break
            except OSError:
                if proc.poll() is not None or time.time() > deadline:
                    raise AssertionError(f"{what} did not start:\n{(root / 'server.log').read_text()[-3000:]}") \
                        from None
                time.sleep(0.3)
        yield base, token
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """A JupyterLab server over a parameterised copy of the tuning notebook: (base url, token, notebook, chromium)."""
    chromium = _chromium()
    for module in ("playwright", "jupyterlab", "papermill"):
        try:
            __import__(module)
        except ImportError:
            _need(module, "pip install -r requirements-dev.txt")
    import nbformat
    from papermill.iorw import load_notebook_node
    from papermill.parameterize import parameterize_notebook

    root = tmp_path_factory.mktemp("lab")
    params = {**PARAMS, "OUT_DIR": str(root / "out")}
    nb = parameterize_notebook(load_notebook_node(str(NOTEBOOKS["batch_size_tuning"])), params)
    nbformat.write(nb, root / "tuning.ipynb")
    home = root / "jupyter"
    settings = home / "settings" / "@jupyterlab" / "apputils-extension"
    settings.mkdir(parents=True)
    (settings / "notification.jupyterlab-settings").write_text(json.dumps({"fetchNews": "false",
                                                                           "checkForUpdates": False}))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "JUPYTER_CONFIG_DIR": str(home / "config"), "JUPYTER_RUNTIME_DIR": str(home / "runtime"),
           "JUPYTERLAB_SETTINGS_DIR": str(home / "settings"), "JUPYTERLAB_WORKSPACES_DIR": str(home / "ws"),
           "MPLBACKEND": "agg"}
    argv = [sys.executable, "-m", "jupyterlab", "--LabApp.expose_app_in_browser=True"]
    for base, token in serve_jupyter(argv, root, env, "JupyterLab", "--IdentityProvider.token"):
        yield base, token, "tuning.ipynb", chromium


def _artifacts() -> Path:
    out = Path(os.environ.get("TPU_HELPERS_ARTIFACTS") or ROOT / "runs" / "browser-test")
    out.mkdir(parents=True, exist_ok=True)
    return out


LAYOUT_JS = """() => {
  const panel = document.querySelector('.tpu-tuning-panel').getBoundingClientRect();
  const area = document.querySelector('.jp-NotebookPanel').getBoundingClientRect();
  const right = Math.min(panel.right, area.right, window.innerWidth);
  const out = [];
  for (const el of document.querySelectorAll('.tpu-tuning-panel [class*="tpu-ctl-"], .tpu-apply, .tpu-probe')) {
    const r = el.getBoundingClientRect();
    const name = [...el.classList].find(c => c.startsWith('tpu-')) || el.className;
    const cut = [...el.querySelectorAll('label, .widget-label, .widget-label-basic span')]
      .filter(l => l.scrollWidth > l.clientWidth + 1).map(l => l.textContent);
    out.push({name, left: r.left, right: r.right, top: Math.round(r.top), width: r.width, height: r.height, cut,
              inside: r.width > 0 && r.height > 0 && r.left >= panel.left - 1 && r.right <= right + 1});
  }
  return {panel: [panel.left, panel.right], visibleRight: right, controls: out};
}"""


def _check_layout(page, width: int) -> dict:
    page.locator(".tpu-controls").scroll_into_view_if_needed()
    layout = page.evaluate(LAYOUT_JS)
    bad = [c for c in layout["controls"] if not c["inside"] or c["cut"]]
    assert len(layout["controls"]) >= 14, layout
    assert not bad, f"at {width} px these controls are outside the visible panel or have cut labels: {bad}"
    return layout


def _state(page) -> tuple[str, str, str]:
    return (page.locator(".tpu-chart img, img.tpu-chart").first.get_attribute("src") or "",
            page.locator(".tpu-details").inner_text(), page.locator(".tpu-verdict").inner_text())


def _changed(page, before: tuple[str, str, str], what: str, timeout: float = 20_000) -> tuple[str, str, str]:
    """Wait until the chart and the figures both differ from ``before``."""
    deadline = time.time() + timeout / 1000
    while time.time() < deadline:
        now = _state(page)
        if now[0] != before[0] and (now[1] != before[1] or now[2] != before[2]):
            return now
        page.wait_for_timeout(150)
    raise AssertionError(f"{what}: the chart or the figures did not update ({_state(page)[1:]} vs {before[1:]})")


def _fill(page, control: str, value: str) -> None:
    box = page.locator(f".tpu-ctl-{control} input").first
    box.fill(value)
    box.press("Enter")


def test_panel_in_jupyterlab_at_laptop_and_desktop_width(lab):
    from playwright.sync_api import sync_playwright

    base, token, name, chromium = lab
    t0 = time.perf_counter()

    def mark(what: str) -> None:
        print(f"{time.perf_counter() - t0:6.1f} s  {what}")

    shots = _artifacts()
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, headless=True,
                                     args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            mark("browser up")
            page.goto(f"{base}/lab/tree/{name}?token={token}&reset")
            page.wait_for_selector(".jp-NotebookPanel .jp-Cell", timeout=60_000)
            page.evaluate("""async () => {
                const app = window.jupyterapp;
                const w = app.shell.currentWidget;
                await w.context.ready; await w.sessionContext.ready;
                await app.commands.execute('notebook:run-all-cells');
            }""")
            page.wait_for_selector(".tpu-tuning-panel .tpu-verdict", timeout=120_000)
            page.get_by_text("results:", exact=False).last.wait_for(timeout=60_000)
            mark("notebook ran")
            verdict = page.locator(".tpu-verdict").inner_text()
            assert verdict.startswith("FITS") and "% of HBM" in verdict, verdict

            # 1280 px: every control inside the visible panel, labels whole.
            layout_1280 = _check_layout(page, 1280)
            page.locator(".tpu-tuning-panel").scroll_into_view_if_needed()
            page.screenshot(path=str(shots / "panel-1280x900.png"))

            # The probe: busy at once (a second click does nothing), then its answer and "use this batch".
            probe = page.locator(".tpu-probe")
            probe.scroll_into_view_if_needed()
            probe.click()
            page.wait_for_selector(".tpu-probe.tpu-busy", timeout=10_000)
            assert probe.is_disabled() and "probing" in probe.inner_text()
            busy_status = page.locator(".tpu-probe-status").inner_text()
            assert "Probing on CPU" in busy_status and "starting at batch" in busy_status, busy_status
            page.locator(".tpu-probe-status").scroll_into_view_if_needed()
            page.screenshot(path=str(shots / "probe-busy-1280x900.png"))
            page.get_by_text("Largest batch that ran").wait_for(timeout=120_000)
            status = page.locator(".tpu-probe-status").inner_text()
            assert "CPU" in status and "fp32" in status and "memory cap" in status, status
            assert ("exactly" in status or "at least" in status) and "Tries:" in status, status
            assert not probe.is_disabled()
            use = page.locator(".tpu-use-probe")
            assert not use.is_disabled(), status
            page.screenshot(path=str(shots / "probe-result-1280x900.png"))
            mark("probe done")
            before = _state(page)
            use.click()
            _changed(page, before, "use this batch")
            probed = use.inner_text().split("batch ")[1].split("/")[0]
            assert page.locator(".tpu-ctl-batch_size input").input_value() == probed
            (shots / "probe-result.txt").write_text(status + "\n")

            # Each change updates the chart and the figures.
            for control, action in (("batch_size", lambda: _fill(page, "batch_size", "24")),
                                    ("hardware", lambda: page.locator(".tpu-ctl-hardware select")
                                     .select_option(label="NVIDIA H100")),
                                    ("gradient_checkpointing", lambda: page.locator(
                                        ".tpu-ctl-gradient_checkpointing input").click()),
                                    ("chips", lambda: page.locator(".tpu-ctl-chips select")
                                     .select_option(label="4 chips"))):
                before = _state(page)
                action()
                _changed(page, before, control)
            assert "4 chips" in page.locator(".tpu-details").inner_text()

            mark("changes")
            # A bad value: refused, said in red, the figures marked stale; a good one clears it.
            before = _state(page)
            _fill(page, "seq_len", "0")
            page.wait_for_selector(".tpu-error :text('seq_len')", timeout=20_000)
            _changed(page, before, "stale marking")
            assert "STALE" in page.locator(".tpu-verdict").inner_text()
            page.screenshot(path=str(shots / "stale-1280x900.png"))
            _fill(page, "seq_len", "1024")
            page.wait_for_function("() => !document.querySelector('.tpu-verdict').innerText.includes('STALE')",
                                   timeout=20_000)

            # Does not fit -> the suggestion keeps the global batch; "apply suggestion" changes the controls.
            for what, action in (("v5e", lambda: page.locator(".tpu-ctl-hardware select").select_option(label="TPU v5e")),
                                 ("8 chips", lambda: page.locator(".tpu-ctl-chips select").select_option(label="8 chips")),
                                 ("no checkpointing", lambda: page.locator(".tpu-ctl-gradient_checkpointing input").click()),
                                 ("small", lambda: page.locator(".tpu-ctl-preset select").select_option("small")),
                                 ("batch 36", lambda: _fill(page, "batch_size", "36"))):
                before = _state(page)
                action()
                _changed(page, before, what)
            assert page.locator(".tpu-verdict").inner_text().startswith("DOES NOT FIT")
            suggestion = page.locator(".tpu-suggestion").inner_text()
            assert "largest batch 9/chip" in suggestion and "accumulation 4 for global batch 288" in suggestion
            page.screenshot(path=str(shots / "does-not-fit-1280x900.png"))
            before = _state(page)
            page.locator(".tpu-apply").click()
            _changed(page, before, "apply suggestion")
            assert page.locator(".tpu-ctl-batch_size input").input_value() == "9"
            assert page.locator(".tpu-ctl-grad_accum input").input_value() == "4"
            assert page.locator(".tpu-verdict").inner_text().startswith("FITS")

            mark("apply")
            # The sharding control (a Combobox: typed, applied on Enter): fsdp over the 8 chips, then a bad mesh.
            before = _state(page)
            _fill(page, "sharding", "fsdp")
            _changed(page, before, "sharding fsdp")
            assert "with fsdp over 8 chips" in page.locator(".tpu-verdict").inner_text()
            assert page.locator(".tpu-sharding").inner_text().startswith("Sharding: sharding='fsdp' (fsdp over 8")
            _fill(page, "sharding", "3x3")
            page.wait_for_selector(".tpu-error :text('3x3')", timeout=20_000)
            _fill(page, "sharding", "data")
            page.wait_for_function("() => !document.querySelector('.tpu-verdict').innerText.includes('STALE')",
                                   timeout=20_000)
            mark("sharding")
            # 1920 px: the same, spread out.
            page.set_viewport_size({"width": 1920, "height": 1080})
            page.wait_for_timeout(500)
            layout_1920 = _check_layout(page, 1920)
            page.locator(".tpu-tuning-panel").scroll_into_view_if_needed()
            page.screenshot(path=str(shots / "panel-1920x1080.png"))
            def rows(layout):
                return len({c["top"] for c in layout["controls"] if c["name"].startswith("tpu-ctl-")})

            assert rows(layout_1920) <= rows(layout_1280), (rows(layout_1920), rows(layout_1280))
            mark("1920")
            (shots / "layout.json").write_text(json.dumps({"1280": layout_1280, "1920": layout_1920}, indent=1))
        finally:
            browser.close()
