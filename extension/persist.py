"""What one browser keeps across a page reload: the form values, the run it follows and the open tab.

Kept in the browser's localStorage (two browsers never share it; two pages of one browser do, and the
last change wins; the server keeps no per-user state): every form field, the Train tab's run dropdown and the tab selection save themselves there from a
browser-side `change` handler or tab click, with no server round trip. On page load a small script hands
the saved JSON to `restore`, which checks every value against what the form accepts today (a dropdown
choice may be gone, a run deleted) before putting it back, and clicks the saved tab.
"""
from __future__ import annotations

import json
from typing import Any, Callable

import gradio as gr

from .compat import listen, make, unchanged, update
from .context import UIContext
from .form import UNSET

STORAGE_KEY = "stabletune-ui"
TAB_KEY = "__tab__"  # the open tab, beside the field names
RUN_KEY = "__run__"  # the Train tab's run dropdown

# Browser side: store VALUE (a JS expression) under KEY in the saved object.
SAVE_JS = """(ARGS) => {
  try {
    const saved = JSON.parse(localStorage.getItem(STORE) || '{}');
    saved[KEY] = VALUE;
    localStorage.setItem(STORE, JSON.stringify(saved));
  } catch (e) {}
  return [];
}"""
# The open tab is kept by the page itself: a click on one of our tab buttons saves its label, and on load the
# saved one is clicked. (A server-side Tabs update would also work, but any update to Tabs, even an empty
# one, snaps it back to its first tab on Gradio 6, and Gradio 3.41 has no tab event to save with.)
TAB_JS = """() => {
  const STORE = "%s", KEY = "%s", TABS = "#stabletune-tabs";
  const root = () => { const app = document.querySelector('gradio-app');
                       return app && app.shadowRoot ? app.shadowRoot : document; };
  const buttons = (tabs) => [...tabs.querySelectorAll('button')].filter(b =>
      (b.getAttribute('role') === 'tab' || b.parentElement.classList.contains('tab-nav'))
      && b.closest(TABS) === tabs);
  const load = () => { try { return JSON.parse(localStorage.getItem(STORE) || '{}'); } catch (e) { return {}; } };
  let tries = 0;
  const restore = () => {
    const tabs = root().querySelector(TABS);
    if (!tabs) { if (tries++ < 50) setTimeout(restore, 100); return; }
    tabs.addEventListener('click', (event) => {
      const button = event.target.closest && event.target.closest('button');
      if (!button || !buttons(tabs).includes(button)) return;
      const saved = load();
      saved[KEY] = button.innerText.trim();
      try { localStorage.setItem(STORE, JSON.stringify(saved)); } catch (e) {}
    }, true);
    const wanted = load()[KEY];
    const button = buttons(tabs).find(b => b.innerText.trim() === wanted);
    if (button && button.getAttribute('aria-selected') !== 'true') button.click();
  };
  restore();
  return [];
}""" % (STORAGE_KEY, TAB_KEY)
READ_JS = """(ignored) => {
  try { return [localStorage.getItem('%s') || '']; } catch (e) { return ['']; }
}""" % STORAGE_KEY


def _save(args: str, key: str, value: str) -> str:
    return (SAVE_JS.replace("ARGS", args).replace("STORE", json.dumps(STORAGE_KEY)).replace("KEY", json.dumps(key))
            .replace("VALUE", value))


def save_js(key: str) -> str:
    """The handler that stores its input value under `key`."""
    return _save("value", key, "value")


def accepted(field: dict[str, Any], value: Any) -> bool:
    """Does the widget of `field` take `value` as it was saved (what the widget itself showed)?"""
    kind = field["type"]
    if kind == "bool":
        return isinstance(value, bool)
    if kind == "choice":
        return value in ([UNSET] if field["optional"] else []) + list(field["choices"])
    if kind in ("int", "float") and not field["optional"]:
        return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool))
    return isinstance(value, str)


def restore(ctx: UIContext, saved_text: str | None) -> list[Any]:
    """Updates for [every form field, the run dropdown] from the browser's saved JSON; anything
    missing, unreadable or no longer valid is left as the page shows it."""
    try:
        saved = json.loads(saved_text or "{}")
    except ValueError:
        saved = {}
    if not isinstance(saved, dict):
        saved = {}
    fields = [update(value=saved[n]) if n in saved and accepted(ctx.form.fields[n], saved[n]) else unchanged()
              for n in ctx.form.names]
    labels = ctx.run_labels()
    run = saved.get(RUN_KEY)
    run_update = update(choices=labels, value=run) if isinstance(run, str) and run in labels else unchanged()
    return [*fields, run_update]


def wire(blocks: gr.Blocks, ctx: UIContext) -> Callable[..., Any]:
    """Save handlers on every kept component; returns `after_restore(fn, inputs, outputs)`, which runs `fn`
    once the saved values are back (the first paint must read the restored run, not the default)."""
    for name, component in ctx.form.components.items():
        listen(component.change, None, [component], None, js=save_js(name), _js=save_js(name), queue=False)
    run = ctx.parts["train.run"]
    listen(run.change, None, [run], None, js=save_js(RUN_KEY), _js=save_js(RUN_KEY), queue=False)
    listen(blocks.load, None, None, None, js=TAB_JS, _js=TAB_JS, queue=False)
    saved = make(gr.Textbox, value="", visible=False, elem_id="stabletune-saved")
    outputs = [*ctx.form.inputs, run]
    restored = listen(blocks.load, lambda text: restore(ctx, text), [saved], outputs,
                      js=READ_JS, _js=READ_JS, show_progress="hidden")

    def after_restore(fn: Callable[..., Any], inputs: list[Any], outputs_: list[Any]) -> Any:
        return listen(restored.then, fn, inputs, outputs_, show_progress="hidden")

    return after_restore
