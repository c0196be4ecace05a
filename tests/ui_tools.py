"""The tools the UI tests need (Chromium, playwright, the light WebUI-host venvs, a Python 3.10): a missing
one fails the test, since CI (.ci/run) installs them all. Set STABLETUNE_ALLOW_MISSING_UI_TOOLS=1 (CI never
does) to skip such tests on a machine without them."""
from __future__ import annotations

import os

import pytest

ALLOW_MISSING = "STABLETUNE_ALLOW_MISSING_UI_TOOLS"


def require(present: object, what: str) -> None:
    if present:
        return
    message = f"{what} (.ci/run installs it)"
    if os.environ.get(ALLOW_MISSING) == "1":
        pytest.skip(message)
    pytest.fail(f"{message}; set {ALLOW_MISSING}=1 to skip this test on a machine without it.")


def raw_form(ctx, **values) -> list:
    """What the browser sends for the whole form of the UI `ctx`: the defaults as widgets show them, with `values`."""
    from extension.form import display_value

    shown = {n: display_value(f, f["default"]) for n, f in ctx.form.fields.items()}
    shown.update(values)
    return [shown[n] for n in ctx.form.names]
