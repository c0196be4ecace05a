"""Where StableTune keeps what it builds once and reuses (tokenizer files, the toy base, demo data, latents)."""
from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """$STABLETUNE_CACHE, else $XDG_CACHE_HOME/stabletune, else ~/.cache/stabletune."""
    if os.environ.get("STABLETUNE_CACHE"):
        return Path(os.environ["STABLETUNE_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "stabletune"
