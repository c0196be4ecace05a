"""The Gradio subset that runs on 3.41 (A1111), 4.40 (Forge) and current releases.

Components and events are created through these helpers, which pass only the keyword arguments the
installed Gradio knows, so one layout serves every host. Live updates use gr.Timer when it exists and
`load(every=...)` otherwise; nothing here uses `_js`, `gr.Box` or `Component.update()`.
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


def every(blocks: gr.Blocks, seconds: float, fn: Callable, inputs: Any, outputs: Any) -> None:
    """Call `fn` every `seconds` while the page is open (gr.Timer on Gradio 5+, load(every=) before)."""
    if hasattr(gr, "Timer"):
        timer = gr.Timer(seconds)
        listen(timer.tick, fn, inputs, outputs, show_progress="hidden", queue=True)
    else:
        listen(blocks.load, fn, inputs, outputs, every=seconds, show_progress="hidden")


def unchanged() -> Any:
    """An output value that leaves the component as it is."""
    return gr.update()


def update(**kwargs: Any) -> Any:
    return gr.update(**kwargs)


def user_change(component: Any) -> Callable:
    """The event for a value the user changed (`input`), not one the app set (`change` fires for both)."""
    return getattr(component, "input", None) or component.change
