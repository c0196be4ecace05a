"""End to end in a real browser: app.py, demo preset, Start, live loss plot, a sample image, Stop.

Needs Debian's chromium (`apt-get install -y chromium chromium-driver`) and playwright's Python package;
no browser is downloaded. Screenshots of every tab go to test-artifacts/ui/.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

from ui_browser import (ROOT, choose, drawn, fake_live_run, field_value, followed_run, launch_browser, open_tab,
                        require_browser, run_dir_state, serve_app, set_field, settle, shoot, sync_api, tab_open,
                        wait_text, watch_console)
from ui_tools import require

from stabletune_core.runs.jsonfiles import write_json_atomic

# Small run: samples every 10 steps; Stop comes long before step 200.
FORM = {"max_train_steps": "200", "validation_steps": "10", "save_steps": "500"}
ENGINE_WAIT_S = 240  # the engine may share 2 CPU cores with other jobs


@pytest.fixture(autouse=True)
def browser_tools() -> None:
    require_browser()


@pytest.fixture
def app_url(tmp_path: Path):
    yield from serve_app(tmp_path)


def test_charts_stay_drawn_through_new_series_gaps_and_another_run(tmp_path: Path) -> None:
    """Issue 12.1: the Monitor page stays open while a run's series set grows (clip threshold appears once
    the clipper has warmed up), metrics have NaN/Inf gaps, and another (empty, then filling) run is attached."""
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    server = serve_app(tmp_path)
    url, runs = next(server)
    try:
        first = fake_live_run(runs, "first", sleeper.pid)
        for step in range(1, 11):  # no clip threshold yet, no VRAM on CPU
            first.metric(step, loss=1 / step, lr=1e-3, grad_norm=0.5 + step / 100, ram_mb=900 + step)
        with sync_api.sync_playwright() as p:
            browser = launch_browser(p)
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            errors = watch_console(page)
            page.goto(url)
            open_tab(page, "Monitor")
            drawn(page, "grad", {"grad norm"})
            drawn(page, "loss", {"loss", "loss (EMA)"})
            for step in range(11, 21):  # the clipper starts reporting; some steps are non-finite
                bad = step in (13, 17)
                first.metric(step, loss="nan" if bad else 1 / step, lr=1e-3,
                             grad_norm="inf" if bad else 0.5 + step / 100, clip_threshold=0.7, ram_mb=900 + step)
            drawn(page, "grad", {"grad norm", "clip threshold"})
            drawn(page, "loss", {"loss", "loss (EMA)"})
            shoot(page, "charts-1-series-grow")

            second = fake_live_run(runs, "second", sleeper.pid)  # a new run, attached before its first step
            open_tab(page, "Train")
            page.locator("#train-run input").click()
            page.get_by_role("option", name="second", exact=True).click()
            open_tab(page, "Monitor")
            page.wait_for_timeout(2500)
            for step in range(1, 8):
                second.metric(step, loss=2 / step, lr=5e-4, grad_norm=1.0, clip_threshold=2.0, ram_mb=700)
            for name, series in (("loss", {"loss", "loss (EMA)"}), ("lr", {"learning rate"}),
                                 ("grad", {"grad norm", "clip threshold"}), ("memory", {"RAM"})):
                drawn(page, name, series)
            wait_text(page, "#monitor-summary", "7 logged steps", 30)
            shoot(page, "charts-2-second-run")
            browser.close()
        assert not [e for e in errors if "vega" in e.lower() or "1.797" in e or "translate" in e], errors
    finally:
        sleeper.kill()
        sleeper.wait()
        next(server, None)


def test_demo_start_monitor_samples_stop_and_start_again(app_url) -> None:
    url, runs = app_url
    with sync_api.sync_playwright() as p:
        browser = launch_browser(p)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        errors = watch_console(page)
        try:
            page.goto(url)
            open_tab(page, "Model & hyperparameters")
            page.locator("#preset-choice input").click()
            page.get_by_role("option", name="demo", exact=True).click()
            page.locator("#preset-load").click()
            wait_text(page, "#preset-message", "Loaded preset", 180)  # the first call builds the tiny model
            for name, value in FORM.items():
                set_field(page, name, value)
            shoot(page, "2-model")

            open_tab(page, "Dataset")
            page.locator("#dataset-scan").click()
            wait_text(page, "#dataset-counts", "usable images", 120)
            page.locator("#dataset-gallery img").first.wait_for(timeout=30_000)
            shoot(page, "1-dataset")

            open_tab(page, "Train")
            page.locator("#train-start").click()
            wait_text(page, "#train-message", "Started", 60)
            run = runs / "demo"
            assert (run / "config.toml").exists()

            open_tab(page, "Monitor")
            wait_text(page, "#monitor-summary", "logged steps", ENGINE_WAIT_S)
            page.locator("#plot-loss canvas, #plot-loss svg").first.wait_for(timeout=30_000)
            open_tab(page, "Samples")
            page.locator("#samples-gallery img").first.wait_for(timeout=ENGINE_WAIT_S * 1000)
            page.wait_for_timeout(1500)
            shoot(page, "5-samples")
            open_tab(page, "Monitor")
            page.wait_for_timeout(1500)
            shoot(page, "4-monitor")

            open_tab(page, "Train")
            page.locator("#train-stop").click()
            wait_text(page, "#train-message", "Stop requested", 30)
            # Issue 25.4: the status line says so at once (the click answers with it), not minutes later.
            page.locator("#train-status").filter(has_text="Stop").first.wait_for(timeout=5_000)
            deadline = time.time() + ENGINE_WAIT_S
            while run_dir_state(run) not in ("stopped", "finished", "failed") and time.time() < deadline:
                time.sleep(1)
            log = (run / "train.log").read_text() if (run / "train.log").exists() else ""
            assert run_dir_state(run) == "stopped", log[-3000:]
            wait_text(page, "#train-status", "stopped", 30)
            shoot(page, "3-train")

            # Issue 12.1: a second run started with the page open: the charts follow it and stay drawn.
            open_tab(page, "Monitor")
            drawn(page, "loss", {"loss", "loss (EMA)"})
            first_summary = page.locator("#monitor-summary").inner_text()
            open_tab(page, "Train")
            page.locator("#train-start").click()
            wait_text(page, "#train-message", "Started", 60)
            second = runs / "demo-2"
            assert (second / "config.toml").exists()
            open_tab(page, "Monitor")
            page.wait_for_function("(old) => { const t = document.querySelector('#monitor-summary').innerText; "
                                   "return t !== old && t.includes('logged steps'); }", arg=first_summary,
                                   timeout=ENGINE_WAIT_S * 1000)
            for name, series in (("loss", {"loss", "loss (EMA)"}), ("lr", {"learning rate"}), ("memory", {"RAM"})):
                drawn(page, name, series, timeout_s=60)
            shoot(page, "4b-monitor-second-run")
            assert not [e for e in errors if "vega" in e.lower() or "1.797" in e or "translate" in e], errors

            open_tab(page, "Diagnostics")  # refreshed live: no button to click
            page.wait_for_timeout(3000)
            settle(page)
            shoot(page, "6-diagnostics")
            open_tab(page, "Runs")
            page.locator("#runs-refresh").click()
            wait_text(page, "#runs-table", "stopped", 30)
            settle(page)
            shoot(page, "7-runs")
        finally:
            shoot(page, "last")
            browser.close()

    checkpoints = [c for c in (run / "checkpoints").glob("step_*") if (c / "manifest.json").exists()]
    assert checkpoints, "Stop must save a checkpoint"
    assert list((run / "output").glob("*.safetensors")), "Stop must export the LoRA"


QUEUED = {"max_train_steps": "20", "validation_steps": "10", "save_steps": "10", "validation_inference_steps": "10",
          "num_validation_images": "1"}


def test_queue_trains_two_runs_one_after_another_then_a_grid_compares_checkpoints(app_url) -> None:
    """Issue 25.12/25.13 end to end: Try the demo, add the form to the queue twice (the second at another learning
    rate), the two runs train one after another while the page follows the queue, then the Samples tab renders a
    grid of the second run's checkpoints x strengths beside the base image, saved as a PNG in the run."""
    url, runs = app_url
    with sync_api.sync_playwright() as p:
        browser = launch_browser(p)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        errors = watch_console(page)
        try:
            page.goto(url)
            page.locator("#try-demo").click()
            wait_text(page, "#demo-message", "The demo is filled in", 240)  # the first click builds the toy model
            open_tab(page, "Model & hyperparameters")
            for name, value in QUEUED.items():
                set_field(page, name, value)
            open_tab(page, "Train")
            page.locator("#train-enqueue").click()
            wait_text(page, "#train-message", "Queued #1", 120)
            open_tab(page, "Model & hyperparameters")
            set_field(page, "learning_rate", "0.002")
            open_tab(page, "Train")
            page.locator("#train-enqueue").click()
            wait_text(page, "#train-message", "Queued #2", 120)
            shoot(page, "queue-1-added")

            open_tab(page, "Queue")
            wait_text(page, "#queue-table", "running", ENGINE_WAIT_S)
            shoot(page, "queue-2-running")
            wait_text(page, "#queue-status", "Queue: done", 2 * ENGINE_WAIT_S)
            shoot(page, "queue-3-done")
            queue = json.loads((runs / ".queue" / "queue.json").read_text())["entries"]
            assert [(Path(e["run"]).name, e["state"]) for e in queue] == [("demo", "finished"),
                                                                          ("demo-2", "finished")], queue
            assert queue[0]["ended_at"] <= queue[1]["started_at"]  # one after the other, never two at once
            rates = [tomllib.loads((runs / n / "config.toml").read_text())["learning_rate"] for n in ("demo", "demo-2")]
            assert rates == [0.001, 0.002]

            open_tab(page, "Train")  # the page followed the queue on to its second run
            wait_text(page, "#train-status strong", "demo-2", 30)
            open_tab(page, "Samples")
            page.locator("#samples-checkpoints .token").first.wait_for(timeout=30_000)  # the newest one, chosen
            for step in ("step 10", "step 20"):
                # typed and taken with Enter, as a user may (the open list re-renders under a pointer while the page
                # refreshes, and the run's checkpoint choices may arrive a moment after the run is shown)
                deadline = time.monotonic() + 30
                while step not in page.locator("#samples-checkpoints .token").all_inner_texts():
                    assert time.monotonic() < deadline, f"{step} could not be chosen in the checkpoint list"
                    choose(page, "#samples-checkpoints", step)
            assert sorted(page.locator("#samples-checkpoints .token").all_inner_texts()) == ["step 10", "step 20"]
            strengths = page.locator("#samples-strengths textarea, #samples-strengths input").first
            strengths.fill("0, 1")
            strengths.press("Tab")
            page.locator("#samples-render").click()
            wait_text(page, "#samples-grid-message", "Rendering", 30)
            page.locator("#samples-grid img").first.wait_for(timeout=ENGINE_WAIT_S * 1000)
            shoot(page, "queue-4-grid")
        finally:
            shoot(page, "queue-last")
            browser.close()
    made = list((runs / "demo-2" / "grids").glob("*.png"))
    assert len(made) == 1, list((runs / "demo-2" / "grids").iterdir())
    meta = json.loads(made[0].with_suffix(".json").read_text())
    assert meta["state"] == "finished" and meta["checkpoints"] == ["step_000010", "step_000020"]
    assert meta["strengths"] == [0.0, 1.0] and {c["checkpoint"] for c in meta["cells"]} == {None, "step_000010",
                                                                                            "step_000020"}
    assert not [e for e in errors if "vega" in e.lower() or "1.797" in e or "translate" in e], errors


