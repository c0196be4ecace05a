"""What the browser tests share: app.py served on a free port, Debian's Chromium through playwright, and small
steps on the page (open a tab, fill a field, wait for a text, read a chart).

Needs /usr/bin/chromium (`apt-get install -y chromium chromium-driver`) and playwright's Python package; no
browser is downloaded. A missing tool fails the test (ui_tools.require), it never skips in CI.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from stabletune_core.runs.jsonfiles import write_json_atomic
from stabletune_core.runs.writer import RunWriter
from ui_tools import require

CHROMIUM = Path(os.environ.get("STABLETUNE_CHROMIUM", "/usr/bin/chromium"))
ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / "test-artifacts" / "ui"
GROUP_OF = {f["name"]: f["group"] for f in json.loads((ROOT / "extension" / "config_schema.json").read_text())["fields"]}

try:
    from playwright import sync_api
except ImportError:  # reported by require_browser
    sync_api = None


def require_browser() -> None:
    require(sync_api, "playwright's Python package is missing (python install.py --dev)")
    require(CHROMIUM.exists(), f"{CHROMIUM} is missing (apt-get install chromium chromium-driver)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_app(tmp_path: Path, *extra: str, runs: Path | None = None, python: str | None = None):
    """A generator: yields (url, runs folder) once app.py answers; the next `next()` stops it."""
    runs = runs or tmp_path / "runs"
    port = free_port()
    log = open(tmp_path / f"app-{port}.log", "wb")
    process = subprocess.Popen([python or sys.executable, str(ROOT / "app.py"), "--port", str(port), "--runs-dir",
                                str(runs), "--refresh-seconds", "1", *extra], cwd=ROOT, stdout=log,
                               stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/"
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            urllib.request.urlopen(url, timeout=2)
            break
        except OSError:
            assert process.poll() is None, (tmp_path / f"app-{port}.log").read_text()
            time.sleep(0.5)
    yield url, runs
    process.terminate()
    process.wait(20)
    log.close()
    stop_engines(runs)


def stop_engines(runs: Path) -> None:
    """The engine (and a queue worker) outlive the UI by design; a test must not leave one running."""
    for status in runs.glob("*/status.json"):
        try:
            data = json.loads(status.read_text())
        except (OSError, ValueError):
            continue
        if data.get("pid") and data.get("state") not in ("finished", "stopped", "failed"):
            try:
                os.kill(data["pid"], signal.SIGTERM)
            except ProcessLookupError:
                pass


def launch_browser(p):
    return p.chromium.launch(executable_path=str(CHROMIUM), args=[
        "--no-sandbox", "--headless", "--disable-gpu", "--disable-background-networking"])


def watch_console(page) -> list[str]:
    """Errors the page logs (Vega reports a broken chart here, e.g. `translate(0,1.797e308)`)."""
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    return errors


def chart(page, name: str) -> dict:
    """What the Vega plot `name` draws: its line paths, legend entries and axis labels."""
    return page.evaluate("""(name) => {
        const q = (sel) => [...document.querySelectorAll(`#plot-${name} ${sel}`)];
        return {paths: q('g.mark-line path').map(p => p.getAttribute('d') || ''),
                legend: q('.role-legend-label text').map(t => t.textContent),
                labels: q('.role-axis-label text').map(t => t.textContent),
                transforms: q('g').map(g => g.getAttribute('transform') || '').join(' ')};
    }""", name)


def drawn(page, name: str, series: set[str], timeout_s: float = 30) -> dict:
    """Wait until plot `name` draws every one of `series` as a real line on a real axis."""
    deadline = time.time() + timeout_s
    while True:
        seen = chart(page, name)
        ok = (series <= set(seen["legend"]) and sum(len(d) > 20 for d in seen["paths"]) >= len(series)
              and len(set(seen["labels"])) >= 3 and "e+308" not in seen["transforms"]
              and not any("NaN" in d for d in seen["paths"]))
        if ok:
            return seen
        if time.time() > deadline:
            raise AssertionError(f"plot {name} is not drawn with {series}: {seen}")
        page.wait_for_timeout(500)


def shoot(page, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


def open_tab(page, title: str) -> None:
    page.get_by_role("tab", name=title, exact=True).click()
    page.wait_for_timeout(300)


def field_box(page, name: str):
    """The input of a form field, its accordion opened first if it is closed (closed ones are not rendered)."""
    box = page.locator(f"#field-{name} input, #field-{name} textarea").first
    if not box.count() or not box.is_visible():
        page.locator(f"#group-{GROUP_OF[name]} .label-wrap").first.click()
        box.wait_for(state="visible", timeout=5000)
    return box


def set_field(page, name: str, value: str) -> None:
    box = field_box(page, name)
    box.fill(value)
    box.press("Tab")  # blur: Gradio reads the value on change


def field_value(page, name: str) -> str:
    return field_box(page, name).input_value()


def settle(page, timeout_s: float = 30) -> None:
    """Wait until no Gradio component shows its loading overlay (an event has finished)."""
    page.wait_for_timeout(300)
    page.wait_for_function("() => document.querySelectorAll('.pending').length === 0", timeout=timeout_s * 1000)


def wait_text(page, selector: str, text: str, timeout_s: float) -> None:
    page.locator(selector).filter(has_text=text).first.wait_for(timeout=timeout_s * 1000)


def choose(page, selector: str, option: str) -> None:
    """Pick `option` in the Gradio dropdown at `selector` as a user types it: the list filters to it, Enter takes
    it, and the list is closed (Gradio 6 may leave a list open over its input when its tab is shown again, and
    re-render its options under the pointer while the page refreshes)."""
    box = page.locator(f"{selector} input").first
    if box.get_attribute("aria-expanded") == "true":
        box.press("Escape")
    box.click()
    box.fill(option)
    box.press("Enter")  # the first option the typed text leaves (the whole name: that one)
    if box.get_attribute("aria-expanded") == "true":
        box.press("Escape")
    box.press("Tab")


def followed_run(page) -> str:
    """The run named in bold at the head of the Train status line."""
    return page.locator("#train-status strong").first.inner_text()


def tab_open(page, title: str) -> bool:
    return page.get_by_role("tab", name=title, exact=True).get_attribute("aria-selected") == "true"


def run_dir_state(run: Path) -> str:
    try:
        return json.loads((run / "status.json").read_text()).get("state", "")
    except (OSError, ValueError):
        return ""


def fake_live_run(runs: Path, name: str, pid: int) -> RunWriter:
    """A run directory as a live engine leaves it, owned by `pid` (no engine: the charts only read files)."""
    writer = RunWriter(runs / name)
    writer.status("training", step=0, max_steps=100)
    status = json.loads(writer.paths.status.read_text())
    write_json_atomic(writer.paths.status, {**status, "pid": pid})
    return writer
