"""Append what the extension asked of the fake WebUI to FAKE_WEBUI_LOG (one JSON object a line)."""
import json
import os


def record(call: str, **details) -> None:
    path = os.environ.get("FAKE_WEBUI_LOG")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"call": call, **details}, default=str) + "\n")