def test_reload_keeps_form_and_tab_and_each_browser_follows_its_own_run(tmp_path: Path) -> None:
    """Issue 12.5: a page reload keeps the form values, the open tab and the followed run; attaching a run
    in one browser does not switch another browser's view (separate browser contexts = separate browsers)."""
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    server = serve_app(tmp_path)
    url, runs = next(server)
    try:
        for name in ("run-a", "run-b"):  # run-b is newer: the default a fresh page follows
            fake_live_run(runs, name, sleeper.pid).metric(1, loss=0.5)
            time.sleep(0.05)
        with sync_api.sync_playwright() as p:
            browser = launch_browser(p)
            first = browser.new_context(viewport={"width": 1400, "height": 1000}).new_page()
            first.goto(url)
            open_tab(first, "Model & hyperparameters")
            first.locator("#field-lora_rank input").first.wait_for(timeout=30_000)  # the tab has rendered
            set_field(first, "lora_rank", "8")
            choose(first, "#field-lr_scheduler", "cosine")
            set_field(first, "output_name", "kept-name")
            open_tab(first, "Runs")
            first.wait_for_timeout(500)
            first.reload()
            first.wait_for_function("() => { const t = [...document.querySelectorAll('[role=tab]')]"
                                    ".find(t => t.innerText.trim() === 'Runs'); "
                                    "return t && t.getAttribute('aria-selected') === 'true'; }", timeout=30_000)
            open_tab(first, "Model & hyperparameters")
            values = {name: field_value(first, name) for name in ("lora_rank", "lr_scheduler", "output_name")}
            assert values == {"lora_rank": "8", "lr_scheduler": "cosine", "output_name": "kept-name"}
            shoot(first, "reload-kept-form")

            second = browser.new_context(viewport={"width": 1400, "height": 1000}).new_page()
            second.goto(url)
            open_tab(second, "Train")
            wait_text(second, "#train-status", "run-b", 30)
            open_tab(first, "Runs")
            first.locator("#runs-refresh").click()  # the runs were made after the page was built
            settle(first)
            choose(first, "#runs-choice", "run-a")
            first.locator("#runs-attach").click()
            open_tab(first, "Train")
            wait_text(first, "#train-status strong", "run-a", 30)
            second.wait_for_timeout(3000)  # several refresh ticks of the second browser
            assert followed_run(second) == "run-b"
            assert not tab_open(second, "Runs")  # the first browser's tab is not the second's

            choose(second, "#train-run", "run-a")
            wait_text(second, "#train-status strong", "run-a", 30)
            choose(first, "#train-run", "run-b")
            wait_text(first, "#train-status strong", "run-b", 30)
            second.wait_for_timeout(3000)
            assert followed_run(second) == "run-a"
            # Every name the status line shows from the reload on: a refresh tick before the saved run was back
            # once showed the newest run (run-b), and its late reply switched the page (and its save) to it.
            second.add_init_script("""window.__followed = []; setInterval(() => {
                const root = document.querySelector('gradio-app');
                const name = (root && root.shadowRoot ? root.shadowRoot : document)
                    .querySelector('#train-status strong');
                if (name && window.__followed.at(-1) !== name.innerText) window.__followed.push(name.innerText);
            }, 20);""")
            second.reload()
            open_tab(second, "Train")
            wait_text(second, "#train-status strong", "run-a", 30)
            second.wait_for_timeout(3000)
            assert followed_run(second) == "run-a"  # the followed run survives a reload too
            shown = second.evaluate("window.__followed")  # before the first paint: the built page's "No run attached."
            assert [name for name in shown if name.startswith("run-")] == ["run-a"], shown
            open_tab(second, "Model & hyperparameters")
            assert field_value(second, "lora_rank") == "16"  # the first browser's form is not the second's
            browser.close()
    finally:
        sleeper.kill()
        sleeper.wait()
        next(server, None)


