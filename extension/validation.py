"""Check config values before any GPU time is spent: pydantic rules and the world (folders, disk).

In-process when stabletune_core.config imports (pydantic 2: the standalone app, Forge); otherwise the
engine's Python answers (`query_cli validate`), which is what an AUTOMATIC1111 host with pydantic 1 needs.
"""
from __future__ import annotations

from typing import Any

from stabletune_core.launch import ask_engine


def validate(values: dict[str, Any], engine_python: str) -> tuple[list[str], list[str]]:
    """(problems, notes): problems block the start; notes (valid but doubtful settings) are only shown."""
    try:
        from stabletune_core.config import ConfigError, build_config, check_inputs
    except ImportError:
        answer = ask_engine(["validate"], engine_python, stdin=values, timeout=120)
        if "error" in answer:
            return [answer["error"]], []
        return list(answer.get("problems", [])), list(answer.get("notes", []))
    try:
        config = build_config(values)
    except ConfigError as exc:
        return exc.problems, []
    return check_inputs(config), config.notes()
