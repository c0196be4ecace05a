"""Line-atomic JSONL appends and atomically replaced JSON files."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from ..atomic import write_text_atomic  # noqa: F401  (the UI writes captions with it from here)


def _clean(value: Any) -> Any:
    """JSON has no NaN/Inf: write them as strings so a reader never chokes on a diverged run."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def append_jsonl(path: Path, record: dict[str, Any]) -> None:
    """One os.write of one line with O_APPEND: concurrent readers see whole lines or nothing."""
    line = (json.dumps(_clean(record), separators=(",", ":")) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def write_json_atomic(path: Path, data: dict[str, Any], *, durable: bool = True) -> None:
    write_text_atomic(path, json.dumps(_clean(data), indent=1), durable=durable)


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def read_jsonl(path: Path, offset: int = 0) -> tuple[list[dict[str, Any]], int]:
    """Records from byte `offset` on, and the offset to continue from. A half-written last line is left
    for the next call."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except FileNotFoundError:
        return [], offset
    end = data.rfind(b"\n") + 1
    records = []
    for line in data[:end].splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records, offset + end