@pytest.mark.parametrize("gradio", ["current", "3.41"])
def test_the_open_page_keeps_refreshing_on_both_kinds_of_tick(tmp_path: Path, gradio: str) -> None:
    """The live refresh ticks start from the first paint (after the browser's saved choices are back): on Gradio
    4.40+ an inactive gr.Timer switched on, on A1111's 3.41 a browser interval. Once the page shows its run, a
    step the run writes later reaches the status line, which only a tick brings. (Forge's 4.40 runs the Timer
    path too, but app.py cannot serve from .venv-g440 here: its gradio_client 1.2 fails on pydantic 2.11's
    schemas, `argument of type 'bool' is not iterable`; tests/test_ui_build.py checks that build's event order.)"""
    python = {"current": Path(sys.executable), "3.41": ROOT / ".venv-g341" / "bin" / "python"}[gradio]
    require(python.exists(), f"{python} does not exist")
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    server = serve_app(tmp_path, python=str(python))
    url, runs = next(server)
    try:
        run = fake_live_run(runs, "ticking", sleeper.pid)
        with sync_api.sync_playwright() as p:
            browser = launch_browser(p)
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(url)
            if gradio == "3.41":  # no ARIA tab roles there; every tab is drawn at load
                page.locator(".tab-nav button", has_text="Train").first.click()
            else:  # Gradio 4+ draws a tab's contents when it is first opened
                open_tab(page, "Train")
            status = page.locator("#train-status")
            status.filter(has_text="ticking").first.wait_for(state="attached", timeout=60_000)  # the first paint
            assert status.filter(has_text="step 37/100").count() == 0
            written = json.loads(run.paths.status.read_text())
            write_json_atomic(run.paths.status, {**written, "step": 37})
            status.filter(has_text="step 37/100").first.wait_for(state="attached", timeout=30_000)
            browser.close()
    finally:
        next(server, None)
        sleeper.kill()


