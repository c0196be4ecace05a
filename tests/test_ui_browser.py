"""Issue 25 in a real browser (headless Chromium, Gradio 6): number fields that step at their own scale, errors
in the user's words and in red, the Samples rows, the Events table, the Diagnostics titles and the demo on the
first page. One app serves every test here, on a runs folder of prepared runs (the tabs only read files)."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from PIL import Image

from stabletune_core.runs.jsonfiles import append_jsonl
from stabletune_core.runs.writer import RunWriter
from ui_browser import (choose, field_box, launch_browser, open_tab, require_browser, serve_app, set_field, shoot,
                        sync_api, wait_text)

PROMPTS = ["a purple circle on a pale background, drawn with a thick outline", "a purple square",
           "a purple triangle", "a red circle", "a green square"]
LONG_MESSAGE = ("Saved checkpoint at step 50 (every save_steps); " + "the message goes on to say what was kept " * 6
                + "and ends HERE.")


def sample_step(writer: RunWriter, step: int, prompts: list[str], seeds: list[int]) -> None:
    folder = writer.paths.sample_dir(step)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "prompts.json").write_text(json.dumps({"prompts": prompts, "seeds": seeds}))
    for p in range(len(prompts)):
        for seed in seeds:
            Image.new("RGB", (64, 64), (40 * p, 90, step % 256)).save(folder / f"p{p:02d}_s{seed}.png")


def prepared_runs(runs: Path) -> None:
    """'wide': 5 prompts x 2 seeds (10 images a step) at 3 steps, a long event, diagnostics; 'single': one prompt,
    one seed, two steps (made later: the newest run, which a fresh page follows)."""
    wide = RunWriter(runs / "wide")
    wide.status("stopped", step=100, max_steps=100)
    for step in range(1, 101):
        wide.metric(step, loss=1 / step, lr=1e-3, grad_norm=0.5, ram_mb=900)
    for step in (0, 50, 100):
        sample_step(wide, step, PROMPTS, [7, 8])
    wide.event("checkpoint", LONG_MESSAGE, step=50)
    wide.event("stopped", "Run stopped at step 100.", step=100)
    for step in (0, 40, 80, 100, 113):
        for m in range(3):
            append_jsonl(wide.paths.diagnostics / "spectra.jsonl",
                         {"step": step, "module": f"unet.down_blocks.{m}.attentions.0.transformer_blocks.0.attn1.to_q",
                          "singular_values": [3.0, 1.0, 0.1 + step / 1000]})
    for step, value in ((25, 0.5), (50, 0.4), (75, 0.45), (100, 0.47)):
        append_jsonl(wide.paths.diagnostics / "val_loss.jsonl", {"step": step, "val_loss": value})
    time.sleep(0.05)
    single = RunWriter(runs / "single")
    single.status("stopped", step=20, max_steps=20)
    for step in (0, 20):
        sample_step(single, step, ["a purple circle drawn large"], [42])


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory):
    require_browser()
    folder = tmp_path_factory.mktemp("browser")
    prepared_runs(folder / "runs")
    server = serve_app(folder)
    url, runs = next(server)
    with sync_api.sync_playwright() as p:
        browser = launch_browser(p)
        yield url, runs, browser
        browser.close()
    next(server, None)


def painted_page(browser, url: str, width: int):
    """A new browser context's page on the app, once its first paint is done (the newest run is followed): before
    that, choosing a run in the Train tab may find the run picker still empty (seen with a training test beside)."""
    context = browser.new_context(viewport={"width": width, "height": 1000})
    page = context.new_page()
    page.goto(url)
    open_tab(page, "Train")  # Gradio 6 renders a tab's contents when it is first opened
    wait_text(page, "#train-status", "single", 60)
    return context, page


@pytest.fixture
def page(app):
    url, _, browser = app
    context, page = painted_page(browser, url, 1400)
    yield page
    context.close()


def follow(page, run: str) -> None:
    open_tab(page, "Train")
    choose(page, "#train-run", run)
    wait_text(page, "#train-status strong", run, 30)


def test_number_fields_step_at_their_scale_and_a_huge_learning_rate_is_flagged(page) -> None:
    """Issue 25.6: ArrowUp on a learning rate of 0.001 gives 0.00101 (it gave 1), a resolution steps by 8; a
    learning rate of 1 passes the check but gets a warning beside the field and in the message."""
    open_tab(page, "Model & hyperparameters")
    rate = field_box(page, "learning_rate")
    rate.fill("0.001")
    rate.press("ArrowUp")
    assert float(rate.input_value()) == pytest.approx(0.00101), rate.input_value()
    resolution = field_box(page, "resolution")
    resolution.fill("512")
    resolution.press("ArrowUp")
    assert resolution.input_value() == "520"
    set_field(page, "learning_rate", "1")
    page.locator("#check-settings").click()
    wait_text(page, "#settings-problems", "Learning rate 1 is far above", 60)
    assert "learning_rate" not in page.locator("#settings-problems").inner_text()
    field = page.locator("#field-learning_rate")
    assert "stabletune-field-warning" in (field.get_attribute("class") or "")
    assert "far above" in field.locator(".info-text").inner_text()
    shoot(page, "issue25-6-learning-rate-warning")


def test_a_number_box_left_unreadable_says_so_by_its_label_in_red(page) -> None:
    """Issue 25.10 and 25.11 (field errors): letters typed into the learning rate say "Learning rate is empty:
    enter a number" (not "(learning_rate) is None: Input should be a valid number"), in the message and under
    the field, in red, not in the grey of help text."""
    open_tab(page, "Model & hyperparameters")
    rate = field_box(page, "learning_rate")
    rate.fill("")
    rate.press_sequentially("abc")
    rate.press("Tab")
    page.locator("#check-settings").click()
    wait_text(page, "#settings-problems", "Learning rate is empty: enter a number.", 60)
    message = page.locator("#settings-problems").inner_text()
    assert "None" not in message and "Input should" not in message and "learning_rate" not in message
    info = page.locator("#field-learning_rate .info-text")
    assert info.inner_text() == "⚠ Learning rate is empty: enter a number."
    red = info.evaluate("e => getComputedStyle(e).color")
    grey = page.locator("#field-seed .info-text").evaluate("e => getComputedStyle(e).color")
    assert red == "rgb(217, 83, 79)" and grey != red, (red, grey)
    shoot(page, "issue25-10-empty-learning-rate")


def rows_of_images(page) -> list[dict]:
    """Per table row of the Samples tab: its step label, the tops and widths of its images, once every image has
    loaded (until then the rows' layout still moves: tops of one row differed by 350 px under load)."""
    page.wait_for_function("""() => [...document.querySelectorAll('#samples-gallery img')]
                                   .every(i => i.complete && i.naturalWidth > 0)""", timeout=30_000)
    return page.evaluate("""() => [...document.querySelectorAll('#samples-gallery tr')].map(tr => ({
        step: (tr.querySelector('th.step') || {}).innerText || '',
        images: [...tr.querySelectorAll('img')].map(i => { const r = i.getBoundingClientRect();
                                                             return {top: Math.round(r.top), width: r.width}; })
    })).filter(r => r.images.length)""")


def headers(page) -> list[dict]:
    return page.evaluate("""() => [...document.querySelectorAll('#samples-gallery th:not(.step)')].map(th => ({
        text: th.innerText, cut: th.scrollWidth > th.clientWidth + 1 || th.scrollHeight > th.clientHeight + 1}))""")


def test_samples_show_one_row_per_step_with_whole_captions(page) -> None:
    """Issue 25.8: 10 images per step make one row per step (not 8 and 2), each column headed by its whole prompt
    and seed; a single prompt at two steps shows small images, not huge ones, with its caption whole."""
    follow(page, "wide")
    open_tab(page, "Samples")
    page.locator("#samples-gallery img").first.wait_for(timeout=30_000)
    rows = rows_of_images(page)
    assert [r["step"] for r in rows] == ["step 100", "step 50", "step 0"]
    assert all(len(r["images"]) == 10 and len({i["top"] for i in r["images"]}) == 1 for r in rows), rows
    shown = headers(page)
    assert [h["text"] for h in shown][:2] == [f"{PROMPTS[0]} · seed 7", f"{PROMPTS[0]} · seed 8"]
    assert not any(h["cut"] for h in shown), shown
    shoot(page, "issue25-8-samples-wide")

    follow(page, "single")
    open_tab(page, "Samples")
    page.wait_for_function("() => document.querySelectorAll('#samples-gallery img').length === 2", timeout=30_000)
    rows = rows_of_images(page)
    assert [r["step"] for r in rows] == ["step 20", "step 0"]
    assert all(i["width"] <= 160 for r in rows for i in r["images"]), rows
    assert [h["text"] for h in headers(page)] == ["a purple circle drawn large · seed 42"]
    assert not any(h["cut"] for h in headers(page))
    shoot(page, "issue25-8-samples-single")


def test_events_table_keeps_step_on_one_line_and_shows_whole_messages(app) -> None:
    """Issue 25.11: the Events table on a narrow page: "step" is one line (not a letter per line) and a long
    message wraps inside the table, whole (its end is on screen, nothing cut at the right edge)."""
    url, _, browser = app
    context, page = painted_page(browser, url, 900)
    follow(page, "wide")
    open_tab(page, "Monitor")
    page.locator("#monitor-events").filter(has_text="ends HERE").first.wait_for(timeout=30_000)
    cells = page.evaluate("""() => {
        const table = document.querySelector('#monitor-events');
        const right = table.getBoundingClientRect().right;
        const visible = [...table.querySelectorAll('.header-cell, .body-cell')].filter(c => c.offsetHeight > 0);
        const step = visible.find(c => c.innerText.trim() === 'step');
        const message = visible.find(c => c.innerText.includes('ends HERE'));
        const line = parseFloat(getComputedStyle(step).lineHeight) || 20;
        return {stepHeight: step.getBoundingClientRect().height, line,
                messageRight: message.getBoundingClientRect().right, right,
                messageCut: message.scrollWidth > message.clientWidth + 1 || message.scrollHeight > message.clientHeight + 1};
    }""")
    shoot(page, "issue25-11-events")
    context.close()
    assert cells["stepHeight"] < 2.5 * cells["line"], cells  # one line of text plus the cell's padding
    assert cells["messageRight"] <= cells["right"] + 1 and not cells["messageCut"], cells


def test_diagnostics_chart_titles_are_not_covered_by_labels(page) -> None:
    """Issue 25.11: the Diagnostics figures carry their own titles; no Gradio label is drawn over them."""
    follow(page, "wide")
    open_tab(page, "Diagnostics")
    page.locator("#diag-val [data-testid=matplotlib] img").first.wait_for(timeout=30_000)
    covers = page.evaluate("""() => ['#diag-val', '#diag-heatmap', '#diag-rank', '#diag-activations'].flatMap(id =>
        [...document.querySelectorAll(`${id} [data-testid="block-label"]`)]
            .filter(l => l.offsetHeight > 0 && getComputedStyle(l).display !== 'none')
            .map(l => `${id}: ${l.innerText}`))""")
    shoot(page, "issue25-11-diagnostics")
    assert covers == []


def test_first_page_offers_the_demo_and_one_click_fills_it_in(page) -> None:
    """Issue 25.11: a first-time user sees "Try the demo" on the first page; one click fills in the toy model and
    its dataset and opens the Train tab, where Start is."""
    button = page.locator("#try-demo")
    assert button.is_visible() and "Try the demo" in button.inner_text()
    assert "New here?" in page.locator("#demo-message").inner_text()
    button.click()
    wait_text(page, "#demo-message", "The demo is filled in", 240)  # the first click builds the toy model
    page.wait_for_function("() => [...document.querySelectorAll('[role=tab]')].some(t => "
                           "t.innerText.trim() === 'Train' && t.getAttribute('aria-selected') === 'true')",
                           timeout=30_000)
    assert page.locator("#train-start").is_visible()
    open_tab(page, "Model & hyperparameters")
    assert Path(field_box(page, "pretrained_model_name_or_path").input_value(), "model_index.json").is_file()
    open_tab(page, "Dataset")
    assert Path(field_box(page, "train_data_dir").input_value()).is_dir()
