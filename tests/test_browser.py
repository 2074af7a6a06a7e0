"""The step-through widget in a real browser (chapter 03): JupyterLab on a free local port,
headless Debian Chromium driven by Playwright (never a downloaded browser), the notebook
`tests/browser/step_through.ipynb` run from the browser, the slider moved by the kernel and by
the keyboard. Saves `tests/artifacts/step_through.png`. Every wait is bounded; the whole test
takes well under two minutes. Install the browser with `tests/browser/install_chromium.sh`."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

CHROMIUM = "/usr/bin/chromium"
ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "tests" / "browser" / "step_through.ipynb"
ARTIFACT = ROOT / "tests" / "artifacts" / "step_through.png"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]

SETTINGS = {  # user settings: no news or update checks, no kernel dialog
    "@jupyterlab/apputils-extension:notification": {"fetchNews": "false",
                                                    "checkForUpdates": False},
    "@jupyterlab/notebook-extension:tracker": {"autoStartDefaultKernel": True},
}

KERNEL_READY = """() => {
    const kernel = window.jupyterapp.shell.currentWidget?.sessionContext?.session?.kernel;
    return !!kernel && kernel.connectionStatus === 'connected' && kernel.status === 'idle';
}"""
BUDGET_S = 100  # every browser wait together, after the server is up

pytestmark = pytest.mark.browser


def _missing() -> str | None:
    if not os.path.exists(CHROMIUM):
        return f"{CHROMIUM} not found: run tests/browser/install_chromium.sh"
    for module in ("jupyterlab", "playwright.sync_api", "ipywidgets"):
        try:
            __import__(module)
        except ImportError:
            return f"python package {module.split('.')[0]} is not installed"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for_server(url: str, proc: subprocess.Popen, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"JupyterLab exited early with code {proc.returncode}:\n"
                               + log.read_text()[-3000:])
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    raise TimeoutError(f"JupyterLab did not answer {url} within {timeout:.0f} s")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGINT)  # jupyter shuts its kernels down on SIGINT (twice)
    time.sleep(0.3)
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


def _readout(locator) -> str:
    """The slider's readout: a div in ipywidgets 8 (editable), an input in some versions."""
    text = locator.evaluate("e => e.value ?? e.textContent") or ""
    return text.strip()


def test_step_through_renders_in_jupyterlab(tmp_path):
    """In a real JupyterLab, the step-through notebook shows a live slider widget (not its text
    repr) at step 31, and the arrow key moves it to step 32 with the plot redrawn."""
    reason = _missing()
    if reason:
        pytest.skip(reason)
    from playwright.sync_api import sync_playwright

    # a throwaway root (JupyterLab autosaves outputs into the notebook it opens) and settings
    work = tmp_path / "root"
    work.mkdir()
    shutil.copy(NOTEBOOK, work / NOTEBOOK.name)
    settings = tmp_path / "settings"
    for plugin, values in SETTINGS.items():
        package, name = plugin.split(":")
        (settings / package).mkdir(parents=True, exist_ok=True)
        (settings / package / f"{name}.jupyterlab-settings").write_text(json.dumps(values))
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(tmp_path / "config"),
               JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"),
               JUPYTER_DATA_DIR=str(tmp_path / "data"),
               JUPYTERLAB_SETTINGS_DIR=str(settings),
               JUPYTERLAB_WORKSPACES_DIR=str(tmp_path / "workspaces"),
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               MPLBACKEND="Agg")
    port, token = _free_port(), secrets.token_hex(16)
    log_path = tmp_path / "jupyterlab.log"
    log = open(log_path, "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", "--ServerApp.ip=127.0.0.1",
         f"--ServerApp.port={port}", "--ServerApp.port_retries=0",
         f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={work}",
         "--LabApp.expose_app_in_browser=True", "--LabApp.extension_manager=readonly",
         "--ServerApp.terminals_enabled=False"]
        + (["--allow-root"] if os.geteuid() == 0 else []),
        cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + BUDGET_S
    stage = "starting JupyterLab"

    def ms(cap: float) -> float:
        """Milliseconds for the next wait: at most `cap` seconds, never past the deadline."""
        left = deadline - time.monotonic()
        if left <= 1:
            raise TimeoutError(f"browser test ran out of its {BUDGET_S} s while {stage}")
        return 1000 * min(cap, left)

    try:
        _wait_for_server(f"{base}/api/status?token={token}", proc, log_path, timeout=40)
        with sync_playwright() as p:
            stage = "launching chromium"
            browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS,
                                        headless=True, timeout=ms(30))
            page = browser.new_page(viewport={"width": 1400, "height": 1300})
            try:
                stage = "opening the notebook"
                page.goto(f"{base}/lab/tree/{NOTEBOOK.name}?reset&token={token}",
                          wait_until="domcontentloaded", timeout=ms(30))
                page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=ms(45))
                page.wait_for_function("() => window.jupyterapp !== undefined", timeout=ms(15))
                stage = "waiting for the kernel"
                dialog = page.locator(".jp-Dialog .jp-mod-accept")
                while not page.evaluate(KERNEL_READY):
                    if dialog.count():  # a kernel chooser despite the settings: accept it
                        dialog.first.click(timeout=ms(5))
                    page.wait_for_timeout(250)
                    ms(45)
                stage = "running all cells"  # not awaited: the command resolves when done
                page.evaluate("() => { window.jupyterapp.commands"
                              ".execute('notebook:run-all-cells'); }")

                stage = "waiting for the widget"  # a real widget, not "VBox(children=...)"
                slider = page.wait_for_selector(".jupyter-widgets .widget-slider",
                                                timeout=ms(60))
                assert page.locator(".widget-play").count() >= 1
                assert page.locator("text=VBox(children").count() == 0

                stage = "waiting for the kernel to move the slider to 31"
                page.wait_for_selector("text=kernel state: 31", timeout=ms(20))
                page.wait_for_selector("text=step 31: scheduled", timeout=ms(20))
                readout = page.locator(".widget-slider .widget-readout").first
                assert "31" in _readout(readout)

                stage = "moving the slider with the keyboard"
                slider.query_selector(".noUi-handle, [role=slider]").focus()
                page.keyboard.press("ArrowRight")
                page.wait_for_selector("text=step 32: scheduled", timeout=ms(20))
                assert "32" in _readout(readout)
                assert page.locator(".jupyter-widgets img").first.evaluate(
                    "img => img.naturalWidth") > 100
                stage = "saving the screenshot"
                ARTIFACT.parent.mkdir(parents=True, exist_ok=True)
                page.locator(".jp-Notebook").screenshot(path=str(ARTIFACT), timeout=ms(15))
            except Exception as exc:
                failure = ARTIFACT.with_name("step_through_failure.png")
                failure.parent.mkdir(parents=True, exist_ok=True)
                with contextlib.suppress(Exception):
                    page.screenshot(path=str(failure), timeout=5000)
                raise AssertionError(f"browser test failed while {stage} (screenshot: "
                                     f"{failure}): {exc}") from exc
            finally:
                browser.close()
    finally:
        _stop(proc)
        log.close()
    assert ARTIFACT.stat().st_size > 10_000