def test_reload_keeps_form_and_tab_on_gradio_341(tmp_path: Path) -> None:
    """Issue 12.5 on A1111's Gradio 3.41 (no tab events, no ARIA tab roles): the same browser script keeps
    a form value and the open tab across a reload."""
    python = ROOT / ".venv-g341" / "bin" / "python"
    require(python.exists(), f"{python} does not exist")
    real = sys.executable
    sys.executable = str(python)  # serve_app starts app.py with this interpreter
    try:
        server = serve_app(tmp_path)
        url, _ = next(server)
    finally:
        sys.executable = real

    def tab(page, title: str) -> None:
        page.locator(".tab-nav button", has_text=title).first.click()
        page.wait_for_timeout(300)

    try:
        with sync_api.sync_playwright() as p:
            browser = launch_browser(p)
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(url)
            page.locator("#train-status").filter(has_text="No run attached").first.wait_for(state="attached",
                                                                                          timeout=60_000)
            tab(page, "Model & hyperparameters")
            set_field(page, "lora_rank", "8")
            tab(page, "Runs")
            page.wait_for_timeout(500)
            page.reload()
            page.wait_for_function("() => [...document.querySelectorAll('#stabletune-tabs .tab-nav button')]"
                                   ".some(b => b.innerText.trim() === 'Runs' && b.classList.contains('selected'))",
                                   timeout=30_000)
            tab(page, "Model & hyperparameters")
            page.wait_for_function("() => { const i = document.querySelector('#field-lora_rank input'); "
                                   "return i && i.value === '8'; }", timeout=30_000)
            browser.close()
    finally:
        next(server, None)
