"""The Gradio subset that runs on 3.41 (A1111), 4.40 (Forge) and current releases.

Components and events are created through these helpers, which pass only the keyword arguments the
installed Gradio knows, so one layout serves every host. Live updates use gr.Timer when it exists (4.40+)
and a browser-side interval clicking a hidden button otherwise (see `every`); nothing here uses `gr.Box`
or `Component.update()`.
"""
from __future__ import annotations

import inspect
from functools import lru_cache
from typing import Any, Callable

import gradio as gr

GRADIO_VERSION = tuple(int(p) for p in gr.__version__.split(".")[:2] if p.isdigit())


@lru_cache(maxsize=None)
def _known(callable_: Callable) -> frozenset[str]:
    return frozenset(inspect.signature(callable_).parameters)


def make(cls: Callable, **kwargs: Any) -> Any:
    """`cls(**kwargs)` without the arguments this Gradio version does not have (e.g. `info` on 3.x Number).

    Works for any callable with a signature: components, layouts, `blocks.launch`.
    """
    known = _known(cls)
    return cls(**{k: v for k, v in kwargs.items() if k in known})


def listen(event: Callable, fn: Callable, inputs: Any = None, outputs: Any = None, **kwargs: Any) -> Any:
    """`component.event(fn, inputs, outputs, ...)` keeping only the options this version supports."""
    known = _known(event)
    return event(fn, inputs, outputs, **{k: v for k, v in kwargs.items() if k in known})


TICK_ID = "stabletune-tick"
# Clicks the hidden tick button every N ms, once per page (the tab may be rendered twice in a WebUI).
TICK_JS = """() => {
  if (!window.stabletuneTick) {
    window.stabletuneTick = setInterval(() => {
      const root = document.querySelector('gradio-app');
      const button = (root && root.shadowRoot ? root.shadowRoot : document).querySelector('#%s');
      if (button) button.click();
    }, %d);
  }
  return [];
}"""
TICK_CSS = f"#{TICK_ID} {{ display: none !important; }}\n"  # also in style.css


def every(seconds: float, fn: Callable, inputs: Any, outputs: Any, after: Any) -> None:
    """Call `fn` every `seconds` while the page is open, from the moment the event `after` has finished.

    The page's first paint is `after`: a tick before it would send the page's default inputs (no run chosen
    yet), and its late reply could land on top of what the first paint restored (seen: a reload under load
    switched the page back to the newest run and saved that as the browser's choice).

    gr.Timer on Gradio 4.40+, created inactive and switched on by `after`. Before it (A1111's 3.41) not
    `load(every=)`: that runs as a never-ending generator on an open websocket, and the WebUI's "Reload UI"
    (`demo.close()`) then waits for it forever. Instead the browser clicks a hidden button on an interval
    that `after` starts: each tick is a short event.
    """
    if hasattr(gr, "Timer"):
        timer = gr.Timer(seconds, active=False)
        listen(timer.tick, fn, inputs, outputs, show_progress="hidden", queue=True)
        listen(after.then, lambda: gr.Timer(active=True), None, [timer], show_progress="hidden")
        return
    tick = make(gr.Button, value="refresh", elem_id=TICK_ID, elem_classes=[TICK_ID])
    listen(tick.click, fn, inputs, outputs, show_progress="hidden", queue=False)
    listen(after.then, None, None, None, _js=TICK_JS % (TICK_ID, int(seconds * 1000)))


# The route a page loads a local file from (a folder the app allows: the runs folder): /gradio_api/file= since
# Gradio 5, /file= before. Relative, so a WebUI served under a sub-path (or a share link) finds it too.
FILE_ROUTE = "gradio_api/file=" if GRADIO_VERSION >= (5, 0) else "file="


def file_url(path: Any) -> str:
    """The address of a local file for an <img> or a link in gr.HTML."""
    from urllib.parse import quote

    return FILE_ROUTE + quote(str(path))


def unchanged() -> Any:
    """An output value that leaves the component as it is."""
    return gr.update()


def update(**kwargs: Any) -> Any:
    return gr.update(**kwargs)


def user_change(component: Any) -> Callable:
    """The event for a value the user changed (`input`), not one the app set (`change` fires for both)."""
    return getattr(component, "input", None) or component.change
